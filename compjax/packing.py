"""Bit packing of small unsigned integer codes into bytes.

Codes of ``width`` bits (1, 2 or 4) are packed ``8 // width`` to a byte, the
first code in the least significant bits.  Widths 8, 16 and 32 use the
unsigned integer type of that width directly.  This is the wire format of
signs (1 bit), ternaries (2 bits) and QSGD's sign-magnitude codes.
"""

from __future__ import annotations

import sys

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


def codes_per_element(width: int) -> int:
    """Codes of ``width`` bits in one element of the packed array (a byte, or one word)."""
    return 8 // width if width < 8 else 1


def pack(codes: jax.Array, width: int) -> jax.Array:
    """Pack a 1-D array of unsigned codes, each below ``2**width``.

    Returns a uint8 array of ``ceil(n * width / 8)`` bytes for widths below 8,
    else the codes as uint8/uint16/uint32.  Computed through 32-bit words:
    ``32 // width`` codes are or-ed into a uint32 word, which is split into
    its four bytes, least significant first, by shifts (independent of the
    machine's byte order); XLA on a CPU runs this several times faster than
    packing byte by byte.
    """
    if width not in WIDTHS:
        raise ValueError(f"width must be one of {WIDTHS}, got {width}")
    if width >= 8:
        return codes.astype(_WORD[width])
    per_word = 32 // width
    n = codes.shape[0]
    padded = jnp.pad(codes.astype(jnp.uint32), (0, -n % per_word)).reshape(-1, per_word)
    shifts = jnp.uint32(width) * jnp.arange(per_word, dtype=jnp.uint32)
    # Disjoint bit ranges: the sum is the bitwise or.
    words = jnp.sum(padded << shifts, axis=1, dtype=jnp.uint32)
    octets = (words[:, None] >> (jnp.uint32(8) * jnp.arange(4, dtype=jnp.uint32))) & 0xFF
    return octets.astype(jnp.uint8).reshape(-1)[: packed_bits(n, width) // 8]


def unpack(packed: jax.Array, width: int, n: int) -> jax.Array:
    """Inverse of :func:`pack`: the first ``n`` codes, as uint32.

    Four bytes are read as one little-endian uint32 word (a bitcast, which
    XLA's CPU code handles far better than byte-wise shifts), then split into
    its ``32 // width`` codes.
    """
    if width >= 8:
        return packed.astype(jnp.uint32)
    octets = jnp.pad(packed, (0, -packed.shape[0] % 4)).reshape(-1, 4)
    if sys.byteorder == "little":
        words = jax.lax.bitcast_convert_type(octets, jnp.uint32)
    else:  # pragma: no cover - no big-endian JAX platform
        o = octets.astype(jnp.uint32)
        words = o[:, 0] | (o[:, 1] << 8) | (o[:, 2] << 16) | (o[:, 3] << 24)
    shifts = jnp.uint32(width) * jnp.arange(32 // width, dtype=jnp.uint32)
    codes = (words[:, None] >> shifts) & jnp.uint32((1 << width) - 1)
    return codes.reshape(-1)[:n]


class SignMagnitude:
    """Sign-magnitude codes of level indices ``0..levels``, for compressors with ``levels``.

    ``magnitude_bits`` hold the level, the sign sits in the top bit of a code
    ``width`` bits wide (:func:`code_width`: a packable 1, 2, 4, 8, ... bits).
    """

    levels: int

    @property
    def magnitude_bits(self) -> int:
        return int(self.levels).bit_length()

    @property
    def width(self) -> int:
        """Packed width of one sign-magnitude code (sign in the top bit)."""
        return code_width((1 << (self.magnitude_bits + 1)) - 1)
