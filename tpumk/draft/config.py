"""A drafter's description: the `speculators` 0.9.0 config.json read, every field accounted for,
and checked against the target it drafts for.

A speculators drafter directory holds a `config.json` whose `speculators_model_type` names the
kind (eagle3, mtp, dflash, dflash2, dspark), a `transformer_layer_config` (the draft decoder
layers: a transformers Qwen3 or Llama config) and the kind's own fields, beside its safetensors.
Where the `speculators` package is installed (the speculators test tier's venv: it pins
transformers <= 5.19, so not tpumk's default install) the file is first validated and completed
by speculators' own config classes (`SpeculatorModelConfig.from_dict`, then its `to_diff_dict`,
what `save_pretrained` writes); without it the same fields are read here with the classes'
defaults (`DEFAULTS`; tests/test_draft_speculators.py compares both readers and the defaults).
Either way every key is, per kind (`FAMILIES`, tpumk.model.hf_fields' accounting): modelled,
harmless with a stated reason, or refused unless neutral; any other key is refused. The
`transformer_layer_config` is read by tpumk.model.config.from_hf_config, so its fields are
accounted for as a target's are.

Tap numbering. speculators and vLLM name a target hidden state by a layer id: id i < L (L the
target's layers) is the residual stream entering layer i (vLLM's `_maybe_add_hidden_state(...,
0, embeddings)` and `(..., i + 1, ...)` after layer i; speculators' DFlash converter maps z-lab's
`hidden_states[i + 1]` to id i + 1): tpumk's tap i (transformers' output_hidden_states[i]). Id L
is the residual stream after the last layer BEFORE the final norm (vLLM adds it after the last
layer; speculators' trainer applies the verifier's norm to it), which tpumk's taps do not hold
(tpumk's tap L is the final norm's output): refused. MTP reads the target's final hidden state:
tpumk's tap L, the final norm's output, which is what vLLM hands an MTP head when it serves one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from tpumk.errors import ConfigError, NotSupportedError, one_line
from tpumk.model.config import DTYPES, ModelConfig, from_hf_config
from tpumk.model.hf_fields import Family, Refused, account_fields, shown
from tpumk.model.parts import is_int

KINDS = ("eagle3", "mtp", "dflash", "dflash2", "dspark")
CHAIN_KINDS = ("eagle3", "mtp")  # one draft per drafter step, fed back k times
BLOCK_KINDS = ("dflash", "dflash2", "dspark")  # an anchor + mask tokens drafted in one pass
MAX_BLOCK = 64  # drafts per round (a verify step of k + 1 rows); far above any published drafter's
MARKOV_HEADS = ("vanilla", "gated", "rnn")
# The layer config model types each kind's speculators definition builds on (speculators 0.9.0:
# eagle3's model_classes llama / qwen3; DFlash's decoder layer is always Qwen3's, with QK-norm;
# mtp's mtp_model_classes qwen3, plus Qwen3-Next / Qwen3.5 hybrids tpumk does not draft with yet).
LAYER_TYPES = MappingProxyType({"eagle3": ("qwen3", "llama"), "mtp": ("qwen3",), "dflash": ("qwen3",),
                                "dflash2": ("qwen3",), "dspark": ("qwen3",)})
# The config class speculators builds a transformer_layer_config without a model_type as.
DEFAULT_LAYER_TYPE = MappingProxyType({"mtp": "qwen2", "eagle3": "qwen3", "dflash": "qwen3", "dflash2": "qwen3",
                                       "dspark": "qwen3"})

# Each kind's own fields at their speculators 0.9.0 class defaults (a field the file leaves out
# is read at these, as speculators reads it).
_DFLASH_DEFAULTS = {"draft_vocab_size": 32000, "block_size": 8, "target_hidden_size": None,
                    "aux_hidden_state_layer_ids": None, "mask_token_id": None, "sliding_window_non_causal": False,
                    "sample_from_anchor": False}
DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "eagle3": MappingProxyType({"draft_vocab_size": 32000, "norm_before_residual": False, "target_hidden_size": None,
                                "eagle_aux_hidden_state_layer_ids": None, "norm_before_fc": False, "fc_norm": False,
                                "norm_output": False, "embed_requires_grad": False}),
    "mtp": MappingProxyType({"num_nextn_predict_layers": 1}),
    "dflash": MappingProxyType(_DFLASH_DEFAULTS),
    "dflash2": MappingProxyType({**_DFLASH_DEFAULTS, "sliding_window_non_causal": True, "conv_kernel_size": 2,
                                 "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}),
    "dspark": MappingProxyType({**_DFLASH_DEFAULTS, "sample_from_anchor": True, "markov_rank": 256,
                                "markov_head_type": "vanilla", "enable_confidence_head": True,
                                "confidence_head_with_markov": True}),
})
# A proposal method's fields at GreedyTokenProposalConfig's defaults (the only one speculators registers).
PROPOSAL_DEFAULTS = MappingProxyType({"speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0})

_TRAINING = "a training setting; no part of the drafter's forward pass"
_COMMON_MODELLED = {"speculators_model_type", "speculators_config", "transformer_layer_config"}
_COMMON_HARMLESS = {
    "speculators_version": "the speculators release that wrote the file (its fields are read as 0.9.0 defines them)",
    "tie_word_embeddings": "speculators' models never tie a draft's head to its embedding (SpeculatorModel sets "
                           "it false whatever the file says)",
}
_SLIDING_NON_CAUSAL = ("masking inside sliding-window draft layers only; tpumk refuses sliding-window draft layers "
                       "(transformer_layer_config), so its full-attention layers see the whole block as "
                       "speculators' do")
_DFLASH_MODELLED = {"draft_vocab_size", "target_hidden_size", "aux_hidden_state_layer_ids", "block_size",
                    "mask_token_id", "sample_from_anchor"}


def _fam(modelled, harmless=None) -> Family:
    return Family(frozenset(_COMMON_MODELLED | set(modelled)), MappingProxyType({**_COMMON_HARMLESS, **(harmless or {})}),
                  MappingProxyType({}), MappingProxyType({}))


FAMILIES: Mapping[str, Family] = MappingProxyType({
    "eagle3": _fam({"draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                    "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"},
                   {"embed_requires_grad": _TRAINING}),
    "mtp": _fam({"num_nextn_predict_layers"}),
    "dflash": _fam(_DFLASH_MODELLED, {"sliding_window_non_causal": _SLIDING_NON_CAUSAL}),
    "dflash2": _fam(_DFLASH_MODELLED | {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"},
                    {"sliding_window_non_causal": _SLIDING_NON_CAUSAL}),
    # the confidence head's flags say which tensors the checkpoint holds (read and shape-checked);
    # the head itself is never evaluated (tpumk.draft.block)
    "dspark": _fam(_DFLASH_MODELLED | {"markov_rank", "markov_head_type", "enable_confidence_head",
                                       "confidence_head_with_markov"},
                   {"sliding_window_non_causal": _SLIDING_NON_CAUSAL}),
})
SPECULATORS_CONFIG_FIELDS = ("algorithm", "proposal_methods", "default_proposal_method", "verifier")
PROPOSAL_FIELDS = Family(frozenset({"proposal_type", "speculative_tokens"}), MappingProxyType({}), MappingProxyType({
    "verifier_accept_k": Refused("a lossy acceptance rule (a draft accepted within the verifier's top k): tpumk "
                                 "accepts a draft as speculative decoding does, exactly", (1,)),
    "accept_tolerance": Refused("a lossy acceptance rule (a tolerance in log-likelihood): tpumk accepts a draft as "
                                "speculative decoding does, exactly", (0, 0.0)),
}), MappingProxyType({}))
VERIFIER_FIELDS = Family(frozenset(), MappingProxyType({
    "name_or_path": "the target the drafter was trained for; tpumk checks the drafter against the target it is "
                    "given (hidden size, vocabulary, depth)",
    "architectures": "the target's transformers classes; tpumk checks the drafter against the target it is given",
}), MappingProxyType({}), MappingProxyType({}))


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter, described: what plans, cache keys and manifests record (`to_dict`, JSON-able) and
    what its functions are specialised on (hashable; no weights).

    `layer` is the draft decoder layers' config (a tpumk ModelConfig, `num_layers` of them; for an
    MTP head from the target's checkpoint, a one-layer copy of the target's). `taps` are the target
    hidden states it reads (tpumk's numbering), `block` the drafts it proposes per round, `vocab`
    the target's vocabulary and `draft_vocab` its head's (smaller: an EAGLE-3 / DFlash reduced
    vocabulary, mapped to the target's by d2t)."""

    kind: str
    layer: ModelConfig
    taps: tuple[int, ...]
    block: int
    vocab: int
    draft_vocab: int
    own_embed: bool = False  # eagle3: the checkpoint's embed_tokens, not the target's
    # eagle3
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # dflash, dflash2, dspark
    block_size: int = 0
    mask_token_id: int = -1
    sample_from_anchor: bool = False
    # dflash2
    conv_kernel: int = 0
    conv_group: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # dspark (confidence_head: the confidence head's input width, 0 without one; never evaluated)
    markov_rank: int = 0
    markov_head: str = ""
    confidence_head: int = 0
    # mtp: "speculators" (a speculators mtp directory) or "checkpoint" (the target's own layer)
    mtp_source: str = ""

    @property
    def hidden(self) -> int:
        return self.layer.hidden_size

    @property
    def slots(self) -> int:
        """Rows the drafter runs per round: its block (dflash family), or 1 per chained step."""
        return self.block_size if self.kind in BLOCK_KINDS else 1

    @property
    def first_slot(self) -> int:
        """The block slot whose output drafts position anchor + 1 (dflash family)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def max_block(self) -> int:
        """The most drafts a round of this drafter can propose: the dflash family's block slots
        (block_size - 1, or every slot with sample_from_anchor), a chain's MAX_BLOCK steps."""
        if self.kind in BLOCK_KINDS:
            return self.block_size if self.sample_from_anchor else self.block_size - 1
        return MAX_BLOCK

    def with_block(self, block: int) -> "DrafterSpec":
        """The same drafter proposing `block` drafts a round (its weights do not depend on it);
        ConfigError (one line) past what it can draft (`max_block`)."""
        if not (is_int(block) and 1 <= block <= self.max_block):
            raise ConfigError(f"{self.kind} drafter: {block!r} drafts a round: expected 1 to {self.max_block}"
                              + (f" (its block_size {self.block_size})" if self.kind in BLOCK_KINDS else ""))
        return dataclasses.replace(self, block=block)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer"] = self.layer.to_dict()
        d["taps"] = list(self.taps)
        return d

    @classmethod
    def from_dict(cls, data: Any, source: str = "drafter") -> "DrafterSpec":
        """The spec `to_dict` wrote (an artifact's manifest, a tune worker's request); ConfigError
        (one line naming the field) for anything else."""
        from tpumk.model.config import from_dict as model_from_dict

        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table of drafter fields")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"{source}: unknown drafter field '{unknown[0]}'")
        missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in data]
        if missing:
            raise ConfigError(f"{source}: missing drafter field '{missing[0]}'")
        values = dict(data)
        values["layer"] = model_from_dict(data["layer"], f"{source}.layer")
        taps = data["taps"]
        if not (isinstance(taps, (list, tuple)) and all(is_int(t) for t in taps)):
            raise ConfigError(f"{source}: field 'taps' = {shown(taps)}: expected a list of layer numbers")
        values["taps"] = tuple(taps)
        if values.get("kind") not in KINDS:
            raise ConfigError(f"{source}: field 'kind' = {shown(values.get('kind'))}: expected one of {', '.join(KINDS)}")
        for name, f in fields.items():
            if name in ("layer", "taps", "kind"):
                continue
            want = {"int": int, "bool": bool, "str": str}.get(str(f.type))
            v = values.get(name, f.default)
            if want is not None and not (type(v) is want):
                raise ConfigError(f"{source}: field '{name}' = {shown(v)}: expected a {want.__name__}")
        return cls(**values)


