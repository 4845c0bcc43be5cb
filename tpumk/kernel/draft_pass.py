"""The drafter's pass as a Pallas TPU kernel of its own (issue 56; docs/speculative.md "Where the
draft runs").

One grid-less `pallas_call` runs one pass of a hidden-state drafter over its rows:

- the chain step (eagle3 / mtp, one row per sequence, `tpumk.draft.chain.rows` + `head`): MTP's
  eh_proj over [enorm(embedding); hnorm(g)] or EAGLE-3's first layer over [attn_norm(embedding);
  hidden_norm(g)], the decoder layers (their keys and values read from the drafter's cache and
  the step's own rows), the final norm and the head's logits; the step's new key / value rows
  are outputs, written into the drafter's cache by the glue (a scatter of B rows);
- the block pass (dflash / dspark, `tpumk.draft.block.block_forward`): the block's anchor and
  mask rows through the decoder layers over the context keys / values in the cache and the
  block's own, the final norm and the head's logits.

Weights stay in HBM (`pl.ANY`) and stream through a ring per matrix stream (`_stream`): q / k / v
one head at a time ([K, D], packed head-major once per device call by `pack`), o one head's rows
[D, H], the MLP's gate / up column tiles with the down projection's matching row tiles (the
intermediate activation never leaves VMEM), eh_proj and the head in column tiles. A stream's ring
has `ring_depth` slots (the megakernel's defaults: up to 12 slots, 24 MiB of a stream's tiles;
tpumk.kernel.ring, TPU_FACTS section 3 on bytes in flight), so depth - 1 tiles load while one is
multiplied. Each ring is VMEM scoped to its stream (`pltpu.run_scoped`), which is what lets it be
that deep (the next stream reuses the VMEM), and also why, unlike the megakernel's ring, the
prefetch does not cross from one matrix to the next: each stream's first tile is waited for (a
bubble per stream, counted by tpumk.estimate.speculative). The drafter's KV cache (head-major
[L, B, KVH, C, D], `tpumk.draft.layers.cache_shape`) streams per (KV head, sequence, chunk) through
a ring of its own (`ring_depth` slots of a key and value chunk), each chunk serving the KV head's group of query heads, with an online softmax; every row computes against every sequence's chunk and a
visibility mask (built by the glue from the positions) keeps its own: at a drafter's few rows
per sequence that costs B x the attention flops and no unaligned slicing.

What the kernel models (`refusal` says why a drafter is not, and the round program then runs
that drafter's passes as XLA operations): GQA layers with dense SwiGLU MLPs, RMSNorm before each
sublayer, optional per-head QK-norm, rotate-half RoPE on every layer, no biases, sinks, caps or
windows, hidden size a multiple of 128; eagle3, mtp (a GQA next-token layer: speculators' qwen3
mtp), dflash and dspark (its Markov bias runs in the glue on the kernel's logits). Numerics are
the reference's (tpumk.model.ops): matrix products in the weight dtype with float32
accumulation, norms, RoPE and softmax in float32; the online softmax and the per-head sums of the
o projection differ from the XLA pass by float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.compat import tpu_interpreter
from tpumk.draft import block as block_drafter
from tpumk.draft import chain as chain_drafter
from tpumk.draft.config import DrafterSpec
from tpumk.draft.layers import embed_rows, target_head, write_head_rows
from tpumk.kernel.norms import rms_norm
from tpumk.model import rope as rope_mod
from tpumk.model.config import ModelConfig
from tpumk.model.ops import jnp_dtype
from tpumk.plan.knobs import AUTO_RING_DEPTH, TuningConfig

LANE = 128
TILE_BYTES = TuningConfig.tile_bytes  # one streamed tile's bytes at most (the megakernel's default)
RING_DEPTH = AUTO_RING_DEPTH  # slots of a stream's ring at most (the megakernel's where it fits)
RING_BYTES = RING_DEPTH * TILE_BYTES  # a stream's ring (every family's slots) at most: 24 MiB
KV_CHUNK = 128  # cache positions per streamed KV chunk (at most; a divisor of the context)
VMEM_LIMIT = 96 << 20


def refusal(spec: DrafterSpec) -> str | None:
    """None when the kernel runs this drafter's passes, else why not (one line)."""
    cfg: ModelConfig = spec.layer
    a, n, p = cfg.attention, cfg.norms, cfg.positions
    checks = [
        (spec.kind in ("eagle3", "mtp", "dflash", "dspark"), f"kind {spec.kind}"),
        (not cfg.is_mla, "MLA layers"),
        (all(cfg.pattern.is_dense(i) for i in range(cfg.num_layers)), "expert layers"),
        (not cfg.sliding_layers, "sliding-window layers"),
        (all(cfg.pattern.rotates(i) for i in range(cfg.num_layers)), "NoPE layers"),
        (not (a.qkv_bias or a.o_bias), "attention biases"),
        (not (a.qk_norm_whole or a.attn_sinks or a.attn_softcap or a.attn_output_gate or a.attn_out_norm),
         "whole-width QK-norm, sinks, soft-caps or output gates"),
        (a.head_width in (0, a.head_dim), "lane-padded heads"),
        (not (p.query_scale_beta or p.rope_learned_freqs), "position-scaled queries or learned frequencies"),
        (n.norm_kind == "rms" and n.pre_norms and not n.post_norms and not n.parallel_blocks
         and not n.residual_gates and n.width == cfg.hidden_size, "norms other than RMSNorm before each sublayer"),
        (cfg.mlp.mlp_act == "silu", f"MLP activation {cfg.mlp.mlp_act}"),
        (cfg.hidden_size % LANE == 0, f"hidden size {cfg.hidden_size} (expected a multiple of {LANE})"),
        (cfg.head.embed_scale == 1.0 and not cfg.head.embed_norm, "scaled or normed embeddings"),
    ]
    bad = [why for ok, why in checks if not ok]
    return None if not bad else f"the drafter's pass kernel does not model {', '.join(bad)}"


