"""DFlash, DFlash2 and DSpark: a block of one anchor and block_size - 1 mask tokens drafted in one
pass over context keys and values projected from the target's taps (speculators' DFlashDraftModel
and its two variants).

Context: the taps of every committed position p, concatenated and projected by `fc` then
`hidden_norm` (c_p), give each draft layer's keys k_norm(k_proj(c_p)) (roped at p) and values
v_proj(c_p): a cache of those per layer and position, filled by `absorb`. A round's block holds
the anchor at anchor_pos and mask_token_id at the next positions; each layer's queries, and its
keys and values for the block itself, come from the block's residual stream (Qwen3 layers with
QK-norm); a block row sees every committed position below the anchor and every row of its block
(no causal mask inside it), as speculators' anchored-block mask has it. Slot j's output (the
draft's norm, then its head) predicts position anchor_pos + j (speculators' sample_from_anchor
false: slots 1 .. block_size - 1 draft) or anchor_pos + j + 1 (sample_from_anchor true, DSpark's
default: every slot drafts).

- DFlash2 (speculators' DFlash2DraftModel, after z-lab's): each layer's attention and MLP are
  wrapped by a grouped dynamic causal convolution inside the block (conv_kernel_size taps; each
  group of conv_group_size channels weighs its taps by a base kernel plus a per-row kernel
  projected from the row's own input, before the sublayer, and by the other half of that
  projection after it); its candidate selector then reranks the head's top selector_top_k
  tokens by adding a bilinear transition score, predecessor_codebook[previous token] x
  hidden_projection(hidden) . successor_codebook[candidate]. A draft is the best candidate
  (greedy) or drawn from the softmax over the candidates' scores (zero elsewhere), left to
  right, the previous token being the draft just picked (the anchor for the first).
- DSpark (speculators' DSparkDraftModel): the logits of each slot get a low-rank Markov bias
  from the previous token, applied left to right: `vanilla` W2(W1[previous]); `gated`
  W2(sigmoid(gate([hidden; W1[previous]])) * W1[previous]); `rnn` a recurrent state over the
  block's slots, W2(tanh(out)). Its confidence head, which predicts each draft's acceptance
  probability so that a serving stack can cut a block short, is read and shape-checked but
  never evaluated: it changes neither the drafts nor the distribution they are drawn from, and
  tpumk's round verifies every draft of the block (greedy or sampled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpumk.draft.config import DrafterSpec
from tpumk.draft.layers import advance, cache_shape, draft_logits, embed_rows, pick, position_major, write_head_rows
from tpumk.model.ops import jnp_dtype, matmul, rms_norm
from tpumk.model.reference import Params, attend, ffn, mlp_in, o_proj, qkv, sublayer_in


def init_state(spec: DrafterSpec, batch: int, context: int) -> dict:
    dt = jnp_dtype(spec.layer)
    state = {k: jnp.zeros(s, dt) for k, s in cache_shape(spec.layer, batch, context).items()}
    return {**state, "length": jnp.zeros((batch,), jnp.int32)}


def context_rows(spec: DrafterSpec, params: Params, hidden: jax.Array) -> jax.Array:
    """The target's taps [B, q, T, H] -> the context rows c [B, q, H] f32 (fc, then hidden_norm)."""
    b, q, t, h = hidden.shape
    return rms_norm(matmul(hidden.reshape(b, q, t * h), params["fc"]), params["hidden_norm"],
                    spec.layer.norms.rms_eps)


def absorb(spec: DrafterSpec, params: Params, target_params: Params, state: dict, hidden: jax.Array,
           tokens: jax.Array, positions: jax.Array, valid: jax.Array) -> dict:
    c = context_rows(spec, params, hidden)
    k_cache, v_cache = state["k"], state["v"]
    for i, layer in enumerate(params["layers"]):
        _, k, v = qkv(spec.layer, layer, c, positions, i)  # (q unused: dropped under jit)
        k_cache = write_head_rows(k_cache, i, positions, valid, k)
        v_cache = write_head_rows(v_cache, i, positions, valid, v)
    return {"k": k_cache, "v": v_cache, "length": advance(state["length"], positions, valid)[1]}


def _conv(spec: DrafterSpec, x: jax.Array, delta: jax.Array, base: jax.Array) -> jax.Array:
    """DFlash2's grouped dynamic causal convolution inside the block: x [B, S, H] (S the block's
    rows), delta [B, S, K, G] per-row kernels, base [K, H]; tap t reads the row t before (zero
    before the block's first row)."""
    b, s, h = x.shape
    g = h // spec.conv_group
    xg = x.reshape(b, s, g, spec.conv_group)
    out = jnp.zeros_like(xg)
    for t in range(base.shape[0]):
        shifted = jnp.pad(xg[:, :s - t], ((0, 0), (t, 0), (0, 0), (0, 0)))
        coef = base[t].astype(jnp.float32).reshape(g, spec.conv_group) + delta[:, :, t, :, None]
        out = out + shifted * coef
    return out.reshape(b, s, h)


