"""ATOMO: water-filling probabilities, unbiasedness, the exact variance, special cases."""

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_mean_error, assert_unbiased, draw
from hypothesis import given
from hypothesis import strategies as st
from test_unbiased import qsgd_variance, terngrad_variance, vectors

import compjax
from compjax.compressor import UnbiasedRangeWarning
from compjax.compressors.atomo import water_fill


def reference_probabilities(m, s):
    """Water-filling written plainly: saturate the largest atoms one at a time."""
    m = np.asarray(m, np.float64)
    p = np.zeros_like(m)
    free = m > 0
    budget = s
    while free.any():
        c = budget / m[free].sum()
        if c * m[free].max() <= 1:
            p[free] = c * m[free]
            break
        top = np.flatnonzero(free)[np.argmax(m[free])]
        p[top], free[top] = 1.0, False
        budget -= 1
        if budget <= 0:
            break
    return np.minimum(p, 1.0)


def test_worked_example():
    p = water_fill(jnp.array([10.0, 5.0, 1.0, 1.0, 1.0, 0.5]), 3.0)
    np.testing.assert_allclose(p, [1, 1, 2 / 7, 2 / 7, 2 / 7, 1 / 7], rtol=1e-6)


@given(x=vectors(), s=st.floats(0.5, 40.0))
def test_water_filling_matches_reference_and_is_optimal(x, s):
    m = np.abs(x)
    p = np.asarray(water_fill(jnp.asarray(m, jnp.float32), s), np.float64)
    np.testing.assert_allclose(p, reference_probabilities(np.float32(m), s), atol=1e-5)
    np.testing.assert_allclose(p.sum(), min(s, np.count_nonzero(m)), rtol=1e-5)
    # KKT: saturated atoms are at least as large as any unsaturated one, and the
    # unsaturated ones share one ratio p_i / m_i.
    live = (p > 0) & (p < 1 - 1e-6)
    if live.any():
        ratios = p[live] / m[live]
        np.testing.assert_allclose(ratios, ratios[0], rtol=1e-4)
        assert m[p >= 1 - 1e-6].min(initial=np.inf) >= m[live].max() * (1 - 1e-5)
    # No random feasible p has a smaller variance sum m^2 / p.
    rng = np.random.default_rng(0)
    nz = m > 0
    best = np.sum(m[nz] ** 2 / p[nz])
    for _ in range(50):
        q = rng.random(nz.sum()) + 1e-3
        q = np.minimum(q * p[nz].sum() / q.sum(), 1.0)
        if abs(q.sum() - p[nz].sum()) < 1e-9:
            assert np.sum(m[nz] ** 2 / q) >= best * (1 - 1e-6)


def atomo_variance(x, s):
    p = reference_probabilities(np.abs(x), s)
    return np.where(p > 0, x**2 * (1 / np.where(p > 0, p, 1) - 1), 0.0)


@given(x=vectors(), s=st.sampled_from([2.0, 7.5, 20.0]))
def test_entrywise_unbiased_with_exact_variance(x, s):
    comp = compjax.atomo(s)
    var = atomo_variance(np.float32(x).astype(np.float64), s)
    assert var.sum() <= comp.omega(len(x)) * np.sum(x**2) * (1 + 1e-6)
    draws = draw(comp, jnp.asarray(x, jnp.float32))
    assert_unbiased(draws, x, var)
    assert_mean_error(draws, x, var.sum())


def test_entrywise_omega_attained_at_equal_magnitudes():
    x = np.where(np.arange(32) % 2, -1.0, 1.0)
    comp = compjax.atomo(4.0)
    np.testing.assert_allclose(atomo_variance(x, 4.0).sum(), comp.omega(32) * 32)
    assert_mean_error(draw(comp, jnp.asarray(x, jnp.float32)), x, comp.omega(32) * 32)


@pytest.mark.parametrize("which", ["terngrad", "qsgd"])
def test_special_cases_reproduce_terngrad_and_qsgd(which):
    """Budget ||x||_1/||x||_inf gives TernGrad's variance, ||x||_1/||x||_2 QSGD's (s=1)."""
    x = np.asarray(np.float32(np.linspace(-1.0, 2.0, 32) ** 3), np.float64)
    norm = np.abs(x).max() if which == "terngrad" else np.linalg.norm(x)
    s = float(np.abs(x).sum() / norm)
    expected = terngrad_variance(x) if which == "terngrad" else qsgd_variance(x, 1)
    np.testing.assert_allclose(atomo_variance(x, s), expected, rtol=1e-4, atol=1e-9)
    assert_mean_error(draw(compjax.atomo(s), jnp.asarray(x, jnp.float32)), x, expected.sum())


