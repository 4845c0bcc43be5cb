"""Ragged paged attention over vLLM's stacked K and V arrays (tpumk.vllm.kv), in pure JAX: the
plugin's prefill.

vLLM flattens a batch into T token rows, request r's in [query_start_loc[r], query_start_loc[r + 1]).
`work_items` cuts them into items of one request each: a tile of up to `query_tile` of its rows,
or for a request of at most `short_tile` new tokens (a decode in a mixed batch) one item of
`short_tile` rows. Their counts are static bounds (ceil(T / query_tile) + the requests that can
be long; one per request slot), since vLLM traces one program per token bucket; the items past
the batch's own do no work. `attend` runs
every item over its request's keys `key_tile` positions at a time, from the first its sliding
window can see (0 without one) up to its last query's position, so it reads only the pages the
item needs (a while loop on the item's own bound), never `[tokens, max_model_len]` rows. Scores
keep a running max and sum (an online softmax, as flash attention does) in float32; the numerics
follow `tpumk.model.reference.attend` (queries in the cache dtype, float32 scores, divisor,
soft cap, causal and window masks, gpt-oss' sink logits in the denominator, probabilities in the
cache dtype against V).

On a TPU the fit is a ragged paged attention kernel (docs/serving-vllm.md says which and why it
is not used here).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpumk.model.parts import Attention
from tpumk.model.reference import soft_cap
from tpumk.vllm import kv

QUERY_TILE = 256  # query rows per item (fewer when the bucket has fewer tokens)
SHORT_TILE = 8  # query rows per item of a request with this many new tokens or fewer (a decode)
KEY_TILE = 256  # key positions per read (fewer when max_model_len is shorter)


class WorkItems(NamedTuple):
    """Items of one request each: `req` [N], their token `rows` [N, tile] (clipped into the
    batch) and which of those rows are the item's own queries, `valid` [N, tile]."""
    req: jax.Array
    rows: jax.Array
    valid: jax.Array


