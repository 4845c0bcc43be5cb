"""XLA_FLAGS for the subprocesses tests start: the session's flags (conftest.FAST_CPU_FLAGS)
kept, the host-device count set or dropped; and `tpumk generate --devices N` run that way."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")
ROOT = Path(__file__).resolve().parents[1]


def xla_flags(devices: int | None = None) -> str:
    """This process's XLA_FLAGS with its host-device count replaced by `devices` (None: removed,
    for a command that makes its host devices itself)."""
    flags = DEVICE_COUNT.sub("", os.environ.get("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def generate_on_devices(ckpt, prompts, steps: int, devices: int, *extra: str, timeout: int = 900) -> dict:
    """`tpumk generate --backend megakernel --devices N --json` (plus `extra` options) on a
    checkpoint, in a fresh process (the command makes its own host devices): the parsed report."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    proc = subprocess.run([sys.executable, "-m", "tpumk.cli", "generate", "--checkpoint", str(ckpt), "--prompt-ids",
                           ";".join(",".join(map(str, p)) for p in prompts), "--steps", str(steps), "--backend",
                           "megakernel", "--devices", str(devices), *extra, "--json"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
