"""What it costs to compile a layer loop that picks its KV cache among L per-layer arrays.

vLLM's TPU runner keeps one KV cache array per layer; the megakernel's layer loop is a traced
`fori_loop` over one stacked `[layers, pages, page_size, width]` array, and a DMA cannot pick its
source among L arrays by a traced index. The way to read vLLM's arrays in place without
unrolling the whole layer body is a branch per layer around every DMA start (`pl.when(layer ==
i)` for i < L, or `lax.switch`), with every wait unconditional on one array's descriptor of the
same size (the attention stage keeps waits out of branches for libtpu's static profiler). This
probe measures what that does to the compile time, deviceless.

Every variant is the same grid-less `pallas_call` with the caches aliased input -> output (updated
in place): a `fori_loop` over `layers`; per layer and per cache (K and V), `sites` page DMAs from
HBM into VMEM slots (pages from an SMEM table, as block tables give them), then +1 on every
slot, then the pages written back. `sites` per cache stands for the attention stage's page DMAs
per layer (patch reads and write-backs for a batch of 8, the tile stream's in-flight pages):

- `stacked`: K and V each one `[layers, pages, page_size, width]` array, `cache.at[layer, page]`
  (the megakernel today);
- `when`: 2 x layers arrays `[pages, page_size, width]`, each DMA start in `layers` `pl.when`s;
- `switch`: the same arrays, each DMA start a `lax.switch` over the layers;
- `unrolled`: the same arrays, the layer loop a Python loop (the body once per layer: a lower
  bound for the megakernel, whose layer body is far larger than this probe's).

    python benchmarks/layer_select_compile.py [--target tpu7x v6e] [--layers 36] [--sites 24]
                                              [--variant stacked when switch unrolled]
    python benchmarks/layer_select_compile.py --check --layers 3 --sites 2   (interpret mode, CPU)

It prints, per target and variant, the seconds `jit(...).lower(...).compile()` took (wall clock
on this host, best of `--repeat`), the lowering alone, and the compiled kernel's Mosaic text size
(a proxy for the code the branches add).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PAGE = 16  # tokens per page
WIDTH = 1024  # bf16 lanes of a token's row: 8 KV heads x 128
NUM_PAGES = 64
VARIANTS = ("stacked", "when", "switch", "unrolled")


def probe(variant: str, layers: int, sites: int, interpret=False):
    """(step, arg specs) of one variant (see the module doc); `interpret`: pallas_call's."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    per_layer = variant != "stacked"
    arrays = 2 * layers if per_layer else 2

    def kernel(table, *refs):
        outs, (slots, sems) = refs[arrays:2 * arrays], refs[2 * arrays:]
        caches = [outs[:layers], outs[layers:]] if per_layer else [outs[0], outs[1]]

        def page_ref(c, layer, page):
            if per_layer:
                return caches[c][layer].at[page]
            return caches[c].at[layer, page]

        def copy(c, layer, s, page, write):
            hbm, vmem = page_ref(c, layer, page), slots.at[c, s]
            src, dst = (vmem, hbm) if write else (hbm, vmem)
            return pltpu.make_async_copy(src, dst, sems.at[1 if write else 0, c, s])

        def start(c, layer, s, page, write):
            if variant in ("stacked", "unrolled"):
                copy(c, layer, s, page, write).start()
            elif variant == "when":
                for i in range(layers):
                    pl.when(layer == i)(lambda i=i: copy(c, i, s, page, write).start())
            else:
                jax.lax.switch(layer, [lambda i=i: copy(c, i, s, page, write).start() for i in range(layers)])

        def wait(c, layer, s, page, write):
            # the same byte count whichever layer's array the start picked: one unconditional wait
            copy(c, layer if variant in ("stacked", "unrolled") else 0, s, page, write).wait()

        def body(layer, carry):
            pages = [table[jax.lax.rem(layer * sites + s, NUM_PAGES)] for s in range(sites)]
            for write in (False, True):
                for c in range(2):
                    for s in range(sites):
                        if write:
                            slots[c, s] = slots[c, s] + 1
                        start(c, layer, s, pages[s], write)
                for c in range(2):
                    for s in range(sites):
                        wait(c, layer, s, pages[s], write)
            return carry

        if variant == "unrolled":
            for layer in range(layers):
                body(layer, 0)
        else:
            jax.lax.fori_loop(0, layers, body, 0)

    shape = (NUM_PAGES, PAGE, WIDTH) if per_layer else (layers, NUM_PAGES, PAGE, WIDTH)
    specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * arrays

    def step(table, *caches):
        return pl.pallas_call(
            kernel,
            out_shape=specs,
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [pl.BlockSpec(memory_space=pl.ANY)] * arrays,
            out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * arrays,
            input_output_aliases={1 + i: i for i in range(arrays)},
            scratch_shapes=[pltpu.VMEM((2, sites, PAGE, WIDTH), jnp.bfloat16),
                            pltpu.SemaphoreType.DMA((2, 2, sites))],
            interpret=interpret,
        )(table, *caches)

    return step, [jax.ShapeDtypeStruct((NUM_PAGES,), jnp.int32), *specs]


