"""Test-only patches that let vLLM's TPU backend (tpu_inference 0.32) run on this CPU host.

On PYTHONPATH only for the processes tests/vllm_serve/test_vllm_serve.py starts (never
installed): vLLM picks its TPU platform because `import libtpu` succeeds, then stops where it
asks a TPU about itself. Each patch replaces one function of the module that defines it, right
after that module first executes, so modules importing the name later bind the replacement:

- `tpu_inference.utils.make_optimized_mesh`: sorts devices by `.coords`, which CPU devices lack
  -> a plain mesh of the given devices in order;
- `tpu_inference.utils.hbm_usage_bytes` / `get_device_hbm_limit`: TPU memory stats and the chip
  kind's HBM -> fixed figures (the test also caps the KV blocks with --num-gpu-blocks-override);
- `tpu_inference.models.common.compiler_options`'s step / sampling options: TPU-only XLA flags
  that XLA:CPU rejects -> none;
- `tpu_inference.utils.device_array` (the runner's host -> device copies of each step's inputs):
  numpy arguments copied first. On the CPU, JAX's `device_put` of a numpy array at a 64-byte
  aligned address aliases its memory (checked under jax 0.11.2; at other addresses it copies),
  and tpu_inference 0.32 passes views of a buffer it rewrites for the next step
  (`DeviceBuffer.build`: the step's input ids, query starts, KV lengths, block tables in one
  reused int32 buffer). In a process where numpy's allocator put that buffer on such an
  address, a step still running when the host prepared the next (the 4-device interpreted
  megakernel, about 0.4 s) read some of the next step's metadata: a wrong token in a few runs
  of `--tensor-parallel-size 4` (test_vllm_serve.py's test_cpu_site_keeps_a_step_s_inputs_...).
"""

import importlib.abc
import importlib.machinery
import sys

_HBM = 8 << 30


def _mesh(axis_shapes, axis_names, *, devices=None):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    return Mesh(np.asarray(devices).reshape(tuple(axis_shapes)), tuple(axis_names))


def _hbm_usage_bytes(devices):
    return [(0, _HBM) for _ in devices]


def _no_options():
    return {}


def _copying_device_array(original):
    def device_array(mesh, *args, **kwargs):
        import jax
        import numpy as np

        args = jax.tree.map(lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else a, args)
        return original(mesh, *args, **kwargs)

    return device_array


# module -> {name: wrapper(original) -> replacement}
WRAPS = {"tpu_inference.utils": {"device_array": _copying_device_array}}

PATCHES = {
    "tpu_inference.utils": {"make_optimized_mesh": _mesh, "hbm_usage_bytes": _hbm_usage_bytes,
                            "get_device_hbm_limit": lambda: _HBM},
    "tpu_inference.models.common.compiler_options": {"get_step_fn_compiler_options": _no_options,
                                                     "get_sampling_compiler_options": _no_options},
}


class _Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            replacements = dict(PATCHES[name])
            for attr, wrap in WRAPS.get(name, {}).items():
                replacements[attr] = wrap(getattr(module, attr, None))
            for attr, fn in replacements.items():
                if not hasattr(module, attr):
                    raise AttributeError(f"cpu_site: {name}.{attr} no longer exists (tpu_inference changed)")
                setattr(module, attr, fn)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patcher())
