"""MLA under other names and llama-4 position-scaled queries (issue 57), on checkpoints written by
transformers 5.24's own classes:

- `glm4_moe_lite` (GLM-4.7-Flash): DeepSeek-V3's MLA (q-LoRA, interleaved rope lanes) and routing
  (sigmoid scores, a non-zero correction bias, 2 of 4 expert groups, a shared expert), its dense
  and routed layers placed by `mlp_layer_types` (here the middle one dense);
- `mistral4` (Mistral Small 4): MLA without q-LoRA, softmax routing over 2 expert groups (1 kept,
  no correction bias), a dense first layer, YaRN over the rope lanes (the MLA softmax mscale), and
  every query times 1 + beta ln(1 + floor(position / 4)) (`rope_parameters.llama_4_scaling_beta`
  over an original length of 4, so the prompts and steps cross four of its steps);
- `ministral3` (Ministral 3): Mistral's GQA with YaRN and the same position-scaled queries, on
  widths off the 128-lane grid (hidden 96, 64-wide heads, vocabulary 211: the plan pads them);
- `mistral3`, the multimodal wrapper both Mistral models ship in (Mistral3ForConditionalGeneration:
  the language model under `language_model.model.*` beside a Pixtral tower).

Each family: its config read, the reference's logits equal transformers' (and would not without
the parts that make the family: the query scale, Mistral 4's softmax routing), and transformers'
greedy tokens through the reference and the megakernel in interpret mode on one device and on 4
host devices (`tpumk generate --devices 4`), the build compiled deviceless for TPU7x and v6e (1
or 4 TensorCores). The default run takes Mistral 4 on one device (the query scale in the MLA
stage) and Ministral 3 on 4 (in the GQA stage); the other kernel runs are the full tier
(tests/README.md), GLM-4.7-Flash's among them (its MLA and routing are DeepSeek-V3's:
test_megakernel_mla.py's checkpoint run). Also: the wrapper's language model against
transformers' logits, Mistral 4's null rope_interleave, and `rope.query_scale` against
transformers' own function in float32 and bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoConfig

import hf_utils
from hf_utils import hf_greedy, hf_logits
from host_flags import generate_on_devices
from test_megakernel import compile_for_tpus
from tpumk.decode.generate import generate, load_model
from tpumk.model.reference import forward_full
from tpumk.plan.knobs import TuningConfig

# MLA widths off the lane grid as the DeepSeek-V3 tests have them (latent 40, nope 24, rope 8,
# value 20); hidden and expert widths in whole 128-lane tiles (MLA is not lane padded)
MLA = dict(vocab_size=211, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           kv_lora_rank=40, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20, intermediate_size=80,
           moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
# YaRN over an original length of 4 with llama-4 query scaling over the same 4 positions; beta 1
# (the releases' 0.1 moves these tiny models' greedy tokens too little to show a dropped scale)
SCALED_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                   mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=1.0)
CHECKPOINTS = {
    "glm4_moe_lite": dict(MLA, q_lora_rank=56, n_group=4, topk_group=2, routed_scaling_factor=1.8,
                          mlp_layer_types=["sparse", "dense", "sparse"], rope_parameters=dict(rope_theta=1e6)),
    "mistral4": dict(MLA, q_lora_rank=None, n_group=2, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=1.5, max_position_embeddings=256,
                     rope_parameters=dict(SCALED_YARN, rope_theta=10000.0)),
    # 8 query / 4 KV heads of 64: the 64-wide KV heads go in pairs over 4 devices
    "ministral3": dict(vocab_size=211, hidden_size=96, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=64, intermediate_size=160, max_position_embeddings=256,
                       rope_parameters=dict(SCALED_YARN, rope_theta=1e6)),
}
# (transformers 5.24's AutoModelForCausalLM does not map ministral3 or mistral4: their classes by name)
CLASSES = {"glm4_moe_lite": "Glm4MoeLiteForCausalLM", "mistral4": "Mistral4ForCausalLM",
           "ministral3": "Ministral3ForCausalLM"}
# one prompt length: the reference's prefill compiles once
PROMPTS = [[3, 141, 59, 26, 5, 200, 17, 122, 41], [150, 1, 64, 7, 180, 2, 99, 11, 203]]  # positions 0..8
STEPS = 8  # ... to 15: floor(p / 4) from 0 to 3
UNSCALED = dict(query_scale_beta=0.0, query_scale_interval=0)


def build(out: Path, model_type: str, seed: int) -> Path:
    """A float32 model of `model_type` with transformers' own class, saved with save_pretrained:
    norm weights around 1 and a non-zero correction bias (GLM), so every part moves the logits."""
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, initializer_range=0.1, pad_token_id=None, bos_token_id=None,
                               eos_token_id=None, tie_word_embeddings=False, **CHECKPOINTS[model_type])
    model = getattr(transformers, CLASSES[model_type])(cfg).to(torch.float32).eval()
    hf_utils.perturb_norms_and_bias(model, seed)
    model.save_pretrained(out)
    return out


def _seed(name: str) -> int:
    return 60 + list(CHECKPOINTS).index(name)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    return name, build(tmp_path_factory.mktemp(name), name, _seed(name))


def test_config_reads_the_family(checkpoint):
    name, ckpt = checkpoint
    cfg = load_model(None, str(ckpt)).cfg
    if name == "ministral3":  # GQA, lane padded by the plan; YaRN and the query scale
        assert not cfg.is_mla and (cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads) == (96, 64, 8, 4)
        assert (cfg.yarn_factor, cfg.yarn_original_max_position, cfg.sliding_window) == (4.0, 4, 0)
        assert (cfg.query_scale_beta, cfg.query_scale_interval) == (1.0, 4)
        return
    assert cfg.is_mla
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (40, 24, 8, 20)
    assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn_size, cfg.num_shared_experts) == (8, 2, 128, 1)
    if name == "glm4_moe_lite":  # DeepSeek-V3's routing; the dense layer where mlp_layer_types puts it
        assert cfg.q_lora_rank == 56 and cfg.dense_layers == (1,) and cfg.ffn_size == 80
        assert (cfg.router_scoring, cfg.router_correction_bias, cfg.router_groups, cfg.router_topk_groups) == \
            ("sigmoid", True, 4, 2)
        assert (cfg.routed_scaling_factor, cfg.rope_theta, cfg.yarn_factor, cfg.query_scale_beta) == (1.8, 1e6, 0.0, 0.0)
        assert cfg.rms_eps == 1e-5 and cfg.latent_norm_eps == 1e-6  # transformers' latent norms keep 1e-6
    else:  # Mistral 4: no q-LoRA, softmax over groups without a bias, YaRN, queries scaled by position
        assert cfg.q_lora_rank == 0 and cfg.dense_layers == (0,)
        assert (cfg.router_scoring, cfg.router_correction_bias, cfg.router_groups, cfg.router_topk_groups) == \
            ("softmax", False, 2, 1)
        assert (cfg.yarn_factor, cfg.yarn_original_max_position, cfg.yarn_mscale_all_dim) == (4.0, 4, 1.0)
        assert (cfg.query_scale_beta, cfg.query_scale_interval, cfg.routed_scaling_factor) == (1.0, 4, 1.5)


def test_reference_logits_match_transformers(checkpoint):
    """Full-sequence logits over 24 tokens (positions 0..23: six steps of the query scale) agree
    to float32 rounding, and would not without the family's parts."""
    name, ckpt = checkpoint
    m = load_model(None, str(ckpt))
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (2, 24))
    want = hf_logits(ckpt, tokens)
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    bound = 2e-5 * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(got - want)) <= bound
    # (GLM-4.7-Flash's parts are DeepSeek-V3's, each shown necessary by test_hf_deepseek.py; a reader
    # that placed its dense layer by default would ask for layer 0's dense tensors, which the file lacks)
    others = [m.cfg.replace(**UNSCALED)] if m.cfg.query_scale_beta else []  # the queries unscaled
    if name == "mistral4":  # DeepSeek-V3's sigmoid scores instead of Mistral 4's softmax
        others.append(m.cfg.replace(router_scoring="sigmoid"))
    for cfg in others:
        assert np.max(np.abs(np.asarray(forward_full(m.params, cfg, tokens)) - want)) > 100 * bound


