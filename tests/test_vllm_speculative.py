"""The vLLM plugin under EAGLE-3 speculative decoding (tpumk.vllm.speculative), without vLLM.

vLLM's drafter reads the hidden states entering three target layers for every token of each
step, which the plugin's steps return (tpumk.vllm.steps.serve_step with `taps`): the JAX step's
checked against tpumk's reference taps (`reference.forward_full(..., taps=)`, transformers'
output_hidden_states numbering) over a prefill of two prompts and then a verify batch of 3 tokens
per request (k = 2 drafts and the last sampled token: a ragged batch reading the cached rows),
with the logits of every token (vLLM samples one per verified position). Then the megakernel's
verify step (q_len 3 with the taps, in the discharge interpreter the plugin runs on the CPU)
against that JAX step on the same verify batch: logits, greedy tokens, taps and the K / V
arrays, one request with fewer than 3 tokens and stale padding slots; a decode-only batch runs
it too. Its TPU compile: test_megakernel_archs.py's `dense-lanes-float32-q2` (a q_len 2 step
with taps, compiled deviceless for TPU7x and v6e). The end-to-end check (`vllm serve
--speculative-config` giving transformers' greedy tokens, the verify batches counted in the
megakernel) is the vLLM tier's test_vllm_serve.py eagle3 test.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target
from tpumk.vllm import kv, steps
from tpumk.vllm.runtime import ServingConfigError
from tpumk.vllm.speculative import speculative_taps, verify_len

BLOCK, NUM_BLOCKS, SLOTS, CONTEXT = 16, 9, 4, 32
TAPS = (0, 1, 2)  # the embeddings and the streams entering layers 1 and 2 of 3


def model():
    cfg = load_preset("tiny-dense").replace(num_layers=3)
    return cfg, random_params(cfg, seed=1)


def batch(chunks, starts, num_tokens):
    """vLLM's flattened batch of `chunks[r]` new tokens of request r from position starts[r]
    (test_vllm_adapter's, in this file's request slots): token ids, positions, query_start_loc."""
    from test_vllm_adapter import batch_inputs

    return tuple(jnp.asarray(a) for a in batch_inputs(chunks, starts, num_tokens, SLOTS)[:3])


def test_served_taps_and_every_row_s_logits_equal_the_reference():
    # serve_step with taps and no verify step runs the JAX step for every batch (the program
    # verify_setup compiles, shared with the verify test)
    cfg, params, _, ragged, _ = verify_setup()
    shape = kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.kv_size)
    cache = (jnp.zeros(shape, R.jnp_dtype(cfg)), jnp.zeros(shape, R.jnp_dtype(cfg)))
    tables = np.zeros((SLOTS, CONTEXT // BLOCK), np.int32)
    tables[:2] = [[3, 7], [5, 1]]  # never block 0, vLLM's null block
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7 + 3, 5 + 3)]

    def step(c, ids, pos, qsl, seq_lens, n):
        return ragged(c, ids, pos, qsl, seq_lens, jnp.asarray(tables), n)

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


Q = 3  # the verify step's q_len: k = 2 drafts and the last sampled token
KERNEL_BATCH = 3  # max_num_seqs: request slots 0 and 1 live, 2 padding inside the kernel's batch, 3 past it


def served_steps(cfg, params, batch: int, context: int, q_len: int, block: int, blocks: int, taps: tuple[int, ...]):
    """serve_step with `taps`, jitted as vLLM jits its step ((k, v), ids, positions,
    query_start_loc, seq_lens, block tables, num_reqs): with the megakernel's verify step (as
    tpumk.vllm.runtime builds it: the decode plan's shape at `q_len` with the taps, for vLLM's
    pool of `blocks`) and without it (every batch the JAX step); `kinds`: the branch each call ran
    (on_step). test_vllm_mla.py's MLA verify test builds its steps here too."""
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=batch, context=context, q_len=q_len, page_size=block,
                               taps=taps))
    step = make_decode_step(dataclasses.replace(plan, num_pages=blocks), portable=True, nested=True)
    packed = pack_weights(plan, params)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    kinds = []

    def served(verify):
        def run(cache, ids, pos, qsl, seq_lens, tables, n):
            return steps.serve_step(None, packed, params, cfg, shape, *cache, ids, pos, qsl, seq_lens, tables, n,
                                    block, context, on_step=lambda kind: jax.debug.callback(lambda: kinds.append(kind)),
                                    taps=taps, verify=(step, q_len) if verify else None)
        return jax.jit(run, compiler_options=INTERPRET_COMPILER_OPTIONS)

    return served(True), served(False), kinds


