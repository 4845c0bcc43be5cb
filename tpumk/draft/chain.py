"""EAGLE-3 and MTP: drafters that propose one token per step and chain k steps.

Both predict the token at position p + 1 from a row made of the token at p and a hidden state of
position p - 1 (speculators' EAGLE-3 data pairs token x[t + 1] with the target's hidden g[t];
its MTP pairs hidden[t] with input_ids[t + 1]), so both keep a cache of their own layers' keys
and values indexed by the row's token position p, and remember the last committed position's
hidden state:

- EAGLE-3 (speculators' Eagle3DraftModel): the taps, optionally normed (norm_before_fc: one
  RMSNorm over their concatenation; fc_norm: one per tap), projected by `fc` to g; its first
  layer reads [input_layernorm(embedding); hidden_norm(g)] (q / k / v over 2H) with g (or
  hidden_norm(g), norm_before_residual) as the residual; further layers are plain decoder
  layers; logits are its lm_head over norm(x) in the draft vocabulary. A chained step feeds the
  layer output x back as g (norm(x) with norm_output), as its training-time test does.
- MTP (speculators' MTPDraftModel, DeepSeek-V3's next-token layer): g is the target's final
  hidden state (tap num_layers); the row is eh_proj([enorm(embedding); hnorm(g)]) (speculators:
  input_proj over token_layernorm / hidden_layernorm), one decoder layer of the target's kind
  (DeepSeek-V3: MLA and experts; speculators' qwen3: GQA and a dense MLP), then the final norm
  (shared_head.norm / final_layernorm) and the target's head. A chained step feeds that normed
  output back as g, as speculators' mtp does (vLLM's DeepSeek MTP feeds the output before the
  norm: the first draft is the same, the later ones differ).

Attention sees the rows at positions 1 .. p (position 0 has no row: no hidden state precedes
it). A chained step's row is written at its position, past the committed length, and is
overwritten by the next `absorb` with the target's own hidden state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpumk.draft.config import DrafterSpec
from tpumk.draft.layers import (advance, attention, cache_shape, decoder_layer, draft_logits, embed_rows, mlp_part,
                                pick)
from tpumk.model.ops import jnp_dtype, matmul, rms_norm
from tpumk.model.reference import Params


def init_state(spec: DrafterSpec, batch: int, context: int) -> dict:
    dt = jnp_dtype(spec.layer)
    cache = {k: jnp.zeros(s, dt) for k, s in cache_shape(spec.layer, batch, context).items()}
    return {"cache": cache, "prev": jnp.zeros((batch, spec.hidden), jnp.float32),
            "length": jnp.zeros((batch,), jnp.int32)}


def project_taps(spec: DrafterSpec, params: Params, hidden: jax.Array) -> jax.Array:
    """The target's taps [B, q, T, H] -> the hidden input g of the drafter's rows [B, q, H] f32."""
    if spec.kind == "mtp":
        return hidden[..., 0, :].astype(jnp.float32)
    eps = spec.layer.norms.rms_eps
    b, q, t, h = hidden.shape
    x = hidden.astype(jnp.float32)
    if spec.fc_norm:
        x = rms_norm(x, params["fc_norm"], eps)  # one norm per tap, over its H lanes
    x = x.reshape(b, q, t * h)
    if spec.norm_before_fc:
        x = rms_norm(x, params["input_norm"], eps)
    return matmul(x, params["fc"])


def rows(spec: DrafterSpec, params: Params, target_params: Params, cache: dict, tokens: jax.Array, g: jax.Array,
         positions: jax.Array, keep: jax.Array) -> tuple[jax.Array, dict]:
    """The drafter's layers over rows (token at p, hidden g of p - 1) at positions p [B, T]: their
    keys and values written where `keep`; returns the last layer's output [B, T, H] f32."""
    cfg, eps = spec.layer, spec.layer.norms.rms_eps
    c = cache["latent"].shape[2] if cfg.is_mla else cache["k"].shape[3]
    k_valid = jnp.broadcast_to(jnp.arange(c) >= 1, (tokens.shape[0], c))
    e = embed_rows(params, target_params, tokens)
    if spec.kind == "mtp":
        x = matmul(jnp.concatenate([rms_norm(e, params["enorm"], eps), rms_norm(g, params["hnorm"], eps)], -1),
                   params["eh_proj"])
        return decoder_layer(cfg, 0, params["layer"], x, positions, cache, keep, k_valid)
    first = params["layers"][0]
    hn = rms_norm(g, first["hidden_norm"], eps)
    x_in = jnp.concatenate([rms_norm(e, first["attn_norm"], eps), hn], -1)
    a, cache = attention(cfg, 0, first, x_in, positions, cache, keep, k_valid)
    x = mlp_part(cfg, 0, first, (hn if spec.norm_before_residual else g) + a, x_in)
    for i, layer in enumerate(params["layers"][1:], 1):
        x, cache = decoder_layer(cfg, i, layer, x, positions, cache, keep, k_valid)
    return x, cache


