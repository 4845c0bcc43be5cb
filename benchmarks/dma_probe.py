"""Probe the TPU compiler's static DMA model: kernels that differ only in DMA count, size and depth.

Issue 16's first question: what does the compiler's static cost estimate (TPU_FACTS section 3)
charge a stream of DMAs, as a function of
  - the size of each DMA (a 16-token KV page is 32 KiB for 8 KV heads x 128 bf16; a weight tile 2 MiB),
  - the number of DMAs for the same bytes,
  - how many are in flight (ring depth), and
  - whether a ring slot is filled by one DMA or by several smaller ones (attention's
    `kv_tile_pages` page DMAs per tile slot)?

Every probe kernel is the same grid-less `pallas_call`: one flat `fori_loop` (a single loop level,
which the static profile counts per trip) over `count` steps; step g waits for slot g % depth, adds
the slot's first 8 rows to an accumulator (negligible vector work, so the figure is the DMA
stream's), then refills the slot with the DMAs of step g + depth. A slot holds `rows_per_dma *
dmas_per_slot` rows of a [rows, 1024] bf16 HBM array (2 KiB per row); the slot's DMAs read
contiguous rows (`--scatter` makes them read rows from a block-table-like permutation, as KV pages
do). All variants of a sweep move the same total bytes. Keep that total at 24 MiB or more: on
TPU7x the compiler charges DMAs from an HBM array of 20 MiB or less some 30x less (a separate
regime of its model, found by this probe), and the arrays decode streams (weights, KV cache)
are gigabytes.

    python benchmarks/dma_probe.py [--target tpu7x v6e] [--total-mib 32] [--sweep size grouped ...]
                                   [--sem-per-dma] [--scatter] [--variant 16,1,4 ...] [--out probe.json]

It starts itself with libtpu's static-profile flag on (`tpumk.estimate.static_profile.enable`,
read once at start-up), compiles every variant deviceless for each target, and prints cycles,
cycles per DMA, cycles per MiB, and the calibrated seconds (`tpumk.estimate.calibration`: the
published TPU7x ring measured at 3.0 TB/s; v6e's conversion ASSUMES the same fraction of its
bandwidth) next to tpumk's timeline model of the same stream. Each compile takes ~0.5-2 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

COLS = 1024  # bf16 lanes of one row: 2 KiB, the row of a KV page with 8 KV heads x 128
ROW_BYTES = COLS * 2

# (rows_per_dma, dmas_per_slot, depth): the sweeps BENCHMARKS.md reports
SIZE_SWEEP = [(r, 1, d) for r in (16, 64, 256, 1024) for d in (2, 4, 8, 16)]
GROUPED = [(16, k, nb) for k in (4, 16) for nb in (2, 3, 4)] + [(16 * k, 1, nb) for k in (4, 16) for nb in (2, 3, 4)]
SAME_BYTES_IN_FLIGHT = [(1024, 1, 12), (512, 1, 24), (2048, 1, 6), (256, 1, 48)]
DEEP = [(16, 1, d) for d in (32, 64, 128, 256)] + [(64, 1, d) for d in (32, 64, 128)]
# many page DMAs per slot, deep: separates a per-DMA issue cost from the loop's per-step cost
DEEP_GROUPED = [(16, 16, nb) for nb in (8, 16)] + [(16, 4, nb) for nb in (32, 64)]


def probe_kernel(rows_per_dma: int, dmas_per_slot: int, depth: int, total_rows: int, scatter: bool,
                 sem_per_dma: bool = False, outer: int = 1):
    """(fn, arg specs, bytes moved, DMAs issued) of one probe variant (see the module doc)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    slot_rows = rows_per_dma * dmas_per_slot
    count = total_rows // slot_rows
    chunks = total_rows // rows_per_dma

    def kernel(table_ref, x_hbm, o_ref, ring, sems):
        def copies(g, slot):
            out = []
            for j in range(dmas_per_slot):
                c = g * dmas_per_slot + j
                src = table_ref[c] if scatter else c
                out.append(pltpu.make_async_copy(x_hbm.at[pl.ds(src * rows_per_dma, rows_per_dma)],
                                                 ring.at[slot, pl.ds(j * rows_per_dma, rows_per_dma)],
                                                 sems.at[slot, j if sem_per_dma else 0]))
            return out

        per_layer = count // outer

        def stream(base, acc):
            """Steps base .. base + per_layer: `depth` slots in flight, refilled after each wait."""
            for g in range(min(depth, per_layer)):
                for c in copies(base + g, g):
                    c.start()

            def body(g, acc):
                slot = jax.lax.rem(g, depth)
                for c in copies(base + g, slot):
                    c.wait()
                acc = acc + ring[slot, pl.ds(0, 8), :].astype(jnp.float32)

                @pl.when(g + depth < per_layer)
                def _():
                    for c in copies(base + g + depth, slot):
                        c.start()

                return acc

            return jax.lax.fori_loop(0, per_layer, body, acc)

        acc = jnp.zeros(o_ref.shape, jnp.float32)
        if outer == 1:
            o_ref[...] = stream(0, acc)
        else:  # the same stream split into `outer` layers: a loop nested in a loop, as attention's tiles
            o_ref[...] = jax.lax.fori_loop(0, outer, lambda layer, a: stream(layer * per_layer, a), acc)

    def step(table, x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, COLS), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((depth, slot_rows, COLS), jnp.bfloat16),
                            pltpu.SemaphoreType.DMA((depth, dmas_per_slot if sem_per_dma else 1))],
        )(table, x)

    del np
    specs = (jax.ShapeDtypeStruct((chunks,), jnp.int32), jax.ShapeDtypeStruct((total_rows, COLS), jnp.bfloat16))
    return step, specs, total_rows * ROW_BYTES, chunks


