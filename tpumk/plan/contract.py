"""The megakernel's contract, defined once: what its single `pallas_call` takes, returns and allocates.

`kernel_contract(plan)` (also `plan.contract`) lists, in order, every operand of the kernel
with its shape, dtype, memory space and where the decode step gets it; the outputs and which
input each aliases; and every scratch buffer (VMEM, SMEM, DMA semaphores), the stages' own
included. The kernel builds its BlockSpecs, `scratch_shapes` and ref unpacking from it
(`tpumk.kernel.megakernel`), the step's call site and `step_specs` read it, the packed-weight
shapes (`tpumk.kernel.layout.packed_specs`) come from it, and the plan's VMEM breakdown sums
its VMEM buffers, so nothing is kept in sync by hand.

Notation: N = batch * q_len token rows (b-major: row b*q_len + i), H hidden, D head_dim,
Hq*D = q_size, Hkv*D = kv_size, W = max(H, D) rounded up to 128, L layers, P page_size,
dt the model dtype. Operands, in order:

    block_tables  smem  int32 [B, pages_per_seq]      cache.block_tables
    lengths       smem  int32 [B]                     cache.lengths (tokens cached before the step)
    positions     smem  int32 [B, q_len]              the new tokens' positions
    x0            vmem  f32 [N, H]                    embedded token rows (gathered by the glue)
    cos, sin      vmem  f32 [N, D]                    RoPE rows (sin signed, `norms.rope_tables`;
                                                      head_dim 64: each row twice, D = 128)
    q_scale       vmem  f32 [N, 128]                  position-scaled queries only (query_scale_beta):
                                                      each row's factor (`rope.query_scale`), lane-replicated
    final_norm    vmem  f32 [1, H]                    packed.final_norm
    layer_vectors hbm   f32 [L, 8, W]                 packed.layer_vectors (norm rows, see layout)
    <family>      hbm   dt  packed tiles              packed.<family> for each streamed family, in
                                                      RING_FAMILIES order (this module)
    scales_<family> hbm f32 scale tiles              group-scaled rings (fp8-b128) only, same order
    layer_scales  hbm   f32 [L, 1, S]                 column-scaled rings (int8, fp8) only
    head_scales   vmem  f32 [1, padded vocab]         column-scaled rings only
    router, e_gateup, e_down  hbm  dt                 packed.moe.* (MoE models only; quantized
                                                      experts: codes, then e_gateup_scales, e_down_scales
                                                      (nvfp4: then e_global_scales);
                                                      expert biases: then e_gateup_bias)
    k_cache, v_cache hbm dt [L, num_pages, P, Hkv*D]  cache.k / cache.v, aliased to outputs 1, 2
    --kv-dtype fp8 / int8 instead: ONE operand kv_cache hbm [L, num_pages, P / G, packed lanes]
                                                      (cache.kv, tpumk.model.kv_quant.PagedLayout),
                                                      aliased to output 1
MLA models (tpumk.kernel.mla_attention): the families q_a, q_b (or q), kv_a, uk, uv, o instead of
qkv, o; cos / sin [N, 128] (R-wide YaRN rotations tiled over a lane tile); ONE cache operand
k_cache [L, num_pages, P, C + R rounded up to 128 lanes] (the latent rows, zero pad lanes), aliased to output 1; `KVCache.v` (empty)
stays outside the kernel.

Sparse attention (DeepSeek-V3.2, GLM-5; tpumk.kernel.sparse_attention): the families idx_k, idx_q
too (stacked over the layers with an indexer); idx_weights hbm f32 [indexer layers, H, Hi padded]
and idx_norm hbm f32 [indexer layers, 8, Di padded] after the packed weights (after the MoE
operands); and after k_cache a second cache operand index_cache [indexer layers, num_pages, P,
Di] (cache.index_keys), aliased to output 2; scratch "sparse.<name>" (`SparseGeometry.scratch`).

With `BuildSpec.taps` the last output is `taps` hbm dt [T, N, H]: the residual entering each
tapped layer (tap L: the final norm's output), staged in VMEM and written by DMA.

Outputs: logits f32 [devices x lm_head column blocks, N, lm_head tile_cols] (block j of
device d's vocabulary slice at d * column blocks + j; one device: block j = vocab columns
j*tile_cols ..; many: every device ends with every slice, all-gathered in the kernel), then the
caches (updated in place). Many devices (`Plan.cache_written_after_kernel`): the caches are
read-only operands, nothing aliases, and the outputs after the logits are each cache's pages
this step patched, `<k|v|kv>_pages` [B*q patch slots, L, page], and `page_ids` smem int32
[B*q], the page each slot goes to (num_pages: none); the step scatters them into the cache. Scratch: see `_kernel_scratch`, then
the attention stage's (`AttentionGeometry.scratch`) and the MoE stage's (`MoEGeometry.scratch`),
named "attention.<name>" / "moe.<name>", and on many devices the all-reduce's
(`AllReduceGeometry.scratch`, "collectives.<name>") with the `partial` buffer it reduces.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpumk.plan.geometry import (F32_SUBLANES, LAYER_VECTOR_ROWS, QUERY_SCALE_LANES, Buffer, dma_sems, hbm, mla_dims,
                                 rope_table_lanes, smem, vmem)

if TYPE_CHECKING:
    from tpumk.plan.plan import Plan

# Streamed matrix families in the order their packed arrays are kernel operands.
RING_FAMILIES = ("qkv", "q_a", "q_b", "q", "kv_a", "idx_k", "idx_q", "uk", "uv", "o", "lin_in", "lin_fb", "lin_gb", "lin_out", "gate_up",
                 "down", "moe_in", "shared_gate_up", "shared_down", "moe_out", "lm_head")
# The MLA matrices in stream order (tpumk.kernel.megakernel's MLA attention block): the two
# projections of the layer's input (q_a, or a plain q; kv_a: on many devices with the latent
# split, their slices are all-gathered together next), q_b after the q_a norm, the per-head
# absorbed W_UK ("uk") and W_UV ("uv", block-diagonal families), then o.
# Sparse attention (tpumk.kernel.sparse_attention): the indexer's key projection after kv_a (it
# reads the layer's input too), its query projection after q_b (it reads the normed q latent).
MLA_FAMILIES = ("q_a", "q", "kv_a", "idx_k", "q_b", "idx_q", "uk", "uv")
MOE_OPERANDS = ("router", "e_gateup", "e_down")
MOE_SCALE_OPERANDS = ("e_gateup_scales", "e_down_scales")  # quantized experts only
MOE_GLOBAL_OPERANDS = ("e_global_scales",)  # nvfp4 experts only: their float32 global scales
MOE_BIAS_OPERANDS = ("e_gateup_bias",)  # expert biases only (gpt-oss)
# The plan's VMEM breakdown keys, in report order (see plan._vmem_breakdown).
VMEM_COMPONENTS = ("weight_ring", "layer_vectors", "activations", "inputs", "logits_staging", "attention", "sparse",
                   "linear", "moe", "collectives")
# Components whose scratch a stage module takes as a list in its own order (named "<stage>.<name>").
STAGES = ("attention", "sparse", "linear", "moe", "collectives")
# Sparse attention's per-layer float32 operands (packed.<name>): weights_proj, the key LayerNorm's rows.
SPARSE_OPERANDS = ("idx_weights", "idx_norm")


def kv_producers(cfg) -> tuple[int, ...]:
    """The MLA layers whose latent rows a later layer reads (kv_source_layers, Mistral Large 4):
    the kernel keeps their step's rows (`mla_shared`) for the layers that read them."""
    return tuple(sorted({cfg.pattern.kv_source(i) for i in range(cfg.num_layers)
                         if cfg.pattern.kv_source(i) != i}))
