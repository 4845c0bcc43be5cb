"""Positions, lengths and non-finite logits: the host check, and what the kernel and the
reference do with positions the host did not check.

Kernel configurations here run in Pallas TPU interpret mode with the race detector on AND are
compiled deviceless for TPU7x in the same test (interpret mode does not check TPU
layout rules). Each test reproduces a defect of the code before the positions hardening:
- a negative position in sequence 0 changed sequence 1's and 2's KV cache and logits (the flat
  tile loop lost its alignment when sequence 0 streamed no tile) and, at -page_size, row 0 of
  sequence 0's first page;
- position 32 of a 32-token cache overwrote row 16 and set the length to 33, silently;
- NaN logits decoded as token 0; prompt ids like '1_0' or full-width digits were accepted;
  --page-size 0 was a traceback.
"""

from __future__ import annotations

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from test_megakernel import model, prompts_of, races_found

from tpumk.cli import main
from tpumk.compile.aot import compile_for
from tpumk.decode.drafters import DraftModelDrafter, NgramDrafter
from tpumk.decode.generate import (Model, generate, load_draft_model, load_model, parse_prompt_ids,
                                   reference_step)
from tpumk.decode.speculative import speculative_generate
from tpumk.errors import ConfigError, NonFiniteError, PositionError
from tpumk.export.artifacts import DecodeStep
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step, step_specs
from tpumk.model import reference as R
from tpumk.model.positions import check_finite, check_step
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import MAX_BATCH, MAX_CONTEXT, MAX_PAGE_SIZE, MAX_Q_LEN, BuildSpec
from tpumk.targets import get_target

CONTEXT, PAGE = 32, 16  # 2 pages per sequence: capacity 32
LENGTHS = [20, 9, 17]  # sequence 0 is on its second page


@functools.lru_cache(maxsize=None)
def prefilled(batch: int):
    cfg, params = model("tiny-dense", "float32")
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of(LENGTHS[:batch], cfg.vocab_size), cache,
                         step_fn=reference_step(cfg))
    return cfg, params, cache


# ---------------------------------------------------------------------- the host check
def test_check_step_accepts_the_contract():
    cfg, _, cache = prefilled(3)
    lengths = np.asarray(cache.lengths)
    check_step(lengths[:, None], cache)  # the next token of each sequence
    check_step(lengths[:, None] + np.arange(3)[None], cache)  # a q = 3 step
    check_step(np.asarray([[5], [9], [0]]), cache)  # rewriting from below the length (rollback)


@pytest.mark.parametrize("positions, match", [
    ([[-1], [9], [17]], "sequence 0 token 0 has position -1, expected 0 <= position < capacity 32"),
    ([[32], [9], [17]], "sequence 0 token 0 has position 32, expected 0 <= position < capacity 32"),
    ([[20], [9], [40]], "sequence 2 token 0 has position 40"),
    ([[20], [11], [17]], "sequence 1 starts at position 11 but holds 9 tokens, expected a first position <= 9"),
])
def test_check_step_rejects_bad_positions(positions, match):
    _, _, cache = prefilled(3)
    with pytest.raises(PositionError, match=match) as e:
        check_step(np.asarray(positions), cache, where="generate step 3")
    assert str(e.value).startswith("generate step 3: ") and "\n" not in str(e.value)


def test_check_step_rejects_non_consecutive_and_past_capacity_steps():
    _, _, cache = prefilled(3)
    with pytest.raises(PositionError, match="sequence 1 token 1 has position 11, expected 10 .*consecutive"):
        check_step(np.asarray([[20, 21], [9, 11], [17, 18]]), cache)
    with pytest.raises(PositionError, match="sequence 0 token 1 has position 32"):
        check_step(np.asarray([[31, 32], [9, 10], [17, 18]]), cache._replace(lengths=jnp.asarray([31, 9, 17])))
    with pytest.raises(PositionError, match="sequence 2 has length 33, expected 0 <= length <= capacity 32"):
        check_step(np.asarray([[20], [9], [17]]), cache._replace(lengths=jnp.asarray([20, 9, 33])))


def test_check_step_rejects_bad_block_tables():
    _, _, cache = prefilled(3)
    tables = np.asarray(cache.block_tables).copy()
    bad = cache._replace(block_tables=jnp.asarray(np.where(np.arange(2)[None] == 1, 99, tables)))
    with pytest.raises(PositionError, match="sequence 0 block table entry 1 is page 99, expected a page id in"):
        check_step(np.asarray([[20], [9], [17]]), bad)
    shared = tables.copy()
    shared[1, 0] = tables[0, 1]  # sequence 1 would write sequence 0's page
    with pytest.raises(PositionError, match=f"sequences 0 and 1 both write page {tables[0, 1]}"):
        check_step(np.asarray([[20], [9], [17]]), cache._replace(block_tables=jnp.asarray(shared)))


