"""Hidden-state drafters (tpumk.draft, issue 56) in the default tier: the speculators-format reader
(round trips, one-line refusals), the layer-id -> tap translation, and each kind's absorb /
propose contract on tiny random drafters (shapes, greedy = argmax of its logits, sampled drafts
drawn from q, one row at a time = all at once, sequences at different lengths independent, a
round inside lax.fori_loop). The logits against speculators' own torch definitions:
tests/test_draft_speculators.py (the `speculators` tier).

Every program is jitted once per drafter (module caches) with the CPU compile options of
interpret mode; the whole file takes about 20 s.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from draft_files import DELETE, config_json, deepseek_layer_tensors, edited, write_drafter
from safetensors.numpy import save_file

from tpumk.draft import Drafter, load_drafter, random_drafter
from tpumk.draft.config import read_config, translate_layer_ids
from tpumk.draft.layers import pick
from tpumk.errors import CheckpointError, ConfigError, NotSupportedError
from tpumk.model import reference
from tpumk.model.config import ModelConfig, load_hf_model, load_preset
from tpumk.model.weights import expected_shapes
from tpumk.targets import INTERPRET_COMPILER_OPTIONS

TARGET = ModelConfig(name="draft-target", num_layers=4, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=256, ffn_size=128, dtype="float32")
# name -> (kind, target preset or None for TARGET, random_drafter's shape)
CASES = {
    "eagle3": ("eagle3", None, dict(taps=(0, 1, 3), draft_vocab=96, block=3, norm_before_residual=True, fc_norm=True,
                                    norm_output=True)),
    "mtp": ("mtp", None, dict(block=3)),
    "mtp-mla": ("mtp", "tiny-mla", dict(block=1)),
    "dflash": ("dflash", None, dict(taps=(1, 3), block_size=4, layers=2)),
    "dflash2": ("dflash2", None, dict(taps=(1, 3), block_size=4, conv_group=8, selector_rank=8, selector_top_k=5)),
    "dspark": ("dspark", None, dict(taps=(0, 2), block_size=4, markov_rank=8, markov_head="rnn", draft_vocab=96)),
}
B, Q, CONTEXT = 2, 6, 16


@functools.lru_cache(maxsize=None)
def target(name: str) -> tuple[ModelConfig, dict]:
    """The target's config, and the only target weights a drafter reads: its embedding and head."""
    cfg = TARGET if CASES[name][1] is None else load_preset(CASES[name][1])
    rng = np.random.default_rng(1)
    h, v = cfg.hidden_size, cfg.vocab_size
    return cfg, {"embed": jnp.asarray(rng.standard_normal((v, h), np.float32)),
                 "lm_head": jnp.asarray(rng.standard_normal((h, v), np.float32) / np.sqrt(h))}


@functools.lru_cache(maxsize=None)
def drafter(name: str) -> Drafter:
    kind, _, shape = CASES[name]
    return random_drafter(kind, target(name)[0], seed=2, **shape)


def inputs(name: str, seed: int = 0):
    """A prefill chunk's taps, tokens and positions for B sequences of Q rows."""
    d, (cfg, _) = drafter(name), target(name)
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((B, Q, len(d.taps), cfg.hidden_size), np.float32))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, Q)), jnp.int32)
    return hidden, tokens, jnp.broadcast_to(jnp.arange(Q, dtype=jnp.int32), (B, Q))


def jit(fn):
    return jax.jit(fn, compiler_options=INTERPRET_COMPILER_OPTIONS)


@functools.lru_cache(maxsize=None)
def round_program(name: str):
    """absorb a chunk from an empty state, then propose greedily and by sampling (temperature
    0.7), and the logits of the greedy drafts."""
    d = drafter(name)

    def run(params, tparams, hidden, tokens, positions, valid, anchor, key):
        state = d.absorb(params, tparams, d.init_state(B, CONTEXT), hidden, tokens, positions, valid)
        drafts, q, after = d.propose(params, tparams, state, anchor, state["length"])
        logits = d.logits(params, tparams, state, anchor, state["length"], drafts)
        sampled, q_s, _ = d.propose(params, tparams, state, anchor, state["length"], key, 0.7)
        return state, drafts, q, logits, sampled, q_s

    return jit(run)


