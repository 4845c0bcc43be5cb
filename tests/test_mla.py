"""MLA (DeepSeek-V3 / Kimi K2): configs and presets, the absorbed reference step over the
latent cache, DeepSeek-V3 routing, and the megakernel's one-line refusal.

The transformers-side checks (YaRN frequencies, a tiny DeepseekV3ForCausalLM checkpoint giving
the same logits and greedy tokens) are in tests/test_hf_deepseek.py.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.errors import ConfigError, NotSupportedError, PlanError
from tpumk.model import mla, reference
from tpumk.model.config import from_dict, from_hf_config, load_preset
from tpumk.model.weights import expected_shapes, random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# The public DeepSeek-V3 config.json (its fields that describe the model).
DEEPSEEK_V3_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False, "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}


# ---------------------------------------------------------------------- configs and presets
def test_hf_deepseek_v3_config_is_the_preset():
    cfg = from_hf_config(DEEPSEEK_V3_JSON)
    assert cfg.replace(name="deepseek-v3") == load_preset("deepseek-v3")
    assert cfg.is_mla and cfg.head_dim == 192 and cfg.num_kv_heads == 128 and not cfg.qk_norm
    assert cfg.dense_layers == (0, 1, 2)


def test_hf_kimi_k2_config_is_the_preset():
    kimi = {**DEEPSEEK_V3_JSON, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_routed_experts": 384,
            "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "vocab_size": 163840,
            "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"}}
    assert from_hf_config(kimi).replace(name="kimi-k2") == load_preset("kimi-k2")


@pytest.mark.parametrize("name, params, kv_per_token", [
    ("deepseek-v3", 671.0e9, 61 * 640 * 2),  # the public count: 671B (MTP layer excluded); 512 + 64 lanes stored in 640
    ("kimi-k2", 1.026e12, 61 * 640 * 2),
])
def test_mla_preset_counts(name, params, kv_per_token):
    cfg = load_preset(name)
    assert cfg.param_count() == pytest.approx(params, rel=0.002)
    assert cfg.kv_bytes_per_token() == kv_per_token  # the latent row, not 2 x heads x head_dim


def test_param_count_matches_the_weight_shapes():
    for name in ("tiny-mla", "deepseek-v3"):
        cfg = load_preset(name)
        if name == "deepseek-v3":  # count shapes of one dense and one MoE layer, no allocation
            cfg = cfg.replace(num_layers=4)
        shapes = expected_shapes(cfg)
        n = sum(int(np.prod(s)) for k, s in shapes.items() if k != "layers")
        n += sum(int(np.prod(s)) for lay in shapes["layers"] for s in lay.values())
        assert n == cfg.param_count()


@pytest.mark.parametrize("changes, field", [
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"qk_rope_head_dim": None}, "qk_rope_head_dim"),
    ({"n_group": 3}, "router_groups"),  # not a divisor of 256 experts
    ({"topk_group": 9}, "router_topk_groups"),
    ({"routed_scaling_factor": -1.0}, "routed_scaling_factor"),
    ({"rope_scaling": {"type": "yarn", "factor": 40}}, "original_max_position_embeddings"),
    ({"rope_interleave": "yes"}, "rope_interleave"),
])
def test_hf_mla_bad_fields_named(changes, field):
    data = {k: v for k, v in {**DEEPSEEK_V3_JSON, **changes}.items() if v is not None}
    with pytest.raises(ConfigError, match=field) as e:
        from_hf_config(data, "x/config.json")
    _one_line(e)


def test_hf_mla_unmodelled_variants_refused():
    for changes, what in (({"moe_layer_freq": 2}, "moe_layer_freq"), ({"scoring_func": "softmax"}, "scoring_func"),
                          ({"topk_method": "group_limited_greedy"}, "topk_method"), ({"attention_bias": True},
                                                                                   "attention_bias")):
        with pytest.raises(NotSupportedError, match=f"not supported yet: {what}") as e:
            from_hf_config({**DEEPSEEK_V3_JSON, **changes})
        _one_line(e)


def test_toml_mla_fields_validated():
    base = load_preset("tiny-mla").to_dict()
    for changes, field in (({"head_dim": 30}, "head_dim"), ({"num_kv_heads": 1}, "num_kv_heads"),
                           ({"qk_norm": True}, "qk_norm"), ({"qk_rope_head_dim": 7, "head_dim": 31}, "qk_rope_head_dim"),
                           ({"router_groups": 8}, "router_groups"),  # one expert per group: no two best
                           ({"router_topk_groups": 1, "top_k": 3}, "top_k")):
        with pytest.raises(ConfigError, match=f"'{field}'") as e:
            from_dict({**base, **changes}, "m.toml")
        _one_line(e)
    gqa = load_preset("tiny-moe").to_dict()
    for changes, field in (({"v_head_dim": 16}, "v_head_dim"), ({"kv_lora_rank": 16}, "qk_rope_head_dim"),
                           ({"yarn_factor": 4.0}, "yarn_original_max_position"),  # YaRN on GQA needs its length
                           ({"yarn_factor": 4.0, "yarn_original_max_position": 64, "rope_scaling": "linear"},
                            "rope_scaling")):  # one scaling at a time
        with pytest.raises(ConfigError, match=f"'{field}'"):
            from_dict({**gqa, **changes}, "m.toml")
    assert from_dict({**gqa, "yarn_factor": 4.0, "yarn_original_max_position": 64}, "m.toml").yarn_factor == 4.0
    with pytest.raises(ConfigError, match="'router_groups'"):
        from_dict({**load_preset("tiny-dense").to_dict(), "router_groups": 2}, "m.toml")


# ---------------------------------------------------------------------- plan: HBM check, then the refusal
def test_big_mla_presets_refused_by_the_hbm_check():
    for name in ("deepseek-v3", "kimi-k2"):
        with pytest.raises(PlanError, match=r"does not fit one tpu7x device: weights .* GB \+ KV cache") as e:
            make_plan(BuildSpec(load_preset(name), get_target("tpu7x"), 1, 4096, quant="fp8"))
        _one_line(e)


def test_hbm_check_counts_the_latent_cache():
    cfg = load_preset("deepseek-v3")
    # 4096 sequences of 32k tokens: 61 x 640 x 2 bytes per token (576 lanes stored in 640) = 10.5 TB
    with pytest.raises(PlanError, match=r"KV cache 10479\.\d GB") as e:
        make_plan(BuildSpec(cfg, get_target("tpu7x"), 4096, 32768, devices=32, quant="fp8"))
    _one_line(e)


@pytest.mark.parametrize("model, devices", [("deepseek-v3", 32), ("kimi-k2", 64)])
def test_big_mla_presets_plan_on_their_slices_in_fp8(model, devices):
    """Issue 15's build: the full public configs in fp8 over a TPU7x slice plan (heads and
    experts split, the latent cache whole on every device); the compile is a slow test
    (tests/test_multidevice_mla.py)."""
    tpu7x = get_target("tpu7x")
    plan = make_plan(BuildSpec(load_preset(model), tpu7x, 1, 4096, devices=devices, quant="fp8"))
    assert plan.sharding.devices == devices and plan.sharding.q_heads * devices == plan.whole_model.num_q_heads
    resident = plan.summary()["resident_bytes_per_device"]
    assert 10e9 < resident["weights"] + resident["kv_cache"] < tpu7x.hbm_bytes
    # the ring's slot is sized against W_UV's 512 latent rows, not 512 x the whole hidden width
    assert plan.slot_rows * plan.slot_cols * plan.families["o"].itemsize <= plan.tuning.tile_bytes
    assert plan.vmem_needed <= plan.vmem_budget
    # expert_slots auto: the most (up to 4) that fit; 4 fixed does not fit, refused in one line
    assert 1 <= plan.moe.expert_slots < 4
    with pytest.raises(PlanError, match="plan does not fit tpu7x VMEM") as e:
        make_plan(BuildSpec(load_preset(model), tpu7x, 1, 4096, devices=devices, quant="fp8",
                            tuning=TuningConfig(expert_slots=4, ring_depth=12)))
    _one_line(e)


def test_quantized_mla_weights_hold_the_absorbed_blocks():
    """wkv_b quantizes as the per-head W_UK^T / W_UV blocks the kernel streams; the expanded twin
    (dequantized blocks) agrees with the absorbed step on them. Kernel checks:
    tests/test_megakernel_mla_quant.py."""
    from tpumk.model.quantize import QuantizedMatrix, quantize_params

    cfg = load_preset("tiny-mla")
    qp = quantize_params(cfg, random_params(cfg), "int8")
    lay = qp["layers"][0]
    assert "wkv_b" not in lay and isinstance(lay["w_uk"], QuantizedMatrix)
    assert lay["w_uk"].shape == (3, 24, 40) and lay["w_uv"].shape == (3, 40, 20)
    tokens = jnp.asarray([[5, 9, 2, 77, 31]], jnp.int32)
    full = jax.jit(lambda p, t: reference.forward_full(p, cfg, t))(qp, tokens)  # jitted: eager takes ~20 s
    cache = reference.init_cache(cfg, 1, 32, 8)
    step, _ = reference.jitted_decode_step(cfg)(qp, tokens, jnp.arange(5, dtype=jnp.int32)[None], cache)
    np.testing.assert_allclose(step, full, rtol=0, atol=1e-3 * float(jnp.max(jnp.abs(full))))


# ---------------------------------------------------------------------- the reference step
@pytest.fixture(scope="module", params=["q_lora", "plain_q"])
def model(request):
    cfg = load_preset("tiny-mla")
    if request.param == "plain_q":
        cfg = cfg.replace(q_lora_rank=0, yarn_factor=0.0, dtype="bfloat16")
    return cfg, random_params(cfg, seed=1)


def test_latent_cache_shape_and_contents(model):
    cfg, params = model
    cache = reference.init_cache(cfg, 2, 16, page_size=4)
    w = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert cache.k.shape[-1] == 128 and cache.v.shape[-1] == 0  # the 48-lane row lane-padded (zeros)
    toks = jnp.asarray([[3, 9, 27], [5, 7, 11]], jnp.int32)
    pos = jnp.asarray([[0, 1, 2], [0, 1, 2]], jnp.int32)
    _, cache = reference.jitted_decode_step(cfg)(params, toks, pos, cache)
    lay = params["layers"][0]  # layer 0 reads the embeddings

    @jax.jit  # (XLA:CPU runs bfloat16 products with float32 results only compiled)
    def rows_of(lay, emb):
        x = reference.rms_norm(emb, lay["attn_norm"], cfg.rms_eps)
        return mla.project(cfg, lay, x, pos)[2]

    rows = rows_of(lay, reference.embed(params, toks))
    ps = cache.page_size
    for b, t in itertools.product(range(2), range(3)):
        got = np.asarray(cache.k[0, cache.block_tables[b, t // ps], t % ps], np.float32)
        np.testing.assert_array_equal(got[:w], np.asarray(rows[b, t], np.float32))
        assert not got[w:].any()
    assert cache.lengths.tolist() == [3, 3]


def test_paged_steps_match_expanded_full_forward(model):
    """Absorbed attention over the paged latent cache (a prefill chunk, a q = 3 verify-style
    step, then single tokens) equals the expanded form (per-head K and V rebuilt) recomputed
    over the whole sequences."""
    cfg, params = model
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 10)), jnp.int32)
    full = np.asarray(jax.jit(lambda p, t: reference.forward_full(p, cfg, t))(params, toks))
    cache = reference.init_cache(cfg, 2, 16, page_size=4)
    step = reference.jitted_decode_step(cfg)
    got = []
    for a, b in ((0, 5), (5, 8), (8, 9), (9, 10)):
        pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
        logits, cache = step(params, toks[:, a:b], pos, cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, 1)
    tol = 2e-5 if cfg.dtype == "float32" else 0.1  # bf16: the two forms round at different points
    np.testing.assert_allclose(got, full, atol=tol * max(1.0, np.abs(full).max()))
    assert (np.argmax(got, -1) == np.argmax(full, -1)).mean() > 0.9


def test_out_of_range_positions_write_nothing(model):
    cfg, params = model
    cache = reference.init_cache(cfg, 1, 8, page_size=4)
    toks = jnp.asarray([[1, 2]], jnp.int32)
    _, after = reference.jitted_decode_step(cfg)(params, toks, jnp.asarray([[8, 9]], jnp.int32), cache)
    np.testing.assert_array_equal(np.asarray(after.k, np.float32), np.asarray(cache.k, np.float32))
    assert after.lengths.tolist() == [0]


def test_greedy_generate_runs_on_the_latent_cache():
    cfg = load_preset("tiny-mla")
    params = random_params(cfg)
    out, cache = reference.greedy_generate(params, cfg, [[1, 2, 3], [4, 5]], 4, reference.init_cache(cfg, 2, 16, 4))
    assert [len(o) for o in out] == [4, 4] and cache.lengths.tolist() == [6, 5]


# ---------------------------------------------------------------------- DeepSeek-V3 routing
def _route_by_hand(cfg, logits: np.ndarray, bias: np.ndarray):
    """transformers' DeepseekV3TopkRouter, one token at a time in numpy."""
    ids, weights = [], []
    e, g = cfg.num_experts, cfg.router_groups
    for row in logits:
        s = 1 / (1 + np.exp(-row.astype(np.float64)))
        choice = s + bias
        groups = choice.reshape(g, e // g)
        gscore = np.sort(groups, -1)[:, -2:].sum(-1)
        keep = np.argsort(-gscore, kind="stable")[: cfg.router_topk_groups]
        masked = np.full(e, -np.inf)
        for k in keep:
            masked[k * (e // g):(k + 1) * (e // g)] = choice[k * (e // g):(k + 1) * (e // g)]
        pick = np.argsort(-masked, kind="stable")[: cfg.top_k]
        w = s[pick]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        ids.append(pick)
        weights.append(w * cfg.routed_scaling_factor)
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_routing_matches_the_algorithm(norm):
    cfg = load_preset("tiny-mla").replace(num_experts=16, top_k=3, router_groups=4, router_topk_groups=2,
                                          norm_topk_prob=norm)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (64, 16)).astype(np.float32)
    bias = rng.normal(0, 0.3, 16).astype(np.float32)
    ids, w = reference.route(cfg.moe, jnp.asarray(logits), jnp.asarray(bias))
    want_ids, want_w = _route_by_hand(cfg, logits, bias)
    order = np.argsort(np.asarray(ids), -1)  # the pick order within top-k is not part of the contract
    want_order = np.argsort(want_ids, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1),
                                  np.take_along_axis(want_ids, want_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(want_w, want_order, -1), rtol=1e-5)
    # the bias and the groups both change picks on these inputs (so the check above can fail)
    plain_ids, _ = reference.route(cfg.replace(router_groups=1, router_topk_groups=1).moe, jnp.asarray(logits))
    assert (np.sort(np.asarray(plain_ids), -1) != np.sort(want_ids, -1)).any(axis=-1).mean() > 0.2


def test_bias_selects_but_does_not_weigh():
    cfg = load_preset("tiny-mla").replace(router_groups=1, router_topk_groups=1, routed_scaling_factor=1.0,
                                          norm_topk_prob=False)
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0, -1.0, -2.0, -3.0, 0.5]])
    bias = jnp.asarray([5.0, 0, 0, 0, 0, 0, 0, 0])  # expert 0 gets picked, weighted by its own sigmoid
    ids, w = reference.route(cfg.moe, logits, bias)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 3]
    np.testing.assert_allclose(sorted(np.asarray(w)[0].tolist()), sorted([0.5, float(jax.nn.sigmoid(3.0))]))


