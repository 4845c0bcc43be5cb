"""XLA's SPMD decode step: the multi-device baseline for `tpumk bench` (issue 13), and the
program of a `cpu` artifact over several devices (docs/artifacts.md).

The program is `tpumk.model.xla_step.xla_decode_step` unchanged (the same reference-layout
weights, head-major contiguous KV cache, unrolled layers), compiled for N devices with its
weights and cache sharded over a 1-D mesh axis "tp" (Megatron-style tensor parallelism) and
XLA's SPMD partitioner inserting whatever collectives the sharding needs. Nothing here writes a
collective by hand: what XLA inserts is what the baseline pays.

Sharding (`spmd_layout`), per layer:
- wq split by output columns (query heads), wo by input rows: each device attends with its own
  heads and holds a partial o-projection, which XLA all-reduces;
- wk, wv and the KV cache [layers, batch, kv_heads, context, head_dim] split on the KV-head axis.
  With more devices than KV heads (Qwen3-32B's 8 KV heads on 32 devices) a KV head cannot be
  split N ways (cutting its 128-wide dimension would cut attention's contraction), so they are
  split as far as the heads allow, kv = gcd(num_kv_heads, N) ways, and replicated N / kv ways:
  the devices' axis is factored as ("tp" = kv, "tp_rep" = N / kv) over the same devices in the
  same order, every N-way split using both. Each query head stays on the devices holding its
  KV head (when the query heads do not divide over N either, wq / wo split kv ways with them).
  Fully replicating K/V instead was tried and rejected: XLA then computes the cache update
  sharded and all-gathers every layer's whole cache back to replicated, megabytes per layer,
  which no serving stack would run;
- w_gate, w_up (and the shared expert's) split by columns, w_down by rows (partial sums,
  all-reduced);
- routed experts e_gate / e_up / e_down [experts, ...]: expert-tensor parallel by default (each
  expert's FFN width split, every device holds a slice of every expert), or expert parallel
  (`expert_parallel=True`: the expert axis split, each device owns num_experts / N experts).
  The step gathers the routed experts' weights per token, so under expert parallelism XLA
  moves those weight slices between devices (an all-reduce of the masked local gathers), not
  the tokens: a real cost of this formulation, reported as XLA's collectives;
- router, norms and the embedding replicated; lm_head split by vocabulary columns, the logits
  gathered to every device (the step returns full logits, as the one-device step does);
- gated attention's wq_gate split as wq (its columns are the query heads');
- a hybrid's linear-attention layers (their weights and the state pool) replicated: every device
  computes them whole (their fused q | k | v projection interleaves three head groups, which a
  column split of the matrix would cut across), and `SpmdLayout.notes` says so.
A dimension that does not divide over the devices is replicated instead, and `SpmdLayout.notes`
says which and why (an explicit `expert_parallel` that cannot split is refused instead).

MLA models (head-parallel, as the megakernel splits them, tpumk.plan.sharding): wq_b (or wq) and
wkv_b split by output columns (whole heads: each head's columns are contiguous), wo by input
rows; wq_a, wkv_a and their norms replicated, and the latent cache [layers, batch, context, C+R]
replicated (every head reads all of it; every device computes and writes the same rows). Query
heads that do not divide over the devices are refused with one line.

`tpumk.decode.xla_spmd.compile_xla_spmd` compiles it deviceless for
`tpumk.targets.mesh_devices(target, n)` (the
smallest topology holding n devices: TPU7x 8 devices -> tpu7x:2x2x1) and returns the program
with its per-device HLO and the collective ops XLA put in it
(`tpumk.estimate.timeline.program_collectives`); `tpumk.estimate.timeline.xla_step` models it,
collectives included, as tpumk's model (never a measurement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tpumk.errors import ConfigError
from tpumk.model.config import ModelConfig
from tpumk.model.quantize import QuantizedMatrix
from tpumk.model.xla_step import XlaCache, xla_state_args, xla_step_specs

AXIS = "tp"  # the devices' one axis, as the caller's mesh names it
REP_AXIS = "tp_rep"  # its minor factor, when the KV heads split fewer ways than the devices
REPLICATED = P()


@dataclass(frozen=True)
class SpmdLayout:
    """How every tensor of the XLA step is split over the devices.

    The device axis is factored as (kv_split, replicas): kv_split = gcd(num_kv_heads, N) ways
    by KV head on axis "tp", times `replicas` on axis "tp_rep" (1 when the KV heads divide
    over the devices: then the mesh is the plain 1-D "tp"). A tensor split N ways is split
    over both axes jointly, i.e. over the devices in their 1-D order."""

    devices: int
    expert_parallel: bool
    kv_split: int
    params: Any  # the params pytree (as `xla_step_specs` builds it) with a PartitionSpec per leaf
    cache: P  # both KV caches [layers, batch, kv_heads, context, head_dim] (a hybrid's pool: replicated)
    notes: tuple[str, ...] = ()  # what is not split N ways, and why

    @property
    def replicas(self) -> int:
        return self.devices // self.kv_split

    @property
    def axes(self) -> tuple[str, ...]:
        return (AXIS,) if self.replicas == 1 else (AXIS, REP_AXIS)

    def mesh(self, mesh: Mesh) -> Mesh:
        """The caller's 1-D mesh over the same devices, in the same order, factored as `axes`."""
        return Mesh(np.asarray(mesh.devices).reshape(self.kv_split, self.replicas)
                    if self.replicas > 1 else np.asarray(mesh.devices), self.axes)

    def describe(self) -> dict[str, str]:
        """One spec per tensor role (the first layer that has it), for reports."""
        out = {k: str(v) for k, v in self.params.items() if k != "layers"}
        for lay in self.params["layers"]:
            out.update({k: str(v) for k, v in lay.items() if k not in out})
        out["kv_cache"] = str(self.cache)
        return out


