"""ModelConfig validation, presets, TOML files and Hugging Face config.json translation."""

from __future__ import annotations

import dataclasses

import pytest

from tpumk.model.config import (ModelConfig, from_dict, from_hf_config, load_hf_config, load_preset, load_toml,
                          preset_names, resolve_model)
from tpumk.errors import ConfigError, NotSupportedError, PlanError


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------- presets
def test_presets_listed():
    assert {"qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "tiny-dense", "tiny-moe"} <= set(preset_names())


@pytest.mark.parametrize("name", preset_names())
def test_preset_loads_and_round_trips(name):
    cfg = load_preset(name)
    cfg.validate()
    assert cfg.name == name
    assert from_dict(cfg.to_dict(), "round trip") == cfg
    assert resolve_model(name) == cfg


@pytest.mark.parametrize("name, params", [("qwen3-8b", 8.19e9), ("qwen3-32b", 32.76e9), ("qwen3-30b-a3b", 30.53e9)])
def test_preset_param_counts(name, params):
    assert load_preset(name).param_count() == pytest.approx(params, rel=0.005)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset 'qwen9'") as e:
        load_preset("qwen9")
    _one_line(e)


# ---------------------------------------------------------------------- TOML files
TINY_TOML = """
num_layers = 2
hidden_size = 256
num_q_heads = 4
num_kv_heads = 2
head_dim = 128
ffn_size = 512
vocab_size = 512
rms_eps = 1e-6
rope_theta = 1000000
dtype = "float32"
"""


def test_toml_top_level(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(TINY_TOML)
    cfg = load_toml(path)
    assert cfg == load_preset("tiny-dense").replace(name="mine")  # name defaults to the file stem
    assert isinstance(cfg.rope_theta, float)  # integer TOML values become floats
    assert resolve_model(str(path)) == cfg


def test_toml_model_table(tmp_path):
    path = tmp_path / "table.toml"
    path.write_text('[model]\nname = "tiny"\n' + TINY_TOML)
    assert load_toml(path) == load_preset("tiny-dense").replace(name="tiny")


def test_toml_moe_dense_layers(tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text(TINY_TOML.replace("num_layers = 2", "num_layers = 3")
                    + "num_experts = 8\ntop_k = 2\nexpert_ffn_size = 256\ndense_layers = [2, 0, 0]\n")
    cfg = load_toml(path)
    assert cfg.is_moe and cfg.dense_layers == (0, 2)  # deduplicated and sorted
    assert [cfg.pattern.is_dense(i) for i in range(3)] == [True, False, True]


def test_toml_malformed(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("num_layers = = 2\n")
    with pytest.raises(ConfigError, match="malformed TOML") as e:
        load_toml(path)
    assert str(path) in _one_line(e)


def test_toml_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_toml(tmp_path / "absent.toml")


# ---------------------------------------------------------------------- validation
BASE = load_preset("tiny-moe").to_dict()


@pytest.mark.parametrize("changes, field", [
    ({"hidden_size": -256}, "hidden_size"),
    ({"num_layers": 0}, "num_layers"),
    ({"ffn_size": -1}, "ffn_size"),
    ({"expert_ffn_size": -8}, "expert_ffn_size"),
    ({"num_layers": True}, "num_layers"),  # a bool is not an integer
    ({"top_k": 9}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"num_q_heads": 6, "num_kv_heads": 4}, "num_kv_heads"),
    ({"head_dim": 127}, "head_dim"),
    ({"dtype": "float16"}, "dtype"),
    ({"router_scoring": "relu"}, "router_scoring"),
    ({"rms_eps": 0.0}, "rms_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_scaling": "yarn"}, "rope_scaling"),  # YaRN is modelled for MLA models only
    ({"rope_scaling": "linear", "rope_factor": 0.5}, "rope_factor"),
    ({"rope_scaling": "llama3", "rope_high_freq_factor": 0.5}, "rope_high_freq_factor"),
    ({"rope_scaling": "llama3", "rope_original_max_position": 0}, "rope_original_max_position"),
    ({"qk_norm": 1}, "qk_norm"),
    ({"dense_layers": [0, 3]}, "dense_layers"),
    ({"dense_layers": [-1]}, "dense_layers"),
    ({"dense_layers": "0"}, "dense_layers"),
    ({"ffn_size": 0}, "ffn_size"),  # layer 0 is dense, so it needs an FFN width
    ({"num_shared_experts": 1, "shared_expert_ffn_size": 0}, "shared_expert_ffn_size"),
    ({"num_experts": 0, "top_k": 0, "num_shared_experts": 0}, "dense_layers"),
    ({"num_experts": 0, "num_shared_experts": 0, "dense_layers": []}, "top_k"),
    ({"hiden_size": 256}, "hiden_size"),
])
def test_bad_field_is_named(changes, field):
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, **changes}, "test.toml")
    msg = _one_line(e)
    assert f"'{field}'" in msg and msg.startswith("test.toml")


@pytest.mark.parametrize("field", ["name", "num_layers", "hidden_size", "num_q_heads", "num_kv_heads",
                                   "head_dim", "vocab_size"])
def test_missing_required_field(field):
    data = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ConfigError, match=f"missing required field '{field}'") as e:
        from_dict(data, "test.toml")
    _one_line(e)


def test_unknown_key_in_toml(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text(TINY_TOML + "num_expert = 8\n")
    with pytest.raises(ConfigError, match="unknown field 'num_expert'"):
        load_toml(path)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="'vocab_size'"):
        ModelConfig(name="x", num_layers=1, hidden_size=8, num_q_heads=1, num_kv_heads=1, head_dim=8,
                    vocab_size=-1, ffn_size=8)


# ---------------------------------------------------------------------- Hugging Face config.json
# The published config.json files (transformers 4.x style: top-level rope_theta, num_experts).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_hf_qwen3_dense_matches_preset():
    cfg = from_hf_config(QWEN3_8B)
    assert cfg == load_preset("qwen3-8b").replace(name="qwen3")


def test_hf_qwen3_moe_matches_preset():
    cfg = from_hf_config({**QWEN3_30B_A3B, "_name_or_path": "Qwen/Qwen3-30B-A3B"})
    assert cfg == load_preset("qwen3-30b-a3b").replace(name="Qwen3-30B-A3B")


