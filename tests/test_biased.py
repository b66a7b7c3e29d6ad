"""Biased compressors: the contraction bound with delta(d), tight where it is.

Deterministic compressors are checked exactly on hypothesis-drawn inputs;
random ones by Monte Carlo (fixed seeds, 5 standard errors).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import apply, assert_mean_error, draw, roundtrip
from hypothesis import given
from hypothesis import strategies as st
from test_unbiased import D, qsgd_variance, vectors

import compjax

KEY = jax.random.key(0)


def sq(v):
    return float(np.sum(np.square(np.asarray(v, np.float64))))


def error(comp, x):
    return sq(np.asarray(apply(comp, KEY, jnp.asarray(x, jnp.float32)), np.float64) - x)


@given(x=vectors(), k=st.sampled_from([1, 5, 16, 32]))
def test_top_k_contraction(x, k):
    comp = compjax.top_k(k=k)
    y = np.asarray(apply(comp, KEY, jnp.asarray(x, jnp.float32)), np.float64)
    assert np.count_nonzero(y) <= k
    # The kept entries are the largest in magnitude and unchanged.
    kept = y != 0
    np.testing.assert_array_equal(y[kept], x[kept])
    if kept.any():
        assert np.abs(x[~kept]).max(initial=0) <= np.abs(x[kept]).min()
    assert error(comp, x) <= (1 - comp.delta(D)) * sq(x) * (1 + 1e-6)


def test_top_k_equality_at_equal_magnitudes():
    x = np.where(np.arange(D) % 2, -2.5, 2.5)
    comp = compjax.top_k(k=5)
    np.testing.assert_allclose(error(comp, x), (1 - comp.delta(D)) * sq(x), rtol=1e-6)


@given(x=vectors())
def test_scaled_sign_error_is_exact(x):
    comp = compjax.scaled_sign()
    exact = sq(x) - np.sum(np.abs(x)) ** 2 / D
    np.testing.assert_allclose(error(comp, x), exact, rtol=1e-5, atol=1e-6 * sq(x))
    assert exact <= (1 - comp.delta(D)) * sq(x) * (1 + 1e-9)


def test_scaled_sign_equality_at_one_sparse():
    x = np.zeros(D)
    x[7] = -3.0
    comp = compjax.scaled_sign()
    np.testing.assert_allclose(error(comp, x), (1 - comp.delta(D)) * sq(x), rtol=1e-6)


def test_sign_is_one_bit_of_sign():
    x = jnp.array([-2.0, 0.0, 3.0, -0.0, -1e-30, 5.0, 1.0, -1.0, 2.0])
    payload, y = compjax.sign().compress(None, x), compjax.sign()(None, x)
    assert payload.wire["signs"].dtype == jnp.uint32 and payload.wire["signs"].shape == (1,)
    assert int(payload.wire["signs"][0]) == 0b010010001  # bit i: entry i negative
    np.testing.assert_array_equal(y, [-1, 1, 1, 1, -1, 1, 1, -1, 1])


def test_rand_k_unscaled_error_is_exact_in_expectation():
    comp = compjax.rand_k(k=5, scaled=False)
    x = np.linspace(-1.0, 3.0, D)
    draws = draw(comp, jnp.asarray(x, jnp.float32))
    assert_mean_error(draws, x, (1 - comp.delta(D)) * sq(x))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cast_contraction_nearly_tight(dtype):
    comp = compjax.cast(dtype)
    u = comp.unit_roundoff()
    # Halfway between two representable numbers: relative error u / (1 + u).
    x = np.float32(1.0 + u) * np.exp2(np.arange(-8, 8, dtype=np.float64))
    err = error(comp, x)
    assert err <= (1 - comp.delta(len(x))) * sq(x)
    assert err >= 0.99 * (1 - comp.delta(len(x))) * sq(x)


@given(x=vectors())
def test_cast_contraction(x):
    comp = compjax.cast("bfloat16")
    assert error(comp, x) <= (1 - comp.delta(D)) * sq(x) * (1 + 1e-6)


def test_cast_saturates_instead_of_overflowing():
    y = compjax.cast("float16")(None, jnp.array([1e6, -1e6, 3.0]))
    np.testing.assert_array_equal(y, [65504.0, -65504.0, 3.0])


@given(x=vectors())
def test_chain_top_k_then_qsgd_contraction(x):
    comp = compjax.chain(compjax.top_k(k=16), compjax.qsgd(8))
    # omega_q(16) = 16 / (4 * 64) = 1/16, so delta = (1 - 1/16) * 16/32.
    np.testing.assert_allclose(comp.delta(D), (1 - 1 / 16) * 0.5)
    kept = np.zeros(D, bool)
    kept[np.argsort(-np.abs(x), kind="stable")[:16]] = True
    # Exact expected error: what top-k drops plus QSGD's variance on the kept values.
    exact = sq(x[~kept]) + qsgd_variance(x[kept], 8).sum()
    assert exact <= (1 - comp.delta(D)) * sq(x) * (1 + 1e-9)
    draws = draw(comp, jnp.asarray(x, jnp.float32), n=2000)
    assert_mean_error(draws, x, exact)


def test_scaled_unbiased_is_contractive_with_one_over_omega_plus_one():
    inner = compjax.qsgd(4)
    x = np.ones(64)  # QSGD's extremal vector: omega = 1
    omega = inner.omega(64)
    comp = compjax.scaled(inner, 1 / (omega + 1))
    np.testing.assert_allclose(comp.delta(64), 1 / (omega + 1))
    draws = draw(comp, jnp.asarray(x, jnp.float32), n=8000)
    assert_mean_error(draws, x, (1 - comp.delta(64)) * sq(x))
    # And the variance of the inner draws is what the scaling relies on.
    assert np.isclose(qsgd_variance(x, 4).sum(), omega * sq(x))


# -- top_k(select="threshold"): DGC's sampled threshold ------------------------------------
# One shape (d = 4096, k = 205, band [164, 266]) so that every test compiles once.  The
# strided sample: every 99th entry from 0 (41 samples); the threshold starts at the 3rd
# largest sampled magnitude.
TD = 4096
THRESHOLD = compjax.top_k(ratio=0.05, select="threshold")
EXACT = compjax.top_k(ratio=0.05)
K_LO, K_HI = THRESHOLD.count_band(TD)
SAMPLED = 99 * np.arange(41)


def roundtrip_threshold(x):
    payload, y = roundtrip(THRESHOLD, None, jnp.asarray(x, jnp.float32))
    return np.asarray(payload.wire["indices"]), np.asarray(payload.wire["values"]), np.asarray(y)


def test_threshold_band_and_delta_are_k_lo():
    assert (THRESHOLD.k_for(TD), K_LO, K_HI) == (205, 164, 266)
    assert THRESHOLD.delta(TD) == K_LO / TD
    assert THRESHOLD.bits((TD,)) == K_HI * 64  # the slots, padding included
    assert EXACT.count_band(TD) == (205, 205) and EXACT.delta(TD) == 205 / TD


def test_threshold_contraction_is_tight_at_k_lo():
    """k_lo entries barely above the rest, three of them sampled: the threshold lands on
    them, exactly k_lo entries pass (in the band, so no fallback), and the error is within
    8e-5 of (1 - k_lo/d) ||x||^2: delta = (k_lo + 1)/d would already fail."""
    rng = np.random.default_rng(5)
    big = np.concatenate(
        [SAMPLED[:3], rng.choice(np.setdiff1d(np.arange(TD), SAMPLED), K_LO - 3, replace=False)]
    )
    x = np.ones(TD)
    x[big] = 1.001
    x *= rng.choice([-1.0, 1.0], TD)
    idx, _, y = roundtrip_threshold(x)
    assert np.count_nonzero(idx < TD) == K_LO  # the threshold's selection, not the top-k
    err, total = sq(y - x), sq(x)
    assert err <= (1 - THRESHOLD.delta(TD)) * total * (1 + 1e-7)
    assert err > (1 - (K_LO + 1) / TD) * total


def test_threshold_equals_exact_top_k_when_exactly_k_pass():
    """The k largest magnitudes 10.00, 10.01, ...; the three smallest are the sample's
    largest, so the threshold is 10 and exactly k entries reach it."""
    rng = np.random.default_rng(6)
    k = EXACT.k_for(TD)
    others = rng.permutation(np.setdiff1d(np.arange(TD), SAMPLED))[: k - 3]
    x = rng.uniform(-1, 1, TD)
    x[np.concatenate([SAMPLED[:3], others])] = (10 + 0.01 * np.arange(k)) * rng.choice([-1, 1], k)
    idx, values, y = roundtrip_threshold(x)
    assert np.count_nonzero(idx < TD) == k
    np.testing.assert_array_equal(y, np.asarray(apply(EXACT, KEY, jnp.asarray(x, jnp.float32))))
    assert np.all(idx[k:] == TD) and np.all(values[k:] == 0)  # padded slots


@given(x=vectors(TD))
def test_threshold_count_in_band_top_set_and_contraction(x):
    idx, values, y = roundtrip_threshold(x)
    x32 = np.asarray(x, np.float32).astype(np.float64)
    used = idx < TD
    count = int(used.sum())
    assert K_LO <= count <= K_HI and idx.shape == (K_HI,)
    assert len(set(idx[used])) == count and np.all(values[~used] == 0)
    np.testing.assert_array_equal(values[used], x32[idx[used]])
    kept = np.zeros(TD, bool)
    kept[idx[used]] = True
    assert np.abs(x32[~kept]).max() <= np.abs(x32[kept]).min()  # the count largest
    assert sq(y - x32) <= (1 - THRESHOLD.delta(TD)) * sq(x32) * (1 + 1e-6)
