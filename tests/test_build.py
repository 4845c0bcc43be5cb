"""`tpumk build`: one kernel per step, a plan checked before compiling, estimates with provenance.

Builds run through the CLI in subprocesses, as a user runs them: the compiler's static
estimate comes from a separate profiling process (tpumk.estimate.profiler), which these tests exercise.
Every build runs beside impostor `tpumk` packages (tests/impostor.py: one in the working directory,
one first on PYTHONPATH); neither the CLI nor the profiling process it starts may import them.
"""

import json
import os
import subprocess
import sys

import pytest

from estimate_support import COMPILER_ESTIMATE, NO_PROFILER, needs_compiler_estimate
from impostor import imported, plant
from tpumk.child_process import PACKAGE_DIR, command

REQUIRED_KEYS = {"model", "target", "batch", "context", "compile_seconds", "custom_calls", "vmem_bytes",
                 "vmem_capacity_bytes", "hbm_bytes_per_step", "floor_seconds", "estimated_cycles",
                 "estimated_seconds", "estimate_source"}


IMPOSTORS: dict = {}  # the working directory and environment of every build (the fixture below)


@pytest.fixture(scope="module", autouse=True)
def beside_impostors(tmp_path_factory):
    root = tmp_path_factory.mktemp("impostors")
    IMPOSTORS.update(cwd=root / "cwd", elsewhere=root / "elsewhere")
    IMPOSTORS["env"] = {**os.environ, **plant(IMPOSTORS["cwd"], IMPOSTORS["elsewhere"])}
    yield
    assert not imported(IMPOSTORS["cwd"], IMPOSTORS["elsewhere"])


@pytest.fixture(autouse=True)
def no_impostor_imported():
    yield
    assert not imported(IMPOSTORS["cwd"], IMPOSTORS["elsewhere"]), "a build imported an impostor tpumk"


