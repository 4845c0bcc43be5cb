"""MLA attention in the megakernel (issue 15): the absorbed decode step over the paged latent
cache (tpumk.kernel.mla_attention, the MLA families of the ring) against the reference
(tpumk.model.mla) in interpret mode with the race detector, for f32 and bf16, q_len 1 and the
verify step's q_len 3, each build also compiled deviceless for TPU7x (the bf16 verify step for v6e too); greedy tokens of a
tiny transformers DeepseekV3ForCausalLM through the megakernel equal transformers' and the
reference's; the builds MLA does not have yet are refused with one line (quantized MLA weights:
tests/test_megakernel_mla_quant.py).

The megakernel needs the hidden size and the expert width in whole 128-lane tiles, so these
models are tiny-mla / the tests' DeepSeek-V3 config with hidden 128 and experts 128 wide (the
MLA widths themselves stay odd: q_lora 56, latent 40, nope 24, rope 8, value 20).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from hf_utils import build_deepseek_checkpoint, hf_greedy
from test_megakernel import (CONTEXT, PAGE, assert_cache_equal, assert_logits_close, compile_for_tpus, prompts_of,
                             races_found, reference_step)
from tpumk.errors import PlanError
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.geometry import MLAGeometry
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

ALIGNED = dict(hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128)


@functools.lru_cache(maxsize=None)
def model(dtype: str, q_lora: bool = True):
    cfg = load_preset("tiny-mla").replace(name=f"tiny-mla-128-{dtype}", dtype=dtype, **ALIGNED,
                                          **({} if q_lora else dict(q_lora_rank=0)))
    return cfg, random_params(cfg, seed=2)


# f32-b2-q1 is the full tier: test_kv_guard.py's [mla] runs the same build (float32, q-LoRA,
# batch 2, q = 1, default knobs) against the reference step, logits within 1e-5 of the scale
# and the cache within 1e-5, and compiles it deviceless for TPU7x. So is bf16-b2-q3:
# test_megakernel_mla_quant.py's fp8b128-bf16-b2-q3 runs the same model, shapes and verify step
# (its weights block-quantized) and test_multidevice_mla.py's mla-2dev-bf16-verify the bfloat16
# verify step on 2 devices.
@pytest.mark.parametrize("dtype, lengths, q_len, q_lora, knobs", [
    pytest.param("float32", [15, 33], 1, True, {}, marks=pytest.mark.full),
    pytest.param("bfloat16", [16, 31], 3, True, dict(ring_depth=3, kv_tile_pages=1), marks=pytest.mark.full),
    ("float32", [7], 3, False, dict(kv_buffers=3)),  # a plain q projection (q_lora_rank 0)
], ids=["f32-b2-q1", "bf16-b2-q3", "f32-noqlora-b1-q3"])
def test_step_matches_reference(dtype, lengths, q_len, q_lora, knobs):
    cfg, params = model(dtype, q_lora)
    batch, tuning = len(lengths), TuningConfig(**knobs)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE))
    assert isinstance(plan.attention, MLAGeometry) and plan.families["uk"].diagonal
    assert ("q_a" in plan.families) == q_lora and "qkv" not in plan.families
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of(lengths, cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]

    logits, new_cache = make_decode_step(plan, detect_races=True)(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want_logits, want_cache = reference_step(cfg)(params, tokens, positions, cache)
    assert logits.shape == (batch, q_len, cfg.vocab_size)
    assert_logits_close(logits, want_logits, dtype)
    assert_cache_equal(new_cache, want_cache, dtype)  # the new latent rows landed in their pages
    assert new_cache.v.shape[-1] == 0
    # the step did attend to the cache: without the cached rows the logits change
    empty = R.KVCache(jnp.zeros_like(cache.k), cache.v, cache.block_tables, cache.lengths)
    other, _ = reference_step(cfg)(params, tokens, positions, empty)
    assert float(jnp.max(jnp.abs(other - want_logits))) > 0.05 * float(jnp.max(jnp.abs(want_logits)))
    compile_for_tpus(cfg, batch, q_len, tuning, v6e=dtype == "bfloat16")


TALL = dict(name="tiny-mla-tall", dtype="float32", hidden_size=256, kv_lora_rank=136, expert_ffn_size=128,
            shared_expert_ffn_size=128, num_layers=2)


def _tall_plan():
    """Hidden 256 and a 136-wide latent (padded to 256): the plan's tiles, checked."""
    cfg = load_preset("tiny-mla").replace(**TALL)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 1, CONTEXT, TuningConfig(), page_size=PAGE))
    fam = plan.families
    assert plan.slot_rows == 256 and fam["uv"].tile_rows == 256
    assert [fam[f].tile_rows for f in ("q_a", "kv_a", "gate_up", "lm_head")] == [256] * 4
    assert fam["shared_down"].tile_rows == 128  # its K is 128
    assert all(f.tile_rows * f.tile_cols <= plan.slot_rows * plan.slot_cols for f in fam.values())
    return cfg, plan


