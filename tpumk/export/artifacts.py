"""Exported build artifacts: a compiled decode step on disk, content-addressed by its cache key.

`export(spec, out_dir="artifacts", estimate=False)` writes `out_dir/<model>/<target>/<key>/` for
a BuildSpec (tpumk.plan.spec) (built in a temporary directory, then os.rename'd into
place, so a reader never sees half an artifact):

    executable.bin   jax.experimental.serialize_executable.serialize(compiled)[0]: the compiled
                     program for the target (deviceless for TPUs); it loads only on a device of
                     that kind with the same jax/jaxlib/libtpu. It is code: loading it runs
                     JAX's deserializer, which unpickles (see "Trust" below)
    exported.bin     jax.export.export(jit(step), platforms=[...]).serialize(): the portable
                     StableHLO of the same step (tpu_custom_call is a stable custom call); any
                     host deserializes it (flatbuffers, no pickle), and it compiles on load for
                     the platform it names
    manifest.toml    model, target, shapes, tuning, the mesh (devices, topology, mesh axis and
                     size, device order, sharding), the cache-key inputs (exact, as canonical
                     JSON, plus readable tables), stack versions, the build report, input/output
                     signatures, whether it is signed and the sha256 of every file above
    manifest.sig     only when signed: HMAC-SHA256 of manifest.toml (tpumk.export.signing)

The executable's input/output pytree structures are not stored as pickles: `load` rebuilds them
from the manifest's plan and checks them against the structures recorded at export.

`cpu`-target artifacts hold real programs too: their kernel runs in Pallas' discharge
interpreter (`interpret=True`: the same kernel lowered to ordinary XLA ops, no host callbacks),
so the portable export runs on any machine's CPU. That interpreter has none of the in-kernel
collectives, so a `cpu` build over several devices ships the same build's XLA SPMD step instead
(`tpumk.compile.keys.program_kind`, `_export_xla_spmd`, `XlaSpmdStep`: docs/artifacts.md).

Many devices (`spec.devices` > 1, TPU targets): both files hold the ONE SPMD program over the
plan's 1-D mesh (`tpumk.kernel.megakernel.step_mesh`), compiled deviceless for the topology
`tpumk.targets.topology_for` names unless that many devices of the kind are attached. The
serialized executable names its devices by id, so `load` runs it on the attached devices with
the recorded ids, in the recorded mesh order, and refuses (one line) a host that lacks them;
the step then takes and returns global arrays on that mesh (`DecodeStep.pack`,
`DecodeStep.shard_cache`, `DecodeStep.shardings`).

An existing key is a cache hit: nothing is compiled. `load(path)` verifies, then returns a
`DecodeStep`: step(packed, tokens, positions, cache) -> (logits, cache).

Trust. `verify` (which `load`, `inspect` and a cache hit run) checks, in this order, before
anything of the artifact is deserialized: the signature of manifest.toml's exact bytes when a
signing key is configured (TPUMK_SIGNING_KEY / TPUMK_SIGNING_KEY_FILE; an unsigned artifact or
another key's is then refused), the manifest's own consistency (every redundant field equals
what its key inputs say, the key is the sha256 of those inputs and the directory's name:
tpumk.export.checks), every file's size and sha256, and the stack versions. `load` then reads
each file once, re-checks its sha256 in memory and deserializes those bytes. Without a key the
hashes prove only that the files match the manifest, not who wrote the manifest. `export` signs
whenever a key is configured. Names that become directories are checked (tpumk.export.paths).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import dataclasses
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from tpumk.compile.keys import XLA_SPMD, cache_key, canonical, key_inputs, program_kind, stack_versions
from tpumk.errors import ConfigError, ArtifactError, ArtifactPathError, SignatureError, TpumkError
from tpumk.files import name_problem, shown
from tpumk.tomlfile import parse_toml
from tpumk.export import checks, paths, signing
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

FORMAT = 5  # 2: cpu artifacts hold programs; no pickled pytrees. 3: [signing] table, manifest.sig.
# 4: [mesh] table (devices, topology, mesh axis, device order, sharding). 5: [loads] table (which
# JAX stack loads which payload: tpumk.export.checks.loads_of). A round artifact (export --draft)
# adds a [draft] table and, for weights read from files, drafter.safetensors: an artifact of
# this format without them reads exactly as before.
MANIFEST = "manifest.toml"
EXECUTABLE = "executable.bin"
EXPORTED = "exported.bin"
DRAFTER = "drafter.safetensors"  # a round artifact's drafter weights (tpumk.draft.weights.params_bytes)
SIGNATURE = signing.SIGNATURE
PAYLOAD = (EXECUTABLE, EXPORTED)
MAX_MANIFEST_BYTES = 16 << 20

_registered = False


def _register_pytrees() -> None:
    """jax.export serializes pytree structure by name; the cache is a NamedTuple (a hybrid's
    carries its state pool, another NamedTuple)."""
    global _registered
    if _registered:
        return
    from jax import export as jexport

    from tpumk.draft.rounds import Carry
    from tpumk.model.kv_quant import PagedLayout
    from tpumk.model.linear_attention import LinearStates
    from tpumk.model.reference import KVCache, QuantizedKVCache
    from tpumk.model.xla_step import XlaCache

    def layout_bytes(aux) -> bytes:  # a quantized cache's static part: its page layout
        return json.dumps(dataclasses.asdict(aux[0]), sort_keys=True).encode()

    def layout_of(data: bytes):
        return (PagedLayout(**json.loads(data)),)

    try:
        jexport.register_namedtuple_serialization(KVCache, serialized_name="tpumk.model.reference.KVCache")
        jexport.register_namedtuple_serialization(LinearStates,
                                                  serialized_name="tpumk.model.linear_attention.LinearStates")
        jexport.register_namedtuple_serialization(Carry, serialized_name="tpumk.draft.rounds.Carry")
        jexport.register_namedtuple_serialization(XlaCache, serialized_name="tpumk.model.xla_step.XlaCache")
        jexport.register_pytree_node_serialization(QuantizedKVCache, serialized_name="tpumk.model.reference.QuantizedKVCache",
                                                   serialize_auxdata=layout_bytes, deserialize_auxdata=layout_of)
    except ValueError:  # already registered (module reloaded)
        pass
    _registered = True


# ---------------------------------------------------------------------- small helpers
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with paths.open_regular_file(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_without_none = checks.without_none


def to_toml(doc: dict[str, Any]) -> str:
    return tomli_w.dumps(_without_none(doc))


# what a manifest of unexpected types or sizes makes the parsers and checks raise (a 5000-digit
# integer, nesting past the recursion limit, a string where a table belongs, a missing name)
MALFORMED = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)


def _malformed(path: Path, e: BaseException) -> str:
    """One line for a MALFORMED exception raised while checking the manifest at `path`."""
    detail = (str(e).splitlines() or [""])[0][:200]
    return f"{path / MANIFEST}: malformed manifest ({type(e).__name__}" + (f": {detail})" if detail else ")")


# ---------------------------------------------------------------------- export
@dataclass
class ExportResult:
    path: Path
    key: str
    cache_hit: bool
    seconds: float
    manifest: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "key": self.key, "cache_hit": self.cache_hit, "seconds": self.seconds,
                "signed": bool(self.manifest.get("signing", {}).get("signed")),
                "devices": self.manifest.get("mesh", {}).get("devices", 1)}


def artifact_path(out_dir: str | Path, spec: BuildSpec, key: str) -> Path:
    """OUT/<model>/<target>/<key>; ArtifactPathError when a name is not one safe path component or
    the path would resolve outside OUT."""
    return paths.artifact_dir(out_dir, spec.model.name, spec.target.name, key)


def _refuse_foreign(final: Path) -> None:
    """An existing directory at the artifact's path that holds no manifest was not published by
    an export (exports rename complete directories into place). It is refused, not replaced:
    it may be someone's data under a wrong --out or a partial copy still being written, and a
    non-empty directory cannot be replaced atomically (rename(2) onto it fails; a two-step swap
    would show readers no artifact in between). An empty directory is replaced by the rename."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise ArtifactPathError(f"{final}: exists and is not an artifact directory; remove it and export again")
    if final.is_dir() and any(final.iterdir()):
        raise ArtifactError(f"{final}: exists without a {MANIFEST} (not published by tpumk export, or a partial "
                            "copy): refusing to replace what tpumk did not write; remove it and export again")


