"""tpumk: build, tune and ship TPU megakernels for LLM decoding."""

from tpumk._env import quiet_libtpu_without_tpu

quiet_libtpu_without_tpu()
del quiet_libtpu_without_tpu

__version__ = "0.1.0"
