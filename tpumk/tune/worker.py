"""One tuner trial's compile and objective, in its own process: `python -m tpumk.tune.worker`.

The tuner (tpumk.tune.study) runs every compile here rather than in its own process so that a
compiler crash, an abort inside libtpu or a hang costs one trial, not the study: the parent
waits with a timeout and kills this process group when it runs over. The worker reads one JSON
request on stdin and prints one JSON reply as its last stdout line:

request: {"spec": BuildSpec.to_dict() (the trial's tuning included), "objective": "compiler" | "model" | "device",
          "deadline_seconds": wall seconds left for the whole request,
          "device_warmup": int, "device_repeats": int}
reply:   {"ok": bool, "stage": where it stopped ("done", "plan", "compile", "estimate", "device",
          "model"), "error": one line or null, "value": seconds or null, "value_kind": how the
          value was obtained, "source": the objective's own provenance, "compile_seconds",
          "lower_seconds", "custom_calls", "model_seconds", "model_source", "details": {...},
          "machine_dependent": true when a stage-"estimate" failure is of this run (timeout, kill),
          "evaluator_sha256": the digest of the source this worker ran (tpumk.compile.keys.source_inputs)}

Every objective compiles the real executable first (the same compile `tpumk build` does), so a
configuration the compiler rejects is caught whatever the objective.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from typing import Any

from tpumk.errors import TpumkError

# How each objective's number was obtained: shown next to every value the tuner prints.
VALUE_KINDS = {
    "compiler": "compiler estimate",
    "model": "tpumk model",
    "device": "measured on device",
    "interpret": "measured in Pallas interpret mode on the host CPU (says nothing about TPU speed)",
}


def _watch_parent() -> None:
    """Exit (with the estimate subprocess this worker may have started: the same process group)
    as soon as the tuner that started us is gone, so a killed study leaves no compiles behind."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                if os.getpgrp() == os.getpid():  # only a group we lead (the tuner starts us so)
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _prefer_as_oom_victim() -> None:
    """Make this worker and the profiling compile it starts the out-of-memory killer's first
    choice (Linux; raising the score needs no privilege). libtpu's static profiler has been
    seen to grow past 23 GB on some tile shapes whose real compile needs under 1 GB: that trial
    should die, not the user's other programs."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("500")
    except OSError:
        pass


def error_line(exc: BaseException) -> str:
    """One line for an exception of the trial's compile or objective: the compiler's reason for a
    rejection (tpumk.compile.aot words it), the type and first telling line otherwise."""
    from tpumk.compile.aot import compiler_error_line

    return f"{type(exc).__name__}: {compiler_error_line(exc)}"


def _model_value(plan, draft=None) -> tuple[float | None, str]:
    """tpumk's timeline model of the step; of a round build (`draft`, a RoundSpec), of one whole
    round (the verify step and the drafter's passes: tpumk.estimate.speculative.round_model),
    which the tuner turns into seconds per accepted token (tpumk.tune.trial)."""
    if draft is not None:
        from tpumk.estimate.speculative import round_model

        r = round_model(plan.spec, draft.drafter, [1.0])
        return float(r["round_seconds"]), (f"one round (verify step + {draft.drafter.kind} drafter passes) by "
                                           f"{r['source']}")
    from tpumk.estimate.timeline import megakernel_step

    m = megakernel_step(plan)
    return float(m.seconds), str(m.source)


def machine_dependent(profiler_error: str | None) -> bool:
    """The profiling compile failed because of this run, not the configuration: it timed out
    (after the time left of the trial's --timeout) or was killed from outside (SIGKILL: most
    likely the out-of-memory killer; SIGTERM). Such a failure is not stored in the result cache.
    (The words are tpumk.estimate.profiler's.)"""
    e = profiler_error or ""
    return e.startswith("profiling compile timed out") or "SIGKILL" in e or "(SIGTERM)" in e


def _compiler_value(plan, compiled, request: dict[str, Any], deadline: float) -> dict[str, Any]:
    from tpumk.build import make_report
    from tpumk.estimate.profiler import estimate_in_subprocess

    left = max(deadline - time.monotonic(), 1.0)
    est = estimate_in_subprocess(plan.spec, timeout=left)
    report = make_report(plan, compiled, est)
    details = {"estimate_source": report.estimate_source, "estimated_cycles": report.estimated_cycles,
               "compiler_cycles": report.compiler_cycles, "nested_loop_cycles": report.nested_loop_cycles,
               "floor_fraction": report.floor_fraction, "notes": report.notes}
    if report.estimated_seconds is None:
        # estimate_source already names the profiler's failure (SIGKILL / OOM, FIFO abort, ...)
        return {"ok": False, "stage": "estimate", "error": f"no compiler estimate: {report.estimate_source}",
                "details": details, "machine_dependent": machine_dependent(est.error)}
    if report.estimated_seconds < report.floor_seconds:
        # An estimate faster than the HBM floor is a wrong model, not a fast kernel: never a result.
        return {"ok": False, "stage": "estimate", "details": details,
                "error": (f"invalid compiler estimate {report.estimated_seconds * 1e6:.1f} us is below the HBM floor "
                          f"{report.floor_seconds * 1e6:.1f} us")}
    return {"ok": True, "value": report.estimated_seconds, "value_kind": VALUE_KINDS["compiler"],
            "source": report.estimate_source, "details": details}


def _device_value(plan, compiled, warmup: int, repeats: int) -> dict[str, Any]:
    """Median wall time of the compiled step on the attached device (or the host, for the cpu
    target), after warm-up, with every sequence at the full context (the plan's worst case)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpumk.kernel.layout import pack_weights
    from tpumk.model.reference import init_cache
    from tpumk.model.weights import random_params

    target = plan.target
    dev = target.attached_device()
    if dev is None:
        return {"ok": False, "stage": "device", "error": f"no {target.name} device is attached to this process"}
    cfg, b, q = plan.cfg, plan.batch, plan.q_len
    packed = jax.device_put(pack_weights(plan, random_params(cfg, seed=0)), dev)
    cache = jax.device_put(init_cache(cfg, b, plan.context, page_size=plan.page_size,
                                      kv_dtype=plan.attention.kv_dtype or None), dev)
    lengths = np.full((b,), plan.context - q, np.int32)
    positions = jax.device_put(lengths[:, None] + np.arange(q, dtype=np.int32)[None, :], dev)
    tokens = jax.device_put(np.zeros((b, q), np.int32), dev)
    step = compiled.compiled
    times = []
    for i in range(warmup + repeats):
        # The cache is donated to the step: feed each call the cache the previous one returned,
        # with the lengths reset so every call does the same work.
        cache = cache._replace(lengths=jax.device_put(jnp.asarray(lengths), dev))
        t0 = time.perf_counter()
        logits, cache = step(packed, tokens, positions, cache)
        logits.block_until_ready()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    kind = VALUE_KINDS["interpret"] if target.interpret else VALUE_KINDS["device"]
    where = ("Pallas TPU interpret mode on this host's CPU" if target.interpret
             else f"attached {dev.device_kind}")
    return {"ok": True, "value": statistics.median(times), "value_kind": kind,
            "source": f"median of {repeats} timed steps after {warmup} warm-up steps on {where}",
            "details": {"step_seconds": times}}


def serve(request: dict[str, Any]) -> dict[str, Any]:
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec

    deadline = time.monotonic() + float(request.get("deadline_seconds", 900))
    reply: dict[str, Any] = {"ok": False, "stage": "plan", "error": None, "value": None, "value_kind": None,
                             "source": None, "compile_seconds": None, "lower_seconds": None, "custom_calls": None,
                             "model_seconds": None, "model_source": None, "details": {}}
    try:
        spec = BuildSpec.from_dict(request["spec"], "tune worker request")
        if spec.target.interpret:  # a cpu build over N devices runs on N host CPU devices
            from tpumk.targets import ensure_host_devices

            ensure_host_devices(spec.devices)
        plan = make_plan(spec)
    except TpumkError as e:
        reply["error"] = str(e)
        return reply
    reply["stage"] = "compile"
    try:
        if spec.draft is not None:  # a round build: the whole round program, as tpumk build compiles it
            from tpumk.compile.aot import compile_rounds

            compiled = compile_rounds(plan, spec.draft.drafter, spec.draft.settings(plan.context))
        else:
            compiled = compile_plan(plan)
    except Exception as e:  # the compiler's rejection of this configuration (VMEM, layout, ...)
        reply["error"] = error_line(e)
        return reply
    reply.update(compile_seconds=compiled.compile_seconds, lower_seconds=compiled.lower_seconds,
                 custom_calls=compiled.custom_calls)
    try:  # tpumk's model is cheap: kept next to every result so objectives can be compared later
        reply["model_seconds"], reply["model_source"] = _model_value(plan, spec.draft)
    except Exception as e:
        reply["model_source"] = f"none: {error_line(e)}"
    objective = request["objective"]
    if spec.draft is not None and objective != "model":  # tpumk.tune.objectives refuses it first
        reply.update(stage="objective", error=f"a round build is ranked by tpumk's model only, not '{objective}'")
        return reply
    if objective == "model":
        if reply["model_seconds"] is None:
            reply.update(stage="model", error=f"tpumk model failed: {reply['model_source']}")
            return reply
        reply.update(ok=True, value=reply["model_seconds"], value_kind=VALUE_KINDS["model"],
                     source=reply["model_source"])
    elif objective == "compiler":
        reply["stage"] = "estimate"
        reply.update(_compiler_value(plan, compiled, request, deadline))
    elif objective == "device":
        reply["stage"] = "device"
        reply.update(_device_value(plan, compiled, int(request.get("device_warmup", 3)),
                                   int(request.get("device_repeats", 10))))
    else:
        reply.update(stage="objective", error=f"unknown objective '{objective}'")
        return reply
    if reply["ok"]:
        reply["stage"] = "done"
    return reply


def main() -> None:
    _watch_parent()
    _prefer_as_oom_victim()
    request = json.loads(sys.stdin.read())
    try:
        reply = serve(request)
    except Exception as e:  # anything unexpected still answers in one line; the trace goes to stderr
        traceback.print_exc()
        reply = {"ok": False, "stage": "worker", "error": error_line(e)}
    # The source this worker ran, read after every import it needed: the tuner stores the reply
    # under its result key only if this is the source that key names (not a tree edited meanwhile).
    try:
        from tpumk.compile.keys import source_inputs

        reply["evaluator_sha256"] = source_inputs(__spec__.name if __spec__ else "tpumk.tune.worker")["sha256"]
    except Exception as e:
        reply["evaluator_sha256"] = f"unknown: {error_line(e)}"
    sys.stdout.write("\n" + json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
