"""Lane padding: a model whose widths are not multiples of 128 lanes, run as a wider one.

The TPU's vector registers and VMEM tiles are 128 lanes wide, and the megakernel slices its
activations on lane-tile boundaries. A model whose hidden size is not a multiple of 128
(SmolLM2-135M: 576), or whose 64-wide KV heads do not pair up into 128-lane blocks (3 KV heads),
is planned as its `lane_padded` copy:

- hidden_size rounds up to a multiple of 128; the extra lanes of every weight are zero, so the
  residual stream's extra lanes stay exactly zero, and RMSNorm divides by the true width
  (`ModelConfig.rms_width`), so every norm equals the unpadded one;
- an odd number of 64-wide KV heads gains one KV head (and its group of query heads) of zeros:
  its keys and values are zero, its queries' outputs meet zero rows of `wo`, so it adds nothing;
- a routed expert's width (expert_ffn_size: gpt-oss's 2880) rounds up to a multiple of 128: the
  extra gate / up columns (and their biases) are zero, so their activation is zero under plain
  or clamped SwiGLU (g * sigmoid(a g) at g = 0), and they meet zero rows of the down projection;
- Muse Spark's experts' width (moe_hidden_size) rounds up to a multiple of 128: moe_in's extra
  columns, the experts' extra input rows and output columns and moe_out's extra rows are zero,
  and the experts' norms divide by the true width (`MoEGeometry.norm_width`, from the plan);
- a head width other than 64 that is not a multiple of 128 (Phi-3's 96, 80) rounds up to one:
  each half of a head is its true half then zeros ([x1 0 x2 0]), so rotate-half RoPE still pairs
  lane i with lane i + D/2, q.k sums only true lanes, and the softmax scale, the RoPE
  frequencies and per-head norms use the true width (`ModelConfig.head_width`).

Padding keeps every true block in place or appends after it: a weight pads by zeros
(`pad_params`), a cache by zero lanes (`pad_cache`, `unpad_cache`). FFN and vocabulary widths
need no copy: the plan already pads those inside the packed layout. MLA models are not padded
(their latent widths have their own lane layout).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from tpumk.errors import PlanError
from tpumk.model.config import ModelConfig
from tpumk.model.quantize import QuantizedMatrix
from tpumk.plan.geometry import LANE, round_up


def lane_padded(cfg: ModelConfig) -> ModelConfig | None:
    """The copy of `cfg` the kernel runs (wider hidden size, paired 64-wide KV heads), or None
    when `cfg` already fits the lanes."""
    hidden = round_up(cfg.hidden_size, LANE)
    kv_heads, q_heads, d = cfg.num_kv_heads, cfg.num_q_heads, cfg.head_dim
    if not cfg.is_mla and d == LANE // 2 and kv_heads % 2:
        if cfg.attention.qk_norm_whole:  # the added zero heads would join the norm's count of heads
            raise PlanError(f"model '{cfg.name}': num_kv_heads = {cfg.num_kv_heads}: an odd number of 64-wide KV heads "
                            "is padded with a zero head, which a QK-norm across all heads (qk_norm_whole) would count")
        kv_heads, q_heads = kv_heads + 1, q_heads + q_heads // kv_heads
    if not cfg.is_mla and d != LANE // 2 and d % LANE:
        d = round_up(d, LANE)
    fe = round_up(cfg.moe.expert_ffn_size, LANE)
    m = round_up(cfg.moe.moe_hidden_size, LANE)
    if (hidden, kv_heads, d, fe, m) == (cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.moe.expert_ffn_size,
                                        cfg.moe.moe_hidden_size):
        return None
    if cfg.is_mla and hidden != cfg.hidden_size:
        raise PlanError(f"model '{cfg.name}': hidden_size = {cfg.hidden_size}: an MLA model's hidden size must be "
                        f"a multiple of {LANE} (lane padding covers GQA models)")
    return cfg.replace(hidden_size=hidden, num_kv_heads=kv_heads, num_q_heads=q_heads, head_dim=d, expert_ffn_size=fe,
                       moe_hidden_size=m, rms_width=cfg.norms.width, head_width=cfg.attention.true_head_dim if d != cfg.head_dim else 0)


def _split_heads(a, axis: int, d: int, dp: int, fill: float = 0.0):
    """Axis `axis` of `a` holds heads of width d side by side: each becomes dp wide, each half
    its true half then zeros (`fill`)."""
    a = jnp.moveaxis(jnp.asarray(a), axis, -1)
    lead, heads = a.shape[:-1], a.shape[-1] // d
    a = a.reshape(*lead, heads, 2, d // 2)
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, (dp - d) // 2)], constant_values=fill)
    return jnp.moveaxis(a.reshape(*lead, heads * dp), -1, axis)


def _unsplit_heads(a, d: int, dp: int):
    """`_split_heads` undone on the last axis."""
    lead, heads = a.shape[:-1], a.shape[-1] // dp
    return a.reshape(*lead, heads, 2, dp // 2)[..., :d // 2].reshape(*lead, heads * d)


def _widen_heads(leaf, axis: int, d: int, dp: int):
    """A tensor whose `axis` (-1: columns, -2: rows) holds heads: widened by `_split_heads`."""
    if not isinstance(leaf, QuantizedMatrix):
        return _split_heads(leaf, axis, d, dp)
    if leaf.grouped and axis == -2:  # 128-row scale groups straddle the true heads' rows
        raise PlanError(f"weights: a group-quantized matrix whose input rows are heads of {d} lanes cannot be "
                        f"padded to {dp}-lane heads (quantize the float weights with the padded plan instead)")
    scale = _split_heads(leaf.scale, -1, d, dp, 1.0) if axis == -1 else leaf.scale
    return leaf._replace(q=_split_heads(leaf.q, axis, d, dp), scale=scale)


def _pad_array(a, shape: tuple[int, ...], fill: float = 0.0):
    a = jnp.asarray(a)
    if tuple(a.shape) == tuple(shape):
        return a
    return jnp.pad(a, [(0, n - m) for m, n in zip(a.shape, shape)], constant_values=fill)


def _pad_leaf(leaf: Any, shape: tuple[int, ...]) -> Any:
    if not isinstance(leaf, QuantizedMatrix):
        return _pad_array(leaf, shape)
    # Codes pad with zeros, so a padded row or column dequantizes to zero whatever its scale;
    # the new scales are 1 (finite and inert).
    k, m = shape[-2:]
    scale_shape = shape[:-2] + ((-(-k // leaf.group), m) if leaf.grouped else (m,))
    return leaf._replace(q=_pad_array(leaf.q, shape), scale=_pad_array(leaf.scale, scale_shape, 1.0))


def pad_params(true: ModelConfig, padded: ModelConfig, params: dict) -> dict:
    """`true`'s weights (reference layout, plain or quantized) as `padded`'s: each tensor gains
    zeros after its true block on every axis (`expected_shapes(padded)`)."""
    from tpumk.model.weights import expected_shapes

    want = expected_shapes(padded)
    d, dp = true.head_dim, padded.head_dim
    head_axes = ({"wq": -1, "wk": -1, "wv": -1, "wo": -2, "q_norm": -1, "k_norm": -1, "bq": -1, "bk": -1, "bv": -1,
                  "wq_gate": -1} if dp != d else {})

    def layer(lay: dict, shapes: dict) -> dict:
        lay = {k: _widen_heads(v, head_axes[k], d, dp) if k in head_axes else v for k, v in lay.items()}
        return {k: _pad_leaf(v, tuple(shapes[k])) for k, v in lay.items()}

    out = {k: _pad_leaf(v, tuple(want[k])) for k, v in params.items() if k != "layers"}
    out["layers"] = [layer(lay, shapes) for lay, shapes in zip(params["layers"], want["layers"])]
    return out


def pad_cache(true: ModelConfig, padded: ModelConfig, cache):
    """A reference-layout cache of `true` as `padded`'s (zero lanes for the added KV heads)."""
    if padded.attention.kv_size == true.attention.kv_size:
        return cache
    shape = cache.k.shape[:-1] + (padded.attention.kv_size,)

    def wide(a):
        if padded.head_dim != true.head_dim:
            a = _split_heads(a, -1, true.head_dim, padded.head_dim)
        return _pad_array(a, shape)
    return cache._replace(k=wide(cache.k), v=wide(cache.v))


