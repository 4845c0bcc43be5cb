"""The whole decode step as one pallas_call, against the pure-JAX reference.

Every configuration runs in Pallas TPU interpret mode with the DMA race detector on, AND is
compiled deviceless for TPU7x in the same test (interpret mode does not check TPU layout rules;
the compiler does); the cases in V6E compile for v6e as well, one of each kernel family (the
other files name theirs: a v6e compile is the same Mosaic lowering for another chip's VMEM). Cache lengths are chosen to cross page (16 tokens) and KV-tile
boundaries. Tolerances:
- float32 weights: logits within 1e-5 relative to the logit scale (f32 rounding: the kernel
  sums K in tile order, the reference in one dot);
- bfloat16 weights: within BF16_LOGIT_BOUND x the logit scale. Both sides round every matmul
  input to bf16 and accumulate in f32; they differ in f32 summation order and in where the
  attention probabilities are rounded to bf16 (the online softmax rounds unnormalised p, the
  reference normalised p), i.e. relative perturbations of ~2^-9 per rounding that propagate
  through the layers. Measured: 2^-8 of the scale (one bf16 ulp at the largest logit); the
  bound 2^-6 is 4 ulps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.model import reference as R
from tpumk.compile.aot import compile_for
from tpumk.model.config import load_preset
from tpumk.errors import PlanError
from tpumk.kernel.layout import pack_weights, packed_specs
from tpumk.kernel.megakernel import make_decode_step, step_specs
from tpumk.plan.padding import pad_cache, unpad_cache
from tpumk.plan.plan import make_plan
from tpumk.compat import interpret_races
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.model.weights import random_params
from tpumk.plan.spec import BuildSpec

CONTEXT, PAGE = 64, 16
BF16_LOGIT_BOUND = 2.0 ** -6

SMALL_TILES = dict(qkv_tile_cols=256, o_tile_cols=128, gate_up_tile_cols=256, down_tile_rows=256, down_tile_cols=128,
                   shared_gate_up_tile_cols=256, shared_down_tile_cols=128, lm_head_tile_cols=128)
MIXED_TILES = dict(qkv_tile_rows=128, qkv_tile_cols=512, o_tile_cols=256, gate_up_tile_cols=512, down_tile_rows=512,
                   down_tile_cols=128, shared_gate_up_tile_rows=128, shared_down_tile_cols=256, lm_head_tile_cols=256)

# (id, preset, dtype, prompt lengths (= cache lengths before the step), q_len, tuning knobs).
# FULL cases are the full tier: moe-f32-default-b4 (MoE at batch 4: moe-bf16-small-b4; float32
# MoE: moe-f32-depth3-b1; the default knobs: every test that builds without knobs, e.g.
# test_multidevice.py's cases and test_hf_archs.py's greedy runs), dense-f32-default-b8 (batch 8
# with cache lengths on both sides of page boundaries: test_attention_stage.py's
# f32-b8-q1-t2-n2-g8 in the stage; a batch-4 step: moe-bf16-small-b4; the default knobs as
# above; tiny-dense compiled for v6e: dense-f32-depth2-b1-tied), dense-f32-mixed-b4 and dense-bf16-mixed-b4 (MIXED_TILES:
# moe-f32-depth3-b1; bfloat16 dense layers: moe-bf16-small-b4's layer 0) and dense-f32-q2-b2
# (q = 2: test_megakernel_archs.py's dense-lanes-float32-q2 and dense-d256-float32-q2).
FULL = ("moe-f32-default-b4", "dense-f32-mixed-b4", "dense-bf16-mixed-b4", "dense-f32-q2-b2", "dense-f32-default-b8")
CASES = [
    ("dense-f32-depth2-b1-tied", "tiny-dense", "float32", [17], 1,
     dict(ring_depth=2, kv_tile_pages=1, kv_buffers=2, **SMALL_TILES)),
    ("dense-f32-mixed-b4", "tiny-dense", "float32", [15, 16, 31, 40], 1,
     dict(ring_depth=5, kv_tile_pages=2, kv_buffers=3, **MIXED_TILES)),
    ("dense-f32-default-b8", "tiny-dense", "float32", [1, 7, 15, 16, 17, 31, 32, 47], 1, {}),
    ("dense-f32-q2-b2", "tiny-dense", "float32", [15, 30], 2, dict(ring_depth=3, kv_tile_pages=1, **SMALL_TILES)),
    ("moe-f32-default-b4", "tiny-moe", "float32", [15, 16, 33, 47], 1, {}),
    ("moe-f32-depth3-b1", "tiny-moe", "float32", [32], 1,
     dict(ring_depth=3, expert_slots=2, expert_chunk=128, kv_tile_pages=3, **MIXED_TILES)),
    ("dense-bf16-mixed-b4", "tiny-dense", "bfloat16", [15, 16, 31, 40], 1,
     dict(ring_depth=4, kv_tile_pages=2, **MIXED_TILES)),
    ("moe-bf16-small-b4", "tiny-moe", "bfloat16", [16, 17, 32, 48], 1, dict(ring_depth=6, **SMALL_TILES)),
]


@functools.lru_cache(maxsize=None)
def model(preset: str, dtype: str, tied: bool = False):
    cfg = load_preset(preset)
    if dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype, name=f"{cfg.name}-{dtype}")
    if tied:
        cfg = cfg.replace(tie_embeddings=True, name=f"{cfg.name}-tied")
    return cfg, random_params(cfg, seed=0)


@functools.lru_cache(maxsize=None)
def reference_step(cfg):
    """One jitted reference step per model, shared by every test (compiles once per shape)."""
    return R.jitted_decode_step(cfg)


def prompts_of(lengths, vocab, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def races_found() -> bool:
    races = interpret_races()
    return bool(races is not None and races.races_found)


def assert_logits_close(got, want, dtype):
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.max(np.abs(want)))
    tol = 1e-5 if dtype == "float32" else BF16_LOGIT_BOUND
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, f"max |logits - reference| = {err:.3g} > {tol:.3g} x scale {scale:.3g}"


def assert_cache_equal(got: R.KVCache, want: R.KVCache, dtype):
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    np.testing.assert_array_equal(np.asarray(got.block_tables), np.asarray(want.block_tables))
    for name in ("k", "v"):
        a = np.asarray(getattr(got, name), np.float32)
        b = np.asarray(getattr(want, name), np.float32)
        if dtype == "float32":
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
        else:  # new rows may differ by bf16 rounding of slightly different f32 values
            np.testing.assert_allclose(a, b, rtol=2 ** -6, atol=2 ** -6, err_msg=name)
        untouched = np.all(b == 0, axis=-1)  # slots no one wrote stay exactly zero
        assert np.all(a[untouched] == 0), name


# Compiled for v6e too: the dense and the MoE model at batch 4-8 with their default or small tiles.
V6E = ("dense-f32-depth2-b1-tied", "moe-bf16-small-b4")


# Cases whose step also writes hidden-state taps (issue 56): out of layer order, the final norm's
# output among them (tap num_layers), checked against the reference's taps.
TAPS = {"dense-f32-depth2-b1-tied": (2, 0), "moe-bf16-small-b4": (1, 3, 0)}


@functools.lru_cache(maxsize=None)  # shared with tests/test_kv_guard.py (same builds)
def compile_for_tpus(cfg, batch, q_len, tuning, v6e: bool = False, taps: tuple[int, ...] = ()):
    """One tpu_custom_call, compiled deviceless for TPU7x (and v6e with `v6e`)."""
    for target in ("tpu7x", "v6e") if v6e else ("tpu7x",):
        plan = make_plan(BuildSpec(cfg, get_target(target), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE,
                                   taps=taps))
        compiled = compile_for(make_decode_step(plan), step_specs(plan), get_target(target))
        assert compiled.custom_calls == 1, f"{target}: expected exactly one tpu_custom_call"
        assert "tpu_custom_call" in compiled.hlo_text


def check_step(cfg, params, dtype: str, lengths: list[int], q_len: int, knobs: dict, v6e: bool = False,
               taps: tuple[int, ...] = ()) -> None:
    """One megakernel step after a reference prefill of `lengths`-token prompts, in interpret
    mode with the race detector, against the reference step (logits and cache, and the tapped
    hidden states with `taps`); then the same build compiled deviceless for the TPU targets."""
    batch = len(lengths)
    tuning = TuningConfig(**knobs)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE,
                               taps=taps))
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of(lengths, cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]

    step = make_decode_step(plan, detect_races=True)
    if plan.unpadded is not None:  # widths off the lane grid: the kernel runs the zero-padded copy
        logits, wide, *got_taps = step(pack_weights(plan, params), tokens, positions, pad_cache(cfg, plan.cfg, cache))
        new_cache = unpad_cache(cfg, plan.cfg, wide)
        again = pad_cache(cfg, plan.cfg, new_cache)  # every padding lane of the written cache is still zero
        assert np.array_equal(np.asarray(again.k), np.asarray(wide.k)) and \
            np.array_equal(np.asarray(again.v), np.asarray(wide.v)), "nonzero cache padding lanes"
    else:
        logits, new_cache, *got_taps = step(pack_weights(plan, params), tokens, positions, cache)
    got_taps = got_taps[0] if taps else None
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want_logits, want_cache = reference_step(cfg)(params, tokens, positions, cache)
    if taps:
        _, _, want_taps = R.jitted_decode_step(cfg, taps)(params, tokens, positions, cache)
        assert got_taps.shape == (batch, q_len, len(taps), cfg.hidden_size) and got_taps.dtype == want_taps.dtype
        assert_logits_close(got_taps, want_taps, dtype)  # the residual, rounded to the model dtype

    assert logits.shape == (batch, q_len, cfg.vocab_size) and logits.dtype == jnp.float32
    assert_logits_close(logits, want_logits, dtype)
    assert_cache_equal(new_cache, want_cache, dtype)
    compile_for_tpus(cfg, batch, q_len, tuning, v6e, taps)


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=pytest.mark.full) if c[0] in FULL
                                  else pytest.param(c, id=c[0]) for c in CASES])
def test_step_matches_reference(case):
    name, preset, dtype, lengths, q_len, knobs = case
    cfg, params = model(preset, dtype, tied=name.endswith("-tied"))
    check_step(cfg, params, dtype, lengths, q_len, knobs, v6e=name in V6E, taps=TAPS.get(name, ()))


# The full tier: greedy megakernel decoding over many steps runs in the default run through
# test_hf_archs.py (every checkpoint family's greedy tokens, the cache carried from step to step).
@pytest.mark.full
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_greedy_16_steps_match_reference(preset):
    """Prefill with the reference, then 15 megakernel steps: the 16 greedy tokens and the final
    cache equal the reference's own greedy run."""
    cfg, params = model(preset, "float32")
    prompts = prompts_of([17, 5], cfg.vocab_size, seed=11)
    want_tokens, want_cache = R.greedy_generate(params, cfg, prompts, 16, R.init_cache(cfg, 2, CONTEXT, PAGE),
                                                step_fn=reference_step(cfg))

    tuning = TuningConfig(ring_depth=4, **SMALL_TILES)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, CONTEXT, tuning, page_size=PAGE))
    step = make_decode_step(plan, detect_races=True)
    packed = pack_weights(plan, params)
    last, cache = R.prefill(params, cfg, prompts, R.init_cache(cfg, 2, CONTEXT, PAGE), step_fn=reference_step(cfg))
    nxt = jnp.argmax(last, -1).astype(jnp.int32)
    got: list[list[int]] = [[int(t)] for t in nxt]
    for _ in range(15):
        logits, cache = step(packed, nxt[:, None], cache.lengths[:, None], cache)
        nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        for b, t in enumerate(np.asarray(nxt)):
            got[b].append(int(t))
    assert not races_found()
    assert got == want_tokens
    assert_cache_equal(cache, want_cache, "float32")


