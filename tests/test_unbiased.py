"""Unbiased compressors: E C(x) = x, the exact variance, and omega attained.

Every test compares Monte Carlo draws (fixed seeds) with the exact
per-entry variance from the paper's formula, computed here in float64
independently of the library:

* the mean is checked by a chi-square test of the standardised errors at
  false-alarm probability 1e-6;
* the mean squared error must match the exact total variance within 5
  standard errors;
* the exact variance must not exceed ``omega(d) ||x||^2``, and on the extremal
  vectors of REFERENCES.md it must equal it, so a wrong constant fails.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_mean_error, assert_unbiased, draw, input_readers
from hypothesis import given
from hypothesis import strategies as st

import compjax

D = 32  # one compiled sampler per compressor


def vectors(d=D):
    """Inputs of several shapes of distribution: dense, heavy-tailed, sparse, tied."""
    return st.builds(_vector, st.integers(0, 2**31), st.sampled_from(range(4)), st.just(d))


def _vector(seed, kind, d):
    rng = np.random.default_rng(seed)
    if kind == 0:
        x = rng.standard_normal(d)
    elif kind == 1:
        x = rng.standard_cauchy(d)
    elif kind == 2:
        x = rng.standard_normal(d) * (rng.random(d) < 0.2)
    else:
        x = rng.choice([-1.5, 0.25, 1.0], size=d)
    return np.asarray(x * 10.0 ** rng.integers(-3, 4), np.float32).astype(np.float64)


# -- exact per-entry variances (float64, from the papers' formulas) ----------


def qsgd_variance(x, s, bucket=None):
    bucket = bucket or len(x)
    var = np.zeros_like(x)
    for start in range(0, len(x), bucket):
        block = x[start : start + bucket]
        norm = np.linalg.norm(block)
        if norm == 0:
            continue
        r = s * np.abs(block) / norm
        p = r - np.floor(r)
        var[start : start + bucket] = (norm / s) ** 2 * p * (1 - p)
    return var


def terngrad_variance(x):
    a = np.abs(x)
    return a * (a.max() - a)


def natural_variance(x):
    a = np.abs(x)
    low = np.exp2(np.floor(np.log2(np.where(a > 0, a, 1.0))))
    return np.where(a > 0, (2 * low - a) * (a - low), 0.0)


def rand_k_variance(x, k):
    return x**2 * (len(x) / k - 1)


CASES = {
    "qsgd(levels=1)": (compjax.qsgd(1), lambda x: qsgd_variance(x, 1)),
    "qsgd(levels=4)": (compjax.qsgd(4), lambda x: qsgd_variance(x, 4)),
    "qsgd(levels=4, bucket_size=5)": (
        compjax.qsgd(4, bucket_size=5),
        lambda x: qsgd_variance(x, 4, 5),
    ),
    "blockwise(qsgd(4), 5)": (
        compjax.blockwise(compjax.qsgd(4), 5),
        lambda x: qsgd_variance(x, 4, 5),
    ),
    "terngrad()": (compjax.terngrad(), terngrad_variance),
    "blockwise(terngrad(), 8)": (
        compjax.blockwise(compjax.terngrad(), 8),
        lambda x: np.concatenate([terngrad_variance(b) for b in np.split(x, D // 8)]),
    ),
    "natural()": (compjax.natural(), natural_variance),
    "rand_k(k=5)": (compjax.rand_k(k=5), lambda x: rand_k_variance(x, 5)),
    "rand_k(k=5, shared_seed=True)": (
        compjax.rand_k(k=5, shared_seed=True),
        lambda x: rand_k_variance(x, 5),
    ),
    "cast('float32')": (compjax.cast("float32"), np.zeros_like),
    "identity()": (compjax.identity(), np.zeros_like),
}


@pytest.mark.parametrize("name", list(CASES))
@given(x=vectors())
def test_unbiased_with_exact_variance_below_omega(name, x):
    comp, variance = CASES[name]
    assert comp.unbiased
    var = variance(x)
    # The formula never exceeds the advertised constant.
    assert var.sum() <= comp.omega(D) * np.sum(x**2) * (1 + 1e-9)
    draws = draw(comp, jnp.asarray(x, jnp.float32))
    assert_unbiased(draws, x, var)
    assert_mean_error(draws, x, var.sum())


def _equal_magnitudes(d):
    return np.where(np.arange(d) % 3 == 0, -1.0, 1.0)


def _terngrad_extremal(d):
    b = 1.0 / (math.sqrt(d) + 1.0)
    return np.concatenate([[1.0], np.full(d - 1, b)])


# (compressor, extremal x, exact variance): the variance equals omega ||x||^2.
TIGHT = {
    # all p_i = 1/2: d = 4 s^2 = 64.
    "qsgd s=4, d=64, all ones": (compjax.qsgd(4), np.ones(64), lambda x: qsgd_variance(x, 4)),
    # s = 1, equal magnitudes: sqrt(d) - 1.
    "qsgd s=1, d=16, equal magnitudes": (
        compjax.qsgd(1),
        _equal_magnitudes(16),
        lambda x: qsgd_variance(x, 1),
    ),
    # d < 4 s^2 with every p_i = 1/2: 4 s^2 = 16 = 7 * 1 + 9 (seven y=1/2, one y=3/2).
    "qsgd s=2, d=8, mixed half-integers": (
        compjax.qsgd(2),
        np.array([1, 1, 1, 1, 1, 1, 1, 3], np.float64),
        lambda x: qsgd_variance(x, 2),
    ),
    "terngrad (1, b, ..., b), d=64": (
        compjax.terngrad(),
        _terngrad_extremal(64),
        terngrad_variance,
    ),
    "natural at (4/3) 2^a": (
        compjax.natural(),
        (4.0 / 3.0) * np.exp2(np.arange(-20, 20, dtype=np.float64)),
        natural_variance,
    ),
    "rand_k(k=3), d=40": (
        compjax.rand_k(k=3),
        np.linspace(-2.0, 3.0, 40),
        lambda x: rand_k_variance(x, 3),
    ),
}


@pytest.mark.parametrize("name", list(TIGHT))
def test_omega_is_attained(name):
    comp, x, variance = TIGHT[name]
    x = np.asarray(np.float32(x), np.float64)
    var = variance(x)
    bound = comp.omega(len(x)) * np.sum(x**2)
    np.testing.assert_allclose(var.sum(), bound, rtol=1e-5)
    draws = draw(comp, jnp.asarray(x, jnp.float32), n=8000)
    assert_unbiased(draws, x, var)
    assert_mean_error(draws, x, bound)


def test_qsgd_omega_formula():
    # Regimes of the exact supremum; both below Lemma 3.1's min(d/s^2, sqrt(d)/s).
    assert compjax.qsgd_omega(64, 4) == 1.0
    assert compjax.qsgd_omega(16, 1) == 3.0
    assert compjax.qsgd_omega(8, 2) == 0.5
    for d in (1, 7, 64, 1000, 10**6):
        for s in (1, 2, 4, 16, 256):
            assert compjax.qsgd_omega(d, s) <= min(d / s**2, math.sqrt(d) / s) + 1e-12


def test_terngrad_omega_formula():
    for d in (1, 4, 64, 1000):
        x = _terngrad_extremal(d)
        omega_x = np.abs(x).max() * np.abs(x).sum() / np.sum(x**2) - 1
        np.testing.assert_allclose(omega_x, compjax.terngrad_omega(d), rtol=1e-12)


def test_natural_keeps_powers_of_two():
    x = np.exp2(np.arange(-126, 128, dtype=np.float64)) * np.where(np.arange(254) % 2, -1, 1)
    draws = draw(compjax.natural(), jnp.asarray(x, jnp.float32), n=64)
    np.testing.assert_array_equal(draws, np.broadcast_to(x, draws.shape))


def test_natural_is_unbiased_on_subnormals():
    x = np.array([1e-40, -3e-39, 2.0**-130, 5e-45], np.float32).astype(np.float64)
    var = x * (2.0**-126 - np.abs(x)) * np.sign(x)
    draws = draw(compjax.natural(), jnp.asarray(x, jnp.float32), n=20000)
    assert set(np.unique(np.abs(draws))) <= {0.0, 2.0**-126}
    assert_unbiased(draws, x, np.abs(var))


def test_natural_wire_is_the_float32_exponent():
    x = jnp.array([3.0, -0.75, 0.0, 1.0])
    payload = compjax.natural().compress(jax.random.key(7), x)
    # Four exponent fields to a uint32 word and 32 signs to another, first entry lowest.
    assert payload.wire["exponents"].dtype == jnp.uint32
    assert payload.wire["signs"].dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(payload.wire["signs"]), [0b0010])
    (word,) = np.asarray(payload.wire["exponents"]).astype(int)
    exps = [(word >> (8 * k)) & 0xFF for k in range(4)]
    assert exps[0] - 127 in (1, 2) and exps[1] - 127 in (-1, 0) and exps[3] == 127
    assert exps[2] == 0
    assert compjax.wire_bits(payload) == 2 * 32 == compjax.natural().bits(x.shape)


def test_natural_wire_of_a_ragged_length():
    """37 entries: 10 exponent words and 2 sign words, the padding zero."""
    x = -jnp.arange(1, 38, dtype=jnp.float32)
    payload = compjax.natural().compress(jax.random.key(7), x)
    exponents = np.asarray(payload.wire["exponents"])
    signs = np.asarray(payload.wire["signs"])
    assert exponents.shape == (10,) and signs.shape == (2,)
    np.testing.assert_array_equal(signs, [0xFFFFFFFF, 0b11111])
    assert exponents[-1] >> 8 == 0  # entries 37..39 do not exist
    magnitudes = np.arange(1, 38)
    fields = ((exponents[:, None] >> (8 * np.arange(4))) & 0xFF).reshape(-1)[:37]
    rounded_up = fields - 127 - np.floor(np.log2(magnitudes))
    assert set(rounded_up) <= {0, 1}
    powers = (magnitudes & (magnitudes - 1)) == 0  # mantissa 0: never rounded
    assert not rounded_up[powers].any()
    decoded = np.asarray(compjax.natural().decompress(payload))
    np.testing.assert_array_equal(decoded, -(2.0 ** (fields - 127.0)))


def test_averaging_workers_divides_variance():
    """Independent keys: the mean of n compressed copies has variance omega/n."""
    comp, n = compjax.rand_k(k=4), 8
    x = np.linspace(-1.0, 2.0, D)
    draws = draw(comp, jnp.asarray(x, jnp.float32), n=8000).reshape(1000, n, D)
    mean = draws.mean(axis=1)
    expected = rand_k_variance(x, 4).sum() / n
    assert_mean_error(mean, x, expected)


@pytest.mark.parametrize(
    ("levels", "bucket", "d"),
    [(4, 8, 64), (4, 8, 61), (4, 512, 2048), (100, 6, 30), (100, 8, 64), (200, 512, 2048)],
)
def test_qsgd_decodes_its_wire_as_transcribed(levels, bucket, d):
    """QSGD's decode, read from its packed wire with numpy: code ``c`` of bucket ``r`` is
    ``(-1)**sign * norm_r * min(level * fl(1/s), 1)``, for whole rows of whole words (decoded in
    the codes' own 3-D shape), a partial last row, and 8- and 16-bit codes (whole rows or not)."""
    comp = compjax.qsgd(levels, bucket_size=bucket)
    x = jax.random.normal(jax.random.key(d), (d,))
    payload = comp.compress(jax.random.key(1), x)
    raw = np.asarray(payload.wire["codes"])
    if comp.width == 4:
        fields = [(raw >> (4 * k)) & 15 for k in range(8)]  # 8 codes to a uint32 word
        codes = np.stack(fields, axis=-1).reshape(-1)[:d].astype(np.int64)
    else:
        codes = raw.astype(np.int64)
    level, sign = codes & ((1 << comp.magnitude_bits) - 1), codes >> (comp.width - 1)
    norms = np.repeat(np.asarray(payload.wire["norms"]), bucket)[:d]
    frac = np.where(level >= levels, 1.0, level.astype(np.float32) * np.float32(1 / levels))
    want = np.where(sign == 1, -1, 1) * (norms * frac.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(comp.decompress)(payload)), want)


