"""The counter-based sampler behind ``bernoulli`` and natural compression.

``compjax.draws.random_bits`` expands a threefry key's 64 bits, through three
Feistel rounds (``seed_of``, a bijection: checked by running it backwards), to
32 bits per entry, ``mix32((i + s0) ^ s1)`` with ``(s0, s1)`` the seed.
What the theory needs, and how it is checked here:

* **exact marginals**: for each entry ``i`` and each ``s1`` the map
  ``s0 -> bits[i]`` is a bijection of uint32 (checked by inverting the
  library's own output step by step), so a uniform seed gives exactly
  uniform 32 bits and ``bernoulli`` rounds up with probability exactly
  ``T / 2**32`` for its integer threshold ``T = p 2**32`` (``p >= 2**-8``);
* **independent workers**: independent seeds (``fold_in`` keys) give
  independent bits at every entry, a function of independent variables;
* **pseudo-randomness within one draw** (neighbouring entries, frequencies,
  joint frequencies across workers' keys): chi-square and binomial tests
  with fixed seeds, each at false-alarm probability 1e-6.

Dispatch: threefry keys (typed or raw) take the hash; any other
implementation (``rbg``, the scripted keys of ``proofs_checks``) draws with
``jax.random.bits``, so an implementation that chooses the bits chooses every
entry's draw.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import compjax
from compjax.draws import (
    _SEED_ROUNDS,
    _TRIPLE32,
    bernoulli,
    counter_bits,
    mix32,
    random_bits,
    seed_of,
)

ALPHA = 1e-6  # false-alarm probability of each statistical test
Z = float(stats.norm.isf(ALPHA / 2))  # two-sided z bound, about 4.9
M32 = (1 << 32) - 1


def np_unxorshift(h: np.ndarray, s: int) -> np.ndarray:
    """Inverse of ``h ^ (h >> s)`` on uint64-held uint32 values."""
    x = h.copy()
    shift = s
    while shift < 32:
        x = h ^ (x >> s)
        shift += s
    return x & M32


def np_unmix32(h: np.ndarray) -> np.ndarray:
    """Inverse of :func:`mix32`, step by step (multiplication by the inverse odd constant)."""
    h = np_unxorshift(np.asarray(h, np.uint64), 14)
    for shift, multiplier in reversed(_TRIPLE32):
        h = np_unxorshift((h * pow(multiplier, -1, 1 << 32)) & M32, shift)
    return h


def test_mix32_is_a_bijection():
    """The library's mix32 inverted by the step-by-step inverse, on 2**20 values and the edges."""
    rng = np.random.default_rng(0)
    h = np.concatenate([rng.integers(0, 1 << 32, 1 << 20, np.uint64), [0, 1, M32, 1 << 31]])
    out = np.asarray(jax.jit(mix32)(jnp.asarray(h, jnp.uint32)), np.uint64)
    np.testing.assert_array_equal(np_unmix32(out), h)
    assert all(m % 2 == 1 for _, m in _TRIPLE32)  # odd: invertible modulo 2**32
    # Wellons' triple32, written with its published constants, on a few values.
    for v in (1, 2, 12345, 0xDEADBEEF, M32):
        x = v
        for shift, mult in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
            x = ((x ^ (x >> shift)) * mult) & M32
        x ^= x >> 14
        assert int(jax.jit(mix32)(jnp.uint32(v))) == x, v


def test_each_entry_is_a_bijection_of_the_seed():
    """For fixed i and s1, s0 -> bits[i] is inverted exactly: uniform s0, exactly uniform bits."""
    rng = np.random.default_rng(1)
    n = 4096
    s0 = rng.integers(0, 1 << 32, 512, np.uint64)
    s1 = rng.integers(0, 1 << 32, 512, np.uint64)
    seeds = jnp.asarray(np.stack([s0, s1], axis=1), jnp.uint32)
    bits = np.asarray(jax.jit(jax.vmap(lambda s: counter_bits(s, n)))(seeds), np.uint64)
    i = np.arange(n, dtype=np.uint64)
    recovered = ((np_unmix32(bits) ^ s1[:, None]) - i) & M32
    np.testing.assert_array_equal(recovered, np.broadcast_to(s0[:, None], recovered.shape))


@pytest.mark.parametrize("p", [2.0**-8, 0.5, 0.75, 1 - 2.0**-8])
def test_bernoulli_threshold_is_exact(p):
    """The library's bernoulli is true exactly for draws below p 2**32 (p >= 2**-8): with
    uniform bits its probability is exactly p.  Scripted draws (multiples of 2**9) just
    below and at the threshold; these p put the threshold on a multiple of 2**9."""
    from proofs_checks._common import scripted_key

    t = int(p * 2**32) >> 9  # the threshold in units of the scripted draws
    key = scripted_key(jnp.asarray([t - 1, t, 0, t + 1], jnp.uint32), 4)
    for unit in (False, True):
        draws = bernoulli(key, jnp.full((4,), p, jnp.float32), unit=unit)
        np.testing.assert_array_equal(draws, [True, False, True, False])


