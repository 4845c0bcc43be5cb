"""Packing reference-layout weights into the megakernel's layout (and its shapes, for AOT builds).

`pack_weights(plan_or_cfg, params)` takes weights in tpumk's reference layout (tpumk.model.weights:
matrices `[in, out]`, one dict per layer; real checkpoints load into that layout) and returns
the pytree the kernel reads. Any serving stack can call it on real weights. The layout depends
only on the model and the tuning (tile shapes), not on the target or batch.

Packed layout (dt = the model dtype; L layers, Ld dense layers, Lm MoE layers, W = max(H, D)
rounded to 128; every streamed matrix is cut into whole tiles, padded with zeros):

    embed          [V, H] dt       the reference embedding; rows are gathered outside the kernel
    final_norm     [1, H] f32
    layer_vectors  [L, 8, W] f32   row 0 attn_norm, 1 mlp_norm (pre_norms), 2 q_norm, 3 k_norm (first
                                   D lanes, or q_size / kv_size with qk_norm_whole; ones when the
                                   model has no QK-norm), 4 qkv bias,
                                   5 post_attn_norm, 6 post_mlp_norm (post_norms; with residual_gates
                                   each sublayer's alpha and beta after it from lanes G and 2G,
                                   G = residual_gate_offset), else zero
    qkv            [L,  T, r, c]   [wq | wk | wv]                       (H x (Hq+2Hkv)D)
    o              [L,  T, r, c]   wo                                    (Hq D x H)
    gate_up        [Ld, T, r, c]   gate and up interleaved per column tile: tile column block j
                                   = [gate cols j*c/2 .. (j+1)*c/2 | the same up cols]
    down           [Ld, T, r, c]   w_down, rows padded to the padded FFN width
    shared_gate_up [Lm, T, r, c]   the same for the shared experts (side by side), MoE models only
    shared_down    [Lm, T, r, c]
    moe_in, moe_out [Lm, T, r, c]  Muse Spark's projections around the experts (moe_hidden_size M):
                                   [H, M] and [M, H]; the experts in pack_experts run at M
    lm_head        [T, r, c]       lm_head (or embed.T when tied), vocab padded to whole tiles

MLA models (tpumk.model.mla; lane layout `tpumk.plan.geometry.mla_dims`: nope / latent / value
parts padded per head to 128 lanes) stream, instead of qkv and o:

    q_a, q_b       [L, T, r, c]    wq_a; wq_b (rows padded like q_a's output) with its columns
                                   regrouped: every head's nope columns (each padded to 128),
                                   then every head's roped columns side by side (or q: wq so)
    kv_a           [L, T, r, c]    wkv_a: c_kv columns (padded to 128), then k_rope's (with the
                                   latent split over devices, q_a / kv_a are a device's slice of
                                   the columns as they are: tpumk.plan.sharding)
    uk             [L, Hq, n, c]   block-diagonal: tile h = head h's W_UK^T [nope, latent]
    uv             [L, Hq, c, v]   block-diagonal: tile h = head h's W_UV [latent, value]
    o              [L, T, r, c]    wo, each head's rows padded to 128
and the layer vectors' q_norm / k_norm rows hold q_a_norm / kv_a_norm. Quantized (uk / uv from
the quantized layer's own per-head `w_uk` / `w_uv`, tpumk.model.quantize): the scales follow the
same column (and row) orders, padded with zeros; uk / uv's column scales sit head block by head
block, their group scales one [scale_rows, tile_cols] block per diagonal tile.
    moe            {router, e_gateup, e_down}  tpumk.kernel.moe.pack_experts (MoE models only)

Inside a family, tile t of a matrix is (row block t % RB, column block t // RB) with RB =
rows / r: the row blocks of a column block are consecutive, so each finishes columns at once.
Each tile is contiguous in HBM: one DMA moves it.

Many devices: `pack_sharded(plan, params)` packs each device's part of the weights this way and
stacks them along a leading device axis (the embedding stays whole and shared).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from tpumk.model.config import ModelConfig
from tpumk.kernel.memory import shape_struct
from tpumk.plan.geometry import (LANE, LAYER_VECTOR_ROWS, LINEAR_ROW, VECTOR_ROW, LinearGeometry, heads_per_lane_block,
                                 mla_dims, round_up)
from tpumk.errors import PlanError
from tpumk.model.quantize import QuantizedMatrix, expert_format, scheme_of, weight_format
from tpumk.plan.plan import (MatrixFamily, Plan, auto_expert_chunk, layer_vector_width, o_bias_offset, residual_gate_offset,
                             plan_families,
                             scale_offsets)
from tpumk.model.reference import jnp_dtype
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.padding import params_as_run
from tpumk.plan.sharding import mla_kv_a



# Packing runs op by op outside any trace: one compiled program per matrix shape and family
# instead of one per op (pad, reshape, transpose); moving bits only, so the values are the same
@functools.partial(jax.jit, static_argnums=1)
def tile_matrix(w: jax.Array, fam: MatrixFamily) -> jax.Array:
    """[k, m] -> [tiles, r, c]: zero-pad to [k_pad, m_pad], cut, column block outer."""
    k, m = w.shape
    w = jnp.pad(w, ((0, fam.k_pad - k), (0, fam.m_pad - m)))
    rb, cb, r, c = fam.row_blocks, fam.col_blocks, fam.tile_rows, fam.tile_cols
    return w.reshape(rb, r, cb, c).transpose(2, 0, 1, 3).reshape(cb * rb, r, c)


@functools.partial(jax.jit, static_argnums=(2, 3))  # one program per shape (tile_matrix)
def interleave_gate_up(gate: jax.Array, up: jax.Array, f_pad: int, tile_cols: int) -> jax.Array:
    """[H, F] x 2 -> [H, 2 f_pad]: each tile_cols-wide column block = gate half | up half."""
    h, f = gate.shape
    half = tile_cols // 2
    g = jnp.pad(gate, ((0, 0), (0, f_pad - f))).reshape(h, f_pad // half, half)
    u = jnp.pad(up, ((0, 0), (0, f_pad - f))).reshape(h, f_pad // half, half)
    return jnp.concatenate([g, u], axis=-1).reshape(h, 2 * f_pad)


class _MLAColumns:
    """The MLA families' row and column orders (module docstring), applied alike to a matrix's
    codes and to its scales (per-column scales are a 1-row matrix, group scales one row per
    128 input rows): every padding is zeros."""

    def __init__(self, cfg: ModelConfig, fams: dict, latent_split: bool = False):
        dims = mla_dims(cfg)
        self.cfg, self.fams, self.latent_split = cfg, fams, latent_split
        self.npad, self.cpad, self.vpad = dims["nope"], dims["latent"], dims["value"]

    def q(self, w, rotates: bool = True):  # [K, Hq*(N+R)] -> [K, Hq*npad + rope lanes]: nope parts padded, then all ropes
        """A NoPE layer with all-latent keys (nope_latent_keys) has N + R nope lanes a head and
        no rope lanes: its rope columns are zeros (so its rotated query lanes are zero too)."""
        cfg, k = self.cfg, w.shape[0]
        hq, r = cfg.num_q_heads, cfg.qk_rope_head_dim
        n, r_layer = cfg.attention.layer_key_widths(rotates)
        heads = w.reshape(k, hq, n + r_layer)
        nope = jnp.pad(heads[..., :n], ((0, 0), (0, 0), (0, self.npad - n))).reshape(k, hq * self.npad)
        rope = heads[..., n:] if r_layer else jnp.zeros((k, hq, r), w.dtype)
        return jnp.concatenate([nope, rope.reshape(k, hq * r)], 1)

    def kv_a(self, w):  # [K, C+R] -> [K, cpad + R]: c_kv padded to whole lane tiles, then k_rope
        if self.latent_split:  # a device's slice of the columns: as it is
            return w
        c = self.cfg.kv_lora_rank
        return jnp.concatenate([jnp.pad(w[:, :c], ((0, 0), (0, self.cpad - c))), w[:, c:]], 1)


    def o_rows(self, w):  # [Hq*V, H] -> [Hq*vpad, H]: each head's rows padded
        hq, v = self.cfg.num_q_heads, self.cfg.v_head_dim
        return jnp.pad(w.reshape(hq, v, -1), ((0, 0), (0, self.vpad - v), (0, 0))).reshape(hq * self.vpad, -1)

    def diagonal(self, blocks, name: str, rows: int | None = None):
        """[Hq, r, c] -> tiles [Hq, rows (default tile_rows), tile_cols], zero-padded."""
        fam = self.fams[name]
        rows = fam.tile_rows if rows is None else rows
        return jnp.pad(blocks, ((0, 0), (0, rows - blocks.shape[1]), (0, fam.tile_cols - blocks.shape[2])))

    def flat_columns(self, blocks, name: str):
        """Per-head column scales [Hq, c] -> [Hq * tile_cols]: head h's block at h * tile_cols."""
        return self.diagonal(blocks[:, None, :], name, 1).reshape(-1)


