"""tpumk's interconnect model: what moving bytes between the devices of one step costs.

Like tpumk.estimate.timeline, every figure here is tpumk's MODEL, built from named constants
with their sources below; none is a measurement, and every result says so in its `source`.

How a round is modelled
-----------------------
A collective is a sequence of dependent rounds. In one round every device pushes some bytes to
some peers at once (remote DMAs), then waits for what its peers push to it. A round costs

    latency + max(sibling bytes / sibling bandwidth,
                  cross-chip bytes / (min(cross-chip peers, links) * link bandwidth),
                  cross-chip bytes * hops / (links * link bandwidth))

for the slowest device of the round:
- **latency**: one remote DMA from issue to its completion signal, the wait for the peers'
  arrivals included (`LinkFigures.latency_s`). Paid once per round: the pushes of a round are
  in flight together.
- **sibling link** (TPU7x only): devices 2r and 2r+1 are the two TensorCores of chip r and copy
  to each other on chip, much faster than across chips; it runs alongside the cross-chip links.
- **injection**: a push to one peer leaves on one link (one route), so pushes reach `links`
  links in parallel only when they go to at least as many peers.
- **link load**: a push to a chip h hops away (Manhattan distance between chip coordinates, a
  mesh without wrap-around links: an assumption, the conservative one) occupies h links on its
  way. Every device runs the same pattern at once, so the network carries each device's
  bytes * hops on the `links` links it owns; with uniform traffic that is the bound.
The devices are those `tpumk.targets.mesh_devices(target, n)` gives: the first n of the
smallest topology that holds them, in its device order (their chip coordinates are read from
the topology, so a device's peers are at the hops the real slice puts them).
Not modelled: per-hop router latency (taken into the one latency), congestion beyond the
uniform link-load bound, the local sum of an all-reduce (a few vector adds per slot, small
next to a microsecond-scale round), and overlap of a collective with compute.

Per chip generation (`LinkFigures`, `LINKS`), per device (one JAX device = one TensorCore on
TPU7x, one chip on v5e / v6e, one megacore chip on v5p), per direction:

- TPU7x, from the published megakernel's on-chip measurements (TPU_FACTS 8):
  cross-chip: "three links in parallel 134 GB/s" per TensorCore -> 3 links of 134/3 = 44.7 GB/s
  (their figure for one link alone is ~45 GB/s: consistent). Google Cloud's TPU7x page gives
  1200 GB/s bidirectional ICI per chip, i.e. 300 GB/s per TensorCore per direction on paper;
  the measured 134 GB/s is 45 % of that, and the model uses the measurement.
  sibling: a copy to the sibling TensorCore measured 101 GB/s at 256 KiB and 610 GB/s at
  16 MiB. A copy of n bytes taking L + n / B through both points gives B = 663 GB/s and
  L = 2.20 us (`_two_point_fit`, computed below from the published figures).
  latency: that L, 2.20 us, a whole remote copy's fixed cost (issue to completion wait), is
  used for every remote DMA round, cross-chip included (an assumption: a cross-chip copy is
  taken to cost no more to start and sync than a sibling copy; a router hop is well under a
  microsecond).
- v6e (Google Cloud TPU v6e page: "Bidirectional inter-chip interconnect (ICI) bandwidth (per
  chip) 800 GBps", "ICI ports per chip 4", 2D torus): 800 / 2 directions / 4 ports = 100 GB/s
  per link per direction, 4 links.
- v5e (Google Cloud TPU v5e page: 400 GBps bidirectional per chip, 4 ICI ports, 2D torus):
  400 / 2 / 4 = 50 GB/s per link per direction, 4 links.
- v5p (Google Cloud TPU v5p page: 1200 GBps bidirectional per chip, 3D torus): a 3D torus
  gives each chip 6 neighbours (the page does not list ports; 6 is inferred from the torus),
  1200 / 2 / 6 = 100 GB/s per link per direction, 6 links. One JAX device is one chip (its two
  TensorCores run as one megacore device), so the whole chip's links are the device's.
- Latency of v5e / v6e / v5p: no public figure found; the model ASSUMES TPU7x's 2.20 us.
- Spec-sheet figures are peaks. On TPU7x the measured per-core figure is 45 % of the spec
  share, so the v5e / v6e / v5p figures (spec only) are likely optimistic by a similar factor.

The model check (tests/test_interconnect.py, `published_collective_check`): TPU_FACTS 8 says
the published TPU7x kernel (8 TensorCores, batch 1) spends "four collectives per layer about 14
of ~55 us", "each collective phase 3.5-4.7 us", its collectives being "reduce-scatter +
all-gather built from remote copies", and that it all-reduces the o-projection and the
down-projection partials. Read together: two all-reduces per layer, each a reduce-scatter
phase and an all-gather phase, four phases of ~3.5 us. The model sees only that pattern and
a payload (hidden 7168, Kimi K2's, the closest public config to the articles' unpublished
Kimi-class model; an [8, 7168] f32 tile, or one bare f32 row): 3.9 us per phase, 15.6 us per
layer, 1.12x the published figure for the tile, 0.69x for one row. None of the constants was
chosen with this figure in view (the latency comes from the sibling copies); the test asks
for 0.5-2x, for the reasons it gives. The same model puts tpumk's one-round "direct"
all-reduce of the padded 8-row tile at ~2.3x the published layer figure: it sends N-1 whole
slots per device, so at that size it is bandwidth-bound on the cross-chip links.

Public API: `link_figures(target)`, `device_coords(target, n)`, `round_seconds`,
`all_reduce_seconds(target, geom)` (tpumk's in-kernel all-reduce),
`all_reduce_floor` / `all_gather_floor` (the least any schedule of a payload can take),
`collective_op_seconds(target, kind, nbytes, devices)` (XLA's collectives as HLO shows them),
`published_collective_check(target)`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from tpumk.plan.geometry import DTYPE_BYTES, AllReduceGeometry
from tpumk.targets import TARGETS, Target, mesh_devices


def _two_point_fit(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(bandwidth B, fixed cost L) of a copy costing L + n / B, through two (bytes, achieved
    bytes/s) points."""
    (n1, r1), (n2, r2) = small, large
    t1, t2 = n1 / r1, n2 / r2
    bw = (n2 - n1) / (t2 - t1)
    return bw, t1 - n1 / bw


