"""Which dimension of each parameter :func:`compjax.fsdp` splits over the data axis; padding.

Pure functions of the shapes: the largest dimension divisible by the number
of workers is split (MaxText's fsdp axis makes the same choice); a leaf
with no such dimension has its largest dimension *padded* with zeros up to
a multiple of the number of workers and split (PyTorch FSDP2's uneven
shards: each worker owns ``ceil(d / n)`` rows, the last ones partly or
wholly padding); only leaves below ``min_size`` entries stay replicated.
JAX arrays cannot be split unevenly, so a padded leaf is stored between
steps in its padded shape (:func:`padded_shape`); the step cuts the padding
off before the loss sees the parameters (:func:`unpadded`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from compjax.axes import worker_index
from compjax.transforms.per_worker_params import wide_float_leaves

P = jax.P


def shard_dim(shape: tuple[int, ...], num_shards: int, min_size: int) -> int | None:
    """The dimension of a leaf of ``shape`` to split into ``num_shards`` shards, or ``None``.

    The largest dimension divisible by ``num_shards`` (the first of equal
    ones); without one, the largest dimension (the first of equal ones),
    which is then padded (:func:`padded_shape`).  ``None`` (replicate) for
    a leaf of fewer than ``min_size`` entries, a scalar or an empty leaf.
    One shard (``num_shards == 1``) splits nothing.
    """
    size = int(np.prod(shape, dtype=np.int64))
    if num_shards <= 1 or size < min_size or size == 0 or not shape:
        return None
    fits = [(d, -i) for i, d in enumerate(shape) if d % num_shards == 0]
    return -max(fits or [(d, -i) for i, d in enumerate(shape)])[1]


def padded_shape(shape: tuple[int, ...], dim: int | None, num_shards: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` rounded up to a multiple of ``num_shards`` (as stored)."""
    return tuple(-(-d // num_shards) * num_shards if i == dim else d for i, d in enumerate(shape))


def fsdp_specs(
    params: Any, num_shards: int, axis_name: str | tuple[str, ...] = "data", min_size: int = 4096
):
    """The ``PartitionSpec`` of every parameter under :func:`fsdp` (a pure function of shapes).

    Args:
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      num_shards: the number of workers along ``axis_name``.
      axis_name: the data-parallel mesh axis, or a tuple of axes, major
        first (:func:`compjax.fsdp` on a ``(slow, fast)`` pair splits over
        ``(fast, slow)``: :mod:`compjax.steps.hpz`).
      min_size: leaves with fewer entries stay replicated.

    Returns:
      A pytree of ``PartitionSpec`` with the params' structure: ``P()`` for
      a replicated leaf, else ``axis_name`` at the dimension
      :func:`shard_dim` chose.  A leaf whose split dimension is not a
      multiple of ``num_shards`` is stored padded to :func:`padded_shape`,
      the shape the spec applies to.
    """

    def spec(leaf):
        shape = tuple(np.shape(leaf))
        dim = shard_dim(shape, num_shards, min_size)
        if dim is None:
            return P()
        return P(*[axis_name if i == dim else None for i in range(len(shape))])

    return jax.tree.map(spec, params)


def spec_dim(spec: jax.sharding.PartitionSpec) -> int | None:
    """The dimension a :func:`fsdp_specs` spec splits, or ``None`` for ``P()``."""
    split = [i for i, entry in enumerate(tuple(spec)) if entry is not None]
    return split[0] if split else None


def padded(x: jax.Array, shape: tuple[int, ...], dim: int | None, stored: tuple[int, ...]):
    """``x``, a parameter of its own ``shape`` or already ``stored`` (padded), in the ``stored``
    shape: zeros appended along ``dim``.

    Raises:
      ValueError: ``x`` has neither shape (the message names ``params``).
    """
    got = tuple(np.shape(x))
    if got == stored:
        return x
    if got != shape:
        also = "" if shape == stored else f" (or {stored}, padded for the shards)"
        raise ValueError(f"params: a leaf of shape {got} where fsdp was built for {shape}{also}")
    return jnp.pad(x, [(0, s - d) for s, d in zip(stored, shape, strict=True)])


def unpadded(x: jax.Array, shape: tuple[int, ...], dim: int | None) -> jax.Array:
    """A stored (padded) parameter ``x`` cut back to its own ``shape`` along ``dim``."""
    if dim is None or x.shape[dim] == shape[dim]:
        return x
    return jax.lax.slice_in_dim(x, 0, shape[dim], axis=dim)


def without_padding(x: jax.Array, offset, rows: int | None) -> jax.Array:
    """``x`` (rows first: a block of a padded leaf whose first row is row ``offset`` of the
    leaf) with the rows at or past ``rows`` (the padding) set to zero; ``rows=None`` leaves
    ``x`` as it is."""
    if rows is None:
        return x
    index = offset + jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(index < rows, x, jnp.zeros((), x.dtype))


def to_stored(params, treedef, shapes, dims, stored):
    """``params`` (each leaf of its own shape in ``shapes`` or already ``stored``) in the
    ``stored`` shapes (:func:`padded`, leaf by leaf; ``treedef`` the params' structure).

    Raises:
      ValueError: a float64 leaf (:func:`check_param_dtypes`) or a leaf of another shape.
    """
    check_param_dtypes(params)
    got = treedef.flatten_up_to(params)
    return treedef.unflatten([padded(*a) for a in zip(got, shapes, dims, stored, strict=True)])


def own_shapes(full, treedef, shapes, dims):
    """Whole (gathered) params in their own ``shapes``: each leaf's padding cut off."""
    whole = zip(treedef.flatten_up_to(full), shapes, dims, strict=True)
    return treedef.unflatten([unpadded(*a) for a in whole])


def owned_part(shard: jax.Array, dim: int | None, rows: int | None, axis_name) -> jax.Array:
    """This worker's ``shard`` of a leaf split along ``dim`` over ``axis_name`` (block
    ``worker_index(axis_name)``) with its padding rows (at or past ``rows``; ``None``: the
    leaf is not padded) set to zero."""
    if rows is None:
        return shard
    moved = jnp.moveaxis(shard, dim, 0)
    first = worker_index(axis_name) * moved.shape[0]
    return jnp.moveaxis(without_padding(moved, first, rows), 0, dim)


def check_param_dtypes(params) -> None:
    """Refuse float64 params (``jax_enable_x64``): the step reduces gradients in float32.

    Raises:
      ValueError: a float64 leaf of ``params`` (the message names its shape and
        says how to cast).
    """
    for _, leaf, dtype in wide_float_leaves(params):
        raise ValueError(
            f"fsdp: params must be float32, bfloat16 or float16, got a {dtype} parameter of "
            f"shape {tuple(np.shape(leaf))} (jax_enable_x64): the step compresses and "
            f"reduces in float32; cast the params to float32 "
            f"(jax.tree.map(lambda p: p.astype(jnp.float32), params)) before fsdp and init, "
            f"or disable jax_enable_x64"
        )


def opt_state_specs(opt, params, dims, n: int, axis_name):
    """The optax state's specs: a leaf whose shape shrinks when ``opt.init`` sees the shards is
    laid out like a parameter, split ``n`` ways along the dimension that shrank; every other
    leaf (a step count) is replicated.  ``params`` are the stored (padded) shapes."""
    shards = jax.tree.map(
        lambda p, dim: jax.ShapeDtypeStruct(
            tuple(s // n if i == dim else s for i, s in enumerate(np.shape(p))), p.dtype
        ),
        params,
        dims,
        is_leaf=lambda x: x is None,
    )
    whole = jax.eval_shape(opt.init, params)
    part = jax.eval_shape(opt.init, shards)

    def spec(full, shard):
        shrunk = [i for i, (a, b) in enumerate(zip(full.shape, shard.shape, strict=True)) if a != b]
        if not shrunk:
            return P()
        i = shrunk[0]
        if len(shrunk) > 1 or full.shape[i] != n * shard.shape[i]:
            raise ValueError(
                f"fsdp: an optimizer state leaf of shape {full.shape} is not laid out like a "
                f"parameter (its shape on a shard is {shard.shape}); fsdp needs an elementwise "
                f"optimizer (sgd, momentum, adam, adamw, lion, ...)"
            )
        return P(*[axis_name if j == i else None for j in range(len(full.shape))])

    return jax.tree.map(spec, whole, part)
