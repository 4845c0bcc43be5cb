"""How an N-device step splits the model: the sharding plan, and the per-device model it leaves.

One decode step spans N devices (TensorCores) on a 1-D mesh axis "tp", every device running the
same megakernel on its own slice of the weights (SPMD). The split, per family:

- attention: query heads split N ways (device d holds heads [d * Hq/N, (d+1) * Hq/N)); KV heads
  split with them while N <= Hkv, and replicated when N > Hkv (then N / Hkv devices hold, and
  write, the same KV head: the one their query heads read). 64-wide KV heads are laid out two
  per 128-lane block, so where that would leave a device one of them (N >= Hkv), devices hold
  KV heads in pairs ("paired"): the r = 2N / Hkv devices of pair p hold and write KV heads 2p
  and 2p + 1, and device slot s of them holds, of each of the two heads' G query heads, the
  s-th G / r (so every device's query heads split evenly over its two KV heads, as the kernel's
  head layout needs). The o-projection is split by its input rows (the device's heads), so
  each device holds a partial sum of o's output.
- MLA attention (head-parallel, as serving stacks shard it): q_b (or q), W_UK and W_UV are
  split by heads, o by its input rows as above. q_a and kv_a make the latent every head reads:
  either replicated (each device computes the same bits from the same all-reduced
  activations), or with `latent_split` split by output columns, device d computing columns
  [d * w, (d+1) * w) of each (w = ceil(width / N), zero-padded past the width), the kernel then
  all-gathering the slices so every device holds the whole latent (copies: the same bits; each
  column is computed as one device would). Their norms stay whole (applied after the gather). The latent cache is replicated: every device holds, and writes, the
  whole cache (the same rows), so a device's cache bytes are those of the whole latent cache.
  Sparse attention's indexer (its weights and its index-key cache) is replicated the same way:
  every device computes the same top-k selection with no collective, and its heads attend to
  the blocks it picks.
- dense FFN (and a MoE model's shared experts): split by width; gate / up by columns, down by
  rows: again a partial sum of the output.
- routed experts: `expert_parallel` groups of N / expert_parallel devices. Group g owns experts
  [g * E/ep, (g+1) * E/ep) (expert parallel); inside a group each expert's width is split
  (expert-tensor parallel). ep = 1 is pure expert-tensor parallel (every device streams every
  picked expert, a slice of its width), ep = N pure expert parallel. The router runs whole on
  every device over the replicated activations, so routing agrees everywhere.
- lm_head: split by vocabulary columns (device d scores tokens [d * V/N, (d+1) * V/N)).
- embedding, norms, router: replicated.

After the o-projection and after the FFN / MoE of every layer the partial sums are all-reduced
inside the kernel (`tpumk.kernel.collectives`), in a fixed device order, so every device holds
bit-identical activations: 2 all-reduces per layer (with the MLA latent split, one all-gather
of the q_a | kv_a slices before them). Each device computes the logits of its
vocabulary slice and all-gathers them in the kernel at the end, so every device returns them all.

`ShardingPlan.local_config(cfg)` is the model ONE device computes (its heads, widths, vocab
slice); the plan, the contract and the kernel are built from it exactly as for one device, plus
the collectives. `device_params` cuts reference-layout weights into a device's part;
`expand_cache` / `collapse_cache` convert a reference KV cache array to the sharded layout and
back; `expand_kv` / `collapse_kv` a whole reference cache (`KVCache` or `QuantizedKVCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tpumk.errors import PlanError
from tpumk.model.config import LAYER_NORMS, ModelConfig
from tpumk.model.weights import RESIDUAL_GATES
from tpumk.model.quantize import QuantizedMatrix, expert_format, quantized_weight_bytes
from tpumk.plan.geometry import LANE, round_up

# Sparse attention's lightning indexer (tpumk.model.sparse_attention): whole on every device
INDEXER_WEIGHTS = ("idx_wq", "idx_wk", "idx_k_norm", "idx_k_bias", "idx_weights",
                   # Mistral Large 4's: the queries' input LayerNorm and per-head log scales
                   "idx_q_norm", "idx_q_bias", "idx_log_scale", "idx_log_bias")


def mla_kv_a(cfg: ModelConfig, lay: dict):
    """A layer's wkv_a as [H, C + R] whatever the layer: a NoPE layer's with all-latent keys has
    no rope columns (zeros: its rows' rope lanes are zero, as the reference pads them); a layer
    reading another layer's rows (kv_source_layers) has none at all (zeros: the kernel takes the
    source's rows instead, `mla_shared`). A quantized matrix as it is."""
    width = cfg.attention.kv_cache_width
    xp = array_module(lay)
    if "wkv_a" not in lay:
        return xp.zeros((cfg.hidden_size, width), xp.asarray(lay["wo"]).dtype)
    w = lay["wkv_a"]
    if isinstance(w, QuantizedMatrix) or w.shape[1] == width:
        return w
    return xp.pad(xp.asarray(w), ((0, 0), (0, width - w.shape[1])))


def array_module(tree):
    """numpy for weights on the host; jax.numpy when any leaf is traced (`pack_sharded` inside a
    jit or `jax.linear_transpose`: tpumk.kernel.unpack reads the weights back through it), which
    takes the same slices, pads and concatenations."""
    import jax

    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(tree)):
        import jax.numpy as jnp

        return jnp
    return np

