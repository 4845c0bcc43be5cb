"""Every private JAX / Optuna API tpumk relies on, in one place.

tpumk pins jax 0.10.2 (and runs its kernels on jax 0.11.2, the vLLM TPU stack's, and 0.12.0.1:
docs/install.md) and supports optuna >= 4; these names are not public API and may move in
another release. Each accessor says what it is for, and fails (or answers "unknown") the same
way whatever moved, so a version bump means reading this file, not the whole package.
"""

from __future__ import annotations

from typing import Any


def release(version: Any) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "0.0.50.1" or "0.12.0.1"."""
    return tuple(int(p) for p in str(version).split(".")[:3] if p.isdigit())


def installed_release(dist: str) -> tuple[int, ...] | None:
    """The installed distribution's release, read without importing it (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return release(version(dist))
    except PackageNotFoundError:
        return None


def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor, patch)."""
    return installed_release("jaxlib") or ()


def known_cpu_compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` less those this jaxlib's XLA:CPU does not know (an unknown one fails the whole
    compile: "INVALID_ARGUMENT: No such compile option"). jaxlib 0.11 has no
    `xla_cpu_use_fusion_emitters` (jax 0.11.2, the vLLM TPU stack's pin; checked 2026-12-04)."""
    if jaxlib_version() >= (0, 11):
        return {k: v for k, v in options.items() if k != "xla_cpu_use_fusion_emitters"}
    return dict(options)


def libtpu_profiles_dma_kernels() -> bool:
    """Does this libtpu's static LLO profile (the compiler estimate) work on kernels with manual
    DMAs? 0.0.52 does on TPU7x and v6e; 0.0.48 (the vLLM TPU stack's) aborts on them ("Static LLO
    profiling of tpu_custom_call.1 failed: Unsupported DMA direction: 0 on GFC", the attention
    stage on TPU7x, checked 2026-12-04); 0.0.50.1 (jax 0.12's) profiled the tiny-dense build
    but its calibration probe gave no figure, so no whole-step estimate either (same day)."""
    have = installed_release("libtpu")
    return have is not None and have >= (0, 0, 52)


