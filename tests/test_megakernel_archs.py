"""Attention variants through the whole megakernel, against the pure-JAX reference: head_dim 64
(two kv heads per 128-lane block) and 256, and sliding-window layers (only the window's KV
tiles streamed); and Gemma 2 and 3's parts (GeGLU, the embedding factor, post-sublayer norms,
their score scale, soft-capped scores and logits, the sliding layers' own RoPE theta), and
OLMo 2's (norms only after the sublayers, QK-norm across all heads), and Cohere's (LayerNorm,
parallel attention and MLP). Interpret mode with the race detector on, and the same plans compiled
deviceless for TPU7x, the head layouts in V6E for v6e too (tolerances as tests/test_megakernel.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from test_megakernel import CONTEXT, PAGE, SMALL_TILES, check_step, prompts_of
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.padding import pad_cache, pad_params, unpad_cache
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

# (preset, overrides of its config)
MODELS = {
    "dense-d64": ("tiny-dense", dict(head_dim=64)),  # 4 q heads x 64 = 256, 2 kv heads = one block
    # with Qwen2-MoE's gate on the shared expert (sigmoid(x . w) from router column E)
    "moe-d64-g4": ("tiny-moe", dict(head_dim=64, num_q_heads=8, num_kv_heads=2, shared_expert_gate=True)),
    "dense-d256": ("tiny-dense", dict(head_dim=256, num_q_heads=2, num_kv_heads=1)),
    # a DFlash drafter's block (issue 56): the step's 4 tokens see each other in any order, the
    # cached keys causally
    "dense-block": ("tiny-dense", dict(step_bidirectional=True)),
    # layer 1 slides a 12-token window; with 16-token pages and one page per KV tile, a query
    # at 40 needs keys 29..40: tiles 1 and 2 only
    "dense-w12": ("tiny-dense", dict(sliding_window=12, sliding_layers=[1])),
    "moe-d64-w20": ("tiny-moe", dict(head_dim=64, sliding_window=20, sliding_layers=[0, 1])),
    # SmolLM2's shape in small: hidden 192 and one 64-wide kv head (3 q heads) are off the
    # 128-lane grid, so the kernel runs the lane-padded copy (hidden 256, 2 kv / 6 q heads);
    # RoPE on 48 of each head's 64 lanes (partial rotary: 8 lanes of each half unturned)
    "dense-lanes": ("tiny-dense", dict(hidden_size=192, head_dim=64, num_q_heads=3, num_kv_heads=1, ffn_size=200,
                                       vocab_size=500, rotary_dim=48)),
    # 96-wide heads with QK-norm run 128 wide: [q1 0 q2 0] per head, norm and scale over 96
    "dense-d96": ("tiny-dense", dict(hidden_size=192, head_dim=96, num_q_heads=4, num_kv_heads=2, ffn_size=200)),
    # Gemma 2 and 3 in small, on padded widths: GeGLU (tanh GELU), embeddings x 13.9, per-head
    # QK-norm on 96-wide heads run 128 wide (as dense-d96), each sublayer's output normalized
    # before the residual (post_norms), scores / sqrt(48) rather than sqrt(96) and soft-capped
    # at 2, logits soft-capped at 3, and layer 0 sliding a 12-token window with its own RoPE
    # theta (as dense-w12: a query at 40 needs KV tiles 1 and 2 only)
    # (and Gemma's attention_bias: q, k, v and o biases, o's normalized with attention's output)
    "dense-gemma": ("tiny-dense", dict(hidden_size=192, head_dim=96, num_q_heads=3, num_kv_heads=1, ffn_size=200,
                                       qkv_bias=True, o_bias=True,
                                       mlp_act="gelu_tanh", embed_scale=192 ** 0.5, post_norms=True,
                                       attn_scalar=48.0, sliding_window=12, sliding_layers=[0],
                                       rope_local_theta=10000.0, attn_softcap=2.0, final_softcap=3.0)),
    # OLMo 2 in small, on padded widths: no norm before the sublayers, one after each, and q / k
    # normalized across all heads (4 q / 2 kv heads of 96, run 128 wide: the norm's divisor is
    # the true 384 / 192 lanes); RoPE on 64 of the 96 lanes (GLM-4.5's partial rotary on a
    # padded head: each 64-lane half is 32 turned, 16 unturned, 16 zero)
    "dense-olmo2": ("tiny-dense", dict(hidden_size=192, head_dim=96, num_q_heads=4, num_kv_heads=2, ffn_size=200,
                                       pre_norms=False, post_norms=True, qk_norm_whole=True, rotary_dim=64)),
    # Cohere in small, on padded widths: LayerNorm without bias (mean and variance over the true
    # 192 lanes), attention and the MLP reading one normed input, both added to the residual
    "dense-cohere": ("tiny-dense", dict(hidden_size=192, head_dim=64, num_q_heads=3, num_kv_heads=1, ffn_size=200,
                                        qk_norm=False, norm_kind="layer", parallel_blocks=True)),
    # gpt-oss's attention: sinks, one logit per q head in each softmax's denominator, on 64-wide
    # heads (two kv heads per lane block: a block's rows hold 8 q heads, each row its own sink),
    # biases on q, k, v and o (o's added to the residual after the o projection), alternating
    # sliding (layer 0, 20 tokens) and full layers
    "dense-sinks": ("tiny-dense", dict(head_dim=64, num_q_heads=8, num_kv_heads=2, attn_sinks=True,
                                       qkv_bias=True, o_bias=True, sliding_window=20, sliding_layers=[0])),
    # gpt-oss in small: its attention as dense-sinks on a lane-padded hidden size (192 -> 256),
    # and its experts: a bias on the router's logits (before the softmax over the top 2 of 8),
    # biases on each expert's gate, up and down outputs, and the clamped SwiGLU (alpha 1.702, a
    # limit of 1 so the clamps bite), on a width off the lane grid (200 -> 256: zero columns)
    "moe-gpt-oss": ("tiny-moe", dict(num_layers=2, hidden_size=192, head_dim=64, num_q_heads=8, num_kv_heads=2,
                                     ffn_size=0, dense_layers=[], num_shared_experts=0, shared_expert_ffn_size=0,
                                     qk_norm=False, attn_sinks=True, qkv_bias=True, o_bias=True,
                                     sliding_window=20, sliding_layers=[0], expert_ffn_size=200,
                                     router_logit_bias=True, expert_bias=True, swiglu_limit=1.0,
                                     swiglu_alpha=1.702)),
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
    ("dense-block", "float32", [17, 5], 4, dict(kv_tile_pages=1)),
    ("dense-w12", "float32", [40, 5, 23], 1, dict(kv_tile_pages=1, **SMALL_TILES)),
    ("dense-w12", "bfloat16", [47, 30], 2, dict(kv_tile_pages=1)),  # speculative verify (q = 2)
    ("moe-d64-w20", "float32", [44, 16], 2, dict(kv_tile_pages=1, kv_buffers=3)),
    ("dense-lanes", "float32", [17, 40], 2, dict(kv_tile_pages=1)),
    ("dense-d96", "float32", [9, 33], 1, dict(kv_tile_pages=1)),
    # float32: silu for GeGLU would be 0.6 % of the logit scale off, a bfloat16 bound allows 1.6 %
    ("dense-gemma", "float32", [40, 5, 23], 1, dict(kv_tile_pages=1)),
    ("dense-olmo2", "float32", [9, 26], 1, dict(kv_tile_pages=1)),
    ("dense-cohere", "float32", [12, 35], 1, dict(kv_tile_pages=1)),
    ("dense-sinks", "float32", [17, 44], 2, dict(kv_tile_pages=1)),  # q = 2: rows of 2 tokens per head
    # two chunks of 128 expert columns, two slots: the gate|up biases ride with each chunk
    ("moe-gpt-oss", "float32", [17, 44], 1, dict(kv_tile_pages=1, expert_chunk=128, expert_slots=2)),
    ("moe-gpt-oss", "bfloat16", [23, 9], 2, dict(kv_tile_pages=1)),
]


# The full tier: moe-d64-w20 (moe-d64-g4 runs 64-wide heads in a MoE model, dense-w12 the
# sliding window), dense-d64 (64-wide heads, two per 128-lane block: moe-d64-g4 and dense-lanes)
# dense-w12 (a window on one layer of two: dense-gemma's layer 0, the same 12-token window and
# cache lengths; bfloat16 at q = 2: moe-d64-g4; a window on every layer: test_hf_archs.py's
# phi3-partial) and dense-d96 (96-wide heads with per-head QK-norm run 128 wide: dense-gemma's;
# across all heads: dense-olmo2's).
# Compiled for v6e too: two 64-wide heads per lane block, lane-padded widths, Gemma's parts.
V6E = ("moe-d64-g4", "dense-lanes", "dense-gemma", "dense-olmo2", "dense-cohere", "dense-sinks", "moe-gpt-oss")
FULL = {("moe-d64-w20", "float32"), ("dense-d64", "float32"), ("dense-w12", "bfloat16"), ("dense-w12", "float32"),
        ("dense-d96", "float32"),
        # one device here, 2 or 4 in the default run: test_multidevice.py's dense-2dev-kv-split runs
        # every Gemma 2 / 3 part and gpt-oss's sinks and biases, dense-2dev-cohere Cohere's,
        # dense-4dev-kv-replicated-verify OLMo 2's, each against the reference and compiled for
        # TPU7x; moe-gpt-oss in bfloat16 (below) gpt-oss's experts on one device
        ("dense-gemma", "float32"), ("dense-olmo2", "float32"), ("dense-cohere", "float32"),
        ("dense-sinks", "float32"), ("moe-gpt-oss", "float32")}


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c[0]}-{c[1]}-q{c[3]}",
                                               marks=[pytest.mark.full] if c[:2] in FULL else [])
                                  for c in CASES])
def test_step_matches_reference(case):
    name, dtype, lengths, q_len, knobs = case
    cfg, params = model(name, dtype)
    # dense-lanes (hidden 192 run as 256 lanes) taps too: the step returns the model's own columns
    check_step(cfg, params, dtype, lengths, q_len, knobs, v6e=name in V6E,
               taps=(0, 2) if name == "dense-lanes" else ())


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


def assert_variants_move_the_logits(name: str, variants) -> None:
    """One reference step of `name`'s float32 model after a 30-token prefill, then the same step
    for each (changed config, weights or None for the model's own) in `variants`: each moves the
    logits by more than 1e-3 of their scale (the kernel cases are held to 1e-5), so a kernel
    case of `name` that ignored that part would fail."""
    cfg, params = model(name, "float32")
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of([30], cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tok, pos = jnp.asarray([[7]], jnp.int32), cache.lengths[:, None]
    a, _ = reference_step(cfg)(params, tok, pos, cache)
    for changes, weights in variants:
        b, _ = reference_step(cfg.replace(**changes))(params if weights is None else weights, tok, pos, cache)
        assert float(jnp.max(jnp.abs(a - b))) > 1e-3 * float(jnp.max(jnp.abs(a))), changes


GEMMA_PARTS = dict(post_norms=False, attn_scalar=0.0, rope_local_theta=0.0, attn_softcap=0.0, final_softcap=0.0)


@pytest.mark.parametrize("part", GEMMA_PARTS)
def test_each_gemma_part_changes_the_output(part):
    """dense-gemma's kernel case is not vacuous: without any one of its parts the reference's
    logits move by more than 1e-3 of their scale (the kernel is held to 1e-5)."""
    assert_variants_move_the_logits("dense-gemma", [({part: GEMMA_PARTS[part]}, None)])


def test_each_olmo2_part_changes_the_output():
    """dense-olmo2's kernel case is not vacuous: norms before the sublayers (unit weights), or
    no QK-norm, move the reference's logits by more than 1e-3 of their scale."""
    cfg, params = model("dense-olmo2", "float32")
    ones = {"attn_norm": jnp.ones(cfg.hidden_size), "mlp_norm": jnp.ones(cfg.hidden_size)}
    assert_variants_move_the_logits("dense-olmo2", [
        (dict(pre_norms=True), {**params, "layers": [{**lay, **ones} for lay in params["layers"]]}),
        (dict(qk_norm=False, qk_norm_whole=False), None)])


def test_each_cohere_part_changes_the_output():
    """dense-cohere's kernel case is not vacuous: RMSNorm instead of LayerNorm, or the MLP after
    attention (normed by the same weights), move the reference's logits by more than 1e-3 of
    their scale."""
    _, params = model("dense-cohere", "float32")
    serial = {**params, "layers": [{**lay, "mlp_norm": lay["attn_norm"]} for lay in params["layers"]]}
    assert_variants_move_the_logits("dense-cohere", [(dict(norm_kind="rms"), None), (dict(parallel_blocks=False), serial)])


def test_sinks_change_the_output_as_transformers_computes_them():
    """dense-sinks' kernel case is not vacuous (without the sinks the logits move by more than
    1e-3 of their scale), and the reference's softmax with sinks is transformers' gpt-oss eager
    attention on the same scores."""
    torch = pytest.importorskip("torch")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg, params = model("dense-sinks", "float32")
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of([30], cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tok, pos = jnp.asarray([[7]], jnp.int32), cache.lengths[:, None]
    a, _ = reference_step(cfg)(params, tok, pos, cache)
    b, _ = reference_step(cfg.replace(attn_sinks=False))(params, tok, pos, cache)
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3 * float(jnp.max(jnp.abs(a)))

    # transformers: q [B, Hq, T, D], k / v [B, Hkv, S, D], module.sinks [Hq], causal mask added
    rng = np.random.default_rng(0)
    b_, t, s_len, hkv, g, d = 2, 3, 7, 2, 4, 64
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((b_, hkv * g, t, d), (b_, hkv, s_len, d), (b_, hkv, s_len, d)))
    sinks = rng.standard_normal(hkv * g).astype(np.float32) * 2
    q_pos = np.array([[4, 5, 6]] * b_, np.int32)
    k_pos = np.broadcast_to(np.arange(s_len, dtype=np.int32), (b_, s_len))
    allowed = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = g, False
    module.sinks = torch.nn.Parameter(torch.from_numpy(sinks))
    mask = torch.from_numpy(np.where(allowed, 0.0, -np.inf).astype(np.float32))[:, None]
    want, _ = gpt_oss.eager_attention_forward(module, torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                              mask, scaling=d ** -0.5, dropout=0.0)
    got = R.attend(cfg.attention, jnp.asarray(q.transpose(0, 2, 1, 3)), jnp.asarray(k.transpose(0, 2, 1, 3)),
                   jnp.asarray(v.transpose(0, 2, 1, 3)), jnp.asarray(q_pos), jnp.asarray(k_pos),
                   jnp.ones((b_, s_len), bool), sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy().reshape(b_, t, -1), rtol=1e-5, atol=1e-6)


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
    page = PAGE * cfg.attention.kv_size * 4  # f32 page, K or V
    # Query at context - 1: full layers stream every page and patch the last one (read + write);
    # the sliding layer streams only the tiles holding keys context - 20 .. context - 1: the
    # last page but one from HBM, and the last (patched) page as a VMEM copy.
    for context in (64, 256):
        pages = context // PAGE
        full_layer = (pages - 1) + 2  # HBM tile pages + patch read + write-back
        sliding_layer = 1 + 2
        assert kv[0, context] == 2 * page * 2 * full_layer
        assert kv[20, context] == 2 * page * (full_layer + sliding_layer)


def test_widths_off_the_lane_grid_are_padded_and_reported():
    """hidden 192 and one 64-wide kv head: the plan runs hidden 256 with 2 kv / 6 q heads, says
    so with the parameter counts both ways, and keeps the model as written in its spec."""
    cfg, params = model("dense-lanes", "float32")
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, CONTEXT, page_size=PAGE))
    assert (plan.cfg.hidden_size, plan.cfg.num_kv_heads, plan.cfg.num_q_heads, plan.cfg.norms.width) == (256, 2, 6, 192)
    pad = plan.summary()["lane_padding"]
    assert pad["hidden_size"] == [192, 256] and pad["kv_heads"] == [1, 2] and pad["q_heads"] == [3, 6]
    assert pad["parameters"] == [cfg.param_count(), plan.cfg.param_count()] and pad["parameters"][0] < pad["parameters"][1]
    assert plan.spec.model == cfg and make_plan(plan.spec).cfg == plan.cfg
    # the padded copy's reference equals the model's own: zeros after each block, norms over 192
    wide = pad_params(cfg, plan.cfg, params)
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    tokens, positions = jnp.asarray([[3, 7]], jnp.int32), jnp.asarray([[0, 1]], jnp.int32)
    want, want_cache = reference_step(cfg)(params, tokens, positions, cache)
    got, got_cache = reference_step(plan.cfg)(wide, tokens, positions, pad_cache(cfg, plan.cfg, cache))
    assert jnp.allclose(got, want, rtol=1e-5, atol=1e-5)
    for got_kv, want_kv in zip(unpad_cache(cfg, plan.cfg, got_cache)[:2], want_cache[:2]):  # summed in another order
        assert jnp.allclose(got_kv, want_kv, rtol=1e-6, atol=1e-6)


