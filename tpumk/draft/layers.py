"""What every drafter shares: its embedding and head (its own, or the target's), the draft
vocabulary's map to the target's, picking a draft (greedy or sampled) with the distribution it
was drawn from, writes into a cache indexed by position, and one decoder layer built from
tpumk.model.reference's pieces (attention over a given cache, the MLP or experts).

Numerics are the reference's (tpumk.model.ops): matrix products cast the activation to the
weight's dtype and accumulate in float32; norms, RoPE, softmax and the residual in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpumk.draft.config import DrafterSpec
from tpumk.model import mla
from tpumk.model.config import ModelConfig
from tpumk.model.ops import matmul
from tpumk.model.reference import (Params, attend, embed, ffn, layer_sinks, mlp_in, o_proj, qkv, sublayer_in,
                                   sublayer_out)


def embed_rows(params: Params, target_params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., H] float32: the drafter's own table when it has one (an EAGLE-3
    checkpoint's embed_tokens), else the target's, unscaled (speculators' nn.Embedding)."""
    table = params["embed"] if "embed" in params else target_params["embed"]
    return embed({"embed": table}, tokens)


def target_head(target_params: Params):
    """The target's lm_head [H, V] (its embedding transposed when tied)."""
    return target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T


def draft_logits(params: Params, target_params: Params, x: jax.Array) -> jax.Array:
    """x [..., H] (normed) -> logits over the draft vocabulary [..., Vd] float32: the drafter's
    own head, else the target's (without the target's logit soft-cap: speculators' plain Linear)."""
    head = params["lm_head"] if "lm_head" in params else target_head(target_params)
    return matmul(x, head)


def to_target(params: Params, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> target ids (through d2t, absolute target ids, when reduced)."""
    return params["d2t"][draft_ids] if "d2t" in params else draft_ids


def pick(spec: DrafterSpec, params: Params, logits: jax.Array, key, temperature) -> tuple[jax.Array, jax.Array]:
    """One draft per row from logits [B, Vd]: (target ids [B] int32, q [B, V] float32).

    q is softmax(logits / temperature) mapped to the target's vocabulary (zero outside the draft
    vocabulary), or at temperature 0 the one-hot of the argmax. `key` None: the argmax (greedy);
    else a draw from q (a row at temperature 0 still takes the argmax)."""
    t = jnp.asarray(temperature, jnp.float32)
    t = jnp.broadcast_to(t.reshape(-1, 1), (logits.shape[0], 1))  # a scalar, or one per sequence
    hot = t > 0
    scaled = logits / jnp.where(hot, t, 1.0)
    best = jnp.argmax(logits, -1)
    probs = jnp.where(hot, jax.nn.softmax(scaled, -1), jax.nn.one_hot(best, logits.shape[-1], dtype=jnp.float32))
    ids = best if key is None else jnp.where(hot[..., 0], jax.random.categorical(key, scaled, -1), best)
    if "d2t" in params:
        probs = jnp.zeros((logits.shape[0], spec.vocab), jnp.float32).at[:, params["d2t"]].set(probs)
    return to_target(params, ids).astype(jnp.int32), probs


def write_rows(cache: jax.Array, layer: int, positions: jax.Array, keep: jax.Array, rows: jax.Array) -> jax.Array:
    """cache [L, B, C, ...] with rows [B, T, ...] written at their positions [B, T] in `layer`,
    where `keep` [B, T]; other rows (and positions past C) write nothing."""
    b = jnp.arange(positions.shape[0])[:, None]
    at = jnp.where(keep & (positions >= 0), positions, cache.shape[2])  # an index past the cache: dropped
    return cache.at[layer, b, at].set(rows.astype(cache.dtype), mode="drop")


def write_head_rows(cache: jax.Array, layer: int, positions: jax.Array, keep: jax.Array, rows: jax.Array) -> jax.Array:
    """write_rows for a head-major cache [L, B, KVH, C, D] (`cache_shape`), rows [B, T, KVH, D]."""
    b = jnp.arange(positions.shape[0])[:, None, None]
    h = jnp.arange(cache.shape[2])[None, None, :]
    at = jnp.where(keep & (positions >= 0), positions, cache.shape[3])[:, :, None]  # past the cache: dropped
    return cache.at[layer, b, h, at].set(rows.astype(cache.dtype), mode="drop")


def position_major(cache_layer: jax.Array) -> jax.Array:
    """One layer of a head-major cache [B, KVH, C, D] as attend reads keys: [B, C, KVH, D], a copy.
    The barrier keeps XLA from folding the transpose into attend's dots: folded, XLA's CPU backend
    leaves some bfloat16 batched dots with a float32 result to a runtime that has none ("Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32", from 8 sequences up)."""
    return jax.lax.optimization_barrier(cache_layer.transpose(0, 2, 1, 3))


def attention(cfg: ModelConfig, i: int, layer: Params, h: jax.Array, positions: jax.Array, cache: dict,
              keep: jax.Array, k_valid: jax.Array) -> tuple[jax.Array, dict]:
    """Layer i's attention output (after its o projection) [B, T, H] float32 for normed inputs h
    at `positions`, their keys and values (or MLA latent rows) written into `cache` first (where
    `keep`); a query sees the cache's positions <= its own where `k_valid` [B, C]."""
    b, _ = positions.shape
    c = cache["latent"].shape[2] if cfg.is_mla else cache["k"].shape[3]
    k_pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    if cfg.is_mla:
        q_nope, q_rope, row = mla.project(cfg, layer, h, positions, cfg.pattern.rotates(i))
        latent = write_rows(cache["latent"], i, positions, keep, row)
        o = mla.attend_latent(cfg, layer, q_nope, q_rope, latent[i], positions, k_pos, k_valid)
        return matmul(o, layer["wo"]), {**cache, "latent": latent}
    q, k, v = qkv(cfg, layer, h, positions, i)
    kc, vc = write_head_rows(cache["k"], i, positions, keep, k), write_head_rows(cache["v"], i, positions, keep, v)
    o = attend(cfg.attention, q, position_major(kc[i]), position_major(vc[i]), positions, k_pos, k_valid, cfg.pattern.window(i), layer_sinks(cfg, layer))
    return o_proj(cfg, layer, o, h), {**cache, "k": kc, "v": vc}


