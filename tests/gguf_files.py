"""GGUF files written by hand with struct, for the hostile-input tests: a tiny Llama laid out as
llama.cpp's writer lays one out (metadata, tensor infos, data aligned to 32 bytes), and the
damage a hostile file carries (a field of another type, a tensor offset that overlaps, is
misaligned or wraps around 2**64, a count no file could hold). Independent of the `gguf`
package's writer, so a case can write what that writer never would.

The tiny model: 1 layer, hidden 128, 2 query heads and 1 KV head of 64, FFN 256, and a 256-token
byte-level vocabulary (GPT-2's byte alphabet, no merges), float32 weights.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
ALIGN = 32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 128, 2, 1, 64, 256, 256


def string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v: Any) -> bytes:
    """A value of GGUF type `vtype`; an array is (item type, items)."""
    if vtype == STR:
        return string(v)
    if vtype == ARR and isinstance(v, bytes):  # already encoded (uint8_array)
        return v
    if vtype == ARR:
        item, items = v
        return struct.pack("<IQ", item, len(items)) + b"".join(value(item, x) for x in items)
    return struct.pack("<" + _FMT[vtype], v)


def uint8_array(n: int) -> tuple[int, bytes]:
    """A metadata value: an ARRAY of `n` UINT8 zeros (encoded at once: n may be millions)."""
    return ARR, struct.pack("<IQ", U8, n) + bytes(n)


def byte_alphabet() -> list[str]:
    """GPT-2's 256 byte-level symbols, in byte order (what a byte-level BPE vocabulary starts with)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tiny_metadata() -> dict[str, tuple[int, Any]]:
    return {
        "general.architecture": (STR, "llama"),
        "llama.block_count": (U32, 1), "llama.context_length": (U32, 256),
        "llama.embedding_length": (U32, HIDDEN), "llama.feed_forward_length": (U32, FFN),
        "llama.attention.head_count": (U32, HEADS), "llama.attention.head_count_kv": (U32, KV_HEADS),
        "llama.rope.freq_base": (F32, 10000.0), "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5),
        "tokenizer.ggml.model": (STR, "gpt2"), "tokenizer.ggml.pre": (STR, "default"),
        "tokenizer.ggml.tokens": (ARR, (STR, byte_alphabet())), "tokenizer.ggml.merges": (ARR, (STR, [])),
        "tokenizer.ggml.token_type": (ARR, (I32, [1] * VOCAB)),
        "tokenizer.ggml.bos_token_id": (U32, 0), "tokenizer.ggml.add_bos_token": (BOOL, False),
    }


def tiny_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny Llama's tensors in numpy order ([out, in], as llama.cpp stores them)."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {"token_embd.weight": r(VOCAB, HIDDEN), "output_norm.weight": 1 + r(HIDDEN), "output.weight": r(VOCAB, HIDDEN),
            "blk.0.attn_norm.weight": 1 + r(HIDDEN), "blk.0.ffn_norm.weight": 1 + r(HIDDEN),
            "blk.0.attn_q.weight": r(q, HIDDEN), "blk.0.attn_k.weight": r(kv, HIDDEN),
            "blk.0.attn_v.weight": r(kv, HIDDEN), "blk.0.attn_output.weight": r(HIDDEN, q),
            "blk.0.ffn_gate.weight": r(FFN, HIDDEN), "blk.0.ffn_up.weight": r(FFN, HIDDEN),
            "blk.0.ffn_down.weight": r(HIDDEN, FFN)}


def gguf_bytes(meta: dict[str, tuple[int, Any]], tensors: dict[str, np.ndarray],
               offsets: dict[str, Any] | None = None, counts: tuple[int, int] | None = None) -> bytes:
    """A GGUF v3 file: `meta` key -> (type, value), float32 `tensors` laid out in order, each at
    a multiple of ALIGN. `offsets` replaces a tensor's data offset: an int, or a function of the
    offsets as laid out (name -> offset) and the data section's start in the file; `counts`
    replaces the (tensor, key/value) counts the header declares."""
    n_tensors, n_kv = counts or (len(tensors), len(meta))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
    for k, (t, v) in meta.items():
        out += string(k) + struct.pack("<I", t) + value(t, v)
    laid, data = {}, b""
    for name, a in tensors.items():
        laid[name] = len(data)
        data += a.tobytes()
        data += b"\0" * (-len(data) % ALIGN)
    infos = b""
    for name, a in tensors.items():
        infos += string(name) + struct.pack("<I", a.ndim) + struct.pack(f"<{a.ndim}Q", *reversed(a.shape))
        infos += struct.pack("<I", 0)  # F32
        infos += b"\0" * 8  # the offset, filled in below
    head = len(out) + len(infos)
    data_start = head + (-head % ALIGN)
    fixed = b""
    pos = 0
    for name, a in tensors.items():
        size = 8 + len(name.encode()) + 4 + 8 * a.ndim + 4
        off = (offsets or {}).get(name, laid[name])
        if callable(off):
            off = off(laid, data_start)
        fixed += infos[pos:pos + size] + struct.pack("<Q", off % (1 << 64))
        pos += size + 8
    out += fixed
    return out + b"\0" * (data_start - len(out)) + data


def tiny_gguf(meta: dict[str, tuple[int, Any] | None] | None = None, **kw) -> bytes:
    """The tiny Llama with `meta` changes (None drops a key); `kw` as gguf_bytes takes it."""
    m = tiny_metadata()
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    return gguf_bytes(m, tiny_tensors(), **kw)
