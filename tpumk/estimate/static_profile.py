"""The TPU compiler's static cost profile (estimated cycles per HLO op, no TPU needed).

libtpu writes `<dir>/<hlo op>_<device kind>_static_llo_profile.textproto` for every compile
when started with `--xla_jf_dump_static_llo_profile_to=<dir>` in LIBTPU_INIT_ARGS. The flag is
read once, when libtpu initialises, so `enable()` must run before JAX creates its backends;
the CLI and the test suite call it at start-up. After each compile, `collect()` reads the
files that compile wrote and deletes them, so the next compile starts clean.

What the figure is and is not (TPU_FACTS section 3): cycles, not seconds; a loop nested in
another loop is counted once, not per trip; usable to rank variants of one Pallas kernel, not
comparable with an XLA program. Callers must say so wherever they show it.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from tpumk.compat import jax_backends_initialised
from tpumk.compile.keys import PROFILE_FLAG as FLAG  # the key leaves this flag out
_CYCLES = re.compile(r'hlo_op_name:\s*"([^"]*)"\s*estimated_cycles:\s*(\d+)')


def profile_dir() -> Path | None:
    """The directory libtpu writes profiles to in this process, if the flag is set."""
    m = re.search(FLAG + r"=(\S+)", os.environ.get("LIBTPU_INIT_ARGS", ""))
    return Path(m.group(1)) if m else None




def enable(directory: str | Path | None = None) -> Path | None:
    """Ask libtpu for static profiles in this process. Returns the directory, or None when
    it is too late (backends already initialised without the flag)."""
    current = profile_dir()
    if current is not None:
        current.mkdir(parents=True, exist_ok=True)
        return current
    if jax_backends_initialised():
        return None
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="tpumk-llo-profile-"))
    d.mkdir(parents=True, exist_ok=True)
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + f" {FLAG}={d}").strip()
    return d


def clear() -> None:
    d = profile_dir()
    if d is not None and d.is_dir():
        for f in d.glob("*_static_llo_profile.textproto"):
            f.unlink(missing_ok=True)


def collect(device_kind: str) -> dict[str, int]:
    """Estimated cycles per HLO op from the profiles written for `device_kind` since the last
    collect/clear; the files read are removed. Empty when profiling is off or nothing came."""
    d = profile_dir()
    if d is None or not d.is_dir():
        return {}
    out: dict[str, int] = {}
    for f in d.glob(f"*_{device_kind}_static_llo_profile.textproto"):
        for name, cycles in _CYCLES.findall(f.read_text()):
            out[name] = out.get(name, 0) + int(cycles)
        f.unlink(missing_ok=True)
    return out
