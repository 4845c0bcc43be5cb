"""DeepSeek Sparse Attention in the megakernel (issue 57; tpumk.kernel.sparse_attention): one
decode step against the reference (tpumk.model.sparse_attention) in interpret mode with the race
detector, each build also compiled deviceless for TPU7x and v6e; the plan's byte counts.
transformers' greedy tokens through the megakernel: tests/test_hf_sparse_mla.py.

The model is tiny-mla (hidden and experts 128 wide for the kernel's lane tiles) with
DeepSeek-V3.2's indexer shape scaled down: 8 heads of 32 lanes (the first 8 roped), top 4; GLM-5's
(full tier): 16-lane heads with interleaved rope pairs, top 6, layer 1 reusing layer 0's picks.
The cache before the step holds random latent rows and index keys (every row a token wrote),
so each query picks 4 of 21 .. 40 keys. Ties: `jax.lax.top_k` keeps the lower position of equal
scores and the kernel does too, but a near-tie at the k-th score could go either way under a
different summation order, so each case checks its k-th and (k+1)-th index scores are at least
TIE_GAP apart (`selection_gap`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_megakernel import PAGE, assert_logits_close, races_found
from tpumk.compile.aot import compile_for
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step, step_specs
from tpumk.model import mla, sparse_attention
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.ops import rms_norm
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

CONTEXT = 64
SPARSE = dict(hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128, index_topk=4, index_heads=8,
              index_head_dim=32)
DENSE = dict(index_topk=0, index_heads=0, index_head_dim=0)
TIE_GAP = 1e-4  # float32 scores of 8 heads x 32 terms of size ~1: rounding ~1e-6


# GLM-5's indexer: layer 1 keeps layer 0's selection, 16-lane heads with interleaved rope pairs, top 6
GLM = dict(index_shared_layers=(1,), index_rope_interleave=True, index_head_dim=16, index_topk=6)


@functools.lru_cache(maxsize=None)
def model(dtype: str, glm: bool = False, v_head_dim: int | None = None):
    """v_head_dim: tiny-mla's 20 unless given (fp8-b128 needs 128: `plan._check_mla`)."""
    cfg = load_preset("tiny-mla").replace(name=f"tiny-dsa-{dtype}", dtype=dtype, **SPARSE)
    if glm:
        cfg = cfg.replace(name=f"tiny-glm-dsa-{dtype}", **GLM)
    if v_head_dim is not None:
        cfg = cfg.replace(name=f"{cfg.name}-v{v_head_dim}", v_head_dim=v_head_dim)
    return cfg, random_params(cfg, seed=2)


@functools.lru_cache(maxsize=None)
def reference_step(cfg):
    """The reference step, with every layer's input tapped (for `selection_gap`)."""
    return R.jitted_decode_step(cfg, taps=tuple(range(cfg.num_layers)))


