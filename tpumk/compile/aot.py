"""Ahead-of-time lowering and compilation for a target (deviceless for TPUs without one).

Arguments are given as shapes (`jax.ShapeDtypeStruct`), never as arrays, so full-size models
compile with no weights in memory.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import SingleDeviceSharding

from tpumk.compat import no_persistent_cache_write
from tpumk.errors import CompileError
from tpumk.targets import Target

# An XLA collective instruction in HLO text (`-start` of an async pair; its `-done` not counted).
XLA_COLLECTIVE = re.compile(r"= [^=\n]*\b(?:all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
                            r"|collective-broadcast)(?:-start)?\(")

# Status words of XLA / Mosaic errors, most telling first: the line holding one says why.
_STATUS_WORDS = ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "INTERNAL", "UNIMPLEMENTED", "Mosaic", "error:")


@dataclass
class Compiled:
    compiled: Any  # jax.stages.Compiled
    lower_seconds: float
    compile_seconds: float
    hlo_text: str
    device_kind: str  # the compiled-for device's kind, e.g. "TPU7x" (names static profiles)

    @property
    def custom_calls(self) -> int:
        """Pallas TPU kernels in the compiled program (each is one tpu_custom_call)."""
        return self.hlo_text.count('custom_call_target="tpu_custom_call"')

    @property
    def xla_collectives(self) -> int:
        """Collective ops XLA runs outside the kernels (an async pair counts once): 0 when every
        cross-device exchange happens inside the megakernel."""
        return count_xla_collectives(self.hlo_text)


def count_xla_collectives(hlo_text: str) -> int:
    """Collective ops XLA runs outside any kernel in a compiled program's HLO text (an async
    pair counts once): `Compiled.xla_collectives` for a program kept only as text."""
    return len(XLA_COLLECTIVE.findall(hlo_text))


def place(specs: Any, device) -> Any:
    """Give every ShapeDtypeStruct in a pytree a single-device sharding on `device`."""
    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), specs)


def compile_for(fn: Callable, arg_specs: tuple, target: Target, **jit_kwargs) -> Compiled:
    """jit(fn).lower(*specs).compile() for the target's device (attached or deviceless)."""
    dev = target.device()
    return _compile_lowered(jax.jit(fn, **jit_kwargs), place(arg_specs, dev), target.name, dev.device_kind)


def _compile_lowered(jitted, specs: tuple, what: str, device_kind: str) -> Compiled:
    """Lower and compile, timing each; the compiler's rejection is a CompileError naming `what`."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*specs)
    t1 = time.perf_counter()
    try:
        with no_persistent_cache_write(spec_devices(specs)):
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # the compiler's verdict on this build, not a tpumk bug
        raise CompileError(f"{what}: the compiler rejected this build: {compiler_error_line(e)}") from e
    t2 = time.perf_counter()
    try:
        text = compiled.as_text()
    except jax.errors.JaxRuntimeError as e:  # seen: an MTP drafter's round program on an MLA target
        raise CompileError(f"{what}: compiled, but XLA cannot print the compiled program, so tpumk cannot count "
                           f"its kernels and collectives: {compiler_error_line(e)}") from e
    return Compiled(compiled, t1 - t0, t2 - t1, text, device_kind)


def spec_devices(specs) -> list:
    """The devices the ShapeDtypeStructs of a pytree are placed on."""
    return [d for s in jax.tree.leaves(specs) if getattr(s, "sharding", None) is not None
            for d in s.sharding.device_set]


def compiler_error_line(exc: BaseException) -> str:
    """The line of a compiler error that says what went wrong (XLA errors span many lines)."""
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for word in _STATUS_WORDS:
        for ln in lines:
            if word in ln:
                return ln[:400]
    return lines[0][:400]


def compile_plan(plan) -> Compiled:
    """Compile the megakernel decode step of `plan` for its target (deviceless when not attached)."""
    from tpumk.kernel.megakernel import make_decode_step, step_specs

    # The cache is donated so the cache update (the kernel's in-place K/V writes on one device,
    # `commit_pages` after it on many) writes it in place, as in serving (docs/many-devices.md,
    # "The KV cache copies").
    # compile_for wraps the step in another jit: donate there too, or XLA copies both caches
    # every step (the kernel aliases them in place).
    step = make_decode_step(plan, donate_cache=True, nested=True)
    return compile_program(step, step_specs(plan), plan, donate_argnums=(3,))


def compile_program(fn: Callable, specs: tuple, plan, **jit_kwargs) -> Compiled:
    """Compile `fn` over `specs` for the plan's target: one device (`compile_for`), or many, the
    specs carrying their NamedShardings over the step's mesh (one SPMD program)."""
    if plan.devices == 1:
        return compile_for(fn, specs, plan.target, **jit_kwargs)
    kind = jax.tree.leaves(specs)[0].sharding.mesh.devices.flat[0].device_kind
    return _compile_lowered(jax.jit(fn, **jit_kwargs), specs, f"{plan.target.name} x {plan.devices}", kind)


