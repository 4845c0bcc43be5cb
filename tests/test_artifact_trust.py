"""Artifact trust and safety: signatures, edited manifests, path escapes, stale temporaries, --out.

Each defect of the "Hardening" issue is reproduced here and must be refused with one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w
from click.testing import CliRunner

from artifact_helpers import copy_artifact, edit_manifest

from tpumk.cli import main
from tpumk.errors import ArtifactError, ArtifactPathError, SignatureError, SigningKeyError
from tpumk.export import artifacts as A
from tpumk.export import paths, signing
from tpumk.model.config import load_preset
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

KEY = "3f1c0e8a9b7d6c5e4f3a2b1c0d9e8f7a"  # 32 bytes of text
OTHER_KEY = "a" * 32
CPU_ARGS = ["--model", "tiny-dense", "--target", "cpu", "--context", "32"]


def _spec() -> BuildSpec:
    return BuildSpec(load_preset("tiny-dense"), get_target("cpu"), batch=1, context=32, tuning=TuningConfig(),
                     q_len=1, page_size=16)


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    for var in (signing.KEY_ENV, signing.KEY_FILE_ENV, signing.REQUIRE_ENV):
        monkeypatch.delenv(var, raising=False)


def _pin_key_inputs(monkeypatch, inputs=None) -> str:
    """Pin what export's key covers (other work editing tpumk's source mid-run would otherwise
    change the key between two calls); returns the key."""
    inputs = inputs if inputs is not None else A.key_inputs(_spec())
    monkeypatch.setattr(A, "key_inputs", lambda spec: inputs)
    return A.cache_key(inputs)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One unsigned and one signed cpu export. Before the signed one, stale temporaries of
    'killed exports' are planted in the directory it writes to."""
    saved = {v: os.environ.pop(v, None) for v in (signing.KEY_ENV, signing.KEY_FILE_ENV, signing.REQUIRE_ENV)}
    try:
        unsigned = A.export(_spec(), out_dir=tmp_path_factory.mktemp("unsigned"))
        out = tmp_path_factory.mktemp("signed")
        parent = out / "tiny-dense" / "cpu"
        parent.mkdir(parents=True)
        host = paths._host_tag()
        planted = {
            "dead": parent / f".tmp-{unsigned.key[:16]}.{_dead_pid()}.{host}.abc",
            "old": parent / f".tmp-{unsigned.key[:16]}-legacy",  # the old naming: no pid, only its age
            "live": parent / f".tmp-{unsigned.key[:16]}.{os.getppid()}.{host}.xyz",
            "fresh_other_host": parent / f".tmp-{unsigned.key[:16]}.{_dead_pid()}.00000000.def",
            # not tpumk's (no marker): a user's directories that merely share the name pattern
            "foreign_old": parent / f".tmp-{unsigned.key[:16]}-mine",
            "foreign_dead": parent / f".tmp-{unsigned.key[:16]}.{_dead_pid()}.{host}.usr",
        }
        for name, p in planted.items():
            p.mkdir()
            (p / A.EXECUTABLE).write_bytes(b"x" * 1000)
            if not name.startswith("foreign"):  # what a killed tpumk export leaves: its marker
                (p / paths.TMP_MARKER).write_bytes(paths.TMP_MARKER_TEXT)
        old = time.time() - 2 * paths.STALE_SECONDS
        for name in ("old", "foreign_old"):
            os.utime(planted[name], (old, old))
        os.environ[signing.KEY_ENV] = KEY
        signed = A.export(_spec(), out_dir=out)
    finally:
        os.environ.pop(signing.KEY_ENV, None)
        for v, val in saved.items():
            if val is not None:
                os.environ[v] = val
    return {"unsigned": unsigned, "signed": signed, "planted": planted}


def _plant_pickle(d: Path, marker: Path) -> None:
    """The attack: executable.bin replaced by a pickle whose __reduce__ runs a shell command,
    its sha256 and size fixed in manifest.toml."""

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    blob = pickle.dumps(Evil())
    (d / A.EXECUTABLE).write_bytes(blob)

    def fix(m):
        m["files"][A.EXECUTABLE] = {"sha256": A.hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}

    edit_manifest(d, fix)


def _one_line_error(r) -> str:
    assert r.exit_code == 1, r.output
    err = r.stderr.strip()
    assert err.startswith("tpumk: error: ") and "\n" not in err and "Traceback" not in r.output, err
    return err


