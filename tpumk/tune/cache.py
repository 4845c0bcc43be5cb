"""The tuner's result cache: every evaluated configuration on disk, keyed by everything that
computed its value.

`artifacts/tune/cache/<key>.json` (written atomically) keeps one evaluated configuration. The
key (`ResultKeys`) is tpumk.compile.keys's build key (model, target, shapes, tuning, the source
closure of the artifact code path, jax/jaxlib/libtpu versions, compile flags) plus the source
closure of the trial evaluation: every tpumk unit (subpackage or top-level module)
`tpumk.tune.worker` reaches by import, each hashed whole. That is the timeline model in
tpumk.estimate, the compiler estimate and its calibration code and the device timing, but
also the whole `tpumk.tune` package the worker belongs to (study.py, report.py, ...: a unit
is hashed whole): change any file of those units and every entry misses (and the default
study name changes), so a hit is exact and never a value computed by other code. The
cache is shared by all studies and processes on the machine. `compile_log.jsonl` next to it
logs every compile the tuner ran.

An entry is one of:
- `outcome: "failed"` at stage `plan` or `compile`: a property of the configuration, served to
  every objective;
- `outcome: "failed"` at another stage (a worker crash) with the `objective` that ran: served
  to that objective only;
- `outcome: "ok"` (it compiled), with `objectives` = {name: {value, value_kind, source,
  details}} or {name: {failed, stage}} (that objective's own failure after the compile, e.g. no
  compiler estimate), and the model value every compile records (`model_seconds`).
A later failure never replaces an ok entry; it is added as that objective's failure.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

from tpumk.compile.keys import cache_key, key_inputs, source_inputs
from tpumk.errors import ConfigError, TpumkError
from tpumk.files import MiB, read_regular
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.tomlfile import write_text_atomic

# The module a trial's value is computed in (tpumk.tune.trial runs it in its own process).
EVALUATOR = "tpumk.tune.worker"


def evaluator_inputs() -> dict[str, Any]:
    """The code behind a trial's value: the units reachable from the evaluator and their digest."""
    return source_inputs(EVALUATOR)


ENTRY_LIMIT = 1 * MiB  # a cache entry tpumk writes is a few KiB
LOG_LIMIT = 256 * MiB  # the compile log: one short line per compile


class ResultKeys:
    """Result-cache keys of one problem's configurations: the build key's inputs with the
    trial's tuning swapped in, plus the evaluator's source (read once, when made)."""

    def __init__(self, problem: BuildSpec):
        self.problem = problem
        self.base = {**key_inputs(problem.replace(tuning=TuningConfig())), "evaluator": evaluator_inputs()}

    @property
    def evaluator(self) -> dict[str, Any]:
        return self.base["evaluator"]

    def inputs(self, tuning: TuningConfig) -> dict[str, Any]:
        if self.problem.draft is None:
            return {**self.base, "tuning": tuning.to_dict()}
        # a round build: the tuning's draft_block is the round's block, which sets the verify
        # step's shapes and the drafter's spec (BuildSpec resolves it): the key names the build
        spec = self.problem.replace(tuning=tuning)
        return {**self.base, "shapes": spec.shapes(), "draft": spec.draft.to_dict(), "tuning": spec.tuning.to_dict()}

    def __call__(self, tuning: TuningConfig) -> str:
        return cache_key(self.inputs(tuning))


# Failures that are properties of the configuration, whatever the objective.
CONFIG_STAGES = ("plan", "compile")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def valid_entry(entry: Any, key: str) -> bool:
    """The entry has the shape `_evaluate` writes (every field a reader indexes)."""
    if not isinstance(entry, dict) or entry.get("key") != key:
        return False
    if entry.get("outcome") == "failed":
        return isinstance(entry.get("stage"), str) and isinstance(entry.get("reason"), str)
    if entry.get("outcome") != "ok":
        return False
    objectives = entry.get("objectives")
    if not isinstance(objectives, dict) or "model_seconds" not in entry:
        return False
    if entry["model_seconds"] is not None and not _number(entry["model_seconds"]):
        return False
    for o in objectives.values():
        if not isinstance(o, dict):
            return False
        if "failed" in o:
            if not (isinstance(o["failed"], str) and isinstance(o.get("stage"), str)):
                return False
        elif not (_number(o.get("value")) and isinstance(o.get("value_kind"), str) and isinstance(o.get("source"), str)):
            return False
    return True


def merge_entries(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any] | None:
    """What to store when `new` is written over `old` (None: keep old as it is). An ok entry is
    never replaced by a failure: one objective's failure is added to it; values of other
    objectives are kept; a recorded value is not replaced by a failure of the same objective."""
    if old is None:
        return new
    if old["outcome"] == "ok":
        if new["outcome"] != "ok":
            name = new.get("objective")
            if new["stage"] in CONFIG_STAGES or name is None or name in old["objectives"]:
                return None  # (cannot happen for one key and one code; keep what compiled)
            return {**old, "objectives": {**old["objectives"], name: {"failed": new["reason"], "stage": new["stage"]}}}
        objectives = dict(old["objectives"])
        for name, o in new["objectives"].items():
            if "failed" not in o or name not in objectives:
                objectives[name] = o
        return {**new, "objectives": objectives}
    if new["outcome"] == "ok" and old["stage"] not in CONFIG_STAGES and old.get("objective") \
            and old["objective"] not in new["objectives"]:
        # keep the earlier objective's own failure (a crash) next to the values that now exist
        failed = {"failed": old["reason"], "stage": old["stage"]}
        return {**new, "objectives": {**new["objectives"], old["objective"]: failed}}
    return new


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
        """The entry of this key, or None: absent, unreadable, or not of the shape this code
        writes (a damaged or foreign file is a miss; it will be rewritten)."""
        try:
            entry = json.loads(read_regular(self._path(key), ENTRY_LIMIT))
        except (TpumkError, ValueError, RecursionError):  # also a FIFO, device or oversized file
            return None
        return entry if valid_entry(entry, key) else None

    def lookup(self, key: str, objective: str) -> dict[str, Any] | None:
        """A result for this objective: the entry if the configuration failed to plan or compile
        (that holds for any objective), if it records this objective's own value or failure, or
        (model objective) the model value recorded next to the compile; else None."""
        entry = self.get(key)
        if entry is None:
            return None
        if entry["outcome"] != "ok":
            return entry if entry["stage"] in CONFIG_STAGES or entry.get("objective") == objective else None
        if objective in entry["objectives"]:
            return entry
        # tpumk's model value is recorded next to every compile: enough for the model objective.
        if objective == "model" and entry["model_seconds"] is not None:
            return entry
        return None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        with self._lock:
            entry = merge_entries(self.get(key), entry)
            if entry is not None:
                write_text_atomic(self._path(key), json.dumps(entry, indent=1, sort_keys=True))

    def log_compile(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        # One write() on an O_APPEND file: lines of concurrent processes never interleave.
        # O_NONBLOCK: a FIFO planted in its place fails the open (ENXIO) instead of blocking it
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
        except OSError as e:
            if e.errno == errno.ENXIO:  # a FIFO nobody reads: not tpumk's log, nothing to append to
                return
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return  # not tpumk's log (a device, a FIFO with a reader): write nothing to it
            os.write(fd, line)
        finally:
            os.close(fd)

    def compile_log(self) -> list[dict[str, Any]]:
        """The logged compiles; a line that is not a JSON object (a damaged file) is skipped."""
        try:
            lines = read_regular(self.log_path, LOG_LIMIT).decode("utf-8", errors="replace").splitlines()
        except TpumkError:  # absent, not a regular file, larger than any log tpumk writes
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
