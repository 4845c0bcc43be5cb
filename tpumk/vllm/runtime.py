"""What the vLLM plugin serves with: the model, the decode step and its checks (no vLLM import).

`Runtime.from_vllm_config(vllm_config)` reads the served checkpoint's config.json with tpumk's
reader and takes the megakernel step from, in this order:

1. an artifact (`tpumk export`) its operator names: `TPUMK_VLLM_ARTIFACT`, else the key
   `tpumk_artifact` of vLLM's `--hf-overrides` (`'{"tpumk_artifact": "artifacts/..."}'`), never
   the checkpoint's own config.json: the checkpoint does not choose the program that runs (a
   config.json naming it is refused, and so is the key reaching vLLM's model config any other way,
   e.g. through --hf-config-path's file). Its `jax.export` program is called inside vLLM's jitted
   step (a serialized executable cannot be), so it loads under the jax that exported it or a newer
   one (`tpumk.load(path, use="exported")` refuses the rest);
2. else a build on start-up for the attached TPU (or, with JAX on the CPU, the `cpu` target's
   kernel in Pallas' discharge interpreter), batch = vLLM's max_num_seqs, context = max_model_len
   rounded up to whole pages of vLLM's block size (the kernel reads vLLM's block tables as its
   page tables), `TPUMK_VLLM_QUANT` (default `none`); at vLLM's tensor_parallel_size N the
   N-device kernel on vLLM's mesh (docs/serving-vllm.md, "Tensor parallel"). With EAGLE-3
   (tpumk.vllm.speculative) the build also plans the verify step, the same shapes at q_len
   num_speculative_tokens + 1 writing out the drafter's taps (`verify_plan`; an artifact has none:
   its verify batches run the JAX step).

Every configuration the plugin cannot serve correctly raises `ServingConfigError` with one line
that names the setting and what was expected, before any weight is read: the server then refuses
to start rather than serve other tokens. Refused in this round: an artifact for another model,
a smaller batch or context than vLLM's, another q_len or several devices; sparse-attention MLA
(its indexer's key cache is not in vLLM's cache), Muse Spark's embedding norm and gated residuals
(the plugin's prefill does not run them), vLLM's own quantization (a checkpoint's stored
quantized weights too) or KV-cache dtype, pipeline / data parallelism, tensor parallelism that
does not give each device its own KV heads (or with an artifact), speculative decoding other than
EAGLE-3 (tpumk.vllm.speculative), a hybrid model's linear layers beside MLA (Kimi Linear), at
tensor parallel > 1, with prefix caching, speculative decoding or an artifact (tpumk.vllm.states),
an attention backend other than the plugin's own `tpumk` (the only one that allocates the kernel's
stacked cache, tpumk.vllm.kv), an artifact whose page size is not vLLM's block size, and sizes
vLLM should never pass (max_model_len, max_num_seqs or block_size below 1). Sliding-window layers
and attention sinks are served (docs/serving-vllm.md, "Sliding windows and attention sinks"),
MLA on one stacked latent array ("MLA: the latent cache"), and Gated DeltaNet hybrids (Qwen3-Next,
Qwen3.5) with their state pool in one more cache array ("Linear-attention hybrids").
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from tpumk.errors import ServingConfigError, TpumkError  # (ServingConfigError: imported from here too)

ARTIFACT_ENV = "TPUMK_VLLM_ARTIFACT"
QUANT_ENV = "TPUMK_VLLM_QUANT"
ARTIFACT_KEY = "tpumk_artifact"
BACKEND = "tpumk"  # the attention backend the plugin registers with tpu_inference (tpumk.vllm.backend)


def _dtype_name(dtype: Any) -> str:
    """vLLM's model dtype (a torch dtype, a jnp dtype or a string) as tpumk's name."""
    name = getattr(dtype, "name", None) or str(dtype)
    return name.removeprefix("torch.")


def _first_difference(a: dict, b: dict) -> str:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"{k} = {a.get(k)!r} in the artifact, {b.get(k)!r} in the checkpoint"
    return "the same fields"


@dataclass(frozen=True, eq=False)  # compared by identity: flax keeps it in the module's static graph
class Runtime:
    model_dir: Path
    cfg: Any  # tpumk ModelConfig of the served checkpoint, in vLLM's dtype
    plan: Any
    step: Callable  # traceable: (packed, tokens, positions, KVCache) -> (logits, KVCache), plan.num_pages pages
    source: str  # "artifact <path>" or "built on start-up for <target>"
    block_size: int  # vLLM's, which is the plan's page size
    max_model_len: int
    fixed_pages: int | None  # an artifact's program takes exactly this many pages; a build: any
    mesh_devices: tuple | None = None  # tensor parallel: vLLM's mesh's devices, in order (the step's 1-D mesh)
    _pool_steps: dict = field(default_factory=dict)  # a build's step per vLLM pool size (one in practice)
    _unpacker: dict = field(default_factory=dict)  # the Unpacker load_params made (floating-point weights)
    taps: tuple[int, ...] = ()  # eagle3: the target layers whose hidden states vLLM's drafter reads (tpumk.vllm.speculative)
    # eagle3 with a start-up build: the verify plan (q_len = k + 1, the taps) and its step (None:
    # no taps, or an artifact, whose one program is its decode step)
    verify_plan: Any = None
    verify_step: Callable | None = None
    _pool_verify_steps: dict = field(default_factory=dict)

    @property
    def plan_shape(self) -> dict[str, int]:
        p = self.plan
        return {"batch": p.batch, "context": p.context, "page_size": p.page_size}

    @property
    def devices(self) -> int:
        """vLLM's tensor_parallel_size: the devices one decode step spans (the kernel's collectives)."""
        return self.plan.devices

    @property
    def kv_layers(self) -> int:
        """The layers of vLLM's stacked K and V arrays (the kernel's cache's)."""
        return self.plan.whole_model.kv_layers

    @property
    def kv_width(self) -> int:
        """The row width of vLLM's stacked K and V arrays: the kernel's (its run model's, lane padded;
        an MLA model's latent row in whole 128-lane tiles, its K array alone); on many devices the
        whole model's, each device holding its KV heads' share (tpumk.vllm.kv.cache_shape)."""
        a = self.plan.whole_model.attention
        return a.latent_cache_lanes if a.is_mla else a.kv_size

    @property
    def kv_names(self) -> tuple[str, ...]:
        """The KV-cache layers vLLM allocates (tpumk.vllm.kv): K and V, or an MLA model's latent array."""
        from tpumk.vllm import kv

        return kv.layer_names(self.plan.whole_model)

    @property
    def state_layers(self) -> int:
        """A hybrid's linear layers: the first axis of its state array (tpumk.vllm.states); 0 otherwise."""
        return len(self.plan.whole_model.linear_layers) if self.plan.whole_model.linear else 0

    @property
    def state_width(self) -> int:
        """The row width of a hybrid's state array: a block's rows hold one slot's entry (tpumk.vllm.states)."""
        from tpumk.vllm import states

        return states.row_width(self.plan.whole_model, self.block_size)

    def packed_shapes(self) -> dict:
        """ShapeDtypeStructs of the kernel's packed weights: one device's (`packed_specs`), or on
        many each device's stacked on a leading axis and the whole embedding
        (`tpumk.kernel.layout.pack_sharded`)."""
        import jax

        from tpumk.kernel.layout import packed_specs
        from tpumk.model.ops import jnp_dtype

        specs = packed_specs(self.plan)
        if self.devices == 1:
            return specs
        n, model = self.devices, self.plan.whole_model
        out = {key: jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), val)
               for key, val in specs.items() if key != "embed"}
        out["embed"] = jax.ShapeDtypeStruct((model.vocab_size, model.hidden_size), jnp_dtype(model))
        return out

    def step_for(self, num_pages: int) -> Callable:
        """The decode step for vLLM's pool of `num_pages` blocks (known only when vLLM first traces
        the model: it sizes the pool after loading it). The kernel addresses pages by their ids,
        clipped to the pool, so a build re-specialises only its cache operands' shapes
        (`Plan.num_pages`); an artifact's exported program takes exactly its own pool."""
        return self._in_pool(self.plan, self.step, self._pool_steps, num_pages)

    def verify_step_for(self, num_pages: int) -> Callable:
        """The verify step (`verify_plan`) for vLLM's pool of `num_pages` blocks, as `step_for`."""
        return self._in_pool(self.verify_plan, self.verify_step, self._pool_verify_steps, num_pages)

    def _in_pool(self, plan, step: Callable, built: dict, num_pages: int) -> Callable:
        """`step` (of `plan`) when the plan already has vLLM's pool, else the plan's step for that
        pool (`pool_plan`), built once into `built`."""
        if num_pages == plan.num_pages and (plan.linear is None or plan.linear.num_slots == num_pages):
            return step  # `pool_plan(plan, num_pages)` would be `plan` itself
        if self.fixed_pages is not None:
            raise ServingConfigError(f"tpumk plugin: vLLM's KV cache has {num_pages} blocks: the artifact's program "
                                     f"takes exactly {self.fixed_pages} pages (start vLLM with "
                                     f"--num-gpu-blocks-override {self.fixed_pages}, or serve a start-up build)")
        if num_pages not in built:
            built[num_pages] = _decode_step(pool_plan(plan, num_pages), self.mesh_devices)
        return built[num_pages]

    @classmethod
    def from_vllm_config(cls, vllm_config, attention_backend: str = BACKEND, mesh_devices=None) -> Runtime:
        """`attention_backend`: the backend vLLM's TPU runner lays out its KV cache for
        (tpu_inference's `attention_backend_name`; model.py reads it from tpu_inference, which
        this module does not import). `mesh_devices`: vLLM's mesh's devices in order (its
        tensor-parallel axis), which the many-device step runs on; None: jax's first devices."""
        from tpumk.files import is_dir
        from tpumk.model.config import load_hf_config, override_dtype

        mc = vllm_config.model_config
        model_dir = Path(mc.model)
        if not is_dir(model_dir) or not (model_dir / "config.json").is_file():
            raise ServingConfigError(f"tpumk plugin: model {mc.model}: expected a local checkpoint directory with "
                                     "a config.json (download it first)")
        _checkpoint_names_no_artifact(model_dir)  # before the reader, which would refuse the key as a field
        cfg = load_hf_config(model_dir)  # ConfigError / NotSupportedError: one line naming the field
        cfg = cfg.replace(dtype=override_dtype(cfg, _dtype_name(mc.dtype)))
        _check_vllm(vllm_config, cfg)
        from tpumk.vllm.speculative import speculative_taps, verify_len

        taps = speculative_taps(vllm_config, cfg)
        q_len = verify_len(vllm_config) if taps else 1
        _check_cache_layout(attention_backend)
        max_seqs = _positive("max_num_seqs", vllm_config.scheduler_config.max_num_seqs)
        max_len = _positive("max_model_len", mc.max_model_len)
        block_size = _positive("block_size", vllm_config.cache_config.block_size)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        art = _operator_artifact(mc, model_dir)
        if art and cfg.linear:
            raise ServingConfigError(f"tpumk plugin: an artifact ({art}) of a model with linear-attention layers: "
                                     "expected a start-up build (an artifact's program takes its own state pool, "
                                     "not vLLM's blocks)")
        if art and tp != 1:
            raise ServingConfigError(f"tpumk plugin: tensor_parallel_size {tp} with an artifact ({art}): expected a "
                                     "start-up build (an artifact's exported program runs on one device)")
        mesh = tuple(mesh_devices) if tp != 1 and mesh_devices is not None else None
        if art:
            plan, step, source = _from_artifact(art, cfg, max_seqs, max_len, block_size)
        else:
            plan, step, source = _built(cfg, max_seqs, max_len, block_size, tp, mesh)
        verify_plan = verify_step = None
        if taps and not art:  # (eagle3 is served on one device only: tpumk.vllm.speculative)
            verify_plan = _verify_plan(plan, q_len, taps)
            verify_step = _decode_step(verify_plan)
        return cls(model_dir, cfg, plan, step, source, block_size, max_len, plan.num_pages if art else None, mesh,
                   taps=taps, verify_plan=verify_plan, verify_step=verify_step)

    @property
    def holds_weights_once(self) -> bool:
        """True when the device holds only the kernel's packed weights and the JAX path reads its
        reference-layout weights back from them inside the step (tpumk.kernel.unpack: floating-point
        weights, on one device or, at tensor parallel, from every device's packed part); a quantized
        plan holds both layouts (integer codes have no transpose)."""
        from tpumk.kernel.unpack import Unpacker

        return Unpacker.supports(self.plan)

    def load_params(self):
        """The checkpoint's weights: (reference-layout params of the kernel's run model for the
        JAX path, or None when `holds_weights_once`; packed weights for the kernel), in the plan's
        weight formats (a quantized plan quantizes both alike, so prefill and decode run the same
        weights) and widths (a lane padded model's zero lanes: the JAX path reads and writes the
        same cache rows as the kernel)."""
        from tpumk.kernel.layout import pack_sharded, pack_weights
        from tpumk.kernel.unpack import Unpacker
        from tpumk.model.checkpoint import load_checkpoint
        from tpumk.model.quantize import quantize_params, scheme_of
        from tpumk.plan.padding import params_as_run

        _, params = load_checkpoint(self.model_dir, self.cfg.dtype)
        if self.plan.quant != "none" and scheme_of(params) == "none":
            params = quantize_params(self.cfg, params, self.plan.quant)
        run = params_as_run(self.plan, params)
        # many devices: each device's part packed and stacked (pack_sharded reads the checkpoint's widths)
        packed = pack_weights(self.plan, run) if self.devices == 1 else pack_sharded(self.plan, params)
        if not self.holds_weights_once:
            return run, packed
        self._unpacker["weights"] = Unpacker(self.plan, run)
        return None, packed

    def unpack(self, packed) -> dict:
        """The JAX path's reference-layout weights read back from `packed` inside the step
        (`holds_weights_once`; after load_params)."""
        return self._unpacker["weights"](packed)


