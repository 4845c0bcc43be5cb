"""`tpumk` packages that are not tpumk, planted where a child process could pick them up.

tpumk's Python children (the compiler-estimate process, the tuner's worker; started with
tpumk.child_process.command) must import the tpumk of the process that starts them, never a
`tpumk/` directory in the working directory (a checkout, an unpacked archive) or one earlier on
PYTHONPATH. Each impostor's `__init__.py` leaves a marker file when imported; a test runs a
command beside them and checks that no marker appeared.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKER = "IMPOSTOR-IMPORTED"


def plant(cwd: Path, elsewhere: Path) -> dict[str, str]:
    """An impostor `tpumk` package in `cwd` and one in `elsewhere`; returns PYTHONPATH with
    `elsewhere` first (set it in the environment the command runs in)."""
    for root in (cwd, elsewhere):
        pkg = root / "tpumk"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(
            "import pathlib\n"
            f"pathlib.Path(__file__).with_name({MARKER!r}).write_text('imported')\n")
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(elsewhere), *([old] if old else [])])}


def imported(*roots: Path) -> list[str]:
    """The impostors under `roots` that something imported."""
    return [str(p) for root in roots for p in root.glob(f"tpumk/{MARKER}")]
