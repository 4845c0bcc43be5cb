"""`tpumk tune --devices N`: a MoE model's expert split (`expert_parallel`) is searched over the
choices the build allows (a computed knob of the tuning space), builds without a choice do not
spend trials on it, and the devices reach the study name, the result-cache keys, the worker's
compile and the summary. Studies run in their own working directory (artifacts/tune/ there)."""

from __future__ import annotations

import json

import optuna
import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.errors import ConfigError
from tpumk.model.config import resolve_model
from tpumk.plan.knobs import TuningConfig, load_tuning
from tpumk.plan.plan import make_plan
from tpumk.plan.sharding import expert_parallel_choices
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target
from tpumk.tune.cache import ResultCache, ResultKeys, evaluator_inputs
from tpumk.tune.objectives import ObjectiveChoice
from tpumk.tune.settings import TuneSettings
from tpumk.tune.space import DEFAULT_SPACE_PATH, load_space, space_facts
from tpumk.tune.storage import open_storage, storage_url
from tpumk.tune.study import study_identity, study_name_for
from tpumk.tune.trial import TrialRunner

TPU7X = get_target("tpu7x")
SPLIT_SPACE = '[knobs.expert_parallel]\ntype = "computed"\nfunction = "expert_parallel_choices"\n'


def spec(devices: int, model: str = "tiny-moe") -> BuildSpec:
    return BuildSpec(resolve_model(model), TPU7X, batch=1, context=256, devices=devices)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---------------------------------------------------------------------- the space (no compile)
def test_the_default_space_computes_the_expert_split_for_each_build():
    space = load_space(DEFAULT_SPACE_PATH)
    assert space.knobs["expert_parallel"].kind == "computed"
    four = space.for_build(spec(4))
    ep = four.knobs["expert_parallel"]
    assert ep.kind == "categorical" and ep.values() == expert_parallel_choices(resolve_model("tiny-moe"), 4) == [2, 4]
    # the default is the split auto makes, so the default trial plans as TuningConfig() does
    assert four.default_values()["expert_parallel"] == make_plan(spec(4)).sharding.expert_parallel == 2
    one = space.for_build(spec(1))
    assert "expert_parallel" not in one.knobs and "all_reduce" not in one.knobs
    # 4 devices: a power of two, and (the cpu target emulates TPU7x) two chips of sibling cores
    assert four.knobs["all_reduce"].values() == ["direct", "rsag", "doubling", "hierarchical"]
    assert four.default_values()["all_reduce"] == make_plan(spec(4)).all_reduce.schedule == "direct"
    assert four.knobs["all_reduce_wire"].values() == ["float32", "bfloat16"] and "all_reduce_wire" not in one.knobs
    assert four.default_values()["all_reduce_wire"] == make_plan(spec(4)).all_reduce.dtype == "float32"
    assert four.size() == 2 * 4 * 2 * one.size()
    assert "expert_parallel" not in space.for_build(spec(4, "tiny-dense")).knobs
    big = space.for_build(BuildSpec(resolve_model("qwen3-235b-a22b"), TPU7X, 1, 4096, devices=32))
    assert big.knobs["expert_parallel"].values() == [8, 16, 32]
    assert four.for_build(spec(4)) is four
    assert "expert_parallel" not in four.for_build(spec(1)).knobs  # rebinding starts from the file
    with pytest.raises(ConfigError, match=r"^knob 'expert_parallel': .* bind the space to a build first"):
        space.suggest(optuna.trial.FixedTrial(space.default_values()))


