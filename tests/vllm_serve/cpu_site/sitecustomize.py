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
- `tpu_inference.layers.common.attention_interface.ragged_paged_attention` (and its head_dim 64
  twin): the Pallas kernel the EAGLE-3 drafter's attention calls -> the same attention in pure JAX
  on the same cache layout (`_ragged_paged_attention`);
- `tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer._propose`: jitted with TPU-only compiler
  options -> the same function jitted without them.
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


def _ragged_paged_attention(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *, sm_scale=1.0,
                            sliding_window=None, soft_cap=None, use_causal_mask=True, update_kv_cache=True,
                            **_unused):
    """tpu_inference's ragged paged attention (kernels/ragged_paged_attention/v3) in pure JAX, on
    its cache layout [pages, page_size, 2 x kv_heads / packing, packing, head_dim] (K of head h at
    row 2h, V at 2h + 1): the Pallas kernel neither compiles on the CPU nor runs in interpret mode
    under jax 0.11. Only the EAGLE-3 drafter tpu_inference runs beside the plugin calls it (the
    plugin's own model runs its own attention). Each token attends to its request's cached rows
    up to its position (kv_lens: the request's length including this step's tokens)."""
    import jax
    import jax.numpy as jnp

    shape = kv_cache.shape
    pages, page_size, head_dim = shape[0], shape[1], shape[-1]
    cache = kv_cache.reshape(pages, page_size, -1, head_dim)
    t, n, d = q.shape
    kh = k.shape[1]
    s = kv_lens.shape[0]
    tables = page_indices.reshape(s, -1)
    i = jnp.arange(t)
    req = jnp.clip(jnp.searchsorted(cu_q_lens[1:], i, side="right"), 0, s - 1)
    valid = i < cu_q_lens[distribution[2]]
    pos = kv_lens[req] - (cu_q_lens[req + 1] - cu_q_lens[req]) + (i - cu_q_lens[req])
    if update_kv_cache:
        rows = jnp.stack([k, v], axis=2).reshape(t, 2 * kh, d).astype(cache.dtype)
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, head_dim - d)))
        page = jnp.where(valid, tables[req, jnp.clip(pos, 0) // page_size], pages)  # past the pool: dropped
        cache = cache.at[page, jnp.clip(pos, 0) % page_size, :2 * kh].set(rows, mode="drop")
    ctx = cache[tables[req]].reshape(t, -1, cache.shape[2], head_dim)  # [T, keys, 2 x heads, head_dim]
    keys, vals = ctx[:, :, 0:2 * kh:2, :d], ctx[:, :, 1:2 * kh:2, :d]
    qg = q.reshape(t, kh, n // kh, d).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys.astype(jnp.float32)) * sm_scale
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(keys.shape[1])
    mask = key_pos[None] < kv_lens[req][:, None]
    if use_causal_mask:
        mask &= key_pos[None] <= pos[:, None]
    if sliding_window:
        mask &= key_pos[None] > pos[:, None] - sliding_window
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, vals.astype(jnp.float32)).reshape(t, n, d)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype), cache.reshape(shape)


def _proposer_without_tpu_options(cls):
    """Eagle3Proposer with its `_propose` jitted as tpu_inference jits it, without the TPU-only
    compiler options it names (XLA:CPU rejects them)."""
    import jax

    cls._propose = jax.jit(cls._propose.__wrapped__, donate_argnames=("kv_caches",), out_shardings=(None, None),
                           static_argnums=(0, 7, 8))
    return cls


# module -> {name: wrapper(original) -> replacement}
WRAPS = {"tpu_inference.utils": {"device_array": _copying_device_array},
         "tpu_inference.spec_decode.jax.eagle3": {"Eagle3Proposer": _proposer_without_tpu_options}}

PATCHES = {
    "tpu_inference.utils": {"make_optimized_mesh": _mesh, "hbm_usage_bytes": _hbm_usage_bytes,
                            "get_device_hbm_limit": lambda: _HBM},
    "tpu_inference.layers.common.attention_interface": {"ragged_paged_attention": _ragged_paged_attention,
                                                        "ragged_paged_attention_hd64": _ragged_paged_attention},
    "tpu_inference.spec_decode.jax.eagle3": {},
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
