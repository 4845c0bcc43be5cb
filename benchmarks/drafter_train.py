"""Train the SmolLM2-135M-Instruct EAGLE-3 drafter on this host (issue 56), JAX + optax.

    python benchmarks/drafter_train.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --data DIR --out DRAFTER_DIR \
        [--draft-vocab 8192 --ttt-steps 4 --batch 4 --epochs 7 --lr 3e-3 --init target]

reads every DIR/train*.npz (and DIR/held_out.npz, when present, for a validation figure each
epoch), all written by benchmarks/drafter_data.py; builds speculators' reduced draft vocabulary
from the training replies' tokens (the `--draft-vocab` most frequent, topped up with the lowest
ids); trains the drafter of benchmarks/drafter_eagle3.py on speculators' objective (forward KL to
the target's distribution over the draft vocabulary, unrolled over `--ttt-steps` chain steps)
with AdamW (gradients clipped at 1, warmup then cosine decay); and writes DRAFTER_DIR in the
speculators eagle3 format (config.json, model.safetensors: what tpumk.draft.load_drafter and
`tpumk generate --draft eagle3:DRAFTER_DIR` read) plus training.json (the recipe, the loss and
agreement of every epoch, the time). After every epoch whose mean held-out agreement is the best
so far the directory is rewritten (whole, renamed into place), so it always holds the best epoch
and a run stopped early (--minutes, or killed) keeps it.

`--init target` starts the decoder layer from the target's last layer (drafter_eagle3.
init_from_target). On this data, 40 steps (batch 4, lr 3e-3, 2 chain steps) from it gave a
held-out step-0 KL of 3.47 nats and greedy agreement 0.204, against 5.46 and 0.178 from
speculators' random init.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import drafter_data  # noqa: E402
import drafter_eagle3 as e3  # noqa: E402


def sequences(d: dict) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens [N], taps [N, 4, H], prompt length) of each sequence of a dataset."""
    s = d["starts"]
    return [(d["tokens"][s[i]:s[i + 1]], d["taps"][s[i]:s[i + 1]], int(d["prompt_lens"][i])) for i in range(len(s) - 1)]


