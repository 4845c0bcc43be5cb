"""Mistral Large 4 in the megakernel (issue 57): its parts beside DeepSeek Sparse Attention (learned
RoPE frequencies, per-head log-position query scales on MLA's and the indexer's queries, NoPE
layers whose keys are all latent, layers reading another layer's latent rows, the indexer's
queries projecting LayerNorm(x), a float32 router), one decode step against the reference
(tpumk.model.reference) in interpret mode with the race detector, compiled deviceless for TPU7x
and v6e. transformers' own Mistral Large 4 through the megakernel: tests/test_hf_mistral_large4.py.

The model: tiny-mla's widths (hidden and experts 128) without q-LoRA, 4 layers: 0 and 1 roped, 2
and 3 NoPE; layer 1 reads layer 0's latent rows and layer 3 layer 2's (the random cache holds
other rows in layers 1 and 3, so a kernel reading them fails); an indexer of 8 heads of 16 lanes
(interleaved rope pairs, top 4) on layers 0-2, layer 3 keeping layer 2's picks; softmax routing
over 2 of 4 expert groups; logits soft-capped. The random weights move every learned part off
its identity (`tpumk.model.weights`); the test checks that dropping each of them moves the
reference's logits, so a kernel ignoring one fails the comparison.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from test_megakernel_sparse import compile_for_tpus, reference_step, step_against_reference
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params

LARGE4 = dict(hidden_size=128, expert_ffn_size=128, shared_expert_ffn_size=128, num_layers=4, q_lora_rank=0,
              index_topk=4, index_heads=8, index_head_dim=16, index_rope_interleave=True, index_shared_layers=(3,),
              index_q_hidden=True, nope_layers=(2, 3), nope_latent_keys=True, kv_source_layers=(0, 0, 2, 2),
              rope_learned_freqs=True, query_log_scale=True, router_scoring="softmax", router_correction_bias=False,
              router_float32=True, routed_scaling_factor=1.0, final_softcap=30.0)


@functools.lru_cache(maxsize=None)
def model(dtype: str = "float32"):
    cfg = load_preset("tiny-mla").replace(name=f"tiny-large4-{dtype}", dtype=dtype, **LARGE4)
    return cfg, random_params(cfg, seed=2)


def without(params, part: str):
    """The weights with one learned part back at its identity."""
    layers = [dict(lay) for lay in params["layers"]]
    out = dict(params, layers=layers)
    if part == "rope_alpha":
        out["rope_alpha"] = jnp.zeros_like(params["rope_alpha"])
    zero, one = {"q_log": ("q_log_scale", "q_log_bias"), "idx_log": ("idx_log_scale", "idx_log_bias"),
                 "idx_q_norm": ("idx_q_bias", "idx_q_norm")}.get(part, (None, None))
    for lay in layers:
        if zero in lay:
            lay[zero], lay[one] = jnp.zeros_like(lay[zero]), jnp.ones_like(lay[one])
    return out


# bf16-b2-q3 is the full tier (a float32 router only differs from a model-dtype one in bfloat16):
# f32-b1-q1 runs every Mistral Large 4 kernel path; tests/README.md.
@pytest.mark.parametrize("dtype, lengths, q_len", [
    ("float32", [37], 1),
    pytest.param("bfloat16", [17, 30], 3, marks=pytest.mark.full),
], ids=["f32-b1-q1", "bf16-b2-q3"])
def test_large4_step_matches_reference_and_compiles(dtype, lengths, q_len):
    """The megakernel's step equals the reference's: logits within 1e-5 of their scale (bf16: the
    MLA tests' bound), the latent and index-key caches with this step's rows; no DMA race; the
    selection matters (the k-th and (k+1)-th scores apart); each learned part moves the
    reference's logits. Compiled deviceless for TPU7x and v6e."""
    cfg, params = model(dtype)
    plan, tokens, positions, cache, want, _, new = step_against_reference(cfg, params, lengths, q_len)
    assert plan.sparse.q_hidden and plan.sparse.log_scale and "q" in plan.families
    step = reference_step(cfg)
    # the layers reading another's rows wrote none of their own: their cache layers as before
    for i in (1, 3):
        np.testing.assert_array_equal(np.asarray(new.k[i], np.float32), np.asarray(cache.k[i], np.float32))
    scale = float(jnp.max(jnp.abs(want)))
    for part in ("rope_alpha", "q_log", "idx_log", "idx_q_norm"):  # (the same compiled reference)
        moved, _, _ = step(without(params, part), tokens, positions, cache)
        assert float(jnp.max(jnp.abs(moved - want))) > 0.01 * scale, part
    compile_for_tpus(cfg, len(lengths), q_len)
