"""Bits per step of dAD, rank-dAD, the plain gradient and PowerSGD on the same model and batch.

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation", arXiv:2102.09631, 2021 (dAD: ``N (in + out)`` numbers per
  linear layer instead of ``in x out``; rank-dAD: ``r (in + out)``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from compjax.accounting import communication
from compjax.dad.capture import LossFn
from compjax.dad.exchange import dad_grads, rank_dad_grads
from compjax.recording import recording
from compjax.transforms.powersgd import powersgd


def _traced_bits(grads_fn, params: Any, batch: Any, axis_name: str, workers: int) -> int:
    """Bits one site records while ``grads_fn`` is traced under ``vmap`` (nothing runs)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), (params, batch))
    params_s, batch_s = shapes
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((workers, *s.shape), s.dtype), batch_s)
    with recording() as log:
        jax.eval_shape(
            jax.vmap(grads_fn, in_axes=(None, 0), axis_name=axis_name), params_s, stacked
        )
    return sum(bits for _, messages in log for _, bits in messages)


def dad_communication(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    *,
    rank: int,
    iterations: int = 2,
    axis_name: str = "data",
    workers: int = 2,
) -> dict[str, int]:
    """Bits one site sends per step with each method, for this model and local batch.

    dAD and rank-dAD are traced abstractly (``jax.eval_shape`` under
    ``jax.vmap``, nothing runs) and their recorded messages added up, as
    :func:`compjax.communication` does for transformations; PowerSGD is
    :func:`compjax.communication`'s ``payload_bits`` of :func:`compjax.powersgd`
    at the same rank (with its 8-bit non-finite flag).  These are the sizes
    of the messages a site hands its collectives, not the ring traffic of
    ``communication().bits_per_worker``: dAD and rank-dAD all-gather them
    (each site sends ``(n - 1)`` times its message), while plain and
    PowerSGD all-reduce (``2 (n - 1) / n`` times).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` as in
        :func:`compjax.dad.dad_grads`.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      batch: one site's batch (arrays or ``jax.ShapeDtypeStruct``).
      rank: the rank of rank-dAD and PowerSGD.
      iterations: rank-dAD's power iterations (they do not change the bits).
      axis_name: the axis name used while tracing.
      workers: sites simulated while tracing (the bits do not depend on it).

    Returns:
      ``{"plain": ..., "dad": ..., "rank_dad": ..., "powersgd": ...}``: bits
      per site per step.  ``plain`` is ``32 x`` the parameter count;
      ``dad`` is ``32 rows (in + out)`` per Dense layer (``rows`` = local
      examples times sequence length) plus the other leaves in float32;
      ``rank_dad`` is ``32 k (out + in + 1)`` per Dense layer (``k`` the
      padded factor width, see :func:`compjax.dad.factor_rank`), an int32
      rank per layer, plus the other leaves.
    """
    plain = sum(32 * math.prod(np.shape(x)) for x in jax.tree.leaves(params))

    def dad(p, b):
        return dad_grads(loss_fn, p, b, axis_name)

    def rank_dad(p, b):
        return rank_dad_grads(loss_fn, p, b, axis_name, rank=rank, iterations=iterations)

    return {
        "plain": plain,
        "dad": _traced_bits(dad, params, batch, axis_name, workers),
        "rank_dad": _traced_bits(rank_dad, params, batch, axis_name, workers),
        "powersgd": communication(
            powersgd(rank, axis_name), params, axis_name, workers
        ).payload_bits,
    }