def test_check_step_rejects_a_page_one_sequence_writes_and_another_reads():
    _, _, cache = prefilled(3)  # lengths 20, 9, 17: every sequence reads pages 0 .. its last
    tables = np.asarray(cache.block_tables)
    shared = tables.copy()
    shared[1, 0] = tables[0, 0]  # a shared prefix page that sequence 1 writes and 0 reads
    with pytest.raises(PositionError, match=f"sequence 1 writes page {tables[0, 0]} that sequence 0 reads") as e:
        check_step(np.asarray([[20], [9], [17]]), cache._replace(block_tables=jnp.asarray(shared)))
    assert "\n" not in str(e.value)
    shared = tables.copy()
    shared[2, 0] = tables[0, 1]  # sequence 0 writes it (position 20), sequence 2 reads it
    with pytest.raises(PositionError, match=f"sequence 0 writes page {tables[0, 1]} that sequence 2 reads"):
        check_step(np.asarray([[20], [9], [17]]), cache._replace(block_tables=jnp.asarray(shared)))
    # A page shared by readers only (a common prefix nobody writes this step) is fine.
    shared = tables.copy()
    shared[2, 0] = tables[0, 0]
    check_step(np.asarray([[20], [9], [17]]), cache._replace(block_tables=jnp.asarray(shared)))


def test_check_step_refuses_an_empty_step():
    _, _, cache = prefilled(3)
    with pytest.raises(PositionError, match=r"positions \(3, 0\).*expected \[B, q\] with q >= 1"):
        check_step(np.zeros((3, 0), np.int32), cache)


# ---------------------------------------------------------------------- a hybrid's state pool
# The smallest Gated DeltaNet hybrid (tests/test_megakernel_linear.py's): linear layers 0 and 1.
GDN = dict(name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=1,
           linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)


def hybrid_cache(slots, pending: int = 1, num_slots: int = 4):
    cfg = model("tiny-dense", "float32")[0].replace(**GDN)
    cache = R.init_cache(cfg, len(slots), CONTEXT, PAGE, pending=pending, num_slots=num_slots)
    return cache._replace(states=cache.states._replace(slots=jnp.asarray(slots, jnp.int32)))


@pytest.mark.parametrize("slots, match", [
    ([2, 7, 0], r"sequence 1 has state slot 7, expected a slot in \[0, 4\) \(the pool's 4 slots\)"),
    ([-1, 1, 0], r"sequence 0 has state slot -1, expected a slot in \[0, 4\)"),
    ([2, 0, 2], r"sequences 0 and 2 both have state slot 2, expected one slot per sequence"),
])
def test_check_step_refuses_a_state_slot_outside_the_pool_or_shared(slots, match):
    """Before: a hybrid's slots were not checked (the kernel reads a clipped slot and writes
    nothing, or two sequences write one slot): the step ran on another sequence's state."""
    with pytest.raises(PositionError, match=match) as e:
        check_step(np.zeros((3, 1), np.int32), hybrid_cache(slots), where="generate step 2")
    assert str(e.value).startswith("generate step 2: ") and "\n" not in str(e.value)
    check_step(np.zeros((3, 1), np.int32), hybrid_cache([3, 0, 1]))  # distinct slots in the pool


def test_check_step_refuses_a_step_longer_than_the_pending_rows_it_must_stay_in():
    """A step whose tokens must stay pending (a verify step, a megakernel artifact's step) on a
    pool of fewer pending rows would apply them at once: a rollback would then keep rejected
    drafts in the state. Any other step (a prompt) may be longer."""
    cache = hybrid_cache([1, 0, 3], pending=2)
    three = np.tile(np.arange(3), (3, 1))
    with pytest.raises(PositionError, match=r"verify step 1: sequence 0 \(state slot 1\): a step of 3 tokens that "
                                            r"must stay pending on a pool of 2 pending rows per slot, expected at "
                                            r"least 3 \(reference.init_cache\(..., pending=3\)"):
        check_step(three, cache, where="verify step 1", keep_pending=True)
    check_step(three, cache)  # applied at once: defined
    check_step(three[:, :2], cache, keep_pending=True)


def test_speculation_on_a_pool_without_rows_for_its_drafts_is_refused():
    cfg = model("tiny-dense", "float32")[0].replace(**GDN)
    from tpumk.model.weights import random_params

    params = random_params(cfg, seed=0)
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE, pending=1)  # a verify step of 3 needs 3 rows
    with pytest.raises(PositionError, match=r"verify step 1: sequence 0 \(state slot 0\): a step of 3 tokens"):
        speculative_generate(params, cfg, [[1, 2, 3]], 4, cache, NgramDrafter(), 2, step_fn=reference_step(cfg))


def test_new_lengths_is_the_rule_of_the_reference_and_the_kernel():
    from tpumk.model.positions import new_lengths

    got = new_lengths(jnp.asarray([[4, 5], [-1, 0], [31, 32], [40, 41]]), jnp.asarray([4, 7, 31, 9]), 32)
    np.testing.assert_array_equal(np.asarray(got), [6, 7, 32, 9])


