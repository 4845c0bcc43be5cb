"""The vLLM plugin's two programs on vLLM's KV cache (tpumk.vllm.steps), against the reference.

No vLLM here: the cache is the two arrays vLLM allocates with the plugin's `tpumk` attention
backend, the megakernel's stacked K and V `[layers, blocks, block_size, width]` (tpumk.vllm.kv),
and the attention metadata is built the way vLLM's TPU runner fills it (query_start_loc,
seq_lens, flattened block tables, request slots past num_reqs padded). A decode-only batch runs
the megakernel (interpret mode, the discharge interpreter the plugin uses under vLLM's jit) on
those arrays themselves, checked against `tpumk.model.reference.decode_step` on the same arrays
with vLLM's block tables as its page tables: logits and the whole cache. The full tier also runs
a prefill chunk of two prompts, decode steps and a mixed batch against the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.kernel.layout import pack_weights
from tpumk.kernel.unpack import Unpacker
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target
from tpumk.vllm import kv, steps

BLOCK = 16  # vLLM's block size, which is the kernel's page size
NUM_BLOCKS = 11  # vLLM's pool: more blocks than the kernel's batch x context needs (8), handed out shuffled
SLOTS = 6  # request slots as vLLM pads them (past max_num_seqs); the kernel's batch is 4
CONTEXT = 32


# tiny-dense with gpt-oss's attention: a 6-token window on layer 0 (shorter than the cached
# sequences of the decode test, so keys outside it are there to be wrongly read) and sinks
WINDOW_SINKS = "tiny-dense-window-sinks"
VARIANTS = {WINDOW_SINKS: ("tiny-dense", dict(sliding_window=6, sliding_layers=(0,), attn_sinks=True))}


@functools.lru_cache(maxsize=None)
def setup(preset: str):
    base, overrides = VARIANTS.get(preset, (preset, {}))
    cfg = load_preset(base).replace(**overrides)
    params = random_params(cfg, seed=0)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=4, context=CONTEXT, page_size=BLOCK))
    # the step for vLLM's pool of NUM_BLOCKS, as the plugin's Runtime.step_for makes it
    step = make_decode_step(dataclasses.replace(plan, num_pages=NUM_BLOCKS), portable=True, nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    packed = pack_weights(plan, params)

    def decode_fn(k, v, ids, pos, qsl, seq_lens, tables, n):
        return steps.decode_step(step, packed, shape, k, v, ids, pos, qsl, seq_lens, tables, n)

    @jax.jit
    def ragged(cache, ids, pos, qsl, tables, n):
        return steps.ragged_step(params, cfg, *cache, ids, pos, qsl, tables, n, BLOCK, CONTEXT)

    # the interpreter's cheap compile options (what make_decode_step's own top-level jit uses on the cpu target)
    return cfg, params, plan, decode_fn, jax.jit(decode_fn, compiler_options=INTERPRET_COMPILER_OPTIONS), ragged


def empty_cache(cfg):
    shape = kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.kv_size)
    return jnp.zeros(shape, R.jnp_dtype(cfg)), jnp.zeros(shape, R.jnp_dtype(cfg))


def tables_for(seqs: int) -> np.ndarray:
    """Each request's blocks, shuffled across the pool (as vLLM hands them out over time; never
    block 0, vLLM's null block); the padding slots' rows 0, as vLLM leaves them."""
    per = CONTEXT // BLOCK
    order = 1 + np.random.default_rng(7).permutation(NUM_BLOCKS - 1)
    t = np.zeros((SLOTS, per), np.int32)
    t[:seqs] = order[:seqs * per].reshape(seqs, per)
    return t


def batch_inputs(chunks, lengths_before, num_tokens: int, slots: int = SLOTS):
    """vLLM's flattened batch: chunks[r] = request r's new tokens (starting at lengths_before[r]),
    in `num_tokens` token rows and `slots` request slots (the vLLM plugin's test files share it)."""
    ids = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    qsl = np.zeros(slots + 1, np.int32)
    seq_lens = np.zeros(slots, np.int32)
    at = 0
    for r, (chunk, start) in enumerate(zip(chunks, lengths_before)):
        ids[at:at + len(chunk)] = chunk
        pos[at:at + len(chunk)] = np.arange(start, start + len(chunk))
        at += len(chunk)
        qsl[r + 1] = at
        seq_lens[r] = start + len(chunk)
    qsl[len(chunks) + 1:] = at
    return ids, pos, qsl, seq_lens


def assert_close(got, want):
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(np.asarray(got) - want)))
    assert err <= 2e-5 * scale, f"max |logits - reference| = {err:.3g} (scale {scale:.3g})"


