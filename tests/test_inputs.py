"""Hardening of inputs: every error a user can cause is one line, sizes are bounded before any
work, shapes are validated where a build is described, a plan that passes compiles, and
profiler failures say why in plain words.

CLI cases run `tpumk build` through Click's CliRunner (in process, so the error path is the
user's: `fail_cleanly` prints `tpumk: error: ...` and exits 1, no traceback).
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from tpumk.cli.app import main
from tpumk.errors import ConfigError, PlanError
from tpumk.estimate.profiler import _failure_line
from tpumk.model.config import from_hf_config, load_preset
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

HF_BASE = {"model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 128, "num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 512}
HF_MOE = {**HF_BASE, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 128}
TOML_BASE = {"name": '"t"', "num_layers": "2", "hidden_size": "256", "num_q_heads": "2", "num_kv_heads": "1",
             "head_dim": "128", "vocab_size": "512", "ffn_size": "512"}


def run(*args):
    return CliRunner().invoke(main, list(args))


def assert_one_line_error(r, *must_contain):
    """Exit 1, exactly one stderr line starting `tpumk: error:`, naming what is wrong."""
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpumk: error: "), r.stderr
    for s in must_contain:
        assert s in lines[0], (s, lines[0])
    return lines[0]


def write_json(tmp_path, data, name="config.json"):
    f = tmp_path / name
    f.write_text(json.dumps(data))
    return str(f)


def write_toml(tmp_path, changes=None, name="model.toml", raw=None):
    f = tmp_path / name
    fields = {**TOML_BASE, **(changes or {})}
    f.write_text(raw if raw is not None else "".join(f"{k} = {v}\n" for k, v in fields.items() if v is not None))
    return str(f)


# ---------------------------------------------------------------------- config.json type confusions
@pytest.mark.parametrize("data, field", [
    ([1, 2], "JSON array"),
    ("qwen3", "JSON string"),
    ({**HF_BASE, "rms_norm_eps": "abc"}, "rms_norm_eps"),
    ({**HF_BASE, "rms_norm_eps": None, "rope_theta": [1]}, "rope_theta"),
    ({**HF_MOE, "num_experts": "8"}, "num_experts"),
    ({**HF_MOE, "num_experts": None, "num_local_experts": 8.5}, "num_local_experts"),
    ({**HF_MOE, "decoder_sparse_step": "2"}, "decoder_sparse_step"),
    ({**HF_MOE, "mlp_only_layers": 5}, "mlp_only_layers"),
    ({**HF_MOE, "mlp_only_layers": [[1]]}, "mlp_only_layers"),
    ({**HF_MOE, "norm_topk_prob": "false"}, "norm_topk_prob"),
    ({**HF_BASE, "num_hidden_layers": "2"}, "num_hidden_layers"),
    ({**HF_BASE, "hidden_size": 256.5}, "hidden_size"),
    ({**HF_BASE, "num_attention_heads": True}, "num_attention_heads"),
    ({**HF_BASE, "tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({**HF_BASE, "model_type": ["qwen3"]}, "model_type"),
    ({**HF_BASE, "layer_types": "full_attention"}, "layer_types"),
    ({**HF_BASE, "rope_scaling": "linear"}, "rope_scaling"),
    ({**HF_BASE, "rope_parameters": {"rope_theta": "1e6"}}, "rope_theta"),
    ({**HF_BASE, "vocab_size": 10**30}, "vocab_size"),
    ({**HF_BASE, "rms_norm_eps": 10**400}, "rms_norm_eps"),
])
def test_config_json_type_confusions_are_one_line(tmp_path, data, field):
    f = write_json(tmp_path, data)
    assert_one_line_error(run("build", "--model", f, "--target", "cpu"), f, field)


def test_config_json_that_is_not_json_or_not_text_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(run("build", "--model", str(bad), "--target", "cpu"), str(bad))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert_one_line_error(run("build", "--model", str(deep), "--target", "cpu"), str(deep))


def test_checkpoint_config_json_that_is_a_list_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    assert_one_line_error(run("build", "--checkpoint", str(tmp_path), "--target", "cpu"), "config.json", "array")


def test_valid_hf_configs_still_translate():
    cfg = from_hf_config({**HF_MOE, "mlp_only_layers": [0], "rms_norm_eps": 1e-5, "num_experts": 8.0})
    assert cfg.num_experts == 8 and cfg.dense_layers == (0,) and cfg.rms_eps == 1e-5


# ---------------------------------------------------------------------- TOML type confusions
@pytest.mark.parametrize("changes, field", [
    ({"num_layers": '"2"'}, "num_layers"),
    ({"hidden_size": "256.0"}, "hidden_size"),
    ({"num_q_heads": "true"}, "num_q_heads"),
    ({"num_kv_heads": "[1]"}, "num_kv_heads"),
    ({"rms_eps": '"abc"'}, "rms_eps"),
    ({"rms_eps": "true"}, "rms_eps"),
    ({"rope_theta": "inf"}, "rope_theta"),
    ({"rope_theta": "nan"}, "rope_theta"),
    ({"qk_norm": '"yes"'}, "qk_norm"),
    ({"dtype": "[1]"}, "dtype"),
    ({"dtype": '"float16"'}, "dtype"),
    ({"num_experts": '"8"'}, "num_experts"),
    ({"num_experts": "8", "top_k": "2", "expert_ffn_size": "128", "router_scoring": "{a = 1}"}, "router_scoring"),
    ({"num_experts": "8", "top_k": "2", "expert_ffn_size": "128", "dense_layers": '"x"'}, "dense_layers"),
    ({"num_experts": "8", "top_k": "2", "expert_ffn_size": "128", "dense_layers": "[1.5]"}, "dense_layers"),
    ({"num_experts": "8", "top_k": "2", "expert_ffn_size": "128", "dense_layers": "[[0]]"}, "dense_layers"),
    ({"name": "5"}, "name"),
    ({"name": '"a\\nb"'}, "name"),
    ({"vocab_size": "99999999999999999"}, "vocab_size"),
])
def test_toml_type_confusions_are_one_line(tmp_path, changes, field):
    f = write_toml(tmp_path, changes)
    assert_one_line_error(run("build", "--model", f, "--target", "cpu"), f, field)


def test_toml_shapes_that_are_not_a_table_of_fields_are_one_line(tmp_path):
    f = write_toml(tmp_path, raw="model = [1, 2]\n")
    assert_one_line_error(run("build", "--model", f, "--target", "cpu"), f, "model")
    f = write_toml(tmp_path, raw="[model]\nname = 3\n", name="m2.toml")
    assert_one_line_error(run("build", "--model", f, "--target", "cpu"), f)


# ---------------------------------------------------------------------- unbounded work
@pytest.mark.parametrize("command", ["build", "generate"])
@pytest.mark.parametrize("moe", [False, True])
def test_huge_num_layers_is_refused_fast(tmp_path, command, moe):
    changes = {"num_layers": str(10**12)}
    if moe:  # a MoE model has no dense layer: the old validation looped over every layer
        changes.update(num_experts="8", top_k="2", expert_ffn_size="128", ffn_size="0")
    f = write_toml(tmp_path, changes)
    args = ["--prompt-ids", "1,2", "--steps", "2"] if command == "generate" else ["--target", "cpu"]
    t0 = time.perf_counter()
    r = run(command, "--model", f, *args)
    assert time.perf_counter() - t0 < 0.5
    assert_one_line_error(r, f, "num_layers")


def test_huge_hf_num_hidden_layers_is_refused_fast(tmp_path):
    f = write_json(tmp_path, {**HF_MOE, "num_hidden_layers": 10**12})
    t0 = time.perf_counter()
    r = run("build", "--model", f, "--target", "cpu")
    assert time.perf_counter() - t0 < 0.5
    assert_one_line_error(r, "num_hidden_layers")


def test_a_model_too_big_for_the_host_is_refused_before_random_weights(tmp_path):
    """1000 layers of hidden 8192: bounded fields, but 1.7 TB of weights: generate refuses
    before allocating, build refuses in the plan's HBM check (closed-form counts)."""
    f = write_toml(tmp_path, {"num_layers": "1000", "hidden_size": "8192", "num_q_heads": "64",
                              "num_kv_heads": "8", "ffn_size": "28672"})
    t0 = time.perf_counter()
    assert_one_line_error(run("generate", "--model", f, "--prompt-ids", "1,2", "--steps", "2"), "host memory")
    assert_one_line_error(run("build", "--model", f), "does not fit one tpu7x device")
    assert time.perf_counter() - t0 < 1.0