def compile_for_mesh(fn: Callable, arg_specs: tuple, devices, axis: str = "tp", in_specs: Any = None,
                     out_specs: Any = None) -> Compiled:
    """Compile `fn` (one device's body: a kernel with in-kernel collectives) for a 1-D mesh of
    `devices` (deviceless stand-ins or real devices) along `axis`:
    jit(shard_map(fn, mesh, in_specs, out_specs, check_vma=False)).lower(*specs).compile().

    `arg_specs` are the GLOBAL shapes; each gets the NamedSharding of its in_spec (default: the
    leading dim split over `axis`, P(axis), for every argument and output)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(list(devices)), (axis,))
    spec = PartitionSpec(axis)
    if in_specs is None:
        in_specs = jax.tree.map(lambda _: spec, tuple(arg_specs))
    if out_specs is None:
        out_specs = spec
    specs = jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)),
                         tuple(arg_specs), tuple(in_specs))
    step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False))
    kind = mesh.devices.flat[0].device_kind
    return _compile_lowered(step, specs, f"{kind} x {mesh.size}", kind)


# ---------------------------------------------------------------------- the speculative round program
def round_specs(plan, drafter_spec, settings) -> tuple:
    """ShapeDtypeStructs of run(packed, dparams, tparams, carry), the round program
    (`tpumk.draft.rounds.make_rounds`) for `plan` (the verify step: q = block + 1, the drafter's
    taps): the packed weights and cache as the step takes them (`step_specs`), the drafter's
    weights (`tpumk.draft.weights.abstract_params`) and state, the target's embedding and head,
    the carry's vectors; on many devices everything but the step's own arguments replicated over
    its mesh."""
    import jax.numpy as jnp

    from tpumk.draft.drafter import Drafter
    from tpumk.draft.rounds import Carry
    from tpumk.draft.weights import abstract_params
    from tpumk.kernel.megakernel import step_mesh, step_specs
    from tpumk.model.ops import jnp_dtype

    packed, _, _, cache = step_specs(plan)
    b, model = plan.batch, plan.whole_model
    place = lambda x: x  # noqa: E731
    if plan.devices > 1:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        rep = NamedSharding(step_mesh(plan), P())
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)  # noqa: E731
    dt = jnp_dtype(model)
    tparams = {"embed": jax.ShapeDtypeStruct((model.vocab_size, model.hidden_size), dt)}
    if not model.tie_embeddings:
        tparams["lm_head"] = jax.ShapeDtypeStruct((model.hidden_size, model.vocab_size), dt)
    dparams = abstract_params(drafter_spec)
    dstate = jax.eval_shape(lambda: Drafter(drafter_spec, dparams).init_state(b, plan.context))
    vec = jax.ShapeDtypeStruct((b,), jnp.int32)
    carry = Carry(cache, jax.tree.map(place, dstate), place(vec), place(vec),
                  place(jax.ShapeDtypeStruct((b, settings.steps + settings.block + 1), jnp.int32)),
                  place(vec), place(vec), place(vec), place(jax.eval_shape(lambda: jax.random.PRNGKey(0))))
    return packed, jax.tree.map(place, dparams), jax.tree.map(place, tparams), carry


def round_program(plan, drafter_spec, settings, portable: bool = False) -> Callable:
    """run(packed, dparams, tparams, carry) -> carry: `settings.rounds_per_call` rounds of the
    drafter's passes (its pass kernel where `tpumk.kernel.draft_pass.refusal` allows, else XLA
    operations) and the plan's megakernel verify step with its taps, in one program
    (`portable`: the cpu target's kernel without host callbacks, so the program serializes)."""
    from tpumk.draft.drafter import Drafter
    from tpumk.draft.rounds import make_rounds
    from tpumk.draft.weights import abstract_params
    from tpumk.errors import ConfigError
    from tpumk.kernel.draft_pass import through_kernel
    from tpumk.kernel.megakernel import make_decode_step, step_mesh

    if plan.q_len != settings.block + 1 or plan.taps != tuple(drafter_spec.taps):
        raise ConfigError(f"round program: the verify plan has q_len {plan.q_len} and taps {list(plan.taps)}; the "
                          f"drafter needs q_len {settings.block + 1} and taps {list(drafter_spec.taps)}")
    drafter = Drafter(drafter_spec, abstract_params(drafter_spec))  # its functions read the spec, never the params
    # the drafter's passes: its own Pallas kernel (tpumk.kernel.draft_pass), replicated per device
    drafter = through_kernel(drafter, plan.target, step_mesh(plan) if plan.devices > 1 else None, portable)
    return make_rounds(make_decode_step(plan, nested=True, portable=portable), drafter, settings)


def compile_rounds(plan, drafter_spec, settings, portable: bool = False) -> Compiled:
    """The round program (`round_program`) compiled for the plan's target, deviceless without a
    TPU, on one device or the plan's mesh, the carry (the KV cache in it) donated."""
    program = round_program(plan, drafter_spec, settings, portable)
    try:
        return compile_program(program, round_specs(plan, drafter_spec, settings), plan, donate_argnums=(3,))
    except CompileError as e:  # say which program: the round's, not the plain step
        raise CompileError(f"the round program ({drafter_spec.kind} drafter, verify q = {plan.q_len}): {e}") from None
