"""Model configuration: one validated description of a decoder-only transformer.

A `ModelConfig` comes from a preset shipped with tpumk, a TOML file, or a Hugging Face
`config.json`. Its fields are stored flat (the TOML / JSON keys every cache key is made of);
each stage reads them through the part it concerns (`cfg.attention`, `cfg.positions`,
`cfg.norms`, `cfg.mlp`, `cfg.moe`, `cfg.pattern`, `cfg.head`: tpumk.model.parts), each part
checks its own fields, and the feature combinations the kernel does not build are refused here,
so validation happens once, with messages that name the field that is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the package requires 3.11, kept for clarity
    import tomli as tomllib

from tpumk.errors import ConfigError, NotSupportedError, did_you_mean
from tpumk.model.hf_defaults import CLASS_DEFAULTS, HF_CLASS_OF, ROPE_DEFAULTS, ROPE_TABLE_DEFAULTS
from tpumk.model.hf_fields import (FAMILIES, GEMMA3_TEXT_DEFAULTS, UNSUPPORTED_FAMILIES, WRAPPER_SHARED_KEYS, WRAPPERS,
                                   account_fields)
from tpumk.model.parts import (MLA_FIELDS, Attention, Head, LayerPattern, LinearAttention, Mlp, Moe, Norms, Positions,
                               is_int, is_number, take)
from tpumk.tomlfile import parser_refusal, read_toml

DTYPES = ("float32", "bfloat16")
# A layer's norm weight vectors in the reference layout (replicated on many devices; Gemma's
# (1 + w) is folded into each on load).
LAYER_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
# Fields added after models were first described: to_dict leaves them out at their defaults, so
# the description (and every content-addressed key made from it) of an older model is unchanged.
LATER_FIELDS = ("rms_width", "head_width", "qkv_bias", "mlp_act", "embed_scale", "post_norms", "attn_scalar",
                "rope_local_theta", "attn_softcap", "final_softcap", "pre_norms", "qk_norm_whole", "norm_kind",
                "parallel_blocks", "rotary_dim", "shared_expert_gate", "rope_short_factor", "rope_long_factor",
                "rope_attention_factor", "attn_sinks", "o_bias", "router_logit_bias", "expert_bias", "swiglu_limit",
                "swiglu_alpha", "linear_kind", "linear_layers", "linear_key_heads", "linear_value_heads",
                "linear_key_dim", "linear_value_dim", "linear_conv", "attn_output_gate", "nope_layers",
                "latent_norm_eps", "step_bidirectional", "query_scale_beta", "query_scale_interval", "index_topk",
                "index_heads", "index_head_dim", "index_rope_interleave", "index_shared_layers", "embed_norm",
                "post_norm_eps", "residual_gates", "attn_out_norm", "moe_hidden_size", "expert_post_norm",
                "rope_learned_freqs", "query_log_scale", "nope_latent_keys", "kv_source_layers", "index_q_hidden",
                "router_float32")
# Fields that list layer indices (stored as sorted tuples).
LAYER_LISTS = ("dense_layers", "sliding_layers", "linear_layers", "nope_layers", "index_shared_layers")
PRESET_PACKAGE = "tpumk.model.presets"

# Sane upper bounds of every size field, checked before anything loops over layers or allocates.
# Each is far above any released decoder (Qwen3-235B: 94 layers, 151936 vocab, 128 experts;
# DeepSeek-V3: 61 layers, 256 experts, hidden 7168), so a value past one is a typo or garbage.
MAX_SIZES = {
    "num_layers": 1024,
    "hidden_size": 65536,
    "num_q_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 4096,
    "vocab_size": 1 << 22,
    "ffn_size": 1 << 20,
    "num_experts": 4096,
    "top_k": 4096,
    "expert_ffn_size": 1 << 20,
    "num_shared_experts": 64,
    "shared_expert_ffn_size": 1 << 20,
    "q_lora_rank": 1 << 16,
    "kv_lora_rank": 1 << 16,
    "qk_nope_head_dim": 4096,
    "qk_rope_head_dim": 4096,
    "v_head_dim": 4096,
    "router_groups": 4096,
    "router_topk_groups": 4096,
    "yarn_original_max_position": 1 << 30,
    "rope_original_max_position": 1 << 30,
    "sliding_window": 1 << 30,
    "index_topk": 1 << 30,
    "index_heads": 1024,
    "index_head_dim": 4096,
    "moe_hidden_size": 65536,
}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: by default Qwen3's (pre-norm, GQA, RoPE, SwiGLU); the fields
    below switch features on, grouped by the part that reads them (tpumk.model.parts)."""

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    ffn_size: int = 0  # dense SwiGLU width; required when any layer is dense
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2 / Qwen2.5); o has none
    tie_embeddings: bool = False
    dtype: str = "bfloat16"
    # Mixture of experts (num_experts == 0 means a dense model).
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_size: int = 0
    router_scoring: str = "softmax"
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    shared_expert_ffn_size: int = 0
    dense_layers: tuple[int, ...] = field(default_factory=tuple)  # dense layers of a MoE model
    # Multi-head latent attention (DeepSeek-V3 / Kimi K2; kv_lora_rank = 0: GQA). An MLA model
    # has num_kv_heads = num_q_heads and head_dim = qk_nope_head_dim + qk_rope_head_dim (the
    # query / key head width); q_lora_rank = 0 means a plain q projection.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek-V3 routing: group-limited top-k (the best `router_topk_groups` of `router_groups`
    # expert groups, a group scored by its two best experts), a per-expert correction bias that
    # only selects, and a factor on the routed experts' weights.
    router_groups: int = 1
    router_topk_groups: int = 1
    router_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    # YaRN RoPE (rope_scaling type yarn; yarn_factor = 0: plain RoPE), MLA models only. The
    # mscales follow transformers: 0 = absent; yarn_attention_factor 0 = derived from them.
    yarn_factor: float = 0.0
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float = 0.0
    yarn_truncate: bool = True
    # RoPE scaling of a GQA model (tpumk.model.rope): "none", "linear" (positions divided by
    # rope_factor), "llama3" (Llama 3.1's banded rescale over rope_original_max_position) or
    # "longrope" (Phi-3.5 / Phi-4-mini: each rotary frequency divided by its rope_short_factor;
    # rope_long_factor is what transformers switches to once a sequence passes
    # rope_original_max_position, so a build's context may not pass it: tpumk.plan.spec).
    # A GQA model's YaRN is the yarn_* fields above, with rope_scaling "none".
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_short_factor: tuple[float, ...] = field(default_factory=tuple)
    rope_long_factor: tuple[float, ...] = field(default_factory=tuple)
    # longrope's factor on cos and sin; 0: transformers' default from rope_factor and
    # rope_original_max_position (sqrt(1 + ln factor / ln original), 1 when factor <= 1)
    rope_attention_factor: float = 0.0
    # Sliding-window attention: the layers in `sliding_layers` let a query at position p see
    # only keys k with p - k < sliding_window (transformers' convention); 0 = no window.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = field(default_factory=tuple)
    # Lanes RMSNorm averages over when hidden_size carries zero padding lanes (the plan's
    # lane-padded copy of a model whose width is not a multiple of 128, tpumk.model.padding);
    # 0: hidden_size.
    rms_width: int = 0
    # A lane-padded copy's true head width (its heads are head_dim lanes, the last ones zero):
    # the softmax scale, the RoPE frequencies and the per-head norms use it; 0: head_dim.
    head_width: int = 0
    # The dense MLP's activation (MLP_ACTS) and a factor on the embedding rows (Gemma:
    # sqrt(hidden_size); applied rounded to the embedding's dtype, as transformers does).
    mlp_act: str = "silu"
    embed_scale: float = 1.0
    # Gemma 3's sublayer norms: besides the norms before attention and the MLP (attn_norm,
    # mlp_norm), each sublayer's output is normalized (post_attn_norm, post_mlp_norm) before it
    # is added to the residual ("sandwich" norms).
    post_norms: bool = False
    # The softmax scale is attn_scalar ** -0.5 (Gemma's query_pre_attn_scalar); 0: the head width.
    attn_scalar: float = 0.0
    # RoPE theta of the sliding-window layers (Gemma 3's rope_local_base_freq, without the
    # full layers' scaling); 0: every layer rotates with rope_theta.
    rope_local_theta: float = 0.0
    # Gemma 2's soft-capping, cap * tanh(x / cap): of the attention scores after scaling and
    # before the mask and softmax (attn_logit_softcapping), and of the logits
    # (final_logit_softcapping); 0: none.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # OLMo 2: no norm before attention and the MLP (attn_norm, mlp_norm), only after them
    # (post_norms); and QK-norm over the whole q and k projections (one RMSNorm across every
    # head, weights of q_size / kv_size) rather than per head.
    pre_norms: bool = True
    qk_norm_whole: bool = False
    # Cohere (Command-R): the residual's norms (attn_norm, mlp_norm, final_norm) are LayerNorm
    # without bias (NORM_KINDS), and attention and the MLP read the same normed input, both
    # outputs added to the residual ("parallel" blocks: no mlp_norm).
    norm_kind: str = "rms"
    parallel_blocks: bool = False
    # Partial rotary (Phi-4-mini, GLM-4.5: partial_rotary_factor): RoPE turns only rotary_dim of
    # each head's lanes; 0: all of them. tpumk's head layout keeps rotate-half pairs (lane i with
    # lane i + head / 2): each half holds its rotary_dim / 2 rotary lanes first, then its share of
    # the unrotated ones, whose RoPE frequency is 0 (cos 1, sin 0: exactly unchanged). A
    # checkpoint's q / k rows are permuted into this layout on load (tpumk.model.checkpoint);
    # scores are unchanged because q and k move alike.
    rotary_dim: int = 0
    # Qwen2-MoE: the shared experts' output is scaled per token by sigmoid(x . w), w a learned
    # [hidden] vector (`shared_router` [H, 1]; transformers' shared_expert_gate) before it joins
    # the routed experts'. The kernel packs w as one more router column (tpumk.kernel.moe).
    shared_expert_gate: bool = False
    # gpt-oss's attention sinks: one learned logit per query head joins each softmax's
    # denominator (a key whose value is zero): weights `sinks` [num_q_heads] per layer.
    attn_sinks: bool = False
    # A bias on the o projection (transformers' attention_bias: Llama, Qwen3, Gemma, OLMo 2,
    # Cohere, gpt-oss put one on q, k, v and o alike): weights `bo` [hidden] per layer, added
    # once to the attention output (after the all-reduce on many devices).
    o_bias: bool = False
    # gpt-oss's mixture of experts: a bias on the router's logits (weights `router_logit_bias`
    # [num_experts], added before the softmax, so it moves both the picks and the weights), biases
    # on every routed expert's gate, up and down projections (`e_gate_bias`, `e_up_bias`
    # [num_experts, expert_ffn_size], `e_down_bias` [num_experts, hidden]), and its clamped
    # SwiGLU: with swiglu_limit > 0 an expert's activation is
    #   min(g, limit) * sigmoid(swiglu_alpha * min(g, limit)) * (clip(u, -limit, limit) + 1)
    # (transformers' GptOssExperts); 0: the plain silu(g) * u.
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # Hybrid models (Qwen3-Next / Qwen3.5: Gated DeltaNet; Kimi Linear: KDA): the layers in
    # `linear_layers` replace softmax attention by a linear-attention layer of `linear_kind`
    # (tpumk.model.parts.LinearAttention, tpumk.model.linear_attention) with its own heads and
    # widths and a causal convolution of `linear_conv` taps; their state lives in a per-sequence
    # slot pool beside the KV cache, which holds the other layers only.
    linear_kind: str = "none"
    linear_layers: tuple[int, ...] = field(default_factory=tuple)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 0
    # Qwen3-Next / Qwen3.5 gated attention: the q projection also emits, per query lane, an output
    # gate g; the attention output is multiplied by sigmoid(g) before the o projection
    # (weights `wq_gate` [H, Hq*D]).
    attn_output_gate: bool = False
    # Attention layers that apply no RoPE (NoPE: Kimi Linear's MLA layers, SmolLM3's every fourth).
    nope_layers: tuple[int, ...] = field(default_factory=tuple)
    # MLA's latent norms (q_a_norm, kv_a_norm) normalise with their own epsilon where it is not
    # rms_eps (transformers builds them with its RMSNorm's default, 1e-6, whatever rms_norm_eps
    # says: Kimi Linear's 1e-5); 0: rms_eps.
    latent_norm_eps: float = 0.0
    # A drafter's block (DFlash, DSpark): a step's own tokens see each other whatever their order
    # (cached keys still causally: each sees the keys before the step); decoders attend causally.
    step_bidirectional: bool = False
    # Position-scaled queries (llama-4's attention temperature; Mistral 4 / Ministral 3's
    # rope_parameters.llama_4_scaling_beta): after RoPE every query (an MLA query's nope and rope
    # lanes alike) is multiplied by 1 + query_scale_beta * ln(1 + floor(position /
    # query_scale_interval)), that factor rounded to the model dtype as transformers casts it
    # (tpumk.model.rope.query_scale); beta 0: unscaled.
    query_scale_beta: float = 0.0
    query_scale_interval: int = 0
    # DeepSeek Sparse Attention (DeepSeek-V3.2's and GLM-5's lightning indexer, MLA models only;
    # tpumk.model.sparse_attention): per MLA layer an indexer of `index_heads` heads of
    # `index_head_dim` lanes (the first qk_rope_head_dim of them roped, rotate-half, or
    # interleaved pairs with `index_rope_interleave`) scores every cached token, and each query
    # attends only to the `index_topk` it scores highest. Its keys live in a second paged cache
    # beside the latent one. The layers in `index_shared_layers` have no indexer and reuse the
    # previous layer's selection (GLM-5's "shared" indexer_types). index_topk 0: dense attention.
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False
    index_shared_layers: tuple[int, ...] = field(default_factory=tuple)
    # Muse Spark (tpumk.model.spark): the embedding rows RMS-normalised without a weight
    # (embed_norm); the post-sublayer norms' own epsilon (post_norm_eps; 0: rms_eps); each
    # sublayer joining the residual as alpha * x + beta * y, alpha and beta learned per channel
    # (residual_gates: weights res_attn_alpha / res_attn_beta / res_mlp_alpha / res_mlp_beta [H],
    # float32); every head's attention output RMS-normalised without a weight before the output
    # gate (attn_out_norm); the routed experts run at moe_hidden_size (0: hidden_size) between a
    # down-projection moe_in [H, M] with its norm moe_in_norm [M] and an up-projection moe_out
    # [M, H]; each routed expert's output RMS-normalised without a weight, eps post_norm_eps,
    # before its routing weight (expert_post_norm).
    embed_norm: bool = False
    post_norm_eps: float = 0.0
    residual_gates: bool = False
    attn_out_norm: bool = False
    moe_hidden_size: int = 0
    expert_post_norm: bool = False
    # Mistral Large 4 (MLA with sparse attention): RoPE frequencies each multiplied by exp(a), a
    # learned per frequency (rope_learned_freqs: weight `rope_alpha` [qk_rope_head_dim / 2],
    # float32); every MLA query (after RoPE) and indexer query multiplied per head by
    # s_h ln(1 + position) + b_h, learned per layer (query_log_scale: weights q_log_scale /
    # q_log_bias [heads], idx_log_scale / idx_log_bias [index_heads]); the NoPE layers' keys all
    # from the latent (nope_latent_keys: their kv_a has no rope columns, their query and key
    # blocks are qk_nope + qk_rope lanes wide, all unrotated); layers that read an earlier
    # layer's latent cache instead of writing their own (kv_source_layers: per layer the layer
    # whose latent rows it attends to, its own index when it owns them; empty: every layer owns
    # its rows); the indexer's queries projected from LayerNorm(x) (weights idx_q_norm /
    # idx_q_bias [H], eps 1e-6) instead of the q-LoRA latent (index_q_hidden); the router's
    # product in float32 with float32 weights (router_float32).
    rope_learned_freqs: bool = False
    query_log_scale: bool = False
    nope_latent_keys: bool = False
    kv_source_layers: tuple[int, ...] = field(default_factory=tuple)
    index_q_hidden: bool = False
    router_float32: bool = False

    def __post_init__(self) -> None:
        # Accept lists from TOML/JSON but store a hashable, sorted tuple (anything else is left
        # as given for `validate` to reject by name).
        for name in LAYER_LISTS:
            dl = getattr(self, name)
            if isinstance(dl, (list, tuple)) and all(is_int(i) for i in dl):
                object.__setattr__(self, name, tuple(sorted(set(dl))))
        if isinstance(self.kv_source_layers, list) and all(is_int(i) for i in self.kv_source_layers):
            object.__setattr__(self, "kv_source_layers", tuple(self.kv_source_layers))  # per layer, in order
        for name in ("rope_short_factor", "rope_long_factor"):  # ordered per frequency: kept as given
            v = getattr(self, name)
            if isinstance(v, (list, tuple)) and all(is_number(x) for x in v):
                object.__setattr__(self, name, tuple(float(x) for x in v))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, fld: str, expected: str) -> None:
            if not cond:
                raise ConfigError(f"model config '{self.name}': field '{fld}' = {_short_repr(getattr(self, fld))}: "
                                  f"expected {expected}")

        if not isinstance(self.name, str) or not self.name or not self.name.isprintable():
            raise ConfigError(f"model config: field 'name' = {_short_repr(self.name)}: expected a non-empty "
                              "one-line string")
        # Types and bounds first: every part's check (and every consumer) may then do arithmetic
        # on the sizes, and nothing loops over more than MAX_SIZES["num_layers"] layers.
        for f in ("num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "router_groups", "router_topk_groups", "rope_original_max_position"):
            need(is_int(getattr(self, f)) and 0 < getattr(self, f) <= MAX_SIZES[f], f,
                 f"a positive integer at most {MAX_SIZES[f]:,}")
        for f in ("ffn_size", "num_experts", "top_k", "expert_ffn_size", "num_shared_experts", "shared_expert_ffn_size",
                  *MLA_FIELDS, "yarn_original_max_position", "sliding_window", "index_topk", "index_heads",
                  "index_head_dim", "moe_hidden_size"):
            need(is_int(getattr(self, f)) and 0 <= getattr(self, f) <= MAX_SIZES[f], f,
                 f"a non-negative integer at most {MAX_SIZES[f]:,}" + (" (0: no window)" if f == "sliding_window" else ""))
        need(isinstance(self.dense_layers, tuple) and all(is_int(i) for i in self.dense_layers), "dense_layers",
             "a list of layer indices")
        need(isinstance(self.dtype, str) and self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        # Each part's own fields, then the rules between parts.
        self.attention.check(need)
        self.moe.check(need, self.num_layers, self.dense_layers)
        self.pattern.check(need)
        self.positions.check(need, has_window=bool(self.sliding_window))
        self.norms.check(need)
        self.mlp.check(need, has_dense_layers=bool(self.pattern.num_dense))
        self.head.check(need)
        self.linear.check(need, self.num_layers)
        self._check_combinations(need)

    def _check_combinations(self, need) -> None:
        """Feature combinations the kernel does not build (each rule names the field to change)."""
        moe, mla = self.is_moe, self.is_mla
        if self.mlp_act != "silu":  # the MoE stage's experts and shared experts are SwiGLU only
            need(not moe, "mlp_act", "silu for a mixture-of-experts model (its experts are SwiGLU)")
        if self.post_norms:
            need(not mla, "post_norms", "false for an MLA model")
        spark = [f for f in ("embed_norm", "residual_gates", "attn_out_norm", "expert_post_norm", "moe_hidden_size",
                             "post_norm_eps") if getattr(self, f)]
        if spark:  # tpumk.model.spark's parts: in the GQA reference step only
            need(not mla and not self.linear, spark[0], "its default for an MLA or linear-attention model")
        if self.post_norm_eps:
            need(self.post_norms, "post_norm_eps", "0 without post_norms (it is their epsilon)")
        if self.norm_kind != "rms":  # MLA's latent norms and QK-norm are RMSNorms
            need(not mla and not self.qk_norm, "norm_kind", "'rms' for an MLA model or with qk_norm")
        if self.parallel_blocks:
            need(not moe and not mla, "parallel_blocks", "false for a mixture-of-experts or MLA model")
        if self.index_shared_layers:
            need(self.attention.is_sparse, "index_shared_layers", "empty without sparse attention (index_topk = 0)")
        if self.attention.is_sparse:  # the indexer's RoPE and cache follow every MLA layer's
            need(not self.linear_layers, "linear_layers", "empty with sparse attention (index_topk > 0)")
            need(not self.nope_layers or self.nope_latent_keys, "nope_layers",
                 "empty with sparse attention (index_topk > 0) unless nope_latent_keys (Mistral Large 4)")
        for f in ("rope_learned_freqs", "query_log_scale", "nope_latent_keys", "index_q_hidden", "router_float32"):
            need(isinstance(getattr(self, f), bool), f, "true or false")
        for f in ("rope_learned_freqs", "query_log_scale", "nope_latent_keys", "kv_source_layers"):
            if getattr(self, f):  # tpumk.model.mla's parts
                need(mla, f, "its default without MLA (kv_lora_rank = 0)")
        if self.index_q_hidden:
            need(self.attention.is_sparse, "index_q_hidden", "false without sparse attention (index_topk = 0)")
        if self.nope_latent_keys:
            need(bool(self.nope_layers), "nope_latent_keys", "false without nope_layers")
        if self.router_float32:
            need(moe, "router_float32", "false without routed experts")
        src = self.kv_source_layers
        if src:
            need(isinstance(src, tuple) and len(src) == self.num_layers
                 and all(is_int(s) and 0 <= s <= i and src[s] == s for i, s in enumerate(src)), "kv_source_layers",
                 f"one entry per layer ({self.num_layers}): an earlier layer that owns its latent rows (its own "
                 "entry), or the layer itself")
            need(all(self.pattern.rotates(i) == self.pattern.rotates(s) for i, s in enumerate(src)),
                 "kv_source_layers", "for each layer a source with the same RoPE (a NoPE layer reads a NoPE "
                 "layer's rows)")

    # ------------------------------------------------------------------ parts (tpumk.model.parts)
    @cached_property
    def attention(self) -> Attention:
        return take(Attention, self)

    @cached_property
    def positions(self) -> Positions:
        return take(Positions, self, head_lanes=self.attention.true_head_dim, mla=self.is_mla)

    @cached_property
    def norms(self) -> Norms:
        return take(Norms, self)

    @cached_property
    def mlp(self) -> Mlp:
        return take(Mlp, self)

    @cached_property
    def moe(self) -> Moe:
        return take(Moe, self)

    @cached_property
    def pattern(self) -> LayerPattern:
        return take(LayerPattern, self, moe=self.is_moe)

    @cached_property
    def head(self) -> Head:
        return take(Head, self)

    @cached_property
    def linear(self) -> LinearAttention:
        return take(LinearAttention, self)

    # ------------------------------------------------------------------ derived facts
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def layer_param_counts(self, i: int) -> dict[str, int]:
        """Parameters of layer i split into what every step reads and what routing selects."""
        h = self.hidden_size
        if self.pattern.is_linear(i):
            mixer = self.linear.param_count()
        elif self.is_mla and (self.nope_latent_keys or self.kv_source_layers or self.query_log_scale):
            # Mistral Large 4: this layer's own MLA tensors (norms included)
            mixer = sum(math.prod(s) for s in self.attention.mla_layer_shapes(
                h, self.pattern.rotates(i), self.pattern.owns_kv(i)).values())
        else:
            mixer = self.attention.param_count(h) + self.attention.norm_params()
        if self.has_indexer(i):
            mixer += sum(math.prod(shape) for shape in self.attention.indexer_shapes(h).values())
        always = mixer + self.norms.per_layer() * h
        if self.pattern.is_dense(i):
            return {"always": always + self.mlp.param_count(h), "per_expert": 0, "experts": 0}
        c = self.moe.param_counts(h)
        return {"always": always + c["always"], "per_expert": c["per_expert"], "experts": self.num_experts}

    def _layer_kinds(self) -> list[tuple[int, dict[str, int]]]:
        """(how many layers, one such layer's param counts) per layer kind: a layer's counts
        depend only on whether it is dense and whether it is linear, so each of those (at most
        four) kinds is counted once (no per-layer loop for the common models: closed form
        without linear layers)."""
        if not self.linear and not self.index_shared_layers and not self.nope_layers and not self.kv_source_layers:
            n_dense = self.pattern.num_dense
            out = []
            if n_dense:
                out.append((n_dense, self.layer_param_counts(self.dense_layers[0] if self.is_moe else 0)))
            if self.num_layers - n_dense:
                out.append((self.num_layers - n_dense, self.layer_param_counts(self.pattern.first_moe_layer())))
            return out
        kinds: dict[tuple[bool, ...], list[int]] = {}
        for i in range(self.num_layers):
            kinds.setdefault((self.pattern.is_dense(i), self.pattern.is_linear(i), self.has_indexer(i),
                              self.pattern.rotates(i), self.pattern.owns_kv(i)), []).append(i)
        return [(len(v), self.layer_param_counts(v[0])) for v in kinds.values()]

    def param_count(self) -> int:
        total = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.hidden_size
        total += self.qk_rope_head_dim // 2 if self.rope_learned_freqs else 0  # Mistral Large 4's rope_alpha
        for n, c in self._layer_kinds():
            total += n * (c["always"] + c["per_expert"] * c["experts"])
        return total

    def decode_weight_bytes(self, batch: int = 1) -> int:
        """Weight bytes one decode step must read from HBM at `batch` sequences.

        The embedding row gather is tiny and not counted. For MoE layers the expected number of
        distinct experts selected by `batch * top_k` uniform picks is counted.
        """
        params = self.vocab_size * self.hidden_size + self.hidden_size  # lm_head + final norm
        for n, c in self._layer_kinds():
            params += n * c["always"]
            if c["experts"]:
                params += n * c["per_expert"] * expected_distinct_experts(self.num_experts, self.top_k, batch)
        return int(round(params * self.dtype_bytes))

    def has_indexer(self, i: int) -> bool:
        """Layer i runs a lightning indexer of its own (sparse attention, not a shared layer)."""
        return self.attention.is_sparse and not self.pattern.shares_selection(i)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """The layers that run their own indexer: the index-key cache holds one layer per entry."""
        return tuple(i for i in range(self.num_layers) if self.has_indexer(i))

    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in a model-dtype cache, every layer (MLA: the stored, lane-padded row)."""
        width = self.attention.latent_cache_lanes if self.is_mla else self.attention.kv_cache_width
        return self.kv_layers * width * self.dtype_bytes

    @property
    def kv_layers(self) -> int:
        """Layers the KV cache holds: the softmax-attention ones (a linear layer keeps a state)."""
        return self.num_layers - len(self.linear_layers)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in LATER_FIELDS:  # added later: models without them keep their keys (and cache keys)
            if d[name] == defaults[name]:
                del d[name]
        for name in (*LAYER_LISTS, "rope_short_factor", "rope_long_factor", "kv_source_layers"):
            if name in d:
                d[name] = list(getattr(self, name))
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts when each of `batch` tokens picks `top_k` of `num_experts`."""
    if num_experts == 0:
        return 0.0
    miss = 1.0
    for j in range(top_k):  # P(a given expert is not among one token's top_k picks)
        miss *= (num_experts - 1 - j) / (num_experts - j)
    return num_experts * (1.0 - miss**batch)


def _short_repr(v: Any, limit: int = 60) -> str:
    """repr(v) cut to one short line (error messages quote user values)."""
    r = " ".join(repr(v).split())
    return r if len(r) <= limit else r[: limit - 3] + "..."


_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
_FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.type == "float")


def from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """Build a config from a plain mapping; unknown keys are an error naming the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a table of model fields")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{source}: unknown field '{unknown[0]}' (known fields: {', '.join(_FIELDS)})")
    for required in ("name", "num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim", "vocab_size"):
        if required not in data:
            raise ConfigError(f"{source}: missing required field '{required}'")
    for key, value in data.items():
        if key in _FLOAT_FIELDS and is_int(value) and is_number(value):
            data = {**data, key: float(value)}
        if key in LAYER_LISTS and not (
                isinstance(value, (list, tuple)) and all(is_int(v) for v in value)):
            raise ConfigError(f"{source}: field '{key}' = {_short_repr(value)}: expected a list of layer indices")
    try:
        return ModelConfig(**data)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except TypeError as e:  # wrong types that break comparisons before validation names them
        raise ConfigError(f"{source}: {e}") from None


def load_toml(path: str | Path) -> ModelConfig:
    """A model TOML file: the fields of ModelConfig at top level, or under a [model] table."""
    path = Path(path)
    data = read_toml(path)
    if "model" in data and isinstance(data["model"], dict) and len(data) == 1:
        data = data["model"]
    data.setdefault("name", path.stem)
    return from_dict(data, str(path))


# ---------------------------------------------------------------------- Hugging Face import
# The model types read (each one's config fields accounted for in tpumk.model.hf_fields).
_HF_SUPPORTED = tuple(FAMILIES)
# Hybrids: Gated DeltaNet layers beside gated attention (Qwen3-Next, Qwen3.5; (1 + w) norms folded
# on load as Gemma's), and Kimi Linear's KDA layers beside NoPE MLA (`_hf_linear_fields`).
HF_GATED_DELTA_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# q and k normalised per head; Llama, Mistral, Phi-3 have no QK-norm
_HF_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmoe") + HF_GATED_DELTA_FAMILIES  # OLMo 2, OLMoE: over the whole projection
_HF_QK_NORM_WHOLE = ("olmo2", "olmoe")
# GeGLU, embeddings x sqrt(hidden), (1 + w) norms (folded on load: tpumk.model.checkpoint), tied by default
HF_GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
# Sandwich norms, query_pre_attn_scalar, soft-capping (attn_logit_softcapping, final_logit_softcapping)
_HF_GEMMA_SANDWICH = ("gemma2", "gemma3_text")
_HF_ROPE_SCALED = ("llama", "mistral", "ministral3", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")
# partial_rotary_factor < 1 turns only the first lanes of each head (transformers' Phi-3 modelling
# rotates q[..., :rotary_dim]; Llama's and most others' ignore the factor's lanes split)
_HF_PARTIAL_ROTARY = ("phi3", "glm4_moe") + HF_GATED_DELTA_FAMILIES
_HF_LONGROPE = ("phi3",)  # rope_scaling type longrope (Phi-3.5, Phi-4-mini)
PHI3_ORIGINAL_MAX_POSITION = 4096  # Phi3Config's original_max_position_embeddings
_HF_QKV_BIAS = ("qwen2",)  # q, k and v projections with biases, o without
# attention_bias = true puts a bias on q, k, v and o (their modelling's o_proj reads it); GLM-4.5's
# is on q, k and v only; the other families refuse it (tpumk.model.hf_fields)
_HF_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe", "granite", "olmo2", "gemma", "gemma2", "gemma3_text", "cohere",
                      "olmoe", "gpt_oss")
# gpt-oss's defaults where its config.json is silent (transformers' GptOssConfig): YaRN over a
# 4096-token pretraining length, theta 150000, q / k / v / o biases, the clamped SwiGLU's constants
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
GPT_OSS_THETA, GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA, GPT_OSS_TOP_K = 150000.0, 7.0, 1.702, 4
# hidden_act -> mlp_act. transformers' Gemma reads the legacy "gelu" of its releases as the tanh
# approximation (GemmaConfig); elsewhere "gelu" is the exact erf GELU, not modelled.
_HF_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_HF_GEMMA_ACTS = {**_HF_ACTS, "gelu": "gelu_tanh"}
# Granite's four scalars (transformers' defaults) and the weights each folds into on load
# (tpumk.model.checkpoint.fold_granite_scalars): the model is a Llama once they are folded.
GRANITE_SCALARS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                   "logits_scaling": 1.0}
# Cohere's logits x logit_scale (transformers' default), folded into the final norm on load
# (tpumk.model.checkpoint.fold_logit_scale).
COHERE_LOGIT_SCALE = 0.0625
# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA with a lightning indexer (`_hf_sparse_fields`)
HF_SPARSE_MLA = ("deepseek_v32", "glm_moe_dsa", "mistral_large4_text")
# MLA (and DeepSeek-V3-style MoE) under every name: Kimi K2 is the DeepSeek-V3 architecture with its
# own sizes; GLM-4.7-Flash (glm4_moe_lite) and Mistral Small 4 (mistral4) read by `_hf_mla_fields` too
_HF_MLA = ("deepseek_v3", "kimi_k2", "glm4_moe_lite", "mistral4") + HF_SPARSE_MLA
# llama-4 position-scaled queries (rope_parameters.llama_4_scaling_beta): `_hf_query_scale`
_HF_QUERY_SCALED = ("mistral4", "ministral3")
MLA_LATENT_EPS = 1e-6  # the epsilon of transformers' MLA latent norms (DeepseekV3RMSNorm's default)
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Families whose sliding layers `layer_types` names (without it: each family's default pattern),
# and those whose window applies whenever `sliding_window` is set (no use_sliding_window flag).
_HF_LAYER_TYPED = ("qwen3", "qwen2", "gemma2", "gemma3_text", "gpt_oss")
_HF_ALWAYS_WINDOWED = ("mistral", "ministral3", "mixtral", "phi3", "gemma2", "gemma3_text", "gpt_oss")


def hf_text_config(data: Any, source: str = "config.json") -> tuple[Any, str]:
    """The config of the language model a Hugging Face config.json describes, and where it
    came from: the config itself, or a multimodal wrapper's `text_config` (tpumk.model.hf_fields.
    WRAPPERS: a multimodal Gemma 3, Kimi K2.5, Qwen3.5, Ministral 3 / Mistral Small 4, Muse Spark) with its
    text config class's defaults filled in,
    the wrapper's stored-weight keys (dtype, name, quantization) where the text config is silent,
    and its head tied by the wrapper's own flag, as transformers ties it. The wrapper's own
    fields are accounted for as a family's are; the vision part is never read (text in, text out)."""
    mt = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(mt, str) or mt not in WRAPPERS:
        return data, source
    wrapper = WRAPPERS[mt]
    account_fields(data, mt, source, wrapper.fields)
    text = data.get("text_config")
    if not isinstance(text, dict):  # (transformers would build its default text model: not this checkpoint's)
        given = "is missing" if "text_config" not in data else f"= {_short_repr(text)}"
        raise ConfigError(f"{source}: field 'text_config' {given}: expected an object (a multimodal {mt} config "
                          "holds its language model's fields there; without them transformers builds a default "
                          "text model)")
    text_type = text.get("model_type", wrapper.text_types[0])
    if text_type not in wrapper.text_types:
        missing = UNSUPPORTED_FAMILIES.get(text_type) if isinstance(text_type, str) else None
        raise NotSupportedError(f"{source}: not supported yet: text_config.model_type {_short_repr(text_type)} in a "
                                f"{mt!r} wrapper (tpumk decodes {' or '.join(map(repr, wrapper.text_types))} there"
                                + (f"; {text_type} has {missing})" if missing else ")"))
    shared = {k: data[k] for k in WRAPPER_SHARED_KEYS if k in data and k not in text}
    tied = data.get("tie_word_embeddings", wrapper.tie_default)
    return ({**wrapper.text_defaults, **shared, **text, "model_type": text_type, "tie_word_embeddings": tied},
            f"{source}: text_config")


