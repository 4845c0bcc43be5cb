"""Exported artifacts: export, cache hits, load in a fresh process, verification errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner

from tpumk.export import artifacts as A
from tpumk.export import checks
from tpumk.compile.keys import key_for
from tpumk.model.config import load_preset
from tpumk.errors import ArtifactError, PositionError
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec

CONTEXT, PAGE = 32, 16


@pytest.fixture(autouse=True)
def _no_signing_key(monkeypatch):
    """These tests are about unsigned artifacts (tests/test_artifact_trust.py covers signing)."""
    for var in ("TPUMK_SIGNING_KEY", "TPUMK_SIGNING_KEY_FILE", "TPUMK_REQUIRE_SIGNED"):
        monkeypatch.delenv(var, raising=False)


def _export(out_dir, target):
    return A.export(BuildSpec(load_preset("tiny-dense"), get_target(target), batch=1, context=CONTEXT, tuning=TuningConfig(), q_len=1, page_size=PAGE), out_dir=out_dir)


@pytest.fixture(scope="module")
def cpu_artifact(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("art"), "cpu")


@pytest.fixture(scope="module")
def tpu_artifact(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("art"), "tpu7x")


def _copy(res, tmp_path):
    dst = tmp_path / res.key
    shutil.copytree(res.path, dst)
    return dst


LOAD_AND_GENERATE = r"""
import json, sys
import jax.numpy as jnp, numpy as np
import tpumk
from tpumk.model import reference as R
from tpumk.model.config import load_preset
from tpumk.model.weights import random_params

import jax
from jax import monitoring

compiles = []  # XLA compilations, counted per step call: the step compiles on its first call only
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else None)
per_call = []


def decode(t, p, c):
    before = len(compiles)
    out = jax.block_until_ready(step(packed, t, p, c))
    per_call.append(len(compiles) - before)
    return out


step = tpumk.load(sys.argv[1], use=sys.argv[2])
cfg = load_preset("tiny-dense")
params = random_params(cfg, seed=0)
packed = tpumk.pack_weights(step.plan, params)
prompt = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]
want, _ = R.greedy_generate(params, cfg, prompt, 8, R.init_cache(cfg, 1, 32, 16))
got, cache = R.greedy_generate(params, cfg, prompt, 8, step.init_cache(), decode_fn=decode)
# one more step, to compare logits against the reference at a tolerance
tokens = jnp.asarray([[got[0][-1]]], jnp.int32)
length = int(cache.lengths[0])
ref_logits, _ = R.jitted_decode_step(cfg)(params, tokens, cache.lengths[:, None], cache)
logits, _ = step(packed, tokens, cache.lengths[:, None], cache)  # the executable donates `cache`
scale = float(np.max(np.abs(np.asarray(ref_logits))))
err = float(np.max(np.abs(np.asarray(logits) - np.asarray(ref_logits))))
print(json.dumps({"kind": step.kind, "got": got, "want": want, "err": err, "scale": scale,
                  "len": length, "compiles_per_call": per_call}))
"""


@pytest.mark.parametrize("use", ["auto", pytest.param("executable", marks=pytest.mark.full)])
def test_cpu_export_loads_in_fresh_process_and_generates_reference_tokens(cpu_artifact, use, tmp_path):
    """The cpu artifact holds real programs (no re-tracing): a fresh process loads the portable
    export (auto) or the serialized executable and greedy-decodes the reference's tokens.
    `executable` loads a second export of the same step made in this process: with JAX's
    persistent compilation cache on (the suite sets one), its compile would be served from the
    cache, and such an executable serialized into a blob that failed to load ("Function
    wrapped_broadcast.N not found"); export compiles past the cache."""
    from jax._src import compilation_cache

    assert not cpu_artifact.cache_hit
    if use == "executable":
        assert compilation_cache.is_persistent_cache_enabled()  # the case this checks
        cpu_artifact = _export(tmp_path, "cpu")
        assert not cpu_artifact.cache_hit
    m = A.verify(cpu_artifact.path)
    assert set(m["files"]) == {A.EXECUTABLE, A.EXPORTED}
    assert m["target"]["export_platform"] == "cpu" and "interpret=True" in m["target"]["kernel_mode"]
    again = _export(cpu_artifact.path.parents[2], "cpu")
    assert again.cache_hit and again.path == cpu_artifact.path
    out = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, str(cpu_artifact.path), use],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["kind"] == ("exported (cpu)" if use == "auto" else "executable (cpu)")
    assert r["got"] == r["want"] and len(r["got"][0]) == 8
    assert r["err"] <= 1e-5 * r["scale"], r
    assert r["len"] == 17 + 7
    # the step compiles on its first call only (before: the portable export compiled again on the
    # second, whose cache argument the first call had committed to the device)
    assert len(r["compiles_per_call"]) == 7 and not any(r["compiles_per_call"][1:]), r["compiles_per_call"]


