"""The drafter interface the device loop uses (`Drafter`), and where drafters come from: a
speculators directory or a target checkpoint's own next-token layer (`load_drafter`), or random
weights of a given shape (`random_drafter`).

Every function of a Drafter is pure JAX with static shapes (jittable, runs inside
lax.fori_loop). A drafter keeps its own cache indexed by token position plus each sequence's
committed length in its state; `absorb` commits the valid rows of a target step (a prefill chunk
or a verify step: the valid rows form a prefix of the step and continue each sequence at its
committed length), `propose` drafts `block` tokens after the anchor (the newest token, at
anchor_pos = the committed length, not yet run by the target). Rows a proposal writes past the
committed length are overwritten by the next absorb, so rolling back a rejected draft needs
nothing.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.draft import block as block_drafter
from tpumk.draft import chain as chain_drafter
from tpumk.draft.config import CHAIN_KINDS, KINDS, MARKOV_HEADS, MAX_BLOCK, DrafterSpec, read_config
from tpumk.draft.weights import abstract_params, random_params, read_speculators
from tpumk.errors import CheckpointError, ConfigError, NotSupportedError
from tpumk.files import TEXT_LIMIT, name_problem, read_regular
from tpumk.files import shown as path_shown
from tpumk.model.checkpoint import load_layer, open_tensors
from tpumk.model.config import DTYPES, ModelConfig, hf_text_config, load_hf_model
from tpumk.model.hf_fields import shown
from tpumk.model.reference import Params, check_taps
from tpumk.tomlfile import parser_refusal


class Drafter:
    """A drafter: `spec` (DrafterSpec: kind, taps, block, shapes) and `params` (its own weights).

    init_state(batch, context) -> state
    absorb(params, target_params, state, hidden [B, q, T, H], tokens [B, q], positions [B, q],
           valid [B, q]) -> state
    propose(params, target_params, state, anchor [B], anchor_pos [B], key, temperature)
        -> (drafts [B, block] int32, q_probs [B, block, V] float32, state)
    logits(params, target_params, state, anchor, anchor_pos, tokens [B, block]) -> [B, block, Vd]
        the logits each draft is picked from (draft vocabulary) when the drafts are `tokens`
        (target ids): propose's greedy drafts are their argmax mapped through d2t."""

    def __init__(self, spec: DrafterSpec, params: Params):
        self.spec, self.params = spec, params
        self._impl = chain_drafter if spec.kind in CHAIN_KINDS else block_drafter

    kind = property(lambda self: self.spec.kind)
    taps = property(lambda self: self.spec.taps)
    block = property(lambda self: self.spec.block)

    def __repr__(self) -> str:
        return f"Drafter({self.kind}, taps {list(self.taps)}, block {self.block}, {self.spec.layer.num_layers} layers)"

    def init_state(self, batch: int, context: int) -> dict:
        return self._impl.init_state(self.spec, batch, context)

    def absorb(self, params: Params, target_params: Params, state: dict, hidden: jax.Array, tokens: jax.Array,
               positions: jax.Array, valid: jax.Array) -> dict:
        want = (len(self.taps), self.spec.hidden)
        if tuple(hidden.shape[-2:]) != want or hidden.shape[:2] != tokens.shape:
            raise ValueError(f"{self.kind} drafter: hidden {list(hidden.shape)} for tokens {list(tokens.shape)}: "
                             f"expected [B, q, {want[0]}, {want[1]}] (its taps {list(self.taps)})")
        return self._impl.absorb(self.spec, params, target_params, state, hidden, tokens.astype(jnp.int32),
                                 positions.astype(jnp.int32), valid.astype(bool))

    def propose(self, params: Params, target_params: Params, state: dict, anchor: jax.Array, anchor_pos: jax.Array,
                key=None, temperature=1.0):
        return self._impl.propose(self.spec, params, target_params, state, anchor.astype(jnp.int32),
                                  anchor_pos.astype(jnp.int32), key, temperature)

    def logits(self, params: Params, target_params: Params, state: dict, anchor: jax.Array, anchor_pos: jax.Array,
               tokens: jax.Array) -> jax.Array:
        return self._impl.logits(self.spec, params, target_params, state, anchor.astype(jnp.int32),
                                 anchor_pos.astype(jnp.int32), tokens.astype(jnp.int32))