def test_svd_atoms_unbiased_with_exact_variance():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 6)) @ np.diag([5, 3, 2, 1, 0.5, 0.1]) @ rng.standard_normal((6, 6))
    x = np.asarray(np.float32(x), np.float64)
    sigma = np.linalg.svd(x, compute_uv=False)
    p = reference_probabilities(sigma, 2.5)
    var = np.sum(sigma**2 * (1 / p - 1))
    comp = compjax.atomo_svd(2.5)
    assert var <= comp.omega_for_shape(x.shape) * np.sum(x**2)
    draws = draw(comp, jnp.asarray(x, jnp.float32), n=4000)
    mean_err = draws.mean(0) - x.reshape(-1)
    # Bias: the squared error of the mean is the variance over n, not more.
    assert np.sum(mean_err**2) < 3 * var / 4000
    assert_mean_error(draws, x, var)


def test_svd_atoms_exact_for_low_rank():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 2)) @ rng.standard_normal((2, 6))
    y = compjax.atomo_svd(2.0)(jnp.zeros(2, jnp.uint32), jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_svd_atoms_beat_entries_at_equal_bits_on_low_rank():
    """Per expected bit, SVD atoms have lower variance on a low-rank-ish matrix."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 3)) @ rng.standard_normal((3, 32)) + 0.05 * rng.standard_normal(
        (32, 32)
    )
    svd = compjax.atomo_svd(3.0)
    entries = compjax.atomo(svd.expected_bits(x.shape) / 64)
    sigma = np.linalg.svd(x, compute_uv=False)
    svd_var = np.sum(sigma**2 * (1 / reference_probabilities(sigma, 3.0) - 1))
    entry_var = atomo_variance(x.reshape(-1), entries.budget).sum()
    assert svd_var < entry_var


def test_bad_budget():
    for bad in (0, -1.0, float("nan"), "3"):
        with pytest.raises(ValueError, match="budget"):
            compjax.atomo(bad)
        with pytest.raises(ValueError, match="budget"):
            compjax.atomo_svd(bad)


SVD_FORMS = {
    "eager": lambda comp, keys, x: np.stack([np.asarray(comp(k, x)) for k in keys[:2]]),
    "jit": lambda comp, keys, x: np.stack([np.asarray(jax.jit(comp)(k, x)) for k in keys[:2]]),
    "jit(vmap)": lambda comp, keys, x: np.asarray(
        jax.jit(jax.vmap(comp, in_axes=(0, None)))(keys, x)
    ),
}


@pytest.mark.parametrize("form", sorted(SVD_FORMS))
@pytest.mark.parametrize(
    ("shape", "value", "dtype"),
    [((7,), 3e38, jnp.float32), ((3, 5), 2e38, jnp.float32), ((3, 5), -3e38, jnp.bfloat16)],
)
def test_svd_atoms_of_entries_near_the_float32_limit_decode_to_them(form, shape, value, dtype):
    """A rank-1 input has one atom, kept w.p. 1 at ``s = 1``: the decode is the input.

    ``sigma_1`` (``sqrt(7) * 3e38``) is beyond float32; the scale is split between the
    sent scale and the right vector, and the decode rebuilds entries near the limit.
    """
    x = jnp.full(shape, value, dtype)
    keys = jax.random.split(jax.random.key(5), 4)
    with pytest.warns(UnbiasedRangeWarning) if form == "eager" else nullcontext():
        out = SVD_FORMS[form](compjax.atomo_svd(1.0), keys, x)
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out))
    # float32: the SVD's rounding; bfloat16: the decode rounds back to the input's value.
    rtol = 2e-6 if dtype == jnp.float32 else 0.0
    np.testing.assert_allclose(out, np.asarray(x, np.float64)[None].repeat(len(out), 0), rtol=rtol)


def test_svd_atoms_scale_by_powers_of_two_exactly():
    """The payload of ``x 2**k`` is that of ``x`` with scales (or right vectors) times
    ``2**k``, and its decode ``2**k`` times ``x``'s, up to the float32 limit: a Gaussian
    64 x 128 matrix of standard deviation 1e36 used to decode to Inf and NaN."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    comp = compjax.atomo_svd(1.0)
    fn = jax.jit(comp)
    key = jax.random.key(7)
    base = np.asarray(fn(key, x), np.float64)
    assert np.all(np.isfinite(base)) and np.any(base)
    for k in (-100, 60, 100, 119):
        big = np.asarray(fn(key, x * np.float32(2.0**k)), np.float64)
        np.testing.assert_array_equal(big, base * 2.0**k)


def test_svd_atoms_beyond_float32_saturate():
    """At ``s = 1/2`` a rank-1 atom of 3e38 entries is sent w.p. 1/2 as 6e38 entries: they
    saturate at float32's largest value (biased, as the range warning says), never Inf."""
    x = jnp.full((7,), 3e38, jnp.float32)
    comp = compjax.atomo_svd(0.5)
    with pytest.warns(UnbiasedRangeWarning, match="saturates"):
        comp.compress(jax.random.key(0), x)
    outs = np.asarray(
        jax.jit(jax.vmap(comp, in_axes=(0, None)))(jax.random.split(jax.random.key(8), 64), x)
    )
    kept = np.any(outs != 0, axis=1)
    assert 0 < kept.sum() < 64
    np.testing.assert_array_equal(outs[kept], np.finfo(np.float32).max)
    np.testing.assert_array_equal(outs[~kept], 0.0)
