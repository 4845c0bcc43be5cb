"""RoPE frequencies and scales of YaRN (`rope_scaling` type yarn): an MLA model's, and a GQA
model's through tpumk.model.rope (Qwen3 / Qwen2.5 long-context configs, gpt-oss).

What transformers computes (`modeling_rope_utils._compute_yarn_parameters` and DeepseekV3's
`yarn_get_mscale` / `yarn_apply_mscale`), over the qk_rope_head_dim rotated lanes:

- inverse frequencies blend interpolation (1 / (factor * base^(2i/d))) and extrapolation
  (1 / base^(2i/d)) by a linear ramp between the correction dimensions of beta_fast and
  beta_slow rotations over original_max_position_embeddings (floored / ceiled when `truncate`);
- `attention_factor` multiplies cos and sin (so the roped query and key lanes each carry it):
  given, or mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
  mscale(factor), with mscale(s, m) = 0.1 m ln s + 1 (1 when s <= 1);
- the softmax scale 1/sqrt(qk_nope + qk_rope) is multiplied by mscale(factor, mscale_all_dim)^2
  when mscale_all_dim is set.

Everything is computed once on the host in float32, as transformers does.
"""

from __future__ import annotations

import math

import numpy as np

from tpumk.model.parts import Attention, Positions


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def inv_freq(pos: Positions, dim: int) -> np.ndarray:
    """float32 [dim / 2] inverse frequencies of the `dim` rotated lanes: an MLA model's
    qk_rope_head_dim, a GQA model's rotary width (tpumk.model.rope)."""
    base = pos.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if not pos.yarn_factor:
        return extrapolation
    factor = pos.yarn_factor
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(pos.yarn_original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(pos.yarn_beta_fast), correction_dim(pos.yarn_beta_slow)
    if pos.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


def attention_factor(pos: Positions) -> float:
    """The factor on cos and sin (1.0 without YaRN)."""
    if not pos.yarn_factor:
        return 1.0
    if pos.yarn_attention_factor:
        return float(pos.yarn_attention_factor)
    if pos.yarn_mscale and pos.yarn_mscale_all_dim:
        return float(_mscale(pos.yarn_factor, pos.yarn_mscale) / _mscale(pos.yarn_factor, pos.yarn_mscale_all_dim))
    return _mscale(pos.yarn_factor)


def softmax_scale(att: Attention, pos: Positions) -> float:
    """The scale of an MLA model's attention scores (before the softmax)."""
    scale = (att.qk_nope_head_dim + att.qk_rope_head_dim) ** -0.5
    if pos.yarn_factor and pos.yarn_mscale_all_dim:
        m = _mscale(pos.yarn_factor, pos.yarn_mscale_all_dim)
        scale = scale * m * m
    return scale
