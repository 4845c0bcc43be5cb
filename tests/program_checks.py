"""Checks on a compiled decode step's HLO shared by the deviceless-compile tests."""

from __future__ import annotations


def cache_copies(plan, compiled) -> list[str]:
    """The copies in the compiled program as large as one of the kernel's cache operands (one
    device's part): a step that updates its donated cache in place has none. Many devices: XLA
    copies every operand a kernel compiled with collective_id aliases (docs/many-devices.md,
    "The KV cache copies"), which is why such a kernel leaves the cache to `commit_pages`."""
    from tpumk.estimate.timeline import program_ops

    smallest = min(b.nbytes for b in plan.contract.operands if b.source.startswith("cache.") and b.space == "hbm")
    return [f"{op.name}: {op.read_bytes:.0f} bytes" for op in program_ops(plan.target, compiled.hlo_text)[0]
            if op.opcode == "copy" and op.read_bytes >= smallest / 2]  # the HLO pads rows its own way