def test_benchmarks_latent_cache_figures():
    """The BENCHMARKS.md "MLA" table's figures (benchmarks/mla_cache_bytes.py)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "mla_cache_bytes.py"
    spec = importlib.util.spec_from_file_location("mla_cache_bytes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ds = mod.rows(["deepseek-v3"], 32768)[0]
    assert ds["latent_bytes_per_sequence"] == 61 * 576 * 2 * 32768
    assert ds["per_head_bytes_per_sequence"] == 61 * 128 * (192 + 128) * 2 * 32768
    assert round(ds["per_head_over_latent"], 1) == 71.1 and round(ds["per_head_over_padded"], 1) == 64.0


def test_auto_expert_slots_are_weighed_against_the_kv_tiles_by_the_model():
    """Slots and KV tiles share the VMEM the ring leaves: on DeepSeek-V3 over 32 TPU7x cores
    (bf16 experts) 3 slots fit only beside 1-page KV tiles; the plan's auto choice is the
    fastest count by the timeline model, so never slower than any fixed count that plans."""
    from tpumk.estimate.timeline import megakernel_step

    spec = dict(devices=32, quant="fp8")
    cfg, tpu7x = load_preset("deepseek-v3"), get_target("tpu7x")
    auto = make_plan(BuildSpec(cfg, tpu7x, 1, 4096, **spec))
    fixed = {n: make_plan(BuildSpec(cfg, tpu7x, 1, 4096, tuning=TuningConfig(expert_slots=n, ring_depth=12), **spec))
             for n in (1, 2, 3)}
    assert fixed[3].attention.kv_tile_pages == 1 < auto.attention.kv_tile_pages
    t = megakernel_step(auto).seconds
    assert all(t <= megakernel_step(p).seconds for p in fixed.values())
    assert t < 0.5 * megakernel_step(fixed[3]).seconds
    assert auto.summary()["moe"]["expert_slots"] == auto.moe.expert_slots == 2
