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

from pathlib import Path

from tpumk.errors import CheckpointError, NotSupportedError, one_line
from tpumk.files import TEXT_LIMIT, is_dir, read_regular, shown

TOKENIZER_FILE = "tokenizer.json"
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2's split (llama.cpp's
# "smollm" pre-tokenizer does, as SmolLM's tokenizer.json does with its Digits step).
_PRE_SPLITS = {"default": False, "gpt2": False, "smollm": True}


class Tokenizer:
    """encode(text) -> ids and decode(ids) -> text over a `tokenizers.Tokenizer`."""

    def __init__(self, backend, source: str, bos_id: int | None = None):
        self.backend, self.source, self.bos_id = backend, source, bos_id

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def from_tokenizer_json(path: str | Path) -> Tokenizer:
    """A Hugging Face `tokenizer.json` (its post-processor adds any BOS the model expects)."""
    from tokenizers import Tokenizer as Backend

    raw = read_regular(path, 4 * TEXT_LIMIT, "expected a tokenizer.json", CheckpointError)
    try:
        backend = Backend.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception subclass for a malformed file
        raise CheckpointError(f"{shown(path)}: not a readable tokenizer.json ({one_line(e)[:200]})") \
            from None
    return Tokenizer(backend, str(path))


def from_gguf(path: str | Path) -> Tokenizer:
    """The byte-level BPE vocabulary a GGUF file carries (see the module doc)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from tpumk.model.gguf import open_gguf

    src = shown(path)
    fields = open_gguf(path).fields  # the reader load_gguf uses too (cached)

    def value(key: str, default=None):
        return fields[key].contents() if key in fields else default

    kind = value("tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{src}: no tokenizer in the file (metadata field 'tokenizer.ggml.model' missing)")
    if kind != "gpt2":
        raise NotSupportedError(f"{src}: not supported yet: tokenizer.ggml.model {kind!r} (supported: 'gpt2', "
                                "byte-level BPE)")
    pre = value("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise NotSupportedError(f"{src}: not supported yet: tokenizer.ggml.pre {pre!r} (supported: "
                                f"{', '.join(sorted(_PRE_SPLITS))})")
    tokens = value("tokenizer.ggml.tokens")
    merges = value("tokenizer.ggml.merges")
    for key, got in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges)):
        if not isinstance(got, list) or not all(isinstance(t, str) for t in got):
            raise CheckpointError(f"{src}: metadata field '{key}' missing or not a list of strings")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.merges' holds {bad!r}, expected two tokens "
                              "separated by one space")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.tokens' repeats a token")
    try:
        backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # a merge naming a token outside the vocabulary
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.merges': {one_line(e)[:200]}") \
            from None
    split = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
    steps = ([pre_tokenizers.Digits(individual_digits=True)] if _PRE_SPLITS[pre] else []) + [
        split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    types = value("tokenizer.ggml.token_type", [])
    # llama.cpp matches control and user-defined tokens whole, never cut by the split or merges.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos = value("tokenizer.ggml.bos_token_id") if value("tokenizer.ggml.add_bos_token", False) else None
    if bos is not None and not (isinstance(bos, int) and 0 <= bos < len(tokens)):
        raise CheckpointError(f"{src}: metadata field 'tokenizer.ggml.bos_token_id' = {bos!r}: expected a token id "
                              f"below {len(tokens)}")
    return Tokenizer(backend, f"{path} (GGUF vocabulary)", bos)


def load_tokenizer(checkpoint: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint: a GGUF file's vocabulary, or a directory's tokenizer.json."""
    p = Path(checkpoint)
    if p.name.lower().endswith(".gguf"):
        return from_gguf(p)
    if is_dir(p) and (p / TOKENIZER_FILE).exists():
        return from_tokenizer_json(p / TOKENIZER_FILE)
    raise CheckpointError(f"{shown(p)}: --prompt needs a tokenizer: a GGUF file, or a checkpoint directory with "
                          f"{TOKENIZER_FILE} (or give --prompt-ids)")
