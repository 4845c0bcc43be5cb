"""The TPU compiler's static estimate of the drafter's pass kernel beside tpumk's model of it.

For each case, the drafter's pass kernel (tpumk.kernel.draft_pass: one dflash / dspark block pass,
or one eagle3 / mtp chain step) is compiled deviceless for the target in this process, started
with libtpu's static-profile flag (`tpumk.estimate.static_profile.enable`, read once at start-up);
the cycles of the kernel's own custom call are converted to seconds by tpumk's calibration
(tpumk.estimate.calibration: on TPU7x the published ring measured at 3.0 TB/s), and printed beside
tpumk's timeline model of the same pass (tpumk.estimate.speculative.kernel_pass_seconds), total
and without its KV-cache stage. What the compiler's figure misses (TPU_FACTS section 3): a loop
nested in another loop is counted once, and the kernel's KV-cache chunk loop sits in its loop over
KV heads, so the compiler's figure holds one KV head's chunks a layer; at one chunk a KV head
(`one-chunk`) nothing is missed.

    python benchmarks/draft_pass_estimate.py [--target tpu7x] [--case small published] [--max-rss-gib 6]

Found with libtpu 0.0.52 (2026-12-07, this 2-core host; docs/speculative.md has the figures): v6e
profiles the small cases; on TPU7x the kernel compiles in about 4 s without the profile flag,
but with it libtpu's profiling compile of even the `one-chunk` case grows past 9 GiB (14 GiB,
killed at 167 s, for `small`) without finishing; the published size on v6e aborts the process in
the profiler (an XLA layout copy before the kernel: "Unsupported DMA direction for latency
modeling: dma-general"). `--max-rss-gib` stops the process (exit 1, one line) before it takes
a shared host's memory.

Cases (bfloat16 weights: libtpu's profiler aborts on float32 kernels):
  small      a dspark drafter of 1 layer, 4 query / 2 KV heads of 64, block 4, on tiny-dense
             (hidden 256) in bfloat16; batch 2, context 256
  one-chunk  the same drafter, batch 1, context 128 (one KV chunk a head)
  published  the published Kimi K2 DSpark's size on kimi-k2 (5 layers, hidden 7168, 96 query /
             16 KV heads of 64, intermediate 14336, 5 taps, block 8); batch 1, context 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tpumk.estimate import static_profile

CASES = {
    "small": dict(model="tiny-dense", batch=2, context=256,
                  shape=dict(layers=1, heads=4, kv_heads=2, head_dim=64, block_size=4)),
    "one-chunk": dict(model="tiny-dense", batch=1, context=128,
                      shape=dict(layers=1, heads=4, kv_heads=2, head_dim=64, block_size=4)),
    "published": dict(model="kimi-k2", batch=1, context=4096,
                      shape=dict(layers=5, heads=96, kv_heads=16, head_dim=64, ffn=14336, block_size=8)),
}


def run_case(name: str, target_name: str) -> dict:
    import jax
    import jax.numpy as jnp

    from tpumk.compile.aot import compile_for
    from tpumk.draft import random_drafter
    from tpumk.estimate.calibration import calibration_for
    from tpumk.estimate.speculative import kernel_pass_seconds
    from tpumk.kernel import draft_pass
    from tpumk.model.config import load_preset
    from tpumk.targets import get_target

    case = CASES[name]
    cfg = load_preset(case["model"]).replace(dtype="bfloat16")
    b, c = case["batch"], case["context"]
    d = random_drafter("dspark", cfg, seed=0, abstract=True, **case["shape"])
    assert draft_pass.refusal(d.spec) is None
    target = get_target(target_name)
    dt = jnp.bfloat16
    tparams = {"embed": jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), dt)}
    if not cfg.tie_embeddings:
        tparams["lm_head"] = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), dt)
    kd = draft_pass.KernelDrafter(d, False)
    state = jax.eval_shape(lambda: d.init_state(b, c))
    vec = jax.ShapeDtypeStruct((b,), jnp.int32)
    forced = jax.ShapeDtypeStruct((b, d.block), jnp.int32)
    # the weights as the round program hands them to the kernel (`KernelDrafter.prepare`, once a
    # call): the pass alone, without pack's transposes (XLA copies, which the profiler may refuse)
    prepared = jax.eval_shape(kd.prepare, d.params, tparams)
    static_profile.clear()
    print(f"{name}: compiling for {target_name}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    compiled = compile_for(lambda p, t, s, a, ap, f: kd.logits(p, t, s, a, ap, f),
                           (prepared, tparams, state, vec, vec, forced), target)
    compile_s = time.perf_counter() - t0
    by_op = static_profile.collect(compiled.device_kind)
    kernel_ops = {k: v for k, v in by_op.items() if "draft_pass" in k}
    g = draft_pass.geometry(d.spec, b, d.spec.block_size, c, cfg.dtype)
    model = kernel_pass_seconds(target, g)
    model_s = sum(model["seconds"].values())
    out = {"case": name, "target": target_name, "batch": b, "context": c, "compile_seconds": round(compile_s, 1),
           "custom_calls": compiled.custom_calls, "profiled_ops": len(by_op), "kernel_ops": kernel_ops,
           "model_seconds": model_s, "model_seconds_without_kv_cache": model_s - model["seconds"]["kv_cache"],
           "model_stages": model["seconds"], "model_hbm_bytes": sum(model["hbm_bytes"].values())}
    print(f"{name}: compiled in {compile_s:.1f} s; calibrating", file=sys.stderr, flush=True)
    cal = calibration_for(target_name)
    if not kernel_ops:
        out["compiler"] = f"none: the compiler wrote no static profile for the kernel ({len(by_op)} ops profiled)"
    elif cal is None:
        out["compiler"] = "cycles only: no calibration for this target"
        out["compiler_cycles"] = sum(kernel_ops.values())
    else:
        cycles = sum(kernel_ops.values())
        out.update(compiler_cycles=cycles, compiler_seconds=cal.seconds(cycles), calibration=cal.basis)
    return out


def _watch_memory(limit_gib: float) -> None:
    """Stop this process (one line, exit 1) once its resident memory passes `limit_gib`."""
    import os
    import threading

    def watch() -> None:
        while True:
            with open("/proc/self/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            if kib > limit_gib * 2**20:
                print(f"draft_pass_estimate: error: resident memory {kib / 2**20:.1f} GiB passed --max-rss-gib "
                      f"{limit_gib:g} while compiling (libtpu's profiling compile); stopped", file=sys.stderr,
                      flush=True)
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tpu7x")
    ap.add_argument("--case", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--max-rss-gib", type=float, default=6.0)
    args = ap.parse_args()
    _watch_memory(args.max_rss_gib)
    if static_profile.enable() is None:
        raise SystemExit("draft_pass_estimate: the static profile could not be enabled (JAX already started)")
    for name in args.case:
        print(json.dumps(run_case(name, args.target)), flush=True)


if __name__ == "__main__":
    main()