def _tile(n: int, rows: int, itemsize: int) -> int:
    """Columns of a streamed tile of a [rows, n] matrix: the widest multiple of 128 dividing n
    within TILE_BYTES (n itself when n is not a multiple of 128)."""
    if n % LANE:
        return n
    best = LANE
    for t in range(LANE, n + 1, LANE):
        if n % t == 0 and rows * t * itemsize <= TILE_BYTES:
            best = t
    return best


def _kv_chunk(context: int) -> int:
    return max(c for c in range(1, min(context, KV_CHUNK) + 1) if context % c == 0)


@dataclass(frozen=True)
class PassGeometry:
    """The static shape of one pass: `mode` "chain" (eagle3 / mtp step) or "block" (dflash /
    dspark); `rows` R = batch x rows per sequence; the drafter's cache of `context` positions."""

    kind: str
    mode: str
    batch: int
    per_seq: int
    context: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int  # the head's columns (the draft vocabulary)
    dtype: str  # the weights'
    head_dtype: str
    eps: float
    score_divisor: float
    qk_norm: bool
    norm_before_residual: bool

    @property
    def rows(self) -> int:
        return self.batch * self.per_seq

    @property
    def itemsize(self) -> int:
        return jnp.dtype(jnp_dtype_name(self.dtype)).itemsize

    def in_width(self, layer: int) -> int:
        """q / k / v's input width: EAGLE-3's first layer reads [embedding; hidden] (2H)."""
        return 2 * self.hidden if (self.kind == "eagle3" and layer == 0) else self.hidden

    @property
    def ffn_tile(self) -> int:
        return _tile(self.ffn, 2 * self.hidden, self.itemsize)  # the down tile has the same bytes

    @property
    def head_tile(self) -> int:
        return _tile(self.vocab, self.hidden, jnp.dtype(jnp_dtype_name(self.head_dtype)).itemsize)

    @property
    def eh_tile(self) -> int:
        return _tile(self.hidden, 2 * self.hidden, self.itemsize)

    @property
    def chunk(self) -> int:
        return _kv_chunk(self.context)


