"""The command line: listing, generation, and one-line errors with a non-zero exit."""

import json

import pytest

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
    # hybrids: the layers of each token mixer (before: only the attention layers' heads were shown)
    nxt = rows["qwen3-next-80b-a3b"]
    assert (nxt["layers"], nxt["attention_layers"], nxt["linear_layers"], nxt["linear_kind"]) == (48, 12, 36,
                                                                                              "gated_delta")
    assert nxt["attention"] == "16q/2kv x 256 on 12, Gated DeltaNet 16k/32v x 128 on 36"
    assert rows["kimi-linear-48b-a3b"]["attention"].startswith("MLA 32h, latent 512+64 on 7, KDA 32k/32v x 128 on 20")
    assert (rows["qwen3-8b"]["attention_layers"], rows["qwen3-8b"]["linear_layers"]) == (36, 0)


def test_targets_json():
    r = run("targets", "--json")
    assert r.exit_code == 0, r.output
    names = [t["name"] for t in json.loads(r.output)["targets"]]
    assert names == ["v5e", "v5p", "v6e", "tpu7x", "cpu"]


def test_generate_json_matches_library_reference():
    r = run("generate", "--model", "tiny-moe", "--prompt-ids", "1,2,3;4,5", "--steps", "4", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
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
    assert json.loads(r.stdout)["model"] == "mini"


def test_malformed_toml_names_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("num_layers = = 3\n")
    r = run("generate", "--model", str(f), "--prompt-ids", "1", "--steps", "1")
    assert r.exit_code == 1 and "bad.toml" in r.output and "malformed TOML" in r.output


# ---------------------------------------------------------------------- errors: one line, exit 2 or 1
@pytest.mark.parametrize("args, line", [
    (("build", "--dtype", "fp16"), "tpumk: error: --dtype: 'fp16' is not one of 'float32', 'bfloat16'"),
    (("build", "--frob"), "tpumk: error: no such option '--frob'"),
    (("build", "--batchh", "2"), "tpumk: error: no such option '--batchh' (did you mean --batch?)"),
    (("build", "--batch", "x"), "tpumk: error: --batch: 'x' is not a valid integer"),
    (("generate", "--steps", "2"), "tpumk: error: missing option --prompt-ids"),
    (("inspect",), "tpumk: error: missing argument PATH"),
    (("frob",), "tpumk: error: no such command 'frob'"),
    (("--frob",), "tpumk: error: no such option '--frob'"),
    (("export", "--model"), "tpumk: error: option '--model' requires an argument"),
])
def test_usage_errors_are_one_line_with_exit_2(args, line):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), r.stderr
    assert "Usage:" not in r.stderr and "Traceback" not in r.stderr


def test_usage_error_points_at_the_commands_help():
    r = run("build", "--dtype", "fp16")
    assert r.stderr.strip().endswith("; see 'tpumk build --help'")


def test_input_errors_are_one_line_with_exit_1():
    for args in (("build", "--model", "no-such-model"), ("build", "--target", "v9")):
        r = run(*args)
        assert r.exit_code == 1, r.output
        assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("tpumk: error: ")


def test_help_and_version_still_exit_0():
    assert run("build", "--help").exit_code == 0
    r = run("--version")
    assert r.exit_code == 0 and "tpumk" in r.output


# ---------------------------------------------------------------------- model sizes
def test_readable_counts():
    from tpumk.cli.app import readable_count

    assert [readable_count(n) for n in (950, 2.1e6, 34.0e6, 117e6, 8.19e9, 30.53e9)] == [
        "950", "2.1 M", "34 M", "117 M", "8.19 B", "30.5 B"]


def test_models_table_prints_sizes_in_readable_units():
    r = run("models")
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line for line in r.output.splitlines() if line and line.split()[0] in
            ("tiny-dense", "tiny-moe", "small-moe", "qwen3-8b")}
    assert " M " in rows["tiny-dense"] and " M " in rows["tiny-moe"] and " M " in rows["small-moe"]
    assert "8.19 B" in rows["qwen3-8b"]
    assert "0.00" not in r.output


