"""EDEN / DRIVE and the fast Walsh-Hadamard transform.

* ``fwht`` equals ``scipy.linalg.hadamard(n) / sqrt(n)`` and is its own inverse;
* the wire: ``d'`` sign bits (the padding to a power of two counted) and one
  float32 scale; the rotation's key is side information;
* EDEN's scale gives ``<x_hat, x> = ||x||^2`` on every draw; DRIVE's error is
  ``||x||^2 - ||Rx||_1^2 / d'``;
* unbiasedness (chi-square at false-alarm probability 1e-6, fixed seeds) and
  the vNMSE against ``omega = pi/2 - 1`` on dense and structured sparse inputs;
* 8 workers under ``shard_map``: the compressed mean is unbiased with the
  error of one worker divided by 8.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import draw, roundtrip
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from scipy import linalg, stats

import compjax
from compjax import hadamard
from compjax.compressors.eden import lloyd_max

OMEGA = math.pi / 2 - 1


@jax.jit
def _fwht_twice(x):
    y = hadamard.fwht(x)
    return y, hadamard.fwht(y)


def test_fwht_is_the_orthonormal_hadamard_matrix():
    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 8, 32, 256, 2048):
        x = rng.standard_normal((3, n)).astype(np.float32)
        y, back = _fwht_twice(jnp.asarray(x))
        y = np.asarray(y)
        np.testing.assert_allclose(y, x @ linalg.hadamard(n) / np.sqrt(n), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.sum(y * y, 1), np.sum(x * x, 1), rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard.fwht(jnp.ones(6))
    assert [hadamard.next_power_of_two(n) for n in (0, 1, 2, 3, 9, 1024, 1025)] == [
        1,
        1,
        2,
        4,
        16,
        1024,
        2048,
    ]


def _butterfly(x: np.ndarray) -> np.ndarray:
    """The textbook in-place butterfly in float64, one stage per index bit (the reference)."""
    y = np.array(x, np.float64)
    n, h = y.shape[-1], 1
    while h < n:
        y = y.reshape(*y.shape[:-1], n // (2 * h), 2, h)
        y = np.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], axis=-2)
        y, h = y.reshape(*y.shape[:-3], n), 2 * h
    return y / np.sqrt(n)


def test_fwht_of_long_vectors_is_the_butterfly():
    """Past the sizes a matrix can check, the transform against the float64 butterfly, plain,
    batched and under vmap: on the CPU (products with H_32, H_16: 2**17 = 2**5 2**4 2**4 2**4),
    and the accelerators' form (H_64, H_32: 2**6 2**6 2**5) run here directly."""
    assert hadamard._factor_bits(24, 5) == [5, 5, 5, 5, 4]
    assert hadamard._factor_bits(17, 5) == [5, 4, 4, 4]
    assert hadamard._factor_bits(24, 6) == [6, 6, 6, 6]
    assert hadamard._factor_bits(17, 6) == [6, 6, 5]
    assert hadamard._factor_bits(13, 6) == [5, 4, 4]
    assert hadamard._factor_bits(0, 5) == []
    x = jax.random.normal(jax.random.key(17), (1 << 17,), jnp.float32)
    reference = _butterfly(np.asarray(x))
    y = jax.jit(hadamard.fwht)(x)
    np.testing.assert_allclose(y, reference, rtol=0, atol=2e-5)
    cpu = jax.jit(hadamard._products, static_argnums=1)(x, hadamard._CPU_FACTOR_BITS)
    np.testing.assert_array_equal(y, cpu)  # the CPU takes its own factors
    np.testing.assert_array_equal(jax.jit(hadamard.fwht)(x[None])[0], y)
    np.testing.assert_array_equal(jax.jit(jax.vmap(hadamard.fwht))(x[None])[0], y)
    np.testing.assert_allclose(jax.jit(hadamard.fwht)(y), x, rtol=1e-4, atol=1e-5)
    accelerators = jax.jit(hadamard._products, static_argnums=1)(x, hadamard._FACTOR_BITS)
    np.testing.assert_allclose(accelerators, reference, rtol=0, atol=2e-5)


