"""One bit per entry: signSGD's sign and the scaled sign of EF-signSGD.

References:
  Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed
  Optimisation for Non-Convex Problems", ICML 2018.
  Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes", ICML 2019.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.compressor import Compressor
from compjax.numerics import ldexp, unit_scale


def sign_bits(x):
    """1 where ``x < 0`` else 0 (zero and +0 are sent as positive)."""
    return (x < 0).astype(jnp.uint32)


def mean_abs(flat: jax.Array) -> jax.Array:
    """``||x||_1 / d`` of a non-empty 1-D array, without overflow or underflow.

    One pass, ``sum |x| / d``, when that sum is finite (a sum of magnitudes
    loses nothing to underflow); otherwise (it overflowed, or ``x`` holds an
    Inf or NaN) ``2**e mean(|x 2**-e|)`` with ``2**e <= max|x| < 2**(e+1)``, an
    exact scaling (:func:`compjax.numerics.unit_scale`; dividing by ``max|x|``
    would flush to zero), two passes, capped at ``max|x|`` (which the mean
    never exceeds; the rounded mean of entries at float32's maximum would
    otherwise round up to ``2**128``, Inf).
    """
    total = jnp.sum(jnp.abs(flat))

    def scaled():
        top = jnp.max(jnp.abs(flat), initial=0.0)
        e, _ = unit_scale(top)
        # |x 2**-e| rather than |x| 2**-e (same values): no full-size |x| shared
        # by two reductions, which XLA would materialise.
        return jnp.minimum(ldexp(jnp.mean(jnp.abs(ldexp(flat, -e))), e), top)

    return jax.lax.cond(jnp.isfinite(total), lambda: total / flat.size, scaled)


def sign_values(bits):
    """Bits back to ``+1.0`` / ``-1.0``."""
    return 1.0 - 2.0 * bits.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Sign(Compressor):
    """``C(x) = sign(x)`` in one bit per entry.  See :func:`sign`."""

    deterministic: ClassVar[bool] = True

    def encode(self, key, flat, dtype):
        return {"signs": packing.pack(sign_bits(flat), 1)}, {}

    def decode(self, wire, side, n, dtype):
        return sign_values(packing.unpack(wire["signs"], 1, n))

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), 1)


@dataclasses.dataclass(frozen=True)
class ScaledSign(Compressor):
    """``C(x) = (||x||_1 / d) sign(x)``.  See :func:`scaled_sign`."""

    deterministic: ClassVar[bool] = True

    def encode(self, key, flat, dtype):
        if not flat.size:
            return {"scale": jnp.float32(0.0), "signs": packing.pack(sign_bits(flat), 1)}, {}
        return {"scale": mean_abs(flat), "signs": packing.pack(sign_bits(flat), 1)}, {}

    def decode(self, wire, side, n, dtype):
        return wire["scale"] * sign_values(packing.unpack(wire["signs"], 1, n))

    def delta(self, d):
        return 1.0 / d if d > 0 else 1.0

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), 1) + 32


def sign() -> Sign:
    """signSGD's compressor: ``C(x) = sign(x)``, one bit per entry.

    Wire format: signs bit-packed 8 per byte.  Zero entries are sent as
    ``+1`` (one bit has no room for a zero), so a zero input decodes to all
    ones; use :func:`scaled_sign` where zero must map to zero.

    Theory: biased and not contractive (``omega`` and ``delta`` are ``None``):
    the output has norm ``sqrt(d)`` whatever the input's.

    References:
      Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex
      Problems", ICML 2018.
    """
    return Sign()


def scaled_sign() -> ScaledSign:
    """EF-signSGD's compressor: ``C(x) = (||x||_1 / d) sign(x)``.

    Wire format: one float32 scale and signs bit-packed 8 per byte.

    Theory: biased and contractive, ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / d``
    exactly, so ``delta(x) = ||x||_1^2 / (d ||x||^2)`` and ``delta(d) = 1/d``
    (attained by 1-sparse ``x``).  A zero input gives zeros.

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019.
    """
    return ScaledSign()
