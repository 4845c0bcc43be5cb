"""Every field of a Hugging Face config.json, accounted for.

transformers builds a config from whatever keys a config.json holds and keeps the ones its
class does not know as plain attributes its modelling never reads. So a config whose
`model_type` names a family tpumk reads but whose fields come from another family (a Ministral 3
config relabelled `mistral`, a SmolLM3 one relabelled `llama`) loads in transformers as the
named family, and a reader that skipped the fields it does not know would build a model that
differs from the one the file describes, silently. Here every key a config.json may hold is, per
model_type (`FAMILIES`), one of:

- modelled: the reader (tpumk.model.config.from_hf_config) reads it, and builds what
  transformers' modelling of that family computes from it;
- harmless: transformers' decode step does not depend on it (tokenizer ids, dropout,
  initialisation, cache flags, training-only losses, parallelism plans, ...); each says why;
- refused unless neutral: a value other than the neutral ones changes the math in a way tpumk
  does not model (`mlp_bias = true`), refused in one line naming the field.

Any other key is refused in one line naming it. The RoPE tables (`rope_parameters`, or 4.x's
`rope_scaling`) are checked key by key against the keys their rope_type reads (`ROPE_KEYS`);
`quantization_config` is read by `tpumk.model.config.stored_scheme`.

Adding a family is one `FAMILIES` entry (its transformers class's fields sorted into the three
lists; tests/test_hf_fields.py walks the installed transformers' class and fails on a field in
none). `UNSUPPORTED_FAMILIES` names what tpumk lacks for the families it refuses, and
`WRAPPERS` the multimodal configs whose language model tpumk decodes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from tpumk.errors import ConfigError, NotSupportedError


@dataclass(frozen=True)
class Refused:
    """A field tpumk does not model: accepted only at a value that leaves the math unchanged
    (`neutral`: the values, compared with their JSON type, or a test of the value)."""

    what: str
    neutral: tuple[Any, ...] | Callable[[Any], bool] = (None, False)

    def accepts(self, value: Any) -> bool:
        if callable(self.neutral):
            return bool(self.neutral(value))
        return any(_same(value, n) for n in self.neutral)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 2.0 is 2."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class Family:
    """One model_type's accounting. `aliases` are transformers' attribute_map names of a field:
    a config.json may write either name (the alias is renamed to the name the reader reads)."""

    modelled: frozenset[str]
    harmless: Mapping[str, str]
    refused: Mapping[str, Refused] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lists = (set(self.modelled), set(self.harmless), set(self.refused))
        for i, a in enumerate(lists):
            for b in lists[i + 1:]:
                if a & b:
                    raise ValueError(f"field {sorted(a & b)[0]!r} is in two lists")

    def kind(self, key: str) -> str | None:
        """'modelled', 'harmless', 'refused' (the family's, else the common lists), or None."""
        for kind, names in (("modelled", self.modelled), ("harmless", self.harmless), ("refused", self.refused),
                            ("modelled", COMMON_MODELLED), ("harmless", COMMON_HARMLESS),
                            ("refused", COMMON_REFUSED)):
            if key in names:
                return kind
        return None

    def refusal(self, key: str) -> Refused | None:
        if key in self.modelled or key in self.harmless:
            return None
        return self.refused.get(key) or COMMON_REFUSED.get(key)


# ---------------------------------------------------------------------- reasons (harmless)
_DROPOUT = "dropout: inactive at inference"
_INIT = "weight initialisation for training; a checkpoint's weights are read as stored"
_TRAINING = "a training loss or router statistic; no part of the forward pass at inference"
_TOKENS = "a token id for the tokenizer and generation loop, not the model's math"
_CACHE = "KV-cache settings of transformers' generate; tpumk keeps its own paged cache"
_OUTPUTS = "what a forward call returns, not how it computes it"
_HEADS = "a classification head's labels; a causal LM's logits do not use them"
_KERNELS = "which attention / expert kernel transformers runs: the same math"
_GENERATION = "a generation setting (sampling, search, lengths), applied outside the decode step"
_POSITIONS = ("the longest position transformers' RoPE tables are sized for; tpumk computes each build's "
              "positions for its own context")
_PARALLEL = "how training sharded the model; the same products unsharded"
_MTP = ("multi-token-prediction layers, not part of the decode step (their tensors are skipped on load)")
_VISION = "the vision part of a multimodal model: tpumk decodes text in, text out"

# Sampling and search settings transformers pops from a config as generation parameters
# (GenerationConfig._get_default_generation_params; 4.x configs saved them at top level).
GENERATION_PARAMS = (
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size", "encoder_repetition_penalty",
    "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id",
    "length_penalty", "max_length", "max_new_tokens", "min_length", "min_new_tokens", "no_repeat_ngram_size",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "num_beam_groups", "num_beams", "num_return_sequences",
    "output_scores", "remove_invalid_values", "repetition_penalty", "return_dict_in_generate", "suppress_tokens",
    "target_lookbehind", "temperature", "top_k", "top_p", "typical_p",
)

# Keys every family may carry: PreTrainedConfig's own fields (transformers 5, and the 4.x
# PretrainedConfig's), and what transformers, the hub and common tools write beside them.
COMMON_MODELLED = frozenset({"model_type", "torch_dtype", "dtype", "_name_or_path", "quantization_config"})
COMMON_HARMLESS: Mapping[str, str] = MappingProxyType({
    "transformers_version": "the transformers version that wrote the file",
    "architectures": "the classes that load the checkpoint; tpumk goes by model_type",
    "auto_map": "remote-code classes of the release; tpumk goes by model_type",
    "name_or_path": "the checkpoint's name (tpumk names the model from _name_or_path)",
    "_commit_hash": "the hub revision the file came from",
    "output_hidden_states": _OUTPUTS, "output_attentions": _OUTPUTS, "return_dict": _OUTPUTS,
    "torchscript": _OUTPUTS,
    "chunk_size_feed_forward": "the feed-forward run over sequence chunks: the same products in pieces",
    "id2label": _HEADS, "label2id": _HEADS, "problem_type": _HEADS, "num_labels": _HEADS, "finetuning_task": _HEADS,
    "is_decoder": "a flag of encoder models that can run as decoders; a causal LM always decodes",
    "tie_encoder_decoder": "a decoder-only model has no encoder to tie",
    "cross_attention_hidden_size": "the width of cross-attention, which add_cross_attention switches on (refused)",
    "bos_token_id": _TOKENS, "eos_token_id": _TOKENS, "pad_token_id": _TOKENS, "sep_token_id": _TOKENS,
    "decoder_start_token_id": _TOKENS, "tokenizer_class": _TOKENS, "prefix": _TOKENS,
    "task_specific_params": _GENERATION,
    "use_cache": _CACHE, "cache_implementation": _CACHE,
    "initializer_range": _INIT,
    "_attn_implementation": _KERNELS, "attn_implementation": _KERNELS, "_attn_implementation_autoset": _KERNELS,
    "_attn_implementation_internal": _KERNELS, "experts_implementation": _KERNELS,
    "_experts_implementation": _KERNELS, "_experts_implementation_internal": _KERNELS,
    "use_bfloat16": "a TensorFlow-era flag; the weights' dtype is torch_dtype / dtype",
    "tf_legacy_loss": _TRAINING,
    "pretraining_tp": "the tensor-parallel slicing of Llama's pretraining; transformers 5 computes the same "
                      "products unsliced",
    "model_max_length": "a tokenizer / serving length limit, not part of the math",
    "unsloth_fixed": "a marker of Unsloth's re-uploads", "unsloth_version": "a marker of Unsloth's re-uploads",
    **{name: _GENERATION for name in GENERATION_PARAMS},
})
COMMON_REFUSED: Mapping[str, Refused] = MappingProxyType({
    "is_encoder_decoder": Refused("an encoder-decoder model"),
    "add_cross_attention": Refused("cross-attention to an encoder"),
    "pruned_heads": Refused("pruned attention heads", (None, {})),
    "per_layer_config": Refused("per-layer overrides of the config: transformers' heterogeneous configs",
                                (None, {}, [])),
    # read where the family models them (Gemma 2 / 3; gpt-oss's sinks are always on)
    "attn_logit_softcapping": Refused("attention logit soft-capping"),
    "final_logit_softcapping": Refused("final logit soft-capping"),
    "sinks": Refused("attention sinks"),
    "use_sinks": Refused("attention sinks"),
})


def _all_full(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(t == "full_attention" for t in value))


# ---------------------------------------------------------------------- the families
# The fields nearly every decoder's reader reads (tpumk.model.config.from_hf_config).
_CORE = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                   "rope_parameters", "rope_scaling", "rope_theta"})
_DENSE_HARMLESS = {"attention_dropout": _DROPOUT}
_MOE_HARMLESS = {"output_router_logits": _TRAINING, "router_aux_loss_coef": _TRAINING,
                 "router_jitter_noise": "noise on the router's input, added in training only"}
