"""tpumk's timeline model: one model of a decode step for the megakernel and for an XLA program.

Everything here is tpumk's own model, computed from the chip figures of `tpumk.targets.Target`
(HBM bandwidth, bf16 peak, MXU width) and three named constants. It is NOT a measurement and
NOT the TPU compiler's estimate; every figure it produces says so in its `source`.

How a step is modelled
----------------------
- **DMA engine.** A stream of DMAs that keeps W bytes in flight reaches
      bw(W) = BW * W / (W + BW * DMA_LATENCY_S)
  of the chip's HBM bandwidth BW. This is Little's law (throughput = bytes in flight /
  latency) with the latency growing with the load as in a single queue, L(U) = L0 / (1 - U):
  few bytes in flight leave the engine waiting on latency, many saturate it; half the
  peak is reached at W = BW * L0, the bandwidth-delay product. TPU_FACTS section 3 shows the
  same shape in the compiler's own DMA model (throughput grows with ring depth x tile bytes,
  then flattens). The engine also starts at most one descriptor per `descriptor_s`, so a
  stream of small DMAs (16-token KV-cache pages, narrow tiles) is bound by its descriptor
  count rather than its bytes: load = max(bytes / bw(W), descriptors * descriptor_s).
- **DMA queues** (benchmarks/dma_probe.py, BENCHMARKS.md "What the compiler charges a DMA"):
  in the TPU compiler's static model one DMA of s bytes completes L + s / q after its issue (q,
  `queue_bytes_per_s`: one queue's rate, a few hundred GB/s, far below the chip's bandwidth),
  DMAs waited on different semaphores overlap completely, and DMAs signalling ONE semaphore
  cost as one DMA of their summed bytes. So a stream whose items are `groups` such queues,
  with `groups_in_flight` queues outstanding, costs at least groups * (L + s / q) /
  groups_in_flight per item: a ring of a few big tiles, or a KV tile of many pages on one
  semaphore, is bound by its queues, not by its bytes in flight. Applied where tpumk knows
  the DMA structure: the megakernel's ring (a queue per tile) and KV tiles (a semaphore per
  page DMA), and jax's ragged paged attention in the bench's serving column
  (tpumk.decode.serving); not to XLA's generated kernels, whose DMA structure the HLO does
  not show.
- **MXU.** A matmul whose stationary operand (the weight tile, the K or V tile) has E elements
  takes at least 2 * E * mxu_cols / peak: the operand must be pushed through a systolic array
  `mxu_cols` wide whatever the number of rows streamed past it, so decode-sized matmuls run at
  rows / mxu_cols of peak. float32 operands at Precision.HIGHEST cost F32_MXU_PASSES bf16
  passes. Elementwise work (norms, RoPE, softmax, SwiGLU) is not modelled: at decode it is
  small next to the weight stream.
- **Overlap.** A pipelined stream of n items costs n * max(load, compute) per item (a tile
  whose compute exceeds its load stalls the stream by the difference); a stream that starts
  cold pays one DMA_LATENCY_S before its first item arrives.
- **Kernel boundaries.** Every kernel an XLA program launches pays OP_DISPATCH_S, plus one
  DMA_LATENCY_S to fill its input pipeline when it reads HBM and one to drain its last output
  block when it writes HBM: nothing streams across an op boundary. The megakernel pays this
  once for the whole step, then streams across layers.

The three constants (not fitted to any measurement; the model check below is therefore a
real check). Their values are stated assumptions, with the reasoning:
- DMA_LATENCY_S = 1.0 us: unloaded time from issuing an HBM->VMEM DMA to its completion
  signal, beyond the transfer itself. HBM access latency on current accelerators is about
  0.5 us; descriptor processing, the on-chip network and the semaphore signal are taken to
  double it.
- Per-DMA figures (`DMA_ENGINE`, per target), from the compiler's static model of probe
  kernels that differ only in DMA count, size and depth (benchmarks/dma_probe.py; cycles
  converted by tpumk.estimate.calibration, so v6e's figures carry its ASSUMED calibration):
  TPU7x: descriptor_s 14 ns (17 cycles per 32 KiB DMA with 256 outstanding, 16 per loop
  step), queue rate 405 GB/s (a single DMA's latency grows by 3,140 cycles per MiB);
  v6e: 56 ns (27 cycles, an upper bound: 64 outstanding), 355 GB/s (1,430 cycles per MiB).
  Targets with no static profile (v5e, v5p) keep the earlier stated assumption DMA_DESCRIPTOR_S = 50 ns and no queue limit.
  The compiler's own unloaded latency (2,820 cycles: 2.3 us on TPU7x, 1.2 us on v6e) is NOT
  adopted for DMA_LATENCY_S: it would also double every XLA op's fill and drain, for which
  the probe says nothing; BENCHMARKS.md has the sensitivity to it.
- OP_DISPATCH_S = 0.25 us: the TensorCore's scalar unit sequencing one kernel of a program
  (program setup, synchronisation flags), beyond its pipeline fill and drain.

The model check (tests/test_costmodel.py): the published TPU7x megakernel's dense ring (12
banks of 2 MiB, bf16, 76 MiB of weights per layer) was measured on chip at 26.4 us per layer
(TPU_FACTS section 6). `ring_layer_seconds` predicts it from those shapes and the chip
figures alone: 24.7 us (0.94x). The test requires 20 %, and that the check holds for DMA
latencies of 0.5-2 us and descriptor costs of 0-200 ns (it is not a knife-edge); the queue
limit does not bind there (12 queues of 2 MiB).

What the model cannot know: the chip's real DMA latency and descriptor rate, HBM efficiency
(refresh, bank conflicts), vector-unit work, and how XLA's generated kernels really pipeline.
Its figures rank configurations and programs on one footing; they are not measurements.

Public API: `megakernel_step(plan) -> StepModel` (the tuner's `model` objective),
`xla_step(target, hlo_text, kernel=None) -> StepModel` (any compiled program, from its HLO),
`ring_layer_seconds`, `achieved_bandwidth`, `stream_seconds`, `mxu_seconds`. The HLO text is
read by tpumk.estimate.hlo; this module only costs what it reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from tpumk.estimate.hlo import (DTYPE_BYTES, HloInstr, called_computation, called_computations, contracting_length,
                                parse_hlo, replica_group, source_target_pairs, trip_count)
from tpumk.estimate.interconnect import (all_gather_floor, all_gather_seconds, all_reduce_floor, all_reduce_seconds,
                                         collective_kind, collective_op_seconds)
from tpumk.estimate.interconnect import model_source as interconnect_source
from tpumk.plan.contract import MLA_FAMILIES, latent_slice_bytes, logits_slice_bytes
from tpumk.plan.geometry import DTYPE_BYTES as WIRE_BYTES
from tpumk.plan.geometry import F32_SUBLANES
from tpumk.plan.knobs import ALL_REDUCE_WIRES
from tpumk.targets import Target

DMA_LATENCY_S = 1.0e-6
DMA_DESCRIPTOR_S = 50e-9  # targets with no probe figures (DMA_ENGINE)
OP_DISPATCH_S = 0.25e-6
F32_MXU_PASSES = 6  # Precision.HIGHEST: float32 products as six bf16 MXU passes (XLA's bf16_6x)



@dataclass(frozen=True)
class DmaEngine:
    """Per-DMA figures of a target's DMA engine (see the module doc)."""

    descriptor_s: float  # serial issue cost of one DMA
    queue_bytes_per_s: float | None  # rate of one DMA queue; None: no queue limit


