"""A sparse-attention model's 1-byte KV cache (`--kv-dtype fp8`, issue 57): the index-key cache
in float8_e4m3fn codes with a power-of-two float32 scale per key (tpumk.model.sparse_attention.
QuantizedIndexKeys) beside the 1-byte latent cache (tpumk.model.kv_quant), in the reference.
The megakernel refuses the combination in one line (tests/test_hf_sparse_mla.py).

The model is test_megakernel_sparse's: tiny-mla with an 8-head, 32-lane indexer and top 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.errors import NotSupportedError
from tpumk.model import kv_quant, sparse_attention
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params

SPARSE = dict(hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128, index_topk=4, index_heads=8,
              index_head_dim=32)
E4M3_STEP = 2.0 ** -4  # e4m3's relative rounding bound for a normal code (3 mantissa bits)
E4M3_SUBNORMAL = 2.0 ** -10  # its absolute bound below the smallest normal (2^-6), in units of the scale


def model_config(dtype: str = "float32"):
    return load_preset("tiny-mla").replace(name=f"tiny-dsa-{dtype}", dtype=dtype, **SPARSE)


@functools.lru_cache(maxsize=None)
def model(dtype: str = "float32"):
    cfg = model_config(dtype)
    return cfg, random_params(cfg, seed=2)


def test_fp8_index_keys_score_and_select_as_the_model_dtype_ones():
    """Index keys written to and read back from the 1-byte cache (layer 1 of 2, shuffled pages):
    codes float8_e4m3fn, each key's scale the smallest power of two with max|k| / scale <= 448
    (so the largest code is in (224, 448]), every lane within e4m3's rounding of the bfloat16 key.
    The scores from them differ from the bfloat16 keys' by no more than that rounding allows
    (ReLU is 1-Lipschitz: |ds| <= sum_h |w_h| Di^-0.5 sum_d |q_hd| |dk_d|), and differ (the keys
    were rounded); 60 queries' top 16 of 256 keys are mostly the same picks. (The indexer's own
    weights only, random: the scores' arithmetic is what is checked.)"""
    cfg = model_config("bfloat16").replace(index_topk=16)
    a, di, page, ctx, b, t = cfg.attention, cfg.attention.index_head_dim, 16, 256, 1, 60
    rng = np.random.default_rng(3)
    layer = {"idx_wq": jnp.asarray(rng.standard_normal((cfg.q_lora_rank, a.index_heads * di)) * 0.1, jnp.bfloat16),
             "idx_weights": jnp.asarray(rng.standard_normal((cfg.hidden_size, a.index_heads)) * 0.1, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), jnp.bfloat16)
    q_lat = jnp.asarray(rng.standard_normal((b, t, cfg.q_lora_rank)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((b, ctx, di)) * rng.uniform(0.01, 3, (b, ctx, 1)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(ctx // page)[None], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))

    @jax.jit
    def run(keys):
        slots = jnp.arange(ctx, dtype=jnp.int32)[None]
        empty = sparse_attention.init_index_keys(cfg, ctx // page, page, "fp8")
        cache = sparse_attention.QuantizedIndexKeys(*(jnp.concatenate([c, c]) for c in empty))  # 2 layers
        cache = sparse_attention.write_index_keys(cache, 1, tables[0][slots // page], slots % page, keys)
        read = sparse_attention.read_index_keys(cache, 1, tables, jnp.bfloat16)
        scores = [sparse_attention.index_scores(cfg, layer, x, q_lat, positions, k) for k in (keys, read)]
        visible = jnp.ones((b, t, ctx), bool)
        picks = [sparse_attention.select(cfg, s, visible) for s in scores]
        return (cache, read, scores, picks, sparse_attention.index_queries(cfg, layer, x, q_lat, positions),
                sparse_attention.head_weights(cfg, layer, x))

    cache, read, (want, got), (pw, pg), q, w = run(keys)
    assert cache.codes.dtype == jnp.float8_e4m3fn and cache.scales.dtype == jnp.float32
    assert not np.any(np.asarray(cache.codes[0], np.float32)) and not np.any(np.asarray(cache.scales[0]))
    assert read.shape == keys.shape and read.dtype == jnp.bfloat16
    k = np.asarray(keys, np.float32)[0]
    scale = np.asarray(cache.scales[1][tables[0]], np.float32).reshape(ctx)
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two
    top = np.abs(k).max(-1) / scale
    assert np.all(top <= 448) and np.all(top > 224)
    err = np.abs(np.asarray(read, np.float32)[0] - k)
    assert np.all(err <= np.maximum(E4M3_STEP * np.abs(k), E4M3_SUBNORMAL * scale[:, None]))

    q, w = np.asarray(q, np.float32)[0], np.asarray(w)[0]  # [t, Hi, Di], [t, Hi]
    want, got = np.asarray(want)[0], np.asarray(got)[0]
    bound = np.einsum("th,thd,sd->ts", np.abs(w), np.abs(q), err) * di ** -0.5
    diff = np.abs(got - want)
    assert np.all(diff <= bound * (1 + 1e-3) + 1e-6 * np.abs(want).max()), float((diff - bound).max())
    assert diff.max() > 0
    overlap = (np.asarray(pw) & np.asarray(pg))[0].sum(-1) / cfg.index_topk
    assert overlap.mean() >= 0.9 and overlap.min() >= 0.75, overlap


@functools.lru_cache(maxsize=None)
def _step(cfg):
    return R.jitted_decode_step(cfg)


def _run(cfg, params, prompt, nxt, kv_dtype):
    """The prompt in one step, then one more token: logits of both, the cache after."""
    cache = R.init_cache(cfg, 1, 32, 16, kv_dtype=kv_dtype)
    step = _step(cfg)
    first, cache = step(params, jnp.asarray([prompt], jnp.int32), jnp.arange(len(prompt), dtype=jnp.int32)[None],
                        cache)
    second, cache = step(params, jnp.asarray([[nxt]], jnp.int32), jnp.asarray([[len(prompt)]], jnp.int32), cache)
    return np.asarray(first[0], np.float32), np.asarray(second[0, 0], np.float32), cache


@pytest.mark.full  # (about 35 s: random weights and four reference compiles) tests/README.md: the default cover
def test_a_step_writes_fp8_index_keys_and_the_logits_stay_close():
    """A 13-token prompt (more keys than the top 4) in one step, then one decode step, with
    --kv-dtype fp8 against the float32 caches: layer 0's index keys (from the embeddings alone,
    so the same in both runs) stored as exactly the codes and scales of the float32 keys, at the
    14 positions the steps wrote and nowhere else; the latent cache 1-byte. Logits: at least 12
    of the 14 rows within 4 % relative RMS of the float32 caches' (the 1-byte latent's own error
    on the dense model here: 1.3-2.4 % a row; measured 1.3-3.5 %), the others rows where a pick
    moved (measured: 2 rows, 19 and 30 %), each still closer than dense attention's logits
    (23-68 %: the selection matters)."""
    cfg, params = model("float32")
    prompt, nxt = [int(v) for v in np.random.default_rng(4).integers(0, cfg.vocab_size, 13)], 7
    f1, f2, fcache = _run(cfg, params, prompt, nxt, None)
    q1, q2, qcache = _run(cfg, params, prompt, nxt, "fp8")
    assert isinstance(qcache, R.QuantizedKVCache) and isinstance(qcache.index_keys, sparse_attention.QuantizedIndexKeys)
    tables = np.asarray(qcache.block_tables[0])
    codes, scales = kv_quant.quantize_rows(fcache.index_keys[0][tables].reshape(32, 1, -1), kv_quant.KV_FORMATS["fp8"])
    got_codes = np.asarray(qcache.index_keys.codes[0][tables].reshape(32, -1), np.float32)
    got_scales = np.asarray(qcache.index_keys.scales[0][tables].reshape(32))
    np.testing.assert_array_equal(got_codes, np.asarray(codes, np.float32).reshape(32, -1))
    np.testing.assert_array_equal(got_scales, np.asarray(scales).reshape(32))
    assert np.all(got_scales[:14] > 0) and not np.any(got_scales[14:]) and not np.any(got_codes[14:])
    assert qcache.kv.dtype == jnp.float8_e4m3fn

    def rel(a, b):  # per row
        return np.sqrt(np.mean((a - b) ** 2, -1)) / np.sqrt(np.mean(b ** 2, -1))

    err = rel(np.concatenate([q1, q2[None]]), np.concatenate([f1, f2[None]]))
    dense = cfg.replace(index_topk=0, index_heads=0, index_head_dim=0)
    d1, d2, _ = _run(dense, params, prompt, nxt, None)
    apart = rel(np.concatenate([d1, d2[None]]), np.concatenate([f1, f2[None]]))[4:]  # (rows 0-3 see <= 4 keys)
    assert np.sum(err <= 0.04) >= 12 and np.all(err[4:] < apart), (err, apart)


def test_int8_is_refused_in_one_line():
    """The index-key cache has a 1-byte form in fp8 only: --kv-dtype int8 on a sparse model is
    refused by the reference's cache (and so by tpumk generate and quality) in one line."""
    cfg = model_config()
    with pytest.raises(NotSupportedError, match=r"^model 'tiny-dsa-float32': --kv-dtype int8 with sparse attention "
                                                r"\(index_topk\) is not built: its index-key cache has a 1-byte form "
                                                r"in fp8 only \(--kv-dtype fp8\)$"):
        R.init_cache(cfg, 1, 32, 16, kv_dtype="int8")
