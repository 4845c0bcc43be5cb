"""XLA's decode step: the baseline `tpumk bench` compares the megakernel against, and the
program of a `cpu` artifact over several devices (sharded by tpumk.model.xla_spmd). Its
compiles live in tpumk.decode.xla_compile; it is model code (reference parts only) so that
tpumk.export can ship it.

The XLA step (`xla_decode_step`) is the reference decode step laid out as a serving stack
would lay it out for XLA, with no tpumk kernel:
- weights in the reference layout, one HBM array per matrix per layer, layers unrolled (XLA
  sees and schedules every op of every layer; no loop-carried weight slicing);
- a contiguous KV cache per sequence, head-major `[layers, batch, kv_heads, context, head_dim]`
  (attention's dot contracts the minor dim, so XLA needs no relayout of the cache), updated in
  place (the cache is donated);
- MoE layers gather the routed experts' weights per token (a serving stack does not evaluate
  all experts at decode time);
- MLA models (DeepSeek-V3, Kimi K2) run the absorbed form over a contiguous latent cache
  `[layers, batch, context, kv_lora_rank + qk_rope_head_dim]` (the same rows the megakernel's
  paged cache holds), with tpumk.model.mla's own projection and attention code;
- a hybrid model's linear-attention layers (Gated DeltaNet, KDA) run the reference's own layer
  (`tpumk.model.linear_attention.layer_step`) on a state pool of one slot per sequence (the
  cache holds the attention layers only): at q = 1 without pending rows (the token applied at
  once, as a serving stack keeps its recurrent state), at q > 1 (a verify step) with q pending
  rows, so that it can be rolled back as the megakernel's (`xla_state_args`).
Its numerics match `tpumk.model.reference.decode_step` for in-range positions (tests/test_bench.py),
which is all the bench feeds it: it does not implement the reference's handling of positions
outside the cache (tpumk.model.positions).
"""


from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from tpumk.model import linear_attention, mla
from tpumk.model import reference as ref
from tpumk.model.config import ModelConfig
from tpumk.model.ops import grouped_operands
from tpumk.model.quantize import QuantizedMatrix


# ---------------------------------------------------------------------- the XLA decode step
def xla_cache_shape(cfg: ModelConfig, batch: int, context: int) -> tuple[int, ...]:
    """K (and V) cache of the XLA step: [layers, batch, kv_heads, context, head_dim]. MLA: the
    latent cache `[layers, batch, context, kv_lora_rank + qk_rope_head_dim]` (one row per token,
    shared by all heads, as the megakernel's paged cache holds it). The layers are the attention
    layers (`cfg.kv_layers`: a hybrid's linear layers keep a state instead)."""
    if cfg.is_mla:
        return (cfg.kv_layers, batch, context, cfg.attention.kv_cache_width)
    return (cfg.kv_layers, batch, cfg.num_kv_heads, context, cfg.head_dim)


def xla_cache_shapes(cfg: ModelConfig, batch: int, context: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(K, V) cache shapes of the XLA step; an MLA model's V cache is empty (width 0), as
    `reference.init_cache` keeps it."""
    k = xla_cache_shape(cfg, batch, context)
    return k, (k[:-1] + (0,) if cfg.is_mla else k)


def _attend_head_major(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                       k_valid: jax.Array, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """`tpumk.model.reference.attend` with the cache head-major: q [B,T,Hq,D] f32; k, v [B,Hkv,S,D];
    q_pos [B,T]; k_valid [B,S]; window > 0: a sliding-window layer. Same casts, scaling, masks
    and softmax as the reference (XLA computes every key's score; the mask drops the rest)."""
    group = cfg.num_q_heads // cfg.num_kv_heads
    b, t = q.shape[:2]
    s_len = k.shape[2]
    qg = q.reshape(b, t, cfg.num_kv_heads, group, cfg.head_dim).astype(k.dtype)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) / cfg.attention.score_divisor
    s = ref.soft_cap(s, cfg.attention.attn_softcap)
    k_pos = jnp.arange(s_len, dtype=jnp.int32)
    mask = k_valid[:, None, None, None, :] & (k_pos[None, None, None, None, :] <= q_pos[:, None, None, :, None])
    if window:
        mask = mask & (k_pos[None, None, None, None, :] > q_pos[:, None, None, :, None] - window)
    if sinks is None:
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    else:  # gpt-oss: the sink logits in the denominator, as the reference
        p = ref.masked_softmax(s, mask, sinks.reshape(cfg.num_kv_heads, group))
    o = jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, cfg.attention.q_size)