def loop_check(positions, cache):
    """The per-sequence, per-page scan check_step replaces (plus the write/read rule): the
    first message it would raise, or None."""
    pos, lengths, tables = (np.asarray(a).astype(np.int64) for a in (positions, cache.lengths, cache.block_tables))
    page_size, num_pages = int(cache.k.shape[2]), int(cache.k.shape[1])
    cap = tables.shape[1] * page_size
    written, read = {}, {}
    for b in range(pos.shape[0]):
        n = int(lengths[b])
        if not 0 <= n <= cap:
            return f"sequence {b} has length {n}"
        for i in range(pos.shape[1]):
            p = int(pos[b, i])
            if not 0 <= p < cap:
                return f"sequence {b} token {i} has position {p}, expected 0 <= position"
            if p != int(pos[b, 0]) + i:
                return f"sequence {b} token {i} has position {p}, expected {int(pos[b, 0]) + i}"
        start, last = int(pos[b, 0]), int(pos[b, -1]) // page_size
        if start > n:
            return f"sequence {b} starts at position {start}"
        for lp in range(last + 1):
            if not 0 <= int(tables[b, lp]) < num_pages:
                return f"sequence {b} block table entry {lp} is page {int(tables[b, lp])}"
        seen = {}
        for lp in range(last + 1):  # a page twice in one sequence's read pages (issue 24)
            page = int(tables[b, lp])
            if page in seen:
                return f"sequence {b} block table entries {seen[page]} and {lp} are both page {page}"
            seen[page] = lp
        mine = {int(tables[b, lp]) for lp in range(start // page_size, last + 1)}
        for lp in range(start // page_size, last + 1):
            page = int(tables[b, lp])
            if written.get(page, b) != b:
                return f"sequences {written[page]} and {b} both write page {page}"
        for lp in range(last + 1):
            page = int(tables[b, lp])
            if page in mine and read.get(page, b) != b:
                return f"sequence {b} writes page {page} that sequence {read[page]} reads"
            if page not in mine and written.get(page, b) != b:
                return f"sequence {written[page]} writes page {page} that sequence {b} reads"
        for lp in range(last + 1):
            read.setdefault(int(tables[b, lp]), b)
        for page in mine:
            written.setdefault(page, b)
    return None


def test_check_step_matches_a_per_page_scan():
    """The vectorised check reports what a scan of the sequences in order would report first."""
    rng = np.random.default_rng(0)
    B, pps, P, num_pages = 4, 4, 8, 20
    k = np.broadcast_to(np.float32(0), (1, num_pages, P, 1))
    for trial in range(400):
        lengths = rng.integers(-1, pps * P + 2, B)
        start = np.clip(lengths - rng.integers(0, 3, B), -2, None)
        q = int(rng.integers(1, 4))
        pos = start[:, None] + np.arange(q)[None]
        if rng.random() < 0.2:
            pos[rng.integers(B), rng.integers(q)] += int(rng.integers(-3, 4))
        tables = rng.permutation(num_pages)[:B * pps].reshape(B, pps)
        for _ in range(int(rng.integers(0, 3))):  # shared pages and bad entries
            tables[rng.integers(B), rng.integers(pps)] = rng.choice([-1, num_pages, int(rng.integers(num_pages))])
        cache = R.KVCache(k, k, tables, lengths)
        want = loop_check(pos, cache)
        if want is None:
            check_step(pos, cache)
            continue
        with pytest.raises(PositionError) as e:
            check_step(pos, cache)
        assert str(e.value).startswith("decode step: " + want), (trial, str(e.value), want)


def test_check_step_is_vectorised():
    """No per-sequence or per-page Python loop (the loop took ~14 ms per step at B = 64, a 32k
    context and 16-token pages): the Python lines check_step runs do not grow with the batch
    or the pages per sequence (counted with a trace hook, not timed: CI cores are shared)."""
    import sys

    def lines_run(B, pps, P=16):
        k = np.broadcast_to(np.float32(0), (1, B * pps, P, 1))
        lengths = np.full(B, pps * P - 1)
        cache = R.KVCache(k, k, np.arange(B * pps).reshape(B, pps), lengths)
        count = 0

        def tracer(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename.endswith("positions.py"):
                if event == "line":
                    count += 1
                return tracer
            return None

        sys.settrace(tracer)
        try:
            check_step(lengths[:, None], cache)
        finally:
            sys.settrace(None)
        return count

    assert lines_run(64, 2048) == lines_run(2, 4)


# ---------------------------------------------------------------------- unchecked inputs
def changed_rows(before: R.KVCache, after: R.KVCache, seq: int) -> list[int]:
    """Logical positions of sequence `seq` whose K or V row differs (any layer)."""
    tables = np.asarray(before.block_tables)[seq]
    out = []
    for name in ("k", "v"):
        a = np.asarray(getattr(before, name))[:, tables]  # [L, pages, P, kv]
        b = np.asarray(getattr(after, name))[:, tables]
        diff = np.any(a != b, axis=(0, 3)).reshape(-1)
        out += [int(p) for p in np.nonzero(diff)[0]]
    return sorted(set(out))


def assert_isolated(bad_run, good_run, cache, positions, capacity=CONTEXT):
    """Sequences 1.. equal the run without the bad position bit for bit; sequence 0's cache
    changes only at its in-range positions and its length stays within the capacity."""
    (logits, new), (good_logits, good) = bad_run, good_run
    batch = cache.block_tables.shape[0]
    np.testing.assert_array_equal(np.asarray(logits[1:]), np.asarray(good_logits[1:]))
    for name in ("k", "v"):
        a, b = np.asarray(getattr(new, name)), np.asarray(getattr(good, name))
        for s in range(1, batch):
            pages = np.asarray(cache.block_tables)[s]
            np.testing.assert_array_equal(a[:, pages], b[:, pages], err_msg=f"{name} of sequence {s}")
    # Pages of no sequence stay as they were too.
    owned = set(np.asarray(cache.block_tables).reshape(-1).tolist())
    free = [p for p in range(cache.k.shape[1]) if p not in owned]
    np.testing.assert_array_equal(np.asarray(new.k)[:, free], np.asarray(cache.k)[:, free])
    np.testing.assert_array_equal(np.asarray(new.lengths)[1:], np.asarray(good.lengths)[1:])
    allowed = sorted(int(p) for p in positions[0] if 0 <= p < capacity)
    assert set(changed_rows(cache, new, 0)) <= set(allowed), "a row outside the contract changed"
    want_len = max([int(cache.lengths[0])] + [p + 1 for p in allowed])
    assert int(new.lengths[0]) == want_len <= capacity
    assert np.all(np.isfinite(np.asarray(logits)))


# (q_len, positions of sequence 0 in place of its good ones): negative (-16 was row 0 of its
# first page), at the capacity (overwrote row 16), far past it, and mixed with a good position.
BAD = [(1, [-1]), (1, [-16]), (1, [32]), (1, [40]), (2, [-17, -16]), (2, [31, 32]), (2, [-1, 20])]


def prefilled_full(batch):
    """Sequence 0 at 31 tokens, for the step that crosses the capacity."""
    cfg, params = model("tiny-dense", "float32")
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of([31] + LENGTHS[1:batch], cfg.vocab_size), cache,
                         step_fn=reference_step(cfg))
    return cfg, params, cache


def inputs(batch, q_len, bad):
    cfg, params, cache = prefilled_full(batch) if bad == [31, 32] else prefilled(batch)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    good = np.asarray(cache.lengths)[:, None] + np.arange(q_len)[None]
    badpos = good.copy()
    badpos[0] = bad
    return cfg, params, cache, tokens, jnp.asarray(good, jnp.int32), jnp.asarray(badpos, jnp.int32)


@pytest.mark.parametrize("q_len, bad", BAD, ids=[f"q{q}-{b}" for q, b in BAD])
def test_reference_out_of_range_positions_write_nothing(q_len, bad):
    cfg, params, cache, tokens, good, badpos = inputs(3, q_len, bad)
    step = reference_step(cfg)
    run = step(params, tokens, badpos, cache)
    assert_isolated(run, step(params, tokens, good, cache), cache, np.asarray(badpos))
    with pytest.raises(PositionError, match="sequence 0 "):
        check_step(badpos, cache)


@functools.lru_cache(maxsize=None)
def kernel(batch, q_len, detect_races=True):
    cfg, params = model("tiny-dense", "float32")
    tuning = TuningConfig(kv_tile_pages=1, kv_buffers=2)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE))
    return plan, make_decode_step(plan, detect_races=detect_races), pack_weights(plan, params), tuning


@functools.lru_cache(maxsize=None)  # both kernel tests of a q_len compile the same configuration
def compile_for_tpus(batch, q_len, tuning):
    cfg, _ = model("tiny-dense", "float32")
    for target in ("tpu7x",):  # v6e compiles this model's kernel in tests/test_megakernel.py
        plan = make_plan(BuildSpec(cfg, get_target(target), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE))
        compiled = compile_for(make_decode_step(plan), step_specs(plan), get_target(target))
        assert compiled.custom_calls == 1, f"{target}: expected exactly one tpu_custom_call"


# q = 1 is the full tier: the same kernel meets the same bad positions (past the capacity,
# negative) in test_kernel_bad_position_never_touches_the_block_table_tail[1], and q = 2 here
# mixes in-range and out-of-range positions in one step.
@pytest.mark.parametrize("q_len", [pytest.param(1, marks=pytest.mark.full), 2])
def test_kernel_out_of_range_positions_stay_in_their_sequence(q_len):
    """Every bad position of sequence 0 for this q_len, in interpret mode with the race
    detector: the other sequences' logits and cache rows are bit-identical to the run without
    it, sequence 0 changes only rows of its in-range positions, and the kernel agrees with the
    reference's defined behaviour on every row (sequence 0's too). Then the same kernel
    configuration compiles deviceless for TPU7x."""
    batch = 3
    plan, step, packed, tuning = kernel(batch, q_len)
    for q, bad in BAD:
        if q != q_len:
            continue
        cfg, params, cache, tokens, good, badpos = inputs(batch, q_len, bad)
        run = step(packed, tokens, badpos, cache)
        assert not races_found(), f"{bad}: the interpreter's race detector reported a DMA race"
        assert_isolated(run, step(packed, tokens, good, cache), cache, np.asarray(badpos))
        want_logits, want_cache = reference_step(cfg)(params, tokens, badpos, cache)
        scale = float(np.max(np.abs(np.asarray(want_logits))))
        assert float(np.max(np.abs(np.asarray(run[0]) - np.asarray(want_logits)))) <= 1e-5 * scale, bad
        np.testing.assert_array_equal(np.asarray(run[1].lengths), np.asarray(want_cache.lengths))
        np.testing.assert_allclose(np.asarray(run[1].k), np.asarray(want_cache.k), rtol=1e-5, atol=1e-5)
    assert not races_found()
    compile_for_tpus(batch, q_len, tuning)


# Sequence 0 holds 5 tokens (page 0 only); the unused tail entry of its block table is
# another sequence's page (one sequence 1 writes this step), -1, or past the pool.
SHORT = [5, 9, 17]
TAILS = ["foreign", "minus-one", "past-pool"]


@functools.lru_cache(maxsize=None)
def prefilled_short(batch):
    cfg, params = model("tiny-dense", "float32")
    cache = R.init_cache(cfg, batch, CONTEXT, PAGE)
    _, cache = R.prefill(params, cfg, prompts_of(SHORT[:batch], cfg.vocab_size), cache,
                         step_fn=reference_step(cfg))
    return cfg, params, cache


def tail_inputs(q_len, tail, bad):
    cfg, params, cache = prefilled_short(3)
    tables = np.asarray(cache.block_tables).copy()
    num_pages = int(cache.k.shape[1])
    tables[0, 1] = {"foreign": tables[1, 0], "minus-one": -1, "past-pool": num_pages}[tail]
    if tail == "past-pool":
        tables[1, 1] = num_pages + 7  # sequence 1 (9 tokens) does not use its tail either
    cache = cache._replace(block_tables=jnp.asarray(tables, jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, cfg.vocab_size, (3, q_len)), jnp.int32)
    good = np.asarray(cache.lengths)[:, None] + np.arange(q_len)[None]
    badpos = good.copy()
    badpos[0] = bad
    check_step(good, cache)  # the run without the bad position keeps the contract
    return cfg, params, cache, tokens, jnp.asarray(good, jnp.int32), jnp.asarray(badpos, jnp.int32)


# (q_len, sequence 0's positions): at / past the capacity (clamped to the tail page before the
# fix), negative, and mixed with an in-range position.
TAIL_BAD = [(1, [32]), (1, [40]), (1, [-1]), (2, [32, 33]), (2, [5, 40])]


# q = 2 is the full tier: the tail entries with q = 1 here, positions mixing in-range and
# out-of-range ones in one q = 2 step in test_kernel_out_of_range_positions_stay_in_their_sequence[2].
@pytest.mark.parametrize("q_len", [1, pytest.param(2, marks=pytest.mark.full)])
def test_kernel_bad_position_never_touches_the_block_table_tail(q_len):
    """Sequence 0 has an out-of-range position and its unused tail entry is a page sequence 1
    writes this step (or -1, or past the pool). In interpret mode with the race detector:
    sequence 1 and 2's logits and cache rows are bit-identical to the run without the bad
    position (no lost write, no double write-back, no read racing a write-back, no DMA outside
    the cache), pages of no sequence keep their bytes, and the kernel matches the reference.
    Then the same configuration compiles deviceless for TPU7x."""
    plan, step, packed, tuning = kernel(3, q_len)
    for q, bad in TAIL_BAD:
        if q != q_len:
            continue
        for tail in TAILS:
            cfg, params, cache, tokens, good, badpos = tail_inputs(q_len, tail, bad)
            logits, new = step(packed, tokens, badpos, cache)
            assert not races_found(), f"{tail} {bad}: the race detector reported a DMA race"
            good_logits, good_new = step(packed, tokens, good, cache)
            np.testing.assert_array_equal(np.asarray(logits[1:]), np.asarray(good_logits[1:]))
            tables = np.asarray(cache.block_tables)
            for name in ("k", "v"):
                a, b = np.asarray(getattr(new, name)), np.asarray(getattr(good_new, name))
                for s in (1, 2):
                    pages = [p for p in tables[s] if 0 <= p < a.shape[1]]
                    np.testing.assert_array_equal(a[:, pages], b[:, pages], err_msg=f"{tail} {bad}: {name} of {s}")
                before = np.asarray(getattr(cache, name))
                free = sorted(set(range(before.shape[1])) - set(tables.reshape(-1).tolist()))
                np.testing.assert_array_equal(a[:, free], before[:, free], err_msg=f"{tail} {bad}: free pages")
            np.testing.assert_array_equal(np.asarray(new.lengths)[1:], np.asarray(good_new.lengths)[1:])
            want_logits, want = reference_step(cfg)(params, tokens, badpos, cache)
            scale = float(np.max(np.abs(np.asarray(want_logits))))
            assert float(np.max(np.abs(np.asarray(logits) - np.asarray(want_logits)))) <= 1e-5 * scale, (tail, bad)
            np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(want.lengths))
            np.testing.assert_allclose(np.asarray(new.k), np.asarray(want.k), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(new.v), np.asarray(want.v), rtol=1e-5, atol=1e-5)
    assert not races_found()
    compile_for_tpus(3, q_len, tuning)