def _pack_mla(cfg: ModelConfig, fams: dict, layers: list, cast, latent_split: bool = False) -> dict:
    """The MLA families of every layer (layout in the module docstring). `latent_split`: the
    layer's wkv_a is one device's output columns (`ShardingPlan.latent_slices`), packed as
    they are (the kernel places them after the all-gather)."""
    from tpumk.model.quantize import absorbed_weights

    cols = _MLAColumns(cfg, fams, latent_split)
    out: dict[str, list] = {}
    attention = cfg.pattern.attention_layers
    for i, l in zip(attention, layers):
        mats, rotates = {}, cfg.pattern.rotates(i)
        if cfg.q_lora_rank:
            mats["q_a"] = cast(l["wq_a"])
            mats["q_b"] = cols.q(cast(l["wq_b"]), rotates)
        else:
            mats["q"] = cols.q(cast(l["wq"]), rotates)
        mats["kv_a"] = cols.kv_a(cast(mla_kv_a(cfg, l)))  # (NoPE / KV-sharing layers: zero columns)
        if "idx_wk" in l:  # sparse attention's indexer (tpumk.kernel.sparse_attention): keys, queries
            mats["idx_k"], mats["idx_q"] = (cast(l[k])[:, indexer_lanes(cfg, l[k].shape[1], rotates)]
                                            for k in ("idx_wk", "idx_wq"))
        mats["o"] = cols.o_rows(cast(l["wo"]))
        for name, m in mats.items():
            out.setdefault(name, []).append(tile_matrix(m, fams[name]))
        w_uk, w_uv = absorbed_weights(cfg, l)  # [Hq, N, C], [Hq, C, V]
        out.setdefault("uk", []).append(cols.diagonal(cast(w_uk), "uk"))
        out.setdefault("uv", []).append(cols.diagonal(cast(w_uv), "uv"))
    return {name: jnp.stack(tiles) for name, tiles in out.items()}


