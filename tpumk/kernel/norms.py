"""Elementwise pieces of a layer, written for a kernel body: RMSNorm, LayerNorm, QK-norm + RoPE, SwiGLU.

Each follows its twin in tpumk.model.reference op for op (float32 throughout), so interpret-mode runs
agree with the reference to float32 rounding. `rope_tables` runs outside the kernel (glue): it
turns positions into the cos / signed-sin rows the kernel multiplies by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from tpumk.model.reference import mlp_activation


def rms_norm(x: jax.Array, w: jax.Array, eps: float, width: int | None = None) -> jax.Array:
    """x [N, K] f32, w [1, K] f32 -> x * rsqrt(sum(x^2) / width + eps) * w (reference.rms_norm);
    `width` < K when x's last lanes are zero padding (ModelConfig.norms.width)."""
    ms = jnp.sum(x * x, axis=-1, keepdims=True) / (width or x.shape[-1])
    return x * jax.lax.rsqrt(ms + eps) * w


def rms_norm_from_sums(x: jax.Array, w: jax.Array, eps: float, sums: jax.Array, width: int) -> jax.Array:
    """rms_norm of rows whose sums of squares `sums` [N, 1] were taken elsewhere (a norm across
    heads that several devices hold, all-reduced): x * rsqrt(sums / width + eps) * w."""
    return x * jax.lax.rsqrt(sums / width + eps) * w


def layer_norm(x: jax.Array, w: jax.Array, eps: float, width: int | None = None) -> jax.Array:
    """x [N, K] f32, w [1, K] f32 -> LayerNorm without bias (reference's ops.layer_norm): mean
    and variance over the first `width` lanes (< K when the last lanes are zero padding)."""
    n = width or x.shape[-1]
    mean = jnp.sum(x, axis=-1, keepdims=True) / n
    d = jnp.where(_lane(x) < n, x - mean, 0.0)  # padding lanes stay 0 and out of the variance
    var = jnp.sum(d * d, axis=-1, keepdims=True) / n
    return d * jax.lax.rsqrt(var + eps) * w


def residual_norm(kind: str, x: jax.Array, w: jax.Array, eps: float, width: int | None = None) -> jax.Array:
    """The residual stream's norm of ModelConfig.norm_kind: rms_norm, or layer_norm (Cohere)."""
    return (layer_norm if kind == "layer" else rms_norm)(x, w, eps, width)


def rope_tables(positions: jax.Array, inv_freq, heads: int = 1, scale=None) -> tuple[jax.Array, jax.Array]:
    """positions [N], inv_freq [D / 2] (tpumk.model.rope.inv_freq) -> (cos [N, heads*D], signed
    sin [N, heads*D]) for rotate-half RoPE (glue, outside the kernel); `heads` > 1 repeats the
    row for that many heads side by side (64-wide heads are rotated two per 128-lane block,
    `rope_heads`); `scale` [D / 2] multiplies both (tpumk.model.rope.cos_sin_scale).

    The sin row carries the rotate-half sign (-sin on the first half), so in the kernel
    rope(x) = x * cos + roll(x, D/2) * sin: roll by half swaps the halves, the sign makes it
    concat(-x2, x1) as in reference.rope. Same ops as the reference, so the tables are bitwise equal."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if scale is not None:  # longrope / yarn (tpumk.model.rope.cos_sin_scale), as the reference
        cos, sin = cos * scale, sin * scale
    return jnp.concatenate([cos, cos] * heads, -1), jnp.concatenate([-sin, sin] * heads, -1)


def rope(x: jax.Array, cos: jax.Array, sin_signed: jax.Array) -> jax.Array:
    """x [N, D] f32 (one head) rotated by the rows' positions (see rope_tables)."""
    half = x.shape[-1] // 2
    return x * cos + pltpu.roll(x, half, 1) * sin_signed


def _lane(x: jax.Array) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (1, x.shape[-1]), 1)


def rms_norm_heads(x: jax.Array, w: jax.Array, eps: float, head_dim: int, width: int | None = None) -> jax.Array:
    """rms_norm of each head_dim-wide head of x [N, K] separately (K = head_dim: rms_norm over
    `width` lanes' worth, a lane-padded head's true width); w [1, K] holds the weight once per
    head. Two 64-wide heads: masked lane sums, no unaligned lane slices."""
    if x.shape[-1] == head_dim:
        return rms_norm(x, w, eps, width)
    assert x.shape[-1] == 2 * head_dim, "two heads per block"
    first = _lane(x) < head_dim
    sq = x * x
    s0 = jnp.sum(jnp.where(first, sq, 0.0), axis=-1, keepdims=True)
    s1 = jnp.sum(jnp.where(first, 0.0, sq), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.where(first, s0, s1) / head_dim + eps) * w


def rope_heads(x: jax.Array, cos: jax.Array, sin_signed: jax.Array, head_dim: int) -> jax.Array:
    """rope of each head_dim-wide head of x [N, K] (K = head_dim: rope); cos / sin from
    rope_tables(..., heads=K // head_dim). Two 64-wide heads [a1 a2 b1 b2] (32 lanes each):
    the per-head half swap [a2 a1 b2 b1] takes lanes i % 64 < 32 from roll(x, 96) (x[i + 32],
    jnp.roll's convention, which pltpu.roll follows) and the others from roll(x, 32) (x[i - 32])."""
    if x.shape[-1] == head_dim:
        return rope(x, cos, sin_signed)
    k, half = x.shape[-1], head_dim // 2
    low = jax.lax.rem(_lane(x), head_dim) < half
    swapped = jnp.where(low, pltpu.roll(x, k - half, 1), pltpu.roll(x, half, 1))
    return x * cos + swapped * sin_signed


def swiglu_act(gate: jax.Array, up: jax.Array, act: str = "silu") -> jax.Array:
    """act(gate) * up in f32 (reference.gated_mlp before the down projection): SwiGLU, or GeGLU
    with act = gelu_tanh (ModelConfig.mlp_act)."""
    return mlp_activation(gate, act) * up
