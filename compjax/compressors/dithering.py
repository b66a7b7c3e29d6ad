"""Natural dithering: random dithering on the power-of-two levels ``1, 1/2, ..., 2^(1-s), 0``.

References:
  Horvath, Ho, Horvath, Sahu, Canini, Richtarik, "Natural Compression for
  Distributed Deep Learning", MSML 2022 (arXiv:1905.10988), Section 4
  (natural dithering and its variance theorem).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.compressor import Compressor, dtype_max
from compjax.compressors.elementwise import Elementwise
from compjax.compressors.qsgd import l2_norm, norm_of_pieces, saturated_norm
from compjax.draws import bernoulli
from compjax.numerics import (
    divide,
    exponent,
    fraction_between,
    magnitude,
    pow2,
    round_to,
    unit_scale,
)
from compjax.pieces import Pieces

_MAX_LEVELS = 64


def natural_dithering_paper_bound(d: int, levels: int, p: float = 2.0) -> float:
    """The paper's bound ``1/8 + d^(1/r) 2^(1-s) min(1, d^(1/r) 2^(1-s))``, ``r = min(p, 2)``.

    Valid for every ``p >= 1``, not attained (it adds the worst case of the
    large levels, ``1/8``, to that of the bottom interval ``[0, 2^(1-s)]``,
    which no single vector reaches together).
    """
    if d <= 0:
        return 0.0
    z = d ** (1.0 / min(p, 2.0)) * 2.0 ** (1 - levels)
    return 0.125 + z * min(1.0, z)


def natural_dithering_omega(d: int, levels: int) -> float:
    """A bound on ``E||C(x) - x||^2 / ||x||^2`` for natural dithering in the 2-norm.

    ``d`` times the concave envelope below: a valid bound for every ``d``,
    the exact supremum where the envelope is attained with ``d`` entries
    (the first and last cases below), and otherwise a few percent above it at
    small ``d``: a brute-force search at ``d = 3`` finds 0.1795 against
    0.1875 (``s = 2``) and 0.1250 against 0.1277 (``s = 4``), tested.

    With ``y_i = |x_i| / ||x||`` (so ``sum_i y_i^2 = 1``) the variance is
    ``||x||^2 sum_i g(y_i^2)`` with ``g(y^2) = (hi - y)(y - lo)`` for ``y`` between
    the neighbouring levels ``lo < hi``.  As for QSGD, the supremum is ``d``
    times the concave envelope of ``g`` at ``1/d``.  In ``u = y^2``, with
    ``h = 2^(1-s)``, ``g`` is ``h sqrt(u) - u`` on the bottom interval, at most
    ``u/8`` on the middle ones (equality at ``y = (4/3) lo``) and
    ``1.5 sqrt(u) - u - 1/2`` on the top one ``[1/2, 1]``.  The envelope
    follows the bottom curve up to ``sqrt(u) = t1 = h / (9/4 - h^2)``, the
    common tangent of the bottom and top curves (slope ``1/8 - h^2/2``,
    intercept ``h^2 / (9/2 - 2 h^2)``, which lies above ``u/8`` on every middle
    interval) up to ``sqrt(u) = t2 = (3/2) / (9/4 - h^2)``, then the top curve:

    * ``d >= 1/t1^2``: ``omega = h sqrt(d) - 1``, attained at equal magnitudes;
    * ``1/t2^2 <= d < 1/t1^2``: ``omega = 1/8 - h^2/2 + d h^2 / (9/2 - 2 h^2)``,
      reached only when ``d`` entries can split between ``y = t2`` and
      ``y = t1`` in the tangent's proportion (e.g. ``s = 4, d = 32``: 2 and 30
      entries, within 1e-4), else above the supremum; the supremum is at
      least ``1/8``, reached by ``x = (2, 2, 1, 0, ...)``;
    * ``d < 1/t2^2`` (``d <= 2``): ``omega = 1.5 sqrt(d) - 1 - d/2``.

    ``s = 1`` (levels ``0, 1``) is QSGD with one level: ``sqrt(d) - 1``; ``s = 2``
    (levels ``0, 1/2, 1``) is QSGD with two: ``d/16`` for ``d < 16``.  Always
    below :func:`natural_dithering_paper_bound`.

    Args:
      d: the number of entries of the input.
      levels: the number of nonzero levels ``s`` of :func:`natural_dithering`.

    Returns:
      The bound ``omega`` (a float; 0 for ``d <= 0``), exact in the cases named above.
    """
    if d <= 0:
        return 0.0
    h = 2.0 ** (1 - levels)
    if levels == 1:
        return math.sqrt(d) - 1.0
    t1 = h / (2.25 - h * h)
    t2 = 1.5 / (2.25 - h * h)
    if d * t1 * t1 >= 1.0:
        return h * math.sqrt(d) - 1.0
    if d * t2 * t2 >= 1.0:
        return 0.125 - h * h / 2 + d * h * h / (4.5 - 2 * h * h)
    return 1.5 * math.sqrt(d) - 1.0 - d / 2


def p_norm(flat: jax.Array, p: float) -> jax.Array:
    """``||x||_p`` as ``m ||x / m||_p`` with ``m = max|x|`` (no overflow; 0 for zeros),
    saturated where it overflows (:func:`compjax.compressors.qsgd.saturated_norm`); for
    ``p = 2`` :func:`compjax.compressors.qsgd.l2_norm` (one pass where that is exact)."""
    if p == 2.0:
        return l2_norm(flat)
    m = jnp.max(jnp.abs(flat), initial=0.0)
    if math.isinf(p):
        return m
    safe_m = jnp.where(m > 0, m, 1.0)
    scaled = jnp.abs(flat / safe_m)
    total = jnp.sum(scaled) if p == 1.0 else jnp.sum(scaled**p) ** (1.0 / p)
    return saturated_norm(m * total, m)


def p_norm_of_pieces(pieces: Pieces, p: float) -> jax.Array:
    """:func:`p_norm` of the flat array in ``pieces`` (non-empty), reduced piece by piece,
    saturated where it overflows (:func:`compjax.compressors.qsgd.saturated_norm`)."""
    if p == 2.0:
        return norm_of_pieces(pieces)
    m = pieces.reduce(jnp.abs, "max")
    if math.isinf(p):
        return m
    safe_m = jnp.where(m > 0, m, 1.0)
    if p == 1.0:
        total = pieces.reduce(lambda a: jnp.abs(a / safe_m), "sum")
    else:
        total = pieces.reduce(lambda a: jnp.abs(a / safe_m) ** p, "sum") ** (1.0 / p)
    return saturated_norm(m * total, m)


def _level_value(code: jax.Array, levels: int) -> jax.Array:
    """Code ``j`` to its level: ``0`` for ``j = 0``, ``2^(j - s)`` for ``1 <= j <= s``."""
    return jnp.where(code > 0, pow2(code.astype(jnp.int32) - levels), 0.0)  # exact, from bits


@dataclasses.dataclass(frozen=True)
class NaturalDithering(packing.SignMagnitude, Elementwise, Compressor):
    """Natural dithering with ``levels`` nonzero levels.  See :func:`natural_dithering`."""

    levels: int = 8
    p: float = 2.0
    unbiased: ClassVar[bool] = True

    def grid(self, norm: jax.Array, code: jax.Array, dtype) -> jax.Array:
        """The magnitude ``code`` decodes to, ``norm * level(code)``, on ``dtype``'s grid."""
        return round_to(norm * _level_value(code, self.levels), dtype)

    def encode(self, key, flat, dtype):
        # A norm of finite entries beyond the float32 range saturates at its largest value
        # (finite; still unbiased: it brackets every entry); an Inf/NaN entry keeps it
        # non-finite, so the decode is too.
        stats = {"norm": p_norm(flat, self.p).reshape(1)}
        return {**stats, **self.encode_span(key, flat, 0, flat.shape[0], stats, dtype)}, {}

    def units(self, d, dtype):
        return {"codes": packing.codes_per_element(self.width)}

    def statistics(self, key, pieces, dtype):
        return {"norm": p_norm_of_pieces(pieces, self.p).reshape(1)}

    def encode_span(self, key, flat, offset, d, stats, dtype):
        s = self.levels
        norm = stats["norm"][0]
        # |x| by its bits: a jnp.abs here would be merged with the norm's and written out
        # whole for the norm's reduction (a full-size array, about a copy's time).
        mag = magnitude(flat)
        y = jnp.minimum(divide(mag, norm), 1.0)
        # y in [2^e, 2^(e+1)), e = floor(log2 y) from y's exponent bits (-127 if subnormal,
        # which is below every level): the level at or below y.
        estimate = jnp.where(y > 0, jnp.clip(exponent(y) + s, 0, s), 0)
        # Bracket |x_i| between neighbouring levels *as decoded* (on the input dtype's grid,
        # saturating), correcting float32's estimate by one level, so that E[decode] = x.
        at, above = self.grid(norm, estimate, dtype), self.grid(norm, estimate + 1, dtype)
        low = jnp.where(at > mag, estimate - 1, jnp.where(above < mag, estimate + 1, estimate))
        low = jnp.clip(low, 0, s)
        high = jnp.minimum(low + 1, s)
        v_low, v_high = self.grid(norm, low, dtype), self.grid(norm, high, dtype)
        # The chance of the upper level, in units of the norm's power of two (one scalar
        # scale for every entry, where a division per entry would scale each by its own).
        p = fraction_between(mag, v_low, v_high, unit_scale(norm)[0])
        up = bernoulli(key, p, offset, unit=True)
        level = jnp.where(up, high, low).astype(jnp.uint32)
        sign = (flat < 0).astype(jnp.uint32) << (self.width - 1)
        return {"codes": packing.pack(level | sign, self.width)}

    def decode_span(self, wire, side, offset, n, d, dtype):
        codes = packing.unpack(wire["codes"], self.width, n)
        level = _level_value(codes & ((1 << self.magnitude_bits) - 1), self.levels)
        negative = (codes >> (self.width - 1)) == 1
        value = wire["norm"][0] * level
        return jnp.where(negative, -value, value)

    def unbiased_range(self, d, dtype=jnp.float32):
        # As QSGD's: a saturated norm is still >= every |x_i|, which stays bracketed.
        return dtype_max(dtype)

    def omega(self, d):
        if self.p == 2.0:
            return natural_dithering_omega(d, self.levels)
        return natural_dithering_paper_bound(d, self.levels, self.p)

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), self.width) + 32


