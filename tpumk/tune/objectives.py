"""What a tuner trial minimises, and which objective `--objective auto` picks here.

All objectives are seconds per decode step, minimised, and each value carries how it was
obtained (tpumk.tune.worker.VALUE_KINDS), because they are not interchangeable:

- `device`: the compiled step timed on the attached accelerator (warm-up, then the median of
  repeated steps). With the `cpu` target it times Pallas' interpret mode on the host, which
  says nothing about TPU speed; it is only useful to exercise the loop.
- `compiler`: the build report's `estimated_seconds`: libtpu's static profile of the kernel plus
  tpumk's model of the nested-loop trips the profile counts once, converted to seconds by the
  stated calibration (tpumk.build.make_report, tpumk.estimate.calibration). Only for targets whose
  static profile works (v6e, tpu7x) and bfloat16 weights (libtpu 0.0.52's profiler aborts on
  float32 kernels), and not for MLA models (it aborts on their kernel too). An estimate below
  the HBM floor is invalid and prunes its trial.
- `model`: tpumk's own timeline model of the plan (tpumk.estimate.timeline.megakernel_step), from the
  chip figures; no TPU and no profile needed. The configuration is still compiled, so one the
  compiler rejects is caught.

`auto` = device if a TPU of the target's kind is attached, else compiler where it works for
this target and dtype, else model; the choice and its reason are printed when a study starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpumk.model.config import ModelConfig
from tpumk.errors import ConfigError
from tpumk.targets import Target

OBJECTIVES = ("auto", "device", "compiler", "model")


@dataclass(frozen=True)
class ObjectiveChoice:
    name: str  # device | compiler | model
    reason: str  # one sentence: why this objective, for this target and model
    device_warmup: int = 0
    device_repeats: int = 0
    # a round build (--draft): the per-draft acceptance rate its rounds are ranked at (seconds
    # per accepted token, tpumk.tune.trial); part of the study's identity, not of the result cache
    acceptance_rate: float | None = None

    @property
    def key(self) -> str:
        """What the study's identity and name record of the objective."""
        return self.name if self.acceptance_rate is None else f"{self.name}-a{self.acceptance_rate:g}"


def attached_tpu_kind() -> str | None:
    """The target name of the TPU chips on this host's PCI bus ('v6e', 'tpu7x', ...), or None.

    Read from PCI ids without initialising a JAX backend: the tuner's own process must not take
    the TPU, which the trial worker processes need."""
    from tpumk.compat import tpu_chips_on_pci

    chips, version = tpu_chips_on_pci()
    return version.name if chips and version is not None else None


def compiler_unsupported(cfg: ModelConfig, target: Target) -> str | None:
    """Why the compiler objective cannot work for this build, or None when it can."""
    if target.interpret:
        return "the cpu target runs the kernel in interpret mode, which has no TPU cost model"
    if not target.static_profile:
        return f"libtpu's static profile does not work for {target.name} kernels with DMAs"
    if cfg.dtype != "bfloat16":
        return (f"model '{cfg.name}' has {cfg.dtype} weights and libtpu's static profiler aborts on float32 "
                "kernels (use --dtype bfloat16)")
    if cfg.is_mla:  # seen for tiny-mla and benchmarks/deepseek-v3-reduced.toml in bfloat16 on tpu7x
        return (f"model '{cfg.name}' is an MLA model and libtpu 0.0.52's static profiler aborts on the MLA "
                "megakernel (an LLO check failure), whatever its dtype")
    return None


def _device(target: Target, tpu_kind: str | None) -> ObjectiveChoice | None:
    if target.interpret:
        return ObjectiveChoice("device", "the cpu target: timing Pallas interpret mode on this host's CPU, "
                                         "which says nothing about TPU speed", device_warmup=1, device_repeats=3)
    if tpu_kind == target.name:
        return ObjectiveChoice("device", f"a {target.name} TPU is attached: timing the compiled step on it",
                               device_warmup=3, device_repeats=10)
    return None


def choose_objective(requested: str, cfg: ModelConfig, target: Target,
                     tpu_kind: str | None = None, acceptance_rate: float | None = None) -> ObjectiveChoice:
    """Resolve --objective for this build; an objective that cannot work here is a ConfigError.
    `acceptance_rate` (a round build, --draft): only `model` works: tpumk's model of a round,
    per accepted token at that per-draft acceptance rate (the compiler's static profile cannot
    count the kernel's loops inside the rounds' loop, and timing a round says nothing of
    acceptance)."""
    if requested not in OBJECTIVES:
        raise ConfigError(f"--objective: unknown objective '{requested}' (expected {', '.join(OBJECTIVES)})")
    if acceptance_rate is not None:
        if requested not in ("auto", "model"):
            raise ConfigError(f"--objective {requested}: not with --draft: a round program is ranked by tpumk's model "
                              "of a round per accepted token (--objective model)")
        return ObjectiveChoice("model", f"{'requested' if requested == 'model' else '--draft'}: tpumk's timeline "
                                        f"model of one round (verify step + drafter passes) per accepted token at a "
                                        f"per-draft acceptance rate of {acceptance_rate:g}",
                               acceptance_rate=acceptance_rate)
    if requested == "device":
        choice = _device(target, tpu_kind)
        if choice is None:
            have = f"a {tpu_kind} TPU is attached" if tpu_kind else "no TPU is attached"
            raise ConfigError(f"--objective device: {have}, not a {target.name} (use compiler or model)")
        return choice
    if requested == "compiler":
        why = compiler_unsupported(cfg, target)
        if why:
            raise ConfigError(f"--objective compiler: {why}")
        return ObjectiveChoice("compiler", "requested: the TPU compiler's static estimate, calibrated")
    if requested == "model":
        return ObjectiveChoice("model", "requested: tpumk's timeline model of the plan")
    # auto
    if target.is_tpu:
        choice = _device(target, tpu_kind)
        if choice is not None:
            return choice
    why_not = compiler_unsupported(cfg, target)
    no_tpu = f"no {target.name} TPU attached" if target.is_tpu else "the cpu target"
    if why_not is None:
        return ObjectiveChoice("compiler", f"{no_tpu}; the compiler's static estimate works for {target.name} "
                                           f"{cfg.dtype} kernels")
    return ObjectiveChoice("model", f"{no_tpu}; no compiler estimate ({why_not}): tpumk's timeline model")
