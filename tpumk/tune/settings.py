"""How one `tpumk tune` run goes: budget, per-trial timeout, workers, seed, where things live."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpumk.errors import ConfigError
from tpumk.tune.storage import DEFAULT_HEARTBEAT, DEFAULT_ROOT

DEFAULT_TIMEOUT = 900.0  # seconds per trial: compile (+ profiling compile, + timing)
# The longest --timeout: a day per trial is far past any compile tpumk makes (the largest,
# DeepSeek-V3 over 32 devices, takes minutes); past it a value is a mistake (inf, 1e300), and
# the wait primitives refuse what does not fit their clocks (OverflowError).
MAX_TIMEOUT = 86400.0
INFEASIBLE_FACTOR = 10  # default max_infeasible = this x trials


@dataclass
class TuneSettings:
    trials: int = 30
    timeout: float = DEFAULT_TIMEOUT
    workers: int = 1
    seed: int | None = None
    heartbeat: int = DEFAULT_HEARTBEAT
    root: Path = DEFAULT_ROOT
    cache_dir: Path | None = None  # default root / "cache"
    top: int = 5
    max_infeasible: int | None = None  # trials pruned before compiling; default 10 x trials

    def infeasible_cap(self) -> int:
        return self.max_infeasible if self.max_infeasible is not None else INFEASIBLE_FACTOR * self.trials

    def repeats_cap(self) -> int:
        """Trials that repeat an evaluated configuration (no cost, outside the budget) after
        which the study stops: the sampler keeps suggesting what it has seen."""
        return INFEASIBLE_FACTOR * self.trials

    def validate(self) -> None:
        for name, low in (("trials", 1), ("workers", 1), ("heartbeat", 1), ("top", 1)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
                raise ConfigError(f"--{name}: {v!r}: expected an integer >= {low}")
        m = self.max_infeasible
        if m is not None and not (isinstance(m, int) and not isinstance(m, bool) and m >= 0):
            raise ConfigError(f"--max-infeasible: {m!r}: expected an integer >= 0")
        t = self.timeout
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= MAX_TIMEOUT):
            raise ConfigError(f"--timeout: {t!r}: expected a positive, finite number of seconds at most "
                              f"{MAX_TIMEOUT:,.0f} (a day)")
