"""The mesh scaffold every step shares: placing trees on the mesh, and a worker's step or
init mapped over it with ``jax.shard_map``.

A step writes only what one worker does (``local_step(params, state, *batch) -> (params,
state, loss)``); :func:`mapped_step` places the inputs as the specs say and maps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

P = jax.P


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a ``PartitionSpec`` (a leaf of a spec tree)."""
    return isinstance(x, jax.sharding.PartitionSpec)


def check_axis(mesh: jax.sharding.Mesh, axis_name: Any) -> None:
    """Refuse an ``axis_name`` (a name or a tuple of names) that is not an axis of ``mesh``.

    Args:
      mesh: the device mesh.
      axis_name: the step's data-parallel axis, or a tuple of axes.

    Returns:
      None.

    Raises:
      ValueError: naming ``axis_name`` and the mesh's axes.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not all(name in mesh.axis_names for name in names):
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")


def placed(mesh: jax.sharding.Mesh, tree: Any, specs: Any) -> Any:
    """``tree`` resharded to ``specs`` on ``mesh``, whatever sharding it came with.

    Args:
      mesh: the device mesh.
      tree: a pytree of arrays.
      specs: one ``PartitionSpec`` for every leaf, or a tree of them matching ``tree``.

    Returns:
      ``tree`` placed: ``jax.reshard`` on a mesh whose axes are all explicit, a sharding
      constraint on any other (under ``jit``).
    """
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    move = jax.reshard if explicit else jax.lax.with_sharding_constraint
    if is_spec(specs):
        return jax.tree.map(lambda x: move(x, jax.NamedSharding(mesh, specs)), tree)
    return jax.tree.map(
        lambda x, s: move(x, jax.NamedSharding(mesh, s)), tree, specs, is_leaf=is_spec
    )


def mapped_step(
    local_step: Callable[..., tuple[Any, Any, jax.Array]],
    mesh: jax.sharding.Mesh,
    param_specs: Any,
    state_specs: Any,
    batch_spec: jax.sharding.PartitionSpec,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """``step(params, state, *batch)``: ``local_step`` mapped over ``mesh``, its inputs placed.

    Args:
      local_step: one worker's ``local_step(params, state, *batch) -> (params, state, loss)``,
        the loss already the same on every worker.
      mesh: the device mesh.
      param_specs: the params' ``PartitionSpec`` (one for all leaves, or a tree).
      state_specs: the state's ``PartitionSpec`` tree.
      batch_spec: every batch array's ``PartitionSpec`` (split along its first axis).

    Returns:
      The mapped step (not jitted: the step jits it with what it adds around it).
    """

    def step(params, state, *batch):
        in_specs = (param_specs, state_specs, *[batch_spec] * len(batch))
        out_specs = (param_specs, state_specs, P())
        mapped = jax.shard_map(local_step, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        batch = [placed(mesh, b, batch_spec) for b in batch]
        return mapped(placed(mesh, params, param_specs), placed(mesh, state, state_specs), *batch)

    return step


def mapped_init(
    local_init: Callable[[Any], Any],
    mesh: jax.sharding.Mesh,
    param_specs: Any,
    state_specs: Any,
) -> Callable[[Any], Any]:
    """``init(params)``: ``local_init`` mapped over ``mesh``, the params placed first.

    Args:
      local_init: one worker's ``local_init(params) -> state``.
      mesh: the device mesh.
      param_specs: the params' ``PartitionSpec`` (one for all leaves, or a tree).
      state_specs: the state's ``PartitionSpec`` tree.

    Returns:
      The mapped init (not jitted).
    """

    def init(params):
        mapped = jax.shard_map(
            local_init, mesh=mesh, in_specs=(param_specs,), out_specs=state_specs
        )
        return mapped(placed(mesh, params, param_specs))

    return init