# From the compiler's static model of benchmarks/dma_probe.py's kernels (BENCHMARKS.md).
DMA_ENGINE = {"tpu7x": DmaEngine(14e-9, 405e9), "v6e": DmaEngine(56e-9, 355e9)}


def dma_engine(target: Target) -> DmaEngine:
    return DMA_ENGINE.get(target.name, DmaEngine(DMA_DESCRIPTOR_S, None))


SOURCE = ("tpumk timeline model (chip figures from Pallas' table; DMA latency {lat:.2g} us (assumed), {desc:.0f} ns "
          "per descriptor{queue}, {disp:.2g} us per kernel dispatch (assumed): not measurements)")


def model_source(what: str, target: Target | None = None) -> str:
    eng = dma_engine(target) if target is not None else DmaEngine(DMA_DESCRIPTOR_S, None)
    queue = (f", {eng.queue_bytes_per_s / 1e9:.0f} GB/s per DMA queue of the Pallas kernels (both from the "
             "compiler's DMA model)" if eng.queue_bytes_per_s else "")
    return f"{what}: " + SOURCE.format(lat=DMA_LATENCY_S * 1e6, desc=eng.descriptor_s * 1e9, queue=queue,
                                       disp=OP_DISPATCH_S * 1e6)


# ---------------------------------------------------------------------- primitives
def achieved_bandwidth(target: Target, in_flight_bytes: float) -> float:
    """Bytes/s a DMA stream reaches with `in_flight_bytes` outstanding (see the module doc)."""
    bw = target.hbm_bandwidth
    w = max(float(in_flight_bytes), 1.0)
    return bw * w / (w + bw * DMA_LATENCY_S)


def load_seconds(target: Target, nbytes: float, in_flight_bytes: float, descriptors: float = 1.0,
                 groups: float = 0.0, groups_in_flight: float = 0.0) -> float:
    """Engine time to move `nbytes` in `descriptors` DMAs with `in_flight_bytes` outstanding:
    the slowest of the byte stream, the descriptor rate (setup of one descriptor overlaps the
    transfer of others, so it only binds when DMAs are small) and, when the caller knows its
    DMA queues (`groups` queues of nbytes / groups each, `groups_in_flight` outstanding) and
    the target has a queue rate, the queues' latency-bound rate (module doc)."""
    if nbytes <= 0 and descriptors <= 0:
        return 0.0
    eng = dma_engine(target)
    seconds = max(nbytes / achieved_bandwidth(target, in_flight_bytes), descriptors * eng.descriptor_s)
    if groups > 0 and groups_in_flight > 0 and eng.queue_bytes_per_s:
        per_queue = DMA_LATENCY_S + nbytes / groups / eng.queue_bytes_per_s
        seconds = max(seconds, groups * per_queue / groups_in_flight)
    return seconds


def mxu_seconds(target: Target, stationary_elements: float, flops: float = 0.0, passes: int = 1) -> float:
    """MXU time of a matmul whose stationary operand has `stationary_elements` elements and
    whose true work is `flops`: max(flops, 2 * E * mxu_cols) * passes / bf16 peak."""
    mxu_cols = target.mxu_shape[1]
    return max(float(flops), 2.0 * stationary_elements * mxu_cols) * passes / target.bf16_flops


def stream_seconds(target: Target, count: float, bytes_each: float, in_flight_bytes: float,
                   compute_each: float = 0.0, descriptors_each: float = 1.0) -> float:
    """A steady pipelined stream of `count` items: each costs max(its load, its compute)."""
    if count <= 0:
        return 0.0
    return count * max(load_seconds(target, bytes_each, in_flight_bytes, descriptors_each), compute_each)


def ring_layer_seconds(target: Target, tile_bytes: float, depth: int, layer_bytes: float,
                       compute_per_tile: float = 0.0) -> float:
    """Steady-state seconds per layer of a weight ring: `depth` tiles of `tile_bytes` in flight,
    `layer_bytes` of weights per layer, `compute_per_tile` of MXU work per tile (0: DMA only).
    The ring streams across layer boundaries, so no fill is paid per layer."""
    return stream_seconds(target, layer_bytes / tile_bytes, tile_bytes, depth * tile_bytes, compute_per_tile)


def published_ring_check(target: Target) -> dict[str, float]:
    """The model's figure for the published TPU7x dense ring (TPU_FACTS 6) from its shapes:
    12 banks of 2 MiB bf16, 76 MiB per layer, batch 1 (each bank's MXU work included)."""
    tile = 2 * 2**20
    compute = mxu_seconds(target, tile / 2, flops=2 * 1 * tile / 2)  # bf16 tile, one token row
    seconds = ring_layer_seconds(target, tile, 12, 76 * 2**20, compute)
    return {"predicted_seconds": seconds, "measured_seconds": 26.4e-6, "ratio": seconds / 26.4e-6}


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class StepModel:
    seconds: float  # modelled step time
    dma_seconds: float  # DMA engine busy time (bytes at the achieved bandwidth + descriptors)
    compute_seconds: float  # MXU time
    hbm_bytes: float  # HBM bytes the model moved
    source: str  # what produced the figure (always "tpumk timeline model ...")
    stages: dict[str, dict[str, float]] = field(default_factory=dict)  # per stage: seconds, hbm_bytes, ...
    kernels: int = 1  # kernels the step launches (megakernel: 1)
    floor_seconds: float = 0.0  # the HBM floor the model is compared with
    notes: tuple[str, ...] = ()
    collectives_floor_seconds: float = 0.0  # many devices: the least any schedule's collectives take (model)

    @property
    def floor_fraction(self) -> float:
        return self.floor_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "dma_seconds": self.dma_seconds, "compute_seconds": self.compute_seconds,
                "hbm_bytes": self.hbm_bytes, "floor_seconds": self.floor_seconds,
                "floor_fraction": self.floor_fraction, "kernels": self.kernels, "source": self.source,
                "collectives_floor_seconds": self.collectives_floor_seconds,
                "stages": {k: dict(v) for k, v in self.stages.items()}, "notes": list(self.notes)}


