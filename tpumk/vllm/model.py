"""`TpumkForCausalLM`: the model class the plugin registers with vLLM's TPU backend (tpu_inference).

vLLM's runner builds it abstractly (`nnx.eval_shape`), calls `load_weights`, then runs
`__call__` inside its jitted step with its own KV cache (one array per layer, tpumk.vllm.kv)
and attention metadata, and `compute_logits` on the rows it picks. This class:

- decode-only batches (one new token per live request): tpumk's megakernel step
  (`tpumk.vllm.steps.decode_step`), from the artifact or the start-up build the `Runtime` holds;
- any other batch (prefill chunks, prefill mixed with decode): the pure-JAX reference layers
  on the same weights (`tpumk.vllm.steps.ragged_step`);
- the choice is a `lax.cond` on the metadata (vLLM decides on the host, then traces one program
  per token bucket), and both branches return the logits rows, so `compute_logits` passes them on.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from tpumk.vllm import kv, steps
from tpumk.vllm.runtime import Runtime, ServingConfigError

logger = logging.getLogger("vllm.tpumk")  # under vLLM's logger, so its handlers print it

# TPUMK_VLLM_COUNT_STEPS=1: every step logs which program ran it (a host callback per step, so
# off by default; the end-to-end test reads these lines to show the megakernel decoded)
COUNT_STEPS = os.environ.get("TPUMK_VLLM_COUNT_STEPS") == "1"
_COUNTS = {"decode": 0, "ragged": 0}


def _count(kind: str, num_reqs) -> None:
    _COUNTS[kind] += 1
    what = "megakernel decode step" if kind == "decode" else "JAX prefill/mixed step"
    logger.info("tpumk plugin: %s #%d (%d requests)", what, _COUNTS[kind], int(num_reqs))


def _cache_kernel(vllm_config) -> dict:
    """What decides the layout of the KV cache vLLM's TPU runner allocates (tpu_inference 0.32):
    its attention backend and its batched-RPA switch (Runtime refuses all but RPA v3's)."""
    from tpu_inference import envs
    from tpu_inference.layers.common.attention_backend import attention_backend_name

    return {"attention_backend": attention_backend_name(vllm_config), "batched_rpa": bool(envs.USE_BATCHED_RPA_KERNEL)}


class TpumkForCausalLM(nnx.Module):
    """A checkpoint tpumk supports, served by vLLM with its decode steps in tpumk's megakernel."""

    def __init__(self, vllm_config, rng_key: jax.Array | None = None, mesh=None):
        from tpumk.errors import TpumkError

        try:
            if mesh is not None and mesh.size != 1:  # before any build: a cheap refusal first
                raise ServingConfigError(f"tpumk plugin: a mesh of {mesh.size} devices: expected 1 (the plugin runs "
                                         "one device in this release)")
            self.runtime = Runtime.from_vllm_config(vllm_config, **_cache_kernel(vllm_config))
        except TpumkError as e:  # one line in vLLM's log, then the engine refuses to start
            logger.error("%s", e)
            raise ServingConfigError(str(e)) from None
        rt = self.runtime
        logger.info("tpumk plugin: %s, decode steps from %s (batch %d, context %d)", rt.cfg.name, rt.source,
                    rt.plan.batch, rt.plan.context)
        from tpumk.kernel.layout import packed_specs
        from tpumk.model.weights import random_params

        # shapes only (the runner builds this under nnx.eval_shape); load_weights fills them
        self.params = nnx.Param(jax.eval_shape(lambda: random_params(rt.cfg, seed=0)))
        self.packed = nnx.Param(packed_specs(rt.plan))

    def load_weights(self, rng_key: jax.Array | None = None) -> None:
        params, packed = self.runtime.load_params()
        # the packed tree reuses some of params' arrays (the embedding) and the runner donates
        # the model's state, which must not hold one buffer twice: those leaves get their own copy
        shared = {id(a) for a in jax.tree.leaves(params)}
        self.params.set_value(jax.tree.map(jnp.asarray, params))
        self.packed.set_value(jax.tree.map(lambda a: jnp.array(a, copy=True) if id(a) in shared else jnp.asarray(a),
                                           packed))

    def __call__(self, kv_caches, input_ids, attention_metadata, inputs_embeds=None, input_positions=None,
                 layer_name_to_kvcache_index=None, lora_metadata=None, intermediate_tensors=None,
                 is_first_rank: bool = True, is_last_rank: bool = True, *args):
        rt, md = self.runtime, attention_metadata
        cfg = rt.cfg
        where = dict(layer_name_to_kvcache_index or ())
        index = [where.get(f"layer.{i}", i) for i in range(cfg.num_layers)]
        caches = [kv_caches[j] for j in index]
        for c in caches:  # traced once per bucket: the shapes are static here
            problem = kv.layout_problem(c.shape, c.dtype, cfg.num_kv_heads, cfg.head_dim, rt.block_size)
            if problem:  # a layout start-up did not foresee: one line, not a reshape error deep in kv.py
                logger.error("tpumk plugin: %s", problem)
                raise ServingConfigError(f"tpumk plugin: {problem}")
        slots = md.seq_lens.shape[0]
        tables = md.block_tables.reshape(slots, -1)
        qsl, seq_lens, positions = md.query_start_loc, md.seq_lens, md.input_positions
        num_reqs = md.request_distribution[2]
        live = jnp.arange(slots) < num_reqs
        one_token = (qsl[1:] - qsl[:-1]) == 1
        decode_only = jnp.all(one_token | ~live)
        params, packed = self.params.get_value(), self.packed.get_value()

        def decode(caches):
            if COUNT_STEPS:
                jax.debug.callback(_count, "decode", num_reqs)
            return steps.decode_step(rt.step, packed, cfg, rt.plan_shape, caches, input_ids, positions, qsl, seq_lens,
                                     tables, num_reqs, rt.block_size)

        def ragged(caches):
            if COUNT_STEPS:
                jax.debug.callback(_count, "ragged", num_reqs)
            return steps.ragged_step(params, cfg, caches, input_ids, positions, qsl, tables, num_reqs, rt.block_size,
                                     rt.max_model_len)

        caches, rows = jax.lax.cond(decode_only, decode, ragged, caches)
        out = list(kv_caches)
        for j, c in zip(index, caches):
            out[j] = c
        return out, rows, [], None

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        # __call__ returns each row's logits already (the megakernel ends with the lm_head)
        return hidden_states
