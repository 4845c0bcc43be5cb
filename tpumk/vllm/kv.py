"""vLLM's paged KV cache as tpumk reads and writes it (pure JAX, no vLLM import).

vLLM's TPU runner (tpu_inference 0.32) allocates ONE array per attention layer, in the layout of
its ragged paged attention (RPA v3) kernel, `[blocks, block_size, G, packing, lanes]` with
`packing` = 32 bits / the cache dtype's bits (1 for float32, 2 for bfloat16) and G * packing
"combined heads" per token. The runner first pads the head width (`get_padded_head_dim`): 64
stays 64, any other width is rounded up to whole 128-lane blocks. Then:

- head_dim 64 (Llama-3.2-1B, SmolLM2; the `kernel_hd64` kernel): one combined head per KV head,
  `[K | V]` side by side in its 128 lanes (K in lanes 0-63, V in 64-127); G * packing = kv_heads
  rounded up to a multiple of packing (bfloat16 with an odd head count: one zero head);
- any other head_dim (the `kernel` kernel): two combined heads per KV head, K of head h at 2h
  and V at 2h + 1, each padded to the padded width; G * packing = 2 * kv_heads rounded up to a
  multiple of packing.

Either way, flattened to `[blocks * block_size, G * packing, lanes]`, a token's row holds its K
and V in its first combined heads and lanes (`_used`: kv_heads x 128 lanes for head_dim 64,
2 * kv_heads x head_dim otherwise), in the order [head][K, V][head_dim]: that is all read_rows /
write_rows need. A cache in any other shape (another attention backend, a batched RPA layout)
is refused by `layout_problem` rather than read wrong.

The megakernel reads ONE stacked cache `[layers, pages, page_size, kv_heads * head_dim]` for K and
one for V, and its layer loop is a traced loop (one per segment of same-kind layers): a DMA
cannot pick its source among L separate arrays by a traced layer index, and vLLM's runner
allocates one array per layer (`create_kv_caches`) whatever attention backend is registered. So
a decode step gathers its sequences' rows into the kernel's layout (`gather_batch`), runs the
kernel, and writes the rows it added back into vLLM's arrays (`write_rows`): by tpumk's plan that
step moves 1.48x the kernel's own HBM bytes at qwen3-8b, batch 8, context 4096
(`decode_step_hbm_bytes`, docs/serving-vllm.md).

What would remove the copies, by evidence (docs/serving-vllm.md, "Reading vLLM's cache in
place"): reading this RPA layout in the kernel is ruled out (a bfloat16 cache packs a head's K
and V into the same 32-bit words, and the L arrays remain); tpu_inference 0.32's
`register_attention_backend` lets a plugin choose each layer's array shape, so a backend in the
kernel's page layout needs no re-layout; and a kernel taking the L arrays as refs with a
`pl.when` per layer around each DMA start compiles, at a cost that grows with layers x DMA
starts (benchmarks/layer_select_compile.py: +28 s / +72 s deviceless for TPU7x at 36 layers and
48 / 112 page DMA starts per cache and layer, once per build). Neither is built yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpumk.plan.geometry import LANE

FUSED_HEAD_DIM = 64  # tpu_inference keeps this width unpadded, K and V of a head in one 128-lane row


def padded_head_dim(head_dim: int) -> int:
    """The head width vLLM's TPU runner gives its cache (tpu_inference's get_padded_head_dim)."""
    return head_dim if head_dim == FUSED_HEAD_DIM else -(-head_dim // LANE) * LANE


def packing(dtype) -> int:
    """Values of `dtype` per 32-bit word: how many combined heads share a sublane row."""
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def _used(kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(combined heads, lanes) of a token's row that hold its K and V, in [head][K, V][head_dim]
    order once flattened."""
    if padded_head_dim(head_dim) == FUSED_HEAD_DIM:
        return kv_heads, 2 * head_dim
    return 2 * kv_heads, head_dim


def row_shape(kv_heads: int, head_dim: int, dtype) -> tuple[int, int, int]:
    """One token's slice of a layer's cache, (G, packing, lanes), as tpu_inference allocates it."""
    p = packing(dtype)
    heads = -(-_used(kv_heads, head_dim)[0] // p)
    lanes = 2 * FUSED_HEAD_DIM if padded_head_dim(head_dim) == FUSED_HEAD_DIM else padded_head_dim(head_dim)
    return heads, p, lanes


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype) -> tuple[int, ...]:
    """One layer's cache shape as vLLM's TPU runner allocates it (for tests and checks)."""
    return (num_blocks, block_size, *row_shape(kv_heads, head_dim, dtype))


