"""The speculative round program as a build, an artifact and a tuning problem (issue 56):
`tpumk build / export / cache-key / tune --draft KIND[:SOURCE]`.

- the cache key covers the drafter (kind, shapes, block, its weights' content hash or random
  seed, rounds per call, temperature): a different drafter or block gives another key, the same
  one the same key, and a build without a drafter keeps the key it had;
- `export --draft` writes the round program (its kernels counted, both payloads), the [draft]
  table, drafter.safetensors for weights read from a directory (checked on verify against the
  key's content hash), and the loader exposes it (`tpumk.load_rounds`) or refuses in one line;
- bad inputs are one line, exit 1, nothing written;
- tune's trial evaluation compiles the round program and values it by tpumk's model of a
  round, per accepted token at a per-draft acceptance rate; a block the plan cannot hold is
  rejected by the plan.

Compiles here are for TPU7x (deviceless, a few seconds each, one export shared by the file's
tests). Running rounds from a cpu artifact (its compile alone takes ~15 s) and a whole
`tpumk tune --draft` study are the `full` tier (tests/README.md)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import tomli_w
from click.testing import CliRunner

from draft_files import write_drafter
from tpumk.cli import main
from tpumk.compile.keys import key_for, key_inputs
from tpumk.decode import drafted
from tpumk.draft import random_drafter
from tpumk.draft.rounds import RoundSpec
from tpumk.errors import ArtifactError, PlanError
from tpumk.export import artifacts
from tpumk.model.config import load_preset
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

TARGET = "tiny-dense"
SHAPE = ["--model", TARGET, "--target", "tpu7x", "--batch", "2", "--context", "64"]


def _spec(**kw) -> BuildSpec:
    return BuildSpec(load_preset(TARGET), get_target("tpu7x"), batch=2, context=64, **kw)


def _round(value: str, seed: int = 0, block=None, **kw) -> RoundSpec:
    return drafted.round_spec(value, load_preset(TARGET), seed=seed, block=block, **kw)[0]


@functools.lru_cache(maxsize=None)
def _drafter_dir(root: str) -> Path:
    """A speculators eagle3 directory for tiny-dense (2 layers: tap 1), random weights."""
    cfg = load_preset(TARGET)
    d = random_drafter("eagle3", cfg, seed=3, layers=1, block=2)
    return write_drafter(Path(root) / "eagle3-dir", d, cfg.num_layers)


def _one_line(res, words: str) -> None:
    lines = [ln for ln in res.output.strip().splitlines() if not ln.startswith("tpumk ") or ln.startswith("tpumk: ")]
    assert res.exit_code == 1, res.output
    assert len(lines) == 1 and lines[0].startswith("tpumk: error: ") and words in lines[0], res.output


# ---------------------------------------------------------------------- the key covers the drafter
def test_the_key_covers_the_drafter_and_plain_keys_are_unchanged(tmp_path):
    base = _round("eagle3:layers=1,block=3")
    keys = {"base": key_for(_spec(draft=base))}
    assert key_for(_spec(draft=_round("eagle3:layers=1,block=3"))) == keys["base"]  # same drafter, same key
    others = {"kind": _round("dflash:layers=1,block_size=4"), "block": _round("eagle3:layers=1,block=2"),
              "seed": _round("eagle3:layers=1,block=3", seed=1), "layers": _round("eagle3:layers=2,block=3"),
              "rounds_per_call": _round("eagle3:layers=1,block=3", rounds_per_call=4),
              "temperature": _round("eagle3:layers=1,block=3", temperature=0.5)}
    for name, r in others.items():
        keys[name] = key_for(_spec(draft=r))
    assert len(set(keys.values())) == len(keys), keys
    # the block from the tuning (tune's draft_block) is the same build as the block given directly
    assert key_for(_spec(draft=base, tuning=TuningConfig(draft_block=2))) == keys["block"]
    # no drafter: no "draft" input and no draft_block knob, so plain keys are the ones they were
    plain = key_inputs(_spec())
    assert "draft" not in plain and "draft_block" not in plain["tuning"]
    assert key_inputs(_spec(draft=base))["draft"]["weights"] == {"random_seed": 0}
    # weights read from files: their content hash, so other weights of the same shape miss
    d = _drafter_dir(str(tmp_path))
    hashed, params = drafted.round_spec(f"eagle3:{d}", load_preset(TARGET))
    assert hashed.weights[0] == "sha256" and params is not None
    cfg = load_preset(TARGET)
    other_dir = write_drafter(tmp_path / "other", random_drafter("eagle3", cfg, seed=4, layers=1, block=2),
                              cfg.num_layers)
    other = drafted.round_spec(f"eagle3:{other_dir}", cfg)[0]
    assert other.drafter == hashed.drafter and key_for(_spec(draft=other)) != key_for(_spec(draft=hashed))
    assert key_for(_spec(draft=drafted.round_spec(f"eagle3:{d}", cfg)[0])) == key_for(_spec(draft=hashed))


def test_cache_key_command_takes_the_draft_options():
    def key(*args):
        res = CliRunner().invoke(main, ["cache-key", *SHAPE, *args])
        assert res.exit_code == 0, res.output
        return res.output.strip()

    plain = key()
    one = key("--draft", "eagle3:layers=1", "--draft-tokens", "3")
    assert one == key("--draft", "eagle3:layers=1,block=3")  # --draft-tokens is the shape's block
    assert len({plain, one, key("--draft", "eagle3:layers=1", "--draft-tokens", "2")}) == 3


# ---------------------------------------------------------------------- export, verify, load
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One round artifact for the file: tiny-dense on TPU7x with a speculators eagle3 directory."""
    root = tmp_path_factory.mktemp("round-artifacts")
    d = _drafter_dir(str(root))
    res = CliRunner().invoke(main, ["export", *SHAPE, "--draft", f"eagle3:{d}", "--out", str(root / "out"), "--json"])
    assert res.exit_code == 0, res.output
    return Path(json.loads(res.stdout)["path"]), d, root


