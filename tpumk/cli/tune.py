"""`tpumk tune` and `tpumk report`: click commands over tpumk.tune.study and tpumk.tune.report.

Registered on the main group in tpumk/cli/app.py (`main.add_command(tune)`, `main.add_command(report)`).

While a study runs, `tpumk tune` shows a progress bar on a terminal and, where stderr is not a
terminal (CI logs, pipes), one line per finished trial instead: its number, state, value and
what kind of value it is, or why it was pruned.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from tabulate import tabulate

from tpumk.cli.options import build_command, echo, emit_json, fail_cleanly, spec_options
from tpumk.cli.units import duration
from tpumk.errors import count_of


def _us(s) -> str:
    return duration(s, us_digits=2)


def _knobs(changed: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "(the default configuration)"


def trial_line(info: dict) -> str:
    """One finished trial, for a log: `trial 3: COMPLETE 12.34 us (tpumk model) [3/8 evaluated]`."""
    s = info["state"]
    if s == "COMPLETE":
        what = f"{_us(info['value_seconds'])} ({info['value_kind']})"
        if info.get("cached_from"):
            what += f", reused from {info['cached_from']}"
    elif s == "PRUNED":
        what = f"at {info.get('prune_stage') or 'unknown'}: {info.get('prune_reason') or 'no reason recorded'}"
        if info.get("cached_from"):
            what += f" (reused from {info['cached_from']})"
    else:
        what = info.get("fail_reason") or "failed (see the trial's user attrs)"
    default = " (default configuration)" if info.get("default") else ""
    return f"trial {info['trial']}{default}: {s} {what} [{info['evaluated']}/{info['trials']} evaluated]"


def print_result(r, next_command: str | None = None) -> None:
    notes = list(r.notes)
    if r.already_complete and notes:
        echo(notes.pop(0))
    c = r.counts
    complete = c.get("COMPLETE", 0)
    echo(f"\nstudy {r.study}: {r.evaluated} of {count_of(r.trials_requested, 'distinct configuration')} evaluated "
         f"({count_of(complete, 'trial')} complete, {c.get('PRUNED', 0) - r.infeasible} pruned by the compiler), "
         f"{r.infeasible} pruned before compiling" + (f", {c['FAIL']} failed" if c.get("FAIL") else ""))
    echo(f"{count_of(r.reused, 'trial')} reused earlier results without compiling ({r.repeated} of "
         f"{'it' if r.reused == 1 else 'them'} repeated a configuration the study had evaluated: outside the budget)")
    if r.prune_reasons:
        echo("pruned by stage: " + ", ".join(f"{k} {v}" for k, v in sorted(r.prune_reasons.items())))
    run = r.this_run
    echo(f"this run: {count_of(run.get('trials', 0), 'trial')}, {count_of(run.get('compiles', 0), 'compile')}, "
         f"{run.get('cache_hits', 0) + run.get('reused_in_study', 0)} reused without compiling, "
         f"{run.get('wall_seconds', 0):.1f} s wall")
    passed = run.get("passed_over") or {}
    if passed:
        echo(f"the sampler passed over {count_of(sum(passed.values()), 'drawn configuration')} the space rules out, "
             "never made trials (" + ", ".join(f"{k} {v}" for k, v in sorted(passed.items())) + ")")
    if not r.best:
        echo("no trial completed: nothing to rank")
    else:
        rows = [[b["rank"], b["trial"], _us(b["value_seconds"]), b["value_kind"], _knobs(b["changed_knobs"]),
                 "n/a" if b["compile_seconds"] is None else f"{b['compile_seconds']:.2f}",
                 "yes" if b["cached"] else "no"] for b in r.best]
        echo(tabulate(rows, headers=["rank", "trial", "step", "value is", "knobs changed from default",
                                           "compile s (measured)", "cached"]))
        best = r.best[0]
        echo(f"objective source (best): {best['objective_source']}")
        if best.get("accepted_tokens_per_second"):  # a round build (--draft)
            echo(f"best round: {best['draft_block']} drafts, {_us(best['round_seconds'])} a round, "
                 f"{best['accepted_tokens_per_round']:.2f} tokens committed a round: "
                 f"{best['accepted_tokens_per_second']:,.0f} accepted tokens/s per sequence (tpumk's model, not "
                 "measured)")
        if r.default is not None and r.default.get("value_seconds") is not None:
            echo(f"default configuration (trial {r.default['trial']}): {_us(r.default['value_seconds'])}; "
                       f"best / default = {r.best_over_default:.3f} ({best['value_kind']})")
        if r.floor_seconds and not best.get("accepted_tokens_per_second"):  # a round's value is no step time
            echo(f"HBM floor of the best (tpumk plan accounting): {_us(r.floor_seconds)}; "
                       f"floor / best = {r.floor_seconds / best['value_seconds']:.2f}")
    for n in notes:
        echo(f"note: {n}")
    if r.out:
        echo(f"wrote {r.out}; build with it: {next_command or f'tpumk build --tuning {r.out}'}")


class _Bar:
    """A tqdm bar of finished trials of the study (all processes), on stderr (a TTY)."""

    def __init__(self, enabled: bool):
        self.bar = None
        self.enabled = enabled

    def __call__(self, done: int, total: int, best) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None:
            import shutil

            # A pty may report a 0 x 0 screen, where tqdm would hide the bar.
            cols, rows = shutil.get_terminal_size((100, 20))
            self.bar = tqdm(total=total, initial=done, unit="trial", file=sys.stderr, ncols=min(cols or 100, 120),
                            nrows=rows or 20, disable=not sys.stderr.isatty())
        self.bar.n = done
        if best is not None:
            self.bar.set_postfix_str(f"best {duration(best, us_digits=2)}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.command()
@spec_options(tuning=False, draft=True, draft_seed=False)
@click.option("--acceptance-rate", "acceptance_rate", type=float, default=None,
              help="With --draft: the per-draft acceptance rate (0 to 1; each draft accepted with this probability "
                   "once its predecessors were) the rounds are ranked at: tpumk's model of a round per accepted "
                   "token, which makes the drafts per round (the draft_block knob) a trade-off.")
@click.option("--space", "space_file", type=click.Path(), help="Tuning space TOML (default tuning_spaces/default.toml).")
@click.option("--trials", default=30, show_default=True,
              help="Distinct configurations the study ends with evaluated (complete, or pruned by the compiler); "
                   "configurations pruned before compiling, and trials repeating a configuration already "
                   "evaluated (they reuse its result), do not count. A larger number extends a finished study.")
@click.option("--max-infeasible", type=int,
              help="Stop after this many configurations pruned before compiling (default 10 x --trials).")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds a trial's compile (and objective) may take; it is killed and pruned after.")
@click.option("--objective", default="auto", show_default=True,
              type=click.Choice(["auto", "device", "compiler", "model"]),
              help="device: timed on the attached accelerator; compiler: the TPU compiler's static estimate; "
                   "model: tpumk's timeline model; auto: the first that works here.")
@click.option("--storage", help="Optuna storage: sqlite:///F.db, postgresql://..., F.journal or journal:F "
                                "(default sqlite:///artifacts/tune/<study>.db).")
@click.option("--study", "study_name", help="Study name (default: derived from model, target, shapes, space, objective and the "
                                              "source of tpumk's evaluation code).")
@click.option("--workers", default=1, show_default=True, help="Trials in parallel in this process (each compiles in its own process).")
@click.option("--seed", type=int, help="Sampler seed (reproducible for a fresh study run by one process with --workers 1).")
@click.option("--heartbeat", default=5, show_default=True, help="Seconds between trial heartbeats; a trial silent for 3 beats (a killed run) is failed.")
@click.option("--out", "out_file", type=click.Path(), help="Write the best configuration here as [tuning] TOML (default artifacts/tune/<study>.toml).")
@click.option("--report", "report_dir", type=click.Path(), help="Also write PNG plots of the study into this directory.")
@click.option("--cache-dir", type=click.Path(), help="Result cache directory (default artifacts/tune/cache).")
@click.option("--top", default=5, show_default=True, help="Best configurations to list.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def tune(spec, draft_params, acceptance_rate, space_file, trials, max_infeasible, timeout, objective, storage,
         study_name, workers, seed, heartbeat, out_file, report_dir, cache_dir, top, as_json):
    """Search the megakernel's knobs with Optuna, every trial a real compile (resumable); with
    --draft, the speculative round program's, its drafts per round among them."""
    import logging

    import optuna

    from tpumk.errors import ConfigError
    from tpumk.tune.cache import ResultKeys
    from tpumk.tune.objectives import attached_tpu_kind, choose_objective
    from tpumk.tune.settings import TuneSettings
    from tpumk.tune.space import DEFAULT_SPACE_PATH, load_space
    from tpumk.tune.storage import check_study_name, local_path, redact, storage_url
    from tpumk.tune.study import check_writable, open_study, run, study_name_for

    if study_name is not None:
        # It names files (the default storage artifacts/tune/<study>.db and --out <study>.toml).
        check_study_name(study_name, "--study")
    if space_file is not None and not space_file.strip():
        raise ConfigError("--space: expected a tuning-space TOML file, got an empty path")
    if spec.draft is None and acceptance_rate is not None:
        raise ConfigError("--acceptance-rate: only with --draft (a speculative round program)")
    if spec.draft is not None and acceptance_rate is None:
        raise ConfigError("--draft: give --acceptance-rate (the per-draft acceptance rate, 0 to 1, the rounds are "
                          "ranked at)")
    if acceptance_rate is not None and not 0 <= acceptance_rate <= 1:
        raise ConfigError(f"--acceptance-rate {acceptance_rate:g}: expected a per-draft acceptance rate from 0 to 1 "
                          "(bench's --acceptance is a mean acceptance length; this is the chance each draft is "
                          "accepted)")
    problem = spec
    # Computed knobs (expert_parallel) take this build's choices, so the grid size printed is the searched one.
    space = load_space(DEFAULT_SPACE_PATH if space_file is None else space_file).for_build(problem)
    choice = choose_objective(objective, spec.model, spec.target, attached_tpu_kind(), acceptance_rate)
    settings = TuneSettings(trials=trials, timeout=timeout, workers=workers, seed=seed, heartbeat=heartbeat,
                            cache_dir=Path(cache_dir) if cache_dir else None, top=top,
                            max_infeasible=max_infeasible)
    settings.validate()  # (run() validates again: cheap, and here it errs before any output)
    nothing = space.admits_nothing(problem)
    if nothing is not None:
        raise ConfigError(f"--space {space.source}: the constraints admit no configuration of its {space.size():,} "
                          f"grid points for this build; e.g. {nothing}")
    keys = ResultKeys(problem)  # the evaluator's source, read once for the name and the study
    if study_name is None:
        name = study_name_for(problem, space, choice.key, keys.evaluator)
        check_study_name(name, "the study name derived from the model name (give --study)")
    else:
        name = study_name
    url = storage_url(storage, name, settings.root)
    out = out_file or str(settings.root / f"{name}.toml")
    # Refuse, before the study starts and anything is printed, what could not be written: the
    # study's storage file, the result cache and the outputs written after the study.
    db = local_path(url)
    if db is not None:
        check_writable(db, "--storage" if storage else "the study's storage (--storage)")
    check_writable(settings.cache_dir or settings.root / "cache", "--cache-dir", directory=True)
    check_writable(out, "--out")
    if report_dir:
        check_writable(report_dir, "--report", directory=True)
    say = (lambda m: echo(m, err=True)) if as_json else echo
    size = space.size()
    say(f"tuning {problem.label()}: space {space.name} ({count_of(size, 'grid point')}), "
        f"{count_of(trials, 'distinct configuration')} to evaluate")
    if space.dropped_line():  # knobs of the file this build has no use for: not searched
        say(space.dropped_line())
    say(f"objective: {choice.name} ({choice.reason})")
    say(f"study {name} in {redact(url)}")
    optuna.logging.set_verbosity(logging.ERROR)  # tpumk prints its own summary
    # A bar on a terminal; one line per finished trial in a log (it would get no bar at all).
    on_tty = sys.stderr.isatty()
    bar = _Bar(enabled=on_tty and not as_json)
    on_trial = None if bar.enabled else (lambda info: say(trial_line(info)))
    try:
        result = run(problem, space, choice, settings, storage=storage, study_name=name, out=out, progress=bar,
                     on_trial=on_trial, keys=keys)
    except KeyboardInterrupt:
        bar.close()
        echo(f"interrupted: rerun the same command to resume study {name}", err=True)
        sys.exit(130)
    finally:
        bar.close()
    report = None
    if report_dir:
        from tpumk.tune.report import write_report

        study = open_study(url, name, None, None, heartbeat, create=False)
        report = write_report(study, report_dir)
    if as_json:
        if result.already_complete and result.notes:
            say(result.notes[0])
        d = result.to_dict()
        if report is not None:
            d["report"] = report
        emit_json(d)
        return
    # the tuned file carries the searched block (draft_block): --draft-tokens beside it would clash
    searched_block = bool((result.best_tuning or {}).get("draft_block"))
    print_result(result, build_command(result.out, skip=("draft_tokens",) if searched_block else ())
                 if result.out else None)
    if report is not None:
        _print_report(report)


