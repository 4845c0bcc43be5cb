"""The tuner's result cache: every evaluated configuration on disk, keyed by everything that
computed its value.

`artifacts/tune/cache/<key>.json` (written atomically) keeps one evaluated configuration. The
key (`ResultKeys`) is tpumk.compile.keys's build key (model, target, shapes, tuning, the source
closure of the artifact code path, jax/jaxlib/libtpu versions, compile flags) plus the source
closure of the trial evaluation, `tpumk.tune.worker` and everything it imports (the timeline
model in tpumk.estimate, the compiler estimate and its calibration code, the device timing):
change any file of those units and every entry misses, so a hit is exact and never a value
computed by other code. The cache is shared by all studies and processes on the machine.
`compile_log.jsonl` next to it logs every compile the tuner ran.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from tpumk.compile.keys import cache_key, key_inputs, source_inputs
from tpumk.errors import ConfigError
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.tomlfile import write_text_atomic

# The module a trial's value is computed in (tpumk.tune.trial runs it in its own process).
EVALUATOR = "tpumk.tune.worker"


def evaluator_inputs() -> dict[str, Any]:
    """The code behind a trial's value: the units reachable from the evaluator and their digest."""
    return source_inputs(EVALUATOR)


class ResultKeys:
    """Result-cache keys of one problem's configurations: the build key's inputs with the
    trial's tuning swapped in, plus the evaluator's source (read once, when made)."""

    def __init__(self, problem: BuildSpec):
        self.base = {**key_inputs(problem.replace(tuning=TuningConfig())), "evaluator": evaluator_inputs()}

    @property
    def evaluator(self) -> dict[str, Any]:
        return self.base["evaluator"]

    def inputs(self, tuning: TuningConfig) -> dict[str, Any]:
        return {**self.base, "tuning": tuning.to_dict()}

    def __call__(self, tuning: TuningConfig) -> str:
        return cache_key(self.inputs(tuning))


class ResultCache:
    """Evaluated configurations on disk, one JSON file per config key (written atomically),
    plus an append-only log of every compile this machine ran for the tuner."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a regular file in the way, no permission
            raise ConfigError(f"--cache-dir {self.dir}: cannot create the result cache directory: "
                              f"{e.strerror or type(e).__name__}") from None
        self.log_path = self.dir / "compile_log.jsonl"
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError, RecursionError):  # absent, or unreadable: a miss (it will be rewritten)
            return None
        return entry if isinstance(entry, dict) and entry.get("key") == key else None

    def lookup(self, key: str, objective: str) -> dict[str, Any] | None:
        """A result for this objective: the entry if the configuration failed to compile (that
        holds for any objective) or holds this objective's value; else None."""
        entry = self.get(key)
        if entry is None:
            return None
        if entry["outcome"] != "ok" or objective in entry.get("objectives", {}):
            return entry
        # tpumk's model value is recorded next to every compile: enough for the model objective.
        if objective == "model" and entry.get("model_seconds") is not None:
            return entry
        return None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        with self._lock:
            old = self.get(key)
            if old and old.get("outcome") == "ok" and entry.get("outcome") == "ok":
                entry = {**entry, "objectives": {**old.get("objectives", {}), **entry.get("objectives", {})}}
            write_text_atomic(self._path(key), json.dumps(entry, indent=1, sort_keys=True))

    def log_compile(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        # One write() on an O_APPEND file: lines of concurrent processes never interleave.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def compile_log(self) -> list[dict[str, Any]]:
        """The logged compiles; a line that is not a JSON object (a damaged file) is skipped."""
        try:
            lines = self.log_path.read_bytes().decode("utf-8", errors="replace").splitlines()
        except OSError:
            return []
        records = []
        for ln in lines:
            try:
                record = json.loads(ln) if ln.strip() else None
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                records.append(record)
        return records
