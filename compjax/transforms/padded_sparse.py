"""Padded sparse messages: what variance-based compression and Strom's method share.

Both delay what they cannot send: each worker accumulates its gradients
locally and sends only the coordinates that pass a test, as a sparse,
quantised message; what is not sent stays in the accumulator, so nothing is
ever lost (``sent + residual = accumulated``, exactly up to float rounding),
unless ``variance_based(keep_error=False)`` drops its quantisation errors.

Wire format.  A sparse message has a variable length, but ``all_gather``
needs a static shape: every message is padded to a fixed number of *slots*
(``budget``).  Each slot holds an int32 index (``d``, one past the end, in an
unused slot, dropped when decoding) and a small code; the static accounting
(:func:`compjax.communication`, :func:`compjax.recording.record`) counts the
padded message, and each state keeps an exact runtime counter of the *real*
bits (the used slots only) that :func:`real_bits_sent` reads.  States with
such a counter (a ``bits_sent`` field) set ``COUNTS_BITS = True``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from compjax.axes import AxisName, num_workers
from compjax.collectives import all_gather
from compjax.payload import Payload
from compjax.recording import record

#: Bits of one index on the wire (int32).
INDEX_BITS = 32


# --- parameters --------------------------------------------------------------


def check_real(name: str, value, ok: Callable[[float], bool], what: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite real with ``ok``.

    A traced value (a hyperparameter under ``optax.inject_hyperparams``) cannot
    be checked and passes.
    """
    if isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, bool | str) or np.ndim(value) != 0:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not (math.isfinite(x) and ok(x)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(
            f"budget must be an integer >= 1 (slots) or a float in (0, 1] (a fraction of "
            f"the entries), got {budget!r}"
        )
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ValueError(f"budget must be an integer >= 1 (slots), got {budget!r}")
    elif not 0.0 < budget <= 1.0:
        raise ValueError(
            f"budget must be a float in (0, 1] (a fraction of the entries) or an "
            f"integer >= 1 (slots), got {budget!r}"
        )


def budget_slots(budget: int | float, d: int) -> int:
    """Slots of a message for ``d`` entries.

    An integer ``budget`` is a number of slots (capped at ``d``); a float is a
    fraction: ``min(d, max(1, round(budget * d)))`` (the rule of ``top_k``).
    """
    if d == 0:
        return 0
    if isinstance(budget, numbers.Integral):
        return min(int(budget), d)
    return min(d, max(1, round(budget * d)))


# --- messages and counters -----------------------------------------------------


def new_counter() -> jax.Array:
    """A per-worker bit counter at 0: uint32 words ``(low, high)``, shape ``(1, 2)``."""
    return jnp.zeros((1, 2), jnp.uint32)


def add_bits(total: jax.Array, count: jax.Array, per_entry: int) -> jax.Array:
    """``total + count * per_entry`` on a 64-bit counter of two uint32 words, exactly.

    ``total`` is ``[low, high]``; ``count < 2**31`` and ``per_entry < 2**16``.
    """
    count = count.astype(jnp.uint32)
    per = jnp.uint32(per_entry)
    low_part = (count & jnp.uint32(0xFFFF)) * per  # < 2**32
    high_part = (count >> 16) * per  # < 2**31; stands for high_part * 2**16
    lo, hi = total[0], total[1]
    for add_lo, add_hi in (
        (low_part, jnp.uint32(0)),
        (high_part << 16, high_part >> 16),
    ):
        new_lo = lo + add_lo  # wraps modulo 2**32
        hi = hi + add_hi + (new_lo < lo).astype(jnp.uint32)
        lo = new_lo
    return jnp.stack([lo, hi])


def select_slots(score: jax.Array, eligible: jax.Array, slots: int):
    """The ``slots`` eligible entries of largest score (ties: lower index first).

    Returns the indices (distinct) and which of them are eligible: fewer than
    ``slots`` eligible entries leave the remaining slots unused.
    """
    _, idx = jax.lax.top_k(jnp.where(eligible, score, -jnp.inf), slots)
    return idx, eligible[idx]


def gather(payload: Payload, axis_name: AxisName) -> Payload:
    """Every worker's ``payload`` stacked on a leading axis (one worker: axis of size 1)."""
    if axis_name is None:
        return jax.tree.map(lambda x: x[None], payload)
    return all_gather(payload, axis_name)


def scatter_mean(indices: jax.Array, values: jax.Array, d: int, n: int) -> jax.Array:
    """Mean over the ``n`` workers of their decoded sparse messages (index ``d`` dropped)."""
    dense = jnp.zeros((d,), jnp.float32)
    dense = dense.at[indices.reshape(-1)].add(values.reshape(-1), mode="drop")
    return dense / n


def sparse_mean(payload: Payload, decode: Callable, axis_name: AxisName) -> jax.Array:
    """The mean over the workers of everyone's padded sparse message, float32 ``(d,)``.

    ``payload`` (this worker's message, of shape ``(d,)``) is recorded for
    accounting and all-gathered; ``decode(wire) -> (indices, values)`` decodes each
    worker's, and the values are scattered (:func:`scatter_mean`).
    """
    record("payload", payload, "all_gather", axis_name)
    indices, values = jax.vmap(decode)(gather(payload, axis_name).wire)
    (d,) = payload.shape
    return scatter_mean(indices, values, d, num_workers(axis_name))


# --- accounting --------------------------------------------------------------


def _is_counted(node) -> bool:
    return getattr(type(node), "COUNTS_BITS", False)


def real_bits_sent(state: Any) -> int:
    """Real (unpadded) bits sent so far, from the counters in an optimizer state.

    Sums the ``bits_sent`` counters of every :class:`~compjax.VarianceBasedState`
    and :class:`~compjax.StromState` (every state with ``COUNTS_BITS``) in
    ``state`` (through chains and wrappers) over all workers present: a state
    gathered from ``shard_map`` (or stacked by ``vmap``/``pmap``) gives the
    total of all workers, one worker's state its own.  Call it outside ``jit``
    (it reads the arrays); differences between steps give the bits of a step.

    Args:
      state: an optimizer state (or any pytree) holding such states.

    Returns:
      The exact number of bits, a Python ``int``.
    """
    total = 0
    for node in jax.tree.leaves(state, is_leaf=_is_counted):
        if not _is_counted(node):
            continue
        words = np.asarray(node.bits_sent).reshape(-1, 2)
        total += sum(int(lo) + (int(hi) << 32) for lo, hi in words)
    return total
