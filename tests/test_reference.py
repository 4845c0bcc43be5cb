"""The reference decode step against its own full-recompute twin: paging, q > 1, prefill."""

import jax.numpy as jnp
import numpy as np
import pytest

from tpumk.model import config

from tpumk.model import reference as ref

from tpumk.model import weights


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-moe"])
def model(request):
    # float32 so the paged/full comparisons below can be tight; bf16 has its own test.
    cfg = config.load_preset(request.param).replace(dtype="float32")
    return cfg, weights.random_params(cfg, seed=1)


def _tokens(cfg, b, t, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)


def test_paged_decode_matches_full_recompute(model):
    cfg, p = model
    toks = _tokens(cfg, 2, 21)
    full = np.asarray(ref.forward_full(p, cfg, jnp.asarray(toks)))
    cache = ref.init_cache(cfg, 2, 32, page_size=8)  # 21 tokens cross two page boundaries
    step = ref.jitted_decode_step(cfg)
    last, cache = ref.prefill(p, cfg, [toks[0, :5].tolist(), toks[1, :5].tolist()], cache, step_fn=step)
    np.testing.assert_allclose(np.asarray(last), full[:, 4], rtol=1e-5, atol=1e-5)
    for i in range(5, 21):
        logits, cache = step(p, jnp.asarray(toks[:, i:i + 1]), cache.lengths[:, None], cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, i], rtol=1e-5, atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [21, 21]


def test_multi_token_step_is_causal_among_new_tokens(model):
    """q > 1 (speculative verification): each new token sees only earlier new tokens."""
    cfg, p = model
    toks = _tokens(cfg, 2, 12, seed=3)
    full = np.asarray(ref.forward_full(p, cfg, jnp.asarray(toks)))
    cache = ref.init_cache(cfg, 2, 16, page_size=8)
    _, cache = ref.prefill(p, cfg, [toks[0, :8].tolist(), toks[1, :8].tolist()], cache)
    pos = cache.lengths[:, None] + jnp.arange(4, dtype=jnp.int32)
    logits, cache = ref.jitted_decode_step(cfg)(p, jnp.asarray(toks[:, 8:12]), pos, cache)
    np.testing.assert_allclose(np.asarray(logits), full[:, 8:12], rtol=1e-5, atol=1e-5)


def test_batched_prefill_equals_one_chunk_per_sequence():
    """`prefill(batched=True)`: all prompts in one right-padded step. Each prompt's last logits
    and every cache slot inside the lengths equal the per-sequence prefill's (float32, the same
    operations on more rows: within 1e-5), and two decode steps after it agree as closely (the
    padding's slots past each prompt are never read). Sequence 1 starts after a first prefill.
    tiny-dense only: the padding never meets another token (an MoE layer routes each token alone)."""
    cfg = config.load_preset("tiny-dense").replace(dtype="float32")
    p = weights.random_params(cfg, seed=1)
    step = ref.jitted_decode_step(cfg)
    toks = _tokens(cfg, 3, 20, seed=9)
    prompts = [toks[0, :7].tolist(), toks[1, 4:15].tolist(), toks[2, :7].tolist()]
    base = ref.init_cache(cfg, 3, 32, page_size=8)
    _, base = ref.prefill(p, cfg, [[1], toks[1, :4].tolist(), [2]], base, step_fn=step, batched=True)
    base = ref.KVCache(base.k, base.v, base.block_tables, base.lengths.at[0].set(0).at[2].set(0))  # uneven starts
    one, c1 = ref.prefill(p, cfg, prompts, base, step_fn=step)
    many, c2 = ref.prefill(p, cfg, prompts, base, step_fn=step, batched=True)
    np.testing.assert_allclose(np.asarray(many), np.asarray(one), rtol=1e-5, atol=1e-5)
    assert np.asarray(c2.lengths).tolist() == np.asarray(c1.lengths).tolist() == [7, 15, 7]
    ctx = np.arange(c1.max_context)
    for b, n in enumerate(np.asarray(c1.lengths)):
        for name in ("k", "v"):
            slots = [getattr(c, name)[:, np.asarray(c.block_tables[b])].reshape(cfg.num_layers, -1, *c.k.shape[3:])
                     for c in (c1, c2)]
            np.testing.assert_allclose(np.asarray(slots[1])[:, ctx < n], np.asarray(slots[0])[:, ctx < n],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{name} of sequence {b}")
    for i in range(2):
        nxt = jnp.asarray(toks[:, 15 + i:16 + i])
        l1, c1 = step(p, nxt, c1.lengths[:, None], c1)
        l2, c2 = step(p, nxt, c2.lengths[:, None], c2)
        np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"pads every prompt to the longest \(29 tokens\): sequence 1 would need "
                                         r"33 tokens > context 32"):
        ref.prefill(p, cfg, [list(range(29)), [1], [2]], base, step_fn=step, batched=True)