def spmd_layout(cfg: ModelConfig, devices: int, expert_parallel: bool = False) -> SpmdLayout:
    """The Megatron-style sharding of `cfg`'s XLA step over `devices` (see the module doc)."""
    if not (isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1):
        raise ConfigError(f"devices = {devices!r}: expected a positive integer")
    n = devices
    if cfg.is_mla:
        return _mla_layout(cfg, n, expert_parallel)
    kvs = math.gcd(cfg.num_kv_heads, n)
    every = AXIS if kvs == n else (AXIS, REP_AXIS)  # split over all n devices
    col = P(None, every)
    notes: list[str] = []

    def split(size: int, what: str, field_name: str) -> P:
        if size % n == 0:
            return col
        notes.append(f"{field_name} = {size} does not divide over {n} devices: {what} replicated")
        return REPLICATED

    kv = P(None, AXIS) if kvs > 1 else REPLICATED
    cache = P(None, None, AXIS, None, None) if kvs > 1 else REPLICATED
    if kvs < n:
        notes.append(f"num_kv_heads = {cfg.num_kv_heads} with {n} devices: wk, wv and the KV cache split {kvs} "
                     f"way(s) by KV head, replicated {n // kvs} ways")
    if cfg.num_q_heads % n == 0:
        q = col
    else:  # keep each query head on the devices that hold its KV head
        q = kv
        notes.append(f"num_q_heads = {cfg.num_q_heads} does not divide over {n} devices: wq, wo split {kvs} way(s) "
                     f"with their KV heads")
    wo = P(q[1], None) if q != REPLICATED else REPLICATED
    roles = {"wq": q, "wq_gate": q, "wo": wo, "wk": kv, "wv": kv, **_ffn_roles(cfg, n, expert_parallel, every, split)}
    return _layout(cfg, n, expert_parallel, kvs, roles, cache, notes)


