"""The serving-stack decode step: XLA for the dense parts, JAX's ragged paged attention kernel.

What a serving user would run instead of tpumk (vLLM's TPU backend pairs XLA with a Pallas
ragged paged attention kernel): the reference decode step with attention replaced by
`jax.experimental.pallas.ops.tpu.ragged_paged_attention` (shipped in jax) over a paged KV cache.

- Cache: one array per layer (as a serving stack keeps it, so the kernel reads its operand in
  place), RPA's layout `[num_pages, page_size, 2 * kv_heads, head_dim]` with K of head h at
  combined head 2h and V at 2h + 1. The new tokens' K/V rows are written by XLA (a scatter into
  the donated cache) before the kernel: this version of the kernel does not write the cache.
- Block sizes: the kernel's tuned table (`get_tuned_block_sizes`) asks the attached device for
  its kind, which a deviceless compile does not have; `rpa_block_sizes` reads the same table
  for the target's device kind, with the kernel's own defaults for kinds it has no entry for.
- The model: `rpa_call_model` costs one kernel call with tpumk's timeline model, from the
  kernel's DMA structure (read from its source): per (sequence, KV block) of
  `num_kv_pages_per_block` pages, one DMA per page, all on one semaphore, double-buffered; one
  matmul pair per KV head per block. `xla_step` uses it for every `tpu_custom_call` of the
  compiled program, so the dense parts are costed op by op exactly as the plain XLA step.

Numerics match `tpumk.model.reference.decode_step` for in-range positions except that the
kernel returns its output in the query dtype (the cache dtype here) where the reference keeps
float32 (tests/test_serving.py). Positions must follow each sequence's cached length (as the
bench feeds them); the kernel's causal mask assumes so.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.model.xla_step import _moe_gathered
from tpumk.model import reference as ref
from tpumk.errors import NotSupportedError
from tpumk.model.config import ModelConfig
from tpumk.targets import Target

_RPA = "jax.experimental.pallas.ops.tpu.ragged_paged_attention"


def _rpa_modules():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes

    return kernel, tuned_block_sizes


def serving_cache_shape(cfg: ModelConfig, batch: int, context: int, page_size: int) -> tuple[int, ...]:
    """One layer's K|V cache: [batch * pages per sequence, page_size, 2 * kv_heads, head_dim]."""
    return (batch * (context // page_size), page_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def heads_per_block(cfg: ModelConfig) -> tuple[int, int]:
    """(q heads, combined K|V heads) the kernel puts in one grid step (its own rule)."""
    kernel, _ = _rpa_modules()
    dt = ref.jnp_dtype(cfg)
    return kernel.get_min_heads_per_blk(cfg.num_q_heads, 2 * cfg.num_kv_heads, dt, dt)


def rpa_block_sizes(target: Target, cfg: ModelConfig, batch: int, q_len: int, context: int,
                    page_size: int) -> tuple[int, int]:
    """(KV pages per block, queries per block) the kernel would pick on the target's device."""
    _, tuned = _rpa_modules()
    dt = ref.jnp_dtype(cfg)
    q_heads, kv_heads = heads_per_block(cfg)
    pages_per_seq = context // page_size
    tokens = batch * q_len
    kind = target.device_kind or ""
    name = " ".join(kind.split()[:2])
    bkv, bq = (32, 32) if name == "TPU v4" else (128, 32)
    key = tuned.simplify_key((dt, dt, q_heads, kv_heads // 2, cfg.head_dim, page_size, tokens, pages_per_seq))
    bkv, bq = tuned.TUNED_BLOCK_SIZES.get(name, {}).get(key, (bkv, bq))
    return min(pages_per_seq, bkv), min(tokens, bq)


def serving_decode_step(params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                        kv_caches: list, page_indices: jax.Array, lengths: jax.Array, *,
                        blocks: tuple[int, int], kernel_reference: bool = False):
    """One decode step as a serving stack runs it: tokens / positions [B, q] (positions follow
    each sequence's cached length); kv_caches: one [pages, page, 2 * Hkv, D] array per layer;
    page_indices [B, pages per sequence]; lengths [B] tokens cached before the step.
    Returns (logits [B, q, V] f32, kv_caches, new lengths).

    `kernel_reference`: call the kernel's own pure-JAX reference (`ref_ragged_paged_attention`,
    same arguments) instead of the kernel. Pallas' TPU interpret mode cannot run this kernel in
    jax 0.10.2 (its interpreter has no reshape of a ref), so the tests check the step's wiring
    (cache layout, lengths, block table) through the reference and compile the kernel deviceless."""
    if cfg.attention.attn_sinks:  # the kernel's softmax has no per-head sink logit
        raise NotSupportedError(f"model '{cfg.name}': attn_sinks = true: jax's ragged_paged_attention has no "
                                "attention sinks")
    kernel, _ = _rpa_modules()
    b, t = tokens.shape
    page = kv_caches[0].shape[1]
    pages = jnp.take_along_axis(page_indices, positions // page, axis=1)  # [B, q]
    slots = positions % page
    kv_lens = jnp.maximum(lengths, positions[:, -1] + 1).astype(jnp.int32)
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    num_seqs = jnp.array([b], jnp.int32)
    kv_pages_per_block, queries_per_block = blocks
    x = ref.embed(params, tokens, cfg.head.embed_scale)
    out_caches = []
    for i, layer in enumerate(params["layers"]):
        h = ref.sublayer_in(cfg.norms, layer, "attn_norm", x)
        q, k, v = ref.qkv(cfg, layer, h, positions, i)  # k, v [B, T, Hkv, D] in the cache dtype
        kv = jnp.stack([k, v], axis=3).reshape(b, t, 2 * cfg.num_kv_heads, cfg.head_dim)
        cache = kv_caches[i].at[pages, slots].set(kv)
        out_caches.append(cache)
        qk = q.astype(cache.dtype).reshape(b * t, cfg.num_q_heads, cfg.head_dim)

        args = (qk, cache, kv_lens, page_indices, cu_q_lens, num_seqs)
        window = cfg.pattern.window(i) or None  # the kernel's convention is transformers': p - k < window
        cap = cfg.attention.attn_softcap or None  # cap * tanh(s / cap) of the scaled scores, as the reference
        if kernel_reference:
            o = kernel.ref_ragged_paged_attention(*args, sm_scale=1.0 / cfg.attention.score_divisor, sliding_window=window,
                                                  soft_cap=cap)
        else:
            o = kernel.ragged_paged_attention(*args, sm_scale=1.0 / cfg.attention.score_divisor, sliding_window=window,
                                              soft_cap=cap,
                                              num_kv_pages_per_block=kv_pages_per_block,
                                              num_queries_per_block=queries_per_block)
        x = x + ref.sublayer_out(cfg.norms, layer, "post_attn_norm",
                                 ref.o_proj(cfg, layer, o.astype(jnp.float32).reshape(b, t, cfg.attention.q_size)))
        hf = ref.mlp_in(cfg.norms, layer, x, h).reshape(b * t, -1)
        f = (ref.gated_mlp(hf, layer["w_gate"], layer["w_up"], layer["w_down"], cfg.mlp.mlp_act) if cfg.pattern.is_dense(i)
             else _moe_gathered(cfg, layer, hf))
        x = x + ref.sublayer_out(cfg.norms, layer, "post_mlp_norm", f.reshape(b, t, -1))
    return ref.logits_from(cfg, params, x), out_caches, kv_lens


def identity_page_indices(batch: int, context: int, page_size: int) -> np.ndarray:
    """Sequence b owns pages b * pps .. (b + 1) * pps - 1 (the bench's layout)."""
    pps = context // page_size
    return np.arange(batch * pps, dtype=np.int32).reshape(batch, pps)


def serving_step_specs(cfg: ModelConfig, batch: int, context: int, page_size: int, q_len: int = 1,
                       quant: str = "none") -> tuple:
    """ShapeDtypeStructs of (params, tokens, positions, kv_caches, page_indices, lengths)."""
    from tpumk.model.xla_step import xla_step_specs

    params, tok, pos, _, _, lengths = xla_step_specs(cfg, batch, 16, q_len, quant)  # caches replaced below
    dt = ref.jnp_dtype(cfg)
    caches = [jax.ShapeDtypeStruct(serving_cache_shape(cfg, batch, context, page_size), dt)
              for _ in range(cfg.num_layers)]
    table = jax.ShapeDtypeStruct((batch, context // page_size), jnp.int32)
    return params, tok, pos, caches, table, lengths


def make_serving_step(cfg: ModelConfig, blocks: tuple[int, int]):
    """The serving step as one function of (params, tokens, positions, caches, table, lengths);
    compile it with the caches donated (`donate_argnums=(3,)`) so they are updated in place."""
    def step(p, t, pos, caches, table, n):
        return serving_decode_step(p, cfg, t, pos, caches, table, n, blocks=blocks)
    return step


def compile_serving_step(cfg: ModelConfig, target: Target, batch: int, context: int, page_size: int,
                         q_len: int = 1, quant: str = "none"):
    """The serving step compiled for the target (deviceless without a TPU), caches donated.

    Lowered with the target's device as JAX's default device: some of the kernel's lowering
    rules (the sign of a floor division) ask the default device for its TPU generation, which
    is the CPU in a deviceless process (TPU_FACTS 2)."""
    from tpumk.decode.xla_compile import compile_program

    blocks = rpa_block_sizes(target, cfg, batch, q_len, context, page_size)
    specs = serving_step_specs(cfg, batch, context, page_size, q_len, quant)
    with jax.default_device(target.device()):
        return compile_program(make_serving_step(cfg, blocks), specs, target, donate_argnums=(3,))


# ---------------------------------------------------------------------- tpumk's model of one call
def rpa_call_model(target: Target, cfg: ModelConfig, batch: int, q_len: int, context: int, page_size: int,
                   blocks: tuple[int, int]):
    """tpumk's timeline model of one `ragged_paged_attention` call at the full context (every
    sequence holds `context` tokens), from the kernel's DMA structure (module doc)."""
    from tpumk.estimate.timeline import (DMA_LATENCY_S, OP_DISPATCH_S, StepModel, load_seconds, model_source,
                                         mxu_seconds)

    kv_pages_per_block, queries_per_block = blocks
    q_heads, kv_heads = heads_per_block(cfg)
    heads_blocks = cfg.num_q_heads // q_heads
    q_blocks = -(-batch * q_len // queries_per_block)
    dt_bytes = cfg.dtype_bytes
    page_bytes = page_size * kv_heads * cfg.head_dim * dt_bytes  # one DMA: a page of this block's K|V heads
    pages_per_seq = context // page_size
    kv_blocks_per_seq = -(-pages_per_seq // kv_pages_per_block)
    # every grid step walks every sequence of its query block (at decode all of them) block by block
    items = heads_blocks * q_blocks * batch * kv_blocks_per_seq
    block_bytes = kv_pages_per_block * page_bytes  # the kernel fetches whole blocks (stand-in pages past the end)
    load = load_seconds(target, block_bytes, 2 * block_bytes, kv_pages_per_block, 1, 2)  # double-buffered, one sem
    rows = min(queries_per_block, batch * q_len) * (cfg.num_q_heads // cfg.num_kv_heads)
    kv_rows = kv_pages_per_block * page_size
    per_head = mxu_seconds(target, kv_rows * cfg.head_dim, 2.0 * rows * kv_rows * cfg.head_dim,
                           6 if cfg.dtype == "float32" else 1)
    compute = 2 * (kv_heads // 2) * per_head  # q.k^T and p.v per KV head of the block
    q_bytes = 2.0 * batch * q_len * cfg.num_q_heads * cfg.head_dim * dt_bytes  # q in, o out
    stream = items * max(load, compute)
    boundary = OP_DISPATCH_S + 2 * DMA_LATENCY_S  # dispatch, fill, drain (as any XLA op)
    seconds = boundary + stream + load_seconds(target, q_bytes, q_bytes)
    stages = {"attention (ragged paged attention kernel)": {
        "seconds": seconds, "hbm_bytes": items * block_bytes + q_bytes, "dma_seconds": items * load,
        "mxu_seconds": items * compute}}
    return StepModel(seconds=seconds, dma_seconds=items * load, compute_seconds=items * compute,
                     hbm_bytes=items * block_bytes + q_bytes,
                     source=model_source(f"{_RPA} call", target), stages=stages, kernels=1)


def describe(target: Target, cfg: ModelConfig, batch: int, q_len: int, context: int, page_size: int) -> dict[str, Any]:
    blocks = rpa_block_sizes(target, cfg, batch, q_len, context, page_size)
    q_heads, kv_heads = heads_per_block(cfg)
    return {"kernel": _RPA, "num_kv_pages_per_block": blocks[0], "num_queries_per_block": blocks[1],
            "q_heads_per_block": q_heads, "kv_heads_per_block": kv_heads // 2,
            "cache": "one [pages, page, 2 * kv_heads, head_dim] array per layer, written by an XLA scatter"}
