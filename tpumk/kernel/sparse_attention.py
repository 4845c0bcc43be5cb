"""DeepSeek Sparse Attention in the megakernel: the lightning indexer, each query's top-k, and MLA
over the selected tokens only (`tpumk.model.sparse_attention` is the reference; the geometry is
`tpumk.plan.geometry.SparseGeometry`).

Per MLA layer, inside `mla_attention.mla_attention_stage` (whose latent page patching and
write-back it shares):

1. the indexer's inputs (`SparseStage.prepare`): idx_k's and idx_q's outputs arrive from the
   weight ring; the key is LayerNormed (weight, bias, eps 1e-6) in float32, cast to the model
   dtype, roped (rotate-half on lanes [0, R) of each head, MLA's cos / sin tables) and cast again;
   the queries likewise roped; w = x . weights_proj / sqrt(Hi) in float32 (weights_proj streams
   as float32 by its own DMA, as transformers keeps it: the ring is one dtype);
2. the index-key cache update: the pages this step writes are read, patched and written back
   exactly as the latent cache's (`attention._Stage`'s addressing and stand-in DMAs);
3. per sequence: the scores of its queries against every cached (and new) key, streamed tile
   by tile from the index-key cache, one matmul for all heads and queries per tile and one more
   for the weighted sum over heads, stored as order-preserving int32 keys (a float's bits,
   negatives' magnitude bits flipped; -0.0 read as 0.0; a key the query may not see: INT32_MIN);
4. the top-k selection, with no sort: a threshold search over the keys' 32 bits (per query row,
   bit by bit from the top, keep the bit when at least k keys are >= the candidate), which
   finds the k-th largest key in 32 vector passes that only compare and count (what the VPU
   does well; a sort of tens of thousands of lanes per query has no TPU primitive and a
   bitonic network costs log^2 passes of cross-lane shuffles); each pass reads the keys in
   chunks of `select_lanes` positions, so its temporaries do not grow with the context. Ties at the
   lowest positions, as `jax.lax.top_k` breaks them (the reference): a second search over the
   position finds how far along the tied keys the k-th pick reaches. Fewer visible keys than
   k: all of them;
5. the selection goes VMEM -> SMEM by a local DMA, and the scalar core lists the distinct
   sublane-tile blocks (block_rows positions) holding a position some query of the sequence
   picked, in order (the compaction: one pass over the sequence's positions, a few loads, an
   add and a store each; Mosaic moves no single row, see SparseGeometry, so a block is the
   smallest gather and each is moved once however many of its rows are picked);
6. the listed blocks are gathered by DMA, `gather_tokens` per step into a ring of
   `ring_slots` slots (the next ring_slots - 1 steps' DMAs fly while one is computed: a step's
   small DMAs are latency-bound with fewer), from the patch page when this step wrote that
   page; online softmax over the steps, each gathered row a key only for the queries that
   picked its position.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.kernel import attention as attn
from tpumk.kernel.norms import rope_heads
from tpumk.plan.geometry import LANE, MLAGeometry, SparseGeometry

INT32_MIN = -(2 ** 31)
INDEX_KEY_NORM_EPS = 1e-6  # (tpumk.model.sparse_attention.INDEX_KEY_NORM_EPS: the model layer's)
# sems: 0 weights_proj, 1 the key norm rows, 2 / 3 the index-key tile slots, 4 selection VMEM -> SMEM
_SEM_WEIGHTS, _SEM_NORM, _SEM_TILE, _SEM_PICKED = 0, 1, 2, 4


class SparseScratch(NamedTuple):
    idx_q: Any
    idx_k: Any
    head_weights: Any
    weights: Any
    norm: Any
    key_patch: Any
    key_tiles: Any
    heads: Any
    combine: Any
    keys: Any
    gather: Any
    picked: Any
    order: Any
    counts: Any
    sems: Any
    gather_sems: Any
    patch_sems: Any
    q_in: Any = None  # index_q_hidden only: LayerNorm(x), what idx_q projects


class _KeyPages(attn._Stage):
    """attention._Stage's page addressing and patch DMAs, over the index-key cache."""

    def __init__(self, mla: MLAGeometry, layer, cache, block_tables, positions, sc: SparseScratch, out=None):
        self.g, self.layer, self.out = mla, layer, out
        self.block_tables, self.positions = block_tables, positions
        self.sc = types.SimpleNamespace(patch_sems=sc.patch_sems)
        self.caches, self.patches = (cache,), (sc.key_patch,)
        self.meta_width = 3 + mla.q_len
        self._tokens = None
        self.window = None

    def patch_pieces(self):
        return [(0, None)]


