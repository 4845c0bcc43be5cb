"""Run `tpumk bench` over the presets and record the side-by-side table (BENCHMARKS.md).

For every (preset, target, batch) it runs the same path as `tpumk bench` (tpumk.decode.bench.run_bench):
both steps compiled for the target (deviceless without a TPU), compile seconds measured here,
HBM bytes (plan / XLA cost_analysis), kernels launched, and the step times: measured when the
target's TPU is attached, else tpumk's timeline model of both compiled programs. A combination
that does not fit the target is recorded with the plan's reason instead of a row.

    python benchmarks/bench_presets.py [--preset tiny-dense ...] [--target tpu7x v6e] [--batch 1 8]
                                       [--context 4096] [--devices N] [--out rows.json] [--save-hlo DIR]
    python benchmarks/bench_presets.py --remodel rows.json --save-hlo DIR [--out rows.json]

With two or more `--batch` sizes it ends with each model's batch curve (tokens per second in
aggregate and per sequence, against batch 1, the floor fraction, XLA and the serving stack).

`--remodel` re-runs only the timeline model on the HLO saved by an earlier run (no compiles):
the compile figures stay those measured then. `--devices N` (> 1) benches the N-device
megakernel against XLA's SPMD step (tpumk.decode.bench.compare_devices); `--no-compiler-estimate`
skips the megakernel's static-profile compile there. On one device `--compiler-estimate` adds
the megakernel's calibrated compiler estimate (a profiling compile in a fresh process,
tpumk.estimate.profiler.estimate_in_subprocess) beside the model's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PRESETS = ("tiny-dense", "tiny-moe", "qwen3-8b", "qwen3-30b-a3b", "qwen3-32b")
DEFAULT_TARGETS = ("tpu7x", "v6e")


def _row(r: dict) -> dict:
    mk, x = r["megakernel"], r["xla"]
    return {
        "mk_compile_s": mk["compile_seconds"], "xla_compile_s": x["compile_seconds"],
        "mk_hbm_gb": mk["hbm_bytes"] / 1e9, "xla_hbm_gb": x["hbm_bytes"] / 1e9, "floor_ms": r["floor_seconds"] * 1e3,
        "mk_kernels": mk["kernels"], "xla_kernels": x["kernels"],
        "mk_step_ms": mk["step_seconds"] * 1e3, "xla_step_ms": x["step_seconds"] * 1e3,
        "speedup": r["speedup"], "mk_floor_fraction": mk["floor_fraction"], "xla_floor_fraction": x["floor_fraction"],
        "mk_tok_s_seq": r["tokens_per_second"]["megakernel"]["per_sequence"],
        "mk_tok_s_all": r["tokens_per_second"]["megakernel"]["aggregate"],
        "xla_tok_s_seq": r["tokens_per_second"]["xla"]["per_sequence"],
        "xla_tok_s_all": r["tokens_per_second"]["xla"]["aggregate"],
        "step_source": "measured" if mk["measured"] else "model",
        **(_devices_row(r) if r.get("devices", 1) > 1 else {}),
        **(_serving_row(r) if r.get("serving") else {}),
    }


def _serving_row(r: dict) -> dict:
    """The serving-stack column (XLA + jax's ragged paged attention), always by the model."""
    sv = r["serving"]
    return {"serving_compile_s": sv["compile_seconds"], "serving_step_ms": sv["step_seconds"] * 1e3,
            "speedup_vs_serving": r["speedup_vs_serving"], "serving_floor_fraction": sv["floor_fraction"],
            "serving_kernels": sv["kernels"], "serving_blocks": r["serving_blocks"]}


def _devices_row(r: dict) -> dict:
    mk, x, est = r["megakernel"], r["xla"], r["compiler_estimate"]
    return {
        "devices": r["devices"], "mk_floor_coll_fraction": mk["floor_with_collectives_fraction"],
        "xla_floor_coll_fraction": x["floor_with_collectives_fraction"],
        "mk_collectives_ms": mk["collectives_seconds"] * 1e3, "xla_collectives_ms": x["collectives_seconds"] * 1e3,
        "mk_xla_collectives": mk["xla_collectives"], "xla_xla_collectives": x["xla_collectives"],
        "mk_in_kernel_collectives": mk["in_kernel_collectives"],
        "mk_interconnect_mb": mk["interconnect_bytes"] / 1e6, "xla_interconnect_mb": x["interconnect_bytes"] / 1e6,
        "est_step_ms": est["step_seconds"] * 1e3 if est["step_seconds"] else None, "est_source": est["source"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="*", default=list(DEFAULT_PRESETS))
    ap.add_argument("--target", nargs="*", default=list(DEFAULT_TARGETS))
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", help="write every row (with the full bench result) to this JSON file")
    ap.add_argument("--save-hlo", metavar="DIR", help="also save both compiled HLO texts per row (re-run the model "
                                                        "offline, e.g. with other constants)")
    ap.add_argument("--page-size", type=int, default=16, help="KV-cache page size of the megakernel (tokens)")
    ap.add_argument("--devices", type=int, default=1, help="devices one step spans (> 1: against XLA's SPMD step)")
    ap.add_argument("--no-compiler-estimate", action="store_true",
                    help="with --devices: skip the megakernel's static-profile compile")
    ap.add_argument("--compiler-estimate", action="store_true",
                    help="one device: also the megakernel's calibrated compiler estimate (a profiling compile)")
    ap.add_argument("--remodel", metavar="ROWS_JSON", help="re-run the model on rows saved with --out/--save-hlo")
    ap.add_argument("--constants", metavar="LATENCY,DESCRIPTOR,DISPATCH",
                    help="with --remodel: the timeline model's three constants in seconds (sensitivity runs; "
                         "DESCRIPTOR replaces every target's probe figure)")
    args = ap.parse_args(argv)
    if args.remodel:
        return remodel(args)

    from tpumk.decode.bench import run_bench
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.model.config import load_preset
    from tpumk.errors import PlanError
    from tpumk.targets import get_target
    from tpumk.tomlfile import write_text_atomic

    rows = []
    for preset in args.preset:
        for target_name in args.target:
            for batch in args.batch:
                cmd = (f"tpumk bench --model {preset} --target {target_name} --batch {batch} "
                       f"--context {args.context}" + (f" --page-size {args.page_size}" if args.page_size != 16 else "")
                       + (f" --devices {args.devices}" if args.devices > 1 else "") + " --json")
                row = {"preset": preset, "target": target_name, "batch": batch, "context": args.context,
                       "page_size": args.page_size, "devices": args.devices, "command": cmd}
                t0 = time.perf_counter()
                try:
                    r = run_bench(BuildSpec(load_preset(preset), get_target(target_name), batch, args.context,
                                            page_size=args.page_size, devices=args.devices),
                                  keep_hlo=bool(args.save_hlo), compiler_estimate=not args.no_compiler_estimate)
                except PlanError as e:
                    row["skipped"] = str(e)
                else:
                    compiles = r.pop("compiles", None)
                    if compiles:
                        d = Path(args.save_hlo)
                        d.mkdir(parents=True, exist_ok=True)
                        for side in ("megakernel", "xla"):
                            write_text_atomic(_hlo_path(d, row, side), compiles.pop(f"{side}_hlo"))
                        row["compiles"] = compiles
                    row.update(_row(r))
                    row["result"] = r
                    a = make_plan(BuildSpec(load_preset(preset), get_target(target_name), batch, args.context,
                                            page_size=args.page_size, devices=args.devices)).attention
                    row["kv_tiles"] = [a.kv_tile_pages, a.kv_buffers]  # as the plan chose them (auto)
                    if args.compiler_estimate and args.devices == 1:
                        row.update(_estimate_row(r, BuildSpec(load_preset(preset), get_target(target_name), batch,
                                                              args.context, page_size=args.page_size)))
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                _print(row)
                if args.out:  # after every row, so a long run leaves what it finished
                    write_text_atomic(args.out, json.dumps(rows, indent=1))
    print_batch_curves(rows)
    return 0


def batch_curves(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The rows of each (preset, target, devices, context) benched at two or more batch sizes,
    by batch: the batch curve."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if "skipped" not in r:
            out.setdefault((r["preset"], r["target"], r.get("devices", 1), r["context"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["batch"]) for k, v in out.items() if len({r["batch"] for r in v}) > 1}


def print_batch_curves(rows: list[dict]) -> None:
    """Each batch curve as a table: tokens per second in aggregate and per sequence, the
    aggregate over batch 1's, the floor fraction, and XLA's and the serving stack's aggregate
    rates beside (each figure as its row says: measured, or tpumk's model)."""
    from tabulate import tabulate

    for (preset, target, devices, context), curve in batch_curves(rows).items():
        base = next((r["mk_tok_s_all"] for r in curve if r["batch"] == 1), None)
        table = [[r["batch"], f"{r['mk_tok_s_all']:.0f}", f"{r['mk_tok_s_seq']:.0f}",
                  f"{r['mk_tok_s_all'] / base:.2f}x" if base else "-", f"{r['mk_floor_fraction']:.2f}",
                  f"{r['xla_tok_s_all']:.0f}",
                  f"{r['batch'] / r['serving_step_ms'] * 1e3:.0f}" if "serving_step_ms" in r else "not built",
                  f"{r['speedup']:.2f}x", r["step_source"]] for r in curve]
        print(f"\nbatch curve: {preset} on {devices} x {target}, context {context}", flush=True)
        print(tabulate(table, headers=["batch", "mk tok/s", "per seq", "vs batch 1", "floor frac", "XLA tok/s",
                                       "serving tok/s", "XLA / mk", "source"]), flush=True)


def _estimate_row(r: dict, spec) -> dict:
    """The megakernel's step by the calibrated compiler estimate (COMPILER), beside the model."""
    from tpumk.estimate.profiler import estimate_in_subprocess

    if not spec.target.static_profile:
        return {"est_step_ms": None, "est_source": f"none: {spec.target.name} has no static profile"}
    t0 = time.perf_counter()
    est = estimate_in_subprocess(spec)
    out = {"est_step_ms": est.seconds * 1e3 if est.seconds else None, "est_cycles": est.cycles,
           "est_source": "compiler static profile, calibrated" if est.seconds else f"none: {est.error}",
           "est_wall_s": time.perf_counter() - t0}
    if est.seconds:
        out["est_floor_fraction"] = r["floor_seconds"] / est.seconds
    return out


def _hlo_path(d: Path, row: dict, side: str) -> Path:
    page = f"_p{row['page_size']}" if row.get("page_size", 16) != 16 else ""
    devices = f"_d{row['devices']}" if row.get("devices", 1) > 1 else ""
    return d / f"{row['preset']}_{row['target']}_b{row['batch']}{page}{devices}_{side}.hlo"


def remodel(args) -> int:
    """Recompute every row's figures from its saved HLO with the current model (no compiles)."""
    from tpumk.decode.bench import Compiles, SpmdCompiles, compare
    from tpumk.model.config import load_preset
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import DEFAULT_PAGE_SIZE, BuildSpec
    from tpumk.targets import get_target
    from tpumk.tomlfile import write_text_atomic

    from tpumk.estimate import timeline as costmodel

    if args.constants:
        costmodel.DMA_LATENCY_S, costmodel.DMA_DESCRIPTOR_S, costmodel.OP_DISPATCH_S = \
            (float(v) for v in args.constants.split(","))
        for name, eng in list(costmodel.DMA_ENGINE.items()):  # the descriptor cost of every target
            costmodel.DMA_ENGINE[name] = costmodel.DmaEngine(costmodel.DMA_DESCRIPTOR_S, eng.queue_bytes_per_s)
    rows = json.loads(Path(args.remodel).read_text())
    d = Path(args.save_hlo or ".")
    for row in rows:
        if "skipped" not in row:
            old = row["result"]
            c = row.get("compiles") or {
                "megakernel_compile_seconds": old["megakernel"]["compile_seconds"],
                "megakernel_lower_seconds": old["megakernel"]["lower_seconds"],
                "xla_compile_seconds": old["xla"]["compile_seconds"], "xla_lower_seconds": old["xla"]["lower_seconds"],
                "xla_cost_bytes": old["xla"]["hbm_bytes"]}
            plan = make_plan(BuildSpec(load_preset(row["preset"]), get_target(row["target"]), row["batch"],
                                       row["context"], page_size=row.get("page_size", DEFAULT_PAGE_SIZE),
                                       devices=row.get("devices", 1)))
            kind = SpmdCompiles if plan.devices > 1 else Compiles
            compiles = kind(_hlo_path(d, row, "megakernel").read_text(), _hlo_path(d, row, "xla").read_text(), **c)
            r = compare(plan, compiles)
            row.update(_row(r))
            row["result"] = r
            row["compiles"] = c
        _print(row)
    if args.out:
        write_text_atomic(args.out, json.dumps(rows, indent=1))
    print_batch_curves(rows)
    return 0


def _print(row: dict) -> None:
    head = f"{row['preset']:>14} {row['target']:>6} B={row['batch']}" + (
        f" page {row['page_size']}" if row.get("page_size", 16) != 16 else "") + (
        f" x{row['devices']}" if row.get("devices", 1) > 1 else "")
    if "skipped" in row:
        print(f"{head}  skipped: {row['skipped']}", flush=True)
        return
    print(f"{head}  compile {row['mk_compile_s']:5.1f} / {row['xla_compile_s']:5.1f} s  "
          f"HBM {row['mk_hbm_gb']:7.3f} / {row['xla_hbm_gb']:7.3f} GB  floor {row['floor_ms']:7.3f} ms  "
          f"kernels {row['mk_kernels']} / {row['xla_kernels']}  step ({row['step_source']}) "
          f"{row['mk_step_ms']:7.3f} / {row['xla_step_ms']:7.3f} ms  XLA/mk {row['speedup']:.2f}x  "
          f"floor frac {row['mk_floor_fraction']:.2f} / {row['xla_floor_fraction']:.2f}"
          + (f"  floor+coll frac {row['mk_floor_coll_fraction']:.2f} / {row['xla_floor_coll_fraction']:.2f}  "
             f"XLA collectives {row['mk_xla_collectives']} / {row['xla_xla_collectives']}"
             if row.get("devices", 1) > 1 else "")
          + (f"  serving {row['serving_step_ms']:7.3f} ms ({row['speedup_vs_serving']:.2f}x)" if "serving_step_ms" in row
             else "")
          + (f"  COMPILER {row['est_step_ms']:7.3f} ms (floor frac {row['est_floor_fraction']:.3f})"
             if row.get("est_step_ms") else (f"  COMPILER {row['est_source']}" if "est_source" in row else "")),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
