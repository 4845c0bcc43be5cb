"""The attention stage alone: interpret mode (race detector on) against the reference, and the
same wrapper compiled deviceless for TPU targets (and profiled by libtpu), for every geometry.

The wrapper is a grid-less pallas_call shaped like the megakernel's: q / k_new / v_new in VMEM,
the paged caches left in HBM (pl.ANY) and aliased input -> output, block tables, lengths,
positions and the layer index in SMEM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.model import reference

from tpumk.compat import interpret_races, tpu_interpreter
from tpumk.estimate import static_profile
from tpumk.compile.aot import compile_for
from tpumk.model.config import ModelConfig
from tpumk.errors import PlanError
from tpumk.kernel.attention import AttentionScratch, attention_prefetch, attention_scratch, attention_stage
from tpumk.plan.geometry import AttentionGeometry
from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target

NUM_LAYERS = 2
LAYER = 1  # the stage updates layer 1 only; layer 0 must come back untouched
TARGETS = ("tpu7x", "v6e")  # what the megakernel ships for; v5e is spot-checked below


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    q_len: int
    kv_tile_pages: int
    kv_buffers: int
    lengths: tuple[int, ...]
    num_q_heads: int = 4
    num_kv_heads: int = 2
    pages_per_seq: int = 6
    positions: tuple[tuple[int, ...], ...] | None = None  # default: lengths[b] + i
    nan_garbage: bool = False  # unused cache rows hold NaN (an uninitialised cache)
    head_dim: int = 128
    windows: tuple[int, ...] = ()  # per layer sliding window (0: full), empty: all full
    nan_below_window: bool = False  # sliding layers: cached rows of tiles below every window are NaN

    @property
    def page_size(self) -> int:  # the smallest page each dtype's sublane tiling allows
        return 8 if self.dtype == "float32" else 16

    def geometry(self) -> AttentionGeometry:
        return AttentionGeometry(
            batch=self.batch, q_len=self.q_len, num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=self.page_size,
            pages_per_seq=self.pages_per_seq, num_layers=NUM_LAYERS,
            kv_tile_pages=self.kv_tile_pages, kv_buffers=self.kv_buffers, dtype=self.dtype,
            windows=self.windows)

    def position_array(self) -> np.ndarray:
        if self.positions is not None:
            return np.asarray(self.positions, np.int32)
        return (np.asarray(self.lengths)[:, None] + np.arange(self.q_len)[None, :]).astype(np.int32)


# Lengths are chosen so new tokens start a sequence (0), cross a page (f32 pages are 8 tokens,
# bf16 pages 16), cross a KV tile (tile = kv_tile_pages pages), and differ per sequence.
CASES = {
    "f32-b1-q1-t1-n2": Case("float32", 1, 1, 1, 2, (15,)),
    "f32-b4-q3-t2-n3": Case("float32", 4, 3, 2, 3, (0, 7, 15, 30)),
    "f32-b8-q1-t2-n2-g8": Case("float32", 8, 1, 2, 2, (0, 8, 15, 16, 31, 40, 3, 23),
                               num_q_heads=8, num_kv_heads=1),
    # Speculative re-verify: positions below the cached length overwrite cached rows; the second
    # sequence has a gap (keys 5..8 are neither cached nor new) whose rows hold NaN.
    "f32-b2-q3-t1-n3-overwrite-nan": Case("float32", 2, 3, 1, 3, (20, 5),
                                          positions=((18, 19, 20), (9, 10, 11)), nan_garbage=True),
    "bf16-b1-q3-t1-n3": Case("bfloat16", 1, 3, 1, 3, (14,), pages_per_seq=4),
    "bf16-b4-q1-t2-n2": Case("bfloat16", 4, 1, 2, 2, (0, 31, 32, 50), pages_per_seq=4),
    "bf16-b4-q3-t2-n2-g4": Case("bfloat16", 4, 3, 2, 2, (29, 1, 45, 16), num_q_heads=8,
                                num_kv_heads=2, pages_per_seq=4, nan_garbage=True),
    # head_dim 64: two kv heads per 128-lane block (block-diagonal q); group 3, so a q head's
    # 64 lanes sit in the other half of their block than its kv head's (the roll path).
    "f32-b2-q1-t1-n2-d64": Case("float32", 2, 1, 1, 2, (13, 30), num_q_heads=6, num_kv_heads=2,
                                head_dim=64),
    "bf16-b2-q2-t1-n3-d64-g2": Case("bfloat16", 2, 2, 1, 3, (29, 7), num_q_heads=8, num_kv_heads=4,
                                    head_dim=64, pages_per_seq=4, nan_garbage=True),
    "f32-b1-q2-t1-n2-d256": Case("float32", 1, 2, 1, 2, (11,), num_q_heads=2, num_kv_heads=1, head_dim=256),
    # Sliding windows (layer 0 full, layer 1 sliding): tiles below every query's window are
    # skipped; sequence 0 (window 10 at 20..22) starts at tile 1, sequence 2 at tile 3.
    # Cached rows in the tiles below every query's window are NaN in the sliding layer: a stage
    # that streamed them would put 0 * NaN into p.V (they are valid keys, so V is not zeroed).
    "f32-b3-q3-t1-n2-w10": Case("float32", 3, 3, 1, 2, (20, 2, 33), windows=(0, 10), nan_garbage=True,
                                nan_below_window=True),
    "bf16-b2-q2-t1-n3-d64-w20": Case("bfloat16", 2, 2, 1, 3, (40, 15), num_q_heads=4, num_kv_heads=2,
                                     head_dim=64, pages_per_seq=4, windows=(0, 20)),
}


def num_pages(case: Case) -> int:
    return case.batch * case.pages_per_seq + 3  # spare pages no table points to


def make_call(geom: AttentionGeometry, pages: int, interpret: bool, layer_loop: bool = False):
    """The grid-less wrapper: (layer, tables, lengths, positions, q, k_new, v_new, k, v) ->
    (o, k, v), with the caches aliased in place.

    layer_loop=False: one attention_stage for layer `layer`. layer_loop=True: the megakernel's
    shape, a fori_loop over every layer (traced layer index) calling attention_prefetch then
    attention_stage(prefetched=True) on per-layer q / k_new / v_new [L, B*q, ...] -> o [L, ...];
    without sliding windows each layer also starts the next layer's first KV tiles
    (prefetch_next) and the next takes them (tiles_started), as the megakernel does.
    """
    kv_ahead = layer_loop and not geom.window_runs()

    def kernel(layer_ref, tables_ref, lengths_ref, positions_ref, q_ref, k_new_ref, v_new_ref,
               k_ref, v_ref, o_ref, k_out, v_out, *scratch):
        del k_out, v_out  # aliases of k_ref / v_ref
        if not layer_loop:
            o_ref[...] = attention_stage(geom, layer_ref[0], q_ref[...], k_new_ref[...], v_new_ref[...],
                                         k_ref, v_ref, tables_ref, lengths_ref, positions_ref, scratch)
            return

        def layer_body(layer, carry):
            attention_prefetch(geom, layer, k_ref, v_ref, tables_ref, positions_ref, scratch)
            o_ref[layer] = attention_stage(geom, layer, q_ref[layer], k_new_ref[layer], v_new_ref[layer],
                                           k_ref, v_ref, tables_ref, lengths_ref, positions_ref, scratch,
                                           prefetched=True, tiles_started=kv_ahead and layer > 0,
                                           prefetch_next=kv_ahead and layer + 1 < geom.num_layers)
            return carry

        lax.fori_loop(0, geom.num_layers, layer_body, 0)

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    cache = jax.ShapeDtypeStruct((geom.num_layers, pages, geom.page_size, geom.kv_size), geom.jnp_dtype)
    o_shape = (geom.tokens, geom.q_size)
    if layer_loop:
        o_shape = (geom.num_layers,) + o_shape
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(o_shape, jnp.float32), cache, cache),
        in_specs=[smem] * 4 + [vmem] * 3 + [hbm] * 2,
        out_specs=(vmem, hbm, hbm),
        scratch_shapes=attention_scratch(geom),
        input_output_aliases={7: 1, 8: 2},
        interpret=tpu_interpreter(detect_races=True) if interpret else False,
    )


def make_inputs(case: Case, layer_loop: bool = False, seed: int = 0):
    geom = case.geometry()
    rng = np.random.default_rng(seed)
    dt = geom.jnp_dtype
    pages = num_pages(case)
    tables = rng.permutation(pages)[: case.batch * case.pages_per_seq]
    tables = tables.reshape(case.batch, case.pages_per_seq).astype(np.int32)
    positions = case.position_array()
    lengths = np.asarray(case.lengths, np.int32)
    shape = (NUM_LAYERS, pages, geom.page_size, geom.kv_size)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    if case.nan_garbage:  # every row that is neither cached nor written this step is NaN
        used = np.zeros(shape[1:3], bool)
        for b in range(case.batch):
            for p in list(range(lengths[b])) + list(positions[b]):
                used[tables[b, p // geom.page_size], p % geom.page_size] = True
        k[:, ~used] = np.nan
        v[:, ~used] = np.nan
    if case.nan_below_window:
        s = geom.tile_rows
        for layer, w in enumerate(case.windows):
            for b in range(case.batch * bool(w)):
                row = positions[b]
                kv_end = max(int(x) + 1 for x in row)
                first = min([kv_end - 1] + [max(int(x) - w + 1, 0) for x in row if x >= 0]) // s * s
                for p in range(first):
                    k[layer, tables[b, p // geom.page_size], p % geom.page_size] = np.nan
                    v[layer, tables[b, p // geom.page_size], p % geom.page_size] = np.nan
    lead = (NUM_LAYERS,) if layer_loop else ()
    q = rng.standard_normal(lead + (geom.tokens, geom.q_size), np.float32)
    k_new = rng.standard_normal(lead + (geom.tokens, geom.kv_size), np.float32)
    v_new = rng.standard_normal(lead + (geom.tokens, geom.kv_size), np.float32)
    return (np.asarray([LAYER], np.int32), tables, lengths, positions, q,
            jnp.asarray(k_new, dt), jnp.asarray(v_new, dt), jnp.asarray(k, dt), jnp.asarray(v, dt))


def expected(case: Case, layer, tables, lengths, positions, q, k_new, v_new, k, v):
    """One layer of tpumk.model.reference.decode_step: in-place page writes, gather, reference.attend."""
    geom = case.geometry()
    b, t, ps = case.batch, case.q_len, geom.page_size
    window = geom.window(int(np.asarray(layer)[0]))
    cfg = ModelConfig(name="attention-test", num_layers=NUM_LAYERS, hidden_size=geom.q_size,
                      num_q_heads=geom.num_q_heads, num_kv_heads=geom.num_kv_heads,
                      head_dim=geom.head_dim, vocab_size=128, ffn_size=128, dtype=case.dtype)

    @jax.jit  # one XLA program instead of dozens of eager dispatches (keeps the test fast)
    def run(layer, tables, lengths, positions, q, k_new, v_new, k, v):
        layer = layer[0]
        page_ids = jnp.take_along_axis(tables, positions // ps, axis=1)
        slots = positions % ps
        kc = k.at[layer, page_ids, slots].set(k_new.reshape(b, t, geom.kv_size))
        vc = v.at[layer, page_ids, slots].set(v_new.reshape(b, t, geom.kv_size))
        ctx = case.pages_per_seq * ps
        k_pos = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (b, ctx))
        k_valid = (k_pos < lengths[:, None]) | jnp.any(k_pos[:, :, None] == positions[:, None, :], -1)
        # The reference gives a masked key weight 0, and 0 * NaN = NaN: feed it zeros where the
        # cache holds garbage, which is what the kernel must be equivalent to.
        ks = jnp.nan_to_num(kc[layer][tables]).reshape(b, ctx, geom.num_kv_heads, geom.head_dim)
        vs = jnp.nan_to_num(vc[layer][tables]).reshape(b, ctx, geom.num_kv_heads, geom.head_dim)
        qr = q.reshape(b, t, geom.num_q_heads, geom.head_dim)
        o = reference.attend(cfg.attention, qr, ks, vs, positions, k_pos, k_valid, window)
        return o.reshape(b * t, geom.q_size), kc, vc

    return run(layer, tables, lengths, positions, q, k_new, v_new, k, v)


# What runs in interpret mode and compiles: each geometry once, two of them in the megakernel's
# shape ("loop-" + name: a layer loop with attention_prefetch), which also covers both layers.
RUNS = ["f32-b1-q1-t1-n2", "loop-f32-b4-q3-t2-n3", "f32-b8-q1-t2-n2-g8", "f32-b2-q3-t1-n3-overwrite-nan",
        "bf16-b1-q3-t1-n3", "bf16-b4-q1-t2-n2", "loop-bf16-b4-q3-t2-n2-g4",
        "f32-b2-q1-t1-n2-d64", "loop-bf16-b2-q2-t1-n3-d64-g2", "f32-b1-q2-t1-n2-d256",
        "loop-f32-b3-q3-t1-n2-w10", "loop-bf16-b2-q2-t1-n3-d64-w20"]


def _resolve(name: str) -> tuple[Case, bool]:
    loop = name.startswith("loop-")
    return CASES[name.removeprefix("loop-")], loop


def run_expected(case: Case, loop: bool, args):
    """The reference for the wrapper: one layer, or every layer in turn for the layer loop."""
    layer, tables, lengths, positions, q, k_new, v_new, k, v = args
    if not loop:
        return expected(case, layer, tables, lengths, positions, q, k_new, v_new, k, v)
    outs = []
    for i in range(NUM_LAYERS):
        o, k, v = expected(case, np.asarray([i], np.int32), tables, lengths, positions, q[i],
                           k_new[i], v_new[i], k, v)
        outs.append(o)
    return jnp.stack(outs), k, v


@pytest.mark.parametrize("name", RUNS)
def test_attention_stage_matches_reference(name):
    case, loop = _resolve(name)
    geom = case.geometry()
    args = make_inputs(case, loop)
    want_o, want_k, want_v = run_expected(case, loop, args)
    o, k, v = jax.block_until_ready(jax.jit(make_call(geom, num_pages(case), True, loop),
                                            compiler_options=INTERPRET_COMPILER_OPTIONS)(*args))
    races = interpret_races()
    assert races is not None and not races.races_found, "data race detected"

    # Caches: the new rows land exactly (a copy), every other row of every layer is untouched.
    np.testing.assert_array_equal(np.asarray(k, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(want_v, np.float32))

    o, want_o = np.asarray(o), np.asarray(want_o)
    assert np.all(np.isfinite(o))
    if case.dtype == "float32":
        # Same math in f32; only summation order (online softmax, tiled p.v) differs.
        np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    else:
        # bf16 bound: both sides round each probability to bf16 (relative error <= 2^-9), the
        # reference after normalising, the kernel before (it divides by the f32 sum at the end),
        # so |o - o_ref| <= sum_k (2^-9 + 2^-9) p_k |v_k| <= 2^-8 max|v|. Scores are identical
        # bf16 x bf16 products summed in f32 (order-only differences, ~1e-6 here).
        vmax = max(float(np.nanmax(np.abs(np.asarray(a, np.float32)))) for a in (args[6], args[8]))
        np.testing.assert_allclose(o, want_o, rtol=0, atol=2.0**-8 * vmax + 1e-5)


V5E = ("loop-f32-b4-q3-t2-n3", "loop-bf16-b4-q3-t2-n2-g4")


@pytest.mark.parametrize("name, target", [(n, t) for n in RUNS for t in TARGETS] + [(n, "v5e") for n in V5E])
def test_attention_stage_compiles_deviceless(name, target):
    """Interpret mode does not check Mosaic's layout rules: every configuration run above must
    also compile for real TPU targets."""
    case, loop = _resolve(name)
    specs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in make_inputs(case, loop))
    tgt = get_target(target)
    static_profile.clear()
    compiled = compile_for(make_call(case.geometry(), num_pages(case), False, loop), specs, tgt)
    assert compiled.custom_calls == 1
    # The tuner ranks builds by libtpu's static cost profile; a stage that crashes or starves
    # it would take the whole megakernel build down, so check it profiles too (when enabled).
    if static_profile.profile_dir() is not None and tgt.static_profile:
        cycles = static_profile.collect(tgt.device().device_kind)
        assert any(k.startswith("tpu_custom_call") and v > 0 for k, v in cycles.items()), cycles


_PROFILE_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tpumk.compat import interpret_races
from tpumk.estimate import static_profile
static_profile.enable(sys.argv[2])  # before JAX starts libtpu: the flag is read once per process
import test_attention_stage as t
out = {}
for name in sys.argv[4:]:
    t.test_attention_stage_compiles_deviceless(name, sys.argv[3])  # asserts cycles > 0
    out[name] = "ok"
print("RESULT " + json.dumps(out))
"""


