"""Drafters for speculative decoding: who proposes the K tokens one target step verifies.

A drafter has `name`, `prepare(prompts)` (called once, after the target's prefill) and
`propose(histories, k) -> int array [B, k]`, where `histories[b]` is sequence b's whole token
list so far (prompt + generated; its last token is the one the target has not cached yet).
Drafters never affect which tokens come out (acceptance checks every draft against the
target's greedy choice); they only set how many tokens one target step yields.

- `NgramDrafter`: prompt lookup, no weights. Finds the most recent earlier occurrence of the
  sequence's last n tokens (longest n first) and proposes what followed it.
- `DraftModelDrafter`: a smaller model with the same vocabulary, decoded greedily for k tokens
  with its own q = 1 decode step (its own megakernel, or the reference) and its own paged
  cache, kept in sync with the accepted tokens by rollback.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from tpumk.model import reference
from tpumk.model.positions import check_finite, check_step


class NgramDrafter:
    """Prompt lookup: propose the continuation of the latest earlier match of the last n tokens.

    Tokens are proposed one at a time and appended to a scratch copy of the sequence, so a
    match close to the end keeps going through the tokens just proposed (a repeating pattern
    is extended, not cut short). n runs from `max_ngram` down to `min_ngram`; when nothing
    matches, the last token is repeated (runs of one token are what greedy decoding falls into
    most often, and any guess is safe: a wrong one costs only its verify row)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"NgramDrafter: expected 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"ngram (prompt lookup, n = {max_ngram}..{min_ngram})"
        self.lookups = self.fallbacks = 0

    def prepare(self, prompts: Sequence[Sequence[int]]) -> None:
        self.lookups = self.fallbacks = 0

    def next_token(self, seq: Sequence[int]) -> int:
        self.lookups += 1
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = list(seq[-n:])
            for j in range(len(seq) - n - 1, -1, -1):  # latest occurrence that has a successor
                if seq[j + n - 1] == tail[-1] and list(seq[j:j + n]) == tail:
                    return int(seq[j + n])
        self.fallbacks += 1
        return int(seq[-1])

    def propose(self, histories: Sequence[Sequence[int]], k: int) -> np.ndarray:
        out = np.zeros((len(histories), k), np.int64)
        for b, h in enumerate(histories):
            seq = list(h)
            for i in range(k):
                seq.append(self.next_token(seq))
                out[b, i] = seq[-1]
        return out

    def summary(self) -> dict:
        return {"drafter": self.name, "lookups": self.lookups, "fallbacks_no_match": self.fallbacks}


class DraftModelDrafter:
    """A draft model decoded greedily with its own q = 1 step and its own paged cache.

    `decode(tokens [B, 1], positions [B, 1], cache) -> (logits, cache)` is the draft's step
    (its megakernel or the reference, params bound); `prefill_step` (reference signature) fills
    its cache from the prompts. The cache always holds some prefix of each sequence plus the
    drafts of the last round (`cached[b]`); `propose` first rolls it back to the longest prefix
    that is still the sequence (the accepted drafts stay, the rejected ones go), feeds the
    tokens it has not seen (one, or two after a round whose drafts were all accepted), then
    drafts k tokens. Sequences needing fewer catch-up feeds repeat their first one: feeding the
    same token at the same position rewrites the same row, so the batch keeps one shape."""

    def __init__(self, cfg, params, decode: Callable, cache: reference.KVCache, prefill_step: Callable | None = None,
                 label: str | None = None, check: bool = True):
        self.cfg, self.params, self.decode = cfg, params, decode
        self.check = check  # positions before and finite logits after each draft step
        self.empty_cache = cache
        self.prefill_step = prefill_step or reference.jitted_decode_step(cfg)
        self.name = f"draft model {label or cfg.name}"
        self.cache = cache
        self.cached: list[list[int]] = []
        self.draft_steps = 0

    def prepare(self, prompts: Sequence[Sequence[int]]) -> None:
        _, self.cache = reference.prefill(self.params, self.cfg, prompts, self.empty_cache, step_fn=self.prefill_step,
                                          check=self.check)
        self.cached = [list(p) for p in prompts]
        self.draft_steps = 0

    def _step(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        where = f"draft model step {self.draft_steps + 1}"
        pos = jnp.asarray(positions[:, None], jnp.int32)
        if self.check:
            check_step(pos, self.cache, where=where)
        logits, self.cache = self.decode(jnp.asarray(tokens[:, None], jnp.int32), pos, self.cache)
        if self.check:
            check_finite(logits[:, -1], where=where)
        self.draft_steps += 1
        return np.asarray(jnp.argmax(logits[:, -1], -1))

    def propose(self, histories: Sequence[Sequence[int]], k: int) -> np.ndarray:
        keep, pending = [], []
        for c, h in zip(self.cached, histories):
            n = 0
            limit = min(len(c), len(h) - 1)  # the newest token is always fed: its logits give d_1
            while n < limit and c[n] == h[n]:
                n += 1
            keep.append(n)
            pending.append(list(h[n:]))
        self.cache = self.cache._replace(lengths=jnp.asarray(keep, jnp.int32))  # rollback
        feeds = max(len(p) for p in pending)
        nxt = None
        for j in range(feeds):
            idx = [max(0, len(p) - feeds + j) for p in pending]  # right-aligned
            toks = np.asarray([p[i] for p, i in zip(pending, idx)])
            nxt = self._step(toks, np.asarray(keep) + np.asarray(idx))
        drafts = [nxt]
        pos = np.asarray([len(h) for h in histories])
        for i in range(1, k):
            drafts.append(self._step(drafts[-1], pos + i - 1))
        out = np.stack(drafts, 1).astype(np.int64)
        self.cached = [list(h) + [int(t) for t in out[b, :k - 1]] for b, h in enumerate(histories)]
        return out

    def summary(self) -> dict:
        return {"drafter": self.name, "draft_steps": self.draft_steps}