class _Ledger:
    """Accumulates stage times, bytes, DMA and MXU seconds while the schedule is walked."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, float]] = {}
        self.dma = 0.0
        self.mxu = 0.0

    def add(self, stage: str, seconds: float, hbm_bytes: float = 0.0, dma: float = 0.0, mxu: float = 0.0,
            times: float = 1.0) -> None:
        s = self.stages.setdefault(stage, {"seconds": 0.0, "hbm_bytes": 0.0, "dma_seconds": 0.0, "mxu_seconds": 0.0})
        s["seconds"] += seconds * times
        s["hbm_bytes"] += hbm_bytes * times
        s["dma_seconds"] += dma * times
        s["mxu_seconds"] += mxu * times
        self.dma += dma * times
        self.mxu += mxu * times

    @property
    def seconds(self) -> float:
        return sum(s["seconds"] for s in self.stages.values())

    @property
    def hbm_bytes(self) -> float:
        return sum(s["hbm_bytes"] for s in self.stages.values())


# ---------------------------------------------------------------------- the megakernel
def _passes(dtype: str) -> int:
    return F32_MXU_PASSES if dtype == "float32" else 1


class _Ring:
    """The weight ring as the kernel walks it: `depth` tiles in flight in one global order.
    `ahead` is bytes already loaded by the ring while non-ring stages ran (the ring keeps
    `depth` loads outstanding across them), so the next tiles cost only their compute."""

    def __init__(self, plan, ledger: _Ledger) -> None:
        self.plan, self.t, self.ledger = plan, plan.target, ledger
        self.ahead = 0.0

    def family(self, name: str, stage: str, times: float = 1.0, extra_bytes_per_block: float = 0.0) -> None:
        plan = self.plan
        f = plan.families[name]
        # a group-scaled tile's scale tile streams beside it (its own DMA and semaphore)
        tb = float(f.tile_bytes + f.scale_tile_bytes)
        per_tile = 2.0 if f.group else 1.0
        w = plan.ring_depth * tb
        compute = mxu_seconds(self.t, f.tile_rows * f.tile_cols, 2.0 * plan.rows * f.tile_rows * f.tile_cols,
                              _passes(plan.cfg.dtype))
        n = f.tiles
        # extra bytes (lm_head logits blocks written back) ride the same engine, per tile
        extra = extra_bytes_per_block * f.col_blocks / n
        load = load_seconds(self.t, tb + extra, w, per_tile + (1.0 if extra else 0.0), per_tile,
                            per_tile * plan.ring_depth)
        ready = min(float(n), self.ahead / tb)  # tiles the ring loaded during earlier stages
        self.ahead = max(0.0, self.ahead - ready * tb)
        seconds = ready * compute + (n - ready) * max(load, compute)
        dma = (n - ready) * load
        self.ledger.add(stage, seconds, n * (tb + extra), dma, n * compute, times)

    def prefetch_during(self, seconds: float, other_bytes: float, depth_bytes: float) -> None:
        """The ring keeps loading while a non-ring stage of `seconds` moves `other_bytes`: it gets
        the bandwidth that stage leaves, up to the `depth` tiles it has outstanding."""
        spare = max(0.0, seconds * self.t.hbm_bandwidth - other_bytes)
        self.ahead = min(depth_bytes, self.ahead + spare)


def _attention_stage(plan, ledger: _Ledger, extra_bytes: float, times: float,
                     windows: Sequence[int] = (0,), started: bool = False,
                     ring_bytes_in_flight: float = 0.0, patches_early: bool = False) -> tuple[float, float]:
    """One layer's attention (patch reads, KV tiles, write-backs) at the plan's full context.
    `extra_bytes` (layer vectors, the MoE router) load meanwhile. `windows`: the sliding
    windows (0: full) of the `times` layers this stands for, each an equal share; a sliding
    layer streams only its window's tiles. `started`: the previous layer's stage started this
    layer's first kv_buffers - 1 tiles when its tile loop ended (`attention_stage`'s
    prefetch_next): they loaded during its tail, beside the ring's `ring_bytes_in_flight`, so
    the tile loop starts without the pipeline fill. `patches_early`: the reads of the pages the
    step writes started before the q|k|v tiles (`attention_prefetch`): their round trip hides
    there, their bytes load beside the ring. Returns the mean (seconds, bytes) of one layer."""
    t, a = plan.target, plan.attention
    pb = float(a.page_bytes)
    nc = a.caches  # K and V; MLA: the one latent cache
    lengths = [plan.context - plan.q_len] * plan.batch
    positions = [[n + i for i in range(plan.q_len)] for n in lengths]
    total_s = total_b = 0.0
    for window in windows:
        share = times / len(windows)
        c = a.dma_counts(positions, lengths, window)
        patched = c["patched_pages"]
        # 1. the pages this step writes are read first (K and V), a round trip before the tiles
        patch_read = load_seconds(t, nc * patched * pb, ring_bytes_in_flight + nc * patched * pb, nc * patched) \
            if patches_early else DMA_LATENCY_S + load_seconds(t, nc * patched * pb, nc * patched * pb, nc * patched)
        # 2. KV tiles through kv_buffers slots, nc * kv_tile_pages page DMAs per tile
        n_tiles = c["tiles"]
        tile_hbm = nc * c["hbm_tile_pages"] * pb / n_tiles
        slots = a.kv_buffers * nc * a.kv_tile_pages * pb  # all slots load while the loop waits
        # one matmul per kv head block (two 64-wide heads share one: AttentionGeometry)
        per_block = mxu_seconds(t, a.tile_rows * a.block_lanes, 2.0 * a.block_rows * a.tile_rows * a.block_lanes,
                                _passes(a.dtype))
        compute = 2 * a.head_blocks * per_block  # q.k^T and p.v per block
        descriptors = nc * a.kv_tile_pages
        # GQA: every page DMA (K and V) signals its own semaphore (a queue each); the MLA stage's
        # pages of a tile share one. kv_buffers tiles are outstanding when a tile is waited for
        # (the refill is issued before the wait)
        queues = descriptors if nc == 2 else 1
        load = load_seconds(t, tile_hbm, slots, descriptors, queues, queues * a.kv_buffers)
        ahead = min(a.kv_buffers - 1, n_tiles) if started else 0
        # prefetched tiles: their bytes took their share of the previous tail's engine time
        early = load_seconds(t, ahead * tile_hbm, ring_bytes_in_flight + ahead * tile_hbm, ahead * descriptors) \
            if ahead else 0.0
        kv = (0.0 if ahead else DMA_LATENCY_S) + (n_tiles - ahead) * max(load, compute) + ahead * compute + early
        # 3. write-backs (K, V per patched page) and the extra loads share the engine meanwhile
        side = nc * patched * pb + extra_bytes
        side_dma = load_seconds(t, side, slots + side, nc * patched + 1)
        seconds = patch_read + max(kv, (n_tiles - ahead) * load + early + side_dma)
        nbytes = nc * patched * pb + n_tiles * tile_hbm + side
        dma = patch_read - (0.0 if patches_early else DMA_LATENCY_S) + (n_tiles - ahead) * load + early + side_dma
        ledger.add("attention", seconds, nbytes, dma, n_tiles * compute, share)
        total_s += seconds / len(windows)
        total_b += nbytes / len(windows)
    return total_s, total_b


def _sparse_stage(plan, ledger: _Ledger, extra_bytes: float, times: float, indexer: bool = True
                  ) -> tuple[float, float]:
    """One layer of sparse attention (tpumk.kernel.sparse_attention) at the plan's full context:
    the latent and index-key pages the step writes read first (a round trip); per sequence the
    index-key tiles through two slots, each costing the larger of its load and its two matmuls
    (the heads' scores, their weighted sum); then the gather steps, `gather_tokens` block DMAs
    each through a ring of `ring_slots` slots against the latent scores and p . c_kv; the write-backs and the
    layer's float32 vectors load beside them. The selection's vector passes (31 + log2 of the
    positions per sequence) and the scalar compaction (one step per position) are not modelled,
    like the other stages' elementwise work. A layer without an indexer (`indexer` False,
    index_shared_layers) has only the latent pages and the gather. Returns one layer's (seconds,
    bytes)."""
    t, g, a = plan.target, plan.sparse, plan.attention
    lengths = [plan.context - plan.q_len] * plan.batch
    c = g.layer_counts([[n + i for i in range(plan.q_len)] for n in lengths], lengths)
    if not indexer:
        c = dict(c, key_tiles=0, key_tile_pages=0)
    patched = c["patched_pages"] * (a.page_bytes + (g.key_page_bytes if indexer else 0))
    patch_read = DMA_LATENCY_S + load_seconds(t, patched, patched, 2 * c["patched_pages"])
    tile_bytes = c["key_tile_pages"] * g.key_page_bytes / max(c["key_tiles"], 1)
    tile_compute = (mxu_seconds(t, g.tile_rows * g.index_head_dim, 2.0 * g.head_rows * g.tile_rows * g.index_head_dim,
                                _passes(g.dtype))
                    + mxu_seconds(t, g.head_rows * g.tile_rows, 2.0 * g.query_rows * g.head_rows * g.tile_rows,
                                  F32_MXU_PASSES))
    tile_load = load_seconds(t, tile_bytes, 2 * tile_bytes, g.tile_pages, 1, 2)
    keys = c["key_tiles"] * max(tile_load, tile_compute) + (plan.batch * DMA_LATENCY_S if indexer else 0.0)
    step_bytes = g.gather_tokens * g.block_bytes
    step_compute = 2 * mxu_seconds(t, g.gather_rows * a.row_lanes, 2.0 * a.q_rows * g.gather_rows * a.row_lanes,
                                   _passes(a.dtype))
    slots = g.ring_slots
    step_load = load_seconds(t, step_bytes, slots * step_bytes, g.gather_tokens, 1, slots)
    gather = c["gather_steps"] * max(step_load, step_compute) + plan.batch * DMA_LATENCY_S
    side = patched + (g.vector_bytes if indexer else 0) + extra_bytes
    side_dma = load_seconds(t, side, side, 2 * c["patched_pages"] + 3)
    key_bytes = c["key_tile_pages"] * g.key_page_bytes
    gather_bytes = c["gather_blocks"] * g.block_bytes
    seconds = patch_read + max(keys + gather, c["key_tiles"] * tile_load + c["gather_steps"] * step_load + side_dma)
    nbytes = patched + key_bytes + gather_bytes + side
    dma = patch_read - DMA_LATENCY_S + c["key_tiles"] * tile_load + c["gather_steps"] * step_load + side_dma
    ledger.add("attention", seconds, nbytes, dma, c["key_tiles"] * tile_compute + c["gather_steps"] * step_compute,
               times)
    return seconds, nbytes


def _linear_stage(plan, ledger: _Ledger, extra_bytes: float, times: float) -> tuple[float, float]:
    """One linear-attention layer's stage (tpumk.kernel.linear_attention): per sequence its
    slot's entry (state, window, pending rows: three DMAs) read into one of two buffers while
    the previous sequence computes, and written back; per token (the replayed previous step's
    and this step's) and value head one [8, Dk] x [Dk, Dv] float32 product at HIGHEST
    precision. The first sequence's reads start before the in-projection's tiles, so their
    latency hides there. Elementwise work on the state (decay, rank-1 update) is not modelled,
    as elsewhere in this model. Returns one layer's (seconds, bytes)."""
    t, g = plan.target, plan.linear
    entry = float(g.slot_bytes)
    per_token = g.value_heads * mxu_seconds(t, g.key_dim * g.value_dim, 2.0 * F32_SUBLANES * g.key_dim * g.value_dim,
                                            F32_MXU_PASSES)
    compute = 2 * g.q_len * per_token  # replay of the previous step's tokens, then this step's
    # each sequence: its entry in (double-buffered: the next one's reads fly during its compute)
    # and out, six DMAs on their own semaphores
    load = load_seconds(t, 2 * entry, 2 * entry, 6, 6, 6)
    side = load_seconds(t, extra_bytes, extra_bytes, 1) if extra_bytes else 0.0
    seconds = g.batch * max(load, compute) + side
    nbytes = 2 * g.batch * entry + extra_bytes
    ledger.add("linear_attention", seconds, nbytes, g.batch * load + side, g.batch * compute, times)
    return seconds, nbytes


def _moe_stage(plan, ring: _Ring, ledger: _Ledger, times: float) -> None:
    """Routing, then the shared expert's ring tiles and the routed experts' chunks together."""
    t, m = plan.target, plan.moe
    passes = _passes(m.dtype)
    # routing: router matmul on the MXU, then the expert-id list VMEM -> SMEM (a local round trip)
    route = mxu_seconds(t, m.router_in * m.experts_padded, 2.0 * m.rows * m.router_in * m.experts_padded, passes) \
        + DMA_LATENCY_S
    ledger.add("moe_routing", route, 0.0, 0.0, route - DMA_LATENCY_S, times)
    ring.prefetch_during(route, 0.0, plan.ring_depth * plan.slot_rows * plan.slot_cols * plan.cfg.dtype_bytes)
    trips = m.expected_distinct_experts() * m.chunks_per_expert
    chunk = float(m.chunk_bytes)
    chunk_compute = mxu_seconds(t, 3 * m.hidden * m.expert_chunk, 2.0 * m.rows * 3 * m.hidden * m.expert_chunk, passes)
    shared = [n for n in ("shared_gate_up", "shared_down") if n in plan.families]
    sh_bytes = sh_compute = sh_tiles = 0.0
    w_ring = 0.0
    for n in shared:
        f = plan.families[n]
        ready = min(float(f.tiles), ring.ahead / f.tile_bytes)
        ring.ahead = max(0.0, ring.ahead - ready * f.tile_bytes)
        sh_bytes += (f.tiles - ready) * f.tile_bytes
        sh_tiles += f.tiles - ready
        sh_compute += f.tiles * mxu_seconds(t, f.tile_rows * f.tile_cols, 2.0 * plan.rows * f.tile_rows * f.tile_cols,
                                            passes)
        w_ring = plan.ring_depth * f.tile_bytes
    slots = m.expert_slots
    first = min(float(slots), trips)  # chunks issued right after routing
    # the shared expert streams through the ring while the first chunks load
    sh_time = max(load_seconds(t, sh_bytes + first * chunk, w_ring + slots * chunk, sh_tiles + 2 * first), sh_compute)
    rest = trips - first
    if slots > 1:  # chunk t + S loads while chunk t is computed
        rest_load = load_seconds(t, rest * chunk, slots * chunk, 2 * rest)
        loop = max(rest_load, trips * chunk_compute)
    else:  # one slot: each load waits for the previous chunk's compute
        rest_load = rest * load_seconds(t, chunk, chunk, 2)
        loop = rest_load + trips * chunk_compute
    dma = load_seconds(t, sh_bytes + first * chunk, w_ring + slots * chunk, sh_tiles + 2 * first) + rest_load
    compute = sh_compute + trips * chunk_compute
    # without a shared expert nothing hides the first chunk's latency after routing
    fill = 0.0 if shared else DMA_LATENCY_S
    seconds = fill + sh_time + loop
    ring_bytes_all = sum(plan.families[n].tiles * plan.families[n].tile_bytes for n in shared)
    ledger.add("experts", seconds, ring_bytes_all + trips * chunk, dma, compute, times)
    # the ring runs ahead into the next layer while the experts load
    ring.prefetch_during(seconds, sh_bytes + trips * chunk,
                         plan.ring_depth * plan.slot_rows * plan.slot_cols * plan.cfg.dtype_bytes)


def megakernel_step(plan) -> StepModel:
    """tpumk's timeline model of the plan's megakernel decode step, walking its schedule.

    Per layer: the q|k|v ring tiles; attention (patch reads, KV tiles through `kv_buffers`
    slots, write-backs) while the ring's outstanding tiles finish; the o tiles; then dense
    gate|up and down tiles, or MoE routing and the shared expert's ring tiles sharing the
    engine with the routed experts' chunks (`expert_slots` in flight). Then the lm_head with
    its logits write-back, and one kernel boundary for the whole step. Bytes are the plan's
    own accounting (KV at the full context, experts at the expected distinct count), so
    `hbm_bytes` equals `plan.hbm_bytes`. Never faster than the plan's HBM floor.
    Many devices: the figures are one device's (its bytes, its floor), plus a "collectives"
    stage: each all-reduce after o and after the FFN / MoE stalls the compute for
    `all_reduce_seconds` (tpumk.estimate.interconnect) while the ring keeps prefetching, and so
    does, with the MLA latent split, each layer's all-gather of the q_a | kv_a slices."""
    ledger = _Ledger()
    ring = _Ring(plan, ledger)
    cfg, t = plan.cfg, plan.target
    depth_bytes = plan.ring_depth * plan.slot_rows * plan.slot_cols * plan.families["lm_head"].itemsize
    # a layer's norm vectors, and its column scales when the ring is column-scaled (one row each)
    vec_bytes = plan.hbm.get("layer_vectors", 0.0) / max(cfg.num_layers, 1) + 4.0 * plan.scales_width
    router = float(plan.moe.router_bytes) if plan.moe is not None else 0.0

    # kernel entry: dispatch, the kernel's VMEM inputs (embedded rows, cos/sin) copied in, and
    # the first ring tile's latency (the prologue issues `depth` tiles; the first must land)
    io = plan.hbm.get("activations_io", 0.0)
    logits_bytes = float(plan.rows * plan.vocab_pad * 4)
    inputs = max(0.0, io - logits_bytes)
    copy_in = load_seconds(t, inputs, inputs, 3)
    entry = OP_DISPATCH_S + 2 * DMA_LATENCY_S + copy_in
    ledger.add("kernel_boundary", entry, inputs, copy_in)

    # Many devices: the partial sums of o and of the FFN / MoE (and an all-heads QK-norm's sums of
    # squares) are all-reduced in the kernel
    # (tpumk.kernel.collectives). The compute waits for each; the ring's outstanding loads go on.
    reduce = all_reduce_seconds(t, plan.all_reduce)["seconds"] if plan.all_reduce is not None else 0.0
    gather = all_gather_seconds(t, plan.all_reduce, latent_slice_bytes(plan))["seconds"] if plan.latent_split else 0.0

    def collective(times: float) -> None:
        if reduce:
            ledger.add("collectives", reduce, times=times)
            ring.prefetch_during(reduce, 0.0, depth_bytes)

    kv_ahead = not cfg.is_mla and not plan.attention.window_runs() and plan.linear is None
    for seg in plan.segments[:-1]:
        # Every layer of a segment walks the same schedule: model the first layer (entering
        # from the previous stage) and the steady layer separately, then scale.
        for first, times in ((True, 1.0), (False, float(seg.num_layers - 1))):
            if times <= 0:
                continue
            extra = vec_bytes + (router if seg.kind == "moe" else 0.0)
            if seg.linear:  # a linear layer: its projections, the state stage, the out-projection
                for name in ("lin_in", "lin_fb", "lin_gb"):
                    if name in plan.families:
                        ring.family(name, "weight_ring", times)
                lin_s, lin_b = _linear_stage(plan, ledger, extra, times)
                ring.prefetch_during(lin_s, lin_b, depth_bytes)
                ring.family("lin_out", "weight_ring", times)
                collective(times)
                if seg.kind == "dense":
                    ring.family("gate_up", "weight_ring", times)
                    ring.family("down", "weight_ring", times)
                else:
                    _moe_stage(plan, ring, ledger, times)
                collective(times)
                continue
            before, after = (("qkv",), ("o",)) if "qkv" in plan.families else (
                tuple(n for n in seg.families if n in MLA_FAMILIES and n != "uv"), ("uv", "o"))
            for name in before:  # the projections ahead of attention (MLA: q path, kv_a, W_UK)
                ring.family(name, "weight_ring", times)
                if name == "kv_a" and plan.latent_split:  # the latent slices, all-gathered
                    ledger.add("collectives", gather, times=times)
                    ring.prefetch_during(gather, 0.0, depth_bytes)
            if cfg.attention.qk_norm_whole:  # the all-heads QK-norm's sums of squares (none on one device)
                collective(times)
            layers = range(seg.first_layer + (0 if first else 1), seg.first_layer + (1 if first else seg.num_layers))
            # the kernel's next-layer KV prefetch: GQA without sliding windows, every layer but
            # the kernel's first (tpumk.kernel.attention.attention_stage, prefetch_next)
            started = kv_ahead and not (first and seg is plan.segments[0])
            if plan.sparse is not None:
                att, att_bytes = _sparse_stage(plan, ledger, extra, times, seg.index_base >= 0)
            else:
                att, att_bytes = _attention_stage(plan, ledger, extra, times, [plan.attention.window(i) for i in layers],
                                                  started, depth_bytes, patches_early=not cfg.is_mla)
            ring.prefetch_during(att, att_bytes, depth_bytes)
            for name in after:
                ring.family(name, "weight_ring", times)
            collective(times)
            if seg.kind == "dense":
                ring.family("gate_up", "weight_ring", times)
                ring.family("down", "weight_ring", times)
            else:
                # Muse Spark's projections around the experts: modelled before and after the
                # stage (the kernel streams moe_in while the first expert chunks load: not credited)
                if "moe_in" in seg.families:
                    ring.family("moe_in", "weight_ring", times)
                _moe_stage(plan, ring, ledger, times)
                if "moe_out" in seg.families:
                    ring.family("moe_out", "weight_ring", times)
            collective(times)
    taps = plan.hbm.get("hidden_taps", 0.0)
    if taps:  # each tapped residual written out while its layer runs: bandwidth the ring shares
        one = taps / len(plan.taps)
        ledger.add("hidden_taps", load_seconds(t, taps, one, len(plan.taps)), taps, load_seconds(t, taps, one, len(plan.taps)))
    head = plan.families["lm_head"]
    ring.family("lm_head", "lm_head", 1.0, extra_bytes_per_block=float(plan.rows * head.tile_cols * 4))
    ledger.add("kernel_boundary", DMA_LATENCY_S)  # the last logits block's write-back drains
    if plan.all_reduce is not None:  # then every device's slice goes to every peer
        ledger.add("collectives", all_gather_seconds(t, plan.all_reduce, logits_slice_bytes(plan))["seconds"])

    notes = []
    least = collectives_floor_seconds(plan)
    if reduce:
        waits = ledger.stages["collectives"]["seconds"]
        latent = ", the per-layer latent all-gathers" if plan.latent_split else ""
        notes.append(f"collectives: {plan.collectives_per_step} in-kernel collectives ({plan.all_reduce.schedule} "
                     f"all-reduces{latent} and the logits all-gather), {plan.interconnect_bytes / 1e6:.3f} MB sent per "
                     f"device, {waits * 1e6:.1f} us of waits (no schedule or wire below {least * 1e6:.1f} us); the "
                     f"weight ring keeps loading during the all-reduces ({interconnect_source('collectives', t)})")
    floor = plan.floor_seconds
    seconds = ledger.seconds
    if seconds < floor:  # cannot happen when every byte is accounted; never report it if it does
        notes.append(f"model walk gave {seconds * 1e6:.1f} us < HBM floor {floor * 1e6:.1f} us; clamped to the floor")
        seconds = floor
    return StepModel(seconds=seconds, dma_seconds=ledger.dma, compute_seconds=ledger.mxu, hbm_bytes=ledger.hbm_bytes,
                     source=model_source("megakernel", t), stages=ledger.stages, kernels=1, floor_seconds=floor,
                     notes=tuple(notes), collectives_floor_seconds=least)


def collectives_floor_seconds(plan) -> float:
    """Seconds per step that the plan's in-kernel collectives cannot go below by tpumk's
    interconnect model, whatever their schedule and wire (`all_reduce_floor`, `all_gather_floor`:
    one round carrying every peer's whole part, or two bare round latencies, each taken at the
    narrowest wire tpumk sends, `ALL_REDUCE_WIRES`). The same count of collectives as the
    plan's (`Plan.interconnect`); 0 on one device. Where the modelled waits sit near this
    figure, only fewer collectives per step (or a faster round) would cut them."""
    g = plan.all_reduce
    if g is None:
        return 0.0
    t, ic = plan.target, plan.interconnect
    reduce = min(all_reduce_floor(t, dataclasses.replace(g, dtype=w))["seconds"] for w in ALL_REDUCE_WIRES)
    seconds = ic["all_reduce"]["count"] * reduce
    # the gathers carry float32 slices; the narrowest wire would shrink them by its width
    narrow = min(WIRE_BYTES[w] for w in ALL_REDUCE_WIRES) / WIRE_BYTES["float32"]
    seconds += ic["logits_all_gather"]["count"] * all_gather_floor(t, g.devices, logits_slice_bytes(plan) * narrow)["seconds"]
    if "latent_all_gather" in ic:
        seconds += (ic["latent_all_gather"]["count"]
                    * all_gather_floor(t, g.devices, latent_slice_bytes(plan) * narrow)["seconds"])
    return seconds


# ---------------------------------------------------------------------- compiled HLO programs
# Ops that launch nothing: bookkeeping, views, and XLA-internal zero-copy custom calls.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
         "add-dependency", "partition-id", "replica-id", "domain"}
