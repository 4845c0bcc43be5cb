"""A speculative round by tpumk's model: the verify step with its taps, the drafter's passes, and
the accepted tokens per second they give at a mean acceptance length (not measurements).

A round (tpumk.draft.rounds) is one verify step of the target over k + 1 rows that also writes
the drafter's taps, then the drafter: the dflash family one pass over its block (an anchor and
mask tokens), eagle3 and mtp k chained passes of one row. Each drafter pass is modelled as what
it is made of, planned as a model of its own: its decoder layers (`DrafterSpec.layer`, the
dflash family's block attending to itself, `step_bidirectional`) and its head (the draft
vocabulary) on the target's devices, by the same timeline model as the target's step
(tpumk.estimate.timeline). The context a drafter keeps (the dflash family: every layer's keys and
values of the projected taps) is read as that plan's KV cache at the target's context; the taps'
projection (eagle3 / dflash's fc over the concatenated taps, every dflash layer's k / v of it)
reads its weights once per round (bytes at the HBM bandwidth), and so do the second half of
eagle3's q / k / v rows (its layer reads [embedding; hidden], 2H wide) on each pass.

The drafter is modelled as it is built. On N devices it is replicated (tpumk.kernel.draft_pass,
tpumk.compile.aot.round_specs: every drafter operand is P()), so every device reads all of its
weights and runs its passes over the whole batch: the model counts one device's whole pass, and
the taps' projection's weights whole, whatever N. A drafter the pass kernel models
(`tpumk.kernel.draft_pass.refusal` is None) is modelled as that kernel runs
(`kernel_pass_seconds`): each matrix streamed on its own through a ring of up to 12 slots
(`draft_pass.ring_depth`, the megakernel's defaults), the first tile of every matrix waited for,
the drafter's KV cache read once per KV head through such a ring, every sequence's chunks for every row, plus the once-per-device-call packing of its weights
spread over the call's rounds. A drafter it does not model keeps XLA passes, modelled as before
as a one-device plan of its layers and head by the megakernel's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tpumk.draft import BLOCK_KINDS, DrafterSpec
from tpumk.draft.rounds import RoundSpec
from tpumk.errors import PlanError
from tpumk.estimate.timeline import megakernel_step
from tpumk.plan.plan import Plan, make_plan
from tpumk.plan.spec import BuildSpec


@dataclass(frozen=True)
class DrafterPlan:
    """One drafter pass as built, on one device (the drafter is replicated): how it runs
    ("kernel": tpumk.kernel.draft_pass; "xla": XLA operations), the passes per round, a pass's
    rows per sequence, its seconds and HBM bytes, and per round the taps' projection's
    weights (XLA operations: `absorb`) and the kernel's weight packing (once a device call)."""

    runs: str
    passes: int
    rows: int
    pass_seconds: float
    pass_hbm_bytes: float
    projection_bytes: float
    pack_bytes_per_call: float = 0.0  # the kernel's weight layout: read and written once a device call
    stages: dict | None = None  # the kernel's pass by stage (seconds), for the docs and the bench


def drafter_body(d: DrafterSpec):
    """The drafter's decoder layers and head as a model tpumk plans: its layers, its draft
    vocabulary's head; the dflash family's block attends to the whole block."""
    body = d.layer.replace(vocab_size=d.draft_vocab, name=f"{d.kind}-draft-{d.layer.name}")
    return body.replace(step_bidirectional=True) if d.kind in BLOCK_KINDS else body