F32_MAX = float(np.finfo(np.float32).max)
NORM_CASES = {
    "normal": np.random.default_rng(3).standard_normal(1000),
    # Every square flushes to zero in float32: the exactly scaled fallback.
    "tiny": np.random.default_rng(4).standard_normal(1000) * 1e-30,
    # A few normal entries among flushed ones: the one pass, within 2**-24 of the norm.
    "tiny and normal": np.concatenate([np.full(997, 1e-30), [3.0, -4.0, 1e-3]]),
    # The squares overflow: the fallback's norm saturates at float32's largest value.
    "huge": np.linspace(-3e38, 3e38, 13),
    "1e19": np.full(10, 1e19),
    "zeros": np.zeros(7),
}


@pytest.mark.parametrize("name", sorted(NORM_CASES))
def test_one_norm_is_the_exactly_scaled_norm(name):
    """QSGD's and natural dithering's one norm (``qsgd.l2_norm``, and reduced over pieces) is
    the float64 norm to float32 rounding: one pass where the plain sum of squares is finite
    and not flushed, the exactly scaled two passes otherwise, float32's largest value where
    the norm of finite entries overflows; NaN and Inf entries keep it non-finite."""
    from compjax.compressors.qsgd import l2_norm, norm_of_pieces
    from compjax.pieces import Pieces

    x = jnp.asarray(NORM_CASES[name], jnp.float32)
    want = min(np.linalg.norm(np.asarray(x, np.float64)), F32_MAX)
    cut = x.shape[0] // 3
    pieces = Pieces.of([x[:cut], x[cut:]])
    for got in (jax.jit(l2_norm)(x), jax.jit(norm_of_pieces)(pieces)):
        np.testing.assert_allclose(float(got), want, rtol=1e-6)
    for got in (
        compjax.qsgd(4).compress(jax.random.key(0), x).wire["norms"][0],
        compjax.natural_dithering().compress(jax.random.key(0), x).wire["norm"][0],
    ):
        np.testing.assert_allclose(float(got), want, rtol=1e-6)
    for bad in (np.nan, np.inf):
        y = x.at[0].set(bad)
        assert not np.isfinite(float(jax.jit(l2_norm)(y)))


