"""`BuildSpec`: the one description of a build that every command and library entry takes.

A build is a model on a target at one step shape (sequences per step, KV capacity, new tokens
per sequence, KV page size) with one set of kernel knobs. `tpumk build`, `estimate`, `tune`,
`export`, `bench` and the cache key all take a BuildSpec, so each default below is defined here
and nowhere else. Fields the next capabilities add (devices, weight formats) belong here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tpumk.model.config import ModelConfig
from tpumk.plan.knobs import TuningConfig
from tpumk.targets import Target

DEFAULT_MODEL = "small-moe"  # preset a command builds when given no --model / --checkpoint (bfloat16: profiles)
DEFAULT_TARGET = "tpu7x"
DEFAULT_BATCH = 1
DEFAULT_CONTEXT = 4096
DEFAULT_Q_LEN = 1
DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class BuildSpec:
    """Everything that decides a megakernel decode step (the plan is computed from it alone)."""

    model: ModelConfig
    target: Target
    batch: int = DEFAULT_BATCH  # sequences per decode step
    context: int = DEFAULT_CONTEXT  # KV-cache capacity per sequence, in tokens
    tuning: TuningConfig = field(default_factory=TuningConfig)
    q_len: int = DEFAULT_Q_LEN  # new tokens per sequence per step (> 1: speculative verification)
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per KV-cache page

    def replace(self, **changes: Any) -> BuildSpec:
        return dataclasses.replace(self, **changes)

    def shapes(self) -> dict[str, int]:
        return {"batch": self.batch, "context": self.context, "q_len": self.q_len, "page_size": self.page_size}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-safe) that `from_dict` turns back into the same spec."""
        return {"model": self.model.to_dict(), "target": self.target.name, **self.shapes(),
                "tuning": self.tuning.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "build spec") -> BuildSpec:
        from tpumk.model.config import from_dict
        from tpumk.targets import get_target

        return cls(from_dict(d["model"], where), get_target(d["target"]), d["batch"], d["context"],
                   TuningConfig.from_dict(d.get("tuning", {}), where), d["q_len"], d["page_size"])

    def label(self) -> str:
        q = f", q_len {self.q_len}" if self.q_len > 1 else ""
        return (f"{self.model.name} ({self.model.dtype}) on {self.target.name}, batch {self.batch}, "
                f"context {self.context}{q}")