# ---------------------------------------------------------------------- loading
def load_drafter(source: str | Path, target: ModelConfig, *, checkpoint: str | Path | None = None,
                 block: int | None = None, dtype: str | None = None, target_params: Params | None = None,
                 use_speculators: bool | None = None) -> Drafter:
    """A drafter for `target`: a speculators directory (config.json + safetensors), or "mtp" with
    `checkpoint` (the target's Hugging Face checkpoint directory: its next-token layer).

    `block`: drafts per round (default: the config's; an MTP layer's, 1). `dtype`: the draft
    weights' (default: the config's). `target_params` (optional): an EAGLE-3 checkpoint's own
    embedding that equals the target's is dropped and the target's read instead. Bad input is one
    line naming the file and field (ConfigError, NotSupportedError, CheckpointError)."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"drafter dtype {shown(dtype)}: expected one of {', '.join(DTYPES)}")
    if str(source) == "mtp":
        if checkpoint is None:
            raise ConfigError("drafter 'mtp': give the target's checkpoint directory (its next-token layer)")
        return _checkpoint_mtp(Path(checkpoint), target, block, dtype)
    d = Path(source)
    spec = read_drafter_spec(d, target, block=block, dtype=dtype, use_speculators=use_speculators)
    if spec.kind == "eagle3":
        with ExitStack() as stack:
            own = "embed_tokens.weight" in open_tensors(d, stack)
        spec = _replace(spec, own_embed=own)
    params = read_speculators(d, spec)
    if spec.own_embed and target_params is not None \
            and np.array_equal(np.asarray(params["embed"]), np.asarray(target_params["embed"])):
        spec = _replace(spec, own_embed=False)
        params = {k: v for k, v in params.items() if k != "embed"}
    return Drafter(spec, params)


def read_drafter_spec(d: Path, target: ModelConfig, *, block: int | None = None, dtype: str | None = None,
                      use_speculators: bool | None = None) -> DrafterSpec:
    """The DrafterSpec a speculators directory's config.json describes, its weights not read (a
    plan or the round's model needs only the shapes). Bad input: one line (as load_drafter)."""
    if name_problem(d) or not d.is_dir():
        raise CheckpointError(f"{path_shown(d)}: expected a drafter directory (config.json and *.safetensors)")
    path = d / "config.json"
    raw = read_regular(path, TEXT_LIMIT, "expected a drafter's config.json", CheckpointError)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected a config.json)") from None
    except (ValueError, RecursionError) as e:
        raise parser_refusal(str(path), "JSON", "arrays or objects", e) from None
    return read_config(data, str(path), target, block, dtype, use_speculators)


def _replace(spec: DrafterSpec, **changes: Any) -> DrafterSpec:
    import dataclasses

    return dataclasses.replace(spec, **changes)


# The tensors of a DeepSeek-V3 (GLM-4.5) next-token layer besides its decoder layer's
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the target's embedding and head


def mtp_layer_config(target: ModelConfig, source: str = "the target") -> ModelConfig:
    """A one-layer copy of `target`'s config describing its next-token layer (a decoder layer of
    the target's kind stored at index num_layers: experts when the target routes its later layers)."""
    if target.linear_layers or target.sliding_layers or target.nope_layers:
        raise NotSupportedError(f"{source}: not supported yet: a next-token layer of a model with linear-attention, "
                                "sliding-window or NoPE layers")
    n_dense = len(target.dense_layers)
    if target.is_moe and n_dense >= target.num_layers:
        raise NotSupportedError(f"{source}: not supported: a mixture-of-experts model whose layers are all dense "
                                "(is its next-token layer dense?)")
    return target.replace(name=f"{target.name}-mtp", num_layers=1, dense_layers=())


