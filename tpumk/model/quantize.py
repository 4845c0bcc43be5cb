"""Quantized weights: the schemes, the quantizer, and the matrix type the reference multiplies.

A scheme (`BuildSpec.quant`, `--quant`) sets the format of every matrix the megakernel's weight
ring streams (q|k|v, o, the dense and shared-expert gate / up / down, and the lm_head):

- "none": the model dtype (bfloat16 or float32), as before;
- "int8": symmetric int8, one float32 scale per output column, s = absmax over K / 127
  (the published TPU7x kernel's dense format, TPU_FACTS 9);
- "fp8": float8_e4m3fn, one float32 scale per output column, s = absmax over K / 448.

`quantize_params(cfg, params, scheme)` turns reference-layout weights into the same structure
with those matrices as `QuantizedMatrix(q, scale)`. The reference decode step and the kernel
packer both take that: `reference.matmul(x, QuantizedMatrix)` computes
(x in the compute dtype) @ (q in the compute dtype), float32 accumulation, times the column
scales, which is what the kernel computes tile by tile (every int8 and e4m3 code is exact in
bfloat16, so converting the tile in VMEM rounds nothing), so the kernel is checked against the
reference to float tolerance. Applying a per-column scale after the contraction equals
dequantizing first up to float32 rounding.

Embedding rows (gathered outside the kernel), norms, the MoE router (it decides routing: kept
exact), the routed experts and the KV cache stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError, NotSupportedError

SCHEMES = ("none", "int8", "fp8")
# Reference-layout keys of the matrices the ring streams (per layer; the lm_head at the top).
RING_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down")


@dataclass(frozen=True)
class WeightFormat:
    """How a quantized matrix is stored: element dtype and the largest code."""

    name: str  # the scheme
    dtype: str  # "int8" | "float8_e4m3fn"
    qmax: float  # codes lie in [-qmax, qmax]

    @property
    def jnp_dtype(self):
        return jnp.int8 if self.dtype == "int8" else jnp.float8_e4m3fn

    itemsize = 1


FORMATS = {"int8": WeightFormat("int8", "int8", 127.0), "fp8": WeightFormat("fp8", "float8_e4m3fn", 448.0)}


def weight_format(scheme: Any) -> WeightFormat | None:
    """The format of the ring's matrices under `scheme` (None: the model dtype)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"quant = {scheme!r:.40}: expected one of {', '.join(SCHEMES)}")
    return FORMATS.get(scheme)


class QuantizedMatrix(NamedTuple):
    """A [K, M] matrix as codes q [K, M] and float32 scales [M] (dequantized: q * scale).
    `compute` is an empty array of the dtype the codes are multiplied in (the model dtype): a
    leaf, so the type passes through jit like any weight."""

    q: jax.Array
    scale: jax.Array
    compute: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    def dequantized(self) -> jax.Array:
        return self.q.astype(jnp.float32) * self.scale.astype(jnp.float32)


def quantize_matrix(w, fmt: WeightFormat, compute=jnp.bfloat16) -> QuantizedMatrix:
    """Symmetric per-output-column quantization of w [K, M]: scale = absmax over K / qmax (a
    zero column gets scale 1: its codes are 0 whatever the scale)."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0)
    scale = jnp.where(amax > 0, amax / fmt.qmax, 1.0).astype(jnp.float32)
    x = w / scale
    if fmt.dtype == "int8":
        q = jnp.clip(jnp.round(x), -fmt.qmax, fmt.qmax).astype(jnp.int8)
    else:  # e4m3 rounds to nearest itself; |x| <= 448 is within its range
        q = jnp.clip(x, -fmt.qmax, fmt.qmax).astype(jnp.float8_e4m3fn)
    return QuantizedMatrix(q, scale, jnp.zeros((0,), compute))


def quantize_params(cfg, params: dict, scheme: str) -> dict:
    """Reference-layout weights with every ring matrix quantized under `scheme` (the lm_head too:
    a tied model's lm_head becomes a quantized copy of embed.T, kept as `lm_head`; the
    embedding itself stays, for the row gather). "none" returns `params` unchanged."""
    fmt = weight_format(scheme)
    if fmt is None:
        return params
    if cfg.is_mla:  # the MLA matrices (wq_a, wq_b, wkv_a, wkv_b) have no quantized path yet
        raise NotSupportedError(f"--quant {scheme}: not supported yet: quantized weights of an MLA model ('{cfg.name}')")
    dt = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16
    layers = []
    for lay in params["layers"]:
        out = dict(lay)
        for k in RING_MATRICES:
            if k in lay and not isinstance(lay[k], QuantizedMatrix):
                out[k] = quantize_matrix(lay[k], fmt, dt)
        layers.append(out)
    top = {**params, "layers": layers}
    head = params["lm_head"] if "lm_head" in params else jnp.asarray(params["embed"]).T
    if not isinstance(head, QuantizedMatrix):
        top["lm_head"] = quantize_matrix(head, fmt, dt)
    return top


def scheme_of(params: dict) -> str:
    """The scheme reference-layout weights were quantized with ("none" if they were not)."""
    head = params.get("lm_head")
    if not isinstance(head, QuantizedMatrix):
        return "none"
    return next(f.name for f in FORMATS.values() if jnp.dtype(head.q.dtype) == jnp.dtype(f.jnp_dtype))


def relative_rms(got, want) -> float:
    """sqrt(mean((got - want)^2)) / sqrt(mean(want^2)): the quality figure of a scheme."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want ** 2)), 1e-30))


