"""A corpus of hostile and careless inputs run through the `tpumk` command line.

For every case (README, "Every error is one line on stderr"):
- the exit code is the one the README gives for that kind of error: 2 for a malformed command
  line (unknown option, a value not of the option's type or not among its choices, a missing
  required option), 1 for input tpumk refused (a config field, a token id, a file, a storage, an
  artifact, an infeasible shape);
- stderr is exactly one non-empty line starting `tpumk: error:` (holding the words a case names,
  where it names some: what makes it the right refusal);
- no 'Traceback' in stdout or stderr (in-process: no exception other than SystemExit escapes);
- nothing is written outside the directories the case names: each case runs with cwd = a fresh
  directory under a sentinel parent, and both trees are snapshotted before and after.

A constraint that cannot be evaluated for a configuration (division by zero, a value past
2**1024) prunes that trial and the study goes on; a study that so evaluates no configuration at
all is refused like any other input, in one line saying how many configurations were rejected
and by what (`says`: what the line must hold).

Most cases run in-process through click.testing.CliRunner (`result.stderr` is separate since
Click 8.2); the few that need a fresh process (environment read at start-up, the real console
script's streams) run as subprocesses.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.model import gguf_file

import gguf_files
from cli_output import error_lines
from file_trees import Symlink, snapshot, stray, write_tree

REPO = Path(__file__).resolve().parents[1]
TINY_SPACE = str(REPO / "tuning_spaces" / "tiny.toml")
TPUMK_BIN = Path(sys.executable).parent / "tpumk"
SIGNING_VARS = ("TPUMK_SIGNING_KEY", "TPUMK_SIGNING_KEY_FILE", "TPUMK_REQUIRE_SIGNED")

USAGE, INPUT = 2, 1  # the README's exit codes
FAST = 5.0  # seconds: inputs that must be refused before any real work (absurd sizes)
DEFAULT_LIMIT = 30.0  # seconds: a generous ceiling for everything else (all rejected before compiling)


# ---------------------------------------------------------------------- file contents
def toml_model(**fields: Any) -> str:
    """A model TOML from tiny-dense's fields with `fields` overriding (None drops a field)."""
    base = dict(name="hostile", num_layers=1, hidden_size=128, num_q_heads=2, num_kv_heads=1, head_dim=128,
                ffn_size=256, vocab_size=256, dtype="float32")
    base.update(fields)
    lines = []
    for k, v in base.items():
        if v is None:
            continue
        lines.append(f"{k} = {_toml(v)}")
    return "\n".join(lines) + "\n"


def _toml(v: Any) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)





class Raw:
    """A TOML / JSON value written verbatim (nan, inf, huge literals)."""

    def __init__(self, text: str):
        self.text = text


HF_TINY = dict(model_type="qwen3", _name_or_path="tiny-ckpt", hidden_size=128, num_attention_heads=2,
               num_key_value_heads=1, head_dim=128, num_hidden_layers=1, intermediate_size=256, vocab_size=256,
               rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="float32",
               hidden_act="silu")
HF_TINY_MLA = dict(HF_TINY, model_type="deepseek_v3", num_attention_heads=2, num_key_value_heads=2, head_dim=None,
                   kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
                   first_k_dense_replace=1, num_hidden_layers=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
HF_TINY_MOE = dict(HF_TINY, model_type="qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=128, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])

HF_TINY_GPT_OSS = dict(HF_TINY, model_type="gpt_oss", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
                       sliding_window=16, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 64, "truncate": False})


def hf_json(base: dict | None = None, **fields: Any) -> str:
    """A config.json from HF_TINY with `fields` overriding (None drops a field; Raw is verbatim)."""
    d = dict(HF_TINY if base is None else base)
    raws = {}
    for k, v in fields.items():
        if v is None:
            d.pop(k, None)
        elif isinstance(v, Raw):
            raws[k] = v.text
            d[k] = f"@@{k}@@"
        else:
            d[k] = v
    text = json.dumps(d)
    for k, t in raws.items():
        text = text.replace(json.dumps(f"@@{k}@@"), t)
    return text


def tiny_tensors(cfg: dict = HF_TINY) -> dict[str, np.ndarray]:
    """The safetensors of a Qwen3 checkpoint for the dense config `cfg` (float32, random)."""
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv, hd = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"], cfg["head_dim"]
    rng = np.random.default_rng(0)

    def r(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h), "lm_head.weight": r(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
            p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
            p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
            p + "self_attn.q_norm.weight": 1 + r(hd), p + "self_attn.k_norm.weight": 1 + r(hd),
            p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h), p + "mlp.down_proj.weight": r(h, f),
        })
    return t


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save(tensors)


