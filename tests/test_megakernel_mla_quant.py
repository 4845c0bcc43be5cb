"""Quantized weights of MLA models in the megakernel (issue 15 with issue 14's formats).

The ring streams an MLA layer's wq_a / wq_b (or wq), wkv_a and wo in the ring format and wkv_b
as its absorbed per-head blocks `w_uk` / `w_uv`, quantized block by block
(tpumk.model.quantize); the reference computes with the same quantized weights, so the kernel
(interpret mode, race detector) is checked against it to float tolerance for int8, fp8-b128
and int4 (int8 ring, int4-g128 experts), q_len 1 and the verify step's q_len 3, and every build
compiles deviceless for TPU7x (the kernel cases for v6e too). An FP8 DeepSeek-V3 checkpoint in the official format
(a transformers DeepseekV3ForCausalLM quantized to e4m3 blocks here) loads bit for bit and
gives the reference's greedy tokens through the megakernel.

Model: tiny-mla with hidden and expert widths of one 128-lane tile (the MLA widths stay odd:
q_lora 56, latent 40, nope 24, rope 8, value 20; fp8-b128 needs value 128, see `_check_mla`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_megakernel import CONTEXT, PAGE, assert_cache_equal, assert_logits_close, prompts_of, races_found
from tpumk.errors import NotSupportedError
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import mla
from tpumk.model import reference as R
from tpumk.model.config import load_preset, resolve_model
from tpumk.model.quantize import (FORMATS, QuantizedMatrix, parse_scheme, quantize_params, quantized_specs,
                                  quantized_weight_bytes, relative_rms, scheme_of)
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

ALIGNED = dict(hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128)


@functools.lru_cache(maxsize=None)
def model(dtype: str, v_head_dim: int = 20):
    cfg = load_preset("tiny-mla").replace(name=f"tiny-mla-128-{dtype}-v{v_head_dim}", dtype=dtype,
                                          v_head_dim=v_head_dim, **ALIGNED)
    return cfg, random_params(cfg, seed=2)


@functools.lru_cache(maxsize=None)
def reference_step(cfg):
    return R.jitted_decode_step(cfg)


def _leaf_bytes(cfg, params) -> int:
    """HBM bytes of reference-layout weights as stored: codes at their format's size, f32 scales,
    every float tensor in its own dtype."""
    total = 0
    for a in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedMatrix)):
        if isinstance(a, QuantizedMatrix):
            fmt = next(f for f in FORMATS.values() if jnp.dtype(f.jnp_dtype) == jnp.dtype(a.q.dtype))
            total += int(a.q.size * fmt.itemsize) + 4 * a.scale.size
        else:
            total += a.size * a.dtype.itemsize
    return total


# ---------------------------------------------------------------------- the quantized reference
@pytest.mark.parametrize("scheme", ["int8", pytest.param("fp8-b128", marks=pytest.mark.full), "int4"])
def test_quantize_params_covers_the_mla_matrices(scheme):
    """Every matrix the ring streams is quantized (wkv_b as its absorbed per-head blocks, each
    head's block on its own); norms, router and bias stay float; the byte count, the specs and
    the dequantized blocks agree with the weights themselves."""
    cfg, params = model("float32", 128 if scheme == "fp8-b128" else 20)
    qp = quantize_params(cfg, params, scheme)
    s = parse_scheme(scheme)
    assert scheme_of(qp) == scheme
    hq, n, c, v = cfg.num_q_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    for lay, flt in zip(qp["layers"], params["layers"]):
        assert "wkv_b" not in lay
        for k in ("wq_a", "wq_b", "wkv_a", "wo", "w_uk", "w_uv"):
            assert isinstance(lay[k], QuantizedMatrix) and jnp.dtype(lay[k].q.dtype) == jnp.dtype(s.ring.jnp_dtype), k
        assert lay["w_uk"].shape == (hq, n, c) and lay["w_uv"].shape == (hq, c, v)
        # per head block: per-column scales [Hq, cols], or [Hq, 128-row groups, cols]
        assert lay["w_uk"].scale.shape == ((hq, 1, c) if s.ring.group else (hq, c))
        for k in ("attn_norm", "mlp_norm", "q_a_norm", "kv_a_norm", "router", "router_bias"):
            assert k not in lay or not isinstance(lay[k], QuantizedMatrix), k
        # the blocks are W_UK^T / W_UV of the float wkv_b, up to the format's rounding
        w_uk, w_uv = mla.absorbed_weights(cfg, flt)
        assert relative_rms(lay["w_uk"].dequantized(), w_uk) < 0.04
        assert relative_rms(lay["w_uv"].dequantized(), w_uv) < 0.04
        if "e_gate" in lay and s.experts is not None:
            assert jnp.dtype(lay["e_gate"].q.dtype) == jnp.dtype(s.experts.jnp_dtype)
    # the closed-form byte count (HBM check, plan) is the stored bytes exactly
    assert quantized_weight_bytes(cfg, scheme) == _leaf_bytes(cfg, qp)
    assert quantized_weight_bytes(cfg, scheme) < quantized_weight_bytes(cfg, "none")
    # the specs of a deviceless build describe the same pytree
    specs = quantized_specs(cfg, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), scheme)
    same = jax.tree.map(lambda a, b: (tuple(a.shape), jnp.dtype(a.dtype)) == (tuple(b.shape), jnp.dtype(b.dtype)),
                        specs, qp)
    assert all(jax.tree.leaves(same))
    # the reference computes with them: close to the float model, but not equal to it
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    prompt = prompts_of([9], cfg.vocab_size)
    lf, _ = R.prefill(params, cfg, prompt, cache, step_fn=reference_step(cfg))
    lq, _ = R.prefill(qp, cfg, prompt, cache, step_fn=reference_step(cfg))
    # (int8 / e4m3: a few percent; int4-g128 experts, 15 levels per group: about 0.1)
    assert 1e-4 < relative_rms(lq, lf) < (0.2 if s.experts is not None and s.experts.bits == 4 else 0.1)


# ---------------------------------------------------------------------- the kernel against it
# int8 and int4 on MLA are the full tier: fp8-b128 (DeepSeek's own format) runs the quantized
# MLA path here, int8 and int4 kernels run on tiny-moe in tests/test_quant.py, and
# test_quantize_params_covers_the_mla_matrices quantizes MLA's matrices in each scheme.
@pytest.mark.parametrize("scheme, dtype, v_head_dim, lengths, q_len", [
    pytest.param("int8", "float32", 20, [15, 33], 1, id="int8-f32-b2-q1", marks=pytest.mark.full),
    pytest.param("fp8-b128", "bfloat16", 128, [16, 31], 3, id="fp8b128-bf16-b2-q3"),  # each tile's scales stream beside it
    pytest.param("int4", "float32", 20, [7], 3, id="int4-f32-b1-q3", marks=pytest.mark.full),  # int8 ring, int4-g128 experts
])
def test_kernel_matches_the_quantized_reference_and_compiles(scheme, dtype, v_head_dim, lengths, q_len):
    cfg, params = model(dtype, v_head_dim)
    qp = quantize_params(cfg, params, scheme)
    batch, tuning = len(lengths), TuningConfig()
    spec = BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE, quant=scheme)
    plan = make_plan(spec)
    fmt = parse_scheme(scheme).ring
    for name in ("q_a", "q_b", "kv_a", "uk", "uv", "o"):  # every MLA family streams the ring format
        assert plan.families[name].itemsize == 1 and plan.families[name].group == fmt.group
    assert plan.contract.operand("uk").dtype == fmt.dtype
    assert ("scales_uk" in [b.name for b in plan.contract.operands]) == bool(fmt.group)
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(qp, cfg, prompts_of(lengths, cfg.vocab_size), cache, step_fn=reference_step(cfg))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]

    logits, new_cache = make_decode_step(plan, detect_races=True)(pack_weights(plan, qp), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want, want_cache = reference_step(cfg)(qp, tokens, positions, cache)
    assert_logits_close(logits, want, dtype)  # f32: 1e-5 of the largest logit; bf16: 2^-6
    assert_cache_equal(new_cache, want_cache, dtype)
    # the tolerance separates the quantized model from the float one (the scales matter)
    flt, _ = reference_step(cfg)(params, tokens, positions, cache)
    assert float(jnp.max(jnp.abs(flt - want))) > 2 * (1e-5 if dtype == "float32" else 2 ** -6) * \
        float(jnp.max(jnp.abs(want)))
    compile_for_tpus_quant(cfg, batch, q_len, tuning, scheme, v6e=True)


def compile_for_tpus_quant(cfg, batch, q_len, tuning, scheme, v6e: bool = False):
    """compile_for_tpus with a weight scheme: one tpu_custom_call for TPU7x (and v6e)."""
    from tpumk.compile.aot import compile_plan

    for target in ("tpu7x", "v6e") if v6e else ("tpu7x",):
        plan = make_plan(BuildSpec(cfg, get_target(target), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE,
                                   quant=scheme))
        assert compile_plan(plan).custom_calls == 1, f"{target}: expected exactly one tpu_custom_call"


# ---------------------------------------------------------------------- plan figures and refusals
@pytest.mark.parametrize("scheme", ["fp8", "fp8-b128"])
def test_reduced_deepseek_plan_counts_the_quantized_mla_matrices(scheme):
    """The reduced DeepSeek-V3 (the public widths, 4 layers): every MLA family streams 1-byte
    codes, so its ring bytes halve against bf16 with the same padded matrices; the scales are
    counted (column scales: uk / uv per head block in the layer's scale row; group scales: one
    scale tile per weight tile, in the DMA list too)."""
    cfg = resolve_model("benchmarks/deepseek-v3-reduced.toml")
    # (the default knobs need 59.3 MiB of VMEM even in bf16; the column-scaled ring's per-layer
    # scale row adds 11 MiB for 128 heads' uk / uv blocks, hence two expert slots)
    tuning = TuningConfig(ring_depth=4, expert_slots=2)
    hq, c, v = cfg.num_q_heads, cfg.kv_lora_rank, cfg.v_head_dim
    base = make_plan(BuildSpec(cfg, get_target("tpu7x"), tuning=tuning))
    q = make_plan(BuildSpec(cfg, get_target("tpu7x"), tuning=tuning, quant=scheme))
    for name in ("q_a", "q_b", "kv_a", "uk", "uv", "o"):
        f, b = q.families[name], base.families[name]
        assert q.dmas[f"ring_{name}"]["count"] * f.tile_bytes == q.hbm[f"weights_{name}"]
        assert q.hbm[f"weights_{name}"] == cfg.num_layers * (f.k_pad * f.m_pad if not f.diagonal else
                                                             hq * f.tile_rows * f.tile_cols)
        if name != "o":  # (o's auto 2048-wide tiles pad H = 7168 to 8192 columns, as any family's)
            assert (f.k_pad, f.m_pad, f.diagonal) == (b.k_pad, b.m_pad, b.diagonal)
            assert 2 * q.hbm[f"weights_{name}"] == base.hbm[f"weights_{name}"]
    if scheme == "fp8":
        assert q.scale_offsets["uv"] - q.scale_offsets["uk"] == hq * c  # uk's column scales, head by head
        assert q.scales_width >= hq * (c + v) + cfg.hidden_size
    else:
        uk = q.families["uk"]
        assert q.dmas["ring_uk_scales"]["count"] == cfg.num_layers * hq
        assert uk.scale_tile_bytes == 8 * c * 4  # one group of 128 nope rows, padded to 8 rows
        assert q.hbm["weight_scales"] == sum(q.dmas[k]["count"] * q.dmas[k]["bytes_each"]
                                             for k in q.dmas if k.endswith("_scales"))
    ring = sum(b for k, b in base.hbm.items() if k.startswith("weights_"))  # bf16 ring bytes per step
    assert base.hbm_bytes - q.hbm_bytes > 0.45 * ring  # the ring halves; its scales cost little


def test_block_scaled_ring_needs_whole_value_groups():
    cfg, _ = model("bfloat16")  # v_head_dim 20: o's 128-row groups would straddle heads
    with pytest.raises(NotSupportedError, match=r"v_head_dim = 20: --quant fp8-b128 .* needs a multiple of 128") as e:
        make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 4096, quant="fp8-b128"))
    assert "\n" not in str(e.value)
    make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 4096, quant="ring=int8,experts=fp8-b128"))  # experts only: fine


# ---------------------------------------------------------------------- an FP8 DeepSeek-V3 checkpoint
@pytest.fixture(scope="module")
def fp8_deepseek_dir(tmp_path_factory):
    """A transformers DeepseekV3ForCausalLM (YaRN, interleaved RoPE, q-LoRA, group-limited routing
    with a correction bias, one dense layer with an 80-wide FFN: a partial 128-row group),
    hidden, experts and value heads 128 wide, rewritten in the official FP8 format (every
    projection incl. q_a / q_b / kv_a_proj_with_mqa / kv_b_proj in e4m3 128 x 128 blocks)."""
    from hf_utils import build_deepseek_checkpoint, fp8_checkpoint

    src = build_deepseek_checkpoint(tmp_path_factory.mktemp("ds_src"), seed=3, hidden_size=128,
                                    moe_intermediate_size=128, v_head_dim=128)
    return fp8_checkpoint(src, tmp_path_factory.mktemp("ds_fp8"))


def _stored(d, name):
    import torch
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as h:  # numpy has no e4m3 reader
        w = h.get_tensor(name + ".weight").view(torch.uint8).numpy()
        s = h.get_tensor(name + ".weight_scale_inv").numpy()
    return w, s


@pytest.mark.full  # fp8 checkpoints load as stored: test_quant.py's [fp8_dense_dir]; MLA's block scales in the kernel: [fp8b128-bf16-b2-q3]
def test_fp8_deepseek_checkpoint_loads_as_stored_and_runs_the_megakernel(fp8_deepseek_dir):
    from test_quant import _dequantized_float
    from tpumk.decode.generate import generate, load_model
    from tpumk.model.checkpoint import load_checkpoint

    d = fp8_deepseek_dir
    cfg, params = load_checkpoint(d)
    assert scheme_of(params) == "fp8-b128"
    hq, n, c, v = cfg.num_q_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    lay = params["layers"][1]
    # kv_b_proj [Hq*(N+V), C] -> w_uk [Hq, N, C] (rows as stored) and w_uv [Hq, C, V]: codes bit for bit
    w, s = _stored(d, "model.layers.1.self_attn.kv_b_proj")
    heads = w.reshape(hq, n + v, c)
    assert np.array_equal(np.asarray(lay["w_uk"].q).view(np.uint8), heads[:, :n])
    assert np.array_equal(np.asarray(lay["w_uv"].q).view(np.uint8), heads[:, n:].transpose(0, 2, 1))
    row_scales = np.repeat(s, 128, axis=0)[:hq * (n + v)].reshape(hq, n + v, -1)  # each stored row's block scale
    np.testing.assert_array_equal(np.asarray(lay["w_uv"].scale), row_scales[:, n:].transpose(0, 2, 1))
    # one scale per (128 nope rows, latent column): exactly the stored scale of every nope row
    col_scales = np.repeat(row_scales, 128, axis=-1)[..., :c]  # [Hq, N+V, C]
    for i in range(n):
        np.testing.assert_array_equal(np.asarray(lay["w_uk"].scale)[:, 0, :], col_scales[:, i, :])
    # q_b_proj: its roped rows are permuted (interleaved -> rotate-half) with their scales
    w, s = _stored(d, "model.layers.1.self_attn.q_b_proj")
    got = lay["wq_b"]
    deq = np.asarray(got.dequantized())
    full = w.view(jnp.float8_e4m3fn).astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
    perm = np.arange(w.shape[0]).reshape(hq, -1)
    r = cfg.qk_rope_head_dim
    perm[:, -r:] = np.concatenate([perm[:, -r:][:, 0::2], perm[:, -r:][:, 1::2]], 1)
    np.testing.assert_array_equal(deq, full[perm.reshape(-1)].T)
    # the reference on the stored weights = the reference on their float dequantization
    prompts = [[3, 17, 42, 7, 99], [250, 1, 64]]
    flt = _dequantized_float(cfg, params)  # w_uk / w_uv as float blocks (the reference takes either)
    want, _ = R.prefill(flt, cfg, prompts, R.init_cache(cfg, 2, 64))
    got_l, _ = R.prefill(params, cfg, prompts, R.init_cache(cfg, 2, 64))
    np.testing.assert_allclose(got_l, want, rtol=0, atol=2e-4 * float(jnp.max(jnp.abs(want))))
    # the megakernel (interpret mode) generates the reference's greedy tokens
    m = load_model(None, str(d))
    assert m.quant == "fp8-b128" and "fp8-b128 as stored" in m.source
    got = generate(m, prompts, 5, backend="megakernel")
    assert "megakernel" in got["ran_on"]
    assert got["tokens"] == generate(m, prompts, 5, backend="reference")["tokens"]
    compile_for_tpus_quant(m.cfg, 2, 1, TuningConfig(), "fp8-b128")


def test_fp8_kv_b_whose_heads_straddle_scale_blocks_is_refused(tmp_path):
    """N + V = 60 puts head 2's nope rows [120, 160) across two stored 128-row blocks: one scale
    per 128 nope rows cannot hold them without re-quantizing, so the load is refused."""
    from hf_utils import build_deepseek_checkpoint, fp8_checkpoint
    from tpumk.model.checkpoint import load_checkpoint

    src = build_deepseek_checkpoint(tmp_path / "src", seed=1, qk_nope_head_dim=40, v_head_dim=20)
    with pytest.raises(NotSupportedError, match="kv_b_proj.weight': a head's W_UK rows straddle two 128-row") as e:
        load_checkpoint(fp8_checkpoint(src, tmp_path / "fp8"))
    assert "\n" not in str(e.value)
