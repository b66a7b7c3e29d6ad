"""ATOMO: unbiased sparsification of an atomic decomposition with optimal probabilities.

A tensor is written as ``sum_i lambda_i a_i`` over orthonormal atoms (its
entries, or the rank-1 terms ``sigma_i u_i v_i^T`` of its SVD); atom ``i`` is
kept independently with probability ``p_i`` and rescaled by ``1/p_i``.  The
variance ``sum_i lambda_i^2 (1/p_i - 1)`` is minimised under the budget
``sum_i p_i = s`` by ``p_i = min(1, c |lambda_i|)`` with ``c`` found by
water-filling.

References:
  Wang, Sievert, Charles, Liu, Wright, Papailiopoulos, "ATOMO:
  Communication-efficient Learning via Atomic Sparsification", NeurIPS 2018.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from compjax.compressor import Compressor, dtype_max
from compjax.draws import bernoulli, stochastic_round
from compjax.numerics import all_finite, ldexp, unit_scale


def water_fill(magnitudes: jax.Array, budget: float) -> jax.Array:
    """Variance-optimal keep probabilities ``p_i = min(1, c m_i)`` with ``sum p_i = budget``.

    With ``j`` atoms saturated at ``p = 1`` (the ``j`` largest), ``c = (s - j) /
    sum_{i >= j} m_(i)``; the answer is the smallest ``j`` for which the largest
    unsaturated atom has ``c m_(j) <= 1``.  If the budget covers every nonzero
    atom, ``p_i = 1`` for those (and ``sum p_i`` is their count).

    Args:
      magnitudes: nonnegative ``|lambda_i|``, 1-D.
      budget: ``s > 0``.

    Returns:
      ``p``, float32, same shape; 0 exactly where the magnitude is 0.

    Example (REFERENCES.md): ``m = (10, 5, 1, 1, 1, .5)``, ``s = 3`` gives
    ``p = (1, 1, 2/7, 2/7, 2/7, 1/7)``.
    """
    m = magnitudes.astype(jnp.float32)
    d = m.shape[0]
    if d == 0:
        return m
    # p is scale-free: bring max m into [1, 2) exactly, so that neither the sum
    # of magnitudes overflows nor the reciprocal of that sum flushes to zero.
    e, _ = unit_scale(jnp.max(m))
    m = ldexp(m, -e)
    order = jnp.argsort(-m)
    desc = m[order]
    tail = jnp.cumsum(desc[::-1])[::-1]  # tail[j] = sum_{i >= j} desc[i]
    j = jnp.arange(d, dtype=jnp.float32)
    valid = (tail > 0) & (j < budget) & ((budget - j) * desc <= tail)
    first = jnp.argmax(valid)
    c = (budget - first) / jnp.where(tail[first] > 0, tail[first], 1.0)
    p_desc = jnp.where(jnp.arange(d) < first, 1.0, jnp.minimum(1.0, c * desc))
    p_desc = jnp.where(jnp.any(valid), p_desc, (desc > 0).astype(jnp.float32))
    return jnp.zeros_like(m).at[order].set(p_desc)


def capacity(budget: float, atoms: int) -> int:
    """Static message slots: ``ceil(s + 8 sqrt(s) + 8)``, at most the number of atoms.

    The number of kept atoms is a sum of independent Bernoullis with mean at
    most ``s``; by Bernstein's inequality it exceeds this capacity with
    probability below ``exp(-16)`` (about 1e-7) for any ``s``, and far less
    for large ``s``.
    """
    return min(atoms, math.ceil(budget + 8.0 * math.sqrt(budget) + 8.0))


def _kept_slots(key, p: jax.Array, slots: int) -> jax.Array:
    """Indices of the atoms kept (independent Bernoulli(p_i)), padded with ``len(p)``.

    In the (improbable) event that more atoms are kept than ``slots``, the
    first ``slots`` are sent and the rest dropped.
    """
    keep = bernoulli(key, p)
    return jnp.nonzero(keep, size=slots, fill_value=p.shape[0])[0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Atomo(Compressor):
    """Entrywise ATOMO.  See :func:`atomo`."""

    budget: float = 1.0
    unbiased = True

    def encode(self, key, flat, dtype):
        d = flat.shape[0]
        p = water_fill(jnp.abs(flat), self.budget)
        idx = _kept_slots(key, p, capacity(self.budget, d))
        safe = jnp.minimum(idx, max(d - 1, 0))
        used = idx < d
        values = jnp.where(used, flat[safe] / jnp.where(used, p[safe], 1.0), 0.0)
        # x_i / p_i beyond float32's range saturates (finite, biased there) rather than Inf.
        top = float(jnp.finfo(jnp.float32).max)
        values = jnp.where(jnp.isfinite(flat[safe]), jnp.clip(values, -top, top), values)
        if np.dtype(dtype).itemsize < 4:  # decoding rounds: round onto the grid here, unbiased
            values = stochastic_round(jax.random.fold_in(key, 1), values, dtype)
        if d:  # an Inf/NaN has no probability to be kept with: send NaN (to entry 0) instead
            bad = ~all_finite(flat)
            idx = jnp.where(bad, 0, idx)
            values = jnp.where(bad, jnp.nan, values)
        return {"indices": idx, "values": values}, {}

    def decode(self, wire, side, n, dtype):
        dense = jnp.zeros((n + 1,), jnp.float32).at[wire["indices"]].add(wire["values"])
        return dense[:n]

    def omega(self, d):
        return max(0.0, d / self.budget - 1.0)

    def unbiased_range(self, d, dtype=jnp.float32):
        """``max * min(1, s/d)``: each sent ``x_i/p_i`` is at most ``max(max|x|, ||x||_1/s)``."""
        return dtype_max(dtype) * min(1.0, self.budget / d if d else 1.0)

    def bits(self, shape, dtype=jnp.float32):
        return 64 * capacity(self.budget, math.prod(shape))

    def expected_bits(self, shape) -> float:
        """Bits of the variable-length message: ``E[kept atoms] <= s`` times 64."""
        return 64.0 * min(self.budget, math.prod(shape))


def matrix_shape(shape) -> tuple[int, int]:
    """The 2-D view of a tensor: ``(shape[0], rest)``; scalars ``(1, 1)``."""
    if len(shape) == 0:
        return (1, 1)
    return (shape[0], math.prod(shape[1:]))


@dataclasses.dataclass(frozen=True)
class AtomoSVD(Compressor):
    """ATOMO over the SVD's rank-1 atoms.  See :func:`atomo_svd`."""

    budget: float = 1.0
    unbiased = True

    def compress(self, key, x):
        x = self.check(key, x)
        rows, cols = matrix_shape(x.shape)
        m = x.astype(jnp.float32).reshape(rows, cols)
        # Factorise m 2**-e, 2**e <= max|m| < 2**(e+1) (an exact scaling), so that
        # entries near the float32 limit neither overflow nor flush to zero.
        e, _ = unit_scale(jnp.max(jnp.abs(m), initial=0.0))
        u, s, vt = jnp.linalg.svd(ldexp(m, -e), full_matrices=False)
        rank = s.shape[0]
        # p is scale-free: the singular values of m 2**-e give those of m (sigma_1 of 7
        # entries of 3e38 is 7.9e38, beyond float32: unscaled it would be Inf and p 0).
        p = water_fill(s, self.budget)
        idx = _kept_slots(key, p, capacity(self.budget, rank))
        safe = jnp.minimum(idx, max(rank - 1, 0))
        used = idx < rank
        scale = jnp.where(used, s[safe] / jnp.where(used, p[safe], 1.0), 0.0)
        # sigma_i / p_i is 2**e times scale; the part of 2**e that the scales cannot hold
        # (only for entries near the float32 limit) goes into the right vectors, whose
        # entries are at most 1, so that each sent number is finite.
        top, _ = unit_scale(jnp.max(scale, initial=0.0))
        e_scale = jnp.minimum(e, 127 - top)
        scale = ldexp(scale, e_scale)
        right = vt[safe, :]
        right = jnp.where(e_scale < e, ldexp(right, e - e_scale), right)
        # An Inf/NaN makes the SVD meaningless: send NaN scales, which decode to NaN.
        scale = jnp.where(all_finite(m), scale, jnp.nan)
        wire = {"left": u[:, safe] * used, "right": right, "scales": scale}
        return self.payload(wire, {}, x)

    def decompress(self, payload):
        wire = payload.wire
        # Scales beyond 2**64 are brought down by a power of two g for the product (exact)
        # and the result back up, saturating at float32's largest value instead of Inf: a
        # draw sigma_i u_i v_i^T / p_i beyond float32 saturates, and partial sums of atoms
        # larger than float32 that cancel stay finite.  g = 0 everywhere else.
        top, _ = unit_scale(jnp.max(jnp.abs(wire["scales"]), initial=0.0))
        g = jnp.maximum(top - 64, 0)
        m = (wire["left"] * ldexp(wire["scales"], -g)) @ wire["right"]
        limit = ldexp(jnp.float32(dtype_max(jnp.float32)), -g)
        m = ldexp(jnp.where(jnp.isfinite(m), jnp.clip(m, -limit, limit), m), g)
        return self.finish(m.reshape(-1), payload)

    def omega(self, d):
        # Rank of any 2-D view of d entries is at most floor(sqrt(d)).
        return max(0.0, math.isqrt(d) / self.budget - 1.0) if d else 0.0

    def unbiased_range(self, d, dtype=jnp.float32):
        """``max / max(sqrt(d), d**0.75 / s)``.

        Each decoded entry is at most ``max(sigma_1, ||sigma||_1 / s)`` (the
        rows of ``U`` and ``V`` have norm at most 1), ``sigma_1 <= ||x||_F <=
        sqrt(d) max|x|`` and ``||sigma||_1 <= sqrt(rank) ||x||_F <= d**0.75
        max|x|``: a sufficient bound, not a tight one.
        """
        if d == 0:
            return dtype_max(dtype)
        return dtype_max(dtype) / max(math.sqrt(d), d**0.75 / self.budget)

    def omega_for_shape(self, shape) -> float:
        """``max(0, rank/s - 1)`` with ``rank = min`` of :func:`matrix_shape` (attained
        when every singular value is equal)."""
        return max(0.0, min(matrix_shape(shape)) / self.budget - 1.0)

    def bits(self, shape, dtype=jnp.float32):
        rows, cols = matrix_shape(shape)
        return 32 * capacity(self.budget, min(rows, cols)) * (rows + cols + 1)

    def expected_bits(self, shape) -> float:
        """Bits of the variable-length message: ``E[kept atoms] <= s`` atoms of
        ``32 (rows + cols + 1)`` bits."""
        rows, cols = matrix_shape(shape)
        return 32.0 * min(self.budget, min(rows, cols)) * (rows + cols + 1)