def test_param_counts_are_closed_form_and_unchanged():
    for name in ("qwen3-8b", "qwen3-30b-a3b", "tiny-moe", "small-moe"):
        cfg = load_preset(name)
        by_layer = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2) + cfg.hidden_size
        for i in range(cfg.num_layers):
            c = cfg.layer_param_counts(i)
            by_layer += c["always"] + c["per_expert"] * c["experts"]
        assert cfg.param_count() == by_layer


@pytest.mark.parametrize("flag, value", [("--batch", "100000"), ("--context", str(2**40)), ("--q-len", "5000")])
def test_huge_step_shapes_are_refused_fast(flag, value):
    t0 = time.perf_counter()
    r = run("build", "--model", "tiny-dense", "--target", "cpu", flag, value)
    assert time.perf_counter() - t0 < 0.5
    assert_one_line_error(r, flag.lstrip("-").replace("-", "_"))


# ---------------------------------------------------------------------- context vs page size
def test_context_not_a_multiple_of_the_page_size_is_refused():
    line = assert_one_line_error(run("build", "--model", "tiny-dense", "--target", "cpu", "--context", "4"),
                                 "context = 4", "page_size (16)")
    assert "multiple" in line
    assert_one_line_error(run("build", "--model", "tiny-dense", "--target", "cpu", "--context", "40"),
                          "32 or 48")