def test_bernoulli_in_the_unit_interval_draws_the_same():
    """``unit=True`` (no clip, for a probability known to be in [0, 1]) gives the clipped
    draws bit for bit over [0, 1]: 0, tiny, 2**-8, around 1/2, the largest float32 below 1
    and 1 (true, though ``2**32`` does not convert to uint32), each at 2**13 hashed draws;
    and at p = 1 the largest scripted draw is below it."""
    from proofs_checks._common import LAST, scripted_key

    below_one = float(np.nextafter(np.float32(1), np.float32(0)))
    probs = jnp.asarray([0.0, 1e-30, 2.0**-8, 0.5 - 2.0**-25, 0.5, below_one, 1.0], jnp.float32)
    p = jnp.tile(probs, 1 << 13)
    run = jax.jit(bernoulli, static_argnums=(2, 3))
    key = jax.random.key(9)
    np.testing.assert_array_equal(run(key, p, 0, True), run(key, p, 0, False))
    top = scripted_key(jnp.asarray([LAST], jnp.uint32), 1)
    assert bool(bernoulli(top, jnp.ones(1), unit=True)[0])


def test_dispatch():
    """Threefry keys (typed and raw) take the hash; other implementations their own bits."""
    key = jax.random.key(3)
    bits = jax.jit(random_bits, static_argnums=1)
    expect = counter_bits(seed_of(key), 12).reshape(3, 4)
    np.testing.assert_array_equal(bits(key, (3, 4)), expect)
    np.testing.assert_array_equal(bits(jax.random.key_data(key), (3, 4)), expect)
    rbg = jax.random.key(3, impl="rbg")
    np.testing.assert_array_equal(bits(rbg, (3, 4)), jax.random.bits(rbg, (3, 4)))
    keys = jax.random.split(key, 5)
    batched = jax.jit(jax.vmap(lambda k: random_bits(k, (7,))))(keys)
    for k, row in zip(keys, batched, strict=True):
        np.testing.assert_array_equal(row, bits(k, (7,)))


def test_scripted_keys_choose_every_draw():
    """proofs_checks' scripted implementation still sets each entry's draw (its exact checks)."""
    from proofs_checks._common import LAST, scripted_key

    m = jnp.asarray([0, LAST, 0, LAST, 5, LAST - 5, 0], jnp.uint32)
    key = scripted_key(m, 8)
    draws = random_bits(key, (7,))
    np.testing.assert_array_equal(draws, m << 9)
    up = bernoulli(key, jnp.full((7,), 0.5))
    np.testing.assert_array_equal(up, np.asarray(m << 9) < 2**31)


def _draws(seed: int, n: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda k: random_bits(k, (n,)))(jax.random.key(seed)), np.uint64)


