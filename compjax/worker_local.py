"""Each worker's own values: refuse gradients and losses already reduced over the workers.

Under ``jax.shard_map`` (``check_vma=True``, the default) the gradient of a
replicated (``P()``) input is summed over the workers by JAX's autodiff, and
a loss with a ``pmean`` inside is reduced before it is differentiated: a
compressed exchange of either would be wrong by a factor ``n`` and save
nothing.  :func:`worker_params` gives each worker a copy of its own to
differentiate; :func:`check_worker_local` and :func:`check_local_loss` refuse
the reduced values with a message naming the fix.  Nothing here sends a
message: the values' types (:func:`compjax.axes.varying`) tell.
"""

from __future__ import annotations

import jax

from compjax import axes
from compjax.axes import AxisName


def check_worker_local(arrays, axis_name: AxisName) -> None:
    """Refuse a gradient that is already reduced over the workers, or an untyped 2-D mesh.

    Under ``shard_map`` (``check_vma=True``, the default) every value knows
    the mesh axes it varies over.  A worker's own gradient varies over
    ``axis_name``; the gradient of a replicated (``P()``) input does not,
    because JAX's autodiff has already summed it over the workers, and a
    compressed exchange of it would be ``n`` times too large and save
    nothing.  Under ``check_vma=False`` nothing can be told, which is
    harmless on a mesh of the data axes alone but not with other axes (a
    model axis): refused.  Under ``vmap`` and ``pmap`` gradients are local.

    Raises:
      ValueError: a leaf does not vary over an axis of ``axis_name`` (the
        message names it and ``compjax.worker_params``), or ``check_vma=False``
        on a mesh with axes besides ``axis_name``.
    """
    names = axes.bound_names(axis_name)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if not names or not set(names) <= manual:
        return
    if not axes.tracks_variation(names[0]):
        others = sorted(manual - set(names))
        if others:
            raise ValueError(
                f"shard_map with check_vma=False over a mesh with axes {others} besides "
                f"axis_name {axis_name!r}: compjax cannot tell which values vary over them "
                f"(leaves sharded over {others[0]!r} would take wrong steps); use "
                f"check_vma=True, the default"
            )
        return
    for leaf in arrays:
        varying = axes.varying(leaf)
        missing = [a for a in names if a not in varying]
        if missing:
            raise ValueError(
                f"the gradient does not vary over axis {missing[0]!r}: it is already summed "
                f"over the workers (under shard_map, the gradient of a replicated input is), "
                f"so compressing it would apply it {axes.num_workers(missing[0])} times over and "
                f"save nothing. Differentiate compjax.worker_params(params, {axis_name!r}) "
                f"instead of params, so each worker keeps its own gradient (with Flax NNX: "
                f"compjax.nnx.value_and_grad(loss_fn, {axis_name!r}) in place of "
                f"nnx.value_and_grad or nnx.grad)"
            )


def check_local_loss(loss, axis_name: AxisName) -> None:
    """Refuse a loss already reduced over the workers (a ``pmean`` inside the loss).

    Under ``shard_map`` (``check_vma=True``) each worker's loss of its own
    params (:func:`worker_params`) varies over ``axis_name``.  A loss that
    does not was reduced over the workers inside the loss function: the
    gradient of ``pmean(loss)`` is each worker's gradient divided by ``n``,
    so the step would be ``1/n`` of the intended one, silently.  Nothing is
    checked under ``pmap``, ``vmap`` or ``check_vma=False``.

    Raises:
      ValueError: a leaf of ``loss`` does not vary over an axis of ``axis_name``.
    """
    names = axes.bound_names(axis_name)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if not names or not set(names) <= manual or not axes.tracks_variation(names[0]):
        return
    for leaf in jax.tree.leaves(loss):
        missing = [a for a in names if a not in axes.varying(leaf)]
        if missing:
            raise ValueError(
                f"the loss does not vary over axis {missing[0]!r}: it is already reduced over "
                f"the workers (a jax.lax.pmean or psum inside the loss function), so its "
                f"gradient is each worker's divided by {axes.num_workers(missing[0])} (pmean) and "
                f"the step would be that much too small. Return this worker's local loss, "
                f"and pmean the reported loss outside the gradient"
            )


def worker_params(tree, axis_name: AxisName):
    """This worker's own copy of replicated ``tree`` (params), to differentiate.

    Under ``shard_map`` the gradient with respect to a replicated (``P()``)
    input is summed over the workers by JAX's autodiff, so
    ``jax.grad(loss)(params, local_batch)`` is already the *sum* of every
    worker's gradient and a compressor would compress the reduced gradient.
    Differentiating ``worker_params(params, axis_name)`` instead gives each
    worker its own local gradient, which compjax then exchanges.  Under
    ``pmap`` and ``vmap`` the gradient is local anyway and this returns the
    tree as it is.

    Args:
      tree: the replicated params (any pytree of arrays).
      axis_name: the data-parallel axis (a name or a tuple of names), or ``None`` for one
        worker.

    Returns:
      ``tree``, its leaves marked as varying over ``axis_name`` under ``shard_map`` (the same
      values); ``tree`` itself under ``pmap``, ``vmap`` or with ``axis_name=None``.

    Raises:
      compjax.axes.UnboundAxisError: ``axis_name`` is not bound (outside the mapped
        function, or misspelled).
    """
    if axis_name is None:
        return tree
    names = axes.bound_names(axis_name)  # a misspelled axis raises, as everywhere
    if axes.gather_target(axis_name) == "varying":
        return tree
    return jax.tree.map(lambda x: jax.lax.pcast(x, names, to="varying"), tree)
