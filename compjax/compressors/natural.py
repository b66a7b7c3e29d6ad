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
import numpy as np

from compjax import packing
from compjax.compressor import Compressor, dtype_max
from compjax.compressors.elementwise import Elementwise
from compjax.draws import random_bits

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MAX_FINITE_EXPONENT = 254
# float16's top binade [2^15, 65504]: 2^16 decodes to 65504 (saturated).
_F16_TOP_EXPONENT = 127 + 15
#: The 8-bit exponent fields in one uint32 word of the wire.
_EXPONENTS_PER_WORD = 4


def round_up_threshold(exponent: jax.Array, mantissa: jax.Array, dtype) -> jax.Array:
    """``2**23 P(round up)`` of an entry with these float32 exponent and mantissa fields.

    ``mantissa`` (so ``P = (|t| - 2^a) / 2^a``), except in float16's top
    binade, where rounding up decodes to 65504 rather than ``2^16``: there
    ``P = (|t| - 2^15) / (65504 - 2^15) = k / 1023`` with ``k = mantissa >> 13``
    (a float16 mantissa), as ``floor(k 2^23 / 1023) = 8200 k + floor(8 k / 1023)``.
    """
    if np.dtype(dtype) != np.dtype(jnp.float16):
        return mantissa
    k = mantissa >> 13
    top = k * 8200 + (8 * k) // 1023
    return jnp.where(exponent == _F16_TOP_EXPONENT, top, mantissa)


@dataclasses.dataclass(frozen=True)
class Natural(Elementwise, Compressor):
    """Natural compression of float32 entries.  See :func:`natural`."""

    unbiased: ClassVar[bool] = True
    #: ``max |decode| / max |x|``: ``|t|`` decodes to at most ``2^(a+1) <= 2|t|``.
    decode_growth: ClassVar[float] = 2.0

    def units(self, d, dtype):
        return {"exponents": _EXPONENTS_PER_WORD, "signs": packing.WORD}

    def encode(self, key, flat, dtype):
        return self.encode_span(key, flat, 0, flat.shape[0], {}, dtype), {}

    def encode_span(self, key, flat, offset, d, stats, dtype):
        word = jax.lax.bitcast_convert_type(flat, jnp.uint32)
        exponent = (word >> _MANTISSA_BITS) & 0xFF
        mantissa = word & _MANTISSA_MASK
        # Round up with probability threshold / 2**23: compare with 23 random bits.
        draw = random_bits(key, flat.shape, offset) >> (32 - _MANTISSA_BITS)
        up = (draw < round_up_threshold(exponent, mantissa, dtype)).astype(jnp.uint32)
        finite = exponent < 255
        rounded = jnp.where(finite, jnp.minimum(exponent + up, _MAX_FINITE_EXPONENT), exponent)
        exponents, signs = packing.pack_fields_pair(rounded, 8, word >> 31, 1)
        return {"exponents": exponents, "signs": signs}

    def decode_span(self, wire, side, offset, n, d, dtype):
        sign = packing.unpack_fields(wire["signs"], 1, packing.WORD, n) << 31
        exponent = packing.unpack_fields(wire["exponents"], 8, _EXPONENTS_PER_WORD, n)
        return jax.lax.bitcast_convert_type(sign | (exponent << _MANTISSA_BITS), jnp.float32)

    def omega(self, d):
        return 1.0 / 8.0

    def unbiased_range(self, d, dtype=jnp.float32):
        """``2^127`` (float32, bfloat16: larger values saturate there), 65504 (float16)."""
        if np.dtype(dtype) == np.dtype(jnp.float16):
            return dtype_max(dtype)
        return 2.0**127

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        return packing.WORD * (-(-d // _EXPONENTS_PER_WORD) + -(-d // packing.WORD))


def natural() -> Natural:
    """Natural compression: ``|t| in [2^a, 2^(a+1))`` becomes ``2^a`` or ``2^(a+1)``.

    It rounds up with probability ``(|t| - 2^a) / 2^a``, so it is unbiased, and
    sends 9 bits per entry: the 8-bit float32 exponent field, 4 to a uint32
    word, and the sign bit, 32 to a word (:func:`compjax.packing.pack_fields`:
    entry ``i`` in word ``i // 4``, bits ``8 (i % 4) ..``, and word ``i // 32``,
    bit ``i % 32``; both packed in one pass, :func:`compjax.packing.pack_fields_pair`).
    On float32 bits this is "drop the mantissa, carrying into the exponent
    with probability mantissa / 2^23"; decoding puts sign and exponent back
    with a zero mantissa.

    Exact powers of two (mantissa 0) are never changed, zero stays zero,
    subnormal inputs round to 0 or the smallest normal number ``2^-126``
    (still unbiased), values at or above ``2^127`` saturate at ``2^127`` (no
    Inf; biased there), and Inf/NaN inputs decode to Inf of the same sign.
    Float16/bfloat16 inputs are rounded in float32; every power of two they
    can round to is exact in their dtype, except ``2^16`` for float16, which
    decodes to float16's largest value 65504: entries in ``[2^15, 65504]``
    round up with probability ``(|t| - 2^15) / (65504 - 2^15)`` instead, so
    float16 stays unbiased (65504 itself is kept).

    Theory: unbiased, per-entry variance ``(2^(a+1) - |t|)(|t| - 2^a)``,
    ``omega = 1/8`` for every ``d``, attained at ``|t| = (4/3) 2^a``.

    Range of unbiasedness (``unbiased_range``): ``|x_i| <= 2^127`` in
    float32 and bfloat16 (an entry in ``(2^127, max]`` would need ``2^128``,
    beyond the dtype, and decodes to ``2^127``: 3e38 always gives 1.7e38);
    every finite float16 input.  A concrete input beyond it warns
    (``UnbiasedRangeWarning``); inputs under ``jit`` are not checked.

    Args:
      none: the compressor has no parameters.

    Returns:
      A :class:`Natural` compressor whose payload holds ``"exponents"`` (the
      8-bit exponent fields, 4 to a uint32 word) and ``"signs"`` (32 to a
      word); it decodes to ``sign * 2**a`` with the chosen power ``a``.

    References:
      Horvath et al., "Natural Compression for Distributed Deep Learning",
      arXiv:1905.10988.
    """
    return Natural()
