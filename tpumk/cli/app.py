"""The `tpumk` command line: a thin Click shell over the library. Every command has --json."""

from __future__ import annotations

import sys

import click
from tabulate import tabulate

import tpumk
from tpumk.cli.bench import bench
from tpumk.cli.export import cache_key, export, inspect
from tpumk.cli.tune import report, tune
from tpumk.cli.options import KV_DTYPE_HELP, QUANT_HELP, TpumkGroup, echo, emit_json, fail_cleanly, spec_options
from tpumk.cli.units import duration, size


def readable_count(n: float) -> str:
    """A parameter count in readable units: 2.1 M, 117 M, 8.19 B (decimal, as model names use)."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.3g} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{n:.0f}"


@click.group(cls=TpumkGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(tpumk.__version__, prog_name="tpumk")
def main():
    """Build, tune and ship TPU megakernels for LLM decoding."""


# ---------------------------------------------------------------------- models / targets
@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def models(as_json):
    """List the built-in model presets."""
    from tpumk.model.config import load_preset, preset_names

    rows = []
    for name in preset_names():
        c = load_preset(name)
        attention = (f"MLA {c.num_q_heads}h, latent {c.kv_lora_rank}+{c.qk_rope_head_dim}" if c.is_mla
                     else f"{c.num_q_heads}q/{c.num_kv_heads}kv x {c.head_dim}")
        if c.linear:  # a hybrid: softmax attention on some layers, linear attention on the rest
            lin = c.linear
            kind = {"gated_delta": "Gated DeltaNet", "kda": "KDA"}[lin.linear_kind]
            attention = (f"{attention} on {c.kv_layers}, {kind} {lin.linear_key_heads}k/{lin.linear_value_heads}v "
                         f"x {lin.linear_key_dim} on {len(c.linear_layers)}")
        rows.append({
            "name": name, "layers": c.num_layers, "hidden": c.hidden_size,
            "attention_layers": c.kv_layers, "linear_layers": len(c.linear_layers),
            "linear_kind": c.linear_kind if c.linear else None,
            "attention": attention,
            "ffn": (f"{c.num_experts} experts top-{c.top_k} x {c.expert_ffn_size}" if c.is_moe
                    else f"dense {c.ffn_size}" + (" GeGLU" if c.mlp_act == "gelu_tanh" else "")),
            "dtype": c.dtype, "params": c.param_count(),
            "weight_bytes_per_step_b1": c.decode_weight_bytes(1),
            "weight_bytes_per_step_b8": c.decode_weight_bytes(8),
        })
    if as_json:
        emit_json({"models": rows})
        return
    table = [[r["name"], r["layers"], r["hidden"], r["attention"], r["ffn"], r["dtype"],
              readable_count(r["params"]), size(r["weight_bytes_per_step_b1"]), size(r["weight_bytes_per_step_b8"])]
             for r in rows]
    echo(tabulate(table, headers=["model", "layers", "hidden", "attention", "ffn", "dtype", "params",
                                        "weights/step b=1", "weights/step b=8"]))
    echo("\nweights/step: bytes of weights one decode step reads (MoE: expected distinct experts"
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
    table = [[r["name"], r["topology"] or "(host, interpret mode)", f"{r['vmem_bytes'] >> 20} MiB", size(r["hbm_bytes"]),
              f"{r['hbm_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s", f"{r['bf16_flops'] / 1e12:.0f} TFLOP/s", r["mxu"],
              "yes" if r["static_profile"] else "no", "yes" if r["attached"] else "no (deviceless)"]
             for r in rows]
    echo(tabulate(table, headers=["target", "topology", "VMEM", "HBM", "HBM BW", "bf16 peak", "MXU",
                                        "static profile", "attached"]))
    echo("\nThe cpu target runs kernels in Pallas TPU interpret mode and plans with TPU7x figures.")


# ---------------------------------------------------------------------- build
def hbm_line(r) -> str:
    """'11.13 MB (weights 10.92 MB, KV cache 0.13 MB, state pool 0.05 MB, other 0.03 MB)'."""
    parts = r.hbm_bytes_by_part or {}
    if not parts:
        return size(r.hbm_bytes_per_step)
    pool = parts.get("linear_states", 0.0) + parts.get("linear_windows", 0.0)
    shown = [("weights", parts.get("weights", 0.0)), ("KV cache", parts.get("kv_cache", 0.0))]
    if r.state_pool is not None:
        shown.append(("state pool", pool))
    shown.append(("other", parts.get("other", 0.0)))
    return (f"{size(r.hbm_bytes_per_step)} ("
            + ", ".join(f"{what} {size(b, r.hbm_bytes_per_step)}" for what, b in shown) + ")")


def state_pool_line(s: dict) -> str:
    """A hybrid's state pool: its shape, what it holds and what a step moves (plan accounting)."""
    step = s["states_bytes_per_step"] + s["windows_bytes_per_step"]
    plural = lambda n, w: f"{n} {w}{'s' if n != 1 else ''}"  # noqa: E731
    return (f"{plural(s['linear_layers'], 'linear layer')} x {plural(s['slots'], 'slot')} "
            f"({plural(s['pending_rows'], 'pending row')} each): {size(s['resident_bytes'])} held; per step "
            f"{size(step)} read + written (states {size(s['states_bytes_per_step'], step)}, windows and pending rows "
            f"{size(s['windows_bytes_per_step'], step)})")


