"""The attention stage over a 1-byte KV cache (`--kv-dtype fp8 | int8`, tpumk.model.kv_quant).

The stage's geometries from test_attention_stage.py, with the caches quantized and packed
(`kv_quant.PagedLayout`: one array, kv_group tokens per row): interpret mode (race detector on)
against the quantized reference, and the same wrapper compiled deviceless for TPU7x and v6e.
Given the same new rows, the kernel's packed pages must equal the reference's bit for bit (the
same power-of-two quantization); o follows the model-dtype stage's bounds, since every tile is
converted back to the model dtype before its matmuls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from test_attention_stage import CASES, NUM_LAYERS, num_pages
from test_attention_stage import make_inputs as model_dtype_inputs
from tpumk.compat import interpret_races, tpu_interpreter
from tpumk.compile.aot import compile_for
from tpumk.kernel.attention import attention_prefetch, attention_scratch, attention_stage
from tpumk.model import kv_quant, reference
from tpumk.model.config import ModelConfig
from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target

# (stage case of test_attention_stage.py, cache format): a layer loop like the megakernel's, so
# both layers are written and the next layer's first tiles are prefetched across the boundary.
RUNS = {
    "bf16-b4-q3-t2-n2-g4-fp8": ("bf16-b4-q3-t2-n2-g4", "fp8"),  # unused rows: huge garbage
    "bf16-b2-q2-t1-n3-d64-g2-int8": ("bf16-b2-q2-t1-n3-d64-g2", "int8"),  # two 64-wide heads per block
    "f32-b2-q3-t1-n3-overwrite-nan-int8": ("f32-b2-q3-t1-n3-overwrite-nan", "int8"),  # rows re-written
}


def geometry(name: str):
    base, fmt = RUNS[name]
    case = CASES[base]
    return case, dataclasses.replace(case.geometry(), kv_dtype=fmt)


def make_call(geom, pages: int, interpret: bool):
    """(tables, lengths, positions, q, k_new, v_new [L, B*q, ..], kv) -> (o [L, B*q, Hq*D], kv):
    every layer in a fori_loop, the packed cache aliased in place."""

    def kernel(tables, lengths, positions, q, k_new, v_new, kv, o_ref, kv_out, *scratch):
        del kv_out  # the alias of kv

        def layer_body(layer, carry):
            attention_prefetch(geom, layer, kv, None, tables, positions, scratch)
            o_ref[layer] = attention_stage(geom, layer, q[layer], k_new[layer], v_new[layer], kv, None, tables, lengths,
                                           positions, scratch, prefetched=True, tiles_started=layer > 0,
                                           prefetch_next=layer + 1 < geom.num_layers)
            return carry

        lax.fori_loop(0, geom.num_layers, layer_body, 0)

    smem, vmem = pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    cache = jax.ShapeDtypeStruct(geom.kv_layout.shape(geom.num_layers, pages), geom.kv_layout.fmt.dtype)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((geom.num_layers, geom.tokens, geom.q_size), jnp.float32), cache),
        in_specs=[smem] * 3 + [vmem] * 3 + [hbm],
        out_specs=(vmem, hbm),
        scratch_shapes=attention_scratch(geom),
        input_output_aliases={6: 1},
        interpret=tpu_interpreter(detect_races=True) if interpret else False,
    )


def make_inputs(name: str):
    """The stage case's inputs (two layers of q / k_new / v_new), its caches quantized per row
    and head and packed; rows the case marks as garbage (NaN) keep code 0 and the largest
    exponent byte (a scale of 2^126: huge keys and values, which must still be ignored)."""
    case, geom = geometry(name)
    _, tables, lengths, positions, q, k_new, v_new, k, v = model_dtype_inputs(case, layer_loop=True)
    lay = geom.kv_layout
    rows = jnp.stack([jnp.asarray(x, jnp.float32) for x in (k, v)], axis=3)  # [L, pages, P, 2, Hkv*D]
    rows = rows.reshape(*rows.shape[:4], geom.num_kv_heads, geom.head_dim)
    bad = jnp.isnan(rows).any(-1)
    codes, scales = kv_quant.quantize_rows(jnp.where(bad[..., None], 0.0, rows), lay.fmt)
    exps = jnp.where(bad, jnp.int8(125), kv_quant.exponent_bytes(scales))
    return tables, lengths, positions, q, k_new, v_new, lay.pack(codes, exps)


def key_mask(name: str, tables, lengths, positions):
    """[B, ctx] bool: the rows some query may read (cached, or written by this step)."""
    case, geom = geometry(name)
    ctx = case.pages_per_seq * geom.page_size
    k_pos = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (case.batch, ctx))
    return k_pos, (k_pos < lengths[:, None]) | jnp.any(k_pos[:, :, None] == positions[:, None, :], -1)


def expected(name: str, tables, lengths, positions, q, k_new, v_new, kv):
    """The reference decode step's attention, layer by layer: rows written quantized
    (`PagedLayout.write`), pages read back dequantized (`PagedLayout.read`), `reference.attend`.
    Returns (o [L, B*q, Hq*D], the packed cache, the V rows every query may read)."""
    case, geom = geometry(name)
    b, t, ps = case.batch, case.q_len, geom.page_size
    cfg = ModelConfig(name="attention-test", num_layers=NUM_LAYERS, hidden_size=geom.q_size,
                      num_q_heads=geom.num_q_heads, num_kv_heads=geom.num_kv_heads,
                      head_dim=geom.head_dim, vocab_size=128, ffn_size=128, dtype=case.dtype)
    lay, dt = geom.kv_layout, geom.jnp_dtype
    heads = (geom.num_kv_heads, geom.head_dim)

    @jax.jit
    def run(tables, lengths, positions, q, k_new, v_new, kv):
        page_ids = jnp.take_along_axis(tables, positions // ps, axis=1)
        slots = positions % ps
        k_pos, k_valid = key_mask(name, tables, lengths, positions)
        valid = k_valid[:, :, None, None]
        outs, seen = [], []
        for layer in range(NUM_LAYERS):
            new = jnp.stack([k_new[layer].reshape(b, t, *heads), v_new[layer].reshape(b, t, *heads)], axis=2)
            kv = lay.write(kv, layer, page_ids, slots, new)
            rows = lay.read(kv, layer, tables, dt)
            # garbage rows are never keys: zeros stand in for them (the kernel must ignore them)
            kr, vr = (jnp.where(valid, rows[:, :, c], 0) for c in range(2))
            o = reference.attend(cfg.attention, q[layer].reshape(b, t, geom.num_q_heads, geom.head_dim), kr, vr,
                                 positions, k_pos, k_valid, 0)
            outs.append(o.reshape(b * t, geom.q_size))
            seen.append(vr)
        return jnp.stack(outs), kv, jnp.stack(seen)

    return run(tables, lengths, positions, q, k_new, v_new, kv)


FULL = ("f32-b2-q3-t1-n3-overwrite-nan-int8",)  # the full tier (tests/README.md says what covers it)
FULL_TARGETS = ("v6e",)  # the default run compiles the stage for TPU7x; v6e compiles of the kernel: elsewhere


def params(cases):
    """Parameter sets (a name, or (name, target)), the FULL names' marked for the full tier."""
    out = []
    for c in cases:
        values = c if isinstance(c, tuple) else (c,)
        full = values[0] in FULL or values[-1] in FULL_TARGETS
        out.append(pytest.param(*values, marks=pytest.mark.full) if full else pytest.param(*values))
    return out


