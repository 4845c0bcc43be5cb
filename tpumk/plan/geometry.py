"""Static geometry of the megakernel's stages, and the `Buffer` every kernel memory is described by.

Everything here is plain Python and jax.numpy dtypes, decided before tracing: the plan
(`tpumk.plan.plan`) builds an `AttentionGeometry` and (MoE models) a `MoEGeometry`, and the
kernel contract (`tpumk.plan.contract`) lists their scratch buffers. The Pallas stages in
`tpumk.kernel` import these classes; this module never imports Pallas.

TPU memory facts used for sizes (TPU_FACTS 4): a VMEM buffer is stored in (sublanes x 128)
tiles over its last two dims, 8 sublanes for 32-bit dtypes and 16 for bfloat16, so a
buffer's VMEM footprint is its shape with the last dim rounded up to 128 lanes and the
second-minor dim rounded up to the dtype's sublane count (`Buffer.nbytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from tpumk.errors import PlanError
from tpumk.model.config import ModelConfig, expected_distinct_experts
from tpumk.model.kv_quant import KV_FORMATS, PagedLayout, kv_format
from tpumk.model.parts import SCORINGS
from tpumk.model.quantize import EXPERT_FORMATS, FORMATS, GROUP

LANE = 128  # TPU lane width: the minor dim of every VMEM tile
F32_SUBLANES = 8  # rows of one (8 x 128) 32-bit VMEM tile
# Weight / cache dtypes a model may use, and their bytes.
WEIGHT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MAX_ROUTER_GROUPS = 32  # DeepSeek-V3 uses 8; the kernel ranks groups pairwise
# Every dtype a kernel buffer may have ("dma" marks a DMA semaphore array).
# (int8 / float8_e4m3fn / int4: quantized weight codes, tpumk.model.quantize)
BUFFER_DTYPES = {**WEIGHT_DTYPES, "int32": jnp.int32, "int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn,
                 "int4": jnp.int4, "float4_e2m1fn": jnp.float4_e2m1fn}
# 4-bit codes take half a byte in HBM (two a byte) but one byte each in VMEM (int4 on TPU7x,
# TPU_FACTS 9; counted so on every target and for e2m1 too: the larger of the two possibilities).
HBM_BITS = {"int4": 4, "float4_e2m1fn": 4}
# Rows of one VMEM tile per dtype: the second-minor tiling Mosaic requires of DMA offsets and
# sizes (hence of page_size, TPU_FACTS 4) and the row padding of every VMEM buffer.
SUBLANES = {"float32": 8, "bfloat16": 16, "int32": 8, "int8": 32, "float8_e4m3fn": 32, "int4": 32,
            "float4_e2m1fn": 32}
SPACES = ("smem", "vmem", "hbm", "semaphore")
# A layer's vector block [LAYER_VECTOR_ROWS, W] f32: these rows hold the layer's norm weights.
LAYER_VECTOR_ROWS = 8  # attn_norm, mlp_norm, q_norm, k_norm, qkv_bias, post_attn_norm, post_mlp_norm, sinks
VECTOR_ROW = {"attn_norm": 0, "mlp_norm": 1, "q_norm": 2, "k_norm": 3, "qkv_bias": 4, "post_attn_norm": 5,
              "post_mlp_norm": 6, "sinks": 7,
              # Mistral Large 4's per-head log-position query scale and bias take those rows: an
              # MLA model has neither (the config refuses both); moe_in_norm beside them is refused
              # (tpumk.plan.plan.check_kernel_parts)
              "q_log_scale": 4, "q_log_bias": 7,
              # Muse Spark's experts' input norm (moe_in_norm, M lanes) takes the sinks' row: the
              # model has no sinks (tpumk.plan.plan.check_kernel_parts refuses both)
              "moe_in_norm": 7}


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def mla_dims(cfg: ModelConfig) -> dict[str, int]:
    """The lane layout of the MLA activations in the kernel (every block 128-lane aligned so
    the streamed matmuls slice whole lane tiles): per head, the nope part of q padded to
    `nope` lanes, the latent to `latent` lanes, the value to `value` lanes; all heads' roped q
    lanes side by side after the nope parts (`rope_q` lanes, whole 128-lane blocks, rotated
    R-wide per head, R dividing 128); kv_a's output is c_kv then k_rope from lane `latent_1`
    (one lane block). `o_rows`: the o projection's input rows (per head `value`)."""
    hq, r = cfg.num_q_heads, cfg.qk_rope_head_dim
    # a NoPE layer with all-latent keys (nope_latent_keys, Mistral Large 4) has N + R nope lanes
    n = cfg.qk_nope_head_dim + (r if cfg.attention.nope_latent_keys else 0)
    nope, latent, value = (round_up(v, LANE) for v in (n, cfg.kv_lora_rank, cfg.v_head_dim))
    rope_q = round_up(hq * r, LANE)
    return {"nope": nope, "latent": latent, "value": value, "rope_q": rope_q, "q_cols": hq * nope + rope_q,
            "kv_a_cols": latent + LANE, "latent_1": latent, "o_rows": hq * value,
            "q_lora": round_up(cfg.q_lora_rank, LANE) if cfg.q_lora_rank else 0}


# ---------------------------------------------------------------------- buffers
@dataclass(frozen=True)
class Buffer:
    """One memory the kernel sees: an operand, an output or a scratch buffer.

    name: unique within its list (stage scratch is prefixed by the stage, "attention.m").
    shape: the array shape (semaphores: the semaphore array's shape).
    dtype: "float32" | "bfloat16" | "int32", or "dma" for DMA semaphores.
    space: "smem" (scalars), "vmem", "hbm" (left in HBM: `pl.ANY`, moved by manual DMAs) or
        "semaphore".
    component: what it belongs to; for VMEM buffers, the key of the plan's VMEM breakdown it is
        counted under.
    source: operands only: where the decode step takes it from: "packed.<key>[.<key>]" (the
        packed weights), "cache.<field>" (the KV cache) or "step.<value>" (computed by the glue).
    layout: one line saying what the rows / lanes hold.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str
    component: str = ""
    source: str = ""
    layout: str = ""

    def __post_init__(self):
        if self.space not in SPACES:
            raise ValueError(f"buffer {self.name}: space {self.space!r} not in {SPACES}")
        if self.dtype != "dma" and self.dtype not in BUFFER_DTYPES:
            raise ValueError(f"buffer {self.name}: dtype {self.dtype!r}")
        if (self.dtype == "dma") != (self.space == "semaphore"):
            raise ValueError(f"buffer {self.name}: semaphores (and only they) have dtype 'dma'")

    @property
    def jnp_dtype(self):
        return BUFFER_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return 0 if self.space == "semaphore" else jnp.dtype(self.jnp_dtype).itemsize

    @property
    def count(self) -> int:
        """Elements (semaphores: semaphores)."""
        return math.prod(self.shape)

    @property
    def logical_bytes(self) -> int:
        """Bytes of the elements packed as HBM stores them (int4: two a byte)."""
        if self.dtype in HBM_BITS:
            return -(-self.count * HBM_BITS[self.dtype] // 8)
        return self.count * self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes the buffer occupies in its memory. VMEM: whole (sublanes x 128) tiles over the
        last two dims (a 1-D buffer is one row); other spaces: the logical bytes; semaphores 0."""
        if self.space != "vmem":
            return self.logical_bytes
        shape = (1, *self.shape) if len(self.shape) == 1 else self.shape
        *lead, r, c = shape
        return math.prod(lead) * round_up(r, SUBLANES[self.dtype]) * round_up(c, LANE) * self.itemsize

    def summary(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "space": self.space}
        for k in ("component", "source", "layout"):
            if getattr(self, k):
                out[k] = getattr(self, k)
        if self.space == "vmem":
            out["bytes"] = self.nbytes
        return out


def vmem(name: str, shape: Sequence[int], dtype: str, layout: str = "") -> Buffer:
    return Buffer(name, tuple(shape), dtype, "vmem", layout=layout)


def smem(name: str, shape: Sequence[int], dtype: str = "int32", layout: str = "") -> Buffer:
    return Buffer(name, tuple(shape), dtype, "smem", layout=layout)


def dma_sems(name: str, shape: Sequence[int], layout: str = "") -> Buffer:
    return Buffer(name, tuple(shape), "dma", "semaphore", layout=layout)


def hbm(name: str, shape: Sequence[int], dtype: str, layout: str = "") -> Buffer:
    return Buffer(name, tuple(shape), dtype, "hbm", layout=layout)


# ---------------------------------------------------------------------- attention
def heads_per_lane_block(head_dim: int) -> int:
    """Heads that share one 128-lane block in the kernel: 2 for 64-wide heads (no padding,
    see AttentionGeometry), else 1 (a head is one or more whole lane blocks)."""
    return 2 if head_dim == LANE // 2 else 1


