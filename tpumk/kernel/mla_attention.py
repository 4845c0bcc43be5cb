"""The MLA attention stage of the megakernel: multi-query attention over the paged latent cache.

Absorbed form (tpumk.model.mla.attend_latent): one shared "kv head" of W = C + R lanes per
token (c_kv | k_rope), every q head's row q_lat | q_rope scored against it in ONE matmul per
KV tile for all heads and all q_len rows of a sequence, online softmax in f32, values = the
tile's first C lanes. The cache update (read-modify-write of whole pages) and the paged tile
pipeline are tpumk.kernel.attention's, with one cache instead of two (`_LatentStage` reuses its
page addressing, token table, sequence tabulation and write-back retirement; this module has
its own page patching and tile loop, whose K and V are the same tile here). Everything that
module's docstring says about write ordering (a page the step writes is never read from HBM by
the tile loop), out-of-range positions, masking and the profiler-friendly control flow (DMAs
started in branches, every wait unconditional, branch-free tile compute) holds here too.

Numerics follow the reference: the query row cast to the cache dtype, scores with float32
accumulation times the YaRN softmax scale (`MLAGeometry.scale`), softmax in float32 (online),
probabilities cast to the cache dtype for p . c_kv. The latent rows are stored lane-padded
(C + R lanes then zeros to a whole number of 128-lane tiles: 576 -> 640 for DeepSeek-V3, 48 ->
128 for the tests' tiny model; `MLAGeometry.page_lanes`): the row-major layout the kernel
reads pads them so in HBM anyway, and an unpadded row gets another default layout on TPU that
XLA converted around the kernel every step. The query rows' pad lanes are zero and each
tile's are zeroed before the scores, so whatever a cache holds there cannot reach the output.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.kernel import attention as attn
from tpumk.model import kv_quant
from tpumk.plan.geometry import LANE, MLAGeometry


class MLAScratch(NamedTuple):
    tiles: Any
    patch: Any
    new_rows: Any
    q_heads: Any
    m: Any
    l: Any
    acc: Any
    seq_meta: Any
    tile_sems: Any
    patch_sems: Any


class _LatentStage(attn._Stage):
    """attention._Stage with one cache (the latent rows) instead of K and V."""

    def __init__(self, geom, layer, cache, block_tables, positions, scratch, out=None):
        self.g, self.layer, self.out = geom, layer, out
        self.block_tables, self.positions = block_tables, positions
        self.sc = MLAScratch(*scratch)
        self.caches = (cache,)
        self.patches = (self.sc.patch,)
        self.meta_width = 3 + geom.q_len
        self._tokens = None
        self.window = None

    def patch_pieces(self):
        """One DMA a patch page, the whole (packed or model-dtype) latent page."""
        return [(0, None)]


def mla_attention_stage(geom: MLAGeometry, layer, q_rows, new_rows, cache, block_tables, lengths, positions,
                        scratch: Sequence, out: attn.PageOutputs | None = None, sparse=None) -> Any:
    """One layer of MLA attention with the in-place latent cache update. Call inside a kernel.

    q_rows: callable (b, h) -> [(lane offset, f32 [q_len, width]), ...]: the pieces of the row
        q_lat | q_rope (W = latent + rope lanes) of query head h for sequence b's new tokens
        (roped; the stage casts the row to the cache dtype for the scores);
    new_rows: f32 [B*q_len, C + R]: this step's cache rows c_kv | k_rope (exact in the cache dtype);
    cache: HBM ref [num_layers, num_pages, page_size, page_lanes] (C + R then zero pad lanes, or
        the packed quantized row; aliased in -> out, updated in place);
    block_tables, lengths, positions, scratch, out: as `tpumk.kernel.attention.attention_stage`.
    sparse: a `tpumk.kernel.sparse_attention.SparseStage` (started, its inputs prepared): each
        query attends to the tokens its indexer picks, gathered, instead of the whole cache.
    Returns the q_heads scratch ref: after the stage, row h*q_len + i of q_heads[b] holds head
    h's latent output o_lat (softmax(q . rows) . c_kv) of token i in its first `latent` lanes."""
    st = _LatentStage(geom, layer, cache, block_tables, positions, scratch, out)
    sc, g = st.sc, geom
    B, T, H, W = g.batch, g.q_len, g.num_q_heads, g.row_lanes
    st.start_patch_reads()
    if g.quantized:
        _stage_quantized_rows(g, sc, new_rows)
    else:
        _stage_rows(g, sc, new_rows)
    for b in range(B):
        if W > g.kv_size:  # the stored row's pad lanes (a quantized one's exponent too): zero in every query row
            sc.q_heads[b] = jnp.zeros((g.q_rows, W), jnp.float32)
        for h in range(H):
            for lo, value in q_rows(b, h):
                sc.q_heads[b, pl.ds(h * T, T), pl.ds(lo, value.shape[1])] = value
        if g.q_rows > H * T:
            sc.q_heads[b, pl.ds(H * T, g.q_rows - H * T), :] = jnp.zeros((g.q_rows - H * T, W), jnp.float32)
    qrow = lax.broadcasted_iota(jnp.int32, (g.q_rows, 1), 0)
    token_of_row = jnp.full((g.q_rows, 1), -1, jnp.int32)
    for h in range(H):
        for i in range(T):
            token_of_row = jnp.where(qrow == h * T + i, i, token_of_row)
    total = attn._tabulate_sequences(st, lengths)
    _patch(st)
    if sparse is None:
        _tiles(st, lengths, token_of_row, total)
    else:
        sparse.patch()
        for b in range(B):
            sparse.attend(b, st, lengths, token_of_row)
        sparse.retire()
    attn._retire_write_backs(st)
    return sc.q_heads


