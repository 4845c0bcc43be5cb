"""A model loaded from a Hugging Face checkpoint generates through the megakernel exactly the
tokens `transformers` generates (tiny random Qwen3 / Qwen3-MoE, CPU, interpret mode)."""

import pytest
from hf_utils import hf_greedy

from tpumk.decode.generate import generate, load_model


# The full tier: test_hf_archs.py::test_greedy_tokens_transformers_reference_megakernel[qwen3-moe-d64]
# runs a Qwen3-MoE checkpoint of transformers' through the megakernel against transformers' greedy
# tokens in the default run (64-wide heads there, 128 here).
@pytest.mark.full
def test_megakernel_greedy_equals_transformers(hf_qwen3_moe_dir):
    # Dense models take the same kernel path minus routing; tests/test_megakernel.py covers them
    # against the reference, which tests/test_hf_parity.py ties to transformers.
    ckpt = hf_qwen3_moe_dir
    prompts = [[3, 17, 42, 7, 99], [250, 1, 64]]
    want = hf_greedy(ckpt, prompts, 16)
    m = load_model(None, str(ckpt))
    got = generate(m, prompts, 16, backend="megakernel")
    assert got["tokens"] == want
    assert "megakernel" in got["ran_on"]