def pool_plan(plan, num_pages: int):
    """`plan` on vLLM's pool of `num_pages` blocks: its pages, and a hybrid model's state slots
    (one per block: a request's slot is its first block, tpumk.vllm.states)."""
    out = replace(plan, num_pages=num_pages)
    if plan.linear is not None:
        out = replace(out, linear=replace(plan.linear, num_slots=num_pages))
    return out


def _check_vllm(vllm_config, cfg) -> None:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    where = "tpumk plugin"
    # MLA is served on one stacked latent array in the kernel's layout (tpumk.vllm.mla_prefill);
    # a sparse-attention model's indexer keeps a second, index-key cache the plugin does not declare
    if cfg.is_mla and getattr(mc, "use_mla", False):  # (tpu_inference refuses the start first, in its words)
        raise ServingConfigError(f"{where}: model '{cfg.name}' uses MLA and vLLM's own MLA cache is on: start vLLM "
                                 "with VLLM_MLA_DISABLE=1 (the plugin declares the kernel's stacked latent cache "
                                 "itself; vLLM's MLA layout is per layer and refuses --attention-backend tpumk)")
    if cfg.is_mla and int(pc.tensor_parallel_size) != 1:  # the latent rows whole on every device: not split
        raise ServingConfigError(f"{where}: tensor_parallel_size {pc.tensor_parallel_size}: model '{cfg.name}' uses "
                                 "MLA: expected tensor_parallel_size 1 (the plugin serves MLA's latent cache on one "
                                 "device in this release)")
    if cfg.is_mla and cfg.attention.is_sparse:
        raise ServingConfigError(f"{where}: model '{cfg.name}' has sparse attention (index_topk "
                                 f"{cfg.attention.index_topk}); the plugin does not keep its indexer's key cache in "
                                 "vLLM's cache yet (run it with tpumk generate)")
    # sliding-window layers are served: the plugin declares one full-attention cache for every
    # layer (tpumk.vllm.backend), so a window layer keeps all its pages in vLLM's block tables,
    # and the kernel and the ragged prefill apply each layer's window (and sinks) themselves
    # a hybrid's linear layers keep their state pool in one more cache array, a request's slot
    # being its first block (tpumk.vllm.states): what that does not cover is refused
    if cfg.linear and cfg.is_mla:
        raise ServingConfigError(f"{where}: model '{cfg.name}' has linear-attention layers beside MLA (Kimi Linear); "
                                 "the plugin's MLA prefill (tpumk.vllm.mla_prefill) does not run them yet (run it with "
                                 "tpumk generate)")
    if cfg.linear and int(pc.tensor_parallel_size) != 1:
        raise ServingConfigError(f"{where}: tensor_parallel_size {pc.tensor_parallel_size}: model '{cfg.name}' has "
                                 "linear-attention layers: expected 1 (the plugin keeps their state pool on one device)")
    if cfg.linear and getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ServingConfigError(f"{where}: enable_prefix_caching with linear-attention layers (model '{cfg.name}'): "
                                 "expected --no-enable-prefix-caching (a request's state slot is its first block, "
                                 "which a cached prefix would share)")
    if cfg.linear and getattr(vllm_config, "speculative_config", None) is not None:
        raise ServingConfigError(f"{where}: --speculative-config with linear-attention layers (model '{cfg.name}'): "
                                 "expected none (the plugin's verify steps do not roll their state pool back)")
    spark = [f for f, on in (("embed_norm", cfg.embed_norm), ("residual_gates", cfg.residual_gates)) if on]
    if spark:
        raise ServingConfigError(f"{where}: model '{cfg.name}' has {spark[0]} (Muse Spark's parts); the plugin's "
                                 "prefill (tpumk.vllm.steps.ragged_step) does not run it yet (run it with tpumk "
                                 "generate)")
    # tensor parallel is served: the N-device megakernel on vLLM's mesh (_built); the others are not
    for name, v, why in (("pipeline_parallel_size", pc.pipeline_parallel_size, "the megakernel runs every layer"),
                         ("data_parallel_size", getattr(pc, "data_parallel_size", 1),
                          "one decode step spans vLLM's whole mesh")):
        if int(v) != 1:
            raise ServingConfigError(f"{where}: {name} = {v}: expected 1 ({why})")
    if getattr(mc, "quantization", None):
        stored = getattr(mc.hf_config, "quantization_config", None)
        if stored:  # vLLM takes a checkpoint's quantization_config as its --quantization
            from tpumk.files import shown

            method = stored.get("quant_method") if isinstance(stored, dict) else stored
            raise ServingConfigError(f"{where}: the checkpoint's quantization_config (quant_method "
                                     f"{shown(repr(method), 40)}, which vLLM runs as --quantization "
                                     f"{mc.quantization}): expected float weights (the plugin does not serve a "
                                     f"checkpoint's stored quantized weights yet; {QUANT_ENV} quantizes a float "
                                     "checkpoint)")
        raise ServingConfigError(f"{where}: --quantization {mc.quantization}: expected none (tpumk quantizes "
                                 f"through its own formats: {QUANT_ENV} or the artifact's --quant)")
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", cfg.dtype):
        raise ServingConfigError(f"{where}: --kv-cache-dtype {cache_dtype}: expected auto (the model's dtype, "
                                 f"{cfg.dtype})")