@dataclass(frozen=True)
class AttentionGeometry:
    """Static facts of the attention stage: model shape, cache shape and two tuning knobs.

    kv_tile_pages: pages per streamed KV tile (tile = kv_tile_pages * page_size tokens). Any
        value in [1, pages_per_seq] is valid: it need not divide pages_per_seq, because a
        sequence's last tile repeats its last needed page in the unused page slots (those rows
        are masked), so no tile DMA reads past the last page the sequence uses this step (page
        ids are also clipped into the pool, so no DMA ever leaves the cache).
    kv_buffers: VMEM tile slots (>= 2); kv_buffers - 1 tiles are in flight during compute.
    windows: per layer, its sliding window (0: full attention); empty: every layer is full.
        A sliding layer streams only the tiles holding keys inside some query's window.

    Head dim 64: a cache row holds the heads side by side with no padding (the KV bytes are
    num_kv_heads * 64 per token), and the stage works on 128-lane blocks of `heads_per_block`
    = 2 kv heads: the two heads' queries are stacked into one block-diagonal query block
    (head p's rows carry its q in lanes p*64 .. p*64+63 and zeros elsewhere), so one matmul
    against the 128-lane K block gives both heads' scores, and p.V the two heads' outputs in
    their own lane halves (the cross-head quadrants are computed and dropped: the MXU pass is
    128 lanes wide either way).
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
    windows: tuple[int, ...] = ()
    # scores are q . k / sqrt(score_dim): a lane-padded head's true width, or the model's
    # attn_scalar (Gemma's query_pre_attn_scalar); 0: head_dim
    score_dim: float = 0
    # scores soft-capped to cap * tanh(s / cap) before the mask (Gemma 2); 0: not capped
    softcap: float = 0
    # gpt-oss: each q head's sink logit joins its softmax denominator (the stage's `sinks` row)
    sinks: bool = False
    # the cache's format (`tpumk.model.kv_quant`): "" the model dtype, or "fp8" / "int8" codes with
    # a power-of-two scale per (token, kv head), packed with them in one array (`kv_layout`)
    kv_dtype: str = ""
    # a drafter's block (DFlash): the step's tokens see each other in any order
    bidirectional: bool = False

    @classmethod
    def from_config(cls, cfg, batch: int, q_len: int, page_size: int, pages_per_seq: int,
                    kv_tile_pages: int, kv_buffers: int, kv_dtype: str = "") -> "AttentionGeometry":
        # one entry per attention layer: the KV cache's layers (a hybrid's linear layers hold none)
        windows = tuple(cfg.pattern.window(i) for i in cfg.pattern.attention_layers) if cfg.pattern.sliding_window else ()
        return cls(batch=batch, q_len=q_len, num_q_heads=cfg.num_q_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=page_size,
                   pages_per_seq=pages_per_seq, num_layers=cfg.kv_layers,
                   kv_tile_pages=kv_tile_pages, kv_buffers=kv_buffers, dtype=cfg.dtype, windows=windows,
                   score_dim=cfg.attention.attn_scalar or cfg.attention.head_width, softcap=cfg.attention.attn_softcap,
                   sinks=cfg.attention.attn_sinks, kv_dtype=kv_dtype, bidirectional=cfg.attention.step_bidirectional)

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
    def heads_per_block(self) -> int:
        """KV heads per lane block the stage computes on: 2 for head_dim 64, else 1."""
        return heads_per_lane_block(self.head_dim)

    @property
    def head_blocks(self) -> int:
        return self.num_kv_heads // self.heads_per_block

    @property
    def block_lanes(self) -> int:
        """Lanes of one block: head_dim, or 128 for two 64-wide heads."""
        return self.head_dim * self.heads_per_block

    @property
    def block_rows(self) -> int:
        """Query rows of one block: q_rows per head of the block, stacked."""
        return self.q_rows * self.heads_per_block

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.windows[layer] if self.windows else 0

    def window_runs(self) -> list[tuple[int, int, int]]:
        """(first layer, end layer, window) of each run of consecutive layers with one nonzero
        window: the kernel selects a traced layer's window with one compare per run."""
        runs: list[tuple[int, int, int]] = []
        for i, w in enumerate(self.windows):
            if w and runs and runs[-1][1] == i and runs[-1][2] == w:
                runs[-1] = (runs[-1][0], i + 1, w)
            elif w:
                runs.append((i, i + 1, w))
        return runs

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
        return round_up(self.group * self.q_len, 8)

    @property
    def staged_rows(self) -> int:
        return round_up(self.tokens, 8)

    @property
    def patch_pages(self) -> int:
        """Patch slots: one page per new token, plus a read-only sink page (source of the
        stand-in DMAs of tokens that share a page with an earlier token or are out of range)."""
        return self.tokens + 1

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def jnp_dtype(self):
        return WEIGHT_DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        """Whether the cache holds 1-byte codes and per (token, kv head) scales."""
        return bool(self.kv_dtype)

    @property
    def cache_dtype(self) -> str:
        """dtype of the cache arrays (and their VMEM tiles and patch pages)."""
        return np.dtype(kv_format(self.kv_dtype).dtype).name if self.quantized else self.dtype

    @property
    def kv_layout(self) -> PagedLayout:
        """A quantized cache's page layout: K, V codes and scale exponents in one array."""
        return PagedLayout(self.num_kv_heads, self.head_dim, 2, self.page_size, self.kv_dtype)

    @property
    def kv_group(self) -> int:
        """Tokens per cache row: 1, or the quantized layout's group (see PagedLayout)."""
        return self.kv_layout.group if self.quantized else 1

    @property
    def page_rows(self) -> int:
        """Rows of one page in a cache array (and in a tile slot): page_size / kv_group."""
        return self.page_size // self.kv_group

    @property
    def page_lanes(self) -> int:
        """Lanes of one cache row: kv_size, or the quantized layout's packed row."""
        return self.kv_layout.lanes if self.quantized else self.kv_size

    @property
    def page_bytes(self) -> int:
        """HBM bytes of one page of one cache array (a quantized page holds K, V and scales)."""
        if self.quantized:
            return self.kv_layout.page_bytes
        return self.page_size * self.page_lanes * self.itemsize

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
        need(self.dtype in WEIGHT_DTYPES, "dtype", f"one of {', '.join(WEIGHT_DTYPES)}")
        need(self.kv_dtype in ("",) + tuple(KV_FORMATS), "kv_dtype", f"'' (the model dtype) or one of {', '.join(KV_FORMATS)}")
        need(self.num_q_heads % self.num_kv_heads == 0, "num_kv_heads",
             f"a divisor of num_q_heads ({self.num_q_heads})")
        need(self.head_dim % LANE == 0 or self.head_dim == LANE // 2, "head_dim",
             f"64 or a multiple of {LANE} (heads are lane-aligned slices of a cache row, or two "
             f"64-wide heads share one {LANE}-lane block)")
        need(self.num_kv_heads % self.heads_per_block == 0, "num_kv_heads",
             f"a multiple of {self.heads_per_block} (head_dim {self.head_dim}: kv heads go in pairs per "
             f"{LANE}-lane block)")
        need(isinstance(self.windows, tuple) and len(self.windows) in (0, self.num_layers)
             and all(isinstance(w, int) and w >= 0 for w in self.windows), "windows",
             f"empty or one non-negative window per layer ({self.num_layers})")
        sub = SUBLANES[self.dtype]
        need(self.page_size % sub == 0, "page_size",
             f"a multiple of {sub} ({self.dtype} sublane tiling: pages are DMA'd whole into "
             f"tile-aligned VMEM rows)")
        need(self.kv_tile_pages <= self.pages_per_seq, "kv_tile_pages",
             f"at most pages_per_seq ({self.pages_per_seq})")
        need(self.kv_buffers >= 2, "kv_buffers", "at least 2 (one tile computed while the next loads)")

    # ------------------------------------------------------------------ budgets
    def scratch(self) -> tuple[Buffer, ...]:
        """Every scratch buffer of the stage, in the order `attention_stage` takes their refs
        (`tpumk.kernel.attention.AttentionScratch` names them the same way).

        Every VMEM shape is whole (8 x 128) f32 / (16 x 128) bf16 tiles (page_size is validated,
        the other row counts are padded), so the logical bytes are the bytes VMEM allocates."""
        dt = self.cache_dtype
        nb, s, p, hd = self.kv_buffers, self.tile_rows, self.page_size, self.kv_size
        hkv, r, d = self.head_blocks, self.block_rows, self.block_lanes
        if self.quantized:  # one packed array: a page is page_rows x page_lanes (tpumk.model.kv_quant)
            caches = (
                vmem("kv_tiles", (nb, self.kv_tile_pages * self.page_rows, self.page_lanes), dt,
                     "streamed quantized tiles: [slot, row of the tile, packed row (K | V codes of kv_group "
                     "tokens, their exponents)]"),
                vmem("kv_patch", (self.patch_pages, self.page_rows, self.page_lanes), dt,
                     "packed page of new token i of sequence b in slot b*q_len + i, then a read-only sink page"))
        else:
            caches = (
                vmem("k_tiles", (nb, s, hd), dt, "streamed K tiles: [slot, token of the tile, kv heads along lanes]"),
                vmem("v_tiles", (nb, s, hd), dt, "same for V"),
                vmem("k_patch", (self.patch_pages, p, hd), dt,
                     "page of new token i of sequence b in slot b*q_len + i, then a read-only sink page"),
                vmem("v_patch", (self.patch_pages, p, hd), dt, "same for V"))
        exponents = () if not self.quantized else (
            vmem("new_exps", (2, self.staged_rows, self.num_kv_heads), "float32",
                 "[k_new | v_new, token row b*q_len + i, kv head]: the new rows' exponent bytes (new_rows holds "
                 "their codes)"),)
        return caches + (
            vmem("new_rows", (2, self.staged_rows, hd), "float32",
                 "[k_new | v_new, token row b*q_len + i, kv heads]: one row addressable at a time"),
            vmem("q_heads", (self.batch, hkv, r, d), "float32",
                 "q regrouped per kv head block: [b, j] row p*q_rows + g*q_len + i = q head h*group + g of "
                 "token i (h = j*heads_per_block + p, in lanes p*head_dim ..); then o"),
            vmem("m", (hkv, r, LANE), "float32", "running max, lane-replicated"),
            vmem("l", (hkv, r, LANE), "float32", "running sum, lane-replicated"),
            vmem("acc", (hkv, r, d), "float32", "running p.v"),
            vmem("flat", (self.staged_rows, self.q_size), "float32", "q as given ([B*q_len, Hq*D], b-major), later o"),
            smem("seq_meta", (self.batch * (3 + self.q_len),), "int32",
                 "per sequence b at b*(3+q_len): end tile, npages, first tile, then the page of each new token"),
            dma_sems("tile_sems", (self.caches, self.kv_buffers, self.kv_tile_pages),
                     "[K | V (a quantized cache: the one array), tile slot, page]"),
            dma_sems("patch_sems", (2, self.tokens), "[read | write, patch slot]"),
        ) + exponents

    def vmem_shapes(self) -> list[tuple[str, tuple[int, ...], Any]]:
        """(name, shape, jnp dtype) of every VMEM scratch buffer, in scratch order."""
        return [(b.name, b.shape, b.jnp_dtype) for b in self.scratch() if b.space == "vmem"]

    def vmem_bytes(self) -> int:
        """Exact bytes of VMEM scratch the stage allocates (sum over `vmem_shapes`):

        2*kv_buffers*tile_rows*kv_size*itemsize          KV tile slots
        + 2*(B*q + 1)*page_size*kv_size*itemsize        patch pages (per new token, + sink)
        + 4*(2*Bq8*kv_size + Bq8*q_size)                 staged new K/V rows, q in / o out
        + 4*B*Hb*Rb*Db + 4*Hb*Rb*(2*128 + Db)            per-block q/o, softmax m, l, acc
        with Bq8 = round_up(B*q, 8), R = round_up(group*q, 8), and per head block (heads_per_block
        kv heads) Hb = Hkv / heads_per_block, Rb = heads_per_block * R, Db = heads_per_block * D."""
        return sum(b.nbytes for b in self.scratch() if b.space == "vmem")

    def temporaries_bytes(self) -> int:
        """Estimated VMEM of the compiler temporaries of one KV-tile step (not scratch buffers).

        The tile loop runs every kv head's QK^T, then every softmax, then every p.v, so all heads'
        per-tile values are live together: scores and exp(scores - max) [R, S] float32 and the
        probabilities cast to the cache dtype, per kv head; the masked V tile (V rows that are
        no key zeroed) [S, Hkv*D] in the cache dtype; and the [R, S] key mask. Rows and lanes are
        padded to whole VMEM tiles. Grows with kv_tile_pages: this is what the tile size costs
        besides its kv_buffers slots.

        An upper bound (every value live at once): measured with libtpu 0.0.52 on TPU7x (8 layers,
        hidden 2048, bf16), Mosaic's scoped VMEM beyond the contract's buffers was 0.3-3.4 MiB and
        grew by at most 0.12 MiB from kv_tile_pages 1 to 32 (16 query rows per kv head); the
        bound keeps the plan safe if the compiler materialises more of them."""
        s, r, isz = self.tile_rows, self.block_rows, self.itemsize
        s_lanes = round_up(s, LANE)
        per_head = r * s_lanes * (4 + 4 + isz)
        masked_v = round_up(s, SUBLANES[self.dtype]) * round_up(self.kv_size, LANE) * isz
        mask = r * s_lanes * 4
        # a quantized cache's tiles: every block's codes in the model dtype (counted at f32 + the
        # model dtype, which also covers their conversion) and the tile's scales, every block
        # live at once (the same upper-bound stance)
        dequant = 0
        if self.quantized:
            rows = round_up(self.kv_tile_pages * self.page_rows, F32_SUBLANES)
            dequant = rows * (2 * self.kv_group * round_up(self.kv_size, LANE) * (4 + isz)
                              + (self.page_lanes - self.kv_layout.codes_lanes) * 4)
        return self.head_blocks * per_head + masked_v + mask + dequant

    def smem_bytes(self) -> int:
        """SMEM scratch: per sequence, its end and first tile, page count and each new token's page."""
        return 4 * self.batch * (3 + self.q_len)

    def dma_semaphores(self) -> int:
        """DMA semaphores the stage allocates: (K, V) x kv_buffers x kv_tile_pages (one per page
        DMA) + (read, write) x B*q."""
        return self.caches * self.kv_buffers * self.kv_tile_pages + 2 * self.tokens

    def dma_counts(self, positions: np.ndarray, lengths: Sequence[int] | None = None,
                   window: int = 0) -> dict[str, int]:
        """Page DMAs of one layer for concrete `positions` [B, q] (the kernel's own logic).

        hbm_tile_pages: pages streamed from HBM into tile slots; local_tile_pages: tile pages
        copied from a patched page in VMEM; patched_pages: pages read, patched and written back;
        tiles: (sequence, tile) steps of the tile loop. Each page count is per cache (K and V
        each move this many pages). Clamped as the kernel clamps: positions outside [0, capacity)
        patch nothing, and a sequence streams the tiles from `first_key // tile_rows` up to
        max(largest in-range position + 1, min(length, capacity) if a position is at or past the
        capacity, 1) rows; `lengths` [B] (tokens cached before the step) default to the capacity.
        first_key is 0, or with a sliding `window` the lowest key some query's window holds:
        min over non-negative positions p of max(p - window + 1, 0), at most the last row."""
        positions = np.asarray(positions).reshape(self.batch, self.q_len)
        p, s, kt = self.page_size, self.tile_rows, self.kv_tile_pages
        cap = self.pages_per_seq * p
        lengths = np.full(self.batch, cap) if lengths is None else np.asarray(lengths).reshape(self.batch)
        hbm = local = patched = tiles = 0
        for row, n in zip(positions, lengths):
            n = min(max(int(n), 0), cap)
            kv_end = max([1] + [int(x) + 1 if 0 <= x < cap else (n if x >= cap else 0) for x in row])
            npages, ntiles = -(-kv_end // p), -(-kv_end // s)
            first = 0
            if window:
                first = min([kv_end - 1] + [max(int(x) - window + 1, 0) for x in row if x >= 0]) // s
            written = {int(x) // p for x in row if 0 <= x < cap}
            patched += len(written)
            # Tile page slot lp (from first * kt on) holds page min(lp, npages - 1): pages
            # first*kt .. npages - 2 once each, the last page in every remaining slot. Closed
            # form (no loop over the context). A written page is never below the first tile.
            slots = (ntiles - first) * kt
            last_uses = slots - (npages - 1 - first * kt)
            uses = {pg: (last_uses if pg == npages - 1 else 1) for pg in written if first * kt <= pg < npages}
            local += sum(uses.values())
            hbm += slots - sum(uses.values())
            tiles += ntiles - first
        return {"hbm_tile_pages": hbm, "local_tile_pages": local, "patched_pages": patched, "tiles": tiles}

    def layer_counts(self, positions: np.ndarray, lengths: Sequence[int] | None = None
                     ) -> list[tuple[int, dict[str, int]]]:
        """(layers, dma_counts) per distinct window: the counts of every layer of the step."""
        if not self.windows:
            return [(self.num_layers, self.dma_counts(positions, lengths))]
        return [(self.windows.count(w), self.dma_counts(positions, lengths, w))
                for w in sorted(set(self.windows))]

    def hbm_bytes(self, context_lengths: Sequence[int], positions: np.ndarray | None = None) -> int:
        """KV-cache bytes read + written in HBM by one decode step over all layers.

        `context_lengths` [B] are the tokens cached before the step; the new tokens sit at
        positions length .. length + q_len - 1 unless `positions` [B, q] is given. Counts the
        tile pages streamed from HBM (a sliding-window layer only its window's tiles), the pages
        read for patching and the pages written back, for K and V, summed over the layers.
        Pages repeated to fill a sequence's last tile are its last page, which the step always
        writes, so they are VMEM copies and cost no HBM."""
        lengths = np.asarray(context_lengths, dtype=np.int64).reshape(self.batch)
        if positions is None:
            positions = lengths[:, None] + np.arange(self.q_len)[None, :]
        pages = sum(n * (c["hbm_tile_pages"] + 2 * c["patched_pages"])
                    for n, c in self.layer_counts(positions, lengths))
        return self.caches * pages * self.page_bytes

    @property
    def caches(self) -> int:
        """Cache arrays the stage reads and writes page by page: K and V, or a quantized
        cache's one packed array."""
        return 1 if self.quantized else 2


@dataclass(frozen=True)
class MLAGeometry(AttentionGeometry):
    """The MLA attention stage (`tpumk.kernel.mla_attention`): multi-query attention over ONE
    paged latent cache whose row is `c_kv | k_rope` (latent + rope lanes, the model's
    kv_cache_width, then zeros up to whole 128-lane tiles: `latent_cache_lanes`; a quantized
    cache: its packed row). In AttentionGeometry's terms: one kv head of head_dim =
    latent + rope lanes shared by all num_q_heads query heads (group = num_q_heads), one cache
    (no V: the values are the first `latent` lanes of the same rows). `scale` is the softmax
    scale (YaRN's, `tpumk.model.yarn.softmax_scale`)."""

    latent: int = 0
    rope: int = 0
    scale: float = 0.0

    @classmethod
    def for_mla(cls, cfg, batch: int, q_len: int, page_size: int, pages_per_seq: int, kv_tile_pages: int,
                kv_buffers: int, kv_dtype: str = "") -> "MLAGeometry":
        from tpumk.model import yarn

        return cls(batch=batch, q_len=q_len, num_q_heads=cfg.num_q_heads, num_kv_heads=1,
                   head_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, page_size=page_size,
                   pages_per_seq=pages_per_seq, num_layers=cfg.kv_layers, kv_tile_pages=kv_tile_pages,
                   kv_buffers=kv_buffers, dtype=cfg.dtype, latent=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim,
                   scale=float(yarn.softmax_scale(cfg.attention, cfg.positions)), kv_dtype=kv_dtype)

    @property
    def caches(self) -> int:
        return 1

    @property
    def heads_per_block(self) -> int:
        return 1

    @property
    def kv_layout(self) -> PagedLayout:
        """A quantized latent cache's layout: one token per row, its C + R codes then its
        exponent byte in the row's lane padding (`PagedLayout.group` says why)."""
        return PagedLayout(1, self.kv_size, 1, self.page_size, self.kv_dtype)

    @property
    def exponent_block(self) -> int:
        """A quantized cache: the first lane of the 128-lane tile that holds the exponent byte
        (lane kv_size); the stage reads that whole tile and picks the byte by lane."""
        return self.kv_size // LANE * LANE

    @property
    def page_lanes(self) -> int:
        """Lanes of a stored latent row: C + R rounded up to whole 128-lane tiles (pad lanes
        zero, `parts.latent_cache_lanes`), or a quantized cache's packed row."""
        return self.kv_layout.lanes if self.quantized else round_up(self.kv_size, LANE)

    @property
    def row_lanes(self) -> int:
        """Lanes of the stage's latent rows in VMEM (new rows, q rows, tiles): the stored row's
        (C + R then zero pad lanes, or a quantized cache's codes, exponent and padding), so rows
        and tiles line up."""
        return self.page_lanes

    def validate(self) -> None:
        def need(cond: bool, knob: str, expected: str) -> None:
            if not cond:
                raise PlanError(f"attention: {knob} = {getattr(self, knob)!r}: expected {expected}")

        for knob in ("batch", "q_len", "num_q_heads", "page_size", "pages_per_seq", "num_layers",
                     "kv_tile_pages", "kv_buffers", "latent", "rope"):
            v = getattr(self, knob)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, knob, "a positive integer")
        need(self.head_dim == self.latent + self.rope, "head_dim", f"latent + rope ({self.latent + self.rope})")
        need(self.dtype in WEIGHT_DTYPES, "dtype", f"one of {', '.join(WEIGHT_DTYPES)}")
        need(self.kv_dtype in ("",) + tuple(KV_FORMATS), "kv_dtype", f"'' (the model dtype) or one of {', '.join(KV_FORMATS)}")
        sub = SUBLANES[self.dtype]
        need(self.page_size % sub == 0, "page_size",
             f"a multiple of {sub} ({self.dtype} sublane tiling: pages are DMA'd whole into "
             f"tile-aligned VMEM rows)")
        need(self.kv_tile_pages <= self.pages_per_seq, "kv_tile_pages",
             f"at most pages_per_seq ({self.pages_per_seq})")
        need(self.kv_buffers >= 2, "kv_buffers", "at least 2 (one tile computed while the next loads)")

    def scratch(self) -> tuple[Buffer, ...]:
        """The MLA stage's scratch, in the order `mla_attention.MLAScratch` names it. Rows of
        `latent + rope` lanes are padded to whole 128-lane tiles in VMEM (Buffer.nbytes)."""
        dt, w, nb, s, p, r = self.cache_dtype, self.row_lanes, self.kv_buffers, self.tile_rows, self.page_size, self.q_rows
        return (
            vmem("tiles", (nb, s, w), dt, "streamed latent tiles: [slot, token of the tile, c_kv | k_rope "
                 "(a quantized cache: their codes, then the exponent byte)]"),
            vmem("patch", (self.patch_pages, p, w), dt,
                 "page of new token i of sequence b in slot b*q_len + i, then a read-only sink page"),
            vmem("new_rows", (self.staged_rows, w), "float32",
                 "this step's latent rows, one addressable at a time (quantized: codes, then the exponent byte)"),
            vmem("q_heads", (self.batch, r, w), "float32",
                 "[b, h*q_len + i]: q_lat | q_rope of head h, token i; then o_lat in the first latent lanes"),
            vmem("m", (r, LANE), "float32", "running max, lane-replicated"),
            vmem("l", (r, LANE), "float32", "running sum, lane-replicated"),
            vmem("acc", (r, self.latent), "float32", "running p . c_kv"),
            smem("seq_meta", (self.batch * (3 + self.q_len),), "int32",
                 "per sequence b at b*(3+q_len): end tile, npages, first tile, then the page of each new token"),
            dma_sems("tile_sems", (1, self.kv_buffers), "[latent, tile slot]"),
            dma_sems("patch_sems", (2, self.tokens), "[read | write, patch slot]"),
        )

    def temporaries_bytes(self) -> int:
        """Scores, exp and the cast probabilities [q_rows, S], the mask, and the masked value
        tile [S, latent] of one KV-tile step (an upper bound, as AttentionGeometry's)."""
        s, r, isz = self.tile_rows, self.q_rows, self.itemsize
        s_lanes = round_up(s, LANE)
        out = r * s_lanes * (4 + 4 + isz + 4) + round_up(s, SUBLANES[self.dtype]) * round_up(self.latent, LANE) * isz
        if self.quantized:  # the tile's codes in the model dtype, its exponent tile in f32 and as a scale row
            out += round_up(s, SUBLANES[self.dtype]) * self.page_lanes * isz + round_up(s, F32_SUBLANES) * LANE * 4 \
                + F32_SUBLANES * s_lanes * 4
        return out

    def smem_bytes(self) -> int:
        return 4 * self.batch * (3 + self.q_len)

    def dma_semaphores(self) -> int:
        return self.kv_buffers + 2 * self.tokens


# ---------------------------------------------------------------------- mixture of experts


@dataclass(frozen=True)
class MoEGeometry:
    """Static shape and knobs of the routed-expert stage (all Python ints: it shapes the trace)."""

    rows: int  # N = batch * q_len token rows routed together
    hidden: int  # the width the experts read and write: H, or Muse Spark's moe_hidden_size M
    num_experts: int  # E
    top_k: int
    expert_ffn: int  # Fe
    scoring: str  # "softmax" | "sigmoid"
    norm_topk: bool  # renormalise the top-k weights to sum to 1
    num_moe_layers: int  # Lm: MoE layers stacked in the packed expert arrays
    dtype: str  # weight dtype: "float32" | "bfloat16"
    expert_slots: int  # S: VMEM slots for expert chunks (loads in flight while one is computed)
    expert_chunk: int  # C: columns of Fe per chunk (multiple of 128 dividing Fe); Fe = whole experts
    # Many devices (tpumk.plan.sharding): this device owns experts [g * owned, (g+1) * owned) of
    # the E the router scores, g = (device id on mesh axis `axis`) // expert_tensor; only those
    # are packed here and streamed. 0 = all E (one device).
    owned_experts: int = 0
    expert_tensor: int = 1
    axis: str = "tp"
    # Quantized experts (tpumk.model.quantize EXPERT_FORMATS): codes of `code_dtype` with one
    # float32 scale per (128-row group, column); "none": the weight dtype, no scales.
    expert_format: str = "none"
    # mxfp4 / nvfp4 experts: TPU7x's Mosaic converts e2m1 codes (and nvfp4's e4m3 scales) to
    # float itself, so they stream as float4_e2m1fn (and float8_e4m3fn); elsewhere (v6e has no
    # 4-bit float type in Mosaic) the same nibbles stream as int4, the scale bytes as int8, and
    # the stage decodes them with integer ops (tpumk.kernel.moe). mxfp4's scales stream as their
    # E8M0 bytes (int8), one per 32 rows; nvfp4's as e4m3 bytes, one per 16 rows, and its
    # float32 global scales (one per expert matrix) come with the router, once per layer.
    fp4_native: bool = False
    # DeepSeek-V3 routing (tpumk.model.reference.route): group-limited top-k, a per-expert
    # correction bias for selection only (packed as row H of a float32 router, which
    # transformers keeps in float32), a factor on the weights.
    groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    scaling: float = 1.0
    router_float32: bool = False  # Mistral Large 4: a float32 router (and product) without a bias
    # Qwen2-MoE's shared-expert gate: its [H] weight is router column E (so Ep covers E + 1); the
    # stage leaves sigmoid(x . w) in the combine matrix's column E (`shared_gate_of`).
    shared_gate: bool = False
    # gpt-oss (tpumk.model.reference.moe_ffn): a router logit bias, packed as row H of the router
    # (in the weight dtype, one sublane tile); expert biases: each expert's gate|up bias as row 0
    # of one f32 (8, 256) tile per 128-column block, streamed with the chunk (`e_gateup_bias`),
    # and the down biases transposed [H, Ep] in the router's rows after it, applied once per
    # layer as combine @ bias; the clamped SwiGLU (swiglu_limit > 0, alpha).
    logit_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # Muse Spark (tpumk.model.spark): the router reads the hidden size H (`router_hidden`; 0: the
    # experts' width) while the experts run at moe_hidden_size (`hidden`); each expert's whole
    # output RMS-normalised without a weight before its routing weight, epsilon
    # `post_norm_eps` (expert_post_norm; 0: no norm).
    router_hidden: int = 0
    post_norm_eps: float = 0.0
    # A lane-padded copy (tpumk.plan.padding): the true moe_hidden_size its norms divide by; 0: hidden
    norm_width: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig, rows: int, expert_slots: int,
                    expert_chunk: int | None = None, owned_experts: int = 0,
                    expert_tensor: int = 1, expert_format: str = "none", fp4_native: bool = False,
                    norm_width: int = 0) -> "MoEGeometry":
        """The geometry of `cfg`'s MoE layers for `rows` token rows; chunk defaults to whole experts."""
        if not cfg.is_moe:
            raise PlanError(f"model '{cfg.name}' has no mixture-of-experts layers")
        geom = cls(
            rows=rows, hidden=cfg.moe.width(cfg.hidden_size), num_experts=cfg.num_experts, top_k=cfg.moe.top_k,
            expert_ffn=cfg.moe.expert_ffn_size, scoring=cfg.moe.router_scoring, norm_topk=cfg.moe.norm_topk_prob,
            num_moe_layers=len(moe_layer_ids(cfg)), dtype=cfg.dtype, expert_slots=expert_slots,
            expert_chunk=cfg.moe.expert_ffn_size if expert_chunk is None else expert_chunk,
            owned_experts=0 if owned_experts == cfg.num_experts else owned_experts, expert_tensor=expert_tensor,
            expert_format=expert_format, fp4_native=fp4_native,
            groups=cfg.moe.router_groups, topk_groups=cfg.moe.router_topk_groups, correction_bias=cfg.moe.router_correction_bias,
            router_float32=cfg.moe.router_float32,
            scaling=float(cfg.moe.routed_scaling_factor), shared_gate=cfg.moe.shared_expert_gate,
            logit_bias=cfg.moe.router_logit_bias, expert_bias=cfg.moe.expert_bias,
            swiglu_limit=float(cfg.moe.swiglu_limit), swiglu_alpha=float(cfg.moe.swiglu_alpha),
            router_hidden=cfg.hidden_size if cfg.moe.moe_hidden_size else 0,
            post_norm_eps=float(cfg.norms.post_eps) if cfg.moe.expert_post_norm else 0.0,
            norm_width=0 if norm_width == cfg.moe.width(cfg.hidden_size) else norm_width,
        )
        geom.validate()
        return geom

    def validate(self) -> None:
        """Raise PlanError (one line, naming the knob or field) if the kernel cannot be built."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise PlanError(f"moe stage: {what}")

        def pos_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0

        for f in ("rows", "hidden", "num_experts", "top_k", "expert_ffn", "num_moe_layers"):
            need(pos_int(getattr(self, f)), f"{f} = {getattr(self, f)!r}: expected a positive integer")
        need(self.top_k <= self.num_experts, f"top_k = {self.top_k}: expected at most num_experts ({self.num_experts})")
        need(self.scoring in SCORINGS, f"scoring = {self.scoring!r}: expected one of {', '.join(SCORINGS)}")
        need(isinstance(self.norm_topk, bool), f"norm_topk = {self.norm_topk!r}: expected true or false")
        need(self.dtype in DTYPE_BYTES, f"dtype = {self.dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
        # H is the lane dim of x and of the down chunks and the sublane dim of gate/up blocks.
        need(self.hidden % LANE == 0, f"hidden = {self.hidden}: expected a multiple of {LANE} (TPU lane tile)")
        need(self.expert_ffn % LANE == 0,
             f"expert_ffn = {self.expert_ffn}: expected a multiple of {LANE} (packed gate/up blocks are {LANE} wide)")
        need(pos_int(self.expert_slots), f"expert_slots = {self.expert_slots!r}: expected a positive integer")
        need(pos_int(self.expert_chunk) and self.expert_chunk % LANE == 0,
             f"expert_chunk = {self.expert_chunk!r}: expected a positive multiple of {LANE}")
        need(self.expert_ffn % self.expert_chunk == 0,
             f"expert_chunk = {self.expert_chunk}: expected a divisor of expert_ffn ({self.expert_ffn})")
        need(isinstance(self.owned_experts, int) and 0 <= self.owned_experts <= self.num_experts
             and (self.owned_experts == 0 or self.num_experts % self.owned_experts == 0),
             f"owned_experts = {self.owned_experts!r}: expected 0 (all) or a divisor of num_experts ({self.num_experts})")
        need(pos_int(self.expert_tensor), f"expert_tensor = {self.expert_tensor!r}: expected a positive integer")
        need(self.expert_format in ("none",) + EXPERT_FORMATS,
             f"expert_format = {self.expert_format!r}: expected none or one of {', '.join(EXPERT_FORMATS)}")
        need(isinstance(self.fp4_native, bool), f"fp4_native = {self.fp4_native!r}: expected true or false")
        # the kernel ranks groups pairwise (groups^2 row compares): keep it to what models use
        need(pos_int(self.groups) and self.groups <= MAX_ROUTER_GROUPS and self.num_experts % self.groups == 0
             and (self.groups == 1 or self.num_experts // self.groups >= 2),
             f"groups = {self.groups!r}: expected a divisor of num_experts ({self.num_experts}) at most "
             f"{MAX_ROUTER_GROUPS}, leaving at least 2 experts per group")
        need(pos_int(self.topk_groups) and self.topk_groups <= self.groups,
             f"topk_groups = {self.topk_groups!r}: expected 1..groups ({self.groups})")
        need(isinstance(self.correction_bias, bool), f"correction_bias = {self.correction_bias!r}: expected true or false")
        need(isinstance(self.scaling, float) and self.scaling > 0, f"scaling = {self.scaling!r}: expected a positive float")
        need(isinstance(self.shared_gate, bool) and not (self.shared_gate and self.correction_bias),
             f"shared_gate = {self.shared_gate!r}: expected true or false, false with a correction bias")
        need(isinstance(self.logit_bias, bool) and not (self.logit_bias and self.correction_bias),
             f"logit_bias = {self.logit_bias!r}: expected true or false, false with a correction bias")
        need(isinstance(self.expert_bias, bool), f"expert_bias = {self.expert_bias!r}: expected true or false")
        need(isinstance(self.swiglu_limit, float) and 0 <= self.swiglu_limit < math.inf,
             f"swiglu_limit = {self.swiglu_limit!r}: expected a non-negative finite float")
        need(isinstance(self.swiglu_alpha, float) and 0 < self.swiglu_alpha < math.inf,
             f"swiglu_alpha = {self.swiglu_alpha!r}: expected a positive finite float")
        need(isinstance(self.router_hidden, int) and self.router_hidden >= 0 and self.router_hidden % LANE == 0
             and not (self.router_hidden and self.expert_bias),
             f"router_hidden = {self.router_hidden!r}: expected 0 or a multiple of {LANE}, 0 with expert biases")
        need(isinstance(self.post_norm_eps, float) and 0 <= self.post_norm_eps < 1
             and not (self.post_norm_eps and (self.expert_bias or self.expert_tensor > 1)),
             f"post_norm_eps = {self.post_norm_eps!r}: expected 0 <= eps < 1, 0 with expert biases or an expert "
             "split over devices (its norm needs the whole output)")
        need(isinstance(self.norm_width, int) and 0 <= self.norm_width <= self.hidden,
             f"norm_width = {self.norm_width!r}: expected 0 (the experts' width) up to hidden ({self.hidden})")

    @property
    def local_experts(self) -> int:
        """Experts packed on (and streamed by) this device."""
        return self.owned_experts or self.num_experts

    @property
    def sharded(self) -> bool:
        return self.local_experts != self.num_experts

    # ---------------------------------------------------------------- derived shapes
    @property
    def experts_padded(self) -> int:
        """Ep: the expert axis padded to whole lanes (router columns, combine, id list), with
        room for the shared-expert gate's column E."""
        return round_up(self.num_experts + self.shared_gate, LANE)

    @property
    def chunks_per_expert(self) -> int:
        return self.expert_ffn // self.expert_chunk

    @property
    def blocks_per_chunk(self) -> int:
        """128-column gate|up blocks per chunk (each block is one [H, 256] MXU operand)."""
        return self.expert_chunk // LANE

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def jnp_dtype(self):
        return WEIGHT_DTYPES[self.dtype]

    @property
    def max_distinct_experts(self) -> int:
        return min(self.num_experts, self.rows * self.top_k)

    # ---------------------------------------------------------------- bytes and DMAs
    @property
    def quantized(self) -> bool:
        return self.expert_format != "none"

    @property
    def mx(self) -> bool:
        """Microscaled experts (mxfp4, nvfp4): e2m1 codes, 32- or 16-row groups of one-byte
        scales applied to the codes in VMEM before the matmul."""
        return self.quantized and FORMATS[self.expert_format].scale_dtype in ("e8m0", "e4m3")

    @property
    def nv(self) -> bool:
        """nvfp4 experts: e4m3 group scales and a float32 global scale per expert matrix."""
        return self.quantized and FORMATS[self.expert_format].global_scale

    @property
    def scale_group(self) -> int:
        """Input rows per expert scale (128, mxfp4's 32 or nvfp4's 16)."""
        return FORMATS[self.expert_format].group if self.quantized else GROUP

    @property
    def scale_dtype(self) -> str:
        """dtype of the packed expert scales: float32, or a microscaled format's scale bytes:
        nvfp4's as float8_e4m3fn where Mosaic converts them (TPU7x), else in an int8 container."""
        if self.nv and self.fp4_native:
            return "float8_e4m3fn"
        return "int8" if self.mx else "float32"

    @property
    def code_dtype(self) -> str:
        """dtype of the packed expert matrices: the weight dtype, or the format's codes."""
        if self.mx and not self.fp4_native:
            return "int4"  # the same nibbles (tpumk.kernel.moe decodes them)
        return FORMATS[self.expert_format].dtype if self.quantized else self.dtype

    @property
    def gateup_scale_rows(self) -> int:
        """Scale rows of one [H, 256] gate|up block: H / group rows, padded to the scale dtype's tile."""
        return round_up(self.hidden // self.scale_group, SUBLANES[self.scale_dtype])

    @property
    def down_scale_rows(self) -> int:
        """Scale rows of one down chunk [C, H]: C / 128 groups, padded to the f32 tile. mxfp4 /
        nvfp4: of one whole expert's down projection [Fe, H] (Fe / 32 or Fe / 16 rows, padded to
        the one-byte tile), loaded once per expert (`expert_scale_buffers`): a chunk's few rows
        would each fill a 32-row tile."""
        rows = self.expert_ffn if self.mx else self.expert_chunk
        return round_up(rows // self.scale_group, SUBLANES[self.scale_dtype])

    @property
    def expert_scale_buffers(self) -> int:
        """mxfp4: VMEM buffers of whole experts' down scales. Expert k's load starts with its
        first chunk, which can be S - 1 chunks ahead of the chunk being multiplied, so
        1 + ceil(S / chunks) buffers keep every expert's scales until its last chunk is done."""
        return 1 + -(-self.expert_slots // self.chunks_per_expert) if self.mx else 0

    @property
    def router_in(self) -> int:
        """The router's input width: H (the rows of its matrix)."""
        return self.router_hidden or self.hidden

    @property
    def router_dtype(self) -> str:
        return "float32" if self.correction_bias or self.router_float32 else self.dtype

    @property
    def bias_row(self) -> int:
        """The router's row holding the correction or logit bias: H (one sublane tile of rows
        after the matrix; 0 rows without a bias)."""
        return self.router_in

    @property
    def down_bias_row(self) -> int:
        """First of the H router rows holding the experts' down biases transposed ([H, Ep])."""
        with_bias = self.correction_bias or self.logit_bias
        return self.router_in + (SUBLANES[self.router_dtype] if with_bias else 0)

    @property
    def router_rows(self) -> int:
        """H, one sublane tile whose first row is the correction or logit bias when there is
        one, then the down biases' H rows with expert biases."""
        return self.down_bias_row + (self.hidden if self.expert_bias else 0)

    @property
    def router_bytes(self) -> int:
        """HBM bytes fetched once per layer: the router, and nvfp4's global scales with it."""
        return self.router_rows * self.experts_padded * DTYPE_BYTES[self.router_dtype] + self.global_bytes

    @property
    def global_bytes(self) -> int:
        """nvfp4: one layer's global scales, f32 [8, Ep] (rows gate, up, down by expert); else 0."""
        return F32_SUBLANES * self.experts_padded * 4 if self.nv else 0

    @property
    def slot_bytes(self) -> int:
        """HBM bytes of one slot's loads: a gate|up chunk [C/128, H, 256] plus a down chunk
        [C, H] (codes at their packed size) and, quantized, their scale tiles (mxfp4: the
        gate|up ones; the down scales load per expert)."""
        chunk = ("gateup", "down", "gateup_scales", "gateup_bias") + (() if self.mx else ("down_scales",))
        return sum(b.logical_bytes for b in self.scratch() if b.name in chunk) // self.expert_slots

    @property
    def expert_scale_bytes(self) -> int:
        """mxfp4: HBM bytes of one expert's down scales (loaded once per expert); else 0."""
        return self.down_scale_rows * self.hidden if self.mx else 0

    @property
    def expert_bytes(self) -> int:
        """HBM bytes of one expert (gate, up, down, and their scales when quantized)."""
        return self.chunks_per_expert * self.slot_bytes + self.expert_scale_bytes

    @property
    def chunk_bytes(self) -> float:
        """HBM bytes per chunk, on average: one slot's loads plus its share of the expert's
        per-expert loads (mxfp4's down scales)."""
        return self.expert_bytes / self.chunks_per_expert

    def hbm_bytes(self, distinct_experts: float) -> float:
        """HBM bytes this stage reads per MoE layer: the router plus each distinct expert once."""
        return self.router_bytes + distinct_experts * self.expert_bytes

    def dma_count(self, distinct_experts: float) -> float:
        """DMAs issued per MoE layer: router (and nvfp4's global scales), the ids VMEM->SMEM copy,
        2 per expert chunk (4 with scales; one more with expert biases), and mxfp4 / nvfp4's one
        down-scale load per expert."""
        return 2 + self.nv + (self.chunk_dmas * self.chunks_per_expert + bool(self.mx)) * distinct_experts

    @property
    def chunk_dmas(self) -> int:
        """DMAs of one chunk: gate|up, down, (quantized) their scales (mxfp4: gate|up's only),
        (expert_bias) gate|up biases."""
        return 2 + (1 if self.mx else 2) * self.quantized + self.expert_bias

    @property
    def bias_sem(self) -> int:
        """The slot semaphore row of the gate|up bias DMA (after the codes' and scales')."""
        return self.chunk_dmas - 1

    def expected_distinct_experts(self) -> float:
        """Expected distinct experts per layer this device streams under uniform routing of
        `rows` tokens (its owned share of the distinct experts picked)."""
        return expected_distinct_experts(self.num_experts, self.top_k, self.rows) * self.local_experts / self.num_experts

    def expected_hbm_bytes(self) -> float:
        return self.hbm_bytes(self.expected_distinct_experts())

    def scratch(self) -> tuple[Buffer, ...]:
        """Every scratch buffer of the stage, in the order the MoE stage takes their refs
        (`tpumk.kernel.moe.MoEScratch` names them the same way)."""
        h, ep, s, cd = self.hidden, self.experts_padded, self.expert_slots, self.code_dtype
        scales = (
            vmem("gateup_scales", (s, self.blocks_per_chunk, self.gateup_scale_rows, 2 * LANE), self.scale_dtype,
                 f"per slot: each gate|up block's scales, row g = input rows [{self.scale_group}g, ..+{self.scale_group})"),
            vmem("down_scales", (self.expert_scale_buffers or s, self.down_scale_rows, h), self.scale_dtype,
                 f"per expert buffer (mxfp4) or slot: the down scales, row g = rows [{self.scale_group}g, "
                 f"..+{self.scale_group}) of the expert (mxfp4) or chunk"),
        ) if self.quantized else ()
        if self.mx:
            scales += (dma_sems("expert_sems", (self.expert_scale_buffers,), "per expert buffer: its down-scale load"),
                       vmem("down_scales_f32", (self.down_scale_rows, h), "float32",
                            "the expert being multiplied: its down scales decoded once, at its first chunk"))
        if self.nv:
            scales += (vmem("global_scales", (F32_SUBLANES, ep), "float32",
                            "this layer's global scales: row 0 gate, 1 up, 2 down, lane = expert (owned index)"),)
        biases = (
            vmem("gateup_bias", (s, self.blocks_per_chunk, F32_SUBLANES, 2 * LANE), "float32",
                 "per slot: each gate|up block's biases in row 0"),
        ) if self.expert_bias else ()
        return (
            vmem("router", (self.router_rows, ep), self.router_dtype,
                 "this layer's router [H, Ep] (+ the correction or logit bias in row H, + the down biases "
                 "transposed)"),
            vmem("gateup", (s, self.blocks_per_chunk, h, 2 * LANE), cd,
                 "per slot: the chunk's 128-column blocks, gate lanes 0..127 | up lanes 128..255"),
            vmem("down", (s, self.expert_chunk, h), cd, "per slot: the chunk's down rows"),
            vmem("combine", (self.rows, ep), "float32", "combine weight of (row, expert), 0 where not picked"),
            vmem("ids_vmem", (2, ep), "int32", "row 0: distinct picked ids ascending; row 1: their count"),
            smem("ids_smem", (2, ep), "int32", "the same, read as scalars"),
            dma_sems("sems", (2 + self.nv,), "0 router, 1 ids VMEM->SMEM" + (", 2 global scales" if self.nv else "")),
            dma_sems("slot_sems", (self.chunk_dmas, s),
                     "[gate|up | down (| their scales) (| gate|up biases), slot]"),
        ) + scales + biases

    def packed(self) -> tuple[Buffer, ...]:
        """The HBM arrays of `tpumk.kernel.moe.pack_experts`, stacked over the MoE layers."""
        lm, h, fe, cd, e = self.num_moe_layers, self.hidden, self.expert_ffn, self.code_dtype, self.local_experts
        scales = (
            hbm("e_gateup_scales", (lm, e, fe // LANE, self.gateup_scale_rows, 2 * LANE), self.scale_dtype,
                f"[Lm, E (owned), Fe/128, H/{self.scale_group} groups (padded to the tile), gate 128 | up 128]"),
            hbm("e_down_scales", (lm, e, self.down_scale_rows, h), self.scale_dtype,
                f"[Lm, E (owned), Fe/{self.scale_group} groups (padded to the tile), H]") if self.mx else
            hbm("e_down_scales", (lm, e, self.chunks_per_expert, self.down_scale_rows, h), self.scale_dtype,
                f"[Lm, E (owned), chunk, C/{self.scale_group} groups (padded to the tile), H]"),
        ) if self.quantized else ()
        if self.nv:
            scales += (hbm("e_global_scales", (lm, F32_SUBLANES, self.experts_padded), "float32",
                           "[Lm, rows gate | up | down (5 zero rows), Ep: owned expert, zero past them]"),)
        biases = (
            hbm("e_gateup_bias", (lm, e, fe // LANE, F32_SUBLANES, 2 * LANE), "float32",
                "[Lm, E (owned), Fe/128, row 0: gate 128 | up 128 biases]"),
        ) if self.expert_bias else ()
        return (
            hbm("router", (lm, self.router_rows, self.experts_padded), self.router_dtype,
                "[Lm, H (+ a tile: bias in row H) (+ H: down biases transposed), Ep], columns E..Ep-1 zero"),
            hbm("e_gateup", (lm, e, fe // LANE, h, 2 * LANE), cd, "[Lm, E (owned), Fe/128, H, gate 128 | up 128]"),
            hbm("e_down", (lm, e, fe, h), cd, "[Lm, E (owned), Fe, H]"),
        ) + scales + biases

    def scratch_bytes(self) -> int:
        """Exact VMEM bytes of the stage's scratch buffers (rows padded to the sublane tile):
        expert_slots * chunk_bytes + router_bytes + round_up(N, 8) * Ep * 4 (combine)
        + 8 * Ep * 4 (the [2, Ep] int32 id list fills one (8, 128) tile row-group)."""
        return sum(b.nbytes for b in self.scratch() if b.space == "vmem")

    def vmem_bytes(self) -> int:
        """Scratch plus the largest compiler temporaries, an estimate for the VMEM budget.

        Temporaries: the routing matrices ([Ep, Ep] f32: strict-lower and identity masks, the
        broadcast picked row and the two products), one chunk's gate|up activations
        [N, 2C] f32 and SwiGLU output [N, C] f32, x in the weight dtype and the f32 accumulator
        and down product [N, H]. mxfp4 / nvfp4: one 128-row group's decoded codes [128, max(256, H)]
        as f32 and in the weight dtype, and a block's decoded scales [H/32 (H/16) rows, 256] f32."""
        ep, n = self.experts_padded, round_up(self.rows, F32_SUBLANES)
        routing = 5 * ep * ep * 4
        chunk = n * 3 * self.expert_chunk * 4
        rows = n * self.hidden * (4 + 4 + 4)
        mx = 0
        if self.mx:
            mx = GROUP * max(2 * LANE, self.hidden) * (4 + self.dtype_bytes) \
                + max(self.gateup_scale_rows * 2 * LANE, self.down_scale_rows * self.hidden) * 4
        return self.scratch_bytes() + routing + chunk + rows + mx

    def smem_bytes(self) -> int:
        return 2 * self.experts_padded * 4


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    """Model layer indices of the MoE layers, in the order they are stacked by `pack_experts`."""
    return [i for i in range(cfg.num_layers) if not cfg.pattern.is_dense(i)]


# ---------------------------------------------------------------------- collectives
ALL_REDUCE_SCHEDULES = ("direct", "doubling", "rsag", "hierarchical")
# Chips whose devices are TensorCores in pairs on one chip (devices 2r and 2r + 1 of a mesh share
# chip r, TPU_FACTS 8): the chip-hierarchical all-reduce needs that pairing.
PAIRED_CORE_CHIPS = ("7x",)
# The geometry's own auto all-reduce (no model at hand): a direct push (one round) while each
# device sends at most this many bytes, else reduce-scatter + all-gather (two rounds, about
# 2 / N of the bytes). The break-even is one remote round's latency times the cross-chip
# bandwidth: 2.2 us x 134 GB/s = 295 KB with the published TPU7x figures
# (tpumk.estimate.interconnect); rounded down to 256 KiB. It ignores hops, so a build's plan
# (`tpumk.plan.plan.all_reduce_geometry`) decides by the interconnect model instead, this rule
# breaking its ties.
DIRECT_ALL_REDUCE_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class AllReduceGeometry:
    """Static shape of the in-kernel all-reduce (`tpumk.kernel.collectives.all_reduce`).

    devices: N, the size of the 1-D mesh axis `axis` the kernel's devices are numbered along
        (device id = `lax.axis_index(axis)`, remote DMAs addressed as MESH ids `(peer,)`).
    rows, width: the [rows, width] f32 partial sums each device holds: rows are the step's
        token rows, NOT padded to the sublane tile (a batch-1 step moves one row per chunk, not
        eight: Mosaic tiles a slot of fewer rows more finely and accepts the DMA; compiled for
        TPU7x / v6e / v5e / v5p in tests/test_multidevice.py), width a multiple of 128 lanes.
    dtype: what travels and is stored in the receive slots: "float32" (exact partial sums) or
        "bfloat16" (half the bytes; each slot is rounded to bf16 before the f32 sum, and with
        rsag each summed chunk again before the all-gather, its owner using the rounded copy
        too: every device still holds the same bits).
    schedule: "direct" (every device pushes its partial to every peer: one round, peers at
        every offset 1..N-1) or "doubling" (recursive-doubling all-gather with XOR partners: log2 N
        rounds, every offset a power of two, as TPU v5e's routing needs; N a power of two).
        Both move the same bytes and sum the same N slots in the same order 0..N-1, so their
        results are bit-identical to each other and across devices.
        "rsag": reduce-scatter then all-gather, both direct pushes. The width is cut into N
        chunks of `chunk` lanes; device c receives every device's chunk c, sums the N of them
        in order 0..N-1, and pushes the sum to every peer. Two dependent rounds, but each
        device sends 2 (N-1) chunks (2 (N-1) / N of a slot) instead of N-1 slots: the choice
        once N > 2 and bytes matter. Each chunk is summed by one device, in a fixed order, and
        copied: every device holds the same bits, and the same bits as the other schedules
        (each element is the same N numbers added in the same order 0..N-1).
        "hierarchical" (TPU7x, N even >= 4: devices 2r and 2r + 1 are chip r's TensorCores):
        rsag in two levels, the sibling first. Device d = 2r + b owns chunk d, as with rsag;
        the chunks of parity b form its half. Round 0: each device pushes its sibling's half to
        the sibling (on chip) and adds the sibling's copy of its own half: chip sums. Round 1:
        chip sum m of its half goes to device 2m + b (the same-parity core of chip m), which
        adds the N / 2 chip sums in chip order. Round 2: that total goes to the other N / 2 - 1
        same-parity cores; round 3: the whole half to the sibling. The same 2 (N-1) chunks
        leave each device as with rsag, but half of them stay on chip, so the cross-chip links
        carry 2 (N / 2 - 1) chunks instead of 2 (N - 2); four dependent rounds instead of two.
        Each chunk is still summed by one device in a fixed order and copied (every device holds
        the same bits), but the order is chip pairs first ((x0 + x1) + (x2 + x3) + ...), so its
        bits differ from the other schedules'.
    """

    devices: int
    rows: int
    width: int
    dtype: str = "float32"
    schedule: str = "direct"
    axis: str = "tp"

    @classmethod
    def for_chip(cls, chip: str, devices: int, rows: int, width: int, dtype: str = "float32",
                 axis: str = "tp", schedule: str = "auto") -> "AllReduceGeometry":
        """The geometry with `schedule` ("auto": the one the chip routes best). v5e reaches only
        power-of-two device offsets, so it gets recursive doubling once N > 2. Other chips
        route any offset: the direct push while the N-1 slots it sends are at most
        DIRECT_ALL_REDUCE_MAX_BYTES (one round; 2 devices always: the same bytes either way),
        else reduce-scatter + all-gather (two rounds, 2 (N-1) / N of a slot sent). (A build's
        plan, `tpumk.plan.plan.all_reduce_geometry`, takes whichever routable schedule tpumk's
        interconnect model costs least, this rule breaking ties.)"""
        pow2_only = chip == "v5e" and devices > 2
        if schedule == "auto":
            # Weighed at float32 whatever the wire: a bfloat16 wire halves both schedules' bytes,
            # and counting it here would turn 32 devices back to the 31-push direct round
            # (qwen3-235b-a22b on 32 TPU7x: 1.54 ms of collectives per step against rsag's 0.92
            # by tpumk's timeline model).
            direct_bytes = (devices - 1) * rows * width * 4
            schedule = ("doubling" if pow2_only else
                        "direct" if devices <= 2 or direct_bytes <= DIRECT_ALL_REDUCE_MAX_BYTES else "rsag")
        elif pow2_only and schedule != "doubling":
            raise PlanError(f"tuning: 'all_reduce' = {schedule}: {chip} routes remote DMAs only to power-of-two "
                            f"device offsets; {devices} devices need 'doubling' (or auto)")
        elif schedule == "hierarchical" and not cls.pairs_cores(chip, devices):
            raise PlanError(f"tuning: 'all_reduce' = hierarchical: needs an even number of devices, at least 4, "
                            f"on a chip with two TensorCores ({', '.join(PAIRED_CORE_CHIPS)}); {chip} with "
                            f"{devices} devices has no sibling pairs")
        geom = cls(devices, rows, width, dtype, schedule, axis)
        geom.validate()
        return geom

    @staticmethod
    def pairs_cores(chip: str, devices: int) -> bool:
        """Whether `devices` mesh devices of `chip` form whole sibling pairs, at least two chips:
        what the hierarchical schedule needs."""
        return chip in PAIRED_CORE_CHIPS and devices >= 4 and devices % 2 == 0

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise PlanError(f"all-reduce: {what}")

        for f in ("devices", "rows", "width"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{f} = {v!r}: expected a positive integer")
        need(self.dtype in WEIGHT_DTYPES, f"dtype = {self.dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
        need(self.schedule in ALL_REDUCE_SCHEDULES,
             f"schedule = {self.schedule!r}: expected one of {', '.join(ALL_REDUCE_SCHEDULES)}")
        need(self.width % LANE == 0, f"width = {self.width}: expected a multiple of {LANE} (lane tile)")
        if self.schedule == "doubling":
            need(self.devices & (self.devices - 1) == 0,
                 f"devices = {self.devices}: recursive doubling needs a power of two")
        if self.schedule == "hierarchical":
            need(self.devices >= 4 and self.devices % 2 == 0,
                 f"devices = {self.devices}: the hierarchical schedule needs sibling pairs on at least 2 chips "
                 f"(an even count >= 4)")
        need(isinstance(self.axis, str) and bool(self.axis), f"axis = {self.axis!r}: expected a mesh axis name")

    @property
    def stages(self) -> int:
        """Dependent rounds of one call: 1 (direct), 2 (rsag), 4 (hierarchical) or log2 N (doubling)."""
        if self.schedule == "doubling":
            return max(1, (self.devices - 1).bit_length())
        return {"rsag": 2, "hierarchical": 4}.get(self.schedule, 1)

    @property
    def chunked(self) -> bool:
        """Whether the schedule cuts the width into N chunks, one summed by each device."""
        return self.schedule in ("rsag", "hierarchical")

    @property
    def chips(self) -> int:
        """hierarchical: the chips of the mesh (N / 2 sibling pairs)."""
        return self.devices // 2

    @property
    def chunk(self) -> int:
        """rsag / hierarchical: lanes of one chunk (the width split N ways, rounded up to whole lanes)."""
        return round_up(-(-self.width // self.devices), LANE) if self.chunked else self.width

    @property
    def padded_width(self) -> int:
        """Width of the partial sums `all_reduce` takes and returns: N whole chunks for rsag and
        hierarchical (the pad columns must be zero), the width itself otherwise."""
        return self.devices * self.chunk if self.chunked else self.width

    @property
    def slot_bytes(self) -> int:
        return self.rows * self.width * DTYPE_BYTES[self.dtype]

    @property
    def chunk_bytes(self) -> int:
        return self.rows * self.chunk * DTYPE_BYTES[self.dtype]

    @property
    def send_bytes(self) -> int:
        """Bytes each device sends (and receives) per call: N-1 slots (direct, doubling), or
        2 (N-1) chunks (rsag, hierarchical: N of them to the sibling)."""
        if self.chunked:
            return 2 * (self.devices - 1) * self.chunk_bytes
        return (self.devices - 1) * self.slot_bytes

    @property
    def messages(self) -> int:
        """Remote DMAs each device starts per call: N-1 (direct), 2 (N-1) (rsag), N (hierarchical:
        one to the sibling and N/2 - 1 across chips, twice) or log2 N (doubling)."""
        if self.schedule == "rsag":
            return 2 * (self.devices - 1)
        if self.schedule == "hierarchical":
            return self.devices
        return self.devices - 1 if self.schedule == "direct" else self.stages

    @property
    def gather_stages(self) -> int:
        """Rounds of `all_gather_slices` (the logits): 1 (a direct push to every peer) or log2 N
        (recursive doubling, where only power-of-two offsets route)."""
        return self.stages if self.schedule == "doubling" else 1

    def gather_offsets(self) -> tuple[int, ...]:
        """Device offsets `all_gather_slices` pushes to: every peer, or 2^s (XOR) for doubling."""
        if self.devices == 1:
            return ()
        return self.peer_offsets() if self.schedule == "doubling" else tuple(range(1, self.devices))

    def peer_offsets(self) -> tuple[int, ...]:
        """Device-id offsets (mod N) the schedule sends to: direct 1..N-1; doubling 2^s (XOR)."""
        if self.devices == 1:
            return ()
        if self.schedule != "doubling":  # hierarchical: its peers (the sibling, the same-parity
            return tuple(range(1, self.devices))  # cores) are not one offset set; the barrier takes all
        return tuple(1 << s for s in range(self.stages))

    def scratch(self) -> tuple[Buffer, ...]:
        """The stage's scratch, in the order `all_reduce` takes the refs
        (`tpumk.kernel.collectives.AllReduceScratch`)."""
        n, st = self.devices, self.stages
        step = "round" if self.chunked else "stage"
        sems = (dma_sems("recv_sems", (2, st), f"[parity, {step}]: arrivals into this device's slots"),
                dma_sems("send_sems", (2, st), f"[parity, {step}]: this device's outgoing pushes"))
        if not self.chunked:
            return (vmem("slots", (2, n, self.rows, self.width), self.dtype,
                         "[parity of the collective counter, source device, rows, lanes]: device d's partial in "
                         "slot d"),) + sems
        if self.schedule == "rsag":
            slots = vmem("slots", (2, 2, n, self.rows, self.chunk), self.dtype,
                         "[parity, round (0 reduce-scatter, 1 all-gather), source device, rows, chunk lanes]")
            order = "[chunk, rows, chunk lanes]: this device's partial cut into chunks, the pushes' sources"
        else:
            slots = vmem("slots", (2, 4, self.chips, self.rows, self.chunk), self.dtype,
                         "[parity, round (0 the sibling's copy of my half, then my chip sums; 1 chip sums by "
                         "source chip; 2 totals of my half by chip; 3 the sibling's totals), chip, rows, chunk lanes]")
            order = ("[half * N/2 + chip, rows, chunk lanes]: this device's partial cut into chunks, chunk "
                     "2 m + h at h * N/2 + m (each half contiguous: one DMA to the sibling)")
        return (slots,) + sems + (vmem("staging", (n, self.rows, self.chunk), self.dtype, order),)

    def scratch_bytes(self) -> int:
        """VMEM of the scratch: 2 * N * rows * width * itemsize (whole tiles by validation);
        rsag: 5 * N * rows * chunk * itemsize (two rounds' slots per parity, one staging);
        hierarchical: the same (four rounds of N/2 chunks per parity, one staging)."""
        return sum(b.nbytes for b in self.scratch() if b.space == "vmem")

    def dma_semaphores(self) -> int:
        return 4 * self.stages


# Lanes of the glue's per-row query factor (position-scaled queries): one lane tile, the factor
# in every lane, so the kernel reads it as whole tiles and broadcasts lane 0.
QUERY_SCALE_LANES = LANE


def rope_table_lanes(cfg: ModelConfig) -> int:
    """Lanes of the cos / sin rows the glue passes: one head (two 64-wide heads), or for MLA
    one lane tile of R-wide rotations (`tpumk.kernel.megakernel`)."""
    return LANE if cfg.is_mla else cfg.head_dim * heads_per_lane_block(cfg.head_dim)


# ---------------------------------------------------------------------- linear attention
# A linear layer's rows of the layer vector block (the attention rows it does not use): the
# gated norm's weight, the decay row (A_log per value head from lane 0; dt_bias from lane 128,
# per value head (Gated DeltaNet) or per key channel of each head (KDA)), then the
# convolution's taps, one row each (at most LINEAR_MAX_TAPS).
LINEAR_ROW = {"norm": 2, "decay": 3, "taps": 4}
LINEAR_MAX_TAPS = LAYER_VECTOR_ROWS - LINEAR_ROW["taps"]


@dataclass(frozen=True)
class LinearGeometry:
    """Static facts of the linear-attention stage (`tpumk.kernel.linear_attention`) on one
    device: its heads (on many devices, this device's share) and widths, the pool of
    per-sequence states it reads and writes, and where each part of the in-projection's output
    (`lin_in`, the ring family) sits in the `lin_proj` scratch row.

    Every step leaves its own tokens pending (`pending` = q_len rows per slot,
    tpumk.model.linear_attention): the state written back is the one before them, so a verify
    step is rolled back by setting a count."""

    kind: str  # "gated_delta" | "kda"
    batch: int
    q_len: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    taps: int
    num_layers: int  # linear layers (the pool's first axis)
    num_slots: int
    dtype: str  # the model dtype (what the convolution rounds to)
    eps: float  # the gated norm's epsilon

    @classmethod
    def from_config(cls, cfg: ModelConfig, batch: int, q_len: int, num_slots: int = 0) -> "LinearGeometry":
        lin = cfg.linear
        return cls(lin.linear_kind, batch, q_len, lin.linear_key_heads, lin.linear_value_heads, lin.linear_key_dim,
                   lin.linear_value_dim, lin.linear_conv, len(cfg.linear_layers), num_slots or batch, cfg.dtype,
                   cfg.norms.rms_eps)

    # ------------------------------------------------------------------ sizes
    @property
    def key_size(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def value_size(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_size + self.value_size

    @property
    def group(self) -> int:
        return self.value_heads // self.key_heads

    @property
    def pending(self) -> int:
        """Pending rows per slot: the step's own tokens."""
        return self.q_len

    @property
    def rows(self) -> int:
        return self.batch * self.q_len

    @property
    def padded_rows(self) -> int:
        return round_up(self.rows, F32_SUBLANES)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_dim, self.value_dim)

    @property
    def decay_width(self) -> int:
        return self.value_heads * (self.key_dim if self.kind == "kda" else 1)

    @property
    def pending_offsets(self) -> tuple[int, int, int]:
        """(b, second gate input, width) of a pending row (`linear_attention.pending_offsets`)."""
        b = round_up(self.conv_dim, LANE)
        second = b + round_up(self.value_heads, LANE)
        return b, second, second + round_up(self.value_heads if self.kind == "gated_delta" else self.decay_width,
                                            LANE) + LANE

    @property
    def proj_offsets(self) -> dict[str, int]:
        """Where each part of `lin_in`'s output starts in a `lin_proj` row (lane-tile aligned):
        q | k | v from 0, b, then Gated DeltaNet's a and z, or KDA's f_a and g_a (the low-rank
        gates' first halves); "width": the row's lanes. Up to the second gate input it is the
        pending row's layout, so a Gated DeltaNet token's pending row is its lin_proj row."""
        b, second, _ = self.pending_offsets
        if self.kind == "gated_delta":
            third = second + round_up(self.value_heads, LANE)
            return {"conv": 0, "b": b, "a": second, "z": third, "width": third + round_up(self.value_size, LANE)}
        third = second + round_up(self.key_dim, LANE)
        return {"conv": 0, "b": b, "f_a": second, "g_a": third, "width": third + round_up(self.key_dim, LANE)}

    @property
    def state_bytes(self) -> int:
        """One slot's recurrent state in one layer, float32."""
        return 4 * math.prod(self.state_shape)

    @property
    def window_bytes(self) -> int:
        return 4 * (self.taps - 1) * self.conv_dim

    @property
    def pending_bytes(self) -> int:
        return 4 * self.pending * self.pending_offsets[2]

    @property
    def slot_bytes(self) -> int:
        """One slot's pool entry in one layer: state, window and pending rows."""
        return self.state_bytes + self.window_bytes + self.pending_bytes

    @property
    def resident_bytes(self) -> int:
        """The whole pool in HBM: every slot's entry in every linear layer (this device's share)."""
        return self.num_layers * self.num_slots * self.slot_bytes

    def hbm_bytes(self) -> dict[str, int]:
        """Pool bytes one step reads and writes, every sequence's slot entry read and written in
        every linear layer: "linear_states" the recurrent states, "linear_windows" the
        convolution windows and pending rows."""
        n = 2 * self.num_layers * self.batch
        return {"linear_states": n * self.state_bytes, "linear_windows": n * (self.window_bytes + self.pending_bytes)}

    def pool_shapes(self) -> dict[str, tuple[int, ...]]:
        """The pool's arrays as the reference lays them out (tpumk.model.linear_attention)."""
        n, s = self.num_layers, self.num_slots
        return {"recurrent": (n, s, *self.state_shape), "conv": (n, s, self.taps - 1, self.conv_dim),
                "pending": (n, s, self.pending, self.pending_offsets[2])}

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, what: str, expected: str) -> None:
            if not cond:
                raise PlanError(f"linear attention: {what} = {getattr(self, what)!r}: expected {expected}")

        need(self.kind in ("gated_delta", "kda"), "kind", "gated_delta or kda")
        for what in ("key_dim", "value_dim"):
            need(getattr(self, what) % LANE == 0, what,
                 f"a multiple of {LANE} (the kernel keeps a linear head on whole lane tiles)")
        need(2 <= self.taps <= LINEAR_MAX_TAPS, "taps", f"2 to {LINEAR_MAX_TAPS} convolution taps (one "
             "layer-vector row each)")
        need(self.value_heads <= LANE, "value_heads", f"at most {LANE} per device (one lane each in the gate rows)")

    # ------------------------------------------------------------------ kernel memory
    def scratch(self) -> tuple[Buffer, ...]:
        """The stage's scratch, in the order `tpumk.kernel.linear_attention.LinearScratch` names it."""
        # buffers the stage reads one token row at a time have whole 8-row tiles (Mosaic proves
        # a traced row's alignment only on (8, 128) tiles; it stores only to static rows, so the
        # outputs go by sequence, a leading index); the ring's inputs have N rows
        n, n8, w = self.rows, self.padded_rows, self.pending_offsets[2]
        out = [
            vmem("proj", (n8, self.proj_offsets["width"]), "float32",
                 "[N (| pad), lin_in's output: q | k | v, b, then a | z (Gated DeltaNet) or f_a | g_a (KDA)]"),
            vmem("o", (self.batch, round_up(self.q_len, F32_SUBLANES), self.value_size), "float32",
                 "[sequence, token (| pad), value heads' outputs]: a traced sequence's rows"),
            vmem("y", (n, self.value_size), "float32", "[N, the outputs normed and gated]: lin_out's input"),
        ]
        if self.kind == "kda":
            out += [vmem("low", (n, round_up(self.key_dim, LANE)), "float32", "[N, f_a or g_a]: a low-rank matmul's input"),
                    vmem("f", (n8, self.value_size), "float32", "[N (| pad), forget-gate projection f per key channel]"),
                    vmem("g", (n, self.value_size), "float32", "[N, output-gate projection per value lane]")]
        out += [
            vmem("state", (2, *self.state_shape), "float32", "[sequence % 2, value head, key, value]: its slot's state"),
            vmem("work", self.state_shape, "float32", "the state as the step's own tokens move it (never written back)"),
            vmem("window", (2, self.taps - 1, self.conv_dim), "float32",
                 "[sequence % 2, tap, C]: its convolution window, oldest first"),
            vmem("pend_in", (2, self.pending, w), "float32", "[sequence % 2, row, pending row]: rows to replay"),
            vmem("pend_out", (2, self.pending, w), "float32", "[sequence % 2, row, pending row]: this step's rows"),
            dma_sems("in_sems", (2, 3), "[sequence % 2, state | window | pending] reads"),
            dma_sems("out_sems", (2, 3), "[sequence % 2, state | window | pending] writes"),
        ]
        return tuple(out)


# ---------------------------------------------------------------------- sparse attention


@dataclass(frozen=True)
class SparseGeometry:
    """DeepSeek Sparse Attention in the megakernel (`tpumk.kernel.sparse_attention`): the lightning
    indexer of every MLA layer (its q / k projections stream through the ring as the families
    idx_q, idx_k; its float32 weights_proj and the key LayerNorm's weight and bias come per layer
    by DMA), the index-key cache (a second paged cache, [layers, num_pages, page_size,
    index_head_dim] in the model dtype, as `reference.KVCache.index_keys`), each query's top-k
    selection in the kernel, and the latent rows of the selected tokens gathered by DMA.

    The gather moves whole blocks of `block_rows` rows (one sublane tile: 8 float32 rows, 16
    bfloat16) of a page, each block holding a selected token once: Mosaic refuses DMAs whose
    offset along the tiled (token) dimension is not a whole tile (TPU_FACTS 4), so a single row
    cannot be moved alone; the block's unselected rows are masked out of the softmax.
    `gather_tokens` blocks are gathered per step of the attention loop, through a ring of
    `gather_slots` slots (one computed while the next steps' DMAs fly)."""

    batch: int
    q_len: int
    hidden: int
    q_lora: int  # q_a's lane-padded width: idx_q's input
    index_heads: int
    index_head_dim: int
    rope: int
    topk: int
    page_size: int
    pages_per_seq: int
    num_layers: int  # layers with an indexer (the index-key cache's layers)
    dtype: str
    latent_lanes: int  # a stored latent row's lanes (MLAGeometry.page_lanes)
    interleave: bool = False
    mla_layers: int = 0  # every MLA layer gathers (a layer of index_shared_layers the previous layer's picks)
    q_hidden: bool = False  # index_q_hidden (Mistral Large 4): idx_q projects LayerNorm(x), q_lora is H
    log_scale: bool = False  # query_log_scale (Mistral Large 4): the queries x (s_h ln(1 + p) + b_h) per head
    select_chunk: int = 0  # positions per pass of the top-k search (select_lanes); 0: auto
    gather_step: int = 0  # blocks per gather step (gather_tokens); 0: auto (GATHER_ROWS rows)
    gather_slots: int = 0  # the gather ring's slots; 0: GATHER_SLOTS

    @classmethod
    def for_model(cls, cfg: ModelConfig, batch: int, q_len: int, page_size: int, pages_per_seq: int,
                  latent_lanes: int) -> "SparseGeometry":
        a = cfg.attention
        q_in = round_up(cfg.hidden_size, LANE) if a.index_q_hidden else mla_dims(cfg)["q_lora"]
        return cls(batch=batch, q_len=q_len, hidden=cfg.hidden_size, q_lora=q_in, q_hidden=a.index_q_hidden,
                   log_scale=a.query_log_scale,
                   index_heads=a.index_heads, index_head_dim=a.index_head_dim, rope=cfg.qk_rope_head_dim,
                   topk=a.index_topk, page_size=page_size, pages_per_seq=pages_per_seq,
                   num_layers=len(cfg.indexer_layers), dtype=cfg.dtype, latent_lanes=latent_lanes,
                   interleave=a.index_rope_interleave, mla_layers=cfg.kv_layers)

    # ---- derived sizes
    @property
    def tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_size

    @property
    def key_lanes(self) -> int:
        return round_up(self.index_head_dim, LANE)

    @property
    def norm_lanes(self) -> int:
        """The per-layer vector rows' lanes (`idx_norm`): rows 0, 1 the key LayerNorm's weight and
        bias (Di lanes); with log_scale rows 2, 3 the per-head query scale and bias (Hi lanes);
        with q_hidden rows 4, 5 the query input LayerNorm's weight and bias (H lanes)."""
        return max(self.key_lanes, self.weight_lanes if self.log_scale else 0,
                   round_up(self.hidden, LANE) if self.q_hidden else 0)

    @property
    def q_cols(self) -> int:
        """idx_q's output lanes: every head's index_head_dim lanes side by side, lane padded."""
        return round_up(self.index_heads * self.index_head_dim, LANE)

    @property
    def weight_lanes(self) -> int:
        return round_up(self.index_heads, LANE)

    @property
    def head_rows(self) -> int:
        """Rows of one sequence's index queries, head-major (row h * q_len + i), sublane padded."""
        return round_up(self.index_heads * self.q_len, F32_SUBLANES)

    @property
    def query_rows(self) -> int:
        return round_up(self.q_len, F32_SUBLANES)

    @property
    def score_lanes(self) -> int:
        return round_up(self.capacity, LANE)

    @property
    def select_lanes(self) -> int:
        """Positions the top-k search compares and counts at once: the score lanes in chunks of
        at most SELECT_LANES (the largest whole number of 128-lane blocks dividing them), so the
        passes' temporaries stay [query rows, select_lanes] at any context; `select_chunk`
        fixes it (a divisor of score_lanes, whole lanes)."""
        if self.select_chunk:
            return self.select_chunk
        blocks = self.score_lanes // LANE
        return LANE * max(k for k in range(1, min(blocks, SELECT_LANES // LANE) + 1) if blocks % k == 0)

    @property
    def tile_pages(self) -> int:
        """Pages per index-key tile: the largest count dividing pages_per_seq whose rows are a
        whole number of 128-lane score blocks (scores are stored at lane offset tile x rows),
        at most INDEX_TILE_ROWS rows; a whole sequence when it is one tile."""
        if self.capacity <= INDEX_TILE_ROWS:
            return self.pages_per_seq
        best = 0
        for k in range(1, self.pages_per_seq + 1):
            rows = k * self.page_size
            if self.pages_per_seq % k == 0 and rows % LANE == 0 and rows <= INDEX_TILE_ROWS:
                best = k
        return best

    @property
    def tile_rows(self) -> int:
        return self.tile_pages * self.page_size

    @property
    def block_rows(self) -> int:
        return SUBLANES[self.dtype]

    @property
    def selected(self) -> int:
        """Most blocks one sequence's gather moves: its queries' picks (the union of their top-k)
        lie in at most this many distinct blocks."""
        return min(self.q_len * self.topk, -(-self.capacity // self.block_rows))

    @property
    def gather_tokens(self) -> int:
        return max(1, min(self.gather_step or GATHER_ROWS // self.block_rows, self.selected))

    @property
    def ring_slots(self) -> int:
        """Gather steps in the ring: this one computed while the next ring_slots - 1 steps'
        block DMAs fly."""
        return self.gather_slots or GATHER_SLOTS

    @property
    def gather_rows(self) -> int:
        return self.gather_tokens * self.block_rows

    @property
    def patch_pages(self) -> int:
        return self.tokens + 1  # one per new token, then the read-only sink page (as MLAGeometry's)

    @property
    def jnp_dtype(self):
        return WEIGHT_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def key_row_bytes(self) -> int:
        return self.index_head_dim * self.itemsize

    def validate(self) -> None:
        def need(cond: bool, what: str, expected: str) -> None:
            if not cond:
                raise PlanError(f"sparse attention: {what}: expected {expected}")

        d, r = self.index_head_dim, self.rope
        need(d % r == 0 and (LANE % d == 0 or d % LANE == 0), f"index_head_dim = {d}",
             f"a multiple of qk_rope_head_dim ({r}) that divides {LANE} or is a multiple of it (heads are "
             "roped inside lane tiles)")
        need(self.tile_pages > 0, f"page_size = {self.page_size} x pages_per_seq = {self.pages_per_seq}",
             f"a context whose pages make whole {LANE}-token score blocks of at most {INDEX_TILE_ROWS} tokens")
        need(self.page_size % self.block_rows == 0, f"page_size = {self.page_size}",
             f"a multiple of {self.block_rows} (the gathered blocks)")
        need(self.ring_slots >= 2, f"gather_slots = {self.ring_slots}", "at least 2")
        c = self.select_lanes
        need(c > 0 and c % LANE == 0 and self.score_lanes % c == 0, f"select_chunk = {c}",
             f"a multiple of {LANE} dividing the {self.score_lanes} score lanes")

    def scratch(self) -> tuple[Buffer, ...]:
        """The sparse stage's scratch, in the order `tpumk.kernel.sparse_attention.SparseScratch`
        names it."""
        dt, n, p = self.dtype, round_up(self.tokens, F32_SUBLANES), self.page_size
        return (
            vmem("idx_q", (n, self.q_cols), "float32", "[N, head h's index query at lanes h*Di ..] (roped in place)"),
            vmem("idx_k", (n, self.key_lanes), "float32", "[N, Di (| pad)] idx_k's output, then the new key rows"),
            vmem("head_weights", (n, self.weight_lanes), "float32", "[N, Hi (| pad)] each row's w_h / sqrt(Hi)"),
            vmem("weights", (self.hidden, self.weight_lanes), "float32", "[H, Hi (| pad)] this layer's weights_proj"),
            vmem("norm", (F32_SUBLANES, self.norm_lanes), "float32",
                 "rows 0, 1: this layer's key LayerNorm weight, bias (then its query rows: norm_lanes)"),
            vmem("key_patch", (self.patch_pages, p, self.index_head_dim), dt,
                 "index-key page of new token i of sequence b in slot b*q_len + i, then a read-only sink page"),
            vmem("key_tiles", (2, self.tile_rows, self.index_head_dim), dt, "[slot, token]: streamed index keys"),
            vmem("heads", (self.head_rows, self.key_lanes), "float32", "[h*q_len + i, Di]: one sequence's index queries"),
            vmem("combine", (self.query_rows, self.head_rows), "float32",
                 "[i, h*q_len + i]: query i's head weights w_h / sqrt(Hi) (the sum over heads as one matmul)"),
            vmem("keys", (self.query_rows, self.score_lanes), "int32",
                 "[query, position]: the scores as order-preserving int32 keys (masked: INT32_MIN), then the selection"),
            vmem("gather", (self.ring_slots, self.gather_rows, self.latent_lanes), dt,
                 "[slot, block j's block_rows rows]: gathered latent rows"),
            smem("picked", (self.batch, self.q_len, self.score_lanes), "int32",
                 "[sequence, query, position]: 1 where the query selected it (kept for the layers reusing it)"),
            smem("order", (self.batch, self.selected + self.gather_tokens), "int32",
                 "per sequence the blocks holding some query's picks, ascending (then copies of the last, for a "
                 "whole gather step)"),
            smem("counts", (self.batch,), "int32", "per sequence: the blocks listed in order"),
            dma_sems("sems", (6,), "weights, norm, key tile slots 0 / 1, selection VMEM -> SMEM, spare"),
            dma_sems("gather_sems", (self.ring_slots,), "one per gather slot"),
            dma_sems("patch_sems", (2, self.tokens), "[read | write, key patch slot]"),
        ) + ((vmem("q_in", (n, self.q_lora), "float32", "[N, H (| pad)] LayerNorm(x): what idx_q projects"),)
             if self.q_hidden else ())

    @property
    def key_page_bytes(self) -> int:
        return self.page_size * self.key_row_bytes

    @property
    def block_bytes(self) -> int:
        """One gathered block: block_rows latent rows as stored (lane padded)."""
        return self.block_rows * self.latent_lanes * self.itemsize

    @property
    def vector_bytes(self) -> int:
        """Per layer: weights_proj [H, Hi lane-padded] and the key norm rows [8, Di padded], float32."""
        return 4 * (self.hidden * self.weight_lanes + F32_SUBLANES * self.norm_lanes)

    def layer_counts(self, positions: np.ndarray, lengths: Sequence[int] | None = None) -> dict[str, int]:
        """One layer's DMAs for concrete `positions` [B, q] (the kernel's own logic, per sequence):
        key_tile_pages: index-key pages streamed from HBM (a tile slot past the sequence's last
        page repeats it; a page the step writes comes from VMEM); key_local_pages: those copied
        from a patched page; patched_pages: key pages read, patched and written back (the latent
        cache patches the same pages); key_tiles: index tiles; gather_blocks: latent blocks
        gathered: at most min(q_len x topk, the sequence's blocks) distinct blocks, rounded up to
        whole gather steps (an upper bound: picks sharing a block, or the queries sharing picks,
        make fewer, and a block in a page the step writes is a VMEM copy); gather_steps."""
        positions = np.asarray(positions).reshape(self.batch, self.q_len)
        p, kt, cap, gt = self.page_size, self.tile_pages, self.capacity, self.gather_tokens
        lengths = np.full(self.batch, cap) if lengths is None else np.asarray(lengths).reshape(self.batch)
        out = dict.fromkeys(("key_tile_pages", "key_local_pages", "patched_pages", "key_tiles", "gather_blocks",
                             "gather_steps"), 0)
        for row, n in zip(positions, lengths):
            n = min(max(int(n), 0), cap)
            kv_end = max([1] + [int(x) + 1 if 0 <= x < cap else (n if x >= cap else 0) for x in row])
            npages = -(-kv_end // p)
            ntiles = 1 if kt == self.pages_per_seq else -(-npages // kt)
            written = {int(x) // p for x in row if 0 <= x < cap}
            slots = ntiles * kt
            uses = {pg: (slots - (npages - 1) if pg == npages - 1 else 1) for pg in written if pg < npages}
            out["key_local_pages"] += sum(uses.values())
            out["key_tile_pages"] += slots - sum(uses.values())
            out["patched_pages"] += len(written)
            out["key_tiles"] += ntiles
            blocks = min(self.q_len * self.topk, -(-(npages * p) // self.block_rows))  # distinct, at most
            steps = max(1, -(-blocks // gt))
            out["gather_steps"] += steps
            out["gather_blocks"] += steps * gt
        return out

    def hbm_bytes(self, context_lengths: Sequence[int]) -> dict[str, int]:
        """Bytes one decode step moves in HBM for sparse attention, over the indexer layers, with
        the new tokens after `context_lengths` [B]: "index_keys" (key tiles read, patched key
        pages read and written), "sparse_gather" (the gathered latent blocks of every MLA layer,
        an upper bound: `layer_counts`), "indexer_vectors" (weights_proj and the norm rows). The latent pages
        the step patches are the MLA stage's (`AttentionGeometry.hbm_bytes`' patched pages)."""
        lengths = np.asarray(context_lengths, dtype=np.int64).reshape(self.batch)
        positions = lengths[:, None] + np.arange(self.q_len)[None, :]
        c = self.layer_counts(positions, lengths)
        return {"index_keys": self.num_layers * (c["key_tile_pages"] + 2 * c["patched_pages"]) * self.key_page_bytes,
                "sparse_gather": self.mla_layers * c["gather_blocks"] * self.block_bytes,
                "indexer_vectors": self.num_layers * self.vector_bytes}

    def temporaries_bytes(self) -> int:
        """One index tile's head scores [head rows, tile] and combined scores, the selection
        passes' [query rows, select_lanes] compare and count, and one gather step's scores,
        probabilities and masked values (an upper bound)."""
        t = round_up(self.tile_rows, LANE)
        return (self.head_rows * t * 8 + self.query_rows * t * 4 + 3 * self.query_rows * self.select_lanes * 4
                + 3 * self.gather_rows * self.latent_lanes * 4)


# Index-key tiles are at most this many tokens (the scores of one tile are [heads x q_len, tile]
# float32 before the sum over heads: 64 heads x 512 tokens is 128 KiB).
INDEX_TILE_ROWS = 512
# The top-k search's passes read at most this many positions at once (temporaries of [8 query
# rows, 4096] int32: 128 KiB each, where the whole 128k-token row would be 4 MiB).
SELECT_LANES = 4096
# A gather step moves at most this many latent rows (blocks of block_rows rows each).
GATHER_ROWS = 128
# Slots of the gather ring. A step's block DMAs share one queue, whose time by tpumk's DMA
# model is a 1 us latency plus the bytes at 405 GB/s (a bfloat16 DeepSeek-V3.2 step: 8 blocks
# of 20 KiB, about 0.4 us): with two slots the queue waits on latency; about 3.5 steps in
# flight cover it, so 4 slots (3 steps ahead of the one computed).
GATHER_SLOTS = 4
