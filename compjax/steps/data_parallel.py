"""A compressed data-parallel step for ``jax.jit`` users: sharded arrays in, sharded arrays out.

Under ``jax.jit`` with ``NamedSharding`` inputs, XLA differentiates the
global loss and all-reduces the gradient itself, before any optax
transformation sees it: compjax would compress an already-reduced gradient
and save nothing.  :func:`data_parallel` builds the step the other way
round: each worker's own gradient (``shard_map`` over the data axis,
``compjax.worker_params``), then the optimizer with its compressed exchange,
wrapped in ``jax.jit``.  Callers keep passing and receiving ordinary global
arrays (any sharding, explicit-sharding meshes included); the optimizer
state's per-worker fields are sharded over the data axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from compjax.steps.scaffold import check_axis, mapped_init, mapped_step
from compjax.transforms.specs import state_specs
from compjax.worker_local import check_local_loss, worker_params


class DataParallel(NamedTuple):
    """``init(params) -> opt_state`` and ``step(params, opt_state, *batch) -> (params,
    opt_state, loss)``, both jitted; ``specs`` are the state's partition specs."""

    init: Callable[[Any], Any]
    step: Callable[..., tuple[Any, Any, jax.Array]]
    specs: Any


def data_parallel(
    loss_fn: Callable[..., jax.Array],
    opt: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str = "data",
) -> DataParallel:
    """Build a jitted, compressed data-parallel training step over ``mesh``'s ``axis_name``.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``, the mean loss of the
        batch it is given (each worker is given its own shard); not reduced
        over the workers (no ``pmean`` inside: ``step`` averages the loss).
      opt: an optax transformation with compjax parts over ``axis_name``
        (e.g. ``optax.chain(compjax.compress(comp, "data"), optax.sgd(lr))``).
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), replicated.
      mesh: the device mesh; every batch array is split along its first axis
        over ``axis_name`` (its size a multiple of the number of workers).
      axis_name: the data-parallel mesh axis.

    Returns:
      :class:`DataParallel`.  ``step`` returns the new params, the new state
      and the loss averaged over workers.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``; or, at the first
        ``step``, ``loss_fn``'s value does not vary over ``axis_name`` (it was
        reduced over the workers inside ``loss_fn``).
    """
    check_axis(mesh, axis_name)
    specs = state_specs(jax.eval_shape(opt.init, params), axis_name)

    def local_step(p, state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(worker_params(p, axis_name), *batch)
        check_local_loss(loss, axis_name)  # a pmean inside loss_fn would make the step 1/n
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, jax.lax.pmean(loss, axis_name)

    step = mapped_step(local_step, mesh, jax.P(), specs, jax.P(axis_name))
    init = mapped_init(opt.init, mesh, jax.P(), specs)
    return DataParallel(init=jax.jit(init), step=jax.jit(step), specs=specs)