def _mla_layout(cfg: ModelConfig, n: int, expert_parallel: bool) -> SpmdLayout:
    """Head-parallel MLA (module doc): the latent path and cache replicated, heads split."""
    if cfg.num_q_heads % n:
        raise ConfigError(f"devices = {n}: expected a divisor of num_q_heads ({cfg.num_q_heads}) of model "
                          f"'{cfg.name}' (MLA heads are split across devices)")
    notes: list[str] = []

    def split(size: int, what: str, field_name: str) -> P:
        if size % n == 0:
            return P(None, AXIS)
        notes.append(f"{field_name} = {size} does not divide over {n} devices: {what} replicated")
        return REPLICATED

    heads = P(None, AXIS) if n > 1 else REPLICATED
    # Quantized, wkv_b is stored absorbed as w_uk [Hq, N, C] and w_uv [Hq, C, V]: split by head.
    per_head = P(AXIS, None, None) if n > 1 else REPLICATED
    roles = {"wq_b": heads, "wq": heads, "wkv_b": heads, "w_uk": per_head, "w_uv": per_head,
             "wo": P(AXIS, None) if n > 1 else REPLICATED, **_ffn_roles(cfg, n, expert_parallel, AXIS, split)}
    if n > 1:
        notes.append("MLA: wq_a, wkv_a and the latent cache replicated (every head reads the whole latent)")
    return _layout(cfg, n, expert_parallel, n, roles, REPLICATED, notes)


def _ffn_roles(cfg: ModelConfig, n: int, expert_parallel: bool, every, split) -> dict[str, P]:
    """Specs of the FFN / expert matrices and the lm_head (the same for GQA and MLA models)."""
    col, row = P(None, every), P(every, None)
    dense = split(cfg.ffn_size, "w_gate, w_up, w_down", "ffn_size") if cfg.ffn_size else REPLICATED
    shared_size = cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size if cfg.num_experts else 0
    shared = split(shared_size, "s_gate, s_up, s_down", "shared expert width") if shared_size else REPLICATED
    experts: dict[str, P] = {}
    if cfg.num_experts:
        if expert_parallel:
            if cfg.num_experts % n:
                raise ConfigError(f"expert_parallel: num_experts = {cfg.num_experts} does not split over {n} devices")
            experts = {k: P(every, None, None) for k in ("e_gate", "e_up", "e_down")}
            experts.update({k: P(every, None) for k in ("e_gate_bias", "e_up_bias", "e_down_bias")})
        elif split(cfg.moe.expert_ffn_size, "e_gate, e_up, e_down", "expert_ffn_size") == col:
            experts = {"e_gate": P(None, None, every), "e_up": P(None, None, every), "e_down": P(None, every, None),
                       "e_gate_bias": col, "e_up_bias": col}  # (e_down_bias whole: it joins after the sum)
    elif expert_parallel:
        raise ConfigError(f"expert_parallel: model '{cfg.name}' has no experts")
    roles = {"w_gate": dense, "w_up": dense, "w_down": row if dense == col else REPLICATED,
             "s_gate": shared, "s_up": shared, "s_down": row if shared == col else REPLICATED, **experts}
    if not cfg.head.tie_embeddings:
        roles["lm_head"] = split(cfg.vocab_size, "lm_head", "vocab_size")
    return roles


def _layout(cfg: ModelConfig, n: int, expert_parallel: bool, kvs: int, roles: dict, cache: P,
            notes: list[str]) -> SpmdLayout:
    params, _, _, _, _, _ = xla_step_specs(cfg, 1, 1, 1)
    if cfg.linear and n > 1:  # (their weights take no role below: replicated)
        notes.append(f"linear-attention layers ({len(cfg.linear_layers)}, {cfg.linear.linear_kind}): weights and the "
                     "state pool replicated, every device computes them whole")
    tree = {k: roles.get(k, REPLICATED) for k in params if k != "layers"}
    # (the float layout's keys, plus the quantized MLA layer's absorbed w_uk / w_uv)
    extra = ("w_uk", "w_uv") if cfg.is_mla else ()
    tree["layers"] = [{k: roles.get(k, REPLICATED) for k in (*lay, *extra)} for lay in params["layers"]]
    return SpmdLayout(n, expert_parallel, kvs, tree, cache, tuple(dict.fromkeys(notes)))


def _check_mesh(mesh: Mesh) -> None:
    if tuple(mesh.axis_names) != (AXIS,):
        raise ConfigError(f"mesh: axis names {tuple(mesh.axis_names)}: expected the one axis ('{AXIS}',)")


