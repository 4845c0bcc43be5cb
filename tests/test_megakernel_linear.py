"""Linear attention in the megakernel (issue 55): Gated DeltaNet and KDA layers beside softmax
attention, each sequence's state streamed from the pool through VMEM.

Every case runs one prefilled step of the kernel in interpret mode with the race detector
against the reference step (logits, the KV cache and every pool array: states, windows,
pending rows), then the same build compiled deviceless for TPU7x and v6e. The cases cover both
recurrences, float32 and bfloat16, one step and a verify step (q_len 3), int8 weights (the ring
streams the linear families' codes, their column scales after the K sweep), a pool of more
slots than sequences, a slot outside the pool (unchecked: it reads a clipped slot and writes
nothing) and MLA beside KDA (Kimi Linear's NoPE MLA). Then: a q_len 3 verify step equals three
single steps; the plan counts the pool's bytes (the hand count, and the issue's 2 % bar for
Qwen3-Next-80B-A3B at batch 8); the refusals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_megakernel import races_found
from tpumk.compile.aot import compile_for
from tpumk.errors import NotSupportedError, PlanError
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step, step_specs
from tpumk.model import linear_attention as LA
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.quantize import quantize_params
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

CONTEXT, PAGE = 64, 16
# The smallest hybrids on whole lane tiles: two linear layers, then an attention layer (gated
# for Gated DeltaNet), heads of 128; Gated DeltaNet groups 2 value heads on 1 key head.
GDN = dict(name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=1,
           linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)
KDA = dict(name="tiny-kda", num_layers=3, linear_kind="kda", linear_layers=(0, 2), linear_key_heads=2,
           linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=3)


def hybrid(kind: str, dtype: str = "float32", mla: bool = False):
    base = load_preset("tiny-mla" if mla else "tiny-dense").replace(dtype=dtype)
    over = dict(GDN if kind == "gdn" else KDA)
    if mla:  # Kimi Linear: KDA beside MLA without RoPE (tiny-mla's widths on whole lanes)
        over.update(name="tiny-kda-mla", hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128,
                    dense_layers=(0,), nope_layers=(1,))
    return base.replace(**over)


# (case: kind, dtype, batch, q_len, quant, extra slots, a bad slot, mla)
CASES = {
    "gdn-f32-b2-q1": ("gdn", "float32", 2, 1, "none", 0, False, False),
    "kda-bf16-b2-q3": ("kda", "bfloat16", 2, 3, "none", 2, False, False),
    "gdn-bf16-b3-q1-int8": ("gdn", "bfloat16", 3, 1, "int8", 0, True, False),
    "kda-mla-f32-b2-q1": ("kda", "float32", 2, 1, "none", 0, False, True),
}


# Cases whose step also writes hidden-state taps (issue 56): a linear layer's input, an attention
# layer's, the final norm's output.
TAPS = {"kda-bf16-b2-q3": (2, 3, 1), "kda-mla-f32-b2-q1": (1, 3)}


@functools.lru_cache(maxsize=8)
def _plan_and_step(case: str):
    kind, dtype, batch, q_len, quant, _, _, mla = CASES[case]
    cfg = hybrid(kind, dtype, mla)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, TuningConfig(), q_len=q_len, page_size=PAGE,
                               quant=quant, taps=TAPS.get(case, ())), num_slots=batch + CASES[case][5])
    return cfg, plan, make_decode_step(plan, detect_races=True)


def _prefilled(cfg, params, batch: int, q_len: int, extra: int, seed: int = 0):
    """A cache after a reference prefill of prompts of different lengths (their states committed)."""
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE, pending=q_len, num_slots=batch + extra, seed=seed)
    prompts = [list(np.random.default_rng(b).integers(0, cfg.vocab_size, 5 + 3 * b)) for b in range(batch)]
    return R.prefill(params, cfg, prompts, cache, step_fn=R.jitted_decode_step(cfg))[1]


# The int8 / bad-slot case and KDA beside MLA are the full tier (tests/README.md): 38 s and 104 s
# serially here; the two default cases cover the linear stage in float32 and bfloat16 with taps.
FULL = ("gdn-bf16-b3-q1-int8", "kda-mla-f32-b2-q1")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c in FULL else c for c in CASES])
def test_step_matches_reference_and_compiles(case):
    kind, dtype, batch, q_len, quant, extra, bad_slot, mla = CASES[case]
    cfg, plan, step = _plan_and_step(case)
    params = random_params(cfg, seed=3)
    if quant != "none":
        params = quantize_params(cfg, params, quant)
    cache = _prefilled(cfg, params, batch, q_len, extra)
    if bad_slot:  # unchecked: the last sequence's slot is outside the pool
        cache = cache._replace(states=cache.states._replace(slots=cache.states.slots.at[-1].set(batch + extra + 5)))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    taps = TAPS.get(case, ())
    got, new, *got_taps = step(pack_weights(plan, params), tokens, positions, cache)
    assert not races_found(), "the interpreter's race detector reported a DMA race"
    want, ref = R.jitted_decode_step(cfg)(params, tokens, positions, cache)
    scale = float(np.max(np.abs(np.asarray(want))))
    # float32: rounding only (the kernel's k.S' and q.S' are MXU sums in another order); bfloat16:
    # the rows each product rounds to bfloat16 (relative 2^-8) through three layers
    tol = 2e-5 if dtype == "float32" else 3e-2
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) <= tol * scale
    if taps:  # the residual entering each tapped layer, as the reference's
        want_taps = np.asarray(R.jitted_decode_step(cfg, taps)(params, tokens, positions, cache)[2], np.float32)
        err = np.max(np.abs(np.asarray(got_taps[0], np.float32) - want_taps))
        assert got_taps[0].shape == want_taps.shape and err <= tol * max(1.0, float(np.max(np.abs(want_taps))))
    for name in ("recurrent", "conv", "pending"):
        a, b = np.asarray(getattr(new.states, name)), np.asarray(getattr(ref.states, name))
        assert np.max(np.abs(a - b)) <= tol * max(1.0, float(np.max(np.abs(b)))), name
    assert np.array_equal(np.asarray(new.states.counts), np.asarray(ref.states.counts))
    if bad_slot:  # nothing outside the pool was written: every other slot as the reference left it
        assert np.asarray(new.states.recurrent).shape == np.asarray(cache.states.recurrent).shape
    k_new, k_ref = (c.k for c in (new, ref))
    assert np.max(np.abs(np.asarray(k_new, np.float32) - np.asarray(k_ref, np.float32))) <= tol * max(
        1.0, float(np.max(np.abs(np.asarray(k_ref, np.float32)))))
    for target in ("tpu7x", "v6e"):  # interpret mode does not check Mosaic's layout rules
        tplan = make_plan(BuildSpec(cfg, get_target(target), batch, 256, TuningConfig(), q_len=q_len, page_size=PAGE,
                                    quant=quant, taps=taps))
        compiled = compile_for(make_decode_step(tplan), step_specs(tplan), get_target(target))
        assert compiled.custom_calls == 1


def test_verify_step_equals_single_steps_and_rolls_back():
    """A q_len 3 step leaves its tokens pending (the state written back is the one before them);
    the next step applies them first, so verify-then-step gives the logits of three single
    steps then one; keeping one of the three (a rejected draft) gives the states of one step."""
    cfg = hybrid("gdn")
    params = random_params(cfg, seed=4)
    step = R.jitted_decode_step(cfg)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    pool3, pool1 = (_prefilled(cfg, params, 2, q, 0) for q in (3, 1))
    pos3 = pool3.lengths[:, None] + jnp.arange(3)[None]
    verify, after3 = step(params, toks[:, :3], pos3, pool3)
    singles, c1 = [], pool1
    for i in range(3):
        logits, c1 = step(params, toks[:, i:i + 1], c1.lengths[:, None], c1)
        singles.append(logits)
    assert np.max(np.abs(np.asarray(verify) - np.asarray(jnp.concatenate(singles, 1)))) <= 1e-5 * 8
    a, _ = step(params, toks[:, 3:4], after3.lengths[:, None], after3)
    b, _ = step(params, toks[:, 3:4], c1.lengths[:, None], c1)
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) <= 1e-5 * 8
    # roll back to the first token of the three: the pool replays one row, as after one step
    kept = after3._replace(lengths=pool3.lengths + 1, states=LA.keep_accepted(after3.states, jnp.asarray([1, 1])))
    one = pool1
    _, one = step(params, toks[:, :1], one.lengths[:, None], one)
    x, _ = step(params, toks[:, 4:5], kept.lengths[:, None], kept)
    y, _ = step(params, toks[:, 4:5], one.lengths[:, None], one)
    assert np.max(np.abs(np.asarray(x) - np.asarray(y))) <= 1e-5 * 8


def test_chunked_prefill_equals_the_recurrent_form():
    """The chunked gated delta rule (prefill) equals token-by-token steps, both recurrences, a
    start state and a sequence crossing chunk boundaries."""
    rng = np.random.default_rng(2)
    b, t, hv, dk, dv = 2, 70, 3, 16, 8
    q, k = (jnp.asarray(rng.standard_normal((b, t, hv, dk)), jnp.float32) / 4 for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), jnp.float32)
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, hv)), jnp.float32))
    s0 = jnp.asarray(rng.standard_normal((b, hv, dk, dv)), jnp.float32)
    for g in (jnp.broadcast_to(-jnp.abs(jnp.asarray(rng.standard_normal((b, t, hv, 1)), jnp.float32)), (b, t, hv, dk)),
              -jnp.abs(jnp.asarray(rng.standard_normal((b, t, hv, dk)), jnp.float32))):
        s, outs = s0, []
        for i in range(t):
            s, o = LA.delta_step(s, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
            outs.append(o)
        s_chunk, o_chunk = LA.delta_chunked(s0, q, k, v, g, beta, chunk=16)
        assert np.max(np.abs(np.asarray(o_chunk) - np.asarray(jnp.stack(outs, 1)))) <= 1e-4
        assert np.max(np.abs(np.asarray(s_chunk) - np.asarray(s))) <= 1e-4


def test_plan_counts_the_pool_bytes():
    """Per step every sequence's slot entry (state, window, pending rows) is read and written in
    every linear layer: the plan's `linear_states` bytes are the hand count (Qwen3-Next-80B-A3B
    at batch 8: 36 linear layers x 8 slots x 2 MiB state x 2, within the issue's 2 %), the
    windows and pending rows are counted beside them, and the step's floor includes both."""
    cfg = load_preset("qwen3-next-80b-a3b")
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 8, 4096, devices=8,
                               tuning=TuningConfig(kv_tile_pages=16, kv_buffers=3, expert_slots=2)))
    state = 32 * 128 * 128 * 4  # float32, the whole model's value heads (8 devices x 4)
    hand = 36 * 8 * state * 2
    assert abs(plan.hbm["linear_states"] * plan.devices - hand) <= 0.02 * hand
    g = plan.linear
    assert plan.hbm["linear_windows"] == 2 * 36 * 8 * (g.window_bytes + g.pending_bytes) > 0
    assert plan.floor_seconds * plan.target.hbm_bandwidth == pytest.approx(plan.hbm_bytes)