def _moe_gathered(cfg: ModelConfig, layer: dict, x: jax.Array) -> jax.Array:
    """MoE FFN reading only the routed experts: x [N, H] f32 -> [N, H] f32 (reference routing)."""
    moe = cfg.moe
    ids, weights = ref.route(moe, ref.router_logits(moe, layer, x), layer.get("router_bias"))  # [N, k]
    g = _picked_matmul(x, layer["e_gate"], ids)
    u = _picked_matmul(x, layer["e_up"], ids)
    if moe.expert_bias:  # gpt-oss: each picked expert's biases
        g = g + layer["e_gate_bias"].astype(jnp.float32)[ids]
        u = u + layer["e_up_bias"].astype(jnp.float32)[ids]
    y = _picked_matmul(ref.expert_activation(g, u, moe.swiglu_limit, moe.swiglu_alpha), layer["e_down"], ids)
    if moe.expert_bias:
        y = y + layer["e_down_bias"].astype(jnp.float32)[ids]
    out = jnp.einsum("nkh,nk->nh", y, weights)
    if cfg.moe.num_shared_experts:
        out = out + ref.shared_experts(cfg.moe, layer, x)
    return out


def _picked_matmul(x: jax.Array, w, ids: jax.Array) -> jax.Array:
    """Each row's picked experts only: x [N, K] (or [N, k, K]) @ w[ids] -> [N, k, M] f32, the
    reference's matmul contract (quantized experts: group scales per 128 rows, `reference.matmul`)."""
    xs = "nkc" if x.ndim == 3 else "nc"
    if not isinstance(w, QuantizedMatrix):
        return jnp.einsum(f"{xs},nkcm->nkm", x.astype(w.dtype), w[ids], preferred_element_type=jnp.float32)
    xg, qg = grouped_operands(x, w.q[ids], w)  # codes [N, k, K, M] -> [N, k, G, group, M]
    parts = jnp.einsum(f"{xs[:-1]}gc,nkgcm->nkgm", xg, qg, precision=jax.lax.Precision.HIGHEST)
    y = jnp.sum(parts * w.scale.astype(jnp.float32)[ids], axis=-2)
    return y if w.outer is None else y * jnp.asarray(w.outer, jnp.float32)[ids][..., None]


def xla_decode_step(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                    k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                    states: linear_attention.LinearStates | None = None):
    """One decode step as XLA runs it: tokens / positions [B, q]; caches [L, B, Hkv, ctx, D]
    (L: the attention layers); lengths [B] tokens cached before the step; a hybrid's state pool
    `states` (`xla_state_args`). Returns (logits [B, q, V] f32, k, v, lengths), and the pool
    fifth when one is given."""
    if cfg.linear and states is None:
        raise ValueError(f"xla_decode_step: model '{cfg.name}' has linear-attention layers: pass their state pool "
                         "(xla_state_args)")
    if cfg.is_mla:
        return _xla_mla_step(params, cfg, tokens, positions, k_cache, v_cache, lengths, states)
    b, t = tokens.shape
    ctx = k_cache.shape[3]
    k_pos = jnp.arange(ctx, dtype=jnp.int32)[None, :]
    k_valid = (k_pos < lengths[:, None]) | jnp.any(k_pos[:, :, None] == positions[:, None, :], -1)
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(cfg.num_kv_heads)[None, None, :]
    pi = positions[:, :, None]
    x = ref.embed(params, tokens, cfg.head.embed_scale)
    for i, layer in enumerate(params["layers"]):
        h = ref.sublayer_in(cfg.norms, layer, "attn_norm", x)
        if cfg.pattern.is_linear(i):
            o, states = _linear_layer(cfg, i, layer, h, positions, ctx, states)
        else:
            kl = cfg.pattern.kv_index(i)  # the layer's place in the cache (the attention layers only)
            q, k, v = ref.qkv(cfg, layer, h, positions, i)  # k, v [B, T, Hkv, D]
            k_cache = k_cache.at[kl, bi, hi, pi].set(k)
            v_cache = v_cache.at[kl, bi, hi, pi].set(v)
            o = _attend_head_major(cfg, q, k_cache[kl], v_cache[kl], positions, k_valid, cfg.pattern.window(i),
                                   ref.layer_sinks(cfg, layer))
            o = ref.o_proj(cfg, layer, o, h)  # (h: gated attention's gate input)
        x = x + ref.sublayer_out(cfg.norms, layer, "post_attn_norm", o)
        h = ref.mlp_in(cfg.norms, layer, x, h).reshape(b * t, -1)
        x = x + ref.sublayer_out(cfg.norms, layer, "post_mlp_norm", _ffn(cfg, i, layer, h).reshape(b, t, -1))
    out = ref.logits_from(cfg, params, x), k_cache, v_cache, jnp.maximum(lengths, positions[:, -1] + 1)
    return out if states is None else out + (linear_attention.step_counts(states, t),)