def checkpoint(config: str | None = HF_TINY, tensors: Callable[[], bytes] | bytes | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Files of a checkpoint directory `ckpt/`: config.json (text or dict) and model.safetensors."""
    files: dict[str, Any] = {"ckpt/": None}
    if config is not None:
        files["ckpt/config.json"] = config if isinstance(config, str) else json.dumps(config)
    if tensors is not None:
        files["ckpt/model.safetensors"] = tensors
    files.update(extra or {})
    return files


def with_tensors(change: Callable[[dict], None]) -> Callable[[], bytes]:
    def make() -> bytes:
        t = tiny_tensors()
        change(t)
        return safetensors_bytes(t)

    return make


def _rename(t: dict) -> None:
    t["model.layers.0.self_attn.qq_proj.weight"] = t.pop("model.layers.0.self_attn.q_proj.weight")


def _reshape(t: dict) -> None:
    t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((256, 129), np.float32)


def _drop(t: dict) -> None:
    del t["model.norm.weight"]


def _extra(t: dict) -> None:
    t["model.layers.7.mlp.gate_proj.weight"] = np.zeros((256, 128), np.float32)


def _int8(t: dict) -> None:
    t["model.layers.0.mlp.down_proj.weight"] = np.zeros((128, 256), np.int8)


def _transposed(t: dict) -> None:
    t["model.embed_tokens.weight"] = np.ascontiguousarray(t["model.embed_tokens.weight"].T)


NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}


def nvfp4_tensors(change: Callable[[dict], None] | None = None) -> Callable[[], bytes]:
    """The safetensors of HF_TINY_MOE with its routed experts in ModelOpt's NVFP4 layout (random
    code and scale bytes), `change` applied before they are written."""
    def make() -> bytes:
        import ml_dtypes

        cfg = HF_TINY_MOE
        h, e, f = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
        rng = np.random.default_rng(1)
        t = {k: v for k, v in tiny_tensors(cfg).items() if not k.startswith("model.layers.1.mlp.")}
        t["model.layers.1.mlp.gate.weight"] = (0.1 * rng.standard_normal((e, h))).astype(np.float32)
        for j in range(e):
            for proj, (o, i) in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
                p = f"model.layers.1.mlp.experts.{j}.{proj}."
                t[p + "weight"] = rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
                scale = rng.integers(0, 0x7F, (o, i // 16), dtype=np.uint8)  # (finite e4m3 bytes)
                t[p + "weight_scale"] = scale.view(ml_dtypes.float8_e4m3fn)
                t[p + "weight_scale_2"] = np.asarray(1e-3, np.float32)
        if change is not None:
            change(t)
        return safetensors_bytes(t)

    return make


def _nvfp4_nan_scale(t: dict) -> None:
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    s = t[name].view(np.uint8).copy()
    s[5, 1] = 0xFF  # e4m3's (negative) NaN
    t[name] = s.view(t[name].dtype)


def _nvfp4_scale_shape(t: dict) -> None:
    name = "model.layers.1.mlp.experts.1.up_proj.weight_scale"
    t[name] = np.ascontiguousarray(t[name][:, :4])


def truncated_safetensors() -> bytes:
    b = safetensors_bytes(tiny_tensors())
    return b[: len(b) // 2]


def lying_header() -> bytes:
    """A safetensors header that claims 2**60 bytes of header."""
    return (1 << 60).to_bytes(8, "little") + b"{}"


GARBAGE = bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8))  # random bytes, not UTF-8
DEEP_JSON_LIST = "[" * 100_000 + "]" * 100_000
DEEP_JSON_OBJ = '{"a":' * 100_000 + "1" + "}" * 100_000
DEEP_TOML_ARRAY = "x = " + "[" * 20_000 + "]" * 20_000 + "\n"
DEEP_TOML_TABLE = "x = " + "{a = " * 20_000 + "1" + "}" * 20_000 + "\n"
LONG_INT = "7" * 5000  # more digits than Python's int() accepts by default (4300)


# ---------------------------------------------------------------------- tuning spaces
def space(knobs: str = "", constraints: str = "", fixed: str = "", head: str = '[space]\nname = "hostile"\n') -> str:
    return head + knobs + fixed + constraints


RING = '[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n'
KV = '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 3]\n'  # 0: the default, auto


def constraint(expr: str, why: str = "hostile") -> str:
    return f"[[constraints]]\nwhy = {json.dumps(why)}\nexpr = {json.dumps(expr)}\n"


def tune_args(space_file: str, *more: str) -> list[str]:
    return ["tune", "--model", "tiny-moe", "--target", "cpu", "--objective", "model", "--trials", "1",
            "--space", space_file, "--storage", "sqlite:///st/s.db", "--cache-dir", "cache", "--out", "best/t.toml",
            "--max-infeasible", "2", *more]


TUNE_DIRS = ("st", "cache", "best")


def good_tune(*more: str, storage: str | None = None) -> list[str]:
    args = tune_args(TINY_SPACE, *more)
    if storage is not None:
        i = args.index("--storage")
        args[i + 1] = storage
    return args


# ---------------------------------------------------------------------- the corpus
@dataclass
class Case:
    id: str
    args: list[str]
    code: int = INPUT
    files: dict[str, Any] = field(default_factory=dict)  # relative path -> str | bytes | callable; "d/": a dir
    allow: tuple[str, ...] = ()  # directories (relative to cwd) the case names: files may appear there
    limit: float = DEFAULT_LIMIT
    subprocess: bool = False
    env: dict[str, str] = field(default_factory=dict)
    says: tuple[str, ...] = ()  # substrings the error line must hold (what makes it the right refusal)


def model_case(id, text, cmd="build", code=INPUT, limit=DEFAULT_LIMIT, name="m.toml", **kw):
    args = {"build": ["build", "--model", name, "--target", "cpu"],
            "generate": ["generate", "--model", name, "--prompt-ids", "1", "--steps", "1"],
            "cache-key": ["cache-key", "--model", name, "--target", "cpu"]}[cmd]
    return Case(id, args, code, files={name: text}, limit=limit, **kw)


def json_case(id, text, cmd="build", **kw):
    return model_case(id, text, cmd=cmd, name="config.json", **kw)


GGUF_PROMPT = ["generate", "--checkpoint", "m.gguf", "--prompt", "hi", "--steps", "1"]
CKPT_PROMPT = ["generate", "--checkpoint", "ckpt", "--prompt", "hello", "--steps", "1"]


def gguf_case(id, meta=None, args=None, offsets=None, **kw):
    """A command (default: generate --prompt) on the tiny GGUF of tests/gguf_files.py as m.gguf,
    with `meta` key/values and tensor `offsets` changed."""
    return Case(id, args or GGUF_PROMPT, files={"m.gguf": lambda: gguf_files.tiny_gguf(meta, offsets=offsets)}, **kw)


def tokenizer_json(**fields: Any) -> str:
    """A word-level tokenizer.json (hello, world; [UNK]) with `fields` set."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return json.dumps(json.loads(tok.to_str()) | fields)


GEN = ["generate", "--model", "tiny-dense", "--steps", "1"]
BUILD = ["build", "--model", "tiny-dense", "--target", "cpu"]
KEY = ["cache-key", "--model", "tiny-dense", "--target", "cpu"]
EXPORT = ["export", "--model", "tiny-dense", "--target", "cpu"]
CKPT_GEN = ["generate", "--checkpoint", "ckpt", "--prompt-ids", "1,2", "--steps", "1"]