def indexer_lanes(cfg: ModelConfig, width: int, rotates: bool = True) -> jax.Array:
    """The indexer's output lanes (`width`: one key, or every head's query) in the kernel's order:
    with index_rope_interleave (GLM-5) each head's first R lanes evens then odds, the order the
    reference ropes and caches them in (`sparse_attention._rope`), so the kernel's rotate-half
    RoPE applies; the key's LayerNorm is blind to the order (its weight and bias permuted alike).
    A NoPE layer's indexer (`rotates` False, Mistral Large 4) ropes nothing: its lanes as they are."""
    a, r = cfg.attention, cfg.qk_rope_head_dim
    lanes = jnp.arange(width)
    if not a.index_rope_interleave or not rotates:
        return lanes
    d = a.index_head_dim
    head = jnp.concatenate([jnp.arange(0, r, 2), jnp.arange(1, r, 2), jnp.arange(r, d)])
    return (lanes.reshape(-1, d)[:, head]).reshape(width)


def _pack_indexer_vectors(cfg: ModelConfig, layers: list) -> dict:
    """Sparse attention's float32 per-layer arrays: weights_proj [L, H, Hi lane-padded] and the key
    LayerNorm's weight and bias as rows 0 and 1 of [L, 8, Di lane-padded] (`contract.SPARSE_OPERANDS`)."""
    a = cfg.attention
    hi = round_up(a.index_heads, LANE)
    lanes = max(round_up(a.index_head_dim, LANE), hi if a.query_log_scale else 0,
                round_up(cfg.hidden_size, LANE) if a.index_q_hidden else 0)  # (SparseGeometry.norm_lanes)
    w = [jnp.pad(jnp.asarray(l["idx_weights"], jnp.float32), ((0, 0), (0, hi - a.index_heads))) for l in layers]
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    norm = []
    for i, l in zip(cfg.indexer_layers, layers):
        order = indexer_lanes(cfg, a.index_head_dim, cfg.pattern.rotates(i))
        rows = jnp.zeros((8, lanes), jnp.float32).at[0, :a.index_head_dim].set(f32(l["idx_k_norm"])[order])
        rows = rows.at[1, :a.index_head_dim].set(f32(l["idx_k_bias"])[order])
        if a.query_log_scale:  # rows 2, 3: the queries' per-head log-position scale and bias
            rows = rows.at[2, :a.index_heads].set(f32(l["idx_log_scale"])).at[3, :a.index_heads].set(
                f32(l["idx_log_bias"]))
        if a.index_q_hidden:  # rows 4, 5: the LayerNorm of x the queries project
            h = cfg.hidden_size
            rows = rows.at[4, :h].set(f32(l["idx_q_norm"])).at[5, :h].set(f32(l["idx_q_bias"]))
        norm.append(rows)
    return {"idx_weights": jnp.stack(w), "idx_norm": jnp.stack(norm)}