_FREE_CUSTOM = {"ConcatBitcast", "AllocateBuffer", "SliceToDynamic", "PadToStatic"}
# Top-level elementwise ops on a few scalars run on the scalar unit, not as vector kernels.
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "and", "or", "xor", "not",
                "negate", "abs", "compare", "select", "convert", "rsqrt", "sqrt", "exp", "log", "shift-left",
                "shift-right-logical", "shift-right-arithmetic", "clamp", "floor", "ceil", "sign", "power",
                "is-finite", "iota", "broadcast", "reshape", "pad", "slice", "dynamic-slice"}
SCALAR_MAX_ELEMENTS = 128  # at most one vector register row: such top-level ops are scalar work
_SLICING = {"slice", "dynamic-slice", "gather"}
_VIEWS = {"bitcast", "reshape", "copy", "transpose", "convert"}


@dataclass
class OpCost:
    """What one top-level HLO op of a program costs in the timeline model."""

    name: str
    opcode: str
    kind: str  # "kernel" | "scalar" | "async_dma" | "free" | "custom_kernel" | "collective"
    read_bytes: float = 0.0  # HBM bytes read
    write_bytes: float = 0.0  # HBM bytes written
    mxu_seconds: float = 0.0
    window_bytes: float = 0.0  # VMEM the op's pipeline buffers use (its bytes in flight)
    times: float = 1.0  # executions per step (while-loop trips)
    collective: str = ""  # kind "collective": "all-reduce", "all-gather", ... (the -start form's base name)
    collective_bytes: float = 0.0  # its operand on one device (tpumk.estimate.interconnect's convention)
    group: tuple[int, ...] | None = None  # device ids of its (first) replica group; None: every device
    peer_offset: int = 1  # collective-permute: distance from source to target, in group positions


