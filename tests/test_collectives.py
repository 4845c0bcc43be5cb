"""The in-kernel all-reduce (tpumk.kernel.collectives): interpret mode on N host CPU devices, and
deviceless compiles of the same kernel for TPU topologies (TPU_FACTS 4 and 8: one check without
the other proves little).

The interpret runs need N host devices, which XLA only makes when XLA_FLAGS is set before jax is
imported, so each runs in a subprocess: this file, run as a script (`_worker`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
CALLS = 4  # all_reduce calls per kernel: both parities, each twice
ROWS, WIDTH = 8, 256


# ---------------------------------------------------------------------- the test kernel
def make_local(geom, calls: int, interpret, counter_step: int = 1):
    """One device's body: x [1, calls, rows, width] -> [1, calls, rows, width], output t being
    all_reduce of input t (counter t * counter_step, in a fori_loop). counter_step 2 is the
    broken variant with ONE buffer (every call has parity 0), which the race detector must flag."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from tpumk.kernel.collectives import COLLECTIVE_COMPILER_PARAMS, all_reduce, all_reduce_barrier, all_reduce_scratch

    seen = {}

    def kernel(x_ref, o_ref, *scratch):
        seen["scratch"] = [(tuple(r.shape), str(r.dtype)) for r in scratch]
        all_reduce_barrier(geom)

        def body(t, carry):
            o_ref[t] = all_reduce(geom, x_ref[t], scratch, t * counter_step)
            return carry

        lax.fori_loop(0, calls, body, 0)

    def local(x):
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((calls, geom.rows, geom.padded_width), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=all_reduce_scratch(geom),
            compiler_params=pltpu.CompilerParams(**COLLECTIVE_COMPILER_PARAMS),
            interpret=interpret,
        )(x[0])
        return out[None]

    local.seen = seen
    return local


def ordered_sum(x: np.ndarray, dtype: str, schedule: str = "direct") -> np.ndarray:
    """x [N, ...] f32 -> the f32 sum x[0] + x[1] + ... + x[N-1], left to right (each term rounded
    to bf16 first when the slots are bf16; with rsag the sum rounded again, as its chunk travels).
    hierarchical: chip sums x[2r] + x[2r+1] first (each rounded when the wire is bf16), then
    those left to right."""
    import ml_dtypes

    if dtype == "bfloat16":
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if schedule == "hierarchical":
        x = x[0::2] + x[1::2]
        if dtype == "bfloat16":
            x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    acc = x[0].copy()
    for k in range(1, x.shape[0]):
        acc = acc + x[k]
    if dtype == "bfloat16" and schedule in ("rsag", "hierarchical"):
        acc = acc.astype(ml_dtypes.bfloat16).astype(np.float32)
    return acc


def _worker(n: int, schedule: str, dtype: str, counter_step: int = 1) -> dict:
    """Runs in a subprocess with n host devices: the kernel on random per-device inputs."""
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    from tpumk.compat import interpret_races, tpu_interpreter
    from tpumk.plan.geometry import AllReduceGeometry
    from tpumk.targets import INTERPRET_COMPILER_OPTIONS

    geom = AllReduceGeometry(n, ROWS if dtype == "float32" else 16, WIDTH, dtype, schedule)
    geom.validate()
    rng = np.random.default_rng(100 + n)
    # Values of mixed magnitudes, so the summation order changes the f32 bits; and in about one
    # element of 8 a large value on device 0 that device N-1 cancels, which keeps an order's
    # effect past a bf16 wire's rounding of the sum (absorbed small terms are not rounding noise).
    shape = (n, CALLS, geom.rows, geom.padded_width)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(np.float32)
    if n > 1:
        big = rng.random(shape[1:]) < 0.125
        x[0][big], x[-1][big] = 3.0e7, -3.0e7
    local = make_local(geom, CALLS, tpu_interpreter(detect_races=True), counter_step)
    mesh = Mesh(np.asarray(jax.devices("cpu")[:n]), ("tp",))
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False),
                   compiler_options=INTERPRET_COMPILER_OPTIONS)
    out = np.asarray(step(x))
    want = np.stack([ordered_sum(x[:, t], dtype, schedule) for t in range(CALLS)])
    races = interpret_races()
    # another order: the last device's partial first (two terms commute: n > 2 only)
    last_first = ordered_sum(np.concatenate([x[-1:], x[:-1]])[:, 0], dtype, schedule)
    return {
        "exact": all(bool(np.array_equal(out[d], want)) for d in range(n)),
        "same_on_devices": all(bool(np.array_equal(out[d], out[0])) for d in range(n)),
        "order_matters": not np.array_equal(last_first, want[0]),
        "max_err": float(np.max(np.abs(out - want[None]))),
        "races": None if races is None else bool(races.races_found),
        "scratch": local.seen["scratch"],
        "scratch_bytes": geom.scratch_bytes(),
    }