def from_hf_config(data: Any, source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face `config.json` (the model types in `_HF_SUPPORTED`: Qwen3,
    Qwen3-MoE, Qwen2, Llama, Granite, Mistral, Ministral 3, Phi-3, OLMo 2, Gemma 1 / 2 / 3 (and a
    multimodal Gemma 3's language model: `hf_text_config`), Cohere, Mixtral, OLMoE, GLM-4.5, Qwen2-MoE,
    gpt-oss, DeepSeek-V3, Kimi K2 (and Kimi K2.5's language model), GLM-4.7-Flash, Mistral Small 4
    (and the mistral3 wrapper's language model), the linear-attention hybrids, Muse Spark (and the
    muse_spark wrapper's language model)) into a ModelConfig.

    Every key of the file is accounted for first (tpumk.model.hf_fields.account_fields: modelled
    here, harmless, or refused at a value that changes the math; any other key refused), so a
    config relabelled from another family is refused rather than read as the named one.
    Anything that changes the math and is not modelled raises NotSupportedError, so a model is
    never silently built wrong. A field of the wrong type or out of bounds raises ConfigError
    naming the field (its Hugging Face name) and the file.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object of model fields, got a JSON {_json_kind(data)}")
    data, source = hf_text_config(data, source)
    mt = _HFFields(data, source).str_("model_type", None)
    if mt in UNSUPPORTED_FAMILIES:
        raise NotSupportedError(f"{source}: not supported yet: model_type {mt!r}: {UNSUPPORTED_FAMILIES[mt]}")
    if mt not in _HF_SUPPORTED:
        raise NotSupportedError(
            f"{source}: not supported yet: model_type {mt!r} (supported: {', '.join(_HF_SUPPORTED)})")
    # every key accounted for (modelled below, harmless, or refused at a value that changes the
    # math); transformers' attribute_map aliases renamed to the names read here
    aliases = {name: alias for alias, name in FAMILIES[mt].aliases.items() if alias in data and data.get(name) is None}
    data = account_fields(data, mt, source)
    # a field the file leaves out is transformers' class default, as transformers reads it
    # (kimi_k2: transformers reads it as DeepseekV3Config, e.g. as Kimi K2.5's text_config)
    data = {**{k: v for k, v in CLASS_DEFAULTS.get(HF_CLASS_OF.get(mt, mt), {}).items() if k not in data}, **data}
    if mt in ROPE_TABLE_DEFAULTS and not data.get("rope_parameters") and not data.get("rope_scaling"):
        # no RoPE table: transformers' class fills its own (Mistral 4 / Ministral 3: YaRN with
        # llama-4 query scaling), whose theta wins over a top-level rope_theta
        data = {**data, "rope_parameters": dict(ROPE_TABLE_DEFAULTS[mt])}
    hf = _HFFields(data, source, aliases)
    if mt == "gpt_oss" and not any(isinstance(data.get(k), dict) and (data[k].get("rope_type") or data[k].get("type"))
                                   for k in ("rope_scaling", "rope_parameters")):
        # no RoPE type given: transformers' GptOssConfig applies its YaRN (keeping a given theta)
        theta = (data.get("rope_parameters") or {}).get("rope_theta") if isinstance(data.get("rope_parameters"), dict) \
            else None
        data = {**{k: v for k, v in data.items() if k != "rope_scaling"},
                "rope_parameters": {**GPT_OSS_ROPE, "rope_theta": theta or data.get("rope_theta", GPT_OSS_THETA)}}
        hf = _HFFields(data, source, aliases)
    # attention_bias: on q, k, v and o (qkv_bias, o_bias) where transformers' modelling reads it
    # so; GLM-4.5's is on q, k and v only (o_proj has none); the families whose projections have
    # no bias refuse it (tpumk.model.hf_fields)
    attention_bias = hf.bool_("attention_bias", mt == "gpt_oss")
    # transformers 5 writes RoPE settings as `rope_parameters` (theta included); 4.x wrote a
    # top-level `rope_theta` plus an optional `rope_scaling` (both set is refused by account_fields).
    rope_key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
    for key in ("rope_scaling", "rope_parameters") if mt != "gemma3_text" else ():  # Gemma 3: _hf_gemma3_rope
        rope = data.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise ConfigError(f"{source}: field '{key}' = {_short_repr(rope)}: expected an object or null")
        kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
        if kind == "dynamic":  # its frequencies follow the sequence length at run time
            raise NotSupportedError(f"{source}: not supported: {key} rope_type 'dynamic' (frequencies that change "
                                    "with the sequence length; a megakernel's RoPE rows are fixed per position)")
        if kind not in (None, "default") and not (kind == "yarn" and (mt in _HF_MLA or mt in _HF_ROPE_SCALED)) \
                and not (kind in ("linear", "llama3") and mt in _HF_ROPE_SCALED) \
                and not (kind == "longrope" and mt in _HF_LONGROPE):
            raise NotSupportedError(f"{source}: not supported yet: {key} {_short_repr(rope, 200)}")
    rope_params = data.get(rope_key) if isinstance(data.get(rope_key), dict) else {}
    # RoPE on only part of each head (Phi-4-mini: model_type phi3, 0.75); transformers 5 keeps
    # the factor in the RoPE table, 4.x at top level.
    rope_defaults = ROPE_DEFAULTS.get(HF_CLASS_OF.get(mt, mt), {})  # transformers' default RoPE table for the family
    default_factor = rope_defaults.get("partial_rotary_factor", 1.0)
    rotary_factor = ("partial_rotary_factor", default_factor) if default_factor != 1 else None
    # (Mistral 4's table names its rope lanes' share of each MLA head: `_hf_mla_fields` checks it)
    for where, table in (("partial_rotary_factor", data), (f"{rope_key}.partial_rotary_factor", rope_params)):
        factor = table.get("partial_rotary_factor") if isinstance(table, dict) and mt != "mistral4" else None
        if factor is None:
            continue
        if factor == 1:
            rotary_factor = None
            continue
        if mt not in _HF_PARTIAL_ROTARY:  # their modelling rotates the whole head whatever the factor says
            raise NotSupportedError(f"{source}: not supported yet: {where} = {_short_repr(factor)} for model_type "
                                    f"{mt!r} (RoPE on part of each head: {', '.join(_HF_PARTIAL_ROTARY)})")
        if not (is_number(factor) and 0 < factor < 1):
            raise ConfigError(f"{source}: field '{where}' = {_short_repr(factor)}: expected a number in (0, 1]")
        rotary_factor = (where, factor)
    if rope_params.get("rope_theta") is not None:  # the table's theta wins over a top-level one, as in transformers
        rope_theta = _HFFields(rope_params, f"{source}: {rope_key}").number("rope_theta", None)
    else:
        rope_theta = hf.number("rope_theta", GPT_OSS_THETA if mt == "gpt_oss" else rope_defaults.get("rope_theta", 10000.0))
    act = _hf_activation(hf, mt)
    if data.get("torch_dtype") is not None and data.get("dtype") is not None and data["torch_dtype"] != data["dtype"]:
        raise ConfigError(f"{source}: fields 'torch_dtype' = {_short_repr(data['torch_dtype'])} and 'dtype' = "
                          f"{_short_repr(data['dtype'])} disagree (transformers 4.x writes torch_dtype, 5.x dtype)")
    torch_dtype = data.get("torch_dtype") or data.get("dtype") or "bfloat16"
    dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}.get(torch_dtype) \
        if isinstance(torch_dtype, str) else None
    if dtype is None:
        raise NotSupportedError(f"{source}: not supported yet: torch_dtype {_short_repr(torch_dtype)}")

    hidden = hf.int_("hidden_size", MAX_SIZES["hidden_size"], _REQUIRED)
    heads = hf.int_("num_attention_heads", MAX_SIZES["num_q_heads"], _REQUIRED)
    n_layers = hf.int_("num_hidden_layers", MAX_SIZES["num_layers"], _REQUIRED)
    head_dim = hf.int_("head_dim", MAX_SIZES["head_dim"], default=None) or (hidden // heads if heads else 0)
    name = data.get("_name_or_path")
    name = name if isinstance(name, str) else ""
    fields: dict[str, Any] = dict(
        name=name.rstrip("/").split("/")[-1] or mt,
        num_layers=n_layers,
        hidden_size=hidden,
        num_q_heads=heads,
        num_kv_heads=hf.int_("num_key_value_heads", MAX_SIZES["num_kv_heads"], default=None) or heads,
        head_dim=head_dim,
        vocab_size=hf.int_("vocab_size", MAX_SIZES["vocab_size"], _REQUIRED),
        ffn_size=hf.int_("intermediate_size", MAX_SIZES["ffn_size"], default=0) or 0,
        rms_eps=hf.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        qk_norm=mt in _HF_QK_NORM or (mt == "glm4_moe" and hf.bool_("use_qk_norm", False)),
        qkv_bias=mt in _HF_QKV_BIAS or attention_bias or (mt == "qwen2_moe" and hf.bool_("qkv_bias", True)),
        o_bias=attention_bias and mt in _HF_ATTENTION_BIAS,
        tie_embeddings=hf.bool_("tie_word_embeddings", mt in HF_GEMMA_FAMILIES + ("cohere",)),  # their default: tied
        dtype=dtype,
        mlp_act=act,
    )
    if rotary_factor is not None:  # transformers: int(head_dim * factor) lanes turn, rotate-half among them
        where, factor = rotary_factor
        rotary = int(head_dim * factor)
        if rotary < 2 or rotary % 2:
            raise NotSupportedError(f"{source}: not supported: {where} = {_short_repr(factor)} turns {rotary} of "
                                    f"head_dim {head_dim} lanes (RoPE needs an even, positive number)")
        fields["rotary_dim"] = rotary
    if mt in HF_GEMMA_FAMILIES:  # embeddings x sqrt(hidden_size) (tpumk.model.reference.embed rounds it as transformers)
        fields["embed_scale"] = math.sqrt(hidden)
    fields.update(_hf_sliding_window(hf, mt, n_layers))
    if mt in _HF_GEMMA_SANDWICH:
        caps = {}
        for f, key, gemma2_default in (("attn_softcap", "attn_logit_softcapping", 50.0),
                                       ("final_softcap", "final_logit_softcapping", 30.0)):
            # null is no soft-capping (Gemma 3's default); a missing key is Gemma 2's default
            v = data[key] if key in data else (gemma2_default if mt == "gemma2" else None)
            if v is not None and not (is_number(v) and 0 < v < math.inf):
                raise ConfigError(f"{source}: field '{key}' = {_short_repr(v)}: expected a positive number or null")
            caps[f] = float(v or 0.0)
        fields.update(post_norms=True, attn_scalar=hf.number("query_pre_attn_scalar", 256.0), **caps)
    if mt == "gemma3_text":
        fields.update(_hf_gemma3_rope(data, source, bool(fields.get("sliding_layers"))))
    if mt == "olmo2":  # norms after each sublayer only
        fields.update(pre_norms=False, post_norms=True)
    if mt in _HF_QK_NORM_WHOLE:  # q / k normalized across all heads
        fields.update(qk_norm_whole=True)
    if mt == "cohere":  # LayerNorm without bias, attention and MLP in parallel, interleaved RoPE (on load)
        if hf.number("logit_scale", COHERE_LOGIT_SCALE) <= 0:
            raise ConfigError(f"{source}: field 'logit_scale' = {_short_repr(data['logit_scale'])}: "
                              "expected a positive number")
        fields.update(norm_kind="layer", parallel_blocks=True, rms_eps=hf.number("layer_norm_eps", 1e-5))
    if mt == "granite":
        for key, default in GRANITE_SCALARS.items():
            if hf.number(key, default) <= 0:
                raise ConfigError(f"{source}: field '{key}' = {_short_repr(data[key])}: expected a positive number")
    if mt in _HF_ROPE_SCALED or mt in _HF_LONGROPE:
        fields.update(_hf_rope_scaling(data, source))
    if mt in ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):
        step = hf.int_("decoder_sparse_step", MAX_SIZES["num_layers"], default=1) or 1
        mlp_only = set(hf.list_("mlp_only_layers", int, "a list of layer indices"))
        # (transformers 5 writes Qwen3-MoE's num_experts as num_local_experts: renamed by account_fields)
        n_exp = hf.int_("num_experts", MAX_SIZES["num_experts"], _REQUIRED)
        dense = [i for i in range(n_layers) if i in mlp_only or not (n_exp > 0 and (i + 1) % step == 0)]
        fields.update(
            num_experts=n_exp,
            top_k=hf.int_("num_experts_per_tok", MAX_SIZES["top_k"], _REQUIRED),
            expert_ffn_size=hf.int_("moe_intermediate_size", MAX_SIZES["expert_ffn_size"], _REQUIRED),
            router_scoring="softmax",
            # Qwen3-Next's default: renormalised; Qwen3.5-MoE's router always renormalises (no field)
            norm_topk_prob=True if mt == "qwen3_5_moe_text" else hf.bool_("norm_topk_prob", mt == "qwen3_next"),
            dense_layers=dense,
        )
        if mt == "qwen3_5_moe_text":  # every layer routed, its dense MLP width unused
            fields.update(dense_layers=[], ffn_size=0)
    if mt in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):  # one shared expert, scaled by sigmoid(x . gate)
        shared = hf.int_("shared_expert_intermediate_size", MAX_SIZES["shared_expert_ffn_size"], default=0) or 0
        if shared:
            fields.update(num_shared_experts=1, shared_expert_ffn_size=shared, shared_expert_gate=True)
    if mt == "mixtral":
        # Mistral's attention; every layer's MLP is routed experts of width intermediate_size,
        # softmax over all of them, the top-k's weights renormalised (the softmax of the top-k
        # logits), as transformers' Mixtral routes
        fields.update(
            ffn_size=0,
            num_experts=hf.int_("num_local_experts", MAX_SIZES["num_experts"], _REQUIRED),
            top_k=hf.int_("num_experts_per_tok", MAX_SIZES["top_k"], _REQUIRED),
            expert_ffn_size=hf.int_("intermediate_size", MAX_SIZES["expert_ffn_size"], _REQUIRED),
            router_scoring="softmax",
            norm_topk_prob=True,
            dense_layers=[],
        )
    if mt == "olmoe":
        if head_dim * heads != hidden:  # its q_norm is hidden_size wide, its k_norm kv_heads x hidden / heads
            raise ConfigError(f"{source}: field 'head_dim' = {head_dim}: expected hidden_size / num_attention_heads "
                              f"= {hidden / heads:g} (OLMoE's QK-norm widths assume it)")
        # every layer's MLP is routed experts of width intermediate_size, softmax over all of
        # them, the top-k's weights renormalised only with norm_topk_prob (default false)
        fields.update(
            ffn_size=0,
            num_experts=hf.int_("num_experts", MAX_SIZES["num_experts"], _REQUIRED),
            top_k=hf.int_("num_experts_per_tok", MAX_SIZES["top_k"], _REQUIRED),
            expert_ffn_size=hf.int_("intermediate_size", MAX_SIZES["expert_ffn_size"], _REQUIRED),
            router_scoring="softmax",
            norm_topk_prob=hf.bool_("norm_topk_prob", False),
            dense_layers=[],
        )
    if mt == "gpt_oss":
        fields.update(_hf_gpt_oss_fields(hf))
    if mt == "glm4_moe":  # DeepSeek-V3's routing and shared experts (transformers' Glm4MoeMoE) on GQA attention
        fields.update(_hf_sigmoid_moe_fields(hf, n_layers, "n_routed_experts", norm_default=True))
    if mt in _HF_MLA:
        fields.update(_hf_mla_fields(hf, mt, data, source, n_layers, heads))
    if mt in _HF_QUERY_SCALED:
        fields.update(_hf_query_scale(data, source, rope_key))
    if mt in HF_GATED_DELTA_FAMILIES + ("kimi_linear",):
        fields.update(_hf_linear_fields(hf, mt, n_layers, heads))
    if mt == "muse_spark_text":
        fields.update(_hf_muse_spark_fields(hf, n_layers, rope_theta))
    return from_dict(fields, source)


def _hf_muse_spark_fields(hf: "_HFFields", n_layers: int, rope_theta: float) -> dict[str, Any]:
    """Muse Spark's language model as transformers' MuseSparkTextModel builds it (tpumk.model.spark):
    `layer_types` (default: full attention on every fourth layer counted back from the last,
    sliding otherwise) with `sliding_window`; `layer_rope_theta` 0 for a NoPE layer (default: the
    full layers); `mlp_layer_types` dense (`intermediate_size`) or sparse (default: all sparse);
    the sparse layers' experts at `moe_hidden_size` between their projections, routed by sigmoid
    scores with a correction bias, renormalised, times `routed_scaling_factor`; its norms,
    residual gates, gated attention and the logits' soft-cap. `qk_scale_factor`,
    `output_multiplier` and `residual_gate_temperature` are folded into the weights on load
    (tpumk.model.spark_weights.fold_tensors), so they are only checked here."""
    src = hf.source
    full = [(n_layers - 1 - i) % 4 == 0 for i in range(n_layers)]
    types = hf.list_("layer_types", str, "a list of layer type names") or \
        ["full_attention" if f else "sliding_attention" for f in full]
    if len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{src}: field 'layer_types' = {_short_repr(types)}: expected {', '.join(_LAYER_TYPES)} for "
                          f"each of the {n_layers} layers")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = hf.int_("sliding_window", MAX_SIZES["sliding_window"], default=None)
    if sliding and not window:
        raise ConfigError(f"{src}: field 'sliding_window' = {_short_repr(hf.data.get('sliding_window'))}: expected a "
                          "positive integer (layer_types names sliding_attention layers)")
    thetas = hf.data.get("layer_rope_theta")
    if thetas is None:
        thetas = [0 if f else rope_theta for f in full]
    if not (isinstance(thetas, list) and len(thetas) == n_layers and all(is_number(t) for t in thetas)):
        raise ConfigError(f"{src}: field 'layer_rope_theta' = {_short_repr(thetas)}: expected a number for each of "
                          f"the {n_layers} layers (0: no RoPE)")
    other = [t for t in thetas if t and t != rope_theta]
    if other:  # transformers' modelling rotates every such layer with the one table's theta
        raise NotSupportedError(f"{src}: not supported: layer_rope_theta entry {_short_repr(other[0])} (transformers "
                                f"5.24 rotates every layer whose entry is not 0 with rope_theta {rope_theta:g})")
    mlp_types = _hf_mlp_layer_types(hf, n_layers) or ["sparse"] * n_layers
    dense = [i for i, t in enumerate(mlp_types) if t == "dense"]
    for key in ("qk_scale_factor", "output_multiplier", "residual_gate_temperature", "post_norm_eps",
                "final_logit_softcapping"):
        v = hf.number(key, None)
        if not 0 < v < math.inf:
            raise ConfigError(f"{src}: field '{key}' = {_short_repr(v)}: expected a positive finite number")
    fields: dict[str, Any] = dict(
        qk_norm=True, tie_embeddings=False, ffn_size=hf.int_("intermediate_size", MAX_SIZES["ffn_size"], _REQUIRED)
        if dense else 0, sliding_window=window if sliding else 0, sliding_layers=sliding,
        nope_layers=[i for i, t in enumerate(thetas) if not t],
        final_softcap=hf.number("final_logit_softcapping", None),
        embed_norm=True, post_norms=True, post_norm_eps=hf.number("post_norm_eps", None), residual_gates=True,
        attn_out_norm=True, attn_output_gate=True)
    if len(dense) == n_layers:
        return fields
    if not hf.int_("moe_hidden_size", MAX_SIZES["moe_hidden_size"], _REQUIRED):
        raise ConfigError(f"{src}: field 'moe_hidden_size' = 0: expected a positive integer (the routed experts' "
                          "width between pre_expert_proj and post_expert_proj)")
    return {**fields, **dict(
        num_experts=hf.int_("num_local_experts", MAX_SIZES["num_experts"], _REQUIRED),
        top_k=hf.int_("num_experts_per_tok", MAX_SIZES["top_k"], _REQUIRED),
        expert_ffn_size=hf.int_("moe_intermediate_size", MAX_SIZES["expert_ffn_size"], _REQUIRED),
        moe_hidden_size=hf.int_("moe_hidden_size", MAX_SIZES["moe_hidden_size"], _REQUIRED),
        router_scoring="sigmoid", norm_topk_prob=True, router_correction_bias=True,
        routed_scaling_factor=hf.number("routed_scaling_factor", None), expert_post_norm=True, dense_layers=dense)}


def _hf_layer_types(hf: "_HFFields", n_layers: int, default: list[str]) -> list[str]:
    """A hybrid's `layer_types` (linear_attention / full_attention per layer), else `default`."""
    types = hf.list_("layer_types", str, "a list of layer type names") or default
    for t in types:
        if t not in ("linear_attention", "full_attention"):
            raise NotSupportedError(f"{hf.source}: not supported yet: layer type {_short_repr(t)} in layer_types "
                                    "(supported: linear_attention, full_attention)")
    if len(types) != n_layers:
        raise ConfigError(f"{hf.source}: field 'layer_types' has {len(types)} entries: expected one per layer "
                          f"({n_layers})")
    return types


def _hf_linear_fields(hf: "_HFFields", mt: str, n_layers: int, heads: int) -> dict[str, Any]:
    """A hybrid's linear-attention layers, as transformers' modelling reads them.

    Gated DeltaNet (Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet): linear_num_key_heads /
    linear_num_value_heads heads of linear_key_head_dim / linear_value_head_dim, a convolution
    of linear_conv_kernel_dim taps; the layers `layer_types` names linear_attention (default:
    all but every full_attention_interval-th); the other layers' attention gates its output
    (q_proj's second half per head). Kimi Linear (KimiLinearDeltaAttention): linear_attn_config
    (or the flat linear_* fields) gives the KDA heads, their width and the convolution; its MLA
    layers apply no RoPE; its dense layers: mlp_layer_types (else first_k_dense_replace)."""
    big = MAX_SIZES["num_q_heads"]
    if mt != "kimi_linear":
        interval = hf.int_("full_attention_interval", MAX_SIZES["num_layers"], default=4) or 4
        default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        types = _hf_layer_types(hf, n_layers, default)
        return dict(linear_kind="gated_delta", linear_layers=[i for i, t in enumerate(types) if t == "linear_attention"],
                    linear_key_heads=hf.int_("linear_num_key_heads", big, _REQUIRED),
                    linear_value_heads=hf.int_("linear_num_value_heads", big, _REQUIRED),
                    linear_key_dim=hf.int_("linear_key_head_dim", MAX_SIZES["head_dim"], _REQUIRED),
                    linear_value_dim=hf.int_("linear_value_head_dim", MAX_SIZES["head_dim"], _REQUIRED),
                    linear_conv=hf.int_("linear_conv_kernel_dim", 1 << 10, _REQUIRED), attn_output_gate=True)
    # Kimi Linear: the released config.json nests the KDA sizes (and 1-indexed layer lists) in
    # linear_attn_config; transformers' own save writes them flat.
    nested = hf.data.get("linear_attn_config")
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError(f"{hf.source}: field 'linear_attn_config' = {_short_repr(nested)}: expected an object")
    nested = _HFFields(nested or {}, f"{hf.source}: linear_attn_config")
    width = nested.int_("head_dim", MAX_SIZES["head_dim"], default=None) or \
        hf.int_("linear_head_dim", MAX_SIZES["head_dim"], default=128)
    kda_heads = nested.int_("num_heads", big, default=None) or hf.int_("linear_num_heads", big, default=32)
    taps = nested.int_("short_conv_kernel_size", 1 << 10, default=None) or \
        hf.int_("linear_conv_kernel_dim", 1 << 10, default=4)
    default = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    full, kda = (nested.list_(k, int, "a list of 1-based layer numbers") for k in ("full_attn_layers", "kda_layers"))
    if hf.data.get("layer_types") is None and (full or kda):
        if sorted(full + kda) != list(range(1, n_layers + 1)):
            raise ConfigError(f"{hf.source}: fields 'linear_attn_config.full_attn_layers' and 'kda_layers' must "
                              f"name each of the layers 1..{n_layers} once")
        default = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n_layers)]
    types = _hf_layer_types(hf, n_layers, default)
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    mlp_types = _hf_mlp_layer_types(hf, n_layers)
    if not mlp_types:
        first = hf.int_("first_k_dense_replace", MAX_SIZES["num_layers"], default=1)
        mlp_types = ["dense" if i < first else "sparse" for i in range(n_layers)]
    # (transformers' KimiLinearConfig attribute names, which its save writes, were renamed to
    # these by account_fields; its default: 256 experts)
    data = {**hf.data, "n_routed_experts": hf.data.get("n_routed_experts") or 256}
    moe = _hf_sigmoid_moe_fields(_HFFields(data, hf.source, hf.aliases), n_layers, "n_routed_experts", norm_default=True)
    moe["dense_layers"] = [i for i, t in enumerate(mlp_types) if t == "dense"]
    nope, rope_dim = (hf.int_(k, MAX_SIZES[k], _REQUIRED) for k in ("qk_nope_head_dim", "qk_rope_head_dim"))
    return dict(linear_kind="kda", linear_layers=linear, linear_key_heads=kda_heads, linear_value_heads=kda_heads,
                linear_key_dim=width, linear_value_dim=width, linear_conv=taps,
                nope_layers=[i for i in range(n_layers) if i not in linear],
                num_kv_heads=heads, head_dim=nope + rope_dim,
                q_lora_rank=hf.int_("q_lora_rank", MAX_SIZES["q_lora_rank"], default=0) or 0,
                kv_lora_rank=hf.int_("kv_lora_rank", MAX_SIZES["kv_lora_rank"], _REQUIRED),
                qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                v_head_dim=hf.int_("v_head_dim", MAX_SIZES["v_head_dim"], _REQUIRED), **moe, **_hf_latent_eps(hf))