CASES: list[Case] = [
    # ---- model configs: whole-file shapes
    json_case("json-list", "[1, 2, 3]"),
    json_case("json-scalar", "42"),
    json_case("json-string", '"qwen3"'),
    json_case("json-null", "null"),
    json_case("json-empty", ""),
    json_case("json-binary-garbage", GARBAGE),
    json_case("json-deeply-nested-list", DEEP_JSON_LIST, limit=FAST),
    json_case("json-deeply-nested-object", DEEP_JSON_OBJ, limit=FAST),
    json_case("json-5000-digit-int", hf_json(vocab_size=Raw(LONG_INT)), limit=FAST),
    model_case("toml-empty", ""),
    model_case("toml-binary-garbage", GARBAGE),
    model_case("toml-is-a-json-list", "[1, 2, 3]\n"),
    model_case("toml-deeply-nested-array", DEEP_TOML_ARRAY, limit=FAST),
    model_case("toml-deeply-nested-inline-table", DEEP_TOML_TABLE, limit=FAST),
    model_case("toml-array-of-model-tables", "[[model]]\nname = 'a'\n[[model]]\nname = 'b'\n"),
    model_case("toml-5000-digit-int", toml_model(num_layers=Raw(LONG_INT)), limit=FAST),
    Case("model-file-missing", ["build", "--model", "nope.toml", "--target", "cpu"]),
    Case("model-toml-is-a-directory", ["build", "--model", "d.toml", "--target", "cpu"], files={"d.toml/": None}),
    Case("model-unknown-preset", ["build", "--model", "no-such-model", "--target", "cpu"]),
    # ---- model configs: fields of the wrong type
    json_case("json-num-experts-string", hf_json(HF_TINY_MOE, num_experts="8")),
    json_case("json-rms-eps-string", hf_json(rms_norm_eps="abc")),
    json_case("json-layers-boolean", hf_json(num_hidden_layers=True)),
    json_case("json-hidden-float", hf_json(hidden_size=128.5)),
    json_case("json-rms-eps-nan", hf_json(rms_norm_eps=Raw("NaN"))),
    json_case("json-rope-theta-infinity", hf_json(rope_theta=Raw("Infinity"))),
    json_case("json-vocab-1e400", hf_json(vocab_size=Raw("1e400"))),
    json_case("json-rms-eps-list", hf_json(rms_norm_eps=[1e-6])),
    json_case("json-model-type-number", hf_json(model_type=42)),
    json_case("json-tie-string", hf_json(tie_word_embeddings="false")),
    model_case("toml-num-experts-string", toml_model(num_experts="8", top_k=2, expert_ffn_size=128)),
    model_case("toml-rms-eps-string", toml_model(rms_eps="abc")),
    model_case("toml-layers-boolean", toml_model(num_layers=True)),
    model_case("toml-hidden-float", toml_model(hidden_size=128.0)),
    model_case("toml-rms-eps-nan", toml_model(rms_eps=Raw("nan"))),
    model_case("toml-rope-theta-inf", toml_model(rope_theta=Raw("inf"))),
    model_case("toml-dense-layers-string", toml_model(num_experts=4, top_k=2, expert_ffn_size=128, dense_layers="0")),
    model_case("toml-qk-norm-int", toml_model(qk_norm=1)),
    model_case("toml-dtype-fp16", toml_model(dtype="fp16")),
    # ---- model configs: sizes
    model_case("toml-negative-layers", toml_model(num_layers=-1)),
    model_case("toml-zero-hidden", toml_model(hidden_size=0)),
    model_case("toml-zero-vocab", toml_model(vocab_size=0), cmd="generate"),
    model_case("toml-negative-ffn", toml_model(ffn_size=-256)),
    model_case("toml-top-k-above-experts", toml_model(num_experts=4, top_k=5, expert_ffn_size=128)),
    json_case("json-negative-layers", hf_json(num_hidden_layers=-2)),
    json_case("json-zero-hidden", hf_json(hidden_size=0)),
    model_case("toml-layers-1e12-build", toml_model(num_layers=10**12), limit=FAST),
    model_case("toml-layers-1e12-generate", toml_model(num_layers=10**12), cmd="generate", limit=FAST),
    model_case("toml-vocab-1e12-generate", toml_model(vocab_size=10**12), cmd="generate", limit=FAST),
    model_case("toml-experts-1e12-generate", toml_model(num_experts=10**12, top_k=2, expert_ffn_size=128),
               cmd="generate", limit=FAST),
    json_case("json-layers-1e12-generate", hf_json(num_hidden_layers=10**12), cmd="generate", limit=FAST),
    json_case("json-vocab-1e12-build", hf_json(vocab_size=10**12), limit=FAST),
    json_case("json-experts-1e12-generate", hf_json(HF_TINY_MOE, num_experts=10**12), cmd="generate", limit=FAST),
    json_case("json-hidden-1e30-build", hf_json(hidden_size=10**30), limit=FAST),
    # a model within every per-field bound whose weights still could not be allocated on a host
    model_case("toml-bounded-but-huge-generate", toml_model(num_layers=1024, hidden_size=65536, num_q_heads=512,
                                                              num_kv_heads=512, ffn_size=1 << 20, vocab_size=1 << 22),
               cmd="generate", limit=FAST),
    # ---- model configs: unknown / missing fields
    model_case("toml-unknown-field", toml_model(num_experts_typo=8)),
    model_case("toml-missing-hidden", toml_model(hidden_size=None)),
    json_case("json-missing-vocab", hf_json(vocab_size=None)),
    json_case("json-missing-model-type", hf_json(model_type=None)),
    json_case("json-moe-missing-experts", hf_json(HF_TINY_MOE, num_experts=None)),
    # ---- model configs: architectures tpumk does not implement
    json_case("json-deepseek-v3-mla", hf_json(model_type="deepseek_v3", kv_lora_rank=512, q_lora_rank=1536)),
    json_case("json-qwen3-with-mla-fields", hf_json(kv_lora_rank=512)),
    # valid; a block-scaled ring with v_head_dim 32 is refused (o's scale groups would straddle heads)
    Case("json-mla-megakernel-block-quant-refused", ["build", "--model", "config.json", "--target", "cpu",
                                                     "--quant", "fp8-b128"],
         INPUT, files={"config.json": hf_json(HF_TINY_MLA)}),
    json_case("json-mla-yarn-nan-factor", hf_json(HF_TINY_MLA, rope_scaling=Raw(
        '{"type": "yarn", "factor": NaN, "original_max_position_embeddings": 64}'))),
    json_case("json-mla-groups-not-dividing", hf_json(HF_TINY_MLA, n_group=3)),
    json_case("json-mla-softmax-scoring", hf_json(HF_TINY_MLA, scoring_func="softmax")),
    json_case("json-sliding-window-zero", hf_json(use_sliding_window=True, sliding_window=0)),
    json_case("json-layer-types-sliding", hf_json(layer_types=["sliding_attention"])),
    # Mistral's attention has no biases whatever attention_bias says (Llama's and Qwen3's read it)
    json_case("json-mistral-attention-bias", hf_json(model_type="mistral", attention_bias=True)),
    json_case("json-rope-yarn", hf_json(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
    # (Cohere normalises with layer_norm_eps: HF_TINY's rms_norm_eps is another family's field, refused)
    json_case("json-cohere-qk-norm", hf_json(model_type="cohere", rms_norm_eps=None, use_qk_norm=True)),
    json_case("json-cohere-logit-scale", hf_json(model_type="cohere", rms_norm_eps=None, logit_scale=-1.0)),
    # a field of another family under a model_type tpumk reads (a relabelled config)
    json_case("json-llama-relabelled-smollm3", hf_json(model_type="llama", no_rope_layers=[1])),
    json_case("json-gelu", hf_json(hidden_act="gelu")),
    # gpt-oss: a clamp below zero; MXFP4 weights of a family whose tensors tpumk reads only as
    # gpt-oss stores them; a quant scheme the MXFP4 checkpoint would have to re-quantize
    json_case("json-gpt-oss-negative-swiglu-limit", hf_json(HF_TINY_GPT_OSS, swiglu_limit=-7.0)),
    json_case("json-mxfp4-not-gpt-oss", hf_json(quantization_config={"quant_method": "mxfp4"})),
    Case("json-mxfp4-requantized-int4", ["build", "--model", "config.json", "--target", "cpu", "--quant", "int4"],
         INPUT, files={"config.json": hf_json(HF_TINY_GPT_OSS, quantization_config={"quant_method": "mxfp4"})}),
    # NVFP4 (ModelOpt): its scales of the wrong shape or NaN (read with the weights, by generate);
    # a group size and a dense model tpumk does not read (refused from config.json alone, before
    # export writes anything); an NVFP4 checkpoint re-quantized
    Case("ckpt-nvfp4-nan-scale", CKPT_GEN, files=checkpoint(
        config=hf_json(HF_TINY_MOE, quantization_config=NVFP4_CONFIG), tensors=nvfp4_tensors(_nvfp4_nan_scale)),
        says=("experts.2.down_proj.weight_scale' holds a NaN e4m3 scale",)),
    Case("ckpt-nvfp4-scale-shape", CKPT_GEN, files=checkpoint(
        config=hf_json(HF_TINY_MOE, quantization_config=NVFP4_CONFIG), tensors=nvfp4_tensors(_nvfp4_scale_shape)),
        says=("experts.1.up_proj.weight_scale' has shape [128, 4]", "expected [128, 8] F8_E4M3")),
    Case("ckpt-nvfp4-group-size-export", ["export", "--checkpoint", "ckpt", "--target", "cpu", "--out", "out"],
         files=checkpoint(config=hf_json(HF_TINY_MOE, quantization_config={**NVFP4_CONFIG, "group_size": 32}),
                          tensors=nvfp4_tensors()), says=("nvfp4 group_size 32",)),
    json_case("json-nvfp4-dense-model", hf_json(quantization_config=NVFP4_CONFIG),
              says=("an nvfp4 checkpoint of a model without routed experts",)),
    Case("json-nvfp4-requantized-int4", ["build", "--model", "config.json", "--target", "cpu", "--quant", "int4"],
         INPUT, files={"config.json": hf_json(HF_TINY_MOE, quantization_config=NVFP4_CONFIG)},
         says=("the checkpoint stores its weights as nvfp4",)),
    json_case("json-int8-dtype", hf_json(torch_dtype="int8")),
    # ---- model names that are not one path component
    Case("toml-name-dotdot-export", ["export", "--model", "m.toml", "--target", "cpu", "--out", "out"],
         files={"m.toml": toml_model(name="..")}, allow=("out",)),
    Case("toml-name-slash-export", ["export", "--model", "m.toml", "--target", "cpu", "--out", "out"],
         files={"m.toml": toml_model(name="a/../../b")}, allow=("out",)),
    Case("toml-name-newline-cache-key-out", ["cache-key", "--model", "m.toml", "--target", "cpu", "--out", "out"],
         files={"m.toml": toml_model(name="a\nb")}, allow=("out",)),
    Case("json-name-or-path-dotdot-cache-key-out",
         ["cache-key", "--model", "config.json", "--target", "cpu", "--out", "out"],
         files={"config.json": hf_json(_name_or_path="a/..")}, allow=("out",)),
    # ---- checkpoints
    Case("ckpt-missing-dir", CKPT_GEN),
    Case("ckpt-is-a-file", CKPT_GEN, files={"ckpt": "not a directory"}),
    Case("ckpt-no-config-generate", CKPT_GEN, files=checkpoint(config=None, tensors=lambda: safetensors_bytes(tiny_tensors()))),
    Case("ckpt-no-config-build", ["build", "--checkpoint", "ckpt", "--target", "cpu"], files=checkpoint(config=None)),
    Case("ckpt-config-is-directory", CKPT_GEN, files={"ckpt/": None, "ckpt/config.json/": None}),
    Case("ckpt-no-safetensors", CKPT_GEN, files=checkpoint()),
    Case("ckpt-truncated-safetensors", CKPT_GEN, files=checkpoint(tensors=truncated_safetensors)),
    Case("ckpt-garbage-safetensors", CKPT_GEN, files=checkpoint(tensors=GARBAGE)),
    Case("ckpt-lying-header", CKPT_GEN, files=checkpoint(tensors=lying_header), limit=FAST),
    Case("ckpt-empty-safetensors-file", CKPT_GEN, files=checkpoint(tensors=b"")),
    Case("ckpt-tensor-wrong-shape", CKPT_GEN, files=checkpoint(tensors=with_tensors(_reshape))),
    Case("ckpt-tensor-transposed", CKPT_GEN, files=checkpoint(tensors=with_tensors(_transposed))),
    Case("ckpt-tensor-wrong-name", CKPT_GEN, files=checkpoint(tensors=with_tensors(_rename))),
    Case("ckpt-tensor-missing", CKPT_GEN, files=checkpoint(tensors=with_tensors(_drop))),
    Case("ckpt-tensor-unexpected", CKPT_GEN, files=checkpoint(tensors=with_tensors(_extra))),
    Case("ckpt-tensor-int8", CKPT_GEN, files=checkpoint(tensors=with_tensors(_int8))),
    Case("ckpt-garbage-index", CKPT_GEN, files=checkpoint(tensors=lambda: safetensors_bytes(tiny_tensors()),
                                                          extra={"ckpt/model.safetensors.index.json": "{not json"})),
    Case("ckpt-index-missing-shard", CKPT_GEN, files=checkpoint(
        tensors=lambda: safetensors_bytes(tiny_tensors()),
        extra={"ckpt/model.safetensors.index.json": json.dumps({"weight_map": {"model.norm.weight": "nope.safetensors"}})})),
    Case("ckpt-and-model-both", ["build", "--model", "tiny-dense", "--checkpoint", "ckpt", "--target", "cpu"],
         files=checkpoint()),
    # ---- GGUF checkpoints (tests/gguf_files.py): layouts llama.cpp refuses ran on wrong weights
    gguf_case("gguf-tensors-overlap", offsets={"blk.0.attn_v.weight": lambda laid, start: laid["blk.0.attn_k.weight"]},
              says=("'blk.0.attn_v.weight'", "overlaps")),
    gguf_case("gguf-tensor-misaligned",
              offsets={"blk.0.attn_v.weight": lambda laid, start: laid["blk.0.attn_v.weight"] + 4},
              says=("'blk.0.attn_v.weight'", "alignment")),
    gguf_case("gguf-tensor-offset-wraps-into-header", offsets={"blk.0.attn_v.weight": lambda laid, start: -start},
              says=("'blk.0.attn_v.weight'", "wraps around 2**64")),
    gguf_case("gguf-build-tensors-overlap", args=["build", "--checkpoint", "m.gguf", "--target", "cpu"],
              offsets={"blk.0.attn_v.weight": lambda laid, start: laid["blk.0.attn_k.weight"]},
              says=("'blk.0.attn_v.weight'", "overlaps")),
    gguf_case("gguf-array-past-the-limit", {"x.big": gguf_files.uint8_array(gguf_file.MAX_ARRAY_ITEMS + 1)},
              limit=FAST, says=("'x.big'", f"{gguf_file.MAX_ARRAY_ITEMS:,}")),
    # ---- GGUF tokenizer fields: tracebacks, or loose types read as something else
    gguf_case("gguf-token-not-utf8",
              {"tokenizer.ggml.tokens": (gguf_files.ARR, (gguf_files.STR, gguf_files.byte_alphabet()[:255] + [b"\xff"]))},
              says=("item 255 of metadata field 'tokenizer.ggml.tokens'",)),
    gguf_case("gguf-token-type-scalar", {"tokenizer.ggml.token_type": (gguf_files.I32, 1)},
              says=("'tokenizer.ggml.token_type'",)),
    gguf_case("gguf-token-type-short", {"tokenizer.ggml.token_type": (gguf_files.ARR, (gguf_files.I32, [1] * 100))},
              says=("'tokenizer.ggml.token_type' has 100 entries",)),
    gguf_case("gguf-bos-id-bool", {"tokenizer.ggml.bos_token_id": (gguf_files.BOOL, True),
                                   "tokenizer.ggml.add_bos_token": (gguf_files.BOOL, True)},
              says=("'tokenizer.ggml.bos_token_id' is a BOOL",)),
    gguf_case("gguf-add-bos-string-false", {"tokenizer.ggml.add_bos_token": (gguf_files.STR, "false")},
              says=("'tokenizer.ggml.add_bos_token' is a STRING",)),
    # ---- a checkpoint's tokenizer.json: Rust panics (BaseException) escaped as tracebacks
    Case("tokenizer-template-undefined-special-token", CKPT_PROMPT, files=checkpoint(
        tensors=lambda: safetensors_bytes(tiny_tensors()), extra={"ckpt/tokenizer.json": tokenizer_json(
            post_processor={"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                     {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}})}),
         says=("tokenizer.json", "no entry found for key")),
    # ---- tuning files ([tuning] TOML)
    Case("tuning-unknown-knob", [*KEY, "--tuning", "t.toml"], files={"t.toml": "[tuning]\nring_dpeth = 8\n"}),
    Case("tuning-string-int", [*KEY, "--tuning", "t.toml"], files={"t.toml": '[tuning]\nring_depth = "8"\n'}),
    Case("tuning-float-int", [*KEY, "--tuning", "t.toml"], files={"t.toml": "[tuning]\nring_depth = 8.5\n"}),
    Case("tuning-bool-int", [*KEY, "--tuning", "t.toml"], files={"t.toml": "[tuning]\nkv_buffers = true\n"}),
    Case("tuning-nan-fraction", [*KEY, "--tuning", "t.toml"], files={"t.toml": "[tuning]\nvmem_limit_fraction = nan\n"}),
    Case("tuning-huge-tile-bytes", [*BUILD, "--tuning", "t.toml"],
         files={"t.toml": "[tuning]\ntile_bytes = 9223372036854775807\nring_depth = 9223372036854775807\n"},
         limit=FAST),
    Case("tuning-not-a-table", [*KEY, "--tuning", "t.toml"], files={"t.toml": "tuning = 3\n"}),
    Case("tuning-extra-table", [*KEY, "--tuning", "t.toml"], files={"t.toml": "[tunning]\nring_depth = 8\n"}),
    Case("tuning-binary-garbage", [*KEY, "--tuning", "t.toml"], files={"t.toml": GARBAGE}),
    Case("tuning-missing-file", [*KEY, "--tuning", "nope.toml"]),
    # ---- tuning spaces
    Case("space-empty-path", tune_args("")),
    Case("space-unknown-knob", tune_args("s.toml"), files={"s.toml": space('[knobs.ring_dpeth]\ntype = "int"\nlow = 2\nhigh = 4\n')},
         allow=TUNE_DIRS),
    Case("space-unknown-type", tune_args("s.toml"), files={"s.toml": space('[knobs.ring_depth]\ntype = "float"\nlow = 2\nhigh = 4\n')},
         allow=TUNE_DIRS),
    Case("space-string-bound", tune_args("s.toml"), files={"s.toml": space('[knobs.ring_depth]\ntype = "int"\nlow = "2"\nhigh = 4\n')},
         allow=TUNE_DIRS),
    Case("space-empty-range", tune_args("s.toml"), files={"s.toml": space('[knobs.ring_depth]\ntype = "int"\nlow = 12\nhigh = 4\n')},
         allow=TUNE_DIRS),
    Case("space-empty-choices", tune_args("s.toml"), files={"s.toml": space('[knobs.expert_chunk]\ntype = "categorical"\nchoices = []\n')},
         allow=TUNE_DIRS),
    Case("space-huge-range", tune_args("s.toml"),
         files={"s.toml": space('[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 1000000000000\n')},
         allow=TUNE_DIRS, limit=FAST),
    Case("space-huge-pow2-range", tune_args("s.toml"),
         files={"s.toml": space('[knobs.tile_bytes]\ntype = "pow2"\nlow = 65536\nhigh = 9223372036854775807\n')},
         allow=TUNE_DIRS, limit=FAST),
    Case("space-no-knobs", tune_args("s.toml"), files={"s.toml": space()}, allow=TUNE_DIRS),
    Case("space-binary-garbage", tune_args("s.toml"), files={"s.toml": GARBAGE}, allow=TUNE_DIRS),
    Case("space-missing-file", tune_args("nope.toml"), allow=TUNE_DIRS),
    Case("space-constraint-not-an-expression", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("ring_depth <="))}, allow=TUNE_DIRS),
    Case("space-constraint-not-a-condition", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("ring_depth + 1"))}, allow=TUNE_DIRS),
    Case("space-constraint-unknown-name", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("ring_depth * slots <= 8"))}, allow=TUNE_DIRS),
    Case("space-constraint-dunder-import", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("__import__('os').system('touch pwned') == 0"))}, allow=TUNE_DIRS),
    Case("space-constraint-attribute", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("ring_depth.__class__ == 0"))}, allow=TUNE_DIRS),
    Case("space-constraint-lambda", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("(lambda: 1)() == 1"))}, allow=TUNE_DIRS),
    Case("space-constraint-variable-exponent", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("2 ** ring_depth > 0"))}, allow=TUNE_DIRS),
    Case("space-constraint-nested-parens", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("(" * 500 + "ring_depth" + ")" * 500 + " > 0"))},
         allow=TUNE_DIRS, limit=FAST),
    Case("space-constraint-10000-terms", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint(" + ".join(["ring_depth"] * 10_000) + " > 0"))},
         allow=TUNE_DIRS, limit=FAST),
    Case("space-constraint-not-a-string", tune_args("s.toml"),
         files={"s.toml": space(RING, "[[constraints]]\nwhy = 'x'\nexpr = 3\n")}, allow=TUNE_DIRS),
    # a value past 2**1024 or a division by zero prunes each trial (tuning_spaces/README.md); a
    # study that so evaluates nothing is refused, saying why (before: exit 0, `best: []`)
    Case("space-constraint-exponent-tower", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("((ring_depth ** 64) ** 64) ** 64 > 0"))},
         allow=TUNE_DIRS, limit=60, says=("no configuration", "cannot be evaluated", "exceeds 2**1024")),
    Case("space-constraint-divide-by-zero", tune_args("s.toml"),
         files={"s.toml": space(RING, constraint("ring_depth / (ring_depth - ring_depth) > 0"))},
         allow=TUNE_DIRS, limit=60, says=("no configuration", "cannot be evaluated", "division by zero")),
    # constraints nothing meets, over a grid too large to walk before the study (4,608 > 4,096 points)
    Case("space-unsatisfiable-over-4096-points", tune_args("s.toml", "--max-infeasible", "5"),
         files={"s.toml": space('[knobs.ring_depth]\ntype = "int"\nlow = 2\nhigh = 33\n'
                                '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 2, 3, 4, 5, 6, 7, 8]\n'
                                '[knobs.kv_tile_pages]\ntype = "categorical"\nchoices = [0, 4, 8]\n'
                                '[knobs.tile_bytes]\ntype = "pow2"\nlow = 262144\nhigh = 8388608\n',
                                constraint("ring_depth > 100", "nothing"))},
         allow=TUNE_DIRS, limit=60, says=("no configuration of its 4,608 grid points can be evaluated",
                                          "4,608 configurations rejected before compiling (constraint 4,608)",
                                          "nothing (ring_depth > 100")),
    # ... over a grid too large to walk at all (580,608 points): what --max-infeasible let it draw
    Case("space-unsatisfiable-beyond-walking", tune_args("s.toml", "--max-infeasible", "1"),
         files={"s.toml": space('[knobs.ring_depth]\ntype = "int"\nlow = 2\nhigh = 33\n'
                                '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 2, 3, 4, 5, 6, 7, 8]\n'
                                '[knobs.kv_tile_pages]\ntype = "categorical"\nchoices = [0, 4, 8, 16, 32, 64]\n'
                                '[knobs.tile_bytes]\ntype = "pow2"\nlow = 262144\nhigh = 8388608\n'
                                '[knobs.expert_slots]\ntype = "int"\nlow = 1\nhigh = 8\n'
                                '[knobs.expert_chunk]\ntype = "categorical"\nchoices = [0, 128, 256, 384, 512, '
                                '768, 1536]\n', constraint("ring_depth > 100", "nothing"))},
         allow=TUNE_DIRS, limit=60, says=("none of the configurations drawn from its 580,608 grid points",
                                          "1 configuration rejected before compiling (constraint 1)",
                                          "--max-infeasible 1 ended it")),
    # ---- tune options
    Case("tune-trials-0", good_tune("--trials", "0"), allow=TUNE_DIRS),
    Case("tune-trials-negative", good_tune("--trials", "-1"), allow=TUNE_DIRS),
    Case("tune-workers-0", good_tune("--workers", "0"), allow=TUNE_DIRS),
    Case("tune-timeout-negative", good_tune("--timeout", "-1"), allow=TUNE_DIRS),
    Case("tune-timeout-nan", good_tune("--timeout", "nan"), allow=TUNE_DIRS),
    Case("tune-heartbeat-0", good_tune("--heartbeat", "0"), allow=TUNE_DIRS),
    Case("tune-cache-dir-regular-file", [*good_tune(), "--cache-dir", "f"], files={"f": "a file"}, allow=TUNE_DIRS),
    Case("tune-report-under-regular-file", [*good_tune(), "--report", "f/plots"], files={"f": "a file"},
         allow=TUNE_DIRS),
    Case("tune-objective-bogus", good_tune("--objective", "fastest"), code=USAGE, allow=TUNE_DIRS),
    # ---- storages
    Case("storage-no-scheme", good_tune(storage="mystudy"), allow=TUNE_DIRS),
    Case("storage-malformed-url", good_tune(storage="postgresql://user@host:notaport/db"), allow=TUNE_DIRS),
    Case("storage-unknown-dialect", good_tune(storage="nosuchdialect://u:pw@host/db"), allow=TUNE_DIRS),
    Case("storage-colon-garbage", good_tune(storage="::::"), allow=TUNE_DIRS),
    Case("storage-journal-under-a-file", good_tune(storage="journal:f/x.journal"), files={"f": "a file"}, allow=TUNE_DIRS),
    Case("storage-journal-in-proc", good_tune(storage="/proc/nope/x.journal"), allow=TUNE_DIRS),
    Case("storage-journal-empty-name", good_tune(storage="journal:"), allow=TUNE_DIRS),
    Case("storage-corrupt-journal", good_tune(storage="x.journal"), files={"x.journal": GARBAGE}, allow=TUNE_DIRS),
    Case("storage-journal-is-a-directory", good_tune(storage="x.journal"), files={"x.journal/": None}, allow=TUNE_DIRS),
    Case("storage-sqlite-is-a-directory", good_tune(storage="sqlite:///d.db"), files={"d.db/": None}, allow=TUNE_DIRS),
    Case("storage-sqlite-garbage-file", good_tune(storage="g.db"), files={"g.db": GARBAGE}, allow=TUNE_DIRS),
    Case("storage-sqlite-under-a-file", good_tune(storage="sqlite:///f/s.db"), files={"f": "a file"}, allow=TUNE_DIRS),
    Case("report-no-study", ["report", "--out", "plots"], allow=("plots",)),
    Case("report-corrupt-journal", ["report", "--storage", "x.journal", "--out", "plots"], files={"x.journal": GARBAGE},
         allow=("plots",)),
    Case("report-missing-sqlite", ["report", "--storage", "sqlite:///none.db", "--out", "plots"], allow=("plots",)),
    # ---- artifacts
    Case("inspect-missing-path", ["inspect", "nope"]),
    Case("inspect-regular-file", ["inspect", "f"], files={"f": "hello"}),
    Case("inspect-empty-dir", ["inspect", "d"], files={"d/": None}),
    Case("inspect-garbage-manifest", ["inspect", "d"], files={"d/manifest.toml": GARBAGE}),
    Case("inspect-malformed-manifest", ["inspect", "d"], files={"d/manifest.toml": "key = = 3\n"}),
    Case("inspect-manifest-missing-keys", ["inspect", "d"], files={"d/manifest.toml": '[model]\nname = "x"\n'}),
    Case("inspect-manifest-wrong-types", ["inspect", "d"],
         files={"d/manifest.toml": 'key = 3\nfiles = "x"\nmodel = []\ntarget = 1\nshapes = "big"\n'}),
    Case("inspect-manifest-is-a-directory", ["inspect", "d"], files={"d/manifest.toml/": None}),
    Case("inspect-manifest-files-traversal", ["inspect", "d"],
         files={"d/manifest.toml": '[files."../../etc/passwd"]\nsha256 = "00"\nbytes = 1\n'}),
    Case("inspect-garbage-tree", ["inspect", "root"],
         files={"root/m/cpu/abc/manifest.toml": GARBAGE, "root/m/cpu/def/manifest.toml": "[files]\n"}),
    # ---- prompts
    *[Case(f"prompt-ids-{label}", [*GEN, "--prompt-ids", ids]) for label, ids in [
        ("empty", ""), ("semicolon", ";"), ("double-comma", "1,,2"), ("underscore", "1_0"),
        ("fullwidth-digits", "１２"), ("negative", "-1"), ("vocab-size", "512"), ("1e30", str(10**30)),
        ("float", "1.5"), ("spaces-only", "   "), ("trailing-semicolon", "1,2;"), ("hex", "0x10"),
        ("plus-sign", "+1"), ("nul", "1\x002"), ("5000-digits", LONG_INT),
    ]],
    Case("quality-kv-dtype-empty", ["quality", "--model", "tiny-dense", "--kv-dtype", ""], says=("--kv-dtype",),
         limit=FAST),
    Case("quality-kv-dtype-only-commas", ["quality", "--model", "tiny-dense", "--kv-dtype", " , "],
         says=("--kv-dtype",), limit=FAST),
    Case("generate-steps-0", ["generate", "--model", "tiny-dense", "--prompt-ids", "1", "--steps", "0"]),
    Case("generate-steps-negative", ["generate", "--model", "tiny-dense", "--prompt-ids", "1", "--steps", "-1"]),
    Case("generate-steps-not-int", ["generate", "--model", "tiny-dense", "--prompt-ids", "1", "--steps", "x"], code=USAGE),
    Case("generate-steps-1e12", ["generate", "--model", "tiny-dense", "--prompt-ids", "1", "--steps", str(10**12)],
         limit=FAST),
    Case("generate-page-size-0", [*GEN, "--prompt-ids", "1", "--page-size", "0"]),
    Case("generate-page-size-negative", [*GEN, "--prompt-ids", "1", "--page-size", "-16"]),
    Case("generate-draft-tokens-0", [*GEN, "--prompt-ids", "1,2,1,2", "--spec", "ngram", "--draft-tokens", "0"]),
    Case("generate-draft-tokens-1e12", [*GEN, "--prompt-ids", "1,2,1,2", "--spec", "ngram", "--draft-tokens", str(10**12)],
         limit=FAST),
    Case("generate-draft-layers-0", [*GEN, "--prompt-ids", "1", "--spec", "draft", "--draft-model", "layers:0"]),
    Case("generate-draft-model-without-spec", [*GEN, "--prompt-ids", "1", "--draft-model", "layers:1"]),
    Case("generate-no-prompt-ids", ["generate", "--model", "tiny-dense"], code=USAGE),
    Case("generate-dtype-fp16", [*GEN, "--prompt-ids", "1", "--dtype", "fp16"], code=USAGE),
    # ---- flags and paths
    Case("build-dtype-fp16", [*BUILD, "--dtype", "fp16"], code=USAGE),
    Case("build-batch-0", [*BUILD, "--batch", "0"]),
    Case("build-batch-negative", [*BUILD, "--batch", "-1"]),
    Case("build-batch-not-int", [*BUILD, "--batch", "eight"], code=USAGE),
    Case("build-batch-1e30", [*BUILD, "--batch", str(10**30)], limit=FAST),
    Case("build-context-4", [*BUILD, "--context", "4"]),
    Case("build-context-0", [*BUILD, "--context", "0"]),
    Case("build-context-1e12", [*BUILD, "--context", str(10**12)], limit=FAST),
    Case("build-q-len-0", [*BUILD, "--q-len", "0"]),
    Case("build-page-size-7", [*BUILD, "--page-size", "7", "--context", "4096"]),
    Case("build-page-size-0", [*BUILD, "--page-size", "0"]),
    Case("build-target-v9", ["build", "--model", "tiny-dense", "--target", "v9"]),
    # a target spelled another way: the one it means (before: no suggestion for these)
    Case("build-target-v7x", ["build", "--model", "tiny-dense", "--target", "v7x"],
         says=("unknown target 'v7x' (did you mean 'tpu7x'?)",)),
    Case("key-target-accelerator-type", ["cache-key", "--model", "tiny-dense", "--target", "v5litepod-16"],
         says=("(did you mean 'v5e'?)",)),
    Case("key-target-code-name", ["cache-key", "--model", "tiny-dense", "--target", "Trillium"],
         says=("(did you mean 'v6e'?)",)),
    # ---- devices
    Case("build-devices-0", [*BUILD, "--devices", "0"]),
    Case("build-devices-negative", [*BUILD, "--devices", "-4"]),
    Case("build-devices-not-int", [*BUILD, "--devices", "four"], code=USAGE),
    Case("build-devices-1e12", [*BUILD, "--devices", str(10**12)], limit=FAST),
    Case("build-devices-not-dividing-heads", ["build", "--model", "tiny-dense", "--target", "tpu7x", "--devices", "3"]),
    Case("build-devices-more-than-heads", ["build", "--model", "qwen3-8b", "--target", "v5e", "--devices", "128"]),
    Case("build-expert-parallel-invalid", ["build", "--model", "tiny-moe", "--target", "tpu7x", "--devices", "4",
                                          "--tuning", "t.toml"], files={"t.toml": "[tuning]\nexpert_parallel = 3\n"}),
    Case("build-235b-on-one-device", ["build", "--model", "qwen3-235b-a22b", "--target", "tpu7x"], limit=FAST),
    Case("key-devices-0", [*KEY, "--devices", "0"]),
    Case("generate-devices-0", [*GEN, "--prompt-ids", "1", "--backend", "megakernel", "--devices", "0"]),
    Case("generate-devices-reference-backend", [*GEN, "--prompt-ids", "1", "--devices", "2"]),
    Case("generate-devices-1e12", [*GEN, "--prompt-ids", "1", "--backend", "megakernel", "--devices", str(10**12)],
         limit=FAST),
    Case("build-verify-q-negative", [*BUILD, "--verify-q", "-1"]),
    Case("build-unknown-option", [*BUILD, "--batchsize", "8"], code=USAGE),
    Case("unknown-command", ["biuld"], code=USAGE),
    Case("inspect-no-path", ["inspect"], code=USAGE),
    Case("key-target-empty", ["cache-key", "--model", "tiny-dense", "--target", ""]),
    Case("key-model-empty", ["cache-key", "--model", "", "--target", "cpu"]),
    Case("key-page-size-7", [*KEY, "--page-size", "7"]),
    Case("bench-batch-0", ["bench", "--model", "tiny-dense", "--target", "cpu", "--batch", "0"]),
    Case("bench-runs-0", ["bench", "--model", "tiny-dense", "--target", "cpu", "--runs", "0"]),
    Case("export-out-regular-file", [*EXPORT, "--out", "f"], files={"f": "a file"}),
    Case("export-out-under-regular-file", [*EXPORT, "--out", "f/sub"], files={"f": "a file"}),
    Case("export-out-proc", [*EXPORT, "--out", "/proc/x"]),
    Case("export-batch-0", [*EXPORT, "--batch", "0", "--out", "out"], allow=("out",)),
    Case("cache-key-out-model-dotdot", ["cache-key", "--model", "m.toml", "--target", "cpu", "--out", "out"],
         files={"m.toml": toml_model(name="../../x")}, allow=("out",)),
    # a symlink in --out that leads outside it (README: refused, for export and cache-key --out)
    Case("cache-key-out-symlink-escape", [*KEY, "--out", "out"],
         files={"out/tiny-dense": Symlink("../../outside"), "../outside/": None}, allow=("out",)),
    Case("export-out-symlink-escape", [*EXPORT, "--out", "out"],
         files={"out/tiny-dense": Symlink("../../outside"), "../outside/": None}, allow=("out",), limit=120),
    Case("inspect-symlink-loop", ["inspect", "loop"], files={"loop": Symlink("loop")}),
    Case("build-tuning-is-a-directory", [*BUILD, "--tuning", "t.toml"], files={"t.toml/": None}),
    Case("generate-draft-model-missing-file", [*GEN, "--prompt-ids", "1", "--spec", "draft", "--draft-model", "nope.toml"]),
    Case("generate-draft-model-layers-abc", [*GEN, "--prompt-ids", "1", "--spec", "draft", "--draft-model", "layers:abc"]),
    Case("generate-draft-model-other-vocab", [*GEN, "--prompt-ids", "1", "--spec", "draft", "--draft-model", "m.toml"],
         files={"m.toml": toml_model(vocab_size=128)}),
    # a study name is not a path: the default storage and --out must not land outside artifacts/
    Case("tune-study-name-traversal", ["tune", "--model", "tiny-moe", "--target", "cpu", "--objective", "model",
                                       "--trials", "1", "--space", "s.toml", "--max-infeasible", "2",
                                       "--study", "../../../escape"],
         files={"s.toml": space(RING, constraint("ring_depth / (ring_depth - ring_depth) > 0"))},
         allow=("artifacts",), limit=60),
    Case("tune-out-is-a-directory", [*good_tune()[:good_tune().index("--out")], "--out", "best"],
         files={"best/": None}, allow=TUNE_DIRS),
    Case("cache-key-out-regular-file", [*KEY, "--out", "f"], files={"f": "a file"}),
    Case("tune-out-under-regular-file", ["tune", "--model", "tiny-moe", "--target", "cpu", "--objective", "model",
                                         "--trials", "1", "--space", TINY_SPACE, "--storage", "sqlite:///st/s.db",
                                         "--cache-dir", "cache", "--out", "f/t.toml"],
         files={"f": "a file"}, allow=("st", "cache")),
    # ---- fresh processes: environment read at start-up, the console script's own streams
    Case("proc-unknown-option", ["build", "--frobnicate"], code=USAGE, subprocess=True, limit=60),
    Case("proc-json-garbage", ["build", "--model", "config.json", "--target", "cpu"], files={"config.json": GARBAGE},
         subprocess=True, limit=60),
    Case("proc-signing-key-too-short", [*EXPORT, "--out", "out"], subprocess=True, limit=60, allow=("out",),
         env={"TPUMK_SIGNING_KEY": "short"}),
    Case("proc-signing-key-file-missing", [*EXPORT, "--out", "out"], subprocess=True, limit=60, allow=("out",),
         env={"TPUMK_SIGNING_KEY_FILE": "/nonexistent/key"}),
    Case("proc-signing-key-and-file-both", [*EXPORT, "--out", "out"], subprocess=True, limit=60, allow=("out",),
         files={"key": "k" * 64}, env={"TPUMK_SIGNING_KEY": "k" * 64, "TPUMK_SIGNING_KEY_FILE": "key"}),
    Case("proc-toml-binary-garbage", ["build", "--model", "m.toml", "--target", "cpu"], files={"m.toml": GARBAGE},
         subprocess=True, limit=60),
    # a regex past Oniguruma's retry limit: a panic, whose Rust report (and backtrace) went to stderr
    Case("proc-tokenizer-regex-retry-limit", [*CKPT_PROMPT[:-3], "a" * 40 + "b", "--steps", "1"], subprocess=True,
         limit=60, env={"RUST_BACKTRACE": "1"}, files=checkpoint(
             tensors=lambda: safetensors_bytes(tiny_tensors()), extra={"ckpt/tokenizer.json": tokenizer_json(
                 pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a+)+c"}, "behavior": "Isolated",
                                "invert": False})}),
         says=("tokenizer.json", "retry-limit-in-match")),
]

