"""Quantized weights: the formats, the schemes, the quantizer, and the matrix type the reference multiplies.

A *format* is how one matrix is stored (`FORMATS`):

- "int8": symmetric int8, one float32 scale per output column, s = absmax over K / 127
  (the published TPU7x kernel's dense format, TPU_FACTS 9);
- "fp8": float8_e4m3fn, one float32 scale per output column, s = absmax over K / 448;
- "fp8-b128": float8_e4m3fn with one float32 scale per 128 x 128 block, as Hugging Face FP8
  checkpoints store them (`weight_scale_inv`, TPU_FACTS 9); kept as one scale per (group of 128
  input rows, output column), the block's scale repeated over its 128 columns (exact);
- "int4-g128": symmetric int4 (codes -7..7) with one float32 scale per (group of 128 input rows,
  output column), the published kernel's expert format;
- "mxfp4": OCP microscaling FP4, as gpt-oss releases its experts: e2m1 codes (0, 0.5, 1, 1.5,
  2, 3, 4, 6 and their negatives) with one power-of-two scale per (group of 32 input rows,
  output column), stored as an E8M0 byte (2^(byte - 127)). Held here as float32 powers of two
  (exact); the kernel streams the scales as their bytes. Quantizing: scale 2^(floor(log2 absmax)
  - 2), codes rounded to nearest (the OCP MX recipe); a checkpoint's codes load as stored.
- "nvfp4": NVIDIA's FP4, as ModelOpt writes a checkpoint's experts: e2m1 codes with one
  float8_e4m3fn scale per (group of 16 input rows, output column) and one float32 global scale
  per matrix (`weight_scale_2`); dequantized = code x e4m3 scale x global. Held here as they
  are stored: the scales as e4m3 values, the global scales in `QuantizedMatrix.outer` (one per
  matrix of a stack). A code times an e4m3 scale has at most 6 significant bits, so it is exact
  in bfloat16 and the kernel decodes that product in VMEM; the global scale multiplies each
  column's float32 sum after the contraction. Quantizing (ModelOpt's recipe): global = absmax
  of the matrix / (6 x 448), each group's scale = its absmax / (6 x global) rounded to e4m3,
  codes rounded to nearest.

A *scheme* (`BuildSpec.quant`, `--quant`) gives a format to each of two families of matrices:
`ring`, every matrix the megakernel's weight ring streams (q|k|v, o, the dense and
shared-expert gate / up / down, and the lm_head), and `experts`, the routed experts' gate / up /
down. Written `ring=FMT,experts=FMT` (a family left out stays in the model dtype) or by a
preset name: "int8" (ring int8), "fp8" (ring fp8), "int4" (ring int8, experts int4-g128:
the published kernel's mix), "fp8-b128" (both fp8-b128: how an FP8 checkpoint is stored),
"mxfp4" and "nvfp4" (experts only: how gpt-oss's release and a ModelOpt NVFP4 checkpoint store
them). The
ring streams one buffer of one dtype, so its matrices share one format; that is why the
per-family choice is ring vs experts, not per projection.

`quantize_params(cfg, params, scheme)` turns reference-layout weights into the same structure
with those matrices as `QuantizedMatrix(q, scale)`. The reference decode step and the kernel
packers both take that: `reference.matmul(x, QuantizedMatrix)` computes (x in the compute
dtype) @ (q in the compute dtype) with float32 accumulation, times the scales: per-column
scales after the whole contraction, group scales after each group's contraction (and nvfp4's
global scale after the groups are summed). That
is what the kernel computes tile by tile (every int8, int4 and e4m3 code is exact in bfloat16,
so converting a tile in VMEM rounds nothing), so the kernel is checked against the reference
to float tolerance. Applying a scale after the (group's) contraction equals dequantizing first
up to float32 rounding.

Embedding rows (gathered outside the kernel), norms, the MoE router (it decides routing: kept
exact) and the KV cache stay in the model dtype.

MLA models (tpumk.model.mla): the ring streams wq_a, wq_b (or wq), wkv_a and wo in the ring
format, and wkv_b as the two absorbed per-head matrices the kernel multiplies by: a quantized
layer holds `w_uk` [Hq, N, C] (head h's W_UK^T) and `w_uv` [Hq, C, V] (head h's W_UV) in place
of `wkv_b`, each head's block quantized on its own like a stack of experts (per-column: one
scale per (head, latent / value column); fp8-b128: per (head, 128 contraction rows, column)),
because the kernel streams one head block per tile. The q_a / kv_a norms stay in the model
dtype, the router and its correction bias in float32. Sparse attention's indexer: idx_wq and
idx_wk in the ring format (the ring families idx_q / idx_k); its float32 head weights
(idx_weights, float32 as transformers keeps them: they weight the scores the top-k compares)
and its key LayerNorm stay float (their own DMAs, not the ring).

Why not a quantization library (e.g. qwix): tpumk needs the codes and scales themselves, laid
out in the ring's tile order and the expert stage's chunk order, with the exact dequantization
contract above shared by the reference and the kernel; qwix quantizes a Flax model's
einsums in place (its own layouts and numerics) and is not installed with JAX. The quantizer
here is a few array lines; what matters is the layout, which is tpumk's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError

GROUP = 128  # input rows per scale of the group formats (and the block side of fp8-b128)
MX_GROUP = 32  # input rows per scale of mxfp4 (OCP microscaling blocks)
NV_GROUP = 16  # input rows per e4m3 scale of nvfp4
E8M0_BIAS = 127  # an E8M0 scale byte b is 2^(b - 127)
E4M3_MAX = 448.0  # the largest float8_e4m3fn value (nvfp4's block scales)


@dataclass(frozen=True)
class WeightFormat:
    """How a quantized matrix is stored: element dtype, largest code, scale granularity."""

    name: str
    dtype: str  # "int8" | "float8_e4m3fn" | "int4" | "float4_e2m1fn"
    qmax: float  # codes lie in [-qmax, qmax]
    group: int = 0  # input rows per scale (0: one scale per output column over all of K)
    block_cols: int = 0  # fp8-b128: output columns sharing a scale when quantizing (1 otherwise)
    bits: int = 8
    scale_dtype: str = "float32"  # how a scale is stored: "float32", "e8m0" (a power-of-two byte) or "e4m3"

    @property
    def jnp_dtype(self):
        return {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "int4": jnp.int4,
                "float4_e2m1fn": jnp.float4_e2m1fn}[self.dtype]

    @property
    def scale_bytes(self) -> int:
        """HBM bytes per scale."""
        return 1 if self.scale_dtype in ("e8m0", "e4m3") else 4

    @property
    def global_scale(self) -> bool:
        """Whether each matrix has a float32 global scale besides its group scales (nvfp4)."""
        return self.scale_dtype == "e4m3"

    @property
    def itemsize(self) -> float:
        """HBM bytes per code (int4: two codes a byte)."""
        return self.bits / 8

    def scale_rows(self, k: int) -> int:
        """Scales per output column of a [k, M] matrix (a last, partial group has its own)."""
        return -(-k // self.group) if self.group else 1


FORMATS = {
    "int8": WeightFormat("int8", "int8", 127.0),
    "fp8": WeightFormat("fp8", "float8_e4m3fn", 448.0),
    "fp8-b128": WeightFormat("fp8-b128", "float8_e4m3fn", 448.0, group=GROUP, block_cols=GROUP),
    "int4-g128": WeightFormat("int4-g128", "int4", 7.0, group=GROUP, bits=4),
    "mxfp4": WeightFormat("mxfp4", "float4_e2m1fn", 6.0, group=MX_GROUP, bits=4, scale_dtype="e8m0"),
    "nvfp4": WeightFormat("nvfp4", "float4_e2m1fn", 6.0, group=NV_GROUP, bits=4, scale_dtype="e4m3"),
}
RING_FORMATS = ("int8", "fp8", "fp8-b128")  # int4 tiles are not streamed by the ring (TPU7x holds one per byte)
EXPERT_FORMATS = ("int4-g128", "fp8-b128", "mxfp4", "nvfp4")
PRESETS = {"none": ("none", "none"), "int8": ("int8", "none"), "fp8": ("fp8", "none"),
           "int4": ("int8", "int4-g128"), "fp8-b128": ("fp8-b128", "fp8-b128"),
           "mxfp4": ("none", "mxfp4"),  # gpt-oss's release: experts in MXFP4, the rest in bfloat16
           "nvfp4": ("none", "nvfp4")}  # NVFP4 experts (a ModelOpt checkpoint's), the ring in the model dtype
SCHEMES = tuple(PRESETS)  # the names; any `ring=..,experts=..` text is a scheme too
# Reference-layout keys of the matrices the ring streams (per layer; the lm_head at the top)
# and of the routed experts' stacks.
RING_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down",
                 "wq_a", "wq_b", "wkv_a", "wq_gate", "moe_in", "moe_out",
                 # sparse attention's indexer projections (its float32 head weights and norms stay float)
                 "idx_wq", "idx_wk",
                 # a linear-attention layer's projections (its convolution taps, decays and norm stay float)
                 "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_f_a", "lin_f_b", "lin_g_a", "lin_g_b", "lin_out")
EXPERT_MATRICES = ("e_gate", "e_up", "e_down")
ABSORBED_MATRICES = ("w_uk", "w_uv")  # an MLA layer's wkv_b, split per head (quantized layers only)


@dataclass(frozen=True)
class Scheme:
    """The formats of one scheme: `ring` and `experts` (None: the model dtype)."""

    ring: WeightFormat | None
    experts: WeightFormat | None

    @property
    def name(self) -> str:
        """Canonical text: the preset's name when one matches, else `ring=..,experts=..`."""
        pair = (self.ring.name if self.ring else "none", self.experts.name if self.experts else "none")
        for name, formats in PRESETS.items():
            if formats == pair:
                return name
        return f"ring={pair[0]},experts={pair[1]}"

    def name_for(self, moe: bool) -> str:
        """The name for a model with (moe) or without routed experts: without, the experts'
        format is moot and the first preset with this ring format names the build."""
        if moe:
            return self.name
        ring = self.ring.name if self.ring else "none"
        return next(name for name, formats in PRESETS.items() if formats[0] == ring)


