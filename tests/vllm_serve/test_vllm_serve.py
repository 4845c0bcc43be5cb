"""End to end: `vllm serve` (vLLM's TPU backend, on this CPU host) with tpumk's plugin.

Runs only in the vLLM venv (docs/serving-vllm.md: Python 3.12, `pip install -e '.[vllm]' -c
constraints/vllm-tpu.txt`), with `-m vllm`. Each test starts a real server on 127.0.0.1 (the
engine, scheduler, paged KV manager, runner and sampler of vllm-tpu 0.32), with the test-only
patches of tests/vllm_serve/cpu_site and nothing able to reach the network, and stops it.

- a tiny Qwen3 (head_dim 128), a tiny Llama of head_dim 64 (Llama-3.2-1B's and SmolLM2's
  width, which vLLM's TPU runner caches in another layout: tpumk/vllm/kv.py) and a tiny gpt-oss
  (attention sinks, a sliding window on layer 0 of 2, MoE; one stacked cache for every layer, the
  window layer keeping all its pages) and a tiny DeepSeek-V3 (MLA and MoE, served with
  VLLM_MLA_DISABLE=1 on the kernel's one stacked latent array) and a tiny Qwen3.5 Gated DeltaNet
  hybrid (served with --no-enable-prefix-caching: its linear layers' state pool a third cache
  array, tpumk/vllm/states.py) written by transformers, decode steps built on start-up,
  and a tiny Qwen3-MoE served from a `tpumk export`
  artifact named by --hf-overrides (its jax.export program): concurrent `/v1/completions` through
  the `openai` client give transformers' greedy tokens, and the server's log shows the decode
  steps ran in tpumk's megakernel (TPUMK_VLLM_COUNT_STEPS);
- the KV cache is the megakernel's own stacked layout (tpumk/vllm/kv.py): the served runner logs
  two arrays of [layers, blocks, 16, width], vLLM's KV usage metric moves while the requests run
  and its token counter counts every sampled token; and tpu_inference's own spec and allocator
  code make that layout of the plugin's declared layers (in the test's own process);
- a tiny Llama of 4 KV heads at --tensor-parallel-size 4 on 4 host devices: tpumk's 4-device
  megakernel on vLLM's mesh and its KV arrays in tpu_inference's tensor-parallel layout
  (docs/serving-vllm.md, "Tensor parallel"), the same checks; and why the cpu_site copies the
  step inputs tpu_inference hands device_put (an aligned numpy buffer is aliased on the CPU),
  and on one device through the served engine's import hooks (a step still running reads its
  own positions while the host refills the runner's buffer for the next step);
- an artifact (TPUMK_VLLM_ARTIFACT) of another model or of a smaller batch than --max-num-seqs, a
  checkpoint whose own config.json names tpumk_artifact: the server refuses to start and its log
  holds the plugin's one line saying why (an MLA checkpoint without VLLM_MLA_DISABLE=1:
  tpu_inference's own line) (these servers start side by side: each is mostly
  vLLM's start-up; tests/test_vllm_adapter.py has the rest of the refusals, without vLLM).
"""

from __future__ import annotations

import concurrent.futures as cf
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
TP = 4  # --tensor-parallel-size of the tensor-parallel case (host CPU devices)
READY_S = 420
# a tiny gpt-oss: attention sinks, q / k / v / o biases, layer 0 sliding a 6-token window (shorter
# than every prompt with its 6 new tokens) and layer 1 full, YaRN, 4 experts of which 2 route each
# token, the clamped SwiGLU (limit 1, so the clamps bite at these scales)
GPT_OSS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=128,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.0,
               max_position_embeddings=256,
               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                    truncate=False, original_max_position_embeddings=16))

# a tiny DeepSeek-V3 (MLA: q-LoRA, a 40-wide latent and 8 rope lanes, YaRN with both mscales,
# interleaved RoPE rows; one dense layer then MoE with group-limited routing, a correction bias and
# a shared expert: tests/hf_utils.py's DEEPSEEK_V3_KW) with the hidden size and experts 128 wide,
# as the megakernel needs, and a vocabulary of 512 (the prompts hold ids up to 511)
DEEPSEEK_V3 = dict(hidden_size=128, moe_intermediate_size=128, vocab_size=512)


