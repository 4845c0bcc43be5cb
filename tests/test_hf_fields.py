"""Every field of a Hugging Face config.json is accounted for (tpumk.model.hf_fields): modelled,
harmless, or refused at a value that changes the math; any other key is refused in one line
naming it. So a config relabelled from a neighbouring family (a SmolLM3 config relabelled
`llama`, a Ministral 3 one `mistral`, an OLMo 3 one `olmo2`), which transformers would load as
the named family with the extra fields silently unread, is refused instead of built wrong.

- The field walk: each family's transformers config class (its dataclass fields, PreTrainedConfig's
  base fields and the attribute_map names) against the family's three lists, so a transformers
  that adds a field fails here until the field is classified.
- The relabel cases: configs written by transformers' own classes of neighbouring families,
  relabelled to a family tpumk reads: each refused naming the fields, or, where the config
  alone cannot tell (every field a field of the named family), refused when the checkpoint
  loads, naming the tensor the named family lacks.
- Releases' own extra keys (DeepSeek-V3's ep_size, Phi-4-mini's full_attn_mod, SmolLM2's
  is_llama_config, ...) are accepted; files that say two things at once are refused; the
  refusals of unsupported families name what is missing; Kimi K2.5's wrapper is read through
  its text_config and its checkpoint through the wrapper's tensor names.

Config-level tests take milliseconds; the two checkpoint tests build tiny torch models.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import hf_utils  # first: offline hub, quiet transformers
import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from test_config import (GEMMA2_2B, GEMMA3_1B, GLM_45_AIR, GPT_OSS_20B, LLAMA_31_8B, PHI3_MINI_4K, QWEN3_8B,
                         QWEN3_30B_A3B, QWEN25_7B, COMMAND_R, _one_line)
from test_mla import DEEPSEEK_V3_JSON
from tpumk.errors import CheckpointError, ConfigError, NotSupportedError
from tpumk.model.checkpoint import load_checkpoint
from tpumk.model.config import _HF_SUPPORTED, from_hf_config
from tpumk.model.hf_defaults import CLASS_DEFAULTS, ROPE_DEFAULTS, ROPE_TABLE_DEFAULTS
from tpumk.model.hf_fields import (COMMON_HARMLESS, COMMON_REFUSED, FAMILIES, UNSUPPORTED_FAMILIES, WRAPPERS, Refused, account_fields,
                                   fold_aliases)

ALL_ACCOUNTED = [*FAMILIES, *WRAPPERS]


def _accounting(model_type: str):
    return FAMILIES[model_type] if model_type in FAMILIES else WRAPPERS[model_type].fields


def _config_class(model_type: str):
    return CONFIG_MAPPING["deepseek_v3" if model_type == "kimi_k2" else model_type]  # Kimi K2 loads as DeepSeek-V3


def _written(model_type: str, **kw) -> dict:
    """The config.json transformers' own class of `model_type` writes."""
    return json.loads(_config_class(model_type)(**kw).to_json_string())


# ---------------------------------------------------------------------- the field walk
@pytest.mark.parametrize("model_type", ALL_ACCOUNTED)
def test_every_field_of_the_transformers_class_is_accounted_for(model_type):
    """Each field of transformers' config class (PreTrainedConfig's included) and each
    attribute_map name is modelled, harmless or refused; an alias of a modelled field is renamed
    to it (a file may write either name: tpumk must read both, not refuse or ignore one)."""
    fam, cls = _accounting(model_type), _config_class(model_type)
    names = {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map) | set(cls.attribute_map.values())
    unaccounted = sorted(n for n in names if fam.kind(n) is None and n not in fam.aliases)
    assert not unaccounted, (f"{cls.__name__} has fields tpumk.model.hf_fields does not classify for {model_type!r}: "
                             f"{unaccounted}")
    for alias, name in cls.attribute_map.items():
        if "modelled" in (fam.kind(alias), fam.kind(name)):
            assert fam.aliases.get(alias) == name or fam.aliases.get(name) == alias, (model_type, alias, name)


def test_generation_settings_and_base_fields_are_harmless_everywhere():
    """Sampling settings transformers pops from a config (4.x configs saved them) never change
    the decode step; PreTrainedConfig's own fields are classified once for every family."""
    popped = set(transformers.GenerationConfig._get_default_generation_params())
    assert popped <= set(COMMON_HARMLESS), sorted(popped - set(COMMON_HARMLESS))
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    assert all(FAMILIES["qwen3"].kind(n) for n in base)