def test_buildspec_validates_on_construction():
    cfg, t = load_preset("tiny-dense"), get_target("cpu")
    with pytest.raises(PlanError, match="context = 20: expected a positive multiple of page_size"):
        BuildSpec(cfg, t, 1, 20)
    with pytest.raises(PlanError, match="context = 72"):
        BuildSpec(cfg, t, 1, 64).replace(context=64 + 8)  # replace validates too
    with pytest.raises(PlanError, match="batch"):
        BuildSpec(cfg, t, True, 64)
    with pytest.raises(PlanError, match="q_len"):
        BuildSpec(cfg, t, 1, 32, q_len=33)
    with pytest.raises(PlanError, match="target"):
        BuildSpec(cfg, "cpu", 1, 32)
    spec = BuildSpec(cfg, t, 2, 64, page_size=32)
    assert make_plan(spec).spec == spec  # a valid spec plans to itself: one capacity, one cache key


def test_other_commands_get_the_spec_rule():
    r = run("cache-key", "--model", "tiny-dense", "--target", "cpu", "--context", "4")
    assert_one_line_error(r, "context = 4")


# ---------------------------------------------------------------------- VMEM: a plan that passes compiles
def _dense_2048(layers=8):
    # qwen3-8b cut to 8 layers of hidden 2048 (16 q / 4 kv heads of 128), bfloat16
    return load_preset("qwen3-8b").replace(name="qwen3-8b-h2048", num_layers=layers, hidden_size=2048,
                                           num_q_heads=16, num_kv_heads=4)


def test_attention_tile_temporaries_are_counted():
    cfg, t = _dense_2048(), get_target("tpu7x")
    small = make_plan(BuildSpec(cfg, t, 1, 4096, TuningConfig(kv_tile_pages=1)))
    big = make_plan(BuildSpec(cfg, t, 1, 4096, TuningConfig(kv_tile_pages=32)))
    for p in (small, big):
        assert p.vmem_temporaries["attention_temporaries"] == p.attention.temporaries_bytes() > 0
        assert p.vmem_needed == p.vmem_total + sum(p.vmem_temporaries.values())
        assert p.vmem_limit >= p.vmem_needed + 4 * 2**20
        assert p.summary()["vmem_temporaries_bytes"] == p.vmem_temporaries
    # 512-token tiles: 4 heads x 8 rows x 512 x (4 + 4 + 2) + masked V 512 x 512 x 2 + mask 8 x 512 x 4
    assert big.vmem_temporaries["attention_temporaries"] == 4 * 8 * 512 * 10 + 512 * 512 * 2 + 8 * 512 * 4
    assert big.vmem_temporaries["attention_temporaries"] > small.vmem_temporaries["attention_temporaries"]