def parse_scheme(text: Any) -> Scheme:
    """A scheme from its text: a preset name or `ring=FMT,experts=FMT` (either part optional)."""
    expected = (f"expected {', '.join(SCHEMES)}, or ring=FMT,experts=FMT with ring in "
                f"{'|'.join(('none',) + RING_FORMATS)} and experts in {'|'.join(('none',) + EXPERT_FORMATS)}")
    if not isinstance(text, str):
        raise ConfigError(f"quant = {text!r:.40}: {expected}")
    if text in PRESETS:
        ring, experts = PRESETS[text]
    else:
        parts = dict(ring="none", experts="none")
        seen = set()
        for item in text.split(","):
            key, eq, val = item.strip().partition("=")
            key = key.strip()
            if not eq or key not in parts:
                raise ConfigError(f"quant = {text!r:.60}: {expected}")
            if key in seen:  # never "the last one wins"
                raise ConfigError(f"quant = {text!r:.60}: '{key}' given twice (give each of ring, experts once)")
            seen.add(key)
            parts[key] = val.strip()
        ring, experts = parts["ring"], parts["experts"]
        if ring not in ("none",) + RING_FORMATS or experts not in ("none",) + EXPERT_FORMATS:
            raise ConfigError(f"quant = {text!r:.60}: {expected}")
    return Scheme(FORMATS.get(ring), FORMATS.get(experts))


