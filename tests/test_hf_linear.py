"""Hybrid linear-attention checkpoints written by transformers' own classes (issue 55): Qwen3-Next
(Gated DeltaNet beside gated attention, MoE with a gated shared expert), Qwen3.5 dense and
Qwen3.5-MoE (Gated DeltaNet with split projections) and Kimi Linear (KDA beside MLA without
RoPE, DeepSeek-style routing, a dense first layer). Every layer kind is present; the Qwen
widths are off the 128-lane grid (hidden 96, 64-wide attention heads, vocabulary 211: the plan
pads them), Kimi Linear's MLA keeps hidden 128 (MLA is not lane padded).

Each family: its config read, the reference's logits equal transformers' (and would not without
the parts that make it a hybrid), and transformers' greedy tokens through the reference and the
megakernel (interpret mode) on one device, on 4 host devices and, with --quant int8, the
megakernel's equal to the quantized reference's. The default run takes one of each kind of run
(1 device: Qwen3-Next; 4 devices: Kimi Linear; int8: Qwen3.5-MoE; Qwen3.5 dense's megakernel
run on 1 device); the rest of the matrix is the full tier (tests/README.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_utils import hf_greedy, hf_logits
from host_flags import generate_on_devices
from tpumk.decode.generate import generate, load_model, quantized
from tpumk.model.reference import forward_full

LIN = dict(linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
           linear_conv_kernel_dim=4)
QWEN = dict(vocab_size=211, hidden_size=96, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, intermediate_size=160, layer_types=["linear_attention", "linear_attention", "full_attention"],
            **LIN)
QWEN_MOE = dict(QWEN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
CHECKPOINTS = {
    "qwen3_next": dict(QWEN_MOE, shared_expert_intermediate_size=96),
    "qwen3_5_text": dict(QWEN),
    "qwen3_5_moe_text": dict({k: v for k, v in QWEN_MOE.items() if k != "intermediate_size"},
                             shared_expert_intermediate_size=96),
    "kimi_linear": dict(vocab_size=211, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                        intermediate_size=160, moe_intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                        linear_head_dim=128, linear_num_heads=4, first_k_dense_replace=1,
                        layer_types=["linear_attention", "full_attention", "linear_attention"]),
}
PROMPTS = [[3, 141, 59, 26, 5, 200, 17, 122, 41, 9], [150, 1, 64, 7, 180, 2]]
STEPS = 6


def build(out: Path, model_type: str, seed: int) -> Path:
    """A float32 model of `model_type` with transformers' own class, saved with save_pretrained:
    norm weights around their neutral value (Qwen's (1 + w) norms around 0), the gated norms
    and Kimi's around 1, decays and correction biases random, so every part moves the logits."""
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, initializer_range=0.1, pad_token_id=None, bos_token_id=None,
                               eos_token_id=None, tie_word_embeddings=False, **CHECKPOINTS[model_type])
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                plain = model_type == "kimi_linear" or "linear_attn.norm" in name
                p.copy_((1.0 if plain else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("dt_bias", "A_log")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    return name, build(tmp_path_factory.mktemp(name), name, seed=40 + list(CHECKPOINTS).index(name))


def test_config_reads_the_hybrid(checkpoint):
    name, ckpt = checkpoint
    cfg = load_model(None, str(ckpt)).cfg
    kimi = name == "kimi_linear"
    assert cfg.linear_kind == ("kda" if kimi else "gated_delta")
    assert cfg.linear_layers == ((0, 2) if kimi else (0, 1)) and cfg.kv_layers == 1
    want = (4, 4) if kimi else (LIN["linear_num_key_heads"], LIN["linear_num_value_heads"])
    assert (cfg.linear_key_heads, cfg.linear_value_heads) == want
    assert (cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv) == (128, 128, 4)
    assert cfg.attn_output_gate == (not kimi) and cfg.qk_norm == (not kimi)
    if kimi:  # MLA without RoPE or q-LoRA, DeepSeek's routing, the first layer dense
        assert cfg.is_mla and cfg.nope_layers == (1,) and cfg.q_lora_rank == 0 and cfg.dense_layers == (0,)
        assert cfg.router_correction_bias and cfg.routed_scaling_factor == pytest.approx(2.446)
        assert cfg.latent_norm_eps == 1e-6 and cfg.rms_eps == 1e-5  # transformers' latent norms keep 1e-6
    else:  # RoPE on a quarter of each 64-wide head
        assert cfg.rotary_dim == 16 and cfg.head_dim == 64
        assert cfg.is_moe == (name != "qwen3_5_text") and cfg.shared_expert_gate == cfg.is_moe


def test_reference_logits_match_transformers(checkpoint):
    """Full-sequence logits agree to float32 rounding (the chunked prefill form over 24 tokens
    against transformers' chunked form), and would not without the linear layers' recurrence,
    gated attention's output gate or (Kimi) MLA's missing RoPE."""
    _, ckpt = checkpoint
    m = load_model(None, str(ckpt))
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 24))
    want = hf_logits(ckpt, tokens)
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    bound = 2e-5 * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(got - want)) <= bound
    others = []
    if m.cfg.attn_output_gate:  # ungated attention: the gate's weights unread
        others.append(m.cfg.replace(attn_output_gate=False))
    if m.cfg.nope_layers:  # RoPE on the MLA layers
        others.append(m.cfg.replace(nope_layers=()))
    for other in others:
        assert np.max(np.abs(np.asarray(forward_full(m.params, other, tokens)) - want)) > 100 * bound


