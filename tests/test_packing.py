"""Bit packing: exact round trips and the byte counts of the wire format."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from compjax import packing


@given(
    width=st.sampled_from(packing.WIDTHS),
    n=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip(width, n, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**width, size=n, dtype=np.uint64).astype(np.uint32)
    packed = packing.pack(jnp.asarray(codes), width)
    assert packed.size * packed.dtype.itemsize * 8 == packing.packed_bits(n, width)
    np.testing.assert_array_equal(np.asarray(packing.unpack(packed, width, n)), codes)


def test_layout_first_code_in_low_bits():
    packed = packing.pack(jnp.array([1, 0, 0, 1, 1, 1, 0, 0, 1], jnp.uint32), 1)
    np.testing.assert_array_equal(np.asarray(packed), [0b00111001, 0b1])
    packed = packing.pack(jnp.array([3, 0, 1, 2, 2], jnp.uint32), 2)
    np.testing.assert_array_equal(np.asarray(packed), [0b10010011, 0b10])


def reference_bytes(codes: np.ndarray, width: int) -> np.ndarray:
    """The wire format written plainly: byte j holds codes j*k .. j*k+k-1, k = 8 // width,
    the first in the least significant bits."""
    per_byte = 8 // width
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, np.uint64)
    padded[: codes.size] = codes
    groups = padded.reshape(-1, per_byte) << (width * np.arange(per_byte, dtype=np.uint64))
    return groups.sum(axis=1).astype(np.uint8)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_bytes_match_the_plain_layout(width):
    """Packing through 32-bit words gives exactly the byte layout, at sizes around a word."""
    rng = np.random.default_rng(width)
    for n in (0, 7, 32, 33, 100):
        codes = rng.integers(0, 1 << width, n).astype(np.uint32)
        packed = packing.pack(jnp.asarray(codes), width)
        np.testing.assert_array_equal(np.asarray(packed), reference_bytes(codes, width))
        np.testing.assert_array_equal(np.asarray(packing.unpack(packed, width, n)), codes)


@pytest.mark.parametrize(
    ("max_code", "width"), [(0, 1), (1, 1), (2, 2), (3, 2), (15, 4), (16, 8), (2**16, 32)]
)
def test_code_width(max_code, width):
    assert packing.code_width(max_code) == width


def test_bad_width():
    with pytest.raises(ValueError, match="width"):
        packing.pack(jnp.zeros(3, jnp.uint32), 3)
