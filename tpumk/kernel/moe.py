"""The routed mixture-of-experts stage of the megakernel, as functions called inside a kernel body.

One call of `moe_stage` does, for one MoE layer and all N token rows:

1. **Router.** The layer's router `[H, Ep]` is DMA'd from HBM into VMEM (it is small but a
   whole stack of them is not: Qwen3-30B-A3B has 48 x 512 KiB, so it is not kept resident).
   `start_router_fetch` lets the composer issue that DMA early (e.g. before attention).
2. **Routing in the kernel.** Logits on the MXU (f32 accumulation), softmax or sigmoid in f32,
   top-k by repeated lane max + lowest-lane-of-the-max (ties go to the lower expert id, as
   `jax.lax.top_k`), optional renormalisation. The result is a combine matrix `[N, Ep]` (weight
   of expert e for row n, 0 if n did not pick e), kept in VMEM scratch. DeepSeek-V3 routing
   (`MoEGeometry.groups / correction_bias / scaling`): the picks follow the biased scores of the
   `topk_groups` best groups (a group scored by its two best, groups ranked pairwise), the
   weights are the unbiased scores, times the scaling factor; the float32 router carries the
   bias in row H, so the same single DMA fetches both. A shared-expert gate (Qwen2-MoE) is
   router column E: its sigmoid is left in the combine matrix's column E for the composer
   (`shared_gate_of`), which scales the shared experts' output by it.
3. **Distinct experts.** The experts picked by ANY row are compacted, in ascending id order, into
   a list of D ids (1 <= D <= min(E, N * top_k)) with exact 0/1 matmuls and an iota compare;
   the list and D go VMEM -> SMEM by a local DMA so they can be read as scalars to address DMAs.
4. **Expert streaming.** Each distinct expert is read from HBM exactly once per layer, as
   `Fe / expert_chunk` chunks; chunk t (a flat index over experts x chunks) goes to slot
   t % expert_slots. The first `expert_slots` chunk loads start as soon as the ids are known;
   after chunk t is multiplied, the load of chunk t + expert_slots is issued into the slot it
   freed, so `expert_slots - 1` loads are in flight while a chunk is multiplied (one slot:
   load, wait, multiply, no overlap). The loop has a dynamic trip count D * chunks (a
   `lax.fori_loop` with a traced bound); chunk order is expert-major, experts ascending.
5. **Expert compute.** Each chunk is evaluated for ALL N rows (decode batches are small, so the
   MXU cost of unpicked rows is noise next to the HBM read), and its down-projection is scaled
   by the row's combine weight (0 for rows that did not pick the expert) before accumulation.

Numerics follow `tpumk.model.reference.moe_ffn` exactly: activations cast to the weight dtype, f32
accumulation, SwiGLU in f32, the SwiGLU output cast to the weight dtype before the down
projection, the combine weight applied to the f32 down projection. The only difference is the
f32 summation order over Fe (per chunk, then across chunks).

Invariant for the composer: every DMA this stage starts is also waited by it, so no stage
DMA is in flight when `moe_stage` returns; scratch and semaphores can be reused by the next
layer (or by anyone else) right away.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.errors import PlanError
from tpumk.kernel.memory import scratch_shape, shape_struct
from tpumk.model.config import ModelConfig
from tpumk.model.quantize import E8M0_BIAS, GROUP, MX_GROUP, NV_GROUP, QuantizedMatrix
from tpumk.model.reference import expert_activation
from tpumk.plan.geometry import F32_SUBLANES, LANE, SUBLANES, MoEGeometry, moe_layer_ids, round_up


# ---------------------------------------------------------------------- packing
def pack_experts(cfg: ModelConfig, params: dict, expert_chunk: int | None = None,
                 fp4_native: bool = False) -> dict[str, jax.Array]:
    """Reference-layout MoE weights -> the stage's kernel layout, stacked over MoE layers.

    Input (tpumk.model.weights): per MoE layer `router [H, E]`, `e_gate [E, H, Fe]`, `e_up [E, H, Fe]`,
    `e_down [E, Fe, H]`. MoE layers are stacked in model order (`moe_layer_ids(cfg)`); arrays
    are cast to `cfg.dtype`. Output, with Lm MoE layers, Ep = E rounded up to 128, nb = Fe / 128:

    - `router  [Lm, H, Ep]`: columns E..Ep-1 are zero (the kernel masks them out of routing);
      with a shared-expert gate (Qwen2-MoE) column E holds its weight `shared_router`.
      With a correction bias (DeepSeek-V3 routing) it is float32 `[Lm, H + 8, Ep]`, the bias in
      row H (rows H+1.. zero): one DMA brings both. gpt-oss's logit bias takes row H the same
      way in the weight dtype (a tile of 8 | 16 rows); with expert biases the H rows after
      hold the experts' down biases transposed ([H, E]).
    - `e_gateup_bias [Lm, E, nb, 8, 256]` f32 (expert biases): block b's gate | up biases in
      row 0, streamed with the block's chunk.
    - `e_gateup [Lm, E, nb, H, 256]`: block b holds gate columns [128b, 128b+128) in lanes
      0..127 and the same up columns in lanes 128..255, so one x @ block matmul feeds both.
      A chunk of C columns is blocks [c*C/128, (c+1)*C/128): ONE contiguous DMA of whole
      (8|16, 128) tiles whatever C is, so the layout does not depend on the chunk knob.
    - `e_down  [Lm, E, Fe, H]` (the reference layout): a chunk is rows [c*C, (c+1)*C), again
      one contiguous, tile-aligned DMA.

    Quantized experts (`QuantizedMatrix` with group scales, tpumk.model.quantize): the codes in
    the same layout, and their float32 scales, padded to whole (8, 128) tiles so each chunk's
    scales are one tile-aligned DMA too (this needs the chunk width, `expert_chunk`):
    - `e_gateup_scales [Lm, E, nb, G8, 256]`: block b's scales, row g for input rows
      [128g, 128g+128) (G8 = H/128 rounded up to 8), gate | up lanes as the codes;
    - `e_down_scales [Lm, E, Fe/C, C8, H]`: chunk c's scales, row g for its rows [128g, 128g+128)
      (mxfp4: `[Lm, E, Fe/32 padded, H]`, the whole expert's, loaded once per expert).

    mxfp4 experts (e2m1 codes, one power-of-two scale per 32 input rows): the codes as
    float4_e2m1fn with `fp4_native` (TPU7x), else the same nibbles as int4; the scales as their
    E8M0 bytes (int8), row g for input rows [32g, 32g+32), padded to whole (32, 128) int8 tiles.
    nvfp4 experts (e2m1 codes, one e4m3 scale per 16 input rows, a global scale per matrix):
    the codes as mxfp4's; the scales as float8_e4m3fn with `fp4_native`, else their bytes in
    int8, row g for input rows [16g, 16g+16), laid out as mxfp4's (the down scales per expert);
    and `e_global_scales [Lm, 8, Ep]` f32: rows 0, 1, 2 the gate, up and down matrices' global
    scales, lane j the layer's j-th packed (owned) expert.

    Works on jax or numpy arrays (jnp ops; numpy inputs land on the default device).
    """
    if not cfg.is_moe:
        raise PlanError(f"pack_experts: model '{cfg.name}' has no mixture-of-experts layers")
    h, e, fe = cfg.moe.width(cfg.hidden_size), cfg.num_experts, cfg.moe.expert_ffn_size  # (the router reads H)
    if fe % LANE or h % LANE:
        raise PlanError(f"pack_experts: the experts' width ({h}) and expert_ffn_size ({fe}) must be multiples of {LANE}")
    dt = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16
    ep, nb = round_up(e + cfg.moe.shared_expert_gate, LANE), fe // LANE
    routers, gateups, downs, gu_scales, dn_scales = [], [], [], [], []

    def codes(a):
        if not isinstance(a, QuantizedMatrix):
            return jnp.asarray(a, dt)
        return a.q if fp4_native or a.group not in (MX_GROUP, NV_GROUP) else e2m1_as_int4(a.q)

    def blocks(a, owned):  # [E, H, Fe] -> [E, nb, H, 128]
        return a.reshape(owned, a.shape[1], nb, LANE).transpose(0, 2, 1, 3)

    moe = cfg.moe
    f32_router = moe.router_correction_bias or moe.router_float32  # (MoEGeometry.router_dtype)
    tile = SUBLANES["float32" if f32_router else cfg.dtype]
    gu_biases, globals_ = [], []
    for i in moe_layer_ids(cfg):
        layer = params["layers"][i]
        rdt = jnp.float32 if f32_router else dt
        rows = [jnp.asarray(layer["router"], rdt)]
        if moe.shared_expert_gate:
            rows = [jnp.concatenate([rows[0], jnp.asarray(layer["shared_router"], rdt)], 1)]
        bias = layer["router_bias"] if moe.router_correction_bias else \
            layer["router_logit_bias"] if moe.router_logit_bias else None
        if bias is not None:  # row H (MoEGeometry.bias_row), one sublane tile
            rows.append(jnp.zeros((tile, e), rdt).at[0].set(jnp.asarray(bias, rdt)))
        if moe.expert_bias:  # the down biases transposed, [H, E] (MoEGeometry.down_bias_row)
            rows.append(jnp.asarray(layer["e_down_bias"], rdt).T)
        routers.append(jnp.concatenate([jnp.pad(r, ((0, 0), (0, ep - r.shape[1]))) for r in rows], 0))
        owned = layer["e_gate"].shape[0]  # E, or a device's owned experts (tpumk.plan.sharding)
        gateups.append(jnp.concatenate([blocks(codes(layer["e_gate"]), owned), blocks(codes(layer["e_up"]), owned)],
                                       axis=-1))
        downs.append(codes(layer["e_down"]))
        if moe.expert_bias:  # [E, Fe] gate and up biases -> row 0 of one f32 (8, 256) tile per block
            gub = jnp.concatenate([jnp.asarray(layer[k], jnp.float32).reshape(owned, nb, LANE)
                                   for k in ("e_gate_bias", "e_up_bias")], axis=-1)  # [E, nb, 256]
            gu_biases.append(jnp.zeros((owned, nb, F32_SUBLANES, 2 * LANE), jnp.float32).at[:, :, 0].set(gub))
        if isinstance(layer["e_gate"], QuantizedMatrix):
            gate, up, down = layer["e_gate"], layer["e_up"], layer["e_down"]
            group = gate.group
            if not (gate.grouped and group in (GROUP, MX_GROUP, NV_GROUP) and down.grouped and down.group == group):
                raise PlanError(f"pack_experts: quantized experts need scales per {GROUP} (or mxfp4's {MX_GROUP}, "
                                f"nvfp4's {NV_GROUP}) input rows (got groups of {gate.group} / {down.group})")
            if expert_chunk is None:
                raise PlanError("pack_experts: quantized experts are packed per chunk: pass expert_chunk")
            micro = group in (MX_GROUP, NV_GROUP)  # one-byte scales, the down ones per expert
            as_stored = e8m0_bytes if group == MX_GROUP else \
                (lambda a: a if fp4_native else e4m3_bytes(a)) if group == NV_GROUP else (lambda a: a)
            scale_tile = SUBLANES["int8" if micro else "float32"]
            g = h // group
            gs = jnp.concatenate([blocks(as_stored(gate.scale), owned), blocks(as_stored(up.scale), owned)],
                                 axis=-1)  # [E, nb, G, 256]
            gu_scales.append(jnp.pad(gs, ((0, 0), (0, 0), (0, round_up(g, scale_tile) - g), (0, 0))))
            if micro:  # mxfp4 / nvfp4: the whole expert's down scales, loaded once per expert
                ds = as_stored(down.scale)  # [E, Fe/32 (Fe/16), H]
                dn_scales.append(jnp.pad(ds, ((0, 0), (0, round_up(ds.shape[1], scale_tile) - ds.shape[1]), (0, 0))))
            else:
                per_chunk = expert_chunk // group
                ds = as_stored(down.scale).reshape(owned, fe // expert_chunk, per_chunk, h)
                dn_scales.append(jnp.pad(ds, ((0, 0), (0, 0), (0, round_up(per_chunk, scale_tile) - per_chunk),
                                              (0, 0))))
            if group == NV_GROUP:  # rows gate, up, down of one (8, Ep) f32 tile, lane = owned expert
                rows = jnp.stack([jnp.asarray(m.outer, jnp.float32) for m in (gate, up, down)])  # [3, E]
                globals_.append(jnp.zeros((F32_SUBLANES, ep), jnp.float32).at[:3, :owned].set(rows))
    out = {"router": jnp.stack(routers), "e_gateup": jnp.stack(gateups), "e_down": jnp.stack(downs)}
    if gu_scales:
        out.update(e_gateup_scales=jnp.stack(gu_scales), e_down_scales=jnp.stack(dn_scales))
    if globals_:
        out.update(e_global_scales=jnp.stack(globals_))
    if gu_biases:
        out.update(e_gateup_bias=jnp.stack(gu_biases))
    return out


def e2m1_as_int4(codes) -> jax.Array:
    """float4_e2m1fn codes -> int4 holding the same 4 bits (sign bit 3, exponent 2..1, mantissa 0)
    read as two's complement: what a chip without a 4-bit float type streams (`_e2m1_values`
    decodes it). Exact: a relabelling of the 16 codes, no rounding."""
    v = jnp.asarray(codes).astype(jnp.float32)
    mag = jnp.abs(v)
    # magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are codes 0..7
    m = jnp.where(mag < 2, 2 * mag, jnp.where(mag < 4, mag + 2, mag / 2 + 4)).astype(jnp.int32)
    return jnp.where(jnp.signbit(v), m - 8, m).astype(jnp.int4)


def e8m0_bytes(scale) -> jax.Array:
    """Power-of-two float32 scales -> their E8M0 bytes (2^(b - 127)) in an int8 container."""
    _, exp = jnp.frexp(jnp.asarray(scale, jnp.float32))  # scale = 0.5 * 2^exp
    b = (exp - 1 + E8M0_BIAS).astype(jnp.int32)
    return jnp.where(b > 127, b - 256, b).astype(jnp.int8)


def e4m3_bytes(scale) -> jax.Array:
    """float8_e4m3fn scales -> their bytes in an int8 container (a bitcast: what a chip whose
    Mosaic does not convert e4m3 streams; `_e4m3_values` decodes it)."""
    return lax.bitcast_convert_type(jnp.asarray(scale, jnp.float8_e4m3fn), jnp.int8)


def packed_shapes(geom: MoEGeometry) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of `pack_experts`' output for this geometry (for deviceless compiles and checks)."""
    return {b.name: shape_struct(b) for b in geom.packed()}


