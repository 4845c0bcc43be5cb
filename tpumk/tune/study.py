"""`tpumk tune`: an Optuna study over the megakernel's knobs, every trial a real compile.

A study tunes one *problem* (model, target, step shapes) over one tuning space
(tpumk.tune.space) for one objective (tpumk.tune.objectives), measured by one version of the
evaluation code, and lives in an Optuna storage (tpumk.tune.storage: SQLite by default, a
journal file, or PostgreSQL for workers on many machines).

The study name (default `study_name_for`) is derived from the problem, the space's content,
the objective and the evaluator's source digest, so the same command with the same code finds
the same study and resumes it (`load_if_exists`).

The pieces, one concern each:
- tpumk.tune.budget: which trials count against `--trials`, and the check before a trial starts;
- tpumk.tune.trial: one trial (suggest -> precheck -> lookup -> evaluate -> finish);
- tpumk.tune.cache: the result cache, keyed by everything that computed a value;
- tpumk.tune.claims: the bakery claim, so a study never evaluates a configuration twice;
- tpumk.tune.storage: storage URLs, heartbeats, stale trials;
- this module: the study's identity and name, running it with worker threads, the summary
  and the tuned `[tuning]` file.

Resume: a killed run's RUNNING trials become FAIL after the heartbeat's grace period and stop
counting; the rerun then finishes the budget, taking every configuration that had finished from
the cache. A rerun of a study that already has its trials runs nothing and says so
(`TuneResult.already_complete`); a larger `--trials` extends it.

Workers: `workers` threads in this process each drive one trial at a time; the compile runs in
the trial's own worker process, so threads suffice. More machines = more `tpumk tune` processes
on one PostgreSQL storage.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tpumk.compile.keys import canonical
from tpumk.errors import ConfigError, TpumkError, count_of, one_line
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.tomlfile import write_text_atomic
from tpumk.tune.budget import (FINISHED, POLL_SECONDS, Interrupted, SurplusTrial, foreign, is_free, is_spent, own,
                               repeats, state, tally)
from tpumk.tune.cache import ResultCache, ResultKeys, evaluator_inputs
from tpumk.tune.objectives import ObjectiveChoice
from tpumk.tune.settings import TuneSettings
from tpumk.tune.space import TuningSpace
from tpumk.tune.storage import DEFAULT_HEARTBEAT, fail_stale, open_storage, redact, scrub, storage_url
from tpumk.tune.trial import TrialRunner

STUDY_ATTR = "tpumk_problem"
# a round build's trial (tpumk.tune.trial._per_accepted_token): its block and round, in the ranking
ROUND_ATTRS = ("draft_block", "round_seconds", "accepted_tokens_per_round", "accepted_tokens_per_second")
MAX_IGNORED_NOTES = 5  # foreign trials named one per line in the summary; the rest in one more
DEFAULT_ATTR = "tpumk_default"  # user attr of the enqueued default-configuration trial


# ---------------------------------------------------------------------- identity
def describe(problem: BuildSpec) -> dict[str, Any]:
    """The problem as plain data, without the knobs a study searches."""
    return {k: v for k, v in problem.to_dict().items() if k != "tuning"}


def space_fingerprint(space: TuningSpace) -> dict[str, Any]:
    """What a space searches, as plain data (its distributions, fixed knobs and constraints)."""
    from optuna.distributions import distribution_to_json

    return {"knobs": {k: json.loads(distribution_to_json(d)) for k, d in sorted(space.distributions().items())},
            "fixed": dict(sorted(space.fixed.items())),
            "constraints": [getattr(c, "expr", str(c)) for c in space.constraints]}


def study_identity(problem: BuildSpec, space: TuningSpace, objective: str,
                   evaluator: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a study's trials mean. The evaluator's source (the units tpumk.tune.worker reaches
    and their digest, as in the result-cache key) is part of it: values computed by other code
    (another timeline model, another kernel, another compiler-estimate conversion) are not
    comparable with this code's, so TPE must not learn from them and the ranking must not mix
    them. A change of that code therefore starts a new study (a new default name) rather than
    resuming the old one; resuming would gain nothing anyway, since every result-cache entry
    of the old code misses."""
    ev = evaluator if evaluator is not None else evaluator_inputs()
    space = space.for_build(problem)  # a computed knob's choices are part of what the study searches
    return {"problem": describe(problem), "space": space_fingerprint(space), "objective": objective,
            "evaluator": {"units": ev["units"], "sha256": ev["sha256"]}}


