"""The acceptance length of a trained EAGLE-3 drafter on held-out prompts, greedy, through tpumk
(issue 56).

    python benchmarks/drafter_acceptance.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --drafter DIR \
        [--split held_out] [--max-new 128] [--block K] [--more-blocks 4,5] [--limit N]
        [--megakernel 4 --megakernel-new 16] [--json F]

The drafter is read as `tpumk generate --draft eagle3:DIR` reads it (tpumk.decode.drafted.load:
tpumk.draft.load_drafter on the speculators directory), the target from the GGUF file
(tpumk.decode.generate.load_model), and every prompt (the checkpoint's chat template around it,
as benchmarks/drafter_data.py renders it) runs through tpumk's device-loop speculative rounds
(tpumk.decode.drafted.generate -> tpumk.draft.rounds.generate): the prompts prefilled by the
reference with the drafter's taps, then rounds of K greedy drafts verified by ONE target step
(q = K + 1, with taps: tpumk's reference step), the longest prefix equal to the target's own
greedy tokens accepted plus the target's next token. One round per device call, so the host sees
each round's committed count (rounds.generate's on_call).

The acceptance length is the tokens committed per verify step, counted over each reply up to its
end-of-turn token (or `--max-new` tokens): for each prompt, the reply tokens after the prefill's
first one, up to and including the end-of-turn, over the verify steps it took to commit them,
pooled over all prompts (tokens past the end-of-turn, which the rounds also write, are not
counted; the figure over every written token is printed too). The tokens are checked against
plain greedy decoding of the same prompts (tpumk.decode.generate.generate, the reference step,
one token a step).

`--megakernel N`: the first N prompts again, `--megakernel-new` tokens each, with the megakernel's
verify step (Pallas interpret mode on this host) and with the reference's, which must give the
same tokens and the same verify steps per prompt.

`--more-blocks 4,5`: the same prompts again with those drafts per round (the drafter's chain run
longer or shorter than its config's), each checked against the same plain greedy tokens.
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


class RoundTrace:
    """rounds.generate's on_call with one round per call: each round's committed tokens per
    sequence (0 where the sequence had already finished)."""

    def __init__(self):
        self.per_round: list[np.ndarray] = []
        self._last = None

    def __call__(self, carry) -> None:
        now = np.asarray(carry.committed)
        self.per_round.append(now - (self._last if self._last is not None else 0))
        self._last = now


def reply_acceptance(tokens: list[list[int]], trace: RoundTrace, eos: int, block: int) -> dict:
    """Per prompt, the rounds until its reply ends (the end-of-turn token, or all its tokens):
    tokens[b][0] came from the prefill; round r commits trace.per_round[r][b] tokens. Returns the
    pooled acceptance length (reply tokens after the first / the verify steps that wrote them),
    the accepted drafts of each counted round, and drafts accepted by depth (share of rounds)."""
    commits = np.stack(trace.per_round, 1) if trace.per_round else np.zeros((len(tokens), 0), int)
    accepted, written, steps = [], 0, 0
    depth = np.zeros(block)
    for b, row in enumerate(tokens):
        end = row.index(eos) + 1 if eos in row else len(row)
        have, mine = 1, []
        for c in commits[b]:
            if have >= end or c == 0:
                break
            mine.append(int(c) - 1)
            have += int(c)
        accepted.append(mine)
        written += end - 1
        steps += len(mine)
        for n in mine:
            depth[:n] += 1
    return dict(acceptance_length=written / max(steps, 1), reply_tokens=written, verify_steps=steps,
                accepted=accepted, drafts_accepted_by_depth=(depth / max(steps, 1)).round(4).tolist())


def speculative(m, drafter, prompts: list[list[int]], steps: int, eos: int, backend: str) -> dict:
    """tpumk's rounds over `prompts` (one round per device call) -> the tokens, the figures to the
    end of each reply (`reply_acceptance`) and rounds.RoundStats' over every written token."""
    from tpumk.decode import drafted

    trace = RoundTrace()
    t0 = time.perf_counter()
    out = drafted.generate(m, prompts, steps, drafter, backend=backend, rounds_per_call=1, on_call=trace)
    res = reply_acceptance(out["tokens"], trace, eos, drafter.block)
    res.update(tokens=out["tokens"], seconds=round(time.perf_counter() - t0, 1),
               all_tokens_acceptance_length=out["spec"]["mean_acceptance_length"],
               verify_steps_per_sequence=out["spec"]["verify_steps_per_sequence"],
               committed_per_sequence=out["spec"]["committed_per_sequence"])
    return res