_NO_O_BIAS = Refused("q / k / v / o biases: this family's projections have none")
_MLP_BIAS = Refused("biases on the MLP's projections")
_BIDIRECTIONAL = Refused("attention to later tokens: a decoder attends causally")
_WINDOWED = {"sliding_window", "use_sliding_window", "layer_types", "max_window_layers"}  # Qwen's windows
# max_position_embeddings changes the math only through a RoPE scaling that derives its factor
# from it (YaRN without a factor, LongRoPE): read where the family reads those.
_SCALED_POSITIONS = {"max_position_embeddings"}
_SIGMOID_MOE = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "first_k_dense_replace", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor"}


# A Gated DeltaNet hybrid's linear-attention fields (Qwen3-Next, Qwen3.5); full_attention_interval
# is the pattern's default when layer_types is absent; transformers 5.19 also writes the RoPE
# table's partial_rotary_factor at top level (the config reader takes either)
_GATED_DELTA = {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "layer_types", "full_attention_interval", "partial_rotary_factor"}
_HYBRID_REFUSED = {"attention_bias": Refused("biases on the gated attention's projections")}


def _family(modelled, harmless=None, refused=None, aliases=None) -> Family:
    return Family(frozenset(modelled), MappingProxyType(dict(harmless or {})),
                  MappingProxyType(dict(refused or {})), MappingProxyType(dict(aliases or {})))


_GEMMA_SANDWICH = _CORE | {"hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
                           "query_pre_attn_scalar", "sliding_window", "layer_types", "attention_bias"}