class SparseStage:
    """One layer's sparse attention (module docstring). Built per layer inside the kernel."""

    def __init__(self, g: SparseGeometry, mla: MLAGeometry, layer, scratch, weights_hbm, norm_hbm, index_cache,
                 block_tables, positions, out=None):
        """layer: the index-key cache layer, or None for a layer that keeps the previous layer's
        selection (index_shared_layers: no indexer, no index keys; start, prepare, patch and
        retire do nothing, attend gathers the kept blocks). out: an `attention.PageOutputs`
        for the index-key pages when the kernel does not update the cache in place (many
        devices: the cache is read only, the step scatters the pages after the kernel)."""
        self.g, self.mla, self.layer = g, mla, layer
        self.shared = layer is None
        layer = 0 if layer is None else layer
        self.sc = SparseScratch(*scratch)
        self.weights_hbm, self.norm_hbm, self.cache = weights_hbm, norm_hbm, index_cache
        self.pages = _KeyPages(mla, layer, index_cache, block_tables, positions, self.sc, out)
        self.positions = positions
        self._vectors_waited = False

    # ---- 1. the indexer's inputs
    def _vector_copies(self):
        sc = self.sc
        return (pltpu.make_async_copy(self.weights_hbm.at[self.layer], sc.weights, sc.sems.at[_SEM_WEIGHTS]),
                pltpu.make_async_copy(self.norm_hbm.at[self.layer], sc.norm, sc.sems.at[_SEM_NORM]))

    def start(self) -> None:
        """Start this layer's float32 vectors and the reads of the index-key pages the step writes."""
        if self.shared:
            return
        for c in self._vector_copies():
            c.start()
        self.pages.start_patch_reads()

    def _rope(self, x, cos, sin, first_lane: int):
        """RoPE of each head's first R lanes in a 128-lane tile x [N, 128] starting at `first_lane`."""
        g = self.g
        lane = first_lane + lax.broadcasted_iota(jnp.int32, (1, LANE), 1)
        return jnp.where(lax.rem(lane, g.index_head_dim) < g.rope, rope_heads(x, cos, sin, g.rope), x)

    def _wait_vectors(self) -> None:
        if not self._vectors_waited:
            for c in self._vector_copies():
                c.wait()
            self._vectors_waited = True

    @staticmethod
    def _layer_norm(x, width: int, weight, bias):
        """LayerNorm (weight, bias, eps 1e-6) of x [N, lanes] over its first `width` lanes, float32."""
        inside = lax.broadcasted_iota(jnp.int32, (1, x.shape[1]), 1) < width
        mean = jnp.sum(jnp.where(inside, x, 0.0), axis=1, keepdims=True) / width
        dev = jnp.where(inside, x - mean, 0.0)
        var = jnp.sum(dev * dev, axis=1, keepdims=True) / width
        return dev * lax.rsqrt(var + INDEX_KEY_NORM_EPS) * weight + bias

    def hidden_queries(self, x) -> None:
        """index_q_hidden (Mistral Large 4): q_in = LayerNorm(x; rows 4, 5 of the layer's vectors)
        in the model dtype, what idx_q projects. x [N, H] the layer's normed input (f32)."""
        g, sc = self.g, self.sc
        self._wait_vectors()
        n, w = sc.q_in.shape[0], g.q_lora  # every row (a padding row too: the matmul reads them all)
        xs = x[0:min(n, x.shape[0]), :]
        if xs.shape[0] < n:  # the scratch's sublane padding rows: zeros
            xs = jnp.concatenate([xs, jnp.zeros((n - xs.shape[0], xs.shape[1]), jnp.float32)], 0)
        if xs.shape[1] < w:
            xs = jnp.concatenate([xs, jnp.zeros((n, w - xs.shape[1]), jnp.float32)], 1)
        y = self._layer_norm(xs, g.hidden, sc.norm[4:5, 0:w], sc.norm[5:6, 0:w])
        sc.q_in[pl.ds(0, n), :] = y.astype(g.jnp_dtype).astype(jnp.float32)

    def _log_scales(self, log_pos, lo: int):
        """query_log_scale: the factor [N, 128] of idx_q's lanes [lo, lo + 128): head h's lanes
        times s_h ln(1 + p) + b_h, computed in the model dtype (mla.log_position_scale)."""
        g, sc, dt = self.g, self.sc, self.g.jnp_dtype
        di = g.index_head_dim
        lane = lax.broadcasted_iota(jnp.int32, (1, LANE), 1)
        rounded = lambda v: v.astype(dt).astype(jnp.float32)  # noqa: E731
        factor = jnp.zeros((g.tokens, LANE), jnp.float32)
        for h in range(lo // di, min(g.index_heads, -(-(lo + LANE) // di))):
            f = rounded(rounded(sc.norm[2:3, h:h + 1] * log_pos) + sc.norm[3:4, h:h + 1])  # [N, 1]
            inside = jnp.logical_and(lo + lane >= h * di, lo + lane < (h + 1) * di)
            factor = jnp.where(inside, f, factor)
        return factor

    def prepare(self, x, cos, sin, log_pos=None) -> None:
        """x [N, H] the layer's normed input (f32), cos / sin [N, 128]: the new key rows (in
        idx_k, exact in the model dtype), the roped queries (idx_q) and each row's head weights.
        log_pos [N, 1] (query_log_scale): ln(1 + p) in the model dtype, each query head's factor's."""
        g, sc, dt = self.g, self.sc, self.g.jnp_dtype
        n, di = g.tokens, g.index_head_dim
        if self.shared:
            return
        self._wait_vectors()
        k = sc.idx_k[pl.ds(0, n), :]
        k = self._layer_norm(k, di, sc.norm[0:1, 0:g.key_lanes], sc.norm[1:2, 0:g.key_lanes])
        k = k.astype(dt).astype(jnp.float32)
        for lo in range(0, g.key_lanes, LANE):
            sc.idx_k[pl.ds(0, n), pl.ds(lo, LANE)] = self._rope(k[:, lo:lo + LANE], cos, sin, lo).astype(dt).astype(
                jnp.float32)
        for lo in range(0, g.q_cols, LANE):
            q = sc.idx_q[pl.ds(0, n), pl.ds(lo, LANE)].astype(dt).astype(jnp.float32)
            if g.log_scale:  # before RoPE, as transformers (a model-dtype product)
                q = (q * self._log_scales(log_pos[0:n], lo)).astype(dt).astype(jnp.float32)
            sc.idx_q[pl.ds(0, n), pl.ds(lo, LANE)] = self._rope(q, cos, sin, lo).astype(dt).astype(jnp.float32)
        xw = x.astype(dt).astype(jnp.float32)
        w = lax.dot_general(xw, sc.weights[...], (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
        sc.head_weights[pl.ds(0, n), :] = w * (g.index_heads ** -0.5)

    # ---- 2. the index-key cache update
    def patch(self) -> None:
        """Patch this step's key rows into the pages they land on and start the write-backs."""
        g, sc, st = self.g, self.sc, self.pages
        T, P, di = g.q_len, g.page_size, g.index_head_dim
        if self.shared:
            return
        rows = lax.broadcasted_iota(jnp.int32, (P, 1), 0)
        for b, i, slot, lps, pos, pg, first in st.tokens():
            st.wait_patch_dma(slot, pg, write=False)
            hits = attn._page_slots(st, i, lps, pos)
            page = sc.key_patch[slot].astype(jnp.float32)
            for j in range(T):
                page = jnp.where(rows == hits[j], sc.idx_k[pl.ds(b * T + j, 1), pl.ds(0, di)], page)
            sc.key_patch[slot] = page.astype(g.jnp_dtype)
            st.start_patch_dma(slot, pg, first, write=True)

    def retire(self) -> None:
        if not self.shared:
            attn._retire_write_backs(self.pages)

    # ---- 3. scores
    def _stage_queries(self, b: int) -> None:
        """One sequence's index queries head-major in `heads`, its head weights in `combine`."""
        g, sc = self.g, self.sc
        T, Hi, di = g.q_len, g.index_heads, g.index_head_dim
        sc.heads[...] = jnp.zeros(sc.heads.shape, jnp.float32)
        for h in range(Hi):
            sc.heads[pl.ds(h * T, T), pl.ds(0, di)] = sc.idx_q[pl.ds(b * T, T), pl.ds(h * di, di)]
        col = lax.broadcasted_iota(jnp.int32, (g.weight_lanes, g.head_rows), 1)
        head = lax.broadcasted_iota(jnp.int32, (g.weight_lanes, g.head_rows), 0)
        qrow = lax.broadcasted_iota(jnp.int32, (g.query_rows, 1), 0)
        combine = jnp.zeros((g.query_rows, g.head_rows), jnp.float32)
        for i in range(T):  # row i: w[h] at lane h * T + i
            spread = (col == head * T + i).astype(jnp.float32)
            row = lax.dot_general(sc.head_weights[pl.ds(b * T + i, 1), :], spread, (((1,), (0,)), ((), ())),
                                  precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
            combine = jnp.where(qrow == i, row, combine)
        sc.combine[...] = combine

    def _key_valid(self, b, kpos, length):
        st = self.pages
        ok = kpos < length
        for i in range(self.g.q_len):
            p_ = self.positions[b, i]
            ok = jnp.logical_or(ok, kpos == jnp.where(st.in_range(p_), p_, -1))
        return ok

    def _scores(self, b: int, lengths, seq_meta, mw: int) -> None:
        """keys[i, p] = the order-preserving int32 key of query i's score of position p."""
        g, sc, dt = self.g, self.sc, self.g.jnp_dtype
        T, S, KT, P = g.q_len, g.tile_rows, g.tile_pages, g.page_size
        st = self.pages
        precision = lax.Precision.HIGHEST if g.dtype == "float32" else None
        sc.keys[...] = jnp.full(sc.keys.shape, INT32_MIN, jnp.int32)
        npages = seq_meta[b * mw + 1]
        lps = [seq_meta[b * mw + 3 + i] for i in range(T)]
        length = jnp.minimum(lengths[b], st.capacity)
        qrow = lax.broadcasted_iota(jnp.int32, (g.query_rows, 1), 0)
        qpos = jnp.full((g.query_rows, 1), -1, jnp.int32)
        for i in range(T):
            qpos = jnp.where(qrow == i, self.positions[b, i], qpos)

        def copies(t, slot):
            out = []
            for j in range(KT):
                lp = jnp.minimum(t * KT + j, npages - 1)
                patched, pslot = False, 0
                for i in reversed(range(T)):
                    hit = lps[i] == lp
                    pslot = jnp.where(hit, b * T + i, pslot)
                    patched = jnp.logical_or(patched, hit)
                dst, sem = sc.key_tiles.at[slot, pl.ds(j * P, P)], sc.sems.at[_SEM_TILE + slot]
                out.append((patched, sc.key_patch.at[pslot], self.cache.at[self.layer, st.page_id(b, lp)], dst, sem))
            return out

        def fetch(t, slot):
            for patched, local, page, dst, sem in copies(t, slot):
                pl.when(patched)(lambda local=local, dst=dst, sem=sem: pltpu.make_async_copy(local, dst, sem).start())
                pl.when(jnp.logical_not(patched))(
                    lambda page=page, dst=dst, sem=sem: pltpu.make_async_copy(page, dst, sem).start())

        def wait(slot):
            for j in range(KT):
                pltpu.make_async_copy(self.cache.at[self.layer, 0], sc.key_tiles.at[slot, pl.ds(j * P, P)],
                                      sc.sems.at[_SEM_TILE + slot]).wait()

        def compute(t, slot):
            q = sc.heads[:, pl.ds(0, g.index_head_dim)].astype(dt)
            s = lax.dot_general(q, sc.key_tiles[slot], (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)  # [heads x queries, S]
            s = jnp.maximum(s * (g.index_head_dim ** -0.5), 0.0)
            score = lax.dot_general(sc.combine[...], s, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32)  # [queries, S]
            score = jnp.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0, as in the reference's compare
            bits = lax.bitcast_convert_type(score, jnp.int32)
            key = jnp.where(bits >= 0, bits, jnp.bitwise_xor(bits, jnp.int32(0x7FFFFFFF)))
            kpos = t * S + lax.broadcasted_iota(jnp.int32, (1, S), 1)
            seen = jnp.logical_and(self._key_valid(b, kpos, length), kpos <= qpos)
            key = jnp.where(seen, key, INT32_MIN)
            if isinstance(t, int):
                sc.keys[:, pl.ds(0, S)] = key
            else:
                sc.keys[:, pl.ds(pl.multiple_of(t * S, LANE), S)] = key

        if g.tile_pages == g.pages_per_seq:  # one tile: the whole sequence
            fetch(0, 0)
            wait(0)
            compute(0, 0)
            return
        ntiles = lax.div(npages + (KT - 1), KT)
        fetch(jnp.int32(0), 0)

        def step(t, carry):
            slot = lax.rem(t, 2)
            pl.when(t + 1 < ntiles)(lambda: fetch(t + 1, 1 - slot))
            wait(slot)
            compute(t, slot)
            return carry

        lax.fori_loop(0, ntiles, step, 0)

    # ---- 4. top-k
    def _select(self) -> None:
        """keys -> the selection (1 picked, 0 not) in keys, per query row (module docstring).
        Every pass reads the keys `select_lanes` positions at a time (a loop over the chunks when
        there are several), so its compare / count temporaries are [query rows, select_lanes]
        whatever the context (SparseGeometry.select_lanes)."""
        g, sc = self.g, self.sc
        R, L, K, C = g.query_rows, g.score_lanes, g.topk, g.select_lanes
        chunks = L // C

        def count(pred):
            """Per query row: how many positions p satisfy pred(key [R, C], position [1, C])."""
            def part(lo):
                pos = lo + lax.broadcasted_iota(jnp.int32, (1, C), 1)
                return jnp.sum(pred(sc.keys[:, pl.ds(lo, C)], pos).astype(jnp.int32), axis=1, keepdims=True)

            if chunks == 1:
                return part(0)
            return lax.fori_loop(0, chunks, lambda c, acc: acc + part(pl.multiple_of(c * C, LANE)),
                                 jnp.zeros((R, 1), jnp.int32))

        def bit_step(i, prefix):  # bits 30 .. 0, the sign bit settled before
            cand = jnp.bitwise_or(prefix, lax.shift_left(jnp.int32(1), 30 - i))
            return jnp.where(count(lambda k, _: k >= cand) >= K, cand, prefix)

        top = jnp.where(count(lambda k, _: k >= 0) >= K, 0, INT32_MIN) * jnp.ones((R, 1), jnp.int32)
        thr = lax.fori_loop(0, 31, bit_step, top)
        need = K - count(lambda k, _: k > thr)  # ties at the threshold to take, lowest positions first

        def pos_step(_, bounds):
            lo, hi = bounds
            mid = lax.shift_right_logical(lo + hi, 1)
            enough = count(lambda k, pos: jnp.logical_and(k == thr, pos <= mid)) >= need
            return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

        steps = max(1, (L - 1).bit_length())
        last, _ = lax.fori_loop(0, steps, pos_step, (jnp.zeros((R, 1), jnp.int32), jnp.full((R, 1), L - 1, jnp.int32)))

        def mark(lo):
            keys = sc.keys[:, pl.ds(lo, C)]
            pos = lo + lax.broadcasted_iota(jnp.int32, (1, C), 1)
            picked = jnp.logical_or(keys > thr, jnp.logical_and(keys == thr, pos <= last))
            sc.keys[:, pl.ds(lo, C)] = jnp.logical_and(picked, keys != INT32_MIN).astype(jnp.int32)

        if chunks == 1:
            mark(0)
        else:
            def mark_step(c, carry):
                mark(pl.multiple_of(c * C, LANE))
                return carry
            lax.fori_loop(0, chunks, mark_step, 0)

    # ---- 5. the blocks holding some query's picks, in order
    def _compact(self, b: int, seq_meta, mw: int):
        """picked (SMEM) -> order[0 .. n): the distinct latent blocks (position // block_rows)
        holding a position some query picked, ascending; then copies of the last (a whole final
        gather step, masked). Returns n."""
        g, sc = self.g, self.sc
        T, blk = g.q_len, g.block_rows
        copy = pltpu.make_async_copy(sc.keys.at[pl.ds(0, T)], sc.picked.at[b], sc.sems.at[_SEM_PICKED])
        copy.start()
        copy.wait()
        end = seq_meta[b * mw + 1] * g.page_size  # the sequence's pages (no key past them)

        def body(p, carry):
            n, last = carry
            any_ = sc.picked[b, 0, p]
            for i in range(1, T):
                any_ = jnp.maximum(any_, sc.picked[b, i, p])
            block = lax.div(p, blk)
            new = jnp.logical_and(any_ > 0, block != last)
            sc.order[b, n] = block
            return n + new.astype(jnp.int32), jnp.where(new, block, last)

        n, last = lax.fori_loop(0, end, body, (jnp.int32(0), jnp.int32(-1)))
        last = jnp.maximum(last, 0)
        for j in range(g.gather_tokens):
            sc.order[b, n + j] = last
        sc.counts[b] = n

    # ---- 6. attention over the gathered rows
    def attend(self, b: int, lst, lengths, token_of_row) -> None:
        """Sequence b: scores, selection, compaction, then MLA over the picked rows; o_lat to
        q_heads[b]'s first `latent` lanes (as the dense stage leaves it)."""
        g, sc, m = self.g, self.sc, self.mla
        msc, mw = lst.sc, lst.meta_width
        if not self.shared:  # (a shared layer keeps the previous layer's picks and blocks)
            self._stage_queries(b)
            self._scores(b, lengths, msc.seq_meta, mw)
            self._select()
            self._compact(b, msc.seq_meta, mw)
        n = sc.counts[b]
        T, P, C, G, blk, W = g.q_len, g.page_size, m.latent, g.gather_tokens, g.block_rows, m.row_lanes
        RB, dt = m.q_rows, m.jnp_dtype
        precision = lax.Precision.HIGHEST if m.dtype == "float32" else None
        lps = [msc.seq_meta[b * mw + 3 + i] for i in range(T)]
        nsteps = jnp.maximum(lax.div(n + (G - 1), G), 1)

        def fetch(c, slot):
            for j in range(G):
                p_ = sc.order[b, c * G + j] * blk  # the block's first position
                lp = lax.div(p_, P)
                off = pl.multiple_of(lax.rem(p_, P), blk)
                patched, pslot = False, 0
                for i in reversed(range(T)):
                    hit = lps[i] == lp
                    pslot = jnp.where(hit, b * T + i, pslot)
                    patched = jnp.logical_or(patched, hit)
                dst, sem = sc.gather.at[slot, pl.ds(j * blk, blk)], sc.gather_sems.at[slot]
                local = msc.patch.at[pslot, pl.ds(off, blk)]
                page = lst.caches[0].at[lst.layer, lst.page_id(b, lp), pl.ds(off, blk)]
                pl.when(patched)(lambda local=local, dst=dst, sem=sem: pltpu.make_async_copy(local, dst, sem).start())
                pl.when(jnp.logical_not(patched))(
                    lambda page=page, dst=dst, sem=sem: pltpu.make_async_copy(page, dst, sem).start())

        def wait(slot):
            for j in range(G):
                pltpu.make_async_copy(lst.caches[0].at[lst.layer, 0, pl.ds(0, blk)],
                                      sc.gather.at[slot, pl.ds(j * blk, blk)], sc.gather_sems.at[slot]).wait()

        lane = lax.broadcasted_iota(jnp.int32, (1, G * blk), 1)
        sub = lax.broadcasted_iota(jnp.int32, (G * blk, 1), 0)

        def compute(c, slot):
            first = c == 0
            rows = [jnp.zeros((1, G * blk), jnp.bool_) for _ in range(T)]  # per query: its keys among the rows
            any_col = jnp.zeros((G * blk, 1), jnp.bool_)
            for j in range(G):  # each row of block j is a key of the queries that picked its position
                k = c * G + j
                base = sc.order[b, k] * blk
                live = k < n
                for r in range(blk):
                    for i in range(T):
                        flag = jnp.logical_and(live, sc.picked[b, i, base + r] > 0)
                        rows[i] = jnp.where(lane == j * blk + r, flag, rows[i])
                        any_col = jnp.where(sub == j * blk + r, jnp.logical_or(any_col, flag), any_col)
            mask = jnp.zeros((RB, G * blk), jnp.bool_)
            for i in range(T):
                mask = jnp.logical_or(mask, jnp.logical_and(token_of_row == i, rows[i]))
            q = msc.q_heads[b]
            tile = sc.gather[slot]
            if W > m.kv_size:  # the stored row's pad lanes zero, whatever the cache holds there
                wl = lax.broadcasted_iota(jnp.int32, (1, W), 1)
                tile = jnp.where(wl < m.kv_size, tile, jnp.zeros((), dt))
            s = lax.dot_general(q.astype(dt), tile, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32) * m.scale
            s = jnp.where(mask, s, attn.MASK_VALUE)
            p, alpha, m_next, l_next = attn.online_softmax(s, first, msc.m, msc.l)
            vals = jnp.where(any_col, tile[:, :C], jnp.zeros((), dt))
            pv = lax.dot_general(p.astype(dt), vals, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
            acc = jnp.where(first, 0.0, msc.acc[...]) * alpha[:, :1] + pv
            msc.m[...], msc.l[...], msc.acc[...] = m_next, l_next, acc

        D = g.ring_slots
        fetch(jnp.int32(0), 0)  # the first D - 1 steps (there is always one)
        for first in range(1, D - 1):
            pl.when(first < nsteps)(lambda first=first: fetch(jnp.int32(first), first))

        def step(c, carry):
            ahead = c + (D - 1)  # into the slot step c - 1 computed from
            pl.when(ahead < nsteps)(lambda: fetch(ahead, lax.rem(ahead, D)))
            slot = lax.rem(c, D)
            wait(slot)
            compute(c, slot)
            return carry

        lax.fori_loop(0, nsteps, step, 0)
        m_last, l_last = msc.m[...], msc.l[...]
        o = jnp.where(m_last[:, :1] <= 0.5 * attn.MASK_VALUE, 0.0, msc.acc[...] / l_last[:, :1])
        msc.q_heads[b, :, pl.ds(0, C)] = o
