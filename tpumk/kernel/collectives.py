"""In-kernel collectives of a tensor-parallel megakernel, from remote DMAs: an all-reduce of
partial sums (`all_reduce`) and an all-gather of per-device slices (`all_gather_slices`, the
logits at the end of the kernel).

The megakernel of an N-device step (issue 13) is one grid-less `pallas_call` per device inside
`jax.shard_map` over a 1-D mesh axis (`AllReduceGeometry.axis`, "tp"). After the o-projection
and the down-projection of a tensor-parallel layer every device holds partial sums x
[rows, width] f32; `all_reduce` returns their sum over the N devices, the SAME BITS on every
device: each device sums the N contributions in the fixed order 0, 1, ..., N-1 (sequential f32
adds, never "mine first"), so rank-replicated work downstream (norms, routing) agrees exactly.

Schedules (`AllReduceGeometry.schedule`; direct and doubling are all-gathers of the partials
followed by the same ordered local sum, so they give identical bits and move identical bytes,
(N-1) slots):

- "direct": device i stores its partial in its slot i, then pushes that slot into slot i of
  every peer (offsets 1..N-1, started in the order i+1, i+2, ... so devices do not all hit
  device 0 first), then waits for N-1 arrivals. One round: all N-1 DMAs are in flight at once.
- "doubling" (recursive doubling, N a power of two): in round s = 0..log2 N - 1 device i
  pushes its aligned block of 2^s slots (the block holding slot i, everything gathered so far)
  to partner i XOR 2^s, into the same slot positions, and waits for the partner's block.
  Every offset is a power of two: TPU v5e routes remote DMAs only to power-of-two device
  offsets (TPU_FACTS 8), and a direct push for N = 4 needs offset 3. Rounds are dependent, so
  it costs log2 N link latencies instead of one; `AllReduceGeometry.for_chip` picks it only for
  v5e with N > 2.

- "rsag" (reduce-scatter, then all-gather; N > 2 on chips that route any offset): the width
  is cut into N chunks; device c receives chunk c of every partial (round 0), sums the N in
  order 0..N-1, and pushes its sum to every peer (round 1). Each element is still the same N
  numbers added in the same order, so the bits equal the other schedules'; each device sends
  2 (N-1) chunks, 2 (N-1) / N of a slot, instead of N-1 slots. Its buffers are per (parity,
  round), so the parity argument below holds round by round.
- "hierarchical" (TPU7x, whose chips are pairs of TensorCores 2r, 2r + 1): rsag in two
  levels, the sibling first (`_hierarchical`): the chip's two cores swap halves and add them
  (round 0, on chip), each core reduce-scatters its half's chip sums with the same-parity cores
  of the other chips (round 1) and all-gathers the totals (round 2), then the siblings swap
  halves (round 3). The same 2 (N-1) chunks leave each device, but half stay on chip. Each
  chunk is summed once, by its owner, chip pairs first then chips in order: the same bits on
  every device, NOT the same bits as the flat schedules (another association).

Wire dtype (`AllReduceGeometry.dtype`): float32, or bfloat16 for half the bytes. Every sum is
still float32 in the order 0..N-1; what is rounded is what travels: each partial (every
schedule), and with rsag each summed chunk before the all-gather, the device that summed it
keeping the rounded copy as well, so every device holds the same bits.

Buffers and semaphores (`AllReduceGeometry.scratch()`): slots [2, N, rows, width] (parity of the
collective counter, source device), recv_sems / send_sems [2, stages] DMA semaphores (a DMA
semaphore counts bytes, so one semaphore per (parity, round) takes the N-1 equal-sized arrivals
of a direct call, waited N-1 times with a slot-sized descriptor).

Why two parities suffice. Call c uses parity p = c mod 2. Device j reads its slots[p] (the sum,
and as the source of its own pushes, whose completion it waits) only during call c. A peer i
writes j's slots[p] again only in call c + 2, which it starts after finishing call c + 1; call
c + 1 is an all-gather, so i cannot finish it before j's partial of call c + 1 has reached i
(directly, or through XOR partners), and j pushes that only after it finished call c. So every
write into slots[p] of call c + 2 happens after every read of call c: no overwrite of a buffer a
slow peer still reads. The semaphores are per parity for the same reason: a fast peer's
arrival of call c + 1 lands on the other parity's semaphore and cannot be counted as an
arrival of call c that a slow peer has not sent yet; per round (doubling) because the round
s + 1 partner may deliver before the round s partner. Within a call the writes are disjoint:
device k writes only slot k (direct) or its partner's block (doubling), never the block the
receiver is sending from.

Barrier. Remote writes into a peer's VMEM are only safe once the peer is inside the kernel
(its scratch exists), so the kernel calls `all_reduce_barrier` once at its start, before the
first remote DMA: signal the barrier semaphore of every peer it will ever write to, wait for as
many signals. The pallas_call needs `COLLECTIVE_COMPILER_PARAMS` (`collective_id=0`,
`has_side_effects=True`; TPU_FACTS 8). Every DMA a call starts is also waited by that call, and
the barrier semaphore is waited back to 0, so all semaphores are 0 when the kernel ends.

Device ids are positions on the 1-D mesh axis (`lax.axis_index(geom.axis)`), addressed as MESH
ids `(peer,)`: the mesh must have that one axis (a 2-D mesh would need the full coordinate).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.kernel.memory import scratch_shape
from tpumk.plan.geometry import AllReduceGeometry

# pltpu.CompilerParams fields every pallas_call that uses these collectives needs.
COLLECTIVE_COMPILER_PARAMS = {"collective_id": 0, "has_side_effects": True}


class AllReduceScratch(NamedTuple):
    """The all-reduce's scratch refs, in `AllReduceGeometry.scratch()` order."""

    slots: Any  # VMEM [2, N, rows, width] geom.dtype: [parity, source device]; rsag [2, 2, N, rows, chunk]
    recv_sems: Any  # DMA semaphores [2, stages]
    send_sems: Any  # DMA semaphores [2, stages]
    staging: Any = None  # rsag only: VMEM [N, rows, chunk], this device's partial cut into chunks