# ---------------------------------------------------------------------- loaded artifacts
def fake_artifact(calls):
    manifest = {"shapes": {"batch": 3, "q_len": 1}, "key": "0123456789abcdef"}
    return DecodeStep(None, manifest, lambda *a: calls.append(a) or "ran", "test")


def test_artifact_step_checks_positions_before_running():
    _, _, cache = prefilled(3)
    calls: list = []
    step = fake_artifact(calls)
    tokens = jnp.zeros((3, 1), jnp.int32)
    with pytest.raises(PositionError, match="artifact 0123456789ab: sequence 0 token 0 has position 32"):
        step(None, tokens, jnp.asarray([[32], [9], [17]]), cache)
    with pytest.raises(PositionError, match="sequence 1 token 0 has position -1"):
        step(None, tokens, jnp.asarray([[20], [-1], [17]]), cache)
    assert calls == [], "the executable ran on a bad position"
    assert step(None, tokens, cache.lengths[:, None], cache) == "ran"
    # the documented opt-outs: per call, or for every call of this step
    assert step(None, tokens, jnp.asarray([[32], [9], [17]]), cache, check=False) == "ran"
    step.check_inputs = False
    assert step(None, tokens, jnp.asarray([[32], [9], [17]]), cache) == "ran"
    with pytest.raises(PositionError):
        step(None, tokens, jnp.asarray([[32], [9], [17]]), cache, check=True)
    assert len(calls) == 3


