"""TuningConfig: every knob of the megakernel, in one place, with defaults.

A knob exists only here. The plan (`tpumk.plan.plan.make_plan`) reads it and decides everything the
kernel does from it; `tpumk build --tuning FILE.toml`, the tuner's search space, the cache key
and build reports all go through `to_dict()` / `from_dict()` / the `[tuning]` TOML table.

Validation here is model-independent (types, ranges, lane alignment). Whether a knob works for a
given model and target (divides a matrix, fits VMEM) is the plan's job and raises PlanError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpumk.errors import ConfigError
from tpumk.tomlfile import read_toml, write_text_atomic

MIB = 1 << 20

# Weight-matrix families streamed through the ring. Each has a tile shape knob pair
# `<family>_tile_rows` / `<family>_tile_cols`; 0 means "auto" (see tpumk.plan.plan).
ALL_REDUCE_CHOICES = ("auto", "direct", "rsag", "doubling", "hierarchical")  # tpumk.plan.geometry.ALL_REDUCE_SCHEDULES + auto
ALL_REDUCE_WIRES = ("float32", "bfloat16")  # AllReduceGeometry.dtype
MLA_PROJECTIONS = ("auto", "replicated", "split")  # ShardingPlan.latent_split (tpumk.plan.sharding)
FAMILIES = ("qkv", "o", "gate_up", "down", "shared_gate_up", "shared_down", "lm_head")


# ring_depth = 0 (auto): this many tiles where they fit (the published kernel's 12 x 2 MiB in
# flight, the fixed default before the plan chose), else the model's pick of fewer
# (tpumk.plan.plan._choose_ring_depth).
AUTO_RING_DEPTH = 12


@dataclass(frozen=True)
class TuningConfig:
    # ---- weight ring (dense matrices of every layer and the lm_head)
    # tiles in flight; the published kernel keeps 12 x 2 MiB in flight. 0 = auto: 12 where it fits
    # the VMEM budget, else the fastest shallower ring by the timeline model (plan._choose_ring_depth)
    ring_depth: int = 0
    tile_bytes: int = 2 * MIB  # target bytes of an auto-shaped tile
    # Per-family tile shapes: rows split the input dim K (0 = auto), cols split the output dim.
    qkv_tile_rows: int = 0
    qkv_tile_cols: int = 0
    o_tile_rows: int = 0
    o_tile_cols: int = 0
    gate_up_tile_rows: int = 0
    gate_up_tile_cols: int = 0  # gate and up halves side by side: must be a multiple of 256
    down_tile_rows: int = 0
    down_tile_cols: int = 0
    shared_gate_up_tile_rows: int = 0
    shared_gate_up_tile_cols: int = 0
    shared_down_tile_rows: int = 0
    shared_down_tile_cols: int = 0
    lm_head_tile_rows: int = 0
    lm_head_tile_cols: int = 0
    # ---- attention over the paged KV cache
    # 0 = auto: the plan picks the pair from the batch and context with the timeline model,
    # within the VMEM budget (tpumk.plan.plan._choose_kv_knobs); a value set here is kept.
    kv_tile_pages: int = 0  # pages per KV tile
    kv_buffers: int = 0  # KV tile slots (kv_buffers - 1 tiles in flight while one is computed)
    # ---- mixture of experts
    # expert weight slots in VMEM (loads start as soon as routing is known); 0 = auto: the most,
    # up to 4, that fit the VMEM budget (tpumk.plan.plan.AUTO_EXPERT_SLOTS)
    expert_slots: int = 0
    expert_chunk: int = 0  # expert FFN columns per load; 0 = auto (chunks of about 2 ring tiles)
    # Devices > 1: experts split over `expert_parallel` groups of devices (each group owns
    # num_experts / expert_parallel whole experts), each expert's width split over the
    # devices / expert_parallel devices of its group. 1 = expert-tensor parallel (every device
    # streams every picked expert, a slice of its width), devices = expert parallel; 0 = auto.
    expert_parallel: int = 0
    # Devices > 1: the in-kernel all-reduce's schedule: "direct" (one round, every device's
    # partial to every peer), "rsag" (reduce-scatter + all-gather: two rounds, 2 / N of the
    # bytes), "doubling" (log2 N rounds, power-of-two offsets: what v5e routes), "hierarchical"
    # (TPU7x: rsag with the chip's sibling TensorCore first, four rounds, half the bytes on chip)
    # or "auto".
    all_reduce: str = "auto"
    # Devices > 1: what the all-reduce's pushes carry: "float32" (exact partial sums) or
    # "bfloat16" (half the bytes; every partial, and for rsag / hierarchical every sum that travels, rounded to
    # bfloat16, the sums still float32 in a fixed order: the same bits on every device).
    all_reduce_wire: str = "float32"
    # MLA on devices > 1: q_a and kv_a (the projections that make the latent) "replicated"
    # (every device computes them whole), "split" (each device computes 1/N of their output
    # columns and the kernel all-gathers the latent) or "auto" (the plan weighs both with
    # tpumk's timeline model: fewer weight bytes against one more collective per layer).
    mla_projections: str = "auto"
    # ---- VMEM budget
    vmem_limit_fraction: float = 0.85  # share of the target's VMEM the kernel may plan for
    # ---- a speculative round program (a build with a drafter, `BuildSpec.draft`)
    # drafts per round (the verify step's q_len is draft_block + 1); 0 = the drafter's own
    # (--draft-tokens, or its config's). Left out of to_dict when 0, so a build without a drafter
    # keeps the key inputs, study identities and tuned files it always had.
    draft_block: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, expected: str) -> ConfigError:
            return ConfigError(f"tuning: '{name}' = {getattr(self, name)!r}: expected {expected}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and not (isinstance(v, int) and not isinstance(v, bool)):
                raise bad(f.name, "an integer")
        if self.ring_depth != 0 and self.ring_depth < 2:
            raise bad("ring_depth", "0 (auto) or at least 2 (one tile computing while the next loads)")
        if self.tile_bytes < 64 * 1024:
            raise bad("tile_bytes", "at least 65536")
        for fam in FAMILIES:
            rows, cols = f"{fam}_tile_rows", f"{fam}_tile_cols"
            if getattr(self, rows) < 0 or getattr(self, rows) % 128:
                raise bad(rows, "0 (auto) or a positive multiple of 128")
            lane = 256 if fam.endswith("gate_up") else 128
            if getattr(self, cols) < 0 or getattr(self, cols) % lane:
                why = " (gate and up halves of 128-lane multiples)" if lane == 256 else ""
                raise bad(cols, f"0 (auto) or a positive multiple of {lane}{why}")
        if self.kv_tile_pages < 0:
            raise bad("kv_tile_pages", "0 (auto) or a positive number of pages")
        if self.kv_buffers < 0 or self.kv_buffers == 1:
            raise bad("kv_buffers", "0 (auto) or at least 2")
        if self.expert_slots < 0:
            raise bad("expert_slots", "0 (auto) or at least 1")
        if self.all_reduce not in ALL_REDUCE_CHOICES:
            raise bad("all_reduce", f"one of {', '.join(ALL_REDUCE_CHOICES)}")
        if self.all_reduce_wire not in ALL_REDUCE_WIRES:
            raise bad("all_reduce_wire", f"one of {', '.join(ALL_REDUCE_WIRES)}")
        if self.mla_projections not in MLA_PROJECTIONS:
            raise bad("mla_projections", f"one of {', '.join(MLA_PROJECTIONS)}")
        if self.expert_parallel < 0:
            raise bad("expert_parallel", "0 (auto) or a positive number of expert groups")
        if self.expert_chunk < 0 or self.expert_chunk % 128:
            raise bad("expert_chunk", "0 (whole expert) or a positive multiple of 128")
        if self.draft_block < 0:
            raise bad("draft_block", "0 (the drafter's own) or a positive number of drafts per round")
        frac = self.vmem_limit_fraction
        if not (isinstance(frac, (int, float)) and not isinstance(frac, bool) and 0.1 <= frac <= 1.0):
            raise bad("vmem_limit_fraction", "a number in [0.1, 1.0]")

    def tile_shape(self, family: str) -> tuple[int, int]:
        """A family's tile knobs; (0, 0), auto, for a family without knobs (MLA's, linear attention's)."""
        return getattr(self, f"{family}_tile_rows", 0), getattr(self, f"{family}_tile_cols", 0)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not d["draft_block"]:  # no drafter, or its own block: the dict plain builds always had
            del d["draft_block"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "tuning") -> "TuningConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table of tuning knobs")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown tuning knob '{unknown[0]}' (known knobs: {', '.join(known)})")
        if isinstance(data.get("vmem_limit_fraction"), int) and not isinstance(data["vmem_limit_fraction"], bool):
            data = {**data, "vmem_limit_fraction": float(data["vmem_limit_fraction"])}
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def replace(self, **changes: Any) -> "TuningConfig":
        return TuningConfig.from_dict({**self.to_dict(), **changes})

    def to_toml(self) -> str:
        lines = ["[tuning]"]
        for k, v in self.to_dict().items():
            lines.append(f"{k} = {v!r}")
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_toml())


def load_tuning(path: str | Path) -> TuningConfig:
    """A TOML file with a `[tuning]` table (knobs not given keep their defaults)."""
    data = read_toml(path)
    extra = sorted(set(data) - {"tuning"})
    if extra:
        raise ConfigError(f"{path}: unknown table or key '{extra[0]}' (expected a [tuning] table)")
    return TuningConfig.from_dict(data.get("tuning", {}), str(path))
