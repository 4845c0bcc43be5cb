"""The evidence behind the KV cache's scale granularity (tpumk.model.kv_quant; docs/quantization.md).

Runs `tpumk quality`'s fixed prompts through the reference decode step with the float weights and
three caches: the model dtype, the 1-byte format tpumk uses (one power-of-two scale per token
and kv head), and the alternative (one per page and kv head). A per-page scale is the page's
largest row's; when a new row raises it, every row already on the page is re-quantized to the
new scale (what an in-place page update would have to do), which this script simulates by
replacing the packed layout's row writer (`kv_quant.PagedLayout.write`) for the run. Prints the logit relative RMS and greedy agreement of both
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


def per_page_write(self, cache, layer, page_ids, slots, rows):
    """`PagedLayout.write` with one scale per (page, tensor, kv head): every slot of a page holds
    the page's scale (the power of two of its largest row); a new row that raises it
    re-quantizes the page's earlier rows (re-quantizing at an unchanged power-of-two scale gives
    the same codes)."""
    fmt = self.fmt
    codes, exps = self.unpack(cache[layer])  # [pages, P, T, H, D], [pages, P, T, H]
    data = kv_quant.dequantize_rows(codes, kv_quant.scales_of(exps), jnp.float32)
    data = data.at[page_ids, slots].set(rows.astype(jnp.float32), mode="drop")
    scale, inverse = kv_quant.pow2_scales(jnp.abs(data).max(axis=(1, 4)), fmt)  # [pages, T, H]
    y = data * inverse[:, None, :, :, None]
    new = (jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax) if fmt.name == "int8" else y).astype(fmt.dtype)
    full = jnp.broadcast_to(scale[:, None], exps.shape)
    return cache.at[layer].set(self.pack(new, kv_quant.exponent_bytes(full)))


def measure(cfg, params, kv_dtype: str, steps: int) -> dict:
    prompts = fixed_prompts(cfg.vocab_size)
    want, forced = _logits(cfg, params, prompts, None, steps)
    out = {}
    per_token = kv_quant.PagedLayout.write
    for name, writer in (("per token and kv head", per_token), ("per page and kv head", per_page_write)):
        kv_quant.PagedLayout.write = writer
        ref.jitted_decode_step.cache_clear()  # the writer is traced into the compiled step
        try:
            got, _ = _logits(cfg, params, prompts, forced, steps, kv_dtype=kv_dtype)
        finally:
            kv_quant.PagedLayout.write = per_token
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
        heads, width, tensors = kv_quant.cache_rows(m.cfg)
        # what a bfloat16 cache stores per token and layer (an MLA latent row lane-padded)
        bf16_row = m.cfg.replace(dtype="bfloat16").kv_bytes_per_token() / m.cfg.num_layers
        for kv in a.kv_dtype:
            packed = kv_quant.layout_for(m.cfg, PAGE, kv)  # the page tpumk stores: codes, exponents, padding
            row = {"model": m.cfg.name, "source": m.source, "kv_dtype": kv, "steps": a.steps,
                   **measure(m.cfg, m.params, kv, a.steps),
                   "bytes_vs_bf16": {"per token and kv head": packed.page_bytes / (PAGE * bf16_row),
                                     "per page and kv head (a float32 scale, unpadded)":
                                         (width + 4 / PAGE) / (2 * width)}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