# ---------------------------------------------------------------------- generate / speculation
def test_greedy_generate_past_the_cache_raises():
    """Before: generating past the capacity overwrote earlier rows and set lengths past it."""
    cfg, params = model("tiny-dense", "float32")
    cache = R.init_cache(cfg, 1, CONTEXT, PAGE)
    with pytest.raises(PositionError, match="generate step 3: sequence 0 token 0 has position 32"):
        R.greedy_generate(params, cfg, [list(range(30))], 10, cache, step_fn=reference_step(cfg))


def test_draft_model_past_its_cache_raises():
    cfg, params = model("tiny-dense", "float32")
    small = R.init_cache(cfg, 1, 16, PAGE)  # too small for the drafts
    drafter = DraftModelDrafter(cfg, params, lambda t, p, c: reference_step(cfg)(params, t, p, c), small,
                                prefill_step=reference_step(cfg))
    drafter.prepare([list(range(12))])
    with pytest.raises(PositionError, match="draft model step .*position 16, expected 0 <= position < capacity 16"):
        drafter.propose([list(range(13))], 5)  # drafts at 13..16


def nan_model(kind: str) -> Model:
    cfg, params = model("tiny-dense", "float32")
    if kind == "rope_theta":
        return Model(cfg.replace(rope_theta=1e-300, name="tiny-dense-theta"), params, "test")
    params = dict(params)
    params["layers"] = [dict(layer) for layer in params["layers"]]
    params["layers"][1]["mlp_norm"] = params["layers"][1]["mlp_norm"].at[3].set(jnp.nan)
    return Model(cfg.replace(name="tiny-dense-nan"), params, "test")


