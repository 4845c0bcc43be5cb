"""The parts a model is composed of, one per feature area: attention, positions (RoPE), norms,
the dense MLP, the mixture of experts, the per-layer pattern and the embedding / head.

A `ModelConfig` stays stored flat (its TOML / JSON fields are the content-addressed description
every cache key is made from); `cfg.attention`, `cfg.positions`, `cfg.norms`, `cfg.mlp`,
`cfg.moe`, `cfg.pattern` and `cfg.head` are these views of it. Each part holds its fields under
their flat names, checks them (messages name the flat field a user writes), and derives what
its stage needs, so the reference, the plan, the kernel and the timeline model read one part
per concern instead of a family name. A new family is a config reader mapping onto these
fields, plus a feature where a part lacks one; rules between parts live in
`tpumk.model.config.ModelConfig.validate`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

# need(condition, flat field name, what was expected): raises ConfigError naming the field.
Need = Callable[[bool, str, str], None]
P = TypeVar("P")

ROPE_SCALINGS = ("none", "linear", "llama3", "longrope")  # tpumk.model.rope
# The gated MLP's activation: act(x @ w_gate) * (x @ w_up) @ w_down. silu: SwiGLU (Qwen, Llama);
# gelu_tanh: GeGLU with GELU's tanh approximation (Gemma's gelu_pytorch_tanh).
MLP_ACTS = ("silu", "gelu_tanh")
# The residual stream's norms: RMSNorm, or LayerNorm without bias (Cohere: mean subtracted).
NORM_KINDS = ("rms", "layer")
SCORINGS = ("softmax", "sigmoid")
# A linear-attention layer's recurrence (tpumk.model.linear_attention): "none" (every layer is
# softmax attention), "gated_delta" (Qwen3-Next / Qwen3.5's Gated DeltaNet: one decay per value
# head and token) or "kda" (Kimi Linear's Kimi Delta Attention: one decay per key channel).
LINEAR_KINDS = ("none", "gated_delta", "kda")


def take(cls: type[P], source: Any, **derived: Any) -> P:
    """A part of `source` (a ModelConfig): its fields of the same names, plus `derived` ones."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in derived]
    return cls(**{n: getattr(source, n) for n in names}, **derived)


