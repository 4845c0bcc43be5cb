"""Hardening of `tpumk tune` against hostile or broken input (each case failed on the code
before it): constraints of unbounded cost or that cannot be evaluated, huge knob ranges, stale
journal locks and corrupt journals, unwritable outputs, the budget counting repeats of one
configuration, and the calibration cache ignoring the probe code.

All fast: constraint and space units, or studies whose compile is a stand-in."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.errors import ConfigError
from tpumk.model.config import resolve_model
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target
from tpumk.tune.objectives import choose_objective
from tpumk.tune.settings import TuneSettings
from tpumk.tune.space import SPACES_DIR, Constraint, load_space
from tpumk.tune.storage import open_storage, storage_url

TINY_SPACE = str(SPACES_DIR / "tiny.toml")
NESTED_POW = "((((ring_depth ** 64) ** 64) ** 64) ** 64) ** 64 > 0"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tune_cmd(*extra):
    return ["tune", "--model", "tiny-moe", "--target", "tpu7x", "--space", TINY_SPACE, *map(str, extra)]


def one_line_error(r, *needles):
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpumk: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def fake_worker(self, trial, tuning):
    """A stand-in compile: the value is the ring depth in microseconds."""
    v = 1e-6 * tuning.ring_depth + 1e-8 * tuning.kv_buffers
    return ({"ok": True, "stage": "done", "value": v, "value_kind": "tpumk model", "source": "stand-in",
             "compile_seconds": 0.1, "lower_seconds": 0.1, "custom_calls": 1, "model_seconds": v,
             "model_source": "stand-in"}, "", 0)


@pytest.fixture
def stand_in(monkeypatch):
    from tpumk.tune.trial import TrialRunner

    monkeypatch.setattr(TrialRunner, "_run_worker", fake_worker)


def problem_and_objective():
    problem = BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"))
    return problem, choose_objective("model", problem.model, problem.target)


def study_must_not_start(monkeypatch):
    """Make any trial compile fail the test: the case must be refused before the study runs."""
    from tpumk.tune.trial import TrialRunner

    def no_worker(self, trial, tuning):
        raise AssertionError("the study must not start")

    monkeypatch.setattr(TrialRunner, "_run_worker", no_worker)


# ---------------------------------------------------------------------- constraints: bounded cost
def test_nested_powers_are_evaluated_in_bounded_time():
    """Constant exponents of at most 64 still nest into numbers of billions of digits: the
    evaluation refuses every intermediate above 2**1024 before computing it. (Before, this
    computed for ever: run in a subprocess so the old behaviour fails instead of hanging.)"""
    code = textwrap.dedent(f"""
        from tpumk.tune.space import Constraint, ConstraintError
        c = Constraint({NESTED_POW!r}, "w")
        try:
            c.holds({{"ring_depth": 12}})
        except ConstraintError as e:
            print("refused:", e)
    """)
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("evaluating the constraint did not end in 30 s")
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "exceeds 2**1024" in r.stdout and "ring_depth=12" in r.stdout
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("expr", ["2 ** ring_depth > 1", "ring_depth ** (1 + 1) > 1", "ring_depth ** 65 > 1",
                                  "ring_depth ** -65 > 0"])
def test_exponents_must_be_small_constants(expr):
    with pytest.raises(ConfigError, match="exponent .* is not allowed"):
        Constraint(expr, "w")


@pytest.mark.parametrize("expr, env", [
    ("ring_depth * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64"
     " * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 * 2 ** 64 > 0",
     {"ring_depth": 3}),
    ("1e300 ** 2 > 0", {}),
    ("(0 - ring_depth) ** 0.5 > 0", {"ring_depth": 4}),
    ("1 / (ring_depth - 4) > 0", {"ring_depth": 4}),
])
def test_unevaluable_constraints_raise_a_constraint_error(expr, env):
    from tpumk.tune.space import ConstraintError

    with pytest.raises(ConstraintError, match="cannot be evaluated"):
        Constraint(expr, "w").holds(env)
    # ...which `violated` turns into a reason (the trial is pruned), not an exception.
    space = load_space(TINY_SPACE)
    space = type(space)(space.name, space.source, space.knobs, space.fixed, (Constraint(expr, "my why"),))
    from tpumk.plan.knobs import TuningConfig

    tuning = TuningConfig(ring_depth=env.get("ring_depth", 12))
    reason = space.violated(tuning, {})
    assert reason.startswith("my why: constraint") and "cannot be evaluated" in reason


def test_constraints_respect_a_deadline():
    c = Constraint("ring_depth + 1 > 0", "w")
    from tpumk.tune.space import ConstraintError

    with pytest.raises(ConstraintError, match="out of time"):
        c.holds({"ring_depth": 4}, deadline=time.monotonic() - 1)
    assert c.holds({"ring_depth": 4}, deadline=time.monotonic() + 60)


def test_a_constraint_dividing_by_zero_prunes_the_trial_not_the_study(tmp_path, monkeypatch, stand_in):
    """ring_depth 12 (the default) divides by zero: that trial is pruned with the reason; the
    study goes on with the other rings. (Before: the ConfigError aborted the whole run.)"""
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "div.toml"
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n\n'
                     '[[constraints]]\nwhy = "a divisor"\nexpr = "hidden_size % (ring_depth - 12) == 0"\n')
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 2, "--seed", 1, "--json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["default"]["state"] == "PRUNED"
    assert "cannot be evaluated" in out["default"]["prune_reason"]
    assert "modulo by zero" in out["default"]["prune_reason"] and "ring_depth=12" in out["default"]["prune_reason"]
    assert out["prune_reasons"].get("constraint", 0) >= 1 and out["evaluated"] == 2


def test_a_hanging_constraint_in_a_space_file_prunes_quickly(tmp_path, monkeypatch, stand_in):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "pow.toml"
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n\n'
                     f'[[constraints]]\nwhy = "huge"\nexpr = "{NESTED_POW}"\n')
    t0 = time.monotonic()
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 2, "--max-infeasible", 3))
    # every configuration pruned, nothing evaluated: one line saying why
    one_line_error(r, "no configuration of its 3 grid points", "3 configurations rejected before compiling",
                   "exceeds 2**1024")
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------- knob ranges
@pytest.mark.parametrize("spec, needle", [
    ('type = "int"\nlow = 4\nhigh = 1000000000000\nstep = 4', "candidates"),
    ('type = "int"\nlow = 2\nhigh = 4000000', "candidates"),
    ('type = "int"\nlow = 4\nhigh = 4611686018427387904\nstep = 4', "out of range"),
    ('type = "pow2"\nlow = 2\nhigh = 4611686018427387904', "out of range"),
])
def test_huge_int_ranges_are_one_line_errors(tmp_path, monkeypatch, spec, needle):
    """(Before: the range was listed whole, a MemoryError traceback.)"""
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "huge.toml"
    space.write_text(f"[knobs.ring_depth]\n{spec}\n")
    with pytest.raises(ConfigError) as e:
        load_space(space)
    assert str(e.value).startswith(str(space)) and "knob 'ring_depth'" in str(e.value) and needle in str(e.value)
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 2))
    one_line_error(r, "huge.toml", "ring_depth", needle)
    assert not (tmp_path / "artifacts").exists()


def test_a_wide_but_legal_range_is_never_listed(tmp_path):
    space = tmp_path / "wide.toml"
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 2\nhigh = 900002\n')
    s = load_space(space)
    assert s.size() == 900001
    assert s.knobs["ring_depth"].distribution().high == 900002


# ---------------------------------------------------------------------- journal storage
def test_a_killed_lock_holder_does_not_delay_the_next_run(tmp_path):
    """A process killed while holding the journal's append lock (a hung run killed with -9)
    must not cost the next process the lock's grace period. (Before: Optuna's symlink lock
    stayed behind and the next append waited 30 s to break it.)"""
    journal = tmp_path / "s.journal"
    holder = textwrap.dedent(f"""
        import sys, time
        from tpumk.tune.storage import open_storage
        s = open_storage({str(journal)!r})
        s._backend._lock.acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    t0 = time.monotonic()
    study = optuna.create_study(study_name="s", storage=open_storage(str(journal)))
    study.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=2)
    assert len(study.trials) == 2
    assert time.monotonic() - t0 < 10


