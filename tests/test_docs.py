"""The documentation's commands stay true: every `tpumk ...` line of a bash block in README.md and
docs/*.md parses with the current command line (the command exists, every option exists and
its value has the option's type or is one of its choices). Parsing runs no command; the README's
Python quickstart runs as written in tests/test_artifacts.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
import pytest

from tpumk.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("tpumk ", ".venv/bin/tpumk ")


def doc_commands() -> list[tuple[str, list[str]]]:
    """(file:line, argv after `tpumk`) of every tpumk command in a ```bash block (a line may chain
    commands with &&; a `# ...` comment ends it; a line ending in a backslash goes on on the next,
    as in the shell, and the command is named by its first line)."""
    out = []
    for path in DOCS:
        fence, held, first = None, "", 0
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fence = line.strip()[3:] if fence is None else None
                continue
            if fence not in ("bash", "sh"):
                continue
            if line.endswith("\\"):
                held, first = held + line[:-1] + " ", first or n
                continue
            line, held, n, first = held + line, "", first or n, 0
            for part in shlex.split(line, comments=True) and line.split("&&"):
                words = shlex.split(part, comments=True)
                text = " ".join(words)
                if any(text.startswith(p) for p in PREFIXES):
                    out.append((f"{path.relative_to(ROOT)}:{n}", words[1:]))
    return out


COMMANDS = doc_commands()


def test_the_docs_show_the_main_commands():
    shown = {argv[0] for _, argv in COMMANDS if argv}
    assert {"build", "tune", "export", "inspect", "cache-key", "bench", "generate", "report"} <= shown, shown


def parse(argv: list[str]) -> None:
    """Parse `tpumk argv` as the command line would (ClickException when it would not), running nothing."""
    ctx = main.make_context("tpumk", list(argv))
    cmd = main.get_command(ctx, argv[0])
    if cmd is None:
        raise click.UsageError(f"no command {argv[0]!r}")
    cmd.make_context(argv[0], list(argv[1:]), parent=ctx)


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_documented_command_parses(where, argv):
    try:
        parse(argv)
    except click.ClickException as e:
        pytest.fail(f"{where}: tpumk {' '.join(argv)}: {e.format_message()}")


@pytest.mark.parametrize("argv", [["build", "--no-such-option"], ["tune", "--objective", "fastest"], ["buld"],
                                  ["bench", "--batch", "eight"]])
def test_a_stale_command_would_be_caught(argv):
    with pytest.raises(click.ClickException):
        parse(argv)