def mlp_part(cfg: ModelConfig, i: int, layer: Params, x: jax.Array, attn_in: jax.Array) -> jax.Array:
    """The residual after layer i's MLP (dense or experts) sublayer."""
    b, t, _ = x.shape
    h = mlp_in(cfg.norms, layer, x, attn_in)
    y = ffn(cfg, i, layer, h.reshape(b * t, -1)).reshape(b, t, -1)
    return x + sublayer_out(cfg.norms, layer, "post_mlp_norm", y)


def decoder_layer(cfg: ModelConfig, i: int, layer: Params, x: jax.Array, positions: jax.Array, cache: dict,
                  keep: jax.Array, k_valid: jax.Array) -> tuple[jax.Array, dict]:
    """One whole decoder layer of `cfg` (layer i's kind: GQA or MLA, dense or experts) over the
    residual x [B, T, H] float32, as tpumk.model.reference runs it."""
    h = sublayer_in(cfg.norms, layer, "attn_norm", x)
    a, cache = attention(cfg, i, layer, h, positions, cache, keep, k_valid)
    x = x + sublayer_out(cfg.norms, layer, "post_attn_norm", a)
    return mlp_part(cfg, i, layer, x, h), cache


def cache_shape(cfg: ModelConfig, batch: int, context: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a drafter's own per-position cache for `cfg`'s layers: K and V per layer,
    head-major [L, B, KVH, C, D] (a head's keys of a sequence are one contiguous slab: what the
    drafter's pass kernel, tpumk.kernel.draft_pass, streams), or MLA's latent row per layer."""
    n = cfg.num_layers
    if cfg.is_mla:
        return {"latent": (n, batch, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
    return {"k": (n, batch, cfg.num_kv_heads, context, cfg.head_dim),
            "v": (n, batch, cfg.num_kv_heads, context, cfg.head_dim)}


def advance(state_length: jax.Array, positions: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the index of each sequence's last valid row [B], its new committed length [B]): the rows
    of a step that are valid form a prefix; a sequence with none keeps its length."""
    n = jnp.sum(valid, 1)
    last = jnp.maximum(n - 1, 0)
    end = jnp.take_along_axis(positions, last[:, None], 1)[:, 0] + 1
    return last, jnp.where(n > 0, end, state_length).astype(jnp.int32)