def _check_cache_layout(attention_backend: str) -> None:
    """vLLM's runner must allocate the KV cache through the plugin's backend (tpumk.vllm.kv's
    stacked layout, which the kernel reads and writes in place)."""
    if attention_backend != BACKEND:
        raise ServingConfigError(f"tpumk plugin: --attention-backend {attention_backend}: expected {BACKEND} (the "
                                 "megakernel reads and writes vLLM's KV cache in place in its own stacked layout, "
                                 f"which vLLM allocates only with --attention-backend {BACKEND})")


def _positive(name: str, value) -> int:
    """A size vLLM passes (max_model_len, max_num_seqs, block_size) as a positive int, or one line naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ServingConfigError(f"tpumk plugin: {name} {value!r}: expected a positive whole number")
    return int(value)


def _checkpoint_names_no_artifact(model_dir: Path) -> None:
    """A tpumk_artifact in the checkpoint's own config.json is refused rather than followed: a
    downloaded checkpoint must not pick the program a server runs (`_operator_artifact`). Checked
    before tpumk's config reader, which refuses any field it does not model with a line that does
    not say why this one matters."""
    import json

    from tpumk.files import TEXT_LIMIT, read_regular

    try:
        own = json.loads(read_regular(model_dir / "config.json", TEXT_LIMIT))
    except (OSError, ValueError, RecursionError, TpumkError):
        return  # not readable JSON: the reader says why, in one line
    if isinstance(own, dict) and ARTIFACT_KEY in own:
        raise ServingConfigError(f"tpumk plugin: config.json of the checkpoint names {ARTIFACT_KEY}: the artifact is "
                                 f"chosen by the operator ({ARTIFACT_ENV} or --hf-overrides)")


def _operator_artifact(mc, model_dir: Path) -> Path | None:
    """The artifact the server's operator names (TPUMK_VLLM_ARTIFACT, else --hf-overrides'
    tpumk_artifact), None for a start-up build. vLLM merges --hf-overrides into the model's config
    (`hf_config`), so the key there cannot tell who set it: a tpumk_artifact in the checkpoint's
    config.json was refused before (`_checkpoint_names_no_artifact`), and one reaching hf_config
    from anywhere but the overrides is refused rather than followed."""
    from tpumk.files import shown

    where = "tpumk plugin"
    overrides = getattr(mc, "hf_overrides", None)
    overrides = overrides if isinstance(overrides, dict) else {}
    if ARTIFACT_KEY not in overrides and getattr(mc.hf_config, ARTIFACT_KEY, None) is not None:
        raise ServingConfigError(f"{where}: vLLM's model config names {ARTIFACT_KEY}, but not through "
                                 f"--hf-overrides: the artifact is chosen by the operator ({ARTIFACT_ENV} or "
                                 "--hf-overrides)")
    if ARTIFACT_KEY in overrides:
        art = overrides[ARTIFACT_KEY]
        if not isinstance(art, str) or not art:
            raise ServingConfigError(f"{where}: --hf-overrides {ARTIFACT_KEY} = {shown(repr(art), 80)}: expected a "
                                     "non-empty string, the path of a `tpumk export` artifact directory")
    art = os.environ.get(ARTIFACT_ENV) or overrides.get(ARTIFACT_KEY)
    return Path(art) if art else None


def _check_shape(where: str, plan, max_seqs: int, max_len: int, block_size: int) -> None:
    if plan.batch < max_seqs:
        raise ServingConfigError(f"{where}: batch {plan.batch} < vLLM's max_num_seqs {max_seqs}: start vLLM with "
                                 f"--max-num-seqs {plan.batch} or export with --batch {max_seqs}")
    if plan.context < max_len:
        raise ServingConfigError(f"{where}: context {plan.context} < vLLM's max_model_len {max_len}: start vLLM "
                                 f"with --max-model-len {plan.context} or export with a larger --context")
    if plan.page_size != block_size:
        raise ServingConfigError(f"{where}: page size {plan.page_size} != vLLM's block size {block_size}: start vLLM "
                                 f"with --block-size {plan.page_size} or export with --page-size {block_size} (the "
                                 "kernel reads vLLM's block tables as its page tables)")
    if plan.q_len != 1:
        raise ServingConfigError(f"{where}: q_len {plan.q_len}: expected 1 (a decode step of one token per request)")
    if plan.devices != 1:
        raise ServingConfigError(f"{where}: {plan.devices} devices: expected 1 (an artifact's exported program runs "
                                 "one device)")
    if plan.attention.kv_dtype:
        raise ServingConfigError(f"{where}: built with --kv-dtype {plan.attention.kv_dtype}: expected the model-dtype "
                                 "cache (vLLM's KV blocks are not in tpumk's packed 1-byte page layout)")


def _from_artifact(path: Path, cfg, max_seqs: int, max_len: int, block_size: int):
    from tpumk.export.artifacts import load

    step = load(path, use="exported", check_inputs=False)  # ArtifactError: one line (stack, files, signature)
    where = f"tpumk plugin: artifact {path}"
    if step.config != cfg:
        raise ServingConfigError(f"{where} was built for model '{step.config.name}', not the served checkpoint's: "
                                 f"{_first_difference(step.config.to_dict(), cfg.to_dict())}")
    _check_shape(where, step.plan, max_seqs, max_len, block_size)
    return step.plan, step.program, f"artifact {path} ({step.kind})"


def _decode_step(plan, mesh_devices=None):
    """The plan's step as the plugin calls it: a jit nested in vLLM's step; one device on the CPU:
    the discharge interpreter (portable: plain XLA ops, no host callbacks inside vLLM's
    program); many devices: the TPU interpreter (its collectives), on vLLM's mesh, reading the
    K and V arrays in vLLM's tensor-parallel layout (tpumk.vllm.kv.cache_shape)."""
    from tpumk.kernel.megakernel import make_decode_step

    if plan.devices == 1:
        return make_decode_step(plan, nested=True, portable=plan.target.interpret)
    return make_decode_step(plan, nested=True, mesh_devices=None if mesh_devices is None else list(mesh_devices),
                            cache_split="rows")


