"""Muse Spark's parts through the whole megakernel (issue 57), against the pure-JAX reference in
interpret mode with the race detector on, and the same plans compiled deviceless for TPU7x
(tests/test_megakernel.py's check_step): the embedding's weightless RMSNorm (embed_norm), gated
residuals (residual_gates), post-sublayer norms on routed layers with their own epsilon
(post_norms, post_norm_eps), each head's output normalised before the sigmoid output gate
(attn_out_norm), and NoPE on some attention layers but not all (nope_layers).
"""

from __future__ import annotations

import functools

import pytest

from test_megakernel import check_step
from test_megakernel_archs import assert_variants_move_the_logits, MODELS
from tpumk.errors import NotSupportedError
from tpumk.model.config import load_preset
from tpumk.plan.plan import check_kernel_parts

# Muse Spark in small: 64-wide heads (two per 128-lane block, as its 64-wide heads run), layers 0
# and 2 sliding a 20-token window, layer 1 a NoPE full layer; a dense layer 0, then layers routed
# by sigmoid scores with a correction bias and no shared expert; every sublayer's output
# normalised (epsilon 0.1, so it shows against rms_eps 1e-6) and joined by a gate; the embedding
# normalised; each head's output normalised before the output gate; the logits soft-capped.
SPARK = dict(head_dim=64, num_q_heads=8, num_kv_heads=2, sliding_window=20, sliding_layers=[0, 2], nope_layers=[1],
             num_shared_experts=0, shared_expert_ffn_size=0, router_scoring="sigmoid", router_correction_bias=True,
             embed_norm=True, post_norms=True, post_norm_eps=0.1, residual_gates=True, attn_output_gate=True,
             attn_out_norm=True, final_softcap=20.0)
MODELS["moe-spark"] = ("tiny-moe", SPARK)  # (assert_variants_move_the_logits reads the archs' table)


@functools.lru_cache(maxsize=None)
def spark_model(dtype: str):
    from test_megakernel_archs import model

    return model("moe-spark", dtype)


@pytest.mark.parametrize("dtype, lengths, q_len, knobs", [
    ("float32", [17, 44], 1, dict(kv_tile_pages=1)),
])
def test_spark_parts_match_reference(dtype, lengths, q_len, knobs):
    cfg, params = spark_model(dtype)
    check_step(cfg, params, dtype, lengths, q_len, knobs)


# Each part the case above holds the kernel to (1e-5 of the logits' scale) moves the reference's
# logits by more than 1e-3 of their scale when it is off, so a kernel that ignored it would fail.
SPARK_PARTS = {
    "embed_norm": dict(embed_norm=False),
    "residual_gates": dict(residual_gates=False),
    "post_norm_eps": dict(post_norm_eps=0.0),
    "post_norms": dict(post_norms=False, post_norm_eps=0.0),
    "attn_out_norm": dict(attn_out_norm=False),
    "nope_layers": dict(nope_layers=[]),
}


@pytest.mark.parametrize("part", SPARK_PARTS)
def test_each_spark_part_changes_the_output(part):
    assert_variants_move_the_logits("moe-spark", [(SPARK_PARTS[part], None)])


def test_muse_spark_is_refused_naming_only_what_remains():
    """The full-size model is refused in one line naming the parts the kernel still lacks, and
    none of those it builds."""
    with pytest.raises(NotSupportedError) as e:
        check_kernel_parts(load_preset("muse-spark"))
    msg = str(e.value)
    assert "\n" not in msg and "moe_hidden_size" in msg and "expert_post_norm" in msg
    for built in ("embed_norm", "residual_gates", "attn_out_norm", "post_norm_eps", "nope_layers", "post_norms"):
        assert built not in msg, built
