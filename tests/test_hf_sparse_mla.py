"""DeepSeek Sparse Attention (issue 57): `deepseek_v32` (DeepSeek-V3.2) and `glm_moe_dsa` (GLM-5) on
checkpoints written by transformers 5.24's own classes, through tpumk's reader and reference
(`tpumk.model.sparse_attention`); Mistral Large 4's is tests/test_hf_mistral_large4.py.

- `deepseek_v32`: MLA with q-LoRA, interleaved rope lanes and YaRN, an indexer of 8 heads of 32
  lanes (rope lanes rotate-half), index_topk 4, 2 of 4 expert groups, the first layer dense;
- `glm_moe_dsa`: the same MLA with an indexer of 8 heads of 16 lanes (rope lanes interleaved),
  index_topk 6, layer 1 "shared" (it reuses layer 0's selection, no indexer of its own).

Both have a vocabulary of 211 (off the 128-lane grid), the indexer key's LayerNorm bias and
norm weights drawn away from their defaults. Prompts of 9 tokens and 10 steps reach a context of
18 tokens, past each top-k, so the selection decides what each query reads: the dense model's
logits and greedy tokens differ from transformers'. Ties: torch.topk's order among equal scores
is unspecified, so every context here is checked to have its k-th and (k+1)-th index scores at
least TIE_GAP apart (`_selection_gap`; ReLU makes exact ties at 0 common in tiny models).

Float32 logits agree to 2e-5 of their scale (the MLA twin's tolerance, tests/test_hf_mla_names.py;
measured: about 6e-6 of a scale near 4.5).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from transformers import AutoConfig

import hf_utils
from hf_utils import hf_greedy, hf_logits
from tpumk.cli.app import main
from tpumk.decode.generate import generate, load_model
from tpumk.model import mla, reference, sparse_attention
from tpumk.model.config import load_preset
from tpumk.model.ops import rms_norm
from tpumk.model.reference import forward_full
from tpumk.model.weights import random_params

MLA = dict(vocab_size=211, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           q_lora_rank=56, kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20,
           intermediate_size=80, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, first_k_dense_replace=1)
# YaRN as DeepSeek-V3.2's release configures it (the mscales on the MLA softmax and on cos / sin, which
# the indexer's RoPE takes too), over an original length of 8 that the prompts pass
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=1.2, mscale_all_dim=0.8)
CHECKPOINTS = {
    "deepseek_v32": dict(MLA, n_group=4, topk_group=2, index_topk=4, index_n_heads=8, index_head_dim=32,
                         max_position_embeddings=64, rope_parameters=YARN),
    "glm_moe_dsa": dict(MLA, n_group=2, topk_group=1, index_topk=6, index_n_heads=8, index_head_dim=16,
                        indexer_types=["full", "shared", "full"]),
}
CLASSES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
PROMPTS = [[3, 141, 59, 26, 5, 200, 17, 122, 41], [150, 1, 64, 7, 180, 2, 99, 11, 203]]
STEPS = 10
LOGIT_TOKENS = np.random.default_rng(4).integers(0, 211, (2, 24))  # a seed without ties (_selection_gap)
# scores are float32 dots of at most 32 terms of size ~1 (error ~1e-6): a gap of 1e-4 is no tie
TIE_GAP = 1e-4
DENSE = dict(index_topk=0, index_heads=0, index_head_dim=0, index_rope_interleave=False, index_shared_layers=())


def build(out: Path, model_type: str, seed: int = 1) -> Path:
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, initializer_range=0.1, pad_token_id=None, bos_token_id=None,
                               eos_token_id=None, tie_word_embeddings=False, **CHECKPOINTS[model_type])
    model = getattr(transformers, CLASSES[model_type])(cfg).to(torch.float32).eval()
    hf_utils.perturb_norms_and_bias(model, seed)  # the indexer's k_norm weight too
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("indexer.k_norm.bias"):  # (zero by default: a dropped bias would not show)
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    ckpt = build(tmp_path_factory.mktemp(name), name)
    return name, ckpt, load_model(None, str(ckpt))


@functools.lru_cache(maxsize=None)
def _hf_greedy(ckpt: Path) -> list[list[int]]:
    """transformers' greedy tokens of PROMPTS (once per checkpoint: two tests compare with them)."""
    return hf_greedy(ckpt, PROMPTS, STEPS)


@functools.lru_cache(maxsize=None)
def _full(cfg, taps=()):
    """forward_full jitted (one compile per model and shape; op by op it takes seconds)."""
    return jax.jit(lambda params, tokens: forward_full(params, cfg, tokens, taps=taps))


