"""MLA models in the N-device megakernel (issue 15): head-parallel MLA (q_a / kv_a replicated,
q_b / W_UK / W_UV split by heads, o input-sharded and all-reduced, the latent cache replicated on
every device) on 2 and 4 host devices in interpret mode against the one-device reference, for
q_len 1 and a verify step (q_len 3); greedy tokens through `generate(..., devices=N)` (the path
`tpumk generate --devices N --backend megakernel` takes: plain, and speculative with the verify
step) equal the reference's; the same builds compiled deviceless for multi-chip TPU7x and v6e
topologies (one kernel, no XLA collective); the plan's per-device latent-cache bytes, the full
DeepSeek-V3 on 32 TPU7x devices (plan), the refusals; and the XLA baseline for MLA models (the
bench's XLA step against the reference, its SPMD layout's per-device shapes and numerics on the
host devices, `tpumk bench --devices 4`).

Interpret runs need N host devices, which JAX makes only before its backends start, so each
runs in a subprocess: this file as a script (`_worker`), as tests/test_multidevice.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_flags import xla_flags
from program_checks import cache_copies

from tpumk.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_multidevice import XLA_COLLECTIVES  # noqa: E402

# tiny-mla with hidden and expert widths in whole lanes (the MLA widths stay odd: q_lora 56,
# latent 40, nope 24, rope 8, value 20), more heads so they split 2 and 4 ways, an odd vocab.
MLA = dict(hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128, num_q_heads=4, num_kv_heads=4,
           vocab_size=321)
# (case id: model overrides, devices, batch, q_len). Default tuning: the step is the one
# `generate` builds (the all-reduce schedules are model-independent, tests/test_multidevice.py).
CASES = {
    "mla-2dev-f32-q1": (dict(MLA), 2, 2, 1),
    "mla-2dev-bf16-verify": (dict(MLA, dtype="bfloat16", num_q_heads=8, num_kv_heads=8), 2, 2, 3),
    "mla-4dev-bf16-verify": (dict(MLA, dtype="bfloat16", num_q_heads=8, num_kv_heads=8), 4, 2, 3),
}
NO_QLORA = dict(MLA, q_lora_rank=0)  # a plain q projection: deviceless compiles and the split's algebra
CONTEXT = 64


def _config(over: dict):
    from tpumk.model.config import load_preset

    return load_preset("tiny-mla").replace(name="tiny-mla-tp", **over)


def _spec(case: str, target: str):
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    model, n, batch, q_len = CASES[case]
    return BuildSpec(_config(model), get_target(target), batch=batch, context=CONTEXT, q_len=q_len, devices=n)


# ---------------------------------------------------------------------- the subprocess
def _worker(case: str) -> dict:
    """A decode step of the N-device kernel (interpret mode, N host devices) and of the reference
    from the same prefilled cache, then greedy generation through `generate` with the same
    shapes (so the one compiled step serves both: interpret runs are slow)."""
    import time

    import jax
    import jax.numpy as jnp

    from tpumk.decode.generate import Model, _kernel_step, generate
    from tpumk.kernel.layout import pack_sharded
    from tpumk.model import reference as ref
    from tpumk.model.weights import random_params

    t0 = time.perf_counter()
    spec = _spec(case, "cpu")
    cfg, n, b, q = spec.model, spec.devices, spec.batch, spec.q_len
    plan, step = _kernel_step(cfg, b, CONTEXT, 16, q, n, "none", "")  # what generate(..., devices=n) runs
    assert plan.spec == spec, (plan.spec, spec)
    sh = plan.sharding
    params = random_params(cfg, seed=5)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, 5 + 7 * i)] for i in range(b)]
    cache = ref.init_cache(cfg, b, CONTEXT)
    _, cache = ref.prefill(params, cfg, prompts, cache)
    packed = pack_sharded(plan, params)
    wide = ref.KVCache(sh.expand_cache(cfg, cache.k), sh.expand_cache(cfg, cache.v), cache.block_tables, cache.lengths)
    out = {"steps": [], "devices": len(jax.devices("cpu"))}
    ref_cache = cache
    for _ in range(1):  # the steps after it: the greedy generation below
        lengths = np.asarray(ref_cache.lengths)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, q)), jnp.int32)
        positions = jnp.asarray(lengths[:, None] + np.arange(q)[None], jnp.int32)
        want, ref_cache = ref.jitted_decode_step(cfg)(params, tokens, positions, ref_cache)
        got, wide = step(packed, tokens, positions, wide)
        shards = [np.asarray(x.data, np.float32) for x in got.addressable_shards]
        same_everywhere = len(shards) == sh.devices and all(np.array_equal(x, shards[0]) for x in shards)
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        k = np.asarray(wide.k, np.float32)
        copies = k.reshape(*k.shape[:-1], sh.devices, -1)  # every device's copy of the latent cache
        out["steps"].append({
            "shape": list(got.shape), "want_shape": list(want.shape), "wide_k": list(k.shape),
            "max_err": float(np.max(np.abs(got - want))), "scale": float(np.max(np.abs(want))),
            "argmax_equal": bool(np.array_equal(got.argmax(-1), want.argmax(-1))),
            "k_err": float(np.max(np.abs(np.asarray(sh.collapse_cache(cfg, wide.k), np.float32)
                                         - np.asarray(ref_cache.k, np.float32)))),
            "v_width": int(wide.v.shape[-1]),
            "lengths_equal": bool(np.array_equal(np.asarray(wide.lengths), np.asarray(ref_cache.lengths))),
            "copies_equal": all(np.array_equal(copies[..., d, :], copies[..., 0, :]) for d in range(sh.devices)),
            "logits_same_everywhere": same_everywhere,
        })
    # The XLA SPMD baseline (tpumk bench --devices N) on the same host devices: its head-parallel
    # sharding of the same weights gives the reference's step.
    from tpumk.model.xla_step import paged_to_head_major, xla_decode_step
    from tpumk.decode.xla_spmd import spmd_mesh
    from tpumk.model.xla_spmd import xla_spmd_out_shardings, xla_spmd_specs

    mesh = spmd_mesh(spec.target, n)
    specs = xla_spmd_specs(cfg, b, CONTEXT, q, mesh, expert_parallel=False)
    k_x, v_x = paged_to_head_major(cache, cfg)
    args = jax.tree.map(lambda a, s: jax.device_put(a, s.sharding),
                        (params, tokens, positions, k_x, v_x, cache.lengths), specs)
    xla_logits, xla_k, _, _ = jax.jit(lambda p, t, pos, kc, vc, ln: xla_decode_step(p, cfg, t, pos, kc, vc, ln),
                                      out_shardings=xla_spmd_out_shardings(cfg, mesh))(*args)
    wq_b = args[0]["layers"][0]["wq_b" if cfg.q_lora_rank else "wq"]
    want_k, _ = paged_to_head_major(ref_cache, cfg)
    out["xla"] = {"max_err": float(np.max(np.abs(np.asarray(xla_logits, np.float32) - want))),
                  "k_err": float(np.max(np.abs(np.asarray(xla_k, np.float32) - np.asarray(want_k, np.float32)))),
                  "wq_b_shard": list(wq_b.addressable_shards[0].data.shape), "wq_b": list(wq_b.shape),
                  "cache_replicated": xla_k.sharding.is_fully_replicated}

    # Greedy generation through the CLI's path against the reference backend: plain steps
    # (q_len 1) or speculative ones (n-gram drafts, each verify step q_len 3).
    m = Model(cfg, params, "random weights (seed 5)")
    gp = [[3, 17, 42, 7, 99, 3, 17], [250, 1, 64]][:b]
    kw = dict(spec="ngram", draft_tokens=q - 1) if q > 1 else {}
    want_tokens = generate(m, gp, 4, backend="reference", context=CONTEXT)["tokens"]
    got = generate(m, gp, 4, backend="megakernel", devices=n, context=CONTEXT, **kw)
    out["generate"] = {"want": want_tokens, "got": got["tokens"], "ran_on": got["ran_on"],
                       "target_steps": got["spec"]["target_steps"]}
    out["sharding"] = sh.summary(cfg)
    out["schedule"] = plan.all_reduce.schedule
    out["local_heads"] = plan.cfg.num_q_heads
    out["compiles"] = _kernel_step.cache_info().misses  # generate reused the worker's step
    out["seconds"] = time.perf_counter() - t0
    return out


def _run(case: str) -> dict:
    n = CASES[case][1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * n),
               XLA_FLAGS=xla_flags(n))
    proc = subprocess.run([sys.executable, __file__, case], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- interpret vs reference
# The full tier: the 2-device float32 case and the 4-device verify step. The default run's
# 2-device verify step runs the same N-device MLA path (heads split, the latent cache
# replicated, the XLA baseline, speculative generate) on half the interpreted devices, and
# test_device_parts_sum_to_the_whole_attention checks the split's arithmetic in float32.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c != "mla-2dev-bf16-verify" else c
                                  for c in CASES])
def test_interpret_matches_reference_and_compiles(case):
    r = _run(case)
    model, n, batch, q_len = CASES[case]
    bf16 = model.get("dtype") == "bfloat16"
    assert r["devices"] == n and r["local_heads"] == model["num_q_heads"] // n
    for s in r["steps"]:
        assert s["shape"] == s["want_shape"] == [batch, q_len, model["vocab_size"]]
        tol = (3e-2 if bf16 else 2e-5) * max(1.0, s["scale"])
        assert s["max_err"] <= tol, (case, s)
        assert s["argmax_equal"], (case, s)
        assert s["k_err"] <= tol, (case, s)  # the new latent rows landed in every copy's pages
        assert s["wide_k"][-1] == n * 128 and s["v_width"] == 0  # 40 + 8 lanes stored in 128 per device
        assert s["copies_equal"], (case, s)  # every device wrote the same bits
        assert s["lengths_equal"] and s["logits_same_everywhere"]
    x = r["xla"]  # the XLA SPMD baseline: heads split, the latent cache replicated, the reference's numbers
    tol = (3e-2 if bf16 else 2e-5) * max(1.0, r["steps"][0]["scale"])
    assert x["max_err"] <= tol and x["k_err"] <= tol, x
    assert x["wq_b_shard"][1] * n == x["wq_b"][1] and x["wq_b_shard"][0] == x["wq_b"][0] and x["cache_replicated"]
    g = r["generate"]
    assert f"{n} devices" in g["ran_on"] and r["compiles"] == 1
    assert g["got"] == g["want"], g
    assert r["schedule"] == "direct"
    att = r["sharding"]["attention"]
    assert att["heads_per_device"] == model["num_q_heads"] // n and "replicated" in att["latent_cache"]

    # The same build compiles deviceless for a multi-chip TPU7x topology: one kernel, no XLA collective.
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    plan = make_plan(_spec(case, "tpu7x"))
    c = compile_plan(plan)
    assert c.custom_calls == 1
    assert not XLA_COLLECTIVES.search(c.hlo_text), XLA_COLLECTIVES.search(c.hlo_text).group(0)
    assert cache_copies(plan, c) == []  # the latent cache is not copied around the kernel either


@pytest.mark.parametrize("target, case", [("v6e", "mla-4dev-bf16-verify"), ("v6e", "noqlora"),
                                          ("tpu7x", "noqlora")])
def test_compiles_deviceless(target, case):
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    spec = _spec(case, target) if case in CASES else _spec("mla-2dev-f32-q1", target).replace(
        model=_config(NO_QLORA))
    c = compile_plan(make_plan(spec))
    assert c.custom_calls == 1 and not XLA_COLLECTIVES.search(c.hlo_text)


@pytest.mark.parametrize("over", [MLA, NO_QLORA], ids=["q_lora", "plain_q"])
def test_device_parts_sum_to_the_whole_attention(over):
    """The reference's MLA attention of each device's part (`local_config`, `device_params`), its
    o outputs summed over devices (the kernel's all-reduce), equals the whole model's; the
    cache row each device computes equals the whole model's (the replicated latent)."""
    import jax.numpy as jnp

    from tpumk.model import mla
    from tpumk.model.reference import matmul
    from tpumk.model.weights import random_params
    from tpumk.plan.sharding import plan_sharding

    cfg = _config(over)
    params = random_params(cfg, seed=4)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 3, cfg.hidden_size)), jnp.float32)
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    valid = jnp.ones((1, 3), bool)

    def attention(c, lay):
        q_nope, q_rope, row = mla.project(c, lay, x, pos)
        return matmul(mla.attend_latent(c, lay, q_nope, q_rope, row, pos, pos, valid), lay["wo"]), row

    want, want_row = attention(cfg, params["layers"][0])
    for n in (2, 4):
        sh = plan_sharding(cfg, n)
        local = sh.local_config(cfg)
        outs = [attention(local, {k: jnp.asarray(v) for k, v in sh.device_params(cfg, params, d)["layers"][0].items()})
                for d in range(n)]
        assert all(np.array_equal(row, want_row) for _, row in outs)
        total = sum(o for o, _ in outs)
        assert float(jnp.max(jnp.abs(total - want))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(want))))
        assert float(jnp.max(jnp.abs(outs[0][0] - want))) > 1e-3  # one device's part is not the whole


