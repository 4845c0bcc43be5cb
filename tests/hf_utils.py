"""Transformers-side oracles for parity tests: build tiny random Qwen3 checkpoints, run them.

Everything runs on CPU in float32 with the eager attention path, so transformers computes the
plain math the reference model documents.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny local models only, never the hub

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

# Shapes shared by the fixtures; small enough for CPU, large enough for real GQA and routing.
QWEN3_KW = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=128, intermediate_size=512, vocab_size=512, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, max_position_embeddings=4096)
QWEN3_MOE_KW = dict(QWEN3_KW, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[0])


# Families without QK-norm, by transformers' class names (the shared kwargs fit each; Mixtral
# reads intermediate_size as its experts' width and needs num_local_experts too).
DENSE_ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "granite": ("GraniteConfig", "GraniteForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
               "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "cohere": ("CohereConfig", "CohereForCausalLM"),
               "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
               "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
# Phi3Config's default special tokens (32000) lie outside the tiny vocabularies.
ARCH_KW = {"phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)}
# Shared kwargs that are not a field of the family: transformers would keep them in config.json,
# where tpumk refuses another family's field (Cohere normalises with layer_norm_eps).
ARCH_DROP = {"cohere": ("rms_norm_eps",)}


def build_checkpoint(out: str | Path, moe: bool = False, seed: int = 0, max_shard_size: str | None = None,
                     arch: str = "qwen3", **overrides) -> Path:
    """A random float32 Qwen3 (or Qwen3-MoE, or with `arch` a Llama / Mistral / Phi-3 / Qwen2 / Granite / OLMo 2 /
    Gemma / Gemma 2 / Gemma 3 text / Cohere / Mixtral / OLMoE / GLM-4.5 / Qwen2-MoE / gpt-oss) model saved with
    `save_pretrained` into `out`.

    initializer_range 0.1 (vs 0.02) gives logits a spread of several units so greedy decoding
    is not constant, norm weights are drawn around 1 and biases around 0 with spread 0.5, so a
    swapped or dropped norm or bias shows.
    """
    kw = dict(QWEN3_MOE_KW if moe else QWEN3_KW, initializer_range=0.1, tie_word_embeddings=False,
              **ARCH_KW.get(arch, {}))
    kw.update(overrides)
    for key in ARCH_DROP.get(arch, ()):
        if key not in overrides:
            kw.pop(key, None)
    if arch in DENSE_ARCHS:
        cfg_cls, model_cls = (getattr(transformers, name) for name in DENSE_ARCHS[arch])
    else:
        cfg_cls, model_cls = ((transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM) if moe
                              else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith((".bias", "_bias")):  # transformers starts biases at zero: a dropped bias would not show
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".sinks"):  # gpt-oss: about a score's size, so each sink takes a visible share
                p.copy_(torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # GLM-4.5's too (zero at init), as build_deepseek_checkpoint's
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    out = Path(out)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


# DeepSeek-V3 with every feature tpumk models switched on and no size a multiple of 128: q-LoRA,
# YaRN with both mscales (attention factor and softmax scale != 1), interleaved RoPE rows, 4
# expert groups of which 2 are kept, a scaling factor, a shared expert, one dense layer first.
DEEPSEEK_V3_KW = dict(
    num_hidden_layers=3, hidden_size=96, num_attention_heads=3, num_key_value_heads=3, intermediate_size=80,
    moe_intermediate_size=48, vocab_size=320, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=56, kv_lora_rank=40, qk_nope_head_dim=24,
    qk_rope_head_dim=8, v_head_dim=20, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=256, rope_interleave=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                         beta_fast=32, beta_slow=1, mscale=1.2, mscale_all_dim=0.8))


def perturb_norms_and_bias(model: torch.nn.Module, seed: int) -> None:
    """Norm weights drawn around 1 (so a reader that drops one fails) and a DeepSeek-style
    correction bias of 0.3 x N(0, 1), large enough against sigmoid scores to change some picks."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def build_deepseek_checkpoint(out: str | Path, seed: int = 0, **overrides) -> Path:
    """A random float32 DeepseekV3ForCausalLM saved with `save_pretrained` into `out` (the
    public releases' tensor names: per-expert experts.{j}.*_proj, gate.e_score_correction_bias).

    Norm weights are drawn around 1, and the correction bias is non-zero and large enough
    (0.3 x N(0, 1) against sigmoid scores) to change which experts some tokens pick."""
    kw = dict(DEEPSEEK_V3_KW, initializer_range=0.1, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).to(torch.float32).eval()
    perturb_norms_and_bias(model, seed)
    out = Path(out)
    model.save_pretrained(out)
    return out


