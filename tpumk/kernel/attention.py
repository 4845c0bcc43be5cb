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
   start them before the QKV projection so their latency hides behind it. In a kernel compiled
   with `collective_id` (many devices) the cache is read only instead and each patched page
   goes to a kernel output (`PageOutputs`), scattered into the cache after the kernel: XLA
   copies the whole of every operand such a kernel aliases, twice a step.
2. Attention. Each sequence streams the KV tiles it needs (up to its largest new position)
   through `kv_buffers` VMEM slots of `kv_tile_pages` pages each, with the DMAs of the next
   `kv_buffers - 1` tiles in flight while a tile is computed. All sequences share one flat
   pipeline (a `fori_loop` over every (sequence, tile) pair), so the prefetch runs across
   sequence boundaries and the pipeline fills once per layer, not once per sequence. In the
   megakernel (no sliding windows) it does not fill per layer either: when a layer's tile loop
   ends, the HBM page DMAs of the next layer's first `kv_buffers - 1` tiles start
   (`prefetch_next`), so they fly during the layer's o projection and FFN.
   Per tile and kv head, ONE matmul covers all `group` q heads and all `q_len` rows; the
   softmax is online (running max and sum in float32). 64-wide heads go two kv heads per
   128-lane block, with a block-diagonal query (`AttentionGeometry`): one matmul per block.
   In a sliding-window layer (`AttentionGeometry.windows`; the layer's window is selected from
   the traced layer index) a sequence's stream starts at the tile of the lowest key some
   query's window holds, and keys with p - k >= window are masked.

Ordering of the in-place writes: a page the step writes is never DMA'd from HBM by the
attention loop. Its tile slot is filled by a local VMEM->VMEM DMA from the patched copy
instead, so the write-back DMAs (waited at the end of the stage) never overlap a read of the
same HBM bytes, and the attention sees the new rows without a write->read round trip. Every
page a step needs is thus read from HBM exactly once and every written page written once.
Requirement this relies on (the host check enforces it, `tpumk.model.positions` item 5): a
page a step writes belongs to one sequence only, and no other sequence reads it in that step
(no two sequences' block tables share a page that this step writes: another sequence would
stream it from HBM while the write-back is in flight).

Control flow is shaped for libtpu 0.0.52's static cost profiler (the tuner's yardstick),
which on TPU7x crashed on a DMA wait inside a branch and ran out of memory on vector work
inside branches of the tile loop: DMAs may be started in branches, every wait is
unconditional, and the tile compute is branch-free.

Numerics (as the reference): scores are q cast to the cache dtype times k with float32
accumulation, scaled by 1/sqrt(head_dim) (then soft-capped, Gemma 2); softmax in float32;
probabilities cast to the cache dtype for p.v with float32 accumulation. The online softmax
casts unnormalised probabilities and divides by the running sum at the end, so float32 caches
agree with the reference to rounding and bfloat16 caches to the bfloat16 rounding of p (see
tests).

Positions outside [0, pages_per_seq * page_size) (the host checks them by default, see
`tpumk.model.positions`; the kernel must not touch another sequence's pages or leave the cache
even when it does not) follow the reference's defined behaviour: such a token's row is patched
into no page (its patch slot takes stand-in DMAs from the sink page, so no page is read or
written back for it), it is no key for any query, the sequence streams only the pages below
max(largest in-range position + 1, min(lengths[b], capacity) when a position is at or past the
capacity, 1) (at least one tile, so the flat tile loop stays aligned with the sequences), and
a query that sees no key at all (a negative position) gets output 0. Cached keys are those
below min(lengths[b], capacity). Page ids are clipped into [0, num_pages) for addressing, so
even a block-table entry outside the pool is never an out-of-bounds DMA; and a token whose
entry is outside the pool writes nothing (the in-kernel guard, which holds whether or not the
host checked): like an out-of-range token its patch slot takes stand-in DMAs, so no page is
read for patching or written back for it, and its sequence reads that logical page from HBM
through the clipped id, as the reference does (`tpumk.model.reference.read_tables`).

Rows of a tile that are not valid keys (past a sequence's last position, gaps, repeated
pages at the end of the last tile) get zero weight, and their V rows are zeroed, so stale or
non-finite bytes in unused cache slots cannot leak into the output (0 * NaN).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.kernel.memory import scratch_shape
from tpumk.model.kv_quant import exponent_values, kv_format, pow2_scales, scales_of
from tpumk.model.reference import soft_cap
from tpumk.plan.geometry import BUFFER_DTYPES, LANE, AttentionGeometry, round_up

# Finite stand-in for -inf in masked scores: exp(MASK - m) underflows to exactly 0 once a row
# has seen one real key, and a fully masked tile cannot produce inf - inf = NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def online_softmax(s, first, m_ref, l_ref):
    """One tile's step of the online softmax over scores `s` [R, T] (one query head's rows):
    the running max and sum from `m_ref` / `l_ref` (an empty state on a sequence's `first`
    tile). Returns the tile's probabilities, the rescale of the old accumulator, and the new
    max and sum (the MLA and sparse stages; the GQA stage runs its head groups and sinks inline)."""
    m_prev = jnp.where(first, -jnp.inf, m_ref[...])
    l_prev = jnp.where(first, 0.0, l_ref[...])
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, :1])
    return p, alpha, m_next, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
# Window of a full-attention layer in a model with sliding layers: larger than any capacity, and
# p - NO_WINDOW stays in int32 for every non-negative position.
NO_WINDOW = 1 << 30


class AttentionScratch(NamedTuple):
    """The stage's scratch refs by name (`AttentionGeometry.scratch` names them; a buffer the
    geometry does not allocate is None)."""

    k_tiles: Any = None  # [kv_buffers, tile_rows, kv_size] cache dtype: streamed K tiles
    v_tiles: Any = None  # same for V
    k_patch: Any = None  # [B*q (+1 sink), page_size, kv_size]: page of new token i of seq b (slot b*q+i)
    v_patch: Any = None
    # a quantized cache (geometry.kv_dtype): ONE packed array (tpumk.model.kv_quant.PagedLayout)
    kv_tiles: Any = None  # [kv_buffers, kv_tile_pages * page_rows, page_lanes] codes dtype
    kv_patch: Any = None  # [B*q (+1 sink), page_rows, page_lanes]
    new_rows: Any = None  # [2, Bq8, kv_size] f32: k_new / v_new rows (quantized: their codes), one row addressable
    q_heads: Any = None  # [B, Hb, Rb, Db] f32: q regrouped per kv head block; overwritten by o per sequence
    m: Any = None  # [Hb, Rb, 128] f32 running max (lane-replicated)
    l: Any = None  # [Hb, Rb, 128] f32 running sum (lane-replicated)
    acc: Any = None  # [Hb, Rb, Db] f32 running p.v
    flat: Any = None  # [Bq8, Hq*D] f32: q as given, later o in the same layout
    seq_meta: Any = None  # SMEM int32 [B * (3 + q)]: per sequence end tile, npages, first tile, page of each new token
    tile_sems: Any = None  # DMA semaphores [caches, kv_buffers, kv_tile_pages]: one per page DMA (see _tile_loop)
    patch_sems: Any = None  # DMA semaphores [2 (read, write), B*q] (one per patch slot)
    new_exps: Any = None  # quantized: [2, Bq8, Hkv] f32, the new rows' exponent bytes (kv_quant.exponent_bytes)


