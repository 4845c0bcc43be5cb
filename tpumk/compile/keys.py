"""Content-addressed cache keys for builds: sha256 over everything that computed the value.

The key covers the model config, the target and its topology, the step shapes, the tuning
knobs, the source of the code that computed the value, the jax / jaxlib / libtpu versions
and the compile settings (`compile_flags`: the environment libtpu and XLA read, and every
JAX option that changes what JAX traces, lowers, exports or asks XLA to compile). It is computed from files and metadata only (no JAX backend, no
compile), so CI can ask for it in about a second. The encoding is canonical JSON (sorted keys,
no whitespace, floats by repr), so the same inputs give the same key in any process on any
machine.

Source: no hand-kept list of files (a list goes stale the day someone moves code or adds a
module, and then a cache serves values computed by other code). `source_inputs(entry)` reads
the package's import graph from the source (`ast`: every import, lazy ones inside functions
included) and takes the *units* reachable from an entry module: a unit is a subpackage
(`tpumk/model/`, with its package data such as the presets' TOML) or a top-level module
(`tpumk/targets.py`). Every file of those units is hashed, sorted by path. Whole units, not
single modules: a unit's modules may load each other dynamically or read its data files, and
the import rule of the package (tests/test_layout.py) is stated per unit too. The package
root (`tpumk/__init__.py`) runs on every import of tpumk, so it is always hashed and its
module-level imports followed; the imports inside its lazy `__getattr__` (the public serving
API, `tpumk.load`) are followed only when a reached module uses that API (`import tpumk`, or
`from tpumk import <not a unit>` other than `__version__`).

- the build / artifact key (`key_inputs`) covers the closure of `tpumk.export.artifacts`, the
  code path that builds, compiles and writes an artifact (compile, kernel, plan, model,
  targets, estimate for the build report, ...), and not the CLI, the tuner or decoding;
- the tuner's result cache adds the closure of its trial evaluation (tpumk.tune.cache).

The inputs record which units were hashed (readable) and the digest. Parsing is cached by file
content, so a process asking again pays for reading and hashing the files only.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from tpumk.plan.spec import BuildSpec

PACKAGE = "tpumk"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../tpumk
# The code path of a build artifact: its closure decides the executable and the manifest.
ARTIFACT_ENTRY = "tpumk.export.artifacts"
# Bump when the artifact layout or what the key covers changes (old keys then miss, never collide).
# 2: source by import closure of whole units (was: a hand-kept list of files).
# 3: the JAX options that change the program (`jax_options`), TPU_MEGACORE.
KEY_SCHEMA = 3
# libtpu flags that only write reports beside a compile and do not change the executable: left
# out of the key (the static-profile dump, tpumk.estimate.static_profile).
PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
# Environment variables libtpu and XLA read that change the executable: libtpu's and XLA's
# compiler flags, and libtpu's megacore mode (how a chip's TensorCores are used). The other
# TPU_* variables libtpu reads name the host's chips and workers, logging and runtime buffers:
# a deviceless compile names its topology itself (tpumk.targets), so they do not reach the
# program; tpumk's own defaults for them (tpumk._env) are among those. JAX_* variables are
# covered by their effect, the options' values (`jax_options`).
COMPILE_ENV = ("LIBTPU_INIT_ARGS", "XLA_FLAGS", "TPU_MEGACORE")
# JAX options that change the program beyond the ones JAX keys its own traces on
# (`trace_context_names()`: x64, matmul precision, Shardy, PRNG, dtype promotion, ...): the
# options JAX passes to XLA's compile (optimisation effort and levels, the remat pass), the
# source locations written into the exported StableHLO, the PRNG implementation, and the export
# format versions.
JAX_COMPILE_OPTIONS = (
    "jax_exec_time_optimization_effort", "jax_memory_fitting_effort", "jax_optimization_level",
    "jax_memory_fitting_level", "jax_compiler_enable_remat_pass", "jax_include_full_tracebacks_in_locations",
    "jax_traceback_in_locations_limit", "jax_hlo_source_file_canonicalization_regex", "jax_default_prng_impl",
    "jax_enable_custom_prng", "jax_legacy_prng_key", "jax_serialization_version",
    "jax_export_calling_convention_version", "jax_persistent_cache_enable_xla_caches",
)
ROOT = PACKAGE  # the unit name of the package root, tpumk/__init__.py


# ---------------------------------------------------------------------- source closure
def _skip(path: Path) -> bool:
    """Files that are not source: bytecode caches, editor and OS dot-files and dot-directories."""
    return ("__pycache__" in path.parts or path.suffix in (".pyc", ".pyo")
            or any(part.startswith(".") for part in path.parts))


def _unit_of(module: str, package_dir: Path) -> str | None:
    """The unit a module (absolute, dotted) belongs to: `tpumk.model.config` -> `tpumk.model`;
    the root for `tpumk` itself; None outside the package or for a name that is not a module
    file or package of it (an attribute of the root, e.g. `tpumk.__version__`)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return ROOT
    name = parts[1]
    if (package_dir / name).is_dir() or (package_dir / f"{name}.py").is_file():
        return f"{PACKAGE}.{name}"
    return None