_DEEPSEEK_V3 = _family(
    _CORE | _SIGMOID_MOE | _SCALED_POSITIONS
    | {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
       # transformers derives these two (head_dim = qk_rope_head_dim) and saves them; the reader checks them
       "qk_head_dim",
       # the release's remote-code routing settings: the reader builds sigmoid / noaux_tc / every layer
       "scoring_func", "topk_method", "moe_layer_freq"},
    {**_DENSE_HARMLESS, **_MOE_HARMLESS, "num_nextn_predict_layers": _MTP, "ep_size": _PARALLEL,
     "aux_loss_alpha": _TRAINING, "seq_aux": _TRAINING},
    {"attention_bias": Refused("biases on the MLA projections")},
    {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"})
# MLA under other names (tpumk.model.config._hf_mla_fields reads them as DeepSeek-V3's): their
# MLA fields, and the release's remote-code settings the reader checks (as DeepSeek-V3's)
_MLA = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
        "qk_head_dim", "scoring_func", "topk_method", "moe_layer_freq"}
_MLA_BIAS = {"attention_bias": Refused("biases on the MLA projections")}
# GLM-4.7-Flash: DeepSeek-V3's MLA and routing; dense or routed layers by mlp_layer_types
# (first_k_dense_replace, which its release writes and transformers does not read, is checked
# against them); transformers' head_dim is qk_rope_head_dim (attribute_map)
_GLM4_MOE_LITE = _family(
    _CORE - {"head_dim"} | _SIGMOID_MOE | _SCALED_POSITIONS | _MLA | {"mlp_layer_types", "partial_rotary_factor"},
    {**_DENSE_HARMLESS, **_MOE_HARMLESS, "num_nextn_predict_layers": _MTP},
    _MLA_BIAS,
    {"num_local_experts": "n_routed_experts", "head_dim": "qk_rope_head_dim",
     "num_mtp_layers": "num_nextn_predict_layers"})
# Mistral Small 4: MLA (no q-LoRA allowed), softmax routing over expert groups without a
# correction bias, YaRN over the rope lanes, llama-4 position-scaled queries
_MISTRAL4 = _family(
    _CORE | _SIGMOID_MOE | _SCALED_POSITIONS | _MLA - {"scoring_func", "topk_method", "moe_layer_freq"},
    {**_DENSE_HARMLESS, **_MOE_HARMLESS}, _MLA_BIAS, {"num_local_experts": "n_routed_experts"})

# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): DeepSeek-V3's MLA (always q-LoRA, always
# interleaved rope lanes: rope_interleave is not read) and routing (dense layers by
# mlp_layer_types, default the first first_k_dense_replace), plus the lightning indexer's sizes;
# every layer_types entry is 'indexed_attention'. GLM-5's indexer_types (or, without it, the
# index_topk_pattern / index_topk_freq / index_skip_topk_offset transformers derives them from)
# say which layers reuse the previous layer's selection.
_DSA = {"index_topk", "index_head_dim", "index_n_heads", "layer_types", "mlp_layer_types"}
_DSA_HARMLESS = {**_DENSE_HARMLESS, **_MOE_HARMLESS, "num_nextn_predict_layers": _MTP, "ep_size": _PARALLEL,
                 "aux_loss_alpha": _TRAINING, "seq_aux": _TRAINING}
_DSA_REFUSED = {**_MLA_BIAS, "mlp_bias": _MLP_BIAS,
                "rope_interleave": Refused("rotate-half MLA rope lanes: transformers' sparse-attention MLA always "
                                           "rotates interleaved pairs", (None, True))}
_DSA_ALIASES = {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts",
                "num_mtp_layers": "num_nextn_predict_layers"}
_DEEPSEEK_V32 = _family(_CORE | _SIGMOID_MOE | _SCALED_POSITIONS | (_MLA - {"rope_interleave"}) | _DSA,
                        _DSA_HARMLESS, _DSA_REFUSED, _DSA_ALIASES)
_GLM_MOE_DSA = _family(_CORE | _SIGMOID_MOE | _SCALED_POSITIONS | (_MLA - {"rope_interleave"}) | _DSA
                       | {"indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"},
                       _DSA_HARMLESS, _DSA_REFUSED, _DSA_ALIASES)

# Mistral Large 4's language model (read with DeepSeek-V3.2's by tpumk.model.config._hf_mla_fields
# and _hf_large4_fields): MLA without q-LoRA (always interleaved rope lanes), sparse attention with
# GLM-5's indexer_types, NoPE layers (no_rope_layers, or its no_rope_layer_interval default),
# latent-cache sharing (kv_source_layers), Mistral 4's softmax group routing (always
# renormalised), the logits' soft-cap; its learned RoPE frequencies and query scales are weights
_MISTRAL_LARGE4_TEXT = _family(
    _CORE - {"head_dim"} | _SCALED_POSITIONS
    | {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
       "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
       "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim"}
    | _DSA | {"indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset",
              "no_rope_layers", "no_rope_layer_interval", "kv_source_layers", "final_logit_softcapping"},
    {**_DENSE_HARMLESS, **_MOE_HARMLESS,
     "head_dim": "transformers' MistralLarge4TextConfig overwrites it with qk_rope_head_dim (its RoPE's width)"},
    {**_MLA_BIAS, "mlp_bias": _MLP_BIAS},
    {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts"})

# Muse Spark's language model (tpumk.model.spark; read by tpumk.model.config._hf_muse_spark_fields):
# sliding-window and NoPE full layers, gated residuals, the MoE between a down- and an up-projection.
# qk_scale_factor, output_multiplier and residual_gate_temperature are folded into the weights on
# load (tpumk.model.spark_weights.fold_tensors)
_MUSE_SPARK_TEXT = _family(
    _CORE - {"tie_word_embeddings"}
    | {"sliding_window", "layer_types", "layer_rope_theta", "final_logit_softcapping", "qk_scale_factor",
       "output_multiplier", "post_norm_eps", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
       "routed_scaling_factor", "moe_hidden_size", "mlp_layer_types", "residual_gate_temperature"},
    {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS,
     "tie_word_embeddings": "MuseSparkForConditionalGeneration keeps its own lm_head and ties nothing, whatever "
                            "the flag says (transformers 5.24)"},
    {"attention_bias": Refused("biases on the attention projections")})

FAMILIES: Mapping[str, Family] = MappingProxyType({
    "qwen3": _family(_CORE | _WINDOWED | _SCALED_POSITIONS | {"attention_bias"}, _DENSE_HARMLESS),
    "qwen3_moe": _family(
        _CORE | _SCALED_POSITIONS | {"attention_bias", "sliding_window", "use_sliding_window", "num_experts",
                                     "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                     "decoder_sparse_step", "mlp_only_layers"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS,
         "max_window_layers": "Qwen3-MoE's attention windows every layer once use_sliding_window is set (its "
                              "releases carry Qwen3's max_window_layers, which its modelling does not read)"},
        aliases={"num_local_experts": "num_experts"}),
    "qwen2": _family(_CORE | _WINDOWED | _SCALED_POSITIONS, _DENSE_HARMLESS,
                     {"attention_bias": _NO_O_BIAS,
                      # DeepSeek-R1-Distill-Qwen writes use_mrope false
                      "use_mrope": Refused("multimodal RoPE, M-RoPE")}),
    "llama": _family(
        _CORE | _SCALED_POSITIONS | {"attention_bias"},
        {**_DENSE_HARMLESS, "is_llama_config": "a marker of nanotron's export (SmolLM2)"},
        {"mlp_bias": _MLP_BIAS,
         # SmolLM2 writes rope_interleaved false (nanotron's flag); transformers' Llama rotates halves
         "rope_interleaved": Refused("RoPE on interleaved pairs"),
         "sliding_window": Refused("a sliding window: Llama's attention has none", (None,))}),
    "granite": _family(
        _CORE | {"attention_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                 "logits_scaling"},
        {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS}, {"mlp_bias": _MLP_BIAS}),
    "mistral": _family(_CORE | _SCALED_POSITIONS | {"sliding_window"}, _DENSE_HARMLESS,
                       {"attention_bias": _NO_O_BIAS}),
    # Ministral 3: Mistral with YaRN and llama-4 position-scaled queries (its RoPE table's
    # llama_4_scaling_beta); layer_types, which transformers warns about and does not read, is refused
    "ministral3": _family(_CORE | _SCALED_POSITIONS | {"sliding_window"}, _DENSE_HARMLESS,
                          {"attention_bias": _NO_O_BIAS}),
    "phi3": _family(
        _CORE | _SCALED_POSITIONS | {"original_max_position_embeddings", "sliding_window", "partial_rotary_factor"},
        {**_DENSE_HARMLESS, "embd_pdrop": _DROPOUT, "resid_pdrop": _DROPOUT},
        {"attention_bias": _NO_O_BIAS, "mlp_bias": _MLP_BIAS,
         # Phi-4-mini's release writes these at their neutral values (its remote code's settings)
         "lm_head_bias": Refused("a bias on the lm_head"),
         "full_attn_mod": Refused("a full-attention layer every full_attn_mod layers", (None, 1)),
         "interpolate_factor": Refused("RoPE position interpolation", (None, 1))}),
    "olmo2": _family(_CORE | {"attention_bias"}, {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS}),
    "gemma": _family(
        _CORE | {"attention_bias", "hidden_activation"},
        {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS},
        {"use_bidirectional_attention": _BIDIRECTIONAL}),
    "gemma2": _family(
        _GEMMA_SANDWICH,
        {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS,
         "sliding_window_size": "an older name of sliding_window (Gemma 2 9B / 27B write both); transformers "
                                "reads sliding_window"},
        {"use_bidirectional_attention": _BIDIRECTIONAL}),
    "gemma3_text": _family(
        _GEMMA_SANDWICH | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
        {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS},
        {"use_bidirectional_attention": _BIDIRECTIONAL}),
    "cohere": _family(
        _CORE - {"rms_norm_eps"} | {"attention_bias", "layer_norm_eps", "logit_scale"},
        {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS},
        {"use_qk_norm": Refused("Cohere's per-head LayerNorm of q / k")}),
    "mixtral": _family(
        _CORE | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS},
        {"attention_bias": _NO_O_BIAS}, {"num_experts": "num_local_experts"}),
    "olmoe": _family(
        _CORE | {"attention_bias", "num_experts", "num_experts_per_tok", "norm_topk_prob"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS},
        {"clip_qkv": Refused("q, k and v clamped after their projections", (None,))},
        {"num_local_experts": "num_experts"}),
    "glm4_moe": _family(
        _CORE | _SIGMOID_MOE | {"attention_bias", "use_qk_norm", "partial_rotary_factor"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS, "num_nextn_predict_layers": _MTP},
        aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}),
    "qwen2_moe": _family(
        _CORE | {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "qkv_bias"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS,
         "sliding_window": "a window only use_sliding_window switches on (refused)",
         "max_window_layers": "a window only use_sliding_window switches on (refused)"},
        {"attention_bias": _NO_O_BIAS,
         "use_sliding_window": Refused("Qwen2-MoE's sliding window, its own odd-layers pattern"),
         "layer_types": Refused("sliding-window layers", _all_full)}),
    "gpt_oss": _family(
        _CORE | _SCALED_POSITIONS | {"attention_bias", "sliding_window", "layer_types", "num_local_experts",
                                     "num_experts_per_tok", "swiglu_limit", "swiglu_alpha",
                                     # the release's own name of num_experts_per_tok: checked against it
                                     "experts_per_token"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS,
         "initial_context_length": "the release's pretraining length; transformers reads its RoPE table's "
                                   "original_max_position_embeddings"},
        aliases={"num_experts": "num_local_experts"}),
    "deepseek_v3": _DEEPSEEK_V3,
    "kimi_k2": _DEEPSEEK_V3,  # Kimi K2: the DeepSeek-V3 architecture (transformers loads it as deepseek_v3)
    "glm4_moe_lite": _GLM4_MOE_LITE,
    "mistral4": _MISTRAL4,
    "deepseek_v32": _DEEPSEEK_V32,
    "glm_moe_dsa": _GLM_MOE_DSA,
    "mistral_large4_text": _MISTRAL_LARGE4_TEXT,
    "muse_spark_text": _MUSE_SPARK_TEXT,
    # Hybrids (tpumk.model.config._hf_linear_fields): Gated DeltaNet beside gated attention
    "qwen3_next": _family(
        _CORE | _GATED_DELTA | {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS}, _HYBRID_REFUSED,
        {"num_local_experts": "num_experts"}),
    "qwen3_5_text": _family(_CORE | _GATED_DELTA, {**_DENSE_HARMLESS, "max_position_embeddings": _POSITIONS},
                            _HYBRID_REFUSED),
    # its router always renormalises and every layer is routed (no norm_topk_prob, no dense layers)
    "qwen3_5_moe_text": _family(
        _CORE - {"intermediate_size"} | _GATED_DELTA | {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                       "shared_expert_intermediate_size"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS}, _HYBRID_REFUSED,
        {"num_local_experts": "num_experts"}),
    # KDA beside MLA without RoPE; transformers' save writes its attribute_map's names, the release
    # nests the KDA sizes in linear_attn_config
    "kimi_linear": _family(
        _CORE - {"head_dim"} | _SIGMOID_MOE | {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim", "layer_types", "mlp_layer_types", "linear_head_dim",
                                               "linear_num_heads", "linear_conv_kernel_dim", "linear_attn_config"},
        {**_DENSE_HARMLESS, **_MOE_HARMLESS, "max_position_embeddings": _POSITIONS,
         "num_nextn_predict_layers": _MTP,
         "head_dim": "transformers sets it to qk_rope_head_dim itself (the release writes 72); MLA's widths are read",
         "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim, derived and saved by transformers",
         "use_grouped_topk": "the release's remote code; transformers' router groups whenever num_expert_group > 1"},
        {"attention_bias": Refused("biases on the MLA projections"),
         "mla_use_nope": Refused("RoPE on the MLA layers (transformers' Kimi Linear applies none)", (None, True)),
         "moe_router_activation_func": Refused("expert scores other than sigmoid", (None, "sigmoid")),
         "moe_layer_freq": Refused("MoE on every moe_layer_freq-th layer only", (None, 1))},
        {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
         "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
         "moe_renormalize": "norm_topk_prob", "num_shared_experts": "n_shared_experts",
         "model_max_length": "max_position_embeddings"}),
})

# Keys of a RoPE table each rope_type reads (tpumk.model.config: _hf_rope_scaling, _hf_yarn,
# _hf_longrope, _hf_gemma3_rope), beyond the type and theta; partial_rotary_factor is read from
# the table (RoPE on part of each head, refused where the family rotates whole heads). A type
# not listed here is refused by the reader itself.
_ROPE_ANY = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# Qwen3.5's multimodal RoPE: the lanes taken by each of the time / height / width positions. A text
# token's three positions are equal, so the interleaved sections are the plain rotation.
MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})
# llama-4 position-scaled queries (Mistral 4, Ministral 3): their beta, and the length their
# positions are divided by (a scaled table's own original_max_position_embeddings; a default
# table may carry it for them). Mistral's tables also copy max_position_embeddings, which
# transformers validates away and never reads (its YaRN derives a missing factor from the
# top-level field).
QUERY_SCALE_KEYS = frozenset({"llama_4_scaling_beta", "original_max_position_embeddings", "max_position_embeddings"})
# RoPE table keys a family reads beyond its rope_type's
ROPE_FAMILY_KEYS: Mapping[str, frozenset[str]] = MappingProxyType({
    "qwen3_5_text": MROPE_KEYS, "qwen3_5_moe_text": MROPE_KEYS, "mistral4": QUERY_SCALE_KEYS,
    "ministral3": QUERY_SCALE_KEYS})
