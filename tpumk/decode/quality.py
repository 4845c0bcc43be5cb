"""What a weight format costs in accuracy: the logits of a quantized model against the float model.

`logit_quality(model, schemes)` runs the reference decode step over a fixed set of prompts
(seeded, so the same for every run and scheme) for the float weights and for each scheme's
quantized copy, teacher-forced on the float model's greedy tokens so both see the same inputs,
and reports the relative RMS error of all those logits (`tpumk.model.quantize.relative_rms`)
and how often the greedy token agrees. The published int8 per-column scheme reports 1.0-1.3 %
relative RMS per matrix (TPU_FACTS 9); these figures are per model, over whole decode steps.
`kv_dtypes` does the same for a KV cache in one byte per element (`tpumk.model.kv_quant`): the
float weights, the cache quantized as it is written.
Everything runs on this host with the pure-JAX reference: no TPU is involved.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from tpumk.errors import ConfigError
from tpumk.model import kv_quant, sparse_attention
from tpumk.model import reference as ref
from tpumk.model.quantize import canonical_scheme, quantize_params, relative_rms

PROMPTS = 4  # fixed prompts, 8..14 tokens, drawn from the vocabulary with seed 0
STEPS = 8  # decode steps after each prompt


def fixed_prompts(vocab_size: int, count: int = PROMPTS) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, vocab_size, 8 + 2 * i)] for i in range(count)]


def _logits(cfg, params, prompts: Sequence[Sequence[int]], forced: list[np.ndarray] | None, steps: int,
            kv_dtype: str | None = None):
    """Prefill logits then `steps` decode-step logits per prompt ([B, 1 + steps, V]); the next
    token is `forced[step]` when given, else this model's greedy token. `kv_dtype`: the cache
    in that 1-byte format (else the model dtype)."""
    cache = ref.init_cache(cfg, len(prompts), ref_context(prompts, steps), kv_dtype=kv_dtype)
    step = ref.jitted_decode_step(cfg)
    last, cache = ref.prefill(params, cfg, prompts, cache, step_fn=step, batched=True)  # one shape, not one per prompt
    out, tokens = [np.asarray(last, np.float32)], []
    for i in range(steps):
        tok = forced[i] if forced is not None else np.argmax(out[-1], -1)
        tokens.append(tok)
        positions = np.asarray(cache.lengths)[:, None]
        logits, cache = step(params, jnp.asarray(tok[:, None], jnp.int32), jnp.asarray(positions, jnp.int32), cache)
        out.append(np.asarray(logits[:, -1], np.float32))
    return np.stack(out, 1), tokens


def ref_context(prompts, steps: int, page: int = 16) -> int:
    longest = max(len(p) for p in prompts) + steps + 1
    return -(-longest // page) * page


def check_request(steps: Any, schemes: Sequence[str], longest: int = 8 + 2 * (PROMPTS - 1),
                  kv_dtypes: Sequence[str] = ()) -> None:
    """--steps a positive count within the longest context after the longest prompt, --quant
    schemes and --kv-dtype formats each parsing and none given twice, at least one of either:
    checked before a model is loaded (`longest` defaults to the fixed prompts' longest)."""
    from tpumk.plan.spec import MAX_CONTEXT

    upper = MAX_CONTEXT - longest - 1
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= upper):
        raise ConfigError(f"--steps: expected a positive number of decode steps at most {upper:,} (the longest "
                          f"context a sequence can have, less the prompt), got {steps!r:.40}")
    try:
        names = [canonical_scheme(s) for s in schemes]
    except ConfigError as e:
        raise ConfigError(f"--quant: {e}") from None
    for k in kv_dtypes:
        kv_quant.kv_format(k)
    if not names and not kv_dtypes:
        raise ConfigError("--quant: expected at least one scheme (or a --kv-dtype) to compare with the float model")
    for flag, given in (("--quant", names), ("--kv-dtype", list(kv_dtypes))):
        dup = next((n for i, n in enumerate(given) if n in given[:i]), None)
        if dup is not None:
            raise ConfigError(f"{flag}: {dup} given twice")


def logit_quality(cfg, params: dict, schemes: Sequence[str], steps: int = STEPS,
                  prompts: Sequence[Sequence[int]] | None = None, progress=None,
                  kv_dtypes: Sequence[str] = ()) -> dict[str, Any]:
    """Relative RMS of the logits and greedy agreement of each weight scheme, and of each KV
    cache format (`kv_dtypes`, float weights), against `params` (float) with a model-dtype cache.
    `progress(phase)` is called as the float decode and each scheme's start (tpumk.cli.progress)."""
    say = progress or (lambda phase: None)
    from tpumk.decode.generate import check_host_memory

    if any(not isinstance(v, (np.ndarray, jnp.ndarray)) for v in params["layers"][0].values()):
        raise ConfigError("quality: the weights are quantized already; give float weights to compare against")
    prompts = [list(p) for p in (prompts or fixed_prompts(cfg.vocab_size))]
    longest = max(len(p) for p in prompts)
    check_request(steps, schemes, longest, kv_dtypes)
    schemes = [canonical_scheme(s, cfg) for s in schemes]
    check_host_memory(cfg, len(prompts), ref_context(prompts, steps), [(1, longest), (len(prompts), 1)])
    say(f"float decode: {len(prompts)} prompts x {1 + steps} steps (the reference)")
    want, forced = _logits(cfg, params, prompts, None, steps)
    def compared(got) -> dict[str, float]:
        return {"logit_relative_rms": relative_rms(got, want),
                "greedy_agreement": float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))}

    rows = []
    for i, scheme in enumerate(schemes):
        name = canonical_scheme(scheme, cfg)
        say(f"{name} ({i + 1}/{len(schemes)}): quantize, then the same decode")
        got, _ = _logits(cfg, quantize_params(cfg, params, name), prompts, forced, steps)
        rows.append({"quant": name, **compared(got)})
    kv_rows = []
    heads, width, tensors = kv_quant.cache_rows(cfg)
    model_bytes = cfg.kv_bytes_per_token()  # what the model-dtype cache stores (an MLA row lane-padded)
    # a sparse model's index-key cache beside it: Di model-dtype lanes, or Di fp8 codes and a float32 scale
    index_keys, di = len(cfg.indexer_layers) if cfg.attention.is_sparse else 0, cfg.attention.index_head_dim
    model_bytes += index_keys * di * cfg.dtype_bytes
    for kv in kv_dtypes:
        say(f"KV cache {kv}: the same decode, the cache quantized as it is written")
        got, _ = _logits(cfg, params, prompts, forced, steps, kv_dtype=kv)
        fmt_bytes = kv_quant.cache_bytes_per_token(heads, width, cfg.kv_layers, kv_quant.kv_format(kv), tensors=tensors)
        fmt_bytes += index_keys * (di + sparse_attention.INDEX_SCALE_BYTES)
        kv_rows.append({"kv_dtype": kv, **compared(got), "kv_bytes_per_token": fmt_bytes,
                        "kv_bytes_vs_model_dtype": fmt_bytes / model_bytes})
    return {"model": cfg.name, "dtype": cfg.dtype, "prompts": len(prompts), "steps": steps,
            "tokens_compared": len(prompts) * (1 + steps), "schemes": rows, "kv_formats": kv_rows,
            "kv_bytes_per_token": model_bytes,
            "source": "tpumk's reference decode step on this host (no TPU)"}