def _selection_gap(m, tokens: np.ndarray, upto: int | None = None) -> float:
    """The smallest gap between the k-th and (k+1)-th index scores a query sees, over every query
    (before position `upto`) with more than k visible keys and every indexer layer of the full
    causal pass over `tokens` (what the cached decode steps of the same sequence compute too)."""
    cfg = m.cfg
    b, t = tokens.shape
    _, taps = _full(cfg, tuple(range(cfg.num_layers)))(m.params, tokens)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    k, gap = cfg.index_topk, np.inf
    for i in cfg.indexer_layers:
        layer = m.params["layers"][i]
        h = rms_norm(taps[:, :, i], layer["attn_norm"], cfg.norms.rms_eps)
        keys = sparse_attention.index_keys(cfg, layer, h, pos)
        s = np.asarray(sparse_attention.index_scores(cfg, layer, h, mla.q_latent(cfg, layer, h), pos, keys))
        for q in range(k, upto or t):
            top = -np.sort(-s[:, q, :q + 1], axis=-1)
            gap = min(gap, float(np.min(top[:, k - 1] - top[:, k])))
    return gap


def test_config_reads_the_family(checkpoint):
    name, ckpt, m = checkpoint
    cfg = m.cfg
    assert cfg.is_mla and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (56, 40, 8)
    assert cfg.dense_layers == (0,) and cfg.vocab_size == 211 and cfg.router_correction_bias
    if name == "deepseek_v32":
        assert (cfg.index_topk, cfg.index_heads, cfg.index_head_dim, cfg.index_rope_interleave) == (4, 8, 32, False)
        assert cfg.indexer_layers == (0, 1, 2) and (cfg.router_groups, cfg.router_topk_groups) == (4, 2)
        assert (cfg.yarn_factor, cfg.yarn_original_max_position, cfg.yarn_mscale_all_dim) == (4.0, 8, 0.8)
    else:
        assert (cfg.index_topk, cfg.index_heads, cfg.index_head_dim, cfg.index_rope_interleave) == (6, 8, 16, True)
        assert cfg.index_shared_layers == (1,) and cfg.indexer_layers == (0, 2)
        assert "idx_wq" not in m.params["layers"][1] and m.params["layers"][2]["idx_weights"].dtype == jnp.float32


def test_reference_logits_match_transformers(checkpoint):
    """Full-sequence logits over 24 tokens (each query past the top-k picks among more keys than it
    keeps) agree to float32 rounding; with dense attention, or with the other family's indexer
    RoPE, they do not."""
    name, ckpt, m = checkpoint
    assert _selection_gap(m, LOGIT_TOKENS) > TIE_GAP
    want = hf_logits(ckpt, LOGIT_TOKENS)
    got = np.asarray(_full(m.cfg)(m.params, LOGIT_TOKENS))
    bound = 2e-5 * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(got - want)) <= bound
    others = [m.cfg.replace(**DENSE), m.cfg.replace(index_rope_interleave=not m.cfg.index_rope_interleave)]
    for cfg in others:
        assert np.max(np.abs(np.asarray(_full(cfg)(m.params, LOGIT_TOKENS)) - want)) > 100 * bound


def test_greedy_tokens_equal_transformers_and_selection_matters(checkpoint):
    """transformers' greedy tokens through the reference's paged prefill and decode steps (the
    index keys of the prompt written by the prefill, of each new token by its step), to a context
    past the top-k; the dense model's greedy tokens differ."""
    name, ckpt, m = checkpoint
    want = _hf_greedy(ckpt)
    got = generate(m, PROMPTS, STEPS, backend="reference")
    assert got["tokens"] == want
    n = len(PROMPTS[0]) + STEPS - 1  # the tokens the last step's query sees
    assert n > 2 * m.cfg.index_topk  # ... keeping fewer than half of them
    # the sequences padded to LOGIT_TOKENS' shape (causal: the padding changes no earlier position),
    # so the full passes reuse the test above's compiled programs
    seqs = np.asarray([p + t + [0] * (LOGIT_TOKENS.shape[1] - n - 1) for p, t in zip(PROMPTS, want)])
    assert _selection_gap(m, seqs, upto=n) > TIE_GAP
    # the dense model's greedy tokens differ: its argmax after some prefix of transformers' tokens
    # is another token (the first such position is where its own greedy run would turn away)
    dense = np.asarray(_full(m.cfg.replace(**DENSE))(m.params, seqs)).argmax(-1)[:, len(PROMPTS[0]) - 1:n]
    assert dense.tolist() != want