def test_the_journal_lock_excludes_threads_of_one_process(tmp_path):
    import threading

    from tpumk.tune.storage import _flock_lock_class

    lock = _flock_lock_class()(str(tmp_path / "j.journal"))
    inside = []
    overlap = []

    def work():
        for _ in range(20):
            lock.acquire()
            try:
                inside.append(1)
                if len(inside) > 1:
                    overlap.append(1)
                time.sleep(0.001)
                inside.pop()
            finally:
                lock.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlap


def test_a_corrupt_journal_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    journal = tmp_path / "bad.journal"
    journal.write_text("this is not\na journal\n")
    with pytest.raises(ConfigError, match="bad.journal is not a readable Optuna journal"):
        open_storage(str(journal))
    r = cli(*tune_cmd("--objective", "model", "--trials", 2, "--storage", journal))
    one_line_error(r, "bad.journal", "not a readable Optuna journal")
    assert journal.read_text() == "this is not\na journal\n"  # left as it was


# ---------------------------------------------------------------------- outputs checked first
@pytest.mark.parametrize("which", ["out", "report"])
def test_unwritable_outputs_are_refused_before_the_study(tmp_path, monkeypatch, which):
    """(Before: the whole study ran, then writing failed.)"""
    study_must_not_start(monkeypatch)
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    opt = ["--out", blocker / "tuned.toml"] if which == "out" else ["--report", blocker]
    r = cli(*tune_cmd("--objective", "model", "--trials", 2, *opt))
    one_line_error(r, f"--{which}", "a_file")
    assert not (tmp_path / "artifacts").exists()  # no study, no cache


def test_check_writable_cases(tmp_path):
    from tpumk.tune.study import check_writable

    check_writable(tmp_path / "new" / "deeper" / "t.toml", "--out")  # creatable
    check_writable(tmp_path, "--report", directory=True)
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable(tmp_path, "--out")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="not writable"):
                check_writable(ro / "t.toml", "--out")
        finally:
            ro.chmod(0o700)


# ---------------------------------------------------------------------- the budget: distinct configurations
def test_trials_count_distinct_configurations_and_the_summary_counts_reuse(tmp_path, stand_in, capsys):
    """Duplicates enqueued ahead: a study of 4 ends with 4 distinct evaluated configurations,
    and says how many trials reused earlier results. (Before: the 4 trials were the enqueued
    ones, 2 distinct configurations.)"""
    from tpumk.cli.tune import print_result
    from tpumk.tune import study as T

    space = tmp_path / "two.toml"
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n\n'
                     '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 3]\n')  # 0: the default, auto
    space = load_space(space)
    problem, objective = problem_and_objective()
    storage = str(tmp_path / "b.journal")
    study = T.open_study(storage_url(storage, "b"), "b", None, None, heartbeat=1)
    d = space.default_values()
    study.enqueue_trial(d, user_attrs={"tpumk_default": True})
    for ring in (12, 12, 8):
        study.enqueue_trial({**d, "ring_depth": ring})
    settings = TuneSettings(trials=4, workers=1, seed=0, heartbeat=1, root=tmp_path, cache_dir=tmp_path / "cache")
    result = T.run(problem, space, objective, settings, storage=storage, study_name="b")
    study = T.open_study(storage_url(storage, "b"), "b", None, None, create=False)
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len({t.user_attrs["config_key"] for t in done}) == 4 == result.evaluated
    assert result.repeated == len(done) - 4 >= 2
    assert result.reused >= result.repeated
    d = result.to_dict()
    assert d["reused"] == result.reused and d["repeated"] == result.repeated
    print_result(result)
    text = capsys.readouterr().out
    assert "4 of 4 distinct configurations evaluated" in text
    assert f"{result.reused} trials reused earlier results" in text
    assert f"{result.repeated} of them repeated" in text