def check_exportable(spec: BuildSpec):
    """The build's plan, after the checks `tpumk build` makes before compiling (the same
    `make_plan`: a spec build refuses gets no key and no artifact, PlanError naming why), and
    ArtifactError (one line saying why) for a build no artifact can hold: a `cpu` build over
    many devices (tpumk.export.checks.unexportable). Plan arithmetic only, no compile."""
    from tpumk.build import plan_of

    why = checks.unexportable(spec.target, spec.devices, spec.draft is not None)
    if not why and program_kind(spec) == XLA_SPMD:
        why = checks.xla_spmd_refusal(spec)
    if why:
        raise ArtifactError(why)
    return plan_of(spec)


def _compiled_mesh(compiled, plan) -> list:
    """The devices of the mesh the executable was compiled for, in mesh order."""
    import jax

    from tpumk.plan.sharding import MESH_AXIS

    mesh = jax.tree.leaves(compiled.compiled.input_shardings)[0].mesh
    if tuple(mesh.axis_names) != (MESH_AXIS,) or mesh.size != plan.devices:
        raise ArtifactError(f"internal: compiled for mesh {dict(mesh.shape)}, the plan's is {MESH_AXIS}={plan.devices}")
    return list(mesh.devices.flat)


def export(spec: BuildSpec, out_dir: str | Path = "artifacts", estimate: bool = False,
           progress=None, draft_params=None) -> ExportResult:
    """Build and write the artifact, or find it already there (cache hit: compiles nothing).
    Signed when a signing key is configured (tpumk.export.signing). `progress(phase)` is called
    as each phase after the checks starts (the CLI prints it: tpumk.cli.progress).

    A round build (`spec.draft`, a RoundSpec) ships its round program instead of the plain step,
    the drafter in the manifest's [draft] table and the key, and `draft_params` (the drafter's
    weights, whose content hash the RoundSpec records) as drafter.safetensors; a random
    drafter's weights are not shipped (its seed remakes them)."""
    say = progress or (lambda phase: None)
    t0 = time.perf_counter()
    cfg, target, tuning = spec.model, spec.target, spec.tuning
    paths.check_names(cfg.name, target.name)  # the directory names first: no plan for a path export refuses
    if program_kind(spec) == XLA_SPMD:  # its refusals, then its host CPU devices, before JAX's backends start
        from tpumk.targets import ensure_host_devices

        if why := checks.xla_spmd_refusal(spec):
            raise ArtifactError(why)
        ensure_host_devices(spec.devices)
    plan = check_exportable(spec)  # refused as `tpumk build` refuses it, before the key and any cache hit
    drafter_blob = _drafter_payload(spec.draft, draft_params)
    sign_key = signing.configured_key()  # a misconfigured key fails before compiling
    inputs = key_inputs(spec)
    key = cache_key(inputs)
    final = artifact_path(out_dir, spec, key)
    if (final / MANIFEST).exists():
        manifest = verify(final)
        return ExportResult(final, key, True, time.perf_counter() - t0, manifest)
    _refuse_foreign(final)
    paths.check_out_dir(out_dir, final.parent)
    if "program" in inputs:  # a cpu build over several devices: the same build's XLA SPMD step
        return _export_xla_spmd(spec, inputs, key, out_dir, final, sign_key, say, t0)

    import jax
    from jax import export as jexport
    from jax.experimental import serialize_executable

    from tpumk.build import make_report
    from tpumk.compat import persistent_cache_bypassed
    from tpumk.compile.aot import compile_for, compile_plan, compile_rounds, round_program, round_specs
    from tpumk.estimate.profiler import estimate_in_subprocess
    from tpumk.kernel.megakernel import make_decode_step, step_specs
    _register_pytrees()
    draft = spec.draft
    settings = draft.settings(plan.context) if draft is not None else None
    specs = step_specs(plan) if draft is None else round_specs(plan, draft.drafter, settings)
    say(f"lower + compile for {target.name}" if draft is None else
        f"lower + compile the round program for {target.name} ({draft.label()})")
    with persistent_cache_bypassed():  # the executable is serialized (tpumk.compat)
        if draft is not None:
            # one program over the plan's mesh, or one device's (portable: the cpu target's kernel
            # without host callbacks; TPU targets ignore it)
            portable = plan.devices == 1
            compiled = compile_rounds(plan, draft.drafter, settings, portable=portable)
            program = jax.jit(round_program(plan, draft.drafter, settings, portable=portable))
            compiled_devices = _compiled_mesh(compiled, plan) if plan.devices > 1 else None
        elif plan.devices == 1:
            # portable: on the cpu target, the discharge interpreter (serializable); TPU targets
            # ignore it. Donate in compile_for's own jit too: a donation inside a nested jit is
            # not honoured, and without it XLA copies both KV caches every step
            compiled = compile_for(make_decode_step(plan, donate_cache=True, portable=True, nested=True), specs,
                                   target, donate_argnums=(3,))
            program = make_decode_step(plan, portable=True, nested=True)
            compiled_devices = None
        else:
            # the SPMD program over the plan's mesh (donating the cache), as `tpumk build` compiles it
            compiled = compile_plan(plan)
            program = make_decode_step(plan, nested=True)
            compiled_devices = _compiled_mesh(compiled, plan)
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled.compiled)
    except Exception as e:
        raise ArtifactError(f"{target.name}: the compiled step cannot be serialized: "
                            f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
    if (in_tree, out_tree) != checks.program_trees(plan, draft):  # load() rebuilds them from the plan
        raise ArtifactError(f"internal: executable pytrees {in_tree} / {out_tree} differ from the plan's")
    platform = checks.export_platform(target.interpret)
    say("jax.export of the " + ("step" if draft is None else "round program") + " (portable program)")
    t1 = time.perf_counter()
    exported = jexport.export(program, platforms=[platform])(*specs)
    export_seconds = time.perf_counter() - t1
    est = None
    if estimate and target.static_profile:
        say("compiler estimate (a profiling compile in its own process)")
        est = estimate_in_subprocess(spec.replace(draft=None))  # a round build's: its verify step
    say("report and files (write to a temporary directory, then rename)")
    report = make_report(plan, compiled, est, draft=draft)
    out_specs = jax.tree.unflatten(exported.out_tree, exported.out_avals)  # (logits, KVCache) or the Carry, of avals

    blobs = {EXECUTABLE: blob, EXPORTED: bytes(exported.serialize())}
    if drafter_blob is not None:
        blobs[DRAFTER] = drafter_blob
    manifest = {
        "format": FORMAT,
        "key": key,
        "created_unix": int(time.time()),
        "model": {k: v for k, v in cfg.to_dict().items()},
        "target": {"name": target.name, "chip": target.chip, "topology": target.topology or "",
                   "device_kind": compiled.device_kind, "interpret": target.interpret,
                   "export_platform": platform, "kernel_mode": checks.KERNEL_MODE[target.interpret]},
        "shapes": spec.shapes(),
        "mesh": checks.mesh_record(plan, compiled_devices),
        **({"draft": checks.without_none(draft.to_dict())} if draft is not None else {}),
        "tuning": spec.tuning.to_dict(),
        "versions": stack_versions(),
        "loads": checks.loads_of(stack_versions()),
        "cache_key": {"key": key, "inputs_json": canonical(inputs).decode()},
        "report": {k: v for k, v in report.to_dict().items() if k != "plan"},
        "report_json": json.dumps(report.to_dict(), sort_keys=True, default=str),
        "timings": {"export_seconds": export_seconds},
        "signature": {"inputs_json": json.dumps(checks.tree_signature(specs)),
                      "outputs_json": json.dumps(checks.tree_signature(out_specs)),
                      "executable_in_tree": str(in_tree), "executable_out_tree": str(out_tree),
                      "exported_in_avals": [str(a) for a in exported.in_avals],
                      "exported_out_avals": [str(a) for a in exported.out_avals]},
        "signing": signing.signing_record(sign_key),
    }
    return _write_artifact(out_dir, final, key, manifest, blobs, sign_key, t0)


def _write_artifact(out_dir, final: Path, key: str, manifest: dict[str, Any], blobs: dict[str, bytes], sign_key,
                    t0: float) -> ExportResult:
    """Write `blobs` and the manifest (`manifest` plus the files' sha256 and sizes; signed when
    `sign_key`) into a temporary directory beside `final`, then rename it into place."""
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        paths.check_inside(out_dir, parent)
        paths.clean_stale_tmps(parent)  # temporaries of killed exports
        tmp = paths.make_tmp(parent, key)
    except OSError as e:
        raise ArtifactPathError(f"{parent}: cannot create the artifact's directory: {paths.os_reason(e)}") from None
    try:
        for name, data in blobs.items():
            (tmp / name).write_bytes(data)
        files = {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size} for name in blobs}
        manifest = {**manifest, "files": files}
        text = to_toml(manifest).encode()
        (tmp / MANIFEST).write_bytes(text)
        if sign_key is not None:
            (tmp / SIGNATURE).write_text(signing.signature_text(text, sign_key))
        paths.unmark_tmp(tmp)
        for f in tmp.iterdir():  # durable before it becomes visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, final)
        except OSError:
            if (final / MANIFEST).exists():  # another process published the same key first
                shutil.rmtree(tmp, ignore_errors=True)
                return ExportResult(final, key, True, time.perf_counter() - t0, verify(final))
            _refuse_foreign(final)
            raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArtifactError(f"{final}: cannot write the artifact: {paths.os_reason(e)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(final, key, False, time.perf_counter() - t0, read_manifest(final))


def _export_xla_spmd(spec: BuildSpec, inputs: dict[str, Any], key: str, out_dir, final: Path, sign_key, say,
                     t0: float) -> ExportResult:
    """A cpu build over N devices as an artifact of the same build's XLA SPMD step
    (`tpumk.model.xla_step.xla_cache_step`, its weights and cache sharded by
    `tpumk.model.xla_spmd.xla_cache_shardings`): the jax.export program only. A serialized
    executable would name the device ids it was compiled for, which differ between one process
    of N host devices and N devices over several processes; the portable program runs on any N."""
    import jax
    import numpy as np
    from jax import export as jexport
    from jax.sharding import Mesh

    from tpumk.model.xla_spmd import AXIS, xla_cache_shardings
    from tpumk.model.xla_step import xla_cache_step
    from tpumk.targets import mesh_devices

    _register_pytrees()
    cfg, n = spec.model, spec.devices
    mesh = Mesh(np.asarray(mesh_devices(spec.target, n)), (AXIS,))
    specs, out_shardings = xla_cache_shardings(cfg, spec.batch, spec.context, spec.q_len, mesh)
    say(f"jax.export of XLA's SPMD decode step over {n} {spec.target.name} devices (portable program)")
    t1 = time.perf_counter()
    exported = jexport.export(jax.jit(xla_cache_step(cfg), out_shardings=out_shardings), platforms=["cpu"])(*specs)
    export_seconds = time.perf_counter() - t1
    say("report and files (write to a temporary directory, then rename)")
    report = checks.xla_spmd_report(spec)
    out_specs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    target = spec.target
    manifest = {
        "format": FORMAT, "key": key, "created_unix": int(time.time()),
        "model": cfg.to_dict(),
        "target": {"name": target.name, "chip": target.chip, "topology": target.topology or "",
                   "device_kind": "cpu", "interpret": target.interpret, "export_platform": "cpu",
                   "kernel_mode": checks.XLA_SPMD_MODE},
        "program": checks.program_record(inputs),
        "shapes": spec.shapes(),
        "mesh": checks.xla_spmd_mesh_record(spec),
        "tuning": spec.tuning.to_dict(),
        "versions": stack_versions(),
        "loads": checks.loads_of(stack_versions()),
        "cache_key": {"key": key, "inputs_json": canonical(inputs).decode()},
        "report": report,
        "report_json": json.dumps(report, sort_keys=True),
        "timings": {"export_seconds": export_seconds},
        "signature": {"inputs_json": json.dumps(checks.tree_signature(checks.xla_spmd_program_specs(spec))),
                      "outputs_json": json.dumps(checks.tree_signature(out_specs)),
                      "exported_in_avals": [str(a) for a in exported.in_avals],
                      "exported_out_avals": [str(a) for a in exported.out_avals]},
        "signing": signing.signing_record(sign_key),
    }
    return _write_artifact(out_dir, final, key, manifest, {EXPORTED: bytes(exported.serialize())}, sign_key, t0)


def _drafter_payload(draft, params) -> bytes | None:
    """drafter.safetensors of a round build whose drafter was read from files (None: no drafter,
    or a random one); its weights must be the ones the RoundSpec's content hash names."""
    if draft is None or draft.random_seed is not None:
        return None
    from tpumk.draft.weights import params_bytes, weights_sha256

    if params is None:
        raise ArtifactError(f"--draft {draft.drafter.kind}: its weights are needed to ship them (export(..., "
                            "draft_params=...))")
    got = weights_sha256(params)
    if got != draft.weights[1]:
        raise ArtifactError(f"--draft {draft.drafter.kind}: weights with content hash {got[:12]}..., the round spec "
                            f"names {draft.weights[1][:12]}...")
    try:
        return params_bytes(draft.drafter, params)
    except ConfigError as e:
        raise ArtifactError(f"--draft {draft.drafter.kind}: {e}") from None


# ---------------------------------------------------------------------- verify / load
def _manifest_bytes(path: Path) -> bytes:
    for p in (path, path / MANIFEST):  # a name the OS refuses (ENAMETOOLONG): one line, not a traceback
        if problem := name_problem(p):
            raise ArtifactError(f"{shown(p)}: {problem}")
    if not path.is_dir():
        raise ArtifactError(f"{path}: not an artifact directory (no such directory)")
    mf = path / MANIFEST
    if not mf.is_file():
        raise ArtifactError(f"{path}: not an artifact directory (no {MANIFEST})")
    try:
        data = paths.read_at_most(mf, MAX_MANIFEST_BYTES)
    except OSError as e:
        raise ArtifactError(f"{mf}: cannot read: {paths.os_reason(e)}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{mf}: more than {MAX_MANIFEST_BYTES:,} bytes, not a manifest")
    return data


def _parse_manifest(mf: Path, data: bytes) -> dict[str, Any]:
    try:
        m = parse_toml(data, str(mf))
    except ConfigError as e:  # not UTF-8, bad syntax, nesting or integers the parser refuses
        raise ArtifactError(f"{mf}: malformed manifest: {str(e).removeprefix(f'{mf}: ')}") from None
    if "format" not in m:
        raise ArtifactError(f"{mf}: malformed manifest: missing 'format'")
    if m["format"] != FORMAT:  # before the tables: an older format lacks some (e.g. [mesh] before 4)
        got = m["format"] if isinstance(m["format"], int) else repr(m["format"])[:60]
        raise ArtifactError(f"{mf}: artifact format {got}, this tpumk reads format {FORMAT} (re-export)")
    for field in ("key", "target", "versions", "cache_key", "files", "shapes", "tuning", "model",
                  "report", "report_json", "signature", "mesh"):
        if field not in m:
            raise ArtifactError(f"{mf}: malformed manifest: missing '{field}'")
    if not isinstance(m.get("signing"), dict) or not isinstance(m["signing"].get("signed"), bool):
        raise ArtifactError(f"{mf}: malformed manifest: missing 'signing'")
    return m


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest, parsed and well-formed, NOT verified (for display; `verify` authenticates)."""
    path = Path(path)
    return _parse_manifest(path / MANIFEST, _manifest_bytes(path))


def _check_signing_record(path: Path, m: dict[str, Any], trust: dict[str, Any]) -> None:
    rec = m["signing"]
    if rec["signed"] and not trust["signed"]:
        raise SignatureError(f"{path}: the manifest says it is signed (key id {rec.get('key_id', '?')}) but "
                             f"{SIGNATURE} is missing (signature removed)")
    if trust["signed"] and not rec["signed"]:
        raise SignatureError(f"{path}: {SIGNATURE} present but the manifest says it is unsigned (manifest altered)")
    if rec["signed"] and rec.get("key_id") != trust["key_id"]:
        raise SignatureError(f"{path / SIGNATURE}: key id {trust['key_id']} differs from the manifest's "
                             f"signing.key_id {rec.get('key_id')!r} (altered)")


def _verify(path: Path, check_versions: bool = True) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """verify(), also returning what was proved about who wrote it (signing.check_signature) and
    the plan its key inputs make (checks.check_fields re-plans it; `load` reuses it)."""
    key = signing.configured_key()
    data = _manifest_bytes(path)
    trust = signing.check_signature(path, data, key)  # the exact bytes, before parsing them
    try:
        m = _parse_manifest(path / MANIFEST, data)
        _check_signing_record(path, m, trust)
        inputs = checks.key_inputs_of(path, m)
        plan = checks.check_fields(path, m, inputs)
        _check_files(path, m, _payload_of(inputs))
        if DRAFTER in m["files"]:  # its weights are the ones the key's content hash names
            drafter_weights(path, m)
    except MALFORMED as e:  # types or sizes no check expected: one line, never a traceback
        raise ArtifactError(_malformed(path, e)) from None
    if check_versions:  # the stack that may load the executable (the manifest's [loads]; `load` checks its own payload)
        why = checks.why_not_loadable(path, m["versions"], stack_versions(), "executable")
        if why:
            raise ArtifactError(why)
    return m, trust, plan


def _payload_of(inputs: dict[str, Any]) -> tuple[str, ...]:
    """The files an artifact of these key inputs holds: the two programs, and a round artifact's
    drafter weights when they were read from files (a random drafter's seed remakes them)."""
    if "program" in inputs:  # XLA's SPMD step: the portable program only (_export_xla_spmd)
        return (EXPORTED,)
    weights = (inputs.get("draft") or {}).get("weights") or {}
    return PAYLOAD + ((DRAFTER,) if "sha256" in weights else ())


def _check_files(path: Path, m: dict[str, Any], payload: tuple[str, ...] = PAYLOAD) -> None:
    """Every payload file listed, present, of the listed size and sha256."""
    missing = [n for n in payload if n not in m["files"]]
    if missing:
        raise ArtifactError(f"{path / MANIFEST}: malformed manifest: no sha256 listed for {missing[0]}")
    for name, entry in sorted(m["files"].items()):
        if name not in payload:
            raise ArtifactError(f"{path / MANIFEST}: malformed manifest: bad files entry '{name}'")
        f = path / name
        try:
            if not f.is_file():
                raise ArtifactError(f"{f}: missing file of artifact {m['key'][:12]}")
            size = f.stat().st_size
            if size != entry["bytes"]:
                raise ArtifactError(f"{f}: {size} bytes, manifest says {entry['bytes']} (truncated or altered)")
            got = sha256_file(f)
        except OSError as e:  # EACCES, EIO, ...: one line, not a traceback
            raise ArtifactError(f"{f}: cannot read: {paths.os_reason(e)}") from None
        if got != entry["sha256"]:
            raise ArtifactError(f"{f}: sha256 {got[:12]}... does not match the manifest's "
                                f"{entry['sha256'][:12]}... (altered)")


def verify(path: str | Path, check_versions: bool = True) -> dict[str, Any]:
    """The signature when a key is configured (before anything else is read), the manifest's
    fields against its key inputs, its key against the directory's name, every file present with
    its size and sha256, the same stack. Returns the manifest; ArtifactError (one line) if not."""
    return _verify(Path(path), check_versions)[0]


def _read_payload(path: Path, name: str, m: dict[str, Any]) -> bytes:
    """A file's bytes, read once and checked against the verified manifest's sha256 in memory, so
    what is deserialized is exactly what was hashed (no swap between verify and load)."""
    entry = m["files"].get(name)
    if entry is None:
        raise ArtifactError(f"{path}: no {name} in this artifact")
    try:
        data = paths.read_at_most(path / name, entry["bytes"])
    except OSError as e:
        raise ArtifactError(f"{path / name}: cannot read: {paths.os_reason(e)}") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ArtifactError(f"{path / name}: changed since it was verified (altered)")
    return data


def drafter_weights(path: Path, m: dict[str, Any]):
    """A verified round artifact's drafter weights: drafter.safetensors (read once, checked
    against the manifest's sha256, parsed, and its content hash against the key's), or a random
    drafter's, remade from the seed its key names."""
    from tpumk.draft.weights import params_from_bytes, random_params, weights_sha256

    draft = spec_of(m).draft
    if draft.random_seed is not None:
        return random_params(draft.drafter, draft.random_seed)
    try:
        params = params_from_bytes(draft.drafter, _read_payload(path, DRAFTER, m), str(path / DRAFTER))
    except TpumkError as e:
        raise ArtifactError(str(e)) from None
    got = weights_sha256(params)
    if got != draft.weights[1]:
        raise ArtifactError(f"{path / DRAFTER}: weights with content hash {got[:12]}..., the key names "
                            f"{draft.weights[1][:12]}... (altered)")
    return params


def spec_of(m: dict[str, Any]) -> BuildSpec:
    """The BuildSpec an artifact was built from (from the key inputs its manifest records)."""
    return checks.spec_from_inputs(json.loads(m["cache_key"]["inputs_json"]))


class DecodeStep:
    """A loaded artifact: step(packed, tokens, positions, cache) -> (logits, cache).

    The serialized executable donates `cache` (its K/V are updated in place): keep using the
    returned cache, never the one passed in.

    Before running, a call checks the positions contract on the host
    (`tpumk.model.positions.check_step`: per sequence, consecutive positions starting at most
    at the cache length and below the capacity, distinct valid page ids; PositionError
    otherwise) and the token ids (`check_tokens`: in the vocabulary; TokenError otherwise) so a
    bad input is reported before any cache row is touched. Serving loops that guarantee their inputs
    skip it (a device-to-host read of positions and lengths) with `step(..., check=False)` or
    for every call with `step.check_inputs = False`.

    Many devices (an N-device artifact): `devices` are the mesh's devices in the recorded order,
    `mesh` the 1-D mesh over them, and the step takes global arrays in `shardings` (for
    (packed, tokens, positions, cache): weights stacked per device and split on that axis, the
    embedding and the step inputs replicated, the K/V in the sharded layout split on their last
    axis). `pack(params)` and `init_cache()` / `shard_cache(cache)` build them; any other
    argument is placed there first, each process filling only the shards it addresses. Logits
    come back [B, q, vocab] on every device (all-gathered inside the kernel)."""

    check_inputs: bool = True

    def __init__(self, path: Path, manifest: dict[str, Any], fn, kind: str, plan=None, devices=None):
        self.path, self.manifest, self._fn, self.kind = path, manifest, fn, kind
        self._plan = plan  # verify's (load passes it); else planned from the manifest when first asked
        self.batch = manifest["shapes"]["batch"]
        self.q_len = manifest["shapes"]["q_len"]
        self.devices = list(devices) if devices is not None else None
        self._shardings = self._specs = self._pool_shapes = None
        name = (manifest.get("target") or {}).get("name")  # load verified it; None: a bare program
        self._device_platform = None if name is None else ("cpu" if get_target(name).interpret else "tpu")

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def config(self):
        """The model the artifact runs (its ModelConfig), e.g. for
        `tpumk.model.weights.random_params(step.config)`."""
        return self.plan.spec.model  # the model as described (a lane-padded plan runs a padded copy of it)

    @property
    def plan(self):
        """The plan the artifact was built from (`step.pack(params)` packs weights for it; one
        device: also `tpumk.pack_weights(step.plan, params)`)."""
        if self._plan is None:
            self._plan = plan_of(self.manifest)
        return self._plan

    @property
    def program(self):
        """The step's program itself, to call inside the caller's own jit (as a serving engine
        does): the `jax.export` program of a `use="exported"` load, with no host-side checks of
        positions or tokens. A serialized executable cannot be traced: ArtifactError."""
        if not self.kind.startswith("exported"):
            raise ArtifactError(f"artifact {self.key[:12]}: its serialized executable cannot run inside another "
                                "jit; load it with use=\"exported\"")
        return self._fn

    @property
    def mesh(self):
        """The 1-D mesh the step runs on (many devices), else None."""
        return None if self.shardings is None else self.shardings[1].mesh

    @property
    def shardings(self):
        """NamedShardings of (packed, tokens, positions, cache) on the step's mesh (many devices),
        else None: what each host needs to build its inputs (e.g. jax.make_array_from_callback)."""
        if self.devices is None:
            return None
        if self._shardings is None:
            import jax
            import numpy as np
            from jax.sharding import Mesh, NamedSharding

            from tpumk.kernel.megakernel import step_specs
            from tpumk.plan.sharding import MESH_AXIS

            mesh = Mesh(np.asarray(self.devices), (MESH_AXIS,))
            self._specs = step_specs(self.plan)  # the GLOBAL shapes
            self._shardings = jax.tree.map(lambda a: NamedSharding(mesh, a.sharding.spec), self._specs)
        return self._shardings

    def pack(self, params: dict):
        """Reference-layout weights -> the packed weights this step takes. One device:
        `tpumk.pack_weights(step.plan, params)`. Many devices: each device's part
        (`ShardingPlan.device_params`) is packed on the host CPU and put on that device alone,
        so no device ever holds more than its part; each process packs only the devices it
        addresses (every process passes the whole model's params). A quantized artifact
        quantizes float weights here (`tpumk.model.quantize`); already quantized ones must use
        its scheme."""
        from tpumk.kernel.layout import pack_weights
        from tpumk.model.quantize import quantize_params, scheme_of

        from tpumk.plan.padding import params_as_run

        plan = self.plan
        params = params_as_run(plan, params)  # a lane-padded plan: zeros after each true block
        if scheme_of(params) == "none":
            params = quantize_params(plan.whole_model, params, plan.quant)
        if self.devices is None:
            return pack_weights(plan, params)
        import jax
        import jax.numpy as jnp

        from tpumk.model.reference import jnp_dtype

        sh, model, specs = plan.sharding, plan.whole_model, self.shardings[0]
        parts = []
        with jax.default_device(jax.devices("cpu")[0]):
            for i, d in enumerate(self.devices):
                if d.process_index != jax.process_index():
                    continue
                part = pack_weights(plan, sh.device_params(model, params, i))
                part.pop("embed")
                parts.append(jax.device_put(jax.tree.map(lambda a: a[None], part), d))
            embed = jnp.asarray(params["embed"], jnp_dtype(model))
        shapes = {k: v for k, v in self._specs[0].items() if k != "embed"}  # global, stacked per device
        out = jax.tree.map(lambda a, s, *leaves: jax.make_array_from_single_device_arrays(a.shape, s, list(leaves)),
                           shapes, {k: v for k, v in specs.items() if k != "embed"}, *parts)
        out["embed"] = _place(embed, specs["embed"])
        return out

    def init_cache(self):
        """An empty paged KV cache of the artifact's shapes (many devices: on its mesh, as
        `shard_cache` places it). A hybrid model's carries its empty state pool: the plan's
        slots (one per sequence), each with q_len pending rows (the kernel leaves every step's
        tokens pending: `tpumk.model.linear_attention`)."""
        import jax

        from tpumk.model.reference import init_cache

        p = self.plan
        kw = dict(num_pages=p.num_pages, kv_dtype=p.attention.kv_dtype or None)
        if p.linear is not None:
            kw.update(pending=p.q_len, num_slots=p.linear.num_slots)
        if self.devices is None:
            return init_cache(p.whole_model, p.batch, p.context, p.page_size, **kw)
        with jax.default_device(jax.devices("cpu")[0]):  # built on the host, placed shard by shard
            cache = init_cache(p.whole_model, p.batch, p.context, p.page_size, **kw)
        return self.shard_cache(cache)

    def shard_cache(self, cache):
        """A KV cache in the reference layout (e.g. filled by `tpumk.model.reference.prefill`) ->
        the one this step takes: one device, the same; many, the sharded layout
        (`ShardingPlan.expand_kv`) on the step's mesh, each process placing its shards. A
        lane-padded model's cache gains the padded KV heads' zero lanes (`tpumk.plan.padding`).
        A hybrid's state pool goes along (`ShardingPlan.expand_states`)."""
        from tpumk.plan.padding import pad_cache

        if self.plan.unpadded is not None:
            cache = pad_cache(self.plan.unpadded, self.plan.whole_model, cache)
        if self.devices is None:
            return cache
        import jax
        import numpy as np

        with jax.default_device(jax.devices("cpu")[0]):  # from host copies: the layout is built on the host
            wide = self.plan.sharding.expand_kv(self.plan.whole_model, jax.tree.map(np.asarray, cache))
        return _place(wide, self.shardings[3])

    def unshard_cache(self, cache):
        """The inverse of `shard_cache`: the reference layout (one process must address every
        device: a single host)."""
        from tpumk.plan.padding import unpad_cache

        if self.devices is not None:
            cache = self.plan.sharding.collapse_kv(self.plan.whole_model, cache)
        if self.plan.unpadded is not None:
            cache = unpad_cache(self.plan.unpadded, self.plan.whole_model, cache)
        return cache

    def __call__(self, packed, tokens, positions, cache, check: bool | None = None):
        b, t = tokens.shape
        if (b, t) != (self.batch, self.q_len):
            raise ArtifactError(f"artifact {self.key[:12]} takes tokens [{self.batch}, {self.q_len}], got [{b}, {t}]")
        self._check_pool(cache)
        if self.check_inputs if check is None else check:
            from tpumk.model.positions import check_step, check_tokens

            vocab = (self.manifest.get("model") or {}).get("vocab_size")  # load checks it against the key
            if vocab is not None:
                check_tokens(tokens, int(vocab), where=f"artifact {self.key[:12]}")
            # the kernel leaves every step's tokens pending (the pool's rows: q_len)
            check_step(positions, cache, where=f"artifact {self.key[:12]}", keep_pending=True)
        return self._run((packed, tokens, positions, cache), self.shardings)  # None on one device

    def _run(self, args: tuple, shardings):
        """The program on `args` (packed weights first): on one device every argument committed
        to the program's device, on a mesh placed in exactly `shardings`."""
        if self.devices is None:
            # every argument committed to the step's device (zero-copy for arrays already there):
            # jit specializes on committed-ness, and the cache a call returns is committed, so
            # uncommitted first arguments (init_cache, pack) made the second call compile again
            if self._device_platform is None:
                return self._fn(*args)
            import jax

            device = jax.devices(self._device_platform)[0]
            return self._fn(*jax.device_put(args, device))
        self._check_packed(args[0])
        # the program takes its arguments in exactly these shardings (the executable refuses others)
        return self._fn(*_place(args, shardings))

    def _check_pool(self, cache) -> None:
        """A hybrid's step takes the cache's state pool in exactly the plan's shapes (`init_cache`
        makes it); a missing pool, or one of other shapes, is refused here in one line instead of
        the program's shape error. A model without linear layers takes none."""
        hybrid = bool((self.manifest.get("model") or {}).get("linear_layers"))
        states = getattr(cache, "states", None)
        if not hybrid:
            if states is not None:
                raise ArtifactError(f"artifact {self.key[:12]}: the cache carries a state pool, but the model has no "
                                    "linear-attention layers")
            return
        if states is None:
            raise ArtifactError(f"artifact {self.key[:12]}: the model has linear-attention layers: the cache needs "
                                "their state pool (step.init_cache() makes it)")
        if self._pool_shapes is None:  # the step's own (global) shapes, worked out once
            from tpumk.kernel.megakernel import step_specs

            pool = (self._specs if self._specs is not None else step_specs(self.plan))[3].states
            self._pool_shapes = {name: tuple(getattr(pool, name).shape) for name in pool._fields}
        for name, w in self._pool_shapes.items():
            got = tuple(getattr(getattr(states, name), "shape", ()))
            if got != w:
                raise ArtifactError(f"artifact {self.key[:12]}: cache.states.{name} has shape {list(got)}, this step "
                                    f"takes {list(w)} ({self.plan.linear.num_slots} slots of q_len = {self.q_len} "
                                    "pending rows: step.init_cache() makes it)")

    def _check_packed(self, packed) -> None:
        """Many devices: weights packed for one device (e.g. `tpumk.pack_weights(step.plan, ...)`,
        the per-device layout without the device axis) are refused here, in one line."""
        import jax

        want = self.shardings and self._specs[0]
        got_leaves, got_tree = jax.tree.flatten_with_path(packed)
        if got_tree != jax.tree.structure(want):
            raise ArtifactError(f"artifact {self.key[:12]}: packed weights of another structure than this step's "
                                "(pack them with step.pack(params))")
        for (where, a), s in zip(got_leaves, jax.tree.leaves(want)):
            if tuple(getattr(a, "shape", ())) != tuple(s.shape):
                raise ArtifactError(f"artifact {self.key[:12]}: packed weight {jax.tree_util.keystr(where)} has shape "
                                    f"{list(getattr(a, 'shape', ()))}, this {len(self.devices)}-device step takes "
                                    f"{list(s.shape)} (pack them with step.pack(params))")

    def __repr__(self) -> str:
        on = f", {len(self.devices)} devices" if self.devices else ""
        return f"DecodeStep({self.path}, {self.kind}{on})"


class RoundProgram(DecodeStep):
    """A loaded round artifact (`tpumk export --draft`): the speculative round program
    (`tpumk.draft.rounds.make_rounds` around the megakernel's verify step, compiled by
    `tpumk.compile.aot.compile_rounds`), `rounds_per_call` rounds of draft, verify with the
    drafter's taps and accept per call.

    program(packed, dparams, tparams, carry) -> carry: one device call (`__call__`); the carry
    (`tpumk.draft.rounds.Carry`, the KV cache in the kernel's layout inside it) is donated: keep
    the returned one. `generate(params, prompts, steps)` is the whole loop: the prompts prefilled
    by the reference decode step with the drafter's taps (`tpumk.model.reference`, on this
    host's default device), then the program until every sequence has `steps` tokens.
    `pack`, `init_cache`, `shard_cache`, `plan` and `config` are the verify step's, as a
    DecodeStep's; `draft` is the RoundSpec, `drafter` the Drafter with the artifact's weights."""

    drafter_params = None  # load_rounds sets them (drafter.safetensors, or remade from the seed)

    @property
    def draft(self):
        """The artifact's RoundSpec: the drafter's spec, its weights' identity, the settings."""
        return spec_of(self.manifest).draft

    @property
    def settings(self):
        """The compiled program's RoundSettings (block, the most tokens per sequence, rounds per
        call, temperature)."""
        return self.draft.settings(self.plan.context)

    @property
    def drafter(self):
        from tpumk.draft.drafter import Drafter

        return Drafter(self.draft.drafter, self.drafter_params)

    @functools.cached_property
    def round_shardings(self):
        """NamedShardings of (packed, dparams, tparams, carry) on the program's mesh (many
        devices), else None; made once, not on every call."""
        if self.devices is None:
            return None
        import jax
        from jax.sharding import NamedSharding

        from tpumk.compile.aot import round_specs

        mesh = self.shardings[1].mesh
        specs = round_specs(self.plan, self.draft.drafter, self.settings)
        return jax.tree.map(lambda a: NamedSharding(mesh, a.sharding.spec), specs)

    def __call__(self, packed, dparams, tparams, carry, check: bool | None = None):
        return self._run((packed, dparams, tparams, carry), None if self.devices is None else self.round_shardings)

    def generate(self, params: dict, prompts, steps: int, seed: int = 0, on_call=None):
        """Speculative generation of `steps` tokens for each of the program's `batch` prompts
        (token id lists, any lengths), greedy or sampled as the artifact was exported; `params`
        the target's reference-layout weights (as `pack` takes them). Returns (tokens per
        prompt, tpumk.draft.rounds.RoundStats). The prompt, the steps and a verify step must fit
        the artifact's context: one line (ConfigError, TokenError) otherwise."""
        import jax
        import jax.numpy as jnp

        from tpumk.draft.rounds import drive, required_context
        from tpumk.errors import ConfigError
        from tpumk.model import reference
        from tpumk.model.ops import jnp_dtype
        from tpumk.model.positions import check_tokens
        from tpumk.model.quantize import quantize_params, scheme_of

        plan, model, settings = self.plan, self.config, self.settings
        prompts = [list(p) for p in prompts]
        if len(prompts) != plan.batch or not all(prompts):
            raise ConfigError(f"artifact {self.key[:12]}: expected {plan.batch} non-empty prompts (its batch), got "
                              f"{[len(p) for p in prompts]}")
        if self.check_inputs:
            for p in prompts:
                check_tokens(jnp.asarray([p]), model.vocab_size, where=f"artifact {self.key[:12]}")
        if not (isinstance(steps, int) and 1 <= steps <= settings.steps):
            raise ConfigError(f"artifact {self.key[:12]}: steps = {steps!r}: expected 1 to {settings.steps}")
        need = required_context(prompts, steps, settings.block)
        if need > plan.context:
            raise ConfigError(f"artifact {self.key[:12]}: the longest prompt plus {steps} steps plus a verify step "
                              f"of {settings.block + 1} need {need} positions; its context holds {plan.context}")
        run_params = params if scheme_of(params) != "none" else quantize_params(model, params, plan.quant)
        dt = jnp_dtype(model)
        tparams = {"embed": jnp.asarray(params["embed"], dt)}  # what the drafter reads of the target (round_specs)
        if not model.tie_embeddings:
            tparams["lm_head"] = jnp.asarray(params["lm_head"], dt)
        kw = dict(num_pages=plan.num_pages, kv_dtype=plan.attention.kv_dtype or None)
        if plan.linear is not None:
            kw.update(pending=plan.q_len, num_slots=plan.linear.num_slots)
        cache = reference.init_cache(model, plan.batch, plan.context, plan.page_size, **kw)
        taps = self.draft.drafter.taps
        prefill = jax.jit(lambda t, p, c: reference.decode_step(run_params, model, t, p, c, taps=taps))
        # the cache goes into the kernel's layout once; the one the rounds leave is not returned
        tokens, _, stats = drive(self, prefill, self.drafter, self.pack(params), self.drafter_params, tparams,
                                 prompts, cache, settings, steps, seed, (self.shard_cache, lambda c: c), on_call)
        return tokens, stats

    def __repr__(self) -> str:
        on = f", {len(self.devices)} devices" if self.devices else ""
        return f"RoundProgram({self.path}, {self.kind}, {self.draft.label()}{on})"


class XlaSpmdStep(DecodeStep):
    """A loaded `cpu` artifact over N devices (tpumk.compile.keys.program_kind "xla-spmd"): the
    build's XLA decode step (`tpumk.model.xla_step.xla_cache_step`), weights and cache sharded
    over a 1-D mesh "tp" of `devices` as `tpumk.model.xla_spmd.spmd_layout` splits them, XLA's
    SPMD partitioner inserting the collectives. Not the megakernel: its in-kernel collectives
    run only in Pallas' TPU interpreter, which neither serializes nor runs across processes.

    step(packed, tokens [B, q], positions [B, q], cache) -> (logits [B, q, vocab] f32, cache),
    as a DecodeStep; the cache is an `XlaCache` (k, v [L, B, kv_heads, context, head_dim],
    lengths [B]) from `init_cache()`, contiguous per sequence, not paged. `pack(params)` places
    the reference-layout weights as they are (no kernel layout), each process filling only the
    shards it addresses. The step checks its positions on the host: consecutive per sequence,
    from at most the sequence's length, below the context (the XLA step does not implement the
    kernel's treatment of positions outside the cache)."""

    @property
    def mesh(self):
        import numpy as np
        from jax.sharding import Mesh

        from tpumk.model.xla_spmd import AXIS

        return Mesh(np.asarray(self.devices), (AXIS,))

    @property
    def shardings(self):
        """NamedShardings of (packed, tokens, positions, XlaCache) on the step's devices (the
        mesh factored as `tpumk.model.xla_spmd.SpmdLayout.mesh` where the KV heads split fewer
        ways than the devices)."""
        if self._shardings is None:
            import jax

            from tpumk.model.xla_spmd import xla_cache_shardings

            cfg, sh = self.config, self.manifest["shapes"]
            self._specs = xla_cache_shardings(cfg, sh["batch"], sh["context"], sh["q_len"], self.mesh)[0]
            self._shardings = jax.tree.map(lambda a: a.sharding, self._specs)
        return self._shardings

    def pack(self, params: dict):
        """Reference-layout float weights, as `tpumk.model.weights.random_params` or a checkpoint
        gives them, placed in the step's shardings (every process passes the whole model's)."""
        import jax
        import numpy as np

        from tpumk.model.quantize import scheme_of

        if scheme_of(params) != "none":
            raise ArtifactError(f"artifact {self.key[:12]}: XLA's SPMD step takes float weights, got "
                                f"{scheme_of(params)} ones")
        shardings = self.shardings
        want = self._specs[0]
        if jax.tree.structure(params) != jax.tree.structure(want):
            raise ArtifactError(f"artifact {self.key[:12]}: weights of another structure than model "
                                f"'{self.config.name}' (tpumk.model.weights.random_params(step.config) has its)")
        for (where, a), s in zip(jax.tree.flatten_with_path(params)[0], jax.tree.leaves(want)):
            if tuple(np.shape(a)) != tuple(s.shape):
                raise ArtifactError(f"artifact {self.key[:12]}: weight {jax.tree_util.keystr(where)} has shape "
                                    f"{list(np.shape(a))}, the model's is {list(s.shape)}")
        host = jax.tree.map(lambda a, s: np.asarray(a).astype(s.dtype), params, want)
        return _place(host, shardings[0])

    def init_cache(self):
        """An empty XlaCache (zeros, lengths 0) in the step's shardings."""
        import jax
        import numpy as np

        zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self._cache_specs())
        return _place(zeros, self.shardings[3])

    def _cache_specs(self):
        self.shardings  # noqa: B018 - makes self._specs
        return self._specs[3]

    def shard_cache(self, cache):
        raise ArtifactError(f"artifact {self.key[:12]}: XLA's SPMD step keeps a contiguous cache (XlaCache), not the "
                            "paged one: start from step.init_cache()")

    def unshard_cache(self, cache):
        return self.shard_cache(cache)

    def __call__(self, packed, tokens, positions, cache, check: bool | None = None):
        import numpy as np

        b, t = np.shape(tokens)
        if (b, t) != (self.batch, self.q_len):
            raise ArtifactError(f"artifact {self.key[:12]}: takes tokens [{self.batch}, {self.q_len}], got [{b}, {t}]")
        if self.check_inputs if check is None else check:
            from tpumk.model.positions import check_tokens

            check_tokens(_host(tokens), self.config.vocab_size, where=f"artifact {self.key[:12]}")
            self._check_positions(_host(positions), _host(cache.lengths))
        # (the cache a call returns is laid out as it came in, under the program's sharding objects)
        return self._fn(*_place((packed, tokens, positions, cache), self.shardings, equivalent=True))

    def _check_positions(self, positions, lengths) -> None:
        """Per sequence: consecutive positions, the first at most its length, all below the
        context (PositionError naming the sequence otherwise)."""
        import numpy as np

        from tpumk.errors import PositionError

        context, where = self.manifest["shapes"]["context"], f"artifact {self.key[:12]}"
        for i, (row, n) in enumerate(zip(np.asarray(positions), np.asarray(lengths))):
            if np.any(np.diff(row) != 1) or row[0] < 0 or row[0] > n or row[-1] >= context:
                raise PositionError(f"{where}: sequence {i}: positions {row.tolist()} with {int(n)} tokens cached: "
                                    f"expected consecutive positions from at most {int(n)}, below the context "
                                    f"{context}")

    def __repr__(self) -> str:
        return f"XlaSpmdStep({self.path}, {self.kind})"


def _host(x):
    """A step input on the host: a global array spanning other processes' devices is read from
    this process's first shard (the step's tokens, positions and lengths are replicated)."""
    import jax
    import numpy as np

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _place(tree, shardings, equivalent: bool = False):
    """Every leaf of `tree` as a global array of the matching sharding in `shardings`: one already
    there is kept (`equivalent`: also one laid out the same way under another sharding object,
    e.g. a jax.export program's results), a process-local jax array is resharded on device,
    anything else is sliced on the host and each shard this process addresses put on its device
    (every process passes the same value)."""
    import jax
    import numpy as np

    def one(x, s):
        if isinstance(x, jax.Array):
            if x.sharding == s or (equivalent and x.sharding.is_equivalent_to(s, x.ndim)):
                return x
            if x.is_fully_addressable and s.is_fully_addressable:  # one process: a device-side reshard
                return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def plan_of(m: dict[str, Any]):
    """The plan an artifact was built from (planning compiles nothing)."""
    from tpumk.plan.plan import make_plan

    return make_plan(spec_of(m))


USES = ("auto", "executable", "exported")


def load(path: str | Path, use: str = "auto", check_inputs: bool = True) -> DecodeStep:
    """Verify the artifact and make it callable on this host.

    use="auto": on a TPU target, the serialized executable on an attached TPU of the artifact's
    kind (ArtifactError if another kind or none is attached); on the cpu target, the portable
    export compiled for this host's CPU (runs on any machine). use="executable" / "exported"
    forces one of the two programs (the cpu executable loads only on a compatible host CPU).

    Nothing is deserialized before `verify` passes (signature when a key is configured, fields,
    every sha256, versions). The serialized executable is code (JAX unpickles it): without a
    signing key, loading it trusts whoever can write the artifact's directory; use="exported"
    (flatbuffers, no pickle) is the safer load of an artifact that is not signed.

    check_inputs: the step checks every call's positions and cache lengths on the host
    (tpumk.model.positions) before running; False is for serving loops that guarantee them (the
    kernel still never writes outside a sequence's own pages)."""
    if use not in USES:
        raise ArtifactError(f"use={use!r}: expected one of {', '.join(USES)}")
    path = Path(path)
    # the plan too: verify re-plans the key inputs to check the manifest; the stack is checked
    # next, for the payload this load takes (the manifest's [loads])
    m, _, plan = _verify(path, check_versions=False)
    if "draft" in m:
        raise ArtifactError(f"{path}: holds a speculative round program ({m['draft']['drafter']['kind']} drafter), "
                            "not a decode step: load it with tpumk.load_rounds(path)")
    return _load_program(path, m, plan, use, check_inputs, DecodeStep)


def load_rounds(path: str | Path, use: str = "auto", check_inputs: bool = True) -> "RoundProgram":
    """Verify a round artifact (`tpumk export --draft`) and make its round program callable on
    this host: a RoundProgram (`generate` runs prompts through it; `__call__` is one device call
    of `rounds_per_call` rounds). `use` and `check_inputs` as `load`; the drafter's weights are
    the artifact's drafter.safetensors (checked against the key's content hash) or, for a
    random drafter, remade from its seed. An artifact without a round program is refused in one
    line."""
    if use not in USES:
        raise ArtifactError(f"use={use!r}: expected one of {', '.join(USES)}")
    path = Path(path)
    m, _, plan = _verify(path, check_versions=False)
    if "draft" not in m:
        raise ArtifactError(f"{path}: holds the plain decode step, no speculative round program (export one with "
                            "tpumk export --draft KIND[:SOURCE]; tpumk.load(path) loads this one)")
    program = _load_program(path, m, plan, use, check_inputs, RoundProgram)
    program.drafter_params = drafter_weights(path, m)
    return program


def _load_program(path: Path, m: dict[str, Any], plan, use: str, check_inputs: bool, cls):
    """The verified artifact's program as `cls` (DecodeStep or RoundProgram), from the payload
    `use` names."""
    if "program" in m:  # verify checked its kind: XLA's SPMD step
        return _load_xla_spmd(path, m, plan, use, check_inputs)
    target = get_target(m["target"]["name"])
    payload = "exported" if use == "exported" or (use == "auto" and target.interpret) else "executable"
    why = checks.why_not_loadable(path, m["versions"], stack_versions(), payload)
    if why:
        raise ArtifactError(why)
    devices = None
    if plan.devices > 1:  # the recorded mesh's devices, attached, in its order (or one line why not)
        devices = _attached_mesh(path, m["mesh"], target)
    elif not target.interpret and not target.is_attached():
        attached = _attached_kind()
        raise ArtifactError(f"{path}: built for {target.name} ({target.device_kind}), but this host has "
                            f"{attached}; load it where a {target.device_kind} is attached")
    on = f"{target.name} x {plan.devices}" if devices else target.name
    if payload == "exported":
        step = cls(path, m, _deserialize_exported(path, m).call, f"exported ({on})", plan, devices)
        step.check_inputs = check_inputs
        return step
    from jax.experimental import serialize_executable

    _register_pytrees()
    # verify checked the manifest's signature.executable_in_tree / _out_tree against these
    in_tree, out_tree = checks.program_trees(plan, spec_of(m).draft)
    blob = _read_payload(path, EXECUTABLE, m)
    try:
        # many devices: the executable names its devices by id; these are the recorded ones
        compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                             backend="cpu" if target.interpret else "tpu",
                                                             execution_devices=devices)
    except Exception as e:
        raise ArtifactError(f"{path / EXECUTABLE}: cannot load on this host: {str(e).splitlines()[0]}") from None
    step = cls(path, m, compiled, f"executable ({on})", plan, devices)
    step.check_inputs = check_inputs
    return step


