"""Hostile and careless build specs, cache keys and resource requests (issue 24).

Each refusal case runs `tpumk` in-process (click.testing.CliRunner) in a fresh directory and
checks, as tests/test_hostile_corpus.py does: the README's exit code (1: input tpumk refused,
2: a malformed command line), stderr exactly one non-empty `tpumk: error: ...` line, no
traceback (no exception but SystemExit escapes), and a time limit (cheap checks run before
any expensive work: no case here compiles).

The cache-key cases check that the key covers what changes the program: the environment
variables libtpu and XLA read (LIBTPU_INIT_ARGS, XLA_FLAGS, TPU_MEGACORE) and every JAX option
that changes what JAX traces, lowers, exports or compiles (set by its JAX_* variable, read at
JAX's import: a fresh process per value), and that a spec `tpumk build` refuses gets no key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from tpumk.cli import main

from cli_output import error_lines
from file_trees import write_tree

TPUMK_BIN = Path(sys.executable).parent / "tpumk"
USAGE, INPUT = 2, 1
FAST = 10.0  # seconds: refused before any real work (no weights, no cache, no compile)
LIMIT = 60.0

HF_TINY = dict(model_type="qwen3", _name_or_path="tiny-ckpt", hidden_size=128, num_attention_heads=2,
               num_key_value_heads=1, head_dim=128, num_hidden_layers=1, intermediate_size=256, vocab_size=256,
               rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="float32",
               hidden_act="silu")
FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def hf_json(**fields: Any) -> str:
    d = dict(HF_TINY)
    d.update(fields)
    return json.dumps(d)


def tiny_tensors() -> dict[str, np.ndarray]:
    h, v, f, hd = 128, 256, 256, 128
    q, kv = 2 * hd, hd
    rng = np.random.default_rng(0)

    def r(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    p = "model.layers.0."
    return {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h), "lm_head.weight": r(v, h),
            p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
            p + "self_attn.q_proj.weight": r(q, h), p + "self_attn.k_proj.weight": r(kv, h),
            p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
            p + "self_attn.q_norm.weight": 1 + r(hd), p + "self_attn.k_norm.weight": 1 + r(hd),
            p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h), p + "mlp.down_proj.weight": r(h, f)}


def fp8_tensors(scale: float = 0.01, name: str = "model.layers.0.mlp.down_proj.weight") -> bytes:
    """The tiny checkpoint with `name` stored as e4m3 codes and one block scale set to `scale`
    (the others 0.01), in the official FP8 layout (weight_scale_inv [ceil(out/128), ceil(in/128)])."""
    import ml_dtypes
    from safetensors.numpy import save

    t = tiny_tensors()
    w = t[name]
    t[name] = np.clip(w / 0.01, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = np.full((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), 0.01, np.float32)
    s.flat[-1] = scale
    t[name + "_scale_inv"] = s
    return save(t)


# ---------------------------------------------------------------------- the harness
@dataclass
class Case:
    id: str
    args: list[str]
    code: int = INPUT
    files: dict[str, Any] = field(default_factory=dict)  # relative path -> text | bytes | callable; "d/": a dir
    limit: float = FAST
    match: str = ""  # a piece of the error line that says why


def run_cli(args: list[str]):
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, args, catch_exceptions=True)
    return r, time.perf_counter() - t0


def check_refusal(case: Case, tmp_path: Path, monkeypatch) -> str:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    write_tree(cwd, case.files)
    monkeypatch.chdir(cwd)
    r, seconds = run_cli(case.args)
    problems = []
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        problems.append(f"uncaught {type(r.exception).__name__}: {' '.join(str(r.exception).split())[:200]}")
    if r.exit_code != case.code:
        problems.append(f"exit code {r.exit_code}, expected {case.code}")
    if "Traceback" in r.stdout or "Traceback" in r.stderr:
        problems.append("'Traceback' in the output")
    # progress lines (tpumk.cli.progress: "tpumk generate: [   0.0 s] weights: ...") may come first
    lines = error_lines(r.stderr)
    if len(lines) != 1 or not lines[0].startswith("tpumk: error:") or not lines[0][len("tpumk: error:"):].strip():
        problems.append(f"stderr is not one 'tpumk: error: ...' line ({len(lines)} lines)")
    elif case.match and case.match not in lines[0]:
        problems.append(f"the error line does not say {case.match!r}")
    if seconds > case.limit:
        problems.append(f"took {seconds:.1f} s (limit {case.limit:.0f} s)")
    if problems:
        pytest.fail(f"{case.id}: " + "; ".join(problems) + f"\n  stderr: {r.stderr[:300]!r}\n  stdout: {r.stdout[:200]!r}",
                    pytrace=False)
    return lines[0]


@pytest.fixture(scope="module")
def warm():
    """Import what the commands import once, so the limits measure the case, not imports."""
    CliRunner().invoke(main, ["cache-key", "--model", "tiny-dense", "--target", "cpu"])
    import safetensors  # noqa: F401


# ---------------------------------------------------------------------- the corpus
RING = '[space]\nname = "h"\n[knobs.ring_depth]\ntype = "int"\nlow = 4\nhigh = 12\nstep = 4\n'
KV = '[knobs.kv_buffers]\ntype = "categorical"\nchoices = [0, 3]\n'


def constraint(expr: str) -> str:
    return f"[[constraints]]\nwhy = \"hostile\"\nexpr = {json.dumps(expr)}\n"


def tune(*more: str, space: str = "s.toml") -> list[str]:
    return ["tune", "--model", "tiny-moe", "--target", "cpu", "--objective", "model", "--trials", "1", "--space",
            space, "--storage", "sqlite:///st/s.db", "--cache-dir", "cache", "--out", "best/t.toml", *more]


def ckpt(config: str, tensors=None) -> dict[str, Any]:
    files = {"ckpt/config.json": config}
    if tensors is not None:
        files["ckpt/model.safetensors"] = tensors
    return files


KEY = ["cache-key", "--target", "cpu"]
GEN = ["generate", "--model", "tiny-dense", "--steps", "1"]
LONG = ",".join(["1"] * 50_000)

CASES: list[Case] = [
    # ---- duplicated keys in a weight scheme (never "the last one wins")
    *[Case(f"quant-duplicate-{label}", [*cmd, "--quant", q], match="given twice", files=files)
      for label, cmd, q, files in [
          ("ring-cache-key", [*KEY, "--model", "tiny-dense"], "ring=int8,ring=fp8", {}),
          ("ring-same-value", [*KEY, "--model", "tiny-dense"], "ring=int8, ring=int8", {}),
          ("experts-build", ["build", "--model", "tiny-moe", "--target", "cpu"],
           "experts=int4-g128,ring=int8,experts=fp8-b128", {}),
          ("ring-export", ["export", "--model", "tiny-dense", "--target", "cpu", "--out", "out"],
           "ring=fp8,experts=none,ring=int8", {}),
          ("ring-generate", [*GEN, "--prompt-ids", "1"], "ring = int8,ring=fp8", {}),
          ("tune", tune(space="t.toml"), "ring=int8,ring=int8", {"t.toml": RING}),
          ("quality-scheme-list", ["quality", "--model", "tiny-dense"], "int8;fp8;int8", {}),
          ("quality-preset-list", ["quality", "--model", "tiny-dense"], "fp8,fp8", {}),
      ]],
    # ---- quantization_config that is not an object; FP8 block scales that are not above zero
    *[Case(f"quantization-config-{label}-{where}", cmd, files=ckpt(hf_json(quantization_config=qc), tensors),
           match="quantization_config")
      for label, qc in [("string-fp8", "fp8"), ("string-other", "awq"), ("number", 8), ("list", ["fp8"]),
                        ("true", True)]
      for where, cmd, tensors in [
          ("cache-key-checkpoint", [*KEY, "--checkpoint", "ckpt"], None),
          ("cache-key-config-json", [*KEY, "--model", "ckpt/config.json"], None),
          ("generate-checkpoint", ["generate", "--checkpoint", "ckpt", "--prompt-ids", "1", "--steps", "1"],
           fp8_tensors)]],
    *[Case(f"fp8-block-scale-{label}", ["generate", "--checkpoint", "ckpt", "--prompt-ids", "1", "--steps", "1"],
           files=ckpt(hf_json(quantization_config=FP8_QC), lambda s=s, n=n: fp8_tensors(s, n)),
           match=f"{n}_scale_inv", limit=LIMIT)
      for label, s, n in [("zero", 0.0, "model.layers.0.mlp.down_proj.weight"),
                          ("negative", -0.01, "model.layers.0.mlp.down_proj.weight"),
                          ("nan", float("nan"), "model.layers.0.self_attn.q_proj.weight"),
                          ("inf", float("inf"), "model.layers.0.mlp.up_proj.weight"),
                          ("negative-zero", -0.0, "model.layers.0.self_attn.o_proj.weight")]],
    # ---- a quantized checkpoint builds as stored; another scheme is refused, not mixed in
    *[Case(f"fp8-checkpoint-requant-{label}", [*KEY, *src, "--quant", q], files=ckpt(hf_json(quantization_config=FP8_QC)),
           match="stores its weights as fp8-b128")
      for label, src, q in [("int8-checkpoint", ["--checkpoint", "ckpt"], "int8"),
                            ("fp8-model-json", ["--model", "ckpt/config.json"], "fp8"),
                            ("int4-model-dir", ["--model", "ckpt"], "int4"),
                            ("ring-int8", ["--checkpoint", "ckpt"], "ring=int8")]],
    # ---- a tuning space whose constraints admit nothing; absurd --timeout
    *[Case(f"tune-space-admits-nothing-{label}", tune(), files={"s.toml": text}, match="admit no configuration",
           limit=LIMIT)
      for label, text in [("below-range", RING + constraint("ring_depth < 0")),
                          ("above-range", RING + constraint("ring_depth > 100")),
                          ("contradiction", RING + KV + constraint("ring_depth > 8") + constraint("ring_depth < 8")),
                          ("fact", RING + constraint("ring_depth > hidden_size * 1000")),
                          ("two-knobs", RING + KV + constraint("ring_depth + kv_buffers > 1000"))]],
    *[Case(f"tune-timeout-{label}", tune("--timeout", t, space="t.toml"), files={"t.toml": RING}, match="--timeout")
      for label, t in [("inf", "inf"), ("minus-inf", "-inf"), ("nan", "nan"), ("1e300", "1e300"), ("zero", "0"),
                       ("negative", "-5"), ("a-year", "31536000"), ("infinity", "Infinity")]],
    # ---- specs build refuses get no key and no artifact either
    *[Case(f"refused-spec-{'-'.join(c.strip('-') for c in cmd)}-{label}", [*cmd, *args], files={}, match=match,
           limit=LIMIT)
      for cmd in (["cache-key"], ["cache-key", "--out", "out"], ["export", "--out", "out"])
      for label, args, match in [
          ("devices-7", ["--devices", "7"], "devices = 7"),
          ("devices-3-tiny-dense", ["--model", "tiny-dense", "--devices", "3", "--target", "tpu7x"], "devices = 3"),
          ("devices-6-qwen3-8b", ["--model", "qwen3-8b", "--devices", "6", "--target", "v6e"], "devices = 6"),
          ("too-big-for-hbm", ["--model", "qwen3-235b-a22b", "--target", "v5e"], "does not fit"),
      ]],
    # ---- a model name that is a path is never looked up among the presets
    *[Case(f"model-path-not-preset-{label}", [*KEY, "--model", name], files=files, match=match)
      for label, name, files, match in [
          ("dotdot-tmp", "../../../../tmp/x", {}, "no such model file"),
          ("dotdot-preset-dir", "../presets/tiny-dense", {}, "no such model file"),
          ("dot-slash", "./tiny-dense", {}, "no such model file"),
          ("trailing-slash", "tiny-dense/", {}, "no such model file"),
          ("existing-file-no-suffix", "./m", {"m": "name = 'x'\n"}, "a model file is a model TOML"),
          ("absolute-no-suffix", "/etc/hostname", {}, "a model file is a model TOML"),
          ("space", "tiny dense", {}, "not a preset name"),
          ("backslash", "..\\..\\tiny-dense", {}, "not a preset name"),
      ]],
    # ---- resources checked against the host before anything is allocated
    *[Case(f"quality-steps-{label}", ["quality", "--model", "tiny-dense", "--steps", s], match="--steps")
      for label, s in [("minus-1", "-1"), ("zero", "0"), ("minus-1e9", "-1000000000"), ("1e8", "100000000"),
                       ("4m-host-memory", "4000000")]],
    Case("generate-50k-token-prompt", [*GEN, "--prompt-ids", LONG], match="--prompt-ids"),
    Case("generate-50k-token-prompt-ngram", [*GEN, "--prompt-ids", LONG, "--spec", "ngram"], match="--prompt-ids"),
    Case("generate-30k-token-prompt-moe", ["generate", "--model", "tiny-moe", "--steps", "1", "--prompt-ids",
                                           ",".join(["2"] * 30_000)], match="--prompt-ids"),
    Case("generate-long-prompts-batch", [*GEN, "--prompt-ids", ";".join([",".join(["3"] * 45_000)] * 3)],
         match="--prompt-ids"),
    Case("generate-steps-3m", ["generate", "--model", "tiny-moe", "--steps", "3000000", "--prompt-ids", "1;2;3;4"],
         match="--steps"),
]

_ids = [c.id for c in CASES]
assert len(_ids) == len(set(_ids)), sorted({i for i in _ids if _ids.count(i) > 1})


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_refused_in_one_line(case: Case, tmp_path: Path, monkeypatch, warm):
    check_refusal(case, tmp_path, monkeypatch)


# ---------------------------------------------------------------------- specs build refuses
@pytest.mark.parametrize("args", [["--devices", "7"], ["--model", "tiny-dense", "--devices", "3", "--target", "tpu7x"],
                                  ["--model", "qwen3-235b-a22b", "--target", "v5e"]], ids=["d7", "d3", "hbm"])
def test_cache_key_refuses_exactly_what_build_refuses(args, tmp_path, monkeypatch, warm):
    """The same check (the plan), so the same line: build refuses before compiling."""
    monkeypatch.chdir(tmp_path)
    b, _ = run_cli(["build", *args])
    k, _ = run_cli(["cache-key", *args])
    assert b.exit_code == k.exit_code == INPUT
    assert k.stderr == b.stderr and k.stdout == ""


# ---------------------------------------------------------------------- FP8 checkpoints plan as stored
def test_fp8_checkpoint_spec_is_its_stored_format_everywhere(tmp_path, monkeypatch, warm):
    """build, export and cache-key derive one spec: an FP8 checkpoint is fp8-b128 whether it is
    given as --checkpoint, its directory or its config.json, and its key is not the float one."""
    write_tree(tmp_path, {"fp8/config.json": hf_json(quantization_config=FP8_QC), "float/config.json": hf_json()})
    monkeypatch.chdir(tmp_path)

    def key(*args):
        r, _ = run_cli(["cache-key", "--target", "cpu", "--json", *args])
        assert r.exit_code == 0, r.stderr
        d = json.loads(r.stdout)
        return d["key"], d["inputs"]["shapes"]["quant"]

    fp8 = {key("--checkpoint", "fp8"), key("--model", "fp8"), key("--model", "fp8/config.json"),
           key("--checkpoint", "fp8", "--quant", "fp8-b128"), key("--checkpoint", "fp8", "--quant", "none")}
    assert len(fp8) == 1 and next(iter(fp8))[1] == "fp8-b128"
    assert key("--checkpoint", "float") != next(iter(fp8)) and key("--checkpoint", "float")[1] == "none"
    assert key("--checkpoint", "float", "--quant", "fp8-b128") == next(iter(fp8))  # the same build


def test_one_code_path_decides_the_stored_format():
    """The spec (resolve_spec) and the loader (load_checkpoint) ask the same function."""
    from tpumk.model import checkpoint, config

    assert config.stored_scheme({"quantization_config": FP8_QC}, "c") == "fp8-b128"
    assert config.stored_scheme({}, "c") == config.stored_scheme({"quantization_config": None}, "c") == "none"
    assert not hasattr(checkpoint, "_fp8_config")  # the loader's own copy is gone


# ---------------------------------------------------------------------- the cache key's compile settings
KEY_SCRIPT = textwrap.dedent("""
    import json, sys
    from tpumk.compile.keys import key_inputs, cache_key
    from tpumk.model.config import load_preset
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target
    spec = BuildSpec(load_preset("tiny-dense"), get_target("tpu7x"), 1, 32)
    inputs = key_inputs(spec)
    print(json.dumps({"key": cache_key(inputs), "inputs": inputs}))
