"""Partition specs of optimizer states: which fields are per-worker, for ``jax.shard_map``.

Per-worker state (error memory, local shifts) has a leading axis of size 1
in each worker's view, so that it concatenates into a leading worker axis:
under ``shard_map`` its global shape is ``(workers, *shape)`` with
``PartitionSpec(axis)``; under ``pmap`` or ``vmap`` it is ``(workers, 1,
*shape)``.  State NamedTuples list their per-worker fields in ``PER_WORKER``
(and the fields computed from each leaf's block in ``PER_LEAF``);
:func:`state_specs` turns any optimizer state (chains, wrappers, Flax NNX
states) into the matching ``PartitionSpec`` tree.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from compjax.axes import axis_names

# The variable metadata in which compjax.nnx.optimizer records each optimizer-state leaf's spec.
NNX_SPEC = "compjax_spec"


def spec_axes(spec: Any) -> tuple[str, ...]:
    """The mesh axes a ``PartitionSpec`` (or ``None``) splits over, in order."""
    return tuple(a for entry in tuple(spec or ()) for a in axis_names(entry))


def is_marked(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "PER_WORKER")


def state_specs(state: Any, axis_name, param_specs: Any = None) -> Any:
    """``PartitionSpec``s of an optimizer state for ``jax.shard_map``.

    Per-worker fields of compjax states get ``P(axis_name)`` (their leading
    worker axis is split across workers); everything else ``P()``
    (replicated).  Works through ``optax.chain``, ``inject_hyperparams``,
    ``MultiSteps`` and any other container.

    Flax NNX: in an ``nnx.State`` (of an optimizer built by
    :func:`compjax.nnx.optimizer`, alone or split together with its model)
    each optimizer-state variable gives the spec it was laid out with, and
    every other variable (the model's params, the step count) ``P()``.

    With ``param_specs`` (the params' own specs, for parameters sharded over
    other mesh axes, e.g. ``{"w": P(None, "model")}``), every state field
    laid out like the params follows them: a per-worker field gets
    ``P(axis_name, *spec)`` (the worker axis, then the parameter's own
    sharding), a shared one the parameter's ``spec``.  Every other per-worker
    field (a bit counter) differs on each device holding a block, so its
    leading axis is split over the data axes and the params' other axes
    together, ``P((axis_name, "model"))``; fields a state lists in
    ``PER_LEAF`` (one entry per leaf, computed from its block, as PowerSGD's
    ``Q``) are split over that leaf's other axes.  ``flatten=True`` and
    ``bucket_size=`` refuse params split over other axes (in ``init``).

    Args:
      state: the state, or its shapes (``jax.eval_shape(opt.init, params)``).
      axis_name: the data-parallel axis (a name or a tuple of names).
      param_specs: ``None`` (parameters replicated over every other axis), or
        a pytree of ``PartitionSpec`` with the params' structure.

    Returns:
      A pytree of ``PartitionSpec`` with the state's structure, usable as
      ``in_specs``/``out_specs`` of ``jax.shard_map``.

    Raises:
      ValueError: an ``nnx.State`` holds the state of an ``nnx.Optimizer``
        that was not built by :func:`compjax.nnx.optimizer` (its per-worker
        fields cannot be told apart).
    """
    return jax.tree.map(
        functools.partial(_spec, _layout(axis_name, param_specs)), state, is_leaf=_stop
    )


class _Layout(NamedTuple):
    """What :func:`state_specs` derives once from its arguments."""

    axis_name: Any
    param_specs: Any
    treedef: Any  # the params' structure (None without param_specs)
    leaf_specs: list  # each param's spec
    leaf_axes: list  # each param's mesh axes other than the data axes
    per_block: Any  # the spec of a per-worker field not laid out like the params


def _is_spec(x: Any) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _layout(axis_name, param_specs: Any) -> _Layout:
    treedef = None if param_specs is None else jax.tree.structure(param_specs, is_leaf=_is_spec)
    leaf_specs = [] if param_specs is None else jax.tree.leaves(param_specs, is_leaf=_is_spec)
    data_axes = set(axis_names(axis_name))
    leaf_axes = [tuple(a for a in spec_axes(s) if a not in data_axes) for s in leaf_specs]
    # The other mesh axes any parameter is split over: a per-worker field that is not laid out
    # like the params (a bit counter, a flattened memory) differs on each of their blocks too.
    model_axes = tuple(dict.fromkeys(a for axes in leaf_axes for a in axes))
    per_block = jax.P((*axis_names(axis_name), *model_axes)) if model_axes else jax.P(axis_name)
    return _Layout(axis_name, param_specs, treedef, leaf_specs, leaf_axes, per_block)


def _field_specs(lay: _Layout, value: Any, per_worker: bool) -> Any:
    if lay.treedef is not None and jax.tree.structure(value) == lay.treedef:
        specs = [jax.P(lay.axis_name, *s) if per_worker else s for s in lay.leaf_specs]
        return jax.tree.unflatten(lay.treedef, specs)
    return jax.tree.map(lambda _: lay.per_block if per_worker else jax.P(), value)


def _per_leaf_specs(lay: _Layout, value: Any) -> Any:
    """A tuple in leaf order of values computed from each leaf's block (PowerSGD's ``Q``)."""
    if not lay.leaf_axes:
        return jax.tree.map(lambda _: jax.P(), value)
    if len(value) != len(lay.leaf_axes):
        raise ValueError(
            f"state_specs: param_specs has {len(lay.leaf_axes)} leaves where the state was "
            f"built for {len(value)}: give the specs of the params the state was built for"
        )
    return tuple(
        jax.tree.map(lambda _, axes=axes: jax.P(axes) if axes else jax.P(), v)
        for v, axes in zip(value, lay.leaf_axes, strict=True)
    )


def _per_worker_grads(lay: _Layout, leaf: Any) -> Any:
    if not np.shape(leaf):
        raise ValueError(
            "state_specs: optax.MultiSteps accumulates each worker's own gradient "
            "(acc_grads), which shard_map can only split along a leading axis: a scalar "
            "parameter has none (give it shape (1,))"
        )
    return jax.P(lay.axis_name)


def _variable_spec(var: nnx.Variable) -> Any:
    if not isinstance(var, nnx.OptArray | nnx.OptVariable):
        return jax.P()
    recorded = var.get_metadata().get(NNX_SPEC)
    if recorded is None:
        raise ValueError(
            "state_specs: this nnx.State holds the state of an nnx.Optimizer built "
            "directly, whose per-worker fields nnx.state no longer marks (and whose "
            "tx.init ran outside shard_map); build it with compjax.nnx.optimizer(model, "
            "tx, mesh, axis_name, wrt=...)"
        )
    return recorded


def _spec(lay: _Layout, node: Any) -> Any:
    if isinstance(node, nnx.Variable):
        return _variable_spec(node)
    if isinstance(node, optax.MultiStepsState):
        # acc_grads holds each worker's own sum of gradients, the params' shape on every
        # worker: split along its first axis (globally n times the params' first axis).
        return node._replace(
            mini_step=jax.P(),
            gradient_step=jax.P(),
            inner_opt_state=state_specs(node.inner_opt_state, lay.axis_name, lay.param_specs),
            acc_grads=jax.tree.map(functools.partial(_per_worker_grads, lay), node.acc_grads),
            skip_state=jax.tree.map(lambda _: jax.P(), node.skip_state),
        )
    if is_marked(node):
        per_leaf = getattr(node, "PER_LEAF", ())
        fields = [
            _per_leaf_specs(lay, v) if f in per_leaf else _field_specs(lay, v, f in node.PER_WORKER)
            for f, v in zip(node._fields, node, strict=True)
        ]
        return type(node)(*fields)
    return jax.P()


def _stop(node: Any) -> bool:
    return is_marked(node) or isinstance(node, optax.MultiStepsState | nnx.Variable)
