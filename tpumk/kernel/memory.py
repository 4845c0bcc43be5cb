"""Contract buffers (`tpumk.plan.geometry.Buffer`) as Pallas TPU memory types.

The plan side describes every operand and scratch buffer as plain data; these three functions
are the only place that turns such a description into Pallas objects:

    space       operand BlockSpec                        scratch shape
    smem        pl.BlockSpec(memory_space=pltpu.SMEM)    pltpu.SMEM(shape, dtype)
    vmem        pl.BlockSpec(memory_space=pltpu.VMEM)    pltpu.VMEM(shape, dtype)
    hbm         pl.BlockSpec(memory_space=pl.ANY)        (not a scratch space)
    semaphore   (not an operand space)                   pltpu.SemaphoreType.DMA(shape)
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpumk.plan.geometry import Buffer


def block_spec(buf: Buffer) -> pl.BlockSpec:
    """The grid-less BlockSpec of an operand or output: the whole array in its memory space."""
    spaces = {"smem": pltpu.SMEM, "vmem": pltpu.VMEM, "hbm": pl.ANY}
    if buf.space not in spaces:
        raise ValueError(f"{buf.name}: a {buf.space} buffer cannot be a kernel operand")
    return pl.BlockSpec(memory_space=spaces[buf.space])


def scratch_shape(buf: Buffer):
    """The `scratch_shapes` entry of a scratch buffer."""
    if buf.space == "vmem":
        return pltpu.VMEM(buf.shape, buf.jnp_dtype)
    if buf.space == "smem":
        return pltpu.SMEM(buf.shape, buf.jnp_dtype)
    if buf.space == "semaphore":
        return pltpu.SemaphoreType.DMA(buf.shape)
    raise ValueError(f"{buf.name}: a {buf.space} buffer cannot be scratch")


def shape_struct(buf: Buffer) -> jax.ShapeDtypeStruct:
    """The array's ShapeDtypeStruct (out_shape entries, AOT argument specs)."""
    return jax.ShapeDtypeStruct(buf.shape, buf.jnp_dtype)
