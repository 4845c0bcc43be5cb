"""`tpumk bench`: the megakernel step side by side with the XLA-compiled step (tpumk.decode.bench)."""

from __future__ import annotations

import click
from tabulate import tabulate

from tpumk.cli.options import emit_json, fail_cleanly, spec_options


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def _bytes(n: float) -> str:
    return f"{n / 1e9:,.3f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def print_bench(r: dict) -> None:
    mk, x = r["megakernel"], r["xla"]
    measured = mk["measured"] is not None
    how = "measured on device" if measured else "MODEL (no TPU attached)"
    click.echo(f"bench {r['model']} on {r['target']}: batch {r['batch']}, q_len {r['q_len']}, context {r['context']}, "
               f"{r['dtype']}")
    tps = r["tokens_per_second"]
    rows = [
        ["compile (this host, measured)", f"{mk['compile_seconds']:.2f} s", f"{x['compile_seconds']:.2f} s"],
        ["HBM bytes per step", f"{_bytes(mk['hbm_bytes'])} (plan)", f"{_bytes(x['hbm_bytes'])} (cost_analysis)"],
        ["HBM floor (plan bytes / bandwidth)", _ms(r["floor_seconds"]), _ms(r["floor_seconds"])],
        ["kernels launched (HLO ops)", f"{mk['kernels']} ({mk['hlo_ops']})", f"{x['kernels']} ({x['hlo_ops']})"],
        [f"step time, {how}", _ms(mk["step_seconds"]), _ms(x["step_seconds"])],
        ["fraction of the HBM floor", f"{mk['floor_fraction']:.2f}", f"{x['floor_fraction']:.2f}"],
        ["tokens/s per sequence", f"{tps['megakernel']['per_sequence']:,.0f}", f"{tps['xla']['per_sequence']:,.0f}"],
        ["tokens/s aggregate", f"{tps['megakernel']['aggregate']:,.0f}", f"{tps['xla']['aggregate']:,.0f}"],
    ]
    click.echo(tabulate(rows, headers=["", "megakernel", "XLA"], tablefmt="simple"))
    click.echo(f"XLA step / megakernel step: {r['speedup']:.2f}x ({how}, the same measure for both)")
    click.echo(f"layouts: megakernel: {r['layouts']['megakernel']}; XLA: {r['layouts']['xla']}")
    if measured:
        click.echo(f"step times: {mk['step_source']}")
    else:
        click.echo("step times are tpumk's timeline model of each compiled program (tpumk.estimate.timeline), NOT "
                   "measurements; the TPU compiler's static profile is not used (it is not comparable between a "
                   "Pallas kernel and an XLA program).")
        click.echo(f"model: {r['model_constants']}")
    v = r.get("verify")
    if v and v["feasible"]:
        click.echo(f"verify step (q = {v['q_len']}: {v['draft_tokens']} drafts + 1): {_bytes(v['hbm_bytes'])}, floor "
                   f"{_ms(v['floor_seconds'])}, kernel {_ms(v['kernel_seconds'])} vs plain {_ms(v['plain_kernel_seconds'])}"
                   f" = {v['cost_vs_plain']:.3f}x (MODEL): speculation pays off above a mean acceptance length of "
                   f"{v['cost_vs_plain']:.2f} tokens per step, drafting aside")
    elif v:
        click.echo(f"verify step (q = {v['q_len']}): does not plan: {v['reason']}")
    if r.get("model_check"):
        c = r["model_check"]
        click.echo(f"model check: the published TPU7x ring (12 x 2 MiB, 76 MiB/layer) modelled at "
                   f"{c['predicted_seconds'] * 1e6:.1f} us/layer vs 26.4 us measured on chip ({c['ratio']:.2f}x)")


@click.command()
@spec_options()
@click.option("--runs", default=10, show_default=True, help="Timed runs per step when a TPU is attached (median).")
@click.option("--warmup", default=3, show_default=True, help="Untimed runs first when a TPU is attached.")
@click.option("--verify-q", default=8, show_default=True,
              help="Also model the speculative verify step with this q_len (K drafts + 1); 0: off.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def bench(spec, runs, warmup, verify_q, as_json):
    """The megakernel decode step side by side with the same step compiled by XLA."""
    from tpumk.decode.bench import run_bench
    from tpumk.errors import ConfigError

    if runs < 1 or warmup < 0:
        raise ConfigError(f"--runs must be >= 1 and --warmup >= 0 (got {runs}, {warmup})")
    if verify_q < 0 or verify_q == 1:
        raise ConfigError(f"--verify-q: expected 0 (off) or at least 2 tokens per sequence, got {verify_q}")
    r = run_bench(spec, warmup=warmup, runs=runs, verify_q=verify_q)
    if as_json:
        emit_json(r)
    else:
        print_bench(r)
