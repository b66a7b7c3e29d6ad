"""Means over workers whose sums would overflow though the means cannot.

``n`` workers each sending values near their dtype's largest value sum to
Inf.  The two guards here keep the plain ``sum / n`` (bit for bit) wherever
the sum is finite, and only on steps where it overflowed take the sum again
on the values pre-scaled by an exact power of two
(:func:`compjax.numerics.prescale`): nothing extra is sent otherwise, and a
resent message is not logged as traffic.

* :func:`mean_without_overflow`: the one overflow-safe mean of a sum, given
  the sum and a way to take it again scaled (every flat exchange's mean,
  and the means PowerSGD and DGC take themselves);
* :func:`rescaled_if_overflow`: a whole exchange run again pre-scaled
  (scatter-gather and hierarchical, whose second compression sees the sum).

Both are called from above (:mod:`compjax.exchange.choose`, the
transformations) with the exchange's own sums
(:mod:`compjax.exchange.two_level`, :mod:`compjax.exchange.flat`) as
arguments, which they call down.

The second run is the body of a ``while_loop`` that runs at most once, not
a branch of a ``lax.cond``: under ``vmap`` (simulated workers) a ``cond`` on
a per-worker predicate becomes a select that runs both branches on every
step.  A whole exchange run again is the same jitted function called on
arguments of the same types, so JAX traces it once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from compjax import numerics, recording
from compjax.numerics import prescale

#: Extra binades of headroom when a whole exchange is run again pre-scaled: a lossy
#: compressor's decode can exceed its input's largest entry (QSGD's levels reach
#: ``||x||``, up to ``sqrt(d) max|x|``), and its sums with it.
HEADROOM = 32


def scaled_back(a: jax.Array, factor: float) -> jax.Array:
    """``a * factor`` in float32, saturating at float32's largest value where ``a`` is finite
    (an Inf or NaN in ``a`` is kept as it is)."""
    top = float(jnp.finfo(jnp.float32).max)
    a = a.astype(jnp.float32)
    return jnp.where(jnp.isfinite(a), jnp.clip(a * factor, -top, top), a)


def mean_without_overflow(total: jax.Array, resum, n: int) -> tuple[jax.Array, jax.Array]:
    """``(total / n, finite)`` of ``total``, a sum over ``n`` workers, without overflow.

    Terms each at most their dtype's largest value can sum to Inf though
    their mean is finite.  Wherever ``total`` is finite the mean is
    ``total / n`` bit for bit; where an entry is not, it is ``resum(2**-k)``
    (the same sum of every term times ``2**-k``, :func:`compjax.numerics.prescale`:
    an exact scaling whose sum cannot overflow) times ``2**k / n`` in float32,
    saturating at ``total``'s dtype's largest value.  ``resum`` runs only on
    such steps (:func:`once_more_if_not_finite`: nothing extra is sent
    otherwise, and what it sends is not logged as traffic); a term that is
    itself Inf or NaN keeps that entry non-finite.

    Args:
      total: the sum (any float dtype; the same on every worker: a reduced value).
      resum: ``scale -> `` the same sum of every term times ``scale``.
      n: the number of terms (workers).

    Returns:
      ``(mean, finite)``: the mean in ``total``'s dtype, and whether it is
      finite (a boolean scalar).
    """
    down, up = prescale(n)

    def again(carried):
        (total,) = carried
        with recording.unrecorded():
            rescaled = numerics.to_dtype(scaled_back(resum(down), up), total.dtype)
        return (jnp.where(jnp.isfinite(total), total / n, rescaled),)

    retry, (out,), finite = once_more_if_not_finite(total, (total,), again)
    return jnp.where(retry, out, out / n), finite


def once_more_if_not_finite(total: jax.Array, first, again):
    """``(retry, result, finite)``: ``again(first)`` if ``total`` has an Inf or NaN, else ``first``.

    ``retry`` says which.  ``finite`` says whether the mean (the result's
    first array, ``total / n`` when not retried) is finite: ``not retry``, or
    on a retried step the check of ``again``'s mean, made in the loop's body,
    so that the guard need not read the mean again
    (:attr:`compjax.exchange.Exchanged.finite`).

    A ``while_loop`` whose body runs at most once (and, under ``vmap``, only
    on steps where some worker's ``total`` is not finite): see the module
    docstring.  The loop carries ``first`` and the body reads it from the
    carry, so XLA keeps ``first``'s buffers in place; the callers carry the
    sum itself and divide after the loop, where the division fuses with what
    reads the mean (the guard's select, the optimiser's update).  (Carrying
    ``total / n`` cost one more pass over every array, and a body reading
    ``total`` from outside the loop a copy: together 9 ms of ``make bench``'s
    69 ms sign MLP step.)
    """
    retry = jnp.logical_not(numerics.all_finite(total))

    def body(carry):
        retry, carried, _ = carry
        out = again(carried)
        return jnp.logical_and(retry, False), out, numerics.all_finite(out[0])

    _, out, finite = jax.lax.while_loop(
        lambda carry: carry[0], body, (retry, first, jnp.logical_not(retry))
    )
    return retry, out, finite


def rescaled_if_overflow(run, x: jax.Array, memory, n: int):
    """An exchange ``run(x, memory) -> (total, local, memory)`` as ``(mean, local, memory, ok)``.

    If its float32 sum overflows anywhere, the exchange is run again on ``x``
    and ``memory`` times ``2**-(k + HEADROOM)`` (:func:`compjax.numerics.prescale`, exact
    except that entries below about ``2**(-94 + k)`` flush to zero; no
    headroom for float16) and its
    results scaled back (the mean by ``2**(k + HEADROOM) / n``, ``local`` and
    the memory by ``2**(k + HEADROOM)``, saturating at float32's largest value).
    ``ok`` says whether the mean is finite (:func:`once_more_if_not_finite`).
    """
    run = jax.jit(run)  # called twice on the same types: traced once
    total, local, new_memory = run(x, memory)
    # float16's narrow exponent has no room for the headroom (and its decodes saturate at 65504).
    wide = jnp.finfo(x.dtype).maxexp >= jnp.finfo(jnp.float32).maxexp
    down, up = prescale(n, HEADROOM if wide else 0)

    def again(_):
        with recording.unrecorded():
            ms = None if memory is None else memory * jnp.asarray(down, memory.dtype)
            t, lo, m = run(x * jnp.asarray(down, x.dtype), ms)
        scale = 1.0 / down
        lo = scaled_back(lo, scale).astype(local.dtype)
        m = None if m is None else scaled_back(m, scale).astype(new_memory.dtype)
        return scaled_back(t, up), lo, m

    # On a retry the loop's first value is the mean itself; otherwise the sum.
    retry, (out, local, new_memory), finite = once_more_if_not_finite(
        total, (total, local, new_memory), again
    )
    return jnp.where(retry, out, out / n), local, new_memory, finite
