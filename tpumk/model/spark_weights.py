"""A Muse Spark checkpoint's language-model tensors, folded into what tpumk's parts read
(tpumk.model.spark has the math; tpumk.model.checkpoint maps the result onto the reference layout).

transformers' MuseSparkTextModel keeps several factors outside its matrices that tpumk's parts
take inside them; each is folded here in float32, before the cast to the model dtype:

- the (1 + w) RMSNorms (input_layernorm, pre_feedforward_layernorm, mlp.pre_expert_norm): 1 added;
- the weightless norms (post_attention_layernorm, QK-norm): weights of ones, the queries' norm
  times qk_scale_factor (transformers multiplies the normed queries by it);
- the input-scaled norms (post_feedforward_layernorm, mlp.experts.post_expert_norm: x * (1 + w)
  normalised): (1 + w) moved onto the output rows of the projection before them (down_proj or
  mlp.post_expert_proj; every expert's down_proj), leaving a weightless norm;
- the router's and the head's output_multiplier: on mlp.gate and lm_head;
- each residual gate vector: its (alpha, beta) per channel (tpumk.model.spark.gate_coefficients);
- the multimodal wrapper's image / video / audio token ids, which transformers embeds as token 0:
  those rows of embed_tokens set to row 0's.

Tensors tpumk synthesises get names of their own (`SYNTHESISED`); the checkpoint holding a tensor
of such a name is refused, as any unexpected tensor is.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tpumk.errors import CheckpointError
from tpumk.model.config import ModelConfig
from tpumk.model.spark import gate_coefficients

# The wrapper's token ids transformers maps to token 0 before the embedding (MuseSparkConfig's defaults)
MULTIMODAL_TOKENS = {"image_token_id": 200092, "video_token_id": 200091, "audio_token_id": 200038}
GATES = {"attn": "post_attention_residual_gate", "mlp": "post_feedforward_residual_gate"}
SYNTHESISED = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "post_attention_layernorm.weight",
               *(f"{g}.{c}" for g in GATES.values() for c in ("alpha", "beta")))


class _Folded:
    """A tensor computed from the checkpoint's own (a `checkpoint._Tensor` look-alike: the loader
    checks its shape and reads it once); errors name `name` as if stored in `file`."""

    def __init__(self, name: str, file: Any, shape: tuple[int, ...], compute: Callable[[], np.ndarray]):
        self.name, self.file, self.shape, self.dtype_tag, self._compute = name, file, tuple(shape), "F32", compute

    def read(self, fp8: bool = False, raw_bytes: bool = False) -> np.ndarray:
        return np.asarray(self._compute(), np.float32)


def _f32(t) -> np.ndarray:
    return np.asarray(t.read(), np.float32)


def fold_tensors(cfg: ModelConfig, tensors: dict[str, Any], text: dict[str, Any], wrapper: dict[str, Any] | None,
                 source: str) -> dict[str, Any]:
    """`tensors` (the language model's, under model.* / lm_head.*) with Muse Spark's factors folded
    in (the module docstring); `text` the text config (its folded factors read from it, transformers'
    defaults where it is silent: tpumk.model.config already checked them), `wrapper` the multimodal
    config (its token ids) or None; `source` (the checkpoint) names a missing tensor's place."""
    from tpumk.model.hf_defaults import CLASS_DEFAULTS

    defaults = CLASS_DEFAULTS["muse_spark_text"]
    factor = {k: float(text.get(k) if text.get(k) is not None else defaults[k])
              for k in ("qk_scale_factor", "output_multiplier", "residual_gate_temperature")}
    out = dict(tensors)

    def need(name: str):
        if name not in tensors:
            raise CheckpointError(f"{source}: missing tensor '{name}'")
        return tensors[name]

    def fold(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        t = need(name)
        out[name] = _Folded(name, t.file, t.shape, lambda: fn(_f32(t)))

    def consume(name: str) -> Any:
        need(name)
        return out.pop(name)

    def make(name: str, like: Any, shape: tuple[int, ...], fn: Callable[[], np.ndarray]) -> None:
        if name in tensors:
            raise CheckpointError(f"{tensors[name].file}: unexpected tensor '{name}' (not part of the model "
                                  "config.json describes)")
        out[name] = _Folded(name, like.file, shape, fn)

    plus_one = (lambda a: a + np.float32(1))
    scale = (lambda a, s=factor["output_multiplier"]: a * np.float32(s))
    embed = need("model.embed_tokens.weight")
    given = [wrapper.get(k, default) for k, default in MULTIMODAL_TOKENS.items()] if wrapper is not None else []
    ids = [v for v in given if isinstance(v, int) and not isinstance(v, bool) and 0 < v < embed.shape[0]]
    if ids:  # transformers looks these ids up as token 0
        fold("model.embed_tokens.weight", lambda a: _rows_as_row0(a, ids))
    fold("lm_head.weight", scale)
    h, d = cfg.hidden_size, cfg.head_dim
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm.weight", "pre_feedforward_layernorm.weight"):
            fold(p + norm, plus_one)
        like = need(p + "input_layernorm.weight")
        make(p + "post_attention_layernorm.weight", like, (h,), lambda: np.ones(h, np.float32))
        make(p + "self_attn.q_norm.weight", like, (d,), lambda: np.full(d, factor["qk_scale_factor"], np.float32))
        make(p + "self_attn.k_norm.weight", like, (d,), lambda: np.ones(d, np.float32))
        for gate in GATES.values():
            g = consume(p + f"{gate}.gate")
            for k, c in enumerate(("alpha", "beta")):
                make(p + f"{gate}.{c}", g, g.shape,
                     lambda g=g, k=k: gate_coefficients(_f32(g), factor["residual_gate_temperature"])[k])
        post_mlp = consume(p + "post_feedforward_layernorm.weight")  # its (1 + w): onto the rows before it
        out[p + "post_feedforward_layernorm.weight"] = _Folded(  # now weightless
            p + "post_feedforward_layernorm.weight", post_mlp.file, (h,), lambda: np.ones(h, np.float32))
        rows = p + ("mlp.down_proj.weight" if cfg.pattern.is_dense(i) else "mlp.post_expert_proj.weight")
        fold(rows, lambda a, w=post_mlp: a * (1 + _f32(w))[:, None])
        if cfg.pattern.is_dense(i):
            continue
        fold(p + "mlp.gate.weight", scale)
        fold(p + "mlp.pre_expert_norm.weight", plus_one)
        post_expert = consume(p + "mlp.experts.post_expert_norm.weight")
        fold(p + "mlp.experts.down_proj", lambda a, w=post_expert: a * (1 + _f32(w))[None, :, None])
    return out


def _rows_as_row0(a: np.ndarray, ids: list[int]) -> np.ndarray:
    a = a.copy()
    a[ids] = a[0]
    return a