def test_randomized_rotation_inverts():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(64), jnp.float32)
    signs = hadamard.random_signs(jax.random.key(3), 64, rounds=3)
    assert set(np.unique(np.asarray(signs))) == {-1.0, 1.0}
    y = hadamard.rotate(signs, x)
    np.testing.assert_allclose(jnp.linalg.norm(y), jnp.linalg.norm(x), rtol=1e-5)
    np.testing.assert_allclose(hadamard.unrotate(signs, y), x, rtol=1e-4, atol=1e-5)


def test_rotation_with_signs_drawn_from_the_index_is_rotate_bit_for_bit():
    """``rotate_key`` flips signs drawn from each entry's index (no sign array): the same bits
    as ``rotate`` with ``random_signs``, and ``unrotate_key`` inverts it."""
    n, key = 1 << 17, jax.random.key_data(jax.random.key(9))
    x = jax.random.normal(jax.random.key(8), (n,), jnp.float32)
    signs = hadamard.random_signs(key, n, 3)
    y = jax.jit(hadamard.rotate_key, static_argnums=2)(key, x, 3)
    np.testing.assert_array_equal(y, jax.jit(hadamard.rotate)(signs, x))
    back = jax.jit(hadamard.unrotate_key, static_argnums=2)(key, y, 3)
    np.testing.assert_array_equal(back, jax.jit(hadamard.unrotate)(signs, y))
    np.testing.assert_allclose(back, x, rtol=1e-4, atol=1e-5)
    # A key whose draws are not counter-based takes the signs from memory: the same rotation.
    rbg = jax.random.key(9, impl="rbg")
    rotate = jax.jit(hadamard.rotate_key, static_argnums=2)
    np.testing.assert_array_equal(
        rotate(rbg, x, 2), jax.jit(hadamard.rotate)(hadamard.random_signs(rbg, n, 2), x)
    )


def test_eden_on_a_long_vector_keeps_its_inner_product():
    """``<x_hat, x> = ||x||^2`` through the rotation with its signs drawn from the index."""
    x = jax.random.normal(jax.random.key(10), (100_000,), jnp.float32)
    for comp in (compjax.eden(), compjax.eden(bits=2)):
        x_hat = jax.jit(lambda key, x, comp=comp: comp.decompress(comp.compress(key, x)))(
            jax.random.key(11), x
        )
        np.testing.assert_allclose(jnp.dot(x_hat, x), jnp.dot(x, x), rtol=1e-4)
        assert 0.05 < float(jnp.sum((x_hat - x) ** 2) / jnp.sum(x * x)) < 1.0


def test_wire_format_counts_the_padding():
    for comp in (compjax.eden(), compjax.drive(rounds=1)):
        for d, padded in ((0, 0), (1, 1), (7, 8), (9, 16), (1000, 1024)):
            payload = jax.eval_shape(comp.compress, jax.random.key(0), jnp.zeros(d))
            assert payload.wire["signs"].dtype == jnp.uint32
            assert payload.wire["scale"].dtype == jnp.float32
            assert compjax.wire_bits(payload) == 32 + 32 * math.ceil(padded / 32)
            assert "key" in payload.side  # the rotation is never sent
    assert compjax.eden().bits((1024,)) == 1024 + 32


@partial(jax.jit, static_argnums=0)
def _rotated_l1(comp, key, x):
    """``||R x||_1`` with the compressor's own rotation (raw key as in its payload)."""
    n = hadamard.next_power_of_two(x.size)
    signs = hadamard.random_signs(jax.random.key_data(key), n, comp.rounds)
    return jnp.sum(jnp.abs(hadamard.rotate(signs, jnp.pad(x, (0, n - x.size)))))


def test_scales_eden_inner_product_and_drive_error():
    x = jnp.asarray(np.random.default_rng(2).standard_normal(100), jnp.float32)
    sq = float(jnp.sum(x * x))
    for seed in range(2):
        key = jax.random.key(seed)
        _, y = roundtrip(compjax.eden(), key, x)
        # EDEN: <x_hat, x> = ||x||^2 on every draw (the error is orthogonal to x).
        np.testing.assert_allclose(float(jnp.dot(y, x)), sq, rtol=1e-5)
        # DRIVE: ||x_hat - x||^2 = ||x||^2 - ||Rx||_1^2 / d' (computed on d' entries,
        # so at most that on the d kept ones), and within the contraction bound.
        comp = compjax.drive()
        _, z = roundtrip(comp, key, x)
        l1 = float(_rotated_l1(comp, key, x))
        err = float(jnp.sum((z - x) ** 2))
        assert err <= (sq - l1**2 / 128) * (1 + 1e-5)
        assert err <= (1 - comp.delta(100)) * sq
    assert compjax.drive().delta(100) == 1 / 128 and compjax.drive().omega(100) is None
    assert compjax.eden().omega(100) == OMEGA and compjax.eden().delta(100) is None
    assert compjax.eden().omega(1) == 0.0