@pytest.mark.parametrize("name", params(RUNS))
def test_quantized_stage_matches_the_quantized_reference(name):
    case, geom = geometry(name)
    args = make_inputs(name)
    want_o, want_kv, v_seen = expected(name, *args)
    o, kv = jax.block_until_ready(jax.jit(make_call(geom, num_pages(case), True),
                                          compiler_options=INTERPRET_COMPILER_OPTIONS)(*args))
    races = interpret_races()
    assert races is not None and not races.races_found, "data race detected"
    # the packed pages: bit for bit, written rows and untouched ones (garbage stays as it was)
    np.testing.assert_array_equal(np.asarray(kv).view(np.uint8), np.asarray(want_kv).view(np.uint8))
    o, want_o = np.asarray(o), np.asarray(want_o)
    assert np.all(np.isfinite(o))
    if case.dtype == "float32":
        np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    else:  # test_attention_stage.py's bf16 bound: 2^-8 of the largest |v| a query reads
        vmax = float(np.max(np.abs(np.asarray(v_seen, np.float32))))
        np.testing.assert_allclose(o, want_o, rtol=0, atol=2.0 ** -8 * vmax + 1e-5)


@pytest.mark.parametrize("name, target", params([(n, t) for n in RUNS for t in ("tpu7x", "v6e")]))
def test_quantized_stage_compiles_deviceless(name, target):
    """The quantized stage lowers for TPU7x and v6e (packed 1-byte pages of page_rows rows, the
    exponent bytes' bitcasts and shifts): interpret mode does not check Mosaic's layout rules."""
    case, geom = geometry(name)
    specs = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in make_inputs(name))
    assert compile_for(make_call(geom, num_pages(case), False), specs, get_target(target)).custom_calls == 1


def test_fp8_bytes_equal_the_cast():
    """The stage encodes fp8 codes from their float32 bits (the static profiler aborts on the
    cast): every byte must equal XLA's float32 -> float8_e4m3fn cast, across normals, ties,
    subnormals, zeros of both signs and the top of the range."""
    from tpumk.kernel.attention import _code_bytes

    geom = dataclasses.replace(CASES["bf16-b1-q3-t1-n3"].geometry(), kv_dtype="fp8")
    rng = np.random.default_rng(4)
    grid = np.concatenate([
        np.linspace(-448, 448, 20001), rng.uniform(-2 ** -5, 2 ** -5, 20000),  # normals, subnormals
        np.arange(-3584, 3585) / 8.0,  # every value on a 1/8 grid up to 448: many exact ties
        np.arange(0, 64) * 2.0 ** -10,  # ties between subnormals
        [0.0, -0.0, 448.0, -448.0, 447.99, 2.0 ** -6, 2.0 ** -6 * 0.999, 2.0 ** -9, 2.0 ** -10, 2.0 ** -11],
    ]).astype(np.float32)
    got = np.asarray(_code_bytes(geom, jnp.asarray(grid)))
    want = np.asarray(jnp.asarray(grid).astype(jnp.float8_e4m3fn)).view(np.int8).astype(np.int32)
    assert np.array_equal(got, want), grid[got != want][:10]
