"""XLA's SPMD decode step compiled: `compile_xla_spmd` (the multi-device baseline of `tpumk
bench`, deviceless for a TPU target) and what its compiled HLO says. The layout itself (which
tensor splits how over the devices) is tpumk.model.xla_spmd."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.sharding import Mesh

from tpumk.decode.xla_compile import CompiledProgram, compile_placed
from tpumk.errors import CompileError
from tpumk.model.config import ModelConfig
from tpumk.model.xla_spmd import AXIS, SpmdLayout, spmd_layout, xla_spmd_out_shardings, xla_spmd_specs
from tpumk.model.xla_step import xla_donated, xla_step_fn
from tpumk.targets import Target, mesh_devices, topology_for


def spmd_mesh(target: Target, devices: int) -> Mesh:
    """A 1-D mesh "tp" over `tpumk.targets.mesh_devices(target, devices)`, in their order."""
    return Mesh(np.array(mesh_devices(target, devices)), (AXIS,))


@dataclass
class SpmdProgram(CompiledProgram):
    """The compiled SPMD step (`hlo_text` is one device's program, shapes per device)."""

    devices: int = 1
    topology: str | None = None
    expert_parallel: bool = False
    collectives: dict[str, int] = field(default_factory=dict)  # XLA collective ops per step, by kind
    layout: SpmdLayout | None = None

    @property
    def collective_ops(self) -> int:
        return sum(self.collectives.values())


def compile_xla_spmd(cfg: ModelConfig, batch: int, context: int, q_len: int, target: Target, devices: int,
                     expert_parallel: bool = False, quant: str = "none") -> SpmdProgram:
    """The XLA decode step sharded over `devices` devices of `target` (deviceless unless they
    are attached), compiled by XLA's SPMD partitioner; caches donated as in serving."""
    from tpumk.compile.aot import compiler_error_line
    from tpumk.estimate.timeline import program_collectives

    layout = spmd_layout(cfg, devices, expert_parallel)  # refuses bad input before any compile
    mesh = spmd_mesh(target, devices)
    specs = xla_spmd_specs(cfg, batch, context, q_len, mesh, expert_parallel, quant)
    try:
        prog = compile_placed(xla_step_fn(cfg), specs, donate_argnums=xla_donated(cfg),
                              out_shardings=xla_spmd_out_shardings(cfg, mesh, expert_parallel))
    except jax.errors.JaxRuntimeError as e:  # the compiler's verdict on this program, not a tpumk bug
        raise CompileError(f"{target.name}: XLA rejected the {devices}-device SPMD step: {compiler_error_line(e)}") \
            from e
    return SpmdProgram(prog.compiled, prog.lower_seconds, prog.compile_seconds, prog.hlo_text, devices=devices,
                       topology=topology_for(target, devices), expert_parallel=expert_parallel,
                       collectives=program_collectives(target, prog.hlo_text), layout=layout)


def entry_parameter_shapes(hlo_text: str) -> dict[str, tuple[int, ...]]:
    """Shape of every ENTRY parameter of a compiled program by its JAX path (the `op_name`
    metadata XLA keeps, e.g. "p['layers'][0]['wq']"): one device's shapes for an SPMD program."""
    from tpumk.estimate.hlo import parse_hlo

    comps, entry = parse_hlo(hlo_text)
    out = {}
    for i in comps[entry]:
        if i.opcode != "parameter":
            continue
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', i.attrs)
        if m and i.shapes:
            out[m.group(1).replace("\\'", "'")] = i.shapes[0].dims
    return out