# ---------------------------------------------------------------------- scratch
class MoEScratch(NamedTuple):
    """The stage's scratch refs, in the order `moe_scratch` lists their shapes."""

    router: Any  # VMEM [H (+8), Ep] router dtype: this layer's router (+ correction bias in row H)
    gateup: Any  # VMEM [S, C/128, H, 256] weight dtype: gate|up blocks of one chunk per slot
    down: Any  # VMEM [S, C, H] weight dtype: down rows of one chunk per slot
    combine: Any  # VMEM [N, Ep] f32: combine weight of (row, expert), 0 where not picked
    ids_vmem: Any  # VMEM [2, Ep] int32: row 0 distinct picked ids ascending, row 1 their count
    ids_smem: Any  # SMEM [2, Ep] int32: the same, read as scalars
    sems: Any  # DMA semaphores [2]: 0 router, 1 ids VMEM->SMEM
    slot_sems: Any  # DMA semaphores [2 | 4, S]: gate|up and down chunk of each slot (and their scales)
    gateup_scales: Any = None  # quantized: VMEM [S, C/128, G8, 256] f32, each block's group scales
    down_scales: Any = None  # quantized: VMEM [S, C8, H] f32, the down chunk's group scales
    gateup_bias: Any = None  # expert biases: VMEM [S, C/128, 8, 256] f32, each block's biases in row 0
    expert_sems: Any = None  # mxfp4 / nvfp4: DMA semaphores [B], one per expert down-scale buffer
    down_scales_f32: Any = None  # mxfp4 / nvfp4: VMEM [R, H] f32, the current expert's down scales decoded
    global_scales: Any = None  # nvfp4: VMEM [8, Ep] f32, this layer's global scales (rows gate, up, down)


