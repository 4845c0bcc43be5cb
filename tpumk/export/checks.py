"""The manifest checked against itself: every redundant field must equal what its key inputs say.

`cache_key.inputs_json` is the manifest's one authoritative record (its sha256 is the key, and
the key is the directory's name). Every other field that can be derived from it is re-derived
and compared: model, target (and what the target registry says about it), shapes, tuning,
versions, the plan figures of the build report, the step's input signature and the mesh (devices,
topology, mesh axis, device order, sharding). An edited field is refused with one line naming
it, with or without a signing key. What cannot be re-derived (measured compile times, the
estimate, the creation time) is covered only by a signature.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from tpumk.compile.keys import cache_key
from tpumk.compat import release
from tpumk.errors import ArtifactError, TpumkError

TOP_LEVEL = {"format", "key", "created_unix", "model", "target", "shapes", "tuning", "versions", "cache_key",
             "report", "report_json", "timings", "signature", "files", "signing", "mesh", "loads", "draft"}
TARGET_FIELDS = {"name", "chip", "topology", "device_kind", "interpret", "export_platform", "kernel_mode"}
KERNEL_MODE = {True: "Pallas discharge interpreter (interpret=True), lowered to XLA CPU ops",
               False: "Mosaic TPU kernel (tpu_custom_call)"}
# report figures the plan decides (the rest are measured at export: only a signature covers them)
PLAN_REPORT = ("model", "target", "batch", "context", "q_len", "vmem_bytes", "vmem_budget_bytes",
               "vmem_capacity_bytes", "hbm_bytes_per_step", "floor_seconds", "tuning", "devices", "topology",
               "mesh", "sharding", "hbm_bytes_by_part", "state_pool")
_HEX64 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------- which stack loads which payload
# The serialized executable is tied to the jaxlib and libtpu that compiled it. jax.export's
# serialization is backward compatible: a newer jax loads an older one's program (jax's promise;
# a tiny-dense cpu artifact exported under jax 0.10.2 loaded under 0.11.2, the vLLM TPU set of
# docs/install.md, and its step gave the reference's logits to 1.7e-6: checked 2026-12-04),
# never the other way round. tpumk's own version is the same on both sides (its code reads the
# manifest and packs the weights).
def loads_of(versions: dict[str, Any]) -> dict[str, str]:
    """The manifest's [loads] table: which JAX stack may load each payload."""
    v = versions
    return {"executable": f"tpumk {v.get('tpumk')} with jax {v.get('jax')}, jaxlib {v.get('jaxlib')} and libtpu "
                          f"{v.get('libtpu')} exactly",
            "exported": f"tpumk {v.get('tpumk')} with jax {v.get('jax')} or newer (jax.export's backward "
                        "compatibility)"}


def why_not_loadable(path: Path, built: dict[str, Any], here: dict[str, Any], payload: str) -> str | None:
    """Why this environment (`here`, tpumk.compile.keys.stack_versions) may not load `payload`
    ("executable" or "exported") of an artifact built with `built`, in one line; None if it may."""
    if built.get("tpumk") != here.get("tpumk"):
        return f"{path}: built with tpumk {built.get('tpumk')}, this environment has tpumk {here.get('tpumk')} (re-export)"
    if payload == "exported":
        if release(here.get("jax")) < release(built.get("jax")):
            return (f"{path}: its exported program was built with jax {built.get('jax')}, this environment has jax "
                    f"{here.get('jax')}: jax.export loads a program only under the jax that serialized it or a "
                    "newer one (re-export)")
        return None
    for dist in ("jax", "jaxlib", "libtpu"):
        if built.get(dist) != here.get(dist):
            also = (f"; use='exported' loads its jax.export program under jax {built.get('jax')} or newer"
                    if release(here.get("jax")) >= release(built.get("jax")) else "")
            return (f"{path}: built with {dist} {built.get(dist)}, this environment has {dist} "
                    f"{here.get(dist, 'not installed')}: its executable loads only under the same jax, jaxlib and "
                    f"libtpu{also} (or re-export)")
    return None


def export_platform(interpret: bool) -> str:
    return "cpu" if interpret else "tpu"