def test_a_count_of_one_reads_in_the_singular(capsys):
    """The summary of a one-trial study: '1 trial reused', '1 compile', never '1 trials'."""
    from tpumk.cli.tune import print_result
    from tpumk.tune.study import TuneResult

    best = [{"rank": 1, "trial": 0, "value_seconds": 1e-5, "value_kind": "tpumk model", "objective_source": "x",
             "changed_knobs": {}, "compile_seconds": 1.0, "cached": True, "floor_seconds": None, "vmem_bytes": 1}]
    print_result(TuneResult(
        study="s", storage="s.journal", problem="p", space="tiny", objective="model", objective_reason="",
        trials_requested=1, counts={"COMPLETE": 1}, evaluated=1, infeasible=0, reused=1, repeated=1,
        this_run={"trials": 1, "compiles": 1, "cache_hits": 0, "reused_in_study": 0, "wall_seconds": 1.0,
                  "passed_over": {"constraint": 1}},
        best=best, default=None, best_over_default=None, best_tuning={}, floor_seconds=None))
    text = capsys.readouterr().out
    for said in ("1 of 1 distinct configuration evaluated (1 trial complete,",
                 "1 trial reused earlier results without compiling (1 of it repeated",
                 "this run: 1 trial, 1 compile,", "passed over 1 drawn configuration the space rules out"):
        assert said in text, (said, text)
    assert "1 trials" not in text and "1 compiles" not in text


def test_a_space_smaller_than_the_budget_ends_when_exhausted(tmp_path, monkeypatch, stand_in):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "three.toml"
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n')
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 5, "--seed", 2, "--json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["evaluated"] == 3 and any("every configuration of the space was tried" in n for n in out["notes"])


def test_the_default_space_stores_the_evaluated_trials_not_the_draws_it_rules_out(tmp_path, stand_in, capsys):
    """tiny-moe on the default space, 6 trials: the storage holds the 6 evaluated configurations
    and at most a few pruned before compiling, never a repeat; the draws passed over are
    counted in the summary. (Before: about 50 trials, nearly all pruned
    by the constraints before compiling.)"""
    from tpumk.cli.tune import print_result
    from tpumk.tune import study as T

    problem, objective = problem_and_objective()
    space = load_space(Path(__file__).parents[1] / "tuning_spaces" / "default.toml")
    settings = TuneSettings(trials=6, workers=2, seed=0, heartbeat=1, root=tmp_path, cache_dir=tmp_path / "cache")
    result = T.run(problem, space, objective, settings, storage=str(tmp_path / "d.journal"), study_name="d")
    assert result.evaluated == 6 and result.repeated == 0
    # A draw the rules refuse still becomes a trial when 64 TPE draws and 1,000 uniform ones all
    # were refused (early, while the default configuration is the only good point TPE knows).
    assert result.infeasible <= 3, result.prune_reasons
    assert sum(result.counts.values()) == 6 + result.infeasible
    passed = result.this_run["passed_over"]
    assert passed.get("constraint", 0) > 0  # the constraints did refuse draws: in the sampler, not the storage
    print_result(result)
    assert f"the sampler passed over {sum(passed.values()):,} drawn configurations" in capsys.readouterr().out


def test_a_small_space_is_walked_without_repeats(tmp_path, stand_in):
    """Six configurations, --trials 6: every one evaluated once, no trial repeating another
    (TPE alone repeated the ones it liked, stored as extra trials)."""
    from tpumk.tune import study as T

    path = tmp_path / "six.toml"
    path.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n\n'
                    '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 3]\n')
    problem, objective = problem_and_objective()
    settings = TuneSettings(trials=6, workers=1, seed=0, heartbeat=1, root=tmp_path, cache_dir=tmp_path / "cache")
    result = T.run(problem, load_space(path), objective, settings, storage=str(tmp_path / "s.journal"),
                   study_name="s")
    assert result.evaluated == 6 and result.counts == {"COMPLETE": 6} and result.repeated == 0


def test_a_dense_models_study_searches_only_its_knobs_and_says_so(tmp_path, monkeypatch, stand_in):
    """tiny.toml searches expert_slots / expert_chunk; tiny-dense has no experts: its study
    leaves them out, says so in one line, and prints the grid it searches (before: 192
    points, 8 of every 24 the same kernel)."""
    monkeypatch.chdir(tmp_path)
    r = cli("tune", "--model", "tiny-dense", "--target", "tpu7x", "--space", TINY_SPACE, "--objective", "model",
            "--trials", 1, "--json")
    assert r.exit_code == 0, r.output
    assert "space tiny (24 grid points), 1 distinct configuration to evaluate" in r.stderr
    left = [ln for ln in r.stderr.splitlines() if "left out" in ln]
    assert left == ["space tiny: 3 of 5 knobs searched for this build; left out: expert_slots, expert_chunk "
                    "(a dense model has no experts)"]
    study = optuna.load_study(study_name=json.loads(r.stdout)["study"],
                              storage=open_storage(storage_url(None, json.loads(r.stdout)["study"])))
    assert {k for t in study.trials for k in t.params} == {"ring_depth", "tile_bytes", "kv_buffers"}


