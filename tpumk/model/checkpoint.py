"""Load a local Hugging Face checkpoint (Qwen3, Qwen3-MoE, Qwen2, Llama, Mistral, Ministral 3, Phi-3, Granite,
Gemma, OLMo 2, Cohere, Mixtral, OLMoE, GLM-4.5, Qwen2-MoE, gpt-oss, DeepSeek-V3, Kimi K2, GLM-4.7-Flash,
Mistral Small 4; the language model of a multimodal Gemma 3, Kimi K2.5, Ministral 3, Mistral Small 4 or
Muse Spark: `language_model_tensors`) into the reference weight layout.

A checkpoint directory holds `config.json` and one or more `*.safetensors` files (listed by
`model.safetensors.index.json` when sharded). The files are opened with `safetensors.safe_open`
and tensors are read one at a time, so host memory stays near one (stacked) tensor at a time.

Name mapping (HF Linear weights are `[out, in]`; the reference layout is `[in, out]`):

    model.embed_tokens.weight                  -> embed
    model.norm.weight                          -> final_norm
    lm_head.weight                             -> lm_head (transposed; ignored when tied)
    model.layers.{i}.input_layernorm.weight    -> attn_norm
    model.layers.{i}.post_attention_layernorm  -> mlp_norm (Gemma 3: post_attn_norm; Cohere has none)
    model.layers.{i}.{pre,post}_feedforward_layernorm -> mlp_norm, post_mlp_norm (Gemma 3)
    model.layers.{i}.self_attn.{q,k,v,o}_proj  -> wq, wk, wv, wo (transposed; Cohere: each head's
                                                  q / k rows evens then odds, its RoPE pairs interleaved)
    model.layers.{i}.self_attn.qkv_proj        -> wq, wk, wv (Phi-3: q rows, then k, then v)
    model.layers.{i}.self_attn.{q,k}_norm      -> q_norm, k_norm
    model.layers.{i}.mlp.{gate,up,down}_proj   -> w_gate, w_up, w_down (dense layers)
    model.layers.{i}.mlp.gate_up_proj          -> w_gate, w_up (Phi-3: gate rows, then up rows)
    model.layers.{i}.mlp.gate.weight           -> router (transposed)
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight -> e_gate/e_up/e_down[j]
    model.layers.{i}.block_sparse_moe.gate.weight, .experts.{j}.{w1,w3,w2}.weight (Mixtral) -> the same
or the fused expert tensors of transformers 5's in-memory layout:
    model.layers.{i}.mlp.experts.gate_up_proj  [E, 2*Fe, H] (gate rows first, then up rows)
    model.layers.{i}.mlp.experts.down_proj     [E, H, Fe]
Muse Spark (its factors folded into the tensors first: tpumk.model.spark_weights; `_muse_spark_layer`):
    model.layers.{i}.self_attn.gate_proj       -> wq_gate (transposed)
    model.layers.{i}.post_{attention,feedforward}_residual_gate.gate -> res_{attn,mlp}_{alpha,beta}
    model.layers.{i}.mlp.{pre,post}_expert_proj, .pre_expert_norm -> moe_in, moe_out, moe_in_norm
    model.layers.{i}.mlp.experts.{gate_up,down}_proj (at the MoE width), .post_expert_norm (on down_proj)

FP8 checkpoints in the official format (`quantization_config` quant_method "fp8", e4m3,
weight_block_size [128, 128], TPU_FACTS 9): a projection's `weight` is e4m3 and a float32
`weight_scale_inv` [ceil(out/128), ceil(in/128)] sits beside it (dequantized = weight x
scale_inv). Such a weight is loaded as it is stored, bit for bit, as a `QuantizedMatrix` in the
fp8-b128 format (its block scales repeated over their 128 columns); the model then builds with
`--quant fp8-b128` (float matrices left in the checkpoint, e.g. the lm_head, are quantized at
pack time). Activations stay in the model dtype: the checkpoint's "dynamic" activation
quantization (a serving kernel's choice) is not emulated.
NVFP4 checkpoints in NVIDIA ModelOpt's layout (`quantization_config` quant_method "modelopt",
quant_algo "NVFP4" or "W4A16_NVFP4", group_size 16), as vLLM's ModelOpt reader takes them: a
routed expert's projection (one tensor per expert, e.g. mlp.experts.{j}.gate_proj) stores
    weight          U8 [out, in/2]       two e2m1 codes a byte, input element 2j in the low nibble
    weight_scale    F8_E4M3 [out, in/16] one scale per 16 input elements
    weight_scale_2  F32 [] (or [1])      the global scale: dequantized = code x weight_scale x it
    input_scale     F32 [] (or [1])      (W4A4 activation quantization; not used: activations
                                          stay in the model dtype)
and loads as stored (`_nvfp4_matrix`): a QuantizedMatrix of e2m1 codes, e4m3 scales and the
global scales (`outer`), no float round trip; the model builds with `--quant nvfp4`. NVFP4
anywhere else (attention, dense or shared-expert MLPs, fused expert tensors) is refused.
DeepSeek-V3 / Kimi K2 (MLA, tpumk.model.mla), as the public releases store them (GLM-4.7-Flash and
Mistral Small 4 name their MLA tensors the same; Mistral 4's router has no correction bias):
    model.layers.{i}.self_attn.q_a_proj / q_b_proj (or q_proj)  -> wq_a / wq_b (or wq)
    model.layers.{i}.self_attn.q_a_layernorm / kv_a_layernorm   -> q_a_norm / kv_a_norm
    model.layers.{i}.self_attn.kv_a_proj_with_mqa / kv_b_proj   -> wkv_a / wkv_b
    model.layers.{i}.mlp.gate.e_score_correction_bias           -> router_bias (float32, as the router)
    model.layers.{i}.self_attn.indexer.wq_b / wk / k_norm (weight, bias) / weights_proj
                                                                -> idx_wq / idx_wk / idx_k_norm, idx_k_bias /
                                                                   idx_weights (float32; sparse attention)
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj     -> s_gate, s_up, s_down (GLM-4.5 too)
Mistral Large 4 (under its wrapper's language-model prefix) adds model.rotary_emb.alpha ->
rope_alpha, self_attn.softmax_scaling.{scale,bias} -> q_log_scale / q_log_bias, and
self_attn.indexer.{q_input_norm.{weight,bias}, softmax_scaling.{scale,bias}} -> idx_q_norm /
idx_q_bias, idx_log_scale / idx_log_bias; a layer reading another's latent rows has no
kv_a_proj_with_mqa / kv_a_layernorm.
gpt-oss (float weights, as transformers saves them; tpumk.model.checkpoint._gpt_oss_experts):
    model.layers.{i}.self_attn.sinks [Hq]                        -> sinks
    model.layers.{i}.mlp.router.weight [E, H], .bias [E]        -> router (transposed), router_logit_bias
    model.layers.{i}.mlp.experts.gate_up_proj [E, H, 2F] (+ _bias [E, 2F]), gate / up columns
        interleaved                                             -> e_gate, e_up (+ e_gate_bias, e_up_bias)
    model.layers.{i}.mlp.experts.down_proj [E, F, H] (+ _bias [E, H]) -> e_down (+ e_down_bias)
Qwen2-MoE's one shared expert and its gate:
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj      -> s_gate, s_up, s_down
    model.layers.{i}.mlp.shared_expert_gate.weight [1, H]       -> shared_router [H, 1]
Their FP8 releases (the format above) store q_a_proj, q_b_proj (q_proj), kv_a_proj_with_mqa,
kv_b_proj, o_proj, the dense / shared / routed experts' projections in e4m3 blocks; each loads
bit for bit like any fp8 weight (the RoPE row permutation below moves each row's scales with
its codes), and kv_b_proj loads as the absorbed per-head `w_uk` / `w_uv` a quantized MLA layer
holds (tpumk.model.quantize), codes unchanged (`_fp8_absorbed`: when a head's nope rows would
straddle two 128-row scale blocks the checkpoint is refused rather than re-quantized).
With `rope_interleave` (transformers' default for these models) the roped output rows of
q_b_proj (or q_proj) and kv_a_proj_with_mqa hold interleaved pairs; they are permuted to
rotate-half order (evens, then odds), which is exactly what transformers' interleaved RoPE
computes, so the reference needs no interleaved variant. The multi-token-prediction layers
(model.layers.{L..L+num_nextn_predict_layers-1}) are not part of the decode step and are skipped.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp  # also imports ml_dtypes, which safetensors needs for BF16 numpy arrays
import numpy as np
from safetensors import SafetensorError, safe_open

from tpumk.files import TEXT_LIMIT, name_problem, open_regular, read_regular, shown
from tpumk.model.config import (COHERE_LOGIT_SCALE, GRANITE_SCALARS, HF_GATED_DELTA_FAMILIES, HF_GEMMA_FAMILIES, LAYER_NORMS, ModelConfig,
                                hf_text_config, load_hf_model, override_dtype)
from tpumk.model.gguf_file import is_gguf_path, open_gguf
from tpumk.errors import CheckpointError, NotSupportedError, and_more, one_line
from tpumk.model.hf_fields import LANGUAGE_MODEL_PREFIXES, WRAPPERS
from tpumk.model.quantize import (E8M0_BIAS, EXPERT_MATRICES, FORMATS, GROUP, MX_GROUP, NV_GROUP, RING_MATRICES,
                                  QuantizedMatrix, quantize_params)
from tpumk.model.reference import Params, jnp_dtype
from tpumk.model import spark_weights
from tpumk.model.weights import expected_shapes, tensor_dtype

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype tags of the float formats read as is; e4m3 is read in FP8 checkpoints only
# (see `tpumk.model.config.stored_scheme`); anything else (int / packed) is a quantization tpumk does not read.
_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
FP8_TAG = "F8_E4M3"
_INT_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U8", "BOOL"})
# Reference keys a checkpoint may store in FP8 (the ring's matrices and the routed experts: the
# formats tpumk streams); the router, embedding and norms must be float.
_FP8_KEYS = frozenset(RING_MATRICES + EXPERT_MATRICES + ("lm_head", "wkv_b"))
# Buffers some older exports saved alongside the weights; they are derived, not parameters.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


# ---------------------------------------------------------------------- safetensors reading
class _Tensor:
    """One tensor of an open safetensors file: shape and dtype from the header, data read on demand."""

    def __init__(self, name: str, file: Path, handle: Any):
        self.name, self.file, self._handle = name, file, handle
        info = handle.get_slice(name)  # header only, no data read
        self.shape = tuple(int(s) for s in info.get_shape())
        self.dtype_tag = info.get_dtype()

    def read(self, fp8: bool = False, raw_bytes: bool = False) -> np.ndarray:
        """The tensor as numpy: a float dtype (`fp8`: e4m3 too; `raw_bytes`: only uint8, the
        packed codes and scales of an MXFP4 tensor)."""
        if raw_bytes and self.dtype_tag != "U8":
            raise CheckpointError(f"{self.file}: tensor '{self.name}' has dtype {self.dtype_tag}, expected U8 "
                                  "(MXFP4 blocks and scales are bytes)")
        if self.dtype_tag not in _DTYPES and not (fp8 and self.dtype_tag == FP8_TAG) and not raw_bytes:
            raise NotSupportedError(f"{self.file}: not supported yet: tensor '{self.name}' has dtype "
                                    f"{self.dtype_tag} (quantized checkpoints are not supported)")
        try:
            if self.dtype_tag == FP8_TAG:
                return self._read_fp8()
            return self._handle.get_tensor(self.name)
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.file}: cannot read tensor '{self.name}' ({one_line(e)})") from None


    def read_ints(self) -> np.ndarray:
        """An integer or boolean tensor (a drafter's vocabulary maps: d2t int64, t2d bool) as numpy."""
        if self.dtype_tag not in _INT_DTYPES:
            raise CheckpointError(f"{self.file}: tensor '{self.name}' has dtype {self.dtype_tag}, expected an integer "
                                  "or boolean tensor")
        try:
            return self._handle.get_tensor(self.name)
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{self.file}: cannot read tensor '{self.name}' ({one_line(e)})") from None

    def _read_fp8(self) -> np.ndarray:
        """An e4m3 tensor's bytes as float8_e4m3fn (safetensors' numpy reader has no fp8 dtype):
        the file is an 8-byte little-endian header length, a JSON header giving each tensor's
        [begin, end) byte offsets past it, then the data."""
        with open(self.file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(n))[self.name]
            begin, end = entry["data_offsets"]
            f.seek(8 + n + begin)
            data = f.read(end - begin)
        return np.frombuffer(data, dtype=jnp.float8_e4m3fn).reshape(self.shape)


MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own bound on a header


def _check_safetensors(file: Path) -> None:
    """Before the library opens it: a regular file (a FIFO would block its open, a device read
    without end) whose 8-byte header length fits in the file."""
    fd = open_regular(file, "expected a safetensors file", CheckpointError)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or n > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"{file}: not a readable safetensors file (header length {n} in a file of "
                              f"{size} bytes)")