ROPE_KEYS: Mapping[str, frozenset[str]] = MappingProxyType({
    "default": _ROPE_ANY,
    "linear": _ROPE_ANY | {"factor"},
    "llama3": _ROPE_ANY | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": _ROPE_ANY | {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                         "mscale_all_dim", "attention_factor", "truncate"},
    "longrope": _ROPE_ANY | {"short_factor", "long_factor", "original_max_position_embeddings", "factor",
                             "attention_factor"},
})
# Gemma 3's RoPE tables nested by layer type (transformers 5)
NESTED_ROPE = {"gemma3_text": ("full_attention", "sliding_attention")}


# ---------------------------------------------------------------------- families tpumk refuses
# What each family tpumk knows of and does not build lacks, read from transformers' modelling
# of it. A family added to FAMILIES leaves this table.
UNSUPPORTED_FAMILIES: Mapping[str, str] = MappingProxyType({
    "deepseek_v2": "DeepSeek-V2's expert routing (softmax scores, topk_method 'greedy' / 'group_limited_greedy': a "
                   "group scored by its best expert; tpumk's group limit scores a group by its two best, as "
                   "DeepSeek-V3 and Mistral 4 route)",
    "deepseek_v4": "hyper-connections (hc_mult residual streams), compressed sparse attention (CSA / HCA "
                   "compressors with a lightning indexer) and hash-routed experts",
    "ministral": "sliding-window and full layers by layer_types in a Mistral: not read for this model_type yet",
    "smollm3": "NoPE layers (no RoPE on the layers no_rope_layers marks)",
    "olmo3": "sliding-window layers (layer_types, sliding_window) in OLMo 2's architecture: not read yet",
    "cohere2": "sliding-window layers that alone take RoPE (its full-attention layers have no positions)",
    "llama4": "chunked attention, NoPE layers with attention temperature tuning, L2-normed q / k and a routed "
              "plus shared expert MoE, in a multimodal wrapper",
    "llama4_text": "chunked attention, NoPE layers with attention temperature tuning, L2-normed q / k and a routed "
                   "plus shared expert MoE",
    "granitemoe": "Granite's mixture of experts (fused input_linear / output_linear experts): not read yet",
    "granitemoeshared": "Granite's mixture of experts with a shared expert: not read yet",
    "granitemoehybrid": "Mamba-2 layers beside attention",
    "phimoe": "SparseMixer expert routing and LayerNorm with biases",
    "flex_olmo": "OLMo 2's post-sublayer norms around a mixture of experts (tpumk puts post-norms on dense "
                 "layers only)",
    "gemma3n": "AltUp, LAuReL, per-layer input embeddings, KV-cache sharing and activation sparsity",
    "gemma3n_text": "AltUp, LAuReL, per-layer input embeddings, KV-cache sharing and activation sparsity",
    "vaultgemma": "Gemma 2's architecture without the norms after each sublayer: not read yet",
    "olmo": "OLMo (1)'s LayerNorm without weights and its clip_qkv",
})