def tp_env(tp: int) -> dict:
    """tp host CPU devices for vLLM's mesh (made before JAX starts its backends), and XLA CPU
    threads enough for tp interpreted kernels blocked on each other's semaphores
    (tpumk.targets.ensure_host_devices: NPROC)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
    return {"XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={tp}"]), "NPROC": str(4 * tp)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_site_path() -> str:
    """PYTHONPATH for a served process: the cpu_site patches first, then this checkout (its tpumk
    before the venv's install, which may be another checkout's, editable), then the caller's own."""
    return os.pathsep.join(p for p in (str(HERE / "cpu_site"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


class Server:
    """`vllm serve` in its own process group; `stop()` ends it and everything it started."""

    def __init__(self, model: Path, log: Path, env: dict | None = None, max_seqs: int = MAX_SEQS,
                 overrides: dict | None = None, blocks: int = 64, tp: int = 1, args: tuple[str, ...] = ()):
        self.port, self.log = _free_port(), log
        # --attention-backend tpumk (a backend registered by a plugin): tpu_inference allows it with
        # forked engine processes only, and `vllm serve` spawns them unless told otherwise
        full = dict(os.environ, **OFFLINE_ENV, VLLM_WORKER_MULTIPROC_METHOD="fork", PYTHONPATH=cpu_site_path(),
                    **(tp_env(tp) if tp > 1 else {}), **(env or {}))
        cmd = [str(Path(sys.executable).with_name("vllm")), "serve", str(model), "--host", "127.0.0.1", "--port",
               str(self.port), "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", str(max_seqs),
               "--max-num-batched-tokens", "64", "--num-gpu-blocks-override", str(blocks), "--skip-tokenizer-init",
               "--attention-backend", "tpumk", "--hf-overrides", json.dumps({"architectures": ["TpumkForCausalLM"], **(overrides or {})}),
               *(["--tensor-parallel-size", str(tp)] if tp > 1 else []), *args]
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
    from hf_utils import build_checkpoint, build_deepseek_checkpoint, build_qwen3_5_checkpoint, hf_greedy

    d = tmp_path_factory.mktemp("ckpt")
    made = {"dense": build_checkpoint(d / "qwen3"), "moe": build_checkpoint(d / "qwen3-moe", moe=True),
            "llama-hd64": build_checkpoint(d / "llama-hd64", arch="llama", head_dim=64),
            # 8 query heads, 4 KV heads of 128: one KV head per device at --tensor-parallel-size 4
            "llama-tp4": build_checkpoint(d / "llama-tp4", arch="llama", num_attention_heads=8, num_key_value_heads=4),
            "gpt-oss": build_checkpoint(d / "gpt-oss", arch="gpt_oss", **GPT_OSS),
            "deepseek-v3": build_deepseek_checkpoint(d / "deepseek-v3", seed=3, **DEEPSEEK_V3),
            "qwen3.5-hybrid": build_qwen3_5_checkpoint(d / "qwen3.5", seed=5)}
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


def metrics(port: int) -> dict[str, float]:
    """vLLM's Prometheus metrics (/metrics), each name's samples summed over their labels."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def kv_usage_while(port: int, stop: list) -> list[float]:
    """vLLM's vllm:kv_cache_usage_perc, read every 50 ms until stop[0] is set."""
    seen = []
    while not stop[0]:
        seen.append(metrics(port).get("vllm:kv_cache_usage_perc", 0.0))
        time.sleep(0.05)
    return seen


# what tpumk.vllm.model logs for each program (TPUMK_VLLM_COUNT_STEPS)
STEP_NAMES = {"decode": "megakernel decode step", "verify": "megakernel verify step",
              "ragged": "JAX prefill/mixed step"}


def steps_run(log: Path, kind: str) -> list[int]:
    """The number of requests of each step the plugin logged as run by `kind`'s program."""
    what = STEP_NAMES[kind]
    return [int(n) for n in re.findall(rf"{what} #\d+ \((\d+) requests\)", log.read_text())]


def gpt_oss_without_window_and_sinks(path: Path) -> list[list[list[int]]]:
    """transformers' greedy tokens of the gpt-oss checkpoint with its window wider than every
    sequence, then with its sinks at -1e9 (no share of any softmax)."""
    import copy

    import torch
    from hf_utils import hf_greedy, load_model

    model = load_model(str(path))
    no_window, no_sinks = copy.deepcopy(model), copy.deepcopy(model)
    no_window.config.sliding_window = 4096
    with torch.no_grad():
        for a, b in zip(no_window.model.layers, no_sinks.model.layers):
            a.self_attn.sliding_window = None
            b.self_attn.sinks.fill_(-1e9)
    return [hf_greedy(path, PROMPTS, STEPS, model=m) for m in (no_window, no_sinks)]


@pytest.mark.parametrize("kind", ["dense", "llama-hd64", "moe", "gpt-oss", "deepseek-v3", "llama-tp4", "qwen3.5-hybrid"])
def test_served_tokens_are_transformers_greedy_tokens(kind, checkpoints, tmp_path, request):
    ckpt, want = checkpoints[kind]
    if kind == "gpt-oss":  # the window and the sinks each change these tokens: a server ignoring either fails
        assert all(other != want for other in gpt_oss_without_window_and_sinks(ckpt))
    overrides = {}
    if kind == "moe":  # from an artifact the operator names in --hf-overrides: its jax.export program
        overrides["tpumk_artifact"] = str(request.getfixturevalue("moe_artifact"))
    # an artifact's exported program takes its own pool: the plan's batch x context pages; an MLA
    # model with vLLM's own MLA switched off (VLLM_MLA_DISABLE=1: the plugin declares the kernel's
    # latent cache itself, docs/serving-vllm.md)
    tp = TP if kind == "llama-tp4" else 1
    server = Server(ckpt, tmp_path / "serve.log", overrides=overrides, blocks=16 if kind == "moe" else 64,
                    env={"VLLM_MLA_DISABLE": "1"} if kind == "deepseek-v3" else None, tp=tp,
                    # a hybrid's state slot is its request's first block (tpumk.vllm.states): no shared
                    # prefixes; 8 tokens a step, so the 9-token prompt is prefilled in two chunks, its
                    # linear layers' state carried from one to the next
                    args=("--no-enable-prefix-caching", "--max-num-batched-tokens", "8")
                    if kind == "qwen3.5-hybrid" else ())
    try:
        assert server.wait_ready(), (tmp_path / "serve.log").read_text()[-3000:]
        with cf.ThreadPoolExecutor(1) as ex:
            stop = [False]
            usage = ex.submit(kv_usage_while, server.port, stop)
            try:
                got = completions(server.port, PROMPTS)
            finally:
                stop[0] = True
            usage = usage.result()
        after = metrics(server.port)
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert got == want
    # vLLM allocated the kernel's two stacked arrays, [layers, blocks, block size 16, width] (the
    # runner's log labels the first axis num_blocks and prints the others); an MLA model's one
    # latent array, [layers, blocks, 16, 128] (40 + 8 lanes in a whole 128-lane tile); tensor
    # parallel: [layers, blocks, tp x 16, width / tp], split on its mesh's 'model' axis (tpumk.vllm.kv)
    blocks = 16 if kind == "moe" else 64
    # a hybrid: a third array, its linear layers' state pool (one slot's entry per block: tpumk.vllm.states)
    arrays, width = (1, "128") if kind == "deepseek-v3" else (3, r"\d+") if kind == "qwen3.5-hybrid" else (2, r"\d+")
    assert re.search(rf"num_blocks=\[{', '.join([str(blocks)] * arrays)}\] \| regular_attn_layers={arrays} \| "
                     rf"regular_attn_shape=\(num_blocks, \({blocks}, {16 * tp}, {width}\)\)", log), log[-3000:]
    if kind == "qwen3.5-hybrid":  # 2 Gated DeltaNet layers' states, a block's 16 rows one slot's entry
        assert re.search(rf"tpumk plugin: linear-attention state pool: \[2, {blocks}, 16, \d+\] float32", log), \
            log[-3000:]
    if tp > 1:  # float weights held once on vLLM's mesh: the packed parts only (tpumk.kernel.unpack)
        assert re.search(rf"tpumk plugin: .*Pallas TPU interpreter on {tp} CPU devices.*weights held once", log), \
            log[-3000:]
    # vLLM's metrics: the KV usage rose while requests held blocks (each request's tokens fit one
    # 16-token block of the pool's blocks - 1, the null block), the token counter counts them all
    assert 0 < max(usage) <= len(PROMPTS) / (blocks - 1) + 1e-6, usage
    assert after["vllm:generation_tokens_total"] == len(PROMPTS) * STEPS, after
    source = "artifact" if kind == "moe" else "built on start-up"
    assert re.search(rf"tpumk plugin: .*decode steps from {source}", log), log[-3000:]
    decode, ragged = steps_run(tmp_path / "serve.log", "decode"), steps_run(tmp_path / "serve.log", "ragged")
    # every sampled token came from a logged step (one per request per step), most of them from
    # the megakernel's decode-only batches, several requests in one step
    # (the hybrid's 8-token steps also run prompt chunks that sample nothing: the 9-token prompt's
    # first chunk at least, so its state was carried into a second chunk)
    unsampled = sum(decode) + sum(ragged) - len(PROMPTS) * STEPS
    assert (0 < unsampled < sum(ragged)) if kind == "qwen3.5-hybrid" else unsampled == 0, (decode, ragged)
    assert sum(decode) >= len(PROMPTS) * STEPS // 2 and max(decode) > 1, (decode, ragged)


def eagle3_drafter(target: Path, out: Path) -> Path:
    """An EAGLE-3 drafter of random weights for `target`: speculators' config.json (tests/draft_files.py's
    writer), reading taps 0, 1, 2 with a Llama layer (tpu_inference's drafter class,
    Eagle3LlamaForCausalLM: no q / k norms) of head size hidden / heads, as tpu_inference sizes its
    cache, and the decoder layer's tensors under EAGLE-3's original names, `midlayer.*`: tpu_inference
    0.32's drafter loads those only (speculators' `layers.0.*` names are not valid param paths to it)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from draft_files import config_json, edited, tensors, write_drafter

    from tpumk.draft.drafter import random_drafter
    from tpumk.model.config import load_hf_config

    cfg = load_hf_config(target)
    # heads of 128 (a 64-wide head has tpu_inference's other cache layout, its hd64 kernel's K | V
    # in one 128-lane row, which cpu_site's attention does not read)
    heads = cfg.hidden_size // 128
    d = random_drafter("eagle3", cfg, seed=2, taps=(0, 1, 2), block=2, draft_vocab=256, heads=heads, kv_heads=heads,
                       head_dim=128)
    conf = edited(config_json(d, cfg.num_layers), {"transformer_layer_config.model_type": "llama"})
    layer = {k: v for k, v in tensors(d).items() if k.startswith("layers.0.")}
    midlayer = {"midlayer." + k.removeprefix("layers.0."): v for k, v in layer.items() if "_norm.weight" not in k
                or "self_attn" not in k}  # no q / k norms
    return write_drafter(out, d, cfg.num_layers, conf, drop=tuple(layer), extra=midlayer)


@pytest.mark.parametrize("kind", ["qwen3", "deepseek-v3"])
def test_eagle3_speculative_decoding_gives_transformers_greedy_tokens(kind, tmp_path):
    """`--speculative-config` eagle3 with 2 drafts a step (tpu_inference's own drafter and
    rejection sampler): the tokens are those of greedy decoding (transformers'), the megakernel's
    verify step (q_len 3, with the drafter's taps) ran the verify batches and the plugin's JAX
    step the prefill (docs/serving-vllm.md, "Speculative decoding"), and vLLM verified drafts (its
    spec-decode counters moved). The drafter's weights are random: acceptance is low, the tokens
    may not differ. Targets: a 3-layer Qwen3, and the tiny DeepSeek-V3 (MLA on the kernel's one
    latent array, VLLM_MLA_DISABLE=1: the MLA verify step and tpumk.vllm.mla_prefill with taps)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_utils import build_checkpoint, build_deepseek_checkpoint, hf_greedy

    if kind == "deepseek-v3":  # 3 layers (DEEPSEEK_V3_KW); a query-key head of 120 + 8 = 128 lanes,
        # which tpu_inference's drafter loader pads by nothing (tpumk.vllm.speculative.drafter_head_pad)
        ckpt = build_deepseek_checkpoint(tmp_path / "deepseek-v3", seed=3, qk_nope_head_dim=120, **DEEPSEEK_V3)
    else:
        ckpt = build_checkpoint(tmp_path / "qwen3-3", num_hidden_layers=3)  # three distinct taps below the last layer
    want = hf_greedy(ckpt, PROMPTS, STEPS)
    drafter = eagle3_drafter(ckpt, tmp_path / "eagle3")
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}
    server = Server(ckpt, tmp_path / "serve.log", args=("--speculative-config", json.dumps(spec)),
                    env={"VLLM_MLA_DISABLE": "1"} if kind == "deepseek-v3" else None)
    try:
        assert server.wait_ready(), (tmp_path / "serve.log").read_text()[-3000:]
        got = completions(server.port, PROMPTS)
        after = metrics(server.port)
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert got == want, log[-3000:]
    assert after.get("vllm:spec_decode_num_draft_tokens_total", 0) > 0, after
    # the drafter (stored without an embedding, as speculators' are) reads the target's, which the plugin exposes
    assert "Setting draft model's embed_tokens to target model's embed" in log, log[-3000:]
    verify, ragged = steps_run(tmp_path / "serve.log", "verify"), steps_run(tmp_path / "serve.log", "ragged")
    # the prefill (prompts of up to 9 tokens: more than k + 1) in the JAX step, the verify batches
    # in the megakernel, several requests in one step; no step in the decode step (it has no taps)
    assert sum(ragged) > 0 and sum(verify) > 0 and max(verify) > 1, (verify, ragged)
    assert not steps_run(tmp_path / "serve.log", "decode")


def test_kv_cache_is_the_kernel_s_stacked_layout(monkeypatch):
    """What tpu_inference's own runner code makes of the plugin's declared KV-cache layers and its
    `tpumk` backend (in the test's own process: mostly the import of tpu_inference): the spec of
    each layer (`KVCacheManager.get_kv_cache_spec`, which vLLM sizes and counts blocks by) holds
    exactly one stacked array's bytes per block, and `create_kv_caches` allocates that array as
    `[layers, blocks, block_size, width]` (tpumk.vllm.kv), so a tpu_inference that changes either
    fails here, not in a server."""
    from types import SimpleNamespace as NS

    for name, value in OFFLINE_ENV.items():  # before tpu_inference is imported in this process
        monkeypatch.setenv(name, value)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.sharding import Mesh
    from tpu_inference.runner.kv_cache import create_kv_caches
    from tpu_inference.runner.kv_cache_manager import KVCacheManager

    from tpumk.vllm import kv
    from tpumk.vllm.backend import TpumkAttentionBackend, declare_layers

    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))  # one device: nothing sharded
    # (the last: an MLA model's one latent array, DeepSeek-V3's 61 layers of 640 lanes, vLLM's own
    # MLA off as VLLM_MLA_DISABLE=1 has it)
    for layers, width, dtype, names in [(3, 256, torch.bfloat16, (kv.K_LAYER, kv.V_LAYER)),
                                        (2, 128, torch.float32, (kv.K_LAYER, kv.V_LAYER)),
                                        (36, 1024, torch.bfloat16, (kv.K_LAYER, kv.V_LAYER)),
                                        (61, 640, torch.bfloat16, (kv.K_LAYER,))]:
        config = NS(compilation_config=NS(static_forward_context={}), cache_config=NS(block_size=16),
                    model_config=NS(dtype=dtype))
        declare_layers(config, layers, width, names)
        runner = NS(model_config=NS(use_mla=False), cache_config=config.cache_config, mesh=mesh, vllm_config=config,
                    kv_cache_dtype=dtype, attention_backend=TpumkAttentionBackend())
        specs = KVCacheManager(runner).get_kv_cache_spec()
        assert sorted(specs) == sorted(names)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        assert {s.page_size_bytes for s in specs.values()} == {layers * 16 * width * itemsize}
        spec = specs[kv.K_LAYER]
        (cache,) = create_kv_caches(5, 16, spec.num_kv_heads, spec.head_size, mesh, [kv.K_LAYER],
                                    jnp.dtype(str(dtype).removeprefix("torch.")),
                                    attention_backend=TpumkAttentionBackend())
        assert cache.shape == kv.cache_shape(layers, 5, 16, width), (layers, width, cache.shape)


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
                         r"by the operator \(TPUMK_VLLM_ARTIFACT or --hf-overrides\)"),
             # an MLA checkpoint without VLLM_MLA_DISABLE=1: vLLM's own MLA path, which tpu_inference
             # refuses on its own terms before the plugin's model is built (docs/serving-vllm.md)
             (checkpoints["deepseek-v3"][0], {}, r"MLA models require both the NEW_MODEL_DESIGN=1 environment variable")]
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




