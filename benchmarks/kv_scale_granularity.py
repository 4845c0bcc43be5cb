"""The evidence behind the KV cache's scale granularity (tpumk.model.kv_quant; docs/quantization.md).

Runs `tpumk quality`'s fixed prompts through the reference decode step with the float weights and
three caches: the model dtype, the 1-byte format tpumk uses (one scale per token and kv head),
and the alternative (one scale per page and kv head). A per-page scale is the page's largest
row's; when a new row raises it, every row already on the page is re-quantized to the new scale
(what an in-place page update would have to do), which this script simulates by replacing the
reference's row writer for the run. Prints the logit relative RMS and greedy agreement of both
against the model-dtype cache, and the bytes per token of each. Everything runs on this host's
CPU with random weights (--seed) or a checkpoint; no TPU is involved.

    python benchmarks/kv_scale_granularity.py [--model tiny-dense ...] [--checkpoint DIR ...]
                                              [--kv-dtype fp8 int8] [--steps 8]
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from tpumk.decode import generate as gen
from tpumk.decode.quality import _logits, fixed_prompts
from tpumk.model import kv_quant
from tpumk.model import reference as ref
from tpumk.model.quantize import relative_rms

PAGE = 16  # the page size of the reference caches `_logits` makes (init_cache's default)


def per_page_write(codes, scales, layer, page_ids, slots, rows):
    """`reference.write_quantized` with one scale per (page, kv head): every slot of a page
    holds the page's scale; a new row that raises it re-quantizes the page's earlier rows."""
    fmt = kv_quant.format_of(codes)
    b, t, heads, d = rows.shape
    lay_codes, lay_scales = codes[layer], scales[layer]  # [pages, ps, H*D], [pages, ps, H]
    pages, ps = lay_scales.shape[:2]
    old = kv_quant.dequantize_rows(lay_codes.reshape(pages, ps, heads, d), lay_scales, jnp.float32)
    rows = rows.astype(jnp.float32)
    page_scale = lay_scales.max(axis=1)  # [pages, H]: 0 on an empty page
    page_scale = page_scale.at[page_ids].max(jnp.abs(rows).max(-1) / fmt.qmax, mode="drop")
    full = jnp.broadcast_to(page_scale[:, None, :], (pages, ps, heads))
    data = old.at[page_ids, slots].set(rows, mode="drop")  # earlier rows (dequantized) and the new ones
    safe = jnp.where(full > 0, full, 1.0)[..., None]
    y = data / safe
    new = (jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax) if fmt.name == "int8" else y).astype(fmt.dtype)
    return codes.at[layer].set(new.reshape(pages, ps, heads * d)), scales.at[layer].set(full)


def measure(cfg, params, kv_dtype: str, steps: int) -> dict:
    prompts = fixed_prompts(cfg.vocab_size)
    want, forced = _logits(cfg, params, prompts, None, steps)
    out = {}
    per_token = ref.write_quantized
    for name, writer in (("per token and kv head", per_token), ("per page and kv head", per_page_write)):
        ref.write_quantized = writer
        ref.jitted_decode_step.cache_clear()  # the writer is traced into the compiled step
        try:
            got, _ = _logits(cfg, params, prompts, forced, steps, kv_dtype=kv_dtype)
        finally:
            ref.write_quantized = per_token
            ref.jitted_decode_step.cache_clear()
        out[name] = {"logit_relative_rms": relative_rms(got, want),
                     "greedy_agreement": float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="*", default=["tiny-dense", "tiny-moe"])
    ap.add_argument("--checkpoint", nargs="*", default=[])
    ap.add_argument("--kv-dtype", nargs="*", default=["fp8", "int8"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    loads = [(m, None) for m in a.model] + [(None, c) for c in a.checkpoint]
    for model, checkpoint in loads:
        m = gen.load_model(model, checkpoint, seed=a.seed, dtype=a.dtype)
        _, width, _ = kv_quant.cache_rows(m.cfg)
        for kv in a.kv_dtype:
            row = {"model": m.cfg.name, "source": m.source, "kv_dtype": kv, "steps": a.steps,
                   **measure(m.cfg, m.params, kv, a.steps),
                   "bytes_vs_bf16": {"per token and kv head": (width + 4) / (2 * width),
                                     "per page and kv head": (width + 4 / PAGE) / (2 * width)}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
