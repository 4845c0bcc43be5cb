"""The plan: everything a megakernel build does, decided in plain Python before tracing.

`make_plan(spec, num_pages=None)` turns a `BuildSpec` (model, target, shape, tuning knobs) into
a `Plan`: which weight tiles stream through the ring in which order, the ring's shape, the
expert slots, the KV tiling, a VMEM budget with a per-component breakdown, the HBM bytes one
step moves and the DMAs it issues. The kernel (`tpumk.kernel.megakernel`) and the weight packer
(`tpumk.kernel.layout`) only walk this value. A configuration that cannot work (tiles that do
not divide a matrix, a VMEM budget overrun, a model bigger than the device's HBM) raises
PlanError here, with a message naming the knob, before anything is compiled.

Weight streaming vocabulary:
- a *family* is one kind of dense matrix, fused where narrow ones sit side by side:
  `qkv` = [wq | wk | wv] (H x (Hq+2Hkv)D), `o` = wo, `gate_up` = gate and up interleaved per
  column tile (each tile holds gate columns then the same up columns), `down`, the shared
  expert's `shared_gate_up` / `shared_down`, Muse Spark's `moe_in` / `moe_out` around the
  routed experts, and `lm_head`.
- a family's matrix is cut into tiles [tile_rows, tile_cols]; tile t = col_block * row_blocks +
  row_block (all row blocks of a column block in a row, so each column block finishes at once).
- a *segment* is a run of consecutive layers of one kind (dense or MoE) walked by one top-level
  loop, or the lm_head. The ring order is: segment by segment, layer by layer, family by
  family, tile by tile; global tile g sits in ring slot g % ring_depth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from tpumk.model import kv_quant, sparse_attention
from tpumk.model.config import ModelConfig
from tpumk.model.quantize import WeightFormat, expert_format, quantized_weight_bytes, weight_format
from tpumk.errors import NotSupportedError, PlanError, VMEMError
from tpumk.targets import Target
from tpumk.plan.contract import MLA_FAMILIES, KernelContract, kernel_contract, latent_slice_bytes, logits_slice_bytes
from tpumk.plan.geometry import (LANE, LAYER_VECTOR_ROWS, LINEAR_ROW, AllReduceGeometry, AttentionGeometry, SparseGeometry,
                                 LinearGeometry, MLAGeometry, MoEGeometry, QUERY_SCALE_LANES, mla_dims, rope_table_lanes,
                                 round_up)
from tpumk.plan.knobs import AUTO_RING_DEPTH, TuningConfig
from tpumk.plan.padding import lane_padded
from tpumk.plan.sharding import ShardingPlan, per_device_weight_bytes, plan_sharding
from tpumk.plan.spec import BuildSpec

# Auto tiles are at least this many columns wide: measured in the TPU7x static profile, 2 MiB
# tiles of [4096, 256] cost 1.6x the cycles per byte of [1024, 1024], [512, 2048] or [2048, 512]
# (narrow tiles starve the MXU), so auto rows stop where the width would drop below this.
AUTO_MIN_TILE_COLS = 1024
# Tokens per KV tile behind the tuning space's `kv_auto_tile_pages` fact (tpumk.tune.space); the
# plan's own auto choice is `_choose_kv_knobs`.
KV_TILE_TOKENS = 256
COMPILER_DEFAULT_SCOPED_VMEM = 32 * 2**20  # XLA:TPU's scoped VMEM limit unless a kernel sets one
MOSAIC_HEADROOM = 4 * 2**20  # Mosaic internal scratch + register spills (3.9 MiB measured, qwen3-8b)


# ---------------------------------------------------------------------- families and segments
@dataclass(frozen=True)
class MatrixFamily:
    """One kind of streamed matrix, its padding and its tiling (all static ints)."""

    name: str
    k: int  # input dim of the logical matrix
    m: int  # output columns of the logical matrix (gate_up: 2 * ffn width)
    k_pad: int  # k padded with zero rows (only `down`, to match the padded FFN width)
    m_pad: int  # m padded with zero columns to whole column tiles
    tile_rows: int
    tile_cols: int
    stack: int  # matrices of this family stacked in HBM (layers that carry it; 1 for lm_head)
    itemsize: int
    group: int = 0  # group-scaled formats (fp8-b128): input rows per scale; 0: none or per column
    # Block-diagonal (MLA's per-head W_UK / W_UV): tile t is block (t, t), the input's row block
    # t times it gives output column block t; the off-diagonal blocks are zero and not stored.
    diagonal: bool = False

    @property
    def row_blocks(self) -> int:
        return self.k_pad // self.tile_rows

    @property
    def col_blocks(self) -> int:
        return self.m_pad // self.tile_cols

    @property
    def tiles(self) -> int:
        """Tiles of one matrix (one layer's)."""
        return self.col_blocks if self.diagonal else self.row_blocks * self.col_blocks

    @property
    def tile_bytes(self) -> int:
        return self.tile_rows * self.tile_cols * self.itemsize

    @property
    def packed_shape(self) -> tuple[int, ...]:
        """HBM array of this family: [stack, tiles, rows, cols] (lm_head: [tiles, rows, cols])."""
        tile = (self.tiles, self.tile_rows, self.tile_cols)
        return tile if self.name == "lm_head" else (self.stack, *tile)

    @property
    def scale_rows(self) -> int:
        """Group-scaled: a tile's scale rows (one per `group` input rows), padded to the f32
        (8, 128) tile so each tile's scales are one aligned DMA; 0 otherwise."""
        return round_up(self.tile_rows // self.group, 8) if self.group else 0

    @property
    def scale_tile_bytes(self) -> int:
        return self.scale_rows * self.tile_cols * 4

    @property
    def packed_scale_shape(self) -> tuple[int, ...]:
        """Group-scaled: the HBM array of the tiles' scales, in the tiles' order."""
        tile = (self.tiles, self.scale_rows, self.tile_cols)
        return tile if self.name == "lm_head" else (self.stack, *tile)

    def summary(self) -> dict[str, Any]:
        return {"matrix": [self.k, self.m], "padded": [self.k_pad, self.m_pad],
                "tile": [self.tile_rows, self.tile_cols], "tiles_per_matrix": self.tiles,
                "matrices": self.stack, "tile_bytes": self.tile_bytes,
                **({"block_diagonal": True} if self.diagonal else {}),
                **({"scale_group": self.group, "scale_tile_bytes": self.scale_tile_bytes} if self.group else {})}


@dataclass(frozen=True)
class Segment:
    """A run of same-kind layers walked by one top-level loop (or the lm_head)."""

    kind: str  # "dense" | "moe" (the FFN) | "lm_head"
    first_layer: int  # model index of the first layer (lm_head: num_layers)
    num_layers: int  # 1 for the lm_head
    families: tuple[str, ...]  # ring families of one layer, in stream order
    stack_base: tuple[int, ...]  # per family: stack index of this segment's first layer
    family_offsets: tuple[int, ...]  # per family: index of its first tile within a layer
    tiles_per_layer: int
    first_tile: int  # global ring index of this segment's first tile
    moe_base: int = 0  # MoE-layer ordinal of the first layer (moe segments)
    linear: bool = False  # the layers' token mixer: linear attention (tpumk.kernel.linear_attention)
    kv_base: int = 0  # the first layer's KV-cache layer (attention) or state-pool layer (linear)
    # sparse attention: the first layer's index-key cache layer; -1: the layers keep the previous
    # layer's selection (index_shared_layers) and run no indexer
    index_base: int = -1

    @property
    def end_layer(self) -> int:
        return self.first_layer + self.num_layers

    @property
    def tiles(self) -> int:
        return self.num_layers * self.tiles_per_layer

    def family_at(self, t: int) -> tuple[int, int]:
        """(family position, tile index within the family) of static in-layer tile t."""
        for pos in reversed(range(len(self.families))):
            if t >= self.family_offsets[pos]:
                return pos, t - self.family_offsets[pos]
        raise ValueError(t)


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    cfg: ModelConfig
    target: Target
    tuning: TuningConfig
    batch: int
    q_len: int
    context: int  # cache capacity per sequence (pages_per_seq * page_size) and byte-accounting length
    page_size: int
    pages_per_seq: int
    num_pages: int
    families: dict[str, MatrixFamily]
    segments: tuple[Segment, ...]
    ring_depth: int
    slot_rows: int
    slot_cols: int
    ffn_pad: int  # dense FFN width padded to whole gate/up half tiles (0 without dense layers)
    shared_ffn_pad: int  # shared-expert width, padded likewise (0 without shared experts)
    attention: AttentionGeometry
    moe: MoEGeometry | None
    vmem: dict[str, int] = field(default_factory=dict)
    # A hybrid model's linear-attention stage (tpumk.kernel.linear_attention); None otherwise.
    linear: LinearGeometry | None = None
    # Compiler temporaries the kernel's VMEM needs besides `vmem` (not buffers of the contract):
    # estimates, counted in the budget check and in `vmem_limit` (see `_vmem_temporaries`).
    vmem_temporaries: dict[str, int] = field(default_factory=dict)
    vmem_budget: int = 0
    hbm: dict[str, float] = field(default_factory=dict)
    dmas: dict[str, dict[str, float]] = field(default_factory=dict)
    # Many devices: `cfg` above is the model ONE device computes (its heads, widths and vocab
    # slice, `ShardingPlan.local_config`); `model` is the whole model. One device: model is cfg.
    model: ModelConfig | None = None
    sharding: ShardingPlan | None = None
    all_reduce: AllReduceGeometry | None = None  # the in-kernel all-reduce (None on one device)
    interconnect: dict[str, dict[str, float]] = field(default_factory=dict)  # per device, per step
    quant: str = "none"  # format of the ring's matrices (tpumk.model.quantize)
    # The model as the user gave it when its widths are lane padded (tpumk.plan.padding): `cfg`
    # and `model` are then the padded copy the kernel runs. None: no padding.
    unpadded: ModelConfig | None = None
    # Hidden states the step also writes (`BuildSpec.taps`): the kernel's `taps` output.
    taps: tuple[int, ...] = ()
    # DeepSeek Sparse Attention's indexer, selection and gather (tpumk.kernel.sparse_attention); None: dense.
    sparse: SparseGeometry | None = None

    # ---- derived facts
    @functools.cached_property
    def contract(self) -> KernelContract:
        """The kernel's contract: its operands, outputs, aliases and scratch, in order, with
        shapes, dtypes and memory spaces (`tpumk.plan.contract`). The kernel is built from it
        and the VMEM breakdown counts its buffers."""
        return kernel_contract(self)

    @property
    def cache_written_after_kernel(self) -> bool:
        """True when the kernel does not update the KV cache in place: it writes the pages this
        step patches to an output, and the step scatters them into the donated cache after it
        (`tpumk.kernel.megakernel.commit_pages`). So on many devices: XLA copies every operand
        a Pallas call compiled with `collective_id` aliases (the whole cache, in and out, each
        step; docs/many-devices.md "The KV cache copies"), and a read-only operand it does not."""
        return self.all_reduce is not None

    @property
    def spec(self) -> BuildSpec:
        """The build this plan is for (context as planned: whole pages); planning it again
        gives this plan."""
        return BuildSpec(self.unpadded or self.whole_model, self.target, self.batch, self.context, self.tuning, self.q_len,
                         self.page_size, self.devices, self.quant, self.attention.kv_dtype, self.taps)

    @property
    def weight_format(self) -> WeightFormat | None:
        """The ring matrices' quantized format (None: the model dtype)."""
        return weight_format(self.quant)

    @property
    def ring_dtype(self) -> str:
        """dtype of the ring's tiles in HBM and VMEM."""
        return self.weight_format.dtype if self.weight_format is not None else self.cfg.dtype

    @property
    def ring_grouped(self) -> bool:
        """The ring's format has scales per 128 input rows (fp8-b128): each tile's scales
        stream with it, instead of one scale row per layer."""
        return self.weight_format is not None and bool(self.weight_format.group)

    @property
    def column_scaled(self) -> bool:
        """The ring's format has one scale per output column (int8, fp8)."""
        return self.weight_format is not None and not self.weight_format.group

    @functools.cached_property
    def scale_offsets(self) -> dict[str, int]:
        """Column-scaled builds: where each layer family's column scales start in a layer's scale
        row (`layer_scales`, f32 [L, 1, scales_width]; families in ring order, each m_pad wide;
        a layer lacking a family leaves its columns zero). Empty otherwise."""
        return scale_offsets(self.families) if self.column_scaled else {}

    @property
    def scales_width(self) -> int:
        return sum(self.families[n].m_pad for n in self.scale_offsets)

    @property
    def whole_model(self) -> ModelConfig:
        """The model the build is for (on many devices `cfg` is one device's part of it)."""
        return self.model or self.cfg

    @property
    def devices(self) -> int:
        return self.sharding.devices if self.sharding is not None else 1

    @property
    def latent_split(self) -> bool:
        """MLA on many devices: q_a / kv_a split by output columns, the latent all-gathered in
        the kernel once per layer (`ShardingPlan.latent_split`)."""
        return self.sharding is not None and self.sharding.latent_split

    @property
    def layer_collectives(self) -> int:
        """In-kernel all-reduces per layer (`ShardingPlan.collectives_per_layer`); 0 on one device."""
        return self.sharding.collectives_per_layer(self.cfg) if self.sharding is not None else 0

    @property
    def collectives_per_step(self) -> int:
        return int(sum(v["count"] for v in self.interconnect.values()))

    @property
    def interconnect_bytes(self) -> float:
        """Bytes one device sends to its peers per step."""
        return sum(v["count"] * v["bytes_each"] for v in self.interconnect.values())

    @property
    def rows(self) -> int:
        """Token rows one step computes: batch * q_len."""
        return self.batch * self.q_len

    @property
    def total_tiles(self) -> int:
        return sum(s.tiles for s in self.segments)

    @property
    def vocab_pad(self) -> int:
        return self.families["lm_head"].m_pad

    @property
    def vector_width(self) -> int:
        return layer_vector_width(self.cfg)

    @property
    def all_nope(self) -> bool:
        """No attention layer is rotated (nope_layers on every one): the step's RoPE tables are
        identities; with NoPE on some layers only, the kernel skips those layers' rotation."""
        cfg = self.cfg
        return bool(cfg.nope_layers) and set(cfg.nope_layers) >= set(cfg.pattern.attention_layers)

    @property
    def vmem_total(self) -> int:
        return sum(self.vmem.values())

    @property
    def vmem_limit(self) -> int:
        """The scoped-VMEM limit the kernel is compiled with: the planned total and temporaries
        (`vmem_needed`) plus headroom for
        Mosaic's internal scratch and register spills (3.9 MiB measured for qwen3-8b), never below
        the compiler's default (32 MiB). Measured with libtpu 0.0.52: under the static-profile
        flag XLA reserves the kernel's scoped limit a second time as temp space (and may place
        small HBM operands in VMEM too), so a profiled build on a 64 MiB target fails unless the
        kernel uses well under half the VMEM; unprofiled builds are unaffected."""
        want = round_up(self.vmem_needed + MOSAIC_HEADROOM, 2**20)
        return min(max(COMPILER_DEFAULT_SCOPED_VMEM, want), self.target.vmem_bytes)

    @property
    def vmem_needed(self) -> int:
        """What the budget is checked against: the breakdown (`vmem_total`) plus the compiler
        temporaries it does not list (`vmem_temporaries`)."""
        return self.vmem_total + sum(self.vmem_temporaries.values())

    @property
    def hbm_bytes(self) -> float:
        return sum(self.hbm.values())

    @property
    def floor_seconds(self) -> float:
        """HBM floor of one step: bytes moved / the target's HBM bandwidth."""
        return self.hbm_bytes / self.target.hbm_bandwidth

    def attention_summary(self) -> dict[str, Any]:
        """How the attention stage lays out heads and which layers slide (plain data)."""
        a = self.attention
        return {
            "head_dim": a.head_dim, "kv_heads": a.num_kv_heads,
            "kv_heads_per_128_lanes": a.heads_per_block,
            # unpadded: 64-wide heads share lane blocks, so a cached token is Hkv * D per cache
            "kv_cache_bytes_per_token_per_layer": a.caches * a.page_bytes // a.page_size,
            "kv_cache_format": a.kv_dtype or a.dtype,  # fp8 / int8: codes + a float32 scale per token and kv head
            **({"latent_cache": {"c_kv": a.latent, "k_rope": a.rope, "softmax_scale": a.scale}}
               if isinstance(a, MLAGeometry) else {}),
            # the KV tiling the kernel streams with; "auto": chosen by `_choose_kv_knobs`
            "kv_tile_pages": a.kv_tile_pages, "kv_tile_tokens": a.tile_rows, "kv_buffers": a.kv_buffers,
            "kv_knobs": {k: "auto (plan: timeline model)" if not getattr(self.tuning, k) else "fixed"
                         for k in ("kv_tile_pages", "kv_buffers")},
            "sliding_window": self.cfg.pattern.sliding_window,
            "sliding_layers": sum(1 for w in a.windows if w),
        }

    def padding_summary(self) -> dict[str, Any]:
        """The widths the kernel pads to 128-lane multiples, [as written, as run], and the
        parameters each way (the padded count is what the ring streams, zeros included)."""
        true, run = self.unpadded, self.whole_model
        return {"hidden_size": [true.hidden_size, run.hidden_size], "q_heads": [true.num_q_heads, run.num_q_heads],
                "kv_heads": [true.num_kv_heads, run.num_kv_heads], "head_dim": [true.head_dim, run.head_dim],
                "parameters": [true.param_count(), run.param_count()]}

    def summary(self) -> dict[str, Any]:
        """Plain data for reports and JSON (every number says what it counts)."""
        return {
            "model": self.whole_model.name, "target": self.target.name, "devices": self.devices,
            "batch": self.batch, "q_len": self.q_len,
            "context": self.context, "page_size": self.page_size, "num_pages": self.num_pages,
            "tuning": self.tuning.to_dict(),
            "quant": self.quant, "ring_dtype": self.ring_dtype,
            "ring": {"depth": self.ring_depth,
                     "depth_knob": "fixed" if self.tuning.ring_depth else "auto (plan: 12 where it fits, else the timeline model's pick)",
                     "slot": [self.slot_rows, self.slot_cols],
                     "slot_bytes": self.slot_rows * self.slot_cols * self.families["lm_head"].itemsize,
                     "tiles_per_step": self.total_tiles},
            "families": {n: f.summary() for n, f in self.families.items()},
            "segments": [{"kind": s.kind, "layers": [s.first_layer, s.end_layer], "families": list(s.families),
                          "tiles_per_layer": s.tiles_per_layer} for s in self.segments],
            "attention": self.attention_summary(),
            **({"moe": {"expert_slots": self.moe.expert_slots, "expert_chunk": self.moe.expert_chunk,
                        "expert_slots_knob": "fixed" if self.tuning.expert_slots else "auto (plan: timeline model)"}}
               if self.moe is not None else {}),
            "vmem_bytes": dict(self.vmem), "vmem_total_bytes": self.vmem_total,
            "vmem_temporaries_bytes": dict(self.vmem_temporaries), "vmem_needed_bytes": self.vmem_needed,
            "vmem_budget_bytes": self.vmem_budget, "vmem_limit_bytes": self.vmem_limit, "vmem_capacity_bytes": self.target.vmem_bytes,
            "hbm_bytes_per_step": dict(self.hbm), "hbm_total_bytes_per_step": self.hbm_bytes,
            "hbm_floor_seconds": self.floor_seconds,
            "dmas_per_step": {k: dict(v) for k, v in self.dmas.items()},
            **({"lane_padding": self.padding_summary()} if self.unpadded is not None else {}),
            **({"sharding": self.sharding.summary(self.whole_model),
                "resident_bytes_per_device": dict(zip(("weights", "kv_cache"), resident_bytes(
                    self.whole_model, self.num_pages, self.page_size, self.sharding, self.quant,
                    self.attention.kv_dtype))),
                "interconnect_per_step": {k: dict(v) for k, v in self.interconnect.items()},
                "interconnect_bytes_per_step": self.interconnect_bytes,
                "collectives_per_step": self.collectives_per_step,
                "all_reduce": {"schedule": self.all_reduce.schedule, "slot": [self.all_reduce.rows, self.all_reduce.width],
                               "dtype": self.all_reduce.dtype}} if self.devices > 1 else {}),
        }


def layer_vector_width(cfg: ModelConfig) -> int:
    """Lanes of a layer's vector rows: the hidden size, the head dim, for MLA the q_a and kv_a
    norms' widths (they take the q_norm / k_norm rows), with qkv_bias / o_bias the q|k|v|o bias row, and
    with qk_norm_whole the q norm's q_size, with attention sinks one lane per q head, with linear
    layers their convolution's channels and decay row (`tpumk.plan.geometry.LINEAR_ROW`), with
    residual_gates each post row's alpha and beta after the norm (`residual_gate_offset`)."""
    bias = cfg.attention.q_size + 2 * cfg.attention.kv_size if cfg.attention.qkv_bias else 0
    whole = cfg.attention.q_size if cfg.attention.qk_norm_whole else 0  # OLMo 2's q_norm / k_norm span every head
    sinks = cfg.num_q_heads if cfg.attention.attn_sinks else 0
    o = o_bias_offset(cfg) + cfg.hidden_size if cfg.attention.o_bias else 0
    gates = 3 * residual_gate_offset(cfg) if cfg.norms.residual_gates else 0
    moe_in = cfg.moe.moe_hidden_size if cfg.is_moe else 0  # moe_in_norm's row
    log_scale = cfg.num_q_heads if cfg.attention.query_log_scale else 0  # q_log_scale's / q_log_bias's rows
    # a linear layer's rows (LINEAR_ROW): its convolution's taps over C lanes, dt_bias after a lane tile
    lin = cfg.linear
    linear = max(lin.conv_dim, LANE + lin.decay_width) if lin else 0
    return round_up(max(cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank, cfg.kv_lora_rank, bias, whole, sinks, o, linear,
                        gates, moe_in, log_scale), LANE)


def residual_gate_offset(cfg: ModelConfig) -> int:
    """With residual_gates (Muse Spark): the first lane of a sublayer's alpha in its post-norm row
    (post_attn_norm: attention's, post_mlp_norm: the MLP's), beta from twice this lane; the norm
    itself holds the first hidden_size lanes (each on a lane tile boundary: aligned slices)."""
    return round_up(cfg.hidden_size, LANE)


def o_bias_offset(cfg: ModelConfig) -> int:
    """First lane of the o projection's bias in the bias row: after the q|k|v biases, on a lane
    tile boundary (the kernel reads it as an aligned lane slice)."""
    return round_up(cfg.attention.q_size + 2 * cfg.attention.kv_size, LANE) if cfg.attention.qkv_bias else 0


def scale_offsets(families: dict[str, MatrixFamily]) -> dict[str, int]:
    """Start of each layer family's column scales in a layer's scale row: ring order, m_pad each."""
    out, at = {}, 0
    for name, fam in families.items():
        if name != "lm_head":
            out[name] = at
            at += fam.m_pad
    return out


# ---------------------------------------------------------------------- tiling
def _auto_rows(cfg: ModelConfig, ks: list[int], tuning: TuningConfig, itemsize: int) -> int:
    """A row count shared by every family whose knob is auto, so default tiles share one shape.

    The largest multiple of 128 dividing every K whose [rows, AUTO_MIN_TILE_COLS] tile still
    fits tile_bytes."""
    g = 0
    for k in ks:
        g = math.gcd(g, k)
    return _largest_lane_multiple(g, min(g, max(LANE, tuning.tile_bytes // (AUTO_MIN_TILE_COLS * itemsize))))


def _largest_lane_multiple(k: int, top: int) -> int:
    """The largest multiple of 128 dividing `k` and at most `top` (128 if none is): a tile's
    rows (of K) or columns (of a lane-padded M) with no partial tile."""
    return max([r for r in range(LANE, top + 1, LANE) if k % r == 0] or [LANE])


def auto_expert_chunk(cfg: ModelConfig, tuning: TuningConfig, fmt: WeightFormat | None = None) -> int:
    """Expert FFN columns per load: the largest 128-multiple dividing Fe whose chunk (gate, up and
    down rows, 3 * M * C at the experts' width M: H, or Muse Spark's moe_hidden_size) stays
    within two ring tiles, so `expert_slots` slots cost about as much VMEM as a few ring slots
    (whole Qwen3-30B-A3B experts are 9 MiB each). Quantized experts count one byte per code (an
    int4 code takes a byte of VMEM on TPU7x)."""
    fe, best = cfg.moe.expert_ffn_size, LANE
    nbytes = 1 if fmt is not None else cfg.dtype_bytes
    for c in range(LANE, fe + 1, LANE):
        if fe % c == 0 and 3 * cfg.moe.width(cfg.hidden_size) * c * nbytes <= 2 * tuning.tile_bytes:
            best = c
    return best


def _family(name: str, k: int, m: int, stack: int, rows: int, cols: int, itemsize: int,
            k_pad: int | None = None, m_pad: int | None = None, group: int = 0) -> MatrixFamily:
    return MatrixFamily(name, k, m, k_pad if k_pad is not None else k,
                        m_pad if m_pad is not None else round_up(m, cols), rows, cols, stack, itemsize, group)


def plan_families(cfg: ModelConfig, tuning: TuningConfig, quant: str = "none",
                  latent_slices: dict[str, int] | None = None) -> tuple[dict[str, MatrixFamily], int, int]:
    """The streamed matrix families of `cfg` under `tuning`: (families, ffn_pad, shared_ffn_pad).

    Depends only on the model and the knobs (not on the target or batch), so packed weights
    can be reused across targets that share a tuning. `latent_slices` (MLA split over devices,
    `ShardingPlan.latent_slices`): q_a and kv_a are one device's output columns."""
    fmt = weight_format(quant)
    h, isz = cfg.hidden_size, fmt.bits // 8 if fmt is not None else cfg.dtype_bytes  # ring formats are 8-bit
    group = fmt.group if fmt is not None else 0
    n_dense = sum(cfg.pattern.is_dense(i) for i in range(cfg.num_layers))
    n_moe = cfg.num_layers - n_dense
    shared = cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size if cfg.is_moe else 0
    moe_width = cfg.moe.moe_hidden_size if cfg.is_moe else 0  # Muse Spark: moe_in [H, M], moe_out [M, H]
    if moe_width % LANE:
        raise PlanError(f"model '{cfg.name}': moe_hidden_size = {moe_width} must be a multiple of {LANE} (TPU lane tile)")
    for what, v in ((("hidden_size", h),) if cfg.is_mla else
                    (("hidden_size", h), ("num_q_heads * head_dim", cfg.attention.q_size), ("num_kv_heads * head_dim", cfg.attention.kv_size))):
        if v % LANE:
            raise PlanError(f"model '{cfg.name}': {what} = {v} must be a multiple of {LANE} (TPU lane tile)")
    if not cfg.is_mla and cfg.head_dim % LANE and cfg.head_dim != LANE // 2:
        raise PlanError(f"model '{cfg.name}': head_dim = {cfg.head_dim}: the kernel needs 64 or a multiple of {LANE}")

    # K of every family (padded FFN widths are multiples of 128, so 128 always divides them).
    present = (["o", "lm_head"] if cfg.is_mla else ["qkv", "o", "lm_head"]) + (["gate_up", "down"] if n_dense else []) \
        + (["shared_gate_up", "shared_down"] if shared else []) + (["moe_in", "moe_out"] if moe_width else [])
    ks = {"qkv": h, "o": mla_dims(cfg)["o_rows"] if cfg.is_mla else cfg.attention.q_size, "lm_head": h, "gate_up": h,
          "shared_gate_up": h, "moe_in": h, "moe_out": moe_width,
          "down": round_up(cfg.ffn_size, LANE), "shared_down": round_up(shared, LANE)}
    auto_rows = _auto_rows(cfg, [ks[f] for f in present if tuning.tile_shape(f)[0] == 0], tuning, isz)
    # The ring's slot is the tallest tile's rows x the widest tile's columns. MLA's W_UV blocks
    # are `latent` rows high whatever the knobs, so auto widths are sized against that height:
    # otherwise a narrow-input family (o with 4 heads per device: 512 rows) gets 128-row tiles
    # the whole 7168 wide and the slot becomes 512 x 7168 (DeepSeek-V3 on 32 devices).
    fixed_rows = max(mla_dims(cfg)["latent"], mla_dims(cfg)["nope"]) if cfg.is_mla else 0
    # An auto family's tile is as tall as its K allows up to that slot height: the slot is
    # there anyway, and taller tiles keep more bytes per DMA in flight (tpumk's timeline model
    # puts DeepSeek-V3's 128-row q_a tiles on 32 devices at ~0.4 of the HBM rate).
    slot_rows = max(auto_rows, fixed_rows)

    def shape(fam: str, k: int, m: int, lane: int) -> tuple[int, int]:
        rows, cols = tuning.tile_shape(fam)
        rows = rows or _largest_lane_multiple(k, slot_rows)
        if not cols:  # auto: fill tile_bytes, never wider than the (lane-rounded) matrix
            cols = max(lane, tuning.tile_bytes // (max(rows, fixed_rows) * isz) // lane * lane)
            cols = min(cols, round_up(m, lane))
        if k % rows:
            raise PlanError(f"tuning: '{fam}_tile_rows' = {rows} must divide the {fam} input dim {k} "
                            f"of model '{cfg.name}'")
        return rows, cols

    fams: dict[str, MatrixFamily] = {}
    kv_layers = cfg.kv_layers  # attention's families stack over the attention layers only
    if cfg.is_mla:
        fams.update(_mla_families(cfg, tuning, isz, group, slot_rows, latent_slices))
        r, c = shape("o", ks["o"], h, LANE)
        fams["o"] = _family("o", cfg.num_q_heads * cfg.v_head_dim, h, kv_layers, r, c, isz, k_pad=ks["o"],
                            group=group)
    else:
        qkv_m = qkv_columns(cfg)
        r, c = shape("qkv", h, qkv_m, LANE)
        fams["qkv"] = _family("qkv", h, qkv_m, kv_layers, r, c, isz, group=group)
        r, c = shape("o", cfg.attention.q_size, h, LANE)
        fams["o"] = _family("o", cfg.attention.q_size, h, kv_layers, r, c, isz, group=group)
    if cfg.linear:
        fams.update(_linear_families(cfg, shape, isz, group))

    def ffn_pair(prefix: str, width: int, stack: int) -> int:
        gu, dn = f"{prefix}gate_up", f"{prefix}down"
        gu_rows, gu_cols = shape(gu, h, 2 * width, 2 * LANE)
        # Pad F so whole gate/up half tiles and whole down row tiles cover it (zeros are inert:
        # silu(0) * 0 = 0 and zero down rows add nothing).
        dn_rows = tuning.tile_shape(dn)[0] or auto_rows
        f_pad = round_up(width, math.lcm(gu_cols // 2, dn_rows))
        fams[gu] = _family(gu, h, 2 * width, stack, gu_rows, gu_cols, isz, m_pad=2 * f_pad, group=group)
        dn_rows, dn_cols = shape(dn, f_pad, h, LANE)
        fams[dn] = _family(dn, width, h, stack, dn_rows, dn_cols, isz, k_pad=f_pad, group=group)
        return f_pad

    ffn_pad = ffn_pair("", cfg.ffn_size, n_dense) if n_dense else 0
    shared_pad = ffn_pair("shared_", shared, n_moe) if shared else 0
    if moe_width:  # the experts' down- and up-projections, one of each per MoE layer
        for name, k, m in (("moe_in", h, moe_width), ("moe_out", moe_width, h)):
            r, c = shape(name, k, m, LANE)
            fams[name] = _family(name, k, m, n_moe, r, c, isz, group=group)
    r, c = shape("lm_head", h, cfg.vocab_size, LANE)
    fams["lm_head"] = _family("lm_head", h, cfg.vocab_size, 1, r, c, isz, group=group)
    return fams, ffn_pad, shared_pad


def qkv_columns(cfg: ModelConfig) -> int:
    """Columns of the qkv family: q | k | v, then with attn_output_gate the gate's q_size."""
    a = cfg.attention
    return a.q_size * (1 + a.attn_output_gate) + 2 * a.kv_size


def _linear_families(cfg: ModelConfig, shape, isz: int, group: int) -> dict[str, MatrixFamily]:
    """A linear layer's families (LINEAR_FAMILIES): lin_in [H, the lin_proj row
    (`LinearGeometry.proj_offsets`)], KDA's lin_fb / lin_gb [key_dim, value size] and lin_out
    [value size, H], stacked over the linear layers."""
    geom = LinearGeometry.from_config(cfg, 1, 1)
    h, n = cfg.hidden_size, len(cfg.linear_layers)
    out = {}
    parts = [("lin_in", h, geom.proj_offsets["width"])]
    if geom.kind == "kda":
        parts += [("lin_fb", geom.key_dim, geom.value_size), ("lin_gb", geom.key_dim, geom.value_size)]
    parts.append(("lin_out", geom.value_size, h))
    for name, k, m in parts:
        r, c = shape(name, k, m, LANE)
        out[name] = _family(name, k, m, n, r, c, isz, group=group)
    return out


def _mla_families(cfg: ModelConfig, tuning: TuningConfig, isz: int, group: int = 0,
                  max_rows: int = 0, latent_slices: dict[str, int] | None = None) -> dict[str, MatrixFamily]:
    """The MLA attention families (auto tiles: no tuning knobs of their own; `tile_bytes` caps
    a tile, `max_rows` (the slot height the other families and W_UV already give the ring)
    its height, so the ring's slot, the widest rows times the widest columns, does not grow:
    with 1-byte codes a 2 MiB tile of DeepSeek-V3's q_a would otherwise be 1792 rows high
    against the others' 1024 x 2048 and the slot 3.5 MiB). Output widths are padded to whole
    column tiles; the diagonal families' tiles are one head's [nope, latent] / [latent, value]
    block. `group`: the ring format's scale group (fp8-b128: 128 input rows; every MLA tile
    height is a multiple of 128). `latent_slices`: q_a / kv_a are one device's output columns
    (`ShardingPlan.latent_slices`), plain [H, w] matrices."""
    dims, h, hq, L = mla_dims(cfg), cfg.hidden_size, cfg.num_q_heads, cfg.num_layers

    def tiled(name: str, k: int, k_pad: int, m: int, m_lane: int) -> MatrixFamily:
        top = min(k_pad, max(max_rows, LANE)) if max_rows else k_pad
        # the tallest that divides k_pad and whose [rows, AUTO_MIN_TILE_COLS] tile fits tile_bytes
        rows = _largest_lane_multiple(k_pad, min(top, tuning.tile_bytes // (min(m_lane, AUTO_MIN_TILE_COLS) * isz)))
        cap = max(LANE, tuning.tile_bytes // (max(rows, dims["latent"], dims["nope"]) * isz))
        # the widest dividing m_lane: no zero columns streamed beyond the lane padding
        # (q_a's output is q_b's input: DeepSeek-V3's 1536 would otherwise stream as 2048 rows)
        cols = _largest_lane_multiple(m_lane, min(m_lane, cap))
        return _family(name, k, m, L, rows, cols, isz, k_pad=k_pad, m_pad=m_lane, group=group)

    out = {}
    split = latent_slices or {}
    if cfg.q_lora_rank:
        w = split.get("q_a", cfg.q_lora_rank)
        out["q_a"] = tiled("q_a", h, h, w, round_up(w, LANE) if split else dims["q_lora"])
        out["q_b"] = tiled("q_b", cfg.q_lora_rank, dims["q_lora"], hq * cfg.head_dim, dims["q_cols"])
    else:
        out["q"] = tiled("q", h, h, hq * cfg.head_dim, dims["q_cols"])
    w = split.get("kv_a", cfg.attention.kv_cache_width)
    out["kv_a"] = tiled("kv_a", h, h, w, round_up(w, LANE) if split else dims["kv_a_cols"])
    n, c, v = dims["nope"], dims["latent"], dims["value"]
    if cfg.attention.is_sparse:  # the indexer's projections: idx_k of the layer's input, idx_q of the q latent
        a = cfg.attention
        n_idx = len(cfg.indexer_layers)  # stacked over the layers with an indexer of their own
        out["idx_k"] = dataclasses.replace(tiled("idx_k", h, h, a.index_head_dim, round_up(a.index_head_dim, LANE)),
                                           stack=n_idx)
        q_in, q_pad = (h, round_up(h, LANE)) if a.index_q_hidden else (cfg.q_lora_rank, dims["q_lora"])
        out["idx_q"] = dataclasses.replace(tiled("idx_q", q_in, q_pad,
                                                 a.index_heads * a.index_head_dim,
                                                 round_up(a.index_heads * a.index_head_dim, LANE)), stack=n_idx)
    keys = cfg.qk_nope_head_dim + (cfg.qk_rope_head_dim if cfg.attention.nope_latent_keys else 0)  # (mla_dims)
    out["uk"] = MatrixFamily("uk", hq * keys, hq * cfg.kv_lora_rank, hq * n, hq * c, n, c, L, isz,
                             group=group, diagonal=True)
    out["uv"] = MatrixFamily("uv", hq * cfg.kv_lora_rank, hq * cfg.v_head_dim, hq * c, hq * v, c, v, L, isz,
                             group=group, diagonal=True)
    return out


# A linear layer's families in stream order: the in-projection, KDA's two low-rank gates' second
# halves (forget, output), then the out-projection.
LINEAR_FAMILIES = ("lin_in", "lin_fb", "lin_gb", "lin_out")


def plan_segments(cfg: ModelConfig, fams: dict[str, MatrixFamily]) -> tuple[Segment, ...]:
    """Consecutive same-kind layers (the same FFN, dense or MoE, and the same token mixer,
    attention or linear) grouped into segments, then the lm_head, in ring order. A family's
    stack index counts the layers that carry it: attention's the attention layers (the KV
    cache's layers), a linear layer's the linear layers (the state pool's), the FFN's the dense
    or the MoE layers."""
    segments: list[Segment] = []
    dense_seen = moe_seen = kv_seen = lin_seen = 0
    g = 0
    i = 0

    def kind(layer: int) -> tuple[bool, bool, bool]:
        return cfg.pattern.is_dense(layer), cfg.pattern.is_linear(layer), cfg.has_indexer(layer)

    idx_seen = 0

    while i < cfg.num_layers:
        dense, linear, indexer = kind(i)
        j = i
        while j < cfg.num_layers and kind(j) == (dense, linear, indexer):
            j += 1
        if linear:
            att, mixer_base = tuple(n for n in LINEAR_FAMILIES if n in fams), lin_seen
        else:
            att = tuple(n for n in MLA_FAMILIES if n in fams and (indexer or not n.startswith("idx_"))) \
                + ("o",) if cfg.is_mla else ("qkv", "o")
            mixer_base = kv_seen
        att_base = tuple(idx_seen if n.startswith("idx_") else mixer_base for n in att)
        if dense:
            names = att + ("gate_up", "down")
            base = att_base + (dense_seen, dense_seen)
        else:
            # (stream order: tpumk.kernel.megakernel's MoE layer)
            names = att + (("moe_in",) if "moe_in" in fams else ()) \
                + (("shared_gate_up", "shared_down") if "shared_gate_up" in fams else ()) \
                + (("moe_out",) if "moe_out" in fams else ())
            base = att_base + (moe_seen,) * (len(names) - len(att))
        offsets, t = [], 0
        for n in names:
            offsets.append(t)
            t += fams[n].tiles
        segments.append(Segment("dense" if dense else "moe", i, j - i, names, base, tuple(offsets), t, g,
                                moe_base=moe_seen, linear=linear, kv_base=mixer_base,
                                index_base=idx_seen if indexer and cfg.attention.is_sparse else -1))
        if indexer and cfg.attention.is_sparse:
            idx_seen += j - i
        g += (j - i) * t
        if dense:
            dense_seen += j - i
        else:
            moe_seen += j - i
        if linear:
            lin_seen += j - i
        else:
            kv_seen += j - i
        i = j
    head = fams["lm_head"]
    segments.append(Segment("lm_head", cfg.num_layers, 1, ("lm_head",), (0,), (0,), head.tiles, g))
    return tuple(segments)


# ---------------------------------------------------------------------- make_plan
def make_plan(spec: BuildSpec, num_pages: int | None = None, num_slots: int | None = None) -> Plan:
    """Plan the decode step `spec` describes: `batch` sequences x `q_len` tokens over a paged
    cache of `context` tokens (`num_pages` pages in the pool; default exactly enough).

    Raises PlanError for anything that cannot build: bad tiling for this model, a VMEM budget
    overrun on this target, or a model (weights + KV cache) bigger than one device's HBM.
    An MLA model on many devices with `mla_projections` = auto is planned with q_a / kv_a
    replicated and split (`ShardingPlan.latent_split`), and the faster by tpumk's timeline
    model is kept (ties: replicated, which sends nothing more).
    """
    check_kernel_parts(spec.model)
    knob = spec.tuning.mla_projections
    if not (spec.model.is_mla and spec.devices > 1):
        return _make_plan(spec, num_pages, num_slots, latent_split=False)
    if knob != "auto":
        return _make_plan(spec, num_pages, num_slots, latent_split=knob == "split")
    return _fastest_plan(((int(split),), lambda split=split: _make_plan(spec, num_pages, num_slots, latent_split=split))
                         for split in (False, True))


def _make_plan(spec: BuildSpec, num_pages: int | None, num_slots: int | None, latent_split: bool) -> Plan:
    target, tuning = spec.target, spec.tuning
    padded = lane_padded(spec.model)  # widths off the 128-lane grid: the kernel runs a zero-padded copy
    model = padded or spec.model
    fmt = weight_format(spec.quant)
    if padded is not None and padded.head_dim != spec.model.head_dim and fmt is not None and fmt.group:
        raise NotSupportedError(f"--quant {spec.quant}: head_dim = {spec.model.head_dim} runs padded to "
                                f"{padded.head_dim} lanes, and wo's {fmt.group}-row scale groups would straddle its "
                                "heads (use int8 or fp8)")
    if padded is not None and spec.kv_dtype:
        raise NotSupportedError(f"--kv-dtype {spec.kv_dtype}: model '{spec.model.name}' runs lane-padded "
                                "(tpumk.plan.padding), and a 1-byte cache of padded heads is not built yet "
                                "(use the model-dtype cache)")
    batch, context, q_len, page_size = spec.batch, spec.context, spec.q_len, spec.page_size
    pages_per_seq = context // page_size  # BuildSpec validated the shape (context a multiple of page_size)
    num_pages = batch * pages_per_seq if num_pages is None else num_pages
    if num_pages < batch * pages_per_seq:
        raise PlanError(f"plan: num_pages = {num_pages} < {batch * pages_per_seq} needed for "
                        f"{batch} sequences of {context} tokens")
    sharding = plan_sharding(model, spec.devices, tuning.expert_parallel)
    if latent_split:
        sharding = dataclasses.replace(sharding, latent_split=True)
    cfg = sharding.local_config(model)  # what one device computes (the model itself on one device)
    _check_hbm(model, target, num_pages, page_size, sharding, spec.quant, spec.kv_dtype)  # before any per-page work
    if model.is_mla:  # after the HBM check: a model too big is refused for that first
        _check_mla(model, spec)
    if model.linear:
        _check_linear(model, sharding.devices)

    fams, ffn_pad, shared_pad = plan_families(cfg, tuning, spec.quant,
                                              sharding.latent_slices(model) if latent_split else None)
    segments = plan_segments(cfg, fams)
    used = {n for s in segments for n in s.families}
    fams = {n: f for n, f in fams.items() if n in used}
    slot_rows = max(f.tile_rows for f in fams.values())
    slot_cols = max(f.tile_cols for f in fams.values())
    rows = batch * q_len

    def geometry(kv_tile_pages: int, kv_buffers: int):
        if cfg.is_mla:
            return MLAGeometry.for_mla(cfg, batch, q_len, page_size, pages_per_seq, kv_tile_pages, kv_buffers,
                                       kv_dtype=spec.kv_dtype)
        return AttentionGeometry.from_config(cfg, batch, q_len, page_size, pages_per_seq, kv_tile_pages, kv_buffers,
                                             kv_dtype=spec.kv_dtype)

    # Assembled with the smallest KV tiling first; `_choose_kv_knobs` swaps in the chosen one.
    attention = geometry(tuning.kv_tile_pages or 1, tuning.kv_buffers or 2)
    attention.validate()
    sparse = None
    if cfg.attention.is_sparse:
        sparse = SparseGeometry.for_model(cfg, batch, q_len, page_size, pages_per_seq, attention.page_lanes)
        sparse.validate()
    linear = None
    if cfg.linear:
        if num_slots is not None and num_slots < batch:
            raise PlanError(f"plan: num_slots = {num_slots} < {batch}: every sequence needs a state slot")
        linear = LinearGeometry.from_config(cfg, batch, q_len, num_slots or batch)
        linear.validate()
    all_reduce = None
    if sharding.devices > 1:
        # One row per token row (padding to the 8-row tile would send 8x the bytes at batch 1);
        # f32 partial sums (exact) unless the tuning puts bfloat16 on the wire.
        all_reduce = all_reduce_geometry(target.chip, sharding.devices, rows, cfg.hidden_size,
                                         dtype=tuning.all_reduce_wire, schedule=tuning.all_reduce)

    budget = int(tuning.vmem_limit_fraction * target.vmem_bytes)

    def plan_with(expert_slots: int, depth: int) -> Plan:
        moe = None
        if cfg.is_moe:
            efmt = expert_format(spec.quant)
            moe = MoEGeometry.from_config(cfg, rows, expert_slots,
                                          tuning.expert_chunk or auto_expert_chunk(cfg, tuning, efmt),
                                          owned_experts=sharding.experts, expert_tensor=sharding.expert_tensor,
                                          expert_format=efmt.name if efmt is not None else "none",
                                          fp4_native=target.chip == "7x",  # TPU7x converts e2m1 itself
                                          norm_width=spec.model.moe.moe_hidden_size if padded is not None else 0)
        plan = Plan(cfg, target, tuning, batch, q_len, pages_per_seq * page_size, page_size, pages_per_seq,
                    num_pages, fams, segments, depth, slot_rows, slot_cols, ffn_pad, shared_pad, attention, moe,
                    model=model if sharding.devices > 1 else None,
                    sharding=sharding if sharding.devices > 1 else None, all_reduce=all_reduce, quant=spec.quant,
                    unpadded=spec.model if padded is not None else None, linear=linear, taps=spec.taps,
                    sparse=sparse)

        def finish(geom) -> Plan:
            p = _replace(plan, attention=geom)
            p = _replace(p, vmem=_vmem_breakdown(p), vmem_temporaries=_vmem_temporaries(p), vmem_budget=budget,
                         hbm=_hbm_breakdown(p), dmas=_dma_breakdown(p), interconnect=_interconnect(p))
            _check_fits(p)
            return p

        if tuning.kv_tile_pages and tuning.kv_buffers:
            return finish(attention)
        if sparse is not None:  # the dense tile loop never runs: its knobs at their smallest
            return finish(geometry(tuning.kv_tile_pages or 1, tuning.kv_buffers or 2))
        return _choose_kv_knobs(tuning, pages_per_seq, geometry, finish)

    def plan_at(depth: int) -> Plan:
        if tuning.expert_slots or not cfg.is_moe:
            return plan_with(tuning.expert_slots or 1, depth)
        return _choose_expert_slots(lambda slots: plan_with(slots, depth))

    if tuning.ring_depth:
        return plan_at(tuning.ring_depth)
    return _choose_ring_depth(plan_at)




def _choose_ring_depth(plan_at) -> Plan:
    """`ring_depth` left at 0 (auto): the published 12-deep ring (AUTO_RING_DEPTH) whenever its plan
    fits the VMEM budget, as before the plan chose; when it does not (Muse Spark's NVFP4 experts
    on 8 TPU7x devices: 57.2 MiB against 54.4), every shallower depth that fits is planned (each
    with its own KV and expert-slot choices) and the fastest by tpumk's timeline model wins, ties
    to the deeper ring. Not simply the deepest that fits: a deeper ring can leave room for fewer
    expert slots (that build at batch 8: 11 slots and one expert slot, 27.7 ms by the model; 10
    and two, 17.4 ms). Raises the 12-deep plan's VMEMError when no depth fits (any other
    PlanError at once: only VMEM depends on the depth)."""
    try:
        return plan_at(AUTO_RING_DEPTH)
    except VMEMError as e:
        error = e
    try:
        return _fastest_plan(((-depth,), lambda depth=depth: plan_at(depth)) for depth in range(AUTO_RING_DEPTH - 1, 1, -1))
    except PlanError:
        raise error from None


# expert_slots = 0 (auto): the plan weighs 1 to this many slots (4 was the fixed default before
# the plan chose).
AUTO_EXPERT_SLOTS = 4


def _choose_expert_slots(plan_with) -> Plan:
    """`expert_slots` left at 0 (auto): every count up to AUTO_EXPERT_SLOTS is planned (with its
    own KV choice) and walked by tpumk's timeline model; the fastest wins, ties (AUTO_KV_TIE)
    to more slots. Expert slots and KV tiles share the VMEM left by the ring, so the most slots
    is not always best: DeepSeek-V3 on 32 TPU7x cores with bfloat16 experts fits 3 slots only
    beside 1-page KV tiles (attention 4.4 ms by the model), 2 slots beside 32-page tiles. Raises
    the one-slot plan's PlanError when no count fits."""
    return _fastest_plan(((-slots,), lambda slots=slots: plan_with(slots))
                         for slots in range(1, AUTO_EXPERT_SLOTS + 1))


def all_reduce_geometry(chip: str, devices: int, rows: int, width: int, dtype: str = "float32",
                        schedule: str = "auto") -> AllReduceGeometry:
    """The in-kernel all-reduce of a build. An asked-for schedule is `AllReduceGeometry.for_chip`'s
    (checked against the chip). `auto`: of the schedules the chip routes (v5e beyond two devices
    routes only recursive doubling; elsewhere direct and rsag, and on TPU7x's sibling pairs
    hierarchical), the one tpumk's interconnect model costs least for this payload and wire;
    ties go to `for_chip`'s byte rule. The model, not the byte rule, decides because it counts
    the hops a direct push crosses: qwen3-30b-a3b's batch-1 row on 32 TPU7x TensorCores sends
    248 KiB per direct all-reduce, under the rule's 256 KiB, yet the model costs that round at
    8.1 us against rsag's 5.1 (four chips across, the links carry each byte ~2.4 times). The
    tuning space's default is this choice."""
    geom = AllReduceGeometry.for_chip(chip, devices, rows, width, dtype=dtype, schedule=schedule)
    if schedule != "auto" or geom.schedule == "doubling" or devices <= 2:
        return geom
    from tpumk.estimate.interconnect import all_reduce_seconds_on  # the model reads plans (lazy: layer rule)

    others = [s for s in ("direct", "rsag", "hierarchical") if s != geom.schedule
              and (s != "hierarchical" or AllReduceGeometry.pairs_cores(chip, devices))]
    options = [geom] + [AllReduceGeometry.for_chip(chip, devices, rows, width, dtype=dtype, schedule=s) for s in others]
    return min(options, key=lambda g: all_reduce_seconds_on(chip, g)["seconds"])  # the first of equals: the rule's


def _fastest_plan(candidates) -> Plan:
    """The fastest of `candidates` ((tie key, build) pairs; build() returns a Plan or raises
    PlanError when it does not fit) by tpumk's timeline model; plans within AUTO_KV_TIE of the
    fastest count as equal and the smallest tie key wins. Raises the first candidate's
    PlanError when none fits."""
    from tpumk.estimate.timeline import megakernel_step  # the model imports the plan (lazy: layer rule)

    scored, error = [], None
    for key, build in candidates:
        try:
            p = build()
        except PlanError as e:
            error = error or e
            continue
        scored.append((megakernel_step(p).seconds, key, p))
    if not scored:
        raise error
    best = min(c[0] for c in scored)
    return min((c for c in scored if c[0] <= best * (1 + AUTO_KV_TIE)), key=lambda c: c[1])[2]


# KV knobs the plan chooses from when the tuning leaves them at 0 (auto): the tuning space's
# ranges (tuning_spaces/default.toml: up to 64 pages, 2-8 buffers), plus the small tiles (1, 2
# pages, or a whole sequence of fewer than 64) that short contexts need.
AUTO_KV_TILE_PAGES = (1, 2, 4, 8, 16, 32, 64)
AUTO_KV_BUFFERS = tuple(range(2, 9))
# Modelled step times within this share of the best count as equal: then the least VMEM for
# KV tiles wins, then the larger tile (fewer trips of the tile loop, whose per-trip scalar and
# vector work the model does not count).
AUTO_KV_TIE = 0.0005


def _choose_kv_knobs(tuning: TuningConfig, pages_per_seq: int, geometry, finish) -> "Plan":
    """`kv_tile_pages` / `kv_buffers` left at 0 (auto): every candidate pair that fits the VMEM
    budget is planned and walked by tpumk's timeline model (`megakernel_step`, the tuner's
    `model` objective), and the fastest wins (ties: see AUTO_KV_TIE). A fixed knob is kept.
    The KV tiles' size and depth trade VMEM for DMAs in flight, and the best pair depends on
    the batch and the context (how many tiles a layer streams), which is why the plan, not a
    constant, picks them. Raises the smallest candidate's PlanError when none fits."""
    pages = [tuning.kv_tile_pages] if tuning.kv_tile_pages else \
        sorted({k for k in AUTO_KV_TILE_PAGES if k <= pages_per_seq} | ({pages_per_seq} if pages_per_seq < 64 else set()))
    buffers = [tuning.kv_buffers] if tuning.kv_buffers else list(AUTO_KV_BUFFERS)
    return _fastest_plan(((kt * nb, -kt), lambda kt=kt, nb=nb: finish(geometry(kt, nb)))
                         for kt in pages for nb in buffers)


def check_kernel_parts(model: ModelConfig) -> None:
    """Refuse, in one line naming every one, the parts of `model` the megakernel lacks (before any
    planning: a model that is also too big for one device is refused for these first)."""
    missing = []
    if (model.nope_layers and model.is_mla and not model.nope_latent_keys
            and set(model.nope_layers) != set(model.pattern.attention_layers)):
        missing.append("NoPE on some MLA layers but not all (nope_layers)")  # (but with all-latent keys)
    if model.query_log_scale and model.is_moe and model.moe_hidden_size:  # (one vector row: geometry.VECTOR_ROW)
        missing.append("per-head log-position query scales (query_log_scale) with the experts at moe_hidden_size")
    if model.kv_source_layers and model.linear_layers:
        missing.append("layers reading another layer's latent cache (kv_source_layers) in a hybrid")
    if model.is_moe and model.moe_hidden_size and model.attn_sinks:  # moe_in_norm takes the sinks' vector row
        missing.append("attention sinks with the experts at moe_hidden_size")
    if missing and model.attention.is_sparse:  # (alone, _check_mla's own line says it)
        missing.append(f"sparse attention with the parts above (index_topk = {model.index_topk})")
    if missing:
        raise NotSupportedError(f"model '{model.name}': not built by the megakernel yet: {'; '.join(missing)} (the "
                                "reference decode step runs it: tpumk generate --backend reference)")


def _check_mla(model: ModelConfig, spec: BuildSpec) -> None:
    """What the megakernel's MLA attention does not do yet, refused with one line each."""
    if model.attention.is_sparse:  # (tpumk.kernel.sparse_attention: what it does not do yet)
        where = f"model '{model.name}': sparse attention (index_topk = {model.index_topk})"
        if spec.kv_dtype:  # (an fp8 index-key cache runs in the reference; int8 nowhere: its own line)
            sparse_attention.check_index_key_format(model, spec.kv_dtype)
        # quantized weights: the indexer's idx_k / idx_q stream in the ring format with their
        # scales like every ring family (whole on every device, as their codes)
        for cond, what in ((spec.quant != "none" and bool(model.kv_source_layers),
                            f"with --quant {spec.quant} and layers reading another layer's latent rows "
                            "(kv_source_layers: Mistral Large 4's; model-dtype weights only yet)"),
                           (bool(spec.kv_dtype), f"with --kv-dtype {spec.kv_dtype} (the model-dtype caches only "
                                                "yet: 1-byte index keys and latent rows run in the reference)"),
                           (not model.q_lora_rank and not model.index_q_hidden,
                            "without q-LoRA (q_lora_rank = 0) when its indexer's queries project the q-LoRA latent")):
            if cond:
                raise NotSupportedError(f"{where} {what} is not built by the megakernel yet; the reference runs it "
                                        "(tpumk generate --backend reference)")
    fmt = weight_format(spec.quant)
    if fmt is not None and fmt.group and model.v_head_dim % fmt.group:
        # o's rows are padded per head in the kernel: its 128-row scale groups must not straddle heads
        raise NotSupportedError(f"model '{model.name}': v_head_dim = {model.v_head_dim}: --quant {spec.quant} "
                                f"(ring {fmt.name}) needs a multiple of {fmt.group} (o's scale groups would "
                                f"straddle heads); use int8 or fp8")
    if LANE % model.qk_rope_head_dim:
        raise NotSupportedError(f"model '{model.name}': qk_rope_head_dim = {model.qk_rope_head_dim}: the MLA "
                                f"megakernel needs a divisor of {LANE} (roped heads are rotated inside lane tiles)")


def _check_linear(model: ModelConfig, devices: int) -> None:
    """What the megakernel's linear-attention layers do not do yet, refused with one line each."""
    where = f"model '{model.name}'"
    for f, on in (("post_norms", model.post_norms), ("parallel_blocks", model.parallel_blocks),
                  ("sliding_layers", bool(model.sliding_layers)), ("qk_norm_whole", model.qk_norm_whole)):
        if on:
            raise NotSupportedError(f"{where}: {f} with linear-attention layers is not built yet")
    attention = model.pattern.attention_layers
    if model.nope_layers and set(model.nope_layers) != set(attention):
        raise NotSupportedError(f"{where}: nope_layers = {list(model.nope_layers)}: the megakernel rotates every "
                                "attention layer or none (one RoPE table per step)")
    lin = model.linear
    if devices > 1 and lin.linear_key_heads % devices:
        raise NotSupportedError(f"{where}: linear_key_heads = {lin.linear_key_heads}: expected a multiple of the "
                                f"{devices} devices (each takes whole key heads and their value heads)")


def _replace(plan: Plan, **changes) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, **changes)


def _vmem_breakdown(plan: Plan) -> dict[str, int]:
    """VMEM bytes per component: every VMEM buffer of the kernel contract, tile-padded, summed
    by its component, plus one estimate that is not a buffer.

    From the contract: `weight_ring`, `layer_vectors` (two layers' norm vectors),
    `activations` (residual, normed input, q|k|v, attention output, FFN activation, MoE output),
    `logits_staging`, `attention` and `moe` (the stages' scratch), and `inputs` (the VMEM
    operands: embedded rows, cos, sin, final norm). Not from the contract:
    `moe_temporaries`, the MoE stage's largest compiler temporaries (`MoEGeometry.vmem_bytes()`
    minus its scratch), an estimate."""
    out = plan.contract.vmem_by_component()
    if plan.moe is not None:
        out["moe_temporaries"] = int(plan.moe.vmem_bytes() - plan.moe.scratch_bytes())
    return out


def _vmem_temporaries(plan: Plan) -> dict[str, int]:
    """Compiler temporaries of the stages that are not kernel buffers, estimated per component
    (kept out of `vmem`, whose keys are the contract's components plus `moe_temporaries`):
    `attention_temporaries`, the per-KV-tile scores / probabilities / masked V tile of the
    attention tile loop (`AttentionGeometry.temporaries_bytes`), which grow with kv_tile_pages."""
    out = {"attention_temporaries": plan.attention.temporaries_bytes()}
    if plan.sparse is not None:
        out["sparse_temporaries"] = plan.sparse.temporaries_bytes()
    return out


def _hbm_breakdown(plan: Plan) -> dict[str, float]:
    cfg = plan.cfg
    ring = {}
    for s in plan.segments:
        for n in s.families:
            ring[n] = ring.get(n, 0) + s.num_layers * plan.families[n].tiles * plan.families[n].tile_bytes
    out: dict[str, float] = {f"weights_{n}": float(b) for n, b in ring.items()}
    out["layer_vectors"] = float(cfg.num_layers * LAYER_VECTOR_ROWS * plan.vector_width * 4)
    if plan.column_scaled:  # column scales: one row per layer, the lm_head's whole
        out["weight_scales"] = float(4 * (cfg.num_layers * plan.scales_width + plan.vocab_pad))
    if plan.ring_grouped:  # group scales: one scale tile per weight tile
        out["weight_scales"] = float(sum(s.num_layers * plan.families[n].tiles * plan.families[n].scale_tile_bytes
                                         for s in plan.segments for n in s.families))
    if plan.moe is not None:
        out["experts_and_router"] = plan.moe.num_moe_layers * plan.moe.expected_hbm_bytes()
    if plan.sparse is None:
        out["kv_cache"] = float(plan.attention.hbm_bytes(_full_lengths(plan)))
    else:  # the latent pages the step patches (read, written); the selected rows, gathered; the index keys
        att, lengths = plan.attention, _full_lengths(plan)
        c = att.dma_counts([[n + i for i in range(plan.q_len)] for n in lengths], lengths)
        out["kv_cache"] = float(att.num_layers * 2 * c["patched_pages"] * att.page_bytes)
        out.update({k: float(v) for k, v in plan.sparse.hbm_bytes(lengths).items()})
    if plan.linear is not None:  # every sequence's slot: state, window, pending rows, read and written
        out.update({k: float(v) for k, v in plan.linear.hbm_bytes().items()})
    # glue <-> kernel: embedded rows + cos/sin (+ the query factors) in, logits out (f32)
    rope_lanes = 2 * rope_table_lanes(cfg) + (QUERY_SCALE_LANES if cfg.positions.query_scale_beta else 0)
    out["activations_io"] = float(plan.rows * 4 * (cfg.hidden_size + rope_lanes + plan.vocab_pad))
    if plan.all_reduce is not None:  # the peers' logits slices, written into this device's HBM
        out["logits_gathered"] = float((plan.devices - 1) * logits_slice_bytes(plan))
    if plan.taps:  # every tapped row written out (each device its own copy of the whole rows)
        out["hidden_taps"] = float(tap_bytes(plan))
    return out


def tap_bytes(plan: Plan) -> int:
    """Bytes of the step's `taps` output: len(taps) x N rows x the unpadded hidden width, model dtype."""
    return len(plan.taps) * plan.rows * tap_width(plan) * plan.cfg.dtype_bytes


def tap_width(plan: Plan) -> int:
    """Lanes of a tapped row as the kernel writes it: the hidden width the kernel runs (a
    lane-padded model's padded width; the step slices the model's own columns)."""
    return plan.cfg.hidden_size


def _interconnect(plan: Plan) -> dict[str, dict[str, float]]:
    """What one device sends to its peers per step: `Plan.layer_collectives` all-reduces per
    layer (after the o-projection and after the FFN / MoE; with an all-heads QK-norm also its
    sums of squares, in the same slot-sized buffers), each sending
    `AllReduceGeometry.send_bytes`, the logits all-gather after the lm_head, and with the MLA
    latent split one all-gather of q_a | kv_a slices per layer."""
    g = plan.all_reduce
    if g is None:
        return {}
    return {"all_reduce": {"count": plan.layer_collectives * plan.cfg.num_layers, "bytes_each": float(g.send_bytes),
                           "messages_each": g.messages, "rounds": g.stages},
            # every device's logits slice to every peer (N - 1 slices sent, either schedule)
            "logits_all_gather": {"count": 1, "bytes_each": float((g.devices - 1) * logits_slice_bytes(plan)),
                                  "messages_each": len(g.gather_offsets()), "rounds": g.gather_stages},
            # MLA with the latent split: every layer's q_a | kv_a slice to every peer
            **({"latent_all_gather": {"count": plan.cfg.num_layers,
                                      "bytes_each": float((g.devices - 1) * latent_slice_bytes(plan)),
                                      "messages_each": len(g.gather_offsets()), "rounds": g.gather_stages}}
               if plan.latent_split else {})}


def _full_lengths(plan: Plan) -> list[int]:
    """Cached tokens per sequence when the step's new tokens fill the context (the worst case)."""
    return [plan.context - plan.q_len] * plan.batch


def _dma_breakdown(plan: Plan) -> dict[str, dict[str, float]]:
    out = {}
    for n, f in plan.families.items():
        count = sum(s.num_layers * f.tiles for s in plan.segments if n in s.families)
        out[f"ring_{n}"] = {"count": count, "bytes_each": f.tile_bytes}
    vec_bytes = LAYER_VECTOR_ROWS * plan.vector_width * 4
    out["layer_vectors"] = {"count": plan.cfg.num_layers, "bytes_each": vec_bytes}
    if plan.taps:
        out["hidden_taps"] = {"count": len(plan.taps), "bytes_each": tap_bytes(plan) // len(plan.taps)}
    if plan.column_scaled:
        out["layer_scales"] = {"count": plan.cfg.num_layers, "bytes_each": 4 * plan.scales_width}
    for n, f in plan.families.items():
        if f.group:
            count = sum(s.num_layers * f.tiles for s in plan.segments if n in s.families)
            out[f"ring_{n}_scales"] = {"count": count, "bytes_each": f.scale_tile_bytes}
    att = plan.attention
    lengths = _full_lengths(plan)
    positions = [[n + i for i in range(plan.q_len)] for n in lengths]
    if plan.sparse is None:
        pages = sum(n * (c["hbm_tile_pages"] + c["local_tile_pages"] + 2 * c["patched_pages"])
                    for n, c in att.layer_counts(positions))
        out["kv_cache_pages"] = {"count": att.caches * pages, "bytes_each": att.page_bytes}
    else:  # the latent cache's patched pages; the index keys' tiles and patches; the gathered blocks
        g = plan.sparse
        c = g.layer_counts(positions, lengths)
        out["kv_cache_pages"] = {"count": g.num_layers * 2 * c["patched_pages"], "bytes_each": att.page_bytes}
        out["index_key_pages"] = {"count": g.num_layers * (c["key_tile_pages"] + c["key_local_pages"]
                                                           + 2 * c["patched_pages"]), "bytes_each": g.key_page_bytes}
        out["sparse_gather_blocks"] = {"count": g.mla_layers * c["gather_blocks"], "bytes_each": g.block_bytes}
        out["indexer_vectors"] = {"count": 2 * g.num_layers, "bytes_each": g.vector_bytes / 2}
    if plan.linear is not None:  # per linear layer and sequence: state, window, pending rows in and out
        g = plan.linear
        out["linear_states"] = {"count": 6 * g.num_layers * g.batch, "bytes_each": g.slot_bytes / 3}
    if plan.moe is not None:
        m = plan.moe
        distinct = m.expected_distinct_experts()
        out["experts"] = {"count": m.num_moe_layers * m.dma_count(distinct),
                          "bytes_each": m.expected_hbm_bytes() / max(m.dma_count(distinct), 1)}
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def resident_bytes(cfg: ModelConfig, num_pages: int, page_size: int, sharding: ShardingPlan | None = None,
                   quant: str = "none", kv_dtype: str = "") -> tuple[int, int]:
    """(weights, KV cache) bytes each device holds in HBM (closed form, O(1)): one device holds
    everything; on many, each holds its share of the weights (`per_device_weight_bytes`) and its
    KV heads' cache, or for MLA the whole latent cache (every device keeps a copy: it is
    shared by all heads). `kv_dtype` (fp8, int8): the cache's 1-byte format (`tpumk.model.kv_quant`).
    The cache holds the attention layers only (a hybrid's linear layers keep a state pool,
    `LinearGeometry.resident_bytes`)."""
    n = sharding.devices if sharding is not None else 1
    weights = quantized_weight_bytes(cfg, quant) if n == 1 else per_device_weight_bytes(cfg, sharding, quant)
    heads, width, tensors = kv_quant.cache_rows(cfg)
    if n > 1 and not cfg.is_mla:
        heads = sharding.kv_heads
    fmt = kv_quant.kv_format(kv_dtype) if kv_dtype else None
    if cfg.is_mla and fmt is None:  # the model-dtype latent row is stored lane-padded
        width = cfg.attention.latent_cache_lanes
    per_token = kv_quant.cache_bytes_per_token(heads, width, cfg.kv_layers, fmt, cfg.dtype_bytes, tensors, page_size)
    return int(weights), int(round(num_pages * page_size * per_token))


def _check_hbm(cfg: ModelConfig, target: Target, num_pages: int, page_size: int,
               sharding: ShardingPlan | None = None, quant: str = "none", kv_dtype: str = "",
               pool: int = 0) -> None:
    """The model's weights plus the KV cache (plus `pool`: a hybrid's state pool, bytes per
    device) must fit each device's HBM (`resident_bytes`)."""
    n = sharding.devices if sharding is not None else 1
    weights, kv = resident_bytes(cfg, num_pages, page_size, sharding, quant, kv_dtype)
    if weights + kv + pool > target.hbm_bytes:
        where = f"one {target.name} device" if n == 1 else f"{n} {target.name} devices"
        each = "" if n == 1 else " per device"
        hint = _fit_hint(cfg, target, num_pages, page_size, quant, n, pool * n)
        states = f" + state pool {pool / 1e9:.1f} GB" if pool else ""
        raise PlanError(
            f"model '{cfg.name}' does not fit {where}: weights {weights / 1e9:.1f} GB + "
            f"KV cache {kv / 1e9:.1f} GB{states}{each} > HBM {target.hbm_bytes / 1e9:.1f} GB{hint}")


def _fits(cfg: ModelConfig, target: Target, num_pages: int, page_size: int, quant: str, devices: int,
          pool: int = 0) -> bool:
    """Whether the weights and KV cache (and a hybrid's state pool of `pool` bytes in all, split
    by linear heads over the devices) fit each of `devices` devices (a split the model allows)."""
    try:
        sharding = plan_sharding(cfg, devices) if devices > 1 else None
    except PlanError:
        return False
    weights, kv = resident_bytes(cfg, num_pages, page_size, sharding, quant)
    return weights + kv + pool / devices <= target.hbm_bytes


def _fit_hint(cfg: ModelConfig, target: Target, num_pages: int, page_size: int, quant: str, devices: int,
              pool: int = 0) -> str:
    """'; fits --devices 4 (or --quant int8 on ...)': the fewest devices (a power of two the model
    splits over) that hold it with these weights, and the first smaller weight scheme that fits
    the devices asked for; '' when neither does."""
    from tpumk.plan.spec import MAX_DEVICES

    ways = []
    more = next((d for d in (2 ** k for k in range(1, MAX_DEVICES.bit_length()))
                 if devices < d <= MAX_DEVICES and _fits(cfg, target, num_pages, page_size, quant, d, pool)), None)
    if more is not None:
        ways.append(f"--devices {more}")
    if quant == "none":
        schemes = ("int8", "int4") if cfg.is_moe else ("int8",)
        smaller = next((q for q in schemes if _fits(cfg, target, num_pages, page_size, q, devices, pool)), None)
        if smaller is not None:
            ways.append(f"--quant {smaller}" + (f" on {devices} devices" if devices > 1 else " on one device"))
    return f"; it fits with {' or '.join(ways)}" if ways else ""


def _check_fits(plan: Plan) -> None:
    pool = plan.linear.resident_bytes if plan.linear is not None else 0
    _check_hbm(plan.whole_model, plan.target, plan.num_pages, plan.page_size, plan.sharding, plan.quant,
               plan.attention.kv_dtype, pool)
    target = plan.target
    parts = ", ".join(f"{k} {_mib(v)}" for k, v in sorted({**plan.vmem, **plan.vmem_temporaries}.items(),
                                                          key=lambda kv: -kv[1]))
    advice = "Lower ring_depth / tile sizes / kv_tile_pages / kv_buffers / expert_slots"
    if plan.vmem_needed > plan.vmem_budget:
        raise VMEMError(
            f"plan does not fit {target.name} VMEM: needs {_mib(plan.vmem_needed)} > budget "
            f"{_mib(plan.vmem_budget)} ({plan.tuning.vmem_limit_fraction:.2f} x {_mib(target.vmem_bytes)}); "
            f"{parts}. {advice}")
    if plan.vmem_needed + MOSAIC_HEADROOM > target.vmem_bytes:  # the scoped limit would be capped below need
        raise VMEMError(
            f"plan does not fit {target.name} VMEM: needs {_mib(plan.vmem_needed)} + {_mib(MOSAIC_HEADROOM)} "
            f"Mosaic headroom > capacity {_mib(target.vmem_bytes)}; {parts}. {advice} (or vmem_limit_fraction)")
