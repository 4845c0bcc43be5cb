"""Converting the compiler's estimated cycles to seconds, through a stated calibration.

The clock behind the static profile's cycles is not published, so tpumk never guesses one.
Instead it compiles a probe: the published TPU7x megakernel's dense weight ring (12 banks of
2 MiB, bf16, a flat loop over every tile), whose throughput was measured on chip at 3.0 TB/s
(TPU_FACTS section 6: 26.4 us per 76 MiB layer). The probe's estimated cycles for a known
number of bytes then give seconds per cycle:

    seconds_per_cycle = (probe_bytes / 3.0e12 B/s) / probe_cycles

v6e has no on-chip anchor. Its conversion assumes the same probe ring reaches the same
fraction of the chip's HBM bandwidth as it did on TPU7x (3.0 / 3.7 = 0.81); that assumption is
named in every figure derived from it. Other targets have no usable static profile.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tpumk.estimate import static_profile
from tpumk.targets import Target, get_target
from tpumk.tomlfile import write_text_atomic

# The measured anchor (TPU_FACTS section 6): 76 MiB per layer in 26.4 us on a TPU7x TensorCore.
ANCHOR_BYTES_PER_S = 76 * 2**20 / 26.4e-6
ANCHOR_TARGET = "tpu7x"
PROBE_BANKS, PROBE_BANK_ROWS, PROBE_COLS, PROBE_LAYERS = 12, 256, 4096, 16  # 2 MiB bf16 banks


@dataclass(frozen=True)
class Calibration:
    target: str
    seconds_per_cycle: float
    probe_bytes: int
    probe_cycles: int
    assumed_bytes_per_s: float
    basis: str  # one sentence: where the conversion comes from

    def seconds(self, cycles: float) -> float:
        return cycles * self.seconds_per_cycle


def probe_ring_step():
    """The probe kernel and its argument shapes: a flat loop over every 2 MiB tile of
    PROBE_LAYERS 4096x4096 bf16 matrices, 12 loads in flight, each tile fed to the MXU."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    tiles_per_layer = PROBE_COLS // PROBE_BANK_ROWS
    total = PROBE_LAYERS * tiles_per_layer

    def kernel(w_hbm, x_ref, o_ref, ring, sems):
        def copy(g, slot):
            layer, t = jax.lax.div(g, tiles_per_layer), jax.lax.rem(g, tiles_per_layer)
            return pltpu.make_async_copy(w_hbm.at[layer, pl.ds(t * PROBE_BANK_ROWS, PROBE_BANK_ROWS)],
                                         ring.at[slot], sems.at[slot])

        for g in range(PROBE_BANKS):
            copy(g, g).start()

        def body(g, acc):
            slot = jax.lax.rem(g, PROBE_BANKS)
            copy(g, slot).wait()
            acc = acc + jnp.dot(x_ref[...], ring[slot], preferred_element_type=jnp.float32)

            @pl.when(g + PROBE_BANKS < total)
            def _():
                copy(g + PROBE_BANKS, slot).start()

            return acc

        o_ref[...] = jax.lax.fori_loop(0, total, body, jnp.zeros(o_ref.shape, jnp.float32))

    def step(w, x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, PROBE_COLS), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)],
            scratch_shapes=[pltpu.VMEM((PROBE_BANKS, PROBE_BANK_ROWS, PROBE_COLS), jnp.bfloat16),
                            pltpu.SemaphoreType.DMA((PROBE_BANKS,))],
        )(w, x)

    specs = (jax.ShapeDtypeStruct((PROBE_LAYERS, PROBE_COLS, PROBE_COLS), jnp.bfloat16),
             jax.ShapeDtypeStruct((8, PROBE_BANK_ROWS), jnp.bfloat16))
    return step, specs, PROBE_LAYERS * PROBE_COLS * PROBE_COLS * 2


def _cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpumk"
    return root / "calibration.json"


# The code behind a calibration: this module (the probe kernel, the anchor, the conversion) and
# everything it imports (the static-profile reader, the compile path, the targets).
CALIBRATION_ENTRY = "tpumk.estimate.calibration"


def _stack_key(target: Target) -> str:
    """The cache key of a target's calibration: the target, the jax/jaxlib/libtpu/tpumk
    versions and the digest of the probe code's source closure (tpumk.compile.keys's
    `source_inputs`, as artifact keys use), so an edit of the probe or of the code it runs
    through measures afresh instead of reusing a figure of other code."""
    from tpumk.compile.keys import source_inputs, stack_versions

    source = source_inputs(CALIBRATION_ENTRY)["sha256"]
    return "|".join([target.name] + [f"{k} {v}" for k, v in sorted(stack_versions().items())]
                    + [f"source {source}"])


@functools.lru_cache(maxsize=None)
def calibration_for(target_name: str) -> Calibration | None:
    """The cycles->seconds calibration for a target, or None where there is none (no static
    profile on this target, or profiling not enabled in this process). Cached on disk per
    target, jax/libtpu version and source of the probe code (`_stack_key`): the probe compile
    takes a few seconds."""
    target = get_target(target_name)
    if not target.static_profile:
        return None
    cache = _cache_file()
    key = _stack_key(target)
    try:
        from tpumk.errors import TpumkError
        from tpumk.files import MiB, read_regular

        stored = json.loads(read_regular(cache, MiB))
    except (TpumkError, ValueError, RecursionError):
        stored = {}
    if key in stored:
        return Calibration(**stored[key])
    if static_profile.profile_dir() is None:
        return None
    cal = _measure(target)
    if cal is not None:
        stored[key] = asdict(cal)
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cache, json.dumps(stored, indent=1))
    return cal


def _measure(target: Target) -> Calibration | None:
    from tpumk.compile.aot import compile_for

    step, specs, probe_bytes = probe_ring_step()
    static_profile.clear()
    compiled = compile_for(step, specs, target)
    cycles = sum(static_profile.collect(compiled.device_kind).values())
    if cycles <= 0:
        return None
    anchor = get_target(ANCHOR_TARGET)
    if target.name == ANCHOR_TARGET:
        bps = ANCHOR_BYTES_PER_S
        basis = ("probe ring (12 x 2 MiB bf16) measured on a TPU7x TensorCore at 3.0 TB/s "
                 "(published megakernel, TPU_FACTS 6)")
    else:
        fraction = ANCHOR_BYTES_PER_S / anchor.hbm_bandwidth
        bps = fraction * target.hbm_bandwidth
        basis = (f"ASSUMED: probe ring reaches {fraction:.2f} of {target.name} HBM bandwidth, as measured "
                 f"on TPU7x; no on-chip measurement for {target.name}")
    return Calibration(target.name, (probe_bytes / bps) / cycles, probe_bytes, int(cycles), bps, basis)