def same_as_plain(got: list[list[int]], plain: list[list[int]], eos: int) -> tuple[int, list[int]]:
    """How many replies equal the plain greedy ones up to the end of the reply, and where each
    differing one first differs."""
    same, where = 0, []
    for b, (g, p) in enumerate(zip(got, plain)):
        end = p.index(eos) + 1 if eos in p else len(p)
        if g[:end] == p[:end]:
            same += 1
        else:
            where.append(next(i for i in range(end) if g[i] != p[i]))
    return same, where


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--drafter", required=True, type=Path, help="a speculators eagle3 directory (drafter_train.py's)")
    ap.add_argument("--split", default="held_out", choices=drafter_data.SPLITS)
    ap.add_argument("--max-new", type=int, default=128, help="tokens per prompt at most (default 128)")
    ap.add_argument("--block", type=int, default=0, help="drafts per round (default: the drafter's speculative_tokens)")
    ap.add_argument("--more-blocks", default="", metavar="K,K", help="also run the prompts with these drafts per round")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    ap.add_argument("--megakernel", type=int, default=0, metavar="N",
                    help="also run the first N prompts with the megakernel's verify step (interpret mode)")
    ap.add_argument("--megakernel-new", type=int, default=16, help="tokens per prompt of that run (default 16)")
    ap.add_argument("--json", type=Path, help="write the figures (and every reply) here")
    a = ap.parse_args(argv)
    if not Path(a.checkpoint).is_file():
        drafter_data.fail(f"--checkpoint {a.checkpoint}: no such file")
    if min(a.max_new, a.megakernel_new) < 1 or min(a.block, a.limit, a.megakernel) < 0:
        drafter_data.fail("--max-new and --megakernel-new must be positive, --block, --limit and --megakernel "
                          "not negative")
    try:
        more = [int(k) for k in a.more_blocks.split(",") if k.strip()]
    except ValueError:
        more = [0]
    if min(more, default=1) < 1:
        drafter_data.fail(f"--more-blocks {a.more_blocks}: expected positive integers separated by commas")
    from tpumk.decode import drafted
    from tpumk.decode.generate import generate, load_model
    from tpumk.errors import TpumkError

    t0 = time.perf_counter()
    m = load_model(None, a.checkpoint)
    chat = drafter_data.Chat(a.checkpoint)
    try:
        drafter = drafted.load(f"eagle3:{a.drafter}", m.cfg, None, block=a.block or None, target_params=m.params)
    except TpumkError as e:
        drafter_data.fail(f"--drafter {a.drafter}: {e}")
    prompts = drafter_data.load_prompts(a.split)[:a.limit or None]
    ids = [chat.ids(p) for p in prompts]
    print(f"{len(ids)} {a.split} prompts, {drafter!r}, max_new {a.max_new}; target and drafter read in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    res = speculative(m, drafter, ids, a.max_new, chat.eos, "reference")
    t1 = time.perf_counter()
    plain = generate(m, ids, a.max_new, backend="reference")["tokens"]
    plain_seconds = time.perf_counter() - t1
    same, where = same_as_plain(res["tokens"], plain, chat.eos)
    print(f"reference verify, block {drafter.block}: acceptance length {res['acceptance_length']:.3f} tokens per "
          f"verify step ({res['reply_tokens']} reply tokens in {res['verify_steps']} verify steps, to each reply's "
          f"end), drafts accepted by depth {res['drafts_accepted_by_depth']}; over every written token "
          f"{res['all_tokens_acceptance_length']:.3f}; {res['seconds']:.0f} s")
    print(f"replies equal to plain greedy decoding (to the reply's end): {same}/{len(ids)}"
          + (f"; the others first differ at reply token {where}" if where else "") + f" ({plain_seconds:.0f} s)")
    doc = dict(split=a.split, prompts=len(ids), block=drafter.block, max_new=a.max_new, drafter=str(a.drafter),
               reference={k: v for k, v in res.items()}, plain_greedy_equal=f"{same}/{len(ids)}",
               plain_first_difference=where)
    for k in more:
        try:
            other = drafted.load(f"eagle3:{a.drafter}", m.cfg, None, block=k, target_params=m.params)
        except TpumkError as e:
            drafter_data.fail(f"--more-blocks {k}: {e}")
        r = speculative(m, other, ids, a.max_new, chat.eos, "reference")
        s, w = same_as_plain(r["tokens"], plain, chat.eos)
        print(f"reference verify, block {k}: acceptance length {r['acceptance_length']:.3f} tokens per verify step "
              f"({r['reply_tokens']} reply tokens in {r['verify_steps']} verify steps), drafts accepted by depth "
              f"{r['drafts_accepted_by_depth']}; over every written token {r['all_tokens_acceptance_length']:.3f}; "
              f"equal to plain greedy {s}/{len(ids)}; {r['seconds']:.0f} s", flush=True)
        doc.setdefault("more_blocks", {})[str(k)] = dict(reference=r, plain_greedy_equal=f"{s}/{len(ids)}",
                                                          plain_first_difference=w)
    if a.megakernel:
        sub = ids[:a.megakernel]
        ref = speculative(m, drafter, sub, a.megakernel_new, chat.eos, "reference")
        mk = speculative(m, drafter, sub, a.megakernel_new, chat.eos, "megakernel")
        agree = (mk["tokens"] == ref["tokens"]
                 and mk["verify_steps_per_sequence"] == ref["verify_steps_per_sequence"]
                 and mk["committed_per_sequence"] == ref["committed_per_sequence"])
        print(f"megakernel verify (interpret mode), first {len(sub)} prompts, {a.megakernel_new} tokens each: "
              f"acceptance length {mk['acceptance_length']:.3f} ({mk['reply_tokens']} tokens in "
              f"{mk['verify_steps']} verify steps), reference verify {ref['acceptance_length']:.3f}; same tokens and "
              f"verify steps as the reference: {'yes' if agree else 'NO'} ({mk['seconds']:.0f} s, reference "
              f"{ref['seconds']:.0f} s)")
        doc["megakernel"] = dict(prompts=len(sub), max_new=a.megakernel_new, same_as_reference=agree,
                                 megakernel=mk, reference=ref)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
