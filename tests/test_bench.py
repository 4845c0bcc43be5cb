"""`tpumk bench`: figures internally consistent, the XLA step equal to the reference, the
timing helper, and clean errors. Two deviceless benches of tiny models (~10-20 s each)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from tpumk.model import reference as ref
from tpumk.decode.bench import measure_seconds
from tpumk.decode.xla_compile import compile_program
from tpumk.model.xla_step import make_xla_step, paged_to_head_major, xla_decode_step, xla_step_specs
from tpumk.cli import main
from tpumk.model.config import load_preset
from tpumk.plan.plan import make_plan
from tpumk.targets import get_target
from tpumk.model.weights import random_params
from tpumk.plan.spec import BuildSpec


def _bench(*args) -> dict:
    res = CliRunner().invoke(main, ["bench", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.fixture(scope="module")
def tiny_moe() -> dict:
    """The CI line of the issue: tpumk bench --model tiny-moe --target tpu7x --json."""
    return _bench("--model", "tiny-moe", "--target", "tpu7x")


@pytest.fixture(scope="module")
def tiny_dense_b2() -> dict:
    return _bench("--model", "tiny-dense", "--target", "v6e", "--batch", "2", "--dtype", "bfloat16")


def _consistent(r: dict, preset: str, target: str, batch: int, dtype: str | None = None) -> None:
    cfg = load_preset(preset)
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    plan = make_plan(BuildSpec(cfg, get_target(target), batch, 4096))
    assert (r["model"], r["target"], r["batch"]) == (preset, target, batch)
    mk, x = r["megakernel"], r["xla"]
    for side in (mk, x):
        for key in ("compile_seconds", "hbm_bytes", "kernels", "step_seconds", "step_source", "floor_fraction"):
            assert key in side
        assert side["compile_seconds"] > 0 and side["step_seconds"] > 0
    # bytes: the megakernel's are the plan's; XLA's are its own cost_analysis
    assert mk["hbm_bytes"] == pytest.approx(plan.hbm_bytes)
    prog = compile_program(lambda p, t, pos, k, v, n: xla_decode_step(p, cfg, t, pos, k, v, n),
                           xla_step_specs(cfg, batch, 4096), get_target(target), donate_argnums=(3, 4))
    assert x["hbm_bytes"] == pytest.approx(prog.compiled.cost_analysis()["bytes accessed"])
    assert r["floor_seconds"] == pytest.approx(plan.floor_seconds)
    # ratios follow from the times
    assert r["speedup"] == pytest.approx(x["step_seconds"] / mk["step_seconds"])
    for name, side in (("megakernel", mk), ("xla", x)):
        assert side["floor_fraction"] == pytest.approx(r["floor_seconds"] / side["step_seconds"])
        tps = r["tokens_per_second"][name]
        assert tps["aggregate"] == pytest.approx(batch / side["step_seconds"])
        assert tps["per_sequence"] == pytest.approx(1 / side["step_seconds"])
        # no TPU here: both times are the model, labelled so, never the compiler's static profile
        assert side["measured"] is None and side["step_source"].startswith("MODEL, not measured")
        assert side["step_seconds"] == pytest.approx(side["model"]["seconds"])
        assert side["step_seconds"] >= r["floor_seconds"] * 0.999 or name == "xla"
    # the serving-stack column: XLA + jax's ragged paged attention, one kernel call per layer, by the model
    sv = r["serving"]
    assert sv["step_source"].startswith("MODEL, not measured") and sv["compile_seconds"] > 0
    assert r["speedup_vs_serving"] == pytest.approx(sv["step_seconds"] / mk["step_seconds"])
    assert sv["model"]["stages"]["pallas: attention (ragged paged attention kernel)"]["seconds"] > 0
    assert r["tokens_per_second"]["serving"]["aggregate"] == pytest.approx(batch / sv["step_seconds"])
    # one fused program against an op-by-op one
    assert mk["kernels"] < x["kernels"] and x["kernels"] > 5 * cfg.num_layers
    # the megakernel program's model contains its Pallas kernel walked by the plan
    assert any(k.startswith("pallas: ") for k in mk["model"]["stages"])
    assert r["tpu_attached"] is False


def test_tiny_moe_bench_is_consistent(tiny_moe):
    _consistent(tiny_moe, "tiny-moe", "tpu7x", 1)
    assert tiny_moe["model_check"]["ratio"] == pytest.approx(tiny_moe["model_check"]["predicted_seconds"] / 26.4e-6)


def test_bench_reports_the_verify_step_beside_the_plain_one(tiny_moe):
    from tpumk.estimate.timeline import megakernel_step

    v = tiny_moe["verify"]
    cfg = load_preset("tiny-moe")
    plain, vp = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 4096)), make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 4096, q_len=8))
    assert v["feasible"] and v["q_len"] == 8 and v["draft_tokens"] == 7
    assert v["hbm_bytes"] == pytest.approx(vp.hbm_bytes) and v["floor_seconds"] == pytest.approx(vp.floor_seconds)
    assert v["kernel_seconds"] == pytest.approx(megakernel_step(vp).seconds)
    assert v["cost_vs_plain"] == pytest.approx(v["kernel_seconds"] / megakernel_step(plain).seconds)
    assert v["cost_vs_plain"] >= 1.0 and v["source"].startswith("MODEL")


def test_batch2_bench_is_consistent(tiny_dense_b2):
    _consistent(tiny_dense_b2, "tiny-dense", "v6e", 2, dtype="bfloat16")
    assert tiny_dense_b2["model_check"] is None  # the published anchor is a TPU7x figure


def test_bench_table_prints_provenance():
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-dense", "--target", "tpu7x"])
    assert res.exit_code == 0, res.output
    assert "MODEL (no TPU attached)" in res.output and "NOT measurements" in res.output
    assert "XLA step / megakernel step" in res.output and "fraction of the HBM floor" in res.output
    assert "verify step (q = 8: 7 drafts + 1)" in res.output and "mean acceptance length" in res.output
    assert "XLA + ragged paged attn" in res.output and "serving-stack step / megakernel step" in res.output


def test_batch_curve_rows_are_the_benches_of_each_batch(tiny_dense_b2):
    """`--batch-curve 1,2`: one row per batch with the single bench's figures (batch 2's equal
    to the fixture's bench of the same build), the aggregate over batch 1's, the published
    curve's ratio beside it; on a terminal-less run a progress line per batch on stderr."""
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-dense", "--target", "v6e", "--dtype", "bfloat16",
                                    "--batch-curve", "1,2", "--no-serving", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert [row["batch"] for row in r["curve"]] == [1, 2] and r["devices"] == 1
    one, two = r["curve"]
    assert two["step_seconds"]["megakernel"] == pytest.approx(tiny_dense_b2["megakernel"]["step_seconds"])
    assert two["aggregate"]["xla"] == pytest.approx(tiny_dense_b2["tokens_per_second"]["xla"]["aggregate"])
    for row in r["curve"]:
        assert row["aggregate"]["megakernel"] == pytest.approx(row["batch"] / row["step_seconds"]["megakernel"])
        assert row["per_sequence"]["megakernel"] == pytest.approx(1 / row["step_seconds"]["megakernel"])
        assert row["step_source"] == "tpumk model" and "serving" not in row["aggregate"]
    ratio = r["aggregate_over_batch_1"]
    assert ratio["1"] == 1.0 and ratio["2"] == pytest.approx(two["aggregate"]["megakernel"] / one["aggregate"]["megakernel"])
    assert r["published_over_batch_1"]["2"] == pytest.approx(392 / 249)
    assert [ln for ln in res.stderr.splitlines() if "] batch " in ln] and "batch 2" in res.stderr


