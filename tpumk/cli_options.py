"""Options and error handling shared by the commands of `tpumk` (tpumk.cli, tpumk.cli_export)."""

from __future__ import annotations

import functools
import json
import sys

import click

from tpumk.errors import TpumkError


def fail_cleanly(fn):
    """Turn tpumk's user errors into one line on stderr and exit code 1 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TpumkError as e:
            click.echo(f"tpumk: error: {e}", err=True)
            sys.exit(1)

    return wrapper


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))



def model_options(fn):
    """The model/target/shape options of every command that builds a step (build, export,
    cache-key, bench, tune)."""
    opts = [
        click.option("--model", "model", metavar="NAME|FILE", help="Preset name, model TOML or config.json (default tiny-moe)."),
        click.option("--checkpoint", type=click.Path(), help="Take the model config from a Hugging Face checkpoint directory."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), help="Override the model's weight dtype."),
        click.option("--target", default="tpu7x", show_default=True, help="v5e, v5p, v6e, tpu7x or cpu."),
        click.option("--batch", default=1, show_default=True, help="Sequences per decode step."),
        click.option("--context", default=4096, show_default=True, help="Max tokens per sequence (KV cache capacity)."),
        click.option("--q-len", default=1, show_default=True, help="New tokens per sequence per step (>1: speculative verification)."),
        click.option("--page-size", default=16, show_default=True, help="Tokens per KV-cache page."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def build_options(fn):
    """model_options plus --tuning (tune has no --tuning: a study searches the knobs itself)."""
    fn = click.option("--tuning", "tuning_file", type=click.Path(),
                      help="Tuning TOML ([tuning] table); default knobs otherwise.")(fn)
    return model_options(fn)


def resolve_build_inputs(model, checkpoint, dtype, target, tuning_file):
    from tpumk.config import load_hf_config, resolve_model
    from tpumk.errors import ConfigError
    from tpumk.targets import get_target
    from tpumk.tuning import TuningConfig, load_tuning

    if model and checkpoint:
        raise ConfigError("give either --model or --checkpoint, not both")
    cfg = load_hf_config(checkpoint) if checkpoint else resolve_model(model or "tiny-moe")
    if dtype and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    tuning = load_tuning(tuning_file) if tuning_file else TuningConfig()
    return cfg, get_target(target), tuning
