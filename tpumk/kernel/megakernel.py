"""The megakernel: one decode step (every layer, the final norm, the lm_head) in ONE pallas_call.

`make_decode_step(plan)` returns `step(packed, tokens, positions, cache) -> (logits, cache)`
with the semantics of `tpumk.model.reference.decode_step` (tokens / positions [B, q], logits
[B, q, V] f32, the paged KV cache updated in place). `step_specs(plan)` gives its argument
shapes, so a full-size model compiles deviceless with no weights in memory.

Outside the kernel (thin glue, all O(B * q * (H + V)) elementwise work):
- the embedding row gather `embed[tokens]`: a data-dependent gather of B*q rows that XLA does
  in one op; inside the kernel it would be B*q tiny DMAs for no gain;
- RoPE cos / sin rows from the positions (`norms.rope_tables`): a function of the positions
  only, shared by every layer, computed once instead of once per layer; likewise each row's
  query factor of a model with position-scaled queries (`rope.query_scale`), which the kernel
  multiplies into the roped queries (GQA: before the attention stage; MLA: before q_nope . W_UK);
- reshapes: logits come out as [devices x column blocks, B*q, tile_cols] (one whole tile per
  lm_head step; on many devices every device's vocabulary slice, all-gathered in the kernel)
  and are put back to [B, q, V] by a transpose and slices of the vocab padding;
  `lengths = max(lengths, last in-range position + 1)` for the returned cache.

Inside, per layer (one top-level loop per segment of same-kind layers, see tpumk.kernel.ring):
RMSNorm -> q|k|v tiles -> QK-norm + RoPE -> paged attention with the cache write
(tpumk.kernel.attention) -> o tiles + residual -> RMSNorm -> SwiGLU gate|up tiles and down tiles
(dense) or router, expert slots and the shared expert's tiles (MoE, tpumk.kernel.moe; Muse
Spark's experts between the moe_in and moe_out tiles) -> residual (with post_norms or
residual_gates the sublayer's whole output, normalized and / or gated, joins it). MLA models (tpumk.kernel.mla_attention) run, instead of q|k|v and attention: the q
path (q_a -> q_a norm -> q_b, or q), kv_a -> kv_a norm + RoPE of k_rope (the new latent cache
rows), RoPE of the q rope lanes, q_nope . W_UK per head (block-diagonal ring family), latent
attention with the cache write, . W_UV per head, then o. Then the final norm and the lm_head as its own loop. The ring keeps `ring_depth`
weight tiles in flight across all of it; a layer's norm vectors are prefetched one layer ahead,
and (GQA, no sliding windows) its first KV tiles start at the end of the previous layer's tile loop.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.compat import tpu_interpreter
from tpumk.kernel import attention as attn
from tpumk.kernel import linear_attention as lin_mod
from tpumk.kernel import moe as moe_mod
from tpumk.kernel.collectives import COLLECTIVE_COMPILER_PARAMS, all_gather_slices, all_reduce, all_reduce_barrier
from tpumk.kernel.layout import packed_specs
from tpumk.kernel.memory import block_spec, scratch_shape, shape_struct
from tpumk.kernel.norms import (residual_norm, rms_norm, rms_norm_from_sums, rms_norm_heads, rope_heads, rope_tables,
                                swiglu_act)
from tpumk.kernel.ring import WeightRing
from tpumk.plan.contract import (MOE_GLOBAL_OPERANDS, MOE_OPERANDS, MOE_SCALE_OPERANDS, RING_FAMILIES, STAGES,
                                 STATE_ARRAYS, STATE_SCALARS, KernelContract, kv_producers)
from tpumk.kernel.mla_attention import mla_attention_stage
from tpumk.kernel.sparse_attention import SparseStage
from tpumk.plan.geometry import (LANE, QUERY_SCALE_LANES, VECTOR_ROW, heads_per_lane_block, mla_dims,
                                 rope_table_lanes)
from tpumk.plan.plan import Plan, o_bias_offset, residual_gate_offset
from tpumk.model import rope
from tpumk.model.positions import new_lengths
from tpumk.model.linear_attention import LinearStates, step_counts
from tpumk.model.reference import KVCache, QuantizedKVCache, embed, guard_positions, jnp_dtype, soft_cap
from tpumk.targets import INTERPRET_COMPILER_OPTIONS


class _Scratch:
    """The kernel's scratch refs by contract name (`plan.contract.scratch`, in that order).

    Its own buffers are attributes (`ring`, `resid`, `logits_sems`, ...); the stages' are
    passed through as lists in their own order (`attention`, `moe`)."""

    def __init__(self, contract: KernelContract, refs: list):
        assert len(refs) == len(contract.scratch), "scratch refs and the contract disagree"
        by_name = {b.name: r for b, r in zip(contract.scratch, refs)}
        for b in contract.scratch:
            if b.component not in STAGES:
                setattr(self, b.name, by_name[b.name])
        self.moe_out = by_name.get("moe_out")
        self.partial = by_name.get("partial")
        self.attention = [by_name[b.name] for b in contract.stage_scratch("attention")]
        self.sparse = [by_name[b.name] for b in contract.stage_scratch("sparse")] or None
        self.linear = [by_name[b.name] for b in contract.stage_scratch("linear")] or None
        self.moe = [by_name[b.name] for b in contract.stage_scratch("moe")] or None
        self.collectives = [by_name[b.name] for b in contract.stage_scratch("collectives")] or None


def _scratch_shapes(plan: Plan) -> list:
    """The pallas_call's scratch_shapes: the contract's scratch list, in order."""
    return [scratch_shape(b) for b in plan.contract.scratch]


def _ring_families(plan: Plan) -> list[str]:
    return [f for f in RING_FAMILIES if f in plan.families]


def _kernel(plan: Plan):
    cfg = plan.cfg
    # the model's parts each stage reads (tpumk.model.parts)
    att, norms, pos = cfg.attention, cfg.norms, cfg.positions
    h, d, eps = cfg.hidden_size, att.head_dim, norms.rms_eps
    q_size, kv_size = att.q_size, att.kv_size
    o_at = o_bias_offset(cfg)  # the o projection's bias in the bias row (o_bias)
    gate_at = residual_gate_offset(cfg)  # residual_gates: alpha, then beta, in each post-norm row
    # the sublayer's whole output is staged before it joins the residual: normalized, or gated
    staged = norms.post_norms or norms.residual_gates
    fams = _ring_families(plan)
    dt = jnp_dtype(plan.cfg)

    contract = plan.contract
    n_in, n_out = len(contract.operands), len(contract.outputs)
    ar, rows = plan.all_reduce, plan.rows

    def kernel(*refs):
        ins = {b.name: r for b, r in zip(contract.operands, refs[:n_in])}
        block_tables, lengths, positions = ins["block_tables"], ins["lengths"], ins["positions"]
        x0, cos_ref, sin_ref, final_norm, vec_hbm = (ins[k] for k in ("x0", "cos", "sin", "final_norm", "layer_vectors"))
        q_scale_ref = ins.get("q_scale")  # position-scaled queries: each row's factor (glue, rope.query_scale)
        log_pos_ref = ins.get("log_pos")  # query_log_scale: each row's ln(1 + position) in the model dtype
        weights = {f: ins[f] for f in fams}
        moe_refs = [ins[k] for k in MOE_OPERANDS] if plan.moe is not None else None
        moe_scales = tuple(ins[k] for k in MOE_SCALE_OPERANDS + (MOE_GLOBAL_OPERANDS if plan.moe.nv else ())) \
            if plan.moe is not None and plan.moe.quantized else None
        moe_bias = ins["e_gateup_bias"] if plan.moe is not None and plan.moe.expert_bias else None
        logits_ref, *outs = refs[n_in:n_in + n_out]
        taps_ref = outs.pop() if plan.taps else None  # the last output
        n_states = len(STATE_ARRAYS) if plan.linear is not None else 0
        outs, state_outs = outs[:len(outs) - n_states], outs[len(outs) - n_states:]
        if plan.cache_written_after_kernel:
            # The caches are read only; the patched pages go to the outputs after the logits, the
            # page each slot goes to to the last (the step scatters them into the cache); a
            # hybrid's pool likewise (each sequence's new entry, then scattered into its slot).
            k_cache, v_cache = (*(ins[b.name] for b in contract.operands[-plan.attention.caches:]), None)[:2]
            pages_out = attn.PageOutputs(tuple(outs[:-1]), outs[-1])
            index_cache, index_out = None, None
            if plan.sparse is not None:  # the latent cache, then the index-key cache (its pages: the second output)
                k_cache, v_cache, index_cache = ins["k_cache"], None, ins["index_cache"]
                pages_out = attn.PageOutputs((outs[0],), outs[-1])
                index_out = attn.PageOutputs((outs[1],), outs[-1])
            pool_arrays, pool_outputs = [ins[k] for k in STATE_ARRAYS] if n_states else [], tuple(state_outs)
        else:
            # The caches are aliased to outputs 1 (and 2): the kernel updates the outputs in place
            # (MLA: the one latent cache; --kv-dtype: the one packed cache); then the pool's arrays.
            k_cache, v_cache = (*outs, None)[:2]
            index_cache, index_out = None, None
            if plan.sparse is not None:  # the latent cache, then the index-key cache
                v_cache, index_cache = None, outs[1]
            pages_out = None
            pool_arrays, pool_outputs = list(state_outs), None
        pool = lin_mod.StatePool(*(ins[k] for k in STATE_SCALARS), *pool_arrays, outputs=pool_outputs) \
            if n_states else None
        s = _Scratch(contract, list(refs[n_in + n_out:]))
        lsc = lin_mod.LinearScratch(plan.linear, s.linear) if plan.linear is not None else None
        if plan.ring_grouped:  # each tile's scales stream with it
            ring = WeightRing(plan, weights, s.ring, s.ring_sems, {f: ins[f"scales_{f}"] for f in fams},
                              s.tile_scales, s.tile_scale_sems)
        else:
            ring = WeightRing(plan, weights, s.ring, s.ring_sems)

        quantized = plan.column_scaled  # one scale row per layer, applied after each column block

        def vector_copy(layer, slot):
            return pltpu.make_async_copy(vec_hbm.at[layer], s.vectors.at[slot], s.vector_sems.at[slot])

        def scale_copy(layer, slot):
            return pltpu.make_async_copy(ins["layer_scales"].at[layer], s.scales.at[slot], s.scale_sems.at[slot])

        ring.prologue()
        vector_copy(0, 0).start()
        if quantized:
            scale_copy(0, 0).start()
        s.resid[...] = x0[...]
        if cfg.is_mla:  # its pad lanes (between heads' latent outputs) are never written: keep them 0
            s.mla_olat[...] = jnp.zeros(s.mla_olat.shape, jnp.float32)
        if ar is not None:
            s.partial[...] = jnp.zeros(s.partial.shape, jnp.float32)  # pad columns stay 0 in every sum
            all_reduce_barrier(ar)  # peers are in the kernel before the first remote write

        def layer_vectors(layer):
            """This layer's norm vectors [8, W] (prefetched); starts the next layer's fetch (and
            likewise its column scales, when quantized)."""
            slot = lax.rem(layer, 2)
            vector_copy(layer, slot).wait()
            if quantized:
                scale_copy(layer, slot).wait()
            vec = s.vectors[slot]

            @pl.when(layer + 1 < cfg.num_layers)
            def _():
                vector_copy(layer + 1, 1 - slot).start()
                if quantized:
                    scale_copy(layer + 1, 1 - slot).start()
            return vec

        def family_scales(layer, family: str):
            """Quantized builds: scales(j) of `family` this layer, [1, tile_cols] f32."""
            if not quantized:
                return None
            slot, off, tc = lax.rem(layer, 2), plan.scale_offsets[family], plan.families[family].tile_cols
            return lambda j: s.scales[slot, :, pl.ds(off + j * tc, tc)]

        def matmul(seg, layer, family: str, x_ref, epilogue) -> None:
            ring.matmul(seg, layer, family, x_ref, epilogue, family_scales(layer, family))

        def row(vec, name, width):
            r = VECTOR_ROW[name]
            return vec[r:r + 1, :width]

        def add_to(ref, width: int, tile_cols: int) -> Callable:
            """Epilogue: ref[:, block j] += acc, dropping the padded columns past `width`."""
            def epilogue(j, acc):
                lo, hi = j * tile_cols, min((j + 1) * tile_cols, width)
                if hi > lo:
                    ref[:, lo:hi] = ref[:, lo:hi] + acc[:, :hi - lo]
            return epilogue

        def store_to(ref, width: int, tile_cols: int, at: int = 0) -> Callable:
            """Epilogue: ref[:, at + block j] = acc, dropping the padded columns past `width` (a
            ref with more rows than the step's, padded to whole tiles: its first rows)."""
            def epilogue(j, acc):
                lo, hi = j * tile_cols, min((j + 1) * tile_cols, width)
                if hi > lo:
                    ref[0:acc.shape[0], at + lo:at + hi] = acc[:, :hi - lo]
            return epilogue

        def partial_to(width: int, tile_cols: int) -> Callable:
            """Epilogue on many devices: this device's partial sum of block j into `partial`."""
            def epilogue(j, acc):
                lo, hi = j * tile_cols, min((j + 1) * tile_cols, width)
                if hi > lo:
                    s.partial[0:rows, lo:hi] = acc[:, :hi - lo]
            return epilogue

        def residual_epilogue(width: int, tile_cols: int) -> Callable:
            """resid += this block (one device), or stage the partial sum (many: see
            `reduce_into_resid`); with post_norms or residual_gates (one device) stage the block in
            `normed`, which the sublayer has read by then: its output is normalized (gated) whole
            before it joins the residual."""
            if ar is not None:
                return partial_to(width, tile_cols)
            return store_to(s.normed, width, tile_cols) if staged else add_to(s.resid, width, tile_cols)

        # The collectives' counters, consecutive through the kernel: per layer the QK-norm's
        # sums of squares (all-heads QK-norm only), o's partial sums, the FFN's / MoE's.
        per_layer = plan.layer_collectives

        def qk_sums_counter(layer):
            return per_layer * layer

        def attention_counter(layer):
            return per_layer * layer + per_layer - 2

        def ffn_counter(layer):
            return per_layer * layer + per_layer - 1

        def reduce_into_resid(counter, vec=None, post_norm: str = "", bias=None) -> None:
            """Many devices: resid += the sum over devices of `partial`, in device order (the same
            bits everywhere). `counter` numbers the kernel's collectives (`per_layer` per layer). With
            post_norms the sublayer's whole output (the sum, or on one device the block staged
            in `normed`) is normalized by the layer's `post_norm` row (epsilon post_eps), then
            added; with residual_gates it joins as alpha * resid + beta * output, alpha and beta
            from the same row (`residual_gate_offset`). `bias` [1, H] (o_bias) joins the
            sublayer's whole output first (on one device without post_norms or gates the output is
            already in resid: the bias follows it)."""
            if ar is not None:
                s.partial[...] = all_reduce(ar, s.partial[...], s.collectives, counter)
                out = s.partial[0:rows, 0:h]
            elif staged:
                out = s.normed[...]
            elif bias is not None:
                s.resid[...] = s.resid[...] + bias
                return
            else:
                return
            if bias is not None:
                out = out + bias
            if norms.post_norms:
                out = residual_norm(norms.norm_kind, out, row(vec, post_norm, h), norms.post_eps, norms.width)
            if norms.residual_gates:  # (tpumk.model.spark.join)
                r = VECTOR_ROW[post_norm]
                alpha, beta = vec[r:r + 1, gate_at:gate_at + h], vec[r:r + 1, 2 * gate_at:2 * gate_at + h]
                s.resid[...] = alpha * s.resid[...] + beta * out
            else:
                s.resid[...] = s.resid[...] + out

        def swiglu_into(ref, tile_cols: int) -> Callable:
            half = tile_cols // 2

            def epilogue(j, acc):
                ref[:, j * half:(j + 1) * half] = swiglu_act(acc[:, :half], acc[:, half:], cfg.mlp.mlp_act)
            return epilogue

        def gather_latent() -> None:
            """MLA with the latent split: every device's q_a | kv_a columns (`mla_part`) to every
            peer (`all_gather_slices`; the all-reduces between two layers' gathers keep a
            peer from overwriting slices still being read), then placed in `mla_qa` / `mla_kv`
            as one device computing them whole would have them (pad lanes zero)."""
            fam, w = plan.families, plan.sharding.latent_slices(cfg)
            c, width, lat = cfg.kv_lora_rank, cfg.attention.kv_cache_width, mla_dims(cfg)["latent"]
            s.mla_gather[lax.axis_index(ar.axis)] = s.mla_part[...]
            all_gather_slices(ar, s.mla_gather, 1, s.gather_send_sems, s.gather_recv_sems)
            kv_at = 0
            if "q_a" in fam:
                kv_at = fam["q_a"].m_pad
                s.mla_qa[...] = jnp.zeros(s.mla_qa.shape, jnp.float32)
                for d in range(plan.devices):
                    lo, hi = d * w["q_a"], min((d + 1) * w["q_a"], cfg.q_lora_rank)
                    if hi > lo:
                        s.mla_qa[:, lo:hi] = s.mla_gather[d, :, 0:hi - lo]
            s.mla_kv[...] = jnp.zeros(s.mla_kv.shape, jnp.float32)
            for d in range(plan.devices):  # kv_a's columns c_kv | k_rope; k_rope lives from lane `lat`
                lo, hi = d * w["kv_a"], min((d + 1) * w["kv_a"], width)
                for a, b, dst in ((lo, min(hi, c), lo), (max(lo, c), hi, lat + max(lo, c) - c)):
                    if b > a:
                        s.mla_kv[:, dst:dst + b - a] = s.mla_gather[d, :, kv_at + a - lo:kv_at + b - lo]

        def cache_layer(seg, layer):
            """The layer's place in the KV cache (a hybrid's) or the state pool (a linear layer's)."""
            return seg.kv_base + (layer - seg.first_layer) if plan.linear is not None else layer

        def rounded(v):  # a float32 value rounded to the model dtype, as the reference's model-dtype ops
            return v.astype(dt).astype(jnp.float32)

        def log_scale_queries(vec) -> None:
            """Mistral Large 4 (query_log_scale): each head's query lanes (nope and rope) times
            s_h ln(1 + p) + b_h, computed in the model dtype (tpumk.model.mla.log_position_scale)."""
            dims = mla_dims(cfg)
            hq, r, npad = cfg.num_q_heads, cfg.qk_rope_head_dim, dims["nope"]
            rope0 = hq * npad
            lp = log_pos_ref[:, 0:1]
            scale, bias = row(vec, "q_log_scale", hq), row(vec, "q_log_bias", hq)
            f = [rounded(rounded(scale[:, i:i + 1] * lp) + bias[:, i:i + 1]) for i in range(hq)]  # [N, 1] each
            for i in range(hq):
                s.mla_q[:, i * npad:(i + 1) * npad] = s.mla_q[:, i * npad:(i + 1) * npad] * f[i]
            lane = lax.broadcasted_iota(jnp.int32, (1, LANE), 1)
            for lo in range(0, dims["rope_q"], LANE):  # every head's roped lanes, R to a head
                heads = range(lo // r, min(hq, (lo + LANE) // r))
                factor = functools.reduce(  # (compares, not a division: Mosaic lowers int // through sign)
                    lambda acc, i: jnp.where(jnp.logical_and(lane >= i * r - lo, lane < (i + 1) * r - lo), f[i], acc),
                    heads, jnp.zeros((1, LANE), jnp.float32))
                s.mla_q[:, rope0 + lo:rope0 + lo + LANE] = s.mla_q[:, rope0 + lo:rope0 + lo + LANE] * factor

        # KV sharing (kv_source_layers, Mistral Large 4): a layer reading an earlier layer's latent
        # rows attends to that layer's cache with that layer's rows of this step (kept in
        # `mla_shared` by the source); it rewrites the same rows into the same pages
        producers = kv_producers(cfg)
        consumers = [(i, producers.index(cfg.pattern.kv_source(i))) for i in range(cfg.num_layers)
                     if cfg.pattern.kv_source(i) != i]

        def mla_cache_layer(seg, layer):
            base = cache_layer(seg, layer)
            return functools.reduce(lambda acc, ic: jnp.where(layer == ic[0], producers[ic[1]], acc), consumers, base)

        def share_rows(layer) -> None:
            for k, p in enumerate(producers):
                @pl.when(layer == p)
                def _(k=k):
                    s.mla_shared[k] = s.mla_row[...]
            for i, k in consumers:
                @pl.when(layer == i)
                def _(k=k):
                    s.mla_row[...] = s.mla_shared[k]

        def mla_attention_block(seg, layer, vec):
            """MLA (absorbed form): q path, kv_a, latent norm + RoPE, q_nope . W_UK, attention
            over the latent cache (tpumk.kernel.mla_attention), . W_UV, o + residual."""
            dims, fam = mla_dims(cfg), plan.families
            hq, c, r, t = cfg.num_q_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, plan.q_len
            lat, rope0 = dims["latent"], cfg.num_q_heads * dims["nope"]
            sparse = None
            if plan.sparse is not None:  # a layer without an indexer (index_base -1) keeps the last selection
                index_layer = seg.index_base + (layer - seg.first_layer) if seg.index_base >= 0 else None
                sparse = SparseStage(plan.sparse, plan.attention, index_layer, s.sparse, ins["idx_weights"],
                                     ins["idx_norm"], index_cache, block_tables, positions, index_out)
                sparse.start()  # its float32 vectors and key-page reads fly behind the projections
                idx = sparse.sc
            s.normed[...] = rms_norm(s.resid[...], row(vec, "attn_norm", h), eps, norms.width)
            # the two projections of the layer's input, in ring order (contract.MLA_FAMILIES)
            if plan.latent_split:  # this device's columns of q_a | kv_a, gathered from every device
                at = 0
                for f in ("q_a", "q", "kv_a"):
                    if f == "q" and f in fam:  # a plain q is split by heads already
                        matmul(seg, layer, "q", s.normed, store_to(s.mla_q, fam["q"].m_pad, fam["q"].tile_cols))
                    elif f in fam:
                        matmul(seg, layer, f, s.normed, store_to(s.mla_part, fam[f].m_pad, fam[f].tile_cols, at))
                        at += fam[f].m_pad
                gather_latent()
            else:
                if "q_a" in fam:
                    matmul(seg, layer, "q_a", s.normed, store_to(s.mla_qa, fam["q_a"].m_pad, fam["q_a"].tile_cols))
                else:
                    matmul(seg, layer, "q", s.normed, store_to(s.mla_q, fam["q"].m_pad, fam["q"].tile_cols))
                matmul(seg, layer, "kv_a", s.normed, store_to(s.mla_kv, fam["kv_a"].m_pad, fam["kv_a"].tile_cols))
            if sparse is not None and not sparse.shared:
                matmul(seg, layer, "idx_k", s.normed, store_to(idx.idx_k, fam["idx_k"].m_pad, fam["idx_k"].tile_cols))
            if "q_a" in fam:
                rq = cfg.q_lora_rank
                s.mla_qa[:, :rq] = rms_norm(s.mla_qa[:, :rq], row(vec, "q_norm", rq), norms.latent_eps)
                matmul(seg, layer, "q_b", s.mla_qa, store_to(s.mla_q, fam["q_b"].m_pad, fam["q_b"].tile_cols))
            # (a NoPE layer among rotated ones, Mistral Large 4's: cos 1, sin 0; its q and k rope
            # lanes are zero anyway, packed so, but its indexer's are not)
            cos, sin = rope_rows(layer)  # R-wide rotations tiled over one lane tile
            if sparse is not None and not sparse.shared:
                if sparse.g.q_hidden:  # Mistral Large 4: the index queries project LayerNorm(x)
                    sparse.hidden_queries(s.normed[...])
                    matmul(seg, layer, "idx_q", idx.q_in, store_to(idx.idx_q, fam["idx_q"].m_pad,
                                                                   fam["idx_q"].tile_cols))
                else:
                    matmul(seg, layer, "idx_q", s.mla_qa, store_to(idx.idx_q, fam["idx_q"].m_pad,
                                                                   fam["idx_q"].tile_cols))
                sparse.prepare(s.normed[...], cos, sin, log_pos_ref[:, 0:1] if log_pos_ref is not None else None)
            for lo in range(rope0, rope0 + dims["rope_q"], LANE):  # every head's roped q lanes
                s.mla_q[:, lo:lo + LANE] = rope_heads(s.mla_q[:, lo:lo + LANE], cos, sin, r)
            s.mla_kv[:, lat:lat + LANE] = rope_heads(s.mla_kv[:, lat:lat + LANE], cos, sin, r)
            if q_scale_ref is not None:  # Mistral 4: the whole query (nope and rope lanes) by position
                s.mla_q[...] = s.mla_q[...] * q_scale_ref[:, 0:1]
            if log_pos_ref is not None:  # Mistral Large 4: per head, after RoPE
                log_scale_queries(vec)
            # this step's cache rows c_kv | k_rope, rounded to the cache dtype (as the reference)
            s.mla_row[:, :c] = rms_norm(s.mla_kv[:, :c], row(vec, "k_norm", c), norms.latent_eps).astype(dt).astype(jnp.float32)
            s.mla_row[:, c:c + r] = s.mla_kv[:, lat:lat + r].astype(dt).astype(jnp.float32)
            if producers:
                share_rows(layer)
            matmul(seg, layer, "uk", s.mla_q, store_to(s.mla_qlat, fam["uk"].m_pad, fam["uk"].tile_cols))

            def q_rows(b, head):
                rows_ = slice(b * t, (b + 1) * t)
                return [(0, s.mla_qlat[rows_, head * lat:head * lat + c]),
                        (c, s.mla_q[rows_, rope0 + head * r:rope0 + (head + 1) * r])]

            o_lat = mla_attention_stage(plan.attention, mla_cache_layer(seg, layer), q_rows, s.mla_row[...], k_cache,
                                        block_tables, lengths,
                                        positions, s.attention, pages_out, sparse=sparse)
            for b in range(plan.batch):
                for head in range(hq):
                    s.mla_olat[b * t:(b + 1) * t, head * lat:head * lat + c] = o_lat[b, head * t:(head + 1) * t, 0:c]
            matmul(seg, layer, "uv", s.mla_olat, store_to(s.attn_out, fam["uv"].m_pad, fam["uv"].tile_cols))
            matmul(seg, layer, "o", s.attn_out, residual_epilogue(h, fam["o"].tile_cols))
            reduce_into_resid(attention_counter(layer))
            s.normed[...] = rms_norm(s.resid[...], row(vec, "mlp_norm", h), eps, norms.width)

        def sublayer_input(vec, norm: str) -> None:
            """`normed` = what the next sublayer reads: the residual normed by the layer's `norm`
            row, or without pre_norms (OLMo 2) the residual itself (reference.sublayer_in)."""
            resid = s.resid[...]
            s.normed[...] = residual_norm(norms.norm_kind, resid, row(vec, norm, h), eps, norms.width) \
                if norms.pre_norms else resid

        # NoPE on some attention layers (Muse Spark's full layers): runs of such layers, whose q and
        # k the kernel leaves unrotated (on every attention layer the glue's tables do it: cos 1, sin 0)
        nope_runs = _runs(cfg.nope_layers) if cfg.nope_layers and not plan.all_nope else ()

        def rope_rows(layer):
            """This layer's cos / sin rows: with rope_local_theta the tables hold the full layers'
            rows, then the sliding layers' (`_device_step`); a sliding layer takes the second.
            A NoPE layer among rotated ones takes cos 1, sin 0."""
            if not pos.rope_local_theta:
                cos, sin = cos_ref[...], sin_ref[...]
            else:
                local = attn.traced_window(plan.attention, layer) != attn.NO_WINDOW
                cos, sin = (jnp.where(local, cos_ref[rows:2 * rows, :], cos_ref[0:rows, :]),
                            jnp.where(local, sin_ref[rows:2 * rows, :], sin_ref[0:rows, :]))
            if nope_runs:
                nope = functools.reduce(jnp.logical_or, [jnp.logical_and(layer >= a, layer < b) for a, b in nope_runs])
                cos, sin = jnp.where(nope, 1.0, cos), jnp.where(nope, 0.0, sin)
            return cos, sin

        def whole_qk_norm(layer, vec) -> None:
            """RMSNorm of q's and of k's rows across all heads, in place in the q|k|v scratch.
            Many devices: each holds some heads, so the rows' sums of squares are all-reduced
            first (the layer's first collective; lanes 0 and 1 of `partial`), a KV head held by
            kv_replicas devices counted once (by the first of them)."""
            whole = plan.whole_model
            parts = (("q_norm", 0, q_size, whole.num_q_heads), ("k_norm", q_size, kv_size, whole.num_kv_heads))
            if ar is None:
                for name, lo, width, heads in parts:
                    s.qkv[:, lo:lo + width] = rms_norm(s.qkv[:, lo:lo + width], row(vec, name, width), eps,
                                                       heads * cfg.attention.true_head_dim)
                return
            sums = [jnp.sum(s.qkv[:, lo:lo + width] ** 2, axis=-1, keepdims=True) for _, lo, width, _ in parts]
            replicas = plan.sharding.kv_replicas
            if replicas > 1:
                first = lax.rem(lax.axis_index(ar.axis), replicas) == 0
                sums[1] = jnp.where(first, sums[1], 0.0)
            lane = lax.broadcasted_iota(jnp.int32, s.partial.shape, 1)
            s.partial[...] = jnp.where(lane == 0, sums[0], jnp.where(lane == 1, sums[1], 0.0))
            # pad columns stay 0; o's blocks overwrite every other column of `partial` next
            total = all_reduce(ar, s.partial[...], s.collectives, qk_sums_counter(layer))
            for i, (name, lo, width, heads) in enumerate(parts):
                s.qkv[:, lo:lo + width] = rms_norm_from_sums(s.qkv[:, lo:lo + width], row(vec, name, width), eps,
                                                             total[:, i:i + 1], heads * cfg.attention.true_head_dim)

        def attention_block(seg, layer, vec):
            if cfg.is_mla:
                return mla_attention_block(seg, layer, vec)
            # The reads of the pages this step writes depend only on the layer, tables and
            # positions: start them now, so their round trip hides behind the q|k|v tiles.
            kv_layer = cache_layer(seg, layer)
            attn.attention_prefetch(plan.attention, kv_layer, k_cache, v_cache, block_tables, positions, s.attention)
            sublayer_input(vec, "attn_norm")
            qkv = plan.families["qkv"]
            matmul(seg, layer, "qkv", s.normed, store_to(s.qkv, qkv.m_pad, qkv.tile_cols))
            if att.qkv_bias:  # before QK-norm and RoPE, as transformers adds it
                width = q_size + 2 * kv_size
                s.qkv[:, :width] = s.qkv[:, :width] + row(vec, "qkv_bias", width)
            # QK-norm + RoPE per head, in place in the q|k|v scratch (heads are 128-lane aligned;
            # 64-wide heads go two per 128-lane block, the norm row and cos / sin tiled to match).
            if att.qk_norm_whole:  # OLMo 2: one norm across all heads' true lanes (pad lanes are 0)
                whole_qk_norm(layer, vec)
            cos, sin = rope_rows(layer)  # loaded per layer: a value live across loops spills
            pack = heads_per_lane_block(d)
            for name, heads, base in (("q_norm", cfg.num_q_heads, 0), ("k_norm", cfg.num_kv_heads, q_size)):
                w = row(vec, name, d * pack)
                for i in range(heads // pack):
                    lo = base + i * d * pack
                    x = s.qkv[:, lo:lo + d * pack]
                    if att.qk_norm and not att.qk_norm_whole:
                        x = rms_norm_heads(x, w, eps, d, cfg.attention.true_head_dim)
                    s.qkv[:, lo:lo + d * pack] = rope_heads(x, cos, sin, d)
            q = s.qkv[:, :q_size]
            if q_scale_ref is not None:  # Ministral 3: each query row by its position's factor, after RoPE
                q = q * q_scale_ref[:, 0:1]
            k_new = s.qkv[:, q_size:q_size + kv_size].astype(dt)
            v_new = s.qkv[:, q_size + kv_size:q_size + 2 * kv_size].astype(dt)
            # Without sliding windows every layer starts the next layer's first KV tiles when its
            # tile loop ends (they fly during o and the FFN), and takes its own from the previous.
            # (a hybrid's next layer may be a linear one: no early start there)
            kv_ahead = not plan.attention.window_runs() and plan.linear is None
            s.attn_out[...] = attn.attention_stage(plan.attention, kv_layer, q, k_new, v_new, k_cache, v_cache,
                                                   block_tables, lengths, positions, s.attention, prefetched=True,
                                                   tiles_started=kv_ahead and layer > 0,
                                                   prefetch_next=kv_ahead and layer + 1 < cfg.num_layers,
                                                   sinks=row(vec, "sinks", cfg.num_q_heads) if att.attn_sinks else None,
                                                   out=pages_out)
            if att.attn_out_norm:  # Muse Spark: each head's output normalised (no weight) before the gate
                ones = jnp.ones((1, d * pack), jnp.float32)
                for i in range(cfg.num_q_heads // pack):
                    lo = i * d * pack
                    s.attn_out[:, lo:lo + d * pack] = rms_norm_heads(s.attn_out[:, lo:lo + d * pack], ones, eps, d,
                                                                     att.true_head_dim)
            if att.attn_output_gate:  # Qwen3-Next: o * sigmoid(gate), the gate after q | k | v
                gate_at = q_size + 2 * kv_size
                s.attn_out[...] = s.attn_out[...] * jax.nn.sigmoid(s.qkv[:, gate_at:gate_at + q_size])
            o = plan.families["o"]
            matmul(seg, layer, "o", s.attn_out, residual_epilogue(h, o.tile_cols))
            o_bias = vec[VECTOR_ROW["qkv_bias"]:VECTOR_ROW["qkv_bias"] + 1, o_at:o_at + h] if att.o_bias else None
            reduce_into_resid(attention_counter(layer), vec, "post_attn_norm", o_bias)
            if not norms.parallel_blocks:  # Cohere's MLP reads attention's input, still in `normed`
                sublayer_input(vec, "mlp_norm")

        def linear_block(seg, layer, vec):
            """A linear-attention layer (tpumk.kernel.linear_attention): lin_in (and KDA's
            low-rank gates), the stage over every sequence's state, lin_out + residual."""
            g, fam = plan.linear, plan.families
            at = cache_layer(seg, layer)
            lin_mod.start_reads(g, pool, lsc, at)  # sequence 0's entry flies behind the projection
            sublayer_input(vec, "attn_norm")
            matmul(seg, layer, "lin_in", s.normed, store_to(lsc.proj, fam["lin_in"].m, fam["lin_in"].tile_cols))
            if g.kind == "kda":  # the forget and output gates' second halves, from their first
                offs, k = g.proj_offsets, g.key_dim
                for name, src, dst in (("lin_fb", "f_a", lsc.f), ("lin_gb", "g_a", lsc.g)):
                    lsc.low[...] = lsc.proj[0:rows, offs[src]:offs[src] + k]
                    matmul(seg, layer, name, lsc.low, store_to(dst, fam[name].m, fam[name].tile_cols))
            lin_mod.linear_stage(g, at, vec, lsc, pool, positions, plan.context)
            matmul(seg, layer, "lin_out", lsc.y, residual_epilogue(h, fam["lin_out"].tile_cols))
            reduce_into_resid(attention_counter(layer), vec, "post_attn_norm")
            sublayer_input(vec, "mlp_norm")

        def mixer_block(seg, layer, vec):
            (linear_block if seg.linear else attention_block)(seg, layer, vec)

        def dense_layer(seg):
            def body(layer):
                vec = layer_vectors(layer)
                mixer_block(seg, layer, vec)
                matmul(seg, layer, "gate_up", s.normed, swiglu_into(s.act, plan.families["gate_up"].tile_cols))
                matmul(seg, layer, "down", s.act, residual_epilogue(h, plan.families["down"].tile_cols))
                reduce_into_resid(ffn_counter(layer), vec, "post_mlp_norm")
            return body

        def moe_layer(seg):
            router, e_gateup, e_down = moe_refs

            def body(layer):
                vec = layer_vectors(layer)
                moe_index = seg.moe_base + (layer - seg.first_layer)
                # The router is small: fetch it while attention runs.
                moe_mod.start_router_fetch(plan.moe, moe_index, router, s.moe, scales_hbm=moe_scales)
                mixer_block(seg, layer, vec)
                x = s.normed[...]
                # Routing first, so the expert loads are in flight while the shared expert streams.
                moe_mod.moe_route_and_prefetch(plan.moe, moe_index, x, router, e_gateup, e_down, s.moe,
                                               router_started=True, scales_hbm=moe_scales, bias_hbm=moe_bias)
                fam = plan.families
                if "moe_in" in fam:  # Muse Spark: the experts read rms_norm(x @ moe_in) at width M
                    m = plan.moe.hidden
                    matmul(seg, layer, "moe_in", s.normed, store_to(s.moe_x, m, fam["moe_in"].tile_cols))
                    s.moe_x[...] = rms_norm(s.moe_x[...], row(vec, "moe_in_norm", m), eps, plan.moe.norm_width or None)
                if "shared_gate_up" in seg.families:
                    matmul(seg, layer, "shared_gate_up", s.normed,
                                swiglu_into(s.act, fam["shared_gate_up"].tile_cols))
                    matmul(seg, layer, "shared_down", s.act,
                                store_to(s.moe_out, h, fam["shared_down"].tile_cols))
                experts_x = s.moe_x[...] if "moe_in" in fam else s.normed[...]
                routed = moe_mod.moe_experts(plan.moe, moe_index, experts_x, e_gateup, e_down, s.moe,
                                             scales_hbm=moe_scales, bias_hbm=moe_bias)
                shared = None
                if "shared_gate_up" in seg.families:  # reference: routed + shared, then the residual
                    shared = s.moe_out[...]
                    if plan.moe.shared_gate:  # Qwen2-MoE: sigmoid(x . w) per row, from the routing
                        shared = moe_mod.shared_gate_of(plan.moe, s.moe) * shared
                if "moe_out" in fam:  # back to the hidden width (the experts' output in moe_x, read by now)
                    s.moe_x[...] = routed
                    matmul(seg, layer, "moe_out", s.moe_x, store_to(s.moe_out, h, fam["moe_out"].tile_cols))
                    routed = s.moe_out[...]
                if shared is not None:
                    routed = routed + shared
                if ar is not None:  # this device's experts / widths: a partial sum
                    s.partial[0:rows, 0:h] = routed
                elif staged:  # `normed` is read by now: the output, normalized (gated) whole
                    s.normed[...] = routed
                else:
                    s.resid[...] = s.resid[...] + routed
                reduce_into_resid(ffn_counter(layer), vec, "post_mlp_norm")
            return body

        # Hidden taps: tap k of the schedule (taps by layer) staged in slot k % 2 and DMA'd to its
        # place in the output while the layer runs; slot k % 2 is free once tap k - 2 has left.
        schedule = sorted(range(len(plan.taps)), key=lambda j: plan.taps[j])

        def tap_copy(k: int):
            return pltpu.make_async_copy(s.tap_stage.at[k % 2], taps_ref.at[schedule[k]], s.tap_sems.at[k % 2])

        def write_tap(k: int, value) -> None:
            if k >= 2:
                tap_copy(k - 2).wait()
            s.tap_stage[k % 2] = value.astype(s.tap_stage.dtype)
            tap_copy(k).start()

        def tapped(seg, body):
            """body, writing the residual entering each tapped layer of the segment first."""
            mine = [k for k in range(len(schedule)) if seg.first_layer <= plan.taps[schedule[k]] < seg.end_layer]
            if not mine:
                return body

            def with_taps(layer):
                for k in mine:
                    @pl.when(layer == plan.taps[schedule[k]])
                    def _(k=k):
                        write_tap(k, s.resid[...])
                body(layer)
            return with_taps

        for seg in plan.segments[:-1]:
            ring.layer_loop(seg, tapped(seg, dense_layer(seg) if seg.kind == "dense" else moe_layer(seg)))
        s.normed[...] = residual_norm(norms.norm_kind, s.resid[...], final_norm[...], eps, norms.width)
        if cfg.num_layers in plan.taps:  # the final norm's output, what the lm_head reads
            write_tap(schedule.index(plan.taps.index(cfg.num_layers)), s.normed[...])
        head_blocks = plan.families["lm_head"].col_blocks

        # This device's blocks go to its slice of the output (one device: the whole output).
        head_base = lax.axis_index(ar.axis) * head_blocks if ar is not None else 0

        def logits_copy(j):
            return pltpu.make_async_copy(s.logits, logits_ref.at[head_base + j], s.logits_sems.at[0])

        def write_logits(j, acc):
            """Block j leaves through the staging buffer while block j + 1 is computed."""
            if not (isinstance(j, int) and j == 0):
                logits_copy(j - 1).wait()  # the staging buffer is free once block j - 1 left
            s.logits[...] = soft_cap(acc, cfg.head.final_softcap)
            logits_copy(j).start()

        head_tc = plan.families["lm_head"].tile_cols

        def head_scales(j):  # block 0 is peeled off the lm_head loop: a Python int there
            lo = j * head_tc if isinstance(j, int) else pl.multiple_of(j * head_tc, head_tc)
            return ins["head_scales"][:, pl.ds(lo, head_tc)]

        ring.lm_head(s.normed, write_logits, head_scales if quantized else None)
        logits_copy(head_blocks - 1).wait()
        for k in range(max(0, len(schedule) - 2), len(schedule)):  # the last taps' DMAs
            tap_copy(k).wait()
        if ar is not None:  # every device ends with every device's vocabulary slice
            all_gather_slices(ar, logits_ref, head_blocks, s.gather_send_sems, s.gather_recv_sems)

    return kernel


def mla_rope_tables(positions: jax.Array, cfg, rope_alpha=None) -> tuple[jax.Array, jax.Array]:
    """positions [N] -> (cos, signed sin) [N, 128] of an MLA model's R-wide rotations (YaRN
    frequencies, cos and sin times the attention factor: `tpumk.model.mla.rope_rows`, the same
    ops so the tables are bitwise equal), tiled 128 / R times for `rope_heads` on a lane tile.
    `rope_alpha` (learned frequencies, Mistral Large 4): each frequency times exp(alpha), as
    `tpumk.model.mla.rope_freqs`."""
    from tpumk.model import yarn

    freqs = jnp.asarray(yarn.inv_freq(cfg.positions, cfg.qk_rope_head_dim), jnp.float32)
    if cfg.rope_learned_freqs:
        if rope_alpha is None:
            raise ValueError("mla_rope_tables: learned RoPE frequencies need the packed weights' rope_alpha")
        freqs = freqs * jnp.exp(rope_alpha.astype(jnp.float32))
    ang = positions.astype(jnp.float32)[:, None] * freqs
    factor = yarn.attention_factor(cfg.positions)
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1) * factor
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1) * factor
    half = cfg.qk_rope_head_dim // 2
    sin = jnp.concatenate([-sin[:, :half], sin[:, half:]], -1)
    reps = LANE // cfg.qk_rope_head_dim
    return jnp.tile(cos, (1, reps)), jnp.tile(sin, (1, reps))


def _interpret_mode(plan: Plan, detect_races: bool, portable: bool):
    """How the `cpu` target runs the kernel (TPU targets compile it: False).

    Pallas' TPU interpreter (InterpretParams) simulates DMAs, semaphores and VMEM and can detect
    races, but it runs through Python host callbacks, so its programs cannot be serialized.
    `portable` picks the older discharge interpreter (`interpret=True`), which lowers the same
    kernel to ordinary XLA ops: a program that jax.export and serialize_executable can ship."""
    if not plan.target.interpret:
        return False
    if portable:
        if detect_races:
            raise ValueError("race detection needs the TPU interpreter; it cannot be portable")
        return True
    return tpu_interpreter(detect_races)


def _pallas_call(plan: Plan, detect_races: bool, portable: bool = False):
    """The pallas_call, every spec read from `plan.contract`: in_specs from the operands'
    memory spaces, out_shape / out_specs from the outputs, the aliases, the scratch list."""
    c = plan.contract
    return pl.pallas_call(
        _kernel(plan),
        out_shape=tuple(shape_struct(b) for b in c.outputs),
        in_specs=[block_spec(b) for b in c.operands],
        out_specs=tuple(block_spec(b) for b in c.outputs),
        scratch_shapes=_scratch_shapes(plan),
        input_output_aliases=c.input_output_aliases,
        compiler_params=pltpu.CompilerParams(
            vmem_limit_bytes=plan.vmem_limit, **(COLLECTIVE_COMPILER_PARAMS if plan.all_reduce is not None else {})),

        interpret=_interpret_mode(plan, detect_races, portable),
        name=c.name,
    )


def _device_step(plan: Plan, call) -> Callable:
    """One device's glue around the kernel: (packed, tokens, positions, k, v, block_tables,
    lengths) -> (logits [B, q, cfg.vocab_size], k, v). On many devices `plan.cfg` is the
    device's part of the model (its vocab slice) and this runs inside `jax.shard_map`."""
    cfg, contract = plan.cfg, plan.contract
    quantized = plan.attention.quantized

    def run(packed, tokens, positions, caches, block_tables, lengths, states=None):
        """caches: (k, v), or (kv,) for a quantized cache; states: a hybrid's LinearStates (or
        None); both returned updated (the states' counts are the step's to set)."""
        b, t = tokens.shape
        n = b * t
        # a token id outside the vocabulary: zeros, as the reference; Gemma's factor as the reference
        x0 = embed(packed, tokens.reshape(n), cfg.head.embed_scale)
        if cfg.head.embed_norm:  # Muse Spark: the rows RMS-normalised without a weight (spark.embed_normed)
            x0 = rms_norm(x0, jnp.ones((1, x0.shape[-1]), jnp.float32), cfg.norms.rms_eps, cfg.norms.width)
        if plan.all_nope:  # every attention layer unrotated: cos 1, sin 0 (some of them: `rope_rows`)
            lanes = rope_table_lanes(cfg)
            cos, sin = jnp.ones((n, lanes), jnp.float32), jnp.zeros((n, lanes), jnp.float32)
        elif cfg.is_mla:
            cos, sin = mla_rope_tables(positions.reshape(n), cfg, packed.get("rope_alpha"))
        else:
            pos, lanes = cfg.positions, heads_per_lane_block(cfg.head_dim)
            cos, sin = rope_tables(positions.reshape(n), rope.inv_freq(pos, jnp), lanes, rope.cos_sin_scale(pos, jnp))
            if pos.rope_local_theta:  # the sliding layers' rows below the full layers' (`rope_rows`)
                cos_l, sin_l = rope_tables(positions.reshape(n), rope.inv_freq(pos, jnp, local=True), lanes,
                                           rope.cos_sin_scale(pos, jnp, local=True))
                cos, sin = jnp.concatenate([cos, cos_l]), jnp.concatenate([sin, sin_l])
        q_scale = rope.query_scale(cfg.positions, positions.reshape(n), jnp_dtype(cfg))
        if q_scale is not None:  # lane-replicated rows (contract: q_scale)
            q_scale = jnp.broadcast_to(q_scale[:, None], (n, QUERY_SCALE_LANES))
        log_pos = None
        if cfg.attention.query_log_scale:  # ln(1 + p) in the model dtype (mla.log_position_scale), lane-replicated
            lp = jnp.log1p(jnp.maximum(positions.reshape(n), 0).astype(jnp.float32)).astype(jnp_dtype(cfg))
            log_pos = jnp.broadcast_to(lp.astype(jnp.float32)[:, None], (n, QUERY_SCALE_LANES))
        values = {"step.positions": positions, "step.x0": x0, "step.cos": cos, "step.sin": sin, "step.q_scale": q_scale,
                  "step.log_pos": log_pos,
                  "cache.block_tables": block_tables, "cache.lengths": lengths,
                  **{f"cache.{name}": a for name, a in zip(("kv",) if quantized else ("k", "v", "index_keys"), caches)},
                  **({f"cache.states.{k}": getattr(states, k) for k in states._fields} if states is not None else {})}
        blocks, *updated = call(*(values[b.source] if b.source in values else _packed_leaf(packed, b.source)
                                  for b in contract.operands))
        taps = updated.pop() if plan.taps else None  # [T, n, H]: the last output
        if taps is not None:  # -> [B, q, T, H], the model's own hidden columns (a padded model's first)
            width = (plan.unpadded or plan.whole_model).hidden_size
            taps = jnp.swapaxes(taps[:, :, :width], 0, 1).reshape(b, t, len(plan.taps), width)
        n_states = len(STATE_ARRAYS) if plan.linear is not None else 0
        updated, state_out = updated[:len(updated) - n_states], updated[len(updated) - n_states:]
        if plan.cache_written_after_kernel:
            *pages, page_ids = updated
            kernel_caches = (caches[0], caches[2]) if plan.sparse is not None else caches  # (not KVCache.v)
            readers = [i for i in range(cfg.num_layers) if cfg.pattern.kv_source(i) != i]
            if readers:  # a layer reading another's rows writes no page (its output slots unset): kept as cached
                ids = jnp.clip(page_ids, 0, caches[0].shape[1] - 1)
                pages[0] = pages[0].at[:, jnp.asarray(readers)].set(jnp.swapaxes(caches[0][jnp.asarray(readers)][:, ids],
                                                                                 0, 1))
            updated = [commit_pages(cache, p, page_ids) for cache, p in zip(kernel_caches, pages)]
            if n_states:
                states = commit_states(states, state_out)
        elif n_states:
            states = states._replace(**dict(zip(("recurrent", "conv", "pending"), state_out)))
        if plan.sparse is not None:  # the latent cache, then the index keys: KVCache.v (empty) between them
            updated = [updated[0], caches[1], updated[1]]
        updated += caches[len(updated):]  # MLA: KVCache.v (empty) never enters the kernel
        # [devices * column blocks, n, tile_cols] -> [n, devices, padded slice] -> each slice's
        # own columns, side by side -> the model's vocabulary (local ops: every device holds all)
        d = plan.devices
        logits = blocks.reshape(d, -1, n, blocks.shape[-1]).transpose(2, 0, 1, 3).reshape(n, d, plan.vocab_pad)
        logits = logits[:, :, :cfg.vocab_size].reshape(n, d * cfg.vocab_size)[:, :plan.whole_model.vocab_size]
        return logits.reshape(b, t, -1), tuple(updated), states, taps

    return run


def _runs(layers) -> tuple[tuple[int, int], ...]:
    """Sorted layer indices as runs [first, end) of consecutive ones (one compare pair per run)."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


def commit_states(states, entries):
    """A pool update of a kernel that does not write the pool itself (many devices): each
    sequence's new entry [B, L lin, ...] (recurrent, window, pending) into its slot; a slot
    outside the pool writes nothing (as the kernel in place)."""
    ok = (states.slots >= 0) & (states.slots < states.num_slots)
    slots = jnp.where(ok, states.slots, states.num_slots)
    new = {k: getattr(states, k).at[:, slots].set(jnp.swapaxes(e, 0, 1), mode="drop")
           for k, e in zip(("recurrent", "conv", "pending"), entries)}
    return states._replace(**new)


def commit_pages(cache: jax.Array, pages: jax.Array, page_ids: jax.Array) -> jax.Array:
    """The cache update of a kernel that does not write the cache itself
    (`Plan.cache_written_after_kernel`): cache[l, page_ids[s]] = pages[s, l] for every layer
    l and patch slot s, a slot whose id is num_pages (none) dropped. The ids the kernel gives
    are distinct pages (one slot per page written, `attention._Stage.tokens`), so the order of
    the writes does not matter; on a donated cache XLA scatters in place. The pages come
    slot-major, the order XLA's scatter takes its updates in: given layer-major, XLA transposed
    them first, at batch 32 on the SparseCore as an async op whose HLO libtpu 0.0.52 cannot
    print back (so no report)."""
    return cache.at[:, page_ids].set(jnp.swapaxes(pages, 0, 1), mode="drop")


def make_decode_step(plan: Plan, detect_races: bool = False, donate_cache: bool = False, portable: bool = False,
                     nested: bool = False, mesh_devices: list | None = None, cache_split: str = "lanes"):
    """The plan's decode step: step(packed, tokens [B,q], positions [B,q], cache) -> (logits, cache)
    (with `plan.taps`: (logits, cache, taps [B, q, len(taps), H]), as `reference.decode_step`).

    `packed` is `tpumk.kernel.layout.pack_weights(plan, params)` (one device) or
    `pack_sharded(plan, params)` (many). On the `cpu` target the kernel
    runs in Pallas TPU interpret mode (`detect_races` turns on its DMA race detector).
    `donate_cache` donates the input cache so the in-place update needs no copy (serving; one
    device; many devices: no copy either, as the kernel leaves the cache to `commit_pages`);
    off by default so callers may keep using the cache they passed in. `portable` (cpu target
    only) interprets the kernel without host callbacks so the step can be exported.

    On the cpu target a call with concrete arrays compiles with `INTERPRET_COMPILER_OPTIONS`;
    traced (inside a caller's jit, make_jaxpr, eval_shape) it is the plain jit, as JAX takes
    compiler options only at the top level. `nested`: return the plain `jax.jit` object itself,
    for callers that need one (`compile_for`, `jax.export`).

    Many devices (`plan.devices` > 1): one SPMD program, `jax.shard_map` over the 1-D mesh
    `step_mesh(plan)` around the same kernel; the cache is in the sharded layout
    (`ShardingPlan.expand_cache`: KV heads along the last axis, split over the devices; MLA: N
    copies of the latent row, one per device, each device writing the same rows to its own; sparse
    attention's index keys likewise); the
    logits [B, q, V] are all-gathered inside the kernel, so every device holds them whole.
    `mesh_devices`: that mesh's devices in order (default: `step_mesh(plan)`'s; a caller's own
    mesh, e.g. vLLM's). `cache_split` "rows" (many devices, model-dtype K / V caches only): the
    caches come as `[L, pages, N * page_size, local width]`, device d's part of every page in
    rows [d * page_size, (d + 1) * page_size) (how vLLM's TPU runner splits a KV array: its third
    axis over the mesh), each device's shard being exactly its `[L, pages, page_size, local
    width]`; "lanes" (default): the layout above."""
    if cache_split not in ("lanes", "rows"):
        raise ValueError(f"cache_split {cache_split!r}: expected 'lanes' or 'rows'")
    if cache_split == "rows" and (plan.devices == 1 or plan.attention.quantized or plan.cfg.is_mla
                                  or plan.sparse is not None):
        raise ValueError("cache_split 'rows': a many-device step of a model-dtype K / V cache only")
    if plan.devices > 1 and portable:
        raise ValueError("a many-device step runs its collectives through the TPU interpreter; it cannot be portable")
    run = _device_step(plan, _pallas_call(plan, detect_races, portable))
    check, check_rows, check_states = _shape_check(plan), _cache_rows_check(plan, cache_split), _states_check(plan)
    check_index_keys = _index_keys_check(plan)

    device_run = run if plan.devices == 1 else _shard_mapped(plan, run, mesh_devices, cache_split)

    quantized = plan.attention.quantized

    def step(packed: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache | QuantizedKVCache):
        check(tokens)
        if isinstance(cache, QuantizedKVCache) != quantized:
            raise ValueError(f"decode step planned for a {plan.attention.kv_dtype or plan.cfg.dtype} KV cache, "
                             f"got a {'quantized' if isinstance(cache, QuantizedKVCache) else 'model-dtype'} one "
                             "(reference.init_cache(..., kv_dtype=...) makes either)")
        tokens, positions = tokens.astype(jnp.int32), positions.astype(jnp.int32)
        # As the reference: a token id outside the vocabulary runs at position -1 (writes nothing).
        positions = guard_positions(tokens, positions, plan.whole_model.vocab_size)
        arrays = (cache.kv,) if quantized else (cache.k, cache.v)
        check_rows(arrays)
        if plan.sparse is not None:  # sparse attention's index-key cache, updated in place too
            check_index_keys(cache.index_keys)
            arrays += (cache.index_keys,)
        check_states(cache.states)
        logits, arrays, states, taps = device_run(packed, tokens, positions, arrays,
                                                  cache.block_tables.astype(jnp.int32), cache.lengths.astype(jnp.int32),
                                                  cache.states)
        # As the reference: positions outside the pages write nothing and do not move lengths;
        # the step's tokens are each slot's pending rows now.
        # (the plan's page size: a "rows" cache's third axis holds every device's rows of a page)
        lengths = new_lengths(positions, cache.lengths, cache.block_tables.shape[1] * plan.page_size)
        if states is not None:
            states = step_counts(states, plan.q_len)
        new = cache._replace(kv=arrays[0], lengths=lengths, states=states) if quantized else \
            KVCache(*arrays[:2], cache.block_tables, lengths, states, *arrays[2:])
        return (logits, new, taps) if plan.taps else (logits, new)

    donate = (3,) if donate_cache else ()
    plain = jax.jit(step, donate_argnums=donate)
    if not plan.target.interpret or nested:
        return plain
    fast = jax.jit(step, donate_argnums=donate, compiler_options=INTERPRET_COMPILER_OPTIONS)
    # Many devices: the arguments placed as the step returns its cache (split over the mesh), so
    # the first call and the ones after it run one compiled program; unplaced arrays would make
    # the second call compile again (measured: 8 s of a 4-device tiny-moe step).
    shardings = jax.tree.map(lambda s: s.sharding, step_specs(plan)) \
        if plan.devices > 1 and mesh_devices is None and cache_split == "lanes" else None

    @functools.wraps(step)
    def interpreted_step(*args):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return plain(*args)
        if shardings is not None and jax.tree.structure(args) == jax.tree.structure(shardings):
            args = jax.device_put(args, shardings)
        return fast(*args)

    return interpreted_step


def _shard_mapped(plan: Plan, run: Callable, mesh_devices: list | None = None, cache_split: str = "lanes") -> Callable:
    """`run` (one device's glue and kernel) as one SPMD program over `step_mesh(plan)` (or a 1-D
    mesh of `mesh_devices`): packed weights split along their leading device axis (the
    embedding whole), the step inputs replicated, the caches split along their last axis (or,
    `cache_split` "rows", their third: make_decode_step); the logits are all-gathered in the
    kernel, so every device holds the same [B, q, V]."""
    from jax.sharding import PartitionSpec as P

    from tpumk.plan.sharding import MESH_AXIS

    mesh = step_mesh(plan, mesh_devices)
    kv_spec = P(None, None, MESH_AXIS, None) if cache_split == "rows" else P(None, None, None, MESH_AXIS)

    def body(packed, tokens, positions, caches, block_tables, lengths, states):
        local = {key: val if key == "embed" else jax.tree.map(lambda a: a[0], val) for key, val in packed.items()}
        return run(local, tokens, positions, caches, block_tables, lengths, states)

    def without_values(packed, tokens, positions, caches, block_tables, lengths, states):
        k_cache, *rest = caches  # (sparse attention: the index-key cache after the latent one)
        empty = jnp.zeros((*k_cache.shape[:3], 0), k_cache.dtype)
        logits, (k_cache, _, *rest), states, taps = body(packed, tokens, positions, (k_cache, empty, *rest),
                                                         block_tables, lengths, states)
        return logits, (k_cache, *rest), states, taps

    def sharded(packed: dict, tokens, positions, caches, block_tables, lengths, states=None):
        """caches: (k, v) or a quantized cache's (kv,), each split along its last axis (kv heads);
        states: a hybrid's pool in the sharded layout (`ShardingPlan.expand_states`)."""
        weights = {key: P() if key == "embed" else jax.tree.map(lambda _: P(MESH_AXIS), val)
                   for key, val in packed.items()}
        fn, kept = body, caches
        if len(caches) >= 2 and caches[1].size == 0:  # MLA's empty value cache stays outside: jax 0.11.2's Shardy canonicalizer
            # segfaults on a zero-size operand a manual computation returns unchanged (checked 2026-12-05)
            fn, kept = without_values, (caches[0], *caches[2:])
        specs = tuple(kv_spec for _ in kept)
        state_specs = None if states is None else state_partition(states)
        # the taps are the residual every device holds whole: each device writes the same rows
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=(weights, P(), P(), specs, P(), P(), state_specs),
                               out_specs=(P(), specs, state_specs, P() if plan.taps else None), check_vma=False)
        # a caller tracing under its own mesh of these devices (vLLM's ('data', 'model')): the
        # step's 1-D mesh in its place while it traces (shard_map wants the context's mesh)
        with _step_mesh_context(mesh):
            logits, out, states, taps = mapped(packed, tokens, positions, kept, block_tables, lengths, states)
        if len(out) < len(caches):  # the empty value cache back in its place
            out = (out[0], caches[1], *out[1:])
        return logits, tuple(out), states, taps

    return sharded


def _step_mesh_context(mesh):
    """The abstract mesh of `mesh` as the trace's context when the caller set another of its size
    (`jax.set_mesh` around its jit); nothing otherwise."""
    import contextlib

    from jax._src.mesh import get_abstract_mesh

    ctx = get_abstract_mesh()
    if ctx.empty or ctx == mesh.abstract_mesh:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def state_partition(states):
    """How a hybrid's pool splits over the step's mesh: recurrent states by value head (axis 2),
    convolution windows and pending rows by their device-major last axis; slots and counts whole."""
    from jax.sharding import PartitionSpec as P

    from tpumk.plan.sharding import MESH_AXIS

    return states._replace(recurrent=P(None, None, MESH_AXIS), conv=P(None, None, None, MESH_AXIS),
                           pending=P(None, None, None, MESH_AXIS), counts=P(), slots=P())


def _shape_check(plan: Plan) -> Callable:
    def check(tokens) -> None:
        if tuple(tokens.shape) != (plan.batch, plan.q_len):
            raise ValueError(f"decode step planned for tokens [{plan.batch}, {plan.q_len}], got "
                             f"[{', '.join(map(str, tokens.shape))}]")
    return check


def _cache_rows_check(plan: Plan, cache_split: str = "lanes") -> Callable:
    """Refuse, in one line, cache arrays whose layers, page size or row lanes are not the
    plan's (`step_specs`; the number of pages may differ; `cache_split` "rows": make_decode_step)."""
    names = ("kv",) if plan.attention.quantized else ("k", "v")
    want: list = []

    def check(arrays) -> None:
        if not want:
            cache = step_specs(plan)[3]
            want.extend(getattr(cache, n).shape for n in names)
            if cache_split == "rows":  # [L, pages, N * page_size, width / N]
                n = plan.devices
                want[:] = [(w[0], w[1], n * w[2], w[3] // n) for w in want]
        for name, a, w in zip(names, arrays, want):
            if (a.ndim, a.shape[0], *a.shape[2:]) != (len(w), w[0], *w[2:]):
                raise ValueError(f"decode step: cache.{name} has shape {list(a.shape)}, expected [{w[0]}, num_pages, "
                                 f"{', '.join(map(str, w[2:]))}] (reference.init_cache makes it; an MLA latent row is "
                                 "stored lane-padded)")
    return check


def _index_keys_check(plan: Plan) -> Callable:
    """Refuse, in one line, a sparse model's index-key cache that is missing or not of the plan's
    layers, page size and key width (the number of pages may differ; many devices: a copy of the
    key per device side by side, `ShardingPlan.expand_kv`)."""
    def check(keys) -> None:
        g = plan.sparse
        want = (g.num_layers, g.page_size, plan.devices * g.index_head_dim)
        if keys is None or keys.ndim != 4 or (keys.shape[0], *keys.shape[2:]) != want:
            got = "none" if keys is None else f"shape {list(keys.shape)}"
            raise ValueError(f"decode step: cache.index_keys is {got}, expected [{want[0]}, num_pages, {want[1]}, "
                             f"{want[2]}] (reference.init_cache makes it for a sparse-attention model)")
    return check


def _states_check(plan: Plan) -> Callable:
    """Refuse, in one line, a state pool that is missing, unexpected, or not of the plan's
    shapes (`LinearGeometry.pool_shapes`; the number of slots may differ)."""
    def check(states) -> None:
        if plan.linear is None:
            if states is not None:
                raise ValueError("decode step: the cache carries a state pool, but the model has no linear layers")
            return
        if states is None:
            raise ValueError("decode step: model has linear-attention layers: the cache needs its state pool "
                             "(reference.init_cache(..., pending=q_len) makes it)")
        want = plan.linear.pool_shapes() if plan.devices == 1 else step_specs(plan)[3].states._asdict()
        for name in ("recurrent", "conv", "pending"):
            a, w = getattr(states, name), want[name]
            w = tuple(getattr(w, "shape", w))
            if tuple(a.shape) != w:
                raise ValueError(f"decode step: states.{name} has shape {list(a.shape)}, expected {list(w)} (the "
                                 f"plan's {plan.linear.num_slots} slots of pending = q_len = {plan.q_len} rows: "
                                 "reference.init_cache(..., pending=q_len, num_slots=...))")
        if states.slots.shape != (plan.batch,):
            raise ValueError(f"decode step: states.slots has shape {list(states.slots.shape)}, expected [{plan.batch}]")
    return check


def step_mesh(plan: Plan, devices: list | None = None):
    """The 1-D device mesh of a many-device step: `plan.devices` devices of its target
    (`tpumk.targets.mesh_devices`: attached TPUs, deviceless stand-ins, or host CPU devices), or
    the given `devices` in their order (a caller's own mesh, e.g. vLLM's)."""
    import numpy as np
    from jax.sharding import Mesh

    from tpumk.plan.sharding import MESH_AXIS
    from tpumk.targets import mesh_devices

    if devices is not None:
        if len(devices) != plan.devices:
            raise ValueError(f"a mesh of {len(devices)} devices for a step planned for {plan.devices}")
        return Mesh(np.asarray(list(devices)), (MESH_AXIS,))
    return Mesh(np.asarray(mesh_devices(plan.target, plan.devices)), (MESH_AXIS,))


def _packed_leaf(packed: dict, source: str):
    """packed["a"]["b"] for source "packed.a.b"."""
    kind, *path = source.split(".")
    assert kind == "packed", source
    for k in path:
        packed = packed[k]
    return packed


def step_specs(plan: Plan) -> tuple:
    """ShapeDtypeStructs of (packed, tokens, positions, cache) for a deviceless compile, read from
    the contract: the packed weights' leaves, the positions operand's shape for tokens and
    positions, and the cache operands. Many devices: the GLOBAL shapes, each with the
    NamedSharding of `step_mesh(plan)` the step takes it in (weights stacked per device, the
    embedding and the step inputs replicated, the cache split along its last axis)."""
    c = plan.contract
    states = None
    if plan.linear is not None:
        states = LinearStates(*(shape_struct(c.operand(n)) for n in ("lin_recurrent", "lin_window", "lin_pending",
                                                                      "state_counts", "state_slots")))
    if plan.attention.quantized:  # one device's packed layout (many: each device's, side by side)
        cache = QuantizedKVCache(*(shape_struct(c.operand(n)) for n in ("kv_cache", "block_tables", "lengths")),
                                 layout=plan.attention.kv_layout, states=states)
    elif plan.cfg.is_mla:  # the empty value cache of an MLA model is not an operand
        k = shape_struct(c.operand("k_cache"))
        cache = KVCache(k, jax.ShapeDtypeStruct((*k.shape[:3], 0), k.dtype),
                        *(shape_struct(c.operand(n)) for n in ("block_tables", "lengths")), states,
                        shape_struct(c.operand("index_cache")) if plan.sparse is not None else None)
    else:
        cache = KVCache(*(shape_struct(c.operand(n)) for n in ("k_cache", "v_cache", "block_tables", "lengths")), states)
    tok = shape_struct(c.operand("positions"))
    if plan.devices == 1:
        return packed_specs(plan), tok, tok, cache
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpumk.plan.sharding import MESH_AXIS

    mesh, n = step_mesh(plan), plan.devices

    def spec(shape, dtype, p):
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, p))

    packed = {key: jax.tree.map(lambda a: spec((n, *a.shape), a.dtype, P(MESH_AXIS)), val)
              for key, val in packed_specs(plan).items() if key != "embed"}
    model = plan.whole_model
    packed["embed"] = spec((model.vocab_size, model.hidden_size), jnp_dtype(model), P())
    wide = {}
    names = ("kv",) if plan.attention.quantized else ("k", "v") + (("index_keys",) if plan.sparse is not None else ())
    for name in names:  # (an MLA model's latent and index-key caches: a copy per device, side by side)
        a = getattr(cache, name)
        wide[name] = spec((*a.shape[:-1], n * a.shape[-1]), a.dtype, P(None, None, None, MESH_AXIS))
    rep = [spec(a.shape, a.dtype, P()) for a in (tok, cache.block_tables, cache.lengths)]
    if states is not None:  # the sharded pool: each device's part side by side along its split axis
        parts = state_partition(states)

        def whole(a, p):
            axis = next((i for i, x in enumerate(p) if x is not None), None)
            shape = a.shape if axis is None else tuple(n * x if i == axis else x for i, x in enumerate(a.shape))
            return spec(shape, a.dtype, p)
        states = LinearStates(*(whole(a, p) for a, p in zip(states, parts)))
    return packed, rep[0], rep[0], cache._replace(**wide, block_tables=rep[1], lengths=rep[2], states=states)