def attention_scratch(geom: AttentionGeometry) -> list:
    """Scratch shapes for the enclosing pallas_call, in the order attention_stage expects
    (`AttentionGeometry.scratch()`, the list the kernel contract and the plan's VMEM count use)."""
    geom.validate()
    return [scratch_shape(b) for b in geom.scratch()]


def traced_window(g: AttentionGeometry, layer):
    """Traced layer `layer`'s sliding window as an int32 scalar (NO_WINDOW for a full layer), or
    None when no layer of the model has one (then there is no window logic at all)."""
    runs = g.window_runs()
    if not runs:
        return None
    w = jnp.int32(NO_WINDOW)
    for first, end, size in runs:  # one compare per run of equal windows
        w = jnp.where(jnp.logical_and(layer >= first, layer < end), jnp.int32(size), w)
    return w


class PageOutputs(NamedTuple):
    """Where the write-backs go when the kernel does not update the cache in place
    (`Plan.cache_written_after_kernel`): the kernel's outputs `pages` (per cache, [B*q, L,
    page]: the patched page of each slot that writes one, layer by layer; a stand-in slot's
    is never written) and `page_ids` (SMEM int32 [B*q]: the page of the cache each slot's
    image goes to, num_pages for none). The decode step scatters them
    into the cache after the kernel (`tpumk.kernel.megakernel.commit_pages`)."""

    pages: tuple
    page_ids: Any


