"""The `tpumk` command line: a thin Click shell over the library. Every command has --json."""

from __future__ import annotations

import click
from tabulate import tabulate

import tpumk
from tpumk.cli_export import cache_key, export, inspect
from tpumk.cli_options import emit_json, fail_cleanly, build_options, resolve_build_inputs


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tpumk.__version__, prog_name="tpumk")
def main():
    """Build, tune and ship TPU megakernels for LLM decoding."""


# ---------------------------------------------------------------------- models / targets
@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def models(as_json):
    """List the built-in model presets."""
    from tpumk.config import load_preset, preset_names

    rows = []
    for name in preset_names():
        c = load_preset(name)
        rows.append({
            "name": name, "layers": c.num_layers, "hidden": c.hidden_size,
            "attention": f"{c.num_q_heads}q/{c.num_kv_heads}kv x {c.head_dim}",
            "ffn": (f"{c.num_experts} experts top-{c.top_k} x {c.expert_ffn_size}" if c.is_moe else f"dense {c.ffn_size}"),
            "dtype": c.dtype, "params": c.param_count(),
            "weight_bytes_per_step_b1": c.decode_weight_bytes(1),
            "weight_bytes_per_step_b8": c.decode_weight_bytes(8),
        })
    if as_json:
        emit_json({"models": rows})
        return
    table = [[r["name"], r["layers"], r["hidden"], r["attention"], r["ffn"], r["dtype"],
              f"{r['params'] / 1e9:.3f} B", _gb(r["weight_bytes_per_step_b1"]), _gb(r["weight_bytes_per_step_b8"])]
             for r in rows]
    click.echo(tabulate(table, headers=["model", "layers", "hidden", "attention", "ffn", "dtype", "params",
                                        "weights/step b=1", "weights/step b=8"]))
    click.echo("\nweights/step: bytes of weights one decode step reads (MoE: expected distinct experts"
               " under uniform routing); tpumk's own count from the config, not a measurement.")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def targets(as_json):
    """List TPU targets with their chip figures (per TensorCore, from Pallas' chip table)."""
    from tpumk.targets import TARGETS

    rows = []
    for t in TARGETS.values():
        r = t.figures()
        r["attached"] = t.is_attached() if t.is_tpu else True
        rows.append(r)
    if as_json:
        emit_json({"targets": rows})
        return
    table = [[r["name"], r["topology"] or "(host, interpret mode)", f"{r['vmem_bytes'] >> 20} MiB", _gb(r["hbm_bytes"]),
              f"{r['hbm_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s", f"{r['bf16_flops'] / 1e12:.0f} TFLOP/s", r["mxu"],
              "yes" if r["static_profile"] else "no", "yes" if r["attached"] else "no (deviceless)"]
             for r in rows]
    click.echo(tabulate(table, headers=["target", "topology", "VMEM", "HBM", "HBM BW", "bf16 peak", "MXU",
                                        "static profile", "attached"]))
    click.echo("\nThe cpu target runs kernels in Pallas TPU interpret mode and plans with TPU7x figures.")


# ---------------------------------------------------------------------- build
def _us(s):
    return "n/a" if s is None else f"{s * 1e6:,.1f} us"


def print_build_report(r) -> None:
    click.echo(f"built {r.model} for {r.target}: batch {r.batch}, q_len {r.q_len}, context {r.context}")
    rows = [
        ["compile (this host, measured)", f"{r.compile_seconds:.2f} s (+ {r.lower_seconds:.2f} s lowering)"],
        ["Pallas TPU kernels in the step", r.custom_calls if r.target != "cpu"
         else "none (cpu: the kernel is emulated by interpret mode as host ops)"],
        ["VMEM plan / budget / capacity", f"{r.vmem_bytes / 2**20:.1f} / {r.vmem_budget_bytes / 2**20:.1f} / "
                                          f"{r.vmem_capacity_bytes / 2**20:.0f} MiB"],
        ["HBM bytes per step (plan)", f"{r.hbm_bytes_per_step / 1e6:,.2f} MB"],
        ["HBM floor (bytes / bandwidth)", _us(r.floor_seconds)],
        ["compiler estimated cycles", "n/a" if r.estimated_cycles is None else f"{r.estimated_cycles:,}"],
        ["estimated step time", _us(r.estimated_seconds)],
        ["floor / estimate", "n/a" if r.floor_fraction is None else f"{r.floor_fraction:.2f}"],
    ]
    click.echo(tabulate(rows, tablefmt="plain"))
    click.echo(f"estimate source: {r.estimate_source}")
    for n in r.notes:
        click.echo(f"note: {n}")


@main.command()
@build_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def build(model, checkpoint, dtype, target, batch, context, q_len, page_size, tuning_file, as_json):
    """Plan and compile the megakernel decode step for a target (deviceless without a TPU)."""
    from tpumk.build import build as do_build

    cfg, tgt, tuning = resolve_build_inputs(model, checkpoint, dtype, target, tuning_file)
    b = do_build(cfg, tgt, batch=batch, context=context, tuning=tuning, q_len=q_len, page_size=page_size)
    if as_json:
        emit_json(b.report.to_dict())
    else:
        print_build_report(b.report)


# ---------------------------------------------------------------------- generate
@main.command()
@click.option("--model", "model", metavar="NAME|FILE", help="Preset name, model TOML or config.json (default tiny-moe).")
@click.option("--checkpoint", type=click.Path(), help="Hugging Face checkpoint directory (config.json + *.safetensors).")
@click.option("--prompt-ids", required=True, help="Comma-separated token ids; several sequences separated by ';'.")
@click.option("--steps", default=16, show_default=True, help="Tokens to generate per sequence.")
@click.option("--backend", default="reference", show_default=True, help="reference (pure JAX) or megakernel (interpret mode on the host, or an attached TPU).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights (ignored with --checkpoint).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), help="Override the model's weight dtype.")
@click.option("--page-size", default=16, show_default=True, help="Tokens per KV-cache page.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def generate(model, checkpoint, prompt_ids, steps, backend, seed, dtype, page_size, as_json):
    """Greedy generation from token ids (no tokenizer: ids in, ids out)."""
    from tpumk import generate as gen

    m = gen.load_model(model, checkpoint, seed=seed, dtype=dtype)
    prompts = gen.parse_prompt_ids(prompt_ids, m.cfg.vocab_size)
    result = gen.generate(m, prompts, steps, backend=backend, page_size=page_size)
    if as_json:
        emit_json(result)
        return
    click.echo(f"model {result['model']} ({result['weights']}), backend {backend}")
    for p, toks in zip(prompts, result["tokens"]):
        click.echo(f"  {','.join(map(str, p))} -> {','.join(map(str, toks))}")
    click.echo(f"{steps} steps in {result['seconds']:.2f} s wall on this host (includes compilation)")


main.add_command(export)
main.add_command(cache_key)
main.add_command(inspect)

if __name__ == "__main__":  # pragma: no cover
    main()
