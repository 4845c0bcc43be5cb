"""Speculative decoding: greedy acceptance, rollback, drafters, and end-to-end token equality.

The end-to-end oracle is plain greedy decoding (the reference, which tests/test_megakernel.py
ties to the megakernel and tests/test_hf_parity.py to transformers) or transformers itself.
Speculation must give exactly its tokens; the tests also check that drafts were really
accepted (mean acceptance > 1) and really rejected (some steps accept only the bonus), so both
the acceptance and the rollback paths ran. Prompts are chosen where the tiny random models'
greedy output repeats itself (what prompt lookup exploits), found by running the reference.
"""

from __future__ import annotations

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from test_megakernel import model

from tpumk.model import reference as R
from tpumk.cli import main
from tpumk.decode.drafters import DraftModelDrafter, NgramDrafter
from tpumk.errors import ConfigError
from tpumk.decode.generate import Model, generate, load_draft_model, load_model, reference_step, truncated_model
from tpumk.decode.speculative import greedy_accept, rollback, speculative_generate

STEPS = 12
CONTEXT = 64
# Six random ids followed by the model's own greedy continuation (tiny models, random weights
# seed 0), cut where the continuation goes on to repeat earlier text for a while: what prompt
# lookup exploits. Sequences of a batch accept different counts per step.
PROMPTS = {
    "tiny-dense": [[31, 143, 255, 248, 59, 502, 472, 409, 90, 64, 411, 39, 126, 486, 447, 495, 112, 499, 93, 497,
                    90, 64, 411, 39],
                   [139, 423, 131, 209, 329, 281, 308, 285, 396, 382, 360, 125, 278, 490, 483, 361, 167, 133, 408,
                    31, 146, 406, 302, 113]],
    "tiny-moe": [[421, 485, 127, 159, 444, 216, 34, 101, 216, 34, 101, 216, 34, 101],
                 [418, 168, 231, 403, 63, 155, 188, 34, 35, 457, 343, 147, 422, 176]],
}


# ---------------------------------------------------------------------- acceptance
def test_greedy_accept_all_none_partial_in_one_batch():
    drafts = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 3]]
    target = [[5, 6, 7, 8],  # every draft matches: 3 accepted + bonus 8
              [9, 6, 7, 8],  # first draft wrong: only the target's own token
              [5, 6, 1, 2],  # two accepted, bonus is the target's correction 1
              [1, 9, 3, 4]]  # a later match after a mismatch does not count
    accepted, emitted = greedy_accept(np.asarray(drafts), np.asarray(target))
    assert accepted.tolist() == [3, 0, 2, 1]
    assert emitted == [[5, 6, 7, 8], [9], [5, 6, 1], [1, 9]]


def test_greedy_accept_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="K \\+ 1"):
        greedy_accept(np.zeros((2, 3), int), np.zeros((2, 3), int))


# ---------------------------------------------------------------------- drafters
def test_ngram_drafter_prefers_longest_latest_match_and_extends_it():
    d = NgramDrafter(max_ngram=3)
    # "1 2 3" occurred before, followed by 4 then 9: the latest occurrence of the longest
    # suffix wins, and the proposal continues through the tokens it proposes.
    hist = [1, 2, 3, 4, 7, 1, 2, 3, 9, 8, 1, 2, 3]
    assert d.propose([hist], 4).tolist() == [[9, 8, 1, 2]]
    # A repeating pattern is extended past the end of the text it was matched in.
    assert d.propose([[5, 6, 5, 6]], 5).tolist() == [[5, 6, 5, 6, 5]]
    # No match of any length: repeat the last token.
    d.prepare([])
    assert d.propose([[1, 2, 3]], 3).tolist() == [[3, 3, 3]]
    assert d.summary()["fallbacks_no_match"] == 1  # later tokens then match the repeated 3


