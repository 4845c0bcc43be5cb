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

from tpumk.errors import PlanError
from tpumk.model.config import ModelConfig
from tpumk.model.kv_quant import KV_FORMATS
from tpumk.plan.knobs import TuningConfig
from tpumk.targets import Target

DEFAULT_MODEL = "small-moe"  # preset a command builds when given no --model / --checkpoint (bfloat16: profiles)
DEFAULT_TARGET = "tpu7x"
DEFAULT_BATCH = 1
DEFAULT_CONTEXT = 4096
DEFAULT_Q_LEN = 1
DEFAULT_PAGE_SIZE = 16
DEFAULT_DEVICES = 1
DEFAULT_QUANT = "none"
DEFAULT_KV_DTYPE = ""  # the KV cache in the model dtype; "fp8" / "int8": tpumk.model.kv_quant
# Bounds of the step shapes, checked when a BuildSpec is made (before any plan arithmetic or
# per-page loop), so that no input can make planning hang. They sit far above what the models
# tpumk builds serve (Qwen3: 32k native, 128k with YaRN, which tpumk refuses for now); raise
# them with the first model that needs more (some serve 10M-token contexts).
MAX_BATCH = 4096
MAX_CONTEXT = 1 << 22  # 4M tokens per sequence
MAX_Q_LEN = 1024
MAX_PAGE_SIZE = 4096
MAX_DEVICES = 256  # TensorCores of one step (the largest deviceless topology tpumk names has 128)


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
    devices: int = DEFAULT_DEVICES  # TensorCores (JAX devices) one step spans: tensor/expert parallel
    quant: str = DEFAULT_QUANT  # weight formats (tpumk.model.quantize: a preset or ring=..,experts=..)
    kv_dtype: str = DEFAULT_KV_DTYPE  # KV cache format: "" (model dtype), "fp8" or "int8" (`--kv-dtype`)
    # hidden states the step also returns, [B, q, len(taps), H] (a hidden-state drafter's input):
    # transformers' output_hidden_states numbering (tpumk.model.reference.check_taps)
    taps: tuple[int, ...] = ()
    # a speculative round program (tpumk.draft.rounds.RoundSpec: the drafter, its weights' identity,
    # rounds per call, temperature): the build compiles the round, whose verify step is this
    # spec's step, so q_len and taps are set here from it (block + 1, the drafter's taps), and
    # the tuning's draft_block, when set, is its block
    draft: Any = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise PlanError (one line naming the field) for a shape no build can have.

        The context is the KV-cache capacity per sequence and the cache is allocated in whole
        pages, so it must be a positive multiple of page_size: any other value would silently be
        planned as the next whole page (another capacity, under another cache key)."""
        if not isinstance(self.model, ModelConfig):
            raise PlanError(f"build spec: model = {self.model!r:.60}: expected a ModelConfig")
        if not isinstance(self.target, Target):
            raise PlanError(f"build spec: target = {self.target!r:.60}: expected a Target")
        if not isinstance(self.tuning, TuningConfig):
            raise PlanError(f"build spec: tuning = {self.tuning!r:.60}: expected a TuningConfig")
        for name, upper in (("batch", MAX_BATCH), ("context", MAX_CONTEXT), ("q_len", MAX_Q_LEN),
                            ("page_size", MAX_PAGE_SIZE), ("devices", MAX_DEVICES)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= upper):
                raise PlanError(f"build spec: {name} = {v!r:.60}: expected a positive integer at most {upper:,}")
        from tpumk.errors import ConfigError
        from tpumk.model.quantize import canonical_scheme

        try:  # one spelling per scheme, so equal builds share a cache key
            object.__setattr__(self, "quant", canonical_scheme(self.quant, self.model))
        except ConfigError as e:
            raise PlanError(f"build spec: {e}") from None
        if self.kv_dtype not in ("", "none") and self.kv_dtype not in KV_FORMATS:
            raise PlanError(f"build spec: kv_dtype = {self.kv_dtype!r:.40}: expected one of {', '.join(KV_FORMATS)} "
                            "(or none: the model dtype)")
        object.__setattr__(self, "kv_dtype", "" if self.kv_dtype == "none" else self.kv_dtype)
        self._resolve_draft()
        from tpumk.model.reference import check_taps

        try:
            object.__setattr__(self, "taps", check_taps(self.model, self.taps))
        except (ConfigError, TypeError) as e:
            raise PlanError(f"build spec: {e}") from None
        if self.context % self.page_size:
            lo = self.context // self.page_size * self.page_size
            near = f"{lo} or {lo + self.page_size}" if lo else f"{self.page_size}"
            raise PlanError(f"build spec: context = {self.context}: expected a positive multiple of page_size "
                            f"({self.page_size}), since the KV cache holds whole pages (e.g. {near})")
        if self.q_len > self.context:
            raise PlanError(f"build spec: q_len = {self.q_len}: expected at most context ({self.context})")
        m = self.model
        if m.attention.is_sparse and self.context <= m.attention.index_topk:
            # every query would keep every cached token: the indexer's work and cache buy nothing
            raise PlanError(f"build spec: context = {self.context}: expected more than the indexer's top-k "
                            f"(field 'index_topk' = {m.attention.index_topk} of model '{m.name}'), or its sparse "
                            "attention never selects: build with a longer --context")
        if m.rope_scaling == "longrope" and self.context > m.rope_original_max_position:
            # transformers turns to the long factors once a sequence passes that length (and keeps
            # the keys it cached with the short ones); one build's RoPE rows are fixed
            raise PlanError(f"build spec: context = {self.context}: expected at most {m.rope_original_max_position:,} "
                            f"for model '{m.name}' (longrope RoPE: past its original_max_position_embeddings "
                            "the frequencies change with the sequence length)")

    def _resolve_draft(self) -> None:
        """A round build's verify step: the drafter's block (the tuning's draft_block when set,
        which then moves into the RoundSpec) + 1 rows and its taps; a drafter made for another
        hidden size or vocabulary, or a block the drafter or the context cannot hold, is refused."""
        from tpumk.errors import ConfigError

        d, block = self.draft, self.tuning.draft_block
        if d is None:
            if block:
                raise PlanError(f"build spec: tuning 'draft_block' = {block}: only for a speculative round program "
                                "(--draft)")
            return
        from tpumk.draft.rounds import RoundSpec

        if not isinstance(d, RoundSpec):
            raise PlanError(f"build spec: draft = {d!r:.60}: expected a RoundSpec")
        m, s = self.model, d.drafter
        for what, mine, theirs in (("hidden size", s.hidden, m.hidden_size), ("vocabulary", s.vocab, m.vocab_size)):
            if mine != theirs:
                raise PlanError(f"build spec: draft: a {s.kind} drafter for a {what} of {mine}, the target "
                                f"'{m.name}' has {theirs}: expected a drafter made for this target")
        try:
            if block:
                d = d.with_block(block)
                object.__setattr__(self, "tuning", self.tuning.replace(draft_block=0))
            d.settings(self.context)
        except ConfigError as e:
            raise PlanError(f"build spec: {e}") from None
        object.__setattr__(self, "draft", d)
        object.__setattr__(self, "q_len", d.block + 1)
        object.__setattr__(self, "taps", tuple(s.taps))

    def replace(self, **changes: Any) -> BuildSpec:
        return dataclasses.replace(self, **changes)

    def shapes(self) -> dict[str, int]:
        # everything but the model, target and knobs (the cache key and manifests record these)
        # kv_dtype only when set: builds with a model-dtype cache keep the keys they always had
        return {"batch": self.batch, "context": self.context, "q_len": self.q_len, "page_size": self.page_size,
                "devices": self.devices, "quant": self.quant, **({"kv_dtype": self.kv_dtype} if self.kv_dtype else {}),
                **({"taps": list(self.taps)} if self.taps else {})}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-safe) that `from_dict` turns back into the same spec."""
        return {"model": self.model.to_dict(), "target": self.target.name, **self.shapes(),
                "tuning": self.tuning.to_dict(), **({"draft": self.draft.to_dict()} if self.draft else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "build spec") -> BuildSpec:
        from tpumk.model.config import from_dict
        from tpumk.targets import get_target

        if not isinstance(d, dict):
            raise PlanError(f"{where}: expected a table with model, target, batch, context, q_len, page_size")
        missing = [k for k in ("model", "target", "batch", "context", "q_len", "page_size") if k not in d]
        if missing:
            raise PlanError(f"{where}: missing field '{missing[0]}'")
        return cls(from_dict(d["model"], where), get_target(d["target"]), d["batch"], d["context"],
                   TuningConfig.from_dict(d.get("tuning", {}), where), d["q_len"], d["page_size"],
                   d.get("devices", DEFAULT_DEVICES), d.get("quant", DEFAULT_QUANT), d.get("kv_dtype", DEFAULT_KV_DTYPE),
                   _taps_field(d.get("taps", ()), where), _draft_field(d.get("draft"), where))

    def label(self) -> str:
        q = f", q_len {self.q_len}" if self.q_len > 1 else ""
        on = f"{self.devices} x {self.target.name}" if self.devices > 1 else self.target.name
        fmt = f", {self.quant} weights" if self.quant != "none" else ""
        fmt += f", {self.kv_dtype} KV cache" if self.kv_dtype else ""
        fmt += f", taps {list(self.taps)}" if self.taps else ""
        draft = f"; round program: {self.draft.label()}" if self.draft else ""
        return (f"{self.model.name} ({self.model.dtype}{fmt}) on {on}, batch {self.batch}, "
                f"context {self.context}{q}{draft}")


def _taps_field(value: Any, where: str) -> tuple[int, ...]:
    if not (isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise PlanError(f"{where}: field 'taps' = {value!r:.60}: expected a list of layer numbers")
    return tuple(value)


def _draft_field(value: Any, where: str):
    if value is None:
        return None
    from tpumk.draft.rounds import RoundSpec

    return RoundSpec.from_dict(value, f"{where}: field 'draft'")