def _hf_activation(hf: "_HFFields", mt: str) -> str:
    """The dense MLP's activation (mlp_act) from the key transformers' modelling of the family
    reads: Gemma 2 / 3 `hidden_activation`, the others `hidden_act`. Gemma releases write both;
    the one transformers does not read must agree with it (else the file says two things)."""
    acts = _HF_GEMMA_ACTS if mt in HF_GEMMA_FAMILIES else _HF_ACTS
    key, other = ("hidden_activation", "hidden_act") if mt in _HF_GEMMA_SANDWICH else \
        ("hidden_act", "hidden_activation")
    act = hf.data.get(key)
    if act is None:
        act = "gelu_pytorch_tanh" if mt in HF_GEMMA_FAMILIES else "silu"
    if not isinstance(act, str) or act not in acts:
        raise NotSupportedError(f"{hf.source}: not supported yet: {key} {_short_repr(act)} "
                                f"(supported: {', '.join(acts)})")
    seen = hf.data.get(other) if mt in HF_GEMMA_FAMILIES else None
    if seen is not None and (not isinstance(seen, str) or acts.get(seen) != acts[act]):
        raise NotSupportedError(f"{hf.source}: not supported yet: {other} {_short_repr(seen)} beside {key} "
                                f"{act!r} (transformers' {mt} computes {key}: the two must agree)")
    return acts[act]