def _bool(need: Need, part: Any, *names: str) -> None:
    for n in names:
        need(isinstance(getattr(part, n), bool), n, "true or false")


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): the type checks of every model field."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Attention:
    """GQA (q / k / v / o projections, optional q/k/v biases and QK-norm) or MLA (DeepSeek-V3's
    low-rank latents, kv_lora_rank > 0); how scores are scaled and capped."""
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_width: int  # a lane-padded copy's true head width; 0: head_dim
    qkv_bias: bool
    qk_norm: bool
    qk_norm_whole: bool  # OLMo 2: one norm across every head rather than per head
    attn_scalar: float  # softmax scale attn_scalar ** -0.5 (Gemma); 0: the head width
    attn_softcap: float  # Gemma 2: cap * tanh(score / cap); 0: none
    attn_sinks: bool  # gpt-oss: a learned logit per q head in each softmax's denominator
    o_bias: bool  # a bias on the o projection's output
    attn_output_gate: bool  # Qwen3-Next: o * sigmoid(x @ wq_gate) before the o projection
    attn_out_norm: bool  # Muse Spark: each head's output RMS-normalised (no weight) before the gate
    step_bidirectional: bool  # a drafter's block: the step's tokens see each other in any order
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int  # DeepSeek Sparse Attention: the tokens each query attends to; 0: dense
    index_heads: int
    index_head_dim: int
    index_rope_interleave: bool  # GLM-5: the indexer's rope lanes hold interleaved pairs
    query_log_scale: bool  # Mistral Large 4: queries x (s_h ln(1 + p) + b_h) per layer and head
    nope_latent_keys: bool  # Mistral Large 4: a NoPE layer's keys are all latent (no rope columns)
    index_q_hidden: bool  # Mistral Large 4: the indexer's queries project LayerNorm(x)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_sparse(self) -> bool:
        """DeepSeek Sparse Attention: a lightning indexer picks each query's keys (tpumk.model.sparse_attention)."""
        return self.index_topk > 0

    def indexer_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """One indexer's tensors (a layer that runs its own): its query projection from the q-LoRA
        latent, its key projection, the key's LayerNorm weight and bias, the per-head weights
        (float32, as transformers keeps them)."""
        q_in = hidden if self.index_q_hidden else self.q_lora_rank
        out = {"idx_wq": (q_in, self.index_heads * self.index_head_dim),
               "idx_wk": (hidden, self.index_head_dim), "idx_k_norm": (self.index_head_dim,),
               "idx_k_bias": (self.index_head_dim,), "idx_weights": (hidden, self.index_heads)}
        if self.index_q_hidden:  # Mistral Large 4: the LayerNorm its queries read
            out.update(idx_q_norm=(hidden,), idx_q_bias=(hidden,))
        if self.query_log_scale:
            out.update(idx_log_scale=(self.index_heads,), idx_log_bias=(self.index_heads,))
        return out

    def layer_key_widths(self, rotates: bool) -> tuple[int, int]:
        """(nope, rope) lanes of an MLA layer's query and key blocks: a NoPE layer with
        nope_latent_keys (Mistral Large 4) has all qk_nope + qk_rope lanes from the latent."""
        if self.nope_latent_keys and not rotates:
            return self.qk_nope_head_dim + self.qk_rope_head_dim, 0
        return self.qk_nope_head_dim, self.qk_rope_head_dim

    def mla_layer_shapes(self, hidden: int, rotates: bool, owns_kv: bool) -> dict[str, tuple[int, ...]]:
        """An MLA layer's attention tensors: projection_shapes, with a NoPE layer's kv_a without
        rope columns and its kv_b key blocks wide (nope_latent_keys), no kv_a / kv_a_norm in a
        layer that reads another's latent rows, the query log-scale's per-head weights."""
        out = self.projection_shapes(hidden)
        n, r = self.layer_key_widths(rotates)
        if r != self.qk_rope_head_dim:
            out["wkv_a"] = (hidden, self.kv_lora_rank + r)
            out["wkv_b"] = (self.kv_lora_rank, self.num_q_heads * (n + self.v_head_dim))
        if not owns_kv:
            del out["wkv_a"], out["kv_a_norm"]
        if self.query_log_scale:
            out.update(q_log_scale=(self.num_q_heads,), q_log_bias=(self.num_q_heads,))
        return out

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def true_head_dim(self) -> int:
        """The head width the softmax scale, RoPE and per-head norms are for (head_dim unless padded)."""
        return self.head_width or self.head_dim

    @property
    def score_divisor(self) -> float:
        """Scores are q . k / this: sqrt(attn_scalar), else sqrt(true head width)."""
        return math.sqrt(self.attn_scalar or self.true_head_dim)

    @property
    def kv_cache_width(self) -> int:
        """Elements one token caches per layer: K and V of every KV head, or for MLA the
        normalized latent c_kv and the roped key part (one row shared by all heads)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_size

    @property
    def latent_cache_lanes(self) -> int:
        """MLA: lanes of one stored latent cache row, c_kv | k_rope (kv_cache_width) then zeros
        up to a whole number of 128-lane tiles (DeepSeek-V3: 576 -> 640). The TPU's row-major
        tiled layout pads a row to that anyway; a row off the lane grid instead gets a
        non-row-major default layout on TPU, which the kernel cannot read, so XLA copied the
        whole cache around it every step (docs/many-devices.md, "The KV cache copies")."""
        return -(-self.kv_cache_width // 128) * 128

    def param_count(self, hidden: int) -> int:
        """Parameters of one layer's attention matrices (norms not included)."""
        if not self.is_mla:
            bias = (self.q_size + 2 * self.kv_size if self.qkv_bias else 0) + (hidden if self.o_bias else 0)
            gate = hidden * self.q_size if self.attn_output_gate else 0
            return hidden * (self.q_size + 2 * self.kv_size) + self.q_size * hidden + bias + gate
        q = self.q_lora_rank * (hidden + self.q_size) if self.q_lora_rank else hidden * self.q_size
        kv_b = self.kv_lora_rank * self.num_q_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + hidden * self.kv_cache_width + kv_b + self.num_q_heads * self.v_head_dim * hidden

    def output_columns(self, hidden: int) -> int:
        """Output columns of one layer's attention matrices (one quantization scale each)."""
        if not self.is_mla:
            return self.q_size * (1 + self.attn_output_gate) + 2 * self.kv_size + hidden
        q = self.q_lora_rank + self.q_size if self.q_lora_rank else self.q_size
        return q + self.kv_cache_width + self.num_q_heads * (self.qk_nope_head_dim + self.v_head_dim) + hidden

    def projection_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """The layer's attention matrices in the reference layout ([in, out])."""
        h, hq = hidden, self.num_q_heads
        if not self.is_mla:
            gate = {"wq_gate": (h, self.q_size)} if self.attn_output_gate else {}
            return {"wq": (h, self.q_size), **gate, "wk": (h, self.kv_size), "wv": (h, self.kv_size),
                    "wo": (self.q_size, h)}
        out: dict[str, tuple[int, ...]] = {}
        if self.q_lora_rank:
            out.update(wq_a=(h, self.q_lora_rank), q_a_norm=(self.q_lora_rank,), wq_b=(self.q_lora_rank, self.q_size))
        else:
            out.update(wq=(h, self.q_size))
        out.update(wkv_a=(h, self.kv_cache_width), kv_a_norm=(self.kv_lora_rank,),
                   wkv_b=(self.kv_lora_rank, hq * (self.qk_nope_head_dim + self.v_head_dim)),
                   wo=(hq * self.v_head_dim, h))
        return out

    def extra_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """q / k / v biases (Qwen2), the QK-norm weights (per head, or across every head), the
        attention sinks (gpt-oss: one logit per q head), then the o projection's bias."""
        out: dict[str, tuple[int, ...]] = {}
        if self.qkv_bias:
            out.update(bq=(self.q_size,), bk=(self.kv_size,), bv=(self.kv_size,))
        if self.qk_norm:
            q, k = (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
            out.update(q_norm=(q,), k_norm=(k,))
        if self.attn_sinks:
            out.update(sinks=(self.num_q_heads,))
        if self.o_bias:
            out.update(bo=(hidden,))
        return out

    def norm_params(self) -> int:
        """Parameters of one layer's attention-side vectors (QK-norm, MLA's latent norms, sinks)."""
        qk = 0
        if self.qk_norm:
            qk = self.q_size + self.kv_size if self.qk_norm_whole else 2 * self.head_dim
        return qk + self.q_lora_rank + self.kv_lora_rank + self.attn_sinks * self.num_q_heads

    def check(self, need: Need) -> None:
        need(self.num_q_heads % self.num_kv_heads == 0, "num_kv_heads", f"a divisor of num_q_heads ({self.num_q_heads})")
        if not self.is_mla:
            need(self.head_dim % 2 == 0, "head_dim", "an even number (RoPE rotates pairs)")
        _bool(need, self, "qk_norm", "qkv_bias", "qk_norm_whole", "attn_sinks", "o_bias", "attn_output_gate",
              "step_bidirectional", "attn_out_norm")
        if self.step_bidirectional:  # the MLA stage's mask is causal
            need(not self.is_mla, "step_bidirectional", "false for an MLA model")
        if self.attn_output_gate:  # the MLA stage's output has no gate
            need(not self.is_mla, "attn_output_gate", "false for an MLA model")
        need(is_int(self.head_width) and 0 <= self.head_width <= self.head_dim and self.head_width % 2 == 0,
             "head_width", f"an even integer in [0, head_dim = {self.head_dim}] (0: head_dim)")
        need(is_number(self.attn_scalar) and 0 <= self.attn_scalar < math.inf, "attn_scalar",
             "a non-negative finite number (0: the head width)")
        need(is_number(self.attn_softcap) and 0 <= self.attn_softcap < math.inf, "attn_softcap",
             "a non-negative finite number (0: no soft-capping)")
        if self.qk_norm_whole:
            need(self.qk_norm and not self.is_mla, "qk_norm_whole", "false without qk_norm or for an MLA model")
        if self.attn_softcap:  # the MLA stage's scores are not capped
            need(not self.is_mla, "attn_softcap", "0 for an MLA model")
        if self.attn_sinks:  # the MLA stage's softmax has no sink
            need(not self.is_mla, "attn_sinks", "false for an MLA model")
        if not self.is_mla:
            for f in MLA_FIELDS + ("index_topk",):
                need(getattr(self, f) == 0, f, "0 for a GQA model (kv_lora_rank = 0)")
            self._check_indexer(need)
            return
        need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             "a positive even number for an MLA model (RoPE rotates pairs)")
        need(self.qk_nope_head_dim > 0, "qk_nope_head_dim", "a positive integer for an MLA model")
        need(self.v_head_dim > 0, "v_head_dim", "a positive integer for an MLA model")
        need(self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim, "head_dim",
             f"qk_nope_head_dim + qk_rope_head_dim ({self.qk_nope_head_dim + self.qk_rope_head_dim}) for an MLA model")
        need(self.num_kv_heads == self.num_q_heads, "num_kv_heads",
             f"num_q_heads ({self.num_q_heads}) for an MLA model (every head reads the shared latent)")
        need(not self.qk_norm, "qk_norm", "false for an MLA model (it normalizes the latents instead)")
        need(not self.qkv_bias, "qkv_bias", "false for an MLA model (its projections have no biases)")
        need(not self.o_bias, "o_bias", "false for an MLA model (its projections have no biases)")
        self._check_indexer(need)

    def _check_indexer(self, need: Need) -> None:
        _bool(need, self, "index_rope_interleave")
        if not self.is_sparse:
            for f in ("index_heads", "index_head_dim"):
                need(getattr(self, f) == 0, f, "0 without sparse attention (index_topk = 0)")
            need(not self.index_rope_interleave, "index_rope_interleave", "false without sparse attention (index_topk = 0)")
            return
        need(self.q_lora_rank > 0 or self.index_q_hidden, "q_lora_rank", "a positive integer with sparse attention "
             "(the indexer's queries project the q-LoRA latent) unless index_q_hidden")
        need(self.index_heads > 0, "index_heads", "a positive integer with sparse attention (index_topk > 0)")
        need(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim",
             f"at least qk_rope_head_dim ({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim lanes")