# A hybrid model's state pool (tpumk.model.linear_attention.LinearStates) as kernel operands:
# each sequence's slot and each slot's pending count (SMEM), then the pool's arrays (HBM).
STATE_SCALARS = ("state_slots", "state_counts")
STATE_ARRAYS = ("lin_recurrent", "lin_window", "lin_pending")


@dataclass(frozen=True)
class KernelContract:
    """Operands, outputs, aliases and scratch of the megakernel's pallas_call, in call order."""

    name: str  # the pallas_call's name
    operands: tuple[Buffer, ...]
    outputs: tuple[Buffer, ...]
    aliases: tuple[tuple[int, int], ...]  # (operand index, output index): updated in place
    scratch: tuple[Buffer, ...]
    packed: tuple[Buffer, ...]  # leaves of `pack_weights`' pytree (source "packed.<key>[.<key>]")

    # ---- lookups
    def operand(self, name: str) -> Buffer:
        return self.operands[self.operand_index(name)]

    def operand_index(self, name: str) -> int:
        for i, b in enumerate(self.operands):
            if b.name == name:
                return i
        raise KeyError(name)

    def stage_scratch(self, component: str) -> tuple[Buffer, ...]:
        """The scratch buffers of one stage ("attention", "moe"), in the stage's order."""
        return tuple(b for b in self.scratch if b.component == component)

    @property
    def input_output_aliases(self) -> dict[int, int]:
        return dict(self.aliases)

    # ---- budgets
    def vmem_scratch_bytes(self) -> int:
        """Bytes of every VMEM scratch buffer, tile-padded (what the kernel allocates)."""
        return sum(b.nbytes for b in self.scratch if b.space == "vmem")

    def vmem_operand_bytes(self) -> int:
        """Bytes of the operands Pallas places in VMEM for the kernel, tile-padded."""
        return sum(b.nbytes for b in self.operands if b.space == "vmem")

    def vmem_by_component(self) -> dict[str, int]:
        """VMEM bytes of the scratch and VMEM operands, summed per component (VMEM_COMPONENTS
        order; components with no buffer are left out)."""
        sums: dict[str, int] = {}
        for b in self.scratch + self.operands:
            if b.space == "vmem":
                sums[b.component] = sums.get(b.component, 0) + b.nbytes
        unknown = set(sums) - set(VMEM_COMPONENTS)
        assert not unknown, f"VMEM buffers outside the breakdown's components: {sorted(unknown)}"
        return {k: sums[k] for k in VMEM_COMPONENTS if k in sums}

    def smem_bytes(self) -> int:
        return sum(b.nbytes for b in self.scratch + self.operands if b.space == "smem")

    def dma_semaphores(self) -> int:
        return sum(b.count for b in self.scratch if b.space == "semaphore")

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "operands": [b.summary() for b in self.operands],
                "outputs": [b.summary() for b in self.outputs],
                "aliases": [list(a) for a in self.aliases], "scratch": [b.summary() for b in self.scratch],
                "vmem_scratch_bytes": self.vmem_scratch_bytes(), "vmem_operand_bytes": self.vmem_operand_bytes(),
                "smem_bytes": self.smem_bytes(), "dma_semaphores": self.dma_semaphores()}


