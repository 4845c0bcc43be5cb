"""Parity of the pure-JAX reference with transformers on tiny random Qwen3 / Qwen3-MoE models,
and the checkpoint loader's handling of formats and broken checkpoints.

Tolerance: everything runs in float32, so the reference and transformers differ only in
summation order and transcendental implementations; logits must agree to within
LOGIT_RTOL * max|logits| (measured: at most 2.6e-6 of the scale). Greedy tokens must be identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_utils import hf_greedy, hf_logits
from tpumk.model.checkpoint import load_checkpoint
from tpumk.errors import CheckpointError, NotSupportedError
from tpumk.model.reference import forward_full, greedy_generate, init_cache, jitted_decode_step, prefill

LOGIT_RTOL = 2e-5
PROMPTS = [[3, 141, 59, 26, 5], [300, 17, 222, 41, 9, 99, 6, 480, 2, 77, 31]]  # batch 2, lengths 5 and 11
STEPS = 16
PAGE = 4  # small pages: prompts and decode cross many page boundaries of a shuffled block table


def _max_err(got, want) -> float:
    """Max abs difference relative to the logit scale."""
    want = np.asarray(want, np.float32)
    return float(np.max(np.abs(np.asarray(got, np.float32) - want)) / max(1.0, np.max(np.abs(want))))


@pytest.fixture(scope="module", params=["hf_qwen3_dir", "hf_qwen3_tied_dir", "hf_qwen3_moe_dir"])
def model(request):
    d = request.getfixturevalue(request.param)
    cfg, params = load_checkpoint(d)
    # One jitted step per model, shared by the tests so each shape compiles once.
    return SimpleNamespace(dir=d, cfg=cfg, params=params, step=jitted_decode_step(cfg))


def test_config_from_checkpoint(model):
    hf = json.loads((model.dir / "config.json").read_text())
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (hf["num_hidden_layers"], 256, 512)
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 128)
    assert cfg.rope_theta == 1_000_000.0 and cfg.dtype == "float32" and cfg.qk_norm
    assert cfg.tie_embeddings == hf["tie_word_embeddings"]
    assert ("lm_head" in model.params) != cfg.tie_embeddings
    if cfg.is_moe:
        assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size) == (8, 2, 256)
        assert cfg.dense_layers == (0,) and cfg.norm_topk_prob


def test_forward_full_matches_transformers(model):
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (3, 24))
    want = hf_logits(model.dir, tokens)
    got = forward_full(model.params, model.cfg, jnp.asarray(tokens, jnp.int32))
    assert _max_err(got, want) < LOGIT_RTOL
    assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))


def test_paged_greedy_matches_transformers(model):
    cache = init_cache(model.cfg, len(PROMPTS), max_context=32, page_size=PAGE)
    got, cache = greedy_generate(model.params, model.cfg, PROMPTS, STEPS, cache, step_fn=model.step)
    assert got == hf_greedy(model.dir, PROMPTS, STEPS)
    assert len(set(got[0])) > 3  # the model is not degenerate: greedy output varies
    # The last generated token is not fed back, so STEPS - 1 decode steps were cached.
    assert np.asarray(cache.lengths).tolist() == [len(p) + STEPS - 1 for p in PROMPTS]


def test_paged_decode_steps_match_full_recompute(model):
    cfg, params = model.cfg, model.params
    cache = init_cache(cfg, len(PROMPTS), max_context=32, page_size=PAGE)
    logits, cache = prefill(params, cfg, PROMPTS, cache, step_fn=model.step)
    seqs = [list(p) for p in PROMPTS]
    step_logits = []  # (batch, position, logits) of every prefill tail and decode step
    for _ in range(STEPS):
        for b in range(len(seqs)):
            step_logits.append((b, len(seqs[b]) - 1, np.asarray(logits[b])))
        nxt = np.argmax(np.asarray(logits), -1)
        for b, t in enumerate(nxt):
            seqs[b].append(int(t))
        out, cache = model.step(params, jnp.asarray(nxt[:, None], jnp.int32), cache.lengths[:, None], cache)
        logits = out[:, -1]
    # Right padding is harmless under a causal mask: positions < length never see it.
    width = max(map(len, seqs))
    padded = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    full = np.asarray(forward_full(params, cfg, jnp.asarray(padded)))
    err = max(_max_err(lg, full[b, pos]) for b, pos, lg in step_logits)
    assert err < LOGIT_RTOL


# ---------------------------------------------------------------------- checkpoint formats
def _load_tensors(d: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _write_copy(src: Path, dst: Path, tensors: dict[str, np.ndarray], config: dict | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    if config is None:
        shutil.copy(src / "config.json", dst / "config.json")
    else:
        (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _assert_params_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if k != "layers":
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    for i, (la, lb) in enumerate(zip(a["layers"], b["layers"])):
        assert la.keys() == lb.keys()
        for k in la:
            np.testing.assert_array_equal(np.asarray(la[k]), np.asarray(lb[k]), err_msg=f"layers[{i}].{k}")


def test_fused_expert_format_loads_identically(hf_qwen3_moe_dir, tmp_path):
    """transformers 5's in-memory expert layout: gate_up_proj [E, 2Fe, H], down_proj [E, H, Fe]."""
    tensors = _load_tensors(hf_qwen3_moe_dir)
    for i in (1, 2):
        p = f"model.layers.{i}.mlp.experts."
        gate = [tensors.pop(f"{p}{j}.gate_proj.weight") for j in range(8)]
        up = [tensors.pop(f"{p}{j}.up_proj.weight") for j in range(8)]
        down = [tensors.pop(f"{p}{j}.down_proj.weight") for j in range(8)]
        tensors[p + "gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
        tensors[p + "down_proj"] = np.stack(down)
    _, fused = load_checkpoint(_write_copy(hf_qwen3_moe_dir, tmp_path / "fused", tensors))
    _, classic = load_checkpoint(hf_qwen3_moe_dir)
    _assert_params_equal(fused, classic)


def test_bfloat16_checkpoint_and_dtype_override(hf_qwen3_dir, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    dst = tmp_path / "bf16"
    dst.mkdir()
    shutil.copy(hf_qwen3_dir / "config.json", dst / "config.json")
    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in _load_tensors(hf_qwen3_dir).items()},
               str(dst / "model.safetensors"))
    cfg16, from_bf16 = load_checkpoint(dst, dtype="bfloat16")
    _, cast = load_checkpoint(hf_qwen3_dir, dtype=jnp.bfloat16)
    assert cfg16.dtype == "bfloat16" and from_bf16["embed"].dtype == jnp.bfloat16
    _assert_params_equal(from_bf16, cast)  # both round to nearest even
    cfg32, widened = load_checkpoint(dst)  # config.json says float32: bf16 values widen exactly
    assert cfg32.dtype == "float32" and widened["layers"][0]["wq"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(widened["layers"][0]["wq"], np.float32),
                                  np.asarray(cast["layers"][0]["wq"], np.float32))