def test_decode_step_on_vllm_s_stacked_cache_equals_the_reference():
    """One decode-only batch (3 live requests of 4 kernel slots, 6 vLLM slots) on a cache of
    random rows: the megakernel runs on vLLM's arrays with vLLM's block tables, and its logits and
    the whole cache it returns equal the reference's decode step on the same arrays and tables
    (every row but the 3 new ones unchanged). The model has a sliding-window layer and attention
    sinks (gpt-oss's attention): one page table for every layer, the window layer's pages all
    held, the kernel applying the window and the sinks itself (the reference without either
    gives other logits)."""
    cfg, params, plan, _, decode, _ = setup(WINDOW_SINKS)
    rng = np.random.default_rng(5)
    k, v = (jnp.asarray(rng.normal(size=c.shape), c.dtype) for c in empty_cache(cfg))
    lengths = [5, 17, 30]  # tokens cached before this step: within the first block, on the second, near the end
    tables = tables_for(len(lengths))
    tokens = rng.integers(0, cfg.vocab_size, len(lengths)).tolist()
    ids, pos, qsl, seq_lens = batch_inputs([[t] for t in tokens], lengths, 8)
    (k_got, v_got), rows = decode(k, v, ids, pos, qsl, seq_lens, tables, jnp.int32(len(lengths)))

    b = plan.batch
    ref_tokens = np.zeros((b, 1), np.int32)
    ref_pos = np.full((b, 1), -1, np.int32)
    ref_len = np.zeros(b, np.int32)
    ref_tokens[:3, 0], ref_pos[:3, 0], ref_len[:3] = tokens, lengths, lengths
    cache = R.KVCache(k, v, jnp.asarray(tables[:b]), jnp.asarray(ref_len))
    want, want_cache = jax.jit(lambda c: R.decode_step(params, cfg, jnp.asarray(ref_tokens), jnp.asarray(ref_pos),
                                                       c))(cache)
    assert_close(np.asarray(rows)[qsl[1:4] - 1], np.asarray(want)[:3, 0])
    assert not np.any(np.asarray(rows)[qsl[3]:]), "rows past the last request are zero"
    np.testing.assert_allclose(np.asarray(k_got), np.asarray(want_cache.k), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(v_got), np.asarray(want_cache.v), atol=1e-5, rtol=0)
    assert not np.array_equal(np.asarray(k_got), np.asarray(k)), "the step wrote its new rows"
    assert_differs_without_window_and_sinks(params, cfg, ref_tokens, ref_pos, cache, np.asarray(want)[:3, 0])


def assert_differs_without_window_and_sinks(params, cfg, tokens, positions, cache, want) -> None:
    """The reference's logits of the live requests without the window, and without the sinks,
    are not `want`: both change these logits, so a kernel ignoring either fails the comparison."""
    no_sinks = {**params, "layers": [{n: w for n, w in layer.items() if n != "sinks"} for layer in params["layers"]]}
    variants = {"no window": (params, cfg.replace(sliding_window=0, sliding_layers=())),
                "no sinks": (no_sinks, cfg.replace(attn_sinks=False))}

    @jax.jit  # one program for both
    def logits(c):
        return {name: R.decode_step(p, m, jnp.asarray(tokens), jnp.asarray(positions), c)[0]
                for name, (p, m) in variants.items()}

    for name, got in logits(cache).items():
        assert np.max(np.abs(np.asarray(got)[:len(want), 0] - want)) > 1e-3 * np.max(np.abs(want)), name


def _uses(jaxpr, var) -> list:
    return [e for e in jaxpr.eqns if any(x is var for x in e.invars)]


