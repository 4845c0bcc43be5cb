"""The vLLM plugin's two programs on vLLM's KV layout (tpumk.vllm.steps), against the reference.

No vLLM here: the arrays are laid out as vLLM's TPU runner allocates them (tpumk.vllm.kv) and the
attention metadata is built the way it fills it (query_start_loc, seq_lens, flattened block
tables, request slots past num_reqs padded). A prefill chunk of two prompts and then a mixed batch
run the pure-JAX path; decode-only batches run the megakernel (interpret mode, the discharge
interpreter the plugin uses under vLLM's jit). Logits and new cache rows are checked against
`tpumk.model.reference` on its own paged cache; greedy tokens must be identical.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target
from tpumk.vllm import kv, steps

BLOCK = 4  # vLLM's block size here: not the kernel's page size (16), so the gather really re-pages
NUM_BLOCKS = 48
SLOTS = 6  # request slots as vLLM pads them (past max_num_seqs); the kernel's batch is 4
CONTEXT = 32


@functools.lru_cache(maxsize=None)
def setup(preset: str):
    cfg = load_preset(preset)
    params = random_params(cfg, seed=0)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=4, context=CONTEXT, page_size=16))
    step = make_decode_step(plan, portable=True, nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size, "num_pages": plan.num_pages}
    packed = pack_weights(plan, params)

    @jax.jit
    def decode(caches, ids, pos, qsl, seq_lens, tables, n):
        return steps.decode_step(step, packed, cfg, shape, caches, ids, pos, qsl, seq_lens, tables, n, BLOCK)

    @jax.jit
    def ragged(caches, ids, pos, qsl, tables, n):
        return steps.ragged_step(params, cfg, caches, ids, pos, qsl, tables, n, BLOCK, CONTEXT)

    return cfg, params, decode, ragged


def empty_caches(cfg):
    shape = kv.cache_shape(NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim, R.jnp_dtype(cfg))
    return [jnp.zeros(shape, R.jnp_dtype(cfg)) for _ in range(cfg.num_layers)]


def tables_for(seqs: int) -> np.ndarray:
    """Each request's blocks, shuffled across the pool (as vLLM hands them out over time)."""
    per = CONTEXT // BLOCK
    order = np.random.default_rng(7).permutation(NUM_BLOCKS)[:SLOTS * per]
    t = order.reshape(SLOTS, per).astype(np.int32)
    t[seqs:] = 0
    return t


def batch_inputs(chunks, lengths_before, num_tokens: int):
    """vLLM's flattened batch: chunks[r] = request r's new tokens (starting at lengths_before[r])."""
    ids = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    qsl = np.zeros(SLOTS + 1, np.int32)
    seq_lens = np.zeros(SLOTS, np.int32)
    at = 0
    for r, (chunk, start) in enumerate(zip(chunks, lengths_before)):
        ids[at:at + len(chunk)] = chunk
        pos[at:at + len(chunk)] = np.arange(start, start + len(chunk))
        at += len(chunk)
        qsl[r + 1] = at
        seq_lens[r] = start + len(chunk)
    qsl[len(chunks) + 1:] = at
    return ids, pos, qsl, seq_lens


def reference_logits(cfg, params, sequences):
    """The reference's last-token logits of each whole sequence (one paged cache per sequence)."""
    out = []
    for seq in sequences:
        cache = R.init_cache(cfg, 1, CONTEXT, 16)
        logits, _ = R.prefill(params, cfg, [seq], cache)
        out.append(np.asarray(logits[0]))
    return np.stack(out)


def assert_close(got, want):
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err <= 2e-5 * scale, f"max |logits - reference| = {err:.3g} (scale {scale:.3g})"