def _mla_scale_parts(cfg: ModelConfig, fams: dict, lay: dict, layer: int, grouped: bool,
                     latent_split: bool = False) -> dict:
    """MLA layer `layer`'s scales in the families' packed order: column-scaled formats, each family's
    [M] row (uk / uv: every head's block side by side, as the diagonal tiles' column blocks);
    group-scaled, each family's [K/128, M] matrix (uk / uv: the tiles' scale blocks [Hq,
    scale_rows, tile_cols])."""
    from tpumk.model.quantize import absorbed_weights

    cols = _MLAColumns(cfg, fams, latent_split)

    def s(key):  # as a matrix: [1, M] or [K/128, M]
        return lay[key].scale if grouped else lay[key].scale[None]

    out = {"kv_a": cols.kv_a(s("wkv_a"))}
    if cfg.q_lora_rank:
        out["q_a"], out["q_b"] = s("wq_a"), cols.q(s("wq_b"))
    else:
        out["q"] = cols.q(s("wq"))
    # o: its rows are padded per head, but a grouped build has V % 128 == 0 (the plan refuses
    # others), so no padding lands inside a row group: its group scales keep their order
    out["o"] = s("wo")
    if "idx_wk" in lay:  # the indexer's keys and queries: columns in the codes' lane order
        rotates = cfg.pattern.rotates(layer)
        for name, key in (("idx_k", "idx_wk"), ("idx_q", "idx_wq")):
            out[name] = s(key)[:, indexer_lanes(cfg, lay[key].shape[1], rotates)]
    w_uk, w_uv = absorbed_weights(cfg, lay)
    for name, w in (("uk", w_uk), ("uv", w_uv)):
        out[name] = (cols.diagonal(w.scale, name, fams[name].scale_rows) if grouped
                     else cols.flat_columns(w.scale, name)[None])
    return out if grouped else {k: v[0] for k, v in out.items()}


# lin_in's parts in column order (LinearGeometry.proj_offsets): the part, then its weight
_LIN_IN_PARTS = {"gated_delta": (("conv", "lin_qkv"), ("b", "lin_b"), ("a", "lin_a"), ("z", "lin_z")),
                 "kda": (("conv", "lin_qkv"), ("b", "lin_b"), ("f_a", "lin_f_a"), ("g_a", "lin_g_a"))}


def linear_in(cfg: ModelConfig, lay: dict, part) -> jax.Array:
    """A linear layer's lin_in matrix [K, proj width] (or its column scales, when `part(key)`
    gives a [1, M] row): each part at its `LinearGeometry.proj_offsets` column, zeros between."""
    geom = LinearGeometry.from_config(cfg, 1, 1)
    offsets = geom.proj_offsets
    pieces = [part(key) for _, key in _LIN_IN_PARTS[geom.kind]]
    out = jnp.zeros((pieces[0].shape[0], offsets["width"]), pieces[0].dtype)
    for (name, _), piece in zip(_LIN_IN_PARTS[geom.kind], pieces):
        out = out.at[:, offsets[name]:offsets[name] + piece.shape[1]].set(piece)
    return out


def _linear_families(cfg: ModelConfig, fams: dict, layers: list, cast) -> dict:
    """Every linear layer's lin_in, (KDA) lin_fb and lin_gb, and lin_out, in the linear layers' order."""
    out: dict[str, list] = {}
    for i, l in enumerate(layers):
        if not cfg.pattern.is_linear(i):
            continue
        mats = {"lin_in": linear_in(cfg, l, lambda k, l=l: cast(l[k]))}
        if cfg.linear.linear_kind == "kda":
            mats.update(lin_fb=cast(l["lin_f_b"]), lin_gb=cast(l["lin_g_b"]))
        mats["lin_out"] = cast(l["lin_out"])
        for name, m in mats.items():
            out.setdefault(name, []).append(tile_matrix(m, fams[name]))
    return {name: jnp.stack(tiles) for name, tiles in out.items()}


