"""The megakernel as a speculative verify step: q = 1, 4, 8 tokens per sequence vs the reference.

Each case runs in Pallas TPU interpret mode with the DMA race detector on and is compiled
deviceless for TPU7x (the q = 8 rollback case for v6e too; see tests/test_megakernel.py). The rollback cases
prefill q + 3 tokens more than the cache length they then declare: those rows hold K/V of
tokens that are no longer part of the sequence (what a rejected draft leaves behind), some of
them beyond every position the step writes. The step must neither read them (its logits equal
the reference's on a cache that never held them) nor touch the ones it does not overwrite.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_megakernel import (CONTEXT, PAGE, SMALL_TILES, assert_cache_equal, assert_logits_close, compile_for_tpus,
                             model, prompts_of, races_found, reference_step)

from tpumk.model import reference as R
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.plan.plan import make_plan
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec

# (id, preset, dtype, cache lengths before the step, q_len, stale rows past the lengths, knobs).
# Lengths put the q new tokens across a page boundary (16-token pages) in at least one sequence.
CASES = [
    ("dense-f32-q4-b2", "tiny-dense", "float32", [15, 30], 4, False, dict(ring_depth=3, kv_tile_pages=1)),
    ("dense-f32-q8-b2-rollback", "tiny-dense", "float32", [9, 40], 8, True, {}),
    ("moe-f32-q8-b2-rollback", "tiny-moe", "float32", [16, 33], 8, True, dict(kv_tile_pages=2)),
    # q = 1 after a rollback is what a draft model's step sees
    ("dense-bf16-q1-b2-rollback", "tiny-dense", "bfloat16", [15, 31], 1, True, dict(ring_depth=4, **SMALL_TILES)),
]


# The full tier: dense-f32-q4-b2 (q = 8 after a rollback: dense-f32-q8-b2-rollback) and
# moe-f32-q8-b2-rollback (the same verify step through MoE layers: test_megakernel_archs.py's
# moe-d64-g4-bfloat16-q2 against the reference, test_speculative.py's tiny-moe-draft-k3 end to end).
FULL = ("dense-f32-q4-b2", "moe-f32-q8-b2-rollback")


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0], marks=[pytest.mark.full] if c[0] in FULL else [])
                                  for c in CASES])
def test_verify_step_matches_reference(case):
    name, preset, dtype, lengths, q_len, stale, knobs = case
    cfg, params = model(preset, dtype)
    batch = len(lengths)
    tuning = TuningConfig(**knobs)
    ref = reference_step(cfg)
    prompts = prompts_of(lengths, cfg.vocab_size)
    _, clean = R.prefill(params, cfg, prompts, R.init_cache(cfg, batch, CONTEXT, PAGE), step_fn=ref)
    cache = clean
    if stale:  # a step writes q + 3 more tokens, then the lengths roll back as after a rejection
        extra = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len + 3)), jnp.int32)
        _, cache = ref(params, extra, clean.lengths[:, None] + jnp.arange(q_len + 3, dtype=jnp.int32)[None, :], clean)
        cache = cache._replace(lengths=clean.lengths)
        assert np.any(np.asarray(cache.k) != np.asarray(clean.k))  # the stale rows are really there
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]

    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE))
    step = make_decode_step(plan, detect_races=True)
    logits, new_cache = step(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want_logits, want_cache = ref(params, tokens, positions, cache)
    clean_logits, _ = ref(params, tokens, positions, clean)

    assert logits.shape == (batch, q_len, cfg.vocab_size)
    assert_logits_close(logits, want_logits, dtype)
    assert_logits_close(logits, clean_logits, dtype)  # stale rows are never read
    # the reference ignores them exactly (masked scores are -inf), not just to rounding
    np.testing.assert_array_equal(np.asarray(want_logits), np.asarray(clean_logits))
    assert_cache_equal(new_cache, want_cache, dtype)  # every row, stale ones included
    np.testing.assert_array_equal(np.asarray(new_cache.lengths), np.asarray(lengths) + q_len)
    if stale:  # rows past the new tokens are left exactly as they were
        for b, n in enumerate(lengths):
            table = np.asarray(cache.block_tables[b])
            for p in range(n + q_len, n + q_len + 3):
                pg, slot = table[p // PAGE], p % PAGE
                for got, before in ((new_cache.k, cache.k), (new_cache.v, cache.v)):
                    np.testing.assert_array_equal(np.asarray(got[:, pg, slot]), np.asarray(before[:, pg, slot]))
    compile_for_tpus(cfg, batch, q_len, tuning, v6e=q_len == 8)


# ---------------------------------------------------------------------- the build report's verify step
def test_verify_figures_from_the_plan():
    """qwen3-8b on TPU7x, batch 8: the verify step (q = 8) reads the same weights and KV once
    and writes 8x the K/V rows and logits, so its bytes sit a little above the plain step's; a
    verify plan that does not fit is reported, not raised."""
    from tpumk.build import verify_figures
    from tpumk.model.config import load_preset

    cfg = load_preset("qwen3-8b")
    plain = make_plan(BuildSpec(cfg, get_target("tpu7x"), batch=8, context=4096))
    v = verify_figures(plain, 8)
    want = make_plan(BuildSpec(cfg, get_target("tpu7x"), batch=8, context=4096, q_len=8))
    assert v["hbm_bytes_per_step"] == want.hbm_bytes and v["floor_seconds"] == want.floor_seconds
    assert 1.0 < v["hbm_bytes_vs_plain"] < 1.1 and v["floor_vs_plain"] == pytest.approx(v["hbm_bytes_vs_plain"])
    from estimate_support import COMPILER_ESTIMATE, NO_PROFILER

    assert v["estimated_seconds"] is None
    assert v["estimate_source"].startswith("none: not requested" if COMPILER_ESTIMATE else NO_PROFILER)
    # batch 16 with the 12-deep ring fixed: the plain step fits TPU7x VMEM, 16 x 8 verify rows do
    # not (the automatic depth would plan them with a shallower ring)
    big = verify_figures(make_plan(BuildSpec(cfg, get_target("tpu7x"), batch=16, context=1024,
                                             tuning=TuningConfig(ring_depth=12))), 8)
    assert big["error"].startswith("the verify step does not plan: plan does not fit tpu7x VMEM")


def test_cli_build_prints_the_verify_step():
    import json as _json

    from click.testing import CliRunner

    from tpumk.cli import main

    args = ["build", "--model", "tiny-dense", "--target", "v5e", "--context", "64", "--verify-q", "4"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "verify step (speculative decoding: q_len 4 = 3 drafts + 1" in r.output
    assert "x plain)" in r.output and "mean acceptance length" in r.output
    out = _json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)
    assert out["verify"]["q_len"] == 4 and out["verify"]["hbm_bytes_per_step"] > out["hbm_bytes_per_step"]
    r = CliRunner().invoke(main, ["build", "--model", "tiny-dense", "--target", "v5e", "--verify-q", "-1"])
    assert r.exit_code == 1 and "--verify-q: expected 0 (off)" in r.output


@pytest.mark.slow
def test_verify_estimate_from_a_second_profiling_compile():
    """--verify-estimate: the verify step gets the compiler's estimate (its own profiling
    process), never below its floor, and its ratio to the plain step's estimate."""
    import json as _json
    import subprocess

    from tpumk.child_process import command

    proc = subprocess.run([*command("tpumk.cli"), "build", "--model", "tiny-moe", "--dtype", "bfloat16",
                           "--batch", "2", "--context", "256", "--verify-q", "8", "--verify-estimate", "--json"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = _json.loads(proc.stdout)
    v = r["verify"]
    assert r["estimated_seconds"] is not None and v["estimated_seconds"] is not None
    assert v["estimated_cycles"] == v["compiler_cycles"] + v["nested_loop_cycles"]
    assert v["estimated_seconds"] >= v["floor_seconds"]
    assert v["estimate_vs_plain"] == pytest.approx(v["estimated_seconds"] / r["estimated_seconds"])
    assert "static profile" in v["estimate_source"]
