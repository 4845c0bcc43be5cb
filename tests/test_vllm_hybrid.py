"""The vLLM plugin's steps on a hybrid model (Gated DeltaNet beside gated attention), without
vLLM: the linear layers' state pool in vLLM's cache (tpumk.vllm.states: a request's slot is its
first block), a prompt prefilled in two ragged chunks through the reference layers, then decode
steps through the megakernel (Pallas interpreter), against the reference over whole sequences."""

from __future__ import annotations

import re

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
from tpumk.vllm import kv, states, steps
from tpumk.vllm.runtime import pool_plan

from test_vllm_adapter import batch_inputs  # vLLM's flattened batch (6 request slots, as here)

BLOCK, NUM_BLOCKS, SLOTS, CONTEXT = 16, 11, 6, 32
# every batch padded to one token bucket past 64 rows (the chunked form of the delta rule): one
# compile of the served step (both of its branches) for the whole test
TOKENS = 80
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


def reference_logits(cfg, params, seqs):
    """The reference's logits [len(seqs), longest, V] at every position of each whole sequence (one
    causal forward; a shorter sequence padded at its end, which no earlier position sees)."""
    longest = max(len(q) for q in seqs)
    tokens = np.array([list(q) + [0] * (longest - len(q)) for q in seqs], np.int32)
    return np.asarray(jax.jit(R.forward_full, static_argnums=1)(params, cfg, jnp.asarray(tokens)))


def assert_close(got, want):
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err <= 1e-4 * scale, f"max |logits - reference| = {err:.3g} (scale {scale:.3g})"


def test_hybrid_chunked_prefill_then_megakernel_decode_equals_the_reference():
    """Two requests of 13 and 7 prompt tokens, each prefilled in two chunks, then 3 decode-only batches
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
    got = []  # (request, position, the served logits there)

    def served(rows, qsl, n, seqs):
        for r in range(n):
            got.append((r, len(seqs[r]) - 1, np.asarray(rows)[qsl[r + 1] - 1]))
        assert not np.any(np.asarray(rows)[qsl[n]:]), "rows past the last request are zero"

    ids, pos, qsl, lens = batch_inputs([prompts[0][:8], prompts[1][:4]], [0, 0], TOKENS)
    cache, rows = serve(cache, ids, pos, qsl, lens, tables, two)
    served(rows, qsl, 2, [prompts[0][:8], prompts[1][:4]])
    ids, pos, qsl, lens = batch_inputs([prompts[0][8:], prompts[1][4:]], [8, 4], TOKENS)
    cache, rows = serve(cache, ids, pos, qsl, lens, tables, two)
    served(rows, qsl, 2, prompts)
    seqs = [p + [int(np.argmax(g))] for p, (_, _, g) in zip(prompts, got[-2:])]

    for _ in range(3):  # decode-only batches: the megakernel on vLLM's arrays and the state pool
        ids, pos, qsl, lens = batch_inputs([[q[-1]] for q in seqs], [len(q) - 1 for q in seqs], TOKENS)
        cache, rows = serve(cache, ids, pos, qsl, lens, tables, two)
        served(rows, qsl, 2, seqs)
        seqs = [q + [int(np.argmax(g))] for q, (_, _, g) in zip(seqs, got[-2:])]

    # a mixed batch after the megakernel's steps (their tokens left pending in the pool): both
    # decode through the reference layers, replaying the pending rows first, beside a new request
    seqs.append([5, 6])
    ids, pos, qsl, lens = batch_inputs([[q[-1]] for q in seqs[:2]] + [seqs[2]], [len(q) - 1 for q in seqs[:2]] + [0],
                                       TOKENS)
    t3 = tables.copy()
    t3[2] = [1, 3]
    cache, rows = serve(cache, ids, pos, qsl, lens, t3, jnp.int32(3))
    served(rows, qsl, 3, seqs)

    want = reference_logits(cfg, params, seqs)
    assert len(got) == 13  # 2 chunks and 3 decode steps of 2 requests, a mixed batch of 3
    for r, at, g in got:  # every served row against the reference at its position: logits and greedy token
        assert_close(g, want[r, at])
        assert int(np.argmax(g)) == int(np.argmax(want[r, at])), (r, at)


@pytest.mark.full  # the served step's path is the default test above (interpreter); this compiles it for TPU7x
def test_hybrid_served_step_compiles_deviceless_for_tpu7x_with_the_pool_in_place():
    """The served step of the hybrid (the lax.cond between the megakernel on vLLM's pool of
    NUM_BLOCKS blocks and state slots, and the ragged prefill with its linear layers) compiles
    deviceless for TPU7x with K, V and the state array donated as vLLM donates them, and all
    three are aliased to outputs (written in place)."""
    from tpumk.compile.aot import compile_for

    cfg = load_preset("tiny-dense").replace(**HYBRID)
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), batch=4, context=CONTEXT, page_size=BLOCK))
    step = make_decode_step(pool_plan(plan, NUM_BLOCKS), nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    run = plan.whole_model
    params = jax.eval_shape(lambda: random_params(run, seed=0))
    packed = jax.eval_shape(lambda: pack_weights(plan, random_params(cfg, seed=0)))

    def served(k, v, state, packed, params, ids, pos, qsl, seq_lens, tables, n):
        return steps.serve_step(step, packed, params, run, shape, k, v, ids, pos, qsl, seq_lens, tables, n, BLOCK,
                                CONTEXT, state=state)

    dt = R.jnp_dtype(run)
    cache = jax.ShapeDtypeStruct(kv.cache_shape(run.kv_layers, NUM_BLOCKS, BLOCK, run.attention.kv_size), dt)
    pool = jax.ShapeDtypeStruct((len(run.linear_layers), NUM_BLOCKS, BLOCK, states.row_width(run, BLOCK)), dt)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    compiled = compile_for(served, (cache, cache, pool, packed, params, i32(TOKENS), i32(TOKENS), i32(SLOTS + 1),
                                    i32(SLOTS), i32(SLOTS, CONTEXT // BLOCK), i32()), plan.target,
                           donate_argnums=(0, 1, 2))
    aliases = re.search(r"input_output_alias=\{ (.*?) \}", compiled.hlo_text)
    assert aliases, "no input_output_alias in the compiled program"
    for param in (0, 1, 2):  # the step's ((k, v, state), rows): outputs 0-2 are parameters 0-2
        assert re.search(rf"\{{{param}\}}: \({param}, \{{\}}", aliases.group(1)), aliases.group(1)
