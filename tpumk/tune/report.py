"""PNG plots of a tuning study, drawn by Optuna's matplotlib visualizations (Agg backend, no display).

- `history.png`: the objective of every complete trial and the best so far
  (optuna.visualization.matplotlib.plot_optimization_history);
- `importances.png`: how much each searched knob explains of the objective
  (plot_param_importances; needs two complete trials of different configurations);
- `timeline.png`: every trial's start, duration and state, which shows parallel workers and
  where pruned and failed trials went (plot_timeline).

The plots label the axis with the objective's value kind (compiler estimate, tpumk model,
measured on device), so a reader never takes an estimate for a measurement.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tpumk.errors import ConfigError


def _value_kind(study) -> str:
    kinds = {t.user_attrs.get("value_kind") for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"}
    kinds.discard(None)
    return ", ".join(sorted(kinds)) or "no complete trial"


def _importance_problem(study) -> str | None:
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(complete) < 2:
        return f"needs at least 2 complete trials, the study has {len(complete)}"
    varying = {k for t in complete for k, v in t.params.items() if v != complete[0].params.get(k)}
    values = {t.value for t in complete}
    if not varying:
        return "every complete trial has the same configuration: no knob varies"
    if len(values) < 2:
        return "every complete trial has the same value: nothing for a knob to explain"
    return None


def write_report(study, out_dir: str | Path) -> dict[str, Any]:
    """Write the PNGs into out_dir; returns {"written": [paths], "skipped": {plot: why}}."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--report {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    kind = _value_kind(study)
    label = f"step seconds ({kind})"
    written: list[str] = []
    skipped: dict[str, str] = {}

    def save(name: str, ax_or_axes, title: str) -> None:
        ax = ax_or_axes[0] if hasattr(ax_or_axes, "__len__") and not hasattr(ax_or_axes, "figure") else ax_or_axes
        fig = ax.figure
        fig.suptitle(f"{study.study_name}\n{title}", fontsize=8)
        fig.set_size_inches(9, 5.5)
        fig.tight_layout()
        path = out / name
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        tmp.replace(path)  # atomic: a reader never sees half a PNG
        plt.close(fig)
        written.append(str(path))

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if complete:
            ax = ovm.plot_optimization_history(study, target_name=label)
            save("history.png", ax, f"optimization history: {label}")
        else:
            skipped["history.png"] = "no complete trial to plot"
        why = _importance_problem(study)
        if why is None:
            try:
                ax = ovm.plot_param_importances(study, target_name=label)
                save("importances.png", ax, f"knob importances (fANOVA) for {label}")
            except (RuntimeError, ValueError, ZeroDivisionError) as e:
                skipped["importances.png"] = f"Optuna could not compute importances: {str(e).splitlines()[0]}"
        else:
            skipped["importances.png"] = why
        if study.get_trials(deepcopy=False):
            ax = ovm.plot_timeline(study)
            save("timeline.png", ax, "trials over time by state")
        else:
            skipped["timeline.png"] = "the study has no trials"
    return {"written": written, "skipped": skipped}
