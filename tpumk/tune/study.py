"""`tpumk tune`: an Optuna study over the megakernel's knobs, every trial a real compile.

A study tunes one *problem* (model, target, step shapes) over one tuning space
(tpumk.tune.space) for one objective (tpumk.tune.objectives), and lives in an Optuna storage:

- default: `sqlite:///artifacts/tune/<study>.db` (one file per study, under the working directory;
  for one process: SQLite cannot lock a trial for update, so several processes should share a
  journal file or PostgreSQL);
- `PATH.journal` or `journal:PATH`: a JournalStorage file, for several processes on one machine;
- any Optuna RDB URL, e.g. `postgresql://user:pw@host/db` for workers on many machines.

The study name (default `study_name_for`) is derived from the problem, the space's content and
the objective, so the same command finds the same study and resumes it (`load_if_exists`).

Budget: `--trials N` means the study ends with N *evaluated* trials: COMPLETE, or PRUNED after
a compile (the compiler rejected the configuration, crashed or timed out), i.e. the trials that
cost a compile or reused one. Trials pruned before compiling (the space's constraints, the
plan) cost a fraction of a second and do not count; they are capped at `max_infeasible`
(default 10 x N) so a space that is mostly infeasible still ends. Every process and worker
thread shares the budget: a thread starts a trial only while evaluated + running < N (running
trials of other processes included), and a trial that another process started past the
budget in a race is marked FAIL ("surplus", never evaluated). (Optuna's MaxTrialsCallback
stops a study only after a trial finishes, so parallel workers would overshoot the budget by
the trials they have in flight; hence the check before each start.)

One trial: suggest -> TuningConfig (space.tuning_for) -> the space's constraints -> the plan
(PlanError) -> both infeasible kinds PRUNED with their reason, never compiled -> the result
cache -> claim the configuration in the study (below) -> compile in a worker process
(tpumk.tune.worker) with the per-trial timeout (compiler rejection, crash or timeout: PRUNED
with the reason) -> the objective's value. Every finished trial carries user attrs saying
what it is: `config_key`, `objective`, `value_kind` (compiler estimate / tpumk model / measured
on device), `objective_source`, `compile_seconds`, `vmem_bytes`, `floor_seconds`, `cached`,
and for pruned ones `prune_stage` and `prune_reason`.

Nothing is evaluated twice:
- the result cache (`artifacts/tune/cache/<config key>.json`, written atomically) keeps every
  evaluated configuration, keyed by tpumk.compile.keys's key (model, target, shapes, tuning,
  kernel source, jax/jaxlib/libtpu versions, compile flags), so a hit is exact; it is shared by
  all studies and processes on the machine. `compile_log.jsonl` next to it logs every compile.
- within a study, processes coordinate through the storage itself (so this also works across
  machines on PostgreSQL): each trial writes its `config_key` user attr, then takes a ticket
  one above the highest ticket any trial of that key holds, and evaluates only if no other
  running trial of the key is still choosing a ticket or holds a lower (ticket, trial number).
  That is Lamport's bakery algorithm over trial user attrs; the others wait and reuse the
  owner's result (recorded as cached, `duplicate_of` = the owner's number). A finished trial of
  the key is reused at once. An owner that dies is failed by the heartbeat (below) and the next
  waiter in ticket order takes over.

Resume: trials send Optuna heartbeats (RDBStorage's own; JournalStorage gets the same through
`JournalHeartbeatStorage`), so a killed run's RUNNING trials become FAIL after a grace period
(`optuna.storages.fail_stale_trials`, run before every trial and while waiting) and stop
counting; the rerun then finishes the budget, taking every configuration that had finished
from the cache.

Workers: `workers` threads in this process each drive one trial at a time; the compile runs in
the trial's own worker process, so threads suffice. More machines = more `tpumk tune` processes
on one PostgreSQL storage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tpumk.compile.keys import cache_key, canonical, key_inputs
from tpumk.errors import ConfigError, PlanError
from tpumk.plan.spec import BuildSpec
from tpumk.tomlfile import write_text_atomic
from tpumk.tune.objectives import ObjectiveChoice
from tpumk.plan.knobs import TuningConfig
from tpumk.tune.space import TuningSpace, space_facts

DEFAULT_ROOT = Path("artifacts") / "tune"
DEFAULT_TIMEOUT = 900.0  # seconds per trial: compile (+ profiling compile, + timing)
DEFAULT_HEARTBEAT = 5  # seconds between trial heartbeats
GRACE_FACTOR = 3  # a RUNNING trial whose heartbeat is this many intervals old is stale
POLL_SECONDS = 0.5
STUDY_ATTR = "tpumk_problem"
DEFAULT_ATTR = "tpumk_default"  # user attr of the enqueued default-configuration trial
FINISHED = ("COMPLETE", "PRUNED")
FREE_STAGES = ("tuning", "constraint", "plan")  # pruned before compiling: not in the budget
INFEASIBLE_FACTOR = 10  # default max_infeasible = this x trials


class SurplusTrial(Exception):
    """A trial another process started after the budget was used up: failed, never evaluated."""


class Interrupted(Exception):
    """The run was interrupted while this trial was evaluating: failed, so a rerun redoes it."""


# ---------------------------------------------------------------------- the problem
# A study tunes one BuildSpec (model, target, step shapes); its `tuning` is the default, and
# each trial swaps in its own.
def trial_plan(problem: BuildSpec, tuning: TuningConfig):
    from tpumk.plan.plan import make_plan

    return make_plan(problem.replace(tuning=tuning))


def describe(problem: BuildSpec) -> dict[str, Any]:
    """The problem as plain data, without the knobs a study searches."""
    return {k: v for k, v in problem.to_dict().items() if k != "tuning"}


def space_fingerprint(space: TuningSpace) -> dict[str, Any]:
    """What a space searches, as plain data (its distributions, fixed knobs and constraints)."""
    from optuna.distributions import distribution_to_json

    return {"knobs": {k: json.loads(distribution_to_json(d)) for k, d in sorted(space.distributions().items())},
            "fixed": dict(sorted(space.fixed.items())),
            "constraints": [getattr(c, "expr", str(c)) for c in space.constraints]}


def study_identity(problem: BuildSpec, space: TuningSpace, objective: str) -> dict[str, Any]:
    return {"problem": describe(problem), "space": space_fingerprint(space), "objective": objective}


def study_name_for(problem: BuildSpec, space: TuningSpace, objective: str) -> str:
    """Stable across processes and machines: readable fields plus a digest of everything."""
    digest = hashlib.sha256(canonical(study_identity(problem, space, objective))).hexdigest()[:10]
    dt = {"bfloat16": "bf16", "float32": "f32"}.get(problem.model.dtype, problem.model.dtype)
    q = f"-q{problem.q_len}" if problem.q_len > 1 else ""
    name = (f"{problem.model.name}-{dt}-{problem.target.name}-b{problem.batch}-c{problem.context}{q}"
            f"-{space.name}-{objective}-{digest}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


# ---------------------------------------------------------------------- storage
@functools.lru_cache(maxsize=None)
def _journal_heartbeat_class():
    from optuna.storages import JournalStorage
    from tpumk.compat import optuna_heartbeat_base

    BaseHeartbeat = optuna_heartbeat_base()
    from optuna.trial import TrialState

    class JournalHeartbeatStorage(JournalStorage, BaseHeartbeat):
        """A JournalStorage with Optuna's heartbeat protocol (RDBStorage has its own): the
        heartbeat is a trial system attr, so `study.optimize` records it and
        `fail_stale_trials` fails trials of a killed process, as with RDBStorage. Heartbeats
        compare wall clocks of the processes sharing the file, i.e. of one machine."""

        HEARTBEAT = "tpumk:heartbeat"

        def __init__(self, backend, heartbeat_interval: int, grace_period: int) -> None:
            super().__init__(backend)
            self.heartbeat_interval = heartbeat_interval
            self.grace_period = grace_period

        def record_heartbeat(self, trial_id: int) -> None:
            import optuna

            try:
                self.set_trial_system_attr(trial_id, self.HEARTBEAT, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # failed as stale meanwhile (a paused process): nothing left to keep alive

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                beat = t.system_attrs.get(self.HEARTBEAT)
                if beat is None and t.datetime_start is not None:
                    beat = t.datetime_start.timestamp()
                if beat is not None and now - beat > self.grace_period:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self.heartbeat_interval

        def get_heartbeat_stale_trial_callback(self):
            return None

    return JournalHeartbeatStorage


@functools.lru_cache(maxsize=None)
def _sqlite_storage_class():
    import optuna

    class SQLiteStorage(optuna.storages.RDBStorage):
        """RDBStorage on SQLite, with trial state changes serialised in this process. SQLite has
        no SELECT ... FOR UPDATE, so two worker threads could both take the same WAITING
        (enqueued) trial; under the lock the second sees it RUNNING and takes another. Several
        processes should share a journal file or PostgreSQL instead, which lock properly."""

        _state_lock = threading.Lock()

        def set_trial_state_values(self, trial_id, state, values=None):
            with self._state_lock:
                return super().set_trial_state_values(trial_id, state, values)

    return SQLiteStorage


def redact(url: str) -> str:
    """A storage URL fit to print (no password)."""
    if "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def storage_url(storage: str | None, study_name: str, root: Path = DEFAULT_ROOT) -> str:
    """The storage a study uses: the --storage value normalised, or the default SQLite file."""
    if storage is None or storage == "":
        return f"sqlite:///{root / (study_name + '.db')}"
    if storage.startswith("journal:") or ("://" not in storage and storage.endswith(".journal")):
        return storage
    if "://" in storage:
        return storage
    if storage.endswith((".db", ".sqlite", ".sqlite3")):
        return f"sqlite:///{storage}"
    raise ConfigError(f"--storage {storage!r}: expected an Optuna storage URL (sqlite:///FILE.db, "
                      "postgresql://user:pw@host/db), a FILE.journal or journal:FILE, or a FILE.db")


def open_storage(url: str, heartbeat: int = DEFAULT_HEARTBEAT):
    """An Optuna storage with heartbeats on, for a URL from `storage_url`."""
    import optuna

    grace = GRACE_FACTOR * heartbeat
    if url.startswith("journal:") or ("://" not in url and url.endswith(".journal")):
        path = Path(url.removeprefix("journal:"))
        if not path.name:
            raise ConfigError(f"--storage {url!r}: expected journal:FILE")
        path.parent.mkdir(parents=True, exist_ok=True)
        from optuna.storages.journal import JournalFileBackend

        return _journal_heartbeat_class()(JournalFileBackend(str(path)), heartbeat, grace)
    scheme = url.split("://", 1)[0].split("+", 1)[0]
    if scheme == "sqlite":
        db = url.split(":///", 1)[-1]
        if db and db != ":memory:":
            Path(db).parent.mkdir(parents=True, exist_ok=True)
    if scheme in ("postgresql", "postgres"):
        if "+" not in url.split("://", 1)[0]:
            # SQLAlchemy 2.1 defaults to the psycopg 3 driver; tpumk depends on psycopg2-binary.
            url = "postgresql+psycopg2://" + url.split("://", 1)[1]
        if url.startswith("postgresql+psycopg2://"):
            import importlib.util

            if importlib.util.find_spec("psycopg2") is None:
                raise ConfigError(f"--storage {redact(url)}: PostgreSQL needs psycopg2 (pip install psycopg2-binary)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            cls = _sqlite_storage_class() if scheme == "sqlite" else optuna.storages.RDBStorage
            return cls(url, heartbeat_interval=heartbeat, grace_period=grace)
    except Exception as e:  # bad URL, server down, wrong password, unknown dialect
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"--storage {redact(url)}: cannot open: {first[:300]}") from None


# ---------------------------------------------------------------------- result cache
class ResultCache:
    """Evaluated configurations on disk, one JSON file per config key (written atomically),
    plus an append-only log of every compile this machine ran for the tuner."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "compile_log.jsonl"
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):  # absent, or unreadable: a miss (it will be rewritten)
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
        try:
            return [json.loads(ln) for ln in self.log_path.read_text().splitlines() if ln.strip()]
        except OSError:
            return []


