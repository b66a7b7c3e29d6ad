"""Dense baselines: no compression, and reduced-precision transport.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018 (fp16 transport
  with float32 master weights).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from compjax.compressor import Compressor, dtype_max, to_dtype

_CAST_DTYPES = {
    "float16": np.dtype(jnp.float16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "float32": np.dtype(jnp.float32),
}


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
class Cast(Compressor):
    """Round to a narrower float type (round to nearest even) for transport.

    Values beyond the wire type's range saturate at its largest finite value
    (never Inf).  Within the normal range of the wire type the relative error
    of each entry is at most the unit roundoff ``u = 2**-(mantissa bits + 1)``,
    so ``||C(x) - x||^2 <= u^2 ||x||^2``: ``delta = 1 - u^2``.  Entries below
    the smallest normal number of the wire type (float16: 6.1e-5) lose
    relative precision and fall outside that bound.

    Linear: the fp16/bf16 all-reduce sums payloads in the wire dtype, so the
    sum of decodes equals the decode of the sum up to wire-dtype rounding.
    """

    dtype: np.dtype = _CAST_DTYPES["float16"]
    linear: ClassVar[bool] = True
    deterministic: ClassVar[bool] = True
    keeps_dtype: ClassVar[bool] = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.dtype == np.dtype(jnp.float32)

    def encode(self, key, flat, dtype):
        return {"values": to_dtype(flat, self.dtype)}, {}

    def decode(self, wire, side, n, dtype):
        return wire["values"].astype(jnp.float32)

    def unit_roundoff(self) -> float:
        return 2.0 ** -(jnp.finfo(self.dtype).nmant + 1)

    def omega(self, d):
        return 0.0 if self.unbiased else None

    def unbiased_range(self, d, dtype=jnp.float32):
        return dtype_max(dtype) if self.unbiased else None

    def delta(self, d):
        return 1.0 - self.unit_roundoff() ** 2

    def bits(self, shape, dtype=jnp.float32):
        return math.prod(shape) * _itembits(self.dtype)


def identity() -> Identity:
    """The uncompressed baseline: ``C(x) = x``, 32 bits per float32 entry.

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
      dtype: the wire dtype, one of ``float16``, ``bfloat16``, ``float32``
        (a name or a dtype).

    Raises:
      ValueError: ``dtype`` is not one of these.

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    """
    try:
        key = np.dtype(dtype).name
    except TypeError as err:
        raise ValueError(f"dtype must be one of {sorted(_CAST_DTYPES)}, got {dtype!r}") from err
    if key not in _CAST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_CAST_DTYPES)}, got {dtype!r}")
    return Cast(dtype=_CAST_DTYPES[key])
