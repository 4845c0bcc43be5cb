"""Deviceless compiles of XLA's programs: the XLA decode step (tpumk.model.xla_step), the
serving step and the SPMD step, keeping the compiled HLO text (`tpumk bench` reads it)."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax

from tpumk.targets import Target


@dataclass
class CompiledProgram:
    compiled: Any  # jax.stages.Compiled
    lower_seconds: float
    compile_seconds: float
    hlo_text: str  # the compiled (post-optimization) HLO


def _read_dumped_hlo(dump_dir: Path) -> str:
    """The post-codegen HLO XLA dumped for the one module it compiled."""
    files = sorted(dump_dir.glob("*after_codegen.txt")) or sorted(dump_dir.glob("*after_optimizations.txt"))
    if not files:
        raise RuntimeError(f"XLA wrote no post-optimization HLO under {dump_dir}")
    return files[-1].read_text()


def compile_program(fn: Callable, arg_specs: tuple, target: Target, **jit_kwargs) -> CompiledProgram:
    """jit(fn).lower(*specs).compile() for the target's device, keeping the compiled HLO text."""
    from tpumk.compile.aot import place

    return compile_placed(fn, place(arg_specs, target.device()), **jit_kwargs)


def compile_placed(fn: Callable, specs: tuple, **jit_kwargs) -> CompiledProgram:
    """jit(fn).lower(*specs).compile() for specs that already carry their shardings (one
    device, or a mesh of them), keeping the compiled HLO text.

    `Compiled.as_text()` fails on some XLA TPU programs (jax 0.10.2: an async-update
    instruction's proto does not round-trip), so the HLO is also dumped by XLA itself and read
    back when as_text() fails. The dump does not change the executable."""
    from tpumk.compat import no_persistent_cache_write
    from tpumk.compile.aot import spec_devices

    with tempfile.TemporaryDirectory(prefix="tpumk-bench-hlo-") as d:
        t0 = time.perf_counter()
        lowered = jax.jit(fn, **jit_kwargs).lower(*specs)
        t1 = time.perf_counter()
        with no_persistent_cache_write(spec_devices(specs)):
            compiled = lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True,
                                                         "xla_dump_hlo_pass_re": "^$"})
        t2 = time.perf_counter()
        try:
            text = compiled.as_text()
        except Exception:  # noqa: BLE001 - see the docstring; the dump has the same module
            text = _read_dumped_hlo(Path(d))
    return CompiledProgram(compiled, t1 - t0, t2 - t1, text)