# ---------------------------------------------------------------------- settings and result
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

    def validate(self) -> None:
        for name, low in (("trials", 1), ("workers", 1), ("heartbeat", 1), ("top", 1)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
                raise ConfigError(f"--{name}: {v!r}: expected an integer >= {low}")
        m = self.max_infeasible
        if m is not None and not (isinstance(m, int) and not isinstance(m, bool) and m >= 0):
            raise ConfigError(f"--max-infeasible: {m!r}: expected an integer >= 0")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ConfigError(f"--timeout: {self.timeout!r}: expected a positive number of seconds")


@dataclass
class TuneResult:
    study: str
    storage: str
    problem: str
    space: str
    objective: str
    objective_reason: str
    trials_requested: int
    counts: dict[str, int]  # trial states in the study at the end
    evaluated: int  # trials in the budget: COMPLETE + pruned after compiling
    infeasible: int  # trials pruned before compiling (constraints, plan)
    this_run: dict[str, Any]  # trials, compiles and cache hits of this process, wall seconds
    best: list[dict[str, Any]]  # ranked distinct configurations
    default: dict[str, Any] | None  # the default configuration's trial
    best_over_default: float | None
    best_tuning: dict[str, Any] | None
    floor_seconds: float | None  # HBM floor of the best configuration (tpumk plan accounting)
    prune_reasons: dict[str, int] = field(default_factory=dict)
    out: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- the trial pipeline
def _state(t) -> str:
    return t.state.name


def _free(t) -> bool:
    return _state(t) == "PRUNED" and t.user_attrs.get("prune_stage") in FREE_STAGES


def tally(trials) -> tuple[int, int, set[int]]:
    """(evaluated trials, trials pruned before compiling, numbers of running trials)."""
    evaluated = sum(_state(t) in FINISHED and not _free(t) for t in trials)
    return evaluated, sum(_free(t) for t in trials), {t.number for t in trials if _state(t) == "RUNNING"}


def _fail_stale(study) -> None:
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


# Attributes copied from the trial that evaluated a configuration to a trial that reuses it.
RESULT_ATTRS = ("objective", "value_kind", "objective_source", "compile_seconds", "lower_seconds", "custom_calls",
                "model_seconds", "model_source", "estimate_source", "prune_stage", "prune_reason")


class TrialRunner:
    """The objective Optuna calls: one trial of the pipeline in the module docstring."""

    def __init__(self, problem: BuildSpec, space: TuningSpace, objective: ObjectiveChoice, settings: TuneSettings,
                 cache: ResultCache, study_name: str):
        self.problem, self.space, self.objective = problem, space, objective
        self.settings, self.cache, self.study_name = settings, cache, study_name
        self.facts = space_facts(problem)
        self.key_base = key_inputs(problem.replace(tuning=TuningConfig()))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.mine: set[int] = set()  # trial numbers this process started
        self.procs: set[subprocess.Popen] = set()
        self.errors: list[BaseException] = []  # unexpected errors of worker threads
        self.stats = {"trials": 0, "compiles": 0, "cache_hits": 0, "reused_in_study": 0}

    # ---- helpers
    def key_of(self, tuning: TuningConfig) -> str:
        return cache_key({**self.key_base, "tuning": tuning.to_dict()})

    def _count(self, name: str) -> None:
        with self.lock:
            self.stats[name] += 1

    def _prune(self, trial, stage: str, reason: str):
        import optuna

        trial.set_user_attr("prune_stage", stage)
        trial.set_user_attr("prune_reason", reason)
        raise optuna.TrialPruned(f"{stage}: {reason}")

    # ---- budget
    def _gate(self, trial) -> None:
        """Evaluate only within the budget: wait while trials ahead of this one might still fill
        it; fail as surplus if they did (another process raced this one past the budget)."""
        last_stale_check = 0.0
        while True:
            trials = trial.study.get_trials(deepcopy=False)
            evaluated, infeasible, _ = tally(trials)
            ahead = sum(_state(t) == "RUNNING" and t.number < trial.number for t in trials)
            if evaluated >= self.settings.trials or infeasible >= self.settings.infeasible_cap():
                trial.set_user_attr("fail_reason", "surplus: the study had its trials when this one started")
                raise SurplusTrial(f"study already has {evaluated} evaluated trials")
            if evaluated + ahead < self.settings.trials:
                return
            if self.stop.is_set():
                raise Interrupted("interrupted before evaluating")
            if time.monotonic() - last_stale_check > self.settings.heartbeat:
                _fail_stale(trial.study)
                last_stale_check = time.monotonic()
            time.sleep(POLL_SECONDS)

    # ---- claims (see the module docstring)
    def _claim(self, trial, key: str):
        """Return a finished trial of the same configuration to reuse, or None once this trial
        owns the configuration and must evaluate it."""
        same = [t for t in trial.study.get_trials(deepcopy=False)
                if t.number != trial.number and t.user_attrs.get("config_key") == key]
        ticket = 1 + max((t.user_attrs.get("claim_ticket", 0) for t in same), default=0)
        trial.set_user_attr("claim_ticket", ticket)
        mine = (ticket, trial.number)
        last_stale_check = time.monotonic()
        while True:
            same = [t for t in trial.study.get_trials(deepcopy=False)
                    if t.number != trial.number and t.user_attrs.get("config_key") == key]
            done = sorted((t for t in same if _state(t) in FINISHED), key=lambda t: t.number)
            if done:
                return done[0]
            ahead = [t for t in same if _state(t) == "RUNNING"
                     and ("claim_ticket" not in t.user_attrs or (t.user_attrs["claim_ticket"], t.number) < mine)]
            if not ahead:
                return None
            if self.stop.is_set():
                raise Interrupted("interrupted while waiting for another trial of this configuration")
            if time.monotonic() - last_stale_check > self.settings.heartbeat:
                _fail_stale(trial.study)  # an owner that died must not hold its waiters forever
                last_stale_check = time.monotonic()
            time.sleep(POLL_SECONDS)

    # ---- finishing
    def _from_entry(self, trial, entry: dict[str, Any], via: str) -> float:
        """Finish the trial from a result-cache entry (no compile)."""
        trial.set_user_attr("cached", True)
        trial.set_user_attr("cached_from", via)
        for k in ("compile_seconds", "lower_seconds", "custom_calls", "model_seconds", "model_source"):
            trial.set_user_attr(k, entry.get(k))
        if entry["outcome"] != "ok":
            self._prune(trial, entry["stage"], entry["reason"])
        name = self.objective.name
        if name in entry.get("objectives", {}):
            o = entry["objectives"][name]
        else:  # the model objective served from the model value every compile records
            o = {"value": entry["model_seconds"], "value_kind": "tpumk model", "source": entry["model_source"]}
        return self._complete(trial, o)

    def _complete(self, trial, o: dict[str, Any]) -> float:
        trial.set_user_attr("objective", self.objective.name)
        trial.set_user_attr("value_kind", o["value_kind"])
        trial.set_user_attr("objective_source", o["source"])
        if self.objective.name == "compiler":
            trial.set_user_attr("estimate_source", o["source"])
        return float(o["value"])

    def _reuse(self, trial, other) -> float:
        """Finish the trial with the result of a finished trial of the same configuration."""
        trial.set_user_attr("cached", True)
        trial.set_user_attr("cached_from", f"trial {other.number}")
        trial.set_user_attr("duplicate_of", other.number)
        for k in RESULT_ATTRS:
            if k in other.user_attrs:
                trial.set_user_attr(k, other.user_attrs[k])
        if _state(other) == "PRUNED":
            import optuna

            raise optuna.TrialPruned(f"{other.user_attrs.get('prune_stage')}: {other.user_attrs.get('prune_reason')}")
        return float(other.value)

    # ---- evaluation
    def _run_worker(self, trial, tuning: TuningConfig) -> tuple[dict[str, Any] | None, str, int | None]:
        """Run tpumk.tune.worker; returns (its reply or None, why there is none, its exit code:
        None when it was killed for running over the timeout)."""
        request = {"spec": self.problem.replace(tuning=tuning).to_dict(), "objective": self.objective.name,
                   "deadline_seconds": self.settings.timeout, "device_warmup": self.objective.device_warmup,
                   "device_repeats": self.objective.device_repeats}
        # Its own session: a timeout kills the worker and the profiling compile it may have started.
        proc = subprocess.Popen([sys.executable, "-m", "tpumk.tune.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        with self.lock:
            self.procs.add(proc)
        try:
            out, err = proc.communicate(json.dumps(request), timeout=self.settings.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return None, f"timed out after {self.settings.timeout:g} s (worker killed)", None
        finally:
            with self.lock:
                self.procs.discard(proc)
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        try:
            reply = json.loads(lines[-1]) if lines else None
        except ValueError:
            reply = None
        tail = [ln for ln in err.strip().splitlines() if ln.strip()]
        if reply is None:
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            return None, f"compile worker died ({how}): {_why(tail)[:300]}", proc.returncode
        return reply, "", proc.returncode

    def _evaluate(self, trial, tuning: TuningConfig, key: str) -> dict[str, Any]:
        """Compile + objective in a worker; store the outcome in the result cache when it is a
        property of the configuration (not of this run: timeouts and kills are not stored)."""
        t0 = time.monotonic()
        reply, failure, rc = self._run_worker(trial, tuning)
        wall = time.monotonic() - t0
        if self.stop.is_set() and (reply is None or not reply.get("ok")):
            raise Interrupted("interrupted while compiling")
        self._count("compiles")
        entry: dict[str, Any] = {"key": key, "tuning": tuning.to_dict(), "problem": self.problem.label(),
                                 "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 "study": self.study_name, "trial": trial.number, "host": socket.gethostname(),
                                 "worker_wall_seconds": wall}
        storable = True
        if reply is None:
            timed_out = rc is None
            entry.update(outcome="failed", stage="timeout" if timed_out else "crash", reason=failure)
            # A timeout depends on --timeout, a SIGKILL/SIGTERM on the machine (OOM killer, an
            # operator): neither is a property of the configuration. A crash (abort) is.
            storable = not timed_out and rc not in (-9, -15)
        elif not reply.get("ok"):
            entry.update(outcome="failed", stage=reply.get("stage", "worker"), reason=reply.get("error") or "unknown")
            storable = reply.get("stage") in ("plan", "compile", "estimate")
        else:
            entry.update(outcome="ok", objectives={self.objective.name: {
                "value": reply["value"], "value_kind": reply["value_kind"], "source": reply["source"],
                "details": reply.get("details", {})}})
        if reply is not None:
            for k in ("compile_seconds", "lower_seconds", "custom_calls", "model_seconds", "model_source"):
                entry[k] = reply.get(k)
        self.cache.log_compile({"time": entry["written"], "host": entry["host"], "pid": os.getpid(),
                                "study": self.study_name, "trial": trial.number, "key": key,
                                "objective": self.objective.name, "outcome": entry["outcome"],
                                "stage": entry.get("stage", "done"), "wall_seconds": round(wall, 3)})
        if storable:
            self.cache.put(key, entry)
        return entry

    # ---- the objective
    def __call__(self, trial) -> float:
        with self.lock:
            self.mine.add(trial.number)
        self._count("trials")
        self._gate(trial)
        values = self.space.suggest(trial)
        try:
            tuning = self.space.tuning_for(values)
        except ConfigError as e:
            self._prune(trial, "tuning", str(e))
        key = self.key_of(tuning)
        trial.set_user_attr("cached", False)
        reason = self.space.violated(tuning, self.facts)
        if reason:
            self._prune(trial, "constraint", reason)
        try:
            plan = trial_plan(self.problem, tuning)
        except PlanError as e:
            self._prune(trial, "plan", str(e))
        trial.set_user_attr("vmem_bytes", plan.vmem_total)
        trial.set_user_attr("floor_seconds", plan.floor_seconds)
        trial.set_user_attr("hbm_bytes_per_step", plan.hbm_bytes)
        # Announce the configuration before looking for others (the claim's "choosing" phase).
        trial.set_user_attr("config_key", key)
        entry = self.cache.lookup(key, self.objective.name)
        if entry is not None:
            self._count("cache_hits")
            return self._from_entry(trial, entry, "result cache")
        other = self._claim(trial, key)
        if other is not None:
            self._count("reused_in_study")
            return self._reuse(trial, other)
        entry = self.cache.lookup(key, self.objective.name)  # finished elsewhere while we claimed
        if entry is not None:
            self._count("cache_hits")
            return self._from_entry(trial, entry, "result cache")
        entry = self._evaluate(trial, tuning, key)
        for k in ("compile_seconds", "lower_seconds", "custom_calls", "model_seconds", "model_source"):
            trial.set_user_attr(k, entry.get(k))
        if entry["outcome"] != "ok":
            self._prune(trial, entry["stage"], entry["reason"])
        return self._complete(trial, entry["objectives"][self.objective.name])

    def kill_workers(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            _kill_group(p)


def _why(stderr_lines: list[str]) -> str:
    """The stderr line of a dead worker that says why (a libtpu CHECK, an XLA status, a Python error)."""
    for key in ("Check failed", "RESOURCE_EXHAUSTED", "Error", "error"):
        for line in reversed(stderr_lines):
            if key in line:
                return line.strip()
    return stderr_lines[-1].strip() if stderr_lines else "no output"


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own group (start_new_session)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------- the study
def open_study(url: str, study_name: str, identity: dict[str, Any] | None, seed: int | None,
               heartbeat: int = DEFAULT_HEARTBEAT, create: bool = True):
    """Create or load the study; a study of the same name made for another problem, space or
    objective is refused (its trials would mean something else)."""
    import optuna

    storage = open_storage(url, heartbeat)
    if not create:
        try:
            return optuna.load_study(study_name=study_name, storage=storage)
        except KeyError:
            names = optuna.get_all_study_names(storage)
            raise ConfigError(f"--study {study_name!r}: no such study in {redact(url)} "
                              f"(studies: {', '.join(names) or 'none'})") from None
    sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, direction="minimize",
                                load_if_exists=True)
    if identity is not None:
        digest = hashlib.sha256(canonical(identity)).hexdigest()
        stored = study.user_attrs.get(STUDY_ATTR)
        if stored is None:
            study.set_user_attr(STUDY_ATTR, {"digest": digest, **identity})
        elif stored.get("digest") != digest:
            raise ConfigError(f"study {study_name!r} in {redact(url)} was made for another problem, space or "
                              f"objective ({_identity_label(stored)}); give another --study")
    if seed is not None and len(study.trials):
        # A resumed study must not replay the first run's suggestions (all cache hits).
        study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.trials), constant_liar=True)
    return study


def _identity_label(stored: dict[str, Any]) -> str:
    p = stored.get("problem", {})
    return (f"{p.get('model', {}).get('name')} on {p.get('target')}, batch {p.get('batch')}, context "
            f"{p.get('context')}, objective {stored.get('objective')}")


def _enqueue_default(study, space: TuningSpace) -> None:
    """The default configuration goes first so the end summary can compare against it
    (again if the run that took it was killed before it finished)."""
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(DEFAULT_ATTR) and _state(t) in ("WAITING", "RUNNING", "COMPLETE", "PRUNED"):
            return
    study.enqueue_trial(space.default_values(), user_attrs={DEFAULT_ATTR: True})


def run(problem: BuildSpec, space: TuningSpace, objective: ObjectiveChoice, settings: TuneSettings,
        storage: str | None = None, study_name: str | None = None, out: str | Path | None = None,
        progress: Callable[[int, int, float | None], None] | None = None) -> TuneResult:
    """Run (or resume) the study until it has `settings.trials` evaluated trials (see the
    module docstring: trials pruned before compiling do not count, up to a cap)."""
    settings.validate()
    if objective.name == "device" and settings.workers > 1:
        raise ConfigError(f"--workers {settings.workers}: the device objective times trials one at a time on the "
                          "one device (parallel runs would time each other); use --workers 1")
    identity = study_identity(problem, space, objective.name)
    name = study_name or study_name_for(problem, space, objective.name)
    url = storage_url(storage, name, settings.root)
    study = open_study(url, name, identity, settings.seed, settings.heartbeat)
    cache = ResultCache(settings.cache_dir or settings.root / "cache")
    runner = TrialRunner(problem, space, objective, settings, cache, name)
    _fail_stale(study)
    _enqueue_default(study, space)
    t0 = time.monotonic()

    inflight = [0]
    progress_lock = threading.Lock()

    def report(_study=None, _trial=None) -> None:
        if progress is None:
            return
        with progress_lock:
            fin, _, _ = tally(study.get_trials(deepcopy=False))
            best = None
            try:
                best = study.best_value
            except ValueError:
                pass
            progress(min(fin, settings.trials), settings.trials, best)

    def loop() -> None:
        last_stale_check = 0.0
        while not runner.stop.is_set():
            with runner.lock:
                fin, infeasible, running = tally(study.get_trials(deepcopy=False))
                others = len(running - runner.mine)
                if fin >= settings.trials or infeasible >= settings.infeasible_cap():
                    return
                go = fin + others + inflight[0] < settings.trials
                if go:
                    inflight[0] += 1
            if not go:  # the rest of the budget is running elsewhere: wait for it to finish or die
                if time.monotonic() - last_stale_check > settings.heartbeat:
                    _fail_stale(study)
                    last_stale_check = time.monotonic()
                time.sleep(POLL_SECONDS)
                continue
            try:
                # optimize() per trial: Optuna's heartbeat thread, stale-trial check and tell.
                study.optimize(runner, n_trials=1, catch=(SurplusTrial, Interrupted), callbacks=[report])
            finally:
                with runner.lock:
                    inflight[0] -= 1

    report()
    threads = [threading.Thread(target=_guard(loop, runner), name=f"tpumk-tune-{i}", daemon=True)
               for i in range(settings.workers)]
    for th in threads:
        th.start()
    try:
        while any(th.is_alive() for th in threads):
            for th in threads:
                th.join(timeout=0.2)
    except KeyboardInterrupt:
        runner.stop.set()
        runner.kill_workers()
        for th in threads:
            th.join(timeout=30)
        raise
    if runner.errors:
        raise runner.errors[0]
    wall = time.monotonic() - t0
    result = summarize(study, space, settings.trials, top=settings.top, url=url, problem=problem,
                       objective=objective)
    result.this_run = {**runner.stats, "wall_seconds": wall}
    if result.infeasible >= settings.infeasible_cap() and result.evaluated < settings.trials:
        result.notes.append(f"stopped after {result.infeasible} configurations pruned before compiling "
                            f"(--max-infeasible {settings.infeasible_cap()}) with {result.evaluated} of "
                            f"{settings.trials} evaluated: the space is mostly infeasible for this problem")
    if out is not None and result.best_tuning is not None:
        write_tuned(out, result)
        result.out = str(out)
    elif out is not None:
        result.notes.append(f"no trial completed: {out} not written")
    return result


def _guard(fn, runner: TrialRunner):
    """Run a worker thread's loop; an unexpected error stops the others and is re-raised."""

    def wrapped() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            runner.stop.set()
            runner.kill_workers()
            runner.errors.append(e)

    return wrapped


# ---------------------------------------------------------------------- summary
def _changed(params: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if default.get(k) != v}


def summarize(study, space: TuningSpace, trials_requested: int, top: int = 5, url: str = "",
              problem: BuildSpec | None = None, objective: ObjectiveChoice | None = None) -> TuneResult:
    """The study's state: counts, the best distinct configurations, the default's trial and
    the ratio of the best over the default."""
    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[_state(t)] = counts.get(_state(t), 0) + 1
    reasons: dict[str, int] = {}
    for t in trials:
        if _state(t) == "PRUNED":
            stage = t.user_attrs.get("prune_stage", "unknown")
            reasons[stage] = reasons.get(stage, 0) + 1
    default_params = space.default_values()
    complete = sorted((t for t in trials if _state(t) == "COMPLETE"), key=lambda t: (t.value, t.number))
    seen: set[str] = set()
    best = []
    for t in complete:
        k = t.user_attrs.get("config_key", f"trial {t.number}")
        if k in seen:
            continue
        seen.add(k)
        best.append({"rank": len(best) + 1, "trial": t.number, "value_seconds": t.value,
                     "value_kind": t.user_attrs.get("value_kind"), "objective_source": t.user_attrs.get("objective_source"),
                     "changed_knobs": _changed(t.params, default_params),
                     "compile_seconds": t.user_attrs.get("compile_seconds"), "cached": t.user_attrs.get("cached"),
                     "floor_seconds": t.user_attrs.get("floor_seconds"), "vmem_bytes": t.user_attrs.get("vmem_bytes")})
        if len(best) >= top:
            break
    default_trial = None
    for t in sorted(trials, key=lambda t: t.number):
        if _state(t) in FINISHED and (t.user_attrs.get(DEFAULT_ATTR) or t.params == default_params):
            default_trial = t
            break
    default = None
    ratio = None
    if default_trial is not None:
        default = {"trial": default_trial.number, "state": _state(default_trial), "value_seconds": default_trial.value,
                   "prune_reason": default_trial.user_attrs.get("prune_reason")}
        if default_trial.value and best:
            ratio = best[0]["value_seconds"] / default_trial.value
    stored = study.user_attrs.get(STUDY_ATTR, {})
    evaluated, infeasible, _ = tally(trials)
    best_tuning = space.tuning_for(complete[0].params).to_dict() if complete else None
    label = problem.label() if problem else _identity_label(stored)
    notes = []
    if default is not None and default["state"] == "PRUNED":
        notes.append(f"the default configuration was pruned ({default['prune_reason']}): no ratio to it")
    return TuneResult(
        study=study.study_name, storage=redact(url), problem=label, space=f"{space.name} ({space.source})",
        objective=objective.name if objective else stored.get("objective", "?"),
        objective_reason=objective.reason if objective else "", trials_requested=trials_requested,
        counts=counts, evaluated=evaluated, infeasible=infeasible, this_run={}, best=best, default=default, best_over_default=ratio, best_tuning=best_tuning,
        floor_seconds=best[0]["floor_seconds"] if best else None, prune_reasons=reasons, notes=notes)


def write_tuned(path: str | Path, result: TuneResult) -> None:
    """The best configuration as a `[tuning]` TOML file (`tpumk build/export --tuning`), with
    where it came from in comments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    b = result.best[0]
    tuning = TuningConfig.from_dict(result.best_tuning)
    ratio = "n/a" if result.best_over_default is None else f"{result.best_over_default:.3f}"
    head = [f"# tuned by tpumk tune: {result.problem}",
            f"# study {result.study} in {result.storage}, trial {b['trial']}",
            f"# step {b['value_seconds'] * 1e6:.2f} us ({b['value_kind']}); best / default = {ratio}"]
    write_text_atomic(path, "\n".join(head) + "\n" + tuning.to_toml())


def trials_to_within(study, fraction: float = 0.05) -> int | None:
    """Evaluated trials (the budget's unit, in trial-number order) until one came within
    `fraction` of the study's best value."""
    trials = sorted((t for t in study.get_trials(deepcopy=False) if _state(t) in FINISHED and not _free(t)),
                    key=lambda t: t.number)
    values = [t.value for t in trials if _state(t) == "COMPLETE"]
    if not values:
        return None
    target = min(values) * (1 + fraction)
    for i, t in enumerate(trials, 1):
        if _state(t) == "COMPLETE" and t.value <= target:
            return i
    return None
