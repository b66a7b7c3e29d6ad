"""Bit packing of small unsigned integer codes into bytes.

Codes of ``width`` bits (1, 2 or 4) are packed ``8 // width`` to a byte, the
first code in the least significant bits.  Widths 8, 16 and 32 use the
unsigned integer type of that width directly.  This is the wire format of
signs (1 bit), ternaries (2 bits) and QSGD's sign-magnitude codes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WIDTHS = (1, 2, 4, 8, 16, 32)
_WORD = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def code_width(max_code: int) -> int:
    """The smallest packing width in :data:`WIDTHS` holding codes ``0..max_code``."""
    needed = max(int(max_code).bit_length(), 1)
    for width in WIDTHS:
        if width >= needed:
            return width
    raise ValueError(f"max_code={max_code} does not fit in 32 bits")


def packed_bits(n: int, width: int) -> int:
    """Bits of ``n`` codes of ``width`` bits once packed (whole bytes)."""
    if width >= 8:
        return n * width
    per_byte = 8 // width
    return -(-n // per_byte) * 8


def pack(codes: jax.Array, width: int) -> jax.Array:
    """Pack a 1-D array of unsigned codes, each below ``2**width``.

    Returns a uint8 array of ``ceil(n * width / 8)`` bytes for widths below 8,
    else the codes as uint8/uint16/uint32.
    """
    if width not in WIDTHS:
        raise ValueError(f"width must be one of {WIDTHS}, got {width}")
    if width >= 8:
        return codes.astype(_WORD[width])
    per_byte = 8 // width
    n = codes.shape[0]
    padded = jnp.pad(codes.astype(jnp.uint8), (0, -n % per_byte))
    groups = padded.reshape(-1, per_byte)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(width)
    # Disjoint bit ranges: the sum is the bitwise or.
    return jnp.sum(groups << shifts, axis=1, dtype=jnp.uint8)


def unpack(packed: jax.Array, width: int, n: int) -> jax.Array:
    """Inverse of :func:`pack`: the first ``n`` codes, as uint32."""
    if width >= 8:
        return packed.astype(jnp.uint32)
    per_byte = 8 // width
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(width)
    mask = jnp.uint8((1 << width) - 1)
    codes = (packed[:, None] >> shifts) & mask
    return codes.reshape(-1)[:n].astype(jnp.uint32)