# ---------------------------------------------------------------------- inspect an artifact root
def test_inspect_lists_artifacts_under_a_root(tmp_path):
    root = tmp_path / "artifacts"
    # a TPU7x export (deviceless): what is listed is the manifest, and it compiles in a third of the cpu time
    r = run("export", "--model", "tiny-dense", "--target", "tpu7x", "--context", "32", "--out", str(root), "--json")
    assert r.exit_code == 0, r.output
    good = json.loads(r.stdout)["path"]
    # a broken artifact beside it: listed with the reason, not a crash
    broken = root / "tiny-moe" / "tpu7x" / "0123456789abcdef"
    broken.mkdir(parents=True)
    (broken / "manifest.toml").write_text("format = = 2\n")
    (root / "tiny-dense" / "tpu7x" / ".tmp-unfinished").mkdir()  # an export in progress: not listed

    for where in (root, root / "tiny-dense"):
        r = run("inspect", str(where), "--json")
        listing = json.loads(r.stdout)
        paths = {a["path"]: a for a in listing["artifacts"]}
        assert good in paths
        assert paths[good]["valid"] and paths[good]["model"] == "tiny-dense" and paths[good]["target"] == "tpu7x"
        assert (paths[good]["dtype"], paths[good]["quant"], paths[good]["batch"]) == ("float32", "none", 1)
    assert r.exit_code == 0 and listing["valid"]  # only the good one below tiny-dense/

    r = run("inspect", str(root))
    assert r.exit_code == 1  # one of them is invalid
    assert "2 artifacts, 1 invalid" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith(good))
    assert row.split()[1:6] == ["tiny-dense", "float32", "none", "1", "tpu7x"] and "valid" in row
    bad_row = next(line for line in r.stdout.splitlines() if line.startswith(str(broken)))
    assert "INVALID" in bad_row and "malformed manifest" in bad_row

    r = run("inspect", str(tmp_path / "empty"))  # no artifacts anywhere: the single-artifact answer
    assert r.exit_code == 1 and "not an artifact directory" in r.output


# ---------------------------------------------------------------------- empty names, cache-key --out
def one_error_line(r, *words):
    """Exit code 1, nothing on stdout, exactly one `tpumk: error:` line naming `words`."""
    assert r.exit_code == 1, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpumk: error: "), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, flag", [
    (("--model", "tiny-dense", "--target", ""), "--target"),
    (("--model", "", "--target", "cpu"), "--model"),
    (("--model", "   ", "--target", "cpu"), "--model"),
    (("--checkpoint", "", "--target", "cpu"), "--checkpoint"),
    (("--model", "tiny-dense", "--target", "cpu", "--tuning", ""), "--tuning"),
])
def test_empty_names_are_refused_not_defaulted(args, flag):
    """An empty --model / --target / ... is refused with one line: only an option left out is the default."""
    r = run("cache-key", *args)
    assert r.stdout == ""
    one_error_line(r, f"{flag}: empty value")


