"""The weight ring alone: every tile of a real plan streamed through VMEM, checked against numpy.

The kernel here multiplies a fixed x by every family's matrix of every layer (dense segment, MoE
segment with shared-expert families, lm_head) through `WeightRing`, so tile order, slot and
semaphore addressing, cross-layer and cross-segment prefetch and per-family tile shapes are
tested without the rest of the model. Race detection is on; the same kernel is compiled
deviceless for TPU7x. The last test proves the compiler's static cost estimate of the whole
megakernel grows linearly with the layer count (the loop structure it can count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from estimate_support import needs_compiler_estimate
from tpumk.compat import tpu_interpreter
from tpumk.compile.aot import compile_for
from tpumk.model.config import load_preset
from tpumk.kernel.layout import tile_matrix
from tpumk.kernel.ring import WeightRing
from tpumk.plan.plan import make_plan
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec

ROWS = 4

MIXED = dict(qkv_tile_rows=128, qkv_tile_cols=512, o_tile_cols=256, gate_up_tile_cols=256, down_tile_rows=512,
             down_tile_cols=128, shared_gate_up_tile_rows=128, shared_down_tile_cols=256, lm_head_tile_cols=128)


def ring_kernel_fn(plan, interpret):
    fams = list(plan.families)
    n_layers = plan.cfg.num_layers
    width = max(f.m_pad for f in plan.families.values())
    head = plan.families["lm_head"]

    def kernel(x_ref, *refs):
        weights = dict(zip(fams, refs[:len(fams)]))
        out_ref, head_ref, buf, sems = refs[len(fams):]
        ring = WeightRing(plan, weights, buf, sems)
        ring.prologue()
        for seg in plan.segments[:-1]:
            def body(layer, seg=seg):
                for name in seg.families:
                    cols = plan.families[name].tile_cols

                    def store(j, acc, name=name, cols=cols):
                        out_ref[layer, fams.index(name), :, j * cols:(j + 1) * cols] = acc
                    ring.matmul(seg, layer, name, x_ref, store)
            ring.layer_loop(seg, body)
        def store_head(j, acc):
            head_ref[j] = acc
        ring.lm_head(x_ref, store_head)

    call = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n_layers, len(fams), ROWS, width), jnp.float32),
                   jax.ShapeDtypeStruct((head.col_blocks, ROWS, head.tile_cols), jnp.float32)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)] + [pl.BlockSpec(memory_space=pl.ANY)] * len(fams),
        scratch_shapes=[pltpu.VMEM((plan.ring_depth, plan.slot_rows, plan.slot_cols), jnp.float32),
                        pltpu.SemaphoreType.DMA((plan.ring_depth,))],
        interpret=tpu_interpreter(detect_races=True) if interpret else False,
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=60 << 20),  # depth 40 x 1 MiB tiles
    )
    return call, fams


def _matrices(plan, seed=0):
    """A random [k_pad, m_pad] matrix per (family, stacked layer), and its packed tiles."""
    rng = np.random.default_rng(seed)
    mats, packed = {}, {}
    for name, fam in plan.families.items():
        stack = [rng.standard_normal((fam.k_pad, fam.m_pad)).astype(np.float32) / np.sqrt(fam.k_pad)
                 for _ in range(fam.stack)]
        mats[name] = stack
        tiles = [tile_matrix(jnp.asarray(m), fam) for m in stack]
        packed[name] = tiles[0] if name == "lm_head" else jnp.stack(tiles)
    return mats, packed


@pytest.mark.parametrize("depth, knobs", [
    (2, {}),
    (3, MIXED),  # per-family shapes: sub-slot DMAs, K-split accumulation, mixed tile sizes
    (7, MIXED),
    (40, {}),  # deeper than a layer: prefetch reaches across layers, segments and into the head
])
def test_ring_streams_every_tile_in_order(depth, knobs):
    cfg = load_preset("tiny-moe").replace(dtype="float32")  # dense layer 0, MoE layers 1-2 with a shared expert, lm_head
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, 64, TuningConfig(ring_depth=depth, **knobs)))
    mats, packed = _matrices(plan)
    width = max(f.k_pad for f in plan.families.values())
    x = np.random.default_rng(1).standard_normal((ROWS, width)).astype(np.float32)

    call, fams = ring_kernel_fn(plan, interpret=True)
    out, head = call(jnp.asarray(x), *[packed[f] for f in fams])

    from tpumk.compat import interpret_races

    assert not interpret_races().races_found
    for seg in plan.segments[:-1]:
        for layer in range(seg.first_layer, seg.end_layer):
            for name in seg.families:
                fam = plan.families[name]
                pos = seg.families.index(name)
                w = mats[name][seg.stack_base[pos] + layer - seg.first_layer]
                want = x[:, :fam.k_pad] @ w
                got = np.asarray(out[layer, fams.index(name), :, :fam.m_pad])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} layer {layer}")
    head_fam = plan.families["lm_head"]
    got = np.asarray(head).transpose(1, 0, 2).reshape(ROWS, head_fam.m_pad)
    np.testing.assert_allclose(got, x[:, :head_fam.k_pad] @ mats["lm_head"][0], rtol=1e-5, atol=1e-5)

    # The same ring compiles for a real TPU (layout rules are checked only there).
    specs = (jax.ShapeDtypeStruct(x.shape, jnp.float32),) + tuple(
        jax.ShapeDtypeStruct(packed[f].shape, jnp.float32) for f in fams)
    tpu_plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 2, 64, TuningConfig(ring_depth=depth, **knobs)))
    compiled = compile_for(ring_kernel_fn(tpu_plan, interpret=False)[0], specs, get_target("tpu7x"))
    assert compiled.custom_calls == 1


_PROFILE_SCRIPT = textwrap.dedent("""
    import json, sys
    from tpumk.estimate import static_profile
    static_profile.enable(sys.argv[1])
    from tpumk.compile.aot import compile_for
    from tpumk.model.config import load_preset
    from tpumk.kernel.megakernel import make_decode_step, step_specs
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target
    from tpumk.plan.knobs import TuningConfig
    target = get_target("tpu7x")
    out = {}
    for preset, layers, extra in json.loads(sys.argv[2]):
        cfg = load_preset(preset).replace(num_layers=layers, **extra)
        plan = make_plan(BuildSpec(cfg, target, 1, 64, TuningConfig(ring_depth=4)))
        static_profile.clear()
        compiled = compile_for(make_decode_step(plan), step_specs(plan), target)
        out[f"{preset}/{layers}"] = sum(static_profile.collect(compiled.device_kind).values())
    print(json.dumps(out))
""")


@needs_compiler_estimate
def test_static_estimate_grows_linearly_with_layers(tmp_path):
    """The compiler counts a top-level loop's body once per trip, so with the layer loop at top
    level (tiles unrolled inside) the whole step's estimate is affine in the layer count."""
    cases = [("tiny-dense", n, {}) for n in (2, 4, 8)]
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}  # a fresh libtpu flag
    res = subprocess.run([sys.executable, "-c", _PROFILE_SCRIPT, str(tmp_path), json.dumps(cases)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cycles = json.loads(res.stdout.strip().splitlines()[-1])
    c2, c4, c8 = (cycles[f"tiny-dense/{n}"] for n in (2, 4, 8))
    per_layer = (c4 - c2) / 2
    assert per_layer > 0
    assert (c8 - c4) / 4 == pytest.approx(per_layer, rel=0.05), cycles
