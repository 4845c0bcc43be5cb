"""The N-device megakernel (issue 13): sharding plan, interpret-mode runs on N host CPU devices
against the one-device reference, deviceless compiles of the same builds for multi-chip TPU
topologies, and greedy parity with transformers through `tpumk generate --devices 4`.

Interpret runs need N host devices, which JAX makes only before its backends start, so they
run in a subprocess: this file as a script (`_worker_many`), all cases of a session in one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_flags import generate_on_devices, xla_flags
from program_checks import cache_copies

ROOT = Path(__file__).resolve().parents[1]
XLA_COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(")

# (case id, model: preset or overrides of one, devices, batch, q_len, tuning overrides)
DENSE8 = dict(base="tiny-dense", name="dense8", num_q_heads=8, num_kv_heads=2, vocab_size=1001, dtype="bfloat16")
GPT_OSS_EXPERTS = dict(router_logit_bias=True, expert_bias=True, swiglu_limit=1.0, swiglu_alpha=1.702)
# The tiny models' partials are small, so the auto all-reduce is the direct push; the other
# schedules are asked for by the knob so every one runs in the megakernel.
CASES = {
    # a vocabulary off the lane grid, split over the devices (each pads its slice); Gemma 2 and
    # 3's parts: each sublayer's all-reduced output normalized before the residual (post_norms),
    # GeGLU, scores / sqrt(96) soft-capped at 2, each device's logits slice soft-capped at 3,
    # layer 0 sliding a 20-token window with its own RoPE theta; gpt-oss's attention sinks (each
    # device's q heads' sink logits from its slice of the layer's sinks row) and q / k / v / o
    # biases (each device's heads' q / k / v biases; o's whole, added once to the all-reduced sum)
    "dense-2dev-kv-split": (dict(base="tiny-dense", name="dense-v1001", vocab_size=1001, post_norms=True,
                                 mlp_act="gelu_tanh", attn_scalar=96.0, sliding_window=20, sliding_layers=[0],
                                 rope_local_theta=10000.0, attn_softcap=2.0, final_softcap=3.0, attn_sinks=True,
                                 qkv_bias=True, o_bias=True),
                            2, 2, 1, {}),
    # 64-wide KV heads, one per device: held in pairs (both KV heads on both devices, each device
    # 2 of each head's 4 query heads, the q / o / bias / sink slices gathered run by run), with
    # gpt-oss's attention (sinks, q / k / v / o biases, a sliding layer)
    "dense-2dev-d64-paired": (dict(base="tiny-dense", head_dim=64, num_q_heads=8, num_kv_heads=2, attn_sinks=True,
                                   qkv_bias=True, o_bias=True, sliding_window=20, sliding_layers=[0]),
                              2, 2, 1, {}),
    # OLMo 2's norms: none before the sublayers, each all-reduced output normalized, q and k each
    # normalized across all heads (the rows' sums of squares all-reduced first: 3 collectives a
    # layer), here with each KV head on 2 devices (counted once); the chip-hierarchical
    # all-reduce (4 devices: 2 chips of sibling TensorCores)
    "dense-4dev-kv-replicated-verify": (dict(base="tiny-dense", pre_norms=False, post_norms=True, qk_norm_whole=True),
                                        4, 2, 2, {"all_reduce": "hierarchical"}),
    # Cohere's parts: LayerNorm without bias, attention and the MLP on one normed input (the MLP's
    # all-reduced output joins the residual after attention's)
    "dense-2dev-cohere": (dict(base="tiny-dense", name="dense-cohere", qk_norm=False, norm_kind="layer",
                               parallel_blocks=True), 2, 2, 1, {}),
    # the shared expert's columns split over the devices, each partial scaled by Qwen2-MoE's gate;
    # gpt-oss's experts (a router logit bias, expert biases, the clamped SwiGLU) with each expert
    # split over 2 devices: each holds its columns' gate / up biases, one of the two adds the
    # down biases
    "moe-4dev-mixed": (dict(base="tiny-moe", shared_expert_gate=True, taps=(3, 1), **GPT_OSS_EXPERTS), 4, 2, 1,
                       {"all_reduce": "rsag"}),
    # each device owns 2 of the 8 experts and adds its picked experts' down biases
    "moe-4dev-expert-parallel": (dict(base="tiny-moe", **GPT_OSS_EXPERTS), 4, 3, 1,
                                 {"expert_parallel": 4, "all_reduce": "doubling"}),
    # a bfloat16 wire: partials and rsag's chunk sums rounded to bf16 as they travel (logits the
    # same bits on every device, within the bf16 model's bound of the reference). Dense: in a
    # MoE model that rounding can flip a near-tie of the router (tiny-moe does, at its second
    # step: a token takes another expert), which no tolerance on the logits bounds.
    "dense-4dev-bf16-wire": (dict(base="tiny-dense", dtype="bfloat16"), 4, 2, 1,
                             {"all_reduce": "rsag", "all_reduce_wire": "bfloat16"}),
    "dense8-8dev-bf16-odd-vocab": (DENSE8, 8, 1, 1, {"all_reduce": "hierarchical"}),
    "moe-4dev-int8": (dict(base="tiny-moe", dtype="bfloat16", quant="int8"), 4, 2, 1, {}),  # scales shard too
    # a 1-byte KV cache (tpumk.model.kv_quant): each device's KV head in its own packed page
    # layout, each head on 2 devices (both must write the same bytes)
    "dense-4dev-fp8-kv": (dict(base="tiny-dense", dtype="bfloat16", kv_dtype="fp8"), 4, 2, 1, {}),
    # DeepSeek-V3 routing: the float32 router and its correction-bias row are replicated
    "moe-4dev-deepseek-routing": (dict(base="tiny-moe", router_scoring="sigmoid", router_groups=4, router_topk_groups=2,
                                       router_correction_bias=True, routed_scaling_factor=2.5), 4, 2, 1, {}),
}


RACES_CASE = "moe-4dev-mixed"  # the case run with the interpreter's race detector


def _config(model: dict):
    from tpumk.model.config import load_preset

    over = {k: v for k, v in model.items() if k not in ("quant", "kv_dtype", "taps")}
    return load_preset(over.pop("base")).replace(**over)


def _spec(case: str, target: str):
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    model, n, batch, q_len, tuning = CASES[case]
    return BuildSpec(_config(model), get_target(target), batch=batch, context=64, q_len=q_len, devices=n,
                     tuning=TuningConfig(**tuning), quant=model.get("quant", "none"), kv_dtype=model.get("kv_dtype", ""),
                     taps=tuple(model.get("taps", ())))


# ---------------------------------------------------------------------- the subprocess
def _worker(case: str, races: bool) -> dict:
    """Two decode steps of the N-device kernel (interpret mode, N host devices) and of the
    reference from the same prefilled cache; what a test needs to judge them."""
    import jax
    import jax.numpy as jnp

    from tpumk.compat import interpret_races
    from tpumk.kernel.layout import pack_sharded
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.model import reference as ref
    from tpumk.model.quantize import quantize_params
    from tpumk.model.weights import random_params
    from tpumk.plan.plan import make_plan

    spec = _spec(case, "cpu")
    plan = make_plan(spec)
    cfg, sh = spec.model, plan.sharding
    params = quantize_params(cfg, random_params(cfg, seed=7), spec.quant)
    b, q = spec.batch, spec.q_len
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, cfg.vocab_size, 5 + 3 * i)) for i in range(b)]
    cache = ref.init_cache(cfg, b, spec.context, kv_dtype=spec.kv_dtype or None)
    _, cache = ref.prefill(params, cfg, prompts, cache)
    step = make_decode_step(plan, detect_races=races)
    packed = pack_sharded(plan, params)
    if spec.kv_dtype:
        wide = sh.expand_quantized(cfg, cache)
    else:
        wide = ref.KVCache(sh.expand_cache(cfg, cache.k), sh.expand_cache(cfg, cache.v), cache.block_tables,
                           cache.lengths)
    out = {"steps": [], "devices": len(jax.devices("cpu"))}
    ref_cache = cache
    for _ in range(2):
        lengths = np.asarray(ref_cache.lengths)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, q)), jnp.int32)
        positions = jnp.asarray(lengths[:, None] + np.arange(q)[None], jnp.int32)
        taps = {}
        if spec.taps:  # the hidden-state taps: every device holds the whole rows, as the reference's
            _, _, want_taps = ref.jitted_decode_step(cfg, spec.taps)(params, tokens, positions, ref_cache)
        want, ref_cache = ref.jitted_decode_step(cfg)(params, tokens, positions, ref_cache)
        got, wide, *got_taps = step(packed, tokens, positions, wide)
        if spec.taps:
            taps = {"taps_err": float(np.max(np.abs(np.asarray(got_taps[0], np.float32) - np.asarray(want_taps, np.float32)))),
                    "taps_shape_ok": list(got_taps[0].shape) == list(want_taps.shape)}
        # the in-kernel all-gather left the same logits on every device
        shards = [np.asarray(x.data, np.float32) for x in got.addressable_shards]
        same_everywhere = len(shards) == sh.devices and all(np.array_equal(x, shards[0]) for x in shards)
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        k = np.asarray(wide.kv).view(np.uint8) if spec.kv_dtype else np.asarray(wide.k, np.float32)
        per_dev = k.reshape(*k.shape[:-1], sh.devices, -1)
        replicas_equal = all(np.array_equal(per_dev[..., d, :], per_dev[..., d // sh.kv_replicas * sh.kv_replicas, :])
                             for d in range(sh.devices)) if sh.kv_replicas > 1 else None
        if spec.kv_dtype:  # the packed pages' bytes: in bfloat16 a row can round to the next code
            back = np.asarray(sh.collapse_quantized(cfg, wide).kv).view(np.uint8)
            errs = {"kv_bytes_differing": float(np.mean(back != np.asarray(ref_cache.kv).view(np.uint8)))}
        else:
            errs = {"k_err": float(np.max(np.abs(np.asarray(sh.collapse_cache(cfg, wide.k), np.float32)
                                                 - np.asarray(ref_cache.k, np.float32)))),
                    "v_err": float(np.max(np.abs(np.asarray(sh.collapse_cache(cfg, wide.v), np.float32)
                                                 - np.asarray(ref_cache.v, np.float32))))}
        out["steps"].append({
            "shape": list(got.shape), "want_shape": list(want.shape),
            "max_err": float(np.max(np.abs(got - want))), "scale": float(np.max(np.abs(want))),
            "argmax_equal": bool(np.array_equal(got.argmax(-1), want.argmax(-1))), **errs,
            "lengths_equal": bool(np.array_equal(np.asarray(wide.lengths), np.asarray(ref_cache.lengths))),
            "replicas_equal": replicas_equal, "logits_same_everywhere": same_everywhere, **taps,
        })
    r = interpret_races()
    out["races"] = None if (r is None or not races) else bool(r.races_found)
    out["sharding"] = plan.sharding.summary(cfg)
    out["schedule"] = plan.all_reduce.schedule
    return out


def _worker_many(cases: list[str]) -> dict:
    """`_worker` for each case in turn, in this one process (a case on n devices uses the first n
    of its host devices); a case that raises is reported, not fatal to the others."""
    import traceback

    out = {}
    for case in cases:
        try:
            out[case] = _worker(case, races=case == RACES_CASE)
        except Exception:  # noqa: BLE001 - the test of that case shows it
            out[case] = {"error": traceback.format_exc()[-3000:]}
    return out


def _run(cases: list[str]) -> dict:
    n = max(CASES[c][1] for c in cases)
    # NPROC: see tpumk.targets.ensure_host_devices (interpreted devices block pool threads).
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * n),
               XLA_FLAGS=xla_flags(n))
    proc = subprocess.run([sys.executable, __file__, *cases], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600 * len(cases))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpret_runs(request) -> dict:
    """Every case of test_interpret_matches_reference_and_compiles this session runs, in ONE
    subprocess with as many host devices as the largest case needs: one JAX start-up and one
    set of shared compiles (random weights, reference steps) instead of one per case. Whole
    files go to one pytest-xdist worker (`--dist loadfile`), so the cases listed are the ones
    this process runs."""
    cases = [item.callspec.params["case"] for item in request.session.items
             if item.module is request.module and item.originalname == "test_interpret_matches_reference_and_compiles"]
    return _run(cases)


# ---------------------------------------------------------------------- interpret vs reference
# The full tier: the int8 case (quantized scales sharded: test_quant.py::
# test_many_devices_with_quantized_weights_compile checks the device parts and compiles them),
# DeepSeek routing on 4 devices (the replicated float32 router and correction bias run in
# tests/test_multidevice_mla.py's 4-device case, whose tiny-mla routes that way) and the
# 8-device bf16 model (its odd vocabulary split: dense-2dev-kv-split; KV heads replicated:
# dense-4dev-kv-replicated-verify, which also runs the hierarchical schedule; rsag:
# moe-4dev-mixed; 8 devices: test_collectives.py's 8-device all-reduces, hierarchical included)
# and the bfloat16 wire (test_collectives.py's [8-rsag-bfloat16] and [8-hierarchical-bfloat16]
# hold its rounded partials and sums bit for bit; the megakernel's all-reduce call is the same
# for either wire: the other 4-device cases). Without it the subprocess needs 4 host devices, not 8.
FULL_CASES = {"moe-4dev-int8", "moe-4dev-deepseek-routing", "dense8-8dev-bf16-odd-vocab", "dense-4dev-bf16-wire"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c in FULL_CASES else c for c in CASES])
def test_interpret_matches_reference_and_compiles(case, interpret_runs):
    r = interpret_runs[case]
    assert "error" not in r, r.get("error")
    model, n, batch, q_len, _ = CASES[case]
    bf16 = model.get("dtype") == "bfloat16"
    for s in r["steps"]:
        assert s["shape"] == s["want_shape"]
        # f32: partial sums added in another order than one matmul's; bf16: activations are cast
        # to bf16 before each matmul, so a last-bit f32 difference can flip a bf16 rounding (a
        # bf16 wire rounds each partial and chunk sum once more, the same relative 2^-9).
        tol = (3e-2 if bf16 else 2e-5) * max(1.0, s["scale"])
        assert s["max_err"] <= tol, (case, s)
        assert s["argmax_equal"], (case, s)
        if "kv_bytes_differing" in s:  # a bf16 row a rounding apart can take the next code: rarely
            assert s["kv_bytes_differing"] <= 0.01, (case, s)
        else:
            assert s["k_err"] <= tol and s["v_err"] <= tol, (case, s)
        assert s["lengths_equal"] and s["logits_same_everywhere"]
        if "taps_err" in s:  # hidden-state taps (issue 56): the residual every device holds
            assert s["taps_shape_ok"] and s["taps_err"] <= tol, (case, s)
        if s["replicas_equal"] is not None:  # devices sharing a KV head computed the same bits
            assert s["replicas_equal"], (case, s)
    if case == RACES_CASE:
        assert r["races"] is False
    assert r["schedule"] == CASES[case][4].get("all_reduce", "direct")

    # The same build compiles deviceless for a multi-chip TPU7x topology: one kernel, no XLA
    # collective (interpret mode does not check Mosaic's layout rules), and no copy of the
    # cache around the kernel (the pages it patched are scattered into the donated cache).
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    plan = make_plan(_spec(case, "tpu7x"))
    c = compile_plan(plan)
    assert c.custom_calls == 1
    assert not XLA_COLLECTIVES.search(c.hlo_text), XLA_COLLECTIVES.search(c.hlo_text).group(0)
    assert plan.cache_written_after_kernel and not plan.contract.aliases
    assert cache_copies(plan, c) == []


@pytest.mark.parametrize("target,case", [("v5e", "moe-4dev-mixed"), ("v6e", "dense-4dev-kv-replicated-verify"),
                                         ("v5p", "dense-2dev-kv-split")])
def test_compiles_for_other_generations(target, case):
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    spec = _spec(case, target)
    plan = make_plan(spec.replace(tuning=spec.tuning.replace(all_reduce="auto")))
    if target == "v5e":  # power-of-two offsets only (TPU_FACTS 8)
        assert plan.all_reduce.schedule == "doubling"
    c = compile_plan(plan)
    assert c.custom_calls == 1 and not XLA_COLLECTIVES.search(c.hlo_text)


# ---------------------------------------------------------------------- the plan
def _plan(model: str, target: str = "tpu7x", devices: int = 1, **kw):
    from tpumk.model.config import resolve_model
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    tuning = TuningConfig(**kw.pop("tuning", {}))
    return make_plan(BuildSpec(resolve_model(model), get_target(target), devices=devices, tuning=tuning, **kw))


def test_sharding_of_public_models():
    p = _plan("qwen3-32b", devices=8)
    sh = p.sharding
    assert (sh.q_heads, sh.kv_heads, sh.kv_replicas, sh.ffn, sh.vocab) == (8, 1, 1, 3200, 151936 // 8)
    assert p.cfg.num_q_heads == 8 and p.whole_model.num_q_heads == 64
    big = _plan("qwen3-235b-a22b", devices=32)
    sh = big.sharding
    # 4 KV heads over 32 devices: each read by 8; experts 8 groups x 4-way width (1536 / 32 = 48
    # lanes would not be whole lanes), as the published 16-chip model splits them.
    assert (sh.q_heads, sh.kv_heads, sh.kv_replicas) == (2, 1, 8)
    assert (sh.expert_parallel, sh.expert_tensor, sh.experts, sh.expert_ffn) == (8, 4, 16, 384)
    assert big.moe.local_experts == 16 and big.moe.num_experts == 128
    s = big.summary()
    assert s["devices"] == 32 and s["sharding"]["experts"]["mode"] == "expert_x_tensor"
    assert s["collectives_per_step"] == 2 * 94 + 1  # 2 all-reduces per layer, the logits all-gather
    from tpumk.plan.contract import logits_slice_bytes

    assert s["interconnect_bytes_per_step"] == 2 * 94 * big.all_reduce.send_bytes + 31 * logits_slice_bytes(big)
    # rsag: each device sends 2 (N-1) chunks of [1 token row, 128 lanes] f32 per all-reduce
    assert big.all_reduce.send_bytes == 2 * 31 * 1 * 128 * 4
    # per-device HBM: about a 32nd of the active weights plus the replicated embedding
    one = _plan("qwen3-8b")
    assert big.hbm_bytes < 2.2e9 and one.hbm_bytes > 15e9


def test_one_device_plan_is_unchanged_by_the_sharding_code():
    p = _plan("qwen3-8b")
    assert p.sharding is None and p.all_reduce is None and p.devices == 1
    assert p.whole_model is p.cfg and "sharding" not in p.summary()
    assert not any(b.component == "collectives" for b in p.contract.scratch)


def test_expert_parallel_knob():
    from tpumk.errors import PlanError
    from tpumk.plan.sharding import expert_parallel_choices
    from tpumk.model.config import resolve_model

    assert _plan("tiny-moe", devices=4, tuning={"expert_parallel": 4}).sharding.experts == 2
    assert expert_parallel_choices(resolve_model("qwen3-235b-a22b"), 32) == [8, 16, 32]
    with pytest.raises(PlanError) as e:
        _plan("tiny-moe", devices=4, tuning={"expert_parallel": 1})
    assert "'expert_parallel' = 1" in str(e.value) and "possible: 2, 4" in str(e.value)


@pytest.mark.parametrize("model,devices,target,words", [
    ("tiny-dense", 3, "tpu7x", "devices = 3: expected a divisor of num_q_heads (4)"),
    ("qwen3-235b-a22b", 1, "tpu7x", "does not fit one tpu7x device"),
    ("qwen3-235b-a22b", 4, "tpu7x", "does not fit 4 tpu7x devices"),
    ("qwen3-8b", 300, "tpu7x", "devices = 300: expected a positive integer at most 256"),
    ("qwen3-8b", 12, "v5e", "devices = 12: expected a divisor of num_q_heads (32)"),
])
def test_refusals_are_one_line(model, devices, target, words):
    from tpumk.errors import TpumkError

    with pytest.raises(TpumkError) as e:
        _plan(model, target, devices=devices)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg
    if "does not fit" in msg:
        assert "GB" in msg  # names the bytes


def test_kv_head_split_must_be_whole():
    from tpumk.errors import PlanError
    from tpumk.model.config import load_preset
    from tpumk.plan.sharding import plan_sharding

    cfg = load_preset("tiny-dense").replace(num_q_heads=12, num_kv_heads=6)
    with pytest.raises(PlanError, match=r"devices = 4: expected a divisor of num_kv_heads \(6\)"):
        plan_sharding(cfg, 4)
    assert plan_sharding(cfg, 6).kv_heads == 1 and plan_sharding(cfg, 12).kv_replicas == 2


def test_topologies_per_device_count():
    from tpumk.targets import get_target, topology_for

    t7 = get_target("tpu7x")
    assert topology_for(t7, 1) == "tpu7x:2x2x1" and topology_for(t7, 8) == "tpu7x:2x2x1"
    assert topology_for(t7, 32) == "tpu7x:4x4x1" and topology_for(t7, 16) == "tpu7x:2x2x2"
    assert topology_for(get_target("v6e"), 8) == "v6e:2x4"
    assert topology_for(get_target("cpu"), 8) is None


# ---------------------------------------------------------------------- the build report
def test_build_report_json_for_four_devices():
    from click.testing import CliRunner

    from tpumk.cli.app import main

    # --no-estimate: the figures checked here are the plan's and the compile's (the profiling
    # compile, a second process, is tests/test_build.py's)
    r = CliRunner().invoke(main, ["build", "--model", "tiny-moe", "--target", "tpu7x", "--devices", "4",
                                  "--verify-q", "0", "--no-estimate", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert (rep["devices"], rep["topology"], rep["custom_calls"], rep["xla_collectives"]) == (4, "tpu7x:2x2x1", 1, 0)
    assert rep["mesh"]["axes"] == {"tp": 4} and len(rep["mesh"]["device_ids"]) == 4
    assert rep["sharding"]["experts"]["mode"] == "expert_x_tensor"
    assert rep["collectives_per_step"] == 2 * 3 + 1 and rep["interconnect_bytes_per_step"] > 0
    # per device: a quarter of the attention heads' bytes and so on, so less than one device's
    one = json.loads(CliRunner().invoke(main, ["build", "--model", "tiny-moe", "--target", "tpu7x", "--verify-q", "0",
                                               "--no-estimate", "--json"]).stdout)
    assert rep["hbm_bytes_per_step"] < one["hbm_bytes_per_step"] and one["devices"] == 1 and one["mesh"] is None
    assert rep["model_collectives_seconds"] > 0 and one["model_collectives_seconds"] == 0
    assert "tpumk timeline model" in rep["model_source"]
    from tpumk.targets import get_target

    why = "none: not requested" if get_target("tpu7x").static_profile else "none: this libtpu's static profiler"
    assert rep["estimate_source"].startswith(why) and rep["estimated_seconds"] is None  # (the vLLM TPU set: docs/install.md)


# ---------------------------------------------------------------------- transformers, from the CLI
# The MoE checkpoint is the `full` tier: the dense one runs the same command (host devices made
# by the command, the checkpoint sharded, greedy tokens against transformers), and 4-device MoE
# steps are checked against the reference above (test_interpret_matches_reference_and_compiles).
@pytest.mark.parametrize("fixture", ["hf_qwen3_dir", pytest.param("hf_qwen3_moe_dir", marks=pytest.mark.full)])
def test_generate_devices_4_equals_transformers(fixture, request):
    """`tpumk generate --backend megakernel --devices 4` on transformers' own checkpoints (4 query
    heads, 2 KV heads: KV heads replicated on 4 devices) gives transformers' greedy tokens."""
    from hf_utils import hf_greedy

    ckpt = request.getfixturevalue(fixture)
    prompts = [[3, 17, 42, 7, 99], [250, 1, 64]]
    want = hf_greedy(ckpt, prompts, 6)
    got = generate_on_devices(ckpt, prompts, 6, 4)
    assert got["devices"] == 4 and "4 devices" in got["ran_on"]
    assert got["tokens"] == want


if __name__ == "__main__":
    print(json.dumps(_worker_many(sys.argv[1:])))