def _verify_plan(plan, q_len: int, taps: tuple[int, ...]):
    """The decode plan's build (batch, context, page size, target, quant) as a verify step of
    `q_len` tokens per request that also writes the hidden states entering the `taps` layers."""
    from tpumk.errors import PlanError
    from tpumk.plan.plan import make_plan

    try:
        return make_plan(plan.spec.replace(q_len=q_len, taps=taps))
    except PlanError as e:
        raise ServingConfigError(f"tpumk plugin: --speculative-config num_speculative_tokens {q_len - 1}: "
                                 f"{e}") from None


def _check_sharding(plan, tp: int) -> None:
    """The plugin's prefill writes each KV head once, in its device's rows (tpumk.vllm.kv):
    a sharding that repeats KV heads over devices, or pads a device's heads, is refused."""
    sh, model = plan.sharding, plan.whole_model
    where = f"tpumk plugin: tensor_parallel_size {tp}"
    if sh.kv_replicas != 1:
        raise ServingConfigError(f"{where}: model '{model.name}' has {model.num_kv_heads} KV heads, which {tp} devices "
                                 f"would hold {sh.kv_replicas} times each: expected a divisor of num_kv_heads "
                                 f"({model.num_kv_heads}) (the plugin does not write replicated KV heads)")
    if tp * plan.cfg.attention.kv_size != model.attention.kv_size:
        raise ServingConfigError(f"{where}: a device's KV row is {plan.cfg.attention.kv_size} lanes, "
                                 f"{tp} x that is not the model's {model.attention.kv_size}: expected "
                                 "num_kv_heads / tensor_parallel_size heads filling whole 128-lane blocks")


