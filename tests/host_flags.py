"""XLA_FLAGS for the subprocesses tests start: the session's flags (conftest.FAST_CPU_FLAGS)
kept, the host-device count set or dropped."""

from __future__ import annotations

import os
import re

DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def xla_flags(devices: int | None = None) -> str:
    """This process's XLA_FLAGS with its host-device count replaced by `devices` (None: removed,
    for a command that makes its host devices itself)."""
    flags = DEVICE_COUNT.sub("", os.environ.get("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