def _load_xla_spmd(path: Path, m: dict[str, Any], plan, use: str, check_inputs: bool) -> "XlaSpmdStep":
    """An XLA SPMD artifact's portable program on the first N devices of jax.devices("cpu")
    (after jax.distributed.initialize(): every process's, in JAX's global order)."""
    import jax

    if use == "executable":
        raise ArtifactError(f"{path}: holds XLA's SPMD step as a portable program only (a serialized executable "
                            "names the device ids it was compiled for); load it with use='exported' or 'auto'")
    why = checks.why_not_loadable(path, m["versions"], stack_versions(), "exported")
    if why:
        raise ArtifactError(why)
    n, have = m["mesh"]["devices"], jax.devices("cpu")
    if len(have) < n:
        raise ArtifactError(f"{path}: XLA's SPMD step over {n} cpu devices, but this process sees {len(have)}; set "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting (several "
                            "processes: jax.distributed.initialize() in each first)")
    step = XlaSpmdStep(path, m, _deserialize_exported(path, m).call, f"exported (XLA SPMD step, cpu x {n})", plan,
                       have[:n])
    step.check_inputs = check_inputs
    return step


def _attached_mesh(path: Path, mesh: dict[str, Any], target) -> list:
    """The attached devices of `target`'s kind with the recorded mesh's ids, in its order."""
    import jax

    try:
        # after jax.distributed.initialize(): every host's devices, addressable or not
        have = [d for d in jax.devices("tpu") if d.device_kind == target.device_kind]
    except RuntimeError:
        have = []
    return mesh_order(path, mesh, have, target)


def _ids(ids: list) -> str:
    ids = sorted(ids)
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids[:16])) + (",..." if len(ids) > 16 else "")