def _unit_files(unit: str, package_dir: Path) -> list[Path]:
    if unit == ROOT:
        return [package_dir / "__init__.py"]
    name = unit.split(".", 1)[1]
    d = package_dir / name
    if d.is_dir():
        return sorted(p for p in d.rglob("*") if p.is_file() and not _skip(p.relative_to(package_dir)))
    return [package_dir / f"{name}.py"]


def _module_name(path: Path, package_dir: Path) -> str:
    rel = path.relative_to(package_dir.parent).with_suffix("")
    return ".".join(p for p in rel.parts if p != "__init__")


@functools.lru_cache(maxsize=4096)
def _imports(source: bytes, module: str, is_package: bool) -> tuple[tuple[str, bool, bool], ...]:
    """Every module name a source imports, absolute, as (name, lazy: inside a function, bare:
    `import NAME` rather than `from NAME import ...`). `from a import b` gives `a` and `a.b`
    (b may be a module); relative imports are resolved against `module`;
    `importlib.import_module("...")` with a literal name counts as a bare import. Cached by
    content, so an unchanged file is parsed once per process."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()  # hashed all the same; a module that does not parse imports nothing
    here = module.split(".") if is_package else module.split(".")[:-1]
    out: list[tuple[str, bool, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, lazy, True) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here[:len(here) - child.level + 1] if child.level <= len(here) else []
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod:
                    out.append((mod, lazy, False))
                    out.extend((f"{mod}.{a.name}", lazy, False) for a in child.names if a.name != "*")
            elif (isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str)
                  and ((isinstance(child.func, ast.Attribute) and child.func.attr == "import_module")
                       or (isinstance(child.func, ast.Name) and child.func.id in ("import_module", "__import__")))):
                out.append((child.args[0].value, lazy, True))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return tuple(dict.fromkeys(out))


def _package_dir(package_dir: str | Path | None) -> Path:
    return Path(package_dir).resolve() if package_dir is not None else PACKAGE_DIR


def source_closure(entries: Iterable[str], package_dir: str | Path | None = None) -> list[str]:
    """The units reachable from the entry modules, sorted (the root always among them)."""
    pkg = _package_dir(package_dir)
    todo = [u for u in (_unit_of(e, pkg) for e in entries) if u is not None] + [ROOT]
    seen: set[str] = set()
    root_api = False  # a reached module may use the root's lazy API (tpumk.load, tpumk.pack_weights)
    root_api_followed = False
    while todo or (root_api and not root_api_followed):
        if not todo:
            root_api_followed = True
            todo = [u for name, lazy, _ in _imports((pkg / "__init__.py").read_bytes(), PACKAGE, True)
                    for u in [_unit_of(name, pkg)] if lazy and u is not None]
            continue
        unit = todo.pop()
        if unit in seen:
            continue
        seen.add(unit)
        for path in _unit_files(unit, pkg):
            if path.suffix != ".py":
                continue
            for name, lazy, bare in _imports(path.read_bytes(), _module_name(path, pkg), path.name == "__init__.py"):
                if name.split(".")[0] != PACKAGE:
                    continue
                if unit == ROOT:
                    if not lazy:  # the root's lazy API is followed below, if something uses it
                        todo.extend(u for u in [_unit_of(name, pkg)] if u is not None)
                    continue
                target = _unit_of(name, pkg)
                if target is not None:
                    todo.append(target)
                    root_api |= bare and name == PACKAGE  # `import tpumk`: may call tpumk.load
                elif name != f"{PACKAGE}.__version__":
                    root_api = True  # `from tpumk import load`
    return sorted(seen)


def source_files(units: Iterable[str], package_dir: str | Path | None = None) -> list[Path]:
    pkg = _package_dir(package_dir)
    return sorted({p for u in units for p in _unit_files(u, pkg)}, key=lambda p: p.relative_to(pkg).as_posix())


def source_digest(units: Iterable[str], package_dir: str | Path | None = None) -> str:
    """sha256 over every file of the units: its path under the package's parent, its length,
    its bytes; sorted by path, so the same tree gives the same digest wherever it lives."""
    pkg = _package_dir(package_dir)
    h = hashlib.sha256()
    for p in source_files(units, pkg):
        data = p.read_bytes()
        h.update(p.relative_to(pkg.parent).as_posix().encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def source_inputs(*entries: str, package_dir: str | Path | None = None) -> dict[str, Any]:
    """What a key records about the code behind a value: the entry modules, the units hashed
    (readable) and their digest."""
    units = source_closure(entries, package_dir)
    return {"entry": list(entries), "units": units, "sha256": source_digest(units, package_dir)}


# ---------------------------------------------------------------------- environment
def stack_versions() -> dict[str, str]:
    import tpumk

    out = {"tpumk": tpumk.__version__}
    for dist in ("jax", "jaxlib", "libtpu"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def compile_flags() -> dict[str, str]:
    """Compiler-relevant environment (COMPILE_ENV), minus the static-profile dump flag (it only
    writes a report next to the compile and does not change the executable)."""
    out = {}
    for var in COMPILE_ENV:
        v = os.environ.get(var)
        if var == "LIBTPU_INIT_ARGS" and v:
            v = re.sub(re.escape(PROFILE_FLAG) + r"=\S+", "", v).strip()
        if v:
            out[var] = " ".join(v.split())
    return out


def jax_option_names() -> list[str]:
    """The JAX options that change the program: those JAX itself keys its traces and jit cache
    on (so no list here goes stale when JAX adds one) and JAX_COMPILE_OPTIONS; only the ones
    this JAX defines."""
    from jax._src import config as jc

    try:
        traced = list(jc.trace_context_names())
    except NotImplementedError:  # older jaxlib: the compile options and the well-known traced ones
        traced = ["jax_enable_x64", "jax_default_matmul_precision", "jax_use_shardy_partitioner",
                  "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion", "jax_threefry_partitionable"]
    defined = jc.config._value_holders
    return sorted({n for n in traced + list(JAX_COMPILE_OPTIONS) if n in defined})


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)
    return str(getattr(v, "name", v))  # enums, dtypes, precision objects


def jax_options() -> dict[str, Any]:
    """The values the JAX options that change the program have in this process (set by their
    JAX_* environment variables, jax.config.update or a context manager), by name."""
    from jax._src import config as jc

    return {name: _plain(jc.config._read(name)) for name in jax_option_names()}


# ---------------------------------------------------------------------- the key
XLA_SPMD = "xla-spmd"  # the program kind of a cpu artifact over several devices (program_kind)


def program_kind(spec: BuildSpec) -> str:
    """What an artifact of `spec` holds: "megakernel" (the Pallas step), or for a `cpu` build over
    several devices "xla-spmd", the same build's XLA decode step sharded over the devices
    (tpumk.model.xla_spmd): the megakernel's in-kernel collectives run only in Pallas' TPU
    interpreter, whose host callbacks neither serialize nor run across processes."""
    return XLA_SPMD if spec.target.interpret and spec.devices > 1 and spec.draft is None else "megakernel"


def key_inputs(spec: BuildSpec) -> dict[str, Any]:
    """Everything the key covers, as plain data (also stored in artifact manifests); a build
    without a drafter has no "draft" entry, and a megakernel artifact no "program" entry: their
    inputs are the ones they always had."""
    target = spec.target
    kind = program_kind(spec)
    return {
        "schema": KEY_SCHEMA,
        "model": spec.model.to_dict(),
        "target": {"name": target.name, "chip": target.chip, "topology": target.topology,
                   "interpret": target.interpret},
        "shapes": spec.shapes(),
        "tuning": spec.tuning.to_dict(),
        "source": source_inputs(ARTIFACT_ENTRY),
        "versions": stack_versions(),
        "compile_flags": compile_flags(),
        "jax_options": jax_options(),
        # a speculative round program: the drafter (kind, shapes, taps, block), its weights'
        # content hash or random seed, rounds per call and temperature (tpumk.draft.rounds.RoundSpec)
        **({"draft": spec.draft.to_dict()} if spec.draft is not None else {}),
        **({"program": kind} if kind != "megakernel" else {}),
    }


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(inputs)).hexdigest()


def key_for(spec: BuildSpec) -> str:
    return cache_key(key_inputs(spec))