def test_the_tables_agree_with_the_reader_and_transformers():
    assert tuple(FAMILIES) == _HF_SUPPORTED  # adding a family is one FAMILIES entry (and its reader)
    known = set(CONFIG_MAPPING.keys())
    assert set(UNSUPPORTED_FAMILIES) <= known and not set(UNSUPPORTED_FAMILIES) & set(FAMILIES)
    assert set(WRAPPERS) <= known and all(set(w.text_types) <= set(FAMILIES) for w in WRAPPERS.values())


@pytest.mark.parametrize("model_type", ALL_ACCOUNTED)
def test_what_transformers_writes_is_read(model_type):
    """The config.json transformers' class writes (every field, derived ones included:
    DeepSeek-V3's head_dim and qk_head_dim, Gemma 3's _sliding_window_pattern) reads."""
    kw = {"head_dim": 128} if model_type == "glm4_moe" else {}  # its default hidden 4096 / 96 heads is no head width
    data = {**_written(model_type, **kw), "model_type": model_type}
    assert from_hf_config(data, model_type).num_layers > 0


# ---------------------------------------------------------------------- fields left out
WITH_CLASS = [t for t in FAMILIES if t in CONFIG_MAPPING]
_SIZED = {"glm4_moe": {"head_dim": 128}}  # its default hidden 4096 / 96 heads is no head width


def _class_default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_the_defaults_tpumk_fills_in_are_transformers_class_defaults():
    assert set(CLASS_DEFAULTS) == set(WITH_CLASS)
    for model_type, table in CLASS_DEFAULTS.items():
        cls = CONFIG_MAPPING[model_type]
        for key, value in table.items():
            assert FAMILIES[model_type].kind(key) == "modelled", (model_type, key)
            want = _class_default(cls, key)
            assert (want, type(want)) == (value, type(value)), (model_type, key, want, value)
    for model_type, rope in ROPE_DEFAULTS.items():
        table = CONFIG_MAPPING[model_type]().rope_parameters
        assert rope == {"rope_theta": table["rope_theta"],
                        "partial_rotary_factor": table.get("partial_rotary_factor", 1.0)}, model_type
    for model_type, rope in ROPE_TABLE_DEFAULTS.items():  # whole tables, less what the reader derives
        table = CONFIG_MAPPING[model_type]().rope_parameters
        assert rope == {k: v for k, v in table.items() if k not in ("type", "max_position_embeddings",
                                                                     "partial_rotary_factor")}, model_type
        assert table.get("partial_rotary_factor", 0.5) == 0.5  # Mistral 4's qk_rope 64 / head_dim 128


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_field_left_out_is_read_as_transformers_reads_it(model_type):
    """Each key of the config transformers writes for the family, left out in turn: tpumk reads
    the file as transformers' class fills it in (its default, or what it derives), or refuses it
    in one line. Was: DeepSeek-V3 without norm_topk_prob read as false (transformers: true), a
    Mistral without sliding_window as unwindowed (4096), Mixtral's theta 10000 (1e6), Qwen3-Next's
    head_dim hidden / heads (256) and RoPE on whole heads (0.25), rms_norm_eps 1e-6 for the
    families whose default is 1e-5, ..."""
    full = {**_written(model_type, **_SIZED.get(model_type, {})), "model_type": model_type}
    silent = []
    for key in sorted(set(full) - {"model_type"}):
        data = {k: v for k, v in full.items() if k != key}
        try:
            got = from_hf_config(data, model_type)
        except (ConfigError, NotSupportedError) as e:
            assert "\n" not in str(e)
            continue
        filled = {**_written(model_type, **{k: v for k, v in data.items() if k != "model_type"}),  # kimi_k2: as DeepSeek-V3
                  "model_type": model_type}  # what transformers' class makes of the file
        want = from_hf_config(filled, model_type)
        differ = {f.name: (getattr(want, f.name), getattr(got, f.name)) for f in dataclasses.fields(want)
                  if f.name != "name" and getattr(want, f.name) != getattr(got, f.name)}
        if differ:
            silent.append((key, differ))
    assert not silent, f"{model_type}: left out, read otherwise than transformers reads it (field, (want, got)): {silent}"


