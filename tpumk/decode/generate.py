"""Greedy generation through a chosen backend (the user-visible proof a model is right).

Backends share one decode-step signature, `step(params, tokens[B,q], positions[B,q], cache)
-> (logits[B,q,V], cache)`, so prefill, the greedy loop and the paged cache are common code
(`tpumk.model.reference.greedy_generate`), and only the step differs.

With speculation (`spec="ngram"` or `"draft"`) the loop is `tpumk.decode.speculative`'s: one target
step of q = K + 1 tokens (the megakernel planned for that q, or the reference) verifies the K
tokens a drafter (`tpumk.decode.drafters`) proposed; the tokens are the greedy ones either way. On
the megakernel backend a draft model runs through its own megakernel (q = 1). Prefill is the
reference's on every backend (the prompt is one multi-token chunk per sequence; the kernel is
planned for a fixed [B, q]).
"""

from __future__ import annotations

import functools
import numbers
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from tpumk.model import reference
from tpumk.model.config import ModelConfig, load_hf_model, resolve_model
from tpumk.errors import ConfigError
from tpumk.plan.spec import MAX_BATCH, MAX_CONTEXT, MAX_PAGE_SIZE, MAX_Q_LEN

BACKENDS = ("reference", "megakernel")
SPEC_METHODS = ("none", "ngram", "draft")
DEFAULT_DRAFT_TOKENS = 7  # verify q = 8, the verify step `tpumk build` reports by default


@dataclass
class Model:
    cfg: ModelConfig
    params: dict
    source: str  # "random weights (seed N)" or the checkpoint directory
    quant: str = "none"  # the scheme `params`' streamed matrices are quantized with


def check_model_options(model: str | None, checkpoint: str | None) -> None:
    """One of --model / --checkpoint (None: not given), neither an empty value."""
    if checkpoint is not None and model is not None:
        raise ConfigError("give either --model or --checkpoint, not both")
    for flag, value in (("--model", model), ("--checkpoint", checkpoint)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag}: empty value (expected a preset name, model TOML, config.json or checkpoint "
                              "directory; leave the option out for the default)")


def check_draft_option(draft: str | None, spec: str) -> None:
    """--draft-model: given only with --spec draft, not empty, `layers:N` with an integer N."""
    if draft is None:
        return
    if spec != "draft":
        raise ConfigError("--draft-model: only used with --spec draft")
    draft = draft.strip()
    if not draft:
        raise ConfigError("--draft-model: empty value (expected a preset name, model TOML, config.json, checkpoint "
                          "directory or layers:N)")
    if draft.startswith("layers:"):
        try:
            int(draft.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"--draft-model {draft}: expected layers:N with an integer N") from None


def load_model(model: str | None, checkpoint: str | None, seed: int = 0, dtype: str | None = None) -> Model:
    """A model from a preset / TOML / config.json with random weights, or from a checkpoint.
    None is "not given" (the default model); an empty or blank name is refused, not defaulted."""
    check_model_options(model, checkpoint)
    if checkpoint is not None:
        from tpumk.model.checkpoint import load_checkpoint

        from tpumk.model.quantize import scheme_of

        cfg, params = load_checkpoint(Path(checkpoint), dtype=dtype)
        quant = scheme_of(params)  # "none", or how a quantized checkpoint stores its weights
        return Model(cfg, params, f"checkpoint {checkpoint}" + (f" ({quant} as stored)" if quant != "none" else ""),
                     quant)
    from tpumk.model.weights import random_params

    cfg = resolve_model("tiny-moe" if model is None else model)
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    return Model(cfg, random_params(cfg, seed), f"random weights (seed {seed})")