def test_a_plan_whose_scoped_limit_would_exceed_the_chip_is_refused():
    cfg, t = _dense_2048(), get_target("tpu7x")
    with pytest.raises(PlanError, match="Mosaic headroom > capacity"):
        make_plan(BuildSpec(cfg, t, 1, 4096, TuningConfig(ring_depth=29, vmem_limit_fraction=1.0,
                                                         kv_tile_pages=16, kv_buffers=3)))


# (kv_tile_pages, kv_buffers, batch): the kv_tile_pages = 32 case of the issue, deeper KV rings,
# more rows, and configurations the plan must refuse (KV slots past the budget).
# The default run keeps one compiled case and one refusal; the wider ones are the `full` tier
# (tests/README.md lists them).
SWEEP = [(32, 3, 1), (32, 32, 1)] + [pytest.param(*c, marks=pytest.mark.full)
                                     for c in [(32, 6, 1), (16, 4, 8), (32, 3, 32), (32, 28, 1)]]


@pytest.mark.parametrize("kv_tile_pages, kv_buffers, batch", SWEEP)
def test_vmem_sweep_every_plan_that_passes_compiles(kv_tile_pages, kv_buffers, batch):
    """On the 8-layer 2048-wide bf16 dense model, every configuration is either refused by the
    plan (one PlanError) or compiles deviceless for tpu7x within the plan's scoped limit."""
    # the ring fixed at 12: the automatic depth would plan the refused cases with a shallower one
    spec = BuildSpec(_dense_2048(), get_target("tpu7x"), batch, 4096,
                     TuningConfig(kv_tile_pages=kv_tile_pages, kv_buffers=kv_buffers, ring_depth=12))
    try:
        plan = make_plan(spec)
    except PlanError as e:
        assert "\n" not in str(e) and "VMEM" in str(e)
        return
    from tpumk.compile.aot import compile_plan

    compiled = compile_plan(plan)  # raises (scoped VMEM OOM) if the plan undercounts
    assert compiled.custom_calls == 1


# ---------------------------------------------------------------------- profiler failures in plain words
FIFO_STDERR = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
E0000 00:00:1733012345.123456   12345 tpu_backend.cc:12] TPU_WORKER_HOSTNAMES not set
F1201 00:12:34.567890   12345 llo_scheduler.cc:987] Check failed: fifo.HasSpace() Cannot schedule FIFO push \
instruction when the FIFO is full (dma_general_push.3)
*** Check failure stack trace: ***
    @     0x7f0000000000  (unknown)