# ---------------------------------------------------------------------- the plan
def test_device_params_split_heads_and_replicate_the_latent_path():
    """Device d's weights are the whole model's: its heads' q_b / wkv_b columns and o rows; q_a,
    kv_a and their norms whole. The local model's reference step, summed over devices' o
    outputs, is checked by the interpret runs; here the slicing itself."""
    from tpumk.model.weights import random_params
    from tpumk.plan.sharding import plan_sharding

    cfg = _config(MLA)
    params = random_params(cfg, seed=1)
    sh = plan_sharding(cfg, 2)
    local = sh.local_config(cfg)
    assert (local.num_q_heads, local.num_kv_heads, local.kv_lora_rank) == (2, 2, cfg.kv_lora_rank)
    lay = params["layers"][1]
    n, r, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for d in range(2):
        part = sh.device_params(cfg, params, d)["layers"][1]
        for k in ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm"):
            assert np.array_equal(part[k], np.asarray(lay[k])), k
        heads = range(2 * d, 2 * d + 2)
        wq_b = np.asarray(lay["wq_b"]).reshape(-1, 4, n + r)
        assert np.array_equal(part["wq_b"], wq_b[:, heads].reshape(-1, 2 * (n + r)))
        wkv_b = np.asarray(lay["wkv_b"]).reshape(c, 4, n + v)
        assert np.array_equal(part["wkv_b"], wkv_b[:, heads].reshape(c, 2 * (n + v)))
        wo = np.asarray(lay["wo"]).reshape(4, v, -1)
        assert np.array_equal(part["wo"], wo[heads].reshape(2 * v, -1))
        assert "wq" not in part and "wk" not in part