# ---------------------------------------------------------------------- one line each
def test_a_field_of_another_family_is_refused_naming_it():
    with pytest.raises(NotSupportedError) as e:
        from_hf_config({**LLAMA_31_8B, "no_rope_layers": [1, 1, 0, 1]}, "x/config.json")
    assert _one_line(e) == ("x/config.json: not supported: field 'no_rope_layers' is not a field of model_type 'llama' "
                            "that tpumk models (a config relabelled from another family?)")
    assert from_hf_config(LLAMA_31_8B) == from_hf_config({**LLAMA_31_8B, "do_sample": True, "auto_map": {}})


def _non_neutral(r: Refused):
    return next(v for v in (True, 7, 0.5, "x", ["sliding_attention"], {"a": 1}) if not r.accepts(v))


REFUSED = sorted({(mt, key) for mt in ALL_ACCOUNTED for key in _accounting(mt).refused}
                 | {("qwen3", key) for key in COMMON_REFUSED})


@pytest.mark.parametrize("model_type, key", REFUSED)
def test_a_refused_field_is_refused_unless_neutral(model_type, key):
    fam = _accounting(model_type)
    r = fam.refusal(key)
    if not callable(r.neutral):
        for v in r.neutral:
            account_fields({"model_type": model_type, key: v}, model_type, "x/config.json", fam)
    bad = _non_neutral(r)
    with pytest.raises(NotSupportedError) as e:
        account_fields({"model_type": model_type, key: bad}, model_type, "x/config.json", fam)
    assert _one_line(e).startswith(f"x/config.json: not supported yet: {key} = ")


def test_transformers_aliases_are_read_as_the_field():
    """transformers' attribute_map lets a file write num_local_experts for GLM-4.5's and
    DeepSeek-V3's n_routed_experts: read as the experts, not ignored (a dense model, before)."""
    glm = {k: v for k, v in GLM_45_AIR.items() if k != "n_routed_experts"}
    assert from_hf_config({**glm, "num_local_experts": 128}) == from_hf_config(GLM_45_AIR)
    ds = {k: v for k, v in DEEPSEEK_V3_JSON.items() if k != "n_routed_experts"}
    assert from_hf_config({**ds, "num_local_experts": 256}).num_experts == 256
    moe = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert from_hf_config({**moe, "num_local_experts": 128}) == from_hf_config(QWEN3_30B_A3B)
    with pytest.raises(ConfigError) as e:
        from_hf_config({**GLM_45_AIR, "num_local_experts": 64}, "x/config.json")
    assert "fields 'num_local_experts' = 64 and 'n_routed_experts' = 128 name the same setting" in _one_line(e)
    assert fold_aliases({"num_experts": 8}, FAMILIES["mixtral"], "s") == {"num_local_experts": 8}


# Keys the public releases of each family write beside their transformers class's fields
# (recalled from the published config.json files; each is harmless or neutral there).
# GLM-4.7-Flash's release (zai-org/GLM-4.7-Flash, as its config.json is quoted in public test
# suites): transformers' Glm4MoeLiteConfig fields, and beside them the remote-code settings
# first_k_dense_replace / topk_method, the MTP layer count and a neutral partial_rotary_factor
GLM_47_FLASH = {
    "model_type": "glm4_moe_lite", "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
    "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False, "max_position_embeddings": 202752,
    "rope_theta": 1e6, "rope_scaling": None, "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "tie_word_embeddings": False,
    "dtype": "bfloat16"}
