"""The parts Muse Spark adds to a GQA decoder layer, in the reference's numerics (float32 on the
residual stream, tpumk.model.ops' matrix-product contract). transformers' modelling
(MuseSparkTextModel / MuseSparkForConditionalGeneration, 5.24) computes:

- the embedding rows RMS-normalised without a weight (`embed_norm`, eps rms_eps);
- each sublayer joining the residual through a learned per-channel gate: x <- alpha * x + beta * y
  (`residual_gates`; alpha and beta derived from the checkpoint's gate vector on load,
  `gate_coefficients`);
- each head's attention output RMS-normalised without a weight before the sigmoid output gate
  (`attn_out_norm`, eps rms_eps);
- the routed experts between a down-projection to moe_hidden_size (with a (1 + w) RMSNorm) and an
  up-projection back (`moe_hidden_size`), each expert's output RMS-normalised before its routing
  weight (`expert_post_norm`, eps post_norm_eps).

The rest of the layer is tpumk's existing parts with weights folded on load
(tpumk.model.spark_weights.fold_tensors): (1 + w) pre-norms, the weightless post-attention norm,
the input-scaled post-feed-forward and post-expert norms (their (1 + w) moved onto the columns of
the projection before them), QK-norm without weight with the queries' qk_scale_factor as q_norm's
weight, the router's and the head's output_multiplier, the final soft-cap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.model.ops import matmul, rms_norm
from tpumk.model.parts import Moe, Norms

# transformers' MuseSparkResidualGate clamps alpha's square from below
RESIDUAL_GATE_EPS = 1e-3


def gate_coefficients(gate: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) float32 of a residual gate vector, as transformers computes them in float32:
    w = gate / temperature, beta = sigmoid(w), alpha = sqrt(max(sigmoid(-w) * (1 + beta), eps))."""
    w = np.asarray(gate, np.float32) / np.float32(temperature)
    beta = (1.0 / (1.0 + np.exp(-w))).astype(np.float32)
    alpha = np.sqrt(np.maximum((1.0 / (1.0 + np.exp(w))).astype(np.float32) * (1.0 + beta), RESIDUAL_GATE_EPS))
    return alpha.astype(np.float32), beta


def join(norms: Norms, layer, which: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """The residual after a sublayer (`which`: "attn" or "mlp") whose output is y: x + y, or with
    residual_gates alpha * x + beta * y (float32 gates, per channel)."""
    if not norms.residual_gates:
        return x + y
    alpha, beta = layer[f"res_{which}_alpha"], layer[f"res_{which}_beta"]
    return alpha.astype(jnp.float32) * x + beta.astype(jnp.float32) * y


def head_norm(o: jax.Array, heads: int, head_dim: int, eps: float, width: int) -> jax.Array:
    """Each head's attention output [..., heads * head_dim] RMS-normalised over its `width` true
    lanes, without a weight (attn_out_norm)."""
    shape = o.shape
    per_head = o.reshape(*shape[:-1], heads, head_dim)
    return rms_norm(per_head, jnp.ones((head_dim,), jnp.float32), eps, width).reshape(shape)


def experts_in(moe: Moe, layer, x: jax.Array, eps: float) -> jax.Array:
    """What the routed experts read: x, or with moe_hidden_size the (1 + w)-normed down-projection
    x @ moe_in (moe_in_norm holds 1 + w, folded on load)."""
    if not moe.moe_hidden_size:
        return x
    return rms_norm(matmul(x, layer["moe_in"]), layer["moe_in_norm"], eps)


def expert_outputs(moe: Moe, y: jax.Array, eps: float) -> jax.Array:
    """Every expert's output [E, N, M] f32, with expert_post_norm RMS-normalised per row (its
    (1 + w) folded into e_down's columns on load)."""
    if not moe.expert_post_norm:
        return y
    return rms_norm(y, jnp.ones((y.shape[-1],), jnp.float32), eps)


def experts_out(moe: Moe, layer, out: jax.Array) -> jax.Array:
    """The routed experts' combined output back at the hidden width: out, or out @ moe_out."""
    return matmul(out, layer["moe_out"]) if moe.moe_hidden_size else out


def embed_normed(rows: jax.Array, eps: float) -> jax.Array:
    """The embedding rows RMS-normalised without a weight (embed_norm); a zero row (a token id
    outside the vocabulary) stays zero."""
    return rms_norm(rows, jnp.ones((rows.shape[-1],), jnp.float32), eps)