def _hf_gpt_oss_fields(hf: "_HFFields") -> dict[str, Any]:
    """gpt-oss's layers as transformers' GptOss modelling reads them: attention sinks; every
    layer's MLP routed experts of width intermediate_size, picked by the top-k of the router's
    biased logits, weighed by the softmax of those k (= the softmax over all, renormalised),
    with biases on each expert's gate, up and down outputs and the clamped SwiGLU (transformers'
    defaults where the file is silent)."""
    top_k = hf.int_("num_experts_per_tok", MAX_SIZES["top_k"], default=GPT_OSS_TOP_K)
    if hf.data.get("experts_per_token") is not None:  # the release's own name, which transformers does not read
        given = hf.int_("experts_per_token", MAX_SIZES["top_k"], _REQUIRED)
        if given != top_k:
            raise ConfigError(f"{hf.source}: field 'experts_per_token' = {given}: expected num_experts_per_tok's "
                              f"{top_k} (transformers routes by num_experts_per_tok, default {GPT_OSS_TOP_K})")
    limit = hf.number("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)
    if not limit > 0:  # transformers clamps at +-limit whatever it is; tpumk's swiglu_limit 0 means no clamp
        raise ConfigError(f"{hf.source}: field 'swiglu_limit' = {_short_repr(hf.data['swiglu_limit'])}: expected a "
                          "positive number (gpt-oss clamps its experts' gate and up outputs at +-swiglu_limit)")
    return dict(
        attn_sinks=True,
        ffn_size=0,
        num_experts=hf.int_("num_local_experts", MAX_SIZES["num_experts"], _REQUIRED),
        top_k=top_k,
        expert_ffn_size=hf.int_("intermediate_size", MAX_SIZES["expert_ffn_size"], _REQUIRED),
        router_scoring="softmax",
        norm_topk_prob=True,
        dense_layers=[],
        router_logit_bias=True,
        expert_bias=True,
        swiglu_limit=limit,
        swiglu_alpha=hf.number("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA),
    )


def _hf_sigmoid_moe_fields(hf: "_HFFields", n_layers: int, experts_key: str, norm_default: bool) -> dict[str, Any]:
    """DeepSeek-V3's MoE as transformers' DeepseekV3 and Glm4Moe modelling read it: sigmoid scores
    with a selection-only correction bias, group-limited top-k, the weights renormalised (with
    norm_topk_prob) then scaled, shared experts of n_shared_experts x moe_intermediate_size, the
    first first_k_dense_replace layers dense. {} without routed experts."""
    n_exp = hf.int_(experts_key, MAX_SIZES["num_experts"], default=0) or 0
    if not n_exp:
        return {}
    fe = hf.int_("moe_intermediate_size", MAX_SIZES["expert_ffn_size"], _REQUIRED)
    shared = hf.int_("n_shared_experts", MAX_SIZES["num_shared_experts"], default=0) or 0
    first_dense = hf.int_("first_k_dense_replace", MAX_SIZES["num_layers"], default=0) or 0
    return dict(
        num_experts=n_exp,
        top_k=hf.int_("num_experts_per_tok", MAX_SIZES["top_k"], _REQUIRED),
        expert_ffn_size=fe,
        num_shared_experts=shared,
        shared_expert_ffn_size=fe if shared else 0,
        router_scoring="sigmoid",
        norm_topk_prob=hf.bool_("norm_topk_prob", norm_default),
        dense_layers=list(range(min(first_dense, n_layers))),
        router_groups=hf.int_("n_group", MAX_SIZES["router_groups"], default=1) or 1,
        router_topk_groups=hf.int_("topk_group", MAX_SIZES["router_topk_groups"], default=1) or 1,
        router_correction_bias=True,  # transformers always carries e_score_correction_bias
        routed_scaling_factor=hf.number("routed_scaling_factor", 1.0),
    )


def _hf_mla_fields(hf: "_HFFields", mt: str, data: dict[str, Any], source: str, n_layers: int,
                   heads: int) -> dict[str, Any]:
    """The MLA, routing and YaRN fields of a deepseek_v3 / kimi_k2 / glm4_moe_lite / mistral4
    config.json, as transformers' modelling of each reads them. All four run DeepSeek-V3's
    attention (Glm4MoeLiteAttention and Mistral4Attention are its copies: q-LoRA or a plain q,
    interleaved or rotate-half rope lanes, YaRN's softmax mscale). DeepSeek-V3 and GLM-4.7-Flash
    route by sigmoid scores with a correction bias, group-limited (other scoring_func /
    topk_method values of their releases' remote code would be built wrong, so they are
    refused); Mistral 4 by softmax scores over its groups, no bias. Dense layers: the first
    first_k_dense_replace (DeepSeek-V3, Mistral 4), or GLM-4.7-Flash's mlp_layer_types."""
    glm, mistral, sparse = mt == "glm4_moe_lite", mt == "mistral4", mt in HF_SPARSE_MLA
    large4 = mt == "mistral_large4_text"
    if not (mistral or large4):
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            got = hf.str_(key, want)
            if got != want:
                raise NotSupportedError(f"{source}: not supported yet: {key} {got!r} (only {want!r})")
        if hf.int_("moe_layer_freq", MAX_SIZES["num_layers"], default=1) != 1:
            raise NotSupportedError(f"{source}: not supported yet: moe_layer_freq {data['moe_layer_freq']!r} (only 1)")
    # checked here; the checkpoint loader applies it (tpumk.model.checkpoint): transformers rotates
    # interleaved pairs when it is true (Mistral 4 admits null: rotate-half, as transformers' `if`)
    if not (isinstance(data.get("rope_interleave", True), bool) or (mistral and data["rope_interleave"] is None)):
        # (Mistral Large 4 has no such field: always interleaved)
        raise hf._bad("rope_interleave", data["rope_interleave"], "true or false")
    nope = hf.int_("qk_nope_head_dim", MAX_SIZES["qk_nope_head_dim"], _REQUIRED)
    rope_dim = hf.int_("qk_rope_head_dim", MAX_SIZES["qk_rope_head_dim"], _REQUIRED)
    # what transformers' config derives and saves (DeepSeek-V3's RoPE is sized by head_dim =
    # qk_rope_head_dim, Mistral 4 sets head_dim = qk_head_dim; GLM-4.7-Flash's head_dim is an
    # alias of qk_rope_head_dim), and the KV heads its attention repeats the latent over: a file
    # that says otherwise is not this model
    expect = [("qk_head_dim", nope + rope_dim, "qk_nope_head_dim + qk_rope_head_dim"),
              ("num_key_value_heads", heads, "num_attention_heads: every head reads the one latent")]
    if not glm and not large4:  # (Mistral Large 4's class overwrites head_dim with qk_rope_head_dim)
        expect.append(("head_dim", nope + rope_dim, "qk_nope_head_dim + qk_rope_head_dim") if mistral else
                      ("head_dim", rope_dim, "qk_rope_head_dim"))
    for key, want, what in expect:
        got = hf.int_(key, 1 << 30, default=None)
        if got is not None and got != want:
            raise ConfigError(f"{source}: field '{key}' = {got}: expected {want} ({what})")
    fields: dict[str, Any] = dict(
        num_kv_heads=heads,  # transformers repeats the one latent for every head (num_key_value_heads unused)
        head_dim=nope + rope_dim,
        q_lora_rank=hf.int_("q_lora_rank", MAX_SIZES["q_lora_rank"], default=0) or 0,
        kv_lora_rank=hf.int_("kv_lora_rank", MAX_SIZES["kv_lora_rank"], _REQUIRED),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=hf.int_("v_head_dim", MAX_SIZES["v_head_dim"], _REQUIRED),
    )
    moe = _hf_sigmoid_moe_fields(hf, n_layers, "n_routed_experts", norm_default=False)
    if mistral and moe:  # Mistral4TopkRouter: softmax over all experts, group-limited, no correction bias
        moe.update(router_scoring="softmax", router_correction_bias=False)
    if large4 and moe:  # MistralLarge4TextTopkRouter: Mistral 4's, float32, always renormalised
        moe.update(router_scoring="softmax", router_correction_bias=False, norm_topk_prob=True, router_float32=True)
    if glm:
        moe = _hf_glm4_lite_layers(hf, n_layers, moe)
    if sparse:  # dense layers by mlp_layer_types (default: the first first_k_dense_replace)
        first = hf.int_("first_k_dense_replace", MAX_SIZES["num_layers"], _REQUIRED)
        moe = _hf_glm4_lite_layers(hf, n_layers, moe, ["dense"] * min(first, n_layers) + ["sparse"] * (n_layers - first))
        fields.update(_hf_sparse_fields(hf, mt, n_layers, fields))
    fields.update(moe)
    if mistral:
        fields.update(_hf_mistral4_rope(data, source, nope, rope_dim))
    if large4:
        fields.update(_hf_large4_fields(hf, n_layers))
    fields.update(_hf_yarn(data, source))
    if not large4:  # (Mistral Large 4 builds its kv_a_layernorm with rms_norm_eps)
        fields.update(_hf_latent_eps(hf))
    return fields


def _hf_glm4_lite_layers(hf: "_HFFields", n_layers: int, moe: dict[str, Any], default: list[str] | None = None
                         ) -> dict[str, Any]:
    """GLM-4.7-Flash's dense and routed layers: `mlp_layer_types` ('dense' / 'sparse' per layer;
    transformers' default: the first layer dense, the rest routed). Its release also writes
    first_k_dense_replace, which transformers does not read: it must say the same layers.
    DeepSeek-V3.2 / GLM-5 (`default`: the layers their first_k_dense_replace makes dense, which
    transformers derives mlp_layer_types from when the file has none) read the same way."""
    default = default or ["dense"] + ["sparse"] * (n_layers - 1)
    types = _hf_mlp_layer_types(hf, n_layers) or default
    first = hf.int_("first_k_dense_replace", MAX_SIZES["num_layers"], default=None)
    if first is not None and types != ["dense"] * min(first, n_layers) + ["sparse"] * (n_layers - first):
        where = "mlp_layer_types" if hf.data.get("mlp_layer_types") is not None else "mlp_layer_types' default"
        raise ConfigError(f"{hf.source}: field 'first_k_dense_replace' = {first}: expected the layers {where} makes "
                          f"dense ({types.count('dense')} of {n_layers}; transformers' Glm4MoeLite reads "
                          "mlp_layer_types only)")
    dense = [i for i, t in enumerate(types) if t == "dense"]
    if not moe or len(dense) == n_layers:  # no routed layer: a dense model
        return {}
    return {**moe, "dense_layers": dense}


def _hf_sparse_fields(hf: "_HFFields", mt: str, n_layers: int, mla: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek Sparse Attention's fields (DeepSeek-V3.2, GLM-5) as transformers reads them: the
    indexer's heads, width and top-k; every layer an indexed-attention layer (`layer_types`);
    GLM-5's `indexer_types` ('full' / 'shared' per layer; without it transformers derives them from
    index_topk_pattern, else index_topk_freq and index_skip_topk_offset); the indexer's rope lanes
    rotate-half (DeepSeek-V3.2) or interleaved (GLM-5). Their attention always has q-LoRA."""
    src = hf.source
    large4 = mt == "mistral_large4_text"  # its indexer's queries project the hidden state: no q-LoRA needed
    if not mla["q_lora_rank"] and not large4:
        raise ConfigError(f"{src}: field 'q_lora_rank' = {_short_repr(hf.data.get('q_lora_rank'))}: expected a positive "
                          f"integer ({mt}'s attention always projects q through the q-LoRA latent its indexer reads)")
    types = hf.list_("layer_types", str, "a list of 'indexed_attention' per layer")
    if types and (len(types) != n_layers or any(t != "indexed_attention" for t in types)):
        raise NotSupportedError(f"{src}: not supported: field 'layer_types' = {_short_repr(types)} (every layer of "
                                f"{mt} is 'indexed_attention': one for each of the {n_layers} layers)")
    topk = hf.int_("index_topk", MAX_SIZES["index_topk"], _REQUIRED)
    heads = hf.int_("index_n_heads", MAX_SIZES["index_heads"], _REQUIRED)
    dim = hf.int_("index_head_dim", MAX_SIZES["index_head_dim"], _REQUIRED)
    rope = mla["qk_rope_head_dim"]
    if topk < 1:
        raise ConfigError(f"{src}: field 'index_topk' = {topk}: expected a positive integer (the cached tokens each "
                          "query attends to)")
    if heads < 1:
        raise ConfigError(f"{src}: field 'index_n_heads' = {heads}: expected a positive integer (the indexer's heads)")
    if dim < rope:
        raise ConfigError(f"{src}: field 'index_head_dim' = {dim}: expected at least qk_rope_head_dim ({rope}: the "
                          "indexer ropes its first qk_rope_head_dim lanes)")
    shared: list[int] = []
    if mt in ("glm_moe_dsa", "mistral_large4_text"):
        kinds = _hf_indexer_types(hf, n_layers)
        shared = [i for i, k in enumerate(kinds) if k == "shared"]
        if 0 in shared:
            raise ConfigError(f"{src}: field 'indexer_types' = {_short_repr(kinds)}: expected 'full' for layer 0 (a "
                              "'shared' layer reuses the previous layer's selection; transformers fails without one)")
    return dict(index_topk=topk, index_heads=heads, index_head_dim=dim, index_shared_layers=shared,
                index_rope_interleave=mt in ("glm_moe_dsa", "mistral_large4_text"), index_q_hidden=large4)


def _hf_large4_fields(hf: "_HFFields", n_layers: int) -> dict[str, Any]:
    """Mistral Large 4's own parts, as transformers' MistralLarge4TextModel builds them: learned
    RoPE frequencies and per-head log-position query scales (weights: always present), NoPE
    layers by `no_rope_layers` (1: RoPE, 0: NoPE; at least one entry per layer; default: every
    `no_rope_layer_interval`-th layer, 4) whose keys are all latent, layers reading an earlier
    layer's latent rows by `kv_source_layers`, and the logits' soft-cap
    (`final_logit_softcapping`, which its MistralLarge4ForConditionalGeneration always applies)."""
    src = hf.source
    rope_flags = hf.list_("no_rope_layers", int, "a list of 1 (RoPE) / 0 (NoPE) per layer")
    if not rope_flags:
        interval = hf.int_("no_rope_layer_interval", MAX_SIZES["num_layers"], default=4)
        if not interval:
            raise ConfigError(f"{src}: field 'no_rope_layer_interval' = 0: expected a positive integer (every "
                              "interval-th layer is NoPE)")
        rope_flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(rope_flags) < n_layers or any(f not in (0, 1) for f in rope_flags[:n_layers]):
        raise ConfigError(f"{src}: field 'no_rope_layers' = {_short_repr(rope_flags)}: expected 1 (RoPE) or 0 (NoPE) "
                          f"for each of the {n_layers} layers")
    rotates = [bool(f) for f in rope_flags[:n_layers]]
    sources = hf.list_("kv_source_layers", int, "a list of layer indices, one per layer") or list(range(n_layers))
    if len(sources) != n_layers or any(not 0 <= s <= i or sources[s] != s for i, s in enumerate(sources)):
        raise ConfigError(f"{src}: field 'kv_source_layers' = {_short_repr(sources)}: expected for each of the "
                          f"{n_layers} layers itself or an earlier layer that is its own source")
    # transformers hands a sharing layer the rows of the last earlier layer that stores its rows
    # for a later one (a source in kv_source_layers) with the same RoPE, whatever index it names:
    # a list naming another layer would be read as that one, so it is refused
    producers = {s for i, s in enumerate(sources) if s != i}
    for i, s in enumerate(sources):
        if s == i:
            continue
        read = max((j for j in producers if j < i and rotates[j] == rotates[i]), default=None)
        if read != s:
            raise NotSupportedError(f"{src}: not supported: field 'kv_source_layers' = {_short_repr(sources)}: layer "
                                    f"{i} names layer {s}, but transformers' shared KV states hand it "
                                    + ("none (no earlier source layer with its RoPE)" if read is None else
                                       f"layer {read}'s rows (the last earlier source layer with its RoPE)"))
    cap = hf.number("final_logit_softcapping", None)
    if not cap or cap < 0:
        raise ConfigError(f"{src}: field 'final_logit_softcapping' = {_short_repr(cap)}: expected a positive number "
                          "(MistralLarge4ForConditionalGeneration always divides the logits by it)")
    nope = [i for i, r in enumerate(rotates) if not r]
    return dict(rope_learned_freqs=True, query_log_scale=True, nope_layers=nope, nope_latent_keys=bool(nope),
                kv_source_layers=sources if sources != list(range(n_layers)) else [], final_softcap=cap)


def _hf_indexer_types(hf: "_HFFields", n_layers: int) -> list[str]:
    """GLM-5's 'full' / 'shared' per layer, as GlmMoeDsaConfig derives them: indexer_types, else
    index_topk_pattern ('F' / 'S' per layer, or a list of the words), else layer i is full when
    max(i - index_skip_topk_offset + 1, 0) is a multiple of index_topk_freq (defaults 2 and 1)."""
    src, data = hf.source, hf.data
    kinds = data.get("indexer_types")
    where = "indexer_types"
    if kinds is None and data.get("index_topk_pattern") is not None:
        pattern, where = data["index_topk_pattern"], "index_topk_pattern"
        if isinstance(pattern, str) and set(pattern) <= {"F", "S"}:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern]
        else:
            kinds = pattern
    elif kinds is None:
        freq = max(hf.int_("index_topk_freq", MAX_SIZES["num_layers"], default=1), 1)
        offset = hf.int_("index_skip_topk_offset", MAX_SIZES["num_layers"], default=2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if not (isinstance(kinds, list) and len(kinds) == n_layers and all(k in ("full", "shared") for k in kinds)):
        raise ConfigError(f"{src}: field '{where}' = {_short_repr(kinds)}: expected 'full' or 'shared' for each of "
                          f"the {n_layers} layers" + (" (or a string of 'F' / 'S')" if where != "indexer_types" else ""))
    return kinds


def _hf_mlp_layer_types(hf: "_HFFields", n_layers: int) -> list[str]:
    """`mlp_layer_types` checked ('dense' or 'sparse' for each layer), or [] when absent."""
    types = hf.list_("mlp_layer_types", str, "a list of 'dense' / 'sparse' per layer")
    if types and (len(types) != n_layers or any(t not in ("dense", "sparse") for t in types)):
        raise ConfigError(f"{hf.source}: field 'mlp_layer_types' = {_short_repr(types)}: expected 'dense' or "
                          f"'sparse' for each of the {n_layers} layers")
    return types


def _hf_mistral4_rope(data: dict[str, Any], source: str, nope: int, rope_dim: int) -> dict[str, Any]:
    """Mistral 4's RoPE table: YaRN only (transformers' Mistral4 builds any other type's
    frequencies over head_dim = qk_nope + qk_rope lanes, which its qk_rope_head_dim-wide rope
    lanes cannot take: it fails), over int(head_dim x partial_rotary_factor) lanes (default
    qk_rope / head_dim), which must be the rope lanes. Returns {} (checks only)."""
    key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
    rope = data.get(key) or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "yarn":
        raise NotSupportedError(f"{source}: not supported: {key} rope_type {_short_repr(kind)} for model_type "
                                "'mistral4' (transformers' Mistral4 rotates its rope lanes with YaRN only)")
    head = nope + rope_dim
    factor = rope.get("partial_rotary_factor", rope_dim / head)
    if not is_number(factor) or int(head * factor) != rope_dim:
        raise ConfigError(f"{source}: field '{key}.partial_rotary_factor' = {_short_repr(factor)}: expected "
                          f"{rope_dim / head:g} (YaRN turns int(head_dim {head} x factor) lanes: the "
                          f"qk_rope_head_dim {rope_dim} rope lanes)")
    return {}


def _hf_query_scale(data: dict[str, Any], source: str, rope_key: str) -> dict[str, Any]:
    """llama-4 position-scaled queries (Mistral 4, Ministral 3): the RoPE table's
    llama_4_scaling_beta over its original_max_position_embeddings, both of which transformers'
    attention reads (it fails without either; beta 0: unscaled)."""
    table = data.get(rope_key) or {}
    r = _HFFields(table, f"{source}: {rope_key}")
    if table.get("llama_4_scaling_beta") is None:
        raise ConfigError(f"{source}: field '{rope_key}.llama_4_scaling_beta' is missing: expected a number (the "
                          "attention multiplies each query by 1 + beta x ln(1 + floor(position / "
                          "original_max_position_embeddings)); 0: unscaled)")
    beta = r.number("llama_4_scaling_beta", None)
    if not beta:
        return {}
    interval = r.int_("original_max_position_embeddings", MAX_SIZES["rope_original_max_position"], default=None)
    if not interval:
        given = "is missing" if interval is None else f"= {interval}"
        raise ConfigError(f"{source}: field '{rope_key}.original_max_position_embeddings' {given}: expected a positive "
                          "integer (the positions per step of llama_4_scaling_beta's query scale)")
    return dict(query_scale_beta=beta, query_scale_interval=interval)


def _hf_latent_eps(hf: "_HFFields") -> dict[str, Any]:
    """transformers builds an MLA layer's q_a / kv_a norms with its RMSNorm's default epsilon
    (1e-6), not rms_norm_eps: latent_norm_eps where the two differ."""
    return {} if hf.number("rms_norm_eps", 1e-6) == MLA_LATENT_EPS else {"latent_norm_eps": MLA_LATENT_EPS}


def _hf_yarn(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The yarn_* fields of a `rope_scaling` / `rope_parameters` of type yarn (MLA or GQA), else {}.
    A missing factor is max_position_embeddings / original_max_position_embeddings, as transformers."""
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) != "yarn":
        return {}
    where = f"{source}: {'rope_parameters' if data.get('rope_parameters') else 'rope_scaling'}"
    r = _HFFields(rope, where)
    original = r.int_("original_max_position_embeddings", MAX_SIZES["yarn_original_max_position"], _REQUIRED)
    factor = r.number("factor", 0.0) or \
        _HFFields(data, source).int_("max_position_embeddings", 1 << 40, _REQUIRED) / original
    return dict(
        yarn_factor=factor,
        yarn_original_max_position=original,
        yarn_beta_fast=r.number("beta_fast", 32.0) or 32.0,  # transformers: `or 32`
        yarn_beta_slow=r.number("beta_slow", 1.0) or 1.0,
        yarn_mscale=r.number("mscale", 0.0),
        yarn_mscale_all_dim=r.number("mscale_all_dim", 0.0),
        yarn_attention_factor=r.number("attention_factor", 0.0),
        yarn_truncate=r.bool_("truncate", True),
    )