_ids = [c.id for c in CASES]
assert len(_ids) == len(set(_ids)), sorted({i for i in _ids if _ids.count(i) > 1})


# ---------------------------------------------------------------------- the harness
def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SIGNING_VARS}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def warm():
    """Import what the commands import once, so per-case limits measure the case, not imports."""
    runner = CliRunner()
    runner.invoke(main, ["models", "--json"])
    runner.invoke(main, ["cache-key", "--model", "tiny-dense", "--target", "cpu"])
    for module in ("optuna", "safetensors"):  # tune, checkpoints
        importlib.import_module(module)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_hostile_input(case: Case, tmp_path: Path, monkeypatch, warm):
    parent = tmp_path / "sentinel-parent"
    cwd = parent / "cwd"
    cwd.mkdir(parents=True)
    (parent / "SENTINEL").write_text("nothing may change here\n")
    write_tree(cwd, case.files)
    before = snapshot(parent)
    monkeypatch.chdir(cwd)
    for k in SIGNING_VARS:
        monkeypatch.delenv(k, raising=False)

    t0 = time.perf_counter()
    if case.subprocess:
        try:
            p = subprocess.run([str(TPUMK_BIN), *case.args], cwd=cwd, env=_clean_env(case.env), capture_output=True,
                               text=True, timeout=case.limit + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{case.id}: still running after {case.limit + 30:.0f} s")
        code, stdout, stderr, exc = p.returncode, p.stdout, p.stderr, None
    else:
        for k, v in case.env.items():
            monkeypatch.setenv(k, v)
        r = CliRunner().invoke(main, case.args, catch_exceptions=True)
        code, stdout, stderr, exc = r.exit_code, r.stdout, r.stderr, r.exception
    seconds = time.perf_counter() - t0
    after = snapshot(parent)

    problems = []
    if exc is not None and not isinstance(exc, SystemExit):
        last = f"{type(exc).__module__}.{type(exc).__qualname__}: {' '.join(str(exc).split())[:200]}"
        problems.append(f"uncaught exception (a traceback in a real run): {last}")
    if code != case.code:
        problems.append(f"exit code {code}, expected {case.code}")
    if "Traceback" in stdout or "Traceback" in stderr:
        problems.append("'Traceback' in the output")
    lines = error_lines(stderr)  # after any progress lines of the phases that started
    if len(lines) != 1 or not lines[0].startswith("tpumk: error:") or not lines[0][len("tpumk: error:"):].strip():
        problems.append(f"stderr is not one 'tpumk: error: ...' line ({len(lines)} lines)")
    for needle in case.says:
        if not any(needle in line for line in lines):
            problems.append(f"the error does not say {needle!r}")
    outside = stray(before, after, [str(Path("cwd") / a) for a in case.allow])
    if outside:
        problems.append(f"wrote outside {list(case.allow) or 'nothing allowed'}: {outside[:5]}")
    if seconds > case.limit:
        problems.append(f"took {seconds:.1f} s (limit {case.limit:.0f} s)")
    if problems:
        pytest.fail(f"{case.id}: " + "; ".join(problems) + f"\n  stderr: {stderr[:200]!r}\n  stdout: {stdout[:200]!r}",
                    pytrace=False)


# ---------------------------------------------------------------------- controls
def test_control_checkpoint_generates(tmp_path, monkeypatch, warm):
    """The checkpoint the ckpt-* cases damage is itself valid: the failures are the damage's."""
    write_tree(tmp_path, checkpoint(tensors=lambda: safetensors_bytes(tiny_tensors())))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, [*CKPT_GEN, "--json"])
    assert r.exit_code == 0, (r.stderr, r.exception)


