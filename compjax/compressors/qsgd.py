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

from compjax import packing
from compjax.compressor import (
    Compressor,
    bernoulli,
    safe_divide,
    safe_norm,
)


def qsgd_omega(d: int, levels: int) -> float:
    """The supremum of ``E||Q(x) - x||^2 / ||x||^2`` over ``x`` with ``d`` entries.

    The variance is ``(||x||^2 / s^2) sum_i p_i (1 - p_i)`` with ``p_i`` the
    fractional part of ``y_i = s |x_i| / ||x||`` and ``sum_i y_i^2 = s^2``.
    Maximising ``sum_i f(y_i^2)`` with ``f(u) = frac(sqrt u)(1 - frac(sqrt u))``
    under that budget gives ``d`` times the concave envelope of ``f`` at
    ``s^2 / d``: ``sqrt(u) - u`` for ``u <= 1/4``, and ``1/4`` beyond.  Hence

    * ``d >= 4 s^2``: ``omega = sqrt(d)/s - 1``, attained at equal magnitudes;
    * ``d <  4 s^2``: ``omega <= d / (4 s^2)``, attained when every ``p_i = 1/2``
      (e.g. ``d = 64, s = 4``, all-ones ``x``: ``omega = 1``).

    Both are below Lemma 3.1's ``min(d/s^2, sqrt(d)/s)``.
    """
    if d <= 0:
        return 0.0
    if d >= 4 * levels * levels:
        return math.sqrt(d) / levels - 1.0
    return d / (4.0 * levels * levels)


def _with_sign(value: jax.Array, sign: jax.Array) -> jax.Array:
    """``value`` with its float32 sign bit xor-ed with ``sign`` (``0`` or ``1 << 31``)."""
    bits = jax.lax.bitcast_convert_type(value, jnp.uint32) ^ sign
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@dataclasses.dataclass(frozen=True)
class QSGD(Compressor):
    """QSGD with ``levels`` levels, one norm per bucket.  See :func:`qsgd`."""

    levels: int = 4
    bucket_size: int | None = None
    unbiased: ClassVar[bool] = True

    @property
    def magnitude_bits(self) -> int:
        return int(self.levels).bit_length()

    @property
    def width(self) -> int:
        """Packed width of one sign-magnitude code (sign in the top bit)."""
        return packing.code_width((1 << (self.magnitude_bits + 1)) - 1)

    def _buckets(self, d: int) -> tuple[int, int]:
        size = max(self.bucket_size or d, 1)
        return size, -(-d // size)

    def encode(self, key, flat):
        d = flat.shape[0]
        size, count = self._buckets(d)
        xb = jnp.pad(flat, (0, count * size - d)).reshape(count, size)
        norms = safe_norm(xb, axis=1)
        ratio = jnp.minimum(jnp.abs(safe_divide(xb, norms[:, None])), 1.0)
        scaled = self.levels * ratio
        low = jnp.floor(scaled)
        up = bernoulli(key, scaled - low)
        level = jnp.minimum(low + up, self.levels).astype(jnp.uint32)
        sign = (xb < 0).astype(jnp.uint32) << (self.width - 1)
        codes = (level | sign).reshape(-1)[:d]
        return {"norms": norms, "codes": packing.pack(codes, self.width)}, {}

    def decode(self, wire, side, n, dtype):
        size, count = self._buckets(n)
        codes = packing.unpack(wire["codes"], self.width, n)
        level = (codes & ((1 << self.magnitude_bits) - 1)).astype(jnp.float32)
        # The sign bit moved to float32's sign: exactly ``where(negative, -value, value)``
        # (negation flips the sign bit), which XLA's CPU loops run several times slower.
        sign = (codes >> (self.width - 1)) << 31
        if count == 1:  # one norm: a scalar keeps the loop flat
            return _with_sign(wire["norms"][0] * (level / self.levels), sign)
        level = jnp.pad(level, (0, count * size - n)).reshape(count, size)
        value = (wire["norms"][:, None] * (level / self.levels)).reshape(-1)[:n]
        return _with_sign(value, sign)

    @property
    def flat_barrier(self) -> bool:
        return self.bucket_size is None  # buckets are rows of their own

    def omega(self, d):
        size, _ = self._buckets(d)
        return qsgd_omega(min(d, size), self.levels)

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

    Theory: unbiased, ``omega(d)`` = the exact supremum :func:`qsgd_omega`
    (``sqrt(d)/s - 1`` for ``d >= 4 s^2``, else ``d / (4 s^2)``), tighter than
    Lemma 3.1's ``min(d/s^2, sqrt(d)/s)``.

    Args:
      levels: number of quantisation levels ``s >= 1``.
      bucket_size: entries per norm, ``>= 1``, or ``None`` for one norm.

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
