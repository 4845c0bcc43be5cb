"""Targets: chip figures come from Pallas' table; deviceless TPU compiles work."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from tpumk.compile.aot import compile_for
from tpumk.errors import TargetError
from tpumk.targets import TARGETS, get_target


def test_figures_from_pallas_chip_table():
    assert get_target("tpu7x").vmem_bytes == 64 * 2**20
    assert get_target("v6e").vmem_bytes == 128 * 2**20
    assert get_target("tpu7x").hbm_bandwidth == pytest.approx(3.7e12, rel=0.01)
    assert get_target("v5e").bf16_flops == pytest.approx(197e12, rel=0.01)
    assert get_target("cpu").interpret and get_target("cpu").is_attached()


def test_unknown_target_is_a_clear_error():
    with pytest.raises(TargetError, match="unknown target 'v9'.*tpu7x"):
        get_target("v9")


def test_target_names_match_case_insensitively_with_a_suggestion():
    assert get_target("TPU7x") is get_target("tpu7x") and get_target("V6E") is get_target("v6e")
    for near, name in (("tpu7", "tpu7x"), ("v6", "v6e"), ("tpuv7x", "tpu7x")):
        with pytest.raises(TargetError, match=f"unknown target '{near}' \\(did you mean '{name}'\\?\\)"):
            get_target(near)
    with pytest.raises(TargetError) as e:  # nothing close: no guess
        get_target("gpu")
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("name", [n for n, t in TARGETS.items() if t.is_tpu])
def test_deviceless_compile_of_a_pallas_kernel(name):
    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def f(x):
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    c = compile_for(f, (jax.ShapeDtypeStruct((8, 128), jnp.float32),), get_target(name))
    assert c.custom_calls == 1
    assert c.device_kind == get_target(name).device_kind
