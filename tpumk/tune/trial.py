"""One trial: the objective Optuna calls, in named phases.

    suggest   the space's values for this trial (Optuna's sampler); values outside the space (a
              trial another process enqueued into a shared study) are PRUNED at stage "space"
    precheck  the TuningConfig (space.tuning_for), the space's constraints, the plan
              (PlanError): an infeasible configuration is PRUNED with its reason, never compiled
    lookup    the result cache (tpumk.tune.cache), then the claim on the configuration in the
              study (tpumk.tune.claims): a hit or another trial's result finishes the trial
    evaluate  compile + objective in a worker process (tpumk.tune.worker) with the per-trial
              timeout; the outcome goes to the result cache when it is a property of the
              configuration
    finish    the objective's value, or PRUNED with the compiler's reason (rejection, crash,
              timeout)

Before the phases the trial waits for room in the budget (tpumk.tune.budget). Every finished
trial carries user attrs saying what it is: `config_key`, `objective`, `value_kind` (compiler
estimate / tpumk model / measured on device), `objective_source`, `compile_seconds`,
`vmem_bytes`, `floor_seconds`, `cached`, and for pruned ones `prune_stage` and `prune_reason`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from datetime import datetime, timezone
from typing import Any

from tpumk.child_process import command
from tpumk.errors import ConfigError, PlanError, TpumkError
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.tune.budget import Interrupted, is_step_time, state, wait_for_budget
from tpumk.tune.cache import CONFIG_STAGES, EVALUATOR, ResultCache, ResultKeys
from tpumk.tune.claims import KEY_ATTR, claim
from tpumk.tune.objectives import ObjectiveChoice
from tpumk.tune.settings import TuneSettings
from tpumk.tune.space import TuningSpace, space_facts

# Worker stages after the compile that belong to one objective: a failure there is that
# objective's, not the configuration's.
OBJECTIVE_STAGES = ("estimate",)

# Attributes copied from the trial that evaluated a configuration to a trial that reuses it.
RESULT_ATTRS = ("objective", "value_kind", "objective_source", "compile_seconds", "lower_seconds", "custom_calls",
                "model_seconds", "model_source", "estimate_source", "prune_stage", "prune_reason",
                # a round build's (`_per_accepted_token`)
                "draft_block", "round_seconds", "accepted_tokens_per_round", "accepted_tokens_per_second")
# What every evaluation records next to its value (copied onto the trial from a cache entry).
EVALUATION_ATTRS = ("compile_seconds", "lower_seconds", "custom_calls", "model_seconds", "model_source")


class SourceChanged(TpumkError):
    """The evaluation code changed on disk while the study ran: nothing it computed is stored."""


def trial_plan(problem: BuildSpec, tuning: TuningConfig):
    """A study tunes one BuildSpec; its `tuning` is the default, and each trial swaps in its own."""
    from tpumk.plan.plan import make_plan

    return make_plan(problem.replace(tuning=tuning))


class TrialRunner:
    """The objective Optuna calls: one trial, in the phases of the module docstring."""

    def __init__(self, problem: BuildSpec, space: TuningSpace, objective: ObjectiveChoice, settings: TuneSettings,
                 cache: ResultCache, study_name: str, keys: ResultKeys | None = None):
        self.problem, self.objective = problem, objective
        self.space = space.for_build(problem)  # computed knobs get this build's choices
        self.settings, self.cache, self.study_name = settings, cache, study_name
        self._facts: dict[tuple, dict[str, Any]] = {}  # by expert_parallel and draft_block, the knobs facts depend on
        self.keys = keys or ResultKeys(problem)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.mine: set[int] = set()  # trial numbers this process started
        self.procs: set[subprocess.Popen] = set()
        self.errors: list[BaseException] = []  # unexpected errors of worker threads
        self.stats = {"trials": 0, "compiles": 0, "cache_hits": 0, "reused_in_study": 0}

    # ---- the objective
    def __call__(self, trial) -> float:
        self._begin(trial)
        values = self.space.suggest(trial)
        outside = self.space.outside(values)
        if outside is not None:  # enqueued by another process with values the space does not have
            self._prune(trial, "space", f"trial {trial.number} is not a configuration of the space: {outside}")
        tuning = self._precheck(trial, values)
        key = self.key_of(tuning)
        found = self._lookup(trial, key)
        if found is not None:
            return found
        entry = self._evaluate(trial, tuning, key)
        return self._finish(trial, entry)

    # ---- phases
    def _begin(self, trial) -> None:
        """Count the trial as this process's and wait for room in the budget."""
        with self.lock:
            self.mine.add(trial.number)
        self._count("trials")
        wait_for_budget(trial, self.settings, self.stop, self.space)

    def _precheck(self, trial, values: dict[str, Any]) -> TuningConfig:
        """The configuration, pruned before compiling if the space or the plan rules it out."""
        trial.set_user_attr("cached", False)
        ruled_out = self.rules_out(values)
        if ruled_out is not None:
            self._prune(trial, *ruled_out)
        tuning = self.space.tuning_for(values)
        try:
            plan = trial_plan(self.problem, tuning)
        except PlanError as e:
            self._prune(trial, "plan", str(e))
        trial.set_user_attr("vmem_bytes", plan.vmem_total)
        trial.set_user_attr("floor_seconds", plan.floor_seconds)
        trial.set_user_attr("hbm_bytes_per_step", plan.hbm_bytes)
        return tuning

    def _lookup(self, trial, key: str) -> float | None:
        """The value from the result cache or another trial of the study (or PRUNED as that
        one was); None when this trial owns the configuration and must evaluate it."""
        # Announce the configuration before looking for others (the claim's "choosing" phase),
        # with a heartbeat on record first: Optuna's RDB storages never count a RUNNING trial
        # without one as stale, so an owner killed before its heartbeat thread's first beat
        # would hold the waiters of its configuration forever.
        beat = getattr(trial.study._storage, "record_heartbeat", None)
        if beat is not None and self.settings.heartbeat:
            beat(trial._trial_id)
        trial.set_user_attr(KEY_ATTR, key)
        entry = self.cache.lookup(key, self.objective.name)
        if entry is not None:
            self._count("cache_hits")
            return self._from_entry(trial, entry, "result cache")
        other = claim(trial, key, self.stop, self.settings.heartbeat, self.space)
        if other is not None:
            self._count("reused_in_study")
            return self._reuse(trial, other)
        entry = self.cache.lookup(key, self.objective.name)  # finished elsewhere while we claimed
        if entry is not None:
            self._count("cache_hits")
            return self._from_entry(trial, entry, "result cache")
        return None

    def _evaluate(self, trial, tuning: TuningConfig, key: str) -> dict[str, Any]:
        """Compile + objective in a worker; store the outcome in the result cache when it is a
        property of the configuration (not of this run: timeouts and kills are not stored)."""
        t0 = time.monotonic()
        reply, failure, rc = self._run_worker(trial, tuning)
        wall = time.monotonic() - t0
        if self.stop.is_set() and (reply is None or not reply.get("ok")):
            raise Interrupted("interrupted while compiling")
        ran = (reply or {}).get("evaluator_sha256")
        if ran is not None and ran != self.keys.evaluator["sha256"]:
            # The worker ran other code than the key (and the study's identity) names: its value
            # belongs to no key this run knows. Stop rather than store or rank it.
            trial.set_user_attr("fail_reason", "tpumk source changed during the run")
            raise SourceChanged("tpumk's source changed while the study ran (the compile worker ran code "
                                f"{ran[:12]}, the study is for {self.keys.evaluator['sha256'][:12]}): rerun to "
                                "tune with the new code (a new study)")
        self._count("compiles")
        entry: dict[str, Any] = {"key": key, "tuning": tuning.to_dict(), "problem": self.problem.label(),
                                 "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                 "study": self.study_name, "trial": trial.number, "host": socket.gethostname(),
                                 "worker_wall_seconds": wall}
        storable = True
        name = self.objective.name
        if reply is None:
            timed_out = rc is None
            entry.update(outcome="failed", stage="timeout" if timed_out else "crash", reason=failure, objective=name)
            # A timeout depends on --timeout, a SIGKILL/SIGTERM on the machine (OOM killer, an
            # operator): neither is a property of the configuration. A crash (abort) is, but
            # for this objective only (it may have happened after the compile).
            storable = not timed_out and rc not in (-9, -15)
        elif not reply.get("ok"):
            stage = reply.get("stage") if isinstance(reply.get("stage"), str) else "worker"
            reason = str(reply.get("error") or "unknown")
            if stage in OBJECTIVE_STAGES:
                # It compiled; only this objective failed (e.g. no compiler estimate): recorded as
                # this objective's failure, never served to other objectives. A failure of this
                # run (the profiler timed out or was killed) is not stored at all.
                entry.update(outcome="ok", objectives={name: {"failed": reason, "stage": stage}})
                storable = not reply.get("machine_dependent")
            else:
                entry.update(outcome="failed", stage=stage, reason=reason, objective=name)
                storable = stage in CONFIG_STAGES
        else:
            entry.update(outcome="ok", objectives={name: {
                "value": reply["value"], "value_kind": reply["value_kind"], "source": reply["source"],
                "details": reply.get("details", {})}})
        if reply is not None:
            for k in EVALUATION_ATTRS:
                entry[k] = reply.get(k)
        mine = entry.get("objectives", {}).get(name, {})
        own_failure = mine if "failed" in mine else {}  # compiled, but this objective failed
        self.cache.log_compile({"time": entry["written"], "host": entry["host"], "pid": os.getpid(),
                                "study": self.study_name, "trial": trial.number, "key": key,
                                "objective": name, "outcome": "failed" if own_failure else entry["outcome"],
                                "stage": own_failure.get("stage") or entry.get("stage", "done"),
                                "wall_seconds": round(wall, 3)})
        if storable:
            self.cache.put(key, entry)
        return entry

    def _finish(self, trial, entry: dict[str, Any]) -> float:
        """The evaluated trial's value, or PRUNED with the stage and reason it failed at."""
        for k in EVALUATION_ATTRS:
            trial.set_user_attr(k, entry.get(k))
        return self._result(trial, entry)

    # ---- helpers
    def rules_out(self, values: dict[str, Any]) -> tuple[str, str] | None:
        """(stage, reason) when the space rules these knob values out before any plan: not a
        valid TuningConfig, a device split the model does not allow, a constraint that fails
        (or cannot be evaluated). Arithmetic only: the sampler (tpumk.tune.sampler) asks it of
        every draw, so that such a draw never becomes a trial."""
        try:
            tuning = self.space.tuning_for(values)
        except ConfigError as e:
            return "tuning", str(e)
        try:
            facts = self.facts_for(tuning)
        except PlanError as e:  # the model does not split over the devices this way
            return "plan", str(e)
        # Bounded cost by construction (tpumk.tune.space), and under the trial's time budget; a
        # constraint that cannot be evaluated for this configuration rules it out with the reason.
        reason = self.space.violated(tuning, facts, deadline=time.monotonic() + self.settings.timeout)
        return ("constraint", reason) if reason else None

    def facts_for(self, tuning: TuningConfig) -> dict[str, Any]:
        """The constraints' facts for this configuration: on many devices one device's share of
        the model, which only expert_parallel changes (tpumk.tune.space.space_facts)."""
        # a round build's draft_block sets the verify step's rows (q_len = draft_block + 1)
        which = (tuning.expert_parallel, tuning.draft_block)
        with self.lock:
            found = self._facts.get(which)
        if found is None:
            found = space_facts(self.problem.replace(tuning=TuningConfig(expert_parallel=which[0],
                                                                         draft_block=which[1])))
            with self.lock:
                self._facts[which] = found
        return found

    def key_of(self, tuning: TuningConfig) -> str:
        return self.keys(tuning)

    def _count(self, name: str) -> None:
        with self.lock:
            self.stats[name] += 1

    def _prune(self, trial, stage: str, reason: str):
        import optuna

        trial.set_user_attr("prune_stage", stage)
        trial.set_user_attr("prune_reason", reason)
        raise optuna.TrialPruned(f"{stage}: {reason}")

    def _from_entry(self, trial, entry: dict[str, Any], via: str) -> float:
        """Finish the trial from a result-cache entry (no compile)."""
        trial.set_user_attr("cached", True)
        trial.set_user_attr("cached_from", via)
        for k in EVALUATION_ATTRS:
            trial.set_user_attr(k, entry.get(k))
        return self._result(trial, entry)

    def _result(self, trial, entry: dict[str, Any]) -> float:
        """This objective's value in an entry, or PRUNED with the stage and reason it failed at
        (the configuration's failure, or this objective's own)."""
        if entry["outcome"] != "ok":
            self._prune(trial, entry["stage"], entry["reason"])
        name = self.objective.name
        if name in entry["objectives"]:
            o = entry["objectives"][name]
        else:  # the model objective served from the model value every compile records
            o = {"value": entry["model_seconds"], "value_kind": "tpumk model",
                 "source": entry.get("model_source") or "tpumk model"}
        if "failed" in o:
            self._prune(trial, o["stage"], o["failed"])
        v = o.get("value")
        if not is_step_time(v):
            # Completed with it, the trial would be `foreign` (tpumk.tune.budget): never seen by
            # the sampler, which would propose the configuration again for ever.
            self._prune(trial, "objective", f"the {name} objective returned {v!r}: not a step time (a positive, "
                                            "finite number of seconds)")
        return self._complete(trial, o)

    def _complete(self, trial, o: dict[str, Any]) -> float:
        trial.set_user_attr("objective", self.objective.name)
        trial.set_user_attr("value_kind", o["value_kind"])
        trial.set_user_attr("objective_source", o["source"])
        if self.objective.name == "compiler":
            trial.set_user_attr("estimate_source", o["source"])
        if self.problem.draft is not None:
            return self._per_accepted_token(trial, float(o["value"]))
        return float(o["value"])

    def _per_accepted_token(self, trial, round_seconds: float) -> float:
        """A round build's value: the seconds of one round (tpumk's model, the worker's) over the
        tokens a round commits on average at the study's per-draft acceptance rate with this
        trial's block (tpumk.estimate.speculative.expected_acceptance_length): seconds per
        accepted token per sequence, minimised (accepted tokens per second, maximised)."""
        from tpumk.estimate.speculative import expected_acceptance_length

        block = self.space.tuning_for(trial.params).draft_block or self.problem.draft.block
        rate = self.objective.acceptance_rate
        tokens = expected_acceptance_length(block, rate)
        trial.set_user_attr("draft_block", block)
        trial.set_user_attr("round_seconds", round_seconds)
        trial.set_user_attr("accepted_tokens_per_round", tokens)
        trial.set_user_attr("accepted_tokens_per_second", tokens / round_seconds)
        trial.set_user_attr("value_kind", f"tpumk model: seconds per accepted token at a per-draft acceptance "
                                          f"rate of {rate:g}")
        return round_seconds / tokens

    def _reuse(self, trial, other) -> float:
        """Finish the trial with the result of a finished trial of the same configuration."""
        trial.set_user_attr("cached", True)
        trial.set_user_attr("cached_from", f"trial {other.number}")
        trial.set_user_attr("duplicate_of", other.number)
        for k in RESULT_ATTRS:
            if k in other.user_attrs:
                trial.set_user_attr(k, other.user_attrs[k])
        if state(other) == "PRUNED":
            import optuna

            raise optuna.TrialPruned(f"{other.user_attrs.get('prune_stage')}: {other.user_attrs.get('prune_reason')}")
        return float(other.value)

    # ---- the worker process
    def _run_worker(self, trial, tuning: TuningConfig) -> tuple[dict[str, Any] | None, str, int | None]:
        """Run tpumk.tune.worker; returns (its reply or None, why there is none, its exit code:
        None when it was killed for running over the timeout)."""
        request = {"spec": self.problem.replace(tuning=tuning).to_dict(), "objective": self.objective.name,
                   "deadline_seconds": self.settings.timeout, "device_warmup": self.objective.device_warmup,
                   "device_repeats": self.objective.device_repeats}
        # Its own session: a timeout kills the worker and the profiling compile it may have started.
        # tpumk.child_process: the worker imports this process's tpumk, never the working directory's.
        proc = subprocess.Popen(command(EVALUATOR), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        with self.lock:
            self.procs.add(proc)
        try:
            out, err = proc.communicate(json.dumps(request), timeout=self.settings.timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.communicate()
            return None, f"timed out after {self.settings.timeout:g} s (worker killed)", None
        except BaseException:  # an interrupt, or anything else: no worker outlives its trial
            kill_group(proc)
            proc.communicate()
            raise
        finally:
            with self.lock:
                self.procs.discard(proc)
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        try:
            reply = json.loads(lines[-1]) if lines else None
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):  # valid JSON but not a reply object: no reply
            reply = None
        tail = [ln for ln in err.strip().splitlines() if ln.strip()]
        if reply is None:
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            return None, f"compile worker died ({how}): {_why(tail)[:300]}", proc.returncode
        return reply, "", proc.returncode

    def kill_workers(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            kill_group(p)


def _why(stderr_lines: list[str]) -> str:
    """The stderr line of a dead worker that says why (a libtpu CHECK, an XLA status, a Python error)."""
    for key in ("Check failed", "RESOURCE_EXHAUSTED", "Error", "error"):
        for line in reversed(stderr_lines):
            if key in line:
                return line.strip()
    return stderr_lines[-1].strip() if stderr_lines else "no output"


def kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own group (start_new_session)
    except ProcessLookupError:
        pass