def check_request(model: str | None, checkpoint: str | None, dtype: str | None, prompt_ids: str | None,
                  backend: str, spec: str, devices: int, quant: str, steps: int = 1,
                  draft_tokens: int = DEFAULT_DRAFT_TOKENS, draft_model: str | None = None) -> None:
    """What `tpumk generate` can check before any weights exist (random weights take seconds, a
    checkpoint longer): the backend and speculation method, the devices' backend, and, from the
    model's config alone (a preset, TOML or config.json; a checkpoint directory's config.json, a
    GGUF file's metadata), the weight scheme and the prompt ids against the vocabulary."""
    from tpumk.files import is_dir
    from tpumk.model.checkpoint import checkpoint_config
    from tpumk.model.gguf_file import is_gguf_path
    from tpumk.model.quantize import build_scheme

    check_methods(backend, spec, devices)
    check_model_options(model, checkpoint)
    check_draft_option(draft_model, spec)
    if spec == "draft" and draft_model is None:
        raise ConfigError("--spec draft: needs --draft-model NAME|FILE|DIR|layers:N")
    if checkpoint is not None and not (is_dir(Path(checkpoint)) or is_gguf_path(checkpoint)):
        return  # a path load_model refuses in one line
    cfg, stored = checkpoint_config(checkpoint) if checkpoint is not None else \
        (resolve_model("tiny-moe" if model is None else model), "none")
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    if checkpoint is None:  # random weights are drawn on the host: refuse what cannot fit it first
        from tpumk.model.weights import check_host_memory as weights_fit

        weights_fit(cfg)
    try:
        build_scheme(stored, quant, cfg)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith("--quant") else f"--quant: {e}") from None
    if prompt_ids is not None:
        check_prompts(parse_prompt_ids(prompt_ids, cfg.vocab_size), steps, spec, draft_tokens)
    draft = (draft_model or "").strip()
    if draft and not draft.startswith("layers:"):  # the draft's config, as load_draft_model will read it
        dcfg = load_hf_model(draft)[0] if _is_checkpoint_dir(draft) else resolve_model(draft)
        check_draft_vocab(draft, dcfg.vocab_size, cfg.vocab_size)
        check_draft_mixer(draft, dcfg)
    elif draft:
        truncated_config(cfg, int(draft.split(":", 1)[1]))


def check_methods(backend: str, spec: str, devices: int) -> None:
    """--backend and --spec among the known ones; more than one device only on the megakernel."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend: unknown backend '{backend}' (backends: {', '.join(BACKENDS)})")
    if devices != 1 and backend != "megakernel":
        raise ConfigError(f"--devices {devices}: only the megakernel backend spans devices (--backend megakernel)")
    if spec not in SPEC_METHODS:
        raise ConfigError(f"--spec: unknown method '{spec}' (methods: {', '.join(SPEC_METHODS)})")


def check_prompts(prompts: list[list[int]], steps: int, spec: str, draft_tokens: int) -> None:
    """The prompts make one decode batch and, with the steps (and drafts), fit a sequence's longest context."""
    if not prompts:
        raise ConfigError("--prompt-ids: expected at least one sequence")
    if len(prompts) > MAX_BATCH:
        raise ConfigError(f"--prompt-ids: {len(prompts):,} sequences, expected at most {MAX_BATCH:,} "
                          "(one decode batch)")
    k = draft_tokens if spec != "none" else 0
    longest = max(len(p) for p in prompts)
    need = longest + steps + k
    if need > MAX_CONTEXT:
        raise ConfigError(f"--steps: the longest prompt ({longest:,} token{'s' if longest != 1 else ''}) plus "
                          f"{steps:,} steps"
                          + (f" plus {k:,} draft tokens" if k else "")
                          + f" is {need:,} tokens, more than the longest context a sequence can have ({MAX_CONTEXT:,})")


def quantized(m: Model, scheme: str) -> Model:
    """`m` with its streamed matrices quantized (`tpumk.model.quantize`): the reference and the
    megakernel then run the same quantized weights. "none": `m` itself."""
    from tpumk.model.quantize import build_scheme, quantize_params

    scheme = build_scheme(m.quant, scheme, m.cfg)  # the one decision (a quantized checkpoint: as stored)
    if scheme == m.quant:
        return m
    return Model(m.cfg, quantize_params(m.cfg, m.params, scheme), f"{m.source}, {scheme} weights", scheme)


