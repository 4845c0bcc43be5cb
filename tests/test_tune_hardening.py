"""Hardening of `tpumk tune` against hostile or broken input (each case failed on the code
before it): constraints of unbounded cost or that cannot be evaluated, huge knob ranges, stale
journal locks and corrupt journals, unwritable outputs, the budget counting repeats of one
configuration, and the calibration cache ignoring the probe code.

All fast: constraint and space units, or studies whose compile is a stand-in."""

from __future__ import annotations

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
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 2, "--max-infeasible", 3, "--json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["evaluated"] == 0 and out["infeasible"] == 3
    assert "exceeds 2**1024" in out["default"]["prune_reason"]
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
    from tpumk.tune.trial import TrialRunner

    def no_worker(self, trial, tuning):
        raise AssertionError("the study must not start")

    monkeypatch.setattr(TrialRunner, "_run_worker", no_worker)
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
                     '[knobs.kv_buffers]\ntype = "int"\nlow = 2\nhigh = 3\n')
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


def test_a_space_smaller_than_the_budget_ends_when_exhausted(tmp_path, monkeypatch, stand_in):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "three.toml"
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n')
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 5, "--seed", 2, "--json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["evaluated"] == 3 and any("every configuration of the space was tried" in n for n in out["notes"])


# ---------------------------------------------------------------------- calibration cache
def test_calibration_cache_is_keyed_by_the_probe_source(tmp_path, monkeypatch):
    """An entry stored by other probe code (same target and versions) is not reused. (Before:
    the key was the target and the stack versions only.)"""
    from tpumk.compile.keys import source_inputs, stack_versions
    from tpumk.estimate import calibration as C

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(C.static_profile, "profile_dir", lambda: None)  # never measure here
    target = get_target("tpu7x")
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
    from tpumk.tune.trial import TrialRunner

    def no_worker(self, trial, tuning):
        raise AssertionError("the study must not start")

    monkeypatch.setattr(TrialRunner, "_run_worker", no_worker)
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
    from tpumk.tune.trial import TrialRunner

    def no_worker(self, trial, tuning):
        raise AssertionError("the study must not start")

    monkeypatch.setattr(TrialRunner, "_run_worker", no_worker)
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