class _Stage:
    """Addressing shared by attention_prefetch and attention_stage (trace-time helper).
    `out`: PageOutputs, or None to write the pages back into the caches in place."""

    def __init__(self, geom, layer, k_cache, v_cache, block_tables, positions, scratch, out: PageOutputs | None = None):
        geom.validate()
        self.g, self.layer, self.out = geom, layer, out
        self.block_tables, self.positions = block_tables, positions
        self.sc = AttentionScratch(**{b.name: ref for b, ref in zip(geom.scratch(), scratch)})
        # The cache arrays moved page by page: K and V, each with its own patch pages and tile
        # slots and the same addressing; a quantized cache is one packed array (v_cache None).
        if geom.quantized:
            self.caches, self.patches, self.tiles = (k_cache,), (self.sc.kv_patch,), (self.sc.kv_tiles,)
        else:
            self.caches = (k_cache, v_cache)
            self.patches, self.tiles = (self.sc.k_patch, self.sc.v_patch), (self.sc.k_tiles, self.sc.v_tiles)
        self.meta_width = 3 + geom.q_len  # seq_meta entries per sequence
        self._tokens = None
        self.window = traced_window(geom, layer)

    @property
    def capacity(self) -> int:
        return self.g.pages_per_seq * self.g.page_size

    def in_range(self, p_):
        """Whether a position is inside the sequence's pages (else its token writes nothing)."""
        return jnp.logical_and(p_ >= 0, p_ < self.capacity)

    def logical_page(self, p_):
        """The logical page of a position, clamped into [0, pages_per_seq) so that SMEM reads
        stay in bounds (out-of-range tokens take stand-in DMAs and never patch that page)."""
        return jnp.clip(lax.div(p_, self.g.page_size), 0, self.g.pages_per_seq - 1)

    def raw_page_id(self, b, lp):
        """Block-table entry of b's logical page `lp` (already in [0, pages_per_seq)), as given."""
        pps = self.g.pages_per_seq
        if len(self.block_tables.shape) == 1:
            return self.block_tables[b * pps + lp]
        return self.block_tables[b, lp]

    def page_id(self, b, lp):
        """Page id of b's logical page `lp`, clipped into [0, num_pages) for addressing only:
        an entry may be -1 or past the pool (the host check refuses the entries a step uses,
        unless skipped), and no DMA may leave the cache. Writes never use a clipped id: a token
        whose entry is outside the pool writes nothing (`writes`)."""
        return jnp.clip(self.raw_page_id(b, lp), 0, self.caches[0].shape[1] - 1)

    def writes(self, b, p_, lp):
        """Whether a token at position p_ on b's logical page lp writes its row: p_ in
        [0, capacity) and the page's block-table entry in [0, num_pages) (the in-kernel guard:
        an entry outside the pool is never clipped onto another sequence's page)."""
        pg = self.raw_page_id(b, lp)
        in_pool = jnp.logical_and(pg >= 0, pg < self.caches[0].shape[1])
        return jnp.logical_and(self.in_range(p_), in_pool)

    def tokens(self):
        """Per new token: (b, i, patch slot, pages of b's tokens, b's positions, page id, first).

        `first` is True only for a writing token (`writes`: in range, its page in the pool) that
        no earlier writing token of the same sequence shares a page with: that token's slot
        reads, patches (with every row of the step on the page) and writes back the page, so
        each page is written once. Every other token (a later one on the same page, or one that
        writes nothing) takes stand-in DMAs from the sink page: no read or write-back of a page
        that may belong to another sequence."""
        if self._tokens is None:
            g, out = self.g, []
            self._writes = []
            for b in range(g.batch):
                pos = [self.positions[b, i] for i in range(g.q_len)]
                lps = [self.logical_page(p_) for p_ in pos]
                ok = [self.writes(b, p_, lp) for p_, lp in zip(pos, lps)]
                self._writes.extend(ok)
                for i in range(g.q_len):
                    first = ok[i]
                    for j in range(i):
                        first = jnp.logical_and(first, jnp.logical_not(jnp.logical_and(ok[j], lps[j] == lps[i])))
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
    def patch_pieces(self):
        """The DMAs one patch page moves, as (cache, lanes): K and V whole; a quantized cache's
        one page as two lane ranges (codes, exponents). Two per arm: libtpu 0.0.52's static
        profiler aborts ("No DMA issue node found for sync flag") when each arm of the
        real / stand-in branch starts ONE DMA on the slot's semaphore (checked on TPU7x)."""
        if not self.g.quantized:
            return [(0, None), (1, None)]
        lay = self.g.kv_layout
        return [(0, (0, lay.codes_lanes)), (0, (lay.codes_lanes, lay.lanes - lay.codes_lanes))]

    def _patch_copy(self, piece, slot, pg, write):
        c, lanes = piece
        if write and self.out is not None:  # the slot's own page of the output (a stand-in writes none)
            hbm = self.out.pages[c].at[slot, self.layer]
        else:
            hbm = self.caches[c].at[self.layer, pg]
        vmem = self.patches[c].at[slot]
        if lanes is not None:
            hbm, vmem = hbm.at[:, pl.ds(*lanes)], vmem.at[:, pl.ds(*lanes)]
        src, dst = (vmem, hbm) if write else (hbm, vmem)
        return pltpu.make_async_copy(src, dst, self.sc.patch_sems.at[1 if write else 0, slot])

    def _sink_copy(self, piece, slot, write):
        c, lanes = piece
        sink = self.patches[c].at[self.g.tokens]  # always allocated (AttentionGeometry.patch_pages)
        dst = self.patches[c].at[slot]
        if lanes is not None:
            sink, dst = sink.at[:, pl.ds(*lanes)], dst.at[:, pl.ds(*lanes)]
        return pltpu.make_async_copy(sink, dst, self.sc.patch_sems.at[1 if write else 0, slot])

    def start_patch_dma(self, slot, pg, first, write):
        def real():
            for piece in self.patch_pieces():
                self._patch_copy(piece, slot, pg, write).start()

        if write and self.out is not None:  # the page the slot's output image goes to (none: num_pages)
            self.out.page_ids[slot] = jnp.where(first, pg, jnp.int32(self.caches[0].shape[1]))

        def stand_in():
            for piece in self.patch_pieces():
                self._sink_copy(piece, slot, write).start()

        pl.when(first)(real)
        pl.when(jnp.logical_not(first))(stand_in)

    def wait_patch_dma(self, slot, pg, write):
        # Per piece the same byte count whichever arm started it; the pieces share the slot's
        # semaphore, and every one is waited before the slot is used.
        for piece in self.patch_pieces():
            self._patch_copy(piece, slot, pg, write).wait()

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
                    prefetched: bool = False, tiles_started: Any = False, prefetch_next: Any = False,
                    sinks: jax.Array | None = None, out: PageOutputs | None = None) -> jax.Array:
    """One layer of paged GQA attention with the in-place cache update. Call inside a kernel.

    layer: int32 scalar (traced: the megakernel's layer loop index) or Python int.
    q: f32 [B*q_len, Hq*D] (normed, RoPE'd), rows b-major (row = b*q_len + i).
    k_new, v_new: [B*q_len, Hkv*D] in the cache dtype (k normed and RoPE'd).
    k_cache, v_cache: HBM refs (pl.ANY) [num_layers, num_pages, page_size, Hkv*D], aliased
        input -> output of the enclosing pallas_call; layer `layer` is updated in place
        (with `out`: read-only inputs, the updated pages go to `out`).
    block_tables: SMEM int32 [B, pages_per_seq] (or flattened [B * pages_per_seq]).
    lengths: SMEM int32 [B], tokens cached before this step.
    positions: SMEM int32 [B, q_len], positions of the new tokens (a query at p sees cached
        keys < lengths[b] and new keys, all at <= p). A position outside [0, pages_per_seq *
        page_size) writes nothing and is no key (see the module docstring); the host checks the
        full contract (`tpumk.model.positions.check_step`).
    scratch: the refs allocated from `attention_scratch(geom)`, in order.
    prefetched: True when `attention_prefetch` already started this layer's patch reads.
    tiles_started: bool or traced bool: the previous layer's stage (`prefetch_next`) already
        started the HBM page DMAs of this layer's first kv_buffers - 1 tile steps; the stage
        then issues only their pages this step writes (copies of the patched images).
    prefetch_next: bool or traced bool: once this layer's tile loop is done, start the HBM page
        DMAs of layer + 1's first kv_buffers - 1 tile steps, so they fly during this layer's
        tail (o projection, FFN / MoE) and the next tile loop starts without a pipeline fill
        (the published kernel issues a layer's KV loads at layer start). Layer + 1's stage must
        then run with tiles_started true, and nothing may touch the KV tile slots in between.
        Only for models without sliding windows (a window moves a layer's first tile).
    sinks: f32 [1, Hq] (geom.sinks, gpt-oss): each q head's sink logit, one more key in its
        softmax denominator whose value is zero (the online softmax starts from it).
    out: PageOutputs: write the patched pages there instead of into k_cache / v_cache, which
        are then read only (a kernel compiled with collective_id, see `PageOutputs`).
    A quantized cache (geom.kv_dtype fp8 / int8): k_cache is the ONE packed array [num_layers,
        num_pages, page_rows, page_lanes] (`tpumk.model.kv_quant.PagedLayout`: kv_group tokens'
        K and V codes per row, then their scale exponents), v_cache None. The new rows are
        quantized per (row, kv head) before they are patched in; each streamed tile's codes go
        to the model dtype per token group and head block, and each key's power-of-two scale
        multiplies its score (K) and its probability (V): bit for bit the products of the
        reference's dequantized rows (`_tile_loop`'s row_scales).
    Returns o: f32 [B*q_len, Hq*D]. Every DMA the stage starts (or the prefetch started) has
    been waited when it returns, except the next layer's first tile DMAs under prefetch_next.

    The phases, in order (each a function below):
    1. `_start_cache_reads`: read every page this step writes (cache update, part 1);
    2. `_stage_rows`, `_regroup_q`, `_tabulate_sequences`, `_softmax_start`: while they fly,
       stage the inputs in VMEM, regroup q per kv head, tabulate each sequence's extent in SMEM,
       and set each query row's softmax start (its sink, with attention sinks);
    3. `_patch_pages`: patch the new rows into the pages and start their write-back;
    4. `_tile_loop`: stream the KV tiles, all sequences in one flat loop, online softmax;
    5. `_retire_write_backs`: wait for the write-backs (cache update, part 2);
    6. `_ungroup_o`: o back to [B*q_len, Hq*D].
    """
    st = _Stage(geom, layer, k_cache, v_cache, block_tables, positions, scratch, out)
    _check_shapes(geom, q, k_new, v_new, k_cache, v_cache, block_tables, lengths, positions)
    if st.window is not None and (tiles_started is not False or prefetch_next is not False):
        raise ValueError("attention_stage: tiles_started / prefetch_next need a model without sliding windows "
                         "(a window moves each layer's first tile)")
    if not prefetched:
        _start_cache_reads(st)
    _stage_rows(st, q, k_new, v_new)
    token_of_row = _regroup_q(st)
    total = _tabulate_sequences(st, lengths)
    _patch_pages(st)
    if geom.sinks != (sinks is not None):
        raise ValueError(f"attention_stage: the geometry says sinks={geom.sinks}, the call passes "
                         f"{'a' if sinks is not None else 'no'} sinks row")
    start = _softmax_start(st, sinks)
    _tile_loop(st, lengths, token_of_row, total, tiles_started, prefetch_next, start)
    _retire_write_backs(st)
    return _ungroup_o(st)


def _start_cache_reads(st: _Stage) -> None:
    """Phase 1: start reading every page this step writes (one DMA per distinct page and cache,
    stand-in DMAs for the rest, see `_Stage.tokens`) into the patch slots."""
    st.start_patch_reads()