# ---------------------------------------------------------------------- multimodal wrappers
@dataclass(frozen=True)
class Wrapper:
    """A multimodal config whose language model tpumk decodes (text in, text out): the
    text_config's model types it takes (the first is transformers' default), the defaults its
    text config class fills where text_config is silent, the wrapper's own default for
    tie_word_embeddings (transformers ties the head by the wrapper's flag), its own fields,
    where its checkpoint keeps the parts a text step never reads, and any renaming of its
    language model's tensors beyond LANGUAGE_MODEL_PREFIXES (old prefix -> new, as transformers'
    conversion mapping renames them on load)."""

    text_types: tuple[str, ...]
    text_defaults: Mapping[str, Any]
    tie_default: bool
    fields: Family
    vision_prefixes: tuple[str, ...]
    text_renames: tuple[tuple[str, str], ...] = ()
    # regular-expression renames (the first that matches a name applies): Mistral Large 4's
    # files keep mistral-inference's names, which transformers' conversion mapping renames on load
    text_patterns: tuple[tuple[str, str], ...] = ()


_L = r"^layers\.(\d+)\."
# Mistral Large 4's stored names (its release's and transformers' save_pretrained's, reversed by
# transformers' conversion_mapping "mistral_large4" / "mistral_large4_text") -> the names tpumk reads
MISTRAL_NATIVE_NAMES: tuple[tuple[str, str], ...] = (
    (r"^tok_embeddings\.", "model.embed_tokens."), (r"^lerope\.alpha$", "model.rotary_emb.alpha"),
    (r"^norm\.", "model.norm."), (r"^output\.", "lm_head."),
    (_L + r"attention_norm\.", r"model.layers.\1.input_layernorm."),
    (_L + r"ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (_L + r"attention\.(indexer\.)?ssmax_scaling\.s$", r"model.layers.\1.self_attn.\2softmax_scaling.scale"),
    (_L + r"attention\.(indexer\.)?ssmax_scaling\.b$", r"model.layers.\1.self_attn.\2softmax_scaling.bias"),
    (_L + r"attention\.indexer\.", r"model.layers.\1.self_attn.indexer."),
    (_L + r"attention\.wq\.", r"model.layers.\1.self_attn.q_proj."),
    (_L + r"attention\.wkv_a_with_mqa\.", r"model.layers.\1.self_attn.kv_a_proj_with_mqa."),
    (_L + r"attention\.kv_a_norm\.", r"model.layers.\1.self_attn.kv_a_layernorm."),
    (_L + r"attention\.wkv_b\.", r"model.layers.\1.self_attn.kv_b_proj."),
    (_L + r"attention\.wo\.", r"model.layers.\1.self_attn.o_proj."),
    (_L + r"gate\.", r"model.layers.\1.mlp.gate."),
    *((_L + rf"feed_forward\.{w}\.", rf"model.layers.\1.mlp.{proj}.")
      for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))),
    *((_L + rf"(experts\.\d+\.|shared_experts\.){w}\.", rf"model.layers.\1.mlp.\2{proj}.")
      for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))),
)