@pytest.mark.parametrize("kind", ["rope_theta", "nan_norm"])
@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_non_finite_logits_are_an_error(kind, spec):
    m = nan_model(kind)
    with pytest.raises(NonFiniteError, match=r"^prefill: sequence 0 has NaN logits") as e:
        generate(m, [[1, 2, 3], [4, 5]], 4, spec=spec, draft_tokens=2)
    assert "\n" not in str(e.value)


def test_non_finite_logits_in_a_decode_or_verify_step_are_an_error():
    """A backend whose decode step goes NaN after a good prefill (sequence 1 only)."""
    cfg, params = model("tiny-dense", "float32")
    ref = reference_step(cfg)

    def bad_step(toks, pos, c):
        logits, c = ref(params, toks, pos, c)
        return logits.at[1].set(jnp.nan), c

    with pytest.raises(NonFiniteError, match="^generate step 1: sequence 1 has NaN logits"):
        R.greedy_generate(params, cfg, [[1, 2], [3, 4]], 4, R.init_cache(cfg, 2, CONTEXT, PAGE), step_fn=ref,
                          decode_fn=bad_step)
    with pytest.raises(NonFiniteError, match="^verify step 1: sequence 1 has NaN logits"):
        speculative_generate(params, cfg, [[1, 2], [3, 4]], 4, R.init_cache(cfg, 2, CONTEXT, PAGE), NgramDrafter(),
                             2, step_fn=ref, verify_fn=bad_step)


def test_cli_non_finite_logits_exit_non_zero(tmp_path):
    toml = tmp_path / "theta.toml"
    text = (R.__file__.rsplit("/model/", 1)[0] + "/model/presets/tiny-dense.toml")
    body = open(text).read().replace("rope_theta = 1000000.0", "rope_theta = 1e-300")
    toml.write_text(body.replace('name = "tiny-dense"', 'name = "tiny-theta"'))
    res = CliRunner().invoke(main, ["generate", "--model", str(toml), "--prompt-ids", "1,2,3", "--steps", "3"])
    assert res.exit_code != 0
    assert "sequence 0 has NaN logits" in res.output and "Traceback" not in res.output


