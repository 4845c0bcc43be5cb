"""Parity of the MLA reference (tpumk.model.mla) with transformers' own DeepseekV3ForCausalLM on
tiny random checkpoints, and the loader's handling of the DeepSeek-V3 tensor names.

The checkpoint (hf_utils.DEEPSEEK_V3_KW) switches on every modelled feature: q-LoRA, YaRN with
an attention factor and a softmax mscale both != 1, interleaved RoPE rows, group-limited
routing (4 groups, 2 kept) with a non-zero correction bias, a scaling factor, a shared expert
and a dense first layer; no size is a multiple of 128. Everything is float32: logits agree to
LOGIT_RTOL of the logit scale (measured: 1.3e-6), greedy tokens are identical. Each feature is
also switched off on the tpumk side to show the comparison notices it (the test can fail).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import build_deepseek_checkpoint
from hf_utils import DEEPSEEK_V3_KW, hf_greedy, hf_logits
from tpumk.errors import CheckpointError
from tpumk.model import yarn
from tpumk.model.checkpoint import load_checkpoint
from tpumk.model.reference import forward_full, greedy_generate, init_cache

LOGIT_RTOL = 2e-5
PROMPTS = [[3, 141, 59, 26, 5], [300, 17, 222, 41, 9, 99, 6, 280, 2, 77, 31]]
STEPS = 12
PAGE = 4


def _max_err(got, want) -> float:
    want = np.asarray(want, np.float32)
    return float(np.max(np.abs(np.asarray(got, np.float32) - want)) / max(1.0, np.max(np.abs(want))))


def _tokens(seed=0, shape=(2, 14)):
    return np.random.default_rng(seed).integers(0, DEEPSEEK_V3_KW["vocab_size"], shape)


def _full(cfg, params, toks):
    return np.asarray(jax.jit(lambda p, t: forward_full(p, cfg, t))(params, jnp.asarray(toks, jnp.int32)))


@pytest.fixture(scope="module")
def loaded(hf_deepseek_dir):
    return load_checkpoint(hf_deepseek_dir)


def test_config_from_checkpoint(loaded):
    cfg, params = loaded
    assert cfg.is_mla and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                           cfg.v_head_dim) == (56, 40, 24, 8, 20)
    assert (cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert cfg.dense_layers == (0,) and cfg.router_correction_bias and cfg.yarn_factor == 4.0
    bias = params["layers"][1]["router_bias"]
    assert bias.dtype == jnp.float32 and float(jnp.abs(bias).max()) > 0.1


def test_yarn_matches_transformers(hf_deepseek_dir, loaded):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg, _ = loaded
    hf_cfg = AutoConfig.from_pretrained(hf_deepseek_dir)
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    np.testing.assert_allclose(yarn.inv_freq(cfg.positions, cfg.qk_rope_head_dim), inv.numpy(), rtol=1e-6)
    assert yarn.attention_factor(cfg.positions) == pytest.approx(factor, rel=1e-12) and factor != 1.0
    scaling = DeepseekV3Attention(hf_cfg, 0).scaling
    assert yarn.softmax_scale(cfg.attention, cfg.positions) == pytest.approx(scaling, rel=1e-12) and scaling != 32 ** -0.5


def test_forward_full_matches_transformers(hf_deepseek_dir, loaded):
    cfg, params = loaded
    toks = _tokens()
    err = _max_err(_full(cfg, params, toks), hf_logits(hf_deepseek_dir, toks))
    assert err < LOGIT_RTOL, err


def test_paged_greedy_matches_transformers(hf_deepseek_dir, loaded):
    """The absorbed decode step over the paged latent cache gives transformers' greedy tokens."""
    cfg, params = loaded
    want = hf_greedy(hf_deepseek_dir, PROMPTS, STEPS)
    got, cache = greedy_generate(params, cfg, PROMPTS, STEPS, init_cache(cfg, 2, 32, page_size=PAGE))
    assert got == want
    assert cache.k.shape[-1] == 128 and cache.v.shape[-1] == 0  # 40 latent + 8 roped lanes per token, lane-padded


@pytest.mark.parametrize("mutation", ["no_interleave_permutation", "no_bias", "no_groups", "no_scaling",
                                      "no_yarn_mscale"])
