"""The vLLM plugin's chunked prefill (tpumk.vllm.prefill through steps.ragged_step) against the reference.

Two steps on vLLM's cache as the plugin has it allocated (tpumk.vllm.kv: the megakernel's stacked
K and V arrays) with tiles far smaller than the batch, so items
span several query tiles and read several key tiles: a first step of three prompts, then a ragged
mixed batch whose chunks start mid-sequence (one request continues its prompt, one decodes, one
continues, one arrives), request slots padded past num_reqs and token rows padded past the
batch. Every request's last-token logits must equal `tpumk.model.reference.forward_full` over its
whole sequence, and every cache row it wrote the reference's K and V of that position, within
float32 rounding (the online softmax sums in another order): logits to 1e-5 of their largest
magnitude, cache rows to 1e-5 absolute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_vllm_adapter import SLOTS, batch_inputs  # SLOTS: request slots, padded past num_reqs as vLLM pads them
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.vllm import kv, steps

BLOCK = 4  # vLLM's block size
NUM_BLOCKS = 40
CONTEXT = 32  # max_model_len
TOKENS = 24  # the token bucket of both steps
QUERY_TILE, KEY_TILE, SHORT_TILE = 4, 8, 2  # the decode of step 2 runs as a short item

CONFIGS = {
    "dense": ("tiny-dense", {}),
    # 64-wide heads, a sliding layer whose 8-token window is
    # shorter than the sequences, soft-capped scores and gpt-oss's attention sinks
    "hd64-window-sinks": ("tiny-dense", dict(head_dim=64, sliding_window=8, sliding_layers=[1], attn_softcap=2.0,
                                             attn_sinks=True)),
}


@functools.lru_cache(maxsize=None)
def setup(name: str):
    preset, overrides = CONFIGS[name]
    cfg = load_preset(preset).replace(**overrides)
    params = random_params(cfg, seed=0)

    @jax.jit
    def ragged(cache, ids, pos, qsl, tables, n):
        return steps.ragged_step(params, cfg, *cache, ids, pos, qsl, tables, n, BLOCK, CONTEXT, QUERY_TILE, KEY_TILE,
                                 SHORT_TILE)

    @jax.jit
    def reference(tokens):
        """Logits [CONTEXT, V] and each layer's K, V [layers, CONTEXT, kv width] of one sequence
        (padded to CONTEXT: causal, so the padding changes no earlier position)."""
        logits, taps = R.forward_full(params, cfg, tokens[None], taps=range(cfg.num_layers))
        pos = jnp.arange(CONTEXT, dtype=jnp.int32)[None]
        ks, vs = [], []
        for li, layer in enumerate(params["layers"]):
            h = R.sublayer_in(cfg.norms, layer, "attn_norm", taps[:, :, li])
            _, k, v = R.qkv(cfg, layer, h, pos, li)
            ks.append(k[0].reshape(CONTEXT, -1))
            vs.append(v[0].reshape(CONTEXT, -1))
        return logits[0], jnp.stack(ks), jnp.stack(vs)

    @jax.jit
    def read(cache, table):
        """One request's K and V rows [layers, CONTEXT, kv width] at positions 0 .. CONTEXT - 1."""
        slots = kv.token_slots(table[None], jnp.zeros(CONTEXT, jnp.int32), jnp.arange(CONTEXT), BLOCK)
        return tuple(jnp.stack([kv.read_rows(c, li, slots) for li in range(cfg.num_layers)]) for c in cache)

    return cfg, ragged, reference, read


def batch(chunks, starts):
    """vLLM's flattened batch of `chunks` (request r's new tokens, from position starts[r]) in
    this file's token bucket: test_vllm_adapter's batch_inputs without the sequence lengths."""
    return batch_inputs(chunks, starts, TOKENS)[:3]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_equals_the_reference_on_ragged_batches(name):
    cfg, ragged, reference, read = setup(name)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (17, 6, 9, 7)]
    per = CONTEXT // BLOCK
    tables = np.zeros((SLOTS, per), np.int32)  # the padding slots' rows stay 0, as vLLM leaves them
    tables[:len(seqs)] = rng.permutation(NUM_BLOCKS)[:len(seqs) * per].reshape(len(seqs), per)
    shape = kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.kv_size)
    caches = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    # step 1: prompts of 11, 5 and 3 tokens; step 2: 6 more from position 11, one decode from 5,
    # 6 more from 3, a new prompt of 7 (23 of the 24 rows)
    padded = [s + [0] * (CONTEXT - len(s)) for s in seqs]
    done = [0, 0, 0, 0]
    for cut in ([11, 5, 3], [17, 6, 9, 7]):
        chunks = [s[d:c] for s, d, c in zip(seqs, done, cut)]
        ids, pos, qsl = batch(chunks, done)
        caches, rows = ragged(caches, ids, pos, qsl, tables, jnp.int32(len(cut)))
        rows = np.asarray(rows)
        for r, c in enumerate(cut):
            logits, ks, vs = (np.asarray(x) for x in reference(jnp.asarray(padded[r])))
            want = logits[c - 1]
            err = float(np.max(np.abs(rows[qsl[r + 1] - 1] - want)))
            assert err <= 1e-5 * float(np.max(np.abs(want))), f"request {r}: max |logits - reference| = {err:.3g}"
            k, v = (np.asarray(x)[:, :c] for x in read(caches, jnp.asarray(tables[r])))
            np.testing.assert_allclose(k, ks[:, :c], atol=1e-5, rtol=0)
            np.testing.assert_allclose(v, vs[:, :c], atol=1e-5, rtol=0)
        others = np.setdiff1d(np.arange(TOKENS), qsl[1:len(cut) + 1] - 1)
        assert not np.any(rows[others]), "only each request's last row holds logits"
        done = cut + [0] * (len(seqs) - len(cut))
