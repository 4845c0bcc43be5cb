"""The vLLM plugin under EAGLE-3 speculative decoding (tpumk.vllm.speculative), without vLLM.

vLLM's drafter reads the hidden states entering three target layers for every token of each
step, which the plugin's JAX step returns (tpumk.vllm.steps.serve_step with `taps`): checked
against tpumk's reference taps (`reference.forward_full(..., taps=)`, transformers'
output_hidden_states numbering) over a prefill of two prompts and then a verify batch of 3 tokens
per request (k = 2 drafts and the last sampled token: a ragged batch reading the cached rows),
with the logits of every token (vLLM samples one per verified position). The end-to-end check
(`vllm serve --speculative-config` giving transformers' greedy tokens) is the vLLM tier's
test_vllm_serve.py [eagle3] case.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.vllm import kv, steps
from tpumk.vllm.runtime import ServingConfigError
from tpumk.vllm.speculative import speculative_taps

BLOCK, NUM_BLOCKS, SLOTS, CONTEXT = 16, 9, 4, 32
TAPS = (0, 1, 2)  # the embeddings and the streams entering layers 1 and 2 of 3


def model():
    cfg = load_preset("tiny-dense").replace(num_layers=3)
    return cfg, random_params(cfg, seed=1)


def batch(chunks, starts, num_tokens):
    """vLLM's flattened batch of `chunks[r]` new tokens of request r from position starts[r]."""
    ids, pos = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    qsl = np.zeros(SLOTS + 1, np.int32)
    at = 0
    for r, (chunk, start) in enumerate(zip(chunks, starts)):
        ids[at:at + len(chunk)], pos[at:at + len(chunk)] = chunk, np.arange(start, start + len(chunk))
        at += len(chunk)
        qsl[r + 1] = at
    qsl[len(chunks) + 1:] = at
    return jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(qsl)


def test_served_taps_and_every_row_s_logits_equal_the_reference():
    cfg, params = model()
    shape = kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.kv_size)
    cache = (jnp.zeros(shape, R.jnp_dtype(cfg)), jnp.zeros(shape, R.jnp_dtype(cfg)))
    tables = np.zeros((SLOTS, CONTEXT // BLOCK), np.int32)
    tables[:2] = [[3, 7], [5, 1]]  # never block 0, vLLM's null block
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7 + 3, 5 + 3)]

    # serve_step with taps runs the JAX step for every batch (no megakernel step is passed)
    step = jax.jit(lambda c, ids, pos, qsl, seq_lens, n: steps.serve_step(
        None, None, params, cfg, {}, *c, ids, pos, qsl, seq_lens, jnp.asarray(tables), n, BLOCK, CONTEXT,
        taps=TAPS))
    # causal: each request's whole sequence once gives every row of both steps
    want = [R.forward_full(params, cfg, jnp.asarray([s]), taps=TAPS) for s in seqs]
    for chunks, starts in (([s[:-3] for s in seqs], [0, 0]),  # the prefill
                           ([s[-3:] for s in seqs], [len(s) - 3 for s in seqs])):  # the verify batch
        ids, pos, qsl = batch(chunks, starts, 24)
        seq_lens = jnp.asarray([st + len(c) for st, c in zip(starts, chunks)] + [0] * (SLOTS - 2), jnp.int32)
        cache, rows, taps = step(cache, ids, pos, qsl, seq_lens, jnp.int32(2))
        assert len(taps) == len(TAPS) and all(t.shape == (24, cfg.hidden_size) for t in taps)
        rows, taps = np.asarray(rows), np.stack([np.asarray(t) for t in taps], axis=1)  # [T, taps, H]
        end = int(qsl[2])
        assert not rows[end:].any(), "rows past the last request are zero"
        for r, (chunk, start) in enumerate(zip(chunks, starts)):
            want_logits, want_taps = (np.asarray(a)[0, start:start + len(chunk)] for a in want[r])
            got = slice(int(qsl[r]), int(qsl[r + 1]))
            np.testing.assert_allclose(taps[got], want_taps, atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(rows[got], want_logits, atol=2e-4, rtol=2e-4)
        # the taps differ from one another: a step returning one stream three times fails
        assert not np.allclose(taps[:end, 0], taps[:end, 1]) and not np.allclose(taps[:end, 1], taps[:end, 2])


def spec_config(method="eagle3", ids=None, tp=1):
    hf = NS(eagle_aux_hidden_state_layer_ids=ids) if ids is not None else NS()
    return NS(speculative_config=NS(method=method, draft_model_config=NS(hf_config=hf)),
              parallel_config=NS(tensor_parallel_size=tp))


def test_the_taps_are_the_drafter_s_layer_ids_else_vllm_s_default():
    cfg = load_preset("tiny-dense").replace(num_layers=8)
    assert speculative_taps(NS(speculative_config=None), cfg) == ()
    assert speculative_taps(spec_config(ids=[1, 4, 6]), cfg) == (1, 4, 6)
    assert speculative_taps(spec_config(), cfg) == (2, 4, 5)  # vLLM's (2, L // 2, L - 3)
    # in layer order, as vLLM's models collect them: a 3-layer model's default (2, 1, 0) too
    assert speculative_taps(spec_config(ids=[6, 1, 4]), cfg) == (1, 4, 6)
    assert speculative_taps(spec_config(), cfg.replace(num_layers=3)) == (0, 1, 2)


@pytest.mark.parametrize("conf, line", [
    (spec_config("ngram"), "tpumk plugin: --speculative-config field 'method' = 'ngram': expected one of ['eagle3']"),
    (spec_config("mtp"), "field 'method' = 'mtp'"),
    (spec_config(ids=[1, 4, 8]), "the drafter's eagle_aux_hidden_state_layer_ids [1, 4, 8]: expected 3 distinct "
                                 "layer ids from 0 to 7"),
    (spec_config(ids=[1, 4]), "eagle_aux_hidden_state_layer_ids [1, 4]: expected 3"),
    (spec_config(tp=2), "tensor_parallel_size 2: expected 1 with speculative decoding"),
])
def test_a_speculative_config_the_plugin_cannot_serve_is_refused_in_one_line(conf, line):
    cfg = load_preset("tiny-dense").replace(num_layers=8)
    with pytest.raises(ServingConfigError) as e:
        speculative_taps(conf, cfg)
    assert line in str(e.value) and "\n" not in str(e.value)
