"""Dense baselines: no compression, and reduced-precision transport.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018 (fp16 transport
  with float32 master weights).
  Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433, 2022
  (E4M3 without infinities, largest finite value 448).
  Open Compute Project, "OCP Microscaling Formats (MX) Specification v1.0",
  2023 (E2M1: 4-bit floats, no Inf or NaN, largest finite value 6).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from compjax.compressor import Compressor, dtype_max
from compjax.compressors.elementwise import Elementwise
from compjax.numerics import to_dtype, widen
from compjax.packing import codes_per_element, pack, packed_bits, unpack

_CAST_DTYPES = {
    "float4_e2m1fn": np.dtype(jnp.float4_e2m1fn),
    "float8_e4m3fn": np.dtype(jnp.float8_e4m3fn),
    "float16": np.dtype(jnp.float16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "float32": np.dtype(jnp.float32),
}

#: Magnitudes of the eight float4_e2m1fn codes 0..7 (the sign is the code's bit 3).
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: The code of -0, which float4 transport sends for NaN (E2M1 has no NaN; see ``Cast``).
_E2M1_NAN = 8


def _e2m1_codes(flat: jax.Array) -> jax.Array:
    """4-bit codes (sign in bit 3, magnitude index in bits 0-2) of float32 ``flat``.

    Rounds to nearest even and saturates at 6 (:func:`compjax.numerics.to_dtype`); NaN and
    ±Inf get the code of -0, and zeros of either sign the code of +0.
    """
    magnitude = to_dtype(jnp.abs(flat), jnp.float4_e2m1fn).astype(jnp.float32)
    grid = jnp.asarray(_E2M1_GRID, jnp.float32)
    index = jnp.searchsorted(grid, magnitude, method="compare_all")  # fused, not a while loop
    codes = jnp.where(flat < 0, index + 8, index).astype(jnp.uint32)
    codes = jnp.where(magnitude == 0, 0, codes)
    return jnp.where(jnp.isfinite(flat), codes, _E2M1_NAN).astype(jnp.uint32)


def _e2m1_values(codes: jax.Array) -> jax.Array:
    """Float32 values of 4-bit codes from :func:`_e2m1_codes` (the code of -0 is NaN)."""
    table = jnp.asarray([*_E2M1_GRID, jnp.nan, *(-v for v in _E2M1_GRID[1:])], jnp.float32)
    return table[codes]


def _itembits(dtype) -> int:
    return np.dtype(dtype).itemsize * 8


@dataclasses.dataclass(frozen=True)
class Identity(Compressor):
    """No compression: the array is sent as it is."""

    unbiased: ClassVar[bool] = True
    linear: ClassVar[bool] = True
    deterministic: ClassVar[bool] = True
    keeps_dtype: ClassVar[bool] = True

    def encode(self, key, flat, dtype):
        return {"values": flat}, {}

    def decode(self, wire, side, n, dtype):
        return wire["values"]

    def omega(self, d):
        return 0.0

    def delta(self, d):
        return 1.0

    def unbiased_range(self, d, dtype=jnp.float32):
        return dtype_max(dtype)

    def bits(self, shape, dtype=jnp.float32):
        return math.prod(shape) * _itembits(dtype)


@dataclasses.dataclass(frozen=True)
class Cast(Elementwise, Compressor):
    """Round to a narrower float type (round to nearest even) for transport.

    Values beyond the wire type's range saturate at its largest finite value
    (never Inf).  Within the normal range of the wire type the relative error
    of each entry is at most the unit roundoff ``u = 2**-(mantissa bits + 1)``,
    so ``||C(x) - x||^2 <= u^2 ||x||^2``: ``delta = 1 - u^2``.  Entries below
    the smallest normal number of the wire type (float16: 6.1e-5,
    float8_e4m3fn: 2**-6, float4_e2m1fn: 1) lose relative precision and fall
    outside that bound.  The decode is float32 (then the input's dtype), so
    sums of decodes accumulate in float32.

    float8_e4m3fn travels as one byte per entry; float4_e2m1fn as 4-bit
    codes packed eight to a uint32 word (:func:`compjax.packing.pack`).  Neither has
    an Inf: an infinite input decodes as NaN (float8_e4m3fn's own rounding;
    float4_e2m1fn has no NaN either, so its code of -0 carries NaN and ±Inf,
    and zeros are sent as +0).

    Linear for float16, bfloat16 and float32: the all-reduce sums payloads in
    the wire dtype, so the sum of decodes equals the decode of the sum up to
    wire-dtype rounding.  The 8- and 4-bit types are not (a sum of codes is
    no code; a sum in 3 mantissa bits loses too much): their payloads are
    gathered and decoded one by one.
    """

    dtype: np.dtype = _CAST_DTYPES["float16"]
    deterministic: ClassVar[bool] = True
    keeps_dtype: ClassVar[bool] = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.dtype == np.dtype(jnp.float32)

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.dtype.itemsize >= 2

    @property
    def packed(self) -> bool:
        """Whether entries travel as packed 4-bit codes (float4_e2m1fn)."""
        return self.dtype == np.dtype(jnp.float4_e2m1fn)

    def encode(self, key, flat, dtype):
        return self.encode_span(key, flat, 0, flat.shape[0], {}, dtype), {}

    def units(self, d, dtype):
        return {"codes": codes_per_element(4)} if self.packed else {"values": 1}

    def encode_span(self, key, flat, offset, d, stats, dtype):
        if self.packed:
            return {"codes": pack(_e2m1_codes(flat.astype(jnp.float32)), 4)}
        return {"values": to_dtype(flat, self.dtype)}

    def decode_span(self, wire, side, offset, n, d, dtype):
        if self.packed:
            return _e2m1_values(unpack(wire["codes"], 4, n))
        return widen(wire["values"])

    def unit_roundoff(self) -> float:
        return 2.0 ** -(jnp.finfo(self.dtype).nmant + 1)

    def omega(self, d):
        return 0.0 if self.unbiased else None

    def unbiased_range(self, d, dtype=jnp.float32):
        return dtype_max(dtype) if self.unbiased else None

    def delta(self, d):
        return 1.0 - self.unit_roundoff() ** 2

    def bits(self, shape, dtype=jnp.float32):
        if self.packed:
            return packed_bits(math.prod(shape), 4)
        return math.prod(shape) * _itembits(self.dtype)


def identity() -> Identity:
    """The uncompressed baseline: ``C(x) = x``, 32 bits per float32 entry.

    Args:
      none: the compressor has no parameters.

    Returns:
      An :class:`Identity` compressor whose payload holds ``"values"``, the
      array itself in its dtype; it decodes to the array unchanged.

    Examples:
      >>> import jax, jax.numpy as jnp, compjax
      >>> c = compjax.identity()
      >>> c(jax.random.key(0), jnp.ones(3))
      Array([1., 1., 1.], dtype=float32)
    """
    return Identity()


def cast(dtype) -> Cast:
    """Reduced-precision transport: send the array as ``dtype``.

    Args:
      dtype: the wire dtype, one of ``float16``, ``bfloat16``, ``float32``,
        ``float8_e4m3fn`` (8 bits: 3 mantissa bits, largest finite value 448)
        or ``float4_e2m1fn`` (4 bits: 1 mantissa bit, largest finite value 6,
        packed eight entries to a uint32 word), a name or a dtype.  The 8- and 4-bit
        types have a narrow range: scale the array into it first (entries
        below half the smallest subnormal, 2**-10 and 0.25, are sent as 0).

    Returns:
      A :class:`Cast` compressor whose payload holds ``"values"``, the array in
      ``dtype`` (for ``float4_e2m1fn``: ``"codes"``, its 4-bit codes packed
      eight to a uint32 word); it decodes to those values in the input's dtype.

    Examples:
      >>> import jax.numpy as jnp, compjax
      >>> c = compjax.cast("float4_e2m1fn")
      >>> c(None, jnp.array([0.7, -2.4, 100.0]))
      Array([ 0.5, -2. ,  6. ], dtype=float32)
      >>> c.bits((3,))
      16

    Raises:
      ValueError: ``dtype`` is not one of these.

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018.
      Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433, 2022.
      Open Compute Project, "OCP Microscaling Formats (MX) Specification v1.0", 2023.
    """
    try:
        key = np.dtype(dtype).name
    except TypeError as err:
        raise ValueError(f"dtype must be one of {sorted(_CAST_DTYPES)}, got {dtype!r}") from err
    if key not in _CAST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_CAST_DTYPES)}, got {dtype!r}")
    return Cast(dtype=_CAST_DTYPES[key])