def test_mla_tiles_as_tall_as_the_ring_slot_by_the_plan():
    """The ring's slot is as tall as the latent (W_UV's blocks); an auto family whose K allows
    it takes tiles that tall, not the 128 rows the shared-down width would impose on every
    family: hidden 256 and a 136-wide latent (padded to 256) make q_a, kv_a, gate_up and the
    lm_head 256 rows high in a 256-row slot."""
    _tall_plan()


@pytest.mark.full  # 31 s on a loaded host; tests/README.md: what covers it in the default run
def test_mla_tiles_as_tall_as_the_ring_slot():
    """The tall tiles above through the kernel: the step against the reference in interpret
    mode, then compiled deviceless for TPU7x."""
    cfg, plan = _tall_plan()
    params = random_params(cfg, seed=4)
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of([21], cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tokens = jnp.asarray([[11]], jnp.int32)
    positions = cache.lengths[:, None]
    logits, new_cache = make_decode_step(plan, detect_races=True)(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want_logits, want_cache = reference_step(cfg)(params, tokens, positions, cache)
    assert_logits_close(logits, want_logits, "float32")
    assert_cache_equal(new_cache, want_cache, "float32")
    compile_for_tpus(cfg, 1, 1, TuningConfig())


def test_plan_counts_the_latent_cache():
    cfg, _ = model("bfloat16")
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 2, 4096))
    a = plan.attention
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    stored = -(-width // 128) * 128  # each row lane-padded (48 -> 128), as the TPU lays it out in HBM
    assert a.caches == 1 and a.kv_size == width and a.page_lanes == stored == cfg.attention.latent_cache_lanes
    assert a.page_bytes == plan.page_size * stored * 2
    # one cache: every page the step reads or writes counted once (no V)
    assert plan.hbm["kv_cache"] == a.hbm_bytes([4096 - 1] * 2)
    pages = (4096 // plan.page_size) * 2  # both sequences read every page of their context
    assert plan.hbm["kv_cache"] >= cfg.num_layers * pages * a.page_bytes
    assert plan.hbm["kv_cache"] < 2 * cfg.num_layers * pages * a.page_bytes
    assert plan.dmas["kv_cache_pages"]["bytes_each"] == a.page_bytes
    s = plan.summary()["attention"]
    assert s["kv_cache_bytes_per_token_per_layer"] == stored * 2 and s["latent_cache"]["c_kv"] == cfg.kv_lora_rank
    assert "k_cache" in [b.name for b in plan.contract.operands]
    assert "v_cache" not in [b.name for b in plan.contract.operands]
    from tpumk.estimate.timeline import megakernel_step
    step = megakernel_step(plan)  # tpumk's timeline model walks the MLA families and the one cache
    assert step.seconds > 0 and step.hbm_bytes >= plan.hbm["kv_cache"]


def test_unaligned_hidden_is_refused_with_one_line():
    with pytest.raises(PlanError, match="hidden_size = 96: an MLA model's hidden size must be a multiple of 128") as e:
        make_plan(BuildSpec(load_preset("tiny-mla").replace(hidden_size=96), get_target("tpu7x"), 1, 4096))
    assert "\n" not in str(e.value)


def test_greedy_deepseek_checkpoint_through_the_megakernel(tmp_path):
    """A transformers DeepseekV3ForCausalLM (YaRN, interleaved RoPE, q-LoRA, group-limited routing
    with a correction bias; hidden and experts 128 wide) generates the same greedy tokens through
    the megakernel as through transformers and the reference."""
    from tpumk.decode.generate import generate, load_model

    ckpt = build_deepseek_checkpoint(tmp_path / "ds", seed=3, hidden_size=128, moe_intermediate_size=128)
    prompts, steps = [[3, 17, 42, 7, 99], [250, 1, 64]], 6
    want = hf_greedy(ckpt, prompts, steps)
    m = load_model(None, str(ckpt))
    got = generate(m, prompts, steps, backend="megakernel")
    assert "megakernel" in got["ran_on"]
    assert got["tokens"] == want
    assert generate(m, prompts, steps, backend="reference")["tokens"] == want
    compile_for_tpus(m.cfg, 2, 1, TuningConfig())