def test_each_feature_is_noticed(hf_deepseek_dir, loaded, tmp_path, mutation):
    """Dropping any one modelled feature on tpumk's side breaks the parity above."""
    cfg, params = loaded
    if mutation == "no_interleave_permutation":  # load as if the rows were already rotate-half
        config = json.loads((hf_deepseek_dir / "config.json").read_text())
        d = tmp_path / "c"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
        shutil.copy(hf_deepseek_dir / "model.safetensors", d / "model.safetensors")
        cfg, params = load_checkpoint(d)
    elif mutation == "no_bias":
        params = {**params, "layers": [{k: v for k, v in lay.items() if k != "router_bias"}
                                       for lay in params["layers"]]}
    elif mutation == "no_groups":
        cfg = cfg.replace(router_groups=1, router_topk_groups=1)
    elif mutation == "no_scaling":
        cfg = cfg.replace(routed_scaling_factor=1.0)
    else:
        cfg = cfg.replace(yarn_mscale=0.0, yarn_mscale_all_dim=0.0)
    toks = _tokens()
    assert _max_err(_full(cfg, params, toks), hf_logits(hf_deepseek_dir, toks)) > 50 * LOGIT_RTOL


@pytest.mark.parametrize("variant", [dict(q_lora_rank=None, rope_interleave=False),
                                     dict(n_group=1, topk_group=1, norm_topk_prob=False, first_k_dense_replace=2,
                                          rope_parameters=None, rope_theta=5000.0)])
def test_other_variants_match_transformers(tmp_path, variant):
    """A plain q projection with rotate-half rows; one group, unnormalised weights, no YaRN."""
    d = build_deepseek_checkpoint(tmp_path / "v", seed=5, **variant)
    cfg, params = load_checkpoint(d)
    if "q_lora_rank" in variant:
        assert cfg.q_lora_rank == 0 and "wq" in params["layers"][0]
    else:
        assert (cfg.router_groups, cfg.yarn_factor, cfg.norm_topk_prob, cfg.dense_layers) == (1, 0.0, False, (0, 1))
        assert cfg.rope_theta == 5000.0
    toks = _tokens(seed=1)
    err = _max_err(_full(cfg, params, toks), hf_logits(d, toks))
    assert err < LOGIT_RTOL, err


def test_cli_generate_from_the_checkpoint(hf_deepseek_dir):
    from click.testing import CliRunner

    from tpumk.cli import main

    r = CliRunner().invoke(main, ["generate", "--checkpoint", str(hf_deepseek_dir), "--prompt-ids", "3,141,59,26,5",
                                 "--steps", "6", "--backend", "reference", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == hf_greedy(hf_deepseek_dir, PROMPTS[:1], 6)


# ---------------------------------------------------------------------- the loader's DeepSeek-V3 names
def _copy_with(src: Path, dst: Path, tensors: dict[str, np.ndarray], config: dict | None = None) -> Path:
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_mtp_layer_is_skipped_and_other_extras_refused(hf_deepseek_dir, tmp_path):
    tensors = load_file(hf_deepseek_dir / "model.safetensors")
    mtp = {**tensors, "model.layers.3.eh_proj.weight": np.zeros((96, 192), np.float32),
           "model.layers.3.enorm.weight": np.ones(96, np.float32)}
    cfg, params = load_checkpoint(_copy_with(hf_deepseek_dir, tmp_path / "mtp", mtp))  # num_nextn_predict_layers 1
    assert len(params["layers"]) == cfg.num_layers == 3
    extra = {**tensors, "model.layers.4.eh_proj.weight": np.zeros((96, 192), np.float32)}
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.4\.eh_proj\.weight'"):
        load_checkpoint(_copy_with(hf_deepseek_dir, tmp_path / "extra", extra))


def test_missing_correction_bias_and_shared_expert_named(hf_deepseek_dir, tmp_path):
    tensors = load_file(hf_deepseek_dir / "model.safetensors")
    for i, name in enumerate(("model.layers.1.mlp.gate.e_score_correction_bias",
                              "model.layers.2.mlp.shared_experts.down_proj.weight",
                              "model.layers.0.self_attn.kv_a_layernorm.weight")):
        broken = {k: v for k, v in tensors.items() if k != name}
        with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
            load_checkpoint(_copy_with(hf_deepseek_dir, tmp_path / str(i), broken))


def test_fp8_config_with_float_tensors_loads_as_fp8_blocks(hf_deepseek_dir, tmp_path):
    """An MLA checkpoint declared fp8 whose tensors are float: loaded, then quantized to the
    fp8-b128 scheme it declares (wkv_b as the absorbed per-head blocks). FP8 tensors as the
    releases store them: tests/test_megakernel_mla_quant.py."""
    from tpumk.model.quantize import QuantizedMatrix, scheme_of

    config = json.loads((hf_deepseek_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    d = _copy_with(hf_deepseek_dir, tmp_path / "fp8", load_file(hf_deepseek_dir / "model.safetensors"), config)
    cfg, params = load_checkpoint(d)
    lay = params["layers"][0]
    assert scheme_of(params) == "fp8-b128" and "wkv_b" not in lay
    assert isinstance(lay["w_uk"], QuantizedMatrix) and lay["w_uk"].shape == (3, 24, 40)