def _stage_rows(g: MLAGeometry, sc, new_rows) -> None:
    """A model-dtype cache: this step's rows [tokens, C + R] f32 -> new_rows [tokens, stored
    row], zeros in the pad lanes past C + R (`MLAGeometry.page_lanes`), as the cache stores them."""
    n, W = g.tokens, g.kv_size
    if g.row_lanes == W:
        sc.new_rows[pl.ds(0, n), :] = new_rows
        return
    sc.new_rows[pl.ds(0, n), pl.ds(0, W)] = new_rows
    lane = lax.broadcasted_iota(jnp.int32, (1, g.row_lanes), 1)
    sc.new_rows[pl.ds(0, n), :] = jnp.where(lane < W, sc.new_rows[pl.ds(0, n), :], 0.0)


def _stage_quantized_rows(g: MLAGeometry, sc, new_rows) -> None:
    """A quantized cache: this step's rows [tokens, C + R] f32 -> new_rows [tokens, packed row]:
    each row's codes (as f32 values, `attention._quantize_rows` with the row as one head), its
    exponent byte's value at lane C + R, zeros after it (the kv_quant.PagedLayout row)."""
    n, W = g.tokens, g.kv_size
    codes, exps = attn._quantize_rows(g, new_rows)
    sc.new_rows[pl.ds(0, n), pl.ds(0, W)] = codes
    lane = lax.broadcasted_iota(jnp.int32, (1, g.row_lanes), 1)
    row = sc.new_rows[pl.ds(0, n), :]  # lanes past W: whatever the scratch held, replaced below
    sc.new_rows[pl.ds(0, n), :] = jnp.where(lane < W, row, jnp.where(lane == W, exps, 0.0))


def _patch(st) -> None:
    g, sc = st.g, st.sc
    T, P = g.q_len, g.page_size
    rows = lax.broadcasted_iota(jnp.int32, (P, 1), 0)
    lane = lax.broadcasted_iota(jnp.int32, (1, g.row_lanes), 1)
    for b, i, slot, lps, pos, pg, first in st.tokens():
        st.wait_patch_dma(slot, pg, write=False)
        hits = attn._page_slots(st, i, lps, pos)
        if g.quantized:  # in the page's bytes: the codes' encodings, the exponent byte as it is
            page = attn._as_bytes(g, sc.patch[slot])
            for j in range(T):
                staged = sc.new_rows[pl.ds(b * T + j, 1), :]
                row = jnp.where(lane < g.kv_size, attn._code_bytes(g, staged), staged.astype(jnp.int32))
                page = jnp.where(rows == hits[j], row, page)
            sc.patch[slot] = attn._from_bytes(g, page)
        else:
            page = sc.patch[slot].astype(jnp.float32)
            for j in range(T):
                page = jnp.where(rows == hits[j], sc.new_rows[pl.ds(b * T + j, 1), :], page)
            sc.patch[slot] = page.astype(g.jnp_dtype)
        st.start_patch_dma(slot, pg, first, write=True)


def _scale_row(g: MLAGeometry, tiles, slot):
    """A quantized tile's per-token scales as one row [1, S] over its keys: the exponent byte of
    token row k is lane C + R of row k; its 128-lane tile is read whole, the other lanes (codes,
    padding) zeroed, and `attention._lanes_as_rows` turns the column into a row."""
    base = g.exponent_block
    block = kv_quant.scales_of(attn._as_bytes(g, tiles[slot, :, pl.ds(base, LANE)]))  # [S, 128]
    lane = lax.broadcasted_iota(jnp.int32, (1, LANE), 1)
    cols = jnp.where(lane == g.kv_size - base, block, 0.0)  # code bytes read as exponents may be inf
    return attn._lanes_as_rows(cols, g.kv_size - base, 8)[0:1, :]  # [8, S]: row 0 the scales


