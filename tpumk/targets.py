"""TPU targets: chip figures (from Pallas' own chip table), deviceless topologies, devices.

A target names what a build is compiled for. TPU targets compile deviceless through a
topology description unless a TPU of that kind is attached, in which case the real device is
used. The `cpu` target runs kernels in Pallas' TPU interpret mode on the host; its planning
figures (VMEM budget, bandwidth) are those of the chip it emulates, TPU7x, so a plan that
fits `cpu` also fits a TPU7x TensorCore.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from tpumk.compat import deviceless_topology_devices, known_cpu_compile_options, libtpu_profiles_dma_kernels
from tpumk.errors import TargetError, did_you_mean


@dataclass(frozen=True)
class Target:
    name: str
    chip: str  # Pallas ChipVersion value ("v5e", "v5p", "v6e", "7x")
    topology: str | None  # deviceless topology name; None for the cpu target
    device_kind: str | None  # jax Device.device_kind of a real device of this kind
    static_profile: bool  # does libtpu's static LLO profile work for Pallas kernels here
    interpret: bool = False  # run kernels in TPU interpret mode on the host

    # ---- chip figures, per TensorCore (one JAX device), read from Pallas' chip table
    @functools.cached_property
    def info(self):
        from tpumk.compat import tpu_chip_info

        return tpu_chip_info(self.chip)

    @property
    def vmem_bytes(self) -> int:
        return int(self.info.vmem_capacity_bytes)

    @property
    def hbm_bytes(self) -> int:
        return int(self.info.hbm_capacity_bytes)

    @property
    def hbm_bandwidth(self) -> float:
        """Bytes per second."""
        return float(self.info.mem_bw_bytes_per_second)

    @property
    def bf16_flops(self) -> float:
        return float(self.info.bf16_ops_per_second)

    @property
    def mxu_shape(self) -> tuple[int, int]:
        return (int(self.info.num_mxus), int(self.info.mxu_column_size))

    @property
    def is_tpu(self) -> bool:
        return not self.interpret

    def figures(self) -> dict:
        return {
            "name": self.name, "chip": self.chip, "topology": self.topology,
            "vmem_bytes": self.vmem_bytes, "hbm_bytes": self.hbm_bytes,
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth, "bf16_flops": self.bf16_flops,
            "mxu": f"{self.mxu_shape[0]} x {self.mxu_shape[1]}", "static_profile": self.static_profile,
            "interpret": self.interpret,
            # --devices N compiles for the smallest of these holding N devices (topology_for)
            "multi_device_topologies": {} if self.interpret else dict(TOPOLOGIES[self.chip]),
        }

    # ---- devices
    def attached_device(self):
        """The first attached JAX device of this target's kind, or None."""
        import jax

        if self.interpret:
            return jax.devices("cpu")[0]
        try:
            devs = jax.devices("tpu")
        except RuntimeError:
            return None
        for d in devs:
            if d.device_kind == self.device_kind:
                return d
        return None

    def device(self):
        """The device to compile for: an attached one when present, else a deviceless stand-in."""
        dev = self.attached_device()
        if dev is not None:
            return dev
        return _deviceless_devices(self.topology)[0]

    def is_attached(self) -> bool:
        return self.interpret or self.attached_device() is not None


