"""`tpumk bench`, `tune`, `export` / `inspect` and `build` on MLA models (one device, issue 15).

The XLA step the bench compares with runs MLA in the absorbed form over a contiguous latent
cache (tpumk.model.mla's own projections and attention) and equals the reference step; the
serving-stack column (jax's ragged paged attention) is refused for MLA in one line; the
timeline model walks both programs. The tuning space drops the knobs an MLA build does not
have and its constraints stay necessary conditions of the plan; a 2-trial study compiles; an
MLA artifact round-trips through export, inspect and load. Tiny models: well under 3 minutes.
"""

from __future__ import annotations

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.decode.bench import serving_refusal
from tpumk.decode.xla_compile import compile_program
from tpumk.model.xla_step import make_xla_step, paged_to_head_major, xla_decode_step, xla_step_specs
from tpumk.errors import PlanError
from tpumk.model import reference as ref
from tpumk.model.config import load_preset, resolve_model
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target
from tpumk.tune.space import DEFAULT_SPACE_PATH, SPACES_DIR, load_space, space_facts

TPU7X = get_target("tpu7x")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---------------------------------------------------------------------- the preset
def test_tiny_mla_preset_builds_to_one_kernel():
    r = cli("build", "--model", "tiny-mla", "--target", "tpu7x", "--verify-q", "0", "--no-estimate", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["model"], out["custom_calls"]) == ("tiny-mla", 1)
    assert out["plan"]["attention"]["latent_cache"] and out["model_seconds"] >= out["floor_seconds"] > 0