def work_items(query_start_loc: jax.Array, num_reqs: jax.Array, num_tokens: int,
               query_tile: int = QUERY_TILE, short_tile: int = SHORT_TILE) -> tuple[WorkItems, ...]:
    """The batch's items: requests of more than `short_tile` new tokens in tiles of `query_tile`
    rows, the others (a decode in a mixed batch) one item each of `short_tile` rows, so that a
    request of one token does not run a whole long tile."""
    tile, short = min(query_tile, num_tokens), min(short_tile, num_tokens)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    s = min(q_lens.shape[0], num_tokens)  # live requests: at most one per token
    if short >= tile:
        return (_items(query_start_loc, num_reqs, num_tokens, tile, None, -(-num_tokens // tile) + s),)
    # a long request has more than `short` tokens: at most num_tokens // (short + 1) of them
    longs = _items(query_start_loc, num_reqs, num_tokens, tile, q_lens > short,
                   -(-num_tokens // tile) + min(s, num_tokens // (short + 1)))
    return longs, _items(query_start_loc, num_reqs, num_tokens, short, q_lens <= short, s)


def _items(query_start_loc, num_reqs, num_tokens: int, tile: int, take, count: int) -> WorkItems:
    """`count` items (a bound on how many the batch can need): tiles of `tile` rows of the live
    requests `take` selects (None: all); the items past those do no work."""
    s = query_start_loc.shape[0] - 1
    live = jnp.arange(s) < num_reqs
    if take is not None:
        live = live & take
    tiles = jnp.where(live, -(-(query_start_loc[1:] - query_start_loc[:-1]) // tile), 0)
    ends = jnp.cumsum(tiles)
    n = jnp.arange(count, dtype=jnp.int32)
    req = jnp.clip(jnp.searchsorted(ends, n, side="right"), 0, s - 1).astype(jnp.int32)
    first = query_start_loc[req] + (n - (ends - tiles)[req]) * tile
    rows = first[:, None] + jnp.arange(tile, dtype=jnp.int32)
    valid = (n < ends[-1])[:, None] & (rows < query_start_loc[req + 1][:, None]) & (rows < num_tokens)
    return WorkItems(req, jnp.clip(rows, 0, num_tokens - 1), valid)


def attend(att: Attention, k_cache: jax.Array, v_cache: jax.Array, layer: int, items: tuple[WorkItems, ...],
           q: jax.Array, positions: jax.Array, block_tables: jax.Array, block_size: int, max_context: int,
           window: int = 0, sinks: jax.Array | None = None, key_tile: int = KEY_TILE, devices: int = 1) -> jax.Array:
    """Every token's attention output [T, q_size] f32: q [T, Hq, D] f32 of the tokens at
    `positions` [T] (-1: a padding row, output 0) against its request's rows 0 .. its position in
    layer `layer` of vLLM's stacked `k_cache` / `v_cache` (tpumk.vllm.kv; this step's K and V
    already written there; `devices`: the arrays' tensor-parallel layout, `kv.cache_shape`)."""
    if att.step_bidirectional:
        raise ValueError("tpumk plugin: a drafter's bidirectional block attention is not a served model's")
    t = q.shape[0]
    hkv, g, d = att.num_kv_heads, att.group, att.head_dim
    kt = min(key_tile, max_context)
    dt = k_cache.dtype
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(hkv, g)[..., None, None]  # [Hkv, G, 1, 1]

    def item(args):
        r, rows, valid = args
        qi = q[rows].reshape(-1, hkv, g, d).astype(dt)  # [C, Hkv, G, D]
        qp = jnp.where(valid, positions[rows], -1)  # [C]
        last = jnp.max(qp)
        lo = jnp.maximum(jnp.min(jnp.where(valid, qp, last)) - window + 1, 0) // kt if window else 0
        hi = (last + kt) // kt  # key tiles up to the last query's position (0 when the item is empty)

        def body(carry):
            j, m, l, acc = carry
            kp = j * kt + jnp.arange(kt, dtype=jnp.int32)
            slots = kv.token_slots(block_tables, jnp.broadcast_to(r, kp.shape), kp, block_size)
            k, v = (kv.read_rows(c, layer, jnp.maximum(slots, 0), devices) for c in (k_cache, v_cache))
            seen = kp <= last
            k, v = (jnp.where(seen[:, None], x, 0).reshape(kt, hkv, d) for x in (k, v))
            s = jnp.einsum("ckgd,skd->kgcs", qi, k, preferred_element_type=jnp.float32)
            s = soft_cap(s / att.score_divisor, att.attn_softcap)
            mask = kp[None, :] <= qp[:, None]
            if window:
                mask = mask & (kp[None, :] > qp[:, None] - window)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, -1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            scale = jnp.exp(m - m_new)
            pv = jnp.einsum("kgcs,skd->kgcd", p.astype(dt), v, preferred_element_type=jnp.float32)
            return j + 1, m_new, l * scale + jnp.sum(p, -1, keepdims=True), acc * scale + pv

        c = rows.shape[0]
        start = (jnp.asarray(lo, jnp.int32), jnp.full((hkv, g, c, 1), jnp.finfo(jnp.float32).min),
                 jnp.zeros((hkv, g, c, 1), jnp.float32), jnp.zeros((hkv, g, c, d), jnp.float32))
        _, m, l, acc = jax.lax.while_loop(lambda carry: carry[0] < hi, body, start)
        if sink is not None:  # one more key of value 0 whose logit is the sink
            top = jnp.maximum(m, sink)
            acc, l = acc * jnp.exp(m - top), l * jnp.exp(m - top) + jnp.exp(sink - top)
        o = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)  # a query with no key: 0, as the reference
        return jnp.transpose(o, (2, 0, 1, 3)).reshape(c, att.q_size)

    out = jnp.zeros((t, att.q_size), jnp.float32)
    for group in items:  # each row is one item's own in exactly one group
        outs = jax.lax.map(item, tuple(group))  # [N, C, q_size]
        rows = jnp.where(group.valid, group.rows, t).reshape(-1)  # not an item's own row: dropped
        out = out.at[rows].set(outs.reshape(rows.shape[0], -1), mode="drop")
    return out