def test_export_ships_the_round_program_and_the_drafter(exported):
    path, d, root = exported
    m = artifacts.verify(path)
    assert m["draft"]["drafter"]["kind"] == "eagle3" and m["draft"]["drafter"]["block"] == 2
    assert m["shapes"]["q_len"] == 3 and m["shapes"]["taps"] == [1]
    assert set(m["files"]) == {"executable.bin", "exported.bin", "drafter.safetensors"}
    rep = json.loads(m["report_json"])
    # one megakernel and the drafter's pass kernel, a chain step per draft (tpumk.kernel.draft_pass)
    assert rep["custom_calls"] == 1 + 2 and rep["draft"]["verify_q"] == 3
    assert rep["draft"]["model"]["round_seconds"] > rep["draft"]["model"]["verify_step_seconds"] > 0
    # the shipped weights are the directory's, as the key's content hash says
    from tpumk.draft import load_drafter

    want = load_drafter(d, load_preset(TARGET)).params
    got = artifacts.drafter_weights(path, m)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    # the same export again: a cache hit, nothing compiled
    res = CliRunner().invoke(main, ["export", *SHAPE, "--draft", f"eagle3:{d}", "--out", str(path.parents[2])])
    assert res.exit_code == 0 and "cache hit" in res.output, res.output
    info = artifacts.inspect(path)
    assert info["valid"] and info["draft"]["weights"] == json.loads(m["cache_key"]["inputs_json"])["draft"]["weights"]


def test_the_loaders_expose_the_round_program_or_refuse(exported):
    path, _, _ = exported
    with pytest.raises(ArtifactError, match=r"holds a speculative round program \(eagle3 drafter\), not a decode "
                                            r"step: load it with tpumk.load_rounds\(path\)"):
        artifacts.load(path)
    # no TPU here: refused before anything is deserialized, in one line
    with pytest.raises(ArtifactError, match="built for tpu7x .* but this host has"):
        artifacts.load_rounds(path)