def _check_budget(budget):
    if not (isinstance(budget, int | float) and budget > 0 and math.isfinite(budget)):
        raise ValueError(f"budget must be a positive finite number, got {budget!r}")
    return float(budget)


def atomo(budget: float) -> Atomo:
    """ATOMO with entrywise atoms: keep entry ``i`` w.p. ``p_i = min(1, c|x_i|)``, send ``x_i/p_i``.

    Theory: unbiased; variance ``sum_i x_i^2 (1/p_i - 1)``, at most
    ``(d/s - 1) ||x||^2`` (equal magnitudes), so ``omega(d) = max(0, d/s - 1)``.
    With ``s = ||x||_1 / ||x||_inf`` the probabilities are TernGrad's, with
    ``s = ||x||_1 / ||x||_2`` QSGD's at one level.

    For bfloat16/float16 inputs each rescaled value is rounded onto the
    input dtype's grid at random (unbiased), so decoding's cast is exact
    (float16 values beyond 65504 saturate, biased).

    Range of unbiasedness (``unbiased_range(d, dtype)``): ``max|x_i| <= max
    * min(1, s/d)``, ``max`` the dtype's largest finite value.  Each sent
    ``x_i/p_i`` is at most ``max(max|x|, ||x||_1/s)`` (an unsaturated atom
    sends ``1/c``, below the last saturated magnitude or ``||x||_1/s``), and
    ``||x||_1 <= d max|x|``.  Beyond it sent values can saturate (float16:
    7 entries of 65504 at ``s = 4`` need ``7/4 * 65504``).  A concrete input
    beyond it warns (``UnbiasedRangeWarning``); inputs under ``jit`` are not
    checked.

    Wire format: a fixed number of slots, :func:`capacity` ``(s, d)``, of int32
    indices and float32 rescaled values; unused slots carry index ``d`` and
    value 0.  ``bits`` counts those slots; ``expected_bits`` gives the
    variable-length message's ``64 min(s, d)`` bits of the paper's accounting.

    Args:
      budget: expected number of atoms sent, ``s > 0``.

    Returns:
      An :class:`Atomo` compressor whose payload holds ``"indices"`` (int32) and
      ``"values"`` (float32 ``x_i / p_i``) in :func:`capacity` ``(s, d)`` slots;
      it decodes to those values at those indices and 0 elsewhere.

    Raises:
      ValueError: ``budget`` is not a positive finite number.

    References:
      Wang et al., "ATOMO: Communication-efficient Learning via Atomic
      Sparsification", NeurIPS 2018.
    """
    return Atomo(budget=_check_budget(budget))


