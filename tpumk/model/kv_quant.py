"""A KV cache in one byte per element: the format, and what it costs in bytes.

`--kv-dtype fp8 | int8` (issue 29) stores each key / value row as 1-byte codes with one float32
scale per (token, kv head): for a row x of head_dim elements, `scale` is the smallest power of
two with `max|x| / scale <= QMAX` (`pow2_scales` says why a power of two) and `code = x / scale`
(float8_e4m3fn, QMAX 448, rounded to nearest by the cast; or int8, QMAX 127, rounded to nearest
and clipped). Reading gives `code * scale` in float32, rounded to the model
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

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from tpumk.errors import ConfigError


class KvFormat(NamedTuple):
    name: str
    dtype: object  # the codes' jnp dtype
    qmax: float  # the largest code magnitude a scale maps the row's max|x| to


KV_FORMATS = {
    "fp8": KvFormat("fp8", jnp.float8_e4m3fn, 448.0),
    "int8": KvFormat("int8", jnp.int8, 127.0),
}
LANE_TILE = 128  # lanes of one vector tile: a page's rows are padded to whole tiles


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


def pow2_scales(amax, fmt: KvFormat):
    """Per-row scales from each row's max|x| (any shape, float32): the smallest power of two
    `scale` with max|x| / scale <= QMAX (up to one rounding of max|x| * (1 / QMAX)), and its
    exact reciprocal. A zero row gets scale 0 and reciprocal 1.

    Powers of two, because then `x * (1 / scale)` and `code * scale` are exact in float32 on every
    backend: the kernel (on TPU or in interpret mode) and the reference compute the same codes
    bit for bit. A divide-based scale max|x| / QMAX cannot be checked that way: XLA's CPU float32
    divide differs from the correctly rounded quotient in about a quarter of cases (measured:
    134,386 of 524,288 quotients, docs/quantization.md), and an int8 code at a .5 tie then rounds
    the other way. Elementwise integer and bit ops only, so the kernel calls this function itself."""
    t = (amax * (1.0 / fmt.qmax)).astype(jnp.float32)  # a multiply: correctly rounded everywhere
    bits = lax.bitcast_convert_type(t, jnp.int32)
    exponent = lax.shift_right_logical(bits, jnp.int32(23))  # t >= 0: no sign bit
    round_up = (jnp.bitwise_and(bits, jnp.int32(0x7FFFFF)) != 0).astype(jnp.int32)
    # the biased exponent of the power of two at or above t, in [1, 253] so both it and its
    # reciprocal are normal floats (|x| beyond ~1e36 saturates: not a K / V row)
    e = jnp.clip(exponent + round_up, 1, 253)
    scale = lax.bitcast_convert_type(lax.shift_left(e, jnp.int32(23)), jnp.float32)
    inverse = lax.bitcast_convert_type(lax.shift_left(254 - e, jnp.int32(23)), jnp.float32)
    zero = amax <= 0
    return jnp.where(zero, 0.0, scale), jnp.where(zero, 1.0, inverse)


def quantize_rows(x, fmt: KvFormat):
    """x [..., heads, head_dim] (any float dtype) -> (codes [..., heads, head_dim] in fmt.dtype,
    scales [..., heads] float32), `code = x / scale` with the power-of-two scale of `pow2_scales`
    (exact), int8 rounded to nearest even and clipped, fp8 rounded to nearest by the cast. A row
    of zeros gets scale 0 and codes 0 (it reads back as 0)."""
    x = x.astype(jnp.float32)
    scale, inverse = pow2_scales(jnp.max(jnp.abs(x), axis=-1), fmt)
    y = x * inverse[..., None]
    if fmt.name == "int8":
        codes = jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax).astype(fmt.dtype)
    else:  # |y| <= 448 (one rounding above at most, which the cast rounds back to 448): no saturation
        codes = y.astype(fmt.dtype)
    return codes, scale


def dequantize_rows(codes, scales, dtype):
    """codes [..., heads, head_dim], scales [..., heads] -> the rows in `dtype` (via float32)."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


def exponent_values(scales):
    """Power-of-two scales (`pow2_scales`) -> their biased float32 exponent minus 128, as int32
    (a scale is 2^(e - 127), e in [1, 253]; a zero scale gives -128). Bit ops only: the kernel
    calls it too."""
    e = lax.shift_right_logical(lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.int32), jnp.int32(23))
    return e - 128


def exponent_bytes(scales):
    """`exponent_values` as the int8 the page stores."""
    return exponent_values(scales).astype(jnp.int8)


def scales_of(exponents):
    """The inverse of `exponent_bytes`: stored bytes (any integer dtype, -128 .. 125) -> the
    float32 scales 2^(b + 1): exact, and -128 gives 0.0 (an unwritten or zero row)."""
    e = exponents.astype(jnp.int32) + 128
    return lax.bitcast_convert_type(lax.shift_left(e, jnp.int32(23)), jnp.float32)