def test_decode_step_adds_no_copy_around_the_kernel():
    """The plugin's decode step (traced abstractly: no compile) hands vLLM's K and V arrays to the
    kernel's step as they are, and returns the step's own outputs as the new cache: no gather, no
    re-layout, no write-back (the bytes `kv.decode_step_hbm_bytes` counts as none)."""
    cfg, _, plan, _, decode, _ = setup(WINDOW_SINKS)
    k, v = (jax.ShapeDtypeStruct(c.shape, c.dtype) for c in empty_cache(cfg))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    # the avals of test_decode_step_on_vllm_s_stacked_cache_equals_the_reference's call: one trace for both
    jaxpr = decode.trace(k, v, i32(8), i32(8), i32(SLOTS + 1), i32(SLOTS), i32(SLOTS, CONTEXT // BLOCK),
                         i32()).jaxpr.jaxpr
    k_in, v_in = jaxpr.invars[:2]
    (call,) = _uses(jaxpr, k_in)  # the step (one nested jit holding the kernel), nothing else
    assert _uses(jaxpr, v_in) == [call] and call.primitive.name in ("pjit", "jit"), call.primitive
    assert [x is k_in or x is v_in for x in call.invars].count(True) == 2
    inner = call.params["jaxpr"].jaxpr
    out_k, out_v = jaxpr.outvars[:2]
    assert any(o is out_k for o in call.outvars) and any(o is out_v for o in call.outvars)
    # inside the step the arrays go to the kernel (pallas_call), their outputs back out
    ks, vs = (inner.invars[[i for i, x in enumerate(call.invars) if x is a][0]] for a in (k_in, v_in))
    for a in (ks, vs):
        assert [e.primitive.name for e in _uses(inner, a)] == ["pallas_call"], [e.primitive for e in _uses(inner, a)]


def test_decode_step_traffic_is_the_plan_s_and_the_docs_state_it():
    """docs/serving-vllm.md's figures for the plugin's decode step (qwen3-8b, batch 8, context
    4096, TPU7x plan): the kernel's bytes by the plan plus what the step adds around it on vLLM's
    arrays (`kv.decode_step_hbm_bytes`: the page tables, whose size is that of the array
    `kv.kernel_tables` really produces, abstractly), at most 1.05x what `tpumk build` reports
    (page size 16) at vLLM's block size 16 (`--block-size 16`) and at the 256 it picks for a
    max_model_len of 4096."""
    from tpumk.plan.spec import DEFAULT_PAGE_SIZE

    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "serving-vllm.md").read_text().split())
    build = None
    for block in (DEFAULT_PAGE_SIZE, 256):
        plan = make_plan(BuildSpec(load_preset("qwen3-8b"), get_target("tpu7x"), batch=8, context=4096,
                                   page_size=block))
        build = build or plan.hbm_bytes  # `tpumk build`'s plan: its default page size
        got = kv.decode_step_hbm_bytes(plan)
        assert got["kernel"] == plan.hbm_bytes
        vllm_tables = jax.ShapeDtypeStruct((8, 4096 // block), jnp.int32)
        tables = jax.eval_shape(lambda t: kv.kernel_tables(t, plan.batch, plan.context // block), vllm_tables)
        assert got["page_tables"] == 2 * tables.size * tables.dtype.itemsize
        total = sum(got.values())
        assert total <= 1.05 * build, f"block size {block}: {total / build:.3f}x the bytes of tpumk build"
        stated = (f"block size {block}: the kernel moves {plan.hbm_bytes / 1e9:.2f} GB per step, the plugin's step "
                  f"{total / 1e9:.2f} GB, {total / build:.2f}x")
        assert stated in text, f"docs/serving-vllm.md does not state: {stated}"


def test_window_layers_memory_cost_is_what_the_docs_state():
    """docs/serving-vllm.md's cost of serving sliding-window layers on one page table
    (`kv.held_bytes_per_sequence`): gpt-oss-20b's bytes per sequence in the plugin's stacked cache
    against a cache trimming each window layer to vLLM's sliding-window blocks, at the block size
    vLLM picks for a max_model_len of 4,096 (256) and of 131,072 (16); and on a small case the
    counts themselves (2 layers, layer 0 a 6-token window, blocks of 4, 32 tokens: 8 blocks
    for the full layer, ceil(6 / 4) + 1 = 3 for the window layer)."""
    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "serving-vllm.md").read_text().split())
    small = load_preset("tiny-dense").replace(sliding_window=6, sliding_layers=(0,))
    row = small.attention.kv_size * small.dtype_bytes * 2
    assert kv.held_bytes_per_sequence(small, 32, 4) == {"stacked": 16 * 4 * row, "windows_trimmed": 11 * 4 * row}
    cfg = load_preset("gpt-oss-20b")
    for context, block in ((4096, 256), (131072, 16)):
        got = kv.held_bytes_per_sequence(cfg, context, block)
        unit, scale = ("GB", 1e9) if got["stacked"] >= 1e9 else ("MB", 1e6)
        held, trimmed = got["stacked"], got["windows_trimmed"]
        stated = (f"max_model_len {context:,}, block size {block}: {held / scale:.2f} {unit} per sequence "
                  f"against {trimmed / scale:.2f} {unit}, {held / trimmed:.2f}x")
        assert stated in text, f"docs/serving-vllm.md does not state: {stated}"


def test_a_cache_in_another_layout_is_refused_in_one_line():
    """An array in tpu_inference's RPA v3 layout (what vLLM allocates without --attention-backend
    tpumk), another block size or dtype: one line naming the expected stacked shape."""
    problem = kv.layout_problem((3, 4, 2, 2, 128), jnp.bfloat16, 2, 256, 4, jnp.bfloat16)
    assert problem == ("vLLM's KV cache array is bfloat16 [3, 4, 2, 2, 128]: expected bfloat16 [2, blocks, 4, 256] "
                       "(tpumk's stacked layout: start vLLM with --attention-backend tpumk)")
    assert kv.layout_problem((2, 9, 4, 256), jnp.bfloat16, 2, 256, 4, jnp.bfloat16) is None
    assert kv.layout_problem((2, 9, 8, 256), jnp.bfloat16, 2, 256, 4, jnp.bfloat16) is not None
    assert kv.layout_problem((2, 9, 4, 256), jnp.float32, 2, 256, 4, jnp.bfloat16) is not None


def test_rows_and_tables_on_the_stacked_layout():
    """kv.write_rows / read_rows address block slot // block_size, row slot % block_size of one
    layer (a slot outside the pool writes nothing), and kv.kernel_tables gives the kernel vLLM's
    block table rows, padded with block 0 past vLLM's request slots and cut to its pages."""
    cache = jnp.zeros((2, 3, 4, 2))
    rows = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    got = kv.write_rows(cache, 1, jnp.array([5, -1, 12]), rows)
    want = np.zeros((2, 3, 4, 2))
    want[1, 1, 1] = [1.0, 2.0]
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(kv.read_rows(got, 1, jnp.array([[5, 0]]))), [[[1.0, 2.0], [0.0, 0.0]]])
    vllm = jnp.array([[3, 1, 7], [2, 0, 0]])
    np.testing.assert_array_equal(np.asarray(kv.kernel_tables(vllm, 3, 2)), [[3, 1], [2, 0], [0, 0]])
    np.testing.assert_array_equal(np.asarray(kv.kernel_tables(vllm, 2, 4)), [[3, 1, 7, 0], [2, 0, 0, 0]])


def test_padding_slots_and_rows_with_stale_metadata_touch_no_live_row():
    """vLLM pads a batch past its live requests (num_reqs): tpu_inference 0.32 zeroes the padding
    slots' block tables and seq_lens and repeats the last query start, but the padding token
    rows keep whatever positions its reused host buffer held. Were a padding slot or row to write
    through such leftovers (a finished request's block table row, whose blocks vLLM has handed to
    a live request; a stale position), it would overwrite a live request's row. Here every
    padding slot's table points at live request 0's blocks, and its query start, seq_len and
    position are those of a token on request 0's cached rows: the decode step (megakernel) and
    the ragged step (prefill chunk) return bit for bit the logits and the whole cache they return
    with vLLM's clean padding."""
    cfg, _, plan, _, decode, ragged = setup("tiny-dense")
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.normal(size=c.shape), c.dtype) for c in empty_cache(cfg))
    live = 2
    clean = tables_for(live)
    stale = clean.copy()
    stale[live:] = clean[0]  # every padding slot: request 0's blocks

    def dirty(ids, pos, qsl, seq_lens, rows_used):
        pos, qsl, seq_lens = pos.copy(), qsl.copy(), seq_lens.copy()
        pos[rows_used:] = 3 + np.arange(len(pos) - rows_used) % 7  # request 0's cached rows 3..9
        qsl[live + 1:] = np.minimum(qsl[live] + np.arange(1, SLOTS - live + 1), len(ids))
        seq_lens[live:] = 10
        return ids, pos, qsl, seq_lens

    lengths = [12, 20]  # request 0 holds rows 0..11 of its first block
    ids, pos, qsl, seq_lens = batch_inputs([[5], [9]], lengths, 8)
    want = decode(k, v, ids, pos, qsl, seq_lens, clean, jnp.int32(live))
    got = decode(k, v, *dirty(ids, pos, qsl, seq_lens, live), stale, jnp.int32(live))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert not np.array_equal(np.asarray(want[0][0]), np.asarray(k)), "the step wrote the live rows"

    chunks = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 4)]
    ids, pos, qsl, seq_lens = batch_inputs(chunks, lengths, 16)
    want = ragged((k, v), ids, pos, qsl, clean, jnp.int32(live))
    ids, pos, qsl, _ = dirty(ids, pos, qsl, seq_lens, int(qsl[live]))
    got = ragged((k, v), ids, pos, qsl, stale, jnp.int32(live))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def reference_logits(cfg, params, sequences):
    """The reference's last-token logits of each whole sequence (one paged cache per sequence)."""
    out = []
    for seq in sequences:
        cache = R.init_cache(cfg, 1, CONTEXT, 16)
        logits, _ = R.prefill(params, cfg, [seq], cache)
        out.append(np.asarray(logits[0]))
    return np.stack(out)