def study_name_for(problem: BuildSpec, space: TuningSpace, objective: str,
                   evaluator: dict[str, Any] | None = None) -> str:
    """Stable across processes and machines: readable fields plus a digest of everything."""
    identity = study_identity(problem, space, objective, evaluator)
    digest = hashlib.sha256(canonical(identity)).hexdigest()[:10]
    dt = {"bfloat16": "bf16", "float32": "f32"}.get(problem.model.dtype, problem.model.dtype)
    q = f"-q{problem.q_len}" if problem.q_len > 1 else ""
    q += f"-{problem.draft.drafter.kind}" if problem.draft is not None else ""
    d = f"-d{problem.devices}" if problem.devices > 1 else ""
    name = (f"{problem.model.name}-{dt}-{problem.target.name}{d}-b{problem.batch}-c{problem.context}{q}"
            f"-{space.name}-{objective}-{digest}")
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


# ---------------------------------------------------------------------- the study
def open_study(url: str, study_name: str, identity: dict[str, Any] | None, seed: int | None,
               heartbeat: int = DEFAULT_HEARTBEAT, create: bool = True, sampler=None):
    """Create or load the study; a study of the same name made for another problem, space,
    objective or evaluation code is refused (its trials would mean something else). `sampler`:
    run's DistinctSampler (tpumk.tune.sampler); by default Optuna's TPE."""
    import optuna

    storage = open_storage(url, heartbeat)
    if not create:
        try:
            return optuna.load_study(study_name=study_name, storage=storage)
        except KeyError:
            names = optuna.get_all_study_names(storage)
            raise ConfigError(f"--study {study_name!r}: no such study in {redact(url)} "
                              f"(studies: {', '.join(names) or 'none'})") from None
    reseed = sampler is None and seed is not None
    if sampler is None:
        sampler = optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler, direction="minimize",
                                load_if_exists=True)
    if identity is not None:
        digest = hashlib.sha256(canonical(identity)).hexdigest()
        stored = study.user_attrs.get(STUDY_ATTR)
        if stored is None:
            study.set_user_attr(STUDY_ATTR, {"digest": digest, **identity})
        elif stored.get("digest") != digest:
            same_task = all(stored.get(k) == identity[k] for k in ("problem", "space", "objective"))
            if same_task:
                old = (stored.get("evaluator") or {}).get("sha256", "none recorded")
                raise ConfigError(f"study {study_name!r} in {redact(url)} was evaluated by other tpumk code "
                                  f"(evaluator source {old[:12]}, now {identity['evaluator']['sha256'][:12]}): "
                                  "its values are not comparable with this code's; give another --study "
                                  "(the default name follows the code)")
            raise ConfigError(f"study {study_name!r} in {redact(url)} was made for another problem, space or "
                              f"objective ({_identity_label(stored)}); give another --study")
    if reseed and len(study.trials):
        # A resumed study must not replay the first run's suggestions (all cache hits).
        study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.trials), constant_liar=True)
    return study


def _identity_label(stored: dict[str, Any]) -> str:
    p = stored.get("problem", {})
    on = f"{p.get('devices')} x {p.get('target')}" if (p.get("devices") or 1) > 1 else p.get("target")
    return (f"{p.get('model', {}).get('name')} on {on}, batch {p.get('batch')}, context "
            f"{p.get('context')}, objective {stored.get('objective')}")


def _enqueue_default(study, space: TuningSpace) -> None:
    """The default configuration goes first so the end summary can compare against it
    (again if the run that took it was killed before it finished)."""
    for t in own(study.get_trials(deepcopy=False), space):
        if t.user_attrs.get(DEFAULT_ATTR) and state(t) in ("WAITING", "RUNNING", "COMPLETE", "PRUNED"):
            return
    study.enqueue_trial(space.default_values(), user_attrs={DEFAULT_ATTR: True})


def finished_trial(t) -> dict[str, Any]:
    """One finished trial as plain data, for a log line: number, state, value and its kind,
    where a reused value came from, why it was pruned or failed."""
    a = t.user_attrs
    return {"trial": t.number, "state": state(t), "value_seconds": t.value if state(t) == "COMPLETE" else None,
            "value_kind": a.get("value_kind"), "cached_from": a.get("cached_from") if a.get("cached") else None,
            "prune_stage": a.get("prune_stage"), "prune_reason": a.get("prune_reason"),
            "fail_reason": a.get("fail_reason"), "default": bool(a.get(DEFAULT_ATTR))}