def random_cache(cfg, lengths, seed: int = 5, context: int = CONTEXT) -> R.KVCache:
    """A cache whose first lengths[b] positions hold random latent rows (pad lanes zero) and index
    keys in the model dtype, over shuffled pages."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    cache = R.init_cache(cfg, batch, context, PAGE)
    tables = rng.permutation(cache.block_tables.size).reshape(cache.block_tables.shape)
    k, keys = np.zeros(cache.k.shape, np.float32), np.zeros(cache.index_keys.shape, np.float32)
    width = cfg.attention.kv_cache_width
    for b, n in enumerate(lengths):
        for p in range(n):
            page, slot = tables[b, p // PAGE], p % PAGE
            k[:, page, slot, :width] = rng.standard_normal((cfg.num_layers, width))
            keys[:, page, slot] = rng.standard_normal(keys.shape[::3])
    dt = cache.k.dtype
    return cache._replace(k=jnp.asarray(k, dt), index_keys=jnp.asarray(keys, dt), block_tables=jnp.asarray(tables),
                          lengths=jnp.asarray(lengths, jnp.int32))


def selection_gap(cfg, params, positions, new_cache: R.KVCache, taps) -> float:
    """The smallest gap between the k-th and (k+1)-th index scores of any query with more than k
    visible keys, over the indexer layers of the reference step (its layer inputs `taps`, the
    index keys of its updated cache; the queries from the q-LoRA latent, or Mistral Large 4's
    hidden state, with each layer's RoPE and the model's, possibly learned, frequencies)."""
    b, t = positions.shape
    ctx, k, gap = new_cache.max_context, cfg.index_topk, np.inf
    freqs = mla.rope_freqs(cfg, params)
    for i in cfg.indexer_layers:
        layer = params["layers"][i]
        h = rms_norm(taps[:, :, i], layer["attn_norm"], cfg.norms.rms_eps)
        keys = new_cache.index_keys[cfg.indexer_layers.index(i)][new_cache.block_tables].reshape(b, ctx, -1)
        s = np.asarray(sparse_attention.index_scores(cfg, layer, h, R.q_resid(cfg, layer, h), positions, keys,
                                                     cfg.pattern.rotates(i), freqs))
        for bi in range(b):
            for ti in range(t):
                seen = np.sort(s[bi, ti, :int(positions[bi, ti]) + 1])[::-1]
                if len(seen) > k:
                    gap = min(gap, float(seen[k - 1] - seen[k]))
    return gap


def step_against_reference(cfg, params, lengths, q_len: int, quant: str = "none"):
    """One megakernel step (interpret mode, race detector) and the reference's on the same random
    cache and tokens: no DMA race, a selection that matters (the k-th and (k+1)-th index scores
    more than TIE_GAP apart), logits within `assert_logits_close`'s bound, the latent and
    index-key caches within `cache_tol` and with rows this step wrote. `params` in the plan's
    format (`quant`). Returns (plan, tokens, positions, cache, want_cache, new)."""
    batch = len(lengths)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, TuningConfig(), q_len=q_len, page_size=PAGE,
                               quant=quant))
    assert plan.sparse is not None
    cache = random_cache(cfg, lengths)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    logits, new = make_decode_step(plan, detect_races=True)(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want, want_cache, taps = reference_step(cfg)(params, tokens, positions, cache)
    assert selection_gap(cfg, params, positions, want_cache, taps) > TIE_GAP
    assert_logits_close(logits, want, cfg.dtype)
    tol = cache_tol(cfg)
    for name in ("k", "index_keys"):
        got, exp = (np.asarray(getattr(c, name), np.float32) for c in (new, want_cache))
        np.testing.assert_allclose(got, exp, rtol=tol, atol=tol, err_msg=name)
        assert np.any(got != np.asarray(getattr(cache, name), np.float32)), f"{name}: the step wrote no row"
    return plan, tokens, positions, cache, want, want_cache, new


def cache_tol(cfg) -> float:
    """The caches' bound: float32 rounding, or one bfloat16 step of a value of size ~1."""
    return 1e-5 if cfg.dtype == "float32" else 2 ** -6


def compile_for_tpus(cfg, batch: int, q_len: int, quant: str = "none") -> None:
    """One tpu_custom_call, compiled deviceless for TPU7x and v6e."""
    for target in ("tpu7x", "v6e"):
        plan = make_plan(BuildSpec(cfg, get_target(target), batch, CONTEXT, TuningConfig(), q_len=q_len,
                                   page_size=PAGE, quant=quant))
        assert compile_for(make_decode_step(plan), step_specs(plan), get_target(target)).custom_calls == 1, target


# All three are the full tier (tests/README.md): test_quantized_sparse_step_matches_the_quantized_reference
# [fp8b128-f32-b1-q1] runs f32-b1-q1's model and kernel path (indexer, index-key cache, selection,
# compaction, gather) with fp8-b128 weights in the default run.
@pytest.mark.parametrize("dtype, lengths, q_len, glm", [
    pytest.param("float32", [37], 1, False, marks=pytest.mark.full),
    pytest.param("bfloat16", [17, 30], 3, False, marks=pytest.mark.full),
    pytest.param("float32", [21, 40], 1, True, marks=pytest.mark.full),
], ids=["f32-b1-q1", "bf16-b2-q3", "glm-f32-b2-q1"])
def test_sparse_step_matches_reference(dtype, lengths, q_len, glm):
    """The megakernel's step equals the reference's: logits within 1e-5 of their scale (bf16: the
    MLA tests' bound), the latent and index-key caches with this step's rows; no DMA race. The
    selection matters: the dense model's logits differ by far more. Compiled deviceless too.
    GLM-5's case: a layer reusing the previous layer's picks, interleaved indexer RoPE."""
    cfg, params = model(dtype, glm)
    plan, tokens, positions, cache, want, _, _ = step_against_reference(cfg, params, lengths, q_len)
    assert {"idx_k", "idx_q"} <= set(plan.families)
    dense_cfg = cfg.replace(index_shared_layers=(), index_rope_interleave=False).replace(**DENSE)
    dense, _ = R.jitted_decode_step(dense_cfg)(params, tokens, positions, cache)
    assert float(jnp.max(jnp.abs(dense - want))) > 0.05 * float(jnp.max(jnp.abs(want)))
    compile_for_tpus(cfg, len(lengths), q_len)


