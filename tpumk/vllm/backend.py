"""The `tpumk` attention backend and KV-cache layers: vLLM allocates the megakernel's stacked cache.

vLLM's TPU runner (tpu_inference 0.32) allocates one KV array per KV-cache layer it is told of,
each of the shape its attention backend's `get_kv_cache_shape` gives for that layer's spec
(`kv_cache_manager.initialize_kv_cache` -> `create_kv_caches`), and sizes its blocks by that
shape at one block (`get_attention_page_size_bytes`). For a JAX model its spec lists one layer
per `num_hidden_layers` unless the model's KV-cache layers are in vLLM's
`static_forward_context`, which is how vLLM's own attention layers declare themselves
(`get_kv_cache_spec`, the branch for a non-empty context). So the plugin:

- declares two KV-cache layers (`declare_layers`, from the model's constructor, which vLLM runs
  before it asks for the spec): `tpumk.kv.k` and `tpumk.kv.v` (tpumk.vllm.kv), each a full
  decoder attention spec whose bytes per block are one stacked array's, `layers x block_size x
  width` elements: vLLM's spec counts a K and a V row per head, `2 x num_kv_heads x head_size`
  per token, so each declares `layers x width / 128` heads of 64 (a width tpu_inference does not
  pad; the kernel's row width is a multiple of 128 lanes, lane padding sees to it);
- for a hybrid model, declares a third, `tpumk.kv.state` (tpumk.vllm.states): its linear
  layers' state pool, one slot's entry per block, in the same stacked form;
- registers this backend as `tpumk` (`register_attention_backend`, from plugin.register): for a
  declared layer's (heads, head size) its `get_kv_cache_shape` is the stacked `[layers, blocks,
  block_size, width]`, which vLLM also sizes its blocks by (the shape at one block: exactly the
  spec's bytes); its attention kernel is never called (tpumk's model runs its own).

`--attention-backend tpumk` selects it (tpu_inference: one host, forked workers only); the
plugin refuses to start without it (tpumk.vllm.runtime). Imports vLLM and tpu_inference: only
the plugin's entry point and model use it.
"""

from __future__ import annotations

from tpu_inference.layers.common.attention_backend import AttentionBackend
from tpu_inference.layers.vllm.backends.flash_attn import PallasAttentionBackend, PallasAttentionBackendImpl
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tpumk.vllm import kv
from tpumk.vllm.runtime import BACKEND

SPEC_HEAD_SIZE = 64  # the head size each declared layer's spec counts in (tpu_inference keeps 64 unpadded)
# a declared layer's (heads, head size) as tpu_inference passes them, per device of its mesh's
# tensor-parallel axis -> (layers, width of one device's rows)
_DECLARED: dict[tuple[int, int], tuple[int, int]] = {}
# the (heads, head size) of the eagle3 drafter's KV-cache layer (declare_draft_layer): tpu_inference's
# own layout, which its drafter's attention (ragged paged attention) reads
_DRAFT: set[tuple[int, int]] = set()
DRAFT_LAYER = "draft_layer.0"  # tpu_inference's name for it (kv_cache_manager)


def spec_heads(layers: int, width: int) -> int:
    """The heads of 64 a declared layer's spec counts: 2 x heads x 64 = layers x width per token."""
    if width % (2 * SPEC_HEAD_SIZE):
        raise ValueError(f"tpumk plugin: a KV row width of {width}: expected a multiple of {2 * SPEC_HEAD_SIZE} lanes")
    return layers * width // (2 * SPEC_HEAD_SIZE)


class TpumkAttentionBackend(AttentionBackend):
    """tpu_inference's side: the KV arrays' shape, the stacked layout of a declared layer."""

    def get_kv_cache_shape(self, total_num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                           kv_dtype) -> tuple[int, ...]:
        stacked = _DECLARED.get((num_kv_heads, head_dim))
        if stacked is None and (num_kv_heads, head_dim) in _DRAFT:  # the eagle3 drafter's: tpu_inference's own
            from tpu_inference.layers.common.attention_backend import RPAAttentionBackend

            return RPAAttentionBackend().get_kv_cache_shape(total_num_pages, page_size, num_kv_heads, head_dim,
                                                            kv_dtype)
        if stacked is None:
            raise ValueError(f"--attention-backend {BACKEND}: no tpumk KV-cache layer of {num_kv_heads} heads of "
                             f"{head_dim} was declared (the backend lays out the cache of tpumk's plugin model only)")
        # one device's part, [layers, blocks, block_size, width / N]: tpu_inference multiplies the
        # third axis by its mesh's tensor-parallel size N and splits it over that axis
        # (`get_kv_cache_shape_with_mesh`, `create_kv_caches`), which is kv.cache_shape's layout
        layers, width = stacked
        return kv.cache_shape(layers, total_num_pages, page_size, width)

    def attention(self, *args, **kwargs):
        raise NotImplementedError(f"--attention-backend {BACKEND} lays out the KV cache of tpumk's plugin model only "
                                  "(--hf-overrides '{\"architectures\": [\"TpumkForCausalLM\"]}'), whose own kernel "
                                  "runs its attention")