def _hf5_dict(moe: bool, **kw) -> dict:
    """A config dict as the installed transformers serialises it (5.x: rope_parameters, ...)."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
    return cls(**kw).to_dict()


def test_hf_serialised_by_installed_transformers():
    dense = _hf5_dict(False, **{k: QWEN3_8B[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "rope_theta", "tie_word_embeddings")}, dtype="bfloat16")
    assert from_hf_config(dense) == load_preset("qwen3-8b").replace(name="qwen3")
    moe = _hf5_dict(True, **{k: QWEN3_30B_A3B[k] for k in (
        "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "num_experts", "num_experts_per_tok",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}, dtype="bfloat16")
    assert from_hf_config(moe) == load_preset("qwen3-30b-a3b").replace(name="qwen3_moe")


@pytest.mark.parametrize("extra, dense", [
    ({"mlp_only_layers": [0, 3]}, (0, 3)),
    ({"decoder_sparse_step": 2}, (0, 2)),  # layer i is sparse iff (i + 1) % step == 0
    ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (0, 1, 2)),
])
def test_hf_moe_dense_layers(extra, dense):
    cfg = from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 4, **extra})
    assert cfg.dense_layers == dense


def test_hf_defaults():
    data = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("norm_topk_prob", "rope_theta", "torch_dtype")}
    cfg = from_hf_config(data)
    # transformers' Qwen3-MoE defaults: no top-k renormalisation, theta 10000; tpumk defaults to bf16.
    assert (cfg.norm_topk_prob, cfg.rope_theta, cfg.dtype) == (False, 10000.0, "bfloat16")


@pytest.mark.parametrize("drop", ["vocab_size", "num_hidden_layers", "num_experts", "moe_intermediate_size"])
def test_hf_missing_field(drop):
    data = {k: v for k, v in QWEN3_30B_A3B.items() if k != drop}
    with pytest.raises(ConfigError, match=f"missing required field '{drop}'") as e:
        from_hf_config(data)
    _one_line(e)


def test_hf_invalid_value_names_field():
    with pytest.raises(ConfigError, match="'top_k'"):
        from_hf_config({**QWEN3_30B_A3B, "num_experts_per_tok": 256})


# Each case changes a published config of the family it names (QWEN3_8B unless `base` says).
@pytest.mark.parametrize("base, changes, what", [
    (None, {"model_type": "deepseek_v2"}, "model_type 'deepseek_v2': DeepSeek-V2's expert routing"),
    ("DEEPSEEK_V3", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("DEEPSEEK_V3", {"model_type": "kimi_k2", "topk_method": "greedy"}, "topk_method 'greedy'"),
    (None, {"kv_lora_rank": 512}, "field 'kv_lora_rank' is not a field of model_type 'qwen3'"),  # MLA in a GQA family
    (None, {"model_type": "olmo"}, "model_type 'olmo'"),  # OLMo (1): non-parametric LayerNorm
    ("LLAMA_31_8B", {"mlp_bias": True}, "mlp_bias = true"),
    ("MISTRAL_7B_V03", {"attention_bias": True}, "attention_bias = true"),  # its o_proj has none
    (None, {"layer_types": ["full_attention", "linear_attention"] * 18}, "layer type 'linear_attention'"),
    (None, {"layer_types": ["chunked_attention"] * 36}, "layer type 'chunked_attention'"),
    (None, {"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),  # read for Gemma 2 and 3 only
    (None, {"final_logit_softcapping": 30.0}, "final logit soft-capping"),
    (None, {"use_sinks": True}, "attention sinks"),
    # YaRN is read for the Llama / Mistral / Qwen families and MLA models, LongRoPE for Phi-3
    ("QWEN15_MOE", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling"),
    ("LLAMA_31_8B", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling"),
    ("QWEN15_MOE", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters"),
    (None, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),  # the exact (erf) GELU: only Gemma reads it as tanh
    (None, {"hidden_act": "relu2"}, "hidden_act 'relu2'"),
    (None, {"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
])
def test_hf_not_supported(base, changes, what):
    from test_mla import DEEPSEEK_V3_JSON

    data = {"DEEPSEEK_V3": DEEPSEEK_V3_JSON, None: QWEN3_8B}.get(base) or globals()[base]
    with pytest.raises(NotSupportedError, match="not supported") as e:
        from_hf_config({**data, **changes}, "x/config.json")
    msg = _one_line(e)
    assert what in msg and msg.startswith("x/config.json")


# Llama-3.1-8B's and Mistral-7B-Instruct-v0.3's published config.json files.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
    "use_cache": True, "vocab_size": 128256,
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
    "vocab_size": 32768,
}


@pytest.mark.parametrize("preset, data", [("llama-3.1-8b", LLAMA_31_8B), ("mistral-7b", MISTRAL_7B_V03)])
def test_hf_llama_and_mistral_match_presets(preset, data):
    cfg = from_hf_config(data)
    assert cfg.replace(name=preset) == load_preset(preset)
    assert not cfg.qk_norm and cfg.head_dim == 128  # head_dim absent: hidden / heads


# Gemma 3 1B's config.json in transformers 4.x keys (rope_local_base_freq, sliding_window_pattern;
# tie_word_embeddings absent: Gemma ties by default).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
}


def test_hf_gemma3_matches_its_preset_and_refuses_what_it_does_not_model():
    cfg = from_hf_config(GEMMA3_1B)
    assert cfg.replace(name="gemma-3-1b") == load_preset("gemma-3-1b")
    assert load_preset("gemma-3-1b").param_count() == 999_885_952  # the release's count (4 norms a layer)
    assert (cfg.attn_softcap, cfg.final_softcap) == (0.0, 0.0)  # null: none
    capped = from_hf_config({**GEMMA3_1B, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert (capped.attn_softcap, capped.final_softcap) == (50.0, 30.0)  # transformers' Gemma 3 applies them
    assert cfg.sliding_layers == tuple(i for i in range(26) if (i + 1) % 6)  # layers 5, 11, 17, 23 full
    # transformers 4.x's rope_scaling applies to the full layers only
    scaled = from_hf_config({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (scaled.rope_scaling, scaled.rope_factor, scaled.rope_local_theta) == ("linear", 8.0, 10000)
    for changes, match in [
        ({"use_bidirectional_attention": True}, "not supported yet: use_bidirectional_attention = true"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "not supported yet: rope_parameters.sliding_attention rope_type 'linear'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "not supported yet: rope_scaling rope_type 'yarn'"),
    ]:
        with pytest.raises(NotSupportedError, match=match) as e:
            from_hf_config({**GEMMA3_1B, **changes}, "x/config.json")
        assert _one_line(e).startswith("x/config.json")
    with pytest.raises(ConfigError, match=r"rope_parameters.full_attention.rope_theta' = -1"):
        from_hf_config({**GEMMA3_1B, "rope_parameters": {"full_attention": {"rope_theta": -1}}})


# Gemma 3 27B's published config.json (Gemma3ForConditionalGeneration): its text_config lists
# only what differs from Gemma3TextConfig's defaults. Checked against the technical report's
# 25.6 B non-embedding and 1.4 B embedding parameters.
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_multimodal_gemma3_reads_its_language_model():
    cfg = from_hf_config(GEMMA3_27B)
    assert cfg.replace(name="gemma-3-27b") == load_preset("gemma-3-27b")
    p = load_preset("gemma-3-27b")
    embedding = p.vocab_size * p.hidden_size
    assert round(embedding / 1e9, 1) == 1.4 and round((p.param_count() - embedding) / 1e9, 1) == 25.6
    # the wrapper's dtype reaches the text model; the text_config's own wins
    assert from_hf_config({**GEMMA3_27B, "torch_dtype": "float32"}).dtype == "float32"
    inner = {**GEMMA3_27B, "text_config": {**GEMMA3_27B["text_config"], "torch_dtype": "bfloat16"}}
    assert from_hf_config({**inner, "torch_dtype": "float32"}).dtype == "bfloat16"
    # the head is tied by the wrapper's flag, as transformers ties it
    assert cfg.tie_embeddings and not from_hf_config({**GEMMA3_27B, "tie_word_embeddings": False}).tie_embeddings
    untied_text = {**GEMMA3_27B, "text_config": {**GEMMA3_27B["text_config"], "tie_word_embeddings": False}}
    assert from_hf_config(untied_text).tie_embeddings
    # a field of the text model is named with where it sits
    bad = {**GEMMA3_27B, "text_config": {**GEMMA3_27B["text_config"], "num_hidden_layers": -1}}
    with pytest.raises(ConfigError, match=r"^x/config.json: text_config: .*'num_hidden_layers'") as e:
        from_hf_config(bad, "x/config.json")
    _one_line(e)
    for text, match in [(None, r"field 'text_config' = None: expected an object"),
                        ({"model_type": "siglip_vision_model"},
                         r"not supported yet: text_config.model_type 'siglip_vision_model' in a 'gemma3' wrapper")]:
        with pytest.raises((ConfigError, NotSupportedError), match=match) as e:
            from_hf_config({**GEMMA3_27B, "text_config": text}, "x/config.json")
        assert _one_line(e).startswith("x/config.json")


# Mixtral-8x7B-v0.1's published config.json.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
    "vocab_size": 32000,
}


def test_hf_mixtral_matches_its_preset():
    cfg = from_hf_config(MIXTRAL_8X7B)
    assert cfg.replace(name="mixtral-8x7b") == load_preset("mixtral-8x7b")
    assert cfg.param_count() == 46_702_792_704  # the release: 46.7 B
    assert cfg.dense_layers == () and cfg.ffn_size == 0 and cfg.norm_topk_prob and not cfg.qk_norm
    windowed = from_hf_config({**MIXTRAL_8X7B, "sliding_window": 4096})
    assert windowed.sliding_window == 4096 and windowed.sliding_layers == tuple(range(32))
    with pytest.raises(ConfigError, match="'num_local_experts'") as e:
        from_hf_config({k: v for k, v in MIXTRAL_8X7B.items() if k != "num_local_experts"}, "x/config.json")
    assert _one_line(e).startswith("x/config.json")


# GLM-4.5-Air's and OLMoE-1B-7B-0924's published config.json files.
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.54.0",
    "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
    "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 50304,
}


def test_hf_glm45_and_olmoe_match_their_presets():
    glm = from_hf_config(GLM_45_AIR)
    assert glm.replace(name="glm-4.5-air") == load_preset("glm-4.5-air")
    assert glm.param_count() == 106_852_251_264  # the release: 106 B total
    assert (glm.rotary_dim, glm.qkv_bias, glm.qk_norm, glm.router_scoring, glm.dense_layers) == \
        (64, True, False, "sigmoid", (0,))
    # transformers' GLM-4.5 turns half of each head when the file does not say
    assert from_hf_config({k: v for k, v in GLM_45_AIR.items() if k != "partial_rotary_factor"}).rotary_dim == 64
    assert from_hf_config({**GLM_45_AIR, "use_qk_norm": True}).qk_norm
    olmoe = from_hf_config(OLMOE_1B_7B)
    assert olmoe.replace(name="olmoe-1b-7b") == load_preset("olmoe-1b-7b")
    assert olmoe.param_count() == 6_919_161_856  # the release: 6.9 B total
    assert olmoe.qk_norm_whole and olmoe.pre_norms and not olmoe.norm_topk_prob and olmoe.dense_layers == ()


@pytest.mark.parametrize("data, err, what", [
    ({**OLMOE_1B_7B, "clip_qkv": 8.0}, NotSupportedError, "clip_qkv = 8.0"),
    ({**OLMOE_1B_7B, "head_dim": 64}, ConfigError, "field 'head_dim' = 64: expected hidden_size / num_attention_heads"),
    ({**GLM_45_AIR, "partial_rotary_factor": 0.01}, NotSupportedError, "turns 1 of head_dim 128 lanes"),
    ({**GLM_45_AIR, "n_routed_experts": 0, "num_experts_per_tok": 0}, None, None),  # a dense GLM reads as one
])
def test_hf_glm45_and_olmoe_refusals(data, err, what):
    if err is None:
        assert not from_hf_config(data).is_moe
        return
    with pytest.raises(err) as e:
        from_hf_config(data, "x/config.json")
    assert what in _one_line(e) and _one_line(e).startswith("x/config.json")


def test_gemma3_text_defaults_are_transformers():
    """The defaults a sparse text_config leaves to transformers are transformers' own."""
    transformers = pytest.importorskip("transformers")
    from tpumk.model.config import GEMMA3_TEXT_DEFAULTS

    theirs = transformers.Gemma3TextConfig().to_dict()
    assert {k: theirs[k] for k in GEMMA3_TEXT_DEFAULTS} == GEMMA3_TEXT_DEFAULTS
    # and the RoPE and window pattern tpumk's gemma3_text reader assumes when they are absent
    full, local = theirs["rope_parameters"]["full_attention"], theirs["rope_parameters"]["sliding_attention"]
    sparse = from_hf_config({"model_type": "gemma3", "text_config": {}})
    assert (sparse.rope_theta, sparse.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
    assert [i for i in range(sparse.num_layers) if i not in sparse.sliding_layers] == \
        [i for i, t in enumerate(theirs["layer_types"]) if t == "full_attention"]


# Gemma 2 2B's config.json (transformers 4.42 keys: no layer_types, so the even layers slide).
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
}


