"""A KV cache in one byte per element: the format, and what it costs in bytes.

`--kv-dtype fp8 | int8` (issue 29) stores each key / value row as 1-byte codes with one float32
scale per (token, kv head): for a row x of head_dim elements, `scale = max|x| / QMAX` and
`code = x / scale` (float8_e4m3fn, QMAX 448, rounded to nearest by the cast; or int8, QMAX 127,
rounded to nearest and clipped). Reading gives `code * scale` in float32, rounded to the model
dtype, so attention's numerics after the read are those of a model-dtype cache. An MLA model's
latent row is one "head": one scale per token.

Why per (token, kv head) and not per page (docs/quantization.md has the measurement):
- a row is quantized once, when its token is written, and never again. A per-page scale grows
  with the page's largest row, so every later row that raises it re-quantizes the rows already
  on the page (a second rounding of each, and a rewrite the kernel's in-place page update would
  have to do for every earlier row);
- bytes: at head_dim 128 the scale adds 4 bytes to 128, (128 + 4) / 256 = 0.516 of a bfloat16
  cache; per page of 16 tokens it would be 0.502. Both halve the cache; the difference is 3 %.
- an outlier token (the first token of a sequence often has keys far larger than the rest)
  coarsens only its own row, not its page's other 15.

Layout (the reference's paged cache, `tpumk.model.reference.QuantizedKVCache`): codes
`[layers, pages, page_size, kv_heads * head_dim]` as the model-dtype cache, scales
`[layers, pages, page_size, kv_heads]` float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError


class KvFormat(NamedTuple):
    name: str
    dtype: object  # the codes' jnp dtype
    qmax: float  # the largest code magnitude a scale maps the row's max|x| to


KV_FORMATS = {
    "fp8": KvFormat("fp8", jnp.float8_e4m3fn, 448.0),
    "int8": KvFormat("int8", jnp.int8, 127.0),
}
SCALE_BYTES = 4  # one float32 per (token, kv head)


def kv_format(name: str) -> KvFormat:
    """The format named by `--kv-dtype` (fp8, int8)."""
    if name not in KV_FORMATS:
        raise ConfigError(f"--kv-dtype: unknown KV cache format {name!r:.40} (expected one of {', '.join(KV_FORMATS)})")
    return KV_FORMATS[name]


def format_of(codes) -> KvFormat:
    """The format whose codes `codes` holds (by dtype)."""
    for f in KV_FORMATS.values():
        if np.dtype(codes.dtype) == np.dtype(f.dtype):
            return f
    raise ValueError(f"not a quantized KV cache: codes of dtype {codes.dtype}")


def quantize_rows(x, fmt: KvFormat):
    """x [..., heads, head_dim] (any float dtype) -> (codes [..., heads, head_dim] in fmt.dtype,
    scales [..., heads] float32). A row of zeros gets scale 0 and codes 0 (it reads back as 0)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = amax / fmt.qmax
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    y = x / safe
    if fmt.name == "int8":
        codes = jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax).astype(fmt.dtype)
    else:  # |y| <= 448 by construction: the cast rounds to nearest and never saturates
        codes = y.astype(fmt.dtype)
    return codes, scale


def dequantize_rows(codes, scales, dtype):
    """codes [..., heads, head_dim], scales [..., heads] -> the rows in `dtype` (via float32)."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


def cache_rows(cfg) -> tuple[int, int, int]:
    """(heads, width of one head's row, tensors) of a model's cache: kv heads of head_dim, K and
    V; an MLA model's one latent row per token, K only."""
    if cfg.is_mla:
        return 1, cfg.attention.kv_cache_width, 1
    return cfg.num_kv_heads, cfg.head_dim, 2


def cache_bytes_per_token(kv_heads: int, head_dim: int, layers: int, fmt: KvFormat | None,
                          model_dtype_bytes: int = 2, tensors: int = 2) -> int:
    """Bytes one token's K and V rows (`tensors` = 2; an MLA latent row: 1) take in every layer:
    head_dim codes + one scale per kv head in a quantized cache, head_dim model-dtype elements
    otherwise."""
    per_head = head_dim * model_dtype_bytes if fmt is None else head_dim + SCALE_BYTES
    return layers * tensors * kv_heads * per_head
