"""What a long command is doing, on stderr: one line as each phase starts, with the seconds since
the command began, so a 2-minute build is never silent (stdout keeps the report or the JSON).
On a terminal a phase that runs on (a profiling compile of a real model takes minutes) says so
again every `HEARTBEAT` seconds; off a terminal (CI logs) each phase is one line. The phase
times are kept, so the report can account for the whole wall time."""

from __future__ import annotations

import sys
import threading
import time

import click

from tpumk.cli.options import terminal_safe

HEARTBEAT = 30.0  # seconds between "still running" lines of one phase, on a terminal


class Phases:
    def __init__(self, command: str, heartbeat: float | None = None):
        self.command = command
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None
        self._heartbeat = heartbeat if heartbeat is not None else (HEARTBEAT if sys.stderr.isatty() else 0.0)
        self._stop: threading.Event | None = None
        # held while a heartbeat checks its phase is still on and prints, and while a phase ends:
        # without it a beat that woke just before the phase ended printed "still <old phase>"
        # after the next phase's line
        self._lock = threading.Lock()

    def _line(self, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        click.echo(terminal_safe(f"{self.command}: [{elapsed:6.1f} s] {text}", one_line=True), err=True)

    def __call__(self, phase: str) -> None:
        """Phase `phase` starts now (the previous one ends)."""
        now = time.perf_counter()
        self._close(now)
        self._current = (phase, now)
        self._line(phase)
        if self._heartbeat > 0:
            stop = self._stop = threading.Event()

            def beat() -> None:
                while not stop.wait(self._heartbeat):
                    with self._lock:
                        if stop.is_set():
                            return
                        self._line(f"... still {phase.split(' (')[0]}")

            threading.Thread(target=beat, daemon=True).start()

    def _close(self, now: float) -> None:
        if self._stop is not None:
            with self._lock:
                self._stop.set()
            self._stop = None
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