KEY = r"""
from tpumk.compile.keys import key_for
from tpumk.model.config import load_preset
from tpumk.targets import get_target
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.spec import BuildSpec
print(key_for(BuildSpec(load_preset("tiny-dense"), get_target("tpu7x"), 1, 32, TuningConfig(), 1, 16)))
"""


def test_cache_key_stable_across_processes_and_sensitive_to_inputs():
    keys = {subprocess.run([sys.executable, "-c", KEY], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    assert len(keys) == 1
    cfg, t, tun = load_preset("tiny-dense"), get_target("tpu7x"), TuningConfig()
    base = key_for(BuildSpec(cfg, t, 1, 32, tun, 1, 16))
    assert base in keys
    variants = [
        key_for(BuildSpec(cfg.replace(rms_eps=cfg.rms_eps * 2), t, 1, 32, tun, 1, 16)),
        key_for(BuildSpec(cfg, get_target("v6e"), 1, 32, tun, 1, 16)),
        key_for(BuildSpec(cfg, t, 2, 32, tun, 1, 16)),
        key_for(BuildSpec(cfg, t, 1, 64, tun, 1, 16)),
        key_for(BuildSpec(cfg, t, 1, 32, tun, 2, 16)),
        key_for(BuildSpec(cfg, t, 1, 32, tun, 1, 32)),
        key_for(BuildSpec(cfg, t, 1, 32, tun.replace(ring_depth=8), 1, 16)),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_cache_key_covers_compile_flags(monkeypatch):
    cfg, t = load_preset("tiny-dense"), get_target("tpu7x")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    base = key_for(BuildSpec(cfg, t, 1, 32, TuningConfig(), 1, 16))
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert key_for(BuildSpec(cfg, t, 1, 32, TuningConfig(), 1, 16)) != base


def test_hash_mismatch_truncated_and_altered(tpu_artifact, tmp_path):
    d = _copy(tpu_artifact, tmp_path / "a")
    f = d / A.EXPORTED
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="truncated or altered"):
        A.verify(d)
    d = _copy(tpu_artifact, tmp_path / "b")
    f = d / A.EXECUTABLE
    b = bytearray(f.read_bytes())
    b[100] ^= 0xFF
    f.write_bytes(bytes(b))
    with pytest.raises(ArtifactError, match="sha256 .* does not match"):
        A.verify(d)


def test_missing_file(tpu_artifact, tmp_path):
    d = _copy(tpu_artifact, tmp_path)
    (d / A.EXPORTED).unlink()
    with pytest.raises(ArtifactError, match="missing file"):
        A.load(d)


def test_version_mismatch(cpu_artifact, tmp_path, monkeypatch):
    """Another stack loading the artifact (an edited manifest is refused earlier, naming the field:
    tests/test_artifact_trust.py)."""
    d = _copy(cpu_artifact, tmp_path)
    have = A.stack_versions()
    monkeypatch.setattr(A, "stack_versions", lambda: {**have, "jax": "0.0.1"})
    with pytest.raises(ArtifactError, match=f"built with jax {jax.__version__}, this environment has jax 0.0.1"):
        A.load(d)


def test_a_newer_jax_loads_the_exported_program_not_the_executable(cpu_artifact, tmp_path, monkeypatch):
    """The manifest's [loads]: the executable only under the same jax / jaxlib / libtpu, the
    jax.export program under the same jax or a newer one (jax.export's backward compatibility;
    an artifact of jax 0.10.2 ran under 0.11.2, docs/install.md). A newer stack here (jax and
    jaxlib 0.99) loads and runs the exported program; use='executable' is refused in one line
    that names use='exported'. An edited [loads] is refused as altered."""
    from artifact_helpers import edit_manifest

    from tpumk.export.checks import loads_of

    d = _copy(cpu_artifact, tmp_path)
    m = A.read_manifest(d)
    assert m["loads"] == loads_of(m["versions"]) and "or newer" in m["loads"]["exported"]
    have = A.stack_versions()
    monkeypatch.setattr(A, "stack_versions", lambda: {**have, "jax": "0.99.0", "jaxlib": "0.99.0"})
    step = A.load(d)  # a cpu artifact: "auto" takes the exported program
    assert step.kind.startswith("exported")
    with pytest.raises(ArtifactError, match=r"built with jax .*, this environment has jax 0.99.0: its "
                                            r"executable loads only under the same jax, jaxlib and libtpu; "
                                            r"use='exported' loads its jax.export program"):
        A.load(d, use="executable")
    monkeypatch.undo()
    edit_manifest(d, lambda m: m["loads"].update(exported="any jax"))
    with pytest.raises(ArtifactError, match="loads"):
        A.load(d)


def test_not_an_artifact_dir(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        A.load(tmp_path)
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        A.load(tmp_path / "nope")


@pytest.mark.parametrize("name, limit", [("a" * 256, 255), ("a/" * 2100, 4095)])
def test_a_path_the_os_refuses_is_one_line(tmp_path, name, limit):
    """A component over 255 bytes (or a path over 4095) is refused in one line, not an OSError
    (ENAMETOOLONG) traceback: `tpumk.load`, `verify` and `read_manifest` share the check."""
    for call in (A.load, A.verify, A.read_manifest):
        with pytest.raises(ArtifactError, match=rf"longer than the {limit} the OS accepts") as e:
            call(tmp_path / name)
        assert "\n" not in str(e.value)


def test_errors_are_one_line(tpu_artifact, tmp_path):
    with pytest.raises(ArtifactError) as e:
        A.load(tpu_artifact.path)
    assert "\n" not in str(e.value)


def test_cli_export_cache_hit_and_inspect(cpu_artifact, tpu_artifact, tmp_path):
    from tpumk.cli import main

    root = cpu_artifact.path.parents[2]
    args = ["export", "--model", "tiny-dense", "--target", "cpu", "--context", "32", "--out", str(root)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "cache hit, nothing compiled" in r.output and str(cpu_artifact.path) in r.output
    r = CliRunner().invoke(main, args + ["--json"])
    assert json.loads(r.output)["key"] == cpu_artifact.key
    # what the README's CI recipe relies on: cache-key names the directory export writes
    key_args = ["cache-key"] + args[1:]
    assert CliRunner().invoke(main, key_args).output.strip() == str(cpu_artifact.path)
    assert CliRunner().invoke(main, key_args[:-2]).output.strip() == cpu_artifact.key
    r = CliRunner().invoke(main, ["inspect", str(tpu_artifact.path)])
    assert r.exit_code == 0 and "TPU7x" in r.output and "files match the manifest's sha256" in r.output
    assert "the manifest itself is not authenticated (unsigned)" in r.output
    info = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(tpu_artifact.path)]).output)
    assert info["valid"] and info["key"] == tpu_artifact.key and set(info["files"]) == {A.EXECUTABLE, A.EXPORTED}
    bad = _copy(tpu_artifact, tmp_path)
    with open(bad / A.EXPORTED, "ab") as f:
        f.write(b"x")
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == 1 and "INVALID" in r.output and "truncated or altered" in r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "nothing")])
    assert r.exit_code == 1 and "not an artifact directory" in r.output


