"""The study's sampler: TPE's choice, redrawn until it names a new configuration the space allows.

Optuna creates a trial before it asks the sampler, so every draw the objective then refuses is
a stored trial: `tpumk tune --model tiny-moe --trials 6` on the default space used to leave
about 50 trials in the storage for its 6 evaluated configurations, nearly all pruned by the
space's constraints in a fraction of a second (random draws over 20 knobs rarely divide the
model's widths), and in a small space some repeating configurations already evaluated. The
dashboard and `tpumk report` showed mostly that noise.

So the sampler proposes a whole configuration at a trial's first parameter: it copies the
study's finished trials, and the draws this process already passed over, into an in-memory
study and asks TPE there (`constant_liar`, as before). A draw that repeats a configuration
(finished, running, or proposed to another thread of this process) or that `rules_out` refuses
(the space's constraints and knob rules: arithmetic, no plan or compile) is told to the copy
as PRUNED, so TPE ranks it with the worst and learns the infeasible region, and is drawn
again, up to `REDRAWS` times; then uniform draws over the grid (early in a study TPE's good
group still holds refused draws, so its draws can keep landing on them), then, in a grid small
enough to list (`ENUMERATE_MAX` points), a random untried point the rules allow: a small
discrete space is walked, not sampled with repeats. The draws passed over are counted by stage (`passed_over`) for the summary,
and kept with their stage (`refused`); once every point of such a grid is tried or refused,
`exhausted` says so and the study stops (an unsatisfiable space ends after a few trials, and
tpumk.tune.study says in one line what rejected its configurations).

What can still reach the storage: trials with fixed parameters (the default configuration,
`enqueue_trial`: they never ask the sampler); a draw after `REDRAWS` refusals in a space too
large to list (it becomes a pruned trial, so `--max-infeasible` still ends a space that is
mostly infeasible); a repeat by two processes proposing at the same moment (the budget,
tpumk.tune.budget, counts it outside `--trials`, and the result cache serves it); a
configuration the plan refuses (a PlanError is evidence worth keeping, and costs a plan).
"""

from __future__ import annotations

import itertools
import random
import threading
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from tpumk.tune.budget import foreign

REDRAWS = 64
ENUMERATE_MAX = 100_000
RANDOM_DRAWS = 1_000  # uniform draws after REDRAWS refused TPE draws
CHECK_MAX = 2_000  # untried grid points checked against the rules for one proposal
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def params_key(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


class DistinctSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler over one bound TuningSpace (tpumk.tune.space.TuningSpace.for_build).
    `rules_out(values)` returns (stage, reason) for knob values that cannot be a trial, else None."""

    def __init__(self, space, seed: int | None = None,
                 rules_out: Callable[[dict[str, Any]], tuple[str, str] | None] | None = None):
        self.space = space
        self.seed = seed
        self.rules_out = rules_out
        self.distributions = space.distributions()
        self.passed_over: dict[str, int] = {}  # stage -> draws refused before becoming a trial
        self.refused: dict[tuple, str] = {}  # params_key -> the stage that refused it (each draw once)
        # every point of the grid is tried, proposed or refused: nothing new is left to propose
        self.exhausted = False
        self._lock = threading.Lock()
        self._proposed: dict[int, dict[str, Any]] = {}  # trial id -> its configuration, until it ends
        self._refused: list[optuna.trial.FrozenTrial] = []  # draws passed over, for TPE to learn from
        self._refused_keys: set[tuple] = set()

    # ---- the BaseSampler interface
    def infer_relative_search_space(self, study, trial) -> dict:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict:
        return {}

    def sample_independent(self, study, trial, param_name: str, param_distribution) -> Any:
        with self._lock:
            proposal = self._proposed.get(trial._trial_id)
            if proposal is None:
                proposal = self._propose(study, trial._trial_id)
                self._proposed[trial._trial_id] = proposal
        if param_name in proposal:
            return proposal[param_name]
        # Not one of the space's knobs (tpumk's trials suggest exactly those).
        return optuna.samplers.RandomSampler(seed=self.seed).sample_independent(study, trial, param_name,
                                                                               param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        with self._lock:
            self._proposed.pop(trial._trial_id, None)

    # ---- the proposal
    def _propose(self, study, trial_id: int) -> dict[str, Any]:
        trials = study.get_trials(deepcopy=False)
        names = set(self.distributions)
        seen = {params_key(t.params) for t in trials
                if t._trial_id != trial_id and set(t.params) == names
                and (t.state == TrialState.RUNNING or t.state in _FINISHED and foreign(t, self.space) is None)}
        seen |= {params_key(p) for tid, p in self._proposed.items() if tid != trial_id}
        # Seeded by the study's size: a resumed study does not replay the first run's draws.
        seed = None if self.seed is None else self.seed + len(trials) + len(self._refused)
        # Trials another process wrote into a shared study with values outside the space or a
        # value that is no step time teach TPE nothing (and Optuna refuses the former).
        real = [t for t in trials if t.state in _FINISHED and t.distributions == self.distributions
                and foreign(t, self.space) is None]
        shadow = optuna.create_study(direction="minimize",
                                     sampler=optuna.samplers.TPESampler(seed=seed, constant_liar=True))
        shadow.add_trials(real)
        shadow.add_trials(self._refused)
        last = None
        for _ in range(REDRAWS):
            draw = shadow.ask(self.distributions)
            last = dict(draw.params)
            verdict = self._admit(last, seen)
            if verdict:
                return last
            shadow.tell(draw, state=TrialState.PRUNED)
            if verdict is False:  # newly refused: remembered for the next proposals' TPE
                self._refused.append(shadow.get_trials(deepcopy=False)[-1])
        found = self._random(seen, seed)
        if found is None:
            found = self._untried(seen, seed)
        return found if found is not None else last

    def _admit(self, params: dict[str, Any], seen: set[tuple]) -> bool | None:
        """True: a new configuration the rules allow. False: new, but the rules refuse it (counted
        by stage in `passed_over`, and remembered). None: tried or refused before."""
        key = params_key(params)
        if key in seen or key in self._refused_keys:
            return None
        why = self.rules_out(params) if self.rules_out else None
        if why is None:
            return True
        self.passed_over[why[0]] = self.passed_over.get(why[0], 0) + 1
        self._refused_keys.add(key)
        self.refused[key] = why[0]
        return False

    def _random(self, seen: set[tuple], seed: int | None) -> dict[str, Any] | None:
        """Where TPE's draws keep landing on refused points (early in a study its good group
        still holds refused draws): uniform draws over the grid, new and allowed."""
        rng = random.Random(seed)
        values = {name: knob.values() for name, knob in self.space.knobs.items()}
        for _ in range(RANDOM_DRAWS):
            p = {name: rng.choice(v) for name, v in values.items()}
            if self._admit(p, seen):
                return p
        return None

    def _untried(self, seen: set[tuple], seed: int | None) -> dict[str, Any] | None:
        """A random point of the grid that no trial has and the rules allow, when the grid is
        small enough to list."""
        if self.space.size() > ENUMERATE_MAX:
            return None
        names = list(self.space.knobs)
        grid = (dict(zip(names, combo)) for combo in itertools.product(*(k.values() for k in self.space.knobs.values())))
        free = [p for p in grid if params_key(p) not in seen and params_key(p) not in self._refused_keys]
        random.Random(seed).shuffle(free)
        for p in free[:CHECK_MAX]:
            if self._admit(p, seen):
                return p
        if len(free) <= CHECK_MAX:  # every untried point was checked and refused
            self.exhausted = True
        return None
