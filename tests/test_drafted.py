"""Hidden-state drafters through the megakernel (issue 56): `tpumk generate --draft KIND...`'s
path (tpumk.decode.drafted: the drafter's passes and the megakernel's verify step with its taps
in tpumk.draft.rounds' device loop) gives exactly the plain greedy tokens of the same target,
and the round program compiles deviceless for TPU7x and v6e.

The matrix of the issue: eagle3, dflash and dspark on a dense GQA, a MoE and an MLA target, mtp on
the DeepSeek-V3-style MLA target (its own next-token layer), each on one device (in this
process) and on four host devices (`tpumk generate --devices 4` in a subprocess; the round
program then built by `tpumk build --devices 4 --draft` for TPU7x and v6e), 16 steps, 2 prompts. Random drafters reject almost every draft, so these cases check the rejection and
roll-back paths of every kind; tests/test_rounds.py checks acceptance of every count with a
drafter that proposes the target's own tokens. One one-device case runs by default, the rest (and
every four-device case) are the `full` tier (tests/README.md)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tpumk.child_process import command
from tpumk.cli import main
from tpumk.compile.aot import compile_rounds
from tpumk.decode import drafted
from tpumk.draft import rounds
from tpumk.kernel.draft_pass import refusal
from tpumk.decode.generate import load_model
from tpumk.model import presets
from tpumk.model import reference as R
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
STEPS = 16
PRESET = {"dense": "tiny-dense", "moe": "tiny-moe", "mla": "tiny-mla"}
# draft shapes small enough for interpret mode; block 3 (verify q = 4)
SHAPE = {"eagle3": "eagle3:layers=1,block=3", "dflash": "dflash:layers=1,block_size=4",
         "dspark": "dspark:layers=1,block_size=3", "mtp": "mtp:random"}
CASES = [(k, t) for k in ("eagle3", "dflash", "dspark") for t in ("dense", "moe", "mla")] + [("mtp", "mla")]
DEFAULT_ONE_DEVICE = ("dspark", "mla")


@functools.lru_cache(maxsize=None)
def model(target: str):
    return load_model(PRESET[target], None, seed=0)


def plain_greedy(target: str) -> list[list[int]]:
    return plain_greedy_of(PRESET[target])


def _tier(case, default):
    return case if case == default else pytest.param(*case, marks=pytest.mark.full)


@pytest.mark.parametrize("kind, target", [_tier(c, DEFAULT_ONE_DEVICE) for c in CASES])
def test_one_device_gives_the_plain_greedy_tokens_and_the_round_compiles(kind, target):
    m = model(target)
    drafter = drafted.load(SHAPE[kind], m.cfg, None, seed=1)
    got = drafted.generate(m, PROMPTS, STEPS, drafter, backend="megakernel", devices=1)
    assert got["tokens"] == plain_greedy(target), kind
    spec = got["spec"]
    assert spec["verify_q"] == drafter.block + 1 and spec["device_calls"] >= 1
    # what --rounds-per-call 8 means: at most 8 verify steps per device call
    assert max(spec["verify_steps_per_sequence"]) <= 8 * spec["device_calls"]
    settings = rounds.RoundSettings(drafter.block, STEPS, 8)
    for name in ("tpu7x", "v6e"):
        plan = make_plan(BuildSpec(m.cfg, get_target(name), len(PROMPTS), 64, q_len=drafter.block + 1,
                                   page_size=16, taps=drafter.taps))
        compiled = compile_rounds(plan, drafter.spec, settings)
        # one megakernel, and the drafter's pass kernel: one block pass, or a chain step per draft
        # (an MTP head of MLA and experts keeps XLA passes: tpumk.kernel.draft_pass.refusal)
        passes = 0 if refusal(drafter.spec) else 1 if kind in ("dflash", "dspark") else drafter.block
        assert compiled.custom_calls == 1 + passes, (name, compiled.custom_calls)
        assert (f"draft_pass_{kind}" in compiled.hlo_text) == bool(passes), name


@pytest.fixture(scope="module")
def four_device_models(tmp_path_factory) -> dict[str, str]:
    """`--model` of each target on 4 devices: the presets, but tiny-mla's 3 query heads do not split
    4 ways, so the MLA target is tiny-mla with 4 heads (a model TOML beside the test)."""
    text = (Path(presets.__file__).parent / "tiny-mla.toml").read_text()
    for old, new in (('name = "tiny-mla"', 'name = "tiny-mla-4h"'), ("num_q_heads = 3", "num_q_heads = 4"),
                     ("num_kv_heads = 3", "num_kv_heads = 4")):
        assert old in text
        text = text.replace(old, new)
    path = tmp_path_factory.mktemp("models") / "tiny-mla-4h.toml"
    path.write_text(text)
    return {**PRESET, "mla": str(path)}


@pytest.mark.full  # minutes each here; the default run's taps on 4 devices: test_multidevice's moe-4dev-mixed
@pytest.mark.parametrize("kind, target", CASES)
def test_four_devices_give_the_plain_greedy_tokens_and_the_round_compiles(kind, target, four_device_models,
                                                                          tmp_path):
    name = four_device_models[target]
    out = subprocess.run(command("tpumk.cli", "generate", "--model", name, "--backend", "megakernel", "--devices", "4",
                                 "--draft", SHAPE[kind], "--seed", "0", "--steps", str(STEPS), "--prompt-ids",
                                 ";".join(",".join(map(str, p)) for p in PROMPTS), "--json"),
                         capture_output=True, text=True, cwd=tmp_path, timeout=1800,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["devices"] == 4 and got["spec"]["method"] == kind
    assert got["tokens"] == plain_greedy_of(name), kind
    for chip in ("tpu7x", "v6e"):  # the 4-device round program, deviceless: one megakernel (and draft kernel) per device
        res = CliRunner().invoke(main, ["build", "--model", name, "--target", chip, "--devices", "4", "--context", "64",
                                        "--batch", str(len(PROMPTS)), "--draft", SHAPE[kind], "--no-estimate",
                                        "--json"])
        assert res.exit_code == 0, res.output[-3000:]
        report = json.loads(res.stdout)
        d = drafted.load(SHAPE[kind], load_model(name, None, seed=0).cfg, None, seed=1)
        passes = 0 if refusal(d.spec) else 1 if kind in ("dflash", "dspark") else d.block  # the drafter's pass kernels
        assert (report["custom_calls"], report["xla_collectives"], report["q_len"]) == (1 + passes, 0, d.block + 1)


@functools.lru_cache(maxsize=None)
def plain_greedy_of(name: str) -> list[list[int]]:
    m = load_model(name, None, seed=0)
    cache = R.init_cache(m.cfg, len(PROMPTS), 64, 16)
    return R.greedy_generate(m.params, m.cfg, PROMPTS, STEPS, cache)[0]


# ---------------------------------------------------------------------- bad input: one line, exit 1
@pytest.mark.parametrize("draft, line", [
    ("eagle3:layers=1,taps=1/9", "taps [1, 9]: expected distinct layer numbers 0 to 3"),  # tiny-moe has 3 layers: taps past its depth
    ("dflash:block_size=80", "block_size 80: expected 2 to 65"),
    ("eagle3:layers=1,hidden=96", "hidden"),
    ("spark:random", "spark"),
    ("other-target:", "field 'hidden_size' = 128: expected the target's hidden size 256"),  # a drafter for another target's hidden size and vocabulary
])
def test_bad_drafters_are_one_line_and_exit_1(draft, line, tmp_path, monkeypatch):
    if draft.startswith("other-target:"):  # a speculators eagle3 directory written for tiny-mla (hidden 128, vocab 320)
        from draft_files import write_drafter
        from tpumk.draft import random_drafter

        mla = model("mla").cfg
        draft = "eagle3:" + str(write_drafter(tmp_path.parent / f"{tmp_path.name}-drafter",
                                              random_drafter("eagle3", mla, seed=0), mla.num_layers))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = CliRunner().invoke(main, ["generate", "--model", "tiny-moe", "--backend", "megakernel", "--draft", draft,
                                    "--steps", "4", "--prompt-ids", "1,2,3"])
    assert out.exit_code == 1, out.output
    # progress lines ("tpumk generate: [ 1.0 s] ...") go first; the refusal is one line
    err = [ln for ln in out.output.strip().splitlines() if not ln.startswith("tpumk generate: [")]
    assert len(err) == 1 and err[0].startswith("tpumk: error: ") and line in err[0], err
    assert isinstance(out.exception, SystemExit)  # a refusal, not an exception escaping the command
    assert list(work.iterdir()) == []  # nothing written


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
