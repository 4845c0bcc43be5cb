"""Directory trees for the hostile-input tests: written from a dict, snapshotted, and compared
for writes outside the directories a case allows (tests/test_hostile_*.py share these)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Symlink:
    """A symbolic link to `target` (relative to the link's directory)."""

    def __init__(self, target: str):
        self.target = target


class Fifo:
    """A named pipe nobody writes to."""


class Sparse:
    """A file of `size` bytes (sparse: zeros after `head`), far larger than any config tpumk reads."""

    def __init__(self, size: int, head: bytes = b""):
        self.size, self.head = size, head


def write_tree(root: Path, files: dict[str, Any]) -> list[Path]:
    """Write `files` (relative path -> text | bytes | a callable giving one | Symlink | Fifo |
    Sparse; a path ending in "/" is a directory) under root; returns the FIFOs made."""
    fifos = []
    for rel, content in files.items():
        p = root / rel
        if rel.endswith("/"):
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if callable(content) and not isinstance(content, type):
            content = content()
        if isinstance(content, Fifo):
            os.mkfifo(p)
            fifos.append(p)
        elif isinstance(content, Symlink):
            p.symlink_to(content.target)
        elif isinstance(content, Sparse):
            with open(p, "wb") as f:
                f.write(content.head)
                f.truncate(content.size)
        elif isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return fifos


def snapshot(root: Path) -> dict[str, tuple]:
    """(mode, size, mtime) of every path under root, links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def stray(before: dict, after: dict, allowed: list[str]) -> list[str]:
    """Paths created, changed or removed outside the allowed directories."""
    def ok(rel: str) -> bool:
        return any(rel == a or rel.startswith(a + os.sep) for a in allowed)

    changed = [p for p in after if before.get(p) != after[p] and not ok(p)]
    # an allowed directory itself may appear (or get a new mtime) when files go into it
    changed = [p for p in changed if not any(a.startswith(p + os.sep) for a in allowed)]
    removed = [p for p in before if p not in after and not ok(p)]
    return sorted(changed) + [f"(removed) {p}" for p in sorted(removed)]
