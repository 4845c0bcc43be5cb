"""tpumk.compat's replacement of JAX's io_callback path for the TPU interpreter: in place on the
pinned JAX, taken only by the interpreter's callbacks, and the same results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.compat import fast_interpret_callbacks, tpu_interpreter


def test_other_callbacks_keep_jax_arrays():
    assert fast_interpret_callbacks()  # the pinned JAX has the io_callback it was written for
    seen = []

    def record(x):
        seen.append(type(x))
        return np.asarray(x) + 1

    out = jax.jit(lambda x: jax.experimental.io_callback(record, jax.ShapeDtypeStruct((3,), jnp.float32), x))(
        jnp.zeros(3, jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.ones(3, np.float32))
    assert seen and all(issubclass(t, jax.Array) for t in seen), seen  # JAX's own path


def test_interpreted_kernel_gives_the_same_bits_either_way(monkeypatch):
    """A kernel with a DMA, a semaphore and VMEM reads run by the interpreter with JAX's own
    io_callback path and with tpumk's: bit-identical outputs."""
    from jax._src import callback as cb

    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        copy.wait()
        o_ref[...] = jnp.tanh(buf[...]) * 3.0 + buf[...].sum()

    def run(interpret):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                              out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
                              scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
                              interpret=interpret)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)
    fast = np.asarray(jax.jit(run(tpu_interpreter()))(x))
    assert getattr(cb.io_callback_impl, "_tpumk_fast_interpret", False)
    calls = []
    original = cb.io_callback_impl

    def counted(*args, **kw):
        calls.append(kw["callback"])
        return original(*args, **kw)

    monkeypatch.setattr(cb, "io_callback_impl", counted)
    jax.jit(run(tpu_interpreter()))(x + 0)  # every interpreter callback goes through it
    assert calls
    # JAX's own path: the function tpumk replaced, kept inside it
    jax_own = original._tpumk_jax_impl
    assert jax_own.__module__ == "jax._src.callback" and not hasattr(jax_own, "_tpumk_fast_interpret")
    monkeypatch.setattr(cb, "io_callback_impl", jax_own)
    slow = np.asarray(jax.jit(run(pltpu.InterpretParams()))(x))
    np.testing.assert_array_equal(fast, slow)
    np.testing.assert_allclose(fast, np.asarray(jnp.tanh(x) * 3.0 + x.sum()), rtol=1e-5, atol=1e-4)  # 1,024-term f32 sum


# ---------------------------------------------------------------------- the two supported JAX stacks
def _pins(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip()] = version.strip()
    return out


def test_the_installed_jax_stack_is_one_of_the_constraint_files():
    """tpumk runs on the sets constraints/*.txt pin (the default, vLLM TPU's, jax 0.12, the speculators tier's), not a mix."""
    from importlib.metadata import version
    from pathlib import Path

    sets = {p.name: _pins(p) for p in sorted((Path(__file__).parents[1] / "constraints").glob("*.txt"))}
    assert set(sets) == {"default.txt", "vllm-tpu.txt", "jax-0.12.txt", "speculators.txt"}
    installed = {name: version(name) for name in ("jax", "jaxlib", "libtpu")}
    assert installed in sets.values(), (installed, sets)


def test_stack_dependent_answers_follow_the_installed_versions():
    from tpumk.compat import jaxlib_version, known_cpu_compile_options, libtpu_profiles_dma_kernels
    from tpumk.targets import INTERPRET_COMPILER_OPTIONS, get_target, mesh_devices

    opts = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
    kept = known_cpu_compile_options(opts)
    assert ("xla_cpu_use_fusion_emitters" in kept) == (jaxlib_version() < (0, 11))
    assert set(INTERPRET_COMPILER_OPTIONS) <= set(opts) | {"xla_llvm_disable_expensive_passes",
                                                            "xla_cpu_parallel_codegen_split_count"}
    # the compiler estimate's profiler: what the targets say follows the libtpu installed
    assert get_target("tpu7x").static_profile == get_target("v6e").static_profile == libtpu_profiles_dma_kernels()
    # one TPU7x chip's two TensorCores as a deviceless topology, on either libtpu
    assert len(mesh_devices(get_target("tpu7x"), 2)) == 2
