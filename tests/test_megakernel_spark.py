"""Muse Spark's parts through the whole megakernel (issue 57), against the pure-JAX reference in
interpret mode with the race detector on, and the same plans compiled deviceless for TPU7x
(tests/test_megakernel.py's check_step): the embedding's weightless RMSNorm (embed_norm), gated
residuals (residual_gates), post-sublayer norms on routed layers with their own epsilon
(post_norms, post_norm_eps), each head's output normalised before the sigmoid output gate
(attn_out_norm), NoPE on some attention layers but not all (nope_layers), and the routed experts
at moe_hidden_size between a normed down-projection (moe_in) and an up-projection (moe_out), each
expert's output normalised (expert_post_norm).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from test_megakernel import check_step
from test_megakernel_archs import assert_variants_move_the_logits, MODELS
from tpumk.errors import NotSupportedError, PlanError
from tpumk.model.config import load_preset
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import check_kernel_parts, make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

# Muse Spark in small: 64-wide heads (two per 128-lane block, as its 64-wide heads run), layers 0
# and 2 sliding a 20-token window, layer 1 a NoPE full layer; a dense layer 0, then layers routed
# by sigmoid scores with a correction bias and no shared expert; every sublayer's output
# normalised (epsilon 0.1, so it shows against rms_eps 1e-6) and joined by a gate; the embedding
# normalised; each head's output normalised before the output gate; the logits soft-capped; the
# experts (256 wide) at width 128, half the hidden size, each one's output normalised.
SPARK = dict(head_dim=64, num_q_heads=8, num_kv_heads=2, sliding_window=20, sliding_layers=[0, 2], nope_layers=[1],
             num_shared_experts=0, shared_expert_ffn_size=0, router_scoring="sigmoid", router_correction_bias=True,
             embed_norm=True, post_norms=True, post_norm_eps=0.1, residual_gates=True, attn_output_gate=True,
             attn_out_norm=True, final_softcap=20.0, moe_hidden_size=128, expert_post_norm=True)
MODELS["moe-spark"] = ("tiny-moe", SPARK)  # (assert_variants_move_the_logits reads the archs' table)


@functools.lru_cache(maxsize=None)
def spark_model(dtype: str):
    from test_megakernel_archs import model

    return model("moe-spark", dtype)


@pytest.mark.parametrize("dtype, lengths, q_len, knobs", [
    # two 128-column chunks per expert in two slots: each expert's output is normalised whole
    pytest.param("float32", [17, 44], 1, dict(kv_tile_pages=1, expert_chunk=128, expert_slots=2), id="f32-q1-chunked"),
    # a verify step of 2 tokens, whole experts in one slot (the full tier: tests/README.md)
    pytest.param("float32", [23, 9], 2, dict(kv_tile_pages=1), marks=pytest.mark.full, id="f32-q2"),
])
def test_spark_parts_match_reference(dtype, lengths, q_len, knobs):
    cfg, params = spark_model(dtype)
    check_step(cfg, params, dtype, lengths, q_len, knobs)


# Each part the case above holds the kernel to (1e-5 of the logits' scale) moves the reference's
# logits by more than 1e-3 of their scale when it is off, so a kernel that ignored it would fail.
SPARK_PARTS = {
    "embed_norm": dict(embed_norm=False),
    "residual_gates": dict(residual_gates=False),
    "post_norm_eps": dict(post_norm_eps=0.0),
    "post_norms": dict(post_norms=False, post_norm_eps=0.0),
    "attn_out_norm": dict(attn_out_norm=False),
    "nope_layers": dict(nope_layers=[]),
    "expert_post_norm": dict(expert_post_norm=False),
}


@pytest.mark.full  # tests/README.md: what covers it in the default run
def test_each_spark_part_changes_the_output():
    assert_variants_move_the_logits("moe-spark", [(changes, None) for changes in SPARK_PARTS.values()])


def test_muse_spark_is_built_but_not_with_sinks():
    """Every Muse Spark part is built (check_kernel_parts passes the preset); attention sinks
    beside experts at moe_hidden_size (whose norm takes the sinks' vector row) are refused in one
    line."""
    cfg = load_preset("muse-spark")
    check_kernel_parts(cfg)
    with pytest.raises(NotSupportedError) as e:
        check_kernel_parts(cfg.replace(attn_sinks=True))
    assert "\n" not in str(e.value) and "moe_hidden_size" in str(e.value)


def test_plan_counts_the_projections_and_keeps_experts_whole_on_many_devices():
    """The plan streams moe_in [H, M] and moe_out [M, H] once per routed layer (their bytes in the
    step's weights, whole on every device), and with expert_post_norm never splits an expert's
    width over devices (its norm needs the whole output): an expert_parallel that would is refused
    in one line naming it."""
    cfg, _ = spark_model("float32")
    routed = cfg.num_layers - cfg.pattern.num_dense
    for devices in (1, 2):
        plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 64, devices=devices))
        for name in ("moe_in", "moe_out"):
            assert plan.hbm[f"weights_{name}"] == routed * cfg.hidden_size * cfg.moe_hidden_size * 4, name
        assert plan.moe.hidden == cfg.moe_hidden_size and plan.moe.router_in == cfg.hidden_size
    assert plan.sharding.expert_tensor == 1 and plan.moe.local_experts == cfg.num_experts // 2
    with pytest.raises(PlanError) as e:
        make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, 64, TuningConfig(expert_parallel=1), devices=2))
    assert "\n" not in str(e.value) and "whole experts (expert_post_norm)" in str(e.value)


@functools.lru_cache(maxsize=None)
def quantized_spark(scheme: str = "int4"):
    """The small model's build and weights under --quant `scheme`: int4, the ring in int8 (moe_in
    and moe_out with their column scales) and the experts in int4 at width M; nvfp4, the ring in
    the model dtype and the experts in nvfp4."""
    from tpumk.model.quantize import quantize_params

    cfg, params = spark_model("float32")
    return cfg, BuildSpec(cfg, get_target("cpu"), batch=1, context=64, quant=scheme), \
        quantize_params(cfg, params, scheme)


@pytest.mark.full  # (tests/README.md)
@pytest.mark.parametrize("scheme", ["int4", "nvfp4"])
def test_quantized_projections_and_experts_match_the_quantized_reference(scheme):
    """--quant int4 / nvfp4: two kernel steps against the quantized reference."""
    from test_quant import _check_two_steps

    cfg, spec, qp = quantized_spark(scheme)
    plan = make_plan(spec)
    ring = "int8" if scheme == "int4" else "float32"
    assert plan.contract.operand("moe_in").dtype == plan.contract.operand("moe_out").dtype == ring
    _check_two_steps(plan, cfg, qp, 1, 1, "float32", 64)


def test_quantized_projections_pack_on_every_device():
    """--quant int4 on 2 devices: each device's weights pack (moe_in / moe_out whole and quantized
    on each, their column scales in the layer's scale row)."""
    from tpumk.kernel.layout import pack_sharded

    _, spec, qp = quantized_spark()
    plan = make_plan(spec.replace(devices=2))
    packed = pack_sharded(plan, qp)
    assert packed["moe_in"].shape[0] == packed["layer_scales"].shape[0] == 2
    assert packed["moe_in"].dtype == packed["moe_out"].dtype == jnp.int8
    at, m = plan.scale_offsets["moe_in"], plan.families["moe_in"].m
    assert bool(jnp.all(packed["layer_scales"][:, 1, 0, at:at + m] > 0))  # layer 1 (routed): its scales