def moe_scratch(geom: MoEGeometry) -> list:
    """Scratch shapes to append to the kernel's `scratch_shapes`; pass the refs back in order
    (`MoEGeometry.scratch()`, the list the kernel contract and the plan's VMEM count use)."""
    geom.validate()
    return [scratch_shape(b) for b in geom.scratch()]


def _as_scratch(geom: MoEGeometry, scratch: Sequence[Any]) -> MoEScratch:
    """The refs of `moe_scratch(geom)` (in order) by name."""
    if isinstance(scratch, MoEScratch):
        return scratch
    return MoEScratch(**dict(zip((b.name for b in geom.scratch()), scratch, strict=True)))


def _precision(geom: MoEGeometry):
    # f32 weights: ask Mosaic for full f32 contraction so routing and outputs match the f32
    # reference; bf16 operands are exact on the MXU anyway.
    return lax.Precision.HIGHEST if geom.dtype == "float32" else None


# ---------------------------------------------------------------------- in-kernel pieces
def _router_copies(geom: MoEGeometry, moe_layer, router_hbm, scr: MoEScratch, scales_hbm=None) -> list:
    """The layer's once-per-layer loads: its router, and nvfp4's global scales (`scales_hbm[2]`)."""
    out = [pltpu.make_async_copy(router_hbm.at[moe_layer], scr.router, scr.sems.at[0])]
    if geom.nv:
        out.append(pltpu.make_async_copy(scales_hbm[2].at[moe_layer], scr.global_scales, scr.sems.at[2]))
    return out


