"""`tpumk bench`: the megakernel step side by side with the XLA-compiled step (tpumk.decode.bench)."""

from __future__ import annotations

import click
from tabulate import tabulate

from tpumk.cli.options import echo, emit_json, fail_cleanly, spec_options
from tpumk.cli.units import duration, size


def _ms(s: float, scale_of: float | None = None) -> str:
    return duration(s, scale_of=scale_of)


def _bytes(n: float, scale_of: float | None = None) -> str:
    return size(n, scale_of=scale_of, digits=3)


def print_bench(r: dict) -> None:
    if r.get("devices", 1) > 1:
        print_bench_devices(r)
        return
    mk, x = r["megakernel"], r["xla"]
    measured = mk["measured"] is not None
    how = "measured on device" if measured else "MODEL (no TPU attached)"
    fmt = f", {r['quant']} weights (both steps)" if r.get("quant", "none") != "none" else ""
    echo(f"bench {r['model']} on {r['target']}: batch {r['batch']}, q_len {r['q_len']}, context {r['context']}, "
               f"{r['dtype']}{fmt}")
    tps = r["tokens_per_second"]
    sv = r.get("serving")
    # one unit per row: the largest figure of the row picks it
    nb = max(mk["hbm_bytes"], x["hbm_bytes"], sv["hbm_bytes"] if sv else 0)
    st = max(mk["step_seconds"], x["step_seconds"], sv["step_seconds"] if sv else 0)
    rows = [
        ["compile (this host, measured)", f"{mk['compile_seconds']:.2f} s", f"{x['compile_seconds']:.2f} s"],
        ["HBM bytes per step", f"{_bytes(mk['hbm_bytes'], nb)} (plan)", f"{_bytes(x['hbm_bytes'], nb)} (cost_analysis)"],
        ["HBM floor (plan bytes / bandwidth)", _ms(r["floor_seconds"]), _ms(r["floor_seconds"])],
        ["kernels launched (HLO ops)", f"{mk['kernels']} ({mk['hlo_ops']})", f"{x['kernels']} ({x['hlo_ops']})"],
        [f"step time, {how}", _ms(mk["step_seconds"], st), _ms(x["step_seconds"], st)],
        ["fraction of the HBM floor", f"{mk['floor_fraction']:.2f}", f"{x['floor_fraction']:.2f}"],
        ["tokens/s per sequence", f"{tps['megakernel']['per_sequence']:,.0f}", f"{tps['xla']['per_sequence']:,.0f}"],
        ["tokens/s aggregate", f"{tps['megakernel']['aggregate']:,.0f}", f"{tps['xla']['aggregate']:,.0f}"],
    ]
    headers = ["", "megakernel", "XLA"]
    if sv:  # the serving-stack column (XLA + jax's ragged paged attention), always by the model
        headers.append("XLA + ragged paged attn")
        for row, cell in zip(rows, [f"{sv['compile_seconds']:.2f} s", f"{_bytes(sv['hbm_bytes'], nb)} (cost_analysis, "
                                    "w/o Pallas)", _ms(r["floor_seconds"]), f"{sv['kernels']} ({sv['hlo_ops']})",
                                    _ms(sv["step_seconds"], st) + ("" if not measured else " (MODEL)"),
                                    f"{sv['floor_fraction']:.2f}", f"{tps['serving']['per_sequence']:,.0f}",
                                    f"{tps['serving']['aggregate']:,.0f}"]):
            row.append(cell)
    echo(tabulate(rows, headers=headers, tablefmt="simple"))
    echo(f"XLA step / megakernel step: {r['speedup']:.2f}x ({how}, the same measure for both)")
    if sv:
        b = r["serving_blocks"]
        echo(f"serving-stack step / megakernel step: {r['speedup_vs_serving']:.2f}x (MODEL for the serving "
                   f"step; ragged paged attention with {b['num_kv_pages_per_block']} KV pages and "
                   f"{b['num_queries_per_block']} queries per block)")
    if r.get("serving_refused"):
        echo(f"serving-stack column (XLA + ragged paged attention): {r['serving_refused']}")
    echo(f"layouts: megakernel: {r['layouts']['megakernel']}; XLA: {r['layouts']['xla']}"
               + (f"; serving: {r['layouts']['serving']}" if sv else ""))
    if measured:
        echo(f"step times: {mk['step_source']}")
    else:
        echo("step times are tpumk's timeline model of each compiled program (tpumk.estimate.timeline), NOT "
                   "measurements; the TPU compiler's static profile is not used (it is not comparable between a "
                   "Pallas kernel and an XLA program).")
        echo(f"model: {r['model_constants']}")
    v = r.get("verify")
    if v and v["feasible"]:
        echo(f"verify step (q = {v['q_len']}: {v['draft_tokens']} drafts + 1): {_bytes(v['hbm_bytes'])}, floor "
                   f"{_ms(v['floor_seconds'])}, kernel {_ms(v['kernel_seconds'])} vs plain {_ms(v['plain_kernel_seconds'])}"
                   f" = {v['cost_vs_plain']:.3f}x (MODEL): speculation pays off above a mean acceptance length of "
                   f"{v['cost_vs_plain']:.2f} tokens per step, drafting aside")
    elif v:
        echo(f"verify step (q = {v['q_len']}): does not plan: {v['reason']}")
    if r.get("model_check"):
        c = r["model_check"]
        echo(f"model check: the published TPU7x ring (12 x 2 MiB, 76 MiB/layer) modelled at "
                   f"{c['predicted_seconds'] * 1e6:.1f} us/layer vs 26.4 us measured on chip ({c['ratio']:.2f}x)")


