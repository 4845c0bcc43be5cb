"""Exported build artifacts: a compiled decode step on disk, content-addressed by its cache key.

`export(cfg, target, batch, context, tuning, q_len, page_size, out_dir)` writes
`out_dir/<model>/<target>/<key>/` (built in a temporary directory, then os.rename'd into
place, so a reader never sees half an artifact):

    executable.bin        jax.experimental.serialize_executable.serialize(compiled)[0]: the
                          compiled program (deviceless TPU compile); loading it needs a TPU
                          of that kind
    executable_trees.pkl  the (in_tree, out_tree) pytree definitions serialize() returns
    exported.bin          jax.export.export(jit(step), platforms=[...]).serialize(): the portable
                          StableHLO (tpu_custom_call is a stable custom call); any host
                          deserializes it, it runs on the platform it names
    manifest.toml         model, target, shapes, tuning, the cache-key inputs (exact, as
                          canonical JSON, plus readable tables), stack versions, the build
                          report, input/output signatures and the sha256 of every file above

A `cpu`-target artifact holds only the manifest: the interpret-mode kernel calls back into
Python on the host, which neither serializer accepts in jax 0.10.2 (the reasons are recorded in
the manifest); loading it rebuilds the step from the manifest's settings, and only while the
kernel source hashes as it did at export.

An existing key is a cache hit: nothing is compiled. `load(path)` checks the manifest, every
file's sha256 and the stack versions, then returns a `DecodeStep`:
step(packed, tokens, positions, cache) -> (logits, cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from tpumk.cache_key import cache_key, canonical, key_inputs, stack_versions
from tpumk.config import ModelConfig
from tpumk.errors import ArtifactError
from tpumk.plan import DEFAULT_PAGE_SIZE
from tpumk.targets import Target, get_target
from tpumk.tuning import TuningConfig

FORMAT = 1
MANIFEST = "manifest.toml"
EXECUTABLE = "executable.bin"
EXECUTABLE_TREES = "executable_trees.pkl"
EXPORTED = "exported.bin"
PAYLOAD = (EXECUTABLE, EXECUTABLE_TREES, EXPORTED)

_registered = False


def _register_pytrees() -> None:
    """jax.export serializes pytree structure by name; the cache is a NamedTuple."""
    global _registered
    if _registered:
        return
    from jax import export as jexport

    from tpumk.reference import KVCache

    try:
        jexport.register_namedtuple_serialization(KVCache, serialized_name="tpumk.reference.KVCache")
    except ValueError:  # already registered (module reloaded)
        pass
    _registered = True


# ---------------------------------------------------------------------- small helpers
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _without_none(v: Any) -> Any:
    """TOML has no null: None values are left out (exact values that need None live in the
    manifest's canonical JSON strings)."""
    if isinstance(v, dict):
        return {str(k): _without_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [_without_none(x) for x in v if x is not None]
    return v


def to_toml(doc: dict[str, Any]) -> str:
    return tomli_w.dumps(_without_none(doc))


def _signature(tree: Any) -> list[dict[str, Any]]:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [{"path": jax.tree_util.keystr(p), "shape": list(x.shape), "dtype": str(x.dtype)} for p, x in leaves]


# ---------------------------------------------------------------------- export
@dataclass
class ExportResult:
    path: Path
    key: str
    cache_hit: bool
    seconds: float
    manifest: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "key": self.key, "cache_hit": self.cache_hit, "seconds": self.seconds}


def artifact_path(out_dir: str | Path, cfg: ModelConfig, target: Target, key: str) -> Path:
    return Path(out_dir) / cfg.name / target.name / key


def export(cfg: ModelConfig, target: Target, batch: int = 1, context: int = 4096, tuning: TuningConfig | None = None,
           q_len: int = 1, page_size: int = DEFAULT_PAGE_SIZE, out_dir: str | Path = "artifacts",
           estimate: bool = False) -> ExportResult:
    """Build and write the artifact, or find it already there (cache hit: compiles nothing)."""
    t0 = time.perf_counter()
    tuning = tuning or TuningConfig()
    inputs = key_inputs(cfg, target, batch, context, q_len, page_size, tuning)
    key = cache_key(inputs)
    final = artifact_path(out_dir, cfg, target, key)
    if (final / MANIFEST).exists():
        manifest = verify(final)
        return ExportResult(final, key, True, time.perf_counter() - t0, manifest)

    import jax
    from jax import export as jexport
    from jax.experimental import serialize_executable

    from tpumk.build import make_report, plan_build
    from tpumk.compile import compile_for
    from tpumk.estimate import estimate_in_subprocess, request_for
    from tpumk.kernel.megakernel import make_decode_step, step_specs

    _register_pytrees()
    plan = plan_build(cfg, target, batch, context, tuning, q_len, page_size)  # PlanError before compiling
    specs = step_specs(plan)
    compiled = compile_for(make_decode_step(plan, donate_cache=True), specs, target)
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled.compiled)
        executable_note = "serialized"
    except Exception as e:  # the cpu target's interpret mode holds Python host callbacks
        blob = None
        executable_note = f"not serializable: {type(e).__name__}: {str(e).splitlines()[0]}"
    platform = "cpu" if target.interpret else "tpu"
    t1 = time.perf_counter()
    try:
        exported = jexport.export(make_decode_step(plan), platforms=[platform])(*specs)
        export_note = "serialized"
    except NotImplementedError as e:  # cpu target: interpret mode lowers to host callbacks
        exported = None
        export_note = f"not serializable: {str(e).splitlines()[0]}"
    export_seconds = time.perf_counter() - t1
    est = None
    if estimate and target.static_profile:
        est = estimate_in_subprocess(request_for(cfg, target, batch, context, tuning, q_len, page_size),
                                     target.vmem_bytes)
    report = make_report(plan, compiled, est)

    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=parent))
    try:
        if blob is not None:
            (tmp / EXECUTABLE).write_bytes(blob)
            (tmp / EXECUTABLE_TREES).write_bytes(pickle.dumps((in_tree, out_tree)))
        if exported is not None:
            (tmp / EXPORTED).write_bytes(bytes(exported.serialize()))
        files = [n for n in PAYLOAD if (tmp / n).exists()]
        out_specs = jax.eval_shape(make_decode_step(plan), *specs)
        manifest = {
            "format": FORMAT,
            "key": key,
            "created_unix": int(time.time()),
            "model": {k: v for k, v in cfg.to_dict().items()},
            "target": {"name": target.name, "chip": target.chip, "topology": target.topology or "",
                       "device_kind": compiled.device_kind, "interpret": target.interpret,
                       "export_platform": platform, "executable": executable_note,
                       "exported": export_note},
            "shapes": {"batch": batch, "context": context, "q_len": q_len, "page_size": page_size},
            "tuning": tuning.to_dict(),
            "versions": stack_versions(),
            "cache_key": {"key": key, "inputs_json": canonical(inputs).decode()},
            "report": {k: v for k, v in report.to_dict().items() if k != "plan"},
            "report_json": json.dumps(report.to_dict(), sort_keys=True, default=str),
            "timings": {"export_seconds": export_seconds},
            "signature": {"inputs_json": json.dumps(_signature(specs)),
                          "outputs_json": json.dumps(_signature(out_specs)),
                          "exported_in_avals": [str(a) for a in exported.in_avals] if exported else [],
                          "exported_out_avals": [str(a) for a in exported.out_avals] if exported else []},
            "files": {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
                      for name in files},
        }
        (tmp / MANIFEST).write_text(to_toml(manifest))
        for f in tmp.iterdir():  # durable before it becomes visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, final)
        except OSError:
            if (final / MANIFEST).exists():  # another process published the same key first
                shutil.rmtree(tmp, ignore_errors=True)
                return ExportResult(final, key, True, time.perf_counter() - t0, verify(final))
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(final, key, False, time.perf_counter() - t0, read_manifest(final))


