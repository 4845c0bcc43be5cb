"""Elementwise pieces of a layer, written for a kernel body: RMSNorm, QK-norm + RoPE, SwiGLU.

Each follows its twin in tpumk.model.reference op for op (float32 throughout), so interpret-mode runs
agree with the reference to float32 rounding. `rope_tables` runs outside the kernel (glue): it
turns positions into the cos / signed-sin rows the kernel multiplies by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [N, K] f32, w [1, K] f32 -> x * rsqrt(mean(x^2) + eps) * w (reference.rms_norm)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [N] -> (cos [N, D], signed sin [N, D]) for rotate-half RoPE (glue, outside the kernel).

    The sin row carries the rotate-half sign (-sin on the first half), so in the kernel
    rope(x) = x * cos + roll(x, D/2) * sin: roll by half swaps the halves, the sign makes it
    concat(-x2, x1) as in reference.rope. Same ops as the reference, so the tables are bitwise equal."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    return jnp.concatenate([cos, cos], -1), jnp.concatenate([-sin, sin], -1)


def rope(x: jax.Array, cos: jax.Array, sin_signed: jax.Array) -> jax.Array:
    """x [N, D] f32 (one head) rotated by the rows' positions (see rope_tables)."""
    half = x.shape[-1] // 2
    return x * cos + pltpu.roll(x, half, 1) * sin_signed


def swiglu_act(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in f32 (reference.swiglu before the down projection)."""
    return jax.nn.silu(gate) * up
