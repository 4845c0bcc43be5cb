"""The kernel contract (tpumk.plan.contract): one description the plan, the kernel and the AOT specs share.

Checks that it is the truth about the built kernel, not a fourth copy kept in sync by hand:
- the plan's VMEM total is the contract's VMEM buffers (scratch + VMEM operands) plus the one
  estimate that is not a buffer (the MoE stage's compiler temporaries), nothing else;
- the traced pallas_call takes exactly the contract's operands (order, shape, dtype, memory
  space), returns its outputs, aliases what it says, and allocates exactly its scratch, so every
  VMEM byte the kernel allocates is in the plan's count;
- the operands' sources resolve in `step_specs` and `pack_weights` with the same shapes;
- a deviceless compile for TPU7x of a tiny model still gives exactly one tpu_custom_call, with
  one operand per contract operand.
"""

from __future__ import annotations

import json
import math
import re

import jax
import pytest

from tpumk.compile.aot import compile_plan
from tpumk.kernel.layout import pack_weights, packed_specs
from tpumk.kernel.megakernel import make_decode_step, step_specs
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.contract import VMEM_COMPONENTS
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

# (preset, target, batch, context, q_len)
PLANS = [
    ("tiny-dense", "cpu", 1, 64, 1),
    ("tiny-dense", "tpu7x", 2, 64, 2),
    ("tiny-moe", "cpu", 4, 64, 1),
    ("qwen3-8b", "tpu7x", 1, 4096, 1),
    ("qwen3-8b", "tpu7x", 8, 4096, 1),
    ("qwen3-30b-a3b", "tpu7x", 1, 4096, 1),  # MoE only, no shared experts: the FFN activation is unused
    ("qwen3-30b-a3b", "tpu7x", 8, 4096, 1),
]
SPACE_OF_REF = {"smem": "smem", "vmem": "vmem", "hbm": "any", "semaphore": "semaphore_mem"}


def _plan(preset, target, batch, context, q_len):
    return make_plan(BuildSpec(load_preset(preset), get_target(target), batch, context, q_len=q_len))