# ---------------------------------------------------------------------- verify / load
def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: not an artifact directory (no such directory)")
    mf = path / MANIFEST
    if not mf.is_file():
        raise ArtifactError(f"{path}: not an artifact directory (no {MANIFEST})")
    try:
        m = tomllib.loads(mf.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mf}: malformed manifest: {str(e).splitlines()[0]}") from None
    for field in ("format", "key", "target", "versions", "cache_key", "files", "shapes", "tuning", "model"):
        if field not in m:
            raise ArtifactError(f"{mf}: malformed manifest: missing '{field}'")
    if m["format"] != FORMAT:
        raise ArtifactError(f"{mf}: artifact format {m['format']}, this tpumk reads format {FORMAT}")
    return m


def verify(path: str | Path, check_versions: bool = True) -> dict[str, Any]:
    """Manifest well-formed, key consistent, every file present with its sha256, same stack."""
    path = Path(path)
    m = read_manifest(path)
    try:
        inputs = json.loads(m["cache_key"]["inputs_json"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise ArtifactError(f"{path / MANIFEST}: malformed manifest: bad cache_key.inputs_json") from None
    if cache_key(inputs) != m["key"]:
        raise ArtifactError(f"{path / MANIFEST}: cache key {m['key'][:12]}... does not match its own inputs "
                            "(manifest altered)")
    if not m["target"].get("interpret") and not {EXECUTABLE, EXPORTED} <= set(m["files"]):
        raise ArtifactError(f"{path / MANIFEST}: malformed manifest: a TPU artifact lists no sha256 for "
                            f"{EXECUTABLE} and {EXPORTED}")
    for name, entry in sorted(m["files"].items()):
        if name not in PAYLOAD or not isinstance(entry, dict) or "sha256" not in entry:
            raise ArtifactError(f"{path / MANIFEST}: malformed manifest: bad files entry '{name}'")
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"{f}: missing file of artifact {m['key'][:12]}")
        size = f.stat().st_size
        if size != entry.get("bytes", size):
            raise ArtifactError(f"{f}: {size} bytes, manifest says {entry['bytes']} (truncated or altered)")
        got = sha256_file(f)
        if got != entry["sha256"]:
            raise ArtifactError(f"{f}: sha256 {got[:12]}... does not match the manifest's "
                                f"{entry['sha256'][:12]}... (altered)")
    if check_versions:
        have = stack_versions()
        for dist, want in sorted(m["versions"].items()):
            if have.get(dist) != want:
                raise ArtifactError(f"{path}: built with {dist} {want}, this environment has {dist} "
                                    f"{have.get(dist, 'not installed')} (re-export)")
    return m


def config_of(m: dict[str, Any]) -> tuple[ModelConfig, Target, TuningConfig]:
    from tpumk.config import from_dict

    inputs = json.loads(m["cache_key"]["inputs_json"])
    return (from_dict(inputs["model"], "artifact manifest"), get_target(m["target"]["name"]),
            TuningConfig.from_dict(inputs["tuning"], "artifact manifest"))


class DecodeStep:
    """A loaded artifact: step(packed, tokens, positions, cache) -> (logits, cache)."""

    def __init__(self, path: Path, manifest: dict[str, Any], fn, kind: str):
        self.path, self.manifest, self._fn, self.kind = path, manifest, fn, kind
        self.batch = manifest["shapes"]["batch"]
        self.q_len = manifest["shapes"]["q_len"]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    def __call__(self, packed, tokens, positions, cache):
        b, t = tokens.shape
        if (b, t) != (self.batch, self.q_len):
            raise ArtifactError(f"artifact {self.key[:12]} takes tokens [{self.batch}, {self.q_len}], got [{b}, {t}]")
        return self._fn(packed, tokens, positions, cache)

    def __repr__(self) -> str:
        return f"DecodeStep({self.path}, {self.kind})"


def load(path: str | Path) -> DecodeStep:
    """Verify the artifact and make it callable on this host.

    cpu target: the portable export (jax.export.deserialize(...).call), which runs on CPU.
    TPU targets: the serialized executable, loaded onto an attached TPU of the artifact's kind
    (ArtifactError if none is attached; the portable export stays usable through
    `load_exported`)."""
    path = Path(path)
    m = verify(path)
    target = get_target(m["target"]["name"])
    if target.interpret:
        if EXPORTED in m["files"]:
            return DecodeStep(path, m, load_exported(path, verified=True).call, "exported (cpu)")
        return _rebuild(path, m)
    if EXECUTABLE not in m["files"]:
        raise ArtifactError(f"{path}: no executable in this artifact ({m['target'].get('executable', '')})")
    if not target.is_attached():
        raise ArtifactError(f"{path}: the executable is for {target.name} ({target.device_kind}), "
                            "which is not attached to this host")
    from jax.experimental import serialize_executable

    _register_pytrees()
    in_tree, out_tree = pickle.loads((path / EXECUTABLE_TREES).read_bytes())  # sha256-verified above
    compiled = serialize_executable.deserialize_and_load((path / EXECUTABLE).read_bytes(), in_tree, out_tree,
                                                         backend="tpu")
    return DecodeStep(path, m, compiled, f"executable ({target.name})")


def _rebuild(path: Path, m: dict[str, Any]) -> DecodeStep:
    """cpu artifacts of this stack hold no program: Pallas TPU interpret mode lowers to Python
    host callbacks, which neither serialize_executable nor jax.export can serialize. The step is
    re-traced from the manifest's recipe, and only if the kernel sources are the ones the key
    was computed from (otherwise it would silently be a different program)."""
    from tpumk.build import plan_build
    from tpumk.cache_key import kernel_source_digest
    from tpumk.kernel.megakernel import make_decode_step

    inputs = json.loads(m["cache_key"]["inputs_json"])
    if inputs.get("kernel_source_sha256") != kernel_source_digest():
        raise ArtifactError(f"{path}: cpu artifact was built from other tpumk kernel sources (its program is "
                            "re-traced on load, so the sources must match; re-export)")
    cfg, target, tuning = config_of(m)
    sh = m["shapes"]
    plan = plan_build(cfg, target, sh["batch"], sh["context"], tuning, sh["q_len"], sh["page_size"])
    return DecodeStep(path, m, make_decode_step(plan), "re-traced from manifest (cpu interpret mode)")


def load_exported(path: str | Path, verified: bool = False):
    """The portable jax.export.Exported of the artifact."""
    from jax import export as jexport

    path = Path(path)
    m = m if verified and (m := read_manifest(path)) else verify(path)
    if EXPORTED not in m["files"]:
        raise ArtifactError(f"{path}: no portable export in this artifact ({m['target'].get('exported', '')})")
    _register_pytrees()
    try:
        return jexport.deserialize(bytearray((path / EXPORTED).read_bytes()))
    except Exception as e:
        raise ArtifactError(f"{path / EXPORTED}: cannot deserialize: {str(e).splitlines()[0]}") from None


def inspect(path: str | Path) -> dict[str, Any]:
    """The manifest plus what verify says (never raises for a bad artifact: reports it)."""
    path = Path(path)
    out: dict[str, Any] = {"path": str(path)}
    try:
        m = read_manifest(path)
        out.update(key=m["key"], model=m["model"].get("name"), target=m["target"], shapes=m["shapes"],
                   versions=m["versions"], files=m["files"], report=m.get("report", {}))
        verify(path)
        out["valid"], out["problem"] = True, None
    except ArtifactError as e:
        out["valid"], out["problem"] = False, str(e)
    return out