def all_reduce_scratch(geom: AllReduceGeometry) -> list:
    """Scratch shapes to append to the kernel's `scratch_shapes`; pass the refs back in order."""
    geom.validate()
    return [scratch_shape(b) for b in geom.scratch()]


def _as_scratch(scratch: Sequence[Any]) -> AllReduceScratch:
    return scratch if isinstance(scratch, AllReduceScratch) else AllReduceScratch(*scratch)


def _peer(geom: AllReduceGeometry, my_id, offset: int):
    """The device a schedule's `offset` addresses from `my_id` (non-negative int32 math only)."""
    if geom.schedule == "doubling":
        return lax.bitwise_xor(my_id, jnp.int32(offset))
    return lax.rem(my_id + offset, geom.devices)


def _push_to_peers(geom: AllReduceGeometry, my_id, offsets, src_of, dst, send_sem, recv_sem) -> None:
    """One round of direct pushes: src_of(peer) into `dst` on every peer at `offsets` (all in
    flight at once), then wait as many arrivals into this device's `dst` (equal sizes, so
    they all count on `recv_sem`) and this device's own sends."""
    pushes = [(peer, src_of(peer), dst) for peer in (_peer(geom, my_id, off) for off in offsets)]
    _push_round(pushes, send_sem, recv_sem)


def _push_round(pushes, send_sem, recv_sem) -> None:
    """Start every (peer, source ref, destination ref) push, then wait as many arrivals of the
    same sizes into this device (every peer of the round sends what this device sends) and this
    device's own sends."""
    copies = []
    for peer, src, dst in pushes:
        c = pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem, device_id=(peer,),
                                         device_id_type=pl.DeviceIdType.MESH)
        c.start()
        copies.append(c)
    for c in copies:
        c.wait_recv()
    for c in copies:
        c.wait_send()


def _ordered_sum(slots, n: int):
    """slots[0] + slots[1] + ... + slots[n-1] in f32, left to right (the same bits everywhere)."""
    acc = slots[0].astype(jnp.float32)
    for k in range(1, n):
        acc = acc + slots[k].astype(jnp.float32)
    return acc