# The MLA / DeepSeek-V3 fields (tpumk.model.mla): a config that sets none of them is GQA.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class Positions:
    """RoPE: theta (and the sliding layers' own, Gemma 3), which lanes turn, and the scaling
    (linear, llama3, longrope, or YaRN through the yarn_* fields); and llama-4's factor on the
    queries by position (query_scale_*, tpumk.model.rope.query_scale)."""
    rope_theta: float
    rope_local_theta: float  # the sliding-window layers' theta; 0: rope_theta everywhere
    rotary_dim: int  # lanes RoPE turns per head (partial rotary); 0: the whole head
    rope_scaling: str
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_position: int
    rope_short_factor: tuple[float, ...]
    rope_long_factor: tuple[float, ...]
    rope_attention_factor: float
    yarn_factor: float
    yarn_original_max_position: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_mscale: float
    yarn_mscale_all_dim: float
    yarn_attention_factor: float
    yarn_truncate: bool
    rope_learned_freqs: bool  # Mistral Large 4: each frequency x exp(rope_alpha[j]), learned
    query_scale_beta: float  # llama-4 position-scaled queries (ModelConfig); 0: none
    query_scale_interval: int  # positions per step of that scale's logarithm
    head_dim: int  # a head's lanes (padding included): the frequency table's length
    head_lanes: int  # derived: the true head width (Attention.true_head_dim)
    mla: bool  # derived: MLA turns qk_rope_head_dim lanes of its own

    @property
    def rotary_width(self) -> int:
        """Lanes of each head RoPE turns: rotary_dim, or the whole (true) head."""
        return self.rotary_dim or self.head_lanes

    def check(self, need: Need, has_window: bool) -> None:
        need(is_number(self.rope_theta) and 0 < self.rope_theta < math.inf, "rope_theta", "a positive finite number")
        need(isinstance(self.rope_scaling, str) and self.rope_scaling in ROPE_SCALINGS, "rope_scaling",
             f"one of {', '.join(ROPE_SCALINGS)}")
        need(is_number(self.rope_factor) and self.rope_factor >= 1, "rope_factor", "a finite number of at least 1")
        need(is_number(self.rope_low_freq_factor) and self.rope_low_freq_factor > 0, "rope_low_freq_factor",
             "a positive finite number")
        need(is_number(self.rope_high_freq_factor) and self.rope_high_freq_factor > self.rope_low_freq_factor,
             "rope_high_freq_factor", f"a finite number above rope_low_freq_factor ({self.rope_low_freq_factor})")
        if self.mla:
            need(self.rope_scaling == "none", "rope_scaling", "none for an MLA model (its RoPE scaling is YaRN)")
        if self.yarn_factor:
            need(self.rope_scaling == "none", "rope_scaling", "none with yarn_factor set (one RoPE scaling)")
        need(is_number(self.rope_attention_factor) and self.rope_attention_factor >= 0, "rope_attention_factor",
             "a finite number of at least 0 (0: derived)")
        need(is_int(self.rotary_dim) and 0 <= self.rotary_dim <= self.head_lanes and self.rotary_dim % 2 == 0,
             "rotary_dim", f"an even integer in [0, the head width {self.head_lanes}] (0: the whole head)")
        pairs = self.rotary_width // 2 if not self.mla else 0
        for f in ("rope_short_factor", "rope_long_factor"):
            v = getattr(self, f)
            if self.rope_scaling == "longrope":
                need(isinstance(v, tuple) and len(v) == pairs and all(is_number(x) and x > 0 for x in v), f,
                     f"{pairs} positive finite numbers (one per rotary frequency) for longrope")
            else:
                need(v == (), f, "empty unless rope_scaling is longrope")
        if self.rotary_dim:
            need(not self.mla, "rotary_dim", "0 for an MLA model (qk_rope_head_dim says which lanes turn)")
        need(is_number(self.rope_local_theta) and 0 <= self.rope_local_theta < math.inf, "rope_local_theta",
             "a non-negative finite number (0: rope_theta on every layer)")
        if self.rope_local_theta:
            need(has_window and not self.mla, "rope_local_theta",
                 "0 without sliding-window layers (it is their RoPE theta) or for an MLA model")
        _bool(need, self, "yarn_truncate")
        for f in ("yarn_factor", "yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor"):
            need(is_number(getattr(self, f)) and getattr(self, f) >= 0, f, "a non-negative finite number")
        for f in ("yarn_beta_fast", "yarn_beta_slow"):
            need(is_number(getattr(self, f)) and getattr(self, f) > 0, f, "a positive finite number")
        if self.yarn_factor:
            need(self.yarn_factor >= 1, "yarn_factor", "at least 1 (or 0: plain RoPE)")
            need(self.yarn_original_max_position > 0, "yarn_original_max_position",
                 "a positive integer when yarn_factor is set")
        _bool(need, self, "rope_learned_freqs")
        need(is_number(self.query_scale_beta), "query_scale_beta", "a finite number (0: unscaled queries)")
        if self.query_scale_beta:
            need(is_int(self.query_scale_interval) and 0 < self.query_scale_interval <= 1 << 30,
                 "query_scale_interval", "a positive integer at most 1,073,741,824 when query_scale_beta is set")
        else:
            need(self.query_scale_interval == 0, "query_scale_interval", "0 when query_scale_beta is 0")