def test_batched_prefill_of_a_hybrid_equals_one_chunk_per_sequence():
    """A hybrid's batched prefill (what `tpumk quality` runs) runs its padding at position -1, so
    no linear layer's state takes it in: the padded sequence's last logits, recurrent states,
    convolution windows and attention rows agree with its own one-chunk prefill's (float32,
    the same operations on more rows). Before: batched=True fell back to one step per sequence
    (one compiled shape per prompt length), as the padding would have entered the states."""
    cfg = config.load_preset("tiny-dense").replace(
        name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1), linear_key_heads=1,
        linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)
    p = weights.random_params(cfg, seed=1)
    step = ref.jitted_decode_step(cfg)
    toks = _tokens(cfg, 2, 11, seed=4)
    short = toks[0, :5].tolist()  # padded with 6 tokens in the batched step
    compiled = []
    counted = lambda *a: compiled.append(a[1].shape) or step(*a)  # noqa: E731
    many, c2 = ref.prefill(p, cfg, [short, toks[1].tolist()], ref.init_cache(cfg, 2, 32, page_size=8, num_slots=3),
                           step_fn=counted, batched=True)
    assert compiled == [(2, 11)]  # one step of both prompts, padded to the longest
    one, c1 = ref.prefill(p, cfg, [short], ref.init_cache(cfg, 1, 32, page_size=8), step_fn=step)
    np.testing.assert_allclose(np.asarray(many[0]), np.asarray(one[0]), rtol=1e-5, atol=1e-5)
    assert np.asarray(c2.lengths).tolist() == [5, 11]
    s1, s2 = int(c1.states.slots[0]), int(c2.states.slots[0])  # the sequence's slot in each pool
    for name in ("recurrent", "conv"):
        np.testing.assert_allclose(np.asarray(getattr(c2.states, name))[:, s2],
                                   np.asarray(getattr(c1.states, name))[:, s1], rtol=1e-5, atol=1e-5, err_msg=name)
    rows = [np.asarray(c.k[:, np.asarray(c.block_tables[0])]).reshape(cfg.kv_layers, -1, c.k.shape[3])[:, :5]
            for c in (c1, c2)]  # the attention layer's rows of the prompt
    np.testing.assert_allclose(rows[1], rows[0], rtol=1e-5, atol=1e-5)


def test_cache_holds_rope_keys_at_block_table_pages(model):
    cfg, p = model
    toks = _tokens(cfg, 1, 10, seed=5)
    cache = ref.init_cache(cfg, 1, 16, page_size=8, seed=7)
    _, cache = ref.prefill(p, cfg, [toks[0].tolist()], cache)
    # Token 9 lives in the sequence's second page, slot 1; untouched slots stay zero.
    page = int(cache.block_tables[0, 1])
    assert np.any(np.asarray(cache.k[:, page, 1]) != 0)
    assert np.all(np.asarray(cache.k[:, page, 2:]) == 0)
    unused = set(range(cache.k.shape[1])) - set(np.asarray(cache.block_tables).ravel().tolist())
    assert not unused  # the cache was sized exactly for this sequence