def mesh_order(path: Path, mesh: dict[str, Any], have: list, target) -> list:
    """Of the devices `have` (attached, of the artifact's kind), the recorded mesh's, in mesh
    order: the device with each recorded id, which must sit at the recorded chip coordinates
    and core (the executable runs on the device ids it was compiled for; the same ids at other
    places would be another topology). ArtifactError (one line naming what is missing) if not."""
    n, kind = mesh["devices"], target.device_kind
    want = (f"{n} {kind} devices ({target.name}, mesh {mesh['axis']}={mesh['axis_size']} on {mesh['topology']}, "
            f"device ids {_ids(mesh['device_ids'])})")
    if len(have) < n:
        here = f"{len(have)} {kind} device{'' if len(have) == 1 else 's'}"
        if not have:
            here += f" ({_attached_kind()})"
        raise ArtifactError(f"{path}: built for {want}, but this host has {here}; load it where {n} {kind} devices "
                            "are attached (a slice over several hosts: jax.distributed.initialize() on each first)")
    by_id = {int(d.id): d for d in have}
    out = []
    for i, (did, coords, core) in enumerate(zip(mesh["device_ids"], mesh["device_coords"], mesh["core_on_chip"])):
        d = by_id.get(did)
        if d is None:
            raise ArtifactError(f"{path}: mesh position {i} is {kind} device id {did}, not among the attached ones "
                                f"(ids {_ids(list(by_id))}): the executable runs on the device ids it was compiled for")
        got = ([int(c) for c in getattr(d, "coords", ())], int(getattr(d, "core_on_chip", 0)))
        if got != (list(coords), core):
            raise ArtifactError(f"{path}: {kind} device id {did} is at coords {got[0]} core {got[1]} here, the "
                                f"artifact's mesh has it at {list(coords)} core {core}: another topology "
                                "(export it on this slice)")
        out.append(d)
    return out