def _with(buf: Buffer, **changes: Any) -> Buffer:
    return dataclasses.replace(buf, **changes)


def packed_buffers(plan: Plan) -> tuple[Buffer, ...]:
    """Leaves of `pack_weights(plan, ...)` (all in HBM; see tpumk.kernel.layout for layouts)."""
    cfg, dt = plan.cfg, plan.cfg.dtype
    out = [
        hbm("embed", (cfg.vocab_size, cfg.hidden_size), dt, "[V, H]: rows gathered by the glue"),
        hbm("final_norm", (1, cfg.hidden_size), "float32", "[1, H]"),
        hbm("layer_vectors", (cfg.num_layers, LAYER_VECTOR_ROWS, plan.vector_width), "float32",
            "[L, 8, W]: rows attn_norm, mlp_norm, q_norm, k_norm, qkv_bias, post_attn_norm, post_mlp_norm, sinks"),
    ]
    for name in RING_FAMILIES:
        if name in plan.families:
            fam = plan.families[name]
            tiles = "[tiles, rows, cols]" if name == "lm_head" else "[matrices, tiles, rows, cols]"
            out.append(hbm(name, fam.packed_shape, plan.ring_dtype, f"{tiles}, tile t = column block t // row_blocks"))
    if plan.ring_grouped:
        for name in RING_FAMILIES:
            if name in plan.families:
                fam = plan.families[name]
                out.append(hbm(f"scales_{name}", fam.packed_scale_shape, "float32",
                               f"scale tiles in the tiles' order: row g = tile rows [{fam.group}g, {fam.group}(g+1))"))
    if plan.column_scaled:
        out.append(hbm("layer_scales", (cfg.num_layers, 1, plan.scales_width), "float32",
                       "[L, 1, S]: each layer family's column scales at plan.scale_offsets (packed column order)"))
        out.append(hbm("head_scales", (1, plan.vocab_pad), "float32", "[1, padded vocab]: the lm_head's column scales"))
    if plan.sparse is not None:
        g = plan.sparse
        out += [hbm("idx_weights", (g.num_layers, g.hidden, g.weight_lanes), "float32",
                    "[indexer layer, H, Hi (| pad)]: weights_proj (float32, as transformers keeps it)"),
                hbm("idx_norm", (g.num_layers, F32_SUBLANES, g.norm_lanes), "float32",
                    "[indexer layer, 8, lanes]: rows 0, 1 the key LayerNorm's weight and bias; Mistral Large 4: "
                    "rows 2, 3 the queries' per-head log scale and bias, rows 4, 5 their input LayerNorm's")]
    out = [_with(b, source=f"packed.{b.name}") for b in out]
    if plan.moe is not None:
        out += [_with(b, source=f"packed.moe.{b.name}") for b in plan.moe.packed()]
    return tuple(_with(b, component="packed") for b in out)


