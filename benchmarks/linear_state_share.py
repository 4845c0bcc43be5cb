"""The hybrids' recurrent state in the megakernel step: its bytes and its share of the step, by
tpumk's plan and timeline model (not measurements).

For each hybrid preset on TPU7x it plans the decode step at each batch (context 4096, the
default knobs: the plan's auto choices) and prints the step by tpumk's timeline model, the HBM
floor, the bytes one step moves per device, the pool's part of them (the recurrent states, and
the convolution windows with the pending rows, each read and written once per linear layer and
sequence) and the linear-attention stage's part of the modelled step.

    python benchmarks/linear_state_share.py [--model qwen3-next-80b-a3b ...] [--batch 1 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

# (preset, devices, weights): each on the TensorCores its size asks for, as published or as it fits
DEFAULT_MODELS = (("qwen3-next-80b-a3b", 2, "int8"), ("qwen3-next-80b-a3b", 8, "none"), ("qwen3.5-27b", 8, "none"),
                  ("kimi-linear-48b-a3b", 1, "none"), ("kimi-linear-k2-scale", 32, "int4"))


def rows(models, batches, context: int) -> list[dict]:
    from tpumk.errors import PlanError
    from tpumk.estimate.timeline import megakernel_step
    from tpumk.model.config import resolve_model
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    target = get_target("tpu7x")
    out = []
    for name, devices, quant in models:
        cfg = resolve_model(name)
        for batch in batches:
            base = {"model": name, "devices": devices, "quant": quant, "batch": batch, "context": context}
            try:
                plan = make_plan(BuildSpec(cfg, target, batch=batch, context=context, devices=devices, quant=quant))
            except PlanError as e:
                out.append({**base, "refused": str(e)})
                continue
            m = megakernel_step(plan)
            states, windows = plan.hbm["linear_states"], plan.hbm["linear_windows"]
            out.append({**base, "step_s": m.seconds, "floor_s": plan.floor_seconds, "hbm_bytes": plan.hbm_bytes,
                        "state_bytes": states, "window_bytes": windows, "kv_bytes": plan.hbm["kv_cache"],
                        "pool_share_of_bytes": (states + windows) / plan.hbm_bytes,
                        "linear_stage_s": m.stages["linear_attention"]["seconds"],
                        "linear_stage_share": m.stages["linear_attention"]["seconds"] / m.seconds,
                        "source": m.source})
    return out


def table(data: list[dict]) -> str:
    """One row per (model, batch); byte columns per device and step (each pool entry read and written)."""
    from tabulate import tabulate

    body = []
    for r in data:
        if "refused" in r:
            body.append([r["model"], r["devices"], r["quant"], r["batch"], "refused: " + r["refused"][:60]] + [""] * 6)
            continue
        body.append([r["model"], r["devices"], r["quant"], r["batch"], f"{r['step_s'] * 1e3:.3f}",
                     f"{r['floor_s'] * 1e3:.3f}", f"{r['hbm_bytes'] / 1e9:.3f}", f"{r['state_bytes'] / 1e6:.1f}",
                     f"{r['window_bytes'] / 1e6:.2f}", f"{r['pool_share_of_bytes']:.3f}",
                     f"{r['linear_stage_share']:.3f}"])
    return tabulate(body, headers=["model", "devices", "weights", "batch", "step ms (model)", "floor ms",
                                   "GB / step / device", "states MB (in + out)", "windows + pending MB", "pool / bytes",
                                   "linear stage / step"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="*", help="presets (default: the hybrid presets at their device counts)")
    ap.add_argument("--devices", type=int, default=1, help="devices for --model (default 1)")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    models = [(m, args.devices, args.quant) for m in args.model] if args.model else DEFAULT_MODELS
    data = rows(models, args.batch, args.context)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(table(data))
        print("\nfigures: tpumk's plan (bytes, floor) and timeline model (step, stage): TPU7x, context "
              f"{args.context}; bytes per device and step; not measurements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