def test_expand_and_collapse_the_latent_cache():
    import jax.numpy as jnp

    from tpumk.plan.sharding import plan_sharding

    cfg = _config(MLA)
    sh = plan_sharding(cfg, 4)
    k = jnp.arange(2 * 3 * 4 * 48, dtype=jnp.float32).reshape(2, 3, 4, 48)
    wide = sh.expand_cache(cfg, k)
    assert wide.shape == (2, 3, 4, 4 * 48) and all(np.array_equal(wide[..., 48 * d:48 * (d + 1)], k) for d in range(4))
    assert np.array_equal(sh.collapse_cache(cfg, wide), k)
    assert sh.expand_cache(cfg, jnp.zeros((2, 3, 4, 0))).shape[-1] == 0


def _plan(model, devices: int, target: str = "tpu7x", **kw):
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    return make_plan(BuildSpec(model, get_target(target), devices=devices, **kw))


def test_plan_counts_the_whole_latent_cache_on_every_device():
    """Per device: the whole latent cache (every device reads and writes all of it), a 1/N share
    of the head-split matrices, the replicated q_a / kv_a whole."""
    cfg = _config(dict(MLA, dtype="bfloat16", num_q_heads=8, num_kv_heads=8))
    one, four = (_plan(cfg, n, batch=2, context=4096) for n in (1, 4))
    assert four.hbm["kv_cache"] == one.hbm["kv_cache"]  # the same latent pages read on each device
    assert four.attention.kv_size == one.attention.kv_size == 48
    for fam in ("q_a", "kv_a"):
        assert four.hbm[f"weights_{fam}"] == one.hbm[f"weights_{fam}"]
    for fam in ("uk", "uv"):  # block-diagonal per head: exactly a quarter of the heads' blocks
        assert four.hbm[f"weights_{fam}"] * 4 == one.hbm[f"weights_{fam}"]
    assert four.hbm["weights_q_b"] < one.hbm["weights_q_b"] and four.hbm["weights_o"] < one.hbm["weights_o"]
    from tpumk.plan.plan import resident_bytes

    whole_kv = cfg.num_layers * four.num_pages * four.page_size * 128 * 2  # every device's copy: all of it (48 lanes stored in 128)
    res = four.summary()["resident_bytes_per_device"]
    assert res["kv_cache"] == whole_kv == resident_bytes(cfg, one.num_pages, one.page_size)[1]
    assert res["weights"] < resident_bytes(cfg, one.num_pages, one.page_size)[0]
    s = four.summary()["sharding"]["attention"]
    assert s["kv_cache_bytes_per_token_per_layer_per_device"] == 128 * 2
    assert s["split_by_heads"] == ["q_b", "uk", "uv"] and "kv_a" in s["replicated"]


