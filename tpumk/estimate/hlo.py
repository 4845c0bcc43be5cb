"""Reading the text of a compiled HLO module: computations, instructions and array shapes.

`parse_hlo(text)` splits a module (as `compiled.as_text()` prints it after optimisation) into its
computations, each a list of `HloInstr` (name, result type, opcode, operands, attributes), and
names the ENTRY computation. `parse_shapes` reads every array in a type string (a tuple gives
several) with its element type, dimensions and memory space (`S(n)` in the layout; 0 = HBM).
The helpers read what the costing needs from one instruction: the computation a fusion calls,
a while loop's known trip count, a dot / convolution's contraction length.

This module only reads text; what an op costs is tpumk's timeline model (tpumk.estimate.timeline).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

# Bytes per element of each HLO element type.
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")


@dataclass(frozen=True)
class ArrayShape:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int  # 0 = HBM; 1 = VMEM; others (SMEM, sync flags) are on chip too

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def in_hbm(self) -> bool:
        return self.memory_space == 0


def parse_shapes(text: str) -> list[ArrayShape]:
    """Every array shape in an HLO type string (a tuple gives several), with its memory space."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(ArrayShape(dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
    return out


@dataclass
class HloInstr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool
    args: str = ""  # the raw text inside the op's parentheses (a parameter's index)

    @property
    def shapes(self) -> list[ArrayShape]:
        return parse_shapes(self.type_text)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(\"[^\"]*\"|%?[\w.\-]+|\{{[^}}]*\}})", self.attrs)
        return m.group(1).strip('"') if m else None

    def backend_config(self) -> dict[str, Any]:
        i = self.attrs.find("backend_config=")
        if i < 0:
            return {}
        try:
            return json.JSONDecoder().raw_decode(self.attrs[i + len("backend_config="):])[0]
        except ValueError:
            return {}


def _split_type(rest: str) -> tuple[str, str]:
    """'(f32[2]{0}, s32[]) op(...' -> (type, 'op(...'); handles nested tuple parentheses."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    sp = rest.find(" ")
    return rest[:sp], rest[sp + 1:].lstrip()


def _parse_instr(line: str) -> HloInstr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    type_text, rest = _split_type(m.group(3))
    p = rest.find("(")
    if p < 0:
        return None
    opcode = rest[:p]
    depth, end = 0, len(rest)
    for i in range(p, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            end = i
            break
    operands = re.findall(r"%([^\s,()]+)", rest[p + 1:end])
    return HloInstr(m.group(2), type_text, opcode, operands, rest[end + 1:], bool(m.group(1)), rest[p + 1:end])


def parse_hlo(text: str) -> tuple[dict[str, list[HloInstr]], str]:
    """(computations by name, the entry computation's name) of an HLO module's text."""
    comps: dict[str, list[HloInstr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[current].append(ins)
    if not entry:
        raise ValueError("HLO text has no ENTRY computation")
    return comps, entry


# ---------------------------------------------------------------------- reading one instruction
def called_computation(i: HloInstr) -> str:
    """The computation a fusion (or async-start) calls, without its %; "" when none."""
    c = i.attr("calls")
    return c.lstrip("%") if c else ""


def trip_count(i: HloInstr) -> int | None:
    """A while loop's trip count when XLA knows it (backend_config known_trip_count), else None."""
    n = i.backend_config().get("known_trip_count", {}).get("n")
    return int(n) if n is not None else None


def contracting_length(i: HloInstr, a: ArrayShape, b: ArrayShape) -> int:
    """Contraction length of a dot / convolution (matmuls lowered to convolutions included;
    spatial windows used as batching tricks are not counted as extra work)."""
    if i.opcode == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", i.attrs)
        idx = [int(d) for d in dims.group(1).split(",") if d] if dims else []
        return math.prod(a.dims[d] for d in idx) if idx else 1
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->", i.attrs)
    if not labels:
        return 1
    kernel = labels.group(2)
    return b.dims[kernel.index("i")] if "i" in kernel and len(b.dims) == len(kernel) else 1
