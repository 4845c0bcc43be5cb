"""XLA's SPMD decode step (tpumk.model.xla_spmd, compiled by tpumk.decode.xla_spmd): the
sharding, deviceless compiles for TPU7x with 4 and 8 devices (about a second each, shared by the tests through a cache), the
collectives XLA inserts, per-device shapes, and the timeline model of the result."""

from __future__ import annotations

import functools
import math

import pytest

from tpumk.decode import xla_spmd as xs
from tpumk.model import xla_spmd as xl
from tpumk.model.xla_step import xla_step_specs
from tpumk.errors import ConfigError
from tpumk.estimate.timeline import xla_step
from tpumk.model.config import load_preset
from tpumk.targets import get_target

TPU7X = get_target("tpu7x")


@functools.lru_cache(maxsize=None)
def _program(preset: str, devices: int, expert_parallel: bool = False) -> xs.SpmdProgram:
    return xs.compile_xla_spmd(load_preset(preset), 1, 4096, 1, TPU7X, devices, expert_parallel)


def _ways(spec, layout: xl.SpmdLayout) -> list[int]:
    """How many ways each dimension of a tensor is split under `spec`."""
    size = {xl.AXIS: layout.kv_split, xl.REP_AXIS: layout.replicas}
    out = []
    for entry in tuple(spec):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        out.append(math.prod(size[n] for n in names))
    return out


# ---------------------------------------------------------------------- the sharding (no compile)
def test_megatron_layout_when_heads_divide():
    layout = xl.spmd_layout(load_preset("qwen3-32b"), 8)  # 64 q / 8 kv heads
    lay = layout.params["layers"][0]
    assert (layout.kv_split, layout.replicas, layout.axes) == (8, 1, ("tp",))
    assert lay["wq"] == lay["wk"] == lay["wv"] == lay["w_gate"] == lay["w_up"] == xl.P(None, "tp")
    assert lay["wo"] == lay["w_down"] == xl.P("tp", None)
    assert lay["attn_norm"] == layout.params["embed"] == xl.P()
    assert layout.params["lm_head"] == xl.P(None, "tp") and layout.cache == xl.P(None, None, "tp", None, None)
    assert not layout.notes


def test_more_devices_than_kv_heads_split_kv_as_far_as_heads_allow():
    layout = xl.spmd_layout(load_preset("qwen3-32b"), 32)
    lay = layout.params["layers"][0]
    assert (layout.kv_split, layout.replicas) == (8, 4)
    assert lay["wk"] == xl.P(None, "tp") and layout.cache == xl.P(None, None, "tp", None, None)
    assert lay["wq"] == xl.P(None, ("tp", "tp_rep"))  # 64 query heads still split 32 ways
    assert any("num_kv_heads = 8" in n and "replicated 4 ways" in n for n in layout.notes)
    tiny = xl.spmd_layout(load_preset("tiny-dense"), 8)  # 4 q / 2 kv heads
    assert tiny.params["layers"][0]["wq"] == xl.P(None, "tp") and tiny.params["layers"][0]["wo"] == xl.P("tp", None)
    assert any(n.startswith("num_q_heads = 4") for n in tiny.notes)


def test_expert_tensor_and_expert_parallel():
    cfg = load_preset("tiny-moe")  # 8 experts, expert FFN 256; layer 0 dense
    etp = xl.spmd_layout(cfg, 4).params["layers"][1]
    assert etp["e_gate"] == etp["e_up"] == xl.P(None, None, ("tp", "tp_rep")) and etp["router"] == xl.P()
    assert etp["e_down"] == xl.P(None, ("tp", "tp_rep"), None)
    ep = xl.spmd_layout(cfg, 8, expert_parallel=True).params["layers"][1]
    assert ep["e_gate"] == ep["e_up"] == ep["e_down"] == xl.P(("tp", "tp_rep"), None, None)
    assert "e_gate" not in xl.spmd_layout(cfg, 8).params["layers"][0]  # the dense layer


@pytest.mark.parametrize("preset, devices, ep, match", [
    ("tiny-moe", 16, True, r"^expert_parallel: num_experts = 8 does not split over 16 devices$"),
    ("tiny-dense", 4, True, r"^expert_parallel: model 'tiny-dense' has no experts$"),
    ("tiny-dense", 0, False, r"^devices = 0: expected a positive integer$"),
])
def test_bad_input_is_one_line_naming_the_field(preset, devices, ep, match):
    with pytest.raises(ConfigError, match=match):
        xl.spmd_layout(load_preset(preset), devices, ep)


