"""Options and error handling shared by the commands of `tpumk` (tpumk.cli.app, tpumk.cli.export)."""

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



SPEC_PARAMS = ("model", "checkpoint", "dtype", "target", "batch", "context", "q_len", "page_size", "tuning_file")


def spec_options(tuning: bool = True):
    """The options that describe a build (model, target, step shapes and, unless `tuning` is
    False, --tuning), resolved into one `spec: BuildSpec` argument of the command. Defaults come
    from tpumk.plan.spec. `tune` has no --tuning: a study searches the knobs itself."""
    from tpumk.plan import spec as S

    opts = [
        click.option("--model", "model", metavar="NAME|FILE",
                     help=f"Preset name, model TOML or config.json (default {S.DEFAULT_MODEL})."),
        click.option("--checkpoint", type=click.Path(), help="Take the model config from a Hugging Face checkpoint directory."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), help="Override the model's weight dtype."),
        click.option("--target", default=S.DEFAULT_TARGET, show_default=True, help="v5e, v5p, v6e, tpu7x or cpu."),
        click.option("--batch", default=S.DEFAULT_BATCH, show_default=True, help="Sequences per decode step."),
        click.option("--context", default=S.DEFAULT_CONTEXT, show_default=True, help="Max tokens per sequence (KV cache capacity)."),
        click.option("--q-len", default=S.DEFAULT_Q_LEN, show_default=True, help="New tokens per sequence per step (>1: speculative verification)."),
        click.option("--page-size", default=S.DEFAULT_PAGE_SIZE, show_default=True, help="Tokens per KV-cache page."),
    ]
    if tuning:
        opts.append(click.option("--tuning", "tuning_file", type=click.Path(),
                                 help="Tuning TOML ([tuning] table); default knobs otherwise."))

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(**kwargs):
            values = {k: kwargs.pop(k) for k in SPEC_PARAMS if k in kwargs}
            return fn(spec=fail_cleanly(resolve_spec)(**values), **kwargs)

        for opt in reversed(opts):
            wrapper = opt(wrapper)
        return wrapper

    return decorate


def resolve_spec(model=None, checkpoint=None, dtype=None, target=None, batch=None, context=None, q_len=None,
                 page_size=None, tuning_file=None):
    """A BuildSpec from command-line values (None: the default)."""
    from tpumk.errors import ConfigError
    from tpumk.model.config import load_hf_config, resolve_model
    from tpumk.plan import spec as S
    from tpumk.plan.knobs import TuningConfig, load_tuning
    from tpumk.targets import get_target

    if model and checkpoint:
        raise ConfigError("give either --model or --checkpoint, not both")
    cfg = load_hf_config(checkpoint) if checkpoint else resolve_model(model or S.DEFAULT_MODEL)
    if dtype and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    shapes = {k: v for k, v in (("batch", batch), ("context", context), ("q_len", q_len),
                                 ("page_size", page_size)) if v is not None}
    return S.BuildSpec(cfg, get_target(target or S.DEFAULT_TARGET),
                       tuning=load_tuning(tuning_file) if tuning_file else TuningConfig(), **shapes)