def round_outputs(name: str, valid=None, hidden=None, tokens=None):
    d, (_, tparams) = drafter(name), target(name)
    h, t, p = inputs(name)
    valid = jnp.ones((B, Q), bool) if valid is None else valid
    anchor = jnp.asarray([3, 5], jnp.int32)
    return round_program(name)(d.params, tparams, h if hidden is None else hidden, t if tokens is None else tokens, p,
                               valid, anchor, jax.random.PRNGKey(4))


# ---------------------------------------------------------------------- the reader
def _dir(tmp_path, name: str, config: dict | None = None, **kw):
    d = drafter(name)
    return write_drafter(tmp_path / name, d, target(name)[0].num_layers, config, **kw)


@pytest.mark.parametrize("name", ["eagle3", "mtp", "dflash", "dflash2", "dspark"])
def test_a_written_drafter_reads_back_exactly(tmp_path, name):
    d, cfg = drafter(name), target(name)[0]
    got = load_drafter(_dir(tmp_path, name), cfg, use_speculators=False)
    # (a random mtp drafter is a copy of the target's layer; the file's is speculators' qwen3 layer)
    want = dataclasses.replace(d.spec, layer=d.spec.layer.replace(name=got.spec.layer.name),
                               mtp_source="speculators" if name == "mtp" else "")
    assert got.spec == want
    jax.tree.map(np.testing.assert_array_equal, got.params, d.params)
    half = load_drafter(_dir(tmp_path, name), cfg, dtype="bfloat16", use_speculators=False)
    assert half.spec.layer.dtype == "bfloat16"
    assert {a.dtype for k, a in jax.tree_util.tree_leaves_with_path(half.params) if "d2t" not in str(k)} == \
        {jnp.dtype(jnp.bfloat16)}


def test_an_eagle3_checkpoints_own_embedding_is_kept_unless_it_is_the_targets(tmp_path):
    cfg, tparams = target("eagle3")
    path = _dir(tmp_path, "eagle3", extra={"embed_tokens.weight": np.asarray(tparams["embed"])})
    assert load_drafter(path, cfg, use_speculators=False).spec.own_embed
    shared = load_drafter(path, cfg, target_params=tparams, use_speculators=False)
    assert not shared.spec.own_embed and "embed" not in shared.params
    own = np.asarray(tparams["embed"]) + 1.0
    path = _dir(tmp_path, "eagle3", extra={"embed_tokens.weight": own})
    kept = load_drafter(path, cfg, target_params=tparams, use_speculators=False)
    assert kept.spec.own_embed
    np.testing.assert_array_equal(np.asarray(kept.params["embed"]), own)


