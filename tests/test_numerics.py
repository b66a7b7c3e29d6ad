"""Numerics at the edges: entries near the float32 limit, exact grids, bf16 and fp16.

Means are checked against the input with the draws' own per-entry variance
(fixed seeds): the chi-square statistic of the standardised mean errors stays
below its ``1 - 1e-6`` quantile, and entries whose draws never vary must equal
the input exactly.  Each test also runs its check on a slightly wrong
answer (a constant off by a part in 2^8 or less) and requires it to fail, so
the checks are sharp enough to catch a bias of that size.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import apply, draw
from scipy import stats

import compjax
from compjax import numerics


def assert_mean_is(draws, x, atol=0.0, p=1e-6):
    """``E draws = x``: a chi-square test where draws vary, equality (to ``atol``) where not."""
    x = np.broadcast_to(np.asarray(x, np.float64).reshape(-1), draws.shape[1:])
    n = draws.shape[0]
    var = draws.var(axis=0, ddof=1)
    fixed = var == 0
    off = np.abs(draws[0, fixed] - x[fixed])
    assert np.all(off <= atol), f"constant entries off by {off.max():.3g} (atol {atol:.3g})"
    random = ~fixed
    if random.any():
        err = np.abs(draws[:, random].mean(0) - x[random])
        z = np.maximum(err - atol, 0.0) / np.sqrt(var[random] / n)
        chi2 = float(np.sum(z**2))
        bound = float(stats.chi2.isf(p, int(random.sum())))
        assert chi2 < bound, f"mean is off: chi2={chi2:.1f} > {bound:.1f} (dof {random.sum()})"


def assert_sharp(check, draws, x, factors=(1 - 2**-8, 1 + 2**-8)):
    """``check`` rejects the draws scaled by each of ``factors`` (a wrong constant)."""
    for factor in factors:
        with pytest.raises(AssertionError):
            check(draws * factor, x)


# -- entries near the float32 limit (above 2**126) -------------------------

HUGE = np.array([1e38, -1e38, 5e37, 3.0, -2e37, 7e36, 0.0, 1e-3], np.float32)
MIXED = np.array([1e38, 1e-3, -1e-3, 1e38, -1e38, 2e-3, 0.0, 1e-3], np.float32)
# Bernoulli probabilities below 2^-32 are 0: an entry that small relative to
# the level gap (at most max|x| sqrt(8) / 4 here) may be lost.  Allowed as
# absolute error, relative to max|x|.
REACH = 2.0**-30


@pytest.mark.parametrize(
    "comp",
    [
        compjax.qsgd(4),
        compjax.qsgd(4, bucket_size=3),
        compjax.terngrad(),
        compjax.blockwise(compjax.terngrad(), 4),
        compjax.natural(),
        compjax.atomo(budget=3.0),
        compjax.rand_k(k=3),
    ],
    ids=repr,
)
def test_huge_entries_stay_unbiased(comp):
    for seed, x in enumerate((HUGE, MIXED)):
        draws = draw(comp, jnp.asarray(x), n=4000, seed=seed)
        atol = REACH * float(np.abs(x).max())
        assert_mean_is(draws, x, atol)
        assert_sharp(partial(assert_mean_is, atol=atol), draws, x, (0.9, 1.1))


@pytest.mark.parametrize(
    "comp, x, expect",
    [
        # A single nonzero entry is the norm: level s with probability 1.
        (compjax.qsgd(4), [0.0, 1e38, 0.0, 0.0], [0.0, 1e38, 0.0, 0.0]),
        # Equal magnitudes: TernGrad keeps every entry.
        (compjax.terngrad(), [1e38, -1e38, 1e38, 1e38], [1e38, -1e38, 1e38, 1e38]),
        (compjax.terngrad(clip=2.5), [1e38, -1e38, 1e38, 1e38], [1e38, -1e38, 1e38, 1e38]),
        # sum |x| overflows float32: the two-pass mean of |x| is 2e38.
        (compjax.scaled_sign(), [3e38, -3e38, 2e38, 1.0], [2e38, -2e38, 2e38, 2e38]),
        (compjax.scaled_sign(), [1e38, -1e38, 1e38, -1e38], [1e38, -1e38, 1e38, -1e38]),
        # One rank-1 atom, kept with probability 1.
        (compjax.atomo_svd(budget=1.0), [1e38, 1e38, -1e38, -1e38], [1e38, 1e38, -1e38, -1e38]),
    ],
    ids=lambda v: repr(v) if isinstance(v, compjax.Compressor) else "",
)
def test_huge_entries_decode_to_the_right_values(comp, x, expect):
    x = jnp.asarray(x, jnp.float32).reshape(2, 2)
    for seed in range(3):
        y = np.asarray(apply(comp, jax.random.key(seed), x), np.float64).reshape(-1)
        np.testing.assert_allclose(y, np.asarray(expect, np.float32), rtol=1e-6)


def test_scaling_helpers_are_exact_at_the_limits():
    from compjax import numerics

    m = jnp.array([3.4e38, 1e38, 2.0**126, 1.0, 1.5e-38, 0.0], jnp.float32)
    e, unit = jax.jit(numerics.unit_scale)(m)
    np.testing.assert_array_equal(np.asarray(e), [126, 126, 126, 0, -126, 0])
    np.testing.assert_array_equal(np.asarray(unit), np.asarray(m) * np.exp2(-np.asarray(e)))
    q = jax.jit(numerics.divide)(jnp.array([1e38, 3.0, 0.0, 5.0]), jnp.array([2e38, 3.0, 1e38, 0]))
    np.testing.assert_allclose(np.asarray(q), [0.5, 1.0, 0.0, 0.0], rtol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_widen_is_astype_for_every_16_bit_code(dtype):
    """``numerics.widen`` (bfloat16 by a shift) gives ``astype(float32)``'s bits for all
    65,536 codes: zeros, subnormals, the largest values, Inf and NaN payloads."""
    every = jnp.arange(2**16, dtype=jnp.uint32).astype(jnp.uint16)
    codes = jax.lax.bitcast_convert_type(every, dtype)
    wide = jax.jit(numerics.widen)(codes)
    assert wide.dtype == jnp.float32
    bits = partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint32)
    expected = bits(codes.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(bits(wide)), np.asarray(expected))


# -- inputs on the quantisation grid decode exactly -------------------------

# fl(41 * fl(1/41)) != 1 in float32: a reciprocal of the bucket's max is off.
GRID = np.array([41, 41, -41, 41, 0, 0, 0, -41, 0, 0, 0, 0, 0, 0, 0], np.float32)


@pytest.mark.parametrize(
    "comp", [compjax.qsgd(4, bucket_size=5), compjax.qsgd(2), compjax.qsgd(8)], ids=repr
)
def test_entries_on_the_grid_decode_exactly(comp):
    """Buckets of 4 equal magnitudes (|x|/norm = 1/2) or one entry (|x| = norm)."""
    x = GRID if comp.bucket_size else GRID[:4]
    draws = draw(comp, jnp.asarray(x), n=512)
    np.testing.assert_array_equal(draws, np.broadcast_to(x, draws.shape))


# -- bfloat16 and float16 stay unbiased -------------------------------------

RNG = np.random.default_rng(5)
VEC16 = RNG.standard_normal(16)
VEC64 = RNG.standard_normal(64)


def low_precision_cases():
    bf16, f16 = jnp.bfloat16, jnp.float16
    return {
        # The audit's case: norm 1.0039 rounds to 1.0 in bfloat16.
        "qsgd(1) bf16 [1, 0.0884]": (compjax.qsgd(1), [1.0, 0.0884], bf16),
        "qsgd(1) f16 [1, 0.0884]": (compjax.qsgd(1), [1.0, 0.0884], f16),
        # The norm, 120000, saturates at 65504 in float16.
        "qsgd(1) f16 [60000]*4": (compjax.qsgd(1), [60000.0] * 4, f16),
        "qsgd(4) bf16 normal": (compjax.qsgd(4), VEC16, bf16),
        "qsgd(4, bucket_size=5) f16 normal": (compjax.qsgd(4, bucket_size=5), VEC16 * 1e3, f16),
        "qsgd(100) bf16 normal": (compjax.qsgd(100), VEC16, bf16),
        "terngrad() bf16 normal": (compjax.terngrad(), VEC16, bf16),
        "terngrad() f16 normal": (compjax.terngrad(), VEC16 * 1e4, f16),
        "natural() bf16 normal": (compjax.natural(), VEC16 * 1e30, bf16),
        # float16's top binade: 2^16 decodes to 65504.
        "natural() f16 top binade": (compjax.natural(), [65504, -65000, 40000, 3.0], f16),
        # Levels norm * 2^-k off the bf16 grid: bracketed as decoded.
        "natural_dithering(3) bf16 [1, 0.0884]": (
            compjax.natural_dithering(3),
            [1.0, 0.0884],
            bf16,
        ),
        "natural_dithering(4) f16 normal": (compjax.natural_dithering(4), VEC16 * 1e3, f16),
        # The rotated decode rounded onto the grid at random.
        # (64 entries: d' <= 64, so an exact Haar rotation, unbiased at every size.)
        "eden() bf16 normal": (compjax.eden(), VEC64, bf16),
        "eden(bits=2) f16 normal": (compjax.eden(bits=2), VEC64 * 1e3, f16),
    }


LOW = low_precision_cases()


#: The audit's cases and one per compressor family in the fast suite; the rest in make test-slow
#: (EDEN's 64-entry Haar rotation, 27 s, is tested unbiased at every size in test_eden).
LOW_FAST = {
    "qsgd(1) bf16 [1, 0.0884]",
    "qsgd(1) f16 [60000]*4",
    "terngrad() bf16 normal",
    "natural() f16 top binade",
    "natural_dithering(3) bf16 [1, 0.0884]",
}


@pytest.mark.parametrize(
    "name", [n if n in LOW_FAST else pytest.param(n, marks=pytest.mark.slow) for n in LOW]
)
def test_unbiased_in_low_precision(name):
    comp, x, dtype = LOW[name]
    x = jnp.asarray(x, dtype)
    draws = draw(comp, x, n=100_000, seed=1)
    exact = np.asarray(x, np.float64)
    assert_mean_is(draws, exact)
    assert_sharp(assert_mean_is, draws, exact)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize(
    "comp", [compjax.rand_k(k=5), compjax.rand_k(k=5, shared_seed=True)], ids=repr
)
def test_rand_k_rescaled_values_are_unbiased_in_low_precision(comp, dtype):
    """Given that entry i is kept, its decode averages to ``x_i d/k`` (d/k = 3.2 is not
    exact in bf16/fp16); a kept value's only noise is the choice between two decodes at
    most 3 ulps apart."""
    x = jnp.asarray(VEC16, dtype)
    draws = draw(comp, x, n=20_000, seed=2)
    target = np.asarray(x, np.float64) * 16 / 5
    ulp = np.spacing(np.abs(target).astype(dtype)).astype(np.float64)
    for i in range(16):
        kept = draws[draws[:, i] != 0, i][:, None]
        assert len(kept) > 4000
        assert np.ptp(kept) <= 3 * ulp[i]
        assert_mean_is(kept, target[i])
        assert_sharp(assert_mean_is, kept, target[i], (1 - 2**-10, 1 + 2**-10))


def test_float16_saturation_is_documented_bias():
    """rand_k's rescaled value beyond 65504 saturates (documented: unbiased only below)."""
    x = jnp.asarray([30000.0, 0.0, 0.0, 0.0], jnp.float16)
    draws = draw(compjax.rand_k(k=1), x, n=2000)
    assert set(np.unique(draws[:, 0])) == {0.0, 65504.0}  # 4 * 30000 = 120000 saturates