# Quantized weights (tpumk.model.quantize): the indexer's idx_wk / idx_wq stream in the ring format
# as the families idx_k / idx_q. fp8-b128 (DeepSeek-V3.2's own format: each tile's group scales
# stream beside it) runs here; int8 (column scales in each layer's scale row), bfloat16 at q_len 3
# and GLM-5's shared selection (scales stacked over the indexer layers only) are the full tier
# (tests/README.md).
@pytest.mark.parametrize("scheme, dtype, lengths, q_len, glm", [
    ("fp8-b128", "float32", [37], 1, False),
    pytest.param("int8", "float32", [29], 1, False, marks=pytest.mark.full),
    pytest.param("fp8-b128", "bfloat16", [21, 40], 3, False, marks=pytest.mark.full),
    pytest.param("fp8-b128", "float32", [21, 40], 1, True, marks=pytest.mark.full),
], ids=["fp8b128-f32-b1-q1", "int8-f32-b1-q1", "fp8b128-bf16-b2-q3", "glm-fp8b128-f32-b2-q1"])
def test_quantized_sparse_step_matches_the_quantized_reference(scheme, dtype, lengths, q_len, glm):
    """quantize_params quantizes the indexer's two projections (its float32 head weights and its
    key LayerNorm stay float: they are read by their own DMAs, not the ring) and the stored bytes
    are the closed-form count; the megakernel's step equals the reference's with the same
    quantized weights (logits within the MLA tests' bounds, the latent and index-key caches; the
    index keys would differ by the quantization error if the kernel projected with other
    weights); no DMA race; the selection matters. Compiled deviceless for TPU7x and v6e."""
    from test_megakernel_mla_quant import _leaf_bytes
    from tpumk.model.quantize import QuantizedMatrix, quantize_params, quantized_weight_bytes, relative_rms

    cfg, params = model(dtype, glm, 128 if scheme == "fp8-b128" else None)
    qp = quantize_params(cfg, params, scheme)
    for i in cfg.indexer_layers:
        lay, flt = qp["layers"][i], params["layers"][i]
        for k in ("idx_wk", "idx_wq"):
            assert isinstance(lay[k], QuantizedMatrix), k
            assert 0 < relative_rms(lay[k].dequantized(), flt[k]) < 0.04, k
        for k in ("idx_weights", "idx_k_norm", "idx_k_bias"):
            assert not isinstance(lay[k], QuantizedMatrix), k
        assert jnp.dtype(lay["idx_weights"].dtype) == jnp.float32
    # what quantizing saves, by the closed-form count, is what the stored bytes show (the count of
    # a bfloat16 model's float32 idx_weights at 2 bytes is off alike in both: not this test's)
    saved = quantized_weight_bytes(cfg, "none") - quantized_weight_bytes(cfg, scheme)
    assert saved == _leaf_bytes(cfg, params) - _leaf_bytes(cfg, qp) > 0
    plan, tokens, positions, cache, _, want_cache, _ = step_against_reference(cfg, qp, lengths, q_len, scheme)
    assert {"idx_k", "idx_q"} <= set(plan.families)
    _, float_cache, _ = reference_step(cfg)(params, tokens, positions, cache)  # (the same compiled step)
    moved = np.abs(np.asarray(float_cache.index_keys, np.float32) - np.asarray(want_cache.index_keys, np.float32))
    assert float(moved.max()) > 10 * cache_tol(cfg), \
        "the float indexer's keys equal the quantized one's: the test cannot fail"
    compile_for_tpus(cfg, len(lengths), q_len, scheme)