def test_hf_gemma2_reads_its_soft_caps_and_matches_the_preset():
    cfg = from_hf_config(GEMMA2_2B)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scalar, cfg.post_norms) == (50.0, 30.0, 256.0, True)
    assert cfg.sliding_layers == tuple(range(0, 26, 2)) and not cfg.qk_norm and cfg.tie_embeddings
    assert cfg.replace(name="gemma-2-2b", dtype="bfloat16") == load_preset("gemma-2-2b")
    assert load_preset("gemma-2-2b").param_count() == 2_614_341_888  # the release's count
    # transformers' defaults when the keys are absent; null: no soft-capping
    bare = {k: v for k, v in GEMMA2_2B.items() if not k.endswith("softcapping")}
    assert (from_hf_config(bare).attn_softcap, from_hf_config(bare).final_softcap) == (50.0, 30.0)
    none = from_hf_config({**GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (none.attn_softcap, none.final_softcap) == (0.0, 0.0)
    types = ["full_attention", "sliding_attention"] * 13
    assert from_hf_config({**GEMMA2_2B, "layer_types": types}).sliding_layers == tuple(range(1, 26, 2))
    for bad in (-1.0, 0, "50", float("inf")):
        with pytest.raises(ConfigError, match=r"^x/config.json: field 'attn_logit_softcapping' = .*: expected a "
                                              r"positive number or null$"):
            from_hf_config({**GEMMA2_2B, "attn_logit_softcapping": bad}, "x/config.json")


def test_soft_caps_are_validated_and_refused_with_mla():
    with pytest.raises(ConfigError, match=r"field 'final_softcap' = -3.0: expected a non-negative finite number"):
        load_preset("tiny-dense").replace(final_softcap=-3.0)
    with pytest.raises(ConfigError, match=r"field 'attn_softcap' = 50.0: expected 0 for an MLA model"):
        load_preset("tiny-mla").replace(attn_softcap=50.0)
    assert load_preset("tiny-mla").replace(final_softcap=30.0).final_softcap == 30.0  # the lm_head's cap is shared


# OLMo-2-1124-7B's config.json (transformers 4.47 keys).
OLMO2_7B = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
    "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 100352,
}


def test_hf_olmo2_reads_its_norms_and_matches_the_preset():
    cfg = from_hf_config(OLMO2_7B)
    assert (cfg.pre_norms, cfg.post_norms, cfg.qk_norm, cfg.qk_norm_whole) == (False, True, True, True)
    assert cfg.replace(name="olmo-2-7b", dtype="bfloat16") == load_preset("olmo-2-7b")
    assert load_preset("olmo-2-7b").param_count() == 7_298_617_344  # the release's 7.30 B
    with pytest.raises(NotSupportedError, match="rope_scaling"):
        from_hf_config({**OLMO2_7B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_pre_norms_and_whole_qk_norm_are_validated_and_planned_where_they_build():
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    dense = load_preset("tiny-dense")
    for changes, match in [
        (dict(pre_norms=False), r"field 'pre_norms' = False: expected true unless post_norms is true"),
        (dict(qk_norm=False, qk_norm_whole=True), r"field 'qk_norm_whole' = True: expected false without qk_norm"),
        (dict(pre_norms="no"), r"field 'pre_norms' = 'no': expected true or false"),
    ]:
        with pytest.raises(ConfigError, match=match):
            dense.replace(**changes)
    # post-norms on routed layers (Muse Spark's; tests/test_megakernel_spark.py runs them)
    moe_post = load_preset("tiny-moe").replace(pre_norms=False, post_norms=True)
    assert make_plan(BuildSpec(moe_post, get_target("tpu7x"))).cfg.post_norms
    olmo = dense.replace(pre_norms=False, post_norms=True, qk_norm_whole=True)
    assert make_plan(BuildSpec(olmo, get_target("tpu7x"))).cfg.qk_norm_whole
    # on many devices the rows' sums of squares are all-reduced before the norm: a third
    # collective per layer (test_multidevice.py runs it against the reference on 4 host devices)
    for devices, per_layer in ((2, 3), (4, 3)):
        p = make_plan(BuildSpec(olmo, get_target("tpu7x"), devices=devices))
        assert p.layer_collectives == per_layer and p.collectives_per_step == per_layer * olmo.num_layers + 1
        assert p.sharding.summary(p.whole_model)["collectives_per_layer"] == per_layer
    assert make_plan(BuildSpec(olmo.replace(qk_norm_whole=False), get_target("tpu7x"), devices=2)).layer_collectives == 2
    odd = olmo.replace(hidden_size=192, head_dim=64, num_q_heads=3, num_kv_heads=1)  # a zero KV head would join
    with pytest.raises(PlanError, match=r"num_kv_heads = 1: an odd number of 64-wide KV heads is padded"):
        make_plan(BuildSpec(odd, get_target("tpu7x")))


# Command-R's config.json (c4ai-command-r-v01, transformers 4.x keys).
COMMAND_R = {
    "architectures": ["CohereForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 5,
    "eos_token_id": 255001, "hidden_act": "silu", "hidden_size": 8192, "initializer_range": 0.02,
    "intermediate_size": 22528, "layer_norm_eps": 1e-05, "logit_scale": 0.0625, "max_position_embeddings": 8192,
    "model_type": "cohere", "num_attention_heads": 64, "num_hidden_layers": 40, "num_key_value_heads": 64,
    "pad_token_id": 0, "rope_theta": 8000000.0, "torch_dtype": "float16", "use_cache": True, "use_qk_norm": False,
    "vocab_size": 256000,
}


def test_hf_cohere_reads_layer_norms_and_parallel_blocks():
    cfg = from_hf_config(COMMAND_R)
    assert (cfg.norm_kind, cfg.parallel_blocks, cfg.rms_eps, cfg.qk_norm, cfg.tie_embeddings) == \
        ("layer", True, 1e-5, False, True)
    assert cfg.replace(name="command-r") == load_preset("command-r")
    assert cfg.param_count() == 34_980_831_232  # tpumk's count; the release says 35 B
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.dtype) == \
        (8192, 128, 64, 8e6, "bfloat16")
    # one norm per layer (no mlp_norm): 40 x 8192 fewer parameters than the same model in series
    assert cfg.replace(parallel_blocks=False).param_count() - cfg.param_count() == 40 * 8192
    from tpumk.model.weights import expected_shapes

    assert "mlp_norm" not in expected_shapes(cfg)["layers"][0]
    with pytest.raises(NotSupportedError, match=r"use_qk_norm = true"):
        from_hf_config({**COMMAND_R, "use_qk_norm": True})
    with pytest.raises(ConfigError, match=r"field 'logit_scale' = 0: expected a positive number"):
        from_hf_config({**COMMAND_R, "logit_scale": 0})


def test_layer_norm_and_parallel_blocks_are_validated_and_planned():
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    dense = load_preset("tiny-dense").replace(qk_norm=False)
    for base, changes, match in [
        (dense, dict(norm_kind="batch"), r"field 'norm_kind' = 'batch': expected one of rms, layer"),
        (load_preset("tiny-dense"), dict(norm_kind="layer"), r"field 'norm_kind' = 'layer': expected 'rms' for an "
                                                            r"MLA model or with qk_norm"),
        (dense, dict(parallel_blocks=True, post_norms=True), r"field 'parallel_blocks' = True: expected false with "
                                                            r"post_norms"),
        (load_preset("tiny-moe").replace(qk_norm=False), dict(parallel_blocks=True), r"field 'parallel_blocks'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            base.replace(**changes)
    cohere = dense.replace(norm_kind="layer", parallel_blocks=True)
    for devices in (1, 2):  # on 2 devices: tests/test_multidevice.py's dense-2dev-cohere
        assert make_plan(BuildSpec(cohere, get_target("tpu7x"), devices=devices)).cfg.parallel_blocks


# Qwen2.5-7B's published config.json (transformers 4.x keys).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 152064,
}


def test_hf_qwen25_reads_its_biases_and_matches_the_preset():
    cfg = from_hf_config(QWEN25_7B)
    assert cfg.qkv_bias and not cfg.qk_norm and not cfg.sliding_window  # use_sliding_window false: no window
    assert cfg.replace(name="qwen2.5-7b") == load_preset("qwen2.5-7b")
    assert load_preset("qwen2.5-7b").param_count() == 7_615_616_512  # the release's parameter count


# Gemma-7B's published config.json (transformers 4.38 keys: the legacy hidden_act "gelu", which
# transformers' GemmaConfig reads as the tanh approximation).
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0",
    "use_cache": True, "vocab_size": 256000,
}


def test_hf_gemma_reads_geglu_and_its_embedding_scale_and_matches_the_preset():
    cfg = from_hf_config(GEMMA_7B)
    assert (cfg.mlp_act, cfg.embed_scale, cfg.tie_embeddings, cfg.qk_norm) == ("gelu_tanh", 3072 ** 0.5, True, False)
    assert cfg.replace(name="gemma-7b") == load_preset("gemma-7b")
    assert round(load_preset("gemma-7b").param_count() / 1e9, 2) == 8.54  # the release's 8.54 B
    # transformers 5 writes hidden_activation; tied embeddings are Gemma's default
    new = {k: v for k, v in GEMMA_7B.items() if k != "hidden_act"}
    assert from_hf_config({**new, "hidden_activation": "gelu_pytorch_tanh"}).mlp_act == "gelu_tanh"
    with pytest.raises(NotSupportedError, match="hidden_activation 'relu'"):
        from_hf_config({**new, "hidden_activation": "relu"})


@pytest.mark.parametrize("changes, field, expected", [
    (dict(mlp_act="gelu"), "mlp_act", "one of silu, gelu_tanh"),
    (dict(embed_scale=0.0), "embed_scale", "a positive finite number"),
    (dict(embed_scale=float("inf")), "embed_scale", "a positive finite number"),
])
def test_mlp_act_and_embed_scale_are_validated(changes, field, expected):
    with pytest.raises(ConfigError) as e:
        load_preset("tiny-dense").replace(**changes)
    msg = _one_line(e)
    assert f"field '{field}'" in msg and expected in msg


def test_geglu_is_refused_for_mixture_of_experts_models():
    with pytest.raises(ConfigError, match="'mlp_act' = 'gelu_tanh': expected silu for a mixture-of-experts model"):
        load_preset("tiny-moe").replace(mlp_act="gelu_tanh")


def test_new_fields_at_their_defaults_leave_the_config_dict_unchanged():
    d = load_preset("qwen3-8b").to_dict()
    assert "mlp_act" not in d and "embed_scale" not in d  # the cache keys of earlier models stay
    g = load_preset("gemma-7b").to_dict()
    assert (g["mlp_act"], g["embed_scale"]) == ("gelu_tanh", 3072 ** 0.5)


# Phi-3-mini-4k-instruct's published config.json (transformers 4.x keys).
PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
    "use_cache": True, "vocab_size": 32064,
}


def test_hf_phi3_reads_with_its_window_on_every_layer_and_plans_its_96_wide_heads_padded():
    """Phi-3-mini: 32 heads of 96 (hidden / heads), a 2047-token window on every layer; the plan
    runs the heads 128 lanes wide (tpumk.plan.padding), the softmax scale still 1 / sqrt(96), and
    refuses a group-scaled format whose scale groups would straddle the padded heads."""
    from tpumk.errors import NotSupportedError
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    cfg = from_hf_config(PHI3_MINI_4K)
    assert cfg.replace(name="phi-3-mini") == load_preset("phi-3-mini")
    assert (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (3072, 32, 32, 96)
    assert (cfg.ffn_size, cfg.vocab_size, cfg.rms_eps, cfg.rope_theta) == (8192, 32064, 1e-5, 10000.0)
    assert (cfg.sliding_window, cfg.sliding_layers) == (2047, tuple(range(32)))
    assert not cfg.qk_norm and cfg.rope_scaling == "none" and not cfg.tie_embeddings
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x")))
    assert (plan.cfg.head_dim, plan.cfg.attention.true_head_dim, plan.attention.score_dim) == (128, 96, 96)
    assert plan.summary()["lane_padding"]["head_dim"] == [96, 128]
    with pytest.raises(NotSupportedError) as e:
        make_plan(BuildSpec(cfg, get_target("tpu7x"), quant="fp8-b128"))
    assert "head_dim = 96 runs padded to 128 lanes" in _one_line(e)


def test_hf_phi3_partial_rotary_turns_part_of_each_head():
    """partial_rotary_factor (Phi-4-mini: 0.75; top level in transformers 4.x, in rope_parameters
    in 5.x): int(head_dim x factor) lanes turn, as transformers' Phi-3 modelling counts them."""
    assert from_hf_config({**PHI3_MINI_4K, "partial_rotary_factor": 0.75}).rotary_dim == 72
    five = {**PHI3_MINI_4K, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    assert from_hf_config(five).rotary_dim == 48
    assert from_hf_config({**PHI3_MINI_4K, "partial_rotary_factor": 1.0}).rotary_dim == 0
    assert from_hf_config({**PHI3_MINI_4K, "partial_rotary_factor": 0.51}).rotary_dim == 48  # int(48.96)
    for factor, err, what in ((0.01, NotSupportedError, "turns 0 of head_dim 96 lanes"),
                              (0.49, NotSupportedError, "turns 47 of head_dim 96 lanes"),
                              (1.5, ConfigError, "expected a number in (0, 1]")):
        with pytest.raises(err) as e:
            from_hf_config({**PHI3_MINI_4K, "partial_rotary_factor": factor}, "x/config.json")
        assert what in _one_line(e) and _one_line(e).startswith("x/config.json")
    # Llama's modelling rotates the whole head whatever the factor: refused rather than built wrong
    llama = {**LLAMA_31_8B, "rope_scaling": None,
             "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}}
    for data, what in ((llama, "rope_parameters.partial_rotary_factor = 0.5 for model_type 'llama'"),
                       ({**LLAMA_31_8B, "partial_rotary_factor": 0.5}, "field 'partial_rotary_factor' is not a field "
                                                                         "of model_type 'llama'")):
        with pytest.raises(NotSupportedError) as e:
            from_hf_config(data, "x/config.json")
        assert what in _one_line(e)


def test_hf_mistral_window_is_on_every_layer_and_llama_has_none():
    cfg = from_hf_config({**MISTRAL_7B_V03, "sliding_window": 4096, "num_hidden_layers": 3})
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, (0, 1, 2))
    # Llama's attention has no window: a config that sets one is not a Llama's (SmolLM3, Mistral relabelled?)
    assert from_hf_config({**LLAMA_31_8B, "sliding_window": None}).sliding_window == 0
    with pytest.raises(NotSupportedError, match="sliding_window = 4096"):
        from_hf_config({**LLAMA_31_8B, "sliding_window": 4096})


def test_hf_linear_rope_and_rope_parameters():
    cfg = from_hf_config({**MISTRAL_7B_V03, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 2.0)
    v5 = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    cfg = from_hf_config({**v5, "rope_parameters": {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}})
    assert cfg.replace(name="llama-3.1-8b") == load_preset("llama-3.1-8b")


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "low_freq_factor"),
    ({"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "factor"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "rope_high_freq_factor"),
])
def test_hf_bad_rope_scaling_names_the_field(rope, field):
    with pytest.raises(ConfigError) as e:
        from_hf_config({**LLAMA_31_8B, "rope_scaling": rope}, "x/config.json")
    msg = _one_line(e)
    assert field in msg and msg.startswith("x/config.json")


def _phi4_like(**rope_changes) -> dict:
    """PHI3_MINI_4K with Phi-4-mini's RoPE: 0.75 of each 96-wide head (36 frequencies), LongRoPE."""
    rope = {"type": "longrope", "short_factor": [1.0] * 36, "long_factor": [2.0] * 36, **rope_changes}
    return {**PHI3_MINI_4K, "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_scaling": rope}


@pytest.mark.parametrize("change, field", [
    ({"short_factor": [1.0] * 35}, "rope_short_factor"),  # one per rotary frequency
    ({"long_factor": "2"}, "long_factor"),
    ({"short_factor": [1.0] * 35 + [-1.0]}, "short_factor"),
    ({"attention_factor": "x"}, "attention_factor"),
])
def test_hf_bad_longrope_names_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        from_hf_config(_phi4_like(**change), "x/config.json")
    msg = _one_line(e)
    assert field in msg and msg.startswith("x/config.json")


def test_longrope_build_context_stays_within_its_original_length():
    """transformers turns to the long factors once a sequence passes original_max_position_embeddings
    (and keeps the keys it cached with the short ones): a build past it is refused in one line."""
    from tpumk.errors import PlanError
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    cfg = from_hf_config(_phi4_like(), "x/config.json")
    assert (cfg.rope_scaling, cfg.rope_factor, len(cfg.rope_short_factor)) == ("longrope", 32.0, 36)
    BuildSpec(cfg, get_target("tpu7x"), context=4096).validate()
    with pytest.raises(PlanError, match=r"context = 4160: expected at most 4,096 .*longrope"):
        BuildSpec(cfg, get_target("tpu7x"), context=4160).validate()
    assert from_dict(cfg.to_dict(), "round trip") == cfg  # factors survive to_dict (artifacts, cache keys)


def test_hf_dynamic_rope_is_refused_for_good():
    with pytest.raises(NotSupportedError) as e:
        from_hf_config({**LLAMA_31_8B, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "x/config.json")
    assert "rope_type 'dynamic'" in _one_line(e) and "changes with the sequence length" not in _one_line(e)


@pytest.mark.parametrize("kind", ["default", "linear", "llama3"])
def test_rope_frequencies_match_transformers(kind):
    """tpumk.model.rope.inv_freq against transformers' own RoPE initialisers, to a few float32
    ulps (numpy's and torch's float32 pow round differently; a wrong band or factor is off by
    whole factors)."""
    import numpy as np
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tpumk.model.rope import inv_freq

    rope = {"default": {}, "linear": {"factor": 4.0},
            "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}[kind]
    hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,
                                  rope_parameters={"rope_type": kind, "rope_theta": 500000.0, **rope})
    # "default" is the plain formula every initialiser starts from (torch, float32)
    want, factor = (ROPE_INIT_FUNCTIONS[kind](hf, "cpu") if kind != "default"
                    else (1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128), 1.0))
    cfg = from_hf_config({**LLAMA_31_8B, "head_dim": 128, "rope_scaling": None,
                          **({"rope_scaling": {"rope_type": kind, **rope}} if kind != "default" else {})})
    got = inv_freq(cfg.positions)
    assert factor == 1.0 and got.dtype == np.float32
    np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=8 * 2 ** -24)


def test_hf_default_rope_is_supported():
    cfg = from_hf_config({**QWEN3_8B, "rope_scaling": {"rope_type": "default"}})
    assert cfg.rope_theta == 1e6
    cfg = from_hf_config({**QWEN3_8B, "rope_theta": None, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 5e5}})
    assert cfg.rope_theta == 5e5


def test_load_hf_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON") as e:
        load_hf_config(tmp_path)
    _one_line(e)


# ---------------------------------------------------------------------- sliding windows
@pytest.mark.parametrize("changes, window, layers", [
    # transformers' Qwen3: no window unless use_sliding_window (sliding_window alone is ignored)
    ({"sliding_window": 4096}, 0, ()),
    # without layer_types: the layers from max_window_layers on slide
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}, 4096, tuple(range(28, 36))),
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 36}, 0, ()),
    # layer_types, when given, names the sliding layers
    ({"use_sliding_window": True, "sliding_window": 512,
      "layer_types": ["sliding_attention", "full_attention"] * 18}, 512, tuple(range(0, 36, 2))),
])
def test_hf_sliding_window_qwen3(changes, window, layers):
    cfg = from_hf_config({**QWEN3_8B, **changes})
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, layers)
    assert [cfg.pattern.window(i) for i in range(36)] == [window if i in layers else 0 for i in range(36)]