def _cli(args, env=None):
    return CliRunner().invoke(main, args, env=env)


# ---------------------------------------------------------------------- code execution on load
def test_pickle_attack_refused_with_a_key(exported, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    d = copy_artifact(exported["signed"], tmp_path)
    _plant_pickle(d, marker)
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    for use in ("executable", "auto", "exported"):
        with pytest.raises(SignatureError, match="signature does not match manifest.toml"):
            A.load(d, use=use)
    r = _cli(["inspect", str(d)])
    assert r.exit_code == 1 and "INVALID" in r.output and "signature does not match" in r.output
    # the attacker also drops the signature and marks the manifest unsigned
    (d / A.SIGNATURE).unlink()
    edit_manifest(d, lambda m: m.update(signing={"signed": False}))
    with pytest.raises(SignatureError, match=r"not signed \(no manifest.sig\) and TPUMK_SIGNING_KEY is set"):
        A.load(d, use="executable")
    assert not marker.exists()


def test_pickle_attack_without_a_key_is_reported_unauthenticated_and_refused_when_required(
        exported, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    d = copy_artifact(exported["unsigned"], tmp_path)
    _plant_pickle(d, marker)
    r = _cli(["inspect", str(d)])  # hashes match: inspect must not claim more than that
    assert r.exit_code == 0
    assert "the manifest itself is not authenticated (unsigned)" in r.output
    assert "set TPUMK_SIGNING_KEY to verify signatures" in r.output
    assert "valid (hashes and versions checked)" not in r.output
    monkeypatch.setenv(signing.REQUIRE_ENV, "1")  # a fleet whose key failed to mount
    with pytest.raises(SigningKeyError, match="TPUMK_REQUIRE_SIGNED is set but no signing key"):
        A.load(d, use="executable")
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    with pytest.raises(SignatureError, match="not signed"):
        A.load(d, use="executable")
    assert not marker.exists()


def test_swap_after_verify_is_caught_before_deserializing(exported, tmp_path, monkeypatch):
    """load hashes the bytes it deserializes: a file swapped between verify and read is refused."""
    marker = tmp_path / "pwned"
    d = copy_artifact(exported["signed"], tmp_path)
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    real_verify = A._verify  # what load runs (it reuses the plan verify makes)

    def verify_then_swap(path, *a, **k):
        verified = real_verify(path, *a, **k)
        (Path(path) / A.EXECUTABLE).write_bytes(pickle.dumps("not the executable"))
        return verified

    monkeypatch.setattr(A, "_verify", verify_then_swap)
    with pytest.raises(ArtifactError, match="changed since it was verified"):
        A.load(d, use="executable")
    assert not marker.exists()


# ---------------------------------------------------------------------- signed / unsigned / keys
def test_signed_artifact_verifies_with_its_key_and_is_refused_with_another(exported, tmp_path, monkeypatch):
    res = exported["signed"]
    m = A.read_manifest(res.path)
    assert m["signing"]["signed"] and (res.path / A.SIGNATURE).is_file()
    assert A.SIGNATURE not in m["files"] and "hmac" in (res.path / A.SIGNATURE).read_text()
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    kid = signing.configured_key().key_id
    assert m["signing"]["key_id"] == kid and KEY not in (res.path / A.SIGNATURE).read_text()
    assert A.verify(res.path)["key"] == res.key
    step = A.load(res.path)  # cpu: the portable export, deserialized after verification
    assert step.kind == "exported (cpu)"
    info = A.inspect(res.path)
    assert info["valid"] and info["authenticated"] and info["signing"]["verified"]
    r = _cli(["inspect", str(res.path)])
    assert r.exit_code == 0 and f"signature verified (key id {kid})" in r.output
    r = _cli(["inspect", str(res.path.parents[2])])
    assert r.exit_code == 0 and "all valid (signatures verified" in r.output

    monkeypatch.setenv(signing.KEY_ENV, OTHER_KEY)
    with pytest.raises(SignatureError, match=f"signed with key id '{kid}', the configured key .* another key"):
        A.load(res.path)
    r = _cli(["inspect", str(res.path)])
    assert r.exit_code == 1 and "another key" in r.output

    monkeypatch.delenv(signing.KEY_ENV)  # no key: valid, and says the signature was not checked
    info = A.inspect(res.path)
    assert info["valid"] and not info["authenticated"]
    assert f"signed (key id {kid}) but the signature was not checked" in info["proved"]


def test_unsigned_artifact_refused_when_a_key_is_configured(exported, monkeypatch):
    res = exported["unsigned"]
    assert not A.read_manifest(res.path)["signing"]["signed"] and not (res.path / A.SIGNATURE).exists()
    assert A.verify(res.path)  # no key: fine
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    with pytest.raises(SignatureError, match="not signed .* refusing an unauthenticated artifact") as e:
        A.load(res.path)
    assert "\n" not in str(e.value)
    # a cache hit on it with a key configured is refused too (never passed on as if signed)
    _pin_key_inputs(monkeypatch, json.loads(A.read_manifest(res.path)["cache_key"]["inputs_json"]))
    with pytest.raises(SignatureError, match="not signed"):
        A.export(_spec(), out_dir=res.path.parents[2])
    r = _cli(["export", *CPU_ARGS, "--out", str(res.path.parents[2])])
    assert "not signed" in _one_line_error(r)


def test_removed_or_added_signature_file(exported, tmp_path, monkeypatch):
    d = copy_artifact(exported["signed"], tmp_path / "a")
    (d / A.SIGNATURE).unlink()
    with pytest.raises(SignatureError, match="manifest says it is signed .* manifest.sig is missing"):
        A.verify(d)  # even without a key
    d = copy_artifact(exported["unsigned"], tmp_path / "b")
    shutil.copy(exported["signed"].path / A.SIGNATURE, d / A.SIGNATURE)
    with pytest.raises(SignatureError, match="present but the manifest says it is unsigned"):
        A.verify(d)
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    with pytest.raises(SignatureError, match="signature does not match"):
        A.verify(d)
    sig = d / A.SIGNATURE  # a tampered signature file: one line, never a traceback
    sig.write_text(sig.read_text().replace('key_id = "', 'key_id = "\u00e9'))
    with pytest.raises(SignatureError, match="another key"):
        A.verify(d)
    sig.write_text("not toml [")
    with pytest.raises(SignatureError, match="malformed signature file"):
        A.verify(d)


def test_key_from_file_and_key_configuration_errors(exported, tmp_path, monkeypatch):
    res = exported["signed"]
    kf = tmp_path / "key"
    kf.write_text(KEY + "\n")
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(kf))
    assert A.inspect(res.path)["authenticated"]
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    with pytest.raises(SigningKeyError, match="both TPUMK_SIGNING_KEY and TPUMK_SIGNING_KEY_FILE are set"):
        A.verify(res.path)
    monkeypatch.delenv(signing.KEY_ENV)
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(SigningKeyError, match="cannot read the signing key"):
        A.load(res.path)
    kf.write_text("  \n")
    monkeypatch.setenv(signing.KEY_FILE_ENV, str(kf))
    with pytest.raises(SigningKeyError, match=r"TPUMK_SIGNING_KEY_FILE \(.*\) is set but empty .*or unset it to "
                                              "export unsigned artifacts"):
        A.verify(res.path)
    monkeypatch.delenv(signing.KEY_FILE_ENV)
    monkeypatch.setenv(signing.KEY_ENV, "")  # a CI secret not set for a fork expands to ""
    err = _one_line_error(_cli(["cache-key", *CPU_ARGS, "--with-signing"]))
    assert "TPUMK_SIGNING_KEY is set but empty" in err and "openssl rand -hex 32" in err
    monkeypatch.delenv(signing.KEY_ENV)
    monkeypatch.setenv(signing.KEY_ENV, "short")
    with pytest.raises(SigningKeyError, match="5 bytes, at least 16"):
        A.verify(res.path)
    err = _one_line_error(_cli(["export", *CPU_ARGS, "--out", str(tmp_path / "o")]))
    assert "at least 16" in err and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- edited manifest fields
EDITS = {
    "model.num_layers": (lambda m: m["model"].update(num_layers=m["model"]["num_layers"] + 1), "model.num_layers"),
    "model.hidden_size": (lambda m: m["model"].update(hidden_size=m["model"]["hidden_size"] + 64), "model.hidden_size"),
    "shapes.context": (lambda m: m["shapes"].update(context=64), "shapes.context"),
    "target.name": (lambda m: m["target"].update(name="v6e"), "target.name"),
    "target.kernel_mode": (lambda m: m["target"].update(kernel_mode="x"), "target.kernel_mode"),
    "tuning": (lambda m: m["tuning"].update(ring_depth=m["tuning"]["ring_depth"] + 1), "tuning.ring_depth"),
    "versions.jax": (lambda m: m["versions"].update(jax="0.0.1"), "versions.jax"),
    "report.vmem_bytes": (lambda m: m["report"].update(vmem_bytes=1), "report.vmem_bytes"),
    "report.compile_seconds": (lambda m: m["report"].update(compile_seconds=0.001), "report.compile_seconds"),
    "report_json.floor_seconds": (lambda m: m.update(report_json=json.dumps(
        {**json.loads(m["report_json"]), "floor_seconds": 1.0}, sort_keys=True)), "report.floor_seconds"),
    "signature.inputs_json": (lambda m: m["signature"].update(inputs_json="[]"), "signature.inputs_json"),
    "cache_key.key": (lambda m: m["cache_key"].update(key="0" * 64), "cache_key.key"),
    "extra field": (lambda m: m.update(run="sh -c x"), "unknown field 'run'"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_edited_field_refused_naming_it(exported, tmp_path, monkeypatch, name):
    edit, field = EDITS[name]
    d = copy_artifact(exported["unsigned"], tmp_path)
    edit_manifest(d, edit)
    with pytest.raises(ArtifactError) as e:
        A.verify(d)
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg
    r = _cli(["inspect", str(d)])
    assert r.exit_code == 1 and "INVALID" in r.output and field in r.output
    # signed: the signature already refuses any edit, before the fields are read
    d = copy_artifact(exported["signed"], tmp_path / "s")
    edit_manifest(d, edit)
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    with pytest.raises(SignatureError, match="signature does not match"):
        A.load(d)


def test_measured_figures_edited_consistently_need_a_signature(exported, tmp_path, monkeypatch):
    """What key inputs cannot re-derive (measured compile time) only a signature covers."""
    def edit(m):
        m["report"]["compile_seconds"] = 0.001
        m["report_json"] = json.dumps({**json.loads(m["report_json"]), "compile_seconds": 0.001}, sort_keys=True)

    d = copy_artifact(exported["unsigned"], tmp_path)
    edit_manifest(d, edit)
    info = A.inspect(d)
    assert info["valid"] and not info["authenticated"] and "not authenticated" in info["proved"]
    d = copy_artifact(exported["signed"], tmp_path / "s")
    edit_manifest(d, edit)
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    assert not A.inspect(d)["valid"]


def test_renamed_directory_refused(exported, tmp_path):
    d = tmp_path / "renamed"
    shutil.copytree(exported["unsigned"].path, d)
    with pytest.raises(ArtifactError, match="directory's name is not the artifact's key"):
        A.verify(d)


# ---------------------------------------------------------------------- path escapes
def test_unsafe_names():
    for bad in ["..", ".", "../../../escape", "a/b", "a\\b", "x\0y", ".hidden", "", "tab\there"]:
        assert paths.unsafe_reason(bad), bad
    for good in ["tiny-dense", "Qwen3-8B", "my model", "v1.5"]:
        assert paths.unsafe_reason(good) is None, good


def test_model_name_escaping_out_is_refused(tmp_path):
    toml = tmp_path / "m.toml"
    toml.write_text('name = "../../../escape"\n' + "".join(
        f"{k} = {v!r}\n" for k, v in load_preset("tiny-dense").to_dict().items()
        if k != "name" and isinstance(v, (int, float, str)) and not isinstance(v, bool)))
    out = tmp_path / "a" / "b" / "c" / "out"
    r = _cli(["export", "--model", str(toml), "--target", "cpu", "--context", "32", "--out", str(out)])
    err = _one_line_error(r)
    assert "model name '../../../escape' cannot be a directory name under --out: it contains '/'" in err
    assert "refused, not rewritten" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.toml"]  # nothing written, anywhere
    r = _cli(["cache-key", "--model", str(toml), "--target", "cpu", "--out", str(out)])
    assert "it contains '/'" in _one_line_error(r)


@pytest.mark.parametrize("name_or_path,reason", [("..", "it is '..'"), ("C:\\models\\..\\x", "it contains '\\'"),
                                                 (".hidden", "starts with '.'"), ("...", "starts with '.'")])
def test_checkpoint_name_escaping_out_is_refused(tmp_path, name_or_path, reason):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "_name_or_path": name_or_path, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
        "intermediate_size": 128, "torch_dtype": "float32"}))
    r = _cli(["cache-key", "--checkpoint", str(ckpt), "--target", "cpu", "--out", str(tmp_path / "out")])
    err = _one_line_error(r)
    assert reason in err and "_name_or_path" in err
    r = _cli(["export", "--checkpoint", str(ckpt), "--target", "cpu", "--out", str(tmp_path / "out")])
    assert reason in _one_line_error(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_symlinked_model_dir_outside_out_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "tiny-dense").symlink_to(elsewhere)
    r = _cli(["cache-key", *CPU_ARGS, "--out", str(out)])
    assert "outside --out" in _one_line_error(r)
    with pytest.raises(ArtifactPathError, match="outside --out"):
        A.export(_spec(), out_dir=out)
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------------- temporaries, --out, foreign dirs
def test_export_removes_stale_temporaries_and_keeps_live_ones(exported):
    planted = exported["planted"]
    assert not planted["dead"].exists()  # its process is gone
    assert not planted["old"].exists()  # older than an hour
    assert planted["live"].exists()  # a live process (pytest's parent) may still be writing it
    assert planted["fresh_other_host"].exists()  # another host's pid cannot be checked: age only
    parent = exported["signed"].path.parent
    assert planted["foreign_old"].exists() and planted["foreign_dead"].exists()  # not tpumk's: never removed
    assert sorted(p.name for p in parent.iterdir() if p.name.startswith(".tmp-")) == \
        sorted(planted[n].name for n in ("live", "fresh_other_host", "foreign_old", "foreign_dead"))
    removed = paths.clean_stale_tmps(parent, now=time.time() + 2 * paths.STALE_SECONDS)
    assert sorted(removed) == sorted([planted["live"], planted["fresh_other_host"]])
    assert planted["foreign_old"].exists() and planted["foreign_dead"].exists()
    assert exported["signed"].path.is_dir()  # never the artifacts themselves
    assert not (exported["signed"].path / paths.TMP_MARKER).exists()  # the published artifact carries no marker


