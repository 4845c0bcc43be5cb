"""The GGUF container (llama.cpp's single-file format): its header parsed with every count,
length and offset checked against the file's size before anything is allocated or walked.

Why not the `gguf` package's GGUFReader for the header: it walks the metadata item by item with
no bound and one numpy view per item (an array declaring 2**62 items in a 49-byte file never
ends while memory grows; one legal array of 5 M bytes took 48 s and 3.7 GB), and it maps tensors
without checking their alignment, their overlap or that their data lies inside the file (an
offset that wraps around 2**64 lands in the header): such a file loaded and ran on wrong
weights. Here the header is read with `struct` from a memory map: numeric arrays are one numpy
view, string arrays one walk over their lengths; tensors are numpy views of the map, which
`tpumk.model.gguf` dequantizes with `gguf.quants.dequantize`. The `gguf` package still names
the value and tensor types (GGUFValueType, GGMLQuantizationType, GGML_QUANT_SIZES).

The rules are llama.cpp's (its gguf loader refuses a file that breaks one):
- magic `GGUF`, version 2 or 3, little-endian;
- the tensor and key/value counts no larger than the file can hold (each tensor info takes at
  least 24 bytes, each key/value at least 13);
- every string's length, and every array's item count times its item size, inside the file;
  arrays of arrays refused; keys unique; `general.alignment` a UINT32 power of two (default 32);
- a tensor name under 64 bytes (GGML_MAX_NAME with its NUL), unique; 1 to 4 dimensions, each
  below 2**63; a GGML type with a size (not a removed one), its row a whole number of blocks;
- every tensor's offset a multiple of the alignment, its data inside the file, no two tensors'
  bytes overlapping.
Beyond llama.cpp, tpumk bounds what it is willing to walk (a legal but absurd file must not take
minutes): at most MAX_ARRAY_ITEMS items in one array (the largest vocabulary tpumk models),
MAX_METADATA_ITEMS in all arrays together, MAX_ENTRIES key/values and MAX_ENTRIES tensors, and
keys of at most MAX_KEY_BYTES.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from tpumk.errors import CheckpointError
from tpumk.files import check_regular, name_problem, open_fd, os_reason, shown
from tpumk.model.config import MAX_SIZES

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; llama.cpp reads 2 and 3
HEADER_BYTES = 24  # magic, version, tensor count, key/value count
MIN_KV_BYTES = 8 + 4 + 1  # an empty key, the value type, a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # an empty name, n_dims, the type, the offset (no dims)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) less the C string's NUL
# tpumk's own bounds (see the module doc): far above any real file, low enough that the walk of
# a legal but absurd file stays within seconds.
MAX_ARRAY_ITEMS = MAX_SIZES["vocab_size"]  # 4,194,304: a vocabulary's tokens, merges, scores, types
MAX_METADATA_ITEMS = 4 * MAX_ARRAY_ITEMS  # those four arrays of the largest vocabulary
MAX_ENTRIES = 1 << 16  # key/values, tensors (a 1,024-layer Llama has 9,219 tensors)
MAX_KEY_BYTES = 256  # real keys are under 64 bytes (llama.attention.layer_norm_rms_epsilon: 38)

_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "B", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_SIZES = {t: struct.calcsize("<" + c) for t, c in _SCALARS.items()}
INTEGERS = frozenset({GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                      GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64})
FLOATS = frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64})
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _type_name(t: GGUFValueType, item: GGUFValueType | None = None) -> str:
    """'a UINT32', 'an INT8', 'an ARRAY of STRING': a field's type for a message."""
    name = f"{t.name} of {item.name}" if t == GGUFValueType.ARRAY and item is not None else t.name
    return ("an " if name[0] in "AI" else "a ") + name