def test_attention_stage_static_profile_on_tpu7x(tmp_path):
    """libtpu 0.0.52's static profiler crashed (a DMA wait inside a branch) or ran out of memory
    (vector work inside branches of the tile loop) on earlier versions of this stage, on TPU7x
    only. The flag must be set before libtpu starts, so this runs in a fresh process."""
    from tpumk.targets import get_target

    if not get_target("tpu7x").static_profile:  # the vLLM TPU stack's libtpu 0.0.48 (tpumk.compat)
        pytest.skip("this libtpu's static profiler does not take kernels with DMAs (libtpu_profiles_dma_kernels)")
    names = ["loop-f32-b4-q3-t2-n3", "bf16-b1-q3-t1-n3", "bf16-b4-q1-t2-n2", "loop-bf16-b4-q3-t2-n2-g4",
             "loop-bf16-b2-q2-t1-n3-d64-w20"]
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    args = [str(Path(__file__).parent), str(tmp_path), "tpu7x", *names]
    proc = subprocess.run([sys.executable, "-c", _PROFILE_SCRIPT, *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"RESULT {json.dumps({n: 'ok' for n in names})}" in proc.stdout


def _geom(**changes) -> AttentionGeometry:
    return dataclasses.replace(CASES["f32-b4-q3-t2-n3"].geometry(), **changes)


@pytest.mark.parametrize("changes, knob", [
    (dict(page_size=12), "page_size"),
    (dict(page_size=8, dtype="bfloat16"), "page_size"),
    (dict(kv_tile_pages=0), "kv_tile_pages"),
    (dict(kv_tile_pages=7), "kv_tile_pages"),
    (dict(kv_buffers=1), "kv_buffers"),
    (dict(head_dim=96), "head_dim"),
    (dict(head_dim=64, num_q_heads=3, num_kv_heads=1), "num_kv_heads"),
    (dict(windows=(4,)), "windows"),
    (dict(num_q_heads=6, num_kv_heads=4), "num_kv_heads"),
    (dict(dtype="float16"), "dtype"),
])
def test_bad_knobs_raise_plan_error(changes, knob):
    with pytest.raises(PlanError, match=rf"attention: {knob} = "):
        _geom(**changes).validate()
    with pytest.raises(PlanError, match=knob):
        attention_scratch(_geom(**changes))


def test_from_config_and_vmem_formula():
    cfg = ModelConfig(name="m", num_layers=3, hidden_size=256, num_q_heads=8, num_kv_heads=2,
                      head_dim=128, vocab_size=128, ffn_size=128, dtype="bfloat16")
    g = AttentionGeometry.from_config(cfg, batch=3, q_len=2, page_size=16, pages_per_seq=8,
                                      kv_tile_pages=3, kv_buffers=3)
    g.validate()
    assert (g.num_layers, g.group, g.kv_size, g.dtype) == (3, 4, 256, "bfloat16")
    assert (g.smem_bytes(), g.dma_semaphores()) == (4 * 3 * (3 + 2), 2 * 3 * 3 + 2 * 6)
    # R = round_up(4 * 2, 8), Bq8 = round_up(6, 8); 6 patch pages + the sink (q_len > 1).
    hd, s, r, bq8 = 256, 3 * 16, 8, 8
    want = (2 * 3 * s * hd * 2 + 2 * (6 + 1) * 16 * hd * 2 + 4 * (2 * bq8 * hd + bq8 * 8 * 128)
            + 4 * 3 * 2 * r * 128 + 4 * 2 * r * (2 * 128 + 128))
    assert g.vmem_bytes() == want
    # Every VMEM buffer is whole (sublane x 128) tiles, so logical bytes = allocated bytes.
    for _, shape, dt in g.vmem_shapes():
        sub = 16 if dt == jnp.bfloat16 else 8
        assert shape[-1] % 128 == 0 and shape[-2] % sub == 0, shape
    # The scratch list (what the kernel contract and the plan count) is what the stage unpacks,
    # and its SMEM / semaphore entries are the ones smem_bytes / dma_semaphores describe.
    scratch = g.scratch()
    names = [b.name for b in scratch]  # the stage binds refs by name: every one a field, no repeats
    assert set(names) <= set(AttentionScratch._fields) and len(set(names)) == len(names)
    packed = dataclasses.replace(g, kv_dtype="fp8").scratch()  # a quantized cache: one packed array
    assert {b.name for b in packed} - set(names) == {"kv_tiles", "kv_patch", "new_exps"}
    assert {b.name for b in packed} <= set(AttentionScratch._fields)
    assert all(b.nbytes == b.logical_bytes for b in scratch)
    assert sum(b.nbytes for b in scratch if b.space == "smem") == g.smem_bytes()
    assert sum(b.count for b in scratch if b.space == "semaphore") == g.dma_semaphores()


def test_hbm_bytes_counts_the_kernels_dmas():
    g = _geom(batch=2, q_len=1, kv_tile_pages=2)  # f32, page 8 tokens, tile 16 tokens
    page = 8 * g.kv_size * 4
    # Sequence 0: length 15 -> new token at 15 (page 1), one tile of pages 0 and 1; page 1 is
    # patched, so the tile takes it from VMEM: 1 HBM tile page + 1 patch read + 1 write.
    # Sequence 1: length 16 -> token 16 on page 2, tiles (0, 1) and (2, 2 repeated): 2 HBM
    # tile pages + 1 read + 1 write; both copies of page 2 come from the patch buffer.
    assert g.dma_counts(np.array([[15], [16]])) == {
        "hbm_tile_pages": 3, "local_tile_pages": 3, "patched_pages": 2, "tiles": 3}
    assert g.hbm_bytes([15, 16]) == 2 * (3 + 2 * 2) * page * NUM_LAYERS


def test_dma_counts_clamp_as_the_kernel_does():
    """Out-of-range positions patch nothing and stream only the pages the sequence uses:
    max(in-range position + 1, min(length, capacity) for a position past the capacity, 1)."""
    g = _geom(batch=2, q_len=1, kv_tile_pages=2)  # f32, page 8, 6 pages per sequence: capacity 48
    # Sequence 0 at 60 with 9 cached tokens: rows 0..8, one tile of pages 0 and 1, both from HBM.
    # Sequence 1 at -3: one tile (kv_end 1) whose two slots repeat page 0.
    assert g.dma_counts(np.array([[60], [-3]]), lengths=[9, 4]) == {
        "hbm_tile_pages": 4, "local_tile_pages": 0, "patched_pages": 0, "tiles": 2}
    # Without lengths a position past the capacity streams the whole capacity (an upper bound).
    assert g.dma_counts(np.array([[60], [-3]])) == {"hbm_tile_pages": 8, "local_tile_pages": 0, "patched_pages": 0,
                                                    "tiles": 4}
    assert g.hbm_bytes([9, 4], positions=np.array([[60], [-3]])) == 2 * 4 * g.page_bytes * NUM_LAYERS


def test_the_sink_page_is_always_allocated():
    """Out-of-range tokens take stand-in DMAs from the sink page, so q_len = 1 allocates it too
    (and the plan's VMEM count, which sums `scratch()`, includes it)."""
    for q_len in (1, 3):
        g = _geom(q_len=q_len)
        assert g.patch_pages == g.tokens + 1
        shapes = {b.name: b.shape for b in g.scratch()}
        assert shapes["k_patch"][0] == shapes["v_patch"][0] == g.tokens + 1


def test_dma_counts_stream_only_the_window_tiles():
    g = _geom(batch=2, q_len=1, kv_tile_pages=1)  # f32, page = tile = 8 tokens
    pos, lengths = np.array([[20], [5]]), [20, 5]
    # Full: sequence 0 streams tiles 0..2 (page 2 patched, a VMEM copy), sequence 1 tile 0.
    assert g.dma_counts(pos, lengths) == {"hbm_tile_pages": 2, "local_tile_pages": 2, "patched_pages": 2, "tiles": 4}
    # Window 10: the query at 20 sees keys 11..20, so sequence 0 starts at tile 1; sequence 1's
    # window reaches key 0.
    assert g.dma_counts(pos, lengths, window=10) == {
        "hbm_tile_pages": 1, "local_tile_pages": 2, "patched_pages": 2, "tiles": 3}
    # hbm_bytes sums the layers' own windows (layer 0 full, layer 1 sliding).
    gw = dataclasses.replace(g, windows=(0, 10))
    assert gw.hbm_bytes(lengths) == 2 * ((2 + 2 * 2) + (1 + 2 * 2)) * g.page_bytes