def _tiles(st, lengths, token_of_row, total) -> None:
    g, sc, layer, positions = st.g, st.sc, st.layer, st.positions
    B, T, P, KT, NB, S, C = g.batch, g.q_len, g.page_size, g.kv_tile_pages, g.kv_buffers, g.tile_rows, g.latent
    RB = g.q_rows
    dt = g.jnp_dtype
    precision = lax.Precision.HIGHEST if g.dtype == "float32" else None
    mw = st.meta_width

    def fetch(b, t, slot):
        npages = sc.seq_meta[b * mw + 1]
        lps = [sc.seq_meta[b * mw + 3 + i] for i in range(T)]
        for j in range(KT):
            lp = jnp.minimum(t * KT + j, npages - 1)
            patched, pslot = False, 0
            for i in reversed(range(T)):
                hit = lps[i] == lp
                pslot = jnp.where(hit, b * T + i, pslot)
                patched = jnp.logical_or(patched, hit)
            dst, sem = sc.tiles.at[slot, pl.ds(j * P, P)], sc.tile_sems.at[0, slot]
            pl.when(patched)(lambda dst=dst, sem=sem, pslot=pslot:
                             pltpu.make_async_copy(sc.patch.at[pslot], dst, sem).start())
            pl.when(jnp.logical_not(patched))(
                lambda dst=dst, sem=sem, b=b, lp=lp:
                pltpu.make_async_copy(st.caches[0].at[layer, st.page_id(b, lp)], dst, sem).start())

    def wait_tile(slot):
        for j in range(KT):
            pltpu.make_async_copy(st.caches[0].at[layer, 0], sc.tiles.at[slot, pl.ds(j * P, P)],
                                  sc.tile_sems.at[0, slot]).wait()

    def compute(b, t, slot):
        pos = [positions[b, i] for i in range(T)]
        length = jnp.minimum(lengths[b], st.capacity)
        first_tile, last_tile = t == sc.seq_meta[b * mw + 2], t == sc.seq_meta[b * mw] - 1
        new_pos = [jnp.where(st.in_range(p_), p_, -1) for p_ in pos]

        def key_valid(kpos):
            ok = kpos < length
            for p_ in new_pos:
                ok = jnp.logical_or(ok, kpos == p_)
            return ok

        kpos_lane = t * S + lax.broadcasted_iota(jnp.int32, (1, S), 1)
        kpos_row = t * S + lax.broadcasted_iota(jnp.int32, (S, 1), 0)
        qpos = jnp.full((RB, 1), -1, jnp.int32)
        for i in range(T):
            qpos = jnp.where(token_of_row == i, pos[i], qpos)
        mask = jnp.logical_and(key_valid(kpos_lane), kpos_lane <= qpos)
        v_ok = key_valid(kpos_row)
        q = sc.q_heads[b]
        tile = sc.tiles[slot]
        scale_row = None
        if g.row_lanes > g.kv_size:  # the pad lanes (and a quantized row's exponent) zero, whatever the
            lane = lax.broadcasted_iota(jnp.int32, (1, g.row_lanes), 1)  # cache holds there (0 * inf)
            tile = jnp.where(lane < g.kv_size, tile.astype(dt), jnp.zeros((), dt))  # codes: exact in dt
        if g.quantized:
            scale_row = _scale_row(g, sc.tiles, slot)
        s = lax.dot_general(q.astype(dt), tile, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
        if scale_row is not None:  # a power of two: (q . codes) * scale is q . (codes * scale) exactly
            s = s * scale_row
        s = s * g.scale
        s = jnp.where(mask, s, attn.MASK_VALUE)
        p, alpha, m_next, l_next = attn.online_softmax(s, first_tile, sc.m, sc.l)
        vals = jnp.where(v_ok, tile[:, :C], jnp.zeros((), dt))
        p_v = p if scale_row is None else p * scale_row  # each key's scale on its probability
        pv = lax.dot_general(p_v.astype(dt), vals, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        acc = jnp.where(first_tile, 0.0, sc.acc[...]) * alpha[:, :1] + pv
        sc.m[...], sc.l[...], sc.acc[...] = m_next, l_next, acc
        o = jnp.where(m_next[:, :1] <= 0.5 * attn.MASK_VALUE, 0.0, acc / l_next[:, :1])
        sc.q_heads[b, :, pl.ds(0, C)] = jnp.where(last_tile, o, q[:, :C])

    attn.run_tile_pipeline(sc.seq_meta, mw, B, NB, total, lambda b: sc.seq_meta[b * mw + 2], fetch, wait_tile,
                           compute)
