"""Content-addressed cache keys for builds: sha256 over everything that changes the executable.

The key covers the model config, the target and its topology, the step shapes, the tuning
knobs, the source of every tpumk module that shapes the kernel, the jax / jaxlib / libtpu
versions and the compile flags. It is computed from files and metadata only (no JAX backend,
no compile), so CI can ask for it in about a second. The encoding is canonical JSON (sorted
keys, no whitespace, floats by repr), so the same inputs give the same key in any process on
any machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from tpumk.plan.spec import BuildSpec

PACKAGE_DIR = Path(__file__).resolve().parent
# Modules whose source decides the compiled program. Reports, CLI, tuner and export code do not.
KERNEL_SOURCES = ("config.py", "plan.py", "tuning.py", "reference.py", "targets.py", "compile.py",
                  "build.py", "kernel/*.py")
# Bump when the artifact layout or what the key covers changes (old keys then miss, never collide).
KEY_SCHEMA = 1
# libtpu flags that only write reports beside a compile and do not change the executable: left
# out of the key (the static-profile dump, tpumk.estimate.static_profile).
PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"
# Environment variables that feed the compiler.
COMPILE_ENV = ("LIBTPU_INIT_ARGS", "XLA_FLAGS", "JAX_ENABLE_X64", "JAX_DEFAULT_MATMUL_PRECISION")


def kernel_source_digest() -> str:
    h = hashlib.sha256()
    files = sorted({p for pattern in KERNEL_SOURCES for p in PACKAGE_DIR.glob(pattern)})
    for p in files:
        h.update(p.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


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
    """Compiler-relevant environment, minus the static-profile dump flag (it only writes a
    report next to the compile and does not change the executable)."""
    out = {}
    for var in COMPILE_ENV:
        v = os.environ.get(var)
        if var == "LIBTPU_INIT_ARGS" and v:
            v = re.sub(re.escape(PROFILE_FLAG) + r"=\S+", "", v).strip()
        if v:
            out[var] = " ".join(v.split())
    return out


def key_inputs(spec: BuildSpec) -> dict[str, Any]:
    """Everything the key covers, as plain data (also stored in artifact manifests)."""
    target = spec.target
    return {
        "schema": KEY_SCHEMA,
        "model": spec.model.to_dict(),
        "target": {"name": target.name, "chip": target.chip, "topology": target.topology,
                   "interpret": target.interpret},
        "shapes": spec.shapes(),
        "tuning": spec.tuning.to_dict(),
        "kernel_source_sha256": kernel_source_digest(),
        "versions": stack_versions(),
        "compile_flags": compile_flags(),
    }


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def cache_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(inputs)).hexdigest()


def key_for(spec: BuildSpec) -> str:
    return cache_key(key_inputs(spec))
