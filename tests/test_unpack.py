"""tpumk.kernel.unpack: the reference-layout weights read back from the packed ones (the vLLM
plugin holds the packed layout only) equal the weights that were packed, for the structures the
plugin serves: dense and MoE layers, a shared expert, QK-norm rows repeated per head of a lane block
(64-wide heads), a tied embedding, q / k / v / o biases, gpt-oss's sinks, expert biases and router
bias, sliding layers, bfloat16 weights; and a quantized plan is refused in one line."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from tpumk.errors import PlanError
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.unpack import Unpacker
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.padding import params_as_run
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

FULL = pytest.mark.full  # the default run's case ("moe-hd64-tied-bf16-sinks-biases") covers every leaf kind but the shared expert
CASES = {
    "moe-hd64-tied-bf16-sinks-biases": ("tiny-moe", dict(head_dim=64, tie_embeddings=True, dtype="bfloat16",
                                                         attn_sinks=True, sliding_window=8, sliding_layers=[1],
                                                         expert_bias=True, router_logit_bias=True, num_shared_experts=0,
                                                         shared_expert_ffn_size=0, qkv_bias=True, o_bias=True)),
    "dense": ("tiny-dense", {}),
    "moe-shared-qknorm": ("tiny-moe", {}),
}


@functools.lru_cache(maxsize=None)
def _case(name):
    preset, overrides = CASES[name]
    cfg = load_preset(preset).replace(**overrides)
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, 64, TuningConfig()))
    run = params_as_run(plan, random_params(cfg, seed=1))
    return plan, run


@pytest.mark.parametrize("name", [n if i == 0 else pytest.param(n, marks=FULL) for i, n in enumerate(CASES)])
def test_unpacked_weights_are_the_packed_ones(name):
    plan, run = _case(name)
    unpack = Unpacker(plan, run)
    packed = jax.jit(functools.partial(pack_weights, plan))(run)
    got = jax.jit(unpack)(packed)
    assert jax.tree.structure(got) == jax.tree.structure(run)
    for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(run), jax.tree.leaves(got)):
        assert have.dtype == want.dtype and have.shape == want.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(have, np.float32), np.asarray(want, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    # the leaves the packing repeats are found (the tied embedding is also the lm_head; 64-wide heads'
    # QK-norm rows repeat twice per lane block)
    copies = dict(zip((jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(run)), unpack.copies))
    if "tied" in name:
        assert copies["['embed']"] == 2 and copies["['layers'][0]['q_norm']"] == 2, copies
    else:
        assert set(unpack.copies) == {1}, copies


def test_a_quantized_plan_is_refused_in_one_line():
    plan, run = _case(next(iter(CASES)))
    plan = dataclasses.replace(plan, quant="int8")
    with pytest.raises(PlanError, match="'int8' plan's weights are integer codes"):
        Unpacker(plan, run)