# Both are the full tier (tests/README.md): the vllm tier serves a dense Qwen3 and a head_dim-64
# Llama end to end through this ragged prefill and the megakernel's decode on vLLM's cache.
@pytest.mark.parametrize("preset", [pytest.param("tiny-dense", marks=pytest.mark.full),
                                    pytest.param("tiny-moe", marks=pytest.mark.full)])
def test_prefill_then_decode_on_vllm_layout_equals_reference(preset):
    cfg, params, _, _, decode, ragged = setup(preset)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 9)]
    tables = tables_for(2)
    cache = empty_cache(cfg)

    # one prefill chunk of both prompts, padded to 16 token rows (vLLM pads to a bucket)
    ids, pos, qsl, _ = batch_inputs(prompts, [0, 0], 16)
    cache, rows = ragged(cache, ids, pos, qsl, tables, jnp.int32(2))
    want = reference_logits(cfg, params, prompts)
    assert_close(np.asarray(rows)[qsl[1:3] - 1], want)
    assert not np.any(np.asarray(rows)[qsl[2]:]), "rows past the last request are zero"
    seqs = [p + [int(np.argmax(w))] for p, w in zip(prompts, want)]

    # three decode-only steps through the megakernel, on vLLM's arrays
    for _ in range(3):
        ids, pos, qsl, seq_lens = batch_inputs([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], 8)
        cache, rows = decode(*cache, ids, pos, qsl, seq_lens, tables, jnp.int32(2))
        want = reference_logits(cfg, params, seqs)
        got = np.asarray(rows)[:2]
        assert_close(got, want)
        assert [int(np.argmax(g)) for g in got] == [int(np.argmax(w)) for w in want]
        seqs = [s + [int(np.argmax(w))] for s, w in zip(seqs, want)]

    # a mixed batch: request 0 decodes, request 1 decodes, request 2 arrives with a 6-token prompt
    tables = tables_for(3)
    new = rng.integers(0, cfg.vocab_size, 6).tolist()
    ids, pos, qsl, _ = batch_inputs([[seqs[0][-1]], [seqs[1][-1]], new], [len(seqs[0]) - 1, len(seqs[1]) - 1, 0], 16)
    cache, rows = ragged(cache, ids, pos, qsl, tables, jnp.int32(3))
    assert_close(np.asarray(rows)[qsl[1:4] - 1], reference_logits(cfg, params, seqs + [new]))