def start_router_fetch(geom: MoEGeometry, moe_layer, router_hbm, scratch, scales_hbm=None) -> None:
    """Issue this layer's router DMA (and nvfp4's global scales) early; then call the stage with
    `router_started=True` and the same `scales_hbm`."""
    for cp in _router_copies(geom, moe_layer, router_hbm, _as_scratch(geom, scratch), scales_hbm):
        cp.start()


_EXCLUDED, _TAKEN = -1e30, -2e30  # below any (biased) score: never picked


def _group_mask(geom: MoEGeometry, choice, lane):
    """DeepSeek-V3 group limit: True on the lanes of the `topk_groups` groups whose two best
    choice scores sum highest (ties: the lower group, as jax.lax.top_k). choice [N, Ep] with
    padding lanes at _EXCLUDED."""
    g, per, ep = geom.groups, geom.num_experts // geom.groups, geom.experts_padded
    group_of = jnp.zeros_like(lane)
    for k in range(1, g):  # lane // per without an integer division
        group_of = group_of + (lane >= k * per).astype(jnp.int32)
    in_group = [(group_of == k) & (lane < geom.num_experts) for k in range(g)]
    score = []
    for k in range(g):
        masked = jnp.where(in_group[k], choice, _EXCLUDED)
        b1 = jnp.max(masked, axis=1, keepdims=True)
        first = jnp.min(jnp.where(masked == b1, lane, ep), axis=1, keepdims=True)
        b2 = jnp.max(jnp.where(lane == first, _EXCLUDED, masked), axis=1, keepdims=True)
        score.append(b1 + b2)  # [N, 1]
    keep = jnp.zeros(choice.shape, jnp.bool_)
    for k in range(g):
        rank = jnp.zeros_like(score[k])
        for j in range(g):
            if j != k:
                beats = (score[j] > score[k]) | ((score[j] == score[k]) & (j < k))
                rank = rank + beats.astype(jnp.float32)
        keep = keep | (in_group[k] & (rank < geom.topk_groups))
    return keep


def _route(geom: MoEGeometry, x, router_vmem):
    """x [N, H] f32 -> (combine [N, Ep] f32, picked [1, Ep] f32 0/1), as reference.route."""
    n, ep, e = geom.rows, geom.experts_padded, geom.num_experts
    if geom.correction_bias or geom.router_float32:  # a float32 router: full f32 contraction, as the reference
        logits = jnp.dot(x, router_vmem[: geom.router_in, :], preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)
        if geom.correction_bias:  # and its bias (row H)
            bias = router_vmem[geom.bias_row: geom.bias_row + 1, :]  # [1, Ep]
    else:
        logits = jnp.dot(x.astype(geom.jnp_dtype), router_vmem[: geom.router_in, :], preferred_element_type=jnp.float32,
                         precision=_precision(geom))
        if geom.logit_bias:  # gpt-oss: before the softmax, so it moves the picks and the weights
            logits = logits + router_vmem[geom.bias_row: geom.bias_row + 1, :].astype(jnp.float32)
    lane = lax.broadcasted_iota(jnp.int32, (n, ep), 1)
    valid = lane < e
    if geom.scoring == "softmax":
        z = jnp.where(valid, logits, -jnp.inf)
        p = jnp.exp(z - jnp.max(z, axis=1, keepdims=True))
        scores = p / jnp.sum(p, axis=1, keepdims=True)
    else:
        scores = jax.nn.sigmoid(logits)
    if not (geom.correction_bias or geom.groups > 1):
        # Real scores are >= 0; padding lanes at -1 and taken lanes at -2 can never win.
        scores = jnp.where(valid, scores, -1.0)
        combine = jnp.zeros((n, ep), jnp.float32)
        picked = jnp.zeros((n, ep), jnp.float32)
        total = jnp.zeros((n, 1), jnp.float32)
        for _ in range(geom.top_k):  # top_k is small and static: unrolled
            best = jnp.max(scores, axis=1, keepdims=True)
            first = jnp.min(jnp.where(scores == best, lane, ep), axis=1, keepdims=True)  # ties -> lower id
            hit = lane == first
            combine = jnp.where(hit, best, combine)
            picked = jnp.where(hit, 1.0, picked)
            total = total + best  # descending order, as the reference sums its top-k weights
            scores = jnp.where(hit, -2.0, scores)
    else:
        # DeepSeek-V3: pick by the biased, group-limited `choice`; weigh by the unbiased score.
        choice = jnp.where(valid, scores + bias if geom.correction_bias else scores, _EXCLUDED)
        if geom.groups > 1:
            choice = jnp.where(_group_mask(geom, choice, lane), choice, _EXCLUDED)
        combine = jnp.zeros((n, ep), jnp.float32)
        picked = jnp.zeros((n, ep), jnp.float32)
        total = jnp.zeros((n, 1), jnp.float32)
        for _ in range(geom.top_k):
            best = jnp.max(choice, axis=1, keepdims=True)
            first = jnp.min(jnp.where(choice == best, lane, ep), axis=1, keepdims=True)
            hit = lane == first
            weight = jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True)
            combine = jnp.where(hit, weight, combine)
            picked = jnp.where(hit, 1.0, picked)
            total = total + weight  # in pick order, as the reference sums its gathered weights
            choice = jnp.where(hit, _TAKEN, choice)
    if geom.norm_topk:
        combine = combine / total
    if geom.scaling != 1.0:
        combine = combine * geom.scaling
    if geom.shared_gate:  # column E is no expert: it carries the shared experts' gate (shared_gate_of)
        gate = jax.nn.sigmoid(jnp.sum(jnp.where(lane == e, logits, 0.0), axis=1, keepdims=True))
        combine = jnp.where(lane == e, gate, combine)
    return combine, jnp.max(picked, axis=0, keepdims=True)


