"""The `vllm.general_plugins` entry point (pyproject.toml): registers tpumk's model class.

vLLM calls `register()` in every process it starts. tpu_inference re-registers its own model
classes under their architecture names each time it looks one up, so tpumk's class has its own
name, `TpumkForCausalLM`; a served checkpoint opts in with
`--hf-overrides '{"architectures": ["TpumkForCausalLM"]}'` (tpumk reads the model itself from the
checkpoint's config.json, so its original architecture still decides what tpumk runs).
"""

from __future__ import annotations

import logging

ARCHITECTURE = "TpumkForCausalLM"

logger = logging.getLogger("vllm.tpumk")  # under vLLM's logger, so its handlers print it


def register() -> None:
    try:
        from tpu_inference.models.common.model_loader import register_model
    except ImportError as e:  # vLLM without its TPU backend: nothing to register, nothing broken
        logger.warning("tpumk plugin: not registered: vLLM's TPU backend (tpu_inference) is not importable (%s)", e)
        return
    from tpumk.vllm.model import TpumkForCausalLM

    register_model(ARCHITECTURE, TpumkForCausalLM)