def layout_problem(shape, dtype, kv_heads: int, head_dim: int, block_size: int | None = None) -> str | None:
    """Why a layer's cache of `shape` / `dtype` is not the layout tpumk reads (None: it is)."""
    want = row_shape(kv_heads, head_dim, dtype)
    shape = tuple(int(n) for n in shape)
    if len(shape) != 5 or shape[2:] != want or (block_size is not None and shape[1] != block_size):
        bs = "block_size" if block_size is None else str(block_size)
        return (f"vLLM's KV cache of a layer is {jnp.dtype(dtype).name} {list(shape)}: expected [blocks, {bs}, "
                f"{', '.join(map(str, want))}] (tpu_inference's RPA v3 layout for {kv_heads} KV heads of "
                f"head_dim {head_dim})")
    return None


def read_rows(layer_cache: jax.Array, slots: jax.Array, kv_heads: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """K and V of the tokens at `slots` (any shape S): each [*S, kv_heads * head_dim]."""
    problem = layout_problem(layer_cache.shape, layer_cache.dtype, kv_heads, head_dim)
    if problem:
        raise ValueError(problem)
    heads, lanes = _used(kv_heads, head_dim)
    blocks, bs = layer_cache.shape[:2]
    # the rows first, then their used heads and lanes: never a copy of the whole layer
    rows = layer_cache.reshape(blocks * bs, -1, layer_cache.shape[-1])[slots][..., :heads, :lanes]
    rows = rows.reshape(*slots.shape, kv_heads, 2, head_dim)
    k, v = rows[..., 0, :], rows[..., 1, :]
    return k.reshape(*slots.shape, kv_heads * head_dim), v.reshape(*slots.shape, kv_heads * head_dim)


def write_rows(layer_cache: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array, kv_heads: int,
               head_dim: int) -> jax.Array:
    """`layer_cache` with the tokens at `slots` [n] set to k, v [n, kv_heads * head_dim]; a slot
    outside the cache (e.g. -1 or past the end: a padding token) writes nothing."""
    problem = layout_problem(layer_cache.shape, layer_cache.dtype, kv_heads, head_dim)
    if problem:
        raise ValueError(problem)
    n = slots.shape[0]
    total = layer_cache.shape[0] * layer_cache.shape[1]
    heads, lanes = _used(kv_heads, head_dim)
    kv = jnp.stack([k.reshape(n, kv_heads, head_dim), v.reshape(n, kv_heads, head_dim)], axis=2)
    kv = kv.reshape(n, heads, lanes).astype(layer_cache.dtype)
    flat = layer_cache.reshape(total, -1, layer_cache.shape[-1])
    slots = jnp.where((slots >= 0) & (slots < total), slots, total)  # dropped, never wrapped
    flat = flat.at[slots, :heads, :lanes].set(kv, mode="drop")
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


def decode_step_hbm_bytes(plan) -> dict[str, float]:
    """HBM bytes one decode step of the plugin moves, by tpumk's plan, at the plan's batch and
    full context: the kernel's own (`plan.hbm_bytes`, what `tpumk build` reports) plus the copies
    `tpumk.vllm.steps.decode_step` makes around it:

    - gather_read: `gather_batch` reads every context slot of every sequence from vLLM's arrays,
      whole rows (G x packing x lanes), layer by layer (rows past a sequence's length are read,
      then masked);
    - gather_write: it writes the kernel's stacked K and V, `[layers, num_pages, page_size,
      kv_heads * head_dim]` each, whole (pages past the batch's are zeros, written too);
    - write_back: `write_rows` writes each sequence's new row into every layer's array.

    Counted logically (each array read or written once), not by XLA's fusions."""
    true, run = plan.unpadded or plan.whole_model, plan.whole_model
    itemsize = jnp.dtype(true.dtype).itemsize
    heads, p, lanes = row_shape(true.num_kv_heads, true.head_dim, true.dtype)
    vllm_row = heads * p * lanes * itemsize
    layers = true.num_layers
    kernel_width = run.num_kv_heads * run.head_dim * jnp.dtype(run.dtype).itemsize
    return {
        "kernel": float(plan.hbm_bytes),
        "gather_read": float(layers * plan.batch * plan.context * vllm_row),
        "gather_write": float(2 * layers * plan.num_pages * plan.page_size * kernel_width),
        "write_back": float(layers * plan.batch * vllm_row),
    }