def _stage_rows(st: _Stage, q, k_new, v_new) -> None:
    """Phase 2a: stage q and the new K/V rows in VMEM, so single rows and head blocks can be
    addressed by ref slicing (static unaligned slices of values are not reliably lowerable).

    flat[:B*q_len] = q [B*q_len, Hq*D] f32; new_rows[0 | 1, :B*q_len] = k_new | v_new in f32
    (exact: they are already in the model dtype), or in a quantized cache their codes (as f32,
    exact) with their exponent bytes in new_exps (`_quantize_rows`)."""
    g, sc = st.g, st.sc
    sc.flat[pl.ds(0, g.tokens), :] = q.astype(jnp.float32)
    for c, rows in enumerate((k_new, v_new)):
        rows = rows.astype(jnp.float32)  # exact: the rows are already in the model dtype
        if g.quantized:
            rows, sc.new_exps[c, pl.ds(0, g.tokens), :] = _quantize_rows(g, rows)
        sc.new_rows[c, pl.ds(0, g.tokens), :] = rows


def _quantize_rows(g: AttentionGeometry, x):
    """x [rows, Hkv*D] f32 -> (codes [rows, Hkv*D] as f32 values, exponent bytes [rows, Hkv] as
    f32 values), as `tpumk.model.kv_quant.quantize_rows` and `exponent_bytes` compute them (its
    `pow2_scales` itself, so the codes match bit for bit): per (row, kv head) a power-of-two
    scale from max|x|, code = x times its exact reciprocal, for int8 rounded to nearest even and
    clipped; fp8 codes are rounded by the cast when the page is stored. Heads are lane ranges of
    the row, reduced under a lane mask (64-wide heads share a 128-lane block)."""
    fmt = kv_format(g.kv_dtype)
    lane = lax.broadcasted_iota(jnp.int32, (1, g.kv_size), 1)
    head_lane = lax.broadcasted_iota(jnp.int32, (1, g.num_kv_heads), 1)
    multiplier = jnp.ones(x.shape, jnp.float32)
    exps = jnp.zeros((x.shape[0], g.num_kv_heads), jnp.float32)
    for h in range(g.num_kv_heads):
        in_head = jnp.logical_and(lane >= h * g.head_dim, lane < (h + 1) * g.head_dim)
        scale, inverse = pow2_scales(jnp.max(jnp.where(in_head, jnp.abs(x), 0.0), axis=1, keepdims=True), fmt)
        multiplier = jnp.where(in_head, inverse, multiplier)
        exps = jnp.where(head_lane == h, exponent_values(scale).astype(jnp.float32), exps)
    codes = x * multiplier
    if fmt.name == "int8":
        codes = jnp.clip(jnp.round(codes), -fmt.qmax, fmt.qmax)
    return codes, exps


def _tile_scales(g: AttentionGeometry, tile_ref, slot):
    """The float32 scales of a quantized tile slot [rows, exponent lanes] (kv_quant.scales_of)."""
    lay = g.kv_layout
    return scales_of(_as_bytes(g, tile_ref[slot, :, pl.ds(lay.codes_lanes, lay.lanes - lay.codes_lanes)]))


