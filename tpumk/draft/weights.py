"""A drafter's weights: their shapes (`param_shapes`), random ones (`random_params`), and the
tensors of a speculators checkpoint (or of a target checkpoint's MTP layer) read into them.

Layout (matrices `[in, out]`, as tpumk.model.reference; the draft layers' own tensors are the
reference layer layout of `spec.layer`, tpumk.model.weights.expected_shapes):

    eagle3   fc [T*H, H]; fc_norm [T, H] (fc_norm) or input_norm [T*H] (norm_before_fc);
             layers[0]: hidden_norm [H], wq / wk / wv over 2H inputs; norm [H]; lm_head [H, Vd];
             embed [V, H] (the checkpoint's embed_tokens, when it has one)
    dflash*  fc [T*H, H]; hidden_norm [H]; layers; norm [H]; lm_head [H, Vd] (reduced vocabulary
             only: a full one uses the target's head); dflash2: layers[i] attn_conv_base /
             mlp_conv_base [2, K, H], attn_conv_proj / mlp_conv_proj [H, 2*K*G]; sel_pred,
             sel_succ [V, r], sel_hidden [H, r]; dspark: markov_w1 [V, r], markov_w2 [r, Vd],
             gated: markov_gate [H + r, r], markov_gate_bias [r]; rnn: markov_joint [2r + H, 3r],
             markov_joint_bias [3r]
    mtp      enorm, hnorm [H]; eh_proj [2H, H]; layer (one decoder layer of spec.layer); norm [H]
    d2t      [Vd] int32: the target id of each draft id (a reduced vocabulary only)

The target's embedding and head are never copied in: the functions take `target_params`.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.draft.config import BLOCK_KINDS, DrafterSpec
from tpumk.errors import CheckpointError, and_more
from tpumk.model.checkpoint import open_tensors
from tpumk.model.ops import jnp_dtype
from tpumk.model.reference import Params
from tpumk.model.weights import FLOAT32_TENSORS, expected_shapes

# speculators' names of a Qwen3 / Llama decoder layer's tensors -> the reference layout's
LAYER_NAMES = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
               "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
               "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
               "self_attn.v_proj.bias": "bv", "self_attn.o_proj.bias": "bo", "self_attn.q_norm.weight": "q_norm",
               "self_attn.k_norm.weight": "k_norm", "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
               "mlp.down_proj.weight": "w_down",
               # eagle3's first layer and dflash2's convolutions
               "hidden_norm.weight": "hidden_norm", "attention_conv.base_kernel": "attn_conv_base",
               "attention_conv.kernel_projection.weight": "attn_conv_proj", "mlp_conv.base_kernel": "mlp_conv_base",
               "mlp_conv.kernel_projection.weight": "mlp_conv_proj"}
TOP_NAMES = {"fc.weight": "fc", "input_norm.weight": "input_norm", "hidden_norm.weight": "hidden_norm",
             "norm.weight": "norm", "lm_head.weight": "lm_head", "embed_tokens.weight": "embed",
             "candidate_selector.predecessor_codebook": "sel_pred", "candidate_selector.successor_codebook": "sel_succ",
             "candidate_selector.hidden_projection.weight": "sel_hidden", "markov_head.markov_w1.weight": "markov_w1",
             "markov_head.markov_w2.weight": "markov_w2", "markov_head.gate_proj.weight": "markov_gate",
             "markov_head.gate_proj.bias": "markov_gate_bias", "markov_head.joint_proj.weight": "markov_joint",
             "markov_head.joint_proj.bias": "markov_joint_bias"}
MTP_NAMES = {"token_layernorm.weight": "enorm", "hidden_layernorm.weight": "hnorm", "input_proj.weight": "eh_proj",
             "final_layernorm.weight": "norm"}
# Stored as they are (no transpose): not a Linear's weight
_AS_STORED = ("attn_conv_base", "mlp_conv_base", "sel_pred", "sel_succ", "markov_w1", "embed")
# Tensors speculators keeps only for training (the frozen target head and norm of its loss)
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")


def param_shapes(spec: DrafterSpec) -> Params:
    """The shape of every weight of the drafter (`d2t` int32), as the nested structure its params have."""
    h, t, v, vd = spec.hidden, len(spec.taps), spec.vocab, spec.draft_vocab
    layers = expected_shapes(spec.layer)["layers"]
    if spec.kind == "mtp":
        return {"enorm": (h,), "hnorm": (h,), "eh_proj": (2 * h, h), "layer": layers[0], "norm": (h,)}
    out: Params = {"fc": (t * h, h), "layers": layers, "norm": (h,)}
    if spec.kind == "eagle3":
        first = dict(layers[0])
        for w in ("wq", "wk", "wv"):
            first[w] = (2 * h, first[w][1])
        first["hidden_norm"] = (h,)
        out["layers"] = [first] + layers[1:]
        out["lm_head"] = (h, vd)
        if spec.fc_norm:
            out["fc_norm"] = (t, h)
        if spec.norm_before_fc:
            out["input_norm"] = (t * h,)
        if spec.own_embed:
            out["embed"] = (v, h)
    else:
        out["hidden_norm"] = (h,)
        if vd < v:
            out["lm_head"] = (h, vd)
    if spec.kind == "dflash2":
        k, g, r = spec.conv_kernel, h // spec.conv_group, spec.selector_rank
        out["layers"] = [{**lay, "attn_conv_base": (2, k, h), "attn_conv_proj": (h, 2 * k * g),
                          "mlp_conv_base": (2, k, h), "mlp_conv_proj": (h, 2 * k * g)} for lay in out["layers"]]
        out.update(sel_pred=(v, r), sel_succ=(v, r), sel_hidden=(h, r))
    if spec.kind == "dspark" and spec.markov_rank:
        r = spec.markov_rank
        out.update(markov_w1=(v, r), markov_w2=(r, vd))
        if spec.markov_head == "gated":
            out.update(markov_gate=(h + r, r), markov_gate_bias=(r,))
        if spec.markov_head == "rnn":
            out.update(markov_joint=(2 * r + h, 3 * r), markov_joint_bias=(3 * r,))
    if vd < v:
        out["d2t"] = (vd,)
    return out


def _dtype_of(spec: DrafterSpec, name: str):
    if name == "d2t":
        return jnp.int32
    if spec.layer.moe.router_correction_bias and name in FLOAT32_TENSORS:  # as tpumk.model.weights keeps them
        return jnp.float32
    return jnp_dtype(spec.layer)


def _map(shapes, fn, path: tuple = ()):
    """fn(name, shape) over the leaves of a nested shapes structure (dicts and lists)."""
    if isinstance(shapes, dict):
        return {k: _map(v, fn, path + (k,)) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_map(v, fn, path) for v in shapes]
    return fn(path[-1], shapes)


def abstract_params(spec: DrafterSpec) -> Params:
    """The params' shapes and dtypes as jax.ShapeDtypeStruct (nothing allocated)."""
    return _map(param_shapes(spec), lambda name, shape: jax.ShapeDtypeStruct(shape, _dtype_of(spec, name)))


