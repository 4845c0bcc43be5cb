"""The plugin's prefill for an MLA model (DeepSeek-V3, Kimi K2): ragged paged attention over
vLLM's stacked latent cache, in pure JAX (no vLLM import).

An MLA model's megakernel cache is ONE stacked array, `[layers, blocks, block_size, lanes]`: per
token and layer the row `c_kv | k_rope` (kv_lora_rank + qk_rope_head_dim elements) then zeros up
to whole 128-lane tiles (`Attention.latent_cache_lanes`; `tpumk.model.mla`); there is no V array.
The plugin has vLLM allocate exactly that array (tpumk.vllm.backend declares the one layer
`tpumk.kv.k`), and this module runs any batch that is not pure decode on it, as
`tpumk.vllm.steps.ragged_step` does for the other families:

- each layer projects the batch's tokens (`tpumk.model.mla.project`: q-LoRA, YaRN RoPE, the
  latent row), writes their latent rows into vLLM's array in place, then
- every token attends to its request's rows 0 .. its position in the ABSORBED form the kernel
  runs (`tpumk.model.mla.attend_latent`: q_lat = q_nope @ W_UK per head, scores of `q_lat |
  q_rope` against the row, probabilities against c_kv, then W_UV), through the same work items
  as `tpumk.vllm.prefill` (one request and up to `query_tile` of its rows each), reading the
  request's latent pages `key_tile` positions at a time up to the item's last query (a while
  loop on that bound) with an online softmax in float32: the pages a chunk needs, once per tile
  of its tokens, never `[tokens, max_model_len]` rows.

Numerics follow `attend_latent`: the query row in the cache dtype, float32 scores times YaRN's
softmax scale, probabilities in the cache dtype against c_kv. Layers reading another layer's
latent rows (no wkv_a) read that layer's slice and write nothing, NoPE layers keep their keys
unrotated, as in `tpumk.model.reference`'s MLA step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpumk.model import mla, yarn
from tpumk.model import reference as ref
from tpumk.model.config import ModelConfig
from tpumk.model.ops import matmul, rms_norm
from tpumk.model.quantize import absorbed_weights
from tpumk.vllm import kv, prefill


def ragged_layers(params: dict, cfg: ModelConfig, latent: jax.Array, input_ids: jax.Array, positions: jax.Array,
                  query_start_loc: jax.Array, block_tables: jax.Array, num_reqs: jax.Array, block_size: int,
                  max_context: int, query_tile: int = prefill.QUERY_TILE, key_tile: int = prefill.KEY_TILE,
                  short_tile: int = prefill.SHORT_TILE,
                  taps: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """The batch's T tokens (`steps.ragged_step`'s contract) through every layer on vLLM's latent
    array: (the array with their rows written, the residual stream [T, H] f32 after the last
    layer, the residual stream [T, H] entering each of the `taps` layers, in that order: EAGLE-3's
    inputs, tpumk.vllm.speculative). Rows past the last request's run at position -1: they write
    nothing and see nothing."""
    t = input_ids.shape[0]
    pos, new_slots = kv.ragged_token_rows(positions, query_start_loc, block_tables, num_reqs, block_size)
    items = prefill.work_items(query_start_loc, num_reqs, t, query_tile, short_tile)
    freqs = mla.rope_freqs(cfg, params)
    width = cfg.attention.kv_cache_width
    x = ref.embed(params, input_ids, cfg.head.embed_scale)[None]  # [1, T, H]
    tapped = {}
    for li, layer in enumerate(params["layers"]):
        if li in taps:
            tapped[li] = x[0]
        h = rms_norm(x, layer["attn_norm"], cfg.norms.rms_eps, cfg.norms.width)
        kl, rot = cfg.pattern.kv_index(cfg.pattern.kv_source(li)), cfg.pattern.rotates(li)
        q_nope, q_rope, row = mla.project(cfg, layer, h, pos[None], rot, freqs)
        if row is not None:  # the row's lanes, then zeros in the stored row's pad lanes
            latent = kv.write_rows(latent, kl, new_slots, jnp.pad(row[0], ((0, 0), (0, latent.shape[-1] - width))))
        o = attend(cfg, layer, latent, kl, items, q_nope[0], q_rope[0], pos, block_tables, block_size, max_context,
                   key_tile)
        x = x + matmul(o[None], layer["wo"])
        h = rms_norm(x, layer["mlp_norm"], cfg.norms.rms_eps, cfg.norms.width)
        x = x + ref.ffn(cfg, li, layer, h.reshape(t, -1)).reshape(1, t, -1)
    return latent, x[0], [tapped[li] for li in taps]


def attend(cfg: ModelConfig, layer: dict, latent: jax.Array, kv_layer: int, items: tuple[prefill.WorkItems, ...],
           q_nope: jax.Array, q_rope: jax.Array, positions: jax.Array, block_tables: jax.Array, block_size: int,
           max_context: int, key_tile: int = prefill.KEY_TILE) -> jax.Array:
    """Every token's absorbed MLA attention output [T, Hq * V] f32: q_nope [T, Hq, N], q_rope
    [T, Hq, R] f32 of the tokens at `positions` [T] (-1: a padding row, output 0) against its
    request's latent rows 0 .. its position in `latent[kv_layer]` (this step's rows already
    written there)."""
    t, hq = q_nope.shape[:2]
    c, width = cfg.kv_lora_rank, cfg.attention.kv_cache_width
    dt = latent.dtype
    w_uk, w_uv = absorbed_weights(cfg, layer)
    q_lat = mla._per_head(q_nope[None], w_uk)[0]  # [T, Hq, C] f32, the kernel's uk product
    q_row = jnp.concatenate([q_lat, q_rope], -1).astype(dt)  # [T, Hq, C + R]
    scale = yarn.softmax_scale(cfg.attention, cfg.positions)
    kt = min(key_tile, max_context)

    def item(args):
        r, rows, valid = args
        qi = q_row[rows]  # [Cq, Hq, C + R]
        qp = jnp.where(valid, positions[rows], -1)  # [Cq]
        last = jnp.max(qp)
        hi = (last + kt) // kt  # key tiles up to the last query's position (0 when the item is empty)

        def body(carry):
            j, m, l, acc = carry
            kp = j * kt + jnp.arange(kt, dtype=jnp.int32)
            slots = kv.token_slots(block_tables, jnp.broadcast_to(r, kp.shape), kp, block_size)
            keys = kv.read_rows(latent, kv_layer, jnp.maximum(slots, 0))[:, :width]
            keys = jnp.where((kp <= last)[:, None], keys, 0)  # [kt, C + R]
            s = jnp.einsum("qhd,sd->hqs", qi, keys, preferred_element_type=jnp.float32) * scale
            mask = kp[None, :] <= qp[:, None]
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, -1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            rescale = jnp.exp(m - m_new)
            pv = jnp.einsum("hqs,sc->hqc", p.astype(dt), keys[:, :c], preferred_element_type=jnp.float32)
            return j + 1, m_new, l * rescale + jnp.sum(p, -1, keepdims=True), acc * rescale + pv

        cq = rows.shape[0]
        start = (jnp.int32(0), jnp.full((hq, cq, 1), jnp.finfo(jnp.float32).min),
                 jnp.zeros((hq, cq, 1), jnp.float32), jnp.zeros((hq, cq, c), jnp.float32))
        _, m, l, acc = jax.lax.while_loop(lambda carry: carry[0] < hi, body, start)
        o = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)  # a query with no key: 0, as the reference
        return jnp.transpose(o, (1, 0, 2))  # [Cq, Hq, C]

    o_lat = jnp.zeros((t, hq, c), jnp.float32)
    for group in items:  # each row is one item's own in exactly one group
        outs = jax.lax.map(item, tuple(group))  # [N, Cq, Hq, C]
        rows = jnp.where(group.valid, group.rows, t).reshape(-1)  # not an item's own row: dropped
        o_lat = o_lat.at[rows].set(outs.reshape(rows.shape[0], hq, c), mode="drop")
    return mla._per_head(o_lat[None], w_uv)[0].reshape(t, hq * cfg.v_head_dim)  # the kernel's uv product