def test_cache_key_out_must_be_a_directory(tmp_path, monkeypatch):
    """cache-key --out refuses what export --out refuses: a regular file as --out or in the artifact's path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("a file")
    key = ["cache-key", "--model", "tiny-dense", "--target", "cpu"]
    for out, words in (("f", ["--out f", "f is a regular file"]),
                       ("f/sub", ["--out f/sub", "f is a regular file"])):
        r = run(*key, "--out", out)
        assert r.stdout == ""
        one_error_line(r, *words)
    (tmp_path / "o" / "tiny-dense").mkdir(parents=True)
    (tmp_path / "o" / "tiny-dense" / "cpu").write_text("a file")
    one_error_line(run(*key, "--out", "o"), "o/tiny-dense/cpu is a regular file", "in the artifact's path")
    # a --out that does not exist yet is fine, and cache-key creates nothing
    r = run(*key, "--out", "new")
    assert r.exit_code == 0 and r.stdout.startswith("new/tiny-dense/cpu/") and not (tmp_path / "new").exists()


# ---------------------------------------------------------------------- inspect: the error is on stderr too
# every table a manifest must have (tpumk.export.artifacts._parse_manifest), of the types a display needs
GOOD_TYPES = ('format = 5\nkey = "k"\nreport_json = "{}"\n[model]\nname = "m"\n[target]\nname = "cpu"\n'
              '[shapes]\nbatch = 1\ncontext = 16\nq_len = 1\npage_size = 16\n[tuning]\nwhen = 1979-05-27\n'
              '[versions]\n[files]\n[report]\ncompile_seconds = "fast"\n[signature]\n[signing]\nsigned = false\n'
              '[cache_key]\ninputs_json = "{}"\n[mesh]\ndevices = 1\n')


@pytest.mark.parametrize("files, arg, words", [
    ({}, "nope", ["nope: not an artifact directory (no such file or directory)"]),
    ({"f": "hello"}, "f", ["f: not an artifact directory (a regular file)"]),
    ({"d/": None}, "d", ["d: not an artifact directory (no manifest.toml)"]),
    ({"d/manifest.toml/": None}, "d", ["manifest.toml is a directory"]),
    ({"d/manifest.toml": b"\x8b\x00\xff"}, "d", ["d/manifest.toml: malformed manifest"]),
    ({"d/manifest.toml": "key = = 3\n"}, "d", ["d/manifest.toml: malformed manifest"]),
    ({"d/manifest.toml": 'key = 3\nfiles = "x"\nmodel = []\ntarget = 1\nshapes = "big"\n'}, "d",
     ["malformed manifest: missing 'format'"]),
    # the right format with fields of any type: reported, never raised (a 5000-digit integer in the key inputs)
    ({"d/manifest.toml": 'format = 5\nkey = 3\nmodel = []\ntarget = 1\nshapes = "big"\ntuning = 1\nversions = 1\n'
                         'files = "x"\nsigning = {signed = false}\ncache_key = {inputs_json = \'{"a": '
                         + "1" * 5000 + '}\'}\n'}, "d", ["d/manifest.toml: malformed manifest"]),
    ({"d/manifest.toml": GOOD_TYPES}, "d", ["d/manifest.toml: malformed manifest: cache_key.inputs_json lacks"]),
    ({"loop": "->loop"}, "loop", ["loop: not an artifact directory (a symlink loop)"]),
    ({"root/m/cpu/abc/manifest.toml": b"\x8b", "root/m/cpu/def/manifest.toml": "[files]\n"}, "root",
     ["2 of 2 artifacts under root invalid; first: root/m/cpu/abc/manifest.toml: malformed manifest"]),
    ({"a\nb/manifest.toml": "x = 1\n"}, "a\nb", ["a\\nb/manifest.toml: malformed manifest"]),
])
def test_inspect_invalid_is_one_error_line_and_a_report(files, arg, words, tmp_path, monkeypatch):
    """An invalid artifact (or PATH that is none): the report stays on stdout, one `tpumk: error:`
    line on stderr says why, exit code 1; with --json stdout is one valid JSON object."""
    monkeypatch.chdir(tmp_path)
    for name, content in files.items():
        p = tmp_path / name
        if name.endswith("/"):
            p.mkdir(parents=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str) and content.startswith("->"):
            p.symlink_to(content[2:])
        elif isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    r = run("inspect", arg)
    line = one_error_line(r, *words)
    assert "INVALID" in r.stdout and line.removeprefix("tpumk: error: ") != ""
    r = run("inspect", "--json", arg)
    assert json.loads(r.stdout)["valid"] is False
    assert one_error_line(r, *words) == line


def test_inspect_shows_an_unverified_manifest_of_odd_values_without_crashing(tmp_path):
    """Fields of the displayed types but odd values (a TOML date, a report figure that is a string)
    are shown, not a crash; --json stays JSON."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "manifest.toml").write_text(GOOD_TYPES)
    r = run("inspect", str(d))
    assert "key       k" in r.stdout and "the report's figures are not numbers" in r.stdout
    one_error_line(r, "malformed manifest")
    info = json.loads(run("inspect", "--json", str(d)).stdout)
    assert info["key"] == "k" and info["tuning"] == {"when": "1979-05-27"} and not info["valid"]


@pytest.mark.parametrize("args, words", [
    (["generate", "--prompt-ids", "1,2,999"], "--prompt-ids: id 999 outside the vocabulary [0, 512)"),
    (["generate", "--prompt-ids", "1,2", "--backend", "nope"], "--backend: unknown backend 'nope'"),
    (["generate", "--prompt-ids", "1,2", "--spec", "foo"], "--spec: unknown method 'foo'"),
    (["generate", "--prompt-ids", "1,2", "--quant", "int3"], "--quant: quant = 'int3': expected"),
    (["generate", "--prompt-ids", "1,2", "--devices", "2"], "--devices 2: only the megakernel backend"),
    (["quality", "--quant", "int3"], "--quant: quant = 'int3': expected"),
])
def test_input_checks_run_before_any_weights_are_built(monkeypatch, args, words):
    """Random weights take seconds (a checkpoint longer): what can be checked from the options and
    the model's config is refused first, in one line."""
    import tpumk.model.weights as W

    def no_weights(*a, **k):
        raise AssertionError("weights were built before the input was checked")

    monkeypatch.setattr(W, "random_params", no_weights)
    r = run(*args, "--model", "tiny-moe")
    assert r.exit_code == 1 and words in r.output and "weights were built" not in r.output, r.output