@pytest.mark.full  # (29 s, 16 s CPU) tests/README.md: the default run's plan test of the chunks at 128k
def test_the_selection_in_chunks_and_a_deep_gather_ring_match_reference():
    """The top-k search over 128-position chunks (SparseGeometry.select_lanes: what keeps its
    temporaries small at 128k tokens) at a context of 256: two chunks, a query seeing 231 keys
    across both, its top 24 from both; and the gather in steps of 2 blocks through a ring of 3
    slots, so more steps than slots (the ring wraps): logits and caches as the reference's, no
    DMA race."""
    import dataclasses

    cfg, params = model("float32")
    cfg = cfg.replace(index_topk=24)  # (the same weights: top-k has none)
    context, lengths = 256, [230]
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 1, context, TuningConfig(), page_size=PAGE))
    assert plan.sparse.select_lanes == 256 and plan.sparse.ring_slots == 4
    plan = dataclasses.replace(plan, sparse=dataclasses.replace(plan.sparse, select_chunk=128, gather_step=2,
                                                                gather_slots=3))
    assert plan.sparse.score_lanes // plan.sparse.select_lanes == 2 and plan.sparse.gather_tokens == 2
    cache = random_cache(cfg, lengths, context=context)
    tokens = jnp.asarray([[11]], jnp.int32)
    positions = cache.lengths[:, None]
    logits, new = make_decode_step(plan, detect_races=True)(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want, want_cache, taps = reference_step(cfg)(params, tokens, positions, cache)
    assert selection_gap(cfg, params, positions, want_cache, taps) > TIE_GAP
    assert_logits_close(logits, want, "float32")
    for name in ("k", "index_keys"):
        np.testing.assert_allclose(np.asarray(getattr(new, name)), np.asarray(getattr(want_cache, name)), rtol=1e-5,
                                   atol=1e-5, err_msg=name)
    # the reference's picks of the first layer lie in both chunks (the chunked count matters)
    layer = params["layers"][0]
    h = rms_norm(taps[:, :, 0], layer["attn_norm"], cfg.norms.rms_eps)
    keys = want_cache.index_keys[0][want_cache.block_tables].reshape(1, context, -1)
    s = np.asarray(sparse_attention.index_scores(cfg, layer, h, mla.q_latent(cfg, layer, h), positions, keys))
    picks = np.argsort(-s[0, 0, :231], kind="stable")[:cfg.index_topk]
    assert picks.min() < 128 <= picks.max(), picks
    assert len(set(picks // plan.sparse.block_rows)) > 2 * 3, picks  # gather steps of 2 blocks: more than 3 slots


def test_the_plan_counts_the_sparse_reads():
    """At the plan's full context the step reads every cached index key once per layer, top-k
    sublane blocks of latent rows (not the whole latent cache), and writes one latent and one
    index-key page per sequence and layer; the timeline model walks the same bytes."""
    from tpumk.estimate.timeline import megakernel_step

    cfg, _ = model("bfloat16")
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 512, TuningConfig(), page_size=PAGE))
    g, a, layers = plan.sparse, plan.attention, cfg.num_layers
    assert (g.tile_rows, g.block_rows, g.gather_tokens) == (512, 16, 4)
    pages = 512 // PAGE
    # every page once (the last one, which the step writes, from VMEM), the written page read and written
    assert plan.hbm["index_keys"] == layers * (pages - 1 + 2) * PAGE * 32 * 2
    assert plan.hbm["sparse_gather"] == layers * 4 * 16 * a.page_lanes * 2  # 4 tokens' 16-row blocks
    assert plan.hbm["kv_cache"] == layers * 2 * a.page_bytes  # the latent page the step writes
    dense = make_plan(BuildSpec(cfg.replace(**DENSE), get_target("tpu7x"), 1, 512, TuningConfig(), page_size=PAGE))
    assert plan.hbm["sparse_gather"] + plan.hbm["kv_cache"] < 0.2 * dense.hbm["kv_cache"]
    assert megakernel_step(plan).hbm_bytes == pytest.approx(plan.hbm_bytes)