def test_hf_sliding_window_qwen3_moe_covers_every_layer():
    cfg = from_hf_config({**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 1024})
    assert (cfg.sliding_window, cfg.sliding_layers) == (1024, tuple(range(48)))


def test_hf_sliding_window_matches_transformers_config():
    """The layer kinds are those transformers' own Qwen3Config derives."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3Config(num_hidden_layers=5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, use_sliding_window=True, sliding_window=6, max_window_layers=2)
    cfg = from_hf_config({**hf.to_dict(), "model_type": "qwen3"})
    assert cfg.sliding_window == hf.sliding_window == 6
    assert cfg.sliding_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")


@pytest.mark.parametrize("changes, field", [
    ({"layer_types": ["sliding_attention"] * 36}, "layer_types"),  # no window to slide
    ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
    ({"use_sliding_window": True, "sliding_window": -4}, "sliding_window"),
    ({"use_sliding_window": "yes", "sliding_window": 4}, "use_sliding_window"),
])
def test_hf_bad_sliding_window(changes, field):
    with pytest.raises(ConfigError, match=f"'{field}'") as e:
        from_hf_config({**QWEN3_8B, **changes}, "x/config.json")
    _one_line(e)


@pytest.mark.parametrize("changes, field", [
    (dict(sliding_window=-1), "sliding_window"),
    (dict(sliding_window=8), "sliding_layers"),  # a window for no layer
    (dict(sliding_layers=[1]), "sliding_layers"),  # layers without a window
    (dict(sliding_window=8, sliding_layers=[2]), "sliding_layers"),  # out of range (2 layers)
])
def test_bad_sliding_window_fields(changes, field):
    base = load_preset("tiny-dense").to_dict()
    with pytest.raises(ConfigError, match=f"field '{field}'") as e:
        from_dict({**base, **changes}, "m.toml")
    _one_line(e)


def test_sliding_window_round_trips_through_a_dict():
    cfg = load_preset("tiny-dense").replace(sliding_window=8, sliding_layers=[1, 0, 1])
    assert cfg.sliding_layers == (0, 1)
    assert from_dict(cfg.to_dict(), "m") == cfg


def test_smollm2_135m_config_reads_and_plans_lane_padded():
    """SmolLM2-135M's published config (a Llama, hidden 576, 9 query / 3 KV heads of 64): read,
    then planned as its lane-padded copy (hidden 640, 12 / 4 heads), RMSNorm still over 576."""
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    smol = {**LLAMA_31_8B, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
            "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30, "rope_scaling": None,
            "rope_theta": 100000, "tie_word_embeddings": True, "vocab_size": 49152}
    cfg = from_hf_config(smol)
    assert (cfg.hidden_size, cfg.num_kv_heads, cfg.rope_scaling, cfg.qk_norm) == (576, 3, "none", False)
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x")))
    assert (plan.cfg.hidden_size, plan.cfg.num_q_heads, plan.cfg.num_kv_heads, plan.cfg.norms.width) == (640, 12, 4, 576)
    pad = plan.summary()["lane_padding"]
    assert pad["hidden_size"] == [576, 640] and pad["parameters"][0] == cfg.param_count()


def test_hf_granite_reads_as_a_llama_and_refuses_a_non_positive_scalar():
    """Granite's scalars are folded into the weights when a checkpoint loads, so its config reads
    as a Llama's; a scalar of 0 or below is refused in one line naming the field."""
    granite = {**LLAMA_31_8B, "model_type": "granite", "rope_scaling": None, "embedding_multiplier": 12.0,
               "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "logits_scaling": 8.0}
    cfg = from_hf_config(granite)
    assert (cfg.hidden_size, cfg.num_kv_heads, cfg.qk_norm, cfg.qkv_bias) == (4096, 8, False, False)
    with pytest.raises(ConfigError) as e:
        from_hf_config({**granite, "logits_scaling": 0}, "g/config.json")
    assert _one_line(e) == "g/config.json: field 'logits_scaling' = 0: expected a positive number"


def test_rotary_dim_is_validated_and_keeps_older_descriptions():
    dense = load_preset("tiny-dense")
    assert "rotary_dim" not in dense.to_dict()  # 0: older models' descriptions (and keys) unchanged
    assert dense.replace(rotary_dim=64).to_dict()["rotary_dim"] == 64
    for cfg, changes, match in (
        (dense, dict(rotary_dim=63), r"field 'rotary_dim' = 63: expected an even integer in \[0, the head width 128\]"),
        (dense, dict(rotary_dim=256), r"field 'rotary_dim' = 256"),
        (load_preset("tiny-mla"), dict(rotary_dim=8), r"field 'rotary_dim' = 8: expected 0 for an MLA model"),
    ):
        with pytest.raises(ConfigError, match=match):
            cfg.replace(**changes)


# Qwen1.5-MoE-A2.7B's published config.json (model_type qwen2_moe).
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
    "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe", "num_attention_heads": 16,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}


