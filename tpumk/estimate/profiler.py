"""The TPU compiler's static estimate of a build, obtained in a separate profiling process.

Why a separate process: libtpu reads `--xla_jf_dump_static_llo_profile_to` once, at start-up,
and with it on the compiler also sets aside a large "HLO temp" VMEM reservation next to a
Pallas kernel's scoped VMEM (seen with libtpu 0.0.52: a 27 MiB kernel needed 73 MiB), so a
kernel that fits the chip fails to compile in a profiling process; on v5e the flag aborts the
process on some kernels. The profiling process therefore also raises the VMEM size the
compiler assumes (`--xla_tpu_override_vmem_size_kib`, to twice the chip's) so the reservation
fits. Its executable is thrown away: only the cycle count is kept. Real executables (what
`build` reports on and `export` ships) are compiled in a process without either flag, and
feasibility is decided by the plan and that real compile.

The calibration probe (tpumk.estimate.calibration) runs in the same kind of process, so cycles and
their conversion come from the same compiler settings.

Run as `python -m tpumk.estimate.profiler` with a JSON request on stdin (started with
tpumk.child_process.command: this process's tpumk, never the working directory's); prints a
JSON reply.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from tpumk.child_process import command
from tpumk.errors import TpumkError

PROFILE_VMEM_FACTOR = 2  # VMEM size the profiling compiler assumes, x the chip's


@dataclass
class Estimate:
    cycles: int | None
    cycles_by_op: dict[str, int]
    seconds: float | None  # cycles converted by the calibration; None without one
    calibration: dict[str, Any] | None
    error: str | None = None  # why there is no estimate (compiler crash, no profile written, ...)


def profiling_env(target_vmem_bytes: int, profile_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    from tpumk.estimate.static_profile import FLAG

    args = env.get("LIBTPU_INIT_ARGS", "")
    args += f" {FLAG}={profile_dir} --xla_tpu_override_vmem_size_kib={PROFILE_VMEM_FACTOR * target_vmem_bytes // 1024}"
    env["LIBTPU_INIT_ARGS"] = args.strip()
    return env


def estimate_in_subprocess(spec, timeout: float | None = 900) -> Estimate:
    """Compile the build `spec` (a tpumk.plan.spec.BuildSpec) in a fresh profiling process and
    return its estimate."""
    with tempfile.TemporaryDirectory(prefix="tpumk-estimate-") as d:
        try:
            proc = subprocess.run(command("tpumk.estimate.profiler"), input=json.dumps(spec.to_dict()),
                                  capture_output=True, text=True, timeout=timeout,
                                  env=profiling_env(spec.target.vmem_bytes, d))
        except subprocess.TimeoutExpired:
            return Estimate(None, {}, None, None, f"profiling compile timed out after {timeout:.0f} s")
    if proc.returncode != 0:
        return Estimate(None, {}, None, None, f"profiling compile failed (exit {proc.returncode}): "
                                              f"{_failure_line(proc.stderr, proc.returncode)}")
    try:
        return Estimate(**json.loads(proc.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        return Estimate(None, {}, None, None, "profiling process exited without a reply: "
                                              f"{_failure_line(proc.stderr)}")


FIFO_FULL = "Cannot schedule FIFO push"  # libtpu 0.0.52's static profiler, on some DMA ring shapes
# libtpu 0.0.52's static profiler aborts on float32 kernels with one of these LLO checks: the type
# check on multi-pass f32 matmuls, and (seen since the attention stage's in-kernel write guard, on
# tiny-moe float32 over 4 TPU7x devices) a control-operand check; the same kernels in bfloat16
# profile, and both compile.
F32_PROFILER_ABORTS = ("got vector-bf16packed", "IsControlOperandFull")


def _failure_line(stderr: str, returncode: int | None = None) -> str:
    """Why libtpu or the profiling compile died, in plain words (one line): a known profiler
    limit by name, a fatal signal by name (SIGKILL: most likely the out-of-memory killer), else
    the compiler's CHECK / RESOURCE_EXHAUSTED line, else the last line of stderr."""
    lines = [" ".join(line.split()) for line in (stderr or "").strip().splitlines() if line.strip()] or ["no output"]
    if "got vector-bf16packed" in stderr:  # libtpu 0.0.52's profiler on multi-pass f32 matmuls
        return ("libtpu's static profiler aborts on this kernel's float32 matmuls (an internal LLO type "
                "check); bfloat16 weights (--dtype bfloat16) profile fine")
    if FIFO_FULL in stderr:
        msg = next(line for line in lines if FIFO_FULL in line)
        msg = msg[msg.index(FIFO_FULL):][:160]
        return (f"libtpu's static profiler aborted scheduling this kernel's DMAs (a known profiler limit: {msg}); "
                "the executable itself compiles, only the compiler's cycle estimate is missing")
    # the compiler's CHECK, an allocation failure, or the static profiler's own verdict on an
    # instruction it cannot model (e.g. a copy of a hybrid's state pool: "Static LLO profiling of
    # copy.5 failed: ... Unsupported DMA direction for latency modeling: dma-general")
    detail = next((line.split("] ", 1)[-1][:400] for line in lines
                   if "Check failed" in line or "RESOURCE_EXHAUSTED" in line or "Static LLO profiling of" in line),
                  None)
    if returncode is not None and returncode < 0:
        sig = _signal_name(-returncode)
        if sig == "SIGKILL":
            return ("killed by SIGKILL, most likely out of memory (the profiling compile needs more RAM than this "
                    "host has)")
        why = {"SIGABRT": "libtpu aborted", "SIGSEGV": "libtpu crashed (segmentation fault)",
               "SIGTERM": "terminated from outside"}.get(sig, "killed")
        return f"{why} ({sig}): {detail or lines[-1][:400]}"
    return detail or lines[-1][:400]


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _serve(request: dict[str, Any]) -> Estimate:
    """In the profiling process: plan, compile, collect cycles, calibrate."""
    from tpumk.estimate import static_profile
    from tpumk.compile.aot import compile_plan
    from tpumk.estimate.calibration import calibration_for
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec

    spec = BuildSpec.from_dict(request, "estimate request")
    target = spec.target
    plan = make_plan(spec)
    static_profile.clear()
    compiled = compile_plan(plan)
    by_op = static_profile.collect(compiled.device_kind)
    if not by_op:
        return Estimate(None, {}, None, None, "the compiler wrote no static profile for this build")
    cycles = int(sum(by_op.values()))
    cal = calibration_for(target.name)
    return Estimate(cycles, by_op, cal.seconds(cycles) if cal else None, asdict(cal) if cal else None)


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        est = _serve(request)
    except TpumkError as e:
        est = Estimate(None, {}, None, None, str(e))
    print(json.dumps(asdict(est)))


if __name__ == "__main__":
    main()
