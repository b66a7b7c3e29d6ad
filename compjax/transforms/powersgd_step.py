"""PowerSGD's step: the factors' messages, the low-rank update and the error memory.

Every leaf sent uncompressed is all-reduced in one float32 message
(:func:`dense_means`); every matrix's ``P`` travels in one message and its
``Q`` in one more (:func:`factors_together`), as ``powerSGD_hook`` packs them;
:func:`low_rank` turns a matrix's factors into its update and new memory,
taken again on scaled inputs (:func:`rescaled`) on the steps whose sums
overflow float32.  The transformation, its state and its arguments are
:mod:`compjax.transforms.powersgd`.

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", NeurIPS 2019 (Algorithms 1-2).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compjax.axes import AxisName
from compjax.collectives import pmax, psum, psum_together
from compjax.exchange.overflow import mean_without_overflow
from compjax.guards import all_finite, saturated
from compjax.numerics import exponent, ldexp, to_dtype, unit_scale
from compjax.recording import record, unrecorded


class Options(NamedTuple):
    """The static arguments of :func:`compjax.transforms.powersgd.powersgd` that a step reads.

    Attributes:
      axis_name: the data-parallel axis.
      epsilon: ``orthogonalization_epsilon``, added to column norms in Gram-Schmidt.
      error_feedback: keep the residual in the error memory.
    """

    axis_name: AxisName
    epsilon: float
    error_feedback: bool


#: float32's largest finite value (PowerSGD's memory and update saturate there).
_TOP = float(jnp.finfo(jnp.float32).max)


def outer_sum(p: jax.Array, q: jax.Array, shape=None) -> jax.Array:
    """``p @ q.T`` for ``(rows, r)`` and ``(cols, r)`` factors of a small rank ``r``,
    reshaped to ``shape`` (its leading axes the rows, the rest the columns).

    Written as ``r`` broadcast products, an elementwise expression that XLA
    fuses into each loop that reads the product (the update, the new error
    memory), so the ``rows x cols`` matrix is never written and read back: on
    ResNet-50's matrices the product as a ``dot`` cost a write and two reads
    of every entry.  Built in the tensor's own shape, so that no layout change
    follows (XLA's CPU backend copied each 1x1 kernel's matrix into its 4-D
    layout).  The terms are added in order ``k = 0 .. r - 1``.
    """
    shape = (p.shape[0], q.shape[0]) if shape is None else tuple(shape)
    split = next(i for i in range(len(shape) + 1) if math.prod(shape[:i]) == p.shape[0])
    rows, cols = shape[:split], shape[split:]
    terms = [
        p[:, k].reshape(rows + (1,) * len(cols)) * q[:, k].reshape(cols) for k in range(p.shape[1])
    ]
    return functools.reduce(operator.add, terms)


def unit(col: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(e, col 2**-e)`` with ``2**e <= max|col| < 2**(e+1)``: an exact scaling."""
    e, _ = unit_scale(jnp.max(jnp.abs(col), initial=0.0))
    return e, ldexp(col, -e)


def orthogonalize(m: jax.Array, epsilon: float = 0.0) -> jax.Array:
    """Gram-Schmidt on the columns of ``m`` (as PyTorch's hook); a zero column stays zero.

    Each column is scaled by a power of two (exact, :mod:`compjax.numerics`)
    before its projections and again before its norm, with ``epsilon``
    scaled alike: the same result, but the norm of entries beyond ``1.8e19``
    no longer overflows (which made the column, and the update, zero).
    """
    cols = []
    for i in range(m.shape[1]):
        _, col = unit(m[:, i])
        for prev in cols:
            col = col - jnp.dot(prev, col) * prev
        e, col = unit(col)
        norm = jnp.linalg.norm(col) + ldexp(jnp.float32(epsilon), -e)
        cols.append(jnp.where(norm > 0, col / jnp.where(norm > 0, norm, 1.0), 0.0))
    return jnp.stack(cols, axis=1) if cols else m


def dense_means(gs, n: int, opts: Options):
    """The mean over workers of each leaf sent uncompressed, in one message."""
    g32s = [g.astype(jnp.float32) for g in gs]
    if not g32s:
        return []
    record("dense", tuple(g32s), "all_reduce", opts.axis_name)
    totals = psum_together(g32s, opts.axis_name)
    return [
        # no overflow near the maximum: a sum that overflowed is taken again, scaled
        mean_without_overflow(total, lambda s, g=g: psum(g * s, opts.axis_name), n)[0].astype(
            gs[i].dtype
        )
        for i, (g, total) in enumerate(zip(g32s, totals, strict=True))
    ]


def factors(m, q, n: int, opts: Options):
    """``P`` (orthonormal), the mean ``Q`` of ``m``, and whether their sums were finite."""
    (p,), (q_mean,), (finite,) = factors_together([m], [q], n, opts)
    return p, q_mean, finite


