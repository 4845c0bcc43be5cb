"""Options and error handling shared by the commands of `tpumk` (tpumk.cli.app, tpumk.cli.export).

Every error is one line on stderr, `tpumk: error: ...`, with one of two exit codes:
- 2, a usage error (Click's convention): the command line itself is malformed: an unknown
  command or option, a value of the wrong type or not among an option's choices, a missing
  required option or argument (`TpumkGroup`, for every command);
- 1, tpumk rejected the input or the work: an unknown model, a malformed TOML or manifest, an
  infeasible plan, a model too big for the target, an invalid artifact, ... (`fail_cleanly`,
  which every command wears: tpumk.errors.TpumkError and its subclasses).
"""

from __future__ import annotations

import functools
import json
import sys

import click

from tpumk.errors import TpumkError
from tpumk.model.quantize import SCHEMES as QUANT_SCHEMES

QUANT_HELP = (f"Weight formats: {', '.join(QUANT_SCHEMES)}, or ring=FMT,experts=FMT. int8 / fp8: every matrix "
              "the ring streams (projections, dense FFN, shared experts, lm_head) as int8 or e4m3 codes with a "
              "float32 scale per output column; int4: those int8 and the routed experts int4 with a scale per "
              "128 input rows; fp8-b128: e4m3 with 128 x 128 block scales (how FP8 checkpoints are stored); "
              "mxfp4 / nvfp4: the routed experts as e2m1 codes with a scale per 32 (E8M0) or 16 input rows "
              "(e4m3, and a float32 scale per matrix), the rest in the model dtype. Float weights are quantized "
              "at pack time; a quantized checkpoint builds as it is stored.")


_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def terminal_safe(text: str, one_line: bool = False) -> str:
    """`text` with every character that could drive a terminal written as an escape: C0 and C1
    control characters (ESC sequences, carriage returns, bells), line and paragraph separators
    and bidirectional overrides. Newlines and tabs stay unless `one_line` (an error line).
    Whatever a file held (a manifest's fields, a model's name, a path) reaches the terminal as
    visible text, never as commands to it."""
    keep = "" if one_line else "\n\t"
    out = []
    for c in text:
        n = ord(c)
        if c in keep:
            out.append(c)
        elif n < 0x20 or 0x7F <= n < 0xA0 or c in _BIDI or c in "\u2028\u2029":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or _escape(c))
        elif 0xD800 <= n < 0xE000:  # a lone surrogate (bytes that were not UTF-8 in a path)
            out.append(_escape(c))
        else:
            out.append(c)
    return "".join(out)


def echo(message=None, err: bool = False, **kw) -> None:
    """click.echo with `terminal_safe` text: every line tpumk prints goes through it."""
    click.echo(terminal_safe(str(message)) if message is not None else None, err=err, **kw)


def error_line(message: object) -> None:
    """`tpumk: error: ...`, one line, escaped (the message may quote what a file held)."""
    click.echo(f"tpumk: error: {terminal_safe(str(message), one_line=True)}", err=True)


def fail_cleanly(fn):
    """Turn tpumk's user errors into one line on stderr and exit code 1 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TpumkError as e:
            error_line(e)
            sys.exit(INPUT_EXIT)

    return wrapper


INPUT_EXIT = 1  # tpumk rejected the input or the work (TpumkError)


class OneLineError(click.ClickException):
    """A Click error shown as one line, `tpumk: error: ...`, with the original exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        error_line(self.message)


def _param_name(param) -> str:
    if isinstance(param, click.Option):
        return " / ".join(param.opts)
    return param.human_readable_name if param is not None else ""


def _command_path(ctx) -> str:
    """'tpumk build', however the program was started (console script, python -m, a test runner)."""
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["tpumk", *reversed(names)])