def scale_spec(matrix: P, qm: QuantizedMatrix, ways: int) -> P:
    """The sharding of a quantized matrix's scales, following its codes' `matrix` spec: a
    column split cuts the scales' columns alike; a row split keeps per-column scales whole
    (replicated) and cuts group scales by their groups when whole groups fall to each of the
    `ways` devices (else keeps them whole); a leading (expert) split cuts them alike."""
    if matrix == REPLICATED:
        return REPLICATED
    parts = tuple(matrix) + (None,) * (len(qm.q.shape) - len(tuple(matrix)))
    lead, row, col = parts[:-2], parts[-2], parts[-1]
    if not qm.grouped:
        return P(*lead, col)
    groups = qm.scale.shape[-2]
    whole = row is not None and qm.q.shape[-2] % ways == 0 and (qm.q.shape[-2] // ways) % qm.group == 0 \
        and groups % ways == 0
    return P(*lead, row if whole else None, col)


def xla_spmd_specs(cfg: ModelConfig, batch: int, context: int, q_len: int, mesh: Mesh,
                   expert_parallel: bool = False, quant: str = "none") -> tuple:
    """`xla_step_specs`' (params, tokens, positions, k_cache, v_cache, lengths) and a hybrid's
    state pool (`xla_state_args`), each a global ShapeDtypeStruct carrying its NamedSharding,
    per `spmd_layout`. `mesh` is 1-D ("tp"); the shardings use it factored as
    `SpmdLayout.mesh` (same devices, same order). With `quant` the quantized matrices' codes
    shard as the matrices and their scales follow (`scale_spec`)."""
    _check_mesh(mesh)
    layout = spmd_layout(cfg, int(mesh.size), expert_parallel)
    m = layout.mesh(mesh)
    params, tok, pos, kc, vc, lengths = xla_step_specs(cfg, batch, context, q_len, quant)
    pool = xla_state_args(cfg, batch, q_len)

    def on(s, spec: P):
        if isinstance(s, QuantizedMatrix):  # nvfp4's global scales follow the leading (expert) split
            lead = P(*(tuple(spec) + (None,) * len(s.q.shape))[:len(s.q.shape) - 2]) if spec != REPLICATED else spec
            return QuantizedMatrix(on(s.q, spec), on(s.scale, scale_spec(spec, s, layout.devices)),
                                   on(s.compute, REPLICATED), None if s.outer is None else on(s.outer, lead))
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(m, spec))

    sharded = {k: on(v, layout.params[k]) for k, v in params.items() if k != "layers"}
    sharded["layers"] = [{k: on(v, lay_spec[k]) for k, v in lay.items()}
                         for lay, lay_spec in zip(params["layers"], layout.params["layers"])]
    return (sharded, on(tok, REPLICATED), on(pos, REPLICATED), on(kc, layout.cache), on(vc, layout.cache),
            on(lengths, REPLICATED)) + tuple(jax.tree.map(lambda a: on(a, REPLICATED), s) for s in pool)


def xla_spmd_out_shardings(cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> tuple:
    """(logits, k_cache, v_cache, lengths[, a hybrid's pool]): logits, lengths and the pool on every
    device, the caches as they came in (so the donated caches are updated in place)."""
    _check_mesh(mesh)
    layout = spmd_layout(cfg, int(mesh.size), expert_parallel)
    m = layout.mesh(mesh)
    cache, rep = NamedSharding(m, layout.cache), NamedSharding(m, REPLICATED)
    return (rep, cache, cache, rep) + ((rep,) if cfg.linear else ())


def xla_cache_shardings(cfg: ModelConfig, batch: int, context: int, q_len: int, mesh: Mesh) -> tuple:
    """`xla_spmd_specs` for `tpumk.model.xla_step.xla_cache_step`: its (params, tokens,
    positions, XlaCache) as global ShapeDtypeStructs with their NamedShardings, and the
    shardings of its (logits, XlaCache) result."""
    params, tok, pos, k, v, lengths = xla_spmd_specs(cfg, batch, context, q_len, mesh)[:6]
    logits, kc, vc, n = xla_spmd_out_shardings(cfg, mesh)[:4]
    return (params, tok, pos, XlaCache(k, v, lengths)), (logits, XlaCache(kc, vc, n))