@functools.lru_cache(maxsize=None)
def verify_setup():
    """This file's model through `served_steps` (q_len Q, its TAPS, on NUM_BLOCKS blocks)."""
    cfg, params = model()
    return cfg, params, *served_steps(cfg, params, KERNEL_BATCH, CONTEXT, Q, BLOCK, NUM_BLOCKS, TAPS)


def test_verify_batches_run_the_megakernel_and_equal_the_jax_step():
    """A prefill (more than Q tokens a request: the JAX step), then a verify batch of 3 and 2
    tokens (request 1's third row at position -1) and a decode-only batch through the
    megakernel's verify step, against the JAX step on the same batch and cache and against the
    reference. Request slot 2 (inside the kernel's batch) and 3 (past it) are padding with stale
    metadata: slot 2's block table names request 0's blocks and its seq_len is nonzero, so a
    padding slot that wrote or read anything would change request 0's rows."""
    cfg, params, verified, ragged, kinds = verify_setup()
    shape = kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.kv_size)
    cache = (jnp.zeros(shape, R.jnp_dtype(cfg)), jnp.zeros(shape, R.jnp_dtype(cfg)))
    tables = np.zeros((SLOTS, CONTEXT // BLOCK), np.int32)
    tables[:3] = [[3, 7], [5, 1], [3, 7]]  # slot 2: stale, request 0's blocks
    tables = jnp.asarray(tables)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7 + 3 + 1, 6 + 2 + 1)]
    want = [[np.asarray(a)[0] for a in R.forward_full(params, cfg, jnp.asarray([s]), taps=TAPS)] for s in seqs]
    n = jnp.int32(2)

    def inputs(chunks, starts):
        ids, pos, qsl = batch(chunks, starts, 24)
        seq_lens = jnp.asarray([st + len(c) for st, c in zip(starts, chunks)] + [5, 9], jnp.int32)  # 2, 3: stale
        return ids, pos, qsl, seq_lens, tables, n

    kinds.clear()
    cache, *_ = verified(cache, *inputs([s[:-3 - 1] if r == 0 else s[:-2 - 1] for r, s in enumerate(seqs)], [0, 0]))
    jax.effects_barrier()
    assert kinds == ["ragged"], kinds  # 7 and 6 tokens: more than Q
    for chunks, starts in (([seqs[0][7:10], seqs[1][6:8]], [7, 6]),  # the verify batch: 3 and 2 tokens
                           ([seqs[0][10:], seqs[1][8:]], [10, 8])):  # decode-only: 1 token each
        args = inputs(chunks, starts)
        qsl, end = np.asarray(args[2]), int(args[2][2])
        kinds.clear()
        (k_v, v_v), rows_v, taps_v = verified(cache, *args)
        (k_r, v_r), rows_r, taps_r = ragged(cache, *args)
        jax.effects_barrier()
        assert kinds == ["verify", "ragged"], kinds
        rows_v, rows_r = np.asarray(rows_v), np.asarray(rows_r)
        taps_v = np.stack([np.asarray(t) for t in taps_v], axis=1)  # [T, taps, H]
        taps_r = np.stack([np.asarray(t) for t in taps_r], axis=1)
        assert rows_v.shape == rows_r.shape == (24, cfg.vocab_size) and rows_v.dtype == np.float32
        # float32 on both sides, the same products summed in another order (the kernel's tiles,
        # the JAX step's): the logits' dots have 256 terms, so a bound of 1e-5 of the largest logit
        # is about 600 float32 roundings of the largest term; the taps (residual stream) likewise
        scale = float(np.abs(rows_r[:end]).max())
        assert np.abs(rows_v[:end] - rows_r[:end]).max() <= 1e-5 * scale
        np.testing.assert_array_equal(rows_v[:end].argmax(-1), rows_r[:end].argmax(-1))  # the greedy tokens
        assert not rows_v[end:].any(), "logits past the last request's rows are zero"
        np.testing.assert_allclose(taps_v[:end], taps_r[:end], atol=1e-5, rtol=1e-5)
        assert not taps_v[end:].any(), "taps past the last request's rows are zero"
        for r, (chunk, start) in enumerate(zip(chunks, starts)):  # and both are the reference's
            got = slice(int(qsl[r]), int(qsl[r + 1]))
            want_logits, want_taps = (a[start:start + len(chunk)] for a in want[r])
            np.testing.assert_allclose(taps_v[got], want_taps, atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(rows_v[got], want_logits, atol=2e-4, rtol=2e-4)
        # the K / V arrays: the same rows written (float32 rounding), every other row untouched
        for got, other, before in ((k_v, k_r, cache[0]), (v_v, v_r, cache[1])):
            got, other, before = np.asarray(got), np.asarray(other), np.asarray(before)
            np.testing.assert_allclose(got, other, atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(got != before, other != before)
        cache = (k_v, v_v)


def test_the_runtime_builds_a_verify_step_of_k_plus_1_tokens_with_the_taps(tmp_path, monkeypatch):
    """With --speculative-config eagle3 the plugin's start-up build also plans the verify step:
    the decode plan's batch, context and page size, q_len num_speculative_tokens + 1, the served
    taps; per vLLM pool as the decode step. Without a speculative config: none."""
    from test_vllm_adapter import QWEN3_JSON, vllm_config

    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_JSON, "num_hidden_layers": 3}))
    spec = spec_config(ids=[2, 0, 1], k=4).speculative_config
    rt = Runtime.from_vllm_config(vllm_config(tmp_path, spec=spec, max_model_len=40))
    p, v = rt.plan, rt.verify_plan
    assert (p.q_len, p.taps) == (1, ()) and rt.taps == (0, 1, 2)
    assert (v.batch, v.context, v.page_size, v.q_len, v.taps) == (p.batch, p.context, p.page_size, 5, (0, 1, 2))
    assert rt.verify_step_for(v.num_pages) is rt.verify_step
    assert rt.verify_step_for(50) is rt.verify_step_for(50) is not rt.verify_step
    assert Runtime.from_vllm_config(vllm_config(tmp_path)).verify_plan is None