def _operands(plan: Plan, packed: dict[str, Buffer]) -> list[Buffer]:
    cfg, n = plan.cfg, plan.rows
    h = cfg.hidden_size
    d = rope_table_lanes(cfg)  # 64-wide heads: rows tiled to 128 lanes; MLA: one lane tile
    # rope_local_theta: the full layers' N rows, then the sliding layers' N
    tables, rows = (2, "[2N, D] full layers' then sliding layers' ") if cfg.positions.rope_local_theta else (1, "[N, D] ")
    cache = (cfg.kv_layers, plan.num_pages, plan.page_size, cfg.attention.kv_size)
    out = [
        _with(smem("block_tables", (plan.batch, plan.pages_per_seq), "int32", "[B, pages_per_seq] page ids"),
              source="cache.block_tables"),
        _with(smem("lengths", (plan.batch,), "int32", "[B] tokens cached before the step"), source="cache.lengths"),
        _with(smem("positions", (plan.batch, plan.q_len), "int32", "[B, q_len] positions of the new tokens"),
              source="step.positions"),
        _with(vmem("x0", (n, h), "float32", "[N, H] embedded rows, b-major"), source="step.x0", component="inputs"),
        _with(vmem("cos", (n * tables, d), "float32", rows + "cos rows"), source="step.cos", component="inputs"),
        _with(vmem("sin", (n * tables, d), "float32", rows + "signed sin rows"), source="step.sin",
              component="inputs"),
        *([_with(vmem("q_scale", (n, QUERY_SCALE_LANES), "float32",
                      "[N, 128] each row's query factor (position-scaled queries), lane-replicated"),
                 source="step.q_scale", component="inputs")] if cfg.positions.query_scale_beta else []),
        *([_with(vmem("log_pos", (n, QUERY_SCALE_LANES), "float32",
                      "[N, 128] each row's ln(1 + position) in the model dtype (query_log_scale), lane-replicated"),
                 source="step.log_pos", component="inputs")] if cfg.attention.query_log_scale else []),
        _with(packed["packed.final_norm"], space="vmem", component="inputs"),
        _with(packed["packed.layer_vectors"], component="layer_vectors"),
    ]
    out += [_with(packed[f"packed.{f}"], component="weights") for f in RING_FAMILIES if f in plan.families]
    if plan.ring_grouped:
        out += [_with(packed[f"packed.scales_{f}"], component="weights") for f in RING_FAMILIES if f in plan.families]
    if plan.column_scaled:
        out += [_with(packed["packed.layer_scales"], component="layer_vectors"),
                _with(packed["packed.head_scales"], space="vmem", component="inputs")]
    if plan.moe is not None:
        names = MOE_OPERANDS + (MOE_SCALE_OPERANDS if plan.moe.quantized else ()) \
            + (MOE_GLOBAL_OPERANDS if plan.moe.nv else ()) + (MOE_BIAS_OPERANDS if plan.moe.expert_bias else ())
        out += [_with(packed[f"packed.moe.{k}"], component="moe") for k in names]
    if plan.sparse is not None:
        out += [_with(packed[f"packed.{k}"], component="sparse") for k in SPARSE_OPERANDS]
    if plan.linear is not None:
        out += _state_operands(plan)
    att = plan.attention
    if cfg.is_mla and not att.quantized:  # one latent cache; KVCache.v (empty) stays outside the kernel
        out.append(_with(hbm("k_cache", (*cache[:3], att.page_lanes), cfg.dtype,
                             "[L, num_pages, page_size, C + R lane-padded]: c_kv | k_rope per token, then zeros"),
                         source="cache.k", component="kv_cache"))
        if plan.sparse is not None:  # the index-key cache, the last operand (aliased to the last cache output)
            g = plan.sparse
            out.append(_with(hbm("index_cache", (g.num_layers, plan.num_pages, plan.page_size, g.index_head_dim),
                                 cfg.dtype, "[indexer layer, num_pages, page_size, Di]: each token's index key"),
                             source="cache.index_keys", component="kv_cache"))
        return out
    if att.quantized:  # tpumk.model.kv_quant.PagedLayout: K, V codes (MLA: the latent row's) and exponents
        out.append(_with(hbm("kv_cache", (*cache[:2], att.page_rows, att.page_lanes), att.cache_dtype,
                             "[L, num_pages, page_size / kv_group, packed row]: kv_group tokens' K | V codes "
                             "(MLA: one token's c_kv | k_rope codes), then their exponent bytes"),
                         source="cache.kv", component="kv_cache"))
        return out
    for name in ("k", "v"):
        out.append(_with(hbm(f"{name}_cache", cache, att.cache_dtype, "[L, num_pages, page_size, Hkv*D], heads along lanes"),
                         source=f"cache.{name}", component="kv_cache"))
    return out