def canonical_scheme(text: Any, cfg=None) -> str:
    """The one spelling of a scheme; given the model, the experts' format is dropped when it
    has no routed experts (the same build, so the same name and cache key)."""
    s = parse_scheme(text)
    return s.name if cfg is None else s.name_for(cfg.is_moe)


def build_scheme(stored: str, requested: Any, cfg=None) -> str:
    """The one decision of a build's weight scheme: `requested` (--quant; None: not given) over
    weights stored as `stored` ("none": float weights, quantized as requested at pack time; a
    quantized checkpoint's format, tpumk.model.config.stored_scheme). A quantized checkpoint
    builds as it is stored: not given or the same scheme is that format, any other is refused
    (re-quantizing stored codes would be a lossy round trip). "none" asks for no quantization at
    pack time, so it too is the stored format."""
    stored = canonical_scheme(stored, cfg)
    scheme = "none" if requested is None else canonical_scheme(requested, cfg)
    if scheme == "none":
        return stored
    if stored not in ("none", scheme):
        raise ConfigError(f"--quant {scheme}: the checkpoint stores its weights as {stored}; re-quantizing "
                          f"them would be a lossy round trip (leave --quant out, or give {stored})")
    return scheme


def weight_format(scheme: Any) -> WeightFormat | None:
    """The format of the ring's matrices under `scheme` (None: the model dtype)."""
    return parse_scheme(scheme).ring