def usage_line(e: click.ClickException) -> str:
    """One line for a Click error: which option or argument, what is wrong, where to look."""
    msg = e.message.strip().rstrip(".")
    if isinstance(e, click.MissingParameter) and e.param is not None:
        kind = "option" if isinstance(e.param, click.Option) else "argument"
        line = f"missing {kind} {_param_name(e.param)}"
    elif isinstance(e, click.BadParameter) and e.param is not None:
        line = f"{_param_name(e.param)}: {msg}"
    elif getattr(e, "possibilities", None):  # no such option / command, with close matches
        line = f"{msg} (did you mean {' or '.join(sorted(e.possibilities))}?)"
    elif isinstance(e, click.UsageError):
        line = msg
    else:
        line = e.format_message().strip()
    line = " ".join(line.split())  # one line, whatever the message held
    if line[:1].isupper() and not line[1:2].isupper():  # "No such option" -> "no such option"; keep "TOML"
        line = line[:1].lower() + line[1:]
    ctx = getattr(e, "ctx", None)
    if isinstance(e, click.UsageError) and ctx is not None:
        line += f"; see '{_command_path(ctx)} --help'"
    return line


def _one_line(e: click.ClickException) -> click.ClickException:
    if isinstance(e, (OneLineError, click.exceptions.NoArgsIsHelpError)):
        return e
    return OneLineError(usage_line(e), e.exit_code)


# Options (and arguments) whose value is a file or directory path, in every command.
PATH_PARAMS = frozenset({"model", "checkpoint", "tuning_file", "space_file", "storage", "out_dir", "out_file",
                         "report_dir", "cache_dir", "draft_model", "path"})


def _check_path(callback):
    """A parameter callback that first refuses a path the OS would refuse as too long (a
    component over 255 bytes, the whole over 4095): one line naming the option, exit 1 (the
    command line is well-formed; the file system refuses the name), instead of an OSError
    wherever the path is first used."""
    from tpumk.files import name_problem, shown

    def check(ctx, param, value):
        for v in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(v, str) and (problem := name_problem(v)):
                raise OneLineError(f"{_param_name(param)} {shown(v, 60)}: {problem}", INPUT_EXIT)
        return callback(ctx, param, value) if callback is not None else value

    return check


class TpumkGroup(click.Group):
    """The `tpumk` group: Click's errors (usage errors, exit 2; others keep their code) become
    one line on stderr, for the group and every command under it. Every path option of every
    command added refuses over-long names in one line (`_check_path`)."""

    def add_command(self, cmd, name=None):
        for param in cmd.params:
            if param.name in PATH_PARAMS or isinstance(param.type, click.Path):
                param.callback = _check_path(param.callback)
        super().add_command(cmd, name)

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as e:
            raise _one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            raise _one_line(e) from None


def _is_bytes_key(key) -> bool:
    return isinstance(key, str) and (key.endswith("bytes") or "bytes_per_" in key)