def chi2_ok(counts: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    stat = float(np.sum((counts - expected) ** 2 / expected))
    return stat, float(stats.chi2.isf(ALPHA, counts.size - 1))


@pytest.mark.parametrize("seed", [0, 1])
def test_bytes_are_uniform_within_one_draw(seed):
    """Top, middle and low byte of 2**20 entries of one key: 256-bin chi-square each."""
    bits = _draws(seed, 1 << 20)
    for shift in (24, 12, 0):
        counts = np.bincount(((bits >> shift) & 0xFF).astype(np.int64), minlength=256)
        stat, bound = chi2_ok(counts, np.full(256, bits.size / 256))
        assert stat < bound, (shift, stat, bound)


@pytest.mark.parametrize("lag", [1, 2, 64, 4096])
def test_neighbouring_entries_are_independent(lag):
    """Joint frequencies of the top 4 bits of entries i and i + lag: 16 x 16 chi-square."""
    bits = _draws(2, 1 << 20)
    a, b = (bits[:-lag] >> 28).astype(np.int64), (bits[lag:] >> 28).astype(np.int64)
    counts = np.bincount(16 * a + b, minlength=256)
    stat, bound = chi2_ok(counts, np.full(256, a.size / 256))
    assert stat < bound, (stat, bound)


def test_workers_fold_in_keys_are_independent():
    """Eight workers' fold_in keys: joint top-4-bit frequencies of each pair at the same
    entries, and bernoulli(1/2) agreement at the rate 1/2."""
    n = 1 << 17
    key = jax.random.key(4)
    workers = jax.vmap(lambda w: random_bits(jax.random.fold_in(key, w), (n,)))(jnp.arange(8))
    top = np.asarray(workers >> 28, np.int64)
    for a in range(8):
        for b in range(a + 1, 8):
            counts = np.bincount(16 * top[a] + top[b], minlength=256)
            stat, bound = chi2_ok(counts, np.full(256, n / 256))
            assert stat < bound, (a, b, stat, bound)
    coins = np.asarray(workers, np.uint64) < (1 << 31)
    agree = (coins[:, None, :] == coins[None, :, :]).mean(axis=2)[np.triu_indices(8, 1)]
    se = 0.5 / np.sqrt(n)
    assert np.all(np.abs(agree - 0.5) < Z * se), agree


@pytest.mark.parametrize("p", [2.0**-8, 0.3, 0.5, 0.9])
def test_bernoulli_frequency(p):
    """The fraction of true draws over 2**20 entries of each of 4 keys: binomial z-test."""
    n, keys = 1 << 20, jax.random.split(jax.random.key(5), 4)
    draws = jax.jit(jax.vmap(lambda k: bernoulli(k, jnp.full((n,), p, jnp.float32))))(keys)
    total = n * len(keys)
    z = (float(jnp.sum(draws)) - total * p) / np.sqrt(total * p * (1 - p))
    assert abs(z) < Z, z


def test_seed_of_is_a_bijection_of_the_key():
    """The Feistel rounds run backwards give every key back (so a uniform key gives a
    uniform seed); the seed is computed from the key's data, typed or raw."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 1 << 32, (4096, 2), dtype=np.uint64).astype(np.uint32)
    seeds = np.asarray(jax.jit(jax.vmap(seed_of))(jnp.asarray(data)), np.uint64)
    left, right = seeds[:, 0], seeds[:, 1]
    for c in reversed(_SEED_ROUNDS):
        mixed = np.asarray(mix32(jnp.asarray((left ^ np.uint64(c)).astype(np.uint32))), np.uint64)
        left, right = right ^ mixed, left
    np.testing.assert_array_equal(np.stack([left, right], axis=1), data)
    assert len({tuple(s) for s in seeds}) == len(data)
    key = jax.random.key(11)
    np.testing.assert_array_equal(seed_of(key), seed_of(jax.random.key_data(key)))


def test_seed_of_avalanche_over_the_key():
    """Flipping any one bit of the key flips each seed bit with frequency near 1/2:
    keys one bit apart (``key(0)``, ``key(1)``) draw unrelated streams."""
    rng = np.random.default_rng(8)
    data = jnp.asarray(rng.integers(0, 1 << 32, (2048, 2), dtype=np.uint64).astype(np.uint32))
    base = np.asarray(jax.vmap(seed_of)(data), np.uint64)
    for word in range(2):
        for bit in range(32):
            flipped = data.at[:, word].set(data[:, word] ^ jnp.uint32(1 << bit))
            diff = base ^ np.asarray(jax.vmap(seed_of)(flipped), np.uint64)
            bits = np.unpackbits(diff.astype(">u4").view(np.uint8).reshape(len(data), -1), axis=1)
            rates = bits.mean(axis=0)  # per seed bit, over the keys
            worst = np.abs(rates - 0.5).max()
            assert worst < Z * 0.5 / np.sqrt(len(data)), (word, bit, worst)


def test_seed_bits_avalanche():
    """Flipping any one seed bit flips each output bit with frequency near 1/2."""
    n = 1 << 12
    seed = jnp.asarray([0x12345678, 0x9ABCDEF0], jnp.uint32)
    base = np.asarray(counter_bits(seed, n), np.uint64)
    for word in range(2):
        for bit in range(0, 32, 5):
            flipped = seed.at[word].set(seed[word] ^ jnp.uint32(1 << bit))
            diff = base ^ np.asarray(counter_bits(flipped, n), np.uint64)
            rate = np.unpackbits(diff.astype(">u4").view(np.uint8)).mean()
            assert abs(rate - 0.5) < Z * 0.5 / np.sqrt(32 * n), (word, bit, rate)


def test_unbiased_compressors_use_it():
    """QSGD, TernGrad and natural compression with threefry keys: different keys give
    different roundings, the same key the same one."""
    x = jnp.linspace(-1.0, 1.0, 1001)
    for comp in (compjax.qsgd(4), compjax.terngrad(), compjax.natural()):
        run = jax.jit(jax.vmap(comp, in_axes=(0, None)))
        a, b, c = run(jax.random.split(jax.random.key(0), 3), x)
        assert not np.array_equal(a, b)
        np.testing.assert_array_equal(run(jax.random.split(jax.random.key(0), 3), x)[2], c)


@pytest.mark.parametrize("scale", [1.0, 1e-25, 1e-36, 1e30, 1e37])
def test_one_pass_mean_abs_falls_back_at_the_float32_limits(scale):
    """Scaled sign's ``mean |x|``: float64's value at every scale (huge entries whose sum
    overflows take the scaled path; XLA on a CPU flushes subnormals to zero, and so does
    the reference), and exactly 0 for zeros."""
    from compjax.compressors.sign import mean_abs

    x = (np.random.default_rng(7).standard_normal(1024) * scale).astype(np.float32)
    x64 = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x.astype(np.float64))
    mean = float(jax.jit(mean_abs)(jnp.asarray(x)))
    np.testing.assert_allclose(mean, np.abs(x64).mean(), rtol=1e-5)
    assert float(jax.jit(mean_abs)(jnp.zeros(1024))) == 0.0
