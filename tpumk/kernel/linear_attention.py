"""The megakernel's linear-attention stage: one Gated DeltaNet or KDA layer of every sequence,
with its state streamed through VMEM from the per-sequence state pool.

It runs inside the megakernel's layer loop (`tpumk.kernel.megakernel`), after the ring has put
the layer's in-projection into `proj` (`LinearGeometry.proj_offsets`; KDA's low-rank gates'
second halves into `f` and `g`), and follows `tpumk.model.linear_attention.layer_step`:

- per sequence b (a `fori_loop`), its slot's entry (recurrent state [Hv, Dk, Dv] f32, the
  convolution window, the pending rows) is read by DMA into one of two VMEM buffers while the
  previous sequence computes (`start_reads` for b + 1 before b waits for its own), and written
  back from it once replayed, while b's own tokens run on a copy (`work`), so the write-back
  DMA and the token pass never touch the same VMEM;
- replay: the slot's `counts` pending rows (a static loop over the pool's rows, each applied
  only below the count and when its live flag is set), in place in the buffer;
- the step's tokens (a static loop over q): the convolution over the window rows (values
  only: the window written back is the replayed one), SiLU, per key head L2-normalised q and
  k, per value head the decay, then ONE [8, Dk] x [Dk, Dv] product (rows k and q against the
  decayed state S') gives k.S' and q.S'; delta = beta (v - k.S'), S = S' + k^T delta (k as a
  column: a transpose of the [8, Dk] block) and o = q.S' + (q . k) delta, which is q.S;
- the step's rows go to the pool as pending (rows of `proj`, the convolution's inputs rounded
  to the model dtype, and each token's live flag), so the next step replays them;
- every head's output (`o`) is RMS-normed and gated into `y` (Gated DeltaNet: silu(z); KDA:
  sigmoid(g)), the out-projection's input.

The state math runs in float32 at HIGHEST precision; a token at a position outside the cache
changes no state (as the reference). One device updates the pool in place (its arrays are
aliased outputs); on many devices the kernel writes each sequence's new entry to outputs that
the step scatters into the pool after it (XLA would copy an aliased operand of a collective
kernel whole, every step: docs/many-devices.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.plan.geometry import F32_SUBLANES, LANE, LINEAR_ROW, WEIGHT_DTYPES, LinearGeometry

_HIGHEST = lax.Precision.HIGHEST
L2_EPS = 1e-6  # tpumk.model.linear_attention.L2_EPS


class LinearScratch:
    """The stage's scratch refs by name, in `LinearGeometry.scratch` order."""

    def __init__(self, geom: LinearGeometry, refs: list):
        names = [b.name for b in geom.scratch()]
        assert len(refs) == len(names), "linear scratch refs and the geometry disagree"
        for n, r in zip(names, refs):
            setattr(self, n, r)
        if geom.kind != "kda":
            self.f = self.g = self.low = None


@dataclass
class StatePool:
    """The pool as the kernel sees it: slots and counts (SMEM), the arrays (HBM: read, and on
    one device written in place), and on many devices the outputs each sequence's new entry
    goes to ([B, L lin, ...])."""
    slots: object
    counts: object
    recurrent: object
    window: object
    pending: object
    outputs: tuple | None = None  # (recurrent, window, pending) outputs, or None: in place

    @property
    def num_slots(self) -> int:
        """Slots in the pool the step was given (its arrays' second axis: any number)."""
        return self.recurrent.shape[1]


