"""The DMA evidence behind tpumk's timeline model (BENCHMARKS.md "What the compiler charges a DMA").

benchmarks/dma_probe.py compiles kernels that differ only in DMA count, size and depth and reads
the compiler's static estimate. These tests re-run a few of its variants for TPU7x (a fresh
process: libtpu reads the profile flag once) and check the facts the model's DMA law rests on,
then check that the model follows them. If a libtpu upgrade changes its DMA model, these fail
and the constants in tpumk.estimate.timeline.DMA_ENGINE must be re-derived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimate_support import needs_compiler_estimate
from tpumk.estimate import timeline as cm
from tpumk.targets import get_target

ROOT = Path(__file__).resolve().parents[1]
TPU7X = get_target("tpu7x")
KIB, MIB = 1024, 2**20
# rows per DMA (2 KiB rows), DMAs per slot, slots in flight, semaphore per DMA
VARIANTS = ["16,1,2", "16,1,8", "64,1,4", "256,1,2", "16,16,2", "16,16,2,1", "1024,1,12", "2048,1,6"]


@pytest.fixture(scope="module")
def probe() -> dict[tuple, dict]:
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dma_probe.py"), "--target", "tpu7x",
                          "--total-mib", "32", "--variant", *VARIANTS],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(VARIANTS) and all(r["cycles"] > 0 for r in rows), rows
    return {(r["dma_kib"], r["dmas_per_slot"], r["depth"], r["sem_per_dma"]): r for r in rows}


@needs_compiler_estimate
def test_compiler_overlaps_outstanding_dmas(probe):
    """E1: cycles per DMA x DMAs in flight is the same at depth 2 and 8 (a latency, overlapped)."""
    a, b = probe[(32, 1, 2, False)], probe[(32, 1, 8, False)]
    assert a["cycles_per_dma"] * 2 == pytest.approx(b["cycles_per_dma"] * 8, rel=0.05)


@needs_compiler_estimate
def test_compiler_latency_grows_with_dma_size(probe):
    """E1: one DMA's latency grows with its bytes (a queue rate far below the chip's bandwidth)."""
    lat = {k: probe[(k, 1, d, False)]["cycles_per_dma"] * d for k, d in ((32, 2), (128, 4), (512, 2))}
    assert lat[32] < lat[128] < lat[512]
    per_mib = (lat[512] - lat[32]) / ((512 - 32) / 1024)
    seconds_per_mib = per_mib * 8.244e-10  # TPU7x's calibration (tpumk.estimate.calibration)
    # the queue rate DMA_ENGINE states for TPU7x, within 15 %
    assert MIB / seconds_per_mib == pytest.approx(cm.DMA_ENGINE["tpu7x"].queue_bytes_per_s, rel=0.15)


@needs_compiler_estimate
def test_dmas_on_one_semaphore_cost_as_one_dma(probe):
    """E2/E3: 16 page DMAs signalling one semaphore cost as one DMA of their bytes; with a
    semaphore each they overlap."""
    shared, single = probe[(32, 16, 2, False)], probe[(512, 1, 2, False)]
    assert shared["cycles"] == pytest.approx(single["cycles"], rel=0.1)
    assert probe[(32, 16, 2, True)]["cycles"] < 0.8 * shared["cycles"]


@needs_compiler_estimate
def test_compiler_prefers_more_queues_for_the_same_bytes_in_flight(probe):
    """E5: 24 MiB in flight as 12 x 2 MiB beats 6 x 4 MiB in the compiler's eyes, and in the model's."""
    assert probe[(2048, 1, 12, False)]["cycles"] < probe[(4096, 1, 6, False)]["cycles"]
    assert probe[(2048, 1, 12, False)]["model_us"] < probe[(4096, 1, 6, False)]["model_us"]


@needs_compiler_estimate
def test_model_ranks_the_probe_as_the_compiler_does(probe):
    """The model orders the small-DMA variants as the compiler does (not its absolute figures:
    the model's latency is an assumption, the compiler's cycles a calibrated estimate)."""
    keys = [(32, 1, 2, False), (128, 1, 4, False), (512, 1, 2, False), (32, 16, 2, False), (32, 1, 8, False),
            (32, 16, 2, True)]
    by_compiler = sorted(keys, key=lambda k: probe[k]["cycles"])
    by_model = sorted(keys, key=lambda k: probe[k]["model_us"])
    assert by_compiler[0] == by_model[0] and by_compiler[-1] == by_model[-1], (by_compiler, by_model)


# ---------------------------------------------------------------------- the model's law, no compile
def test_queue_law_binds_few_big_queues_not_the_published_ring():
    eng = cm.dma_engine(TPU7X)
    # 16 x 32 KiB on one semaphore, 2 slots: two queues of 512 KiB in flight
    per_slot = cm.load_seconds(TPU7X, 512 * KIB, 1 * MIB, 16, 1, 2)
    assert per_slot == pytest.approx((cm.DMA_LATENCY_S + 512 * KIB / eng.queue_bytes_per_s) / 2)
    # the same DMAs with a semaphore each: 32 queues, bound by the bytes in flight instead
    assert cm.load_seconds(TPU7X, 512 * KIB, 1 * MIB, 16, 16, 32) < per_slot
    # the published ring (12 x 2 MiB) is bound by its bytes, not its queues
    ring = cm.load_seconds(TPU7X, 2 * MIB, 24 * MIB, 1, 1, 12)
    assert ring == pytest.approx(cm.load_seconds(TPU7X, 2 * MIB, 24 * MIB, 1))


def test_targets_without_probe_figures_keep_the_stated_assumption():
    v5e = get_target("v5e")
    assert cm.dma_engine(v5e) == cm.DmaEngine(cm.DMA_DESCRIPTOR_S, None)
    assert cm.load_seconds(v5e, 512 * KIB, 1 * MIB, 16, 1, 2) == cm.load_seconds(v5e, 512 * KIB, 1 * MIB, 16)


@needs_compiler_estimate
def test_compiler_counts_a_nested_stream_once_per_step():
    """The static profile's blind spot (TPU_FACTS 3) applies to DMA streams: the same 64 MiB
    stream split over 4 trips of an outer loop (the megakernel's KV tiles inside its layer loop)
    gets well under half the cycles. So the compiler's estimate of the megakernel does not see
    attention's per-layer tile trips, and is no check of attention's cost."""
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cycles = {}
    for outer in (1, 4):
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dma_probe.py"), "--target", "tpu7x",
                              "--total-mib", "64", "--variant", "64,1,4", "--outer", str(outer)],
                             capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        cycles[outer] = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("{")))["cycles"]
    assert 0 < cycles[4] < 0.6 * cycles[1], cycles