def expert_format(scheme: Any) -> WeightFormat | None:
    """The format of the routed experts under `scheme` (None: the model dtype)."""
    return parse_scheme(scheme).experts


class QuantizedMatrix(NamedTuple):
    """A [..., K, M] matrix (leading dims: a stack, e.g. experts) as codes q [..., K, M] and
    scales: [..., M] (one per output column) or [..., K / group, M] (one per group of
    input rows and column), float32 (nvfp4: float8_e4m3fn, as stored). Dequantized: q * scale,
    the scale repeated over its group, times `outer` when there is one (nvfp4's global scales,
    float32 [...]: one per matrix of the stack). `compute` is an empty array of the dtype the
    codes are multiplied in (the model dtype): a leaf, so the type passes through jit like any
    weight. Code that cuts a matrix keeps `outer` with `_replace` (it follows the leading dims)."""

    q: jax.Array
    scale: jax.Array
    compute: jax.Array
    outer: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def grouped(self) -> bool:
        return len(self.scale.shape) == len(self.q.shape)

    @property
    def group(self) -> int:
        """Input rows per scale (K for per-column scales; the group formats' 128; for e2m1
        codes mxfp4's 32, or nvfp4's 16 (its e4m3 scales); the last group partial when the
        group does not divide K)."""
        if not self.grouped:
            return self.q.shape[-2]
        if jnp.dtype(self.q.dtype) != jnp.dtype(jnp.float4_e2m1fn):
            return GROUP
        return NV_GROUP if jnp.dtype(self.scale.dtype) == jnp.dtype(jnp.float8_e4m3fn) else MX_GROUP

    def outer_scales(self, lead: int = 0) -> jax.Array | float:
        """The global scales as a multiplier of a result whose last `lead` axes follow the
        matrix's columns and sums ([..., N, M] for lead 2): `outer` [...] with `lead` axes
        added, or 1.0 without one."""
        if self.outer is None:
            return 1.0
        return jnp.asarray(self.outer, jnp.float32).reshape(tuple(self.outer.shape) + (1,) * lead)

    def dequantized(self) -> jax.Array:
        q = self.q.astype(jnp.float32)
        if not self.grouped:
            return q * self.scale.astype(jnp.float32)[..., None, :]
        w = q * jnp.repeat(self.scale.astype(jnp.float32), self.group, axis=-2)[..., :q.shape[-2], :]
        return w * self.outer_scales(2) if self.outer is not None else w


def quantize_matrix(w, fmt: WeightFormat, compute=jnp.bfloat16) -> QuantizedMatrix:
    """Symmetric quantization of w [..., K, M] in `fmt`: scale = absmax / qmax over each column
    (per-column formats), each (128-row group, column) (int4-g128) or each 128 x 128 block
    (fp8-b128); an all-zero group gets scale 1 (its codes are 0 whatever the scale)."""
    w = jnp.asarray(w, jnp.float32)
    k, m = w.shape[-2:]
    if fmt.global_scale:
        return _quantize_nvfp4(w, fmt, compute)
    if fmt.group:
        groups = fmt.scale_rows(k)  # a partial last group: zero rows pad it (they never set the max)
        padded = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, groups * fmt.group - k), (0, 0)])
        g = padded.reshape(*w.shape[:-2], groups, fmt.group, m)
        amax = jnp.max(jnp.abs(g), axis=-2)  # [..., G, M]
        if fmt.block_cols:  # one scale per 128 x 128 block, repeated over the block's columns
            pad = -m % fmt.block_cols
            blocks = jnp.pad(amax, [(0, 0)] * (amax.ndim - 1) + [(0, pad)])
            blocks = jnp.max(blocks.reshape(*amax.shape[:-1], -1, fmt.block_cols), axis=-1)
            amax = jnp.repeat(blocks, fmt.block_cols, axis=-1)[..., :m]
        if fmt.scale_dtype == "e8m0":  # a power of two putting absmax in [4, 8): e2m1's top binade
            e = jnp.clip(jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - 2, -E8M0_BIAS, E8M0_BIAS)
            scale = jnp.where(amax > 0, jnp.exp2(e), 1.0).astype(jnp.float32)
        else:
            scale = jnp.where(amax > 0, amax / fmt.qmax, 1.0).astype(jnp.float32)
        x = w / jnp.repeat(scale, fmt.group, axis=-2)[..., :k, :]
    else:
        amax = jnp.max(jnp.abs(w), axis=-2)
        scale = jnp.where(amax > 0, amax / fmt.qmax, 1.0).astype(jnp.float32)
        x = w / scale[..., None, :]
    if fmt.dtype in ("float8_e4m3fn", "float4_e2m1fn"):  # they round to nearest themselves, within +-qmax
        q = jnp.clip(x, -fmt.qmax, fmt.qmax).astype(fmt.jnp_dtype)
    else:
        q = jnp.clip(jnp.round(x), -fmt.qmax, fmt.qmax).astype(fmt.jnp_dtype)
    return QuantizedMatrix(q, scale, jnp.zeros((0,), compute))