def _attached_kind() -> str:
    import jax

    try:
        devs = jax.devices()
    except RuntimeError:
        return "no accelerator"
    kinds = sorted({d.device_kind for d in devs if d.platform != "cpu"})
    return ", ".join(kinds) if kinds else "no TPU attached"


def _deserialize_exported(path: Path, m: dict[str, Any]):
    from jax import export as jexport

    blob = _read_payload(path, EXPORTED, m)
    _register_pytrees()
    try:
        return jexport.deserialize(bytearray(blob))
    except Exception as e:
        raise ArtifactError(f"{path / EXPORTED}: cannot deserialize: {str(e).splitlines()[0]}") from None


def trust_statement(trust: dict[str, Any]) -> str:
    """What a passing verify proved, in one line."""
    checked = "files match the manifest's sha256, its fields agree with its key inputs, versions match"
    if trust.get("verified"):
        return (f"signature verified (key id {trust['key_id']}): the manifest and, through its hashes, every "
                f"file are as exported by a holder of the key; {checked}")
    how = (f"signed (key id {trust['key_id']}) but the signature was not checked" if trust.get("signed")
           else "unsigned")
    return (f"{checked}; the manifest itself is not authenticated ({how}): anyone who can write the directory "
            f"can rewrite it and the files together; set {signing.KEY_ENV} to verify signatures")