def deviceless_topology_devices(topology: str):
    """The devices of a deviceless TPU topology ("tpu7x:2x2x1"). libtpu 0.0.48 (the vLLM TPU
    stack's) refuses a topology smaller than its default host bounds ("tpu7x:1x1x1 is not
    divisible by the given (or default) chips_per_host_bounds 2x2x1"); it is then asked again with
    the topology's own bounds as one host's. libtpu 0.0.52 takes the name alone."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    except Exception as e:  # noqa: BLE001 - libtpu's errors are plain RuntimeErrors / XlaRuntimeErrors
        if "chips_per_host_bounds" not in str(e):
            raise
        dims = [int(d) for d in topology.split(":", 1)[1].split("x")]
        return topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                            chips_per_host_bounds=dims).devices


def tpu_chips_on_pci() -> tuple[int, Any]:
    """(number of TPU chips on this host's PCI bus, their jax ChipVersion-like id or None), read
    without initialising a JAX backend. (0, None) when jax cannot tell."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # a jax without this helper: report no TPU rather than guess
        return 0, None


def tpu_chip_info(chip: str, cores: int = 1):
    """Pallas' chip table entry (VMEM, HBM, bandwidth, MXU, peak FLOP/s) for a chip version
    ("v5e", "v5p", "v6e", "7x"), per `cores` TensorCores."""
    from jax._src.pallas.mosaic.tpu_info import ChipVersion, get_tpu_info_for_chip

    return get_tpu_info_for_chip(ChipVersion(chip), cores)


def jax_backends_initialised() -> bool:
    """Whether JAX has created its backends in this process (libtpu flags set after that are
    ignored). True when jax cannot tell: callers then leave the environment alone."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:
        return True


def no_persistent_cache_write(devices):
    """A context for compiling for `devices`: when they are deviceless stand-ins (libtpu's
    compile-only client), JAX writes no persistent compilation cache entry. Such an executable
    cannot be read back (jax 0.10.2: "PjRtCompiler must be constructed with a Client to call
    DeserializeLoadedExecutable"), so an entry would only make every later read warn and
    recompile. Attached devices keep the cache as configured."""
    import contextlib

    from jax._src import config

    if any(type(d.client).__name__ == "CompileOnlyPyClient" for d in devices):
        return config.persistent_cache_min_compile_time_secs(float("inf"))
    return contextlib.nullcontext()


def persistent_cache_bypassed():
    """A context in which JAX's persistent compilation cache is neither read nor written, for
    an executable that will be serialized (`tpumk export`): an XLA:CPU executable read back from
    the cache serializes into a blob whose load fails at its first call ("Function
    wrapped_broadcast.N not found", jax 0.10.2), so an artifact's executable is always compiled
    afresh. JAX decides once per process whether the cache is used; its state is reset on
    entry and exit so the next compile decides again under the user's settings."""
    import contextlib

    from jax._src import compilation_cache, config

    if not compilation_cache.is_persistent_cache_enabled():
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def bypassed():
        compilation_cache.reset_cache()
        try:
            with config.enable_compilation_cache(False):
                yield
        finally:
            compilation_cache.reset_cache()
    return bypassed()


def compiler_rejections() -> tuple[type[BaseException], ...]:
    """The exceptions a TPU compile raises when the compiler rejects the program: XLA's
    JaxRuntimeError, and the MosaicError jax re-raises it as for a Pallas kernel (private in
    jax 0.10.2: jax._src.pallas.mosaic.error_handling)."""
    import jax

    try:
        from jax._src.pallas.mosaic.error_handling import MosaicError
    except ImportError:  # another jax: its JaxRuntimeError still names the rejection
        return (jax.errors.JaxRuntimeError,)
    return (jax.errors.JaxRuntimeError, MosaicError)


def interpret_races():
    """The race detector's state of Pallas' TPU interpret mode in this process: None before any
    kernel ran with `InterpretParams(detect_races=True)`, else an object whose `races_found`
    says whether a data race between DMAs and compute was seen."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as state

    return state.races


# The module whose functions Pallas' TPU interpreter runs as host callbacks.
_INTERPRETER_MODULE = "jax._src.pallas.mosaic.interpret"


def fast_interpret_callbacks() -> bool:
    """Let Pallas' TPU interpreter's host callbacks take their numpy arguments as they come.

    The interpreter runs every DMA, semaphore and VMEM access as an io_callback, and JAX's
    io_callback implementation first moves each callback's arguments onto the CPU device as
    jax.Arrays, which the interpreter turns straight back into numpy and Python ints. On a
    4-device tiny-moe step that round trip was most of the run: a compiled step took 5.1 s with
    it and 1.0 s without (same bits). Only callbacks whose function is the interpreter's take
    the short path; every other io_callback keeps JAX's own. Returns whether it is in place
    (False when this JAX's io_callback does not have the shape it was written for: the
    interpreter then runs as JAX ships it, slower and the same)."""
    import inspect

    import numpy as np
    from jax._src import callback as cb
    from jax._src import config, tree_util
    from jax._src import xla_bridge as xb

    impl = getattr(cb, "io_callback_impl", None)
    if impl is None:
        return False
    if getattr(impl, "_tpumk_fast_interpret", False):
        return True
    if list(inspect.signature(impl).parameters) != ["args", "result_avals", "callback", "sharding", "ordered"]:
        return False

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        fn = getattr(callback, "callback_func", None)
        fn = getattr(fn, "func", fn)  # functools.partial of an interpreter function
        if not getattr(fn, "__module__", "").startswith(_INTERPRETER_MODULE):
            return impl(*args, result_avals=result_avals, callback=callback, sharding=sharding, ordered=ordered)
        with config.default_device(xb.local_devices(backend="cpu")[0]):
            return tree_util.tree_map(np.asarray, callback(*args))

    io_callback_impl._tpumk_fast_interpret = True
    io_callback_impl._tpumk_jax_impl = impl  # JAX's own, for whoever needs the slow path back
    cb.io_callback_impl = io_callback_impl
    return True


def tpu_interpreter(detect_races: bool = False):
    """Pallas' TPU interpret mode (`pltpu.InterpretParams`) as tpumk runs it: with
    `fast_interpret_callbacks` in place."""
    from jax.experimental.pallas import tpu as pltpu

    fast_interpret_callbacks()
    # jax 0.12 raises at the first race by default (on_race="raise"); tpumk reads the detector's
    # verdict after the run (`interpret_races`), as jax 0.10 / 0.11 report it.
    extra = {"on_race": "warn"} if detect_races and "on_race" in getattr(
        pltpu.InterpretParams, "__dataclass_fields__", {}) else {}
    return pltpu.InterpretParams(detect_races=detect_races, **extra)


def optuna_heartbeat_base():
    """Optuna's heartbeat mixin (`BaseHeartbeat`): RDBStorage implements it; tpumk adds it to
    JournalStorage so `fail_stale_trials` fails the trials of a killed process there too."""
    from optuna.storages._heartbeat import BaseHeartbeat

    return BaseHeartbeat


def optuna_heartbeat_enabled(storage) -> bool:
    """Whether an Optuna storage runs the heartbeat protocol (interval set)."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return is_heartbeat_enabled(storage)
