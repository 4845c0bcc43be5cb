"""The vLLM plugin on an MLA model (DeepSeek-V3's attention, tiny-mla): vLLM's cache is ONE stacked
latent array, the megakernel's own MLA cache `[layers, blocks, block_size, latent_cache_lanes]`
(tpumk.vllm.kv.layer_names: the layer `tpumk.kv.k` alone), no vLLM here.

- the ragged prefill (tpumk.vllm.mla_prefill through steps.ragged_step: absorbed attention over
  the latent pages each chunk needs) on a first step of three prompts, then a ragged mixed batch
  whose chunks start mid-sequence, with tiles far smaller than the batch: every request's
  last-token logits equal `tpumk.model.reference.forward_full` (MLA's expanded form, as
  transformers computes it) over its whole sequence within 1e-5 of their largest magnitude, every
  latent row it wrote the reference's `c_kv | k_rope` of that position (zeros in the pad lanes);
- the decode-only step (the megakernel in the discharge interpreter, as the plugin runs it on
  the CPU) on vLLM's latent array with vLLM's block tables: the reference decode step's logits
  and cache;
- EAGLE-3 (tpumk.vllm.speculative) on it: the JAX step's taps and every row's logits against the
  reference over a prefill and a verify batch, and the megakernel's MLA verify step (q_len 3 with
  the taps) against that JAX step on the verify batch (the vLLM tier's eagle3-deepseek test serves it);
- the plugin's Runtime accepts a DeepSeek-V3 config.json with one latent array of the kernel's
  width (and builds the verify step under eagle3), and refuses vLLM's own MLA cache and a
  sparse-attention model (DeepSeek-V3.2) in one line;
- (full tier) the MLA weights read back from the packed layout exactly, and the prefill of int8 /
  fp8-b128 weights (TPUMK_VLLM_QUANT) against the quantized reference.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_vllm_adapter import SLOTS, assert_close, batch_inputs, vllm_config
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import mla
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.ops import rms_norm
from tpumk.model.weights import random_params
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target
from tpumk.vllm import kv, steps

BLOCK = 4  # vLLM's block size (the prefill test's)
NUM_BLOCKS = 40
CONTEXT = 32  # max_model_len
TOKENS = 24  # the token bucket of both prefill steps
QUERY_TILE, KEY_TILE, SHORT_TILE = 4, 8, 2  # the decode of step 2 runs as a short item


@functools.lru_cache(maxsize=None)
def setup():
    # float32: q-LoRA, YaRN (softmax scale != 1), latent 40 + rope 8 -> 128 lanes; a dense layer, then MoE
    cfg = load_preset("tiny-mla").replace(num_layers=2)
    params = random_params(cfg, seed=0)
    lanes = cfg.attention.latent_cache_lanes

    @jax.jit
    def ragged(latent, ids, pos, qsl, tables, n):
        v = jnp.zeros(latent.shape[:3] + (0,), latent.dtype)
        (latent, v), rows = steps.ragged_step(params, cfg, latent, v, ids, pos, qsl, tables, n, BLOCK, CONTEXT,
                                              QUERY_TILE, KEY_TILE, SHORT_TILE)
        return latent, rows

    @jax.jit
    def reference(tokens):
        """Logits [CONTEXT, V], each layer's stored latent row [layers, CONTEXT, lanes] and the
        residual stream entering each layer [CONTEXT, layers, H] (EAGLE-3's taps) of one sequence
        (padded to CONTEXT: causal, so the padding changes no earlier position)."""
        logits, tapped = R.forward_full(params, cfg, tokens[None], taps=range(cfg.num_layers))
        pos = jnp.arange(CONTEXT, dtype=jnp.int32)[None]
        freqs = mla.rope_freqs(cfg, params)
        rows = []
        for li, layer in enumerate(params["layers"]):
            h = rms_norm(tapped[:, :, li], layer["attn_norm"], cfg.norms.rms_eps, cfg.norms.width)
            _, _, row = mla.project(cfg, layer, h, pos, True, freqs)
            rows.append(jnp.pad(row[0], ((0, 0), (0, lanes - row.shape[-1]))))
        return logits[0], jnp.stack(rows), tapped[0]

    @jax.jit
    def read(latent, table):
        slots = kv.token_slots(table[None], jnp.zeros(CONTEXT, jnp.int32), jnp.arange(CONTEXT), BLOCK)
        return jnp.stack([kv.read_rows(latent, li, slots) for li in range(cfg.kv_layers)])

    return cfg, params, ragged, reference, read


def test_layers_and_width_of_the_latent_cache():
    cfg = load_preset("tiny-mla")
    assert kv.layer_names(cfg) == (kv.K_LAYER,)
    assert kv.layer_names(load_preset("tiny-dense")) == (kv.K_LAYER, kv.V_LAYER)
    assert cfg.attention.latent_cache_lanes == 128 and cfg.attention.kv_cache_width == 48


def test_mla_chunked_prefill_equals_the_reference_on_ragged_batches():
    cfg, _, ragged, reference, read = setup()
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (17, 6, 9, 7)]
    per = CONTEXT // BLOCK
    tables = np.zeros((SLOTS, per), np.int32)  # the padding slots' rows stay 0, as vLLM leaves them
    tables[:len(seqs)] = rng.permutation(NUM_BLOCKS)[:len(seqs) * per].reshape(len(seqs), per)
    latent = jnp.zeros(kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.latent_cache_lanes),
                       jnp.float32)
    padded = [s + [0] * (CONTEXT - len(s)) for s in seqs]
    done = [0, 0, 0, 0]
    # step 1: prompts of 11, 5 and 3 tokens; step 2: 6 more from position 11, one decode from 5,
    # 6 more from 3, a new prompt of 7 (23 of the 24 rows)
    for cut in ([11, 5, 3], [17, 6, 9, 7]):
        chunks = [s[d:c] for s, d, c in zip(seqs, done, cut)]
        ids, pos, qsl, _ = batch_inputs(chunks, done, TOKENS)
        latent, rows = ragged(latent, ids, pos, qsl, tables, jnp.int32(len(cut)))
        rows = np.asarray(rows)
        for r, c in enumerate(cut):
            logits, want_rows, _ = (np.asarray(x) for x in reference(jnp.asarray(padded[r])))
            want = logits[c - 1]
            err = float(np.max(np.abs(rows[qsl[r + 1] - 1] - want)))
            assert err <= 1e-5 * float(np.max(np.abs(want))), f"request {r}: max |logits - reference| = {err:.3g}"
            got_rows = np.asarray(read(latent, jnp.asarray(tables[r])))[:, :c]
            np.testing.assert_allclose(got_rows, want_rows[:, :c], atol=1e-5, rtol=0)
        others = np.setdiff1d(np.arange(TOKENS), qsl[1:len(cut) + 1] - 1)
        assert not np.any(rows[others]), "only each request's last row holds logits"
        done = cut + [0] * (len(seqs) - len(cut))
    # the attention read the cache: the same last chunk on a latent array without the earlier rows differs
    empty = jnp.zeros_like(latent)
    _, alone = ragged(empty, ids, pos, qsl, tables, jnp.int32(4))
    assert np.max(np.abs(np.asarray(alone)[qsl[1] - 1] - rows[qsl[1] - 1])) > 1e-3 * np.max(np.abs(rows))


# a tiny DeepSeek-V3 config.json (transformers' field names; hidden and experts 128 wide, as the megakernel needs)
DEEPSEEK_JSON = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 320,
                 "hidden_size": 128, "intermediate_size": 80, "moe_intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 3, "num_key_value_heads": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                 "q_lora_rank": 56, "kv_lora_rank": 40, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8,
                 "v_head_dim": 20, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
                 "torch_dtype": "float32"}


def deepseek_runtime(tmp_path, monkeypatch, **change):
    from tpumk.vllm.runtime import Runtime

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(dict(DEEPSEEK_JSON, **change)))
    return Runtime.from_vllm_config(vllm_config(tmp_path))


def test_plugin_serves_mla_on_one_latent_array(tmp_path, monkeypatch):
    rt = deepseek_runtime(tmp_path, monkeypatch)
    run = rt.plan.whole_model
    assert run.is_mla and rt.kv_names == (kv.K_LAYER,)
    assert (rt.kv_layers, rt.kv_width) == (2, run.attention.latent_cache_lanes) == (2, 128)
    assert rt.source.startswith("built on start-up") and rt.holds_weights_once


def test_the_runtime_builds_an_mla_verify_step_with_the_drafter_s_taps(tmp_path, monkeypatch):
    """--speculative-config eagle3 on a DeepSeek-V3 target whose query-key head is 120 + 8 = 128
    lanes: served, the verify plan the decode plan's shapes at q_len k + 1 with the taps (a 3-layer
    model: vLLM's default ids (2, 1, 0)). A head tpu_inference would pad (24 + 8 = 32, DeepSeek-V3's
    own 128 + 64 = 192) is refused in one line (tpumk.vllm.speculative.drafter_head_pad)."""
    from test_vllm_speculative import spec_config

    from tpumk.vllm.runtime import Runtime, ServingConfigError

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    spec = spec_config(k=2).speculative_config
    (tmp_path / "config.json").write_text(json.dumps(dict(DEEPSEEK_JSON, num_hidden_layers=3, qk_nope_head_dim=120)))
    rt = Runtime.from_vllm_config(vllm_config(tmp_path, spec=spec))
    p, v = rt.plan, rt.verify_plan
    assert rt.taps == (0, 1, 2) and v.cfg.is_mla and rt.kv_names == (kv.K_LAYER,)
    assert (v.batch, v.context, v.page_size, v.q_len, v.taps) == (p.batch, p.context, p.page_size, 3, (0, 1, 2))
    for nope, rope in ((24, 8), (128, 64)):
        (tmp_path / "config.json").write_text(json.dumps(dict(DEEPSEEK_JSON, num_hidden_layers=3,
                                                              qk_nope_head_dim=nope, qk_rope_head_dim=rope)))
        with pytest.raises(ServingConfigError) as e:
            Runtime.from_vllm_config(vllm_config(tmp_path, spec=spec))
        line = str(e.value)
        assert f"qk_nope_head_dim + qk_rope_head_dim = {nope + rope}: expected 64 or a multiple of 128 with " \
               "eagle3" in line and "\n" not in line, line
    assert Runtime.from_vllm_config(vllm_config(tmp_path)).verify_plan is None  # without eagle3: served


def test_vllm_s_own_mla_cache_is_refused_in_one_line(tmp_path, monkeypatch):
    """With vLLM's MLA on (no VLLM_MLA_DISABLE=1) tpu_inference would lay out its own per-layer MLA
    cache: refused, naming the switch."""
    from tpumk.vllm.runtime import Runtime, ServingConfigError

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_JSON))
    config = vllm_config(tmp_path)
    config.model_config.use_mla = True
    with pytest.raises(ServingConfigError) as e:
        Runtime.from_vllm_config(config)
    assert str(e.value).startswith("tpumk plugin: model 'deepseek_v3' uses MLA and vLLM's own MLA cache is on: "
                                   "start vLLM with VLLM_MLA_DISABLE=1"), str(e.value)
    assert "\n" not in str(e.value)


def test_sparse_attention_mla_is_refused_in_one_line(tmp_path, monkeypatch):
    from tpumk.errors import TpumkError

    with pytest.raises(TpumkError) as e:
        deepseek_runtime(tmp_path, monkeypatch, model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
                         index_topk=4, index_n_heads=8, index_head_dim=32)
    msg = str(e.value)
    assert "has sparse attention (index_topk 4); the plugin does not keep its indexer's key cache" in msg, msg
    assert "\n" not in msg


def test_mla_at_tensor_parallel_is_refused_in_one_line(tmp_path, monkeypatch):
    """MLA's latent rows are whole on every device of tpumk's N-device kernel, and the plugin's MLA
    prefill writes one array: tensor parallel > 1 is refused, naming the setting."""
    from tpumk.vllm.runtime import Runtime, ServingConfigError

    monkeypatch.delenv("TPUMK_VLLM_ARTIFACT", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_JSON))
    with pytest.raises(ServingConfigError) as e:
        Runtime.from_vllm_config(vllm_config(tmp_path, tp=3))
    assert str(e.value) == ("tpumk plugin: tensor_parallel_size 3: model 'deepseek_v3' uses MLA: expected "
                            "tensor_parallel_size 1 (the plugin serves MLA's latent cache on one device in this "
                            "release)"), str(e.value)


DECODE_BLOCK, DECODE_BLOCKS, DECODE_CONTEXT = 16, 11, 32


@pytest.mark.full  # 32 s on a loaded host (a MoE MLA kernel); tests/README.md names the default tests covering it
def test_mla_decode_step_on_vllm_s_latent_array_equals_the_reference():
    """One decode-only batch (3 live requests of 4 kernel slots, 6 vLLM slots) on a latent array
    of random rows: the megakernel (tiny-mla with hidden and experts 128 wide) runs on vLLM's
    array with vLLM's block tables, its logits and the array it returns equal the reference
    decode step's on the same array and tables."""
    cfg = load_preset("tiny-mla")
    params = random_params(cfg, seed=1)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=4, context=DECODE_CONTEXT, page_size=DECODE_BLOCK))
    step = make_decode_step(dataclasses.replace(plan, num_pages=DECODE_BLOCKS), portable=True, nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    packed = pack_weights(plan, params)

    @functools.partial(jax.jit, compiler_options=INTERPRET_COMPILER_OPTIONS)
    def decode(latent, *a):
        v = jnp.zeros(latent.shape[:3] + (0,), latent.dtype)
        (latent, _), rows = steps.decode_step(step, packed, shape, latent, v, *a)
        return latent, rows

    rng = np.random.default_rng(5)
    latent = jnp.asarray(rng.normal(size=kv.cache_shape(cfg.kv_layers, DECODE_BLOCKS, DECODE_BLOCK,
                                                       cfg.attention.latent_cache_lanes)), jnp.float32)
    lengths = [5, 17, 30]
    per = DECODE_CONTEXT // DECODE_BLOCK
    tables = np.zeros((SLOTS, per), np.int32)
    tables[:3] = (1 + rng.permutation(DECODE_BLOCKS - 1))[:3 * per].reshape(3, per)
    tokens = rng.integers(0, cfg.vocab_size, 3).tolist()
    ids, pos, qsl, seq_lens = batch_inputs([[t] for t in tokens], lengths, 8)
    got_latent, rows = decode(latent, ids, pos, qsl, seq_lens, tables, jnp.int32(3))

    b = plan.batch
    ref_tokens, ref_pos, ref_len = np.zeros((b, 1), np.int32), np.full((b, 1), -1, np.int32), np.zeros(b, np.int32)
    ref_tokens[:3, 0], ref_pos[:3, 0], ref_len[:3] = tokens, lengths, lengths
    cache = R.KVCache(latent, jnp.zeros(latent.shape[:3] + (0,), latent.dtype), jnp.asarray(tables[:b]),
                      jnp.asarray(ref_len))
    want, want_cache = jax.jit(lambda c: R.decode_step(params, cfg, jnp.asarray(ref_tokens), jnp.asarray(ref_pos),
                                                       c))(cache)
    assert_close(np.asarray(rows)[qsl[1:4] - 1], np.asarray(want)[:3, 0])
    assert not np.any(np.asarray(rows)[qsl[3]:]), "rows past the last request are zero"
    np.testing.assert_allclose(np.asarray(got_latent), np.asarray(want_cache.k), atol=1e-5, rtol=0)
    assert not np.array_equal(np.asarray(got_latent), np.asarray(latent)), "the step wrote its new rows"


@pytest.mark.full  # 22 s on a loaded host (the copy counts' gradient); tests/README.md names what covers it
def test_mla_weights_read_back_from_the_packed_layout_exactly():
    """The plugin holds an MLA model's floating-point weights once (Runtime.holds_weights_once):
    its prefill reads them back from the kernel's packed layout (tpumk.kernel.unpack: q-LoRA,
    kv_a, the block-diagonal uk / uv tiles, routed and shared experts), equal to the loaded ones."""
    from tpumk.kernel.unpack import Unpacker

    cfg = load_preset("tiny-mla")
    params = random_params(cfg, seed=0)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=4, context=DECODE_CONTEXT, page_size=DECODE_BLOCK))
    back = jax.jit(Unpacker(plan, params))(pack_weights(plan, params))
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.full  # 18 s / 12 s on a loaded host; tests/README.md names the default tests covering it
@pytest.mark.parametrize("quant", ["int8", "fp8-b128"])
def test_mla_prefill_of_quantized_weights_equals_the_quantized_reference(quant):
    """TPUMK_VLLM_QUANT on an MLA model: the prefill runs the quantized weights (q-LoRA, kv_a and wo
    quantized, wkv_b as per-head w_uk / w_uv blocks: `absorbed_weights`) with the reference's
    contract: three prompts in one ragged step give the last-token logits of the reference's own
    prefill (its absorbed decode step over a paged cache, the same quantized products) within 1e-5
    of their scale."""
    from tpumk.model.quantize import quantize_params

    cfg = load_preset("tiny-mla").replace(num_layers=2)
    params = quantize_params(cfg, random_params(cfg, seed=0), quant)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (11, 5, 3)]
    tables = np.zeros((SLOTS, CONTEXT // BLOCK), np.int32)
    tables[:3] = rng.permutation(NUM_BLOCKS)[:3 * (CONTEXT // BLOCK)].reshape(3, -1)
    ids, pos, qsl, _ = batch_inputs(seqs, [0, 0, 0], TOKENS)

    @jax.jit
    def ragged(latent, ids, pos, qsl, tables):
        v = jnp.zeros(latent.shape[:3] + (0,), latent.dtype)
        return steps.ragged_step(params, cfg, latent, v, ids, pos, qsl, tables, jnp.int32(3), BLOCK, CONTEXT,
                                 QUERY_TILE, KEY_TILE, SHORT_TILE)[1]

    latent = jnp.zeros(kv.cache_shape(cfg.kv_layers, NUM_BLOCKS, BLOCK, cfg.attention.latent_cache_lanes),
                       jnp.float32)
    rows = np.asarray(ragged(latent, ids, pos, qsl, tables))
    want, _ = R.prefill(params, cfg, seqs, R.init_cache(cfg, 3, CONTEXT, 16), batched=True)
    for r in range(3):
        w = np.asarray(want[r])
        err = float(np.max(np.abs(rows[qsl[r + 1] - 1] - w)))
        assert err <= 1e-5 * float(np.max(np.abs(w))), f"request {r}: max |logits - reference| = {err:.3g}"


def test_mla_decode_step_adds_no_copy_around_the_kernel():
    """The plugin's MLA decode step (traced abstractly: no compile) hands vLLM's latent array to the
    kernel's step as it is and returns the step's own output as the new cache: inside the step the
    array meets the kernel's pallas_call only (the V operand the plugin makes has no lanes)."""
    from test_vllm_adapter import _uses

    cfg = load_preset("tiny-mla")
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), batch=4, context=DECODE_CONTEXT, page_size=DECODE_BLOCK))
    step = make_decode_step(dataclasses.replace(plan, num_pages=DECODE_BLOCKS), portable=True, nested=True)
    shape = {"batch": plan.batch, "context": plan.context, "page_size": plan.page_size}
    packed = jax.eval_shape(lambda: pack_weights(plan, random_params(cfg, seed=0)))

    def decode(packed, latent, *a):
        v = jnp.zeros(latent.shape[:3] + (0,), latent.dtype)
        (latent, _), rows = steps.decode_step(step, packed, shape, latent, v, *a)
        return latent, rows

    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    latent = jax.ShapeDtypeStruct(kv.cache_shape(cfg.kv_layers, DECODE_BLOCKS, DECODE_BLOCK,
                                                 cfg.attention.latent_cache_lanes), jnp.float32)
    jaxpr = jax.jit(decode).trace(packed, latent, i32(8), i32(8), i32(SLOTS + 1), i32(SLOTS),
                                  i32(SLOTS, DECODE_CONTEXT // DECODE_BLOCK), i32()).jaxpr.jaxpr
    n_packed = len(jax.tree.leaves(packed))
    lat_in = jaxpr.invars[n_packed]
    (call,) = _uses(jaxpr, lat_in)  # the step (one nested jit holding the kernel), nothing else
    assert call.primitive.name in ("pjit", "jit") and any(o is jaxpr.outvars[0] for o in call.outvars)
    inner = call.params["jaxpr"].jaxpr
    inside = inner.invars[[i for i, x in enumerate(call.invars) if x is lat_in][0]]
    assert [e.primitive.name for e in _uses(inner, inside)] == ["pallas_call"]


# EAGLE-3 on an MLA target (tpumk.vllm.speculative): serve_step with the drafter's taps, with the
# megakernel's MLA verify step (q_len VERIFY_Q, the taps written out, as tpumk.vllm.runtime builds
# it) and without it (every batch the JAX step, tpumk.vllm.mla_prefill with taps); setup()'s model.
VERIFY_Q, VERIFY_BLOCK, VERIFY_BLOCKS, KERNEL_BATCH = 3, 16, 9, 3
TAPS = (0, 1)  # the embeddings and the stream entering layer 1 of 2 (all setup()'s reference returns)


@functools.lru_cache(maxsize=None)
def speculative_setup():
    from test_vllm_speculative import served_steps

    cfg, params, *_ = setup()
    return served_steps(cfg, params, KERNEL_BATCH, CONTEXT, VERIFY_Q, VERIFY_BLOCK, VERIFY_BLOCKS, TAPS)


def test_mla_taps_and_verify_batches_equal_the_reference_and_the_jax_step():
    """EAGLE-3 on an MLA target: a prefill of two prompts (more than VERIFY_Q tokens each: the JAX
    step with taps), then a verify batch of 3 and 2 tokens through the megakernel's MLA verify step
    and, on the same batch and latent array, through the JAX step. Every live row's logits (not
    only each request's last) and taps of both steps equal the reference's (`forward_full(...,
    taps=)`, MLA's expanded form); the verify step's logits, greedy tokens, taps and latent array
    equal the JAX step's. Request slot 2 is padding with stale metadata (request 0's blocks, a
    nonzero seq_len): a padding slot that wrote or read anything would change request 0's rows."""
    cfg, _, _, reference, _ = setup()
    verified, ragged, kinds = speculative_setup()
    latent = jnp.zeros(kv.cache_shape(cfg.kv_layers, VERIFY_BLOCKS, VERIFY_BLOCK, cfg.attention.latent_cache_lanes),
                       jnp.float32)
    tables = np.zeros((SLOTS, CONTEXT // VERIFY_BLOCK), np.int32)
    tables[:3] = [[3, 7], [5, 1], [3, 7]]  # slot 2: stale, request 0's blocks; never block 0, vLLM's null block
    tables = jnp.asarray(tables)
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (13 + 3, 6 + 2)]
    # causal: each sequence padded to CONTEXT once gives every row of both steps
    want = [[np.asarray(a) for a in reference(jnp.asarray(s + [0] * (CONTEXT - len(s))))[::2]] for s in seqs]

    def run(step, latent, chunks, starts):
        ids, pos, qsl, seq_lens = batch_inputs(chunks, starts, TOKENS)
        seq_lens[2:4] = [5, 9]  # stale
        v = jnp.zeros(latent.shape[:3] + (0,), latent.dtype)  # as the plugin: an MLA model has no V array
        (latent, _), rows, taps = step((latent, v), ids, pos, qsl, seq_lens, tables, jnp.int32(2))
        assert len(taps) == len(TAPS) and all(t.shape == (TOKENS, cfg.hidden_size) for t in taps)
        rows, taps = np.asarray(rows), np.stack([np.asarray(t) for t in taps], axis=1)  # [T, taps, H]
        end = int(qsl[2])
        assert not rows[end:].any(), "logits past the last request's rows are zero"
        for r, (chunk, start) in enumerate(zip(chunks, starts)):
            got = slice(int(qsl[r]), int(qsl[r + 1]))
            want_logits, want_taps = (a[start:start + len(chunk)] for a in want[r])
            np.testing.assert_allclose(taps[got], want_taps, atol=2e-5, rtol=2e-5)
            np.testing.assert_allclose(rows[got], want_logits, atol=2e-4, rtol=2e-4)
        return latent, rows, taps, end

    kinds.clear()
    latent, _, taps, end = run(verified, latent, [seqs[0][:13], seqs[1][:6]], [0, 0])
    jax.effects_barrier()
    assert kinds == ["ragged"], kinds  # 13 and 6 tokens: more than VERIFY_Q
    assert not np.allclose(taps[:end, 0], taps[:end, 1]), "the taps differ: one stream twice fails"

    chunks, starts = [seqs[0][13:], seqs[1][6:]], [13, 6]  # the verify batch: 3 and 2 tokens
    kinds.clear()
    lat_v, rows_v, taps_v, end = run(verified, latent, chunks, starts)
    lat_r, rows_r, taps_r, _ = run(ragged, latent, chunks, starts)
    jax.effects_barrier()
    assert kinds == ["verify", "ragged"], kinds
    # float32 on both sides, the same products summed in another order (the kernel's tiles, the
    # JAX step's): the bound of test_vllm_speculative.py's GQA verify test
    scale = float(np.abs(rows_r[:end]).max())
    assert np.abs(rows_v[:end] - rows_r[:end]).max() <= 1e-5 * scale
    np.testing.assert_array_equal(rows_v[:end].argmax(-1), rows_r[:end].argmax(-1))  # the greedy tokens
    np.testing.assert_allclose(taps_v[:end], taps_r[:end], atol=1e-5, rtol=1e-5)
    assert not taps_v[end:].any(), "the verify step's taps past the last request's rows are zero"
    # the latent array: the same rows written (float32 rounding), every other row untouched
    lat_v, lat_r, before = np.asarray(lat_v), np.asarray(lat_r), np.asarray(latent)
    np.testing.assert_allclose(lat_v, lat_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(lat_v != before, lat_r != before)
    assert (lat_v != before).any(), "the verify step wrote its rows"