def test_specs_carry_their_shardings_and_the_mesh_must_be_1d():
    import numpy as np
    from jax.sharding import Mesh

    cfg = load_preset("tiny-dense")
    mesh = xs.spmd_mesh(TPU7X, 4)
    specs = xl.xla_spmd_specs(cfg, 1, 256, 1, mesh)
    plain = xla_step_specs(cfg, 1, 256, 1)
    assert specs[0]["layers"][0]["wq"].shape == plain[0]["layers"][0]["wq"].shape  # global shapes
    sh = specs[0]["layers"][0]["wq"].sharding
    assert sh.shard_shape(plain[0]["layers"][0]["wq"].shape) == (256, 128)
    assert list(sh.mesh.devices.flat) == list(mesh.devices.flat)  # same devices, same order
    with pytest.raises(ConfigError, match=r"^mesh: axis names"):
        xl.xla_spmd_specs(cfg, 1, 256, 1, Mesh(np.array(mesh.devices).reshape(2, 2), ("a", "b")))


# ---------------------------------------------------------------------- compiled, deviceless
CASES = [("tiny-dense", 4, False), ("tiny-dense", 8, False), ("tiny-moe", 4, False), ("tiny-moe", 8, False),
         ("tiny-moe", 8, True)]


@pytest.mark.parametrize("preset, devices, ep", CASES)
def test_spmd_program_holds_xla_collectives(preset, devices, ep):
    cfg = load_preset(preset)
    p = _program(preset, devices, ep)
    assert p.devices == devices and p.topology == "tpu7x:2x2x1" and p.expert_parallel == ep
    assert p.collective_ops > 0
    # every layer's last projection (w_down / e_down split by rows, or wo) leaves partial sums to reduce
    assert p.collectives.get("all-reduce", 0) >= cfg.num_layers
    if cfg.num_q_heads % devices == 0:  # wo split too: its partial sums are reduced as well
        assert p.collectives["all-reduce"] >= 2 * cfg.num_layers