def _lanes_as_rows(cols, first: int, n: int):
    """cols [S, L] f32 -> [n, S]: row r is lane first + r of cols. One one-hot matmul (exact for
    finite values: ones times powers of two) turns a tile's per-key columns into rows over its
    keys, since a key's scale multiplies a lane of the scores and of the probabilities. Lanes
    outside first .. first + n - 1 must hold finite values (0 x inf is NaN)."""
    lanes = cols.shape[1]
    onehot = (lax.broadcasted_iota(jnp.int32, (n, lanes), 0) + first
              == lax.broadcasted_iota(jnp.int32, (n, lanes), 1)).astype(jnp.float32)
    return lax.dot_general(onehot, cols, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _as_bytes(g: AttentionGeometry, x):
    """1-byte cache values (fp8 or int8) -> their bytes as int32 (-128 .. 127). A bitcast, which
    libtpu 0.0.52's static profiler accepts (it aborts on a float32 -> fp8 cast)."""
    if g.cache_dtype != "int8":
        x = lax.bitcast_convert_type(x, jnp.int8)
    return x.astype(jnp.int32)


def _from_bytes(g: AttentionGeometry, b):
    """The inverse of `_as_bytes`."""
    b = b.astype(jnp.int8)
    return b if g.cache_dtype == "int8" else lax.bitcast_convert_type(b, BUFFER_DTYPES[g.cache_dtype])


def _code_bytes(g: AttentionGeometry, codes):
    """Code values (float32, exact integers for int8; |x| <= 448 for fp8) -> their bytes as
    int32. fp8: float8_e4m3fn's encoding computed on the float32 bits (round to nearest even,
    subnormals below 2^-6), because the static profiler aborts on the cast itself; the same
    bytes as the reference's cast (tests/test_attention_kv_quant.py compares every byte)."""
    if g.cache_dtype == "int8":
        return codes.astype(jnp.int32)
    bits = lax.bitcast_convert_type(codes, jnp.int32)
    sign = lax.shift_left(lax.shift_right_logical(bits, jnp.int32(31)), jnp.int32(7))
    mag = jnp.bitwise_and(bits, jnp.int32(0x7FFFFFFF))
    # drop 20 of the 23 mantissa bits, rounding to nearest even (a carry moves into the exponent)
    rounded = mag + 0x7FFFF + jnp.bitwise_and(lax.shift_right_logical(mag, jnp.int32(20)), 1)
    normal = lax.shift_right_logical(rounded, jnp.int32(20)) - ((127 - 7) << 3)  # rebias 127 -> 7
    subnormal = jnp.round(jnp.abs(codes) * 512.0).astype(jnp.int32)  # k * 2^-9; k = 8 is 2^-6's code
    code = jnp.bitwise_or(jnp.where(jnp.abs(codes) < 2.0 ** -6, subnormal, normal), sign)  # 0 .. 255
    return jnp.where(code >= 128, code - 256, code)


def _regroup_q(st: _Stage):
    """Phase 2b: regroup q per kv head block, so ONE matmul per block and tile covers every q
    head of its group(s) and every new token.

    One kv head per block (head_dim a multiple of 128): row gi*q_len + i of q_heads[b, h] = q
    head h*group + gi of token i of sequence b. Two 64-wide kv heads per block (block j, head
    p of it, h = 2j + p): row p*q_rows + gi*q_len + i holds that q head in lanes p*64 .. p*64+63
    and zeros in the other half (the block-diagonal query, AttentionGeometry). Pad rows are
    zero. Returns token_of_row [Rb, 1] int32: the token index i each query row holds (-1 for
    pad rows)."""
    g, sc = st.g, st.sc
    B, T, G, D, R = g.batch, g.q_len, g.group, g.head_dim, g.q_rows
    pack, NBK, BR = g.heads_per_block, g.head_blocks, g.block_rows
    if pack == 1:
        for b in range(B):
            for h in range(NBK):
                for gi in range(G):
                    sc.q_heads[b, h, pl.ds(gi * T, T), :] = sc.flat[pl.ds(b * T, T), pl.ds((h * G + gi) * D, D)]
                if R > G * T:
                    sc.q_heads[b, h, pl.ds(G * T, R - G * T), :] = jnp.zeros((R - G * T, D), jnp.float32)
    else:
        # A q head's 64 lanes are read as the 128-lane block holding them (no unaligned lane
        # slices), moved to the block's half p by a half-block roll when they sit in the other
        # half (a roll by 64 of 128 lanes swaps the halves either way round), the rest zeroed.
        half = lax.div(lax.broadcasted_iota(jnp.int32, (1, LANE), 1), D)  # lax: no jnp sign lowering
        for b in range(B):
            for j in range(NBK):
                sc.q_heads[b, j] = jnp.zeros((BR, LANE), jnp.float32)
                for p_ in range(pack):
                    for gi in range(G):
                        qh = (j * pack + p_) * G + gi
                        src = sc.flat[pl.ds(b * T, T), pl.ds((qh // pack) * LANE, LANE)]
                        if qh % pack != p_:
                            src = pltpu.roll(src, D, 1)
                        sc.q_heads[b, j, pl.ds(p_ * R + gi * T, T), :] = jnp.where(half == p_, src, 0.0)
    qrow = lax.broadcasted_iota(jnp.int32, (BR, 1), 0)
    token_of_row = jnp.full((BR, 1), -1, jnp.int32)  # token index i of each query row
    for p_ in range(pack):
        for gi in range(G):
            for i in range(T):
                token_of_row = jnp.where(qrow == p_ * R + gi * T + i, i, token_of_row)
    return token_of_row


def _tabulate_sequences(st: _Stage, lengths):
    """Phase 2c: each sequence's extent, in SMEM for the tile loop. Returns the total number of
    (sequence, tile) steps (a traced int32).

    seq_meta[b * (3 + q_len) + k]: k = 0 the sequence's end tile (its tiles are first .. end - 1),
    1 its pages, 2 its first tile, 3 + i the logical page of new token i, or -1 when that token
    writes nothing (outside [0, capacity), or its page outside the pool: it patches no page, so
    no tile page takes its stand-in slot; the tile reads that page from HBM).

    The first tile is 0, or in a sliding-window layer the tile of the lowest key some query's
    window holds: min over non-negative positions p of max(p - window + 1, 0), at most
    kv_end - 1 (tiles wholly below every query's window are never read).

    The extent is kv_end = max(largest in-range position + 1, min(lengths[b], capacity) if a
    position is at or past the capacity (its query sees every cached key), 1) rows: keys past
    the last query are never attended, a sequence always streams at least one tile (the flat
    loop's cursor assumes it), and it streams only pages it really uses (a bad position does
    not make it read the unused tail of its block table, which may be -1, past the pool or
    another sequence's page)."""
    g, sc = st.g, st.sc
    B, T, P, S = g.batch, g.q_len, g.page_size, g.tile_rows
    positions = st.positions
    meta_width = st.meta_width
    tokens = st.tokens()
    total = jnp.int32(0)
    for b in range(B):
        pos = [positions[b, i] for i in range(T)]
        length = jnp.clip(lengths[b], 0, st.capacity)
        kv_end = jnp.int32(1)
        for p_ in pos:
            end = jnp.where(st.in_range(p_), p_ + 1, jnp.where(p_ >= st.capacity, length, 0))
            kv_end = jnp.maximum(kv_end, end)
        ntiles = lax.div(kv_end + (S - 1), S)
        first = jnp.int32(0)
        if st.window is not None:
            lo = kv_end - 1
            for p_ in pos:
                lo = jnp.minimum(lo, jnp.where(p_ >= 0, jnp.maximum(p_ - st.window + 1, 0), lo))
            first = lax.div(lo, S)
        sc.seq_meta[b * meta_width] = ntiles
        sc.seq_meta[b * meta_width + 1] = lax.div(kv_end + (P - 1), P)
        sc.seq_meta[b * meta_width + 2] = first
        for i in range(T):
            sc.seq_meta[b * meta_width + 3 + i] = jnp.where(st._writes[b * T + i], tokens[b * T + i][3][i], -1)
        total = total + ntiles - first
    return total


def _patch_pages(st: _Stage) -> None:
    """Phase 3: once each page's read lands, replace its new rows (f32 `where` over a row iota:
    a one-row DMA at an arbitrary slot does not compile) and start writing the page back.

    Stand-in slots are patched too (branch-free; their contents are never used)."""
    g, sc = st.g, st.sc
    T, P = g.q_len, g.page_size
    dt = g.jnp_dtype
    patches = st.patches
    rows = lax.broadcasted_iota(jnp.int32, (P, 1), 0)
    for b, i, slot, lps, pos, pg, first in st.tokens():
        st.wait_patch_dma(slot, pg, write=False)
        hits = _page_slots(st, i, lps, pos)
        if g.quantized:
            _patch_packed_page(st, b, slot, hits)
        else:
            for c in range(2):
                page = patches[c][slot].astype(jnp.float32)
                for j in range(T):
                    page = jnp.where(rows == hits[j], sc.new_rows[c, pl.ds(b * T + j, 1), :], page)
                patches[c][slot] = page.astype(dt)
        st.start_patch_dma(slot, pg, first, write=True)


def _page_slots(st: _Stage, i, lps, pos):
    """Per new token j of the sequence: the slot of token i's page it lands on, or -1 when j is
    on another page or out of range."""
    P = st.g.page_size
    return [jnp.where(jnp.logical_and(lps[j] == lps[i], st.in_range(pos[j])), pos[j] - lps[j] * P, -1)
            for j in range(st.g.q_len)]


def _patch_packed_page(st: _Stage, b: int, slot: int, hits) -> None:
    """`_patch_pages` for a quantized page (`kv_quant.PagedLayout`), in its bytes (as int32):
    token j's slot s = hits[j] is row s // G, group position s % G; its K and V code bytes go
    to that group's code lanes of the row, its exponent bytes to that group's exponent lanes."""
    g, sc = st.g, st.sc
    G, C, H, T = g.kv_group, g.kv_size, g.num_kv_heads, g.q_len
    lay = g.kv_layout
    lane = lax.broadcasted_iota(jnp.int32, (1, g.page_lanes), 1)
    rows = lax.broadcasted_iota(jnp.int32, (g.page_rows, 1), 0)
    head_lane = lax.broadcasted_iota(jnp.int32, (1, H), 1)
    exp_lane = lax.broadcasted_iota(jnp.int32, (1, g.page_lanes - lay.codes_lanes), 1)
    page = _as_bytes(g, st.patches[0][slot])
    for j in range(T):
        codes = [_code_bytes(g, sc.new_rows[c, pl.ds(b * T + j, 1), :]) for c in range(2)]  # [1, C] each
        exps = [sc.new_exps[c, pl.ds(b * T + j, 1), :] for c in range(2)]  # [1, H] f32 exponent bytes
        row = jnp.where(hits[j] >= 0, lax.div(jnp.maximum(hits[j], 0), G), -1)
        grp = lax.rem(jnp.maximum(hits[j], 0), G)
        for gp in range(G):  # the row piece of group position gp, selected when grp == gp
            block = jnp.zeros((1, g.page_lanes - lay.codes_lanes), jnp.int32)
            for c in range(2):
                for h in range(H):  # this byte's value as a [1, 1] (a masked lane sum, exact)
                    e = jnp.sum(jnp.where(head_lane == h, exps[c], 0.0), axis=1, keepdims=True).astype(jnp.int32)
                    block = jnp.where(exp_lane == (gp * 2 + c) * H + h, e, block)
            pieces = ([jnp.zeros((1, gp * 2 * C), jnp.int32)] if gp else []) + codes \
                + ([jnp.zeros((1, (G - gp - 1) * 2 * C), jnp.int32)] if gp < G - 1 else []) + [block]
            mine = jnp.logical_or(jnp.logical_and(lane >= gp * 2 * C, lane < (gp + 1) * 2 * C),
                                  jnp.logical_and(lane >= lay.codes_lanes + gp * 2 * H,
                                                  lane < lay.codes_lanes + (gp + 1) * 2 * H))
            at = jnp.logical_and(rows == jnp.where(grp == gp, row, -1), mine)
            page = jnp.where(at, jnp.concatenate(pieces, axis=1), page)
    st.patches[0][slot] = _from_bytes(g, page)


def _softmax_start(st: _Stage, sinks) -> list[tuple[Any, Any]]:
    """Phase 2d: each head block's online-softmax state before its first key, (max, sum) per
    query row [Rb, 128] lane-replicated: (-inf, 0), or with sinks (gpt-oss) (sink, 1), the
    sink being one more key whose value is zero (exp(sink - sink) = 1 in the sum, nothing in
    acc), so a row's rescaling by later maxima keeps it exactly as the reference's softmax
    over [scores, sink]. Rows map to q heads as `_regroup_q` stacked them; pad rows take 0."""
    g = st.g
    BR, R, T, G = g.block_rows, g.q_rows, g.q_len, g.group
    if sinks is None:
        return [(-jnp.inf, 0.0)] * g.head_blocks
    qrow = lax.broadcasted_iota(jnp.int32, (BR, LANE), 0)
    lane = lax.broadcasted_iota(jnp.int32, (1, sinks.shape[1]), 1)
    out = []
    for j in range(g.head_blocks):
        col = jnp.zeros((BR, LANE), jnp.float32)
        for p_ in range(g.heads_per_block):
            for gi in range(G):
                qh = (j * g.heads_per_block + p_) * G + gi
                # lane qh of the row as a [1, 1] value: a masked lane sum (no unaligned lane slice)
                v = jnp.sum(jnp.where(lane == qh, sinks, 0.0), axis=1, keepdims=True)
                lo = p_ * R + gi * T
                col = jnp.where((qrow >= lo) & (qrow < lo + T), v, col)
        out.append((col, 1.0))
    return out


def _tile_loop(st: _Stage, lengths, token_of_row, total, tiles_started, prefetch_next, start) -> None:
    """Phase 4: stream KV tiles through a kv_buffers-deep ring, all sequences in one flat
    `fori_loop` over the `total` (sequence, tile) steps, kv_buffers - 1 tiles in flight.
    `tiles_started` / `prefetch_next`: see `attention_stage` (the first kv_buffers - 1 steps'
    HBM page DMAs come from the previous layer's stage / are started for the next layer's).

    A tile page this step writes is copied from its patched VMEM image (never read from HBM,
    so it cannot race the write-back). Per tile and kv head, one matmul covers the whole
    query block; online softmax in f32 into m / l / acc; after a sequence's last tile its
    q_heads block holds o (acc / l). `start`: each head block's (max, sum) before its first key
    (`_softmax_start`)."""
    g, sc, layer, positions = st.g, st.sc, st.layer, st.positions
    B, T, KT, NB = g.batch, g.q_len, g.kv_tile_pages, g.kv_buffers
    D, S = g.head_dim, g.tile_rows
    NBK, BL, BR = g.head_blocks, g.block_lanes, g.block_rows
    dt = g.jnp_dtype
    scale = 1.0 / math.sqrt(g.score_dim or D)  # a lane-padded head's true width, or attn_scalar
    # f32 caches: ask the MXU for full f32 products (the reference contract), not one bf16 pass.
    precision = lax.Precision.HIGHEST if g.dtype == "float32" else None
    tiles, patches, channels = st.tiles, st.patches, len(st.caches)
    PR = g.page_rows  # rows of one page in a tile slot (a quantized page packs kv_group tokens per row)
    meta_width = st.meta_width

    def first_of(b):
        """Sequence b's first tile: a static 0 unless some layer slides (with the SMEM reads
        in the tile loop, libtpu 0.0.52's static profiler aborts on an LLO check for some
        many-device builds; models without windows keep the old loop)."""
        return sc.seq_meta[b * meta_width + 2] if st.window is not None else jnp.int32(0)

    def fetch(b, t, slot, layer_=layer, hbm: Any = True, local: bool = True):
        """Start the DMAs filling tile slot `slot` with tile t of sequence b of layer `layer_`:
        the pages this step writes from their patched images (`local`), the others from HBM
        (`hbm`: a bool or a traced bool)."""
        npages = sc.seq_meta[b * meta_width + 1]
        lps = [sc.seq_meta[b * meta_width + 3 + i] for i in range(T)]
        for j in range(KT):
            # Page slots past the sequence's last needed page repeat that page: a valid page id
            # whose rows the position mask drops; no read outside the sequence's own pages.
            lp = jnp.minimum(t * KT + j, npages - 1)
            patched, pslot = False, 0
            for i in reversed(range(T)):  # the first token on this page owns its patched copy
                hit = lps[i] == lp
                pslot = jnp.where(hit, b * T + i, pslot)
                patched = jnp.logical_or(patched, hit)
            dsts = [tiles[c].at[slot, pl.ds(j * PR, PR)] for c in range(channels)]
            sems = [sc.tile_sems.at[c, slot, j] for c in range(channels)]

            if local:
                @pl.when(patched)
                def _():  # a page this step writes: copy its patched VMEM image, never read HBM
                    for c in range(channels):
                        pltpu.make_async_copy(patches[c].at[pslot], dsts[c], sems[c]).start()

            if hbm is not False:
                @pl.when(jnp.logical_not(patched) if hbm is True else jnp.logical_and(hbm, jnp.logical_not(patched)))
                def _():
                    pg = st.page_id(b, lp)
                    for c in range(channels):
                        pltpu.make_async_copy(st.caches[c].at[layer_, pg], dsts[c], sems[c]).start()

    def wait_tile(slot):
        # One semaphore per page DMA: the compiler's DMA model serializes the DMAs that signal one
        # semaphore and overlaps those on different ones (benchmarks/dma_probe.py, BENCHMARKS.md).
        # A DMA wait counts the bytes of its descriptor's destination; both sources of a page
        # (HBM or the patch buffer) move the same bytes, so one descriptor shape waits for either.
        for j in range(KT):
            for c in range(channels):
                dst = tiles[c].at[slot, pl.ds(j * PR, PR)]
                pltpu.make_async_copy(st.caches[c].at[layer, 0], dst, sc.tile_sems.at[c, slot, j]).wait()

    # A quantized cache packs G = kv_group tokens per tile row (PagedLayout): tile row rho holds
    # tokens G*rho .. G*rho + G - 1 of the tile, so each group position grp is its own [RS, ..]
    # block of keys (key t*S + G*rho + grp), with its own matmuls. A model-dtype cache: G = 1.
    G, RS = g.kv_group, KT * g.page_rows

    def kv_block(c, slot, grp, h):
        """Head block h of the K (c = 0) or V (1) keys of group position grp in tile slot
        `slot`, [RS, BL] in the model dtype: the tile itself, or a quantized tile's codes (exact
        in bfloat16: 8-bit integers, or fp8's 3 mantissa bits); their scales are applied by
        `row_scales` instead."""
        if not g.quantized:
            return tiles[c][slot, :, pl.ds(h * BL, BL)]
        return tiles[0][slot, :, pl.ds((grp * 2 + c) * g.kv_size + h * BL, BL)].astype(dt)

    def scale_rows(slot):
        """A quantized tile's scales as rows over its keys: [(grp * 2 + c) * Hkv + head, RS] f32
        (the tile holds them as columns: one exponent lane per group, tensor and head; its pad
        lanes are zero bytes, finite scales)."""
        return _lanes_as_rows(_tile_scales(g, tiles[0], slot), 0, round_up(2 * G * g.num_kv_heads, 8))

    def row_scales(rows_all, c, grp, h):
        """[Rb, RS] (or [1, RS]): each query row's scale of every key of group grp, tensor c, for
        the kv head(s) of block h (a block of two 64-wide heads: each row its own head's).
        Because a power of two commutes with every rounding, (q . codes) * scale equals q . (codes
        * scale) bit for bit, and (p * scale) . codes equals p . (codes * scale) (the reference's
        dequantized rows), barring underflow."""
        idx = lax.broadcasted_iota(jnp.int32, (rows_all.shape[0], 1), 0)
        heads = []
        for p_ in range(g.heads_per_block):  # a row of the matrix: a masked sublane sum, exact
            r = (grp * 2 + c) * g.num_kv_heads + h * g.heads_per_block + p_
            heads.append(jnp.sum(jnp.where(idx == r, rows_all, 0.0), axis=0, keepdims=True))
        if len(heads) == 1:
            return heads[0]
        qrow = lax.broadcasted_iota(jnp.int32, (BR, 1), 0)
        return jnp.where(qrow < g.q_rows, heads[0], heads[1])  # _regroup_q: head p's rows from p * q_rows

    def compute(b, t, slot):
        # Branch-free on purpose: with the first-tile reset and the last-tile output inside
        # pl.when, libtpu 0.0.52's static profiler ran out of memory on TPU7x (bf16 caches).
        # The selects cost a few vregs per kv head and tile.
        pos = [positions[b, i] for i in range(T)]
        length = jnp.minimum(lengths[b], st.capacity)
        first_tile, last_tile = t == first_of(b), t == sc.seq_meta[b * meta_width] - 1
        # Out-of-range positions are written nowhere, so they are no key (-1 matches no row).
        new_pos = [jnp.where(st.in_range(p_), p_, -1) for p_ in pos]

        def key_valid(kpos):  # cached (pos < length) or written by this step
            ok = kpos < length
            for p_ in new_pos:
                ok = jnp.logical_or(ok, kpos == p_)
            return ok

        qpos = jnp.full((BR, 1), -1, jnp.int32)  # pad rows see nothing
        for i in range(T):
            qpos = jnp.where(token_of_row == i, pos[i], qpos)
        if g.bidirectional:  # a drafter's block: a query also sees the step's later keys
            first_new = functools.reduce(jnp.minimum, [jnp.where(p_ >= 0, p_, NO_WINDOW) for p_ in new_pos])
        masks, v_oks = [], []
        for grp in range(G):
            kpos_lane = t * S + G * lax.broadcasted_iota(jnp.int32, (1, RS), 1) + grp
            kpos_row = t * S + G * lax.broadcasted_iota(jnp.int32, (RS, 1), 0) + grp
            seen = kpos_lane <= qpos
            if g.bidirectional:
                seen = jnp.logical_or(seen, jnp.logical_and(kpos_lane >= first_new, qpos >= 0))
            mask = jnp.logical_and(key_valid(kpos_lane), seen)  # [Rb, RS]
            if st.window is not None:  # sliding layer: keys k with p - k < window only
                mask = jnp.logical_and(mask, kpos_lane > qpos - st.window)
            masks.append(mask)
            v_oks.append(key_valid(kpos_row))  # [RS, 1]
        rows_all = scale_rows(slot) if g.quantized else None

        def scaled(x, c, grp, h):  # x [Rb, RS] times each key's scale (a quantized cache only)
            return x if rows_all is None else x * row_scales(rows_all, c, grp, h)

        # The heads go in phases (every QK^T, then every softmax, then every p.v), not one head
        # at a time: with independent matmuls back to back the MXU need not idle through each
        # head's softmax (libtpu's static profile of one tile, 8 kv heads: 2.6x fewer cycles).
        # One block is one kv head, or two 64-wide ones (block-diagonal q: each row's scores
        # are its own head's; of p.V each head's rows keep their own lane half).
        q_blk = [sc.q_heads[b, h] for h in range(NBK)]  # [Rb, Db] f32
        scores = [[soft_cap(scaled(lax.dot_general(q_blk[h].astype(dt), kv_block(0, slot, grp, h),
                                                   (((1,), (1,)), ((), ())), precision=precision,
                                                   preferred_element_type=jnp.float32), 0, grp, h) * scale, g.softcap)
                   for grp in range(G)] for h in range(NBK)]  # [Rb, RS] per group
        probs, stats = [], []
        for h in range(NBK):
            ss = [jnp.where(masks[grp], scores[h][grp], MASK_VALUE) for grp in range(G)]
            # A sequence's first tile starts from an empty state (max -inf, sum 0, acc 0), or
            # with sinks from the sink alone (max sink, sum 1, acc 0).
            m_prev = jnp.where(first_tile, start[h][0], sc.m[h])  # [R, 128] lane-replicated
            l_prev = jnp.where(first_tile, start[h][1], sc.l[h])
            m_next = m_prev
            for s_ in ss:
                m_next = jnp.maximum(m_next, jnp.max(s_, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            ps = [jnp.exp(s_ - m_next[:, :1]) for s_ in ss]
            probs.append([scaled(p, 1, grp, h).astype(dt) for grp, p in enumerate(ps)])
            total_p = jnp.sum(ps[0], axis=1, keepdims=True)
            for p in ps[1:]:
                total_p = total_p + jnp.sum(p, axis=1, keepdims=True)
            stats.append((m_next, alpha * l_prev + total_p, alpha))
        zero_v = jnp.zeros((), dt)
        pvs = []
        for h in range(NBK):
            pv = None
            for grp in range(G):
                part = lax.dot_general(probs[h][grp], jnp.where(v_oks[grp], kv_block(1, slot, grp, h), zero_v),
                                       (((1,), (0,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)  # [Rb, Db]
                pv = part if pv is None else pv + part
            pvs.append(pv)
        for h in range(NBK):
            m_next, l_next, alpha = stats[h]
            acc_next = jnp.where(first_tile, 0.0, sc.acc[h]) * alpha[:, :1] + pvs[h]
            sc.m[h], sc.l[h], sc.acc[h] = m_next, l_next, acc_next
            # After its last tile a sequence's q block is spent, so o takes its place. A row that
            # saw no key (max still the mask value: a negative position, or a pad row) gets 0.
            o = jnp.where(m_next[:, :1] <= 0.5 * MASK_VALUE, 0.0, acc_next / l_next[:, :1])  # NaN stays NaN
            sc.q_heads[b, h] = jnp.where(last_tile, o, q_blk[h])

    # A step's pages this step writes come from the patch images, ready only in this stage: the
    # previous layer's stage started the others' DMAs of the first steps when tiles_started.
    prologue = fetch if tiles_started is False else \
        (lambda b, t, slot: fetch(b, t, slot, hbm=jnp.logical_not(tiles_started)))
    run_tile_pipeline(sc.seq_meta, meta_width, B, NB, total, first_of, fetch, wait_tile, compute, prologue)
    if prefetch_next is not False:
        # The loop has waited every tile and computed the last: all slots are free. The next
        # layer's first steps are this layer's (no windows: same extents, same seq_meta).
        nxt = jnp.minimum(layer + 1, g.num_layers - 1)
        later = lambda b, t, slot: fetch(b, t, slot, layer_=nxt, local=False)  # noqa: E731

        @pl.when(prefetch_next)
        def _():
            issue_ahead(sc.seq_meta, meta_width, B, NB, total, first_of, later)


def _advance(seq_meta, meta_width: int, batch: int, first_of):
    """The flat pipeline's cursor step: (b, t) -> the (sequence, tile) step after it; after the
    last one (batch, first tile of the last)."""
    B = batch

    def advance(b, t):
        wrap = t + 1 >= seq_meta[jnp.minimum(b, B - 1) * meta_width]
        first_next = first_of(jnp.minimum(b + 1, B - 1))
        return jnp.where(wrap, b + 1, b), jnp.where(wrap, first_next, t + 1)
    return advance


def issue_ahead(seq_meta, meta_width: int, batch: int, buffers: int, total, first_of, fetch):
    """Start the first `buffers - 1` steps' tile loads into slots 0 .. buffers - 2 (the
    pipeline's fill). Returns the prefetch cursor after them."""
    advance = _advance(seq_meta, meta_width, batch, first_of)
    pb, pt = jnp.int32(0), first_of(0)  # sequence 0's first tile
    for k in range(buffers - 1):
        pl.when(k < total)(lambda pb=pb, pt=pt, k=k: fetch(pb, pt, k))
        pb, pt = advance(pb, pt)
    return pb, pt


def run_tile_pipeline(seq_meta, meta_width: int, batch: int, buffers: int, total, first_of,
                      fetch, wait_tile, compute, prologue_fetch=None) -> None:
    """The flat (sequence, tile) pipeline every attention stage drives: `buffers - 1` tile
    loads issued ahead, then one `fori_loop` over all `total` steps that refills the slot the
    previous step freed, waits for its own tile and computes it, crossing sequence boundaries
    without a drain. seq_meta[b * meta_width] is sequence b's end tile; first_of(b) its first
    tile; fetch(b, t, slot), wait_tile(slot) and compute(b, t, slot) are the stage's own;
    prologue_fetch (default fetch) issues the first buffers - 1 steps."""
    B, NB = batch, buffers
    advance = _advance(seq_meta, meta_width, B, first_of)
    zero = jnp.int32(0)
    t_first = first_of(0)  # sequence 0's first tile
    # prefetch cursor, kv_buffers - 1 steps ahead of the compute cursor
    pb, pt = issue_ahead(seq_meta, meta_width, B, NB, total, first_of, prologue_fetch or fetch)

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

    lax.fori_loop(0, total, step, (zero, t_first, pb, pt))


def _retire_write_backs(st: _Stage) -> None:
    """Phase 5: the page write-backs have been in flight during the whole tile loop; wait for
    them, so no DMA of the stage outlives it."""
    for _, _, slot, _, _, pg, _ in st.tokens():
        st.wait_patch_dma(slot, pg, write=True)


def _ungroup_o(st: _Stage) -> jax.Array:
    """Phase 6: o from q_heads [B, Hb, Rb, Db] back to [B*q_len, Hq*D] rows (b-major, heads along
    lanes: the layout q came in), through the flat buffer. Two 64-wide heads per block: each
    head's rows keep its own lane half (moved by a half-block roll when its q head sits in the
    other half of its 128-lane block of `flat`), merged into that block by a lane select."""
    g, sc = st.g, st.sc
    B, T, G, D, R = g.batch, g.q_len, g.group, g.head_dim, g.q_rows
    pack, NBK = g.heads_per_block, g.head_blocks
    if pack == 1:
        for b in range(B):
            for h in range(NBK):
                for gi in range(G):
                    sc.flat[pl.ds(b * T, T), pl.ds((h * G + gi) * D, D)] = sc.q_heads[b, h, pl.ds(gi * T, T), :]
    else:
        half = lax.div(lax.broadcasted_iota(jnp.int32, (1, LANE), 1), D)  # lax: no jnp sign lowering
        for b in range(B):
            for j in range(NBK):
                for p_ in range(pack):
                    for gi in range(G):
                        qh = (j * pack + p_) * G + gi
                        o = sc.q_heads[b, j, pl.ds(p_ * R + gi * T, T), :]
                        if qh % pack != p_:
                            o = pltpu.roll(o, D, 1)
                        cols = pl.ds((qh // pack) * LANE, LANE)
                        sc.flat[pl.ds(b * T, T), cols] = jnp.where(half == qh % pack, o,
                                                                   sc.flat[pl.ds(b * T, T), cols])
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
    if g.quantized:
        want = (g.num_layers, k_cache.shape[1], g.page_rows, g.page_lanes)
        if tuple(k_cache.shape) != want or k_cache.dtype != BUFFER_DTYPES[g.cache_dtype] or v_cache is not None:
            raise ValueError(f"attention_stage: a quantized cache is one {g.cache_dtype}{list(want)} array "
                             f"(and v_cache None), got {k_cache.dtype}{list(k_cache.shape)}")
        caches = ()
    else:
        caches = (("k_cache", k_cache), ("v_cache", v_cache))
    for name, ref in caches:
        shp = tuple(ref.shape)
        if len(shp) != 4 or shp[0] != g.num_layers or shp[2:] != (g.page_size, g.kv_size):
            raise ValueError(f"attention_stage: {name} has shape {shp}, geometry expects "
                             f"({g.num_layers}, num_pages, {g.page_size}, {g.kv_size})")
        if ref.dtype != BUFFER_DTYPES[g.cache_dtype]:
            raise ValueError(f"attention_stage: {name} dtype {ref.dtype} != the geometry's cache dtype {g.cache_dtype}")
    bt = tuple(block_tables.shape)
    if bt not in ((g.batch, g.pages_per_seq), (g.batch * g.pages_per_seq,)):
        raise ValueError(f"attention_stage: block_tables has shape {bt}, geometry expects "
                         f"({g.batch}, {g.pages_per_seq})")
