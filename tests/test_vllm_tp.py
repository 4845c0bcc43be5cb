"""The vLLM plugin at tensor_parallel_size 4 (no vLLM here): the serve step on 4 host devices
against the same step on one device, token for token.

vLLM's TPU runner (tpu_inference 0.32) puts a tensor-parallel run on a mesh ('data', 'model') of
shape (1, N) and splits each KV array's third axis over 'model'; the plugin's backend makes that
axis N x block_size (`tpumk.vllm.kv.cache_shape`), so device d's shard is exactly the kernel's
`[layers, blocks, block_size, width / N]` of its KV heads. Here the arrays are allocated that way
on such a mesh, and a served sequence runs through `steps.serve_step` as the plugin runs it inside
vLLM's jit: a ragged prefill of three prompts (pure JAX on the reference-layout weights read back
from the sharded packed ones, as the plugin holds them; XLA partitions it), greedy decode steps
through the 4-device megakernel (Pallas' TPU interpreter, in-kernel collectives) on the arrays in
place, a mixed batch (a new prompt beside decodes), more decodes. The same sequence on one device
(`kv.cache_shape` of one device, the discharge interpreter the one-device plugin runs) must give
the same greedy tokens, logits within float32 rounding, and the same cache rows; a second 4-device
run, with the interpreter's DMA race detector on, must give bit-identical logits and cache and
find no race.

The runs need 4 host devices, which JAX makes only before its backends start: one subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from host_flags import xla_flags  # noqa: E402

N = 4
BLOCK = 16
NUM_BLOCKS = 13  # vLLM's pool: block 0 is its null block, the others handed out shuffled
CONTEXT = 48
BATCH = 4  # the kernel's batch (vLLM's max_num_seqs)
SLOTS = 6  # request slots as vLLM pads them
TOKENS = 32  # vLLM's token bucket of a step
PROMPTS = [[5, 17, 300, 42, 8], [100, 200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [1, 2]]
LATE = [511, 0, 250, 7]  # a fourth request arriving after two decode steps (a mixed batch)


# a tiny Llama's config.json whose 4 KV heads split over 4 devices (GQA: 8 query heads of 128)
LLAMA_JSON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
              "intermediate_size": 512, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32"}


def runtime(model_dir: Path, tp: int, mesh_devices=None):
    """The plugin's Runtime for vLLM's settings (the fields of VllmConfig it reads)."""
    from types import SimpleNamespace as NS

    from tpumk.vllm.runtime import Runtime

    config = NS(model_config=NS(model=str(model_dir), dtype="float32", max_model_len=CONTEXT,
                                hf_config=NS(**LLAMA_JSON), hf_overrides={}, quantization=None),
                scheduler_config=NS(max_num_seqs=BATCH), cache_config=NS(block_size=BLOCK, cache_dtype="auto"),
                parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1),
                speculative_config=None)
    return Runtime.from_vllm_config(config, mesh_devices=mesh_devices)


def _worker(races: bool) -> dict:
    import contextlib
    import dataclasses
    import tempfile

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpumk.compat import interpret_races
    from tpumk.kernel.layout import pack_sharded, pack_weights
    from tpumk.kernel.unpack import Unpacker
    from tpumk.kernel.megakernel import make_decode_step, step_mesh
    from tpumk.model.weights import random_params
    from tpumk.plan.padding import params_as_run
    from tpumk.plan.sharding import MESH_AXIS
    from tpumk.vllm import kv, steps

    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(LLAMA_JSON))
    devices = jax.devices("cpu")[:N]
    vllm_mesh = Mesh(np.asarray(devices).reshape(1, N), ("data", "model"))  # tpu_inference's 2-D mesh
    one_rt, tp_rt = runtime(model_dir, 1), runtime(model_dir, N, devices)
    cfg = one_rt.cfg
    raw = random_params(cfg, seed=0)
    packed_tp = pack_sharded(tp_rt.plan, raw)
    checks = {"devices": tp_rt.devices, "kv_width": tp_rt.kv_width, "source": tp_rt.source,
              "weights_once": tp_rt.holds_weights_once,
              "packed_shapes": jax.tree.map(lambda a: [list(a.shape), str(a.dtype)], tp_rt.packed_shapes()) ==
              jax.tree.map(lambda a: [list(a.shape), str(a.dtype)], packed_tp)}

    def served(n: int, detect_races: bool = False):
        """(step, packed, params, unpack, run model, plan shape) as the plugin's Runtime and model
        make them: on 4 devices the weights held once (the packed ones, sharded; the ragged branch
        reads the reference layout back from them: `unpack`)."""
        rt = one_rt if n == 1 else tp_rt
        plan = rt.plan
        params = params_as_run(plan, raw)
        if n == 1:
            return rt.step_for(NUM_BLOCKS), pack_weights(plan, params), params, None, plan.whole_model, rt.plan_shape, \
                plan
        # the plugin's step for vLLM's pool (Runtime.step_for), or the same with the race detector on
        step = rt.step_for(NUM_BLOCKS) if not detect_races else make_decode_step(
            dataclasses.replace(plan, num_pages=NUM_BLOCKS), nested=True, mesh_devices=devices, cache_split="rows",
            detect_races=True)
        m = step_mesh(plan, devices)  # as TpumkForCausalLM.load_weights places them
        packed = {k: jax.device_put(v, NamedSharding(m, P() if k == "embed" else P(MESH_AXIS)))
                  for k, v in packed_tp.items()}
        return step, packed, {}, Unpacker(plan, params), plan.whole_model, rt.plan_shape, plan

    def program(n: int, detect_races: bool = False):
        step, packed, params, unpack, run, shape, plan = served(n, detect_races)
        assert plan.devices == n

        # vLLM's jitted step: the model's state and the donated cache, metadata as arrays
        @jax.jit
        def one(k, v, ids, pos, qsl, seq_lens, tables, num):
            return steps.serve_step(step, packed, params, run, shape, k, v, ids, pos, qsl, seq_lens, tables, num,
                                    BLOCK, CONTEXT, unpack=unpack, devices=n)

        return one, run

    def empty(n: int, width: int, dtype):
        shape = kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, width, n)
        if n == 1:
            return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
        # tpu_inference's create_kv_caches: P(data, kv context, kv head) on its mesh
        sharding = NamedSharding(vllm_mesh, P("data", None, "model"))
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return make(), make()

    per = CONTEXT // BLOCK
    order = 1 + np.random.default_rng(7).permutation(NUM_BLOCKS - 1)
    tables = np.zeros((SLOTS, per), np.int32)
    tables[:4] = order[:4 * per].reshape(4, per)

    def batch(chunks, starts):
        ids, pos = np.zeros(TOKENS, np.int32), np.zeros(TOKENS, np.int32)
        qsl, seq_lens = np.zeros(SLOTS + 1, np.int32), np.zeros(SLOTS, np.int32)
        at = 0
        for r, (chunk, start) in enumerate(zip(chunks, starts)):
            ids[at:at + len(chunk)] = chunk
            pos[at:at + len(chunk)] = np.arange(start, start + len(chunk))
            at += len(chunk)
            qsl[r + 1], seq_lens[r] = at, start + len(chunk)
        qsl[len(chunks) + 1:] = at
        return ids, pos, qsl, seq_lens, np.int32(len(chunks))

    def serve(n: int, detect_races: bool = False) -> dict:
        """The served sequence: every step's greedy tokens and last-row logits, and the cache
        rows of every request's tokens (in the whole model's lane order) at the end."""
        one, run = program(n, detect_races)
        k, v = empty(n, run.attention.kv_size, jnp.float32)
        seqs = [list(p) for p in PROMPTS]
        chunks, starts = [list(p) for p in PROMPTS], [0, 0, 0]
        out = {"tokens": [], "logits": [], "kinds": []}
        for i in range(7):
            if i == 3:  # a new request beside three decodes: the ragged (mixed) branch
                seqs.append(list(LATE))
                chunks.append(list(LATE))
                starts.append(0)
            ids, pos, qsl, seq_lens, num = batch(chunks, starts)
            with jax.set_mesh(vllm_mesh) if n > 1 else contextlib.nullcontext():  # vLLM traces its step under its mesh
                (k, v), rows = one(k, v, ids, pos, qsl, seq_lens, tables, num)
            last = np.asarray(rows)[qsl[1:len(chunks) + 1] - 1]
            toks = last.argmax(-1).tolist()
            out["tokens"].append(toks)
            out["logits"].append(last.tolist())
            out["kinds"].append("decode" if all(len(c) == 1 for c in chunks) else "ragged")
            starts = [s + len(c) for s, c in zip(starts, chunks)]
            chunks = [[t] for t in toks]
            for s, t in zip(seqs, toks):
                s.append(t)
        rows = {}
        for r, s in enumerate(seqs):
            written = len(s) - 1  # the last sampled token was never fed
            slots = kv.token_slots(jnp.asarray(tables), jnp.full(written, r), jnp.arange(written), BLOCK)
            rows[r] = [np.asarray(jnp.stack([kv.read_rows(c, li, slots, n) for li in range(cfg.kv_layers)]))
                       .tolist() for c in (k, v)]
        out["rows"] = rows
        out["k_sharding"] = str(k.sharding.spec) if n > 1 else None
        out["k_shape"] = list(k.shape)
        return out

    # the second 4-device run with the interpreter's DMA race detector on (the same values)
    result = {"one": serve(1), "tp": serve(N), "tp_again": serve(N, detect_races=races), "runtime": checks}
    r = interpret_races()
    result["races"] = None if (r is None or not races) else bool(r.races_found)
    return result


def _run(races: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * N), XLA_FLAGS=xla_flags(N))
    proc = subprocess.run([sys.executable, __file__, *(["races"] if races else [])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.full  # (76 s to 2 min: two 4-device runs) tests/README.md: the vLLM tier's [llama-tp4] covers it
def test_serve_step_on_4_devices_gives_the_one_device_tokens():
    got = _run(races=True)
    one, tp, again = got["one"], got["tp"], got["tp_again"]
    # the sequence ran both branches: ragged prefill, decode-only steps, a mixed batch
    assert one["kinds"] == tp["kinds"] == ["ragged", "decode", "decode", "ragged", "decode", "decode", "decode"]
    # vLLM's arrays stayed in its tensor-parallel layout: [layers, blocks, 4 x 16, width / 4] split on 'model'
    assert tp["k_shape"] == [2, NUM_BLOCKS, N * BLOCK, 512 // N] and "model" in tp["k_sharding"], tp["k_sharding"]
    assert tp["tokens"] == one["tokens"]
    for a, b in zip(tp["logits"], one["logits"]):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 2e-5 * np.max(np.abs(b)), np.max(np.abs(a - b))
    for r in one["rows"]:  # every written row of every request, K and V, as one device wrote it
        for a, b in zip(tp["rows"][r], one["rows"][r]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    # deterministic: a second run is bit for bit the first
    assert again["logits"] == tp["logits"] and again["rows"] == tp["rows"]
    assert got["races"] is False
    # the plugin's Runtime at tensor_parallel_size 4: the 4-device build on vLLM's devices, vLLM's
    # arrays 4 x 128 lanes wide, the model's packed weights stacked per device and held alone (the
    # prefill reads the reference layout back from them: tpumk.kernel.unpack)
    assert got["runtime"] == {"devices": N, "kv_width": 512, "weights_once": True, "packed_shapes": True,
                              "source": f"built on start-up (Pallas TPU interpreter on {N} CPU devices)"}


if __name__ == "__main__":
    print(json.dumps(_worker("races" in sys.argv[1:])))