def _print_report(report: dict) -> None:
    for p in report["written"]:
        echo(f"wrote {p}")
    for name, why in report["skipped"].items():
        echo(f"skipped {name}: {why}")


def derived_study_name(spec, space_file, objective) -> str:
    """The study name `tpumk tune` derives for these build options, --space and --objective
    (tpumk.tune.study.study_name_for), so `report` finds a study by the options that made it."""
    from tpumk.tune.cache import ResultKeys
    from tpumk.tune.objectives import attached_tpu_kind, choose_objective
    from tpumk.tune.space import DEFAULT_SPACE_PATH, load_space
    from tpumk.tune.study import study_name_for

    space = load_space(DEFAULT_SPACE_PATH if space_file is None else space_file).for_build(spec)
    choice = choose_objective(objective, spec.model, spec.target, attached_tpu_kind())
    return study_name_for(spec, space, choice.name, ResultKeys(spec).evaluator)


@click.command()
@spec_options(tuning=False)
@click.option("--space", "space_file", type=click.Path(), help="The tuning space the study was run with (as for tune).")
@click.option("--objective", default="auto", show_default=True, type=click.Choice(["auto", "device", "compiler", "model"]),
              help="The objective the study was run with (as for tune).")
@click.option("--storage", help="Optuna storage of the study (default sqlite:///artifacts/tune/<study>.db).")
@click.option("--study", "study_name", help="Study name (default: the one tune derives from the same build options, "
                                              "--space and --objective; may be left out when --storage holds one study).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory for the PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def report(spec, space_file, objective, storage, study_name, out_dir, as_json):
    """Plot a tuning study: optimization history, knob importances, timeline (PNG). The study is
    found as tune named it: give the same build options (--model, --target, ...), or --study."""
    import optuna

    from tpumk.errors import ConfigError
    from tpumk.tune.report import write_report
    from tpumk.tune.storage import (DEFAULT_ROOT, check_study_name, local_path, not_regular, open_storage, redact,
                                    storage_url)
    from tpumk.tune.study import open_study

    derived = False
    if not storage and not study_name:
        study_name, derived = derived_study_name(spec, space_file, objective), True
    if not storage:
        check_study_name(study_name, "--study")  # it names the file read
    if not storage and not (DEFAULT_ROOT / f"{study_name}.db").is_file():
        if derived:
            raise ConfigError(f"no study for {spec.label()} (looked for {DEFAULT_ROOT / (study_name + '.db')}): run "
                              "`tpumk tune` with the same build options, --space and --objective first, or give "
                              "--study / --storage")
        raise ConfigError(f"--study {study_name!r}: no {DEFAULT_ROOT / (study_name + '.db')}; give --storage")
    url = storage_url(storage, study_name or "", DEFAULT_ROOT)
    path = local_path(url) if storage else None
    if path is not None and not path.is_file():
        kind = not_regular(path)
        raise ConfigError(f"--storage {redact(storage)}: "
                          + (f"{path} is {kind}, not a regular file (a study's file is one)" if kind else "no such file"))
    if study_name is None:
        names = optuna.get_all_study_names(open_storage(url))
        if len(names) != 1:
            raise ConfigError(f"--storage {redact(url)} holds {len(names)} studies ({', '.join(names) or 'none'}): "
                              "give --study")
        study_name = names[0]
    study = open_study(url, study_name, None, None, create=False)
    r = write_report(study, out_dir)
    if as_json:
        emit_json({"study": study_name, **r})
    else:
        _print_report(r)
