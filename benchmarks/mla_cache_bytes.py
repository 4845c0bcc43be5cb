"""What the MLA latent cache saves against a per-head cache: tpumk's byte count, not a measurement.

For each MLA preset it prints the KV cache bytes per token and per sequence at a context: the
latent c_kv and the roped key part per token and layer, in the model dtype, beside the cache the same model would need if it kept every head's key
(qk_nope + qk_rope lanes) and value (v_head_dim lanes), as a non-absorbed implementation does.
A decode step reads every cached token of the sequence once, so the same ratio applies to the
cache bytes one step reads. The padded column pads each part to 128 lanes (one 640-lane row, the
layout of vLLM's TPU MLA kernel, TPU_FACTS 10). tpumk's paged cache stores the whole row
lane-padded (`ModelConfig.kv_bytes_per_token`, what the plan's HBM check counts: C + R rounded
up to 128 lanes), which for DeepSeek-V3 and Kimi K2 is the same 640 lanes.

    python benchmarks/mla_cache_bytes.py [--preset deepseek-v3 kimi-k2] [--context 32768] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(presets, context: int) -> list[dict]:
    from tpumk.model.config import load_preset
    from tpumk.plan.geometry import LANE, round_up

    out = []
    for name in presets:
        cfg = load_preset(name)
        latent = cfg.num_layers * cfg.attention.kv_cache_width * cfg.dtype_bytes
        per_head = cfg.num_layers * cfg.num_q_heads * (cfg.head_dim + cfg.v_head_dim) * cfg.dtype_bytes
        padded = cfg.num_layers * (round_up(cfg.kv_lora_rank, LANE) + round_up(cfg.qk_rope_head_dim, LANE)) \
            * cfg.dtype_bytes
        out.append({"preset": name, "context": context, "dtype": cfg.dtype,
                    "latent_bytes_per_token": latent, "per_head_bytes_per_token": per_head,
                    "latent_padded_bytes_per_token": padded,
                    "latent_bytes_per_sequence": latent * context, "per_head_bytes_per_sequence": per_head * context,
                    "latent_padded_bytes_per_sequence": padded * context,
                    "per_head_over_latent": per_head / latent, "per_head_over_padded": per_head / padded})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="*", default=["deepseek-v3", "kimi-k2"])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    table = rows(a.preset, a.context)
    if a.json:
        print(json.dumps(table, indent=1))
        return 0
    print("| preset | per token: latent | per-head K+V | latent, 128-lane padded | per sequence at "
          f"{a.context:,}: latent | per-head | padded | per-head / latent | per-head / padded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['preset']} | {r['latent_bytes_per_token']:,} B | {r['per_head_bytes_per_token']:,} B | "
              f"{r['latent_padded_bytes_per_token']:,} B | {r['latent_bytes_per_sequence'] / 1e9:.2f} GB | "
              f"{r['per_head_bytes_per_sequence'] / 1e9:.1f} GB | {r['latent_padded_bytes_per_sequence'] / 1e9:.2f} GB | "
              f"{r['per_head_over_latent']:.1f}x | {r['per_head_over_padded']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