@pytest.mark.parametrize("preset, devices, ep", CASES)
def test_per_device_shapes_are_the_global_ones_split(preset, devices, ep):
    cfg = load_preset(preset)
    p = _program(preset, devices, ep)
    shapes = xs.entry_parameter_shapes(p.hlo_text)
    params = xla_step_specs(cfg, 1, 4096, 1)[0]
    checked = 0
    for i, (lay, spec) in enumerate(zip(params["layers"], p.layout.params["layers"])):
        for name, s in lay.items():
            ways = _ways(spec[name], p.layout) + [1] * len(s.shape)
            expected = tuple(d // w for d, w in zip(s.shape, ways))
            assert shapes[f"p['layers'][{i}]['{name}']"] == expected, (name, s.shape, spec[name])
            checked += 1
    assert checked >= 8 * cfg.num_layers  # every tensor of every layer
    # the FFN (dense, or each expert's width / the expert axis) is 1/N of its global size per device
    dense = shapes["p['layers'][0]['w_gate']"]
    assert dense[1] == cfg.ffn_size // devices
    if cfg.num_experts:
        e = shapes["p['layers'][1]['e_gate']"]
        assert e == ((cfg.num_experts // devices, cfg.hidden_size, cfg.expert_ffn_size) if ep
                     else (cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size // devices))
    assert shapes["p['lm_head']"] == (cfg.hidden_size, cfg.vocab_size // devices)


@pytest.mark.parametrize("preset, devices", [("tiny-dense", 4), ("tiny-moe", 8)])
def test_timeline_model_charges_the_collectives(preset, devices):
    p = _program(preset, devices)
    m = xla_step(TPU7X, p.hlo_text, devices=devices)
    coll = m.stages["collectives"]["seconds"]
    assert coll > 0 and m.seconds > coll
    assert any(f"{p.collective_ops} XLA collective ops" in n and "tpumk interconnect model" in n for n in m.notes)
    assert "tpumk timeline model" in m.source


@pytest.mark.slow
def test_qwen3_32b_on_8_tpu7x_devices_compiles():
    """About 50 s deviceless on a 2-core host (64 unrolled layers)."""
    cfg = load_preset("qwen3-32b")
    p = xs.compile_xla_spmd(cfg, 1, 4096, 1, TPU7X, 8)
    assert p.topology == "tpu7x:2x2x1" and not p.layout.notes
    assert p.collectives["all-reduce"] >= 2 * cfg.num_layers  # o-projection and down-projection per layer
    shapes = xs.entry_parameter_shapes(p.hlo_text)
    assert shapes["p['layers'][0]['wq']"] == (cfg.hidden_size, cfg.attention.q_size // 8)
    assert shapes["p['layers'][0]['w_down']"] == (cfg.ffn_size // 8, cfg.hidden_size)
    m = xla_step(TPU7X, p.hlo_text, devices=8)
    assert m.stages["collectives"]["seconds"] > 0


@pytest.mark.parametrize("ep", [False, True])
def test_quantized_weights_shard_with_their_scales(ep):
    """`--quant int4` on 4 devices: the codes shard as the matrices, the scales follow them
    (column splits cut their columns, row splits cut whole 128-row groups or keep them whole,
    the expert split cuts the expert axis), and XLA compiles the SPMD step."""
    cfg = load_preset("tiny-moe")
    p = xs.compile_xla_spmd(cfg, 1, 4096, 1, TPU7X, 4, ep, quant="int4")
    shapes = xs.entry_parameter_shapes(p.hlo_text)
    e, h, fe = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
    gate_q, gate_s = shapes["p['layers'][1]['e_gate'].q"], shapes["p['layers'][1]['e_gate'].scale"]
    down_q, down_s = shapes["p['layers'][1]['e_down'].q"], shapes["p['layers'][1]['e_down'].scale"]
    if ep:  # expert parallel: a quarter of the experts, whole
        assert gate_q == (e // 4, h, fe) and gate_s == (e // 4, h // 128, fe)
        assert down_q == (e // 4, fe, h) and down_s == (e // 4, fe // 128, h)
    else:  # expert-tensor: a quarter of each expert's width; down's rows keep their scale groups
        assert gate_q == (e, h, fe // 4) and gate_s == (e, h // 128, fe // 4)
        assert down_q == (e, fe // 4, h) and down_s[0] == e and down_s[2] == h
    wq = shapes["p['layers'][0]['wq'].q"]  # int8 per column: the column scales split with the columns
    assert shapes["p['layers'][0]['wq'].scale"] == (wq[1],) and p.collective_ops > 0


def test_nvfp4_global_scales_follow_the_expert_split():
    """`--quant nvfp4` with the experts split over 4 devices: each device holds a quarter of the
    experts with their e4m3 scales (one per 16 rows) and their float32 global scales (one per
    matrix, `QuantizedMatrix.outer`), and XLA compiles the SPMD step."""
    cfg = load_preset("tiny-moe")
    p = xs.compile_xla_spmd(cfg, 1, 4096, 1, TPU7X, 4, True, quant="nvfp4")
    shapes = xs.entry_parameter_shapes(p.hlo_text)
    e, h, fe = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
    assert shapes["p['layers'][1]['e_gate'].scale"] == (e // 4, h // 16, fe)
    assert shapes["p['layers'][1]['e_down'].scale"] == (e // 4, fe // 16, h)
    assert shapes["p['layers'][1]['e_up'].outer"] == shapes["p['layers'][1]['e_down'].outer"] == (e // 4,)


def test_a_hybrid_on_2_devices_replicates_its_linear_layers_and_compiles():
    """A hybrid's XLA SPMD step: gated attention's wq_gate split with wq (its columns are the
    query heads'), the linear layers' weights and state pool replicated (said in the notes),
    compiled deviceless for 2 TPU7x devices with the pool an argument and a result."""
    cfg = load_preset("tiny-dense").replace(
        name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=2,
        linear_value_heads=4, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)
    layout = xl.spmd_layout(cfg, 2)
    attn, lin = layout.params["layers"][2], layout.params["layers"][0]
    assert attn["wq_gate"] == attn["wq"] == xl.P(None, "tp") and attn["wo"] == xl.P("tp", None)
    assert all(spec == xl.P() for k, spec in lin.items() if k.startswith("lin_"))
    assert any(n.startswith("linear-attention layers (2, gated_delta): weights and the state pool replicated")
               for n in layout.notes)
    p = xs.compile_xla_spmd(cfg, 2, 256, 1, TPU7X, 2)
    shapes = xs.entry_parameter_shapes(p.hlo_text)
    assert shapes["p['layers'][2]['wq_gate']"] == (cfg.hidden_size, cfg.attention.q_size // 2)
    assert shapes["p['layers'][0]['lin_qkv']"] == (cfg.hidden_size, cfg.linear.conv_dim)  # whole on each device
    assert shapes["states[0].recurrent"] == (2, 2, 4, 128, 128)  # the pool: an argument of the step