# transformers' Gemma3TextConfig defaults (4.50 to 5.x; tests/test_config.py compares them with
# the installed transformers): a multimodal Gemma 3's text_config lists only what differs.
GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
})
# Where a wrapper's checkpoint keeps its language model: the released files (transformers 4.x
# and the releases' remote code: language_model.model.*, language_model.lm_head.*) or
# transformers 5's save format (model.language_model.*, lm_head.*).
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                           ("language_model.lm_head.", "lm_head."))
# Top-level keys of a wrapper that describe the stored weights, not the vision part: they reach
# the text config unless it sets them itself.
WRAPPER_SHARED_KEYS = ("torch_dtype", "dtype", "_name_or_path", "quantization_config")

WRAPPERS: Mapping[str, Wrapper] = MappingProxyType({
    # Gemma 3 4B / 12B / 27B (Gemma3ForConditionalGeneration)
    "gemma3": Wrapper(
        ("gemma3_text",), GEMMA3_TEXT_DEFAULTS, True,
        _family({"text_config", "tie_word_embeddings"},
                {"vision_config": _VISION, "mm_tokens_per_image": _VISION, "boi_token_index": _TOKENS,
                 "eoi_token_index": _TOKENS, "image_token_index": _TOKENS},
                aliases={"image_token_id": "image_token_index", "boi_token_id": "boi_token_index",
                         "eoi_token_id": "eoi_token_index"}),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")),
    # Kimi K2.5 (Kimi_K25ForConditionalGeneration): a Kimi K2 language model (text_config
    # model_type kimi_k2, which transformers reads as deepseek_v3) beside a vision tower. Its
    # text config class's defaults are DeepseekV3Config's, and the releases write every field.
    "kimi_k25": Wrapper(
        ("deepseek_v3", "kimi_k2"), {}, True,
        _family({"text_config", "tie_word_embeddings"},
                {"vision_config": _VISION, "projection_hidden_size": _VISION, "projection_layer_norm_eps": _VISION,
                 "image_token_id": _TOKENS, "video_token_id": _TOKENS, "vision_start_token_id": _TOKENS,
                 "vision_end_token_id": _TOKENS,
                 # the release's remote-code config (moonshotai/Kimi-K2.5)
                 "media_placeholder_token_id": _TOKENS, "video_placeholder": _TOKENS,
                 "use_unified_vision_chunk": _VISION, "ignore_index": _TRAINING}),
        ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."),
        # transformers' kimi_k25 conversion renames `blocks` to `layers` in every name on load (for
        # its vision encoder), so its own save_pretrained writes the text layers as
        # language_model.model.blocks.N (the release: language_model.model.layers.N)
        (("model.blocks.", "model.layers."),)),
    # Ministral 3 and Mistral Small 4 (Mistral3ForConditionalGeneration): a ministral3 or mistral4
    # language model (transformers' default text_config type: mistral) beside a Pixtral vision
    # tower; the head tied by the wrapper's flag (default true), as transformers ties it. Without
    # a text_config transformers builds a default Mistral of Mistral Small 3.1's size: refused.
    "mistral3": Wrapper(
        ("mistral", "ministral3", "mistral4"), {}, True,
        _family({"text_config", "tie_word_embeddings"},
                {"vision_config": _VISION, "image_token_index": _TOKENS, "projector_hidden_act": _VISION,
                 "vision_feature_layer": _VISION, "multimodal_projector_bias": _VISION,
                 "spatial_merge_size": _VISION},
                aliases={"image_token_id": "image_token_index"}),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")),
    # Mistral Large 4 (MistralLarge4ForConditionalGeneration): Mistral 3's layout (a Pixtral tower and
    # projector beside the language model, the head untied by default) around a
    # mistral_large4_text language model; its head's soft-cap is the text config's
    "mistral_large4": Wrapper(
        ("mistral_large4_text",), {}, False,
        _family({"text_config", "tie_word_embeddings"},
                {"vision_config": _VISION, "image_token_index": _TOKENS, "projector_hidden_act": _VISION,
                 "vision_feature_layer": _VISION, "multimodal_projector_bias": _VISION,
                 "spatial_merge_size": _VISION},
                aliases={"image_token_id": "image_token_index"}),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
         "vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter."),
        text_patterns=MISTRAL_NATIVE_NAMES),
    # Muse Spark (MuseSparkForConditionalGeneration): a muse_spark_text language model beside vision and
    # audio towers; its text config class's defaults are read by the family's (CLASS_DEFAULTS). Its
    # image / video / audio token ids embed as token 0 (transformers zeroes them before the lookup):
    # those embedding rows are set to row 0's on load (tpumk.model.spark_weights.fold_tensors).
    "muse_spark": Wrapper(
        ("muse_spark_text",), {}, False,
        _family({"text_config", "image_token_id", "video_token_id", "audio_token_id"},
                {"vision_config": _VISION, "audio_config": "the audio part of a multimodal model: tpumk decodes "
                                                            "text in, text out",
                 "out_hidden_size": _VISION, "projector_hidden_size": _VISION, "projector_hidden_act": _VISION}),
        ("model.vision_tower.", "model.audio_tower.", "model.vision_adapter.", "model.vision_projection.",
         "vision_tower.", "audio_tower.", "vision_adapter.", "vision_projection.")),
    # Qwen3.5 / Qwen3.5-MoE (Qwen3_5ForConditionalGeneration): the hybrid language model beside a
    # vision tower; its releases write the whole text_config
    **{wrapper: Wrapper(
        (text,), {}, False,
        _family({"text_config", "tie_word_embeddings"},
                {"vision_config": _VISION, "image_token_id": _TOKENS, "video_token_id": _TOKENS,
                 "vision_start_token_id": _TOKENS, "vision_end_token_id": _TOKENS}),
        ("model.visual.", "visual.")) for wrapper, text in (("qwen3_5", "qwen3_5_text"),
                                                           ("qwen3_5_moe", "qwen3_5_moe_text"))},
})


# ---------------------------------------------------------------------- the check
def shown(value: Any, limit: int = 60) -> str:
    """A config value as JSON writes it (true, null, 'text'), cut to one short line."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    r = " ".join(repr(value).split())
    return r if len(r) <= limit else r[: limit - 3] + "..."


def account_fields(data: dict[str, Any], model_type: str, source: str, fields: Family | None = None) -> dict[str, Any]:
    """`data` (a config.json's object, or a wrapper's top level with `fields`) checked against
    its family's accounting: an alias renamed to the field the reader reads, a key the family
    does not list refused, a refused field at a value other than its neutral ones refused, each
    in one line naming the field. Returns the config with aliases renamed."""
    fam = fields or FAMILIES[model_type]
    data = fold_aliases(data, fam, source)
    unknown = [k for k in data if fam.kind(k) is None]
    if unknown:
        raise NotSupportedError(f"{source}: not supported: {_names(unknown)} of model_type {model_type!r} that tpumk "
                                "models (a config relabelled from another family?)")
    for key, value in data.items():
        r = fam.refusal(key)
        if r is not None and not r.accepts(value):
            raise NotSupportedError(f"{source}: not supported yet: {key} = {shown(value)} ({r.what})")
    if fields is None:
        check_rope_tables(data, model_type, source)
    return data


def fold_aliases(data: dict[str, Any], fam: Family, source: str) -> dict[str, Any]:
    """Each attribute_map alias renamed to its field; both given with different values is an error."""
    if not any(a in data for a in fam.aliases):
        return data
    out = dict(data)
    for alias, name in fam.aliases.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] is not None and value is not None and not _same(out[name], value):
            raise ConfigError(f"{source}: fields '{alias}' = {shown(value)} and '{name}' = {shown(out[name])} name "
                              f"the same setting (transformers' attribute_map): expected one, or equal values")
        if out.get(name) is None:
            out[name] = value
    return out


def check_rope_tables(data: dict[str, Any], model_type: str, source: str) -> None:
    """Every key of the RoPE table(s) is one its rope_type reads (else refused, naming it); both
    `rope_scaling` and `rope_parameters` set is refused (transformers 5 reads rope_scaling
    first, tpumk's reader the other: the file must say one thing)."""
    tables = {k: data[k] for k in ("rope_scaling", "rope_parameters") if isinstance(data.get(k), dict) and data[k]}
    if len(tables) == 2:
        raise ConfigError(f"{source}: fields 'rope_scaling' and 'rope_parameters' are both set: expected one "
                          "(transformers 4.x writes rope_scaling, 5.x rope_parameters)")
    for key, table in tables.items():
        nested = NESTED_ROPE.get(model_type, ())
        if nested and any(k in table for k in nested):
            extra = [k for k in table if k not in nested]
            if extra:
                raise NotSupportedError(f"{source}: not supported: field '{key}.{extra[0]}' (a {model_type} RoPE "
                                        f"table nests one table per layer type: {', '.join(nested)})")
            for layer_type in nested:
                if isinstance(table.get(layer_type), dict):
                    _check_rope_keys(table[layer_type], f"{key}.{layer_type}", source)
        else:
            _check_rope_keys(table, key, source, ROPE_FAMILY_KEYS.get(model_type, frozenset()))


def _check_rope_keys(table: dict[str, Any], where: str, source: str, extra: frozenset = frozenset()) -> None:
    kind = table.get("rope_type") or table.get("type") or "default"
    allowed = ROPE_KEYS.get(kind) if isinstance(kind, str) else None
    if allowed is None:  # a type tpumk does not read: the reader refuses the type itself
        return
    allowed = allowed | extra
    unknown = [f"{where}.{k}" for k in table if k not in allowed]
    if unknown:
        raise NotSupportedError(f"{source}: not supported: {_names(unknown)} of a {kind!r} RoPE table that tpumk "
                                "models (a config relabelled from another family?)")


def _names(keys: list[str], most: int = 4) -> str:
    """"field 'a' is not a field" / "fields 'a', 'b' are not fields" (the first `most`, then a count)."""
    if len(keys) == 1:
        return f"field {keys[0]!r} is not a field"
    shown_keys = ", ".join(repr(k) for k in keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")
    return f"fields {shown_keys} are not fields"