""")


def _keys_in_fresh_processes(envs: dict[str, dict[str, str]]) -> dict[str, dict]:
    """The key of one spec in a fresh process per environment (JAX reads JAX_* at import), run
    side by side."""
    base = {k: v for k, v in os.environ.items()
            if not (k.startswith("JAX_") or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_MEGACORE"))}
    procs = {name: subprocess.Popen([sys.executable, "-c", KEY_SCRIPT], env={**base, **env}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, env in envs.items()}
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail(f"{name}: the key process ran over 120 s")
        assert p.returncode == 0, f"{name}: {stderr[-500:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


# Each changes what JAX or libtpu emits for a TPU build (values other than the defaults).
PROGRAM_ENV = {
    "JAX_USE_SHARDY_PARTITIONER": "false",
    "JAX_ENABLE_X64": "true",
    "JAX_DEFAULT_MATMUL_PRECISION": "highest",
    "XLA_FLAGS": "--xla_cpu_enable_fast_math=true",
    "LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false",
    "TPU_MEGACORE": "megacore_dense",
}
# Each leaves the program alone: the key stays (a report-only dump flag, logging, a cache dir).
# (every other JAX option the key covers: test_every_jax_program_option_moves_the_key, in one process)
NEUTRAL_ENV = {
    "LIBTPU_INIT_ARGS": "--xla_jf_dump_static_llo_profile_to=/tmp/profile-dir",
    "JAX_LOG_COMPILES": "true",
}


def test_each_program_setting_moves_the_key_in_a_fresh_process(warm):
    envs = {"base": {}, **{f"set {k}": {k: v} for k, v in PROGRAM_ENV.items()},
            **{f"neutral {k}": {k: v} for k, v in NEUTRAL_ENV.items()}}
    keys = _keys_in_fresh_processes(envs)
    base = keys["base"]["key"]
    stayed = [k for k in PROGRAM_ENV if keys[f"set {k}"]["key"] == base]
    assert not stayed, f"the key does not move with {stayed}"
    moved = [k for k in NEUTRAL_ENV if keys[f"neutral {k}"]["key"] != base]
    assert not moved, f"the key moves with {moved}, which do not change the program"
    # and each setting is readable in the key's inputs
    assert keys["set JAX_USE_SHARDY_PARTITIONER"]["inputs"]["jax_options"]["jax_use_shardy_partitioner"] is False
    assert keys["set TPU_MEGACORE"]["inputs"]["compile_flags"]["TPU_MEGACORE"] == "megacore_dense"


SWEEP_SCRIPT = textwrap.dedent("""
    import json
    import jax
    from jax._src import config as jc
    from tpumk.compile import keys as K
    from tpumk.model.config import load_preset
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target
    spec = BuildSpec(load_preset("tiny-dense"), get_target("tpu7x"), 1, 32)
    base = K.key_for(spec)
    names = K.jax_option_names()

    def other(name, v):
        import enum
        meta = jc.config.meta.get(name, (None, (), {}))
        choices = meta[2].get("enum_values") or [c for c in (meta[1][0] if meta[1] and isinstance(meta[1][0], (list, tuple)) else [])]
        if isinstance(v, enum.Enum):
            return next(m for m in type(v) if m != v)
        if isinstance(v, bool):
            return not v
        if isinstance(v, int):
            return v + 1
        if isinstance(v, float):
            return v + 0.5
        if name == "jax_default_device":
            return jax.devices("cpu")[0]
        for c in choices:
            if c != v and c is not None:
                return c
        return "tpumk-test"

    result = {"names": names, "stayed": [], "unset": []}
    for name in names:
        v = jc.config._read(name)
        try:
            jc.config.update(name, other(name, v))
        except Exception as e:
            result["unset"].append(f"{name}: {type(e).__name__}: {e}"[:200])
            continue
        try:
            if K.key_for(spec) == base:
                result["stayed"].append(name)
        finally:
            jc.config.update(name, v)
    assert K.key_for(spec) == base
    print(json.dumps(result))