@functools.lru_cache(maxsize=16)
def reference_step(cfg: ModelConfig):
    """The jitted reference step of `cfg`, one per config per process (jit compiles per shape,
    so generations in one process share the compiled prefill and decode shapes)."""
    return reference.jitted_decode_step(cfg)


def truncated_config(cfg: ModelConfig, layers: int) -> ModelConfig:
    """`cfg`'s first `layers` layers as a model of its own (`truncated_model`). A hybrid's first
    layers hold linear-attention layers: refused as any hybrid draft is (`check_draft_mixer`)."""
    if not (isinstance(layers, int) and 1 <= layers <= cfg.num_layers):
        raise ConfigError(f"--draft-model layers:N: expected N in [1, {cfg.num_layers}] (layers of '{cfg.name}'), "
                          f"got {layers!r}")
    changes: dict = {"num_layers": layers, "name": f"{cfg.name}-first{layers}"}
    if cfg.is_moe:
        dense = tuple(i for i in cfg.dense_layers if i < layers)
        if len(dense) == layers:  # only dense layers left: a dense model
            changes.update(num_experts=0, top_k=0, expert_ffn_size=0, num_shared_experts=0,
                           shared_expert_ffn_size=0, dense_layers=())
        else:
            changes["dense_layers"] = dense
    if cfg.linear:
        kept = tuple(i for i in cfg.linear_layers if i < layers)
        if kept:
            raise ConfigError(_hybrid_draft(f"layers:{layers}", f"{cfg.name}-first{layers}", len(kept),
                                            cfg.linear_kind))
        changes.update(linear_kind="none", linear_layers=(), linear_key_heads=0, linear_value_heads=0,
                       linear_key_dim=0, linear_value_dim=0, linear_conv=0,
                       nope_layers=tuple(i for i in cfg.nope_layers if i < layers))
    return cfg.replace(**changes)


def truncated_model(m: Model, layers: int) -> Model:
    """The model's first `layers` layers with its own final norm and lm_head: a draft model that
    needs no extra weights (self-speculative early exit; the arrays are shared, not copied)."""
    cfg = truncated_config(m.cfg, layers)
    params = dict(m.params)
    params["layers"] = list(m.params["layers"][:layers])
    return Model(cfg, params, f"first {layers} of {m.cfg.num_layers} layers of the target ({m.source})", m.quant)


def check_draft_mixer(spec: str, cfg: ModelConfig) -> None:
    """A draft model is rolled back to the accepted drafts by its cache lengths alone
    (`tpumk.decode.drafters.DraftModelDrafter`): a linear-attention layer's state has taken in
    every draft, so a hybrid draft is refused (the target may be one: its pool keeps each
    verify step's tokens pending, `tpumk.decode.speculative`)."""
    if cfg.linear_layers:
        raise ConfigError(_hybrid_draft(spec, cfg.name, len(cfg.linear_layers), cfg.linear_kind))


def _hybrid_draft(spec: str, name: str, count: int, kind: str) -> str:
    return (f"--draft-model {spec}: '{name}' has linear-attention layers ({count}, {kind}), whose state cannot be "
            "rolled back to the accepted drafts; use a softmax-attention draft model or --spec ngram")


def load_draft_model(spec: str, target: Model, seed: int = 0, dtype: str | None = None) -> Model:
    """--draft-model: `layers:N` (the target's first N layers), a checkpoint directory
    (config.json + *.safetensors), or a preset / TOML / config.json with random weights (seed
    `seed`). The draft must share the target's vocabulary and dtype is the target's unless given."""
    check_draft_option(spec, "draft")
    spec = spec.strip()
    if spec.startswith("layers:"):
        return truncated_model(target, int(spec.split(":", 1)[1]))
    if _is_checkpoint_dir(spec):
        d = load_model(None, spec, dtype=dtype or target.cfg.dtype)
    else:
        d = load_model(spec, None, seed=seed, dtype=dtype or target.cfg.dtype)
    check_draft_vocab(spec, d.cfg.vocab_size, target.cfg.vocab_size)
    check_draft_mixer(spec, d.cfg)
    return d