# a tiny Qwen3.5 dense hybrid: two Gated DeltaNet layers, then a gated attention layer; widths on
# the 128-lane grid (the linear heads' key and value widths must be), a vocabulary of 512
QWEN3_5_KW = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=128, intermediate_size=256, linear_num_key_heads=1, linear_num_value_heads=2,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention"])


def build_qwen3_5_checkpoint(out: str | Path, seed: int = 0, **overrides) -> Path:
    """A random float32 Qwen3.5 dense hybrid (model_type qwen3_5_text, transformers' own class)
    saved with `save_pretrained`: its (1 + w) norms around 0, the gated norm around 1, decays
    and their biases random, so every part moves the logits."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model("qwen3_5_text", initializer_range=0.1, pad_token_id=None,
                                            bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
                                            **dict(QWEN3_5_KW, **overrides))
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("dt_bias", "A_log")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    out = Path(out)
    model.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=8)
def load_model(path: str) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(path)
    # transformers 5.24's causal-LM auto mapping lacks some families it has classes for
    # (ministral3, mistral4): their checkpoint's own architecture then
    cls = AutoModelForCausalLM if type(config) in AutoModelForCausalLM._model_mapping else \
        getattr(transformers, config.architectures[0])
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(path: str | Path, token_ids) -> np.ndarray:
    """Full-sequence logits [B, T, V] (float32 numpy) of transformers' forward pass."""
    model = load_model(str(path))
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(token_ids), dtype=torch.long)).logits.float().numpy()


def hf_greedy(path: str | Path, prompt_ids: Sequence[Sequence[int]], steps: int,
              model: torch.nn.Module | None = None) -> list[list[int]]:
    """Transformers greedy generation (do_sample=False, KV cache on) of `steps` tokens per prompt
    (by `model`, when given, instead of the checkpoint's: a copy with a part switched off).

    Prompts run one at a time, so no padding or attention mask enters the oracle.
    """
    model = model if model is not None else load_model(str(path))
    out = []
    for prompt in prompt_ids:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                                 max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0,
                                 eos_token_id=None)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


# Linear weights an official FP8 release stores as e4m3 blocks (the router `mlp.gate` and the
# lm_head stay in the model dtype there).
_FP8_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # these four: MLA (DeepSeek-V3)
               "qkv_proj", "gate_up_proj")  # Phi-3's fused projections


