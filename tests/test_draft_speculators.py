"""The `speculators` tier: tpumk's drafters against speculators 0.9.0's own torch definitions.

Only in the speculators venv (speculators pins transformers <= 5.19: tests/README.md, "The
speculators tier"): `pytest -m speculators -p no:xdist -o addopts="" tests/test_draft_speculators.py`.

- Each drafter's logits equal speculators' model's on the same random float32 weights, with the
  target hidden states each side takes from its own target: transformers' `output_hidden_states`
  at the drafter's layer ids into speculators' model (vLLM's numbering), tpumk's taps of the
  same checkpoint (read by tpumk) into tpumk's: for a dense GQA (Qwen3), an MoE (Qwen3-MoE) and
  an MLA (DeepSeek-V3) target. MTP: speculators' mtp over a Qwen3 layer, and a DeepSeek-V3
  checkpoint's own next-token layer run by speculators' MTP layer definition over transformers'
  DeepseekV3DecoderLayer.
- speculators' config classes and tpumk's own reader give the same DrafterSpec; tpumk's defaults
  are the classes' defaults; every field of every class is accounted for; the speculators-format
  files tests/draft_files.py writes (the default tier's) load into speculators' models.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.speculators
speculators = pytest.importorskip("speculators")

import hf_utils  # noqa: E402  (offline hub, quiet transformers)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.dflash import core as dflash_core  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

from draft_files import config_json, write_drafter  # noqa: E402
from tpumk.draft import load_drafter, random_drafter  # noqa: E402
from tpumk.draft.config import DEFAULTS, FAMILIES, PROPOSAL_DEFAULTS, read_config  # noqa: E402
from tpumk.model import reference  # noqa: E402
from tpumk.model.checkpoint import load_checkpoint  # noqa: E402
from tpumk.model.hf_fields import COMMON_HARMLESS, COMMON_MODELLED  # noqa: E402
from tpumk.targets import INTERPRET_COMPILER_OPTIONS  # noqa: E402

SMALL = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)
N = 12  # tokens per sequence


@functools.lru_cache(maxsize=None)
def target(kind: str):
    """(path, tpumk config, tpumk params, transformers model) of a tiny dense / moe / mla target;
    the mla one carries a DeepSeek-V3 next-token layer (model.layers.3.*, written beside)."""
    out = Path(tempfile.mkdtemp(prefix=f"draft-target-{kind}-"))
    if kind == "mla":
        hf_utils.build_deepseek_checkpoint(out, seed=3, num_nextn_predict_layers=1)
        _add_deepseek_mtp_layer(out)
    else:
        hf_utils.build_checkpoint(out, moe=kind == "moe", seed=5, **SMALL,
                                  **({"moe_intermediate_size": 32, "mlp_only_layers": [0]} if kind == "moe" else {}))
    cfg, params = load_checkpoint(out)
    return out, cfg, params, hf_utils.load_model(str(out))


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Norms around 1, other weights N(0, 1 / fan_in): logits of a few units, no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("base_kernel"):  # the identity tap plus noise, as speculators starts it
                p.copy_(torch.zeros_like(p))
                p[:, 0] = 1
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def _add_deepseek_mtp_layer(path: Path) -> None:
    """A next-token layer as DeepSeek-V3 stores it (enorm, hnorm, eh_proj, shared_head, copies of
    the embedding and head, a decoder layer), random, in its own safetensors file."""
    from speculators.models.mtp.model_definitions import _create_mtp_layer_class
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    conf = transformers.AutoConfig.from_pretrained(path)
    model = hf_utils.load_model(str(path))
    n = conf.num_hidden_layers
    layer = _create_mtp_layer_class("DeepseekV3MTPLayer", DeepseekV3DecoderLayer, DeepseekV3RMSNorm)(conf, layer_idx=n)
    _randomize(layer, seed=11)
    names = {"hidden_layernorm": "hnorm", "token_layernorm": "enorm", "input_proj": "eh_proj",
             "final_layernorm": "shared_head.norm"}
    sd = {}
    for k, v in layer.state_dict().items():
        first, _, rest = k.partition(".")
        sd[f"model.layers.{n}." + (f"{names[first]}.{rest}" if first in names else k)] = v.contiguous()
    sd[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    sd[f"model.layers.{n}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(sd, str(path / "mtp.safetensors"))
    torch.save(layer.state_dict(), path / "mtp_layer.pt")  # the torch side's module, as written


def hidden_states(model, tokens: np.ndarray, ids) -> torch.Tensor:
    """transformers' output_hidden_states at `ids` (vLLM's and speculators' layer ids), [1, N, T*H]."""
    with torch.no_grad():
        hs = model(torch.as_tensor(tokens), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in ids], -1)


