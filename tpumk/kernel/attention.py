"""The attention stage of the megakernel: paged GQA attention over a KV cache updated in place.

`attention_stage` is not a kernel of its own: it runs inside the megakernel's single grid-less
`pallas_call`, once per layer (the layer index is a traced scalar of the megakernel's layer
loop), and follows `tpumk.model.reference.decode_step` for one layer exactly:

1. Cache update. Each new token's K/V row goes to page `block_tables[b, pos // page_size]`,
   slot `pos % page_size`, of the HBM cache (aliased input -> output, so the write is in place).
   A one-row DMA at an arbitrary slot does not compile on TPU (second-minor offsets must be
   tile aligned), so every page a step touches is read whole into a VMEM "patch" slot, its
   rows are replaced with `where` over a row iota, and the page is written back whole.
   The page reads depend only on the layer, tables and positions: `attention_prefetch` can
   start them before the QKV projection so their latency hides behind it.
2. Attention. Each sequence streams the KV tiles it needs (up to its largest new position)
   through `kv_buffers` VMEM slots of `kv_tile_pages` pages each, with the DMAs of the next
   `kv_buffers - 1` tiles in flight while a tile is computed. All sequences share one flat
   pipeline (a `fori_loop` over every (sequence, tile) pair), so the prefetch runs across
   sequence boundaries and the pipeline fills once per layer, not once per sequence.
   Per tile and kv head, ONE matmul covers all `group` q heads and all `q_len` rows; the
   softmax is online (running max and sum in float32).

Ordering of the in-place writes: a page the step writes is never DMA'd from HBM by the
attention loop. Its tile slot is filled by a local VMEM->VMEM DMA from the patched copy
instead, so the write-back DMAs (waited at the end of the stage) never overlap a read of the
same HBM bytes, and the attention sees the new rows without a write->read round trip. Every
page a step needs is thus read from HBM exactly once and every written page written once.
Requirement this relies on (as does any paged cache): pages written by a step belong to one
sequence only (no two sequences' block tables share a page that this step writes).

Control flow is shaped for libtpu 0.0.52's static cost profiler (the tuner's yardstick),
which on TPU7x crashed on a DMA wait inside a branch and ran out of memory on vector work
inside branches of the tile loop: DMAs may be started in branches, every wait is
unconditional, and the tile compute is branch-free.

Numerics (as the reference): scores are q cast to the cache dtype times k with float32
accumulation, scaled by 1/sqrt(head_dim); softmax in float32; probabilities cast to the cache
dtype for p.v with float32 accumulation. The online softmax casts unnormalised probabilities
and divides by the running sum at the end, so float32 caches agree with the reference to
rounding and bfloat16 caches to the bfloat16 rounding of p (see tests).

Rows of a tile that are not valid keys (past a sequence's last position, gaps, repeated
pages at the end of the last tile) get zero weight, and their V rows are zeroed, so stale or
non-finite bytes in unused cache slots cannot leak into the output (0 * NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.errors import PlanError

LANES = 128
# Finite stand-in for -inf in masked scores: exp(MASK - m) underflows to exactly 0 once a row
# has seen one real key, and a fully masked tile cannot produce inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Rows of one (8 x 128) x 32-bit VMEM tile per dtype: the second-minor tiling Mosaic requires of
# DMA offsets and sizes, hence of page_size (TPU_FACTS 4).
_SUBLANES = {"float32": 8, "bfloat16": 16}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class AttentionGeometry:
    """Static facts of the attention stage: model shape, cache shape and two tuning knobs.

    kv_tile_pages: pages per streamed KV tile (tile = kv_tile_pages * page_size tokens). Any
        value in [1, pages_per_seq] is valid: it need not divide pages_per_seq, because a
        sequence's last tile repeats its last needed page in the unused page slots (those rows
        are masked), so no DMA ever reads outside the pages a sequence owns.
    kv_buffers: VMEM tile slots (>= 2); kv_buffers - 1 tiles are in flight during compute.
    """

    batch: int
    q_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    num_layers: int
    kv_tile_pages: int
    kv_buffers: int
    dtype: str

    @classmethod
    def from_config(cls, cfg, batch: int, q_len: int, page_size: int, pages_per_seq: int,
                    kv_tile_pages: int, kv_buffers: int) -> "AttentionGeometry":
        return cls(batch=batch, q_len=q_len, num_q_heads=cfg.num_q_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=page_size,
                   pages_per_seq=pages_per_seq, num_layers=cfg.num_layers,
                   kv_tile_pages=kv_tile_pages, kv_buffers=kv_buffers, dtype=cfg.dtype)

    # ------------------------------------------------------------------ derived sizes
    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def kv_size(self) -> int:
        """Lanes of one cache row: all kv heads side by side (one DMA moves every head)."""
        return self.num_kv_heads * self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def tokens(self) -> int:
        """Rows of q / k_new / v_new / o: batch * q_len, ordered b-major."""
        return self.batch * self.q_len

    @property
    def tile_rows(self) -> int:
        return self.kv_tile_pages * self.page_size

    @property
    def q_rows(self) -> int:
        """Rows of one kv head's query block (group * q_len), padded to a whole f32 tile."""
        return _round_up(self.group * self.q_len, 8)

    @property
    def staged_rows(self) -> int:
        return _round_up(self.tokens, 8)

    @property
    def patch_pages(self) -> int:
        """Patch slots: one page per new token, plus a read-only sink page when q_len > 1
        (source of the stand-in DMAs of tokens that share a page with an earlier token)."""
        return self.tokens + (1 if self.q_len > 1 else 0)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_size * self.itemsize

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise PlanError naming the first knob or shape the stage cannot build."""

        def need(cond: bool, knob: str, expected: str) -> None:
            if not cond:
                raise PlanError(f"attention: {knob} = {getattr(self, knob)!r}: expected {expected}")

        for knob in ("batch", "q_len", "num_q_heads", "num_kv_heads", "head_dim", "page_size",
                     "pages_per_seq", "num_layers", "kv_tile_pages", "kv_buffers"):
            v = getattr(self, knob)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, knob, "a positive integer")
        need(self.dtype in _DTYPES, "dtype", f"one of {', '.join(_DTYPES)}")
        need(self.num_q_heads % self.num_kv_heads == 0, "num_kv_heads",
             f"a divisor of num_q_heads ({self.num_q_heads})")
        need(self.head_dim % LANES == 0, "head_dim",
             f"a multiple of {LANES} (each head is a lane-aligned slice of a cache row)")
        sub = _SUBLANES[self.dtype]
        need(self.page_size % sub == 0, "page_size",
             f"a multiple of {sub} ({self.dtype} sublane tiling: pages are DMA'd whole into "
             f"tile-aligned VMEM rows)")
        need(self.kv_tile_pages <= self.pages_per_seq, "kv_tile_pages",
             f"at most pages_per_seq ({self.pages_per_seq})")
        need(self.kv_buffers >= 2, "kv_buffers", "at least 2 (one tile computed while the next loads)")

    # ------------------------------------------------------------------ budgets
    def vmem_shapes(self) -> list[tuple[str, tuple[int, ...], Any]]:
        """(name, shape, dtype) of every VMEM scratch buffer, in scratch order.

        Every shape is whole (8 x 128) f32 / (16 x 128) bf16 tiles (page_size is validated, the
        other row counts are padded), so the logical bytes are the bytes VMEM allocates."""
        dt = self.jnp_dtype
        nb, s, p, hd = self.kv_buffers, self.tile_rows, self.page_size, self.kv_size
        return [
            ("k_tiles", (nb, s, hd), dt),
            ("v_tiles", (nb, s, hd), dt),
            ("k_patch", (self.patch_pages, p, hd), dt),
            ("v_patch", (self.patch_pages, p, hd), dt),
            ("new_rows", (2, self.staged_rows, hd), jnp.float32),
            ("q_heads", (self.batch, self.num_kv_heads, self.q_rows, self.head_dim), jnp.float32),
            ("m", (self.num_kv_heads, self.q_rows, LANES), jnp.float32),
            ("l", (self.num_kv_heads, self.q_rows, LANES), jnp.float32),
            ("acc", (self.num_kv_heads, self.q_rows, self.head_dim), jnp.float32),
            ("flat", (self.staged_rows, self.q_size), jnp.float32),
        ]

    def vmem_bytes(self) -> int:
        """Exact bytes of VMEM scratch the stage allocates (sum over `vmem_shapes`):

        2*kv_buffers*tile_rows*kv_size*itemsize          KV tile slots
        + 2*(B*q + [q>1])*page_size*kv_size*itemsize    patch pages (per new token, + sink)
        + 4*(2*Bq8*kv_size + Bq8*q_size)                 staged new K/V rows, q in / o out
        + 4*B*Hkv*R*D + 4*Hkv*R*(2*128 + D)              per-head q/o, softmax m, l, acc
        with Bq8 = round_up(B*q, 8), R = round_up(group*q, 8)."""
        return sum(math.prod(shape) * jnp.dtype(dt).itemsize for _, shape, dt in self.vmem_shapes())

    def smem_bytes(self) -> int:
        """SMEM scratch: per sequence, its tile count, page count and each new token's page."""
        return 4 * self.batch * (2 + self.q_len)

    def dma_semaphores(self) -> int:
        """DMA semaphores the stage allocates: (K, V) x kv_buffers + (read, write) x B*q."""
        return 2 * self.kv_buffers + 2 * self.tokens

    def dma_counts(self, positions: np.ndarray) -> dict[str, int]:
        """Page DMAs of one layer for concrete `positions` [B, q] (the kernel's own logic).

        hbm_tile_pages: pages streamed from HBM into tile slots; local_tile_pages: tile pages
        copied from a patched page in VMEM; patched_pages: pages read, patched and written back.
        Each count is per cache (K and V each move this many pages)."""
        positions = np.asarray(positions).reshape(self.batch, self.q_len)
        p, s, kt = self.page_size, self.tile_rows, self.kv_tile_pages
        hbm = local = patched = 0
        for row in positions:
            kv_end = int(row.max()) + 1
            npages, ntiles = -(-kv_end // p), -(-kv_end // s)
            written = {int(x) // p for x in row}
            patched += len(written)
            for lp in range(ntiles * kt):
                if min(lp, npages - 1) in written:
                    local += 1
                else:
                    hbm += 1
        return {"hbm_tile_pages": hbm, "local_tile_pages": local, "patched_pages": patched}

    def hbm_bytes(self, context_lengths: Sequence[int], positions: np.ndarray | None = None) -> int:
        """KV-cache bytes read + written in HBM by one decode step over all layers.

        `context_lengths` [B] are the tokens cached before the step; the new tokens sit at
        positions length .. length + q_len - 1 unless `positions` [B, q] is given. Counts the
        tile pages streamed from HBM, the pages read for patching and the pages written back,
        for K and V, times num_layers. Pages repeated to fill a sequence's last tile are its
        last page, which the step always writes, so they are VMEM copies and cost no HBM."""
        lengths = np.asarray(context_lengths, dtype=np.int64).reshape(self.batch)
        if positions is None:
            positions = lengths[:, None] + np.arange(self.q_len)[None, :]
        c = self.dma_counts(positions)
        pages = c["hbm_tile_pages"] + 2 * c["patched_pages"]
        return 2 * pages * self.page_bytes * self.num_layers


class AttentionScratch(NamedTuple):
    """The stage's scratch refs, in the order of `attention_scratch`."""

    k_tiles: Any  # [kv_buffers, tile_rows, kv_size] cache dtype: streamed K tiles
    v_tiles: Any  # same for V
    k_patch: Any  # [B*q (+1 sink), page_size, kv_size]: page of new token i of seq b (slot b*q+i)
    v_patch: Any
    new_rows: Any  # [2, Bq8, kv_size] f32: k_new / v_new rows, addressable one row at a time
    q_heads: Any  # [B, Hkv, R, D] f32: q regrouped per kv head; overwritten by o per sequence
    m: Any  # [Hkv, R, 128] f32 running max (lane-replicated)
    l: Any  # [Hkv, R, 128] f32 running sum (lane-replicated)
    acc: Any  # [Hkv, R, D] f32 running p.v
    flat: Any  # [Bq8, Hq*D] f32: q as given, later o in the same layout
    seq_meta: Any  # SMEM int32 [B * (2 + q)]: per sequence ntiles, npages, page of each new token
    tile_sems: Any  # DMA semaphores [2 (K, V), kv_buffers]
    patch_sems: Any  # DMA semaphores [2 (read, write), B*q] (one per patch slot)


def attention_scratch(geom: AttentionGeometry) -> list:
    """Scratch shapes for the enclosing pallas_call, in the order attention_stage expects."""
    geom.validate()
    vmem = [pltpu.VMEM(shape, dt) for _, shape, dt in geom.vmem_shapes()]
    return vmem + [
        pltpu.SMEM((geom.batch * (2 + geom.q_len),), jnp.int32),
        pltpu.SemaphoreType.DMA((2, geom.kv_buffers)),
        pltpu.SemaphoreType.DMA((2, geom.tokens)),
    ]


class _Stage:
    """Addressing shared by attention_prefetch and attention_stage (trace-time helper)."""

    def __init__(self, geom, layer, k_cache, v_cache, block_tables, positions, scratch):
        geom.validate()
        self.g, self.layer = geom, layer
        self.block_tables, self.positions = block_tables, positions
        self.sc = AttentionScratch(*scratch)
        self.caches = (k_cache, v_cache)
        self.patches = (self.sc.k_patch, self.sc.v_patch)
        self._tokens = None

    def page_id(self, b, lp):
        pps = self.g.pages_per_seq
        lp = jnp.clip(lp, 0, pps - 1)  # a position past the context must not read SMEM out of bounds
        if len(self.block_tables.shape) == 1:
            return self.block_tables[b * pps + lp]
        return self.block_tables[b, lp]

    def tokens(self):
        """Per new token: (b, i, patch slot, pages of b's tokens, b's positions, page id, first).

        `first` is False when an earlier token of the same sequence is on the same page: that
        token's slot then patches the page with both rows, so each page is written once."""
        if self._tokens is None:
            g, out = self.g, []
            for b in range(g.batch):
                pos = [self.positions[b, i] for i in range(g.q_len)]
                lps = [lax.div(p_, g.page_size) for p_ in pos]
                for i in range(g.q_len):
                    first = True
                    for j in range(i):
                        first = jnp.logical_and(first, lps[j] != lps[i])
                    out.append((b, i, b * g.q_len + i, lps, pos, self.page_id(b, lps[i]), first))
            self._tokens = out
        return self._tokens

    # Control flow around DMAs keeps to the one shape libtpu 0.0.52's static cost profiler
    # accepts: a DMA may be *started* in either arm of a branch, but every wait is
    # unconditional (a wait inside a branch crashes the profiler on TPU7x). So a token whose
    # page an earlier token already patches still starts a DMA of the same size on its slot's
    # semaphore: a local copy from the sink page (read only) into its own private slot, which
    # nothing else reads. One semaphore per slot and direction, because a wait on a semaphore
    # shared by several outstanding DMAs returns when ANY of them lands, not necessarily this one.
    def _patch_copy(self, c, slot, pg, write):
        hbm, vmem = self.caches[c].at[self.layer, pg], self.patches[c].at[slot]
        src, dst = (vmem, hbm) if write else (hbm, vmem)
        return pltpu.make_async_copy(src, dst, self.sc.patch_sems.at[1 if write else 0, slot])

    def _sink_copy(self, c, slot, write):
        sink = self.patches[c].at[self.g.tokens]  # allocated when q_len > 1, the only case used
        return pltpu.make_async_copy(sink, self.patches[c].at[slot],
                                     self.sc.patch_sems.at[1 if write else 0, slot])

    def start_patch_dma(self, slot, pg, first, write):
        def real():
            for c in range(2):
                self._patch_copy(c, slot, pg, write).start()

        def stand_in():
            for c in range(2):
                self._sink_copy(c, slot, write).start()

        if first is True:
            real()
        else:
            pl.when(first)(real)
            pl.when(jnp.logical_not(first))(stand_in)

    def wait_patch_dma(self, slot, pg, write):
        for c in range(2):  # same byte count whichever arm started it
            self._patch_copy(c, slot, pg, write).wait()

    def start_patch_reads(self):
        for _, _, slot, _, _, pg, first in self.tokens():
            self.start_patch_dma(slot, pg, first, write=False)


def attention_prefetch(geom: AttentionGeometry, layer, k_cache, v_cache, block_tables, positions,
                       scratch: Sequence) -> None:
    """Optional early start of the stage's first DMAs: the reads of the pages this layer's step
    patches. They depend only on the layer, the block tables and the positions, so calling
    this before the QKV projection hides one HBM round trip per layer behind it. Then call
    `attention_stage(..., prefetched=True)` for the same layer. Call it only after the previous
    `attention_stage` has returned (it reuses the patch buffers)."""
    _Stage(geom, layer, k_cache, v_cache, block_tables, positions, scratch).start_patch_reads()


def attention_stage(geom: AttentionGeometry, layer, q, k_new, v_new, k_cache, v_cache,
                    block_tables, lengths, positions, scratch: Sequence,
                    prefetched: bool = False) -> jax.Array:
    """One layer of paged GQA attention with the in-place cache update. Call inside a kernel.

    layer: int32 scalar (traced: the megakernel's layer loop index) or Python int.
    q: f32 [B*q_len, Hq*D] (normed, RoPE'd), rows b-major (row = b*q_len + i).
    k_new, v_new: [B*q_len, Hkv*D] in the cache dtype (k normed and RoPE'd).
    k_cache, v_cache: HBM refs (pl.ANY) [num_layers, num_pages, page_size, Hkv*D], aliased
        input -> output of the enclosing pallas_call; layer `layer` is updated in place.
    block_tables: SMEM int32 [B, pages_per_seq] (or flattened [B * pages_per_seq]).
    lengths: SMEM int32 [B], tokens cached before this step.
    positions: SMEM int32 [B, q_len], positions of the new tokens (each < pages_per_seq *
        page_size; a query at p sees cached keys < lengths[b] and new keys, all at <= p).
    scratch: the refs allocated from `attention_scratch(geom)`, in order.
    prefetched: True when `attention_prefetch` already started this layer's patch reads.
    Returns o: f32 [B*q_len, Hq*D]. Every DMA the stage starts (or the prefetch started) has
    been waited when it returns, so nothing is in flight across layers.
    """
    g = geom
    st = _Stage(g, layer, k_cache, v_cache, block_tables, positions, scratch)
    sc = st.sc
    B, T, P, KT, NB = g.batch, g.q_len, g.page_size, g.kv_tile_pages, g.kv_buffers
    Hkv, G, D, S, R = g.num_kv_heads, g.group, g.head_dim, g.tile_rows, g.q_rows
    dt = g.jnp_dtype
    _check_shapes(g, q, k_new, v_new, k_cache, v_cache, block_tables, lengths, positions)
    scale = 1.0 / math.sqrt(D)
    # f32 caches: ask the MXU for full f32 products (the reference contract), not one bf16 pass.
    precision = lax.Precision.HIGHEST if g.dtype == "float32" else None
    tiles, patches = (sc.k_tiles, sc.v_tiles), st.patches

    # ---- 1. Start reading every page this step writes (one DMA per distinct page and cache).
    if not prefetched:
        st.start_patch_reads()

    # ---- 2. While they fly: stage the inputs in VMEM (so single rows and head blocks can be
    # addressed by ref slicing: static unaligned slices of values are not reliably lowerable),
    # regroup q per kv head and tabulate each sequence's extent in SMEM for the tile loop.
    sc.flat[pl.ds(0, g.tokens), :] = q.astype(jnp.float32)
    sc.new_rows[0, pl.ds(0, g.tokens), :] = k_new.astype(jnp.float32)  # exact: k is already dt
    sc.new_rows[1, pl.ds(0, g.tokens), :] = v_new.astype(jnp.float32)
    # Rows (g, i) of q_heads[b, h] = q head h*G + g of token i: one matmul per kv head covers
    # every q head of its group and every new token. Pad rows are zeroed.
    for b in range(B):
        for h in range(Hkv):
            for gi in range(G):
                sc.q_heads[b, h, pl.ds(gi * T, T), :] = sc.flat[pl.ds(b * T, T), pl.ds((h * G + gi) * D, D)]
            if R > G * T:
                sc.q_heads[b, h, pl.ds(G * T, R - G * T), :] = jnp.zeros((R - G * T, D), jnp.float32)
    qrow = lax.broadcasted_iota(jnp.int32, (R, 1), 0)
    token_of_row = jnp.full((R, 1), -1, jnp.int32)  # token index i of each query row
    for gi in range(G):
        for i in range(T):
            token_of_row = jnp.where(qrow == gi * T + i, i, token_of_row)

    meta_width = 2 + T  # seq_meta[b * meta_width + (0: ntiles, 1: npages, 2 + i: page of token i)]
    total = jnp.int32(0)
    for b in range(B):
        pos = [positions[b, i] for i in range(T)]
        kv_end = pos[0]
        for p_ in pos[1:]:
            kv_end = jnp.maximum(kv_end, p_)
        kv_end = kv_end + 1  # keys past the last query position are never attended
        ntiles = lax.div(kv_end + (S - 1), S)
        sc.seq_meta[b * meta_width] = ntiles
        sc.seq_meta[b * meta_width + 1] = lax.div(kv_end + (P - 1), P)
        for i in range(T):
            sc.seq_meta[b * meta_width + 2 + i] = lax.div(pos[i], P)
        total = total + ntiles

    # ---- 3. Patch each page's new rows in (f32 where over a row iota) and start the write-back.
    # Stand-in slots are patched too (branch-free; their contents are never used).
    rows = lax.broadcasted_iota(jnp.int32, (P, 1), 0)
    for b, i, slot, lps, pos, pg, first in st.tokens():
        st.wait_patch_dma(slot, pg, write=False)
        # Row of this page that token j lands on, or -1 when j is on another page.
        hits = [jnp.where(lps[j] == lps[i], pos[j] - lps[j] * P, -1) for j in range(T)]
        for c in range(2):
            page = patches[c][slot].astype(jnp.float32)
            for j in range(T):
                page = jnp.where(rows == hits[j], sc.new_rows[c, pl.ds(b * T + j, 1), :], page)
            patches[c][slot] = page.astype(dt)
        st.start_patch_dma(slot, pg, first, write=True)

    # ---- 4. Stream KV tiles through a kv_buffers-deep ring, all sequences in one flat loop.
    def fetch(b, t, slot):
        """Start the DMAs filling tile slot `slot` with tile t of sequence b."""
        npages = sc.seq_meta[b * meta_width + 1]
        lps = [sc.seq_meta[b * meta_width + 2 + i] for i in range(T)]
        for j in range(KT):
            # Page slots past the sequence's last needed page repeat that page: a valid page id
            # whose rows the position mask drops; no read outside the sequence's own pages.
            lp = jnp.minimum(t * KT + j, npages - 1)
            patched, pslot = False, 0
            for i in reversed(range(T)):  # the first token on this page owns its patched copy
                hit = lps[i] == lp
                pslot = jnp.where(hit, b * T + i, pslot)
                patched = jnp.logical_or(patched, hit)
            dsts = [tiles[c].at[slot, pl.ds(j * P, P)] for c in range(2)]
            sems = [sc.tile_sems.at[c, slot] for c in range(2)]

            @pl.when(patched)
            def _():  # a page this step writes: copy its patched VMEM image, never read HBM
                for c in range(2):
                    pltpu.make_async_copy(patches[c].at[pslot], dsts[c], sems[c]).start()

            @pl.when(jnp.logical_not(patched))
            def _():
                pg = st.page_id(b, lp)
                for c in range(2):
                    pltpu.make_async_copy(st.caches[c].at[layer, pg], dsts[c], sems[c]).start()

    def wait_tile(slot):
        # A DMA wait counts the bytes of its descriptor's destination; both sources of a page
        # (HBM or the patch buffer) move the same bytes, so one descriptor shape waits for either.
        for j in range(KT):
            for c in range(2):
                dst = tiles[c].at[slot, pl.ds(j * P, P)]
                pltpu.make_async_copy(st.caches[c].at[layer, 0], dst, sc.tile_sems.at[c, slot]).wait()

    def compute(b, t, slot):
        # Branch-free on purpose: with the first-tile reset and the last-tile output inside
        # pl.when, libtpu 0.0.52's static profiler ran out of memory on TPU7x (bf16 caches).
        # The selects cost a few vregs per kv head and tile.
        pos = [positions[b, i] for i in range(T)]
        length = lengths[b]
        first_tile, last_tile = t == 0, t == sc.seq_meta[b * meta_width] - 1

        def key_valid(kpos):  # cached (pos < length) or written by this step
            ok = kpos < length
            for p_ in pos:
                ok = jnp.logical_or(ok, kpos == p_)
            return ok

        kpos_lane = t * S + lax.broadcasted_iota(jnp.int32, (1, S), 1)
        kpos_row = t * S + lax.broadcasted_iota(jnp.int32, (S, 1), 0)
        qpos = jnp.full((R, 1), -1, jnp.int32)  # pad rows see nothing
        for i in range(T):
            qpos = jnp.where(token_of_row == i, pos[i], qpos)
        mask = jnp.logical_and(key_valid(kpos_lane), kpos_lane <= qpos)  # [R, S]
        v_ok = key_valid(kpos_row)  # [S, 1]

        # The heads go in phases (every QK^T, then every softmax, then every p.v), not one head
        # at a time: with independent matmuls back to back the MXU need not idle through each
        # head's softmax (libtpu's static profile of one tile, 8 kv heads: 2.6x fewer cycles).
        q_blk = [sc.q_heads[b, h] for h in range(Hkv)]  # [R, D] f32
        scores = [lax.dot_general(q_blk[h].astype(dt), sc.k_tiles[slot, :, pl.ds(h * D, D)],
                                  (((1,), (1,)), ((), ())), precision=precision,
                                  preferred_element_type=jnp.float32) * scale
                  for h in range(Hkv)]  # [R, S]
        probs, stats = [], []
        for h in range(Hkv):
            s = jnp.where(mask, scores[h], MASK_VALUE)
            # A sequence's first tile starts from an empty state (max -inf, sum 0, acc 0).
            m_prev = jnp.where(first_tile, -jnp.inf, sc.m[h])  # [R, 128] lane-replicated
            l_prev = jnp.where(first_tile, 0.0, sc.l[h])
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next[:, :1])
            probs.append(p.astype(dt))
            stats.append((m_next, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha))
        zero_v = jnp.zeros((), dt)
        pvs = [lax.dot_general(probs[h], jnp.where(v_ok, sc.v_tiles[slot, :, pl.ds(h * D, D)], zero_v),
                               (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
               for h in range(Hkv)]  # [R, D]
        for h in range(Hkv):
            m_next, l_next, alpha = stats[h]
            acc_next = jnp.where(first_tile, 0.0, sc.acc[h]) * alpha[:, :1] + pvs[h]
            sc.m[h], sc.l[h], sc.acc[h] = m_next, l_next, acc_next
            # After its last tile a sequence's q block is spent, so o takes its place.
            sc.q_heads[b, h] = jnp.where(last_tile, acc_next / l_next[:, :1], q_blk[h])

    def advance(b, t):
        """The (sequence, tile) step after (b, t); (B, 0) after the last one."""
        wrap = t + 1 >= sc.seq_meta[jnp.minimum(b, B - 1) * meta_width]
        return jnp.where(wrap, b + 1, b), jnp.where(wrap, 0, t + 1)

    zero = jnp.int32(0)
    pb, pt = zero, zero  # prefetch cursor, kv_buffers - 1 steps ahead of the compute cursor
    for k in range(NB - 1):
        pl.when(k < total)(lambda pb=pb, pt=pt, k=k: fetch(pb, pt, k))
        pb, pt = advance(pb, pt)

    def step(gidx, carry):
        b, t, pb, pt = carry
        ahead = gidx + (NB - 1)
        # The slot refilled here was read by step gidx - 1, which has finished computing.
        pl.when(ahead < total)(lambda: fetch(pb, pt, lax.rem(ahead, NB)))
        pb, pt = advance(pb, pt)
        slot = lax.rem(gidx, NB)
        wait_tile(slot)
        compute(b, t, slot)
        b, t = advance(b, t)
        return b, t, pb, pt

    lax.fori_loop(0, total, step, (zero, zero, pb, pt))

    # ---- 5. The write-backs have been in flight during the whole loop; retire them.
    for _, _, slot, _, _, pg, _ in st.tokens():
        st.wait_patch_dma(slot, pg, write=True)

    # ---- 6. Ungroup o back to [B*q, Hq*D] rows (b-major, heads along lanes).
    for b in range(B):
        for h in range(Hkv):
            for gi in range(G):
                sc.flat[pl.ds(b * T, T), pl.ds((h * G + gi) * D, D)] = sc.q_heads[b, h, pl.ds(gi * T, T), :]
    return sc.flat[pl.ds(0, g.tokens), :]


def _check_shapes(g: AttentionGeometry, q, k_new, v_new, k_cache, v_cache, block_tables,
                  lengths, positions) -> None:
    """Trace-time check that the operands match the geometry (a wiring error, not a user one)."""
    expect = {
        "q": (q.shape, (g.tokens, g.q_size)),
        "k_new": (k_new.shape, (g.tokens, g.kv_size)),
        "v_new": (v_new.shape, (g.tokens, g.kv_size)),
        "lengths": (tuple(lengths.shape), (g.batch,)),
        "positions": (tuple(positions.shape), (g.batch, g.q_len)),
    }
    for name, (got, want) in expect.items():
        if tuple(got) != want:
            raise ValueError(f"attention_stage: {name} has shape {tuple(got)}, geometry expects {want}")
    for name, ref in (("k_cache", k_cache), ("v_cache", v_cache)):
        shp = tuple(ref.shape)
        if len(shp) != 4 or shp[0] != g.num_layers or shp[2:] != (g.page_size, g.kv_size):
            raise ValueError(f"attention_stage: {name} has shape {shp}, geometry expects "
                             f"({g.num_layers}, num_pages, {g.page_size}, {g.kv_size})")
        if ref.dtype != g.jnp_dtype:
            raise ValueError(f"attention_stage: {name} dtype {ref.dtype} != geometry dtype {g.dtype}")
    bt = tuple(block_tables.shape)
    if bt not in ((g.batch, g.pages_per_seq), (g.batch * g.pages_per_seq,)):
        raise ValueError(f"attention_stage: block_tables has shape {bt}, geometry expects "
                         f"({g.batch}, {g.pages_per_seq})")