def test_hf_qwen2_moe_reads_its_gated_shared_expert():
    cfg = from_hf_config(QWEN15_MOE)
    assert cfg.param_count() == 14_315_784_192  # the release: 14.3 B total
    assert (cfg.num_shared_experts, cfg.shared_expert_ffn_size, cfg.shared_expert_gate) == (1, 5632, True)
    assert cfg.qkv_bias and not cfg.norm_topk_prob and cfg.dense_layers == () and cfg.sliding_window == 0
    assert not from_hf_config({**QWEN15_MOE, "qkv_bias": False}).qkv_bias
    with pytest.raises(NotSupportedError) as e:
        from_hf_config({**QWEN15_MOE, "use_sliding_window": True}, "x/config.json")
    assert "use_sliding_window = true (Qwen2-MoE's sliding window" in _one_line(e)


def test_shared_expert_gate_is_validated():
    moe = load_preset("tiny-moe")
    assert "shared_expert_gate" not in moe.to_dict()
    assert moe.replace(shared_expert_gate=True).param_count() - moe.param_count() == 2 * moe.hidden_size  # 2 MoE layers
    for changes in (dict(num_shared_experts=0, shared_expert_ffn_size=0), dict(router_correction_bias=True)):
        with pytest.raises(ConfigError, match=r"field 'shared_expert_gate' = True: expected false without shared"):
            moe.replace(shared_expert_gate=True, **changes)