def _assert_unbiased_mc(draws, x, p=1e-6):
    """Chi-square test of the mean with per-entry sample variances (n >> 1 draws)."""
    n = draws.shape[0]
    var = draws.var(axis=0, ddof=1)
    z = (draws.mean(0) - x) / np.sqrt(var / n)
    chi2, bound = float(np.sum(z**2)), float(stats.chi2.isf(p, x.size))
    assert chi2 < bound, f"mean is off: chi2={chi2:.1f} > {bound:.1f}"


def _family(d):
    rng = np.random.default_rng(4)
    spikes = lambda k: np.r_[np.ones(k), np.zeros(d - k)]  # noqa: E731
    return {
        "gaussian": rng.standard_normal(d),
        "student-t(2)": rng.standard_t(2, d),
        "two equal spikes": spikes(2),
        "four equal spikes": spikes(4),
        "(1, 1/2, 0, ...)": np.r_[1.0, 0.5, np.zeros(d - 2)],
        "hadamard row + e1": linalg.hadamard(d)[3] / np.sqrt(d) + np.eye(d)[0],
    }


@pytest.mark.parametrize(
    "name",
    [
        n if n in ("gaussian", "two equal spikes") else pytest.param(n, marks=pytest.mark.slow)
        for n in _family(64)
    ],
)
def test_unbiased_and_vnmse_below_omega(name):
    """Three rounds: on every family the mean passes a chi-square test and the vNMSE
    is below omega within 5 standard errors (and at least 0.9 omega, so omega/2 fails)."""
    d = 256
    x = _family(d)[name].astype(np.float32).astype(np.float64)
    draws = draw(compjax.eden(), jnp.asarray(x, jnp.float32), n=4000, seed=11)
    _assert_unbiased_mc(draws, x)
    err = np.sum((draws - x) ** 2, axis=1) / np.sum(x**2)
    se = err.std(ddof=1) / np.sqrt(len(err))
    assert err.mean() <= OMEGA + 5 * se, (err.mean(), se)
    assert err.mean() >= 0.9 * OMEGA


def test_one_round_fails_on_structured_inputs():
    """Documented: one randomized Hadamard round (the papers') is biased on (1, 1/2, 0, ...)
    (every draw decodes to (5/4) e_1) and two equal spikes have error exactly 1."""
    d = 256
    fam = _family(d)
    draws = draw(compjax.eden(rounds=1), jnp.asarray(fam["(1, 1/2, 0, ...)"], jnp.float32), n=64)
    np.testing.assert_allclose(draws, np.broadcast_to(np.eye(d)[0] * 1.25, draws.shape), atol=1e-5)
    x = fam["two equal spikes"]
    draws = draw(compjax.eden(rounds=1), jnp.asarray(x, jnp.float32), n=64)
    np.testing.assert_allclose(np.sum((draws - x) ** 2, axis=1) / 2, 1.0, rtol=1e-5)


@pytest.mark.slow  # also a proofs_checks claim (make proofs)
def test_vnmse_is_pi_over_2_minus_1_in_high_dimension():
    """d = 2^14 Gaussian: EDEN's vNMSE within 1% of pi/2 - 1 (2 and 4 bits: of D/(1 - D));
    DRIVE's within 1% of 1 - 2/pi."""
    x = np.random.default_rng(5).standard_normal(2**14).astype(np.float32)
    cases = [(compjax.eden(b), compjax.eden(b).omega(2**14)) for b in (1, 2, 4)]
    for comp, expected in [*cases, (compjax.drive(), 1 - 2 / math.pi)]:
        draws = draw(comp, jnp.asarray(x), n=64, seed=3)
        err = np.sum((draws - x) ** 2, axis=1) / np.sum(x.astype(np.float64) ** 2)
        assert abs(err.mean() - expected) <= 0.01 * expected, (comp, err.mean())


