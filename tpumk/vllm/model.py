"""`TpumkForCausalLM`: the model class the plugin registers with vLLM's TPU backend (tpu_inference).

vLLM's runner builds it abstractly (`nnx.eval_shape`), calls `load_weights`, then runs
`__call__` inside its jitted step with its own KV cache and attention metadata, and
`compute_logits` on the rows it picks. Its constructor declares the model's two KV-cache layers to
vLLM (tpumk.vllm.backend), so that cache is two arrays in the megakernel's stacked layout
(tpumk.vllm.kv). This class:

- decode-only batches (one new token per live request): tpumk's megakernel step on those two
  arrays in place (`tpumk.vllm.steps.decode_step`), from the artifact or the start-up build the
  `Runtime` holds;
- any other batch (prefill chunks, prefill mixed with decode): the pure-JAX reference layers
  on the same weights (`tpumk.vllm.steps.ragged_step`);
- a hybrid model (Gated DeltaNet layers): a third declared cache array holds the linear layers'
  state pool (tpumk.vllm.states), which both programs read and write;
- the choice is a `lax.cond` on the metadata (`tpumk.vllm.steps.serve_step`), and both branches
  return the logits rows, so `compute_logits` passes them on.
- with `--speculative-config` method eagle3 (tpumk.vllm.speculative): the verify batches (at most
  k + 1 tokens per request, decode-only batches too) through the megakernel's verify step
  (`tpumk.vllm.steps.verify_step`), any other batch (prefill chunks) through the JAX step; both
  also return the hidden states entering the drafter's target layers (`__call__`'s third value,
  what vLLM's drafter reads) and every token's logits (an artifact has no verify step: every
  batch through the JAX step); the drafter's own KV-cache layer is declared after the model's
  (tpumk.vllm.backend.declare_draft_layer).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from tpumk.vllm import kv, states, steps
from tpumk.vllm.runtime import Runtime, ServingConfigError

logger = logging.getLogger("vllm.tpumk")  # under vLLM's logger, so its handlers print it

# TPUMK_VLLM_COUNT_STEPS=1: every step logs which program ran it (a host callback per step, so
# off by default; the end-to-end test reads these lines to show the megakernel decoded)
COUNT_STEPS = os.environ.get("TPUMK_VLLM_COUNT_STEPS") == "1"
_LOGGED: set = set()  # the state array shapes logged
_COUNTS = {"decode": 0, "verify": 0, "ragged": 0}
STEP_NAMES = {"decode": "megakernel decode step", "verify": "megakernel verify step",
              "ragged": "JAX prefill/mixed step"}


def _count(kind: str, num_reqs) -> None:
    _COUNTS[kind] += 1
    what = STEP_NAMES[kind]
    logger.info("tpumk plugin: %s #%d (%d requests)", what, _COUNTS[kind], int(num_reqs))


def _attention_backend(vllm_config) -> str:
    """The attention backend whose shapes vLLM's TPU runner allocates its KV cache in
    (tpu_inference 0.32; Runtime refuses all but the plugin's own)."""
    from tpu_inference.layers.common.attention_backend import attention_backend_name

    return attention_backend_name(vllm_config)


def _tensor_parallel_devices(vllm_config, mesh) -> list | None:
    """vLLM's mesh's devices along its tensor-parallel ('model') axis, in order, which the
    many-device step runs its 1-D mesh on (None: one device); a mesh that splits anything else
    (data parallel, expert or context axes) is refused."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if mesh is None:
        return None
    shape = dict(mesh.shape)
    if mesh.size != tp or shape.get("model", 1) != mesh.size:
        raise ServingConfigError(f"tpumk plugin: vLLM's mesh {shape}: expected its {tp} devices "
                                 "(tensor_parallel_size) all on its 'model' axis (the megakernel's collectives "
                                 "span one 1-D mesh)")
    return list(mesh.devices.reshape(-1)) if tp > 1 else None


class _Embedding(nnx.Module):
    def __init__(self, spec):
        self.embedding = nnx.Param(spec)


class _EmbeddingForDrafter(nnx.Module):
    """The checkpoint's embedding at `model.embed.embedding`, one of the paths where tpu_inference's
    EAGLE-3 proposer looks for the target's embedding to give a drafter stored without one
    (`Eagle3Proposer.load_model`; speculators drafters share the verifier's)."""

    def __init__(self, spec):
        self.embed = _Embedding(spec)


class TpumkForCausalLM(nnx.Module):
    """A checkpoint tpumk supports, served by vLLM with its decode steps in tpumk's megakernel."""

    def __init__(self, vllm_config, rng_key: jax.Array | None = None, mesh=None):
        from tpumk.errors import TpumkError

        try:
            devices = _tensor_parallel_devices(vllm_config, mesh)  # before any build: a cheap refusal first
            self.runtime = Runtime.from_vllm_config(vllm_config, _attention_backend(vllm_config), devices)
        except TpumkError as e:  # one line in vLLM's log, then the engine refuses to start
            logger.error("%s", e)
            raise ServingConfigError(str(e)) from None
        rt = self.runtime
        logger.info("tpumk plugin: %s, decode steps from %s (batch %d, context %d), weights held %s", rt.cfg.name,
                    rt.source, rt.plan.batch, rt.plan.context,
                    "once (packed)" if rt.holds_weights_once else "twice (packed and reference layout)")
        from tpumk.model.weights import random_params
        from tpumk.vllm.backend import declare_layers

        # before vLLM asks the runner for its KV cache spec: two stacked arrays, K and V (MLA: the latent one)
        declare_layers(vllm_config, rt.kv_layers, rt.kv_width, rt.kv_names, rt.devices)
        if rt.state_layers:  # a hybrid: its linear layers' state pool, one slot's entry per block (tpumk.vllm.states)
            declare_layers(vllm_config, rt.state_layers, rt.state_width, (states.STATE_LAYER,))
        if rt.taps:  # eagle3: vLLM's drafter's own KV-cache layer, after the model's (it reads kv_caches[-1])
            from tpumk.vllm.backend import declare_draft_layer

            declare_draft_layer(vllm_config)
            from tpumk.model.ops import jnp_dtype

            # its own copy (the runner donates the state, which must not hold one buffer twice)
            self.model = _EmbeddingForDrafter(jax.ShapeDtypeStruct((rt.cfg.vocab_size, rt.cfg.hidden_size),
                                                                   jnp_dtype(rt.plan.whole_model)))
        # shapes only (the runner builds this under nnx.eval_shape); load_weights fills them. With
        # floating-point weights the device holds the packed ones only (Runtime.holds_weights_once)
        self.params = nnx.Param({} if rt.holds_weights_once else
                                jax.eval_shape(lambda: random_params(rt.plan.whole_model, seed=0)))
        self.packed = nnx.Param(rt.packed_shapes())

    def load_weights(self, rng_key: jax.Array | None = None) -> None:
        params, packed = self.runtime.load_params()
        params = {} if params is None else params
        # the packed tree reuses some of params' arrays (the embedding) and the runner donates
        # the model's state, which must not hold one buffer twice: those leaves get their own copy
        shared = {id(a) for a in jax.tree.leaves(params)}
        packed = jax.tree.map(lambda a: jnp.array(a, copy=True) if id(a) in shared else jnp.asarray(a), packed)
        params = jax.tree.map(jnp.asarray, params)
        rt = self.runtime
        # on vLLM's mesh: each device its part of the packed weights (a quantized plan: the JAX path's whole too)
        if rt.devices > 1:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            from tpumk.kernel.megakernel import step_mesh
            from tpumk.plan.sharding import MESH_AXIS

            m = step_mesh(rt.plan, rt.mesh_devices)
            packed = {key: jax.device_put(val, NamedSharding(m, P() if key == "embed" else P(MESH_AXIS)))
                      for key, val in packed.items()}
            params = jax.device_put(params, NamedSharding(m, P()))
        self.params.set_value(params)
        self.packed.set_value(packed)
        if rt.taps:  # the embedding's checkpoint rows and lanes (a lane padded run model's are wider)
            cfg = rt.cfg
            rows = packed["embed"][:cfg.vocab_size, :cfg.hidden_size]
            self.model.embed.embedding.set_value(jnp.array(rows, self.model.embed.embedding.get_value().dtype,
                                                           copy=True))

    def __call__(self, kv_caches, input_ids, attention_metadata, inputs_embeds=None, input_positions=None,
                 layer_name_to_kvcache_index=None, lora_metadata=None, intermediate_tensors=None,
                 is_first_rank: bool = True, is_last_rank: bool = True, *args):
        rt, md = self.runtime, attention_metadata
        where = dict(layer_name_to_kvcache_index or ())
        run = rt.plan.whole_model
        ik, iv = where.get(kv.K_LAYER, 0), where.get(kv.V_LAYER, 1) if kv.V_LAYER in rt.kv_names else None
        k = kv_caches[ik]
        # an MLA model's cache is the latent array alone: the kernel's V is an array of no lanes
        v = kv_caches[iv] if iv is not None else jnp.zeros(k.shape[:3] + (0,), k.dtype)
        for c in (k, v) if iv is not None else (k,):  # traced once per bucket: the shapes are static here
            problem = kv.layout_problem(c.shape, c.dtype, rt.kv_layers, rt.kv_width, rt.block_size,
                                        jnp.dtype(run.dtype), rt.devices)
            if problem:  # a layout start-up did not foresee: one line, not a shape error deep in the kernel
                logger.error("tpumk plugin: %s", problem)
                raise ServingConfigError(f"tpumk plugin: {problem}")
        state = None
        if rt.state_layers:  # a hybrid's state array: [linear layers, blocks, block size, state width]
            state = kv_caches[where.get(states.STATE_LAYER, len(rt.kv_names))]
            problem = kv.layout_problem(state.shape, state.dtype, rt.state_layers, rt.state_width, rt.block_size,
                                        jnp.dtype(run.dtype))
            if problem or state.shape[1] != k.shape[1]:
                problem = problem or f"vLLM's state array has {state.shape[1]} blocks, its K array {k.shape[1]}"
                logger.error("tpumk plugin: %s", problem)
                raise ServingConfigError(f"tpumk plugin: {problem}")
            if tuple(state.shape) not in _LOGGED:  # traced once per token bucket: logged once
                _LOGGED.add(tuple(state.shape))
                logger.info("tpumk plugin: linear-attention state pool: %s %s (a slot per block: each request's "
                            "first block's)", list(state.shape), jnp.dtype(state.dtype).name)
        try:
            step = rt.step_for(k.shape[1])
        except ServingConfigError as e:
            logger.error("%s", e)
            raise
        verify = None
        if rt.verify_plan is not None:  # eagle3: the megakernel's verify step with the drafter's taps
            verify = (rt.verify_step_for(k.shape[1]), rt.verify_plan.q_len)
        slots = md.seq_lens.shape[0]
        num_reqs = md.request_distribution[2]

        def on_step(kind):
            jax.debug.callback(_count, kind, num_reqs)

        cache, rows, *aux = steps.serve_step(step, self.packed.get_value(), self.params.get_value(), run,
                                              rt.plan_shape, k, v, input_ids, md.input_positions, md.query_start_loc,
                                              md.seq_lens, md.block_tables.reshape(slots, -1), num_reqs,
                                              rt.block_size, rt.max_model_len, on_step if COUNT_STEPS else None,
                                              rt.unpack if rt.holds_weights_once else None, rt.devices, rt.taps,
                                              verify, state)
        out = list(kv_caches)
        k, v = cache[:2]
        if state is not None:
            out[where.get(states.STATE_LAYER, len(rt.kv_names))] = cache[2]
        out[ik] = k
        if iv is not None:
            out[iv] = v
        # eagle3: the drafter's inputs, each [T, hidden] at the checkpoint's width (a lane padded run
        # model's extra lanes are zeros the drafter's fc does not take)
        taps = [a[:, :rt.cfg.hidden_size] for a in aux[0]] if aux else []
        return out, rows, taps, None

    def compute_logits(self, hidden_states: jax.Array) -> jax.Array:
        # __call__ returns each row's logits already (the megakernel ends with the lm_head)
        return hidden_states
