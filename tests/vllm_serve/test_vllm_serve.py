"""End to end: `vllm serve` (vLLM's TPU backend, on this CPU host) with tpumk's plugin.

Runs only in the vLLM venv (docs/serving-vllm.md: Python 3.12, `pip install -e '.[vllm]' -c
constraints/vllm-tpu.txt`), with `-m vllm`. Each test starts a real server on 127.0.0.1 (the
engine, scheduler, paged KV manager, runner and sampler of vllm-tpu 0.32), with the test-only
patches of tests/vllm_serve/cpu_site and nothing able to reach the network, and stops it.

- a tiny Qwen3 (head_dim 128) and a tiny Llama of head_dim 64 (Llama-3.2-1B's and SmolLM2's
  width, which vLLM's TPU runner caches in another layout: tpumk/vllm/kv.py) written by
  transformers, decode steps built on start-up, and a tiny Qwen3-MoE served from a `tpumk export`
  artifact named by --hf-overrides (its jax.export program): concurrent `/v1/completions` through
  the `openai` client give transformers' greedy tokens, and the server's log shows the decode
  steps ran in tpumk's megakernel (TPUMK_VLLM_COUNT_STEPS);
- tpumk/vllm/kv.py writes exactly what tpu_inference's own `get_kv_cache_shape_with_mesh` and
  `merge_kv` lay out, for head widths, KV-head counts and dtypes it packs differently (in the
  test's own process: mostly the import of tpu_inference);
- an artifact (TPUMK_VLLM_ARTIFACT) of another model or of a smaller batch than --max-num-seqs, a
  checkpoint whose own config.json names tpumk_artifact: the server refuses to start and its log
  holds the plugin's one line saying why (these servers start side by side: each is mostly
  vLLM's start-up; tests/test_vllm_adapter.py has the rest of the refusals, without vLLM).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
HERE = Path(__file__).parent
ROOT = HERE.parent.parent
# never the network: tpu_inference asks a cloud metadata server for the TPU type without these
OFFLINE_ENV = {"JAX_PLATFORMS": "cpu", "TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_NAME": "local", "TPU_WORKER_ID": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "RAY_USAGE_STATS_ENABLED": "0", "SKIP_JAX_PRECOMPILE": "1", "TPUMK_VLLM_COUNT_STEPS": "1"}
PROMPTS = [[5, 17, 300, 42, 8], [100, 200, 3, 4, 5, 6, 7, 8, 9], [1, 2], [511, 0, 250]]
STEPS = 6
MAX_SEQS = 4
READY_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` in its own process group; `stop()` ends it and everything it started."""

    def __init__(self, model: Path, log: Path, env: dict | None = None, max_seqs: int = MAX_SEQS,
                 overrides: dict | None = None):
        self.port, self.log = _free_port(), log
        full = dict(os.environ, **OFFLINE_ENV, PYTHONPATH=str(HERE / "cpu_site"), **(env or {}))
        cmd = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--host", "127.0.0.1", "--port",
               str(self.port), "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", str(max_seqs),
               "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", "64", "--skip-tokenizer-init",
               "--hf-overrides", json.dumps({"architectures": ["TpumkForCausalLM"], **(overrides or {})})]
        self.out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, env=full, start_new_session=True)

    def wait_ready(self) -> bool:
        """True once /health answers; False if the server exited first."""
        import urllib.request

        end = time.monotonic() + READY_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"vllm serve not ready in {READY_S} s: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # whatever the group left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.out.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_utils import build_checkpoint, hf_greedy

    d = tmp_path_factory.mktemp("ckpt")
    made = {"dense": build_checkpoint(d / "qwen3"), "moe": build_checkpoint(d / "qwen3-moe", moe=True),
            "llama-hd64": build_checkpoint(d / "llama-hd64", arch="llama", head_dim=64)}
    return {kind: (path, hf_greedy(path, PROMPTS, STEPS)) for kind, path in made.items()}


@pytest.fixture(scope="module")
def moe_artifact(checkpoints, tmp_path_factory) -> Path:
    """The MoE checkpoint's `tpumk export` artifact (served, and refused where it does not fit)."""
    return export(checkpoints["moe"][0], tmp_path_factory.mktemp("artifacts"))