# ---------------------------------------------------------------------- the plugin's refusals
def vllm_config(model_dir, **kw):
    """The fields of vLLM's VllmConfig the plugin reads (SimpleNamespaces: no vLLM here). As vLLM
    does, `hf_config` holds config.json's keys with `overrides` (--hf-overrides) merged over them,
    and `model_config.hf_overrides` the overrides as given; `hf_extra`: keys reaching hf_config
    some other way (another config file)."""
    import json
    from types import SimpleNamespace as NS

    overrides = kw.get("overrides", {})
    hf_config = NS(**json.loads((Path(model_dir) / "config.json").read_text()), **kw.get("hf_extra", {}))
    vars(hf_config).update(overrides)
    return NS(model_config=NS(model=str(model_dir), dtype=kw.get("dtype", "float32"),
                              max_model_len=kw.get("max_model_len", 64), hf_config=hf_config, hf_overrides=overrides,
                              quantization=kw.get("quantization")),
              scheduler_config=NS(max_num_seqs=kw.get("max_num_seqs", 4)),
              cache_config=NS(block_size=kw.get("block_size", 16), cache_dtype=kw.get("kv", "auto"),
                              enable_prefix_caching=kw.get("prefix", False)),
              parallel_config=NS(tensor_parallel_size=kw.get("tp", 1), pipeline_parallel_size=kw.get("pp", 1),
                                 data_parallel_size=kw.get("dp", 1)),
              speculative_config=kw.get("spec"))


QWEN3_JSON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
              "intermediate_size": 512, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32"}
# a tiny gpt-oss's config.json (transformers' field names): attention sinks, q / k / v / o biases,
# layer 0 sliding a 6-token window, layer 1 full (its default layer_types), YaRN, 4 experts
GPT_OSS_JSON = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "intermediate_size": 128, "vocab_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
                "attention_bias": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}}
# a hybrid (Qwen3-Next: Gated DeltaNet on layers 0-2, gated attention on layer 3), as config.json writes it
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
              "linear_num_key_heads": 1, "linear_num_value_heads": 2,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "full_attention_interval": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
              "shared_expert_intermediate_size": 256, "decoder_sparse_step": 1, "norm_topk_prob": True,
              "mlp_only_layers": []}
