"""tpumk's vLLM TPU plugin (`pip install tpumk[vllm]`, docs/serving-vllm.md).

- plugin.py: the `vllm.general_plugins` entry point, registers `TpumkForCausalLM`;
- model.py: that model class (flax nnx, imports vLLM's TPU backend);
- runtime.py: the served model, the decode step (artifact or start-up build) and the refusals;
- steps.py: the decode-only program (the megakernel) and the prefill / mixed program (JAX);
- kv.py: vLLM's per-layer KV arrays, read and written in tpumk's row layout.

Only plugin.py and model.py import vLLM; the rest is tested without it (tests/test_vllm_adapter.py).
"""