def run(problem: BuildSpec, space: TuningSpace, objective: ObjectiveChoice, settings: TuneSettings,
        storage: str | None = None, study_name: str | None = None, out: str | Path | None = None,
        progress: Callable[[int, int, float | None], None] | None = None,
        on_trial: Callable[[dict[str, Any]], None] | None = None, keys: ResultKeys | None = None) -> TuneResult:
    """Run (or resume) the study until it has `settings.trials` distinct evaluated
    configurations (see tpumk.tune.budget: trials pruned before compiling and trials repeating
    an evaluated configuration do not count, each up to a cap; the study also ends when every
    point of the space's grid was tried). `out` is checked writable before anything runs.

    progress(done, total, best) is called at the start and after every trial this process
    finishes; on_trial(finished_trial(t) + {"evaluated", "trials"}) after every such trial.
    `keys`: the problem's ResultKeys when the caller already made them (the evaluator's source
    is then read once, and the study name and the keys name the same code).

    Raises NothingFeasible when the study ends with no configuration evaluated (every one it
    drew was ruled out before compiling), and StudyStopped when its storage, the result cache
    or `out` fails mid-study (one line each; the finished trials stay in the storage)."""
    settings.validate()
    space = space.for_build(problem)  # computed knobs get this build's choices (the default too)
    if out is not None:
        check_writable(out, "--out")
    if objective.name == "device" and settings.workers > 1:
        raise ConfigError(f"--workers {settings.workers}: the device objective times trials one at a time on the "
                          "one device (parallel runs would time each other); use --workers 1")
    keys = keys or ResultKeys(problem)
    identity = study_identity(problem, space, objective.key, keys.evaluator)
    name = study_name or study_name_for(problem, space, objective.key, keys.evaluator)
    url = storage_url(storage, name, settings.root)
    cache = ResultCache(settings.cache_dir or settings.root / "cache")
    runner = TrialRunner(problem, space, objective, settings, cache, name, keys)
    from tpumk.tune.sampler import DistinctSampler

    # Draws the space rules out, or that repeat a tried configuration, never become trials.
    sampler = DistinctSampler(space, settings.seed, rules_out=runner.rules_out)

    def study_run() -> TuneResult:
        study = open_study(url, name, identity, settings.seed, settings.heartbeat, sampler=sampler)
        fail_stale(study)
        already_complete = is_spent(own(study.get_trials(deepcopy=False), space), settings)
        _enqueue_default(study, space)
        t0 = time.monotonic()

        inflight = [0]
        progress_lock = threading.Lock()

        def report(_study=None, trial=None) -> None:
            if progress is None and on_trial is None:
                return
            with progress_lock:
                trials = own(study.get_trials(deepcopy=False), space)
                fin, _, _ = tally(trials)
                if trial is not None and on_trial is not None:
                    on_trial({**finished_trial(trial), "evaluated": fin, "trials": settings.trials})
                if progress is not None:
                    best = min((t.value for t in trials if state(t) == "COMPLETE"), default=None)
                    progress(min(fin, settings.trials), settings.trials, best)

        def loop() -> None:
            last_stale_check = 0.0
            while not runner.stop.is_set():
                with runner.lock:
                    trials = own(study.get_trials(deepcopy=False), space)
                    fin, _, running = tally(trials)
                    others = len(running - runner.mine)
                    if is_spent(trials, settings) or _exhausted(trials, space) or sampler.exhausted:
                        return
                    go = fin + others + inflight[0] < settings.trials
                    if go:
                        inflight[0] += 1
                if not go:  # the rest of the budget is running elsewhere: wait for it to finish or die
                    if time.monotonic() - last_stale_check > settings.heartbeat:
                        fail_stale(study)
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
        result.this_run = {**runner.stats, "wall_seconds": wall, "passed_over": dict(sampler.passed_over)}
        if already_complete and runner.stats["trials"] == 0:
            result.already_complete = True
            if result.evaluated >= settings.trials:
                how = (f"it already has {count_of(result.evaluated, 'evaluated trial')} (--trials {settings.trials}); "
                       f"to extend it, rerun with a larger --trials, e.g. --trials {2 * settings.trials}")
            elif result.repeated >= settings.repeats_cap():
                how = (f"it already stopped at {count_of(result.repeated, 'trial')} repeating evaluated configurations "
                       f"(at most 10 x --trials)")
            elif _exhausted(own(study.get_trials(deepcopy=False), space), space):
                how = "every configuration of the space was already tried"
            else:
                how = (f"it already stopped at {count_of(result.infeasible, 'configuration')} pruned before compiling "
                       f"(--max-infeasible {settings.infeasible_cap()}); to go on, rerun with a larger --max-infeasible")
            result.notes.insert(0, f"study {name} is complete, nothing was run: {how}")
        if result.infeasible >= settings.infeasible_cap() and result.evaluated < settings.trials:
            result.notes.append(f"stopped after {count_of(result.infeasible, 'configuration')} pruned before compiling "
                                f"(--max-infeasible {settings.infeasible_cap()}) with {result.evaluated} of "
                                f"{settings.trials} evaluated: the space is mostly infeasible for this problem")
        elif result.repeated >= settings.repeats_cap() and result.evaluated < settings.trials:
            result.notes.append(f"stopped after {count_of(result.repeated, 'trial')} repeating configurations already "
                                f"evaluated with {result.evaluated} of {settings.trials} evaluated: the sampler finds "
                                "few new configurations in this space")
        elif result.evaluated < settings.trials and _exhausted(own(study.get_trials(deepcopy=False), space), space):
            result.notes.append(f"every configuration of the space was tried: {result.evaluated} evaluated, fewer "
                                f"than --trials {settings.trials}")
        elif result.evaluated < settings.trials and sampler.exhausted:
            result.notes.append(f"every configuration of the space was tried or ruled out by its constraints: "
                                f"{result.evaluated} evaluated, fewer than --trials {settings.trials}")
        if result.evaluated == 0 and result.infeasible:
            raise NothingFeasible(nothing_feasible(own(study.get_trials(deepcopy=False), space), space, problem,
                                                   sampler.refused, settings.infeasible_cap()))
        if out is not None and result.best_tuning is not None:
            write_tuned(out, result)
            result.out = str(out)
        elif out is not None:
            result.notes.append(f"no trial completed: {out} not written")
        return result

    try:
        with warnings.catch_warnings():
            # an enqueued trial with a value outside the space (another process's) is pruned at
            # stage "space" with one line; Optuna's own warning about it would be a second
            warnings.filterwarnings("ignore", message=r"Fixed parameter .* is out of range", category=UserWarning)
            return study_run()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a storage or file failure becomes one line; anything else is re-raised
        why = why_stopped(e, url, cache.dir, out)
        if why is None:
            raise
        raise StudyStopped(scrub(f"study {name} stopped: {why}", url)) from None