def compile_seconds(target_name: str, variant: str, layers: int, sites: int, repeat: int) -> dict:
    import jax
    from jax.sharding import SingleDeviceSharding

    from tpumk.targets import get_target

    dev = get_target(target_name).device()
    step, specs = probe(variant, layers, sites)
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=SingleDeviceSharding(dev)) for s in specs]
    best_lower = best_compile = float("inf")
    text = 0
    for _ in range(repeat):
        jax.clear_caches()
        t0 = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=tuple(range(1, len(specs)))).lower(*specs)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        best_lower, best_compile = min(best_lower, t1 - t0), min(best_compile, t2 - t1)
        text = len(lowered.as_text())
    return {"target": target_name, "variant": variant, "layers": layers, "sites_per_cache": sites,
            "lower_s": round(best_lower, 3), "compile_s": round(best_compile, 3), "lowered_chars": text}


def check(variant: str, layers: int, sites: int) -> bool:
    """Whether the variant, run in Pallas' TPU interpret mode on the CPU, adds 1 to exactly the
    pages of each layer's arrays its table names (and nothing else)."""
    import jax
    import numpy as np

    from tpumk.compat import tpu_interpreter

    step, specs = probe(variant, layers, sites, interpret=tpu_interpreter())
    rng = np.random.default_rng(0)
    table = rng.permutation(NUM_PAGES).astype(np.int32)
    caches = [rng.integers(-8, 8, s.shape).astype(s.dtype) for s in specs[1:]]
    got = jax.jit(step)(table, *caches)
    per_layer = variant != "stacked"
    for c in range(2):
        for layer in range(layers):
            want = np.asarray(caches[c * layers + layer] if per_layer else caches[c][layer], np.float32).copy()
            want[table[[(layer * sites + s) % NUM_PAGES for s in range(sites)]]] += 1
            out = got[c * layers + layer] if per_layer else got[c][layer]
            if not np.array_equal(np.asarray(out, np.float32), want):
                return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", nargs="+", default=["tpu7x", "v6e"])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--sites", type=int, default=24)
    ap.add_argument("--variant", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--check", action="store_true",
                    help="run each variant at --layers / --sites in interpret mode on the CPU and check its pages")
    args = ap.parse_args(argv)
    if args.check:
        for v in args.variant:
            print(json.dumps({"variant": v, "layers": args.layers, "sites_per_cache": args.sites,
                              "interpret_correct": check(v, args.layers, args.sites)}), flush=True)
        return 0
    for t in args.target:
        for v in args.variant:
            try:
                row = compile_seconds(t, v, args.layers, args.sites, args.repeat)
            except Exception as e:  # noqa: BLE001 - a variant the compiler refuses is a result too
                row = {"target": t, "variant": v, "layers": args.layers, "error": str(e).splitlines()[0][:300]}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