@pytest.mark.full  # (13 s) the default run's greedy tests cover the same paged steps against transformers
def test_paged_steps_equal_the_full_pass_and_fill_the_index_key_cache():
    """The reference's paged decode, one token a step after a prefill (shuffled pages, page size
    4), gives the full causal pass's logits; the index-key cache holds exactly the written rows
    (one per indexer layer: GLM-5's shared layer has none)."""
    cfg = load_preset("tiny-mla").replace(index_topk=3, index_heads=2, index_head_dim=16, index_shared_layers=(1,),
                                          index_rope_interleave=True)
    params = random_params(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 14)), jnp.int32)
    full = np.asarray(_full(cfg)(params, tokens))
    cache = reference.init_cache(cfg, 1, 16, page_size=4)
    assert cache.index_keys.shape == (2, 4, 4, 16)
    logits, cache = reference.prefill(params, cfg, [list(np.asarray(tokens[0, :6]))], cache)
    got = [np.asarray(logits[0])]
    step = reference.jitted_decode_step(cfg)
    for t in range(6, 14):
        out, cache = step(params, tokens[:, t:t + 1], jnp.asarray([[t]], jnp.int32), cache)
        got.append(np.asarray(out[0, 0]))
    np.testing.assert_allclose(np.stack(got), full[0, 5:], atol=2e-5 * max(1.0, float(np.abs(full).max())))
    rows = np.asarray(cache.index_keys)[:, np.asarray(cache.block_tables[0])].reshape(2, 16, 16)
    assert np.all(np.any(rows[:, :14] != 0, -1)) and not np.any(rows[:, 14:])


# ---------------------------------------------------------------------- the command line
def _one_line_error(r, *needles) -> str:
    """Exit 1 and one error line, the last on stderr (after any progress lines the command printed)."""
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    err = lines[-1]
    assert err.startswith("tpumk: error: ") and "Traceback" not in r.output, r.stderr
    assert all(line.startswith("tpumk generate: [") for line in lines[:-1]), r.stderr
    assert all(n in err for n in needles), err
    return err