@dataclass(frozen=True)
class Norms:
    """The residual stream's norms: kind (RMSNorm or bias-free LayerNorm), where they sit (before
    each sublayer, after it, or both) and whether attention and the MLP share one (parallel blocks)."""
    norm_kind: str
    rms_eps: float
    rms_width: int  # lanes the norm averages over in a lane-padded copy; 0: hidden_size
    hidden_size: int
    pre_norms: bool
    post_norms: bool  # Gemma 2/3 sandwich, OLMo 2: each sublayer's output normalized
    parallel_blocks: bool  # Cohere: the MLP reads attention's normed input; no mlp_norm
    latent_norm_eps: float  # MLA's latent norms' epsilon; 0: rms_eps
    post_norm_eps: float  # the post-sublayer norms' epsilon (Muse Spark's 1e-8); 0: rms_eps
    residual_gates: bool  # Muse Spark: x <- alpha * x + beta * y per channel (tpumk.model.spark)

    @property
    def post_eps(self) -> float:
        """The epsilon of the norms after each sublayer (and of Muse Spark's expert outputs)."""
        return self.post_norm_eps or self.rms_eps

    @property
    def latent_eps(self) -> float:
        """The epsilon of MLA's q_a_norm and kv_a_norm."""
        return self.latent_norm_eps or self.rms_eps

    @property
    def width(self) -> int:
        """The width the norm over the residual divides by: the model's true hidden size."""
        return self.rms_width or self.hidden_size

    def per_layer(self) -> int:
        """Norm weight vectors one layer holds on the residual (attn / mlp, post_attn / post_mlp)."""
        return (1 if self.parallel_blocks else 2) * self.pre_norms + 2 * self.post_norms + 4 * self.residual_gates

    def check(self, need: Need) -> None:
        need(is_number(self.rms_eps) and 0 < self.rms_eps < 1, "rms_eps", "a number in (0, 1)")
        need(is_number(self.latent_norm_eps) and 0 <= self.latent_norm_eps < 1, "latent_norm_eps",
             "a number in [0, 1) (0: rms_eps)")
        need(is_number(self.post_norm_eps) and 0 <= self.post_norm_eps < 1, "post_norm_eps",
             "a number in [0, 1) (0: rms_eps)")
        _bool(need, self, "residual_gates")
        need(is_int(self.rms_width) and 0 <= self.rms_width <= self.hidden_size, "rms_width",
             f"an integer in [0, hidden_size = {self.hidden_size}] (0: hidden_size)")
        _bool(need, self, "post_norms", "pre_norms")
        if not self.pre_norms:  # a layer keeps its norms after the sublayers
            need(self.post_norms, "pre_norms", "true unless post_norms is true (a layer needs one of them)")
        need(self.norm_kind in NORM_KINDS, "norm_kind", f"one of {', '.join(NORM_KINDS)}")
        _bool(need, self, "parallel_blocks")
        if self.parallel_blocks:  # the kernel's MLP reads attention's normed input, kept in VMEM
            need(self.pre_norms and not self.post_norms, "parallel_blocks", "false with post_norms or without pre_norms")


