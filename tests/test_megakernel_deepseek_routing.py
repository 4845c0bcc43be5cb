"""DeepSeek-V3 routing in the megakernel (issue 15): a GQA MoE model routed the DeepSeek-V3 way
(sigmoid scores, a float32 router with the selection-only correction bias, 4 expert groups of
which 2 are kept, a scaling factor, a shared expert) against the reference, in interpret mode
with the race detector, and compiled deviceless for TPU7x in the same test. Tolerances
and helpers as tests/test_megakernel.py. (MLA models in the megakernel: tests/test_megakernel_mla.py.)
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from test_megakernel import (CONTEXT, PAGE, SMALL_TILES, assert_cache_equal, assert_logits_close, compile_for_tpus,
                             prompts_of, races_found, reference_step)
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

DEEPSEEK_ROUTING = dict(router_scoring="sigmoid", router_groups=4, router_topk_groups=2, router_correction_bias=True,
                        routed_scaling_factor=2.5)


@functools.lru_cache(maxsize=None)
def model(dtype: str):
    cfg = load_preset("tiny-moe").replace(name=f"tiny-moe-deepseek-routing-{dtype}", dtype=dtype, **DEEPSEEK_ROUTING)
    params = random_params(cfg, seed=4)
    assert params["layers"][1]["router"].dtype == jnp.float32 and "router_bias" in params["layers"][1]
    return cfg, params


# Both cases are the full tier: the MoE stage routes the same way in the megakernel in
# test_megakernel_mla.py::test_step_matches_reference ([f32-b2-q1] and the [bf16-b2-q3] verify
# step: tiny-mla routes DeepSeek's way) and test_moe_stage.py's deepseek cases; the GQA attention
# around it runs in tests/test_megakernel.py.
@pytest.mark.full
@pytest.mark.parametrize("dtype, lengths, q_len, knobs", [
    pytest.param("float32", [15, 16, 33, 47], 1, {}, id="f32-b4-q1"),
    pytest.param("bfloat16", [16, 31], 3, dict(ring_depth=3, expert_slots=2, expert_chunk=128, **SMALL_TILES),
                 id="bf16-b2-q3"),  # verify step
])
def test_step_matches_reference(dtype, lengths, q_len, knobs):
    cfg, params = model(dtype)
    batch, tuning = len(lengths), TuningConfig(**knobs)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE))
    assert plan.moe.correction_bias and plan.moe.groups == 4 and plan.moe.router_rows == cfg.hidden_size + 8
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of(lengths, cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]

    logits, new_cache = make_decode_step(plan, detect_races=True)(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want_logits, want_cache = reference_step(cfg)(params, tokens, positions, cache)
    assert_logits_close(logits, want_logits, dtype)
    assert_cache_equal(new_cache, want_cache, dtype)
    # the same weights routed without the DeepSeek pieces give other logits: the check above can fail
    plain = cfg.replace(router_groups=1, router_topk_groups=1, routed_scaling_factor=1.0)
    other, _ = R.jitted_decode_step(plain)(params, tokens, positions, cache)
    assert float(jnp.max(jnp.abs(other - want_logits))) > 0.05 * float(jnp.max(jnp.abs(want_logits)))
    compile_for_tpus(cfg, batch, q_len, tuning)


def test_plan_counts_the_float32_router_and_bias():
    cfg, _ = model("bfloat16")
    plain = make_plan(BuildSpec(load_preset("tiny-moe").replace(dtype="bfloat16"), get_target("tpu7x"), 1, 4096))
    ds = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 4096))
    h, ep = cfg.hidden_size, 128
    assert ds.moe.router_bytes == (h + 8) * ep * 4 and plain.moe.router_bytes == h * ep * 2
    assert ds.hbm["experts_and_router"] - plain.hbm["experts_and_router"] == pytest.approx(
        ds.moe.num_moe_layers * (ds.moe.router_bytes - plain.moe.router_bytes))
