"""Speculative rounds on the device: draft, verify, accept, roll back, N rounds per call.

A hidden-state drafter (`tpumk.draft`: EAGLE-3, MTP, DFlash, DSpark) reads the target's own hidden
states, so its proposals depend on the verify step that just ran; running each round from the
host would return to it once per round (a few target tokens). Here one jitted program runs
`rounds_per_call` rounds in a `lax.fori_loop`, each:

1. `drafter.propose`: k drafts d_1..d_k for the positions after the anchor (the newest token,
   not yet cached, at position `pos`), with the distribution q each was drawn from;
2. one verify step of the target over [anchor, d_1..d_k] at pos..pos + k that also returns the
   drafter's taps (`BuildSpec.taps`: the megakernel, or the reference with `taps=`);
3. acceptance: greedy (temperature 0) keeps the longest prefix of drafts equal to the target's
   argmax and adds the target's own next token (exactly the tokens plain greedy decoding
   gives); sampled keeps d_i with probability min(1, p_i(d_i) / q_i(d_i)) and draws the next
   token from the normalised max(0, p - q) at the first rejection (from p after k acceptances):
   standard speculative sampling, whose output distribution is the target's;
4. roll back: the cache length becomes pos + n + 1 (the anchor and the n accepted drafts; the
   rejected rows stay in HBM, dead, overwritten later), a hybrid's pool keeps n + 1 of the
   step's pending rows (`linear_attention.keep_accepted`: nothing copied);
5. `drafter.absorb` takes the accepted rows' taps as context; the next anchor is the bonus token.

A sequence that has its `steps` tokens rides along with positions -1 (its rows write nothing,
its lengths do not move) until the call ends; the host looks at the emitted counts once per call.
The tokens each sequence emits land in an on-device buffer; nothing returns to the host between
rounds. A program built for `steps` tokens runs any N <= steps of them: the emitted count starts
at steps - N + 1 (`first_carry`), so a sequence stops after exactly N tokens (how an exported
round program serves every length its cache holds).

`RoundSpec` describes the program a build compiles (`BuildSpec.draft`): the drafter (its
DrafterSpec), the identity of its weights and the settings; `tpumk.compile.aot.compile_rounds`
compiles it ahead of time, `tpumk.export.artifacts` ships it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.draft.config import DrafterSpec
from tpumk.errors import ConfigError
from tpumk.model import linear_attention
from tpumk.model.parts import is_int

# verify(packed, tokens [B, q], positions [B, q], cache) -> (logits [B, q, V], cache, taps [B, q, T, H])
VerifyFn = Callable[..., tuple[jax.Array, Any, jax.Array]]


class Carry(NamedTuple):
    """Everything a round reads and writes, on the device."""

    cache: Any  # the target's KV cache (its layout: the step's), lengths = each anchor's position
    dstate: Any  # the drafter's state (`Drafter.init_state` / `absorb`)
    anchor: jax.Array  # [B] int32: the newest token, not yet cached
    pos: jax.Array  # [B] int32: its position (= the cache length)
    out: jax.Array  # [B, steps + k + 1] int32: tokens emitted so far (the first from the prefill)
    count: jax.Array  # [B] int32: how many of them (at most steps)
    committed: jax.Array  # [B] int32: tokens committed by verify steps (accepted drafts + 1 each)
    rounds: jax.Array  # [B] int32: verify steps the sequence was active in
    key: jax.Array  # PRNG key (sampled acceptance and sampled drafts)


@dataclass(frozen=True)
class RoundSettings:
    block: int  # k: drafts per round (verify q = k + 1)
    steps: int  # tokens to generate per sequence (the prefill's included)
    rounds_per_call: int = 8
    temperature: float = 0.0  # 0: greedy

    def __post_init__(self) -> None:
        for name in ("block", "steps", "rounds_per_call"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"speculative rounds: {name} = {v!r}: expected a positive integer")
        t = self.temperature
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 and np.isfinite(t)):
            raise ConfigError(f"speculative rounds: temperature = {t!r}: expected a finite number >= 0")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class RoundSpec:
    """The speculative round program a build compiles (`BuildSpec.draft`): the drafter (its
    DrafterSpec: kind, layer shapes, taps and `block`, the drafts per round), where its weights
    come from (`weights`: ("sha256", the content hash of weights read from files,
    tpumk.draft.weights.weights_sha256) or ("random_seed", n): `random_params(drafter, n)`),
    `rounds_per_call` rounds per device call and the acceptance `temperature` (0: greedy).
    Plain data through to_dict / from_dict: what cache keys, manifests and the tuner record."""

    drafter: DrafterSpec
    weights: tuple[str, Any]
    rounds_per_call: int = 8
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, DrafterSpec):
            raise ConfigError(f"round spec: drafter = {self.drafter!r:.60}: expected a DrafterSpec")
        w = self.weights
        ok = (isinstance(w, tuple) and len(w) == 2 and
              ((w[0] == "sha256" and isinstance(w[1], str) and len(w[1]) == 64
                and all(c in "0123456789abcdef" for c in w[1]))
               or (w[0] == "random_seed" and is_int(w[1]) and w[1] >= 0)))
        if not ok:
            raise ConfigError(f"round spec: weights = {w!r:.80}: expected ('sha256', a 64-digit hex digest) or "
                              "('random_seed', an integer >= 0)")
        RoundSettings(self.drafter.block, 1, self.rounds_per_call, self.temperature)  # the same checks

    @property
    def block(self) -> int:
        return self.drafter.block

    @property
    def random_seed(self) -> int | None:
        return self.weights[1] if self.weights[0] == "random_seed" else None

    def settings(self, context: int) -> "RoundSettings":
        """The program's settings for a KV cache of `context` tokens per sequence: it emits up to
        context - block - 1 tokens (a one-token prompt's most; `first_carry` runs fewer)."""
        steps = context - self.block - 1
        if steps < 1:
            raise ConfigError(f"round program: context {context}: expected at least block + 2 = {self.block + 2} "
                              "(a prompt token, a verify step of block + 1 rows)")
        return RoundSettings(self.block, steps, self.rounds_per_call, float(self.temperature))

    def with_block(self, block: int) -> "RoundSpec":
        import dataclasses

        return dataclasses.replace(self, drafter=self.drafter.with_block(block))

    def to_dict(self) -> dict[str, Any]:
        return {"drafter": self.drafter.to_dict(), "weights": {self.weights[0]: self.weights[1]},
                "rounds_per_call": self.rounds_per_call, "temperature": float(self.temperature)}

    @classmethod
    def from_dict(cls, d: Any, source: str = "draft") -> "RoundSpec":
        if not isinstance(d, dict) or set(d) != {"drafter", "weights", "rounds_per_call", "temperature"}:
            raise ConfigError(f"{source}: expected a table of drafter, weights, rounds_per_call and temperature")
        w = d["weights"]
        if not (isinstance(w, dict) and len(w) == 1):
            raise ConfigError(f"{source}: field 'weights': expected one of sha256 = DIGEST or random_seed = N")
        t = d["temperature"]
        return cls(DrafterSpec.from_dict(d["drafter"], f"{source}.drafter"), next(iter(w.items())),
                   d["rounds_per_call"], float(t) if is_int(t) else t)

    def label(self) -> str:
        how = "greedy" if not self.temperature else f"temperature {self.temperature:g}"
        return (f"{self.drafter.kind} drafter, {self.block} drafts a round, {self.rounds_per_call} rounds a call, "
                f"{how}")


def greedy_accept(drafts: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """drafts [B, k], the verify step's logits [B, k + 1, V] -> (accepted n [B], the next token
    [B]): the longest prefix with d_i == argmax(logits[i - 1]), then argmax(logits[n])."""
    g = jnp.argmax(logits, -1).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(drafts == g[:, :-1], axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(g, n[:, None], 1)[:, 0]


def sampled_accept(drafts: jax.Array, q: jax.Array, logits: jax.Array, temperature: float,
                   key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling: d_i kept with probability min(1, p_i(d_i) / q_i(d_i)) (p the
    target's softmax at `temperature`, q [B, k, V] the drafter's); at the first rejection n the
    next token is drawn from max(0, p_n - q_n) normalised, after k acceptances from p_k."""
    b, k = drafts.shape
    p = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    ku, kr = jax.random.split(key)
    u = jax.random.uniform(ku, (b, k))
    keep = u * qd < pd  # u < p / q, without dividing by a q of 0 (then kept whenever p > 0)
    n = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # after k acceptances: p itself
    p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], 1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    # p == q at n (a rejection there has probability 0): any token of p is right; keep p
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
    nxt = jax.random.categorical(kr, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, nxt


def _emit(out, count, drafts, n, nxt, active, steps):
    """Append d_1..d_n then the next token to each active sequence's emitted tokens."""
    k = drafts.shape[1]
    j = jnp.arange(k + 1)[None, :]
    row = jnp.where(j < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), nxt[:, None])
    write = jax.vmap(lambda o, r, c: jax.lax.dynamic_update_slice(o, r, (c,)))
    new_out = write(out, row.astype(out.dtype), count)
    new_count = jnp.minimum(count + n + 1, steps)
    return jnp.where(active[:, None], new_out, out), jnp.where(active, new_count, count)


def make_rounds(verify: VerifyFn, drafter, settings: RoundSettings) -> Callable:
    """The device program: run(packed, dparams, tparams, carry) -> carry after
    `settings.rounds_per_call` rounds (jit it; `generate` does)."""
    k, steps, temp = settings.block, settings.steps, float(settings.temperature)
    if drafter.block != k:
        raise ConfigError(f"speculative rounds: block = {k} but the drafter proposes {drafter.block} tokens a round")

    def one_round(packed, dparams, tparams, c: Carry) -> Carry:
        active = c.count < steps
        key, k_draft, k_accept = jax.random.split(c.key, 3)
        drafts, q, dstate = drafter.propose(dparams, tparams, c.dstate, c.anchor, c.pos,
                                            k_draft if settings.sampled else None, temp or 1.0)
        drafts = drafts.astype(jnp.int32)
        tokens = jnp.concatenate([c.anchor[:, None], drafts], axis=1)
        offsets = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        positions = jnp.where(active[:, None], c.pos[:, None] + offsets, -1)
        logits, cache, taps = verify(packed, tokens, positions, c.cache)
        if settings.sampled:
            n, nxt = sampled_accept(drafts, q, logits, temp, k_accept)
        else:
            n, nxt = greedy_accept(drafts, logits)
        n = jnp.where(active, n, 0)
        # roll back: the anchor and the n accepted drafts stay cached; a hybrid's pool keeps them pending
        lengths = jnp.where(active, c.pos + n + 1, c.cache.lengths).astype(jnp.int32)
        cache = cache._replace(lengths=lengths)
        if cache.states is not None:
            cache = cache._replace(states=linear_attention.keep_accepted(cache.states, jnp.where(active, n + 1, 0)))
        valid = (offsets <= n[:, None]) & active[:, None]
        dstate = drafter.absorb(dparams, tparams, dstate, taps, tokens, positions, valid)
        out, count = _emit(c.out, c.count, drafts, n, nxt, active, steps)
        return Carry(cache, dstate, jnp.where(active, nxt, c.anchor), jnp.where(active, c.pos + n + 1, c.pos), out,
                     count, c.committed + jnp.where(active, n + 1, 0), c.rounds + active.astype(jnp.int32), key)

    def run(packed, dparams, tparams, carry: Carry) -> Carry:
        # a drafter whose passes run as a kernel of their own lays its weights out once per call
        # (tpumk.kernel.draft_pass.KernelDrafter.prepare), not once per round
        prepare = getattr(drafter, "prepare", None)
        dp = dparams if prepare is None else prepare(dparams, tparams)
        return jax.lax.fori_loop(0, settings.rounds_per_call, lambda _, c: one_round(packed, dp, tparams, c), carry)

    return run


@dataclass
class RoundStats:
    """What the rounds did (per sequence, over the verify steps it was active in)."""

    block: int
    calls: int  # device calls (each `rounds_per_call` rounds): the host round-trips
    rounds: list[int]
    committed: list[int]

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target verify step (accepted drafts + 1), over all sequences."""
        return sum(self.committed) / max(1, sum(self.rounds))

    def to_dict(self) -> dict:
        return {"draft_tokens": self.block, "verify_q": self.block + 1, "device_calls": self.calls,
                "verify_steps_per_sequence": self.rounds, "committed_per_sequence": self.committed,
                "mean_acceptance_length": self.acceptance_length}


def first_carry(prefill_logits, taps, tokens, positions, cache, drafter, dparams, tparams, settings: RoundSettings,
                seed: int = 0, steps: int | None = None) -> Carry:
    """The carry after the prefill (one target step over the prompts with their taps): the first
    token drawn from the last prompt position's logits, the drafter's context absorbed. `steps`
    (default settings.steps): the tokens this run emits per sequence, at most the program's
    settings.steps: the emitted count starts at settings.steps - steps + 1, the first token at
    out[:, settings.steps - steps], so every sequence stops after exactly `steps` tokens."""
    steps = settings.steps if steps is None else steps
    if not 1 <= steps <= settings.steps:
        raise ConfigError(f"speculative rounds: {steps} steps: expected 1 to the program's {settings.steps}")
    start = settings.steps - steps
    key = jax.random.PRNGKey(seed)
    key, k0 = jax.random.split(key)
    lens = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
    last = jnp.take_along_axis(prefill_logits, jnp.maximum(lens - 1, 0)[:, None, None], 1)[:, 0]
    if settings.sampled:
        first = jax.random.categorical(k0, last.astype(jnp.float32) / settings.temperature, axis=-1)
    else:
        first = jnp.argmax(last, -1)
    first = first.astype(jnp.int32)
    b = tokens.shape[0]
    dstate = drafter.init_state(b, cache.max_context)
    dstate = drafter.absorb(dparams, tparams, dstate, taps, tokens, positions, positions >= 0)
    out = jnp.zeros((b, settings.steps + settings.block + 1), jnp.int32).at[:, start].set(first)
    # committed and rounds are two arrays, not one: a program that donates the carry (an exported
    # round program, tpumk.compile.aot.compile_rounds) may not be given one buffer twice
    return Carry(cache, dstate, first, lens, out, jnp.full((b,), start + 1, jnp.int32), jnp.zeros((b,), jnp.int32),
                 jnp.zeros((b,), jnp.int32), key)


def padded_prompts(prompts: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array]:
    """Prompts of any lengths as one step's [B, T] tokens and positions (-1 past each prompt:
    those rows write nothing)."""
    t = max(len(p) for p in prompts)
    toks = np.zeros((len(prompts), t), np.int32)
    pos = np.full((len(prompts), t), -1, np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)] = p
        pos[b, :len(p)] = np.arange(len(p))
    return jnp.asarray(toks), jnp.asarray(pos)


def required_context(prompts: Sequence[Sequence[int]], steps: int, block: int) -> int:
    """Positions a run may write: the longest prompt + steps - 1 cached tokens, plus a verify
    step's k + 1 rows on top of the last of them."""
    return max(len(p) for p in prompts) + steps - 1 + block + 1


def generate(prefill: Callable, verify: VerifyFn, drafter, packed, dparams, tparams, prompts: Sequence[Sequence[int]],
             cache, settings: RoundSettings, seed: int = 0, layout: tuple[Callable, Callable] | None = None,
             on_call: Callable[[Carry], None] | None = None) -> tuple[list[list[int]], Any, RoundStats]:
    """Speculative generation of `settings.steps` tokens per prompt, `rounds_per_call` rounds per
    device call, the host reading only the emitted counts between calls.

    `prefill(tokens [B, T], positions [B, T], cache) -> (logits, cache, taps)` runs the prompts
    (the reference with `taps=drafter.taps`, or any step of that contract); `verify` is the
    target's step for q = block + 1 with the same taps; `layout` (to, back): the verify step's
    cache layout from the prefill's and back (the megakernel's sharded or lane-padded one),
    applied once before the rounds and once after; `on_call(carry)`: called after every device
    call (with rounds_per_call = 1, each round's committed counts). Returns the tokens, the cache
    and the RoundStats (`calls`: how many times the program returned to the host)."""
    run = jax.jit(make_rounds(verify, drafter, settings))
    return drive(run, prefill, drafter, packed, dparams, tparams, prompts, cache, settings, settings.steps, seed,
                 layout, on_call)


def drive(run: Callable, prefill: Callable, drafter, packed, dparams, tparams, prompts: Sequence[Sequence[int]],
          cache, settings: RoundSettings, steps: int, seed: int = 0, layout: tuple[Callable, Callable] | None = None,
          on_call: Callable[[Carry], None] | None = None) -> tuple[list[list[int]], Any, RoundStats]:
    """`generate` with the round program given: `run(packed, dparams, tparams, carry) -> carry`
    built for `settings` (jitted here, or a compiled or loaded one), `steps` <= settings.steps
    tokens per prompt (`first_carry`)."""
    need = required_context(prompts, steps, settings.block)
    if cache.max_context < need:
        raise ConfigError(f"--context: {cache.max_context} tokens < {need} needed for the longest prompt plus "
                          f"{steps} steps plus a verify step of {settings.block + 1}")
    tokens, positions = padded_prompts(prompts)
    logits, cache, taps = prefill(tokens, positions, cache)
    if layout is not None:
        cache = layout[0](cache)
    carry = first_carry(logits, taps, tokens, positions, cache, drafter, dparams, tparams, settings, seed, steps)
    calls = 0
    while True:
        carry = run(packed, dparams, tparams, carry)
        calls += 1
        if on_call is not None:
            on_call(carry)
        if int(np.min(np.asarray(carry.count))) >= settings.steps:  # the one host read per call
            break
    start = settings.steps - steps
    out = np.asarray(carry.out)[:, start:settings.steps]
    stats = RoundStats(settings.block, calls, np.asarray(carry.rounds).tolist(), np.asarray(carry.committed).tolist())
    return [row.tolist() for row in out], carry.cache if layout is None else layout[1](carry.cache), stats


def target_for_drafter(params: dict) -> dict:
    """What a drafter reads of the target's weights: its embedding and head (tpumk.draft)."""
    return {k: params[k] for k in ("embed", "lm_head") if k in params}