@dataclass(frozen=True)
class Mlp:
    """The dense layers' gated MLP: act(x @ w_gate) * (x @ w_up) @ w_down."""
    ffn_size: int
    mlp_act: str

    def param_count(self, hidden: int) -> int:
        return 3 * hidden * self.ffn_size

    def tensor_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        h, f = hidden, self.ffn_size
        return {"w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)}

    def check(self, need: Need, has_dense_layers: bool) -> None:
        if has_dense_layers:
            need(self.ffn_size > 0, "ffn_size", "a positive integer (the model has dense layers)")
        need(isinstance(self.mlp_act, str) and self.mlp_act in MLP_ACTS, "mlp_act", f"one of {', '.join(MLP_ACTS)}")


@dataclass(frozen=True)
class Moe:
    """Routed experts (num_experts = 0: a dense model), the router's scoring and DeepSeek-V3's
    group-limited routing, shared experts (optionally gated per token, Qwen2-MoE)."""
    num_experts: int
    top_k: int
    expert_ffn_size: int
    router_scoring: str
    norm_topk_prob: bool
    num_shared_experts: int
    shared_expert_ffn_size: int
    shared_expert_gate: bool
    router_groups: int
    router_topk_groups: int
    router_correction_bias: bool
    routed_scaling_factor: float
    router_logit_bias: bool  # gpt-oss: a learned bias on the router's logits
    expert_bias: bool  # gpt-oss: biases on each routed expert's gate, up and down outputs
    swiglu_limit: float  # gpt-oss's clamped SwiGLU (ModelConfig); 0: plain SwiGLU
    swiglu_alpha: float
    moe_hidden_size: int  # Muse Spark: the experts' width between moe_in and moe_out; 0: hidden
    expert_post_norm: bool  # Muse Spark: each expert's output RMS-normalised before its weight
    router_float32: bool  # Mistral Large 4: a float32 router (weights and product)

    def __bool__(self) -> bool:
        return self.num_experts > 0

    def width(self, hidden: int) -> int:
        """The width the routed experts read and write: moe_hidden_size, or the hidden size."""
        return self.moe_hidden_size or hidden

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.router_groups

    def param_counts(self, hidden: int) -> dict[str, int]:
        """One MoE layer's parameters outside attention: read every step, and per routed expert."""
        shared = self.num_shared_experts * 3 * hidden * self.shared_expert_ffn_size
        m = self.width(hidden)
        projections = (2 * hidden + 1) * m if self.moe_hidden_size else 0  # moe_in, moe_in_norm, moe_out
        return {"always": hidden * (self.num_experts + self.shared_expert_gate) + shared + projections
                          + self.num_experts * (self.router_correction_bias + self.router_logit_bias),
                "per_expert": 3 * m * self.expert_ffn_size
                              + (2 * self.expert_ffn_size + hidden if self.expert_bias else 0)}

    def tensor_shapes(self, hidden: int) -> dict[str, tuple[int, ...]]:
        """A routed layer's tensors: router (and its correction bias), experts, shared experts."""
        h, e, f, m = hidden, self.num_experts, self.expert_ffn_size, self.width(hidden)
        out: dict[str, tuple[int, ...]] = {"router": (h, e)}
        if self.moe_hidden_size:  # Muse Spark: the experts between a down- and an up-projection
            out.update(moe_in=(h, m), moe_in_norm=(m,), moe_out=(m, h))
        out.update(e_gate=(e, m, f), e_up=(e, m, f), e_down=(e, f, m))
        if self.router_correction_bias:
            out.update(router_bias=(e,))
        if self.router_logit_bias:
            out.update(router_logit_bias=(e,))
        if self.expert_bias:
            out.update(e_gate_bias=(e, f), e_up_bias=(e, f), e_down_bias=(e, h))
        if self.num_shared_experts:
            s = self.num_shared_experts * self.shared_expert_ffn_size
            out.update(s_gate=(h, s), s_up=(h, s), s_down=(s, h))
            if self.shared_expert_gate:  # Qwen2-MoE: sigmoid(x @ shared_router) scales the shared output
                out.update(shared_router=(h, 1))
        return out

    def check(self, need: Need, num_layers: int, dense_layers: tuple[int, ...]) -> None:
        _bool(need, self, "norm_topk_prob", "router_correction_bias")
        need(isinstance(self.router_scoring, str) and self.router_scoring in SCORINGS, "router_scoring",
             f"one of {', '.join(SCORINGS)}")
        if self:
            need(self.top_k >= 1, "top_k", "at least 1 for a mixture-of-experts model")
            need(self.top_k <= self.num_experts, "top_k", f"at most num_experts ({self.num_experts})")
            need(self.expert_ffn_size > 0, "expert_ffn_size", "a positive integer for a mixture-of-experts model")
            need(all(0 <= i < num_layers for i in dense_layers), "dense_layers", f"layer indices in [0, {num_layers})")
            if self.num_shared_experts:
                need(self.shared_expert_ffn_size > 0, "shared_expert_ffn_size",
                     "a positive integer when num_shared_experts > 0")
        else:
            need(self.top_k == 0, "top_k", "0 for a dense model (num_experts = 0)")
            need(self.num_shared_experts == 0, "num_shared_experts", "0 for a dense model (num_experts = 0)")
            need(not dense_layers, "dense_layers", "empty for a dense model (every layer is dense)")
        _bool(need, self, "shared_expert_gate")
        if self.shared_expert_gate:  # the gate shares the router's one DMA and dtype (not DeepSeek's float32 router)
            need(bool(self) and self.num_shared_experts > 0 and not self.router_correction_bias, "shared_expert_gate",
                 "false without shared experts or with router_correction_bias")
        need(is_number(self.routed_scaling_factor) and self.routed_scaling_factor > 0, "routed_scaling_factor",
             "a positive finite number")
        _bool(need, self, "router_logit_bias", "expert_bias", "expert_post_norm")
        spark = [f for f, default in (("moe_hidden_size", 0), ("expert_post_norm", False))
                 if getattr(self, f) != default]
        if spark:
            need(bool(self), spark[0], "its default for a dense model (num_experts = 0)")
            need(not self.num_shared_experts and not self.expert_bias, spark[0],
                 "its default with shared experts or expert biases (Muse Spark's MoE has neither)")
        need(is_number(self.swiglu_limit) and 0 <= self.swiglu_limit < math.inf, "swiglu_limit",
             "a non-negative finite number (0: plain SwiGLU)")
        need(is_number(self.swiglu_alpha) and 0 < self.swiglu_alpha < math.inf, "swiglu_alpha",
             "a positive finite number")
        gpt_oss = [f for f, default in (("router_logit_bias", False), ("expert_bias", False), ("swiglu_limit", 0.0))
                   if getattr(self, f) != default]
        if gpt_oss:
            need(bool(self), gpt_oss[0], "its default for a dense model (num_experts = 0)")
        if self.swiglu_alpha != 1.0:
            need(self.swiglu_limit > 0, "swiglu_alpha", "1 without swiglu_limit (plain SwiGLU has no alpha)")
        if self.router_logit_bias:  # one bias row in the router's DMA: the float32 router's is DeepSeek's
            need(not self.router_correction_bias, "router_logit_bias", "false with router_correction_bias")
        set_fields = [f for f, default in (("router_groups", 1), ("router_topk_groups", 1),
                                           ("router_correction_bias", False), ("routed_scaling_factor", 1.0))
                      if getattr(self, f) != default]
        if set_fields:  # DeepSeek-V3 routing
            need(bool(self), set_fields[0], "its default for a dense model (num_experts = 0)")
            g = self.router_groups
            need(self.num_experts % g == 0, "router_groups", f"a divisor of num_experts ({self.num_experts})")
            need(g == 1 or self.num_experts // g >= 2, "router_groups",
                 "at most num_experts / 2 (a group is scored by its two best experts)")
            need(self.router_topk_groups <= g, "router_topk_groups", f"at most router_groups ({g})")
            need(self.top_k <= self.router_topk_groups * (self.num_experts // g), "top_k",
                 "at most router_topk_groups x experts per group (the experts the kept groups hold)")


@dataclass(frozen=True)
class LinearAttention:
    """The linear-attention layers of a hybrid model (`linear_layers`; the others are softmax
    attention): per value head a recurrent state [key_dim, value_dim] updated by the gated delta
    rule, fed by a depthwise causal convolution of `linear_conv` taps over q | k | v. Gated
    DeltaNet groups value heads over key heads; KDA has as many of each, of one width."""
    linear_kind: str
    linear_layers: tuple[int, ...]
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    linear_conv: int
    hidden_size: int  # derived

    def __bool__(self) -> bool:
        return self.linear_kind != "none"

    @property
    def key_size(self) -> int:
        return self.linear_key_heads * self.linear_key_dim

    @property
    def value_size(self) -> int:
        return self.linear_value_heads * self.linear_value_dim

    @property
    def conv_dim(self) -> int:
        """Channels the short convolution runs over: q | k | v."""
        return 2 * self.key_size + self.value_size

    @property
    def group(self) -> int:
        """Value heads per key head (each key head's q and k serve `group` consecutive value heads)."""
        return self.linear_value_heads // self.linear_key_heads

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One layer's recurrent state of one sequence: [value heads, key_dim, value_dim]."""
        return (self.linear_value_heads, self.linear_key_dim, self.linear_value_dim)

    @property
    def decay_width(self) -> int:
        """Decays per token: one per value head (Gated DeltaNet) or per key channel (KDA)."""
        return self.linear_value_heads * (self.linear_key_dim if self.linear_kind == "kda" else 1)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """A linear layer's tensors in the reference layout ([in, out]; tpumk.model.linear_attention)."""
        h, hv, dk = self.hidden_size, self.linear_value_heads, self.linear_key_dim
        out: dict[str, tuple[int, ...]] = {"lin_qkv": (h, self.conv_dim), "lin_conv": (self.linear_conv, self.conv_dim)}
        if self.linear_kind == "gated_delta":
            out.update(lin_z=(h, self.value_size), lin_b=(h, hv), lin_a=(h, hv), lin_A_log=(hv,), lin_dt_bias=(hv,))
        else:
            out.update(lin_f_a=(h, dk), lin_f_b=(dk, self.value_size), lin_b=(h, hv), lin_A_log=(hv,),
                       lin_dt_bias=(self.value_size,), lin_g_a=(h, dk), lin_g_b=(dk, self.value_size))
        out.update(lin_norm=(self.linear_value_dim,), lin_out=(self.value_size, h))
        return out

    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def check(self, need: Need, num_layers: int) -> None:
        need(isinstance(self.linear_kind, str) and self.linear_kind in LINEAR_KINDS, "linear_kind",
             f"one of {', '.join(LINEAR_KINDS)}")
        need(isinstance(self.linear_layers, tuple) and all(is_int(i) for i in self.linear_layers), "linear_layers",
             "a list of layer indices")
        sizes = ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv")
        for f in sizes:
            need(is_int(getattr(self, f)) and 0 <= getattr(self, f) <= 4096, f, "a non-negative integer at most 4,096")
        if not self:
            for f in sizes:
                need(getattr(self, f) == 0, f, "0 without linear-attention layers (linear_kind none)")
            need(not self.linear_layers, "linear_layers", "empty without linear-attention layers (linear_kind none)")
            return
        need(bool(self.linear_layers) and all(0 <= i < num_layers for i in self.linear_layers), "linear_layers",
             f"at least one layer index in [0, {num_layers})")
        for f in sizes[:4]:
            need(getattr(self, f) > 0, f, f"a positive integer with linear_kind {self.linear_kind}")
        need(self.linear_value_heads % self.linear_key_heads == 0, "linear_value_heads",
             f"a multiple of linear_key_heads ({self.linear_key_heads})")
        if self.linear_kind == "kda":  # one head count and width for q, k and v
            need(self.linear_value_heads == self.linear_key_heads, "linear_value_heads",
                 f"linear_key_heads ({self.linear_key_heads}) for kda")
            need(self.linear_value_dim == self.linear_key_dim, "linear_value_dim",
                 f"linear_key_dim ({self.linear_key_dim}) for kda")
        need(2 <= self.linear_conv <= 8, "linear_conv", "a convolution width from 2 to 8 taps")



@dataclass(frozen=True)
class LayerPattern:
    """Which layer is what: dense or MoE (`dense_layers` of a MoE model), linear or softmax
    attention (`linear_layers` of a hybrid model), full or sliding-window attention
    (`sliding_layers` see `sliding_window` keys back), with or without RoPE (`nope_layers`)."""
    num_layers: int
    dense_layers: tuple[int, ...]
    sliding_window: int
    sliding_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    nope_layers: tuple[int, ...]
    index_shared_layers: tuple[int, ...]  # sparse attention: layers reusing the previous layer's selection
    kv_source_layers: tuple[int, ...]  # MLA: per layer the layer whose latent rows it reads; empty: its own
    moe: bool  # derived: the model has routed experts

    def kv_source(self, i: int) -> int:
        """The layer whose latent cache rows layer i attends to (i itself unless it reads another's)."""
        return self.kv_source_layers[i] if self.kv_source_layers else i

    def owns_kv(self, i: int) -> bool:
        """Layer i writes latent rows of its own (it has a kv_a projection)."""
        return self.kv_source(i) == i

    @property
    def num_dense(self) -> int:
        return len(self.dense_layers) if self.moe else self.num_layers

    def is_linear(self, i: int) -> bool:
        return i in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The softmax-attention layers, in order: the KV cache holds one layer per entry."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    def kv_index(self, i: int) -> int:
        """Attention layer i's layer in the KV cache (its rank among the attention layers)."""
        return i - sum(1 for j in self.linear_layers if j < i)

    def linear_index(self, i: int) -> int:
        """Linear layer i's layer in the state pool (its rank among the linear layers)."""
        return sum(1 for j in self.linear_layers if j < i)

    def rotates(self, i: int) -> bool:
        """Whether attention layer i applies RoPE (a NoPE layer leaves q and k unrotated)."""
        return i not in self.nope_layers

    def is_dense(self, i: int) -> bool:
        return (not self.moe) or i in self.dense_layers

    def window(self, i: int) -> int:
        """Layer i's attention window (a query at p sees keys k with p - k < window), 0 = full."""
        return self.sliding_window if i in self.sliding_layers else 0

    def shares_selection(self, i: int) -> bool:
        """Sparse attention: layer i reuses the previous layer's top-k selection (no indexer of its own)."""
        return i in self.index_shared_layers

    def first_moe_layer(self) -> int:
        """The first routed layer (closed form: among the first num_dense + 1 layers one is routed)."""
        return next(i for i in range(self.num_dense + 1) if not self.is_dense(i))

    def check(self, need: Need) -> None:
        need(isinstance(self.nope_layers, tuple) and all(is_int(i) and 0 <= i < self.num_layers
                                                         for i in self.nope_layers),
             "nope_layers", f"a list of layer indices in [0, {self.num_layers})")
        need(isinstance(self.index_shared_layers, tuple) and all(is_int(i) and 0 < i < self.num_layers
                                                                 for i in self.index_shared_layers),
             "index_shared_layers", f"a list of layer indices in [1, {self.num_layers}) (layer 0 has no previous "
             "selection to reuse)")
        need(not set(self.nope_layers) & set(self.linear_layers), "nope_layers",
             "softmax-attention layers only (a linear layer has no RoPE)")
        need(len(self.linear_layers) < self.num_layers, "linear_layers",
             "fewer entries than layers (at least one softmax-attention layer)")
        need(not set(self.sliding_layers) & set(self.linear_layers), "sliding_layers",
             "softmax-attention layers only (a linear layer has no window)")
        need(isinstance(self.sliding_layers, tuple) and all(is_int(i) for i in self.sliding_layers),
             "sliding_layers", "a list of layer indices")
        need(all(0 <= i < self.num_layers for i in self.sliding_layers), "sliding_layers",
             f"layer indices in [0, {self.num_layers})")
        if self.sliding_window:
            need(bool(self.sliding_layers), "sliding_layers", "at least one layer index when sliding_window > 0")
        else:
            need(not self.sliding_layers, "sliding_layers", "empty when sliding_window = 0 (no window)")


@dataclass(frozen=True)
class Head:
    """The ends of the model: embedding (with its scale, Gemma's sqrt(hidden)), the final norm's
    lm_head (tied or its own) and the logits' soft-cap (Gemma 2)."""
    vocab_size: int
    hidden_size: int
    tie_embeddings: bool
    embed_scale: float
    final_softcap: float
    embed_norm: bool  # Muse Spark: the embedding rows RMS-normalised without a weight

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        h, v = self.hidden_size, self.vocab_size
        out: dict[str, tuple[int, ...]] = {"embed": (v, h), "final_norm": (h,)}
        if not self.tie_embeddings:
            out["lm_head"] = (h, v)
        return out

    def check(self, need: Need) -> None:
        _bool(need, self, "tie_embeddings", "embed_norm")
        need(is_number(self.embed_scale) and 0 < self.embed_scale < math.inf, "embed_scale",
             "a positive finite number")
        need(is_number(self.final_softcap) and 0 <= self.final_softcap < math.inf, "final_softcap",
             "a non-negative finite number (0: no soft-capping)")
