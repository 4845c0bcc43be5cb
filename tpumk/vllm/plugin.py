"""The `vllm.general_plugins` entry point (pyproject.toml): registers tpumk's model class and its
`tpumk` attention backend (tpumk.vllm.backend: the KV cache in the megakernel's stacked layout).

vLLM calls `register()` in every process it starts. tpu_inference re-registers its own model
classes under their architecture names each time it looks one up, so tpumk's class has its own
name, `TpumkForCausalLM`; a served checkpoint opts in with
`--hf-overrides '{"architectures": ["TpumkForCausalLM"]}'` (tpumk reads the model itself from the
checkpoint's config.json, so its original architecture still decides what tpumk runs).
"""

from __future__ import annotations

import logging

ARCHITECTURE = "TpumkForCausalLM"
VLLM_BACKEND = "tpumk.vllm.backend.TpumkPallasBackend"  # the class vLLM resolves --attention-backend tpumk to

logger = logging.getLogger("vllm.tpumk")  # under vLLM's logger, so its handlers print it


def _attention_backend():
    from tpumk.vllm.backend import TpumkAttentionBackend

    return TpumkAttentionBackend()


def register() -> None:
    try:
        from tpu_inference.layers.common.attention_backend import register_attention_backend
        from tpu_inference.models.common.model_loader import register_model
    except ImportError as e:  # vLLM without its TPU backend: nothing to register, nothing broken
        logger.warning("tpumk plugin: not registered: vLLM's TPU backend (tpu_inference) is not importable (%s)", e)
        return
    from tpumk.vllm.model import TpumkForCausalLM
    from tpumk.vllm.runtime import BACKEND

    register_model(ARCHITECTURE, TpumkForCausalLM)
    # --attention-backend tpumk: vLLM allocates the megakernel's stacked KV cache (tpumk.vllm.backend)
    register_attention_backend(BACKEND, attention=_attention_backend, vllm_backend=VLLM_BACKEND)