def test_full_deepseek_v3_per_device_hbm():
    """DeepSeek-V3 in bf16 (1.3 TB of weights) does not fit 32 TPU7x devices' HBM once each holds
    a copy of the whole latent cache at 128k tokens: refused with one line naming the bytes;
    the same model at 4k tokens fits (closed-form check, before any tile work)."""
    from tpumk.errors import PlanError
    from tpumk.model.config import load_preset
    from tpumk.plan import plan as P
    from tpumk.plan.sharding import per_device_weight_bytes, plan_sharding
    from tpumk.targets import get_target

    cfg, t7 = load_preset("deepseek-v3"), get_target("tpu7x")
    sh = plan_sharding(cfg, 32)
    w = per_device_weight_bytes(cfg, sh)
    # the replicated latent path (q_a, kv_a) and embedding are whole; experts 1/32
    assert 38e9 < w < 48e9, w
    pages = 131072 // 16 * 8  # 8 sequences of 128k tokens
    kv = cfg.num_layers * pages * 16 * 640 * 2  # the 576-lane latent row stored in 640 lanes
    with pytest.raises(PlanError) as e:
        P._check_hbm(cfg, t7, pages, 16, sh)
    msg = str(e.value)
    assert "does not fit 32 tpu7x devices" in msg and f"KV cache {kv / 1e9:.1f} GB per device" in msg
    assert "\n" not in msg
    P._check_hbm(cfg, t7, 4096 // 16, 16, sh)


def test_full_deepseek_v3_plans_on_32_tpu7x_devices():
    """The public DeepSeek-V3 (bf16) on 32 TPU7x TensorCores with default knobs: 4 heads per
    device, the whole latent cache on each, read whole by every device every step; at batch 1
    the plan splits q_a / kv_a (one latent all-gather per layer besides the 2 all-reduces)."""
    from tpumk.model.config import load_preset

    cfg = load_preset("deepseek-v3")
    p = _plan(cfg, 32)
    assert p.cfg.num_q_heads == 4 and p.vmem_needed <= p.vmem_budget
    s = p.summary()
    # the 576-lane latent row stored in 640 lanes, whole on every device
    assert s["resident_bytes_per_device"]["kv_cache"] == cfg.num_layers * p.num_pages * p.page_size * 640 * 2
    assert s["hbm_bytes_per_step"]["kv_cache"] >= cfg.num_layers * 4095 * 640 * 2  # every device reads it all
    assert p.latent_split and s["collectives_per_step"] == 3 * cfg.num_layers + 1


def test_heads_not_divisible_are_refused_with_one_line():
    from tpumk.errors import PlanError

    cfg = _config(dict(MLA, num_q_heads=6, num_kv_heads=6))
    with pytest.raises(PlanError) as e:
        _plan(cfg, 4)
    msg = str(e.value)
    assert "devices = 4: expected a divisor of num_q_heads (6)" in msg and "\n" not in msg


# ---------------------------------------------------------------------- the XLA SPMD baseline
@pytest.mark.full  # (19 s on a loaded host) test_mla_tools.py::test_mla_xla_step_matches_the_reference covers it
def test_xla_step_matches_the_reference_on_one_device():
    """The bench's XLA step for an MLA model (absorbed attention over a contiguous latent cache)
    against the reference, q_len 2, from a prefilled cache (DeepSeek-V3 routing with the bias)."""
    import jax.numpy as jnp

    from tpumk.model.xla_step import make_xla_step, paged_to_head_major
    from tpumk.model import reference as R
    from tpumk.model.weights import random_params

    cfg = _config(MLA)
    params = random_params(cfg, seed=1)
    cache = R.init_cache(cfg, 2, CONTEXT, 16)
    _, cache = R.prefill(params, cfg, [[1, 2, 3, 4, 5], [7, 8, 9]], cache)
    tokens = jnp.asarray([[5, 6], [7, 8]], jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
    want, want_cache = R.jitted_decode_step(cfg)(params, tokens, positions, cache)
    k, v = paged_to_head_major(cache, cfg)
    got, k2, v2, lengths = make_xla_step(cfg)(params, tokens, positions, k, v, cache.lengths)
    assert k.shape == (cfg.num_layers, 2, CONTEXT, 48) and v2.shape[-1] == 0
    assert float(jnp.max(jnp.abs(got - want))) <= 2e-5 * max(1.0, float(jnp.max(jnp.abs(want))))
    assert float(jnp.max(jnp.abs(k2 - paged_to_head_major(want_cache, cfg)[0]))) <= 2e-5
    assert np.array_equal(lengths, want_cache.lengths)


def test_xla_spmd_program_splits_heads_and_replicates_the_latent():
    """Deviceless for 4 TPU7x devices: one device's program holds its heads' q_b / wkv_b columns
    and o rows, the whole q_a / kv_a and latent cache, and XLA's all-reduces."""
    from tpumk.decode.xla_spmd import compile_xla_spmd, entry_parameter_shapes
    from tpumk.model.xla_spmd import spmd_layout
    from tpumk.targets import get_target

    cfg = _config(dict(MLA, dtype="bfloat16", num_q_heads=8, num_kv_heads=8))
    prog = compile_xla_spmd(cfg, 1, 256, 1, get_target("tpu7x"), 4)
    shapes = entry_parameter_shapes(prog.hlo_text)
    lay = "p['layers'][1]"
    n, r, v, c = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    assert shapes[f"{lay}['wq_b']"] == (cfg.q_lora_rank, 2 * (n + r))
    assert shapes[f"{lay}['wkv_b']"] == (c, 2 * (n + v)) and shapes[f"{lay}['wo']"] == (2 * v, cfg.hidden_size)
    assert shapes[f"{lay}['wq_a']"] == (cfg.hidden_size, cfg.q_lora_rank)
    assert shapes[f"{lay}['wkv_a']"] == (cfg.hidden_size, c + r)
    assert prog.collectives.get("all-reduce", 0) >= cfg.num_layers
    assert any("latent cache replicated" in note for note in prog.layout.notes)
    with pytest.raises(ConfigError) as e:
        spmd_layout(_config(dict(MLA, num_q_heads=6, num_kv_heads=6)), 4)
    assert "devices = 4: expected a divisor of num_q_heads (6)" in str(e.value) and "\n" not in str(e.value)


def test_bench_devices_runs_on_an_mla_model():
    """`tpumk bench --devices 4` (run_bench) on an MLA model: both programs compiled for
    tpu7x:2x2x1, both modelled (tpumk's timeline model), the layouts naming the latent cache."""
    from tpumk.decode.bench import run_bench
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    cfg = _config(dict(MLA, dtype="bfloat16", num_q_heads=8, num_kv_heads=8))
    r = run_bench(BuildSpec(cfg, get_target("tpu7x"), devices=4, context=1024), verify_q=0, compiler_estimate=False)
    assert r["devices"] == 4 and r["topology"] == "tpu7x:2x2x1"
    assert r["megakernel"]["step_seconds"] > 0 and r["xla"]["step_seconds"] > 0
    assert "MODEL" in r["xla"]["step_source"]
    assert "latent cache" in r["layouts"]["megakernel"] and "latent cache" in r["layouts"]["xla"]
    assert r["sharding"]["attention"]["heads_per_device"] == 2
    one = run_bench(BuildSpec(cfg, get_target("tpu7x"), context=1024), verify_q=0)  # one device: no serving column
    assert one["xla"]["step_seconds"] > 0 and one["serving"] is None and "latent" in one["serving_refused"]
    assert one["layouts"]["xla"].startswith("contiguous latent cache")


# ---------------------------------------------------------------------- a 1-byte latent cache
QUANT_CASE = (dict(MLA), 4, 2, 1, "int8")  # model, devices, batch, q_len, kv_dtype


def _quantized_worker() -> dict:
    """Two decode steps of the 4-device kernel on an int8 latent cache (every device its own
    copy in the packed layout) against the quantized reference, float32 so the bytes must match."""
    import jax
    import jax.numpy as jnp

    from tpumk.decode.generate import _kernel_step
    from tpumk.kernel.layout import pack_sharded
    from tpumk.model import reference as ref
    from tpumk.model.weights import random_params

    model, n, b, q, kv_dtype = QUANT_CASE
    cfg = _config(model)
    plan, step = _kernel_step(cfg, b, CONTEXT, 16, q, n, "none", kv_dtype)
    sh = plan.sharding
    params = random_params(cfg, seed=5)
    rng = np.random.default_rng(4)
    cache = ref.init_cache(cfg, b, CONTEXT, kv_dtype=kv_dtype)
    _, cache = ref.prefill(params, cfg, [[int(t) for t in rng.integers(0, cfg.vocab_size, 9 + 8 * i)] for i in range(b)],
                           cache)
    packed, wide, out = pack_sharded(plan, params), sh.expand_quantized(cfg, cache), []
    for _ in range(2):  # the second step reads the rows the first wrote
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, q)), jnp.int32)
        positions = cache.lengths[:, None]
        want, cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
        got, wide = step(packed, tokens, positions, wide)
        kv = np.asarray(wide.kv).view(np.uint8)
        copies = kv.reshape(*kv.shape[:-1], n, -1)
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        mine = sh.collapse_quantized(cfg, wide)
        out.append({"max_err": float(np.max(np.abs(got - want))), "scale": float(np.max(np.abs(want))),
                    "argmax_equal": bool(np.array_equal(got.argmax(-1), want.argmax(-1))),
                    "bytes_equal": bool(np.array_equal(np.asarray(mine.kv).view(np.uint8),
                                                       np.asarray(cache.kv).view(np.uint8))),
                    "copies_equal": all(np.array_equal(copies[..., d, :], copies[..., 0, :]) for d in range(n)),
                    "lanes": int(wide.kv.shape[-1]), "layout_lanes": int(cache.layout.lanes)})
    return {"steps": out, "devices": len(jax.devices("cpu")), "quantized": plan.attention.quantized}