BAD_CONFIGS = [  # (kind, config changes, tensors dropped, error, what the line must say)
    ("eagle3", {"transformer_layer_config.hidden_size": 32}, (), ConfigError, "field 'hidden_size' = 32: expected the "
                                                                              "target's hidden size 64"),
    ("dflash", {"transformer_layer_config.vocab_size": 300}, (), ConfigError, "field 'vocab_size' = 300"),
    ("dflash", {"aux_hidden_state_layer_ids": [1, 7]}, (), ConfigError, "aux_hidden_state_layer_ids' = [1, 7]: "
                                                                        "expected distinct layer ids from 0 to 3"),
    ("dflash", {"aux_hidden_state_layer_ids": [1, 4]}, (), NotSupportedError, "includes 4, the target's residual "
                                                                              "stream after its last layer before"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, (), ConfigError, "distinct layer ids"),
    ("dflash", {"aux_hidden_state_layer_ids": DELETE}, (), ConfigError, "missing field 'aux_hidden_state_layer_ids'"),
    ("dflash", {"speculators_model_type": "peagle"}, (), NotSupportedError, "speculators_model_type 'peagle'"),
    ("dflash", {"speculators_model_type": DELETE}, (), ConfigError, "missing field 'speculators_model_type'"),
    ("dspark", {"confidence_head_bias": 1}, (), NotSupportedError, "field 'confidence_head_bias' is not a field"),
    ("dflash", {"block_size": 1}, (), ConfigError, "field 'block_size' = 1: expected at least 2"),
    ("dflash", {"block_size": 65}, (), ConfigError, "field 'block_size' = 65: expected an integer from 1 to 64"),
    ("dflash", {"mask_token_id": 256}, (), ConfigError, "field 'mask_token_id' = 256"),
    ("dflash", {"mask_token_id": DELETE}, (), ConfigError, "field 'mask_token_id' = null"),
    ("dflash", {"speculators_config.proposal_methods.0.speculative_tokens": 9}, (), ConfigError,
     "speculative_tokens 9 exceed the 3 drafts one block holds"),
    ("eagle3", {"speculators_config.proposal_methods.0.verifier_accept_k": 3}, (), NotSupportedError,
     "verifier_accept_k = 3 (a lossy acceptance rule"),
    ("eagle3", {"speculators_config.algorithm": "eagle"}, (), ConfigError, "field 'algorithm' = 'eagle'"),
    ("eagle3", {"speculators_config.default_proposal_method": "tree"}, (), ConfigError, "'default_proposal_method'"),
    ("eagle3", {"norm_before_fc": True}, (), ConfigError, "'norm_before_fc' and 'fc_norm' are both true"),
    ("eagle3", {"target_hidden_size": 128}, (), ConfigError, "field 'target_hidden_size' = 128"),
    ("eagle3", {"quantization_config": {"quant_method": "fp8"}}, (), NotSupportedError, "a quantized drafter"),
    ("dflash", {"transformer_layer_config.layer_types": ["sliding_attention"] * 2,
                "transformer_layer_config.sliding_window": 8, "transformer_layer_config.use_sliding_window": True},
     (), NotSupportedError, "sliding-window draft layers"),
    ("dflash", {"transformer_layer_config.model_type": "llama"}, (), NotSupportedError,
     "model_type 'llama' for a dflash drafter"),
    ("eagle3", {"transformer_layer_config.mlp_bias": True, "transformer_layer_config.model_type": "llama",
                **{f"transformer_layer_config.{k}": DELETE for k in ("layer_types", "max_window_layers",
                                                                     "use_sliding_window")}},
     (), NotSupportedError, "mlp_bias = true"),
    ("dflash", {"transformer_layer_config.frobnicate": 1}, (), NotSupportedError, "field 'frobnicate' is not a field"),
    ("dspark", {"markov_head_type": "lstm"}, (), ConfigError, "field 'markov_head_type' = 'lstm'"),
    ("dflash2", {"draft_vocab_size": 128}, (), ConfigError, "speculators' dflash2 requires the full vocabulary"),
    ("dflash2", {"conv_group_size": 7}, (), ConfigError, "field 'conv_group_size' = 7: expected a divisor"),
    ("mtp", {"num_nextn_predict_layers": 2}, (), NotSupportedError, "num_nextn_predict_layers = 2"),
    ("mtp", {"transformer_layer_config.num_hidden_layers": 3,
             "transformer_layer_config.layer_types": ["full_attention"] * 3}, (), ConfigError,
     "'num_hidden_layers' = 3: expected the target's 4 layers"),
    ("eagle3", {"dtype": "int8"}, (), NotSupportedError, "dtype 'int8'"),
    # tensors
    ("dflash", {}, ("fc.weight",), CheckpointError, "missing tensor 'fc.weight'"),
    ("eagle3", {}, ("t2d",), CheckpointError, "missing tensor 't2d'"),
]


@pytest.mark.parametrize("kind, changes, drop, error, needle", BAD_CONFIGS,
                         ids=[f"{c[0]}-{next(iter(c[1]), None) or c[2][0]}" for c in BAD_CONFIGS])
