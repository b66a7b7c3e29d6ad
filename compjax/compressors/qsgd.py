"""QSGD: stochastic rounding of ``|x_i| / ||x||`` to ``s`` uniform levels.

References:
  Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD
  via Gradient Quantization and Encoding", NeurIPS 2017 (Lemma 3.1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from compjax import packing
from compjax.compressor import Compressor, dtype_max, safe_norm, squares_safe
from compjax.compressors.elementwise import Elementwise
from compjax.draws import bernoulli
from compjax.numerics import fraction_between, ldexp, magnitude, round_to, unit_scale
from compjax.pieces import Pieces

#: Most levels held as float32 integers in :meth:`QSGD.bracket` (every integer up to
#: ``2**24`` is exact in float32).
_FLOAT_LEVELS = 2**24


def qsgd_omega(d: int, levels: int) -> float:
    """A bound on ``E||Q(x) - x||^2 / ||x||^2`` for ``d`` entries (exact where attained).

    The variance is ``(||x||^2 / s^2) sum_i p_i (1 - p_i)`` with ``p_i`` the
    fractional part of ``y_i = s |x_i| / ||x||`` and ``sum_i y_i^2 = s^2``.
    Maximising ``sum_i f(y_i^2)`` with ``f(u) = frac(sqrt u)(1 - frac(sqrt u))``
    under that budget gives ``d`` times the concave envelope of ``f`` at
    ``s^2 / d``: ``sqrt(u) - u`` for ``u <= 1/4``, and ``1/4`` beyond.  Hence

    * ``d >= 4 s^2``: ``omega = sqrt(d)/s - 1``, attained at equal magnitudes;
    * ``d <  4 s^2``: ``omega <= d / (4 s^2)``, attained when every ``p_i = 1/2``
      (e.g. ``d = 64, s = 4``, all-ones ``x``: ``omega = 1``).  Where no unit
      vector has every ``p_i = 1/2`` the bound is not attained: at ``d = 3``
      the brute-force supremum is 0.1795 against 0.1875 (``s = 2``) and
      0.0463 against 0.0469 (``s = 4``), tested.

    Both are below Lemma 3.1's ``min(d/s^2, sqrt(d)/s)``.

    Args:
      d: the number of entries of the input (of a bucket, with buckets).
      levels: the number of levels ``s`` of :func:`qsgd`.

    Returns:
      The bound ``omega`` (a float; 0 for ``d <= 0``), exact where attained.
    """
    if d <= 0:
        return 0.0
    if d >= 4 * levels * levels:
        return math.sqrt(d) / levels - 1.0
    return d / (4.0 * levels * levels)


def saturated_norm(norm: jax.Array, top: jax.Array) -> jax.Array:
    """``norm``, or float32's largest value where it overflowed although ``max|x| = top`` is
    finite (still unbiased: it brackets every entry); an Inf/NaN entry keeps it non-finite."""
    overflow = jnp.isinf(norm) & jnp.isfinite(top)
    return jnp.where(overflow, np.finfo(np.float32).max, norm)


def l2_norm(flat: jax.Array) -> jax.Array:
    """:func:`compjax.compressor.safe_norm` of a 1-D array, saturated as :func:`saturated_norm`.

    One pass, ``sqrt(sum x^2)``, where that sum is safe
    (:func:`compjax.compressor.squares_safe`: finite and not so small that
    flushed squares matter); otherwise, under a ``lax.cond``, the exactly
    scaled two passes (``max|x|``, then the scaled squares).  The one pass
    is the same value bit for bit where no square is subnormal.
    """
    total = jnp.sum(jnp.square(flat))

    def exact():
        return saturated_norm(safe_norm(flat), jnp.max(jnp.abs(flat), initial=0.0))

    return jax.lax.cond(squares_safe(total, flat.shape[0]), lambda: jnp.sqrt(total), exact)


def norm_of_pieces(pieces: Pieces) -> jax.Array:
    """:func:`l2_norm` of the flat array in ``pieces``, reduced piece by piece (the one pass
    where its sum of squares is safe, else the exactly scaled two passes)."""
    total = pieces.reduce(jnp.square, "sum")

    def exact():
        top = pieces.reduce(jnp.abs, "max")
        e, _ = unit_scale(top)
        norm = ldexp(jnp.sqrt(pieces.reduce(lambda a: jnp.square(ldexp(a, -e)), "sum")), e)
        return saturated_norm(norm, top)

    return jax.lax.cond(squares_safe(total, pieces.size), lambda: jnp.sqrt(total), exact)


def _with_sign(value: jax.Array, sign: jax.Array) -> jax.Array:
    """``value`` with its float32 sign bit xor-ed with ``sign`` (``0`` or ``1 << 31``)."""
    bits = jax.lax.bitcast_convert_type(value, jnp.uint32) ^ sign
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@dataclasses.dataclass(frozen=True)
class QSGD(packing.SignMagnitude, Elementwise, Compressor):
    """QSGD with ``levels`` levels, one norm per bucket.  See :func:`qsgd`."""

    levels: int = 4
    bucket_size: int | None = None
    unbiased: ClassVar[bool] = True

    def _buckets(self, d: int) -> tuple[int, int]:
        size = max(self.bucket_size or d, 1)
        return size, -(-d // size)

    def grid(self, norm: jax.Array, level: jax.Array, dtype) -> jax.Array:
        """The magnitude that ``level`` decodes to: ``norm * level / s`` on ``dtype``'s grid.

        Computed as ``norm * (level * fl(1/s))`` (``norm`` itself at
        ``level >= s``), the same float32 operations in :meth:`encode` and
        :meth:`decode`, then rounded as :meth:`finish` rounds.  Non-decreasing
        in ``level`` (integer, or float32 holding an integer).
        """
        level = jnp.asarray(level)
        top = level >= self.levels
        frac = jnp.where(top, 1.0, level.astype(jnp.float32) * np.float32(1.0 / self.levels))
        return round_to(norm * frac, dtype)

    def bracket(self, mag: jax.Array, norm: jax.Array, dtype):
        """``(lo, hi, p)``: levels around magnitudes ``mag <= norm`` and the chance of ``hi``.

        With ``V(l) = grid(norm, l)``, pick ``lo`` with ``V(lo) <= mag <= V(hi)``,
        ``hi = lo + 1``, and send ``hi`` with probability
        ``(mag - V(lo)) / (V(hi) - V(lo))``, so that ``E[V(level)] = mag``
        exactly on the output dtype's grid (an entry on the grid decodes to
        itself).  ``lo`` is the float32 estimate ``floor(s mag / norm)``, taken
        a hair high so that it is at most one level above the answer and
        corrected by one; should float32 not resolve the levels (``s`` above
        about ``2**19``) the bracket widens to level 0 or ``s``, still unbiased.

        The levels are float32 (exact integers) for ``s <= 2**24`` and int32
        beyond: a conversion between the two costs more per entry than the
        rest of the arithmetic, and the float32 ones need none until the
        codes are packed.  The same ``(lo, hi, p)`` either way.
        """
        s = self.levels
        e, unit = unit_scale(norm)  # scale by 2**-e: no flushed reciprocal of norm
        y = ldexp(mag, -e)
        inv = s * (1.0 + 2.0**-20) / jnp.where(norm > 0, unit, 1.0)
        # y >= 0 (or NaN), so the floor needs no clip from below; nor does lo, as V(0) = 0
        # is never above a magnitude.
        estimate = jnp.minimum(jnp.floor(y * inv), s)
        if s > _FLOAT_LEVELS:
            estimate = estimate.astype(jnp.int32)
        below, at, above = (self.grid(norm, estimate + i, dtype) for i in (-1, 0, 1))
        high = at > mag
        lo = jnp.where(high, estimate - 1, estimate)
        hi = jnp.minimum(lo + 1, s)
        v_lo, v_hi = jnp.where(high, below, at), jnp.where(high, at, above)
        # Outside the float32 estimate's reach: bracket with level 0 or s.
        lo, v_lo = jnp.where(v_lo > mag, 0, lo), jnp.where(v_lo > mag, 0.0, v_lo)
        top = self.grid(norm, s, dtype)
        hi, v_hi = jnp.where(v_hi < mag, s, hi), jnp.where(v_hi < mag, top, v_hi)
        # Scaled before the levels are subtracted: neighbouring levels of a norm below
        # s * 2**-126 lie closer than float32's smallest normal.
        return lo, hi, fraction_between(mag, v_lo, v_hi, e)

    def quantize(self, key, mag: jax.Array, norm: jax.Array, dtype, offset: int = 0):
        """Levels for magnitudes ``mag <= norm`` (float32 integers; int32 beyond ``2**24``
        levels), unbiased on the decoded grid
        (:meth:`bracket`); ``offset`` as in :func:`compjax.draws.random_bits`."""
        lo, hi, p = self.bracket(mag, norm, dtype)
        return jnp.where(bernoulli(key, p, offset, unit=True), hi, lo)

    @staticmethod
    def _rows(x: jax.Array, size: int) -> jax.Array:
        """``x`` zero-padded to whole rows of ``size`` entries: ``(rows, size)``."""
        rows = -(-x.shape[0] // size)
        return jnp.pad(x, (0, rows * size - x.shape[0])).reshape(rows, size)

    def _codes(self, key, xb, norms, offset, n, dtype) -> dict:
        """Packed codes of the first ``n`` entries of the rows ``xb`` (entries ``offset ..``)."""
        level = self.quantize(key, magnitude(xb), norms[:, None], dtype, offset)
        sign = (xb < 0).astype(jnp.uint32) << (self.width - 1)
        codes = (level.astype(jnp.uint32) | sign).reshape(-1)[:n]
        return {"codes": packing.pack(codes, self.width)}

    def encode(self, key, flat, dtype):
        d = flat.shape[0]
        size, count = self._buckets(d)
        if count == 1 and d:  # one norm, in one pass where that is exact
            norms = l2_norm(flat).reshape(1)
            return {"norms": norms, **self._codes(key, flat[None], norms, 0, d, dtype)}, {}
        xb = self._rows(flat, size)
        # A norm of finite entries beyond the float32 range saturates at its largest value.
        # (max|x|: the reduction safe_norm already makes, shared by XLA, no second pass.)
        norms = saturated_norm(safe_norm(xb, axis=1), jnp.max(jnp.abs(xb), axis=1, initial=0.0))
        return {"norms": norms, **self._codes(key, xb, norms, 0, d, dtype)}, {}

    # -- in pieces (compjax.compressors.elementwise): one norm, or the rows' norms per span --
    def units(self, d, dtype):
        size, count = self._buckets(d)
        codes = packing.codes_per_element(self.width)
        return {"norms": size, "codes": codes} if count > 1 else {"codes": codes}

    def statistics(self, key, pieces, dtype):
        if self._buckets(pieces.size)[1] > 1:
            return {}  # norms per row, computed with each span's rows
        return {"norms": norm_of_pieces(pieces).reshape(1)}

    def encode_span(self, key, x, offset, d, stats, dtype):
        if "norms" in stats:
            return self._codes(key, x.reshape(1, -1), stats["norms"], offset, x.shape[0], dtype)
        xb = self._rows(x, self._buckets(d)[0])
        norms = saturated_norm(safe_norm(xb, axis=1), jnp.max(jnp.abs(xb), axis=1, initial=0.0))
        return {"norms": norms, **self._codes(key, xb, norms, offset, x.shape[0], dtype)}

    def decode_span(self, wire, side, offset, n, d, dtype):
        size, count = self._buckets(d)
        if count > 1 and self.width < 8 and n % size == 0 and size * self.width % 32 == 0:
            # Whole rows of whole packed words: codes and norms in one (rows, words, codes) shape.
            codes = packing.unpack_rows(wire["codes"], self.width, n // size)
            return self._value(codes, wire["norms"][:, None, None]).reshape(-1)
        codes = packing.unpack(wire["codes"], self.width, n)
        if count == 1:  # one norm: a scalar keeps the loop flat
            return self._value(codes, wire["norms"][0])
        rows = self._rows(codes, size)  # the last row padded with zeros, decoded to 0
        return self._value(rows, wire["norms"][:, None]).reshape(-1)[:n]

    def _value(self, codes: jax.Array, norm: jax.Array) -> jax.Array:
        """The float32 values of sign-magnitude ``codes`` (any shape) for ``norm``."""
        level = codes & ((1 << self.magnitude_bits) - 1)
        # The sign bit moved to float32's sign: exactly ``where(negative, -value, value)``
        # (negation flips the sign bit), which XLA's CPU loops run several times slower.
        sign = (codes >> (self.width - 1)) << 31
        return _with_sign(self.grid(norm, level, jnp.float32), sign)

    def flat_barrier(self, shape):
        if self.bucket_size is None:
            return True
        # Rows of its own buckets: a row view XLA indexes cheaply where the innermost
        # dimension beyond 1 is a multiple or a divisor of the row; otherwise (3 x 3 conv
        # kernels) the copy behind the barrier is cheaper (make bench's ResNet-50 tree).
        inner = next((n for n in reversed(shape) if n > 1), 1)
        size = self._buckets(math.prod(shape))[0]
        return bool(inner % size and size % inner)

    def omega(self, d):
        size, _ = self._buckets(d)
        return qsgd_omega(min(d, size), self.levels)

    def unbiased_range(self, d, dtype=jnp.float32):
        # Every finite input: a norm beyond float32 saturates at its largest value, still
        # >= every |x_i|, and each entry is bracketed between levels of that grid.
        return dtype_max(dtype)

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        _, count = self._buckets(d)
        return packing.packed_bits(d, self.width) + 32 * count


def qsgd(levels: int, bucket_size: int | None = None) -> QSGD:
    """QSGD quantisation with ``levels`` levels (``s`` in the paper).

    Each entry becomes ``||x|| sgn(x_i) xi_i`` with ``xi_i`` one of the levels
    ``0, 1/s, ..., 1``, rounded stochastically so that ``E xi_i = |x_i|/||x||``.
    With ``bucket_size`` the norm is taken per bucket of that many consecutive
    entries (the paper's bucketing), else over the whole array.

    Wire format: one float32 norm per bucket, and per entry a sign-magnitude
    code (level in the low bits, sign in the top bit) packed at the smallest
    width in 2, 4, 8, 16, 32 bits that holds it: ``s = 1`` takes 2 bits,
    ``s <= 7`` 4 bits, ``s <= 127`` 8 bits.

    Theory: unbiased, ``omega(d)`` = :func:`qsgd_omega` (``sqrt(d)/s - 1`` for
    ``d >= 4 s^2``, the exact supremum, else ``d / (4 s^2)``, a bound that is
    exact when some unit vector has every ``p_i = 1/2`` and a few percent
    above the supremum otherwise, e.g. 4% at ``d = 3, s = 2``), tighter than
    Lemma 3.1's ``min(d/s^2, sqrt(d)/s)``.

    Numerics: the levels decode to ``norm * level / s`` computed in float32
    and rounded to the input dtype (:meth:`QSGD.grid`); each entry is rounded
    stochastically between the two neighbouring decoded values, so the
    compressor is unbiased on that grid in float32, bfloat16 and float16
    alike (a float16 norm beyond 65504 saturates, and the levels above 65504
    merge there: still unbiased), and an entry on the grid decodes to itself.
    In bfloat16/float16 each decoded level is within a relative half-ulp
    ``eps`` (``2^-8``, ``2^-11``) of ``norm l / s`` (for levels in the dtype's
    normal range), which adds at most ``eps |x_i| norm / s + eps^2 |x_i|
    (|x_i| + norm / s)`` to an entry's variance: ``E||Q(x) - x||^2 <=
    (omega(d) + eps (1 + eps) sqrt(d) / s + eps^2) ||x||^2``, not ``omega(d)``.

    Args:
      levels: number of quantisation levels ``s >= 1``.
      bucket_size: entries per norm, ``>= 1``, or ``None`` for one norm.

    Returns:
      A :class:`QSGD` compressor whose payload holds ``"norms"`` (one float32
      norm per bucket) and ``"codes"`` (the sign-magnitude codes packed into
      uint32 words); it decodes to ``norm sgn(x_i) xi_i``.

    Raises:
      ValueError: ``levels`` or ``bucket_size`` out of range.

    References:
      Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
      Quantization and Encoding", NeurIPS 2017.
    """
    if not isinstance(levels, int) or not 1 <= levels < 2**30:
        raise ValueError(f"levels must be an integer in [1, 2**30), got {levels!r}")
    if bucket_size is not None and (not isinstance(bucket_size, int) or bucket_size < 1):
        raise ValueError(f"bucket_size must be a positive integer or None, got {bucket_size!r}")
    return QSGD(levels=levels, bucket_size=bucket_size)