def whole_bytes(obj):
    """`obj` with every byte count (a key ending in `bytes`, or `..._bytes_per_...`) an integer:
    plan accounting sums float terms (an expected number of distinct experts), but a byte count
    a script reads is a whole number."""
    if isinstance(obj, dict):
        return {k: (round(v) if _is_bytes_key(k) and isinstance(v, float) and v == v and abs(v) != float("inf")
                    else whole_bytes(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [whole_bytes(v) for v in obj]
    return obj


def emit_json(obj) -> None:
    # default=str: what JSON has no type for (a TOML date in an unverified manifest) is shown as text
    echo(json.dumps(whole_bytes(obj), indent=2, sort_keys=False, default=str))


SPEC_PARAMS = ("model", "checkpoint", "dtype", "target", "batch", "context", "q_len", "page_size", "devices",
               "quant", "kv_dtype", "tuning_file")
KV_DTYPE_HELP = ("KV cache format: none (the model dtype), fp8 or int8 (1-byte codes with a power-of-two scale "
                 "per token and KV head, packed with them in one page array: tpumk.model.kv_quant).")


def spec_options(tuning: bool = True):
    """The options that describe a build (model, target, step shapes and, unless `tuning` is
    False, --tuning), resolved into one `spec: BuildSpec` argument of the command. Defaults come
    from tpumk.plan.spec. `tune` has no --tuning: a study searches the knobs itself."""
    from tpumk.plan import spec as S

    opts = [
        click.option("--model", "model", metavar="NAME|FILE",
                     help=f"Preset name, model TOML or config.json (default {S.DEFAULT_MODEL})."),
        click.option("--checkpoint", type=click.Path(),
                     help="Take the model config from a checkpoint: a Hugging Face directory (config.json) or a Llama "
                          "GGUF file."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), help="Override the model's weight dtype."),
        click.option("--target", default=S.DEFAULT_TARGET, show_default=True, help="v5e, v5p, v6e, tpu7x or cpu."),
        click.option("--batch", default=S.DEFAULT_BATCH, show_default=True, help="Sequences per decode step."),
        click.option("--context", default=S.DEFAULT_CONTEXT, show_default=True, help="Max tokens per sequence (KV cache capacity)."),
        click.option("--q-len", default=S.DEFAULT_Q_LEN, show_default=True, help="New tokens per sequence per step (>1: speculative verification)."),
        click.option("--page-size", default=S.DEFAULT_PAGE_SIZE, show_default=True, help="Tokens per KV-cache page."),
        click.option("--devices", default=S.DEFAULT_DEVICES, show_default=True,
                     help="TensorCores (devices) one step spans: heads, FFN widths, experts and vocabulary split "
                          "across them, collectives inside the kernel."),
        click.option("--quant", default=None, metavar="SCHEME",
                     help=QUANT_HELP + f" Default: {S.DEFAULT_QUANT}, or the format a quantized checkpoint stores "
                                       "(an FP8 checkpoint: fp8-b128)."),
        click.option("--kv-dtype", "kv_dtype", default=None, type=click.Choice(["none", "fp8", "int8"]),
                     help=KV_DTYPE_HELP + " Default: none."),
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


def build_command(tuning_file: str) -> str:
    """The `tpumk build` command for the build the current command was given: its build options as
    typed (defaults left out, so the defaults apply again), then `--tuning tuning_file`. What
    `tune` prints as the next step: run as written it rebuilds exactly the tuned build."""
    import shlex

    from click.core import ParameterSource

    ctx = click.get_current_context()
    words = ["tpumk", "build"]
    for param in ctx.command.params:
        if param.name not in SPEC_PARAMS or param.name == "tuning_file":
            continue
        if ctx.get_parameter_source(param.name) in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
            continue
        value = ctx.params.get(param.name)
        if value is not None:
            words += [param.opts[0], str(value)]
    words += ["--tuning", tuning_file]
    return " ".join(shlex.quote(w) for w in words)


def resolve_spec(model=None, checkpoint=None, dtype=None, target=None, batch=None, context=None, q_len=None,
                 page_size=None, devices=None, quant=None, kv_dtype=None, tuning_file=None):
    """A BuildSpec from command-line values (None: the default)."""
    from tpumk.errors import ConfigError
    from tpumk.model.config import resolve_model_scheme
    from tpumk.model.quantize import build_scheme
    from tpumk.plan import spec as S
    from tpumk.plan.knobs import TuningConfig, load_tuning
    from tpumk.targets import get_target

    # None is "not given" (the default); a given but empty name is refused, never read as the default
    for flag, value, what in (("--model", model, "a preset name, model TOML or config.json"),
                              ("--checkpoint", checkpoint, "a checkpoint directory or GGUF file"),
                              ("--target", target, "a target name"),
                              ("--tuning", tuning_file, "a tuning TOML")):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag}: empty value (expected {what}; leave the option out for the default)")
    if model is not None and checkpoint is not None:
        raise ConfigError("give either --model or --checkpoint, not both")
    if checkpoint is not None:
        from tpumk.model.checkpoint import checkpoint_config

        cfg, stored = checkpoint_config(checkpoint)
    else:
        cfg, stored = resolve_model_scheme(S.DEFAULT_MODEL if model is None else model)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    try:  # a quantized checkpoint builds as stored (the loader packs that format)
        quant = build_scheme(stored, quant, cfg)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith("--quant") else f"--quant: {e}") from None
    shapes = {k: v for k, v in (("batch", batch), ("context", context), ("q_len", q_len),
                                 ("page_size", page_size), ("devices", devices), ("quant", quant),
                                 ("kv_dtype", kv_dtype)) if v is not None}
    return S.BuildSpec(cfg, get_target(S.DEFAULT_TARGET if target is None else target),
                       tuning=load_tuning(tuning_file) if tuning_file is not None else TuningConfig(), **shapes)