def _conv_in(spec: DrafterSpec, layer: Params, which: str, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A sublayer's input convolved, and the kernels its output convolution will use."""
    b, s, hid = h.shape
    kernels = matmul(h, layer[f"{which}_conv_proj"]).reshape(b, s, 2, spec.conv_kernel, hid // spec.conv_group)
    return _conv(spec, h, kernels[:, :, 0], layer[f"{which}_conv_base"][0]), kernels[:, :, 1]


def block_forward(spec: DrafterSpec, params: Params, target_params: Params, state: dict, anchor: jax.Array,
                  anchor_pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The block's final hidden states [B, S, H] (after the draft's norm) and its head's logits
    [B, S, Vd] (before any selector or Markov bias)."""
    cfg, s = spec.layer, spec.block_size
    b = anchor.shape[0]
    pos = anchor_pos[:, None] + jnp.arange(s, dtype=jnp.int32)
    tokens = jnp.concatenate([anchor[:, None], jnp.full((b, s - 1), spec.mask_token_id, jnp.int32)], 1)
    x = embed_rows(params, target_params, tokens)
    c = state["k"].shape[3]
    committed = jnp.minimum(state["length"], anchor_pos)
    # block keys carry the anchor's position for the mask: every block row sees all of them
    k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c)),
                             jnp.broadcast_to(anchor_pos[:, None], (b, s))], 1)
    k_valid = jnp.concatenate([jnp.arange(c)[None] < committed[:, None], jnp.ones((b, s), bool)], 1)
    conv = spec.kind == "dflash2"
    for i, layer in enumerate(params["layers"]):
        h = sublayer_in(cfg.norms, layer, "attn_norm", x)
        if conv:
            h, out_kernel = _conv_in(spec, layer, "attn", h)
        q, k, v = qkv(cfg, layer, h, pos, i)
        keys = jnp.concatenate([position_major(state["k"][i]), k], 1)
        values = jnp.concatenate([position_major(state["v"][i]), v], 1)
        a = o_proj(cfg, layer, attend(cfg.attention, q, keys, values, pos, k_pos, k_valid), h)
        if conv:
            a = _conv(spec, a, out_kernel, layer["attn_conv_base"][1])
        x = x + a
        h = mlp_in(cfg.norms, layer, x, h)
        if conv:
            h, out_kernel = _conv_in(spec, layer, "mlp", h)
        y = ffn(cfg, i, layer, h.reshape(b * s, -1)).reshape(b, s, -1)
        if conv:
            y = _conv(spec, y, out_kernel, layer["mlp_conv_base"][1])
        x = x + y
    hidden = rms_norm(x, params["norm"], cfg.norms.rms_eps)
    return hidden, draft_logits(params, target_params, hidden)


def _slot_logits(spec: DrafterSpec, params: Params, hidden: jax.Array, unary: jax.Array, prev: jax.Array,
                 carry: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One slot's logits [B, Vd] given the token before the one it drafts (prev [B], target ids)
    and the Markov head's recurrent state (`rnn`; unused otherwise)."""
    if spec.kind == "dspark" and spec.markov_rank:
        emb = params["markov_w1"][prev].astype(jnp.float32)  # [B, r]
        if spec.markov_head == "gated":
            gate = jax.nn.sigmoid(matmul(jnp.concatenate([hidden, emb], -1), params["markov_gate"])
                                  + params["markov_gate_bias"].astype(jnp.float32))
            emb = gate * emb
        elif spec.markov_head == "rnn":
            z = matmul(jnp.concatenate([carry, emb, hidden], -1), params["markov_joint"]) \
                + params["markov_joint_bias"].astype(jnp.float32)
            g, cand, out = jnp.split(z, 3, -1)
            g = jax.nn.sigmoid(g)
            carry = g * carry + (1.0 - g) * jnp.tanh(cand)
            emb = jnp.tanh(out)
        return unary + matmul(emb, params["markov_w2"]), carry
    if spec.kind == "dflash2":
        cand = jax.lax.top_k(unary, spec.selector_top_k)[1]  # [B, K] draft (= target) ids
        context = params["sel_pred"][prev].astype(jnp.float32) * matmul(hidden, params["sel_hidden"])
        transition = jnp.einsum("br,bkr->bk", context, params["sel_succ"][cand].astype(jnp.float32))
        scores = jnp.take_along_axis(unary, cand, -1) + transition
        rows = jnp.arange(unary.shape[0])[:, None]
        return jnp.full_like(unary, -jnp.inf).at[rows, cand].set(scores), carry
    return unary, carry


def run(spec: DrafterSpec, params: Params, target_params: Params, state: dict, anchor: jax.Array,
        anchor_pos: jax.Array, choose, forward=None) -> jax.Array:
    """The block's drafting slots left to right: logits [B, k, Vd]; choose(i, logits [B, Vd]) ->
    the target id of draft i [B] (the next slot's previous token). `forward(state, anchor,
    anchor_pos)`: how the block pass runs (`block_forward`'s contract; the drafter's pass kernel,
    tpumk.kernel.draft_pass)."""
    if forward is None:
        hidden, unary = block_forward(spec, params, target_params, state, anchor, anchor_pos)
    else:
        hidden, unary = forward(state, anchor, anchor_pos)
    prev = anchor
    carry = jnp.zeros((anchor.shape[0], spec.markov_rank), jnp.float32)
    out = []
    for j in range(spec.first_slot + spec.block):
        lg, carry = _slot_logits(spec, params, hidden[:, j], unary[:, j], prev, carry)
        if j >= spec.first_slot:  # slot j drafts; its draft is the next slot's previous token
            out.append(lg)
            prev = choose(j - spec.first_slot, lg)
    return jnp.stack(out, 1)


def logits(spec, params, target_params, state, anchor, anchor_pos, tokens, forward=None):
    return run(spec, params, target_params, state, anchor, anchor_pos, lambda i, _: tokens[:, i], forward)


def propose(spec, params, target_params, state, anchor, anchor_pos, key, temperature, forward=None):
    keys = [None] * spec.block if key is None else list(jax.random.split(key, spec.block))
    drafts, probs = [], []

    def choose(i, lg):
        tok, q = pick(spec, params, lg, keys[i], temperature)
        drafts.append(tok)
        probs.append(q)
        return tok

    run(spec, params, target_params, state, anchor, anchor_pos, choose, forward)
    return jnp.stack(drafts, 1), jnp.stack(probs, 1), state