# ---------------------------------------------------------------------- trials another process wrote
@pytest.mark.parametrize("inject", ["negative-value", "infinite-value", "outside-complete", "outside-enqueued"])
def test_a_foreign_trial_in_a_shared_study_is_ignored_and_the_resume_goes_on(tmp_path, stand_in, inject):
    """Another process writes a trial into the shared study: a value of -1 ms (before: it became
    the best, best / default = -16.3), infinity, or ring_depth=1, outside the space (before: every
    resume failed blaming the space file). It is left out of the ranking, the budget and the
    reuse of results, named in one note, and the resume finishes its trials."""
    from tpumk.plan.knobs import TuningConfig
    from tpumk.tune import study as T
    from tpumk.tune.cache import ResultKeys

    problem, objective = problem_and_objective()
    space = load_space(TINY_SPACE)
    storage = str(tmp_path / "f.journal")

    def settings(n):
        return TuneSettings(trials=n, workers=1, seed=0, heartbeat=1, root=tmp_path, cache_dir=tmp_path / "cache")

    T.run(problem, space, objective, settings(2), storage=storage, study_name="f")
    study = T.open_study(storage_url(storage, "f"), "f", None, None, create=False)
    bound = space.for_build(problem)
    dists, params = bound.distributions(), dict(study.trials[0].params)
    ring8 = {**params, "ring_depth": 8 if params["ring_depth"] != 8 else 4}
    key = ResultKeys(problem)(bound.tuning_for(ring8))  # what a trial of ring8 claims: never served -1 ms
    if inject.endswith("-value"):
        value = -1e-3 if inject == "negative-value" else float("inf")
        study.add_trial(optuna.trial.create_trial(params=ring8, distributions=dists, value=value,
                                                  user_attrs={"config_key": key, "cached": False}))
    elif inject == "outside-complete":
        wide = {**dists, "ring_depth": optuna.distributions.IntDistribution(1, 32)}
        study.add_trial(optuna.trial.create_trial(params={**params, "ring_depth": 1}, distributions=wide, value=5e-6))
    else:
        study.enqueue_trial({**params, "ring_depth": 1})
    foreign = study.trials[-1].number
    if inject.endswith("-value"):
        study.enqueue_trial(ring8)
    result = T.run(problem, space, objective, settings(3), storage=storage, study_name="f")
    assert result.evaluated == 3 and all(b["value_seconds"] > 0 and b["trial"] != foreign for b in result.best)
    assert 0 < result.best_over_default <= 1 and TuningConfig(**result.best_tuning).ring_depth in (4, 8, 12)
    assert [n for n in result.notes if n.startswith(f"ignored trial {foreign}: ")], result.notes
    study = T.open_study(storage_url(storage, "f"), "f", None, None, create=False)
    if inject.endswith("-value"):  # the study's own trial of ring8 was evaluated, not served -1 ms
        mine = [t for t in study.trials if t.number != foreign and t.params == ring8 and t.state.name == "COMPLETE"]
        assert mine and all(t.value > 0 for t in mine)


# ---------------------------------------------------------------------- storage failing mid-study
def _fail_after(n: int, exc: BaseException):
    """A wrapper for a write method: the first `n` calls go through, every later one raises `exc`."""
    calls = [0]

    def wrap(orig):
        def write(*a, **k):
            calls[0] += 1
            if calls[0] > n:
                raise exc
            return orig(*a, **k)
        return write
    return wrap


def _disk_full():
    import errno

    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _sqlite_full():
    import sqlite3

    import sqlalchemy.exc

    return sqlalchemy.exc.OperationalError("COMMIT", {}, sqlite3.OperationalError("database or disk is full"))


@pytest.mark.parametrize("where", ["journal", "compile-log", "sqlite"])
def test_storage_failing_mid_study_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, stand_in, capfd, where):
    """The journal, the result cache's compile log or SQLite starts failing (a full disk) after
    some trials finished: one line saying what failed and that the same command resumes, no
    traceback (on the terminal either: Optuna's heartbeat thread, its own errors raised while
    handling ours); the rerun (of the journal's study) finishes it with the trials that had
    finished. (Before: 1-7 chained tracebacks ending in Optuna internals.)"""
    import sqlalchemy.orm
    from optuna.storages.journal import JournalFileBackend

    from tpumk.tune import cache as cache_module

    monkeypatch.chdir(tmp_path)
    storage = "sqlite:///s.db" if where == "sqlite" else "s.journal"
    args = tune_cmd("--objective", "model", "--trials", 4, "--seed", 0, "--storage", storage, "--study", "s",
                    "--heartbeat", 1)
    with monkeypatch.context() as m:
        if where == "journal":
            m.setattr(JournalFileBackend, "append_logs", _fail_after(40, _disk_full())(JournalFileBackend.append_logs))
        elif where == "sqlite":
            m.setattr(sqlalchemy.orm.Session, "commit", _fail_after(80, _sqlite_full())(sqlalchemy.orm.Session.commit))
        else:  # the compile log's append, inside tpumk.tune.cache
            failing_os = type("FailingOs", (), {"__getattr__": lambda self, k: getattr(os, k),
                                                "write": staticmethod(_fail_after(1, _disk_full())(os.write))})()
            m.setattr(cache_module, "os", failing_os)
        r = cli(*args)
    line = one_line_error(r, "study s stopped: ", "every trial that finished is kept", "free some space",
                          "rerun the same command to resume it")
    assert {"journal": "the study's storage (s.journal) failed: No space left on device",
            "sqlite": "the study's storage (sqlite:///s.db) failed: database or disk is full",
            "compile-log": "the result cache (artifacts/tune/cache) failed: No space left on device"}[where] in line
    assert "Traceback" not in capfd.readouterr().err
    kept = [t for t in optuna.load_study(study_name="s", storage=open_storage(storage_url(storage, "s"))).trials
            if t.state.name == "COMPLETE"]
    assert kept  # trials finished before the failure
    if where != "journal":  # resuming is the same on every storage (a killed SQLite study: test_tune.py)
        return
    again = cli(*args, "--json")
    assert again.exit_code == 0, again.output
    out = json.loads(again.stdout)
    assert out["evaluated"] == 4 and out["counts"]["COMPLETE"] >= len(kept)