def unpad_cache(true: ModelConfig, padded: ModelConfig, cache):
    """`pad_cache` undone: the true KV heads' lanes of each cache row."""
    if padded.attention.kv_size == true.attention.kv_size:
        return cache
    heads = true.num_kv_heads * padded.head_dim  # the true heads, still padded wide

    def narrow(a):
        a = a[..., :heads]
        return _unsplit_heads(a, true.head_dim, padded.head_dim) if padded.head_dim != true.head_dim else a
    return cache._replace(k=narrow(cache.k), v=narrow(cache.v))



def params_as_run(plan, params: dict) -> dict:
    """Whole-model weights for `plan`'s kernel: padded when the plan pads the model and they are
    in the true shapes, as given when they already are the padded model's (or nothing pads)."""
    true, run = plan.unpadded, plan.whole_model
    if true is None:
        return params

    moe_layer = next((i for i in range(true.num_layers) if not true.pattern.is_dense(i)), None)

    attention = true.pattern.attention_layers[0]  # a hybrid's layer 0 may be linear (no wk)

    def where(name: str) -> dict:  # the tensors whose shapes tell the two models apart
        return params if name == "embed" else params["layers"][moe_layer if name == "e_gate" else attention]

    def shapes(cfg: ModelConfig) -> dict[str, tuple]:
        out = {"embed": (cfg.vocab_size, cfg.hidden_size)}
        if not cfg.is_mla:
            out["wk"] = (cfg.hidden_size, cfg.attention.kv_size)
        if moe_layer is not None:
            out["e_gate"] = (cfg.num_experts, cfg.moe.width(cfg.hidden_size), cfg.moe.expert_ffn_size)
        return out

    def shape(a) -> tuple:
        return tuple((a.q if isinstance(a, QuantizedMatrix) else a).shape)

    have = {k: shape(where(k)[k]) for k in shapes(true)}
    if have == shapes(run):
        return params
    if have != shapes(true):
        got = " / ".join(f"{k} {v}" for k, v in have.items())
        raise PlanError(f"weights: {got} fit neither model '{true.name}' as written {tuple(shapes(true).values())} "
                        f"nor as the kernel runs it {tuple(shapes(run).values())}")
    return pad_params(true, run, params)
