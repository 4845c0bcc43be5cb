"""Attention variants and dense and MoE families from Hugging Face checkpoints built with
transformers' own modelling code: Qwen3 and Qwen3-MoE with 64-wide heads, a Qwen3 with a
sliding-window layer whose window is shorter than the prompts, a Llama with Llama 3 RoPE scaling
(no QK-norm, 64-wide heads, 4 query heads per KV head), a Mistral whose every layer has a window,
a Phi-3 (fused qkv_proj and gate_up_proj tensors, a window on every layer, 96-wide heads, RoPE on
part of each head), a Phi-4-mini-shaped Phi-3 with LongRoPE, a Qwen3 with YaRN RoPE and a SmolLM2-shaped Llama whose widths are off the 128-lane grid (the plan
pads them), a Qwen2 with q / k / v biases and a Gemma (GeGLU, (1 + w) norms, scaled embeddings,
widths off the lane grid), a Gemma 2 (soft-capped scores and logits, sandwich norms), a Gemma 3,
an OLMo 2 (norms only after the sublayers, QK-norm across all heads), a Cohere (LayerNorm,
parallel attention and MLP, interleaved RoPE, logit scale), a Mixtral, an OLMoE, a GLM-4.5 and a
Qwen2-MoE (their routing, shared experts and gate, QK-norm, biases and partial rotary kept). Each generates the same greedy tokens
through transformers, the reference and the megakernel (interpret mode), and its megakernel
compiles deviceless for TPU7x (the MoE families also for v6e).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hf_utils import build_checkpoint, hf_greedy, hf_logits

from test_megakernel import compile_for_tpus
from tpumk.decode.generate import generate, load_model
from tpumk.model.reference import forward_full
from tpumk.plan.knobs import TuningConfig

D64 = dict(head_dim=64, num_attention_heads=8, num_key_value_heads=4)  # q 8 x 64, kv 4 x 64: two lane blocks
# Layer 0 full, layer 1 sliding (max_window_layers = 1) with a 6-token window.
SLIDING = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)
PROMPTS = [[3, 141, 59, 26, 5, 300, 17, 222, 41, 9, 99], [250, 1, 64, 7, 480, 2, 77, 31]]  # longer than 6
STEPS = 10

# Llama 3's RoPE scaling with an original context of 16 tokens, so the prompts and the 24-token
# logits run through the scaled, the kept and the blended frequency bands.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
# YaRN on a GQA model (Qwen3 / Qwen2.5 long-context configs): factor 4 over an original context
# of 16, so the interpolated, extrapolated and ramp bands all turn, and cos / sin x 1.139.
QWEN3_YARN = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16)
# LongRoPE as Phi-4-mini writes it: one short and one long factor per rotary frequency (36 for 72
# rotary lanes of 96), original context 4096 of 131072 (cos / sin x 1.190 on the rotary lanes
# only). Short factors: the build's context stays within 4096 (tpumk.plan.spec).
_factors = np.random.default_rng(31).random((2, 36))
PHI4_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=4096,
                     short_factor=[float(x) for x in 1 + 2 * _factors[0]],
                     long_factor=[float(x) for x in 1 + 4 * _factors[1]])
# gpt-oss's YaRN in small: factor 4 over 16 tokens, beta 32 / 1, the ramp's ends not rounded
GPT_OSS_YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=16)
CHECKPOINTS = {
    "qwen3-d64": dict(seed=3, **D64),
    "qwen3-yarn": dict(seed=27, rope_parameters=QWEN3_YARN),
    # Phi-4-mini's RoPE in small: 2 heads of 96, RoPE on 72 lanes, LongRoPE, no window
    "phi4-longrope": dict(arch="phi3", seed=28, hidden_size=192, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=96, intermediate_size=200, partial_rotary_factor=0.75, sliding_window=None,
                          max_position_embeddings=131072, original_max_position_embeddings=4096,
                          rope_parameters=PHI4_LONGROPE),
    "qwen3-moe-d64": dict(moe=True, seed=4, **D64),
    "qwen3-sliding": dict(seed=5, **SLIDING),
    "llama-llama3-d64": dict(arch="llama", seed=6, head_dim=64, num_attention_heads=8, num_key_value_heads=2,
                             rope_parameters=LLAMA3_ROPE),
    "mistral-sliding": dict(arch="mistral", seed=8, sliding_window=6),
    # Phi-3: q, k, v in one qkv_proj tensor and gate, up in one gate_up_proj; a window on every layer
    # Phi-3's own head width: 2 heads of 96 (run 128 wide), hidden 192, FFN 200; RoPE on 72 of the
    # 96 lanes (Phi-4-mini's partial_rotary_factor 0.75: q / k rows permuted on load)
    "phi3-partial": dict(arch="phi3", seed=10, sliding_window=6, hidden_size=192, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=96, intermediate_size=200, partial_rotary_factor=0.75),
    # SmolLM2's shape in small (a Llama with tied embeddings): hidden 192, FFN 200, vocab 500
    # and one 64-wide KV head for 3 query heads, none on the 128-lane grid (the plan pads them)
    "smollm2-lanes": dict(arch="llama", seed=12, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                          head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=True,
                          rope_theta=100000.0),
    # Qwen2.5's q / k / v biases (o has none), hidden 160 off the lane grid, tied embeddings
    # Granite's four scalars (folded into the weights on load), tied embeddings, hidden 192
    "granite-scalars": dict(arch="granite", seed=14, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=True,
                            embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.05,
                            logits_scaling=4.0, attention_bias=True),  # q's bias folds as wq, o's as wo
    # Gemma: GeGLU (tanh GELU), RMSNorm scaling by (1 + w) (folded on load), embeddings x
    # sqrt(hidden), tied embeddings; widths off the lane grid (hidden 192, FFN 200, 64-wide heads)
    "gemma-geglu": dict(arch="gemma", seed=15, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                        head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=True),
    # Gemma 3: Gemma's parts plus per-head QK-norm, post-sublayer norms, scores / sqrt(48)
    # (query_pre_attn_scalar), layer 0 sliding a 6-token window with its own RoPE theta (1e4),
    # layer 1 full with theta 1e6 and a linear RoPE scaling (factor 2). Untied, as gemma2-softcap
    # (tied, it mostly repeats the last token: a weak greedy check; gemma-geglu is tied)
    "gemma3-sandwich": dict(arch="gemma3", seed=16, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=False,
                            sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                            query_pre_attn_scalar=48,
                            rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                             "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
    # Gemma 2: Gemma's parts plus post-sublayer norms, scores / sqrt(48) soft-capped at 3, logits
    # soft-capped at 5, layer 0 sliding a 6-token window (transformers' default pattern: the even
    # layers). Untied: with a tied head these tiny random Gemmas mostly repeat the last token.
    "gemma2-softcap": dict(arch="gemma2", seed=17, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                           head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=False,
                           sliding_window=6, query_pre_attn_scalar=48, attn_logit_softcapping=3.0,
                           final_logit_softcapping=5.0),
    # OLMo 2: no norm before the sublayers, one after each; q and k normalized across all heads
    # (a 192-wide norm over 2 heads of 96, run 128 wide); hidden 192, FFN 200, untied
    "olmo2-postnorm": dict(arch="olmo2", seed=18, hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=96, intermediate_size=200, vocab_size=500, rope_theta=500000.0),
    # Cohere (Command-R): LayerNorm without bias, attention and the MLP in parallel on one normed
    # input, RoPE on interleaved pairs (rows permuted on load), logits x 0.25 (folded into the
    # final norm); hidden 192, 3 query / 1 KV heads of 64, untied (tied, a tiny random model
    # mostly repeats its last token)
    "cohere-parallel": dict(arch="cohere", seed=20, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=False, logit_scale=0.25,
                            attention_bias=True),  # q / k biases permuted as the interleaved rows
    # attention_bias: biases on q, k, v and o (Llama's modelling; Gemma, OLMo 2, Qwen3 the same),
    # on widths off the lane grid (the padded copy's o bias is zero past the true 192 lanes)
    "llama-attnbias": dict(arch="llama", seed=29, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                           head_dim=64, intermediate_size=200, vocab_size=500, attention_bias=True),
    "qwen2-bias": dict(arch="qwen2", seed=13, hidden_size=160, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=200, vocab_size=500, tie_word_embeddings=True),
    # Mixtral: every layer's MLP is 4 routed experts of width 256 (an expert width off the lane
    # grid is refused by the plan), 2 per token (softmax over all, the top 2 renormalised),
    # Mistral's window (6 tokens) on both layers; hidden 192 (lane padded), 3 query / 1 KV heads
    # of 64; the files' block_sparse_moe names
    "mixtral-moe": dict(arch="mixtral", seed=21, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                        head_dim=64, intermediate_size=256, vocab_size=500, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=6),
    # OLMoE: every layer routed (4 experts of 256, top 2 by softmax over all, NOT renormalised),
    # QK-norm across all heads before RoPE, pre-norms; 4 query / 2 KV heads of 64 (OLMoE's head
    # width is hidden / heads; an odd count of 64-wide KV heads under a whole-projection QK-norm
    # is refused by the plan), vocabulary 500
    "olmoe-moe": dict(arch="olmoe", seed=22, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=256, vocab_size=500, num_experts=4, num_experts_per_tok=2),
    # GLM-4.5: q / k / v biases (attention_bias), RoPE on half of each 64-wide head, layer 0 dense
    # (FFN 200), layer 1 DeepSeek-V3's routing on GQA: sigmoid scores with a non-zero correction
    # bias, 2 of 4 expert groups, top 2 of 8 experts of 256 renormalised then x 2.5, one shared expert
    "glm45-moe": dict(arch="glm4_moe", seed=23, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                      head_dim=64, intermediate_size=200, moe_intermediate_size=256, vocab_size=500, n_routed_experts=8,
                      num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, attention_bias=True),
    # Qwen2-MoE: q / k / v biases, layer 0 dense (mlp_only_layers, FFN 200), layer 1 routed (top 2
    # of 6 experts of 256 by softmax over all, not renormalised) beside one shared expert of
    # width 320 (off the lane grid) whose output is scaled by sigmoid(shared_expert_gate(x))
    "qwen2moe-shared": dict(arch="qwen2_moe", seed=26, hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=64, intermediate_size=200, moe_intermediate_size=256,
                            shared_expert_intermediate_size=320, vocab_size=500, num_experts=6, num_experts_per_tok=2,
                            mlp_only_layers=[0]),
    # gpt-oss: attention sinks, q / k / v / o biases, layer 0 sliding a 6-token window and layer 1
    # full (its default layer_types), YaRN (factor 4 over 16 tokens, untruncated ramp); every layer
    # 4 routed experts of width 200 (off the lane grid: padded with zero columns), the top 2 of
    # the router's biased logits weighed by their softmax, expert biases, the clamped SwiGLU
    # (limit 1 so the clamps bite at these scales); hidden 192 (lane padded), 4 query / 2 KV heads
    # of 64; transformers' tensors (gate / up columns interleaved)
    "gptoss-moe": dict(arch="gpt_oss", seed=29, hidden_size=192, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=200, vocab_size=500, num_local_experts=4, num_experts_per_tok=2,
                       sliding_window=6, swiglu_limit=1.0, max_position_embeddings=256,
                       rope_parameters=GPT_OSS_YARN),
}
# Mistral's kernel runs are the full tier: Phi-3 decodes the same way (window on every layer,
# no QK-norm) and differs only in how its checkpoint stores the projections. So are the Llama 3
# RoPE Llama's: its scaling lives in the RoPE tables (checked against transformers above by the
# reference), and smollm2-lanes runs a Llama through the kernel.
# Granite's too: once its scalars are folded into the weights on load it is a Llama of
# smollm2-lanes' shapes, the same kernel (its logits are checked against transformers above).
# And the two dense Qwen3 variants': qwen3-moe-d64 runs the same 64-wide heads (its layer 0 is
# dense), phi3-partial a checkpoint's window (on every layer) and test_megakernel_archs.py's
# dense-gemma a window on one layer of two; their configs and reference logits stay above.
# And Cohere's: its parts (LayerNorm, parallel blocks) run in test_multidevice.py's
# dense-2dev-cohere against the reference (a TPU7x compile; one device in the full tier:
# test_megakernel_archs.py's dense-cohere); what only its loader does (interleaved q / k rows permuted, logit_scale
# folded) is checked by its reference logits against transformers above.
# And every Gemma's (gemma-geglu, gemma3-sandwich, gemma2-softcap) and OLMo 2's: every kernel part of
# each runs against the reference on 2 / 4 devices in test_multidevice.py (dense-2dev-kv-split:
# GeGLU, embedding factor, post-sublayer norms, both soft-caps, query_pre_attn_scalar, a local
# window and theta; dense-4dev-kv-replicated-verify: post-norms only, QK-norm across all heads;
# TPU7x compiles; one device and v6e in the full tier: test_megakernel_archs.py's dense-gemma and
# dense-olmo2); what
# their loaders do ((1 + w) norms, q_norm / k_norm over the whole projection) is checked by their
# reference logits against transformers above.
# And SmolLM2's: test_gguf.py's tiny GGUF is a Llama of exactly its shapes (hidden 192, 3 query / 1 KV
# heads of 64), run through the megakernel against transformers in the default run.
# And Mixtral's: its routing (softmax over all, the top k renormalised) is Qwen3-MoE's, run by
# qwen3-moe-d64; olmoe-moe routes every layer and glm45-moe and phi3-partial run 64-wide heads
# and a window on every layer; its loader's names and reference logits stay above.
# And the YaRN Qwen3's: its frequencies and cos / sin factor live in the RoPE tables the kernel's
# glue computes (checked against transformers above by the reference); phi4-longrope runs scaled
# tables (on part of each head) through the kernel.
# And the biased-attention Llama's and Qwen2's: q / k / v / o biases run through the kernel in
# gptoss-moe (below) and test_multidevice.py's dense-2dev-kv-split (each device its heads'
# slice); their reference logits against transformers stay above. And two MoE families': GLM-4.5's
# DeepSeek routing on GQA runs in test_megakernel_deepseek_routing.py and its partial-rotary heads
# in phi3-partial; Qwen2-MoE's gated shared expert in test_megakernel_archs.py's moe-d64-g4 and
# its unrenormalised top-k in olmoe-moe (below).
FULL_KERNEL_CASES = ("qwen3-yarn", "mistral-sliding", "llama-llama3-d64", "granite-scalars", "qwen3-d64", "qwen3-sliding",
                     "gemma-geglu", "smollm2-lanes", "gemma3-sandwich", "cohere-parallel", "gemma2-softcap",
                     "olmo2-postnorm", "mixtral-moe", "llama-attnbias", "qwen2-bias", "glm45-moe", "qwen2moe-shared")
KERNEL_CASES = [pytest.param(n, marks=pytest.mark.full) if n in FULL_KERNEL_CASES else n for n in CHECKPOINTS]


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return request.param, build_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])


def test_config_reads_the_variant(checkpoint):
    name, ckpt = checkpoint
    cfg = load_model(None, str(ckpt)).cfg
    assert cfg.qk_norm == name.startswith(("qwen3", "gemma3", "olmo"))
    attention_bias = name.startswith(("llama-attnbias", "granite", "cohere", "gptoss"))  # on q, k, v and o
    assert cfg.qkv_bias == (name.startswith(("qwen2", "glm45")) or attention_bias) and cfg.o_bias == attention_bias
    assert cfg.shared_expert_gate == name.startswith("qwen2moe")
    assert cfg.qk_norm_whole == name.startswith(("olmo2", "olmoe")) and (not cfg.pre_norms) == name.startswith("olmo2")
    assert cfg.rotary_dim == {"phi3-partial": 72, "phi4-longrope": 72, "glm45-moe": 32}.get(name, 0)
    assert (cfg.yarn_factor, cfg.yarn_original_max_position) == \
        ((4.0, 16) if name in ("qwen3-yarn", "gptoss-moe") else (0.0, 0))
    assert cfg.yarn_truncate == (name != "gptoss-moe")
    gpt_oss = (cfg.attn_sinks, cfg.router_logit_bias, cfg.expert_bias, cfg.swiglu_limit, cfg.swiglu_alpha)
    assert gpt_oss == ((True, True, True, 1.0, 1.702) if name == "gptoss-moe" else (False, False, False, 0.0, 1.0))
    if name == "phi4-longrope":
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_position) == ("longrope", 32.0, 4096)
        assert cfg.rope_short_factor == tuple(PHI4_LONGROPE["short_factor"]) and cfg.sliding_window == 0
        assert cfg.rope_long_factor == tuple(PHI4_LONGROPE["long_factor"])
        from tpumk.model.rope import attention_factor
        assert attention_factor(cfg.positions) == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert cfg.post_norms == name.startswith(("gemma2", "gemma3", "olmo2"))
    assert (cfg.attn_scalar != 0) == name.startswith(("gemma2", "gemma3"))
    assert (cfg.rope_local_theta != 0) == name.startswith("gemma3")
    assert (cfg.attn_softcap, cfg.final_softcap) == ((3.0, 5.0) if name.startswith("gemma2") else (0.0, 0.0))
    assert (cfg.mlp_act == "gelu_tanh") == (cfg.embed_scale != 1.0) == name.startswith("gemma")
    assert (cfg.norm_kind == "layer") == cfg.parallel_blocks == name.startswith("cohere")
    if name == "llama-llama3-d64":
        assert (cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (64, 8, 2)
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_position) == ("llama3", 8.0, 16)
        assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_theta) == (1.0, 4.0, 500000.0)
    elif name == "granite-scalars":  # a Llama with the scalars in its weights and its own lm_head
        assert not cfg.tie_embeddings and (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads) == (192, 3, 1)
    elif name == "gemma-geglu":
        assert (cfg.mlp_act, cfg.embed_scale, cfg.tie_embeddings) == ("gelu_tanh", 192 ** 0.5, True)
        assert (cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads, cfg.ffn_size) == (192, 64, 3, 1, 200)
    elif name == "gemma3-sandwich":
        assert (cfg.mlp_act, cfg.embed_scale, cfg.tie_embeddings, cfg.attn_scalar) == ("gelu_tanh", 192 ** 0.5, False, 48)
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.rope_theta, cfg.rope_local_theta) == (6, (0,), 1e6, 1e4)
        assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 2.0)
    elif name == "gemma2-softcap":
        assert (cfg.attn_scalar, cfg.tie_embeddings, cfg.sliding_window, cfg.sliding_layers) == (48, False, 6, (0,))
    elif name == "olmo2-postnorm":
        assert (cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (192, 96, 2, 2)
        assert not cfg.tie_embeddings and cfg.rope_theta == 500000.0
    elif name == "cohere-parallel":
        assert (cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (192, 64, 3, 1)
        assert not cfg.tie_embeddings and cfg.rms_eps == 1e-5 and cfg.sliding_window == 0
    elif name == "qwen2-bias":
        assert cfg.qkv_bias and (cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (160, 64, 4, 2)
    elif name == "smollm2-lanes":
        assert (cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (192, 64, 3, 1)
        assert (cfg.ffn_size, cfg.vocab_size, cfg.tie_embeddings) == (200, 500, True)
    elif name == "mixtral-moe":
        assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.dense_layers, cfg.ffn_size) == (4, 2, 256, (), 0)
        assert cfg.router_scoring == "softmax" and cfg.norm_topk_prob and not cfg.tie_embeddings
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.hidden_size, cfg.num_kv_heads) == (6, (0, 1), 192, 1)
    elif name == "olmoe-moe":
        assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.dense_layers, cfg.ffn_size) == (4, 2, 256, (), 0)
        assert cfg.router_scoring == "softmax" and not cfg.norm_topk_prob and cfg.sliding_window == 0
    elif name == "glm45-moe":
        assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.dense_layers, cfg.ffn_size) == (8, 2, 256, (0,), 200)
        assert (cfg.router_scoring, cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling_factor) == \
            ("sigmoid", 4, 2, 2.5)
        assert cfg.router_correction_bias and cfg.norm_topk_prob and not cfg.qk_norm
        assert (cfg.num_shared_experts, cfg.shared_expert_ffn_size, cfg.head_dim) == (1, 256, 64)
    elif name == "gptoss-moe":
        assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.dense_layers, cfg.ffn_size) == (4, 2, 200, (), 0)
        assert cfg.router_scoring == "softmax" and cfg.norm_topk_prob and not cfg.qk_norm and cfg.rope_theta == 150000
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.head_dim, cfg.num_kv_heads) == (6, (0,), 64, 2)
    elif name == "qwen2moe-shared":
        assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.dense_layers, cfg.ffn_size) == (6, 2, 256, (0,), 200)
        assert (cfg.num_shared_experts, cfg.shared_expert_ffn_size, cfg.router_scoring) == (1, 320, "softmax")
        assert not cfg.norm_topk_prob and not cfg.qk_norm
    elif name.startswith(("mistral", "phi3")):
        assert (cfg.sliding_window, cfg.sliding_layers) == (6, (0, 1))
        heads = (96, 2, 1) if name.startswith("phi3") else (128, 4, 2)
        assert (cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == heads
    elif name.endswith("d64"):
        assert (cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (64, 8, 4)
    elif name in ("qwen3-yarn", "phi4-longrope", "llama-attnbias"):
        assert cfg.sliding_window == 0
    else:
        assert (cfg.sliding_window, cfg.sliding_layers) == (6, (1,))


def test_reference_logits_match_transformers(checkpoint, monkeypatch):
    """Full-sequence logits over a 24-token sequence (4x the window) agree to f32 rounding."""
    import numpy as np

    _, ckpt = checkpoint
    m = load_model(None, str(ckpt))
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 24))
    want = hf_logits(ckpt, tokens)
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    bound = 2e-5 * max(1.0, np.max(np.abs(want)))
    assert np.max(np.abs(got - want)) <= bound
    if m.cfg.rotary_dim and m.cfg.rope_scaling != "longrope":  # RoPE over the whole head would not agree
        # (longrope's factors are one per rotary frequency: phi3-partial checks its rotary lanes)
        whole = np.asarray(forward_full(m.params, m.cfg.replace(rotary_dim=0), tokens))
        assert np.max(np.abs(whole - want)) > 100 * bound
    if m.cfg.is_moe and not m.cfg.norm_topk_prob:  # OLMoE: renormalised top-k weights would not agree
        renorm = np.asarray(forward_full(m.params, m.cfg.replace(norm_topk_prob=True), tokens))
        assert np.max(np.abs(renorm - want)) > 100 * bound
    if m.cfg.expert_bias:  # gpt-oss: without any one of its parts it would not agree
        for part in (dict(attn_sinks=False), dict(router_logit_bias=False), dict(expert_bias=False),
                     dict(swiglu_limit=0.0, swiglu_alpha=1.0), dict(swiglu_limit=1e6)):
            assert np.max(np.abs(np.asarray(forward_full(m.params, m.cfg.replace(**part), tokens)) - want)) > 100 * bound
    if m.cfg.shared_expert_gate:  # Qwen2-MoE: the shared expert ungated would not agree
        ungated = np.asarray(forward_full(m.params, m.cfg.replace(shared_expert_gate=False), tokens))
        assert np.max(np.abs(ungated - want)) > 100 * bound
    if m.cfg.rope_scaling != "none" or m.cfg.yarn_factor:  # the scaling is what makes them agree
        plain = m.cfg.replace(rope_scaling="none", rope_short_factor=(), rope_long_factor=(), yarn_factor=0.0)
        assert np.max(np.abs(np.asarray(forward_full(m.params, plain, tokens)) - want)) > 100 * bound
    if m.cfg.rope_scaling == "longrope" or m.cfg.yarn_factor:  # and so is the factor on cos and sin
        unscaled = m.cfg.replace(rope_attention_factor=1.0, yarn_attention_factor=1.0 if m.cfg.yarn_factor else 0.0)
        assert np.max(np.abs(np.asarray(forward_full(m.params, unscaled, tokens)) - want)) > 100 * bound
    if m.cfg.mlp_act != "silu":  # Gemma: SwiGLU, or unscaled embeddings, would not agree; Gemma 2 or 3 without a part
        parts = [dict(mlp_act="silu"), dict(embed_scale=1.0)]
        if m.cfg.post_norms:
            parts += [dict(post_norms=False), dict(attn_scalar=0.0)]
        if m.cfg.rope_local_theta:
            parts += [dict(rope_local_theta=0.0)]
        if m.cfg.attn_softcap:
            parts += [dict(attn_softcap=0.0), dict(final_softcap=0.0)]
        for other in (m.cfg.replace(**p) for p in parts):
            assert np.max(np.abs(np.asarray(forward_full(m.params, other, tokens)) - want)) > 100 * bound
    if not m.cfg.pre_norms:  # OLMo 2: norms before the sublayers (unit weights), or no QK-norm, would not agree
        ones = {"attn_norm": np.ones(m.cfg.hidden_size, np.float32), "mlp_norm": np.ones(m.cfg.hidden_size, np.float32)}
        normed = {**m.params, "layers": [{**lay, **ones} for lay in m.params["layers"]]}
        assert np.max(np.abs(np.asarray(forward_full(normed, m.cfg.replace(pre_norms=True), tokens)) - want)) > 100 * bound
        plain = m.cfg.replace(qk_norm=False, qk_norm_whole=False)
        assert np.max(np.abs(np.asarray(forward_full(m.params, plain, tokens)) - want)) > 100 * bound
    if m.cfg.parallel_blocks:  # Cohere: RMSNorm, the MLP after attention, or unscaled logits would not agree
        serial = {**m.params, "layers": [{**lay, "mlp_norm": lay["attn_norm"]} for lay in m.params["layers"]]}
        unscaled = {**m.params, "final_norm": np.asarray(m.params["final_norm"]) * 4.0}
        for cfg, params in ((m.cfg.replace(norm_kind="rms"), m.params), (m.cfg.replace(parallel_blocks=False), serial),
                            (m.cfg, unscaled)):
            assert np.max(np.abs(np.asarray(forward_full(params, cfg, tokens)) - want)) > 100 * bound
        # nor would q / k rows loaded as stored (rotate-half RoPE on Cohere's interleaved pairs)
        monkeypatch.setattr("tpumk.model.checkpoint._rope_deinterleave", lambda a, *_: a)
        raw = load_model(None, str(ckpt))
        assert np.max(np.abs(np.asarray(forward_full(raw.params, raw.cfg, tokens)) - want)) > 100 * bound


@pytest.mark.parametrize("checkpoint", KERNEL_CASES, indirect=True)
def test_greedy_tokens_transformers_reference_megakernel(checkpoint):
    _, ckpt = checkpoint
    want = hf_greedy(ckpt, PROMPTS, STEPS)
    m = load_model(None, str(ckpt))
    assert generate(m, PROMPTS, STEPS, backend="reference")["tokens"] == want
    got = generate(m, PROMPTS, STEPS, backend="megakernel", page_size=8)
    assert got["tokens"] == want and "megakernel" in got["ran_on"]


@pytest.mark.parametrize("checkpoint", KERNEL_CASES, indirect=True)
def test_megakernel_compiles_deviceless(checkpoint):
    _, ckpt = checkpoint
    cfg = load_model(None, str(ckpt)).cfg
    compile_for_tpus(cfg, 2, 1, TuningConfig(kv_tile_pages=1), v6e=cfg.is_moe)


# ---------------------------------------------------------------------- a multimodal Gemma 3 checkpoint
# The published files' names for the parts of Gemma3ForConditionalGeneration (what
# save_pretrained writes), and the names of transformers 5's modules, which tpumk reads too.
MODULE_NAMES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def test_multimodal_gemma3_checkpoint_decodes_its_language_model(tmp_path):
    """Gemma 3 4B / 12B / 27B are published as Gemma3ForConditionalGeneration: a gemma3_text
    language model beside a SigLIP vision tower. Built by transformers' own class (the text part
    is gemma3-sandwich's), tpumk reads its text_config and its language model's tensors, skips
    the vision tower, and the reference gives transformers' logits on text; the same tensors
    under transformers 5's module names load to the same weights; a stray tensor is still refused."""
    import json

    import jax
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    from tpumk.errors import CheckpointError
    from tpumk.model.checkpoint import load_checkpoint

    from hf_utils import QWEN3_KW  # the sizes build_checkpoint starts from

    text = {**QWEN3_KW, **{k: v for k, v in CHECKPOINTS["gemma3-sandwich"].items() if k not in ("arch", "seed")}}
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    # untied (the wrapper's flag decides): the head is a tensor of its own
    config = transformers.Gemma3Config(text_config=transformers.Gemma3TextConfig(**text, initializer_range=0.1),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4, tie_word_embeddings=False)
    torch.manual_seed(29)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    ckpt = tmp_path / "gemma3-mm"
    model.save_pretrained(ckpt)
    stored = json.loads((ckpt / "config.json").read_text())
    assert stored["model_type"] == "gemma3" and stored["text_config"]["model_type"] == "gemma3_text"
    names = set(load_file(ckpt / "model.safetensors"))
    assert {"language_model.lm_head.weight", "language_model.model.layers.0.self_attn.q_proj.weight"} <= names
    assert any(n.startswith("vision_tower.") for n in names)  # the vision tower is in the file

    m = load_model(None, str(ckpt))
    assert (m.cfg.num_layers, m.cfg.hidden_size, m.cfg.attn_scalar, m.cfg.sliding_layers) == (2, 192, 48.0, (0,))
    assert not m.cfg.tie_embeddings and m.cfg.rope_scaling == "linear"
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    assert np.max(np.abs(got - want)) <= 2e-5 * max(1.0, np.max(np.abs(want)))

    # transformers 5's module names: the same weights.
    hub = tmp_path / "gemma3-modules"
    hub.mkdir()
    (hub / "config.json").write_text((ckpt / "config.json").read_text())
    renamed = {}
    for name, a in load_file(ckpt / "model.safetensors").items():
        new = next((to + name[len(frm):] for frm, to in MODULE_NAMES if name.startswith(frm)), name)
        renamed[new] = a
    assert "lm_head.weight" in renamed and any(n.startswith("model.language_model.layers.") for n in renamed)
    save_file(renamed, hub / "model.safetensors")
    cfg, params = load_checkpoint(hub)
    assert cfg == m.cfg
    assert jax.tree.structure(params) == jax.tree.structure(m.params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(m.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A tensor of neither part is refused, named as stored.
    save_file({**renamed, "model.language_model.extra.weight": np.zeros(3, np.float32)}, hub / "model.safetensors")
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_checkpoint(hub)


def test_phi3_fused_tensors_in_fp8_are_refused(tmp_path):
    """An fp8 checkpoint's 128 x 128 scale blocks would be cut by the q / k / v (gate / up)
    split of a fused tensor in general (here the cuts fall on block edges, still refused: the
    loader does not split scales), so it is refused in one line naming the tensor."""
    from hf_utils import fp8_checkpoint

    from tpumk.errors import NotSupportedError
    from tpumk.model.checkpoint import load_checkpoint

    ckpt = fp8_checkpoint(build_checkpoint(tmp_path / "phi3", arch="phi3", seed=11), tmp_path / "fp8")
    with pytest.raises(NotSupportedError, match=r"fused tensor 'model\.layers\.0\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight' in fp8$"):
        load_checkpoint(ckpt)


def test_cohere_q_k_in_fp8_are_refused(tmp_path):
    """Cohere's q / k rows are permuted on load (interleaved RoPE pairs to rotate-half order); an
    fp8 checkpoint's scale blocks would have to move with them, which the loader does not do."""
    from hf_utils import fp8_checkpoint

    from tpumk.errors import NotSupportedError
    from tpumk.model.checkpoint import load_checkpoint

    ckpt = fp8_checkpoint(build_checkpoint(tmp_path / "cohere", **CHECKPOINTS["cohere-parallel"]), tmp_path / "fp8")
    with pytest.raises(NotSupportedError, match=r"tensor 'model\.layers\.0\.self_attn\.[qk]_proj\.weight' in fp8 "
                                                r"\(Cohere's q / k rows are permuted on load"):
        load_checkpoint(ckpt)


# ---------------------------------------------------------------------- 4 host devices, int8 (full tier)
def check_4_devices_and_int8(ckpt) -> None:
    """`tpumk generate --devices 4` on the checkpoint gives transformers' greedy tokens; quantized
    to int8 at pack time, the megakernel and the reference fed the same weights give the same
    tokens."""
    from host_flags import generate_on_devices
    from tpumk.decode.generate import quantized

    want = hf_greedy(ckpt, PROMPTS, 6)
    got = generate_on_devices(ckpt, PROMPTS, 6, 4)
    assert got["devices"] == 4 and got["tokens"] == want
    m = quantized(load_model(None, str(ckpt)), "int8")
    ref = generate(m, PROMPTS, 6, backend="reference")["tokens"]
    assert generate(m, PROMPTS, 6, backend="megakernel", page_size=8)["tokens"] == ref


@pytest.mark.full  # every architecture x device count x quant: 4-device and int8 paths run on Qwen3 by default
def test_llama_on_4_host_devices_and_with_int8_weights(tmp_path):
    """A tiny Llama (llama3 RoPE, 128-wide heads: a 64-wide KV head alone on a device is not a
    whole lane block, which the plan refuses; 2 KV heads replicated on 4 devices)."""
    check_4_devices_and_int8(build_checkpoint(tmp_path / "llama", arch="llama", seed=9, rope_parameters=LLAMA3_ROPE))


@pytest.mark.full  # the default run has Gemma 3's parts on 2 host devices (test_multidevice.py dense-2dev-kv-split)
def test_gemma3_on_4_host_devices_and_with_int8_weights(tmp_path):
    """A tiny Gemma 3 (128-wide heads: 4 query / 2 KV heads, so each of 4 devices holds a whole
    lane block of a replicated KV head; hidden 192 lane padded; a sliding layer with its own
    theta; untied): its post-sublayer norms after the all-reduce."""
    check_4_devices_and_int8(build_checkpoint(tmp_path / "gemma3", **{
        **CHECKPOINTS["gemma3-sandwich"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "seed": 19}))


def test_mixtral_fused_expert_tensors_load_to_the_same_weights(tmp_path):
    """transformers 5's Mixtral modules hold each layer's experts fused (mlp.experts.gate_up_proj
    [E, 2 Fe, H], gate rows first; mlp.experts.down_proj) and the router as mlp.gate; files
    written from them load to the same weights as the published block_sparse_moe names."""
    import jax
    import numpy as np
    from safetensors.torch import save_file

    from hf_utils import load_model as hf_model
    from tpumk.model.checkpoint import load_checkpoint

    ckpt = build_checkpoint(tmp_path / "mixtral", **CHECKPOINTS["mixtral-moe"])
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((ckpt / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf_model(str(ckpt)).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and not any("block_sparse_moe" in k for k in state)
    save_file(state, fused / "model.safetensors")
    (cfg_a, a), (cfg_b, b) = load_checkpoint(ckpt), load_checkpoint(fused)
    assert cfg_a == cfg_b and jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.full  # the default run has MoE layers on 4 host devices (test_multidevice.py's moe-4dev cases)
def test_mixtral_on_4_host_devices_and_with_int8_weights(tmp_path):
    """A tiny Mixtral (4 query / 2 KV heads of 128, each KV head on 2 devices; its 4 experts split
    over the devices; Mistral's window on both layers)."""
    check_4_devices_and_int8(build_checkpoint(tmp_path / "mixtral", **{
        **CHECKPOINTS["mixtral-moe"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
        "seed": 24}))


@pytest.mark.full  # the default run has OLMo 2's parts on 4 host devices (test_multidevice.py dense-4dev-kv-replicated-verify)
def test_olmo2_on_4_host_devices_and_with_int8_weights(tmp_path):
    """A tiny OLMo 2 (4 query / 2 KV heads of 96, run 128 wide; each KV head on 2 devices): q and k
    normalized across every device's heads, the sums of squares all-reduced in the kernel."""
    check_4_devices_and_int8(build_checkpoint(tmp_path / "olmo2", **{
        **CHECKPOINTS["olmo2-postnorm"], "num_attention_heads": 4, "num_key_value_heads": 2, "seed": 23}))


@pytest.mark.full  # the default run has MoE layers on 4 host devices (test_multidevice.py's moe-4dev cases)
@pytest.mark.parametrize("name", ["olmoe-moe", "glm45-moe", "qwen2moe-shared", "gptoss-moe"])
def test_moe_families_on_4_host_devices_and_with_int8_weights(tmp_path, name):
    """A tiny OLMoE (4 query / 2 KV heads of 128: each KV head on 2 devices, q and k normalized
    across every device's heads), a tiny GLM-4.5 (the same heads, RoPE on 64 of 128 lanes,
    q / k / v biases cut with their columns; sigmoid group routing with its correction bias
    replicated, the shared expert split like a dense MLP) and a tiny Qwen2-MoE (its gated shared
    expert split over the devices, each partial scaled by the replicated gate) and a tiny gpt-oss
    (its experts' gate / up biases cut with their columns, the down biases added once)."""
    check_4_devices_and_int8(build_checkpoint(tmp_path / name, **{
        **CHECKPOINTS[name], "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "seed": 25}))


def test_glm45_multi_token_prediction_layer_is_skipped(tmp_path):
    """Published GLM-4.5 files carry a multi-token-prediction layer after the last decoder layer
    (num_nextn_predict_layers, model.layers.{num_hidden_layers}.*; transformers writes the count,
    1 by default): not part of the decode step, skipped; without the count in config.json the
    same tensors are refused by name."""
    import json

    import jax
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tpumk.errors import CheckpointError
    from tpumk.model.checkpoint import load_checkpoint

    ckpt = build_checkpoint(tmp_path / "glm", **CHECKPOINTS["glm45-moe"])
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    extra = {"model.layers.2.eh_proj.weight": np.ones((192, 384), np.float32),
             "model.layers.2.mlp.gate.weight": np.ones((8, 192), np.float32)}
    save_file({**tensors, **extra}, mtp / "model.safetensors")
    assert config["num_nextn_predict_layers"] == 1
    (mtp / "config.json").write_text(json.dumps(config))
    (cfg_a, a), (cfg_b, b) = load_checkpoint(ckpt), load_checkpoint(mtp)
    assert cfg_a == cfg_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bare = {k: v for k, v in config.items() if k not in ("num_nextn_predict_layers", "num_mtp_layers")}
    (mtp / "config.json").write_text(json.dumps(bare))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.2."):
        load_checkpoint(mtp)


# ---------------------------------------------------------------------- gpt-oss's MXFP4 release format
@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    from hf_utils import build_gpt_oss_mxfp4_checkpoints

    kw = {k: v for k, v in CHECKPOINTS["gptoss-moe"].items() if k not in ("arch", "seed")}
    kw["intermediate_size"] = 192  # whole 32-row scale groups (the release's 2880 is 90 of them)
    return build_gpt_oss_mxfp4_checkpoints(tmp_path_factory.mktemp("gptoss-mxfp4"), seed=31, **kw)


def test_gpt_oss_mxfp4_checkpoint_decodes_as_its_dequantized_copy(gpt_oss_mxfp4):
    """A tiny gpt-oss whose experts are stored as the release stores them (e2m1 codes two a byte,
    E8M0 scales per 32 rows; encoded here by numpy alone): transformers' own MXFP4 reader
    (dequantize=True) gives the float copy's logits, so the tensors are in the official layout;
    tpumk loads the codes as stored (no float round trip) and its megakernel, streaming the
    codes at half a byte and decoding them in VMEM, gives the float copy's greedy tokens."""
    import torch
    import transformers
    from hf_utils import hf_greedy, hf_logits

    from tpumk.model.quantize import scheme_of

    mx_dir, float_dir = gpt_oss_mxfp4
    tokens = np.random.default_rng(2).integers(0, 500, (2, 12))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        mx_dir, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        got = theirs(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, hf_logits(float_dir, tokens), rtol=1e-5, atol=1e-5)

    m = load_model(None, str(mx_dir))
    assert scheme_of(m.params) == "mxfp4" and str(m.params["layers"][0]["e_gate"].q.dtype) == "float4_e2m1fn"
    want = hf_greedy(float_dir, PROMPTS, STEPS)
    assert generate(m, PROMPTS, STEPS, backend="reference")["tokens"] == want
    got = generate(m, PROMPTS, STEPS, backend="megakernel", page_size=8)
    assert got["tokens"] == want and "megakernel" in got["ran_on"]


@pytest.mark.parametrize("bad, match", [
    ("blocks", r"tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks' has shape \[4, 384, 5, 16\], "
               r"expected \[4, 384, 6, 16\]"),
    ("nan-scale", r"tensor 'model.layers.0.mlp.experts.down_proj_scales' holds the E8M0 byte 255"),
])
def test_gpt_oss_mxfp4_bad_tensors_are_one_line(gpt_oss_mxfp4, tmp_path, bad, match):
    """An MXFP4 tensor with the wrong block count, or a NaN scale, is refused naming it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from tpumk.errors import CheckpointError
    from tpumk.model.checkpoint import load_checkpoint

    d = tmp_path / "ckpt"
    shutil.copytree(gpt_oss_mxfp4[0], d)
    tensors = load_file(d / "model.safetensors")
    if bad == "blocks":
        name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
        tensors[name] = tensors[name][:, :, :5]
    else:
        tensors["model.layers.0.mlp.experts.down_proj_scales"][0, 0, 0] = 255
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match) as e:
        load_checkpoint(d)
    assert "\n" not in str(e.value)


@pytest.mark.full  # the default run has MXFP4 experts on one device above, and paired KV heads on 2 devices
def test_gpt_oss_mxfp4_on_2_host_devices(gpt_oss_mxfp4):  # in tests/test_multidevice.py (dense-2dev-d64-paired)
    """The MXFP4 checkpoint on 2 host devices: its two 64-wide KV heads held as a pair by both
    devices, each expert's width split over both (its e2m1 codes and their 32-row scales cut
    with its columns and rows): the float copy's greedy tokens (transformers')."""
    from hf_utils import hf_greedy
    from host_flags import generate_on_devices

    mx_dir, float_dir = gpt_oss_mxfp4
    got = generate_on_devices(mx_dir, PROMPTS, 6, 2)
    assert got["devices"] == 2 and got["tokens"] == hf_greedy(float_dir, PROMPTS, 6)
