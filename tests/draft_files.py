"""Speculators-format drafter directories written from tpumk drafters, without speculators: the
config.json speculators 0.9.0's `save_pretrained` writes (its layout, field for field) and the
safetensors under its names. The speculators tier checks that speculators' own classes load
what this writes (tests/test_draft_speculators.py), so the default tier's reader tests read
files of the real format.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tpumk.draft import Drafter
from tpumk.draft.weights import LAYER_NAMES, MTP_NAMES, TOP_NAMES

CLASS_NAMES = {"eagle3": "Eagle3SpeculatorConfig", "dflash": "DFlashSpeculatorConfig",
               "dflash2": "DFlash2SpeculatorConfig", "dspark": "DSparkSpeculatorConfig", "mtp": "MTPSpeculatorConfig"}
ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel",
                 "dspark": "DSparkDraftModel", "mtp": "MTPDraftModel"}


def layer_config(d: Drafter, target_layers: int) -> dict:
    """transformer_layer_config as speculators writes a Qwen3Config's (mtp: the verifier's depth)."""
    c = d.spec.layer
    n = target_layers if d.kind == "mtp" else c.num_layers
    return {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
            "head_dim": c.head_dim, "hidden_act": "silu", "hidden_size": c.hidden_size, "initializer_range": 0.02,
            "intermediate_size": c.ffn_size, "layer_types": ["full_attention"] * n, "max_position_embeddings": 32768,
            "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": c.num_q_heads,
            "num_hidden_layers": n, "num_key_value_heads": c.num_kv_heads, "pad_token_id": None,
            "rms_norm_eps": c.rms_eps, "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
            "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
            "vocab_size": c.vocab_size}


def config_json(d: Drafter, target_layers: int) -> dict:
    """The config.json speculators 0.9.0 writes for `d` (layer ids = its taps)."""
    s = d.spec
    out = {"architectures": [ARCHITECTURES[s.kind]], "auto_map": {"": f"config.{CLASS_NAMES[s.kind]}"},
           "dtype": s.layer.dtype,
           "speculators_config": {"algorithm": s.kind, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                        "speculative_tokens": s.block, "verifier_accept_k": 1}],
                                  "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": None}},
           "speculators_model_type": s.kind, "speculators_version": "0.9.0", "tie_word_embeddings": False,
           "transformer_layer_config": layer_config(d, target_layers), "transformers_version": "5.19.0"}
    if s.kind == "mtp":
        out["num_nextn_predict_layers"] = 1
        return out
    out.update(draft_vocab_size=s.draft_vocab, target_hidden_size=None)
    if s.kind == "eagle3":
        out.update(eagle_aux_hidden_state_layer_ids=list(s.taps), embed_requires_grad=False, fc_norm=s.fc_norm,
                   norm_before_fc=s.norm_before_fc, norm_before_residual=s.norm_before_residual,
                   norm_output=s.norm_output)
        return out
    out.update(aux_hidden_state_layer_ids=list(s.taps), block_size=s.block_size, mask_token_id=s.mask_token_id,
               sample_from_anchor=s.sample_from_anchor, sliding_window_non_causal=s.kind == "dflash2")
    if s.kind == "dflash2":
        out.update(conv_kernel_size=s.conv_kernel, conv_group_size=s.conv_group, selector_rank=s.selector_rank,
                   selector_top_k=s.selector_top_k)
    if s.kind == "dspark":
        out.update(markov_rank=s.markov_rank, markov_head_type=s.markov_head or "vanilla",
                   enable_confidence_head=False, confidence_head_with_markov=False)
    return out


def tensors(d: Drafter) -> dict[str, np.ndarray]:
    """The drafter's params under speculators' names and layouts (Linear weights [out, in])."""
    from tpumk.draft.weights import _AS_STORED

    def out_layout(key, a):
        a = np.asarray(a)
        return a.T if a.ndim == 2 and key not in _AS_STORED else a

    p, s = d.params, d.spec
    layer_names = {v: k for k, v in LAYER_NAMES.items()}
    if s.kind == "mtp":
        out = {f"mtp_layers.0.{name}": out_layout(key, p[key]) for name, key in MTP_NAMES.items()}
        out.update({f"mtp_layers.0.{layer_names[k]}": out_layout(k, v) for k, v in p["layer"].items()})
        return out
    top = {v: k for k, v in TOP_NAMES.items()}
    out = {}
    for key, v in p.items():
        if key == "layers":
            for i, lay in enumerate(v):
                out.update({f"layers.{i}.{layer_names[k]}": out_layout(k, a) for k, a in lay.items()})
        elif key == "fc_norm":
            out.update({f"fc_norm.{i}.weight": np.asarray(row) for i, row in enumerate(v)})
        elif key == "d2t":  # speculators stores target id - draft id, and the mask t2d
            ids = np.asarray(v, np.int64)
            out["d2t"] = ids - np.arange(len(ids))
            t2d = np.zeros(s.vocab, bool)
            t2d[ids] = True
            out["t2d"] = t2d
        else:
            out[top[key]] = out_layout(key, v)
    return out


def write_drafter(path: str | Path, d: Drafter, target_layers: int, config: dict | None = None,
                  drop: tuple[str, ...] = (), extra: dict | None = None) -> Path:
    """`d` as a speculators directory at `path`: config.json (`config`: the file's object instead,
    e.g. an edited copy of config_json(d)) and model.safetensors (without the tensors in `drop`,
    plus `extra`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else config_json(d, target_layers)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    ts = {k: np.ascontiguousarray(v) for k, v in tensors(d).items() if k not in drop}
    ts.update(extra or {})
    save_file(ts, str(path / "model.safetensors"))
    return path


DELETE = object()


def edited(cfg: dict, changes: dict) -> dict:
    """A deep copy of a config with each dotted path in `changes` set to its value (DELETE: the
    key removed; a number in the path indexes a list)."""
    out = copy.deepcopy(cfg)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is DELETE:
            node.pop(last, None)
        else:
            node[int(last) if last.isdigit() else last] = value
    return out


# A DeepSeek-V3 decoder layer's tensors under the release's names (reference key -> name under
# model.layers.{i}.; experts one tensor each), for a checkpoint whose config says rope_interleave false.
DEEPSEEK_LAYER = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
                  "wq_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
                  "wq_b": "self_attn.q_b_proj.weight", "wq": "self_attn.q_proj.weight",
                  "wkv_a": "self_attn.kv_a_proj_with_mqa.weight", "kv_a_norm": "self_attn.kv_a_layernorm.weight",
                  "wkv_b": "self_attn.kv_b_proj.weight", "wo": "self_attn.o_proj.weight", "router": "mlp.gate.weight",
                  "router_bias": "mlp.gate.e_score_correction_bias", "w_gate": "mlp.gate_proj.weight",
                  "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
                  "s_gate": "mlp.shared_experts.gate_proj.weight", "s_up": "mlp.shared_experts.up_proj.weight",
                  "s_down": "mlp.shared_experts.down_proj.weight"}
EXPERTS = {"e_gate": "gate_proj", "e_up": "up_proj", "e_down": "down_proj"}


def deepseek_layer_tensors(layer: dict, prefix: str) -> dict[str, np.ndarray]:
    out = {}
    for key, a in layer.items():
        a = np.asarray(a)
        if key in EXPERTS:
            out.update({f"{prefix}mlp.experts.{j}.{EXPERTS[key]}.weight": a[j].T for j in range(a.shape[0])})
        else:
            out[prefix + DEEPSEEK_LAYER[key]] = a.T if a.ndim == 2 else a
    return out
