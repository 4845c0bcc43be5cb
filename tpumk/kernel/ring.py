"""The weight ring: every dense matrix of every layer, then the lm_head, streamed through VMEM.

The plan fixes a global tile order (segment, layer, family, tile; see tpumk.plan.plan). Global tile
g lives in slot g % depth of one VMEM buffer [depth, slot_rows, slot_cols] and signals DMA
semaphore g % depth. The first `depth` tiles are issued before the first layer; after tile g
is multiplied, tile g + depth is issued into the slot it freed, so `depth - 1` loads are always
in flight, across family, layer and segment boundaries (the next layer's first tiles load
while this layer's last ones are multiplied).

Loop structure (what the compiler's static profile can count): a layer segment is ONE
`fori_loop` over its layers whose body walks the layer's tiles unrolled in Python, so a tile's
family and in-layer index are static and only the layer index is traced; the lm_head is its
own top-level `fori_loop` over column blocks. No streaming loop is nested in another.

A tile issued from inside a layer loop may belong to a later layer of the same segment (traced
layer + static offset) or, near the end of the segment, to the next segment or the lm_head;
then its identity depends on the traced layer only through "is this the last layer(s)", so the
finitely many cases are emitted as static descriptors under `pl.when(layer == l0)`.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.plan.plan import Plan, Segment


def _static(v) -> bool:
    return isinstance(v, int)


class WeightRing:
    """Walks the plan's tile schedule inside a kernel body.

    Args:
      plan: the Plan the kernel is built from.
      weights: family name -> HBM ref (`pl.ANY`) of that family's packed tiles.
      buf: VMEM scratch [depth, slot_rows, slot_cols] in the ring dtype (the model dtype, or the
        quantized codes' dtype).
      sems: DMA semaphores [depth].
    """

    def __init__(self, plan: Plan, weights: dict, buf, sems, tile_scales: dict | None = None,
                 scale_buf=None, scale_sems=None):
        self.plan = plan
        self.weights = weights
        self.buf = buf
        self.sems = sems
        # Group-scaled formats (fp8-b128): each tile's scales [groups (padded to 8), cols] f32
        # travel with it, from `tile_scales[family]` into slot g % depth of `scale_buf`.
        self.tile_scales = tile_scales
        self.scale_buf = scale_buf
        self.scale_sems = scale_sems
        self.grouped = tile_scales is not None
        self.depth = plan.ring_depth
        self.total = plan.total_tiles
        self.dtype = jnp.float32 if plan.cfg.dtype == "float32" else jnp.bfloat16
        # f32 weights: full-precision MXU passes so the kernel matches the f32 reference tightly.
        self.precision = lax.Precision.HIGHEST if plan.cfg.dtype == "float32" else None
        # Quantized tiles (int8 / e4m3 codes) are converted to the compute dtype in VMEM (exact:
        # every code is a bfloat16 value) and the column sums scaled after the K sweep.
        self.quantized = plan.weight_format is not None and not self.grouped

    # ------------------------------------------------------------------ addressing
    def _global(self, seg: Segment, layer, t):
        return seg.first_tile + (layer - seg.first_layer) * seg.tiles_per_layer + t

    def _slot(self, seg: Segment, layer, t):
        if _static(layer) and _static(t):
            return self._global(seg, layer, t) % self.depth
        if _static(t) and seg.tiles_per_layer % self.depth == 0:  # same slot pattern every layer
            return (seg.first_tile + t) % self.depth
        g = self._global(seg, jnp.asarray(layer, jnp.int32), t)
        return lax.rem(g, jnp.int32(self.depth))  # g >= 0; lax.rem avoids floor-division lowering

    def _family(self, seg: Segment, t):
        """(family name, tile index within the family's matrix) for in-layer tile t."""
        if seg.kind == "lm_head":
            return "lm_head", t
        pos, local = seg.family_at(t)
        return seg.families[pos], local

    def _copy(self, seg: Segment, layer, t):
        name, local = self._family(seg, t)
        fam = self.plan.families[name]
        slot = self._slot(seg, layer, t)
        if seg.kind == "lm_head":
            src = self.weights[name].at[local]
        else:
            pos = seg.families.index(name)
            src = self.weights[name].at[seg.stack_base[pos] + (layer - seg.first_layer), local]
        if (fam.tile_rows, fam.tile_cols) == (self.plan.slot_rows, self.plan.slot_cols):
            dst = self.buf.at[slot]
        else:
            dst = self.buf.at[slot, pl.ds(0, fam.tile_rows), pl.ds(0, fam.tile_cols)]
        copies = [pltpu.make_async_copy(src, dst, self.sems.at[slot])]
        if self.grouped:
            table = self.tile_scales[name]
            ssrc = table.at[local] if seg.kind == "lm_head" else table.at[seg.stack_base[pos] + (layer - seg.first_layer), local]
            rows = table.shape[-2]
            sdst = self.scale_buf.at[slot, pl.ds(0, rows), pl.ds(0, fam.tile_cols)]
            copies.append(pltpu.make_async_copy(ssrc, sdst, self.scale_sems.at[slot]))
        return copies, slot, fam

    def _locate(self, g: int) -> tuple[Segment, int, int]:
        for seg in self.plan.segments:
            if g < seg.first_tile + seg.tiles:
                layer, t = divmod(g - seg.first_tile, seg.tiles_per_layer)
                return seg, seg.first_layer + layer, t
        raise ValueError(f"tile {g} beyond the schedule ({self.total} tiles)")

    # ------------------------------------------------------------------ issue / wait
    def start(self, seg: Segment, layer, t) -> None:
        for cp in self._copy(seg, layer, t)[0]:
            cp.start()

    def start_global(self, g: int) -> None:
        self.start(*self._locate(g))

    def prologue(self) -> None:
        """Issue the first `depth` tiles (call once, before the first layer)."""
        for g in range(min(self.depth, self.total)):
            self.start_global(g)

    def wait(self, seg: Segment, layer, t):
        """Wait for tile t of `layer`; returns its VMEM view (a ref [tile_rows, tile_cols])."""
        copies, slot, fam = self._copy(seg, layer, t)
        for cp in copies:
            cp.wait()
        self.last_slot = slot
        if (fam.tile_rows, fam.tile_cols) == (self.plan.slot_rows, self.plan.slot_cols):
            return self.buf.at[slot]
        return self.buf.at[slot, pl.ds(0, fam.tile_rows), pl.ds(0, fam.tile_cols)]

    def refill(self, seg: Segment, layer, t) -> None:
        """Tile (layer, t) has been consumed: issue tile g + depth into the slot it freed."""
        d = self.depth
        if seg.kind == "lm_head":  # the last segment: nothing follows it
            nxt = t + d
            if _static(t):
                if nxt < seg.tiles_per_layer:
                    self.start(seg, layer, nxt)
            else:
                pl.when(nxt < seg.tiles_per_layer)(lambda: self.start(seg, layer, nxt))
            return
        ahead, t2 = divmod(t + d, seg.tiles_per_layer)
        if ahead == 0:
            self.start(seg, layer, t2)
            return
        if _static(layer):
            g = self._global(seg, layer, t) + d
            if g < self.total:
                self.start_global(g)
            return
        pl.when(layer + ahead < seg.end_layer)(lambda: self.start(seg, layer + ahead, t2))
        # Near the segment end the tile belongs to a later segment: one static case per layer.
        for l0 in range(max(seg.first_layer, seg.end_layer - ahead), seg.end_layer):
            g = self._global(seg, l0, t) + d
            if g < self.total:
                pl.when(layer == l0)(lambda g=g: self.start_global(g))

    # ------------------------------------------------------------------ streamed matmul
    def _tile(self, w):
        """A waited tile's values in the compute dtype."""
        return w[...].astype(self.dtype) if self.quantized else w[...]

    def _dot(self, x, w, fam):
        """x [N, tile_rows] @ the waited tile w, f32. Group-scaled tiles: each 128-row group's sum
        times its scale row (the tile's scales, in `scale_buf` at the slot `wait` just used)."""
        if not self.grouped:
            return jnp.dot(x, self._tile(w), preferred_element_type=jnp.float32, precision=self.precision)
        group = self.plan.weight_format.group
        sc = self.scale_buf.at[self.last_slot]
        acc = None
        for g in range(fam.tile_rows // group):
            part = jnp.dot(x[:, g * group:(g + 1) * group], w[g * group:(g + 1) * group, :].astype(self.dtype),
                           preferred_element_type=jnp.float32, precision=self.precision)
            part = part * sc[g:g + 1, 0:fam.tile_cols]
            acc = part if acc is None else acc + part
        return acc

    def matmul(self, seg: Segment, layer, family: str, x_ref, epilogue: Callable,
               scales: Callable | None = None) -> None:
        """y = x @ W_family(layer), one column block at a time, inside a layer loop body.

        x_ref: VMEM ref [N, >= K] f32 (or the weight dtype); each row block of the tiles
        (block-diagonal families: row block j only, for column block j)
        multiplies the matching column slice, cast to the weight dtype (the reference's matmul
        contract). epilogue(j, acc) receives column block j's finished f32 [N, tile_cols].
        Quantized builds: scales(j) gives column block j's [1, tile_cols] f32 scales, applied
        to the block's sum over K."""
        fam = self.plan.families[family]
        off = seg.family_offsets[seg.families.index(family)]
        r, rb = fam.tile_rows, fam.row_blocks
        xs = [x_ref[:, i * r:(i + 1) * r].astype(self.dtype) for i in range(rb)]
        for j in range(fam.col_blocks):
            acc = None
            # block-diagonal: column block j is row block j times tile j (one tile per column)
            for i in ([j] if fam.diagonal else range(rb)):
                t = off + j if fam.diagonal else off + j * rb + i
                w = self.wait(seg, layer, t)
                part = self._dot(xs[i], w, fam)
                acc = part if acc is None else acc + part
                self.refill(seg, layer, t)
            epilogue(j, acc * scales(j) if self.quantized else acc)

    def lm_head(self, x_ref, epilogue: Callable, scales: Callable | None = None) -> None:
        """The lm_head as a top-level loop over column blocks j: epilogue(j, acc) gets logits
        block j ([N, tile_cols] f32). Block 0 is peeled off the loop (j = Python 0 there, traced
        after), so an epilogue can pair each DMA it waits with one started a step earlier
        without a conditional wait (the static profiler cannot model a conditional wait)."""
        seg = self.plan.segments[-1]
        fam = self.plan.families["lm_head"]
        r, rb = fam.tile_rows, fam.row_blocks
        xs = [x_ref[:, i * r:(i + 1) * r].astype(self.dtype) for i in range(rb)]

        def column_block(j, carry):
            acc = None
            for i in range(rb):
                t = j * rb + i
                w = self.wait(seg, seg.first_layer, t)
                part = self._dot(xs[i], w, fam)
                acc = part if acc is None else acc + part
                self.refill(seg, seg.first_layer, t)
            epilogue(j, acc * scales(j) if self.quantized else acc)
            return carry

        column_block(0, 0)
        lax.fori_loop(1, fam.col_blocks, column_block, 0)

    def layer_loop(self, seg: Segment, body: Callable) -> None:
        """Run body(layer) for each layer of a layer segment as one top-level fori_loop."""
        def step(layer, carry):
            body(layer)
            return carry

        lax.fori_loop(seg.first_layer, seg.end_layer, step, 0)