def _is_checkpoint_dir(spec: str) -> bool:
    """A --draft-model that names a checkpoint directory (config.json + *.safetensors), not a model file."""
    from tpumk.files import is_dir

    return is_dir(Path(spec)) and any(Path(spec).glob("*.safetensors"))


def check_draft_vocab(spec: str, draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ConfigError(f"--draft-model {spec}: vocabulary {draft_vocab} != the target's {target_vocab} "
                          "(a draft must propose the target's token ids)")


def prompt_tokenizer(checkpoint: str | None):
    """--prompt's tokenizer: the checkpoint's (tpumk.model.tokenizer); random weights have none."""
    if checkpoint is None:
        raise ConfigError("--prompt: needs --checkpoint with a tokenizer (a GGUF file, or a checkpoint directory "
                          "with tokenizer.json); with --model give --prompt-ids")
    from tpumk.model.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """--prompt's token ids, at least one (encoded before any weights load: a tokenizer that
    cannot encode the text fails first)."""
    ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError("--prompt: the text encodes to no tokens (expected a non-empty prompt)")
    return ids


def check_prompt_vocab(ids: list[int], vocab_size: int) -> None:
    """--prompt's ids each inside the model's vocabulary."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"--prompt: the tokenizer gives id {bad}, outside the model's vocabulary of {vocab_size}")


_ID = re.compile(r"[0-9]+", re.ASCII)


def parse_prompt_ids(text: str, vocab_size: int) -> list[list[int]]:
    """'1,2,3;4,5' -> [[1,2,3],[4,5]]; every id is ASCII digits only (no sign, underscore or
    non-ASCII digit, which int() would accept) and in [0, vocab_size). An empty item ('1,,2', a
    trailing comma) is refused, not dropped; an id of more digits than the vocabulary's size is
    refused before int() (which refuses past 4300 digits with a ValueError of its own)."""
    prompts = []
    max_digits = len(str(vocab_size))
    for k, part in enumerate(text.split(";")):
        items = [s.strip() for s in part.split(",")]
        if not any(items):
            raise ConfigError(f"--prompt-ids: sequence {k} is empty (expected comma-separated token ids)")
        ids = []
        for j, s in enumerate(items):
            if not s:
                raise ConfigError(f"--prompt-ids: sequence {k} has an empty item at position {j} (e.g. '1,,2' or a "
                                  "trailing comma; expected comma-separated token ids such as 1,2,3;4,5)")
            if not _ID.fullmatch(s):
                raise ConfigError(f"--prompt-ids: sequence {k} holds {s[:40]!r}, expected a token id of ASCII digits "
                                  "0-9 only (e.g. 1,2,3;4,5)")
            if len(s.lstrip("0")) > max_digits:
                shown = s if len(s) <= 20 else f"{s[:20]}... ({len(s)} digits)"
                raise ConfigError(f"--prompt-ids: id {shown} outside the vocabulary [0, {vocab_size})")
            ids.append(int(s.lstrip("0") or "0"))  # int() counts leading zeros against its digit limit
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ConfigError(f"--prompt-ids: id {bad[0]} outside the vocabulary [0, {vocab_size})")
        prompts.append(ids)
    return prompts


def check_sizes(steps, page_size, draft_tokens) -> None:
    """--steps, --page-size and --draft-tokens within the BuildSpec bounds (tpumk.plan.spec), so
    an absurd value is refused before a model is loaded or a cache allocated."""
    if not _positive_int(steps, MAX_CONTEXT):
        raise ConfigError(f"--steps: expected a positive number of steps at most {MAX_CONTEXT:,} (the longest context "
                          f"a sequence can have), got {_short(steps)}")
    if not _positive_int(page_size, MAX_PAGE_SIZE):
        raise ConfigError(f"--page-size: expected a positive number of tokens per KV-cache page at most "
                          f"{MAX_PAGE_SIZE:,}, got {_short(page_size)}")
    if not _positive_int(draft_tokens, MAX_Q_LEN - 1):
        raise ConfigError(f"--draft-tokens: expected a positive integer at most {MAX_Q_LEN - 1:,} (a verify step "
                          f"checks draft tokens + 1 <= {MAX_Q_LEN:,} tokens), got {_short(draft_tokens)}")


def prepare_devices(devices) -> None:
    """--devices: a positive integer within the BuildSpec bound; for more than one, make the
    host CPU devices interpret mode runs them on (before anything starts JAX's backends)."""
    from tpumk.plan.spec import MAX_DEVICES
    from tpumk.targets import ensure_host_devices

    if not _positive_int(devices, MAX_DEVICES):
        raise ConfigError(f"--devices: expected a positive integer at most {MAX_DEVICES}, got {_short(devices)}")
    ensure_host_devices(devices)


def generate(m: Model, prompts: list[list[int]], steps: int, backend: str = "reference",
             page_size: int = 16, context: int | None = None, spec: str = "none",
             draft_tokens: int = DEFAULT_DRAFT_TOKENS, draft: Model | None = None, devices: int = 1,
             on_token=None, kv_dtype: str = "") -> dict:
    """Greedy-generate `steps` tokens per prompt; returns tokens, timing and, with `spec`
    ("ngram": prompt lookup; "draft": the `draft` model, see load_draft_model), the speculation
    figures. Speculation never changes the tokens: each target step verifies `draft_tokens`
    drafts (q = draft_tokens + 1) and keeps only what greedy decoding would produce.
    `devices` > 1 runs the target's megakernel over that many devices (host CPU devices in
    interpret mode without a TPU; a draft model stays on one device). `kv_dtype` ("fp8",
    "int8"): the target's KV cache in that 1-byte format (tpumk.model.kv_quant), for both
    backends alike; a draft model's cache stays in its dtype.

    Every size is bounded by the BuildSpec limits (tpumk.plan.spec) before the KV cache is
    allocated: a sequence holds at most MAX_CONTEXT tokens (prompt + steps + drafts), the
    prompts are at most MAX_BATCH sequences, the verify step at most MAX_Q_LEN tokens; and the
    cache must fit in this host's memory."""
    check_sizes(steps, page_size, draft_tokens)
    check_prompts(prompts, steps, spec, draft_tokens)
    check_methods(backend, spec, devices)
    if spec == "none" and draft is not None:
        raise ConfigError("--draft-model: only used with --spec draft")
    if spec == "draft" and draft is None:
        raise ConfigError("--spec draft: needs --draft-model NAME|FILE|DIR|layers:N")
    if draft is not None and draft.cfg.vocab_size != m.cfg.vocab_size:
        raise ConfigError(f"--draft-model: vocabulary {draft.cfg.vocab_size} != the target's {m.cfg.vocab_size}")
    if draft is not None:
        check_draft_mixer(draft.cfg.name, draft.cfg)
    k = draft_tokens if spec != "none" else 0
    need = max(len(p) for p in prompts) + steps + k
    context = need if context is None else context
    if not _positive_int(context, MAX_CONTEXT):
        raise ConfigError(f"--context: expected a positive number of tokens at most {MAX_CONTEXT:,}, "
                          f"got {_short(context)}")
    if context < need:
        raise ConfigError(f"--context: {context} tokens < {need} needed for the longest prompt plus steps"
                          + (f" plus {k} draft tokens" if k else ""))
    context = -(-context // page_size) * page_size  # the cache holds whole pages (plans require it)
    longest = max(len(p) for p in prompts)
    chunks = [(1, longest), (len(prompts), k + 1)]  # the longest prompt's prefill; a decode / verify step
    flag = "--prompt-ids" if longest > steps + k else "--steps"
    check_host_memory(m.cfg, len(prompts), context, chunks, flag=flag, pending=k + 1)
    if draft is not None:
        check_host_memory(draft.cfg, len(prompts), context, chunks, flag=flag, whose="the draft model ")
    kv_dtype = "" if kv_dtype in ("", "none", None) else kv_dtype
    # a hybrid's state pool holds as many pending rows as the megakernel's steps have tokens
    cache = _init_cache(m.cfg, len(prompts), context, page_size, "", kv_dtype, pending=k + 1)
    ref_step = reference_step(m.cfg)
    t0 = time.perf_counter()
    spec_info: dict = {"method": spec}
    if spec == "none":
        def ticked(decode):  # `on_token()` after each one-token step (a progress bar's tick)
            if on_token is None:
                return decode

            def run(toks, pos, c):
                out = decode(toks, pos, c)
                on_token()
                return out
            return run

        if backend == "reference":
            decode = ticked(lambda toks, pos, c: ref_step(m.params, toks, pos, c))
        else:
            decode = ticked(_kernel_decode_fn(m, len(prompts), context, page_size, 1, devices, kv_dtype)[0])
        tokens, _ = reference.greedy_generate(m.params, m.cfg, prompts, steps, cache, step_fn=ref_step,
                                              decode_fn=decode)
        spec_info.update(target_steps=steps - 1, tokens_per_target_step=1.0)
    else:
        from tpumk.decode.drafters import DraftModelDrafter, NgramDrafter
        from tpumk.decode.speculative import speculative_generate

        if spec == "ngram":
            drafter = NgramDrafter()
        else:
            dcache = _init_cache(draft.cfg, len(prompts), context, page_size, "the draft model's ")
            d_ref = reference_step(draft.cfg)
            if backend == "reference":
                d_decode = lambda toks, pos, c: d_ref(draft.params, toks, pos, c)  # noqa: E731
            else:
                d_decode, _ = _kernel_decode_fn(draft, len(prompts), context, page_size, 1)
            drafter = DraftModelDrafter(draft.cfg, draft.params, d_decode, dcache, prefill_step=d_ref,
                                        label=f"{draft.cfg.name} ({draft.source})")
        verify = None
        if backend == "megakernel":
            verify, _ = _kernel_decode_fn(m, len(prompts), context, page_size, k + 1, devices, kv_dtype)
        tokens, _, stats = speculative_generate(m.params, m.cfg, prompts, steps, cache, drafter, k,
                                                step_fn=ref_step, verify_fn=verify)
        spec_info.update(stats.to_dict())
        spec_info.update(drafter.summary())
        spec_info["note"] = ("acceptance counts are exact token comparisons on this host; "
                             "tokens_per_target_step = (steps - 1) / verify steps (plain greedy: 1)")
    seconds = time.perf_counter() - t0
    if backend == "reference":
        where = "reference decode step (pure JAX) on this host"
    else:
        where = _megakernel_where(devices)
    return {
        "model": m.cfg.name, "backend": backend, "devices": devices, "weights": m.source, "steps": steps,
        "kv_dtype": kv_dtype or m.cfg.dtype,
        "prompts": prompts, "tokens": tokens, "seconds": seconds, "ran_on": where, "spec": spec_info,
        "timing_note": "wall time on this host, including compilation; not a TPU speed figure",
    }


def _positive_int(n, upper: int | None = None) -> bool:
    return (isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1
            and (upper is None or n <= upper))


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:20]}... ({len(r)} characters)"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _host_memory_bytes() -> int | None:
    """The memory this host can give a request now: MemAvailable (Linux), else the physical
    memory."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def step_working_bytes(cfg: ModelConfig, rows: int, q: int, context: int) -> int:
    """An estimate of the largest temporaries of one reference step of `rows` sequences x `q`
    tokens over a `context`-token cache (a prefill chunk is 1 x prompt length): the float32
    attention scores and probabilities [rows, Hq, q, context] (four live copies: scores, the
    masked scores, the softmax and its exponentials; a 20,000-token prefill of tiny-dense was
    measured at 12 GB resident, this gives 13), the key-validity mask, the float32 logits [rows, q, vocab]
    (two), the FFN activations (the reference evaluates every routed expert densely:
    [E, rows * q, 3 * expert width + hidden]), and a hybrid's linear layers: q, k, v, the
    decays and the outputs per token [value heads, key dim] float32 (six) and, for a prompt,
    one chunk's pairwise decays [rows, chunk, chunk, value heads, key dim] (two:
    `linear_attention.delta_chunked`)."""
    n = rows * q
    attn = 4 * 4 * rows * cfg.num_q_heads * q * context + 2 * rows * q * context
    logits = 2 * 4 * n * cfg.vocab_size
    ffn = 3 * 4 * n * max(cfg.ffn_size, cfg.hidden_size)
    if cfg.is_moe:
        ffn = max(ffn, 4 * n * cfg.num_experts * (3 * cfg.moe.expert_ffn_size + cfg.hidden_size))
    linear = 0
    if cfg.linear:
        from tpumk.model.linear_attention import CHUNK

        head = cfg.linear.linear_value_heads * cfg.linear.linear_key_dim
        linear = 6 * 4 * n * head + 2 * 4 * rows * CHUNK * min(q, CHUNK) * head
    return int(attn + logits + ffn + linear)


def _cache_bytes(cfg: ModelConfig, batch: int, context: int, pending: int) -> tuple[int, str]:
    """(bytes, 'what they are, needs') of the cache a request allocates: the KV cache of its
    attention layers and, for a hybrid, the linear layers' state pool (one slot per sequence)."""
    from tpumk.model.linear_attention import pool_bytes

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'s' if n != 1 else ''}"

    kv = batch * context * cfg.kv_bytes_per_token()
    pool = pool_bytes(cfg, batch, pending)
    if not pool:
        return kv, f"KV cache of {batch} x {context:,} tokens ({count(cfg.num_layers, 'layer')}, {cfg.name}) needs"
    return kv + pool, (f"KV cache of {batch} x {context:,} tokens ({count(cfg.kv_layers, 'attention layer')}, "
                       f"{cfg.name}) and its state pool ({count(len(cfg.linear_layers), 'linear layer')} x "
                       f"{count(batch, 'slot')}) need")