def test_a_plain_artifact_has_no_round_program(tmp_path):
    res = CliRunner().invoke(main, ["export", "--model", TARGET, "--target", "tpu7x", "--context", "32", "--out",
                                    str(tmp_path)])
    assert res.exit_code == 0, res.output
    path = artifacts.find_artifacts(tmp_path)[0]
    with pytest.raises(ArtifactError, match="holds the plain decode step, no speculative round program"):
        artifacts.load_rounds(path)


def _copy(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy" / path.name
    shutil.copytree(path, dst)
    return dst


def test_altered_round_artifacts_are_refused(exported, tmp_path):
    path, _, _ = exported
    # other weights in drafter.safetensors, the manifest's file hash updated to match: the
    # content hash the key names still refuses them
    bad = _copy(path, tmp_path)
    from tpumk.draft.weights import params_bytes

    m = artifacts.read_manifest(bad)
    spec = artifacts.spec_of(m).draft.drafter
    weights = jax.tree.map(lambda a: a + 1 if a.dtype != np.int32 else a, artifacts.drafter_weights(path, m))
    (bad / "drafter.safetensors").write_bytes(params_bytes(spec, weights))
    m["files"]["drafter.safetensors"] = {"sha256": artifacts.sha256_file(bad / "drafter.safetensors"),
                                         "bytes": (bad / "drafter.safetensors").stat().st_size}
    (bad / "manifest.toml").write_text(tomli_w.dumps(m))
    with pytest.raises(ArtifactError, match=r"drafter.safetensors: weights with content hash .* the key names"):
        artifacts.verify(bad)
    # an edited [draft] field
    bad = _copy(path, tmp_path / "2")
    m = artifacts.read_manifest(bad)
    m["draft"]["rounds_per_call"] = 2
    (bad / "manifest.toml").write_text(tomli_w.dumps(m))
    with pytest.raises(ArtifactError, match="field 'draft.rounds_per_call' = 2 does not match"):
        artifacts.verify(bad)
    # the drafter file removed from the manifest: the key says the weights were shipped
    bad = _copy(path, tmp_path / "3")
    m = artifacts.read_manifest(bad)
    del m["files"]["drafter.safetensors"]
    (bad / "manifest.toml").write_text(tomli_w.dumps(m))
    with pytest.raises(ArtifactError, match="no sha256 listed for drafter.safetensors"):
        artifacts.verify(bad)


# ---------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("args, words", [
    # a drafter made for another target's hidden size (a speculators directory written for tiny-mla)
    (["--draft", "OTHER"], "field 'hidden_size' = 128: expected the target's hidden size 256"),
    (["--draft", "eagle3:layers=1,hidden=96"], "hidden = 96: expected the target's hidden size 256"),
    # a block larger than the plan can hold: the verify step's 64 rows x 64 sequences over VMEM
    (["--batch", "64", "--context", "256", "--draft", "dflash:layers=1,block_size=64,taps=1"],
     "--draft: the round's verify step (q = 64: 63 drafts + 1, 1 taps) does not plan: plan does not fit tpu7x VMEM"),
    (["--context", "16", "--page-size", "4", "--draft", "dflash:block_size=16"],
     "context 16: expected at least block + 2 = 17"),
    (["--draft", "dflash:layers=1,block_size=4", "--draft-tokens", "4"], "block 4 of a block_size 4: expected 1 to 3"),
    (["--draft", "ngram"], "a round program takes a hidden-state drafter"),
    (["--draft-tokens", "3"], "--draft-tokens: only with --draft"),
    (["--rounds-per-call", "2"], "--rounds-per-call: only with --draft"),
    (["--draft", "eagle3:random", "--q-len", "3"], "--q-len: not with --draft"),
    (["--draft", "eagle3:random", "--rounds-per-call", "0"], "rounds_per_call = 0: expected a positive integer"),
    (["--draft", "eagle3:random", "--temperature", "-1"], "temperature = -1.0: expected a finite number >= 0"),
])
def test_bad_round_inputs_are_one_line_and_write_nothing(args, words, tmp_path):
    if "OTHER" in args:
        mla = load_preset("tiny-mla")
        other = write_drafter(tmp_path / "mla-drafter", random_drafter("eagle3", mla, seed=0), mla.num_layers)
        args = [f"eagle3:{other}" if a == "OTHER" else a for a in args]
    out = tmp_path / "out"
    for command in ("export", "build"):
        extra = ["--out", str(out)] if command == "export" else ["--no-estimate"]
        res = CliRunner().invoke(main, [command, *SHAPE, *args, *extra])  # a later --batch / --context wins
        _one_line(res, words)
    assert not out.exists()  # nothing written


