"""Flax NNX models trained data-parallel with compjax: ``nnx.Optimizer`` under ``shard_map``.

Three things stand between an NNX model and a compressed exchange:

1. ``nnx.Optimizer(model, tx, wrt=...)`` calls ``tx.init`` outside
   ``shard_map``, so per-worker state (error memories, DIANA's local shifts)
   gets one worker's shape instead of a leading axis of every worker.
2. ``nnx.state(optimizer)`` holds the optax state's leaves as ``OptArray``
   variables in plain dicts: compjax's state NamedTuples, which say which
   fields are per-worker, are gone, and :func:`compjax.state_specs` could
   only guess.
3. ``nnx.grad`` of a model whose params are replicated inside ``shard_map``
   is the gradient summed over the workers, not each worker's own.

:func:`optimizer` builds an ``nnx.Optimizer`` whose state is initialised
under ``shard_map`` (per-worker fields split over the data axis) and whose
``OptArray`` leaves carry their ``PartitionSpec`` as variable metadata
(``compjax_spec``), which :func:`compjax.state_specs` reads through any
``nnx.State``.  :func:`value_and_grad` differentiates each worker's copy of
the params (:func:`compjax.worker_params`), like ``nnx.value_and_grad``.

Example (one training step, inside ``jax.shard_map``)::

    optimizer = compjax.nnx.optimizer(model, tx, mesh, "data", wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    specs = compjax.state_specs(state, "data")

    def step(state, x, y):  # shard_map'ed with in_specs=(specs, P("data"), P("data"))
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = compjax.nnx.value_and_grad(loss_fn, "data")(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), jax.lax.pmean(loss, "data")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from compjax.axes import AxisName
from compjax.transforms.specs import NNX_SPEC, state_specs
from compjax.worker_local import check_local_loss, worker_params


def optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: AxisName = "data",
    *,
    wrt: Any = nnx.Param,
    param_specs: Any = None,
) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` for ``model`` whose compjax state is laid out over ``mesh``.

    The state is ``tx.init`` run under ``jax.shard_map``: per-worker fields
    have a leading axis of the workers, split over ``axis_name``, and every
    leaf records its ``PartitionSpec`` so that :func:`compjax.state_specs`
    of ``nnx.state(optimizer)`` (or of ``nnx.split((model, optimizer))``'s
    state) gives the ``in_specs``/``out_specs`` of the training step.

    Args:
      model: the NNX model (its ``wrt`` variables are the params).
      tx: an optax transformation with compjax parts over ``axis_name``.
      mesh: the device mesh.
      axis_name: the data-parallel axis (a name or a tuple of names).
      wrt: the filter of the variables the optimizer updates (as for
        ``nnx.Optimizer`` and ``nnx.grad``).
      param_specs: the params' own specs over the mesh's other axes, as for
        :func:`compjax.state_specs` (``None``: replicated).

    Returns:
      An ``nnx.Optimizer``; its ``update(model, grads)`` runs inside the
      ``shard_map`` of the training step.

    Raises:
      ValueError: an axis of ``axis_name`` is not an axis of ``mesh``.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = [n for n in names if n not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    params = nnx.as_pure(nnx.state(model, wrt))
    specs = state_specs(jax.eval_shape(tx.init, params), axis_name, param_specs)
    in_specs = jax.P() if param_specs is None else param_specs
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(in_specs,), out_specs=specs))
    tagged = jax.tree.map(
        lambda spec, leaf: nnx.OptArray(leaf, **{NNX_SPEC: spec}),
        specs,
        init(params),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    # Built around a stateless transformation, so that tx.init runs once, under shard_map.
    opt = nnx.Optimizer(model, optax.identity(), wrt=wrt)
    opt.tx = tx
    opt.opt_state = nnx.data(tagged)
    return opt


def value_and_grad(
    loss_fn: Callable[..., Any],
    axis_name: AxisName,
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, nnx.State]]:
    """``nnx.value_and_grad`` of each worker's own loss, for use inside ``shard_map``.

    The returned function takes the model first (then ``loss_fn``'s other
    arguments) and returns ``(loss, grads)`` (``((loss, aux), grads)`` with
    ``has_aux``), ``grads`` an ``nnx.State`` of the ``wrt`` variables, ready
    for ``optimizer.update(model, grads)``.  While ``loss_fn`` runs the
    model's params are this worker's copy (:func:`compjax.worker_params`);
    afterwards they are the shared params again.  Other variables that
    ``loss_fn`` changes (batch statistics, RNG counts) keep their new values,
    as with ``nnx.value_and_grad``; they vary over the workers, so reduce
    them (e.g. ``jax.lax.pmean``) before returning them replicated.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs) -> loss`` on this worker's batch.
      axis_name: the data-parallel axis.
      wrt: the filter of the variables to differentiate.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``fn(model, *args, **kwargs) -> (loss, grads)`` (``((loss, aux), grads)`` with
      ``has_aux``): this worker's loss and the gradient of it alone.

    Raises:
      ValueError: (under ``shard_map``) the loss does not vary over
        ``axis_name``: ``loss_fn`` reduced it over the workers (a ``pmean``
        inside it would make the step ``1/n`` of the intended one); return
        the worker's local loss and ``pmean`` the reported value afterwards.
    """
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=has_aux)

    def worker_value_and_grad(model, *args, **kwargs):
        shared = nnx.as_pure(nnx.state(model, wrt))
        nnx.update(model, worker_params(shared, axis_name))
        try:
            value, grads = grad_fn(model, *args, **kwargs)
        finally:
            nnx.update(model, shared)
        check_local_loss(value[0] if has_aux else value, axis_name)
        return value, grads

    return worker_value_and_grad