# tpu_inference's own DeviceBuffer and device_array on vLLM's mesh of 4 host devices, as its runner
# uses them for a step's metadata, the buffer at a 64-byte aligned address (where numpy's
# allocator happened to put it in some runs)
HAZARD = """
import importlib.util, json, sys
import jax, numpy as np
from jax.sharding import Mesh
from tpu_inference import utils
spec = importlib.util.spec_from_file_location("cpu_site_patches", sys.argv[1])
site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(site)
mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4), ("data", "model"))
seen = {}
for name, put in (("tpu_inference", utils.device_array), ("cpu_site", site._copying_device_array(utils.device_array))):
    buf = utils.DeviceBuffer()
    raw = np.zeros(buf.buffer.size + 16, np.int32)
    skip = (-raw.ctypes.data % 64) // 4
    buf.buffer = raw[skip:skip + buf.buffer.size]
    assert buf.buffer.ctypes.data % 64 == 0
    buf.append(np.arange(8, dtype=np.int32), key="ids")
    blob, _ = buf.build()
    got = put(mesh, blob)
    got.block_until_ready()
    buf.reset()
    buf.append(np.full(8, -1, np.int32), key="ids")  # the next step's inputs, in the same buffer
    seen[name] = [np.asarray(s.data).tolist() for s in got.addressable_shards]
print(json.dumps(seen))
"""


