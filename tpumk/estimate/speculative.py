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

Where a drafter's heads do not split over all the target's devices (the published Kimi K2 DSpark:
16 KV heads of 64 over 32 devices), it is planned on the largest device count that splits them,
the others waiting: said in the result's notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tpumk.draft import BLOCK_KINDS, DrafterSpec
from tpumk.errors import PlanError
from tpumk.estimate.timeline import megakernel_step
from tpumk.plan.plan import Plan, make_plan
from tpumk.plan.spec import BuildSpec


@dataclass(frozen=True)
class DrafterPlan:
    """One drafter pass, planned: its plan, the passes per round, and the device count it runs on."""

    plan: Plan
    passes: int
    devices: int
    projection_bytes: float  # per device, per round: the taps' projections' weights

    @property
    def pass_seconds(self) -> float:
        return megakernel_step(self.plan).seconds


def drafter_body(d: DrafterSpec):
    """The drafter's decoder layers and head as a model tpumk plans: its layers, its draft
    vocabulary's head; the dflash family's block attends to the whole block."""
    body = d.layer.replace(vocab_size=d.draft_vocab, name=f"{d.kind}-draft-{d.layer.name}")
    return body.replace(step_bidirectional=True) if d.kind in BLOCK_KINDS else body


def plan_drafter(spec: BuildSpec, d: DrafterSpec) -> DrafterPlan:
    """The drafter pass for the target build `spec` (its target, batch, context, devices): the
    largest device count at most spec.devices its heads split over (PlanError if none)."""
    body = drafter_body(d)
    rows = d.block_size if d.kind in BLOCK_KINDS else 1
    passes = 1 if d.kind in BLOCK_KINDS else d.block
    errors = []
    for n in sorted({n for n in range(1, spec.devices + 1) if spec.devices % n == 0}, reverse=True):
        try:
            plan = make_plan(BuildSpec(body, spec.target, spec.batch, spec.context, q_len=rows,
                                       page_size=spec.page_size, devices=n))
        except PlanError as e:
            errors.append(f"{n} devices: {e}")
            continue
        return DrafterPlan(plan, passes, n, _projection_bytes(d, n))
    raise PlanError(f"drafter {d.kind}: no device count up to {spec.devices} plans it ({errors[0]})")


def _projection_bytes(d: DrafterSpec, devices: int) -> float:
    """Weights the taps' projection reads once a round, per device: fc (taps x H -> H; mtp's
    eh_proj of 2H) and, for the dflash family, every layer's k and v of the projected context."""
    lay, h = d.layer, d.layer.hidden_size
    fc = (len(d.taps) if d.kind != "mtp" else 2) * h * h
    kv = lay.num_layers * h * 2 * lay.num_kv_heads * lay.head_dim if d.kind in BLOCK_KINDS else 0
    # eagle3's layer reads [embedding; hidden] (2H wide): q / k / v's second H rows, every pass
    wide = d.block * h * (lay.num_q_heads + 2 * lay.num_kv_heads) * lay.head_dim if d.kind == "eagle3" else 0
    return float((fc + kv + wide) * lay.dtype_bytes) / devices


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
    draft_s = dp.passes * dp.pass_seconds + projection_s
    round_s = verify_s + draft_s
    b = spec.batch
    rows = [{"acceptance": a, "per_sequence": a / round_s, "aggregate": b * a / round_s,
             "speedup": a * plain_s / round_s} for a in acceptance]
    notes = []
    if dp.devices < spec.devices:
        notes.append(f"the drafter runs on {dp.devices} of the {spec.devices} devices (its "
                     f"{d.layer.num_kv_heads} KV heads of {d.layer.head_dim} split no further); the others wait")
    if d.kind == "dspark" and d.markov_rank:
        notes.append(f"dspark's Markov logit bias (rank {d.markov_rank}) is not in the model: its weights and the "
                     "left-to-right pick are left out of the drafter's pass")
    if d.kind == "dflash2":
        notes.append("dflash2's dynamic convolutions and candidate selector are not in the model: left out of the "
                     "drafter's pass")
    return {
        "drafter": {"kind": d.kind, "block": k, "taps": list(d.taps), "layers": d.layer.num_layers,
                    "hidden": d.layer.hidden_size, "draft_vocab": d.draft_vocab, "devices": dp.devices,
                    "passes_per_round": dp.passes, "rows_per_pass": dp.plan.q_len,
                    "pass_seconds": dp.pass_seconds, "pass_hbm_bytes": dp.plan.hbm_bytes,
                    "projection_seconds": projection_s},
        "plain_step_seconds": plain_s, "verify_step_seconds": verify_s, "verify_hbm_bytes": verify.hbm_bytes,
        "verify_taps_bytes": verify.hbm.get("hidden_taps", 0.0), "draft_seconds": draft_s, "round_seconds": round_s,
        "plain": {"per_sequence": 1 / plain_s, "aggregate": b / plain_s},
        "break_even_acceptance": round_s / plain_s,
        "rows": rows, "notes": notes,
        "source": "tpumk's timeline model of the planned steps (tpumk.estimate.timeline), not measurements",
    }