# Which run the default tier takes (Gated DeltaNet and gated attention on 1 device); the rest are
# the full tier (every checkpoint's logits against transformers stay in the default run).
DEFAULT_RUNS = {("qwen3_next", 1, "none")}
RUNS = [pytest.param(n, d, q, marks=() if (n, d, q) in DEFAULT_RUNS else pytest.mark.full, id=f"{n}-{d}dev-{q}")
        for n in CHECKPOINTS for d, q in ((1, "none"), (4, "none"), (1, "int8"))]


@pytest.mark.parametrize("name, devices, quant", RUNS)
def test_greedy_tokens_transformers_reference_megakernel(name, devices, quant, tmp_path_factory):
    ckpt = build(tmp_path_factory.mktemp(name), name, seed=40 + list(CHECKPOINTS).index(name))
    if quant == "none":
        want = hf_greedy(ckpt, PROMPTS, STEPS)
        m = load_model(None, str(ckpt))
        assert generate(m, PROMPTS, STEPS, backend="reference")["tokens"] == want
    else:  # the megakernel against the reference on the same quantized weights
        m = quantized(load_model(None, str(ckpt)), quant)
        want = generate(m, PROMPTS, STEPS, backend="reference")["tokens"]
    if devices == 1:
        got = generate(m, PROMPTS, STEPS, backend="megakernel", page_size=8)
    else:  # `tpumk generate --devices 4` in a fresh process (it makes its own host devices)
        got = generate_on_devices(ckpt, PROMPTS, STEPS, devices, "--page-size", "8", timeout=1200)
        assert got["devices"] == devices
    assert got["tokens"] == want and "megakernel" in got["ran_on"]


@pytest.mark.full  # 66 s here; the default run's wrapper case is test_hf_fields' kimi_k25
def test_multimodal_qwen3_5_checkpoint_decodes_its_language_model(tmp_path):
    """Qwen3.5's releases are Qwen3_5ForConditionalGeneration (the hybrid language model beside a
    vision tower, model_type qwen3_5, its text_config qwen3_5_text): built by transformers' own
    class, tpumk reads the text_config and the language model's tensors, skips the vision tower,
    and the reference gives transformers' logits on text."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(47)
    text = {k: v for k, v in QWEN.items()}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=96, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=dict(text, initializer_range=0.1, pad_token_id=None, bos_token_id=None,
                                         eos_token_id=None), vision_config=vision)
    model = Qwen3_5ForConditionalGeneration(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    m = load_model(None, str(tmp_path))
    assert m.cfg.linear_kind == "gated_delta" and m.cfg.hidden_size == 96 and m.cfg.attn_output_gate
    tokens = np.random.default_rng(3).integers(0, m.cfg.vocab_size, (1, 12))
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    assert np.max(np.abs(got - want)) <= 2e-5 * max(1.0, float(np.max(np.abs(want))))
