"""Muse Spark's language model (transformers' `muse_spark` wrapper, text config `muse_spark_text`):
tpumk's reader, its reference decode step against transformers' own MuseSparkForConditionalGeneration,
its greedy tokens through the megakernel, and the `muse-spark` preset at the published size.

The tiny checkpoint is written by transformers' classes with every part moved off its identity
init: the (1 + w) and input-scaled norm weights around 1 (not 0), the final norm's around 1, a
correction bias that changes picks, residual gates of spread 0.5, qk_scale_factor, output_multiplier,
residual_gate_temperature, post_norm_eps and routed_scaling_factor off their defaults, logits
soft-capped at 1 (so the cap bends them), a 301-token vocabulary (not a multiple of 128), a 5-token
window (shorter than the 9-token prompts and the 12-token sequences), the full layer 3 without RoPE,
layer 1 dense, and the wrapper's image / video / audio token ids inside the vocabulary (transformers
embeds them as token 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner

import hf_utils
from hf_utils import hf_greedy, hf_logits
from tpumk.cli import main
from tpumk.decode.generate import generate, load_model
from tpumk.errors import ConfigError, NotSupportedError
from tpumk.model.config import from_hf_config, load_preset
from tpumk.model.reference import forward_full
from tpumk.model.weights import expected_shapes, random_params, tensor_dtype

TEXT = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=5, moe_intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=2, moe_hidden_size=48, mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
            qk_scale_factor=3.0, output_multiplier=2.0, final_logit_softcapping=1.0, residual_gate_temperature=0.5,
            post_norm_eps=1e-6, routed_scaling_factor=1.5, initializer_range=0.1, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
MULTIMODAL_IDS = dict(image_token_id=7, video_token_id=8, audio_token_id=9)
PROMPTS = [[3, 141, 7, 26, 5, 200, 17, 122, 41], [150, 1, 64, 8, 280, 2, 99, 11, 203]]
STEPS = 6


def build(out: Path, seed: int = 80) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.MuseSparkConfig(
        text_config=TEXT, out_hidden_size=32, projector_hidden_size=32, **MULTIMODAL_IDS,
        vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        audio_config=dict(hidden_sizes=[8, 8, 8, 8], out_hidden_size=TEXT["hidden_size"]))
    model = transformers.MuseSparkForConditionalGeneration(cfg).to(torch.float32).eval()
    hf_utils.perturb_norms_and_bias(model, seed)  # every norm weight 1 + 0.1 N(0, 1), the correction bias
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("residual_gate.gate"):  # transformers' init: N(0, initializer_range)
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("muse_spark"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(None, str(checkpoint))


def test_config_reads_the_language_model(checkpoint, model):
    cfg, params = model.cfg, model.params
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == \
        (4, 64, 4, 2, 16, 301)
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.nope_layers, cfg.dense_layers, cfg.ffn_size) == \
        (5, (0, 1, 2), (3,), (1,), 96)
    assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.moe_hidden_size, cfg.num_shared_experts) == \
        (8, 2, 32, 48, 0)
    assert (cfg.router_scoring, cfg.router_correction_bias, cfg.norm_topk_prob, cfg.routed_scaling_factor) == \
        ("sigmoid", True, True, 1.5)
    assert (cfg.rms_eps, cfg.post_norm_eps, cfg.final_softcap, cfg.rope_theta, cfg.tie_embeddings) == \
        (1e-5, 1e-6, 1.0, 500000.0, False)
    assert cfg.embed_norm and cfg.residual_gates and cfg.attn_out_norm and cfg.attn_output_gate
    assert cfg.expert_post_norm and cfg.post_norms and cfg.qk_norm and not cfg.qk_norm_whole
    # the wrapper's image / video / audio ids embed as token 0 (transformers zeroes them first)
    stored = hf_utils.load_tensors(checkpoint / "model.safetensors")["model.language_model.embed_tokens.weight"]
    embed = np.asarray(params["embed"])
    for i in MULTIMODAL_IDS.values():
        assert not np.array_equal(stored[i], stored[0]) and np.array_equal(embed[i], embed[0])
    assert np.array_equal(embed[10:], stored[10:])
    assert np.allclose(np.asarray(params["layers"][0]["q_norm"]), 3.0)  # qk_scale_factor on the normed queries


def test_random_weights_take_the_checkpoint_s_layout(model):
    """A model described without a checkpoint (a TOML, the preset) has the tensors and shapes the
    checkpoint loads into (tpumk.model.weights.expected_shapes, what random weights are drawn in),
    the residual gates and the router float32 in a bfloat16 model as in the checkpoint."""
    assert jax.tree.map(lambda a: tuple(a.shape), model.params) == \
        jax.tree.map(lambda s: s, expected_shapes(model.cfg), is_leaf=lambda s: isinstance(s, tuple))
    float32 = {k for k in model.params["layers"][0] if tensor_dtype(model.cfg, k, jnp.bfloat16) == jnp.float32}
    assert float32 == {"res_attn_alpha", "res_attn_beta", "res_mlp_alpha", "res_mlp_beta", "router", "router_bias"}


@pytest.mark.full  # each tensor's draw compiles once per shape: 4-7 s on a loaded 2-core host
def test_random_weights_are_drawn_in_the_checkpoint_s_layout(model):
    def layout(params):
        return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params)

    one = model.cfg.replace(num_layers=1, dense_layers=(), sliding_layers=(0,), nope_layers=())
    assert layout(random_params(one, seed=1)) == layout({**model.params, "layers": model.params["layers"][:1]})
    assert str(model.params["layers"][0]["res_attn_alpha"].dtype) == "float32"


def test_reference_logits_match_transformers(checkpoint, model):
    """Full-sequence float32 logits over 12 tokens (past the 5-token window) agree to 2e-5 of the
    scale of the logits before the soft-cap (which is 1-Lipschitz): float32 rounding of products of
    a few hundred terms, with the folded factors rounded once more. Each Muse Spark part is needed:
    without it they differ by 100 times that."""
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 12))
    tokens[0, 4], tokens[1, 6] = MULTIMODAL_IDS["image_token_id"], MULTIMODAL_IDS["audio_token_id"]
    want = hf_logits(checkpoint, tokens)
    got = np.asarray(forward_full(model.params, model.cfg, tokens))
    cfg = model.cfg
    uncapped = np.asarray(forward_full(model.params, cfg.replace(final_softcap=0.0), tokens))
    bound = 2e-5 * max(1.0, float(np.max(np.abs(uncapped))))
    assert np.max(np.abs(got - want)) <= bound
    assert np.max(np.abs(uncapped)) > 2 * cfg.final_softcap  # the cap bends the logits
    without = {"embed_norm": cfg.replace(embed_norm=False), "residual_gates": cfg.replace(residual_gates=False),
               "attn_out_norm": cfg.replace(attn_out_norm=False),
               "expert_post_norm": cfg.replace(expert_post_norm=False),
               "final_softcap": cfg.replace(final_softcap=0.0), "nope_layers": cfg.replace(nope_layers=()),
               "sliding_window": cfg.replace(sliding_window=0, sliding_layers=())}
    for part, other in without.items():
        assert np.max(np.abs(np.asarray(forward_full(model.params, other, tokens)) - want)) > 100 * bound, part


def test_greedy_tokens_equal_transformers(checkpoint, model):
    """transformers' greedy tokens through the reference's paged decode step (prefill of 9 tokens
    past the window, then 5 one-token steps), `tpumk generate`'s reference backend."""
    want = hf_greedy(checkpoint, PROMPTS, STEPS)
    assert generate(model, PROMPTS, STEPS, backend="reference", page_size=4)["tokens"] == want