def random_params(spec: DrafterSpec, seed: int = 0) -> Params:
    """Deterministic random weights of `spec`'s shapes (numpy's generator: no device program per
    shape). As tpumk.model.weights: matrices N(0, 1 / fan_in), norms 1 + N(0, 0.01), output
    projections scaled down with depth, the router scaled up; DFlash2's base kernels the identity
    tap plus noise; a reduced vocabulary keeps every vocab / draft_vocab-th target id."""
    rng = np.random.default_rng(seed)
    depth = 1.0 / np.sqrt(2.0 * max(spec.layer.num_layers, 1))

    def make(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name == "d2t":
            return jnp.asarray(np.arange(shape[0]) * (spec.vocab // shape[0]), jnp.int32)
        n = rng.standard_normal(shape, np.float32)
        if name.endswith("norm"):
            w = 1.0 + 0.1 * n
        elif name.endswith("_conv_base"):  # near the identity tap, as speculators initialises it
            w = 0.1 * n
            w[:, 0] += 1.0
        elif name == "router_bias":
            w = 0.1 * n
        elif name.endswith("bias") or name in ("bq", "bk", "bv", "embed", "sel_pred", "sel_succ", "markov_w1"):
            w = n
        elif name == "bo":
            w = n * depth
        else:
            w = n / np.sqrt(shape[-2])
            if name in ("wo", "w_down", "e_down", "s_down"):
                w = w * depth
            if name == "router":
                w = w * 4.0
        return jnp.asarray(w, _dtype_of(spec, name))

    return _map(param_shapes(spec), make)


class _Reader:
    """A safetensors directory's tensors, each taken at most once and checked for its shape;
    `finish` refuses any left over."""

    def __init__(self, d: Path, tensors: dict[str, Any], dtype):
        self.d, self.tensors, self.dtype, self.used = d, tensors, np.dtype(dtype), set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _get(self, name: str, shape: tuple[int, ...]):
        if name not in self.tensors:
            raise CheckpointError(f"{self.d}: missing tensor '{name}'")
        t = self.tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{t.file}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        self.used.add(name)
        return t

    def float(self, name: str, key: str, ref_shape: tuple[int, ...]) -> jax.Array:
        """A float tensor into the reference layout's `key` of shape ref_shape (a Linear's
        [out, in] weight transposed)."""
        transpose = len(ref_shape) == 2 and key not in _AS_STORED
        t = self._get(name, tuple(reversed(ref_shape)) if transpose else ref_shape)
        a = t.read()
        return jnp.asarray(np.asarray(a.T if transpose else a, self.dtype))

    def skip(self, name: str, shape: tuple[int, ...] | None = None) -> None:
        """An optional tensor speculators does not use at inference: shape-checked, not read."""
        if name in self.tensors:
            self._get(name, shape if shape is not None else tuple(self.tensors[name].shape))

    def finish(self) -> None:
        left = sorted(set(self.tensors) - self.used)
        if left:
            t = self.tensors[left[0]]
            raise CheckpointError(f"{t.file}: unexpected tensor '{left[0]}'{and_more(left)} (not part of the drafter "
                                  "its config.json describes)")


def _layer_tensors(r: _Reader, prefix: str, shapes: dict) -> Params:
    names = {v: k for k, v in LAYER_NAMES.items()}
    return {key: r.float(prefix + names[key], key, s) for key, s in shapes.items()}


def read_speculators(d: Path, spec: DrafterSpec) -> Params:
    """The drafter's weights from its directory's safetensors (speculators' names), cast to the
    layer config's dtype; every tensor accounted for (used, or one speculators replaces or keeps
    for training only: shape-checked), d2t / t2d checked against each other."""
    shapes = param_shapes(spec)
    h, v = spec.hidden, spec.vocab
    with ExitStack() as stack:
        r = _Reader(d, open_tensors(d, stack), jnp_dtype(spec.layer))
        for name in TRAINING_ONLY:
            r.skip(name, (spec.draft_vocab, h) if name.startswith("verifier_lm") else (h,))
        if spec.kind == "mtp":
            params = {key: r.float(f"mtp_layers.0.{name}", key, shapes[key]) for name, key in MTP_NAMES.items()}
            params["layer"] = _layer_tensors(r, "mtp_layers.0.", shapes["layer"])
            r.finish()
            return params
        top = {key: name for name, key in TOP_NAMES.items()}
        params = {key: r.float(top[key], key, s) for key, s in shapes.items() if key not in ("layers", "d2t", "fc_norm")}
        if spec.fc_norm:
            params["fc_norm"] = jnp.stack([r.float(f"fc_norm.{i}.weight", "fc_norm", (h,)) for i in range(len(spec.taps))])
        params["layers"] = [_layer_tensors(r, f"layers.{i}.", s) for i, s in enumerate(shapes["layers"])]
        if spec.kind in BLOCK_KINDS:  # speculators replaces these with the target's
            r.skip("embed_tokens.weight", (v, h))
            if spec.draft_vocab == v:
                r.skip("lm_head.weight", (v, h))
        if spec.confidence_head:
            r.skip("confidence_head.proj.weight", (1, spec.confidence_head))
            r.skip("confidence_head.proj.bias", (1,))
        if spec.draft_vocab < v:
            params["d2t"] = _vocab_map(r, spec)
        else:
            _identity_map(r, spec)
        r.finish()
    return params


def _vocab_map(r: _Reader, spec: DrafterSpec) -> jax.Array:
    """d2t (speculators stores target id - draft id) as absolute target ids, checked against t2d."""
    vd, v = spec.draft_vocab, spec.vocab
    d2t = np.asarray(r._get("d2t", (vd,)).read_ints(), np.int64)
    t2d = np.asarray(r._get("t2d", (v,)).read_ints(), bool)
    ids = np.arange(vd) + d2t
    where = r.tensors["d2t"].file
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != vd:
        raise CheckpointError(f"{where}: tensor 'd2t' maps draft ids to target ids outside [0, {v}) or to one id "
                              "twice: expected distinct target ids (draft id + d2t)")
    if int(t2d.sum()) != vd or not t2d[ids].all():
        raise CheckpointError(f"{where}: tensors 'd2t' and 't2d' disagree: expected t2d true at exactly the "
                              f"{vd} target ids d2t maps to")
    return jnp.asarray(ids, jnp.int32)


def _identity_map(r: _Reader, spec: DrafterSpec) -> None:
    """A full-vocabulary drafter's d2t / t2d, when present, must map each id to itself (speculators
    ignores them then)."""
    v = spec.vocab
    if r.has("d2t"):
        if np.any(np.asarray(r._get("d2t", (v,)).read_ints()) != 0):
            raise CheckpointError(f"{r.tensors['d2t'].file}: tensor 'd2t' of a full-vocabulary drafter maps ids to "
                                  "others: expected zeros (draft id = target id)")
    if r.has("t2d"):
        if not np.all(np.asarray(r._get("t2d", (v,)).read_ints())):
            raise CheckpointError(f"{r.tensors['t2d'].file}: tensor 't2d' of a full-vocabulary drafter leaves ids out")


# ---------------------------------------------------------------------- weights as named arrays
# What a drafter's weights are called outside a Params tree (an artifact's drafter.safetensors):
# the tree path joined with dots, 'layers.0.wq'; the content hash covers these names, dtypes,
# shapes and bytes, so the same weights give the same hash however they were read.
_DTYPE_TAGS = {"BF16": jnp.bfloat16, "F16": np.float16, "F32": np.float32, "I32": np.int32}


def _named_leaves(tree) -> list[tuple[str, Any]]:
    """(dotted path, leaf) of a Params tree (or of its ShapeDtypeStructs), in tree order."""
    return [(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def named_arrays(params: Params) -> dict[str, np.ndarray]:
    """{dotted path: host array} of a drafter's weights, in tree order."""
    return {name: np.asarray(leaf) for name, leaf in _named_leaves(params)}


def weights_sha256(params: Params) -> str:
    """The content hash of a drafter's weights: sha256 over every weight's name, dtype, shape and
    bytes, sorted by name (what a cache key and a manifest record of a drafter read from files)."""
    import hashlib

    h = hashlib.sha256()
    for name, a in sorted(named_arrays(params).items()):
        a = np.ascontiguousarray(a)
        h.update(f"{name}\0{a.dtype.name}\0{list(a.shape)}\0{a.nbytes}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def params_bytes(spec: DrafterSpec, params: Params) -> bytes:
    """The weights as one safetensors file (tpumk's names, `named_arrays`), after checking they
    have the structure, shapes and dtypes `spec` describes (ConfigError otherwise)."""
    import safetensors.numpy

    _check_like(spec, params, "the drafter's weights")
    return safetensors.numpy.save(named_arrays(params))


def params_from_bytes(spec: DrafterSpec, data: bytes, source: str) -> Params:
    """The weights `params_bytes` wrote, as the Params tree of `spec` (CheckpointError naming
    `source` for a missing, stray or misshapen tensor)."""
    import safetensors

    try:
        tensors = {name: t for name, t in safetensors.deserialize(data)}
    except Exception as e:  # noqa: BLE001 - the parser's own error types vary by version
        raise CheckpointError(f"{source}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    want = abstract_params(spec)
    named = _named_leaves(want)
    stray = sorted(set(tensors) - {name for name, _ in named})
    if stray:
        raise CheckpointError(f"{source}: tensor '{stray[0]}' is not one of this {spec.kind} drafter's")
    leaves = []
    for name, like in named:
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{source}: missing tensor '{name}'")
        dt = _DTYPE_TAGS.get(t["dtype"])
        if dt is None or np.dtype(dt) != np.dtype(like.dtype) or tuple(t["shape"]) != tuple(like.shape):
            raise CheckpointError(f"{source}: tensor '{name}' is {t['dtype']} {list(t['shape'])}, expected "
                                  f"{np.dtype(like.dtype).name} {list(like.shape)}")
        leaves.append(jnp.asarray(np.frombuffer(t["data"], dtype=dt).reshape(like.shape)))
    return jax.tree.unflatten(jax.tree.structure(want), leaves)


def _check_like(spec: DrafterSpec, params: Params, what: str) -> None:
    from tpumk.errors import ConfigError

    want = abstract_params(spec)
    if jax.tree.structure(params) != jax.tree.structure(want):
        raise ConfigError(f"{what}: another structure than the {spec.kind} drafter's spec describes")
    for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(want)):
        if tuple(a.shape) != tuple(s.shape) or np.dtype(a.dtype) != np.dtype(s.dtype):
            raise ConfigError(f"{what}: {jax.tree_util.keystr(path)} is {np.dtype(a.dtype).name} {list(a.shape)}, "
                              f"the spec's is {np.dtype(s.dtype).name} {list(s.shape)}")