def _built(cfg, max_seqs: int, max_len: int, block_size: int, tp: int = 1, mesh_devices=None):
    import jax

    from tpumk.errors import PlanError
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import attached_target, get_target

    target = attached_target()
    if target is None:
        if jax.default_backend() != "cpu":
            raise ServingConfigError(f"tpumk plugin: JAX runs on {jax.default_backend()}: expected a TPU or the CPU")
        target = get_target("cpu")
    # pages of vLLM's block size: its block tables are the kernel's page tables
    context = -(-max_len // block_size) * block_size
    spec = BuildSpec(cfg, target, batch=max_seqs, context=context, page_size=block_size, devices=tp,
                     quant=os.environ.get(QUANT_ENV, "none"))  # PlanError: one line naming the field
    try:
        plan = make_plan(spec)
    except PlanError as e:
        if tp == 1:
            raise
        raise ServingConfigError(f"tpumk plugin: tensor_parallel_size {tp}: {e}") from None
    if tp != 1:
        _check_sharding(plan, tp)
    step = _decode_step(plan, mesh_devices)
    how = ("Pallas discharge interpreter on the CPU" if tp == 1 else
           f"Pallas TPU interpreter on {tp} CPU devices") if target.interpret else \
        f"compiled for {target.name}" + (f" x {tp}" if tp != 1 else "")
    return plan, step, f"built on start-up ({how})"