@pytest.mark.parametrize("preset, dtype, tied", [("tiny-dense", "float32", True), ("tiny-moe", "bfloat16", False)])
def test_packed_specs_describe_pack_weights(preset, dtype, tied):
    """The AOT shapes equal the packed weights', and packing from (cfg, tuning) equals packing from the plan."""
    cfg, params = model(preset, dtype, tied)
    tuning = TuningConfig(**MIXED_TILES)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, CONTEXT, tuning, page_size=PAGE))
    packed = pack_weights(plan, params)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), packed)
    assert shapes == jax.tree.map(lambda s: (s.shape, s.dtype), packed_specs(plan))
    again = pack_weights(cfg, params, tuning)
    # numpy's comparison: no compiled program per leaf shape (jnp.array_equal's two)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), packed, again))


def test_step_rejects_a_batch_it_was_not_planned_for():
    cfg, params = model("tiny-dense", "float32")
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, CONTEXT, page_size=PAGE))
    step = make_decode_step(plan)
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    with pytest.raises(ValueError, match="planned for tokens"):
        step(pack_weights(plan, params), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache)


# ---------------------------------------------------------------------- full-size presets (slow)
PRESET_BUILDS = [("qwen3-8b", "tpu7x"), ("qwen3-32b", "tpu7x"), ("qwen3-30b-a3b", "tpu7x"), ("qwen3-8b", "v6e"),
                 ("llama-3.2-1b", "v6e"), ("llama-3.1-8b", "tpu7x"), ("mistral-7b", "tpu7x"), ("qwen2.5-7b", "tpu7x"),
                 ("phi-3-mini", "tpu7x")]


