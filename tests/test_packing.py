"""Bit packing: exact round trips and the byte counts of the wire format."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import compjax
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


@pytest.mark.parametrize("width", [1, 2, 4])
def test_pack_summing_packs_and_sums_in_one_pass(width):
    """The bytes of ``pack`` and the sum of the terms (float64 reference, float32 rounding),
    at sizes around a word; NaN and Inf terms reach the sum."""
    rng = np.random.default_rng(10 + width)
    run = jax.jit(packing.pack_summing, static_argnums=1)
    for n in (0, 7, 32, 33, 100, 5000):
        codes = rng.integers(0, 1 << width, n).astype(np.uint32)
        terms = np.abs(rng.standard_normal(n)).astype(np.float32)
        packed, total = run(jnp.asarray(codes), width, jnp.asarray(terms))
        np.testing.assert_array_equal(np.asarray(packed), reference_bytes(codes, width))
        np.testing.assert_allclose(float(total), np.sum(terms, dtype=np.float64), rtol=1e-6)
    for bad in (np.inf, np.nan):
        terms[17] = bad
        _, total = run(jnp.asarray(codes), width, jnp.asarray(terms))
        np.testing.assert_array_equal(float(total), bad)
    with pytest.raises(ValueError, match="width"):
        packing.pack_summing(jnp.zeros(3, jnp.uint32), 8, jnp.zeros(3))


SCALES = {
    "scaled_sign": (compjax.scaled_sign(), lambda x: jnp.mean(jnp.abs(x))),
    "l2_scaled_sign": (compjax.l2_scaled_sign(), lambda x: jnp.sqrt(jnp.mean(jnp.square(x)))),
}


@pytest.mark.parametrize("name", sorted(SCALES))
def test_scaled_signs_read_their_input_once(name):
    """The scale's sum is reduced in the pass that packs the signs: in the compiled compress
    one operation reads the input (besides the conditional's exactly scaled fallback, which
    runs only where the sum overflows or flushes); the scale is the plain sum's to rounding."""
    comp, plain = SCALES[name]
    x = jax.random.normal(jax.random.key(0), (1 << 16,))
    compress = jax.jit(comp.compress)
    entry = compress.lower(jax.random.key(1), x).compile().as_text()
    entry = entry[entry.index("ENTRY") :].splitlines()
    param = re.search(r"(%\S+) = f32\[65536\]\S* parameter\(0\)", "\n".join(entry)).group(1)
    readers = [
        line
        for line in entry[1:]
        if re.search(re.escape(param) + r"\b", line)
        and not re.search(r"parameter\(|\) tuple\(|conditional\(", line)
    ]
    assert len(readers) == 1, readers
    scale = compress(jax.random.key(1), x).wire["scale"]
    np.testing.assert_allclose(float(scale), float(plain(x)), rtol=1e-6)