@pytest.mark.parametrize("change, what", [
    (dict(linear_key_dim=64, linear_value_dim=64), "key_dim = 64"),
    (dict(linear_conv=6), "taps = 6"),
    (dict(sliding_window=4, sliding_layers=(2,)), "sliding_layers with linear-attention layers"),
])
def test_what_the_kernel_does_not_build_is_refused(change, what):
    cfg = hybrid("gdn").replace(**change)
    with pytest.raises((PlanError, NotSupportedError), match=what):
        make_plan(BuildSpec(cfg, get_target("cpu"), 1, CONTEXT, page_size=PAGE))


def test_a_pool_of_another_shape_is_refused():
    cfg, plan, step = _plan_and_step("gdn-f32-b2-q1")
    params = random_params(cfg, seed=3)
    cache = R.init_cache(cfg, 2, CONTEXT, PAGE, pending=3)  # the plan's steps keep q_len = 1 rows
    with pytest.raises(ValueError, match="states.pending has shape"):
        step(pack_weights(plan, params), jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32), cache)
    with pytest.raises(ValueError, match="needs its state pool"):
        step(pack_weights(plan, params), jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
             cache._replace(states=None))


def test_a_shared_slot_unchecked_writes_only_that_slot():
    """Unchecked (the host check refuses it: tests/test_positions.py), two sequences on one state
    slot: which write lands is not defined, but the kernel and the reference write that slot
    alone: every other slot of the pool, the KV cache outside the step's rows and the lengths are
    as the reference leaves them, and the shared slot holds finite values. (The step reuses the
    kda-bf16-b2-q3 build of the first test: 4 slots for 2 sequences.)"""
    cfg, plan, step = _plan_and_step("kda-bf16-b2-q3")
    params = random_params(cfg, seed=3)
    cache = _prefilled(cfg, params, 2, 3, 2)
    shared = int(cache.states.slots[0])
    cache = cache._replace(states=cache.states._replace(slots=jnp.asarray([shared, shared], jnp.int32)))
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 3)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(3, dtype=jnp.int32)[None, :]
    new = step(pack_weights(plan, params), tokens, positions, cache)[1]  # (this build also returns taps)
    _, ref = R.jitted_decode_step(cfg)(params, tokens, positions, cache)
    others = np.arange(cache.states.num_slots) != shared
    for name in ("recurrent", "conv", "pending"):
        before = np.asarray(getattr(cache.states, name))
        for got in (np.asarray(getattr(new.states, name)), np.asarray(getattr(ref.states, name))):
            assert got.shape == before.shape and np.array_equal(got[:, others], before[:, others]), name
            assert np.isfinite(got[:, shared]).all(), name
    assert np.asarray(new.states.counts)[others].tolist() == np.asarray(cache.states.counts)[others].tolist()
    assert np.array_equal(np.asarray(new.lengths), np.asarray(ref.lengths))
    k_new, k_ref = (np.asarray(c.k, np.float32) for c in (new, ref))
    assert np.max(np.abs(k_new - k_ref)) <= 3e-2 * max(1.0, float(np.max(np.abs(k_ref))))
