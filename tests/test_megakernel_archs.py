"""Attention variants through the whole megakernel, against the pure-JAX reference: head_dim 64
(two kv heads per 128-lane block) and 256, and sliding-window layers (only the window's KV
tiles streamed). Interpret mode with the race detector on, and the same plans compiled
deviceless for TPU7x and v6e (tolerances as tests/test_megakernel.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from test_megakernel import CONTEXT, PAGE, SMALL_TILES, check_step, prompts_of
from tpumk.errors import PlanError
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

# (preset, overrides of its config)
MODELS = {
    "dense-d64": ("tiny-dense", dict(head_dim=64)),  # 4 q heads x 64 = 256, 2 kv heads = one block
    "moe-d64-g4": ("tiny-moe", dict(head_dim=64, num_q_heads=8, num_kv_heads=2)),
    "dense-d256": ("tiny-dense", dict(head_dim=256, num_q_heads=2, num_kv_heads=1)),
    # layer 1 slides a 12-token window; with 16-token pages and one page per KV tile, a query
    # at 40 needs keys 29..40: tiles 1 and 2 only
    "dense-w12": ("tiny-dense", dict(sliding_window=12, sliding_layers=[1])),
    "moe-d64-w20": ("tiny-moe", dict(head_dim=64, sliding_window=20, sliding_layers=[0, 1])),
}


@functools.lru_cache(maxsize=None)
def model(name: str, dtype: str):
    preset, overrides = MODELS[name]
    cfg = load_preset(preset)
    cfg = cfg.replace(name=f"{cfg.name}-{name}-{dtype}", dtype=dtype, **overrides)
    return cfg, random_params(cfg, seed=0)


@functools.lru_cache(maxsize=None)
def reference_step(cfg):
    return R.jitted_decode_step(cfg)


# (model, dtype, cache lengths before the step, q_len, tuning)
CASES = [
    ("dense-d64", "float32", [17, 40], 1, dict(ring_depth=3, kv_tile_pages=1, **SMALL_TILES)),
    ("moe-d64-g4", "bfloat16", [15, 33], 2, dict(kv_tile_pages=2)),
    ("dense-d256", "float32", [30], 2, dict(kv_tile_pages=1)),
    ("dense-w12", "float32", [40, 5, 23], 1, dict(kv_tile_pages=1, **SMALL_TILES)),
    ("dense-w12", "bfloat16", [47, 30], 2, dict(kv_tile_pages=1)),  # speculative verify (q = 2)
    ("moe-d64-w20", "float32", [44, 16], 2, dict(kv_tile_pages=1, kv_buffers=3)),
]


# moe-d64-w20 is the full tier: moe-d64-g4 runs 64-wide heads in a MoE model, dense-w12 the
# sliding window (q = 1 and the q = 2 verify).
@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c[0]}-{c[1]}-q{c[3]}",
                                               marks=[pytest.mark.full] if c[0] == "moe-d64-w20" else [])
                                  for c in CASES])
def test_step_matches_reference(case):
    name, dtype, lengths, q_len, knobs = case
    cfg, params = model(name, dtype)
    check_step(cfg, params, dtype, lengths, q_len, knobs)


def test_window_changes_the_output():
    """The window is not vacuous: the same weights without it give other logits."""
    cfg, params = model("dense-w12", "float32")
    full = cfg.replace(sliding_window=0, sliding_layers=[])
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of([40], cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tok, pos = jnp.asarray([[7]], jnp.int32), cache.lengths[:, None]
    a, _ = reference_step(cfg)(params, tok, pos, cache)
    b, _ = reference_step(full)(params, tok, pos, cache)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3


def test_plan_counts_only_the_window_tiles():
    """A sliding layer's KV bytes per step stop growing at the window; full layers' do not."""
    cfg, _ = model("dense-w12", "float32")
    cfg, full = cfg.replace(sliding_window=20), cfg.replace(sliding_window=0, sliding_layers=[])
    tuning = TuningConfig(kv_tile_pages=1)
    kv = {}
    for c in (cfg, full):
        for context in (64, 256):
            plan = make_plan(BuildSpec(c, get_target("tpu7x"), 1, context, tuning, page_size=PAGE))
            kv[c.sliding_window, context] = plan.hbm["kv_cache"]
    page = PAGE * cfg.kv_size * 4  # f32 page, K or V
    # Query at context - 1: full layers stream every page and patch the last one (read + write);
    # the sliding layer streams only the tiles holding keys context - 20 .. context - 1: the
    # last page but one from HBM, and the last (patched) page as a VMEM copy.
    for context in (64, 256):
        pages = context // PAGE
        full_layer = (pages - 1) + 2  # HBM tile pages + patch read + write-back
        sliding_layer = 1 + 2
        assert kv[0, context] == 2 * page * 2 * full_layer
        assert kv[20, context] == 2 * page * (full_layer + sliding_layer)


def test_head_dim_the_kernel_cannot_build_is_refused():
    cfg, _ = model("dense-d64", "float32")
    with pytest.raises(PlanError, match="head_dim = 96"):
        make_plan(BuildSpec(cfg.replace(head_dim=96, num_q_heads=8, num_kv_heads=4), get_target("tpu7x"), 1,
                            CONTEXT, page_size=PAGE))
    with pytest.raises(PlanError, match="num_kv_heads"):  # 64-wide kv heads go in pairs
        make_plan(BuildSpec(cfg.replace(num_q_heads=6, num_kv_heads=3, hidden_size=384),
                            get_target("tpu7x"), 1, CONTEXT, page_size=PAGE))


def test_plan_states_the_head_layout_and_counts_unpadded_kv():
    """64-wide heads are not padded: the cache and the plan's KV bytes are Hkv * 64 per token."""
    cfg, _ = model("moe-d64-w20", "float32")  # 2 kv heads x 64: one 128-lane block
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, CONTEXT, TuningConfig(kv_tile_pages=1), page_size=PAGE))
    assert plan.summary()["attention"] == {
        "head_dim": 64, "kv_heads": 2, "kv_heads_per_128_lanes": 2,
        "kv_cache_bytes_per_token_per_layer": 2 * 2 * 64 * 4, "sliding_window": 20, "sliding_layers": 2,
        "kv_tile_pages": 1, "kv_tile_tokens": PAGE, "kv_buffers": plan.attention.kv_buffers,
        "kv_knobs": {"kv_tile_pages": "fixed", "kv_buffers": "auto (plan: timeline model)"}}
    assert plan.attention.page_bytes == PAGE * 2 * 64 * 4