def head(spec: DrafterSpec, params: Params, target_params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(draft logits, the hidden state the next chained step reads) from a step's output x."""
    n = rms_norm(x, params["norm"], spec.layer.norms.rms_eps)
    feedback = n if spec.kind == "mtp" or spec.norm_output else x
    return draft_logits(params, target_params, n), feedback


def absorb(spec: DrafterSpec, params: Params, target_params: Params, state: dict, hidden: jax.Array,
           tokens: jax.Array, positions: jax.Array, valid: jax.Array) -> dict:
    g = project_taps(spec, params, hidden)
    before = jnp.concatenate([state["prev"][:, None], g[:, :-1]], 1)  # row p reads g of p - 1
    _, cache = rows(spec, params, target_params, state["cache"], tokens, before, positions, valid & (positions >= 1))
    last, length = advance(state["length"], positions, valid)
    newest = jnp.take_along_axis(g, last[:, None, None], 1)[:, 0]
    prev = jnp.where((jnp.sum(valid, 1) > 0)[:, None], newest, state["prev"])
    return {"cache": cache, "prev": prev, "length": length}


def xla_step(spec: DrafterSpec, params: Params, target_params: Params, cache: dict, tokens: jax.Array, g: jax.Array,
             positions: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """One chained step as XLA operations: rows (token [B], hidden g [B, H]) at positions [B] ->
    (draft logits [B, Vd], the hidden state the next step reads [B, H], the cache with the rows)."""
    ones = jnp.ones((tokens.shape[0], 1), bool)
    x, cache = rows(spec, params, target_params, cache, tokens[:, None], g[:, None], positions[:, None], ones)
    logits, feedback = head(spec, params, target_params, x[:, 0])
    return logits, feedback, cache


def run(spec: DrafterSpec, params: Params, target_params: Params, state: dict, anchor: jax.Array,
        anchor_pos: jax.Array, choose, step=None) -> tuple[jax.Array, dict]:
    """The k chained steps from the anchor: logits [B, k, Vd] and the state (its cache holding the
    steps' rows). choose(step, logits [B, Vd]) -> the target id of that step's draft [B]. `step`:
    how a step runs (`xla_step`'s contract; the drafter's pass kernel, tpumk.kernel.draft_pass)."""
    step = step or (lambda cache, tok, g, pos: xla_step(spec, params, target_params, cache, tok, g, pos))
    cache, g, tok, pos = state["cache"], state["prev"], anchor, anchor_pos
    out = []
    for s in range(spec.block):
        logits, g, cache = step(cache, tok, g, pos)
        out.append(logits)
        tok, pos = choose(s, logits), pos + 1
    return jnp.stack(out, 1), {**state, "cache": cache}


def logits(spec, params, target_params, state, anchor, anchor_pos, tokens, step=None):
    return run(spec, params, target_params, state, anchor, anchor_pos, lambda s, _: tokens[:, s], step)[0]


def propose(spec, params, target_params, state, anchor, anchor_pos, key, temperature, step=None):
    keys = [None] * spec.block if key is None else list(jax.random.split(key, spec.block))
    drafts, probs = [], []

    def choose(s, lg):
        tok, q = pick(spec, params, lg, keys[s], temperature)
        drafts.append(tok)
        probs.append(q)
        return tok

    _, state = run(spec, params, target_params, state, anchor, anchor_pos, choose, step)
    return jnp.stack(drafts, 1), jnp.stack(probs, 1), state
