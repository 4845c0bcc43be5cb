"""Tune the full-size presets' megakernels deviceless and print what the tuner found.

For every (preset, batch) on the target it runs `tpumk tune`'s study (tpumk.tune.study.run) over a
tuning space and prints: the trials run (finished; how many compiled), the wall time on this
host, the default and the best configuration's step time, best / default, the number of
finished trials until one came within 5 % of the best, and the best step against the HBM floor.

What the numbers are: wall and compile times are measured on this host; step times come from
the chosen objective, by default `compiler` (the TPU compiler's static profile plus tpumk's
model of the nested-loop trips, converted by the TPU7x calibration: an estimate, NOT a
measurement); the HBM floor is tpumk's plan accounting over the chip's bandwidth. Studies live
in the default storage (artifacts/tune/<study>.db), so a rerun resumes them and the result
cache skips every configuration already compiled.

    python benchmarks/tune_presets.py [--preset qwen3-8b qwen3-30b-a3b] [--batch 1 8] [--target tpu7x]
                                      [--trials 24] [--workers 1] [--space FILE] [--objective compiler]
                                      [--seed 0] [--timeout 900] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="*", default=["qwen3-8b", "qwen3-30b-a3b"])
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--target", default="tpu7x")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--space", help="tuning space TOML (default tuning_spaces/default.toml)")
    ap.add_argument("--objective", default="compiler", choices=["auto", "compiler", "model", "device"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import logging

    import optuna

    from tpumk.model.config import load_preset
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target
    from tpumk.tune.cache import evaluator_inputs
    from tpumk.tune.objectives import attached_tpu_kind, choose_objective
    from tpumk.tune.settings import TuneSettings
    from tpumk.tune.space import DEFAULT_SPACE_PATH, load_space
    from tpumk.tune.storage import storage_url
    from tpumk.tune.study import open_study, run, study_name_for, trials_to_within

    optuna.logging.set_verbosity(logging.ERROR)
    space = load_space(args.space or DEFAULT_SPACE_PATH)
    target = get_target(args.target)
    rows = []
    for preset in args.preset:
        for batch in args.batch:
            cfg = load_preset(preset)
            problem = BuildSpec(cfg, target, batch, args.context)
            choice = choose_objective(args.objective, cfg, target, attached_tpu_kind())
            settings = TuneSettings(trials=args.trials, timeout=args.timeout, workers=args.workers, seed=args.seed)
            name = study_name_for(problem, space, choice.name, evaluator_inputs())
            print(f"[{preset} b{batch}] study {name}: {choice.name} ({choice.reason})", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            r = run(problem, space, choice, settings, study_name=name)
            wall = time.monotonic() - t0
            study = open_study(storage_url(None, name), name, None, None, create=False)
            done = [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]
            best = r.best[0] if r.best else None
            default = r.default["value_seconds"] if r.default else None
            rows.append({
                "preset": preset, "batch": batch, "target": target.name, "study": name,
                "objective": choice.name, "value_kind": best["value_kind"] if best else None,
                "trials_finished": r.counts.get("COMPLETE", 0) + r.counts.get("PRUNED", 0),
                "complete": r.counts.get("COMPLETE", 0), "pruned": r.counts.get("PRUNED", 0),
                "prune_stages": r.prune_reasons, "compiles_this_run": r.this_run["compiles"],
                "trials_this_run": r.this_run["trials"], "wall_seconds_this_run": wall,
                # The whole study, over every run that worked on it (a resumed study's earlier runs too).
                "study_compiles": sum(1 for t in done if "config_key" in t.user_attrs and not t.user_attrs.get("cached")),
                "study_trial_seconds": sum(t.duration.total_seconds() for t in done if t.duration),
                "default_seconds": default, "best_seconds": best["value_seconds"] if best else None,
                "best_over_default": r.best_over_default, "trials_to_within_5pct": trials_to_within(study, 0.05),
                "floor_seconds": r.floor_seconds,
                "floor_over_best": (r.floor_seconds / best["value_seconds"]) if best and r.floor_seconds else None,
                "best_changed_knobs": best["changed_knobs"] if best else None,
                "best_objective_source": best["objective_source"] if best else None,
            })
            print(f"[{preset} b{batch}] done in {wall:.0f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0

    from tabulate import tabulate

    def us(s):
        return "n/a" if s is None else f"{s * 1e6:,.1f} us"

    def f(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    table = [[r["preset"], r["batch"], f"{r['trials_finished']} ({r['complete']} ok, {r['pruned']} pruned)",
              r["study_compiles"], f"{r['study_trial_seconds']:.0f} s", us(r["default_seconds"]),
              us(r["best_seconds"]), f(r["best_over_default"]), r["trials_to_within_5pct"] or "n/a",
              us(r["floor_seconds"]), f(r["floor_over_best"], ".2f")] for r in rows]
    print(tabulate(table, headers=["model", "batch", "trials", "compiles", "trial time (this host)", "default step",
                                   "best step", "best / default", "trials to 5 %", "HBM floor", "floor / best"]))
    kinds = {r["value_kind"] for r in rows if r["value_kind"]}
    print(f"\nstep times: {', '.join(sorted(kinds)) or 'none'} ({args.objective} objective; not measured on a TPU "
          "unless it says 'measured on device'); trial time: the study's trials' wall time summed over all runs "
          "(measured on this host); HBM floor: tpumk plan accounting / chip bandwidth; trials to 5 %: evaluated "
          "trials until one came within 5 % of the best.")
    for r in rows:
        print(f"{r['preset']} b{r['batch']}: best knobs vs default: {r['best_changed_knobs']}; "
              f"pruned by stage: {r['prune_stages']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