def _vmem_tile_bytes(shape, dtype) -> int:
    """Bytes of a VMEM array in whole (sublanes x 128) tiles, computed here independently."""
    shape = (1, *shape) if len(shape) == 1 else tuple(shape)
    itemsize = jax.numpy.dtype(dtype).itemsize
    sub = 8 * 4 // itemsize  # 8 rows of 32-bit, 16 of 16-bit
    *lead, r, c = shape
    return math.prod(lead) * (-(-r // sub) * sub) * (-(-c // 128) * 128) * itemsize


def _pallas_eqn(plan):
    jaxpr = jax.make_jaxpr(make_decode_step(plan))(*step_specs(plan))

    def walk(jx):
        for e in jx.eqns:
            if e.primitive.name == "pallas_call":
                yield e
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    eqns = list(walk(jaxpr.jaxpr))
    assert len(eqns) == 1, f"expected one pallas_call in the step, found {len(eqns)}"
    return eqns[0]


@pytest.mark.parametrize("case", PLANS, ids=[f"{p}-{t}-b{b}-q{q}" for p, t, b, _, q in PLANS])
def test_plan_vmem_is_the_contracts_buffers(case):
    plan = _plan(*case)
    c = plan.contract
    temporaries = plan.vmem.get("moe_temporaries", 0)
    assert (temporaries > 0) == (plan.moe is not None)
    # The whole plan total: every VMEM scratch byte + the VMEM operands + the MoE estimate.
    assert plan.vmem_total == c.vmem_scratch_bytes() + c.vmem_operand_bytes() + temporaries
    # Component by component.
    assert {k: v for k, v in plan.vmem.items() if k != "moe_temporaries"} == c.vmem_by_component()
    assert plan.vmem["inputs"] == c.vmem_operand_bytes()
    assert plan.vmem["weight_ring"] == plan.ring_depth * plan.slot_rows * plan.slot_cols * plan.cfg.dtype_bytes
    assert plan.vmem["attention"] == plan.attention.vmem_bytes()
    if plan.moe is not None:
        assert plan.vmem["moe"] == plan.moe.scratch_bytes()
        assert plan.vmem["moe"] + temporaries == plan.moe.vmem_bytes()
    assert set(plan.vmem) <= set(VMEM_COMPONENTS) | {"moe_temporaries"}
    # The FFN activation buffer is allocated at least one lane tile wide, and counted.
    act = next(b for b in c.scratch if b.name == "act")
    assert act.shape[1] == max(plan.ffn_pad, plan.shared_ffn_pad, 128) and act.component == "activations"
    json.dumps(c.summary())


@pytest.mark.parametrize("case", PLANS[:3] + PLANS[5:6], ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}-q{c[4]}")
def test_traced_kernel_takes_and_allocates_exactly_the_contract(case):
    plan = _plan(*case)
    c = plan.contract
    eqn = _pallas_eqn(plan)
    assert eqn.params["input_output_aliases"] == c.aliases
    assert [(v.aval.shape, v.aval.dtype) for v in eqn.invars] == [(b.shape, b.jnp_dtype) for b in c.operands]
    assert [(a.shape, a.dtype) for a in eqn.params["out_avals"]] == [(b.shape, b.jnp_dtype) for b in c.outputs]
    # The kernel body's refs: operands, outputs, then scratch, each in its memory space.
    refs = [v.aval for v in eqn.params["jaxpr"].invars]
    want = c.operands + c.outputs + c.scratch
    assert len(refs) == len(want)
    for ref, b in zip(refs, want):
        assert (str(ref.memory_space), tuple(ref.shape)) == (SPACE_OF_REF[b.space], b.shape), b.name
        if b.space != "semaphore":
            assert ref.dtype == b.jnp_dtype, b.name
    # Every VMEM byte the kernel allocates (scratch and VMEM operands) is in the plan's count.
    allocated = sum(_vmem_tile_bytes(r.shape, r.dtype) for r in refs if str(r.memory_space) == "vmem")
    assert allocated == c.vmem_scratch_bytes() + c.vmem_operand_bytes()
    assert allocated == plan.vmem_total - plan.vmem.get("moe_temporaries", 0)


def _leaves(tree) -> dict[str, tuple]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["packed." + ".".join(k.key for k in path)] = (tuple(leaf.shape), leaf.dtype)
    return out


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_operands_resolve_in_step_specs_and_packed_weights(preset):
    cfg = load_preset(preset)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, 64, TuningConfig(ring_depth=3), q_len=2))
    c = plan.contract
    packed, tokens, positions, cache = step_specs(plan)
    # The contract's packed leaves are packed_specs' and pack_weights' (keys, shapes, dtypes).
    want = {b.source: (b.shape, b.jnp_dtype) for b in c.packed}
    assert _leaves(packed) == want == _leaves(packed_specs(plan))
    assert _leaves(pack_weights(plan, random_params(cfg, seed=0))) == want
    # Every operand comes from somewhere the step has, with the declared shape and dtype.
    n = plan.rows
    glue = {"step.positions": positions, "step.x0": jax.ShapeDtypeStruct((n, cfg.hidden_size), "float32"),
            "step.cos": jax.ShapeDtypeStruct((n, cfg.head_dim), "float32"),
            "step.sin": jax.ShapeDtypeStruct((n, cfg.head_dim), "float32")}
    sources = []
    for b in c.operands:
        kind, _, field = b.source.partition(".")
        if kind == "packed":
            got = want[b.source]
        elif kind == "cache":
            spec = getattr(cache, field)
            got = (tuple(spec.shape), spec.dtype)
        else:
            got = (tuple(glue[b.source].shape), glue[b.source].dtype)
        assert got == (b.shape, b.jnp_dtype), b.name
        sources.append(b.source)
    assert tokens.shape == positions.shape == (plan.batch, plan.q_len)
    # Operand order: SMEM scalars, VMEM rows, then the HBM arrays (norm vectors, the streamed
    # families in ring order, the experts), the two caches last (aliased to outputs 1 and 2).
    fams = [f"packed.{f}" for f in plan.families]
    moe = [f"packed.moe.{k}" for k in ("router", "e_gateup", "e_down")] if plan.moe is not None else []
    assert sources == (["cache.block_tables", "cache.lengths", "step.positions", "step.x0", "step.cos", "step.sin",
                        "packed.final_norm", "packed.layer_vectors"] + fams + moe + ["cache.k", "cache.v"])
    assert c.input_output_aliases == {len(sources) - 2: 1, len(sources) - 1: 2}


def test_deviceless_compile_is_one_custom_call_with_the_contracts_operands():
    plan = _plan("tiny-moe", "tpu7x", 2, 64, 1)
    compiled = compile_plan(plan)
    assert compiled.custom_calls == 1
    line = next(l for l in compiled.hlo_text.splitlines() if 'custom_call_target="tpu_custom_call"' in l)
    constraints = re.search(r"operand_layout_constraints=\{(.*?\})\}, ", line).group(1)
    shapes = re.findall(r"(\w+)\[([\d,]*)\]", constraints)
    assert [tuple(int(d) for d in s.split(",") if d) for _, s in shapes] == [b.shape for b in plan.contract.operands]
    assert f'"size":"{plan.vmem_limit}"' in line  # compiled with the plan's scoped-VMEM limit
