"""Linear attention (the reference): Gated DeltaNet (Qwen3-Next, Qwen3.5) and Kimi Delta
Attention (Kimi Linear), and the per-sequence state pool a hybrid model keeps beside its KV cache.

A linear layer (tpumk.model.parts.LinearAttention) reads the normed residual x and:
1. projects it: q | k | v (`lin_qkv`, the convolution's channels), and the gates: Gated DeltaNet
   z (`lin_z`, the output gate), b and a (`lin_b`, `lin_a`: per value head); KDA b (`lin_b`) and
   the low-rank forget gate f = (x @ lin_f_a) @ lin_f_b and output gate (x @ lin_g_a) @ lin_g_b;
2. runs a depthwise causal convolution of `taps` taps over q | k | v (its window: the last
   taps - 1 inputs of the sequence, in the state pool), then SiLU;
3. L2-normalises q and k per head (eps 1e-6), scales q by key_dim^-0.5;
4. decays and updates each value head's state S [key_dim, value_dim] by the gated delta rule:
       S <- diag(exp(g)) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
   with beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) (Gated DeltaNet: one per
   value head, the same for every key channel) or -exp(A_log[head]) * softplus(f + dt_bias) (KDA:
   one per key channel); value head j reads key head j // (value heads / key heads);
5. normalises each head's o (RMSNorm, weight `lin_norm`), gates it (Gated DeltaNet: silu(z);
   KDA: sigmoid of the output gate) and projects it out (`lin_out`).

Numerics (what the megakernel follows): matrix products as `tpumk.model.ops.matmul`; the
convolution's inputs are rounded to the model dtype (they are what the window stores, as
transformers' cache does); everything after is float32, the state float32.

The state pool (`LinearStates`), per linear layer and sequence slot: the recurrent state, the
convolution window, and the raw inputs of up to `pending` tokens not yet applied. A step first
applies each slot's `counts` pending tokens (replay), then its own tokens. A step of q tokens on
a pool with pending >= q (a speculative verify step) writes back the state *before* its tokens
and leaves them pending, `counts` = q: rolling back to an accepted prefix of n tokens is setting
counts to n (`keep_accepted`), with no state copied; the next step applies them. Any longer
step (a prompt) and every step on a pool without pending rows applies its tokens at once.
Transformers keeps no such rows; the tokens each step computes are the same.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tpumk.model.config import ModelConfig
from tpumk.model.ops import jnp_dtype, matmul, rms_norm
from tpumk.model.parts import LinearAttention

L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon
CHUNK = 64  # tokens per chunk of the chunked (prefill) form


class LinearStates(NamedTuple):
    """The state pool of a hybrid model's linear layers (L of them) over S sequence slots.

    recurrent [L, S, value heads, key_dim, value_dim] float32; conv [L, S, taps - 1, C] float32
    (the last inputs, oldest first, each a model-dtype value); pending [L, S, P, W] float32 (P rows
    of raw inputs laid out as `pending_offsets` says); counts [S] int32 (pending rows each slot
    applies next); slots [B] int32 (each sequence's slot)."""
    recurrent: jax.Array
    conv: jax.Array
    pending: jax.Array
    counts: jax.Array
    slots: jax.Array

    @property
    def num_slots(self) -> int:
        return self.recurrent.shape[1]

    @property
    def pending_rows(self) -> int:
        return self.pending.shape[2]


LANE = 128  # each part of a pending row starts on a lane tile (the kernel slices them whole)


def _lanes(n: int) -> int:
    return -(-n // LANE) * LANE


def pending_offsets(lin: LinearAttention) -> tuple[int, int, int]:
    """Where a pending row's parts start, and its width: (b, the second gate input, width). The
    row: the convolution's inputs q | k | v from lane 0, b (per value head) from the next lane
    tile, then Gated DeltaNet's a (per value head) or KDA's forget-gate projection f (per key
    channel of each head) from the next, then one lane tile whose first lane is 1 for a live
    token (a token at a position outside the cache changes no state, now or when replayed)."""
    b = _lanes(lin.conv_dim)
    second = b + _lanes(lin.linear_value_heads)
    width = second + _lanes(lin.linear_value_heads if lin.linear_kind == "gated_delta" else lin.decay_width) + LANE
    return b, second, width


def pool_bytes(cfg: ModelConfig, num_slots: int, pending: int = 0) -> int:
    """Bytes of the pool `init_states` makes (float32 states, windows and pending rows of every
    linear layer and slot; the counts and slots besides are a few bytes); 0 without linear layers."""
    lin = cfg.linear
    if not lin:
        return 0
    import math

    per_slot = math.prod(lin.state_shape) + (lin.linear_conv - 1) * lin.conv_dim + pending * pending_offsets(lin)[2]
    return 4 * len(cfg.linear_layers) * num_slots * per_slot


def init_states(cfg: ModelConfig, batch: int, num_slots: int | None = None, pending: int = 0,
                seed: int | None = 0) -> LinearStates:
    """An empty pool (zero states and windows, nothing pending) of `num_slots` slots (default:
    one per sequence), the sequences on distinct slots (a seeded shuffle, so tests exercise the
    indirection); `pending` rows per slot (the widest verify step that may be rolled back)."""
    import numpy as np

    lin = cfg.linear
    num_slots = batch if num_slots is None else num_slots
    if num_slots < batch:
        raise ValueError(f"init_states: {num_slots} slots for {batch} sequences")
    order = np.arange(num_slots) if seed is None else np.random.default_rng(seed).permutation(num_slots)
    n = len(cfg.linear_layers)
    return LinearStates(
        jnp.zeros((n, num_slots, *lin.state_shape), jnp.float32),
        jnp.zeros((n, num_slots, lin.linear_conv - 1, lin.conv_dim), jnp.float32),
        jnp.zeros((n, num_slots, pending, pending_offsets(lin)[2]), jnp.float32),
        jnp.zeros((num_slots,), jnp.int32),
        jnp.asarray(order[:batch], jnp.int32))


def keep_accepted(states: LinearStates, accepted: jax.Array) -> LinearStates:
    """After a verify step left its q tokens pending: keep only the first `accepted[b]` tokens
    of sequence b (0 <= accepted <= q); the rest are never applied."""
    ok = (states.slots >= 0) & (states.slots < states.num_slots)
    slots = jnp.where(ok, states.slots, states.num_slots)
    return states._replace(counts=states.counts.at[slots].set(accepted.astype(jnp.int32), mode="drop"))


# ---------------------------------------------------------------------- one layer's parts
def project(lin: LinearAttention, layer, x: jax.Array, dt) -> tuple[jax.Array, jax.Array]:
    """x [..., H] normed -> (the convolution's inputs q | k | v [..., C] rounded to the model
    dtype, the raw gate inputs [..., pending width - b's lane] float32: b then a or f, as the
    pending row lays them out from its b offset)."""
    conv_in = matmul(x, layer["lin_qkv"]).astype(dt).astype(jnp.float32)
    b_at, second, width = pending_offsets(lin)
    b = matmul(x, layer["lin_b"])
    second_in = matmul(x, layer["lin_a"]) if lin.linear_kind == "gated_delta" else \
        matmul(matmul(x, layer["lin_f_a"]), layer["lin_f_b"])
    pad = lambda v, n: jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, n - v.shape[-1])])  # noqa: E731
    return conv_in, jnp.concatenate([pad(b, second - b_at), pad(second_in, width - LANE - second)], -1)