# ---- TPU7x: the published megakernel's measurements (TPU_FACTS 8)
TPU7X_SIBLING_COPY_POINTS = ((256 * 2**10, 101e9), (16 * 2**20, 610e9))  # (bytes, achieved B/s)
TPU7X_SIBLING_BPS, TPU7X_COPY_LATENCY_S = _two_point_fit(*TPU7X_SIBLING_COPY_POINTS)  # 663 GB/s, 2.20 us
TPU7X_LINKS = 3  # "three links in parallel"
TPU7X_LINK_BPS = 134e9 / TPU7X_LINKS  # 134 GB/s over the three, per TensorCore per direction

# ---- v6e / v5e / v5p: Google Cloud TPU documentation, bidirectional ICI GB/s per chip / 2 / ports
V6E_LINKS, V6E_LINK_BPS = 4, 800e9 / 2 / 4
V5E_LINKS, V5E_LINK_BPS = 4, 400e9 / 2 / 4
V5P_LINKS, V5P_LINK_BPS = 6, 1200e9 / 2 / 6
ASSUMED_LATENCY_S = TPU7X_COPY_LATENCY_S  # no public figure for v5e / v6e / v5p: TPU7x's, assumed


@dataclass(frozen=True)
class LinkFigures:
    """One device's interconnect, per direction (see the module doc for every source)."""

    chip: str
    link_bps: float  # one cross-chip link
    links: int  # cross-chip links one device drives in parallel
    sibling_bps: float | None  # on-chip copy to the chip's other TensorCore; None: one device per chip
    latency_s: float  # one remote-DMA round: issue, transfer start, completion wait
    basis: str  # where the figures come from, in a few words

    @property
    def cross_bps(self) -> float:
        return self.link_bps * self.links