def _open_file(file: Path, stack: ExitStack) -> dict[str, _Tensor]:
    """The tensors of one safetensors file, which stays open until `stack` closes."""
    _check_safetensors(file)
    try:
        handle = stack.enter_context(safe_open(str(file), framework="numpy"))
        return {name: _Tensor(name, file, handle) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({one_line(e)})") from None


def _index_tensors(d: Path, stack: ExitStack) -> dict[str, _Tensor]:
    """Every tensor of the checkpoint by name, with the file that holds it (open until `stack` closes)."""
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(read_regular(index, TEXT_LIMIT, "expected a JSON index",
                                                 CheckpointError).decode("utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
            raise CheckpointError(f"{index}: malformed index ({one_line(e)})") from None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise CheckpointError(f"{index}: malformed index (field 'weight_map': expected an object of "
                                  "tensor name -> shard file name)")
        for f in sorted(set(weight_map.values())):
            # a shard is a file of the checkpoint directory: a path would read files outside it
            if f in ("", ".", "..") or "/" in f or "\\" in f or "\0" in f:
                raise CheckpointError(f"{index}: lists shard {shown(f, 60)!r}: expected a file name inside {shown(d)} "
                                      "(no '/', '\\' or '..')")
        files = [d / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if name_problem(f):  # is_file() raises on a name the OS refuses
                raise CheckpointError(f"{index}: lists shard '{shown(f.name, 60)}': {name_problem(f)}")
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard '{f.name}' which is missing from {d}")
    else:
        weight_map = None
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{d}: no *.safetensors files in the checkpoint directory")
    tensors: dict[str, _Tensor] = {}
    for f in files:
        for name, t in _open_file(f, stack).items():
            if name in tensors:
                raise CheckpointError(f"{d}: tensor '{name}' appears in both {tensors[name].file.name} and {f.name}")
            tensors[name] = t
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors or tensors[name].file.name != fname:
                raise CheckpointError(f"{index}: lists tensor '{name}' in {fname}, which does not hold it")
    return tensors


def open_tensors(d: Path, stack: ExitStack) -> dict[str, _Tensor]:
    """Every tensor of the safetensors directory `d` by name (sharded or not, each file checked
    as load_checkpoint checks it), open until `stack` closes: for readers of other tensor layouts
    (a drafter's, tpumk.draft). Each has `shape`, `dtype_tag`, `read()` (float) and `read_ints()`."""
    return _index_tensors(d, stack)


# ---------------------------------------------------------------------- name mapping
# Each HF tensor feeds one or more destinations: (layer index or None, reference key, where in the
# reference tensor (None: all of it; an int: that expert, the leading index; (lo, hi): those
# columns of the last axis, several HF tensors side by side), HF-side shape it must have,
# transform from the HF array to the reference slice).
_Dest = tuple[int | None, str, int | tuple[int, int] | None, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


def _t(a: np.ndarray) -> np.ndarray:
    return a.T


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _rope_deinterleave(a: np.ndarray, heads: int, head_rows: int, rope: int) -> np.ndarray:
    """Rows [out, in] whose per-head last `rope` rows are interleaved pairs -> evens then odds."""
    idx = np.arange(a.shape[0]).reshape(heads, head_rows)
    tail = idx[:, head_rows - rope:]
    idx[:, head_rows - rope:] = np.concatenate([tail[:, 0::2], tail[:, 1::2]], 1)
    return a[idx.reshape(-1)]


def _mla_attention(cfg: ModelConfig, p: str, i: int, add, interleave: bool) -> None:
    # (a Mistral Large 4 NoPE layer: wide query / key blocks, no rope lanes to permute)
    n, r = cfg.attention.layer_key_widths(cfg.pattern.rotates(i))
    c = cfg.kv_lora_rank
    q_size = cfg.num_q_heads * (n + r)
    q_fix = ((lambda a: _rope_deinterleave(a, cfg.num_q_heads, n + r, r).T) if interleave and r else _t)
    kv_fix = ((lambda a: _rope_deinterleave(a, 1, c + r, r).T) if interleave and r else _t)
    if cfg.q_lora_rank:
        add(p + "self_attn.q_a_proj.weight", i, "wq_a", _t)
        add(p + "self_attn.q_a_layernorm.weight", i, "q_a_norm")
        add(p + "self_attn.q_b_proj.weight", i, "wq_b", q_fix, hf_shape=(q_size, cfg.q_lora_rank))
    else:
        add(p + "self_attn.q_proj.weight", i, "wq", q_fix, hf_shape=(q_size, cfg.hidden_size))
    if cfg.pattern.owns_kv(i):  # (a Mistral Large 4 layer reading another's latent rows has neither)
        add(p + "self_attn.kv_a_proj_with_mqa.weight", i, "wkv_a", kv_fix, hf_shape=(c + r, cfg.hidden_size))
        add(p + "self_attn.kv_a_layernorm.weight", i, "kv_a_norm")
    add(p + "self_attn.kv_b_proj.weight", i, "wkv_b", _t)
    add(p + "self_attn.o_proj.weight", i, "wo", _t)
    if cfg.attention.query_log_scale:  # Mistral Large 4's MistralLarge4TextSoftmaxScaling
        add(p + "self_attn.softmax_scaling.scale", i, "q_log_scale")
        add(p + "self_attn.softmax_scaling.bias", i, "q_log_bias")
    if cfg.has_indexer(i):  # sparse attention's lightning indexer (transformers' DeepseekV32Indexer)
        for name, key, fn in (("wq_b.weight", "idx_wq", _t), ("wk.weight", "idx_wk", _t), ("k_norm.weight", "idx_k_norm", _same),
                              ("k_norm.bias", "idx_k_bias", _same), ("weights_proj.weight", "idx_weights", _t)):
            add(p + "self_attn.indexer." + name, i, key, fn)
        if cfg.attention.index_q_hidden:
            add(p + "self_attn.indexer.q_input_norm.weight", i, "idx_q_norm")
            add(p + "self_attn.indexer.q_input_norm.bias", i, "idx_q_bias")
        if cfg.attention.query_log_scale:
            add(p + "self_attn.indexer.softmax_scaling.scale", i, "idx_log_scale")
            add(p + "self_attn.indexer.softmax_scaling.bias", i, "idx_log_bias")


def _linear_attention(cfg: ModelConfig, p: str, i: int, add, names: set[str]) -> None:
    """A linear-attention layer's tensors (tpumk.model.linear_attention's layout).

    Gated DeltaNet: Qwen3.5 stores in_proj_qkv (q | k | v, the convolution's channel order),
    in_proj_z, in_proj_b, in_proj_a; Qwen3-Next fuses them as in_proj_qkvz (per key head: its q
    and k rows, then its value heads' v and z rows) and in_proj_ba (per key head: its value
    heads' b, then their a). KDA (Kimi Linear): q / k / v projections and convolutions each,
    the forget gate f_a / f_b with A_log [1, 1, heads, 1] and dt_bias, b_proj, the output gate
    g_a / g_b, o_norm, o_proj. Convolutions [channels, 1, taps] -> [taps, channels]."""
    lin, h = cfg.linear, cfg.hidden_size
    hk, hv, dk, dv, r = lin.linear_key_heads, lin.linear_value_heads, lin.linear_key_dim, lin.linear_value_dim, lin.group
    kd, vd, c, taps = lin.key_size, lin.value_size, lin.conv_dim, lin.linear_conv
    a = "linear_attn." if lin.linear_kind == "gated_delta" else "self_attn."
    conv = (lambda x: x[:, 0, :].T)
    if lin.linear_kind == "kda":
        for j, proj in enumerate(("q", "k", "v")):
            add(p + f"{a}{proj}_proj.weight", i, "lin_qkv", _t, expert=(j * kd, (j + 1) * kd), hf_shape=(kd, h))
            add(p + f"{a}{proj}_conv1d.weight", i, "lin_conv", conv, expert=(j * kd, (j + 1) * kd), hf_shape=(kd, 1, taps))
        for proj, key in (("f_a_proj", "lin_f_a"), ("f_b_proj", "lin_f_b"), ("b_proj", "lin_b"), ("g_a_proj", "lin_g_a"),
                          ("g_b_proj", "lin_g_b"), ("o_proj", "lin_out")):
            add(p + f"{a}{proj}.weight", i, key, _t)
        add(p + a + "A_log", i, "lin_A_log", lambda x: x.reshape(-1), hf_shape=(1, 1, hv, 1))
        add(p + a + "dt_bias", i, "lin_dt_bias")
        add(p + a + "o_norm.weight", i, "lin_norm")
        return
    if p + a + "in_proj_qkvz.weight" in names:
        per = 2 * dk + 2 * r * dv  # one key head's rows
        base = np.arange(hk)[:, None] * per
        q_rows = (base + np.arange(dk)).reshape(-1)
        k_rows = (base + dk + np.arange(dk)).reshape(-1)
        v_rows = (base + 2 * dk + np.arange(r * dv)).reshape(-1)
        z_rows = (base + 2 * dk + r * dv + np.arange(r * dv)).reshape(-1)
        qkv_rows = np.concatenate([q_rows, k_rows, v_rows])
        add(p + a + "in_proj_qkvz.weight", i, "lin_qkv", lambda x: x[qkv_rows].T, hf_shape=(per * hk, h))
        add(p + a + "in_proj_qkvz.weight", i, "lin_z", lambda x: x[z_rows].T, hf_shape=(per * hk, h))
        ba = np.arange(hk)[:, None] * 2 * r
        b_rows, a_rows = (ba + np.arange(r)).reshape(-1), (ba + r + np.arange(r)).reshape(-1)
        add(p + a + "in_proj_ba.weight", i, "lin_b", lambda x: x[b_rows].T, hf_shape=(2 * hv, h))
        add(p + a + "in_proj_ba.weight", i, "lin_a", lambda x: x[a_rows].T, hf_shape=(2 * hv, h))
    else:
        for proj, key in (("in_proj_qkv", "lin_qkv"), ("in_proj_z", "lin_z"), ("in_proj_b", "lin_b"),
                          ("in_proj_a", "lin_a")):
            add(p + f"{a}{proj}.weight", i, key, _t)
    add(p + a + "conv1d.weight", i, "lin_conv", conv, hf_shape=(c, 1, taps))
    add(p + a + "A_log", i, "lin_A_log")
    add(p + a + "dt_bias", i, "lin_dt_bias")
    add(p + a + "norm.weight", i, "lin_norm")
    add(p + a + "out_proj.weight", i, "lin_out", _t)


def _mtp_layers(cfg: ModelConfig, config_json: dict[str, Any], names: set[str]) -> list[str]:
    """Tensors of the multi-token-prediction layers a DeepSeek-V3 or GLM-4.5 checkpoint appends
    (transformers 5 names the count num_mtp_layers for GLM)."""
    extra = config_json.get("num_nextn_predict_layers") or config_json.get("num_mtp_layers") or 0
    mtp_family = cfg.is_mla or config_json.get("model_type") == "glm4_moe"
    if not (mtp_family and isinstance(extra, int) and extra > 0):
        return []
    layer = re.compile(r"model\.layers\.(\d+)\.")
    return [n for n in names if (m := layer.match(n)) and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + extra]


def rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """One head's lanes in tpumk's partial-rotary layout (ModelConfig.rotary_dim), as indices into
    transformers' [rotary lanes (rotate-half within them), unrotated lanes]: each half of the
    head takes its rotary_dim / 2 rotary lanes, then half of the unrotated ones."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot, keep = np.arange(rotary_dim), np.arange(rotary_dim, head_dim)
    return np.concatenate([rot[:half], keep[:rest], rot[half:], keep[rest:]])


def _rotary_perm(heads: int, head_dim: int, rotary_dim: int) -> np.ndarray:
    """The rotary_order of each of `heads` heads of head_dim lanes, as indices into all of them."""
    return (np.arange(heads)[:, None] * head_dim + rotary_order(head_dim, rotary_dim)[None]).reshape(-1)


def _plan(cfg: ModelConfig, names: set[str], config_json: dict[str, Any] | None = None, layers_only: bool = False
          ) -> tuple[dict[str, list[_Dest]], list[str]]:
    """Map every expected HF tensor name to its destinations; also return names to ignore.
    `layers_only`: the decoder layers' tensors alone (no embedding, final norm or head)."""
    config_json = config_json or {}
    shapes = expected_shapes(cfg)
    plan: dict[str, list[_Dest]] = {}
    ignored = [n for n in names if _IGNORED.match(n)] + _mtp_layers(cfg, config_json, names)
    if config_json.get("model_type") in HF_GATED_DELTA_FAMILIES:  # Qwen3-Next / Qwen3.5's MTP head, a drafter's
        ignored += [n for n in names if n.startswith("mtp.")]
    # transformers rotates interleaved pairs when rope_interleave is true (Mistral 4 admits null: not)
    interleave = cfg.is_mla and bool(config_json.get("rope_interleave", True))
    # Cohere rotates interleaved pairs over the whole head: q / k rows permuted the same way
    # (q . k unchanged), so the rotate-half RoPE of the reference and the kernel applies.
    cohere = config_json.get("model_type") == "cohere"
    d, rd = cfg.head_dim, cfg.positions.rotary_dim
    mx = (config_json.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    heads_of = {"wq": cfg.num_q_heads, "wk": cfg.num_kv_heads, "bq": cfg.num_q_heads, "bk": cfg.num_kv_heads}

    def rotary(key: str, fn):
        """fn, then (partial rotary) the q / k heads' lanes put in rotary_order: the columns of wq
        / wk ([in, out] once fn has run), the biases and the QK-norm weights."""
        if not rd or rd == d or key not in (*heads_of, "q_norm", "k_norm"):
            return fn
        n = heads_of.get(key, 1 if not cfg.attention.qk_norm_whole else
                         (cfg.num_q_heads if key == "q_norm" else cfg.num_kv_heads))
        perm = _rotary_perm(n, d, rd)
        return (lambda a: fn(a)[:, perm]) if key in ("wq", "wk") else (lambda a: fn(a)[perm])

    def add(hf: str, layer: int | None, key: str, fn=_same, expert: int | tuple[int, int] | None = None,
            hf_shape: tuple[int, ...] | None = None) -> None:
        fn_in = fn
        fn = rotary(key, fn)
        ref = shapes["layers"][layer][key] if layer is not None else shapes[key]
        if isinstance(expert, tuple):  # columns lo:hi of the reference tensor
            ref = (*ref[:-1], expert[1] - expert[0])
        elif expert is not None:
            ref = ref[1:]
        if hf_shape is None:
            hf_shape = tuple(reversed(ref)) if fn_in is _t else ref
        plan.setdefault(hf, []).append((layer, key, expert, hf_shape, fn))

    if not layers_only:
        add("model.embed_tokens.weight", None, "embed")
        if cfg.rope_learned_freqs:  # Mistral Large 4: RoPE frequencies x exp(alpha)
            add("model.rotary_emb.alpha", None, "rope_alpha")
        add("model.norm.weight", None, "final_norm")
        if cfg.head.tie_embeddings:
            if "lm_head.weight" in names:  # some exports write the tied copy; it equals embed
                ignored.append("lm_head.weight")
        else:
            add("lm_head.weight", None, "lm_head", _t)
    muse = config_json.get("model_type") == "muse_spark_text"  # its tensors folded first (spark_weights)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if muse:
            _muse_spark_layer(cfg, p, i, add)
            continue
        if cfg.norms.pre_norms:  # OLMo 2 has none
            add(p + "input_layernorm.weight", i, "attn_norm")
        if cfg.norms.post_norms:  # Gemma 2 / 3, OLMo 2: post_attention_layernorm normalizes attention's output
            add(p + "post_attention_layernorm.weight", i, "post_attn_norm")
            if cfg.norms.pre_norms:
                add(p + "pre_feedforward_layernorm.weight", i, "mlp_norm")
            add(p + "post_feedforward_layernorm.weight", i, "post_mlp_norm")
        elif not cfg.norms.parallel_blocks:  # Cohere's MLP reads input_layernorm's output too
            add(p + "post_attention_layernorm.weight", i, "mlp_norm")
        if cfg.pattern.is_linear(i):
            _linear_attention(cfg, p, i, add, names)
        elif cfg.is_mla:
            _mla_attention(cfg, p, i, add, interleave)
        elif cfg.attention.attn_output_gate:  # Qwen3-Next: q_proj rows per head: its q lanes, then its gate's
            q, d2 = cfg.attention.q_size, 2 * d
            rows = np.arange(2 * q).reshape(cfg.num_q_heads, d2)
            for key, part in (("wq", rows[:, :d]), ("wq_gate", rows[:, d:])):
                add(p + "self_attn.q_proj.weight", i, key, lambda a, r=part.reshape(-1): a[r].T,
                    hf_shape=(2 * q, cfg.hidden_size))
            for proj, key in (("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
                add(p + f"self_attn.{proj}.weight", i, key, _t)
        elif p + "self_attn.qkv_proj.weight" in names:  # Phi-3: q, k and v rows in one tensor
            q, kv, h = cfg.attention.q_size, cfg.attention.kv_size, cfg.hidden_size
            for key, lo, hi in (("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)):
                add(p + "self_attn.qkv_proj.weight", i, key, lambda a, lo=lo, hi=hi: a[lo:hi].T,
                    hf_shape=(q + 2 * kv, h))
            add(p + "self_attn.o_proj.weight", i, "wo", _t)
        else:
            for proj, key, heads in (("q_proj", "wq", cfg.num_q_heads), ("k_proj", "wk", cfg.num_kv_heads),
                                     ("v_proj", "wv", 0), ("o_proj", "wo", 0)):
                fix = (lambda a, n=heads: _rope_deinterleave(a, n, d, d).T) if cohere and heads else _t
                add(p + f"self_attn.{proj}.weight", i, key, fix, hf_shape=tuple(reversed(shapes["layers"][i][key])))
            if cfg.attention.qkv_bias:  # Qwen2: q, k and v biases (o has none); Cohere's permuted as its rows
                for proj, key, heads in (("q_proj", "bq", cfg.num_q_heads), ("k_proj", "bk", cfg.num_kv_heads),
                                         ("v_proj", "bv", 0)):
                    fix = (lambda a, n=heads: _rope_deinterleave(a, n, d, d)) if cohere and heads else _same
                    add(p + f"self_attn.{proj}.bias", i, key, fix)
            if cfg.attention.o_bias:  # attention_bias: o_proj's too
                add(p + "self_attn.o_proj.bias", i, "bo")
        if cfg.attention.qk_norm and not cfg.pattern.is_linear(i):
            add(p + "self_attn.q_norm.weight", i, "q_norm")
            add(p + "self_attn.k_norm.weight", i, "k_norm")
        if cfg.attention.attn_sinks and not cfg.pattern.is_linear(i):  # gpt-oss: [num_q_heads]
            add(p + "self_attn.sinks", i, "sinks")
        if cfg.pattern.is_dense(i) and p + "mlp.gate_up_proj.weight" in names:  # Phi-3: gate rows, then up rows
            f, h = cfg.ffn_size, cfg.hidden_size
            add(p + "mlp.gate_up_proj.weight", i, "w_gate", lambda a, f=f: a[:f].T, hf_shape=(2 * f, h))
            add(p + "mlp.gate_up_proj.weight", i, "w_up", lambda a, f=f: a[f:].T, hf_shape=(2 * f, h))
            add(p + "mlp.down_proj.weight", i, "w_down", _t)
            continue
        if cfg.pattern.is_dense(i):
            # Kimi Linear's files keep a dense layer's MLP under block_sparse_moe too
            where = "block_sparse_moe." if p + "block_sparse_moe.gate_proj.weight" in names else "mlp."
            for proj, key in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
                add(p + f"{where}{proj}.weight", i, key, _t)
            continue
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe.expert_ffn_size
        if cfg.moe.expert_bias:  # gpt-oss: router with a bias; experts [in, out], gate / up interleaved
            _gpt_oss_experts(p, i, add, e, h, f, mx)
            continue
        # Mixtral's files keep the routed MLP under block_sparse_moe, its experts' matrices as w1
        # (gate), w3 (up) and w2 (down); transformers 5's modules under mlp, fused as Qwen3-MoE's
        mixtral = p + "block_sparse_moe.gate.weight" in names
        moe = "block_sparse_moe." if mixtral else "mlp."
        add(p + moe + "gate.weight", i, "router", _t)
        if cfg.moe.router_correction_bias:
            add(p + moe + "gate.e_score_correction_bias", i, "router_bias")
        if cfg.moe.num_shared_experts:  # DeepSeek-V3 / GLM-4.5: shared_experts; Qwen2-MoE: shared_expert
            where = moe + ("shared_expert." if cfg.moe.shared_expert_gate else "shared_experts.")
            for proj, key in (("gate_proj", "s_gate"), ("up_proj", "s_up"), ("down_proj", "s_down")):
                add(p + f"{where}{proj}.weight", i, key, _t)
            if cfg.moe.shared_expert_gate:  # [1, H] -> [H, 1]
                add(p + "mlp.shared_expert_gate.weight", i, "shared_router", _t)
        if p + "mlp.experts.gate_up_proj" in names:
            gu = p + "mlp.experts.gate_up_proj"
            add(gu, i, "e_gate", lambda a, f=f: a[:, :f].transpose(0, 2, 1), hf_shape=(e, 2 * f, h))
            add(gu, i, "e_up", lambda a, f=f: a[:, f:].transpose(0, 2, 1), hf_shape=(e, 2 * f, h))
            add(p + "mlp.experts.down_proj", i, "e_down", lambda a: a.transpose(0, 2, 1), hf_shape=(e, h, f))
        else:
            projs = (("w1", "e_gate"), ("w3", "e_up"), ("w2", "e_down")) if mixtral else \
                (("gate_proj", "e_gate"), ("up_proj", "e_up"), ("down_proj", "e_down"))
            where = "block_sparse_moe.experts" if mixtral else "mlp.experts"
            for j in range(e):
                for proj, key in projs:
                    add(p + f"{where}.{j}.{proj}.weight", i, key, _t, expert=j)
    return plan, ignored


def _muse_spark_layer(cfg: ModelConfig, p: str, i: int, add) -> None:
    """Muse Spark's layer i (its tensors as tpumk.model.spark_weights.fold_tensors leaves them):
    the norms and residual gates, q / k / v / o with the output gate's gate_proj, then a dense MLP or
    the routed experts between pre_expert_proj (and its norm) and post_expert_proj."""
    for hf, key in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
                    ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm"),
                    ("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm")):
        add(p + hf + ".weight", i, key)
    for which, gate in spark_weights.GATES.items():
        for c in ("alpha", "beta"):
            add(p + f"{gate}.{c}", i, f"res_{which}_{c}")
    for proj, key in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo"), ("gate_proj", "wq_gate")):
        add(p + f"self_attn.{proj}.weight", i, key, _t)
    if cfg.pattern.is_dense(i):
        for proj, key in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            add(p + f"mlp.{proj}.weight", i, key, _t)
        return
    e, m, f = cfg.num_experts, cfg.moe.width(cfg.hidden_size), cfg.moe.expert_ffn_size
    add(p + "mlp.gate.weight", i, "router", _t)
    add(p + "mlp.gate.e_score_correction_bias", i, "router_bias")
    add(p + "mlp.pre_expert_proj.weight", i, "moe_in", _t)
    add(p + "mlp.pre_expert_norm.weight", i, "moe_in_norm")
    add(p + "mlp.post_expert_proj.weight", i, "moe_out", _t)
    gu = p + "mlp.experts.gate_up_proj"
    add(gu, i, "e_gate", lambda a, f=f: a[:, :f].transpose(0, 2, 1), hf_shape=(e, 2 * f, m))
    add(gu, i, "e_up", lambda a, f=f: a[:, f:].transpose(0, 2, 1), hf_shape=(e, 2 * f, m))
    add(p + "mlp.experts.down_proj", i, "e_down", lambda a: a.transpose(0, 2, 1), hf_shape=(e, m, f))


def _gpt_oss_experts(p: str, i: int, add, e: int, h: int, f: int, mx: bool) -> None:
    """gpt-oss's MoE tensors as transformers stores them: the router (weight [E, H], bias [E]),
    gate_up_proj [E, H, 2F] with gate and up columns interleaved (gate at even columns, up at
    odd: GptOssExperts._apply_gate), its bias [E, 2F] alike, down_proj [E, F, H] and its bias
    [E, H] (already [in, out]). `mx` (the MXFP4 release): gate_up_proj_blocks / _scales and
    down_proj_blocks / _scales instead of the float matrices (`_mxfp4_matrix`, read in pairs by `_load_params`)."""
    add(p + "mlp.router.weight", i, "router", _t)
    add(p + "mlp.router.bias", i, "router_logit_bias")
    gu = p + "mlp.experts.gate_up_proj"
    if mx:  # [E, out, in / 32, 16] bytes and [E, out, in / 32] E8M0 scales, output rows interleaved
        add(gu + "_blocks", i, "e_gate", MX_EXPERTS, hf_shape=(e, 2 * f, h // MX_GROUP, MX_GROUP // 2))
        add(gu + "_scales", i, "e_gate", MX_EXPERTS, hf_shape=(e, 2 * f, h // MX_GROUP))
        dn = p + "mlp.experts.down_proj"
        add(dn + "_blocks", i, "e_down", MX_EXPERTS, hf_shape=(e, h, f // MX_GROUP, MX_GROUP // 2))
        add(dn + "_scales", i, "e_down", MX_EXPERTS, hf_shape=(e, h, f // MX_GROUP))
    else:
        add(gu, i, "e_gate", lambda a: a[..., 0::2], hf_shape=(e, h, 2 * f))
        add(gu, i, "e_up", lambda a: a[..., 1::2], hf_shape=(e, h, 2 * f))
    add(gu + "_bias", i, "e_gate_bias", lambda a: a[..., 0::2], hf_shape=(e, 2 * f))
    add(gu + "_bias", i, "e_up_bias", lambda a: a[..., 1::2], hf_shape=(e, 2 * f))
    if not mx:
        add(p + "mlp.experts.down_proj", i, "e_down")
    add(p + "mlp.experts.down_proj_bias", i, "e_down_bias")


def MX_EXPERTS(a: np.ndarray) -> np.ndarray:
    """The marker transform of an MXFP4 tensor's plan entries: `_load_params` reads each
    *_blocks tensor with its *_scales (`_mxfp4_matrix`)."""
    return a


def _mxfp4_matrix(blocks: _Tensor, scales: _Tensor, compute) -> QuantizedMatrix:
    """An MXFP4 tensor pair as gpt-oss stores it (transformers' convert_moe_packed_tensors):
    blocks [E, out, G, 16] bytes, byte j of group g holding input rows 32g + 2j (low nibble) and
    32g + 2j + 1 (high nibble) as e2m1 codes; scales [E, out, G] E8M0 bytes (2^(b - 127)). As a
    QuantizedMatrix [E, in, out]: the codes bit for bit (float4_e2m1fn), the scales as float32
    powers of two per (32 input rows, output column). An E8M0 byte of 255 (NaN) is refused."""
    raw, sc = blocks.read(raw_bytes=True), scales.read(raw_bytes=True)
    if 255 in sc:
        raise CheckpointError(f"{scales.file}: tensor '{scales.name}' holds the E8M0 byte 255 (NaN): expected "
                              "finite power-of-two scales")
    e, out, g, half = raw.shape
    nibbles = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(e, out, g * 2 * half)  # [E, out, in]
    codes = E2M1_CODES[nibbles].transpose(0, 2, 1)  # [E, in, out]
    scale = np.ldexp(np.float32(1.0), sc.astype(np.int32) - E8M0_BIAS).astype(np.float32).transpose(0, 2, 1)
    return QuantizedMatrix(jnp.asarray(codes), jnp.asarray(scale), jnp.zeros((0,), compute))


NV_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale")  # beside an NVFP4 module's .weight


def _scalar_f32(t: _Tensor) -> float:
    """A per-tensor float32 scale, stored with shape [] or [1]."""
    if t.dtype_tag != "F32" or t.shape not in ((), (1,)):
        raise CheckpointError(f"{t.file}: tensor '{t.name}' has dtype {t.dtype_tag} and shape {list(t.shape)}, "
                              "expected a float32 scalar (shape [] or [1])")
    return float(np.asarray(t.read(), np.float32).reshape(()))


def _nvfp4_matrix(weight: _Tensor, scale: _Tensor, global_: _Tensor, input_scale: _Tensor | None,
                  hf_shape: tuple[int, ...], compute) -> QuantizedMatrix:
    """One NVFP4 projection of a ModelOpt checkpoint (module docstring) as a QuantizedMatrix
    [in, out]: the codes bit for bit (float4_e2m1fn, byte j's low nibble input element 2j),
    the e4m3 scales as stored [in/16, out], the global scale as `outer`. A scale tensor of
    another shape or dtype, a NaN e4m3 scale, or a global scale that is not a finite
    non-negative number is refused naming the tensor."""
    out_dim, in_dim = hf_shape
    want = (out_dim, in_dim // NV_GROUP)
    if scale.shape != want or scale.dtype_tag != FP8_TAG:
        raise CheckpointError(f"{scale.file}: tensor '{scale.name}' has shape {list(scale.shape)} and dtype "
                              f"{scale.dtype_tag}, expected {list(want)} {FP8_TAG} (one e4m3 scale per "
                              f"{NV_GROUP} input elements)")
    sc = scale.read(fp8=True)
    if np.any(np.isnan(sc.astype(np.float32))):
        raise CheckpointError(f"{scale.file}: tensor '{scale.name}' holds a NaN e4m3 scale: expected finite scales")
    g = _scalar_f32(global_)
    if not (np.isfinite(g) and g >= 0):
        raise CheckpointError(f"{global_.file}: tensor '{global_.name}' = {g!r}: expected a finite global scale "
                              "of at least 0 (dequantized = code x weight_scale x weight_scale_2)")
    if input_scale is not None:
        _scalar_f32(input_scale)
    raw = weight.read(raw_bytes=True)
    nibbles = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(out_dim, in_dim)  # [out, in]
    return QuantizedMatrix(jnp.asarray(E2M1_CODES[nibbles].T), jnp.asarray(sc.T), jnp.zeros((0,), compute),
                           jnp.asarray(g, jnp.float32))


# The 16 e2m1 codes by their 4 bits (bit 3 the sign), as float4_e2m1fn values.
E2M1_CODES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                      np.float32).astype(jnp.float4_e2m1fn)


# ---------------------------------------------------------------------- public API
def fold_granite_scalars(cfg: ModelConfig, params: Params, config_json: dict[str, Any]) -> tuple[ModelConfig, Params]:
    """Granite's scalars folded into its weights, after which it is a Llama (transformers'
    GraniteModel: embeddings x embedding_multiplier, each sublayer's output x residual_multiplier
    before the residual add, scores x attention_multiplier instead of 1 / sqrt(D), logits /
    logits_scaling). So the reference, the megakernel and every baseline run it unchanged:
    wq x attention_multiplier * sqrt(D) (RoPE is linear and Granite has no QK-norm), wo and
    w_down x residual_multiplier, embed x embedding_multiplier, lm_head / logits_scaling. A tied
    head becomes its own lm_head (the embedding and the head now differ)."""
    s = {k: float(config_json.get(k, v)) for k, v in GRANITE_SCALARS.items()}
    if cfg.attention.qk_norm or cfg.is_moe or any(isinstance(lay["wq"], QuantizedMatrix) for lay in params["layers"]):
        raise NotSupportedError("granite: not supported yet: its scalars folded into QK-norm, experts or fp8 weights")
    dt = jnp.dtype(jnp_dtype(cfg))

    def scaled(a, f: float):
        return (np.asarray(a, np.float32) * np.float32(f)).astype(dt)

    q_scale = s["attention_multiplier"] * np.sqrt(cfg.head_dim)
    # with attention_bias: q's bias scales as wq, o's as wo (each is part of its projection's output)
    layers = [{**lay, "wq": scaled(lay["wq"], q_scale), "wo": scaled(lay["wo"], s["residual_multiplier"]),
               "w_down": scaled(lay["w_down"], s["residual_multiplier"]),
               **({"bq": scaled(lay["bq"], q_scale)} if "bq" in lay else {}),
               **({"bo": scaled(lay["bo"], s["residual_multiplier"])} if "bo" in lay else {})}
              for lay in params["layers"]]
    head = params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T
    out = {**params, "layers": layers, "embed": scaled(params["embed"], s["embedding_multiplier"]),
           "lm_head": scaled(head, 1.0 / s["logits_scaling"])}
    return cfg.replace(tie_embeddings=False), out


def fold_gemma_norms(cfg: ModelConfig, params: Params) -> Params:
    """Gemma's RMSNorms scale by (1 + weight) (transformers' GemmaRMSNorm, in float32): the 1 is
    added to every stored norm weight on load, so the reference and the megakernel's plain
    x_normed * w compute it. Added in float32, then cast to the weights' dtype (a bfloat16
    checkpoint rounds 1 + w once more than transformers does; float32 is exact)."""
    dt = jnp.dtype(jnp_dtype(cfg))

    def plus_one(a):
        return (np.asarray(a, np.float32) + np.float32(1)).astype(dt)

    layers = [{k: plus_one(v) if k in LAYER_NORMS else v for k, v in lay.items()} for lay in params["layers"]]
    return {**params, "layers": layers, "final_norm": plus_one(params["final_norm"])}


def fold_logit_scale(cfg: ModelConfig, params: Params, config_json: dict[str, Any]) -> Params:
    """Cohere's logits x logit_scale folded into the final norm's weights (the lm_head is linear
    in them), so a tied head stays tied: computed in float32, cast to the weights' dtype (exact
    for a power of two such as the releases' 0.0625)."""
    s = np.float32(config_json.get("logit_scale", COHERE_LOGIT_SCALE))
    w = (np.asarray(params["final_norm"], np.float32) * s).astype(jnp.dtype(jnp_dtype(cfg)))
    return {**params, "final_norm": w}


def checkpoint_config(path: str | Path) -> tuple[ModelConfig, str]:
    """The config of the checkpoint `path` and the scheme its weights are stored in
    (`tpumk.model.config.stored_scheme`), without reading the weights: a GGUF file's from its
    metadata (its weights load dequantized to float: "none"), a directory's (or a config.json's)
    from its config.json. What every --checkpoint reads its config through: build, export,
    cache-key, bench, tune, and generate's checks before the weights."""
    p = Path(path)
    if is_gguf_path(p):
        from tpumk.model.gguf import gguf_config

        return gguf_config(open_gguf(p), p), "none"
    return load_hf_model(p)


def load_checkpoint(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, Params]:
    """Read a Hugging Face checkpoint directory, or a Llama GGUF file (a path ending in .gguf:
    `tpumk.model.gguf`), into (config, params).

    `dtype` ("float32" / "bfloat16" or a dtype) overrides the checkpoint's dtype: weights are
    cast to it and the returned config carries it, so caches and kernels follow. Any missing,
    unexpected or misshapen tensor raises CheckpointError naming it; an architecture tpumk does
    not model raises NotSupportedError.
    """
    d = Path(path)
    if is_gguf_path(d):  # llama.cpp's single file, whatever kind of file the path is
        from tpumk.model.gguf import load_gguf

        return load_gguf(d, dtype)
    for p in (d, d / INDEX_FILE):  # is_dir / is_file raise on a name the OS refuses (the index: the longest)
        if name_problem(p):
            raise CheckpointError(f"{shown(p)}: {name_problem(p)}")
    if not d.is_dir():
        raise CheckpointError(f"{d}: checkpoint directory does not exist")
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}: no config.json in the checkpoint directory")
    cfg, stored = load_hf_model(d / "config.json")  # refuses a quantization tpumk does not read
    raw = json.loads(read_regular(d / "config.json"))  # a JSON object: checked above
    config_json = hf_text_config(raw)[0]  # a multimodal wrapper's (Gemma 3, Kimi K2.5): its language model's
    fp8, nv = stored == "fp8-b128", stored == "nvfp4"
    cfg = cfg.replace(dtype=override_dtype(cfg, dtype))
    out_dt = np.dtype(jnp.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)
    with ExitStack() as stack:
        tensors = _index_tensors(d, stack)
        if raw.get("model_type") in WRAPPERS:
            wrapper = WRAPPERS[raw["model_type"]]
            tensors = language_model_tensors(tensors, wrapper.vision_prefixes, wrapper.text_renames,
                                             wrapper.text_patterns)
        if config_json.get("model_type") == "muse_spark_text":  # its factors folded into the tensors first
            if stored != "none":
                raise NotSupportedError(f"{d}: not supported yet: a Muse Spark checkpoint stored as {stored} "
                                        "(its weights are folded on load, from float tensors)")
            tensors = spark_weights.fold_tensors(cfg, tensors, config_json,
                                                 raw if raw.get("model_type") == "muse_spark" else None, str(d))
        params = _load_params(d, cfg, out_dt, tensors, config_json, fp8, nv=nv)
    if config_json.get("model_type") == "granite":
        cfg, params = fold_granite_scalars(cfg, params, config_json)
    if config_json.get("model_type") in HF_GEMMA_FAMILIES + HF_GATED_DELTA_FAMILIES:  # (1 + w) RMSNorms
        params = fold_gemma_norms(cfg, params)
    if config_json.get("model_type") == "cohere":
        params = fold_logit_scale(cfg, params, config_json)
    # An FP8 checkpoint's float matrices among those the fp8-b128 scheme streams (typically the
    # lm_head) are quantized now, so the weights are one scheme the kernel can stream.
    return cfg, quantize_params(cfg, params, "fp8-b128") if fp8 else params


def load_layer(path: str | Path, cfg: ModelConfig, index: int, own: tuple[str, ...] = (),
               shared: tuple[str, ...] = (), dtype: Any = None) -> tuple[Params, dict[str, np.ndarray]]:
    """Decoder layer `model.layers.{index}.` of a checkpoint directory alone, as layer 0 of `cfg` (a
    one-layer config of that layer's kind) in the reference layout: for a layer stored past the
    model's own (a multi-token-prediction layer, which load_checkpoint skips). Under that prefix,
    the tensors named in `own` are returned as stored (float numpy, [out, in] for a matrix), those
    in `shared` must be present and are not read (copies of the model's embedding or head, which
    a caller takes from the model), and every other one is read as part of the decoder layer, with
    load_checkpoint's checks (a missing, unexpected or misshapen tensor refused in one line; fp8
    weights loaded as stored). `dtype` as load_checkpoint's."""
    d = Path(path)
    if name_problem(d) or not d.is_dir() or not (d / "config.json").is_file():
        raise CheckpointError(f"{shown(d)}: expected a checkpoint directory with a config.json")
    _, stored = load_hf_model(d / "config.json")
    raw = json.loads(read_regular(d / "config.json"))
    config_json = {**hf_text_config(raw)[0], "num_nextn_predict_layers": 0, "num_mtp_layers": 0}
    cfg = cfg.replace(dtype=override_dtype(cfg, dtype))
    out_dt = np.dtype(jnp.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(np.float32)
    prefix = f"model.layers.{index}."
    with ExitStack() as stack:
        tensors = _index_tensors(d, stack)
        if raw.get("model_type") in WRAPPERS:
            wrapper = WRAPPERS[raw["model_type"]]
            tensors = language_model_tensors(tensors, wrapper.vision_prefixes, wrapper.text_renames,
                                             wrapper.text_patterns)
        mine = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
        missing = [prefix + n for n in own + shared if n not in mine]
        if missing:
            raise CheckpointError(f"{d}: missing tensor '{missing[0]}'{and_more(missing)}")
        extras = {n: mine[n].read() for n in own}
        layer = {"model.layers.0." + n: t for n, t in mine.items() if n not in own and n not in shared}
        try:
            params = _load_params(d, cfg, out_dt, layer, config_json, stored == "fp8-b128", layers_only=True,
                                  nv=stored == "nvfp4")
        except CheckpointError as e:  # read as layer 0: name the tensor as the checkpoint stores it
            raise CheckpointError(str(e).replace("'model.layers.0.", f"'{prefix}")) from None
    return params["layers"][0], extras


def language_model_tensors(tensors: dict[str, _Tensor], vision_prefixes: tuple[str, ...],
                           renames: tuple[tuple[str, str], ...] = (),
                           patterns: tuple[tuple[str, str], ...] = ()) -> dict[str, _Tensor]:
    """A multimodal checkpoint's tensors under the names of its language model alone (errors
    still name each tensor as stored): the language model's under either naming of
    tpumk.model.hf_fields.LANGUAGE_MODEL_PREFIXES (the released files, transformers 5's saves)
    and then the wrapper's own `renames` (and regular-expression `patterns`), the wrapper's vision tower and projector
    (`vision_prefixes`) dropped. Any other name is kept as it is, so a tensor that belongs
    nowhere is still refused."""
    out: dict[str, _Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(vision_prefixes):
            continue
        new = next((short + name[len(long):] for long, short in LANGUAGE_MODEL_PREFIXES if name.startswith(long)),
                   name)
        new = next((short + new[len(long):] for long, short in renames if new.startswith(long)), new)
        # (Mistral Large 4: its stored mistral-inference names, hf_fields.MISTRAL_NATIVE_NAMES)
        new = next((re.sub(pat, repl, new) for pat, repl in patterns if re.match(pat, new)), new)
        if new in out:
            raise CheckpointError(f"{t.file}: tensor '{name}' is stored twice (as '{out[new].name}' too)")
        out[new] = t
    return out


def _fp8_matrix(name: str, t: _Tensor, scale: _Tensor, fn, hf_shape: tuple[int, ...], compute) -> QuantizedMatrix:
    """An FP8 [out, in] weight and its [ceil(out/128), ceil(in/128)] `weight_scale_inv` as the
    reference's QuantizedMatrix: codes fn(weight) ([in, out], bit for bit) and one scale per
    (128 input rows, output column), each block's scale repeated over its 128 columns (exact:
    dequantized = weight * scale_inv, as the checkpoint defines it)."""
    out_dim, in_dim = hf_shape[-2:]
    want = (*hf_shape[:-2], -(-out_dim // GROUP), -(-in_dim // GROUP))
    if scale.shape != want:
        raise CheckpointError(f"{scale.file}: tensor '{scale.name}' has shape {list(scale.shape)}, expected {list(want)}")
    q = fn(t.read(fp8=True))
    # one scale row per output row first, so fn (a transpose, or the RoPE row permutation of
    # q_b / kv_a then a transpose) moves each row's scales with its codes
    blocks = np.asarray(scale.read(), np.float32)
    if not np.all(np.isfinite(blocks) & (blocks > 0)):
        bad = blocks[~(np.isfinite(blocks) & (blocks > 0))].flat[0]
        raise CheckpointError(f"{scale.file}: tensor '{scale.name}' holds a block scale of {float(bad)!r}: expected "
                              "finite scales above zero (dequantized = weight x scale_inv)")
    s = np.repeat(blocks, GROUP, axis=-2)[..., :out_dim, :]
    s = np.asarray(fn(s), np.float32)  # [.., ceil(in/128), out]
    return QuantizedMatrix(jnp.asarray(q), jnp.asarray(s), jnp.zeros((0,), compute))


def _fp8_absorbed(cfg: ModelConfig, t: _Tensor, scale: _Tensor, compute) -> tuple[QuantizedMatrix, QuantizedMatrix]:
    """An FP8 kv_b_proj [Hq*(N+V), C] as the absorbed per-head blocks a quantized MLA layer holds
    (tpumk.model.quantize): w_uk [Hq, N, C] = head h's nope rows as stored, w_uv [Hq, C, V] = its
    value rows transposed, every code bit for bit. W_UV contracts over C, so its scales are the
    stored blocks per (128 latent rows, value column). W_UK^T contracts over N: head h's nope
    rows [128g, 128g+128) need one stored block row, which holds whenever the head and nope
    widths keep them inside one 128-row block (DeepSeek-V3 / Kimi K2: N = V = 128); otherwise
    the checkpoint is refused (re-quantizing would change the stored codes)."""
    hq, n, v, c = cfg.num_q_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    m = _fp8_matrix(t.name, t, scale, _same, (hq * (n + v), c), compute)  # codes [Hq*(N+V), C], scales [., C/128-blocks]
    codes = np.asarray(m.q).reshape(hq, n + v, c)
    rows = np.asarray(m.scale).reshape(hq, n + v, -1)  # [Hq, N+V, ceil(C/128)]: each row's stored scales
    block = (np.arange(hq * (n + v)) // GROUP).reshape(hq, n + v)[:, :n]  # stored block row of each nope row
    groups = -(-n // GROUP)
    starts = block[:, ::GROUP]  # [Hq, groups]
    if not np.array_equal(block, np.repeat(starts, GROUP, axis=1)[:, :n]):
        raise NotSupportedError(f"{t.file}: not supported yet: fp8 tensor '{t.name}': a head's W_UK rows straddle "
                                f"two {GROUP}-row scale blocks (qk_nope_head_dim {n}, v_head_dim {v}), so its "
                                f"codes cannot keep one scale per {GROUP} nope rows in the absorbed layout")
    uk_scale = np.repeat(rows[:, ::GROUP][:, :groups], GROUP, axis=-1)[..., :c]  # [Hq, groups, C]
    uv_scale = rows[:, n:].transpose(0, 2, 1)  # [Hq, ceil(C/128), V]
    dt = jnp.zeros((0,), compute)
    return (QuantizedMatrix(jnp.asarray(codes[:, :n]), jnp.asarray(uk_scale), dt),
            QuantizedMatrix(jnp.asarray(codes[:, n:].transpose(0, 2, 1)), jnp.asarray(uv_scale), dt))


def _nvfp4_weights(plan: dict[str, list[_Dest]], tensors: dict[str, _Tensor]) -> tuple[set[str], list[str]]:
    """An NVFP4 checkpoint's NVFP4 weights (a `weight_scale_2` beside them; every routed expert's
    projection, one tensor per expert, and nothing else) and the scale tensors they consume."""
    nv = {n[:-len("_scale_2")] for n in tensors if n.endswith(".weight_scale_2")}
    for w in sorted(nv):
        t = tensors[w[:-len(".weight")] + ".weight_scale_2"]
        if w not in plan or not all(key in EXPERT_MATRICES and isinstance(expert, int)
                                    for _, key, expert, *_ in plan[w]):
            what = f"tensor '{w}'" if w in plan else f"tensor '{t.name}' (no planned '{w}' beside it)"
            raise NotSupportedError(f"{t.file}: not supported yet: {what} in nvfp4 (tpumk reads the routed experts "
                                    "in NVFP4, one tensor per expert; attention, dense and shared-expert matrices "
                                    "must be float)")
    for name, dests in plan.items():  # (a tensor not there at all: `_load_params` names it missing)
        if name in nv or name not in tensors or not any(key in EXPERT_MATRICES for _, key, *_ in dests):
            continue
        t = tensors[name]
        if any(expert is None for _, _, expert, *_ in dests):
            raise NotSupportedError(f"{t.file}: not supported yet: fused expert tensor '{name}' in an nvfp4 "
                                    "checkpoint (ModelOpt stores one tensor per expert)")
        raise CheckpointError(f"{t.file}: missing tensor '{name[:-len('.weight')]}.weight_scale_2' (an nvfp4 "
                              "checkpoint stores every routed expert in NVFP4)")
    consumed = [w[:-len(".weight")] + sfx for w in nv for sfx in NV_SUFFIXES if w[:-len(".weight")] + sfx in tensors]
    return nv, consumed


def _load_params(d: Path, cfg: ModelConfig, out_dt: np.dtype, tensors: dict[str, _Tensor],
                 config_json: dict[str, Any] | None = None, fp8: bool = False, layers_only: bool = False,
                 nv: bool = False) -> Params:
    plan, ignored = _plan(cfg, set(tensors), config_json, layers_only)
    nv_weights: set[str] = set()
    if nv:  # NVFP4 (ModelOpt): the routed experts' weights, each with its scales
        nv_weights, consumed = _nvfp4_weights(plan, tensors)
        ignored = ignored + consumed
    cohere = (config_json or {}).get("model_type") == "cohere"
    # FP8 checkpoints: a weight with a `weight_scale_inv` beside it is stored in e4m3 blocks.
    scales = {n[:-len("_scale_inv")]: n for n in tensors if fp8 and n.endswith(".weight_scale_inv")}
    ignored = ignored + [n for w, n in scales.items() if w in plan]
    for w in scales:
        if w in plan and not all(key in _FP8_KEYS and layer is not None or key == "lm_head"
                                 for layer, key, *_ in plan[w]):
            raise NotSupportedError(f"{tensors[w].file}: not supported yet: tensor '{w}' stored in fp8 "
                                    "(tpumk keeps the router, embedding and norms in float)")
        if w in plan and any(expert is None and key in EXPERT_MATRICES for _, key, expert, *_ in plan[w]):
            raise NotSupportedError(f"{tensors[w].file}: not supported yet: fused expert tensor '{w}' in fp8 "
                                    "(official fp8 releases store one tensor per expert)")
        if w in plan and any(key.startswith("lin_") for _, key, *_ in plan[w]):
            raise NotSupportedError(f"{tensors[w].file}: not supported yet: linear-attention tensor '{w}' in fp8 "
                                    "(its rows are regrouped on load; the loader does not regroup scale blocks)")
        if w in plan and len(plan[w]) > 1:  # Phi-3's qkv_proj / gate_up_proj: rows cut across scale blocks
            raise NotSupportedError(f"{tensors[w].file}: not supported yet: fused tensor '{w}' in fp8")
        if w in plan and (cohere or 0 < cfg.positions.rotary_dim < cfg.head_dim) \
                and any(key in ("wq", "wk") for _, key, *_ in plan[w]):
            why = "Cohere's q / k rows are" if cohere else "partial rotary: q / k rows are"
            raise NotSupportedError(f"{tensors[w].file}: not supported yet: tensor '{w}' in fp8 ({why} "
                                    "permuted on load; the loader does not permute scale blocks)")
    missing = [n for n in plan if n not in tensors]  # plan order: layer by layer
    if missing:
        raise CheckpointError(f"{d}: missing tensor '{missing[0]}'{and_more(missing)}")
    unexpected = sorted(set(tensors) - set(plan) - set(ignored))
    if unexpected:
        t = tensors[unexpected[0]]
        raise CheckpointError(f"{t.file}: unexpected tensor '{t.name}'{and_more(unexpected)} "
                              f"(not part of the model config.json describes)")
    for name, dests in plan.items():
        t = tensors[name]
        want = dests[0][3]
        if name in nv_weights:  # two e2m1 codes a byte, whole 16-element scale groups
            if want[-1] % NV_GROUP:
                raise NotSupportedError(f"{t.file}: not supported yet: nvfp4 tensor '{name}' of {want[-1]} input "
                                        f"features (not a multiple of the {NV_GROUP} an e4m3 scale covers)")
            want = (*want[:-1], want[-1] // 2)
        if t.shape != want:
            raise CheckpointError(f"{t.file}: tensor '{name}' has shape {list(t.shape)}, "
                                  f"expected {list(want)}")
        if name in nv_weights and f"{name}_scale" not in tensors:
            raise CheckpointError(f"{d}: missing tensor '{name}_scale' (the e4m3 scales of nvfp4 tensor '{name}')")

    shapes = expected_shapes(cfg)
    params: Params = {k: None for k in shapes if k != "layers" and not layers_only}
    params["layers"] = [{k: None for k in lay} for lay in shapes["layers"]]

    def put(layer: int | None, key: str, arr: np.ndarray) -> None:
        (params if layer is None else params["layers"][layer])[key] = jnp.asarray(arr)

    def dtype_of(key: str) -> np.dtype:  # DeepSeek-V3 gate, residual gates, indexer weights: float32 (tpumk.model.weights)
        return np.dtype(tensor_dtype(cfg, key, out_dt))

    # Tensors go to the device one at a time; per-expert slices (and column parts) fill a host
    # buffer that moves over as soon as its last part arrives (the plan runs layer by layer).
    stacks: dict[tuple[int, str], tuple[np.ndarray, set]] = {}
    parts: dict[tuple[int, str], int] = {}
    for dests in plan.values():
        for layer, key, expert, *_ in dests:
            if isinstance(expert, tuple):
                parts[(layer, key)] = parts.get((layer, key), 0) + 1
    fp8_experts: dict[tuple[int, str], dict[int, QuantizedMatrix]] = {}
    for name, dests in plan.items():
        if dests[0][4] is MX_EXPERTS:  # gpt-oss's MXFP4 experts: at each *_blocks, with its *_scales
            if name.endswith("_blocks"):
                layer, key = dests[0][0], dests[0][1]
                m = _mxfp4_matrix(tensors[name], tensors[name[:-len("_blocks")] + "_scales"], out_dt)
                if key == "e_gate":  # gate_up: output columns interleaved, gate even, up odd
                    params["layers"][layer]["e_gate"] = QuantizedMatrix(m.q[..., 0::2], m.scale[..., 0::2], m.compute)
                    params["layers"][layer]["e_up"] = QuantizedMatrix(m.q[..., 1::2], m.scale[..., 1::2], m.compute)
                else:
                    params["layers"][layer][key] = m
            continue
        if name in nv_weights:  # one expert's NVFP4 projection, stacked once all E are read
            base = name[:-len(".weight")]
            for layer, key, expert, hf_shape, fn in dests:
                m = _nvfp4_matrix(tensors[name], tensors[base + ".weight_scale"], tensors[base + ".weight_scale_2"],
                                  tensors.get(base + ".input_scale"), hf_shape, out_dt)
                got = fp8_experts.setdefault((layer, key), {})
                got[expert] = m
                if len(got) == shapes["layers"][layer][key][0]:
                    params["layers"][layer][key] = QuantizedMatrix(
                        *(jnp.stack([getattr(got[j], f) for j in range(len(got))]) for f in ("q", "scale")),
                        m.compute, jnp.stack([got[j].outer for j in range(len(got))]))
                    del fp8_experts[(layer, key)]
            continue
        if name in scales:
            for layer, key, expert, hf_shape, fn in dests:
                if key == "wkv_b":  # MLA: stored as the absorbed per-head blocks, codes as they are
                    lay = params["layers"][layer]
                    del lay["wkv_b"]
                    lay["w_uk"], lay["w_uv"] = _fp8_absorbed(cfg, tensors[name], tensors[scales[name]], out_dt)
                    continue
                m = _fp8_matrix(name, tensors[name], tensors[scales[name]], fn, hf_shape, out_dt)
                if expert is None:
                    (params if layer is None else params["layers"][layer])[key] = m
                    continue
                got = fp8_experts.setdefault((layer, key), {})
                got[expert] = m
                if len(got) == shapes["layers"][layer][key][0]:
                    params["layers"][layer][key] = QuantizedMatrix(
                        jnp.stack([got[j].q for j in range(len(got))]), jnp.stack([got[j].scale for j in range(len(got))]),
                        m.compute)
                    del fp8_experts[(layer, key)]
            continue
        raw = tensors[name].read()
        for layer, key, expert, _, fn in dests:
            if expert is None:
                put(layer, key, np.asarray(fn(raw), dtype=dtype_of(key)))
                continue
            if (layer, key) not in stacks:
                stacks[(layer, key)] = (np.empty(shapes["layers"][layer][key], out_dt), set())
            buf, seen = stacks[(layer, key)]
            if isinstance(expert, tuple):
                buf[..., expert[0]:expert[1]] = fn(raw)
            else:
                buf[expert] = fn(raw)
            seen.add(expert)
            if len(seen) == parts.get((layer, key), buf.shape[0]):
                put(layer, key, buf)
                del stacks[(layer, key)]
    _check_complete(params, shapes, d, cfg, layers_only)
    return params


def _check_complete(params: Params, shapes: Params, d: Path, cfg: ModelConfig, layers_only: bool = False) -> None:
    """Every reference tensor is present with its expected shape (guards the mapping itself)."""
    def check(got: Any, want: tuple[int, ...], where: str) -> None:
        if isinstance(got, QuantizedMatrix) and jnp.dtype(got.q.dtype) not in (
                jnp.dtype(FORMATS["fp8-b128"].jnp_dtype), jnp.dtype(FORMATS["mxfp4"].jnp_dtype)):
            raise CheckpointError(f"{d}: reference tensor '{where}' not built as e4m3 or e2m1 codes")
        if got is None or tuple(got.shape) != tuple(want):
            raise CheckpointError(f"{d}: reference tensor '{where}' not built with shape {list(want)}")

    for k, s in shapes.items():
        if k != "layers" and not layers_only:
            check(params[k], s, k)
    for i, lay in enumerate(shapes["layers"]):
        got = params["layers"][i]
        for k, s in lay.items():
            if k == "wkv_b" and "w_uk" in got:  # an fp8 kv_b_proj, loaded as its absorbed blocks
                hq, n, v = cfg.num_q_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
                check(got["w_uk"], (hq, n, s[0]), f"layers[{i}].w_uk")
                check(got["w_uv"], (hq, s[0], v), f"layers[{i}].w_uv")
                continue
            check(got[k], s, f"layers[{i}].{k}")