def test_a_database_server_going_away_is_one_line():
    """PostgreSQL stopping mid-study: SQLAlchemy's error with psycopg2's inside, under Optuna's
    own error raised while handling it: what failed (the URL redacted) and how to resume."""
    import psycopg2
    import sqlalchemy.exc

    from tpumk.tune.study import why_stopped

    url = "postgresql://u:S3cr3t@db.example/tune"
    try:
        try:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, psycopg2.OperationalError(
                "server closed the connection unexpectedly\n\tThis probably means the server terminated"))
        except sqlalchemy.exc.OperationalError:
            assert False, "Should not reach."
    except AssertionError as e:
        why = why_stopped(e, url, Path("cache"), None)
    assert why == ("the study's storage (postgresql://u:***@db.example/tune) failed: server closed the connection "
                   "unexpectedly This probably means the server terminated; every trial that finished is kept: once "
                   "the database server is reachable again, rerun the same command to resume it")
    assert why_stopped(ValueError("a bug"), url, Path("cache"), None) is None  # not a storage failure: raised as it is


# ---------------------------------------------------------------------- calibration cache
def test_calibration_cache_is_keyed_by_the_probe_source(tmp_path, monkeypatch):
    """An entry stored by other probe code (same target and versions) is not reused. (Before:
    the key was the target and the stack versions only.)"""
    from tpumk.compile.keys import source_inputs, stack_versions
    from tpumk.estimate import calibration as C

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(C.static_profile, "profile_dir", lambda: None)  # never measure here
    # the key logic on every JAX set, whether or not this libtpu profiles kernels with DMAs
    target = dataclasses.replace(get_target("tpu7x"), static_profile=True)
    monkeypatch.setattr(C, "get_target", lambda name: target)
    old_key = "|".join([target.name] + [f"{k} {v}" for k, v in sorted(stack_versions().items())])
    entry = {"target": "tpu7x", "seconds_per_cycle": 1e-9, "probe_bytes": 1, "probe_cycles": 1,
             "assumed_bytes_per_s": 1.0, "basis": "stored by other code"}
    cache = tmp_path / "tpumk" / "calibration.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({old_key: entry}))
    C.calibration_for.cache_clear()
    try:
        assert C.calibration_for("tpu7x") is None  # not the other code's figure
        key = C._stack_key(target)
        assert key.startswith(old_key) and source_inputs(C.CALIBRATION_ENTRY)["sha256"] in key
        cache.write_text(json.dumps({key: {**entry, "basis": "this code"}}))
        C.calibration_for.cache_clear()
        assert C.calibration_for("tpu7x").basis == "this code"
    finally:
        C.calibration_for.cache_clear()


def test_every_shipped_space_still_loads():
    for p in Path(SPACES_DIR).glob("*.toml"):
        load_space(p)


# ---------------------------------------------------------------------- constraints: bounded size before parsing
def test_a_constraint_too_long_to_parse_is_a_one_line_error(tmp_path, monkeypatch):
    """(Before: 10,000 terms exhausted the recursion limit inside ast.parse: a RecursionError.)"""
    long_expr = " + ".join(["ring_depth"] * 10_000) + " > 0"
    with pytest.raises(ConfigError, match="longer than 2000 characters"):
        Constraint(long_expr, "x")
    f = tmp_path / "s.toml"
    f.write_text(f'[knobs.ring_depth]\ntype = "int"\nlow = 2\nhigh = 4\n\n'
                 f'[[constraints]]\nwhy = "x"\nexpr = "{long_expr}"\n')
    with pytest.raises(ConfigError, match="longer than 2000 characters") as e:
        load_space(f)
    assert str(e.value).startswith(f"{f}: constraint 'ring_depth + ") and len(str(e.value)) < 300
    monkeypatch.chdir(tmp_path)
    one_line_error(cli("tune", "--model", "tiny-moe", "--target", "tpu7x", "--space", f, "--objective", "model",
                       "--trials", 1), "s.toml", "longer than 2000 characters")
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("expr", ["-" * 400 + "ring_depth > 0", "not " * 300 + "ring_depth > 0",
                                  "+".join(["1"] * 300) + " > ring_depth"])
def test_constraints_nested_deeper_than_the_bound_are_refused_on_load(expr):
    with pytest.raises(ConfigError, match="nested deeper than 200 levels"):
        Constraint(expr, "x")


def test_ordinary_constraints_still_load_and_hold():
    c = Constraint("+".join(["ring_depth"] * 150) + " >= 300 and min(ring_depth, 8) ** 2 <= 64", "x")
    assert c.holds({"ring_depth": 2}) and not c.holds({"ring_depth": 1})


# ---------------------------------------------------------------------- study names, cache and storage paths
@pytest.mark.parametrize("name", ["../../../escape", "a/b", "a\\b", "..", ".hidden", "", "x\x00y", "x\ny",
                                  "x?mode=ro", "x#y", "x%2e", " lead", "n" * 201])
def test_unsafe_study_names_are_refused(name):
    from tpumk.tune.storage import check_study_name

    with pytest.raises(ConfigError, match="--study") as e:
        check_study_name(name)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not a usable study name"):
        storage_url(None, name)


@pytest.mark.parametrize("name", ["s", "tiny-moe-f32-cpu-b1-c4096-tiny-model-0123456789", "my study", "a..b",
                                  "run_2+x=y@host,v:1"])
def test_safe_study_names_are_kept(name):
    from tpumk.tune.storage import check_study_name

    assert check_study_name(name) == name
    assert storage_url(None, name) == f"sqlite:///artifacts/tune/{name}.db"
    assert storage_url("x.journal", name) == "x.journal"