RELEASE_EXTRAS = {
    "glm-4.7-flash": (GLM_47_FLASH, {"first_k_dense_replace": 1, "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
                                     "partial_rotary_factor": 1.0, "attention_dropout": 0.0, "pad_token_id": 154820,
                                     "architectures": ["Glm4MoeLiteForCausalLM"]}),
    "deepseek-v3": (DEEPSEEK_V3_JSON, {"aux_loss_alpha": 0.001, "ep_size": 1, "seq_aux": True, "pretraining_tp": 1,
                                       "bos_token_id": 0, "eos_token_id": 1, "auto_map": {"AutoConfig": "x"},
                                       "use_cache": True, "transformers_version": "4.33.1", "initializer_range": 0.02,
                                       "attention_dropout": 0.0, "num_nextn_predict_layers": 1,
                                       "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                               "quant_method": "fp8", "weight_block_size": [128, 128]}}),
    "smollm2": (LLAMA_31_8B, {"is_llama_config": True, "rope_interleaved": False, "pretraining_tp": 1,
                              "mlp_bias": False}),
    "phi-4-mini": ({**PHI3_MINI_4K, "partial_rotary_factor": 0.75},
                   {"full_attn_mod": 1, "interpolate_factor": 1, "lm_head_bias": False, "mlp_bias": False,
                    "attention_bias": False}),
    "gemma-2-9b": (GEMMA2_2B, {"sliding_window_size": 4096, "cache_implementation": "hybrid",
                               "hidden_act": "gelu_pytorch_tanh"}),
    "gemma-3-1b": (GEMMA3_1B, {"cache_implementation": "hybrid", "_sliding_window_pattern": 6,
                               "use_bidirectional_attention": False}),
    "deepseek-r1-distill-qwen": (QWEN25_7B, {"use_mrope": False, "max_window_layers": 28}),
    "command-r": (COMMAND_R, {"model_max_length": 131072, "use_qk_norm": False}),
    "gpt-oss": (GPT_OSS_20B, {"experts_per_token": 4, "initial_context_length": 4096}),
    "unsloth": (QWEN3_8B, {"unsloth_fixed": True}),
}


@pytest.mark.parametrize("name", RELEASE_EXTRAS)
def test_release_extra_keys_are_read(name):
    base, extra = RELEASE_EXTRAS[name]
    assert from_hf_config({**base, **extra}) == from_hf_config(base)


M4, MIN3 = _written("mistral4"), _written("ministral3")


@pytest.mark.parametrize("data, err, what", [
    # RoPE tables: every key one its rope_type reads; one table
    ({**LLAMA_31_8B, "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "llama_4_scaling_beta": 0.1}},
     NotSupportedError, "field 'rope_scaling.llama_4_scaling_beta' is not a field of a 'llama3' RoPE table"),
    ({**LLAMA_31_8B, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, ConfigError,
     "fields 'rope_scaling' and 'rope_parameters' are both set"),
    ({**GEMMA3_1B, "rope_scaling": None, "rope_parameters": {"full_attention": {}, "chunked_attention": {}}},
     NotSupportedError, "field 'rope_parameters.chunked_attention'"),
    # two names of one setting that disagree (transformers reads one of them)
    ({**GPT_OSS_20B, "experts_per_token": 2}, ConfigError, "field 'experts_per_token' = 2: expected num_experts_per_tok"),
    ({**GEMMA2_2B, "hidden_act": "silu"}, NotSupportedError, "hidden_act 'silu' beside hidden_activation"),
    ({**GEMMA3_1B, "sliding_window_pattern": 4, "_sliding_window_pattern": 6}, ConfigError,
     "field '_sliding_window_pattern' = 6: expected 4"),
    ({**PHI3_MINI_4K, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48,
                                       "original_max_position_embeddings": 8192}},
     ConfigError, "expected the top-level original_max_position_embeddings (4096)"),
    ({**DEEPSEEK_V3_JSON, "head_dim": 192}, ConfigError, "field 'head_dim' = 192: expected 64 (qk_rope_head_dim)"),
    ({**DEEPSEEK_V3_JSON, "num_key_value_heads": 8}, ConfigError, "field 'num_key_value_heads' = 8: expected 128"),
    ({**QWEN3_8B, "dtype": "float32"}, ConfigError, "fields 'torch_dtype' = 'bfloat16' and 'dtype' = 'float32' "
                                                    "disagree"),
    # gpt-oss clamps at +-swiglu_limit whatever it is: 0 is not tpumk's "no clamp"
    ({**GPT_OSS_20B, "swiglu_limit": 0}, ConfigError, "field 'swiglu_limit' = 0: expected a positive number"),
    # GLM-4.7-Flash: transformers places its dense layers by mlp_layer_types (default: the first),
    # not by the release's first_k_dense_replace; its head_dim is qk_rope_head_dim
    ({**GLM_47_FLASH, "first_k_dense_replace": 3}, ConfigError,
     "field 'first_k_dense_replace' = 3: expected the layers mlp_layer_types' default makes dense (1 of 47"),
    ({**GLM_47_FLASH, "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 45, "first_k_dense_replace": 1}, ConfigError,
     "field 'first_k_dense_replace' = 1: expected the layers mlp_layer_types makes dense (2 of 47"),
    ({**GLM_47_FLASH, "head_dim": 128}, ConfigError,
     "fields 'head_dim' = 128 and 'qk_rope_head_dim' = 64 name the same setting"),
    # Mistral 4: head_dim is qk_nope + qk_rope; its rope lanes turn by YaRN only, over
    # int(head_dim x partial_rotary_factor) lanes; transformers' attention reads llama_4_scaling_beta
    ({**M4, "head_dim": 64}, ConfigError, "field 'head_dim' = 64: expected 128 (qk_nope_head_dim + qk_rope_head_dim)"),
    ({**M4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1,
                                "original_max_position_embeddings": 8192}},
     NotSupportedError, "rope_parameters rope_type 'default' for model_type 'mistral4'"),
    ({**M4, "rope_parameters": {**M4["rope_parameters"], "partial_rotary_factor": 0.25}}, ConfigError,
     "field 'rope_parameters.partial_rotary_factor' = 0.25: expected 0.5"),
    ({**M4, "rope_parameters": {k: v for k, v in M4["rope_parameters"].items() if k != "llama_4_scaling_beta"}},
     ConfigError, "field 'rope_parameters.llama_4_scaling_beta' is missing: expected a number"),
    ({**MIN3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "llama_4_scaling_beta": 0.1}}, ConfigError,
     "field 'rope_parameters.original_max_position_embeddings' is missing: expected a positive integer"),
    # a Mistral config relabelled ministral3: every field is one, but its RoPE table has no beta
    ({**_written("mistral"), "model_type": "ministral3"}, ConfigError, "'rope_parameters.llama_4_scaling_beta' is missing"),
    # DeepSeek-V3's class takes a boolean only (Mistral 4's also null: rotate-half)
    ({**DEEPSEEK_V3_JSON, "rope_interleave": None}, ConfigError, "field 'rope_interleave' = None: expected true or false"),
])
def test_a_file_that_says_another_model_or_two_things_is_refused(data, err, what):
    with pytest.raises(err) as e:
        from_hf_config(data, "x/config.json")
    assert what in _one_line(e) and _one_line(e).startswith("x/config.json")


def test_the_rope_table_in_use_gives_theta_and_partial_rotary():
    """transformers 4.x's rope_scaling carries its own rope_theta and partial_rotary_factor the
    same as 5.x's rope_parameters (transformers reads both from whichever table the file has)."""
    phi = {**PHI3_MINI_4K, "rope_scaling": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}}
    cfg = from_hf_config(phi)
    assert (cfg.rope_theta, cfg.rotary_dim) == (5e5, 48)


# ---------------------------------------------------------------------- families tpumk refuses
@pytest.mark.parametrize("model_type, what", [
    ("deepseek_v4", "hyper-connections"), ("smollm3", "NoPE layers"),
    ("olmo3", "sliding-window layers"), ("llama4", "chunked attention"),
    ("deepseek_v2", "softmax scores"),
])
def test_an_unsupported_family_is_refused_naming_what_is_missing(model_type, what):
    """Each refusal names the family's missing part, read from transformers' modelling of it
    (MLA only where MLA is what is missing: these families' MLA is not, or they have none)."""
    with pytest.raises(NotSupportedError) as e:
        from_hf_config({**_written(model_type), "model_type": model_type}, "x/config.json")
    msg = _one_line(e)
    assert msg.startswith(f"x/config.json: not supported yet: model_type {model_type!r}: ") and what in msg, msg
    assert "kv_lora_rank" not in msg


# ---------------------------------------------------------------------- relabelled configs
# (transformers' class, the family it is relabelled as, fields the refusal names)
RELABELLED = [
    ("ministral3", "mistral", "rope_parameters.llama_4_scaling_beta"),
    ("smollm3", "llama", "no_rope_layers"),
    ("olmo3", "olmo2", "layer_types"),
    ("qwen3_5_text", "qwen3", "linear_conv_kernel_dim"),
    ("qwen3_next", "qwen3_moe", "linear_conv_kernel_dim"),
    ("qwen3_5_moe_text", "qwen3_moe", "linear_conv_kernel_dim"),
    ("cohere2", "cohere", "sliding_window"),
    ("granitemoe", "granite", "num_local_experts"),
    ("glm4_moe_lite", "deepseek_v3", "mlp_layer_types"),
    ("glm4_moe_lite", "glm4_moe", "kv_lora_rank"),
    ("qwen3_next", "qwen3", "linear_conv_kernel_dim"),
    ("qwen3_5_moe_text", "qwen2_moe", "linear_conv_kernel_dim"),
    ("kimi_linear", "kimi_k2", "linear_conv_kernel_dim"),
    ("deepseek_v32", "deepseek_v3", "index_head_dim"),
    ("glm_moe_dsa", "deepseek_v3", "index_head_dim"),
    ("kimi_linear", "deepseek_v3", "linear_conv_kernel_dim"),
    ("deepseek_v4", "deepseek_v3", "hc_mult"),
    ("deepseek_v2", "deepseek_v3", "mlp_bias"),
    ("mistral4", "deepseek_v3", "rope_parameters.llama_4_scaling_beta"),
    ("mistral4", "mistral", "kv_lora_rank"),
    ("glm4_moe_lite", "mistral4", "mlp_layer_types"),
    ("deepseek_v3", "mistral4", "num_nextn_predict_layers"),
    ("ministral", "mistral", "layer_types"),
    ("gemma3n_text", "gemma3_text", "altup_active_idx"),
    ("phimoe", "phi3", "num_local_experts"),
    ("llama4_text", "llama", "attention_chunk_size"),
    ("exaone4", "qwen3", "sliding_window_pattern"),
    ("seed_oss", "qwen2", "attention_out_bias"),
    ("dots1", "deepseek_v3", "sliding_window"),
    ("olmo", "olmo2", "clip_qkv"),
    ("minimax", "mixtral", "layer_types"),
    ("arcee", "llama", "hidden_act 'relu2'"),  # ReLU^2 MLP
    ("apertus", "llama", "hidden_act 'xielu'"),
    ("gemma3_text", "gemma2", "_sliding_window_pattern"),
    ("mixtral", "mistral", "num_local_experts"),
]


@pytest.mark.parametrize("source, as_type, named", RELABELLED, ids=[f"{s}-as-{t}" for s, t, _ in RELABELLED])
def test_a_relabelled_config_is_refused_naming_its_fields(source, as_type, named):
    with pytest.raises(NotSupportedError) as e:
        from_hf_config({**_written(source), "model_type": as_type}, "x/config.json")
    msg = _one_line(e)
    assert msg.startswith("x/config.json: not supported") and named in msg, msg


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            intermediate_size=64, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# Families whose every field is a field of the family they are relabelled as: the config cannot
# tell them apart, their checkpoints can (transformers' relabelled model would load with freshly
# initialised norms: a different model).
@pytest.mark.parametrize("source, as_type, tensor", [
    ("vaultgemma", "gemma2", "missing tensor 'model.layers.0.post_attention_layernorm.weight'"),  # no sandwich norms
    ("flex_olmo", "olmoe", "missing tensor 'model.layers.0.input_layernorm.weight'"),  # OLMo 2's post-norms
    # GLM-4 as GLM-4.5: transformers reads the absent n_routed_experts as its class default (128
    # experts), so the config is refused before the checkpoint (was: read as a dense GLM-4.5,
    # then refused on GLM-4's sandwich norms)
    ("glm4", "glm4_moe", "missing required field 'moe_intermediate_size'"),
])
def test_a_relabelled_checkpoint_the_config_cannot_tell_is_refused_on_load(tmp_path, source, as_type, tensor):
    extra = dict(num_experts=4, num_experts_per_tok=2) if source == "flex_olmo" else {}
    model = transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[source](**TINY, **extra))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if "missing required field" in tensor:
        with pytest.raises(ConfigError) as e:
            from_hf_config({**config, "model_type": as_type})
        assert tensor in _one_line(e)
        return
    from_hf_config({**config, "model_type": as_type})  # the config reads as the named family
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": as_type}))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert tensor in _one_line(e)