def unexportable(target, devices: int) -> str | None:
    """Why a build of `target` over `devices` devices cannot be an artifact (None: it can).

    A `cpu` artifact's kernel runs in Pallas' discharge interpreter (interpret=True) so that
    its program serializes. That interpreter (checked on JAX 0.10.2) implements none of the
    many-device kernel's collectives: a remote semaphore signal raises "Remote signal not
    implemented", the barrier semaphore has no discharge rule, and a remote DMA addressed by
    mesh coordinates fails in its discharge rule. The TPU interpreter that runs them (tpumk
    generate --devices N) calls back into Python, so its program cannot be serialized."""
    if not (target.interpret and devices > 1):
        return None
    from tpumk.compile.keys import stack_versions

    return (f"{target.name}: --devices {devices} cannot be exported: the many-device step's in-kernel "
            f"collectives (remote DMAs and semaphore signals, the barrier semaphore) run only in Pallas' TPU "
            f"interpreter, whose host callbacks cannot be serialized, and the discharge interpreter (interpret=True) "
            f"of jax {stack_versions().get('jax', '?')} does not implement them; export for a TPU target "
            f"(e.g. --target tpu7x), or run it here with `tpumk generate --backend megakernel --devices {devices}`")


def mesh_record(plan, devices=None) -> dict[str, Any]:
    """The manifest's [mesh] table for a plan: devices and the topology compiled for; on many
    devices also the mesh axis and its size, the device order (ids, chip coordinates and core
    on the chip, in mesh order: the executable runs on exactly those device ids) and how the
    model is split. `devices`: the mesh's devices in order; default the ones tpumk compiles
    this plan for (`tpumk.targets.mesh_devices`: attached ones of the kind, else the
    deviceless topology's)."""
    from tpumk.targets import topology_for

    n, target = plan.devices, plan.target
    rec: dict[str, Any] = {"devices": n, "topology": topology_for(target, n) or ""}
    if n == 1:
        return rec
    from tpumk.plan.sharding import MESH_AXIS
    from tpumk.targets import mesh_devices

    devices = list(mesh_devices(target, n) if devices is None else devices)
    rec.update(axis=MESH_AXIS, axis_size=n, device_ids=[int(d.id) for d in devices],
               device_coords=[[int(c) for c in getattr(d, "coords", ())] for d in devices],
               core_on_chip=[int(getattr(d, "core_on_chip", 0)) for d in devices],
               sharding=without_none(plan.sharding.summary(plan.whole_model)))
    return rec


