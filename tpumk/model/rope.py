"""RoPE frequencies of a GQA model: plain, or scaled (`rope_scaling` linear or llama3).

What transformers computes (`modeling_rope_utils`), in float32, over head_dim / 2
frequencies inv_freq_i = 1 / theta^(2i / head_dim):

- linear: every frequency divided by `rope_factor` (positions interpolated);
- llama3 (Llama 3.1 / 3.2): wavelengths 2 pi / inv_freq longer than original_max_position /
  low_freq_factor are divided by `rope_factor`, those shorter than original_max_position /
  high_freq_factor kept, and the band between blends the two with a weight linear in
  original_max_position / wavelength;
- longrope (Phi-3.5, Phi-4-mini): inv_freq_i = 1 / (short_factor_i * theta^(2i / head_dim));
  transformers switches to long_factor once a sequence passes original_max_position, which a
  fixed build cannot follow, so a longrope build's context stays within it (tpumk.plan.spec);
- yarn (tpumk.model.yarn, as for MLA models) over the rotary lanes.

longrope and yarn also scale cos and sin by an attention factor (`attention_factor`), so the
roped q and k each carry it; linear and llama3 leave it at 1.

A `dynamic` scaling depends on the sequence length at run time, so it is refused when read
(tpumk.model.config).

`query_scale` is llama-4's attention temperature as Mistral 4 and Ministral 3 configure it
(`rope_parameters.llama_4_scaling_beta` over its `original_max_position_embeddings`): a factor
on each query, by its position, after RoPE (any model, GQA or MLA: the reference and the
megakernel's glue compute it with this one function).
"""

from __future__ import annotations

import math

import numpy as np

from tpumk.model import yarn
from tpumk.model.parts import Positions


def plain_inv_freq(head_dim: int, theta: float, xp=np):
    """float32 [head_dim / 2]: 1 / theta^(2i / head_dim)."""
    exponents = xp.arange(0, head_dim, 2, dtype=xp.float32) / xp.float32(head_dim)
    return (xp.float32(1.0) / (xp.float32(theta) ** exponents)).astype(xp.float32)


def inv_freq(pos: Positions, xp=np, local: bool = False):
    """float32 [head_dim / 2] inverse frequencies of a GQA model's rotary lanes. `xp` is numpy
    (host constants) or jax.numpy: the reference and the kernel's glue compute them in the
    traced step, as before scaling existed (the compiler's static estimate of the step moved
    when they became a baked constant), with the same ops on both sides. `local`: those of the
    sliding-window layers of a model with `rope_local_theta` (plain, unscaled: Gemma 3)."""
    rotary = pos.rotary_width
    if local and pos.rope_local_theta:
        freqs = plain_inv_freq(rotary, pos.rope_local_theta, xp)
    else:
        freqs = _scaled_inv_freq(pos, plain_inv_freq(rotary, pos.rope_theta, xp), xp)
    if rotary == pos.head_dim:
        return freqs
    # Partial rotary (Positions.rotary_dim): each half of a head holds its rotary lanes first,
    # then unrotated ones, whose frequency 0 leaves them exactly as they are (cos 1, sin 0). A
    # lane-padded head (tpumk.plan.padding): each half of it is its true half then zeros, so
    # lane i still pairs with lane i + head_dim / 2; the zero lanes' frequency is never seen.
    return xp.concatenate([freqs, xp.zeros(((pos.head_dim - rotary) // 2,), xp.float32)])


def attention_factor(pos: Positions, local: bool = False) -> float:
    """The factor on cos and sin (1.0 but for longrope and yarn); `local` as for inv_freq (Gemma
    3's sliding layers have plain RoPE)."""
    if local and pos.rope_local_theta:
        return 1.0
    if pos.yarn_factor:
        return float(yarn.attention_factor(pos))
    if pos.rope_scaling != "longrope":
        return 1.0
    if pos.rope_attention_factor:
        return float(pos.rope_attention_factor)
    factor = pos.rope_factor
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(pos.rope_original_max_position))


def cos_sin_scale(pos: Positions, xp=np, local: bool = False):
    """None when cos and sin are unscaled, else float32 [head_dim / 2]: attention_factor on the
    rotary lanes' frequencies and 1 on the unrotated ones (transformers scales only the rotated
    part of a partially rotary head; the rest passes through unchanged)."""
    factor = attention_factor(pos, local)
    if factor == 1.0:
        return None
    rotary = pos.rotary_width
    scale = np.concatenate([np.full(rotary // 2, factor, np.float32),
                            np.ones((pos.head_dim - rotary) // 2, np.float32)])
    return xp.asarray(scale)


def query_scale(pos: Positions, positions, dtype):
    """None without position-scaled queries, else float32 of `positions`' shape: 1 + beta *
    ln(1 + floor(p / interval)) (transformers' `get_llama_4_attn_scale`, float32), rounded to
    the model dtype `dtype` as transformers casts it before multiplying. The floor is an integer
    division (exact; transformers divides in float32, the same for any position below 2^24);
    a negative position (a token outside the cache, which sees no key) is read as 0, so its
    factor stays finite."""
    if not pos.query_scale_beta:
        return None
    import jax.numpy as jnp  # here only: the frequencies above are host numpy unless given jnp

    steps = (jnp.maximum(positions, 0) // pos.query_scale_interval).astype(jnp.float32)
    scale = 1.0 + jnp.float32(pos.query_scale_beta) * jnp.log(1.0 + steps)
    return scale.astype(dtype).astype(jnp.float32)


def _scaled_inv_freq(pos: Positions, base, xp):
    if pos.yarn_factor:  # host constants, the same array on both sides
        return xp.asarray(yarn.inv_freq(pos, pos.rotary_width))
    if pos.rope_scaling == "longrope":  # as transformers: 1 / (factor * theta^(2i/d))
        rotary = pos.rotary_width
        exponents = xp.arange(0, rotary, 2, dtype=xp.float32) / xp.float32(rotary)
        short = xp.asarray(np.asarray(pos.rope_short_factor, np.float32))
        return (xp.float32(1.0) / (short * xp.float32(pos.rope_theta) ** exponents)).astype(xp.float32)
    factor = xp.float32(pos.rope_factor)
    if pos.rope_scaling == "linear":
        return (base / factor).astype(xp.float32)
    if pos.rope_scaling != "llama3":
        return base
    old = xp.float32(pos.rope_original_max_position)
    low, high = xp.float32(pos.rope_low_freq_factor), xp.float32(pos.rope_high_freq_factor)
    wavelen = xp.float32(2 * np.pi) / base
    scaled = xp.where(wavelen > old / low, base / factor, base).astype(xp.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(xp.float32)
    blended = ((1 - smooth) * scaled / factor + smooth * scaled).astype(xp.float32)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return xp.where(medium, blended, scaled).astype(xp.float32)