# 4 devices: the full tier (tests/README.md; 33 s against 18 s): the default run has one device
# here, each part against the reference in test_megakernel_spark.py, and MoE models on 4 devices
@pytest.mark.parametrize("devices", [1, pytest.param(4, marks=pytest.mark.full)])
def test_greedy_tokens_through_the_megakernel(checkpoint, model, devices):
    """transformers' greedy tokens through the megakernel in interpret mode (the lane-padded copy:
    hidden 64, heads of 16, experts of 32 at the MoE width 48 each run 128 lanes wide), on one
    device and on 4 host devices (`tpumk generate --devices 4`: 2 experts each, the KV heads
    replicated); the build compiled deviceless for TPU7x: one kernel, no XLA collective."""
    from host_flags import generate_on_devices
    from test_hf_mla_names import _compiles_on_devices
    from test_megakernel import compile_for_tpus
    from tpumk.plan.knobs import TuningConfig

    want = hf_greedy(checkpoint, PROMPTS, STEPS)
    if devices == 1:
        got = generate(model, PROMPTS, STEPS, backend="megakernel", page_size=8)
        compile_for_tpus(model.cfg, len(PROMPTS), 1, TuningConfig())
    else:
        got = generate_on_devices(checkpoint, PROMPTS, STEPS, devices, "--page-size", "8", timeout=1200)
        assert got["devices"] == devices
        _compiles_on_devices(model.cfg, devices)
    assert got["tokens"] == want and "megakernel" in got["ran_on"]