# a tiny Kimi Linear (KDA on layers 0 and 2 beside an MLA layer), as transformers 5's save writes it
KIMI_LINEAR_JSON = {"model_type": "kimi_linear", "vocab_size": 211, "hidden_size": 128, "num_hidden_layers": 3,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
                    "qk_nope_head_dim": 32, "v_head_dim": 32, "intermediate_size": 160, "moe_intermediate_size": 128,
                    "num_experts": 4, "num_experts_per_token": 2, "linear_head_dim": 128, "linear_num_heads": 4,
                    "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1, "torch_dtype": "float32",
                    "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
# a tiny Muse Spark language model (test_hf_muse_spark's): sliding-window and NoPE layers, gated
# residuals, the embedding norm
MUSE_SPARK_JSON = {"model_type": "muse_spark_text", "vocab_size": 301, "hidden_size": 64, "intermediate_size": 96,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "sliding_window": 5, "moe_intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                   "moe_hidden_size": 48, "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"],
                   "qk_scale_factor": 3.0, "output_multiplier": 2.0, "final_logit_softcapping": 1.0,
                   "residual_gate_temperature": 0.5, "post_norm_eps": 1e-6, "routed_scaling_factor": 1.5}
OPERATOR = "(TPUMK_VLLM_ARTIFACT or --hf-overrides)"
LONG = "/tmp/" + "a" * 256  # a path component over 255 bytes


@pytest.mark.parametrize("case, change, kw, line", [
    # tensor parallel is served (tests/test_vllm_tp.py) where each device holds its own KV heads
    ("tensor-parallel-replicated-kv", {}, {"tp": 4},
     "tpumk plugin: tensor_parallel_size 4: model 'qwen3' has 2 KV heads, which 4 devices would hold 2 times each: "
     "expected a divisor of num_kv_heads (2) (the plugin does not write replicated KV heads)"),
    ("tensor-parallel-3", {}, {"tp": 3},
     "tpumk plugin: tensor_parallel_size 3: sharding: devices = 3: expected a divisor of num_q_heads (4)"),
    ("tensor-parallel-artifact", {}, {"tp": 2, "env": "/srv/art"},
     "tpumk plugin: tensor_parallel_size 2 with an artifact (/srv/art): expected a start-up build (an artifact's "
     "exported program runs on one device)"),
    ("pipeline-parallel", {}, {"pp": 2}, "tpumk plugin: pipeline_parallel_size = 2: expected 1 (the megakernel runs "
                                         "every layer)"),
    ("data-parallel", {}, {"dp": 2}, "tpumk plugin: data_parallel_size = 2: expected 1 (one decode step spans "
                                     "vLLM's whole mesh)"),
    ("kv-dtype", {}, {"kv": "fp8"}, "--kv-cache-dtype fp8: expected auto"),
    ("quantization", {}, {"quantization": "fp8"}, "--quantization fp8: expected none"),
    # eagle3 is served (tests/test_vllm_speculative.py); no other drafter's inputs are returned
    ("speculative-ngram", {}, {"spec": __import__("types").SimpleNamespace(method="ngram")},
     "tpumk plugin: --speculative-config field 'method' = 'ngram': expected one of ['eagle3']"),
    # Muse Spark's parts the plugin's prefill (steps.ragged_step) does not run
    ("muse-spark", MUSE_SPARK_JSON, {},
     "tpumk plugin: model 'muse_spark_text' has embed_norm (Muse Spark's parts); the plugin's prefill "
     "(tpumk.vllm.steps.ragged_step) does not run it yet"),
    ("unsupported", {"model_type": "mamba"}, {}, "mamba"),
    # gpt-oss's MXFP4 release as stored: vLLM takes its quantization_config as --quantization
    ("checkpoint-mxfp4", dict(GPT_OSS_JSON, quantization_config={"quant_method": "mxfp4"}),
     {"quantization": "gpt_oss_mxfp4"},
     "tpumk plugin: the checkpoint's quantization_config (quant_method 'mxfp4', which vLLM runs as --quantization "
     "gpt_oss_mxfp4): expected float weights (the plugin does not serve a checkpoint's stored quantized weights yet; "
     "TPUMK_VLLM_QUANT quantizes a float checkpoint)"),
    # a Gated DeltaNet hybrid is served (tests/test_vllm_hybrid.py: its state pool, a slot per
    # request's first block); what that does not cover is refused
    ("hybrid-prefix-caching", QWEN3_NEXT, {"prefix": True},
     "tpumk plugin: enable_prefix_caching with linear-attention layers (model 'qwen3_next'): expected "
     "--no-enable-prefix-caching (a request's state slot is its first block, which a cached prefix would share)"),
    ("hybrid-tensor-parallel", QWEN3_NEXT, {"tp": 2},
     "tpumk plugin: tensor_parallel_size 2: model 'qwen3_next' has linear-attention layers: expected 1"),
    ("hybrid-speculative", QWEN3_NEXT, {"spec": __import__("types").SimpleNamespace(method="eagle3")},
     "tpumk plugin: --speculative-config with linear-attention layers (model 'qwen3_next'): expected none"),
    ("hybrid-kimi-linear", KIMI_LINEAR_JSON, {},
     "tpumk plugin: model 'kimi_linear' has linear-attention layers beside MLA (Kimi Linear); the plugin's MLA "
     "prefill (tpumk.vllm.mla_prefill) does not run them yet"),
    ("hybrid-artifact", QWEN3_NEXT, {"env": "/srv/art"},
     "tpumk plugin: an artifact (/srv/art) of a model with linear-attention layers: expected a start-up build"),
    # the checkpoint never picks the program: its own config.json naming an artifact is refused,
    # even beside the operator's choice, and so is the key reaching vLLM's config another way
    ("checkpoint-names-artifact", {"tpumk_artifact": "/srv/evil"}, {},
     f"tpumk plugin: config.json of the checkpoint names tpumk_artifact: the artifact is chosen by the operator "
     f"{OPERATOR}"),
    ("checkpoint-and-operator", {"tpumk_artifact": "/srv/evil"}, {"env": "/srv/mine"},
     "config.json of the checkpoint names tpumk_artifact"),
    ("config-file-names-artifact", {}, {"hf_extra": {"tpumk_artifact": "/srv/evil"}},
     f"vLLM's model config names tpumk_artifact, but not through --hf-overrides: the artifact is chosen by the "
     f"operator {OPERATOR}"),
    ("override-number", {}, {"overrides": {"tpumk_artifact": 5}},
     "tpumk plugin: --hf-overrides tpumk_artifact = 5: expected a non-empty string, the path of a `tpumk export` "
     "artifact directory"),
    ("override-list", {}, {"overrides": {"tpumk_artifact": ["a", "b"]}},
     "--hf-overrides tpumk_artifact = ['a', 'b']: expected a non-empty string"),
    ("override-empty", {}, {"overrides": {"tpumk_artifact": ""}}, "tpumk_artifact = '': expected a non-empty string"),
    # the operator's artifact is followed (here to a directory that is not one)
    ("override-followed", {}, {"overrides": {"tpumk_artifact": "/nonexistent/art"}},
     "/nonexistent/art: not an artifact directory"),
    ("env-followed", {}, {"env": "/nonexistent/env-art", "overrides": {"tpumk_artifact": "/nonexistent/art"}},
     "/nonexistent/env-art: not an artifact directory"),
    ("env-too-long", {}, {"env": LONG}, "a path component is 256 bytes, longer than the 255 the OS accepts"),
    ("max-model-len", {}, {"max_model_len": -5}, "tpumk plugin: max_model_len -5: expected a positive whole number"),
    ("max-num-seqs", {}, {"max_num_seqs": 0}, "tpumk plugin: max_num_seqs 0: expected a positive whole number"),
    ("block-size", {}, {"block_size": 16.0}, "tpumk plugin: block_size 16.0: expected a positive whole number"),
    # without the plugin's backend vLLM allocates RPA v3's per-layer arrays, which the kernel cannot read in place
    ("attention-backend", {}, {"runtime": {"attention_backend": "rpa"}},
     "tpumk plugin: --attention-backend rpa: expected tpumk (the megakernel reads and writes vLLM's KV cache in "
     "place in its own stacked layout, which vLLM allocates only with --attention-backend tpumk)"),
])
def test_plugin_refuses_what_it_cannot_serve(tmp_path, monkeypatch, case, change, kw, line):
    import json

    from tpumk.errors import TpumkError
    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    if "env" in kw:
        monkeypatch.setenv("TPUMK_VLLM_ARTIFACT", kw["env"])
    config = change if "hidden_size" in change else dict(QWEN3_JSON, **change)  # a whole config.json, or changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TpumkError) as e:
        Runtime.from_vllm_config(vllm_config(tmp_path, **kw), **kw.get("runtime", {}))
    msg = str(e.value)
    assert line in msg and "\n" not in msg, msg


def test_plugin_builds_its_step_for_vllm_shapes(tmp_path, monkeypatch):
    import json

    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_JSON))
    rt = Runtime.from_vllm_config(vllm_config(tmp_path))
    assert (rt.plan.batch, rt.plan.context, rt.plan.q_len, rt.cfg.dtype) == (4, 64, 1, "float32")
    assert rt.source.startswith("built on start-up")
    assert rt.holds_weights_once  # float32 weights: the device holds the packed layout only
    # pages of vLLM's block size (its block tables are the kernel's page tables), the context
    # rounded up to whole blocks; vLLM's stacked arrays: the kernel's layers and row width
    rt = Runtime.from_vllm_config(vllm_config(tmp_path, block_size=32, max_model_len=80))
    assert (rt.plan.page_size, rt.plan.context, rt.kv_layers, rt.kv_width) == (32, 96, 2, 256)
    # the step for vLLM's pool (sized after the model loads) is the same kernel on that pool's
    # shape; a build makes it once per pool size
    assert rt.step_for(rt.plan.num_pages) is rt.step
    assert rt.step_for(50) is rt.step_for(50) is not rt.step
    # an artifact's exported program takes exactly its own pool: another is refused in one line
    from tpumk.vllm.runtime import ServingConfigError

    art = dataclasses.replace(rt, fixed_pages=rt.plan.num_pages)
    assert art.step_for(rt.plan.num_pages) is rt.step
    with pytest.raises(ServingConfigError) as e:
        art.step_for(50)
    assert str(e.value) == (f"tpumk plugin: vLLM's KV cache has 50 blocks: the artifact's program takes exactly "
                            f"{rt.plan.num_pages} pages (start vLLM with --num-gpu-blocks-override {rt.plan.num_pages}, "
                            "or serve a start-up build)")