def plan_drafter(spec: BuildSpec, d: DrafterSpec) -> DrafterPlan:
    """The drafter's pass for the target build `spec` (its target, batch, context) as the round
    program builds it: replicated on every device, through the pass kernel where it models the
    drafter, else XLA passes (planned as one device's megakernel step of the drafter's body;
    PlanError if that plan fails)."""
    from tpumk.kernel import draft_pass

    per_seq = d.block_size if d.kind in BLOCK_KINDS else 1
    passes = 1 if d.kind in BLOCK_KINDS else d.block
    kernel = draft_pass.refusal(d) is None
    projection = _projection_bytes(d, kernel)
    if kernel:
        g = draft_pass.geometry(d, spec.batch, per_seq, spec.context, d.layer.dtype)
        stages = kernel_pass_seconds(spec.target, g)
        return DrafterPlan("kernel", passes, per_seq, sum(stages["seconds"].values()),
                           sum(stages["hbm_bytes"].values()), projection, 2.0 * _packed_copy_bytes(g), stages)
    try:
        plan = make_plan(BuildSpec(drafter_body(d), spec.target, spec.batch, spec.context, q_len=per_seq,
                                   page_size=spec.page_size, devices=1))
    except PlanError as e:
        raise PlanError(f"drafter {d.kind} (XLA passes, on each device): {e}") from None
    return DrafterPlan("xla", passes, plan.q_len, megakernel_step(plan).seconds, plan.hbm_bytes,
                       projection)