def test_a_traversing_study_name_writes_nothing(tmp_path, monkeypatch):
    """(Before: `--study ../../../escape` ran, and wrote escape.db and escape.toml three levels up.)"""
    study_must_not_start(monkeypatch)
    cwd = tmp_path / "a" / "b" / "c"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    r = cli(*tune_cmd("--objective", "model", "--trials", 1, "--study", "../../../escape"))
    assert r.stdout == ""
    one_line_error(r, "--study", "'../../../escape'")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "c"]
    r = cli("report", "--study", "../escape", "--out", "plots")
    one_line_error(r, "--study", "'../escape'")


@pytest.mark.parametrize("option", ["--cache-dir", "--storage"])
def test_a_cache_dir_or_storage_under_a_regular_file_is_refused_before_the_study(tmp_path, monkeypatch, option):
    """(Before: FileExistsError from mkdir, after the header lines; for --cache-dir after the study opened.)"""
    study_must_not_start(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file")
    value = "f" if option == "--cache-dir" else "sqlite:///f/s.db"
    r = cli(*tune_cmd("--objective", "model", "--trials", 1, option, value))
    one_line_error(r, option, "f")
    assert r.stdout == ""  # refused before the header lines
    assert (tmp_path / "f").read_text() == "a file"
    assert not (tmp_path / "artifacts" / "tune" / "cache").exists()


def test_result_cache_and_open_storage_refuse_a_regular_file_in_the_way(tmp_path):
    from tpumk.tune.cache import ResultCache

    (tmp_path / "f").write_text("a file")
    with pytest.raises(ConfigError, match="--cache-dir .*cannot create"):
        ResultCache(tmp_path / "f")
    with pytest.raises(ConfigError, match="--cache-dir .*cannot create"):
        ResultCache(tmp_path / "f" / "cache")
    with pytest.raises(ConfigError, match="--storage .*cannot create"):
        open_storage(f"sqlite:///{tmp_path / 'f' / 's.db'}")


def test_local_storage_paths():
    from tpumk.tune.storage import local_path, sqlite_path

    assert sqlite_path("sqlite:///a/b.db") == Path("a/b.db")
    assert sqlite_path("sqlite:////abs/b.db?timeout=5") == Path("/abs/b.db")
    assert sqlite_path("sqlite:///:memory:") is None and sqlite_path("sqlite://") is None
    assert sqlite_path("postgresql://u@h/db") is None
    assert local_path("journal:x/y.journal") == Path("x/y.journal") and local_path("y.journal") == Path("y.journal")
    assert local_path("journal:") is None


def test_a_damaged_compile_log_line_is_skipped(tmp_path):
    from tpumk.tune.cache import ResultCache

    cache = ResultCache(tmp_path / "cache")
    cache.log_compile({"key": "a"})
    with open(cache.log_path, "ab") as f:
        f.write(b"\xff\xfe not json\n[1, 2]\n" + b"[" * 100_000 + b"\n")
    cache.log_compile({"key": "b"})
    assert [r["key"] for r in cache.compile_log()] == ["a", "b"]
    (tmp_path / "cache" / "k.json").write_text("[" * 100_000)
    assert cache.get("k") is None


def test_processes_opening_a_new_sqlite_study_at_once_all_succeed(tmp_path):
    """Optuna creates its schema on the first open; several processes opening a new SQLite file
    at once used to lose the race with `UNIQUE constraint failed: alembic_version` (seen as a
    tune run dying at start while another process read its study)."""
    import subprocess
    import sys

    code = ("import sys; from tpumk.tune.storage import open_storage; "
            "open_storage('sqlite:///' + sys.argv[1]); print('ok')")
    db = tmp_path / "s.db"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(db)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    assert all(o[0].strip() == "ok" for o in outs)


# ---------------------------------------------------------------------- the result cache: one objective's failure
def _study(tmp_path, objective: str, storage_name: str, space=TINY_SPACE, trials=2):
    from tpumk.tune import study as T
    from tpumk.tune.objectives import ObjectiveChoice

    problem = BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"))
    settings = TuneSettings(trials=trials, workers=1, seed=0, heartbeat=1, root=tmp_path, cache_dir=tmp_path / "cache")
    storage = str(tmp_path / f"{storage_name}.journal")
    result = T.run(problem, load_space(space), ObjectiveChoice(objective, "test"), settings, storage=storage,
                   study_name=storage_name)
    study = T.open_study(storage_url(storage, storage_name), storage_name, None, None, create=False)
    return result, study


def estimate_failing_worker(machine_dependent: bool):
    """A stand-in compile that compiles (model value recorded) but has no compiler estimate."""

    def worker(self, trial, tuning):
        v = 1e-6 * tuning.ring_depth + 1e-8 * tuning.kv_buffers
        reply = {"ok": False, "stage": "estimate", "error": "no compiler estimate: profiling compile timed out",
                 "value": None, "compile_seconds": 0.1, "lower_seconds": 0.1, "custom_calls": 1,
                 "model_seconds": v, "model_source": "stand-in", "machine_dependent": machine_dependent}
        if self.objective.name != "compiler":
            reply.update(ok=True, stage="done", value=v, value_kind="tpumk model", source="stand-in")
        return reply, "", 0

    return worker


def test_an_estimate_failure_is_not_served_to_other_objectives(tmp_path, monkeypatch):
    """A compiler study whose estimates fail, then a model study on the same result cache: the
    model study completes every configuration (from the cache: they compiled) instead of
    pruning them with the compiler-estimate reason. (Before: the failed entry was served to
    every objective.)"""
    from tpumk.tune.trial import TrialRunner

    monkeypatch.setattr(TrialRunner, "_run_worker", estimate_failing_worker(False))
    first, study = _study(tmp_path, "compiler", "c")
    assert first.this_run["compiles"] >= 2
    assert all(t.state.name == "PRUNED" and t.user_attrs["prune_stage"] == "estimate" for t in study.trials)
    second, study = _study(tmp_path, "model", "m")
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(done) >= 2 and not any(t.state.name == "PRUNED" for t in study.trials)
    assert second.this_run["compiles"] == 0 and second.this_run["cache_hits"] >= 2
    # and the compiler objective still gets its own recorded failure from the cache
    third, study = _study(tmp_path, "compiler", "c2")
    assert third.this_run["compiles"] == 0
    assert all(t.user_attrs["prune_stage"] == "estimate" for t in study.trials)


def test_an_estimate_timeout_or_kill_is_not_stored(tmp_path, monkeypatch):
    """The profiler running out of the trial's --timeout (or the OOM killer) says nothing about
    the configuration: a rerun evaluates it again. (Before: stored, and served to every study.)"""
    from tpumk.tune.cache import ResultCache
    from tpumk.tune.trial import TrialRunner

    monkeypatch.setattr(TrialRunner, "_run_worker", estimate_failing_worker(True))
    first, study = _study(tmp_path, "compiler", "c")
    assert all(t.user_attrs.get("prune_stage") == "estimate" for t in study.trials)
    keys = {t.user_attrs["config_key"] for t in study.trials}
    cache = ResultCache(tmp_path / "cache")
    assert keys and all(cache.get(k) is None for k in keys)
    again, _ = _study(tmp_path, "compiler", "c2")
    assert again.this_run["compiles"] >= 2 and again.this_run["cache_hits"] == 0


def test_the_worker_marks_profiler_timeouts_and_kills_as_machine_dependent():
    """The words tpumk.estimate.profiler uses for a timeout and a kill are recognised; a
    profiler limit of the configuration (FIFO abort, a CHECK) is not."""
    from tpumk.estimate.profiler import _failure_line, estimate_in_subprocess
    from tpumk.tune.worker import machine_dependent

    timed_out = estimate_in_subprocess(BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x")), timeout=0.01)
    assert timed_out.seconds is None and machine_dependent(timed_out.error), timed_out.error
    assert machine_dependent(f"profiling compile failed (exit -9): {_failure_line('', -9)}")
    assert machine_dependent(f"profiling compile failed (exit -15): {_failure_line('x', -15)}")
    assert not machine_dependent(f"profiling compile failed (exit -6): {_failure_line('Check failed: x', -6)}")
    assert not machine_dependent(_failure_line("Cannot schedule FIFO push foo"))
    assert not machine_dependent(None)


def _entry(key, outcome="ok", **kw):
    e = {"key": key, "outcome": outcome, "objectives": {}, "model_seconds": 1e-6, "model_source": "m"}
    e.update(kw)
    return e


def test_an_ok_entry_is_never_replaced_by_a_later_failure(tmp_path):
    """(Before: put() overwrote the entry holding model/device values with the failure.)"""
    from tpumk.tune.cache import ResultCache

    cache = ResultCache(tmp_path / "cache")
    value = {"value": 2e-6, "value_kind": "measured on device", "source": "d"}
    cache.put("k", _entry("k", objectives={"device": value}))
    cache.put("k", {"key": "k", "outcome": "failed", "stage": "crash", "reason": "abort", "objective": "compiler"})
    assert cache.lookup("k", "device")["objectives"]["device"] == value
    assert cache.lookup("k", "model")["model_seconds"] == 1e-6
    assert cache.lookup("k", "compiler")["objectives"]["compiler"] == {"failed": "abort", "stage": "crash"}
    # a later objective failure does not replace a recorded value of the same objective either
    cache.put("k", _entry("k", objectives={"device": {"failed": "x", "stage": "estimate"}}))
    assert cache.lookup("k", "device")["objectives"]["device"] == value
    # a crash of one objective is that objective's: served to it only, kept when values arrive
    cache.put("j", {"key": "j", "outcome": "failed", "stage": "crash", "reason": "abort", "objective": "compiler"})
    assert cache.lookup("j", "model") is None and cache.lookup("j", "compiler")["reason"] == "abort"
    cache.put("j", _entry("j"))
    assert cache.lookup("j", "model") is not None
    assert cache.lookup("j", "compiler")["objectives"]["compiler"]["failed"] == "abort"
    # plan and compile failures are the configuration's: served to every objective
    cache.put("p", {"key": "p", "outcome": "failed", "stage": "compile", "reason": "VMEM", "objective": "model"})
    assert cache.lookup("p", "device")["reason"] == "VMEM"


@pytest.mark.parametrize("entry", [
    {"key": "k"}, {"key": "k", "outcome": "failed"}, {"key": "k", "outcome": "failed", "stage": "compile"},
    {"key": "k", "outcome": "ok"}, {"key": "k", "outcome": "ok", "objectives": {}},
    {"key": "k", "outcome": "ok", "objectives": {"model": 3}, "model_seconds": None},
    {"key": "k", "outcome": "ok", "objectives": {"model": {"value": "x", "value_kind": "a", "source": "b"}},
     "model_seconds": None},
    {"key": "k", "outcome": "ok", "objectives": [], "model_seconds": 1.0},
    {"key": "k", "outcome": "ok", "objectives": {}, "model_seconds": "fast"},
    {"key": "k", "outcome": "maybe", "stage": "compile", "reason": "x"},
])
def test_a_malformed_cache_entry_is_a_miss(tmp_path, entry):
    """(Before: get() checked only the key; lookup or the trial raised KeyError and stopped the study.)"""
    from tpumk.tune.cache import ResultCache

    cache = ResultCache(tmp_path / "cache")
    (tmp_path / "cache" / "k.json").write_text(json.dumps(entry))
    assert cache.get("k") is None
    for objective in ("model", "compiler", "device"):
        assert cache.lookup("k", objective) is None
    cache.put("k", _entry("k"))  # rewritten
    assert cache.lookup("k", "model") is not None


def test_a_worker_reply_that_is_not_an_object_is_no_reply(tmp_path, monkeypatch):
    """The worker's last line is valid JSON but not an object: the trial is a crash, not an
    AttributeError that stops the study."""
    from tpumk.tune import trial as TR
    from tpumk.tune.cache import ResultCache
    from tpumk.tune.objectives import ObjectiveChoice
    from tpumk.plan.knobs import TuningConfig

    class FakeProc:
        pid, returncode = 999_999_999, 0

        def __init__(self, *a, **kw):
            pass

        def communicate(self, *a, **kw):
            return "starting\n[1, 2]\n", "some warning\n"

    class FakeTrial:
        number = 0

    monkeypatch.setattr(TR.subprocess, "Popen", FakeProc)
    problem = BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"))
    settings = TuneSettings(trials=1, root=tmp_path, cache_dir=tmp_path / "cache")
    runner = TR.TrialRunner(problem, load_space(TINY_SPACE), ObjectiveChoice("model", "test"), settings,
                            ResultCache(tmp_path / "cache"), "s")
    tuning = TuningConfig()
    entry = runner._evaluate(FakeTrial(), tuning, runner.key_of(tuning))
    assert entry["outcome"] == "failed" and entry["stage"] == "crash", entry
    assert "compile worker died (exit 0)" in entry["reason"]


def test_written_files_get_the_usual_mode_and_reach_the_disk(tmp_path, monkeypatch):
    """(Before: mkstemp's 0600 made result-cache entries and tuned TOMLs owner-only, and nothing
    was fsynced before the rename.)"""
    from tpumk import tomlfile

    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(tomlfile.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(tomlfile.os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    old = os.umask(0o022)
    try:
        tomlfile.write_text_atomic(tmp_path / "a.toml", "x = 1\n")
        os.umask(0o077)
        tomlfile.write_text_atomic(tmp_path / "b.toml", "x = 2\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.toml").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.toml").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "a.toml").read_text() == "x = 1\n"
    assert calls == ["fsync", "replace"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toml", "b.toml"]  # no temporary left


def test_report_refuses_a_missing_sqlite_file_of_any_driver(tmp_path, monkeypatch):
    """`sqlite+pysqlite:///missing.db` is a missing file like `sqlite:///missing.db`, not an
    empty database created on the way. (Before: only the `sqlite:///` spelling was checked.)"""
    monkeypatch.chdir(tmp_path)
    for url in ("sqlite:///missing.db", "sqlite+pysqlite:///missing.db", "journal:missing.journal"):
        r = cli("report", "--storage", url, "--out", tmp_path / "plots")
        one_line_error(r, "no such file")
    assert not (tmp_path / "missing.db").exists()


def test_the_compile_log_says_an_objective_failed_after_the_compile(tmp_path, monkeypatch):
    from tpumk.tune.cache import ResultCache
    from tpumk.tune.trial import TrialRunner

    monkeypatch.setattr(TrialRunner, "_run_worker", estimate_failing_worker(False))
    _study(tmp_path, "compiler", "c")
    log = ResultCache(tmp_path / "cache").compile_log()
    assert log and all(r["outcome"] == "failed" and r["stage"] == "estimate" for r in log)


def test_a_trial_killed_before_its_first_heartbeat_is_failed_as_stale(tmp_path):
    """A run killed between creating a trial and its first heartbeat left it RUNNING with no
    heartbeat, which Optuna's RDB never counts as stale: a resumed run waited for it for ever
    (tests/test_tune.py's kill-and-resume test hung in CI). Past the grace period it is failed;
    a trial that beats is not."""
    import optuna

    from tpumk.tune.storage import fail_stale, open_storage

    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat=1)  # grace 3 s
    study = optuna.create_study(storage=storage, study_name="s")
    silent = study.ask()  # never beats: the killed run's trial
    alive = study.ask()
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        storage.record_heartbeat(alive._trial_id)
        time.sleep(0.5)
    fail_stale(study)
    states = {t.number: t.state.name for t in study.get_trials(deepcopy=False)}
    assert states == {silent.number: "FAIL", alive.number: "RUNNING"}, states


def test_a_worker_value_that_is_no_step_time_prunes_the_trial_and_the_study_ends(tmp_path, monkeypatch):
    """A worker that replies ok with 0, a negative or a non-finite value for a configuration: that
    trial is pruned at stage `objective` with a one-line reason naming the value (it compiled, so it
    counts in the budget) and the study ends. (Before, the trial completed with the value, was then
    taken for another process's ("foreign") trial, so the sampler proposed the configuration again
    for ever: the study runs in a daemon thread, so the old behaviour fails instead of hanging.)"""
    import math
    import threading

    from tpumk.tune.trial import TrialRunner

    def worker(self, trial, tuning):
        reply, why, rc = fake_worker(self, trial, tuning)
        if tuning.ring_depth == 4:
            reply.update(value=0.0)
        elif tuning.ring_depth == 8:
            reply.update(value=math.nan)
        elif tuning.kv_buffers == 0:
            reply.update(value=-1.0)
        return reply, why, rc

    monkeypatch.setattr(TrialRunner, "_run_worker", worker)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(zip(("result", "study"), _study(tmp_path, "model", "zero", trials=6))),
                         daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the study did not end"
    result, study = out["result"], out["study"]
    bad = [tr for tr in study.trials if tr.params["ring_depth"] in (4, 8) or tr.params["kv_buffers"] == 0]
    assert bad
    for tr in bad:
        assert tr.state.name == "PRUNED" and tr.user_attrs["prune_stage"] == "objective", tr
        assert "not a step time" in tr.user_attrs["prune_reason"], tr.user_attrs
    assert result.evaluated == 6
    assert all(b["value_seconds"] > 0 for b in result.best), result.best
