"""Cache keys that cannot go stale: every cached value is keyed by the source that computed it.

The source part of a key is the closure of tpumk units (subpackages, top-level modules)
reachable by import from an entry module, every file of them hashed (tpumk.compile.keys).
These tests change files in a copy of the package and watch the keys; the last one changes the
timeline model in a copy and runs `tpumk tune` on it with the same result cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpumk.compile import keys as K
from tpumk.model.config import resolve_model
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target
from tpumk.tune.cache import EVALUATOR, ResultKeys
from tpumk.tune.space import SPACES_DIR

TINY_SPACE = SPACES_DIR / "tiny.toml"


def copy_package(dst: Path) -> Path:
    """The tpumk source tree (no bytecode) under dst/tpumk; returns the package directory."""
    pkg = dst / "tpumk"
    shutil.copytree(K.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return pkg


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "tpumk"


def change_timeline_model(pkg: Path) -> None:
    """A DMA's latency is 2 us instead of 1 us, in the copy's timeline model. (A larger change
    moves the plan's automatic tile choices too: at 50 us the tiny model's trial compiled for
    90 s instead of 4 s, for no more evidence that the changed model is re-evaluated.)"""
    timeline = pkg / "estimate" / "timeline.py"
    text, n = re.subn(r"^DMA_LATENCY_S = .*$", "DMA_LATENCY_S = 2e-6", timeline.read_text(), flags=re.M)
    assert n == 1, "tpumk/estimate/timeline.py no longer defines DMA_LATENCY_S"
    timeline.write_text(text)


# ---------------------------------------------------------------------- the closure
def test_closure_follows_every_import_and_only_imports(tmp_path):
    """Lazy imports inside functions, `from tpumk import unit`, relative imports and
    import_module count; a unit nobody imports does not; the root's lazy API counts only for
    modules that use it (`import tpumk`)."""
    pkg = write_tree(tmp_path, {
        "tpumk/__init__.py": "from tpumk.base import x\n\ndef __getattr__(name):\n"
                             "    from tpumk.served import load\n    return load\n",
        "tpumk/base.py": "x = 1\n",
        "tpumk/a/__init__.py": "",
        "tpumk/a/m.py": "def f():\n    from tpumk.b import y\n    return y\n",
        "tpumk/a/data.toml": "k = 1\n",
        "tpumk/b.py": "from tpumk import c\ny = c\n",
        "tpumk/c/__init__.py": "from .inner import z\n",
        "tpumk/c/inner.py": "import importlib\nz = importlib.import_module('tpumk.d')\n",
        "tpumk/d.py": "from tpumk import __version__\n",
        "tpumk/api_user.py": "import tpumk\n\ndef g():\n    return tpumk.load\n",
        "tpumk/served.py": "load = 2\n",
        "tpumk/unrelated/__init__.py": "from tpumk.a import m\n",
    })
    core = ["tpumk", "tpumk.a", "tpumk.b", "tpumk.base", "tpumk.c", "tpumk.d"]
    assert K.source_closure(["tpumk.a.m"], pkg) == core
    assert K.source_closure(["tpumk.api_user"], pkg) == sorted(["tpumk.api_user", "tpumk.served", "tpumk.base"] +
                                                               ["tpumk"])
    assert K.source_closure(["tpumk.unrelated"], pkg) == sorted(core + ["tpumk.unrelated"])
    files = [p.relative_to(tmp_path).as_posix() for p in K.source_files(K.source_closure(["tpumk.a"], pkg), pkg)]
    assert "tpumk/a/data.toml" in files and "tpumk/unrelated/__init__.py" not in files


def test_real_closures_cover_the_code_path_and_not_the_front_ends():
    art = K.source_inputs(K.ARTIFACT_ENTRY)
    for unit in ("tpumk", "tpumk.compile", "tpumk.kernel", "tpumk.plan", "tpumk.model", "tpumk.targets",
                 "tpumk.estimate", "tpumk.build", "tpumk.export"):
        assert unit in art["units"], unit
    assert not {"tpumk.cli", "tpumk.tune", "tpumk.decode"} & set(art["units"])
    ev = K.source_inputs(EVALUATOR)
    assert {"tpumk.tune", "tpumk.estimate", "tpumk.kernel", "tpumk.compile"} <= set(ev["units"])
    assert "tpumk.cli" not in ev["units"]
    assert re.fullmatch(r"[0-9a-f]{64}", art["sha256"]) and art["sha256"] != ev["sha256"]


# ---------------------------------------------------------------------- the digest
def test_digest_changes_with_any_file_of_a_hashed_unit_and_only_those(tmp_path):
    pkg = copy_package(tmp_path)
    units = K.source_closure([K.ARTIFACT_ENTRY], pkg)
    base = K.source_inputs(K.ARTIFACT_ENTRY, package_dir=pkg)
    assert base["units"] == units
    # Where the tree lives does not matter, bytecode caches do not count.
    other = copy_package(tmp_path / "elsewhere")
    (other / "kernel" / "__pycache__").mkdir(exist_ok=True)
    (other / "kernel" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    assert K.source_inputs(K.ARTIFACT_ENTRY, package_dir=other) == base
    # Every file of every hashed unit (package data included) changes the digest.
    hashed = K.source_files(units, pkg)
    assert pkg / "model" / "presets" / "tiny-moe.toml" in hashed
    for f in hashed:
        old = f.read_bytes()
        f.write_bytes(old + b"\n# changed\n")
        try:
            assert K.source_inputs(K.ARTIFACT_ENTRY, package_dir=pkg)["sha256"] != base["sha256"], f
        finally:
            f.write_bytes(old)
    assert K.source_inputs(K.ARTIFACT_ENTRY, package_dir=pkg) == base
    # A new module in a hashed unit changes it too.
    new = pkg / "estimate" / "brand_new.py"
    new.write_text("X = 1\n")
    assert K.source_inputs(K.ARTIFACT_ENTRY, package_dir=pkg)["sha256"] != base["sha256"]
    new.unlink()
    # Units the artifact code path does not reach do not.
    for rel in ("cli/app.py", "tune/study.py", "tune/worker.py", "decode/generate.py"):
        f = pkg / rel
        f.write_text(f.read_text() + "\n# changed\n")
    assert K.source_inputs(K.ARTIFACT_ENTRY, package_dir=pkg) == base
    # ... but the evaluator's closure does see the tuner's worker, and not the CLI.
    ev = K.source_inputs(EVALUATOR, package_dir=pkg)
    (pkg / "cli" / "app.py").write_text((pkg / "cli" / "app.py").read_text() + "\n# again\n")
    assert K.source_inputs(EVALUATOR, package_dir=pkg) == ev
    change_timeline_model(pkg)
    assert K.source_inputs(EVALUATOR, package_dir=pkg)["sha256"] != ev["sha256"]


def test_keys_record_the_source_and_the_tuner_adds_its_evaluator():
    spec = BuildSpec(resolve_model("tiny-moe"), get_target("tpu7x"))
    inputs = K.key_inputs(spec)
    assert inputs["schema"] == K.KEY_SCHEMA and "kernel_source_sha256" not in inputs
    assert inputs["source"] == K.source_inputs(K.ARTIFACT_ENTRY)
    keys = ResultKeys(spec)
    t = TuningConfig()
    assert keys.inputs(t)["evaluator"] == K.source_inputs(EVALUATOR)
    assert {k: v for k, v in keys.inputs(t).items() if k != "evaluator"} == inputs
    assert keys(t) != K.key_for(spec)  # the tuner's entries are keyed apart from artifacts
    assert keys(t) == ResultKeys(spec)(t)


# ---------------------------------------------------------------------- the tuner serves no stale value
def _tune(cwd: Path, cache: Path, pythonpath: Path | None) -> dict:
    # The package under test (this checkout, wherever it is: not an installed copy), or the copy.
    # Started with `-m` and PYTHONPATH on purpose (not tpumk.child_process.command, which would
    # run this process's tpumk): a PYTHONPATH setup, whose trial workers must then run the copy too.
    env = {**os.environ, "PYTHONPATH": str(pythonpath if pythonpath is not None else K.PACKAGE_DIR.parent)}
    cwd.mkdir(parents=True, exist_ok=True)
    # tiny-dense: the model does not matter here, and its compile is the quickest
    r = subprocess.run([sys.executable, "-m", "tpumk.cli", "tune", "--model", "tiny-dense", "--target", "tpu7x",
                        "--space", str(TINY_SPACE), "--objective", "model", "--trials", "1", "--seed", "0", "--json",
                        "--cache-dir", str(cache)],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_changed_timeline_model_is_reevaluated_not_served_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _tune(tmp_path / "run1", cache, None)
    assert first["this_run"]["compiles"] == 1 and first["default"]["state"] == "COMPLETE"
    assert "DMA latency 2 us" not in first["best"][0]["objective_source"]

    src = tmp_path / "src"
    change_timeline_model(copy_package(src))
    # The same command, same cache directory, in the same place (its study storage), new code.
    second = _tune(tmp_path / "run1", cache, src)
    assert second["study"] != first["study"]  # values of other code: another study
    assert second["this_run"]["compiles"] == 1 and second["this_run"]["cache_hits"] == 0
    assert "DMA latency 2 us" in second["best"][0]["objective_source"]  # the copy ran
    assert second["default"]["value_seconds"] != pytest.approx(first["default"]["value_seconds"])

    # Unchanged code (the copy again; the repository may be edited meanwhile) in a fresh study
    # still gets every value from the cache.
    third = _tune(tmp_path / "run3", cache, src)
    assert third["study"] == second["study"]
    assert third["this_run"]["compiles"] == 0 and third["this_run"]["cache_hits"] == 1
    assert third["default"]["value_seconds"] == second["default"]["value_seconds"]