# ---------------------------------------------------------------------- wrappers
def _kimi_k25(text_type: str = "kimi_k2", tie: bool = False, **text) -> "transformers.Kimi_K25Config":
    """A tiny Kimi K2.5: hf_utils' DeepSeek-V3 as its text model, a one-layer vision tower."""
    return transformers.Kimi_K25Config(
        text_config=dict(hf_utils.DEEPSEEK_V3_KW, initializer_range=0.1, tie_word_embeddings=False,
                         model_type=text_type, **text),
        vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                           patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1),
        projection_hidden_size=32, tie_word_embeddings=tie)


def test_a_wrapper_is_read_through_its_text_config():
    data = json.loads(_kimi_k25().to_json_string())
    text = {**data["text_config"], "tie_word_embeddings": False}
    cfg = from_hf_config(data)
    assert cfg.is_mla and cfg == from_hf_config(text)
    # transformers maps a kimi_k2 text model to deepseek_v3, and ties the head by the wrapper's flag (default true)
    assert from_hf_config({**data, "text_config": {**text, "model_type": "kimi_k2"}}).replace(name="x") == \
        cfg.replace(name="x")
    assert from_hf_config({k: v for k, v in data.items() if k != "tie_word_embeddings"}).tie_embeddings
    for changes, err, what in [
        ({"text_config": {**text, "model_type": "deepseek_v4"}}, NotSupportedError,
         "not supported yet: text_config.model_type 'deepseek_v4' in a 'kimi_k25' wrapper (tpumk decodes "
         "'deepseek_v3' or 'kimi_k2' there; deepseek_v4 has hyper-connections"),
        ({"text_config": {**text, "model_type": "deepseek_v32"}}, NotSupportedError,
         "not supported yet: text_config.model_type 'deepseek_v32' in a 'kimi_k25' wrapper (tpumk decodes "
         "'deepseek_v3' or 'kimi_k2' there)"),
        ({"text_config": None}, ConfigError, "field 'text_config' = None: expected an object"),
        ({"media_placeholder_token_id": 163605, "audio_config": {}}, NotSupportedError,
         "field 'audio_config' is not a field of model_type 'kimi_k25'"),
        ({"text_config": {**text, "index_topk": 64}}, NotSupportedError,
         "text_config: not supported: field 'index_topk' is not a field of model_type 'deepseek_v3'"),
    ]:
        with pytest.raises(err) as e:
            from_hf_config({**data, **changes}, "x/config.json")
        assert _one_line(e).startswith("x/config.json") and what in _one_line(e), _one_line(e)