def _hf_gemma3_rope(data: dict[str, Any], source: str, sliding: bool) -> dict[str, Any]:
    """Gemma 3's two RoPEs: the full-attention layers' theta (default 1e6) with an optional
    linear scaling, the sliding layers' own plain theta (default 1e4). transformers 5 writes
    them as rope_parameters {full_attention, sliding_attention}; 4.x as rope_theta,
    rope_scaling and rope_local_base_freq."""
    rp = data.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        tables = {"full": ("rope_parameters.full_attention", rp.get("full_attention") or {}),
                  "local": ("rope_parameters.sliding_attention", rp.get("sliding_attention") or {})}
    else:
        scaling = data.get("rope_scaling") or {}
        tables = {"full": ("rope_scaling", {**(scaling if isinstance(scaling, dict) else {"rope_type": scaling}),
                                            "rope_theta": data.get("rope_theta")}),
                  "local": ("rope_local_base_freq", {"rope_theta": data.get("rope_local_base_freq")})}
    out: dict[str, Any] = {}
    for which, default_theta in (("full", 1e6), ("local", 1e4)):
        where, table = tables[which]
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: field '{where}' = {_short_repr(table)}: expected an object or null")
        kind = table.get("rope_type") or table.get("type") or "default"
        if kind not in (("default", "linear") if which == "full" else ("default",)):
            raise NotSupportedError(f"{source}: not supported yet: {where} rope_type {_short_repr(kind)}")
        r = _HFFields(table, f"{source}: {where}")
        theta = r.number("rope_theta", default_theta)
        if theta <= 0:
            raise ConfigError(f"{source}: field '{where}.rope_theta' = {_short_repr(theta)}: expected a positive number")
        if which == "full":
            out["rope_theta"] = theta
            if kind == "linear":
                out.update(rope_scaling="linear", rope_factor=r.number("factor", None))
        elif sliding:  # without sliding layers the local theta rotates nothing
            out["rope_local_theta"] = theta
    return out