def print_build_report(r) -> None:
    on = f"{r.devices} x {r.target} ({r.topology})" if r.devices > 1 else r.target
    fmt = f", {r.quant} weights" if r.quant != "none" else ""
    echo(f"built {r.model} for {on}: batch {r.batch}, q_len {r.q_len}, context {r.context}{fmt}")
    if r.devices > 1:
        echo(f"sharding: {sharding_line(r.sharding)}")
    each = " per device" if r.devices > 1 else ""
    what = "the round program" if r.draft else "the step"
    rows = [
        ["compile (this host, measured)", f"{r.compile_seconds:.2f} s (+ {r.lower_seconds:.2f} s lowering)"
                                          + (" of the round program" if r.draft else "")],
        [f"Pallas TPU kernels in {what}" + (" (per device)" if r.devices > 1 else ""),
         r.custom_calls if r.target != "cpu" else "none (cpu: the kernel is emulated by interpret mode as host ops)"],
        ["VMEM plan / budget / capacity" + each, f"{r.vmem_bytes / 2**20:.1f} / {r.vmem_budget_bytes / 2**20:.1f} / "
                                                 f"{r.vmem_capacity_bytes / 2**20:.0f} MiB"],
        ["HBM bytes per step (plan)" + each, hbm_line(r)],
        ["HBM floor (bytes / bandwidth)", duration(r.floor_seconds)],
        ["KV tiles", kv_tiles_line(r.plan["attention"])],
    ]
    if "lane_padding" in r.plan:  # widths off the 128-lane grid: the kernel runs a zero-padded copy
        p = r.plan["lane_padding"]
        widths = ", ".join(f"{what} {p[key][0]} -> {p[key][1]}" for key, what in (
            ("hidden_size", "hidden"), ("head_dim", "head dim"), ("q_heads", "q heads"), ("kv_heads", "kv heads"))
            if p[key][0] != p[key][1])
        rows.append(["lane padding (plan)", f"{widths}; {p['parameters'][0] / 1e6:,.1f} M parameters, "
                                            f"{p['parameters'][1] / 1e6:,.1f} M streamed"])
    if r.state_pool is not None:  # a hybrid's linear layers
        s = r.state_pool
        rows.append(["state pool (plan)" + each, state_pool_line(s)])
    if "moe" in r.plan:
        m = r.plan["moe"]
        rows.append(["expert slots", f"{m['expert_slots']} of {m['expert_chunk']} columns ({m['expert_slots_knob']})"])
    if r.devices > 1:
        ar = r.plan.get("all_reduce", {})
        how = f" ({ar['schedule']}, {ar['dtype']} wire)" if ar else ""
        ic = r.plan["interconnect_per_step"]
        reduces = int(ic["all_reduce"]["count"])
        latent = (f" + {int(ic['latent_all_gather']['count'])} latent all-gathers (MLA, q_a / kv_a split)"
                  if "latent_all_gather" in ic else "")
        rows += [["in-kernel collectives per step",
                  f"{reduces} all-reduces{how}{latent} + the logits all-gather"],
                 ["interconnect bytes sent per step" + each, size(r.interconnect_bytes_per_step)],
                 ["XLA collectives outside the kernel", r.xla_collectives]]
    if r.model_seconds is not None:
        coll = (f", {duration(r.model_collectives_seconds)} of it collectives, no schedule below "
                f"{duration(r.model_collectives_floor_seconds)}" if r.model_collectives_seconds else "")
        rows.append(["tpumk model step time", f"{duration(r.model_seconds)} (floor / model {r.model_floor_fraction:.2f}{coll})"])
        if r.program_seconds is not None:
            from tpumk.build import COPY_NOTE_BYTES

            c = r.program_copies or {}
            extra = (f": {duration(c['seconds'])} of it copying {size(c['hbm_bytes'] / 2)} around the kernel"
                     if c.get("hbm_bytes", 0.0) >= COPY_NOTE_BYTES else "")
            rows.append(["tpumk model, the whole program", f"{duration(r.program_seconds)} (kernel + XLA ops around it{extra})"])
    if r.estimated_seconds is not None:
        rows += [["compiler estimated cycles", f"{r.estimated_cycles:,}"],
                 ["estimated step time", duration(r.estimated_seconds)],
                 ["floor / estimate", f"{r.floor_fraction:.2f}"]]
    else:
        rows.append(["estimated step time", "none (see below)"])
    echo(tabulate(rows, tablefmt="plain"))
    if r.model_seconds is not None:
        echo(f"model source: {r.model_source}")
    if r.estimated_seconds is not None:
        echo(f"estimate source: {r.estimate_source}")
    else:
        echo(f"no estimate: {r.estimate_source.removeprefix('none: ')}")
    for n in r.notes:
        echo(f"note: {n}")
    if r.verify:
        print_verify_figures(r)
    if r.draft:
        print_round_figures(r)


