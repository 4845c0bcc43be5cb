"""DeepSeek Sparse Attention in the N-device megakernel (issue 57): the indexer replicated on every
device (its weights, and its index-key cache as N copies side by side, as MLA's latent cache), so
every device computes the same top-k selection with no collective, and each device's query heads
attend to the latent blocks it picks. The 4-device step in interpret mode against the one-device
reference (tests/test_megakernel_sparse.py's model, cache and tie check); the same build compiled
deviceless for a multi-chip TPU7x topology (one kernel, no XLA collective); the plan's per-device
counts. transformers' greedy tokens on 4 devices: tests/test_hf_sparse_mla.py.

Interpret runs need N host devices, which JAX makes only before its backends start, so the step
runs in a subprocess: this file as a script (`_worker`), as tests/test_multidevice_mla.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from host_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_multidevice import XLA_COLLECTIVES  # noqa: E402

DEVICES = 4
CONTEXT = 64
# tests/test_megakernel_sparse.py's sparse model with 4 query heads (one per device) and an odd vocabulary
HEADS = dict(num_q_heads=4, num_kv_heads=4, vocab_size=321)


def _quant(dtype: str) -> tuple[str, str]:
    """("int8", "float32") of "int8-float32", ("fp8-b128", ..) of "fp8b128-..": quantized weights
    (tpumk.model.quantize); ("none", dtype) otherwise."""
    for scheme, prefix in (("int8", "int8-"), ("fp8-b128", "fp8b128-")):
        if dtype.startswith(prefix):
            return scheme, dtype.removeprefix(prefix)
    return "none", dtype


def _model(dtype: str):
    """dtype "glm-float32": GLM-5's indexer (a layer reusing the previous layer's picks);
    "large4-float32": tests/test_megakernel_large4.py's Mistral Large 4 model with 4 heads;
    "fp8b128-float32" (`_quant`): value heads of 128 lanes (fp8-b128's scale groups, `plan._check_mla`)."""
    from test_megakernel_sparse import GLM, SPARSE
    from tpumk.model.config import load_preset

    scheme, dtype = _quant(dtype)
    if scheme == "fp8-b128":
        return _model(dtype).replace(v_head_dim=128)

    if dtype.startswith("large4-"):
        from test_megakernel_large4 import LARGE4

        dtype = dtype.removeprefix("large4-")
        return load_preset("tiny-mla").replace(name=f"tiny-large4-{dtype}-tp", dtype=dtype, **LARGE4, **HEADS)
    glm = dtype.startswith("glm-")
    dtype = dtype.removeprefix("glm-")
    cfg = load_preset("tiny-mla").replace(name=f"tiny-dsa-{dtype}-tp", dtype=dtype, **SPARSE, **HEADS)
    return cfg.replace(**GLM) if glm else cfg


def _spec(dtype: str, target: str, batch: int, q_len: int, devices: int = DEVICES):
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    from test_megakernel import PAGE

    cfg = _model(dtype)
    return BuildSpec(cfg, get_target(target), batch, CONTEXT, TuningConfig(), q_len=q_len, page_size=PAGE,
                     devices=devices, quant=_quant(dtype)[0])


# ---------------------------------------------------------------------- the subprocess
def _worker(dtype: str, lengths: list[int], q_len: int) -> dict:
    """One decode step of the 4-device kernel (interpret mode, 4 host devices) and of the reference
    from the same random cache (its latent rows and index keys expanded to one copy per device)."""
    import time

    import jax.numpy as jnp
    import numpy as np

    from test_megakernel_sparse import TIE_GAP, random_cache, selection_gap

    large4 = dtype.startswith("large4-")
    from tpumk.kernel.layout import pack_sharded
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.model import reference as R
    from tpumk.model.quantize import quantize_params
    from tpumk.model.weights import random_params
    from tpumk.plan.plan import make_plan

    t0 = time.perf_counter()
    batch = len(lengths)
    plan = make_plan(_spec(dtype, "cpu", batch, q_len))
    cfg, sh = plan.whole_model, plan.sharding
    params = quantize_params(cfg, random_params(cfg, seed=2), plan.quant)  # ("none": as they are)
    cache = random_cache(cfg, lengths)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, cfg.vocab_size, (batch, q_len)), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(q_len, dtype=jnp.int32)[None, :]
    want, want_cache, taps = R.jitted_decode_step(cfg, taps=tuple(range(cfg.num_layers)))(params, tokens, positions,
                                                                                           cache)
    got, new = make_decode_step(plan)(pack_sharded(plan, params), tokens, positions, sh.expand_kv(cfg, cache))
    shards = [np.asarray(x.data, np.float32) for x in got.addressable_shards]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    out = {"devices": plan.devices, "local_heads": plan.cfg.num_q_heads, "shape": list(got.shape),
           "want_shape": list(want.shape), "max_err": float(np.max(np.abs(got - want))),
           "scale": float(np.max(np.abs(want))), "argmax_equal": bool(np.array_equal(got.argmax(-1), want.argmax(-1))),
           "logits_same_everywhere": len(shards) == DEVICES and all(np.array_equal(x, shards[0]) for x in shards),
           "gap_ok": bool(selection_gap(cfg, params, positions, want_cache, taps) > TIE_GAP)}
    for name in ("k", "index_keys"):
        wide = np.asarray(getattr(new, name), np.float32)
        copies = wide.reshape(*wide.shape[:-1], DEVICES, -1)
        whole = np.asarray(getattr(want_cache, name), np.float32)
        out[name] = {"width": int(wide.shape[-1]), "whole_width": int(whole.shape[-1]),
                     "err": float(np.max(np.abs(copies[..., 0, :] - whole))),
                     "copies_equal": all(np.array_equal(copies[..., d, :], copies[..., 0, :]) for d in range(DEVICES)),
                     "written": bool(np.any(whole != np.asarray(getattr(cache, name), np.float32)))}
    if large4:  # the layers reading another's rows wrote none: their cache layers as before
        wide = np.asarray(new.k, np.float32)
        out["shared_layers_kept"] = all(np.array_equal(wide[i], np.asarray(sh.expand_kv(cfg, cache).k[i], np.float32))
                                        for i in (1, 3))
        out["seconds"] = time.perf_counter() - t0
        return out
    # the dense model's logits differ by far more: the selection matters on 4 devices too
    from test_megakernel_sparse import DENSE

    dense_cfg = cfg.replace(index_shared_layers=(), index_rope_interleave=False).replace(**DENSE)
    dense, _ = R.jitted_decode_step(dense_cfg)(params, tokens, positions, cache)
    out["dense_err"] = float(np.max(np.abs(np.asarray(dense, np.float32) - want)))
    out["seconds"] = time.perf_counter() - t0
    return out


