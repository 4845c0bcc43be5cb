"""`tpumk tune` and `tpumk report`: real compiles in worker processes, a resumable study,
infeasible configurations pruned before compiling, the tuned file consumed by `tpumk build`.

Every study here runs in its own working directory (its artifacts/tune/ with the default
SQLite storage, the result cache and the compile log), so no test sees another's cache.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.model.config import resolve_model
from tpumk.errors import ConfigError
from tpumk.targets import get_target
from tpumk.tune.cache import ResultCache
from tpumk.tune.settings import TuneSettings
from tpumk.tune.storage import open_storage, storage_url
from tpumk.tune.study import study_name_for
from tpumk.tune.objectives import choose_objective
from tpumk.plan.knobs import load_tuning
from tpumk.tune.space import SPACES_DIR, load_space
from tpumk.plan.spec import BuildSpec

from estimate_support import COMPILER_ESTIMATE
from impostor import imported, plant
from tpumk.child_process import command

TINY_SPACE = str(SPACES_DIR / "tiny.toml")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tune_cmd(*extra, model: str = "tiny-moe"):
    return ["tune", "--model", model, "--target", "tpu7x", "--space", TINY_SPACE, *map(str, extra)]


def load(url_or_path: str, study: str):
    return optuna.load_study(study_name=study, storage=open_storage(storage_url(url_or_path, study)))


def finished(study):
    return [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]


def evaluated(study):
    """The budget: one trial (the first) per distinct configuration complete, or pruned by the
    compiler (not before compiling); trials repeating an evaluated configuration do not count."""
    out, seen = [], set()
    for t in sorted(finished(study), key=lambda t: t.number):
        if t.state.name == "COMPLETE" or t.user_attrs.get("prune_stage") not in ("tuning", "constraint", "plan"):
            key = t.user_attrs.get("config_key", f"trial {t.number}")
            if key not in seen:
                seen.add(key)
                out.append(t)
    return out


def compile_log(root: Path):
    return ResultCache(root / "artifacts" / "tune" / "cache").compile_log()


# ---------------------------------------------------------------------- objective choice (no compile)
def test_auto_objective_says_why():
    tiny = resolve_model("tiny-moe")  # float32 weights
    # without a profiler for kernels with DMAs (the vLLM TPU / jax 0.12 sets) that is the reason
    why = "float32" if COMPILER_ESTIMATE else "static profile does not work for tpu7x kernels with DMAs"
    c = choose_objective("auto", tiny, get_target("tpu7x"), tpu_kind=None)
    assert c.name == "model" and why in c.reason
    c = choose_objective("auto", tiny.replace(dtype="bfloat16"), get_target("tpu7x"), tpu_kind=None)
    assert c.name == ("compiler" if COMPILER_ESTIMATE else "model") and "no tpu7x TPU attached" in c.reason
    assert choose_objective("auto", tiny.replace(dtype="bfloat16"), get_target("v5e")).name == "model"
    assert choose_objective("auto", tiny, get_target("cpu")).name == "model"
    c = choose_objective("auto", tiny.replace(dtype="bfloat16"), get_target("tpu7x"), tpu_kind="tpu7x")
    assert c.name == "device" and c.device_repeats > 1
    c = choose_objective("device", tiny, get_target("cpu"))
    assert "says nothing about TPU speed" in c.reason
    with pytest.raises(ConfigError, match=why):
        choose_objective("compiler", tiny, get_target("tpu7x"))
    with pytest.raises(ConfigError, match="no TPU is attached"):
        choose_objective("device", tiny, get_target("tpu7x"), tpu_kind=None)


def test_study_name_is_stable_and_covers_the_problem():
    space = load_space(TINY_SPACE)
    cfg = resolve_model("tiny-moe")
    p = BuildSpec(cfg, get_target("tpu7x"), 1, 4096)
    name = study_name_for(p, space, "model")
    assert name == study_name_for(BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"), 1, 4096), space, "model")
    others = {study_name_for(BuildSpec(cfg, get_target("tpu7x"), 2, 4096), space, "model"),
              study_name_for(BuildSpec(cfg.replace(dtype="bfloat16"), get_target("tpu7x"), 1, 4096), space, "model"),
              study_name_for(p, space, "compiler"),
              study_name_for(p, load_space(SPACES_DIR / "default.toml"), "model")}
    assert name not in others and len(others) == 4
    assert name.startswith("tiny-moe-f32-tpu7x-b1-c4096-tiny-model-")


# ---------------------------------------------------------------------- bad input: one line, exit 1
def test_broken_space_file_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text('[knobs.ring_depht]\ntype = "int"\nlow = 2\nhigh = 8\n')
    r = cli(*tune_cmd("--space", bad, "--trials", 2))
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpumk: error:") and "bad.toml" in lines[0]
    assert "unknown knob 'ring_depht'" in lines[0]
    assert not (tmp_path / "artifacts").exists()  # nothing started


@pytest.mark.parametrize("args, needle", [
    (("--storage", "nowhere"), "--storage 'nowhere'"),
    # tiny-moe is float32: the static profiler aborts (or, on a libtpu without one for DMA kernels, that)
    (("--objective", "compiler"), "float32" if COMPILER_ESTIMATE else "static profile does not work"),
    (("--trials", "0"), "--trials"),
    (("--storage", "postgresql://u:secret@127.0.0.1:1/db", "--trials", "2"), "cannot open"),
])
def test_bad_tune_options_are_one_line_errors(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    r = cli(*tune_cmd(*args))
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "secret" not in r.stderr  # storage passwords are never printed


def test_report_on_missing_study_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("report", "--study", "nope", "--out", tmp_path / "rep")
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr


# ---------------------------------------------------------------------- infeasible: pruned, never compiled
def test_infeasible_configurations_are_pruned_with_reason_and_never_compiled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "infeasible.toml"
    # ring 4 breaks the constraint; rings 8 and 12 overrun a 6.4 MiB VMEM budget in the plan.
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n\n'
                     '[fixed]\nvmem_limit_fraction = 0.1\n\n'
                     '[[constraints]]\nexpr = "ring_depth >= 8"\nwhy = "small rings excluded for this test"\n')
    r = cli(*tune_cmd("--space", space, "--objective", "model", "--trials", 2, "--max-infeasible", 6,
                      "--seed", 3))
    # Nothing could be evaluated: one line saying how many configurations were rejected and by
    # what (before: exit 0 with `best: []`).
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert r.stderr.startswith(f"tpumk: error: --space {space}: no configuration of its 3 grid points can be "
                               "evaluated for tiny-moe (float32) on tpu7x, batch 1, context 4096: 3 configurations "
                               "rejected before compiling (plan 2, constraint 1), e.g. ")
    assert "Traceback" not in r.output
    name = study_name_for(BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x")), load_space(space), "model")
    study = load(None, name)
    # Pruned before compiling, outside the budget of 2 evaluated trials: the whole grid of 3 once
    # (then nothing is left to propose), under the cap of 6.
    assert [t.state.name for t in study.trials] == ["PRUNED"] * 3
    assert study.trials[0].user_attrs["tpumk_default"]
    stages = set()
    for t in study.trials:
        a = t.user_attrs
        stages.add(a["prune_stage"])
        assert "compile_seconds" not in a and "config_key" not in a
        if t.params["ring_depth"] == 4:
            assert a["prune_stage"] == "constraint" and "small rings excluded" in a["prune_reason"]
            assert "ring_depth=4" in a["prune_reason"]
        else:
            assert a["prune_stage"] == "plan" and "does not fit tpu7x VMEM" in a["prune_reason"]
    assert stages == {"constraint", "plan"}
    assert compile_log(tmp_path) == []  # no worker ever ran
    assert not any((tmp_path / "artifacts" / "tune").glob("*.toml"))  # no best: no tuned file


# ---------------------------------------------------------------------- a whole study, then build
def test_tiny_study_runs_and_build_accepts_the_tuned_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # Impostor `tpumk` packages in the working directory and first on PYTHONPATH: the trial
    # workers (and the profiling processes they start) must import this tpumk, not them.
    for k, v in plant(tmp_path, tmp_path / "elsewhere").items():
        monkeypatch.setenv(k, v)
    tuned = tmp_path / "tuned.toml"
    # tiny-dense: a study's path is the same for every model and its compiles are the quickest
    # (a MoE model's expert split is searched in tests/test_tune_devices.py)
    # the compiler objective where this libtpu profiles kernels with DMAs, else tpumk's model (the
    # same study, tuned file and report; the compiler objective's refusal: test_bad_tune_options...)
    obj, kind = ("compiler", "compiler estimate") if COMPILER_ESTIMATE else ("model", "tpumk model")
    r = cli(*tune_cmd("--dtype", "bfloat16", "--objective", obj, "--trials", 3, "--workers", 2,
                      "--seed", 0, "--out", tuned, "--report", tmp_path / "report", "--json", model="tiny-dense"))
    assert r.exit_code == 0, r.output
    said = "static estimate" if COMPILER_ESTIMATE else "timeline model"
    assert f"objective: {obj}" in r.stderr and said in r.stderr  # said at the start
    out = json.loads(r.stdout)
    # --trials counts distinct evaluated configurations; repeats of one are outside the budget.
    assert out["evaluated"] == 3 and "FAIL" not in out["counts"]
    assert out["counts"].get("COMPLETE", 0) + out["counts"].get("PRUNED", 0) == 3 + out["infeasible"] + out["repeated"]
    study = load(None, out["study"])
    trials = finished(study)
    assert len(trials) == 3 + out["infeasible"] + out["repeated"]
    assert len(evaluated(study)) == 3
    default = study.trials[0]
    assert default.user_attrs.get("tpumk_default") and default.state.name == "COMPLETE"
    compiled_keys = []
    for t in trials:
        a = t.user_attrs
        if t.state.name == "COMPLETE":
            assert a["objective"] == obj and a["value_kind"] == kind
            if COMPILER_ESTIMATE:
                assert "static profile" in a["objective_source"] and "calibration" in a["objective_source"]
                assert a["estimate_source"] == a["objective_source"]
            else:
                assert "tpumk timeline model" in a["objective_source"]
            assert t.value >= a["floor_seconds"] > 0 and a["vmem_bytes"] > 0
            assert a["compile_seconds"] > 0 and a["custom_calls"] == 1
            assert a["model_seconds"] > 0  # tpumk's model is kept next to every result
        else:
            assert a["prune_reason"]
        if not a.get("cached") and "config_key" in a:
            compiled_keys.append(a["config_key"])
    # Every evaluated configuration compiled exactly once, and the log says so.
    log = compile_log(tmp_path)
    assert sorted(e["key"] for e in log) == sorted(compiled_keys)
    assert len(set(compiled_keys)) == len(compiled_keys)
    assert out["this_run"]["compiles"] == len(log)
    # The summary: ranked, provenance named, best over the default.
    best = out["best"][0]
    assert best["value_seconds"] == min(t.value for t in trials if t.state.name == "COMPLETE")
    assert best["value_kind"] == kind
    assert out["best_over_default"] == pytest.approx(best["value_seconds"] / default.value)
    assert out["best_over_default"] <= 1.0
    # The tuned file: a [tuning] table that is the best trial's configuration...
    assert load_tuning(tuned).to_dict() == out["best_tuning"]
    space = load_space(TINY_SPACE)
    assert out["best_tuning"] == space.tuning_for(study.best_trial.params).to_dict()
    # ...which `tpumk build --tuning` accepts and builds.
    b = cli("build", "--model", "tiny-dense", "--dtype", "bfloat16", "--target", "tpu7x", "--tuning", tuned,
            "--no-estimate", "--json")
    assert b.exit_code == 0, b.output
    rep = json.loads(b.stdout)
    assert rep["tuning"] == out["best_tuning"] and rep["custom_calls"] == 1
    # --report wrote real PNGs.
    written = out["report"]["written"]
    assert {Path(p).name for p in written} >= {"history.png", "importances.png", "timeline.png"}
    for p in written:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # Not a terminal: one line per finished trial on stderr (stdout is the JSON).
    logged = [ln for ln in r.stderr.splitlines() if ln.startswith("trial ")]
    assert len(logged) == len(trials)
    assert [ln for ln in logged if ln.startswith("trial 0 (default configuration): COMPLETE ")]
    assert all(f"({kind})" in ln for ln in logged if ": COMPLETE " in ln)
    # Rerunning the finished study evaluates nothing, and says so.
    r2 = cli(*tune_cmd("--dtype", "bfloat16", "--objective", obj, "--trials", 3, "--json", model="tiny-dense"))
    assert r2.exit_code == 0, r2.output
    out2 = json.loads(r2.stdout)
    assert out2["study"] == out["study"] and out2["this_run"]["trials"] == 0
    assert out2["already_complete"] and "--trials 6" in out2["notes"][0] and "is complete" in r2.stderr
    assert len(compile_log(tmp_path)) == len(log)
    # `tpumk report` on the stored study, and its too-few-trials message.
    rr = cli("report", "--study", out["study"], "--out", tmp_path / "rep2", "--json")
    assert rr.exit_code == 0, rr.output
    assert {Path(p).name for p in json.loads(rr.stdout)["written"]} >= {"history.png", "timeline.png"}
    # ...found by the build options that made it, as tune takes them (no hash-suffixed name)
    rb = cli(*["report" if a == "tune" else a for a in tune_cmd("--dtype", "bfloat16", "--objective", obj,
                                                                  model="tiny-dense")], "--out", tmp_path / "rep3", "--json")
    assert rb.exit_code == 0 and json.loads(rb.stdout)["study"] == out["study"], rb.output
    other = cli("report", "--model", "tiny-dense", "--target", "tpu7x", "--out", tmp_path / "rep4")
    assert other.exit_code == 1 and "no study for tiny-dense" in other.stderr and "run `tpumk tune`" in other.stderr
    assert not imported(tmp_path, tmp_path / "elsewhere")


def test_a_one_trial_study_of_a_hybrid_runs_on_the_cpu_target(tmp_path, monkeypatch):
    """A hybrid (Gated DeltaNet layers beside gated attention): its space's facts count the
    layers of each kind, its search leaves out only what the build has not (experts, the
    collectives; the attention layers' qkv / o knobs stay, the linear families have none), and
    a one-trial study on the cpu target compiles and ranks its configuration."""
    import tomli_w

    from tpumk.model.config import load_preset
    from tpumk.tune.space import space_facts, unused_knobs

    cfg = load_preset("tiny-dense").replace(
        name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=1,
        linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)
    spec = BuildSpec(cfg, get_target("cpu"), context=256)
    facts = space_facts(spec)
    assert (facts["num_layers"], facts["num_attention_layers"], facts["num_linear_layers"]) == (3, 1, 2)
    assert (facts["num_dense_layers"], facts["num_moe_layers"], facts["is_moe"]) == (3, 0, 0)
    dropped = unused_knobs(spec)
    assert "qkv_tile_rows" not in dropped and "o_tile_cols" not in dropped and "expert_slots" in dropped
    nxt = space_facts(BuildSpec(resolve_model("qwen3-next-80b-a3b"), get_target("tpu7x"), batch=8, context=4096,
                                devices=8))
    assert (nxt["num_attention_layers"], nxt["num_linear_layers"], nxt["num_moe_layers"]) == (12, 36, 48)
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "tiny-gdn.toml"
    toml.write_text(tomli_w.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in cfg.to_dict().items()}))
    r = cli("tune", "--model", toml, "--target", "cpu", "--context", 256, "--trials", 1, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["evaluated"] == 1 and out["counts"] == {"COMPLETE": 1}
    assert out["best"][0]["value_seconds"] > 0 and out["best"][0]["value_kind"] == "tpumk model"


def test_report_explains_missing_importances(tmp_path):
    """One complete trial: the history plots, importances say why not."""
    from tpumk.tune.report import write_report

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="one")
    study.enqueue_trial({"ring_depth": 8})
    study.optimize(lambda t: t.suggest_int("ring_depth", 4, 12) * 1e-6, n_trials=1)
    r = write_report(study, tmp_path / "rep")
    assert [Path(p).name for p in r["written"]] == ["history.png", "timeline.png"]
    assert r["skipped"]["importances.png"] == "needs at least 2 complete trials, the study has 1"


# ---------------------------------------------------------------------- kill, then resume
def test_killed_study_resumes_and_recompiles_nothing_that_finished(tmp_path):
    # --timeout 60: a compile stuck on a loaded host is pruned (counted as evaluated) instead of
    # outliving the rerun's 300 s limit under the default 900 s.
    # tiny-dense: resuming is the same for every model, and its compile is the quickest
    args = [*command("tpumk.cli"), *tune_cmd("--objective", "model", "--trials", 3, "--seed", 5,
                                                          "--heartbeat", 1, "--timeout", 60, "--json",
                                                          model="tiny-dense")]
    name = study_name_for(BuildSpec(resolve_model("tiny-dense"), get_target("tpu7x")), load_space(TINY_SPACE), "model")
    db = tmp_path / "artifacts" / "tune" / f"{name}.db"
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        evaluated_before = []
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if proc.poll() is not None:
                pytest.fail(f"tune ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
            if not db.exists():
                continue
            try:
                study = load(str(db), name)
            except (KeyError, Exception):
                continue
            evaluated_before = [t for t in finished(study) if "compile_seconds" in t.user_attrs]
            if evaluated_before:  # killed at the first finished compile: at least one is left to do
                break
        assert evaluated_before, "no compile finished in time"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    study = load(str(db), name)
    before = {t.number: t for t in finished(study)}
    killed = [t.number for t in study.trials if t.state.name == "RUNNING"]
    keys_before = {t.user_attrs["config_key"] for t in before.values() if "config_key" in t.user_attrs}
    log_before = compile_log(tmp_path)
    assert {e["key"] for e in log_before} <= keys_before
    # The sampler of the rerun may well suggest finished configurations again; make sure it does.
    room = 3 - len([t for t in evaluated(study) if t.number in before])
    assert room >= 1
    for t in [t for t in before.values() if "config_key" in t.user_attrs][:room]:
        study.enqueue_trial(t.params)
    # The same command again.
    r = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    study = load(str(db), name)
    after = finished(study)
    assert len(evaluated(study)) == 3
    for n in killed:  # the killed run's trial was failed by the heartbeat, not left RUNNING
        assert study.trials[n].state.name == "FAIL"
    assert not [t for t in study.trials if t.state.name in ("RUNNING", "WAITING")]
    log = compile_log(tmp_path)
    # Nothing that had finished was compiled again; nothing was compiled twice at all.
    assert not [e for e in log[len(log_before):] if e["key"] in keys_before]
    assert len({e["key"] for e in log}) == len(log)
    reused = [t for t in after if t.number not in before and t.user_attrs.get("config_key") in keys_before]
    assert reused and all(t.user_attrs["cached"] for t in reused)
    assert json.loads(r.stdout)["counts"].get("FAIL", 0) == len(killed)


# ---------------------------------------------------------------------- claims without compiles
def test_duplicate_configurations_in_parallel_are_evaluated_once(tmp_path, monkeypatch):
    """Four threads, eight trials over three configurations enqueued twice or more each: the
    claim protocol lets one trial per configuration evaluate and the others wait and reuse.
    The compile is replaced by a slow stand-in so the threads overlap for sure."""
    import threading

    from tpumk.tune import study as T
    from tpumk.tune.trial import TrialRunner

    calls: list[str] = []
    lock = threading.Lock()

    def fake_worker(self, trial, tuning):
        with lock:
            calls.append(self.key_of(tuning))
        time.sleep(1.0)
        return ({"ok": True, "stage": "done", "value": 1e-6 * tuning.ring_depth, "value_kind": "tpumk model",
                 "source": "stand-in", "compile_seconds": 0.1, "lower_seconds": 0.1, "custom_calls": 1,
                 "model_seconds": 1e-6 * tuning.ring_depth, "model_source": "stand-in"}, "", 0)

    monkeypatch.setattr(TrialRunner, "_run_worker", fake_worker)
    space = load_space(TINY_SPACE)
    problem = BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"))
    objective = choose_objective("model", problem.model, problem.target)
    name = "dups"
    storage = str(tmp_path / "dups.journal")
    study = T.open_study(storage_url(storage, name), name, None, None, heartbeat=1)
    d = space.default_values()
    assert d["ring_depth"] == 12
    study.enqueue_trial(d, user_attrs={"tpumk_default": True})  # run() enqueues no second default
    for ring in (12, 8, 8, 8, 4, 4, 12):
        study.enqueue_trial({**d, "ring_depth": ring})
    # --trials counts distinct configurations: the three queued ones (and their repeats, reused).
    settings = TuneSettings(trials=3, workers=4, heartbeat=1, root=tmp_path, cache_dir=tmp_path / "cache")
    result = T.run(problem, space, objective, settings, storage=storage, study_name=name)
    assert result.evaluated == 3 and not {"FAIL", "PRUNED", "RUNNING"} & set(result.counts)  # queued rest: WAITING
    assert result.counts["COMPLETE"] == 3 + result.repeated and result.repeated >= 3  # 12, 8, 8, 8, 4 at least
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 3
    study = T.open_study(storage_url(storage, name), name, None, None, create=False)
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert {t.params["ring_depth"] for t in done} == {4, 8, 12}
    for t in done:
        assert t.value == pytest.approx(1e-6 * t.params["ring_depth"])
    reused = [t for t in done if t.user_attrs["cached"]]
    assert len(reused) == result.repeated == result.reused
    assert all(study.trials[t.user_attrs["duplicate_of"]].params == t.params
               for t in reused if "duplicate_of" in t.user_attrs)


# ---------------------------------------------------------------------- the front door, in a log
def test_cli_logs_one_line_per_trial_and_says_when_a_study_is_complete(tmp_path, monkeypatch):
    """Where stderr is not a terminal (CliRunner, CI logs) every finished trial is one line:
    number, state, value and its kind, or why it was pruned. A rerun of a finished study runs
    nothing and says how to extend it; the larger --trials it names does. The compile is a
    stand-in (this is about what the command prints)."""
    from tpumk.tune.trial import TrialRunner

    def fake_worker(self, trial, tuning):
        if tuning.ring_depth == 4:
            return ({"ok": False, "stage": "compile", "error": "Mosaic: stand-in rejection"}, "", 1)
        return ({"ok": True, "stage": "done", "value": 1e-6 * tuning.ring_depth, "value_kind": "tpumk model",
                 "source": "stand-in", "compile_seconds": 0.1, "lower_seconds": 0.1, "custom_calls": 1,
                 "model_seconds": 1e-6 * tuning.ring_depth, "model_source": "stand-in"}, "", 0)

    monkeypatch.setattr(TrialRunner, "_run_worker", fake_worker)
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "rings.toml"
    # Six configurations: --trials counts distinct ones, so 4 and then 5 must be reachable.
    space.write_text('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n\n'
                     '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 3]\n')  # 0: the default, auto
    args = tune_cmd("--space", space, "--objective", "model", "--seed", 1)
    r = cli(*args, "--trials", 4)
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("trial ")]
    assert len(lines) >= 4, r.stdout  # more when the sampler repeated a configuration (reused, not counted)
    assert lines[0] == "trial 0 (default configuration): COMPLETE 12.00 us (tpumk model) [1/4 evaluated]"
    assert lines[-1].endswith("[4/4 evaluated]")
    for ln in lines:
        assert re.fullmatch(r"trial \d+( \(default configuration\))?: (COMPLETE [\d.]+ us \(tpumk model\)"
                            r"(, reused from (trial \d+|result cache))?|PRUNED at compile: Mosaic: stand-in "
                            r"rejection( \(reused from (trial \d+|result cache)\))?) \[\d/4 evaluated\]", ln), ln
    assert "is complete" not in r.stdout
    # the next step rebuilds exactly this build: its options as typed, the tuned knobs' file
    out_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("wrote "))
    out = out_line.split()[1].rstrip(";")
    assert out_line.endswith(f"build with it: tpumk build --model tiny-moe --target tpu7x --tuning {out}")
    wide = cli(*tune_cmd("--space", space, "--objective", "model", "--seed", 1, "--batch", 2, "--dtype", "bfloat16",
                         "--trials", 1))
    assert wide.exit_code == 0, wide.output
    assert "tpumk build --model tiny-moe --dtype bfloat16 --target tpu7x --batch 2 --tuning " in wide.stdout

    again = cli(*args, "--trials", 4)
    assert again.exit_code == 0, again.output
    assert not [ln for ln in again.stdout.splitlines() if ln.startswith("trial ")]
    assert "is complete, nothing was run: it already has 4 evaluated trials (--trials 4)" in again.stdout
    assert "rerun with a larger --trials, e.g. --trials 8" in again.stdout
    j = cli(*args, "--trials", 4, "--json")  # JSON on stdout; the message on stderr
    assert json.loads(j.stdout)["already_complete"] is True and "is complete" in j.stderr

    more = cli(*args, "--trials", 5, "--json")
    assert more.exit_code == 0, more.output
    out = json.loads(more.stdout)
    assert out["already_complete"] is False and out["evaluated"] == 5 and out["this_run"]["trials"] >= 1
    assert [ln for ln in more.stderr.splitlines() if ln.startswith("trial ")][-1].endswith("[5/5 evaluated]")


# ---------------------------------------------------------------------- code changes: no stale value
def test_values_of_other_code_are_neither_stored_nor_mixed_into_a_study(tmp_path, monkeypatch):
    """A worker that ran other source than the key names (the tree was edited during the run)
    stops the run and stores nothing; a study made by other evaluation code is refused by name."""
    from tpumk.tune import study as T
    from tpumk.tune.trial import SourceChanged, TrialRunner

    def edited_worker(self, trial, tuning):
        return ({"ok": True, "stage": "done", "value": 1e-6, "value_kind": "tpumk model", "source": "stand-in",
                 "compile_seconds": 0.1, "lower_seconds": 0.1, "custom_calls": 1, "model_seconds": 1e-6,
                 "model_source": "stand-in", "evaluator_sha256": "0" * 64}, "", 0)

    monkeypatch.setattr(TrialRunner, "_run_worker", edited_worker)
    space = load_space(TINY_SPACE)
    problem = BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"))
    objective = choose_objective("model", problem.model, problem.target)
    settings = TuneSettings(trials=2, root=tmp_path, cache_dir=tmp_path / "cache")
    with pytest.raises(SourceChanged, match="source changed while the study ran"):
        T.run(problem, space, objective, settings)
    assert not list((tmp_path / "cache").glob("*.json"))  # nothing stored under this code's keys

    url = storage_url(str(tmp_path / "s.journal"), "s")
    ev = {"units": ["tpumk"], "sha256": "1" * 64}
    T.open_study(url, "s", T.study_identity(problem, space, "model", ev), None)
    other = T.study_identity(problem, space, "model", {**ev, "sha256": "2" * 64})
    with pytest.raises(ConfigError, match="evaluated by other tpumk code"):
        T.open_study(url, "s", other, None)
    assert T.study_name_for(problem, space, "model", ev) != T.study_name_for(problem, space, "model",
                                                                              {**ev, "sha256": "2" * 64})


# ---------------------------------------------------------------------- the device objective
@pytest.mark.slow
def test_device_objective_on_cpu_times_interpret_mode_and_says_so(tmp_path, monkeypatch):
    """No TPU here: the device objective with the cpu target times Pallas interpret mode (15 s
    on 2 idle cores, 45 s loaded: the interpret-mode compile dominates) and labels the value."""
    monkeypatch.chdir(tmp_path)
    r = cli("tune", "--model", "tiny-moe", "--target", "cpu", "--context", 256, "--space", TINY_SPACE,
            "--objective", "device", "--trials", 1, "--json")
    assert r.exit_code == 0, r.output
    assert "says nothing about TPU speed" in r.stderr
    best = json.loads(r.stdout)["best"][0]
    assert best["value_kind"].startswith("measured in Pallas interpret mode") and best["value_seconds"] > 0
    [entry] = [json.loads(p.read_text()) for p in (tmp_path / "artifacts" / "tune" / "cache").glob("*.json")]
    steps = entry["objectives"]["device"]["details"]["step_seconds"]
    assert len(steps) == 3 and best["value_seconds"] == sorted(steps)[1]  # the median of 3 timed steps
