"""The pure-JAX reference model: the oracle every kernel is checked against.

Numerics, which the megakernel follows exactly:
- the residual stream, norms, RoPE, softmax and router run in float32;
- every matrix product casts its activation input to the weight dtype and accumulates in
  float32 (`preferred_element_type=float32`), as the MXU does;
- the KV cache holds keys (after QK-norm and RoPE) and values in the model dtype, or, in a
  `QuantizedKVCache` (`--kv-dtype fp8 | int8`), as 1-byte codes with one power-of-two scale per
  (token, kv head), read back in float32 and rounded to the model dtype (`tpumk.model.kv_quant`,
  whose `PagedLayout` packs a page's codes and scale exponents into one array).

Paged KV cache layout (shared with the kernel, so caches compare element for element):
- `k`, `v`: `[num_layers, num_pages, page_size, num_kv_heads * head_dim]`;
- `block_tables`: `[batch, pages_per_seq]` int32, page ids of each sequence in order;
- `lengths`: `[batch]` int32, tokens already cached per sequence.
An MLA model (DeepSeek-V3, Kimi K2; its attention in `tpumk.model.mla`, the matrix-product
contract in `tpumk.model.ops`) caches one latent row per token in `k`
(`[..., kv_lora_rank + qk_rope_head_dim]`) and nothing in `v` (`[..., 0]`).
A step with token ids `[B, q]` at positions `[B, q]` writes each new token's K/V at its
position, lets a query at position p see every cached or new key at positions <= p, and
returns `lengths = max(lengths, last position + 1)`. In a sliding-window layer
(`ModelConfig.pattern.window`) a query at p sees only the keys k with p - k < window.

Positions contract (checked on the host by `tpumk.model.positions.check_step`, which generate,
speculation and loaded artifacts call by default): per sequence b the step's positions are
consecutive, `positions[b, i] = positions[b, 0] + i`, start at most at `lengths[b]` (no gap:
a start below it rewrites rows, as rollback does), and stay below the capacity
`pages_per_seq * page_size`.

Defined behaviour for positions outside [0, capacity) (what the kernel does too, so a bad
position never reaches another sequence or another row): such a token writes no K/V row, is
no key for any query, does not move `lengths` (`lengths = max(lengths, largest in-range
position + 1)`), and its query sees the valid keys at positions <= its position (every valid
key when past the capacity, none when negative; a query with no key gets attention output 0).
Cached keys are those at positions < min(lengths, capacity).

Defined behaviour for block-table entries outside [0, num_pages) and token ids outside
[0, vocab_size) (the host checks both by default; unchecked, the kernel does exactly this too):
- a token whose page entry is outside the pool writes no row (no page is written for it; the
  write is dropped, never clipped or wrapped onto another page); pages are *read* through the
  entry clipped into [0, num_pages), as the kernel addresses them, so its position is still a
  key (whatever row the clipped page holds there) and still moves `lengths`;
- a token id outside the vocabulary embeds as zeros and is treated as a token at position -1:
  it writes no row, is no key, does not move `lengths`, and its logits are finite (not NaN).
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError, NotSupportedError
from tpumk.model.config import ModelConfig
from tpumk.model.parts import Attention, Moe, Norms
from tpumk.model.positions import new_lengths
from tpumk.model import kv_quant, linear_attention, mla, spark, sparse_attention
from tpumk.model.ops import expert_matmul, jnp_dtype, matmul, residual_norm, rms_norm
from tpumk.model.rope import cos_sin_scale as rope_cos_sin_scale
from tpumk.model.rope import inv_freq as rope_freqs
from tpumk.model.rope import query_scale

Params = dict[str, Any]


class KVCache(NamedTuple):
    k: jax.Array
    v: jax.Array
    block_tables: jax.Array
    lengths: jax.Array
    # A hybrid model's linear layers' state pool (tpumk.model.linear_attention); None otherwise.
    states: linear_attention.LinearStates | None = None
    # Sparse attention's index-key cache (tpumk.model.sparse_attention): [indexer layers, pages,
    # page_size, index_head_dim] in the model dtype, paged by the same block tables; None otherwise.
    index_keys: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def max_context(self) -> int:
        return self.block_tables.shape[1] * self.page_size


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["kv", "block_tables", "lengths", "states", "index_keys"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class QuantizedKVCache:
    """A paged cache in one byte per element (`tpumk.model.kv_quant`): `kv` [num_layers,
    num_pages, layout.rows, layout.lanes] holds every page's K and V codes (float8_e4m3fn or
    int8) and their scale exponents, packed as `layout` (a `kv_quant.PagedLayout`, static under
    jit) says; an MLA model's latent rows likewise (one tensor). A sparse-attention model's index
    keys beside them in `index_keys` (fp8 only: `sparse_attention.QuantizedIndexKeys`)."""

    kv: jax.Array
    block_tables: jax.Array
    lengths: jax.Array
    layout: kv_quant.PagedLayout
    states: linear_attention.LinearStates | None = None  # as KVCache.states
    # a sparse model's 1-byte index-key cache (sparse_attention.QuantizedIndexKeys); None otherwise
    index_keys: sparse_attention.QuantizedIndexKeys | None = None

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    max_context = KVCache.max_context

    def _replace(self, **changes) -> "QuantizedKVCache":
        return dataclasses.replace(self, **changes)


def init_cache(cfg: ModelConfig, batch: int, max_context: int, page_size: int = 16,
               num_pages: int | None = None, seed: int | None = 0, kv_dtype: str | None = None,
               pending: int = 0, num_slots: int | None = None):
    """An empty paged cache; pages are handed out in a shuffled order (seeded) so that tests
    exercise real indirection rather than an identity block table. `kv_dtype` ("fp8", "int8"):
    a QuantizedKVCache instead of a model-dtype KVCache. A hybrid model's cache holds its
    attention layers only, and carries the linear layers' state pool (`states`: `num_slots`
    slots, default one per sequence, `pending` rows each: `linear_attention.init_states`)."""
    if page_size <= 0 or max_context <= 0 or batch <= 0:
        raise ValueError("init_cache: batch, max_context and page_size must be positive")
    pages_per_seq = -(-max_context // page_size)
    needed = batch * pages_per_seq
    num_pages = needed if num_pages is None else num_pages
    if num_pages < needed:
        raise ValueError(f"init_cache: num_pages {num_pages} < {needed} needed for {batch} x {max_context} tokens")
    order = np.arange(num_pages)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(num_pages)
    tables = order[:needed].reshape(batch, pages_per_seq).astype(np.int32)
    shape = (cfg.kv_layers, num_pages, page_size, cfg.attention.kv_size)
    dt = jnp_dtype(cfg)
    states = linear_attention.init_states(cfg, batch, num_slots, pending, seed) if cfg.linear else None
    # a sparse model's second cache: one index-key row per token and indexer layer (1-byte with fp8)
    index_keys = sparse_attention.init_index_keys(cfg, num_pages, page_size, kv_dtype) \
        if cfg.attention.is_sparse else None
    if kv_dtype is not None:
        layout = kv_quant.layout_for(cfg, page_size, kv_quant.kv_format(kv_dtype).name)
        return QuantizedKVCache(layout.zeros(cfg.kv_layers, num_pages), jnp.asarray(tables),
                                jnp.zeros((batch,), jnp.int32), layout, states, index_keys)
    if cfg.is_mla:  # one latent row per token in k (tpumk.model.mla), zero past C + R; v stays empty
        return KVCache(jnp.zeros(shape[:3] + (cfg.attention.latent_cache_lanes,), dt), jnp.zeros(shape[:3] + (0,), dt),
                       jnp.asarray(tables), jnp.zeros((batch,), jnp.int32), states, index_keys)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.asarray(tables),
                   jnp.zeros((batch,), jnp.int32), states)


# ---------------------------------------------------------------------- building blocks
def rope(x: jax.Array, positions: jax.Array, inv_freq, scale=None) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face / Qwen convention). x: [..., T, H, D], positions [..., T],
    inv_freq [D / 2] (tpumk.model.rope.inv_freq: plain or scaled), `scale` [D / 2] on cos and
    sin or None (tpumk.model.rope.cos_sin_scale: longrope, yarn)."""
    d = x.shape[-1]
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., T, D/2]
    c, s_ = jnp.cos(ang), jnp.sin(ang)
    if scale is not None:  # in float32 on the tables, as the kernel's glue (tpumk.kernel.norms.rope_tables)
        c, s_ = c * scale, s_ * scale
    cos = jnp.concatenate([c, c], -1)[..., None, :]
    sin = jnp.concatenate([s_, s_], -1)[..., None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], -1)
    return x * cos + rotated * sin


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of scores and logits); cap 0: x unchanged."""
    return cap * jnp.tanh(x / cap) if cap else x


def mlp_activation(gate: jax.Array, act: str = "silu") -> jax.Array:
    """The gated MLP's activation (ModelConfig.mlp_act): silu, or GELU's tanh approximation."""
    return jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, act: str = "silu") -> jax.Array:
    """act(x @ w_gate) * (x @ w_up) @ w_down: SwiGLU, or GeGLU with act = gelu_tanh."""
    return matmul(mlp_activation(matmul(x, w_gate), act) * matmul(x, w_up), w_down)


def route(moe: Moe, router_logits: jax.Array, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: returns (expert ids [..., k] int32, weights [..., k] float32).

    Softmax scoring takes the softmax over all experts, then the top k; sigmoid scoring takes
    per-expert sigmoids. With `norm_topk_prob` the k weights are renormalised to sum to 1.
    Ties break toward the lower expert id (jax.lax.top_k semantics).

    DeepSeek-V3 routing (transformers' DeepseekV3TopkRouter): `bias` (the correction bias,
    [E] float32) is added to the scores for selection only; with router_groups > 1 only the
    experts of the router_topk_groups best groups (a group scored by the sum of its two best
    biased scores) can be picked; the picked experts' unbiased scores are the weights, times
    routed_scaling_factor after any renormalisation.
    """
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, -1) if moe.router_scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if moe.router_groups > 1:
        g = moe.router_groups
        grouped = choice.reshape(*choice.shape[:-1], g, moe.experts_per_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], -1)  # [..., G]
        _, keep = jax.lax.top_k(group_scores, moe.router_topk_groups)
        kept = jnp.any(keep[..., :, None] == jnp.arange(g), -2)  # [..., G]
        choice = jnp.where(jnp.repeat(kept, moe.experts_per_group, axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, moe.top_k)
    weights = jnp.take_along_axis(scores, ids, -1)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return ids.astype(jnp.int32), weights


def expert_activation(g: jax.Array, u: jax.Array, limit: float = 0.0, alpha: float = 1.0) -> jax.Array:
    """The routed experts' gated activation from f32 gate / up outputs: silu(g) * u (SwiGLU), or
    with limit > 0 gpt-oss's clamped form (transformers' GptOssExperts._apply_gate; Moe's
    swiglu_limit / swiglu_alpha). The kernel's MoE stage calls it too."""
    if not limit:
        return mlp_activation(g) * u
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return g * jax.nn.sigmoid(alpha * g) * (u + 1.0)


def router_logits(moe: Moe, layer: Params, x: jax.Array) -> jax.Array:
    """x @ router in f32, plus gpt-oss's logit bias (router_logit_bias) in f32."""
    logits = matmul(x, layer["router"])
    return logits + layer["router_logit_bias"].astype(jnp.float32) if moe.router_logit_bias else logits


def moe_ffn(moe: Moe, layer: Params, x: jax.Array, norms: Norms | None = None) -> jax.Array:
    """x: [N, H] float32 normed activations -> [N, H] float32. `norms` (the model's) gives the
    epsilons of Muse Spark's expert-side norms (moe_hidden_size, expert_post_norm: tpumk.model.spark)."""
    ids, weights = route(moe, router_logits(moe, layer, x), layer.get("router_bias"))
    routed_in = spark.experts_in(moe, layer, x, norms.rms_eps) if moe.moe_hidden_size else x
    # Dense evaluation over all experts, masked by the routing weights: simple and exact.
    # A one-hot sum, not a scatter-add: exact all the same (top-k ids are distinct), and XLA for
    # TPU7x offloads a scatter-add to the SparseCore, whose compiled program (libtpu 0.0.52)
    # cannot be printed, so its kernels could not be counted (an MTP drafter's round program).
    combine = (jax.nn.one_hot(ids, moe.num_experts, dtype=jnp.float32) * weights[..., None]).sum(axis=1)
    g = expert_matmul(routed_in, layer["e_gate"])
    u = expert_matmul(routed_in, layer["e_up"])
    if moe.expert_bias:  # gpt-oss: f32 biases on each expert's outputs, before the activation
        g = g + layer["e_gate_bias"].astype(jnp.float32)[:, None, :]
        u = u + layer["e_up_bias"].astype(jnp.float32)[:, None, :]
    # cast to the compute dtype by expert_matmul, as the kernel does
    a = expert_activation(g, u, moe.swiglu_limit, moe.swiglu_alpha)
    y = expert_matmul(a, layer["e_down"])
    if moe.expert_bias:
        y = y + layer["e_down_bias"].astype(jnp.float32)[:, None, :]
    if moe.expert_post_norm:
        y = spark.expert_outputs(moe, y, norms.post_eps)
    out = spark.experts_out(moe, layer, jnp.einsum("enh,ne->nh", y, combine))
    if moe.num_shared_experts:
        out = out + shared_experts(moe, layer, x)
    return out


def shared_experts(moe: Moe, layer: Params, x: jax.Array) -> jax.Array:
    """The shared experts' output [N, H] f32; with shared_expert_gate (Qwen2-MoE) scaled per row by
    sigmoid(x @ shared_router) (the logit as the router's: x cast to the weight dtype, f32 sums)."""
    out = gated_mlp(x, layer["s_gate"], layer["s_up"], layer["s_down"])
    if moe.shared_expert_gate:
        out = jax.nn.sigmoid(matmul(x, layer["shared_router"])) * out
    return out


def sublayer_in(norms: Norms, layer: Params, norm: str, x: jax.Array) -> jax.Array:
    """What a sublayer reads: the residual normalized by the layer's `norm` weights (attn_norm /
    mlp_norm), or without pre_norms (OLMo 2) the residual itself."""
    return residual_norm(norms.norm_kind, x, layer[norm], norms.rms_eps, norms.width) if norms.pre_norms else x


def mlp_in(norms: Norms, layer: Params, x: jax.Array, attn_in: jax.Array) -> jax.Array:
    """What the MLP reads: the residual after attention normalized by mlp_norm, or with
    parallel_blocks (Cohere) attention's own input `attn_in` (both outputs join the residual)."""
    return attn_in if norms.parallel_blocks else sublayer_in(norms, layer, "mlp_norm", x)


def sublayer_out(norms: Norms, layer: Params, norm: str, y: jax.Array) -> jax.Array:
    """What a sublayer adds to the residual: its output, or with post_norms (Gemma 3) its
    output normalized by the layer's `norm` weights (post_attn_norm / post_mlp_norm)."""
    return residual_norm(norms.norm_kind, y, layer[norm], norms.post_eps, norms.width) if norms.post_norms else y


def ffn(cfg: ModelConfig, i: int, layer: Params, x: jax.Array) -> jax.Array:
    if cfg.pattern.is_dense(i):
        return gated_mlp(x, layer["w_gate"], layer["w_up"], layer["w_down"], cfg.mlp.mlp_act)
    return moe_ffn(cfg.moe, layer, x, cfg.norms)


def qkv(cfg: ModelConfig, layer: Params, x: jax.Array, positions: jax.Array, i: int):
    """x: [B, T, H] normed -> q [B,T,Hq,D] f32, k and v [B,T,Hkv,D] (k, v rounded to cache dtype).
    `i`: the layer (a sliding-window layer may rotate with its own theta, rope_local_theta). With
    position-scaled queries (`rope.query_scale`) q leaves multiplied by its position's factor."""
    b, t, _ = x.shape
    a, eps = cfg.attention, cfg.norms.rms_eps
    q, k, v = (matmul(x, layer[w]) for w in ("wq", "wk", "wv"))
    if a.qkv_bias:  # added in float32 to the float32 products, as the kernel does
        q, k, v = (y + layer[n].astype(jnp.float32) for y, n in ((q, "bq"), (k, "bk"), (v, "bv")))
    if a.qk_norm_whole:  # OLMo 2: one norm across every head (the true lanes of each)
        q = rms_norm(q, layer["q_norm"], eps, a.num_q_heads * a.true_head_dim)
        k = rms_norm(k, layer["k_norm"], eps, a.num_kv_heads * a.true_head_dim)
    q = q.reshape(b, t, a.num_q_heads, a.head_dim)
    k = k.reshape(b, t, a.num_kv_heads, a.head_dim)
    v = v.reshape(b, t, a.num_kv_heads, a.head_dim)
    if a.qk_norm and not a.qk_norm_whole:
        q = rms_norm(q, layer["q_norm"], eps, a.true_head_dim)
        k = rms_norm(k, layer["k_norm"], eps, a.true_head_dim)
    local = bool(cfg.pattern.window(i))
    if cfg.pattern.rotates(i):  # a NoPE layer leaves q and k unrotated
        freqs, scale = rope_freqs(cfg.positions, jnp, local=local), rope_cos_sin_scale(cfg.positions, jnp, local)
        q = rope(q, positions, freqs, scale)
        k = rope(k, positions, freqs, scale)
    dt = jnp_dtype(cfg)  # the cache dtype (the model's, whatever format wk is stored in)
    q_scale = query_scale(cfg.positions, positions, dt)  # Ministral 3: queries scaled by position
    if q_scale is not None:
        q = q * q_scale[..., None, None]
    return q, k.astype(dt), v.astype(dt)


def attend(att: Attention, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
           k_pos: jax.Array, k_valid: jax.Array, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """GQA attention. q [B,T,Hq,D] f32; k, v [B,S,Hkv,D]; q_pos [B,T]; k_pos, k_valid [B,S].

    window > 0 (a sliding-window layer): a query at p sees only keys k with p - k < window
    (transformers' `sliding_window_overlay`: kv_idx > q_idx - sliding_window).

    Scores are q (in the cache dtype) . k with float32 accumulation, scaled by 1/sqrt(D) (then
    soft-capped when att.attn_softcap); the softmax runs in float32 (with `sinks` [Hq], gpt-oss's
    sink logits in its denominator: `masked_softmax`); probabilities are cast to the cache dtype
    for p . v.
    """
    b, t = q.shape[:2]
    qg = q.reshape(b, t, att.num_kv_heads, att.group, att.head_dim).astype(k.dtype)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    s = soft_cap(s / att.score_divisor, att.attn_softcap)
    seen = k_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None]
    if att.step_bidirectional:  # a drafter's block: also every key of the step (those at or past its first row)
        first = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        seen = seen | ((k_pos >= first[:, None])[:, None, None, None, :] & (q_pos >= 0)[:, None, None, :, None])
    mask = k_valid[:, None, None, None, :] & seen
    if window:
        mask = mask & (k_pos[:, None, None, None, :] > q_pos[:, None, None, :, None] - window)
    p = masked_softmax(s, mask, None if sinks is None else sinks.reshape(att.num_kv_heads, att.group))
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, att.q_size)


