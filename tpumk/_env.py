"""Process environment set before JAX initialises its backends.

On a machine with no TPU, libtpu still initialises (it is what compiles deviceless TPU
executables) and prints warnings about TPU worker hostnames and accelerator type that mean
nothing here. We default the variables it looks for, only when no TPU chip is present, so a
real TPU VM keeps its own settings. Never overrides a value the user set.
"""

import os


def quiet_libtpu_without_tpu() -> None:
    from tpumk.compat import tpu_chips_on_pci

    chips, _ = tpu_chips_on_pci()
    if chips:
        return
    # Without a TPU, libtpu only compiles; several processes (parallel tests, tuner workers)
    # may then share it, which its single-user lockfile would otherwise refuse.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Only feeds libtpu's host-bounds lookup; deviceless topologies are named per compile.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "tpu7x-8")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