def inspect(path: str | Path) -> dict[str, Any]:
    """The manifest plus what verify says. Never raises for a bad artifact or a bad PATH (missing,
    a regular file, a symlink loop, an unreadable or malformed manifest of any types): reports it,
    `valid` False and `problem` one line. The manifest's fields are shown (even when invalid, then
    marked INVALID) only when they have the types a display needs."""
    path = Path(path)
    out: dict[str, Any] = {"path": str(path)}

    def show(m: Any) -> None:
        if _displayable(m):
            out.update(key=m["key"], model=m["model"].get("name"), dtype=m["model"].get("dtype"), target=m["target"],
                       shapes=m["shapes"],
                       mesh=m.get("mesh", {}), tuning=m["tuning"], versions=m["versions"], files=m["files"],
                       report=m.get("report", {}), signature=m.get("signature", {}),
                       signed=bool(m.get("signing", {}).get("signed")),
                       **({"draft": m["draft"]} if "draft" in m else {}),
                       program=m.get("program") or {"kind": "megakernel"})

    problem = None
    try:
        problem = _path_problem(path)
        if problem:
            raise ArtifactError(problem)
        m, trust, _ = _verify(path)  # the signature first, before the manifest is parsed
        show(m)
        out.update(valid=True, problem=None, authenticated=trust["verified"],
                   signing={**trust, "scheme": signing.SCHEME if trust["signed"] else None},
                   proved=trust_statement(trust))
        return out
    except ArtifactError as e:
        out.update(valid=False, problem=str(e), authenticated=False)
    except OSError as e:
        where = e.filename if isinstance(e.filename, str) else path
        out.update(valid=False, problem=f"{where}: cannot read: {paths.os_reason(e)}", authenticated=False)
    except MALFORMED as e:
        out.update(valid=False, problem=_malformed(path, e), authenticated=False)
    if problem is None:  # an artifact that failed verification: its fields shown for display, marked INVALID
        try:
            show(read_manifest(path))
        except (TpumkError, OSError) + MALFORMED:
            pass
    return out