LINKS: dict[str, LinkFigures] = {
    "7x": LinkFigures("7x", TPU7X_LINK_BPS, TPU7X_LINKS, TPU7X_SIBLING_BPS, TPU7X_COPY_LATENCY_S,
                      "published TPU7x kernel measurements"),
    "v6e": LinkFigures("v6e", V6E_LINK_BPS, V6E_LINKS, None, ASSUMED_LATENCY_S,
                       "Cloud TPU v6e spec sheet; latency assumed = TPU7x's"),
    "v5e": LinkFigures("v5e", V5E_LINK_BPS, V5E_LINKS, None, ASSUMED_LATENCY_S,
                       "Cloud TPU v5e spec sheet; latency assumed = TPU7x's"),
    "v5p": LinkFigures("v5p", V5P_LINK_BPS, V5P_LINKS, None, ASSUMED_LATENCY_S,
                       "Cloud TPU v5p spec sheet (6 links from its 3D torus); latency assumed = TPU7x's"),
}


def link_figures(target: Target) -> LinkFigures:
    return LINKS[target.chip]


def model_source(what: str, target: Target) -> str:
    f = link_figures(target)
    sib = f", sibling {f.sibling_bps / 1e9:.0f} GB/s" if f.sibling_bps else ""
    return (f"{what}: tpumk interconnect model ({f.chip}: {f.links} links x {f.link_bps / 1e9:.1f} GB/s per device "
            f"per direction{sib}, {f.latency_s * 1e6:.2f} us per remote-DMA round; {f.basis}; mesh hops without "
            f"wrap-around, local sums and overlap not modelled: stated assumptions, not a measurement)")


# ---------------------------------------------------------------------- topology
@functools.lru_cache(maxsize=None)
def _coords(chip: str, n: int) -> tuple[tuple[int, ...], ...]:
    # The cpu target emulates TPU7x (tpumk.targets): its links are TPU7x's, and so is its slice.
    target = next(t for t in TARGETS.values() if t.chip == chip and not t.interpret)
    return tuple(tuple(int(c) for c in d.coords) for d in mesh_devices(target, n))


def device_coords(target: Target, n: int) -> tuple[tuple[int, ...], ...]:
    """Chip coordinates of the n mesh devices, in mesh order (TPU7x siblings share theirs)."""
    if n < 1:
        raise ValueError(f"devices = {n}: expected a positive integer")
    return _coords(target.chip, n)


def hops(coords: tuple[tuple[int, ...], ...], a: int, b: int) -> int:
    """ICI hops from device a to device b: 0 for the same chip, else the Manhattan distance."""
    return sum(abs(x - y) for x, y in zip(coords[a], coords[b]))


# ---------------------------------------------------------------------- one round
def round_seconds(target: Target, coords: tuple[tuple[int, ...], ...],
                  sends: Mapping[int, Mapping[int, float]]) -> dict[str, float]:
    """One round in which device d pushes sends[d][peer] bytes to each of its peers, all at
    once. Returns the slowest device's seconds (latency + transfer) and its parts."""
    return _round(link_figures(target), coords, sends)


def _round(f: LinkFigures, coords, sends: Mapping[int, Mapping[int, float]]) -> dict[str, float]:
    worst = 0.0
    moved = False
    for src, out in sends.items():
        sib = cross = byte_hops = 0.0
        peers = 0
        for dst, nbytes in out.items():
            if nbytes <= 0 or dst == src:
                continue
            moved = True
            h = hops(coords, src, dst)
            if h == 0:  # the other TensorCore of the same chip (TPU7x)
                sib += nbytes
                continue
            cross += nbytes
            byte_hops += nbytes * h
            peers += 1
        t = sib / (f.sibling_bps or f.link_bps) if sib else 0.0
        if cross:
            t = max(t, cross / (min(peers, f.links) * f.link_bps), byte_hops / f.cross_bps)
        worst = max(worst, t)
    if not moved:
        return {"seconds": 0.0, "latency_seconds": 0.0, "transfer_seconds": 0.0}
    return {"seconds": f.latency_s + worst, "latency_seconds": f.latency_s, "transfer_seconds": worst}


def _rounds(f: LinkFigures, coords, rounds: list[dict[int, dict[int, float]]]) -> dict[str, float]:
    seen: dict[int, dict[str, float]] = {}  # a ring repeats one round object 2(N-1) times: cost it once
    for r in rounds:
        if id(r) not in seen:
            seen[id(r)] = _round(f, coords, r)
    parts = [seen[id(r)] for r in rounds]
    parts = [p for p in parts if p["seconds"] > 0]
    return {"seconds": sum(p["seconds"] for p in parts), "rounds": len(parts),
            "latency_seconds": sum(p["latency_seconds"] for p in parts),
            "transfer_seconds": sum(p["transfer_seconds"] for p in parts)}