def check_host_memory(cfg: ModelConfig, batch: int, context: int, chunks: list[tuple[int, int]],
                      flag: str = "--steps", whose: str = "", pending: int = 0) -> None:
    """Refuse (one line naming `flag`) a request whose KV cache of `batch` x `context` tokens (a
    hybrid's with its state pool of `pending` rows per slot) plus the largest step's
    temporaries (`step_working_bytes` over each (rows, q) in `chunks`: the longest prompt's
    prefill, the decode or verify step) would not fit in this host's memory, before anything is
    allocated or compiled. Arithmetic only, so it runs first."""
    host = _host_memory_bytes()
    kv, what = _cache_bytes(cfg, batch, context, pending)
    work = max((step_working_bytes(cfg, r, q, context) for r, q in chunks), default=0)
    if host is not None and kv > host:
        raise ConfigError(f"{flag}: the {whose}{what} {_size(kv)}, more than this host's {_size(host)} of memory "
                          "(fewer --steps, shorter prompts or fewer sequences)")
    if host is not None and kv + work > host:
        rows, q = max(chunks, key=lambda c: step_working_bytes(cfg, c[0], c[1], context))
        cache = "KV cache and state pool" if cfg.linear else "KV cache"
        raise ConfigError(f"{flag}: {whose}{cfg.name} over {batch} x {context:,} tokens needs about {_size(kv + work)} "
                          f"({cache} {_size(kv)}, the {rows} x {q:,}-token step's temporaries {_size(work)}), more "
                          f"than this host's {_size(host)} of available memory (fewer --steps, shorter prompts or fewer "
                          "sequences)")