def _run(dtype: str, lengths: list[int], q_len: int) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", JAX_PLATFORMS="cpu",
               NPROC=str(4 * DEVICES), XLA_FLAGS=xla_flags(DEVICES))
    proc = subprocess.run([sys.executable, __file__, dtype, ",".join(map(str, lengths)), str(q_len)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- interpret vs reference
@pytest.mark.full  # (see tests/README.md: the default run's cover is the deviceless compile and plan tests below)
@pytest.mark.parametrize("dtype, lengths, q_len", [("float32", [37, 22], 1), ("bfloat16", [17, 30], 3),
                                                   ("glm-float32", [21, 40], 1), ("large4-float32", [37, 22], 1),
                                                   ("int8-float32", [37, 22], 1), ("fp8b128-float32", [37, 22], 1)],
                         ids=["f32-b2-q1", "bf16-b2-q3", "glm-f32-b2-q1", "large4-f32-b2-q1", "int8-f32-b2-q1",
                              "fp8b128-f32-b2-q1"])
def test_four_device_step_matches_reference(dtype, lengths, q_len):
    """The 4-device step equals the one-device reference: logits within 1e-5 of their scale (bf16:
    the MLA tests' bound), the same on every device; every device's copy of the latent and the
    index-key cache holds the reference's rows (this step's written); one query head per device.
    GLM-5's case: a layer reusing the previous layer's picks, interleaved indexer RoPE. The int8
    and fp8-b128 cases: quantized weights (the indexer's whole on every device with their
    scales), against the one-device reference with the same quantized weights. Mistral
    Large 4's (44 s): its parts, each device's heads' log scales, the layers reading another's
    latent rows leaving their own cache layers as they were."""
    r = _run(dtype, lengths, q_len)
    if dtype.startswith("large4-"):
        assert r["shared_layers_kept"], r
        r["dense_err"] = float("inf")  # (test_megakernel_large4 checks that each of its parts matters)
    assert r["devices"] == DEVICES and r["local_heads"] == 1 and r["gap_ok"], r
    assert r["shape"] == r["want_shape"] == [len(lengths), q_len, HEADS["vocab_size"]]
    f32 = dtype.endswith("float32")
    tol = (1e-5 if f32 else 3e-2) * max(1.0, r["scale"])
    assert r["max_err"] <= tol and r["argmax_equal"] and r["logits_same_everywhere"], r
    assert r["dense_err"] > 0.05 * r["scale"], r
    cache_tol = 1e-5 if f32 else 2 ** -6
    for name in ("k", "index_keys"):
        c = r[name]
        assert c["width"] == DEVICES * c["whole_width"] and c["copies_equal"] and c["written"], (name, c)
        assert c["err"] <= cache_tol, (name, c)


# ---------------------------------------------------------------------- deviceless compile, plan
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("fp8b128-bfloat16", marks=pytest.mark.full)])
def test_four_device_build_compiles_to_one_kernel_without_xla_collectives(dtype):
    """The 4-device sparse build compiles deviceless for a multi-chip TPU7x topology: one
    tpu_custom_call, no XLA collective (the selection is each device's own), and neither the
    latent nor the index-key cache copied around the kernel (both scattered after it); with
    fp8-b128 weights too (the full tier)."""
    from program_checks import cache_copies
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    plan = make_plan(_spec(dtype, "tpu7x", 2, 1))
    c = compile_plan(plan)
    assert c.custom_calls == 1
    assert not XLA_COLLECTIVES.search(c.hlo_text), XLA_COLLECTIVES.search(c.hlo_text).group(0)
    assert cache_copies(plan, c) == []


