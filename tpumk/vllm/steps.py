"""The programs the vLLM plugin runs on vLLM's KV cache (pure JAX; no vLLM import), and
`serve_step`, the `lax.cond` between them that runs inside vLLM's jitted step.

- `decode_step`: a decode-only batch (one new token per request) through tpumk's megakernel,
  on vLLM's two stacked K and V arrays themselves (tpumk.vllm.kv: the kernel's own layout), vLLM's
  block tables as its page tables: no copy around the kernel.
- `verify_step` (EAGLE-3 speculative decoding, tpumk.vllm.speculative): a batch of at most q_len
  tokens per request (vLLM's verify batch: the last sampled token and k drafts) through the
  megakernel's verify step (q_len = k + 1 rows per request, a request's missing rows at position
  -1), which also returns the hidden states the drafter reads and the logits of every token.
- `ragged_step`: any other batch (prefill chunks, mixed prefill + decode) through the pure-JAX
  reference layers (tpumk.model.reference) with the same weights over the flattened batch,
  writing vLLM's arrays in place and attending through `tpumk.vllm.prefill` (ragged paged
  attention in pure JAX: each request's pages read once per tile of its tokens).

All take vLLM's attention metadata as arrays: `query_start_loc` [S + 1], `seq_lens` [S] (the KV
length including this step's tokens), `block_tables` [S, blocks per request], `num_reqs` (a
scalar array) for the S request slots of the batch, and return ((k, v), rows [T, vocab] f32):
the logits of each request's last token at that token's row (what vLLM's runner picks by
`logits_indices`), zeros elsewhere; with taps, the logits of every token of the batch and the
taps third.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from tpumk.model import reference as ref
from tpumk.model.config import ModelConfig
from tpumk.model.reference import KVCache
from tpumk.model import linear_attention as la
from tpumk.model.ops import jnp_dtype
from tpumk.vllm import kv, mla_prefill, prefill, states


def _last_rows(query_start_loc: jax.Array, num_reqs: jax.Array) -> jax.Array:
    """Each request slot's last token row (-1 for slots past num_reqs)."""
    s = query_start_loc.shape[0] - 1
    last = query_start_loc[1:] - 1
    return jnp.where(jnp.arange(s) < num_reqs, last, -1)


def _kernel_batch(q: int, batch: int, input_ids: jax.Array, positions: jax.Array, query_start_loc: jax.Array,
                  seq_lens: jax.Array, num_reqs: jax.Array):
    """vLLM's flattened batch as the kernel's [batch, q] step: request slot b's token j (j < its
    count n_b) is row query_start_loc[b] + j; rows j >= n_b, and slots past num_reqs (up to
    `batch`), run at position -1, which writes nothing, is no key and moves no length. Returns
    (tokens [batch, q], positions [batch, q], lengths [batch]: the rows cached before the step,
    seq_lens - n_b; rows [s * q]: each kernel row's batch row or -1; s: the slots read)."""
    t = input_ids.shape[0]
    # vLLM pads the request slots to a bucket that may pass max_num_seqs (<= batch, checked at
    # start-up): the live requests are all among the first `batch`
    s = min(seq_lens.shape[0], batch)
    query_start_loc, seq_lens = query_start_loc[:s + 1], seq_lens[:s]
    live = jnp.arange(s) < num_reqs
    count = jnp.where(live, query_start_loc[1:] - query_start_loc[:-1], 0)
    j = jnp.arange(q, dtype=jnp.int32)
    real = j[None, :] < count[:, None]  # [s, q]
    rows = query_start_loc[:-1, None] + j[None, :]
    at = jnp.clip(rows, 0, t - 1)
    tokens = jnp.zeros((batch, q), jnp.int32).at[:s].set(jnp.where(real, input_ids[at], 0))
    pos = jnp.full((batch, q), -1, jnp.int32).at[:s].set(jnp.where(real, positions[at], -1))
    lengths = jnp.zeros((batch,), jnp.int32).at[:s].set(jnp.where(live, seq_lens - count, 0))
    return tokens, pos, lengths, jnp.where(real, rows, -1).reshape(-1), s