def ring_parameter_count(cfg) -> int:
    """Parameters of the matrices a scheme quantizes: every layer's q|k|v and o, the dense and
    shared-expert gate / up / down, and the lm_head (a tied model's head counts: it becomes its
    own quantized copy). Closed form, no loop over layers."""
    h = cfg.hidden_size
    n_dense = cfg.num_dense_layers
    n_moe = cfg.num_layers - n_dense
    attn = cfg.attention_param_count()
    shared = cfg.num_shared_experts * cfg.shared_expert_ffn_size if cfg.is_moe else 0
    return cfg.num_layers * attn + n_dense * 3 * h * cfg.ffn_size + n_moe * 3 * h * shared + h * cfg.vocab_size


def quantized_weight_bytes(cfg, scheme: str) -> int:
    """HBM bytes of the model's weights under `scheme`: ring matrices at 1 byte per weight plus
    their float32 column scales, everything else in the model dtype."""
    fmt = weight_format(scheme)
    total = cfg.param_count() * cfg.dtype_bytes
    if fmt is None:
        return total
    ring = ring_parameter_count(cfg)
    untied_head = 0 if cfg.tie_embeddings else cfg.hidden_size * cfg.vocab_size
    kept = total - (ring - cfg.hidden_size * cfg.vocab_size + untied_head) * cfg.dtype_bytes
    return int(kept + ring * fmt.itemsize + 4 * ring_output_columns(cfg))


def ring_output_columns(cfg) -> int:
    """Output columns of the quantized matrices: one float32 scale each."""
    h, n_dense = cfg.hidden_size, cfg.num_dense_layers
    n_moe = cfg.num_layers - n_dense
    shared = cfg.num_shared_experts * cfg.shared_expert_ffn_size if cfg.is_moe else 0
    return (cfg.num_layers * cfg.attention_output_columns() + n_dense * (2 * cfg.ffn_size + h)
            + (n_moe * (2 * shared + h) if shared else 0) + cfg.vocab_size)


def quantized_specs(cfg, params: dict, scheme: str) -> dict:
    """`quantize_params` on ShapeDtypeStructs: the same pytree with each ring matrix a
    QuantizedMatrix of specs (codes [K, M], float32 scales [M]), for deviceless compiles."""
    fmt = weight_format(scheme)
    if fmt is None:
        return params
    dt = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16

    def spec(s) -> QuantizedMatrix:
        return QuantizedMatrix(jax.ShapeDtypeStruct(tuple(s.shape), fmt.jnp_dtype),
                               jax.ShapeDtypeStruct((s.shape[-1],), jnp.float32), jax.ShapeDtypeStruct((0,), dt))

    layers = [{k: spec(v) if k in RING_MATRICES else v for k, v in lay.items()} for lay in params["layers"]]
    head = params["lm_head"] if "lm_head" in params else jax.ShapeDtypeStruct(params["embed"].shape[::-1],
                                                                              params["embed"].dtype)
    return {**params, "layers": layers, "lm_head": spec(head)}