def model_seconds(target, rows_per_dma: int, dmas_per_slot: int, depth: int, total_rows: int,
                  sem_per_dma: bool = False) -> float:
    """tpumk's timeline model of the same stream (as `_attention_stage` costs a KV tile stream):
    a slot is one DMA queue (one semaphore), or `dmas_per_slot` queues with --sem-per-dma."""
    from tpumk.estimate.timeline import DMA_LATENCY_S, load_seconds

    slot_bytes = rows_per_dma * dmas_per_slot * ROW_BYTES
    count = total_rows // (rows_per_dma * dmas_per_slot)
    queues = dmas_per_slot if sem_per_dma else 1
    return DMA_LATENCY_S + count * load_seconds(target, slot_bytes, depth * slot_bytes, dmas_per_slot,
                                                queues, depth * queues)


def run(targets: list[str], total_mib: int, scatter: bool, sweeps: dict[str, list],
        sem_per_dma: bool = False, outer: int = 1) -> list[dict]:
    from tpumk.compile.aot import compile_for
    from tpumk.estimate import static_profile
    from tpumk.estimate.calibration import calibration_for
    from tpumk.targets import get_target

    total_rows = total_mib * 2**20 // ROW_BYTES
    rows = []
    for name in targets:
        target = get_target(name)
        cal = calibration_for(name)
        for sweep, variants in sweeps.items():
            for variant in variants:
                rpd, k, depth = variant[:3]
                per_dma = bool(variant[3]) if len(variant) > 3 else sem_per_dma
                fn, specs, nbytes, dmas = probe_kernel(rpd, k, depth, total_rows, scatter, per_dma, outer)
                static_profile.clear()
                t0 = time.perf_counter()
                try:
                    compiled = compile_for(fn, specs, target)
                    cycles = sum(static_profile.collect(compiled.device_kind).values())
                    err = None
                except Exception as e:  # noqa: BLE001 - a probe row records the compiler's verdict
                    cycles, err = 0, str(e).splitlines()[0][:200]
                row = {"target": name, "sweep": sweep, "dma_kib": rpd * ROW_BYTES // 1024, "dmas_per_slot": k,
                       "depth": depth, "outer": outer, "sem_per_dma": per_dma, "scatter": scatter, "in_flight_kib": depth * k * rpd * ROW_BYTES // 1024, "dmas": dmas,
                       "mib": nbytes / 2**20, "cycles": cycles, "cycles_per_dma": cycles / dmas if cycles else None,
                       "cycles_per_mib": cycles / (nbytes / 2**20) if cycles else None,
                       "compiler_us": cal.seconds(cycles) * 1e6 if (cal and cycles) else None,
                       "model_us": model_seconds(target, rpd, k, depth, total_rows, per_dma) * 1e6,
                       "compile_s": time.perf_counter() - t0, "error": err}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs="+", default=["tpu7x", "v6e"])
    ap.add_argument("--total-mib", type=int, default=32,
                    help="bytes every variant moves (default 32 MiB; on TPU7x keep it >= 24 MiB, see BENCHMARKS.md)")
    ap.add_argument("--scatter", action="store_true", help="DMA sources from a permuted block table")
    ap.add_argument("--sweep", nargs="+", default=["size", "grouped", "same_bytes"],
                    choices=["size", "grouped", "same_bytes", "deep", "deep_grouped"])
    ap.add_argument("--variant", nargs="+", metavar="ROWS,DMAS,DEPTH[,SEM_PER_DMA]",
                    help="run these variants instead of the sweeps (rows per DMA, DMAs per slot, slots in flight, "
                         "1: a semaphore per DMA)")
    ap.add_argument("--sem-per-dma", action="store_true",
                    help="every DMA of a slot signals its own semaphore (default: one per slot, as attention's tiles)")
    ap.add_argument("--outer", type=int, default=1,
                    help="split the stream into this many layers of an outer fori_loop (a nested loop, as the "
                         "megakernel's attention tiles inside its layer loop)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)

    from tpumk.estimate import static_profile

    if static_profile.enable() is None:
        print("dma_probe: JAX backends started before the static profile could be enabled", file=sys.stderr)
        return 2
    table = {"size": SIZE_SWEEP, "grouped": GROUPED, "same_bytes": SAME_BYTES_IN_FLIGHT, "deep": DEEP,
             "deep_grouped": DEEP_GROUPED}
    sweeps = {k: table[k] for k in args.sweep}
    if args.variant:
        sweeps = {"variant": [tuple(int(x) for x in v.split(",")) for v in args.variant]}
    rows = run(args.target, args.total_mib, args.scatter, sweeps, args.sem_per_dma, args.outer)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
