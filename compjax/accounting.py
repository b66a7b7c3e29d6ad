"""Bits each worker sends per step, counted from the payloads a transformation builds.

The transformation's update is traced abstractly (``jax.eval_shape``, nothing
runs) under ``jax.vmap`` with the axis name bound, while
:func:`compjax.collectives.recording` logs the wire bits of every message
each worker sends: payloads with their scales and indices, integer votes,
shared scalers, flags.  Each compjax transformation counts one round per
step even where a wrapper traces it twice; under ``optax.MultiSteps(k)`` a
round happens every ``k`` steps, so divide by ``k`` for the per-step mean.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from compjax.collectives import AxisName, _names, recording

#: Kinds of the messages a hierarchical exchange sends over its fast axis.
FAST_PREFIX = "fast_"


class CommunicationReport(NamedTuple):
    """Per-step communication of one worker.

    Attributes:
      bits_per_worker: bits one worker sends per step (from the payloads).
      dense_bits: bits of the same update sent dense, in each gradient leaf's
        own dtype (16 per entry for a bf16 model, 32 for float32).
      messages: ``(kind, bits)`` of every message, in order.
      routes: ``(kind, via, axes)`` of every message, in the same order:
        ``via`` the collective that carries it (``"all_reduce"``,
        ``"all_gather"``, ``"all_to_all"`` or ``"reduce_scatter"``; a
        ``pmax`` is an all-reduce), ``axes`` the mesh axes it crosses.
    """

    bits_per_worker: int
    dense_bits: int
    messages: tuple[tuple[str, int], ...]
    routes: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    def bits_by_route(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """Bits per ``(via, axes)``: what is all-reduced and what all-gathered, per axis."""
        out: dict[tuple[str, tuple[str, ...]], int] = {}
        for (_, bits), (_, via, axes) in zip(self.messages, self.routes, strict=True):
            out[via, axes] = out.get((via, axes), 0) + bits
        return out

    @property
    def compression_ratio(self) -> float:
        return self.dense_bits / self.bits_per_worker if self.bits_per_worker else float("inf")

    @property
    def fast_bits(self) -> int:
        """Bits sent over the fast axis of a hierarchical exchange (uncompressed)."""
        return sum(b for kind, b in self.messages if kind.startswith(FAST_PREFIX))

    @property
    def slow_bits(self) -> int:
        """Bits sent over the other axes (everything but :attr:`fast_bits`)."""
        return self.bits_per_worker - self.fast_bits


def communication(
    tx: optax.GradientTransformation,
    params: Any,
    axis_name: AxisName = "data",
    num_workers: int | tuple[int, ...] = 2,
) -> CommunicationReport:
    """The bits one worker sends per step when ``tx`` updates ``params``-shaped gradients.

    Args:
      tx: any optax transformation containing compjax transformations
        (chains, wrappers); transformations that send nothing count zero.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      axis_name: the axis name (or tuple of names) ``tx``'s compjax parts
        reduce over; ``None`` for transformations built with ``axis_name=None``.
      num_workers: workers to simulate along each axis (an int for all of
        them, or one per name).  Integer sums and the shards of
        scatter-gather and hierarchical exchanges depend on it.

    Returns:
      A :class:`CommunicationReport`.
    """
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)

    def step(p):
        return tx.update(p, tx.init(p), p)

    names = _names(axis_name)
    sizes = tuple(num_workers) if isinstance(num_workers, tuple) else (num_workers,) * len(names)
    if len(sizes) != len(names):
        raise ValueError(f"num_workers {num_workers!r} must give one size per axis of {names}")
    batched = jax.tree.map(lambda s: jax.ShapeDtypeStruct((*sizes, *s.shape), s.dtype), shapes)
    for name in reversed(names):
        step = jax.vmap(step, axis_name=name)
    with recording() as log:
        jax.eval_shape(step, batched)
    messages, routes, seen = [], [], set()
    for owner, sent in log:
        if owner is not None and owner in seen:
            continue  # the same transformation traced again (e.g. by MultiSteps)
        seen.add(owner)
        messages.extend(sent)
        routes.extend(sent.routes)
    dense = sum(
        8 * np.dtype(s.dtype).itemsize * int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)
    )
    return CommunicationReport(
        bits_per_worker=sum(b for _, b in messages),
        dense_bits=dense,
        messages=tuple(messages),
        routes=tuple(routes),
    )