def test_bf16_close_to_f32(model):
    cfg, p = model
    cfg16 = cfg.replace(dtype="bfloat16")
    p16 = weights.cast_params(p, jnp.bfloat16)
    toks = jnp.asarray(_tokens(cfg, 1, 8, seed=2))
    a = np.asarray(ref.forward_full(p, cfg, toks))
    b = np.asarray(ref.forward_full(p16, cfg16, toks))
    # Weights and activations rounded to bf16 (8 mantissa bits): a few percent of logit scale.
    assert np.max(np.abs(a - b)) < 0.1 * np.std(a) + 0.05


def test_routing_softmax_topk_renormalised():
    cfg = config.load_preset("tiny-moe").replace(dtype="float32")
    logits = jnp.asarray([[0.0, 3.0, 1.0, 3.0, -1.0, 0.5, 2.0, 0.0]])
    ids, w = ref.route(cfg, logits)
    assert ids.tolist() == [[1, 3]]  # ties go to the lower id
    np.testing.assert_allclose(np.asarray(w), [[0.5, 0.5]], rtol=1e-6)
    ids, w = ref.route(cfg.replace(router_scoring="sigmoid", norm_topk_prob=False), logits)
    np.testing.assert_allclose(np.asarray(w), [[1 / (1 + np.exp(-3.0))] * 2], rtol=1e-6)


def test_greedy_generate_is_deterministic_and_in_vocab(model):
    cfg, p = model
    cache = ref.init_cache(cfg, 2, 24)
    a, _ = ref.greedy_generate(p, cfg, [[1, 2, 3], [4]], 6, cache)
    b, _ = ref.greedy_generate(p, cfg, [[1, 2, 3], [4]], 6, ref.init_cache(cfg, 2, 24))
    assert a == b and all(len(t) == 6 and all(0 <= x < cfg.vocab_size for x in t) for t in a)
    assert len(set(a[0])) > 1  # random weights are not degenerate


def test_a_bidirectional_step_sees_the_whole_step_and_the_cache_causally():
    """step_bidirectional (a DFlash drafter's block): each of the step's tokens attends to every
    token of the step and to the cached keys; a causal step's first rows do not see later rows,
    so their outputs differ, and a one-token step is the same either way."""
    from tpumk.model.config import load_preset
    from tpumk.model.weights import random_params

    cfg = load_preset("tiny-dense").replace(step_bidirectional=True, name="tiny-block")
    causal = cfg.replace(step_bidirectional=False)
    params = random_params(cfg, seed=0)
    block, plain = ref.jitted_decode_step(cfg), ref.jitted_decode_step(causal)  # compiled: eager ops take 20 s
    cache = ref.init_cache(cfg, 1, 32, 16)
    _, cache = plain(params, jnp.asarray([[1, 2, 3]]), jnp.arange(3)[None], cache)
    toks, pos = jnp.asarray([[3, 4, 5, 6]]), jnp.arange(3, 7)[None]
    a = block(params, toks, pos, cache)[0]
    b = plain(params, toks, pos, cache)[0]
    assert float(jnp.min(jnp.max(jnp.abs(a - b), -1))) > 1e-3
    one_a = block(params, toks[:, :1], pos[:, :1], cache)[0]
    one_b = plain(params, toks[:, :1], pos[:, :1], cache)[0]
    assert jnp.array_equal(one_a, one_b)


