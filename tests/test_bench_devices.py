"""`tpumk bench --devices N`: the N-device megakernel beside XLA's SPMD step, by one measure.

Two deviceless benches of tiny presets on 4 TPU7x devices (about 10 s each): the figures agree
with the plan, the timeline model and the compiled programs they come from; the megakernel
program holds one Pallas kernel and no XLA collective, the XLA program some; the ratio and the
floor fractions follow from the step times; every figure names its source; refusals are one
line. The full-size rows of BENCHMARKS.md are `slow`."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from tpumk.cli import main
from tpumk.cli.bench import print_bench
from tpumk.compile.aot import count_xla_collectives
from tpumk.decode.bench import SpmdCompiles, compare, run_bench, xla_expert_parallel
from tpumk.decode.xla_spmd import compile_xla_spmd
from tpumk.errors import TargetError
from tpumk.estimate.hlo import parse_hlo
from tpumk.estimate.timeline import megakernel_step
from tpumk.model.config import load_preset
from tpumk.plan.knobs import TuningConfig
from tpumk.plan.plan import make_plan
from tpumk.plan.spec import BuildSpec
from tpumk.targets import get_target

TPU7X = get_target("tpu7x")


def _spec(preset: str, devices: int = 4, batch: int = 1, dtype: str | None = None, **tuning) -> BuildSpec:
    cfg = load_preset(preset)
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    return BuildSpec(cfg, TPU7X, batch, 4096, devices=devices, tuning=TuningConfig(**tuning))


DENSE_KV = dict(kv_tile_pages=16, kv_buffers=3)  # see `dense`


@pytest.fixture(scope="module")
def dense() -> dict:
    """bfloat16, so libtpu's static profile works and the compiler column has a figure; KV tiles
    of 16 pages: with the 8 the plan picks here (and the next-layer prefetch) libtpu 0.0.52's
    profiling compile aborts (an LLO check on a vnop operand, as on every MLA kernel) though the
    kernel itself compiles."""
    return run_bench(_spec("tiny-dense", dtype="bfloat16", **DENSE_KV), keep_hlo=True)


@pytest.fixture(scope="module")
def moe() -> dict:
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-moe", "--target", "tpu7x", "--devices", "4", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _check(r: dict, spec: BuildSpec) -> None:
    plan = make_plan(spec)
    kernel = megakernel_step(plan)
    mk, x = r["megakernel"], r["xla"]
    assert (r["devices"], r["topology"], r["batch"]) == (4, "tpu7x:2x2x1", spec.batch)
    # one Pallas kernel, every exchange inside it; XLA's program runs its own collectives
    assert mk["pallas_kernels"] == 1 and mk["xla_collectives"] == 0 and mk["xla_collectives_by_kind"] == {}
    assert x["pallas_kernels"] == 0 and x["xla_collectives"] > 0
    assert x["xla_collectives"] == sum(x["xla_collectives_by_kind"].values())
    assert mk["in_kernel_collectives"] == plan.collectives_per_step == 2 * plan.cfg.num_layers + 1  # + the logits all-gather
    # per-device figures: the plan's for the megakernel
    assert r["floor_seconds"] == pytest.approx(plan.floor_seconds)
    assert mk["hbm_bytes"] == pytest.approx(plan.hbm_bytes)
    assert mk["interconnect_bytes"] == pytest.approx(plan.interconnect_bytes) and x["interconnect_bytes"] > 0
    # the collective waits are the model's collectives stage of each program
    assert mk["collectives_seconds"] > 0 and x["collectives_seconds"] > 0
    assert mk["collectives_seconds"] == pytest.approx(kernel.stages["collectives"]["seconds"])
    # and no schedule or wire could take the same collectives below the floor printed beside them
    assert 0 < mk["collectives_floor_seconds"] == pytest.approx(kernel.collectives_floor_seconds)
    assert mk["collectives_floor_seconds"] <= mk["collectives_seconds"]
    assert x["collectives_seconds"] == pytest.approx(x["model"]["stages"]["collectives"]["seconds"])
    assert mk["model"]["stages"]["pallas: collectives"]["seconds"] == pytest.approx(mk["collectives_seconds"])
    # the ratio and the fractions follow from the two modelled steps
    assert r["speedup"] == pytest.approx(x["step_seconds"] / mk["step_seconds"])
    for side in (mk, x):
        assert side["measured"] is None and side["step_source"].startswith("MODEL, not measured")
        assert side["step_seconds"] == pytest.approx(side["model"]["seconds"])
        assert side["floor_fraction"] == pytest.approx(r["floor_seconds"] / side["step_seconds"])
        assert side["floor_with_collectives_fraction"] == pytest.approx(
            (r["floor_seconds"] + side["collectives_seconds"]) / side["step_seconds"])
    assert mk["step_seconds"] >= r["floor_seconds"]
    # every figure names where it comes from
    src = r["sources"]
    for key in ("compile_seconds", "floor_seconds", "hbm_bytes", "step_seconds", "collectives_seconds",
                "interconnect_bytes", "kernels", "xla_collectives", "floor_with_collectives_fraction", "speedup",
                "compiler_estimate"):
        assert src[key], key
    assert "interconnect model" in src["collectives_seconds"] and "not a bound" in src["floor_with_collectives_fraction"]
    assert "cost_analysis" in src["hbm_bytes"]["xla"] and "plan accounting" in src["hbm_bytes"]["megakernel"]
    assert r["tpu_attached"] is False


def test_dense_bench_on_four_devices(dense):
    _check(dense, _spec("tiny-dense", dtype="bfloat16"))
    assert dense["xla_sharding"]["expert_parallel"] is False


def test_moe_bench_through_the_cli(moe):
    _check(moe, _spec("tiny-moe"))
    assert moe["sharding"]["experts"]["mode"] == "expert_x_tensor"
    assert moe["xla_sharding"]["expert_parallel"] is False and "mixes 2 expert groups" in moe["xla_sharding"]["why"]


@pytest.mark.full  # tests/README.md: what covers it in the default run
def test_quantized_mla_bench_on_two_devices_prints_its_table(tmp_path):
    """An MLA model with quantized weights on 2 devices, through the CLI's table: XLA's SPMD step
    shards the absorbed w_uk / w_uv by head, and the table says how MLA splits (heads; q_a, kv_a
    and the latent cache replicated). Before: a KeyError ('w_uk') building the XLA step, then
    one ('q_heads_per_device') printing the table."""
    import tomli_w

    cfg = load_preset("tiny-mla").replace(name="mla-4h", num_q_heads=4, num_kv_heads=4, expert_ffn_size=256)
    path = tmp_path / "mla-4h.toml"
    path.write_bytes(tomli_w.dumps(cfg.to_dict()).encode())
    res = CliRunner().invoke(main, ["bench", "--model", str(path), "--target", "tpu7x", "--devices", "2",
                                    "--quant", "int8"])
    assert res.exit_code == 0, res.output
    assert "megakernel sharding: 2 heads per device, q_a, q_a_norm, kv_a, kv_a_norm and the latent cache" in res.stdout
    assert re.search(r"XLA SPMD step / megakernel step: [\d.]+x", res.stdout)


def test_xla_column_is_the_xla_spmd_program(dense):
    """The XLA column's collectives are those of compile_xla_spmd's program for the same shapes."""
    prog = compile_xla_spmd(load_preset("tiny-dense").replace(dtype="bfloat16"), 1, 4096, 1, TPU7X, 4)
    assert dense["xla"]["xla_collectives_by_kind"] == prog.collectives
    assert dense["xla"]["hbm_bytes"] == pytest.approx(prog.compiled.cost_analysis()["bytes accessed"])


def test_compiler_profile_is_its_own_column(dense, moe):
    from estimate_support import COMPILER_ESTIMATE, NO_PROFILER

    est = dense["compiler_estimate"]
    if not COMPILER_ESTIMATE:  # the column says why this libtpu gives none, for both models
        assert [(c["compiler_estimate"]["step_seconds"], c["compiler_estimate"]["source"].startswith(NO_PROFILER))
                for c in (dense, moe)] == [(None, True)] * 2
        return
    assert est["step_seconds"] > 0 and est["source"].startswith("TPU compiler static profile")
    assert est["floor_fraction"] == pytest.approx(dense["floor_seconds"] / est["step_seconds"])
    assert any("not comparable with the XLA column" in n for n in est["notes"])
    # float32: libtpu's profiler aborts; the column says why instead of a figure
    assert moe["compiler_estimate"]["step_seconds"] is None and "float32" in moe["compiler_estimate"]["source"]


def test_compare_reruns_the_model_from_kept_programs(dense):
    c = dense["compiles"]
    assert count_xla_collectives(c["megakernel_hlo"]) == 0 and count_xla_collectives(c["xla_hlo"]) > 0
    again = compare(make_plan(_spec("tiny-dense", dtype="bfloat16", **DENSE_KV)), SpmdCompiles(**c))
    assert again["speedup"] == pytest.approx(dense["speedup"])
    assert again["compiler_estimate"]["step_seconds"] == pytest.approx(dense["compiler_estimate"]["step_seconds"])


def test_megakernel_model_sees_the_ops_after_the_kernel(dense):
    """A many-device kernel's frontend_attributes span lines, the last starting with "}": the
    HLO reader must not take it for the computation's end, or every op after the kernel (the
    cache copies, the logits slice) escapes the model."""
    text = dense["compiles"]["megakernel_hlo"]
    assert '"mesh_axes"' in text  # the multi-line kernel_metadata is there
    comps, entry = parse_hlo(text)
    names = [i.name for i in comps[entry]]
    kernel = next(k for k, i in enumerate(comps[entry]) if i.opcode == "custom-call"
                  and "tpu_custom_call" in (i.attr("custom_call_target") or ""))
    assert comps[entry][-1].root and kernel < len(names) - 1
    body = text[text.index("ENTRY"):]
    assert len(names) == sum(1 for ln in body.splitlines() if re.match(r"\s*(ROOT\s+)?%[^\s=]+\s*=", ln))


def test_hlo_reader_joins_an_attribute_across_lines():
    text = ("HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
            "  %k = f32[8]{0} custom-call(%p), custom_call_target=\"tpu_custom_call\", "
            "frontend_attributes={kernel_metadata={\n\"mesh_axes\":\"[\\\"tp\\\"]\"\n}}, metadata={op_name=\"k\"}\n"
            "  ROOT %c = f32[8]{0} copy(%k)\n}\n")
    comps, entry = parse_hlo(text)
    assert [i.name for i in comps[entry]] == ["p", "k", "c"] and comps[entry][-1].root


def test_text_table_names_every_column(dense, capsys):
    print_bench(dense)
    out = capsys.readouterr().out
    assert "megakernel (MODEL)" in out and "XLA SPMD (MODEL)" in out and "megakernel (compiler profile)" in out
    assert "XLA SPMD step / megakernel step" in out and "no TPU measured anything" in out
    assert "(floor + collectives) / step" in out and "interconnect model" in out
    assert "least with any schedule and wire" in out


def test_xla_expert_split_follows_the_plan():
    assert xla_expert_parallel(make_plan(_spec("tiny-dense")))[0] is False
    assert xla_expert_parallel(make_plan(_spec("tiny-moe", expert_parallel=4))) == (
        True, "expert parallel, as the megakernel's plan (each device owns 2 experts)")
    ep, why = xla_expert_parallel(make_plan(_spec("tiny-moe", devices=2)))  # auto: expert-tensor
    assert ep is False and why.startswith("expert-tensor parallel, as the megakernel's plan")


def test_devices_that_do_not_divide_the_heads_are_one_line():
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-dense", "--target", "tpu7x", "--devices", "3", "--json"])
    assert res.exit_code == 1 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpumk: error: sharding: devices = 3: expected a divisor of "
                                                   "num_q_heads (4)"), res.stderr


def test_timing_many_devices_is_refused_in_one_line():
    with pytest.raises(TargetError) as e:
        run_bench(_spec("tiny-dense"), measure=True)
    assert "devices = 4: on-device timing is implemented for one device only" in str(e.value)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.slow
def test_qwen3_235b_on_32_devices():
    """The issue's row (deviceless, about 2 minutes here): one kernel, no XLA collective."""
    spec = BuildSpec(load_preset("qwen3-235b-a22b"), TPU7X, 1, 4096, devices=32)
    r = run_bench(spec, compiler_estimate=False)
    assert r["megakernel"]["pallas_kernels"] == 1 and r["megakernel"]["xla_collectives"] == 0
    assert r["xla"]["xla_collectives"] > 0 and r["topology"] == "tpu7x:4x4x1"
    assert r["speedup"] == pytest.approx(r["xla"]["step_seconds"] / r["megakernel"]["step_seconds"])
    assert r["compiler_estimate"]["source"] == "none: not requested"