def test_four_device_large4_build_compiles_to_one_kernel_without_xla_collectives():
    """Mistral Large 4's parts on 4 devices (tests/test_megakernel_large4.py's model, 4 heads)
    compile deviceless for a multi-chip TPU7x topology: one tpu_custom_call, no XLA collective."""
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    plan = make_plan(_spec("large4-float32", "tpu7x", 1, 1))
    assert plan.devices == DEVICES and plan.cfg.num_q_heads == 1 and plan.sparse.q_hidden
    c = compile_plan(plan)
    assert c.custom_calls == 1
    assert not XLA_COLLECTIVES.search(c.hlo_text), XLA_COLLECTIVES.search(c.hlo_text).group(0)


def test_the_plan_counts_each_devices_sparse_reads():
    """On 4 devices each device streams the whole indexer (idx_q, idx_k, its float32 vectors) and
    reads the whole index-key cache and the same gathered blocks as one device (the selection is
    replicated); its heads' q_b / uk / uv / o are under half of one device's (a quarter of the
    heads, lane-padded)."""
    from tpumk.plan.plan import make_plan

    one, four = (make_plan(_spec("bfloat16", "tpu7x", 2, 1, devices=n)) for n in (1, DEVICES))
    assert four.sparse == one.sparse and four.cfg.num_q_heads == 1
    for key in ("weights_idx_q", "weights_idx_k", "indexer_vectors", "index_keys", "sparse_gather"):
        assert four.hbm[key] == one.hbm[key] > 0, key
    for key in ("weights_q_b", "weights_uk", "weights_uv", "weights_o"):
        assert 0 < four.hbm[key] < one.hbm[key] / 2, key
    assert four.cache_written_after_kernel
    outputs = {b.name: b.shape for b in four.contract.outputs}
    assert outputs["index_pages"] == (2, one.sparse.num_layers, one.sparse.page_size, one.sparse.index_head_dim)



def test_deepseek_v32_plans_on_32_devices_up_to_128k():
    """The deepseek-v3.2 preset on 32 TPU7x devices, default knobs, batch 1: planned at 4k, 32k and
    128k tokens (at 128k the top-k search's temporaries are [8, 4096] chunks, not [8, 131072]
    rows: 13.2 MiB of temporaries made it not fit VMEM before). Per device the step reads every
    cached index key (256 B a token and layer) and at most 2,048 16-row latent blocks a layer."""
    from tpumk.model.config import load_preset
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    cfg = load_preset("deepseek-v3.2")
    for context in (4096, 32768, 131072):
        plan = make_plan(BuildSpec(cfg, get_target("tpu7x"), 1, context, devices=32))
        g = plan.sparse
        assert plan.vmem_total <= plan.vmem_budget and plan.cfg.num_q_heads == 4
        assert g.select_lanes == 4096 and g.temporaries_bytes() < 2 * 2 ** 20  # (1.6 MiB at every context)
        assert plan.hbm["index_keys"] == 61 * (context + 16) * 256  # every page once, the written one twice more
        assert plan.hbm["sparse_gather"] == 61 * min(2048, context // 16) * 16 * 640 * 2


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]))))