def _scatter_rows(num_tokens: int, rows: jax.Array, logits: jax.Array) -> jax.Array:
    out = jnp.zeros((num_tokens, logits.shape[-1]), jnp.float32)
    return out.at[jnp.where(rows >= 0, rows, num_tokens)].set(logits.astype(jnp.float32), mode="drop")


def serve_step(step: Callable, packed, params: dict, cfg: ModelConfig, plan_shape: dict, k: jax.Array, v: jax.Array,
               input_ids: jax.Array, positions: jax.Array, query_start_loc: jax.Array, seq_lens: jax.Array,
               block_tables: jax.Array, num_reqs: jax.Array, block_size: int, max_context: int,
               on_step: Callable[[str], None] | None = None,
               unpack: Callable[[dict], dict] | None = None,
               devices: int = 1, taps: tuple[int, ...] = (), verify: tuple[Callable, int] | None = None,
               state: jax.Array | None = None):
    """What the plugin's model runs inside vLLM's jitted step: `decode_step` when every live
    request has one new token, else `ragged_step` (`params` / `cfg`: the kernel's run model), as
    a `lax.cond` on the metadata (vLLM decides on the host, then traces one program per token
    bucket). Every branch takes and returns vLLM's K and V arrays, updated in place. `on_step`
    ("decode", "verify" or "ragged") is called inside the branch taken (TPUMK_VLLM_COUNT_STEPS). `unpack`
    (tpumk.kernel.unpack.Unpacker): the ragged branch reads its weights back from `packed`
    instead of `params` (the device holds the weights once), inside that branch only, so a
    decode step never pays for it. `devices`: tensor parallel, the K and V arrays in
    `kv.cache_shape`'s layout of that many devices (`step` is then the many-device step reading
    it, `make_decode_step(..., cache_split="rows")`).

    `taps` (eagle3 speculative decoding: the target layers the drafter reads): every branch
    returns ((k, v), rows of every token, taps), the drafter reading them after every step.
    `verify` = (the megakernel's verify step with those taps, its q_len): a batch whose live
    requests each have 1 to q_len tokens (vLLM's verify batches of k + 1; fewer near
    max_model_len or the token budget; decode-only batches; short prefill chunks) runs
    `verify_step`, any other `ragged_step` with the taps. Without `verify` (an artifact's program
    has no verify step) every batch runs `ragged_step` with the taps.

    `state`: a hybrid model's linear-attention state array (tpumk.vllm.states), which every
    branch takes and returns after K and V (the cache is then (k, v, state)); a request whose
    first token arrives in this batch has its slot reset first."""
    if state is not None:
        state = states.reset_new(state, positions, query_start_loc, block_tables, num_reqs)

    def ragged(cache):
        if on_step is not None:
            on_step("ragged")
        return ragged_step(params if unpack is None else unpack(packed), cfg, *cache[:2], input_ids, positions,
                           query_start_loc, block_tables, num_reqs, block_size, max_context, devices=devices,
                           taps=taps, state=cache[2] if len(cache) > 2 else None)

    live = jnp.arange(seq_lens.shape[0]) < num_reqs
    counts = query_start_loc[1:] - query_start_loc[:-1]
    if taps:
        if verify is None:  # every batch, its taps returned too
            return ragged((k, v))
        verify_fn, q_len = verify

        def verified(cache):
            if on_step is not None:
                on_step("verify")
            return verify_step(verify_fn, packed, {**plan_shape, "q_len": q_len}, cfg.hidden_size, *cache,
                               input_ids, positions, query_start_loc, seq_lens, block_tables, num_reqs)

        fits = jnp.all((counts <= q_len) | ~live)
        return jax.lax.cond(fits, verified, ragged, (k, v))
    cache = (k, v) if state is None else (k, v, state)
    decode_only = jnp.all((counts == 1) | ~live)

    def decode(cache):
        if on_step is not None:
            on_step("decode")
        return decode_step(step, packed, plan_shape, *cache[:2], input_ids, positions, query_start_loc, seq_lens,
                           block_tables, num_reqs, state=cache[2] if len(cache) > 2 else None, cfg=cfg)

    return jax.lax.cond(decode_only, decode, ragged, cache)