def _checkpoint_mtp(d: Path, target: ModelConfig, block: int | None, dtype: str | None) -> Drafter:
    cfg, _ = load_hf_model(d)
    where = f"{d / 'config.json'}"
    raw = hf_text_config(json.loads(read_regular(d / "config.json")))[0]
    n = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers"))
    if not n:
        raise NotSupportedError(f"{where}: not supported: no next-token layer (num_nextn_predict_layers "
                                f"{shown(n)}): expected a DeepSeek-V3-style checkpoint with one")
    if n != 1:
        raise NotSupportedError(f"{where}: not supported yet: num_nextn_predict_layers = {shown(n)} (tpumk chains "
                                "one next-token layer)")
    for f in ("num_layers", "hidden_size", "vocab_size", "num_q_heads", "kv_lora_rank", "num_experts"):
        if getattr(cfg, f) != getattr(target, f):
            raise ConfigError(f"{where}: {f} {getattr(cfg, f)}: expected the target's {getattr(target, f)} (the "
                              "next-token layer of another model?)")
    k = 1 if block is None else block
    if not isinstance(k, int) or not 1 <= k <= MAX_BLOCK:
        raise ConfigError(f"drafter 'mtp': drafts per round {shown(k)}: expected 1 to {MAX_BLOCK}")
    layer = mtp_layer_config(target.replace(dtype=dtype or target.dtype), where)
    spec = DrafterSpec(kind="mtp", layer=layer, taps=(target.num_layers,), block=k, vocab=target.vocab_size,
                       draft_vocab=target.vocab_size, mtp_source="checkpoint")
    lay, own = load_layer(d, layer, target.num_layers, MTP_OWN, MTP_SHARED, dtype=layer.dtype)
    h, dt = target.hidden_size, np.dtype(jnp.bfloat16) if layer.dtype == "bfloat16" else np.dtype(np.float32)
    for name, shape in zip(MTP_OWN, ((h,), (h,), (h, 2 * h), (h,))):
        if tuple(own[name].shape) != shape:
            raise CheckpointError(f"{d}: tensor 'model.layers.{target.num_layers}.{name}' has shape "
                                  f"{list(own[name].shape)}, expected {list(shape)}")
    params = {"enorm": own["enorm.weight"], "hnorm": own["hnorm.weight"], "eh_proj": own["eh_proj.weight"].T,
              "norm": own["shared_head.norm.weight"]}
    params = {k_: jnp.asarray(np.asarray(v, dt)) for k_, v in params.items()}
    params["layer"] = lay
    return Drafter(spec, params)


