"""The reference-layout weights read back from the kernel's packed ones, so a serving stack holds
the weights once (the packed layout) and its JAX path (the vLLM plugin's prefill) still runs
tpumk's reference layers.

`pack_sharded(plan, params)` (`pack_weights` on one device; on N devices each device's part,
`ShardingPlan.device_params`, packed and stacked, plus the whole embedding) only slices, pads
with zeros, reshapes, transposes, concatenates, stacks, casts and copies: for floating-point
weights it is linear, and its transpose (`jax.linear_transpose`) maps the packed tree back onto
the reference tree, every element summed over the places the packing put it. Most elements sit
in one place; a few leaves sit in several (a tied embedding is also the lm_head; a QK-norm row
repeats once per head of a lane block; on N devices the norms, router and o bias sit on every
device, a KV head on each of the kv_replicas devices that hold it, and the whole embedding beside
each device's lm_head slice of a tied one), always the same number of times over the whole leaf,
so dividing each leaf by its copy count gives the weights back. Bitwise: one copy is the element
itself; two are 2x in any float format, and halving it is exact. More copies (norms at N > 2
devices, replicated KV heads) are summed in float32 in two halves, each element's top 12
significand bits and the rest (`_halves`): k copies of a 12-bit value sum exactly in float32 for
k <= 4096, so each half divided by k is that half exactly, and the halves add back to the element.
The copy counts are the gradient of the packed tree's sum with respect to one scale per leaf
(each leaf's elements x copies), computed once.

Inside a jitted step the transpose is slices, reshapes and transposes of the packed arrays:
XLA computes each layer's weights where they are read and frees them after, so they are a
working buffer of the step, not a second copy held between steps (how much of it is live at once
is XLA's schedule). Quantized weights (integer codes) have no transpose: a quantized plan keeps
both copies (`Unpacker.supports`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from tpumk.errors import PlanError
from tpumk.kernel.layout import pack_sharded
from tpumk.plan.plan import Plan


class Unpacker:
    """`Unpacker(plan, template)(packed)` -> the reference-layout params `template` describes
    (ShapeDtypeStructs of the kernel's run model, `plan.whole_model`), read from `packed`
    (`pack_sharded(plan, params)`: `pack_weights` on one device). Traceable; construct it once
    (it computes the copy counts)."""

    def __init__(self, plan: Plan, template: dict):
        if not self.supports(plan):
            raise PlanError(f"unpack: a '{plan.quant}' plan's weights are integer codes: they cannot be read back "
                            "from the packed layout (keep the reference-layout copy)")
        self.template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), template)
        pack = partial(pack_sharded, plan)
        self._transpose = jax.linear_transpose(pack, self.template)

        @jax.jit
        def copies(scales):  # d/d scale_X of sum(pack({X: scale_X * ones})) = copies_X * |X|
            def total(s):
                ones = jax.tree.map(lambda t, k: jnp.full(t.shape, k, jnp.float32).astype(t.dtype), self.template, s)
                return sum(jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(pack(ones)))
            return jax.grad(total)(scales)

        leaves = jax.tree.leaves(self.template)
        scales = jax.tree.map(lambda t: jnp.float32(1), self.template)
        grads = jax.tree.leaves(copies(scales))
        self.copies = [round(float(g) / max(t.size, 1)) for g, t in zip(grads, leaves)]
        missing = [jax.tree_util.keystr(p) for (p, _), c in
                   zip(jax.tree_util.tree_leaves_with_path(self.template), self.copies) if c < 1]
        if missing:
            raise PlanError(f"unpack: the packed layout does not hold {', '.join(missing[:3])}: the reference "
                            "layout cannot be read back from it")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(self.template)]
        many = [(p, c) for p, c in zip(paths, self.copies) if c > MAX_COPIES]
        if many:
            raise PlanError(f"unpack: {many[0][0]} sits in {many[0][1]} places of the packed layout: expected at most "
                            f"{MAX_COPIES} (more copies do not sum exactly in float32)")
        # leaves in more than two places: read back through a second transpose whose template holds
        # them in float32, so their copies are summed in float32 (the packing casts them as before)
        self._wide = [c > 2 for c in self.copies]
        self._wide_transpose = None
        if any(self._wide):
            wide = jax.tree.unflatten(jax.tree.structure(self.template), [
                jax.ShapeDtypeStruct(t.shape, jnp.float32) if w else t for t, w in zip(leaves, self._wide)])
            shapes = partial(jax.tree.map, lambda a: (a.shape, a.dtype))
            if shapes(jax.eval_shape(pack, wide)) != shapes(jax.eval_shape(pack, self.template)):
                raise PlanError("unpack: the packed layout of float32 norms differs from the model dtype's: the "
                                "weights copied to more than two places cannot be read back exactly")
            self._wide_transpose = jax.linear_transpose(pack, wide)

    @staticmethod
    def supports(plan: Plan) -> bool:
        """True when the plan's weights are floating point (quant 'none'), on any number of devices."""
        return plan.quant == "none"

    def __call__(self, packed: dict) -> dict[str, Any]:
        (summed,) = self._transpose(packed)
        leaves, tree = jax.tree.flatten(summed)
        # one copy: the element; two: 2x, halved exactly (the wide leaves' values here go unused: XLA drops them)
        out = [a if c == 1 else (a / c).astype(a.dtype) for a, c in zip(leaves, self.copies)]
        if self._wide_transpose is not None:
            halves = [_halves(a) for a in jax.tree.leaves(packed)]
            packed_tree = jax.tree.structure(packed)
            (top,) = self._wide_transpose(jax.tree.unflatten(packed_tree, [h for h, _ in halves]))
            parts = [jax.tree.leaves(top)]
            if any(low is not None for _, low in halves):
                zeros = [jnp.zeros_like(h) if low is None else low for h, low in halves]
                (rest,) = self._wide_transpose(jax.tree.unflatten(packed_tree, zeros))
                parts.append(jax.tree.leaves(rest))
            for i, (t, c) in enumerate(zip(jax.tree.leaves(self.template), self.copies)):
                if self._wide[i]:  # each half's sum is exactly c x that half: divided by c, exactly the half
                    out[i] = sum(p[i] / c for p in parts).astype(t.dtype)
        return jax.tree.unflatten(tree, out)


MAX_COPIES = 4096  # k copies of a 12-bit value sum exactly in float32's 24 significand bits


def _halves(a: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """A packed array as two of its dtype whose elements have at most 12 significand bits each and
    add back to it exactly: float32's top 12 bits and the rest; a narrower float (bfloat16's 8,
    float16's 11 bits) as it is, and None for the rest."""
    if jnp.finfo(a.dtype).nmant < 12:
        return a, None
    if a.dtype != jnp.float32:
        raise PlanError(f"unpack: packed weights of dtype {a.dtype}: expected float32 or a narrower float")
    top = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFFF000),
                                       jnp.float32)
    return top, a - top