@dataclass(frozen=True)
class Field:
    """One key/value of the metadata: where its value lies (arrays: from the first item)."""
    key: str
    type: GGUFValueType
    start: int
    end: int
    item_type: GGUFValueType | None = None  # arrays only
    count: int = 1  # arrays: how many items

    def kind(self) -> str:
        return _type_name(self.type, self.item_type)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    dims: tuple[int, ...]  # GGML's order, innermost first
    start: int  # absolute byte offset of its data in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order (outermost first), like Hugging Face's [out, in]."""
        return tuple(reversed(self.dims))

    def byte_shape(self) -> tuple[int, ...]:
        block, size = GGML_QUANT_SIZES[self.type]
        return (*self.shape[:-1], self.dims[0] // block * size)


class _Cursor:
    """Reads forward through the map; every read is checked against the file's size first."""

    def __init__(self, buf: mmap.mmap, size: int, bad):
        self.buf, self.size, self.pos, self.bad = buf, size, 0, bad

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.bad(f"{what} at byte {self.pos:,} needs {n:,} bytes, but the file ends at byte {self.size:,}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, limit: int | None = None) -> tuple[int, int]:
        """A length-prefixed string: its [start, end) in the file."""
        n = self.u64(f"the length of {what}")
        if limit is not None and n > limit:
            raise self.bad(f"{what} at byte {self.pos - 8:,} is {n:,} bytes long, more than {limit:,}")
        self.need(n, what)
        start = self.pos
        self.pos += n
        return start, self.pos

    def text(self, what: str, limit: int | None = None) -> str:
        start, end = self.string(what, limit)
        try:
            return bytes(self.buf[start:end]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{what} at byte {start:,} is not UTF-8 text") from None


class GGUFFile:
    """A GGUF file's metadata and tensor layout, checked (module doc); tensor data read lazily."""

    def __init__(self, path: Path, fd: int):
        self.path, self.src = path, shown(path)
        self.size = os.fstat(fd).st_size
        if self.size < HEADER_BYTES:
            raise self._bad(f"{self.size} bytes, shorter than the {HEADER_BYTES}-byte GGUF header")
        self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        self.fields: dict[str, Field] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _bad(self, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.src}: not a readable GGUF file ({detail})")

    # ------------------------------------------------------------------ the header
    def _parse(self) -> None:
        c = _Cursor(self._map, self.size, self._bad)
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            raise self._bad(f"magic {magic!r} at byte 0, expected {MAGIC!r}")
        c.pos = 4
        version = c.u32("the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise self._bad("a big-endian file (tpumk reads little-endian GGUF, as llama.cpp does)"
                            if swapped in VERSIONS else f"version {version}, expected one of {VERSIONS}")
        n_tensors, n_kv = c.u64("the tensor count"), c.u64("the key/value count")
        room = self.size - HEADER_BYTES
        if n_tensors > MAX_ENTRIES or n_kv > MAX_ENTRIES:
            raise self._bad(f"header declares {n_tensors:,} tensors and {n_kv:,} metadata key/values; tpumk reads "
                            f"at most {MAX_ENTRIES:,} of each")
        if n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES > room:
            raise self._bad(f"header declares {n_tensors:,} tensors and {n_kv:,} metadata key/values, more than "
                            f"the file's {self.size:,} bytes can hold")
        self._items_left = MAX_METADATA_ITEMS
        for i in range(n_kv):
            key = c.text(f"metadata key {i}", MAX_KEY_BYTES)
            if key in self.fields:
                raise self._bad(f"metadata key '{key}' appears twice")
            self.fields[key] = self._value(c, key)
        alignment = self._alignment()
        infos = [self._tensor_info(c, i) for i in range(n_tensors)]
        self.alignment = alignment
        self.data_offset = -(-c.pos // alignment) * alignment
        self._place(infos)

    def _value(self, c: _Cursor, key: str) -> Field:
        raw = c.u32(f"the type of metadata field '{key}'")
        kind = self._value_type(raw, key)
        start = c.pos
        if kind == GGUFValueType.STRING:
            c.string(f"metadata field '{key}'")
            return Field(key, kind, start, c.pos)
        if kind != GGUFValueType.ARRAY:
            c.need(_SIZES[kind], f"metadata field '{key}'")
            c.pos += _SIZES[kind]
            return Field(key, kind, start, c.pos)
        item = self._value_type(c.u32(f"the item type of metadata array '{key}'"), key)
        if item == GGUFValueType.ARRAY:
            raise self._bad(f"metadata field '{key}' is an array of arrays (llama.cpp reads none)")
        n = c.u64(f"the length of metadata array '{key}'")
        least = 8 if item == GGUFValueType.STRING else _SIZES[item]  # a string: at least its length
        c.need(n * least, f"metadata array '{key}' of {n:,} {item.name} items")
        if n > MAX_ARRAY_ITEMS:
            raise CheckpointError(f"{self.src}: metadata field '{key}' is an array of {n:,} items, more than the "
                                  f"{MAX_ARRAY_ITEMS:,} tpumk reads (the largest vocabulary it models)")
        if n > self._items_left:
            raise CheckpointError(f"{self.src}: the metadata arrays hold more than {MAX_METADATA_ITEMS:,} items "
                                  f"in all (at '{key}'), more than tpumk reads")
        self._items_left -= n
        start = c.pos
        if item == GGUFValueType.STRING:
            for j in range(n):
                c.string(f"item {j} of metadata array '{key}'")
        else:
            c.pos += n * least
        return Field(key, kind, start, c.pos, item, n)

    def _value_type(self, raw: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._bad(f"metadata field '{key}' has value type {raw}, which is not a GGUF value type") from None

    def _alignment(self) -> int:
        f = self.fields.get("general.alignment")
        if f is None:
            return GGUF_DEFAULT_ALIGNMENT
        if f.type != GGUFValueType.UINT32:
            raise self._bad(f"metadata field 'general.alignment' is {f.kind()}, expected a UINT32")
        a = self.value("general.alignment")
        if a == 0 or a & (a - 1):
            raise self._bad(f"metadata field 'general.alignment' = {a}: expected a power of two")
        return a

    def _tensor_info(self, c: _Cursor, i: int) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
        name = c.text(f"the name of tensor {i}", MAX_NAME_BYTES)
        n_dims = c.u32(f"the dimension count of tensor '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self._bad(f"tensor '{name}' has {n_dims} dimensions, expected 1 to {MAX_DIMS}")
        dims = tuple(c.u64(f"dimension {j} of tensor '{name}'") for j in range(n_dims))
        if any(d >= 1 << 63 for d in dims):
            raise self._bad(f"tensor '{name}' has dimensions {list(dims)}, expected each below 2**63")
        raw = c.u32(f"the type of tensor '{name}'")
        try:
            kind = GGMLQuantizationType(raw)
            block, _ = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise CheckpointError(f"{self.src}: tensor '{name}' has tensor type {raw} (field 'type' of its tensor "
                                  "info), which is not a GGML tensor type the gguf package knows") from None
        if dims[0] % block:
            raise self._bad(f"tensor '{name}' of type {kind.name} has rows of {dims[0]:,} values, not a multiple "
                            f"of its block of {block}")
        return name, kind, dims, c.u64(f"the data offset of tensor '{name}'")

    def _place(self, infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]]) -> None:
        """Each tensor's data: aligned, inside the file, overlapping no other tensor's."""
        for name, kind, dims, offset in infos:
            if name in self.tensors:
                raise self._bad(f"tensor '{name}' appears twice")
            block, size = GGML_QUANT_SIZES[kind]
            count = 1
            for d in dims:
                count *= d
            nbytes = count // block * size
            if offset % self.alignment:
                raise CheckpointError(f"{self.src}: tensor '{name}' has data offset {offset:,}, not a multiple of "
                                      f"the file's alignment {self.alignment} (general.alignment)")
            start = self.data_offset + offset
            if start + nbytes > self.size:
                wraps = (f", which wraps around 2**64 to file byte {start % (1 << 64):,}, inside the header"
                         if start >= 1 << 64 and start % (1 << 64) < self.data_offset else "")
                raise CheckpointError(f"{self.src}: tensor '{name}' has its {nbytes:,} bytes at data offset "
                                      f"{offset:,} (file byte {start:,}{wraps}), past the end of the file "
                                      f"({self.size:,} bytes)")
            self.tensors[name] = TensorInfo(name, kind, dims, start, nbytes)
        laid = sorted((t for t in self.tensors.values() if t.nbytes), key=lambda t: t.start)
        for a, b in zip(laid, laid[1:]):
            if b.start < a.start + a.nbytes:
                raise CheckpointError(f"{self.src}: tensor '{b.name}' (file bytes {b.start:,} to "
                                      f"{b.start + b.nbytes:,}) overlaps tensor '{a.name}' (bytes {a.start:,} to "
                                      f"{a.start + a.nbytes:,})")

    # ------------------------------------------------------------------ typed reads
    def value(self, key: str) -> Any:
        """A scalar or string field as Python's value (BOOL: bool; a byte other than 0 / 1 refused)."""
        f = self.fields[key]
        if f.type == GGUFValueType.STRING:
            return self._text(f.start + 8, f.end, f"metadata field '{key}'")
        if f.type == GGUFValueType.ARRAY:
            raise CheckpointError(f"{self.src}: metadata field '{key}' is {f.kind()}, expected a single value")
        (v,) = struct.unpack_from("<" + _SCALARS[f.type], self._map, f.start)
        if f.type == GGUFValueType.BOOL:
            if v > 1:
                raise CheckpointError(f"{self.src}: metadata field '{key}' is a BOOL holding {v}, expected 0 or 1")
            return bool(v)
        return v

    def typed(self, key: str, types: frozenset | set, expected: str, default: Any = None) -> Any:
        """value(key) when the field is one of `types` (absent: `default`); another type refused
        in one line naming the field, what it is and what was `expected`."""
        f = self.fields.get(key)
        if f is None:
            return default
        if f.type not in types:
            raise CheckpointError(f"{self.src}: metadata field '{key}' is {f.kind()}, expected {expected}")
        return self.value(key)

    def strings(self, key: str) -> list[str]:
        """An ARRAY of STRING as Python strings (each must be UTF-8)."""
        f = self._array(key, {GGUFValueType.STRING}, "an ARRAY of STRING")
        out, pos = [], f.start
        for j in range(f.count):
            (n,) = _U64.unpack_from(self._map, pos)
            out.append(self._text(pos + 8, pos + 8 + n, f"item {j} of metadata field '{key}'"))
            pos += 8 + n
        return out

    def integers(self, key: str) -> np.ndarray:
        """An ARRAY of any integer type, as int64 (a UINT64 above 2**63 - 1 refused)."""
        f = self._array(key, INTEGERS, "an ARRAY of integers")
        dt = np.dtype("<" + _SCALARS[f.item_type])
        a = np.frombuffer(self._map, dt, f.count, f.start)
        if dt == np.uint64 and f.count and int(a.max()) >= 1 << 63:
            raise CheckpointError(f"{self.src}: metadata field '{key}' holds {int(a.max())}, expected integers "
                                  "below 2**63")
        return a.astype(np.int64)

    def _array(self, key: str, items: set | frozenset, expected: str) -> Field:
        f = self.fields[key]
        if f.type != GGUFValueType.ARRAY or f.item_type not in items:
            raise CheckpointError(f"{self.src}: metadata field '{key}' is {f.kind()}, expected {expected}")
        return f

    def _text(self, start: int, end: int, what: str) -> str:
        try:
            return bytes(self._map[start:end]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.src}: {what} is not UTF-8 text (byte {e.start} of "
                                  f"{bytes(self._map[start:end])[max(0, e.start - 8):e.start + 8]!r})") from None

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as llama.cpp stores them, shaped as `gguf.quants.dequantize` takes
        them (rows of whole blocks): a read-only view of the map."""
        return np.frombuffer(self._map, np.uint8, t.nbytes, t.start).reshape(t.byte_shape())


def is_gguf_path(path: str | Path) -> bool:
    """A checkpoint path read as a GGUF file (by its name, whatever kind of file it is)."""
    return Path(path).name.lower().endswith(".gguf")


def open_gguf(path: str | Path) -> GGUFFile:
    """The checked GGUF file at `path`, a regular file (a FIFO would block the map, a directory
    cannot be mapped); anything out of bounds is one line. The parse is cached per file as it is
    now (device, inode, size, mtime): load_gguf and the tokenizer share one."""
    p = Path(path)
    if name_problem(p):
        raise CheckpointError(f"{shown(p)}: {name_problem(p)}")
    if check_regular(p, "expected a GGUF file", CheckpointError) == 0:
        raise CheckpointError(f"{shown(p)}: empty file (expected a GGUF file)")
    st = os.stat(p)
    return _parsed(str(p), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, *identity: int) -> GGUFFile:
    try:
        fd = open_fd(path)
    except OSError as e:
        raise CheckpointError(f"{shown(path)}: cannot read: {os_reason(e)}") from None
    try:
        return GGUFFile(Path(path), fd)
    except (OSError, ValueError) as e:  # mmap of a file that shrank, or one the OS cannot map
        raise CheckpointError(f"{shown(path)}: cannot map the file ({e})") from None
    finally:
        os.close(fd)
