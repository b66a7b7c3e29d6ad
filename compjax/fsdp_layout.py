"""Which dimension of each parameter :func:`compjax.fsdp` splits over the data axis.

Pure functions of the shapes: the largest dimension divisible by the number
of workers is split; leaves below ``min_size`` entries, or without such a
dimension, stay replicated (MaxText's fsdp axis makes the same choice).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

P = jax.P


def shard_dim(shape: tuple[int, ...], num_shards: int, min_size: int) -> int | None:
    """The dimension of a leaf of ``shape`` to split into ``num_shards`` shards, or ``None``.

    The largest dimension divisible by ``num_shards`` (the first of equal
    ones); ``None`` (replicate) for a leaf of fewer than ``min_size``
    entries or with no such dimension.  One shard (``num_shards == 1``)
    splits nothing.
    """
    if num_shards <= 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return None
    fits = [(size, -i) for i, size in enumerate(shape) if size % num_shards == 0 and size > 0]
    return -max(fits)[1] if fits else None


def fsdp_specs(
    params: Any, num_shards: int, axis_name: str | tuple[str, ...] = "data", min_size: int = 4096
):
    """The ``PartitionSpec`` of every parameter under :func:`fsdp` (a pure function of shapes).

    Args:
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      num_shards: the number of workers along ``axis_name``.
      axis_name: the data-parallel mesh axis, or a tuple of axes, major
        first (:func:`compjax.fsdp` on a ``(slow, fast)`` pair splits over
        ``(fast, slow)``: :mod:`compjax.hpz`).
      min_size: leaves with fewer entries stay replicated.

    Returns:
      A pytree of ``PartitionSpec`` with the params' structure: ``P()`` for
      a replicated leaf, else ``axis_name`` at the dimension
      :func:`shard_dim` chose.
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


def opt_state_specs(opt, params, dims, n: int, axis_name):
    """The optax state's specs: a leaf whose shape shrinks when ``opt.init`` sees the shards is
    laid out like a parameter, split ``n`` ways along the dimension that shrank; every other
    leaf (a step count) is replicated."""
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
