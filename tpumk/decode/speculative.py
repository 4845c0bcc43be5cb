"""Speculative decoding with greedy verification in one decode step of q = K + 1 tokens.

One round, per sequence b whose cache holds L_b tokens and whose newest token `last_b` (position
L_b) is not cached yet:

1. a drafter (tpumk.decode.drafters) proposes K tokens d_1..d_K;
2. ONE target step (the megakernel planned for q = K + 1, or the reference) takes
   [last_b, d_1..d_K] at positions L_b..L_b + K, writes all K + 1 rows of K/V into the paged
   cache and returns logits for every position; their greedy ids are g_0..g_K;
3. `greedy_accept`: the longest prefix with d_i == g_{i-1} (n_b accepted drafts) plus the
   target's bonus token g_{n_b}, i.e. exactly g_0..g_{n_b}: the tokens plain greedy decoding
   would have produced, one step at a time;
4. rollback: the cache length becomes L_b + n_b + 1 (rows of last_b and the accepted drafts).
   The rows of rejected drafts stay in HBM but are dead: both the reference and the kernel
   attend only to keys at positions < length or written by the current step
   (tpumk.model.reference.decode_step, tpumk.kernel.attention), and the next round writes its own
   rows over them starting at the new length.

Batches: the step is planned for a fixed [B, q], and every sequence sends q = K + 1 tokens
every round, each at its own positions L_b..L_b + K (the cache is paged per sequence and the
kernel takes per-sequence positions and lengths), so sequences that accept different counts
need no padding or shifting: they simply advance by different amounts. A sequence that has
its `steps` tokens keeps riding along (its rows written and rolled back, length unchanged)
until the whole batch is done; the last round's tokens are trimmed to `steps`, so no cached
position exceeds prompt + steps + K - 1 (hence `required_context`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from tpumk.model import linear_attention, reference
from tpumk.errors import ConfigError
from tpumk.model.positions import check_finite, check_step

DecodeFn = Callable  # (tokens [B, q], positions [B, q], cache) -> (logits [B, q, V], cache)


def greedy_accept(drafts, target_ids) -> tuple[np.ndarray, list[list[int]]]:
    """Greedy acceptance for a batch.

    drafts [B, K]: the proposed tokens d_1..d_K; target_ids [B, K + 1]: the target's greedy
    ids g_0..g_K at the verified positions (g_i follows d_i; g_0 follows the last accepted
    token). Returns (accepted [B]: drafts accepted n_b in 0..K, emitted: per sequence the
    n_b + 1 new tokens, the accepted drafts then the bonus token, which equal g_0..g_{n_b})."""
    d, g = np.asarray(drafts), np.asarray(target_ids)
    if d.ndim != 2 or g.shape != (d.shape[0], d.shape[1] + 1):
        raise ValueError(f"greedy_accept: drafts {d.shape} and target ids {g.shape}: expected [B, K] and [B, K + 1]")
    match = d == g[:, :-1]
    # n_b = index of the first mismatch, or K when every draft matched
    accepted = np.where(match.all(axis=1), d.shape[1], np.argmin(match, axis=1)).astype(np.int32)
    emitted = [[int(t) for t in g[b, :n + 1]] for b, n in enumerate(accepted)]
    return accepted, emitted


def rollback(cache: reference.KVCache, lengths, kept=None) -> reference.KVCache:
    """The cache with per-sequence lengths set back to `lengths` (rows past them are dead). A
    hybrid model's state pool keeps the first `kept[b]` tokens the verify step left pending
    (`linear_attention.keep_accepted`): the next step applies only them."""
    cache = cache._replace(lengths=jnp.asarray(np.asarray(lengths), jnp.int32))
    if cache.states is not None and kept is not None:
        cache = cache._replace(states=linear_attention.keep_accepted(cache.states, jnp.asarray(np.asarray(kept))))
    return cache


def required_context(prompts: Sequence[Sequence[int]], steps: int, draft_tokens: int) -> int:
    """Cache positions a speculative run may write: the longest prompt + steps - 1 tokens
    cached at most, plus a verify step's K + 1 rows on top of the last of them."""
    return max(len(p) for p in prompts) + steps + draft_tokens