def _kinds(side: dict) -> str:
    by = side["xla_collectives_by_kind"]
    return f"{side['xla_collectives']}" + (f" ({', '.join(f'{v} {k}' for k, v in sorted(by.items()))})" if by else "")


def print_bench_devices(r: dict) -> None:
    """The N-device table: three columns, each named by what produced its step time."""
    mk, x, est = r["megakernel"], r["xla"], r["compiler_estimate"]
    n = r["devices"]
    echo(f"bench {r['model']} on {n} x {r['target']} ({r['topology']}): batch {r['batch']}, q_len {r['q_len']}, "
               f"context {r['context']}, {r['page_size']}-token pages, {r['dtype']}; every figure per device")
    tps = r["tokens_per_second"]
    est_s = est["step_seconds"]
    # one unit per row: the largest figure of the row picks it
    nb, ib = max(mk["hbm_bytes"], x["hbm_bytes"]), max(mk["interconnect_bytes"], x["interconnect_bytes"])
    ct = max(mk["collectives_seconds"], x["collectives_seconds"])
    st = max(mk["step_seconds"], x["step_seconds"], est_s or 0)
    rows = [
        ["compile (this host, measured)", f"{mk['compile_seconds']:.2f} s", f"{x['compile_seconds']:.2f} s", ""],
        ["HBM bytes per step", f"{_bytes(mk['hbm_bytes'], nb)} (plan)", f"{_bytes(x['hbm_bytes'], nb)} (cost_analysis)", ""],
        ["HBM floor (plan bytes / bandwidth)", _ms(r["floor_seconds"]), _ms(r["floor_seconds"]), _ms(r["floor_seconds"])],
        ["Pallas kernels / kernels launched (HLO ops)", f"{mk['pallas_kernels']} / {mk['kernels']} ({mk['hlo_ops']})",
         f"{x['pallas_kernels']} / {x['kernels']} ({x['hlo_ops']})", ""],
        ["XLA collective ops per step", _kinds(mk), _kinds(x), ""],
        ["in-kernel collectives per step (all-reduces + logits all-gather)", f"{mk['in_kernel_collectives']}", "0", ""],
        ["interconnect bytes sent per step", _bytes(mk["interconnect_bytes"], ib) + " (plan)",
         _bytes(x["interconnect_bytes"], ib) + " (model)", ""],
        ["collectives (modelled waits)", _ms(mk["collectives_seconds"], ct), _ms(x["collectives_seconds"], ct), ""],
        ["  least with any schedule and wire", _ms(mk["collectives_floor_seconds"], ct), "", ""],
        ["step time", _ms(mk["step_seconds"], st), _ms(x["step_seconds"], st), _ms(est_s, st) if est_s else "none"],
        ["fraction of the HBM floor", f"{mk['floor_fraction']:.2f}", f"{x['floor_fraction']:.2f}",
         f"{est['floor_fraction']:.2f}" if est_s else "none"],
        ["(floor + collectives) / step", f"{mk['floor_with_collectives_fraction']:.2f}",
         f"{x['floor_with_collectives_fraction']:.2f}", ""],
        ["tokens/s per sequence", f"{tps['megakernel']['per_sequence']:,.0f}", f"{tps['xla']['per_sequence']:,.0f}", ""],
        ["tokens/s aggregate", f"{tps['megakernel']['aggregate']:,.0f}", f"{tps['xla']['aggregate']:,.0f}", ""],
    ]
    echo(tabulate(rows, headers=["", "megakernel (MODEL)", "XLA SPMD (MODEL)", "megakernel (compiler profile)"],
                        tablefmt="simple"))
    echo(f"XLA SPMD step / megakernel step: {r['speedup']:.2f}x (tpumk's timeline model for both, the same "
               f"measure; no TPU measured anything)")
    echo("(floor + collectives) / step: (HBM floor + the program's modelled collective waits) / its modelled step; "
               "a yardstick, not a bound (the model lets the weight ring load during the waits)")
    echo(f"compiler profile column: {est['source']}")
    s = r["sharding"]
    a = s["attention"]
    if "heads_per_device" in a:  # MLA: heads split, the latent cache on every device
        parts = [f"{a['heads_per_device']} heads per device, {', '.join(a['replicated'])} and the latent cache replicated"
                 + (", q_a / kv_a split by columns (the latent all-gathered)" if "split_by_columns" in a else "")]
    else:
        parts = [f"{a['q_heads_per_device']} query / {a['kv_heads_per_device']} KV heads per device"
                 f" (KV replicated {a['kv_replicas']}x)"]
    if "experts" in s:
        e = s["experts"]
        parts.append(f"experts {e['mode']} ({e['expert_parallel']} groups x {e['expert_tensor']}-way width)")
    echo(f"megakernel sharding: {'; '.join(parts)}; all-reduce {mk['all_reduce']['schedule']}")
    xs = r["xla_sharding"]
    echo("XLA SPMD sharding: Megatron-style (tpumk.model.xla_spmd)" + (f"; experts: {xs['why']}" if "experts" in s
                                                                               else ""))
    for note in xs["notes"] + r["notes"]:
        echo(f"note: {note}")
    echo(f"step times: {r['model_constants']}")
    echo(r["interconnect_constants"])
    v = r.get("verify")
    if v and v["feasible"]:
        echo(f"verify step (q = {v['q_len']}): kernel {_ms(v['kernel_seconds'])} vs plain "
                   f"{_ms(v['plain_kernel_seconds'])} = {v['cost_vs_plain']:.3f}x (MODEL)")
    elif v:
        echo(f"verify step (q = {v['q_len']}): does not plan: {v['reason']}")
    c = r.get("collective_check")
    if c:
        echo(f"model check: the published TPU7x collective pattern (8 devices, 2 all-reduces per layer) modelled "
                   f"at {c['layer_seconds'] * 1e6:.1f} us/layer vs {c['published_layer_seconds'] * 1e6:.0f} us "
                   f"published ({c['ratio']:.2f}x)")