def shared_gate_of(geom: MoEGeometry, scratch):
    """[N, 1] f32: sigmoid(x . shared_router) of the layer routed last (reference.shared_experts),
    left by the routing in the combine matrix's column E (a lane mask: no unaligned slice)."""
    combine = _as_scratch(geom, scratch).combine[...]
    lane = lax.broadcasted_iota(jnp.int32, combine.shape, 1)
    return jnp.sum(jnp.where(lane == geom.num_experts, combine, 0.0), axis=1, keepdims=True)


def _compact(geom: MoEGeometry, picked):
    """picked [1, Ep] 0/1 -> (ids [1, Ep] int32: picked expert ids ascending then 0s, count [1, Ep]).

    pos[e] = number of picked experts below e, as an exact 0/1 matmul (MXU products of 0/1 are
    exact at any precision, sums are small integers in f32). The NT form yields pos along
    sublanes ([e, p] = pos[e] for every lane p), so slot p's id is the sublane index e with
    picked[e] and pos[e] == p: an iota compare and a sublane reduction, no transposes.
    """
    ep = geom.experts_padded
    row = lax.broadcasted_iota(jnp.int32, (ep, ep), 0)
    col = lax.broadcasted_iota(jnp.int32, (ep, ep), 1)
    rhs = jnp.broadcast_to(picked, (ep, ep))
    nt = (((1,), (1,)), ((), ()))
    pos = lax.dot_general((col < row).astype(jnp.float32), rhs, nt, preferred_element_type=jnp.float32)
    mine = lax.dot_general((col == row).astype(jnp.float32), rhs, nt, preferred_element_type=jnp.float32)
    hit = (mine > 0.5) & (pos == col.astype(jnp.float32))
    ids = jnp.max(jnp.where(hit, row.astype(jnp.float32), 0.0), axis=0, keepdims=True)
    count = jnp.broadcast_to(jnp.sum(picked, axis=1, keepdims=True), (1, ep))
    return ids.astype(jnp.int32), count.astype(jnp.int32)


def _expert_base(geom: MoEGeometry):
    """Global id of this device's first owned expert (0 on one device)."""
    if not geom.sharded:
        return jnp.int32(0)
    return lax.div(lax.axis_index(geom.axis), jnp.int32(geom.expert_tensor)) * geom.local_experts


def _chunk_copies(geom: MoEGeometry, moe_layer, t, e_gateup_hbm, e_down_hbm, scr: MoEScratch, scales_hbm=None,
                  bias_hbm=None):
    """The DMAs of flat chunk t (expert t // chunks, chunk t % chunks) into slot t % S: gate|up
    codes, down codes, (quantized) their scales and (expert biases) the gate|up blocks' biases.
    Returns the expert's global id (the combine column), the slot and the copies; the packed
    arrays hold only the owned experts, addressed from the device's first one."""
    nc, kb, c_cols, s = geom.chunks_per_expert, geom.blocks_per_chunk, geom.expert_chunk, geom.expert_slots
    slot = 0 if s == 1 else lax.rem(t, jnp.int32(s))
    if nc == 1:
        c = jnp.int32(0)
        e = scr.ids_smem[0, t]
    else:  # lax.div/rem, not // and %: Python floor division lowers through a TPU-info query
        c = lax.rem(t, jnp.int32(nc))
        e = scr.ids_smem[0, lax.div(t, jnp.int32(nc))]
    local = e - _expert_base(geom) if geom.sharded else e
    if nc == 1:
        gu_src, gs_src = e_gateup_hbm.at[moe_layer, local], None
        dn_src = e_down_hbm.at[moe_layer, local]
    else:
        blocks = pl.ds(pl.multiple_of(c * kb, kb), kb)
        gu_src = e_gateup_hbm.at[moe_layer, local, blocks]
        dn_src = e_down_hbm.at[moe_layer, local, pl.ds(pl.multiple_of(c * c_cols, c_cols), c_cols)]
    copies = [pltpu.make_async_copy(gu_src, scr.gateup.at[slot], scr.slot_sems.at[0, slot]),
              pltpu.make_async_copy(dn_src, scr.down.at[slot], scr.slot_sems.at[1, slot])]
    if geom.quantized:
        gs_hbm, ds_hbm = scales_hbm[:2]
        gs_src = gs_hbm.at[moe_layer, local] if nc == 1 else gs_hbm.at[moe_layer, local, blocks]
        copies.append(pltpu.make_async_copy(gs_src, scr.gateup_scales.at[slot], scr.slot_sems.at[2, slot]))
        if not geom.mx:  # (mxfp4: per expert, `_expert_scale_copy`)
            copies.append(pltpu.make_async_copy(ds_hbm.at[moe_layer, local, c], scr.down_scales.at[slot],
                                                scr.slot_sems.at[3, slot]))
    if geom.expert_bias:
        b_src = bias_hbm.at[moe_layer, local] if nc == 1 else bias_hbm.at[moe_layer, local, blocks]
        copies.append(pltpu.make_async_copy(b_src, scr.gateup_bias.at[slot], scr.slot_sems.at[geom.bias_sem, slot]))
    return e, slot, copies


def _expert_buffer(geom: MoEGeometry, t):
    """mxfp4: (k = t // chunks, the distinct-expert index of flat chunk t; its down-scale buffer
    k mod B)."""
    nc, nb = geom.chunks_per_expert, geom.expert_scale_buffers
    k = t if nc == 1 else lax.div(t, jnp.int32(nc))
    return k, (0 if nb == 1 else lax.rem(k, jnp.int32(nb)))