def decode_step(step: Callable, packed, plan_shape: dict, k: jax.Array, v: jax.Array, input_ids: jax.Array,
                positions: jax.Array, query_start_loc: jax.Array, seq_lens: jax.Array, block_tables: jax.Array,
                num_reqs: jax.Array, state: jax.Array | None = None, cfg: ModelConfig | None = None):
    """A decode-only batch through `step` (a tpumk decode step: (packed, tokens [B, 1],
    positions [B, 1], KVCache) -> (logits, KVCache), B = plan_shape["batch"] >= S) on vLLM's
    stacked K and V arrays themselves (tpumk.vllm.kv): they go into the kernel as they are, with
    vLLM's block tables as its page tables (the step's page size is vLLM's block size), and the
    kernel's returned arrays are the new cache (written in place: aliased, and vLLM donates it).

    `plan_shape`: batch, context, page_size of the step's plan. Request slot b's token is row
    query_start_loc[b]; slots past num_reqs (and up to B) run at position -1, which writes
    nothing and reads nothing.

    `state` (a hybrid model: tpumk.vllm.states; `cfg` the kernel's run model): the state array,
    each request reading and writing its first block's slot; returned third in the cache tuple."""
    batch, per = plan_shape["batch"], plan_shape["context"] // plan_shape["page_size"]
    tokens, pos, lengths, rows, s = _kernel_batch(1, batch, input_ids, positions, query_start_loc, seq_lens, num_reqs)
    pool = None if state is None else states.pool(state, cfg, states.request_slots(block_tables, num_reqs, batch))
    cache = KVCache(k, v, kv.kernel_tables(block_tables, batch, per), lengths, pool)
    logits, cache = step(packed, tokens, pos, cache)
    out = (cache.k, cache.v) if state is None else (cache.k, cache.v, states.commit(state, cache.states))
    return out, _scatter_rows(input_ids.shape[0], rows, logits[:s, 0])


def verify_step(step: Callable, packed, plan_shape: dict, hidden: int, k: jax.Array, v: jax.Array,
                input_ids: jax.Array, positions: jax.Array, query_start_loc: jax.Array, seq_lens: jax.Array,
                block_tables: jax.Array, num_reqs: jax.Array):
    """A batch of at most q = plan_shape["q_len"] tokens per live request through `step`, the
    megakernel's verify step with taps ((packed, tokens [B, q], positions [B, q], KVCache) ->
    (logits [B, q, V], KVCache, taps [B, q, n, H])), on vLLM's stacked K and V arrays in place
    as `decode_step`, in `_kernel_batch`'s rows: request slot b's token j (j < its count n_b) is
    row query_start_loc[b] + j of the batch; rows j >= n_b, and slots past num_reqs (up to B), run
    at position -1 (reference.py's defined behaviour, the kernel's too). The cache holds
    seq_lens[b] - n_b rows of request b before the step.

    Returns ((k, v), logits [T, V] f32 of every token at its row, zeros past the last request's
    rows, taps: a list of [T, hidden] f32 (ragged_step's residual stream, the lanes past the
    kernel's model width zero), zeros at rows no request holds)."""
    batch, q, per = plan_shape["batch"], plan_shape["q_len"], plan_shape["context"] // plan_shape["page_size"]
    t = input_ids.shape[0]
    tokens, pos, lengths, rows, s = _kernel_batch(q, batch, input_ids, positions, query_start_loc, seq_lens, num_reqs)
    cache = KVCache(k, v, kv.kernel_tables(block_tables, batch, per), lengths)
    logits, cache, tapped = step(packed, tokens, pos, cache)
    n, width = tapped.shape[2], tapped.shape[3]
    where = jnp.where(rows >= 0, rows, t)
    tapped = tapped[:s].reshape(s * q, n, width).astype(jnp.float32)
    out = [jnp.zeros((t, hidden), jnp.float32).at[where, :width].set(tapped[:, i], mode="drop") for i in range(n)]
    return (cache.k, cache.v), _scatter_rows(t, rows, logits[:s].reshape(s * q, -1)), out