# XLA:CPU compile options for the programs the `cpu` target interprets kernels in (jax.jit's
# `compiler_options`; not XLA_FLAGS, which libtpu parses too and aborts on CPU-only flags). An
# interpreted megakernel is a CPU program of thousands of ops that runs a few steps, so compile
# time dominates: LLVM's optimisations and XLA:CPU's newer fusion emitters cost more to compile
# than they save in running. Measured here (tiny-moe, batch 4, 2-core host under load): lower +
# compile 22-25 s -> 16-17 s, a step no slower (3 steps 7.4-10.3 s -> 7.1-8.6 s).
INTERPRET_COMPILER_OPTIONS = known_cpu_compile_options(
    {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
     "xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1})


@functools.lru_cache(maxsize=None)
def _deviceless_devices(topology: str):
    try:
        return deviceless_topology_devices(topology)
    except Exception as e:  # libtpu missing or topology unknown: say which
        raise TargetError(f"cannot create deviceless topology '{topology}': {str(e).splitlines()[0]}") from None


_PROFILES_DMA_KERNELS = libtpu_profiles_dma_kernels()  # the installed libtpu's (tpumk.compat)
TARGETS: dict[str, Target] = {
    # v5e's static profile crashes inside libtpu 0.0.52 on kernels with DMAs (TPU_FACTS 3).
    "v5e": Target("v5e", "v5e", "v5e:2x2", "TPU v5 lite", static_profile=False),
    "v5p": Target("v5p", "v5p", "v5p:2x2x1", "TPU v5", static_profile=False),
    "v6e": Target("v6e", "v6e", "v6e:2x2", "TPU v6 lite", static_profile=_PROFILES_DMA_KERNELS),
    "tpu7x": Target("tpu7x", "7x", "tpu7x:2x2x1", "TPU7x", static_profile=_PROFILES_DMA_KERNELS),
    "cpu": Target("cpu", "7x", None, None, static_profile=False, interpret=True),
}


# Other names a chip goes by (its code name), for the "did you mean" of an unknown target.
CODE_NAMES = {"ironwood": "tpu7x", "trillium": "v6e"}


def _spelling(name: str) -> str:
    """A target name as people write it, reduced to what tells chips apart: `v7x`, `TPU7x`,
    `tpu-7x`, `tpu7x-8` -> `7x`; `v5litepod-16`, `TPU v5 lite` (a device kind) -> `5lite`."""
    s = re.sub(r"-\d+$", "", name.strip().lower())  # an accelerator type's core count (v6e-8)
    s = re.sub(r"[^a-z0-9]", "", s).replace("tpu", "").replace("pod", "")
    return s.removeprefix("v")


def _near_target(name: str) -> str:
    """' (did you mean 'tpu7x'?)' for a name that spells a target another way (v7x, v5litepod,
    Trillium), or is close to one; '' otherwise."""
    if not isinstance(name, str):
        return ""
    spelled = _spelling(name)
    for t in TARGETS.values():
        if spelled and spelled in {_spelling(t.name), _spelling(t.chip), _spelling(t.device_kind or "")}:
            return f" (did you mean '{t.name}'?)"
    if name.strip().lower() in CODE_NAMES:
        return f" (did you mean '{CODE_NAMES[name.strip().lower()]}'?)"
    return did_you_mean(name, list(TARGETS))


def get_target(name: str) -> Target:
    """A target by name, matched case-insensitively (TPU7x is tpu7x, V6E is v6e); an unknown
    name that spells a target another way (`v7x`, `v5litepod-8`, `Trillium`) is refused with
    the target it means."""
    if name in TARGETS:
        return TARGETS[name]
    if isinstance(name, str) and name.lower() in TARGETS:
        return TARGETS[name.lower()]
    raise TargetError(f"unknown target '{name}'{_near_target(name)} (targets: {', '.join(TARGETS)})")


def attached_target() -> Target | None:
    """The TPU target physically attached to this process, if any."""
    for t in TARGETS.values():
        if not t.interpret and t.attached_device() is not None:
            return t
    return None


# Deviceless topologies per chip, smallest first (each checked to compile an in-kernel collective,
# TPU_FACTS 8, and listed by libtpu 0.0.52 with the device count in the comment). A TPU7x chip
# is two devices (TensorCores); the other chips here are one device per chip.
TOPOLOGIES: dict[str, tuple[tuple[str, int], ...]] = {
    "7x": (("tpu7x:1x1x1", 2), ("tpu7x:2x2x1", 8), ("tpu7x:2x2x2", 16), ("tpu7x:4x4x1", 32),
           ("tpu7x:4x4x2", 64), ("tpu7x:4x4x4", 128)),
    "v6e": (("v6e:2x2", 4), ("v6e:2x4", 8), ("v6e:4x4", 16), ("v6e:4x8", 32), ("v6e:8x8", 64)),
    "v5e": (("v5e:2x2", 4), ("v5e:2x4", 8), ("v5e:4x4", 16), ("v5e:4x8", 32), ("v5e:8x8", 64)),
    "v5p": (("v5p:2x2x1", 4), ("v5p:2x2x2", 8), ("v5p:2x2x4", 16), ("v5p:2x4x4", 32), ("v5p:4x4x4", 64)),
}


def topology_for(target: Target, n: int) -> str | None:
    """The deviceless topology an n-device build of `target` compiles for: the target's own for
    one device (unchanged single-device builds), else the smallest that holds n devices (so
    TPU7x `--devices 8` is tpu7x:2x2x1, 32 is tpu7x:4x4x1). None for the cpu target."""
    if target.interpret:
        return None
    if n <= 1:
        return target.topology
    for name, count in TOPOLOGIES[target.chip]:
        if count >= n:
            return name
    most = TOPOLOGIES[target.chip][-1]
    raise TargetError(f"{target.name}: {n} devices asked; the largest topology tpumk knows, {most[0]}, "
                      f"has {most[1]}")


def mesh_devices(target: Target, n: int) -> list:
    """n devices of `target` for a 1-D tensor-parallel mesh, in device order: the attached TPUs of
    its kind when there are n of them, else the stand-ins of `topology_for(target, n)` (its first n).
    TPU7x lists each chip's two TensorCores as devices 2r and 2r+1, so n TensorCores fill n/2
    whole chips when n is even. The cpu target gives host CPU devices (as many as
    XLA_FLAGS=--xla_force_host_platform_device_count made before jax was imported)."""
    import jax

    if n < 1:
        raise TargetError(f"{target.name}: a mesh needs at least 1 device, not {n}")
    if target.interpret:
        devs = jax.devices("cpu")
        where = "host CPU devices (set XLA_FLAGS=--xla_force_host_platform_device_count before importing jax)"
    else:
        try:
            devs = [d for d in jax.devices("tpu") if d.device_kind == target.device_kind]
        except RuntimeError:
            devs = []
        where = "attached devices"
        if len(devs) < n:
            topology = topology_for(target, n)
            devs = list(_deviceless_devices(topology))
            where = f"devices in topology '{topology}'"
    if len(devs) < n:
        raise TargetError(f"{target.name}: {n} devices asked, {len(devs)} {where}")
    return list(devs[:n])


def routes_any_offset(target: Target) -> bool:
    """Whether remote DMAs reach any device offset; TPU v5e routes only power-of-two offsets
    (TPU_FACTS 8)."""
    return target.chip != "v5e"


def ensure_host_devices(n: int) -> None:
    """Make (at least) n host CPU devices for the `cpu` target's n-device steps: sets
    `jax_num_cpu_devices` while JAX has not started its backends, and sizes XLA's CPU thread
    pool (NPROC) so n interpreted kernels blocked on each other's semaphores cannot starve
    the pool (with one thread per core, 2 here, 8 devices hang). Once the backends are up
    the count is fixed: fewer devices than n is refused with one line."""
    import os

    import jax

    from tpumk.compat import jax_backends_initialised

    if n <= 1:
        return
    if not jax_backends_initialised():
        if int(os.environ.get("NPROC", "0") or 0) < 4 * n:
            os.environ["NPROC"] = str(4 * n)
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    have = len(jax.devices("cpu"))
    if have < n:
        raise TargetError(f"cpu: {n} devices asked, this process has {have} host CPU devices (JAX started with "
                          f"fewer; set XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting)")