# The published batch curve this one is compared with: Kimi K2 on 16 TPU7x chips without
# speculation, 249 / 392 / 515 / 865 tok/s at batch 1 / 2 / 4 / 8 (measured on chips; the seeds).
PUBLISHED_CURVE = {"what": "Kimi K2 on 16 TPU7x chips, no speculation (published, measured on chips)",
                   "tokens_per_second": {1: 249, 2: 392, 4: 515, 8: 865}}


def parse_batches(text: str) -> list[int]:
    """`--batch-curve 1,2,4,8`: distinct positive integers, in the order given."""
    from tpumk.errors import ConfigError

    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out) or len(set(out)) != len(out):
        raise ConfigError(f"--batch-curve {text!r}: expected distinct positive batch sizes separated by commas "
                          "(e.g. 1,2,4,8,16,32)")
    return out


def curve_row(r: dict) -> dict:
    """One batch of the curve: the figures a person compares across batches."""
    tps, mk, x = r["tokens_per_second"], r["megakernel"], r["xla"]
    row = {"batch": r["batch"], "step_seconds": {"megakernel": mk["step_seconds"], "xla": x["step_seconds"]},
           "aggregate": {"megakernel": tps["megakernel"]["aggregate"], "xla": tps["xla"]["aggregate"]},
           "per_sequence": {"megakernel": tps["megakernel"]["per_sequence"], "xla": tps["xla"]["per_sequence"]},
           "floor_fraction": {"megakernel": mk["floor_fraction"], "xla": x["floor_fraction"]},
           "xla_over_megakernel": r["speedup"], "hbm_bytes": mk["hbm_bytes"],
           "step_source": "measured on device" if mk.get("measured") else "tpumk model"}
    if r.get("serving"):
        sv = r["serving"]
        row["step_seconds"]["serving"] = sv["step_seconds"]
        row["aggregate"]["serving"] = tps["serving"]["aggregate"]
        row["per_sequence"]["serving"] = tps["serving"]["per_sequence"]
        row["floor_fraction"]["serving"] = sv["floor_fraction"]
    return row