def all_reduce_barrier(geom: AllReduceGeometry) -> None:
    """Once per kernel, before the first `all_reduce`: wait until every peer this device will
    write to has entered the kernel (and signal the peers that write to it)."""
    offsets = geom.peer_offsets()
    if not offsets:
        return
    my_id = lax.axis_index(geom.axis)
    sem = pltpu.get_barrier_semaphore()
    for off in offsets:
        pl.semaphore_signal(sem, 1, device_id=(_peer(geom, my_id, off),),
                            device_id_type=pl.DeviceIdType.MESH)
    # direct: every peer signals once; doubling: XOR partnership is symmetric (log2 N partners)
    pl.semaphore_wait(sem, len(offsets))


def all_reduce(geom: AllReduceGeometry, x, scratch: Sequence[Any], counter):
    """Sum of every device's x [rows, geom.padded_width] (f32 result), in device order 0..N-1,
    identical bits on every device. `counter` (Python int or traced int32 >= 0) numbers the collectives of the
    kernel: consecutive calls must use consecutive counters (its parity picks the buffers)."""
    n = geom.devices
    if n == 1:
        return x.astype(jnp.float32)
    scr = _as_scratch(scratch)
    my_id = lax.axis_index(geom.axis)
    p = lax.rem(jnp.asarray(counter, jnp.int32), 2)
    if geom.schedule == "rsag":
        return _reduce_scatter_all_gather(geom, x, scr, my_id, p)
    if geom.schedule == "hierarchical":
        return _hierarchical(geom, x, scr, my_id, p)
    scr.slots[p, my_id] = x.astype(scr.slots.dtype)

    if geom.schedule == "direct":
        mine = scr.slots.at[p, my_id]
        _push_to_peers(geom, my_id, geom.peer_offsets(), lambda _: mine, mine, scr.send_sems.at[p, 0],
                       scr.recv_sems.at[p, 0])
    else:
        for s, off in enumerate(geom.peer_offsets()):
            base = lax.bitwise_and(my_id, jnp.int32(~(off - 1)))  # my aligned block of `off` slots
            block = scr.slots.at[p, pl.ds(base, off)]
            # the partner's block of the same size arrives into its own positions
            _push_to_peers(geom, my_id, (off,), lambda _: block, block, scr.send_sems.at[p, s],
                           scr.recv_sems.at[p, s])
    return _ordered_sum([scr.slots[p, k] for k in range(n)], n)


def _reduce_scatter_all_gather(geom: AllReduceGeometry, x, scr: AllReduceScratch, my_id, p):
    """The "rsag" schedule. Round 0: device i pushes chunk c of its partial into slot
    [p, 0, i] of device c (its own chunk i stays home), then sums the N chunks i it received in
    order 0..N-1. Round 1: it pushes that sum into slot [p, 1, i] of every peer; the result is
    the N summed chunks side by side. x [rows, padded_width]; returns the same shape, f32."""
    n, cw = geom.devices, geom.chunk
    for c in range(n):
        scr.staging[c] = x[:, c * cw:(c + 1) * cw].astype(scr.staging.dtype)
    scr.slots[p, 0, my_id] = scr.staging[my_id]

    def push_round(rnd: int, src_of) -> None:
        _push_to_peers(geom, my_id, geom.peer_offsets(), src_of, scr.slots.at[p, rnd, my_id],
                       scr.send_sems.at[p, rnd], scr.recv_sems.at[p, rnd])

    push_round(0, lambda peer: scr.staging.at[peer])
    acc = _ordered_sum([scr.slots[p, 0, k] for k in range(n)], n)
    scr.slots[p, 1, my_id] = acc.astype(scr.slots.dtype)
    push_round(1, lambda peer: scr.slots.at[p, 1, my_id])
    return jnp.concatenate([scr.slots[p, 1, k].astype(jnp.float32) for k in range(n)], axis=1)


