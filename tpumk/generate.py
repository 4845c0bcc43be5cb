"""Greedy generation through a chosen backend (the user-visible proof a model is right).

Backends share one decode-step signature, `step(params, tokens[B,q], positions[B,q], cache)
-> (logits[B,q,V], cache)`, so prefill, the greedy loop and the paged cache are common code
(`tpumk.reference.greedy_generate`), and only the step differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tpumk import reference
from tpumk.config import ModelConfig, resolve_model
from tpumk.errors import ConfigError

BACKENDS = ("reference", "megakernel")


@dataclass
class Model:
    cfg: ModelConfig
    params: dict
    source: str  # "random weights (seed N)" or the checkpoint directory


def load_model(model: str | None, checkpoint: str | None, seed: int = 0, dtype: str | None = None) -> Model:
    """A model from a preset / TOML / config.json with random weights, or from a checkpoint."""
    if checkpoint and model:
        raise ConfigError("give either --model or --checkpoint, not both")
    if checkpoint:
        from tpumk.checkpoint import load_checkpoint

        cfg, params = load_checkpoint(Path(checkpoint), dtype=dtype)
        return Model(cfg, params, f"checkpoint {checkpoint}")
    from tpumk.weights import random_params

    cfg = resolve_model(model or "tiny-moe")
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    return Model(cfg, random_params(cfg, seed), f"random weights (seed {seed})")


def parse_prompt_ids(text: str, vocab_size: int) -> list[list[int]]:
    """'1,2,3;4,5' -> [[1,2,3],[4,5]]; every id must be in [0, vocab_size)."""
    prompts = []
    for k, part in enumerate(text.split(";")):
        items = [s.strip() for s in part.split(",") if s.strip()]
        if not items:
            raise ConfigError(f"--prompt-ids: sequence {k} is empty (expected comma-separated token ids)")
        try:
            ids = [int(s) for s in items]
        except ValueError:
            raise ConfigError(f"--prompt-ids: sequence {k} holds a non-integer id (expected e.g. 1,2,3;4,5)") from None
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ConfigError(f"--prompt-ids: id {bad[0]} outside the vocabulary [0, {vocab_size})")
        prompts.append(ids)
    return prompts


def generate(m: Model, prompts: list[list[int]], steps: int, backend: str = "reference",
             page_size: int = 16, context: int | None = None) -> dict:
    """Greedy-generate `steps` tokens per prompt; returns tokens and timing."""
    if steps < 1:
        raise ConfigError(f"--steps: expected a positive number of steps, got {steps}")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend: unknown backend '{backend}' (backends: {', '.join(BACKENDS)})")
    need = max(len(p) for p in prompts) + steps
    context = context or need
    if context < need:
        raise ConfigError(f"--context: {context} tokens < {need} needed for the longest prompt plus steps")
    cache = reference.init_cache(m.cfg, len(prompts), context, page_size=page_size)
    ref_step = reference.jitted_decode_step(m.cfg)
    t0 = time.perf_counter()
    if backend == "reference":
        tokens, _ = reference.greedy_generate(m.params, m.cfg, prompts, steps, cache, step_fn=ref_step)
        where = "reference decode step (pure JAX) on this host"
    else:
        tokens, where = _megakernel_generate(m, prompts, steps, cache, context, page_size, ref_step)
    seconds = time.perf_counter() - t0
    return {
        "model": m.cfg.name, "backend": backend, "weights": m.source, "steps": steps,
        "prompts": prompts, "tokens": tokens, "seconds": seconds, "ran_on": where,
        "timing_note": "wall time on this host, including compilation; not a TPU speed figure",
    }


def _megakernel_generate(m: Model, prompts, steps, cache, context, page_size, ref_step):
    """Prefill with the reference step (the prompt is one multi-token chunk per sequence; the
    cache layout is shared), then every generated token through the megakernel: on an attached
    TPU when there is one, else in Pallas TPU interpret mode on the host."""
    from tpumk.kernel.layout import pack_weights
    from tpumk.kernel.megakernel import make_decode_step
    from tpumk.plan import make_plan
    from tpumk.targets import attached_target, get_target

    target = attached_target() or get_target("cpu")
    plan = make_plan(m.cfg, target, len(prompts), context, page_size=page_size)
    kernel_step = make_decode_step(plan)
    packed = pack_weights(plan, m.params)
    tokens, _ = reference.greedy_generate(
        m.params, m.cfg, prompts, steps, cache, step_fn=ref_step,
        decode_fn=lambda toks, pos, c: kernel_step(packed, toks, pos, c))
    where = (f"megakernel on an attached {target.name}" if target.is_tpu
             else "megakernel in Pallas TPU interpret mode on the host (prefill by the reference)")
    return tokens, where
