"""tpumk: build, tune and ship TPU megakernels for LLM decoding."""

__version__ = "0.1.0"
