"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): which cached tokens each
query of an MLA layer attends to. `tpumk.model.reference` runs it beside `tpumk.model.mla`.

Per layer with an indexer (ModelConfig.has_indexer; Hi = index_heads, Di = index_head_dim,
R = qk_rope_head_dim; weights in `tpumk.model.weights`' layout):

    q_i   = q_resid @ idx_wq  -> [Hi, Di]   (q_resid: the layer's normed q-LoRA latent, as MLA's q_b reads)
    k_i   = LayerNorm(x @ idx_wk; idx_k_norm, idx_k_bias, eps 1e-6)  -> [Di]   (x: the layer's normed input)
    RoPE on lanes [0, R) of q_i and k_i (rotate-half; interleaved pairs with index_rope_interleave),
    lanes [R, Di) unrotated; the positions' cos / sin are MLA's (YaRN's attention factor included)
    w     = (x @ idx_weights) x Hi^-0.5                      -> [Hi]   (float32)
    score(t, s) = sum_h w_h ReLU(q_i[t, h] . k_i[s] x Di^-0.5)

Mistral Large 4 (index_q_hidden, query_log_scale): q_i = LayerNorm(x; idx_q_norm, idx_q_bias,
eps 1e-6) @ idx_wq, times s_h ln(1 + p) + b_h per head (idx_log_scale / idx_log_bias); a NoPE
layer's indexer ropes nothing; RoPE's frequencies are MLA's learned ones (mla.rope_freqs).

Each query keeps the `index_topk` keys it scores highest among those it may see (cached or
new keys at positions <= its own: transformers' causal mask enters the scores before top-k);
fewer visible keys than that: all of them. MLA then attends to the kept keys only. A layer in
`index_shared_layers` runs no indexer and keeps the previous layer's selection (GLM-5).

The index keys are cached as the latent rows are: one row of Di lanes per token and indexer
layer, in the model dtype (`reference.KVCache.index_keys`, [indexer layers, pages, page_size,
Di], paged by the same block tables), so a decode step scores the new queries against every
cached token's key without recomputing them. Scores are float32 (the query and key rows read in
float32, as transformers' `q.float() @ k.float()`).

With `--kv-dtype fp8` the index-key cache is 1-byte (`QuantizedIndexKeys`): each key row is
stored as Di float8_e4m3fn codes and ONE float32 scale per key (per token and indexer layer,
over all Di lanes: DeepSeek's release scales per 128-lane block, and its index_head_dim is 128,
so for it the two are the same), the smallest power of two with max|k| / scale <= 448
(`kv_quant.pow2_scales`: DeepSeek's own indexer rounds its scales up to powers of two, "ue8m0",
and a power of two makes `k x (1 / scale)` and `code x scale` exact on every backend). Scoring
reads `code x scale` in the model dtype (exact: an e4m3 code times a power of two is a
bfloat16), then the same float32 scores.

Ties: `jax.lax.top_k` keeps the lower position of two equal scores; torch.topk's order among
ties is unspecified, so tests compare with transformers where the k-th and (k+1)-th scores differ.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpumk.errors import NotSupportedError
from tpumk.model import kv_quant, mla, yarn
from tpumk.model.config import ModelConfig
from tpumk.model.ops import jnp_dtype, matmul

# transformers' indexer k_norm: nn.LayerNorm(index_head_dim, eps=1e-6); Mistral Large 4's q_input_norm too
INDEX_KEY_NORM_EPS = 1e-6


def _layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with weight and bias over the last axis, in float32."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)


def _rope(cfg: ModelConfig, x: jax.Array, positions: jax.Array, rotate: bool = True, freqs=None) -> jax.Array:
    """RoPE on the first qk_rope_head_dim lanes of x [B, T, heads, Di] (rotate-half, or interleaved
    pairs: evens then odds, then rotate-half, as transformers' apply_rotary_pos_emb_interleave
    writes them); the other lanes unchanged. `rotate` False (a NoPE layer's indexer, Mistral
    Large 4): x unchanged. `freqs`: MLA's (mla.rope_freqs; learned ones included)."""
    if not rotate:
        return x
    r = cfg.qk_rope_head_dim
    rot, rest = x[..., :r], x[..., r:]
    if cfg.attention.index_rope_interleave:
        rot = jnp.concatenate([rot[..., 0::2], rot[..., 1::2]], -1)
    freqs = mla.rope_freqs(cfg) if freqs is None else freqs
    return jnp.concatenate([mla.rope_rows(rot, positions, freqs, yarn.attention_factor(cfg.positions)), rest], -1)


class QuantizedIndexKeys(NamedTuple):
    """A 1-byte index-key cache (`--kv-dtype fp8`, module doc): codes [indexer layers, pages,
    page_size, Di] float8_e4m3fn and their power-of-two scales [indexer layers, pages, page_size]
    float32 (0 for an unwritten row, which reads back as zeros)."""

    codes: jax.Array
    scales: jax.Array


INDEX_KEY_FORMATS = ("fp8",)  # --kv-dtype values the index-key cache has a 1-byte form for
INDEX_SCALE_BYTES = 4  # a 1-byte index key's float32 scale


def check_index_key_format(cfg: ModelConfig, kv_dtype: str) -> kv_quant.KvFormat:
    """The 1-byte format `--kv-dtype kv_dtype` gives a sparse model's index keys, or its one-line refusal."""
    if kv_dtype not in INDEX_KEY_FORMATS:
        raise NotSupportedError(f"model '{cfg.name}': --kv-dtype {kv_dtype} with sparse attention (index_topk) is not "
                                "built: its index-key cache has a 1-byte form in fp8 only (--kv-dtype fp8)")
    return kv_quant.kv_format(kv_dtype)


def init_index_keys(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype: str | None = None):
    """An empty index-key cache: the model dtype (kv_dtype None), or QuantizedIndexKeys (fp8)."""
    shape = (len(cfg.indexer_layers), num_pages, page_size, cfg.attention.index_head_dim)
    if kv_dtype is None:
        return jnp.zeros(shape, jnp_dtype(cfg))
    fmt = check_index_key_format(cfg, kv_dtype)
    return QuantizedIndexKeys(jnp.zeros(shape, fmt.dtype), jnp.zeros(shape[:3], jnp.float32))


def write_index_keys(cache, layer: int, page_ids: jax.Array, slots: jax.Array, keys: jax.Array):
    """keys [B, T, Di] into indexer layer `layer` of the cache at page_ids / slots [B, T] (a page id
    past the pool drops the write); quantized first when the cache is QuantizedIndexKeys."""
    if not isinstance(cache, QuantizedIndexKeys):
        return cache.at[layer, page_ids, slots].set(keys, mode="drop")
    codes, scales = kv_quant.quantize_rows(keys, kv_quant.format_of(cache.codes))
    return QuantizedIndexKeys(cache.codes.at[layer, page_ids, slots].set(codes, mode="drop"),
                              cache.scales.at[layer, page_ids, slots].set(scales, mode="drop"))


def read_index_keys(cache, layer: int, tables: jax.Array, dtype) -> jax.Array:
    """Each sequence's index keys of indexer layer `layer` in order, [B, pages_per_seq x page_size,
    Di] in `dtype` (tables [B, pages_per_seq], clipped into the pool): dequantized when 1-byte."""
    if isinstance(cache, QuantizedIndexKeys):
        rows = kv_quant.dequantize_rows(cache.codes[layer][tables], cache.scales[layer][tables], dtype)
    else:
        rows = cache[layer][tables]
    return rows.reshape(tables.shape[0], -1, rows.shape[-1])


def index_keys(cfg: ModelConfig, layer, x: jax.Array, positions: jax.Array, rotate: bool = True,
               freqs=None) -> jax.Array:
    """x [B, T, H] (the layer's normed input) -> the index-key rows [B, T, Di] in the model dtype
    (what the index-key cache stores)."""
    k = _layer_norm(matmul(x, layer["idx_wk"]), layer["idx_k_norm"], layer["idx_k_bias"], INDEX_KEY_NORM_EPS)
    k = k.astype(jnp_dtype(cfg))  # the LayerNorm's output in the model dtype, as transformers' module returns it
    return _rope(cfg, k[:, :, None, :], positions, rotate, freqs)[:, :, 0, :].astype(jnp_dtype(cfg))


def index_scores(cfg: ModelConfig, layer, x: jax.Array, q_resid: jax.Array | None, positions: jax.Array,
                 keys: jax.Array, rotate: bool = True, freqs=None) -> jax.Array:
    """The indexer's scores [B, T, S] float32 of the step's queries (x [B, T, H] the normed input,
    q_resid [B, T, Rq] the normed q-LoRA latent, positions [B, T]) against key rows [B, S, Di].
    With index_q_hidden (Mistral Large 4) the queries project LayerNorm(x) instead (q_resid
    unused), and with query_log_scale leave times their per-head log-position factor (before
    RoPE, as transformers; RoPE is linear, so the order is the same product)."""
    a = cfg.attention
    q = index_queries(cfg, layer, x, q_resid, positions, rotate, freqs)
    s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * (a.index_head_dim ** -0.5)
    return jnp.einsum("bth,bths->bts", head_weights(cfg, layer, x), jax.nn.relu(s), precision=jax.lax.Precision.HIGHEST)


def index_queries(cfg: ModelConfig, layer, x: jax.Array, q_resid: jax.Array | None, positions: jax.Array,
                  rotate: bool = True, freqs=None) -> jax.Array:
    """The indexer's roped queries [B, T, Hi, Di] in the model dtype (`index_scores`' arguments)."""
    a, dt = cfg.attention, jnp_dtype(cfg)
    b, t, _ = x.shape
    if a.index_q_hidden:
        q_resid = _layer_norm(x, layer["idx_q_norm"], layer["idx_q_bias"], INDEX_KEY_NORM_EPS).astype(dt)
    q = matmul(q_resid, layer["idx_wq"]).astype(dt).reshape(b, t, a.index_heads, a.index_head_dim)
    if a.query_log_scale:
        q = q * mla.log_position_scale(layer["idx_log_scale"], layer["idx_log_bias"], positions, dt)[..., None]
    return _rope(cfg, q, positions, rotate, freqs).astype(dt)


def head_weights(cfg: ModelConfig, layer, x: jax.Array) -> jax.Array:
    """w = x . weights_proj / sqrt(Hi): [B, T, Hi] float32 (the model-dtype input, as transformers'
    hidden_states, into the float32 weights_proj)."""
    return matmul(x.astype(jnp_dtype(cfg)), layer["idx_weights"]) * (cfg.attention.index_heads ** -0.5)


def select(cfg: ModelConfig, scores: jax.Array, visible: jax.Array) -> jax.Array:
    """The keys each query attends to: [B, T, S] bool, the index_topk visible keys of highest
    score (all visible keys when fewer). `visible` [B, T, S]: the causal, valid keys."""
    s = scores.shape[-1]
    k = min(cfg.attention.index_topk, s)
    masked = jnp.where(visible, scores, -jnp.inf)
    _, ids = jax.lax.top_k(masked, k)  # [B, T, k]
    picked = jnp.zeros(scores.shape, bool)
    bi = jnp.arange(scores.shape[0])[:, None, None]
    ti = jnp.arange(scores.shape[1])[None, :, None]
    return picked.at[bi, ti, ids].set(True) & visible