EXPONENT_ALIGN = 4  # rows of one 1-byte DMA slice: Mosaic tiles 8-bit rows in fours (checked: tpu7x, v6e)
EXPONENT_OVERHEAD = 1 / 32  # pack tokens per row until the exponents' lane tile is at most this of the codes


@dataclass(frozen=True)
class PagedLayout:
    """How a quantized page sits in the cache: ONE array [L, pages, rows, lanes] of 1-byte
    elements holding every tensor's codes and their scale exponents, so a page is one DMA.

    A page of `page_size` tokens is `rows` = page_size / group rows; row r holds tokens
    r*group .. r*group + group - 1 (slot i at row i // group, group position g = i % group):
    token g of the row has tensor t's codes (heads x head_dim) at lanes (g*tensors + t) * width,
    and its exponent byte for (t, head h) at lane group*tensors*width + (g*tensors + t)*heads + h;
    the lanes are padded to whole 128-lane tiles. GQA: tensors K, V of kv_heads heads; MLA: one
    latent row (one "head" of kv_cache_width lanes).

    Why one array (issue 29's evidence): a KV tile streams one DMA per page and cache array, and
    by tpumk's timeline model (14 ns per descriptor on TPU7x, from the compiler's DMA model) a
    bfloat16 cache of 16-token pages is already bound by those descriptors, not bytes; separate
    code and scale arrays would cost 4 descriptors per page and make a 1-byte cache SLOWER. A
    per-token exponent needs a byte, which would pad a row by a whole 128-lane tile (qwen3-8b:
    2048 code bytes + 128 = 0.531 of a bfloat16 row), so `group` tokens share a row and its
    exponent tile: the smallest group (dividing page_size in rows of EXPONENT_ALIGN) whose tile
    is at most EXPONENT_OVERHEAD of the row's codes, else the largest. qwen3-8b at 16-token pages:
    group 2, 8 rows of 4224 bytes = 0.516 of the bfloat16 page, one DMA instead of two."""

    heads: int
    head_dim: int
    tensors: int  # 2: K and V; 1: MLA's latent row
    page_size: int
    kv_dtype: str

    @property
    def fmt(self) -> KvFormat:
        return kv_format(self.kv_dtype)

    @property
    def width(self) -> int:
        """Lanes of one token's one tensor: heads x head_dim."""
        return self.heads * self.head_dim

    def _lanes(self, group: int) -> int:
        return -(-(group * self.tensors * (self.width + self.heads)) // LANE_TILE) * LANE_TILE

    @property
    def group(self) -> int:
        """Tokens per row (see the class doc). An MLA latent row (one tensor) is always alone on
        its row: its width (576 lanes for DeepSeek-V3) is off the 128-lane grid, so a second
        token would start mid lane tile, where the kernel cannot address it; its exponent byte
        sits in the row's own lane padding (576 + 1 -> 640 lanes)."""
        if self.tensors == 1:
            return 1
        fits = [g for g in range(1, self.page_size + 1) if self.page_size % g == 0
                and (self.page_size // g) % EXPONENT_ALIGN == 0] or [1]
        for g in fits:
            if self._lanes(g) - g * self.tensors * self.width <= EXPONENT_OVERHEAD * g * self.tensors * self.width:
                return g
        return fits[-1]

    @property
    def rows(self) -> int:
        return self.page_size // self.group

    @property
    def lanes(self) -> int:
        return self._lanes(self.group)

    @property
    def codes_lanes(self) -> int:
        """The lane where the exponent bytes start (every token's codes lie below it)."""
        return self.group * self.tensors * self.width

    @property
    def page_bytes(self) -> int:
        return self.rows * self.lanes

    def shape(self, layers: int, pages: int) -> tuple[int, int, int, int]:
        return (layers, pages, self.rows, self.lanes)

    def pack(self, codes, exponents):
        """codes [..., page_size, tensors, heads, head_dim] (fmt dtype), exponents [..., page_size,
        tensors, heads] (int8, `exponent_bytes`) -> pages [..., rows, lanes]."""
        lead, g = codes.shape[:-4], self.group
        c = codes.reshape(*lead, self.rows, self.codes_lanes)
        e = exponents.reshape(*lead, self.rows, g * self.tensors * self.heads)
        if np.dtype(codes.dtype) != np.dtype(jnp.int8):
            e = lax.bitcast_convert_type(e, codes.dtype)  # the exponent byte's bits, in the codes' dtype
        pad = jnp.zeros((*lead, self.rows, self.lanes - self.codes_lanes - e.shape[-1]), codes.dtype)
        return jnp.concatenate([c, e, pad], axis=-1)

    def unpack(self, pages):
        """pages [..., rows, lanes] -> (codes [..., page_size, tensors, heads, head_dim],
        exponent bytes [..., page_size, tensors, heads] int8)."""
        lead = pages.shape[:-2]
        codes = pages[..., :self.codes_lanes].reshape(*lead, self.page_size, self.tensors, self.heads, self.head_dim)
        e = pages[..., self.codes_lanes:self.codes_lanes + self.group * self.tensors * self.heads]
        if np.dtype(pages.dtype) != np.dtype(jnp.int8):
            e = lax.bitcast_convert_type(e, jnp.int8)
        return codes, e.reshape(*lead, self.page_size, self.tensors, self.heads)

    def zeros(self, layers: int, pages: int):
        """An empty cache: every code 0 and every scale 0 (exponent byte -128)."""
        return self.pack(jnp.zeros((layers, pages, self.page_size, self.tensors, self.heads, self.head_dim),
                                   self.fmt.dtype),
                         jnp.full((layers, pages, self.page_size, self.tensors, self.heads), -128, jnp.int8))

    def write(self, cache, layer: int, page_ids, slots, rows):
        """rows [B, q, tensors, heads, head_dim] quantized (a power-of-two scale per row, tensor
        and head) into layer `layer` of cache [L, pages, rows, lanes] at page_ids / slots [B, q]
        (a page id past the pool drops the write)."""
        codes, exps = self.unpack(cache[layer])
        c, s = quantize_rows(rows, self.fmt)
        codes = codes.at[page_ids, slots].set(c, mode="drop")
        exps = exps.at[page_ids, slots].set(exponent_bytes(s), mode="drop")
        return cache.at[layer].set(self.pack(codes, exps))

    def read(self, cache, layer: int, tables, dtype):
        """[B, ctx, tensors, heads, head_dim]: each sequence's pages of layer `layer` in order
        (tables [B, pages_per_seq], already clipped into the pool), dequantized to `dtype`."""
        codes, exps = self.unpack(cache[layer][tables])  # [B, pps, P, T, H, D]
        b = tables.shape[0]
        rows = dequantize_rows(codes, scales_of(exps), dtype)
        return rows.reshape(b, -1, self.tensors, self.heads, self.head_dim)


def split_heads(pages, layout: PagedLayout, parts: list[list[int]]):
    """A packed cache in `layout` -> each part's heads (`parts[d]`: head indices, in order)
    packed in that part's own layout, the parts side by side along the last axis (the
    many-device cache: device d's lanes are part d's)."""
    codes, exps = layout.unpack(pages)
    local = dataclasses.replace(layout, heads=len(parts[0]))
    idx = [jnp.asarray(p) for p in parts]
    return jnp.concatenate([local.pack(codes[..., i, :], exps[..., i]) for i in idx], axis=-1)


def join_heads(pages, layout: PagedLayout, parts: int, take: list[int]):
    """The inverse of `split_heads`: `pages` holds `parts` parts side by side, each packed in
    the per-part layout; the parts `take` (in order) are unpacked, their heads joined, and
    packed in `layout` (the whole model's)."""
    local_heads = layout.heads // len(take)
    local = dataclasses.replace(layout, heads=local_heads)
    chunks = jnp.split(pages, parts, axis=-1)
    got = [local.unpack(chunks[d]) for d in take]
    return layout.pack(jnp.concatenate([c for c, _ in got], axis=-2), jnp.concatenate([e for _, e in got], axis=-1))


def layout_for(cfg, page_size: int, kv_dtype: str, heads: int | None = None) -> PagedLayout:
    """The quantized cache layout of model `cfg` (`heads`: a device's kv heads, default all)."""
    h, d, t = cache_rows(cfg)
    return PagedLayout(heads if heads is not None else h, d, t, page_size, kv_dtype)


def cache_rows(cfg) -> tuple[int, int, int]:
    """(heads, width of one head's row, tensors) of a model's cache: kv heads of head_dim, K and
    V; an MLA model's one latent row per token, K only."""
    if cfg.is_mla:
        return 1, cfg.attention.kv_cache_width, 1
    return cfg.num_kv_heads, cfg.head_dim, 2


def cache_bytes_per_token(kv_heads: int, head_dim: int, layers: int, fmt: KvFormat | None,
                          model_dtype_bytes: int = 2, tensors: int = 2, page_size: int = 16) -> float:
    """HBM bytes one token's K and V rows (`tensors` = 2; an MLA latent row: 1) take in every
    layer: head_dim model-dtype elements per head, or a quantized page's share (`PagedLayout`:
    codes, exponent bytes and the row's lane padding) for a page of `page_size` tokens."""
    if fmt is None:
        return layers * tensors * kv_heads * head_dim * model_dtype_bytes
    return layers * PagedLayout(kv_heads, head_dim, tensors, page_size, fmt.name).page_bytes / page_size
