"""The vLLM plugin's prefill step against XLA's plain forward of the same model (issue 58).

One prompt of --tokens tokens (default 2,048) in one run, on this host's JAX backend:

- the plugin's step: `tpumk.vllm.steps.ragged_step` under jax.jit, on vLLM's KV layout
  (tpumk.vllm.kv: the stacked K and V arrays, blocks of --block-size tokens handed out shuffled,
  --slots request slots of which one is live, max_model_len = --context), its caches donated as
  vLLM's runner donates them, so the K/V writes land in place;
- the same step as the plugin runs it with floating-point weights: the weights held once, in the
  megakernel's packed layout (a plan of --slots x max_model_len), read back inside the step
  (`tpumk.kernel.unpack`);
- XLA's plain forward: `tpumk.model.reference.forward_full` under jax.jit over the same tokens
  (no cache, no pages: every position's logits).

Both compiled first (compile time not counted), then --repeats timed calls each, alternating; the
median of each is printed with the ratio. Random weights of a preset (--model; default
tiny-dense; an MLA preset, e.g. tiny-mla, runs tpumk.vllm.mla_prefill on one latent array), float32
unless the preset says otherwise.

    python benchmarks/vllm_prefill.py [--model tiny-dense] [--tokens 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.kernel.layout import pack_weights
from tpumk.kernel.unpack import Unpacker
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.padding import params_as_run
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target
from tpumk.vllm import kv, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=0, help="max_model_len (default: --tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = load_preset(args.model)
    params = random_params(cfg, seed=0)
    n, context, bs = args.tokens, args.context or args.tokens, args.block_size
    dt = R.jnp_dtype(cfg)
    per = -(-context // bs)
    blocks = args.slots * per
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
    tables = np.zeros((args.slots, per), np.int32)
    tables[0] = rng.permutation(blocks)[:per]
    qsl = np.full(args.slots + 1, n, np.int32)
    qsl[0] = 0
    ids, pos, qsl, tables = (jnp.asarray(a) for a in (tokens, np.arange(n, dtype=np.int32), qsl, tables))
    # an MLA model's cache is one latent array (tpumk.vllm.mla_prefill); its V has no lanes
    width = cfg.attention.latent_cache_lanes if cfg.is_mla else cfg.attention.kv_size
    shape = kv.cache_shape(cfg.kv_layers, blocks, bs, width)

    plan = make_plan(BuildSpec(cfg, get_target("cpu"), args.slots, per * bs, TuningConfig(), page_size=bs))
    run = params_as_run(plan, params)
    unpack = Unpacker(plan, run)
    packed = pack_weights(plan, run)
    if plan.whole_model != cfg:
        raise SystemExit(f"{args.model}: the plan pads the model's lanes; pick a preset whose widths are whole lanes")

    plugin = jax.jit(lambda caches: steps.ragged_step(params, cfg, *caches, ids, pos, qsl, tables, jnp.int32(1), bs,
                                                      context), donate_argnums=0)
    once = jax.jit(lambda packed, caches: steps.ragged_step(unpack(packed), cfg, *caches, ids, pos, qsl, tables,
                                                            jnp.int32(1), bs, context), donate_argnums=1)
    plain = jax.jit(lambda t: R.forward_full(params, cfg, t))

    caches = (jnp.zeros(shape, dt), jnp.zeros(shape[:3] + (0,) if cfg.is_mla else shape, dt))
    caches, rows = plugin(caches)
    caches, rows_once = once(packed, caches)
    full = plain(ids[None])
    jax.block_until_ready((caches, rows, rows_once, full))
    err = float(jnp.max(jnp.abs(rows[n - 1] - full[0, n - 1])))
    diff = float(jnp.max(jnp.abs(rows[n - 1] - rows_once[n - 1])))
    times = {"plugin": [], "once": [], "plain": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        caches, rows = plugin(caches)
        jax.block_until_ready(rows)
        times["plugin"].append(time.perf_counter() - t)
        t = time.perf_counter()
        caches, rows = once(packed, caches)
        jax.block_until_ready(rows)
        times["once"].append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(plain(ids[None]))
        times["plain"].append(time.perf_counter() - t)
    a, c, b = (statistics.median(times[k]) for k in ("plugin", "once", "plain"))
    load = os.getloadavg()[0]
    heads = (f"{cfg.num_q_heads} heads, latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}" if cfg.is_mla else
             f"{cfg.num_q_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}")
    print(f"{args.model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {heads}, {cfg.dtype}), {n} tokens, max_model_len {context}, block size {bs}, "
          f"{args.slots} slots; {jax.default_backend()}, {os.cpu_count()} cores, load {load:.1f}")
    print(f"plugin prefill step (ragged_step, jit): {a * 1e3:.0f} ms (median of {args.repeats})")
    print(f"the same, weights held once (packed):   {c * 1e3:.0f} ms (last-token logits differ from the step's above "
          f"by {diff:.2g})")
    print(f"plain forward (forward_full, jit):      {b * 1e3:.0f} ms")
    print(f"ratio {a / b:.2f}x, held once {c / b:.2f}x; last-token logits differ by {err:.2g}")


if __name__ == "__main__":
    main()