def jnp_dtype_name(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def geometry(spec: DrafterSpec, batch: int, per_seq: int, context: int, head_dtype) -> PassGeometry:
    cfg = spec.layer
    a = cfg.attention
    return PassGeometry(kind=spec.kind, mode="chain" if spec.kind in ("eagle3", "mtp") else "block", batch=batch,
                        per_seq=per_seq, context=context, hidden=cfg.hidden_size, heads=a.num_q_heads,
                        kv_heads=a.num_kv_heads, head_dim=a.head_dim, ffn=cfg.mlp.ffn_size, layers=cfg.num_layers,
                        vocab=spec.draft_vocab, dtype=cfg.dtype, head_dtype=jnp.dtype(head_dtype).name,
                        eps=cfg.norms.rms_eps, score_divisor=a.score_divisor, qk_norm=a.qk_norm,
                        norm_before_residual=bool(getattr(spec, "norm_before_residual", False)))


# ---------------------------------------------------------------------- weights, once per device call
def _heads_major(w: jax.Array, n: int) -> jax.Array:
    """[K, n * D] -> [n, K, D]: one head's columns contiguous, a whole-tile DMA per head."""
    k = w.shape[0]
    return w.reshape(k, n, -1).transpose(1, 0, 2)


def _layers_of(spec: DrafterSpec, params: dict) -> list[dict]:
    return [params["layer"]] if spec.kind == "mtp" else list(params["layers"])


def _col_tiles(w: jax.Array, tile: int) -> jax.Array:
    """[K, N] -> [N / tile, K, tile]: column tiles, each one contiguous DMA."""
    k, n = w.shape
    return w.reshape(k, n // tile, tile).transpose(1, 0, 2)


def pack(spec: DrafterSpec, params: dict, target_params: dict) -> dict:
    """The drafter's weights as the kernel streams them, made once per device call (outside the
    round loop: an HBM copy of the drafter's matrices per call, 1 / rounds_per_call of what a
    round's passes read): q / k / v head-major [heads, K, D], o [heads, D, H] and the down
    projection [tiles, tile, H] (free reshapes), the gate / up projections, eh_proj and the head
    (the drafter's own or the target's, its embedding when tied) as column tiles [tiles, K, tile]."""
    g = geometry(spec, 1, 1, 1, _head(params, target_params).dtype)
    layers = []
    for lay in _layers_of(spec, params):
        d = {k: lay[k].reshape(1, -1) for k in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "hidden_norm")
             if k in lay}
        d.update(wq=_heads_major(lay["wq"], g.heads), wk=_heads_major(lay["wk"], g.kv_heads),
                 wv=_heads_major(lay["wv"], g.kv_heads), wo=lay["wo"].reshape(g.heads, g.head_dim, g.hidden),
                 w_gate=_col_tiles(lay["w_gate"], g.ffn_tile), w_up=_col_tiles(lay["w_up"], g.ffn_tile),
                 w_down=lay["w_down"].reshape(g.ffn // g.ffn_tile, g.ffn_tile, g.hidden))
        layers.append(d)
    out = {"layers": layers, "norm": params["norm"].reshape(1, -1),
           "head": _col_tiles(_head(params, target_params), g.head_tile)}
    if spec.kind == "mtp":
        out.update(enorm=params["enorm"].reshape(1, -1), hnorm=params["hnorm"].reshape(1, -1),
                   eh_proj=_col_tiles(params["eh_proj"], g.eh_tile))
    return out


def _head(params: dict, target_params: dict) -> jax.Array:
    return params["lm_head"] if "lm_head" in params else target_head(target_params)


# ---------------------------------------------------------------------- the kernel
def _dot(x, w):
    """The reference's matmul: x in the weight's dtype, float32 accumulation (full precision for
    float32 weights, so interpret mode and the TPU agree with the XLA pass to rounding)."""
    prec = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32, precision=prec)


def _dot_t(x, y):
    """x [M, D] . y [N, D]^T -> [M, N] f32 (scores)."""
    prec = lax.Precision.HIGHEST if y.dtype == jnp.float32 else None
    return lax.dot_general(x.astype(y.dtype), y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                           precision=prec)


def ring_depth(tile_bytes: int, n: int) -> int:
    """Slots of a stream's ring: the megakernel's defaults (tpumk.plan.knobs: RING_DEPTH tiles,
    RING_DEPTH x TILE_BYTES in flight) for a step of `tile_bytes` (every family's tile of one
    step), at least two, at most the stream's `n` steps. tpumk.estimate.speculative counts it."""
    return max(1, min(n, max(2, min(RING_DEPTH, RING_BYTES // max(1, tile_bytes)))))


def _stream(hbms, n: int, body, carry):
    """fori_loop over steps j < n of the matrices `hbms` (HBM refs [n, ...], their tile j each),
    through a ring of `ring_depth` slots per matrix allocated for this stream only
    (`pltpu.run_scoped`: the next stream reuses the VMEM): the first `depth` steps are issued at
    once, and after step j is multiplied step j + depth is issued into the slots it freed, so
    depth - 1 steps stay in flight while one is multiplied. body(j, tiles, carry)."""
    depth = ring_depth(sum(math.prod(h.shape[1:]) * h.dtype.itemsize for h in hbms), n)

    def run(*scoped):
        bufs, sems = scoped[:-1], scoped[-1]

        def copies(j, slot):
            return [pltpu.make_async_copy(h.at[j], b.at[slot], sems.at[i, slot]) for i, (h, b) in
                    enumerate(zip(hbms, bufs))]

        for j0 in range(depth):
            for cp in copies(j0, j0):
                cp.start()

        def step(j, c):
            slot = lax.rem(j, depth)
            for cp in copies(j, slot):
                cp.wait()
            c = body(j, [b[slot] for b in bufs], c)

            @pl.when(j + depth < n)
            def _():
                for cp in copies(j + depth, slot):
                    cp.start()

            return c

        return lax.fori_loop(0, n, step, carry)

    return pl.run_scoped(run, *[pltpu.VMEM((depth, *h.shape[1:]), h.dtype) for h in hbms],
                            pltpu.SemaphoreType.DMA((len(hbms), depth)))


class _Refs:
    """Named refs: inputs, outputs and scratch, by the names `_specs` gives them."""

    def __init__(self, names, refs):
        self.__dict__.update(dict(zip(names, refs)))


def _in_names(g: PassGeometry) -> tuple[list[str], list[str]]:
    """(VMEM input names, HBM input names) in call order."""
    vm = ["e", "cos", "sin", "rot", "vis_cache", "vis_new", "norm"]
    if g.mode == "chain":
        vm += ["g"]
    if g.kind == "mtp":
        vm += ["enorm", "hnorm"]
    for i in range(g.layers):
        vm += [f"attn_norm{i}", f"mlp_norm{i}"]
        if g.qk_norm:
            vm += [f"q_norm{i}", f"k_norm{i}"]
    if g.kind == "eagle3":
        vm += ["hidden_norm0"]
    hbm = ["k_cache", "v_cache", "head"] + (["eh_proj"] if g.kind == "mtp" else [])
    for i in range(g.layers):
        hbm += [f"{w}{i}" for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    return vm, hbm


def _out_names(g: PassGeometry) -> list[str]:
    return ["logits", "x", "normed"] + (["k_new", "v_new"] if g.mode == "chain" else [])


def _scratch(g: PassGeometry, kvdt) -> dict:
    r, d, h = g.rows, g.head_dim, g.hidden
    # the KV cache's ring: a KV head's chunks (key and value) of every sequence, as deep as a weight stream's
    kv_depth = ring_depth(2 * g.chunk * d * jnp.dtype(kvdt).itemsize, g.batch * (g.context // g.chunk))
    s = {"q_s": pltpu.VMEM((g.heads, r, d), jnp.float32), "k_s": pltpu.VMEM((g.kv_heads, r, d), kvdt),
         "v_s": pltpu.VMEM((g.kv_heads, r, d), kvdt), "o_s": pltpu.VMEM((g.heads, r, d), jnp.float32),
         "kc": pltpu.VMEM((kv_depth, g.chunk, d), kvdt), "vc": pltpu.VMEM((kv_depth, g.chunk, d), kvdt),
         "kv_sem": pltpu.SemaphoreType.DMA((2, kv_depth))}
    if g.kind == "mtp":
        s["eh_s"] = pltpu.VMEM((h // g.eh_tile, r, g.eh_tile), jnp.float32)
    return s


def _kernel(g: PassGeometry, names: list[str]):
    group = g.heads // g.kv_heads
    n_chunks = g.batch * (g.context // g.chunk)
    per_b = g.context // g.chunk
    scale = 1.0 / g.score_divisor

    def kernel(*refs):
        s = _Refs(names, refs)

        e = s.e[...]
        cos, sin, rot = s.cos[...], s.sin[...], s.rot[...]

        def rope(x):  # rotate-half as x @ rot (a signed permutation): no lane shuffles of a D-wide head
            return x * cos + jnp.dot(x, rot, preferred_element_type=jnp.float32,
                                     precision=lax.Precision.HIGHEST) * sin

        # the first layer's input and residual
        if g.kind == "eagle3":
            gg = s.g[...]
            hn = rms_norm(gg, s.hidden_norm0[...], g.eps)
            resid = hn if g.norm_before_residual else gg
            attn_in0 = jnp.concatenate([rms_norm(e, s.attn_norm0[...], g.eps), hn], -1)
        elif g.kind == "mtp":
            cat = jnp.concatenate([rms_norm(e, s.enorm[...], g.eps), rms_norm(s.g[...], s.hnorm[...], g.eps)], -1)
            n_eh = g.hidden // g.eh_tile

            def eh_body(j, tiles, c):
                s.eh_s[j] = _dot(cat, tiles[0])
                return c

            _stream([s.eh_proj], n_eh, eh_body, 0)
            resid = jnp.concatenate([s.eh_s[j] for j in range(n_eh)], -1)
            attn_in0 = None
        else:
            resid, attn_in0 = e, None

        x = resid
        for i in range(g.layers):
            attn_in = attn_in0 if (i == 0 and attn_in0 is not None) else rms_norm(x, getattr(s, f"attn_norm{i}")[...],
                                                                                  g.eps)
            kw = g.in_width(i)
            qn = getattr(s, f"q_norm{i}")[...] if g.qk_norm else None
            kn = getattr(s, f"k_norm{i}")[...] if g.qk_norm else None

            def q_body(h, tiles, c, attn_in=attn_in, qn=qn):
                q = _dot(attn_in, tiles[0])
                if qn is not None:
                    q = rms_norm(q, qn, g.eps)
                s.q_s[h] = rope(q)
                return c

            _stream([getattr(s, f"wq{i}")], g.heads, q_body, 0)

            def kv_body(h, tiles, c, attn_in=attn_in, kn=kn, i=i):
                k = _dot(attn_in, tiles[0])
                if kn is not None:
                    k = rms_norm(k, kn, g.eps)
                k = rope(k).astype(s.k_s.dtype)
                v = _dot(attn_in, tiles[1]).astype(s.v_s.dtype)
                s.k_s[h] = k
                s.v_s[h] = v
                if g.mode == "chain":
                    s.k_new[i, h] = k
                    s.v_new[i, h] = v
                return c

            _stream([getattr(s, f"wk{i}"), getattr(s, f"wv{i}")], g.kv_heads, kv_body, 0)
            _attention(g, s, i, group, n_chunks, per_b, scale)

            def o_body(h, tiles, acc):
                return acc + _dot(s.o_s[h], tiles[0])

            a = _stream([getattr(s, f"wo{i}")], g.heads, o_body,
                        jnp.zeros((g.rows, g.hidden), jnp.float32))
            x = (resid if i == 0 else x) + a
            hm = rms_norm(x, getattr(s, f"mlp_norm{i}")[...], g.eps)

            def mlp_body(j, tiles, acc, hm=hm):
                act = jax.nn.silu(_dot(hm, tiles[0])) * _dot(hm, tiles[1])
                return acc + _dot(act, tiles[2])

            x = x + _stream([getattr(s, f"w_gate{i}"), getattr(s, f"w_up{i}"), getattr(s, f"w_down{i}")],
                            g.ffn // g.ffn_tile, mlp_body,
                            jnp.zeros((g.rows, g.hidden), jnp.float32))
        normed = rms_norm(x, s.norm[...], g.eps)
        s.x[...] = x
        s.normed[...] = normed

        def head_body(j, tiles, c):
            s.logits[j] = _dot(normed, tiles[0])
            return c

        _stream([s.head], g.vocab // g.head_tile, head_body, 0)

    return kernel


def _attention(g: PassGeometry, s: _Refs, layer: int, group: int, n_chunks: int, per_b: int, scale: float) -> None:
    """Every q head over the step's own rows (their keys in k_s / v_s) and the cache's chunks of
    every sequence (masked to each row's own by vis_cache), online softmax in float32. The cache
    streams once per KV head: each chunk serves the `group` query heads that share it (their
    softmax states carried side by side)."""
    vis_new = s.vis_new[...] > 0
    depth = s.kc.shape[0]  # the chunk ring's slots (`_scratch`)

    def chunk_copy(t, slot, kh):
        b, c0 = lax.div(t, per_b), lax.rem(t, per_b) * g.chunk
        return [pltpu.make_async_copy(cache.at[layer, b, kh, pl.ds(c0, g.chunk)], buf.at[slot], s.kv_sem.at[w, slot])
                for w, (cache, buf) in enumerate(((s.k_cache, s.kc), (s.v_cache, s.vc)))]

    def own_rows(kh, j):
        q = s.q_s[kh * group + j].astype(s.k_s.dtype)
        sc = jnp.where(vis_new, _dot_t(q, s.k_s[kh]) * scale, -jnp.inf)
        m = jnp.max(sc, -1, keepdims=True)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        p = jnp.where(vis_new, jnp.exp(sc - m_safe), 0.0)
        acc = jnp.dot(p.astype(s.v_s.dtype), s.v_s[kh], preferred_element_type=jnp.float32)
        return m, jnp.sum(p, -1, keepdims=True), acc

    def kv_head(kh, carry):
        states = tuple(own_rows(kh, j) for j in range(group))
        for t0 in range(depth):
            for cp in chunk_copy(t0, t0, kh):
                cp.start()

        def chunk(t, states):
            slot = lax.rem(t, depth)
            for cp in chunk_copy(t, slot, kh):
                cp.wait()
            vis = s.vis_cache[t] > 0
            kc, vc = s.kc[slot], s.vc[slot]
            out = []
            for j, (m, l, acc) in enumerate(states):
                q = s.q_s[kh * group + j].astype(kc.dtype)
                sc = jnp.where(vis, _dot_t(q, kc) * scale, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(sc, -1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(jnp.where(m == -jnp.inf, 0.0, m - m_safe))
                alpha = jnp.where(m == -jnp.inf, 1.0, alpha)
                p = jnp.where(vis, jnp.exp(sc - m_safe), 0.0)
                acc = acc * alpha + jnp.dot(p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
                out.append((m_new, l * alpha + jnp.sum(p, -1, keepdims=True), acc))

            @pl.when(t + depth < n_chunks)
            def _():  # into the slots this chunk freed
                for cp in chunk_copy(t + depth, slot, kh):
                    cp.start()

            return tuple(out)

        states = lax.fori_loop(0, n_chunks, chunk, states)
        for j, (_, l, acc) in enumerate(states):  # no key at all: 0, as masked_softmax
            s.o_s[kh * group + j] = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
        return carry

    lax.fori_loop(0, g.kv_heads, kv_head, 0)


def _pallas(g: PassGeometry, interpret, wdt, kvdt, hdt):
    vm, hbm = _in_names(g)
    outs = _out_names(g)
    scratch = _scratch(g, kvdt)
    names = vm + hbm + outs + list(scratch)
    r, h = g.rows, g.hidden
    out_shape = [jax.ShapeDtypeStruct((g.vocab // g.head_tile, r, g.head_tile), jnp.float32),
                 jax.ShapeDtypeStruct((r, h), jnp.float32), jax.ShapeDtypeStruct((r, h), jnp.float32)]
    if g.mode == "chain":
        out_shape += [jax.ShapeDtypeStruct((g.layers, g.kv_heads, r, g.head_dim), kvdt)] * 2
    vspec = pl.BlockSpec(memory_space=pltpu.VMEM)
    return pl.pallas_call(
        _kernel(g, names), out_shape=out_shape,
        in_specs=[vspec] * len(vm) + [pl.BlockSpec(memory_space=pl.ANY)] * len(hbm),
        out_specs=[vspec] * len(out_shape), scratch_shapes=list(scratch.values()),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=f"draft_pass_{g.kind}")


# ---------------------------------------------------------------------- glue
def _rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cos, sin [R, D] as tpumk.model.reference.rope computes them (the same ops: bitwise equal),
    and the signed rotate-half permutation [D, D]: (x @ rot) = concat(-x2, x1)."""
    pos = cfg.positions
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_mod.inv_freq(pos, jnp), jnp.float32)
    c, s_ = jnp.cos(ang), jnp.sin(ang)
    scale = rope_mod.cos_sin_scale(pos, jnp)
    if scale is not None:
        c, s_ = c * scale, s_ * scale
    d = cfg.head_dim
    half = d // 2
    eye = jnp.eye(half, dtype=jnp.float32)
    zero = jnp.zeros((half, half), jnp.float32)
    rot = jnp.block([[zero, eye], [-eye, zero]])  # row j of x feeds column j + half; row j + half feeds -column j
    return jnp.concatenate([c, c], -1), jnp.concatenate([s_, s_], -1), rot


def run_pass(spec: DrafterSpec, packed: dict, cache: dict, e: jax.Array, g: jax.Array | None, positions: jax.Array,
             vis_cache: jax.Array, vis_new: jax.Array, interpret):
    """One pass over rows [B, T] (`packed`: `pack`'s): e / g [B, T, H] f32, positions [B, T];
    vis_cache [B, T, B, C] and vis_new [B, T, B, T]: which cached / new keys each row sees.
    Returns (logits [B, T, Vd] f32, the last layer's output x and its final norm [B, T, H] f32,
    and for a chain step the new key / value rows [L, B, T, KVH, D] in the cache dtype).
    `interpret`: pallas_call's (False on a TPU; the TPU interpreter or, portable, True on the CPU)."""
    cfg = spec.layer
    b, t = positions.shape
    k_cache = cache["k"]
    geom = geometry(spec, b, t, k_cache.shape[3], packed["head"].dtype)
    r = b * t
    cos, sin, rot = _rope_tables(cfg, positions.reshape(r))
    vals = {"e": e.reshape(r, -1), "cos": cos, "sin": sin, "rot": rot,
            # chunk-major [chunks, R, chunk]: a chunk's mask is a whole leading-index load
            "vis_cache": vis_cache.reshape(r, -1, geom.chunk).transpose(1, 0, 2).astype(jnp.float32),
            "vis_new": vis_new.reshape(r, r).astype(jnp.float32), "norm": packed["norm"],
            "k_cache": k_cache, "v_cache": cache["v"], "head": packed["head"]}
    if g is not None:
        vals["g"] = g.reshape(r, -1)
    for k in ("enorm", "hnorm", "eh_proj"):
        if k in packed:
            vals[k] = packed[k]
    for i, lay in enumerate(packed["layers"]):
        vals.update({f"{k}{i}": v for k, v in lay.items()})
    vm, hbm = _in_names(geom)
    call = _pallas(geom, interpret, jnp_dtype(cfg), k_cache.dtype, packed["head"].dtype)
    outs = call(*[vals[n] for n in vm + hbm])
    logits = outs[0].transpose(1, 0, 2).reshape(b, t, geom.vocab)
    res = (logits, outs[1].reshape(b, t, -1), outs[2].reshape(b, t, -1))
    if geom.mode == "chain":
        res += tuple(o.reshape(geom.layers, geom.kv_heads, b, t, geom.head_dim).transpose(0, 2, 3, 1, 4)
                     for o in outs[3:])
    return res


# ---------------------------------------------------------------------- the passes the drafter runs
def _own_rows(vis: jax.Array, batch: int) -> jax.Array:
    """vis [B, T, X] of each row over its own sequence's keys -> [B, T, B, X] (no other's)."""
    same = jnp.eye(batch, dtype=bool)[:, None, :, None]
    return same & vis[:, :, None, :]


def chain_step(spec: DrafterSpec, packed: dict, params: dict, target_params: dict, cache: dict, tokens: jax.Array,
               g: jax.Array, positions: jax.Array, interpret) -> tuple[jax.Array, jax.Array, dict]:
    """`tpumk.draft.chain.xla_step` through the kernel: the row at p sees the cache's positions
    1 .. p - 1 and its own key (written at p, as the XLA step writes it before attending)."""
    b = tokens.shape[0]
    c = cache["k"].shape[3]
    pos = positions[:, None]
    k_pos = jnp.arange(c, dtype=jnp.int32)[None, None, :]
    vis_cache = (k_pos >= 1) & (k_pos < pos[..., None])  # [B, 1, C]: below the row; its own position: its new key
    own = ((pos >= 1) & (pos < c))[:, :, None, None] & jnp.ones((b, 1, b, 1), bool)
    vis_new = own & jnp.eye(b, dtype=bool)[:, None, :, None]
    e = embed_rows(params, target_params, tokens[:, None])
    logits, x, normed, k_new, v_new = run_pass(spec, packed, cache, e, g[:, None], pos, _own_rows(vis_cache, b),
                                               vis_new, interpret)
    keep = jnp.ones_like(pos, bool)
    kc, vc = cache["k"], cache["v"]
    for i in range(spec.layer.num_layers):
        kc, vc = write_head_rows(kc, i, pos, keep, k_new[i]), write_head_rows(vc, i, pos, keep, v_new[i])
    feedback = normed if spec.kind == "mtp" or spec.norm_output else x
    return logits[:, 0], feedback[:, 0], {**cache, "k": kc, "v": vc}


def block_pass(spec: DrafterSpec, packed: dict, params: dict, target_params: dict, state: dict, anchor: jax.Array,
               anchor_pos: jax.Array, interpret) -> tuple[jax.Array, jax.Array]:
    """`tpumk.draft.block.block_forward` through the kernel: every block row sees the committed
    context below the anchor and every row of its block."""
    s, b = spec.block_size, anchor.shape[0]
    c = state["k"].shape[3]
    pos = anchor_pos[:, None] + jnp.arange(s, dtype=jnp.int32)
    tokens = jnp.concatenate([anchor[:, None], jnp.full((b, s - 1), spec.mask_token_id, jnp.int32)], 1)
    e = embed_rows(params, target_params, tokens)
    committed = jnp.minimum(state["length"], anchor_pos)
    vis_cache = jnp.broadcast_to((jnp.arange(c)[None, :] < committed[:, None])[:, None, :], (b, s, c))
    vis_new = _own_rows(jnp.ones((b, s, s), bool), b)
    logits, _, normed = run_pass(spec, packed, state, e, None, pos, _own_rows(vis_cache, b), vis_new, interpret)
    return normed, logits


class Prepared(NamedTuple):
    """A drafter's weights for a round program: as stored (absorb's XLA operations) and packed for
    the kernel (`pack`), made once per device call."""

    params: Any
    packed: Any


class KernelDrafter:
    """A Drafter (tpumk.draft.drafter) whose proposals run through the drafter's pass kernel: the
    chain's steps (eagle3 / mtp) or the block pass (dflash / dspark); `absorb` (the context of the
    accepted rows) stays XLA operations. `interpret`: pallas_call's. `mesh`: a many-device round
    program's mesh: the drafter is replicated, every device runs the same pass on its copy (a
    shard_map with every operand replicated)."""

    def __init__(self, drafter, interpret, mesh=None):
        self.drafter, self.interpret, self.mesh = drafter, interpret, mesh
        self.spec, self.params = drafter.spec, drafter.params

    kind = property(lambda self: self.spec.kind)
    taps = property(lambda self: self.spec.taps)
    block = property(lambda self: self.spec.block)

    def __repr__(self) -> str:
        return repr(self.drafter).replace("Drafter(", "Drafter(pass kernel, ", 1)

    def init_state(self, batch: int, context: int) -> dict:
        return self.drafter.init_state(batch, context)

    def prepare(self, params, target_params) -> Prepared:
        return Prepared(params, pack(self.spec, params, target_params))

    def absorb(self, params, target_params, state, hidden, tokens, positions, valid) -> dict:
        raw = params.params if isinstance(params, Prepared) else params
        return self.drafter.absorb(raw, target_params, state, hidden, tokens, positions, valid)

    def _replicated(self, fn):
        if self.mesh is None:
            return fn
        from jax.sharding import PartitionSpec as P

        return jax.shard_map(fn, mesh=self.mesh, in_specs=P(), out_specs=P(), check_vma=False)

    def _pass(self, prep: Prepared, target_params):
        spec, interp = self.spec, self.interpret
        if spec.kind in ("eagle3", "mtp"):
            run = self._replicated(lambda pk, tp, cache, tok, g, pos: chain_step(spec, pk.packed, pk.params, tp, cache,
                                                                                 tok, g, pos, interp))
            return "step", lambda cache, tok, g, pos: run(prep, target_params, cache, tok, g, pos)
        run = self._replicated(lambda pk, tp, state, anchor, pos: block_pass(spec, pk.packed, pk.params, tp, state,
                                                                             anchor, pos, interp))
        return "forward", lambda state, anchor, pos: run(prep, target_params, state, anchor, pos)

    def _impl_args(self, params, target_params):
        prep = params if isinstance(params, Prepared) else self.prepare(params, target_params)
        name, fn = self._pass(prep, target_params)
        impl = chain_drafter if self.spec.kind in ("eagle3", "mtp") else block_drafter
        return impl, prep.params, {name: fn}

    def propose(self, params, target_params, state, anchor, anchor_pos, key=None, temperature=1.0):
        impl, raw, kw = self._impl_args(params, target_params)
        return impl.propose(self.spec, raw, target_params, state, anchor.astype(jnp.int32),
                            anchor_pos.astype(jnp.int32), key, temperature, **kw)

    def logits(self, params, target_params, state, anchor, anchor_pos, tokens):
        impl, raw, kw = self._impl_args(params, target_params)
        return impl.logits(self.spec, raw, target_params, state, anchor.astype(jnp.int32),
                           anchor_pos.astype(jnp.int32), tokens.astype(jnp.int32), **kw)


def through_kernel(drafter, target, mesh=None, portable: bool = False):
    """The drafter a megakernel round program runs: `KernelDrafter` on `target` (a tpumk Target:
    compiled for a TPU, the TPU interpreter on the cpu target, the portable interpreter when
    `portable`), or the drafter itself (its passes XLA operations) when the kernel does not
    model it (`refusal`)."""
    if refusal(drafter.spec) is not None:
        return drafter
    interp = (True if portable else tpu_interpreter()) if target.interpret else False
    return KernelDrafter(drafter, interp, mesh)