def _hierarchical(geom: AllReduceGeometry, x, scr: AllReduceScratch, my_id, p):
    """The "hierarchical" schedule (TPU7x: devices 2r and 2r + 1 are chip r's TensorCores).
    Device d = 2r + b owns chunk d; chunks 2m + b (m = 0..C-1, C = N/2 chips) are its half, kept
    at staging[b * C + m]. Round 0: push the sibling's half to the sibling (one on-chip DMA) and
    add the sibling's copy of this half: C chip sums. Round 1: chip sum m to device 2m + b
    (slot [p, 1, r] there); add the C chip sums of chunk d in chip order 0..C-1. Round 2: that
    total to the other same-parity cores (slot [p, 2, r]). Round 3: the C totals of this half to
    the sibling (slots [p, 3]). x [rows, padded_width]; returns the same shape, f32."""
    n, c, cw = geom.devices, geom.chips, geom.chunk
    b, r = lax.rem(my_id, 2), lax.div(my_id, 2)
    sibling = lax.bitwise_xor(my_id, 1)
    for k in range(n):  # chunk k = 2 m + h at h * C + m: each half one contiguous block
        scr.staging[(k % 2) * c + k // 2] = x[:, k * cw:(k + 1) * cw].astype(scr.staging.dtype)

    # round 0: the sibling's half goes to it; its copy of mine arrives in slots [p, 0]
    _push_round([(sibling, scr.staging.at[pl.ds((1 - b) * c, c)], scr.slots.at[p, 0])],
                scr.send_sems.at[p, 0], scr.recv_sems.at[p, 0])
    for m in range(c):  # chip sums (x[2m'] + x[2m'+1]: addition commutes, both cores get these bits)
        mine = scr.staging[b * c + m].astype(jnp.float32)
        scr.slots[p, 0, m] = (mine + scr.slots[p, 0, m].astype(jnp.float32)).astype(scr.slots.dtype)

    def same_parity_core(k: int):  # the core of parity b on chip r + k (mod C), and that chip
        chip = lax.rem(r + k, c)
        return 2 * chip + b, chip

    # round 1: chip sum m to chip m's core of this parity; its chip sums of my chunk arrive
    scr.slots[p, 1, r] = scr.slots[p, 0, r]
    pushes = []
    for k in range(1, c):
        peer, chip = same_parity_core(k)
        pushes.append((peer, scr.slots.at[p, 0, chip], scr.slots.at[p, 1, r]))
    _push_round(pushes, scr.send_sems.at[p, 1], scr.recv_sems.at[p, 1])
    total = _ordered_sum([scr.slots[p, 1, m] for m in range(c)], c)
    scr.slots[p, 2, r] = total.astype(scr.slots.dtype)

    # round 2: my chunk's total to the other cores of this parity
    pushes = [(same_parity_core(k)[0], scr.slots.at[p, 2, r], scr.slots.at[p, 2, r]) for k in range(1, c)]
    _push_round(pushes, scr.send_sems.at[p, 2], scr.recv_sems.at[p, 2])
    # round 3: this half's totals to the sibling; its half arrives in slots [p, 3]
    _push_round([(sibling, scr.slots.at[p, 2], scr.slots.at[p, 3])], scr.send_sems.at[p, 3], scr.recv_sems.at[p, 3])
    # chunk 2 m + h: this half's (round 2) when h == b, else the sibling's (round 3)
    return jnp.concatenate([scr.slots[p, 2 + lax.bitwise_xor(b, k % 2), k // 2].astype(jnp.float32)
                            for k in range(n)], axis=1)


def all_gather_slices(geom: AllReduceGeometry, out_ref, per_device: int, send_sems, recv_sems) -> None:
    """out_ref [N * per_device, ...] (HBM or VMEM) holds this device's slice at rows
    [my_id * per_device, (my_id + 1) * per_device); on return every device holds every slice
    (the same bits: copies). Direct: one push of the slice to every peer, at the same offset;
    doubling (v5e): log2 N rounds, round s pushing the aligned block of 2^s slices gathered
    so far to the XOR partner. Each device writes only slices other than the receiver's own and
    waits every arrival before returning, so a peer's output is complete when its kernel ends.
    Needs the barrier (`all_reduce_barrier`) earlier in the kernel: peers write this output."""
    n = geom.devices
    if n == 1:
        return
    my_id = lax.axis_index(geom.axis)

    def part(first, count: int):
        return out_ref.at[pl.ds(first * per_device, count * per_device)]

    if geom.schedule != "doubling":
        mine = part(my_id, 1)
        _push_to_peers(geom, my_id, geom.gather_offsets(), lambda _: mine, mine, send_sems.at[0], recv_sems.at[0])
        return
    for s, off in enumerate(geom.gather_offsets()):
        block = part(lax.bitwise_and(my_id, jnp.int32(~(off - 1))), off)
        _push_to_peers(geom, my_id, (off,), lambda _: block, block, send_sems.at[s], recv_sems.at[s])