# ---------------------------------------------------------------------- the XLA step
def _cached(cfg, lengths, context=64, page=16):
    """A paged latent cache holding random rows for `lengths` tokens per sequence (shuffled
    pages): what a prefill leaves, without its cost."""
    cache = ref.init_cache(cfg, len(lengths), context, page_size=page, seed=1)
    k = np.zeros(cache.k.shape, np.float32)
    rng = np.random.default_rng(2)
    tables = np.asarray(cache.block_tables)
    for b, n in enumerate(lengths):
        for pos in range(n):
            w = cfg.attention.kv_cache_width  # the row's lanes; the pad lanes after them stay 0
            k[:, tables[b, pos // page], pos % page, :w] = rng.normal(0, 1, (cfg.num_layers, w))
    return cache._replace(k=jnp.asarray(k, cache.k.dtype), lengths=jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("dtype, q_len", [("float32", 1), ("bfloat16", 3)])
def test_mla_xla_step_matches_the_reference(dtype, q_len):
    """The XLA step's absorbed MLA over its contiguous latent cache computes the reference step:
    logits, the step's latent rows in the cache, the lengths (q_len 3: the verify step). Its
    routing uses the correction bias (without it the logits differ: the check can fail)."""
    cfg = load_preset("tiny-mla").replace(dtype=dtype)
    params = random_params(cfg, 3)
    batch, context = 2, 64
    cache = _cached(cfg, [5, 20], context)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    want_logits, want_cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
    k, v = paged_to_head_major(cache, cfg)
    assert k.shape == (cfg.num_layers, batch, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim) and v.shape[-1] == 0
    step = make_xla_step(cfg)
    logits, k2, v2, lengths = step(params, tokens, positions, k, v, cache.lengths)
    tol = 2e-5 if dtype == "float32" else 1e-6  # bf16: the same ops in the same order
    scale = float(jnp.max(jnp.abs(want_logits)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=0, atol=tol * scale)
    wk, _ = paged_to_head_major(want_cache, cfg)
    np.testing.assert_allclose(np.asarray(k2, np.float32), np.asarray(wk, np.float32), rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(np.asarray(k2[:, 1, 20:20 + q_len], np.float32)) > 0  # the new rows are written
    np.testing.assert_array_equal(np.asarray(lengths), np.asarray(want_cache.lengths))
    if dtype == "float32":
        unbiased = {**params, "layers": [{n: w for n, w in lay.items() if n != "router_bias"}
                                         for lay in params["layers"]]}
        k, v = paged_to_head_major(cache, cfg)
        other = step(unbiased, tokens, positions, k, v, cache.lengths)[0]
        assert float(jnp.max(jnp.abs(other - want_logits))) > 1e-3 * scale


# ---------------------------------------------------------------------- bench
@pytest.fixture(scope="module")
def mla_bench() -> dict:
    r = cli("bench", "--model", "tiny-mla", "--target", "tpu7x", "--dtype", "bfloat16", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_bench_of_an_mla_model(mla_bench):
    r = mla_bench
    cfg = load_preset("tiny-mla").replace(dtype="bfloat16")
    plan = make_plan(BuildSpec(cfg, TPU7X, 1, 4096))
    mk, x = r["megakernel"], r["xla"]
    assert r["model"] == "tiny-mla" and mk["hbm_bytes"] == pytest.approx(plan.hbm_bytes)
    for side in (mk, x):
        assert side["compile_seconds"] > 0 and side["step_seconds"] > 0 and side["hbm_bytes"] > 0
        assert side["step_source"].startswith("MODEL, not measured")
        assert side["step_seconds"] == pytest.approx(side["model"]["seconds"])
    assert mk["step_seconds"] >= r["floor_seconds"] > 0
    assert r["speedup"] == pytest.approx(x["step_seconds"] / mk["step_seconds"])
    # the megakernel's model walks the plan (its MLA families through the ring, bytes equal to
    # the plan's) and streams the one latent cache, not a per-head K and V
    latent = cfg.num_layers * 4096 * cfg.attention.kv_cache_width * 2  # (stored lane-padded: 48 -> 128 lanes)
    per_head = 2 * cfg.num_layers * 4096 * cfg.num_q_heads * cfg.head_dim * 2  # 192 lanes a token
    assert {"q_a", "q_b", "kv_a", "uk", "uv", "o"} <= set(plan.families)
    stages = mk["model"]["stages"]
    kernel_bytes = sum(v["hbm_bytes"] for k, v in stages.items() if k.startswith("pallas: "))
    assert kernel_bytes == pytest.approx(plan.hbm_bytes)
    assert stages["pallas: weight_ring"]["seconds"] > 0 and stages["pallas: experts"]["seconds"] > 0
    assert latent <= stages["pallas: attention"]["hbm_bytes"] < per_head
    # the XLA column: its own program, op by op, reading the latent cache (not a per-head one)
    prog = compile_program(lambda p, t, pos, k, v, n: xla_decode_step(p, cfg, t, pos, k, v, n),
                           xla_step_specs(cfg, 1, 4096), TPU7X, donate_argnums=(3, 4))
    assert x["hbm_bytes"] == pytest.approx(prog.compiled.cost_analysis()["bytes accessed"])
    assert 'custom_call_target="tpu_custom_call"' not in prog.hlo_text
    specs = xla_step_specs(cfg, 1, 4096)
    assert specs[3].shape == (cfg.num_layers, 1, 4096, cfg.attention.kv_cache_width) and specs[4].shape[-1] == 0
    assert f"bf16[{cfg.num_layers},1,4096,{cfg.attention.kv_cache_width}]" in prog.hlo_text  # the latent cache, in place
    assert x["model"]["hbm_bytes"] >= latent
    assert mk["kernels"] < x["kernels"]
    # no serving-stack column for MLA: one line saying why, no numbers
    assert r["serving"] is None and "speedup_vs_serving" not in r
    assert r["serving_refused"] == serving_refusal(cfg) and "\n" not in r["serving_refused"]
    assert "ragged_paged_attention" in r["serving_refused"] and "latent" in r["serving_refused"]
    assert "latent cache" in r["layouts"]["xla"] and "latent cache" in r["layouts"]["megakernel"]
    assert r["verify"]["feasible"] and r["verify"]["cost_vs_plain"] >= 1.0


def test_bench_table_of_an_mla_model_says_why_there_is_no_serving_column(mla_bench, capsys):
    from tpumk.cli.bench import print_bench

    print_bench(mla_bench)
    out = capsys.readouterr().out
    assert "XLA + ragged paged attn" not in out and "serving-stack step / megakernel step" not in out
    assert "serving-stack column (XLA + ragged paged attention): not built: " in out
    assert "XLA step / megakernel step" in out and "NOT measurements" in out


def test_serving_refusal_is_for_mla_and_heads_off_the_lane_grid():
    assert serving_refusal(load_preset("tiny-moe")) is None
    assert serving_refusal(load_preset("deepseek-v3")) is not None
    # jax's ragged paged attention cannot build 64-wide heads (it asserts while tracing):
    # the column is refused in one line instead (when jax builds it, this fails: drop the refusal)
    from tpumk.decode.serving import compile_serving_step

    d64 = load_preset("tiny-dense").replace(head_dim=64)
    assert "multiple of 128 lanes; this model's is 64" in serving_refusal(d64)
    with pytest.raises(AssertionError):
        compile_serving_step(d64, TPU7X, 1, 64, 16, 1, "none")


# ---------------------------------------------------------------------- tuning space and tune
def test_space_for_an_mla_build_drops_the_qkv_knobs():
    space = load_space(DEFAULT_SPACE_PATH)
    mla = space.for_build(BuildSpec(load_preset("tiny-mla"), TPU7X))
    assert "qkv_tile_rows" not in mla.knobs and "qkv_tile_cols" not in mla.knobs
    for knob in ("ring_depth", "tile_bytes", "o_tile_rows", "lm_head_tile_cols", "kv_tile_pages", "kv_buffers",
                 "expert_slots", "expert_chunk", "gate_up_tile_rows", "shared_down_tile_cols"):
        assert knob in mla.knobs, knob
    assert mla.tuning_for(mla.default_values()) == TuningConfig(ring_depth=12)  # auto's depth where it fits
    gqa = space.for_build(BuildSpec(load_preset("tiny-moe"), TPU7X))
    assert set(gqa.knobs) == set(mla.knobs) | {"qkv_tile_rows", "qkv_tile_cols"}


def test_space_facts_of_an_mla_model():
    cfg = resolve_model("benchmarks/deepseek-v3-reduced.toml")
    f = space_facts(BuildSpec(cfg, TPU7X))
    assert (f["is_mla"], f["kv_caches"], f["kv_row_lanes"]) == (1, 1, 640)  # 512 + 64 in whole lane tiles
    assert f["o_rows"] == 128 * 128  # 128 heads x 128 value lanes
    g = space_facts(BuildSpec(load_preset("tiny-moe"), TPU7X))
    assert (g["is_mla"], g["kv_caches"], g["kv_row_lanes"], g["o_rows"]) == (0, 2, g["kv_size"], g["q_size"])


@pytest.mark.parametrize("model, tuning", [
    ("benchmarks/deepseek-v3-reduced.toml", dict(ring_depth=4, expert_slots=4)),  # its tuning file
    ("tiny-mla", {}),
])
def test_default_constraints_are_necessary_conditions_for_mla(model, tuning):
    """The default configuration passes the constraints (a per-head KV count would have pruned
    DeepSeek-V3's), and every random configuration they reject, the plan rejects too."""
    spec = BuildSpec(resolve_model(model), TPU7X, 1, 4096, TuningConfig(**tuning))
    space = load_space(DEFAULT_SPACE_PATH).for_build(spec)
    assert space.violated(spec.tuning, space_facts(spec)) is None
    make_plan(spec)
    rng = random.Random(model)
    rejected = 0
    for _ in range(60):
        values = {n: rng.choice(k.values()) for n, k in space.knobs.items()}
        for name in values:
            if "_tile_" in name and rng.random() < 0.8:
                values[name] = 0
        t = space.tuning_for(values, base=spec.tuning)
        if space.violated(t, space_facts(spec.replace(tuning=t))) is not None:
            rejected += 1
            with pytest.raises(PlanError):
                make_plan(spec.replace(tuning=t))
    assert rejected > 0


def test_auto_objective_of_an_mla_model_is_the_model():
    """libtpu's static profiler aborts on the MLA megakernel (bfloat16 too), so `auto` does not
    pick the compiler objective, and asking for it is one line saying why."""
    from tpumk.errors import ConfigError
    from tpumk.tune.objectives import choose_objective

    from estimate_support import COMPILER_ESTIMATE

    cfg = load_preset("tiny-mla").replace(dtype="bfloat16")
    # a libtpu without a profiler for kernels with DMAs (vLLM TPU / jax 0.12 sets): that reason first
    why = "MLA model" if COMPILER_ESTIMATE else "static profile does not work"
    c = choose_objective("auto", cfg, TPU7X, tpu_kind=None)
    assert c.name == "model" and why in c.reason
    with pytest.raises(ConfigError, match=why) as e:
        choose_objective("compiler", cfg, TPU7X)
    assert "\n" not in str(e.value)
    dense = choose_objective("auto", load_preset("tiny-moe").replace(dtype="bfloat16"), TPU7X).name
    assert dense == ("compiler" if COMPILER_ESTIMATE else "model")


def test_a_study_of_an_mla_model_compiles(tmp_path, monkeypatch):
    """One trial: the study mechanism itself (many trials, resume) is test_tune.py's."""
    monkeypatch.chdir(tmp_path)
    r = cli("tune", "--model", "tiny-mla", "--target", "tpu7x", "--space", SPACES_DIR / "tiny.toml",
            "--objective", "model", "--trials", 1, "--seed", 0, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["counts"] == {"COMPLETE": 1} and out["evaluated"] == 1 and out["this_run"]["compiles"] == 1
    for b in out["best"]:
        assert b["value_seconds"] >= b["floor_seconds"] > 0 and b["compile_seconds"] > 0
    from tpumk.plan.knobs import load_tuning

    tuned = load_tuning(tmp_path / out["out"])  # what `tpumk build --tuning` reads
    assert tuned.to_dict() == out["best_tuning"]
    make_plan(BuildSpec(load_preset("tiny-mla"), TPU7X, tuning=tuned))


# ---------------------------------------------------------------------- export, inspect, load
def test_mla_artifact_round_trips(tmp_path, monkeypatch):
    """`tpumk export` writes an MLA artifact that `tpumk inspect` reads back valid, and whose
    loaded step (the portable export, interpret mode on the host) gives the reference's logits
    and latent cache rows."""
    from tpumk.export import artifacts as A
    from tpumk.kernel.layout import pack_weights

    for var in ("TPUMK_SIGNING_KEY", "TPUMK_SIGNING_KEY_FILE", "TPUMK_REQUIRE_SIGNED"):
        monkeypatch.delenv(var, raising=False)
    r = cli("export", "--model", "tiny-mla", "--target", "cpu", "--context", 32, "--out", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    path = json.loads(r.stdout)["path"]
    info = json.loads(cli("inspect", "--json", path).stdout)
    assert info["valid"] and set(info["files"]) == {A.EXECUTABLE, A.EXPORTED}
    text = cli("inspect", path).output
    assert "tiny-mla" in text and "context 32" in text and "files match the manifest's sha256" in text
    again = cli("export", "--model", "tiny-mla", "--target", "cpu", "--context", 32, "--out", tmp_path, "--json")
    assert json.loads(again.stdout)["cache_hit"] and json.loads(again.stdout)["path"] == path

    cfg = load_preset("tiny-mla")
    step = A.load(path)
    params = random_params(cfg, seed=0)
    cache = step.init_cache()
    w = cfg.attention.kv_cache_width
    assert cache.k.shape[-1] == cfg.attention.latent_cache_lanes == 128 and cache.v.shape[-1] == 0
    # 7 cached tokens of random latent rows (what a prefill would leave, without its cost)
    rows = np.random.default_rng(1).normal(0, 1, (cfg.num_layers, 7, w)).astype(np.float32)
    first_page = int(cache.block_tables[0, 0])
    cache = cache._replace(k=cache.k.at[:, first_page, :7, :w].set(rows), lengths=jnp.asarray([7], jnp.int32))
    tokens, positions = jnp.asarray([[6]], jnp.int32), cache.lengths[:, None]
    want, want_cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
    got, got_cache = step(pack_weights(step.plan, params), tokens, positions, cache)  # donates `cache`
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(got_cache.k), np.asarray(want_cache.k), rtol=1e-5, atol=1e-5)
    assert int(got_cache.lengths[0]) == 8