def _mistral3(text_type: str, **kw) -> dict:
    """A Mistral3ForConditionalGeneration config (Ministral 3, Mistral Small 4) as transformers
    writes it: its text_config transformers' `text_type` class's defaults, a small Pixtral tower."""
    return json.loads(transformers.Mistral3Config(
        text_config={"model_type": text_type}, vision_config=dict(hidden_size=32, intermediate_size=32,
                                                                    num_hidden_layers=1, num_attention_heads=2),
        **kw).to_json_string())


@pytest.mark.parametrize("text_type", ["ministral3", "mistral4", "mistral"])
def test_a_mistral3_wrapper_is_read_through_its_text_config(text_type):
    """Ministral 3 and Mistral Small 4 ship as Mistral3ForConditionalGeneration: the language
    model is the text_config (transformers' default type: mistral), the head tied by the
    wrapper's flag (default true). Without a text_config transformers builds a default text
    model (Mistral Small 3.1's shapes), not the checkpoint's: refused in one line."""
    data = _mistral3(text_type)
    text = {**data["text_config"], "tie_word_embeddings": True}
    cfg = from_hf_config(data)
    assert cfg == from_hf_config(text) and cfg.tie_embeddings and cfg.is_mla == (text_type == "mistral4")
    assert cfg.query_scale_beta == (0.1 if text_type != "mistral" else 0.0)
    assert not from_hf_config(_mistral3(text_type, tie_word_embeddings=False)).tie_embeddings
    if text_type == "mistral":  # a text_config without model_type is transformers' default, a Mistral
        untyped = {k: v for k, v in data["text_config"].items() if k != "model_type"}
        assert from_hf_config({**data, "text_config": untyped}) == cfg
    for changes, err, what in [
        ({"text_config": None}, ConfigError, "field 'text_config' = None: expected an object"),
        ({"text_config": "missing"}, ConfigError,
         "field 'text_config' is missing: expected an object (a multimodal mistral3 config holds its language "
         "model's fields there; without them transformers builds a default text model)"),
        ({"text_config": {**text, "model_type": "llama"}}, NotSupportedError,
         "text_config.model_type 'llama' in a 'mistral3' wrapper (tpumk decodes 'mistral' or 'ministral3' or "
         "'mistral4' there)"),
        ({"image_seq_length": 1}, NotSupportedError, "field 'image_seq_length' is not a field of model_type 'mistral3'"),
    ]:
        bad = {k: v for k, v in {**data, **changes}.items() if v != "missing"}
        with pytest.raises(err) as e:
            from_hf_config(bad, "x/config.json")
        assert _one_line(e).startswith("x/config.json") and what in _one_line(e), _one_line(e)


