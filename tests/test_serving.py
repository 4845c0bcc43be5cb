"""The serving-stack step (tpumk.decode.serving): XLA for the dense parts, jax's ragged paged
attention kernel for attention, the third column of `tpumk bench`.

Pallas' TPU interpret mode cannot run the kernel in jax 0.10.2 (no reshape of a ref in its
interpreter), so the step's wiring (cache layout, lengths, block table, causal offsets) is checked
against tpumk's reference through the kernel's own pure-JAX reference, and the kernel itself is
compiled deviceless for TPU7x and v6e."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.decode import serving as sv
from tpumk.estimate.timeline import dma_engine, xla_step
from tpumk.model import reference as ref
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.targets import get_target


def _paged_to_serving(cache: ref.KVCache, cfg) -> list:
    """A reference paged cache [L, pages, page * kv] as one [pages, page, 2 * Hkv, D] array per layer."""
    out = []
    for i in range(cfg.num_layers):
        k = cache.k[i].reshape(cache.k.shape[1], cache.page_size, cfg.num_kv_heads, cfg.head_dim)
        v = cache.v[i].reshape(cache.v.shape[1], cache.page_size, cfg.num_kv_heads, cfg.head_dim)
        out.append(jnp.stack([k, v], axis=3).reshape(k.shape[0], cache.page_size, 2 * cfg.num_kv_heads, cfg.head_dim))
    return out


# Gemma 2 and 3's parts through the serving step too (layer 0 slides a 20-token window), and Cohere's
GEMMA_PARTS = dict(mlp_act="gelu_tanh", embed_scale=16.0, post_norms=True, attn_scalar=96.0, sliding_window=20,
                   sliding_layers=[0], rope_local_theta=10000.0, attn_softcap=2.0, final_softcap=3.0)
COHERE_PARTS = dict(qk_norm=False, norm_kind="layer", parallel_blocks=True)


@pytest.mark.parametrize("preset, parts, q_len", [
    ("tiny-dense", GEMMA_PARTS, 1),
    pytest.param("tiny-moe", {}, 2, marks=pytest.mark.full),  # tests/README.md: what covers it
    ("tiny-dense", COHERE_PARTS, 1)], ids=["tiny-dense-1", "tiny-moe-2", "tiny-dense-cohere-1"])
def test_serving_step_matches_the_reference(preset, parts, q_len):
    cfg = load_preset(preset).replace(**parts)
    batch, ctx, page = 3, 64, 16
    params = random_params(cfg, 0)
    rng = np.random.default_rng(1)
    cache = ref.init_cache(cfg, batch, ctx, page)  # a shuffled block table
    lengths = jnp.array([37, 20, 5], jnp.int32)
    cache = cache._replace(k=jnp.asarray(rng.normal(size=cache.k.shape), cache.k.dtype),
                           v=jnp.asarray(rng.normal(size=cache.v.shape), cache.v.dtype), lengths=lengths)
    positions = lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    want, new_cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
    got, caches, kv_lens = sv.serving_decode_step(params, cfg, tokens, positions, _paged_to_serving(cache, cfg),
                                                  cache.block_tables, lengths, blocks=(2, 8), kernel_reference=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(kv_lens), np.asarray(lengths + q_len))
    # The new rows landed where the reference wrote them. The old rows are copied (exact); the new
    # ones are float32 projections that XLA sums in another order than the reference's dot: a
    # K-term float32 dot is off by at most K * 2^-24 of the sum of |terms| (K = hidden size), and
    # QK-norm / RoPE keep the row's scale, so the bound is that much of the largest cache value.
    for a, b in zip(caches, _paged_to_serving(new_cache, cfg)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=cfg.hidden_size * 2.0 ** -24 * np.max(np.abs(b)))
        written = np.any(a != b, axis=(1, 2, 3))  # pages holding a new row; every other page is bit-exact
        assert written.sum() <= batch * q_len


def test_block_sizes_follow_the_kernels_table():
    cfg = load_preset("qwen3-8b")
    # TPU7x has no entry in jax 0.10.2's table: the kernel's defaults (128 pages, 32 queries), capped
    assert sv.rpa_block_sizes(get_target("tpu7x"), cfg, 8, 1, 4096, 16) == (128, 8)
    assert sv.rpa_block_sizes(get_target("tpu7x"), cfg, 8, 1, 1024, 16) == (64, 8)
    # v6e reads its tuned entry when there is one (whatever it is, within the caps)
    kv, q = sv.rpa_block_sizes(get_target("v6e"), cfg, 8, 1, 4096, 16)
    assert 1 <= kv <= 256 and 1 <= q <= 8


@pytest.mark.parametrize("target", ["tpu7x", "v6e"])
def test_serving_step_compiles_deviceless_and_is_modelled(target):
    cfg = load_preset("tiny-dense").replace(dtype="bfloat16")
    t = get_target(target)
    batch, ctx, page = 2, 1024, 16
    prog = sv.compile_serving_step(cfg, t, batch, ctx, page)
    assert prog.hlo_text.count('custom_call_target="tpu_custom_call"') == cfg.num_layers  # one kernel per layer
    blocks = sv.rpa_block_sizes(t, cfg, batch, 1, ctx, page)
    call = sv.rpa_call_model(t, cfg, batch, 1, ctx, page, blocks)
    # the kernel reads every sequence's whole KV (K and V) once per call at the full context
    kv_bytes = batch * ctx * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype_bytes
    assert call.hbm_bytes >= kv_bytes
    step = xla_step(t, prog.hlo_text, kernel=call)
    attn = step.stages["pallas: attention (ragged paged attention kernel)"]
    assert attn["seconds"] == pytest.approx(cfg.num_layers * call.seconds)
    assert step.seconds > attn["seconds"]


def test_rpa_model_pays_its_single_semaphore_blocks():
    """The kernel fetches a block's pages on one semaphore, double-buffered: by the queue law
    (tests/test_dma_probe.py) fewer pages per block stream faster per byte only up to the
    latency; the model must follow the block size it is given."""
    cfg = load_preset("qwen3-8b")
    t = get_target("tpu7x")
    assert dma_engine(t).queue_bytes_per_s
    small = sv.rpa_call_model(t, cfg, 8, 1, 4096, 16, (8, 8))
    big = sv.rpa_call_model(t, cfg, 8, 1, 4096, 16, (128, 8))
    assert small.hbm_bytes == pytest.approx(big.hbm_bytes)
    assert small.seconds != pytest.approx(big.seconds)


def test_serving_column_reports_what_the_compiler_rejects():
    """jax 0.10.2's ragged paged attention does not compile for 256-wide heads with two KV heads
    (Gemma 2's layout): the bench's serving column says so in one line instead of failing the
    bench; the megakernel and XLA columns do not depend on it."""
    from tpumk.decode.bench import serving_column

    tpu7x = get_target("tpu7x")
    wide = load_preset("tiny-dense").replace(num_q_heads=4, num_kv_heads=2, head_dim=256)
    step, why = serving_column(wide, tpu7x, 1, 64, 16, 1, "none")
    assert step is None and why.startswith("not built: the tpu7x compiler rejected jax's ragged_paged_attention")
    assert "\n" not in why and "last dim size is not 128" in why
    step, why = serving_column(load_preset("tiny-dense"), tpu7x, 1, 64, 16, 1, "none")
    assert why is None and "tpu_custom_call" in step.hlo_text
