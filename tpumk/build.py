"""`tpumk build`: plan, lower and compile a megakernel decode step, and say what the compiler says.

A build is: ModelConfig + Target + shapes + TuningConfig -> Plan (rejects infeasible configs
before compiling) -> jit(step).lower(argument shapes).compile() for the target (deviceless for
TPUs that are not attached) -> BuildReport.

Every number in the report names its source:
- plan figures (VMEM, HBM bytes, DMAs, the HBM floor) are tpumk's own accounting of the plan;
- `estimated_cycles` is the TPU compiler's static profile plus tpumk's model of the nested-loop
  trips it misses, and `estimated_seconds` converts it through `tpumk.estimate.calibration`
  (both in `tpumk.estimate.compiler`; the basis is repeated in `estimate_source`);
- `model_seconds` is tpumk's timeline model of the step (`tpumk.estimate.timeline`), with its
  stated assumptions in `model_source` (on many devices it counts the in-kernel collectives);
- `compile_seconds` is measured on this host;
- `verify` (optional) is the speculative verify step (q = verify_q) of the same build: plan
  figures, and the compiler's estimate only when asked for (`verify_figures` says why);
- `draft` (a build with a drafter, `BuildSpec.draft`): what was compiled is the speculative round
  program (`tpumk.compile.aot.compile_rounds`: the drafter's passes (its pass kernel,
  tpumk.kernel.draft_pass, where it models the drafter), the megakernel's verify step
  with its taps, acceptance, `rounds_per_call` rounds per call), so the compile figures, the
  kernel count and the XLA collectives are the round program's; the plan figures, the model
  and the compiler's estimate are its verify step's (q = block + 1: the estimate profiles that
  step alone, as the profile cannot count a kernel's loops inside the rounds' loop), and
  `draft` adds tpumk's timeline model of a round (`round_figures`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from tpumk.compile.aot import Compiled, compile_plan
from tpumk.compile.keys import stack_versions
from tpumk.estimate.compiler import convert_estimate
from tpumk.estimate.profiler import Estimate, estimate_in_subprocess
from tpumk.plan.plan import Plan, make_plan
from tpumk.plan.spec import BuildSpec


@dataclass
class BuildReport:
    model: str
    target: str
    batch: int
    context: int
    q_len: int
    compile_seconds: float
    lower_seconds: float
    custom_calls: int
    vmem_bytes: int
    vmem_budget_bytes: int
    vmem_capacity_bytes: int
    hbm_bytes_per_step: float
    floor_seconds: float
    estimated_cycles: int | None  # whole step: compiler cycles + modelled nested-loop trips
    estimated_seconds: float | None
    estimate_source: str
    compiler_cycles: int | None  # the static profile as written (nested loops counted once)
    nested_loop_cycles: int | None  # tpumk's model of the nested-loop trips the profile misses
    floor_fraction: float | None  # floor_seconds / estimated_seconds (1.0 = at the HBM floor)
    tuning: dict[str, Any]
    plan: dict[str, Any] = field(repr=False)
    notes: list[str] = field(default_factory=list)
    # The speculative verify step (q = verify_q) of the same build, see `verify_figures`.
    verify: dict[str, Any] | None = None
    # Devices one step spans (every per-step figure above is per device: its VMEM, its HBM
    # bytes and floor), the deviceless topology compiled for, the mesh, and how the model is
    # split; interconnect bytes one device sends and in-kernel collectives per step (plan
    # accounting); collective ops XLA runs outside the kernel (0 is the aim).
    devices: int = 1
    quant: str = "none"  # format of the streamed matrices (tpumk.model.quantize)
    topology: str | None = None
    mesh: dict[str, Any] | None = None
    sharding: dict[str, Any] | None = None
    interconnect_bytes_per_step: float = 0.0
    collectives_per_step: int = 0
    xla_collectives: int = 0
    # tpumk's timeline model of the step (`tpumk.estimate.timeline.megakernel_step`), beside the
    # compiler's estimate: on many devices it is the estimate that counts the collectives
    # (what the compiler charges for remote DMAs is not known, TPU_FACTS 8).
    model_seconds: float | None = None
    model_floor_fraction: float | None = None
    model_collectives_seconds: float = 0.0
    model_collectives_floor_seconds: float = 0.0  # the least any schedule's collectives take (model)
    model_source: str = ""
    # The same model of the whole compiled program (`tpumk.estimate.timeline.xla_step`: the
    # kernel plus the XLA ops around it, e.g. copies of the KV cache in and out of the kernel);
    # TPU targets only. `program_copies`: those copies (count, bytes moved, seconds).
    program_seconds: float | None = None
    program_copies: dict[str, float] | None = None
    # tpumk, jax, jaxlib and libtpu as installed (docs/install.md: two supported sets)
    versions: dict[str, str] = field(default_factory=dict)
    # hbm_bytes_per_step by what the bytes are (`hbm_parts`: weights, KV cache, a hybrid's state
    # pool, the rest), and a hybrid's state pool (`state_pool_figures`; None without linear layers)
    hbm_bytes_by_part: dict[str, float] = field(default_factory=dict)
    state_pool: dict[str, Any] | None = None
    # a round build: the drafter and the round program's settings, and tpumk's model of a round
    # (`round_figures`); None for a plain build
    draft: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Build:
    plan: Plan
    compiled: Compiled
    report: BuildReport


def build(spec: BuildSpec, estimate: bool = True, verify_q: int = 0, verify_estimate: bool = False,
          progress: Callable[[str], None] | None = None) -> Build:
    """Plan (PlanError before any compile for infeasible configs), compile, report.

    With `estimate`, targets whose static profile works also get the compiler's estimate from
    a separate profiling process (see tpumk.estimate.profiler for why it cannot be this one).
    `verify_q` > 0 adds the speculative verify step (q = verify_q) to the report
    (`verify_figures`); `verify_estimate` gives it the compiler's estimate as well.
    `progress(phase)` is called as each phase after the plan starts (the CLI prints it:
    tpumk.cli.progress)."""
    say = progress or (lambda phase: None)
    plan = plan_of(spec)  # quick; a refusal here stays the command's one line on stderr
    if spec.draft is not None:
        from tpumk.compile.aot import compile_rounds

        d = spec.draft
        say(f"lower + compile the round program for {spec.target.name} ({d.drafter.kind} drafter, verify q = "
            f"{d.block + 1}, {d.rounds_per_call} rounds a call)")
        compiled = compile_rounds(plan, d.drafter, d.settings(plan.context))
    else:
        say(f"lower + compile for {spec.target.name}")
        compiled = compile_plan(plan)
    est = None
    if estimate and spec.target.static_profile:
        say("compiler estimate (a profiling compile in its own process)"
            + (": the verify step alone" if spec.draft is not None else ""))
        est = estimate_in_subprocess(spec.replace(draft=None))  # a round build's: its verify step
    say("report (tpumk's timeline model)")
    report = make_report(plan, compiled, est,
                         not_requested="estimate=False / --no-estimate skips the profiling compile", draft=spec.draft)
    if verify_q:
        say(f"verify step, q = {verify_q}" + (" (plan and a profiling compile)" if estimate and verify_estimate
                                                else " (plan figures)"))
        report.verify = verify_figures(plan, verify_q, estimate=estimate and verify_estimate,
                                       plain_estimated_seconds=report.estimated_seconds)
    return Build(plan, compiled, report)


def plan_of(spec: BuildSpec) -> Plan:
    """make_plan(spec); a round build's refusal names its verify step (a block the plan cannot
    hold: its k + 1 rows over VMEM, ...)."""
    from tpumk.errors import PlanError

    if spec.draft is None:
        return make_plan(spec)
    try:
        return make_plan(spec)
    except PlanError as e:
        raise PlanError(f"--draft: the round's verify step (q = {spec.q_len}: {spec.draft.block} drafts + 1, "
                        f"{len(spec.taps)} taps) does not plan: {e}") from None


def verify_figures(plain: Plan, verify_q: int, estimate: bool = False,
                   plain_estimated_seconds: float | None = None) -> dict[str, Any]:
    """The speculative verify step beside the plain one: the same model, target, batch, context
    and knobs with q = verify_q tokens per sequence (K = verify_q - 1 drafts and the token
    before them), so a user sees what one verification costs relative to one plain step.

    Always: tpumk's plan accounting (HBM bytes, floor, VMEM; an infeasible verify plan is
    reported, not raised, since the plain build stands). With `estimate` (targets with a static
    profile) also the compiler's estimate, from a second profiling compile in its own process:
    for qwen3-8b on TPU7x the profiling compile is most of a build's time, so this is opt-in.
    No executable is built for the verify step here (`tpumk build --q-len N` builds one).
    The `*_vs_plain` ratios (verify / plain) are also the mean acceptance length (accepted
    drafts + bonus) at which speculation breaks even with plain decoding in target time,
    drafting aside."""
    from tpumk.errors import PlanError

    if not (isinstance(verify_q, int) and verify_q >= 1):
        raise PlanError(f"--verify-q: expected a positive number of tokens per sequence, got {verify_q!r}")
    out: dict[str, Any] = {"q_len": verify_q, "draft_tokens": verify_q - 1}
    try:
        vp = make_plan(plain.spec.replace(q_len=verify_q))
    except PlanError as e:
        out["error"] = f"the verify step does not plan: {e}"
        return out
    plain_bytes, plain_floor = plain.hbm_bytes, plain.floor_seconds
    out.update({
        "source": "tpumk plan accounting (bytes, floor, VMEM); no executable compiled for the verify step",
        "hbm_bytes_per_step": vp.hbm_bytes, "floor_seconds": vp.floor_seconds, "vmem_bytes": vp.vmem_total,
        "hbm_bytes_vs_plain": vp.hbm_bytes / plain_bytes, "floor_vs_plain": vp.floor_seconds / plain_floor,
    })
    est = estimate_in_subprocess(vp.spec) if estimate and vp.target.static_profile else None
    e = convert_estimate(vp, est, not_requested="verify_estimate / --verify-estimate runs a second profiling compile")
    out.update(e)
    secs = e["estimated_seconds"]
    if secs is not None:
        out["floor_fraction"] = vp.floor_seconds / secs
        if secs < vp.floor_seconds:
            out["notes"].append(f"INVALID ESTIMATE: {secs * 1e6:.1f} us is faster than the verify step's HBM floor "
                                f"{vp.floor_seconds * 1e6:.1f} us; do not use it as a result")
        if plain_estimated_seconds:
            out["estimate_vs_plain"] = secs / plain_estimated_seconds
    return out


# Copies around the kernel worth a note: a step's worth of a KV cache, not the scalars XLA moves.
COPY_NOTE_BYTES = 1e6


def program_figures(plan: Plan, compiled: Compiled, model) -> tuple[float | None, dict[str, float] | None]:
    """(seconds, copies) of tpumk's timeline model of the whole compiled program around the
    kernel `model` describes (TPU targets: an interpreted kernel is many ops, not one)."""
    if not plan.target.is_tpu or compiled.custom_calls != 1:
        return None, None
    from tpumk.estimate.timeline import program_ops, xla_step

    prog = xla_step(plan.target, compiled.hlo_text, kernel=model, floor_seconds=plan.floor_seconds,
                    what="the compiled step (the kernel and the XLA ops around it)", devices=plan.devices)
    c = prog.stages.get("copies", {})
    big = sum(op.times for op in program_ops(plan.target, compiled.hlo_text)[0]
              if op.opcode == "copy" and op.read_bytes >= COPY_NOTE_BYTES / 2)
    return prog.seconds, {"count": float(big), "hbm_bytes": c.get("hbm_bytes", 0.0), "seconds": c.get("seconds", 0.0)}


# the plan's HBM parts (`Plan.hbm`) that are weights: the ring families' tiles (weights_<family>),
# the layer vectors, the quantized formats' scales, the routed experts and their router
WEIGHT_PARTS = ("layer_vectors", "weight_scales", "experts_and_router")
STATE_POOL_PARTS = ("linear_states", "linear_windows")


def hbm_parts(plan: Plan) -> dict[str, float]:
    """The plan's HBM bytes per step (one device's) by what they are: "weights", "kv_cache", a
    hybrid's state pool ("linear_states": the recurrent states, "linear_windows": convolution
    windows and pending rows, each read and written once per step and sequence) and "other"
    (activations in and out, gathered logits). The parts sum to `plan.hbm_bytes`."""
    out = {"weights": 0.0, "kv_cache": 0.0}
    for k, v in plan.hbm.items():
        part = ("weights" if k.startswith("weights_") or k in WEIGHT_PARTS else
                k if k in ("kv_cache", *STATE_POOL_PARTS) else "other")
        out[part] = out.get(part, 0.0) + float(v)
    return out


def state_pool_figures(plan: Plan) -> dict[str, Any] | None:
    """A hybrid's state pool by the plan (one device's share): its shape (linear layers, slots,
    pending rows per slot), the bytes it holds in HBM, and the bytes one step reads and writes.
    None for a model without linear layers."""
    g = plan.linear
    if g is None:
        return None
    return {"linear_layers": g.num_layers, "slots": g.num_slots, "pending_rows": g.pending,
            "slot_bytes_per_layer": g.slot_bytes, "resident_bytes": g.resident_bytes,
            "states_bytes_per_step": float(plan.hbm["linear_states"]),
            "windows_bytes_per_step": float(plan.hbm["linear_windows"])}


def round_figures(plan: Plan, d) -> dict[str, Any]:
    """A round build's drafter and settings (its RoundSpec `d`; `plan` its verify step), and tpumk's timeline
    model of one round (tpumk.estimate.speculative.round_model: the verify step, the drafter's
    passes, the break-even mean acceptance length against the plain step; not measurements). A
    drafter the model cannot plan leaves `model` as the reason."""
    from tpumk.errors import PlanError
    from tpumk.estimate.speculative import round_model

    s = d.drafter
    out: dict[str, Any] = {
        "kind": s.kind, "block": d.block, "verify_q": d.block + 1, "taps": list(s.taps),
        "layers": s.layer.num_layers, "draft_vocab": s.draft_vocab, "rounds_per_call": d.rounds_per_call,
        "temperature": float(d.temperature), "max_steps": d.settings(plan.context).steps,
        "weights": {d.weights[0]: d.weights[1]}}
    try:
        r = round_model(plan.spec, s, [1.0])
    except PlanError as e:
        out["model"] = f"none: {e}"
        return out
    out["model"] = {k: r[k] for k in ("plain_step_seconds", "verify_step_seconds", "draft_seconds", "round_seconds",
                                       "break_even_acceptance")}
    out["model"].update(notes=r["notes"], source=r["source"])
    return out


def make_report(plan: Plan, compiled: Compiled, est: Estimate | None, not_requested: str = "",
                draft=None) -> BuildReport:
    """The build report of `plan` compiled (`draft`: a round build's RoundSpec, whose round
    program `compiled` is; `plan` is then its verify step)."""
    target = plan.target
    e = convert_estimate(plan, est, not_requested)
    notes = e["notes"]
    est_cycles, est_seconds, source = e["estimated_cycles"], e["estimated_seconds"], e["estimate_source"]
    compiler_cycles, nested_cycles = e["compiler_cycles"], e["nested_loop_cycles"]
    floor = plan.floor_seconds
    fraction = None
    if est_seconds is not None:
        fraction = floor / est_seconds
        if est_seconds < floor:
            notes.append(
                f"INVALID ESTIMATE: {est_seconds * 1e6:.1f} us is faster than the HBM floor {floor * 1e6:.1f} us; "
                "the compiler model or the calibration is wrong for this kernel, do not use it as a result")
    from tpumk.estimate.timeline import megakernel_step
    from tpumk.targets import topology_for

    model = megakernel_step(plan)
    figures = None
    if draft is None:
        program_seconds, copies = program_figures(plan, compiled, model)
    else:  # the compiled program is the rounds' loop: the model of one step's program does not apply
        program_seconds, copies = None, None
        figures = round_figures(plan, draft)
        if e["estimated_seconds"] is not None:
            notes.append("the compiler's estimate is the verify step's (q = "
                         f"{plan.q_len}, profiled alone), not the round program's")
    if copies and copies["hbm_bytes"] >= COPY_NOTE_BYTES:
        notes.append(f"XLA copies {copies['hbm_bytes'] / 2e6:,.1f} MB around the kernel every step "
                     f"({copies['count']:.0f} cop{'y' if copies['count'] == 1 else 'ies'}, +{copies['seconds'] * 1e6:,.1f} us by tpumk's model), e.g. a KV "
                     "cache in a layout other than the kernel's (docs/many-devices.md, 'The KV cache copies')")
    mesh = None
    if plan.devices > 1:
        from tpumk.kernel.megakernel import step_mesh

        m = step_mesh(plan)
        mesh = {"axes": {name: size for name, size in m.shape.items()},
                "device_ids": [int(d.id) for d in m.devices.flat],
                "device_coords": [list(getattr(d, "coords", []) or []) for d in m.devices.flat]}
    return BuildReport(
        devices=plan.devices, quant=plan.quant, topology=topology_for(target, plan.devices), mesh=mesh,
        sharding=plan.sharding.summary(plan.whole_model) if plan.sharding is not None else None,
        interconnect_bytes_per_step=plan.interconnect_bytes, collectives_per_step=plan.collectives_per_step,
        xla_collectives=compiled.xla_collectives, model_seconds=model.seconds,
        model_floor_fraction=model.floor_fraction, model_source=model.source,
        program_seconds=program_seconds, program_copies=copies,
        model_collectives_seconds=model.stages.get("collectives", {}).get("seconds", 0.0),
        model_collectives_floor_seconds=model.collectives_floor_seconds,
        model=plan.whole_model.name, target=target.name, batch=plan.batch, context=plan.context, q_len=plan.q_len,
        compile_seconds=compiled.compile_seconds, lower_seconds=compiled.lower_seconds,
        custom_calls=compiled.custom_calls, vmem_bytes=plan.vmem_total, vmem_budget_bytes=plan.vmem_budget,
        vmem_capacity_bytes=target.vmem_bytes, hbm_bytes_per_step=plan.hbm_bytes, floor_seconds=floor,
        estimated_cycles=est_cycles, estimated_seconds=est_seconds, estimate_source=source,
        compiler_cycles=compiler_cycles, nested_loop_cycles=nested_cycles,
        floor_fraction=fraction, tuning=plan.tuning.to_dict(), plan=plan.summary(), notes=notes,
        versions=stack_versions(), hbm_bytes_by_part=hbm_parts(plan), state_pool=state_pool_figures(plan),
        draft=figures)
