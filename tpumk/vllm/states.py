"""A hybrid model's linear-attention state pool in vLLM's cache (pure JAX, no vLLM import).

The megakernel keeps each sequence's linear-layer state in a pool (`tpumk.model.linear_attention.
LinearStates`: recurrent state, convolution window and pending rows per linear layer and slot, a
sequence reading its slot through `slots`). The plugin has vLLM allocate that pool as one more
KV-cache layer, `STATE_LAYER` (tpumk.vllm.backend declares it beside K and V):
`[linear layers, blocks, block_size, width]` in the model dtype, where one block's
`block_size x width` elements hold one slot's float32 entry of each linear layer (bit for bit:
a 2-byte dtype's array is read as float32 pairs), padded to whole 128-lane rows. So:

- vLLM's memory budget counts it: the declared layer's bytes per block are one slot's entry, and
  vLLM's block count shrinks by them;
- a request's slot is its FIRST block (`block_tables[r, 0]`): vLLM gives a running request its
  own blocks and never moves them (prefix caching, which would share a first block, is refused at
  start-up), so the slot is stable from the request's first chunk to its last token, and a
  request preempted and recomputed starts again at position 0;
- a slot is reset (zero state, window and pending rows) by the step in which its request's
  first token (position 0) arrives (`reset_new`), whatever request held that block before.

Every step unpacks the pool (`pool`), runs (the kernel or the reference layers), and packs it
back (`commit`). Pending rows: the kernel leaves each step's own token pending (the state it
writes back is the one before it; the next step replays it), the reference applies a prompt's
tokens at once: the pool's `counts` are kept in the rows themselves (a row replays when its live
lane is 1; every slot's count is 1 going in, and a slot whose count a step set to 0 has its row
cleared going out).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from tpumk.model import linear_attention as la

STATE_LAYER = "tpumk.kv.state"
LANES = 128


def entry_floats(cfg) -> tuple[int, int, int]:
    """float32 values of one slot's entry in one linear layer: (recurrent, window, pending row)."""
    lin = cfg.linear
    return math.prod(lin.state_shape), (lin.linear_conv - 1) * lin.conv_dim, la.pending_offsets(lin)[2]


def row_width(cfg, block_size: int) -> int:
    """The row width of the state array (model-dtype elements, whole 128-lane rows) whose
    `block_size` rows hold one slot's entry."""
    need = 4 * sum(entry_floats(cfg))  # bytes
    per_row = -(-need // (block_size * cfg.dtype_bytes))
    return -(-per_row // LANES) * LANES


def _as_f32(arr: jax.Array) -> jax.Array:
    """[L, P, block, width] of the model dtype -> [L, P, F] float32, the same bits."""
    n, p = arr.shape[:2]
    if arr.dtype == jnp.float32:
        return arr.reshape(n, p, -1)
    per = 4 // arr.dtype.itemsize
    return lax.bitcast_convert_type(arr.reshape(n, p, -1, per), jnp.float32)


def _from_f32(flat: jax.Array, like: jax.Array) -> jax.Array:
    if like.dtype == jnp.float32:
        return flat.reshape(like.shape)
    return lax.bitcast_convert_type(flat, like.dtype).reshape(like.shape)


def request_slots(block_tables: jax.Array, num_reqs, n: int) -> jax.Array:
    """Each of the first `n` request slots' state slot (its first block), -1 past num_reqs
    (a slot outside the pool: read clipped, written nowhere)."""
    s = min(n, block_tables.shape[0])
    first = jnp.where(jnp.arange(s) < num_reqs, block_tables[:s, 0].astype(jnp.int32), -1)
    return jnp.pad(first, (0, n - s), constant_values=-1)


def reset_new(arr: jax.Array, positions: jax.Array, query_start_loc: jax.Array, block_tables: jax.Array,
              num_reqs) -> jax.Array:
    """The state array with the slot of every live request whose chunk starts at position 0
    zeroed (a new request, or one recomputed after preemption, on a block that another may have
    left a state in)."""
    s = query_start_loc.shape[0] - 1
    starts = jnp.clip(query_start_loc[:-1], 0, positions.shape[0] - 1)
    new = (jnp.arange(s) < num_reqs) & (query_start_loc[1:] > query_start_loc[:-1]) & (positions[starts] == 0)
    slots = request_slots(block_tables, num_reqs, s)
    slots = jnp.where(new & (slots >= 0), slots, arr.shape[1])  # past the pool: dropped
    return arr.at[:, slots].set(0, mode="drop")


def pool(arr: jax.Array, cfg, slots: jax.Array) -> la.LinearStates:
    """The state array as the pool the kernel and the reference read, `slots` [B] its sequences'."""
    rec, win, pend = entry_floats(cfg)
    lin = cfg.linear
    flat = _as_f32(arr)
    n, p = flat.shape[:2]
    return la.LinearStates(flat[..., :rec].reshape(n, p, *lin.state_shape),
                           flat[..., rec:rec + win].reshape(n, p, lin.linear_conv - 1, lin.conv_dim),
                           flat[..., rec + win:rec + win + pend].reshape(n, p, 1, pend),
                           jnp.ones((p,), jnp.int32), slots.astype(jnp.int32))


def commit(arr: jax.Array, states: la.LinearStates) -> jax.Array:
    """`states` (after a step) packed back into the state array: a slot whose count is 0 has
    its pending row cleared (nothing to replay)."""
    n, p = arr.shape[:2]
    pending = jnp.where((states.counts > 0)[None, :, None, None], states.pending, 0.0)
    flat = jnp.concatenate([states.recurrent.reshape(n, p, -1), states.conv.reshape(n, p, -1),
                            pending.reshape(n, p, -1)], -1)
    total = _as_f32(arr).shape[-1]
    flat = jnp.pad(flat, ((0, 0), (0, 0), (0, total - flat.shape[-1])))
    return _from_f32(flat, arr)