MESH_AXIS = "tp"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ShardingPlan:
    """The split of one model over `devices` devices (all static ints; see the module doc)."""

    devices: int
    q_heads: int  # query heads per device
    kv_heads: int  # KV heads per device
    kv_replicas: int  # devices holding the same KV head (1 while devices <= num_kv_heads)
    ffn: int  # dense FFN width per device (lane-rounded; 0 without dense layers)
    shared_ffn: int  # shared-expert width per device (0 without shared experts)
    expert_parallel: int  # expert groups (1 without experts)
    experts: int  # experts each device owns (0 without experts)
    expert_ffn: int  # width of each owned expert on a device
    vocab: int  # lm_head columns per device (the last device's tail may pass the vocab)
    kv_paired: bool = False  # 64-wide KV heads held in pairs by kv_replicas devices each (module doc)
    latent_split: bool = False  # MLA: q_a / kv_a split by output columns, the latent all-gathered
    linear_key_heads: int = 0  # a hybrid's linear-attention key heads per device (their value heads with them)
    linear_value_heads: int = 0

    def latent_slices(self, cfg: ModelConfig) -> dict[str, int]:
        """With `latent_split`: the output columns of q_a ("q_a", 0 without q-LoRA) and of kv_a
        ("kv_a": c_kv | k_rope) each device computes, ceil(width / N)."""
        return {"q_a": -(-cfg.q_lora_rank // self.devices),
                "kv_a": -(-cfg.attention.kv_cache_width // self.devices)}

    @property
    def expert_tensor(self) -> int:
        """Devices that split one expert's width (devices per expert group)."""
        return self.devices // self.expert_parallel

    def expert_group(self, d: int) -> int:
        return d // self.expert_tensor

    def kv_head(self, d: int) -> int:
        """First (global) KV head device d holds."""
        return d * self.kv_heads if self.kv_replicas == 1 else (d // self.kv_replicas) * self.kv_heads

    def q_ranges(self, cfg: ModelConfig, d: int) -> list[tuple[int, int]]:
        """Device d's query heads as (first global head, count) runs, in the device's order:
        one run, or paired, a run from each of its two KV heads' groups."""
        if not self.kv_paired:
            return [(d * self.q_heads, self.q_heads)]
        group, per = cfg.num_q_heads // cfg.num_kv_heads, self.q_heads // self.kv_heads
        slot = d % self.kv_replicas
        return [((self.kv_head(d) + j) * group + slot * per, per) for j in range(self.kv_heads)]

    # ---------------------------------------------------------------- the per-device model
    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model one device computes. Routing stays global (num_experts = E, the router is
        whole); the packed experts hold only the owned ones (`experts`)."""
        if self.devices == 1:
            return cfg
        shared = {"num_shared_experts": 1, "shared_expert_ffn_size": self.shared_ffn} if self.shared_ffn else {}
        linear = {"linear_key_heads": self.linear_key_heads, "linear_value_heads": self.linear_value_heads} \
            if cfg.linear else {}
        return cfg.replace(
            name=f"{cfg.name}-tp{self.devices}", num_q_heads=self.q_heads, num_kv_heads=self.kv_heads,
            ffn_size=self.ffn, vocab_size=self.vocab,
            expert_ffn_size=self.expert_ffn if cfg.is_moe else 0, **shared, **linear)

    def collectives_per_layer(self, cfg: ModelConfig) -> int:
        """In-kernel all-reduces per layer: the o-projection's and the FFN's partial sums, and
        first, with a QK-norm across all heads (OLMo 2), the sums of squares of q's and k's rows
        (each device holds some heads). 0 on one device."""
        if self.devices == 1:
            return 0
        return 3 if cfg.attention.qk_norm_whole else 2

    def summary(self, cfg: ModelConfig) -> dict[str, Any]:
        """Plain data for the build report: what each device holds."""
        out: dict[str, Any] = {
            "devices": self.devices, "mesh_axis": MESH_AXIS,
            "attention": {"q_heads_per_device": self.q_heads, "kv_heads_per_device": self.kv_heads,
                          "kv_replicas": self.kv_replicas, "kv_paired": self.kv_paired,
                          "o_proj": "split by input rows (heads), partial sums all-reduced"},
            "lm_head": {"split": "vocabulary", "columns_per_device": self.vocab},
            "replicated": ["embedding", "norms"] + (["router"] if cfg.is_moe else []),
            "collectives_per_layer": self.collectives_per_layer(cfg),
        }
        if cfg.is_mla:
            out["attention"] = {
                "heads_per_device": self.q_heads,
                "split_by_heads": ["q_b" if cfg.q_lora_rank else "q", "uk", "uv"],
                "replicated": [k for k in ("q_a", "q_a_norm", "kv_a", "kv_a_norm")
                               if (cfg.q_lora_rank or not k.startswith("q_"))
                               and (k.endswith("norm") or not self.latent_split)],
                **({"split_by_columns": {k: v for k, v in self.latent_slices(cfg).items() if v},
                    "latent": "q_a / kv_a output slices all-gathered in the kernel, once per layer"}
                   if self.latent_split else {}),
                "o_proj": "split by input rows (heads), partial sums all-reduced",
                "latent_cache": "replicated: every device holds and writes the whole latent cache",
                "kv_cache_bytes_per_token_per_layer_per_device": cfg.attention.latent_cache_lanes * cfg.dtype_bytes}
        if cfg.pattern.num_dense:
            out["dense_ffn"] = {"split": "width", "width_per_device": self.ffn}
        if cfg.is_moe:
            mode = ("expert_tensor" if self.expert_parallel == 1 else
                    "expert" if self.expert_parallel == self.devices else "expert_x_tensor")
            out["experts"] = {"mode": mode, "expert_parallel": self.expert_parallel,
                              "expert_tensor": self.expert_tensor, "experts_per_device": self.experts,
                              "expert_width_per_device": self.expert_ffn}
            if self.shared_ffn:
                out["shared_experts"] = {"split": "width", "width_per_device": self.shared_ffn}
        return out

    # ---------------------------------------------------------------- weights
    def device_params(self, cfg: ModelConfig, params: dict, d: int) -> dict:
        """Device d's part of reference-layout weights, in the reference layout of
        `local_config(cfg)` (numpy arrays, jax arrays when traced: `array_module`; widths
        zero-padded past the model's own). The
        embedding is cut to the device's vocabulary slice (it only feeds a tied lm_head there:
        the step gathers token rows from the whole, replicated embedding)."""
        if self.devices == 1:
            return params
        dd = cfg.head_dim
        xp = array_module(params)

        def cols(a, lo: int, width: int, axis: int = -1):
            if isinstance(a, QuantizedMatrix):  # codes split like the matrix; scales follow them
                q = cols(a.q, lo, width, axis)
                ax = axis % a.q.ndim
                if ax == a.q.ndim - 1:  # a column split: every scale row keeps its columns
                    scale = cols(a.scale, lo, width)
                elif a.grouped:  # a row split: whole 128-row groups go with their rows
                    g = a.group
                    if lo % g or width % g:
                        raise PlanError(f"sharding: rows [{lo}, {lo + width}) of a matrix with scales per {g} "
                                        f"rows do not split into whole groups")
                    scale = cols(a.scale, lo // g, width // g, axis=ax)
                else:
                    scale = xp.asarray(a.scale)
                return a._replace(q=q, scale=scale)  # nvfp4's global scales: one per matrix, kept
            a = xp.asarray(a)
            axis %= a.ndim
            hi = max(min(lo + width, a.shape[axis]), lo)
            part = a[(slice(None),) * axis + (slice(lo, hi),)]  # (a static slice: traced, its transpose is a pad)
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, width - part.shape[axis])
            return xp.pad(part, pad)

        kv_lo = self.kv_head(d) * dd
        runs = self.q_ranges(cfg, d)

        def heads(a, width: int, axis: int = -1):
            """The device's query heads' `width`-wide slices of axis `axis`, run by run."""
            parts = [cols(a, h0 * width, n * width, axis) for h0, n in runs]
            if len(parts) == 1:
                return parts[0]
            if isinstance(a, QuantizedMatrix):  # scales as `cols` cut them: by column, by row group, or whole
                ax = axis % a.q.ndim
                scale_ax = -1 if ax == a.q.ndim - 1 else -2 if a.grouped else None
                scale = (xp.concatenate([p.scale for p in parts], axis=scale_ax) if scale_ax is not None
                         else parts[0].scale)
                return a._replace(q=xp.concatenate([p.q for p in parts], axis=ax), scale=scale)
            return xp.concatenate(parts, axis=axis)
        layers = []
        for i, lay in enumerate(params["layers"]):
            # norms and Muse Spark's residual gates: whole on every device (they act on the whole residual)
            out = {k: xp.asarray(lay[k]) for k in LAYER_NORMS + RESIDUAL_GATES if k in lay}
            if cfg.pattern.is_linear(i):
                out.update(self._linear_params(cfg, lay, d, cols, xp))
            elif cfg.attention.qk_norm_whole:  # laid out as the q (k) columns: each device's heads' part
                out["q_norm"] = heads(lay["q_norm"], dd)
                out["k_norm"] = cols(lay["k_norm"], kv_lo, self.kv_heads * dd)
            if cfg.pattern.is_linear(i):
                pass
            elif cfg.is_mla:
                out.update(self._mla_params(cfg, lay, d, cols, cfg.pattern.rotates(i), xp))
            else:
                out["wq"] = heads(lay["wq"], dd)
                if cfg.attention.attn_output_gate:  # its columns follow the q heads'
                    out["wq_gate"] = heads(lay["wq_gate"], dd)
                out["wk"] = cols(lay["wk"], kv_lo, self.kv_heads * dd)
                out["wv"] = cols(lay["wv"], kv_lo, self.kv_heads * dd)
                out["wo"] = heads(lay["wo"], dd, axis=0)
                if cfg.attention.o_bias:  # whole on every device: added once, after the all-reduce
                    out["bo"] = xp.asarray(lay["bo"])
                if cfg.attention.attn_sinks:  # each device's q heads' sink logits
                    out["sinks"] = heads(lay["sinks"], 1)
                if cfg.attention.qkv_bias:  # each device's heads' biases, as their columns
                    out["bq"] = heads(lay["bq"], dd)
                    out["bk"] = cols(lay["bk"], kv_lo, self.kv_heads * dd)
                    out["bv"] = cols(lay["bv"], kv_lo, self.kv_heads * dd)
            if cfg.pattern.is_dense(i):
                lo = d * self.ffn
                out["w_gate"] = cols(lay["w_gate"], lo, self.ffn)
                out["w_up"] = cols(lay["w_up"], lo, self.ffn)
                out["w_down"] = cols(lay["w_down"], lo, self.ffn, axis=0)
            else:
                out["router"] = xp.asarray(lay["router"])
                # replicated with the router (e_down_bias is packed into it: tpumk.kernel.moe)
                # Muse Spark's projections around the experts: whole on every device (each device's
                # experts read all M columns; its partial output at M maps to a partial sum at H)
                for k in ("router_bias", "shared_router", "router_logit_bias", "e_down_bias", "moe_in", "moe_in_norm",
                          "moe_out"):
                    if k in lay:  # (moe_in / moe_out quantized with the ring: kept as they are)
                        out[k] = lay[k] if isinstance(lay[k], QuantizedMatrix) else xp.asarray(lay[k])
                e_lo = self.expert_group(d) * self.experts
                f_lo = (d % self.expert_tensor) * self.expert_ffn
                def owned(a):  # this device's experts (the leading axis)
                    if isinstance(a, QuantizedMatrix):  # (nvfp4: each expert's global scales with it)
                        return a._replace(q=owned(a.q), scale=owned(a.scale),
                                          outer=None if a.outer is None else owned(a.outer))
                    return xp.asarray(a)[e_lo:e_lo + self.experts]

                for k in ("e_gate", "e_up"):
                    out[k] = cols(owned(lay[k]), f_lo, self.expert_ffn)
                out["e_down"] = cols(owned(lay["e_down"]), f_lo, self.expert_ffn, axis=1)
                for k in ("e_gate_bias", "e_up_bias"):  # as their matrices' columns
                    if k in lay:
                        out[k] = cols(owned(lay[k]), f_lo, self.expert_ffn)
                if self.shared_ffn:
                    lo = d * self.shared_ffn
                    out["s_gate"] = cols(lay["s_gate"], lo, self.shared_ffn)
                    out["s_up"] = cols(lay["s_up"], lo, self.shared_ffn)
                    out["s_down"] = cols(lay["s_down"], lo, self.shared_ffn, axis=0)
            layers.append(out)
        v_lo = d * self.vocab
        top = {"embed": cols(params["embed"], v_lo, self.vocab, axis=0), "final_norm": xp.asarray(params["final_norm"]),
               "layers": layers}
        if "rope_alpha" in params:  # learned RoPE frequencies: whole on every device
            top["rope_alpha"] = xp.asarray(params["rope_alpha"])
        if "lm_head" in params:  # untied, or a quantized build's own copy of a tied head
            top["lm_head"] = cols(params["lm_head"], v_lo, self.vocab)
        return top

    def linear_channels(self, cfg: ModelConfig, d: int) -> np.ndarray:
        """Device d's convolution channels (q | k | v of its key heads and their value heads) as
        indices into the whole model's q | k | v."""
        lin, kh, vh = cfg.linear, self.linear_key_heads, self.linear_value_heads
        dk, dv, ks = lin.linear_key_dim, lin.linear_value_dim, lin.key_size
        return np.concatenate([np.arange(d * kh * dk, (d + 1) * kh * dk),
                               ks + np.arange(d * kh * dk, (d + 1) * kh * dk),
                               2 * ks + np.arange(d * vh * dv, (d + 1) * vh * dv)])

    def _linear_params(self, cfg: ModelConfig, lay: dict, d: int, cols, xp=np) -> dict:
        """Device d's linear-attention weights: its key heads and their value heads (convolution
        channels, gates, decays, the out-projection's rows); KDA's low-rank gates' first halves
        (f_a, g_a) and the gated norm whole."""
        lin, vh = cfg.linear, self.linear_value_heads
        dv, dk = lin.linear_value_dim, lin.linear_key_dim
        ch = self.linear_channels(cfg, d)

        def take(a, idx, axis=-1):  # columns (or rows) at `idx`, codes and their scales alike
            if isinstance(a, QuantizedMatrix):
                scale = take(a.scale, idx) if axis % a.q.ndim == a.q.ndim - 1 else                     (xp.asarray(a.scale) if not a.grouped else None)
                if scale is None:
                    raise PlanError("sharding: a linear layer's out-projection with scales per 128 rows cannot split "
                                    "by value heads here (quantize per column, or on one device)")
                return a._replace(q=take(a.q, idx, axis), scale=scale)
            return xp.take(xp.asarray(a), idx, axis=axis)

        heads_v = np.arange(d * vh, (d + 1) * vh)
        lanes_v = np.arange(d * vh * dv, (d + 1) * vh * dv)
        out = {"lin_qkv": take(lay["lin_qkv"], ch), "lin_conv": take(lay["lin_conv"], ch),
               "lin_b": take(lay["lin_b"], heads_v), "lin_A_log": take(lay["lin_A_log"], heads_v),
               "lin_norm": xp.asarray(lay["lin_norm"]), "lin_out": take(lay["lin_out"], lanes_v, axis=0)}
        if lin.linear_kind == "gated_delta":
            out.update(lin_z=take(lay["lin_z"], lanes_v), lin_a=take(lay["lin_a"], heads_v),
                       lin_dt_bias=take(lay["lin_dt_bias"], heads_v))
        else:
            lanes_k = np.arange(d * vh * dk, (d + 1) * vh * dk)
            out.update(lin_f_a=lay["lin_f_a"], lin_g_a=lay["lin_g_a"], lin_f_b=take(lay["lin_f_b"], lanes_k),
                       lin_g_b=take(lay["lin_g_b"], lanes_v), lin_dt_bias=take(lay["lin_dt_bias"], lanes_k))
            out.update({k: out[k] if isinstance(out[k], QuantizedMatrix) else xp.asarray(out[k])
                        for k in ("lin_f_a", "lin_g_a")})
        return out

    # ---------------------------------------------------------------- the state pool
    def _pending_lanes(self, cfg: ModelConfig, d: int) -> np.ndarray:
        """Device d's pending row as indices into the whole model's (-1: a zero pad lane), in
        the device's own layout (`tpumk.model.linear_attention.pending_offsets` of its heads)."""
        from tpumk.model.linear_attention import pending_offsets

        lin = cfg.linear
        local = self.local_config(cfg).linear
        b, second, width = pending_offsets(lin)
        lb, lsecond, lwidth = pending_offsets(local)
        idx = np.full(lwidth, -1)
        ch = self.linear_channels(cfg, d)
        idx[:len(ch)] = ch
        vh = self.linear_value_heads
        idx[lb:lb + vh] = b + np.arange(d * vh, (d + 1) * vh)
        per = local.decay_width // vh  # 1 (Gated DeltaNet's a) or key_dim (KDA's f)
        idx[lsecond:lsecond + vh * per] = second + np.arange(d * vh * per, (d + 1) * vh * per)
        idx[lwidth - LANE] = width - LANE  # the live flag
        return idx

    def expand_states(self, cfg: ModelConfig, states):
        """A reference state pool in the sharded layout: the recurrent states as they are (split
        by value heads along their head axis), each device's convolution channels and pending
        row side by side along the last axis (`linear_channels`, `_pending_lanes`)."""
        import jax.numpy as jnp

        if states is None or self.devices == 1:
            return states
        conv = jnp.concatenate([states.conv[..., self.linear_channels(cfg, d)] for d in range(self.devices)], -1)
        parts = []
        for d in range(self.devices):
            idx = self._pending_lanes(cfg, d)
            parts.append(jnp.where(idx >= 0, states.pending[..., np.maximum(idx, 0)], 0.0))
        return states._replace(conv=conv, pending=jnp.concatenate(parts, -1))

    def collapse_states(self, cfg: ModelConfig, states):
        """The inverse of `expand_states`."""
        import jax.numpy as jnp

        if states is None or self.devices == 1:
            return states
        from tpumk.model.linear_attention import pending_offsets

        n = self.devices
        c_local = states.conv.shape[-1] // n
        conv = jnp.zeros((*states.conv.shape[:-1], c_local * n), states.conv.dtype)
        w = pending_offsets(cfg.linear)[2]
        pending = jnp.zeros((*states.pending.shape[:-1], w), states.pending.dtype)
        lw = states.pending.shape[-1] // n
        for d in range(n):
            conv = conv.at[..., self.linear_channels(cfg, d)].set(states.conv[..., d * c_local:(d + 1) * c_local])
            idx = self._pending_lanes(cfg, d)
            keep = np.nonzero(idx >= 0)[0]
            pending = pending.at[..., idx[keep]].set(states.pending[..., d * lw + keep])
        return states._replace(conv=conv, pending=pending)

    def _mla_params(self, cfg: ModelConfig, lay: dict, d: int, cols, rotates: bool = True, xp=np) -> dict:
        """Device d's MLA attention weights: its heads' columns of q_b (or q) and of wkv_b
        (each head's columns are contiguous: N + R of q, N key then V value lanes of wkv_b; a
        quantized layer: its heads' blocks of the absorbed w_uk / w_uv stacks), its
        heads' rows of o; q_a and kv_a whole, or with `latent_split` device d's output columns
        of each (`latent_slices`); their norms whole."""
        hl, h0 = self.q_heads, d * self.q_heads
        # sparse attention's indexer whole on every device: each computes the same selection
        out = {k: lay[k] if isinstance(lay[k], QuantizedMatrix) else xp.asarray(lay[k])
               for k in ("wq_a", "q_a_norm", "kv_a_norm") + INDEXER_WEIGHTS if k in lay}
        out["wkv_a"] = mla_kv_a(cfg, lay)  # (Mistral Large 4's NoPE and KV-sharing layers: [H, C + R])
        if self.latent_split:
            w = self.latent_slices(cfg)
            for key, fam in (("wq_a", "q_a"), ("wkv_a", "kv_a")):
                if key in out:
                    out[key] = cols(out[key], d * w[fam], w[fam])
        if cfg.attention.query_log_scale:  # each device's heads' log-position scales and biases
            for k in ("q_log_scale", "q_log_bias"):
                out[k] = xp.asarray(lay[k])[h0:h0 + hl]
        q = "wq_b" if "wq_b" in lay else "wq"
        out[q] = cols(lay[q], h0 * cfg.head_dim, hl * cfg.head_dim)
        if "w_uk" in lay:  # a quantized layer's absorbed per-head blocks [Hq, ...]: its heads' blocks
            for k in ("w_uk", "w_uv"):
                m = lay[k]
                out[k] = m._replace(q=xp.asarray(m.q)[h0:h0 + hl], scale=xp.asarray(m.scale)[h0:h0 + hl])
        else:
            kv_b = cfg.attention.layer_key_widths(rotates)[0] + cfg.v_head_dim  # (a wide NoPE layer's N + R keys)
            out["wkv_b"] = cols(lay["wkv_b"], h0 * kv_b, hl * kv_b)
        out["wo"] = cols(lay["wo"], h0 * cfg.v_head_dim, hl * cfg.v_head_dim, axis=0)
        return out

    # ---------------------------------------------------------------- the KV cache
    def cache_heads(self, cfg: ModelConfig) -> int:
        """KV heads along the sharded cache's last axis: Hkv, or N when heads are replicated
        (MLA: N copies of the one latent row)."""
        return self.devices * self.kv_heads if not cfg.is_mla else self.devices

    def _replicated_cache(self, cfg: ModelConfig) -> bool:
        """Every device holds a copy of the whole cache row (MLA's latent cache)."""
        return cfg.is_mla and self.devices > 1

    def expand_cache(self, cfg: ModelConfig, kv):
        """A reference cache array [L, pages, P, Hkv*D] (or a quantized cache's scales [.., Hkv])
        -> the sharded layout [L, pages, P, N*kv_heads*D] (device d's lanes [d*kv_heads*D, ...)): the same array while N <= Hkv,
        each KV head repeated kv_replicas times when replicated. MLA: the stored latent row
        (C + R lane-padded, W lanes) repeated N times (device d's copy in lanes [d*W, ...))."""
        import jax.numpy as jnp

        if self._replicated_cache(cfg):
            return jnp.tile(kv, (1,) * (kv.ndim - 1) + (self.devices,))
        if self.kv_replicas == 1:
            return kv

        *lead, width = kv.shape  # each device's KV head (or pair) repeated on its kv_replicas devices
        unit = self.kv_heads * (width // cfg.num_kv_heads)  # head_dim lanes per head; a scale cache: 1
        heads = kv.reshape(*lead, cfg.num_kv_heads // self.kv_heads, unit)
        return jnp.repeat(heads, self.kv_replicas, axis=-2).reshape(*lead, self.devices * unit)

    def device_heads(self, cfg: ModelConfig) -> list[list[int]]:
        """The KV heads each device's cache holds (MLA: the one latent "head", on every device)."""
        if cfg.is_mla:
            return [[0]] * self.devices
        return [[(d // self.kv_replicas) * self.kv_heads + h for h in range(self.kv_heads)] for d in range(self.devices)]

    def expand_quantized(self, cfg: ModelConfig, cache):
        """`expand_cache` for a `reference.QuantizedKVCache`: every device's heads repacked in
        its own page layout (`kv_quant.PagedLayout` of its kv heads), side by side."""
        from tpumk.model import kv_quant

        if self.devices == 1:
            return cache
        heads = self.device_heads(cfg)
        local = kv_quant.layout_for(cfg, cache.layout.page_size, cache.layout.kv_dtype, heads=len(heads[0]))
        return cache._replace(kv=kv_quant.split_heads(cache.kv, cache.layout, heads), layout=local)

    def collapse_quantized(self, cfg: ModelConfig, cache):
        """The inverse of `expand_quantized` (replicas agree; the first of each is kept)."""
        from tpumk.model import kv_quant

        if self.devices == 1:
            return cache
        whole = kv_quant.layout_for(cfg, cache.layout.page_size, cache.layout.kv_dtype)
        heads = self.device_heads(cfg)
        firsts = [d for d in range(self.devices) if d == 0 or heads[d] != heads[d - 1]]  # each head's first copy
        return cache._replace(kv=kv_quant.join_heads(cache.kv, whole, self.devices, firsts), layout=whole)

    def expand_kv(self, cfg: ModelConfig, cache):
        """A whole reference cache in the sharded layout: a `reference.KVCache`'s k and v arrays
        (`expand_cache`), or a `QuantizedKVCache` repacked per device (`expand_quantized`)."""
        from tpumk.model.reference import QuantizedKVCache

        if isinstance(cache, QuantizedKVCache):
            return self.expand_quantized(cfg, cache)._replace(states=self.expand_states(cfg, cache.states))
        keys = None if cache.index_keys is None else self.expand_cache(cfg, cache.index_keys)
        return cache._replace(k=self.expand_cache(cfg, cache.k), v=self.expand_cache(cfg, cache.v),
                              states=self.expand_states(cfg, cache.states), index_keys=keys)

    def collapse_kv(self, cfg: ModelConfig, cache):
        """The inverse of `expand_kv`."""
        from tpumk.model.reference import QuantizedKVCache

        if isinstance(cache, QuantizedKVCache):
            return self.collapse_quantized(cfg, cache)._replace(states=self.collapse_states(cfg, cache.states))
        keys = None if cache.index_keys is None else self.collapse_cache(cfg, cache.index_keys)
        return cache._replace(k=self.collapse_cache(cfg, cache.k), v=self.collapse_cache(cfg, cache.v),
                              states=self.collapse_states(cfg, cache.states), index_keys=keys)

    def collapse_cache(self, cfg: ModelConfig, kv):
        """The inverse of `expand_cache` (replicas agree; the first of each is kept)."""
        if self._replicated_cache(cfg):
            return kv[..., :kv.shape[-1] // self.devices]
        if self.kv_replicas == 1:
            return kv
        *lead, width = kv.shape
        heads = kv.reshape(*lead, self.devices, width // self.devices)[..., ::self.kv_replicas, :]
        return heads.reshape(*lead, width // self.kv_replicas)


def plan_sharding(cfg: ModelConfig, devices: int, expert_parallel: int = 0) -> ShardingPlan:
    """The sharding of `cfg` over `devices` devices (`expert_parallel` 0 = auto). Raises
    PlanError (one line naming the field) when the model cannot be split that way."""
    n = devices
    hq, hkv = cfg.num_q_heads, cfg.num_kv_heads
    if n == 1:
        e = cfg.num_experts
        return ShardingPlan(1, hq, hkv, 1, cfg.ffn_size if cfg.pattern.num_dense else 0,
                            cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size if cfg.is_moe else 0,
                            1, e, cfg.moe.expert_ffn_size if e else 0, cfg.vocab_size,
                            linear_key_heads=cfg.linear.linear_key_heads, linear_value_heads=cfg.linear.linear_value_heads)
    if hq % n:
        raise PlanError(f"sharding: devices = {n}: expected a divisor of num_q_heads ({hq}) of model '{cfg.name}' "
                        f"(query heads are split across devices)")
    if n <= hkv and hkv % n:
        raise PlanError(f"sharding: devices = {n}: expected a divisor of num_kv_heads ({hkv}) of model '{cfg.name}', "
                        f"or a multiple of it (KV heads are split, or replicated when devices exceed them)")
    if n > hkv and n % hkv:
        raise PlanError(f"sharding: devices = {n}: expected a multiple of num_kv_heads ({hkv}) of model '{cfg.name}' "
                        f"when devices exceed the KV heads (each device must read one whole KV head)")
    kv_heads, replicas = (hkv // n, 1) if n <= hkv else (1, n // hkv)
    paired = False
    if kv_heads == 1 and cfg.head_dim == LANE // 2 and not cfg.is_mla:  # one 64-wide KV head: hold pairs
        pairs, group = hkv // 2, hq // hkv
        r = n // pairs if hkv % 2 == 0 and n % pairs == 0 else 0
        if not r or group % r or cfg.attention.qk_norm_whole:
            raise PlanError(f"sharding: devices = {n}: model '{cfg.name}' would leave a device one 64-wide KV head "
                            f"(half a {LANE}-lane block), and its {hkv} KV heads cannot be held in pairs over {n} "
                            f"devices (expected an even num_kv_heads, devices a multiple of num_kv_heads / 2 and "
                            f"each KV head's {group} query heads a multiple of the devices per pair"
                            + (", no QK-norm across all heads)" if cfg.attention.qk_norm_whole else ")"))
        kv_heads, replicas, paired = 2, r, True
    ffn = round_up(-(-cfg.ffn_size // n), LANE) if cfg.pattern.num_dense else 0
    shared_total = cfg.moe.num_shared_experts * cfg.moe.shared_expert_ffn_size if cfg.is_moe else 0
    shared = round_up(-(-shared_total // n), LANE) if shared_total else 0
    ep, experts, expert_ffn = 1, 0, 0
    if cfg.is_moe:
        e, fe = cfg.num_experts, cfg.moe.expert_ffn_size
        ok = expert_parallel_choices(cfg, n)
        if expert_parallel:
            ep = expert_parallel
            if ep not in ok:
                raise PlanError(
                    f"tuning: 'expert_parallel' = {ep}: expected a divisor of devices ({n}) and num_experts ({e}) "
                    f"leaving each device a multiple of {LANE} of expert_ffn_size ({fe})"
                    f"{', whole experts (expert_post_norm)' if cfg.moe.expert_post_norm else ''}; "
                    f"possible: {', '.join(map(str, ok)) or 'none'}")
        else:
            # Auto: the widest expert-tensor split whose width slices stay whole lanes (every
            # device streams every picked expert: balanced load whatever the routing), then more
            # expert groups only as the width requires.
            if not ok:
                raise PlanError(f"sharding: devices = {n}: no split of model '{cfg.name}''s {e} experts of width {fe} "
                                f"gives every device whole experts and a multiple of {LANE} of their width")
            ep = ok[0]
        experts, expert_ffn = e // ep, fe // (n // ep)
    lin_k = lin_v = 0
    if cfg.linear:  # whole key heads per device, their value heads with them
        lk, lv = cfg.linear.linear_key_heads, cfg.linear.linear_value_heads
        if lk % n:
            raise PlanError(f"sharding: devices = {n}: expected a divisor of linear_key_heads ({lk}) of model "
                            f"'{cfg.name}' (linear-attention heads are split across devices)")
        lin_k, lin_v = lk // n, lv // n
    return ShardingPlan(n, hq // n, kv_heads, replicas, ffn, shared, ep, experts, expert_ffn,
                        -(-cfg.vocab_size // n), paired, linear_key_heads=lin_k, linear_value_heads=lin_v)


def expert_parallel_choices(cfg: ModelConfig, devices: int) -> list[int]:
    """Every valid `expert_parallel` for `cfg` on `devices` devices (the tuner's choices)."""
    if not cfg.is_moe or devices == 1:
        return [1]
    e, fe = cfg.num_experts, cfg.moe.expert_ffn_size
    # expert_post_norm (Muse Spark) normalises each expert's whole output: no expert split by width
    return [g for g in _divisors(devices)
            if e % g == 0 and fe % (devices // g) == 0 and (fe // (devices // g)) % LANE == 0
            and (g == devices or not cfg.moe.expert_post_norm)]


def per_device_weight_bytes(cfg: ModelConfig, sharding: ShardingPlan, quant: str = "none") -> int:
    """Closed-form weight bytes one device holds (no padding, before planning): its slice of the
    split matrices (in the `quant` format where quantized) plus the replicated embedding,
    router and norms."""
    local = sharding.local_config(cfg)
    h, db = cfg.hidden_size, cfg.dtype_bytes
    # the local model's bytes, its embedding slice swapped for the whole (replicated) embedding
    total = quantized_weight_bytes(local, quant) + (cfg.vocab_size - local.vocab_size) * h * db
    if cfg.is_moe:  # local counts all E experts of the local width; a device owns `experts`
        moe_layers = cfg.num_layers - cfg.pattern.num_dense
        efmt = expert_format(quant)  # codes plus their group scales, or the model dtype
        per_param = efmt.itemsize + efmt.scale_bytes / efmt.group if efmt is not None else db
        total -= moe_layers * (cfg.num_experts - sharding.experts) * 3 * cfg.moe.width(h) * local.expert_ffn_size \
            * per_param
    return int(total)


__all__ = ["MESH_AXIS", "ShardingPlan", "plan_sharding", "expert_parallel_choices", "per_device_weight_bytes"]