def curve_summary(rows: list[dict]) -> dict:
    """The megakernel's aggregate rate at each batch over batch 1's, beside the published curve's."""
    by = {r["batch"]: r["aggregate"]["megakernel"] for r in rows}
    pub = PUBLISHED_CURVE["tokens_per_second"]
    if 1 not in by:
        return {}
    return {"aggregate_over_batch_1": {b: by[b] / by[1] for b in sorted(by)},
            "published_over_batch_1": {b: pub[b] / pub[1] for b in sorted(pub) if b in by},
            "published": PUBLISHED_CURVE["what"]}


def print_curve(rows: list[dict], head: str) -> None:
    serving = all("serving" in r["aggregate"] for r in rows)
    summary = curve_summary(rows)
    ratio = summary.get("aggregate_over_batch_1", {})
    pub = summary.get("published_over_batch_1", {})
    table = []
    for r in rows:
        a, q, f, st = r["aggregate"], r["per_sequence"], r["floor_fraction"], r["step_seconds"]
        line = [r["batch"], _ms(st["megakernel"]), _ms(st["xla"]), f"{a['megakernel']:,.0f}", f"{a['xla']:,.0f}"]
        if serving:
            line.append(f"{a['serving']:,.0f}")
        line += [f"{q['megakernel']:,.0f}", f"{f['megakernel']:.2f} / {f['xla']:.2f}", f"{r['xla_over_megakernel']:.2f}x",
                 f"{ratio[r['batch']]:.2f}x" if r["batch"] in ratio else "", f"{pub[r['batch']]:.2f}x" if r["batch"] in pub
                 else ""]
        table.append(line)
    headers = ["batch", "step mk", "step XLA", "tok/s aggregate mk", "XLA"] + (["serving"] if serving else []) + \
        ["tok/s per seq mk", "floor fraction mk / XLA", "XLA / mk", "aggregate / batch 1", "published / batch 1"]
    echo(head)
    echo(tabulate(table, headers=headers, tablefmt="simple"))
    sources = sorted({r["step_source"] for r in rows})
    echo(f"step times: {', '.join(sources)} for every column" + ("" if sources != ["tpumk model"] else
         " (tpumk's timeline model of each compiled program, NOT measurements)"))
    if pub:
        echo(f"published / batch 1: {summary['published']}")


def parse_acceptance(text: str) -> list[float]:
    """`--acceptance 3,6`: mean acceptance lengths (numbers; their range is the drafter's, checked
    by the round's model)."""
    from tpumk.errors import ConfigError

    try:
        out = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out:
        raise ConfigError(f"--acceptance {text!r}: expected mean acceptance lengths (tokens committed per verify "
                          "step) separated by commas, e.g. 3,6")
    return out


def default_acceptance(k: int) -> list[float]:
    """2, 3 and k + 1 (every draft accepted), those at most k + 1."""
    return sorted({a for a in (2.0, 3.0, float(k + 1)) if a <= k + 1})


# options of the compiled bench that a modelled round does not use: refused beside --draft
NOT_WITH_DRAFT = ("runs", "warmup", "verify_q", "serving", "compiler_estimate", "batch_curve", "q_len")


