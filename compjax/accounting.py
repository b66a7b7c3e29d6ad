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

from compjax.collectives import AxisName, recording


class CommunicationReport(NamedTuple):
    """Per-step communication of one worker.

    Attributes:
      bits_per_worker: bits one worker sends per step (from the payloads).
      dense_bits: bits of the same update sent as dense float32.
      messages: ``(kind, bits)`` of every message, in order.
    """

    bits_per_worker: int
    dense_bits: int
    messages: tuple[tuple[str, int], ...]

    @property
    def compression_ratio(self) -> float:
        return self.dense_bits / self.bits_per_worker if self.bits_per_worker else float("inf")


def communication(
    tx: optax.GradientTransformation,
    params: Any,
    axis_name: AxisName = "data",
    num_workers: int = 2,
) -> CommunicationReport:
    """The bits one worker sends per step when ``tx`` updates ``params``-shaped gradients.

    Args:
      tx: any optax transformation containing compjax transformations
        (chains, wrappers); transformations that send nothing count zero.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      axis_name: the axis name ``tx``'s compjax parts reduce over (a single
        name; ``None`` for transformations built with ``axis_name=None``).
      num_workers: workers to simulate (only integer sums depend on it).

    Returns:
      A :class:`CommunicationReport`.
    """
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)

    def step(p):
        return tx.update(p, tx.init(p), p)

    with recording() as log:
        if axis_name is None:
            jax.eval_shape(step, shapes)
        else:
            batched = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct((num_workers, *s.shape), s.dtype), shapes
            )
            jax.eval_shape(jax.vmap(step, axis_name=axis_name), batched)
    messages, seen = [], set()
    for owner, sent in log:
        if owner is not None and owner in seen:
            continue  # the same transformation traced again (e.g. by MultiSteps)
        seen.add(owner)
        messages.extend(sent)
    dense = sum(32 * int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    return CommunicationReport(
        bits_per_worker=sum(b for _, b in messages), dense_bits=dense, messages=tuple(messages)
    )
