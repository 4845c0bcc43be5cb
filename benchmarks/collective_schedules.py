"""The in-kernel all-reduce's schedules and wires side by side: tpumk's timeline and interconnect
models, not measurements.

For each model and batch on N TPU7x TensorCores it plans the megakernel step with every
all-reduce schedule the chip routes (`direct`, `rsag`, `hierarchical`) and both wires
(`float32`, `bfloat16`), and prints the step's "collectives" stage (the all-reduces and the
logits all-gather, by `tpumk.estimate.interconnect`) and the whole step (`tpumk.estimate.
timeline.megakernel_step`), each against the flat float32 baseline (rsag, or direct where auto
takes the direct push: what tpumk built before the hierarchical schedule existed). `auto` marks
the schedule the plan picks with no tuning. "floor": the least the same collectives could take
with any schedule and wire by the model (`collectives_floor_seconds`: one direct round or two
bare round latencies per collective, whichever is less). Then the model's figures for the
published TPU7x kernel's two schedule comparisons (`published_schedule_check`).

    python benchmarks/collective_schedules.py [--model qwen3-235b-a22b deepseek-v3] [--batch 1 8 32]
        [--devices 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(models, batches, devices: int, context: int, page_size: int) -> list[dict]:
    from tpumk.errors import PlanError
    from tpumk.estimate.timeline import megakernel_step
    from tpumk.model.config import resolve_model
    from tpumk.plan.geometry import AllReduceGeometry
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    target = get_target("tpu7x")
    out = []
    for name in models:
        cfg = resolve_model(name)
        quant = "fp8" if cfg.is_mla else "none"  # DeepSeek-V3 as released (fp8 weights)
        for batch in batches:
            def step(schedule: str, wire: str):
                spec = BuildSpec(cfg, target, batch=batch, context=context, devices=devices, page_size=page_size,
                                 quant=quant, tuning=TuningConfig(all_reduce=schedule, all_reduce_wire=wire))
                plan = make_plan(spec)
                m = megakernel_step(plan)
                return plan, m.stages["collectives"]["seconds"], m.seconds, m.collectives_floor_seconds

            flat = AllReduceGeometry.for_chip(target.chip, devices, batch, cfg.hidden_size).schedule  # flat auto
            try:
                auto = make_plan(BuildSpec(cfg, target, batch=batch, context=context, devices=devices,
                                           page_size=page_size, quant=quant)).all_reduce.schedule
                _, base_coll, base_step, _ = step(flat, "float32")
            except PlanError as e:  # the default knobs do not fit this batch: nothing to compare
                out.append({"model": name, "quant": quant, "batch": batch, "devices": devices, "schedule": "any",
                            "wire": "any", "auto": False, "refused": str(e).split(":")[0]})
                continue
            for schedule in ("direct", "rsag", "hierarchical"):
                for wire in ("float32", "bfloat16"):
                    try:
                        plan, coll, secs, least = step(schedule, wire)
                    except PlanError as e:  # e.g. direct's N slots outgrow VMEM at large batches
                        out.append({"model": name, "quant": quant, "batch": batch, "devices": devices,
                                    "schedule": schedule, "wire": wire, "auto": False, "refused": str(e).split(":")[0]})
                        continue
                    out.append({"model": name, "quant": quant, "batch": batch, "devices": devices,
                                "schedule": schedule, "wire": wire, "auto": schedule == auto and wire == "float32",
                                "collectives_seconds": coll, "collectives_ratio": coll / base_coll,
                                "collectives_floor_seconds": least, "floor_ratio": least / base_coll,
                                "step_seconds": secs, "step_ratio": secs / base_step,
                                "rounds_per_all_reduce": plan.all_reduce.stages,
                                "send_bytes_per_all_reduce": plan.all_reduce.send_bytes, "baseline": f"{flat} float32"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["qwen3-235b-a22b", "deepseek-v3"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--devices", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from tabulate import tabulate

    from tpumk.estimate.interconnect import model_source, published_schedule_check
    from tpumk.targets import get_target

    target = get_target("tpu7x")
    table = rows(a.model, a.batch, a.devices, a.context, a.page_size)
    check = published_schedule_check(target)
    if a.json:
        json.dump({"rows": table, "published_schedule_check": check,
                   "source": model_source("collectives", target) + "; steps: tpumk timeline model"}, sys.stdout, indent=1)
        print()
        return 0
    print(tabulate([[r["model"], r["batch"], r["schedule"] + (" (auto)" if r["auto"] else ""), r["wire"]]
                    + ([r["refused"]] if "refused" in r else
                       [r["rounds_per_all_reduce"], f"{r['send_bytes_per_all_reduce'] / 1024:.1f}",
                        f"{r['collectives_seconds'] * 1e3:.3f}", f"{r['collectives_ratio']:.2f}",
                        f"{r['collectives_floor_seconds'] * 1e3:.3f} ({r['floor_ratio']:.2f})",
                        f"{r['step_seconds'] * 1e3:.3f}", f"{r['step_ratio']:.2f}"]) for r in table],
                   headers=["model", "batch", "schedule", "wire", "rounds", "KiB sent / all-reduce",
                            "collectives ms / step", "vs flat f32", "floor ms (vs flat f32)", "step ms",
                            "vs flat f32"]))
    print(f"\n{a.devices} x tpu7x, context {a.context}, {a.page_size}-token pages; "
          f"{model_source('collectives', target)}; steps: tpumk timeline model")
    w, h = check["wire"], check["hierarchy"]
    print(f"published comparisons on {check['devices']} TensorCores (measured on chips) vs the model: "
          f"bf16 / f32 wire, rsag [8, 8192]: {w['published_ratio']:.3f} published, {w['model_ratio']:.3f} model; "
          f"hierarchical / flat [64, 4096] f32: {h['published_ratio']:.3f} published, {h['model_ratio']:.3f} model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