def report_mesh(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The build report's `mesh` (tpumk.build.make_report) for a [mesh] table."""
    if rec["devices"] == 1:
        return None
    return {"axes": {rec["axis"]: rec["axis_size"]}, "device_ids": rec["device_ids"],
            "device_coords": rec["device_coords"]}


def without_none(v: Any) -> Any:
    """TOML has no null: None values are left out (the canonical JSON keeps them)."""
    if isinstance(v, dict):
        return {str(k): without_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [without_none(x) for x in v if x is not None]
    return v


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class _Checker:
    def __init__(self, path: Path):
        self.mf = path / "manifest.toml"

    def fail(self, msg: str):
        raise ArtifactError(f"{self.mf}: {msg}")

    def field(self, name: str, got: Any, want: Any, what: str = "the key inputs'") -> None:
        if isinstance(got, dict) and isinstance(want, dict):
            for k in sorted(set(got) | set(want)):
                if k not in got:
                    self.fail(f"field '{name}.{k}' is missing (the key inputs have {_short(want[k])}; manifest altered)")
                if k not in want:
                    self.fail(f"field '{name}.{k}' = {_short(got[k])} is not among the key inputs (manifest altered)")
                self.field(f"{name}.{k}", got[k], want[k], what)
            return
        if not _same(got, want):
            self.fail(f"field '{name}' = {_short(got)} does not match {what} {_short(want)} (manifest altered)")


def key_inputs_of(path: Path, m: dict[str, Any]) -> dict[str, Any]:
    """The manifest's key inputs, checked to be its key and its directory's name."""
    c = _Checker(path)
    ck = m.get("cache_key")
    if not isinstance(ck, dict) or not isinstance(ck.get("inputs_json"), str):
        c.fail("malformed manifest: bad cache_key.inputs_json")
    try:
        inputs = json.loads(ck["inputs_json"])
    except (ValueError, RecursionError):  # bad JSON, an integer of thousands of digits, deep nesting
        c.fail("malformed manifest: bad cache_key.inputs_json")
    if not isinstance(inputs, dict) or not all(isinstance(inputs.get(f), dict)
                                               for f in ("model", "target", "shapes", "tuning", "versions")):
        c.fail("malformed manifest: cache_key.inputs_json lacks model, target, shapes, tuning or versions")
    key = m.get("key")
    if not isinstance(key, str) or cache_key(inputs) != key:
        c.fail(f"cache key {str(key)[:12]}... does not match its own inputs (manifest altered)")
    if ck.get("key") != key:
        c.fail(f"field 'cache_key.key' = {_short(ck.get('key'))} is not the artifact's key {key[:12]}... "
               "(manifest altered)")
    if path.name != key:
        raise ArtifactError(f"{path}: the directory's name is not the artifact's key {key[:12]}... (an artifact "
                            "lives in OUT/<model>/<target>/<key>/: renamed, or its manifest replaced)")
    return inputs


def check_fields(path: Path, m: dict[str, Any], inputs: dict[str, Any]):
    """Every redundant manifest field against the key inputs (ArtifactError naming the first that
    differs). Returns the plan the key inputs make (re-planned to check the report and the step's
    signature; `load` reuses it). The manifest has every table (artifacts._parse_manifest)."""
    from tpumk.targets import get_target

    c = _Checker(path)
    unknown = sorted(set(m) - TOP_LEVEL)
    if unknown:
        c.fail(f"unknown field '{unknown[0]}' (manifest altered, or written by another tpumk)")
    for name in ("model", "target", "shapes", "tuning", "versions", "files", "signature", "report"):
        if not isinstance(m.get(name, {}), dict):
            c.fail(f"malformed manifest: '{name}' is not a table")
    c.field("model", m["model"], without_none(inputs["model"]))
    c.field("shapes", m["shapes"], inputs["shapes"])
    c.field("tuning", m["tuning"], without_none(inputs["tuning"]))
    c.field("versions", m["versions"], inputs["versions"])
    c.field("loads", m.get("loads"), loads_of(inputs["versions"]))
    if "draft" in m or "draft" in inputs:  # a round artifact: the drafter its key names
        if not isinstance(m.get("draft"), dict):
            c.fail("field 'draft' is missing or not a table (manifest altered)" if "draft" in inputs else
                   "field 'draft' is not among the key inputs (manifest altered)")
        c.field("draft", m["draft"], without_none(inputs.get("draft")))

    t, ti = m["target"], inputs["target"]
    extra = sorted(set(t) - TARGET_FIELDS)
    if extra:
        c.fail(f"unknown field 'target.{extra[0]}' (manifest altered)")
    for f in ("name", "chip", "interpret"):
        c.field(f"target.{f}", t.get(f), ti.get(f))
    c.field("target.topology", t.get("topology"), ti.get("topology") or "")
    try:
        target = get_target(ti["name"])
    except TpumkError as e:
        c.fail(f"target {ti['name']!r}: {e}")
    for f in ("chip", "interpret"):
        c.field(f"target.{f}", t.get(f), getattr(target, f), f"the {target.name} target's")
    c.field("target.topology", t.get("topology"), target.topology or "", f"the {target.name} target's")
    c.field("target.export_platform", t.get("export_platform"), export_platform(target.interpret), "its target's")
    c.field("target.kernel_mode", t.get("kernel_mode"), KERNEL_MODE[target.interpret], "its target's")
    if target.device_kind is not None:
        c.field("target.device_kind", t.get("device_kind"), target.device_kind, "its target's")
    devices = inputs["shapes"].get("devices", 1)
    why = unexportable(target, devices) if isinstance(devices, int) else None
    if why:  # export refuses it: only a forged manifest says so
        c.fail(f"not a loadable artifact: {why}")

    for name, entry in m["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or not _HEX64.fullmatch(entry["sha256"]) or not isinstance(entry.get("bytes"), int):
            c.fail(f"malformed manifest: bad files entry '{name}'")

    # the build report: its table is its JSON minus the plan; the plan's figures are re-planned
    rj = m["report_json"]
    try:
        full = json.loads(rj) if isinstance(rj, str) else None
    except (ValueError, RecursionError):
        full = None
    if not isinstance(full, dict):
        c.fail("malformed manifest: bad report_json")
    c.field("report", m["report"], without_none({k: v for k, v in full.items() if k != "plan"}), "report_json's")
    plan = _plan(c, inputs)
    # the mesh: what this tpumk compiles the plan for (the deviceless topology's devices, or the
    # attached ones of its kind), device order included, and how the model is split
    if not isinstance(m.get("mesh"), dict):
        c.fail("malformed manifest: 'mesh' is not a table")
    try:
        mesh = mesh_record(plan)
    except TpumkError as e:
        c.fail(f"its mesh cannot be rebuilt here: {e}")
    c.field("mesh", m["mesh"], mesh, "the plan's")
    from tpumk.build import hbm_parts, state_pool_figures

    want = {"model": plan.whole_model.name, "target": plan.target.name, "batch": plan.batch,
            "context": plan.context, "q_len": plan.q_len, "vmem_bytes": plan.vmem_total,
            "vmem_budget_bytes": plan.vmem_budget, "vmem_capacity_bytes": plan.target.vmem_bytes,
            "hbm_bytes_per_step": plan.hbm_bytes, "floor_seconds": plan.floor_seconds,
            "tuning": without_none(plan.tuning.to_dict()), "devices": plan.devices,
            "topology": mesh["topology"] or None, "mesh": report_mesh(mesh),
            "sharding": mesh.get("sharding"), "hbm_bytes_by_part": hbm_parts(plan),
            "state_pool": state_pool_figures(plan)}
    for f in PLAN_REPORT:
        c.field(f"report.{f}", without_none(full.get(f)), want[f], "the plan's")

    draft = spec_from_inputs(inputs).draft
    sig = m["signature"]
    c.field("signature.inputs_json", sig.get("inputs_json"), json.dumps(tree_signature(program_specs(plan, draft))),
            "the plan's")
    in_tree, out_tree = program_trees(plan, draft)
    c.field("signature.executable_in_tree", sig.get("executable_in_tree"), str(in_tree), "the plan's")
    c.field("signature.executable_out_tree", sig.get("executable_out_tree"), str(out_tree), "the plan's")
    return plan


def spec_from_inputs(inputs: dict[str, Any]):
    """The BuildSpec recorded cache-key inputs describe (what an artifact was built from)."""
    from tpumk.plan.spec import BuildSpec

    return BuildSpec.from_dict({"model": inputs["model"], "target": inputs["target"]["name"], **inputs["shapes"],
                                "tuning": inputs["tuning"], **({"draft": inputs["draft"]} if "draft" in inputs else {})},
                               "artifact manifest")


def _plan(c: _Checker, inputs: dict[str, Any]):
    from tpumk.plan.plan import make_plan

    try:
        return make_plan(spec_from_inputs(inputs))
    except TpumkError as e:
        c.fail(f"its key inputs do not plan: {e}")
    except (KeyError, TypeError, ValueError) as e:
        c.fail(f"malformed manifest: key inputs: {type(e).__name__}: {e}")


def tree_signature(tree: Any) -> list[dict[str, Any]]:
    """Each leaf's path, shape and dtype: what a manifest records of a step's inputs and outputs."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [{"path": jax.tree_util.keystr(p), "shape": list(x.shape), "dtype": str(x.dtype)} for p, x in leaves]


def program_specs(plan, draft=None) -> tuple:
    """The argument shapes of the program an artifact holds: the decode step's (`step_specs`), or
    with `draft` (a RoundSpec) the round program's (`tpumk.compile.aot.round_specs`)."""
    if draft is None:
        from tpumk.kernel.megakernel import step_specs

        return step_specs(plan)
    from tpumk.compile.aot import round_specs

    return round_specs(plan, draft.drafter, draft.settings(plan.context))


def program_trees(plan, draft=None) -> tuple:
    """(in_tree, out_tree) of the compiled program an artifact holds: `step_trees`, or a round
    program's (its four arguments; the Carry it returns). Rebuilt from the plan on load."""
    if draft is None:
        return step_trees(plan)
    import jax

    specs = program_specs(plan, draft)
    return jax.tree.structure((specs, {})), jax.tree.structure(specs[3])


def step_trees(plan) -> tuple:
    """The (in_tree, out_tree) a compiled decode step of this plan has: jit's ((args), {}) and
    (logits, KVCache) (a hybrid's cache with its state pool). Rebuilt from the plan on load
    rather than unpickled from the artifact."""
    import jax

    from tpumk.kernel.megakernel import step_specs
    from tpumk.model.linear_attention import LinearStates
    from tpumk.model.reference import KVCache, QuantizedKVCache

    states = LinearStates(0, 0, 0, 0, 0) if plan.linear is not None else None
    cache = QuantizedKVCache(0, 0, 0, plan.attention.kv_layout, states) if plan.attention.quantized \
        else KVCache(0, 0, 0, 0, states)
    return jax.tree.structure((step_specs(plan), {})), jax.tree.structure((0, cache))
