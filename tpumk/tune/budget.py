"""The study's budget: which trials count, and the check before a trial starts evaluating.

`--trials N` means the study ends with N *distinct evaluated configurations*: configurations
(`config_key`) of trials that are COMPLETE, or PRUNED after a compile (the compiler rejected the
configuration, crashed or timed out), whether the study compiled them or took their result from
the result cache. A trial of a configuration the study already evaluated (the sampler suggested
it again; it reuses the earlier trial's result) is a *repeat*: it costs nothing and does not
count, so a study of N never holds fewer than N distinct evaluated configurations. Repeats are
capped at 10 x N (`TuneSettings.repeats_cap()`) and the study also ends once every point of the space's grid
was tried, so a small or exhausted space still ends. Trials pruned before compiling (the space's
constraints, the plan) cost a fraction of a second and do not count either; they are capped at
`max_infeasible` (default 10 x N) so a space that is mostly infeasible still ends. Every process and worker
thread shares the budget: a thread starts a trial only while evaluated + running < N (running
trials of other processes included), and a trial that another process started past the
budget in a race is marked FAIL ("surplus", never evaluated). (Optuna's MaxTrialsCallback
stops a study only after a trial finishes, so parallel workers would overshoot the budget by
the trials they have in flight; hence the check before each start.)
"""

from __future__ import annotations

import math
import threading
import time

from tpumk.tune.settings import TuneSettings
from tpumk.tune.storage import fail_stale

POLL_SECONDS = 0.5
FINISHED = ("COMPLETE", "PRUNED")
# pruned before compiling: not in the budget ("space": a trial another process enqueued with
# values outside the space, never evaluated)
FREE_STAGES = ("tuning", "constraint", "plan", "space")


class SurplusTrial(Exception):
    """A trial another process started after the budget was used up: failed, never evaluated."""


class Interrupted(Exception):
    """The run was interrupted while this trial was evaluating: failed, so a rerun redoes it."""


def state(t) -> str:
    return t.state.name


def is_free(t) -> bool:
    """Pruned before compiling: outside the budget."""
    return state(t) == "PRUNED" and t.user_attrs.get("prune_stage") in FREE_STAGES


def is_step_time(v) -> bool:
    """A positive, finite number of seconds (a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def foreign(t, space) -> str | None:
    """Why a finished trial cannot be one of this study's evaluations, or None. A study may be
    shared (a journal file, PostgreSQL), so another process can write any trial into it: a
    value that is not a step time (negative, zero, not finite) or knobs outside the space
    (`TuningSpace.outside`; the space bound to the study's build). Such a trial never ranks,
    never serves its value to another trial, and does not count in the budget."""
    if state(t) == "COMPLETE":
        v = t.value
        if not is_step_time(v):
            return f"its value {v!r} is not a step time (a positive, finite number of seconds)"
    return space.outside(t.params)


def own(trials, space) -> list:
    """`trials` without the finished ones that are `foreign` (running and waiting ones are kept)."""
    return [t for t in trials if state(t) not in FINISHED or foreign(t, space) is None]


def config_of(t) -> str:
    """The configuration a trial evaluated (its result-cache key; its number if it has none)."""
    return t.user_attrs.get("config_key") or f"trial {t.number}"


def repeats(trials) -> list:
    """Finished trials (not pruned before compiling) of a configuration that an earlier
    finished trial of the study had already evaluated: outside the budget."""
    seen: set[str] = set()
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        if state(t) in FINISHED and not is_free(t):
            k = config_of(t)
            if k in seen:
                out.append(t)
            seen.add(k)
    return out


def tally(trials) -> tuple[int, int, set[int]]:
    """(distinct evaluated configurations, trials pruned before compiling, numbers of running
    trials)."""
    evaluated = len({config_of(t) for t in trials if state(t) in FINISHED and not is_free(t)})
    return evaluated, sum(is_free(t) for t in trials), {t.number for t in trials if state(t) == "RUNNING"}


def is_spent(trials, settings: TuneSettings) -> bool:
    """The study has its evaluated configurations, or hit the cap of trials pruned before
    compiling or of repeats."""
    evaluated, infeasible, _ = tally(trials)
    return (evaluated >= settings.trials or infeasible >= settings.infeasible_cap()
            or len(repeats(trials)) >= settings.repeats_cap())


def wait_for_budget(trial, settings: TuneSettings, stop: threading.Event, space) -> None:
    """Evaluate only within the budget: wait while trials ahead of this one might still fill
    it; fail as surplus if they did (another process raced this one past the budget)."""
    last_stale_check = 0.0
    while True:
        trials = own(trial.study.get_trials(deepcopy=False), space)
        evaluated, _, _ = tally(trials)
        ahead = sum(state(t) == "RUNNING" and t.number < trial.number for t in trials)
        if is_spent(trials, settings):
            trial.set_user_attr("fail_reason", "surplus: the study had its trials when this one started")
            raise SurplusTrial(f"study already has {evaluated} evaluated configurations")
        if evaluated + ahead < settings.trials:
            return
        if stop.is_set():
            raise Interrupted("interrupted before evaluating")
        if time.monotonic() - last_stale_check > settings.heartbeat:
            fail_stale(trial.study)
            last_stale_check = time.monotonic()
        time.sleep(POLL_SECONDS)