def test_facts_are_one_devices_share():
    one, four = space_facts(spec(1)), space_facts(spec(4))
    cfg = resolve_model("tiny-moe")
    assert (one["devices"], four["devices"]) == (1, 4)
    assert one["vocab_size"] == cfg.vocab_size and four["vocab_size"] == -(-cfg.vocab_size // 4)
    assert four["num_q_heads"] == cfg.num_q_heads // 4 and four["hidden_size"] == cfg.hidden_size
    assert four["num_experts"] == cfg.num_experts == one["experts_per_device"]
    split4 = space_facts(spec(4).replace(tuning=TuningConfig(expert_parallel=4)))
    assert (four["experts_per_device"], four["expert_ffn_size"]) == (4, 128)  # auto: 2 groups of 2 devices
    assert (split4["experts_per_device"], split4["expert_ffn_size"]) == (2, 256)
    assert split4["step_weight_bytes"] < one["step_weight_bytes"]


def test_an_infeasible_split_is_pruned_with_the_plans_reason(tmp_path):
    """A categorical space may list any split: the plan judges it, as every other knob."""
    path = tmp_path / "any.toml"
    path.write_text('[knobs.expert_parallel]\ntype = "categorical"\nchoices = [1, 2, 4]\n')
    settings = TuneSettings(trials=1, root=tmp_path, cache_dir=tmp_path / "cache")
    runner = TrialRunner(spec(4), load_space(path), ObjectiveChoice("model", "test"), settings,
                         ResultCache(tmp_path / "cache"), "s")
    trial = optuna.trial.FixedTrial({"expert_parallel": 1})
    with pytest.raises(optuna.TrialPruned):
        runner._precheck(trial, {"expert_parallel": 1})
    reason = trial.user_attrs["prune_reason"]
    assert trial.user_attrs["prune_stage"] == "plan" and "'expert_parallel' = 1" in reason
    assert "possible: 2, 4" in reason and "\n" not in reason
    assert runner._precheck(optuna.trial.FixedTrial({}), {"expert_parallel": 4}).expert_parallel == 4


def test_the_study_name_and_the_result_keys_follow_the_devices():
    space, ev = load_space(DEFAULT_SPACE_PATH), evaluator_inputs()
    one, four = study_name_for(spec(1), space, "model", ev), study_name_for(spec(4), space, "model", ev)
    assert one.startswith("tiny-moe-f32-tpu7x-b1-c256-default-model-")
    assert four.startswith("tiny-moe-f32-tpu7x-d4-b1-c256-default-model-")
    assert study_name_for(spec(8), space, "model", ev) not in (one, four)
    ident = study_identity(spec(4), space, "model", ev)
    assert ident["problem"]["devices"] == 4 and "expert_parallel" in ident["space"]["knobs"]
    assert "expert_parallel" not in study_identity(spec(1), space, "model", ev)["space"]["knobs"]
    assert ResultKeys(spec(1))(TuningConfig()) != ResultKeys(spec(4))(TuningConfig())


# ---------------------------------------------------------------------- end to end (real compiles)
def _tune(tmp_path, *devices):
    r = cli("tune", "--model", "tiny-moe", "--target", "tpu7x", "--context", 256, *devices,
            "--space", tmp_path / "split.toml", "--objective", "model", "--trials", 3, "--seed", 0, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    study = optuna.load_study(study_name=out["study"], storage=open_storage(storage_url(None, out["study"])))
    return out, study.get_trials(deepcopy=False)


@pytest.mark.full  # the space it searches: test_the_default_space_computes_the_expert_split_for_each_build
def test_tune_on_4_devices_searches_the_expert_split_and_1_device_does_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "split.toml").write_text(SPLIT_SPACE)
    out, trials = _tune(tmp_path, "--devices", 4)
    assert out["devices"] == 4 and "on 4 x tpu7x" in out["problem"] and "-d4-" in out["study"]
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert sorted(t.params["expert_parallel"] for t in complete) == [2, 4]  # both splits, once each
    assert trials[0].params == {"expert_parallel": 2} and trials[0].user_attrs["tpumk_default"]
    assert out["evaluated"] == 2 and any("every configuration of the space was tried" in n for n in out["notes"])
    assert load_tuning(out["out"]).expert_parallel in (2, 4)
    # the worker compiled the 4-device build, under keys that name the 4 devices
    cache = tmp_path / "artifacts" / "tune" / "cache"
    entries = [json.loads(p.read_text()) for p in cache.glob("*.json")]
    assert sorted(e["tuning"]["expert_parallel"] for e in entries) == [2, 4]
    keys = ResultKeys(spec(4))
    assert {e["key"] for e in entries} == {keys(TuningConfig(expert_parallel=v)) for v in (2, 4)}
    assert all("4 x tpu7x" in e["problem"] and e["outcome"] == "ok" for e in entries)

    # One device: nothing to split, so the study's only configuration is the default.
    one, trials1 = _tune(tmp_path)
    assert one["devices"] == 1 and one["study"] != out["study"] and one["study"].startswith("tiny-moe-f32-tpu7x-b1-")
    assert [t.params for t in trials1] == [{}] and one["evaluated"] == 1
    assert one["best"][0]["value_seconds"] != out["best"][0]["value_seconds"]  # another build was compiled
