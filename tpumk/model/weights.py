"""Model weights in tpumk's reference layout: deterministic random init and shape checks.

Reference layout (what `tpumk.model.reference` consumes; matrices are `[in, out]`):

    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied)
    layers[i]: attn_norm [H], wq [H, Hq*D], wk [H, Hkv*D], wv [H, Hkv*D], wo [Hq*D, H],
               bq [Hq*D], bk [Hkv*D], bv [Hkv*D] (when qkv_bias),
               q_norm [D], k_norm [D] (when qk_norm), mlp_norm [H], and either
      dense:   w_gate [H, F], w_up [H, F], w_down [F, H]
      MoE:     router [H, E], e_gate [E, H, Fe], e_up [E, H, Fe], e_down [E, Fe, H],
               s_gate [H, S*Fs], s_up [H, S*Fs], s_down [S*Fs, H] (S shared experts side by side;
               a sum of SwiGLU experts equals one SwiGLU of the concatenated widths),
               shared_router [H, 1] (shared_expert_gate: the shared output's sigmoid gate),
               router_logit_bias [E] (gpt-oss), e_gate_bias [E, Fe], e_up_bias [E, Fe],
               e_down_bias [E, H] (expert_bias: gpt-oss)
      DeepSeek-V3 routing (router_correction_bias): router [H, E] and router_bias [E] are
               float32 whatever the model dtype (transformers keeps the gate in float32)
    MLA layers (tpumk.model.mla) replace wq, wk, wv, q_norm, k_norm by wq_a, q_a_norm, wq_b
    (or wq when q_lora_rank = 0), wkv_a, kv_a_norm, wkv_b; wo is [Hq*V, H].
    wq_gate [H, Hq*D] (attn_output_gate: Qwen3-Next's gated attention).
    Sparse attention (index_topk > 0): each MLA layer with an indexer of its own adds idx_wq
    [Rq, Hi*Di], idx_wk [H, Di], idx_k_norm, idx_k_bias [Di] (the key's LayerNorm) and
    idx_weights [H, Hi] (float32 whatever the model dtype).
    Mistral Large 4: rope_alpha [R/2] (float32, top level; rope_learned_freqs), q_log_scale,
    q_log_bias [Hq] and idx_log_scale, idx_log_bias [Hi] per layer (query_log_scale); idx_wq
    [H, Hi*Di] with idx_q_norm, idx_q_bias [H] (index_q_hidden); a NoPE layer's wkv_a [H, C] and
    wkv_b [C, Hq*(N+R+V)] (nope_latent_keys); no wkv_a / kv_a_norm in a layer that reads
    another's latent rows (kv_source_layers).
    Linear-attention layers (tpumk.model.linear_attention, `LinearAttention.tensor_shapes`)
    replace the attention tensors by lin_qkv [H, C] (q | k | v, C = 2 Hk Dk + Hv Dv), lin_conv
    [taps, C], lin_norm [Dv], lin_out [Hv Dv, H], and Gated DeltaNet's lin_z [H, Hv Dv], lin_b,
    lin_a [H, Hv], lin_A_log, lin_dt_bias [Hv], or KDA's lin_f_a, lin_g_a [H, Dk], lin_f_b, lin_g_b
    [Dk, Hv Dk], lin_b [H, Hv], lin_A_log [Hv], lin_dt_bias [Hv Dk].

Loading real checkpoints lives in `tpumk.model.checkpoint`; packing into the kernel layout lives
with the kernel's plan.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError
from tpumk.model.config import ModelConfig
from tpumk.model.reference import Params, jnp_dtype


def expected_shapes(cfg: ModelConfig) -> Params:
    """The shape of every tensor of the reference layout, as the same nested structure: each
    part of the model (tpumk.model.parts) names its own tensors, in a fixed order (random
    weights are drawn in it)."""
    h, n, a = cfg.hidden_size, cfg.norms, cfg.attention
    top: Params = cfg.head.tensor_shapes()
    if cfg.rope_learned_freqs:  # Mistral Large 4: each RoPE frequency x exp(rope_alpha[j])
        top["rope_alpha"] = (cfg.qk_rope_head_dim // 2,)
    layers = []
    for i in range(cfg.num_layers):
        lay: Params = {"attn_norm": (h,)} if n.pre_norms else {}  # OLMo 2: only the post-sublayer norms
        linear = cfg.pattern.is_linear(i)  # a linear-attention layer's own tensors replace attention's
        if linear:
            lay.update(cfg.linear.tensor_shapes())
        elif cfg.is_mla:  # (a NoPE layer's widths, a layer reading another's latent rows: Mistral Large 4)
            lay.update(a.mla_layer_shapes(h, cfg.pattern.rotates(i), cfg.pattern.owns_kv(i)))
        else:
            lay.update(a.projection_shapes(h))
        if n.pre_norms and not n.parallel_blocks:  # Cohere: attention and the MLP read one normed input
            lay["mlp_norm"] = (h,)
        if not linear:
            lay.update(a.extra_shapes(h))
        if cfg.has_indexer(i):  # sparse attention's lightning indexer (tpumk.model.sparse_attention)
            lay.update(a.indexer_shapes(h))
        if n.post_norms:
            lay.update(post_attn_norm=(h,), post_mlp_norm=(h,))
        if n.residual_gates:  # Muse Spark: each sublayer joins the residual as alpha * x + beta * y
            lay.update({k: (h,) for k in RESIDUAL_GATES})
        lay.update(cfg.mlp.tensor_shapes(h) if cfg.pattern.is_dense(i) else cfg.moe.tensor_shapes(h))
        layers.append(lay)
    top["layers"] = layers
    return top


QKV_BIASES = ("bq", "bk", "bv")
FLOAT32_TENSORS = ("router", "router_bias")  # kept float32 under DeepSeek-V3 routing
# float32 whatever the model dtype, as transformers keeps them: the indexer's per-head weights,
# Mistral Large 4's learned RoPE frequencies
FLOAT32_ALWAYS = ("idx_weights", "rope_alpha")
# Muse Spark's residual gates (tpumk.model.spark), float32 as transformers keeps them
RESIDUAL_GATES = ("res_attn_alpha", "res_attn_beta", "res_mlp_alpha", "res_mlp_beta")


def tensor_dtype(cfg: ModelConfig, name: str, dt):
    """The dtype a reference-layout tensor is stored in: `dt`, except the DeepSeek-V3 gate, Muse
    Spark's residual gates and the sparse-attention indexer's per-head weights (transformers keeps
    `indexer.weights_proj` float32)."""
    if name in FLOAT32_ALWAYS or name in RESIDUAL_GATES or (
            (cfg.moe.router_correction_bias or cfg.moe.router_float32) and name in FLOAT32_TENSORS):
        return jnp.float32
    return dt


# Draws up to this many elements come from one compiled program per power-of-two size (larger
# ones, as a big model's, are drawn at their own shape)
BUCKETED_DRAW_MAX = 1 << 22


@functools.partial(jax.jit, static_argnums=1)
def _flat_normal(key: jax.Array, size: int) -> jax.Array:
    return jax.random.normal(key, (size,), jnp.float32)


def normal_draw(key: jax.Array, shape: tuple[int, ...]) -> np.ndarray:
    """`jax.random.normal(key, shape, float32)` as numpy, bit for bit. With threefry's partitionable
    counters (jax's default) element i's bits depend only on the key and i, so the first n draws
    of a longer vector are the draws of any n-element shape: one compiled program per
    power-of-two size instead of one per shape."""
    n = math.prod(shape)
    if not jax.config.jax_threefry_partitionable or n == 0 or n > BUCKETED_DRAW_MAX:
        return np.asarray(jax.random.normal(key, shape, jnp.float32))
    size = max(256, 1 << (n - 1).bit_length())
    return np.asarray(_flat_normal(key, size))[:n].reshape(shape)


def random_params(cfg: ModelConfig, seed: int = 0, dtype=None) -> Params:
    """Deterministic random weights for any config.

    Matrices are normal with std 1/sqrt(fan_in) (so each projection keeps activations at unit
    scale), output projections are scaled down by sqrt(2 * layers) so the residual stream grows
    slowly with depth, norm weights are 1 + small noise (so a kernel that ignores them fails),
    and the router is scaled up so routing decisions are not near-ties.
    """
    dt = dtype or jnp_dtype(cfg)
    check_host_memory(cfg)  # before the per-layer loop and any allocation
    shapes = expected_shapes(cfg)
    key = jax.random.PRNGKey(seed)
    depth_scale = 1.0 / np.sqrt(2.0 * cfg.num_layers)

    f32 = np.float32  # each scalar as the float32 that jnp's eager ops would use

    def make(name: str, shape: tuple[int, ...], k) -> jax.Array:
        # under a trace (jax.eval_shape of the weights, as the vLLM plugin takes their shapes) the
        # key is abstract: the same ops run as jnp's on the tracer
        traced = isinstance(k, jax.core.Tracer)
        n = jax.random.normal(k, shape, jnp.float32) if traced else normal_draw(k, shape)
        if name.endswith("norm"):
            w = f32(1.0) + f32(0.1) * n
        elif name == "router_bias":  # large enough to change some picks (it selects, never weighs)
            w = f32(0.1) * n
        elif name in RESIDUAL_GATES:  # about 1 each, apart enough that a swapped or dropped gate shows
            w = f32(1.0) + f32(0.2) * n
        elif name == "embed":
            w = n
        elif name == "sinks":  # about a score's size, so the sink takes a visible share of each softmax
            w = f32(1.0) + n
        elif name == "router_logit_bias":  # a logit's size: it moves picks and weights
            w = n
        elif name == "lin_A_log":  # decay rates A = exp(A_log) about 0.1-1: a state remembers a few tokens
            w = f32(-1.0) + f32(0.5) * n
        elif name == "lin_dt_bias":
            w = f32(0.5) * n
        elif name == "rope_alpha":  # frequencies x exp(alpha) about 0.6-1.6: a dropped alpha shows
            w = f32(0.3) * n
        elif name in ("q_log_scale", "idx_log_scale"):  # s ln(1 + p) about 0.1-0.5 at the tests' positions
            w = f32(0.2) * n
        elif name in ("q_log_bias", "idx_log_bias"):  # about 1: the query keeps its size
            w = f32(1.0) + f32(0.2) * n
        elif name == "idx_q_bias":
            w = f32(0.5) * n
        elif name == "idx_k_bias":  # about a normed lane's size, so a dropped bias shows
            w = f32(0.5) * n
        elif name in QKV_BIASES + ("e_gate_bias", "e_up_bias"):  # as large as a projection's output, so a dropped bias shows
            w = n
        elif name in ("bo", "e_down_bias"):  # as large as the projection's output (depth-scaled as wo)
            w = n * f32(depth_scale)
        else:
            fan_in = shape[-2]
            # jnp's `/ np.sqrt(fan_in)`: XLA folds a division by a constant into a multiplication
            # by the constant's float32 reciprocal
            w = n * (f32(1.0) / f32(np.sqrt(fan_in)))
            if name in ("wo", "w_down", "e_down", "s_down", "lin_out", "moe_out"):
                w = w * f32(depth_scale)
            if name == "router":
                w = w * f32(4.0)
        # numpy's float32 arithmetic and casts round as XLA's do: the same bits as these ops run
        # eagerly in jnp (tests/test_reference.py checks it), without a compiled program per shape
        # (device_put, as jnp.asarray would, but without jnp's staging program per shape)
        if traced:
            return w.astype(tensor_dtype(cfg, name, dt))
        return jax.device_put(np.asarray(w, np.float32).astype(tensor_dtype(cfg, name, dt)))

    return draw_leaves(shapes, key, make)


def draw_leaves(shapes, key, make) -> Params:
    """`make(name, shape, subkey)` for every leaf of `expected_shapes`' tree, each subkey split
    off `key` in turn (top-level leaves, then layer by layer): which key each weight is drawn
    from."""
    out: Params = {}
    for name, shape in shapes.items():
        if name == "layers":
            continue
        key, sub = jax.random.split(key)
        out[name] = make(name, shape, sub)
    out["layers"] = []
    for lay_shapes in shapes["layers"]:
        lay = {}
        for name, shape in lay_shapes.items():
            key, sub = jax.random.split(key)
            lay[name] = make(name, shape, sub)
        out["layers"].append(lay)
    return out


def host_memory_bytes() -> int | None:
    """Physical memory of this host (None when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(cfg: ModelConfig) -> None:
    """Random weights are made on the host (each matrix drawn in float32, then cast): refuse a
    model whose weights cannot fit this host's memory, with one line, before allocating."""
    need = cfg.param_count() * max(cfg.dtype_bytes, 2)
    have = host_memory_bytes()
    if have is not None and need > 0.8 * have:
        raise ConfigError(
            f"model '{cfg.name}': random weights need {need / 1e9:,.1f} GB of host memory, more than 80% of "
            f"this host's {have / 1e9:,.1f} GB; use a smaller model")


def cast_params(params: Params, dtype) -> Params:
    return jax.tree.map(lambda a: a.astype(dtype), params)