# ---------------------------------------------------------------------- tpumk's in-kernel all-reduce
def all_reduce_seconds(target: Target, geom: AllReduceGeometry) -> dict:
    """tpumk's in-kernel all-reduce (see `_all_reduce`); a fresh dict each call."""
    return dict(_all_reduce(link_figures(target), target, geom))


# Cached (keyed on the link figures too, like `_collective`): the plan's auto searches walk the
# timeline model over hundreds of candidate plans with the same all-reduce, and one 32-device
# round visits every device pair.
@functools.lru_cache(maxsize=4096)
def _all_reduce(f: LinkFigures, target: Target, geom: AllReduceGeometry) -> dict:
    """tpumk's in-kernel all-reduce (`tpumk.kernel.collectives.all_reduce`) by this model.

    "direct": one round, every device pushes its [rows, width] slot to each of the N-1 peers.
    "doubling": log2 N rounds; in round s device i pushes its 2^s gathered slots to i XOR 2^s.
    "rsag": two rounds (reduce-scatter, all-gather), each a push of one [rows, chunk] chunk to
    each of the N-1 peers.
    "hierarchical": four rounds: N/2 chunks to the sibling, one chunk to each of the N/2 - 1
    same-parity cores of the other chips (twice), N/2 chunks to the sibling.
    Returns seconds, rounds, latency / transfer seconds, send_bytes (per device per call, as
    `geom.send_bytes`), messages (remote DMAs per device) and the model's source."""
    geom.validate()
    n, slot = geom.devices, float(geom.slot_bytes)
    out = {"devices": n, "schedule": geom.schedule, "slot_bytes": geom.slot_bytes, "send_bytes": geom.send_bytes,
           "messages": geom.messages, "source": model_source("in-kernel all-reduce", target)}
    if n == 1:
        return {**out, "seconds": 0.0, "rounds": 0, "latency_seconds": 0.0, "transfer_seconds": 0.0}
    coords = device_coords(target, n)
    if geom.schedule == "direct":
        rounds = [{i: {(i + off) % n: slot for off in geom.peer_offsets()} for i in range(n)}]
    elif geom.schedule == "rsag":
        chunk = float(geom.chunk_bytes)
        one = {i: {(i + off) % n: chunk for off in geom.peer_offsets()} for i in range(n)}
        rounds = [one, one]
    elif geom.schedule == "hierarchical":
        chunk, chips = float(geom.chunk_bytes), geom.chips
        sibling = {i: {i ^ 1: chips * chunk} for i in range(n)}
        cross = {i: {2 * ((i // 2 + k) % chips) + i % 2: chunk for k in range(1, chips)} for i in range(n)}
        rounds = [sibling, cross, cross, sibling]
    else:
        rounds = [{i: {i ^ off: off * slot} for i in range(n)} for off in geom.peer_offsets()]
    return {**out, **_rounds(f, coords, rounds)}


def all_reduce_seconds_on(chip: str, geom: AllReduceGeometry) -> dict:
    """`all_reduce_seconds` on the first deviceless target of `chip` (the plan's schedule choice
    knows the chip, not the target; every target of a chip has the same links and slices)."""
    return all_reduce_seconds(next(t for t in TARGETS.values() if t.chip == chip and not t.interpret), geom)


def all_gather_seconds(target: Target, geom: AllReduceGeometry, slice_bytes: float) -> dict:
    """tpumk's in-kernel all-gather (see `_all_gather`); a fresh dict each call."""
    return dict(_all_gather(link_figures(target), target, geom, float(slice_bytes)))


@functools.lru_cache(maxsize=4096)
def _all_gather(f: LinkFigures, target: Target, geom: AllReduceGeometry, slice_bytes: float) -> dict:
    """tpumk's in-kernel all-gather of one `slice_bytes` slice per device
    (`tpumk.kernel.collectives.all_gather_slices`, the logits): one round pushing the slice to
    every peer, or log2 N doubling rounds of 2^s slices (v5e)."""
    n = geom.devices
    out = {"devices": n, "schedule": "doubling" if geom.schedule == "doubling" else "direct",
           "send_bytes": (n - 1) * float(slice_bytes), "source": model_source("in-kernel all-gather", target)}
    if n == 1 or slice_bytes <= 0:
        return {**out, "seconds": 0.0, "rounds": 0, "latency_seconds": 0.0, "transfer_seconds": 0.0}
    coords = device_coords(target, n)
    if out["schedule"] == "direct":
        rounds = [{i: {(i + off) % n: float(slice_bytes) for off in geom.gather_offsets()} for i in range(n)}]
    else:
        rounds = [{i: {i ^ off: off * float(slice_bytes)} for i in range(n)} for off in geom.gather_offsets()]
    return {**out, **_rounds(f, coords, rounds)}


# ---------------------------------------------------------------------- what no schedule beats
def _floor(f: LinkFigures, one_round: dict) -> dict:
    """The least of one round carrying `one_round` and two bare round latencies."""
    one, two = one_round["seconds"], 2 * f.latency_s
    return {"seconds": min(one, two), "bound": "one round" if one <= two else "two rounds",
            "one_round_seconds": one, "two_round_latency_seconds": two}


def _no_floor(what: str, target: Target) -> dict:
    """One device (or nothing to send): no collective, nothing to wait for."""
    return {"seconds": 0.0, "bound": "none", "one_round_seconds": 0.0, "two_round_latency_seconds": 0.0,
            "source": model_source(what, target)}


def all_reduce_floor(target: Target, geom: AllReduceGeometry) -> dict:
    """The least seconds ANY all-reduce of geom's payload (N devices, [rows, width] at geom's
    wire dtype) can take by this model, whatever its schedule.

    A schedule either finishes in one round or takes at least two. In one round nothing can be
    summed before it is sent, so every device must receive every peer's whole partial: that
    round is the "direct" push, and the model costs it with the slice's real hops. Two or more
    dependent rounds cost at least two latencies, whatever they carry. The floor is the lesser
    of the two. (Routing limits such as v5e's power-of-two offsets only raise real costs, so
    the floor ignores them.) Returns seconds, which bound it is ("one round" / "two rounds"),
    both candidates and the source."""
    if geom.devices == 1:
        return _no_floor("all-reduce floor", target)
    direct = all_reduce_seconds(target, dataclasses.replace(geom, schedule="direct"))
    return {**_floor(link_figures(target), direct), "source": model_source("all-reduce floor", target)}


def all_gather_floor(target: Target, devices: int, slice_bytes: float) -> dict:
    """The least seconds any all-gather of one `slice_bytes` slice per device can take by this
    model: one round pushing the slice to every peer, or two bare round latencies."""
    return dict(_all_gather_floor(link_figures(target), target, devices, float(slice_bytes)))


@functools.lru_cache(maxsize=4096)
def _all_gather_floor(f: LinkFigures, target: Target, devices: int, slice_bytes: float) -> dict:
    if devices == 1 or slice_bytes <= 0:
        return _no_floor("all-gather floor", target)
    one = _rounds(f, device_coords(target, devices), _one_shot(devices, slice_bytes))
    return {**_floor(f, one), "source": model_source("all-gather floor", target)}


# ---------------------------------------------------------------------- XLA's collectives
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collective_kind(opcode: str) -> str | None:
    """The collective an HLO opcode names ("all-gather-start" -> "all-gather"), or None."""
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    base = base[:-len("-done")] if base.endswith("-done") else base
    return base if base in COLLECTIVE_KINDS else None


def _one_shot(n: int, chunk: float) -> list[dict[int, dict[int, float]]]:
    """One round: every device pushes `chunk` bytes to every peer."""
    return [{i: {j: chunk for j in range(n) if j != i} for i in range(n)}]


def _ring(n: int, chunk: float, steps: int) -> list[dict[int, dict[int, float]]]:
    """`steps` rounds of a bidirectional ring in mesh order: every device pushes half of
    `chunk` to its successor and half to its predecessor (two rings, two links busy)."""
    if n == 2:
        return [{i: {1 - i: chunk} for i in range(n)}] * steps
    return [{i: {(i + 1) % n: chunk / 2, (i - 1) % n: chunk / 2} for i in range(n)}] * steps


def collective_op_seconds(target: Target, kind: str, nbytes: float, devices: int,
                          peer_offset: int = 1, members: Sequence[int] | None = None) -> dict:
    """One XLA collective over `devices` devices, by this model. `kind` is an HLO collective
    opcode (`all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all`, `collective-permute`, or
    their `-start` / `-done` forms; the `-done` half costs nothing, its `-start` carries the
    cost). `nbytes` is the op's operand on one device (for all-gather the local shard, for
    reduce-scatter the whole buffer before scattering). `peer_offset`: a collective-permute's
    distance in group positions. `members`: the mesh positions of the group's devices (an HLO
    replica group, e.g. (0, 2) for a group along the major axis of a 2x2 mesh), default the
    first `devices` positions; it decides the hops between them.

    Algorithms: for each kind the cheapest of the standard ones, as a tuned collective
    library picks per message size (XLA's own choice on TPU is not public, and charging it
    more than a good algorithm needs would flatter the megakernel):
    - all-reduce (B = nbytes): one-shot (1 round, B to each peer: latency-bound sizes),
      two-shot (reduce-scatter then all-gather, 2 rounds of B/N to each peer), or a
      bidirectional ring (2(N-1) rounds of B/N split between both neighbours in mesh order:
      2(N-1)/N * B per device, the bandwidth optimum on neighbour links);
    - all-gather (B/N = nbytes) and reduce-scatter (B = nbytes): one-shot (B/N to each peer) or
      ring (N-1 rounds of B/N);
    - all-to-all: one round, B/N to each peer;
    - collective-permute: one round, B to one peer `peer_offset` positions on.
    Returns seconds, algorithm, rounds, send_bytes (per device) and the source."""
    name = collective_kind(kind)
    if name is None:
        raise ValueError(f"kind = {kind!r}: expected one of {', '.join(COLLECTIVE_KINDS)} (or a -start / -done form)")
    if not (isinstance(devices, int) and devices >= 1):
        raise ValueError(f"devices = {devices!r}: expected a positive integer")
    if nbytes < 0:
        raise ValueError(f"nbytes = {nbytes!r}: expected a non-negative byte count")
    if members is not None and (len(members) != devices or len(set(members)) != devices or min(members) < 0):
        raise ValueError(f"members = {tuple(members)!r}: expected {devices} distinct mesh positions")
    src = model_source(f"XLA {name}", target)
    n, b = devices, float(nbytes)
    if kind.endswith("-done") or n == 1 or b == 0:
        return {"seconds": 0.0, "algorithm": "none", "rounds": 0, "send_bytes": 0.0, "kind": name, "devices": n,
                "source": src}
    if members is None:
        coords = device_coords(target, n)
    else:
        mesh = device_coords(target, max(members) + 1)
        coords = tuple(mesh[m] for m in members)
    return {**_collective(link_figures(target), name, b, n, peer_offset, coords), "kind": name, "devices": n,
            "source": src}


@functools.lru_cache(maxsize=4096)
def _collective(f: LinkFigures, name: str, b: float, n: int, peer_offset: int, coords) -> dict:
    """The cheapest algorithm for one collective (cached: a program repeats a few shapes)."""
    if name == "all-reduce":
        options = {"one-shot": (_one_shot(n, b), (n - 1) * b),
                   "two-shot": (_one_shot(n, b / n) * 2, 2 * (n - 1) / n * b),
                   "ring": (_ring(n, b / n, 2 * (n - 1)), 2 * (n - 1) / n * b)}
    elif name in ("all-gather", "reduce-scatter"):
        chunk = b if name == "all-gather" else b / n
        options = {"one-shot": (_one_shot(n, chunk), (n - 1) * chunk), "ring": (_ring(n, chunk, n - 1), (n - 1) * chunk)}
    elif name == "all-to-all":
        options = {"one-shot": (_one_shot(n, b / n), (n - 1) / n * b)}
    else:
        off = peer_offset % n or 1
        options = {"direct": ([{i: {(i + off) % n: b} for i in range(n)}], b)}
    best: dict = {}
    for algo, (rounds, sent) in options.items():
        r = _rounds(f, coords, rounds)
        if not best or r["seconds"] < best["seconds"]:
            best = {**r, "algorithm": algo, "send_bytes": sent}
    return best


# ---------------------------------------------------------------------- the model check
PUBLISHED_LAYER_SECONDS = 14e-6  # four collective phases per layer, batch 1, 8 TensorCores (TPU_FACTS 8)
PUBLISHED_PHASE_SECONDS = (3.5e-6, 4.7e-6)


def published_collective_check(target: Target, rows: int = 8, width: int = 7168, dtype: str = "float32") -> dict:
    """The model's figures for the published TPU7x per-layer collective pattern (TPU_FACTS 8):
    8 TensorCores, two all-reduces per layer of a [rows, width] partial (hidden 7168, Kimi K2's;
    rows 8 f32 is one whole f32 VMEM tile of rows, what a batch-1 step holds once padded to the
    tile), each built as a reduce-scatter phase then an all-gather
    phase from remote copies (2 rounds of B/8 to each peer). Also tpumk's own "direct"
    all-reduce of the same slot, for comparison (one round, but N-1 whole slots per device)."""
    n = 8
    coords = device_coords(target, n)
    b = float(rows * width * DTYPE_BYTES[dtype])
    phase = round_seconds(target, coords, _one_shot(n, b / n)[0])["seconds"]
    layer = 4 * phase
    direct = all_reduce_seconds(target, AllReduceGeometry(n, rows, width, dtype, "direct"))
    return {"phase_seconds": phase, "layer_seconds": layer, "published_layer_seconds": PUBLISHED_LAYER_SECONDS,
            "published_phase_seconds": PUBLISHED_PHASE_SECONDS, "ratio": layer / PUBLISHED_LAYER_SECONDS,
            "tpumk_direct_layer_seconds": 2 * direct["seconds"],
            "tpumk_direct_ratio": 2 * direct["seconds"] / PUBLISHED_LAYER_SECONDS,
            "bytes_per_all_reduce": b, "source": model_source("published collective pattern", target)}


# Two schedule comparisons of the published TPU7x kernel, as issue 29 quotes them (measured on
# chips): a reduce-scatter + all-gather of [8, 8192] with a bfloat16 wire against a float32 one,
# and a chip-hierarchical all-reduce (the sibling TensorCore first) against the flat one at
# [64, 4096]. The quote names neither the device count nor the hierarchical pair's dtype: the
# check takes the kernel's TP8 configuration (TPU_FACTS 8) and float32.
PUBLISHED_WIRE_SECONDS = {"float32": 9.41e-6, "bfloat16": 7.28e-6}  # rsag [8, 8192]
PUBLISHED_HIERARCHY_SECONDS = {"rsag": 14.45e-6, "hierarchical": 13.51e-6}  # [64, 4096]


def published_schedule_check(target: Target, devices: int = 8) -> dict:
    """The model's figures for the two published schedule comparisons above, side by side with
    them: seconds per all-reduce and the ratio each change gives (bf16 / f32 wire; hierarchical
    / flat). The model's ratios are what a schedule choice rests on; its absolute figures show
    how far its constants are from those chips."""
    def modelled(rows: int, width: int, dtype: str, schedule: str) -> float:
        return all_reduce_seconds(target, AllReduceGeometry(devices, rows, width, dtype, schedule))["seconds"]

    wire = {d: modelled(8, 8192, d, "rsag") for d in PUBLISHED_WIRE_SECONDS}
    tiers = {s: modelled(64, 4096, "float32", s) for s in PUBLISHED_HIERARCHY_SECONDS}
    return {"devices": devices,
            "wire": {"model_seconds": wire, "published_seconds": PUBLISHED_WIRE_SECONDS,
                     "model_ratio": wire["bfloat16"] / wire["float32"],
                     "published_ratio": PUBLISHED_WIRE_SECONDS["bfloat16"] / PUBLISHED_WIRE_SECONDS["float32"]},
            "hierarchy": {"model_seconds": tiers, "published_seconds": PUBLISHED_HIERARCHY_SECONDS,
                          "model_ratio": tiers["hierarchical"] / tiers["rsag"],
                          "published_ratio": PUBLISHED_HIERARCHY_SECONDS["hierarchical"]
                          / PUBLISHED_HIERARCHY_SECONDS["rsag"]},
            "source": model_source("published schedule comparisons", target)}
