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
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.compressor import Compressor
from compjax.compressors.elementwise import Elementwise
from compjax.numerics import ldexp, unit_scale
from compjax.pieces import Pieces, encode_spans


def sign_bits(x):
    """1 where ``x < 0`` else 0 (zero and +0 are sent as positive)."""
    return (x < 0).astype(jnp.uint32)


def mean_abs(flat: jax.Array, total: jax.Array | None = None) -> jax.Array:
    """``||x||_1 / d`` of a non-empty 1-D array, without overflow or underflow.

    One pass, ``sum |x| / d``, when that sum is finite (a sum of magnitudes
    loses nothing to underflow); otherwise (it overflowed, or ``x`` holds an
    Inf or NaN) ``2**e mean(|x 2**-e|)`` with ``2**e <= max|x| < 2**(e+1)``, an
    exact scaling (:func:`compjax.numerics.unit_scale`; dividing by ``max|x|``
    would flush to zero), two passes, capped at ``max|x|`` (which the mean
    never exceeds; the rounded mean of entries at float32's maximum would
    otherwise round up to ``2**128``, Inf).  ``total``: ``sum |x|`` already
    taken (with the signs' packing, :func:`compjax.packing.pack_summing`).
    """
    if total is None:
        total = jnp.sum(jnp.abs(flat))

    def scaled():
        top = jnp.max(jnp.abs(flat), initial=0.0)
        e, _ = unit_scale(top)
        # |x 2**-e| rather than |x| 2**-e (same values): no full-size |x| shared
        # by two reductions, which XLA would materialise.
        return jnp.minimum(ldexp(jnp.mean(jnp.abs(ldexp(flat, -e))), e), top)

    return jax.lax.cond(jnp.isfinite(total), lambda: total / flat.size, scaled)


def mean_abs_of_pieces(pieces: Pieces, total: jax.Array | None = None) -> jax.Array:
    """:func:`mean_abs` of the flat array in ``pieces`` (non-empty), reduced piece by piece.

    ``sum |x| / d`` where that sum (``total`` if given) is finite; otherwise
    :func:`mean_abs`'s exactly scaled two passes, piece by piece.
    """
    if total is None:
        total = pieces.reduce(jnp.abs, "sum")

    def scaled():
        top = pieces.reduce(jnp.abs, "max")
        e, _ = unit_scale(top)
        mean = pieces.reduce(lambda a: jnp.abs(ldexp(a, -e)), "sum") / pieces.size
        return jnp.minimum(ldexp(mean, e), top)

    return jax.lax.cond(jnp.isfinite(total), lambda: total / pieces.size, scaled)


def sign_values(bits):
    """Bits back to ``+1.0`` / ``-1.0``."""
    return 1.0 - 2.0 * bits.astype(jnp.float32)


class SignCodes(Elementwise):
    """Signs packed 32 to a uint32 word, times a scale where the compressor has one.

    A scaled compressor's scale is a mean of per-entry terms (``|x|``,
    ``x^2``) that the signs do not depend on, so their sum is reduced in the
    pass that packs the signs (:func:`compjax.packing.pack_summing`), over the
    whole array or span by span over a bucket's pieces: the scale costs no
    second pass over the input.
    """

    def units(self, d, dtype):
        return {"signs": packing.codes_per_element(1)}

    def encode_span(self, key, x, offset, d, stats, dtype):
        return {"signs": packing.pack(sign_bits(x), 1)}

    def decode_span(self, wire, side, offset, n, d, dtype):
        values = sign_values(packing.unpack(wire["signs"], 1, n))
        return wire["scale"] * values if "scale" in wire else values

    #: A scaled compressor's ``(terms, scale, scale_of_pieces)``: the per-entry terms
    #: whose sum the scale is taken from, and the scale of a flat array and of pieces
    #: from that sum (``f(x, total)``); ``None`` for the unscaled sign.
    scaling: ClassVar[tuple[Callable, Callable, Callable] | None] = None

    def _signs_summing(self, x):
        signs, total = packing.pack_summing(sign_bits(x), 1, self.scaling[0](x))
        return {"signs": signs, "_total": total.reshape(1)}

    def encode(self, key, flat, dtype):
        if self.scaling is None:
            return self.encode_span(key, flat, 0, flat.shape[0], {}, dtype), {}
        if not flat.size:
            return {"scale": jnp.float32(0.0), **self.encode_span(key, flat, 0, 0, {}, dtype)}, {}
        fields = self._signs_summing(flat)
        return {"scale": self.scaling[1](flat, fields.pop("_total")[0]), **fields}, {}

    def encode_pieces(self, key, pieces, dtype):
        if self.scaling is None:
            return Elementwise.encode_pieces(self, key, pieces, dtype)
        unit = packing.codes_per_element(1)
        fields = encode_spans(pieces, unit, lambda x, offset: self._signs_summing(x))
        total = jnp.sum(fields.pop("_total"))  # the spans' sums, in order
        return {"scale": self.scaling[2](pieces, total), **fields}, {}


@dataclasses.dataclass(frozen=True)
class Sign(SignCodes, Compressor):
    """``C(x) = sign(x)`` in one bit per entry.  See :func:`sign`."""

    deterministic: ClassVar[bool] = True

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), 1)


@dataclasses.dataclass(frozen=True)
class ScaledSign(SignCodes, Compressor):
    """``C(x) = (||x||_1 / d) sign(x)``.  See :func:`scaled_sign`."""

    deterministic: ClassVar[bool] = True

    scaling: ClassVar = (jnp.abs, mean_abs, mean_abs_of_pieces)

    def delta(self, d):
        return 1.0 / d if d > 0 else 1.0

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), 1) + 32


def sign() -> Sign:
    """signSGD's compressor: ``C(x) = sign(x)``, one bit per entry.

    Wire format: signs bit-packed 32 to a uint32 word.  Zero entries are sent as
    ``+1`` (one bit has no room for a zero), so a zero input decodes to all
    ones; use :func:`scaled_sign` where zero must map to zero.

    Theory: biased and not contractive (``omega`` and ``delta`` are ``None``):
    the output has norm ``sqrt(d)`` whatever the input's.

    Args:
      none: the compressor has no parameters.

    Returns:
      A :class:`Sign` compressor whose payload holds ``"signs"``, packed 32 to
      a uint32 word; it decodes to ``+1`` and ``-1``.

    References:
      Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex
      Problems", ICML 2018.
    """
    return Sign()


def scaled_sign() -> ScaledSign:
    """EF-signSGD's compressor: ``C(x) = (||x||_1 / d) sign(x)``.

    Wire format: one float32 scale and signs bit-packed 32 to a uint32 word.

    Theory: biased and contractive, ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / d``
    exactly, so ``delta(x) = ||x||_1^2 / (d ||x||^2)`` and ``delta(d) = 1/d``
    (attained by 1-sparse ``x``).  A zero input gives zeros.

    Args:
      none: the compressor has no parameters.

    Returns:
      A :class:`ScaledSign` compressor whose payload holds ``"scale"`` (float32
      ``||x||_1 / d``) and ``"signs"`` (packed 32 to a uint32 word); it decodes
      to ``scale sign(x)``.

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019.
    """
    return ScaledSign()