def test_a_round_program_that_cannot_compile_is_refused_and_nothing_written(tmp_path, monkeypatch):
    """The compiler's refusal of the round program (here: XLA's error raised in its place, as
    libtpu raises one for a program it rejects) is one line naming the round program, before any
    file is written."""
    import jax

    def rejected(self, *a, **k):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem")

    monkeypatch.setattr(jax.stages.Lowered, "compile", rejected)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["export", "--model", "tiny-mla", "--target", "tpu7x", "--context", "32",
                                    "--draft", "mtp:random", "--out", str(out)])
    _one_line(res, "the round program (mtp drafter, verify q = 2): tpu7x: the compiler rejected this build: "
                   "RESOURCE_EXHAUSTED")
    assert not out.exists() or not any(out.rglob("*"))


# ---------------------------------------------------------------------- tune
def test_the_tuner_compiles_the_round_and_ranks_blocks_per_accepted_token():
    """The trial worker (in this process) compiles the round program and values it by tpumk's
    round model; the trial turns it into seconds per accepted token at the acceptance rate; a
    block the plan cannot hold is rejected by the plan, as any infeasible knob."""
    from tpumk.estimate.speculative import expected_acceptance_length, round_model
    from tpumk.tune import worker
    from tpumk.tune.objectives import choose_objective
    from tpumk.tune.space import DEFAULT_SPACE_PATH, load_space
    from tpumk.tune.trial import trial_plan

    problem = _spec(draft=_round("dflash:layers=1,block_size=6", block=2))
    space = load_space(DEFAULT_SPACE_PATH).for_build(problem)
    knob = space.knobs["draft_block"]
    assert knob.values() == [1, 2, 3, 4, 5] and knob.default == 2  # the drafter's own block is the default
    assert trial_plan(problem, space.tuning_for(space.default_values())).q_len == 3
    reply = worker.serve({"spec": problem.replace(tuning=TuningConfig(draft_block=4)).to_dict(),
                          "objective": "model", "deadline_seconds": 300})
    assert reply["ok"] and reply["stage"] == "done" and reply["custom_calls"] == 1 + 1, reply  # + dflash's block pass
    four = problem.replace(tuning=TuningConfig(draft_block=4))
    assert four.q_len == 5 and four.draft.block == 4
    assert reply["value"] == pytest.approx(round_model(four, four.draft.drafter, [1.0])["round_seconds"])
    # seconds per accepted token: at rate 0 every extra draft is wasted, at rate 1 every one counts
    rounds = {k: round_model(problem.replace(tuning=TuningConfig(draft_block=k)), problem.draft.drafter.with_block(k),
                             [1.0])["round_seconds"] for k in (1, 5)}
    per_token = {(k, a): rounds[k] / expected_acceptance_length(k, a) for k in rounds for a in (0.0, 1.0)}
    assert per_token[(1, 0.0)] < per_token[(5, 0.0)] and per_token[(5, 1.0)] < per_token[(1, 1.0)]
    assert expected_acceptance_length(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    # infeasible: 64 sequences of a 64-row verify step over VMEM, pruned at the plan
    big = BuildSpec(load_preset(TARGET), get_target("tpu7x"), batch=64, context=256,
                    draft=drafted.round_spec("dflash:layers=1,block_size=64,taps=1", load_preset(TARGET), block=3)[0])
    with pytest.raises(PlanError, match="VMEM"):
        trial_plan(big, TuningConfig(draft_block=63))
    choice = choose_objective("auto", problem.model, problem.target, None, acceptance_rate=0.7)
    assert choice.name == "model" and choice.key == "model-a0.7"


@pytest.mark.parametrize("args, words", [
    (["--draft", "eagle3:random"], "--draft: give --acceptance-rate"),
    (["--acceptance-rate", "0.5"], "--acceptance-rate: only with --draft"),
    (["--draft", "eagle3:random", "--acceptance-rate", "1.5"], "expected a per-draft acceptance rate from 0 to 1"),
    (["--draft", "eagle3:random", "--acceptance-rate", "0.5", "--objective", "compiler"],
     "--objective compiler: not with --draft"),
])
def test_tune_draft_refusals(args, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["tune", *SHAPE, "--trials", "1", *args])
    _one_line(res, words)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- full tier: rounds from disk, a study
@pytest.fixture(scope="module")
def cpu_artifact(tmp_path_factory):
    """A cpu round artifact of tiny-dense with the speculators eagle3 directory (2 drafts a round,
    4 rounds a call): its round program runs on this host (the discharge interpreter)."""
    root = tmp_path_factory.mktemp("cpu-round-artifact")
    d = _drafter_dir(str(root))
    res = CliRunner().invoke(main, ["export", "--model", TARGET, "--target", "cpu", "--batch", "2", "--context", "64",
                                    "--draft", f"eagle3:{d}", "--rounds-per-call", "4", "--out", str(root / "out"),
                                    "--json"])
    assert res.exit_code == 0, res.output
    return Path(json.loads(res.stdout)["path"]), d


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def _plain_greedy(cfg, params, steps: int):
    from tpumk.model import reference as R

    return R.greedy_generate(params, cfg, PROMPTS, steps, R.init_cache(cfg, len(PROMPTS), 64, 16))[0]


@pytest.mark.full  # ~20 s to export (its compile), then 15-40 s per load and run; default: the tests above
@pytest.mark.parametrize("use", ["executable", "exported"])
def test_rounds_run_from_a_cpu_artifact_give_the_plain_greedy_tokens(use, cpu_artifact):
    import tpumk
    from tpumk.draft import load_drafter
    from tpumk.errors import ConfigError
    from tpumk.model.weights import random_params

    path, d = cpu_artifact
    rp = tpumk.load_rounds(path, use=use)
    assert rp.settings.block == 2 and rp.settings.rounds_per_call == 4 and rp.settings.steps == 64 - 3
    want = load_drafter(d, rp.config).params
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(rp.drafter_params), jax.tree.leaves(want)))
    params = random_params(rp.config, seed=0)
    tokens, stats = rp.generate(params, PROMPTS, 16)
    assert tokens == _plain_greedy(rp.config, params, 16)
    assert stats.calls >= 1 and max(stats.rounds) <= 4 * stats.calls
    with pytest.raises(ConfigError, match="plus 60 steps plus a verify step of 3 need 67 positions; its context holds 64"):
        rp.generate(params, PROMPTS, 60)
    with pytest.raises(ConfigError, match="expected 2 non-empty prompts"):
        rp.generate(params, PROMPTS[:1], 4)