def test_the_megakernel_refuses_what_it_lacks_and_generate_runs_the_reference(checkpoint):
    """The megakernel's sparse attention has model-dtype caches only (its runs:
    tests/test_megakernel_sparse.py, tests/test_multidevice_sparse.py, the greedy tests below):
    `tpumk build` with --kv-dtype fp8 refuses in one line (the reference runs it);
    --kv-dtype int8 (no 1-byte index-key form) is refused by build and generate; `tpumk generate`
    (the reference backend) gives transformers' greedy tokens."""
    name, ckpt, m = checkpoint
    base = ["build", "--checkpoint", str(ckpt), "--target", "tpu7x", "--no-estimate"]
    # a context no longer than the indexer's top-k: its sparse attention would never select
    topk = m.cfg.index_topk
    _one_line_error(CliRunner().invoke(main, ["build", "--checkpoint", str(ckpt), "--target", "tpu7x", "--no-estimate",
                                              "--context", str(topk), "--page-size", str(topk)]),
                    f"context = {topk}: expected more than the indexer's top-k (field 'index_topk' = {topk}")
    # a 1-byte cache: fp8 runs in the reference only (tests/test_sparse_kv_quant.py), int8 nowhere
    _one_line_error(CliRunner().invoke(main, base + ["--kv-dtype", "fp8"]), "sparse attention", "--kv-dtype fp8",
                    "not built by the megakernel yet", "--backend reference")
    for cmd in (base, ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "3,141", "--steps", "2"]):
        _one_line_error(CliRunner().invoke(main, cmd + ["--kv-dtype", "int8"]),
                        "--kv-dtype int8 with sparse attention (index_topk) is not built: its index-key cache has a "
                        "1-byte form in fp8 only (--kv-dtype fp8)")
    if name == "deepseek_v32":  # (the reference's prefill and steps, already compiled by the test above)
        ids = ";".join(",".join(map(str, p)) for p in PROMPTS)
        r = CliRunner().invoke(main, ["generate", "--checkpoint", str(ckpt), "--prompt-ids", ids, "--steps",
                                      str(STEPS), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["tokens"] == _hf_greedy(ckpt)


@pytest.mark.full  # (22-30 s each: ten interpreted megakernel steps) tests/README.md: the default run's cover
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_megakernel_greedy_tokens_equal_transformers(name, tmp_path):
    """DeepSeek-V3.2 and GLM-5 (a layer reusing the previous selection, interleaved indexer RoPE)
    through the megakernel (tpumk.kernel.sparse_attention, interpret mode): the reference's
    prefill writes the prompts' index keys, then ten kernel steps give transformers' greedy
    tokens, past the top-k (the dense model's differ: the test above)."""
    ckpt = build(tmp_path / name, name)
    m = load_model(None, str(ckpt))
    n = len(PROMPTS[0]) + STEPS - 1
    want = _hf_greedy(ckpt)
    seqs = np.asarray([p + t + [0] * (LOGIT_TOKENS.shape[1] - n - 1) for p, t in zip(PROMPTS, want)])
    assert _selection_gap(m, seqs, upto=n) > TIE_GAP
    assert generate(m, PROMPTS, STEPS, backend="megakernel")["tokens"] == want


@pytest.mark.full  # (about 2 min each: the 4-device step interpreted) test_multidevice_sparse's default tests: its plan
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_megakernel_greedy_tokens_on_four_devices_equal_transformers(name, tmp_path):
    """DeepSeek-V3.2 and GLM-5 (its shared-selection layer, interleaved indexer RoPE) through
    `tpumk generate --backend megakernel --devices 4` (interpret mode, 4 host devices; one query
    head per device, the indexer and its index-key cache on every device): transformers' greedy
    tokens."""
    from host_flags import generate_on_devices

    ckpt = build(tmp_path / name, name)
    r = generate_on_devices(ckpt, PROMPTS, STEPS, 4)
    assert "4 devices" in r["ran_on"], r["ran_on"]
    assert r["tokens"] == _hf_greedy(ckpt)


@pytest.mark.parametrize("change, needle", [
    ({"index_topk": 0}, "field 'index_topk' = 0: expected a positive integer"),
    ({"index_topk": -3}, "field 'index_topk' = -3: expected a non-negative integer"),
    ({"index_head_dim": 6}, "field 'index_head_dim' = 6: expected at least qk_rope_head_dim (8"),
    ({"index_n_heads": 0}, "field 'index_n_heads' = 0: expected a positive integer"),
    ({"q_lora_rank": None}, "field 'q_lora_rank' = None: expected a positive integer"),
    ({"indexer_types": ["shared", "full", "full"]}, "field 'indexer_types'"),
    ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, "field 'layer_types'"),
    ({"rope_interleave": False}, "rope_interleave = false"),
])
def test_bad_indexer_fields_are_one_line_errors(change, needle, tmp_path):
    """Through `tpumk build --model config.json`: exit 1, one line naming the field."""
    data = {**CHECKPOINTS["glm_moe_dsa"], "model_type": "glm_moe_dsa"}
    data.update(change)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    _one_line_error(CliRunner().invoke(main, ["build", "--model", str(path), "--no-estimate"]), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


# ---------------------------------------------------------------------- KV bytes per step
def test_sparse_kv_reads_against_hand_computed_bytes():
    """A DeepSeek-V3.2-size model (the deepseek-v3 preset, bfloat16, 61 MLA layers, plus
    DeepSeek-V3.2's indexer: 64 heads of 128 lanes, top 2,048): per sequence and decode step, the
    latent row is 576 lanes stored as 640 (whole 128-lane tiles) x 2 B = 1,280 B, the index key
    128 x 2 B = 256 B. Sparse = context x 256 x 61 + min(2048, context) x 1,280 x 61; dense =
    context x 1,280 x 61. At 128k the indexer's own reads alone are 1/5 of the dense read. The
    megakernel gathers 16-row blocks instead of rows: at most the whole cache up to 32k tokens."""
    from tpumk.errors import ConfigError
    from tpumk.plan.sparse_reads import sparse_kv_reads

    cfg = load_preset("deepseek-v3").replace(index_topk=2048, index_heads=64, index_head_dim=128)
    want = {  # context: (index keys, selected rows, dense rows)
        4096: (63_963_136, 159_907_840, 319_815_680),
        32768: (511_705_088, 159_907_840, 2_558_525_440),
        131072: (2_046_820_352, 159_907_840, 10_234_101_760),
        1000: (15_616_000, 78_080_000, 78_080_000),  # fewer cached tokens than the top-k: every row
    }
    for context, (index, selected, dense) in want.items():
        r = sparse_kv_reads(cfg, context)
        assert (r.index_key_bytes, r.selected_row_bytes, r.dense_row_bytes) == (index, selected, dense)
        assert r.sparse_bytes == index + selected
    assert [round(sparse_kv_reads(cfg, c).ratio, 6) for c in (4096, 32768, 131072)] == [0.7, 0.2625, 0.215625]
    # the megakernel's gather: whole 16-row bf16 blocks (20,480 B), at most min(2048, context / 16) per layer
    blocks = {4096: 256, 32768: 2048, 131072: 2048, 1000: 63}
    for context, n in blocks.items():
        assert sparse_kv_reads(cfg, context).gathered_block_bytes == n * 20_480 * 61
    assert [round(sparse_kv_reads(cfg, c).kernel_ratio, 6) for c in (4096, 32768, 131072)] == [1.2, 1.2, 0.45]
    # --kv-dtype fp8: an index key is 128 e4m3 codes and a float32 scale (132 B), a latent row the
    # 1-byte layout's 640 B (576 codes, the exponent byte, lane padding), the gather's block one 8-bit
    # sublane tile of 32 rows (20,480 B); against the dense build's 1-byte latent rows
    fp8 = {c: sparse_kv_reads(cfg, c, "fp8") for c in (4096, 131072)}
    assert [(r.index_key_bytes, r.selected_row_bytes, r.gathered_block_bytes, r.dense_row_bytes)
            for r in fp8.values()] == [(4096 * 132 * 61, 2048 * 640 * 61, 128 * 20_480 * 61, 4096 * 640 * 61),
                                       (131072 * 132 * 61, 2048 * 640 * 61, 2048 * 20_480 * 61, 131072 * 640 * 61)]
    assert (round(fp8[131072].ratio, 4), round(fp8[131072].kernel_ratio, 4)) == (0.2219, 0.7063)
    with pytest.raises(ConfigError, match="--kv-dtype int8: a sparse-attention model's 1-byte caches are fp8 only"):
        sparse_kv_reads(cfg, 4096, "int8")
    # a layer that reuses the previous selection reads no index keys of its own
    shared = cfg.replace(index_shared_layers=tuple(range(1, 61, 2)))  # 31 of 61 layers keep an indexer
    assert sparse_kv_reads(shared, 131072).index_key_bytes == 131072 * 256 * 31
    with pytest.raises(ConfigError, match="field 'index_topk' = 0: expected a sparse-attention model"):
        sparse_kv_reads(load_preset("deepseek-v3"), 4096)


def test_a_verify_step_selects_per_query(checkpoint):
    """Speculative decoding (`--spec ngram`: the reference's verify steps of 4 tokens, each query
    selecting among the cached keys and the step's earlier tokens, rolled back by the lengths)
    gives the plain greedy tokens: transformers'. (GLM-5's checkpoint: its shared layer too.)"""
    name, ckpt, m = checkpoint
    if name != "glm_moe_dsa":
        pytest.skip("one family: the verify step's selection is the same code for both")
    got = generate(m, PROMPTS, STEPS, backend="reference", spec="ngram", draft_tokens=3)
    # (every step a 4-token verify, whatever its drafts' acceptance: rejected drafts' latent and
    # index-key rows are left past the lengths and rewritten by the next step)
    assert got["tokens"] == _hf_greedy(ckpt) and got["spec"]["target_steps"] >= 1


@pytest.mark.parametrize("kw", [dict(index_topk_pattern="FSSF"), dict(index_topk_pattern=["full", "full", "shared", "full"]),
                                dict(index_topk_freq=2, index_skip_topk_offset=1),
                                dict(index_topk_freq=3), {}])
def test_glm5_shared_layers_are_derived_as_transformers_derives_them(kw):
    """Without indexer_types, GlmMoeDsaConfig derives them from index_topk_pattern, else
    index_topk_freq / index_skip_topk_offset (its defaults: every layer full): tpumk reads the
    same shared layers from the file that carries only those fields."""
    from tpumk.model.config import from_hf_config

    base = {**CHECKPOINTS["glm_moe_dsa"], "num_hidden_layers": 4, "model_type": "glm_moe_dsa"}
    del base["indexer_types"]
    want = transformers.GlmMoeDsaConfig(**{k: v for k, v in base.items() if k != "model_type"}, **kw).indexer_types
    got = from_hf_config({**base, **kw}, "x/config.json").index_shared_layers
    assert got == tuple(i for i, t in enumerate(want) if t == "shared")
    assert bool(got) == bool(kw)  # each pattern here shares some layer; the defaults none