def draft_round(spec, draft: str, acceptance: str | None) -> dict:
    """`bench --draft`: the speculative round by tpumk's timeline model (plans only, nothing compiled)."""
    from tpumk.decode import drafted
    from tpumk.estimate.speculative import round_model

    spec.validate()
    d = drafted.describe(draft, spec.model)
    acc = parse_acceptance(acceptance) if acceptance is not None else default_acceptance(d.block)
    r = round_model(spec, d, acc)
    head = {"model": spec.model.name, "target": spec.target.name, "devices": spec.devices, "batch": spec.batch,
            "context": spec.context, "page_size": spec.page_size, "dtype": spec.model.dtype, "quant": spec.quant,
            "draft": draft.strip()}
    return {**head, **r}


def print_draft_round(r: dict) -> None:
    d = r["drafter"]
    on = f"{r['devices']} x {r['target']}" if r["devices"] > 1 else r["target"]
    fmt = f", {r['quant']} weights" if r.get("quant", "none") != "none" else ""
    echo(f"speculative round: {r['model']} on {on}, batch {r['batch']}, context {r['context']}, {r['dtype']}{fmt}")
    echo(f"drafter {r['draft']}: {d['kind']}, {d['layers']} layers of hidden {d['hidden']}, draft vocabulary "
         f"{d['draft_vocab']:,}, {d['block']} drafts per round, taps {d['taps']}")
    k, t = d["block"], r["round_seconds"]
    how = "pass kernel" if d["runs"] == "kernel" else "XLA passes"
    on_dev = f"{how}, replicated on {r['devices']} devices" if r["devices"] > 1 else how
    steps = [
        ["plain step (q = 1)", _ms(r["plain_step_seconds"], t), ""],
        [f"verify step (q = {k + 1}, {len(d['taps'])} taps)", _ms(r["verify_step_seconds"], t),
         f"{_bytes(r['verify_hbm_bytes'])} HBM, taps {_bytes(r['verify_taps_bytes'])}"],
        [f"drafter passes ({d['passes_per_round']} x {d['rows_per_pass']} row{'s' if d['rows_per_pass'] > 1 else ''})",
         _ms(d["passes_per_round"] * d["pass_seconds"], t), f"{_bytes(d['pass_hbm_bytes'])} HBM a pass, {on_dev}"],
        ["taps' projection weights", _ms(d["projection_seconds"], t), "read once a round"],
        *([["drafter weight packing", _ms(d["pack_seconds"], t),
            f"once a device call of {d['rounds_per_call']} rounds"]] if d["pack_seconds"] else []),
        ["round (verify + draft)", _ms(t, t), ""],
    ]
    echo(tabulate(steps, headers=["per device", "time (MODEL)", ""], tablefmt="simple"))
    rows = [["plain step", "1", f"{r['plain']['per_sequence']:,.0f}", f"{r['plain']['aggregate']:,.0f}", "1.00x"]]
    for row in r["rows"]:
        rows.append(["round", f"{row['acceptance']:g}", f"{row['per_sequence']:,.0f}", f"{row['aggregate']:,.0f}",
                     f"{row['speedup']:.2f}x"])
    echo(tabulate(rows, headers=["", "mean acceptance length", "accepted tok/s per sequence", "tok/s aggregate",
                                 "over the plain step"], tablefmt="simple"))
    echo(f"break-even: a mean acceptance length of {r['break_even_acceptance']:.2f} tokens per round (round time / "
         f"plain step; at most {k + 1})")
    for note in r["notes"]:
        echo(f"note: {note}")
    echo(f"every time and rate above: {r['source']} (no TPU); nothing was compiled")


@click.command()
@spec_options()
@click.option("--runs", default=10, show_default=True, help="Timed runs per step when a TPU is attached (median).")
@click.option("--warmup", default=3, show_default=True, help="Untimed runs first when a TPU is attached.")
@click.option("--verify-q", default=8, show_default=True,
              help="Also model the speculative verify step with this q_len (K drafts + 1); 0: off.")
@click.option("--serving/--no-serving", default=True, show_default=True,
              help="Also build the serving-stack step (XLA + jax's ragged paged attention kernel), one device only.")
@click.option("--compiler-estimate/--no-compiler-estimate", default=True, show_default=True,
              help="With --devices N: also run the megakernel's profiling compile for the compiler's column.")