def _expert_scale_copy(geom: MoEGeometry, moe_layer, t, scr: MoEScratch, scales_hbm):
    """mxfp4: (is chunk t its expert's first, the copy of that expert's down scales into its
    buffer, `_expert_buffer`). Started with the expert's first chunk, waited before it is
    multiplied; `MoEGeometry.expert_scale_buffers` keeps a buffer until its expert is done."""
    nc = geom.chunks_per_expert
    k, buf = _expert_buffer(geom, t)
    first = jnp.bool_(True) if nc == 1 else lax.rem(t, jnp.int32(nc)) == 0
    e = scr.ids_smem[0, k]
    local = e - _expert_base(geom) if geom.sharded else e
    return first, pltpu.make_async_copy(scales_hbm[1].at[moe_layer, local], scr.down_scales.at[buf],
                                             scr.expert_sems.at[buf])


def _start_chunk(geom, moe_layer, t, e_gateup_hbm, e_down_hbm, scr, load_counts, scales_hbm=None,
                 bias_hbm=None) -> None:
    e, _, copies = _chunk_copies(geom, moe_layer, t, e_gateup_hbm, e_down_hbm, scr, scales_hbm, bias_hbm)
    for cp in copies:
        cp.start()
    if geom.mx:
        first, scale_copy = _expert_scale_copy(geom, moe_layer, t, scr, scales_hbm)

        @pl.when(first)
        def _():
            scale_copy.start()
    if load_counts is not None:
        load_counts[e] = load_counts[e] + 1


def moe_route_and_prefetch(geom: MoEGeometry, moe_layer, x, router_hbm, e_gateup_hbm, e_down_hbm,
                           scratch, *, router_started: bool = False, load_counts=None, scales_hbm=None,
                           bias_hbm=None) -> None:
    """Phase 1: route x, publish the distinct-expert list, start the first `expert_slots` chunk loads.

    Split from `moe_experts` so the composer can overlap other work (e.g. the shared expert from
    its weight ring) with the first expert loads. State lives in scratch; nothing is returned.
    """
    scr = _as_scratch(geom, scratch)
    router_dmas = _router_copies(geom, moe_layer, router_hbm, scr, scales_hbm)
    for cp in router_dmas:
        if not router_started:
            cp.start()
    for cp in router_dmas:
        cp.wait()
    combine, picked = _route(geom, x, scr.router)
    scr.combine[...] = combine
    if geom.sharded:  # every device routes alike; each streams only the picked experts it owns
        lane = lax.broadcasted_iota(jnp.int32, picked.shape, 1)
        base = _expert_base(geom)
        picked = jnp.where((lane >= base) & (lane < base + geom.local_experts), picked, 0.0)
    ids, count = _compact(geom, picked)
    scr.ids_vmem[0:1, :] = ids
    scr.ids_vmem[1:2, :] = count
    ids_dma = pltpu.make_async_copy(scr.ids_vmem, scr.ids_smem, scr.sems.at[1])
    ids_dma.start()
    ids_dma.wait()
    total = scr.ids_smem[1, 0] * geom.chunks_per_expert
    for t in range(geom.expert_slots):
        @pl.when(t < total)
        def _():
            _start_chunk(geom, moe_layer, jnp.int32(t), e_gateup_hbm, e_down_hbm, scr, load_counts, scales_hbm,
                         bias_hbm)


def _grouped_dot(x_groups, codes, scales, dt, prec):
    """sum over 128-row groups g of (x_g @ codes_g in dt, f32) * scales[g]: a group-scaled
    matmul (x_groups: the [N, 128] slices of x in dt; codes a VMEM ref [K, M]; scales [>= K/128, M]
    f32). Each group's float32 sum is scaled before the groups are added, as the reference."""
    acc = None
    for g, xg in enumerate(x_groups):
        part = jnp.dot(xg, codes[g * GROUP:(g + 1) * GROUP, :].astype(dt), preferred_element_type=jnp.float32,
                       precision=prec) * scales[g:g + 1, :]
        acc = part if acc is None else acc + part
    return acc


def _down_bias(geom: MoEGeometry, scr: MoEScratch):
    """[N, H] f32: sum over this device's picked experts e of combine[n, e] * down_bias[e], from
    the router's transposed down-bias rows (an NT matmul, so no transpose in VMEM). With an
    expert split over several devices (expert_tensor), one of them adds it."""
    n, ep = geom.rows, geom.experts_padded
    combine = scr.combine[...]
    lane = lax.broadcasted_iota(jnp.int32, (n, ep), 1)
    own = lane < geom.num_experts  # (column E may hold the shared gate)
    if geom.sharded:
        base = _expert_base(geom)
        own = own & (lane >= base) & (lane < base + geom.local_experts)
    rows = scr.router[geom.down_bias_row: geom.down_bias_row + geom.hidden, :].astype(jnp.float32)  # [H, Ep]
    nt = (((1,), (1,)), ((), ()))
    out = lax.dot_general(jnp.where(own, combine, 0.0), rows, nt, preferred_element_type=jnp.float32,
                          precision=lax.Precision.HIGHEST)
    if geom.expert_tensor > 1:
        first = lax.rem(lax.axis_index(geom.axis), jnp.int32(geom.expert_tensor)) == 0
        out = jnp.where(first, out, 0.0)
    return out


def _e8m0_values(scale_bytes):
    """E8M0 bytes (int8 container) -> float32 2^(b - 127): the byte as the float's exponent
    field (b = 0 gives 0 rather than 2^-127; the loader refuses b = 255, E8M0's NaN)."""
    b = scale_bytes.astype(jnp.int32)
    b = jnp.where(b < 0, b + 256, b)
    return lax.bitcast_convert_type(b << 23, jnp.float32)


def _e4m3_values(geom: MoEGeometry, scales):
    """nvfp4's e4m3 scales -> float32. TPU7x: float8_e4m3fn, converted by Mosaic. Elsewhere the
    byte in an int8: exponent field e (bits 6..3) and mantissa m (bits 2..0) are the float32
    with exponent e + 120 and the mantissa's 3 bits on top of its own (e >= 1), or m x 2^-9
    (e = 0, subnormal; exact); bit 7 the sign. The loader refuses NaN (bytes 0x7F, 0xFF)."""
    if geom.fp4_native:
        return scales.astype(jnp.float32)
    b = scales.astype(jnp.int32)
    b = jnp.where(b < 0, b + 256, b)
    e, m = (b >> 3) & 15, b & 7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * (2.0 ** -9), normal)
    return jnp.where(b >= 128, -mag, mag)