def o_proj(cfg: ModelConfig, layer: Params, o: jax.Array, x: jax.Array | None = None) -> jax.Array:
    """Attention's output projection, f32; with o_bias its bias added in float32. With
    attn_output_gate (Qwen3-Next) o is first gated by sigmoid(x @ wq_gate), x the layer's normed
    input."""
    a = cfg.attention
    if a.attn_out_norm:  # Muse Spark: each head's output normalised before its gate
        o = spark.head_norm(o, a.num_q_heads, a.head_dim, cfg.norms.rms_eps, a.true_head_dim)
    if a.attn_output_gate:
        o = o * jax.nn.sigmoid(matmul(x, layer["wq_gate"]))
    out = matmul(o, layer["wo"])
    return out + layer["bo"].astype(jnp.float32) if cfg.attention.o_bias else out


def layer_sinks(cfg: ModelConfig, layer: Params) -> jax.Array | None:
    """The layer's sink logits when the model has attention sinks, else None."""
    return layer["sinks"] if cfg.attention.attn_sinks else None


def masked_softmax(s: jax.Array, mask: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax of scores s [B, Hkv, G, T, S] over the keys where `mask`, in float32. A query with
    no key at all (only an out-of-range negative position) gets 0, not NaN. `sinks` [Hkv, G]
    (gpt-oss): each head's sink logit joins the denominator as one more key whose value is 0,
    as transformers' eager attention appends it to the scores and drops its column."""
    s = jnp.where(mask, s, -jnp.inf)
    if sinks is None:
        return jnp.where(jnp.any(mask, -1, keepdims=True), jax.nn.softmax(s, axis=-1), 0.0)
    sink = sinks.astype(jnp.float32)[None, :, :, None, None]
    m = jnp.maximum(jnp.max(s, -1, keepdims=True), sink)
    e = jnp.exp(s - m)
    return e / (jnp.sum(e, -1, keepdims=True) + jnp.exp(sink - m))


def final_hidden(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """The residual stream after the final norm: what the lm_head reads (tap `num_layers`)."""
    n = cfg.norms
    return residual_norm(n.norm_kind, x, params["final_norm"], n.rms_eps, n.width)


def logits_from(cfg: ModelConfig, params: Params, x: jax.Array, normed: bool = False) -> jax.Array:
    x = x if normed else final_hidden(cfg, params, x)
    # a quantized build quantizes a tied head into its own `lm_head` (tpumk.model.quantize)
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return soft_cap(matmul(x, head), cfg.head.final_softcap)


def check_taps(cfg: ModelConfig, taps: Sequence[int]) -> tuple[int, ...]:
    """Hidden-state taps, transformers' `output_hidden_states` numbering: tap t < num_layers is the
    residual stream entering layer t (0: the embeddings), tap num_layers the final norm's output."""
    taps = tuple(taps)
    bad = [t for t in taps if not (isinstance(t, int) and 0 <= t <= cfg.num_layers)]
    if bad or len(set(taps)) != len(taps):
        raise ConfigError(f"taps {list(taps)}: expected distinct layer numbers 0 to {cfg.num_layers} "
                          f"(the model's {cfg.num_layers} layers; {cfg.num_layers}: after the final norm)")
    return taps


class _Taps:
    """Collects the tapped hidden states of one forward, in the model dtype: [B, q, len(taps), H]."""

    def __init__(self, cfg: ModelConfig, taps: Sequence[int]):
        self.cfg, self.taps, self.rows = cfg, check_taps(cfg, taps), {}

    def layer(self, i: int, x: jax.Array) -> None:
        if i in self.taps:
            self.rows[i] = x.astype(jnp_dtype(self.cfg))

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        h = final_hidden(self.cfg, params, x)
        self.layer(self.cfg.num_layers, h)
        return logits_from(self.cfg, params, h, normed=True)

    def stacked(self) -> jax.Array:
        return jnp.stack([self.rows[t] for t in self.taps], axis=2)


def embed_rows(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """The embedded tokens the first layer reads: `embed`'s rows, with embed_norm (Muse Spark)
    RMS-normalised without a weight."""
    x = embed(params, tokens, cfg.head.embed_scale)
    return spark.embed_normed(x, cfg.norms.rms_eps) if cfg.head.embed_norm else x


def embed(params: Params, tokens: jax.Array, scale: float = 1.0) -> jax.Array:
    """Embedding rows [..., H] float32; a token id outside [0, vocab) embeds as zeros (not NaN).

    `scale` (ModelConfig.embed_scale) multiplies the rows as transformers' Gemma does: the
    factor and the product rounded to the table's dtype."""
    table = params["embed"]
    ok = (tokens >= 0) & (tokens < table.shape[0])
    rows = jnp.take(table, jnp.where(ok, tokens, 0), axis=0)
    if scale != 1.0:
        rows = rows * jnp.asarray(scale, table.dtype)
    return jnp.where(ok[..., None], rows.astype(jnp.float32), 0.0)


def guard_positions(tokens: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """The positions a step runs at: a token id outside [0, vocab_size) puts its token at -1
    (out of range: it writes no row, is no key and does not move lengths). The kernel's step
    applies the same rule."""
    return jnp.where((tokens >= 0) & (tokens < vocab_size), positions, -1).astype(positions.dtype)


def read_tables(cache: KVCache) -> jax.Array:
    """The block tables as pages are read: entries clipped into [0, num_pages), as the kernel
    addresses them (writes never go through this: an entry outside the pool writes nothing)."""
    return jnp.clip(cache.block_tables, 0, cache.num_pages - 1)


# ---------------------------------------------------------------------- whole steps
def cache_slots(cache: KVCache, positions: jax.Array):
    """Where a step's new tokens go and which keys it sees, for any paged cache layout:
    (page_ids [B, q] (past the pool for an out-of-range token or a block-table entry outside
    [0, num_pages): its write is dropped), slots [B, q], k_pos [B, ctx], k_valid [B, ctx]
    (cached, or at an in-range position of this step), new lengths [B])."""
    b = positions.shape[0]
    ps, ctx, num_pages = cache.page_size, cache.max_context, cache.num_pages
    in_range = (positions >= 0) & (positions < ctx)  # out-of-range tokens write nothing
    lp = jnp.clip(positions // ps, 0, cache.block_tables.shape[1] - 1)
    page_ids = jnp.take_along_axis(cache.block_tables, lp, axis=1)  # [B, q]
    in_pool = (page_ids >= 0) & (page_ids < num_pages)  # never clipped or wrapped onto another page
    page_ids = jnp.where(in_range & in_pool, page_ids, num_pages)  # an index past the pages: dropped
    k_pos = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (b, ctx))
    new_pos = jnp.where(in_range, positions, -1)
    k_valid = (k_pos < cache.lengths[:, None]) | jnp.any(k_pos[:, :, None] == new_pos[:, None, :], -1)
    return page_ids, positions % ps, k_pos, k_valid, new_lengths(positions, cache.lengths, ctx)


def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                cache: KVCache, taps: Sequence[int] = ()):
    """One step over the paged cache: tokens/positions [B, q] -> (logits [B, q, V] f32, cache),
    and with `taps` (`check_taps`) the tapped hidden states [B, q, len(taps), H] third."""
    tap = _Taps(cfg, taps)
    logits, cache = (_mla_decode_step if cfg.is_mla else _decode_step)(params, cfg, tokens, positions, cache, tap)
    return (logits, cache, tap.stacked()) if tap.taps else (logits, cache)


def _decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: KVCache,
                 tap: _Taps):
    b, t = tokens.shape
    ctx = cache.max_context
    positions = guard_positions(tokens, positions, cfg.vocab_size)
    page_ids, slots, k_pos, k_valid, new_len = cache_slots(cache, positions)
    tables = read_tables(cache)

    quant = isinstance(cache, QuantizedKVCache)
    kc, vc = (cache.kv, None) if quant else (cache.k, cache.v)
    states, live = cache.states, (positions >= 0) & (positions < ctx)
    x = embed_rows(cfg, params, tokens)
    for i, layer in enumerate(params["layers"]):
        tap.layer(i, x)
        h = sublayer_in(cfg.norms, layer, "attn_norm", x)
        if cfg.pattern.is_linear(i):  # the layer's state in the pool, no KV rows
            o, states = linear_attention.layer_step(cfg.linear, layer, h, live, states, cfg.pattern.linear_index(i),
                                                    cfg.norms.rms_eps, jnp_dtype(cfg))
            x = x + sublayer_out(cfg.norms, layer, "post_attn_norm", o)
            h = mlp_in(cfg.norms, layer, x, h)
            x = x + sublayer_out(cfg.norms, layer, "post_mlp_norm",
                                 ffn(cfg, i, layer, h.reshape(b * t, -1)).reshape(b, t, -1))
            continue
        q, k, v = qkv(cfg, layer, h, positions, i)
        kl = cfg.pattern.kv_index(i)  # the layer's place in the KV cache
        if quant:  # codes and scales written; the rows read back dequantized: [B, ctx, Hkv, D]
            kc = cache.layout.write(kc, kl, page_ids, slots, jnp.stack([k, v], axis=2))
            rows = cache.layout.read(kc, kl, tables, k.dtype)
            ks, vs = rows[:, :, 0], rows[:, :, 1]
        else:
            kc = kc.at[kl, page_ids, slots].set(k.reshape(b, t, cfg.attention.kv_size), mode="drop")
            vc = vc.at[kl, page_ids, slots].set(v.reshape(b, t, cfg.attention.kv_size), mode="drop")
            # Gather this sequence's pages in order: [B, ctx, Hkv, D].
            ks = kc[kl][tables].reshape(b, ctx, cfg.num_kv_heads, cfg.head_dim)
            vs = vc[kl][tables].reshape(b, ctx, cfg.num_kv_heads, cfg.head_dim)
        o = attend(cfg.attention, q, ks, vs, positions, k_pos, k_valid, cfg.pattern.window(i), layer_sinks(cfg, layer))
        x = spark.join(cfg.norms, layer, "attn", x, sublayer_out(cfg.norms, layer, "post_attn_norm",
                                                                 o_proj(cfg, layer, o, h)))
        h = mlp_in(cfg.norms, layer, x, h)
        x = spark.join(cfg.norms, layer, "mlp", x, sublayer_out(
            cfg.norms, layer, "post_mlp_norm", ffn(cfg, i, layer, h.reshape(b * t, -1)).reshape(b, t, -1)))
    if states is not None:
        states = linear_attention.step_counts(states, t)
    if quant:
        return tap.logits(params, x), cache._replace(kv=kc, lengths=new_len, states=states)
    return tap.logits(params, x), KVCache(kc, vc, cache.block_tables, new_len, states)


def forward_full(params: Params, cfg: ModelConfig, tokens: jax.Array, taps: Sequence[int] = ()):
    """Causal forward over whole sequences without a cache: tokens [B, T] -> logits [B, T, V]
    (and with `taps`, the tapped hidden states [B, T, len(taps), H] second).

    K/V are rounded to the model dtype exactly as the cache would store them, so this is the
    full-recompute twin of `decode_step`."""
    tap = _Taps(cfg, taps)
    logits = (_mla_forward_full if cfg.is_mla else _forward_full)(params, cfg, tokens, tap)
    return (logits, tap.stacked()) if tap.taps else logits


def _forward_full(params: Params, cfg: ModelConfig, tokens: jax.Array, tap: _Taps) -> jax.Array:
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed_rows(cfg, params, tokens)
    states = linear_attention.init_states(cfg, b, seed=None) if cfg.linear else None
    for i, layer in enumerate(params["layers"]):
        tap.layer(i, x)
        h = sublayer_in(cfg.norms, layer, "attn_norm", x)
        if cfg.pattern.is_linear(i):  # from empty states: the chunked form over the whole sequence
            o, states = linear_attention.layer_step(cfg.linear, layer, h, jnp.ones((b, t), bool), states,
                                                    cfg.pattern.linear_index(i), cfg.norms.rms_eps, jnp_dtype(cfg))
        else:
            q, k, v = qkv(cfg, layer, h, pos, i)
            o = attend(cfg.attention, q, k, v, pos, pos, jnp.ones((b, t), bool), cfg.pattern.window(i),
                       layer_sinks(cfg, layer))
            o = o_proj(cfg, layer, o, h)
        x = spark.join(cfg.norms, layer, "attn", x, sublayer_out(cfg.norms, layer, "post_attn_norm", o))
        h = mlp_in(cfg.norms, layer, x, h)
        x = spark.join(cfg.norms, layer, "mlp", x, sublayer_out(
            cfg.norms, layer, "post_mlp_norm", ffn(cfg, i, layer, h.reshape(b * t, -1)).reshape(b, t, -1)))
    return tap.logits(params, x)


def q_resid(cfg: ModelConfig, layer, h: jax.Array) -> jax.Array | None:
    """What a sparse-attention indexer's queries project: the q-LoRA latent, or None when they
    project the hidden state (index_q_hidden, Mistral Large 4)."""
    return None if cfg.attention.index_q_hidden else mla.q_latent(cfg, layer, h)


def _mla_decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, cache, tap: _Taps):
    """`decode_step` for an MLA model (same contract, latent cache; tpumk.model.mla's attention)."""
    b, t = tokens.shape
    ctx = cache.max_context
    positions = guard_positions(tokens, positions, cfg.vocab_size)
    page_ids, slots, k_pos, k_valid, new_len = cache_slots(cache, positions)
    tables = read_tables(cache)

    quant = isinstance(cache, QuantizedKVCache)
    lc = cache.kv if quant else cache.k
    ic = cache.index_keys  # sparse attention's index-key cache (1-byte beside a 1-byte latent cache)
    if cfg.attention.is_sparse and ic is None:
        raise ValueError("decode_step: a sparse-attention model needs its index-key cache (reference.init_cache makes it)")
    selected = None  # sparse attention: the keys each query attends to (a shared layer keeps the last)
    states, live = cache.states, (positions >= 0) & (positions < ctx)
    freqs = mla.rope_freqs(cfg, params)
    x = embed(params, tokens, cfg.head.embed_scale)
    for i, layer in enumerate(params["layers"]):
        tap.layer(i, x)
        h = rms_norm(x, layer["attn_norm"], cfg.norms.rms_eps, cfg.norms.width)
        if cfg.pattern.is_linear(i):  # Kimi Linear's KDA layers beside its MLA ones
            o, states = linear_attention.layer_step(cfg.linear, layer, h, live, states, cfg.pattern.linear_index(i),
                                                    cfg.norms.rms_eps, jnp_dtype(cfg))
            x = x + o
        else:
            # (a layer reading another's latent rows, Mistral Large 4: that layer's cache, no write)
            kl, rot = cfg.pattern.kv_index(cfg.pattern.kv_source(i)), cfg.pattern.rotates(i)
            q_nope, q_rope, row = mla.project(cfg, layer, h, positions, rot, freqs)
            w = cfg.attention.kv_cache_width
            if quant:  # the latent row is one tensor of one "head": one scale per token
                if row is not None:
                    lc = cache.layout.write(lc, kl, page_ids, slots, row[:, :, None, None, :])
                rows = cache.layout.read(lc, kl, tables, jnp_dtype(cfg)).reshape(b, ctx, w)
            else:
                if row is not None:  # the row's lanes, then zeros in the stored row's pad lanes
                    stored = jnp.pad(row, ((0, 0), (0, 0), (0, lc.shape[-1] - w)))
                    lc = lc.at[kl, page_ids, slots].set(stored, mode="drop")
                rows = lc[kl][tables][..., :w].reshape(b, ctx, w)  # this sequence's pages in order
            if cfg.has_indexer(i):
                il = cfg.indexer_layers.index(i)
                ic = sparse_attention.write_index_keys(
                    ic, il, page_ids, slots, sparse_attention.index_keys(cfg, layer, h, positions, rot, freqs))
                keys = sparse_attention.read_index_keys(ic, il, tables, jnp_dtype(cfg))
                scores = sparse_attention.index_scores(cfg, layer, h, q_resid(cfg, layer, h), positions, keys, rot,
                                                       freqs)
                selected = sparse_attention.select(cfg, scores, mla.visible(positions, k_pos, k_valid))
            o = mla.attend_latent(cfg, layer, q_nope, q_rope, rows, positions, k_pos, k_valid, selected)
            x = x + matmul(o, layer["wo"])
        h = rms_norm(x, layer["mlp_norm"], cfg.norms.rms_eps, cfg.norms.width)
        x = x + ffn(cfg, i, layer, h.reshape(b * t, -1)).reshape(b, t, -1)
    if states is not None:
        states = linear_attention.step_counts(states, t)
    if quant:
        return tap.logits(params, x), cache._replace(kv=lc, lengths=new_len, states=states, index_keys=ic)
    return tap.logits(params, x), KVCache(lc, cache.v, cache.block_tables, new_len, states, ic)


def _mla_forward_full(params: Params, cfg: ModelConfig, tokens: jax.Array, tap: _Taps) -> jax.Array:
    """`forward_full` for an MLA model, attention in the expanded form (tpumk.model.mla)."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, tokens, cfg.head.embed_scale)
    states = linear_attention.init_states(cfg, b, seed=None) if cfg.linear else None
    valid, selected = jnp.ones((b, t), bool), None
    freqs, rows = mla.rope_freqs(cfg, params), {}  # rows: each layer's latent rows (a later layer may read them)
    for i, layer in enumerate(params["layers"]):
        tap.layer(i, x)
        h = rms_norm(x, layer["attn_norm"], cfg.norms.rms_eps, cfg.norms.width)
        if cfg.pattern.is_linear(i):
            o, states = linear_attention.layer_step(cfg.linear, layer, h, valid, states,
                                                    cfg.pattern.linear_index(i), cfg.norms.rms_eps, jnp_dtype(cfg))
            x = x + o
        else:
            rot = cfg.pattern.rotates(i)
            q_nope, q_rope, row = mla.project(cfg, layer, h, pos, rot, freqs)
            row = rows.setdefault(i, row) if row is not None else rows[cfg.pattern.kv_source(i)]
            if cfg.has_indexer(i):  # sparse attention over the whole sequence's index keys
                keys = sparse_attention.index_keys(cfg, layer, h, pos, rot, freqs)
                scores = sparse_attention.index_scores(cfg, layer, h, q_resid(cfg, layer, h), pos, keys, rot, freqs)
                selected = sparse_attention.select(cfg, scores, mla.visible(pos, pos, valid))
            o = mla.attend_expanded(cfg, layer, q_nope, q_rope, row, pos, pos, valid, selected)
            x = x + matmul(o, layer["wo"])
        h = rms_norm(x, layer["mlp_norm"], cfg.norms.rms_eps, cfg.norms.width)
        x = x + ffn(cfg, i, layer, h.reshape(b * t, -1)).reshape(b, t, -1)
    return tap.logits(params, x)


def prefill(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], cache: KVCache,
            step_fn=None, check: bool = True, batched: bool = False) -> tuple[jax.Array, KVCache]:
    """Fill the cache from prompts of any lengths (one chunk per sequence, q = prompt length).

    Returns the logits of each prompt's last token [B, V] and the filled cache. `step_fn` is
    the decode step to use (default: the reference, jitted); the same path serves any backend
    whose step has the reference's signature. `check` (default) checks each chunk's positions
    (`tpumk.model.positions.check_step`) and token ids (`check_tokens`) before it runs and
    raises NonFiniteError on NaN or infinite last-token logits.

    `batched`: one step for all sequences instead of one per sequence (one compiled shape
    instead of one per prompt length; `_prefill_batched`). The cache slots past each prompt
    then hold the padding's keys and values rather than zeros: outside `lengths`, so never read
    (a hybrid model's padding runs at position -1 instead, so that it changes no state).
    """
    from tpumk.model.positions import check_finite, check_step, check_tokens

    if len(prompts) != cache.block_tables.shape[0]:
        raise ValueError(f"prefill: {len(prompts)} prompts for a cache of batch {cache.block_tables.shape[0]}")
    step = step_fn or jitted_decode_step(cfg)
    if batched:
        return _prefill_batched(params, cfg, prompts, cache, step, check)
    last = []
    cur = cache  # any paged cache type: its arrays carried, its block tables whole between prompts
    for b, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prefill: prompt {b} is empty")
        start = int(cur.lengths[b])
        if start + len(prompt) > cache.max_context:
            raise ValueError(f"prefill: prompt {b} needs {start + len(prompt)} tokens > context {cache.max_context}")
        toks = jnp.asarray([prompt], jnp.int32)
        pos = jnp.arange(start, start + len(prompt), dtype=jnp.int32)[None]
        sub = cur._replace(block_tables=cache.block_tables[b:b + 1], lengths=cur.lengths[b:b + 1],
                           states=sequence_states(cur.states, b))
        if check:
            check_tokens(toks, cfg.vocab_size, where=f"prefill of sequence {b}")
            check_step(pos, sub, where=f"prefill of sequence {b}")
        logits, sub = step(params, toks, pos, sub)
        cur = sub._replace(block_tables=cache.block_tables, lengths=cur.lengths.at[b].set(sub.lengths[0]),
                           states=None if sub.states is None else sub.states._replace(slots=cache.states.slots))
        last.append(logits[0, -1])
        if check:
            check_finite(logits[:, -1], where="prefill", names=[b])
    return jnp.stack(last), cur


def sequence_states(states, b: int):
    """The state pool seen by sequence b alone (its slot), or None without linear layers."""
    return None if states is None else states._replace(slots=states.slots[b:b + 1])


def _prefill_batched(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], cache: KVCache, step,
                     check: bool) -> tuple[jax.Array, KVCache]:
    """Every prompt in one [B, longest] step, right-padded with token 0 at the positions that
    follow it. Exact: a query sees only keys at positions up to its own, so no prompt token sees
    padding; the lengths are then set to the prompts' ends, so the padding's slots are outside
    every sequence and the next step at each end overwrites its slot before reading it. A
    hybrid model's padding runs at position -1 (checked as the positions that follow the prompt):
    a token outside the cache changes no linear layer's state and writes no row, and it comes
    after every prompt token, where the chunked form takes dead tokens (`linear_attention`)."""
    from tpumk.model.positions import check_finite, check_step, check_tokens

    if any(not p for p in prompts):
        raise ValueError(f"prefill: prompt {next(b for b, p in enumerate(prompts) if not p)} is empty")
    longest = max(len(p) for p in prompts)
    starts = np.asarray(cache.lengths, np.int64)
    if int(starts.max()) + longest > cache.max_context:
        b = int(np.argmax(starts + longest))
        raise ValueError(f"prefill: batched, it pads every prompt to the longest ({longest} tokens): sequence {b} "
                         f"would need {int(starts[b]) + longest} tokens > context {cache.max_context}")
    toks = jnp.asarray([list(p) + [0] * (longest - len(p)) for p in prompts], jnp.int32)
    pos = jnp.asarray(starts[:, None] + np.arange(longest)[None], jnp.int32)
    ends = np.asarray([len(p) for p in prompts])
    if check:
        check_tokens(toks, cfg.vocab_size, where="prefill")
        check_step(pos, cache, where="prefill")
    if cache.states is not None:  # the padding at -1: it must not enter any state
        pos = jnp.where(jnp.arange(longest)[None] < jnp.asarray(ends)[:, None], pos, -1)
    logits, filled = step(params, toks, pos, cache)
    last = logits[jnp.arange(len(prompts)), jnp.asarray(ends - 1)]
    if check:
        check_finite(last, where="prefill")
    lengths = jnp.asarray(starts + ends, cache.lengths.dtype)
    return last, filled._replace(block_tables=cache.block_tables, lengths=lengths)


@functools.lru_cache(maxsize=32)
def jitted_decode_step(cfg: ModelConfig, taps: Sequence[int] = ()):
    """decode_step with the config (and `taps`) bound, jitted (compiled once per input shape).
    One per config in a process, so every prefill, generate and test of a model shares its
    compiled steps."""
    taps = tuple(taps)
    return jax.jit(lambda p, t, pos, c: decode_step(p, cfg, t, pos, c, taps=taps))


def greedy_generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], steps: int,
                    cache: KVCache, step_fn=None, decode_fn=None, check: bool = True
                    ) -> tuple[list[list[int]], KVCache]:
    """Greedy decoding: prefill the prompts, then `steps` one-token steps for all sequences.

    `step_fn` (reference signature) runs the prefill and, unless `decode_fn(tokens, positions,
    cache) -> (logits, cache)` is given, the one-token steps too: another backend plugs in
    there with its own weights. Returns the generated ids per sequence (the first comes from
    the prefill logits). `check` (default) checks every step's positions before it runs
    (PositionError, e.g. a cache too small for the steps) and its logits after (NonFiniteError
    on NaN / inf: argmax would silently read token 0)."""
    from tpumk.model.positions import check_finite, check_step

    step = step_fn or jitted_decode_step(cfg)
    decode = decode_fn or (lambda toks, pos, c: step(params, toks, pos, c))
    last_logits, cache = prefill(params, cfg, prompts, cache, step_fn=step, check=check)
    out: list[list[int]] = [[] for _ in prompts]
    nxt = jnp.argmax(last_logits, -1).astype(jnp.int32)
    for s in range(steps):
        for b, t in enumerate(np.asarray(nxt)):
            out[b].append(int(t))
        if s == steps - 1:
            break
        positions = cache.lengths[:, None]
        if check:
            check_step(positions, cache, where=f"generate step {s + 1}")
        logits, cache = decode(nxt[:, None], positions, cache)
        if check:
            check_finite(logits[:, -1], where=f"generate step {s + 1}")
        nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    return out, cache