def print_round_figures(r) -> None:
    """A round build: the drafter, the round program's settings and tpumk's model of a round
    (tpumk.build.round_figures)."""
    d = r.draft
    how = "greedy" if not d["temperature"] else f"speculative sampling at temperature {d['temperature']:g}"
    w = d["weights"]
    weights = f"weights sha256 {w['sha256'][:16]}..." if "sha256" in w else f"random weights, seed {w['random_seed']}"
    layers = f"{d['layers']} layer{'s' if d['layers'] != 1 else ''}"
    echo(f"\nround program: {d['kind']} drafter ({layers}, taps {d['taps']}, {weights}), {d['block']} "
         f"drafts a round (the step above is its verify step, q_len {d['verify_q']}), {d['rounds_per_call']} rounds "
         f"a device call, {how}; up to {d['max_steps']} tokens per sequence")
    m = d["model"]
    if isinstance(m, str):
        echo(f"  no round model: {m.removeprefix('none: ')}")
        return
    echo(tabulate([["plain step (q = 1)", duration(m["plain_step_seconds"])],
                   [f"verify step (q = {d['verify_q']})", duration(m["verify_step_seconds"])],
                   ["drafter passes", duration(m["draft_seconds"])],
                   ["round (verify + draft)", duration(m["round_seconds"])]], tablefmt="plain"))
    echo(f"  the round beats plain decoding when the mean acceptance length (tokens committed per round) exceeds "
         f"{m['break_even_acceptance']:.2f}; figures: {m['source']}")
    for n in m["notes"]:
        echo(f"  note: {n}")