@partial(jax.jit, static_argnums=(0, 2))
def _qsgd_bracket(comp, x, dtype):
    """QSGD's bracket on ``x`` (one bucket) and the decoded values of its two levels."""
    norm = compjax.compressor.safe_norm(x)
    mag = jnp.abs(x)
    lo, hi, p = comp.bracket(mag, norm, dtype)
    return mag, lo, hi, p, comp.grid(norm, lo, dtype), comp.grid(norm, hi, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("levels", [1, 3, 4, 7, 16, 41, 1000, 12345])
def test_qsgd_brackets_each_entry_between_neighbouring_decoded_levels(levels, dtype):
    """``V(lo) <= |x| <= V(lo + 1)`` and ``V(lo) + p (V(hi) - V(lo)) = |x|``: the expected
    decode is exactly ``|x|``, on inputs with ties, near-grid values and wide ranges."""
    comp = compjax.qsgd(levels)
    rng = np.random.default_rng(levels)
    for trial in range(6):
        x = rng.standard_normal(64) * 10.0 ** rng.integers(-3, 4)
        if trial % 2:
            x = rng.choice([-1.5, 0.25, 1.0, 41.0], 64) * 10.0 ** rng.integers(-3, 3)
        x = jnp.asarray(jnp.asarray(x, dtype), jnp.float32)
        mag, lo, hi, p, v_lo, v_hi = map(np.asarray, _qsgd_bracket(comp, x, dtype))
        assert np.all((hi - lo == 1) | ((hi == lo) & (lo == levels)))
        assert np.all((v_lo <= mag) & (mag <= v_hi) & (p >= 0) & (p <= 1))
        mean = v_lo.astype(np.float64) + p * (v_hi.astype(np.float64) - v_lo)
        np.testing.assert_allclose(mean, mag, rtol=1e-6, atol=0)


@pytest.mark.parametrize("levels", [4, 16, 4096])
def test_qsgd_brackets_entries_of_a_tiny_norm(levels):
    """A norm a few times float32's smallest normal (``2**-126``, about ``1.2e-38``):
    neighbouring levels lie closer than it, and their gap, unscaled, flushed to 0
    (``p = Inf``: the upper level always).  The bracket holds and its expected decode
    is ``|x|``."""
    comp = compjax.qsgd(levels)
    rng = np.random.default_rng(levels)
    for trial in range(4):
        x = rng.standard_normal(4096) * 10.0 ** -rng.integers(37, 39)
        if trial % 2:  # a few entries, all normal, for a norm below levels * 2**-126
            x = np.zeros(4096)
            x[rng.integers(0, 4096, 3)] = rng.uniform(1.2e-38, 1.5e-38 * levels, 3)
        x = jnp.asarray(x, jnp.float32)
        mag, _, _, p, v_lo, v_hi = map(np.asarray, _qsgd_bracket(comp, x, jnp.float32))
        mag = np.where(mag < np.finfo(np.float32).tiny, 0.0, mag)  # a CPU flushes subnormals
        assert np.all((v_lo <= mag) & (mag <= v_hi) & (p >= 0) & (p <= 1))
        mean = v_lo.astype(np.float64) + p * (v_hi.astype(np.float64) - v_lo)
        np.testing.assert_allclose(mean, mag, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_atomo_rescaled_values_are_unbiased_in_low_precision(dtype):
    """Given that entry i is kept, its decode averages to ``x_i / p_i`` (rounded at random
    onto the dtype's grid, not to the nearest value)."""
    from compjax.compressors.atomo import water_fill

    x = jnp.asarray(VEC16, dtype)
    p = np.asarray(water_fill(jnp.abs(x.astype(jnp.float32)), 8.0), np.float64)
    draws = draw(compjax.atomo(budget=8.0), x, n=20_000, seed=3)
    target = np.asarray(x, np.float64) / p
    for i in range(16):
        kept = draws[draws[:, i] != 0, i][:, None]
        assert len(kept) > 1000
        assert_mean_is(kept, target[i])
        assert_sharp(assert_mean_is, kept, target[i], (1 - 2**-10, 1 + 2**-10))


# Relative half-ulp of the normal range: the decoded levels' rounding.
HALF_ULP = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}


def qsgd_low_precision_omega(comp, d, dtype):
    """QSGD's documented variance constant in bf16/fp16 (decoded levels in the normal range):
    ``omega(d) + eps (1 + eps) sqrt(d) / s + eps^2``, eps the dtype's relative half-ulp."""
    eps = HALF_ULP[dtype]
    return comp.omega(d) + eps * (1 + eps) * np.sqrt(d) / comp.levels + eps**2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_qsgd_low_precision_variance_bound(dtype):
    """The exact variance ``sum (V(hi) - |x|)(|x| - V(lo))`` from the bracket stays within
    the documented constant, and exceeds the float32 ``omega`` somewhere (so the extra
    term is needed, and the check is sharp)."""
    rng = np.random.default_rng(7)
    worst_ratio = 0.0
    for levels in (1, 2, 4, 100):
        comp = compjax.qsgd(levels)
        for trial in range(8):
            x = rng.standard_normal(64) * 10.0 ** rng.integers(-1, 2)
            if trial % 2:
                x = np.full(64, 3.0) + rng.standard_normal(64) * 0.01 * (trial % 3)
            x = jnp.asarray(jnp.asarray(x, dtype), jnp.float32)
            mag, _, _, _, v_lo, v_hi = map(np.asarray, _qsgd_bracket(comp, x, dtype))
            mag, v_lo, v_hi = (a.astype(np.float64) for a in (mag, v_lo, v_hi))
            var = np.sum((v_hi - mag) * (mag - v_lo))
            sq = np.sum(mag**2)
            assert var <= qsgd_low_precision_omega(comp, 64, dtype) * sq * (1 + 1e-6)
            worst_ratio = max(worst_ratio, var / (comp.omega(64) * sq))
    assert worst_ratio > 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
def test_all_finite_is_one_sum_that_keeps_every_inf_and_nan(dtype):
    """``numerics.all_finite`` (``sum(a - a) == 0``) agrees with ``all(isfinite(a))``:
    finite extremes (the dtype's largest values, which a plain sum would overflow,
    subnormals, -0) are finite; one Inf of either sign or one NaN, anywhere, is not."""
    dt = jnp.dtype(dtype)
    top = jnp.iinfo(dt).max if dt.kind == "i" else jnp.finfo(dt).max
    base = jnp.full((3, 1000), top, dt)
    if dt.kind == "f":
        base = base.at[0, :3].set(jnp.array([-0.0, jnp.finfo(dt).smallest_subnormal, -top], dt))
    check = jax.jit(numerics.all_finite)
    assert bool(check(base)) and bool(check(base[:0]))
    if dt.kind == "f":
        for bad in (jnp.inf, -jnp.inf, jnp.nan):
            for where in ((0, 0), (1, 517), (2, 999)):
                assert not bool(check(base.at[where].set(bad)))


def test_all_finite_sums_the_flat_array():
    """The finite check of a matrix reduces its 1-D view (the reshape behind an optimisation
    barrier): over the matrix's shape, inside a training step, XLA's CPU backend split the
    sum into 32 x 32 windows for a slower YNNPACK fusion (``make bench``'s MLP step)."""
    hlo = jax.jit(numerics.all_finite).lower(jax.ShapeDtypeStruct((96, 64), jnp.float32))
    reduces = [ln for ln in hlo.compile().as_text().splitlines() if " reduce(" in ln]
    assert reduces and all("dimensions={0}" in ln for ln in reduces), reduces