@pytest.mark.parametrize("spec", ["qsgd(levels=4)", "natural_dithering()"])
def test_one_norm_compressors_read_their_input_twice(spec):
    """The norm's one sum of squares, then the codes: two operations of the compiled
    compress read the input (the exactly scaled fallback runs under a conditional, only
    where that sum overflows or flushes); it was three (``max|x|``, the scaled squares,
    the codes)."""
    comp = {"qsgd(levels=4)": compjax.qsgd(4), "natural_dithering()": compjax.natural_dithering()}
    x = jax.random.normal(jax.random.key(0), (1 << 16,))
    readers = input_readers(jax.jit(comp[spec].compress), jax.random.key(1), x)
    assert len(readers) == 2, readers


# -- the forms users run, on an input whose squares overflow float32 --------------------------

#: Entries near float32's limit: their squares overflow, the norm (2.9e38) does not.
NEAR_LIMIT = np.array([1e38, -1e38, 5e37, 3.0] * 4, np.float32)


def in_three_forms(comp, x, n=2000, seed=0):
    """``comp`` on ``x`` eager, under ``jit`` and under ``jit(vmap)`` over ``n`` keys, ``x``
    closed over (a compile-time constant) and as an argument: ``(eager, jitted, draws)``,
    each a dict of float64 arrays keyed by ``"const"``/``"arg"`` (eager: one decode)."""
    x = jnp.asarray(x)
    key = jax.random.key(seed)
    keys = jax.random.split(key, n)
    eager = np.asarray(comp(key, x), np.float64)
    jitted = {
        "const": jax.jit(lambda k: comp(k, x))(key),
        "arg": jax.jit(lambda k, y: comp(k, y))(key, x),
    }
    draws = {
        "const": jax.jit(jax.vmap(lambda k: comp(k, x)))(keys),
        "arg": jax.jit(jax.vmap(lambda k, y: comp(k, y), in_axes=(0, None)))(keys, x),
    }
    as64 = lambda d: {k: np.asarray(v, np.float64) for k, v in d.items()}  # noqa: E731
    return eager, as64(jitted), as64(draws)