def _linear_layer(cfg: ModelConfig, i: int, layer: dict, h: jax.Array, positions: jax.Array, ctx: int, states):
    """Linear layer i of a hybrid: the reference's layer on the pool -> (out [B, T, H] f32, pool)."""
    live = (positions >= 0) & (positions < ctx)
    return linear_attention.layer_step(cfg.linear, layer, h, live, states, cfg.pattern.linear_index(i),
                                       cfg.norms.rms_eps, ref.jnp_dtype(cfg))


def _ffn(cfg: ModelConfig, i: int, layer: dict, h: jax.Array) -> jax.Array:
    return (ref.gated_mlp(h, layer["w_gate"], layer["w_up"], layer["w_down"], cfg.mlp.mlp_act) if cfg.pattern.is_dense(i)
            else _moe_gathered(cfg, layer, h))


def _xla_mla_step(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                  k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, states=None):
    """`xla_decode_step` of an MLA model, in the absorbed form serving stacks run at decode
    (tpumk.model.mla's projections and latent attention, the reference's own code): the
    contiguous latent cache k_cache [L, B, ctx, C+R] gets the step's rows, every head scores
    them with q_nope @ W_UK | q_rope, W_UV maps the latent output to values (a NoPE layer's
    rows unrotated). v_cache is the empty value cache, passed through. Kimi Linear's KDA layers
    run as the reference's (`_linear_layer`)."""
    b, t = tokens.shape
    ctx = k_cache.shape[2]
    k_pos = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (b, ctx))
    k_valid = (k_pos < lengths[:, None]) | jnp.any(k_pos[:, :, None] == positions[:, None, :], -1)
    bi = jnp.arange(b)[:, None]
    x = ref.embed(params, tokens, cfg.head.embed_scale)
    for i, layer in enumerate(params["layers"]):
        h = ref.sublayer_in(cfg.norms, layer, "attn_norm", x)
        if cfg.pattern.is_linear(i):
            o, states = _linear_layer(cfg, i, layer, h, positions, ctx, states)
            x = x + o
        else:
            kl = cfg.pattern.kv_index(i)
            # row [B, T, C+R] in the cache dtype
            q_nope, q_rope, row = mla.project(cfg, layer, h, positions, cfg.pattern.rotates(i))
            k_cache = k_cache.at[kl, bi, positions].set(row)
            o = mla.attend_latent(cfg, layer, q_nope, q_rope, k_cache[kl], positions, k_pos, k_valid)
            x = x + ref.matmul(o, layer["wo"])
        h = ref.sublayer_in(cfg.norms, layer, "mlp_norm", x).reshape(b * t, -1)
        x = x + _ffn(cfg, i, layer, h).reshape(b, t, -1)
    out = ref.logits_from(cfg, params, x), k_cache, v_cache, jnp.maximum(lengths, positions[:, -1] + 1)
    return out if states is None else out + (linear_attention.step_counts(states, t),)


