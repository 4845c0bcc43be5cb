"""Mistral Large 4 (issue 57): `mistral_large4` (MistralLarge4ForConditionalGeneration, a Pixtral
tower beside a `mistral_large4_text` language model) on a checkpoint written by transformers
5.24's own classes, through tpumk's reader and reference.

The tiny model: 5 layers of MLA without q-LoRA (interleaved rope lanes, YaRN with attention
factor 1 as the class's default table), layer 3 NoPE (its query / key blocks all latent: 24
lanes, no rope columns in kv_a), layer 2 reading layer 0's latent rows and layer 4 reading layer
3's (kv_source_layers: neither has a kv_a projection), sparse attention of index_topk 4 with an
indexer of 8 heads of 16 lanes reading the hidden state through a LayerNorm (layer 1 "shared":
it keeps layer 0's selection), 2 of 4 expert groups routed by softmax scores, the first layer
dense, the logits soft-capped at 30. Every learned part is moved off its identity init so it
moves the logits: the RoPE frequencies' alpha, every per-head log-position query scale and bias
(MLA and indexer), the indexer's LayerNorms' weights and biases, the norms. Vocabulary 211 (off
the 128-lane grid).

Prompts of 9 tokens and 10 steps reach 18 tokens, past the top-k; every context compared is
checked to have its k-th and (k+1)-th index scores at least TIE_GAP apart (torch.topk's order
among ties is unspecified). Float32 logits agree to 2e-5 of their scale (the MLA tests'
tolerance; measured below it).
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

from hf_utils import hf_greedy, hf_logits
from tpumk.cli.app import main
from tpumk.decode.generate import generate, load_model
from tpumk.model import mla, sparse_attention
from tpumk.model.ops import rms_norm
from tpumk.model.reference import forward_full, q_resid

TEXT = dict(vocab_size=211, hidden_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20, intermediate_size=80,
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
            topk_group=2, first_k_dense_replace=1, index_topk=4, index_n_heads=8, index_head_dim=16,
            indexer_types=["full", "shared", "full", "full", "full"], no_rope_layers=[1, 1, 1, 0, 0],
            kv_source_layers=[0, 1, 0, 3, 3], max_position_embeddings=64, initializer_range=0.1,
            pad_token_id=None, bos_token_id=None, eos_token_id=None,
            # the class's YaRN over an original length of 8 that the prompts pass
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
                                 beta_fast=32.0, beta_slow=1.0, attention_factor=1.0))
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
              image_size=16, patch_size=4)
PROMPTS = [[3, 141, 59, 26, 5, 200, 17, 122, 41], [150, 1, 64, 7, 180, 2, 99, 11, 203]]
STEPS = 10
LOGIT_TOKENS = np.random.default_rng(4).integers(0, 211, (2, 24))
TIE_GAP = 1e-4  # float32 dots of 16 terms of size ~1: a gap of 1e-4 is no tie
DENSE = dict(index_topk=0, index_heads=0, index_head_dim=0, index_rope_interleave=False, index_shared_layers=(),
             index_q_hidden=False)


def build(out: Path, seed: int = 1) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.MistralLarge4Config(text_config=dict(TEXT), vision_config=dict(VISION))
    model = transformers.MistralLarge4ForConditionalGeneration(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.language_model."):
                continue
            if name.endswith("norm.weight"):  # the RMSNorms and both indexer LayerNorms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.bias"):  # the indexer's LayerNorm biases (zero by default)
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("rotary_emb.alpha"):  # frequencies x exp(alpha) (zero: x 1)
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("softmax_scaling.scale"):  # s ln(1 + p) + b (0 and 1: unscaled)
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("softmax_scaling.bias"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ckpt = build(tmp_path_factory.mktemp("mistral_large4"))
    return ckpt, load_model(None, str(ckpt))


@functools.lru_cache(maxsize=None)
def _hf_greedy(ckpt: Path) -> list[list[int]]:
    return hf_greedy(ckpt, PROMPTS, STEPS)


@functools.lru_cache(maxsize=None)
def _full(cfg):
    """forward_full jitted with every layer's input tapped (one program per model serves the logits
    and the selection gaps)."""
    return jax.jit(lambda params, tokens: forward_full(params, cfg, tokens, taps=tuple(range(cfg.num_layers))))


def _logits(cfg, params, tokens) -> np.ndarray:
    return np.asarray(_full(cfg)(params, tokens)[0])


def _selection_gap(m, tokens: np.ndarray, upto: int | None = None) -> float:
    """The smallest gap between the k-th and (k+1)-th index scores any query with more than k
    visible keys sees, over the indexer layers of the full causal pass over `tokens`."""
    cfg = m.cfg
    b, t = tokens.shape
    _, taps = _full(cfg)(m.params, tokens)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    freqs = mla.rope_freqs(cfg, m.params)
    k, gap = cfg.index_topk, np.inf
    for i in cfg.indexer_layers:
        layer, rot = m.params["layers"][i], cfg.pattern.rotates(i)
        h = rms_norm(taps[:, :, i], layer["attn_norm"], cfg.norms.rms_eps)
        keys = sparse_attention.index_keys(cfg, layer, h, pos, rot, freqs)
        s = np.asarray(sparse_attention.index_scores(cfg, layer, h, q_resid(cfg, layer, h), pos, keys, rot, freqs))
        for q in range(k, upto or t):
            top = -np.sort(-s[:, q, :q + 1], axis=-1)
            gap = min(gap, float(np.min(top[:, k - 1] - top[:, k])))
    return gap


def test_config_reads_every_part(checkpoint):
    ckpt, m = checkpoint
    cfg = m.cfg
    assert cfg.is_mla and cfg.q_lora_rank == 0 and cfg.vocab_size == 211 and not cfg.tie_embeddings
    assert (cfg.index_topk, cfg.index_heads, cfg.index_head_dim, cfg.index_rope_interleave) == (4, 8, 16, True)
    assert cfg.index_q_hidden and cfg.index_shared_layers == (1,) and cfg.indexer_layers == (0, 2, 3, 4)
    assert cfg.rope_learned_freqs and cfg.query_log_scale and cfg.nope_layers == (3, 4) and cfg.nope_latent_keys
    assert cfg.kv_source_layers == (0, 1, 0, 3, 3) and cfg.final_softcap == 30.0
    assert (cfg.router_scoring, cfg.norm_topk_prob, cfg.router_float32, cfg.router_correction_bias) == \
        ("softmax", True, True, False)
    assert (cfg.router_groups, cfg.router_topk_groups, cfg.dense_layers) == (4, 2, (0,))
    assert cfg.latent_norm_eps == 0  # transformers' kv_a_layernorm: rms_norm_eps
    layers = m.params["layers"]
    assert "wkv_a" not in layers[2] and "kv_a_norm" not in layers[4] and layers[3]["wkv_a"].shape == (128, 40)
    assert layers[3]["wkv_b"].shape == (40, 4 * (24 + 20)) and m.params["rope_alpha"].shape == (4,)
    assert layers[0]["idx_wq"].shape == (128, 128) and "idx_wq" not in layers[1]
    assert layers[1]["router"].dtype == jnp.float32  # (bfloat16 builds keep it float32 too: tensor_dtype)
    # the count tpumk plans with is the tensors it loads (per-layer widths, shared layers, rope_alpha)
    leaves = [v for lay in layers for v in lay.values()] + [v for k, v in m.params.items() if k != "layers"]
    assert cfg.param_count() == sum(int(np.prod(v.shape)) for v in leaves)


def test_reference_logits_match_transformers(checkpoint):
    """Full-sequence float32 logits over 24 tokens agree to 2e-5 of their scale; without each
    learned part (alpha, the query scales: new weights, the same compiled pass) or with dense
    attention (the greedy test's program) they do not; the soft-cap moves them by far more than
    the bound (so the match needs it)."""
    ckpt, m = checkpoint
    assert _selection_gap(m, LOGIT_TOKENS) > TIE_GAP
    want = hf_logits(ckpt, LOGIT_TOKENS)
    got = _logits(m.cfg, m.params, LOGIT_TOKENS)
    bound = 2e-5 * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(got - want)) <= bound
    p = m.params
    unscaled = [{**lay, **{k: jnp.zeros_like(lay[k]) for k in ("q_log_scale", "idx_log_scale") if k in lay},
                 **{k: jnp.ones_like(lay[k]) for k in ("q_log_bias", "idx_log_bias") if k in lay}} for lay in p["layers"]]
    variants = [(m.cfg, {**p, "rope_alpha": jnp.zeros_like(p["rope_alpha"])}),
                (m.cfg, {**p, "layers": unscaled}),

                (m.cfg.replace(**DENSE), p)]
    for cfg, params in variants:
        assert np.max(np.abs(_logits(cfg, params, LOGIT_TOKENS) - want)) > 100 * bound
    assert np.max(np.abs(30.0 * np.arctanh(want / 30.0) - want)) > 100 * bound


def test_greedy_tokens_equal_transformers(checkpoint):
    """transformers' greedy tokens (its own KV-sharing cache) through the reference's paged prefill
    and decode steps, to a context past the top-k; the dense model's tokens differ."""
    ckpt, m = checkpoint
    want = _hf_greedy(ckpt)
    got = generate(m, PROMPTS, STEPS, backend="reference")
    assert got["tokens"] == want
    n = len(PROMPTS[0]) + STEPS - 1
    assert n > 2 * m.cfg.index_topk
    seqs = np.asarray([p + t + [0] * (LOGIT_TOKENS.shape[1] - n - 1) for p, t in zip(PROMPTS, want)])
    assert _selection_gap(m, seqs, upto=n) > TIE_GAP
    dense = _logits(m.cfg.replace(**DENSE), m.params, seqs).argmax(-1)[:, len(PROMPTS[0]) - 1:n]
    assert dense.tolist() != want


# ---------------------------------------------------------------------- refusals
def _one_line_error(r, *needles) -> str:
    assert r.exit_code == 1, r.output
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("tpumk: error: ") and "Traceback" not in r.output, r.stderr
    assert all(n in err for n in needles), err
    return err


def test_the_megakernel_refuses_quantized_weights(checkpoint):
    """The megakernel builds Mistral Large 4 with model-dtype weights only (its runs: the greedy
    tests below, tests/test_megakernel_large4.py, tests/test_multidevice_sparse.py): `tpumk
    build --quant int8` refuses in one line, naming the part (its layers reading another's
    latent rows) and what runs it."""
    ckpt, _ = checkpoint
    _one_line_error(CliRunner().invoke(main, ["build", "--checkpoint", str(ckpt), "--target", "tpu7x",
                                              "--no-estimate", "--quant", "int8"]),
                    "sparse attention", "--quant int8", "kv_source_layers", "--backend reference")


@pytest.mark.full  # (38 s: ten interpreted megakernel steps) tests/README.md: the default run's cover
def test_megakernel_greedy_tokens_equal_transformers(checkpoint):
    """Every Mistral Large 4 part through the megakernel (interpret mode, one device): the
    reference's prefill writes the prompts' latent rows and index keys, then ten kernel steps give
    transformers' greedy tokens, past the top-k (the dense model's differ: the test above)."""
    ckpt, m = checkpoint
    assert generate(m, PROMPTS, STEPS, backend="megakernel")["tokens"] == _hf_greedy(ckpt)


@pytest.mark.full  # (about 2 min: the 4-device step interpreted) tests/README.md: the default run's cover
def test_megakernel_greedy_tokens_on_four_devices_equal_transformers(checkpoint):
    """`tpumk generate --backend megakernel --devices 4` (interpret mode, 4 host devices; one query
    head per device, the indexer and its index-key cache on every device): transformers' tokens."""
    from host_flags import generate_on_devices

    ckpt, _ = checkpoint
    r = generate_on_devices(ckpt, PROMPTS, STEPS, 4)
    assert "4 devices" in r["ran_on"], r["ran_on"]
    assert r["tokens"] == _hf_greedy(ckpt)


def _wrapper(text: dict) -> dict:
    return json.loads(transformers.MistralLarge4Config(text_config={**TEXT, **text},
                                                       vision_config=dict(VISION)).to_json_string())


@pytest.mark.parametrize("change, needle", [
    ({"kv_source_layers": [0, 1, 0, 3, 2]}, "field 'kv_source_layers'"),  # a NoPE layer naming a RoPE one
    ({"kv_source_layers": [0, 0, 1, 3, 4]}, "field 'kv_source_layers'"),  # a source that is not its own
    ({"no_rope_layers": [1, 1, 2, 0, 0]}, "field 'no_rope_layers'"),
    ({"no_rope_layers": [1, 1]}, "field 'no_rope_layers'"),
    ({"final_logit_softcapping": 0.0}, "field 'final_logit_softcapping' = 0.0"),
    ({"indexer_types": ["shared", "full", "full", "full", "full"]}, "field 'indexer_types'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
])
def test_bad_fields_are_one_line_errors(change, needle, tmp_path):
    data = _wrapper({})
    data["text_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(data))
    _one_line_error(CliRunner().invoke(main, ["build", "--model", str(tmp_path / "config.json"), "--no-estimate"]),
                    needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_source_transformers_would_not_hand_over_is_refused(tmp_path):
    """Layers 0 and 1 both store rows for later ones; transformers hands layer 3 (naming layer 0)
    the last stored, layer 1's: refused, naming what transformers reads."""
    data = _wrapper({"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 1], "kv_source_layers": [0, 1, 1, 0],
                     "indexer_types": ["full"] * 4})
    (tmp_path / "config.json").write_text(json.dumps(data))
    _one_line_error(CliRunner().invoke(main, ["build", "--model", str(tmp_path / "config.json"), "--no-estimate"]),
                    "layer 3 names layer 0", "layer 1's rows")


def test_a_mistral3_wrapper_around_it_is_refused(tmp_path):
    """transformers' Mistral3ForConditionalGeneration would run a mistral_large4_text model without
    its logits' soft-cap (and tie the head by default): not this model, refused in one line."""
    data = _wrapper({})
    data["model_type"] = "mistral3"
    data.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(data))
    _one_line_error(CliRunner().invoke(main, ["build", "--model", str(tmp_path / "config.json"), "--no-estimate"]),
                    "text_config.model_type 'mistral_large4_text' in a 'mistral3' wrapper")