def natural_dithering(levels: int = 8, p: float = 2.0) -> NaturalDithering:
    """Natural dithering ``D_nat^{p,s}``: random dithering on power-of-two levels.

    Each entry becomes ``||x||_p sgn(x_i) xi_i`` with ``xi_i`` one of the
    levels ``1, 1/2, ..., 2^(1-s), 0`` (``s = levels``): the two levels around
    ``|x_i| / ||x||_p`` are chosen with the probabilities that make
    ``E xi_i = |x_i| / ||x||_p`` (unbiased).  Where QSGD spends its ``s``
    levels uniformly, natural dithering spaces them geometrically, so the same
    number of levels (the same bits) reaches ``2^(1-s)`` instead of ``1/s``.

    Wire format: one float32 norm, and per entry a sign-magnitude code (level
    index ``0..s`` in the low bits, sign in the top bit) packed at the smallest
    width in 2, 4, 8 bits that holds it: ``s = 1`` takes 2 bits, ``s <= 7``
    4 bits, ``s <= 64`` 8 bits.

    Theory: unbiased.  For ``p = 2``, ``omega(d)`` is
    :func:`natural_dithering_omega` (``h sqrt(d) - 1`` with ``h = 2^(1-s)`` for
    large ``d``, the exact supremum, about ``1/8 + d h^2 / 4.5`` below, a
    bound that can exceed the supremum by a few percent at small ``d``:
    0.1875 against 0.1795 at ``d = 3, s = 2``), under the paper's bound
    ``1/8 + d^(1/r) h min(1, d^(1/r) h)``, ``r = min(p, 2)``
    (:func:`natural_dithering_paper_bound`), which ``omega(d)`` is for other
    ``p``.

    Args:
      levels: number of nonzero levels ``s``, ``1 <= s <= 64``.
      p: the norm, ``p >= 1`` (``float('inf')`` for the max norm).

    Returns:
      A :class:`NaturalDithering` compressor whose payload holds ``"norm"``
      (float32 ``||x||_p``) and ``"codes"`` (the sign-magnitude codes packed
      into uint32 words); it decodes to ``norm sgn(x_i) xi_i``.

    Raises:
      ValueError: ``levels`` or ``p`` out of range.

    References:
      Horvath et al., "Natural Compression for Distributed Deep Learning",
      arXiv:1905.10988 (natural dithering, Section 4).
    """
    if not isinstance(levels, int) or not 1 <= levels <= _MAX_LEVELS:
        raise ValueError(f"levels must be an integer in [1, {_MAX_LEVELS}], got {levels!r}")
    if not isinstance(p, int | float) or not p >= 1:
        raise ValueError(f"p must be a number >= 1 (or inf), got {p!r}")
    return NaturalDithering(levels=levels, p=float(p))