def export(checkpoint: Path, out: Path, batch: int = MAX_SEQS) -> Path:
    tpumk = str(Path(sys.executable).with_name("tpumk"))
    r = subprocess.run([tpumk, "export", "--checkpoint", str(checkpoint), "--target", "cpu", "--batch", str(batch),
                        "--context", "64", "--out", str(out), "--json"], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    return next(p.parent for p in out.rglob("manifest.toml"))


def completions(port: int, prompts) -> list[list[int]]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def one(p):
        r = client.completions.create(model=model, prompt=p, max_tokens=STEPS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        return r.choices[0].model_extra["token_ids"]

    with cf.ThreadPoolExecutor(len(prompts)) as ex:  # concurrent: the scheduler batches them
        return list(ex.map(one, prompts))


def steps_run(log: Path, kind: str) -> list[int]:
    """The number of requests of each step the plugin logged as run by `kind`'s program."""
    what = "megakernel decode step" if kind == "decode" else "JAX prefill/mixed step"
    return [int(n) for n in re.findall(rf"{what} #\d+ \((\d+) requests\)", log.read_text())]


@pytest.mark.parametrize("kind", ["dense", "llama-hd64", "moe"])
def test_served_tokens_are_transformers_greedy_tokens(kind, checkpoints, tmp_path, request):
    ckpt, want = checkpoints[kind]
    overrides = {}
    if kind == "moe":  # from an artifact the operator names in --hf-overrides: its jax.export program
        overrides["tpumk_artifact"] = str(request.getfixturevalue("moe_artifact"))
    server = Server(ckpt, tmp_path / "serve.log", overrides=overrides)
    try:
        assert server.wait_ready(), (tmp_path / "serve.log").read_text()[-3000:]
        got = completions(server.port, PROMPTS)
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert got == want
    source = "artifact" if kind == "moe" else "built on start-up"
    assert re.search(rf"tpumk plugin: .*decode steps from {source}", log), log[-3000:]
    decode, ragged = steps_run(tmp_path / "serve.log", "decode"), steps_run(tmp_path / "serve.log", "ragged")
    # every sampled token came from a logged step (one per request per step), most of them from
    # the megakernel's decode-only batches, several requests in one step
    assert sum(decode) + sum(ragged) == len(PROMPTS) * STEPS, (decode, ragged)
    assert sum(decode) >= len(PROMPTS) * STEPS // 2 and max(decode) > 1, (decode, ragged)


def test_kv_layout_is_tpu_inference_s(monkeypatch):
    """kv.write_rows against tpu_inference's own allocator shape and K/V merge (what its RPA v3
    kernels write), so a tpu_inference that changes its layout fails here, not in a server."""
    import itertools

    for name, value in OFFLINE_ENV.items():  # before tpu_inference is imported in this process
        monkeypatch.setenv(name, value)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel, kernel_hd64
    from tpu_inference.runner.kv_cache import get_kv_cache_shape_with_mesh
    from tpu_inference.utils import get_padded_head_dim

    from tpumk.vllm import kv

    mesh = Mesh(np.asarray(jax.devices()[:1]), ("model",))  # one device: no head or context sharding
    slots = jnp.array([5, 7])

    @functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
    def both(k, v, merge_kv, shape, heads, head_dim):
        """tpu_inference's rows ([tokens, G, packing, lanes]) at `slots`, and kv.write_rows'."""
        want = jnp.zeros(shape, k.dtype).reshape(-1, *shape[2:]).at[slots].set(merge_kv(k, v)).reshape(shape)
        got = kv.write_rows(jnp.zeros(shape, k.dtype), slots, k.reshape(2, -1), v.reshape(2, -1), heads, head_dim)
        return want, got

    # the layouts of tests/test_vllm_adapter.py's LAYOUTS (which builds them from this description)
    for head_dim, heads, dtype in [(64, 1, jnp.bfloat16), (64, 2, jnp.bfloat16), (64, 3, jnp.float32),
                                   (128, 1, jnp.bfloat16), (128, 2, jnp.float32), (96, 3, jnp.bfloat16)]:
        padded = get_padded_head_dim(head_dim)  # what the runner asks the allocator for
        shape = tuple(get_kv_cache_shape_with_mesh(mesh, 3, 4, heads, padded, dtype))
        assert kv.cache_shape(3, 4, heads, head_dim, dtype) == shape, (head_dim, heads, dtype)
        rng = np.random.default_rng(head_dim + heads)
        k, v = (jnp.asarray(rng.integers(-8, 8, (2, heads, head_dim)), dtype) for _ in range(2))
        merge_kv = (kernel_hd64 if padded == 64 else kernel).merge_kv  # the kernel the runner picks
        want, got = both(k, v, merge_kv, shape, heads, head_dim)
        assert bool(jnp.array_equal(got, want)), (head_dim, heads, dtype)


def checkpoint_naming(src: Path, out: Path, artifact: str) -> Path:
    """`src` with `tpumk_artifact` in its own config.json (the weights linked, not copied)."""
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, tpumk_artifact=artifact)))
    return out


def test_refusals_at_start_up(checkpoints, moe_artifact, tmp_path):
    dense, moe = checkpoints["dense"][0], checkpoints["moe"][0]
    art = str(moe_artifact)
    named = checkpoint_naming(dense, tmp_path / "names-its-artifact", art)
    env = {"TPUMK_VLLM_ARTIFACT": art}
    cases = [(dense, dict(env=env),
              r"tpumk plugin: artifact \S+ was built for model '\S+', not the served checkpoint's: "),
             (moe, dict(env=env, max_seqs=8), r"tpumk plugin: artifact \S+: batch 4 < vLLM's max_num_seqs 8"),
             (named, {}, r"tpumk plugin: config\.json of the checkpoint names tpumk_artifact: the artifact is chosen "
                         r"by the operator \(TPUMK_VLLM_ARTIFACT or --hf-overrides\)")]
    servers = [Server(ckpt, tmp_path / f"refused{i}.log", **kw) for i, (ckpt, kw, _) in enumerate(cases)]
    try:
        for server in servers:
            assert not server.wait_ready(), "the server started"
    finally:
        for server in servers:
            server.stop()
    for server, (_, _, line) in zip(servers, cases):
        log = server.log.read_text()
        assert server.proc.returncode != 0
        assert re.search(line, log), log[-3000:]
