"""The workers' axes: names, sizes, this worker's index, and what values vary over.

An ``axis_name`` is a mapped axis name, a tuple of names (every function of
:mod:`compjax.collectives` reduces over all of them), or ``None`` for a single
worker.  This module reads the axes where the code is traced (``jax.pmap``,
``jax.shard_map``, ``jax.vmap(axis_name=...)``): which are bound and how many
workers they hold, which are manual under ``shard_map``, and which of them a
value varies over.  It sends nothing: the collectives are
:mod:`compjax.collectives`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AxisName = str | tuple[str, ...] | None


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
    """``axis_name`` as a tuple of names (empty for ``None``)."""
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


class UnboundAxisError(ValueError):
    """An axis name that is not bound where a collective runs (``axis`` names it)."""

    def __init__(self, message: str, axis: str):
        super().__init__(message)
        self.axis = axis


def num_workers(axis_name: AxisName) -> int:
    """Number of workers along ``axis_name`` (1 for ``None``).

    Raises:
      UnboundAxisError: (a ``ValueError``) the axis name is not bound here
        (not inside ``pmap``, ``shard_map`` or ``vmap`` with that name).
    """
    size = 1
    for name in axis_names(axis_name):
        try:
            size *= jax.lax.axis_size(name)
        except NameError as err:
            raise UnboundAxisError(
                f"axis_name {name!r} is not bound: call the update inside jax.pmap, "
                f"jax.shard_map or jax.vmap over an axis named {name!r} "
                f"(or pass axis_name=None for a single worker)",
                name,
            ) from err
    return size


def worker_index(axis_name: AxisName) -> jax.Array:
    """This worker's index along ``axis_name`` (0 for ``None``)."""
    if axis_name is None:
        return jnp.int32(0)
    num_workers(axis_name)  # clear error for an unbound name
    return jax.lax.axis_index(axis_names(axis_name))


def bound_names(axis_name: AxisName) -> tuple[str, ...]:
    """The names of ``axis_name``, after checking each is bound (clear error if not)."""
    num_workers(axis_name)
    return axis_names(axis_name)


def gather_target(axis_name: AxisName) -> str:
    """``"invarying"`` where the axes are manual (``shard_map``, ``pmap``), else ``"varying"``.

    Under ``shard_map`` (and ``pmap``) the axes are manual: a gathered result
    is marked replicated so that callers can return it with ``out_specs=P()``.
    """
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return "invarying" if set(axis_names(axis_name)) <= manual else "varying"


def tracks_variation(name: str) -> bool:
    """Whether values here carry the manual axes they vary over (``shard_map`` with
    ``check_vma=True``); ``pmap`` and ``check_vma=False`` do not."""
    return name in jax.typeof(jax.lax.axis_index(name)).manual_axis_type.varying


def varying(x: jax.Array) -> set[str]:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``'s typing)."""
    return set(jax.typeof(x).manual_axis_type.varying)