def kernel_pass_seconds(t, g) -> dict[str, dict[str, float]]:
    """tpumk's model of one run of the drafter's pass kernel (tpumk.kernel.draft_pass) of
    geometry `g` on target `t`, by the timeline model's primitives (tpumk.estimate.timeline):
    every matrix is a stream of its tiles through a ring of `draft_pass.ring_depth` slots (every
    family of the stream), all issued at the stream's start; the first step is waited for with
    only itself in flight (nothing streams across matrices), each later one costs max(its load
    with `depth` steps outstanding, as the megakernel's ring is counted, its MXU time). The KV
    cache streams once per KV head through such a ring (filled afresh per KV head), every chunk of every
    sequence (rows of other sequences are masked, not skipped), each chunk multiplied for the KV
    head's group of query heads. Returns seconds and HBM bytes by stage, and each stage's ring
    bytes. Elementwise work (norms, RoPE, softmax) is not modelled, as in the timeline."""
    from tpumk.estimate.timeline import DMA_LATENCY_S, OP_DISPATCH_S, load_seconds, mxu_seconds
    from tpumk.kernel import draft_pass

    r, d, h = g.rows, g.head_dim, g.hidden
    wb, hb, kvb = g.itemsize, _itemsize(g.head_dtype), g.itemsize
    mx = 6 if g.dtype == "float32" else 1  # Precision.HIGHEST on float32 weights (timeline.F32_MXU_PASSES)
    sec: dict[str, float] = {}
    hbm: dict[str, float] = {}
    in_flight: dict[str, float] = {}  # a stage's ring bytes (every slot of its stream)

    def stream(stage: str, n: int, family_bytes: list[float], stationary: float, passes: int = mx) -> None:
        s = float(sum(family_bytes))
        f = len(family_bytes)
        # a stream's ring (draft_pass.ring_depth slots, all issued at the stream's start) keeps
        # `depth` steps outstanding, as the megakernel's ring is counted (timeline.ring_layer_seconds)
        depth = draft_pass.ring_depth(int(s), n)
        first = load_seconds(t, s, s, descriptors=f, groups=f, groups_in_flight=f)
        load = load_seconds(t, s, depth * s, descriptors=f, groups=f, groups_in_flight=f * depth)
        compute = mxu_seconds(t, stationary, 2.0 * r * stationary, passes)
        # the stream's first step is waited for (nothing of it in flight before the stream starts)
        sec[stage] = sec.get(stage, 0.0) + first + compute + (n - 1) * max(load, compute)
        hbm[stage] = hbm.get(stage, 0.0) + n * s
        in_flight[stage] = max(in_flight.get(stage, 0.0), depth * s)

    if g.kind == "mtp":
        stream("eh_proj", h // g.eh_tile, [2 * h * g.eh_tile * wb], 2 * h * g.eh_tile)
    for i in range(g.layers):
        k = g.in_width(i)
        stream("q", g.heads, [k * d * wb], k * d)
        stream("k_v", g.kv_heads, [k * d * wb] * 2, 2 * k * d)
        # once per KV head: each chunk's keys and values through the MXU for its `group` query heads'
        # scores and p . v (the float32 softmax is elementwise)
        group = g.heads // g.kv_heads
        for _ in range(g.kv_heads):  # a ring of a KV head's chunks, filled afresh per KV head
            stream("kv_cache", g.batch * (g.context // g.chunk), [g.chunk * d * kvb] * 2, group * 2 * g.chunk * d,
                   1 if kvb < 4 else 6)
        stream("o", g.heads, [d * h * wb], d * h)
        stream("mlp", g.ffn // g.ffn_tile, [h * g.ffn_tile * wb] * 3, 3 * h * g.ffn_tile)
    stream("head", g.vocab // g.head_tile, [h * g.head_tile * hb], h * g.head_tile, 6 if hb == 4 else 1)
    sec["launch"] = OP_DISPATCH_S + 2 * DMA_LATENCY_S  # one kernel: its inputs' fill, its outputs' drain
    hbm["launch"] = 0.0
    return {"seconds": sec, "hbm_bytes": hbm, "ring_bytes": in_flight}


def _packed_copy_bytes(g) -> float:
    """Bytes of the matrices `tpumk.kernel.draft_pass.pack` moves (a transpose: q / k / v
    head-major, gate / up, eh_proj and the head as column tiles); o and down are reshapes only."""
    wb = g.itemsize
    layers = sum(g.in_width(i) * (g.heads + 2 * g.kv_heads) * g.head_dim + 2 * g.hidden * g.ffn
                 for i in range(g.layers))
    eh = 2 * g.hidden * g.hidden if g.kind == "mtp" else 0
    return float((layers + eh) * wb + g.hidden * g.vocab * _itemsize(g.head_dtype))


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _projection_bytes(d: DrafterSpec, kernel: bool) -> float:
    """Weights the taps' projection reads once a round (XLA operations, on every device: the
    drafter is replicated): fc (taps x H -> H; mtp's eh_proj of 2H) and, for the dflash family,
    every layer's k and v of the projected context; XLA passes of eagle3 (`kernel` False) also
    read the second H rows of its first layer's q / k / v each pass (the kernel's own streams
    count them when it runs the passes)."""
    lay, h = d.layer, d.layer.hidden_size
    fc = (len(d.taps) if d.kind != "mtp" else 2) * h * h
    kv = lay.num_layers * h * 2 * lay.num_kv_heads * lay.head_dim if d.kind in BLOCK_KINDS else 0
    # eagle3's layer reads [embedding; hidden] (2H wide): q / k / v's second H rows, every pass
    wide = d.block * h * (lay.num_q_heads + 2 * lay.num_kv_heads) * lay.head_dim \
        if d.kind == "eagle3" and not kernel else 0
    return float((fc + kv + wide) * lay.dtype_bytes)


def expected_acceptance_length(block: int, rate: float) -> float:
    """Tokens a round commits on average (accepted drafts + the target's own) when each draft is
    accepted with probability `rate`, independently, given its predecessors were: 1 + rate +
    ... + rate**block = (1 - rate**(block + 1)) / (1 - rate) (Leviathan et al. 2023's
    i.i.d. model); block + 1 at rate 1. What `tpumk tune --draft --acceptance-rate` ranks blocks
    by: a longer block commits more only while the rate keeps its later drafts alive."""
    if not (0 <= rate <= 1):
        raise PlanError(f"--acceptance-rate {rate!r}: expected a per-draft acceptance rate from 0 to 1")
    if rate == 1:
        return float(block + 1)
    return (1 - rate ** (block + 1)) / (1 - rate)


def _planned(what: str, spec: BuildSpec) -> Plan:
    try:
        return make_plan(spec)
    except PlanError as e:
        raise PlanError(f"{what}: {e}") from None


def round_model(spec: BuildSpec, d: DrafterSpec, acceptance: Sequence[float]) -> dict[str, Any]:
    """The round for the target build `spec` (its q_len ignored: the plain step is q = 1, the
    verify step k + 1 with the drafter's taps) at each mean acceptance length (tokens committed
    per verify step, accepted drafts + 1, at most k + 1)."""
    k = d.block
    spec_draft = spec.draft
    spec = spec.replace(draft=None)  # a round build's spec: its own step shapes are replaced below
    for a in acceptance:
        if not 1 <= a <= k + 1:
            raise PlanError(f"--acceptance {a:g}: expected a mean acceptance length from 1 to {k + 1} "
                            f"(the {k} drafts a round of {d.kind} proposes, plus the target's own token)")
    plain = _planned("the plain step (q = 1)", spec.replace(q_len=1, taps=()))
    verify = _planned(f"the verify step (q = {k + 1} with {len(d.taps)} taps)", spec.replace(q_len=k + 1, taps=d.taps))
    plain_s, verify_s = megakernel_step(plain).seconds, megakernel_step(verify).seconds
    dp = plan_drafter(spec, d)
    t = spec.target
    projection_s = dp.projection_bytes / t.hbm_bandwidth
    per_call = spec_draft.rounds_per_call if spec_draft is not None else RoundSpec.rounds_per_call
    # the kernel's weight layout, made once a device call: its weights read and written once
    pack_s = dp.pack_bytes_per_call / t.hbm_bandwidth / per_call
    draft_s = dp.passes * dp.pass_seconds + projection_s + pack_s
    round_s = verify_s + draft_s
    b = spec.batch
    rows = [{"acceptance": a, "per_sequence": a / round_s, "aggregate": b * a / round_s,
             "speedup": a * plain_s / round_s} for a in acceptance]
    notes = []
    if spec.devices > 1:
        notes.append(f"the drafter is replicated: each of the {spec.devices} devices reads all its weights and runs "
                     f"its passes over the whole batch (as built: tpumk.kernel.draft_pass)")
    if dp.runs == "xla":
        notes.append(f"{d.kind}'s passes are XLA operations (the drafter's pass kernel does not model it), "
                     "modelled as a one-device megakernel step of its layers and head")
    if d.kind == "dspark" and d.markov_rank:
        notes.append(f"dspark's Markov logit bias (rank {d.markov_rank}) is not in the model: its weights and the "
                     "left-to-right pick are left out of the drafter's pass")
    if d.kind == "dflash2":
        notes.append("dflash2's dynamic convolutions and candidate selector are not in the model: left out of the "
                     "drafter's pass")
    return {
        "drafter": {"kind": d.kind, "block": k, "taps": list(d.taps), "layers": d.layer.num_layers,
                    "hidden": d.layer.hidden_size, "draft_vocab": d.draft_vocab, "runs": dp.runs, "devices": 1,
                    "replicated_on": spec.devices, "passes_per_round": dp.passes, "rows_per_pass": dp.rows,
                    "pass_seconds": dp.pass_seconds, "pass_hbm_bytes": dp.pass_hbm_bytes,
                    "pass_stages": dict((dp.stages or {}).get("seconds", {})),
                    "projection_seconds": projection_s, "pack_seconds": pack_s, "rounds_per_call": per_call},
        "plain_step_seconds": plain_s, "verify_step_seconds": verify_s, "verify_hbm_bytes": verify.hbm_bytes,
        "verify_taps_bytes": verify.hbm.get("hidden_taps", 0.0), "draft_seconds": draft_s, "round_seconds": round_s,
        "plain": {"per_sequence": 1 / plain_s, "aggregate": b / plain_s},
        "break_even_acceptance": round_s / plain_s,
        "rows": rows, "notes": notes,
        "source": "tpumk's timeline model of the planned steps (tpumk.estimate.timeline), not measurements",
    }
