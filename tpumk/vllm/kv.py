"""vLLM's paged KV cache as tpumk reads and writes it (pure JAX, no vLLM import).

vLLM's TPU runner (tpu_inference) allocates ONE array per attention layer:
`[blocks, block_size, ceil(2 * kv_heads / packing), packing, head_dim rounded up to 128]`,
where the K of KV head h is combined head 2h and its V is 2h + 1 (`packing` = 32 bits / the
dtype's bits: 1 for float32, 2 for bfloat16). Flattened, row `block * block_size + offset` holds
one token's K and V, heads interleaved, each head padded to 128 lanes.

The megakernel reads ONE stacked cache `[layers, pages, page_size, kv_heads * head_dim]` for K and
one for V, and its layer loop is a traced loop (one per segment of same-kind layers): a DMA
cannot pick its source among L separate arrays by a traced layer index. vLLM's runner allocates
per layer whatever attention backend is registered, so neither reading vLLM's arrays in place
nor a backend with tpumk's layout is open without changing vLLM's allocator. So a decode step
gathers its sequences' rows into the kernel's layout (`gather_batch`), runs the kernel, and
writes the rows it added back into vLLM's arrays (`write_rows`): the cost is one extra read and
write of the batch's KV rows per step (docs/serving-vllm.md says so).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpumk.plan.geometry import LANE


def padded_head_dim(head_dim: int) -> int:
    """The head width vLLM's TPU cache stores (rounded up to whole 128-lane blocks)."""
    return -(-head_dim // LANE) * LANE


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype) -> tuple[int, ...]:
    """One layer's cache shape as vLLM's TPU runner allocates it (for tests and checks)."""
    packing = max(1, 4 // jnp.dtype(dtype).itemsize)
    return (num_blocks, block_size, -(-2 * kv_heads // packing), packing, padded_head_dim(head_dim))


def _rows(layer_cache: jax.Array, kv_heads: int) -> jax.Array:
    """[blocks * block_size, 2 * kv_heads, padded head_dim]: one row per cached token."""
    blocks, bs = layer_cache.shape[:2]
    return layer_cache.reshape(blocks * bs, -1, layer_cache.shape[-1])[:, :2 * kv_heads]


def read_rows(layer_cache: jax.Array, slots: jax.Array, kv_heads: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """K and V of the tokens at `slots` (any shape S): each [*S, kv_heads * head_dim]."""
    rows = _rows(layer_cache, kv_heads)[slots][..., :head_dim]  # [*S, 2 * kv_heads, head_dim]
    k, v = rows[..., 0::2, :], rows[..., 1::2, :]
    return k.reshape(*slots.shape, kv_heads * head_dim), v.reshape(*slots.shape, kv_heads * head_dim)


def write_rows(layer_cache: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array, kv_heads: int,
               head_dim: int) -> jax.Array:
    """`layer_cache` with the tokens at `slots` [n] set to k, v [n, kv_heads * head_dim]; a slot
    outside the cache (e.g. -1 or past the end: a padding token) writes nothing."""
    n = slots.shape[0]
    total = layer_cache.shape[0] * layer_cache.shape[1]
    kv = jnp.stack([k.reshape(n, kv_heads, head_dim), v.reshape(n, kv_heads, head_dim)], axis=2)
    kv = kv.reshape(n, 2 * kv_heads, head_dim).astype(layer_cache.dtype)
    flat = layer_cache.reshape(total, -1, layer_cache.shape[-1])
    slots = jnp.where((slots >= 0) & (slots < total), slots, total)  # dropped, never wrapped
    flat = flat.at[slots, :2 * kv_heads, :head_dim].set(kv, mode="drop")
    return flat.reshape(layer_cache.shape)


def token_slots(block_tables: jax.Array, seqs: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """vLLM's flat row of sequence `seqs`' token at `positions` (same shapes): the block table
    entry of its block times block_size plus its offset; -1 where the position is negative."""
    blk = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    slot = block_tables[seqs, blk] * block_size + positions % block_size
    return jnp.where(positions >= 0, slot, -1)


def gather_batch(caches: list, block_tables: jax.Array, lengths: jax.Array, kv_heads: int, head_dim: int,
                 block_size: int, context: int, page_size: int, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """The first `lengths[b]` rows of each sequence b (rows past it zero) from vLLM's per-layer
    arrays, as the megakernel's stacked K and V `[layers, num_pages, page_size, kv_heads *
    head_dim]`: sequence b on pages b * context / page_size onwards, in order (`kernel_tables`)."""
    b = block_tables.shape[0]
    t = jnp.arange(context, dtype=jnp.int32)
    seqs = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, context))
    slots = token_slots(block_tables, seqs, jnp.broadcast_to(t, (b, context)), block_size)
    keep = (t[None, :] < lengths[:, None])[..., None]
    pages = b * context // page_size
    ks, vs = [], []
    for layer in caches:
        k, v = read_rows(layer, jnp.maximum(slots, 0), kv_heads, head_dim)
        for out, rows in ((ks, k), (vs, v)):
            rows = jnp.where(keep, rows, 0).reshape(pages, page_size, kv_heads * head_dim)
            out.append(jnp.pad(rows, ((0, num_pages - pages), (0, 0), (0, 0))))
    return jnp.stack(ks), jnp.stack(vs)


def kernel_tables(batch: int, context: int, page_size: int) -> jax.Array:
    """The block tables of `gather_batch`'s layout: sequence b's pages in order."""
    per = context // page_size
    return jnp.arange(batch * per, dtype=jnp.int32).reshape(batch, per)


def new_rows(k: jax.Array, positions: jax.Array, context: int, page_size: int) -> jax.Array:
    """Each sequence's row at `positions` [B] from a stacked cache in `gather_batch`'s layout:
    [layers, B, width] (a negative position reads page 0's row: its write is dropped anyway)."""
    per = context // page_size
    p = jnp.maximum(positions, 0)
    pages = jnp.arange(positions.shape[0], dtype=jnp.int32) * per + p // page_size
    return k[:, pages, p % page_size]