def factors_together(ms, qs, n: int, opts: Options):
    """:func:`factors` of every matrix, each factor's sums in one message for all."""
    if not ms:  # no matrix to compress: no message
        return [], [], []
    ps = [(m @ q).astype(jnp.float32) for m, q in zip(ms, qs, strict=True)]
    record("P", tuple(ps), "all_reduce", opts.axis_name)  # P and Q travel in float32
    totals_p = psum_together(ps, opts.axis_name)
    ps = [orthogonalize(t, opts.epsilon) for t in totals_p]
    q_news = [(m.T @ p).astype(jnp.float32) for m, p in zip(ms, ps, strict=True)]
    record("Q", tuple(q_news), "all_reduce", opts.axis_name)
    totals_q = psum_together(q_news, opts.axis_name)
    q_means = [t / n for t in totals_q]
    # Finite sums whose mean Q stays below half of float32's maximum: each product of an
    # orthonormal P's entry (at most 1) with Q's is then finite, and P Q^T has no NaN.
    finite = [
        all_finite([tp, tq]) & (jnp.max(jnp.abs(q), initial=0.0) < _TOP / 2)
        for tp, tq, q in zip(totals_p, totals_q, q_means, strict=True)
    ]
    return ps, q_means, finite


def rescaled(m, q, n: int, opts: Options):
    """:func:`factors` of ``M 2**-a`` and ``Q`` scaled into ``[1, 2)`` (exact scalings,
    ``2**a <= max_i max|M_i|`` shared by every worker): ``(P, Q 2**-a, a)``.

    ``P`` does not change with the scaling and the mean ``Q`` is ``2**-a``
    times the true one, but no sum overflows for finite ``M``.
    """
    a = jnp.clip(exponent(pmax(jnp.max(jnp.abs(m), initial=0.0), opts.axis_name)), -126, 126)
    p, q_scaled, _ = factors(ldexp(m, -a), unit(q)[1], n, opts)
    return p, q_scaled, a


def low_rank(g, m, q, p, q_new, finite, n: int, opts: Options):
    """The update and residual of one leaf from its factors (their sums already taken)."""
    # Where the sums overflowed float32 (gradients near its largest value, or a
    # warm-started Q as large as them), again on scaled M and Q, on such steps only.
    # The mean Q is kept scaled: the warm start uses only its direction.
    with unrecorded():
        p, q_new, a = jax.lax.cond(
            finite,
            # (0 with finite's varying axes: on model-sharded params both vary over them)
            lambda: (p, q_new, finite.astype(jnp.int32) * 0),
            lambda: rescaled(m, q, n, opts),
        )
    # The update as delivered (in g's dtype, saturating at its largest value: the product
    # can round past it): what it rounds away stays in the memory, which saturates too.
    approx = to_dtype(saturated(ldexp(outer_sum(p, q_new, g.shape), a)), g.dtype)
    if not opts.error_feedback:
        return approx, jnp.zeros(g.shape, jnp.float32), q_new
    return approx, saturated(m.reshape(g.shape) - approx), q_new


def compressed_step(arrays, errors, qs, n: int, opts: Options):
    """Every leaf's update: the uncompressed leaves' means in one message, then every
    matrix's ``P`` in one and its ``Q`` in one (as ``powerSGD_hook`` packs them)."""
    out, new_errors, new_qs = list(arrays), list(errors), list(qs)
    dense = [i for i, q in enumerate(qs) if q is None]
    for i, mean in zip(dense, dense_means([arrays[i] for i in dense], n, opts), strict=True):
        out[i] = mean
    low = [i for i, q in enumerate(qs) if q is not None]
    ms = []
    for i in low:
        cols = qs[i].shape[0]  # Q is (cols, r)
        m = arrays[i].reshape(-1, cols).astype(jnp.float32)
        ms.append(saturated(m + errors[i].reshape(m.shape)))
    ps, q_means, finite = factors_together(ms, [qs[i] for i in low], n, opts)
    for j, i in enumerate(low):
        o, residual, q_new = low_rank(
            arrays[i], ms[j], qs[i], ps[j], q_means[j], finite[j], n, opts
        )
        out[i] = o
        new_errors[i] = to_dtype(residual.reshape(errors[i].shape), errors[i].dtype)
        new_qs[i] = q_new
    return out, new_errors, tuple(new_qs)


def warmup_step(arrays, errors, qs, n: int, opts: Options):
    """A step before ``start_iter``: every leaf's dense mean (not logged: the communication
    report gives the compressed steady state); the memories and ``Q`` kept."""
    with unrecorded():
        return dense_means(arrays, n, opts), list(errors), tuple(qs)