@dataclass
class SpecStats:
    """What a speculative run did. Acceptance is exact (token equality), not a timing."""

    draft_tokens: int
    target_steps: int = 0  # verify steps after the prefill
    decode_tokens: int = 0  # tokens per sequence produced by verify steps (steps - 1)
    # tokens accepted (drafts + bonus, before trimming to `steps`) per verify step, per
    # sequence that was still generating in that step
    accepted: list[list[int]] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float | None:
        flat = [a for row in self.accepted for a in row]
        return sum(flat) / len(flat) if flat else None

    @property
    def tokens_per_target_step(self) -> float | None:
        """Tokens each sequence gained per target step (plain greedy decoding: exactly 1)."""
        return self.decode_tokens / self.target_steps if self.target_steps else None

    def histogram(self) -> dict[int, int]:
        out = {n: 0 for n in range(1, self.draft_tokens + 2)}
        for row in self.accepted:
            for a in row:
                out[a] += 1
        return out

    def to_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "verify_q": self.draft_tokens + 1,
                "target_steps": self.target_steps, "decode_tokens_per_sequence": self.decode_tokens,
                "mean_acceptance_length": self.mean_acceptance_length,
                "tokens_per_target_step": self.tokens_per_target_step,
                "acceptance_histogram": {str(k): v for k, v in self.histogram().items()}}


def speculative_generate(params, cfg, prompts: Sequence[Sequence[int]], steps: int, cache: reference.KVCache,
                         drafter, draft_tokens: int, step_fn=None, verify_fn: DecodeFn | None = None,
                         check: bool = True) -> tuple[list[list[int]], reference.KVCache, SpecStats]:
    """Greedy decoding with speculation: the same tokens as `reference.greedy_generate`.

    Prefills the prompts with `step_fn` (reference signature; default the jitted reference),
    then runs rounds of drafter.propose -> one verify step of q = draft_tokens + 1 -> greedy
    acceptance -> rollback, until every sequence has `steps` tokens. `verify_fn(tokens,
    positions, cache) -> (logits, cache)` is the target's step for [B, K + 1] (default the
    reference step with `params`). `drafter` follows tpumk.decode.drafters.Drafter. Returns (tokens per
    sequence, the cache (lengths = prompt + steps - 1, rows past them dead), SpecStats).

    `check` (default) checks every verify step's positions before it runs
    (`tpumk.model.positions.check_step`: PositionError; a hybrid's state pool must keep the
    step's K + 1 tokens pending, so that a rollback can drop the rejected ones) and its logits
    after (NonFiniteError on NaN / inf, which greedy acceptance would read as token 0)."""
    k = draft_tokens
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ConfigError(f"--draft-tokens: expected a positive integer, got {k!r}")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ConfigError(f"--steps: expected a positive number of steps, got {steps!r}")
    need = required_context(prompts, steps, k)
    if cache.max_context < need:
        raise ConfigError(f"--context: {cache.max_context} tokens < {need} needed for the longest prompt "
                          f"plus {steps} steps plus {k} draft tokens")
    step = step_fn or reference.jitted_decode_step(cfg)
    verify = verify_fn or (lambda toks, pos, c: step(params, toks, pos, c))

    last_logits, cache = reference.prefill(params, cfg, prompts, cache, step_fn=step, check=check)
    out = [[int(t)] for t in np.asarray(jnp.argmax(last_logits, -1))]
    drafter.prepare([list(p) for p in prompts])
    stats = SpecStats(k, decode_tokens=steps - 1)
    lengths = np.asarray(cache.lengths).astype(np.int64)
    offsets = np.arange(k + 1)[None, :]
    while any(len(o) < steps for o in out):
        histories = [list(p) + o for p, o in zip(prompts, out)]
        drafts = np.asarray(drafter.propose(histories, k), np.int64)
        if drafts.shape != (len(prompts), k):
            raise ValueError(f"drafter {drafter.name}: proposed {drafts.shape}, expected {(len(prompts), k)}")
        if drafts.min() < 0 or drafts.max() >= cfg.vocab_size:
            raise ValueError(f"drafter {drafter.name}: proposed ids outside the vocabulary [0, {cfg.vocab_size})")
        last = np.asarray([o[-1] for o in out])[:, None]
        tokens = jnp.asarray(np.concatenate([last, drafts], 1), jnp.int32)
        positions = jnp.asarray(lengths[:, None] + offsets, jnp.int32)
        where = f"verify step {stats.target_steps + 1}"
        if check:
            check_step(positions, cache, where=where, keep_pending=True)  # a hybrid's rollback needs them pending
        before = lengths.copy()
        logits, cache = verify(tokens, positions, cache)
        if check:
            check_finite(logits, where=where)
        accepted, emitted = greedy_accept(drafts, np.asarray(jnp.argmax(logits, -1)))
        stats.target_steps += 1
        row = []
        for b, new in enumerate(emitted):
            room = steps - len(out[b])
            if room <= 0:
                continue  # done: its rows were written and are rolled back below
            row.append(int(accepted[b]) + 1)
            take = new[:room]
            out[b] += take
            lengths[b] += len(take)  # rows of last_b and the accepted drafts stay valid
        stats.accepted.append(row)
        cache = rollback(cache, lengths, kept=lengths - before)
    return out, cache, stats
