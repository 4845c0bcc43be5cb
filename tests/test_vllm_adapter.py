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
import re
from pathlib import Path

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


# Both are the full tier (tests/README.md): the vllm tier serves a dense Qwen3 and a head_dim-64
# Llama end to end through this ragged prefill and the megakernel's decode on vLLM's cache.
@pytest.mark.parametrize("preset", [pytest.param("tiny-dense", marks=pytest.mark.full),
                                    pytest.param("tiny-moe", marks=pytest.mark.full)])
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


def tpu_inference_cache(num_blocks, block_size, kv_heads, head_dim, dtype, slots, k, v):
    """A layer's cache laid out as tpu_inference 0.32 lays it out (read from its source: the runner
    pads head_dim with `get_padded_head_dim`, 64 unpadded, else to whole 128 lanes; RPA v3's
    `kernel_hd64.get_kv_cache_shape` / `merge_kv` for 64, `kernel.get_kv_cache_shape` /
    `merge_kv` for any other), built element by element from that description: token `slots[i]`
    holds k[i] and v[i]. packing p = 32 bits / the dtype's; combined head c sits at [c // p, c % p].

    - head_dim 64: [blocks, block_size, ceil(kv_heads / p), p, 128], head h's K in lanes 0-63 and
      its V in 64-127 of combined head h;
    - else: [blocks, block_size, ceil(2 kv_heads / p), p, round_up(head_dim, 128)], K of head h
      in combined head 2h, V in 2h + 1, lanes 0 .. head_dim - 1."""
    p = 4 // np.dtype(dtype).itemsize
    if head_dim == 64:
        shape = (num_blocks, block_size, -(-kv_heads // p), p, 128)
        where = lambda h, j: (h, slice(64 * j, 64 * j + 64))  # noqa: E731
    else:
        shape = (num_blocks, block_size, -(-2 * kv_heads // p), p, -(-head_dim // 128) * 128)
        where = lambda h, j: (2 * h + j, slice(0, head_dim))  # noqa: E731
    cache = np.zeros(shape, np.float32)
    for i, slot in enumerate(slots):
        block, offset = divmod(int(slot), block_size)
        for h in range(kv_heads):
            for j, x in enumerate((k, v)):
                c, lanes = where(h, j)
                cache[block, offset, c // p, c % p, lanes] = x[i, h * head_dim:(h + 1) * head_dim]
    return jnp.asarray(cache, dtype)


# each way tpu_inference packs a layer: the head_dim-64 kernel's layout and the general one's (96:
# padded to 128 lanes), float32 (packing 1) and bfloat16 (packing 2), with a head count that
# fills the packed rows and one that leaves a zero head (head_dim 64, odd count, bfloat16)
LAYOUTS = [(64, 1, "bfloat16"), (64, 2, "bfloat16"), (64, 3, "float32"), (128, 1, "bfloat16"), (128, 2, "float32"),
           (96, 3, "bfloat16")]


@functools.partial(jax.jit, static_argnums=(6, 7))
def write_then_read(empty, write_slots, k, v, laid_out, read_slots, heads, head_dim):
    """kv.write_rows into `empty`, and kv.read_rows from `laid_out` (one compile)."""
    written = kv.write_rows(empty, write_slots, k, v, heads, head_dim)
    return written, kv.read_rows(laid_out, read_slots, heads, head_dim)


@pytest.mark.parametrize("head_dim, heads, dtype", LAYOUTS)
def test_rows_read_and_write_tpu_inference_s_layout(head_dim, heads, dtype):
    blocks, bs = 3, 4
    rng = np.random.default_rng(head_dim + heads)
    # bfloat16-exact values, so the round trip compares exactly
    k, v = (jnp.asarray(rng.integers(-64, 64, (3, heads * head_dim)) / 8, jnp.float32) for _ in range(2))
    slots = np.array([5, 0, 11])
    want = tpu_inference_cache(blocks, bs, heads, head_dim, jnp.dtype(dtype), slots, np.asarray(k), np.asarray(v))
    assert kv.cache_shape(blocks, bs, heads, head_dim, dtype) == want.shape
    assert kv.layout_problem(want.shape, dtype, heads, head_dim, bs) is None

    # write: exactly tpu_inference's bytes (padding lanes and padding heads stay zero); 99 and -1:
    # dropped. read: from tpu_inference's own cache, slots of any shape (here [1, 3], reversed)
    written, (rk, rv) = write_then_read(jnp.zeros(want.shape, dtype), jnp.array([*slots, 99, -1]),
                                        jnp.concatenate([k, k[:2]]), jnp.concatenate([v, v[:2]]), want,
                                        jnp.asarray(slots[::-1].reshape(1, 3)), heads, head_dim)
    np.testing.assert_array_equal(np.asarray(written, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(rk, np.float32)[0], np.asarray(k)[::-1])
    np.testing.assert_array_equal(np.asarray(rv, np.float32)[0], np.asarray(v)[::-1])


def test_decode_step_traffic_is_the_plan_s_and_the_docs_state_it():
    """docs/serving-vllm.md's figure for the plugin's decode step (qwen3-8b, batch 8, context
    4096, TPU7x plan): the kernel's bytes by the plan plus the copies around it
    (`kv.decode_step_hbm_bytes`), whose sizes are those of the arrays `gather_batch` and
    `read_rows` really produce at that shape (abstractly: no memory)."""
    plan = make_plan(BuildSpec(load_preset("qwen3-8b"), get_target("tpu7x"), batch=8, context=4096, page_size=16))
    cfg, dt = plan.cfg, R.jnp_dtype(plan.cfg)
    got = kv.decode_step_hbm_bytes(plan)
    assert got["kernel"] == plan.hbm_bytes
    layer = jax.ShapeDtypeStruct(kv.cache_shape(plan.num_pages, 16, cfg.num_kv_heads, cfg.head_dim, dt), dt)
    tables = jax.ShapeDtypeStruct((plan.batch, plan.context // 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((plan.batch,), jnp.int32)
    stacked = jax.eval_shape(lambda c, t, n: kv.gather_batch(c, t, n, cfg.num_kv_heads, cfg.head_dim, 16,
                                                             plan.context, 16, plan.num_pages),
                             [layer] * cfg.num_layers, tables, lengths)
    assert got["gather_write"] == sum(a.size * a.dtype.itemsize for a in stacked)
    slots = jax.ShapeDtypeStruct((plan.batch, plan.context), jnp.int32)
    rows = jax.eval_shape(lambda c, s: kv.read_rows(c, s, cfg.num_kv_heads, cfg.head_dim), layer, slots)
    # qwen3-8b's rows have no padding lanes or heads: a whole vLLM row is its K and V
    assert got["gather_read"] == cfg.num_layers * sum(a.size * a.dtype.itemsize for a in rows)
    total = sum(got.values())
    text = " ".join((Path(__file__).resolve().parents[1] / "docs" / "serving-vllm.md").read_text().split())
    ratio = f"{total / plan.hbm_bytes:.2f}x"
    stated = (f"the kernel moves {plan.hbm_bytes / 1e9:.2f} GB per step, the plugin's step {total / 1e9:.2f} GB, "
              f"{ratio} ({(got['gather_read'] + got['gather_write']) / 1e9:.2f} GB of it")
    assert stated in text, f"docs/serving-vllm.md does not state: {stated}"
    # every other mention of the ratio says the same
    assert set(re.findall(r"(\d+\.\d+x) the kernel's", text)) == {ratio}


def test_a_cache_in_another_layout_is_refused_in_one_line():
    """A head_dim-64 cache in the general layout (2 * kv_heads combined heads: what kv.py assumed
    before, and what vLLM's runner does not allocate) or of another block size: one line, not a
    reshape error."""
    shape = (3, 4, 4, 1, 128)
    problem = kv.layout_problem(shape, jnp.float32, 2, 64, 4)
    assert problem == ("vLLM's KV cache of a layer is float32 [3, 4, 4, 1, 128]: expected [blocks, 4, 2, 1, 128] "
                       "(tpu_inference's RPA v3 layout for 2 KV heads of head_dim 64)")
    with pytest.raises(ValueError, match=r"expected \[blocks, block_size, 2, 1, 128\]"):
        kv.read_rows(jnp.zeros(shape), jnp.array([0]), 2, 64)
    assert kv.layout_problem((3, 8, 2, 1, 128), jnp.float32, 2, 64, 4) is not None


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
              cache_config=NS(block_size=kw.get("block_size", 16), cache_dtype=kw.get("kv", "auto")),
              parallel_config=NS(tensor_parallel_size=kw.get("tp", 1), pipeline_parallel_size=1),
              speculative_config=kw.get("spec"))


QWEN3_JSON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
              "intermediate_size": 512, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32"}
# a hybrid (Qwen3-Next: Gated DeltaNet on layers 0-2, gated attention on layer 3), as config.json writes it
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
              "linear_num_key_heads": 1, "linear_num_value_heads": 2,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "full_attention_interval": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
              "shared_expert_intermediate_size": 256, "decoder_sparse_step": 1, "norm_topk_prob": True,
              "mlp_only_layers": []}
OPERATOR = "(TPUMK_VLLM_ARTIFACT or --hf-overrides)"
LONG = "/tmp/" + "a" * 256  # a path component over 255 bytes


@pytest.mark.parametrize("case, change, kw, line", [
    ("tensor-parallel", {}, {"tp": 2}, "tensor_parallel_size = 2: expected 1"),
    ("kv-dtype", {}, {"kv": "fp8"}, "--kv-cache-dtype fp8: expected auto"),
    ("quantization", {}, {"quantization": "fp8"}, "--quantization fp8: expected none"),
    ("speculative", {}, {"spec": object()}, "speculative decoding is configured"),
    ("sliding", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, {},
     "has sliding-window layers"),
    ("unsupported", {"model_type": "mamba"}, {}, "mamba"),
    ("hybrid", QWEN3_NEXT, {},
     "tpumk plugin: model 'qwen3_next' has linear-attention layers (gated_delta, 3 of 4); the plugin does "
     "not keep their per-sequence state pool in vLLM's cache yet"),
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
    ("attention-backend", {}, {"runtime": {"attention_backend": "flash_attn_x"}},
     "--attention-backend flash_attn_x: expected the default (rpa: the plugin reads vLLM's KV cache in RPA v3's "
     "layout only)"),
    ("batched-rpa", {}, {"runtime": {"batched_rpa": True}}, "USE_BATCHED_RPA_KERNEL is set: expected it unset"),
])
def test_plugin_refuses_what_it_cannot_serve(tmp_path, monkeypatch, case, change, kw, line):
    import json

    from tpumk.errors import TpumkError
    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    if "env" in kw:
        monkeypatch.setenv("TPUMK_VLLM_ARTIFACT", kw["env"])
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN3_JSON, **change)))
    with pytest.raises(TpumkError) as e:
        Runtime.from_vllm_config(vllm_config(tmp_path, **kw), **kw.get("runtime", {}))
    msg = str(e.value)
    assert line in msg and "\n" not in msg, msg


def test_the_head_dim_64_layout_comes_before_the_batched_rpa_switch(tmp_path, monkeypatch):
    """tpu_inference picks its head_dim-64 kernel's layout whatever USE_BATCHED_RPA_KERNEL says,
    so a head_dim-64 model still starts with it set."""
    import json

    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    hd64 = dict(QWEN3_JSON, head_dim=64, num_attention_heads=4, hidden_size=256)
    (tmp_path / "config.json").write_text(json.dumps(hd64))
    rt = Runtime.from_vllm_config(vllm_config(tmp_path), batched_rpa=True)
    assert rt.cfg.head_dim == 64


def test_plugin_builds_its_step_for_vllm_shapes(tmp_path, monkeypatch):
    import json

    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_JSON))
    rt = Runtime.from_vllm_config(vllm_config(tmp_path))
    assert (rt.plan.batch, rt.plan.context, rt.plan.q_len, rt.cfg.dtype) == (4, 64, 1, "float32")
    assert rt.source.startswith("built on start-up")