class NothingFeasible(ConfigError):
    """The study ended with no configuration evaluated: the space's constraints, the knob rules
    or the plan ruled out every configuration it drew for this build."""


def nothing_feasible(trials, space: TuningSpace, problem: BuildSpec, refused: dict[tuple, str], cap: int) -> str:
    """One line for a study that evaluated nothing: how many distinct configurations were
    rejected before compiling and by what (trials pruned before compiling, and draws the sampler
    passed over), the first reason, and whether that was the whole grid or what the study drew
    before `cap` (--max-infeasible) ended it."""
    from tpumk.tune.sampler import params_key

    stages = dict(refused)
    first = None
    for t in sorted(trials, key=lambda t: t.number):
        if is_free(t):
            stages[params_key(t.params)] = t.user_attrs.get("prune_stage", "unknown")
            first = first or f"{t.user_attrs.get('prune_stage')}: {t.user_attrs.get('prune_reason')}"
    by_stage: dict[str, int] = {}
    for stage in stages.values():
        by_stage[stage] = by_stage.get(stage, 0) + 1
    counted = ", ".join(f"{stage} {n:,}" for stage, n in sorted(by_stage.items(), key=lambda kv: -kv[1]))
    rejected = f"{count_of(len(stages), 'configuration')} rejected before compiling ({counted})"
    if len(stages) >= space.size():  # the whole grid: proven
        head = f"no configuration of its {count_of(space.size(), 'grid point')} can be evaluated"
        tail = "no tuned file written"
    else:  # what it drew before --max-infeasible
        head = f"none of the configurations drawn from its {count_of(space.size(), 'grid point')} could be evaluated"
        tail = f"no tuned file written (--max-infeasible {cap} ended it: raise it to draw more, or widen the space)"
    return (f"--space {space.source}: {head} for {problem.label()}: {rejected}, e.g. {first or 'none recorded'}; "
            f"{tail}")