def spec_config(method="eagle3", ids=None, tp=1, k=2, head=None):
    hf = NS(eagle_aux_hidden_state_layer_ids=ids) if ids is not None else NS()
    if head is not None:  # the drafter's head width (its config's head_dim)
        hf.head_dim = head
    return NS(speculative_config=NS(method=method, draft_model_config=NS(hf_config=hf), num_speculative_tokens=k),
              parallel_config=NS(tensor_parallel_size=tp))


def test_the_taps_are_the_drafter_s_layer_ids_else_vllm_s_default():
    cfg = load_preset("tiny-dense").replace(num_layers=8)
    assert speculative_taps(NS(speculative_config=None), cfg) == ()
    assert speculative_taps(spec_config(ids=[1, 4, 6]), cfg) == (1, 4, 6)
    assert speculative_taps(spec_config(), cfg) == (2, 4, 5)  # vLLM's (2, L // 2, L - 3)
    # in layer order, as vLLM's models collect them: a 3-layer model's default (2, 1, 0) too
    assert speculative_taps(spec_config(ids=[6, 1, 4]), cfg) == (1, 4, 6)
    assert speculative_taps(spec_config(), cfg.replace(num_layers=3)) == (0, 1, 2)
    assert verify_len(spec_config(k=4)) == 5  # the verify step's q_len: the last sampled token and k drafts
    for k in (0, None, True, 2.0):
        with pytest.raises(ServingConfigError, match=f"field 'num_speculative_tokens' = {k!r}: expected a positive"):
            verify_len(spec_config(k=k))


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


@pytest.mark.parametrize("target, drafter, served", [
    (128, 128, True), (96, 96, True),  # a drafter of the target's width: padded alike
    (64, 64, True), (256, 128, True),  # neither padded
    (96, 128, False),  # tpu_inference would load the drafter's 128-wide heads 160 wide
    (128, 96, False),  # and a 96-wide drafter unpadded beside a 128-lane target
])
def test_a_drafter_whose_heads_tpu_inference_would_pad_otherwise_is_refused(target, drafter, served):
    """tpu_inference 0.32 pads the drafter's q / k / v heads by the target's head padding
    (models/jax/utils/weight_utils.py): served only when that equals the drafter's own."""
    cfg = load_preset("tiny-dense").replace(num_layers=8, head_dim=target)
    conf = spec_config(head=drafter)
    if served:
        assert speculative_taps(conf, cfg) == (2, 4, 5)
        return
    with pytest.raises(ServingConfigError) as e:
        speculative_taps(conf, cfg)
    line = str(e.value)
    assert f"head_dim = {target}: expected 64 or a multiple of 128 with eagle3 (the drafter's heads are {drafter} " \
           "wide)" in line and "\n" not in line, line
