"""`tpumk bench --draft`: the speculative round by tpumk's timeline model (tpumk.estimate.speculative):
its figures consistent with one another, the drafter's device fall-back, the CLI's table and JSON,
and one-line refusals. Plans only (nothing compiled): the whole file runs in a few seconds."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.decode import drafted
from tpumk.errors import CheckpointError, PlanError
from tpumk.estimate.speculative import plan_drafter, round_model
from tpumk.model.config import load_preset
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target


def _spec(model: str, batch: int = 1, devices: int = 1) -> BuildSpec:
    return BuildSpec(load_preset(model), get_target("tpu7x"), batch=batch, context=256, devices=devices)


def _bench(*args: str):
    return CliRunner().invoke(main, ["bench", "--target", "tpu7x", "--context", "256", *args])


@pytest.mark.parametrize("model, draft", [("tiny-dense", "dflash:layers=2,block_size=8,taps=1/2"),
                                          ("tiny-moe", "eagle3:layers=1,block=3"),
                                          ("tiny-mla", "dspark:layers=1,heads=3,kv_heads=3,head_dim=32,block_size=4"),
                                          ("tiny-moe", "mtp:block=2")])
def test_round_figures_are_consistent(model, draft):
    spec = _spec(model, batch=2)
    d = drafted.describe(draft, spec.model)
    acc = [1.0, 2.0, float(d.block + 1)]
    r = round_model(spec, d, acc)
    dr = r["drafter"]
    assert dr["passes_per_round"] == (d.block if d.kind in ("eagle3", "mtp") else 1)
    assert r["draft_seconds"] == pytest.approx(dr["passes_per_round"] * dr["pass_seconds"] + dr["projection_seconds"]
                                               + dr["pack_seconds"])
    assert r["round_seconds"] == pytest.approx(r["verify_step_seconds"] + r["draft_seconds"])
    assert r["verify_step_seconds"] > r["plain_step_seconds"] > 0  # k + 1 rows and the taps cost more than 1
    assert r["verify_taps_bytes"] > 0
    for row in r["rows"]:
        assert row["per_sequence"] == pytest.approx(row["acceptance"] / r["round_seconds"])
        assert row["aggregate"] == pytest.approx(spec.batch * row["per_sequence"])
        assert row["speedup"] == pytest.approx(row["per_sequence"] / r["plain"]["per_sequence"])
    speedups = [row["speedup"] for row in r["rows"]]
    assert speedups == sorted(speedups) and speedups[0] < 1  # acceptance 1: a round is dearer than a plain step
    be = r["break_even_acceptance"]
    assert be == pytest.approx(r["round_seconds"] / r["plain_step_seconds"])
    assert round_model(spec, d, [min(be, d.block + 1)])["rows"][0]["speedup"] == pytest.approx(min(1.0, speedups[-1]))


def test_the_drafter_is_modelled_replicated_as_it_is_built():
    """The round program replicates the drafter (tpumk.kernel.draft_pass: every device reads all
    its weights and runs its passes over the whole batch), so the model's pass is one device's
    whole pass on 1 and on 4 devices, through the pass kernel or, for a drafter the kernel does
    not model (an MTP head with experts), XLA passes; the notes say so."""
    for model, draft, runs in [("tiny-dense", "dspark:layers=1,heads=4,kv_heads=2,head_dim=64,block_size=4,taps=1",
                                "kernel"), ("tiny-moe", "mtp:block=2", "xla")]:
        one, four = _spec(model, batch=2), _spec(model, batch=2, devices=4)
        d = drafted.describe(draft, one.model)
        p1, p4 = plan_drafter(one, d), plan_drafter(four, d)
        assert p1.runs == p4.runs == runs, model
        assert (p4.pass_seconds, p4.pass_hbm_bytes, p4.projection_bytes) == \
            pytest.approx((p1.pass_seconds, p1.pass_hbm_bytes, p1.projection_bytes))
    r = round_model(four, d, [2])  # the notes say so
    assert r["drafter"]["runs"] == "xla" and r["drafter"]["pass_seconds"] == pytest.approx(p1.pass_seconds)
    assert any("replicated: each of the 4 devices" in n for n in r["notes"])
    assert any("XLA operations" in n for n in r["notes"])


@pytest.mark.parametrize("draft", ["dspark:layers=2,heads=4,kv_heads=2,head_dim=64,block_size=4,taps=1",
                                   "eagle3:layers=2,heads=4,kv_heads=2,head_dim=64,block=2,draft_vocab=256,taps=1",
                                   "mtp:block=2"])
def test_the_kernel_model_streams_the_bytes_the_kernel_streams(draft):
    """The pass kernel's model reads what the kernel's streams read: every packed matrix once
    (tpumk.kernel.draft_pass.pack's arrays, shapes only) and the drafter's KV cache once per KV
    head (every sequence's chunks); its weight packing reads and writes once a call the matrices
    pack transposes."""
    import jax

    from tpumk.draft.weights import abstract_params
    from tpumk.kernel import draft_pass

    spec = _spec("tiny-dense", batch=2)
    m, d = spec.model, drafted.describe(draft, spec.model)
    tparams = {"embed": jax.ShapeDtypeStruct((m.vocab_size, m.hidden_size), m.dtype)}
    if not m.tie_embeddings:
        tparams["lm_head"] = jax.ShapeDtypeStruct((m.hidden_size, m.vocab_size), m.dtype)
    packed = jax.eval_shape(lambda p, t: draft_pass.pack(d, p, t), abstract_params(d), tparams)
    streamed = [packed["head"]] + ([packed["eh_proj"]] if "eh_proj" in packed else []) + \
        [lay[w] for lay in packed["layers"] for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    weights = sum(a.size * a.dtype.itemsize for a in streamed)
    dp = plan_drafter(spec, d)
    assert dp.runs == "kernel"
    hbm = dp.stages["hbm_bytes"]
    assert sum(v for k, v in hbm.items() if k != "kv_cache") == weights
    lay = d.layer
    assert hbm["kv_cache"] == (lay.num_layers * lay.num_kv_heads * spec.batch * spec.context * lay.head_dim * 2
                               * lay.dtype_bytes)
    moved = weights - sum(a.size * a.dtype.itemsize for lay in packed["layers"] for a in (lay["wo"], lay["w_down"]))
    assert dp.pack_bytes_per_call == 2 * moved  # o and down are reshapes, the rest transposes
    assert dp.pass_seconds == pytest.approx(sum(dp.stages["seconds"].values()))
    # each weight stage is counted with the ring its stream gets in the kernel: ring_depth slots
    # of the stream's step (every family's tile), as many as the megakernel's defaults allow
    lay0 = packed["layers"][0]
    streams = {"q": [lay0["wq"]], "k_v": [lay0["wk"], lay0["wv"]], "o": [lay0["wo"]],
               "mlp": [lay0["w_gate"], lay0["w_up"], lay0["w_down"]], "head": [packed["head"]]}
    for stage, arrays in streams.items():
        step = sum(a.size // a.shape[0] * a.dtype.itemsize for a in arrays)
        depth = draft_pass.ring_depth(step, arrays[0].shape[0])
        assert dp.stages["ring_bytes"][stage] == depth * step, stage
    chunk, chunks = draft_pass._kv_chunk(spec.context), spec.batch * spec.context // draft_pass._kv_chunk(spec.context)
    step = 2 * chunk * lay.head_dim * lay.dtype_bytes  # a key and a value chunk
    assert dp.stages["ring_bytes"]["kv_cache"] == draft_pass.ring_depth(step, chunks) * step
    assert draft_pass.ring_depth(2 << 20, 1000) == 12 and draft_pass.ring_depth(6 << 20, 1000) == 4


def test_cli_table_and_json():
    args = ["--model", "tiny-dense", "--batch", "2", "--draft", "dflash:layers=1,block_size=4,taps=1/2",
            "--acceptance", "2,3.5"]
    res = _bench(*args)
    assert res.exit_code == 0, res.output
    out = res.output
    for text in ("plain step (q = 1)", "verify step (q = 4, 2 taps)", "drafter passes (1 x 4 rows)",
                 "round (verify + draft)", "accepted tok/s per sequence", "break-even", "not measurements",
                 "nothing was compiled", "3.5"):
        assert text in out, text
    res = _bench(*args, "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["model"] == "tiny-dense" and r["batch"] == 2 and [row["acceptance"] for row in r["rows"]] == [2, 3.5]
    assert r["drafter"]["kind"] == "dflash" and r["drafter"]["taps"] == [1, 2] and r["drafter"]["block"] == 3
    assert "not measurements" in r["source"]
    default = json.loads(_bench("--model", "tiny-dense", "--draft", "eagle3:block=4,taps=1", "--json").output)
    assert [row["acceptance"] for row in default["rows"]] == [2, 3, 5]  # 2, 3 and k + 1


@pytest.mark.parametrize("args, words", [
    (["--draft", "medusa:random"], "--draft 'medusa:random': expected KIND[:SHAPE]"),
    (["--draft", "dflash"], "expected dflash:DIR"),
    (["--draft", "dflash:layers=two"], "layers = 'two': expected an integer"),
    (["--draft", "dflash:layers=0"], "layers = '0': expected an integer of at least 1"),
    (["--draft", "dflash:wings=3"], "(got 'wings=3')"),
    (["--draft", "mtp:layers=2"], "(got 'layers=2')"),  # an mtp layer is the target's own: no shape keys
    (["--draft", "eagle3:markov_rank=8"], "(got 'markov_rank=8')"),
    (["--draft", "dflash:hidden=512"], "hidden = 512: expected the target's hidden size 256"),
    (["--draft", "dflash:taps=1/7"], "taps [1, 7]: expected distinct layer numbers 0 to 2"),
    (["--draft", "dflash:block_size=80"], "block_size 80: expected 2 to 65"),
    (["--draft", "dflash:block_size=4,block=4"], "block 4 of a block_size 4: expected 1 to 3"),
    (["--draft", "dflash:block_size=4", "--acceptance", "5"], "--acceptance 5: expected a mean acceptance length "
                                                                "from 1 to 4"),
    (["--draft", "dflash:block_size=4", "--acceptance", "0.5"], "from 1 to 4"),
    (["--draft", "dflash:block_size=4", "--acceptance", "3,x"], "--acceptance '3,x': expected mean acceptance"),
    (["--acceptance", "3"], "--acceptance: only with --draft"),
    (["--draft", "dflash:block_size=4", "--verify-q", "4"], "--verify-q: not with --draft"),
    (["--draft", "dflash:block_size=4", "--batch-curve", "1,2"], "--batch-curve: not with --draft"),
])
def test_refusals_are_one_line(args, words):
    res = _bench("--model", "tiny-dense", *args)
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpumk: error: ") and words in lines[0], res.output


def test_a_drafter_the_plan_cannot_hold_is_refused():
    """A verify step whose rows do not fit VMEM is refused naming the verify step."""
    spec = _spec("tiny-dense", batch=64)
    d = drafted.describe("dflash:layers=1,block_size=64,taps=1", spec.model)
    with pytest.raises(PlanError, match=r"^the verify step \(q = 64 with 1 taps\): "):
        round_model(spec, d, [2])
    with pytest.raises(CheckpointError, match="expected a drafter directory"):
        drafted.describe("eagle3:/nonexistent-dir", spec.model)


def test_a_speculators_directory_is_read_for_its_shape_only(tmp_path):
    """KIND:DIR reads config.json alone (no weights file here): the same shape as the drafter written."""
    from draft_files import config_json

    from tpumk.draft import random_drafter

    target = load_preset("tiny-moe")
    d = random_drafter("dflash", target, abstract=True, layers=2, taps=(1, 2), block_size=4)
    (tmp_path / "config.json").write_text(json.dumps(config_json(d, target.num_layers)))
    spec = drafted.describe(f"dflash:{tmp_path}", target)
    assert (spec.kind, spec.taps, spec.block, spec.layer.num_layers) == ("dflash", (1, 2), 3, 2)
    res = _bench("--model", "tiny-moe", "--draft", f"dflash:{tmp_path}", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["drafter"]["layers"] == 2, res.output
    res = _bench("--model", "tiny-moe", "--draft", f"eagle3:{tmp_path}")
    assert res.exit_code == 1 and "holds a dflash drafter, not eagle3" in res.output, res.output
