"""`tpumk export`, `tpumk cache-key`, `tpumk inspect`: click commands over tpumk.export.artifacts."""

from __future__ import annotations

import click

from tpumk.cli.options import echo, emit_json, fail_cleanly, spec_options
from tpumk.cli.units import duration, size


@click.command()
@spec_options(draft=True)
@click.option("--out", "out_dir", default="artifacts", show_default=True, type=click.Path(),
              help="Artifact root: OUT/<model>/<target>/<key>/.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def export(spec, draft_params, out_dir, as_json):
    """Compile the decode step (with --draft: the speculative round program) and write it as a
    content-addressed artifact (cache hit: no compile).

    Signed whenever a signing key is configured (TPUMK_SIGNING_KEY, or TPUMK_SIGNING_KEY_FILE
    naming a file that holds it): manifest.sig holds an HMAC-SHA256 of manifest.toml, which lists
    every file's sha256. With a key configured, a cache hit on an unsigned artifact is refused."""
    from tpumk.cli.progress import Phases
    from tpumk.export.artifacts import export as do_export

    r = do_export(spec, out_dir=out_dir, progress=Phases("tpumk export"), draft_params=draft_params)
    if as_json:
        emit_json(r.to_dict())
        return
    what = "cache hit, nothing compiled" if r.cache_hit else f"exported in {r.seconds:.2f} s"
    signed = r.manifest.get("signing", {})
    echo(f"{r.path} ({what})")
    echo(f"  devices: {_devices_line(r.manifest.get('mesh', {}))}")
    echo(f"  signed:  key id {signed.get('key_id')}" if signed.get("signed") else
               "  signed:  no (no signing key configured: set TPUMK_SIGNING_KEY to sign)")
    echo(f"  kernel: {r.manifest['target'].get('kernel_mode', 'n/a')}")
    if "program" in r.manifest:
        echo(f"  program: {_program_line(r.manifest['program'])}")
    if "draft" in r.manifest:
        echo(f"  round program: {_draft_line(r.manifest['draft'])}")
    for name, entry in r.manifest["files"].items():
        echo(f"  {name}: {entry['bytes']:,} bytes, sha256 {entry['sha256'][:16]}...")


@click.command("cache-key")
@spec_options(draft=True)
@click.option("--out", "out_dir", type=click.Path(),
              help="Print the artifact directory `tpumk export --out OUT` would write, not the bare key.")
@click.option("--with-signing", is_flag=True,
              help="Append the signing state to the key (-unsigned, or -signed-<key id>): the key a CI cache "
                   "should use, so turning signing on or rotating the key never restores an artifact "
                   "`inspect` would then refuse.")
@click.option("--json", "as_json", is_flag=True, help="Print the key and everything it covers.")
@fail_cleanly
def cache_key(spec, draft_params, out_dir, with_signing, as_json):
    """Print the build's cache key (no compile; with --draft, the round program's, which covers the
    drafter: its weights are read to hash them)."""
    from tpumk.export.artifacts import artifact_path, check_exportable
    from tpumk.export.paths import check_names, check_out_dir
    from tpumk.compile.keys import cache_key as key_of, key_inputs

    if out_dir is not None:  # the directory names first, as export checks them
        check_names(spec.model.name, spec.target.name)
    check_exportable(spec)  # no key for an artifact export refuses to write
    inputs = key_inputs(spec)
    key = key_of(inputs)
    path = None
    if out_dir is not None:
        final = artifact_path(out_dir, spec, key)
        check_out_dir(out_dir, final.parent, probe=False)  # what export checks, short of writing
        path = str(final)
    from tpumk.export.signing import configured_key

    sign_key = configured_key()  # a misconfigured key is refused here as export would refuse it
    signing = f"signed-{sign_key.key_id}" if sign_key is not None else "unsigned"
    if as_json:
        emit_json({"key": key, "path": path, "signing": signing, "inputs": inputs})
    elif with_signing and path is None:
        echo(f"{key}-{signing}")
    else:
        echo(path or key)


@click.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def inspect(path, as_json):
    """Show an artifact's manifest summary and verify it: its signature when a signing key is
    configured (TPUMK_SIGNING_KEY / TPUMK_SIGNING_KEY_FILE; then an unsigned artifact is invalid),
    its fields against its key inputs, every file's sha256, the stack versions. Without a key it
    says what that does not prove: who wrote the manifest.

    PATH may also be a directory holding artifacts below it (the `export --out` root, or a
    model's or target's directory in it): every artifact there is listed and verified. The exit
    code is 1 when any artifact listed is invalid, or PATH holds none."""
    from pathlib import Path

    from tpumk.export.artifacts import MANIFEST, find_artifacts, inspect_tree
    from tpumk.export.artifacts import inspect as do_inspect

    try:
        tree = Path(path).is_dir() and not (Path(path) / MANIFEST).exists() and bool(find_artifacts(path))
    except (OSError, RecursionError):  # an unreadable tree: inspect PATH itself, which reports why
        tree = False
    if tree:
        listing = inspect_tree(path)
        if as_json:
            emit_json(listing)
        else:
            _print_listing(listing)
        if not listing["valid"]:
            bad = [i for i in listing["artifacts"] if not i["valid"]]
            _fail_inspect(f"{len(bad)} of {len(listing['artifacts'])} artifacts under {path} invalid; "
                          f"first: {bad[0]['problem']}")
        return
    info = do_inspect(path)
    if as_json:
        emit_json(info)
    else:
        _print_inspect(info)
    if not info["valid"]:
        _fail_inspect(info["problem"])


def _draft_line(d) -> str:
    """The manifest's [draft] table in one line (an unverified manifest's may hold anything)."""
    try:
        s, w = d["drafter"], d["weights"]
        weights = (f"weights sha256 {w['sha256'][:16]}..." if "sha256" in w
                   else f"random weights, seed {w.get('random_seed')}")
        how = "greedy" if not d["temperature"] else f"temperature {d['temperature']:g}"
        n = s["layer"]["num_layers"]
        return (f"{s['kind']} drafter ({n} layer{'s' if n != 1 else ''}, taps {s['taps']}, {weights}), {s['block']} "
                f"drafts a round, {d['rounds_per_call']} rounds a call, {how}")
    except (KeyError, TypeError, ValueError, AttributeError):
        return "? (the [draft] table is malformed)"


def _program_line(program) -> str:
    """The manifest's [program] (absent: the megakernel) in one line."""
    if not isinstance(program, dict) or program.get("kind") == "megakernel":
        return "megakernel (the Pallas decode step)" if not isinstance(program, dict) or len(program) == 1 else "?"
    return f"{program.get('kind')}: {program.get('step')}, sharded by {program.get('sharding')} ({program.get('why')})"


def _devices_line(mesh: dict, kind=None) -> str:
    """The manifest's [mesh] in one line (an unverified manifest's may hold anything)."""
    n = mesh.get("devices")
    if n == 1:
        return "1 (no mesh)"
    if not isinstance(n, int):
        return "? (no [mesh] table)"
    if "device_ids" not in mesh and "axis" in mesh:  # a portable program (XLA's SPMD step): any n devices
        return f"{n}{f' x {kind}' if kind else ''}, mesh {mesh.get('axis')}={mesh.get('axis_size')} (any {n} devices)"
    try:
        order = ", ".join(f"{i}@{tuple(c)}/{core}" for i, c, core in
                          zip(mesh["device_ids"], mesh["device_coords"], mesh["core_on_chip"]))
    except (KeyError, TypeError):
        order = "?"
    return (f"{n}{f' x {kind}' if kind else ''}, mesh {mesh.get('axis')}={mesh.get('axis_size')} on "
            f"{mesh.get('topology')}; device order id@(chip coords)/core: {order}")


def _sharding_line(sh: dict) -> str:
    if sh and all(isinstance(v, str) for v in sh.values()):  # XLA's SPMD layout: a PartitionSpec per tensor role
        return ", ".join(f"{k} {v}" for k, v in sh.items())
    parts = []
    a = sh.get("attention")
    if isinstance(a, dict) and "heads_per_device" in a:  # MLA
        parts.append(f"heads {a.get('heads_per_device')}/device, q_a / kv_a "
                     + ("split by columns" if "split_by_columns" in a else "replicated"))
    elif isinstance(a, dict):
        parts.append(f"q heads {a.get('q_heads_per_device')}/device, kv heads {a.get('kv_heads_per_device')}/device "
                     f"(x{a.get('kv_replicas')} replicas)")
    for name, what in (("dense_ffn", "width_per_device"), ("shared_experts", "width_per_device")):
        if isinstance(sh.get(name), dict):
            parts.append(f"{name} {sh[name].get(what)}/device")
    e = sh.get("experts")
    if isinstance(e, dict):
        parts.append(f"experts {e.get('mode')} (ep {e.get('expert_parallel')} x et {e.get('expert_tensor')}: "
                     f"{e.get('experts_per_device')} experts of width {e.get('expert_width_per_device')}/device)")
    if isinstance(sh.get("lm_head"), dict):
        parts.append(f"lm_head {sh['lm_head'].get('columns_per_device')} columns/device")
    return "; ".join(parts) or "?"


def _fail_inspect(problem) -> None:
    """The report is on stdout; the error is one line on stderr, exit code 1 (README)."""
    import sys

    from tpumk.cli.options import INPUT_EXIT, error_line

    error_line(problem or "invalid artifact")
    sys.exit(INPUT_EXIT)


def _short_problem(item: dict) -> str:
    """The problem without the artifact's own path in front (the row already shows it)."""
    problem, path = item["problem"] or "", item["path"]
    return problem.replace(path + "/", "").removeprefix(path + ": ")


def _print_listing(listing: dict) -> None:
    from tabulate import tabulate

    items = listing["artifacts"]
    bad = sum(not i["valid"] for i in items)
    if bad:
        status = f", {bad} invalid"
    elif listing.get("authenticated"):
        status = ", all valid (signatures verified; fields, hashes and versions checked)"
    else:
        status = (", all valid (fields, hashes and versions checked; manifests not authenticated: "
                  "set TPUMK_SIGNING_KEY to verify signatures)")
    echo(f"{listing['path']}: {len(items)} artifact{'s' if len(items) != 1 else ''}" + status)
    rows = [[i["path"], i["model"] or "?", i.get("dtype") or "?", i.get("quant") or "?", i.get("batch") or "?",
             i["target"] or "?", i.get("devices") or "?", (i["key"] or "?")[:12],
             "valid" if i["valid"] else f"INVALID: {_short_problem(i)}"] for i in items]
    echo(tabulate(rows, headers=["path", "model", "dtype", "quant", "batch", "target", "devices", "key", "status"],
                  tablefmt="simple"))
    echo("details of one: tpumk inspect PATH")


def _print_inspect(info: dict) -> None:
    from tpumk.plan.knobs import TuningConfig

    echo(info["path"])
    if "key" not in info:
        echo(f"  INVALID: {info['problem']}")
        return
    t, sh, rep = info["target"], info["shapes"], info.get("report", {})
    echo(f"  key       {info['key']}")
    kv = f", KV {sh['kv_dtype']}" if sh.get("kv_dtype") else ""
    echo(f"  model     {info['model']} ({info.get('dtype')}, weights {sh.get('quant', 'none')}{kv})   target "
         f"{t.get('name')} ({t.get('device_kind')})   batch {sh['batch']}  context {sh['context']}  q_len "
         f"{sh['q_len']}  page {sh['page_size']}")
    echo(f"  kernel    {t.get('kernel_mode', 'n/a')}")
    echo(f"  program   {_program_line(info.get('program'))}")
    if isinstance(info.get("draft"), dict):
        echo(f"  rounds    {_draft_line(info['draft'])} (tpumk.load_rounds)")
    echo(f"  devices   {_devices_line(info.get('mesh') or {}, t.get('device_kind'))}")
    sharding = (info.get("mesh") or {}).get("sharding")
    if isinstance(sharding, dict):
        echo(f"  sharding  {_sharding_line(sharding)}")
    default = TuningConfig().to_dict()
    changed = {k: v for k, v in info.get("tuning", {}).items() if default.get(k) != v}
    echo(f"  tuning    {changed or 'defaults'}")
    if rep.get("program") == "xla-spmd":
        echo("  build     " + "; ".join(map(str, rep.get("notes") or [])))
    elif rep:
        est = rep.get("estimated_seconds")
        try:  # an unverified manifest's report may hold anything
            line = (f"  build     compile {rep.get('compile_seconds', 0):.2f} s (measured), VMEM "
                    f"{rep.get('vmem_bytes', 0) / 2**20:.1f} MiB, HBM {size(rep.get('hbm_bytes_per_step', 0))}"
                    f"/step, floor {duration(rep.get('floor_seconds', 0))} (plan), estimate "
                    + (f"{duration(est)} ({rep.get('estimate_source', '')[:60]}...)" if est else
                       f"none ({rep.get('estimate_source', 'not requested')})"))
        except (TypeError, ValueError):
            line = "  build     (the report's figures are not numbers)"
        echo(line)
    echo("  versions  " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    for name, entry in info["files"].items():
        echo(f"  file      {name}: {entry['bytes']:,} bytes, sha256 {entry['sha256'][:16]}...")
    if info["valid"]:
        sig = info.get("signing") or {}
        echo("  signed    " + (f"yes, key id {sig.get('key_id')} ({'verified' if sig.get('verified') else 'not checked: no key configured'})"
                                    if sig.get("signed") else "no"))
        echo(f"  valid: {info['proved']}")
    else:
        echo(f"  INVALID: {info['problem']}")