def test_lloyd_max_codebooks():
    """Max (1960)'s Gaussian quantisers: 2 bits +-0.4528, +-1.510, D = 0.1175; 4 bits 0.0095."""
    centroids, distortion = lloyd_max(2)
    np.testing.assert_allclose(centroids, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    np.testing.assert_allclose(distortion, 0.1175, atol=1e-4)
    np.testing.assert_allclose(lloyd_max(1)[1], 1 - 2 / math.pi, rtol=1e-9)
    np.testing.assert_allclose(lloyd_max(4)[1], 0.0095, atol=1e-5)
    assert compjax.eden(2).omega(10) == pytest.approx(0.1175 / 0.8825, rel=1e-3)


@pytest.mark.parametrize("bits", [2, 4])
def test_multibit_wire_unbiased_and_below_omega(bits):
    comp = compjax.eden(bits)
    payload = jax.eval_shape(comp.compress, jax.random.key(0), jnp.zeros(100))
    assert payload.wire["codes"].dtype == jnp.uint32
    assert compjax.wire_bits(payload) == 32 + 128 * bits == comp.bits((100,))
    d = 256
    fam = _family(d)
    for name in ("gaussian", "two equal spikes", "(1, 1/2, 0, ...)"):
        x = fam[name].astype(np.float32).astype(np.float64)
        draws = draw(comp, jnp.asarray(x, jnp.float32), n=4000, seed=12)
        _assert_unbiased_mc(draws, x)
        np.testing.assert_allclose(draws @ x, np.sum(x**2), rtol=1e-4)
        err = np.sum((draws - x) ** 2, axis=1) / np.sum(x**2)
        se = err.std(ddof=1) / np.sqrt(len(err))
        assert 0.9 * comp.omega(d) <= err.mean() <= comp.omega(d) + 5 * se, (name, err.mean())


@partial(jax.jit, static_argnums=(0, 1))
def _shard_map_means(comp, mesh, keys, xs):
    """The compressed mean over the 8 workers of ``xs`` for each key, under shard_map."""

    def body(keys, x):
        return jax.vmap(lambda k: compjax.compressed_mean(comp, k, x[0], "data").mean)(keys)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(keys, xs)


@pytest.mark.slow
def test_eight_workers_under_shard_map():
    """Independent rotations per worker: the mean of 8 workers is unbiased and its error
    is the sum of the workers' errors over 64 (each one's measured alone)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    d, n = 512, 2000
    xs = np.random.default_rng(6).standard_normal((8, d)).astype(np.float32)
    keys = jax.random.split(jax.random.key(8), n)
    means = np.asarray(_shard_map_means(compjax.eden(), mesh, keys, jnp.asarray(xs)), np.float64)
    target = xs.astype(np.float64).mean(0)
    _assert_unbiased_mc(means, target)
    single = [draw(compjax.eden(), jnp.asarray(x), n=500, seed=20 + i) for i, x in enumerate(xs)]
    per_worker = [np.mean(np.sum((s - x) ** 2, axis=1)) for s, x in zip(single, xs, strict=True)]
    expected = sum(per_worker) / 64
    err = np.sum((means - target) ** 2, axis=1)
    se = err.std(ddof=1) / np.sqrt(n)
    assert abs(err.mean() - expected) <= 5 * se + 0.03 * expected, (err.mean(), expected)


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: compjax.eden(rounds=0), "rounds"),
        (lambda: compjax.drive(rounds=1.5), "rounds"),
        (lambda: compjax.eden(rounds=True), "rounds"),
        (lambda: compjax.eden(bits=3), "bits"),
        (lambda: compjax.eden(bits=0), "bits"),
        (lambda: compjax.drive(scale="unbiased"), "scale"),
    ],
)
def test_bad_parameters_raise(build, name):
    with pytest.raises(ValueError, match=name):
        build()


#: Draws per input of the small-leaf sweep, and the sweep's overall false-alarm probability.
SMALL_DRAWS, SMALL_P = 10_000, 1e-6


def _small_inputs(padded):
    """For every ``d`` with ``padded_size(d) == padded``: a one-hot and a wide-range vector
    (magnitudes 1e-3 to 1e3, alternating signs) in the first ``d`` of ``padded`` entries."""
    sizes = [padded, *range(padded // 2 + 1, padded + 1)]  # the one-hot is one row
    rows = [np.r_[1.0, np.zeros(padded - 1)]]
    for d in sizes[1:]:
        wide = np.logspace(-3, 3, d) * np.where(np.arange(d) % 2, 1.0, -1.0)
        rows.append(np.r_[wide, np.zeros(padded - d)])
    inside = np.arange(padded) < np.asarray(sizes)[:, None]  # a leaf's own entries
    return np.asarray(rows, np.float32), inside


@partial(jax.jit, static_argnums=(0, 3))
def _error_moments(comp, xs, key, chunks):
    """Sums over ``chunks * 1000`` keys of ``C(x) - x`` and its square, for each row of ``xs``
    (every input compressed with the same keys; one Haar matrix per key)."""

    def chunk(carry, keys):
        out = jax.vmap(lambda k: jax.vmap(lambda x: comp(k, x))(xs))(keys) - xs
        return (carry[0] + out.sum(0), carry[1] + (out * out).sum(0)), None

    keys = jax.random.split(key, (chunks, 1000))
    zero = jnp.zeros_like(xs)
    return jax.lax.scan(chunk, (zero, zero), keys)[0]


@pytest.mark.parametrize(
    "padded",  # the leaves of 17 to 64 entries (the largest rotations): with -m slow
    [(1, 2, 4, 8, 16), pytest.param((32, 64), marks=pytest.mark.slow)],
    ids=["d<=16", "16<d<=64"],
)
@pytest.mark.parametrize("bits", [1, *(pytest.param(b, marks=pytest.mark.slow) for b in (2, 4))])
def test_small_leaves_are_unbiased_at_every_size(bits, padded):
    """Every d from 1 to 64 (one compile per d'): one-hot and wide-range inputs, 10000
    draws each. The standardised mean errors of all entries of all inputs stay below the
    Bonferroni bound for an overall false alarm of 1e-6 (|z| < 6.3); the sd is floored at
    1e-5 ||x|| so float32 rounding of an exact entry is not read as bias.  Randomized
    Hadamard rounds (the old rotation) miss at |z| = 10 to 134 for d' = 2 to 16."""
    comp = compjax.eden(bits)
    batches = {p: _small_inputs(p) for p in padded}
    entries = sum(int(inside.sum()) for _, inside in batches.values())
    bound = stats.norm.isf(SMALL_P / (2 * entries))
    # A leaf of d entries is compressed as its zero-padded d' entries (same bits, same decode).
    x = jnp.asarray(_small_inputs(16)[0][-4, :13])
    np.testing.assert_array_equal(
        roundtrip(comp, jax.random.key(3), x)[1],
        roundtrip(comp, jax.random.key(3), jnp.pad(x, (0, 3)))[1][:13],
    )
    for padded, (xs, inside) in batches.items():
        total, square = _error_moments(comp, jnp.asarray(xs), jax.random.key(padded), 10)
        mean = np.asarray(total, np.float64) / SMALL_DRAWS
        var = np.asarray(square, np.float64) / SMALL_DRAWS - mean**2
        floor = (1e-5 * np.linalg.norm(xs.astype(np.float64), axis=1, keepdims=True)) ** 2
        z = mean / np.sqrt((np.maximum(var, 0) + floor) / SMALL_DRAWS)
        z = np.where(inside, z, 0.0)
        worst = np.unravel_index(np.argmax(np.abs(z)), z.shape)
        assert np.abs(z).max() < bound, (padded, worst, z[worst])


def test_drive_authors_scale_is_eden_one_bit():
    """``drive(scale="authors")`` is the authors' unbiased ``||Rx||^2 / ||Rx||_1``: eden(1);
    the paper's scale decodes 0.6 to 0.85 of it on a Gaussian input (same rotation)."""
    assert compjax.drive(scale="authors") == compjax.eden(1)
    assert compjax.drive(2, scale="authors") == compjax.eden(1, rounds=2)
    assert compjax.drive(scale="authors").unbiased and not compjax.drive().unbiased
    x = jnp.asarray(np.random.default_rng(9).standard_normal(1000), jnp.float32)
    key = jax.random.key(4)
    authors = roundtrip(compjax.drive(scale="authors"), key, x)[1]
    paper = roundtrip(compjax.drive(), key, x)[1]
    ratio = float(jnp.linalg.norm(paper) / jnp.linalg.norm(authors))
    assert 0.6 < ratio < 0.85, ratio