def kv_tiles_line(a: dict) -> str:
    """The attention stage's KV tiling from `Plan.attention_summary()`, and who chose it."""
    how = "; ".join(f"{k} {v}" for k, v in a["kv_knobs"].items())
    return f"{a['kv_tile_pages']} pages ({a['kv_tile_tokens']} tokens) x {a['kv_buffers']} buffers ({how})"


def sharding_line(sh: dict) -> str:
    """One line of `ShardingPlan.summary()`: what each device holds."""
    a = sh["attention"]
    if "heads_per_device" in a:  # MLA: heads split, the latent cache whole on every device
        how = ("q_a / kv_a split by columns (" + ", ".join(f"{k} {v}" for k, v in a["split_by_columns"].items())
               + " a device), the latent all-gathered" if "split_by_columns" in a else "q_a / kv_a replicated")
        parts = [f"{a['heads_per_device']} heads per device, {how}, the latent cache on every device"]
    else:
        parts = [f"{a['q_heads_per_device']} q heads / {a['kv_heads_per_device']} kv heads per device"
                 + (f" (each kv head on {a['kv_replicas']} devices)" if a["kv_replicas"] > 1 else "")]
    if "dense_ffn" in sh:
        parts.append(f"FFN width {sh['dense_ffn']['width_per_device']}")
    if "experts" in sh:
        e = sh["experts"]
        parts.append(f"experts {e['mode']} ({e['expert_parallel']} groups x {e['expert_tensor']}-way width: "
                     f"{e['experts_per_device']} experts of width {e['expert_width_per_device']})")
    parts.append(f"vocab {sh['lm_head']['columns_per_device']}")
    return "; ".join(parts)


def print_verify_figures(r) -> None:
    """The speculative verify step beside the plain step (tpumk.build.verify_figures)."""
    v = r.verify
    echo(f"\nverify step (speculative decoding: q_len {v['q_len']} = {v['draft_tokens']} drafts + 1, "
               f"same batch and context)")
    if "error" in v:
        echo(f"  {v['error']}")
        return

    def ratio(key):
        return "" if v.get(key) is None else f"  ({v[key]:.2f} x plain)"

    rows = [
        ["HBM bytes per step (plan)", f"{size(v['hbm_bytes_per_step'])}{ratio('hbm_bytes_vs_plain')}"],
        ["HBM floor (bytes / bandwidth)", f"{duration(v['floor_seconds'])}{ratio('floor_vs_plain')}"],
        ["VMEM plan", f"{v['vmem_bytes'] / 2**20:.1f} MiB"],
    ]
    if v.get("estimated_seconds") is not None:
        rows.append(["estimated step time", f"{duration(v['estimated_seconds'])}{ratio('estimate_vs_plain')}"])
    elif v["estimate_source"].startswith("none: not requested"):
        rows.append(["estimated step time", "not requested (--verify-estimate: a second profiling compile)"])
    else:
        rows.append(["estimated step time", "none (see below)"])
    echo(tabulate(rows, tablefmt="plain"))
    if v.get("estimated_seconds") is not None:
        echo(f"figures: {v['source']}; estimate source: {v['estimate_source']}")
    else:
        echo(f"figures: {v['source']}")
        if not v["estimate_source"].startswith("none: not requested"):
            echo(f"no estimate: {v['estimate_source'].removeprefix('none: ')}")
    be = v.get("estimate_vs_plain") or v["floor_vs_plain"]
    echo(f"speculation beats plain decoding in target time when the mean acceptance length "
               f"(accepted drafts + bonus) exceeds {be:.2f} ({'estimate' if v.get('estimate_vs_plain') else 'floor'} "
               f"ratio; drafting not counted)")
    for n in v.get("notes", []):
        echo(f"note: {n}")


@main.command()
@spec_options(draft=True)
@click.option("--verify-q", default=8, show_default=True,
              help="Also report the speculative verify step with this q_len (K drafts + 1), from the plan; 0: off "
                   "(not with --draft: the round's verify step is the build).")