def paged_to_head_major(cache: ref.KVCache, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """A reference paged cache as the XLA step's contiguous head-major caches (for tests); MLA:
    the latent cache [L, B, ctx, C+R] (the paged rows without their pad lanes) and the empty
    value cache."""
    def one(c):
        b, pps = cache.block_tables.shape
        seq = c[:, cache.block_tables]  # [L, B, pps, page, kv]
        if cfg.is_mla:
            w = min(c.shape[-1], cfg.attention.kv_cache_width)  # (the empty value cache: 0)
            return seq[..., :w].reshape(cfg.kv_layers, b, pps * cache.page_size, w)
        seq = seq.reshape(cfg.kv_layers, b, pps * cache.page_size, cfg.num_kv_heads, cfg.head_dim)
        return seq.transpose(0, 1, 3, 2, 4)
    return one(cache.k), one(cache.v)


def xla_step_specs(cfg: ModelConfig, batch: int, context: int, q_len: int = 1, quant: str = "none") -> tuple:
    """ShapeDtypeStructs of (params, tokens, positions, k_cache, v_cache, lengths); with `quant`
    the streamed matrices are `QuantizedMatrix` specs (the same weights the megakernel reads)."""
    from tpumk.model.quantize import quantized_specs

    from tpumk.model.weights import expected_shapes

    dt = ref.jnp_dtype(cfg)

    def spec(name: str, shape) -> jax.ShapeDtypeStruct:  # norm vectors stay f32 (random_params)
        return jax.ShapeDtypeStruct(tuple(shape), jnp.float32 if name.endswith("norm") else dt)

    shapes = expected_shapes(cfg)
    params = {k: spec(k, v) for k, v in shapes.items() if k != "layers"}
    params["layers"] = [{k: spec(k, v) for k, v in lay.items()} for lay in shapes["layers"]]
    params = quantized_specs(cfg, params, quant)
    i32 = jnp.int32
    tok = jax.ShapeDtypeStruct((batch, q_len), i32)
    k, v = (jax.ShapeDtypeStruct(shape, dt) for shape in xla_cache_shapes(cfg, batch, context))
    return params, tok, tok, k, v, jax.ShapeDtypeStruct((batch,), i32)


def xla_state_args(cfg: ModelConfig, batch: int, q_len: int = 1) -> tuple:
    """The XLA step's arguments after `xla_step_specs`' six: () for a model without linear
    layers; a hybrid's state pool (ShapeDtypeStructs of `LinearStates`): one slot per sequence
    (slot b for sequence b), and q_len pending rows for a verify step (q_len > 1, to be rolled
    back), none for a one-token step (its token applied at once)."""
    if not cfg.linear:
        return ()
    pool = jax.eval_shape(lambda: linear_attention.init_states(cfg, batch, pending=q_len if q_len > 1 else 0,
                                                               seed=None))
    return (pool,)


def xla_step_fn(cfg: ModelConfig) -> Callable:
    """The XLA step as a function of (params, tokens, positions, k_cache, v_cache, lengths) and,
    for a hybrid, its state pool (`xla_state_args`)."""
    return lambda p, t, pos, k, v, n, *states: xla_decode_step(p, cfg, t, pos, k, v, n, *states)


def xla_donated(cfg: ModelConfig) -> tuple[int, ...]:
    """The XLA step's donated arguments: both caches, and a hybrid's state pool (all updated in place)."""
    return (3, 4, 6) if cfg.linear else (3, 4)


def make_xla_step(cfg: ModelConfig):
    """The jitted XLA step with the caches (and a hybrid's pool) donated (updated in place, as in serving)."""
    return jax.jit(xla_step_fn(cfg), donate_argnums=xla_donated(cfg))


class XlaCache(NamedTuple):
    """The XLA step's KV cache as one value (a `cpu` N-device artifact's step takes and returns
    it): k, v [L, B, kv_heads, context, head_dim] (MLA: the latent cache and the empty value
    cache, `xla_cache_shapes`) and lengths [B], the tokens cached per sequence."""
    k: jax.Array
    v: jax.Array
    lengths: jax.Array


def xla_cache_step(cfg: ModelConfig) -> Callable:
    """The XLA step as step(params, tokens, positions, XlaCache) -> (logits [B, q, V] f32,
    XlaCache), the shape of a loaded artifact's step (tpumk.export.artifacts). No state pool:
    a hybrid model is not served this way."""
    def step(params, tokens, positions, cache: XlaCache):
        logits, k, v, lengths = xla_decode_step(params, cfg, tokens, positions, cache.k, cache.v, cache.lengths)
        return logits, XlaCache(k, v, lengths)
    return step


def xla_cache_specs(cfg: ModelConfig, batch: int, context: int, q_len: int = 1, quant: str = "none") -> tuple:
    """ShapeDtypeStructs of `xla_cache_step`'s (params, tokens, positions, XlaCache)."""
    params, tok, pos, k, v, lengths = xla_step_specs(cfg, batch, context, q_len, quant)
    return params, tok, pos, XlaCache(k, v, lengths)