# ---------------------------------------------------------------------- flags
@pytest.mark.parametrize("text", ["1_0,2", "\uff11,2", "+1,2", "1,-2", "1,0x1", "1,2.0", "1,\u0661"])
def test_prompt_ids_are_ascii_digits_only(text):
    with pytest.raises(ConfigError, match="--prompt-ids: sequence 0 holds .* ASCII digits"):
        parse_prompt_ids(text, 512)


def test_prompt_ids_accept_plain_ids():
    assert parse_prompt_ids(" 1, 2 ,003; 4", 512) == [[1, 2, 3], [4]]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(page_size=0), "--page-size"), (dict(page_size=-16), "--page-size"), (dict(steps=0), "--steps"),
    (dict(steps=2.5), "--steps"), (dict(spec="ngram", draft_tokens=0), "--draft-tokens"),
    (dict(draft_tokens=True, spec="ngram"), "--draft-tokens"),
])
def test_generate_flags_are_validated(kwargs, flag):
    cfg, params = model("tiny-dense", "float32")
    args = dict(steps=2)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=f"^{flag}: expected a positive"):
        generate(Model(cfg, params, "test"), [[1, 2]], **args)


@pytest.mark.parametrize("text", ["1,,2", "1,2,", ",1", "1, ,2", "1;2,,3"])
def test_prompt_ids_refuse_an_empty_item(text):
    """An empty item is refused, not silently dropped ('1,,2' is a typo, not [1, 2])."""
    with pytest.raises(ConfigError, match=r"^--prompt-ids: sequence \d has an empty item"):
        parse_prompt_ids(text, 512)


def test_prompt_ids_bound_the_digits_before_int():
    """An id of more digits than the vocabulary size is refused before int() (which raises its own
    ValueError past 4300 digits); leading zeros do not count."""
    with pytest.raises(ConfigError, match=r"^--prompt-ids: id 1{20}\.\.\. \(5000 digits\) outside the vocabulary"):
        parse_prompt_ids("1" * 5000, 512)
    with pytest.raises(ConfigError, match=r"^--prompt-ids: id 5120 outside the vocabulary \[0, 512\)"):
        parse_prompt_ids("5120", 512)
    assert parse_prompt_ids("0" * 5000 + "7,511", 512) == [[7, 511]]


@pytest.mark.parametrize("kwargs, flag, upper", [
    (dict(steps=10**12), "--steps", "4,194,304"), (dict(steps=MAX_CONTEXT + 1), "--steps", "4,194,304"),
    (dict(spec="ngram", draft_tokens=10**12), "--draft-tokens", "1,023"),
    (dict(spec="ngram", draft_tokens=MAX_Q_LEN), "--draft-tokens", "1,023"),
    (dict(page_size=MAX_PAGE_SIZE + 1), "--page-size", "4,096"),
    (dict(context=10**12), "--context", "4,194,304"),
])
def test_generate_sizes_are_bounded_before_allocating(kwargs, flag, upper, monkeypatch):
    """Absurd sizes are refused by the BuildSpec bounds (tpumk.plan.spec) before the KV cache is
    allocated (1e12 steps once asked numpy for 466 GiB)."""
    def no_alloc(*a, **k):
        raise AssertionError("the cache was allocated")

    monkeypatch.setattr(R, "init_cache", no_alloc)
    cfg, params = model("tiny-dense", "float32")
    args = dict(steps=2)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=f"^{flag}: expected a positive .*at most {upper}"):
        generate(Model(cfg, params, "test"), [[1, 2, 1, 2]], **args)


def test_generate_bounds_the_resulting_context_and_batch(monkeypatch):
    def no_alloc(*a, **k):
        raise AssertionError("the cache was allocated")

    monkeypatch.setattr(R, "init_cache", no_alloc)
    cfg, params = model("tiny-dense", "float32")
    m = Model(cfg, params, "test")
    with pytest.raises(ConfigError, match=r"^--steps: the longest prompt \(4 tokens\) plus 4,194,301 steps plus "
                                          r"7 draft tokens is 4,194,312 tokens, more than .* \(4,194,304\)"):
        generate(m, [[1, 2, 1, 2]], MAX_CONTEXT - 3, spec="ngram")
    with pytest.raises(ConfigError, match=f"^--prompt-ids: {MAX_BATCH + 1:,} sequences, expected at most "
                                          f"{MAX_BATCH:,}"):
        generate(m, [[1]] * (MAX_BATCH + 1), 2)