def _entry_copies(g: LinearGeometry, pool: StatePool, sc: LinearScratch, layer, b, buf, write: bool):
    """The three DMAs of sequence b's entry in linear layer `layer` <-> VMEM buffer `buf`."""
    slot = jnp.clip(pool.slots[b], 0, pool.num_slots - 1)
    if write and pool.outputs is not None:
        rec, win, pend = (o.at[b, layer] for o in pool.outputs)
    else:
        rec, win, pend = (a.at[layer, slot] for a in (pool.recurrent, pool.window, pool.pending))
    vmem = (sc.state.at[buf], sc.window.at[buf], (sc.pend_out if write else sc.pend_in).at[buf])
    sems = sc.out_sems if write else sc.in_sems
    pairs = ((rec, vmem[0]), (win, vmem[1]), (pend, vmem[2]))
    return [pltpu.make_async_copy(*((v, h) if write else (h, v)), sems.at[buf, i]) for i, (h, v) in enumerate(pairs)]


def _writes(g: LinearGeometry, pool: StatePool, b):
    """Whether sequence b's entry is written: always to the outputs; in place only when its
    slot is in the pool (a slot outside it writes nothing, as a page outside the KV pool)."""
    if pool.outputs is not None:
        return jnp.bool_(True)
    s = pool.slots[b]
    return jnp.logical_and(s >= 0, s < pool.num_slots)


def start_reads(g: LinearGeometry, pool: StatePool, sc: LinearScratch, layer, b=0) -> None:
    """Start the reads of sequence b's entry into buffer b % 2 (the megakernel calls this for
    sequence 0 before the layer's in-projection, so the DMAs fly behind its tiles)."""
    for cp in _entry_copies(g, pool, sc, layer, b, lax.rem(b, 2) if not isinstance(b, int) else b % 2, False):
        cp.start()


def _row(ref, row, lo: int, width: int):
    """ref[row, lo:lo + width] as [1, width] (a traced row: Mosaic loads a traced row whole,
    then the lanes are sliced from the value)."""
    return ref[pl.ds(row, 1), :][:, lo:lo + width]


