"""tpumk: build, tune and ship TPU megakernels for LLM decoding."""

from tpumk._env import quiet_libtpu_without_tpu

quiet_libtpu_without_tpu()
del quiet_libtpu_without_tpu

__version__ = "0.1.0"


def __getattr__(name):
    """The serving-side API, imported lazily so `import tpumk` stays cheap:
    tpumk.load(artifact_dir) -> DecodeStep; tpumk.pack_weights(plan | step, params)."""
    if name == "load":
        from tpumk.export.artifacts import load

        return load
    if name == "pack_weights":
        from tpumk.kernel.layout import pack_weights

        return pack_weights
    raise AttributeError(f"module 'tpumk' has no attribute {name!r}")
