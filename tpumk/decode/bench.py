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

The XLA step (`xla_decode_step`) is the reference decode step laid out as a serving stack
would lay it out for XLA, with no tpumk kernel:
- weights in the reference layout, one HBM array per matrix per layer, layers unrolled (XLA
  sees and schedules every op of every layer; no loop-carried weight slicing);
- a contiguous KV cache per sequence, head-major `[layers, batch, kv_heads, context, head_dim]`
  (attention's dot contracts the minor dim, so XLA needs no relayout of the cache), updated in
  place (the cache is donated);
- MoE layers gather the routed experts' weights per token (a serving stack does not evaluate
  all experts at decode time).
Its numerics match `tpumk.model.reference.decode_step` for in-range positions (tests/test_bench.py),
which is all the bench feeds it: it does not implement the reference's handling of positions
outside the cache (tpumk.model.positions).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.model import reference as ref
from tpumk.model.config import ModelConfig
from tpumk.plan.spec import BuildSpec
from tpumk.targets import Target


# ---------------------------------------------------------------------- the XLA decode step
def xla_cache_shape(cfg: ModelConfig, batch: int, context: int) -> tuple[int, ...]:
    """K (and V) cache of the XLA step: [layers, batch, kv_heads, context, head_dim]."""
    return (cfg.num_layers, batch, cfg.num_kv_heads, context, cfg.head_dim)


def _attend_head_major(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                       k_valid: jax.Array) -> jax.Array:
    """`tpumk.model.reference.attend` with the cache head-major: q [B,T,Hq,D] f32; k, v [B,Hkv,S,D];
    q_pos [B,T]; k_valid [B,S]. Same casts, scaling and softmax as the reference."""
    group = cfg.num_q_heads // cfg.num_kv_heads
    b, t = q.shape[:2]
    s_len = k.shape[2]
    qg = q.reshape(b, t, cfg.num_kv_heads, group, cfg.head_dim).astype(k.dtype)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / np.sqrt(cfg.head_dim)
    k_pos = jnp.arange(s_len, dtype=jnp.int32)
    mask = k_valid[:, None, None, None, :] & (k_pos[None, None, None, None, :] <= q_pos[:, None, None, :, None])
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, cfg.q_size)


def _moe_gathered(cfg: ModelConfig, layer: dict, x: jax.Array) -> jax.Array:
    """MoE FFN reading only the routed experts: x [N, H] f32 -> [N, H] f32 (reference routing)."""
    ids, weights = ref.route(cfg, ref.matmul(x, layer["router"]))  # [N, k]
    dt = layer["e_gate"].dtype
    xe = x.astype(dt)
    g = jnp.einsum("nh,nkhf->nkf", xe, layer["e_gate"][ids], preferred_element_type=jnp.float32)
    u = jnp.einsum("nh,nkhf->nkf", xe, layer["e_up"][ids], preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g) * u).astype(dt)
    y = jnp.einsum("nkf,nkfh->nkh", a, layer["e_down"][ids], preferred_element_type=jnp.float32)
    out = jnp.einsum("nkh,nk->nh", y, weights)
    if cfg.num_shared_experts:
        out = out + ref.swiglu(x, layer["s_gate"], layer["s_up"], layer["s_down"])
    return out