def _linear_vectors(cfg: ModelConfig, lay: dict, block: jax.Array) -> jax.Array:
    """A linear layer's vector rows (`tpumk.plan.geometry.LINEAR_ROW`): the gated norm, the
    decay row (A_log per value head, dt_bias from lane 128), the convolution's taps."""
    f32 = lambda k: jnp.asarray(lay[k], jnp.float32)  # noqa: E731
    block = block.at[LINEAR_ROW["norm"], :cfg.linear.linear_value_dim].set(f32("lin_norm"))
    block = block.at[LINEAR_ROW["decay"], :cfg.linear.linear_value_heads].set(f32("lin_A_log"))
    dt_bias = f32("lin_dt_bias")
    block = block.at[LINEAR_ROW["decay"], 128:128 + dt_bias.shape[0]].set(dt_bias)
    taps = f32("lin_conv")  # [taps, C]
    return block.at[LINEAR_ROW["taps"]:LINEAR_ROW["taps"] + taps.shape[0], :taps.shape[1]].set(taps)


def _families_of(plan_or_cfg: Plan | ModelConfig, tuning: TuningConfig | None, quant: str):
    if isinstance(plan_or_cfg, Plan):
        if plan_or_cfg.quant != quant:
            raise PlanError(f"pack_weights: weights quantized as '{quant}', the plan streams '{plan_or_cfg.quant}' "
                            "(quantize them with tpumk.model.quantize.quantize_params(cfg, params, plan.quant))")
        plan = plan_or_cfg
        chunk = plan.moe.expert_chunk if plan.moe is not None else None
        return plan.cfg, plan.families, plan.ffn_pad, plan.shared_ffn_pad, chunk
    cfg, tuning = plan_or_cfg, tuning or TuningConfig()
    fams, ffn_pad, shared_pad = plan_families(cfg, tuning, quant)
    chunk = (tuning.expert_chunk or auto_expert_chunk(cfg, tuning, expert_format(quant))) if cfg.is_moe else None
    return cfg, fams, ffn_pad, shared_pad, chunk


