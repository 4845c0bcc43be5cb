"""Reading user files safely: only regular files, never more than a bound.

Every file tpumk reads on a user's say-so (a model TOML or config.json, a tuning or space TOML,
a checkpoint's index and safetensors, the signing key file, an artifact's files) goes through
`open_regular`: the path is opened with O_NONBLOCK (so a FIFO with no writer does not block the
open) and checked with fstat on the descriptor it got (no race with a swap after the check); a
FIFO, a character or block device (`/dev/zero`, a tty), a socket or a directory is refused in
one line naming the file and what it is. `read_regular` then reads at most `limit` bytes: a file
larger than that is refused, never read until memory runs out.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from tpumk.errors import ConfigError

KiB, MiB = 1 << 10, 1 << 20
TEXT_LIMIT = 16 * MiB  # a model / tuning / space TOML, a config.json, a checkpoint index
KEY_LIMIT = 64 * KiB  # a signing key file
NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4095  # bytes in a whole path

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def name_problem(path: str | os.PathLike) -> str | None:
    """Why the OS would refuse `path` as too long (None: it would not): a component over
    NAME_MAX bytes or the whole over PATH_MAX."""
    raw = os.fsencode(path)
    if len(raw) > PATH_MAX:
        return f"the path is {len(raw):,} bytes, longer than the {PATH_MAX} the OS accepts"
    longest = max(raw.split(b"/"), key=len, default=b"")
    if len(longest) > NAME_MAX:
        return f"a path component is {len(longest):,} bytes, longer than the {NAME_MAX} the OS accepts"
    return None


def shown(path: str | os.PathLike, width: int = 120) -> str:
    """A path for a one-line message: long names shortened in the middle."""
    s = os.fspath(path)
    s = s if isinstance(s, str) else os.fsdecode(s)
    return s if len(s) <= width else s[: width // 2] + "..." + s[-width // 2 + 3:]


def os_reason(e: OSError) -> str:
    if e.errno == errno.ENAMETOOLONG:
        return "file name too long (a path component over 255 bytes)"
    return e.strerror or type(e).__name__


class NotRegularFile(OSError):
    """The path opened, but is a FIFO, a device, a socket or a directory (strerror says which)."""


def open_fd(path: str | os.PathLike) -> int:
    """A blocking read-only descriptor of `path`, which must be a regular file (symlinks
    followed): opened with O_NONBLOCK, so a FIFO with no writer does not block the open, and
    checked by fstat on that descriptor. Raises OSError (NotRegularFile for another kind)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"is {kind_of(mode)}, not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike, what: str = "", error: Callable[[str], Exception] = ConfigError) -> int:
    """`open_fd`, its refusals one line: `what` ("expected a TOML file") ends the refusal; `error`
    is the exception class to raise."""
    name = shown(path)
    tail = f" ({what})" if what else ""
    problem = name_problem(path)
    if problem:
        raise error(f"{name}: {problem}")
    try:
        return open_fd(path)
    except FileNotFoundError:
        raise error(f"{name}: no such file{tail}") from None
    except NotRegularFile as e:
        raise error(f"{name}: {e.strerror}{tail}") from None
    except OSError as e:  # permission denied, a path through a regular file, ELOOP, EIO
        raise error(f"{name}: cannot read: {os_reason(e)}") from None


def read_regular(path: str | os.PathLike, limit: int = TEXT_LIMIT, what: str = "",
                 error: Callable[[str], Exception] = ConfigError) -> bytes:
    """The bytes of the regular file `path`, refused (one line) when it holds more than `limit`."""
    fd = open_regular(path, what, error)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"{shown(path)}: cannot read: {os_reason(e)}") from None
    if len(data) > limit:
        raise error(f"{shown(path)}: larger than {_size(limit)}{f' ({what})' if what else ''}; "
                    "not the file expected here")
    return data


def check_regular(path: str | os.PathLike, what: str = "", error: Callable[[str], Exception] = ConfigError) -> int:
    """Refuse `path` unless it is a regular file (for files a library opens itself, e.g.
    safetensors); returns its size."""
    fd = open_regular(path, what, error)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB} KiB" if n % KiB == 0 else f"{n} bytes"


def is_dir(path: str | os.PathLike) -> bool:
    """Path.is_dir() that answers False, never raises, for a name the OS refuses as too long."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False