class _Program:
    def __init__(self, text: str, target: Target):
        self.comps, self.entry = parse_hlo(text)
        self.target = target
        self.by_name = {c: {i.name: i for i in ins} for c, ins in self.comps.items()}
        self.notes: list[str] = []

    # ---- bytes a fusion really touches
    def _param_read_bytes(self, comp: str, index: int, full: float) -> float:
        """HBM bytes a fused computation reads of parameter `index`: only the slices it takes
        when every use is a slice (a layer of a stacked cache or weight); nothing when the
        parameter is the buffer an in-place update writes into; else the whole operand."""
        param = next((i for i in self.comps.get(comp, []) if i.opcode == "parameter" and i.args.strip() == str(index)),
                     None)
        if param is None:
            return full
        return self._value_read_bytes(comp, param.name, full)

    def _value_read_bytes(self, comp: str, value: str, full: float, depth: int = 0) -> float:
        if depth > 8:
            return full
        users = [i for i in self.comps[comp] if value in i.operands]
        if not users:  # the root: the caller consumes it whole; otherwise it is dead
            return full if self.by_name[comp].get(value) is not None and self.by_name[comp][value].root else 0.0
        total = 0.0
        for u in users:
            if u.opcode in _SLICING and u.operands and u.operands[0] == value:
                # the elements taken, at the source's width (XLA may fold a convert into the slice)
                src = self.by_name[comp][value].shapes if value in self.by_name[comp] else []
                width = DTYPE_BYTES.get(src[0].dtype, 4) if src else 4
                total += sum(s.elements for s in u.shapes) * width
            elif u.opcode in ("dynamic-update-slice", "scatter") and u.operands and u.operands[0] == value:
                total += 0.0  # the buffer updated in place is not read
            elif u.opcode in ("bitcast", "reshape"):
                total += self._value_read_bytes(comp, u.name, full, depth + 1)
            elif u.opcode == "fusion":
                called = called_computation(u)
                k = u.operands.index(value)
                total += self._param_read_bytes(called, k, full) if called in self.comps else full
            else:
                return full
        return min(total, full)

    def _write_bytes(self, comp: str, out_bytes: float) -> float:
        """HBM bytes a fused computation writes: the update only, when its root updates a
        parameter's buffer in place (dynamic-update-slice / scatter)."""
        instrs = self.comps.get(comp, [])
        root = next((i for i in instrs if i.root), None)
        if root is None:
            return out_bytes
        roots = [self.by_name[comp][o] for o in root.operands if o in self.by_name[comp]] if root.opcode == "tuple" \
            else [root]
        total = 0.0
        for r in roots:
            while r.opcode in ("bitcast", "reshape") and r.operands and r.operands[0] in self.by_name[comp]:
                r = self.by_name[comp][r.operands[0]]
            if r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
                total += self._shape_bytes(comp, r.operands[1])
            elif r.opcode == "scatter" and len(r.operands) > 2:
                total += self._shape_bytes(comp, r.operands[2])
            elif r.opcode == "fusion" and called_computation(r) in self.comps:
                total += self._write_bytes(called_computation(r), sum(s.nbytes for s in r.shapes))
            else:
                total += sum(s.nbytes for s in r.shapes)
        return min(total, out_bytes) if out_bytes else total

    def _shape_bytes(self, comp: str, name: str) -> float:
        ins = self.by_name[comp].get(name)
        return sum(s.nbytes for s in ins.shapes) if ins else 0.0

    # ---- MXU work
    def _mxu_instr(self, comp: str, i: HloInstr) -> float:
        ops = [self.by_name[comp].get(o) for o in i.operands[:2]]
        if len(ops) < 2 or any(o is None or not o.shapes for o in ops):
            return 0.0
        a, b = ops[0].shapes[0], ops[1].shapes[0]
        out = i.shapes[0]
        prec = i.attr("operand_precision") or ""
        passes = 1
        if "f32" in (a.dtype, b.dtype):
            passes = F32_MXU_PASSES if "highest" in prec else (3 if "high" in prec else 1)
        return mxu_seconds(self.target, max(a.elements, b.elements), 2.0 * out.elements * contracting_length(i, a, b), passes)

    def _mxu(self, comp: str, depth: int = 0) -> float:
        seconds = 0.0
        for i in self.comps.get(comp, []):
            if i.opcode in ("convolution", "dot"):
                seconds += self._mxu_instr(comp, i)
            elif i.opcode == "fusion" and depth < 8:
                seconds += self._mxu(called_computation(i), depth + 1)
        return seconds

    # ---- collectives
    def _find_collective(self, comp: str, depth: int = 0) -> tuple[str, HloInstr] | None:
        """The collective a called computation runs (XLA wraps an async or SparseCore-offloaded
        collective in an async computation, sometimes behind a custom call), or None."""
        if depth > 4 or comp not in self.comps:
            return None
        for i in self.comps[comp]:
            if collective_kind(i.opcode) and not i.opcode.endswith("-done"):
                return comp, i
        for i in self.comps[comp]:
            for c in called_computations(i):
                found = self._find_collective(c, depth + 1)
                if found:
                    return found
        return None

    def _collective_cost(self, comp: str, i: HloInstr, name: str, opcode: str, times: float) -> OpCost:
        """A collective op: its kind, operand bytes on one device and replica-group size."""
        kind = collective_kind(i.opcode) or ""
        group = replica_group(i)
        nbytes = sum(s.nbytes for o in i.operands if o in self.by_name[comp] for s in self.by_name[comp][o].shapes)
        if not nbytes:  # operands not resolvable here: the result (without an async op's scalar context),
            # scaled back to one device's share
            result = [s for s in i.shapes if s.dtype not in ("u32", "s32") or s.dims] or i.shapes
            nbytes = sum(s.nbytes for s in result)
            if kind == "all-gather" and group:
                nbytes /= len(group)
        pairs = source_target_pairs(i)
        offset = 1
        if pairs and group:
            offset = (group.index(pairs[0][1]) - group.index(pairs[0][0])) % len(group) or 1
        return OpCost(name, opcode, "collective", times=times, collective=kind, collective_bytes=float(nbytes),
                      group=group, peer_offset=offset)

    # ---- walk the entry computation
    def ops(self) -> list[OpCost]:
        return self._walk(self.entry, 1.0, 0)

    def _walk(self, comp: str, times: float, depth: int) -> list[OpCost]:
        out: list[OpCost] = []
        for i in self.comps[comp]:
            op = i.opcode
            if op in _FREE or op.endswith("-done") or op.endswith("-update"):
                out.append(OpCost(i.name, op, "free", times=times))
                continue
            if op == "custom-call" and (i.attr("custom_call_target") or "") in _FREE_CUSTOM:
                out.append(OpCost(i.name, op, "free", times=times))
                continue
            if _is_collective(op):
                out.append(self._collective_cost(comp, i, i.name, op, times))
                continue
            if op == "async-start":
                called = called_computation(i)
                found = self._find_collective(called)
                if found:  # an async (possibly SparseCore-offloaded) collective
                    out.append(self._collective_cost(found[0], found[1], i.name, op, times))
                    continue
                root = next((r for r in self.comps.get(called, []) if r.root), None)
                shapes = i.shapes
                if root is not None and root.opcode in ("copy", "slice", "dynamic-slice") and len(shapes) >= 2:
                    # the HLO dump's spelling of copy-start / slice-start: ((source), destination, context)
                    dst, src = shapes[-2], shapes[0]
                    hbm_to_chip = src.in_hbm and not dst.in_hbm
                    chip_to_hbm = dst.in_hbm and not src.in_hbm
                    out.append(OpCost(i.name, op, "async_dma", read_bytes=dst.nbytes if hbm_to_chip else 0.0,
                                      write_bytes=dst.nbytes if chip_to_hbm else 0.0, times=times))
                    continue
            if op in ("copy-start", "slice-start"):  # an async DMA that overlaps other ops
                shapes = i.shapes
                if len(shapes) >= 2:
                    dst, src = (shapes[0], shapes[1]) if op == "copy-start" else (shapes[-2], shapes[0])
                    hbm_to_chip = src.in_hbm and not dst.in_hbm
                    chip_to_hbm = dst.in_hbm and not src.in_hbm
                    out.append(OpCost(i.name, op, "async_dma", read_bytes=dst.nbytes if hbm_to_chip else 0.0,
                                      write_bytes=dst.nbytes if chip_to_hbm else 0.0, times=times))
                    continue
            if op == "while" and depth < 4:
                trips = trip_count(i)
                if trips is None:
                    self.notes.append(f"while loop {i.name}: trip count unknown, its body counted once")
                    trips = 1
                body = i.attr("body")
                if body and body.lstrip("%") in self.comps:
                    out += self._walk(body.lstrip("%"), times * trips, depth + 1)
                continue
            if op in ("call", "conditional") and depth < 4:
                # a call's computation, or a conditional's first branch
                for c in re.findall(r"%([\w.\-]+)", i.attr("to_apply") or i.attrs):
                    if c in self.comps:
                        out += self._walk(c, times, depth + 1)
                        break
                continue
            result = i.shapes
            if op in _ELEMENTWISE and sum(s.elements for s in result) <= SCALAR_MAX_ELEMENTS:
                out.append(OpCost(i.name, op, "scalar", times=times))
                continue
            if op == "custom-call" and "tpu_custom_call" in (i.attr("custom_call_target") or ""):
                out.append(OpCost(i.name, op, "custom_kernel", times=times))
                continue
            out.append(self._kernel_cost(comp, i, times))
        return out

    def _kernel_cost(self, comp: str, i: HloInstr, times: float) -> OpCost:
        names = self.by_name[comp]
        called = called_computation(i) if i.opcode in ("fusion", "async-start") else None
        read = 0.0
        for k, o in enumerate(i.operands):
            src = names.get(o)
            if src is None:
                continue
            for s in src.shapes[:1] if src.opcode != "tuple" else src.shapes:
                if not s.in_hbm:
                    continue
                full = s.nbytes
                if called in self.comps:
                    read += self._param_read_bytes(called, k, full)
                elif i.opcode in ("dynamic-update-slice", "scatter") and k == 0:
                    pass  # in place: the buffer is not read
                elif i.opcode in _SLICING and k == 0:
                    read += sum(x.nbytes for x in i.shapes)
                else:
                    read += full
        out_hbm = sum(s.nbytes for s in i.shapes if s.in_hbm)
        if out_hbm and called in self.comps:
            write = self._write_bytes(called, out_hbm)
        elif out_hbm and i.opcode == "dynamic-update-slice":
            write = self._shape_bytes(comp, i.operands[1]) if len(i.operands) > 1 else out_hbm
        elif out_hbm and i.opcode == "scatter":
            write = self._shape_bytes(comp, i.operands[2]) if len(i.operands) > 2 else out_hbm
        else:
            write = out_hbm
        cfg = i.backend_config()
        window = sum(float(c.get("size", 0)) for c in cfg.get("used_scoped_memory_configs", []) or [])
        if called in self.comps:
            mxu = self._mxu(called)
        else:
            mxu = self._mxu_instr(comp, i) if i.opcode in ("convolution", "dot") else 0.0
        return OpCost(i.name, i.opcode, "kernel", read, write, mxu, window, times)


