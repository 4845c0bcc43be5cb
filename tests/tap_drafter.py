"""A small drafter for testing the speculative rounds (tpumk.draft.rounds) apart from any
published format: it follows tpumk.draft's Drafter contract and reads the target's taps, so a
wrong tap row or a wrong absorb shows in its proposals; its quality does not matter (acceptance
never changes greedy tokens).

Proposal: h = the last absorbed row's taps (flattened), logits_1 = h . W + U[anchor],
logits_i = h . W + U[d_(i-1)]; greedy takes the argmax, sampled draws at `temperature`. With
`bigram`, a greedy draft after token t is the token that followed t last in the absorbed
context when there is one (a device-side prompt lookup: greedy text of tiny random models
repeats, so drafts are often accepted and every acceptance count shows up)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class TapDrafter:
    taps: tuple[int, ...]
    block: int
    hidden: int
    vocab: int
    bigram: bool = False
    kind: str = "test-taps"

    def params(self, seed: int = 0, scale: float = 1.0):
        rng = np.random.default_rng(seed)
        return {"W": jnp.asarray(rng.standard_normal((len(self.taps) * self.hidden, self.vocab)) * scale / 8, jnp.float32),
                "U": jnp.asarray(rng.standard_normal((self.vocab, self.vocab)) * scale, jnp.float32)}

    def init_state(self, batch: int, context: int):
        return {"h": jnp.zeros((batch, len(self.taps) * self.hidden), jnp.float32),
                "next": jnp.full((batch, self.vocab), -1, jnp.int32), "last": jnp.full((batch,), -1, jnp.int32)}

    def absorb(self, dparams, tparams, state, hidden, tokens, positions, valid):
        b, q = tokens.shape
        last = jnp.max(jnp.where(valid, jnp.arange(q)[None, :], -1), axis=1)  # the last valid row, or -1
        rows = hidden.reshape(b, q, -1).astype(jnp.float32)
        h = jnp.take_along_axis(rows, jnp.maximum(last, 0)[:, None, None], 1)[:, 0]
        nxt, prev = state["next"], state["last"]
        for i in range(q):  # the bigram memory, row by row (valid rows are a prefix)
            ok = valid[:, i] & (prev >= 0)
            nxt = jax.vmap(lambda t, p_, v, o: jnp.where(o, t.at[p_].set(v), t))(nxt, jnp.maximum(prev, 0),
                                                                              tokens[:, i], ok)
            prev = jnp.where(valid[:, i], tokens[:, i], prev)
        return {"h": jnp.where((last >= 0)[:, None], h, state["h"]), "next": nxt, "last": prev}

    def propose(self, dparams, tparams, state, anchor, anchor_pos, key, temperature):
        base = state["h"] @ dparams["W"]
        prev, drafts, probs = anchor, [], []
        keys = jax.random.split(key, self.block) if key is not None else [None] * self.block
        for i in range(self.block):
            logits = (base + dparams["U"][prev]) / temperature
            p = jax.nn.softmax(logits, -1)
            d = jnp.argmax(logits, -1) if key is None else jax.random.categorical(keys[i], logits, axis=-1)
            if self.bigram and key is None:
                seen = jnp.take_along_axis(state["next"], prev[:, None], 1)[:, 0]
                d = jnp.where(seen >= 0, seen, d)
            drafts.append(d.astype(jnp.int32))
            probs.append(p)
            prev = d
        return jnp.stack(drafts, 1), jnp.stack(probs, 1), state


@dataclass(frozen=True)
class ScriptDrafter:
    """Proposes the tokens a script says come next (the plain greedy run's own tokens), each
    draft at a position divisible by `corrupt_every` replaced by another token: every round
    accepts a different number of drafts, all k of them included, so the acceptance, the
    emission and the roll back are exercised at every count. Reads no taps."""

    script: tuple[tuple[int, ...], ...]  # per sequence: prompt + greedy tokens, by position
    taps: tuple[int, ...]
    block: int
    vocab: int
    corrupt_every: int = 4
    kind: str = "test-script"

    def init_state(self, batch: int, context: int):
        width = max(len(s) for s in self.script) + self.block + 1
        table = np.zeros((batch, width), np.int32)
        for b, s in enumerate(self.script):
            table[b, :len(s)] = s
        return {"script": jnp.asarray(table)}

    def absorb(self, dparams, tparams, state, hidden, tokens, positions, valid):
        return state

    def propose(self, dparams, tparams, state, anchor, anchor_pos, key, temperature):
        at = anchor_pos[:, None] + jnp.arange(1, self.block + 1)[None, :]
        d = jnp.take_along_axis(state["script"], jnp.minimum(at, state["script"].shape[1] - 1), 1)
        d = jnp.where(at % self.corrupt_every == 0, (d + 1) % self.vocab, d)
        return d.astype(jnp.int32), jax.nn.one_hot(d, self.vocab, dtype=jnp.float32), state
