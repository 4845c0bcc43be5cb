"""The vLLM plugin's steps on a hybrid model (Gated DeltaNet beside gated attention), without
vLLM: the linear layers' state pool in vLLM's cache (tpumk.vllm.states: a request's slot is its
first block), a prompt prefilled in two ragged chunks through the reference layers, then decode
steps through the megakernel (Pallas interpreter), against the reference over whole sequences."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target
from tpumk.vllm import kv, states, steps
from tpumk.vllm.runtime import pool_plan

BLOCK, NUM_BLOCKS, SLOTS, CONTEXT = 16, 11, 6, 32
# the smallest hybrid: a Gated DeltaNet layer, then a gated attention layer (Qwen3-Next's pair)
HYBRID = dict(name="tiny-gdn", num_layers=2, linear_kind="gated_delta", linear_layers=(0,), linear_key_heads=1,
              linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)


def setup():
    cfg = load_preset("tiny-dense").replace(**HYBRID)
    params = random_params(cfg, seed=0)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=4, context=CONTEXT, page_size=BLOCK))
    step = make_decode_step(pool_plan(plan, NUM_BLOCKS), portable=True, nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    packed = pack_weights(plan, params)
    run = plan.whole_model

    def serve(cache, ids, pos, qsl, seq_lens, tables, n):
        return steps.serve_step(step, packed, params, run, shape, *cache[:2], ids, pos, qsl, seq_lens, tables, n,
                                BLOCK, CONTEXT, state=cache[2])

    return cfg, params, run, jax.jit(serve, compiler_options=INTERPRET_COMPILER_OPTIONS)


def batch_inputs(chunks, starts, num_tokens):
    ids, pos = np.zeros(num_tokens, np.int32), np.full(num_tokens, 0, np.int32)
    qsl, seq_lens = np.zeros(SLOTS + 1, np.int32), np.zeros(SLOTS, np.int32)
    at = 0
    for r, (chunk, start) in enumerate(zip(chunks, starts)):
        ids[at:at + len(chunk)] = chunk
        pos[at:at + len(chunk)] = np.arange(start, start + len(chunk))
        at += len(chunk)
        qsl[r + 1], seq_lens[r] = at, start + len(chunk)
    qsl[len(chunks) + 1:] = at
    return ids, pos, qsl, seq_lens


def reference_logits(cfg, params, seqs):
    out = []
    for seq in seqs:
        logits, _ = R.prefill(params, cfg, [seq], R.init_cache(cfg, 1, CONTEXT, 16))
        out.append(np.asarray(logits[0]))
    return np.stack(out)


def assert_close(got, want):
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err <= 1e-4 * scale, f"max |logits - reference| = {err:.3g} (scale {scale:.3g})"


def test_hybrid_chunked_prefill_then_megakernel_decode_equals_the_reference():
    """Two requests of 13 and 7 prompt tokens, each prefilled in two chunks (the second batch
    padded past 64 token rows: the chunked form of the delta rule), then 3 decode-only batches
    through the megakernel: every step's logits equal the reference's over the whole sequence
    and give its greedy tokens. The state array starts full of another request's leftovers
    (a request's first chunk resets its slot), and the padding request slots' block-table rows
    name the live requests' blocks (stale metadata: they must write no state)."""
    cfg, params, run, serve = setup()
    rng = np.random.default_rng(3)
    width = states.row_width(run, BLOCK)
    shape = kv.cache_shape(run.kv_layers, NUM_BLOCKS, BLOCK, run.attention.kv_size)
    cache = (jnp.zeros(shape, R.jnp_dtype(run)), jnp.zeros(shape, R.jnp_dtype(run)),
             jnp.asarray(rng.normal(size=(len(run.linear_layers), NUM_BLOCKS, BLOCK, width)), R.jnp_dtype(run)))
    tables = np.zeros((SLOTS, CONTEXT // BLOCK), np.int32)
    tables[:2] = [[7, 2], [4, 9]]
    tables[2:] = tables[:2].repeat(2, 0)  # stale rows past num_reqs
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (13, 7)]
    two = jnp.int32(2)

    ids, pos, qsl, lens = batch_inputs([prompts[0][:8], prompts[1][:4]], [0, 0], 16)
    cache, rows = serve(cache, ids, pos, qsl, lens, tables, two)
    assert_close(np.asarray(rows)[qsl[1:3] - 1], reference_logits(cfg, params, [prompts[0][:8], prompts[1][:4]]))
    ids, pos, qsl, lens = batch_inputs([prompts[0][8:], prompts[1][4:]], [8, 4], 80)
    cache, rows = serve(cache, ids, pos, qsl, lens, tables, two)
    want = reference_logits(cfg, params, prompts)
    assert_close(np.asarray(rows)[qsl[1:3] - 1], want)
    seqs = [p + [int(np.argmax(w))] for p, w in zip(prompts, want)]

    for _ in range(3):  # decode-only batches: the megakernel on vLLM's arrays and the state pool
        ids, pos, qsl, lens = batch_inputs([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], 8)
        cache, rows = serve(cache, ids, pos, qsl, lens, tables, two)
        want = reference_logits(cfg, params, seqs)
        got = np.asarray(rows)[:2]
        assert_close(got, want)
        assert [int(np.argmax(g)) for g in got] == [int(np.argmax(w)) for w in want]
        seqs = [s + [int(np.argmax(w))] for s, w in zip(seqs, want)]

    # a mixed batch after the megakernel's steps (their tokens left pending in the pool): both
    # decode through the reference layers, replaying the pending rows first
    ids, pos, qsl, lens = batch_inputs([[s[-1]] for s in seqs] + [[5, 6]], [len(s) - 1 for s in seqs] + [0], 16)
    t3 = tables.copy()
    t3[2] = [1, 3]
    cache, rows = serve(cache, ids, pos, qsl, lens, t3, jnp.int32(3))
    assert_close(np.asarray(rows)[qsl[1:4] - 1], reference_logits(cfg, params, seqs + [[5, 6]]))