def test_cpu_site_keeps_a_step_s_inputs_from_the_next_step():
    """Why tests/vllm_serve/cpu_site copies what tpu_inference hands `device_put`: on the CPU,
    JAX's `device_put` of a numpy array at a 64-byte aligned address aliases its memory (no copy),
    and tpu_inference's runner passes a view of its `DeviceBuffer`, which it resets and rewrites
    for the next step. So when numpy's allocator puts that buffer on such an address, a step
    still running when the host prepares the next one reads the next one's metadata: here a
    device_array of a built buffer already holds what the buffer holds after the rewrite, on
    every device of vLLM's 4-device mesh; the cpu_site's holds what was built (a fresh process,
    4 host devices, no cpu_site patches)."""
    env = dict(os.environ, **OFFLINE_ENV, **tp_env(4))
    proc = subprocess.run([sys.executable, "-c", HAZARD, str(HERE / "cpu_site" / "sitecustomize.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["cpu_site"] == [list(range(8))] * 4, seen
    # the hazard the patch removes (this JAX on the CPU): if this fails, the patch may be moot
    assert seen["tpu_inference"][0] == [-1] * 8, seen


# One device (the served llama-hd64 case's flake): a step that reads its positions only after its
# predecessor's work (the KV cache it waits for) and its own, while the host refills the runner's
# positions buffer for the next step, in a process with the served engine's import hooks
STEP_RACE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from tpu_inference.utils import device_array

mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
work = jax.jit(lambda c: jax.lax.fori_loop(0, 100, lambda i, a: jnp.tanh(a @ a), c))

@jax.jit
def step(cache, positions):
    return positions + (work(cache)[0, 0] > 1e9).astype(jnp.int32)

cache = jnp.ones((512, 512), jnp.float32) / 512
step(work(cache), jnp.zeros(8, jnp.int32)).block_until_ready()  # compiled before the race
raw = np.zeros(64 + 16, np.int32)  # the runner's positions_cpu (one buffer for every step), 64-byte aligned
positions_cpu = raw[(-raw.ctypes.data % 64) // 4:][:64]
positions_cpu[:4] = [9, 12, 3, 5]
got = step(work(cache), device_array(mesh, positions_cpu[:8]))  # step N, behind step N - 1
positions_cpu[:4] = [13, 4, 6, 0]  # the host prepares step N + 1 while step N runs
print("read", np.asarray(got)[:4].tolist())
"""


def test_a_served_step_reads_its_own_positions_while_the_host_prepares_the_next():
    """The same hazard on one device, through the hooks the served engine runs with (cpu_site on
    PYTHONPATH, so this also fails if the patch stops reaching `tpu_inference.utils`): the
    runner's `positions_cpu` is refilled for step N + 1 while step N runs (async scheduling,
    vLLM's default), and a step reading it late read the next step's positions before the
    patch (here [13, 4, 6, 0]; served, a request's last token at another request's position:
    the llama-hd64 case's wrong token)."""
    env = dict(os.environ, **OFFLINE_ENV, PYTHONPATH=cpu_site_path())
    r = subprocess.run([sys.executable, "-c", STEP_RACE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read [9, 12, 3, 5]" in r.stdout, r.stdout