def test_plan_states_the_head_layout_and_counts_unpadded_kv():
    """64-wide heads are not padded: the cache and the plan's KV bytes are Hkv * 64 per token."""
    cfg, _ = model("moe-d64-w20", "float32")  # 2 kv heads x 64: one 128-lane block
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, CONTEXT, TuningConfig(kv_tile_pages=1), page_size=PAGE))
    assert plan.summary()["attention"] == {
        "head_dim": 64, "kv_heads": 2, "kv_heads_per_128_lanes": 2,
        "kv_cache_bytes_per_token_per_layer": 2 * 2 * 64 * 4, "kv_cache_format": "float32",
        "sliding_window": 20, "sliding_layers": 2,
        "kv_tile_pages": 1, "kv_tile_tokens": PAGE, "kv_buffers": plan.attention.kv_buffers,
        "kv_knobs": {"kv_tile_pages": "fixed", "kv_buffers": "auto (plan: timeline model)"}}
    assert plan.attention.page_bytes == PAGE * 2 * 64 * 4


@pytest.mark.parametrize("scheme", [pytest.param("int8", marks=pytest.mark.full), "fp8-b128"])  # column scales: full
def test_padding_quantized_weights_equals_quantizing_padded_ones(scheme):
    """A quantized checkpoint is padded code by code (zero codes, unit scales): the same codes and
    the same column / block scales as quantizing the padded float weights (zeros never set a
    maximum), so the kernel streams what the reference multiplies."""
    from tpumk.model.quantize import quantize_params

    cfg, params = model("dense-lanes", "float32")
    run = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, CONTEXT, page_size=PAGE)).cfg
    padded_codes = pad_params(cfg, run, quantize_params(cfg, params, scheme))
    codes_of_padded = quantize_params(run, pad_params(cfg, run, params), scheme)
    for name in ("wq", "wk", "wo", "w_down"):
        a, b = padded_codes["layers"][1][name], codes_of_padded["layers"][1][name]
        assert a.q.shape == b.q.shape and jnp.array_equal(a.q.astype(jnp.float32), b.q.astype(jnp.float32)), name
        true_cols = {"wq": cfg.attention.q_size, "wk": cfg.attention.kv_size}.get(name, cfg.hidden_size)  # padded columns: any scale
        assert jnp.array_equal(a.scale[..., :true_cols], b.scale[..., :true_cols]), name


GPT_OSS_PARTS = dict(router_logit_bias=False, expert_bias=False, swiglu_limit=0.0)


@pytest.mark.parametrize("part", GPT_OSS_PARTS)
def test_each_gpt_oss_expert_part_changes_the_output(part):
    """moe-gpt-oss's kernel cases are not vacuous: without its router's logit bias, its experts'
    biases, or the clamp of its SwiGLU (alpha 1 then: silu(g) * u), the reference's logits move
    by more than 1e-3 of their scale (the kernel is held to 1e-5)."""
    off = {part: GPT_OSS_PARTS[part], **({"swiglu_alpha": 1.0} if part == "swiglu_limit" else {})}
    assert_variants_move_the_logits("moe-gpt-oss", [(off, None)])