def _is_collective(opcode: str) -> bool:
    return collective_kind(opcode) is not None and not opcode.endswith("-done")


def program_ops(target: Target, hlo_text: str) -> tuple[list[OpCost], list[str]]:
    """The cost of every top-level op of a compiled program's HLO, and notes on what the
    parse could not resolve (e.g. a while loop without a known trip count)."""
    prog = _Program(hlo_text, target)
    return prog.ops(), prog.notes


def kernel_op_seconds(target: Target, op: OpCost) -> tuple[float, float, float]:
    """(seconds, dma_seconds, boundary_seconds) of one kernel op: dispatch, a pipeline fill when
    it reads HBM and a drain when it writes HBM, and max(its DMA, its MXU work) in between;
    its bytes in flight are its pipeline buffers in VMEM (the whole op when it has none)."""
    nbytes = op.read_bytes + op.write_bytes
    window = min(nbytes, op.window_bytes) if op.window_bytes > 0 else nbytes
    windows = math.ceil(nbytes / max(window / 2, 1.0)) if nbytes else 0  # double-buffered blocks
    dma = load_seconds(target, nbytes, window, windows) if nbytes else 0.0
    boundary = OP_DISPATCH_S + (DMA_LATENCY_S if op.read_bytes else 0.0) + (DMA_LATENCY_S if op.write_bytes else 0.0)
    return boundary + max(dma, op.mxu_seconds), dma, boundary


