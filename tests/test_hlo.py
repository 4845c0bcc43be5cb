"""Reading HLO text (tpumk.estimate.hlo): shapes, instructions, computations, loop trip counts."""

from __future__ import annotations

import pytest

from tpumk.estimate.hlo import (DTYPE_BYTES, ArrayShape, called_computation, contracting_length, parse_hlo,
                                parse_shapes, trip_count)

MODULE = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[4,256]{1,0})->bf16[4,256]{1,0}}

%fused_add (param_0: bf16[4,256], param_1: bf16[4,256]) -> bf16[4,256] {
  %param_0 = bf16[4,256]{1,0} parameter(0)
  %param_1 = bf16[4,256]{1,0} parameter(1)
  ROOT %add.1 = bf16[4,256]{1,0} add(%param_0, %param_1)
}

%cond (c: (s32[], bf16[4,256])) -> pred[] {
  %c = (s32[], bf16[4,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], bf16[4,256])) -> (s32[], bf16[4,256]) {
  %b = (s32[], bf16[4,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = bf16[4,256]{1,0} get-tuple-element(%b), index=1
  %y = bf16[4,256]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], bf16[4,256]{1,0}) tuple(%i, %y)
}

ENTRY %main.7 (x: bf16[4,256], w: bf16[256,512]) -> bf16[4,256] {
  %x = bf16[4,256]{1,0:T(4,128)(2,1)S(1)} parameter(0)
  %w = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,256]{1,0}) tuple(%zero, %x)
  %loop = (s32[], bf16[4,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"},"dynamic_variable_tuple_indices":[]}
  %open = (s32[], bf16[4,256]{1,0}) while(%init), condition=%cond, body=%body
  %d = f32[4,512]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %k = bf16[4,256]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"abc"}}
  ROOT %r = bf16[4,256]{1,0} get-tuple-element(%loop), index=1
}
"""


# ---------------------------------------------------------------------- shapes
def test_array_shape_with_layout_tiles_and_memory_space():
    (s,) = parse_shapes("bf16[4,256]{1,0:T(4,128)(2,1)S(1)}")
    assert s == ArrayShape("bf16", (4, 256), 1)
    assert (s.elements, s.nbytes, s.in_hbm) == (1024, 2048, False)
    (h,) = parse_shapes("f32[8,128]{1,0:T(8,128)}")
    assert h.memory_space == 0 and h.in_hbm and h.nbytes == 8 * 128 * 4


def test_tuple_shapes_scalars_and_packed_types():
    shapes = parse_shapes("(s32[]{:T(128)S(6)}, (bf16[2,3]{1,0}, s4[16]{0}), pred[])")
    assert [(s.dtype, s.dims, s.memory_space) for s in shapes] == [
        ("s32", (), 6), ("bf16", (2, 3), 0), ("s4", (16,), 0), ("pred", (), 0)]
    assert [s.nbytes for s in shapes] == [4, 12, 8, 1]  # a scalar is one element; s4 packs two per byte
    assert DTYPE_BYTES["bf16"] == 2 and DTYPE_BYTES["f8e4m3fn"] == 1


def test_non_array_tokens_are_not_shapes():
    # "token[]" and words that only look like arrays (not an HLO element type) are skipped
    assert parse_shapes("token[]") == []
    assert parse_shapes("(f32[2]{0}, token[])") == [ArrayShape("f32", (2,), 0)]


# ---------------------------------------------------------------------- computations
def test_module_computations_and_entry():
    comps, entry = parse_hlo(MODULE)
    assert entry == "main.7"
    assert set(comps) == {"fused_add", "cond", "body", "main.7"}
    by_name = {i.name: i for i in comps["main.7"]}
    assert list(by_name) == ["x", "w", "zero", "init", "loop", "open", "d", "k", "r"]
    assert by_name["r"].root and not by_name["d"].root
    assert by_name["x"].opcode == "parameter" and by_name["x"].args == "0"
    assert by_name["init"].operands == ["zero", "x"]
    assert [s.dims for s in by_name["init"].shapes] == [(), (4, 256)]


def test_fusion_and_while_bodies():
    comps, _ = parse_hlo(MODULE)
    body = {i.name: i for i in comps["body"]}
    assert body["y"].opcode == "fusion" and called_computation(body["y"]) == "fused_add"
    assert body["y"].attr("kind") == "kLoop"
    fused = comps[called_computation(body["y"])]
    assert [i.opcode for i in fused] == ["parameter", "parameter", "add"] and fused[-1].root
    loop = {i.name: i for i in comps["main.7"]}["loop"]
    assert loop.opcode == "while" and loop.attr("body") == "%body" and loop.attr("condition") == "%cond"
    assert called_computation(loop) == ""  # a while loop calls no fusion


def test_trip_counts():
    main = {i.name: i for i in parse_hlo(MODULE)[0]["main.7"]}
    assert trip_count(main["loop"]) == 12
    assert trip_count(main["open"]) is None  # no known_trip_count: the caller must say so
    assert main["loop"].backend_config()["dynamic_variable_tuple_indices"] == []


def test_custom_call_target_and_backend_config():
    k = {i.name: i for i in parse_hlo(MODULE)[0]["main.7"]}["k"]
    assert k.opcode == "custom-call" and k.attr("custom_call_target") == "tpu_custom_call"
    assert k.operands == ["x", "w"]
    assert k.backend_config() == {"custom_call_config": {"body": "abc"}}


def test_dot_and_convolution_contraction():
    main = {i.name: i for i in parse_hlo(MODULE)[0]["main.7"]}
    d = main["d"]
    a, b = main["x"].shapes[0], main["w"].shapes[0]
    assert contracting_length(d, a, b) == 256
    conv_text = """ENTRY %e (p: bf16[1,8,512], q: bf16[1,512,1024]) -> bf16[1,8,1024] {
  %p = bf16[1,8,512]{2,1,0} parameter(0)
  %q = bf16[1,512,1024]{2,1,0} parameter(1)
  ROOT %c = bf16[1,8,1024]{2,1,0} convolution(%p, %q), window={size=1}, dim_labels=0bf_0io->0bf
}
"""
    e = {i.name: i for i in parse_hlo(conv_text)[0]["e"]}
    assert contracting_length(e["c"], e["p"].shapes[0], e["q"].shapes[0]) == 512


def test_text_without_entry_is_rejected():
    with pytest.raises(ValueError, match="no ENTRY"):
        parse_hlo("HloModule m\n\n%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n")
