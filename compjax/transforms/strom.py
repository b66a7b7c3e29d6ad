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
from compjax.collectives import AxisName, num_workers, record
from compjax.payload import Payload
from compjax.transforms.base import (
    Leaves,
    any_non_finite,
    cast_like,
    check_state_dtype,
    counted,
    guarded,
    state_zeros,
)
from compjax.transforms.padded_sparse import (
    INDEX_BITS,
    add_bits,
    budget_slots,
    check_budget,
    check_real,
    gather,
    new_counter,
    scatter_mean,
    select_slots,
)

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

    Raises:
      ValueError: ``tau``, ``budget`` or ``state_dtype`` invalid.

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.
    """
    check_real("tau", tau, lambda x: x > 0, "a finite number > 0")
    check_budget(budget)
    zeros = state_zeros(check_state_dtype(state_dtype))

    def init_fn(params):
        residual = Leaves(params, flatten).worker_state(zeros)
        return StromState(residual=residual, bits_sent=new_counter())

    def update_fn(updates, state, params=None):
        leaves = Leaves(updates, flatten)
        bad = any_non_finite(leaves.arrays, axis_name)
        residuals = leaves.read(state.residual, "residual", per_worker=True)
        n = num_workers(axis_name)
        counter = state.bits_sent[0]
        out, new_res = [], []
        for g, r in zip(leaves.arrays, residuals, strict=True):
            shape, d = g.shape, g.size
            slots = budget_slots(budget, d)
            if slots == 0:
                out.append(jnp.zeros(shape, jnp.float32))
                new_res.append(r)
                continue
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
            record("payload", payload, "all_gather", axis_name)
            wire = gather(payload, axis_name).wire
            signs = jax.vmap(functools.partial(packing.unpack, width=1, n=slots))(wire["signs"])
            values = jnp.where(signs == 1, jnp.float32(-tau), jnp.float32(tau))
            out.append(scatter_mean(wire["indices"], values, d, n).reshape(shape))
            new_res.append(acc.at[idx].add(-q).reshape(shape))
            counter = add_bits(counter, jnp.sum(send), STROM_ENTRY_BITS)
        new_state = StromState(
            residual=leaves.write(cast_like(new_res, residuals), per_worker=True),
            bits_sent=counter[None],
        )
        out, new_state = guarded(bad, out, new_state, state)
        out = [o.astype(g.dtype) for o, g in zip(out, leaves.arrays, strict=True)]
        return leaves.rebuild(out), new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))