def tpumk(*args, check=True, env=None):
    # tpumk.child_process.command, as tpumk starts its own children: never the cwd's tpumk
    proc = subprocess.run(command("tpumk.cli", *args), cwd=IMPOSTORS["cwd"], env=env or IMPOSTORS["env"],
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_a_child_imports_the_tpumk_of_its_parent():
    """What the child imported, by Python's own account (PYTHONVERBOSE names every file it
    loads): the package of this process, not the impostor in the working directory or on
    PYTHONPATH. (Before tpumk.child_process, `python -m` loaded the working directory's.)"""
    p = tpumk("--help", env={**IMPOSTORS["env"], "PYTHONVERBOSE": "1"})
    inits = {line.rsplit(" ", 1)[-1] for line in p.stderr.splitlines()
             if line.startswith("# ") and line.endswith(os.path.join("tpumk", "__init__.py"))}
    assert inits == {os.path.join(PACKAGE_DIR, "__init__.py")}, inits


def build_json(*args):
    return json.loads(tpumk("build", *args, "--json").stdout)


def dense_toml(tmp_path, layers):
    f = tmp_path / f"dense{layers}.toml"
    f.write_text(f'name = "dense{layers}"\nnum_layers = {layers}\nhidden_size = 1024\nnum_q_heads = 8\n'
                 'num_kv_heads = 2\nhead_dim = 128\nffn_size = 2048\nvocab_size = 1024\ndtype = "bfloat16"\n')
    return str(f)


def test_default_build_is_small_moe_on_tpu7x_with_one_kernel_and_an_estimate(capsys):
    r = build_json()  # what the README's first command builds
    assert REQUIRED_KEYS <= set(r)
    assert (r["model"], r["target"], r["batch"]) == ("small-moe", "tpu7x", 1)
    assert r["custom_calls"] == 1
    from importlib.metadata import version  # the JAX stack the build used (docs/install.md)
    assert {k: r["versions"][k] for k in ("jax", "jaxlib", "libtpu")} == {k: version(k) for k in ("jax", "jaxlib", "libtpu")}
    assert 0 < r["vmem_bytes"] <= r["vmem_budget_bytes"] <= r["vmem_capacity_bytes"] == 64 * 2**20
    assert r["floor_seconds"] == pytest.approx(r["hbm_bytes_per_step"] / 3.7e12, rel=0.01)
    # the default model is bfloat16, so a build with no arguments gets the whole-step estimate
    # (on a JAX set whose libtpu profiles kernels with DMAs; elsewhere the report says why not)
    if COMPILER_ESTIMATE:
        assert r["estimated_cycles"] == r["compiler_cycles"] + r["nested_loop_cycles"] > 0
        assert r["estimated_seconds"] >= r["floor_seconds"]
        assert r["floor_fraction"] == pytest.approx(r["floor_seconds"] / r["estimated_seconds"])
        assert "static profile" in r["estimate_source"] and "calibration" in r["estimate_source"]
    else:
        assert r["estimated_seconds"] is None and r["estimate_source"].startswith(NO_PROFILER)
    # its speculative verify step (q_len 8) from the plan; with --verify-estimate it profiles too
    # (test_v6e_build_and_v5e_without_estimate: a second profiling compile takes seconds)
    v = r["verify"]
    assert v["q_len"] == 8 and v["estimated_seconds"] is None and v["floor_seconds"] > 0 and v["vmem_bytes"] > 0
    # The same report as `tpumk build` prints it (the CLI's renderer; the text path of the command
    # itself runs in test_float32_build_says_plainly_why_there_is_no_estimate): nothing missing.
    from tpumk.build import BuildReport
    from tpumk.cli.app import print_build_report

    # the command's own wall time by phase (beside the report, not in it): the phases cover it
    wall, phases = r.pop("wall_seconds"), r.pop("phase_seconds")
    profiling = {"compiler estimate (a profiling compile in its own process)"} if COMPILER_ESTIMATE else set()
    assert set(phases) == {"lower + compile for tpu7x", "report (tpumk's timeline model)",
                           "verify step, q = 8 (plan figures)"} | profiling
    assert 0 < sum(phases.values()) <= wall and phases["lower + compile for tpu7x"] >= r["compile_seconds"]
    print_build_report(BuildReport(**{k: v for k, v in r.items() if k not in ("wall_seconds", "phase_seconds")}))
    out = capsys.readouterr().out
    assert out.startswith("built small-moe for tpu7x")
    assert "n/a" not in out and "verify step" in out
    # one device: the compiled program is the kernel and a few small ops (no KV cache copies,
    # docs/many-devices.md), and the report says so with its own figure
    assert r["program_copies"]["count"] == 0 and r["program_seconds"] >= r["model_seconds"]
    assert "tpumk model, the whole program" in out and "XLA copies" not in out
    plain, verify = out.split("verify step", 1)
    assert ("not requested (--verify-estimate" if COMPILER_ESTIMATE else NO_PROFILER.removeprefix("none: ")) in verify
    if COMPILER_ESTIMATE:
        assert "no estimate" not in plain
        for row in ("compiler estimated cycles", "estimated step time", "floor / estimate", "estimate source: "):
            assert row in out
    else:
        assert f"no estimate: {NO_PROFILER.removeprefix('none: ')}" in plain


@pytest.mark.full  # v6e's estimate: test_v6e_build_and_v5e_without_estimate; small-moe's: the default build
def test_small_moe_builds_with_an_estimate_on_v6e():
    r = build_json("--target", "v6e", "--verify-q", "0")
    assert (r["model"], r["custom_calls"]) == ("small-moe", 1)
    assert r["estimated_seconds"] is not None and r["estimated_seconds"] >= r["floor_seconds"]


@needs_compiler_estimate  # elsewhere every build says the libtpu's reason (the default build above)
def test_float32_build_says_plainly_why_there_is_no_estimate():
    # tiny-dense has float32 weights: libtpu 0.0.52's static profiler aborts on them (tiny-moe's
    # too, at twice the compile), and the report must say so (and how to get an estimate) rather
    # than invent a figure.
    p = tpumk("build", "--model", "tiny-dense", "--verify-q", "0")
    out = p.stdout
    assert "n/a" not in out and "estimated step time" in out
    why = [line for line in out.splitlines() if line.startswith("no estimate: ")]
    assert why == ["no estimate: the TPU compiler's cost estimator crashes on this model's float32 weights; "
                   "build with --dtype bfloat16 to get an estimate"]
    for jargon in ("LLO", "exit -6", "profil", "abort"):
        assert jargon not in why[0]
    # the phases a person waited through, on stderr as each started, and the whole wall time
    assert [ln.split("] ", 1)[1] for ln in p.stderr.splitlines() if "] " in ln] == [
        "lower + compile for tpu7x", "compiler estimate (a profiling compile in its own process)",
        "report (tpumk's timeline model)"]
    assert out.splitlines()[-1].startswith("wall time (this host, measured): ")


@pytest.mark.full  # the same assertions on the default build (small-moe, bfloat16): the first test above
def test_bf16_build_has_a_whole_step_estimate_never_below_the_floor():
    r = build_json("--model", "tiny-moe", "--dtype", "bfloat16", "--batch", "2")
    assert r["custom_calls"] == 1
    # The whole-step estimate: compiler cycles plus the modelled nested-loop trips, never faster than the floor.
    assert r["estimated_cycles"] == r["compiler_cycles"] + r["nested_loop_cycles"]
    assert r["estimated_seconds"] >= r["floor_seconds"]
    assert r["floor_fraction"] == pytest.approx(r["floor_seconds"] / r["estimated_seconds"])
    assert "static profile" in r["estimate_source"] and "calibration" in r["estimate_source"]


@pytest.mark.full  # the same property, tighter, without the CLI: test_ring.py::test_static_estimate_grows_linearly_with_layers
def test_compiler_estimate_grows_linearly_with_layers(tmp_path):
    """The kernel is laid out so the static profile counts every layer (one loop level)."""
    cycles = {n: build_json("--model", dense_toml(tmp_path, n))["compiler_cycles"] for n in (2, 4, 8)}
    per_layer_a = (cycles[4] - cycles[2]) / 2
    per_layer_b = (cycles[8] - cycles[4]) / 4
    assert per_layer_a > 0
    assert per_layer_b == pytest.approx(per_layer_a, rel=0.1), cycles


@pytest.mark.full  # tests/README.md: what covers it in the default run
@needs_compiler_estimate
def test_v6e_build_and_v5e_without_estimate():
    r = build_json("--target", "v6e", "--model", "tiny-dense", "--batch", "4", "--verify-estimate")
    assert r["custom_calls"] == 1 and r["estimated_seconds"] is not None
    assert "ASSUMED" in r["estimate_source"]  # v6e's calibration has no on-chip anchor
    # --verify-estimate: the speculative verify step (q_len 8) profiles in its own process too
    v = r["verify"]
    assert v["q_len"] == 8 and v["estimated_seconds"] >= v["floor_seconds"] > 0
    assert v["estimated_cycles"] == v["compiler_cycles"] + v["nested_loop_cycles"]
    assert "static profile" in v["estimate_source"]
    r = build_json("--target", "v5e", "--model", "tiny-dense")
    assert r["custom_calls"] == 1 and r["estimated_cycles"] is None
    assert r["estimate_source"].startswith("none:")


def test_no_estimate_skips_the_profiling_compile():
    """--no-estimate: the plan, the compile and tpumk's model, no profiling process; with
    --verify-estimate it is a one-line usage error."""
    r = build_json("--model", "tiny-dense", "--dtype", "bfloat16", "--verify-q", "0", "--no-estimate")
    assert r["custom_calls"] == 1 and r["model_seconds"] >= r["floor_seconds"] > 0
    assert r["estimated_seconds"] is None and r["compiler_cycles"] is None
    if COMPILER_ESTIMATE:
        assert r["estimate_source"] == "none: not requested (estimate=False / --no-estimate skips the profiling compile)"
    else:  # the libtpu's reason comes first: asking would not have given an estimate either
        assert r["estimate_source"].startswith(NO_PROFILER)
    p = tpumk("build", "--no-estimate", "--verify-estimate", check=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "drop --no-estimate" in p.stderr


def test_build_report_of_a_hybrid_names_its_state_pool(tmp_path, capsys):
    """A hybrid's report names the state pool's bytes beside the weights and the KV cache: in
    the JSON (`hbm_bytes_by_part`, whose parts sum to the step's bytes, and `state_pool`: its
    shape, what it holds, what a step moves) and in the text report's rows."""
    from tpumk.build import BuildReport
    from tpumk.cli.app import print_build_report

    f = tmp_path / "tiny-gdn.toml"
    f.write_text('name = "tiny-gdn"\nnum_layers = 3\nhidden_size = 256\nnum_q_heads = 4\nnum_kv_heads = 2\n'
                 'head_dim = 128\nffn_size = 512\nvocab_size = 512\nlinear_kind = "gated_delta"\n'
                 'linear_layers = [0, 1]\nlinear_key_heads = 1\nlinear_value_heads = 2\nlinear_key_dim = 128\n'
                 'linear_value_dim = 128\nlinear_conv = 4\nattn_output_gate = true\ndtype = "float32"\n')
    r = build_json("--model", str(f), "--context", "256", "--batch", "2", "--no-estimate", "--verify-q", "0")
    parts, pool = r["hbm_bytes_by_part"], r["state_pool"]
    assert sum(parts.values()) == pytest.approx(r["hbm_bytes_per_step"])
    hbm = r["plan"]["hbm_bytes_per_step"]
    assert parts["linear_states"] == hbm["linear_states"] > 0 and parts["linear_windows"] == hbm["linear_windows"] > 0
    assert parts["kv_cache"] == hbm["kv_cache"] and parts["weights"] > parts["kv_cache"]
    state = 2 * 128 * 128 * 4  # float32, 2 value heads of 128 x 128
    window = (4 - 1) * (2 * 128 + 2 * 128) * 4  # the last 3 inputs of q | k | v, float32
    assert (pool["linear_layers"], pool["slots"], pool["pending_rows"]) == (2, 2, 1)
    assert pool["states_bytes_per_step"] == 2 * 2 * 2 * state  # read and written, 2 layers x 2 sequences
    assert pool["resident_bytes"] == 2 * 2 * pool["slot_bytes_per_layer"] > 2 * 2 * (state + window)
    print_build_report(BuildReport(**{k: v for k, v in r.items() if k not in ("wall_seconds", "phase_seconds")}))
    text = capsys.readouterr().out
    assert "(weights " in text and ", KV cache " in text and ", state pool " in text
    assert "2 linear layers x 2 slots (1 pending row each)" in text and "windows and pending rows" in text


def test_a_profiler_abort_names_the_instruction_it_could_not_model():
    """libtpu 0.0.52's static profiler aborts on a hybrid's program (the copy XLA puts around the
    kernel for the state pool's convolution windows); the estimate's reason is its own line,
    not the last 'RAW: Raising signal 6' of the abort (stderr as captured 2026-12-06)."""
    from tpumk.estimate.profiler import _failure_line

    stderr = ("F1206 18:26:38.994597   18307 llo_dumper.cc:1778] Static LLO profiling of copy.5 failed: "
              "INVALID_ARGUMENT: Unsupported DMA direction for latency modeling: dma-general\n"
              "*** Check failure stack trace: ***\n"
              "E1206 18:26:39.264431   18307 process_state.cc:796] RAW: Raising signal 6 with default behavior\n")
    assert _failure_line(stderr, -6) == ("libtpu aborted (SIGABRT): Static LLO profiling of copy.5 failed: "
                                         "INVALID_ARGUMENT: Unsupported DMA direction for latency modeling: dma-general")


def test_infeasible_plan_is_rejected_before_compiling():
    tuning = "ring_depth = 4000\n"
    import tempfile, os

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write("[tuning]\n" + tuning)
    try:
        p = tpumk("build", "--tuning", f.name, check=False)
    finally:
        os.unlink(f.name)
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and "does not fit tpu7x VMEM" in p.stderr


def test_model_too_big_for_one_device_says_so():
    p = tpumk("build", "--model", "qwen3-32b", "--target", "v6e", check=False)
    assert p.returncode == 1 and "does not fit one v6e device" in p.stderr


def test_a_compiler_rejection_is_one_line_naming_the_reason():
    """A program the TPU compiler refuses (here a kernel asking for more VMEM than TPU7x has)
    becomes a CompileError whose message is the compiler's own one-line reason."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from tpumk.compile.aot import compile_for
    from tpumk.errors import CompileError
    from tpumk.targets import get_target

    def kernel(x_ref, o_ref, big):
        big[...] = jnp.zeros_like(big)
        o_ref[...] = x_ref[...] + big[:8, :128]

    def fn(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              scratch_shapes=[pltpu.VMEM((256 * 1024, 512), jnp.float32)])(x)

    with pytest.raises(CompileError) as e:
        compile_for(fn, (jax.ShapeDtypeStruct((8, 128), jnp.float32),), get_target("tpu7x"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("tpu7x: the compiler rejected this build: ")
    assert "RESOURCE_EXHAUSTED" in msg or "vmem" in msg.lower()


def test_deviceless_executables_stay_out_of_the_persistent_compilation_cache(tmp_path):
    """With JAX's persistent cache on (the suite's own, or a user's JAX_COMPILATION_CACHE_DIR),
    a host CPU program is written there but a deviceless TPU executable is not: it could not be
    read back, and every later build would warn and recompile."""
    script = f"""
import os, jax, jax.numpy as jnp
from tpumk.compile.aot import compile_for
from tpumk.targets import get_target
def tpumk_cache_probe(x):
    return jnp.tanh(x) * 3
spec = (jax.ShapeDtypeStruct((8, 128), jnp.float32),)
jax.jit(tpumk_cache_probe).lower(*spec).compile()
compile_for(tpumk_cache_probe, spec, get_target("v6e"))
print(sorted(os.listdir({str(tmp_path)!r})))
"""
    env = dict(__import__("os").environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    entries = [e for e in eval(p.stdout.strip().splitlines()[-1]) if e.startswith("jit_tpumk_cache_probe")]
    assert len(entries) == 1, entries  # the CPU program only
    assert "persistent compilation cache" not in p.stderr
