"""Natural compression: stochastic rounding to a power of two.

References:
  Horvath, Ho, Horvath, Sahu, Canini, Richtarik, "Natural Compression for
  Distributed Deep Learning", MSML 2022 (arXiv:1905.10988).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.compressor import Compressor, random_bits

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MAX_FINITE_EXPONENT = 254


@dataclasses.dataclass(frozen=True)
class Natural(Compressor):
    """Natural compression of float32 entries.  See :func:`natural`."""

    unbiased: ClassVar[bool] = True

    def encode(self, key, flat):
        word = jax.lax.bitcast_convert_type(flat, jnp.uint32)
        exponent = (word >> _MANTISSA_BITS) & 0xFF
        mantissa = word & _MANTISSA_MASK
        # Round up with probability mantissa / 2**23: compare with 23 random bits.
        draw = random_bits(key, flat.shape) >> (32 - _MANTISSA_BITS)
        up = (draw < mantissa).astype(jnp.uint32)
        finite = exponent < 255
        rounded = jnp.where(finite, jnp.minimum(exponent + up, _MAX_FINITE_EXPONENT), exponent)
        return {
            "exponents": rounded.astype(jnp.uint8),
            "signs": packing.pack(word >> 31, 1),
        }, {}

    def decode(self, wire, side, n, dtype):
        sign = packing.unpack(wire["signs"], 1, n) << 31
        word = sign | (wire["exponents"].astype(jnp.uint32) << _MANTISSA_BITS)
        return jax.lax.bitcast_convert_type(word, jnp.float32)

    def omega(self, d):
        return 1.0 / 8.0

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        return 8 * d + packing.packed_bits(d, 1)


def natural() -> Natural:
    """Natural compression: ``|t| in [2^a, 2^(a+1))`` becomes ``2^a`` or ``2^(a+1)``.

    It rounds up with probability ``(|t| - 2^a) / 2^a``, so it is unbiased, and
    sends 9 bits per entry: the 8-bit float32 exponent field (as uint8) and the
    sign bit (bit-packed 8 per byte).  On float32 bits this is "drop the
    mantissa, carrying into the exponent with probability mantissa / 2^23";
    decoding puts sign and exponent back with a zero mantissa.

    Exact powers of two (mantissa 0) are never changed, zero stays zero,
    subnormal inputs round to 0 or the smallest normal number ``2^-126``
    (still unbiased), values at or above ``2^127`` saturate at ``2^127`` (no
    Inf; biased there), and Inf/NaN inputs decode to Inf of the same sign.
    Float16/bfloat16 inputs are rounded in float32 and saturate at the
    input dtype's largest finite value on decoding.

    Theory: unbiased, per-entry variance ``(2^(a+1) - |t|)(|t| - 2^a)``,
    ``omega = 1/8`` for every ``d``, attained at ``|t| = (4/3) 2^a``.

    References:
      Horvath et al., "Natural Compression for Distributed Deep Learning",
      arXiv:1905.10988.
    """
    return Natural()
