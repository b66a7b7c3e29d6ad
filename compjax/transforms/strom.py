"""Strom's threshold quantisation: send ``+-tau`` where the residual exceeds ``tau``.

The message is a padded sparse message with an exact bit counter (see
:mod:`compjax.transforms.padded_sparse`); the baseline of
:func:`compjax.variance_based`.

References:
  Strom, "Scalable distributed DNN training using commodity GPU cloud
  computing", Interspeech 2015.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import packing
from compjax.axes import AxisName
from compjax.payload import Payload
from compjax.transforms.padded_sparse import (
    INDEX_BITS,
    budget_slots,
    check_budget,
    check_real,
    select_slots,
    sparse_mean,
)
from compjax.transforms.scaffold import Leaf, LeafStep, leafwise, scaffold

#: Real bits per coordinate sent: index and sign.
STROM_ENTRY_BITS = INDEX_BITS + 1


class StromState(NamedTuple):
    """State of :func:`strom_threshold`.

    Attributes:
      residual: per-worker residual ``r`` (float32 by default, leading worker axis).
      bits_sent: per-worker cumulative real bits sent, uint32 ``(low, high)``.
    """

    residual: Any
    bits_sent: jax.Array
    PER_WORKER = ("residual", "bits_sent")
    COUNTS_BITS = True


def strom_threshold(
    axis_name: AxisName,
    tau: float,
    *,
    budget: int | float = 0.01,
    flatten: bool = False,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Strom's threshold quantisation: send ``+-tau`` where the residual exceeds ``tau``.

    The input is ordinary gradients.  Each worker keeps a residual ``r``::

        r <- r + g
        send sign(r_j) * tau where |r_j| > tau,  r_j <- r_j - sign(r_j) * tau

    so ``sent + residual = accumulated`` (up to the rounding of one
    subtraction).  The update is the mean over workers of the sent values.

    Wire format (per leaf, or per tree with ``flatten``; ``K`` slots):
    ``indices`` int32[K] and ``signs`` one bit per slot packed 32 to a word
    (uint32[ceil(K/32)], 1 = negative); ``tau`` is known to every worker, so no
    scale is sent.  Unused slots hold index ``d`` (dropped) and sign 0.  Padded
    bits ``32 K + 32 ceil(K/32)``; real bits ``33`` per coordinate sent (for
    ``d < 2^31`` a 31-bit index and the sign could share one 32-bit word, as
    Strom describes; not done here).  When more than
    ``K`` coordinates exceed ``tau``, the ``K`` of largest ``|r|`` are sent
    (ties to the lower index) and the others stay in the residual.

    Non-finite input on any worker gives a NaN update and keeps the whole
    state (the residual and the bit counter).

    Args:
      axis_name: the data-parallel axis (``None``: a single worker).
      tau: threshold ``tau > 0``, also the magnitude sent.
      budget: slots per message: an integer ``>= 1`` (capped at ``d``), or a
        fraction in ``(0, 1]`` of the entries (``max(1, round(budget d))``).
      flatten: one message for the whole tree instead of one per leaf.
      state_dtype: dtype of the accumulators (see
        :mod:`compjax.transforms.base`): ``None`` keeps them in float32 for
        float32, bfloat16 and float16 params (float64 for float64 params
        under ``jax_enable_x64``, whose gradients must still be at most
        float32); messages are the same either way.

    Returns:
      An ``optax.GradientTransformation`` whose update is the mean over the
      workers of the values sent, in the gradients' dtype.

    Raises:
      ValueError: ``tau``, ``budget`` or ``state_dtype`` invalid.

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.
    """
    check_real("tau", tau, lambda x: x > 0, "a finite number > 0")
    check_budget(budget)
    # The updates are computed in float32 and cast to the gradients' dtype after the guard.
    sc = scaffold(StromState, axis_name, flatten, state_dtype=state_dtype, cast_after_guard=True)
    return leafwise(sc, functools.partial(_strom_step, axis_name=axis_name, tau=tau, budget=budget))


def _strom_step(leaf: Leaf, axis_name: AxisName, tau: float, budget: int | float) -> LeafStep:
    """One worker's message for one leaf, its update (float32) and new residual."""
    g, (r,) = leaf.update, leaf.state
    shape, d = g.shape, g.size
    slots = budget_slots(budget, d)
    if slots == 0:
        return LeafStep(jnp.zeros(shape, jnp.float32), (r,))
    acc = (r + g.astype(jnp.float32)).reshape(-1)
    mag = jnp.abs(acc)
    idx, send = select_slots(mag, mag > tau, slots)
    neg = acc[idx] < 0
    q = jnp.where(send, jnp.where(neg, -tau, tau), 0.0).astype(jnp.float32)
    payload = Payload(
        wire={
            "indices": jnp.where(send, idx, d).astype(jnp.int32),
            "signs": packing.pack((send & neg).astype(jnp.uint32), 1),
        },
        side={},
        meta=((d,), np.dtype(np.float32)),
    )
    mean = sparse_mean(payload, functools.partial(_strom_decode, tau=tau, slots=slots), axis_name)
    residual = acc.at[idx].add(-q).reshape(shape)
    return LeafStep(mean.reshape(shape), (residual,), sent=((jnp.sum(send), STROM_ENTRY_BITS),))


def _strom_decode(wire: dict, tau: float, slots: int) -> tuple[jax.Array, jax.Array]:
    """A message's indices and values: ``-tau`` where the sign bit is set, ``+tau`` elsewhere."""
    signs = packing.unpack(wire["signs"], width=1, n=slots)
    return wire["indices"], jnp.where(signs == 1, jnp.float32(-tau), jnp.float32(tau))
