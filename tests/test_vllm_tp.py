"""The vLLM plugin at tensor_parallel_size 4 (no vLLM here): the serve step on 4 host devices
against the same step on one device, token for token.

vLLM's TPU runner (tpu_inference 0.32) puts a tensor-parallel run on a mesh ('data', 'model') of
shape (1, N) and splits each KV array's third axis over 'model'; the plugin's backend makes that
axis N x block_size (`tpumk.vllm.kv.cache_shape`), so device d's shard is exactly the kernel's
`[layers, blocks, block_size, width / N]` of its KV heads. Here the arrays are allocated that way
on such a mesh, and a served sequence runs through `steps.serve_step` as the plugin runs it inside
vLLM's jit: a ragged prefill of three prompts (pure JAX, XLA partitions it), greedy decode steps
through the 4-device megakernel (Pallas' TPU interpreter, in-kernel collectives) on the arrays in
place, a mixed batch (a new prompt beside decodes), more decodes. The same sequence on one device
(`kv.cache_shape` of one device, the discharge interpreter the one-device plugin runs) must give
the same greedy tokens, logits within float32 rounding, and the same cache rows; a second 4-device
run must give bit-identical logits and cache (no race, no garbage read). One decode step also
runs with the interpreter's DMA race detector on.

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


def model():
    """A tiny Llama-shaped model whose 4 KV heads split over 4 devices (GQA: 8 query heads)."""
    from tpumk.model.config import load_preset

    return load_preset("tiny-dense").replace(num_q_heads=8, num_kv_heads=4, qk_norm=False)


def _worker(races: bool) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpumk.compat import interpret_races
    from tpumk.kernel.layout import pack_sharded, pack_weights
    from tpumk.kernel.megakernel import make_decode_step, step_mesh
    from tpumk.model.weights import random_params
    from tpumk.plan.padding import params_as_run
    from tpumk.plan.plan import make_plan
    from tpumk.plan.sharding import MESH_AXIS
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target
    from tpumk.vllm import kv, steps

    cfg = model()
    raw = random_params(cfg, seed=0)
    devices = jax.devices("cpu")[:N]
    vllm_mesh = Mesh(np.asarray(devices).reshape(1, N), ("data", "model"))  # tpu_inference's 2-D mesh

    def served(n: int, detect_races: bool = False):
        """(step, packed, params, run model, plan shape) as the plugin's Runtime makes them for n devices."""
        plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=BATCH, context=CONTEXT, page_size=BLOCK, devices=n))
        pool = dataclasses.replace(plan, num_pages=NUM_BLOCKS)
        params = params_as_run(plan, raw)
        shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
        if n == 1:
            step = make_decode_step(pool, nested=True, portable=True)
            return step, pack_weights(plan, params), params, plan.whole_model, shape, plan
        step = make_decode_step(pool, nested=True, mesh_devices=devices, cache_split="rows", detect_races=detect_races)
        m = step_mesh(plan, devices)
        packed = {k: jax.device_put(v, NamedSharding(m, P() if k == "embed" else P(MESH_AXIS)))
                  for k, v in pack_sharded(plan, raw).items()}
        return step, packed, jax.device_put(params, NamedSharding(m, P())), plan.whole_model, shape, plan

    def program(n: int, detect_races: bool = False):
        step, packed, params, run, shape, plan = served(n, detect_races)
        assert plan.devices == n

        # vLLM's jitted step: the model's state and the donated cache, metadata as arrays
        @jax.jit
        def one(k, v, ids, pos, qsl, seq_lens, tables, num):
            return steps.serve_step(step, packed, params, run, shape, k, v, ids, pos, qsl, seq_lens, tables, num,
                                    BLOCK, CONTEXT, devices=n)

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

    result = {"one": serve(1), "tp": serve(N), "tp_again": serve(N)}
    if races:
        serve(N, detect_races=True)
        r = interpret_races()
        result["races"] = None if r is None else bool(r.races_found)
    return result


def _run(races: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * N), XLA_FLAGS=xla_flags(N))
    proc = subprocess.run([sys.executable, __file__, *(["races"] if races else [])], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


if __name__ == "__main__":
    print(json.dumps(_worker("races" in sys.argv[1:])))