# ---------------------------------------------------------------------- broken checkpoints
def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_dir_and_files(hf_qwen3_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as e:
        load_checkpoint(tmp_path / "nope")
    _one_line(e)
    no_cfg = tmp_path / "no_config"
    no_cfg.mkdir()
    shutil.copy(hf_qwen3_dir / "model.safetensors", no_cfg)
    with pytest.raises(CheckpointError, match="config.json") as e:
        load_checkpoint(no_cfg)
    _one_line(e)
    no_st = tmp_path / "no_weights"
    no_st.mkdir()
    shutil.copy(hf_qwen3_dir / "config.json", no_st)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors") as e:
        load_checkpoint(no_st)
    _one_line(e)


def test_missing_shard(hf_qwen3_moe_dir, tmp_path):
    dst = shutil.copytree(hf_qwen3_moe_dir, tmp_path / "moe")
    victim = sorted(dst.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name) as e:
        load_checkpoint(dst)
    _one_line(e)



def test_truncated_shard(hf_qwen3_moe_dir, tmp_path):
    dst = shutil.copytree(hf_qwen3_moe_dir, tmp_path / "moe")
    victim = sorted(dst.glob("*.safetensors"))[0]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=victim.name) as e:
        load_checkpoint(dst)
    _one_line(e)

def test_missing_tensor(hf_qwen3_dir, tmp_path):
    tensors = _load_tensors(hf_qwen3_dir)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'") as e:
        load_checkpoint(_write_copy(hf_qwen3_dir, tmp_path / "c", tensors))
    _one_line(e)


def test_missing_expert(hf_qwen3_moe_dir, tmp_path):
    tensors = _load_tensors(hf_qwen3_moe_dir)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        load_checkpoint(_write_copy(hf_qwen3_moe_dir, tmp_path / "c", tensors))


def test_unexpected_tensor(hf_qwen3_dir, tmp_path):
    tensors = _load_tensors(hf_qwen3_dir)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(512, np.float32)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'") as e:
        load_checkpoint(_write_copy(hf_qwen3_dir, tmp_path / "c", tensors))
    _one_line(e)


def test_wrong_shape(hf_qwen3_dir, tmp_path):
    tensors = _load_tensors(hf_qwen3_dir)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((256, 512), np.float32)  # transposed
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[256, 512\], "
                                              r"expected \[512, 256\]") as e:
        load_checkpoint(_write_copy(hf_qwen3_dir, tmp_path / "c", tensors))
    assert "model.safetensors" in _one_line(e)


def test_unsupported_architecture(hf_qwen3_dir, tmp_path):
    config = json.loads((hf_qwen3_dir / "config.json").read_text())
    config.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], kv_lora_rank=512,
                  q_lora_rank=1536)
    with pytest.raises(NotSupportedError, match="not supported yet: model_type 'deepseek_v2': DeepSeek-V2's expert "
                                                "routing") as e:
        load_checkpoint(_write_copy(hf_qwen3_dir, tmp_path / "c", _load_tensors(hf_qwen3_dir), config))
    _one_line(e)
    config = json.loads((hf_qwen3_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}  # fp8 block checkpoints load: tests/test_quant.py
    with pytest.raises(NotSupportedError, match="not supported yet: quantized checkpoint \\('gptq'"):
        load_checkpoint(_write_copy(hf_qwen3_dir, tmp_path / "q", _load_tensors(hf_qwen3_dir), config))