def pack_weights(plan_or_cfg: Plan | ModelConfig, params: dict, tuning: TuningConfig | None = None) -> dict:
    """Reference-layout weights -> the kernel layout described in this module's docstring.

    Pass the Plan the kernel is built from (or a ModelConfig plus the TuningConfig, which fix
    the same layout)."""
    if isinstance(plan_or_cfg, Plan) and plan_or_cfg.sharding is None:
        params = params_as_run(plan_or_cfg, params)  # a lane-padded plan: the padded model's weights
    quant = scheme_of(params)
    cfg, fams, ffn_pad, shared_pad, expert_chunk = _families_of(plan_or_cfg, tuning, quant)
    split = isinstance(plan_or_cfg, Plan) and plan_or_cfg.latent_split  # wkv_a: a device's columns
    dt = jnp_dtype(cfg)
    h, d = cfg.hidden_size, cfg.head_dim
    width = layer_vector_width(cfg)
    layers = params["layers"]

    def vectors(lay: dict) -> jax.Array:
        block = jnp.zeros((LAYER_VECTOR_ROWS, width), jnp.float32)
        # the norms the layer has (no attn_norm / mlp_norm without pre_norms: their rows stay 0, unread)
        for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
            if name in lay:
                block = block.at[VECTOR_ROW[name], :h].set(jnp.asarray(lay[name], jnp.float32))
        if cfg.norms.residual_gates:  # each post row: the norm, then alpha, then beta, from lane tiles
            at = residual_gate_offset(cfg)
            for which, name in (("attn", "post_attn_norm"), ("mlp", "post_mlp_norm")):
                for k, c in enumerate(("alpha", "beta")):
                    block = block.at[VECTOR_ROW[name], (k + 1) * at:(k + 1) * at + h].set(
                        jnp.asarray(lay[f"res_{which}_{c}"], jnp.float32))
        pack = heads_per_lane_block(d)  # 64-wide heads: the row repeats once per head of a lane block
        if "lin_qkv" in lay:  # a linear layer: its own rows
            return _linear_vectors(cfg, lay, block)
        if cfg.is_mla:  # the latent norms take the q_norm / k_norm rows
            if cfg.q_lora_rank:
                block = block.at[VECTOR_ROW["q_norm"], :cfg.q_lora_rank].set(jnp.asarray(lay["q_a_norm"], jnp.float32))
            if cfg.attention.query_log_scale:  # per head: s_h and b_h (Mistral Large 4)
                hq = cfg.num_q_heads
                block = block.at[VECTOR_ROW["q_log_scale"], :hq].set(jnp.asarray(lay["q_log_scale"], jnp.float32))
                block = block.at[VECTOR_ROW["q_log_bias"], :hq].set(jnp.asarray(lay["q_log_bias"], jnp.float32))
            if "kv_a_norm" not in lay:  # a layer reading another's rows: no latent norm (unread)
                return block
            return block.at[VECTOR_ROW["k_norm"], :cfg.kv_lora_rank].set(jnp.asarray(lay["kv_a_norm"], jnp.float32))
        for name in ("q_norm", "k_norm"):
            w = jnp.asarray(lay[name], jnp.float32) if cfg.attention.qk_norm else jnp.ones((d,), jnp.float32)
            if cfg.attention.qk_norm_whole:  # across every head: laid out as the q (k) columns
                block = block.at[VECTOR_ROW[name], :w.shape[0]].set(w)
            else:
                block = block.at[VECTOR_ROW[name], :d * pack].set(jnp.tile(w, pack))
        if cfg.attention.qkv_bias:  # one row laid out as the qkv family's columns: q | k | v
            bias = jnp.concatenate([jnp.asarray(lay[n], jnp.float32) for n in ("bq", "bk", "bv")])
            block = block.at[VECTOR_ROW["qkv_bias"], :bias.shape[0]].set(bias)
        if cfg.attention.o_bias:  # the same row, from the next lane tile: o's bias [H]
            at = o_bias_offset(cfg)
            block = block.at[VECTOR_ROW["qkv_bias"], at:at + h].set(jnp.asarray(lay["bo"], jnp.float32))
        if "moe_in_norm" in lay:  # Muse Spark's experts' input norm ((1 + w) folded on load)
            m = cfg.moe.moe_hidden_size
            block = block.at[VECTOR_ROW["moe_in_norm"], :m].set(jnp.asarray(lay["moe_in_norm"], jnp.float32))
        if cfg.attention.attn_sinks:  # one lane per q head (tpumk.kernel.attention reads it per query row)
            block = block.at[VECTOR_ROW["sinks"], :cfg.num_q_heads].set(jnp.asarray(lay["sinks"], jnp.float32))
        return block

    def cast(a) -> jax.Array:
        """A matrix in the ring dtype: quantized codes as they are, else the model dtype."""
        return a.q if isinstance(a, QuantizedMatrix) else jnp.asarray(a, dt)

    out: dict[str, Any] = {
        "embed": cast(params["embed"]),
        "final_norm": jnp.asarray(params["final_norm"], jnp.float32).reshape(1, h),
        "layer_vectors": jnp.stack([vectors(lay) for lay in layers]),
    }
    attention = [l for i, l in enumerate(layers) if not cfg.pattern.is_linear(i)]
    if cfg.is_mla:
        out.update(_pack_mla(cfg, fams, attention, cast, split))
        if cfg.attention.is_sparse:
            out.update(_pack_indexer_vectors(cfg, [layers[i] for i in cfg.indexer_layers]))
        if cfg.rope_learned_freqs:  # the glue's RoPE tables (megakernel.mla_rope_tables), never the kernel's
            out["rope_alpha"] = jnp.asarray(params["rope_alpha"], jnp.float32)
    else:
        out["qkv"] = jnp.stack([tile_matrix(jnp.concatenate([cast(l[k]) for k in qkv_keys(cfg)], 1), fams["qkv"])
                                for l in attention])
        out["o"] = jnp.stack([tile_matrix(cast(l["wo"]), fams["o"]) for l in attention])
    if cfg.linear:
        out.update(_linear_families(cfg, fams, layers, cast))
    dense = [l for i, l in enumerate(layers) if cfg.pattern.is_dense(i)]
    if dense and "gate_up" in fams:
        gu, dn = fams["gate_up"], fams["down"]
        out["gate_up"] = jnp.stack([tile_matrix(interleave_gate_up(cast(l["w_gate"]), cast(l["w_up"]), ffn_pad,
                                                                   gu.tile_cols), gu) for l in dense])
        out["down"] = jnp.stack([tile_matrix(cast(l["w_down"]), dn) for l in dense])
    if cfg.is_moe:
        from tpumk.kernel.moe import pack_experts

        moe_layers = [l for i, l in enumerate(layers) if not cfg.pattern.is_dense(i)]
        if "shared_gate_up" in fams:
            gu, dn = fams["shared_gate_up"], fams["shared_down"]
            out["shared_gate_up"] = jnp.stack([tile_matrix(interleave_gate_up(
                cast(l["s_gate"]), cast(l["s_up"]), shared_pad, gu.tile_cols), gu) for l in moe_layers])
            out["shared_down"] = jnp.stack([tile_matrix(cast(l["s_down"]), dn) for l in moe_layers])
        for name in ("moe_in", "moe_out"):  # Muse Spark's projections around the experts
            if name in fams:
                out[name] = jnp.stack([tile_matrix(cast(l[name]), fams[name]) for l in moe_layers])
        plan = plan_or_cfg if isinstance(plan_or_cfg, Plan) else None
        out["moe"] = pack_experts(cfg, params, expert_chunk, fp4_native=bool(plan and plan.moe.fp4_native))
    head = cast(params["lm_head"]) if "lm_head" in params else cast(params["embed"]).T
    out["lm_head"] = tile_matrix(head, fams["lm_head"])
    fmt = weight_format(quant)
    if fmt is not None and fmt.group:
        out.update(_pack_tile_scales(cfg, fams, ffn_pad, shared_pad, params, split))
    elif fmt is not None:
        out.update(_pack_scales(cfg, fams, ffn_pad, shared_pad, params, split))
    return out