def assert_same_in_three_forms(comp, x, variance):
    """Finite decodes of ``x`` in every form, the same for a key however ``x`` is given, and an
    unbiased mean over the jit(vmap) draws (``assert_unbiased`` with the exact variance)."""
    eager, jitted, draws = in_three_forms(comp, x)
    assert np.all(np.isfinite(eager)), eager
    for source in ("const", "arg"):
        assert np.all(np.isfinite(jitted[source])), (source, jitted[source])
        assert np.all(np.isfinite(draws[source])), (source, draws[source][0])
        np.testing.assert_allclose(jitted[source], eager, rtol=1e-6)
    np.testing.assert_array_equal(draws["const"], draws["arg"])
    x = np.asarray(x, np.float64)
    assert_unbiased(draws["const"], x, variance(x))


@pytest.mark.parametrize("bucket", [None, 8], ids=["one norm", "buckets of 8"])
def test_qsgd_near_the_float32_limit_in_every_form(bucket):
    """A closed-over input used to decode NaN under jit and jit(vmap) (finite eager): XLA's
    simplifier rewrote the exactly scaled squares of the constant, ``(x 2**-e)(x 2**-e)``,
    as ``(x x)(2**-e 2**-e)``, Inf times 0 (``compjax.numerics.opaque``)."""
    comp = compjax.qsgd(levels=4, bucket_size=bucket)
    assert_same_in_three_forms(comp, NEAR_LIMIT, lambda x: qsgd_variance(x, 4, bucket))
