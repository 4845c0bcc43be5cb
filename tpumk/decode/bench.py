"""`tpumk bench`: the megakernel decode step side by side with the same step compiled by XLA.

Both programs are built for the same model, shapes and target (deviceless unless that TPU is
attached) and compared on figures that mean the same thing for both:

- compile seconds, measured on this host;
- HBM bytes per step: the plan's accounting for the megakernel (what its DMAs move), XLA's own
  `cost_analysis()` "bytes accessed" for the XLA program; and the HBM floor (bytes the step
  must move / the chip's HBM bandwidth);
- HLO ops the step launches (from the compiled HLO; the megakernel is one `tpu_custom_call`
  plus a few glue ops);
- step time: measured on the device (warm-up, then the median of timed runs) when the TPU is
  attached; otherwise tpumk's timeline model (`tpumk.estimate.timeline`) of each compiled program,
  labelled as a model. The compiler's static profile is never used for this ratio: it is not
  comparable between a Pallas kernel and an XLA program (TPU_FACTS section 3).

The XLA step is `tpumk.model.xla_step.xla_decode_step`: the reference decode step laid out as
a serving stack would lay it out for XLA (that module says how).
The serving-stack column (XLA + jax's ragged paged attention) exists for GQA models only: for
MLA it is refused with one line (`serving_refusal`), since jax ships no paged attention over a
latent cache, and for hybrid models (linear-attention layers), which it has no layer for.

Many devices (`BuildSpec.devices` > 1, `compare_devices`): the N-device megakernel (one SPMD
program, `jax.shard_map` around one `pallas_call`, its all-reduces inside the kernel) beside the
same XLA step compiled by XLA's SPMD partitioner with Megatron-sharded weights
(`tpumk.decode.xla_spmd`, XLA's own collectives). Both step times are tpumk's timeline model of
one device's program, collectives costed by tpumk.estimate.interconnect; every per-step figure
is one device's. The compiler's static profile of the N-device kernel, when libtpu gives one, is
reported as its own column (megakernel only). On-device timing is implemented for one device
only: with devices > 1 the bench always models, and refuses an explicit `measure=True`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tpumk.model import reference as ref
from tpumk.decode.xla_compile import CompiledProgram, compile_program
from tpumk.model.xla_step import xla_cache_shapes, xla_donated, xla_state_args, xla_step_fn, xla_step_specs
from tpumk.model.config import ModelConfig
from tpumk.plan.spec import BuildSpec
from tpumk.targets import Target


# ---------------------------------------------------------------------- timing on a device
def measure_seconds(call: Callable[[Any], Any], state: Any, warmup: int = 3, runs: int = 10) -> dict[str, Any]:
    """Wall time of `state = call(state)` on the device: `warmup` untimed calls (compilation,
    caches), then `runs` timed ones, each waited with block_until_ready. The state is threaded
    through so donated buffers (the KV cache) are always fresh. Returns the median and all runs."""
    if warmup < 0 or runs < 1:
        raise ValueError("measure_seconds: warmup >= 0 and runs >= 1")
    for _ in range(warmup):
        state = jax.block_until_ready(call(state))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        state = jax.block_until_ready(call(state))
        times.append(time.perf_counter() - t0)
    return {"median_seconds": statistics.median(times), "runs_seconds": times, "warmup": warmup}


def _full_context_inputs(batch: int, context: int, q_len: int):
    """Token ids, positions and cached lengths of a step at the full context (as the plan counts)."""
    lengths = jnp.full((batch,), context - q_len, jnp.int32)
    positions = lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    return jnp.zeros((batch, q_len), jnp.int32), positions, lengths


def _measure_megakernel(build, cfg: ModelConfig, params, warmup: int, runs: int) -> dict[str, Any]:
    from tpumk.kernel.layout import pack_weights

    plan = build.plan
    packed = pack_weights(plan, params)
    pool = dict(pending=plan.q_len, num_slots=plan.linear.num_slots) if plan.linear is not None else {}
    cache = ref.init_cache(cfg, plan.batch, plan.context, plan.page_size, num_pages=plan.num_pages,
                           kv_dtype=plan.attention.kv_dtype or None, **pool)
    tokens, positions, lengths = _full_context_inputs(plan.batch, plan.context, plan.q_len)
    cache = cache._replace(lengths=lengths)
    step = build.compiled.compiled

    def call(c):
        return step(packed, tokens, positions, c)[1]._replace(lengths=lengths)  # stay at the full context

    return measure_seconds(call, cache, warmup, runs)


def _measure_xla(program: CompiledProgram, cfg: ModelConfig, params, batch: int, context: int, q_len: int,
                 warmup: int, runs: int) -> dict[str, Any]:
    dt = ref.jnp_dtype(cfg)
    tokens, positions, lengths = _full_context_inputs(batch, context, q_len)
    caches = tuple(jnp.zeros(shape, dt) for shape in xla_cache_shapes(cfg, batch, context))
    pool = tuple(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), xla_state_args(cfg, batch, q_len)))
    if pool:  # slot b for sequence b, as xla_state_args describes it
        pool = (pool[0]._replace(slots=jnp.arange(batch, dtype=jnp.int32)),)
    step = program.compiled

    def call(state):
        _, k, v, _, *pool = step(params, tokens, positions, *state[:2], lengths, *state[2:])
        return (k, v, *pool)

    return measure_seconds(call, caches + pool, warmup, runs)


# ---------------------------------------------------------------------- the benchmark
@dataclass
class BenchSide:
    compile_seconds: float
    lower_seconds: float
    hbm_bytes: float
    hbm_bytes_source: str
    kernels: int
    hlo_ops: int
    step_seconds: float
    step_source: str
    floor_fraction: float
    model: dict[str, Any]  # the timeline model's full result (always given, also when measured)
    measured: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count_ops(target: Target, hlo_text: str) -> tuple[int, int]:
    """(kernels, HLO ops) the program launches: vector/matrix kernels, and those plus scalar ops."""
    from tpumk.estimate.timeline import program_ops

    ops, _ = program_ops(target, hlo_text)
    kernels = sum(int(o.times) for o in ops if o.kind in ("kernel", "custom_kernel"))
    return kernels, kernels + sum(int(o.times) for o in ops if o.kind == "scalar")


@dataclass
class Compiles:
    """What the comparison needs from the two compiles (kept so the model can be re-run)."""

    megakernel_hlo: str
    xla_hlo: str
    megakernel_compile_seconds: float
    megakernel_lower_seconds: float
    xla_compile_seconds: float
    xla_lower_seconds: float
    xla_cost_bytes: float  # XLA cost_analysis() "bytes accessed"
    # the serving-stack step (tpumk.decode.serving): XLA + jax's ragged paged attention; None: not built
    serving_hlo: str | None = None
    serving_compile_seconds: float = 0.0
    serving_lower_seconds: float = 0.0
    serving_cost_bytes: float = 0.0


def compare(plan, compiles: Compiles, measured: tuple[dict, dict] | None = None) -> dict[str, Any]:
    """The side-by-side figures from a plan, both compiled programs and, when a TPU was
    attached, both timings ((megakernel, xla) from `measure_seconds`). Without timings the step
    times are tpumk's timeline model of each compiled program, labelled as such. A plan of
    many devices takes `SpmdCompiles` and no timings (`compare_devices`)."""
    from tpumk.estimate.timeline import megakernel_step, model_source, published_ring_check, xla_step

    if plan.devices > 1:
        if measured is not None:
            raise ValueError("compare: on-device timings are implemented for one device only")
        if not isinstance(compiles, SpmdCompiles):
            raise ValueError(f"compare: a {plan.devices}-device plan needs SpmdCompiles (both SPMD programs)")
        return compare_devices(plan, compiles)

    cfg, target, batch, q_len = plan.cfg, plan.target, plan.batch, plan.q_len
    floor = plan.floor_seconds
    mk_model = xla_step(target, compiles.megakernel_hlo, kernel=megakernel_step(plan), floor_seconds=floor,
                        what="megakernel step (the Pallas kernel walked by its plan, glue ops from the HLO)")
    x_model = xla_step(target, compiles.xla_hlo, floor_seconds=floor, what="XLA step (op by op from its compiled HLO)")
    mk_kernels, mk_ops = _count_ops(target, compiles.megakernel_hlo)
    x_kernels, x_ops = _count_ops(target, compiles.xla_hlo)
    if measured is not None:
        mk_s, x_s = measured[0]["median_seconds"], measured[1]["median_seconds"]
        runs, warm = len(measured[0]["runs_seconds"]), measured[0]["warmup"]
        mk_src = x_src = f"measured on device ({target.name}): median of {runs} runs after {warm} warm-up"
    else:
        mk_s, x_s = mk_model.seconds, x_model.seconds
        mk_src = "MODEL, not measured: " + mk_model.source
        x_src = "MODEL, not measured: " + x_model.source
    mk = BenchSide(compiles.megakernel_compile_seconds, compiles.megakernel_lower_seconds, plan.hbm_bytes,
                   "tpumk plan accounting (KV at the full context, MoE at the expected distinct experts)",
                   mk_kernels, mk_ops, mk_s, mk_src, floor / mk_s, mk_model.to_dict(),
                   measured[0] if measured else None)
    xs = BenchSide(compiles.xla_compile_seconds, compiles.xla_lower_seconds, compiles.xla_cost_bytes,
                   "XLA cost_analysis() 'bytes accessed'", x_kernels, x_ops, x_s, x_src, floor / x_s,
                   x_model.to_dict(), measured[1] if measured else None)
    tok = q_len  # tokens each sequence advances per step
    serving = _serving_side(plan, compiles, measured is not None) if compiles.serving_hlo else None
    out = {
        "model": cfg.name, "target": target.name, "batch": batch, "context": plan.context, "q_len": q_len,
        "page_size": plan.page_size, "dtype": cfg.dtype, "quant": plan.quant, "tuning": plan.tuning.to_dict(),
        "floor_seconds": floor, "floor_source": "plan HBM bytes / chip HBM bandwidth (Pallas chip table)",
        "megakernel": mk.to_dict(), "xla": xs.to_dict(),
        "speedup": x_s / mk_s,
        "tokens_per_second": {
            "megakernel": {"per_sequence": tok / mk_s, "aggregate": batch * tok / mk_s},
            "xla": {"per_sequence": tok / x_s, "aggregate": batch * tok / x_s},
        },
        "layouts": _layouts(plan),
        "model_check": published_ring_check(target) if target.name == "tpu7x" else None,
        "model_constants": model_source("timeline model", target),
    }
    if serving is not None:
        side, blocks = serving
        s_s = side.step_seconds
        out["serving"] = side.to_dict()
        out["serving_blocks"] = blocks
        out["speedup_vs_serving"] = s_s / mk_s
        out["tokens_per_second"]["serving"] = {"per_sequence": tok / s_s, "aggregate": batch * tok / s_s}
        out["layouts"]["serving"] = (f"paged KV cache{' in the model dtype' if plan.attention.kv_dtype else ''}, "
                                     "one [pages, page, 2 x kv_heads, head_dim] array per layer "
                                     f"({plan.page_size}-token pages), new rows written by an XLA scatter, attention "
                                     "by jax's ragged_paged_attention Pallas kernel; dense parts as the XLA step")
    return out


def _layouts(plan) -> dict[str, str]:
    out = _cache_layouts(plan)
    if plan.linear is not None:  # a hybrid's linear layers
        n = plan.linear.num_slots
        out["megakernel"] += (f"; linear layers' state pool ({n} slot{'s' if n != 1 else ''}: state, convolution window "
                              f"and {plan.q_len} pending row(s) each, streamed through VMEM)")
        out["xla"] += ("; linear layers as the reference's (tpumk.model.linear_attention.layer_step) on a state "
                       f"pool of one slot per sequence{' with q_len pending rows' if plan.q_len > 1 else ''}")
    return out


def _cache_layouts(plan) -> dict[str, str]:
    if plan.cfg.is_mla:
        c = plan.cfg
        return {"megakernel": f"paged latent cache ({plan.page_size}-token pages, one {c.kv_lora_rank} + "
                              f"{c.qk_rope_head_dim} row per token), absorbed MLA, weights packed into ring tiles",
                "xla": f"contiguous latent cache ({c.kv_lora_rank} + {c.qk_rope_head_dim} per token), absorbed MLA "
                       "(tpumk.model.mla), reference weights one array per matrix, layers unrolled, routed experts "
                       "gathered per token"}
    kv = plan.attention.kv_dtype
    cache = (f"{kv} KV cache (one packed array: 1-byte codes and scale exponents, {plan.page_size}-token pages)"
             if kv else f"paged KV cache ({plan.page_size}-token pages)")
    return {"megakernel": f"{cache}, weights packed into ring tiles",
            "xla": f"contiguous head-major KV cache{' in the model dtype' if kv else ''}, reference weights one array "
                   "per matrix, layers unrolled, routed experts gathered per token"}


def _serving_side(plan, compiles: Compiles, measured: bool) -> tuple[BenchSide, dict]:
    """The serving-stack column (tpumk.decode.serving): tpumk's timeline model of its compiled
    program, each ragged paged attention call costed by `rpa_call_model`. Never timed on a
    device (not implemented): with a TPU attached it stays MODEL, and says so."""
    from tpumk.decode.serving import describe, rpa_block_sizes, rpa_call_model
    from tpumk.estimate.timeline import xla_step

    cfg, target = plan.cfg, plan.target
    blocks = rpa_block_sizes(target, cfg, plan.batch, plan.q_len, plan.context, plan.page_size)
    call = rpa_call_model(target, cfg, plan.batch, plan.q_len, plan.context, plan.page_size, blocks)
    model = xla_step(target, compiles.serving_hlo, kernel=call, floor_seconds=plan.floor_seconds,
                     what="serving-stack step (XLA ops from its compiled HLO, each ragged paged attention call by "
                          "its DMA structure)")
    kernels, ops = _count_ops(target, compiles.serving_hlo)
    src = ("MODEL, not measured" + (" (on-device timing of this column is not implemented)" if measured else "")
           + ": " + model.source)
    side = BenchSide(compiles.serving_compile_seconds, compiles.serving_lower_seconds, compiles.serving_cost_bytes,
                     "XLA cost_analysis() 'bytes accessed' (the Pallas attention calls not included)", kernels, ops,
                     model.seconds, src, plan.floor_seconds / model.seconds, model.to_dict())
    return side, describe(target, cfg, plan.batch, plan.q_len, plan.context, plan.page_size)


def verify_step(plain, verify_q: int) -> dict[str, Any]:
    """The speculative verify step (q = verify_q per sequence) beside the plain step, by the
    same timeline model (kernel only; no second compile): what one verification costs relative
    to one plain step, hence the mean acceptance length at which speculation breaks even."""
    from tpumk.estimate.timeline import megakernel_step
    from tpumk.errors import PlanError
    from tpumk.plan.plan import make_plan

    out: dict[str, Any] = {"q_len": verify_q, "draft_tokens": verify_q - 1}
    try:
        vp = make_plan(plain.spec.replace(q_len=verify_q))
    except PlanError as e:
        return {**out, "feasible": False, "reason": str(e)}
    mp, mv = megakernel_step(plain), megakernel_step(vp)
    return {**out, "feasible": True, "hbm_bytes": vp.hbm_bytes, "floor_seconds": vp.floor_seconds,
            "vmem_bytes": vp.vmem_total, "kernel_seconds": mv.seconds, "plain_kernel_seconds": mp.seconds,
            "cost_vs_plain": mv.seconds / mp.seconds,
            "source": "MODEL, not measured: the megakernel's timeline model for both (kernel only, no glue ops)"}


def run_bench(spec: BuildSpec, warmup: int = 3, runs: int = 10, measure: bool | None = None, keep_hlo: bool = False,
              verify_q: int = 8, compiler_estimate: bool = True, serving: bool = True) -> dict[str, Any]:
    """Build both steps for `target` and compare them (see the module doc). `measure` None:
    time on the device when this target's TPU is attached, else use the timeline model.
    `keep_hlo` adds both compiled HLO texts and compile figures under "compiles" (to re-run
    the model offline with `compare`). `verify_q` > 1 (plain steps only) adds the speculative
    verify step's modelled cost under "verify" (see `verify_step`). `spec.devices` > 1: see
    `run_bench_devices` (`compiler_estimate` is used only there). `serving`: also build the
    serving-stack step (tpumk.decode.serving: XLA + jax's ragged paged attention) as a third
    column (one device only)."""
    from tpumk.build import build
    from tpumk.errors import TargetError

    cfg, target, batch, q_len = spec.model, spec.target, spec.batch, spec.q_len
    if target.interpret:
        raise TargetError("bench: target 'cpu' runs kernels in interpret mode on the host, which says nothing "
                          "about TPU speed; choose a TPU target (v5e, v5p, v6e, tpu7x)")
    attached = target.attached_device() is not None
    if spec.devices > 1:
        if measure:
            raise TargetError(f"bench: devices = {spec.devices}: on-device timing is implemented for one device "
                              f"only; bench {spec.devices} devices by the model (no timing) or time one device")
        return run_bench_devices(spec, keep_hlo=keep_hlo, verify_q=verify_q, compiler_estimate=compiler_estimate,
                                 attached=attached)
    measure = attached if measure is None else measure
    if measure and not attached:
        raise TargetError(f"bench: timing needs an attached {target.name}; none is attached")

    b = build(spec, estimate=False)
    plan = b.plan
    xp = compile_program(xla_step_fn(cfg), xla_step_specs(cfg, batch, plan.context, q_len, spec.quant)
                         + xla_state_args(cfg, batch, q_len), target, donate_argnums=xla_donated(cfg))
    cost = xp.compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax returned one dict per module
        cost = cost[0] if cost else {}
    compiles = Compiles(b.compiled.hlo_text, xp.hlo_text, b.compiled.compile_seconds, b.compiled.lower_seconds,
                        xp.compile_seconds, xp.lower_seconds, float(cost.get("bytes accessed", 0.0)))
    sp, serving_refused = serving_column(cfg, target, batch, plan.context, plan.page_size, q_len, spec.quant) \
        if serving else (None, None)
    if sp is not None:
        s_cost = sp.compiled.cost_analysis() or {}
        if isinstance(s_cost, list):
            s_cost = s_cost[0] if s_cost else {}
        compiles.serving_hlo, compiles.serving_compile_seconds = sp.hlo_text, sp.compile_seconds
        compiles.serving_lower_seconds = sp.lower_seconds
        compiles.serving_cost_bytes = float(s_cost.get("bytes accessed", 0.0))
    measured = None
    if measure:
        from tpumk.model.quantize import quantize_params
        from tpumk.model.weights import random_params

        params = quantize_params(cfg, random_params(cfg, 0), spec.quant)  # both steps read the same weights
        measured = (_measure_megakernel(b, cfg, params, warmup, runs),
                    _measure_xla(xp, cfg, params, batch, plan.context, q_len, warmup, runs))
    out = compare(plan, compiles, measured)
    out["tpu_attached"] = attached
    if serving_refused:
        out["serving"], out["serving_refused"] = None, serving_refused
    out["verify"] = verify_step(plan, verify_q) if verify_q > 1 and q_len == 1 else None
    if keep_hlo:
        out["compiles"] = asdict(compiles)
    return out


def serving_refusal(cfg: ModelConfig) -> str | None:
    """Why the serving-stack column cannot be built for `cfg` (None: it can). jax's
    ragged_paged_attention (the only paged attention jax ships in
    jax.experimental.pallas.ops.tpu, besides the older paged_attention of the same form)
    attends per-head K and V pages; an MLA model's cache holds one latent row per token
    shared by all heads, which it has no form for, and expanding the latent into per-head
    K / V pages would be a different (much larger) cache than the megakernel's."""
    if cfg.is_mla:
        return ("not built: jax's ragged_paged_attention (jax.experimental.pallas.ops.tpu) attends per-head K/V "
                "pages; it has no form for MLA's latent cache (one c_kv | k_rope row per token) and jax ships no "
                "MLA paged attention kernel")
    if cfg.linear:
        return (f"not built: model '{cfg.name}' has linear-attention layers ({cfg.linear.linear_kind}); the "
                "serving-stack column is XLA around jax's ragged_paged_attention, which computes softmax attention "
                "only, and jax ships no kernel for a linear layer's recurrent state")
    if cfg.attention.attn_sinks:
        return (f"not built: jax's ragged_paged_attention (jax {jax.__version__}) has no attention sinks (gpt-oss's "
                "per-head logit in the softmax denominator)")
    if cfg.head_dim % 128:  # its softmax statistics are 128 lanes wide, broadcast over the head (an assert)
        return (f"not built: jax's ragged_paged_attention (jax {jax.__version__}) needs a head_dim that is a multiple "
                f"of 128 lanes; this model's is {cfg.head_dim}")
    return None


def serving_column(cfg: ModelConfig, target, batch: int, context: int, page_size: int, q_len: int, quant: str):
    """(the compiled serving-stack step, None), or (None, why it is not built): refused up front
    (`serving_refusal`), or rejected by the TPU compiler (jax's ragged paged attention does not
    compile for every head layout: jax 0.10.2's Mosaic refuses 256-wide heads with more than one
    KV head, "The last dim size is not 128 in original base memref"). The megakernel and XLA
    columns do not depend on it."""
    from tpumk.compat import compiler_rejections
    from tpumk.compile.aot import compiler_error_line
    from tpumk.decode.serving import compile_serving_step

    refused = serving_refusal(cfg)
    if refused is not None:
        return None, refused
    try:
        return compile_serving_step(cfg, target, batch, context, page_size, q_len, quant), None
    except compiler_rejections() as e:
        return None, (f"not built: the {target.name} compiler rejected jax's ragged_paged_attention for this model "
                      f"(jax {jax.__version__}): {compiler_error_line(e)}")


# ---------------------------------------------------------------------- many devices
@dataclass
class SpmdCompiles(Compiles):
    """`Compiles` of an N-device bench: each HLO text is ONE device's program of an SPMD step
    (the megakernel's shard_map program; XLA's partitioned program, whose `xla_cost_bytes` are
    one device's too), plus what the comparison reports about them, so `compare` can re-run the
    model without compiling."""

    devices: int = 2
    topology: str | None = None
    xla_expert_parallel: bool = False
    xla_expert_parallel_reason: str = ""
    xla_layout_notes: list[str] = field(default_factory=list)  # what XLA's layout does not split N ways
    estimate: dict[str, Any] | None = None  # the megakernel's static profile (asdict(Estimate)); None: not run


def xla_expert_parallel(plan) -> tuple[bool, str]:
    """The MoE split of the XLA SPMD baseline for `plan` (tpumk.model.xla_spmd knows two:
    expert-tensor and expert parallel), and why: the plan's own when it is one of the two."""
    s, n = plan.sharding, plan.devices
    if not plan.whole_model.is_moe:
        return False, "dense model (no experts)"
    if s.expert_parallel == n:
        return True, f"expert parallel, as the megakernel's plan (each device owns {s.experts} experts)"
    if s.expert_parallel == 1:
        return False, "expert-tensor parallel, as the megakernel's plan (every expert's width split over the devices)"
    # The XLA step has no mixed form. Its expert-parallel form moves the gathered expert weights
    # between devices (an all-reduce of masked gathers); expert-tensor moves only the partial sums.
    return False, (f"expert-tensor parallel (every expert's width split {n} ways): the megakernel's plan mixes "
                   f"{s.expert_parallel} expert groups x {s.expert_tensor}-way width, which the XLA step has no form "
                   "for; of its two forms expert-tensor is the cheaper one for XLA (its expert-parallel form "
                   "all-reduces the gathered expert weights every layer)")


def run_bench_devices(spec: BuildSpec, keep_hlo: bool = False, verify_q: int = 8, compiler_estimate: bool = True,
                      attached: bool = False) -> dict[str, Any]:
    """`run_bench` for `spec.devices` > 1: plan (a split the model does not allow is refused
    here, before any compile), compile the N-device megakernel and the XLA SPMD step for the
    same devices, batch, context and q_len, and with `compiler_estimate` (targets with a static
    profile) profile the megakernel in a separate process; then `compare_devices`."""
    from tpumk.build import build
    from tpumk.decode.xla_spmd import compile_xla_spmd
    from tpumk.estimate.profiler import estimate_in_subprocess
    from tpumk.targets import topology_for

    b = build(spec, estimate=False)
    plan = b.plan
    ep, why = xla_expert_parallel(plan)
    xp = compile_xla_spmd(plan.whole_model, plan.batch, plan.context, plan.q_len, plan.target, plan.devices, ep,
                          plan.quant)
    cost = xp.compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    est = estimate_in_subprocess(spec) if compiler_estimate and spec.target.static_profile else None
    compiles = SpmdCompiles(b.compiled.hlo_text, xp.hlo_text, b.compiled.compile_seconds, b.compiled.lower_seconds,
                            xp.compile_seconds, xp.lower_seconds, float(cost.get("bytes accessed", 0.0)),
                            devices=plan.devices, topology=topology_for(plan.target, plan.devices),
                            xla_expert_parallel=ep, xla_expert_parallel_reason=why,
                            xla_layout_notes=list(xp.layout.notes) if xp.layout is not None else [],
                            estimate=asdict(est) if est is not None else None)
    out = compare(plan, compiles)
    out["tpu_attached"] = attached
    if attached:
        out["notes"].append("a TPU is attached, but on-device timing is implemented for one device only: both step "
                            "times are the model")
    out["verify"] = verify_step(plan, verify_q) if verify_q > 1 and plan.q_len == 1 else None
    if keep_hlo:
        out["compiles"] = asdict(compiles)
    return out


FLOOR_WITH_COLLECTIVES = (
    "(HBM floor + this program's modelled collective seconds) / its modelled step: the fraction of the step "
    "that is either the floor's HBM traffic or the all-reduce waits the model charges, i.e. how close the step "
    "comes to a device that streams at the HBM floor and then waits out its collectives with nothing to overlap. "
    "A yardstick, not a bound: the model lets the weight ring keep loading during the waits")


def _estimate_column(plan, est: dict | None) -> dict[str, Any]:
    """The TPU compiler's static profile of the N-device kernel, as `tpumk build` converts it."""
    from tpumk.estimate.compiler import convert_estimate
    from tpumk.estimate.profiler import Estimate

    e = convert_estimate(plan, Estimate(**est) if est is not None else None)
    secs, floor = e["estimated_seconds"], plan.floor_seconds
    notes = list(e["notes"])
    if secs is not None:
        notes.append("what the compiler charges for the kernel's remote DMAs and semaphore waits is not known "
                     "(TPU_FACTS 8); not comparable with the XLA column (TPU_FACTS 3), so never used for the ratio")
        if secs < floor:
            notes.append(f"INVALID ESTIMATE: {secs * 1e6:.1f} us is faster than the HBM floor {floor * 1e6:.1f} us; "
                         "do not use it as a result")
    return {"step_seconds": secs, "floor_fraction": floor / secs if secs else None,
            "estimated_cycles": e["estimated_cycles"], "compiler_cycles": e["compiler_cycles"],
            "nested_loop_cycles": e["nested_loop_cycles"], "source": e["estimate_source"],
            "error": est.get("error") if est else None, "notes": notes}


def compare_devices(plan, compiles: SpmdCompiles) -> dict[str, Any]:
    """The N-device side-by-side (see the module doc): both step times by the timeline model
    of one device's compiled program (`xla_step(..., devices=N)`; the megakernel's Pallas kernel
    walked by `megakernel_step(plan)`, its in-kernel all-reduces included), the same per-device
    HBM floor for both, kernels and XLA collective ops from each HLO, interconnect bytes one
    device sends, and the compiler's static profile of the kernel as its own column."""
    from tpumk.compile.aot import count_xla_collectives
    from tpumk.estimate.interconnect import model_source as link_source
    from tpumk.estimate.interconnect import published_collective_check
    from tpumk.estimate.timeline import (collective_op_cost, megakernel_step, model_source, program_collectives,
                                         program_ops, published_ring_check, xla_step)

    cfg, target, batch, q_len, n = plan.whole_model, plan.target, plan.batch, plan.q_len, plan.devices
    floor = plan.floor_seconds
    kernel = megakernel_step(plan)
    mk_model = xla_step(target, compiles.megakernel_hlo, kernel=kernel, floor_seconds=floor, devices=n,
                        what=f"{n}-device megakernel step (one device's program: the Pallas kernel walked by its plan, "
                             "in-kernel all-reduces by the interconnect model, glue ops from the HLO)")
    x_model = xla_step(target, compiles.xla_hlo, floor_seconds=floor, devices=n,
                       what=f"{n}-device XLA SPMD step (one device's program op by op from its compiled HLO, XLA's "
                            "collectives by the interconnect model)")
    x_ops, _ = program_ops(target, compiles.xla_hlo)
    x_send = sum(collective_op_cost(target, o, n)["send_bytes"] * o.times for o in x_ops if o.kind == "collective")
    mk_coll = kernel.stages.get("collectives", {}).get("seconds", 0.0)
    x_coll = x_model.stages.get("collectives", {}).get("seconds", 0.0)

    def side(compile_s, lower_s, hbm, hbm_src, hlo, model, coll_s, send, send_src) -> dict[str, Any]:
        kernels, ops = _count_ops(target, hlo)
        s = model.seconds
        d = BenchSide(compile_s, lower_s, hbm, hbm_src, kernels, ops, s, "MODEL, not measured: " + model.source,
                      floor / s, model.to_dict()).to_dict()
        d.update({"pallas_kernels": hlo.count('custom_call_target="tpu_custom_call"'),
                  "xla_collectives": count_xla_collectives(hlo),
                  "xla_collectives_by_kind": program_collectives(target, hlo),
                  "interconnect_bytes": send, "interconnect_bytes_source": send_src,
                  "collectives_seconds": coll_s, "floor_with_collectives_seconds": floor + coll_s,
                  "floor_with_collectives_fraction": (floor + coll_s) / s})
        return d

    mk = side(compiles.megakernel_compile_seconds, compiles.megakernel_lower_seconds, plan.hbm_bytes,
              "tpumk plan accounting, one device (KV at the full context, MoE at the expected distinct experts)",
              compiles.megakernel_hlo, mk_model, mk_coll, plan.interconnect_bytes,
              "tpumk plan accounting: the in-kernel collectives' remote-DMA bytes one device sends per step")
    mk["in_kernel_collectives"] = plan.collectives_per_step
    mk["collectives_floor_seconds"] = kernel.collectives_floor_seconds
    mk["all_reduce"] = {"schedule": plan.all_reduce.schedule, "slot": [plan.all_reduce.rows, plan.all_reduce.width],
                        "dtype": plan.all_reduce.dtype}
    xs = side(compiles.xla_compile_seconds, compiles.xla_lower_seconds, compiles.xla_cost_bytes,
              "XLA cost_analysis() 'bytes accessed' of the partitioned program (one device's)",
              compiles.xla_hlo, x_model, x_coll, x_send,
              "tpumk interconnect model: bytes one device sends for XLA's collective ops under the algorithm the "
              "model picks for each (collective_op_seconds), operands read from the HLO")
    xs["expert_parallel"] = compiles.xla_expert_parallel
    mk_s, x_s = mk["step_seconds"], xs["step_seconds"]
    tok = q_len
    notes = []
    if mk["xla_collectives"]:
        notes.append(f"the megakernel program holds {mk['xla_collectives']} XLA collective op(s) outside the kernel "
                     "(the aim is 0)")
    copies = mk_model.stages.get("copies", {}).get("seconds", 0.0)
    if copies > 0.01 * mk_s:  # a whole-buffer copy in the glue is the model's to charge, and the reader's to see
        notes.append(f"the megakernel program's glue copies {mk_model.stages['copies']['hbm_bytes'] / 1e9:.3f} GB "
                     f"per step outside the kernel ({copies * 1e6:.1f} us of the modelled step)")
    link = link_source("collectives", target)
    return {
        "model": cfg.name, "target": target.name, "devices": n, "topology": compiles.topology, "batch": batch,
        "context": plan.context, "q_len": q_len, "page_size": plan.page_size, "dtype": cfg.dtype,
        "tuning": plan.tuning.to_dict(),
        "floor_seconds": floor,
        "floor_source": "plan HBM bytes of one device / chip HBM bandwidth (Pallas chip table)",
        "megakernel": mk, "xla": xs, "compiler_estimate": _estimate_column(plan, compiles.estimate),
        "speedup": x_s / mk_s,
        "tokens_per_second": {
            "megakernel": {"per_sequence": tok / mk_s, "aggregate": batch * tok / mk_s},
            "xla": {"per_sequence": tok / x_s, "aggregate": batch * tok / x_s},
        },
        "sharding": plan.sharding.summary(cfg),
        "xla_sharding": {"expert_parallel": compiles.xla_expert_parallel, "why": compiles.xla_expert_parallel_reason,
                         "notes": list(compiles.xla_layout_notes),
                         "source": "tpumk.model.xla_spmd.spmd_layout (Megatron-style; XLA's SPMD partitioner "
                                   "inserts the collectives)"},
        "layouts": {"megakernel": (f"paged latent cache ({plan.page_size}-token pages, replicated on every device)"
                                   if cfg.is_mla else
                                   f"paged {plan.attention.kv_dtype + ' ' if plan.attention.kv_dtype else ''}KV cache "
                                   f"({plan.page_size}-token pages, KV heads split over the devices)")
                                  + ", weights packed per device into ring tiles, all-reduces inside the kernel",
                    "xla": ("contiguous latent cache replicated on every device" if cfg.is_mla else
                            "contiguous head-major KV cache") + ", reference weights one array per matrix sharded "
                           "Megatron-style, layers unrolled, routed experts gathered per token, XLA's collectives"},
        "model_check": published_ring_check(target) if target.name == "tpu7x" else None,
        "collective_check": published_collective_check(target) if target.name == "tpu7x" else None,
        "model_constants": model_source("timeline model", target),
        "interconnect_constants": link,
        "sources": {
            "compile_seconds": "measured on this host",
            "floor_seconds": "tpumk plan accounting: one device's HBM bytes per step / the chip's HBM bandwidth",
            "hbm_bytes": {"megakernel": mk["hbm_bytes_source"], "xla": xs["hbm_bytes_source"]},
            "step_seconds": {"megakernel": mk["step_source"], "xla": xs["step_source"]},
            "collectives_seconds": ("MODEL, not measured: the timeline model's 'collectives' stage (the megakernel's "
                                    "in-kernel all-reduce waits; XLA's collective ops, charged in full), " + link),
            "collectives_floor_seconds": ("MODEL, not measured: the least the megakernel's in-kernel collectives could "
                                          "take with any schedule and wire (tpumk.estimate.timeline."
                                          "collectives_floor_seconds), " + link),
            "interconnect_bytes": {"megakernel": mk["interconnect_bytes_source"],
                                   "xla": xs["interconnect_bytes_source"]},
            "kernels": "the compiled HLO of one device's program (tpumk.estimate.timeline.program_ops; pallas_kernels: "
                       "its tpu_custom_calls)",
            "xla_collectives": "the compiled HLO (tpumk.compile.aot.XLA_COLLECTIVE; an async pair counts once); "
                               "by kind: tpumk.estimate.timeline.program_collectives",
            "floor_with_collectives_fraction": FLOOR_WITH_COLLECTIVES,
            "speedup": "XLA SPMD step / megakernel step, both the timeline model (the same measure for both)",
            "compiler_estimate": "the TPU compiler's static profile of the megakernel only (see its source)",
        },
        "notes": notes,
    }