# tiny-dense is the full tier: tiny-moe's layer 0 is dense, and the vllm tier serves a dense Qwen3
@pytest.mark.parametrize("preset", [pytest.param("tiny-dense", marks=pytest.mark.full), "tiny-moe"])
def test_prefill_then_decode_on_vllm_layout_equals_reference(preset):
    cfg, params, decode, ragged = setup(preset)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 9)]
    tables = tables_for(2)
    caches = empty_caches(cfg)

    # one prefill chunk of both prompts, padded to 16 token rows (vLLM pads to a bucket)
    ids, pos, qsl, _ = batch_inputs(prompts, [0, 0], 16)
    caches, rows = ragged(caches, ids, pos, qsl, tables, jnp.int32(2))
    want = reference_logits(cfg, params, prompts)
    assert_close(np.asarray(rows)[qsl[1:3] - 1], want)
    assert not np.any(np.asarray(rows)[qsl[2]:]), "rows past the last request are zero"
    seqs = [p + [int(np.argmax(w))] for p, w in zip(prompts, want)]

    # three decode-only steps through the megakernel
    for _ in range(3):
        ids, pos, qsl, seq_lens = batch_inputs([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], 8)
        caches, rows = decode(caches, ids, pos, qsl, seq_lens, tables, jnp.int32(2))
        want = reference_logits(cfg, params, seqs)
        got = np.asarray(rows)[:2]
        assert_close(got, want)
        assert [int(np.argmax(g)) for g in got] == [int(np.argmax(w)) for w in want]
        seqs = [s + [int(np.argmax(w))] for s, w in zip(seqs, want)]

    # a mixed batch: request 0 decodes, request 1 decodes, request 2 arrives with a 6-token prompt
    tables = tables_for(3)
    new = rng.integers(0, cfg.vocab_size, 6).tolist()
    ids, pos, qsl, _ = batch_inputs([[seqs[0][-1]], [seqs[1][-1]], new], [len(seqs[0]) - 1, len(seqs[1]) - 1, 0], 16)
    caches, rows = ragged(caches, ids, pos, qsl, tables, jnp.int32(3))
    assert_close(np.asarray(rows)[qsl[1:4] - 1], reference_logits(cfg, params, seqs + [new]))


def test_rows_round_trip_through_vllm_layout():
    """K and V of head h land in combined heads 2h and 2h + 1 of their slot, bf16 packing 2."""
    heads, d = 2, 64  # head_dim 64: vLLM pads it to 128 lanes
    shape = kv.cache_shape(3, 4, heads, d, jnp.bfloat16)
    assert shape == (3, 4, 2, 2, 128)
    k = jnp.arange(2 * heads * d, dtype=jnp.float32).reshape(2, heads * d)
    v = -k
    cache = kv.write_rows(jnp.zeros(shape, jnp.bfloat16), jnp.array([5, 99]), k, v, heads, d)  # 99: dropped
    flat = np.asarray(cache, np.float32).reshape(12, 4, 128)
    np.testing.assert_array_equal(flat[5, 2, :d], np.asarray(k[0, d:]))  # K of head 1
    np.testing.assert_array_equal(flat[5, 3, :d], np.asarray(v[0, d:]))  # V of head 1
    assert not np.any(np.delete(flat, 5, axis=0)) and not np.any(flat[5, :, d:])
    rk, rv = kv.read_rows(cache, jnp.array([5]), heads, d)
    np.testing.assert_array_equal(np.asarray(rk, np.float32), np.asarray(k[:1]))
    np.testing.assert_array_equal(np.asarray(rv, np.float32), np.asarray(v[:1]))


# ---------------------------------------------------------------------- the plugin's refusals
def vllm_config(model_dir, **kw):
    """The fields of vLLM's VllmConfig the plugin reads (SimpleNamespaces: no vLLM here)."""
    from types import SimpleNamespace as NS

    return NS(model_config=NS(model=str(model_dir), dtype=kw.get("dtype", "float32"), max_model_len=64,
                              hf_config=NS(), quantization=kw.get("quantization")),
              scheduler_config=NS(max_num_seqs=4), cache_config=NS(block_size=16, cache_dtype=kw.get("kv", "auto")),
              parallel_config=NS(tensor_parallel_size=kw.get("tp", 1), pipeline_parallel_size=1),
              speculative_config=kw.get("spec"))


QWEN3_JSON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
              "intermediate_size": 512, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32"}


@pytest.mark.parametrize("case, change, kw, line", [
    ("tensor-parallel", {}, {"tp": 2}, "tensor_parallel_size = 2: expected 1"),
    ("kv-dtype", {}, {"kv": "fp8"}, "--kv-cache-dtype fp8: expected auto"),
    ("quantization", {}, {"quantization": "fp8"}, "--quantization fp8: expected none"),
    ("speculative", {}, {"spec": object()}, "speculative decoding is configured"),
    ("sliding", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, {},
     "has sliding-window layers"),
    ("unsupported", {"model_type": "mamba"}, {}, "mamba"),
])
def test_plugin_refuses_what_it_cannot_serve(tmp_path, case, change, kw, line):
    import json

    from tpumk.errors import TpumkError
    from tpumk.vllm.runtime import Runtime

    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_JSON, **change)))
    with pytest.raises(TpumkError) as e:
        Runtime.from_vllm_config(vllm_config(tmp_path, **kw))
    msg = str(e.value)
    assert line in msg and "\n" not in msg, msg


def test_plugin_builds_its_step_for_vllm_shapes(tmp_path):
    import json

    from tpumk.vllm.runtime import Runtime

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_JSON))
    rt = Runtime.from_vllm_config(vllm_config(tmp_path))
    assert (rt.plan.batch, rt.plan.context, rt.plan.q_len, rt.cfg.dtype) == (4, 64, 1, "float32")
    assert rt.source.startswith("built on start-up")
