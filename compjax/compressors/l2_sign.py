"""The sign scaled to keep the input's Euclidean norm: 1-bit Adam's compressor.

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021 (arXiv:2102.02888), Section 4.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.compressor import Compressor
from compjax.compressors.sign import SignCodes
from compjax.numerics import ldexp, unit_scale
from compjax.pieces import Pieces


def rms(flat: jax.Array) -> jax.Array:
    """``||x||_2 / sqrt(d)`` of a non-empty 1-D array, finite for every finite ``x``.

    Computed as ``2**e (||x 2**-e|| / sqrt(d))`` with ``2**e <= max|x| <
    2**(e+1)`` (an exact scaling, :func:`compjax.numerics.unit_scale`) and
    capped at ``max|x|``, which it never exceeds: ``||x||_2`` itself overflows
    for 13 entries of ``1e38`` although their root mean square is ``1e38``.
    """
    top = jnp.max(jnp.abs(flat), initial=0.0)
    e, _ = unit_scale(top)
    unit = jnp.sqrt(jnp.sum(jnp.square(ldexp(flat, -e)))) / math.sqrt(flat.shape[0])
    return jnp.minimum(ldexp(unit, e), top)


def rms_of_pieces(pieces: Pieces) -> jax.Array:
    """:func:`rms` of the flat array in ``pieces`` (non-empty), reduced piece by piece."""
    top = pieces.reduce(jnp.abs, "max")
    e, _ = unit_scale(top)
    total = pieces.reduce(lambda a: jnp.square(ldexp(a, -e)), "sum")
    unit = jnp.sqrt(total) / math.sqrt(pieces.size)
    return jnp.minimum(ldexp(unit, e), top)


@dataclasses.dataclass(frozen=True)
class L2ScaledSign(SignCodes, Compressor):
    """``C(x) = (||x||_2 / sqrt(d)) sign(x)``.  See :func:`l2_scaled_sign`."""

    deterministic: ClassVar[bool] = True
    scaled: ClassVar[bool] = True

    def scale_of(self, flat):
        return rms(flat) if flat.size else jnp.float32(0.0)

    def scale_of_pieces(self, pieces):
        return rms_of_pieces(pieces)

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), 1) + 32


def l2_scaled_sign() -> L2ScaledSign:
    """1-bit Adam's compressor: ``C(x) = (||x||_2 / sqrt(d)) sign(x)``.

    The scale makes ``||C(x)||_2 = ||x||_2`` (the paper's "magnitude of the
    compensated momentum over the magnitude of the quantized one"; DeepSpeed's
    compressed all-reduce uses the same ``||x||_2 / sqrt(d)``).  Zero entries
    are sent as ``+1`` like :func:`compjax.sign`; a zero input has scale 0 and
    decodes to zeros.

    Wire format: one float32 scale and the signs bit-packed 8 per byte.

    Theory: biased and *not* contractive (``delta`` is ``None``):
    ``||C(x) - x||^2 = 2 ||x||_2 (||x||_2 - ||x||_1 / sqrt(d))``, which
    exceeds ``||x||^2`` for sparse ``x`` (about ``2 ||x||^2`` for a 1-sparse
    one).  :func:`compjax.scaled_sign` (scale ``||x||_1 / d``, the projection
    onto ``sign(x)``) is the contractive choice; both work with error
    feedback on the dense momenta of 1-bit Adam.

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
      with Adam's Convergence Speed", ICML 2021.
    """
    return L2ScaledSign()