def _run_worker(n: int, schedule: str, dtype: str = "float32", counter_step: int = 1) -> dict:
    # NPROC sizes XLA's CPU thread pool (default: the core count, 2 here). Interpret mode runs
    # each device's kernel in a host callback, and a device blocked on a semaphore holds a pool
    # thread: with fewer threads than devices, devices still allocating their scratch wait
    # for a thread while the blocked ones wait for them (seen as a hang with 8 devices).
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * n),
               XLA_FLAGS=xla_flags(n))
    proc = subprocess.run([sys.executable, __file__, str(n), schedule, dtype, str(counter_step)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- interpret mode
@pytest.mark.parametrize("n,schedule,dtype", [
    # full: one more device count of a schedule the default run has (tests/README.md)
    pytest.param(1, "direct", "float32", marks=pytest.mark.full), (2, "direct", "float32"),
    pytest.param(4, "direct", "float32", marks=pytest.mark.full),
    pytest.param(8, "direct", "float32", marks=pytest.mark.full),
    pytest.param(4, "doubling", "float32", marks=pytest.mark.full), (8, "doubling", "float32"),
    (4, "direct", "bfloat16"), (3, "rsag", "float32"), pytest.param(4, "rsag", "float32", marks=pytest.mark.full),
    pytest.param(8, "rsag", "float32", marks=pytest.mark.full),
    (8, "rsag", "bfloat16"),  # the bf16 wire: rounded partials and chunk sums, the same bits everywhere
    # the chip-hierarchical schedule: 8 devices are 4 chips of sibling pairs (bf16 wire: chip
    # sums and totals rounded as they travel)
    pytest.param(4, "hierarchical", "float32", marks=pytest.mark.full), (8, "hierarchical", "bfloat16"),
])
def test_all_reduce_interpret(n, schedule, dtype):
    r = _run_worker(n, schedule, dtype)
    assert r["races"] is False, r
    assert r["exact"] and r["same_on_devices"], r
    assert r["order_matters"] or n <= 2, "inputs too tame: another summation order gives the same bits"
    # (3) the scratch the kernel got is what the geometry counts
    from tpumk.plan.geometry import AllReduceGeometry, SUBLANES

    rows = ROWS if dtype == "float32" else SUBLANES[dtype]
    geom = AllReduceGeometry(n, rows, WIDTH, dtype, schedule)
    want = [(b.shape, b.dtype) for b in geom.scratch()]
    got = r["scratch"]
    assert [tuple(s) for s, _ in got] == [s for s, _ in want]
    assert got[0][1] == dtype
    itemsize = 4 if dtype == "float32" else 2
    if schedule in ("rsag", "hierarchical"):  # rsag: two rounds of N chunks per parity, hierarchical four of N/2; staging
        assert r["scratch_bytes"] == 5 * n * rows * geom.chunk * itemsize
    else:
        assert r["scratch_bytes"] == int(np.prod(got[0][0])) * itemsize == 2 * n * rows * WIDTH * itemsize


def test_one_buffer_is_a_race():
    """The detector is not blind here: with every call on parity 0 (one buffer, one semaphore
    set) a fast device overwrites a slot a slow peer still reads, and it says so."""
    r = _run_worker(4, "direct", counter_step=2)
    assert r["races"] is True, r


# ---------------------------------------------------------------------- geometry
def test_geometry():
    from tpumk.errors import PlanError
    from tpumk.plan.geometry import AllReduceGeometry

    g = AllReduceGeometry.for_chip("7x", 8, 8, 4096)
    assert (g.schedule, g.stages, g.messages, g.peer_offsets()) == ("rsag", 2, 14, tuple(range(1, 8)))
    assert (g.chunk, g.padded_width) == (512, 4096)
    assert g.send_bytes == 2 * 7 * 8 * 512 * 4  # 2 (N-1) / N of a slot, not N-1 slots
    assert g.scratch_bytes() == 5 * 8 * 8 * 512 * 4
    d = AllReduceGeometry(8, 8, 4096, "float32", "direct")
    assert (d.send_bytes, d.scratch_bytes(), d.padded_width) == (7 * 8 * 4096 * 4, 2 * 8 * 8 * 4096 * 4, 4096)
    odd = AllReduceGeometry.for_chip("7x", 32, 8, 2048)  # 64 lanes a device: chunks padded to 128
    assert (odd.chunk, odd.padded_width) == (128, 4096)
    assert AllReduceGeometry.for_chip("7x", 2, 8, 4096).schedule == "direct"  # same bytes, one round
    v = AllReduceGeometry.for_chip("v5e", 4, 8, 128)
    assert (v.schedule, v.stages, v.messages, v.peer_offsets()) == ("doubling", 2, 2, (1, 2))
    assert v.send_bytes == 3 * 8 * 128 * 4
    assert AllReduceGeometry.for_chip("v5e", 2, 8, 128).schedule == "direct"
    # auto: the direct push while its N-1 slots are small (one round), else rsag (fewer bytes)
    from tpumk.plan.geometry import DIRECT_ALL_REDUCE_MAX_BYTES

    assert AllReduceGeometry.for_chip("7x", 8, 1, 5120).schedule == "direct"  # 7 x 20 KiB
    assert AllReduceGeometry.for_chip("7x", 32, 1, 4096).schedule == "rsag"  # 31 x 16 KiB
    assert 7 * 20 * 1024 <= DIRECT_ALL_REDUCE_MAX_BYTES < 31 * 16 * 1024
    assert AllReduceGeometry.for_chip("7x", 8, 1, 5120, schedule="rsag").schedule == "rsag"
    # a bfloat16 wire halves every push; auto still weighs the direct push's bytes
    w = AllReduceGeometry.for_chip("7x", 32, 1, 4096, dtype="bfloat16", schedule="rsag")
    assert w.send_bytes == AllReduceGeometry.for_chip("7x", 32, 1, 4096).send_bytes // 2
    assert AllReduceGeometry.for_chip("7x", 32, 1, 4096, dtype="bfloat16").schedule == "rsag"  # weighed at f32
    # hierarchical: rsag's chunks and bytes, half of them to the sibling; four rounds, N messages
    h = AllReduceGeometry.for_chip("7x", 8, 8, 4096, schedule="hierarchical")
    assert (h.stages, h.messages, h.chunk, h.padded_width, h.chips) == (4, 8, 512, 4096, 4)
    assert h.send_bytes == g.send_bytes and h.scratch_bytes() == g.scratch_bytes()
    # the plan's auto takes it where tpumk's interconnect model costs it less than rsag: a
    # batch-1 row is latency-bound (two more rounds lose), [64, 4096] float32 on 32 TensorCores
    # is not; the geometry's own auto stays flat
    from tpumk.plan.plan import all_reduce_geometry

    assert all_reduce_geometry("7x", 32, 1, 4096).schedule == "rsag"
    assert all_reduce_geometry("7x", 32, 64, 4096).schedule == "hierarchical"
    assert AllReduceGeometry.for_chip("7x", 32, 64, 4096).schedule == "rsag"
    assert all_reduce_geometry("v6e", 16, 64, 4096).schedule == "rsag"  # one core per chip
    assert all_reduce_geometry("7x", 32, 64, 4096, schedule="rsag").schedule == "rsag"  # asked for
    for chip, n in (("v6e", 8), ("7x", 2), ("7x", 6 + 1)):
        with pytest.raises(PlanError, match="'all_reduce' = hierarchical: needs an even number of devices"):
            AllReduceGeometry.for_chip(chip, n, 8, 4096, schedule="hierarchical")
    with pytest.raises(PlanError, match="'all_reduce' = direct: v5e routes remote DMAs only to power-of-two"):
        AllReduceGeometry.for_chip("v5e", 4, 8, 128, schedule="direct")
    for bad in (dict(rows=0), dict(width=100), dict(devices=0), dict(dtype="int8"),
                dict(schedule="ring"), dict(devices=6, schedule="doubling"), dict(devices=2, schedule="hierarchical"),
                dict(devices=5, schedule="hierarchical")):
        kw = dict(devices=4, rows=8, width=128, dtype="float32", schedule="direct")
        kw.update(bad)
        with pytest.raises(PlanError):
            AllReduceGeometry(**kw).validate()


# ---------------------------------------------------------------------- deviceless compiles
COMPILES = [  # (target, devices, schedule, slot dtype): every schedule where the chip routes it
    ("tpu7x", 8, "rsag", "float32"),
    ("tpu7x", 4, "rsag", "float32"),
    ("tpu7x", 2, "direct", "float32"),  # the two TensorCores of one chip
    ("tpu7x", 8, "doubling", "float32"),  # not for_chip's pick on TPU7x; compiles as well
    ("tpu7x", 8, "direct", "float32"),  # likewise
    ("tpu7x", 8, "direct", "bfloat16"),
    ("tpu7x", 8, "rsag", "bfloat16"),
    ("tpu7x", 32, "hierarchical", "bfloat16"),  # the 16-chip slice
    ("v6e", 4, "rsag", "float32"),
    ("v5p", 4, "rsag", "float32"),
    ("v5e", 4, "doubling", "float32"),
    ("v5e", 2, "direct", "float32"),
]


@pytest.mark.parametrize("target_name,n,schedule,dtype", COMPILES)
def test_all_reduce_compiles(target_name, n, schedule, dtype):
    import jax
    import jax.numpy as jnp

    from tpumk.compile.aot import compile_for_mesh
    from tpumk.plan.geometry import SUBLANES, AllReduceGeometry
    from tpumk.targets import get_target, mesh_devices, routes_any_offset

    target = get_target(target_name)
    rows = max(ROWS, SUBLANES[dtype])
    geom = AllReduceGeometry(n, rows, WIDTH, dtype, schedule)
    geom.validate()
    assert routes_any_offset(target) or all(o & (o - 1) == 0 for o in geom.peer_offsets())
    devices = mesh_devices(target, n)
    spec = jax.ShapeDtypeStruct((n, CALLS, rows, geom.padded_width), jnp.float32)
    c = compile_for_mesh(make_local(geom, CALLS, False), (spec,), devices, axis=geom.axis)
    hlo = c.hlo_text
    assert c.custom_calls == 1
    for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        assert op not in hlo, op
    print(f"{target_name} x{n} {schedule} {dtype}: lower {c.lower_seconds:.2f}s compile {c.compile_seconds:.2f}s")


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))))
