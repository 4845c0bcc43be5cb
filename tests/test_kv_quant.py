"""A KV cache in one byte per element (tpumk.model.kv_quant): the format's rounding bounds, the
reference decode step writing it (codes and scales of the first layer equal to quantizing the
model-dtype cache's rows, bit for bit), what it costs in logits, and `tpumk quality --kv-dtype`.
The megakernel does not take this format yet: these are the reference's checks the kernel will
be held to."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from tpumk.cli.app import main
from tpumk.errors import ConfigError
from tpumk.model import kv_quant
from tpumk.model import reference as ref
from tpumk.model.config import load_preset
from tpumk.model.quantize import relative_rms
from tpumk.model.weights import random_params

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_rows_round_trip_within_the_format_s_rounding(name):
    fmt = kv_quant.kv_format(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4, 64)).astype(np.float32) * rng.uniform(0.01, 30, (3, 5, 4, 1))
    x[1, 2, 3] = 0.0  # a row of zeros reads back as zeros
    codes, scales = kv_quant.quantize_rows(jnp.asarray(x), fmt)
    assert codes.dtype == fmt.dtype and codes.shape == x.shape and scales.shape == x.shape[:-1]
    back = np.asarray(kv_quant.dequantize_rows(codes, scales, jnp.float32))
    amax = np.abs(x).max(-1, keepdims=True)
    assert np.array_equal(back[1, 2, 3], np.zeros(64)) and float(scales[1, 2, 3]) == 0.0
    # every row's largest element maps to the top code, so the scale is exactly amax / qmax
    np.testing.assert_allclose(np.asarray(scales), amax[..., 0] / fmt.qmax, rtol=1e-6)
    err = np.abs(back - x)
    if name == "int8":  # uniform steps of amax / 127: at most half a step off
        assert np.all(err <= amax / 127 / 2 * (1 + 1e-5))
    else:  # e4m3: 3 mantissa bits, half an ulp relative (2^-4) above the subnormals (2^-6 x scale)
        normal = np.abs(x) >= 2.0 ** -6 * amax / 448
        assert np.all(err[normal] <= np.abs(x[normal]) * 2.0 ** -4 * (1 + 1e-5))
        assert np.all(err[~normal] <= 2.0 ** -10 * amax.repeat(64, -1)[~normal] / 448)


def test_unknown_format_is_one_line():
    with pytest.raises(ConfigError, match=r"--kv-dtype: unknown KV cache format 'fp4' \(expected one of fp8, int8\)"):
        kv_quant.kv_format("fp4")


def test_bytes_per_token_halve_the_cache():
    """qwen3-8b (8 kv heads of 128, 36 layers, bfloat16): 132 bytes per head and tensor against
    256, 0.516 of the bfloat16 cache (issue 29's bar is 0.52)."""
    cfg = load_preset("qwen3-8b")
    bf16 = kv_quant.cache_bytes_per_token(cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, None)
    fp8 = kv_quant.cache_bytes_per_token(cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, kv_quant.kv_format("fp8"))
    assert bf16 == 36 * 2 * 8 * 256 and fp8 == 36 * 2 * 8 * 132
    assert fp8 / bf16 == pytest.approx(0.5156, abs=1e-4) and fp8 / bf16 <= 0.52


def _prefill(cfg, params, kv_dtype):
    cache = ref.init_cache(cfg, len(PROMPTS), 32, page_size=8, kv_dtype=kv_dtype)
    return ref.prefill(params, cfg, PROMPTS, cache)


@pytest.mark.parametrize("preset, kv_dtype", [("tiny-dense", "fp8"), ("tiny-dense", "int8"), ("tiny-mla", "fp8")])
def test_reference_writes_codes_and_scales_of_its_rows(preset, kv_dtype):
    """The first layer's K/V rows depend only on the tokens, so the quantized cache's layer 0
    must hold exactly quantize_rows of the model-dtype cache's layer-0 rows, at the same pages
    and slots; every slot no token wrote stays zero. The logits stay close to the model-dtype
    cache's and pick the same greedy tokens."""
    cfg = load_preset(preset).replace(dtype="bfloat16")
    params = random_params(cfg, seed=3)
    lf, cf = _prefill(cfg, params, None)
    lq, cq = _prefill(cfg, params, kv_dtype)
    assert isinstance(cq, ref.QuantizedKVCache) and np.array_equal(cq.lengths, cf.lengths)
    fmt = kv_quant.kv_format(kv_dtype)
    heads = 1 if cfg.is_mla else cfg.num_kv_heads
    pairs = [(cf.k, cq.k, cq.k_scale)] + ([] if cfg.is_mla else [(cf.v, cq.v, cq.v_scale)])
    for rows, codes, scales in pairs:
        assert codes.dtype == fmt.dtype and scales.shape == codes.shape[:3] + (heads,)
        want_codes, want_scales = kv_quant.quantize_rows(rows[0].reshape(*rows.shape[1:3], heads, -1), fmt)
        assert np.array_equal(np.asarray(codes[0]).view(np.uint8), np.asarray(want_codes.reshape(codes.shape[1:])).view(np.uint8))
        assert np.array_equal(np.asarray(scales[0]), np.asarray(want_scales))
        written = np.asarray(scales[0]).any(-1)
        assert written.sum() == sum(len(p) for p in PROMPTS)  # one row per prompt token, nothing else
    assert relative_rms(lq, lf) < (0.05 if kv_dtype == "fp8" else 0.01)
    assert np.array_equal(np.argmax(lq, -1), np.argmax(lf, -1))


def test_a_decode_step_after_prefill_keeps_the_format():
    cfg = load_preset("tiny-moe").replace(dtype="bfloat16")
    params = random_params(cfg, seed=4)
    last, cache = _prefill(cfg, params, "int8")
    tok = jnp.argmax(last, -1).astype(jnp.int32)[:, None]
    logits, cache = ref.decode_step(params, cfg, tok, cache.lengths[:, None], cache)
    assert isinstance(cache, ref.QuantizedKVCache) and cache.k.dtype == jnp.int8
    assert list(np.asarray(cache.lengths)) == [len(p) + 1 for p in PROMPTS]
    assert np.isfinite(np.asarray(logits)).all()


def test_quality_command_reports_the_kv_formats():
    r = CliRunner().invoke(main, ["quality", "--model", "tiny-dense", "--dtype", "bfloat16", "--steps", "2",
                                  "--quant", "", "--kv-dtype", "fp8,int8", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["schemes"] == [] and [k["kv_dtype"] for k in out["kv_formats"]] == ["fp8", "int8"]
    cfg = load_preset("tiny-dense")
    for row in out["kv_formats"]:
        assert row["kv_bytes_vs_model_dtype"] == pytest.approx((cfg.head_dim + 4) / (2 * cfg.head_dim))
        assert 0 < row["logit_relative_rms"] < 0.05 and row["greedy_agreement"] >= 0.9
    rows = {k["kv_dtype"]: k for k in out["kv_formats"]}
    assert rows["int8"]["logit_relative_rms"] < rows["fp8"]["logit_relative_rms"]  # 7 bits of step against 3 of mantissa
    text = CliRunner().invoke(main, ["quality", "--model", "tiny-dense", "--steps", "1", "--quant", "int8",
                                     "--kv-dtype", "fp8"])
    assert text.exit_code == 0 and "fp8 (float weights)" in text.output and "bytes / float32 cache" in text.output


@pytest.mark.parametrize("args, needle", [
    (["--kv-dtype", "fp4"], "--kv-dtype: unknown KV cache format 'fp4'"),
    (["--kv-dtype", "fp8,fp8"], "--kv-dtype: fp8 given twice"),
    (["--quant", ""], "expected at least one scheme (or a --kv-dtype)"),
])
def test_bad_kv_dtype_is_one_line(args, needle):
    r = CliRunner().invoke(main, ["quality", "--model", "tiny-dense", *args])
    assert r.exit_code == 1 and needle in r.stderr and r.stderr.strip().count("\n") == 0, r.output