def _init_cache(cfg: ModelConfig, batch: int, context: int, page_size: int, whose: str, kv_dtype: str = "",
                pending: int = 1):
    """reference.init_cache, refused with one line when its K and V arrays (and a hybrid's state
    pool) would not fit in this host's memory or the allocation fails (instead of an allocator's
    traceback)."""
    pending = pending if cfg.linear else 0
    nbytes, what = _cache_bytes(cfg, batch, context, pending)
    what = f"{whose}{what} {_size(nbytes)}"
    check_host_memory(cfg, batch, context, [], whose=whose, pending=pending)
    try:
        return reference.init_cache(cfg, batch, context, page_size=page_size, kv_dtype=kv_dtype or None,
                                    pending=pending)
    except MemoryError:
        raise ConfigError(f"--steps: the {what}, which this host cannot allocate") from None
    except Exception as e:  # an accelerator out of memory (XlaRuntimeError RESOURCE_EXHAUSTED)
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ConfigError(f"--steps: the {what}, which the device cannot allocate (RESOURCE_EXHAUSTED)") from None


def _megakernel_where(devices: int = 1) -> str:
    from tpumk.targets import attached_target

    target = attached_target()
    on = f"{devices} devices" if devices > 1 else "one device"
    return (f"megakernel on {on} of an attached {target.name}" if target is not None
            else f"megakernel in Pallas TPU interpret mode on {on} of the host (prefill by the reference)")