def _state_operands(plan: Plan) -> list[Buffer]:
    """A hybrid model's state pool: slots and counts in SMEM, the arrays in HBM (the last
    operands before the KV cache's)."""
    g = plan.linear
    shapes = g.pool_shapes()
    return [
        _with(smem("state_slots", (plan.batch,), "int32", "[B] each sequence's slot in the state pool"),
              source="cache.states.slots"),
        _with(smem("state_counts", (g.num_slots,), "int32", "[S] pending rows each slot replays first"),
              source="cache.states.counts"),
        _with(hbm("lin_recurrent", shapes["recurrent"], "float32", "[L lin, slot, value head, key, value] states"),
              source="cache.states.recurrent", component="state_pool"),
        _with(hbm("lin_window", shapes["conv"], "float32", "[L lin, slot, tap, C] convolution windows, oldest first"),
              source="cache.states.conv", component="state_pool"),
        _with(hbm("lin_pending", shapes["pending"], "float32", "[L lin, slot, row, pending row] tokens not yet applied"),
              source="cache.states.pending", component="state_pool"),
    ]


def _kernel_scratch(plan: Plan) -> list[Buffer]:
    """The megakernel's own scratch (before the stages'), with the component each is counted in."""
    cfg, n = plan.cfg, plan.rows
    h = cfg.hidden_size

    def comp(component: str, *bufs: Buffer) -> list[Buffer]:
        return [_with(b, component=component) for b in bufs]

    out = comp("weight_ring",
               vmem("ring", (plan.ring_depth, plan.slot_rows, plan.slot_cols), plan.ring_dtype,
                    "[slot, rows, cols]: global tile g in slot g % ring_depth, at the top-left"),
               dma_sems("ring_sems", (plan.ring_depth,), "one per ring slot"))
    out += comp("layer_vectors",
                vmem("vectors", (2, LAYER_VECTOR_ROWS, plan.vector_width), "float32",
                     "[layer % 2, 8, W]: this layer's norm rows and the next one's, prefetched"),
                dma_sems("vector_sems", (2,), "one per vector slot"))
    if plan.ring_grouped:
        rows = max(f.scale_rows for f in plan.families.values())
        out += comp("weight_ring",
                    vmem("tile_scales", (plan.ring_depth, rows, plan.slot_cols), "float32",
                         "[slot, groups, cols]: the scales of the tile in the same ring slot"),
                    dma_sems("tile_scale_sems", (plan.ring_depth,), "one per ring slot"))
    if plan.column_scaled:
        out += comp("layer_vectors",
                    vmem("scales", (2, 1, plan.scales_width), "float32",
                         "[layer % 2, 1, S]: this layer's column scales and the next one's, prefetched"),
                    dma_sems("scale_sems", (2,), "one per scale slot"))
    act = [
        vmem("resid", (n, h), "float32", "[N, H] residual stream"),
        vmem("normed", (n, h), "float32", "[N, H] normed input of the current matmul family"),
    ]
    if cfg.is_mla:
        fams, dims = plan.families, mla_dims(cfg)
        if "q_a" in fams:
            act.append(vmem("mla_qa", (n, dims["q_lora"]), "float32", "[N, q_lora (| pad)] q_a output, normed in place"))
        qf = fams["q_b"] if "q_b" in fams else fams["q"]
        if plan.latent_split:  # this device's q_a | kv_a columns, then every device's (all-gathered)
            part = latent_part_width(plan)
            act += [vmem("mla_part", (n, part), "float32", "[N, this device's q_a columns (| pad) | kv_a's (| pad)]"),
                    vmem("mla_gather", (plan.devices, n, part), "float32",
                         "[device, N, its q_a | kv_a columns]: the latent slices, all-gathered")]
        act += [
            vmem("mla_q", (n, qf.m_pad), "float32", "[N, per head nope (128-lane padded) | all heads' rope (| pad)]"),
            vmem("mla_kv", (n, dims["kv_a_cols"]), "float32", "[N, c_kv (| pad) | k_rope (| pad)] kv_a output"),
            vmem("mla_row", (n, cfg.attention.kv_cache_width), "float32", "[N, C + R] this step's latent cache rows"),
            *([vmem("mla_shared", (len(kv_producers(cfg)), n, cfg.attention.kv_cache_width), "float32",
                    "[producer, N, C + R]: the step's rows of each layer another layer reads (kv_source_layers)")]
              if kv_producers(cfg) else []),
            vmem("mla_qlat", (n, fams["uk"].m_pad), "float32", "[N, per head q_nope . W_UK (128-lane padded)]"),
            vmem("mla_olat", (n, fams["uv"].k_pad), "float32", "[N, per head latent output (pad lanes 0)]"),
            vmem("attn_out", (n, fams["o"].k_pad), "float32", "[N, per head value output (128-lane padded)]"),
        ]
    else:
        act += [
            vmem("qkv", (n, plan.families["qkv"].m_pad), "float32",
                 "[N, q | k | v (| the output gate) (| pad)], normed and roped in place"),
            vmem("attn_out", (n, cfg.attention.q_size), "float32", "[N, Hq*D] attention output"),
        ]
    act += [
        # At least one lane tile wide even when no family uses it (MoE-only models without
        # shared experts): the kernel allocates it regardless, so it is counted.
        vmem("act", (n, max(plan.ffn_pad, plan.shared_ffn_pad, 128)), "float32",
             "[N, padded FFN width] SwiGLU activation"),
    ]
    if plan.moe is not None:
        act.append(vmem("moe_out", (n, h), "float32", "[N, H] shared-expert output, then the MoE output"))
        if "moe_in" in plan.families:  # Muse Spark: the experts' input, then their combined output
            act.append(vmem("moe_x", (n, plan.moe.hidden), "float32",
                            "[N, M] moe_in's output, normed (what the experts read), then the experts' output"))
    if plan.all_reduce is not None:
        act.append(vmem("partial", (plan.all_reduce.rows, plan.all_reduce.padded_width), "float32",
                        "[N, H padded to whole all-reduce chunks] this device's partial sum (o / FFN output) to all-reduce; pad columns 0"))
    out += comp("activations", *act)
    if plan.taps:
        out += comp("activations",
                    vmem("tap_stage", (min(2, len(plan.taps)), n, h), cfg.dtype,
                         "[tap % 2, N, H]: a tapped residual in the model dtype, DMA'd out while the layer runs"),
                    dma_sems("tap_sems", (min(2, len(plan.taps)),), "one per tap staging slot"))
    out += comp("logits_staging",
                vmem("logits", (n, plan.families["lm_head"].tile_cols), "float32",
                     "[N, tile_cols]: block j staged here, DMA'd out while block j + 1 computes"),
                dma_sems("logits_sems", (1,), "the staging buffer's DMA"))
    if plan.all_reduce is not None:
        out += comp("logits_staging",
                    dma_sems("gather_send_sems", (plan.all_reduce.gather_stages,),
                             "per round: pushes of this device's logits slice to its peers"),
                    dma_sems("gather_recv_sems", (plan.all_reduce.gather_stages,),
                             "per round: peers' logits slices arriving in this device's output"))
    return out