def _quantize_nvfp4(w, fmt: WeightFormat, compute) -> QuantizedMatrix:
    """nvfp4 by ModelOpt's recipe: per matrix of the stack, global = absmax / (6 x 448) (1 for
    an all-zero matrix); per (16-row group, column), scale = the group's absmax / (6 x global)
    rounded to e4m3; codes = w / (scale x global) rounded to the nearest e2m1 value (0 where the
    scale rounded to 0)."""
    k, m = w.shape[-2:]
    amax = jnp.max(jnp.abs(w), axis=(-2, -1))
    outer = jnp.where(amax > 0, amax / (fmt.qmax * E4M3_MAX), 1.0).astype(jnp.float32)  # [...]
    groups = fmt.scale_rows(k)
    padded = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, groups * fmt.group - k), (0, 0)])
    gmax = jnp.max(jnp.abs(padded.reshape(*w.shape[:-2], groups, fmt.group, m)), axis=-2)  # [..., G, M]
    scale = jnp.clip(gmax / (fmt.qmax * outer[..., None, None]), 0, E4M3_MAX).astype(jnp.float8_e4m3fn)
    step = jnp.repeat(scale.astype(jnp.float32), fmt.group, axis=-2)[..., :k, :] * outer[..., None, None]
    x = jnp.where(step > 0, w / jnp.where(step > 0, step, 1.0), 0.0)
    q = jnp.clip(x, -fmt.qmax, fmt.qmax).astype(fmt.jnp_dtype)
    return QuantizedMatrix(q, scale, jnp.zeros((0,), compute), outer)


def quantize_params(cfg, params: dict, scheme: str) -> dict:
    """Reference-layout weights with every ring matrix and routed expert stack quantized under
    `scheme` (the lm_head too: a tied model's lm_head becomes a quantized copy of embed.T, kept
    as `lm_head`; the embedding itself stays, for the row gather). Matrices already quantized
    (a checkpoint stored so) are kept as they are. "none" returns `params` unchanged."""
    s = parse_scheme(scheme)
    if s.ring is None and s.experts is None:
        return params
    dt = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16
    layers = []
    for lay in params["layers"]:
        out = dict(lay)
        if s.ring is not None and "wkv_b" in lay:  # MLA: the absorbed per-head blocks (module docstring)
            del out["wkv_b"]
            for k, w in zip(ABSORBED_MATRICES, absorbed_weights(cfg, lay)):
                out[k] = quantize_matrix(w, s.ring, dt)
        for keys, fmt in ((RING_MATRICES, s.ring), (EXPERT_MATRICES, s.experts)):
            for k in keys:
                if fmt is not None and k in lay and not isinstance(lay[k], QuantizedMatrix):
                    out[k] = quantize_matrix(lay[k], fmt, dt)
        layers.append(out)
    top = {**params, "layers": layers}
    if s.ring is not None:
        head = params["lm_head"] if "lm_head" in params else jnp.asarray(params["embed"]).T
        if not isinstance(head, QuantizedMatrix):
            top["lm_head"] = quantize_matrix(head, s.ring, dt)
    return top


def format_of(m: Any) -> WeightFormat | None:
    """The format a matrix is stored in (None: a float matrix)."""
    if not isinstance(m, QuantizedMatrix):
        return None
    dtype = jnp.dtype(m.q.dtype).name
    for f in FORMATS.values():
        if jnp.dtype(f.jnp_dtype).name == dtype and bool(f.group) == m.grouped \
                and f.global_scale == (m.outer is not None):
            return f
    raise ConfigError(f"quantized matrix of {dtype} codes with scales {tuple(m.scale.shape)}: no format matches")


