"""The reference-layout weights read back from the kernel's packed ones, so a serving stack holds
the weights once (the packed layout) and its JAX path (the vLLM plugin's prefill) still runs
tpumk's reference layers.

`pack_weights(plan, params)` only pads with zeros, reshapes, transposes, concatenates, stacks,
casts and copies: for floating-point weights it is linear, and its transpose (`jax.linear_transpose`)
maps the packed tree back onto the reference tree, every element summed over the places the
packing put it. Most elements sit in one place; a few leaves sit in several (a tied embedding is
also the lm_head; a QK-norm row repeats once per head of a lane block), always the same number of
times over the whole leaf, so dividing each leaf by its copy count gives the weights exactly (a
sum of equal copies in the weights' own dtype, then a division by a small integer: bitwise for
one copy, to one rounding otherwise). The copy counts are the gradient of the packed tree's sum
with respect to one scale per leaf (each leaf's elements x copies), computed once.

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
from tpumk.kernel.layout import pack_weights
from tpumk.plan.plan import Plan


class Unpacker:
    """`Unpacker(plan, template)(packed)` -> the reference-layout params `template` describes
    (ShapeDtypeStructs of the kernel's run model, `plan.whole_model`), read from `packed`
    (`pack_weights(plan, params)`). Traceable; construct it once (it computes the copy counts)."""

    def __init__(self, plan: Plan, template: dict):
        if not self.supports(plan):
            raise PlanError(f"unpack: a '{plan.quant}' plan's weights are integer codes: they cannot be read back "
                            "from the packed layout (keep the reference-layout copy)")
        self.template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), template)
        pack = partial(pack_weights, plan)
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

    @staticmethod
    def supports(plan: Plan) -> bool:
        """True when the plan's weights are floating point (quant 'none') on one device."""
        return plan.quant == "none" and plan.sharding is None

    def __call__(self, packed: dict) -> dict[str, Any]:
        (summed,) = self._transpose(packed)
        leaves, tree = jax.tree.flatten(summed)
        return jax.tree.unflatten(tree, [a if c == 1 else (a / c).astype(a.dtype) for a, c in zip(leaves, self.copies)])
