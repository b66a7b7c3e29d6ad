"""A jitted training step for per-worker params (local steps: :func:`compjax.diloco`).

The per-worker layout of :mod:`compjax.transforms.diloco`: the params are
stacked on a leading worker axis split over the mesh's data axis
(``P(axis_name)``), each worker trains its own copy, and the optimizer state
holds the shared global params.  :func:`local_steps` builds the
``shard_map`` step that takes each worker's copy out of its block, steps it
on the worker's shard of the batch, and puts it back, so that callers pass
and receive ordinary global arrays, as with :func:`compjax.data_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax.axes import num_workers
from compjax.collectives import psum
from compjax.guards import all_finite
from compjax.steps.scaffold import check_axis, mapped_init, mapped_step, placed
from compjax.transforms.diloco import worker_copies
from compjax.transforms.per_worker_params import check_params_dtype
from compjax.transforms.specs import state_specs
from compjax.worker_local import check_local_loss


class LocalSteps(NamedTuple):
    """``init(params) -> (local, opt_state)`` and ``step(local, opt_state, *batch) -> (local,
    opt_state, loss)``, both jitted; ``specs`` are the state's partition specs."""

    init: Callable[[Any], tuple[Any, Any]]
    step: Callable[..., tuple[Any, Any, jax.Array]]
    specs: Any


def local_steps(
    loss_fn: Callable[..., jax.Array],
    opt: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str = "data",
) -> LocalSteps:
    """Build jitted ``init`` and ``step`` for an optimizer over per-worker params.

    A step whose updates are not finite (a compjax optimizer refuses a step
    on every worker alike when any worker's gradient holds an Inf or NaN)
    keeps the params, so training goes on.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``, the mean loss of the
        batch it is given (each worker is given its own shard), not reduced
        over the workers.
      opt: an optimizer of per-worker params over ``axis_name``, e.g.
        ``compjax.diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9,
        nesterov=True), 100, "data")``.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), replicated;
        float32, bfloat16 or float16.
      mesh: the device mesh; every batch array is split along its first axis
        over ``axis_name`` (its size a multiple of the number of workers).
      axis_name: the data-parallel mesh axis.

    Returns:
      :class:`LocalSteps`.  ``init(params)`` returns the workers' copies
      (stacked on a leading axis split over ``axis_name``) and the state;
      ``step(local, opt_state, *batch)`` takes those copies (or
      :func:`compjax.worker_copies` of the params) and returns the new
      copies, the new state and the loss averaged over the workers.
      :func:`compjax.global_params` reads the global params back from the
      state.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``; ``params`` (or
        those given to ``init``) hold a float64 leaf (``jax_enable_x64``:
        cast the params to float32 first); ``init`` is given params of
        other shapes than ``params``; ``step`` is given ``local`` that are
        not the workers' copies (each leaf with a leading worker axis of
        the size of ``axis_name``); or, at the first ``step``,
        ``loss_fn``'s value does not vary over ``axis_name``.
    """
    check_axis(mesh, axis_name)
    check_params_dtype(params, "local_steps", "local_steps and init")
    workers = mesh.shape[axis_name]
    shapes = [tuple(np.shape(p)) for p in jax.tree.leaves(params)]
    structure = jax.tree.structure(params)
    P = jax.P
    specs = state_specs(jax.eval_shape(opt.init, params), axis_name)
    split = P(axis_name)

    def local_step(local, state, *batch):
        mine = jax.tree.map(lambda x: x[0], local)  # this worker's copy
        loss, grads = jax.value_and_grad(loss_fn)(mine, *batch)
        check_local_loss(loss, axis_name)
        updates, state = opt.update(grads, state, mine)
        # A refused step (NaN updates on every worker alike, the state kept) keeps the params.
        ok = all_finite(jax.tree.leaves(updates))
        new = optax.apply_updates(mine, updates)
        mine = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, mine)
        mean_loss = psum(loss, axis_name) / num_workers(axis_name)
        return jax.tree.map(lambda x: x[None], mine), state, mean_loss

    def check_copies(local):
        """``local`` must be the workers' copies: each leaf ``(workers, *shape)``."""
        got, tree = jax.tree_util.tree_flatten_with_path(local)
        advice = (
            f"step(local, opt_state, *batch) takes the workers' copies, every leaf stacked on "
            f"a leading worker axis of size {workers} (the mesh axis {axis_name!r}): the "
            f"copies init(params) returns, or compjax.worker_copies(params, {workers})"
        )
        if tree != structure:
            raise ValueError(f"{advice}; got a tree of structure {tree}, not {structure}")
        for (path, leaf), shape in zip(got, shapes, strict=True):
            got_shape = tuple(np.shape(leaf))
            if got_shape != (workers, *shape):
                unstacked = " (the replicated params' own shape)" if got_shape == shape else ""
                raise ValueError(
                    f"{advice}; got local{jax.tree_util.keystr(path)} of shape {got_shape}"
                    f"{unstacked} where {(workers, *shape)} is needed"
                )

    mapped = mapped_step(local_step, mesh, split, specs, split)

    def step(local, state, *batch):
        check_copies(local)
        return mapped(local, state, *batch)

    def init(p):
        check_params_dtype(p, "local_steps: init", "local_steps and init")
        given = [tuple(np.shape(a)) for a in jax.tree.leaves(p)]
        if jax.tree.structure(p) != structure or given != shapes:
            raise ValueError(
                f"local_steps: init takes the replicated params local_steps was built for, "
                f"of leaf shapes {shapes}; got {given} (init stacks them per worker itself)"
            )
        p = placed(mesh, p, P())
        return placed(mesh, worker_copies(p, workers), split), init_state(p)

    init_state = mapped_init(opt.init, mesh, P(), specs)

    return LocalSteps(init=jax.jit(init), step=jax.jit(step), specs=specs)
