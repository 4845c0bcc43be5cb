"""vLLM's paged KV cache as the plugin has vLLM allocate it: the megakernel's own stacked layout
(pure JAX, no vLLM import).

The megakernel reads ONE stacked cache `[layers, pages, page_size, kv_heads * head_dim]` for K and
one for V (`tpumk.model.reference.KVCache`), and its layer loop is a traced loop: a DMA cannot pick
its source among L per-layer arrays by a traced layer index. So the plugin does not give vLLM L
attention layers: it declares two KV-cache layers, `K_LAYER` and `V_LAYER`, each one array of
every layer's keys (values) stacked, `[layers, blocks, block_size, kv width]`
(`tpumk.vllm.backend`, which the plugin registers with tpu_inference as the `tpumk` attention
backend). vLLM then allocates exactly the two arrays the kernel takes, its block tables are the
kernel's page tables (the kernel's page size is vLLM's block size), and a decode step passes
vLLM's arrays to the kernel as they are: no gather, no re-layout, no write-back; the kernel
writes the new rows in place (its cache operands are aliased to its outputs, and vLLM donates
its cache to the step). The ragged prefill (`tpumk.vllm.prefill`) reads and writes the same two
arrays. vLLM's memory budget stays right: each declared layer's bytes per block are
`layers x block_size x width x itemsize` (the backend's shape at one block), so one block of the
two is every layer's K and V of block_size tokens, and its block count, KV usage metric and
prefix cache count blocks as they would for L layers of RPA's layout of the same bytes.

Tensor parallel (vLLM's --tensor-parallel-size N): tpu_inference multiplies the third axis of the
backend's shape by N and splits it over its mesh's 'model' axis, so each array is `[layers,
blocks, N x block_size, width / N]` and device d's shard is the `[layers, blocks, block_size,
width / N]` cache of its own KV heads that tpumk's N-device kernel reads (`cache_shape`);
`read_rows` / `write_rows` address a token's row of device d at `d x block_size + offset`.

Why this and not the alternatives (docs/serving-vllm.md, "Reading vLLM's cache in place"):
reading tpu_inference's RPA v3 layout in the kernel is ruled out (a bfloat16 cache packs a
head's K and V into the same 32-bit words, and the L arrays remain); a `pl.when` per layer
around each DMA start compiles but costs +28 s / +72 s deviceless at 36 layers (TPU7x,
benchmarks/layer_select_compile.py) and grows with layers x DMA starts. Stacking needs neither.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# the two KV-cache layers the plugin declares to vLLM (tpumk.vllm.backend), each one stacked array
K_LAYER = "tpumk.kv.k"
V_LAYER = "tpumk.kv.v"


def layer_names(cfg) -> tuple[str, ...]:
    """The KV-cache layers the plugin declares for `cfg` (the kernel's run model): K and V, or for
    an MLA model K alone, the latent array (`[layers, blocks, block_size, latent_cache_lanes]`:
    the kernel's MLA cache has no V; tpumk.vllm.mla_prefill)."""
    return (K_LAYER,) if cfg.is_mla else (K_LAYER, V_LAYER)


def cache_shape(layers: int, num_blocks: int, block_size: int, width: int, devices: int = 1) -> tuple[int, int, int, int]:
    """The shape of each of the two arrays vLLM allocates: [layers, blocks, block_size, width];
    on `devices` > 1 (tensor parallel) [layers, blocks, devices x block_size, width / devices]:
    device d's KV heads of a block's tokens in rows [d x block_size, (d + 1) x block_size)."""
    return (layers, num_blocks, devices * block_size, width // devices)


def layout_problem(shape, dtype, layers: int, width: int, block_size: int, want_dtype, devices: int = 1) -> str | None:
    """Why an array vLLM passes as K or V is not the stacked layout the kernel reads (None: it is)."""
    shape = tuple(int(n) for n in shape)
    want = cache_shape(layers, 0, block_size, width, devices)
    if len(shape) != 4 or (shape[0], *shape[2:]) != (want[0], *want[2:]) or \
            jnp.dtype(dtype) != jnp.dtype(want_dtype):
        return (f"vLLM's KV cache array is {jnp.dtype(dtype).name} {list(shape)}: expected "
                f"{jnp.dtype(want_dtype).name} [{want[0]}, blocks, {want[2]}, {want[3]}] (tpumk's stacked layout: "
                "start vLLM with --attention-backend tpumk)")
    return None


def _split(cache: jax.Array, slots: jax.Array, devices: int = 1) -> tuple[jax.Array, jax.Array]:
    """(block, row in block) of each flat slot; a slot outside [0, blocks * block_size) gets the
    block index `blocks` (past the array: a write there is dropped)."""
    blocks, bs = cache.shape[1], cache.shape[2] // devices
    ok = (slots >= 0) & (slots < blocks * bs)
    return jnp.where(ok, slots // bs, blocks), jnp.where(ok, slots % bs, 0)


def _device_rows(row: jax.Array, block_size: int, devices: int) -> jax.Array:
    """[*S] rows in a block -> [*S, devices]: each device's row of the same token (`cache_shape`)."""
    return row[..., None] + block_size * jnp.arange(devices, dtype=row.dtype)


def read_rows(cache: jax.Array, layer: int, slots: jax.Array, devices: int = 1) -> jax.Array:
    """Layer `layer`'s rows [*S, width] of the tokens at flat `slots` (any shape S, in range);
    on many devices each device's part side by side (the heads in order)."""
    block, row = _split(cache, slots, devices)
    block = jnp.minimum(block, cache.shape[1] - 1)
    if devices == 1:
        return cache[layer, block, row]
    parts = cache[layer, block[..., None], _device_rows(row, cache.shape[2] // devices, devices)]  # [*S, N, W / N]
    return parts.reshape(*slots.shape, -1)


def write_rows(cache: jax.Array, layer: int, slots: jax.Array, rows: jax.Array, devices: int = 1) -> jax.Array:
    """`cache` with layer `layer`'s tokens at flat `slots` [n] set to rows [n, width] (on many
    devices each device's lanes into its own rows); a slot outside the cache (-1 or past the
    end: a padding token) writes nothing."""
    block, row = _split(cache, slots, devices)
    rows = rows.astype(cache.dtype)
    if devices == 1:
        return cache.at[layer, block, row].set(rows, mode="drop")
    parts = rows.reshape(rows.shape[0], devices, -1)
    return cache.at[layer, block[:, None], _device_rows(row, cache.shape[2] // devices, devices)].set(parts,
                                                                                                   mode="drop")


def token_slots(block_tables: jax.Array, seqs: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """vLLM's flat row of sequence `seqs`' token at `positions` (same shapes): the block table
    entry of its block times block_size plus its offset; -1 where the position is negative."""
    blk = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)
    slot = block_tables[seqs, blk] * block_size + positions % block_size
    return jnp.where(positions >= 0, slot, -1)


def ragged_token_rows(positions: jax.Array, query_start_loc: jax.Array, block_tables: jax.Array,
                      num_reqs: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """A ragged batch's T tokens (vLLM's flat layout: request r's tokens at query_start_loc[r] ..
    [r + 1]): (each token's position or -1 past the last request's rows, its flat cache row or
    -1 (`token_slots`))."""
    i = jnp.arange(positions.shape[0], dtype=jnp.int32)
    valid = i < query_start_loc[num_reqs]
    req = jnp.clip(jnp.searchsorted(query_start_loc[1:], i, side="right"), 0, block_tables.shape[0] - 1)
    pos = jnp.where(valid, positions, -1).astype(jnp.int32)
    return pos, token_slots(block_tables, req, pos, block_size)


def kernel_tables(block_tables: jax.Array, batch: int, pages_per_seq: int) -> jax.Array:
    """vLLM's block tables [S, blocks per request] as the kernel's page tables [batch,
    pages_per_seq]: the same entries (the kernel's page size is vLLM's block size), request
    slots past S padded with rows of block 0 (vLLM's null block; those slots run at position -1,
    which reads and writes nothing), columns cut or padded to the kernel's pages per sequence."""
    s, n = block_tables.shape
    t = block_tables[:min(s, batch), :min(n, pages_per_seq)].astype(jnp.int32)
    return jnp.pad(t, ((0, batch - t.shape[0]), (0, pages_per_seq - t.shape[1])))


def decode_step_hbm_bytes(plan) -> dict[str, float]:
    """HBM bytes one decode step of the plugin moves, by tpumk's plan, at the plan's batch and
    full context: the kernel's own (`plan.hbm_bytes`, what `tpumk build` reports: weights, the
    KV pages it streams and the rows it writes, activations) plus what
    `tpumk.vllm.steps.decode_step` adds around it on vLLM's arrays: nothing but the page tables
    (`kernel_tables` reads vLLM's block table rows and writes the kernel's, int32). vLLM's K and V
    arrays go into the kernel as they are, aliased to its outputs (no gather, no write-back).
    Counted logically (each array read or written once), not by XLA's fusions."""
    tables = plan.batch * (plan.context // plan.page_size) * 4
    return {"kernel": float(plan.hbm_bytes), "page_tables": float(2 * tables)}


def held_bytes_per_sequence(cfg, context: int, block_size: int) -> dict[str, int]:
    """KV bytes one sequence of `context` tokens holds in vLLM's pool of a model-dtype cache, by
    block counts (`cfg`: the model whose rows the cache holds; the plugin's is the kernel's run
    model, `plan.whole_model`):

    - "stacked": the plugin's cache (tpumk.vllm.backend declares one full-attention cache for
      every layer), every layer's rows of all ceil(context / block_size) blocks, a sliding-window
      layer's included;
    - "windows_trimmed": what a cache giving each window layer vLLM's own sliding-window spec
      would hold while the sequence decodes: the full layers' blocks as above, a window layer's
      only ceil(window / block_size) + 1 (vLLM 0.32's `SlidingWindowSpec.
      max_admission_blocks_per_request` at one token in flight; the window need not start on a
      block boundary).
    The difference is what serving window layers on one page table costs in memory; the kernel
    still reads only each window's pages (tpumk.plan.geometry)."""
    row = cfg.attention.kv_size * cfg.dtype_bytes * 2  # K and V of one token in one layer
    full_blocks = -(-context // block_size)
    layers = cfg.pattern.attention_layers
    trimmed = sum(min(full_blocks, -(-cfg.pattern.window(i) // block_size) + 1) if cfg.pattern.window(i)
                  else full_blocks for i in layers)
    return {"stacked": len(layers) * full_blocks * block_size * row, "windows_trimmed": trimmed * block_size * row}