@functools.lru_cache(maxsize=16)
def _kernel_step(cfg: ModelConfig, batch: int, context: int, page_size: int, q_len: int, devices: int = 1,
                 quant: str = "none", kv_dtype: str = "", taps: tuple[int, ...] = ()):
    """(plan, step) of the megakernel for these shapes, on an attached TPU when there is one,
    else in Pallas TPU interpret mode on the host. Cached so repeated generations in one
    process (tests, notebooks) trace and compile each shape once."""
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.plan.plan import make_plan
    from tpumk.plan.spec import BuildSpec
    from tpumk.targets import attached_target, ensure_host_devices, get_target

    target = attached_target() or get_target("cpu")
    if target.interpret:
        ensure_host_devices(devices)
    plan = make_plan(BuildSpec(cfg, target, batch, context, q_len=q_len, page_size=page_size, devices=devices,
                               quant=quant, kv_dtype=kv_dtype, taps=taps))
    return plan, make_decode_step(plan)


def _kernel_decode_fn(m: Model, batch: int, context: int, page_size: int, q_len: int, devices: int = 1,
                      kv_dtype: str = ""):
    """decode_fn(tokens, positions, cache) of the megakernel with `m`'s weights packed; prefill
    stays with the reference (the prompt is one multi-token chunk per sequence; the cache
    layout is shared). On many devices the cache goes through the sharded layout and back
    (`ShardingPlan.expand_cache`: the same array unless KV heads are replicated)."""
    from tpumk.kernel.layout import pack_sharded

    plan, step = _kernel_step(m.cfg, batch, context, page_size, q_len, devices, m.quant, kv_dtype)
    packed = pack_sharded(plan, m.params)
    to_kernel, from_kernel = kernel_cache_layout(m.cfg, plan)

    def decode(toks, pos, c):
        logits, out = step(packed, toks, pos, to_kernel(c))
        return logits, from_kernel(out)
    return decode, plan


def kernel_cache_layout(model_cfg: ModelConfig, plan):
    """(to_kernel, from_kernel): the reference's cache into the layout the plan's step takes and
    back: lane padding (a lane-padded model runs the padded copy, tpumk.plan.padding), then the
    sharded KV layout (`ShardingPlan.expand_kv`: the same array unless KV heads are replicated)."""
    from tpumk.plan.padding import pad_cache, unpad_cache

    sh, cfg = plan.sharding, plan.whole_model

    def to_kernel(c):
        c = pad_cache(model_cfg, cfg, c) if plan.unpadded is not None else c
        return sh.expand_kv(cfg, c) if sh is not None else c

    def from_kernel(c):
        c = sh.collapse_kv(cfg, c) if sh is not None else c
        return unpad_cache(model_cfg, cfg, c) if plan.unpadded is not None else c
    return to_kernel, from_kernel
