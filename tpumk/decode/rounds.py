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
rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError
from tpumk.model import linear_attention

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
        return jax.lax.fori_loop(0, settings.rounds_per_call,
                                 lambda _, c: one_round(packed, dparams, tparams, c), carry)

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
                seed: int = 0) -> Carry:
    """The carry after the prefill (one target step over the prompts with their taps): the first
    token drawn from the last prompt position's logits, the drafter's context absorbed."""
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
    out = jnp.zeros((b, settings.steps + settings.block + 1), jnp.int32).at[:, 0].set(first)
    zeros = jnp.zeros((b,), jnp.int32)
    return Carry(cache, dstate, first, lens, out, jnp.ones((b,), jnp.int32), zeros, zeros, key)


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
    need = required_context(prompts, settings.steps, settings.block)
    if cache.max_context < need:
        raise ConfigError(f"--context: {cache.max_context} tokens < {need} needed for the longest prompt plus "
                          f"{settings.steps} steps plus a verify step of {settings.block + 1}")
    tokens, positions = padded_prompts(prompts)
    logits, cache, taps = prefill(tokens, positions, cache)
    if layout is not None:
        cache = layout[0](cache)
    carry = first_carry(logits, taps, tokens, positions, cache, drafter, dparams, tparams, settings, seed)
    run = jax.jit(make_rounds(verify, drafter, settings))
    calls = 0
    while True:
        carry = run(packed, dparams, tparams, carry)
        calls += 1
        if on_call is not None:
            on_call(carry)
        if int(np.min(np.asarray(carry.count))) >= settings.steps:  # the one host read per call
            break
    out = np.asarray(carry.out)[:, :settings.steps]
    stats = RoundStats(settings.block, calls, np.asarray(carry.rounds).tolist(), np.asarray(carry.committed).tolist())
    return [row.tolist() for row in out], carry.cache if layout is None else layout[1](carry.cache), stats


# ---------------------------------------------------------------------- the program, ahead of time
def target_for_drafter(params: dict) -> dict:
    """What a drafter reads of the target's weights: its embedding and head (tpumk.draft)."""
    return {k: params[k] for k in ("embed", "lm_head") if k in params}


def round_specs(plan, drafter, settings: RoundSettings) -> tuple:
    """ShapeDtypeStructs of run(packed, dparams, tparams, carry) for `plan` (the verify step: q =
    block + 1, the drafter's taps): the packed weights and cache as the step takes them
    (`step_specs`), the drafter's weights and state, the target's embedding and head, the
    carry's vectors; on many devices everything but the step's own arguments replicated over
    its mesh."""
    from tpumk.kernel.megakernel import step_mesh, step_specs
    from tpumk.model.ops import jnp_dtype

    packed, _, _, cache = step_specs(plan)
    b, model = plan.batch, plan.whole_model
    place = lambda x: x  # noqa: E731
    if plan.devices > 1:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        rep = NamedSharding(step_mesh(plan), P())
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)  # noqa: E731
    dt = jnp_dtype(model)
    tparams = {"embed": jax.ShapeDtypeStruct((model.vocab_size, model.hidden_size), dt)}
    if not model.tie_embeddings:
        tparams["lm_head"] = jax.ShapeDtypeStruct((model.hidden_size, model.vocab_size), dt)
    dparams = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), drafter.params)
    dstate = jax.eval_shape(lambda: drafter.init_state(b, plan.context))
    vec = jax.ShapeDtypeStruct((b,), jnp.int32)
    carry = Carry(cache, jax.tree.map(place, dstate), place(vec), place(vec),
                  place(jax.ShapeDtypeStruct((b, settings.steps + settings.block + 1), jnp.int32)),
                  place(vec), place(vec), place(vec), place(jax.eval_shape(lambda: jax.random.PRNGKey(0))))
    return packed, jax.tree.map(place, dparams), jax.tree.map(place, tparams), carry


def compile_rounds(plan, drafter, settings: RoundSettings):
    """The round program (`rounds_per_call` rounds: the drafter's passes and the megakernel's
    verify step with its taps, in one program) compiled for the plan's target, deviceless
    without a TPU, on one device or the plan's mesh (tpumk.compile.aot.compile_program)."""
    from tpumk.compile.aot import compile_program
    from tpumk.kernel.megakernel import make_decode_step

    if plan.q_len != settings.block + 1 or plan.taps != tuple(drafter.taps):
        raise ConfigError(f"round program: the verify plan has q_len {plan.q_len} and taps {list(plan.taps)}; the "
                          f"drafter needs q_len {settings.block + 1} and taps {list(drafter.taps)}")
    run = make_rounds(make_decode_step(plan, nested=True), drafter, settings)
    return compile_program(run, round_specs(plan, drafter, settings), plan, donate_argnums=(3,))
