"""The acceptance length of a trained EAGLE-3 drafter on held-out prompts, greedy (issue 56).

    python benchmarks/drafter_acceptance.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --drafter DIR \
        [--split held_out] [--max-new 128] [--chain 4] [--plain DIR/held_out.npz] [--json FILE]

Each prompt (the checkpoint's chat template around it, as benchmarks/drafter_data.py renders it)
is prefilled by the target with its taps; then speculative rounds until the reply ends (the
end-of-turn token) or has `--max-new` tokens: the drafter proposes a greedy chain of `--chain`
tokens from the newest token and the target's taps, ONE target step verifies the newest token
and the chain together (q = chain + 1, with taps), the longest prefix of the chain that equals
the target's own greedy tokens is accepted, and the target's token after it (the bonus) is
committed too. The acceptance length is the tokens committed per target step, pooled over every
round of every prompt: (accepted drafts + 1) averaged; rounds end at the end-of-turn token.

The target step is a function (`verify(tokens, positions, cache) -> (logits, cache, taps)`):
`reference_verify` is tpumk's reference (`tpumk.model.reference.decode_step(..., taps=...)`);
the megakernel's verify step with taps has the same signature and plugs in there.

`--plain` (a dataset benchmarks/drafter_data.py wrote for the same split, greedy) checks that the
speculative replies equal the target's plain greedy replies (as far as both go), prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import drafter_data  # noqa: E402
import drafter_eagle3 as e3  # noqa: E402


def reference_verify(target: "drafter_data.Target"):
    """The target step through tpumk's reference: tokens / positions [B, q], the paged cache ->
    (logits [B, q, V], cache, taps [B, q, 4, H])."""
    return lambda tokens, positions, cache: target.step(target.params, tokens, positions, cache)


class Eagle3Chain:
    """The drafter as the loop drives it, jitted: `absorb` after every target step (the step's
    taps, tokens, positions and which rows are committed) and `propose` (the greedy chain from
    the newest token). tpumk.draft's drafters (issue 56's interface) take the same two calls."""

    def __init__(self, path: Path, target):
        import jax

        self.params, self.frozen, self.shape, self.chain = e3.load(path, target.cfg, target.params)
        if self.shape.taps != target.taps[:-1]:
            raise ValueError(f"{path / 'config.json'}: eagle_aux_hidden_state_layer_ids {list(self.shape.taps)}, "
                             f"the loop taps the target at {list(target.taps[:-1])}")
        p, f, s = self.params, self.frozen, self.shape
        self.absorb = jax.jit(lambda c, taps, tok, pos, valid: e3.absorb(p, f, s, c, taps, tok, pos, valid))
        self._propose = jax.jit(lambda c, a, pos, k: e3.propose(p, f, s, c, a, pos, k), static_argnums=(3,))

    def init_cache(self, batch: int, context: int):
        return e3.init_cache(self.shape, batch, context)

    def propose(self, cache, anchor, anchor_pos, k: int):
        drafts, _, cache = self._propose(cache, anchor, anchor_pos, k)
        return drafts, cache


def greedy_rounds(verify, target, drafter: Eagle3Chain, prompts: list[list[int]], max_new: int, chain: int,
                  log=print) -> dict:
    """Speculative greedy generation of every prompt at once (module doc). Returns per prompt
    the committed reply and the accepted count of each round, and the pooled figures."""
    import jax.numpy as jnp

    b = len(prompts)
    width = max(map(len, prompts))
    context = width + max_new + chain + 1
    cache = target.init_cache(b, context)
    logits, cache, taps = target.prefill(prompts, cache, width)
    lens = np.asarray([len(p) for p in prompts], np.int32)
    pos = np.tile(np.arange(width, dtype=np.int32), (b, 1))
    toks = np.asarray([p + [0] * (width - len(p)) for p in prompts], np.int32)
    dcache = drafter.absorb(drafter.init_cache(b, context), taps[:, :, :3], jnp.asarray(toks), jnp.asarray(pos),
                            jnp.asarray(pos < lens[:, None]))
    rows = jnp.arange(b)
    anchor = jnp.argmax(logits[rows, jnp.asarray(lens - 1)], -1).astype(jnp.int32)
    anchor_pos = jnp.asarray(lens)
    replies = [[int(t)] for t in np.asarray(anchor)]
    accepted: list[list[int]] = [[] for _ in range(b)]
    done = np.asarray([r[0] == target.eos for r in replies])
    steps = 0
    while not done.all():
        drafts, dcache = drafter.propose(dcache, anchor, anchor_pos, chain)
        seq = jnp.concatenate([anchor[:, None], drafts], 1)
        live = jnp.asarray(~done)[:, None]
        run_pos = anchor_pos[:, None] + jnp.arange(chain + 1)[None]
        # roll back to the committed length (rows past it are overwritten); a copy: the step donates the cache
        cache = cache._replace(lengths=jnp.array(anchor_pos))
        logits, cache, vtaps = verify(jnp.where(live, seq, -1), run_pos, cache)  # a finished row writes nothing
        steps += 1
        greedy = np.asarray(jnp.argmax(logits, -1))  # [B, chain + 1]: the target's token after each row
        d = np.asarray(drafts)
        match = np.cumprod(d == greedy[:, :chain], axis=1)
        n = match.sum(1)  # accepted drafts
        bonus = greedy[np.arange(b), n]
        for i in np.flatnonzero(~done):
            new = d[i, :n[i]].tolist() + [int(bonus[i])]
            if target.eos in new:
                new = new[:new.index(target.eos) + 1]
            replies[i] += new
            accepted[i].append(len(new) - 1)
            done[i] = new[-1] == target.eos or len(replies[i]) >= max_new
        # the anchor and the accepted drafts are committed context now; the bonus is the next anchor
        dcache = drafter.absorb(dcache, vtaps[:, :, :3], seq, run_pos,
                                (jnp.arange(chain + 1)[None] <= jnp.asarray(n)[:, None]) & live)
        anchor = jnp.asarray(bonus, jnp.int32)
        anchor_pos = anchor_pos + jnp.asarray(n) + 1
        if steps % 10 == 0:
            log(f"  round {steps}: {int((~done).sum())} prompts still writing")
    rounds = sum(len(a) for a in accepted)
    committed = sum(sum(a) + len(a) for a in accepted)
    depth = np.zeros(chain)
    for a in accepted:
        for n_acc in a:
            depth[:n_acc] += 1
    return dict(replies=replies, accepted=accepted, rounds=rounds, target_steps=steps, committed=committed,
                acceptance_length=committed / rounds, draft_acceptance_by_depth=(depth / rounds).round(4).tolist())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--drafter", required=True, type=Path, help="a speculators eagle3 directory")
    ap.add_argument("--split", default="held_out", choices=drafter_data.SPLITS)
    ap.add_argument("--max-new", type=int, default=128, help="reply tokens per prompt at most (default 128)")
    ap.add_argument("--chain", type=int, default=0, help="drafts per round (default: the drafter's speculative_tokens)")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    ap.add_argument("--plain", type=Path, help="benchmarks/drafter_data.py's greedy dataset of the split, to compare")
    ap.add_argument("--json", type=Path, help="write the figures (and every reply) here")
    a = ap.parse_args(argv)
    for flag, path in (("--checkpoint", Path(a.checkpoint)), ("--drafter", a.drafter / "config.json")):
        if not path.is_file():
            drafter_data.fail(f"{flag} {path}: no such file")
    if a.max_new < 1 or a.chain < 0:
        drafter_data.fail("--max-new must be positive, --chain not negative")
    t0 = time.perf_counter()
    target = drafter_data.Target.from_gguf(a.checkpoint)
    try:
        drafter = Eagle3Chain(a.drafter, target)
    except (ValueError, KeyError, OSError) as e:  # a config or tensor file that is not a drafter of this target
        drafter_data.fail(f"--drafter {a.drafter}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    chain = a.chain or drafter.chain
    prompts = drafter_data.load_prompts(a.split)[:a.limit or None]
    ids = [target.chat_ids(p) for p in prompts]
    print(f"{len(prompts)} {a.split} prompts, chain {chain}, max_new {a.max_new}, drafter {a.drafter}", flush=True)
    res = greedy_rounds(reference_verify(target), target, drafter, ids, a.max_new, chain,
                        log=lambda m: print(m, flush=True))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"acceptance length {res['acceptance_length']:.3f} tokens per target step ({res['committed']} tokens "
          f"committed in {res['rounds']} rounds; {res['target_steps']} batched target steps), drafts accepted by "
          f"depth {res['draft_acceptance_by_depth']}; {res['seconds']:.0f} s")
    if a.plain is not None:
        plain = drafter_data.read_dataset(a.plain)
        s = plain["starts"]
        same = 0
        for i, p in enumerate(ids):
            want = plain["tokens"][s[i] + len(p):s[i + 1]].tolist()
            got = res["replies"][i]
            k = min(len(want), len(got))
            same += want[:k] == got[:k]
        res["equal_to_plain_greedy"] = f"{same}/{len(ids)}"
        print(f"replies equal to the plain greedy replies (as far as both go): {same}/{len(ids)}")
    if a.json is not None:
        doc = dict(res, split=a.split, chain=chain, max_new=a.max_new, prompts=len(ids), drafter=str(a.drafter),
                   verify="tpumk.model.reference.decode_step (taps)")
        a.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