def _eager_random_params(cfg, seed):
    """random_params as it was drawn before it was bucketed: each leaf's normal drawn at its own
    shape and scaled by jnp ops run eagerly (one compiled program per op and shape)."""
    import jax

    dt = ref.jnp_dtype(cfg)
    depth_scale = 1.0 / np.sqrt(2.0 * cfg.num_layers)

    def make(name, shape, k):  # the pre-bucketing code
        if name.endswith("norm"):
            w = 1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)
        elif name == "router_bias":
            w = 0.1 * jax.random.normal(k, shape, jnp.float32)
        elif name in weights.RESIDUAL_GATES:
            w = 1.0 + 0.2 * jax.random.normal(k, shape, jnp.float32)
        elif name == "embed":
            w = jax.random.normal(k, shape, jnp.float32)
        elif name == "sinks":
            w = 1.0 + jax.random.normal(k, shape, jnp.float32)
        elif name == "router_logit_bias":
            w = jax.random.normal(k, shape, jnp.float32)
        elif name == "lin_A_log":
            w = -1.0 + 0.5 * jax.random.normal(k, shape, jnp.float32)
        elif name == "lin_dt_bias":
            w = 0.5 * jax.random.normal(k, shape, jnp.float32)
        elif name == "rope_alpha":
            w = 0.3 * jax.random.normal(k, shape, jnp.float32)
        elif name in ("q_log_scale", "idx_log_scale"):
            w = 0.2 * jax.random.normal(k, shape, jnp.float32)
        elif name in ("q_log_bias", "idx_log_bias"):
            w = 1.0 + 0.2 * jax.random.normal(k, shape, jnp.float32)
        elif name == "idx_q_bias":
            w = 0.5 * jax.random.normal(k, shape, jnp.float32)
        elif name == "idx_k_bias":
            w = 0.5 * jax.random.normal(k, shape, jnp.float32)
        elif name in weights.QKV_BIASES + ("e_gate_bias", "e_up_bias"):
            w = jax.random.normal(k, shape, jnp.float32)
        elif name in ("bo", "e_down_bias"):
            w = jax.random.normal(k, shape, jnp.float32) * depth_scale
        else:
            fan_in = shape[-2]
            w = jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)
            if name in ("wo", "w_down", "e_down", "s_down", "lin_out", "moe_out"):
                w = w * depth_scale
            if name == "router":
                w = w * 4.0
        return w.astype(weights.tensor_dtype(cfg, name, dt))

    return weights.draw_leaves(weights.expected_shapes(cfg), jax.random.PRNGKey(seed), make)


@pytest.mark.parametrize("preset,changes", [
    ("tiny-moe", dict(dtype="bfloat16", qkv_bias=True, attn_sinks=True, o_bias=True, expert_bias=True)),
    ("tiny-dense", dict(name="tiny-gdn", num_layers=3, linear_kind="gated_delta", linear_layers=(0, 1),
                        linear_key_heads=1, linear_value_heads=2, linear_key_dim=128, linear_value_dim=128,
                        linear_conv=4)),
    ("tiny-mla", dict(router_correction_bias=True)),
])
def test_random_params_equal_the_eager_draws_bit_for_bit(preset, changes):
    """random_params draws each leaf from one compiled program per power-of-two size and scales it
    in numpy (tpumk.model.weights.normal_draw): every leaf, dtype and bit as the eager jnp draw
    at the leaf's own shape, so no test's weights moved."""
    import jax

    cfg = config.load_preset(preset).replace(**changes)
    got, want = weights.random_params(cfg, seed=3), _eager_random_params(cfg, seed=3)
    got_leaves, got_tree = jax.tree.flatten(got)
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree
    for path, g, w in zip(jax.tree_util.tree_flatten_with_path(got)[0], got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape, path[0]
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), jax.tree_util.keystr(path[0])


def test_random_params_trace_to_the_shapes_and_dtypes_they_draw():
    """jax.eval_shape of random_params (how the vLLM plugin and the served-step tests take the
    weights' shapes without drawing them) gives the drawn weights' shapes and dtypes."""
    import jax

    cfg = config.resolve_model("tiny-moe")
    drawn = weights.random_params(cfg, seed=0, dtype=jnp.bfloat16)
    traced = jax.eval_shape(lambda: weights.random_params(cfg, seed=0, dtype=jnp.bfloat16))
    leaves = jax.tree_util.tree_leaves_with_path
    assert [(p, a.shape, a.dtype) for p, a in leaves(drawn)] == [(p, a.shape, a.dtype) for p, a in leaves(traced)]