""")


def test_every_jax_program_option_moves_the_key():
    """Each JAX option the key covers (those JAX keys its traces on, and the compile options),
    set to another value through jax.config, moves the key; in a fresh process, since one option
    (jax_default_device) needs a backend."""
    p = subprocess.run([sys.executable, "-c", SWEEP_SCRIPT], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-1000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for must in ("jax_use_shardy_partitioner", "jax_enable_x64", "jax_default_matmul_precision",
                 "jax_numpy_rank_promotion", "jax_optimization_level", "jax_compiler_enable_remat_pass"):
        assert must in r["names"]
    assert not r["stayed"], f"the key does not move with {r['stayed']}"
    assert not r["unset"], r["unset"]


# ---------------------------------------------------------------------- no compile worker outlives its trial
def test_a_failed_wait_kills_the_compile_worker(monkeypatch):
    """Whatever ends the wait for a trial's worker (here the OverflowError an unbounded timeout
    gave), the worker's process group is killed before the error goes on."""
    import threading

    from tpumk.model.config import load_preset
    from tpumk.plan.knobs import TuningConfig
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import get_target
    from tpumk.tune import trial as T

    started = []
    real = subprocess.Popen

    def popen(args, **kw):
        p = real([sys.executable, "-c", "import time; time.sleep(120)"], **kw)
        started.append(p)
        return p

    monkeypatch.setattr(T.subprocess, "Popen", popen)
    obj = object.__new__(T.TrialRunner)  # only what _run_worker reads is set below
    obj.problem = BuildSpec(load_preset("tiny-dense"), get_target("cpu"), 1, 32)
    obj.objective = type("O", (), {"name": "model", "device_warmup": 0, "device_repeats": 0})()
    obj.settings = type("S", (), {"timeout": float("inf")})()
    obj.lock, obj.procs = threading.Lock(), set()
    with pytest.raises(OverflowError):
        obj._run_worker(None, TuningConfig())
    assert started and started[0].poll() is not None, "the worker is still running"


def test_a_relative_path_out_of_the_presets_directory_is_not_a_preset(tmp_path, monkeypatch, warm):
    """`--model ../../x` named a file outside the presets directory, joined onto it: a model
    TOML planted there was built. Now a value with a path separator is a path (from the working
    directory), never a preset; there it names no file."""
    from importlib import resources

    (tmp_path / "planted.toml").write_text('name = "planted"\nnum_layers = 1\nhidden_size = 128\nnum_q_heads = 2\n'
                                           'num_kv_heads = 1\nhead_dim = 128\nffn_size = 256\nvocab_size = 256\n'
                                           'dtype = "float32"\n')
    presets = Path(str(resources.files("tpumk.model.presets")))
    rel = os.path.relpath(tmp_path / "planted", presets)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    r, _ = run_cli(["cache-key", "--model", rel, "--target", "cpu"])
    assert r.exit_code == INPUT and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.startswith("tpumk: error:") and len(r.stderr.splitlines()) == 1 and "no such model file" in r.stderr