def _hf_rope_scaling(data: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_scaling / rope_factor / the llama3 band / longrope's factors / yarn of a GQA model,
    from `rope_parameters` (transformers 5) or `rope_scaling` (4.x); the type was checked by the
    caller."""
    key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
    rope = data.get(key) or {}
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "yarn":
        return _hf_yarn(data, source)
    if kind == "longrope":
        return _hf_longrope(data, f"{source}: {key}", rope)
    if kind not in ("linear", "llama3"):
        return {}
    r = _HFFields(rope, f"{source}: {key}")
    fields: dict[str, Any] = {"rope_scaling": kind, "rope_factor": r.number("factor", None)}
    if kind == "llama3":
        fields.update(
            rope_low_freq_factor=r.number("low_freq_factor", None),
            rope_high_freq_factor=r.number("high_freq_factor", None),
            rope_original_max_position=r.int_("original_max_position_embeddings",
                                              MAX_SIZES["rope_original_max_position"], _REQUIRED),
        )
    return fields


def _hf_longrope(data: dict[str, Any], where: str, rope: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE (Phi-3.5, Phi-4-mini): its per-frequency factors, the pretraining length
    (Phi3Config's top-level original_max_position_embeddings, default 4096, which transformers
    writes over the rope table's), the factor (given, else max_position_embeddings over that
    length) and an optional attention factor."""
    r = _HFFields(rope, where)
    top = _HFFields(data, where.split(": ")[0])
    original = data.get("original_max_position_embeddings", PHI3_ORIGINAL_MAX_POSITION)
    in_table = rope.get("original_max_position_embeddings")
    if in_table is not None and in_table != original:
        raise ConfigError(f"{where}: field 'original_max_position_embeddings' = {_short_repr(in_table)}: expected the "
                          f"top-level original_max_position_embeddings ({_short_repr(original)}), which "
                          "transformers' Phi-3 reads instead")
    if not (is_int(original) and 0 < original <= MAX_SIZES["rope_original_max_position"]):
        raise ConfigError(f"{where}: field 'original_max_position_embeddings' = {_short_repr(original)}: expected a "
                          f"positive integer at most {MAX_SIZES['rope_original_max_position']:,} (longrope)")
    factors = {}
    for name in ("short_factor", "long_factor"):
        v = rope.get(name)
        if not (isinstance(v, list) and v and all(is_number(x) and x > 0 for x in v)):
            raise ConfigError(f"{where}: field '{name}' = {_short_repr(v)}: expected a list of positive numbers "
                              "(one per rotary frequency)")
        factors[name] = tuple(float(x) for x in v)
    factor = r.number("factor", 0.0) or top.int_("max_position_embeddings", 1 << 40, _REQUIRED) / original
    return dict(rope_scaling="longrope", rope_factor=max(float(factor), 1.0), rope_original_max_position=original,
                rope_short_factor=factors["short_factor"], rope_long_factor=factors["long_factor"],
                rope_attention_factor=r.number("attention_factor", 0.0))


def _hf_sliding_window(hf: "_HFFields", mt: str, n_layers: int) -> dict[str, Any]:
    """sliding_window / sliding_layers as transformers reads them: the window is
    `sliding_window` only when `use_sliding_window` is true (Mistral and Phi-3: whenever it is
    set, on every layer; Llama: never, and tpumk.model.hf_fields refuses a Llama's window).
    Qwen3: the sliding layers are those
    `layer_types` names "sliding_attention", or (without layer_types) the layers from
    `max_window_layers` on. Qwen3-MoE: every layer (its attention ignores layer_types). Gemma 3:
    always a window, on the layers `layer_types` names, else on all but every sixth
    (`sliding_window_pattern`). Gemma 2: always a window, on the layers `layer_types` names, else
    on the even ones; gpt-oss likewise (a window of 128 by default)."""
    layer_types = hf.list_("layer_types", str, "a list of layer type names")
    if mt in _HF_LAYER_TYPED:
        for t in layer_types:
            if t not in _LAYER_TYPES:
                raise NotSupportedError(f"{hf.source}: not supported yet: layer type {_short_repr(t)} in layer_types "
                                        f"(supported: {', '.join(_LAYER_TYPES)})")
        if layer_types and len(layer_types) != n_layers:
            raise ConfigError(f"{hf.source}: field 'layer_types' has {len(layer_types)} entries: expected one per "
                              f"layer ({n_layers})")
    if mt == "llama":  # no window in Llama's attention, whatever the file says
        return {}
    if mt in _HF_ALWAYS_WINDOWED:
        window = hf.int_("sliding_window", MAX_SIZES["sliding_window"], default=128 if mt == "gpt_oss" else None)
    else:
        window = hf.int_("sliding_window", MAX_SIZES["sliding_window"], default=None) \
            if hf.bool_("use_sliding_window", False) else None
    if mt in ("qwen3", "qwen2") and window is None and "sliding_attention" in layer_types:
        raise ConfigError(f"{hf.source}: field 'layer_types' names sliding_attention layers but there is no "
                          "window (use_sliding_window false or sliding_window null)")
    if window is None:
        return {}
    if window < 1:
        raise ConfigError(f"{hf.source}: field 'sliding_window' = {window}: expected a positive integer")
    if mt not in _HF_LAYER_TYPED:
        layers = list(range(n_layers))
    elif layer_types:
        layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    elif mt == "gemma3_text":
        # transformers' Gemma3TextConfig builds layer_types from sliding_window_pattern (default 6)
        # and saves it as _sliding_window_pattern, which it does not read back
        pattern = hf.int_("sliding_window_pattern", MAX_SIZES["num_layers"], default=6) or 6
        saved = hf.int_("_sliding_window_pattern", MAX_SIZES["num_layers"], default=None)
        if saved is not None and saved != pattern:
            raise ConfigError(f"{hf.source}: field '_sliding_window_pattern' = {saved}: expected {pattern} (without "
                              "layer_types, transformers places the windows by sliding_window_pattern, default 6)")
        layers = [i for i in range(n_layers) if (i + 1) % pattern]
    elif mt in ("gemma2", "gpt_oss"):
        layers = list(range(0, n_layers, 2))
    else:
        first = hf.int_("max_window_layers", 1 << 30, default=28)
        layers = list(range(first, n_layers))
    return {"sliding_window": window, "sliding_layers": layers} if layers else {}


def _json_kind(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


class _HFFields:
    """Typed reads of a config.json's fields: a value of the wrong type or out of bounds raises
    ConfigError naming the field (as the file names it: `aliases` maps a field read here to the
    attribute_map alias the file wrote) and the file (never a TypeError from deeper down)."""

    def __init__(self, data: dict[str, Any], source: str, aliases: dict[str, str] | None = None):
        self.data, self.source, self.aliases = data, source, aliases or {}

    def _bad(self, key: str, value: Any, expected: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{self.aliases.get(key, key)}' = {_short_repr(value)}: "
                           f"expected {expected}")

    def _get(self, key: str, default: Any, what: str | None = None) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source}: missing required field '{what or key}'")
            return default
        return self.data[key]

    def int_(self, key: str, upper: int, default: Any = None, what: str | None = None) -> Any:
        """A non-negative int at most `upper`; missing or null: `default` (_REQUIRED: an error)."""
        v = self._get(key, default, what)
        if v is default:
            return v
        if isinstance(v, float) and v.is_integer() and 0 <= v <= upper:  # 8.0 from some exporters
            v = int(v)
        if not is_int(v) or not 0 <= v <= upper:
            raise self._bad(key, v, f"a non-negative integer at most {upper:,}")
        return v

    def number(self, key: str, default: float | None) -> float:
        v = self._get(key, _REQUIRED if default is None else default)
        if not is_number(v):
            raise self._bad(key, v, "a finite number")
        return float(v)

    def bool_(self, key: str, default: bool) -> bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, v, "true or false")
        return v

    def str_(self, key: str, default: str | None) -> str | None:
        v = self._get(key, default)
        if v is not None and not isinstance(v, str):
            raise self._bad(key, v, "a string")
        return v

    def list_(self, key: str, item: type, expected: str) -> list:
        v = self._get(key, [])
        ok = isinstance(v, list) and all(isinstance(x, item) and not isinstance(x, bool) for x in v)
        if not ok:
            raise self._bad(key, v, expected)
        return v


