"""The command line: listing, generation, and one-line errors with a non-zero exit."""

import json

from click.testing import CliRunner

from tpumk.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_help_lists_commands():
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("models", "targets", "generate"):
        assert cmd in r.output


def test_models_json_lists_presets():
    r = run("models", "--json")
    assert r.exit_code == 0, r.output
    rows = {m["name"]: m for m in json.loads(r.output)["models"]}
    assert {"tiny-dense", "tiny-moe", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"} <= set(rows)
    assert rows["qwen3-8b"]["layers"] == 36
    assert abs(rows["qwen3-8b"]["params"] / 8.19e9 - 1) < 0.01
    # MoE: batch 8 touches more distinct experts than batch 1.
    assert rows["qwen3-30b-a3b"]["weight_bytes_per_step_b8"] > rows["qwen3-30b-a3b"]["weight_bytes_per_step_b1"]


def test_targets_json():
    r = run("targets", "--json")
    assert r.exit_code == 0, r.output
    names = [t["name"] for t in json.loads(r.output)["targets"]]
    assert names == ["v5e", "v5p", "v6e", "tpu7x", "cpu"]


def test_generate_json_matches_library_reference():
    r = run("generate", "--model", "tiny-moe", "--prompt-ids", "1,2,3;4,5", "--steps", "4", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    from tpumk.model import config
    from tpumk.model import reference
    from tpumk.model import weights

    cfg = config.load_preset("tiny-moe")
    want, _ = reference.greedy_generate(weights.random_params(cfg, 0), cfg, [[1, 2, 3], [4, 5]], 4,
                                        reference.init_cache(cfg, 2, 7))
    assert out["tokens"] == want
    assert out["backend"] == "reference" and out["seconds"] > 0


def test_generate_bad_prompt_ids_is_one_line_error():
    r = run("generate", "--model", "tiny-dense", "--prompt-ids", "1,2,99999", "--steps", "2")
    assert r.exit_code == 1
    assert r.output.strip().count("\n") == 0 and "--prompt-ids" in r.output and "99999" in r.output


def test_generate_unknown_model_is_one_line_error():
    r = run("generate", "--model", "no-such-model", "--prompt-ids", "1", "--steps", "2")
    assert r.exit_code == 1 and "unknown model preset 'no-such-model'" in r.output


def test_generate_from_toml_file(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[model]\nname = "mini"\nnum_layers = 1\nhidden_size = 128\nnum_q_heads = 2\n'
                 'num_kv_heads = 1\nhead_dim = 128\nffn_size = 256\nvocab_size = 256\ndtype = "float32"\n')
    r = run("generate", "--model", str(f), "--prompt-ids", "5,6", "--steps", "3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["model"] == "mini"


def test_malformed_toml_names_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("num_layers = = 3\n")
    r = run("generate", "--model", str(f), "--prompt-ids", "1", "--steps", "1")
    assert r.exit_code == 1 and "bad.toml" in r.output and "malformed TOML" in r.output
