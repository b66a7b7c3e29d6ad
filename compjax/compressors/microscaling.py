"""Microscaling (MX) formats: narrow floats with one power-of-two scale per block.

A plain cast to a 4- or 8-bit float keeps only the entries inside that type's
narrow range: gradients and DiLoCo's pseudo-gradients (entries of 1e-3 and
below) round to zero in float4_e2m1fn, whose smallest nonzero value is 0.5.
The OCP Microscaling formats cure this with a shared scale per block of
``B`` entries (32 in the specification): an 8-bit exponent ``e`` (E8M0, the
scale ``X = 2**e``) chosen so that the block's largest magnitude lands in
the element type's top binade,

    e = floor(log2(max_k |x_k|)) - emax_elem,

and each entry sent as the element type's rounding of ``x_k / X`` (round to
nearest even, saturating at the largest finite value).  MXFP4 (E2M1
elements, ``emax_elem = 2``) costs ``4 + 8/B`` bits per entry, 4.25 at
``B = 32``; MXFP8 (E4M3, ``emax_elem = 8``) ``8 + 8/B``.  Dividing by a power of
two is exact, so the only error is the element's rounding.

The contraction, derived per block.  With ``m`` mantissa bits, ``emin`` the
smallest normal exponent and ``M`` the largest finite value of the element
type, the scaled entries ``y_k = x_k / X`` satisfy ``max|y| in [2**emax,
2**(emax+1))``.  An entry in the normal range is rounded with relative error
at most ``u = 2**-(m+1)``; one beyond ``M`` saturates with relative error at
most ``1 - M / 2**(emax+1)``; one in the subnormal range has absolute error
at most ``2**(emin-m-1) X <= 2**(emin-m-1-emax) max|x|``.  So, with
``r = max(u, 1 - M/2**(emax+1))`` and ``s = 2**(emin-m-1-emax)``,

    ||C(x) - x||^2 <= (r**2 + B s**2) ||x||^2,     delta = 1 - r**2 - B s**2,

for every block, hence for the array: 0.8125 for MXFP4 at ``B = 32`` (``r =
1/4``, ``s = 1/16``) and 0.9844 for MXFP8 (``r = 1/8``, ``s = 2**-18``).
Biased (deterministic rounding); zeros give zeros.

Non-finite entries are sent as the element type's NaN (E2M1 has none: the code
of -0 carries it, as :func:`compjax.cast` does) and decode as NaN; the block's
scale is taken over its finite entries, so the others keep their values.

References:
  Open Compute Project, "OCP Microscaling Formats (MX) Specification v1.0",
  2023 (E8M0 block scales, E2M1 and E4M3 elements, the scale rule above).
  Rouhani et al., "Microscaling Data Formats for Deep Learning",
  arXiv 2310.10537, 2023.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from compjax.compressor import Compressor
from compjax.compressors.dense import _CAST_DTYPES, _e2m1_codes, _e2m1_values
from compjax.numerics import to_dtype
from compjax.packing import pack, packed_bits, unpack

#: The element types and their (mantissa bits, smallest normal exponent, largest exponent).
_ELEMENTS = {"float4_e2m1fn": (1, 0, 2), "float8_e4m3fn": (3, -6, 8)}

#: Bias of the 8-bit scale exponent (E8M0): ``X = 2**(code - 127)``.
_SCALE_BIAS = 127


def mx_delta(element: str, block: int) -> float:
    """``delta = 1 - r**2 - B s**2`` of the module docstring (a bound, per block)."""
    m, emin, emax = _ELEMENTS[element]
    largest = float(jnp.finfo(_CAST_DTYPES[element]).max)
    r = max(2.0 ** -(m + 1), 1.0 - largest / 2.0 ** (emax + 1))
    s = 2.0 ** (emin - m - 1 - emax)
    return 1.0 - r**2 - block * s**2


@dataclasses.dataclass(frozen=True)
class Microscaled(Compressor):
    """Block-scaled narrow floats (OCP MX).  See :func:`mx`."""

    element: str = "float4_e2m1fn"
    block: int = 32

    unbiased: ClassVar[bool] = False
    deterministic: ClassVar[bool] = True
    keeps_dtype: ClassVar[bool] = True

    def __post_init__(self):
        if self.element not in _ELEMENTS:
            raise ValueError(f"element must be one of {sorted(_ELEMENTS)}, got {self.element!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block!r}")

    @property
    def _dtype(self) -> np.dtype:
        return _CAST_DTYPES[self.element]

    def _blocks(self, flat: jax.Array) -> jax.Array:
        """``flat`` in float32, zero-padded to whole blocks, as ``(blocks, B)``."""
        n = flat.shape[0]
        padded = jnp.pad(flat.astype(jnp.float32), (0, -n % self.block))
        return padded.reshape(-1, self.block)

    def encode(self, key, flat, dtype):
        n = flat.shape[0]
        blocks = self._blocks(flat)
        finite = jnp.isfinite(blocks)
        amax = jnp.max(jnp.where(finite, jnp.abs(blocks), 0.0), axis=1)
        emax = _ELEMENTS[self.element][2]
        # floor(log2(amax)) exactly (frexp: amax = f 2**k, f in [0.5, 1)); 0 for a zero block.
        _, k = jnp.frexp(amax)
        exponent = jnp.where(amax > 0, k - 1 - emax, 0)
        exponent = jnp.clip(exponent, -_SCALE_BIAS, _SCALE_BIAS)
        y = jnp.ldexp(blocks, -exponent[:, None]).reshape(-1)[:n]
        scales = (exponent + _SCALE_BIAS).astype(jnp.uint8)
        if self.element == "float4_e2m1fn":
            return {"codes": pack(_e2m1_codes(y), 4), "scales": scales}, {}
        return {"values": to_dtype(y, self._dtype), "scales": scales}, {}

    def decode(self, wire, side, n, dtype):
        if self.element == "float4_e2m1fn":
            y = _e2m1_values(unpack(wire["codes"], 4, n))
        else:
            y = wire["values"].astype(jnp.float32)
        exponent = wire["scales"].astype(jnp.int32) - _SCALE_BIAS
        per_entry = jnp.repeat(
            exponent, self.block, total_repeat_length=exponent.shape[0] * self.block
        )
        return jnp.ldexp(y, per_entry[:n])

    def omega(self, d):
        return None

    def unbiased_range(self, d, dtype=jnp.float32):
        return None

    def delta(self, d):
        return mx_delta(self.element, min(self.block, max(int(d), 1)))

    def bits(self, shape, dtype=jnp.float32):
        n = math.prod(shape)
        scales = 8 * -(-n // self.block)
        if self.element == "float4_e2m1fn":
            return packed_bits(n, 4) + scales
        return 8 * n + scales


def mx(element: str = "float4_e2m1fn", block: int = 32) -> Microscaled:
    """OCP Microscaling: ``element`` floats with one power-of-two scale per ``block`` entries.

    Each block of ``block`` entries is sent as an 8-bit exponent ``e`` (the
    scale ``2**e``, ``e = floor(log2 max|x|) - emax``) and its entries
    divided by the scale, rounded to ``element`` (nearest even, saturating).
    ``mx("float4_e2m1fn")`` is MXFP4 (4.25 bits per entry), ``mx("float8_e4m3fn")``
    MXFP8 (8.25).  Unlike :func:`compjax.cast` to the same types, small
    arrays keep their relative precision.  Biased, with the contraction
    ``delta = 1 - r**2 - B s**2`` derived in the module docstring (0.8125 for
    MXFP4, 0.984 for MXFP8 at ``block=32``): use it with error feedback, or as
    DiLoCo's outer-gradient compressor.

    Args:
      element: ``"float4_e2m1fn"`` or ``"float8_e4m3fn"``.
      block: entries sharing one scale (32 in the specification).

    Returns:
      A :class:`Microscaled` compressor whose payload holds ``"scales"`` (one
      uint8 exponent per block) and the scaled entries: ``"codes"`` (FP4 codes
      packed eight to a uint32 word) or ``"values"`` (float8_e4m3fn); it
      decodes to each entry times its block's ``2**e``.

    Examples:
      >>> import jax.numpy as jnp, compjax
      >>> c = compjax.mx("float4_e2m1fn", block=4)
      >>> c(None, jnp.array([1e-3, -3e-3, 5e-4, 0.0]))
      Array([ 0.00097656, -0.00292969,  0.00048828,  0.        ], dtype=float32)
      >>> c.bits((4,))
      24

    Raises:
      ValueError: ``element`` or ``block`` is not one of these.

    References:
      Open Compute Project, "OCP Microscaling Formats (MX) Specification v1.0", 2023.
    """
    return Microscaled(element=element, block=block)