def test_generate_refuses_a_cache_larger_than_the_host(monkeypatch):
    import tpumk.decode.generate as G

    monkeypatch.setattr(G, "_host_memory_bytes", lambda: 1 << 20)  # a 1 MiB host
    cfg, params = model("tiny-dense", "float32")
    with pytest.raises(ConfigError, match=r"^--steps: the KV cache of 2 x 4,016 tokens \(2 layers, tiny-dense\) needs "
                                          r"31\.4 MiB, more than this host's 1\.0 MiB of memory"):
        generate(Model(cfg, params, "test"), [[1], [2]], 4000)
    # an allocator's MemoryError is one line too
    monkeypatch.setattr(G, "_host_memory_bytes", lambda: None)

    def oom(*a, **k):
        raise MemoryError("Unable to allocate 466 GiB")

    monkeypatch.setattr(R, "init_cache", oom)
    with pytest.raises(ConfigError, match="^--steps: the KV cache .* which this host cannot allocate"):
        generate(Model(cfg, params, "test"), [[1]], 4)


def test_a_hybrid_s_state_pool_counts_against_the_host(monkeypatch):
    """A hybrid's cache is its attention layers' KV cache plus the linear layers' state pool (a
    [value heads, key dim, value dim] float32 state, a window and the pending rows per layer and
    sequence): a host that holds the KV cache but not the pool is refused before allocating,
    naming both. Before: the pool was not counted (and the KV cache counted every layer)."""
    import tpumk.decode.generate as G
    from tpumk.model.linear_attention import pool_bytes

    cfg = model("tiny-dense", "float32")[0].replace(**GDN)
    kv = 2 * 4000 * cfg.kv_bytes_per_token()
    pool = pool_bytes(cfg, 2, 8)
    assert kv == 2 * 4000 * 1 * 2 * cfg.attention.kv_size * 4 and pool > 2 * 2 * 2 * 128 * 128 * 4
    rows = pool - pool_bytes(cfg, 2, 0)  # the pending rows' share
    monkeypatch.setattr(G, "_host_memory_bytes", lambda: kv + pool - rows // 2)
    with pytest.raises(ConfigError, match=r"^--steps: the KV cache of 2 x 4,000 tokens \(1 attention layer, tiny-gdn\) "
                                          r"and its state pool \(2 linear layers x 2 slots\) need [0-9.]+ MiB, more "
                                          r"than this host's"):
        G.check_host_memory(cfg, 2, 4000, [], pending=8)
    G.check_host_memory(cfg, 2, 4000, [], pending=0)  # without the pending rows it fits


def test_empty_model_names_are_refused_not_defaulted():
    with pytest.raises(ConfigError, match="^--model: empty value"):
        load_model("", None)
    with pytest.raises(ConfigError, match="^--checkpoint: empty value"):
        load_model(None, " ")
    cfg, params = model("tiny-dense", "float32")
    with pytest.raises(ConfigError, match="^--draft-model: empty value"):
        load_draft_model("", Model(cfg, params, "test"))


@pytest.mark.parametrize("args, flag", [
    (["--steps", str(10**12)], "--steps"),
    (["--spec", "ngram", "--draft-tokens", str(10**12)], "--draft-tokens"),
    (["--page-size", str(10**12)], "--page-size"),
    (["--spec", "draft", "--draft-model", ""], "--draft-model"),
])
def test_cli_generate_bounds_are_one_line(args, flag):
    res = CliRunner().invoke(main, ["generate", "--model", "tiny-dense", "--prompt-ids", "1,2,1,2", *args])
    assert res.exit_code == 1, res.output
    assert res.stdout == "" and res.stderr.startswith(f"tpumk: error: {flag}: ")
    assert len(res.stderr.splitlines()) == 1


@pytest.mark.parametrize("args, flag", [
    (["--model", ""], "--model"), (["--checkpoint", ""], "--checkpoint"), (["--prompt-ids", "1,,2"], "--prompt-ids"),
    (["--prompt-ids", "9" * 5000], "--prompt-ids"),
])
def test_cli_generate_empty_values_are_one_line(args, flag):
    base = {"--model": "tiny-dense", "--prompt-ids": "1,2"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    if "--checkpoint" in base:
        base.pop("--model")
    res = CliRunner().invoke(main, ["generate", *[x for kv in base.items() for x in kv], "--steps", "1"])
    assert res.exit_code == 1, res.output
    assert res.stdout == "" and res.stderr.startswith(f"tpumk: error: {flag}: ")
    assert len(res.stderr.splitlines()) == 1


def test_cli_page_size_zero_is_one_line():
    res = CliRunner().invoke(main, ["generate", "--model", "tiny-dense", "--prompt-ids", "1,2", "--steps", "2",
                                    "--page-size", "0"])
    assert res.exit_code != 0 and "--page-size" in res.output and "Traceback" not in res.output


def test_cli_prompt_ids_with_underscore_is_rejected():
    res = CliRunner().invoke(main, ["generate", "--model", "tiny-dense", "--prompt-ids", "1_0,2", "--steps", "2",
                                    "--json"])
    assert res.exit_code != 0 and "--prompt-ids" in res.output
    with pytest.raises(json.JSONDecodeError):
        json.loads(res.output)


def test_check_finite_names_the_row():
    check_finite(np.zeros((2, 3)), "x")
    with pytest.raises(NonFiniteError, match="^x: sequence 4 has infinite logits"):
        check_finite(np.asarray([[0.0], [np.inf]]), "x", names=[3, 4])