def scheme_of(params: dict) -> str:
    """The scheme reference-layout weights were quantized with ("none" if they were not): the
    lm_head's format for the ring, the first MoE layer's gate for the experts."""
    ring = format_of(params.get("lm_head"))
    moe = [lay["e_gate"] for lay in params["layers"] if "e_gate" in lay]
    return Scheme(ring, format_of(moe[0]) if moe else None).name_for(bool(moe))


def relative_rms(got, want) -> float:
    """sqrt(mean((got - want)^2)) / sqrt(mean(want^2)): the quality figure of a scheme."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want ** 2)), 1e-30))


def ring_parameter_count(cfg) -> int:
    """Parameters of the matrices the ring streams: every layer's q|k|v and o, the dense and
    shared-expert gate / up / down, sparse attention's indexer projections, and the lm_head (a
    tied model's head counts: it becomes its own quantized copy). Closed form, no loop over layers."""
    h = cfg.hidden_size
    n_dense = cfg.pattern.num_dense
    n_moe = cfg.num_layers - n_dense
    attn = cfg.attention.param_count(cfg.hidden_size)
    shared = cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size if cfg.is_moe else 0
    indexer = sum(n * k * m for n, k, m in _indexer_matrices(cfg))
    return (cfg.num_layers * attn + n_dense * 3 * h * cfg.ffn_size + n_moe * 3 * h * shared + h * cfg.vocab_size
            + indexer)


def _indexer_matrices(cfg) -> list[tuple[int, int, int]]:
    """(count, K, M) of sparse attention's indexer projections idx_wk and idx_wq (ring matrices:
    one of each per layer with an indexer of its own)."""
    if not cfg.attention.is_sparse:
        return []
    a, n = cfg.attention, len(cfg.indexer_layers)
    q_in = cfg.hidden_size if a.index_q_hidden else cfg.q_lora_rank
    return [(n, cfg.hidden_size, a.index_head_dim), (n, q_in, a.index_heads * a.index_head_dim)]


def expert_parameter_count(cfg) -> int:
    """Parameters of the routed experts (every MoE layer's E gate / up / down)."""
    if not cfg.is_moe:
        return 0
    return (cfg.num_layers - cfg.pattern.num_dense) * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe.expert_ffn_size


def _scale_count(fmt: WeightFormat, matrices: list[tuple[int, int, int]]) -> int:
    """Scales of `count` [k, m] matrices for each (count, k, m)."""
    return sum(n * fmt.scale_rows(k) * m for n, k, m in matrices)


def ring_matrices(cfg) -> list[tuple[int, int, int]]:
    """(count, K, M) of the ring's matrices (the lm_head included)."""
    h, n_dense, L = cfg.hidden_size, cfg.pattern.num_dense, cfg.num_layers
    n_moe = L - n_dense
    shared = cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size if cfg.is_moe else 0
    if cfg.is_mla:  # q path, kv_a, the per-head absorbed blocks (quantized head by head), o
        hq, rq, c = cfg.num_q_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        out = [(L, h, rq), (L, rq, cfg.attention.q_size)] if rq else [(L, h, cfg.attention.q_size)]
        out += [(L, h, cfg.attention.kv_cache_width), (L * hq, cfg.qk_nope_head_dim, c), (L * hq, c, cfg.v_head_dim),
                (L, hq * cfg.v_head_dim, h), (1, h, cfg.vocab_size)]
    else:
        out = [(L, h, cfg.attention.q_size + 2 * cfg.attention.kv_size), (L, cfg.attention.q_size, h), (1, h, cfg.vocab_size)]
    out += _indexer_matrices(cfg)
    if n_dense:
        out += [(n_dense, h, 2 * cfg.ffn_size), (n_dense, cfg.ffn_size, h)]
    if shared and n_moe:
        out += [(n_moe, h, 2 * shared), (n_moe, shared, h)]
    return out


def expert_matrices(cfg) -> list[tuple[int, int, int]]:
    """(count, K, M) of the routed experts' matrices: gate | up side by side, then down."""
    if not cfg.is_moe:
        return []
    n = (cfg.num_layers - cfg.pattern.num_dense) * cfg.num_experts
    return [(n, cfg.hidden_size, 2 * cfg.moe.expert_ffn_size), (n, cfg.moe.expert_ffn_size, cfg.hidden_size)]


