"""What a long command is doing, on stderr: one line as each phase starts, with the seconds since
the command began, so a 2-minute build is never silent (stdout keeps the report or the JSON).
The phase times are kept, so the report can account for the whole wall time."""

from __future__ import annotations

import time

import click

from tpumk.cli.options import terminal_safe


class Phases:
    def __init__(self, command: str):
        self.command = command
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def __call__(self, phase: str) -> None:
        """Phase `phase` starts now (the previous one ends)."""
        now = time.perf_counter()
        self._close(now)
        self._current = (phase, now)
        click.echo(terminal_safe(f"{self.command}: [{now - self.start:6.1f} s] {phase}", one_line=True), err=True)

    def _close(self, now: float) -> None:
        if self._current is not None:
            name, began = self._current
            self.seconds[name] = self.seconds.get(name, 0.0) + now - began
            self._current = None

    def done(self) -> float:
        """End the last phase; the command's wall seconds so far."""
        now = time.perf_counter()
        self._close(now)
        return now - self.start

    def summary(self) -> str:
        """'141.9 s: plan 0.4 s, lower + compile 22.3 s, compiler estimate 118.9 s, other 0.3 s' (each
        phase by its name before any parenthesis)."""
        wall = self.done()
        other = wall - sum(self.seconds.values())
        parts = [f"{name.split(' (')[0]} {s:.1f} s" for name, s in self.seconds.items()]
        parts.append(f"other {max(other, 0.0):.1f} s")
        return f"{wall:.1f} s: " + ", ".join(parts)