def test_units_follow_the_magnitude_and_one_row_keeps_one_unit():
    from tpumk.cli.units import duration, size

    assert [duration(s) for s in (12.34e-6, 4.2576e-3, 19.72, None)] == ["12.3 us", "4.258 ms", "19.72 s", "n/a"]
    assert duration(12e-6, us_digits=2) == "12.00 us" and duration(250e-6, scale_of=3e-3) == "0.250 ms"
    assert [size(n) for n in (15_753_120_000, 34_220_000, 12_000, 512)] == ["15.75 GB", "34.22 MB", "12.0 KB", "512 B"]
    assert size(34_220_000, scale_of=2.5e9, digits=3) == "0.034 GB"  # beside a 2.5 GB figure in the same row


def test_json_byte_counts_are_integers():
    from tpumk.cli.options import whole_bytes

    out = whole_bytes({"hbm_bytes": 6746838016.0, "model": {"stages": [{"hbm_bytes": 2.5e9 + 0.4}]},
                       "hbm_bytes_vs_plain": 1.0, "kv_bytes_per_token": 96.0, "floor_seconds": 1e-3,
                       "vmem_bytes": 1024})
    assert out == {"hbm_bytes": 6746838016, "model": {"stages": [{"hbm_bytes": 2500000000}]},
                   "hbm_bytes_vs_plain": 1.0, "kv_bytes_per_token": 96, "floor_seconds": 1e-3, "vmem_bytes": 1024}
    assert all(type(v) is int for v in (out["hbm_bytes"], out["kv_bytes_per_token"]))
    r = run("build", "--model", "tiny-dense", "--target", "cpu", "--context", "32", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert type(d["hbm_bytes_per_step"]) is int


def test_generate_ticks_once_per_decode_step_and_quality_says_its_phases():
    """`on_token` (the terminal's progress bar) ticks after each one-token step: steps - 1 of them,
    the first token coming from the prefill; `quality` prints its phases on stderr."""
    from tpumk.decode import generate as gen
    from tpumk.model.config import load_preset
    from tpumk.model.weights import random_params

    cfg = load_preset("tiny-dense")
    ticks = []
    r = gen.generate(gen.Model(cfg, random_params(cfg, 0), "random"), [[1, 2, 3]], 4, on_token=lambda: ticks.append(1))
    assert len(ticks) == 3 and len(r["tokens"][0]) == 4
    q = run("quality", "--model", "tiny-dense", "--quant", "int8", "--steps", "1")
    assert q.exit_code == 0, q.output
    assert [ln.split("] ", 1)[1] for ln in q.stderr.splitlines()] == [
        "weights: random (seed 0)", "float decode: 4 prompts x 2 steps (the reference)",
        "int8 (1/1): quantize, then the same decode"]


def test_a_long_phase_says_it_is_still_running_on_a_terminal(capsys):
    import time

    from tpumk.cli.progress import Phases

    phases = Phases("tpumk build", heartbeat=0.05)  # a terminal's 30 s, shortened
    phases("compiler estimate (a profiling compile in its own process)")
    time.sleep(0.3)
    phases("report")
    time.sleep(0.2)
    phases.done()
    time.sleep(0.2)  # nothing after the last phase ended
    err = capsys.readouterr().err.splitlines()
    at = next(i for i, ln in enumerate(err) if ln.endswith("] report"))
    assert err[0].endswith("own process)") and 2 <= at - 1 <= 7
    assert all(ln.endswith("... still compiler estimate") for ln in err[1:at])
    assert err[at + 1:] and all(ln.endswith("... still report") for ln in err[at + 1:])
    quiet = Phases("tpumk build", heartbeat=0.0)  # off a terminal: one line per phase
    quiet("lower + compile for tpu7x")
    time.sleep(0.1)
    quiet.done()
    assert len(capsys.readouterr().err.splitlines()) == 1
