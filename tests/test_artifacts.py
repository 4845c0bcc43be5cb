"""Exported artifacts: export, cache hits, load in a fresh process, verification errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tpumk import artifacts as A
from tpumk.cache_key import key_for
from tpumk.config import load_preset
from tpumk.errors import ArtifactError
from tpumk.targets import get_target
from tpumk.tuning import TuningConfig

CONTEXT, PAGE = 32, 16


def _export(out_dir, target):
    return A.export(load_preset("tiny-dense"), get_target(target), batch=1, context=CONTEXT, tuning=TuningConfig(),
                    q_len=1, page_size=PAGE, out_dir=out_dir)


@pytest.fixture(scope="module")
def cpu_artifact(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("art"), "cpu")


@pytest.fixture(scope="module")
def tpu_artifact(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("art"), "tpu7x")


def _copy(res, tmp_path):
    dst = tmp_path / res.key
    shutil.copytree(res.path, dst)
    return dst


LOAD_AND_RUN = r"""
import json, sys
import jax.numpy as jnp, numpy as np
from tpumk import artifacts as A, reference as R
from tpumk.config import load_preset
from tpumk.kernel.layout import pack_weights
from tpumk.plan import make_plan
from tpumk.targets import get_target
from tpumk.tuning import TuningConfig
from tpumk.weights import random_params

step = A.load(sys.argv[1])
cfg = load_preset("tiny-dense")
params = random_params(cfg, seed=0)
plan = make_plan(cfg, get_target("cpu"), 1, 32, TuningConfig(), q_len=1, page_size=16)
cache = R.init_cache(cfg, 1, 32, 16)
_, cache = R.prefill(params, cfg, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]], cache)
tokens = jnp.asarray([[7]], jnp.int32)
positions = cache.lengths[:, None]
want, _ = R.decode_step(params, cfg, tokens, positions, cache)
got, new_cache = step(pack_weights(plan, params), tokens, positions, cache)
scale = float(np.max(np.abs(np.asarray(want))))
err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
print(json.dumps({"kind": step.kind, "err": err, "scale": scale, "len": int(new_cache.lengths[0])}))
"""


def test_cpu_export_loads_in_fresh_process_and_matches_reference(cpu_artifact, tmp_path):
    assert not cpu_artifact.cache_hit
    assert (cpu_artifact.path / A.MANIFEST).is_file()
    again = _export(cpu_artifact.path.parents[2], "cpu")
    assert again.cache_hit and again.path == cpu_artifact.path
    out = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(cpu_artifact.path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["err"] <= 1e-5 * r["scale"], r
    assert r["len"] == 18


def test_tpu7x_deviceless_export_writes_executable_and_export(tpu_artifact):
    m = A.verify(tpu_artifact.path)
    assert set(m["files"]) == {A.EXECUTABLE, A.EXECUTABLE_TREES, A.EXPORTED}
    assert m["target"]["device_kind"] == "TPU7x" and m["target"]["export_platform"] == "tpu"
    assert m["report"]["custom_calls"] == 1
    for name, entry in m["files"].items():
        assert A.sha256_file(tpu_artifact.path / name) == entry["sha256"]
    exp = A.load_exported(tpu_artifact.path)
    assert exp.platforms == ("tpu",)
    inputs = json.loads(m["signature"]["inputs_json"])
    assert any(s["path"].endswith("[1]") and s["shape"] == [1, 1] for s in inputs)
    with pytest.raises(ArtifactError, match="not attached"):
        A.load(tpu_artifact.path)


KEY = r"""
from tpumk.cache_key import key_for
from tpumk.config import load_preset
from tpumk.targets import get_target
from tpumk.tuning import TuningConfig
print(key_for(load_preset("tiny-dense"), get_target("tpu7x"), 1, 32, 1, 16, TuningConfig()))
"""


def test_cache_key_stable_across_processes_and_sensitive_to_inputs():
    keys = {subprocess.run([sys.executable, "-c", KEY], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    assert len(keys) == 1
    cfg, t, tun = load_preset("tiny-dense"), get_target("tpu7x"), TuningConfig()
    base = key_for(cfg, t, 1, 32, 1, 16, tun)
    assert base in keys
    variants = [
        key_for(cfg.replace(rms_eps=cfg.rms_eps * 2), t, 1, 32, 1, 16, tun),
        key_for(cfg, get_target("v6e"), 1, 32, 1, 16, tun),
        key_for(cfg, t, 2, 32, 1, 16, tun),
        key_for(cfg, t, 1, 64, 1, 16, tun),
        key_for(cfg, t, 1, 32, 2, 16, tun),
        key_for(cfg, t, 1, 32, 1, 32, tun),
        key_for(cfg, t, 1, 32, 1, 16, tun.replace(ring_depth=tun.ring_depth + 1)),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_cache_key_covers_compile_flags(monkeypatch):
    cfg, t = load_preset("tiny-dense"), get_target("tpu7x")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    base = key_for(cfg, t, 1, 32, 1, 16, TuningConfig())
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert key_for(cfg, t, 1, 32, 1, 16, TuningConfig()) != base


def test_hash_mismatch_truncated_and_altered(tpu_artifact, tmp_path):
    d = _copy(tpu_artifact, tmp_path / "a")
    f = d / A.EXPORTED
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="truncated or altered"):
        A.verify(d)
    d = _copy(tpu_artifact, tmp_path / "b")
    f = d / A.EXECUTABLE
    b = bytearray(f.read_bytes())
    b[100] ^= 0xFF
    f.write_bytes(bytes(b))
    with pytest.raises(ArtifactError, match="sha256 .* does not match"):
        A.verify(d)


def test_missing_file(tpu_artifact, tmp_path):
    d = _copy(tpu_artifact, tmp_path)
    (d / A.EXPORTED).unlink()
    with pytest.raises(ArtifactError, match="missing file"):
        A.load(d)


def test_version_mismatch(cpu_artifact, tmp_path):
    d = _copy(cpu_artifact, tmp_path)
    mf = d / A.MANIFEST
    text = mf.read_text()
    import jax

    old = f'jax = "{jax.__version__}"'
    assert old in text
    mf.write_text(text.replace(old, 'jax = "0.0.1"', 1))
    with pytest.raises(ArtifactError, match="built with jax 0.0.1"):
        A.load(d)


def test_not_an_artifact_dir(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        A.load(tmp_path)
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        A.load(tmp_path / "nope")


def test_errors_are_one_line(tpu_artifact, tmp_path):
    with pytest.raises(ArtifactError) as e:
        A.load(tpu_artifact.path)
    assert "\n" not in str(e.value)