def test_load_checks_step_inputs_unless_told_not_to(cpu_artifact):
    """tpumk.load's step checks positions by default; check_inputs=False is the documented
    opt-out for serving loops that guarantee them (tests/test_positions.py checks the check)."""
    import jax.numpy as jnp

    from tpumk.errors import PositionError

    step = A.load(cpu_artifact.path)
    assert step.check_inputs
    cache = step.init_cache()
    bad = jnp.full((1, 1), CONTEXT, jnp.int32)  # one past the capacity
    with pytest.raises(PositionError):
        step(None, jnp.zeros((1, 1), jnp.int32), bad, cache)
    assert not A.load(cpu_artifact.path, check_inputs=False).check_inputs


@pytest.mark.parametrize("tail", ["big = " + "9" * 5000 + "\n", "deep = " + "[" * 5000 + "]" * 5000 + "\n",
                                  "\xff\xfe not text\n"])
def test_a_manifest_the_parser_refuses_is_one_line(cpu_artifact, tmp_path, tail):
    """A manifest with an integer longer than Python converts, nesting deeper than the TOML parser
    recurses, or bytes that are not UTF-8: load and verify say so in one line (no ValueError,
    RecursionError or UnicodeDecodeError escapes)."""
    d = _copy(cpu_artifact, tmp_path)
    mf = d / "manifest.toml"
    mf.write_bytes(mf.read_bytes() + tail.encode("latin-1"))
    for fn in (A.load, A.verify):
        with pytest.raises(ArtifactError) as e:
            fn(d)
        assert "\n" not in str(e.value) and "manifest" in str(e.value)