def test_a_wrapper_without_a_text_model_is_one_line_exit_1(tmp_path):
    """`tpumk build` of a mistral3 / kimi_k25 wrapper config without its text_config: one error
    line, exit 1, nothing written."""
    from click.testing import CliRunner

    from tpumk.cli import main

    for name, data in (("mistral3", _mistral3("ministral3")), ("kimi_k25", json.loads(_kimi_k25().to_json_string()))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({k: v for k, v in data.items() if k != "text_config"}))
        before = sorted(tmp_path.iterdir())
        r = CliRunner().invoke(main, ["build", "--model", str(path), "--no-estimate"])
        assert r.exit_code == 1, r.output
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"tpumk: error: {path}: field 'text_config' is missing"), r.stderr
        assert r.stdout == "" and sorted(tmp_path.iterdir()) == before


def _tree_equal(a, b) -> bool:
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                                     jax.tree_util.tree_leaves(b)))


def test_a_kimi_k25_checkpoint_loads_its_language_model(tmp_path):
    """A tiny Kimi K2.5 saved by transformers (its text layers as language_model.model.blocks.N:
    transformers' kimi_k25 conversion renames blocks <-> layers in every name; the head under
    language_model.lm_head; the vision tower and projector beside them) loads to exactly the
    weights of the DeepSeek-V3 checkpoint transformers saves from the same language model
    (whose logits test_hf_deepseek.py checks against transformers), and so do the release's
    names (language_model.model.layers.N). transformers' Kimi_K25ForConditionalGeneration runs a
    text-only input through that language model and its lm_head, tied by the wrapper's flag."""
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(_kimi_k25()).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero correction bias, as hf_utils' DeepSeek-V3 has
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(tmp_path / "k25")
    text = transformers.DeepseekV3ForCausalLM(model.config.text_config).to(torch.float32).eval()
    text.model.load_state_dict(model.model.language_model.state_dict())
    text.lm_head.load_state_dict(model.lm_head.state_dict())
    text.save_pretrained(tmp_path / "text")
    names = load_file(tmp_path / "k25" / "model.safetensors")
    assert any(n.startswith("language_model.model.blocks.") for n in names)
    assert any(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
    cfg, params = load_checkpoint(tmp_path / "k25")
    text_cfg, text_params = load_checkpoint(tmp_path / "text")
    assert cfg.replace(name="x") == text_cfg.replace(name="x") and cfg.is_mla and not cfg.tie_embeddings
    assert _tree_equal(params, text_params)
    release = tmp_path / "release"
    release.mkdir()
    (release / "config.json").write_bytes((tmp_path / "k25" / "config.json").read_bytes())
    save_file({n.replace("language_model.model.blocks.", "language_model.model.layers."): v for n, v in names.items()},
              str(release / "model.safetensors"), metadata={"format": "pt"})
    assert _tree_equal(load_checkpoint(release)[1], params)
    # the wrapper's own flag ties the head (Kimi_K25Config: default true), as transformers ties it
    tied = transformers.Kimi_K25ForConditionalGeneration(_kimi_k25(tie=True))
    assert tied.lm_head.weight is tied.model.language_model.embed_tokens.weight
    assert from_hf_config(json.loads(tied.config.to_json_string())).tie_embeddings