# Which runs the default tier takes: the query scale in the MLA stage (Mistral 4) on one device and
# in the GQA stage (Ministral 3) on 4 host devices; the rest is the full tier (tests/README.md).
DEFAULT_RUNS = {("mistral4", 1), ("ministral3", 4)}
RUNS = [pytest.param(n, d, marks=() if (n, d) in DEFAULT_RUNS else pytest.mark.full, id=f"{n}-{d}dev")
        for n in CHECKPOINTS for d in (1, 4)]


@pytest.mark.parametrize("name, devices", RUNS)
def test_greedy_tokens_transformers_reference_megakernel(name, devices, tmp_path_factory):
    """transformers' greedy tokens through the reference and the megakernel; without the query
    scale transformers' own tokens differ, so a kernel that dropped it could not pass. The build
    compiles deviceless for TPU7x and v6e: on one device, or for 4 TensorCores of each (one
    kernel, no XLA collective)."""
    ckpt = build(tmp_path_factory.mktemp(name), name, _seed(name))
    want = hf_greedy(ckpt, PROMPTS, STEPS)
    m = load_model(None, str(ckpt))
    assert generate(m, PROMPTS, STEPS, backend="reference")["tokens"] == want
    if m.cfg.query_scale_beta:  # (a fresh copy of transformers' model, its beta 0)
        unscaled = hf_utils.load_model.__wrapped__(str(ckpt))
        unscaled.config.rope_parameters["llama_4_scaling_beta"] = 0.0
        assert hf_greedy(ckpt, PROMPTS, STEPS, model=unscaled) != want
    if devices == 1:
        got = generate(m, PROMPTS, STEPS, backend="megakernel", page_size=8)
        compile_for_tpus(m.cfg, len(PROMPTS), 1, TuningConfig(), v6e=True)
    else:  # `tpumk generate --devices 4` in a fresh process (it makes its own host devices)
        got = generate_on_devices(ckpt, PROMPTS, STEPS, devices, "--page-size", "8", timeout=1200)
        assert got["devices"] == devices
        _compiles_on_devices(m.cfg, devices)
    assert got["tokens"] == want and "megakernel" in got["ran_on"]