def test_artifact_dir_without_manifest_is_refused(tmp_path, monkeypatch):
    key = _pin_key_inputs(monkeypatch)
    final = A.artifact_path(tmp_path, _spec(), key)
    final.mkdir(parents=True)
    (final / "executable.bin").write_bytes(b"partial copy")
    r = _cli(["export", *CPU_ARGS, "--out", str(tmp_path)])
    err = _one_line_error(r)
    assert f"{final}: exists without a manifest.toml" in err and "remove it and export again" in err
    assert (final / "executable.bin").read_bytes() == b"partial copy"
    assert [p.name for p in final.parent.iterdir()] == [key]


def test_out_on_a_regular_file_or_unwritable(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    for out in (f, f / "sub"):
        err = _one_line_error(_cli(["export", *CPU_ARGS, "--out", str(out)]))
        assert f"{f} is a regular file, not a directory" in err
    assert f.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    out = tmp_path / "out"
    (out / "tiny-dense").mkdir(parents=True)
    (out / "tiny-dense" / "cpu").write_text("in the way")
    err = _one_line_error(_cli(["export", *CPU_ARGS, "--out", str(out)]))
    assert "is a regular file, not a directory (in the artifact's path)" in err
    err = _one_line_error(_cli(["export", *CPU_ARGS, "--out", "/proc/tpumk-test-out"]))
    assert "cannot write in /proc" in err


# ---------------------------------------------------------------------- removed tables, malformed values, I/O errors
def _rekey(d: Path, edit_inputs, edit=None) -> Path:
    """Edit the key inputs themselves and make the rest agree (key, directory name): what someone
    who can write the directory can do without a signing key."""
    m = tomllib.loads((d / A.MANIFEST).read_text())
    inputs = json.loads(m["cache_key"]["inputs_json"])
    edit_inputs(inputs)
    key = A.cache_key(inputs)
    m.update(key=key, cache_key={"key": key, "inputs_json": A.canonical(inputs).decode()})
    if edit is not None:
        edit(m)
    (d / A.MANIFEST).write_text(tomli_w.dumps(m))
    return d.rename(d.parent / key)


def _in_out(res, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the artifact at OUT/<model>/<target>/<key> (where export looks for a cache hit)."""
    out = tmp_path / "out"
    d = out / "tiny-dense" / "cpu" / res.key
    shutil.copytree(res.path, d)
    return out, d


REMOVED = {
    "signature": ("signature",),
    "report and report_json": ("report", "report_json"),
    "report_json": ("report_json",),
    "report": ("report",),
}


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_manifest_table_is_refused_by_verify_not_a_crash_in_load(exported, tmp_path, name):
    """Before: an unsigned manifest without [signature] (or without both report tables) passed
    verify and inspect, then load(use="executable") died with KeyError: 'signature'."""
    d = copy_artifact(exported["unsigned"], tmp_path)
    edit_manifest(d, lambda m: [m.pop(t) for t in REMOVED[name]])
    with pytest.raises(ArtifactError, match=f"malformed manifest: missing '({'|'.join(REMOVED[name])})'") as e:
        A.verify(d)
    assert "\n" not in str(e.value)
    for use in ("executable", "exported"):
        with pytest.raises(ArtifactError, match="malformed manifest: missing"):
            A.load(d, use=use)
    info = A.inspect(d)
    assert not info["valid"] and "missing" in info["problem"]


HUGE_INT = "9" * 5000  # more digits than Python converts: ValueError from json, not JSONDecodeError
DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError from json
MALFORMED = {
    "inputs_json huge int": (lambda m: m["cache_key"].update(inputs_json='{"a": ' + HUGE_INT + "}"),
                             "bad cache_key.inputs_json"),
    "inputs_json deep": (lambda m: m["cache_key"].update(inputs_json=DEEP), "bad cache_key.inputs_json"),
    "report_json huge int": (lambda m: m.update(report_json='{"a": ' + HUGE_INT + "}"), "bad report_json"),
    "report_json deep": (lambda m: m.update(report_json=DEEP), "bad report_json"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_json_in_the_manifest_is_one_line_from_verify_load_and_a_cache_hit(
        exported, tmp_path, monkeypatch, name):
    edit, said = MALFORMED[name]
    out, d = _in_out(exported["unsigned"], tmp_path)
    edit_manifest(d, edit)
    for fn in (A.verify, A.load):
        with pytest.raises(ArtifactError, match=said) as e:
            fn(d)
        assert "\n" not in str(e.value)
    assert said in A.inspect(d)["problem"]
    _pin_key_inputs(monkeypatch, json.loads(A.read_manifest(exported["unsigned"].path)["cache_key"]["inputs_json"]))
    assert said in _one_line_error(_cli(["export", *CPU_ARGS, "--out", str(out)]))


def _drop_target_name(inputs):
    del inputs["target"]["name"]


def _list_target_name(inputs):
    inputs["target"]["name"] = ["cpu"]


@pytest.mark.parametrize("edit_inputs,edit,raised", [
    (_drop_target_name, lambda m: m["target"].pop("name"), "KeyError"),
    (_list_target_name, lambda m: m["target"].update(name=["cpu"]), "TypeError"),
])
def test_key_inputs_of_unexpected_types_are_one_line(exported, tmp_path, edit_inputs, edit, raised):
    """Key inputs edited with the key and directory made to agree: a target without a name or with
    a list for one made the field checks raise KeyError / TypeError (a traceback from verify and load)."""
    d = _rekey(copy_artifact(exported["unsigned"], tmp_path), edit_inputs, edit)
    for fn in (A.verify, A.load):
        with pytest.raises(ArtifactError, match=rf"manifest.toml: malformed manifest \({raised}") as e:
            fn(d)
        assert "\n" not in str(e.value)
    info = A.inspect(d)
    assert not info["valid"] and f"malformed manifest ({raised}" in info["problem"]
    assert "Traceback" not in _cli(["inspect", str(d)]).output


@pytest.fixture
def unreadable(monkeypatch):
    """unreadable(path, errno): opening `path` fails like that (root ignores file modes, so the
    error is injected where every read starts: open)."""
    import builtins
    import errno as errno_mod
    import io

    real_open, bad = builtins.open, {}

    def fake_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and str(os.fspath(file)) in bad:
            code = bad[str(os.fspath(file))]
            raise OSError(code, os.strerror(code), str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)

    def make(path: Path, code: int = errno_mod.EACCES) -> None:
        bad[str(path)] = code

    return make


@pytest.mark.parametrize("name,signed", [(A.MANIFEST, False), (A.SIGNATURE, True), (A.EXECUTABLE, False),
                                         (A.EXPORTED, True)])
def test_an_unreadable_file_is_one_line_from_verify_load_inspect_and_a_cache_hit(
        exported, tmp_path, monkeypatch, unreadable, name, signed):
    import errno

    res = exported["signed" if signed else "unsigned"]
    out, d = _in_out(res, tmp_path)
    if signed:
        monkeypatch.setenv(signing.KEY_ENV, KEY)
    _pin_key_inputs(monkeypatch, json.loads(A.read_manifest(res.path)["cache_key"]["inputs_json"]))
    for code in (errno.EACCES, errno.EIO):
        unreadable(d / name, code)
        said = f"{d / name}: cannot read: {os.strerror(code)}"
        for fn in (A.verify, lambda p: A.load(p, use="executable")):
            with pytest.raises(ArtifactError) as e:
                fn(d)
            assert str(e.value) == said
        assert A.inspect(d)["problem"] == said
        assert _one_line_error(_cli(["export", *CPU_ARGS, "--out", str(out)])) == f"tpumk: error: {said}"


def test_inspect_checks_the_signature_before_parsing_the_manifest(exported, tmp_path, monkeypatch):
    """README: with a key, inspect checks the signature "before any other part of the artifact is
    read". Before, it parsed the unauthenticated manifest first (for display)."""
    d = copy_artifact(exported["signed"], tmp_path)
    edit_manifest(d, lambda m: m["shapes"].update(context=64))
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    order = []
    real_check, real_parse = signing.check_signature, A._parse_manifest
    monkeypatch.setattr(signing, "check_signature", lambda *a: order.append("signature") or real_check(*a))
    monkeypatch.setattr(A, "_parse_manifest", lambda *a: order.append("parse") or real_parse(*a))
    info = A.inspect(d)
    assert order[0] == "signature", order
    assert not info["valid"] and "signature does not match" in info["problem"]
    assert info["shapes"]["context"] == 64  # still shown (marked INVALID), after verification failed
    order.clear()
    info = A.inspect(exported["signed"].path)
    assert info["valid"] and info["authenticated"] and order == ["signature", "parse"]


def test_a_manifest_or_signature_growing_past_its_limit_is_refused_from_what_was_read(exported, tmp_path,
                                                                                     monkeypatch):
    """The size is judged from at most limit + 1 bytes read, not from a stat taken before reading
    (a file can grow in between: here stat is made to report the size it had before)."""
    d = copy_artifact(exported["signed"], tmp_path)
    real_stat = Path.stat

    def stale_stat(self, *a, **k):
        st = real_stat(self, *a, **k)
        if self.name in (A.MANIFEST, A.SIGNATURE):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 10,
                                   int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))
        return st

    with monkeypatch.context() as mp:
        mp.setattr(Path, "stat", stale_stat)
        mp.setattr(A, "MAX_MANIFEST_BYTES", 100)
        with pytest.raises(ArtifactError, match="manifest.toml: more than 100 bytes, not a manifest"):
            A.verify(d)
    with open(d / A.SIGNATURE, "a") as f:
        f.write("#" * 10_000 + "\n")
    with pytest.raises(SignatureError, match="manifest.sig: more than 4096 bytes, not a signature file"):
        A.verify(d)


def test_the_ci_cache_key_follows_the_signing_state(monkeypatch):
    """`cache-key --with-signing`: the same artifact key with -unsigned, or -signed-<key id>, so a
    CI cache never restores an unsigned artifact once signing is on (which inspect refuses), nor
    one signed with a rotated key."""
    from tpumk.export import signing

    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    monkeypatch.delenv(signing.KEY_FILE_ENV, raising=False)
    key = _cli(["cache-key", *CPU_ARGS]).stdout.strip()
    assert _cli(["cache-key", *CPU_ARGS, "--with-signing"]).stdout.strip() == f"{key}-unsigned"
    monkeypatch.setenv(signing.KEY_ENV, KEY)
    kid = signing.configured_key().key_id
    assert _cli(["cache-key", *CPU_ARGS, "--with-signing"]).stdout.strip() == f"{key}-signed-{kid}"
    assert _cli(["cache-key", *CPU_ARGS]).stdout.strip() == key  # the artifact's own key is unchanged
    monkeypatch.setenv(signing.KEY_ENV, KEY[::-1])
    assert _cli(["cache-key", *CPU_ARGS, "--with-signing"]).stdout.strip() != f"{key}-signed-{kid}"