def test_control_prompt_checkpoints_generate(tmp_path, monkeypatch, warm):
    """The tokenizer.json the tokenizer-* cases damage, and the GGUF file the gguf-* cases damage,
    are themselves valid: `generate --prompt` runs on both."""
    write_tree(tmp_path, checkpoint(tensors=lambda: safetensors_bytes(tiny_tensors()),
                                    extra={"ckpt/tokenizer.json": tokenizer_json()}))
    (tmp_path / "m.gguf").write_bytes(gguf_files.tiny_gguf())
    monkeypatch.chdir(tmp_path)
    for args in (CKPT_PROMPT, GGUF_PROMPT):
        r = CliRunner().invoke(main, [*args, "--json"])
        assert r.exit_code == 0, (args, r.stderr, r.exception)
        assert json.loads(r.stdout)["prompts"] == ([[1]] if args is CKPT_PROMPT else [[ord("h"), ord("i")]])


def test_control_model_toml_builds_a_spec(tmp_path, monkeypatch, warm):
    """The TOML the model cases damage is itself valid."""
    (tmp_path / "m.toml").write_text(toml_model())
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["cache-key", "--model", "m.toml", "--target", "cpu"])
    assert r.exit_code == 0, (r.stderr, r.exception)


def test_control_config_json_builds_a_spec(tmp_path, monkeypatch, warm):
    (tmp_path / "config.json").write_text(hf_json())
    (tmp_path / "moe.json").write_text(hf_json(HF_TINY_MOE))
    monkeypatch.chdir(tmp_path)
    for f in ("config.json", "moe.json"):
        r = CliRunner().invoke(main, ["cache-key", "--model", f, "--target", "cpu"])
        assert r.exit_code == 0, (f, r.stderr, r.exception)