# ---------------------------------------------------------------------- random drafters
def spread(num_layers: int, n: int) -> tuple[int, ...]:
    """n taps spread over a target's layers 1 .. num_layers - 1 (distinct; fewer when it is shallow)."""
    return tuple(sorted({1 + (i * (num_layers - 1)) // n for i in range(n)} - {num_layers}))


def random_drafter(kind: str, target: ModelConfig, seed: int = 0, *, abstract: bool = False, layers: int = 1,
                   heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
                   ffn: int | None = None, taps: tuple[int, ...] | None = None, block: int | None = None,
                   block_size: int = 8, draft_vocab: int | None = None, dtype: str | None = None,
                   sample_from_anchor: bool | None = None, markov_rank: int = 256, markov_head: str = "vanilla",
                   conv_kernel: int = 2, conv_group: int = 16, selector_rank: int = 256, selector_top_k: int = 16,
                   rope_theta: float = 1_000_000.0, **flags: bool) -> Drafter:
    """A drafter of `kind` for `target` with random weights (tests, timing).

    Shape: `layers` draft decoder layers of `heads` query / `kv_heads` KV heads of `head_dim`
    and an MLP of `ffn` (defaults: the target's attention layout; ffn the target's, or 3 x hidden
    for one without a dense MLP), reading `taps` (tpumk's numbering; default 3 spread taps for
    eagle3, 5 for the dflash family), `block` drafts per round, a DFlash block of `block_size`,
    a reduced `draft_vocab`, and each kind's own sizes. An mtp drafter is a next-token layer of the
    target's own kind. `abstract`: params are jax.ShapeDtypeStruct (nothing allocated), e.g. the
    published Kimi K2 DSpark: random_drafter("dspark", kimi_k2, layers=5, heads=96, kv_heads=16,
    head_dim=64, ffn=14336, taps=five taps, block_size=8, abstract=True). `flags`: eagle3's
    norm_before_residual / norm_before_fc / fc_norm / norm_output / own_embed."""
    if kind not in KINDS:
        raise ConfigError(f"drafter kind {shown(kind)}: expected one of {', '.join(KINDS)}")
    dt = dtype or target.dtype
    vocab = target.vocab_size
    dv = draft_vocab or vocab
    if not 1 <= dv <= vocab:
        raise ConfigError(f"draft_vocab {dv}: expected 1 to the target's vocabulary {vocab}")
    if kind == "mtp":
        spec = DrafterSpec(kind=kind, layer=mtp_layer_config(target.replace(dtype=dt)), taps=(target.num_layers,),
                           block=block or 1, vocab=vocab, draft_vocab=vocab, mtp_source="checkpoint")
    else:
        layer = ModelConfig(name=f"{kind}-draft", num_layers=layers, hidden_size=target.hidden_size,
                            num_q_heads=heads or target.num_q_heads, num_kv_heads=kv_heads or target.num_kv_heads,
                            head_dim=head_dim or target.head_dim, vocab_size=vocab,
                            ffn_size=ffn or target.ffn_size or 3 * target.hidden_size, rms_eps=target.rms_eps,
                            rope_theta=rope_theta, qk_norm=True, dtype=dt)
        tp = check_taps(target, taps if taps is not None else spread(target.num_layers, 3 if kind == "eagle3" else 5))
        if kind == "eagle3":
            spec = DrafterSpec(kind=kind, layer=layer, taps=tp, block=block or 3, vocab=vocab, draft_vocab=dv,
                               **flags)
        else:
            anchor = (kind == "dspark") if sample_from_anchor is None else sample_from_anchor
            natural = block_size if anchor else block_size - 1
            if not 1 <= natural <= MAX_BLOCK:
                lo = 1 if anchor else 2
                raise ConfigError(f"block_size {block_size}: expected {lo} to {MAX_BLOCK + lo - 1} ({kind} drafts "
                                  f"{'every slot' if anchor else 'block_size - 1 slots'}, at most {MAX_BLOCK} a round)")
            if not 1 <= (block or natural) <= natural:
                raise ConfigError(f"block {block} of a block_size {block_size}: expected 1 to {natural}")
            extra: dict[str, Any] = {}
            if kind == "dflash2":
                extra = dict(conv_kernel=conv_kernel, conv_group=conv_group, selector_rank=selector_rank,
                             selector_top_k=selector_top_k)
            if kind == "dspark":
                if markov_head not in MARKOV_HEADS:
                    raise ConfigError(f"markov_head {shown(markov_head)}: expected one of {', '.join(MARKOV_HEADS)}")
                extra = dict(markov_rank=markov_rank, markov_head=markov_head if markov_rank else "")
            spec = DrafterSpec(kind=kind, layer=layer, taps=tp, block=block or natural, vocab=vocab, draft_vocab=dv,
                               block_size=block_size, mask_token_id=vocab - 1, sample_from_anchor=anchor, **extra)
    params = abstract_params(spec) if abstract else random_params(spec, seed)
    return Drafter(spec, params)


__all__ = ["Drafter", "load_drafter", "read_drafter_spec", "random_drafter"]