_REQUIRED = object()


def stored_scheme(data: Any, source: str) -> str:
    """The weight scheme (tpumk.model.quantize) a Hugging Face checkpoint stores its weights in,
    from its config.json's `quantization_config`: "none" without one, "fp8-b128" for the
    official FP8 format (quant_method "fp8", fmt "e4m3", weight_block_size [128, 128]), "mxfp4"
    for gpt-oss's release (quant_method "mxfp4": its experts' *_blocks and *_scales), "nvfp4"
    for NVIDIA ModelOpt's NVFP4 (`_modelopt_nvfp4`). Every place a build's weights are derived
    from a checkpoint's config asks here (the spec's default --quant, the checkpoint loader).
    Any other quantization is refused in one line."""
    quant = data.get("quantization_config") if isinstance(data, dict) else None
    if quant is None or quant == {}:
        return "none"
    if not isinstance(quant, dict):
        raise ConfigError(f"{source}: field 'quantization_config' = {_short_repr(quant)}: expected an object "
                          f"(e.g. {{\"quant_method\": \"fp8\", ...}}) or null")
    method = quant.get("quant_method", "?")
    if method == "mxfp4":  # gpt-oss's release: experts in MXFP4 (*_blocks + *_scales), the rest float
        if data.get("model_type") != "gpt_oss":
            raise NotSupportedError(f"{source}: not supported yet: an mxfp4 checkpoint of model_type "
                                    f"{_short_repr(data.get('model_type'))} (tpumk reads gpt-oss's MXFP4 experts)")
        return "mxfp4"
    if method == "modelopt":
        return _modelopt_nvfp4(quant, source)
    if method != "fp8":
        raise NotSupportedError(f"{source}: not supported yet: quantized checkpoint ({_short_repr(method)}; "
                                "tpumk reads fp8 checkpoints with 128 x 128 block scales, gpt-oss's mxfp4 and "
                                "ModelOpt's nvfp4)")
    fmt, block = quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if fmt != "e4m3" or block != [128, 128] or any(isinstance(b, bool) for b in block):
        raise NotSupportedError(f"{source}: not supported yet: fp8 checkpoint with fmt {_short_repr(fmt)} and "
                                f"weight_block_size {_short_repr(block)} (tpumk reads e4m3 with [128, 128] blocks)")
    return "fp8-b128"