def qkv_keys(cfg: ModelConfig) -> tuple[str, ...]:
    """The qkv family's matrices side by side: q | k | v, then attn_output_gate's gate."""
    return ("wq", "wk", "wv") + (("wq_gate",) if cfg.attention.attn_output_gate else ())


def _pack_tile_scales(cfg: ModelConfig, fams: dict, ffn_pad: int, shared_pad: int, params: dict,
                      split: bool = False) -> dict:
    """Group scales of a group-scaled ring (fp8-b128) as `scales_<family>`: each family's scale
    matrix [K/group, M] in the packed column order, cut like the codes (a tile of r rows has
    r/group scale rows), each tile's rows padded to `scale_rows`. Padded rows and columns get 0
    (their codes are 0 too)."""
    layers = params["layers"]

    def tiles(scale: jax.Array, fam: MatrixFamily) -> jax.Array:
        g = fam.group
        shape = dataclasses.replace(fam, k=scale.shape[0], k_pad=fam.k_pad // g, tile_rows=fam.tile_rows // g)
        t = tile_matrix(jnp.asarray(scale, jnp.float32), shape)
        return jnp.pad(t, ((0, 0), (0, fam.scale_rows - shape.tile_rows), (0, 0)))

    attention = [l for i, l in enumerate(layers) if not cfg.pattern.is_linear(i)]
    if cfg.is_mla:
        parts = [_mla_scale_parts(cfg, fams, l, i, grouped=True, latent_split=split)
                 for i, l in enumerate(layers) if not cfg.pattern.is_linear(i)]
        # (idx_k / idx_q: stacked over the layers with an indexer of their own, as their codes)
        out = {f"scales_{name}": jnp.stack([p[name] if fams[name].diagonal else tiles(p[name], fams[name])
                                            for p in parts if name in p]) for name in dict.fromkeys(n for p in parts for n in p)}
    else:
        out = {"scales_qkv": jnp.stack([tiles(jnp.concatenate([l[k].scale for k in qkv_keys(cfg)], 1), fams["qkv"])
                                        for l in attention]),
               "scales_o": jnp.stack([tiles(l["wo"].scale, fams["o"]) for l in attention])}
    if cfg.linear:
        lin = [l for i, l in enumerate(layers) if cfg.pattern.is_linear(i)]
        out["scales_lin_in"] = jnp.stack([tiles(linear_in(cfg, l, lambda k, l=l: l[k].scale), fams["lin_in"]) for l in lin])
        for name, key in (("lin_fb", "lin_f_b"), ("lin_gb", "lin_g_b"), ("lin_out", "lin_out")):
            if name in fams:
                out[f"scales_{name}"] = jnp.stack([tiles(l[key].scale, fams[name]) for l in lin])
    dense = [l for i, l in enumerate(layers) if cfg.pattern.is_dense(i)]
    moe = [l for i, l in enumerate(layers) if not cfg.pattern.is_dense(i)]
    for prefix, group, pad, (gate, up, down) in (("", dense, ffn_pad, ("w_gate", "w_up", "w_down")),
                                                 ("shared_", moe, shared_pad, ("s_gate", "s_up", "s_down"))):
        if group and f"{prefix}gate_up" in fams:
            gu, dn = fams[f"{prefix}gate_up"], fams[f"{prefix}down"]
            out[f"scales_{prefix}gate_up"] = jnp.stack([tiles(interleave_gate_up(
                l[gate].scale, l[up].scale, pad, gu.tile_cols), gu) for l in group])
            out[f"scales_{prefix}down"] = jnp.stack([tiles(l[down].scale, dn) for l in group])
    for name in ("moe_in", "moe_out"):
        if name in fams:
            out[f"scales_{name}"] = jnp.stack([tiles(l[name].scale, fams[name]) for l in moe])
    out["scales_lm_head"] = tiles(params["lm_head"].scale, fams["lm_head"])
    return out


def _pack_scales(cfg: ModelConfig, fams: dict, ffn_pad: int, shared_pad: int, params: dict,
                 split: bool = False) -> dict:
    """Column scales of a quantized build in the packed column order: `layer_scales` [L, 1, S]
    (each layer family at `scale_offsets`, a family the layer lacks left 0) and `head_scales`
    [1, padded vocab]. Padded columns get 0 (their codes are 0 too)."""
    offsets = scale_offsets(fams)
    width = sum(fams[n].m_pad for n in offsets)

    def padded(v, m_pad: int):
        return jnp.pad(jnp.asarray(v, jnp.float32), (0, m_pad - v.shape[0]))

    def row(i: int, lay: dict):
        if "lin_qkv" in lay:  # a linear layer's families
            parts = {"lin_in": linear_in(cfg, lay, lambda k: lay[k].scale[None])[0], "lin_out": lay["lin_out"].scale}
            if "lin_fb" in fams:
                parts.update(lin_fb=lay["lin_f_b"].scale, lin_gb=lay["lin_g_b"].scale)
        elif cfg.is_mla:
            parts = _mla_scale_parts(cfg, fams, lay, i, grouped=False, latent_split=split)
        else:
            parts = {"qkv": jnp.concatenate([lay[k].scale for k in qkv_keys(cfg)]), "o": lay["wo"].scale}
        for prefix, gate, up, down, pad in (("", "w_gate", "w_up", "w_down", ffn_pad),
                                            ("shared_", "s_gate", "s_up", "s_down", shared_pad)):
            if gate in lay and f"{prefix}gate_up" in fams:
                tc = fams[f"{prefix}gate_up"].tile_cols
                parts[f"{prefix}gate_up"] = interleave_gate_up(lay[gate].scale[None], lay[up].scale[None], pad, tc)[0]
                parts[f"{prefix}down"] = lay[down].scale
        for name in ("moe_in", "moe_out"):
            if name in lay and name in fams:
                parts[name] = lay[name].scale
        r = jnp.zeros((width,), jnp.float32)
        for name, v in parts.items():
            lo = offsets[name]
            r = r.at[lo:lo + fams[name].m_pad].set(padded(v, fams[name].m_pad))
        return r

    rows = jnp.stack([row(i, lay) for i, lay in enumerate(params["layers"])])[:, None, :]
    head = params["lm_head"].scale
    return {"layer_scales": rows, "head_scales": padded(head, fams["lm_head"].m_pad)[None, :]}


def packed_specs(plan: Plan) -> dict:
    """ShapeDtypeStructs of `pack_weights(plan, ...)`: compile a full-size model with no weights.

    Read from the kernel contract's packed leaves (`plan.contract.packed`, sources
    "packed.<key>" and "packed.moe.<key>"), the shapes the kernel's operands are declared with."""
    out: dict[str, Any] = {}
    for b in plan.contract.packed:
        _, *path = b.source.split(".")
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = shape_struct(b)
    if plan.cfg.rope_learned_freqs:  # read by the glue only (megakernel.mla_rope_tables): no operand
        out["rope_alpha"] = jax.ShapeDtypeStruct((plan.cfg.qk_rope_head_dim // 2,), jnp.float32)
    return out


def pack_sharded(plan: Plan, params: dict) -> dict:
    """Reference-layout weights -> the packed pytree of a many-device step: each device's part
    (`ShardingPlan.device_params`) packed as for one device and stacked along a leading device
    axis, and the whole embedding, which every device keeps (token rows are gathered from it).
    One device: `pack_weights(plan, params)`."""
    if plan.sharding is None:
        return pack_weights(plan, params)
    model, sh = plan.whole_model, plan.sharding
    params = params_as_run(plan, params)
    parts = []
    for d in range(sh.devices):
        part = pack_weights(plan, sh.device_params(model, params, d))
        part.pop("embed")
        parts.append(part)
    out = jax.tree.map(lambda *leaves: jnp.stack(leaves), *parts)
    out["embed"] = jnp.asarray(params["embed"], jnp_dtype(model))
    return out