def test_preset_names_match_case_insensitively_with_a_suggestion():
    assert resolve_model("Qwen3-8B") == load_preset("qwen3-8b")  # as the model card writes it
    assert load_preset("GLM-4.5-Air").name == "glm-4.5-air"
    for near, name in (("qwen3-8", "qwen3-8b"), ("qwen-3-8b", "qwen3-8b"), ("lama-3.1-8b", "llama-3.1-8b")):
        with pytest.raises(ConfigError, match=f"unknown model preset '{near}' \\(did you mean '{name}'\\?\\)"):
            resolve_model(near)
    with pytest.raises(ConfigError) as e:
        resolve_model("zzz")
    assert "did you mean" not in str(e.value) and "presets: " in str(e.value)


def test_every_field_belongs_to_a_part_and_parts_check_their_own():
    """The flat description and its parts (tpumk.model.parts) stay in step: a field no part
    holds would be read by no stage; a part's check names the flat field a user writes."""
    from tpumk.model import parts
    held = {f.name for cls in (parts.Attention, parts.Positions, parts.Norms, parts.Mlp, parts.Moe,
                               parts.LayerPattern, parts.Head, parts.LinearAttention) for f in dataclasses.fields(cls)}
    stored = {f.name for f in dataclasses.fields(ModelConfig)}
    assert stored - held == {"name", "dtype"}
    assert held - stored == {"head_lanes", "mla", "moe"}  # derived from other parts
    cfg = load_preset("qwen3-8b")
    assert (cfg.attention.group, cfg.attention.kv_cache_width, cfg.positions.rotary_width, cfg.norms.width) == \
        (4, 2 * 8 * 128, 128, 4096)
    assert cfg.pattern.num_dense == 36 and not cfg.moe and cfg.replace(name="x").attention == cfg.attention
    with pytest.raises(ConfigError, match=r"field 'attn_softcap' = -1\.0: expected a non-negative finite number"):
        cfg.replace(attn_softcap=-1.0)
    with pytest.raises(ConfigError, match=r"field 'mlp_act' = 'gelu_tanh': expected silu for a mixture-of-experts"):
        load_preset("qwen3-30b-a3b").replace(mlp_act="gelu_tanh")


