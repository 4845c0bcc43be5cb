"""The TPU compiler's static profile of a megakernel step, turned into a whole-step estimate.

The profile (tpumk.estimate.profiler) counts the body of a loop nested in the layer loop once
per layer, not once per trip (TPU_FACTS section 3). `uncounted_nested_work` lists those loops
(the attention KV-tile loop, the MoE expert-chunk loop) with the trips the profile missed, and
`convert_estimate` adds them, as DMA-bound streaming at the calibration's sustained rate
(tpumk's model), to the compiler's cycles, then converts cycles to seconds through the stated
calibration (tpumk.estimate.calibration). Every result says where it comes from, or why there
is none.
"""

from __future__ import annotations

from typing import Any

from tpumk.estimate.profiler import F32_PROFILER_ABORTS, Estimate
from tpumk.plan.plan import Plan


def uncounted_nested_work(plan: Plan) -> list[dict[str, Any]]:
    """Loops nested inside the layer loop, whose trips the static profile counts once per
    layer (TPU_FACTS 3): the attention KV-tile loop and the MoE expert-chunk loop. Each entry
    gives the trips per step the profile did not count and the bytes each trip streams, at the
    plan's accounting (full context, a sliding layer only its window's tiles; expected distinct
    experts)."""
    a, cfg = plan.attention, plan.cfg
    if a.windows:
        lengths = [plan.context - plan.q_len] * plan.batch
        counts = a.layer_counts([[n + i for i in range(plan.q_len)] for n in lengths], lengths)
        tiles = sum(n * c["tiles"] for n, c in counts) / cfg.num_layers  # mean over the layers
    else:
        tiles = a.batch * -(-a.pages_per_seq // a.kv_tile_pages)
    out = [{"loop": "attention KV tiles", "trips_per_layer": tiles, "uncounted_trips": (tiles - 1) * cfg.num_layers,
            "bytes_per_trip": 2 * a.tile_rows * a.kv_size * a.itemsize}]
    if plan.moe is not None:
        m = plan.moe
        trips = m.expected_distinct_experts() * m.chunks_per_expert
        out.append({"loop": "MoE expert chunks", "trips_per_layer": trips,
                    "uncounted_trips": max(trips - 1.0, 0.0) * m.num_moe_layers, "bytes_per_trip": m.chunk_bytes})
    return out


def convert_estimate(plan: Plan, est: Estimate | None, not_requested: str = "") -> dict[str, Any]:
    """The compiler's static profile of `plan`'s step as a whole-step estimate (or why there is
    none): estimated_cycles / estimated_seconds, compiler_cycles, nested_loop_cycles,
    estimate_source and notes, as `make_report` reports them. `est` None on a target with a
    static profile means the caller did not ask for one; `not_requested` says how to ask."""
    target = plan.target
    notes: list[str] = []
    est_cycles = est_seconds = compiler_cycles = nested_cycles = None
    if target.interpret:
        source = "none: the cpu target runs the kernel in interpret mode (no TPU cost model)"
    elif not target.static_profile and target.name in ("tpu7x", "v6e"):  # the vLLM TPU set's libtpu
        from tpumk.compile.keys import stack_versions

        source = (f"none: this libtpu's static profiler aborts on kernels with DMAs (libtpu "
                  f"{stack_versions()['libtpu']}); the default JAX set (constraints/default.txt, libtpu 0.0.52) "
                  "gives the estimate")
    elif not target.static_profile:
        source = (f"none: the TPU compiler's cost estimator does not work for {target.name} kernels "
                  "(libtpu's static profiler crashes on them); build for tpu7x or v6e to get an estimate")
    elif est is None:
        source = f"none: not requested ({not_requested})" if not_requested else "none: not requested"
    elif est.cycles is None and plan.cfg.dtype == "float32" and (
            "float32" in (est.error or "") or any(s in (est.error or "") for s in F32_PROFILER_ABORTS)):
        # libtpu 0.0.52's static profiler aborts on float32 kernels (tpumk.estimate.profiler)
        source = ("none: the TPU compiler's cost estimator crashes on this model's float32 weights; "
                  "build with --dtype bfloat16 to get an estimate")
    elif est.cycles is None:
        source = f"none: {est.error}"
    elif est.calibration is None:
        compiler_cycles = est.cycles
        source = "none: the static profile gave cycles but no calibration could be measured to convert them"
        notes.append("compiler_cycles count nested-loop bodies once per layer; without a calibration the "
                     "missing trips cannot be added, so no whole-step estimate is given")
    else:
        # The profile counts each nested loop's body once per layer; the remaining trips are
        # DMA-bound streaming, added at the calibration's sustained rate (tpumk's model).
        cal = est.calibration
        nested = uncounted_nested_work(plan)
        nested_seconds = sum(w["uncounted_trips"] * w["bytes_per_trip"] for w in nested) / cal["assumed_bytes_per_s"]
        compiler_cycles = est.cycles
        nested_cycles = int(round(nested_seconds / cal["seconds_per_cycle"]))
        est_cycles = compiler_cycles + nested_cycles
        est_seconds = est_cycles * cal["seconds_per_cycle"]
        source = (f"TPU compiler static profile ({compiler_cycles:,} cycles) + tpumk model of nested-loop trips "
                  f"the profile counts once ({nested_cycles:,} cycles: "
                  + ", ".join(f"{w['uncounted_trips']:.0f} {w['loop']}" for w in nested)
                  + f"); cycles -> seconds by calibration: {cal['basis']}")
    return {"estimated_cycles": est_cycles, "estimated_seconds": est_seconds, "compiler_cycles": compiler_cycles,
            "nested_loop_cycles": nested_cycles, "estimate_source": source, "notes": notes}
