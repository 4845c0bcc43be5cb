"""The reference's multi-head latent attention (DeepSeek-V3, Kimi K2): projections, the absorbed
form over a paged latent cache, and its expanded twin. `tpumk.model.reference.decode_step` and
`forward_full` run an MLA model's layers with these.

Weights (reference layout, matrices `[in, out]`; Hq heads, N = qk_nope_head_dim, R =
qk_rope_head_dim, V = v_head_dim, C = kv_lora_rank, Rq = q_lora_rank):

    wq_a [H, Rq], q_a_norm [Rq], wq_b [Rq, Hq*(N+R)]   (q-LoRA; or wq [H, Hq*(N+R)] when Rq = 0)
    wkv_a [H, C+R], kv_a_norm [C], wkv_b [C, Hq*(N+V)], wo [Hq*V, H]

Each head's columns of wq_b are its N "nope" lanes then its R roped lanes; of wkv_b, its N key
lanes (W_UK) then its V value lanes (W_UV). The roped lanes are in rotate-half order (a
checkpoint stored for interleaved RoPE is permuted on load, tpumk.model.checkpoint).

Per token and layer the cache holds one row `c_kv | k_rope` of C + R elements in the model
dtype: the kv_a-normalized latent and the roped key part, shared by all heads (`KVCache.k`
`[L, pages, page_size, latent_cache_lanes]`: the row, then zeros up to whole 128-lane tiles;
`KVCache.v` is empty, `[L, pages, page_size, 0]`).

The absorbed step: q_lat = q_nope @ W_UK (per head, [C]), each head scores the row with
`q_lat | q_rope` (one C+R wide dot product), the probabilities weight the cached c_kv into a
latent output o_lat [C], and o_lat @ W_UV gives the head's value output. Numerics follow
`tpumk.model.reference`: matrix products cast the activation to the weight dtype and accumulate
in float32; the query row is cast to the cache dtype for the scores, probabilities for p . c_kv.
`attend_expanded` is the expanded twin (keys and values rebuilt per head from the latent, the way
transformers computes them; `reference.forward_full` uses it) and checks the absorption algebra.

Quantized weights (tpumk.model.quantize): wq_a, wq_b / wq, wkv_a and wo are QuantizedMatrix
(`reference.matmul` takes them); wkv_b is replaced by `w_uk` [Hq, N, C] and `w_uv` [Hq, C, V],
the per-head absorbed blocks quantized block by block, multiplied head by head with the same
contract (`_per_head`), which is what the kernel's block-diagonal uk / uv tiles compute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import NotSupportedError
from tpumk.model import yarn
from tpumk.model.config import ModelConfig
from tpumk.model.ops import expert_matmul, jnp_dtype, matmul, rms_norm
from tpumk.model.quantize import QuantizedMatrix, absorbed_weights
from tpumk.model.rope import query_scale


def rope_rows(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float) -> jax.Array:
    """Rotate-half RoPE with given inverse frequencies; cos and sin carry `factor` (YaRN's
    attention factor). x: [..., T, heads, R], positions [..., T]."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, R/2]
    cos = (jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1) * factor)[..., None, :]
    sin = (jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1) * factor)[..., None, :]
    r = x.shape[-1]
    rotated = jnp.concatenate([-x[..., r // 2:], x[..., : r // 2]], -1)
    return x * cos + rotated * sin


def q_latent(cfg: ModelConfig, layer, x: jax.Array) -> jax.Array:
    """The normed q-LoRA latent q_a_norm(x @ wq_a) [B, T, Rq] f32 (what q_b, and a sparse-attention
    indexer's queries, project)."""
    return rms_norm(matmul(x, layer["wq_a"]), layer["q_a_norm"], cfg.norms.latent_eps)


def rope_freqs(cfg: ModelConfig, params=None) -> jax.Array:
    """The rope lanes' inverse frequencies [R/2] float32: YaRN's (or plain), each times
    exp(rope_alpha[j]) with learned frequencies (Mistral Large 4: `params["rope_alpha"]`)."""
    freqs = jnp.asarray(yarn.inv_freq(cfg.positions, cfg.qk_rope_head_dim), jnp.float32)
    if cfg.rope_learned_freqs:
        if params is None or "rope_alpha" not in params:  # (a caller without the model's weights)
            raise NotSupportedError(f"model '{cfg.name}': learned RoPE frequencies (rope_learned_freqs) need the "
                                    "model's rope_alpha weights: this path does not take them")
        freqs = freqs * jnp.exp(params["rope_alpha"].astype(jnp.float32))
    return freqs


def log_position_scale(scale: jax.Array, bias: jax.Array, positions: jax.Array, dtype) -> jax.Array:
    """Mistral Large 4's query factor per head [B, T, heads]: s_h ln(1 + p) + b_h in the model
    dtype, as transformers casts ln(1 + p) and the weights before the product. (A padding
    position, p < 0, reads p = 0: its row is never attended to.)"""
    log_pos = jnp.log1p(jnp.maximum(positions, 0).astype(jnp.float32)).astype(dtype)
    return scale.astype(dtype) * log_pos[..., None] + bias.astype(dtype)


def project(cfg: ModelConfig, layer, x: jax.Array, positions: jax.Array, rotate: bool = True, freqs=None):
    """x [B, T, H] normed -> q_nope [B,T,Hq,N] f32, q_rope [B,T,Hq,R] f32 (roped), and the
    cache row [B, T, C+R] in the cache dtype (normalized c_kv | roped k_rope). `rotate` False (a
    NoPE layer, Kimi Linear's): the R lanes stay as projected; with nope_latent_keys (Mistral
    Large 4) a NoPE layer's query is N+R latent lanes (q_nope) and q_rope / the row's rope lanes
    are zeros. The row is None in a layer that reads another layer's latent rows (no wkv_a).
    With position-scaled queries (`rope.query_scale`, Mistral 4) both query parts leave
    multiplied by their position's factor; with query_log_scale (Mistral Large 4) by the
    layer's per-head log-position factor. `freqs`: rope_freqs (required with learned ones)."""
    b, t, _ = x.shape
    r_full, c, dt = cfg.qk_rope_head_dim, cfg.kv_lora_rank, jnp_dtype(cfg)
    n, r = cfg.attention.layer_key_widths(rotate)
    if cfg.q_lora_rank:
        q = matmul(q_latent(cfg, layer, x), layer["wq_b"])
    else:
        q = matmul(x, layer["wq"])
    q = q.reshape(b, t, cfg.num_q_heads, n + r)
    freqs = rope_freqs(cfg) if freqs is None else freqs
    factor = yarn.attention_factor(cfg.positions)
    row = None
    if "wkv_a" in layer:
        kv = matmul(x, layer["wkv_a"])  # [B, T, C+R] (a wide NoPE layer's: [B, T, C])
        c_kv = rms_norm(kv[..., :c], layer["kv_a_norm"], cfg.norms.latent_eps)
        if rotate:
            k_rope = rope_rows(kv[..., None, c:], positions, freqs, factor)[..., 0, :]
        else:
            k_rope = kv[..., c:]
        k_rope = jnp.pad(k_rope, ((0, 0), (0, 0), (0, r_full - r)))  # a wide NoPE layer: zero rope lanes
        row = jnp.concatenate([c_kv, k_rope], -1).astype(dt)
    q_rope = rope_rows(q[..., n:], positions, freqs, factor) if rotate else q[..., n:]
    q_rope = jnp.pad(q_rope, ((0, 0), (0, 0), (0, 0), (0, r_full - r)))
    q_nope = q[..., :n]
    q_scale = query_scale(cfg.positions, positions, dt)  # Mistral 4: the whole query by position
    if q_scale is not None:
        q_nope, q_rope = q_nope * q_scale[..., None, None], q_rope * q_scale[..., None, None]
    if cfg.attention.query_log_scale:  # Mistral Large 4: per head, after RoPE
        f = log_position_scale(layer["q_log_scale"], layer["q_log_bias"], positions, dt).astype(jnp.float32)
        q_nope, q_rope = q_nope * f[..., None], q_rope * f[..., None]
    return q_nope, q_rope, row


def _per_head(x: jax.Array, w) -> jax.Array:
    """x [B, T, Hq, K] @ w [Hq, K, M] head by head -> [B, T, Hq, M] f32: `reference.matmul`'s
    contract per head (a quantized stack: its codes, scales per head block, as the kernel)."""
    # heads as the leading batch axis for both forms (XLA:CPU has no bfloat16 dot kernel for
    # the bthk,hkm form with a float32 result)
    b, t, hq, k = x.shape
    y = expert_matmul(x.transpose(2, 0, 1, 3).reshape(hq, b * t, k), w)  # [Hq, B*T, M]
    return y.reshape(hq, b, t, -1).transpose(1, 2, 0, 3)


def visible(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array) -> jax.Array:
    """[B, T, S]: the valid keys at positions up to each query's (the causal mask)."""
    return k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])


def _mask(q_pos, k_pos, k_valid, selected) -> jax.Array:
    """[B, 1, T, S] for the [B, H, T, S] scores: the causal mask, and the selection when sparse."""
    mask = visible(q_pos, k_pos, k_valid)
    return (mask if selected is None else mask & selected)[:, None]


def _softmax_masked(s: jax.Array, mask: jax.Array) -> jax.Array:
    s = jnp.where(mask, s, -jnp.inf)
    # A query with no key at all (only an out-of-range negative position) gets output 0, not NaN.
    return jnp.where(jnp.any(mask, -1, keepdims=True), jax.nn.softmax(s, axis=-1), 0.0)


def attend_latent(cfg: ModelConfig, layer, q_nope: jax.Array, q_rope: jax.Array, rows: jax.Array,
                  q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array, selected: jax.Array | None = None) -> jax.Array:
    """Absorbed MLA attention. q_nope [B,T,Hq,N], q_rope [B,T,Hq,R] f32; rows [B,S,C+R] (cache
    dtype); q_pos [B,T]; k_pos, k_valid [B,S] -> [B, T, Hq*V] f32. `selected` [B,T,S] (sparse
    attention, tpumk.model.sparse_attention): each query sees only its selected keys."""
    w_uk, w_uv = absorbed_weights(cfg, layer)
    b, t = q_nope.shape[:2]
    q_lat = _per_head(q_nope, w_uk)
    q_row = jnp.concatenate([q_lat, q_rope], -1).astype(rows.dtype)  # [B,T,Hq,C+R]
    scale = yarn.softmax_scale(cfg.attention, cfg.positions)
    s = jnp.einsum("bthd,bsd->bhts", q_row, rows, preferred_element_type=jnp.float32) * scale
    p = _softmax_masked(s, _mask(q_pos, k_pos, k_valid, selected))
    # (as bhtc, then transposed: XLA:CPU has no bfloat16 kernel for the bthc form of this product)
    o_lat = jnp.einsum("bhts,bsc->bhtc", p.astype(rows.dtype), rows[..., : cfg.kv_lora_rank],
                       preferred_element_type=jnp.float32).transpose(0, 2, 1, 3)
    o = _per_head(o_lat, w_uv)
    return o.reshape(b, t, cfg.num_q_heads * cfg.v_head_dim)


def attend_expanded(cfg: ModelConfig, layer, q_nope: jax.Array, q_rope: jax.Array, rows: jax.Array,
                    q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array, selected: jax.Array | None = None
                    ) -> jax.Array:
    """The same attention with per-head keys and values rebuilt from the latent (transformers'
    form): k = [c_kv @ W_UK | k_rope], v = c_kv @ W_UV, then ordinary multi-head attention."""
    # (quantized blocks enter dequantized: this twin checks the algebra, not the kernel's rounding)
    w_uk, w_uv = (w.dequantized() if isinstance(w, QuantizedMatrix) else w for w in absorbed_weights(cfg, layer))
    b, t = q_nope.shape[:2]
    c_kv, k_rope = rows[..., : cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank:]
    k_nope = jnp.einsum("bsc,hnc->bshn", c_kv.astype(w_uk.dtype), w_uk, preferred_element_type=jnp.float32)
    v = jnp.einsum("bsc,hcv->bshv", c_kv.astype(w_uv.dtype), w_uv, preferred_element_type=jnp.float32)
    s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope)
         + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope.astype(jnp.float32))) \
        * yarn.softmax_scale(cfg.attention, cfg.positions)
    p = _softmax_masked(s, _mask(q_pos, k_pos, k_valid, selected))
    o = jnp.einsum("bhts,bshv->bthv", p, v)
    return o.reshape(b, t, cfg.num_q_heads * cfg.v_head_dim)