# gpt-oss-20b's published config.json (openai/gpt-oss-20b); gpt-oss-120b's differs in the
# layer count, layer_types and num_local_experts.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_hf_gpt_oss_matches_its_presets():
    cfg = from_hf_config(GPT_OSS_20B)
    assert cfg.replace(name="gpt-oss-20b") == load_preset("gpt-oss-20b")
    assert cfg.param_count() == 20_914_757_184  # the release's model card: 20.91 B
    big = from_hf_config({**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                          "layer_types": ["sliding_attention", "full_attention"] * 18})
    assert big.replace(name="gpt-oss-120b") == load_preset("gpt-oss-120b")
    assert big.param_count() == 116_829_156_672  # 116.83 B
    # transformers' defaults where the file is silent: YaRN over 4096 tokens, theta 150000, the
    # even layers sliding 128 tokens, attention biases, the clamp's constants
    bare = {k: v for k, v in GPT_OSS_20B.items()
            if k not in ("rope_scaling", "rope_theta", "layer_types", "sliding_window", "attention_bias", "swiglu_limit")}
    assert from_hf_config(bare) == cfg
    for bad, match in [({"swiglu_limit": -1.0}, "'swiglu_limit'"), ({"num_local_experts": 0}, "top_k"),
                       ({"layer_types": ["linear_attention"] * 24}, "layer type 'linear_attention'")]:
        with pytest.raises((ConfigError, NotSupportedError), match=match) as e:
            from_hf_config({**GPT_OSS_20B, **bad}, "x/config.json")
        assert _one_line(e).startswith(("x/config.json", "model config"))