def ragged_step(params: dict, cfg: ModelConfig, k_cache: jax.Array, v_cache: jax.Array, input_ids: jax.Array,
                positions: jax.Array, query_start_loc: jax.Array, block_tables: jax.Array, num_reqs: jax.Array,
                block_size: int, max_context: int, query_tile: int = prefill.QUERY_TILE,
                key_tile: int = prefill.KEY_TILE,
                short_tile: int = prefill.SHORT_TILE, devices: int = 1, taps: tuple[int, ...] = (),
                state: jax.Array | None = None):
    """Any batch through the reference layers: T tokens [T] at `positions` [T], token i of the
    request whose rows [query_start_loc[r], query_start_loc[r + 1]) hold it, on vLLM's stacked K
    and V arrays (tpumk.vllm.kv; their row width is `cfg`'s KV width: the plugin passes the
    kernel's run model and its weights, `plan.whole_model`). Each layer writes the tokens' K and V
    into its slice of those arrays, then every token attends to its request's rows 0 .. its
    position (the earlier tokens of the same chunk included) through `tpumk.vllm.prefill`, which
    reads each request's pages once per tile of its tokens (`query_tile` tokens, `short_tile` for
    a request of that many or fewer, `key_tile` keys per read). Rows past the last request's write nothing.
    An MLA model's cache is the latent array alone (`k_cache`; `v_cache` has no lanes and is
    returned as it is): `tpumk.vllm.mla_prefill` runs its layers, taps included (one device: MLA
    at tensor parallel > 1 is refused at start-up). `devices`: the arrays' tensor-parallel layout
    (`kv.cache_shape`); the layers run whole (XLA partitions them over vLLM's mesh as it likes:
    the same values).

    `taps` (speculative decoding, tpumk.vllm.speculative): also return the residual stream
    entering each of those layers for every token, a list of [T, H] (tpumk's tap numbering,
    `reference.check_taps`), and the logits of every token of the batch, not only each request's
    last: a verify batch samples a row per draft token. Returns ((k, v), rows) or, with taps,
    ((k, v), rows, taps).

    `state` (a hybrid model's linear-attention state array, tpumk.vllm.states): the linear layers
    run each request's tokens as one sequence from its slot's state (`linear_attention.
    layer_step`, the chunked form for a long chunk), so a prompt split over several chunks
    carries its state from one to the next; the array comes back third in the cache tuple."""
    t = input_ids.shape[0]
    if taps:  # every live token's row: vLLM samples each verified draft position
        ref.check_taps(cfg, taps)
        i = jnp.arange(t, dtype=jnp.int32)
        live_rows = jnp.where(i < query_start_loc[num_reqs], i, -1)
    if cfg.is_mla:  # one latent array (k), v empty: tpumk.vllm.mla_prefill
        k_cache, x, tapped = mla_prefill.ragged_layers(params, cfg, k_cache, input_ids, positions, query_start_loc,
                                                       block_tables, num_reqs, block_size, max_context, query_tile,
                                                       key_tile, short_tile, taps)
        if taps:
            return (k_cache, v_cache), _scatter_rows(t, live_rows, ref.logits_from(cfg, params, x)), tapped
        last = _last_rows(query_start_loc, num_reqs)
        return (k_cache, v_cache), _scatter_rows(t, last, ref.logits_from(cfg, params, x[jnp.maximum(last, 0)]))
    a = cfg.attention
    pos, new_slots = kv.ragged_token_rows(positions, query_start_loc, block_tables, num_reqs, block_size)
    items = prefill.work_items(query_start_loc, num_reqs, t, query_tile, short_tile)
    x = ref.embed(params, input_ids, cfg.head.embed_scale)[None]  # [1, T, H]
    tapped = {}
    if state is not None:
        pool, seq_rows, seq_live = _sequences(cfg, state, query_start_loc, block_tables, num_reqs, pos, t)
    for li, layer in enumerate(params["layers"]):
        if li in taps:
            tapped[li] = x[0]
        h = ref.sublayer_in(cfg.norms, layer, "attn_norm", x)
        if cfg.pattern.is_linear(li):  # each request's tokens as one sequence from its slot's state
            o, pool = la.layer_step(cfg.linear, layer, h[0][seq_rows], seq_live, pool, cfg.pattern.linear_index(li),
                                    cfg.norms.rms_eps, jnp_dtype(cfg))
            back = jnp.where(seq_live, seq_rows, t)  # [S, T] -> the token rows (dead ones dropped)
            mixed = jnp.zeros((t, o.shape[-1]), o.dtype).at[back].set(o, mode="drop")[None]
        else:
            q, k, v = ref.qkv(cfg, layer, h, pos[None], li)
            kl = cfg.pattern.kv_index(li)  # the layer's place in the cache (a hybrid's linear layers have none)
            k_cache = kv.write_rows(k_cache, kl, new_slots, k[0].reshape(t, -1), devices)
            v_cache = kv.write_rows(v_cache, kl, new_slots, v[0].reshape(t, -1), devices)
            o = prefill.attend(a, k_cache, v_cache, kl, items, q[0], pos, block_tables, block_size, max_context,
                               cfg.pattern.window(li), ref.layer_sinks(cfg, layer), key_tile, devices)
            mixed = ref.o_proj(cfg, layer, o[None], h)
        x = x + ref.sublayer_out(cfg.norms, layer, "post_attn_norm", mixed)
        h = ref.mlp_in(cfg.norms, layer, x, h)
        x = x + ref.sublayer_out(cfg.norms, layer, "post_mlp_norm", ref.ffn(cfg, li, layer, h.reshape(t, -1))
                                 .reshape(1, t, -1))
    if taps:
        return (k_cache, v_cache), _scatter_rows(t, live_rows, ref.logits_from(cfg, params, x[0])), \
            [tapped[li] for li in taps]
    last = _last_rows(query_start_loc, num_reqs)
    logits = ref.logits_from(cfg, params, x[0][jnp.maximum(last, 0)])
    out = (k_cache, v_cache) if state is None else (k_cache, v_cache, states.commit(state, la.step_counts(pool, t)))
    return out, _scatter_rows(t, last, logits)


def _sequences(cfg: ModelConfig, state: jax.Array, query_start_loc: jax.Array, block_tables: jax.Array,
               num_reqs: jax.Array, pos: jax.Array, t: int):
    """The ragged batch's requests as sequences for the linear layers: (the pool with each request
    slot's state slot, rows [S, T] of request r's j-th token in the batch, live [S, T]: j < its
    token count and the token in the cache; a request's dead tokens all after its live ones)."""
    s = query_start_loc.shape[0] - 1
    j = jnp.arange(t, dtype=jnp.int32)
    start, count = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
    rows = jnp.clip(start[:, None] + j[None, :], 0, t - 1)
    live = (j[None, :] < count[:, None]) & (jnp.arange(s) < num_reqs)[:, None] & (pos[rows] >= 0)
    return states.pool(state, cfg, states.request_slots(block_tables, num_reqs, s)), rows, live