def kernel_contract(plan: Plan) -> KernelContract:
    """The contract of `plan`'s megakernel (see the module docstring)."""
    cfg = plan.cfg
    packed = packed_buffers(plan)
    operands = tuple(_operands(plan, {b.source: b for b in packed}))
    head = plan.families["lm_head"]
    caches = plan_caches(plan)  # the last operands
    states = [b for b in operands if b.name in STATE_ARRAYS]  # just before the caches
    logits = Buffer("logits", (plan.devices * head.col_blocks, plan.rows, head.tile_cols), "float32", "hbm",
                    component="outputs",
                    layout="[device d, column block j (d-major), N, tile_cols]: device d's vocab column j*tile_cols + c "
                           "(one device: d = 0; many: every device's slice, all-gathered in the kernel)")
    if plan.cache_written_after_kernel:  # the caches are read only; the step scatters the pages after the kernel
        slots = plan.attention.tokens
        outputs = (logits, *(
            _with(c, name=c.name.replace("_cache", "_pages"), shape=(slots, c.shape[0], *c.shape[2:]), source="",
                  component="outputs", layout=f"[patch slot b*q + i, L, page]: {c.name}'s pages this step patched")
            for c in operands[-caches:]),
            Buffer("page_ids", (slots,), "int32", "smem", component="outputs",
                   layout="[patch slot]: the cache page slot's page goes to; num_pages: none (written by another slot, "
                          "or the token writes nothing)"),
            # the pool likewise: each sequence's new entry, scattered into its slot after the kernel
            *(_with(b, name=b.name + "_out", shape=(plan.batch, b.shape[0], *b.shape[2:]), source="",
                    component="outputs", layout=f"[sequence, L lin, ...]: {b.name}'s entry of each sequence's slot")
              for b in states))
        aliases: tuple[tuple[int, int], ...] = ()
    else:  # the caches updated in place (then the pool)
        outputs = (logits, *(_with(c, source="") for c in operands[-caches:]), *(_with(b, source="") for b in states))
        first_state = len(operands) - caches - len(states)
        aliases = tuple((len(operands) - caches + i, 1 + i) for i in range(caches)) + \
            tuple((first_state + i, 1 + caches + i) for i in range(len(states)))
    if plan.taps:  # the tapped hidden states, written by DMA as each tapped layer starts
        outputs += (Buffer("taps", (len(plan.taps), plan.rows, plan.cfg.hidden_size), plan.cfg.dtype, "hbm",
                           component="outputs", layout="[tap (BuildSpec.taps order), N, H]: the residual entering "
                           "the tapped layer (tap L: the final norm's output), model dtype"),)
    scratch = _kernel_scratch(plan)
    scratch += [_with(b, name=f"attention.{b.name}", component="attention") for b in plan.attention.scratch()]
    if plan.sparse is not None:
        scratch += [_with(b, name=f"sparse.{b.name}", component="sparse") for b in plan.sparse.scratch()]
    if plan.linear is not None:
        scratch += [_with(b, name=f"linear.{b.name}", component="linear") for b in plan.linear.scratch()]
    if plan.moe is not None:
        scratch += [_with(b, name=f"moe.{b.name}", component="moe") for b in plan.moe.scratch()]
    if plan.all_reduce is not None:
        scratch += [_with(b, name=f"collectives.{b.name}", component="collectives") for b in plan.all_reduce.scratch()]
    names = [b.name for b in scratch]
    assert len(set(names)) == len(names), f"scratch names repeat: {names}"
    return KernelContract(f"tpumk_decode_{cfg.name.replace('-', '_').replace('.', '_')}", operands, outputs, aliases,
                          tuple(scratch), packed)


def plan_caches(plan: Plan) -> int:
    """How many cache operands the kernel takes (the last operands): the attention stage's, then
    sparse attention's index-key cache."""
    return plan.attention.caches + (plan.sparse is not None)


def logits_slice_bytes(plan: Plan) -> int:
    """Bytes of one device's logits slice in the output: its column blocks x rows x tile_cols, f32."""
    head = plan.families["lm_head"]
    return head.col_blocks * plan.rows * head.tile_cols * 4


def latent_part_width(plan: Plan) -> int:
    """Lanes of one device's latent slice (MLA with `Plan.latent_split`): its q_a then kv_a
    output columns, each lane-padded (`mla_part`, one row per token row)."""
    return sum(plan.families[f].m_pad for f in ("q_a", "kv_a") if f in plan.families)


def latent_slice_bytes(plan: Plan) -> int:
    """Bytes of one device's latent slice, f32: the `mla_part` it pushes to every peer each layer."""
    return plan.rows * latent_part_width(plan) * 4
