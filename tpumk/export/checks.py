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
             "report", "report_json", "timings", "signature", "files", "signing", "mesh", "loads", "draft",
             "program"}
TARGET_FIELDS = {"name", "chip", "topology", "device_kind", "interpret", "export_platform", "kernel_mode"}
KERNEL_MODE = {True: "Pallas discharge interpreter (interpret=True), lowered to XLA CPU ops",
               False: "Mosaic TPU kernel (tpu_custom_call)"}
# a cpu artifact over several devices (tpumk.compile.keys.program_kind): no Pallas kernel
XLA_SPMD_MODE = "none: XLA's SPMD decode step (tpumk.model.xla_step), sharded by XLA's partitioner"
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


def unexportable(target, devices: int, draft: bool = False) -> str | None:
    """Why a build of `target` over `devices` devices cannot be an artifact (None: it can).

    A `cpu` artifact's kernel runs in Pallas' discharge interpreter (interpret=True) so that
    its program serializes. That interpreter (checked on JAX 0.10.2) implements none of the
    many-device kernel's collectives: a remote semaphore signal raises "Remote signal not
    implemented", the barrier semaphore has no discharge rule, and a remote DMA addressed by
    mesh coordinates fails in its discharge rule. The TPU interpreter that runs them (tpumk
    generate --devices N) calls back into Python, so its program cannot be serialized (nor
    does it run across processes). A plain `cpu` build over N devices therefore ships the same
    build's XLA SPMD step (tpumk.compile.keys.program_kind); a round program has no XLA form."""
    if not (target.interpret and devices > 1 and draft):
        return None
    return (f"{target.name}: --draft with --devices {devices} cannot be exported: the many-device verify step's "
            f"in-kernel collectives run only in Pallas' TPU interpreter, whose host callbacks cannot be "
            f"serialized; export the round program for a TPU target (e.g. --target tpu7x), or run it here with "
            f"`tpumk generate --backend megakernel --devices {devices} --draft ...`")


def xla_spmd_refusal(spec) -> str | None:
    """Why a `cpu` N-device build's XLA SPMD step cannot stand in for it (None: it can): the XLA
    step keeps its KV cache in the model dtype, reads float weights, and its artifact carries no
    hybrid's state pool. A build that would silently differ is refused, never shipped."""
    cfg, what = spec.model, f"{spec.target.name} --devices {spec.devices}"
    why = ("a 1-byte KV cache (--kv-dtype)" if spec.kv_dtype else
           f"--quant {spec.quant}" if spec.quant != "none" else
           "linear-attention layers (a state pool)" if cfg.linear else None)
    if why is None:
        return None
    return (f"{what}: exported as XLA's SPMD decode step (the megakernel's collectives do not serialize on the "
            f"cpu target), which has no {why}; export it for one device or a TPU target")


def program_record(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's [program] table for an artifact that does not hold the megakernel (None:
    it does): what program it is, the code that is it, and why."""
    from tpumk.compile.keys import XLA_SPMD

    kind = inputs.get("program")
    if kind is None:
        return None
    if kind != XLA_SPMD:
        raise ArtifactError(f"program kind {kind!r}: this tpumk knows 'megakernel' and '{XLA_SPMD}'")
    return {"kind": kind, "step": "tpumk.model.xla_step.xla_cache_step",
            "sharding": "tpumk.model.xla_spmd.spmd_layout",
            "why": "the megakernel's in-kernel collectives run only in Pallas' TPU interpreter, whose host "
                   "callbacks neither serialize nor run across processes: a cpu build over several devices ships "
                   "the same build's XLA step, sharded over the devices by XLA's SPMD partitioner"}


def xla_spmd_mesh_record(spec) -> dict[str, Any]:
    """The [mesh] table of an XLA SPMD artifact: its portable program runs on any `devices`
    devices (the loading processes' first ones, in jax.devices() order), so no device ids are
    recorded; the sharding is tpumk.model.xla_spmd's layout, one spec per tensor role."""
    from tpumk.model.xla_spmd import AXIS, spmd_layout

    layout = spmd_layout(spec.model, spec.devices)
    return {"devices": spec.devices, "topology": "", "axis": AXIS, "axis_size": spec.devices,
            "sharding": layout.describe()}


def xla_spmd_report(spec) -> dict[str, Any]:
    """The build report of an XLA SPMD artifact: the shapes, the layout's notes and what the
    figures are (none of the megakernel plan's: this program is not the megakernel)."""
    from tpumk.model.xla_spmd import spmd_layout

    layout = spmd_layout(spec.model, spec.devices)
    return {"program": "xla-spmd", "model": spec.model.name, "target": spec.target.name, "batch": spec.batch,
            "context": spec.context, "q_len": spec.q_len, "devices": spec.devices,
            "notes": [*layout.notes, "no plan figures: the program is XLA's decode step, not the megakernel; it "
                                     "compiles when loaded"]}


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
    try:
        program = program_record(inputs)
    except ArtifactError as e:
        c.fail(str(e))
    c.field("program", m.get("program"), program)
    c.field("target.kernel_mode", t.get("kernel_mode"), XLA_SPMD_MODE if program else KERNEL_MODE[target.interpret],
            "its target's")
    if target.device_kind is not None:
        c.field("target.device_kind", t.get("device_kind"), target.device_kind, "its target's")
    devices = inputs["shapes"].get("devices", 1)
    why = unexportable(target, devices, "draft" in inputs) if isinstance(devices, int) else None
    if why:  # export refuses it: only a forged manifest says so
        c.fail(f"not a loadable artifact: {why}")
    from tpumk.compile.keys import program_kind

    try:
        kind = program_kind(spec_from_inputs(inputs))
    except TpumkError as e:
        c.fail(f"its key inputs do not plan: {e}")
    if inputs.get("program", "megakernel") != kind:  # e.g. a cpu N-device build claiming the megakernel
        c.fail(f"not a loadable artifact: its key inputs name the program {inputs.get('program', 'megakernel')!r}, "
               f"a {target.name} build over {devices} device(s) holds {kind!r} (manifest altered)")

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
    if program:
        return _check_xla_spmd(c, m, full, spec_from_inputs(inputs), plan)
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


def _check_xla_spmd(c: _Checker, m: dict[str, Any], full: dict[str, Any], spec, plan):
    """check_fields' second half for an XLA SPMD artifact: its mesh, report and signature."""
    why = xla_spmd_refusal(spec)
    if why:  # export refuses it: only a forged manifest says so
        c.fail(f"not a loadable artifact: {why}")
    if not isinstance(m.get("mesh"), dict):
        c.fail("malformed manifest: 'mesh' is not a table")
    c.field("mesh", m["mesh"], xla_spmd_mesh_record(spec), "the XLA layout's")
    c.field("report", without_none(full), xla_spmd_report(spec), "the build's")
    c.field("signature.inputs_json", m["signature"].get("inputs_json"),
            json.dumps(tree_signature(xla_spmd_program_specs(spec))), "the XLA step's")
    return plan


def xla_spmd_program_specs(spec) -> tuple:
    """The (global, unsharded) argument shapes of an XLA SPMD artifact's step."""
    from tpumk.model.xla_step import xla_cache_specs

    return xla_cache_specs(spec.model, spec.batch, spec.context, spec.q_len)


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