def _scale_values(geom: MoEGeometry, scales):
    """A microscaled format's packed scales -> float32: mxfp4's E8M0 bytes, nvfp4's e4m3."""
    return _e4m3_values(geom, scales) if geom.nv else _e8m0_values(scales)


def _e2m1_values(geom: MoEGeometry, codes):
    """e2m1 codes -> float32 values. TPU7x: float4_e2m1fn, converted by Mosaic. Elsewhere the
    nibble in an int4: magnitude code m (0..7) is 0, 0.5, or for m >= 2 the float32 with bits
    (m + 252) << 22 (exponent (m >> 1) + 126, mantissa bit m & 1: 1, 1.5, 2, 3, 4, 6); bit 3 the sign."""
    if geom.fp4_native:
        return codes.astype(jnp.float32)
    n = codes.astype(jnp.int32)
    n = jnp.where(n < 0, n + 16, n)
    m = n & 7
    bits = jnp.where(m >= 2, (m + 252) << 22, jnp.where(m == 1, 252 << 22, 0)) | ((n >> 3) << 31)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _mx_dot(geom: MoEGeometry, x_groups, codes, scales, dt, prec):
    """sum over 128-row groups g of x_g @ (codes_g decoded, each 32 (nvfp4: 16) rows times their
    scale) in dt, f32 accumulation: a microscaled matmul (x_groups: the [N, 128] slices of x in
    dt; codes a VMEM ref [K, M]; scales [>= K/group, M] f32, `_scale_values`). A code times a
    power of two, or times an e4m3 value (at most 2 x 4 significant bits), is exact in bfloat16,
    so the dequantized operand equals the reference's. nvfp4's global scale is applied by the
    caller, to the f32 sum."""
    group = geom.scale_group
    per = GROUP // group
    acc = None
    for g, xg in enumerate(x_groups):
        w = _e2m1_values(geom, codes[g * GROUP:(g + 1) * GROUP, :])  # [128, M]
        sc = scales[g * per:(g + 1) * per, :]  # [4 | 8, M]
        w = (w.reshape(per, group, w.shape[-1]) * sc[:, None, :]).reshape(GROUP, w.shape[-1]).astype(dt)
        part = jnp.dot(xg, w, preferred_element_type=jnp.float32, precision=prec)
        acc = part if acc is None else acc + part
    return acc


def _chunk_down_scales(geom: MoEGeometry, t, scr: MoEScratch):
    """mxfp4 / nvfp4: chunk t's down scales [C/group, H] f32, its rows of its expert's (decoded
    at the expert's first chunk) picked by an exact 0/1 matmul (the chunk's first row,
    c * C/group, is traced and not a whole tile)."""
    nc, rows = geom.chunks_per_expert, geom.expert_chunk // geom.scale_group
    scales = scr.down_scales_f32[...]  # [R, H], the whole expert's
    if nc == 1:
        return scales
    c = lax.rem(t, jnp.int32(nc))
    pick = lax.broadcasted_iota(jnp.int32, (rows, scales.shape[0]), 1) == \
        lax.broadcasted_iota(jnp.int32, (rows, scales.shape[0]), 0) + c * rows
    return jnp.dot(pick.astype(jnp.float32), scales, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST)


def _global_scales(geom: MoEGeometry, e, scr: MoEScratch):
    """nvfp4: expert e's global scales as ([1, 256] f32: gate's in lanes 0..127, up's in
    128..255, the layout of a gate|up block's output; [1, 1] f32: down's), picked from the
    layer's (lane = owned index) by an exact one-lane sum."""
    local = e - _expert_base(geom) if geom.sharded else e
    rows = scr.global_scales[0:3, :]  # [3, Ep]
    lane = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    picked = jnp.sum(jnp.where(lane == local, rows, 0.0), axis=1, keepdims=True)  # [3, 1]
    half = lax.broadcasted_iota(jnp.int32, (1, 2 * LANE), 1) < LANE
    return jnp.where(half, picked[0:1], picked[1:2]), picked[2:3]


