"""Load a GGUF checkpoint (llama.cpp's single-file format) of a Llama model into the reference
weight layout.

The file's header and tensor layout are read and checked by `tpumk.model.gguf_file` (bounded,
memory-mapped; llama.cpp's rules); the config comes from its `llama.*` metadata, and every
tensor is dequantized to float32 with the `gguf` package's `gguf.quants.dequantize` (tpumk has
no kernel format matching llama.cpp's block quantizations), then cast to the model dtype
(float32 unless `dtype` says otherwise).

Name mapping (GGUF tensors, in numpy order, are `[out, in]` like Hugging Face's; the reference
layout is `[in, out]`):

    token_embd.weight            -> embed
    output_norm.weight           -> final_norm
    output.weight                -> lm_head (transposed; absent: tied embeddings)
    blk.{i}.attn_norm.weight     -> attn_norm
    blk.{i}.ffn_norm.weight      -> mlp_norm
    blk.{i}.attn_{q,k,v,output}  -> wq, wk, wv, wo (transposed; q and k rows un-permuted, below)
    blk.{i}.ffn_{gate,up,down}   -> w_gate, w_up, w_down (transposed)

llama.cpp's converter reorders each head's rows of attn_q / attn_k so its RoPE, which rotates
adjacent lane pairs (2j, 2j+1), computes what Hugging Face's rotate-half RoPE (lanes j and
j + D/2) does; the loader restores the original order, so tpumk's rotate-half RoPE is right.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax.numpy as jnp  # also registers bfloat16 with numpy (ml_dtypes)
import numpy as np
from gguf.constants import GGUFValueType

from tpumk.errors import CheckpointError, ConfigError, NotSupportedError, and_more, one_line
from tpumk.model.config import MAX_SIZES, ModelConfig, from_dict, override_dtype
from tpumk.model.gguf_file import FLOATS, INTEGERS, GGUFFile, TensorInfo, open_gguf
from tpumk.model.reference import Params
from tpumk.model.weights import expected_shapes

ARCHITECTURE = "llama"
_STRING = {GGUFValueType.STRING}
_INT = "an integer (UINT8 to INT64)"


def vocabulary_size(g: GGUFFile) -> int | None:
    """How many tokens `tokenizer.ggml.tokens` lists (None: no such field), without reading them."""
    f = g.fields.get("tokenizer.ggml.tokens")
    if f is None:
        return None
    if f.type != GGUFValueType.ARRAY or f.item_type != GGUFValueType.STRING:
        raise CheckpointError(f"{g.src}: metadata field 'tokenizer.ggml.tokens' is {f.kind()}, expected an ARRAY "
                              "of STRING")
    return f.count


def gguf_config(g: GGUFFile, path: Path) -> ModelConfig:
    """The ModelConfig a Llama GGUF's metadata describes (float32; anything tpumk does not
    model refused in one line naming the metadata key). Every field must have its GGUF type, as
    llama.cpp reads it: sizes integers, epsilons and frequencies floats, names strings."""
    src = g.src
    arch = g.typed("general.architecture", _STRING, "a STRING")
    if arch != ARCHITECTURE:
        raise NotSupportedError(f"{src}: not supported yet: general.architecture {arch!r} (supported: "
                                f"{ARCHITECTURE!r})")
    a = ARCHITECTURE + "."
    req = object()

    def size(key: str, bound: str, default: Any = req) -> int | None:
        v = g.typed(a + key, INTEGERS, _INT)
        if v is None:
            if default is req:
                raise CheckpointError(f"{src}: missing metadata field '{a + key}'")
            return default
        if not 1 <= v <= MAX_SIZES[bound]:
            raise ConfigError(f"{src}: field '{a + key}' = {v}: expected a positive integer at most "
                              f"{MAX_SIZES[bound]:,}")
        return v

    experts = g.typed(a + "expert_count", INTEGERS, _INT, 0)
    if experts:
        raise NotSupportedError(f"{src}: not supported yet: field '{a}expert_count' = {experts} (a mixture of "
                                "experts in the llama architecture)")
    hidden = size("embedding_length", "hidden_size")
    heads = size("attention.head_count", "num_q_heads")
    kv_heads = size("attention.head_count_kv", "num_kv_heads", heads)
    head_dim = size("attention.key_length", "head_dim", None) or hidden // heads
    value_dim = size("attention.value_length", "head_dim", head_dim)
    if value_dim != head_dim:
        raise NotSupportedError(f"{src}: not supported yet: field '{a}attention.value_length' = {value_dim} != "
                                f"the key width {head_dim}")
    rope_dims = size("rope.dimension_count", "head_dim", head_dim)
    if rope_dims != head_dim:
        raise NotSupportedError(f"{src}: not supported yet: field '{a}rope.dimension_count' = {rope_dims} (RoPE on "
                                f"part of each head; only the whole head width {head_dim})")
    n_tokens = vocabulary_size(g)
    vocab = size("vocab_size", "vocab_size", n_tokens)
    if vocab is None:
        raise CheckpointError(f"{src}: missing metadata field '{a}vocab_size' (and no tokenizer.ggml.tokens)")
    if n_tokens is not None and n_tokens != vocab:
        raise CheckpointError(f"{src}: field '{a}vocab_size' = {vocab} but tokenizer.ggml.tokens holds {n_tokens} "
                              "tokens")
    fields: dict[str, Any] = dict(
        name=path.name.removesuffix(".gguf") or "gguf",
        num_layers=size("block_count", "num_layers"),
        hidden_size=hidden, num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        ffn_size=size("feed_forward_length", "ffn_size"),
        rms_eps=_number(g, a + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_number(g, a + "rope.freq_base", 10000.0),
        qk_norm=False,
        tie_embeddings="output.weight" not in g.tensors,
        dtype="float32",
    )
    fields.update(_rope_scaling(g, a))
    return from_dict(fields, src)


def _number(g: GGUFFile, key: str, default: float) -> float:
    v = g.typed(key, FLOATS, "a FLOAT32 or FLOAT64", default)
    if not math.isfinite(v):
        raise ConfigError(f"{g.src}: field '{key}' = {v}: expected a finite number")
    return float(v)


def _rope_scaling(g: GGUFFile, a: str) -> dict[str, Any]:
    """llama.rope.scaling.*: none, or linear (positions divided by the factor); YaRN and the
    rest are refused, as is any scaling factor without a type."""
    src = g.src
    kind = g.typed(a + "rope.scaling.type", _STRING, "a STRING")
    factor = _number(g, a + "rope.scaling.factor", 0.0)
    if kind in (None, "none"):
        if factor not in (0.0, 1.0):
            raise NotSupportedError(f"{src}: not supported yet: field '{a}rope.scaling.factor' = {factor} with "
                                    f"rope.scaling.type {kind or 'absent'}")
        return {}
    if kind != "linear":
        raise NotSupportedError(f"{src}: not supported yet: field '{a}rope.scaling.type' = {kind!r} (supported: "
                                "none, linear)")
    if factor < 1:
        raise ConfigError(f"{src}: field '{a}rope.scaling.factor' = {factor}: expected a number of at least 1")
    return {"rope_scaling": "linear", "rope_factor": factor}


def _unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order of attn_q / attn_k ([heads * D, in]): its converter
    writes row 2j + k of a head from Hugging Face's row k * D/2 + j."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(g: GGUFFile, t: TensorInfo) -> np.ndarray:
    from gguf.quants import dequantize

    src = g.src
    try:
        return np.asarray(dequantize(g.tensor_bytes(t), t.type), np.float32)
    except NotImplementedError:
        raise CheckpointError(f"{src}: tensor '{t.name}' has type {t.type.name}, which the gguf package "
                              "cannot dequantize (expected a float or block-quantized type)") from None
    except (ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"{src}: cannot read tensor '{t.name}' ({one_line(e)})") from None


def load_gguf(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, Params]:
    """Read a Llama GGUF file into (config, params). `dtype` ("float32" / "bfloat16") overrides
    the float32 the dequantized weights are kept in. A missing, unexpected or misshapen tensor,
    or one of a type the gguf package cannot dequantize, is one line naming it."""
    p = Path(path)
    g = open_gguf(p)
    src = g.src
    cfg = gguf_config(g, p)
    cfg = cfg.replace(dtype=override_dtype(cfg, dtype))
    out_dt = np.dtype(jnp.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)
    shapes = expected_shapes(cfg)

    # GGUF name -> (layer or None, reference key, its [out, in] shape, transform to the reference)
    plan: dict[str, tuple[int | None, str, tuple[int, ...], Any]] = {}

    def add(name: str, layer: int | None, key: str, fn=None) -> None:
        ref = shapes[key] if layer is None else shapes["layers"][layer][key]
        plan[name] = (layer, key, tuple(reversed(ref)) if fn is not None else ref, fn)

    transpose = np.transpose
    add("token_embd.weight", None, "embed")
    add("output_norm.weight", None, "final_norm")
    if not cfg.head.tie_embeddings:
        add("output.weight", None, "lm_head", transpose)
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", i, "attn_norm")
        add(b + "ffn_norm.weight", i, "mlp_norm")
        add(b + "attn_q.weight", i, "wq", lambda w: _unpermute_rope_rows(w, cfg.num_q_heads).T)
        add(b + "attn_k.weight", i, "wk", lambda w: _unpermute_rope_rows(w, cfg.num_kv_heads).T)
        add(b + "attn_v.weight", i, "wv", transpose)
        add(b + "attn_output.weight", i, "wo", transpose)
        add(b + "ffn_gate.weight", i, "w_gate", transpose)
        add(b + "ffn_up.weight", i, "w_up", transpose)
        add(b + "ffn_down.weight", i, "w_down", transpose)

    tensors = g.tensors
    if "rope_freqs.weight" in tensors:  # Llama 3.1's per-frequency RoPE factors
        raise NotSupportedError(f"{src}: not supported yet: tensor 'rope_freqs.weight' (RoPE frequency factors)")
    missing = [n for n in plan if n not in tensors]
    if missing:
        raise CheckpointError(f"{src}: missing tensor '{missing[0]}'{and_more(missing)}")
    unexpected = [n for n in tensors if n not in plan]
    if unexpected:
        raise CheckpointError(f"{src}: unexpected tensor '{unexpected[0]}'{and_more(unexpected)} (not part of the llama model its "
                              "metadata describes)")
    for name, (_, _, want, _) in plan.items():
        got = tensors[name].shape
        if got != want:
            raise CheckpointError(f"{src}: tensor '{name}' has shape {list(got)}, expected {list(want)}")

    params: Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    for name, (layer, key, _, fn) in plan.items():  # one tensor in float32 at a time
        w = _dequantized(g, tensors[name])
        if fn is not None:
            w = fn(w)
        (params if layer is None else params["layers"][layer])[key] = jnp.asarray(np.asarray(w, out_dt))
    return cfg, params
