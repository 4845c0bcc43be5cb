"""tpumk: build, tune and ship TPU megakernels for LLM decoding."""

from tpumk._env import quiet_libtpu_without_tpu

quiet_libtpu_without_tpu()
del quiet_libtpu_without_tpu

__version__ = "0.1.0"


def __getattr__(name):
    """The serving-side API, imported lazily so `import tpumk` stays cheap:
    tpumk.load(artifact_dir) -> DecodeStep; tpumk.load_rounds(artifact_dir) -> RoundProgram (an
    artifact of `tpumk export --draft`); tpumk.pack_weights(plan | step, params)."""
    if name == "load":
        from tpumk.export.artifacts import load

        return load
    if name == "load_rounds":
        from tpumk.export.artifacts import load_rounds

        return load_rounds
    if name == "pack_weights":
        from tpumk.kernel.layout import pack_weights

        return pack_weights
    raise AttributeError(f"module 'tpumk' has no attribute {name!r}")
