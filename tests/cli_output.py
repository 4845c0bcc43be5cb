"""What a command printed on stderr, read as the tests expect it: the progress lines of the phases
that started (tpumk.cli.progress: `tpumk generate: [   0.0 s] weights: ...`), then at most one
`tpumk: error: ...` line."""

from __future__ import annotations

import re

PROGRESS_LINE = re.compile(r"tpumk [a-z-]+: \[ *\d+\.\d s\] \S")


def error_lines(stderr: str) -> list[str]:
    """stderr without its progress lines (any other line is kept, so a stray one still shows)."""
    return [ln for ln in stderr.splitlines() if not PROGRESS_LINE.match(ln)]
