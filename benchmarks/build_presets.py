"""Build the full-size presets' megakernels deviceless and print what each build costs.

For every (preset, target, batch) it runs the same path as `tpumk build` (tpumk.build.build):
the plan's VMEM and HBM bytes per step and the HBM floor (tpumk's accounting), the measured
deviceless compile time on this host, the number of Pallas kernels in the compiled step (must
be 1), and on v6e / tpu7x the whole-step estimate: the TPU compiler's static profile plus the
modelled nested-loop trips, converted by the stated calibration (tpumk.estimate.calibration). Nothing
here is measured on a TPU.

    python benchmarks/build_presets.py [--preset qwen3-8b ...] [--target tpu7x ...] [--batch 1 8]
                                       [--context 4096] [--tuning FILE.toml] [--no-estimate] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PRESETS = ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b")
DEFAULT_TARGETS = ("tpu7x", "v6e")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="*", default=list(DEFAULT_PRESETS))
    ap.add_argument("--target", nargs="*", default=list(DEFAULT_TARGETS))
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tuning", help="a TOML file with a [tuning] table")
    ap.add_argument("--no-estimate", action="store_true", help="skip the profiling compile")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from tpumk.build import build
    from tpumk.model.config import load_preset
    from tpumk.errors import PlanError
    from tpumk.targets import get_target
    from tpumk.plan.knobs import TuningConfig, load_tuning
    from tpumk.plan.spec import BuildSpec

    tuning = load_tuning(args.tuning) if args.tuning else TuningConfig()
    rows = []
    for preset in args.preset:
        for target_name in args.target:
            for batch in args.batch:
                row = {"preset": preset, "target": target_name, "batch": batch, "context": args.context}
                try:
                    r = build(BuildSpec(load_preset(preset), get_target(target_name), batch, args.context, tuning),
                              estimate=not args.no_estimate).report
                except PlanError as e:
                    row["plan_error"] = str(e)
                else:
                    row.update(compile_s=r.compile_seconds, lower_s=r.lower_seconds, kernels=r.custom_calls,
                               vmem_mib=r.vmem_bytes / 2**20, hbm_gb=r.hbm_bytes_per_step / 1e9,
                               floor_ms=r.floor_seconds * 1e3, floor_fraction=r.floor_fraction,
                               estimate_ms=None if r.estimated_seconds is None else r.estimated_seconds * 1e3,
                               estimate_source=r.estimate_source)
                rows.append(row)
                _print_row(row, args.json)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


def _print_row(row: dict, as_json: bool) -> None:
    if as_json:
        return
    head = f"{row['preset']:>14} {row['target']:>6} B={row['batch']}"
    if "plan_error" in row:
        print(f"{head}  PlanError: {row['plan_error']}", flush=True)
        return
    line = (f"{head}  compile {row['compile_s']:6.1f} s (lower {row['lower_s']:.1f} s)  kernels {row['kernels']}"
            f"  VMEM {row['vmem_mib']:5.1f} MiB  HBM {row['hbm_gb']:6.2f} GB/step  floor {row['floor_ms']:6.2f} ms")
    if row["estimate_ms"] is not None:
        line += f"  estimate {row['estimate_ms']:6.2f} ms = {row['floor_fraction']:.2f} of floor"
    print(line, flush=True)
    print(f"{'':>24}estimate source: {row['estimate_source']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
