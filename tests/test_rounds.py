"""Speculative rounds on the device (tpumk.draft.rounds, issue 56): draft, verify with the
target's taps, accept, roll back, absorb, N rounds per device call.

The drafters here (tests/tap_drafter.py) follow tpumk.draft's contract without a published
format: ScriptDrafter proposes the plain greedy run's own tokens with every few drafts
corrupted (every acceptance count, all k included), TapDrafter reads the taps (a wrong tap row
or absorb changes its proposals). Greedy speculative tokens must equal plain greedy decoding,
through the reference and through the megakernel (interpret mode), for a dense, a MoE, an MLA
and a linear-attention target; 8 rounds per call return to the host once; speculative sampling
keeps the target's distribution (a chi-square test over 20,000 draws)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from tap_drafter import ScriptDrafter, TapDrafter
from test_megakernel import races_found
from test_megakernel_linear import hybrid
from tpumk.draft import rounds
from tpumk.errors import ConfigError
from tpumk.kernel.layout import pack_weights
from tpumk.kernel.megakernel import make_decode_step
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
CONTEXT, PAGE, K = 64, 16, 3


@functools.lru_cache(maxsize=None)
def target(name: str):
    cfg = {"dense": lambda: load_preset("tiny-dense"), "moe": lambda: load_preset("tiny-moe"),
           "mla": lambda: load_preset("tiny-mla"), "gdn": lambda: hybrid("gdn")}[name]()
    return cfg, random_params(cfg, seed=0)


@functools.lru_cache(maxsize=None)
def plain_greedy(name: str, steps: int):
    cfg, params = target(name)
    return R.greedy_generate(params, cfg, PROMPTS, steps, R.init_cache(cfg, 2, CONTEXT, PAGE))[0]


def _run(name: str, drafter, steps: int, verify=None, packed=None, dparams=None, per_call: int = 8, **kw):
    cfg, params = target(name)
    prefill = lambda t, p, c: R.decode_step(params, cfg, t, p, c, taps=drafter.taps)
    verify = verify or (lambda pk, t, p, c: R.decode_step(pk, cfg, t, p, c, taps=drafter.taps))
    cache = R.init_cache(cfg, 2, CONTEXT, PAGE, pending=K + 1 if cfg.linear else 1)
    return rounds.generate(prefill, verify, drafter, params if packed is None else packed, dparams, None, PROMPTS,
                           cache, rounds.RoundSettings(K, steps, per_call, **kw))


def _script(name: str, steps: int, taps: tuple[int, ...], every: int = 4) -> ScriptDrafter:
    cfg, _ = target(name)
    return ScriptDrafter(tuple(tuple(p + w) for p, w in zip(PROMPTS, plain_greedy(name, steps))), taps, K,
                         cfg.vocab_size, every)


# ---------------------------------------------------------------------- acceptance
def test_greedy_acceptance_counts_and_emission():
    v = 6
    drafts = jnp.asarray([[1, 2, 3], [1, 2, 3], [4, 4, 4], [1, 2, 3]])
    want = np.asarray([[1, 2, 3, 5], [1, 9 % v, 3, 0], [0, 4, 4, 4], [1, 2, 0, 2]])  # the target's argmax per row
    logits = jax.nn.one_hot(want, v) * 5.0
    n, nxt = rounds.greedy_accept(drafts, logits)
    assert n.tolist() == [3, 1, 0, 2] and nxt.tolist() == [5, 3, 0, 0]
    out, count = rounds._emit(jnp.zeros((4, 10), jnp.int32), jnp.asarray([1, 1, 1, 8]), drafts, n, nxt,
                              jnp.asarray([True, True, True, True]), steps=9)
    assert out[0, 1:5].tolist() == [1, 2, 3, 5] and count.tolist() == [5, 3, 2, 9]
    assert out[1, 1:3].tolist() == [1, 3] and out[2, 1] == 0


def test_sampled_acceptance_keeps_the_target_distribution():
    """20,000 rounds of speculative sampling with a drafter distribution q far from the
    target's p: the first token a round commits is distributed as p (chi-square, p > 0.01);
    a drafter whose q equals p keeps every draft."""
    v, k, n_draws = 5, 2, 20_000
    rng = np.random.default_rng(0)
    p_logits = jnp.asarray(rng.standard_normal((k + 1, v)) * 1.5, jnp.float32)
    q = jax.nn.softmax(jnp.asarray(rng.standard_normal((k, v)) * 1.5, jnp.float32), -1)
    p = np.asarray(jax.nn.softmax(p_logits, -1))

    def one(key):
        kd, ka = jax.random.split(key)
        d = jax.random.categorical(kd, jnp.log(q), axis=-1)[None].astype(jnp.int32)  # [1, k]
        n, nxt = rounds.sampled_accept(d, q[None], p_logits[None], 1.0, ka)
        first = jnp.where(n[0] > 0, d[0, 0], nxt[0])
        return first, n[0], d[0, 0]

    first, n, d0 = jax.vmap(one)(jax.random.split(jax.random.PRNGKey(1), n_draws))
    assert 0 < float(jnp.mean(n > 0)) < 1  # some drafts kept, some rejected
    counts = np.bincount(np.asarray(first), minlength=v)
    expected = p[0] * n_draws
    statistic = float(np.sum((counts - expected) ** 2 / expected))
    assert float(chi2.sf(statistic, v - 1)) > 0.01, (counts, expected)
    # what a drafter equal to the target proposes is always kept
    d = jnp.asarray([[2, 3]])
    n_same, _ = rounds.sampled_accept(d, jnp.asarray(p[None, :k]), p_logits[None], 1.0, jax.random.PRNGKey(2))
    assert int(n_same[0]) == k


# ---------------------------------------------------------------------- greedy = plain greedy
# The full tier (tests/README.md): the megakernel test below runs the same loop with the same
# drafter, test_a_drafter_reading_the_taps the reference's, tests/test_drafted.py an MLA target.
@pytest.mark.full
@pytest.mark.parametrize("name", ["dense", "mla", "gdn"])
def test_reference_rounds_give_the_plain_greedy_tokens(name):
    cfg, _ = target(name)
    drafter = _script(name, 16, (cfg.num_layers,), every=5)
    got, cache, stats = _run(name, drafter, 16)
    assert got == plain_greedy(name, 16)
    assert 1.5 < stats.acceptance_length <= K + 1  # drafts were accepted, some rejected
    # each sequence's cache holds its prompt and the tokens before its last (the anchor is not cached)
    assert all(n >= len(p) + 15 for n, p in zip(np.asarray(cache.lengths).tolist(), PROMPTS))


def test_a_drafter_reading_the_taps_gives_the_plain_greedy_tokens():
    cfg, _ = target("dense")
    d = TapDrafter((0, cfg.num_layers), K, cfg.hidden_size, cfg.vocab_size, bigram=True)
    got, _, stats = _run("dense", d, 16, dparams=d.params(1))
    assert got == plain_greedy("dense", 16) and stats.calls == 2  # 15 rounds at most: two calls of 8


def test_a_program_built_for_more_steps_runs_fewer():
    """What an exported round program does (tpumk.load_rounds): built for 40 tokens a sequence,
    driven for 9, each sequence stops after exactly 9 (the emitted count starts at 40 - 9 + 1),
    the tokens are plain greedy's; the carry's counters are distinct buffers (a program that
    donates the carry may not be given one buffer twice)."""
    cfg, params = target("dense")
    d = TapDrafter((0, cfg.num_layers), K, cfg.hidden_size, cfg.vocab_size, bigram=True)
    dparams = d.params(1)
    settings = rounds.RoundSettings(K, 40, 2)
    prefill = lambda t, p, c: R.decode_step(params, cfg, t, p, c, taps=d.taps)
    jitted = jax.jit(rounds.make_rounds(prefill_verify(cfg, d), d, settings))
    given = []  # the carries the program is called with

    def run(*args):
        given.append(args[3])
        return jitted(*args)

    seen = []
    got, _, stats = rounds.drive(run, prefill, d, params, dparams, None, PROMPTS, R.init_cache(cfg, 2, CONTEXT, PAGE),
                                 settings, 9, on_call=seen.append)
    assert got == plain_greedy("dense", 9)
    assert all(int(c) == 40 for c in np.asarray(seen[-1].count))  # stopped at the program's count
    # the same rounds as a program built for 9 tokens: no sequence ran a round past its 9th token
    _, _, nine = rounds.generate(prefill, prefill_verify(cfg, d), d, params, dparams, None, PROMPTS,
                                 R.init_cache(cfg, 2, CONTEXT, PAGE), rounds.RoundSettings(K, 9, 2))
    assert (stats.rounds, stats.committed, stats.calls) == (nine.rounds, nine.committed, nine.calls)
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(given[0])]  # first_carry's carry
    assert len(set(pointers)) == len(pointers)
    with pytest.raises(ConfigError, match="41 steps: expected 1 to the program's 40"):
        rounds.drive(run, prefill, d, params, dparams, None, PROMPTS, R.init_cache(cfg, 2, 80, PAGE), settings, 41)


def prefill_verify(cfg, drafter):
    return lambda pk, t, p, c: R.decode_step(pk, cfg, t, p, c, taps=drafter.taps)


def test_eight_rounds_per_call_return_to_the_host_once_through_the_megakernel():
    """The MoE target's megakernel verify step (q = 4, two taps) in interpret mode inside the
    device loop: 9 tokens need at most 8 rounds, so the loop returns to the host once."""
    cfg, params = target("moe")
    drafter = _script("moe", 9, (1, cfg.num_layers))
    plan = make_plan(BuildSpec(cfg, get_target("cpu"), 2, CONTEXT, q_len=K + 1, page_size=PAGE, taps=drafter.taps))
    got, _, stats = _run("moe", drafter, 9, verify=make_decode_step(plan, detect_races=True),
                         packed=pack_weights(plan, params))
    assert not races_found()
    assert got == plain_greedy("moe", 9) and stats.calls == 1 and stats.acceptance_length > 2


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="block = 0"):
        rounds.RoundSettings(0, 4)
    with pytest.raises(ConfigError, match="temperature"):
        rounds.RoundSettings(2, 4, temperature=-1.0)
    cfg, _ = target("dense")
    with pytest.raises(ConfigError, match="--context: 8 tokens < 24"):
        rounds.generate(None, None, _script("dense", 16, (1,)), None, None, None, PROMPTS,
                        R.init_cache(cfg, 2, 8, 8), rounds.RoundSettings(K, 16))