class StudyStopped(TpumkError):
    """The study's storage, the result cache or an output failed mid-study (a full disk, a
    database that went away): the trials that finished are kept, and the same command resumes."""


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions it was raised from or while handling, outermost first."""
    out: list[BaseException] = []
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _environment_errors() -> tuple[type, ...]:
    """Errors of the machine or a server, not of tpumk: a file system, SQLite, a database driver."""
    import sqlite3

    import optuna
    import sqlalchemy.exc

    return OSError, sqlite3.Error, sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError


def why_stopped(e: BaseException, url: str, cache_dir: Path, out: str | Path | None) -> str | None:
    """One line for a study stopped by its storage, the result cache or an output failing (a
    full disk under the journal, the compile log or SQLite; PostgreSQL stopping): what failed,
    why, and that the same command resumes. None when `e` is not such a failure (a tpumk error,
    a bug: raised as it is). Optuna raises its own errors while handling the storage's (e.g.
    `AssertionError: Should not reach.`), so the whole chain is searched."""
    import traceback

    import sqlalchemy.exc

    if isinstance(e, TpumkError):
        return None
    chain = _chain(e)
    env = [x for x in chain if isinstance(x, _environment_errors())]
    if not env:
        return None
    # the first to happen; Optuna's StorageInternalError only wraps the database's own error
    import optuna

    root = ([x for x in env if not isinstance(x, optuna.exceptions.StorageInternalError)] or env)[-1]
    files = [f.filename for x in chain for f in traceback.extract_tb(x.__traceback__)]
    sep = os.sep
    if isinstance(root, OSError):
        text = root.strerror or one_line(root) or type(root).__name__
        if root.filename:
            text += f": {root.filename}"
    elif isinstance(root, sqlalchemy.exc.DBAPIError) and root.orig is not None:
        text = one_line(root.orig)
    else:
        text = one_line(root).split(" [SQL: ")[0].split(" (Background on this error")[0]
    database = not isinstance(root, OSError) or any(f"{sep}optuna{sep}storages{sep}" in f for f in files)
    if database:
        what = f"the study's storage ({redact(url)})"
    elif any(f.endswith(f"tpumk{sep}tune{sep}cache.py") for f in files):
        what = f"the result cache ({cache_dir})"
    elif out is not None and any(f.endswith(f"tpumk{sep}tomlfile.py") for f in files):
        what = f"writing --out {out}"
    else:
        what = "a file the study writes"
    full = (isinstance(root, OSError) and root.errno in (errno.ENOSPC, errno.EDQUOT)) or "disk is full" in text
    if full:
        fix = "free some space, then rerun"
    elif isinstance(root, OSError) and root.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "make it writable, then rerun"
    elif database and "://" in url and not url.startswith("sqlite"):
        fix = "once the database server is reachable again, rerun"
    else:
        fix = "once that is fixed, rerun"
    return f"{what} failed: {text[:300]}; every trial that finished is kept: {fix} the same command to resume it"


def _exhausted(trials, space: TuningSpace) -> bool:
    """Every point of the space's grid has a finished trial (nothing new left to suggest) and
    at least one was evaluated. (A space with nothing feasible runs on to --max-infeasible
    instead, whose note says the space is infeasible for the problem.)"""
    size = space.size()
    if size > 100_000 or not any(state(t) in FINISHED and not is_free(t) for t in trials):
        return False
    seen = {tuple(sorted(t.params.items(), key=lambda kv: kv[0])) for t in trials if state(t) in FINISHED}
    return len(seen) >= size


def check_writable(path: str | Path, option: str, directory: bool = False) -> None:
    """Refuse, before a study starts, an output path that could not be written at its end:
    one line naming the option and the path (a parent that is a file, no permission, a file
    where a directory is wanted or the other way round)."""
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise ConfigError(f"{option} {path}: exists and is not a directory")
        if not directory and p.is_dir():
            raise ConfigError(f"{option} {path}: is a directory (expected a file path)")
        if not os.access(p if directory else p.parent, os.W_OK | os.X_OK) or \
                (not directory and not os.access(p, os.W_OK)):
            raise ConfigError(f"{option} {path}: not writable")
        return
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: cannot be created: {parent} is not writable")


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
    evaluated: int  # the budget: distinct configurations COMPLETE or pruned after compiling
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
    already_complete: bool = False  # the study had its trials before this run: nothing was run
    reused: int = 0  # finished trials that took an earlier result (result cache or another trial), no compile
    repeated: int = 0  # trials of a configuration the study had already evaluated: outside the budget
    devices: int = 1  # devices one step of the tuned build spans (--devices)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _changed(params: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if default.get(k) != v}


def summarize(study, space: TuningSpace, trials_requested: int, top: int = 5, url: str = "",
              problem: BuildSpec | None = None, objective: ObjectiveChoice | None = None) -> TuneResult:
    """The study's state: counts, the best distinct configurations, the default's trial and
    the ratio of the best over the default. Finished trials `foreign` to the study (another
    process wrote them: a value that is no step time, knobs outside the space) are left out,
    each named in one note."""
    if problem is not None:
        space = space.for_build(problem)
    trials = study.get_trials(deepcopy=False)
    ignored = [(t.number, why) for t in trials if state(t) in FINISHED and (why := foreign(t, space)) is not None]
    trials = own(trials, space)
    counts: dict[str, int] = {}
    for t in trials:
        counts[state(t)] = counts.get(state(t), 0) + 1
    reasons: dict[str, int] = {}
    for t in trials:
        if state(t) == "PRUNED":
            stage = t.user_attrs.get("prune_stage", "unknown")
            reasons[stage] = reasons.get(stage, 0) + 1
    default_params = space.default_values()
    complete = sorted((t for t in trials if state(t) == "COMPLETE"), key=lambda t: (t.value, t.number))
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
                     "floor_seconds": t.user_attrs.get("floor_seconds"), "vmem_bytes": t.user_attrs.get("vmem_bytes"),
                     **{k: t.user_attrs[k] for k in ROUND_ATTRS if k in t.user_attrs}})
        if len(best) >= top:
            break
    default_trial = None
    for t in sorted(trials, key=lambda t: t.number):
        if state(t) in FINISHED and (t.user_attrs.get(DEFAULT_ATTR) or t.params == default_params):
            default_trial = t
            break
    default = None
    ratio = None
    if default_trial is not None:
        default = {"trial": default_trial.number, "state": state(default_trial), "value_seconds": default_trial.value,
                   "prune_reason": default_trial.user_attrs.get("prune_reason")}
        if default_trial.value and best:
            ratio = best[0]["value_seconds"] / default_trial.value
    stored = study.user_attrs.get(STUDY_ATTR, {})
    evaluated, infeasible, _ = tally(trials)
    reused = sum(state(t) in FINISHED and bool(t.user_attrs.get("cached")) for t in trials)
    repeated = len(repeats(trials))
    best_tuning = space.tuning_for(complete[0].params).to_dict() if complete else None
    label = problem.label() if problem else _identity_label(stored)
    notes = [f"ignored trial {n}: {why}; another process wrote it into the shared study" for n, why in
             ignored[:MAX_IGNORED_NOTES]]
    if len(ignored) > MAX_IGNORED_NOTES:
        notes.append(f"ignored {count_of(len(ignored) - MAX_IGNORED_NOTES, 'more such trial')} "
                     f"({', '.join(str(n) for n, _ in ignored[MAX_IGNORED_NOTES:][:20])}"
                     f"{', ...' if len(ignored) > MAX_IGNORED_NOTES + 20 else ''})")
    if default is not None and default["state"] == "PRUNED":
        notes.append(f"the default configuration was pruned ({default['prune_reason']}): no ratio to it")
    return TuneResult(
        study=study.study_name, storage=redact(url), problem=label, space=f"{space.name} ({space.source})",
        objective=objective.name if objective else stored.get("objective", "?"),
        objective_reason=objective.reason if objective else "", trials_requested=trials_requested,
        counts=counts, evaluated=evaluated, infeasible=infeasible, this_run={}, reused=reused, repeated=repeated,
        best=best, default=default,
        best_over_default=ratio, best_tuning=best_tuning,
        floor_seconds=best[0]["floor_seconds"] if best else None, prune_reasons=reasons, notes=notes,
        devices=problem.devices if problem else (stored.get("problem") or {}).get("devices", 1))


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
    """Evaluated configurations (the budget's unit, in trial-number order) until one came
    within `fraction` of the study's best value."""
    all_trials = study.get_trials(deepcopy=False)
    again = {t.number for t in repeats(all_trials)}
    trials = sorted((t for t in all_trials if state(t) in FINISHED and not is_free(t) and t.number not in again),
                    key=lambda t: t.number)
    values = [t.value for t in trials if state(t) == "COMPLETE"]
    if not values:
        return None
    target = min(values) * (1 + fraction)
    for i, t in enumerate(trials, 1):
        if state(t) == "COMPLETE" and t.value <= target:
            return i
    return None