@pytest.mark.full  # (49-89 s on a loaded host) tests/README.md names the default tests covering it
def test_a_quantized_latent_cache_on_4_devices():
    """The latent cache in int8 (one packed row per token: codes, then the exponent byte) on 4
    interpreted devices, each holding a copy: the bytes every device writes equal the quantized
    reference's, and the same build compiles deviceless for 4 TPU7x TensorCores."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * QUANT_CASE[1]),
               XLA_FLAGS=xla_flags(QUANT_CASE[1]))
    proc = subprocess.run([sys.executable, __file__, "quantized"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 4 and r["quantized"]
    for s in r["steps"]:
        assert s["max_err"] <= 2e-5 * max(1.0, s["scale"]) and s["argmax_equal"], s
        assert s["bytes_equal"] and s["copies_equal"], s
        assert s["lanes"] == 4 * s["layout_lanes"] == 4 * 128  # 48 code lanes + 1 exponent byte, padded
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    model, n, b, q, kv_dtype = QUANT_CASE
    c = compile_plan(make_plan(BuildSpec(_config(model), get_target("tpu7x"), batch=b, context=CONTEXT, q_len=q,
                                         devices=n, kv_dtype=kv_dtype)))
    assert c.custom_calls == 1 and not XLA_COLLECTIVES.search(c.hlo_text)


# ---------------------------------------------------------------------- the latent split
# q_a / kv_a split by output columns over 4 devices, the latent all-gathered in the kernel
# (model, devices, batch, quant). q_lora 56 -> 14 columns a device; kv_a's 40 + 8 -> 12, so
# device 3's slice straddles c_kv and k_rope. The fp8 case (column scales cut with their
# columns) has no q-LoRA: only kv_a is gathered, q is split by heads.
SPLIT_CASES = {"split-f32": (dict(MLA), 4, 2, "none"),
               "split-noqlora-fp8": (dict(NO_QLORA, dtype="bfloat16"), 4, 1, "fp8")}


def _split_spec(case: str, target: str):
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target

    model, n, b, quant = SPLIT_CASES[case]
    return BuildSpec(_config(model), get_target(target), batch=b, context=CONTEXT, devices=n, quant=quant,
                     tuning=TuningConfig(mla_projections="split"))


def _split_worker(case: str) -> dict:
    """Two decode steps of the 4-device kernel with the latent split against the reference
    (the second reads the latent rows the first wrote)."""
    import jax
    import jax.numpy as jnp

    from tpumk.kernel.layout import pack_sharded
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.model import reference as ref
    from tpumk.model.quantize import quantize_params
    from tpumk.model.weights import random_params
    from tpumk.plan.plan import make_plan
    from tpumk.targets import ensure_host_devices

    spec = _split_spec(case, "cpu")
    cfg, n, b = spec.model, spec.devices, spec.batch
    ensure_host_devices(n)
    plan = make_plan(spec)
    sh = plan.sharding
    params = random_params(cfg, seed=6)
    if spec.quant != "none":
        params = quantize_params(cfg, params, spec.quant)
    rng = np.random.default_rng(8)
    cache = ref.init_cache(cfg, b, CONTEXT)
    _, cache = ref.prefill(params, cfg, [[int(t) for t in rng.integers(0, cfg.vocab_size, 6 + 9 * i)] for i in range(b)],
                           cache)
    step = make_decode_step(plan)
    packed, wide, out = pack_sharded(plan, params), sh.expand_kv(cfg, cache), []
    for _ in range(2):
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 1)), jnp.int32)
        positions = cache.lengths[:, None]
        want, cache = ref.jitted_decode_step(cfg)(params, tokens, positions, cache)
        got, wide = step(packed, tokens, positions, wide)
        shards = [np.asarray(x.data, np.float32) for x in got.addressable_shards]
        k = np.asarray(wide.k, np.float32)
        copies = k.reshape(*k.shape[:-1], n, -1)
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        out.append({"max_err": float(np.max(np.abs(got - want))), "scale": float(np.max(np.abs(want))),
                    "argmax_equal": bool(np.array_equal(got.argmax(-1), want.argmax(-1))),
                    "k_err": float(np.max(np.abs(np.asarray(sh.collapse_cache(cfg, wide.k), np.float32)
                                                 - np.asarray(cache.k, np.float32)))),
                    "copies_equal": all(np.array_equal(copies[..., d, :], copies[..., 0, :]) for d in range(n)),
                    "same_everywhere": len(shards) == n and all(np.array_equal(x, shards[0]) for x in shards)})
    return {"steps": out, "devices": len(jax.devices("cpu")), "split": plan.latent_split,
            "families": {f: [plan.families[f].k, plan.families[f].m] for f in ("q_a", "kv_a") if f in plan.families},
            "interconnect": plan.interconnect.get("latent_all_gather")}


@pytest.mark.parametrize("case", [c if c == "split-f32" else pytest.param(c, marks=pytest.mark.full)
                                  for c in SPLIT_CASES])
def test_the_latent_split_on_4_devices(case):
    """q_a / kv_a split by output columns, each device computing its slice and the kernel
    all-gathering the latent: logits and every device's copy of the latent cache match the
    reference in interpret mode on 4 host devices, the same bits on every device; the same
    build compiles deviceless for 4 TPU7x TensorCores (one kernel, no XLA collective)."""
    model, n, b, quant = SPLIT_CASES[case]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", NPROC=str(4 * n), XLA_FLAGS=xla_flags(n))
    proc = subprocess.run([sys.executable, __file__, case], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == n and r["split"]
    cfg = _config(model)
    want = {"kv_a": [cfg.hidden_size, 12]} | ({"q_a": [cfg.hidden_size, 14]} if cfg.q_lora_rank else {})
    assert r["families"] == want  # a device streams its columns only
    assert r["interconnect"]["count"] == cfg.num_layers
    bf16 = model.get("dtype") == "bfloat16"
    for s in r["steps"]:
        tol = (3e-2 if bf16 else 2e-5) * max(1.0, s["scale"])
        assert s["max_err"] <= tol and s["k_err"] <= tol and s["argmax_equal"], s
        assert s["copies_equal"] and s["same_everywhere"], s
    from tpumk.compile.aot import compile_plan
    from tpumk.plan.plan import make_plan

    c = compile_plan(make_plan(_split_spec(case, "tpu7x")))
    assert c.custom_calls == 1 and not XLA_COLLECTIVES.search(c.hlo_text)


def test_device_params_split_the_latent_projections_by_columns():
    """With the latent split, device d holds columns [d * w, (d + 1) * w) of wq_a and wkv_a
    (zero past the width), and the slices side by side are the whole matrices; the norms whole."""
    import dataclasses

    from tpumk.model.weights import random_params
    from tpumk.plan.sharding import plan_sharding

    cfg = _config(MLA)
    params = random_params(cfg, seed=1)
    sh = dataclasses.replace(plan_sharding(cfg, 4), latent_split=True)
    w = sh.latent_slices(cfg)
    assert w == {"q_a": 14, "kv_a": 12}
    lay = params["layers"][1]
    parts = [sh.device_params(cfg, params, d)["layers"][1] for d in range(4)]
    for key, fam in (("wq_a", "q_a"), ("wkv_a", "kv_a")):
        whole = np.asarray(lay[key])
        assert all(p[key].shape == (cfg.hidden_size, w[fam]) for p in parts)
        assert np.array_equal(np.concatenate([p[key] for p in parts], 1)[:, :whole.shape[1]], whole)
    for key in ("q_a_norm", "kv_a_norm"):
        assert all(np.array_equal(p[key], np.asarray(lay[key])) for p in parts)
    s = sh.summary(cfg)["attention"]
    assert s["split_by_columns"] == w and "kv_a" not in s["replicated"]


def test_the_plan_weighs_the_latent_split():
    """DeepSeek-V3 (fp8) on 32 TPU7x devices: with the split each device streams 1/32 of q_a and
    kv_a (lane-padded) and sends one more all-gather a layer; `auto` takes whichever tpumk's
    timeline model puts faster, which at batch 1 is the split (the weight ring's bytes and MXU
    pushes fall by more than the gathers cost) and at batch 8 the replicated form."""
    from tpumk.estimate.timeline import megakernel_step
    from tpumk.model.config import load_preset
    from tpumk.plan.knobs import TuningConfig

    cfg = load_preset("deepseek-v3")
    plans = {m: _plan(cfg, 32, quant="fp8", tuning=TuningConfig(mla_projections=m))
             for m in ("replicated", "split", "auto")}
    rep, split = plans["replicated"], plans["split"]
    assert not rep.latent_split and split.latent_split
    assert (split.families["q_a"].m, split.families["kv_a"].m) == (48, 18)
    assert split.hbm["weights_q_a"] * 8 < rep.hbm["weights_q_a"] and split.hbm["weights_kv_a"] * 4 < rep.hbm["weights_kv_a"]
    assert split.collectives_per_step == rep.collectives_per_step + cfg.num_layers
    assert split.vmem_needed <= split.vmem_budget
    secs = {m: megakernel_step(p).seconds for m, p in plans.items()}
    assert secs["split"] < secs["replicated"] and plans["auto"].latent_split and secs["auto"] == secs["split"]
    eight = _plan(cfg, 32, quant="fp8", batch=8)
    assert not eight.latent_split
    assert megakernel_step(eight).seconds <= megakernel_step(
        _plan(cfg, 32, quant="fp8", batch=8, tuning=TuningConfig(mla_projections="split"))).seconds


def test_build_report_of_a_split_mla_model(tmp_path):
    """`tpumk build` prints an MLA model's sharding on many devices (it raised a KeyError on the
    MLA summary before) and counts the latent all-gathers apart from the all-reduces; the
    split knob comes from a --tuning file, the build compiles deviceless for 2 TPU7x devices."""
    import tomli_w
    from click.testing import CliRunner

    from tpumk.cli.app import main

    cfg = _config(MLA)
    (tmp_path / "m.toml").write_bytes(tomli_w.dumps(cfg.to_dict()).encode())
    (tmp_path / "t.toml").write_text('[tuning]\nmla_projections = "split"\n')
    res = CliRunner().invoke(main, ["build", "--model", str(tmp_path / "m.toml"), "--target", "tpu7x", "--devices", "2",
                                    "--tuning", str(tmp_path / "t.toml"), "--context", "64", "--no-estimate",
                                    "--verify-q", "0"])
    assert res.exit_code == 0, res.output
    assert ("sharding: 2 heads per device, q_a / kv_a split by columns (q_a 28, kv_a 24 a device), the latent "
            "all-gathered, the latent cache on every device") in res.stdout
    assert f"{2 * cfg.num_layers} all-reduces (direct, float32 wire) + {cfg.num_layers} latent all-gathers" in res.stdout
    assert "Pallas TPU kernels in the step (per device)  1" in res.stdout
    # the whole program beside the kernel; no copy of the latent cache around the collective
    # kernel, which leaves the cache to commit_pages (docs/many-devices.md, "The KV cache copies";
    # 4 pages: a cache of 128 pages or more gets the layout copy of the test below)
    assert "tpumk model, the whole program" in res.stdout and "(kernel + XLA ops around it)" in res.stdout
    assert "copying" not in res.stdout and "note: XLA copies" not in res.stdout



def test_a_576_lane_latent_cache_is_not_copied(tmp_path, monkeypatch):
    """DeepSeek-V3's latent row (512 + 64 = 576 lanes, off the 128-lane grid) with 128 pages or
    more: stored unpadded, TPU gave the cache a non-row-major default layout, which the kernel
    cannot read, and XLA copied it around the kernel every step (docs/many-devices.md, "The KV
    cache copies"). Stored lane-padded (640 lanes), the one- and two-device builds compile with
    no copy; the build report's note would name one, with its bytes (shown with the program
    figures replaced)."""
    import tomli_w
    from click.testing import CliRunner

    import tpumk.build as B
    from tpumk.cli.app import main

    cfg = _config(dict(MLA, dtype="bfloat16", kv_lora_rank=512, qk_rope_head_dim=64, head_dim=88))
    (tmp_path / "m.toml").write_bytes(tomli_w.dumps(cfg.to_dict()).encode())
    for devices in ("1", "2"):
        res = CliRunner().invoke(main, ["build", "--model", str(tmp_path / "m.toml"), "--target", "tpu7x",
                                        "--devices", devices, "--context", "2048", "--no-estimate", "--verify-q", "0"])
        assert res.exit_code == 0, res.output
        assert "(kernel + XLA ops around it)" in res.stdout and "note: XLA copies" not in res.stdout, res.stdout
    real = B.program_figures
    monkeypatch.setattr(B, "program_figures", lambda *a: (real(*a)[0], {"count": 1.0, "hbm_bytes": 14.2e6,
                                                                          "seconds": 9.8e-6}))
    res = CliRunner().invoke(main, ["build", "--model", str(tmp_path / "m.toml"), "--target", "tpu7x",
                                    "--context", "2048", "--no-estimate", "--verify-q", "0"])
    assert "of it copying 7.10 MB around the kernel" in res.stdout, res.stdout
    assert "note: XLA copies 7.1 MB around the kernel every step (1 copy, +9.8 us by tpumk's model)" in res.stdout


if __name__ == "__main__":
    arg = sys.argv[1]
    print(json.dumps(_quantized_worker() if arg == "quantized" else _split_worker(arg) if arg in SPLIT_CASES
                     else _worker(arg)))