def batches(order: np.ndarray, lengths: np.ndarray, batch: int, bucket: int, rows: int):
    """An epoch's batches: (sequence indices, padded rows) in `order`. bucket 0: every batch in
    order, padded to the longest sequence of all (`rows`); bucket R: windows of 32 batches sorted
    by length, each batch padded to its own longest rounded up to R (fewer padding rows to
    compute; a few shapes, one compile each), the batches of a window kept in `order`'s order
    of their first member. A short last batch is filled from the start of `order`."""
    idx = [order[i:i + batch] for i in range(0, len(order), batch)]
    idx = [np.concatenate([b, order[:batch - len(b)]]) if len(b) < batch else b for b in idx]
    if not bucket:
        return [(b, rows) for b in idx]
    out = []
    for w in range(0, len(idx), 32):
        flat = np.concatenate(idx[w:w + 32])
        flat = flat[np.argsort(lengths[flat], kind="stable")]
        group = [flat[i:i + batch] for i in range(0, len(flat), batch)]
        group.sort(key=lambda b: int(np.argmax(np.isin(order, b))))
        out += [(b, min(rows, -(-int(lengths[b].max() - 1) // bucket) * bucket)) for b in group]
    return out


def make_batch(seqs, rows: int, ttt: int, hidden: int) -> dict[str, np.ndarray]:
    """Sequences -> the arrays of `drafter_eagle3.ttt_loss` (`final` [B, rows + ttt, H]: the final
    norm's output at position r + 1, from which the target logits are taken). Row r: token
    x_{r+1}, taps of position r, position r + 1; the target at step k is position r + 1 + k,
    trained when that position's next token belongs to the reply (r + 1 + k >= prompt length - 1)
    and the position ran (r + 1 + k <= N - 1)."""
    b = len(seqs)
    out = dict(tokens=np.zeros((b, rows + ttt), np.int32), taps=np.zeros((b, rows, 3, hidden), np.float32),
               positions=np.tile(np.arange(1, rows + 1, dtype=np.int32), (b, 1)), valid=np.zeros((b, rows), bool),
               mask=np.zeros((b, ttt, rows), bool), final=np.zeros((b, rows + ttt, hidden), np.float32))
    r = np.arange(rows)
    for i, (tok, taps, plen) in enumerate(seqs):
        n = min(len(tok), rows + 1)
        out["tokens"][i, :n - 1] = tok[1:n]
        out["taps"][i, :n - 1] = taps[:n - 1, :3]
        out["valid"][i, :n - 1] = True
        out["final"][i, :n - 1] = taps[1:n, 3]
        for k in range(ttt):
            p = r + 1 + k
            out["mask"][i, k] = (p >= plen - 1) & (p <= n - 1)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True, type=Path, help="the directory benchmarks/drafter_data.py wrote")
    ap.add_argument("--out", required=True, type=Path, help="the drafter directory to write")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the reduced vocabulary's size (default 4096; with --resume, default the drafter's own: a "
                         "larger N keeps its ids and adds the training replies' most frequent others)")
    ap.add_argument("--ttt-steps", type=int, default=4, help="chain steps unrolled in training (default 4)")
    ap.add_argument("--chain", type=int, default=4, help="speculative_tokens written in the config (default 4)")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (speculators' default 1e-3)")
    ap.add_argument("--minutes", type=float, default=40.0, help="stop at the end of the epoch past this time")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="stored weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default="random", choices=("random", "target"),
                    help="random: speculators' N(0, 0.02) (default); target: the decoder layer from the target's "
                         "last layer, fc passing the last tap through (drafter_eagle3.init_from_target)")
    ap.add_argument("--ffn", type=int, default=None,
                    help="the drafter's MLP width (default the target's, or the resumed drafter's; a larger one "
                         "grows it: the new columns start at zero output, drafter_eagle3.widen_ffn)")
    ap.add_argument("--bucket", type=int, default=0,
                    help="pad each batch to its longest sequence rounded up to this many rows, batches drawn from "
                         "length-sorted windows (default 0: every batch padded to the longest of all, as before)")
    ap.add_argument("--resume", type=Path, help="go on training a drafter directory this script wrote (its weights "
                    "and draft vocabulary, grown to --draft-vocab when that is larger; --init is then not used)")
    a = ap.parse_args(argv)
    if not Path(a.checkpoint).is_file():
        drafter_data.fail(f"--checkpoint {a.checkpoint}: no such file")
    if min(a.draft_vocab or 1, a.ffn or 1, a.ttt_steps, a.chain, a.epochs, a.batch) < 1 or a.lr <= 0:
        drafter_data.fail("--draft-vocab, --ffn, --ttt-steps, --chain, --epochs, --batch and --lr must be positive")
    if a.bucket < 0:
        drafter_data.fail(f"--bucket {a.bucket}: expected 0 (off) or a positive number of rows")

    import jax
    import jax.numpy as jnp
    import optax

    from tpumk.model.gguf import load_gguf

    t_start = time.perf_counter()
    files = sorted(a.data.glob("train*.npz"))
    if not files:
        drafter_data.fail(f"--data {a.data}: no train*.npz (run benchmarks/drafter_data.py first)")
    held = drafter_data.read_dataset(a.data / "held_out.npz") if (a.data / "held_out.npz").is_file() else None
    cfg, target_params = load_gguf(a.checkpoint)
    seqs, metas = [], []
    for f in files:
        d = drafter_data.read_dataset(f)
        meta = d["meta"]
        if meta["hidden_size"] != cfg.hidden_size or meta["vocab_size"] != cfg.vocab_size:
            drafter_data.fail(f"{f}: written for hidden {meta['hidden_size']} / vocabulary {meta['vocab_size']}, "
                              f"the checkpoint has {cfg.hidden_size} / {cfg.vocab_size}")
        if metas and meta["draft_taps"] != metas[0]["draft_taps"]:
            drafter_data.fail(f"{f}: taps {meta['draft_taps']}, {files[0]} has {metas[0]['draft_taps']}")
        seqs += sequences(d)
        metas.append(dict(meta, file=f.name, rows=int(len(d["tokens"]))))
    reply = np.concatenate([t[pl:] for t, _, pl in seqs])
    if a.resume is not None:  # the trained drafter's own vocabulary, so its head rows still mean the same ids
        if not (a.resume / "model.safetensors").is_file():
            drafter_data.fail(f"--resume {a.resume}: no model.safetensors (a directory drafter_train.py wrote)")
        conf = json.loads((a.resume / "config.json").read_text())
        had, had_ffn = int(conf["draft_vocab_size"]), int(conf["transformer_layer_config"]["intermediate_size"])
        s = e3.Shape.for_target(cfg, meta["draft_taps"], had, had_ffn)
        try:
            params, d2t, t2d = e3.load_trained(a.resume, s)
        except ValueError as e:
            drafter_data.fail(f"--resume: {e}")
        if a.draft_vocab is not None and a.draft_vocab < had:
            drafter_data.fail(f"--draft-vocab {a.draft_vocab}: --resume {a.resume} has {had} ids already (it can "
                              "only grow)")
        if a.ffn is not None and a.ffn < had_ffn:
            drafter_data.fail(f"--ffn {a.ffn}: --resume {a.resume} is {had_ffn} wide already (it can only grow)")
        a.draft_vocab = a.draft_vocab or had
        if a.draft_vocab > had:
            d2t, t2d = e3.extend_vocab(d2t, reply, a.draft_vocab, cfg.vocab_size)
            s = e3.Shape.for_target(cfg, meta["draft_taps"], a.draft_vocab, had_ffn)
        a.init = f"resume {a.resume}" + (f" (draft vocabulary {had} -> {a.draft_vocab})" if a.draft_vocab > had else "")
    else:
        a.draft_vocab = a.draft_vocab or 4096
        d2t, t2d = e3.vocab_map(reply, a.draft_vocab, cfg.vocab_size)
        s = e3.Shape.for_target(cfg, meta["draft_taps"], a.draft_vocab)
        params = (e3.init_from_target(s, jax.random.PRNGKey(a.seed), target_params) if a.init == "target" else
                  e3.init_params(s, jax.random.PRNGKey(a.seed), np.asarray(target_params["final_norm"])))
    if a.ffn is not None and a.ffn != s.ffn:  # wider than the target's layer (or the resumed drafter's)
        if a.ffn < s.ffn:
            drafter_data.fail(f"--ffn {a.ffn}: the drafter's MLP starts {s.ffn} wide (the target's layer): expected "
                              "at least that")
        params = e3.widen_ffn(params, s, a.ffn, jax.random.PRNGKey(a.seed + 1))
        a.init += f" (MLP {s.ffn} -> {a.ffn} wide)"
        s = dataclasses.replace(s, ffn=a.ffn)
    frozen = e3.frozen_parts(target_params, d2t)
    rows = max(len(t) for t, _, _ in seqs) - 1
    coverage, held_coverage = float(np.mean(t2d[reply])), None
    if held is not None:
        held_seqs = sequences(held)
        rows = max(rows, max(len(t) for t, _, _ in held_seqs) - 1)
        held_coverage = float(np.mean(t2d[np.concatenate([t[pl:] for t, _, pl in held_seqs])]))
    rows = -(-rows // 8) * 8
    print(f"{len(seqs)} training sequences ({', '.join(f.name for f in files)}), {len(reply)} reply tokens, "
          f"{sum(m['rows'] for m in metas)} rows; draft vocabulary "
          f"{a.draft_vocab} covers {coverage:.4f} of the training replies' tokens, {held_coverage} of the held-out "
          f"replies'; rows padded to {rows}", flush=True)

    steps_per_epoch = -(-len(seqs) // a.batch)
    total = steps_per_epoch * a.epochs
    sched = optax.warmup_cosine_decay_schedule(0.0, a.lr, max(1, total // 20), total, a.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(params)

    def loss_fn(p, batch):
        target = jax.lax.stop_gradient(batch["final"] @ frozen["lm_head"].T)
        b = dict(batch, target=target)
        return e3.ttt_loss(p, frozen, s, b, a.ttt_steps)

    @jax.jit
    def train_step(p, st, batch):
        (loss, (per, agree)), g = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        upd, st = opt.update(g, st, p)
        return optax.apply_updates(p, upd), st, loss, per, agree

    eval_step = jax.jit(loss_fn)

    lengths = np.array([len(t) for t, _, _ in seqs])

    def evaluate(p, eseqs):
        tot = np.zeros((2, a.ttt_steps))
        n = 0
        for i in range(0, len(eseqs), a.batch):
            chunk = eseqs[i:i + a.batch]
            chunk = chunk + [chunk[0]] * (a.batch - len(chunk))  # one shape; the copies weigh like the rest
            _, (per, agree) = eval_step(p, make_batch(chunk, rows, a.ttt_steps, s.hidden))
            tot += np.stack([np.asarray(per), np.asarray(agree)])
            n += 1
        return tot / n

    log = []
    rng = np.random.default_rng(a.seed)
    t_train = time.perf_counter()
    best = -1.0

    def recipe(kept: int) -> dict:
        return dict(data=metas, draft_vocab=a.draft_vocab, reply_coverage=round(coverage, 4),
                    held_out_coverage=held_coverage, ttt_steps=a.ttt_steps, chain=a.chain, batch=a.batch, lr=a.lr,
                    optimizer="adamw, clip 1.0, warmup-cosine", seed=a.seed, init=a.init,
                    rows=rows, bucket=a.bucket, epochs_planned=a.epochs,
                    epochs_run=len(log), weights_of_epoch=kept, train_seconds=round(time.perf_counter() - t_train, 1),
                    total_seconds=round(time.perf_counter() - t_start, 1), log=log, shape=e3.shape_dict(s),
                    jax=jax.__version__, optax=optax.__version__)
    for epoch in range(a.epochs):
        order = rng.permutation(len(seqs))
        t0 = time.perf_counter()
        sums, nb = np.zeros((2, a.ttt_steps)), 0
        for idx, r in batches(order, lengths, a.batch, a.bucket, rows):
            params, opt_state, loss, per, agree = train_step(params, opt_state,
                                                             make_batch([seqs[j] for j in idx], r, a.ttt_steps,
                                                                        s.hidden))
            sums += np.stack([np.asarray(per), np.asarray(agree)])
            nb += 1
            if nb % 6 == 0:
                print(f"  epoch {epoch + 1} step {nb}/{steps_per_epoch}: loss {float(loss):.3f}, "
                      f"agreement by step {np.round(np.asarray(agree), 3).tolist()}", flush=True)
        tr = sums / nb
        entry = dict(epoch=epoch + 1, seconds=round(time.perf_counter() - t0, 1),
                     train_kl=np.round(tr[0], 4).tolist(), train_agreement=np.round(tr[1], 4).tolist())
        if held is not None:
            ev = evaluate(params, held_seqs)
            entry.update(held_out_kl=np.round(ev[0], 4).tolist(), held_out_agreement=np.round(ev[1], 4).tolist())
        log.append(entry)
        print(f"epoch {epoch + 1}: {entry}", flush=True)
        # The directory always holds the best epoch so far (by mean held-out agreement over the
        # chain steps; the newest without held-out data): a run stopped early keeps its best.
        score = float(np.mean(entry["held_out_agreement"])) if held is not None else float(epoch)
        if score > best:
            best = score
            e3.save(a.out, params, frozen, s, d2t, t2d, a.chain, a.dtype, extra={"training.json": recipe(epoch + 1)})
            print(f"  wrote {a.out} (epoch {epoch + 1})", flush=True)
        if (time.perf_counter() - t_train) / 60 > a.minutes:
            print(f"stopping after epoch {epoch + 1}: past --minutes {a.minutes}", flush=True)
            break
    train_seconds = time.perf_counter() - t_train
    kept = json.loads((a.out / "training.json").read_text())["weights_of_epoch"]
    (a.out / "training.json").write_text(json.dumps(recipe(kept), indent=2) + "\n")  # the whole log
    print(f"{a.out} holds epoch {kept} ({a.dtype}); training {train_seconds:.0f} s, all "
          f"{time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
