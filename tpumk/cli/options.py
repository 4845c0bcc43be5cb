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


def spec_options(tuning: bool = True, draft: bool = False, draft_seed: bool = True):
    """The options that describe a build (model, target, step shapes and, unless `tuning` is
    False, --tuning), resolved into one `spec: BuildSpec` argument of the command. Defaults come
    from tpumk.plan.spec. `tune` has no --tuning: a study searches the knobs itself.

    `draft`: also the options of a speculative round program (`draft_option_list`: --draft,
    --draft-tokens, --rounds-per-call, --temperature and, with `draft_seed`, --seed of a random
    drafter), resolved into the spec's RoundSpec (`resolve_spec_and_draft`); the command then also gets
    `draft_params`, the drafter's weights when they were read from files (else None)."""
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
    if draft:
        opts += draft_option_list(draft_seed)
    names = SPEC_PARAMS + (tuple(n for n in DRAFT_PARAMS if draft_seed or n != "seed") if draft else ())

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(**kwargs):
            values = {k: kwargs.pop(k) for k in names if k in kwargs}
            if not draft:
                return fn(spec=fail_cleanly(resolve_spec)(**values), **kwargs)
            values.setdefault("seed", None)  # tune: its --seed is its sampler's
            spec, params = fail_cleanly(resolve_spec_and_draft)(**values)
            return fn(spec=spec, draft_params=params, **kwargs)

        for opt in reversed(opts):
            wrapper = opt(wrapper)
        return wrapper

    return decorate


def build_command(tuning_file: str, skip: tuple[str, ...] = ()) -> str:
    """The `tpumk build` command for the build the current command was given: its build options
    (and draft options) as typed (defaults left out, so the defaults apply again; `skip`: left
    out too), then `--tuning tuning_file`. What `tune` prints as the next step: run as written it
    rebuilds exactly the tuned build."""
    import shlex

    from click.core import ParameterSource

    ctx = click.get_current_context()
    words = ["tpumk", "build"]
    for param in ctx.command.params:
        # (the command's --seed is not passed on: tune's is its sampler's, never a drafter's)
        if param.name not in SPEC_PARAMS + DRAFT_PARAMS or param.name in ("tuning_file", "seed", *skip):
            continue
        if ctx.get_parameter_source(param.name) in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
            continue
        value = ctx.params.get(param.name)
        if value is not None:
            words += [param.opts[0], str(value)]
    words += ["--tuning", tuning_file]
    return " ".join(shlex.quote(w) for w in words)


def resolve_spec(model=None, checkpoint=None, dtype=None, target=None, batch=None, context=None, q_len=None,
                 page_size=None, devices=None, quant=None, kv_dtype=None, tuning_file=None,
                 draft_block_later: bool = False):
    """A BuildSpec from command-line values (None: the default). `draft_block_later`: a round build
    is being made (`resolve_spec_and_draft`), which applies the tuning's draft_block: left out here."""
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
    tuning = load_tuning(tuning_file) if tuning_file is not None else TuningConfig()
    if draft_block_later:
        tuning = tuning.replace(draft_block=0)
    return S.BuildSpec(cfg, get_target(S.DEFAULT_TARGET if target is None else target), tuning=tuning, **shapes)


DRAFT_PARAMS = ("draft", "draft_tokens", "rounds_per_call", "temperature", "seed")


def draft_option_list(seed: bool = True) -> list:
    """The options of a speculative round program (`build`, `export`, `cache-key`, `tune`): --draft
    in `tpumk generate --draft`'s spelling, --draft-tokens, --rounds-per-call, --temperature and
    (unless `seed` is False: tune's --seed is its sampler's) --seed of a random drafter."""
    opts = [
        click.option("--draft", "draft", metavar="KIND[:SOURCE]",
                     help="Build the speculative round program (drafter passes, the megakernel's verify step with "
                          "the drafter's taps, acceptance) instead of the plain step: eagle3:DIR, dflash:DIR, "
                          "dflash2:DIR, dspark:DIR, mtp:DIR (a speculators directory), mtp (the --checkpoint's own "
                          "next-token layer), KIND:random or KIND:key=value,... (random weights of a shape)."),
        click.option("--draft-tokens", "draft_tokens", default=None, type=int,
                     help="Drafts per round (verify q_len = K + 1); default the drafter's own (or the --tuning "
                          "file's draft_block)."),
        click.option("--rounds-per-call", "rounds_per_call", default=8, show_default=True, type=int,
                     help="Speculative rounds per device call of the round program (--draft)."),
        click.option("--temperature", "temperature", default=0.0, show_default=True, type=float,
                     help="Acceptance of the round program (--draft): 0 greedy, above 0 speculative sampling."),
    ]
    if seed:
        opts.append(click.option("--seed", "seed", default=0, show_default=True, type=int,
                                 help="Seed of a random drafter's weights (--draft KIND:random / KIND:key=value)."))
    return opts


def resolve_spec_and_draft(draft=None, draft_tokens=None, rounds_per_call=8, temperature=0.0, seed=None, **values):
    """(spec, the drafter's weights or None) from a command's build and draft options: with
    --draft, the round build (its RoundSpec; q_len and taps the verify step's; a --tuning file's
    draft_block its block) and the weights read from a directory or a checkpoint (None for a
    random drafter: its seed names them; `seed` None: the command has no drafter --seed, and a
    random drafter takes 0). The draft options without --draft, and --q-len beside it, are
    refused in one line."""
    from click.core import ParameterSource

    from tpumk.errors import ConfigError, PlanError
    from tpumk.plan.knobs import TuningConfig, load_tuning

    ctx = click.get_current_context(silent=True)

    def given(name: str) -> bool:
        return ctx is not None and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT,
                                                                        ParameterSource.DEFAULT_MAP)

    if draft is None:
        mine = [n for n in DRAFT_PARAMS if n != "draft" and (n != "seed" or seed is not None)]
        extra = [f"--{n.replace('_', '-')}" for n in mine if given(n)]
        if extra:
            raise ConfigError(f"{extra[0]}: only with --draft (a speculative round program)")
        return resolve_spec(**values), None
    if given("q_len"):
        raise ConfigError("--q-len: not with --draft: the round's verify step takes block + 1 tokens per sequence "
                          "(--draft-tokens sets the block)")
    tuning_file = values.pop("tuning_file", None)
    tuning = load_tuning(tuning_file) if tuning_file is not None and tuning_file.strip() else TuningConfig()
    if draft_tokens is not None and tuning.draft_block and draft_tokens != tuning.draft_block:
        raise ConfigError(f"--draft-tokens {draft_tokens} and the tuning's draft_block {tuning.draft_block} "
                          f"({tuning_file}): give one of them")
    # the spec without a drafter cannot hold a draft_block: the RoundSpec takes it below
    spec = resolve_spec(**values, tuning_file=tuning_file, draft_block_later=True)
    from tpumk.decode import drafted

    rounds, params = drafted.round_spec(draft, spec.model, values.get("checkpoint"), seed=seed or 0,
                                        block=draft_tokens, rounds_per_call=rounds_per_call, temperature=temperature)
    try:
        return spec.replace(draft=rounds, tuning=tuning), params
    except PlanError as e:
        raise PlanError(f"--draft {draft.strip()}: {str(e).removeprefix('build spec: ')}") from None
