"""`tpumk.load` under `jax.distributed` (issue 58): two processes of two host CPU devices each
load the same exported artifact, pack the same weights and run the same steps, and their logits
are those of one process with four host devices running that artifact (and tpumk's reference's).

The artifact is a `cpu` build over 4 devices, which tpumk exports as the same build's XLA SPMD
step (tpumk.compile.keys.program_kind): the megakernel's in-kernel collectives run only in
Pallas' TPU interpreter, which neither serializes nor runs across processes (it hung for
5 minutes on 2 x 2 devices). XLA's collectives between the processes go through gloo.

Every process runs this file as a script (XLA_FLAGS and jax.distributed must come before JAX
starts). They catch SIGTERM (JAX's preemption notifier), so they are stopped with SIGKILL: on a
timeout, and on any failure of the test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
BATCH, CONTEXT = 2, 32
TOKENS = ([[3], [5]], [[7], [9]])  # one [B, q = 1] per step
TIMEOUT = 120  # seconds, per process (each takes a few)
# float32: |logits - other| <= TOLERANCE x the reference's largest logit (measured: 2.3e-6 / 4.1 from the
# reference, 1.7e-6 / 4.1 between 2 processes and 1: gloo sums in another order)
TOLERANCE = 1e-5


def _spec():
    from tpumk.model.config import load_preset
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    return BuildSpec(load_preset("tiny-dense"), get_target("cpu"), batch=BATCH, context=CONTEXT, devices=DEVICES)


def _steps(step) -> np.ndarray:
    """The README's loop on a loaded step: pack, an empty cache, one call per step; the logits
    of every step (replicated: this process's first shard holds them whole)."""
    from tpumk.model.weights import random_params

    packed = step.pack(random_params(step.config, seed=0))
    cache = step.init_cache()
    out = []
    for i, tokens in enumerate(TOKENS):
        logits, cache = step(packed, np.asarray(tokens, np.int32), np.full((BATCH, 1), i, np.int32), cache)
        out.append(np.asarray(logits.addressable_data(0)))
    return np.stack(out)


def _reference() -> np.ndarray:
    import jax.numpy as jnp

    from tpumk.model import reference
    from tpumk.model.weights import random_params

    cfg = _spec().model
    params, cache, out = random_params(cfg, seed=0), reference.init_cache(cfg, BATCH, CONTEXT), []
    for i, tokens in enumerate(TOKENS):
        logits, cache = reference.decode_step(params, cfg, jnp.asarray(tokens, jnp.int32),
                                              jnp.full((BATCH, 1), i, jnp.int32), cache)
        out.append(np.asarray(logits))
    return np.stack(out)


# ---------------------------------------------------------------------- the processes (this file as a script)
def _single(out: Path) -> dict:
    """One process, 4 host devices: export the artifact, load it, run the steps; the reference."""
    from tpumk.export import artifacts as A

    res = A.export(_spec(), out_dir=out / "artifacts")
    step = A.load(res.path)
    np.savez(out / "single.npz", logits=_steps(step), reference=_reference())
    return {"path": str(res.path), "kind": step.kind, "devices": [d.id for d in step.devices],
            "files": sorted(res.manifest["files"]), "program": res.manifest["program"]["kind"]}


def _distributed(artifact: str, port: int, pid: int, out: Path) -> dict:
    """Process `pid` of 2 (2 host devices each) under jax.distributed: load, pack, steps."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from tpumk.export import artifacts as A

    step = A.load(artifact)
    np.save(out / f"process{pid}.npy", _steps(step))
    return {"devices": [[d.id, d.process_index] for d in step.devices], "local": jax.local_device_count()}


def _fewer(artifact: str) -> dict:
    from tpumk.errors import ArtifactError
    from tpumk.export import artifacts as A

    try:
        A.load(artifact)
    except ArtifactError as e:
        return {"error": str(e)}
    return {"error": None}


# ---------------------------------------------------------------------- the tests
def _env(devices: int) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))


def _run(devices: int, *args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], env=_env(devices), cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)  # (a timeout SIGKILLs it)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    return out, _run(DEVICES, "single", str(out))


def test_two_processes_give_the_logits_of_one_process_with_four_devices(single):
    out, one = single
    assert one["program"] == "xla-spmd" and one["files"] == ["exported.bin"] and one["devices"] == [0, 1, 2, 3]
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "distributed", one["path"], str(port), str(pid), str(out)],
                              env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pid in (0, 1)]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:  # SIGKILL: they catch SIGTERM
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
    meta = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results]
    # both processes run the step on the same 4 devices, 2 of their own each
    assert meta[0]["devices"] == meta[1]["devices"] and meta[0]["local"] == meta[1]["local"] == 2
    assert sorted(pi for _, pi in meta[0]["devices"]) == [0, 0, 1, 1]
    ref = np.load(out / "single.npz")
    logits, reference = ref["logits"], ref["reference"]
    assert logits.shape == (len(TOKENS), BATCH, 1, _spec().model.vocab_size)
    scale = float(np.abs(reference).max())
    assert np.abs(logits - reference).max() <= TOLERANCE * scale
    for pid in (0, 1):
        got = np.load(out / f"process{pid}.npy")
        assert np.abs(got - logits).max() <= TOLERANCE * scale, pid
        assert np.array_equal(got.argmax(-1), logits.argmax(-1))


def test_loading_it_with_fewer_devices_is_one_line(single):
    _, one = single
    msg = _run(2, "fewer", one["path"])["error"]
    assert msg and "\n" not in msg, msg
    assert "XLA's SPMD step over 4 cpu devices, but this process sees 2" in msg


def test_inspect_names_the_program_and_there_is_no_executable_to_load(single):
    from click.testing import CliRunner

    from tpumk.cli import main
    from tpumk.errors import ArtifactError
    from tpumk.export import artifacts as A

    _, one = single
    r = CliRunner().invoke(main, ["inspect", one["path"]])
    assert r.exit_code == 0, r.output
    assert "  program   xla-spmd: tpumk.model.xla_step.xla_cache_step, sharded by tpumk.model.xla_spmd.spmd_layout" \
        in r.output and "devices   4 x cpu, mesh tp=4 (any 4 devices)" in r.output
    with pytest.raises(ArtifactError, match="holds XLA's SPMD step as a portable program only") as e:
        A.load(one["path"], use="executable")
    assert "\n" not in str(e.value)


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "single":
        result = _single(Path(rest[0]))
    elif role == "distributed":
        result = _distributed(rest[0], int(rest[1]), int(rest[2]), Path(rest[3]))
    else:
        result = _fewer(rest[0])
    print(json.dumps(result))
