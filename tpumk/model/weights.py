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
               shared_router [H, 1] (shared_expert_gate: the shared output's sigmoid gate)
      DeepSeek-V3 routing (router_correction_bias): router [H, E] and router_bias [E] are
               float32 whatever the model dtype (transformers keeps the gate in float32)
    MLA layers (tpumk.model.mla) replace wq, wk, wv, q_norm, k_norm by wq_a, q_a_norm, wq_b
    (or wq when q_lora_rank = 0), wkv_a, kv_a_norm, wkv_b; wo is [Hq*V, H].

Loading real checkpoints lives in `tpumk.model.checkpoint`; packing into the kernel layout lives
with the kernel's plan.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError
from tpumk.model.config import ModelConfig
from tpumk.model.reference import Params, jnp_dtype


def expected_shapes(cfg: ModelConfig) -> Params:
    """The shape of every tensor of the reference layout, as the same nested structure."""
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    top: Params = {"embed": (v, h), "final_norm": (h,)}
    if not cfg.tie_embeddings:
        top["lm_head"] = (h, v)
    layers = []
    for i in range(cfg.num_layers):
        if cfg.is_mla:
            lay = {"attn_norm": (h,), **_mla_shapes(cfg), "mlp_norm": (h,)}
        else:
            lay = {"attn_norm": (h,), "wq": (h, cfg.q_size), "wk": (h, cfg.kv_size), "wv": (h, cfg.kv_size),
                   "wo": (cfg.q_size, h), "mlp_norm": (h,)}
            if cfg.qkv_bias:
                lay.update(bq=(cfg.q_size,), bk=(cfg.kv_size,), bv=(cfg.kv_size,))
        if not cfg.pre_norms:  # OLMo 2: only the post-sublayer norms
            del lay["attn_norm"], lay["mlp_norm"]
        elif cfg.parallel_blocks:  # Cohere: attention and the MLP read one normed input
            del lay["mlp_norm"]
        if cfg.qk_norm:  # per head, or across every head (qk_norm_whole)
            q_norm, k_norm = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_whole else (d, d)
            lay.update(q_norm=(q_norm,), k_norm=(k_norm,))
        if cfg.post_norms:
            lay.update(post_attn_norm=(h,), post_mlp_norm=(h,))
        if cfg.layer_is_dense(i):
            lay.update(w_gate=(h, cfg.ffn_size), w_up=(h, cfg.ffn_size), w_down=(cfg.ffn_size, h))
        else:
            e, f = cfg.num_experts, cfg.expert_ffn_size
            lay.update(router=(h, e), e_gate=(e, h, f), e_up=(e, h, f), e_down=(e, f, h))
            if cfg.router_correction_bias:
                lay.update(router_bias=(e,))
            if cfg.num_shared_experts:
                s = cfg.num_shared_experts * cfg.shared_expert_ffn_size
                lay.update(s_gate=(h, s), s_up=(h, s), s_down=(s, h))
                if cfg.shared_expert_gate:  # Qwen2-MoE: sigmoid(x @ shared_router) scales the shared output
                    lay.update(shared_router=(h, 1))
        layers.append(lay)
    top["layers"] = layers
    return top


def _mla_shapes(cfg: ModelConfig) -> Params:
    h, hq = cfg.hidden_size, cfg.num_q_heads
    out: Params = {}
    if cfg.q_lora_rank:
        out.update(wq_a=(h, cfg.q_lora_rank), q_a_norm=(cfg.q_lora_rank,), wq_b=(cfg.q_lora_rank, cfg.q_size))
    else:
        out.update(wq=(h, cfg.q_size))
    out.update(wkv_a=(h, cfg.kv_cache_width), kv_a_norm=(cfg.kv_lora_rank,),
               wkv_b=(cfg.kv_lora_rank, hq * (cfg.qk_nope_head_dim + cfg.v_head_dim)), wo=(hq * cfg.v_head_dim, h))
    return out


QKV_BIASES = ("bq", "bk", "bv")
FLOAT32_TENSORS = ("router", "router_bias")  # kept float32 under DeepSeek-V3 routing


def tensor_dtype(cfg: ModelConfig, name: str, dt):
    """The dtype a reference-layout tensor is stored in: `dt`, except the DeepSeek-V3 gate."""
    return jnp.float32 if cfg.router_correction_bias and name in FLOAT32_TENSORS else dt


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

    def make(name: str, shape: tuple[int, ...], k) -> jax.Array:
        if name.endswith("norm"):
            w = 1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)
        elif name == "router_bias":  # large enough to change some picks (it selects, never weighs)
            w = 0.1 * jax.random.normal(k, shape, jnp.float32)
        elif name == "embed":
            w = jax.random.normal(k, shape, jnp.float32)
        elif name in QKV_BIASES:  # as large as a projection's output, so a dropped bias shows
            w = jax.random.normal(k, shape, jnp.float32)
        else:
            fan_in = shape[-2]
            w = jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)
            if name in ("wo", "w_down", "e_down", "s_down"):
                w = w * depth_scale
            if name == "router":
                w = w * 4.0
        return w.astype(tensor_dtype(cfg, name, dt))

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
