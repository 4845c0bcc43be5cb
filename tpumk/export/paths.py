"""Where artifacts go on disk: safe names, --out checks, and the temporaries of killed exports.

`OUT/<model>/<target>/<key>/`: the model and target names become directory names, so each must
be one safe path component. Unsafe names are refused, not rewritten: a rewritten name would make
the directory differ from the name the user reads in their config (and two names could map to
one), while a refusal says exactly what to change.

Exports write into `.tmp-<key16>.<pid>.<host>.<random>` beside the final directory and rename it
into place. Each temporary holds a marker file (`TMP_MARKER`, tpumk's own text) from its
creation until just before the rename, and tpumk only ever removes a directory that carries it
and is owned by the user running tpumk: a directory someone else made, even one named `.tmp-*`,
is never touched. A killed export leaves its temporary behind; the next export into the same
parent removes marked temporaries whose process is gone (same host, pid not alive) or that are
older than an hour (any host: writing an artifact takes seconds, the compile happens before the
temporary exists). A published artifact directory gets the mode a plain mkdir would give
(0o777 less the umask), not mkdtemp's owner-only 0700.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

from tpumk.errors import ArtifactPathError
from tpumk.files import open_fd, os_reason

TMP_PREFIX = ".tmp-"
TMP_MARKER = ".tpumk-export-temporary"
TMP_MARKER_TEXT = b"tpumk export temporary: removed by tpumk when its export dies\n"
STALE_SECONDS = 3600
_RULE = "one path component: no '/', '\\', NUL or control characters, not '.' or '..', no leading '.'"


def unsafe_reason(name: object) -> str | None:
    """Why `name` cannot be one directory name under --out (None: it can)."""
    if not isinstance(name, str) or not name:
        return "it is empty"
    if name in (".", ".."):
        return f"it is {name!r}"
    if "/" in name:
        return "it contains '/'"
    if "\\" in name:
        return "it contains '\\'"
    if "\0" in name:
        return "it contains NUL"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it contains a control character"
    if name.startswith("."):
        return "it starts with '.'"
    if len(name.encode()) > 200:
        return "it is longer than 200 bytes"
    return None


def check_component(kind: str, name: object, hint: str = "") -> str:
    reason = unsafe_reason(name)
    if reason:
        raise ArtifactPathError(f"{kind} name {name!r} cannot be a directory name under --out: {reason} "
                                f"(refused, not rewritten: it must be {_RULE}){hint}")
    return name  # type: ignore[return-value]


def check_names(model: str, target: str) -> None:
    """The model and target names as directory names under --out (ArtifactPathError naming why):
    a cheap check that runs before any plan or key."""
    check_component("model", model, "; set `name` in the model TOML or `_name_or_path` in config.json")
    check_component("target", target)


def artifact_dir(out_dir: str | Path, model: str, target: str, key: str) -> Path:
    """OUT/<model>/<target>/<key>, refused unless every name is safe and the resolved path stays
    inside the resolved OUT (a symlinked model or target directory pointing elsewhere is refused)."""
    check_names(model, target)
    check_component("cache key", key)
    out = Path(out_dir)
    final = out / model / target / key
    root = out.resolve()
    if not final.resolve().is_relative_to(root):
        raise ArtifactPathError(f"{final}: resolves to {final.resolve()}, outside --out {root} "
                                "(a symlink in the way?)")
    return final


def read_at_most(path: Path, limit: int) -> bytes:
    """Up to limit + 1 bytes of `path`: a caller refuses more than `limit` from the length of what
    it got (a size checked first, then read, can be outrun by a file growing in between)."""
    with open_regular_file(path) as f:
        return f.read(limit + 1)


def open_regular_file(path: Path):
    """`open(path, "rb")` that refuses anything but a regular file (a FIFO or device swapped in
    for an artifact's file would block or never end): tpumk.files.open_fd. Raises OSError
    (ArtifactError's callers turn it into one line)."""
    return open(path, "rb", opener=lambda p, _flags: open_fd(p))  # read-only whatever the flags


def check_out_dir(out_dir: str | Path, target_dir: str | Path | None = None, probe: bool = True) -> None:
    """Before compiling: --out (and the directory below it an artifact goes to, `target_dir`)
    must be, or be creatable as, a writable directory: a regular file (or a broken symlink) in
    the way is refused. With `probe` (export), writes nothing that stays: a probe directory in
    the deepest existing ancestor, removed at once; `tpumk cache-key --out` (probe=False) writes
    nothing at all."""
    out = Path(out_dir)
    probe_in = Path(target_dir) if target_dir is not None else out
    while not probe_in.exists() and not probe_in.is_symlink():
        if probe_in.parent == probe_in:
            break
        probe_in = probe_in.parent
    if probe_in.exists() and not probe_in.is_dir():
        what = "a regular file" if probe_in.is_file() else "not a directory"
        where = "" if probe_in == out else " (in the artifact's path)"
        raise ArtifactPathError(f"--out {out}: {probe_in} is {what}, not a directory{where}")
    if not probe_in.exists():
        raise ArtifactPathError(f"--out {out}: {probe_in} is a broken symlink")
    if not probe:
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tpumk-probe-", dir=probe_in))
    except OSError as e:
        raise ArtifactPathError(f"--out {out}: cannot write in {probe_in}: {os_reason(e)}") from None


def check_inside(out_dir: str | Path, path: Path) -> None:
    """Again after creating directories: `path` still resolves inside --out (a symlink planted
    meanwhile is refused)."""
    root = Path(out_dir).resolve()
    if not path.resolve().is_relative_to(root):
        raise ArtifactPathError(f"{path}: resolves to {path.resolve()}, outside --out {root} (a symlink in the way?)")


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def tmp_prefix(key: str) -> str:
    return f"{TMP_PREFIX}{key[:16]}.{os.getpid()}.{_host_tag()}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's live process
        return True
    return True


def is_stale(tmp: Path, now: float | None = None, max_age: float = STALE_SECONDS) -> bool:
    """A temporary of a killed export: its process is gone (recorded on this host), or it is old."""
    now = time.time() if now is None else now
    try:
        age = now - tmp.lstat().st_mtime
    except OSError:
        return False
    if age > max_age:
        return True
    parts = tmp.name[len(TMP_PREFIX):].split(".")
    if len(parts) == 4 and parts[1].isdigit() and parts[2] == _host_tag():
        pid = int(parts[1])
        return pid != os.getpid() and not _pid_alive(pid)
    return False


def make_tmp(parent: Path, key: str) -> Path:
    """A new export temporary in `parent`, marked as tpumk's (`TMP_MARKER`) before anything else
    goes into it, with the mode the umask gives a new directory."""
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(key), dir=parent))
    try:
        fd = os.open(tmp / TMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, TMP_MARKER_TEXT)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o777 & ~current_umask())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def unmark_tmp(tmp: Path) -> None:
    """Before the rename that publishes it: the artifact carries no marker."""
    (tmp / TMP_MARKER).unlink()


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_marked_tmp(p: Path) -> bool:
    """A directory tpumk made as an export temporary: a real directory (not a symlink) owned by
    this user, holding the marker file with tpumk's text."""
    try:
        st = p.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        fd = os.open(p / TMP_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(TMP_MARKER_TEXT) + 1) == TMP_MARKER_TEXT
    except OSError:
        return False
    finally:
        os.close(fd)


def clean_stale_tmps(parent: Path, now: float | None = None, max_age: float = STALE_SECONDS) -> list[Path]:
    """Remove the stale export temporaries directly in `parent` (only directories tpumk marked as
    its own: `is_marked_tmp`); returns what was removed."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        if p.name.startswith(TMP_PREFIX) and is_marked_tmp(p) and is_stale(p, now, max_age):
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                removed.append(p)
    return removed