@pytest.mark.parametrize("curve", ["0,2", "1,1", "a", ""])
def test_a_bad_batch_curve_is_one_line(curve):
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-dense", "--batch-curve", curve])
    assert res.exit_code == 1 and "--batch-curve" in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--target", "cpu"], "target 'cpu' runs kernels in interpret mode"),
    (["--target", "tpu9"], "unknown target 'tpu9'"),
    (["--runs", "0"], "--runs must be >= 1"),
    (["--verify-q", "1"], "--verify-q: expected 0 (off) or at least 2"),
    (["--model", "no-such-model"], "no-such-model"),
])
def test_bench_errors_are_one_line(args, message):
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 1
    assert message in res.output and len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


@pytest.mark.parametrize("preset, overrides, quant", [
    ("tiny-moe", {}, "none"), ("tiny-dense", {}, "none"),
    # 64-wide heads and a sliding layer whose 8-token window is shorter than the 20-token prompt,
    # with Gemma's GeGLU MLP and embedding factor and Gemma 2's soft-capped scores and logits,
    # and gpt-oss's attention sinks
    ("tiny-dense", dict(head_dim=64, sliding_window=8, sliding_layers=[1], mlp_act="gelu_tanh", embed_scale=16.0,
                        attn_softcap=2.0, final_softcap=3.0, attn_sinks=True), "none"),
    ("tiny-moe", {}, "int4"),  # the same quantized weights: int8 ring matrices, group-scaled int4 experts
    # OLMo 2's norms: none before the sublayers, one after each, QK-norm across all heads
    ("tiny-dense", dict(pre_norms=False, post_norms=True, qk_norm_whole=True), "none"),
    # Cohere's: LayerNorm without bias, attention and the MLP on one normed input
    ("tiny-dense", dict(qk_norm=False, norm_kind="layer", parallel_blocks=True), "none"),
])
def test_xla_step_matches_the_reference(preset, overrides, quant):
    """The XLA step (contiguous head-major cache, gathered experts) computes the reference step."""
    from tpumk.model.quantize import quantize_params

    cfg = load_preset(preset).replace(**overrides)
    params = quantize_params(cfg, random_params(cfg, 3), quant)
    batch, context, prompt = 2, 64, 20 if overrides else 5
    cache = ref.init_cache(cfg, batch, context, page_size=16)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, prompt)) for _ in range(batch)]
    _, cache = ref.prefill(params, cfg, prompts, cache)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, 1)), jnp.int32)
    positions = cache.lengths[:, None]
    want_logits, want_cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
    k, v = paged_to_head_major(cache, cfg)
    logits, k2, v2, lengths = make_xla_step(cfg)(params, tokens, positions, k, v, cache.lengths)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=2e-5, atol=2e-5)
    wk, wv = paged_to_head_major(want_cache, cfg)
    # the new K/V rows agree to float32 rounding (XLA fuses the f32 RoPE / norm differently)
    np.testing.assert_allclose(np.asarray(k2), np.asarray(wk), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(wv), rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(np.asarray(k2)) > 0.05 * k2.size  # the prompt and the new token are in there
    np.testing.assert_array_equal(np.asarray(lengths), np.asarray(want_cache.lengths))


# ---------------------------------------------------------------------- hybrid models (linear attention)
# The smallest hybrids (tests/test_megakernel_linear.py's): Gated DeltaNet beside gated attention;
# Kimi Linear's KDA beside MLA without RoPE.
GDN = dict(name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=1,
           linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)
KDA_MLA = dict(name="tiny-kda-mla", num_layers=3, linear_kind="kda", linear_layers=(0, 2), linear_key_heads=2,
               linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=3, hidden_size=128,
               expert_ffn_size=128, shared_expert_ffn_size=128, dense_layers=(0,), nope_layers=(1,))


# kda-mla: full (13 s, most of it drawing a new model's random weights); the default run keeps
# gdn-verify (the linear layers and the pool in the XLA step) and test_mla_tools.py's XLA MLA step
@pytest.mark.parametrize("preset, overrides, q_len", [
    pytest.param("tiny-dense", GDN, 3, id="gdn-verify"),
    pytest.param("tiny-mla", KDA_MLA, 1, id="kda-mla", marks=pytest.mark.full)])
def test_xla_step_of_a_hybrid_matches_the_reference(preset, overrides, q_len):
    """The XLA step's linear layers (the reference's own, on the pool) and attention layers (the
    cache holds those only) compute the reference step: logits, the new KV rows and the whole
    pool; a verify step (q = 3) keeps its tokens pending as the reference does. Before: KeyError
    'wq' on the first linear layer (the step read attention weights in every layer), gated
    attention's gate missing, a NoPE MLA layer rotated."""
    cfg = load_preset(preset).replace(**overrides)
    params = random_params(cfg, 3)
    batch, pending = 2, q_len if q_len > 1 else 0  # as `xla_state_args` lays out the XLA step's pool
    cache = ref.init_cache(cfg, batch, 64, page_size=16, pending=pending)
    rng = np.random.default_rng(0)

    def rand(a, scale=1.0):  # cached rows and states as a prefill would leave them (no prefill to compile)
        return jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype)
    cache = cache._replace(k=rand(cache.k), v=rand(cache.v), lengths=jnp.asarray([5, 9], jnp.int32),
                           states=cache.states._replace(recurrent=rand(cache.states.recurrent, 0.1),
                                                        conv=rand(cache.states.conv)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None]
    want_logits, want = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
    k, v = paged_to_head_major(cache, cfg)
    logits, k2, _, lengths, states = make_xla_step(cfg)(params, tokens, positions, k, v, cache.lengths, cache.states)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(k2), np.asarray(paged_to_head_major(want, cfg)[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(lengths), np.asarray(want.lengths))
    for name in ("recurrent", "conv", "pending"):  # the reference's own layer: the same operations
        np.testing.assert_allclose(np.asarray(getattr(states, name)), np.asarray(getattr(want.states, name)),
                                   rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(np.asarray(states.counts), np.asarray(want.states.counts))
    assert np.asarray(states.counts).tolist() == ([q_len] * batch if q_len > 1 else [0] * batch)


def test_bench_of_a_hybrid_on_tpu7x(tmp_path):
    """`tpumk bench` of a hybrid (issue 55's `--model qwen3-next-80b-a3b --target tpu7x`, at the
    smallest size): both columns compile deviceless, the megakernel's bytes are the plan's
    (its state pool included), the serving-stack column is refused in one line saying why."""
    import tomli_w

    cfg = load_preset("tiny-dense").replace(**GDN)
    toml = tmp_path / "tiny-gdn.toml"
    toml.write_text(tomli_w.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in cfg.to_dict().items()}))
    r = _bench("--model", str(toml), "--target", "tpu7x", "--context", "256")
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 256))
    assert r["megakernel"]["hbm_bytes"] == pytest.approx(plan.hbm_bytes) and plan.hbm["linear_states"] > 0
    assert r["xla"]["compile_seconds"] > 0 and r["xla"]["step_seconds"] > 0 and r["xla"]["hbm_bytes"] > 0
    assert r["serving"] is None and "has linear-attention layers (gated_delta)" in r["serving_refused"]
    assert "state pool" in r["layouts"]["megakernel"] and "linear_attention.layer_step" in r["layouts"]["xla"]


def test_measure_seconds_threads_state_and_takes_the_median():
    calls = []

    @jax.jit
    def step(x):
        return x + 1

    def call(state):
        calls.append(1)
        return step(state)

    out = measure_seconds(call, jnp.zeros(()), warmup=2, runs=5)
    assert len(calls) == 7 and len(out["runs_seconds"]) == 5 and out["warmup"] == 2
    assert out["median_seconds"] == pytest.approx(float(np.median(out["runs_seconds"])))
    assert all(t > 0 for t in out["runs_seconds"])
    with pytest.raises(ValueError):
        measure_seconds(call, jnp.zeros(()), runs=0)
