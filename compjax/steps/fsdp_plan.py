"""What :func:`compjax.fsdp` fixes once, at build time: its arguments checked, and the plan of
the step (the axes, each leaf's split dimension, stored shape, padding and error memory, the
state's specs) that the step's functions (:mod:`compjax.steps.fsdp_exchange`,
:mod:`compjax.steps.fsdp`) read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax.compressor import Compressor
from compjax.compressors.dense import identity
from compjax.steps import hpz
from compjax.steps.fsdp_layout import (
    check_param_dtypes,
    fsdp_specs,
    opt_state_specs,
    padded_shape,
    spec_dim,
)
from compjax.steps.fsdp_state import FSDPState
from compjax.steps.param_gather import GATHERS
from compjax.steps.scaffold import is_spec

P = jax.P

#: Feedback on the compressed reduce-scatter (see :func:`compjax.fsdp`'s ``feedback``).
FEEDBACKS = (None, "ef", "ef21")


class Plan(NamedTuple):
    """The static plan of an FSDP step (built once by :func:`build_plan`).

    Attributes:
      loss_fn, opt, mesh, gather, gather_block, seed: :func:`compjax.fsdp`'s arguments.
      comp: the gradient compressor (``identity()`` for none).
      feedback: ``None``, ``"ef"`` or ``"ef21"``.
      names: every data-parallel axis (one, or the ``(slow, fast)`` pair).
      slow: the axis the compressed stages run over (the only one of a flat step).
      fast: the exact axis of a pair, else ``None``.
      shard_axes: the axes a sharded leaf is split over (local-major on a pair).
      batch_axes: the axes the batch is split over (host-major on a pair).
      n: the number of workers over ``names``.
      n_fast: the number of workers over ``fast`` (1 for a flat step).
      param_specs: the params' specs (of their stored shapes).
      dims: the split dimension of each leaf (``None``: replicated), as a tree.
      dim_list: the same, in leaf order.
      treedef: the params' structure.
      leaf_shapes: each leaf's own shape.
      stored_shapes: each leaf's stored shape (its split dimension padded to a multiple of
        ``n``).
      own_rows: the rows of a padded leaf's split dimension; ``None`` where nothing is padded.
      memory_dtypes: each leaf's memory dtype (float32, or the leaf's where wider).
      ef_leaves: the indices of the leaves with an error memory (the sharded ones, with
        ``feedback``).
      memory_shapes: each of those leaves' memory shape (of what the worker sends over
        ``slow``: the leaf, or ``1/L`` of it on a pair).
      specs: the :class:`FSDPState`'s specs.
    """

    loss_fn: Callable[..., jax.Array]
    opt: optax.GradientTransformation
    mesh: jax.sharding.Mesh
    gather: str | None
    gather_block: int
    seed: int
    comp: Compressor
    feedback: str | None
    names: tuple[str, ...]
    slow: str
    fast: str | None
    shard_axes: Any
    batch_axes: Any
    n: int
    n_fast: int
    param_specs: Any
    dims: Any
    dim_list: list[int | None]
    treedef: Any
    leaf_shapes: list[tuple[int, ...]]
    stored_shapes: list[tuple[int, ...]]
    own_rows: list[int | None]
    memory_dtypes: list[Any]
    ef_leaves: list[int]
    memory_shapes: dict[int, tuple[int, ...]]
    specs: FSDPState


def check_args(
    compressor: Compressor | None, feedback: Any, gather: Any, gather_block: Any, min_size: Any
) -> None:
    """Refuse an invalid ``gather``, ``gather_block``, ``feedback`` or ``min_size`` of
    :func:`compjax.fsdp`.

    Args:
      compressor, feedback, gather, gather_block, min_size: :func:`compjax.fsdp`'s.

    Returns:
      None.

    Raises:
      ValueError: naming the invalid argument (``feedback`` without a ``compressor``).
    """
    if gather is not None and gather not in GATHERS:
        raise ValueError(f"gather must be None or one of {GATHERS}, got {gather!r}")
    if isinstance(gather_block, bool) or not isinstance(gather_block, int) or gather_block < 1:
        raise ValueError(f"gather_block must be a positive integer, got {gather_block!r}")
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback must be one of {FEEDBACKS}, got {feedback!r}")
    if feedback is not None and compressor is None:
        raise ValueError(f"feedback={feedback!r} needs a compressor (nothing is lost without one)")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative integer, got {min_size!r}")


def leaf_plan(params: Any, dims: Any, n: int, n_fast: int, feedback: str | None) -> dict:
    """The per-leaf fields of :class:`Plan` (``dim_list`` to ``memory_shapes``).

    Args:
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      dims: each leaf's split dimension (``None``: replicated), with the params' structure.
      n: the number of workers the leaves are split over.
      n_fast: the number of workers over the fast axis (1 for a flat step).
      feedback: ``None``, ``"ef"`` or ``"ef21"``.

    Returns:
      A dict of those fields.
    """
    dim_list = jax.tree.leaves(dims, is_leaf=lambda x: x is None)
    leaves, treedef = jax.tree.flatten(params)
    leaf_shapes = [tuple(np.shape(p)) for p in leaves]
    # Stored shapes: a split dimension that is not a multiple of n padded up to one.
    stored_shapes = [padded_shape(s, d, n) for s, d in zip(leaf_shapes, dim_list, strict=True)]
    # The rows of a padded leaf's own (split) dimension; None where nothing is padded.
    own_rows = [
        None if s == t else s[d]
        for s, t, d in zip(leaf_shapes, stored_shapes, dim_list, strict=True)
    ]
    ef_leaves = [i for i, dim in enumerate(dim_list) if dim is not None] if feedback else []
    # A worker's memory is of what it sends over ``slow``: the leaf, or 1/L of it on a pair.
    memory_shapes = {
        i: tuple(s // n_fast if j == dim_list[i] else s for j, s in enumerate(stored_shapes[i]))
        for i in ef_leaves
    }
    return dict(
        dim_list=dim_list,
        treedef=treedef,
        leaf_shapes=leaf_shapes,
        stored_shapes=stored_shapes,
        own_rows=own_rows,
        # Error memories in float32, or the leaf's dtype where wider.
        memory_dtypes=[jnp.promote_types(p.dtype, jnp.float32) for p in leaves],
        ef_leaves=ef_leaves,
        memory_shapes=memory_shapes,
    )


def build_plan(
    loss_fn: Callable[..., jax.Array],
    opt: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str | tuple[str, str],
    *,
    compressor: Compressor | None,
    feedback: str | None,
    gather: str | None,
    gather_block: int,
    min_size: int,
    seed: int,
) -> Plan:
    """The :class:`Plan` of :func:`compjax.fsdp` (its arguments checked).

    Args:
      loss_fn: as :func:`compjax.fsdp` takes it; likewise ``opt``, ``params``, ``mesh``,
        ``axis_name``, ``compressor``, ``feedback``, ``gather``, ``gather_block``,
        ``min_size`` and ``seed``.

    Returns:
      The :class:`Plan`.

    Raises:
      ValueError: as :func:`compjax.fsdp` says.
    """
    names = hpz.check_axis_name(axis_name, mesh)
    check_param_dtypes(params)
    check_args(compressor, feedback, gather, gather_block, min_size)
    # The compressed stages run over ``slow`` (the only axis of a flat step); a pair adds the
    # exact ``fast`` stages, and its shards are laid out local-major (see compjax.steps.hpz).
    slow, fast = names if len(names) == 2 else (names[0], None)
    shard_axes = slow if fast is None else (fast, slow)
    n = math.prod(mesh.shape[a] for a in names)
    param_specs = fsdp_specs(params, n, shard_axes, min_size)
    dims = jax.tree.map(spec_dim, param_specs, is_leaf=is_spec)
    per_leaf = leaf_plan(params, dims, n, mesh.shape[fast] if fast else 1, feedback)
    stored = per_leaf["treedef"].unflatten(
        [
            jax.ShapeDtypeStruct(s, p.dtype)
            for s, p in zip(per_leaf["stored_shapes"], jax.tree.leaves(params), strict=True)
        ]
    )
    spec_list = jax.tree.leaves(param_specs, is_leaf=is_spec)
    specs = FSDPState(
        opt_state=opt_state_specs(opt, stored, dims, n, shard_axes),
        key=P(),
        memory=tuple(P(shard_axes) for _ in per_leaf["ef_leaves"]),
        shift=tuple(spec_list[i] for i in per_leaf["ef_leaves"]) if feedback == "ef21" else (),
    )
    return Plan(
        loss_fn=loss_fn,
        opt=opt,
        mesh=mesh,
        gather=gather,
        gather_block=gather_block,
        seed=seed,
        comp=identity() if compressor is None else compressor,
        feedback=feedback,
        names=names,
        slow=slow,
        fast=fast,
        shard_axes=shard_axes,
        batch_axes=slow if fast is None else names,  # host-major: a host's rows are contiguous
        n=n,
        n_fast=mesh.shape[fast] if fast else 1,
        param_specs=param_specs,
        dims=dims,
        specs=specs,
        **per_leaf,
    )