def program_collectives(target: Target, hlo_text: str) -> dict[str, int]:
    """XLA collective ops a compiled program runs per step, by kind (loop trips counted; an
    async pair counts once)."""
    ops, _ = program_ops(target, hlo_text)
    out: dict[str, int] = {}
    for o in ops:
        if o.kind == "collective":
            out[o.collective] = out.get(o.collective, 0) + int(o.times)
    return out


def collective_op_cost(target: Target, op: OpCost, devices: int | None = None) -> dict:
    """tpumk's interconnect model of one collective op (`collective_op_seconds`) over its
    replica group's devices; a group XLA leaves empty spans every device (`devices`)."""
    group = op.group if op.group else (tuple(range(devices)) if devices else None)
    if group is None:
        raise ValueError(f"collective {op.name}: its replica groups span every device; pass devices")
    return collective_op_seconds(target, op.collective, op.collective_bytes, len(group), op.peer_offset, group)


def xla_step(target: Target, hlo_text: str, kernel: StepModel | None = None, floor_seconds: float = 0.0,
             what: str = "XLA program", devices: int | None = None) -> StepModel:
    """tpumk's timeline model of a compiled program, op by op, from its post-optimization HLO.

    Each kernel op (fusion, copy, in-place update, ...) is costed by `kernel_op_seconds`: its
    HBM bytes (operands and results not placed in VMEM by XLA; only the slices a fusion takes
    of a big operand; only the update of an in-place update), its MXU work (`mxu_seconds` of
    each dot / convolution), and a boundary (dispatch, fill, drain); nothing streams across
    ops. Async copies XLA issues (prefetches into VMEM) overlap other ops: their bytes cost
    time only beyond the DMA slack the kernels leave. Scalar-unit ops and views cost nothing.
    Ops inside a while loop count once per trip (known trip counts).

    Collectives of an SPMD program (all-reduce, all-gather, ... and their async and
    SparseCore-offloaded forms) are costed per device by tpumk's interconnect model
    (`tpumk.estimate.interconnect.collective_op_seconds`) and reported as the stage
    "collectives", with a note; they are charged in full, with no overlap: at decode each
    reduction feeds the very next op. `devices`: the program's device count, for a collective
    whose replica groups XLA leaves empty (all devices).

    `kernel`: the model of the program's Pallas kernel (a `tpu_custom_call`), e.g.
    `megakernel_step(plan)`; its time replaces that op's (it already includes its boundary).
    `floor_seconds`: the step's HBM floor, kept on the result for floor fractions."""
    ops, notes = program_ops(target, hlo_text)
    ledger = _Ledger()
    slack = 0.0
    background = 0.0
    kernels = 0
    coll_count, coll_bytes, coll_seconds = 0, 0.0, 0.0
    for op in ops:
        if op.kind == "collective":
            cost = collective_op_cost(target, op, devices)
            ledger.add("collectives", cost["seconds"], times=op.times)
            coll_count += int(op.times)
            coll_bytes += cost["send_bytes"] * op.times
            coll_seconds += cost["seconds"] * op.times
        elif op.kind == "kernel":
            seconds, dma, boundary = kernel_op_seconds(target, op)
            stage = "matmul ops" if op.mxu_seconds > 0 else ("copies" if op.opcode == "copy" else "other ops")
            ledger.add(stage, seconds - boundary, op.read_bytes + op.write_bytes, dma, op.mxu_seconds, op.times)
            ledger.add("kernel boundaries", boundary, times=op.times)
            slack += (seconds - dma) * op.times
            kernels += int(op.times)
        elif op.kind == "custom_kernel":
            if kernel is None:
                raise ValueError(f"{what}: op {op.name} is a Pallas kernel; pass its model as `kernel`")
            for name, st in kernel.stages.items():
                ledger.add(f"pallas: {name}", st["seconds"], st["hbm_bytes"], st["dma_seconds"], st["mxu_seconds"],
                           op.times)
            kernels += int(op.times)
        elif op.kind == "async_dma":
            background += (op.read_bytes + op.write_bytes) * op.times
    if background:
        # prefetches run on the engine while kernels compute or wait on boundaries
        busy = load_seconds(target, background, background, 1.0)
        ledger.add("async prefetch", max(0.0, busy - slack), background, busy)
    if coll_count:
        notes.append(f"collectives: {coll_count} XLA collective ops, {coll_bytes / 1e6:.3f} MB sent per device, "
                     f"{coll_seconds * 1e6:.1f} us (tpumk interconnect model, not a measurement)")
    return StepModel(seconds=ledger.seconds, dma_seconds=ledger.dma, compute_seconds=ledger.mxu,
                     hbm_bytes=ledger.hbm_bytes, source=model_source(what, target), stages=ledger.stages, kernels=kernels,
                     floor_seconds=floor_seconds, notes=tuple(notes))
