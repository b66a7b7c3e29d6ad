"""The range of unbiasedness (``Compressor.unbiased_range``), tested on both sides.

An unbiased estimate of a large ``x`` may need values beyond the dtype
(``rand_k`` rescales by ``d/k``, natural compression rounds up to the next
power of two, ATOMO sends ``x_i / p_i``); those saturate and are biased.
Inside the range the mean of 4000 draws equals ``x`` (chi-square at
p = 1e-6 with the draws' own variance); just outside it misses by far more
than the test's resolution.  Concrete inputs beyond the range warn.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_unbiased, draw

import compjax
from compjax.compressor import UnbiasedRangeWarning

F32 = float(jnp.finfo(jnp.float32).max)
F16 = float(jnp.finfo(jnp.float16).max)


def test_metadata():
    assert compjax.rand_k(ratio=0.1).unbiased_range(100) == pytest.approx(F32 * 0.1)
    assert compjax.rand_k(k=1).unbiased_range(10, jnp.float16) == pytest.approx(F16 / 10)
    assert compjax.natural().unbiased_range(5) == 2.0**127
    assert compjax.natural().unbiased_range(5, jnp.bfloat16) == 2.0**127
    assert compjax.natural().unbiased_range(5, jnp.float16) == F16
    assert compjax.atomo(4).unbiased_range(7, jnp.float16) == pytest.approx(F16 * 4 / 7)
    assert compjax.atomo(10).unbiased_range(7) == F32
    assert compjax.int_quant(4).unbiased_range(100) == F32
    assert compjax.int_quant(4, rotate=True).unbiased_range(100) == F32 / 128
    assert compjax.qsgd(levels=4).unbiased_range(100, jnp.bfloat16) == float(
        jnp.finfo(jnp.bfloat16).max
    )
    assert compjax.blockwise(compjax.rand_k(k=1), 10).unbiased_range(25) == pytest.approx(F32 / 10)
    # Biased compressors have no range of unbiasedness.
    for comp in (compjax.top_k(k=1), compjax.rand_k(k=1, scaled=False), compjax.scaled_sign()):
        assert comp.unbiased_range(10) is None


def _mean_ratio(comp, x):
    draws = draw(comp, x, n=4000)
    return draws, draws.mean(0) / np.asarray(x, np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_rand_k_both_sides(dtype):
    """``rand_k(k=1)`` on 10 entries: unbiased at 0.99 of ``max/10``, and at ``max/2`` the
    mean is a fifth of ``x`` (each kept value saturates at ``max`` instead of ``5 max``)."""
    comp = compjax.rand_k(k=1)
    bound = comp.unbiased_range(10, dtype)
    inside = jnp.full((10,), 0.99 * bound, dtype).at[3].set(-0.5 * bound)
    draws, _ = _mean_ratio(comp, inside)
    assert_unbiased(draws, np.asarray(inside, np.float64), draws.var(0, ddof=1))
    outside = jnp.full((10,), float(jnp.finfo(dtype).max) / 2, dtype)
    _, ratio = _mean_ratio(comp, outside)
    np.testing.assert_allclose(ratio, 0.2, rtol=0.25)  # 5 standard errors of 4000 draws


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_natural_both_sides(dtype):
    """``1.5 * 2**126`` is unbiased; ``1.5 * 2**127`` (finite) always decodes to ``2**127``."""
    inside = jnp.asarray([1.5 * 2.0**126, -1.25 * 2.0**126, 3.0], dtype)
    draws, _ = _mean_ratio(compjax.natural(), inside)
    assert_unbiased(draws, np.asarray(inside, np.float64), draws.var(0, ddof=1))
    outside = jnp.asarray([1.5 * 2.0**127], dtype)
    _, ratio = _mean_ratio(compjax.natural(), outside)
    np.testing.assert_allclose(ratio, 2 / 3)


def test_atomo_both_sides():
    """``atomo(4)`` on 7 float16 entries keeps each with ``p = 4/7`` and sends ``7x/4``:
    unbiased below ``65504 * 4/7``; at 65504 the sent value saturates (mean ``4/7`` of x)."""
    comp = compjax.atomo(4)
    bound = comp.unbiased_range(7, jnp.float16)
    inside = jnp.full((7,), 0.99 * bound, jnp.float16)
    draws, _ = _mean_ratio(comp, inside)
    assert_unbiased(draws, np.asarray(inside, np.float64), draws.var(0, ddof=1))
    _, ratio = _mean_ratio(comp, jnp.full((7,), F16, jnp.float16))
    np.testing.assert_allclose(ratio, 4 / 7, rtol=0.1)


def test_concrete_inputs_outside_warn_traced_ones_are_not_checked():
    comp, key = compjax.rand_k(ratio=0.1), jax.random.key(0)
    with pytest.warns(UnbiasedRangeWarning, match="exceeds the range of unbiasedness"):
        comp(key, jnp.full((100,), 3e38))  # through compress
    with pytest.warns(UnbiasedRangeWarning):
        compjax.natural().warn_out_of_range(jnp.asarray([3e38, 1.0]))
    with pytest.warns(UnbiasedRangeWarning):
        compjax.atomo(4).warn_out_of_range(jnp.full((7,), 65504.0, jnp.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp.warn_out_of_range(jnp.full((100,), 3e37))  # inside: max * 10/100 = 3.4e37
        compjax.natural().warn_out_of_range(jnp.asarray([jnp.inf, 1.0]))  # non-finite
        compjax.top_k(k=1).warn_out_of_range(jnp.full((10,), 3e38))  # biased: no range
        jax.jit(comp)(key, jnp.full((100,), 3e38))  # traced: not checked


def test_empty_input_keeps_nothing_whatever_k():
    """Documented: an empty input has nothing to keep, so a fixed ``k`` does not apply
    (the one exception to "``k`` larger than ``d`` raises"): empty payload, empty output."""
    empty = jnp.zeros((0,))
    for comp in (compjax.rand_k(k=1), compjax.rand_k(k=3, shared_seed=True), compjax.top_k(k=1)):
        payload = comp.compress(jax.random.key(0), empty)
        assert compjax.wire_bits(payload) == comp.bits((0,)) == 0
        assert comp.decompress(payload).shape == (0,)
    assert compjax.rand_k(k=1).omega(0) == 0.0
    with pytest.raises(ValueError, match="k=2 exceeds the number of entries d=1"):
        compjax.rand_k(k=2).compress(jax.random.key(0), jnp.zeros((1,)))


@pytest.mark.parametrize(
    "comp", [compjax.qsgd(levels=4), compjax.natural_dithering()], ids=["qsgd", "dithering"]
)
def test_saturated_norm_stays_unbiased(comp):
    """13 entries up to 3e38: the norm (5.6e38) saturates at the float32 maximum, which still
    brackets every entry, so the mean of 4000 draws is ``x`` (the range is every finite input)."""
    x = jnp.asarray(np.linspace(-3e38, 3e38, 13), jnp.float32)
    draws = draw(comp, x, n=4000)
    assert np.all(np.isfinite(draws))
    assert_unbiased(draws, np.asarray(x, np.float64), draws.var(0, ddof=1))
    assert comp.unbiased_range(13) == F32
