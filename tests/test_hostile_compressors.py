"""Hostile inputs for single compressors: non-finite entries stay visible, values near a
dtype's largest finite value stay unbiased where the documented range says so."""

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax
from compjax.compressor import UnbiasedRangeWarning

# --- top_k(select="threshold"): a NaN or an infinity is always sent -----------------------

THRESHOLD_SIZES = (5, 13, 64, 1000, 4099)


@partial(jax.jit, static_argnums=0)
def _decode_each(comp, xs):
    return jax.vmap(lambda x: comp(None, x))(xs)


def _with_bad(d: int, bad: float) -> np.ndarray:
    """Rows of ``linspace(0.1, 1, d)``, row ``j`` with ``bad`` at one position (first, a
    third, last; two of them in the last row)."""
    base = np.linspace(0.1, 1.0, d).astype(np.float32)
    positions = sorted({0, d // 3, d - 1})
    rows = np.repeat(base[None], len(positions) + 1, 0)
    for j, pos in enumerate(positions):
        rows[j, pos] = bad
    rows[-1, [0, d - 1]] = bad
    return rows


@pytest.mark.parametrize("ratio", [0.1, 0.5])
@pytest.mark.parametrize("d", THRESHOLD_SIZES)
def test_threshold_top_k_sends_nan_and_inf_at_every_size(d, ratio):
    """A NaN reaches every threshold (as on the mask words), so it is sent whatever the size
    and position: before, the full-pass selection compared ``|x| >= t``, false for NaN, and
    46 of 80 (ratio, size, position) cases decoded finite.  Checked under ``jit(vmap)`` over
    inputs (the selection's ``lax.cond``s become selects) and eagerly on one input."""
    comp = compjax.top_k(ratio=ratio, select="threshold")
    for bad in (np.nan, np.inf, -np.inf):
        rows = _with_bad(d, bad)
        outs = np.asarray(_decode_each(comp, jnp.asarray(rows)))
        for row, out in zip(rows, outs, strict=True):
            hit = ~np.isfinite(row)
            # Every non-finite entry is sent as itself (k >= 2 here, or the one kept is it).
            sent = np.isnan(out[hit]) if np.isnan(bad) else out[hit] == bad
            assert sent.sum() >= min(hit.sum(), comp.k_for(d)), (d, ratio, bad, row, out)
        eager = np.asarray(comp(None, jnp.asarray(rows[0])))
        np.testing.assert_array_equal(eager, outs[0])


def test_threshold_top_k_keeps_finite_selections():
    """On finite input the selection is unchanged: ``not |x| < t`` is ``|x| >= t``; the
    threshold keeps between ``k_lo`` and ``k_hi`` of the largest entries."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4099), jnp.float32)
    comp = compjax.top_k(ratio=0.1, select="threshold")
    out = np.asarray(comp(None, x))
    kept = np.flatnonzero(out)
    lo, hi = comp.count_band(4099)
    assert lo <= kept.size <= hi
    mags = np.abs(np.asarray(x))
    assert mags[kept].min() >= np.delete(mags, kept).max()
    np.testing.assert_array_equal(out[kept], np.asarray(x)[kept])


# --- chain(rand_k, natural) in float16: the range of unbiasedness ----------------------

CHAIN_DRAWS = 40_000


@partial(jax.jit, static_argnums=(0, 2))
def _chain_mean(comp, x, n):
    keys = jax.random.split(jax.random.key(11), n)
    per_draw = jax.vmap(lambda k: jnp.mean(comp(k, x).astype(jnp.float32)))(keys)
    return jnp.mean(per_draw), jnp.std(per_draw)


def test_chain_of_rand_k_and_natural_states_its_float16_range():
    """Natural rounds ``|x|`` up to at most ``2|x|``, random-k rescales by ``d/k``: 13
    entries of 3e4 (``k = 6``) need ``32768 * 13/6 = 70997`` > 65504, which saturates: the
    mean was 27898 over 200,000 draws (z = -109) without a warning.  The chain's range is
    ``max k/d / 2`` (15116 here): an input above it warns, one below it is unbiased
    (z-tests at 5 standard errors, false alarm 6e-7)."""
    comp = compjax.chain(compjax.rand_k(ratio=0.5), compjax.natural())
    assert comp.unbiased_range(13, jnp.float16) == pytest.approx(65504 * 6 / 13 / 2)
    assert comp.unbiased_range(64, jnp.float16) == pytest.approx(65504 / 4)
    n = CHAIN_DRAWS
    inside = jnp.full((13,), 15000.0, jnp.float16)
    beyond = jnp.full((13,), 3e4, jnp.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp.compress(jax.random.key(0), inside)
    with pytest.warns(UnbiasedRangeWarning, match="range of unbiasedness 1.512e"):
        comp.compress(jax.random.key(0), beyond)
    for x, biased in ((inside, False), (beyond, True)):
        mean, std = (float(v) for v in _chain_mean(comp, x, n))
        z = (mean - float(x[0])) / (std / np.sqrt(n))
        assert (z < -5) if biased else (abs(z) < 5), (float(x[0]), mean, z)


# --- chunked_top_k: a leaf smaller than a chunk has narrower positions -----------------


@pytest.mark.parametrize(("d", "width"), [(15, 4), (200, 8), (5000, 16)])
def test_chunked_top_k_positions_of_a_small_leaf_are_narrower(d, width):
    """An array of ``d < chunk`` entries is one chunk of ``d``: ``min(k, d)`` positions of
    the packable width holding ``d - 1``; ``bits`` is the payload's, to the bit."""
    comp = compjax.chunked_top_k(k=32, chunk=4096, bits=2)
    x = jnp.asarray(np.random.default_rng(d).standard_normal(d), jnp.float32)
    payload = jax.jit(comp.compress)(None, x)
    chunks, kept = -(-d // 4096), min(32, d)
    sent = chunks * kept
    words = lambda n, w: -(-n * w // 32) * 32 if w < 8 else n * w  # noqa: E731
    expected = words(sent, width) + words(sent, 2) + 32 * 4
    assert comp.bits(x.shape) == compjax.wire_bits(payload) == expected


# --- int_quant(rotate=True) near the largest finite value ------------------------------

ROT_DRAWS = 20_000


@partial(jax.jit, static_argnums=(0, 2))
def _per_draw_means(comp, x, n):
    keys = jax.random.split(jax.random.key(12), n)
    # The mean as a sum of entries / 64 (exact): a float32 sum of 64 entries of 4e37 is Inf.
    return jax.vmap(lambda k: jnp.sum(comp(k, x).astype(jnp.float32) / 64))(keys)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_rotated_int_quant_is_unbiased_up_to_its_range_near_the_max(dtype):
    """``int_quant(8, rotate=True)`` on 64 entries: a decode is within ``(1 + 64/127)
    max|x|``, so the range is ``max / 1.504`` (float16: 43555, two thirds of 65504; it was
    ``max/64``; bfloat16 keeps float32's ``max/64``, where the transform's sums stay
    finite).  At 0.99 of it the mean of 20,000 draws is within 5 standard errors of x
    (false alarm 6e-7); float16's 65504 warns and averages low (decodes past 65504
    saturate: 0.34% low, z far below -5)."""
    comp = compjax.int_quant(8, rotate=True)
    bound = comp.unbiased_range(64, dtype)
    top = float(jnp.finfo(dtype).max)
    want = min(top / (1 + 64 / 127), float(np.finfo(np.float32).max) / 64)
    assert bound == pytest.approx(want)
    inside = jnp.full((64,), 0.99 * bound, dtype).at[::3].multiply(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp.compress(jax.random.key(0), inside)
    means = np.asarray(_per_draw_means(comp, inside, ROT_DRAWS), np.float64)
    z = (means.mean() - float(np.mean(np.asarray(inside, np.float64)))) / (
        means.std() / np.sqrt(ROT_DRAWS)
    )
    assert abs(z) < 5, z
    if dtype == jnp.float16:
        at_max = jnp.full((64,), top, dtype)
        with pytest.warns(UnbiasedRangeWarning):
            comp.compress(jax.random.key(0), at_max)
        means = np.asarray(_per_draw_means(comp, at_max, ROT_DRAWS), np.float64)
        assert (means.mean() - top) / (means.std() / np.sqrt(ROT_DRAWS)) < -5