def atomo_svd(budget: float) -> AtomoSVD:
    """ATOMO with SVD atoms of the 2-D view ``(shape[0], rest)``: ``sum sigma_i u_i v_i^T``.

    Rank-1 term ``i`` is kept w.p. ``p_i = min(1, c sigma_i)`` and sent as
    ``(u_i, v_i, sigma_i / p_i)``.  Unbiased with variance
    ``sum_i sigma_i^2 (1/p_i - 1)``; on gradients of low effective rank this is
    far below entrywise ATOMO's at the same bits.

    In bfloat16/float16 the decoded product is rounded to the input dtype,
    deterministically: unbiased only up to that rounding (half an ulp).

    Entries near the float32 limit: the SVD is of ``x 2**-e`` (``2**e <=
    max|x|``) and ``p`` is drawn from its singular values (scale-free); the
    part of ``2**e`` that a scale ``sigma_i / p_i`` cannot hold goes into the
    right vectors, and the decode's product is scaled the same way and
    saturates at float32's largest value: 7 entries of 3e38 (``sigma_1`` =
    7.9e38) decode to themselves, a draw beyond float32 to its largest value.
    Range of unbiasedness: ``unbiased_range(d, dtype)`` (a sufficient bound).

    Wire format: :func:`capacity` ``(s, rank)`` slots of a left vector, a right
    vector and a float32 scale (unused slots zero): ``32 (rows + cols + 1)``
    bits per slot; ``expected_bits`` for the variable-length message.

    Args:
      budget: expected number of rank-1 atoms sent, ``s > 0``.

    Returns:
      An :class:`AtomoSVD` compressor whose payload holds, per slot, ``"left"``
      and ``"right"`` (float32 singular vectors of the 2-D view) and
      ``"scales"`` (float32 ``sigma_i / p_i``, 0 in unused slots); it decodes
      to the sum of the kept rank-1 terms in the input's shape.

    Raises:
      ValueError: ``budget`` (atoms expected) is not a positive finite number.

    References:
      Wang et al., "ATOMO: Communication-efficient Learning via Atomic
      Sparsification", NeurIPS 2018 (the singular value decomposition's atoms).
    """
    return AtomoSVD(budget=_check_budget(budget))
