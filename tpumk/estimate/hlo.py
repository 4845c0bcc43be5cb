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

import numpy as np

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
    pending = ""
    for line in text.splitlines():
        if pending:
            line, pending = pending + " " + line, ""
        if current is not None and _unclosed(line):
            # An attribute runs onto the next lines (a many-device Pallas kernel's
            # frontend_attributes={kernel_metadata={<newline>"mesh_axes":...<newline>}}): its last
            # line starts with "}", which is not the computation's end.
            pending = line
            continue
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


def _unclosed(line: str) -> bool:
    """Whether a line of an instruction leaves a brace open (quoted strings ignored)."""
    if "{" not in line:
        return False
    bare = re.sub(r'"[^"]*"', "", re.sub(r"\\.", "", line))
    return bare.count("{") > bare.count("}")


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


def replica_group(i: HloInstr) -> tuple[int, ...] | None:
    """The device ids of a collective's first replica group, in any of the forms XLA prints:
    `{{0,2},{1,3}}`, the iota form `[groups,size]<=[dims]` (with an optional `T(perm)`), and
    the mesh form `mesh['axis_0'=2,'axis_1'=4] {'axis_0'}` (ids laid out row-major over the
    mesh axes; a group varies the named axes, the others at 0). A collective-permute's
    `source_target_pairs` give the ids they name. None when the groups are empty (every
    device of the program) or absent. Ids are partition ids (mesh positions) in SPMD programs."""
    a = i.attrs
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", a)
    if m:
        axes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        named = set(re.findall(r"'([^']+)'", m.group(2)))
        if not named:
            return None
        ids = np.arange(math.prod(v for _, v in axes)).reshape([v for _, v in axes])
        return tuple(int(x) for x in ids[tuple(slice(None) if k in named else 0 for k, _ in axes)].ravel())
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", a)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        ids = np.arange(math.prod(int(d) for d in m.group(2).split(","))).reshape([int(d) for d in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return tuple(int(x) for x in ids.reshape(shape[0], -1)[0])
    m = re.search(r"replica_groups=\{\{([0-9,\s]*)\}", a)
    if m:
        return tuple(int(d) for d in m.group(1).split(",") if d.strip())
    pairs = source_target_pairs(i)
    if pairs:
        return tuple(sorted({d for p in pairs for d in p}))
    return None

def source_target_pairs(i: HloInstr) -> list[tuple[int, int]]:
    """A collective-permute's (source, target) device pairs; [] when it has none."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", i.attrs)
    return [(int(s), int(t)) for s, t in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []


def called_computations(i: HloInstr) -> list[str]:
    """Every computation an instruction runs as its body (`calls=`, `called_computations={...}`),
    without the %; not the reduction functions of `to_apply=`."""
    out = [called_computation(i)] if called_computation(i) else []
    m = re.search(r"called_computations=\{([^}]*)\}", i.attrs)
    if m:
        out += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    return out
