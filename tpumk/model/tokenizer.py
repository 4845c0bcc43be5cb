"""Text <-> token ids for `tpumk generate --prompt`: a checkpoint directory's `tokenizer.json`,
or a GGUF file's own vocabulary, both run by the `tokenizers` package.

A GGUF vocabulary is supported when it is byte-level BPE (`tokenizer.ggml.model` "gpt2", the
model of GPT-2, Llama 3, Qwen, SmolLM): `tokenizer.ggml.tokens` are the vocabulary in id order,
`tokenizer.ggml.merges` the merge list, and `tokenizer.ggml.pre` names how llama.cpp splits text
before merging; only the splits listed in `_PRE_SPLITS` are modelled (another split gives other
ids, so it is refused). Tokens `tokenizer.ggml.token_type` marks CONTROL (3, e.g. <|im_end|>)
or USER_DEFINED (4) are matched whole; `tokenizer.ggml.add_bos_token` prepends the BOS id.
Llama 3's split and SentencePiece vocabularies (`llama`) are not modelled yet.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

from tpumk.errors import CheckpointError, NotSupportedError, one_line
from tpumk.files import TEXT_LIMIT, is_dir, name_problem, read_regular, shown
from tpumk.model.gguf_file import INTEGERS, is_gguf_path, open_gguf

TOKENIZER_FILE = "tokenizer.json"
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2's split (llama.cpp's
# "smollm" pre-tokenizer does, as SmolLM's tokenizer.json does with its Digits step).
_PRE_SPLITS = {"default": False, "gpt2": False, "smollm": True}


def _is_panic(e: BaseException) -> bool:
    """A Rust panic inside `tokenizers`: pyo3's PanicException, which derives from BaseException,
    not Exception (so `except Exception` lets it through as a traceback), and cannot be imported."""
    return type(e).__name__ == "PanicException"


@contextlib.contextmanager
def backend_call(what: str):
    """A call into `tokenizers` (Rust): its errors and its panics (a regex past Oniguruma's retry
    limit, a template naming a token the vocabulary lacks) become one CheckpointError line,
    `what` first. Rust's panic hook writes its own report (a backtrace too under RUST_BACKTRACE)
    straight to file descriptor 2; that is held while the call runs, dropped if it panicked (the
    one line says what the panic said) and passed on otherwise."""
    held = _hold_stderr()
    panicked = False
    try:
        yield
    except Exception as e:  # tokenizers raises plain Exception for what it refuses
        raise CheckpointError(f"{what} ({one_line(str(e))[:200]})") from None
    except BaseException as e:
        if not _is_panic(e):
            raise  # KeyboardInterrupt, SystemExit
        panicked = True
        raise CheckpointError(f"{what} (the tokenizers library panicked: {one_line(str(e))[:200]})") from None
    finally:
        _release_stderr(held, keep=not panicked)


def _hold_stderr():
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no descriptor 2 (a daemon): nothing to hold
        return None
    spool = tempfile.TemporaryFile()
    os.dup2(spool.fileno(), 2)
    return saved, spool


def _release_stderr(held, keep: bool) -> None:
    if held is None:
        return
    saved, spool = held
    os.dup2(saved, 2)
    os.close(saved)
    with spool:
        if keep:
            spool.seek(0)
            data = spool.read()
            if data:
                os.write(2, data)


class Tokenizer:
    """encode(text) -> ids and decode(ids) -> text over a `tokenizers.Tokenizer`."""

    def __init__(self, backend, source: str, bos_id: int | None = None):
        self.backend, self.source, self.bos_id = backend, source, bos_id

    def encode(self, text: str) -> list[int]:
        with backend_call(f"{shown(self.source)}: the tokenizer cannot encode the prompt"):
            ids = self.backend.encode(text).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        with backend_call(f"{shown(self.source)}: the tokenizer cannot decode the generated ids"):
            return self.backend.decode(list(ids), skip_special_tokens=False)


def from_tokenizer_json(path: str | Path) -> Tokenizer:
    """A Hugging Face `tokenizer.json` (its post-processor adds any BOS the model expects). Its
    padding and truncation are switched off, as transformers' encode(text) does: a prompt is one
    sequence, never padded or cut (and a padding of 10**12 tokens would abort the process)."""
    from tokenizers import Tokenizer as Backend

    raw = read_regular(path, 4 * TEXT_LIMIT, "expected a tokenizer.json", CheckpointError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{shown(path)}: not a text file (expected a tokenizer.json)") from None
    with backend_call(f"{shown(path)}: not a readable tokenizer.json"):
        backend = Backend.from_str(text)
        backend.no_padding()
        backend.no_truncation()
    return Tokenizer(backend, str(path))


def from_gguf(path: str | Path) -> Tokenizer:
    """The byte-level BPE vocabulary a GGUF file carries (see the module doc). Every field must
    have the GGUF type llama.cpp reads it as (a BOOL add_bos_token, integer token ids inside the
    vocabulary, a token type for every token)."""
    from gguf.constants import GGUFValueType
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend


    g = open_gguf(path)  # the parse load_gguf uses too (cached)
    src = g.src
    string = {GGUFValueType.STRING}
    kind = g.typed("tokenizer.ggml.model", string, "a STRING")
    if kind is None:
        raise CheckpointError(f"{src}: no tokenizer in the file (metadata field 'tokenizer.ggml.model' missing)")
    if kind != "gpt2":
        raise NotSupportedError(f"{src}: not supported yet: tokenizer.ggml.model {kind!r} (supported: 'gpt2', "
                                "byte-level BPE)")
    pre = g.typed("tokenizer.ggml.pre", string, "a STRING", "default")
    if pre not in _PRE_SPLITS:
        raise NotSupportedError(f"{src}: not supported yet: tokenizer.ggml.pre {pre!r} (supported: "
                                f"{', '.join(sorted(_PRE_SPLITS))})")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in g.fields:
            raise CheckpointError(f"{src}: missing metadata field '{key}' (an ARRAY of STRING)")
    tokens, merges = g.strings("tokenizer.ggml.tokens"), g.strings("tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.merges' holds {bad[:80]!r}, expected two "
                              "tokens separated by one space")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.tokens' repeats a token")
    types = []
    if "tokenizer.ggml.token_type" in g.fields:
        types = g.integers("tokenizer.ggml.token_type").tolist()
        if len(types) != len(tokens):
            raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.token_type' has {len(types):,} entries, "
                                  f"expected one per token ({len(tokens):,})")
    ids = {}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        v = g.typed(key, INTEGERS, "a token id (an integer type)")
        if v is not None and not 0 <= v < len(tokens):
            raise CheckpointError(f"{src}: metadata field '{key}' = {v}: expected a token id below {len(tokens):,}")
        ids[key] = v
    add_bos = g.typed("tokenizer.ggml.add_bos_token", {GGUFValueType.BOOL}, "a BOOL", False)
    bos = ids["tokenizer.ggml.bos_token_id"] if add_bos else None
    if add_bos and bos is None:
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.add_bos_token' is true but there is no "
                              "'tokenizer.ggml.bos_token_id'")
    with backend_call(f"{src}: metadata field 'tokenizer.ggml.merges'"):  # a merge naming a token outside the vocabulary
        backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    with backend_call(f"{src}: the GGUF vocabulary"):
        split = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
        steps = ([pre_tokenizers.Digits(individual_digits=True)] if _PRE_SPLITS[pre] else []) + [
            split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        # llama.cpp matches control and user-defined tokens whole, never cut by the split or merges.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return Tokenizer(backend, f"{path} (GGUF vocabulary)", bos)


def load_tokenizer(checkpoint: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint: a GGUF file's vocabulary, or a directory's tokenizer.json."""
    p = Path(checkpoint)
    for q in (p, p / TOKENIZER_FILE):  # exists() raises on a name the OS refuses
        if name_problem(q):
            raise CheckpointError(f"{shown(q)}: {name_problem(q)}")
    if is_gguf_path(p):
        return from_gguf(p)
    if is_dir(p) and (p / TOKENIZER_FILE).exists():
        return from_tokenizer_json(p / TOKENIZER_FILE)
    raise CheckpointError(f"{shown(p)}: --prompt needs a tokenizer: a GGUF file, or a checkpoint directory with "
                          f"{TOKENIZER_FILE} (or give --prompt-ids)")