def test_an_artifact_of_another_page_size_is_refused_in_one_line():
    """The kernel reads vLLM's block tables as its page tables: an artifact whose page size is
    not vLLM's block size is refused at start-up, naming both fixes."""
    from tpumk.vllm.runtime import ServingConfigError, _check_shape

    plan = setup(WINDOW_SINKS)[2]
    _check_shape("tpumk plugin: artifact a", plan, 4, CONTEXT, BLOCK)
    with pytest.raises(ServingConfigError) as e:
        _check_shape("tpumk plugin: artifact a", plan, 4, CONTEXT, 32)
    assert str(e.value) == ("tpumk plugin: artifact a: page size 16 != vLLM's block size 32: start vLLM with "
                            "--block-size 16 or export with --page-size 32 (the kernel reads vLLM's block tables as "
                            "its page tables)")


def test_served_step_compiles_deviceless_for_tpu7x_with_the_cache_in_place():
    """What the plugin's model runs inside vLLM's jitted step (`steps.serve_step`: the lax.cond
    between the megakernel's decode step and the ragged prefill) around a TPU7x kernel
    (tiny-dense, vLLM's pool of NUM_BLOCKS), compiled deviceless with the cache donated as vLLM
    donates it, the weights held once (the packed ones, tpumk.kernel.unpack): it compiles, both cache arrays are aliased to outputs (written in place), and
    XLA adds no copy the size of a cache operand in HBM (tests/program_checks.cache_copies), and
    the decode branch returns the kernel's cache outputs as they are. (At this tiny size XLA keeps
    the ragged branch's whole 360 KB cache in VMEM for its scatters, a copy-start / copy-done
    pair each way, which an HBM-sized cache cannot fit.)"""
    from program_checks import cache_copies

    from tpumk.compile.aot import compile_for

    cfg = load_preset("tiny-dense")
    plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), batch=4, context=CONTEXT, page_size=BLOCK))
    pool = dataclasses.replace(plan, num_pages=NUM_BLOCKS)
    step = make_decode_step(pool, nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    run = plan.whole_model
    params = jax.eval_shape(lambda: random_params(run, seed=0))
    packed = jax.eval_shape(lambda: pack_weights(plan, random_params(cfg, seed=0)))

    # the device holds the packed weights only: the ragged branch reads them back (Runtime.holds_weights_once)
    unpack = Unpacker(plan, params)
    params = {}

    def served(k, v, packed, params, ids, pos, qsl, seq_lens, tables, n):
        return steps.serve_step(step, packed, params, run, shape, k, v, ids, pos, qsl, seq_lens, tables, n, BLOCK,
                                CONTEXT, unpack=unpack)

    dt = R.jnp_dtype(cfg)
    cache = jax.ShapeDtypeStruct(kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.kv_size), dt)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    compiled = compile_for(served, (cache, cache, packed, params, i32(8), i32(8), i32(SLOTS + 1), i32(SLOTS),
                                    i32(SLOTS, CONTEXT // BLOCK), i32()), plan.target, donate_argnums=(0, 1))
    aliases = re.search(r"input_output_alias=\{ (.*?) \}", compiled.hlo_text)
    assert aliases, "no input_output_alias in the compiled program"
    for param in (0, 1):  # outputs 0 and 1 of the step's ((k, v), rows) are the parameters 0 and 1
        assert re.search(rf"\{{{param}\}}: \({param}, \{{\}}", aliases.group(1)), aliases.group(1)
    assert cache_copies(pool, compiled) == []
    # the decode branch returns the kernel's own cache outputs (its operands aliased in place)
    # as the step's: nothing between the kernel and vLLM's arrays
    text = compiled.hlo_text
    kernel = re.search(r"%(\S+) = \([^\n]*\) custom-call\([^\n]*tpumk_decode", text) or \
        re.search(r"%(tpumk_decode\S*) = ", text)
    assert kernel, "no megakernel custom-call in the compiled program"
    outs = {int(i): name for name, i in re.findall(rf"%(\S+) = [^\n]* get-tuple-element\(%{re.escape(kernel.group(1))}\), "
                                                 r"index=(\d+)", text)}
    assert re.search(rf"ROOT %\S+ = [^\n]* tuple\(%{re.escape(outs[1])}, %{re.escape(outs[2])}, ", text), outs


# ---------------------------------------------------------------------- sliding windows and sinks


@functools.lru_cache(maxsize=None)
def gpt_oss_runtime(model_dir: str):
    from tpumk.vllm.runtime import Runtime

    return Runtime.from_vllm_config(vllm_config(model_dir, max_model_len=CONTEXT, block_size=BLOCK))


def gpt_oss_dir(tmp_path_factory, monkeypatch) -> Path:
    import json

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    d = tmp_path_factory.mktemp("gpt-oss")
    (d / "config.json").write_text(json.dumps(GPT_OSS_JSON))
    return d


def test_a_model_with_windows_and_sinks_is_served_on_one_stacked_cache(tmp_path_factory, monkeypatch):
    """A gpt-oss checkpoint's config (sinks, a 6-token window on layer 0 of 2) is accepted: the
    plugin's Runtime builds its step for vLLM's shapes, windows and sinks in the kernel's run
    model, on ONE stacked K and V cache of every layer, so vLLM's one block table per request is
    every layer's page table (a window layer keeps all its pages)."""
    rt = gpt_oss_runtime(str(gpt_oss_dir(tmp_path_factory, monkeypatch)))
    run = rt.plan.whole_model
    assert (run.pattern.window(0), run.pattern.window(1), run.attention.attn_sinks) == (6, 0, True)
    assert (rt.kv_layers, rt.plan.page_size, rt.plan.context, rt.plan.batch) == (2, BLOCK, CONTEXT, 4)
    assert rt.kv_width == run.attention.kv_size == 128 and rt.source.startswith("built on start-up")


@pytest.mark.full  # 10-27 s on a loaded host (a MoE kernel); tests/README.md names the default tests covering it
def test_gpt_oss_decode_step_on_the_stacked_cache_equals_the_reference(tmp_path_factory, monkeypatch):
    """The served gpt-oss config's step (Runtime.step_for vLLM's pool: MoE, biases, YaRN, the
    window and sinks): the megakernel's decode step on vLLM's arrays (random rows everywhere, so
    a key outside a window or a dropped sink would show) gives the reference decode step's logits
    and cache, the window and the sinks applied by the kernel itself."""
    from tpumk.plan.padding import params_as_run

    rt = gpt_oss_runtime(str(gpt_oss_dir(tmp_path_factory, monkeypatch)))
    run = rt.plan.whole_model
    params = params_as_run(rt.plan, random_params(rt.cfg, seed=0))
    packed = pack_weights(rt.plan, params)
    shape = rt.plan_shape
    step = rt.step_for(NUM_BLOCKS)
    decode = jax.jit(lambda *a: steps.decode_step(step, packed, shape, *a),
                     compiler_options=INTERPRET_COMPILER_OPTIONS)

    rng = np.random.default_rng(6)
    kshape = kv.cache_shape(rt.kv_layers, NUM_BLOCKS, BLOCK, rt.kv_width)
    k, v = (jnp.asarray(rng.normal(size=kshape), jnp.float32) for _ in range(2))
    lengths = [3, 17, 30]  # inside the window, past it on page 1, past it near the end
    tables = tables_for(len(lengths))
    tokens = rng.integers(0, run.vocab_size, len(lengths)).tolist()
    ids, pos, qsl, seq_lens = batch_inputs([[t] for t in tokens], lengths, 8)
    (k_got, v_got), rows = decode(k, v, ids, pos, qsl, seq_lens, tables, jnp.int32(len(lengths)))

    b = rt.plan.batch
    ref_tokens, ref_pos, ref_len = np.zeros((b, 1), np.int32), np.full((b, 1), -1, np.int32), np.zeros(b, np.int32)
    ref_tokens[:3, 0], ref_pos[:3, 0], ref_len[:3] = tokens, lengths, lengths
    cache = R.KVCache(k, v, jnp.asarray(tables[:b]), jnp.asarray(ref_len))
    want, want_cache = jax.jit(lambda c: R.decode_step(params, run, jnp.asarray(ref_tokens), jnp.asarray(ref_pos),
                                                       c))(cache)
    assert_close(np.asarray(rows)[qsl[1:4] - 1], np.asarray(want)[:3, 0])
    np.testing.assert_allclose(np.asarray(k_got), np.asarray(want_cache.k), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(v_got), np.asarray(want_cache.v), atol=1e-5, rtol=0)
    assert_differs_without_window_and_sinks(params, run, ref_tokens, ref_pos, cache, np.asarray(want)[:3, 0])
