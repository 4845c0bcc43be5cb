"""The megakernel: one decode step (every layer, the final norm, the lm_head) in ONE pallas_call.

`make_decode_step(plan)` returns `step(packed, tokens, positions, cache) -> (logits, cache)`
with the semantics of `tpumk.model.reference.decode_step` (tokens / positions [B, q], logits
[B, q, V] f32, the paged KV cache updated in place). `step_specs(plan)` gives its argument
shapes, so a full-size model compiles deviceless with no weights in memory.

Outside the kernel (thin glue, all O(B * q * (H + V)) elementwise work):
- the embedding row gather `embed[tokens]`: a data-dependent gather of B*q rows that XLA does
  in one op; inside the kernel it would be B*q tiny DMAs for no gain;
- RoPE cos / sin rows from the positions (`norms.rope_tables`): a function of the positions
  only, shared by every layer, computed once instead of once per layer;
- reshapes: logits come out as [column blocks, B*q, tile_cols] (one whole tile per lm_head
  step) and are put back to [B, q, V] by a transpose and a slice of the vocab padding;
  `lengths = max(lengths, last in-range position + 1)` for the returned cache.

Inside, per layer (one top-level loop per segment of same-kind layers, see tpumk.kernel.ring):
RMSNorm -> q|k|v tiles -> QK-norm + RoPE -> paged attention with the cache write
(tpumk.kernel.attention) -> o tiles + residual -> RMSNorm -> SwiGLU gate|up tiles and down tiles
(dense) or router, expert slots and the shared expert's tiles (MoE, tpumk.kernel.moe) ->
residual. Then the final norm and the lm_head as its own loop. The ring keeps `ring_depth`
weight tiles in flight across all of it; a layer's norm vectors are prefetched one layer ahead.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.kernel import attention as attn
from tpumk.kernel import moe as moe_mod
from tpumk.kernel.layout import packed_specs
from tpumk.kernel.memory import block_spec, scratch_shape, shape_struct
from tpumk.kernel.norms import rms_norm, rope, rope_tables, swiglu_act
from tpumk.kernel.ring import WeightRing
from tpumk.plan.contract import MOE_OPERANDS, RING_FAMILIES, KernelContract
from tpumk.plan.geometry import VECTOR_ROW
from tpumk.plan.plan import Plan
from tpumk.model.positions import new_lengths
from tpumk.model.reference import KVCache, jnp_dtype


class _Scratch:
    """The kernel's scratch refs by contract name (`plan.contract.scratch`, in that order).

    Its own buffers are attributes (`ring`, `resid`, `logits_sems`, ...); the stages' are
    passed through as lists in their own order (`attention`, `moe`)."""

    def __init__(self, contract: KernelContract, refs: list):
        assert len(refs) == len(contract.scratch), "scratch refs and the contract disagree"
        by_name = {b.name: r for b, r in zip(contract.scratch, refs)}
        for b in contract.scratch:
            if b.component not in ("attention", "moe"):
                setattr(self, b.name, by_name[b.name])
        self.moe_out = by_name.get("moe_out")
        self.attention = [by_name[b.name] for b in contract.stage_scratch("attention")]
        self.moe = [by_name[b.name] for b in contract.stage_scratch("moe")] or None


def _scratch_shapes(plan: Plan) -> list:
    """The pallas_call's scratch_shapes: the contract's scratch list, in order."""
    return [scratch_shape(b) for b in plan.contract.scratch]


def _ring_families(plan: Plan) -> list[str]:
    return [f for f in RING_FAMILIES if f in plan.families]


def _kernel(plan: Plan):
    cfg = plan.cfg
    h, d, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_eps
    q_size, kv_size = cfg.q_size, cfg.kv_size
    fams = _ring_families(plan)
    dt = jnp_dtype(plan.cfg)

    contract = plan.contract
    n_in, n_out = len(contract.operands), len(contract.outputs)

    def kernel(*refs):
        ins = {b.name: r for b, r in zip(contract.operands, refs[:n_in])}
        block_tables, lengths, positions = ins["block_tables"], ins["lengths"], ins["positions"]
        x0, cos_ref, sin_ref, final_norm, vec_hbm = (ins[k] for k in ("x0", "cos", "sin", "final_norm", "layer_vectors"))
        weights = {f: ins[f] for f in fams}
        moe_refs = [ins[k] for k in MOE_OPERANDS] if plan.moe is not None else None
        # k_cache / v_cache are aliased to outputs 1 and 2: the kernel updates the outputs in place.
        logits_ref, k_out, v_out = refs[n_in:n_in + n_out]
        s = _Scratch(contract, list(refs[n_in + n_out:]))
        ring = WeightRing(plan, weights, s.ring, s.ring_sems)

        def vector_copy(layer, slot):
            return pltpu.make_async_copy(vec_hbm.at[layer], s.vectors.at[slot], s.vector_sems.at[slot])

        ring.prologue()
        vector_copy(0, 0).start()
        s.resid[...] = x0[...]

        def layer_vectors(layer):
            """This layer's norm vectors [8, W] (prefetched); starts the next layer's fetch."""
            slot = lax.rem(layer, 2)
            vector_copy(layer, slot).wait()
            vec = s.vectors[slot]

            @pl.when(layer + 1 < cfg.num_layers)
            def _():
                vector_copy(layer + 1, 1 - slot).start()
            return vec

        def row(vec, name, width):
            r = VECTOR_ROW[name]
            return vec[r:r + 1, :width]

        def add_to(ref, width: int, tile_cols: int) -> Callable:
            """Epilogue: ref[:, block j] += acc, dropping the padded columns past `width`."""
            def epilogue(j, acc):
                lo, hi = j * tile_cols, min((j + 1) * tile_cols, width)
                if hi > lo:
                    ref[:, lo:hi] = ref[:, lo:hi] + acc[:, :hi - lo]
            return epilogue

        def store_to(ref, width: int, tile_cols: int) -> Callable:
            def epilogue(j, acc):
                lo, hi = j * tile_cols, min((j + 1) * tile_cols, width)
                if hi > lo:
                    ref[:, lo:hi] = acc[:, :hi - lo]
            return epilogue

        def swiglu_into(ref, tile_cols: int) -> Callable:
            half = tile_cols // 2

            def epilogue(j, acc):
                ref[:, j * half:(j + 1) * half] = swiglu_act(acc[:, :half], acc[:, half:])
            return epilogue

        def attention_block(seg, layer, vec):
            s.normed[...] = rms_norm(s.resid[...], row(vec, "attn_norm", h), eps)
            qkv = plan.families["qkv"]
            ring.matmul(seg, layer, "qkv", s.normed, store_to(s.qkv, qkv.m_pad, qkv.tile_cols))
            # QK-norm + RoPE per head, in place in the q|k|v scratch (heads are 128-lane aligned).
            cos, sin = cos_ref[...], sin_ref[...]  # loaded per layer: a value live across loops spills
            for name, heads, base in (("q_norm", cfg.num_q_heads, 0), ("k_norm", cfg.num_kv_heads, q_size)):
                w = row(vec, name, d)
                for i in range(heads):
                    lo = base + i * d
                    x = s.qkv[:, lo:lo + d]
                    if cfg.qk_norm:
                        x = rms_norm(x, w, eps)
                    s.qkv[:, lo:lo + d] = rope(x, cos, sin)
            q = s.qkv[:, :q_size]
            k_new = s.qkv[:, q_size:q_size + kv_size].astype(dt)
            v_new = s.qkv[:, q_size + kv_size:q_size + 2 * kv_size].astype(dt)
            s.attn_out[...] = attn.attention_stage(plan.attention, layer, q, k_new, v_new, k_out, v_out,
                                                   block_tables, lengths, positions, s.attention)
            o = plan.families["o"]
            ring.matmul(seg, layer, "o", s.attn_out, add_to(s.resid, h, o.tile_cols))
            s.normed[...] = rms_norm(s.resid[...], row(vec, "mlp_norm", h), eps)

        def dense_layer(seg):
            def body(layer):
                vec = layer_vectors(layer)
                attention_block(seg, layer, vec)
                ring.matmul(seg, layer, "gate_up", s.normed, swiglu_into(s.act, plan.families["gate_up"].tile_cols))
                ring.matmul(seg, layer, "down", s.act, add_to(s.resid, h, plan.families["down"].tile_cols))
            return body

        def moe_layer(seg):
            router, e_gateup, e_down = moe_refs

            def body(layer):
                vec = layer_vectors(layer)
                moe_index = seg.moe_base + (layer - seg.first_layer)
                # The router is small: fetch it while attention runs.
                moe_mod.start_router_fetch(plan.moe, moe_index, router, s.moe)
                attention_block(seg, layer, vec)
                x = s.normed[...]
                # Routing first, so the expert loads are in flight while the shared expert streams.
                moe_mod.moe_route_and_prefetch(plan.moe, moe_index, x, router, e_gateup, e_down, s.moe,
                                               router_started=True)
                if "shared_gate_up" in seg.families:
                    ring.matmul(seg, layer, "shared_gate_up", s.normed,
                                swiglu_into(s.act, plan.families["shared_gate_up"].tile_cols))
                    ring.matmul(seg, layer, "shared_down", s.act,
                                store_to(s.moe_out, h, plan.families["shared_down"].tile_cols))
                routed = moe_mod.moe_experts(plan.moe, moe_index, s.normed[...], e_gateup, e_down, s.moe)
                if "shared_gate_up" in seg.families:
                    routed = routed + s.moe_out[...]  # reference: routed + shared, then the residual
                s.resid[...] = s.resid[...] + routed
            return body

        for seg in plan.segments[:-1]:
            ring.layer_loop(seg, dense_layer(seg) if seg.kind == "dense" else moe_layer(seg))
        s.normed[...] = rms_norm(s.resid[...], final_norm[...], eps)
        head_blocks = plan.families["lm_head"].col_blocks

        def logits_copy(j):
            return pltpu.make_async_copy(s.logits, logits_ref.at[j], s.logits_sems.at[0])

        def write_logits(j, acc):
            """Block j leaves through the staging buffer while block j + 1 is computed."""
            if not (isinstance(j, int) and j == 0):
                logits_copy(j - 1).wait()  # the staging buffer is free once block j - 1 left
            s.logits[...] = acc
            logits_copy(j).start()

        ring.lm_head(s.normed, write_logits)
        logits_copy(head_blocks - 1).wait()

    return kernel


def _interpret_mode(plan: Plan, detect_races: bool, portable: bool):
    """How the `cpu` target runs the kernel (TPU targets compile it: False).

    Pallas' TPU interpreter (InterpretParams) simulates DMAs, semaphores and VMEM and can detect
    races, but it runs through Python host callbacks, so its programs cannot be serialized.
    `portable` picks the older discharge interpreter (`interpret=True`), which lowers the same
    kernel to ordinary XLA ops: a program that jax.export and serialize_executable can ship."""
    if not plan.target.interpret:
        return False
    if portable:
        if detect_races:
            raise ValueError("race detection needs the TPU interpreter; it cannot be portable")
        return True
    return pltpu.InterpretParams(detect_races=detect_races)


def _pallas_call(plan: Plan, detect_races: bool, portable: bool = False):
    """The pallas_call, every spec read from `plan.contract`: in_specs from the operands'
    memory spaces, out_shape / out_specs from the outputs, the aliases, the scratch list."""
    c = plan.contract
    return pl.pallas_call(
        _kernel(plan),
        out_shape=tuple(shape_struct(b) for b in c.outputs),
        in_specs=[block_spec(b) for b in c.operands],
        out_specs=tuple(block_spec(b) for b in c.outputs),
        scratch_shapes=_scratch_shapes(plan),
        input_output_aliases=c.input_output_aliases,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=plan.vmem_limit),

        interpret=_interpret_mode(plan, detect_races, portable),
        name=c.name,
    )


def make_decode_step(plan: Plan, detect_races: bool = False, donate_cache: bool = False, portable: bool = False):
    """The plan's decode step: step(packed, tokens [B,q], positions [B,q], cache) -> (logits, cache).

    `packed` is `tpumk.kernel.layout.pack_weights(plan, params)`. On the `cpu` target the kernel
    runs in Pallas TPU interpret mode (`detect_races` turns on its DMA race detector).
    `donate_cache` donates the input cache so the in-place update needs no copy (serving);
    off by default so callers may keep using the cache they passed in. `portable` (cpu target
    only) interprets the kernel without host callbacks so the step can be exported."""
    cfg = plan.cfg
    call = _pallas_call(plan, detect_races, portable)
    contract = plan.contract

    def step(packed: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache):
        b, t = tokens.shape
        if (b, t) != (plan.batch, plan.q_len):
            raise ValueError(f"decode step planned for tokens [{plan.batch}, {plan.q_len}], got [{b}, {t}]")
        n = b * t
        tokens, positions = tokens.astype(jnp.int32), positions.astype(jnp.int32)
        x0 = jnp.take(packed["embed"], tokens.reshape(n), axis=0).astype(jnp.float32)
        cos, sin = rope_tables(positions.reshape(n), cfg.head_dim, cfg.rope_theta)
        values = {"step.positions": positions, "step.x0": x0, "step.cos": cos, "step.sin": sin,
                  "cache.block_tables": cache.block_tables.astype(jnp.int32),
                  "cache.lengths": cache.lengths.astype(jnp.int32), "cache.k": cache.k, "cache.v": cache.v}
        blocks, k, v = call(*(values[b.source] if b.source in values else _packed_leaf(packed, b.source)
                              for b in contract.operands))
        logits = blocks.transpose(1, 0, 2).reshape(n, plan.vocab_pad)[:, :cfg.vocab_size].reshape(b, t, -1)
        # As the reference: positions outside the pages write nothing and do not move lengths.
        lengths = new_lengths(positions, cache.lengths, cache.max_context)
        return logits, KVCache(k, v, cache.block_tables, lengths)

    return jax.jit(step, donate_argnums=(3,) if donate_cache else ())


def _packed_leaf(packed: dict, source: str):
    """packed["a"]["b"] for source "packed.a.b"."""
    kind, *path = source.split(".")
    assert kind == "packed", source
    for k in path:
        packed = packed[k]
    return packed


def step_specs(plan: Plan) -> tuple:
    """ShapeDtypeStructs of (packed, tokens, positions, cache) for a deviceless compile, read from
    the contract: the packed weights' leaves, the positions operand's shape for tokens and
    positions, and the cache operands."""
    c = plan.contract
    cache = KVCache(*(shape_struct(c.operand(n)) for n in ("k_cache", "v_cache", "block_tables", "lengths")))
    tok = shape_struct(c.operand("positions"))
    return packed_specs(plan), tok, tok, cache