@click.option("--verify-estimate", is_flag=True,
              help="Give the verify step the compiler's estimate too (a second profiling compile).")
@click.option("--estimate/--no-estimate", default=True, show_default=True,
              help="The compiler's static estimate, from a profiling compile in a second process; "
                   "--no-estimate skips it (the plan, the compile and tpumk's model are still reported).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def build(spec, draft_params, verify_q, verify_estimate, estimate, as_json):
    """Plan and compile the megakernel decode step for a target (deviceless without a TPU), or
    with --draft the speculative round program around its verify step."""
    from click.core import ParameterSource

    from tpumk.build import build as do_build
    from tpumk.errors import ConfigError

    if spec.draft is not None:
        if click.get_current_context().get_parameter_source("verify_q") not in (None, ParameterSource.DEFAULT):
            raise ConfigError("--verify-q: not with --draft (the round's verify step is the build; --draft-tokens "
                              "sets its block)")
        verify_q = 0
    if verify_q < 0:
        raise ConfigError(f"--verify-q: expected 0 (off) or a positive number of tokens per sequence, got {verify_q}")
    if verify_estimate and not estimate:
        raise ConfigError("--verify-estimate: the verify step's estimate needs the plain one; drop --no-estimate")
    from tpumk.cli.progress import Phases

    phases = Phases("tpumk build")
    b = do_build(spec, estimate=estimate, verify_q=verify_q if verify_q != spec.q_len else 0,
                 verify_estimate=verify_estimate, progress=phases)
    wall = phases.summary()
    if as_json:  # the command's own timing beside the report (not part of it: an artifact's report has none)
        emit_json({**b.report.to_dict(), "wall_seconds": phases.done(), "phase_seconds": phases.seconds})
    else:
        print_build_report(b.report)
        echo(f"wall time (this host, measured): {wall}")


# ---------------------------------------------------------------------- generate
def _print_generated(result, prompts, tokenizer, prompt_text, as_json, backend, devices, kv_dtype, steps) -> bool:
    """The tokens (and text) a generation produced; True when it printed everything (--json, or
    a hidden-state drafter's rounds, whose figures it prints too)."""
    if tokenizer is not None:
        result.update(prompt_text=prompt_text, text=tokenizer.decode(result["tokens"][0]), tokenizer=tokenizer.source)
    if as_json:
        emit_json(result)
        return True
    on = f" on {devices} devices" if devices > 1 else ""
    kv = f", {kv_dtype} KV cache" if kv_dtype != "none" else ""
    echo(f"model {result['model']} ({result['weights']}), backend {backend}{on}{kv}")
    for p, toks in zip(prompts, result["tokens"]):
        echo(f"  {','.join(map(str, p))} -> {','.join(map(str, toks))}")
    if tokenizer is not None:  # repr: the text stays on one line, its spaces and newlines visible
        echo(f"  {prompt_text!r} -> {result['text']!r}")
    echo(f"{steps} steps in {result['seconds']:.2f} s wall on this host (includes compilation)")
    sp = result["spec"]
    if "device_calls" not in sp:
        return False
    how = "greedy" if not sp["temperature"] else f"speculative sampling at temperature {sp['temperature']:g}"
    echo(f"speculation: {sp['drafter']}, {sp['draft_tokens']} drafts per round (verify q_len {sp['verify_q']}), "
         f"{how}")
    echo(f"  mean acceptance length {sp['mean_acceptance_length']:.2f} tokens per verify step (accepted drafts + "
         f"1, at most {sp['draft_tokens'] + 1}); {sp['device_calls']} device call"
         f"{'s' if sp['device_calls'] != 1 else ''} of {sp['rounds_per_call']} rounds")
    return True


@main.command()
@click.option("--model", "model", metavar="NAME|FILE", help="Preset name, model TOML or config.json (default tiny-moe).")
@click.option("--checkpoint", type=click.Path(),
              help="Hugging Face checkpoint directory (config.json + *.safetensors), or a Llama GGUF file "
                   "(weights dequantized to float32 unless --dtype).")
@click.option("--prompt-ids", help="Comma-separated token ids; several sequences separated by ';'.")
@click.option("--prompt", "prompt_text", metavar="TEXT",
              help="Prompt text instead of --prompt-ids, encoded by the checkpoint's tokenizer (a GGUF file's "
                   "vocabulary or the directory's tokenizer.json); the continuation is printed as text too.")
@click.option("--steps", default=16, show_default=True, help="Tokens to generate per sequence.")
@click.option("--backend", default="reference", show_default=True, help="reference (pure JAX) or megakernel (interpret mode on the host, or an attached TPU).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights (ignored with --checkpoint).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), help="Override the model's weight dtype.")
@click.option("--page-size", default=16, show_default=True, help="Tokens per KV-cache page.")
@click.option("--devices", default=1, show_default=True,
              help="Devices the megakernel spans (host CPU devices in interpret mode without a TPU).")
@click.option("--quant", default="none", show_default=True, metavar="SCHEME",
              help="Quantize the weights (both backends run the same quantized weights): " + QUANT_HELP)
@click.option("--spec", default="none", show_default=True,
              help="Speculative decoding: none, ngram (prompt lookup, no weights) or draft (--draft-model). "
                   "Greedy tokens are unchanged; each target step verifies --draft-tokens drafts.")
@click.option("--draft", "draft", metavar="KIND[:SOURCE]",
              help="Speculative decoding with a drafter: eagle3:DIR, dflash:DIR, dflash2:DIR, dspark:DIR, mtp:DIR (a "
                   "speculators directory), mtp (the --checkpoint's own next-token layer), KIND:random or "
                   "KIND:key=value,... (random weights of a shape, --seed), ngram, or model:NAME|DIR|layers:N. "
                   "Hidden-state drafters read the target's taps and run --rounds-per-call rounds per device call.")
@click.option("--draft-tokens", default=None, type=int,
              help="Drafts K per target step (verify q = K + 1). Default: the drafter's own, 7 for ngram / model.")
@click.option("--rounds-per-call", default=8, show_default=True,
              help="Speculative rounds (draft, verify, accept) per device call with a hidden-state --draft.")
@click.option("--temperature", default=0.0, show_default=True,
              help="0: greedy. Above 0 (a hidden-state --draft): speculative sampling at that temperature, whose "
                   "tokens are distributed as the target's sampling.")
@click.option("--draft-model", metavar="NAME|FILE|DIR|layers:N",
              help="Draft model for --spec draft: preset / TOML / config.json (random weights, --seed), a checkpoint "
                   "directory, or layers:N (the target's first N layers). Same vocabulary as the target.")
@click.option("--kv-dtype", "kv_dtype", default="none", show_default=True, type=click.Choice(["none", "fp8", "int8"]),
              help=KV_DTYPE_HELP + " Both backends alike (the reference writes and reads the same format).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def generate(model, checkpoint, prompt_ids, prompt_text, steps, backend, seed, dtype, page_size, devices, quant, spec,
             draft, draft_tokens, rounds_per_call, temperature, draft_model, kv_dtype, as_json):
    """Greedy generation from token ids, or from text through a checkpoint's tokenizer (--prompt)."""
    from tpumk.decode import drafted
    from tpumk.decode import generate as gen
    from tpumk.errors import ConfigError

    if (prompt_ids is None) == (prompt_text is None):
        raise click.UsageError("missing option --prompt-ids (or --prompt TEXT)" if prompt_ids is None
                               else "--prompt-ids and --prompt: give one of them, not both",
                               ctx=click.get_current_context())
    hidden = drafted.hidden_kind(draft)
    if draft is not None and spec != "none":
        raise ConfigError("--draft and --spec: give one of them (--draft ngram and --draft model:... are --spec's)")
    if draft is not None and hidden is None:  # --spec's methods, spelled as --draft
        d = draft.strip()
        if d == "ngram":
            spec = "ngram"
        elif d.startswith("model:"):
            spec, draft_model = "draft", d.split(":", 1)[1]
        else:
            raise ConfigError(f"--draft {d!r}: expected eagle3:, dflash:, dflash2:, dspark:, mtp[:DIR], ngram or "
                              "model:NAME|DIR|layers:N")
    if hidden is None and (rounds_per_call != 8 or temperature != 0.0):
        raise ConfigError("--rounds-per-call and --temperature: only with a hidden-state --draft (eagle3, mtp, "
                          "dflash, dflash2, dspark)")
    block = draft_tokens
    draft_tokens = gen.DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens
    gen.check_sizes(steps, page_size, draft_tokens)  # before loading anything
    gen.check_request(model, checkpoint, dtype, prompt_ids, backend, spec, devices, quant, steps,
                      draft_tokens, draft_model)  # before any weights
    gen.prepare_devices(devices)  # host devices must exist before JAX starts its backends
    tokenizer = gen.prompt_tokenizer(checkpoint) if prompt_text is not None else None  # before the weights
    text_ids = gen.encode_prompt(tokenizer, prompt_text) if tokenizer is not None else None
    from tpumk.cli.progress import Phases

    phases = Phases("tpumk generate")
    phases("weights: " + (f"checkpoint {checkpoint}" if checkpoint is not None else f"random (seed {seed})")
           + (f", quantized {quant}" if quant != "none" else ""))
    m = gen.quantized(gen.load_model(model, checkpoint, seed=seed, dtype=dtype), quant)
    if text_ids is not None:
        gen.check_prompt_vocab(text_ids, m.cfg.vocab_size)
        prompts = [text_ids]
    else:
        prompts = gen.parse_prompt_ids(prompt_ids, m.cfg.vocab_size)
    if hidden is not None:
        phases(f"drafter: {draft.strip()}")
        drafter = drafted.load(draft, m.cfg, checkpoint, seed=seed, block=block, target_params=m.params)
        phases(f"generate {steps} tokens per sequence ({backend}: compile, prefill, then {rounds_per_call} "
               "speculative rounds per device call)")
        result = drafted.generate(m, prompts, steps, drafter, backend=backend, page_size=page_size, devices=devices,
                                  kv_dtype="" if kv_dtype == "none" else kv_dtype, rounds_per_call=rounds_per_call,
                                  temperature=temperature, seed=seed)
        _print_generated(result, prompts, tokenizer, prompt_text, as_json, backend, devices, kv_dtype, steps)
        return
    draft = gen.load_draft_model(draft_model, m, seed=seed, dtype=dtype) if draft_model is not None else None
    phases(f"generate {steps} tokens per sequence ({backend}: compile, prefill, then decode)")
    bar = None
    if sys.stderr.isatty() and spec == "none" and steps > 1:  # a bar of the decode steps on a terminal
        from tqdm import tqdm

        bar = tqdm(total=steps - 1, desc="decode steps", unit="step", file=sys.stderr, leave=False)
    try:
        result = gen.generate(m, prompts, steps, backend=backend, page_size=page_size, spec=spec,
                              draft_tokens=draft_tokens, draft=draft, devices=devices,
                              on_token=bar.update if bar is not None else None, kv_dtype=kv_dtype)
    finally:
        if bar is not None:
            bar.close()
    if _print_generated(result, prompts, tokenizer, prompt_text, as_json, backend, devices, kv_dtype, steps):
        return
    sp = result["spec"]
    if sp["method"] != "none" and not sp["target_steps"]:
        echo("speculation: no verify step ran (the prefill gives the only token)")
    elif sp["method"] != "none":
        echo(f"speculation: {sp['drafter']}, {sp['draft_tokens']} drafts per target step (verify q_len "
                   f"{sp['verify_q']})")
        echo(f"  mean acceptance length {sp['mean_acceptance_length']:.2f} tokens per verify step "
                   f"(accepted drafts + bonus, at most {sp['draft_tokens'] + 1})")
        echo(f"  tokens per target step {sp['tokens_per_target_step']:.2f} ({sp['target_steps']} verify steps "
                   f"for {sp['decode_tokens_per_sequence']} tokens per sequence after the prefill; plain greedy: 1.00)")



@main.command()
@click.option("--model", default=None, help="Preset name, model TOML or config.json (random weights, --seed).")
@click.option("--checkpoint", type=click.Path(),
              help="A Hugging Face checkpoint directory (float weights) or a Llama GGUF file (dequantized).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights (ignored with --checkpoint).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), help="Override the model's weight dtype.")
@click.option("--quant", "schemes", default="int8,fp8,int4,fp8-b128", show_default=True, metavar="SCHEME[;SCHEME..]",
              help="Schemes to compare with the float model, separated by ';' (a ',' inside ring=..,experts=..); "
                   "the presets may also be separated by ','.")
@click.option("--steps", default=8, show_default=True, help="Decode steps after each fixed prompt.")
@click.option("--kv-dtype", "kv_dtypes", default=None, metavar="FORMAT[,FORMAT]",
              help="KV cache formats to compare too (fp8, int8: one byte per element, a scale per token and kv "
                   "head), with the float weights. The reference decode only: the megakernel does not take them yet.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def quality(model, checkpoint, seed, dtype, schemes, steps, kv_dtypes, as_json):
    """Logit error of each weight format (and KV cache format) against the float model, on fixed prompts."""
    from tpumk.decode import generate as gen
    from tpumk.decode.quality import check_request, logit_quality

    parts = schemes.split(";") if ";" in schemes or "=" in schemes else schemes.split(",")
    parts = [p.strip() for p in parts if p.strip()]
    given = kv_dtypes is not None
    kv_dtypes = [k.strip() for k in (kv_dtypes or "").split(",") if k.strip()]
    if given and not kv_dtypes:  # asked for KV formats and named none: comparing nothing is no answer
        from tpumk.errors import ConfigError

        raise ConfigError("--kv-dtype: expected KV cache formats to compare (fp8, int8; several separated by ','), "
                          "got none; leave the option out to compare weight formats only")
    check_request(steps, parts, kv_dtypes=kv_dtypes)  # before a model is loaded
    gen.check_model_options(model, checkpoint)
    from tpumk.cli.progress import Phases

    phases = Phases("tpumk quality")
    phases("weights: " + (f"checkpoint {checkpoint}" if checkpoint is not None else f"random (seed {seed})"))
    m = gen.load_model(model, checkpoint, seed=seed, dtype=dtype)
    r = logit_quality(m.cfg, m.params, parts, steps=steps, progress=phases, kv_dtypes=kv_dtypes)
    if as_json:
        emit_json(r)
        return
    echo(f"model {r['model']} ({r['dtype']}, {m.source}): {r['prompts']} fixed prompts x {1 + steps} steps, "
               f"{r['source']}")
    if r["schemes"]:
        echo(tabulate([[s["quant"], f"{100 * s['logit_relative_rms']:.2f} %", f"{100 * s['greedy_agreement']:.1f} %"]
                       for s in r["schemes"]], headers=["quant", "logit relative RMS", "greedy token agreement"]))
    if r["kv_formats"]:
        echo(tabulate([[f"{s['kv_dtype']} (float weights)", f"{100 * s['logit_relative_rms']:.2f} %",
                        f"{100 * s['greedy_agreement']:.1f} %", f"{s['kv_bytes_vs_model_dtype']:.3f}"]
                       for s in r["kv_formats"]],
                      headers=["KV cache", "logit relative RMS", "greedy token agreement",
                               f"bytes / {r['dtype']} cache"]))

main.add_command(export)
main.add_command(cache_key)
main.add_command(inspect)
main.add_command(bench)
main.add_command(tune)
main.add_command(report)