def fp8_checkpoint(src: str | Path, out: str | Path) -> Path:
    """`src` rewritten in Hugging Face's official FP8 format: every projection weight [out, in] as
    float8_e4m3fn with a float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)] (one per
    128 x 128 block, amax / 448: dequantized = weight x scale_inv), and config.json's
    `quantization_config` = {quant_method fp8, fmt e4m3, weight_block_size [128, 128]}."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    stored = {}
    for name, w in tensors.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in _FP8_LINEAR):
            stored[name] = w
            continue
        o, i = w.shape
        bo, bi = -(-o // 128), -(-i // 128)
        padded = torch.zeros(bo * 128, bi * 128, dtype=torch.float32)
        padded[:o, :i] = w.float()
        amax = padded.reshape(bo, 128, bi, 128).abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:o, :i]
        stored[name] = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        stored[name[:-len("weight")] + "weight_scale_inv"] = scale.contiguous()
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# ---------------------------------------------------------------------- gpt-oss in MXFP4
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)  # magnitude codes 0..7 (bit 3: sign)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [E, in, out] (transformers' gpt-oss expert layout) -> the release's MXFP4 tensors:
    blocks [E, out, in/32, 16] uint8 (byte j of a group: element 2j in the low nibble, 2j + 1 in
    the high one) and scales [E, out, in/32] uint8 (E8M0: 2^(b - 127)), by the OCP recipe (the
    group's scale 2^(floor(log2 absmax) - 2), each element to the nearest e2m1 value). Written
    here with numpy alone, so the test's checkpoint does not come from tpumk's quantizer."""
    x = np.asarray(w, np.float32).transpose(0, 2, 1)  # [E, out, in]
    e, out, k = x.shape
    g = x.reshape(e, out, k // 32, 32)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, 0).astype(np.int32)
    y = np.clip(g / np.exp2(exp)[..., None], -6, 6)
    mag = np.argmin(np.abs(np.abs(y)[..., None] - E2M1_VALUES), -1)  # nearest (ties: the smaller code)
    nib = (mag + 8 * (y < 0)).astype(np.uint8)
    blocks = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(exp + 127, np.uint8)  # C order, as written


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`mxfp4_encode` undone: [E, in, out] float32."""
    nib = np.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], -1)  # [E, out, G, 32]
    v = E2M1_VALUES[nib & 7] * np.where(nib >= 8, -1, 1) * np.exp2(scales.astype(np.float32) - 127)[..., None]
    # (C order: safetensors writes an array's buffer as it lies)
    return np.ascontiguousarray(v.reshape(*v.shape[:2], -1).transpose(0, 2, 1), np.float32)


def build_gpt_oss_mxfp4_checkpoints(out: str | Path, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """A tiny transformers gpt-oss, written twice: `out/mxfp4`, its experts in the release's
    MXFP4 tensors (`*_blocks`, `*_scales`, `quantization_config` quant_method mxfp4), and
    `out/float`, the same model with those experts dequantized to float32 (everything else
    identical). Returns (mxfp4 dir, float dir)."""
    import json

    from safetensors.numpy import load_file, save_file

    out = Path(out)
    float_dir = build_checkpoint(out / "float", arch="gpt_oss", seed=seed, **overrides)
    mx_dir = out / "mxfp4"
    mx_dir.mkdir()
    tensors = {k: np.array(v) for k, v in load_file(float_dir / "model.safetensors").items()}  # copies: rewritten below
    mx = {}
    for name, t in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = mxfp4_encode(t)
            mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
            tensors[name] = mxfp4_decode(blocks, scales)  # the float copy holds the dequantized values
        else:
            mx[name] = t
    save_file(tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(mx, mx_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx_dir / "config.json").write_text(json.dumps(config))
    for extra in float_dir.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (mx_dir / extra.name).write_bytes(extra.read_bytes())
    return mx_dir, float_dir


# ---------------------------------------------------------------------- NVFP4 in NVIDIA ModelOpt's layout
def e4m3_values() -> np.ndarray:
    """The 256 float8_e4m3fn values by their byte (sign bit 7, exponent bits 6..3 with bias 7,
    mantissa bits 2..0; exponent 0: subnormal mantissa / 8 x 2^-6; bytes 0x7F / 0xFF: NaN),
    from the format's definition, not from a library's cast."""
    b = np.arange(256)
    exp, mant = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, mant / 8 * 2.0 ** -6, (1 + mant / 8) * 2.0 ** (exp - 7))
    mag[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b >= 128, -mag, mag)


def nvfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """w [out, in] float32 -> one ModelOpt NVFP4 projection, by numpy alone: (weight [out, in/2]
    uint8, two e2m1 codes a byte, input element 2j in the low nibble; weight_scale [out, in/16]
    uint8, the bytes of e4m3 scales; weight_scale_2, the float32 global scale). ModelOpt's
    recipe: global = absmax / (6 x 448); a 16-element group's scale = its absmax / (6 x global)
    to the nearest e4m3 value; each element to the nearest e2m1 value of w / (scale x global)."""
    w = np.asarray(w, np.float32)
    out, k = w.shape
    amax = float(np.abs(w).max())
    g = np.float32(amax / (6 * 448) if amax > 0 else 1.0)
    groups = w.reshape(out, k // 16, 16)
    table = e4m3_values()[:127]  # the finite non-negative values, bytes 0..126
    want = np.abs(groups).max(-1) / (6 * np.float64(g))
    sbytes = np.argmin(np.abs(want[..., None] - table), -1).astype(np.uint8)
    step = table[sbytes].astype(np.float32) * g  # (a step of 0: every element of the group is 0)
    y = np.where(step[..., None] > 0, groups / np.where(step > 0, step, 1)[..., None], 0.0)
    mag = np.argmin(np.abs(np.abs(y)[..., None] - E2M1_VALUES), -1)  # nearest (ties: the smaller code)
    nib = (mag + 8 * (y < 0)).reshape(out, k).astype(np.uint8)
    return np.ascontiguousarray(nib[:, 0::2] | (nib[:, 1::2] << 4)), sbytes, g


def nvfp4_decode(weight: np.ndarray, scale_bytes: np.ndarray, global_scale) -> np.ndarray:
    """`nvfp4_encode` undone: [out, in] float32, (code x e4m3 scale) x global in float32."""
    nib = np.stack([weight & 15, weight >> 4], -1).reshape(weight.shape[0], -1)
    codes = (E2M1_VALUES[nib & 7] * np.where(nib >= 8, -1, 1)).astype(np.float32)
    scales = np.repeat(e4m3_values()[scale_bytes].astype(np.float32), 16, axis=1)
    return (codes * scales) * np.float32(global_scale)


def build_nvfp4_checkpoints(out: str | Path, seed: int = 0, w4a16: bool = False, **overrides) -> tuple[Path, Path]:
    """A tiny transformers Qwen3-MoE, written twice: `out/nvfp4`, its routed experts in NVIDIA
    ModelOpt's NVFP4 tensors (per expert projection: `weight` U8 [out, in/2], `weight_scale`
    F8_E4M3 [out, in/16], `weight_scale_2` F32 [], and `input_scale` F32 [] unless `w4a16`;
    `quantization_config` {quant_method modelopt, quant_algo NVFP4 | W4A16_NVFP4, group_size 16,
    ignore [...]}), and `out/float`, the same model with those experts dequantized to float32
    (everything else identical). Each up projection is scaled by 3 before encoding so gate and
    up carry different global scales. Returns (nvfp4 dir, float dir)."""
    import json

    import ml_dtypes  # (numpy's float8_e4m3fn, so safetensors writes the F8_E4M3 tag)
    from safetensors.numpy import load_file, save_file

    out = Path(out)
    float_dir = build_checkpoint(out / "float", moe=True, seed=seed, **overrides)
    nv_dir = out / "nvfp4"
    nv_dir.mkdir()
    tensors = {k: np.array(v) for k, v in load_file(float_dir / "model.safetensors").items()}
    nv = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if not (".mlp.experts." in name and parts[-1] == "weight"):
            nv[name] = t
            continue
        w = t * (3 if parts[-2] == "up_proj" else 1)
        weight, sbytes, g = nvfp4_encode(w)
        base = name[:-len("weight")]
        nv[name] = weight
        nv[base + "weight_scale"] = sbytes.view(ml_dtypes.float8_e4m3fn)
        nv[base + "weight_scale_2"] = np.asarray(g, np.float32)
        if not w4a16:
            nv[base + "input_scale"] = np.asarray(1 / 448, np.float32)
        tensors[name] = nvfp4_decode(weight, sbytes, g)  # the float copy holds the dequantized values
    save_file(tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(nv, nv_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "W4A16_NVFP4" if w4a16 else "NVFP4", "group_size": 16,
        "ignore": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"],
        "producer": {"name": "modelopt", "version": "0.33.0"}, "kv_cache_quant_algo": None}
    (nv_dir / "config.json").write_text(json.dumps(config))
    for extra in float_dir.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (nv_dir / extra.name).write_bytes(extra.read_bytes())
    return nv_dir, float_dir


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """A safetensors file as numpy arrays, e4m3 tensors as ml_dtypes' float8_e4m3fn
    (safetensors' numpy reader has no fp8 dtype; its writer takes ml_dtypes' arrays)."""
    import ml_dtypes
    from safetensors.torch import load_file

    return {k: (v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn) if v.dtype == torch.float8_e4m3fn
                else v.numpy()) for k, v in load_file(str(path)).items()}