def _path_problem(path: Path) -> str | None:
    """Why `path` cannot be an artifact directory, said plainly (None: it may be one)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path}: not an artifact directory (no such file or directory)"
    except (OSError, ValueError) as e:
        why = paths.os_reason(e) if isinstance(e, OSError) else e
        return f"{path}: not an artifact directory (cannot read it: {why})"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{path}: not an artifact directory (a symlink loop)"
            if e.errno == errno.ENOENT:
                return f"{path}: not an artifact directory (a broken symlink)"
            return f"{path}: not an artifact directory (cannot read it: {paths.os_reason(e)})"
    if not stat.S_ISDIR(st.st_mode):
        what = "a regular file" if stat.S_ISREG(st.st_mode) else "a special file"
        return f"{path}: not an artifact directory ({what})"
    mf = path / MANIFEST
    try:
        mst = os.stat(mf)
    except FileNotFoundError:
        return f"{path}: not an artifact directory (no {MANIFEST})"
    except OSError as e:
        return f"{mf}: cannot read: {paths.os_reason(e)}"
    if not stat.S_ISREG(mst.st_mode):
        what = "a directory" if stat.S_ISDIR(mst.st_mode) else "not a regular file"
        return f"{path}: not an artifact directory ({MANIFEST} is {what})"
    return None


def _displayable(m: Any) -> bool:
    """The manifest has the types the summary shows (an unverified one may have any)."""
    if not isinstance(m, dict) or not isinstance(m.get("key"), str):
        return False
    if not all(isinstance(m.get(k), dict) for k in ("model", "target", "shapes", "tuning", "versions", "files")):
        return False
    if not all(isinstance(m.get(k, {}), dict) for k in ("report", "signature", "signing", "mesh")):
        return False
    sh = m["shapes"]
    if not all(isinstance(sh.get(k), int) for k in ("batch", "context", "q_len", "page_size")):
        return False
    return all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
               for e in m["files"].values())


def find_artifacts(root: str | Path) -> list[Path]:
    """The artifact directories (each with a manifest) below `root`, e.g. an `export --out` root
    or one model's directory in it; exports still being written (hidden .tmp-* directories)
    are left out."""
    root = Path(root)
    found = []
    for mf in root.rglob(MANIFEST):
        rel = mf.parent.relative_to(root).parts
        if not any(part.startswith(".") for part in rel):
            found.append(mf.parent)
    return sorted(found)


def inspect_tree(root: str | Path) -> dict[str, Any]:
    """Every artifact below `root` as a short listing (path, model, dtype, weight scheme, batch,
    target, devices, key, valid or why not);
    `valid` is True when every one of them is, `authenticated` when every signature was verified."""
    items = []
    for path in find_artifacts(root):
        info = inspect(path)
        target = info.get("target") or {}
        shapes = info.get("shapes") or {}
        items.append({"path": info["path"], "model": info.get("model"), "dtype": info.get("dtype"),
                      "quant": shapes.get("quant"), "batch": shapes.get("batch"), "target": target.get("name"),
                      "devices": (info.get("mesh") or {}).get("devices"),
                      "key": info.get("key"), "valid": info["valid"], "problem": info["problem"],
                      "signed": info.get("signed", False), "authenticated": info["authenticated"]})
    return {"path": str(Path(root)), "artifacts": items, "valid": all(i["valid"] for i in items),
            "authenticated": bool(items) and all(i["authenticated"] for i in items)}
