"""The KV contract without host checks (issue 24): a block-table entry outside the page pool
(10000, -5) or a token id outside the vocabulary never makes the kernel or the reference write
a cache row. Such a token's write is dropped (never clipped or wrapped onto another page: the
in-kernel guard, which holds with `check=False`); pages are read through the entry clipped into
the pool, identically on both sides; an out-of-vocabulary token embeds as zeros and runs at
position -1 (no row, no key, lengths unmoved, finite logits). With checks on, the host refuses
these inputs, and a page id twice in one sequence's live range, in one line.

Every kernel configuration runs in Pallas TPU interpret mode against the reference (the cache
compared, the rows no valid token writes bit-identical to before) and is compiled deviceless
for TPU targets in the same test: the attention stage alone (GQA, q_len 3, a sliding window, in
the megakernel's layer loop), the whole megakernel (dense q_len 2, MLA), and a 2-device build
(in a subprocess with 2 host CPU devices).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from host_flags import xla_flags

from tpumk.errors import PositionError, TokenError, TpumkError
from tpumk.model import reference as R
from tpumk.model.positions import check_step, check_tokens
from tpumk.targets import INTERPRET_COMPILER_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
OUT_OF_POOL = (10000, -5)


# ---------------------------------------------------------------------- helpers
def written_rows(tables, positions, tokens, vocab, num_pages, page_size, capacity):
    """The (page, slot) rows a step may write under the contract: in-range positions of
    in-vocabulary tokens whose block-table entry is in the pool."""
    out = set()
    for b in range(positions.shape[0]):
        for i in range(positions.shape[1]):
            p, t = int(positions[b, i]), int(tokens[b, i])
            if not (0 <= p < capacity and 0 <= t < vocab):
                continue
            pg = int(tables[b, p // page_size])
            if 0 <= pg < num_pages:
                out.add((pg, p % page_size))
    return out


def assert_only_rows_written(before, after, rows, what):
    """Every row of every layer outside `rows` (page, slot) is bit-identical to before."""
    before, after = np.asarray(before, np.float32), np.asarray(after, np.float32)
    keep = np.ones(before.shape[1:3], bool)
    for pg, slot in rows:
        keep[pg, slot] = False
    changed = np.argwhere(~np.all((before == after) | (np.isnan(before) & np.isnan(after)), axis=-1) & keep[None])
    assert changed.size == 0, f"{what}: rows (layer, page, slot) written outside the contract: {changed[:5].tolist()}"


# ---------------------------------------------------------------------- host checks
def _cache(tables, lengths, num_pages=8, page_size=4):
    k = np.zeros((1, num_pages, page_size, 2), np.float32)
    return R.KVCache(k, k, np.asarray(tables, np.int32), np.asarray(lengths, np.int32))


def test_check_step_refuses_a_page_twice_in_one_sequence():
    cache = _cache([[3, 5, 3, 6], [0, 1, 2, 4]], [9, 2])  # seq 0 reads entries 0..2: page 3 twice
    with pytest.raises(PositionError) as e:
        check_step(np.asarray([[9], [2]]), cache)
    msg = str(e.value)
    assert "\n" not in msg and "sequence 0 block table entries 0 and 2 are both page 3" in msg, msg
    # a duplicate past the live range (entry 3, unused this step) is no error
    check_step(np.asarray([[5], [2]]), _cache([[3, 5, 7, 3], [0, 1, 2, 4]], [5, 2]))
    # the first sequence with a duplicate is reported, whichever entry repeats
    with pytest.raises(PositionError, match=r"sequence 1 block table entries 1 and 2 are both page 4"):
        check_step(np.asarray([[5], [10]]), _cache([[3, 5, 7, 6], [0, 4, 4, 1]], [5, 10]))


@pytest.mark.parametrize("bad", OUT_OF_POOL)
def test_check_step_refuses_an_entry_outside_the_pool(bad):
    with pytest.raises(PositionError, match=rf"sequence 1 block table entry 1 is page {bad}, expected a page id in \[0, 8\)"):
        check_step(np.asarray([[1], [5]]), _cache([[3, 5, 7, 6], [0, bad, 2, 4]], [1, 5]))


@pytest.mark.parametrize("bad", [-1, 128, 10 ** 6])
def test_check_tokens_refuses_ids_outside_the_vocabulary(bad):
    check_tokens(np.asarray([[0, 127]]), 128)
    with pytest.raises(TokenError) as e:
        check_tokens(np.asarray([[5, 6], [7, bad]]), 128, where="artifact abc")
    msg = str(e.value)
    assert isinstance(e.value, TpumkError) and "\n" not in msg
    assert msg == f"artifact abc: sequence 1 token 1 has id {bad}, expected a token id in [0, 128) (the model's vocabulary)"


def test_artifact_step_checks_token_ids_before_running():
    from tpumk.export.artifacts import DecodeStep

    calls = []
    manifest = {"shapes": {"batch": 2, "q_len": 1}, "key": "0123456789abcdef", "model": {"vocab_size": 100}}
    step = DecodeStep(None, manifest, lambda *a: calls.append(a) or "ran", "test")
    cache = _cache([[3, 5, 7, 6], [0, 1, 2, 4]], [1, 5])
    pos = np.asarray([[1], [5]])
    with pytest.raises(TokenError, match=r"^artifact 0123456789ab: sequence 1 token 0 has id 100, expected a token id in \[0, 100\)"):
        step(None, np.asarray([[99], [100]]), pos, cache)
    assert calls == []
    assert step(None, np.asarray([[99], [0]]), pos, cache) == "ran"
    assert step(None, np.asarray([[99], [100]]), pos, cache, check=False) == "ran"  # unchecked: the kernel's guard


def test_prefill_refuses_an_out_of_vocabulary_prompt():
    cfg, params = _dense()
    cache = R.init_cache(cfg, 1, 32, 16)
    with pytest.raises(TokenError, match=r"prefill of sequence 0: sequence 0 token 2 has id"):
        R.prefill(params, cfg, [[1, 2, cfg.vocab_size + 4]], cache,
                  step_fn=lambda *a: pytest.fail("the step ran"))


# ---------------------------------------------------------------------- the attention stage
STAGE_RUNS = ["loop-f32-b4-q3-t2-n3", "loop-f32-b3-q3-t1-n2-w10", "bf16-b1-q3-t1-n3"]


def _stage_args(name):
    """test_attention_stage's inputs for `name` with block-table entries outside the pool on
    pages the step writes (and reads), every cache row random (nothing stale is zero)."""
    import dataclasses

    import test_attention_stage as tas

    case, loop = tas._resolve(name)
    # no NaN rows: a dropped write leaves the position a key whose row is the clipped page's
    case = dataclasses.replace(case, nan_garbage=False, nan_below_window=False)
    args = list(tas.make_inputs(case, loop))
    tables, positions = args[1].copy(), args[3]
    ps, pages = case.page_size, tas.num_pages(case)
    # The clipped ids (0 and pages - 1) stay pages some sequence may own and read, but none
    # writes this step (else a sequence reading it through the clip would race the write-back).
    spare = sorted(set(range(1, pages - 1)) - set(tables.flat))
    for b in range(case.batch):
        for p in positions[b]:
            if tables[b, int(p) // ps] in (0, pages - 1):
                tables[b, int(p) // ps] = spare.pop()
    for b in range(case.batch):  # each sequence's first written page is outside the pool
        tables[b, int(positions[b, 0]) // ps] = OUT_OF_POOL[b % 2]
    args[1] = tables
    return tas, case, loop, args


def _stage_expected(tas, case, loop, args):
    """The reference's rule for one stage: writes through `cache_slots` (dropped outside the
    pool), reads through `read_tables` (clipped), `reference.attend`."""
    layer0, tables, lengths, positions, q, k_new, v_new, k, v = args
    geom = case.geometry()
    b, t = case.batch, case.q_len
    cfg = R.ModelConfig(name="kv-guard", num_layers=tas.NUM_LAYERS, hidden_size=geom.q_size,
                        num_q_heads=geom.num_q_heads, num_kv_heads=geom.num_kv_heads, head_dim=geom.head_dim,
                        vocab_size=128, ffn_size=128, dtype=case.dtype)
    layers = range(tas.NUM_LAYERS) if loop else [int(layer0[0])]
    outs = []
    for layer in layers:
        qi, kn, vn = (q[layer], k_new[layer], v_new[layer]) if loop else (q, k_new, v_new)
        cache = R.KVCache(k, v, jnp.asarray(tables), jnp.asarray(lengths))
        page_ids, slots, k_pos, k_valid, _ = R.cache_slots(cache, jnp.asarray(positions))
        k = k.at[layer, page_ids, slots].set(kn.reshape(b, t, -1), mode="drop")
        v = v.at[layer, page_ids, slots].set(vn.reshape(b, t, -1), mode="drop")
        rt = R.read_tables(R.KVCache(k, v, jnp.asarray(tables), lengths))
        ctx = case.pages_per_seq * case.page_size
        ks = k[layer][rt].reshape(b, ctx, geom.num_kv_heads, geom.head_dim)
        vs = v[layer][rt].reshape(b, ctx, geom.num_kv_heads, geom.head_dim)
        o = R.attend(cfg.attention, qi.reshape(b, t, geom.num_q_heads, geom.head_dim), ks, vs, jnp.asarray(positions), k_pos,
                     k_valid, geom.window(layer))
        outs.append(o.reshape(b * t, geom.q_size))
    return (jnp.stack(outs) if loop else outs[0]), k, v


# loop-f32-b4-q3-t2-n3 is the full tier: the layer loop with the window (loop-...-w10) and
# batch 1 in bfloat16 stay; the guard is the same write path in every geometry.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n == "loop-f32-b4-q3-t2-n3" else n
                                  for n in STAGE_RUNS])
def test_attention_stage_never_writes_outside_the_pool(name):
    from tpumk.compat import interpret_races
    from tpumk.compile.aot import compile_for
    from tpumk.targets import get_target

    tas, case, loop, args = _stage_args(name)
    geom, pages = case.geometry(), tas.num_pages(case)
    o, k, v = jax.block_until_ready(jax.jit(tas.make_call(geom, pages, True, loop),
                                            compiler_options=INTERPRET_COMPILER_OPTIONS)(*args))
    races = interpret_races()
    assert races is not None and not races.races_found, "data race detected"
    want_o, want_k, want_v = _stage_expected(tas, case, loop, args)
    tables, positions = args[1], args[3]
    rows = written_rows(tables, positions, np.zeros_like(positions), 1, pages, case.page_size,
                        case.pages_per_seq * case.page_size)
    for name_, got, want, before in (("k", k, want_k, args[7]), ("v", v, want_v, args[8])):
        assert_only_rows_written(before, got, rows, f"kernel {name_}")
        assert_only_rows_written(before, want, rows, f"reference {name_}")
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    vmax = max(float(np.max(np.abs(np.asarray(a, np.float32)))) for a in (args[6], args[8]))
    tol = 1e-5 if case.dtype == "float32" else 2.0 ** -8 * vmax + 1e-5  # test_attention_stage's bounds
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=tol if case.dtype == "float32" else 0, atol=tol)
    # the same configuration compiles for TPU targets
    specs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args)
    for target in tas.TARGETS:
        assert compile_for(tas.make_call(geom, pages, False, loop), specs, get_target(target)).custom_calls == 1


# ---------------------------------------------------------------------- the reference alone
def _dense():
    from test_megakernel import model

    return model("tiny-dense", "float32")


def _random_cache(cfg, tables, lengths, page_size=16, seed=11):
    """A cache whose every row is random (a write anywhere shows), over explicit tables."""
    tables = np.asarray(tables, np.int32)
    num_pages = int(np.max(np.where((tables >= 0) & (tables < 1000), tables, 0))) + 1
    rng = np.random.default_rng(seed)
    dt = R.jnp_dtype(cfg)
    width = cfg.attention.latent_cache_lanes if cfg.is_mla else cfg.attention.kv_size  # MLA: pad lanes random too
    k = jnp.asarray(rng.standard_normal((cfg.num_layers, num_pages, page_size, width), np.float32), dt)
    v = (jnp.zeros((cfg.num_layers, num_pages, page_size, 0), dt) if cfg.is_mla else
         jnp.asarray(rng.standard_normal((cfg.num_layers, num_pages, page_size, width), np.float32), dt))
    return R.KVCache(k, v, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


# Dense, batch 2, q_len 2, 4 pages of 16 per sequence, 8 pages. Step 1: sequence 0's token at 16
# has entry 10000 (clipped: page 7, sequence 1's cached page 0), sequence 1's tokens at 30, 31
# have entry -5 (clipped: page 0, sequence 0's unused page 2; wrapped: page 3, sequence 0's page
# 0). Step 2: valid tables, out-of-vocabulary ids at (0, 0) and (1, 1).
DENSE_TABLES = [[3, 1, 0, 6], [7, 4, 2, 5]]
DENSE_LENGTHS = [15, 30]


def _dense_steps(vocab):
    bad = np.asarray(DENSE_TABLES, np.int32)
    bad[0, 1], bad[1, 1] = OUT_OF_POOL
    pos = np.asarray([[15, 16], [30, 31]], np.int32)
    return [(bad, np.asarray([[5, 6], [7, 8]], np.int32), pos),
            (np.asarray(DENSE_TABLES, np.int32), np.asarray([[vocab + 3, 6], [7, -1]], np.int32), pos)]


@pytest.mark.parametrize("which", ["out-of-pool", "out-of-vocab"])
def test_reference_writes_nothing_outside_the_contract(which):
    cfg, params = _dense()
    tables, tokens, pos = _dense_steps(cfg.vocab_size)[which == "out-of-vocab"]
    cache = _random_cache(cfg, tables, DENSE_LENGTHS)
    from test_megakernel import reference_step

    logits, new = reference_step(cfg)(params, jnp.asarray(tokens), jnp.asarray(pos), cache)
    rows = written_rows(tables, pos, tokens, cfg.vocab_size, 8, 16, 64)
    assert rows and len(rows) < 4
    assert_only_rows_written(cache.k, new.k, rows, "k")
    assert_only_rows_written(cache.v, new.v, rows, "v")
    assert np.all(np.isfinite(np.asarray(logits)))
    want_len = [17, 32] if which == "out-of-pool" else [17, 31]  # an out-of-vocabulary token moves nothing
    np.testing.assert_array_equal(np.asarray(new.lengths), want_len)


# ---------------------------------------------------------------------- the megakernel
@functools.lru_cache(maxsize=None)
def _kernel_step(kind):
    """One interpret-mode megakernel step per model, shared by its tests (compiled once)."""
    from test_megakernel import CONTEXT, PAGE, SMALL_TILES
    from tpumk.kernel.layout import pack_weights
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    if kind == "dense":
        cfg, params = _dense()
        batch, q_len, tuning = 2, 2, TuningConfig(ring_depth=3, kv_tile_pages=1, **SMALL_TILES)
    else:
        from test_megakernel_mla import model

        cfg, params = model("float32")
        batch, q_len, tuning = 2, 1, TuningConfig()
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch, CONTEXT, tuning, q_len=q_len, page_size=PAGE))
    return cfg, params, tuning, make_decode_step(plan, detect_races=True), pack_weights(plan, params)


# MLA, batch 2, q_len 1, 8 pages: step 1 sequence 0 at 15 has entry -5 (clipped: page 0, which
# sequence 1 reads and does not write), sequence 1 at 33 entry 10000 (clipped: page 7, sequence
# 0's unused page 3); step 2 valid tables, sequence 1's token out of the vocabulary.
MLA_TABLES = [[2, 5, 6, 7], [0, 4, 1, 3]]
MLA_LENGTHS = [15, 33]


def _mla_steps(vocab):
    bad = np.asarray(MLA_TABLES, np.int32)
    bad[0, 0], bad[1, 2] = -5, 10000
    pos = np.asarray([[15], [33]], np.int32)
    return [(bad, np.asarray([[5], [6]], np.int32), pos),
            (np.asarray(MLA_TABLES, np.int32), np.asarray([[5], [vocab]], np.int32), pos)]


@pytest.mark.parametrize("kind", ["dense", "mla"])
def test_megakernel_never_writes_outside_the_contract(kind):
    from test_megakernel import compile_for_tpus, races_found, reference_step

    cfg, params, tuning, step, packed = _kernel_step(kind)
    steps = _dense_steps(cfg.vocab_size) if kind == "dense" else _mla_steps(cfg.vocab_size)
    base_tables, lengths = (DENSE_TABLES, DENSE_LENGTHS) if kind == "dense" else (MLA_TABLES, MLA_LENGTHS)
    for tables, tokens, pos in steps:
        cache = _random_cache(cfg, base_tables, lengths)._replace(block_tables=jnp.asarray(tables))
        logits, new = step(packed, jnp.asarray(tokens), jnp.asarray(pos), cache)
        assert not races_found(), "the interpreter's race detector reported a DMA race"
        want_logits, want = reference_step(cfg)(params, jnp.asarray(tokens), jnp.asarray(pos), cache)
        rows = written_rows(tables, pos, tokens, cfg.vocab_size, 8, 16, 64)
        for name in ("k", "v"):
            assert_only_rows_written(getattr(cache, name), getattr(new, name), rows, f"kernel {name}")
            assert_only_rows_written(getattr(cache, name), getattr(want, name), rows, f"reference {name}")
            np.testing.assert_allclose(np.asarray(getattr(new, name)), np.asarray(getattr(want, name)),
                                       rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(want.lengths))
        got, want_logits = np.asarray(logits), np.asarray(want_logits)
        assert np.all(np.isfinite(got)) and np.all(np.isfinite(want_logits))
        np.testing.assert_allclose(got, want_logits, rtol=0, atol=1e-5 * float(np.max(np.abs(want_logits))))
    compile_for_tpus(cfg, len(lengths), steps[0][2].shape[1], tuning)


# ---------------------------------------------------------------------- 2 devices
def _worker() -> dict:
    """The dense model on 2 host devices (KV heads split): the kernel's and the reference's
    cache after steps with entries outside the pool and out-of-vocabulary tokens."""
    from tpumk.kernel.layout import pack_sharded
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.model.config import load_preset
    from tpumk.model.weights import random_params
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    cfg = load_preset("tiny-dense")
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=2, context=64, q_len=2, devices=2))
    sh = plan.sharding
    params = random_params(cfg, seed=7)
    step, packed = make_decode_step(plan), pack_sharded(plan, params)
    reference = R.jitted_decode_step(cfg)
    out = []
    for tables, tokens, pos in _dense_steps(cfg.vocab_size):
        cache = _random_cache(cfg, DENSE_TABLES, DENSE_LENGTHS)._replace(block_tables=jnp.asarray(tables))
        wide = R.KVCache(sh.expand_cache(cfg, cache.k), sh.expand_cache(cfg, cache.v), cache.block_tables,
                         cache.lengths)
        logits, got = step(packed, jnp.asarray(tokens), jnp.asarray(pos), wide)
        want_logits, want = reference(params, jnp.asarray(tokens), jnp.asarray(pos), cache)
        rows = written_rows(tables, pos, tokens, cfg.vocab_size, 8, 16, 64)
        res = {}
        for name in ("k", "v"):
            g = np.asarray(sh.collapse_cache(cfg, getattr(got, name)), np.float32)
            try:
                assert_only_rows_written(getattr(cache, name), g, rows, f"kernel {name}")
                assert_only_rows_written(getattr(cache, name), getattr(want, name), rows, f"reference {name}")
                res[name] = "ok"
            except AssertionError as e:
                res[name] = str(e)
            res[name + "_err"] = float(np.max(np.abs(g - np.asarray(want.__getattribute__(name), np.float32))))
        res["lengths_equal"] = bool(np.array_equal(np.asarray(got.lengths), np.asarray(want.lengths)))
        res["finite"] = bool(np.all(np.isfinite(np.asarray(logits))))
        res["logits_err"] = float(np.max(np.abs(np.asarray(logits) - np.asarray(want_logits))))
        res["scale"] = float(np.max(np.abs(np.asarray(want_logits))))
        out.append(res)
    return {"steps": out}


def test_two_devices_never_write_outside_the_contract():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), JAX_PLATFORMS="cpu",
               NPROC="8", XLA_FLAGS=xla_flags(2))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for s in r["steps"]:
        assert s["k"] == "ok" and s["v"] == "ok", s
        assert s["k_err"] <= 1e-5 and s["v_err"] <= 1e-5 and s["lengths_equal"] and s["finite"], s
        assert s["logits_err"] <= 2e-5 * max(1.0, s["scale"]), s
    # the same 2-device build compiles deviceless for a multi-chip TPU7x topology
    from tpumk.compile.aot import compile_plan
    from tpumk.model.config import load_preset
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    spec = BuildSpec(load_preset("tiny-dense"), get_target("tpu7x"), batch=2, context=64, q_len=2, devices=2)
    assert compile_plan(make_plan(spec)).custom_calls == 1


if __name__ == "__main__":
    print(json.dumps(_worker()))
