"""tpumk.kernel.unpack: the reference-layout weights read back from the packed ones (the vLLM
plugin holds the packed layout only) equal the weights that were packed, bit for bit, for the
structures the plugin serves: dense and MoE layers, a shared expert, QK-norm rows repeated per head
of a lane block (64-wide heads), a tied embedding, q / k / v / o biases, gpt-oss's sinks, expert
biases and router bias, sliding layers, bfloat16 weights; on one device and in a many-device plan's
packing (`pack_sharded`, tensor parallel: KV heads split, or replicated over the devices of a
pair, the norms on every device: copies summed exactly). A many-device plan packs and unpacks
on one device (the devices only run the kernel). And a quantized plan is refused in one line."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from tpumk.errors import PlanError
from tpumk.kernel.layout import pack_sharded
from tpumk.kernel.unpack import Unpacker
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.padding import params_as_run
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

FULL = pytest.mark.full
# every leaf kind but the shared expert, on one device and on two (64-wide KV heads held in pairs:
# each KV head on both devices; the tied embedding whole and as each device's lm_head slice)
EVERY_LEAF = dict(head_dim=64, tie_embeddings=True, dtype="bfloat16", attn_sinks=True, sliding_window=8,
                  sliding_layers=[1], expert_bias=True, router_logit_bias=True, num_shared_experts=0,
                  shared_expert_ffn_size=0, qkv_bias=True, o_bias=True)
CASES = {  # name: (preset, overrides, devices); the default run's: the first two and "tp3-dense"
    "moe-hd64-tied-bf16-sinks-biases": ("tiny-moe", EVERY_LEAF, 1),
    "tp2-moe-hd64-tied-bf16-sinks-biases": ("tiny-moe", EVERY_LEAF, 2),
    # float32, one KV head per device, every norm in 3 places (summed in halves: a plain float32
    # sum of 3 copies is off by an ulp for some elements)
    "tp3-dense": ("tiny-dense", dict(num_layers=1, num_q_heads=6, num_kv_heads=3, hidden_size=384), 3),
    "dense": ("tiny-dense", {}, 1),
    "moe-shared-qknorm": ("tiny-moe", {}, 1),
    # bfloat16, 2 KV heads of 64 as one pair on all 4 devices, QK-norm rows in 8 places; the
    # shared expert split
    "tp4-moe-shared-hd64-bf16": ("tiny-moe", dict(head_dim=64, num_q_heads=8, dtype="bfloat16"), 4),
}
DEFAULT = ("moe-hd64-tied-bf16-sinks-biases", "tp2-moe-hd64-tied-bf16-sinks-biases", "tp3-dense")


@functools.lru_cache(maxsize=None)
def _case(name):
    preset, overrides, devices = CASES[name]
    cfg = load_preset(preset).replace(**overrides)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, 64, TuningConfig(), devices=devices))
    run = params_as_run(plan, random_params(cfg, seed=1))
    return plan, run


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=FULL) for n in CASES])
def test_unpacked_weights_are_the_packed_ones(name):
    plan, run = _case(name)
    assert plan.devices == CASES[name][2]
    unpack = Unpacker(plan, run)
    packed = jax.jit(functools.partial(pack_sharded, plan))(run)
    if plan.devices > 1:  # traced (jax.numpy), the per-device cut is the host's (numpy) bit for bit
        for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(pack_sharded(plan, run))):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    got = jax.jit(unpack)(packed)
    assert jax.tree.structure(got) == jax.tree.structure(run)
    for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(run), jax.tree.leaves(got)):
        assert have.dtype == want.dtype and have.shape == want.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(have, np.float32), np.asarray(want, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    # the leaves the packing repeats are found (the tied embedding is also the lm_head; 64-wide heads'
    # QK-norm rows repeat twice per lane block; on n devices the norms and the router sit on each,
    # a KV head on each of its kv_replicas devices)
    copies = dict(zip((jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(run)), unpack.copies))
    n, per_block = plan.devices, 2 if "hd64" in name else 1
    want = {"['embed']": 2 if "tied" in name else 1, "['layers'][0]['q_norm']": n * per_block,
            "['layers'][0]['attn_norm']": n, "['final_norm']": n, "['layers'][0]['wq']": 1,
            "['layers'][0]['wk']": 1 if n == 1 else plan.sharding.kv_replicas}
    if "moe" in name:
        want["['layers'][1]['router']"] = n
    assert {k: copies[k] for k in want} == want, copies
    if n == 1 and "tied" not in name:
        assert set(unpack.copies) == {1}, copies


def test_a_quantized_plan_is_refused_in_one_line():
    plan, run = _case(next(iter(CASES)))
    plan = dataclasses.replace(plan, quant="int8")
    with pytest.raises(PlanError, match="'int8' plan's weights are integer codes"):
        Unpacker(plan, run)
