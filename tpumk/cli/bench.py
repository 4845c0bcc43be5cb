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
    parts = [f"{s['attention']['q_heads_per_device']} query / {s['attention']['kv_heads_per_device']} KV heads per device"
             f" (KV replicated {s['attention']['kv_replicas']}x)"]
    if "experts" in s:
        e = s["experts"]
        parts.append(f"experts {e['mode']} ({e['expert_parallel']} groups x {e['expert_tensor']}-way width)")
    echo(f"megakernel sharding: {'; '.join(parts)}; all-reduce {mk['all_reduce']['schedule']}")
    xs = r["xla_sharding"]
    echo("XLA SPMD sharding: Megatron-style (tpumk.decode.xla_spmd)" + (f"; experts: {xs['why']}" if "experts" in s
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


@click.command()
@spec_options()
@click.option("--runs", default=10, show_default=True, help="Timed runs per step when a TPU is attached (median).")
@click.option("--warmup", default=3, show_default=True, help="Untimed runs first when a TPU is attached.")
@click.option("--verify-q", default=8, show_default=True,
              help="Also model the speculative verify step with this q_len (K drafts + 1); 0: off.")
@click.option("--serving/--no-serving", default=True, show_default=True,
              help="Also build the serving-stack step (XLA + jax's ragged paged attention kernel), one device only.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def bench(spec, runs, warmup, verify_q, serving, as_json):
    """The megakernel decode step side by side with the same step compiled by XLA, and with the
    serving-stack step (XLA plus jax's ragged paged attention Pallas kernel).

    With --devices N: the N-device megakernel beside XLA's SPMD step on the same devices, both
    by tpumk's timeline model (collectives included), per device."""
    from tpumk.decode.bench import run_bench
    from tpumk.errors import ConfigError

    if runs < 1 or warmup < 0:
        raise ConfigError(f"--runs must be >= 1 and --warmup >= 0 (got {runs}, {warmup})")
    if verify_q < 0 or verify_q == 1:
        raise ConfigError(f"--verify-q: expected 0 (off) or at least 2 tokens per sequence, got {verify_q}")
    r = run_bench(spec, warmup=warmup, runs=runs, verify_q=verify_q, serving=serving)
    if as_json:
        emit_json(r)
    else:
        print_bench(r)