def test_a_bad_drafter_is_refused_in_one_line_naming_file_and_field(tmp_path, kind, changes, drop, error, needle):
    name, cfg = kind, target(kind)[0]
    config = edited(config_json(drafter(name), cfg.num_layers), changes)
    path = _dir(tmp_path, name, config, drop=drop)
    with pytest.raises(error) as e:
        load_drafter(path, cfg, use_speculators=False)
    line = str(e.value)
    assert "\n" not in line and str(path) in line and needle in line, line


def test_tensor_shapes_and_vocabulary_maps_are_checked(tmp_path):
    d, cfg = drafter("eagle3"), TARGET
    path = _dir(tmp_path, "eagle3", extra={"fc.weight": np.zeros((64, 100), np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' has shape \[64, 100\], expected \[64, 192\]"):
        load_drafter(path, cfg, use_speculators=False)
    path = _dir(tmp_path, "eagle3", extra={"stray.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'stray.weight'"):
        load_drafter(path, cfg, use_speculators=False)
    ids = np.asarray(d.params["d2t"])
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[ids[:-1]] = True
    t2d[ids[-1] + 1] = True  # one target id that d2t does not map to
    path = _dir(tmp_path, "eagle3", extra={"t2d": t2d})
    with pytest.raises(CheckpointError, match="tensors 'd2t' and 't2d' disagree"):
        load_drafter(path, cfg, use_speculators=False)
    (tmp_path / "eagle3" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        load_drafter(tmp_path / "eagle3", cfg, use_speculators=False)
    with pytest.raises(CheckpointError, match="expected a drafter directory"):
        load_drafter(tmp_path / "nowhere", cfg, use_speculators=False)


def test_defaults_where_the_file_is_silent():
    """A field left out reads as speculators' class default: a minimal dspark drafts from the
    anchor (block_size 8 -> 8 drafts) with a vanilla Markov head of rank 256."""
    minimal = {"speculators_model_type": "dspark", "aux_hidden_state_layer_ids": [1, 2], "mask_token_id": 3,
               "draft_vocab_size": 256, "dtype": "float32",
               "transformer_layer_config": {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 256,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                            "intermediate_size": 128, "num_hidden_layers": 1}}
    spec = read_config(minimal, "config.json", TARGET, use_speculators=False)
    assert (spec.block, spec.block_size, spec.sample_from_anchor, spec.markov_rank, spec.markov_head,
            spec.confidence_head) == (8, 8, True, 256, "vanilla", 64 + 256)
    assert spec.layer.rope_theta == 10000.0  # transformers' Qwen3Config default (rope_parameters left out)
    chainless = {k: v for k, v in minimal.items() if k not in ("aux_hidden_state_layer_ids", "mask_token_id")}
    with pytest.raises(ConfigError, match="the chain length"):
        read_config({**chainless, "speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
                    "config.json", TARGET, use_speculators=False)


# ---------------------------------------------------------------------- taps
def test_layer_ids_are_taps_entering_each_layer():
    """speculators' / vLLM's layer id i < L is the residual stream entering layer i: tpumk's tap i.
    Id 0 is the embeddings, exactly (a translation off by one would hand the drafter layer 0's
    output); id L is the residual before the final norm, which no tpumk tap holds: refused."""
    cfg, rng = TARGET, np.random.default_rng(1)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[0])),
                          expected_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    taps = translate_layer_ids([0, 2, 3], cfg, "aux_hidden_state_layer_ids", "config.json")
    assert taps == (0, 2, 3)
    tokens = jnp.asarray([[5, 9, 200, 31]])
    forward = jit(lambda p, t: reference.forward_full(p, cfg, t, taps=taps + (cfg.num_layers,))[1])
    hidden = np.asarray(forward(params, tokens))
    np.testing.assert_array_equal(hidden[0, :, 0], np.asarray(params["embed"])[[5, 9, 200, 31]])
    assert not np.allclose(hidden[0, :, 2], hidden[0, :, 3])  # id 3 enters the last layer: not the final norm's output
    with pytest.raises(NotSupportedError, match="includes 4, the target's residual stream after its last layer"):
        translate_layer_ids([1, 4], cfg, "aux_hidden_state_layer_ids", "config.json")
    # eagle3 without layer ids: vLLM's default, an early, a middle and a late layer
    deep = TARGET.replace(num_layers=12)
    config = edited(config_json(drafter("eagle3"), 4), {"eagle_aux_hidden_state_layer_ids": None})
    assert read_config(config, "config.json", deep, use_speculators=False).taps == (2, 6, 9)
    # mtp reads the final norm's output: tap L
    assert drafter("mtp").taps == (TARGET.num_layers,)


# ---------------------------------------------------------------------- absorb / propose
@pytest.mark.parametrize("name", list(CASES))
def test_a_round_proposes_the_argmax_of_its_logits_and_samples_from_q(name):
    d, (cfg, _) = drafter(name), target(name)
    state, drafts, q, logits, sampled, q_s = round_outputs(name)
    k, v, vd = d.block, cfg.vocab_size, d.spec.draft_vocab
    assert drafts.shape == (B, k) and drafts.dtype == jnp.int32 and q.shape == (B, k, v) and q.dtype == jnp.float32
    assert logits.shape == (B, k, vd) and np.array_equal(np.asarray(state["length"]), [Q, Q])
    d2t = np.asarray(d.params["d2t"]) if "d2t" in d.params else np.arange(v)
    np.testing.assert_array_equal(np.asarray(drafts), d2t[np.argmax(np.asarray(logits), -1)])
    # q: the softmax of those logits (temperature 1), mapped to the target's vocabulary
    want = np.zeros((B, k, v), np.float32)
    want[..., d2t] = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(q), want, atol=1e-6)
    qs = np.asarray(q_s)
    np.testing.assert_allclose(qs.sum(-1), 1.0, atol=1e-5)
    outside = np.setdiff1d(np.arange(v), d2t)
    assert not qs[..., outside].any()
    picked = np.take_along_axis(qs, np.asarray(sampled)[..., None], -1)
    assert (picked > 0).all()  # each sampled draft lies in the distribution it was drawn from


def test_picking_a_draft():
    """Greedy: the argmax, q the softmax at the temperature (one-hot at 0); sampled: a draw from q
    (the argmax at temperature 0); a reduced vocabulary's q is zero outside d2t."""
    d = drafter("eagle3")
    greedy = jit(lambda lg, t: pick(d.spec, d.params, lg, None, t))
    sample = jit(lambda lg, key, t: pick(d.spec, d.params, lg, key, t))
    rng = np.random.default_rng(0)
    rows = np.tile(rng.standard_normal(d.spec.draft_vocab, np.float32), (4000, 1))
    rows[1] = rng.standard_normal(d.spec.draft_vocab)  # row 1 differs; the others draw from row 0's logits
    logits = jnp.asarray(rows)
    d2t = np.asarray(d.params["d2t"])
    best = d2t[np.argmax(np.asarray(logits), -1)]
    cold = jnp.zeros((4000,))
    for ids, q in (greedy(logits, cold), sample(logits, jax.random.PRNGKey(1), cold)):
        np.testing.assert_array_equal(np.asarray(ids), best)
        np.testing.assert_array_equal(np.asarray(q)[np.arange(4000), best], 1.0)
    hot = cold.at[0].set(2.0)  # a temperature per sequence
    _, q = greedy(logits, hot)
    np.testing.assert_allclose(np.asarray(q)[0, d2t], np.asarray(jax.nn.softmax(logits[0] / 2.0)), atol=1e-6)
    assert np.asarray(q)[1, best[1]] == 1.0
    draws, q = sample(logits, jax.random.PRNGKey(2), jnp.ones((4000,)))  # row 0 and rows 2.. share logits
    draws = np.asarray(draws)[np.r_[0, 2:4000]]
    freq = np.bincount(draws, minlength=d.spec.vocab) / len(draws)
    np.testing.assert_allclose(freq[d2t], np.asarray(jax.nn.softmax(logits[0])), atol=0.03)  # 3,999 draws
    assert not np.asarray(q)[:, np.setdiff1d(np.arange(d.spec.vocab), d2t)].any()


@functools.lru_cache(maxsize=None)
def one_at_a_time_program(name: str):
    """The state after absorbing the chunk at once, and after absorbing it one row per step with a
    proposal (its speculative rows written past the committed length) after each; then the
    greedy drafts from both."""
    d = drafter(name)
    anchor = jnp.asarray([3, 5], jnp.int32)

    def run(params, tparams, hidden, tokens, positions):
        whole = d.absorb(params, tparams, d.init_state(B, CONTEXT), hidden, tokens, positions, jnp.ones((B, Q), bool))

        def one_row(r, state):
            row = lambda a: jax.lax.dynamic_slice_in_dim(a, r, 1, axis=1)  # noqa: E731
            state = d.absorb(params, tparams, state, row(hidden), row(tokens), row(positions), jnp.ones((B, 1), bool))
            return d.propose(params, tparams, state, row(tokens)[:, 0], state["length"])[2]

        rows = jax.lax.fori_loop(0, Q, one_row, d.init_state(B, CONTEXT))
        a = d.propose(params, tparams, whole, anchor, whole["length"])
        b = d.propose(params, tparams, rows, anchor, rows["length"])
        la = d.logits(params, tparams, whole, anchor, whole["length"], a[0])
        lb = d.logits(params, tparams, rows, anchor, rows["length"], a[0])
        return whole["length"], rows["length"], a[0], b[0], la, lb

    return jit(run)


@pytest.mark.parametrize("name", list(CASES))
def test_absorbing_rows_one_at_a_time_equals_absorbing_them_at_once(name):
    d, (_, tparams) = drafter(name), target(name)
    len_a, len_b, drafts_a, drafts_b, logits_a, logits_b = one_at_a_time_program(name)(d.params, tparams,
                                                                                     *inputs(name, seed=5))
    np.testing.assert_array_equal(np.asarray(len_a), np.asarray(len_b))
    np.testing.assert_array_equal(np.asarray(drafts_a), np.asarray(drafts_b))
    # the same products over the same rows, summed in another order (one row vs six per dot)
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_sequences_at_different_lengths_draft_independently(name):
    """Sequence 1 committing 3 rows beside a sequence committing 6 drafts exactly what it drafts
    beside a copy of itself: lengths, anchors and positions are per sequence."""
    hidden, tokens, _ = inputs(name)
    valid = jnp.asarray([[True] * Q, [True] * 3 + [False] * (Q - 3)])
    mixed = round_outputs(name, valid=valid)
    twin = round_outputs(name, valid=jnp.asarray([[True] * 3 + [False] * (Q - 3)] * 2),
                         hidden=jnp.stack([hidden[1]] * 2), tokens=jnp.stack([tokens[1]] * 2))
    assert np.asarray(mixed[0]["length"]).tolist() == [Q, 3]
    np.testing.assert_array_equal(np.asarray(mixed[1])[1], np.asarray(twin[1])[1])
    np.testing.assert_allclose(np.asarray(mixed[3])[1], np.asarray(twin[3])[1], atol=1e-6)


@pytest.mark.parametrize("name", ["eagle3", "dspark"])
def test_rounds_run_inside_a_fori_loop(name):
    """Rounds (propose, then absorb the anchor and the first draft as accepted, with stand-in taps
    made from the tokens) as one lax.fori_loop program give what the same rounds give one by one."""
    d, (cfg, tparams) = drafter(name), target(name)
    hidden, tokens, positions = inputs(name)
    table = jnp.asarray(np.random.default_rng(3).standard_normal((cfg.vocab_size, len(d.taps), cfg.hidden_size)),
                        jnp.float32)

    def one_round(carry, params):
        state, anchor = carry
        drafts, _, state = d.propose(params, tparams, state, anchor, state["length"])
        rows = jnp.concatenate([anchor[:, None], drafts], 1)
        pos = state["length"][:, None] + jnp.arange(rows.shape[1], dtype=jnp.int32)
        valid = jnp.arange(rows.shape[1])[None] < 2
        state = d.absorb(params, tparams, state, table[rows], rows, pos, jnp.broadcast_to(valid, rows.shape))
        return state, drafts[:, 1]

    def start(params):
        return d.absorb(params, tparams, d.init_state(B, CONTEXT), hidden, tokens, positions, jnp.ones((B, Q), bool))

    looped = jit(lambda p: jax.lax.fori_loop(0, 3, lambda _, c: one_round(c, p), (start(p), tokens[:, -1])))(d.params)
    step = jit(lambda c, p: one_round(c, p))
    carry = (jit(start)(d.params), tokens[:, -1])
    for _ in range(3):
        carry = step(carry, d.params)
    np.testing.assert_array_equal(np.asarray(looped[0]["length"]), [Q + 6, Q + 6])
    np.testing.assert_array_equal(np.asarray(looped[1]), np.asarray(carry[1]))


# ---------------------------------------------------------------------- shapes of published drafters
def test_random_drafters_of_the_published_sizes_are_shapes_only():
    """The Kimi K2 DSpark (5 layers, hidden 7168, 96 query / 16 KV heads of 64, intermediate 14336,
    5 taps, block 8) and a DFlash for a dense 27B-class target, as shapes: nothing allocated."""
    kimi = load_preset("kimi-k2")
    d = random_drafter("dspark", kimi, abstract=True, layers=5, heads=96, kv_heads=16, head_dim=64, ffn=14336,
                       taps=(1, 15, 30, 45, 60), block_size=8)
    assert isinstance(d.params["fc"], jax.ShapeDtypeStruct) and d.params["fc"].shape == (5 * 7168, 7168)
    lay = d.params["layers"][0]
    assert (lay["wq"].shape, lay["wk"].shape, lay["w_gate"].shape) == ((7168, 96 * 64), (7168, 16 * 64), (7168, 14336))
    assert len(d.params["layers"]) == 5 and d.block == 8 and d.params["markov_w1"].shape == (kimi.vocab_size, 256)
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(d.params))
    h, q, kv, f, v = 7168, 96 * 64, 16 * 64, 14336, kimi.vocab_size
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h + 2 * 64  # q, o, k, v, the MLP, 2 norms, QK-norms
    assert n == 5 * per_layer + 5 * h * h + h + h + 2 * v * 256, n  # + fc, hidden_norm, norm, Markov W1 and W2
    json.dumps(d.spec.to_dict())
    dense = load_preset("qwen3-32b")
    d = random_drafter("dflash", dense, abstract=True, layers=5, taps=(1, 16, 32, 48, 62), block_size=16)
    assert d.block == 15 and d.params["fc"].shape == (5 * 5120, 5120) and "lm_head" not in d.params


# ---------------------------------------------------------------------- MTP from a target checkpoint
MLA_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 3,
              "hidden_size": 128, "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 80,
              "moe_intermediate_size": 128, "vocab_size": 320, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": 56,
              "kv_lora_rank": 40, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 20,
              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_interleave": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "num_nextn_predict_layers": 1,
              "tie_word_embeddings": False, "dtype": "float32"}


def _mtp_checkpoint(path, config: dict, drop: tuple[str, ...] = ()):
    """A DeepSeek-V3 checkpoint holding only its next-token layer (model.layers.3.*: enorm, hnorm,
    eh_proj, shared_head, copies of the embedding and head, one MLA + experts decoder layer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    cfg = load_hf_model(path)[0]
    d = random_drafter("mtp", cfg, seed=7)
    p, h, v = d.params, cfg.hidden_size, cfg.vocab_size
    ts = deepseek_layer_tensors(p["layer"], "model.layers.3.")
    ts.update({"model.layers.3.enorm.weight": np.asarray(p["enorm"]), "model.layers.3.hnorm.weight": np.asarray(p["hnorm"]),
               "model.layers.3.eh_proj.weight": np.asarray(p["eh_proj"]).T,
               "model.layers.3.shared_head.norm.weight": np.asarray(p["norm"]),
               "model.layers.3.embed_tokens.weight": np.zeros((v, h), np.float32),
               "model.layers.3.shared_head.head.weight": np.zeros((v, h), np.float32)})
    save_file({k: np.ascontiguousarray(a) for k, a in ts.items() if k not in drop}, str(path / "mtp.safetensors"))
    return cfg, d


def test_mtp_reads_a_deepseek_checkpoints_next_token_layer(tmp_path):
    cfg, d = _mtp_checkpoint(tmp_path / "ok", MLA_CONFIG)
    got = load_drafter("mtp", cfg, checkpoint=tmp_path / "ok", block=2)
    assert got.spec.layer.is_mla and got.spec.layer.is_moe and got.taps == (3,) and got.block == 2
    jax.tree.map(np.testing.assert_array_equal, got.params, d.params)
    _mtp_checkpoint(tmp_path / "no-eh", MLA_CONFIG, drop=("model.layers.3.eh_proj.weight",))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.3.eh_proj.weight'"):
        load_drafter("mtp", cfg, checkpoint=tmp_path / "no-eh")
    _mtp_checkpoint(tmp_path / "no-wo", MLA_CONFIG, drop=("model.layers.3.self_attn.o_proj.weight",))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.3.self_attn.o_proj.weight'"):
        load_drafter("mtp", cfg, checkpoint=tmp_path / "no-wo")
    _mtp_checkpoint(tmp_path / "none", {**MLA_CONFIG, "num_nextn_predict_layers": 0})
    with pytest.raises(NotSupportedError, match="no next-token layer"):
        load_drafter("mtp", cfg, checkpoint=tmp_path / "none")
    with pytest.raises(ConfigError, match="num_layers 3: expected the target's 4"):
        load_drafter("mtp", TARGET, checkpoint=tmp_path / "ok")


def test_a_bfloat16_drafter_of_eight_sequences_runs_on_the_cpu_backend():
    """A bfloat16 EAGLE-3 drafter of SmolLM2-135M's attention shapes (9 query / 3 KV heads of 64),
    8 sequences, rounds inside lax.fori_loop on XLA's CPU backend. (Before: with the head-major
    draft cache's transpose folded into attention's dots, XLA left some bfloat16 batched dots
    with a float32 result to its CPU runtime, which has none: "Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32", what benchmarks/drafter_acceptance.py hit at 8 prompts.)"""
    b, q, context, h = 8, 6, 64, 576
    cfg = ModelConfig(name="draft-target-bf16", num_layers=4, hidden_size=h, num_q_heads=9, num_kv_heads=3,
                      head_dim=64, vocab_size=256, ffn_size=128, dtype="bfloat16")
    d = random_drafter("eagle3", cfg, seed=2, taps=(0, 1, 3), draft_vocab=96, block=3)
    rng = np.random.default_rng(1)
    tparams = {"embed": jnp.asarray(rng.standard_normal((256, h)), jnp.bfloat16),
               "lm_head": jnp.asarray(rng.standard_normal((h, 256)) / 24, jnp.bfloat16)}
    hidden = jnp.asarray(rng.standard_normal((b, q, 3, h)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 256, (b, q)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(q, dtype=jnp.int32), (b, q))

    def one_round(state, anchor, params):
        drafts, _, state = d.propose(params, tparams, state, anchor, state["length"])
        rows = jnp.concatenate([anchor[:, None], drafts], 1)
        pos = state["length"][:, None] + jnp.arange(rows.shape[1], dtype=jnp.int32)
        valid = jnp.broadcast_to(jnp.arange(rows.shape[1])[None] < 2, rows.shape)
        taps = jnp.broadcast_to(hidden[:, :1], (b, rows.shape[1], 3, h))
        return d.absorb(params, tparams, state, taps, rows, pos, valid), drafts[:, 1]

    def run(params):
        state = d.absorb(params, tparams, d.init_state(b, context), hidden, tokens, positions, jnp.ones((b, q), bool))
        return jax.lax.fori_loop(0, 2, lambda _, c: one_round(*c, params), (state, tokens[:, -1]))

    state, last = jit(run)(d.params)
    assert np.asarray(state["length"]).tolist() == [q + 4] * b
    assert ((np.asarray(last) >= 0) & (np.asarray(last) < 256)).all()
