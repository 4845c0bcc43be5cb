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
