"""Does the installed JAX set give the TPU compiler's estimate? libtpu 0.0.52 (constraints/default.txt)
profiles kernels with DMAs on TPU7x and v6e; the vLLM TPU set's 0.0.48 and jax 0.12's 0.0.50.1 do
not (tpumk.compat.libtpu_profiles_dma_kernels), and a build there says so instead of a figure.
Tests of the estimate itself skip on those sets; tests of what surrounds it assert the wording."""

from __future__ import annotations

import pytest

from tpumk.targets import get_target

COMPILER_ESTIMATE = get_target("tpu7x").static_profile
# how a tpu7x / v6e build on such a set starts its estimate_source (tpumk.estimate.compiler)
NO_PROFILER = "none: this libtpu's static profiler aborts on kernels with DMAs"
needs_compiler_estimate = pytest.mark.skipif(
    not COMPILER_ESTIMATE, reason="this libtpu's static profiler does not take kernels with DMAs "
                                  "(tpumk.compat.libtpu_profiles_dma_kernels; constraints/default.txt has one that does)")
