"""Reading and writing the small TOML files tpumk takes and makes (models, tuning, manifests).

Reading turns a missing or unreadable file, bytes that are not UTF-8, bad syntax, nesting too
deep for the parser or an integer too long to convert into a one-line ConfigError naming the file;
writing goes to a temporary file in the same directory and is renamed into place, so a crash
never leaves a half-written file behind.
"""

from __future__ import annotations

import os
import secrets
import sys
import tomllib
from pathlib import Path
from typing import Any

from tpumk.errors import ConfigError, one_line


def read_toml(path: str | Path, limit: int | None = None) -> dict[str, Any]:
    """A TOML file, read only as a regular file of at most `limit` bytes (tpumk.files): a FIFO,
    a device, a directory or an oversized file is a one-line ConfigError naming it."""
    from tpumk.files import TEXT_LIMIT, read_regular

    data = read_regular(path, TEXT_LIMIT if limit is None else limit, "expected a TOML file")
    return parse_toml(data, str(path))


def parse_toml(data: bytes | str, source: str) -> dict[str, Any]:
    """Parse a TOML document; anything the parser refuses is a one-line ConfigError naming
    `source`: bytes that are not UTF-8 text (TOML is UTF-8), bad syntax, arrays or inline
    tables nested too deeply for the parser, integers longer than Python converts
    (sys.get_int_max_str_digits(), 4300 digits by default)."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{source}: not a UTF-8 text file (TOML is UTF-8 text): "
                              f"byte 0x{data[e.start]:02x} at offset {e.start}") from None
    try:
        return tomllib.loads(data)
    except (ValueError, RecursionError) as e:  # TOMLDecodeError is a ValueError
        raise parser_refusal(source, "TOML", "arrays or inline tables", e) from None


def parser_refusal(source: str, fmt: str, nests: str, e: ValueError | RecursionError) -> ConfigError:
    """One line for a document a parser (tomllib, json) refused: syntax, nesting deeper than the
    parser recurses, or an integer longer than Python converts (sys.get_int_max_str_digits())."""
    if isinstance(e, RecursionError):
        return ConfigError(f"{source}: malformed {fmt}: {nests} nested too deeply")
    if "integer string conversion" in str(e):
        return ConfigError(f"{source}: malformed {fmt}: an integer with more than "
                           f"{sys.get_int_max_str_digits()} digits")
    return ConfigError(f"{source}: malformed {fmt}: {one_line(e)}")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to a temporary file next to `path`, flushed to disk, then rename it into
    place. The file gets the mode a plain open() would give (0o666 less the umask: the kernel
    applies it), not mkstemp's owner-only 0600."""
    path = Path(path)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{path.parent}: no free temporary file name")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