def moe_experts(geom: MoEGeometry, moe_layer, x, e_gateup_hbm, e_down_hbm, scratch, *,
                load_counts=None, scales_hbm=None, bias_hbm=None):
    """Phase 2: stream and apply every distinct expert's chunks; returns y [N, H] f32.
    Quantized experts: the chunk's codes are converted to the compute dtype in VMEM (exact) and
    each 128-row group's sum is scaled (`_grouped_dot`), or (mxfp4, nvfp4) the codes are scaled
    in VMEM (`_mx_dot`) and nvfp4's global scales multiply the f32 sums; `scales_hbm` =
    (e_gateup_scales, e_down_scales[, e_global_scales]).
    Expert biases (`bias_hbm` = e_gateup_bias): each block's gate|up bias joins its f32 output
    before the activation; the down biases join once, weighted by the combine matrix."""
    scr = _as_scratch(geom, scratch)
    n, ep, s, dt = geom.rows, geom.experts_padded, geom.expert_slots, geom.jnp_dtype
    prec = _precision(geom)
    xw = x.astype(dt)
    x_groups = [xw[:, g * GROUP:(g + 1) * GROUP] for g in range(geom.hidden // GROUP)] if geom.quantized else None
    total = scr.ids_smem[1, 0] * geom.chunks_per_expert
    lane = lax.broadcasted_iota(jnp.int32, (n, ep), 1)

    normed = geom.post_norm_eps > 0  # expert_post_norm: each expert's whole output normalised, then weighted
    nc = geom.chunks_per_expert

    def body(t, carry):
        acc, cur = carry if normed else (carry, None)
        if s == 1:
            # One slot: chunk t can only load once chunk t-1 is consumed (chunk 0 was started in
            # phase 1). Issuing it here rather than as a refill at the end of the previous trip
            # is the same schedule, and libtpu 0.0.52's static profiler (TPU7x) aborts the
            # process on the refill form for some one-slot geometries.
            @pl.when(t > 0)
            def _():
                _start_chunk(geom, moe_layer, t, e_gateup_hbm, e_down_hbm, scr, load_counts, scales_hbm, bias_hbm)

        e, slot, copies = _chunk_copies(geom, moe_layer, t, e_gateup_hbm, e_down_hbm, scr, scales_hbm, bias_hbm)
        for cp in copies:
            cp.wait()
        if geom.mx:
            first, scale_copy = _expert_scale_copy(geom, moe_layer, t, scr, scales_hbm)

            @pl.when(first)
            def _():  # once per expert: its scale bytes as float32, for each of its chunks to pick from
                scale_copy.wait()
                scr.down_scales_f32[...] = _scale_values(geom, scr.down_scales[_expert_buffer(geom, t)[1]])
        weight = jnp.sum(jnp.where(lane == e, scr.combine[...], 0.0), axis=1, keepdims=True)  # [N, 1]
        if geom.nv:
            gu_global, down_global = _global_scales(geom, e, scr)
        gu_slot = scr.gateup.at[slot]
        acts = []
        for b in range(geom.blocks_per_chunk):
            if geom.mx:
                h = _mx_dot(geom, x_groups, gu_slot.at[b], _scale_values(geom, scr.gateup_scales[slot, b]), dt, prec)
                if geom.nv:
                    h = h * gu_global
            elif geom.quantized:
                h = _grouped_dot(x_groups, gu_slot.at[b], scr.gateup_scales[slot, b], dt, prec)
            else:
                h = jnp.dot(xw, gu_slot[b], preferred_element_type=jnp.float32, precision=prec)  # [N, 256]
            if geom.expert_bias:
                h = h + scr.gateup_bias[slot, b, 0:1, :]
            acts.append(expert_activation(h[:, :LANE], h[:, LANE:], geom.swiglu_limit, geom.swiglu_alpha))
        act = acts[0] if len(acts) == 1 else jnp.concatenate(acts, axis=1)
        if geom.quantized:
            act_groups = [a.astype(dt) for a in acts]  # one 128-column block = one 128-row group of down
            if geom.mx:
                part = _mx_dot(geom, act_groups, scr.down.at[slot], _chunk_down_scales(geom, t, scr), dt, prec)
                if geom.nv:
                    part = part * down_global
            else:
                part = _grouped_dot(act_groups, scr.down.at[slot], scr.down_scales[slot], dt, prec)
        else:
            part = jnp.dot(act.astype(dt), scr.down[slot], preferred_element_type=jnp.float32, precision=prec)
        if normed:  # the expert's chunks summed first; at its last chunk normalised (spark.expert_outputs)
            cur = cur + part
            width = geom.norm_width or geom.hidden  # (a lane-padded copy's true width)
            y = cur * lax.rsqrt(jnp.sum(cur * cur, axis=-1, keepdims=True) / width + geom.post_norm_eps)
            last = lax.rem(t, jnp.int32(nc)) == nc - 1
            acc = jnp.where(last, acc + weight * y, acc)
            cur = jnp.where(last, 0.0, cur)
        else:
            acc = acc + weight * part

        if s > 1:
            # The slot is consumed: refill it with chunk t + S.
            @pl.when(t + s < total)
            def _():
                _start_chunk(geom, moe_layer, t + s, e_gateup_hbm, e_down_hbm, scr, load_counts, scales_hbm,
                             bias_hbm)

        return (acc, cur) if normed else acc

    zero = jnp.zeros((n, geom.hidden), jnp.float32)
    y = lax.fori_loop(0, total, body, (zero, zero) if normed else zero)
    y = y[0] if normed else y
    return y + _down_bias(geom, scr) if geom.expert_bias else y


def moe_stage(geom: MoEGeometry, moe_layer, x, router_ref, e_gateup_hbm, e_down_hbm, scratch, *,
              router_started: bool = False, load_counts=None, scales_hbm=None, bias_hbm=None):
    """Routed experts of one MoE layer, called inside a kernel body.

    Args:
      geom: the stage geometry (static).
      moe_layer: int32 (traced is fine) index into the MoE-layer stack.
      x: f32 value [N, H], already RMS-normed.
      router_ref: the packed `router [Lm, H, Ep]`, a ref left in HBM (`pl.ANY`): each layer's
        [H, Ep] slice is DMA'd into scratch (a resident stack would cost Lm * H * Ep * bytes of
        VMEM, 24 MiB for Qwen3-30B-A3B).
      e_gateup_hbm, e_down_hbm: packed expert refs in HBM (`pl.ANY`), see `pack_experts`.
      scratch: the refs of `moe_scratch(geom)`, in order (a sequence or a MoEScratch).
      router_started: the caller already called `start_router_fetch` for this layer.
      load_counts: optional int32 SMEM ref [>= E] (e.g. `out.at[layer]`); each chunk DMA issued
        for expert e adds 1 to load_counts[e]. For tests and instrumentation.
      scales_hbm: quantized experts: (e_gateup_scales, e_down_scales[, nvfp4's e_global_scales]) HBM
        refs (`pack_experts`); given to `start_router_fetch` too when the caller starts the router.
      bias_hbm: expert biases: the e_gateup_bias HBM ref (`pack_experts`).

    Returns y: f32 [N, H], the sum over each row's selected experts of weight * SwiGLU expert(x).
    """
    moe_route_and_prefetch(geom, moe_layer, x, router_ref, e_gateup_hbm, e_down_hbm, scratch,
                           router_started=router_started, load_counts=load_counts, scales_hbm=scales_hbm,
                           bias_hbm=bias_hbm)
    return moe_experts(geom, moe_layer, x, e_gateup_hbm, e_down_hbm, scratch, load_counts=load_counts,
                       scales_hbm=scales_hbm, bias_hbm=bias_hbm)