# quantization_config fields of a ModelOpt checkpoint (as vLLM's ModelOpt reader takes them)
MODELOPT_FIELDS = frozenset({"quant_method", "quant_algo", "group_size", "ignore", "exclude_modules",
                             "kv_cache_quant_algo", "kv_cache_scheme", "producer", "config_groups"})
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")


def _modelopt_nvfp4(quant: dict, source: str) -> str:
    """NVIDIA ModelOpt's NVFP4 `quantization_config` ({quant_method: modelopt, quant_algo: NVFP4
    or W4A16_NVFP4, group_size: 16, ...}): "nvfp4". Which modules are stored in NVFP4 the
    tensors say (a `weight_scale_2` beside a weight), so `ignore` / `exclude_modules` is only
    checked to be a list; `producer` is informational. Activations stay in the model dtype
    (NVFP4's W4A4 activation quantization is a serving kernel's choice, as W4A16_NVFP4 says:
    docs/quantization.md). Another algorithm, group size, a quantized KV cache or an unknown
    field is refused in one line."""
    field = f"{source}: field 'quantization_config'"
    extra = sorted(set(quant) - MODELOPT_FIELDS)
    if extra:
        raise NotSupportedError(f"{field}: not supported yet: key {_short_repr(extra[0])} of a modelopt "
                                f"quantization (tpumk reads {', '.join(sorted(MODELOPT_FIELDS))})")
    algo = quant.get("quant_algo")
    if not (isinstance(algo, str) and algo.upper() in NVFP4_ALGOS):
        raise NotSupportedError(f"{field}: not supported yet: modelopt quant_algo {_short_repr(algo)} (tpumk "
                                f"reads {' and '.join(NVFP4_ALGOS)})")
    group = quant.get("group_size", 16)
    if group != 16 or isinstance(group, bool):
        raise NotSupportedError(f"{field}: not supported yet: nvfp4 group_size {_short_repr(group)} (NVFP4 has "
                                "one e4m3 scale per 16 values)")
    for key in ("ignore", "exclude_modules"):
        v = quant.get(key, [])
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ConfigError(f"{field}: '{key}' = {_short_repr(v)}: expected a list of module names")
    for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
        if quant.get(key) is not None:
            raise NotSupportedError(f"{field}: not supported yet: {key} {_short_repr(quant[key])} (a KV cache "
                                    "with the checkpoint's static scales; tpumk's own is --kv-dtype)")
    groups = quant.get("config_groups", {})
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ConfigError(f"{field}: 'config_groups' = {_short_repr(groups)}: expected an object of objects")
    for name, g in groups.items():
        w = g.get("weights")
        if w is not None and not (isinstance(w, dict) and w.get("num_bits") == 4 and w.get("type") == "float"
                                  and w.get("group_size", 16) == 16):
            raise NotSupportedError(f"{field}: not supported yet: config group {_short_repr(name)} with weights "
                                    f"{_short_repr(w)} (nvfp4 weights: num_bits 4, type float, group_size 16)")
    return "nvfp4"


def override_dtype(cfg: ModelConfig, dtype: Any) -> str:
    """The dtype a loaded checkpoint's weights are cast to: `dtype` ("float32" / "bfloat16" or
    a dtype object) when given, else the one the checkpoint states."""
    if dtype is None:
        return cfg.dtype
    name = getattr(dtype, "__name__", None) or getattr(dtype, "name", None) or str(dtype)  # jnp.bfloat16, np.dtype
    if name not in DTYPES:
        raise ConfigError(f"load_checkpoint: dtype {dtype!r}: expected float32 or bfloat16")
    return name


def load_hf_config(path: str | Path) -> ModelConfig:
    return load_hf_model(path)[0]


def load_hf_model(path: str | Path) -> tuple[ModelConfig, str]:
    """A config.json (or a checkpoint directory's) as (ModelConfig, the scheme its weights are
    stored in: `stored_scheme`), read once."""
    from tpumk.files import TEXT_LIMIT, is_dir, read_regular

    path = Path(path)
    if is_dir(path):
        path = path / "config.json"
    raw = read_regular(path, TEXT_LIMIT, "expected a config.json file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected a config.json)") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise parser_refusal(str(path), "JSON", "arrays or objects", e) from None
    cfg = from_hf_config(data, str(path))
    stored = stored_scheme(*hf_text_config(data, str(path)))  # a wrapper's language model's weights
    if stored == "nvfp4" and not cfg.is_moe:
        raise NotSupportedError(f"{path}: not supported yet: an nvfp4 checkpoint of a model without routed experts "
                                "(tpumk reads NVFP4 routed experts; its other matrices stay float)")
    return cfg, stored


# ---------------------------------------------------------------------- presets
def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".toml"))


def is_preset_name(name: str) -> bool:
    """A plain name (letters, digits, '.', '_', '-'; no path separator, not '.' or '..'): only
    such a name is looked up among the presets, never joined into their directory otherwise."""
    return (isinstance(name, str) and 0 < len(name) <= 100 and name.strip(".") != ""
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in name))


def load_preset(name: str) -> ModelConfig:
    """A preset by name, matched case-insensitively (Qwen3-8B is qwen3-8b, as model cards write it)."""
    names = preset_names()
    if is_preset_name(name) and name not in names and name.lower() in names:
        name = name.lower()
    if not is_preset_name(name) or name not in names:
        raise ConfigError(f"unknown model preset {_short_repr(name)}{did_you_mean(name, names)} "
                          f"(presets: {', '.join(names)})")
    res = resources.files(PRESET_PACKAGE) / f"{name}.toml"
    data = tomllib.loads(res.read_text())
    return from_dict(data, f"preset {name}")


def resolve_model(spec: str) -> ModelConfig:
    return resolve_model_scheme(spec)[0]


def resolve_model_scheme(spec: str) -> tuple[ModelConfig, str]:
    """A preset name, a TOML file, a Hugging Face config.json, or a checkpoint directory, with
    the scheme its weights are stored in ("none" but for a quantized checkpoint's config.json:
    `stored_scheme`). A value that is not a plain name (a path: it holds a '/') is a file or
    directory, never a preset."""
    from tpumk.files import is_dir, name_problem, shown

    p = Path(spec)
    problem = name_problem(spec)
    if problem:
        raise ConfigError(f"--model {shown(spec)}: {problem}")
    if spec.endswith(".toml"):
        return load_toml(p), "none"
    if spec.endswith(".json") or is_dir(p):
        return load_hf_model(p)
    if is_preset_name(spec):
        return load_preset(spec), "none"
    if not p.exists():
        raise ConfigError(f"{_short_repr(spec)}: no such model file or directory, and not a preset name"
                          f"{did_you_mean(p.name, preset_names())} (presets: {', '.join(preset_names())})")
    raise ConfigError(f"{_short_repr(spec)}: a model file is a model TOML (*.toml) or a config.json (*.json), "
                      "or give a checkpoint directory")
