"""Issue 5's calibration test: the tuner's `compiler` and `model` objectives count all the work.

The compiler's static profile counts a loop nested in the layer loop once per layer, not per
trip (TPU_FACTS 3); tpumk's build report adds the missing trips (`nested_loop_cycles`), so the
compiler objective is `estimated_cycles` / `estimated_seconds`. On kernels of known cost (a
bf16 tiny-dense model, which libtpu's profiler accepts; it aborts on float32 kernels) this
proves that:
(a) the compiler objective grows linearly with the number of layers (the nested KV-tile trips
    included), and the bytes a layer streams cost what the ring streams them at: widening the
    model adds cycles at the calibrated streaming rate, neither ignoring the bytes nor
    counting them twice;
(b) tpumk's timeline model (`tpumk.estimate.timeline.megakernel_step`) does the same;
(c) the two rank a set of ring configurations the same way.

The context is 1024 tokens so attention walks 4 KV tiles per layer: 3 trips per layer that the
profile alone would miss. Every build compiles twice (the executable, then the profiling
compile in its own process): about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import itertools

import pytest

from estimate_support import needs_compiler_estimate
from tpumk.build import build
from tpumk.estimate.calibration import ANCHOR_BYTES_PER_S
from tpumk.model.config import load_preset
from tpumk.estimate.timeline import achieved_bandwidth, megakernel_step
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec

TARGET = get_target("tpu7x")
CONTEXT = 1024
KIB = 1024
BASE = load_preset("tiny-dense").replace(dtype="bfloat16")
WIDE = BASE.replace(hidden_size=1024)  # 4x the hidden size: ~4x the weight bytes per layer; same attention
# libtpu 0.0.52's profiler aborts on some ring geometries of these small models (e.g. depth 4
# with 64 KiB tiles); these five profile cleanly and span a 1.2x range in its estimate.
RANKED = [dict(ring_depth=2, tile_bytes=64 * KIB), dict(ring_depth=2, tile_bytes=128 * KIB),
          dict(ring_depth=2, tile_bytes=256 * KIB), dict(ring_depth=2, tile_bytes=2048 * KIB),
          dict(ring_depth=12, tile_bytes=2048 * KIB)]
NEAR_TIE = 0.03  # configurations that stream the same bytes with the same tiles differ by ~1% in the profile


_builds: dict = {}


def _build(cfg, **knobs):
    key = (cfg, TuningConfig(**knobs))  # by the knobs' values: RANKED's last entry is the default build
    if key not in _builds:
        b = build(BuildSpec(cfg, TARGET, batch=1, context=CONTEXT, tuning=key[1]), estimate=True)
        r = b.report
        assert r.estimated_cycles is not None, f"no compiler estimate for {cfg.name} {knobs}: {r.estimate_source}"
        _builds[key] = b
    return _builds[key]


def _layers(cfg, n):
    return cfg.replace(num_layers=n)


def _per_layer(values: dict[int, float]) -> tuple[float, float]:
    """Per-layer increments between 2 -> 4 and 4 -> 8 layers."""
    return (values[4] - values[2]) / 2, (values[8] - values[4]) / 4


def _plan(cfg):
    """The plan `_build` would compile (tpumk's model needs no compile), default knobs."""
    return make_plan(BuildSpec(cfg, TARGET, batch=1, context=CONTEXT, tuning=TuningConfig()))


def _layer_bytes(cfg) -> float:
    lo, hi = _plan(_layers(cfg, 2)).hbm_bytes, _plan(_layers(cfg, 4)).hbm_bytes
    return (hi - lo) / 2


# ---------------------------------------------------------------------- (a) the compiler objective
@pytest.mark.full  # tests/README.md: what covers it in the default run
@needs_compiler_estimate
def test_compiler_objective_is_linear_in_layers_nested_trips_included():
    reports = {n: _build(_layers(BASE, n)).report for n in (2, 4, 8)}
    cycles = {n: r.estimated_cycles for n, r in reports.items()}
    first, second = _per_layer(cycles)
    assert first > 0 and second == pytest.approx(first, rel=0.10)
    # the nested KV-tile loop: 3 uncounted trips per layer, added by tpumk's model of them
    nested = {n: r.nested_loop_cycles for n, r in reports.items()}
    assert nested[2] > 0
    assert nested[4] == pytest.approx(2 * nested[2], rel=0.01) and nested[8] == pytest.approx(4 * nested[2], rel=0.01)
    for r in reports.values():
        assert r.estimated_cycles == r.compiler_cycles + r.nested_loop_cycles
        assert r.estimated_seconds >= r.floor_seconds  # a figure under the floor would be no result


def _marginal(cost, of=_build) -> tuple[float, float]:
    """(extra cost per layer, extra bytes per layer) of WIDE over BASE, from 2- and 4-layer
    builds (`of`: `_build`, or `_plan` for a cost that reads only the plan)."""
    per_layer = {c: (cost(of(_layers(c, 4))) - cost(of(_layers(c, 2)))) / 2 for c in (BASE, WIDE)}
    return per_layer[WIDE] - per_layer[BASE], _layer_bytes(WIDE) - _layer_bytes(BASE)


# A layer's extra bytes must cost between 0.45 and 1.25x of what the ring streams them at:
# less than that would mean bytes are ignored (some may hide under the layer's fixed work,
# never most of them at 4x the bytes), more that they are counted twice. (The floor was 0.5
# until the KV reads moved earlier in the layer, 2026-12-01: the compiler then charged 0.49.)
MARGINAL = (0.45, 1.25)


# The full tier (two more estimate builds, of WIDE): the default run holds the compiler objective
# to each layer's work (the test above) and tpumk's model to the bytes a layer streams (below);
# test_dma_probe.py checks that the compiler charges the ring's streams.
@pytest.mark.full
def test_compiler_objective_grows_with_the_bytes_a_layer_streams():
    extra_cycles, extra_bytes = _marginal(lambda b: b.report.estimated_cycles)
    assert extra_bytes > _layer_bytes(BASE)  # the wide layer streams more than twice the bytes
    r = _build(_layers(BASE, 2)).report
    seconds_per_cycle = r.estimated_seconds / r.estimated_cycles
    ring_cycles_per_byte = 1 / (ANCHOR_BYTES_PER_S * seconds_per_cycle)  # the calibration probe's rate
    ratio = (extra_cycles / extra_bytes) / ring_cycles_per_byte
    assert MARGINAL[0] <= ratio <= MARGINAL[1], ratio


# ---------------------------------------------------------------------- (b) the model objective
def test_model_objective_is_linear_in_layers_and_grows_with_bytes():
    seconds = {n: megakernel_step(_plan(_layers(BASE, n))).seconds for n in (2, 4, 8)}
    first, second = _per_layer(seconds)
    assert first > 0 and second == pytest.approx(first, rel=0.02)
    extra_seconds, extra_bytes = _marginal(lambda plan: megakernel_step(plan).seconds, of=_plan)
    plan = _plan(_layers(WIDE, 2))
    ring_seconds_per_byte = 1 / achieved_bandwidth(TARGET, plan.ring_depth * plan.tuning.tile_bytes)
    ratio = (extra_seconds / extra_bytes) / ring_seconds_per_byte
    assert MARGINAL[0] <= ratio <= MARGINAL[1], ratio


# ---------------------------------------------------------------------- (c) both rank alike
# The full tier (five estimate builds): (a) and (b) above hold both objectives to the work they
# count in the default run; the ranking is the property a release is checked for.
@pytest.mark.full
def test_compiler_and_model_rank_ring_configurations_alike():
    cfg = _layers(BASE, 8)
    compiler = [_build(cfg, **k).report.estimated_seconds for k in RANKED]
    model = [megakernel_step(_build(cfg, **k).plan).seconds for k in RANKED]
    decisive = agree = 0
    for i, j in itertools.combinations(range(len(RANKED)), 2):
        dc = (compiler[i] - compiler[j]) / min(compiler[i], compiler[j])
        dm = (model[i] - model[j]) / min(model[i], model[j])
        if abs(dc) < NEAR_TIE or abs(dm) < NEAR_TIE:
            continue  # a near-tie in either objective says nothing about the ranking
        decisive += 1
        agree += (dc > 0) == (dm > 0)
    table = [(k, round(c * 1e6, 1), round(m * 1e6, 1)) for k, c, m in zip(RANKED, compiler, model)]
    assert decisive >= 5, table
    assert agree == decisive, table
    # smaller tiles at the same depth keep fewer bytes in flight: both objectives say slower
    assert compiler[0] > compiler[1] > compiler[3] and model[0] > model[1] > model[3]