class TpumkPallasImpl(PallasAttentionBackendImpl):
    attention_backend = BACKEND


class TpumkPallasBackend(PallasAttentionBackend):
    """vLLM's side of the backend (what `--attention-backend tpumk` names): tpu_inference's
    Pallas backend with this backend's name, as `register_attention_backend` asks."""

    @staticmethod
    def get_name() -> str:
        return BACKEND.upper()

    @staticmethod
    def get_impl_cls() -> type[PallasAttentionBackendImpl]:
        return TpumkPallasImpl


class StackedKVLayer(AttentionLayerBase):
    """One of the two KV-cache layers the plugin declares: every model layer's K (or V) in one
    array. The fields are those tpu_inference's `get_kv_cache_spec` reads of an attention layer."""

    attn_type = AttentionType.DECODER
    sliding_window = None
    kv_sharing_target_layer_name = None

    def __init__(self, layers: int, width: int):
        self.num_kv_heads, self.head_size = spec_heads(layers, width), SPEC_HEAD_SIZE

    def get_attn_backend(self):
        return TpumkPallasBackend

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, dtype=vllm_config.model_config.dtype)


def declare_layers(vllm_config, layers: int, width: int, names: tuple[str, ...] = (kv.K_LAYER, kv.V_LAYER),
                   devices: int = 1) -> None:
    """Tell vLLM the model's KV-cache layers: `names` (kv.K_LAYER and kv.V_LAYER; an MLA model's
    latent array alone, kv.layer_names), `layers` x `width` each (the whole model's width; on
    `devices` > 1 each device holds width / devices of it)."""
    context = vllm_config.compilation_config.static_forward_context
    key = (spec_heads(layers, width) // devices, SPEC_HEAD_SIZE)
    if _DECLARED.setdefault(key, (layers, width // devices)) != (layers, width // devices):  # one model per process
        raise ValueError(f"tpumk plugin: KV-cache layers of {_DECLARED[key]} (layers, width) were declared in this "
                         f"process already: expected one model's, got ({layers}, {width // devices}) too")
    for name in names:
        context[name] = StackedKVLayer(layers, width)


class DraftKVLayer(AttentionLayerBase):
    """The eagle3 drafter's one KV-cache layer, in tpu_inference's per-layer layout: the spec
    tpu_inference's runner gives it when the model declares no layers of its own
    (kv_cache_manager: padded KV heads and head size)."""

    attn_type = AttentionType.DECODER
    sliding_window = None
    kv_sharing_target_layer_name = None

    def __init__(self, num_kv_heads: int, head_size: int):
        self.num_kv_heads, self.head_size = num_kv_heads, head_size

    def get_attn_backend(self):
        return TpumkPallasBackend

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        return FullAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, dtype=vllm_config.model_config.dtype)


def declare_draft_layer(vllm_config) -> None:
    """Tell vLLM the eagle3 drafter's KV-cache layer (after the model's: tpu_inference's drafter
    reads the last of the runner's KV arrays), as tpu_inference sizes it for a model of its own."""
    from tpu_inference import utils as common_utils

    draft = vllm_config.speculative_config.draft_model_config.hf_config
    heads = common_utils.get_padded_num_heads(draft.num_key_value_heads,
                                              int(vllm_config.parallel_config.tensor_parallel_size))
    head_size = common_utils.get_padded_head_dim(draft.hidden_size // draft.num_attention_heads)
    _DRAFT.add((heads, head_size))
    vllm_config.compilation_config.static_forward_context[DRAFT_LAYER] = DraftKVLayer(heads, head_size)