def test_draft_model_rolls_back_to_the_accepted_prefix():
    """After a round whose drafts were partly rejected (sequence 0) or all accepted (sequence
    1), the draft model's next drafts and live cache rows equal those of a fresh drafter
    prefilled with the accepted sequence."""
    cfg, params = model("tiny-dense", "float32")
    step = reference_step(cfg)

    def fresh():
        return DraftModelDrafter(cfg, params, lambda t, p, c: step(params, t, p, c), R.init_cache(cfg, 2, CONTEXT, 16))

    prompts = PROMPTS["tiny-dense"]
    d = fresh()
    d.prepare(prompts)
    hist = [p + [7] for p in prompts]
    drafts = d.propose(hist, 4)
    # sequence 0 accepts two drafts then a correction; sequence 1 accepts every draft + a bonus
    bad = (int(drafts[0, 2]) + 1) % cfg.vocab_size
    hist2 = [hist[0] + drafts[0, :2].tolist() + [bad], hist[1] + drafts[1].tolist() + [11]]
    got = d.propose(hist2, 3)
    ref = fresh()
    ref.prepare([h[:-1] for h in hist2])
    np.testing.assert_array_equal(got, ref.propose(hist2, 3))
    assert d.cached == ref.cached and [len(c) for c in d.cached] == np.asarray(d.cache.lengths).tolist()
    # every live row (both caches have the same block tables) holds the same K/V, to rounding:
    # the fresh drafter prefilled them in one chunk, the rolled-back one a token at a time
    for b, c in enumerate(d.cached):
        pos = np.arange(len(c))
        pages, slots = np.asarray(d.cache.block_tables[b])[pos // 16], pos % 16
        for name in ("k", "v"):
            a, w = np.asarray(getattr(d.cache, name)), np.asarray(getattr(ref.cache, name))
            np.testing.assert_allclose(a[:, pages, slots], w[:, pages, slots], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- rollback
def test_next_step_after_a_rejection_equals_full_recompute():
    """Verify with drafts that are all wrong, roll back, verify again: the second step's logits
    equal a cache-free forward over the accepted sequence plus the new drafts."""
    cfg, params = model("tiny-dense", "float32")
    step = reference_step(cfg)
    prompts = PROMPTS["tiny-dense"]
    last, cache = R.prefill(params, cfg, prompts, R.init_cache(cfg, 2, CONTEXT, 16), step_fn=step)
    g0 = np.asarray(jnp.argmax(last, -1))
    k = 3
    drafts = np.asarray([[(int(g0[b]) + 1 + i) % cfg.vocab_size for i in range(k)] for b in range(2)])
    lengths = np.asarray(cache.lengths)
    toks = jnp.asarray(np.concatenate([g0[:, None], drafts], 1), jnp.int32)
    logits, cache = step(params, toks, jnp.asarray(lengths[:, None] + np.arange(k + 1)), cache)
    accepted, emitted = greedy_accept(drafts, np.asarray(jnp.argmax(logits, -1)))
    assert accepted.tolist() == [0, 0]  # these drafts are all rejected (so rows 1..k are stale)
    cache = rollback(cache, lengths + 1)
    seqs = [p + [int(g0[b])] for b, p in enumerate(prompts)]
    new_drafts = np.asarray([[11, 12, 13], [21, 22, 23]])
    toks = jnp.asarray(np.concatenate([np.asarray([e[-1] for e in emitted])[:, None], new_drafts], 1), jnp.int32)
    got, cache = step(params, toks, jnp.asarray((lengths + 1)[:, None] + np.arange(k + 1)), cache)
    for b in range(2):
        full = seqs[b] + [emitted[b][-1]] + new_drafts[b].tolist()
        want = R.forward_full(params, cfg, jnp.asarray([full], jnp.int32))[0, -(k + 1):]
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- end to end


@functools.lru_cache(maxsize=None)
def plain_greedy(preset: str) -> list[list[int]]:
    cfg, params = model(preset, "float32")
    prompts = PROMPTS[preset]
    tokens, _ = R.greedy_generate(params, cfg, prompts, STEPS, R.init_cache(cfg, len(prompts), CONTEXT, 16),
                                  step_fn=reference_step(cfg))
    return tokens


def target(preset: str) -> Model:
    cfg, params = model(preset, "float32")
    return Model(cfg, params, "random weights (seed 0)")


# (preset, draft tokens K, spec). Verify steps of q = 8 (dense) and q = 4 (MoE), one compile per
# model; the draft is the target's first layer (tpumk.decode.generate.truncated_model: for tiny-moe its
# dense layer 0, a dense model) decoded by its own q = 1 megakernel.
E2E = [("tiny-dense", 7, "ngram"), ("tiny-dense", 7, "draft"), ("tiny-moe", 3, "ngram"), ("tiny-moe", 3, "draft")]


# The default run takes tiny-moe with the draft model (a q = 4 MoE verify kernel and the draft's
# own q = 1 kernel, end to end); the n-gram drafter is the same loop with another proposer
# (test_speculative_checkpoint_equals_transformers runs both drafters), and the dense q = 8
# verify kernel runs in test_megakernel_verify.py. The other three pairs are the full tier.
E2E_FULL = {("tiny-dense", "draft"), ("tiny-moe", "ngram"), ("tiny-dense", "ngram")}


@pytest.mark.parametrize("preset, k, spec", [
    pytest.param(p, k, s, id=f"{p}-{s}-k{k}", marks=[pytest.mark.full] if (p, s) in E2E_FULL else [])
    for p, k, s in E2E])
def test_speculative_megakernel_equals_plain_greedy(preset, k, spec):
    m = target(preset)
    draft = truncated_model(m, 1) if spec == "draft" else None
    out = generate(m, PROMPTS[preset], STEPS, backend="megakernel", spec=spec, draft_tokens=k, draft=draft)
    assert out["tokens"] == plain_greedy(preset)
    s = out["spec"]
    assert s["verify_q"] == k + 1 and s["target_steps"] < STEPS - 1
    assert s["tokens_per_target_step"] == pytest.approx((STEPS - 1) / s["target_steps"])
    assert 1.0 < s["mean_acceptance_length"] <= k + 1
    hist = {int(n): c for n, c in s["acceptance_histogram"].items()}
    assert hist[1] > 0 and sum(c for n, c in hist.items() if n > 1) > 0  # rejections and acceptances
    print(f"\n{preset} {spec} K={k}: mean acceptance {s['mean_acceptance_length']:.2f}, "
          f"{s['tokens_per_target_step']:.2f} tokens per target step")


# A Gated DeltaNet hybrid (tests/test_megakernel_linear.py's smallest), with prompts cut where its
# greedy continuation (random weights, seed 0) repeats: 192 189 79 ..., 252 70 299 252 ...
HYBRID = dict(name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=1,
              linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)
HYBRID_PROMPTS = [[63, 232, 500, 68, 196, 206, 117, 496, 453], [418, 168, 231, 403, 63, 155, 252, 70, 299]]


@pytest.mark.parametrize("backend", ["reference", pytest.param("megakernel", marks=pytest.mark.full)])
def test_speculative_hybrid_equals_plain_greedy(backend):
    """A hybrid target's verify steps leave their tokens pending in the state pool, and the
    rollback keeps only the accepted ones (`linear_attention.keep_accepted`): speculation gives
    plain greedy decoding's tokens, with drafts both accepted and rejected. The megakernel case
    (`full`: a q = 4 verify kernel in interpret mode) runs the kernel's own pending rows."""
    cfg = load_model("tiny-dense", None).cfg.replace(**HYBRID)
    from tpumk.model.weights import random_params

    m = Model(cfg, random_params(cfg, 0), "random weights (seed 0)")
    # plain greedy on the cache generate() makes for K = 3 (its prefill compiled once for both runs)
    cache = R.init_cache(cfg, 2, 32, 16, pending=4)
    plain, _ = R.greedy_generate(m.params, cfg, HYBRID_PROMPTS, STEPS, cache, step_fn=reference_step(cfg))
    out = generate(m, HYBRID_PROMPTS, STEPS, backend=backend, spec="ngram", draft_tokens=3)
    assert out["tokens"] == plain
    s = out["spec"]
    assert s["target_steps"] < STEPS - 1 and 1.0 < s["mean_acceptance_length"] <= 4
    hist = {int(n): c for n, c in s["acceptance_histogram"].items()}
    assert hist[1] > 0 and sum(c for n, c in hist.items() if n > 1) > 0  # rejections and acceptances
    with pytest.raises(ConfigError, match="--draft-model layers:1: 'tiny-gdn-first1' has linear-attention layers"):
        truncated_model(m, 1)


def test_draft_identical_to_target_accepts_every_draft():
    """A draft that is the target itself proposes exactly the target's greedy tokens: every
    verify step accepts all K drafts plus the bonus (the last one trimmed to the steps asked)."""
    m = target("tiny-moe")
    k = 4
    cache = R.init_cache(m.cfg, 2, CONTEXT, 16)
    step = reference_step(m.cfg)
    d = DraftModelDrafter(m.cfg, m.params, lambda t, p, c: step(m.params, t, p, c), R.init_cache(m.cfg, 2, CONTEXT, 16))
    tokens, cache, stats = speculative_generate(m.params, m.cfg, PROMPTS["tiny-moe"], STEPS, cache, d, k, step_fn=step)
    assert tokens == plain_greedy("tiny-moe")
    assert stats.target_steps == -(-(STEPS - 1) // (k + 1))
    assert all(a == k + 1 for row in stats.accepted for a in row)
    assert np.asarray(cache.lengths).tolist() == [len(p) + STEPS - 1 for p in PROMPTS["tiny-moe"]]


HF_PROMPTS = [[3, 17, 42, 7, 99], [250, 1, 64]]


def test_speculative_checkpoint_equals_transformers(hf_qwen3_moe_dir):
    """A tiny transformers-built Qwen3-MoE checkpoint, both drafters, reference backend (the
    megakernel run is marked slow below; the megakernel itself is tied to transformers on this
    checkpoint by tests/test_megakernel_hf.py, and to speculation by the tests above)."""
    from hf_utils import hf_greedy

    want = hf_greedy(hf_qwen3_moe_dir, HF_PROMPTS, STEPS)
    moe = load_model(None, str(hf_qwen3_moe_dir))
    # The draft is the checkpoint itself, loaded as a draft model: every draft is accepted.
    for spec, draft in (("ngram", None), ("draft", load_draft_model(str(hf_qwen3_moe_dir), moe))):
        got = generate(moe, HF_PROMPTS, STEPS, spec=spec, draft_tokens=3, draft=draft)
        assert got["tokens"] == want, spec
        print(f"\nhf qwen3-moe {spec} K=3: mean acceptance {got['spec']['mean_acceptance_length']:.2f}")
    assert got["spec"]["mean_acceptance_length"] == 4.0


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculative_checkpoint_megakernel_equals_transformers(hf_qwen3_moe_dir, spec):
    from hf_utils import hf_greedy

    moe = load_model(None, str(hf_qwen3_moe_dir))
    draft = load_draft_model("layers:2", moe) if spec == "draft" else None
    got = generate(moe, HF_PROMPTS, STEPS, backend="megakernel", spec=spec, draft_tokens=3, draft=draft)
    assert got["tokens"] == hf_greedy(hf_qwen3_moe_dir, HF_PROMPTS, STEPS)


# ---------------------------------------------------------------------- API and CLI
def test_generate_rejects_bad_speculation_options():
    m = target("tiny-dense")
    with pytest.raises(ConfigError, match="--spec: unknown method 'beam'"):
        generate(m, [[1, 2]], 4, spec="beam")
    with pytest.raises(ConfigError, match="--draft-tokens: expected a positive integer"):
        generate(m, [[1, 2]], 4, spec="ngram", draft_tokens=0)
    with pytest.raises(ConfigError, match="--spec draft: needs --draft-model"):
        generate(m, [[1, 2]], 4, spec="draft")
    with pytest.raises(ConfigError, match="--context: 8 tokens < 10 needed .* plus 4 draft tokens"):
        generate(m, [[1, 2]], 4, spec="ngram", draft_tokens=4, context=8)
    with pytest.raises(ConfigError, match="layers:N: expected N in \\[1, 2\\]"):
        load_draft_model("layers:3", m)


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_cli_generate_reports_acceptance(tmp_path):
    base = ["generate", "--model", "tiny-moe", "--prompt-ids", ";".join(",".join(map(str, p)) for p in PROMPTS["tiny-moe"]),
            "--steps", str(STEPS)]
    r = run(*base, "--spec", "draft", "--draft-model", "tiny-moe", "--draft-tokens", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["tokens"] == plain_greedy("tiny-moe")  # the draft is the target itself (same seed)
    assert out["spec"]["mean_acceptance_length"] == 4.0 and out["spec"]["target_steps"] == -(-(STEPS - 1) // 4)
    r = run(*base, "--spec", "ngram", "--draft-tokens", "3")
    assert r.exit_code == 0, r.output
    assert "mean acceptance length" in r.output and "tokens per target step" in r.output
    r = run(*base, "--spec", "ngram", "--draft-model", "tiny-dense")
    assert r.exit_code == 1 and "--draft-model: only used with --spec draft" in r.output
    small = tmp_path / "small-vocab.toml"
    small.write_text('name = "small"\nnum_layers = 1\nhidden_size = 128\nnum_q_heads = 1\nnum_kv_heads = 1\n'
                     'head_dim = 128\nffn_size = 256\nvocab_size = 256\ndtype = "float32"\n')
    r = run(*base, "--spec", "draft", "--draft-model", str(small))
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0
    assert "vocabulary 256 != the target's 512" in r.output