# ---------------------------------------------------------------------- reading config.json
def _bad(source: str, field: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{source}: field '{field}' = {shown(value)}: expected {expected}")


def _int(source: str, values: dict, key: str, low: int, high: int, allow_none: bool = False) -> int | None:
    v = values[key]
    if v is None and allow_none:
        return None
    if not is_int(v) or not low <= v <= high:
        raise _bad(source, key, v, f"an integer from {low:,} to {high:,}" + (" or null" if allow_none else ""))
    return v


def _bool(source: str, values: dict, key: str) -> bool:
    v = values[key]
    if not isinstance(v, bool):
        raise _bad(source, key, v, "true or false")
    return v


def speculators_installed() -> bool:
    return importlib.util.find_spec("speculators") is not None


def through_speculators(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` validated and completed by speculators' own config classes, as `save_pretrained`
    writes it (`to_diff_dict`: every speculators field, the layer config's non-default ones)."""
    from speculators import SpeculatorModelConfig

    try:
        cfg = SpeculatorModelConfig.from_dict(dict(data))
    except Exception as e:  # pydantic's ValidationError and the classes' own ValueErrors
        raise ConfigError(f"{source}: speculators {_speculators_version()} refuses it: {one_line(e)[:300]}") from None
    return cfg.to_diff_dict()


def _speculators_version() -> str:
    from importlib.metadata import version

    return version("speculators")


def read_config(data: Any, source: str, target: ModelConfig, block: int | None = None,
                dtype: str | None = None, use_speculators: bool | None = None) -> DrafterSpec:
    """The DrafterSpec a speculators config.json (parsed JSON `data`) describes, for `target`.

    `block` overrides the drafts per round (default: the speculators_config's default proposal's
    speculative_tokens); `dtype` the draft weights' dtype (default: the file's). `use_speculators`
    (default: when the package is installed) validates through speculators' config classes first.
    Every refusal is one line naming `source` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object (a speculators drafter's config.json)")
    kind = data.get("speculators_model_type")
    if kind is None:
        raise ConfigError(f"{source}: missing field 'speculators_model_type': not a speculators drafter config "
                          f"(expected one of {', '.join(KINDS)})")
    if not isinstance(kind, str) or kind not in KINDS:
        raise NotSupportedError(f"{source}: not supported: speculators_model_type {shown(kind)} "
                                f"(tpumk drafts with {', '.join(KINDS)})")
    if use_speculators if use_speculators is not None else speculators_installed():
        data = through_speculators(data, source)
    data = account_fields(data, kind, source, FAMILIES[kind])
    values = {**DEFAULTS[kind], **{k: v for k, v in data.items() if k in DEFAULTS[kind]}}
    mt = data.get("model_type")
    if mt not in (None, "speculator_model"):  # speculators' own PretrainedConfig model_type, stripped on save
        raise _bad(source, "model_type", mt, "absent or 'speculator_model' (speculators_model_type names the kind)")
    if data.get("quantization_config") not in (None, {}):
        raise NotSupportedError(f"{source}: not supported yet: a quantized drafter (quantization_config "
                                f"{shown(data['quantization_config'])})")
    weights_dtype = _dtype(data, source) if dtype is None else dtype
    proposal = _proposal(data.get("speculators_config"), kind, source)
    layer = _layer(data, kind, source, weights_dtype, target)

    common = dict(kind=kind, vocab=target.vocab_size)
    if kind == "mtp":
        if _int(source, values, "num_nextn_predict_layers", 0, 1 << 10) != 1:
            raise NotSupportedError(f"{source}: not supported: num_nextn_predict_layers = "
                                    f"{values['num_nextn_predict_layers']} (speculators 0.9.0's mtp has one layer)")
        k = _chain_block(proposal, block, source)
        return DrafterSpec(layer=layer, taps=(target.num_layers,), block=k, draft_vocab=target.vocab_size,
                           mtp_source="speculators", **common)
    draft_vocab = _int(source, values, "draft_vocab_size", 1, target.vocab_size)
    th = _int(source, values, "target_hidden_size", 1, 1 << 20, allow_none=True)
    if th is not None and th != target.hidden_size:
        raise ConfigError(f"{source}: field 'target_hidden_size' = {th}: expected the target's hidden size "
                          f"{target.hidden_size} (or null)")
    if kind == "eagle3":
        flags = {f: _bool(source, values, f) for f in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                       "norm_output", "embed_requires_grad")}
        if flags["norm_before_fc"] and flags["fc_norm"]:
            raise ConfigError(f"{source}: fields 'norm_before_fc' and 'fc_norm' are both true: expected at most one "
                              "(a norm over the concatenated taps, or one per tap)")
        ids = values["eagle_aux_hidden_state_layer_ids"]
        if ids is None:  # vLLM's and speculators' default: an early, a middle and a late layer
            n = target.num_layers
            ids = [2, n // 2, n - 3]
        taps = translate_layer_ids(ids, target, "eagle_aux_hidden_state_layer_ids", source)
        del flags["embed_requires_grad"]
        return DrafterSpec(layer=layer, taps=taps, block=_chain_block(proposal, block, source),
                           draft_vocab=draft_vocab, **flags, **common)
    # the dflash family
    bs = _int(source, values, "block_size", 1, MAX_BLOCK)
    anchor = _bool(source, values, "sample_from_anchor")
    _bool(source, values, "sliding_window_non_causal")
    natural = bs if anchor else bs - 1
    if natural < 1:
        raise ConfigError(f"{source}: field 'block_size' = {bs}: expected at least 2 with sample_from_anchor false "
                          "(the anchor slot drafts nothing)")
    mask = values["mask_token_id"]
    if not is_int(mask) or not 0 <= mask < target.vocab_size:
        raise _bad(source, "mask_token_id", mask, f"a token id below the target's vocabulary {target.vocab_size}")
    ids = values["aux_hidden_state_layer_ids"]
    if ids is None:
        raise ConfigError(f"{source}: missing field 'aux_hidden_state_layer_ids': expected the target layer ids the "
                          "drafter reads")
    taps = translate_layer_ids(ids, target, "aux_hidden_state_layer_ids", source)
    spec = dict(layer=layer, taps=taps, block=_block_block(proposal, block, natural, source), draft_vocab=draft_vocab,
                block_size=bs, mask_token_id=mask, sample_from_anchor=anchor, **common)
    if kind == "dflash2":
        if draft_vocab != target.vocab_size:
            raise ConfigError(f"{source}: field 'draft_vocab_size' = {draft_vocab}: expected the target's vocabulary "
                              f"{target.vocab_size} (speculators' dflash2 requires the full vocabulary)")
        kernel = _int(source, values, "conv_kernel_size", 1, bs)
        group = _int(source, values, "conv_group_size", 1, layer.hidden_size)
        if layer.hidden_size % group:
            raise ConfigError(f"{source}: field 'conv_group_size' = {group}: expected a divisor of the hidden size "
                              f"{layer.hidden_size}")
        spec.update(conv_kernel=kernel, conv_group=group,
                    selector_rank=_int(source, values, "selector_rank", 1, 1 << 16),
                    selector_top_k=_int(source, values, "selector_top_k", 1, target.vocab_size))
    if kind == "dspark":
        rank = _int(source, values, "markov_rank", 0, 1 << 16)
        head = values["markov_head_type"]
        if head not in MARKOV_HEADS:
            raise _bad(source, "markov_head_type", head, f"one of {', '.join(MARKOV_HEADS)}")
        conf, with_markov = _bool(source, values, "enable_confidence_head"), \
            _bool(source, values, "confidence_head_with_markov")
        if conf and with_markov and not rank:
            raise ConfigError(f"{source}: field 'confidence_head_with_markov' = true with markov_rank 0: expected "
                              "false (there is no Markov embedding to feed it)")
        spec.update(markov_rank=rank, markov_head=head if rank else "",
                    confidence_head=(layer.hidden_size + (rank if with_markov else 0)) if conf else 0)
    return DrafterSpec(**spec)


def translate_layer_ids(ids: Any, target: ModelConfig, field: str, source: str) -> tuple[int, ...]:
    """speculators / vLLM layer ids -> tpumk taps (the module doc): id i < num_layers is tap i;
    id num_layers (the residual stream before the final norm) is refused; anything else, or a
    repeated id, is an error naming the field."""
    n = target.num_layers
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        raise _bad(source, field, ids, "a non-empty list of target layer ids")
    if n in ids:
        raise NotSupportedError(f"{source}: not supported: {field} includes {n}, the target's residual stream after "
                                f"its last layer before the final norm (speculators' and vLLM's id {n}); tpumk taps "
                                f"the final norm's output there")
    bad = [i for i in ids if not 0 <= i < n]
    if bad or len(set(ids)) != len(ids):
        raise _bad(source, field, ids, f"distinct layer ids from 0 to {n - 1} (the target has {n} layers)")
    return tuple(ids)


def _dtype(data: dict[str, Any], source: str) -> str:
    t, d = data.get("torch_dtype"), data.get("dtype")
    if t is not None and d is not None and t != d:
        raise ConfigError(f"{source}: fields 'torch_dtype' = {shown(t)} and 'dtype' = {shown(d)} disagree")
    v = d if d is not None else t if t is not None else "bfloat16"
    name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}.get(v) if isinstance(v, str) else None
    if name is None:
        raise NotSupportedError(f"{source}: not supported yet: dtype {shown(v)} (expected one of {', '.join(DTYPES)})")
    return name


def _proposal(sc: Any, kind: str, source: str) -> int | None:
    """The default proposal method's speculative_tokens (None without a speculators_config)."""
    if sc is None:
        return None
    where = f"{source}: speculators_config"
    if not isinstance(sc, dict):
        raise ConfigError(f"{source}: field 'speculators_config' = {shown(sc)}: expected an object or null")
    unknown = [k for k in sc if k not in SPECULATORS_CONFIG_FIELDS]
    if unknown:
        raise NotSupportedError(f"{where}: not supported: field {unknown[0]!r} is not a field of a speculators_config")
    missing = [k for k in SPECULATORS_CONFIG_FIELDS if k not in sc]
    if missing:
        raise ConfigError(f"{where}: missing field '{missing[0]}'")
    if sc["algorithm"] != kind:
        raise ConfigError(f"{where}: field 'algorithm' = {shown(sc['algorithm'])}: expected {kind!r} (the "
                          "speculators_model_type)")
    verifier = sc["verifier"]
    if not isinstance(verifier, dict):
        raise ConfigError(f"{where}: field 'verifier' = {shown(verifier)}: expected an object")
    account_fields(verifier, kind, f"{where}.verifier", VERIFIER_FIELDS)
    methods = sc["proposal_methods"]
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) for m in methods):
        raise ConfigError(f"{where}: field 'proposal_methods' = {shown(methods)}: expected a non-empty list of objects")
    tokens = {}
    for i, m in enumerate(methods):
        at = f"{where}.proposal_methods[{i}]"
        account_fields(m, kind, at, PROPOSAL_FIELDS)
        if m.get("proposal_type") != "greedy":
            raise NotSupportedError(f"{at}: not supported: proposal_type {shown(m.get('proposal_type'))} (speculators "
                                    "0.9.0 defines 'greedy', one chain of speculative_tokens drafts)")
        values = {**PROPOSAL_DEFAULTS, **m}
        tokens[m["proposal_type"]] = _int(at, values, "speculative_tokens", 1, MAX_BLOCK)
    default = sc["default_proposal_method"]
    if default not in tokens:
        raise ConfigError(f"{where}: field 'default_proposal_method' = {shown(default)}: expected the "
                          f"proposal_type of one of proposal_methods ({', '.join(tokens)})")
    return tokens[default]


def _chain_block(proposal: int | None, block: int | None, source: str) -> int:
    k = block if block is not None else proposal
    if k is None:
        raise ConfigError(f"{source}: no speculators_config: the chain length (drafts per round) must be given")
    if not is_int(k) or not 1 <= k <= MAX_BLOCK:
        raise ConfigError(f"{source}: drafts per round {shown(k)}: expected 1 to {MAX_BLOCK}")
    return k


def _block_block(proposal: int | None, block: int | None, natural: int, source: str) -> int:
    """Drafts per round of a block drafter: its block's drafting slots, or fewer."""
    if proposal is not None and proposal > natural:
        raise ConfigError(f"{source}: speculators_config's speculative_tokens {proposal} exceed the {natural} "
                          "drafts one block holds (block_size, sample_from_anchor)")
    k = block if block is not None else (proposal or natural)
    if not is_int(k) or not 1 <= k <= natural:
        raise ConfigError(f"{source}: drafts per round {shown(k)}: expected 1 to {natural} (the drafting slots of a "
                          "block of block_size)")
    return k


def _layer(data: dict[str, Any], kind: str, source: str, dtype: str, target: ModelConfig) -> ModelConfig:
    """transformer_layer_config as a tpumk ModelConfig (every field accounted for by from_hf_config),
    checked for what the kind's definition builds and against the target."""
    tl = data.get("transformer_layer_config")
    where = f"{source}: transformer_layer_config"
    if tl is None:
        tl = {}
    if not isinstance(tl, dict):
        raise ConfigError(f"{source}: field 'transformer_layer_config' = {shown(tl)}: expected an object")
    mt = tl.get("model_type", DEFAULT_LAYER_TYPE[kind])
    if mt not in LAYER_TYPES[kind]:
        raise NotSupportedError(f"{where}: not supported yet: model_type {shown(mt)} for a {kind} drafter (tpumk "
                                f"builds {kind}'s layers on {', '.join(LAYER_TYPES[kind])})")
    tl = {k: v for k, v in tl.items() if k not in ("dtype", "torch_dtype")}  # the weights' dtype is the file's
    layer = from_hf_config({**tl, "model_type": mt, "dtype": dtype}, where)
    if layer.sliding_layers:
        raise NotSupportedError(f"{where}: not supported yet: sliding-window draft layers (layer_types / "
                                "use_sliding_window)")
    if layer.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: field 'hidden_size' = {layer.hidden_size}: expected the target's hidden size "
                          f"{target.hidden_size}")
    if layer.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: field 'vocab_size' = {layer.vocab_size}: expected the target's vocabulary "
                          f"{target.vocab_size}")
    if kind == "mtp":  # the verifier's own config: its depth names the hidden state the head reads
        if layer.num_layers != target.num_layers:
            raise ConfigError(f"{where}: field 'num_hidden_layers' = {layer.num_layers}: expected the target's "
                              f"{target.num_layers} layers (an mtp head reads the target's last hidden state)")
        layer = layer.replace(num_layers=1)
    return layer.replace(name=f"{kind}-draft")