def speculators_model(kind: str, cfg, tmodel, layer_type: str = "qwen3", **fields):
    """speculators' model of `kind` for the target `cfg` with random weights, the target's embedding
    (and head, for a full vocabulary), eager attention; saved to a directory."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    classes = {"eagle3": (Eagle3SpeculatorConfig, Eagle3DraftModel), "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
               "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
               "dspark": (DSparkSpeculatorConfig, DSparkDraftModel)}
    layer_cls = transformers.LlamaConfig if layer_type == "llama" else transformers.Qwen3Config
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=cfg.hidden_size // 4)
    tl = layer_cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
                   num_hidden_layers=fields.pop("layers", 2), **heads)
    tl._attn_implementation = "eager"
    fields.setdefault("draft_vocab_size", cfg.vocab_size)  # (the classes' default is 32000)
    vd = fields["draft_vocab_size"]
    k = fields.pop("k", 3)
    sc = SpeculatorsConfig(algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
                           default_proposal_method="greedy",
                           verifier=VerifierConfig(name_or_path=None, architectures=[]))
    conf_cls, model_cls = classes[kind]
    m = model_cls(conf_cls(transformer_layer_config=tl, speculators_config=sc, **fields)).float().eval()
    _randomize(m, seed=hash(kind) % 1000)
    g = torch.Generator().manual_seed(7)
    if vd < cfg.vocab_size:
        ids = torch.sort(torch.randperm(cfg.vocab_size, generator=g)[:vd]).values
        m.load_vocab_mappings(torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True),
                              ids - torch.arange(vd))
    with torch.no_grad():
        m.embed_tokens.weight.copy_(tmodel.model.embed_tokens.weight)
        if vd == cfg.vocab_size:
            m.lm_head.weight.copy_(tmodel.lm_head.weight)
    path = Path(tempfile.mkdtemp(prefix=f"draft-{kind}-"))
    m.save_pretrained(path)
    return m, path


def _jit(fn):
    return jax.jit(fn, compiler_options=INTERPRET_COMPILER_OPTIONS)


def tpumk_logits(d, params, tparams, taps: jax.Array, tokens: np.ndarray, anchors, forced):
    """tpumk's logits at each anchor position a: the rows before a absorbed (their taps), the
    token at a the anchor, `forced(a)` the drafts after it."""
    fn = _jit(lambda p, tp, h, t, valid, anchor, pos, f: d.logits(p, tp, d.absorb(
        p, tp, d.init_state(1, 32), h, t, jnp.arange(t.shape[1])[None], valid), anchor, pos, f))
    out = []
    for a in anchors:
        valid = jnp.arange(tokens.shape[1])[None] < a
        out.append(np.asarray(fn(params, tparams, taps, jnp.asarray(tokens), valid, jnp.asarray(tokens[:, a]),
                                 jnp.asarray([a]), jnp.asarray(forced(a))[None]))[0])
    return np.stack(out)


def _tokens(cfg, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, N))


CASES = [  # (kind, target, speculators fields and layer type)
    ("eagle3", "dense", dict(draft_vocab_size=96, eagle_aux_hidden_state_layer_ids=[0, 2, 3], norm_before_residual=True,
                             fc_norm=True, norm_output=True)),
    ("eagle3", "moe", dict(eagle_aux_hidden_state_layer_ids=[1, 2], norm_before_fc=True, layer_type="llama")),
    ("eagle3", "mla", dict(draft_vocab_size=100, eagle_aux_hidden_state_layer_ids=[0, 1, 2])),
    ("dflash", "dense", dict(draft_vocab_size=96, aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=7)),
    ("dflash", "moe", dict(aux_hidden_state_layer_ids=[0, 2], block_size=4, mask_token_id=7, sample_from_anchor=True)),
    ("dflash", "mla", dict(aux_hidden_state_layer_ids=[1, 2], block_size=5, mask_token_id=7)),
    ("dflash2", "dense", dict(aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=7, selector_rank=8,
                              conv_group_size=8, selector_top_k=5)),
    ("dflash2", "moe", dict(aux_hidden_state_layer_ids=[0, 3], block_size=4, mask_token_id=7, selector_rank=8,
                            conv_group_size=16, conv_kernel_size=3, sample_from_anchor=True)),
    ("dflash2", "mla", dict(aux_hidden_state_layer_ids=[1, 2], block_size=4, mask_token_id=7, selector_rank=8,
                            conv_group_size=8)),
    ("dspark", "dense", dict(aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=7, markov_rank=8,
                             sample_from_anchor=False)),
    ("dspark", "moe", dict(draft_vocab_size=96, aux_hidden_state_layer_ids=[0, 2], block_size=4, mask_token_id=7,
                           markov_rank=8, markov_head_type="gated")),
    ("dspark", "mla", dict(aux_hidden_state_layer_ids=[1, 2], block_size=4, mask_token_id=7, markov_rank=8,
                           markov_head_type="rnn", confidence_head_with_markov=False)),
]


@pytest.mark.parametrize("kind, target_kind, fields", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_logits_equal_speculators_torch_definition(kind, target_kind, fields):
    _, cfg, tparams, tmodel = target(target_kind)
    fields = dict(fields)
    layer_type = fields.pop("layer_type", "qwen3")
    k = fields.get("block_size", 4) - (0 if fields.get("sample_from_anchor", kind == "dspark") else 1)
    m, path = speculators_model(kind, cfg, tmodel, layer_type, k=3 if kind == "eagle3" else k, **fields)
    d = load_drafter(path, cfg, target_params=tparams, use_speculators=True)
    ids = fields.get("eagle_aux_hidden_state_layer_ids") or fields["aux_hidden_state_layer_ids"]
    assert d.taps == tuple(ids) and not d.spec.own_embed  # the checkpoint's embedding is the target's
    tokens = _tokens(cfg)
    theirs = hidden_states(tmodel, tokens, ids)  # [1, N, T*H]
    taps = reference.forward_full(tparams, cfg, jnp.asarray(tokens), taps=d.taps)[1]
    if kind == "eagle3":
        ref = _eagle3_torch(m, theirs, tokens, d.block)  # [N - 1 anchors, k, Vd]
        padded = np.concatenate([tokens, np.zeros((1, d.block), tokens.dtype)], 1)
        anchors = list(range(1, N))
        mine = tpumk_logits(d, d.params, tparams, taps, tokens, anchors, lambda a: padded[0, a + 1:a + d.block + 1])
    else:
        anchors = [2, 5, N - fields["block_size"]]
        ref = _block_torch(m, theirs, tokens, anchors, kind)
        mine = tpumk_logits(d, d.params, tparams, taps, tokens, anchors, lambda a: tokens[0, a + 1:a + 1 + d.block])
        s0 = d.spec.first_slot
        ref = ref[:, s0:s0 + d.block]
    finite = np.isfinite(ref)
    assert np.array_equal(finite, np.isfinite(mine))  # dflash2: the same candidates
    # float32 on both sides; the taps differ by transformers' and tpumk's sums in another order (~1e-6)
    np.testing.assert_allclose(mine[finite], ref[finite], atol=2e-4, rtol=2e-4)


def _eagle3_torch(m, hidden: torch.Tensor, tokens: np.ndarray, k: int) -> np.ndarray:
    """speculators' training-time test with teacher forcing: step s at row j drafts from the token
    at j + 1 and the taps of j (its data pairing), the later steps fed the true next tokens."""
    outs = []
    hook = m.lm_head.register_forward_hook(lambda mod, i, o: outs.append(o.detach()))
    with torch.no_grad():
        m(hidden_states=hidden[:, :-1], input_ids=torch.as_tensor(tokens[:, 1:]),
          document_ids=torch.zeros(1, N - 1, dtype=torch.long), position_ids=torch.arange(1, N)[None], ttt_steps=k)
    hook.remove()
    return torch.stack(outs, 2)[0].numpy()


def _block_torch(m, hidden: torch.Tensor, tokens: np.ndarray, anchors, kind: str) -> np.ndarray:
    """speculators' anchored-block forward at the given anchors (the same block tokens as teacher
    forcing), with dspark's Markov bias or dflash2's selector scores on its candidates."""
    bs = m.block_size
    a = torch.as_tensor(anchors)
    chosen = lambda loss_mask, num, block: (a, torch.ones(len(anchors), dtype=torch.bool))  # noqa: E731
    original, dflash_core.select_anchors = dflash_core.select_anchors, chosen
    try:
        with torch.no_grad():
            x = torch.as_tensor(tokens)
            hid, logits, *_ = m._backbone_forward(hidden, x, torch.ones(1, N), torch.zeros(1, N, m.hidden_size),
                                                  torch.zeros(1, N, dtype=torch.long), torch.arange(N)[None],
                                                  max_anchors=len(anchors))
    finally:
        dflash_core.select_anchors = original
    logits, hid = logits.view(len(anchors), bs, -1), hid.view(len(anchors), bs, -1)
    block = x[0, (a[:, None] + torch.arange(bs)).clamp(max=N - 1)]
    prev = block if m.config.sample_from_anchor else torch.cat([block[:, :1], block[:, :-1]], 1)
    with torch.no_grad():
        if kind == "dspark":
            logits = logits + m.markov_head.block_bias(prev_token_ids=prev, hidden_states=hid)
        if kind == "dflash2":
            cand, scores = m.candidate_selector.select(logits, hid, prev)
            logits = torch.full_like(logits, -float("inf")).scatter(-1, cand, scores)
    return logits.numpy()


def test_mtp_over_a_qwen3_layer_equals_speculators_mtp():
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig

    path, cfg, tparams, tmodel = target("dense")
    conf = transformers.AutoConfig.from_pretrained(path)
    conf._attn_implementation = "eager"
    sc = SpeculatorsConfig(algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=1)],
                           default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[]))
    m = MTPDraftModel(MTPSpeculatorConfig(transformer_layer_config=conf, speculators_config=sc)).float().eval()
    _randomize(m, seed=5)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(tmodel.model.embed_tokens.weight)
        m.lm_head.weight.copy_(tmodel.lm_head.weight)
    out = Path(tempfile.mkdtemp(prefix="draft-mtp-"))
    m.save_pretrained(out)
    d = load_drafter(out, cfg, use_speculators=True)
    assert d.taps == (cfg.num_layers,) and d.spec.mtp_source == "speculators"
    tokens = _tokens(cfg, seed=2)
    theirs = hidden_states(tmodel, tokens, [cfg.num_layers])  # the final norm's output, as vLLM hands it over
    outs = []
    hook = m.lm_head.register_forward_hook(lambda mod, i, o: outs.append(o.detach()))
    with torch.no_grad():
        m(input_ids=torch.as_tensor(tokens), hidden_states=theirs, position_ids=torch.arange(1, N + 1)[None])
    hook.remove()
    ref = outs[0][0].numpy()  # row t: the taps of t and the token at t + 1
    taps = reference.forward_full(tparams, cfg, jnp.asarray(tokens), taps=d.taps)[1]
    mine = tpumk_logits(d, d.params, tparams, taps, tokens, range(1, ref.shape[0] + 1), lambda a: np.zeros(1, int))
    np.testing.assert_allclose(mine[:, 0], ref, atol=2e-4, rtol=2e-4)


def test_deepseek_next_token_layer_run_as_speculators_mtp():
    """A DeepSeek-V3 checkpoint's own next-token layer (MLA and experts), read by tpumk, against
    speculators' MTP layer definition (its mixin over transformers' DeepseekV3DecoderLayer: hnorm,
    enorm, eh_proj, the layer, shared_head.norm) on the same weights, then the target's head."""
    from speculators.models.mtp.model_definitions import _create_mtp_layer_class
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                                      DeepseekV3RotaryEmbedding)

    path, cfg, tparams, tmodel = target("mla")
    d = load_drafter("mtp", cfg, checkpoint=path, block=2)
    assert d.spec.layer.is_mla and d.spec.layer.is_moe
    conf = tmodel.config
    layer = _create_mtp_layer_class("DeepseekV3MTPLayer", DeepseekV3DecoderLayer, DeepseekV3RMSNorm)(
        conf, layer_idx=conf.num_hidden_layers).float().eval()
    layer.load_state_dict(torch.load(path / "mtp_layer.pt"))
    tokens = _tokens(cfg, seed=3)
    hs = hidden_states(tmodel, tokens, [cfg.num_layers])
    pos = torch.arange(1, N)[None]
    with torch.no_grad():
        h, e = hs[:, :-1], tmodel.model.embed_tokens(torch.as_tensor(tokens[:, 1:]))
        mask = create_causal_mask(config=conf, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        out = layer(hidden_states=h, token_embeddings=e, attention_mask=mask, position_ids=pos,
                    position_embeddings=DeepseekV3RotaryEmbedding(conf)(h, pos))
        ref = tmodel.lm_head(out)[0].numpy()
    taps = reference.forward_full(tparams, cfg, jnp.asarray(tokens), taps=d.taps)[1]
    d1 = dataclasses.replace(d.spec, block=1)
    one = type(d)(d1, d.params)
    mine = tpumk_logits(one, d.params, tparams, taps, tokens, range(1, N), lambda a: np.zeros(1, int))
    np.testing.assert_allclose(mine[:, 0], ref, atol=2e-4, rtol=2e-4)


# ---------------------------------------------------------------------- the readers and the format
def _saved_configs() -> dict:
    """config.json files speculators' own save_pretrained writes, one per kind (and a minimal one)."""
    out = {}
    cfg = target("dense")[1]
    for kind, fields in (("eagle3", dict(draft_vocab_size=96, eagle_aux_hidden_state_layer_ids=[0, 2, 3])),
                         ("dflash", dict(aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=7)),
                         ("dflash2", dict(aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=7,
                                          conv_group_size=8, selector_rank=8)),
                         ("dspark", dict(aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=7,
                                         markov_rank=8, markov_head_type="gated"))):
        _, path = speculators_model(kind, cfg, target("dense")[3], **fields)
        out[kind] = json.loads((path / "config.json").read_text())
    minimal = {k: v for k, v in out["dspark"].items() if k in ("speculators_model_type", "transformer_layer_config",
                                                               "aux_hidden_state_layer_ids", "mask_token_id",
                                                               "draft_vocab_size")}
    out["dspark-minimal"] = minimal
    return out


def test_speculators_classes_and_tpumk_read_configs_alike():
    cfg = target("dense")[1]
    for name, data in _saved_configs().items():
        mine = read_config(data, name, cfg, block=3, use_speculators=False)
        theirs = read_config(data, name, cfg, block=3, use_speculators=True)
        assert mine == theirs, name


def test_tpumk_defaults_are_the_classes_defaults_and_every_field_is_accounted_for():
    from speculators import SpeculatorModelConfig
    from speculators.config import reload_schemas

    reload_schemas()
    registry = SpeculatorModelConfig.registry
    base = set(SpeculatorModelConfig.model_fields)
    for kind, fam in FAMILIES.items():
        fields = registry[kind].model_fields
        own = {n: f.default for n, f in fields.items() if n not in base and n not in ("architectures",
                                                                                  "transformer_layer_config")}
        assert {n: DEFAULTS[kind][n] for n in own if n in DEFAULTS[kind]} == own, kind
        for name in fields:
            assert fam.kind(name) is not None, f"{kind}: field {name!r} not accounted for"
        assert set(own) <= set(DEFAULTS[kind]), kind
    greedy = GreedyTokenProposalConfig()
    assert {k: getattr(greedy, k) for k in PROPOSAL_DEFAULTS} == dict(PROPOSAL_DEFAULTS)
    # what save_pretrained adds beside the fields (PretrainedConfig's own) is accounted for too
    for name, data in _saved_configs().items():
        kind = data["speculators_model_type"]
        assert all(FAMILIES[kind].kind(k) is not None or k in COMMON_MODELLED or k in COMMON_HARMLESS for k in data)


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dflash", "dflash2", "dspark"])
def test_the_default_tiers_files_load_into_speculators_models(tmp_path, kind):
    """tests/draft_files.py (the default tier's writer) writes what speculators reads: its config
    classes take the config.json and its model takes every tensor, none missing but those it
    fills from the target."""
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from safetensors.torch import load_file

    cfg = target("dense")[1]
    shape = dict(taps=(1, 3), block_size=4, markov_rank=8, conv_group=8, selector_rank=8) if kind != "eagle3" \
        else dict(taps=(0, 2, 3), draft_vocab=96)
    d = random_drafter(kind, cfg, **({} if kind == "mtp" else shape))
    path = write_drafter(tmp_path / kind, d, cfg.num_layers)
    conf = SpeculatorModelConfig.from_pretrained(str(path))
    model = SpeculatorModel.registered_model_class_from_config(conf)(conf)
    missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    assert not unexpected
    filled = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert set(missing) <= filled, missing
    assert config_json(d, cfg.num_layers)["speculators_model_type"] == kind