"""


def test_failure_line_names_the_fifo_profiler_limit():
    line = _failure_line(FIFO_STDERR, -6)
    assert line.startswith("libtpu's static profiler aborted scheduling this kernel's DMAs (a known profiler "
                           "limit: Cannot schedule FIFO push")
    assert "the executable itself compiles" in line and "\n" not in line


def test_failure_line_names_sigkill_as_out_of_memory():
    line = _failure_line("WARNING: something\nlast words of the compiler\n", -9)
    assert line == ("killed by SIGKILL, most likely out of memory (the profiling compile needs more RAM than "
                    "this host has)")


def test_failure_line_names_other_signals_and_keeps_the_check_line():
    line = _failure_line("noise\nF1201 x.cc:1] Check failed: a == b something broke\n@ 0x0\n", -6)
    assert line == "libtpu aborted (SIGABRT): Check failed: a == b something broke"
    assert _failure_line("", -11).startswith("libtpu crashed (segmentation fault) (SIGSEGV)")
    assert _failure_line("x\nRESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom\n", 1) == \
        "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom"
    assert _failure_line("", None) == "no output"
    # the float32 case keeps its plain message (build reports rely on it)
    assert "float32 matmuls" in _failure_line("... got vector-bf16packed ...", -6)


def test_estimate_source_carries_the_reason():
    from tpumk.estimate.compiler import convert_estimate
    from tpumk.estimate.profiler import Estimate

    import dataclasses

    # a target whose libtpu profiles kernels with DMAs, whichever JAX set runs the test
    tpu7x = dataclasses.replace(get_target("tpu7x"), static_profile=True)
    plan = make_plan(BuildSpec(load_preset("small-moe"), tpu7x, 1, 4096))
    for rc, stderr, want in ((-9, "", "out of memory"), (-6, FIFO_STDERR, "FIFO push")):
        est = Estimate(None, {}, None, None, f"profiling compile failed (exit {rc}): {_failure_line(stderr, rc)}")
        source = convert_estimate(plan, est)["estimate_source"]
        assert source.startswith("none: profiling compile failed") and want in source and "\n" not in source


def test_config_errors_are_tpumk_errors():
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        from_hf_config({**HF_BASE, "rms_norm_eps": "abc"}, "x/config.json")


# ---------------------------------------------------------------------- files the parsers refuse
GARBAGE = bytes(range(128, 256)) * 4  # not UTF-8


@pytest.mark.parametrize("raw, needle", [
    (GARBAGE, "not a UTF-8 text file"),
    (b"x = " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "nested too deeply"),
    (b"x = " + b"{a = " * 20_000 + b"1" + b"}" * 20_000 + b"\n", "nested too deeply"),
    (b"num_layers = " + b"7" * 5000 + b"\n", "more than 4300 digits"),
    (b"key = = 3\n", "malformed TOML"),
])
def test_read_toml_refusals_are_one_config_error_naming_the_file(tmp_path, raw, needle):
    """(Before: UnicodeDecodeError, RecursionError and int()'s ValueError escaped read_toml.)"""
    from tpumk.tomlfile import read_toml

    f = tmp_path / "bad.toml"
    f.write_bytes(raw)
    with pytest.raises(ConfigError, match=needle) as e:
        read_toml(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ") and "\n" not in msg and len(msg) < 300


def test_read_toml_unreadable_paths_are_config_errors(tmp_path):
    from tpumk.tomlfile import read_toml

    (tmp_path / "a_file").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="no such file"):
        read_toml(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        read_toml(tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_toml(tmp_path / "a_file" / "under.toml")  # a path through a regular file
    assert read_toml(tmp_path / "a_file") == {"x": 1}


def test_read_toml_reads_utf8_text(tmp_path):
    from tpumk.tomlfile import read_toml

    f = tmp_path / "u.toml"
    f.write_bytes('name = "Qwen3 – ü"\n'.encode())
    assert read_toml(f) == {"name": "Qwen3 – ü"}


@pytest.mark.parametrize("raw, needle", [
    (GARBAGE, "name.toml"),
    (b"num_layers = " + b"7" * 5000 + b"\n", "more than 4300 digits"),
    (b"x = " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "nested too deeply"),
])
def test_model_and_tuning_toml_refusals_through_the_cli(tmp_path, raw, needle):
    f = tmp_path / "name.toml"
    f.write_bytes(raw)
    assert_one_line_error(run("build", "--model", str(f), "--target", "cpu"), str(f), needle)
    assert_one_line_error(run("cache-key", "--model", "tiny-dense", "--target", "cpu", "--tuning", str(f)),
                          str(f), needle)


def test_config_json_with_a_5000_digit_integer_is_one_line(tmp_path):
    """(Before: int()'s 'Exceeds the limit (4300 digits)' ValueError escaped load_hf_config.)"""
    f = tmp_path / "config.json"
    f.write_text(json.dumps(HF_BASE).replace('"vocab_size": 512', '"vocab_size": ' + "7" * 5000))
    t0 = time.perf_counter()
    line = assert_one_line_error(run("build", "--model", str(f), "--target", "cpu"), str(f),
                                 "more than 4300 digits")
    assert time.perf_counter() - t0 < 5 and len(line) < 300
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    assert_one_line_error(run("build", "--model", str(deep), "--target", "cpu"), str(deep), "nested too deeply")


def test_load_hf_config_unreadable_path_is_a_config_error(tmp_path):
    from tpumk.model.config import load_hf_config

    (tmp_path / "a_file").write_text("{}")
    with pytest.raises(ConfigError, match="cannot read"):
        load_hf_config(tmp_path / "a_file" / "config.json")
