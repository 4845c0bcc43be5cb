"""The KV-cache bytes one decode step of a sparse-attention model reads (DeepSeek Sparse
Attention, `tpumk.model.sparse_attention`), beside the same model with dense MLA attention.

tpumk's byte count, not a measurement, per sequence and step at a given context (the tokens
cached before the step), summed over the layers:

- dense: every cached token's latent row, in every MLA layer;
- sparse: every cached token's index key, in every layer with an indexer of its own (the indexer
  scores them all), plus min(index_topk, context) latent rows in every MLA layer (the selected
  ones; a layer reusing the previous selection reads its own rows at the same positions).

Rows as the caches store them: the latent row `c_kv | k_rope` lane-padded to whole 128-lane tiles
(`Attention.latent_cache_lanes`, what the plan's HBM count uses), the index key index_head_dim
lanes, both in the model dtype (the reference's index-key cache). `selected_row_bytes` counts
rows, what a gather of single rows would read; the megakernel (tpumk.kernel.sparse_attention)
cannot move a single row and gathers whole sublane-tile blocks (`SparseGeometry.block_rows`:
16 bfloat16 rows, 8 float32), at most min(index_topk, the context's blocks) of them per layer:
`gathered_block_bytes`, the same bound the plan's "sparse_gather" count uses
(`SparseGeometry.layer_counts`, at batch 1 and q_len 1; the plan also counts whole index-key
tiles and the pages the step writes, read and written back).

`kv_dtype` "fp8" (the 1-byte caches, `tpumk.model.kv_quant`, `sparse_attention.QuantizedIndexKeys`):
an index key is index_head_dim e4m3 codes and a float32 scale; a latent row the 1-byte
layout's row (codes, exponent byte, lane padding: 640 bytes for DeepSeek-V3's 576 lanes), in the
sparse and the dense count alike; a gathered block is one sublane tile of 1-byte rows (32: the
tile `geometry.SUBLANES` gives 8-bit rows; the megakernel does not build this combination yet,
so this is the block a 1-byte gather would have to move, by the same rule as bfloat16's 16).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpumk.errors import ConfigError
from tpumk.model import kv_quant, sparse_attention
from tpumk.model.config import ModelConfig
from tpumk.plan.geometry import SUBLANES


@dataclass(frozen=True)
class SparseKVReads:
    context: int
    index_key_bytes: int  # every cached token's index key, per layer with an indexer
    selected_row_bytes: int  # min(index_topk, context) latent rows per MLA layer
    dense_row_bytes: int  # the same model's dense attention: every cached latent row per MLA layer
    gathered_block_bytes: int = 0  # the megakernel's gather: min(index_topk, blocks) sublane blocks per MLA layer

    @property
    def sparse_bytes(self) -> int:
        return self.index_key_bytes + self.selected_row_bytes

    @property
    def ratio(self) -> float:
        """Sparse over dense bytes."""
        return self.sparse_bytes / self.dense_row_bytes

    @property
    def kernel_bytes(self) -> int:
        """What the megakernel's step reads: the index keys and the gathered blocks."""
        return self.index_key_bytes + self.gathered_block_bytes

    @property
    def kernel_ratio(self) -> float:
        return self.kernel_bytes / self.dense_row_bytes

    def to_dict(self) -> dict:
        return {"context": self.context, "index_key_bytes": self.index_key_bytes,
                "selected_row_bytes": self.selected_row_bytes, "sparse_bytes": self.sparse_bytes,
                "dense_row_bytes": self.dense_row_bytes, "sparse_over_dense": self.ratio,
                "gathered_block_bytes": self.gathered_block_bytes, "kernel_bytes": self.kernel_bytes,
                "kernel_over_dense": self.kernel_ratio}


def sparse_kv_reads(cfg: ModelConfig, context: int, kv_dtype: str = "") -> SparseKVReads:
    """The KV bytes one decode step reads per sequence at `context` cached tokens, with the
    caches in the model dtype or (`kv_dtype` "fp8") 1-byte (module doc)."""
    if not cfg.attention.is_sparse:
        raise ConfigError(f"model '{cfg.name}': field 'index_topk' = {cfg.index_topk}: expected a sparse-attention "
                          "model (index_topk > 0)")
    if not (isinstance(context, int) and context > 0):
        raise ConfigError(f"context = {context!r}: expected a positive number of cached tokens")
    if kv_dtype:
        fmt = kv_quant.kv_format(kv_dtype)
        if fmt.name not in sparse_attention.INDEX_KEY_FORMATS:
            raise ConfigError(f"--kv-dtype {kv_dtype}: a sparse-attention model's 1-byte caches are fp8 only")
        row = kv_quant.layout_for(cfg, SUBLANES[fmt.dtype.dtype.name], fmt.name).lanes  # G = 1: one token a row
        key = cfg.attention.index_head_dim + sparse_attention.INDEX_SCALE_BYTES
        block = SUBLANES[fmt.dtype.dtype.name]
    else:
        row = cfg.attention.latent_cache_lanes * cfg.dtype_bytes
        key = cfg.attention.index_head_dim * cfg.dtype_bytes
        block = SUBLANES[cfg.dtype]
    layers = cfg.kv_layers
    return SparseKVReads(context=context,
                         index_key_bytes=context * key * len(cfg.indexer_layers),
                         selected_row_bytes=min(cfg.index_topk, context) * row * layers,
                         dense_row_bytes=context * row * layers,
                         gathered_block_bytes=min(cfg.index_topk, -(-context // block)) * block * row * layers)