def _compiles_on_devices(cfg, devices: int) -> None:
    from test_multidevice import XLA_COLLECTIVES
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    for target in ("tpu7x", "v6e"):
        spec = BuildSpec(cfg, get_target(target), batch=len(PROMPTS), context=64, devices=devices)
        c = compile_plan(make_plan(spec))
        assert c.custom_calls == 1 and not XLA_COLLECTIVES.search(c.hlo_text), target


@pytest.mark.parametrize("text_type", ["ministral3", pytest.param("mistral4", marks=pytest.mark.full)])
def test_the_mistral3_wrapper_decodes_its_language_model(text_type, tmp_path):
    """Ministral 3 and Mistral Small 4 ship as Mistral3ForConditionalGeneration (model_type
    mistral3): built by transformers' own class (its language model this file's, a one-layer
    Pixtral tower, the head tied by the wrapper's default), tpumk reads the text_config and the
    language model's tensors (`language_model.model.*`), skips the vision tower and projector, and
    the reference gives transformers' logits on text."""
    torch.manual_seed(70)
    text = dict(CHECKPOINTS[text_type], model_type=text_type, initializer_range=0.1, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                  image_size=16, patch_size=4)
    model = transformers.Mistral3ForConditionalGeneration(
        transformers.Mistral3Config(text_config=text, vision_config=vision)).to(torch.float32).eval()
    hf_utils.perturb_norms_and_bias(model, 70)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mistral3"
    m = load_model(None, str(tmp_path))
    assert m.cfg.tie_embeddings and m.cfg.is_mla == (text_type == "mistral4") and m.cfg.query_scale_beta == 1.0
    tokens = np.random.default_rng(4).integers(0, m.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    assert np.max(np.abs(got - want)) <= 2e-5 * max(1.0, float(np.max(np.abs(want))))


@pytest.mark.full  # the default run loads rope_interleave false (test_hf_deepseek.py's no_interleave_permutation)
def test_mistral4_rope_interleave_null_is_rotate_half(tmp_path_factory):
    """Mistral4Config admits rope_interleave null, which transformers' attention reads as false
    (rotate-half rope lanes, no interleaved pairs): the loader must not permute the rows then."""
    src = build(tmp_path_factory.mktemp("mistral4"), "mistral4", _seed("mistral4"))
    ckpt = tmp_path_factory.mktemp("mistral4-null")
    for f in src.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "rope_interleave": None}))
    m = load_model(None, str(ckpt))
    tokens = np.random.default_rng(5).integers(0, m.cfg.vocab_size, (1, 12))
    want = hf_logits(ckpt, tokens)
    got = np.asarray(forward_full(m.params, m.cfg, tokens))
    assert np.max(np.abs(got - want)) <= 2e-5 * max(1.0, float(np.max(np.abs(want))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_query_scale_is_transformers_llama4_scale(dtype):
    """rope.query_scale against transformers' own get_llama_4_attn_scale cast to the model dtype
    (Mistral 4's; Ministral 3's is the same function), at positions on both sides of each step
    of the interval and far out, negative ones (tokens outside the cache) read as 0."""
    import jax.numpy as jnp
    from transformers.models.mistral4.modeling_mistral4 import get_llama_4_attn_scale

    from tpumk.model.config import load_preset
    from tpumk.model.rope import query_scale

    cfg = load_preset("tiny-dense").replace(query_scale_beta=0.1, query_scale_interval=8192)
    p = np.array([0, 1, 8191, 8192, 8193, 16383, 16384, 100_000, 1_048_575, 1_048_576, 4_000_000], np.int64)
    want = get_llama_4_attn_scale(torch.as_tensor(p)[None], 0.1, 8192)[0, 0, :, 0]
    want = want.to(getattr(torch, dtype)).float().numpy()
    got = np.asarray(query_scale(cfg.positions, jnp.asarray(p, jnp.int32), jnp.dtype(dtype)))
    np.testing.assert_array_equal(got, want)
    assert float(query_scale(cfg.positions, jnp.asarray([-1, -9000]), jnp.float32)[1]) == 1.0
    assert query_scale(load_preset("tiny-dense").positions, jnp.asarray([5]), jnp.float32) is None


def test_query_scale_fields_are_checked():
    from tpumk.errors import ConfigError
    from tpumk.model.config import load_preset
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    cfg = load_preset("tiny-dense")
    with pytest.raises(ConfigError, match="field 'query_scale_interval' = 0: expected a positive integer"):
        cfg.replace(query_scale_beta=0.1)
    with pytest.raises(ConfigError, match="field 'query_scale_interval' = 8: expected 0 when query_scale_beta is 0"):
        cfg.replace(query_scale_interval=8)
    # the kernel takes the factors as one more glue operand only when the model scales its queries
    names = [b.name for b in make_plan(BuildSpec(cfg, get_target("tpu7x"))).contract.operands]
    scaled = [b.name for b in make_plan(BuildSpec(cfg.replace(query_scale_beta=0.1, query_scale_interval=8),
                                                  get_target("tpu7x"))).contract.operands]
    assert "q_scale" not in names and scaled == names[:6] + ["q_scale"] + names[6:]
