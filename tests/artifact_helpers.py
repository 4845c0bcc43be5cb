"""Shared helpers of the artifact tests: a private copy of an exported artifact, and a manifest
edited in place (what someone who can write the artifact directory can do)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import tomli_w

from tpumk.export import artifacts as A


def copy_artifact(res, tmp_path: Path) -> Path:
    """A copy of the exported artifact `res` under tmp_path/copy/<key> (the fixture stays intact)."""
    dst = tmp_path / "copy" / res.key
    shutil.copytree(res.path, dst)
    return dst


def edit_manifest(d: Path, edit) -> None:
    """Read the manifest of artifact directory `d`, let `edit(m)` change the table, write it back."""
    mf = d / A.MANIFEST
    m = tomllib.loads(mf.read_text())
    edit(m)
    mf.write_text(tomli_w.dumps(m))
