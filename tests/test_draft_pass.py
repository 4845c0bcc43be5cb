"""The drafter's pass as a Pallas kernel of its own (tpumk.kernel.draft_pass, issue 56): each kind's
proposal through the kernel (TPU interpret mode on this host) equals the XLA pass (tpumk.draft's
chain / block, themselves checked against speculators' torch definitions in test_draft_*.py) on
random float32 weights: logits to float32 rounding (a chain step's drafts and the rows it writes
into the drafter's cache too); the
same kernel compiles deviceless for TPU7x in the same test (and v6e for the `full` kinds). The round program carries the
kernel: tests/test_drafted.py counts it in the compiled round program.

Shapes are small but TPU-shaped (hidden 256, heads of 64 and 128 lanes, two sequences, a 32-position
drafter cache: one 32-wide KV chunk per sequence, so the chunk loop crosses a sequence boundary).
mtp (the chain step) runs by default; eagle3, dflash and dspark are the `full` tier
(tests/README.md): the default run's tests/test_drafted.py case (dspark) takes the block pass
through the kernel inside the round program."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.compat import tpu_interpreter
from tpumk.compile.aot import compile_for
from tpumk.decode.generate import load_model
from tpumk.draft import random_drafter
from tpumk.kernel import draft_pass
from tpumk.model.config import load_preset
from tpumk.targets import get_target

B, C = 2, 32
# eagle3: two layers (the first over [embedding; hidden], 2H wide), 64-wide heads, a reduced vocabulary
SHAPES = {"eagle3": dict(layers=2, heads=4, kv_heads=2, head_dim=64, block=2, draft_vocab=256),
          "mtp": {},
          "dflash": dict(layers=1, heads=4, kv_heads=2, head_dim=64, block_size=3),
          "dspark": dict(layers=1, block_size=3, markov_rank=16)}
DEFAULT = ("mtp",)


@functools.lru_cache(maxsize=None)
def target():
    return load_model("tiny-dense", None, seed=0)


def _kinds():
    return [k if k in DEFAULT else pytest.param(k, marks=pytest.mark.full) for k in SHAPES]


def _context(d, tparams):
    """A drafter state holding context: a 5-row prefill of sequence 0, 3 rows of sequence 1."""
    cfg = target().cfg
    hidden = jax.random.normal(jax.random.PRNGKey(3), (B, 5, len(d.taps), cfg.hidden_size))
    tokens = jnp.array([[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]], jnp.int32)
    state = d.init_state(B, C)
    # one jitted program: op-by-op dispatch of the absorb took ~10 s of this file's default run
    return jax.jit(d.absorb)(d.params, tparams, state, hidden, tokens, positions, positions >= 0)


@pytest.mark.parametrize("kind", _kinds())
def test_the_kernel_pass_equals_the_xla_pass_and_compiles(kind, monkeypatch):
    m = target()
    d = random_drafter(kind, m.cfg, seed=1, **SHAPES[kind])
    assert m.cfg.dtype == "float32" and draft_pass.refusal(d.spec) is None
    # interpreted with 3-slot rings and 8-position KV chunks, so the q / o streams (a tile per
    # head) and the cache's (4 chunks a sequence) reuse their slots; compiled below with the defaults
    monkeypatch.setattr(draft_pass, "RING_DEPTH", 3)
    monkeypatch.setattr(draft_pass, "KV_CHUNK", 8)
    assert d.spec.layer.attention.num_q_heads > 3
    tparams = {k: m.params[k] for k in ("embed", "lm_head") if k in m.params}
    state = _context(d, tparams)
    anchor, anchor_pos = jnp.array([6, 12], jnp.int32), jnp.array([5, 3], jnp.int32)
    kd = draft_pass.KernelDrafter(d, tpu_interpreter())
    forced = jnp.array([[3, 4, 5][:d.block]] * B, jnp.int32)
    # jitted (the proposals below are cheaper op by op: their few ops, no compile)
    want = np.asarray(jax.jit(d.logits)(d.params, tparams, state, anchor, anchor_pos, forced))
    got = np.asarray(jax.jit(kd.logits)(d.params, tparams, state, anchor, anchor_pos, forced))
    # float32 rounding (the online softmax, per-head o sums): ~1e-6 on logits of a few units;
    # a wrong mask, row or norm moves them by 0.1 or more
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
    if kind in ("eagle3", "mtp"):  # a chain step also writes its rows into the drafter's cache
        drafts, _, new = d.propose(d.params, tparams, state, anchor, anchor_pos)
        k_drafts, _, k_new = kd.propose(d.params, tparams, state, anchor, anchor_pos)
        np.testing.assert_array_equal(np.asarray(k_drafts), np.asarray(drafts))
        for a, b in zip(jax.tree.leaves(k_new), jax.tree.leaves(new)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    monkeypatch.undo()
    abstract = random_drafter(kind, m.cfg, seed=1, abstract=True, **SHAPES[kind])
    compiled_kd = draft_pass.KernelDrafter(abstract, False)
    specs = (abstract.params, jax.eval_shape(lambda: tparams), jax.eval_shape(lambda: abstract.init_state(B, C)),
             jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    for chip in ("tpu7x",) if kind in DEFAULT else ("tpu7x", "v6e"):  # v6e: test_drafted's round compiles it
        compiled = compile_for(lambda p, t, s, a, ap: compiled_kd.propose(p, t, s, a, ap), specs, get_target(chip))
        passes = d.block if kind in ("eagle3", "mtp") else 1  # a chain step per draft, one block pass
        assert compiled.custom_calls == passes and f"draft_pass_{kind}" in compiled.hlo_text, (chip, compiled.custom_calls)


def test_a_drafter_the_kernel_does_not_model_keeps_its_xla_passes():
    cfg = load_preset("tiny-mla")
    d = random_drafter("mtp", cfg, seed=1, abstract=True)  # DeepSeek-V3's next-token layer: MLA and experts
    why = draft_pass.refusal(d.spec)
    assert why is not None and "MLA layers" in why and "expert layers" in why
    assert draft_pass.through_kernel(d, get_target("tpu7x")) is d
    dense = random_drafter("dflash", load_preset("tiny-dense"), seed=1, abstract=True, block_size=3)
    assert isinstance(draft_pass.through_kernel(dense, get_target("tpu7x")), draft_pass.KernelDrafter)