def xla_decode_step(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array):
    """One decode step as XLA runs it: tokens / positions [B, q]; caches [L, B, Hkv, ctx, D];
    lengths [B] tokens cached before the step. Returns (logits [B, q, V] f32, k, v, lengths)."""
    b, t = tokens.shape
    ctx = k_cache.shape[3]
    k_pos = jnp.arange(ctx, dtype=jnp.int32)[None, :]
    k_valid = (k_pos < lengths[:, None]) | jnp.any(k_pos[:, :, None] == positions[:, None, :], -1)
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(cfg.num_kv_heads)[None, None, :]
    pi = positions[:, :, None]
    x = ref.embed(params, tokens)
    for i, layer in enumerate(params["layers"]):
        h = ref.rms_norm(x, layer["attn_norm"], cfg.rms_eps)
        q, k, v = ref.qkv(cfg, layer, h, positions)  # k, v [B, T, Hkv, D]
        k_cache = k_cache.at[i, bi, hi, pi].set(k)
        v_cache = v_cache.at[i, bi, hi, pi].set(v)
        o = _attend_head_major(cfg, q, k_cache[i], v_cache[i], positions, k_valid)
        x = x + ref.matmul(o, layer["wo"])
        h = ref.rms_norm(x, layer["mlp_norm"], cfg.rms_eps).reshape(b * t, -1)
        f = (ref.swiglu(h, layer["w_gate"], layer["w_up"], layer["w_down"]) if cfg.layer_is_dense(i)
             else _moe_gathered(cfg, layer, h))
        x = x + f.reshape(b, t, -1)
    return ref.logits_from(cfg, params, x), k_cache, v_cache, jnp.maximum(lengths, positions[:, -1] + 1)