def quantized_weight_bytes(cfg, scheme: str) -> int:
    """HBM bytes of the model's weights under `scheme`: quantized matrices at their code size
    plus their scales (float32, or one byte for mxfp4 and nvfp4) and nvfp4's float32 global
    scale per matrix (gate, up and down of each expert), everything else in the model dtype."""
    s = parse_scheme(scheme)
    total = cfg.param_count() * cfg.dtype_bytes
    if s.ring is not None:
        ring = ring_parameter_count(cfg)
        untied_head = 0 if cfg.head.tie_embeddings else cfg.hidden_size * cfg.vocab_size
        total -= (ring - cfg.hidden_size * cfg.vocab_size + untied_head) * cfg.dtype_bytes
        total += ring * s.ring.itemsize + s.ring.scale_bytes * _scale_count(s.ring, ring_matrices(cfg))
    if s.experts is not None and cfg.is_moe:
        n = expert_parameter_count(cfg)
        total += n * (s.experts.itemsize - cfg.dtype_bytes) + s.experts.scale_bytes * _scale_count(
            s.experts, expert_matrices(cfg))
        if s.experts.global_scale:  # one float32 per gate, up and down matrix
            total += 4 * 3 * (cfg.num_layers - cfg.pattern.num_dense) * cfg.num_experts
    return int(total)


def quantized_specs(cfg, params: dict, scheme: str) -> dict:
    """`quantize_params` on ShapeDtypeStructs: the same pytree with each quantized matrix a
    QuantizedMatrix of specs (codes, scales; nvfp4: e4m3 scales and the float32 global scales),
    for deviceless compiles."""
    s = parse_scheme(scheme)
    if s.ring is None and s.experts is None:
        return params
    dt = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16

    def spec(a, fmt: WeightFormat) -> QuantizedMatrix:
        *lead, k, m = a.shape
        scale = (*lead, fmt.scale_rows(k), m) if fmt.group else (*lead, m)
        outer = jax.ShapeDtypeStruct(tuple(lead), jnp.float32) if fmt.global_scale else None
        return QuantizedMatrix(jax.ShapeDtypeStruct(tuple(a.shape), fmt.jnp_dtype),
                               jax.ShapeDtypeStruct(scale, jnp.float8_e4m3fn if fmt.global_scale else jnp.float32),
                               jax.ShapeDtypeStruct((0,), dt), outer)

    def layer(lay):
        out = dict(lay)
        if s.ring is not None and "wkv_b" in lay:  # MLA: wkv_b becomes the per-head W_UK^T and W_UV
            hq, n, c, v = cfg.num_q_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
            del out["wkv_b"]
            for k, shape in zip(ABSORBED_MATRICES, ((hq, n, c), (hq, c, v))):
                out[k] = spec(jax.ShapeDtypeStruct(shape, dt), s.ring)
        for keys, fmt in ((RING_MATRICES, s.ring), (EXPERT_MATRICES, s.experts)):
            for k in keys:
                if fmt is not None and k in lay:
                    out[k] = spec(lay[k], fmt)
        return out

    top = {**params, "layers": [layer(lay) for lay in params["layers"]]}
    if s.ring is not None:
        head = params["lm_head"] if "lm_head" in params else jax.ShapeDtypeStruct(params["embed"].shape[::-1],
                                                                                  params["embed"].dtype)
        top["lm_head"] = spec(head, s.ring)
    return top


def absorbed_weights(cfg, layer):
    """(W_UK^T [Hq, N, C], W_UV [Hq, C, V]): each head's absorbed blocks, the kernel's uk / uv
    tiles. Views of wkv_b, or a quantized layer's own `w_uk` / `w_uv` (QuantizedMatrix stacks
    over heads, tpumk.model.quantize)."""
    if "w_uk" in layer:
        return layer["w_uk"], layer["w_uv"]
    # (the key block's width from the tensor: a Mistral Large 4 NoPE layer's is qk_nope + qk_rope)
    n = layer["wkv_b"].shape[-1] // cfg.num_q_heads - cfg.v_head_dim
    w = layer["wkv_b"].reshape(cfg.kv_lora_rank, cfg.num_q_heads, n + cfg.v_head_dim)
    return w[..., :n].transpose(1, 2, 0), w[..., n:].transpose(1, 0, 2)