def decay_and_beta(lin: LinearAttention, layer, gates: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Raw gate inputs (`project`'s) -> (g [..., Hv, Dk] log-decays (<= 0) per key channel,
    beta [..., Hv]), float32."""
    hv, dk = lin.linear_value_heads, lin.linear_key_dim
    b_at, second, _ = pending_offsets(lin)
    beta = jax.nn.sigmoid(gates[..., :hv])
    rate = jnp.exp(layer["lin_A_log"].astype(jnp.float32))  # [Hv]
    pre = gates[..., second - b_at:second - b_at + lin.decay_width] + layer["lin_dt_bias"].astype(jnp.float32)
    if lin.linear_kind == "gated_delta":
        g = -rate * jax.nn.softplus(pre)  # [..., Hv]
        g = jnp.broadcast_to(g[..., None], (*g.shape, dk))
    else:
        g = -rate[:, None] * jax.nn.softplus(pre.reshape(*pre.shape[:-1], hv, dk))
    return g, beta


def conv_outputs(lin: LinearAttention, layer, window: jax.Array, conv_in: jax.Array) -> jax.Array:
    """The causal convolution + SiLU over q | k | v: window [..., taps - 1, C] (the previous
    inputs), conv_in [..., T, C] -> [..., T, C] float32 (each output rounded to the model dtype
    before SiLU, as transformers' convolution in the model dtype)."""
    taps, dt = lin.linear_conv, layer["lin_conv"].dtype
    seq = jnp.concatenate([window, conv_in], -2)  # [..., taps - 1 + T, C] f32 (model-dtype values)
    w = layer["lin_conv"].astype(jnp.float32)  # [taps, C]
    t = conv_in.shape[-2]
    out = seq[..., 0:t, :] * w[0]
    for j in range(1, taps):  # tap by tap, in this order (the kernel's)
        out = out + seq[..., j:j + t, :] * w[j]
    return jax.nn.silu(out.astype(dt).astype(jnp.float32))


def _l2norm(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + L2_EPS)


def heads(lin: LinearAttention, conv_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Convolution outputs [..., C] -> q, k [..., Hv, Dk] (normalised, q scaled; key heads
    repeated over their value heads), v [..., Hv, Dv]."""
    hk, hv, dk, dv = lin.linear_key_heads, lin.linear_value_heads, lin.linear_key_dim, lin.linear_value_dim
    q = conv_out[..., :lin.key_size].reshape(*conv_out.shape[:-1], hk, dk)
    k = conv_out[..., lin.key_size:2 * lin.key_size].reshape(*conv_out.shape[:-1], hk, dk)
    v = conv_out[..., 2 * lin.key_size:].reshape(*conv_out.shape[:-1], hv, dv)
    q = _l2norm(q) * (dk ** -0.5)
    k = _l2norm(k)
    if lin.group > 1:
        q, k = jnp.repeat(q, lin.group, axis=-2), jnp.repeat(k, lin.group, axis=-2)
    return q, k, v


def delta_step(state: jax.Array, q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule. state [..., Hv, Dk, Dv]; q, k, g [..., Hv, Dk]; v [...,
    Hv, Dv]; beta [..., Hv] -> (the new state, o [..., Hv, Dv])."""
    state = state * jnp.exp(g)[..., None]
    kv = jnp.sum(state * k[..., None], -2)  # S^T k: [..., Hv, Dv]
    delta = (v - kv) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, jnp.sum(state * q[..., None], -2)


def delta_chunked(state: jax.Array, q, k, v, g, beta, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T tokens at once, chunk by chunk (the prefill form; equal to T
    `delta_step`s up to float32 rounding). state [B, Hv, Dk, Dv]; q, k, g [B, T, Hv, Dk]; v [B, T,
    Hv, Dv]; beta [B, T, Hv] -> (the state after the T tokens, o [B, T, Hv, Dv]).

    Within a chunk of C tokens with start state S0 and cumulative log-decays G_i (per key
    channel), the updates u_i = beta_i (v_i - S'_i^T k_i) solve the unit lower-triangular system
    (I + A) U = diag(beta) (V - K~ S0), A_ij = beta_i k_i . (exp(G_i - G_j) k_j) for j < i,
    K~_i = exp(G_i) k_i; then o_i = S0^T (exp(G_i) q_i) + sum_{j <= i} (q_i . exp(G_i - G_j) k_j) u_j
    and S_C = diag(exp(G_C)) S0 + sum_j diag(exp(G_C - G_j)) k_j u_j^T. Every exponent is <= 0."""
    b, t, hv, dk = k.shape
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [B, T, ...] -> [n, B, C, ...], padded with tokens that change nothing
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))

    def body(s0, xs):
        qc, kc, vc, gc, bc = xs  # [B, C, Hv, .]
        cum = jnp.cumsum(gc, axis=1)  # G_i [B, C, Hv, Dk]
        rel = cum[:, :, None] - cum[:, None, :]  # G_i - G_j [B, C(i), C(j), Hv, Dk]
        rel = jnp.where(causal[None, :, :, None, None], rel, -jnp.inf)
        decay = jnp.exp(rel)
        a = jnp.einsum("bihd,bijhd,bjhd->bhij", kc, decay, kc) * jnp.moveaxis(bc, 1, 2)[..., None]
        a = jnp.where(strict, a, 0.0)
        s0k = jnp.einsum("bihd,bhde->bhie", jnp.exp(cum) * kc, s0)  # (K~ S0)_i
        rhs = jnp.moveaxis(bc, 1, 2)[..., None] * (jnp.moveaxis(vc, 1, 2) - s0k)  # [B, Hv, C, Dv]
        u = lax.linalg.triangular_solve(jnp.eye(chunk) + a, rhs, left_side=True, lower=True, unit_diagonal=True)
        qk = jnp.einsum("bihd,bijhd,bjhd->bhij", qc, decay, kc)  # causal (decay 0 above)
        o = jnp.einsum("bihd,bhde->bhie", jnp.exp(cum) * qc, s0) + jnp.einsum("bhij,bhje->bhie", qk, u)
        last = cum[:, -1]  # G_C [B, Hv, Dk]
        tail = jnp.exp(last[:, None] - cum)  # [B, C, Hv, Dk]
        s1 = jnp.exp(last)[..., None] * s0 + jnp.einsum("bjhd,bhje->bhde", tail * kc, u)
        return s1, jnp.moveaxis(o, 2, 1)

    # padding tokens: k = v = 0 and g = 0 leave the state as it is
    state, o = lax.scan(body, state, tuple(chunks(x) for x in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, 0, 1).reshape(b, n * chunk, hv, -1)[:, :t]
    return state, o


def gated_output(lin: LinearAttention, layer, x: jax.Array, o: jax.Array, eps: float) -> jax.Array:
    """o [..., Hv, Dv] -> the layer's output [..., H] f32: each head RMS-normed (lin_norm), gated
    (Gated DeltaNet: silu(x @ lin_z); KDA: sigmoid((x @ lin_g_a) @ lin_g_b)), projected out."""
    if lin.linear_kind == "gated_delta":
        gate = jax.nn.silu(matmul(x, layer["lin_z"]))
    else:
        gate = jax.nn.sigmoid(matmul(matmul(x, layer["lin_g_a"]), layer["lin_g_b"]))
    y = rms_norm(o, layer["lin_norm"], eps) * gate.reshape(o.shape)
    return matmul(y.reshape(*o.shape[:-2], lin.value_size), layer["lin_out"])


# ---------------------------------------------------------------------- a layer in a step
def _token(lin: LinearAttention, layer, carry, conv_in, gates, live):
    """Apply one token (conv_in [B, C], gates [B, W], live [B]: a dead token changes nothing) to
    carry = (window [B, taps - 1, C], state [B, Hv, Dk, Dv]) -> (carry, o [B, Hv, Dv])."""
    window, state = carry
    out = conv_outputs(lin, layer, window, conv_in[:, None])[:, 0]
    q, k, v = heads(lin, out)
    g, beta = decay_and_beta(lin, layer, gates)
    new_state, o = delta_step(state, q, k, v, g, beta)
    new_window = jnp.concatenate([window[:, 1:], conv_in[:, None]], 1)
    keep = live[:, None, None]
    return (jnp.where(keep, new_window, window), jnp.where(keep[..., None], new_state, state)), o


def layer_step(lin: LinearAttention, layer, x: jax.Array, live: jax.Array, states: LinearStates, index: int,
               eps: float, dt) -> tuple[jax.Array, LinearStates]:
    """One linear layer of a step. x [B, T, H] normed; live [B, T] (a token at a position outside
    the cache changes no state); `index`: the layer's place in the pool. -> (out [B, T, H] f32,
    the pool with this layer's slots updated). See the module docstring for pending rows."""
    b, t, _ = x.shape
    ok = (states.slots >= 0) & (states.slots < states.num_slots)
    read = jnp.clip(states.slots, 0, states.num_slots - 1)  # as the KV cache: read clipped, write dropped
    write = jnp.where(ok, states.slots, states.num_slots)
    window, state = states.conv[index, read], states.recurrent[index, read]
    conv_in, gates = project(lin, layer, x, dt)

    # Replay the rows a previous step left pending (count per slot).
    counts = states.counts[read]
    pend = states.pending[index, read]  # [B, P, W]
    c = lin.conv_dim

    b_at = pending_offsets(lin)[0]

    flag = pending_offsets(lin)[2] - LANE

    def replay(r, carry):
        row = pend[:, r]
        return _token(lin, layer, carry, row[:, :c], row[:, b_at:flag], (r < counts) & (row[:, flag] == 1.0))[0]

    if states.pending_rows:
        window, state = lax.fori_loop(0, states.pending_rows, replay, (window, state))
    keep_pending = 0 < t <= states.pending_rows
    if keep_pending or t <= CHUNK:
        def scan_token(carry, xs):
            return _token(lin, layer, carry, *xs)
        (end_window, end_state), o = lax.scan(scan_token, (window, state),
                                              (jnp.moveaxis(conv_in, 1, 0), jnp.moveaxis(gates, 1, 0),
                                               jnp.moveaxis(live, 1, 0)))
        o = jnp.moveaxis(o, 0, 1)
    else:  # a prompt: the chunked form (dead tokens, if any, only at the end: as the padding)
        seq_in = jnp.where(live[..., None], conv_in, 0)
        outs = conv_outputs(lin, layer, window, seq_in)
        q, k, v = heads(lin, outs)
        g, beta = decay_and_beta(lin, layer, gates)
        alive = live[..., None, None]
        end_state, o = delta_chunked(state, q, jnp.where(alive, k, 0.0), v, jnp.where(alive, g, 0.0),
                                     jnp.where(live[..., None], beta, 0.0))
        full = jnp.concatenate([window, seq_in], 1)
        n_live = jnp.sum(live, 1)  # the window ends at the last live token
        end_window = jax.vmap(lambda f, m: lax.dynamic_slice_in_dim(f, m, window.shape[1], 0))(full, n_live)
    out = gated_output(lin, layer, x, o, eps)
    if keep_pending:  # the state before this step's tokens, which stay pending (counts = T)
        live_lane = jnp.pad(live[..., None].astype(jnp.float32), ((0, 0), (0, 0), (0, LANE - 1)))
        rows = jnp.concatenate([jnp.pad(conv_in, ((0, 0), (0, 0), (0, b_at - c))), gates, live_lane], -1)
        pend = jnp.zeros_like(pend).at[:, :t].set(rows)
        new = states._replace(
            recurrent=states.recurrent.at[index, write].set(state, mode="drop"),
            conv=states.conv.at[index, write].set(window, mode="drop"),
            pending=states.pending.at[index, write].set(pend, mode="drop"))
    else:
        new = states._replace(recurrent=states.recurrent.at[index, write].set(end_state, mode="drop"),
                              conv=states.conv.at[index, write].set(end_window, mode="drop"))
    return out, new


def step_counts(states: LinearStates, t: int) -> LinearStates:
    """The pool's counts after a step of t tokens: t pending where the step kept them, else 0."""
    ok = (states.slots >= 0) & (states.slots < states.num_slots)
    write = jnp.where(ok, states.slots, states.num_slots)
    kept = t if 0 < t <= states.pending_rows else 0
    return states._replace(counts=states.counts.at[write].set(kept, mode="drop"))