class _Layer:
    """One layer's constants as values: the decay row, the taps, the norm row, the model dtype."""

    def __init__(self, g: LinearGeometry, vec):
        self.g = g
        self.dt = WEIGHT_DTYPES[g.dtype]
        c = g.conv_dim
        t0 = LINEAR_ROW["taps"]
        self.taps = [vec[t0 + j:t0 + j + 1, :c] for j in range(g.taps)]
        d = LINEAR_ROW["decay"]
        self.a_log = vec[d:d + 1, 0:LANE]
        self.dt_bias = vec[d:d + 1, LANE:LANE + (LANE if g.kind == "gated_delta" else g.decay_width)]
        n = LINEAR_ROW["norm"]
        self.norm = vec[n:n + 1, :g.value_dim]

    def round(self, x):
        return x.astype(self.dt).astype(jnp.float32)

    def conv(self, window_rows: list, x):
        """The causal convolution + SiLU of input row x [1, C] after `window_rows` (oldest first)."""
        seq = window_rows + [x]
        acc = seq[0] * self.taps[0]
        for j in range(1, self.g.taps):  # tap by tap, as the reference
            acc = acc + seq[j] * self.taps[j]
        return jax.nn.silu(self.round(acc))

    def token(self, window_rows: list, x, gates_b, second, live, load, store, out=None) -> list:
        """Apply one token: x [1, C] (model-dtype values), gates_b [1, 128] (b per value head),
        `second` (Gated DeltaNet: a [1, 128] per value head; KDA: f [1, Hv * Dk]), `live` a bool
        scalar. load(j) / store(j, S) move value head j's state; out(j, o) (optional) takes its
        output [1, Dv]. Returns the window rows after the token."""
        g = self.g
        conv = self.conv(window_rows, x)
        beta = jax.nn.sigmoid(gates_b)
        rate = jnp.exp(self.a_log)
        if g.kind == "gated_delta":
            decay = jnp.exp(-rate * jax.nn.softplus(second + self.dt_bias))  # [1, 128]: lane j = head j
        dk, dv, ks = g.key_dim, g.value_dim, g.key_size
        keys = []
        for h in range(g.key_heads):
            q = conv[:, h * dk:(h + 1) * dk]
            k = conv[:, ks + h * dk:ks + (h + 1) * dk]
            q = q * lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2_EPS) * (dk ** -0.5)
            k = k * lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2_EPS)
            keys.append((q, k, jnp.sum(q * k, axis=-1, keepdims=True)))
        rows = lax.broadcasted_iota(jnp.int32, (F32_SUBLANES, dk), 0)
        for j in range(g.value_heads):
            q, k, qk = keys[j // g.group]
            v = conv[:, 2 * ks + j * dv:2 * ks + (j + 1) * dv]
            s0 = load(j)
            if g.kind == "gated_delta":
                s1 = s0 * decay[:, j:j + 1]
                block = jnp.where(rows == 0, k, jnp.where(rows == 1, q, 0.0))
                cols = block.T  # [Dk, 8]: column 0 is k
            else:
                f = second[:, j * dk:(j + 1) * dk] + self.dt_bias[:, j * dk:(j + 1) * dk]
                d = jnp.exp(-rate[:, j:j + 1] * jax.nn.softplus(f))  # [1, Dk]: per key channel
                block = jnp.where(rows == 0, k, jnp.where(rows == 1, q, jnp.where(rows == 2, d, 0.0)))
                cols = block.T
                s1 = s0 * cols[:, 2:3]
            kq = jnp.dot(block, s1, preferred_element_type=jnp.float32, precision=_HIGHEST)  # rows k.S', q.S'
            delta = (v - kq[0:1]) * beta[:, j:j + 1]
            s2 = s1 + cols[:, 0:1] * delta
            if out is not None:
                out(j, kq[1:2] + qk * delta)
            store(j, jnp.where(live, s2, s0))
        moved = window_rows[1:] + [x]
        return [jnp.where(live, m, w) for m, w in zip(moved, window_rows)]


def linear_stage(g: LinearGeometry, layer, vec, sc: LinearScratch, pool: StatePool, positions, capacity: int) -> None:
    """One linear layer (see the module docstring). `layer`: the layer's place in the pool
    (traced); `vec`: its layer vector block [8, W]; `positions` the step's SMEM positions
    [B, q]; `capacity` the cache's tokens per sequence (a token at a position outside [0,
    capacity) is dead). Sequence 0's reads must have been started (`start_reads`). Leaves the
    gated outputs in `sc.o`."""
    lay = _Layer(g, vec)
    c, q, taps, bsz = g.conv_dim, g.q_len, g.taps, g.batch
    b_at, second_at, width = g.pending_offsets
    flag = width - LANE
    offs = g.proj_offsets
    second_w = LANE if g.kind == "gated_delta" else g.decay_width

    def wait(copies):
        for cp in copies:
            cp.wait()

    def sequence(b, carry):
        buf = lax.rem(b, 2)

        @pl.when(b + 1 < bsz)
        def _():
            @pl.when(jnp.logical_and(b >= 1, _writes(g, pool, jnp.maximum(b - 1, 0))))
            def _():
                wait(_entry_copies(g, pool, sc, layer, b - 1, 1 - buf, True))
            start_reads(g, pool, sc, layer, b + 1)

        wait(_entry_copies(g, pool, sc, layer, b, buf, False))
        state, window, pend_in = sc.state.at[buf], sc.window.at[buf], sc.pend_in.at[buf]
        count = pool.counts[jnp.clip(pool.slots[b], 0, pool.num_slots - 1)]

        def load_state(j):
            return state[j]

        def store_state(j, s):
            state[j] = s

        def replay(r, carry_):
            @pl.when(r < count)
            def _():
                row = pend_in[pl.ds(r, 1), :]
                live = row[:, flag:flag + 1] == 1.0
                rows = [window[t:t + 1, :] for t in range(taps - 1)]
                rows = lay.token(rows, row[:, :c], row[:, b_at:b_at + LANE], row[:, second_at:second_at + second_w],
                                 live, load_state, store_state)
                for t in range(taps - 1):
                    window[t:t + 1, :] = rows[t]
            return carry_

        lax.fori_loop(0, g.pending, replay, 0)

        # this step's tokens become the slot's pending rows; the replayed entry is written back
        out_rows = sc.pend_out.at[buf]
        rows_live = []
        for i in range(q):
            row = b * q + i
            p = positions[b, i]
            live = jnp.logical_and(p >= 0, p < capacity)
            rows_live.append(live)
            out_rows[i:i + 1, 0:c] = lay.round(_row(sc.proj, row, 0, c))
            if b_at > c:
                out_rows[i:i + 1, c:b_at] = jnp.zeros((1, b_at - c), jnp.float32)
            if g.kind == "gated_delta":  # b | a as lin_in laid them out
                out_rows[i:i + 1, b_at:flag] = _row(sc.proj, row, b_at, flag - b_at)
            else:  # b, then f from the forget gate's projection
                out_rows[i:i + 1, b_at:second_at] = _row(sc.proj, row, b_at, second_at - b_at)
                out_rows[i:i + 1, second_at:second_at + g.decay_width] = _row(sc.f, row, 0, g.decay_width)
                if flag > second_at + g.decay_width:
                    out_rows[i:i + 1, second_at + g.decay_width:flag] = \
                        jnp.zeros((1, flag - second_at - g.decay_width), jnp.float32)
            lane = lax.broadcasted_iota(jnp.int32, (1, LANE), 1)
            out_rows[i:i + 1, flag:width] = jnp.where(jnp.logical_and(lane == 0, live), 1.0, 0.0)

        @pl.when(_writes(g, pool, b))
        def _():
            for cp in _entry_copies(g, pool, sc, layer, b, buf, True):
                cp.start()

        # the step's tokens, on `work` (the buffer is being written back)
        rows = [window[t:t + 1, :] for t in range(taps - 1)]
        for i in range(q):
            row = b * q + i
            load = load_state if i == 0 else (lambda j: sc.work[j])

            def store(j, s, last=i == q - 1):
                if not last:  # the last token's state is not kept (it stays pending)
                    sc.work[j] = s

            def out(j, o, i=i):
                sc.o[b, i:i + 1, j * g.value_dim:(j + 1) * g.value_dim] = o

            x = lay.round(_row(sc.proj, row, 0, c))
            second = _row(sc.proj, row, offs["a"], LANE) if g.kind == "gated_delta" else \
                _row(sc.f, row, 0, g.decay_width)
            rows = lay.token(rows, x, _row(sc.proj, row, b_at, LANE), second, rows_live[i], load, store, out)
        return carry

    lax.fori_loop(0, bsz, sequence, 0)
    for b in range(max(bsz - 2, 0), bsz):  # the last writes the loop did not wait for
        @pl.when(_writes(g, pool, b))
        def _(b=b):
            wait(_entry_copies(g, pool, sc, layer, b, b % 2, True))
    _gated_norm(g, lay, sc)


def _gated_norm(g: LinearGeometry, lay: _Layer, sc: LinearScratch) -> None:
    """Each value head's output RMS-normed (weight lin_norm) and gated, in place in `sc.o`."""
    dv, n, q = g.value_dim, g.rows, g.q_len
    z = g.proj_offsets.get("z")
    for b in range(g.batch):  # by sequence (stored so), then every row at once
        sc.y[b * q:(b + 1) * q, :] = sc.o[b, 0:q, :]
    for j in range(g.value_heads):
        lo = j * dv
        o = sc.y[:, lo:lo + dv]
        y = o * lax.rsqrt(jnp.sum(o * o, axis=-1, keepdims=True) / dv + g.eps) * lay.norm
        gate = jax.nn.silu(sc.proj[0:n, z + lo:z + lo + dv]) if g.kind == "gated_delta" else \
            jax.nn.sigmoid(sc.g[:, lo:lo + dv])
        sc.y[:, lo:lo + dv] = y * gate
