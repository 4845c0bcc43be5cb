"""The numerics every reference function shares: the model dtype, RMSNorm and the matrix-product
contract (activation cast to the weight dtype, float32 accumulation, as the MXU; a
`QuantizedMatrix` multiplied in its compute dtype with its scales applied as the kernel does).

Below `tpumk.model.reference` and `tpumk.model.mla`, which both build on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpumk.model.config import ModelConfig
from tpumk.model.quantize import QuantizedMatrix


def jnp_dtype(cfg: ModelConfig):
    return jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16


def rms_norm(x: jax.Array, w: jax.Array, eps: float, width: int | None = None) -> jax.Array:
    """RMSNorm over the last axis; `width` (default: that axis) is the divisor of the mean square,
    the true hidden size when x carries zero padding lanes (ModelConfig.norms.width)."""
    x = x.astype(jnp.float32)
    ms = jnp.sum(x * x, axis=-1, keepdims=True) / (width or x.shape[-1])
    return x * jax.lax.rsqrt(ms + eps) * w.astype(jnp.float32)


def layer_norm(x: jax.Array, w: jax.Array, eps: float, width: int | None = None) -> jax.Array:
    """LayerNorm without bias over the last axis (Cohere's, in float32): (x - mean) *
    rsqrt(variance + eps) * w, mean and variance over the first `width` lanes (default: all);
    zero padding lanes past `width` stay out of both and come out 0."""
    x = x.astype(jnp.float32)
    n = width or x.shape[-1]
    mean = jnp.sum(x, axis=-1, keepdims=True) / n
    true = jax.lax.broadcasted_iota(jnp.int32, (1,) * (x.ndim - 1) + (x.shape[-1],), x.ndim - 1) < n
    d = jnp.where(true, x - mean, 0.0)
    var = jnp.sum(d * d, axis=-1, keepdims=True) / n
    return d * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32)


def residual_norm(kind: str, x: jax.Array, w: jax.Array, eps: float, width: int | None = None) -> jax.Array:
    """The residual stream's norm of ModelConfig.norm_kind: RMSNorm, or LayerNorm without bias."""
    return (layer_norm if kind == "layer" else rms_norm)(x, w, eps, width)


def matmul(x: jax.Array, w) -> jax.Array:
    """x @ w with x cast to the weight dtype and float32 accumulation (the MXU contract).
    A `QuantizedMatrix` (tpumk.model.quantize): x and the codes in its compute dtype, the
    float32 column sums times the column scales (what the kernel computes, tile by tile); group
    scales after each group's sum, then nvfp4's global scale on the total."""
    if isinstance(w, QuantizedMatrix):
        dt = w.compute.dtype
        if not w.grouped:
            return jnp.matmul(x.astype(dt), w.q.astype(dt), preferred_element_type=jnp.float32) * w.scale
        # Group scales: each group's float32 sum times its scales, then the groups summed.
        xg, qg = grouped_operands(x, w.q, w)
        parts = jnp.einsum("...gk,gkm->...gm", xg, qg, precision=lax.Precision.HIGHEST)
        return jnp.sum(parts * w.scale.astype(jnp.float32), axis=-2) * w.outer_scales()
    return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def expert_matmul(x: jax.Array, w) -> jax.Array:
    """Every expert at once: x [E, N, K] (or [N, K], shared by all experts) @ w [E, K, M] ->
    [E, N, M] float32, `matmul`'s contract per expert (group scales per 128-row group)."""
    dt = w.compute.dtype if isinstance(w, QuantizedMatrix) else w.dtype
    xs = "enk" if x.ndim == 3 else "nk"
    if not isinstance(w, QuantizedMatrix):
        return jnp.einsum(f"{xs},ekm->enm", x.astype(dt), w, preferred_element_type=jnp.float32)
    if not w.grouped:
        y = jnp.einsum(f"{xs},ekm->enm", x.astype(dt), w.q.astype(dt), preferred_element_type=jnp.float32)
        return y * w.scale[:, None, :]
    xg, qg = grouped_operands(x, w.q, w)
    parts = jnp.einsum(f"{xs[:-1]}gk,egkm->engm", xg, qg, precision=lax.Precision.HIGHEST)
    return jnp.sum(parts * w.scale.astype(jnp.float32)[:, None], axis=-2) * w.outer_scales(2)


def grouped_operands(x: jax.Array, q: jax.Array, w: QuantizedMatrix) -> tuple[jax.Array, jax.Array]:
    """x [..., K] and codes q [..., K, M] (w's codes, or a gather of them) split into w's scale
    groups, [..., G, group] and [..., G, group, M], a partial last group zero-padded on both
    sides. Both are rounded to w's compute dtype and held in float32: a product of two such
    values is exact in f32, and XLA:CPU has no batched bf16 x bf16 -> f32 dot."""
    dt, g = w.compute.dtype, w.scale.shape[-2]
    pad = g * w.group - q.shape[-2]
    xg = jnp.pad(x.astype(dt).astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    qg = jnp.pad(q.astype(dt).astype(jnp.float32), [(0, 0)] * (q.ndim - 2) + [(0, pad), (0, 0)])
    return xg.reshape(*x.shape[:-1], g, w.group), qg.reshape(*q.shape[:-2], g, w.group, q.shape[-1])