def test_output_signature_is_the_steps_output_shapes(cpu_artifact):
    """export records the step's outputs from the jax.export it already made (no third trace):
    the same as evaluating the step's shapes."""
    from tpumk.kernel.megakernel import make_decode_step, step_specs

    plan = A.plan_of(cpu_artifact.manifest)
    want = jax.eval_shape(make_decode_step(plan, portable=True), *step_specs(plan))
    assert json.loads(cpu_artifact.manifest["signature"]["outputs_json"]) == checks.tree_signature(want)


def test_load_plans_once(cpu_artifact, monkeypatch):
    """verify re-plans the key inputs to check the manifest; load and step.plan reuse that plan."""
    import tpumk.plan.plan as P

    calls, real = [], P.make_plan
    monkeypatch.setattr(P, "make_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    for use in ("exported", "executable"):
        calls.clear()
        step = A.load(cpu_artifact.path, use=use)
        assert step.plan.batch == 1 and len(calls) == 1, (use, len(calls))


def test_readme_quickstart_runs_as_written(cpu_artifact, tmp_path, monkeypatch, capsys):
    """README's Python quickstart, executed as written, in a directory where export wrote the
    artifact (the block after `<!-- quickstart -->`)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "artifacts").symlink_to(cpu_artifact.path.parents[2], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md quickstart", "exec"), {})
    cfg = load_preset("tiny-dense")
    assert capsys.readouterr().out.strip() == f"(1, 1, {cfg.vocab_size})"


# ---------------------------------------------------------------------- a hybrid model
# The smallest hybrid (issue 55): a Gated DeltaNet layer, then a gated attention layer.
HYBRID = dict(name="tiny-gdn", num_layers=2, linear_kind="gated_delta", linear_layers=(0,), linear_key_heads=1,
              linear_value_heads=2, linear_key_dim=128, linear_value_dim=128, linear_conv=4, attn_output_gate=True)


def _hybrid_export(out_dir, target: str):
    spec = BuildSpec(load_preset("tiny-dense").replace(**HYBRID), get_target(target), batch=2, context=CONTEXT,
                     tuning=TuningConfig(), q_len=1, page_size=PAGE)
    return A.export(spec, out_dir=out_dir)


@pytest.fixture(scope="module")
def hybrid_artifact(tmp_path_factory):
    return _hybrid_export(tmp_path_factory.mktemp("art"), "tpu7x")  # a deviceless compile: seconds


def test_a_hybrid_exports_its_state_pool(hybrid_artifact):
    """A hybrid's step takes and returns the cache's state pool: export records it in the step's
    signature (its shapes come from the plan: the key's model and shapes), the executable's
    pytrees are the plan's with it, and the portable program deserializes with the pool's
    pytree. Before: export stopped at 'executable pytrees ... differ from the plan's'."""
    from tpumk.kernel.megakernel import step_specs

    m = A.verify(hybrid_artifact.path)
    sig = [leaf["path"] for leaf in json.loads(m["signature"]["inputs_json"])]
    assert {"[3].states.recurrent", "[3].states.conv", "[3].states.pending", "[3].states.slots"} <= set(sig), sig
    plan = A.plan_of(m)
    portable = A._deserialize_exported(hybrid_artifact.path, m)
    assert portable.in_tree == jax.tree.structure((step_specs(plan), {}))
    assert "LinearStates" in m["signature"]["executable_out_tree"]


def test_a_loaded_hybrid_step_makes_and_checks_its_pool(hybrid_artifact):
    """`init_cache` makes the pool the kernel takes (the plan's slots, q_len pending rows: the
    kernel leaves every step's tokens pending); a call refuses a cache without the pool, a pool
    of other shapes and a slot two sequences share, each in one line before the program runs.
    (The loaded program itself: the cpu artifact below, `full`.) Before: init_cache made no
    pending rows, which the program cannot take."""
    from tpumk.model import reference as R

    calls: list = []
    bare = dict(hybrid_artifact.manifest, target={})  # a bare program: no TPU to place the arguments on
    step = A.DecodeStep(hybrid_artifact.path, bare, lambda *a: calls.append(a) or "ran", "test",
                        A.plan_of(hybrid_artifact.manifest))
    cache = step.init_cache()
    assert cache.states.pending_rows == 1 and cache.states.num_slots == step.plan.linear.num_slots == 2
    tokens, positions = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32)
    assert step(None, tokens, positions, cache) == "ran"
    wrong = R.init_cache(step.config, 2, CONTEXT, PAGE, pending=3)
    with pytest.raises(ArtifactError, match=r"cache.states.pending has shape \[1, 2, 3, 896\], this step takes "
                                            r"\[1, 2, 1, 896\] \(2 slots of q_len = 1 pending rows"):
        step(None, tokens, positions, wrong)
    with pytest.raises(ArtifactError, match="the model has linear-attention layers: the cache needs their state pool"):
        step(None, tokens, positions, cache._replace(states=None))
    shared = cache._replace(states=cache.states._replace(slots=jnp.asarray([1, 1], jnp.int32)))
    with pytest.raises(PositionError, match="sequences 0 and 1 both have state slot 1"):
        step(None, tokens, positions, shared)
    assert len(calls) == 1


@pytest.mark.full  # 30 s; the default run: the two tests above, and the kernel in tests/test_megakernel_linear.py
def test_a_hybrid_cpu_artifact_loads_and_generates_reference_tokens(tmp_path):
    """The cpu artifact of a hybrid loads (the serialized executable, and the portable program
    traced) and greedy-decodes the reference's tokens on the pool `init_cache` made."""
    import numpy as np

    from tpumk.model import reference as R
    from tpumk.model.weights import random_params

    art = _hybrid_export(tmp_path, "cpu")
    step = A.load(art.path, use="executable")
    cfg = step.config
    params = random_params(cfg, seed=0)
    packed = step.pack(params)
    prompts = [[3, 1, 4, 1, 5, 9], [5, 3, 5, 8, 9, 7]]  # one length: one prefill shape to compile
    want, _ = R.greedy_generate(params, cfg, prompts, 4, R.init_cache(cfg, 2, CONTEXT, PAGE, pending=1))
    got, cache = R.greedy_generate(params, cfg, prompts, 4, step.init_cache(),
                                   decode_fn=lambda t, p, c: step(packed, t, p, c))
    assert got == want
    assert np.asarray(cache.states.counts).tolist() == [1, 1]  # the last step's token left pending
    portable = A.load(art.path, use="exported").program
    _, out = jax.eval_shape(portable, packed, jnp.zeros((2, 1), jnp.int32), cache.lengths[:, None], cache)
    assert jax.tree.map(lambda a: a.shape, out.states) == jax.tree.map(lambda a: a.shape, cache.states)


def test_a_hybrid_manifest_s_state_pool_is_checked_against_its_plan(hybrid_artifact, tmp_path):
    """The build report's state pool (and the step's bytes by part) are plan figures: an edited
    one is refused naming the field, as every figure the key inputs decide."""
    from artifact_helpers import copy_artifact, edit_manifest

    rep = hybrid_artifact.manifest["report"]
    assert rep["state_pool"]["slots"] == 2 and rep["hbm_bytes_by_part"]["linear_states"] > 0
    d = copy_artifact(hybrid_artifact, tmp_path)

    def more_slots(m):
        full = json.loads(m["report_json"])
        full["state_pool"]["resident_bytes"] *= 2
        m["report_json"] = json.dumps(full, sort_keys=True)
        m["report"]["state_pool"]["resident_bytes"] *= 2
    edit_manifest(d, more_slots)
    with pytest.raises(ArtifactError, match=r"field 'report.state_pool.resident_bytes' = \d+ does not match the "
                                            r"plan's \d+ \(manifest altered\)"):
        A.verify(d)