@click.option("--batch-curve", "batch_curve", metavar="B1,B2,...", default=None,
              help="Bench each of these batch sizes (instead of --batch) and print the batch curve: step, tok/s "
                   "aggregate and per sequence, floor fraction, beside XLA and the serving stack, and the aggregate "
                   "over batch 1's beside the published TPU7x curve.")
@click.option("--draft", "draft", metavar="KIND[:SHAPE]",
              help="Model a speculative round with this drafter instead (plans only, nothing compiled): "
                   "eagle3, dflash, dflash2, dspark or mtp, :key=value,... its shape (e.g. dspark:layers=5,heads=96,"
                   "kv_heads=16,head_dim=64,ffn=14336,taps=5,block_size=8), :random, :DIR (a speculators "
                   "directory's config.json); mtp alone: a next-token layer of the target's own kind.")
@click.option("--acceptance", metavar="A1,A2,...", default=None,
              help="With --draft: mean acceptance lengths (tokens committed per verify step, 1 to drafts + 1). "
                   "Default: 2, 3 and drafts + 1.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def bench(spec, runs, warmup, verify_q, serving, compiler_estimate, batch_curve, draft, acceptance, as_json):
    """The megakernel decode step side by side with the same step compiled by XLA, and with the
    serving-stack step (XLA plus jax's ragged paged attention Pallas kernel).

    With --devices N: the N-device megakernel beside XLA's SPMD step on the same devices, both
    by tpumk's timeline model (collectives included), per device.

    With --draft: the speculative round instead (the plain step, the verify step with the
    drafter's taps, the drafter's passes, accepted tokens/s at each --acceptance), by tpumk's
    timeline model of the plans; nothing is compiled."""
    from tpumk.decode.bench import run_bench
    from tpumk.errors import ConfigError

    if draft is None and acceptance is not None:
        raise ConfigError("--acceptance: only with --draft (the mean acceptance lengths of its rounds)")
    if draft is not None:
        from click.core import ParameterSource

        ctx = click.get_current_context()
        given = [f"--{n.replace('_', '-')}" for n in NOT_WITH_DRAFT
                 if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]
        if given:
            raise ConfigError(f"{', '.join(given)}: not with --draft (it models the round from the plans; the "
                              "verify step's q is the drafter's drafts + 1)")
        r = draft_round(spec, draft, acceptance)
        if as_json:
            emit_json(r)
        else:
            print_draft_round(r)
        return

    if runs < 1 or warmup < 0:
        raise ConfigError(f"--runs must be >= 1 and --warmup >= 0 (got {runs}, {warmup})")
    if verify_q < 0 or verify_q == 1:
        raise ConfigError(f"--verify-q: expected 0 (off) or at least 2 tokens per sequence, got {verify_q}")
    if batch_curve is not None:
        from tpumk.cli.progress import Phases
        from tpumk.plan.plan import make_plan

        specs = [spec.replace(batch=b) for b in parse_batches(batch_curve)]
        for s_ in specs:  # every batch's shape and plan checked before the first compile
            s_.validate()
            make_plan(s_)
        phases, rows = Phases("tpumk bench"), []
        for s_ in specs:
            phases(f"batch {s_.batch} (megakernel, XLA{', serving' if serving and spec.devices == 1 else ''})")
            rows.append(curve_row(run_bench(s_, warmup=warmup, runs=runs, verify_q=0, serving=serving,
                                            compiler_estimate=compiler_estimate)))
        phases.done()
        on = f"{spec.devices} x {spec.target.name}" if spec.devices > 1 else spec.target.name
        if as_json:
            emit_json({"model": spec.model.name, "target": spec.target.name, "devices": spec.devices,
                       "context": spec.context, "q_len": spec.q_len, "quant": spec.quant, "curve": rows,
                       **curve_summary(rows)})
        else:
            print_curve(rows, f"batch curve: {spec.model.name} on {on}, context {spec.context}, "
                              f"{spec.model.dtype}" + (f", {spec.quant} weights" if spec.quant != "none" else ""))
        return
    r = run_bench(spec, warmup=warmup, runs=runs, verify_q=verify_q, serving=serving,
                  compiler_estimate=compiler_estimate)
    if as_json:
        emit_json(r)
    else:
        print_bench(r)