@pytest.mark.slow
@pytest.mark.parametrize("preset, target", PRESET_BUILDS)
@pytest.mark.parametrize("batch", [1, 8])
def test_preset_builds_deviceless(preset, target, batch):
    cfg = load_preset(preset)
    plan = make_plan(BuildSpec(cfg, get_target(target), batch, 4096))
    compiled = compile_for(make_decode_step(plan, donate_cache=True), step_specs(plan), get_target(target))
    assert compiled.custom_calls == 1


@pytest.mark.slow
def test_llama_3_1_70b_on_8_tpu7x_devices_with_int8_weights_is_one_kernel():
    """The issue's bar: `tpumk build --model llama-3.1-70b --target tpu7x --devices 8 --quant int8`."""
    from tpumk.compile.aot import compile_plan

    plan = make_plan(BuildSpec(load_preset("llama-3.1-70b"), get_target("tpu7x"), devices=8, quant="int8"))
    c = compile_plan(plan)
    assert c.custom_calls == 1 and c.xla_collectives == 0


@pytest.mark.parametrize("preset", ["qwen3-32b", "qwen3-30b-a3b"])
def test_presets_too_big_for_v6e_are_rejected_before_compiling(preset):
    with pytest.raises(PlanError, match="does not fit one v6e device"):
        make_plan(BuildSpec(load_preset(preset), get_target("v6e"), 1, 4096))