def paged_to_head_major(cache: ref.KVCache, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """A reference paged cache as the XLA step's contiguous head-major caches (for tests)."""
    def one(c):
        b, pps = cache.block_tables.shape
        seq = c[:, cache.block_tables]  # [L, B, pps, page, kv]
        seq = seq.reshape(cfg.num_layers, b, pps * cache.page_size, cfg.num_kv_heads, cfg.head_dim)
        return seq.transpose(0, 1, 3, 2, 4)
    return one(cache.k), one(cache.v)


def xla_step_specs(cfg: ModelConfig, batch: int, context: int, q_len: int = 1) -> tuple:
    """ShapeDtypeStructs of (params, tokens, positions, k_cache, v_cache, lengths)."""
    from tpumk.model.weights import expected_shapes

    dt = ref.jnp_dtype(cfg)

    def spec(name: str, shape) -> jax.ShapeDtypeStruct:  # norm vectors stay f32 (random_params)
        return jax.ShapeDtypeStruct(tuple(shape), jnp.float32 if name.endswith("norm") else dt)

    shapes = expected_shapes(cfg)
    params = {k: spec(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = [{k: spec(k, v) for k, v in lay.items()} for lay in shapes["layers"]]
    i32 = jnp.int32
    tok = jax.ShapeDtypeStruct((batch, q_len), i32)
    cache = jax.ShapeDtypeStruct(xla_cache_shape(cfg, batch, context), dt)
    return params, tok, tok, cache, cache, jax.ShapeDtypeStruct((batch,), i32)


def make_xla_step(cfg: ModelConfig):
    """The jitted XLA step with the caches donated (updated in place, as in serving)."""
    return jax.jit(lambda p, t, pos, k, v, n: xla_decode_step(p, cfg, t, pos, k, v, n), donate_argnums=(3, 4))


# ---------------------------------------------------------------------- deviceless compiles
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
    with tempfile.TemporaryDirectory(prefix="tpumk-bench-hlo-") as d:
        t0 = time.perf_counter()
        lowered = jax.jit(fn, **jit_kwargs).lower(*specs)
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True,
                                                     "xla_dump_hlo_pass_re": "^$"})
        t2 = time.perf_counter()
        try:
            text = compiled.as_text()
        except Exception:  # noqa: BLE001 - see the docstring; the dump has the same module
            text = _read_dumped_hlo(Path(d))
    return CompiledProgram(compiled, t1 - t0, t2 - t1, text)


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
    cache = ref.init_cache(cfg, plan.batch, plan.context, plan.page_size, num_pages=plan.num_pages)
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
    caches = (jnp.zeros(xla_cache_shape(cfg, batch, context), dt), jnp.zeros(xla_cache_shape(cfg, batch, context), dt))
    step = program.compiled

    def call(kv):
        _, k, v, _ = step(params, tokens, positions, kv[0], kv[1], lengths)
        return k, v

    return measure_seconds(call, caches, warmup, runs)


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


def compare(plan, compiles: Compiles, measured: tuple[dict, dict] | None = None) -> dict[str, Any]:
    """The side-by-side figures from a plan, both compiled programs and, when a TPU was
    attached, both timings ((megakernel, xla) from `measure_seconds`). Without timings the step
    times are tpumk's timeline model of each compiled program, labelled as such."""
    from tpumk.estimate.timeline import megakernel_step, model_source, published_ring_check, xla_step

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
    return {
        "model": cfg.name, "target": target.name, "batch": batch, "context": plan.context, "q_len": q_len,
        "page_size": plan.page_size, "dtype": cfg.dtype, "tuning": plan.tuning.to_dict(),
        "floor_seconds": floor, "floor_source": "plan HBM bytes / chip HBM bandwidth (Pallas chip table)",
        "megakernel": mk.to_dict(), "xla": xs.to_dict(),
        "speedup": x_s / mk_s,
        "tokens_per_second": {
            "megakernel": {"per_sequence": tok / mk_s, "aggregate": batch * tok / mk_s},
            "xla": {"per_sequence": tok / x_s, "aggregate": batch * tok / x_s},
        },
        "layouts": {"megakernel": f"paged KV cache ({plan.page_size}-token pages), weights packed into ring tiles",
                    "xla": "contiguous head-major KV cache, reference weights one array per matrix, layers unrolled, "
                           "routed experts gathered per token"},
        "model_check": published_ring_check(target) if target.name == "tpu7x" else None,
        "model_constants": model_source("timeline model"),
    }


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
              verify_q: int = 8) -> dict[str, Any]:
    """Build both steps for `target` and compare them (see the module doc). `measure` None:
    time on the device when this target's TPU is attached, else use the timeline model.
    `keep_hlo` adds both compiled HLO texts and compile figures under "compiles" (to re-run
    the model offline with `compare`). `verify_q` > 1 (plain steps only) adds the speculative
    verify step's modelled cost under "verify" (see `verify_step`)."""
    from tpumk.build import build
    from tpumk.errors import TargetError

    cfg, target, batch, q_len = spec.model, spec.target, spec.batch, spec.q_len
    if target.interpret:
        raise TargetError("bench: target 'cpu' runs kernels in interpret mode on the host, which says nothing "
                          "about TPU speed; choose a TPU target (v5e, v5p, v6e, tpu7x)")
    attached = target.attached_device() is not None
    measure = attached if measure is None else measure
    if measure and not attached:
        raise TargetError(f"bench: timing needs an attached {target.name}; none is attached")

    b = build(spec, estimate=False)
    plan = b.plan
    xp = compile_program(lambda p, t, pos, k, v, n: xla_decode_step(p, cfg, t, pos, k, v, n),
                         xla_step_specs(cfg, batch, plan.context, q_len), target, donate_argnums=(3, 4))
    cost = xp.compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax returned one dict per module
        cost = cost[0] if cost else {}
    compiles = Compiles(b.compiled.hlo_text, xp.hlo_text, b.compiled.compile_seconds, b.compiled.lower_seconds,
                        xp.compile_seconds, xp.lower_seconds, float(cost.get("bytes accessed", 0.0)))
    measured = None
    if measure:
        from tpumk.model.weights import random_params

        params = random_params(cfg, 0)
        measured = (_measure_megakernel(b, cfg, params, warmup, runs),
                    _measure_xla(xp, cfg, params, batch, plan.context, q_len, warmup, runs))
    out = compare(plan, compiles, measured)
    out["tpu_attached"] = attached
    out["verify"] = verify_step(plan, verify_q) if verify_q > 1 and q_len == 1 else None
    if keep_hlo:
        out["compiles"] = asdict(compiles)
    return out