@pytest.mark.full  # a study of 2 trials, each a compile in its own worker process (~30 s)
def test_tune_draft_searches_the_block_and_writes_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "space.toml"
    space.write_text('[space]\nname = "blocks"\n[knobs.ring_depth]\ntype = "categorical"\nchoices = [12]\n'
                     '[knobs.draft_block]\ntype = "computed"\nfunction = "draft_block_choices"\n')
    args = [*SHAPE, "--draft", "dflash:layers=1,block_size=6", "--draft-tokens", "2", "--acceptance-rate", "0.8",
            "--space", str(space), "--trials", "2", "--seed", "0"]
    res = CliRunner().invoke(main, ["tune", *args])
    assert res.exit_code == 0, res.output
    assert "seconds per accepted token at a per-draft acceptance rate of 0.8" in res.output
    assert "accepted tokens/s per sequence (tpumk's model, not measured)" in res.output
    last = res.output.strip().splitlines()[-1]
    tuned = Path(last.split("wrote ")[1].split(";")[0])
    from tpumk.plan.knobs import load_tuning

    block = load_tuning(tuned).draft_block
    assert 1 <= block <= 5
    command = last.split("build with it: ")[1].split()
    assert command[:2] == ["tpumk", "build"] and "--draft-tokens" not in command  # the file carries the block
    res = CliRunner().invoke(main, [*command[1:], "--no-estimate", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["draft"]["block"] == block


@pytest.mark.full  # a 4-device deviceless compile and export, ~15 s
def test_a_four_device_round_artifact_exports_and_verifies(tmp_path):
    res = CliRunner().invoke(main, ["export", "--model", "tiny-moe", "--target", "tpu7x", "--devices", "4",
                                    "--context", "64", "--batch", "2", "--draft", "dspark:layers=1,block_size=3",
                                    "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    path = Path(json.loads(res.stdout)["path"])
    m = artifacts.verify(path)
    assert m["mesh"]["devices"] == 4 and m["draft"]["drafter"]["kind"] == "dspark" and m["shapes"]["q_len"] == 4
    # one megakernel and dspark's block-pass kernel (replicated), every device's
    assert json.loads(m["report_json"])["custom_calls"] == 1 + 1
    with pytest.raises(ArtifactError, match="built for 4 TPU7x devices"):
        artifacts.load_rounds(path)


@pytest.mark.full  # an interpreted 2-device round program, ~40 s
def test_a_two_device_round_program_runs_through_its_loader():
    """RoundProgram's many-device half (pack, the sharded cache, the replicated drafter and carry
    placed on the mesh) around the interpreted 2-device round program, against plain greedy."""
    import os
    import subprocess
    import sys

    from host_flags import xla_flags

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", NPROC="8", XLA_FLAGS=xla_flags(2))
    proc = subprocess.run([sys.executable, __file__, "two-devices"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["tokens"] == r["plain"], r


def _two_device_worker() -> dict:
    from tpumk.compile.aot import round_program
    from tpumk.model.weights import random_params
    from tpumk.plan.plan import make_plan

    cfg = load_preset(TARGET)
    rounds, _ = drafted.round_spec("eagle3:layers=1", cfg, block=2, rounds_per_call=4)
    spec = BuildSpec(cfg, get_target("cpu"), batch=2, context=64, devices=2, draft=rounds)
    plan = make_plan(spec)
    program = jax.jit(round_program(plan, rounds.drafter, rounds.settings(plan.context)))
    manifest = {"key": "0" * 64, "shapes": spec.shapes(), "model": cfg.to_dict(),
                "cache_key": {"inputs_json": json.dumps(key_inputs(spec))}}
    rp = artifacts.RoundProgram(Path("."), manifest, program, "interpreted (cpu x 2)", plan, jax.devices("cpu")[:2])
    from tpumk.draft.weights import random_params as drafter_params

    rp.drafter_params = drafter_params(rounds.drafter, 0)
    params = random_params(cfg, seed=0)
    tokens, _ = rp.generate(params, PROMPTS, 12)
    return {"tokens": tokens, "plain": _plain_greedy(cfg, params, 12)}


if __name__ == "__main__":
    import sys

    print(json.dumps({"two-devices": _two_device_worker}[sys.argv[1]]()))
