"""Bit packing: exact round trips and the byte counts of the wire format."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import input_readers
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
    assert packed.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(packed), [0b100111001])
    packed = packing.pack(jnp.array([3, 0, 1, 2, 2], jnp.uint32), 2)
    np.testing.assert_array_equal(np.asarray(packed), [0b1010010011])
    packed = packing.pack(jnp.array([1] * 32 + [0, 1], jnp.uint32), 1)
    np.testing.assert_array_equal(np.asarray(packed), [0xFFFFFFFF, 0b10])


def reference_words(codes: np.ndarray, width: int) -> np.ndarray:
    """The wire format written plainly: word j holds codes j*k .. j*k+k-1, k = 32 // width,
    the first in the least significant bits."""
    per_word = 32 // width
    padded = np.zeros(-(-codes.size // per_word) * per_word, np.uint64)
    padded[: codes.size] = codes
    groups = padded.reshape(-1, per_word) << (width * np.arange(per_word, dtype=np.uint64))
    return groups.sum(axis=1).astype(np.uint32)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_words_match_the_plain_layout(width):
    """``pack`` gives exactly the word layout, and as many bits as ``packed_bits`` counts,
    at sizes around a word."""
    rng = np.random.default_rng(width)
    for n in (0, 7, 32 // width, 32 // width + 1, 32, 33, 100):
        codes = rng.integers(0, 1 << width, n).astype(np.uint32)
        packed = packing.pack(jnp.asarray(codes), width)
        np.testing.assert_array_equal(np.asarray(packed), reference_words(codes, width))
        assert packed.size * 32 == packing.packed_bits(n, width) == -(-n * width // 32) * 32
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
    """The words of ``pack`` and the sum of the terms (float64 reference, float32 rounding),
    at sizes around a word; NaN and Inf terms reach the sum."""
    rng = np.random.default_rng(10 + width)
    run = jax.jit(packing.pack_summing, static_argnums=1)
    for n in (0, 7, 32, 33, 100, 5000):
        codes = rng.integers(0, 1 << width, n).astype(np.uint32)
        terms = np.abs(rng.standard_normal(n)).astype(np.float32)
        packed, total = run(jnp.asarray(codes), width, jnp.asarray(terms))
        np.testing.assert_array_equal(np.asarray(packed), reference_words(codes, width))
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
    readers = input_readers(compress, jax.random.key(1), x)
    assert len(readers) == 1, readers
    scale = compress(jax.random.key(1), x).wire["scale"]
    np.testing.assert_allclose(float(scale), float(plain(x)), rtol=1e-6)


@pytest.mark.parametrize("widths", [(8, 1), (4, 2), (2, 2), (16, 1), (4, 4)])
def test_pack_fields_pair_is_both_packings_in_one_pass(widths):
    """The words of two :func:`pack_fields` calls, at sizes around a word; one compiled
    reduction reads the codes' input."""
    wide_width, narrow_width = widths
    rng = np.random.default_rng(sum(widths))
    run = jax.jit(packing.pack_fields_pair, static_argnums=(1, 3))
    for n in (0, 1, 31, 32, 33, 100, 5000):
        wide = rng.integers(0, 1 << wide_width, n).astype(np.uint32)
        narrow = rng.integers(0, 1 << narrow_width, n).astype(np.uint32)
        got = run(jnp.asarray(wide), wide_width, jnp.asarray(narrow), narrow_width)
        for words, codes, width in zip(got, (wide, narrow), widths, strict=True):
            expected = packing.pack_fields(jnp.asarray(codes), width, 32 // width)
            np.testing.assert_array_equal(np.asarray(words), np.asarray(expected))
            np.testing.assert_array_equal(
                np.asarray(packing.unpack_fields(words, width, 32 // width, n)), codes
            )
    with pytest.raises(ValueError, match="widths"):
        packing.pack_fields_pair(jnp.zeros(3, jnp.uint32), 1, jnp.zeros(3, jnp.uint32), 2)


def test_natural_compression_reads_its_input_once():
    """Exponents and signs are packed in one pass: one operation of the compiled compress
    reads the input."""
    x = jax.random.normal(jax.random.key(0), (1 << 16,))
    readers = input_readers(jax.jit(compjax.natural().compress), jax.random.key(1), x)
    assert len(readers) == 1, readers


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an option of XLA's CPU backend")
@pytest.mark.parametrize("comp", [compjax.terngrad(), compjax.int_quant(4)], ids=str)
def test_payloads_do_not_depend_on_the_cpu_vector_width(comp):
    """XLA's CPU option ``xla_cpu_prefer_vector_width=512`` (documented as a speed-up of
    TernGrad's compress on AVX-512) sends and decodes the same bits as the default."""
    key = jax.random.key(3)
    wide = {"xla_cpu_prefer_vector_width": 512}
    for dtype in (jnp.float32, jnp.bfloat16):
        x = (3 * jax.random.normal(jax.random.key(4), (4099,))).astype(dtype)
        runs = []
        for options in (None, wide):
            payload = jax.jit(comp.compress, compiler_options=options)(key, x)
            runs.append((payload, jax.jit(comp.decompress, compiler_options=options)(payload)))
        (p, out), (p_wide, out_wide) = runs
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_wide), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_wide, np.float32))