def test_the_preset_is_transformers_default_config_at_the_published_size():
    """muse-spark is what tpumk reads from transformers' default MuseSparkConfig (bfloat16), and its
    parameters by tpumk's count reproduce the published 816B total / A42B active, both without the
    embedding and the lm_head: 816.68 B (within 0.5 %) and 42.78 B read per token at batch 1 (within
    2 %: the published figure is rounded to whole billions)."""
    preset = load_preset("muse-spark")
    data = json.loads(transformers.MuseSparkConfig().to_json_string())
    assert from_hf_config(data).replace(name="muse-spark", dtype="bfloat16") == preset
    embedding = preset.vocab_size * preset.hidden_size
    total = preset.param_count() - 2 * embedding
    active = preset.decode_weight_bytes(batch=1) / preset.dtype_bytes - embedding - preset.hidden_size
    assert abs(total / 816e9 - 1) < 0.005, total
    assert abs(active / 42e9 - 1) < 0.02, active
    rows = {m["name"]: m for m in json.loads(CliRunner().invoke(main, ["models", "--json"]).output)["models"]}
    assert rows["muse-spark"]["layers"] == 62 and rows["muse-spark"]["params"] == preset.param_count()


def test_wrapper_and_fields_are_refused_in_one_line():
    text = json.loads(transformers.MuseSparkTextConfig(**TEXT).to_json_string())
    with pytest.raises(ConfigError) as e:  # transformers would build its default 816B text model
        from_hf_config({"model_type": "muse_spark", "image_token_id": 7}, "x/config.json")
    assert "\n" not in str(e.value) and "field 'text_config' is missing" in str(e.value)
    with pytest.raises(NotSupportedError) as e:  # transformers rotates every non-zero layer with rope_theta
        from_hf_config({"model_type": "muse_spark", "text_config": {**text, "layer_rope_theta": [1e4, 1e4, 1e4, 0]}},
                       "x/config.json")
    assert "\n" not in str(e.value) and "layer_rope_theta entry 10000.0" in str(e.value)
    with pytest.raises(NotSupportedError) as e:
        from_hf_config({"model_type": "muse_spark", "text_config": {**text, "attention_bias": True}}, "x/config.json")
    assert str(e.value) == ("x/config.json: text_config: not supported yet: attention_bias = true (biases on the "
                            "attention projections)")
    with pytest.raises(ConfigError) as e:  # transformers would build experts of width 0
        from_hf_config({"model_type": "muse_spark", "text_config": {**text, "moe_hidden_size": 0}}, "x/config.json")
    assert str(e.value).startswith("x/config.json: text_config: field 'moe_hidden_size' = 0: expected a positive")
    with pytest.raises(NotSupportedError) as e:  # a field of another family
        from_hf_config({"model_type": "muse_spark", "text_config": {**text, "sliding_window_pattern": 4}},
                       "x/config.json")
    assert "\n" not in str(e.value) and "'sliding_window_pattern' is not a field of model_type 'muse_spark_text'" \
        in str(e.value)
