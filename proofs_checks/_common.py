"""Exact expectations through the library's own code, and Monte Carlo helpers.

Exact expectations: "scripted" PRNG keys
-----------------------------------------
The stochastic compressors of compjax (QSGD, TernGrad, natural compression,
ATOMO) make one independent binary decision per coordinate by comparing
random bits with a threshold: 32 bits against ``p * 2**32``
(``compjax.draws.bernoulli``; QSGD, TernGrad, ATOMO) or, for natural
compression, the top 23 bits against the mantissa.  The bits come from
``compjax.draws.random_bits``: for threefry keys a counter-based hash
of one threefry draw, for any other PRNG implementation that
implementation's ``random_bits``.  A custom PRNG implementation
(:func:`jax.extend.random.define_prng_impl`) whose ``random_bits`` returns
bits we choose therefore lets us run the library's *own*
``compress``/``decompress`` on every outcome.  The scripted key sets the top
23 bits of each draw to ``m`` (the low 9 bits zero), so probabilities are
resolved to ``2**-23``:

* ``m_i = 0`` gives the "rounded up" value of coordinate ``i``, ``m_i = 2**23 - 1``
  the "rounded down" one;
* bisection over ``m_i`` (23 steps, all coordinates at once) finds the number
  ``M_i`` of draws that round up, so under exactly uniform draws the library
  rounds up with probability ``M_i / 2**23`` up to ``2**-23`` -- the
  probability *as implemented*, read off the library's comparison, not the
  paper's formula;
* for small ``d`` every one of the ``2**d`` joint outcomes is run, which also
  checks that each coordinate depends on its own draw only.

The expectation of any function of the output is then an exact finite sum.
What it assumes: the sampler gives independent uniform draws per
coordinate.  For threefry keys each coordinate's 32 bits are exactly uniform
(a bijection of a uniform seed) and independent across workers' keys; the
rest is checked by Monte Carlo with real keys here and in
``tests/test_fast_random.py``.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
from scipy import stats

MANTISSA = 23
FULL = 1 << MANTISSA  # number of distinct 23-bit draws
LAST = FULL - 1


# -- scripted keys ---------------------------------------------------------------
@functools.cache
def _impl(width: int):
    """A PRNG implementation whose key is ``width`` words of chosen random bits."""

    def random_bits(data, bit_width, shape):
        n = math.prod(shape)
        words = data[:n] if n <= width else jnp.tile(data, -(-n // width))[:n]
        if bit_width != 32:
            raise NotImplementedError(f"scripted keys give 32-bit draws, not {bit_width}")
        return words.reshape(shape)

    return jex_random.define_prng_impl(
        key_shape=(width,),
        seed=lambda seed: jnp.zeros((width,), jnp.uint32),
        split=lambda data, shape: jnp.broadcast_to(data, (*shape, width)),
        random_bits=random_bits,
        fold_in=lambda data, i: data,
        name=f"scripted{width}",
    )


def width_for(d: int) -> int:
    return max(8, 1 << max(d - 1, 0).bit_length())


def scripted_key(m: jax.Array, width: int):
    """A key whose coordinate ``i`` draws the 23-bit integer ``m[i]`` (``u = m / 2**23``)."""
    m = jnp.asarray(m, jnp.uint32)
    m = jnp.concatenate([m, jnp.full((width - m.shape[0],), LAST, jnp.uint32)])
    return jax.random.wrap_key_data(m << (32 - MANTISSA), impl=_impl(width))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _run_scripted(comp, xs, ms, width):
    """``comp(scripted_key(ms[b]), xs[b])`` for a batch ``b``, as float32."""
    return jax.vmap(lambda x, m: comp(scripted_key(m, width), x).astype(jnp.float32))(xs, ms)


def run_scripted(comp, xs, ms) -> np.ndarray:
    xs = jnp.asarray(xs, jnp.float32)
    d = xs.shape[-1]
    return np.asarray(_run_scripted(comp, xs, jnp.asarray(ms, jnp.uint32), width_for(d)))


class TwoPoint:
    """The exact distribution of ``comp(key, x)`` for each row of ``xs``.

    Coordinate ``i`` of row ``b`` is ``up[b, i]`` with probability
    ``prob[b, i]`` and ``down[b, i]`` otherwise, independently.  Values are the
    library's float32 outputs, held in float64.
    """

    def __init__(self, comp, xs):
        xs = np.atleast_2d(np.asarray(xs, np.float32))
        self.x = xs.astype(np.float64)
        batch, d = xs.shape
        up = run_scripted(comp, xs, np.zeros((batch, d)))
        down = run_scripted(comp, xs, np.full((batch, d), LAST))
        random = up != down
        lo = np.zeros((batch, d), np.int64)
        hi = np.full((batch, d), FULL, np.int64)
        two_point = True
        for _ in range(MANTISSA + 1):
            mid = (lo + hi) // 2
            out = run_scripted(comp, xs, np.minimum(mid, LAST))
            two_point &= bool(np.all((out == up) | (out == down)))
            is_up = (out == up) & random
            lo = np.where(is_up, mid + 1, lo)
            hi = np.where(is_up, hi, mid)
        self.two_point = two_point  # every scripted output was one of the two values
        self.up = up.astype(np.float64)
        self.down = down.astype(np.float64)
        self.prob = np.where(random, lo / FULL, 0.0)
        self.random = random

    # exact moments, per row
    @property
    def mean(self) -> np.ndarray:
        return self.prob * self.up + (1 - self.prob) * self.down

    @property
    def var_coord(self) -> np.ndarray:
        return self.prob * (1 - self.prob) * (self.up - self.down) ** 2

    def mse(self, scale: float = 1.0) -> np.ndarray:
        """``E||scale * C(x) - x||^2`` per row."""
        up, down = scale * self.up - self.x, scale * self.down - self.x
        return np.sum(self.prob * up**2 + (1 - self.prob) * down**2, axis=1)

    @property
    def variance(self) -> np.ndarray:
        """``E||C(x) - E C(x)||^2`` per row."""
        return self.var_coord.sum(axis=1)

    @property
    def second_moment(self) -> np.ndarray:
        """``E||C(x)||^2`` per row."""
        return np.sum(self.prob * self.up**2 + (1 - self.prob) * self.down**2, axis=1)

    @property
    def nnz(self) -> np.ndarray:
        """Expected number of nonzero entries per row."""
        return np.sum(self.prob * (self.up != 0) + (1 - self.prob) * (self.down != 0), axis=1)


def _patterns(k: int) -> np.ndarray:
    return np.array(list(itertools.product([0, 1], repeat=k)), bool).reshape(-1, k)


def enumerate_outcomes(comp, tp: TwoPoint, row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every joint outcome of ``comp(key, x)`` for ``x = tp.x[row]`` (at most 14 random
    coordinates).

    Returns ``(outputs, weights)``: ``outputs[j]`` is the library's output when
    the random coordinates in pattern ``j`` round up and the others down, and
    ``weights[j]`` its probability under the per-coordinate probabilities read
    off the library (``tp.prob[row]``).
    """
    x = tp.x[row].astype(np.float32)
    random = np.flatnonzero(tp.random[row])
    if len(random) > 14:
        raise ValueError(f"{len(random)} random coordinates: too many to enumerate")
    patterns = _patterns(len(random))
    ms = np.full((len(patterns), x.size), LAST, np.int64)
    ms[:, random] = np.where(patterns, 0, LAST)
    outputs = run_scripted(comp, np.broadcast_to(x, ms.shape), ms).astype(np.float64)
    p = tp.prob[row, random]
    weights = np.prod(np.where(patterns, p, 1 - p), axis=1)
    return outputs, weights


def outcomes_consistent(outputs, tp: TwoPoint, row: int = 0) -> bool:
    """Every enumerated output has coordinate ``i`` equal to its up or down value,
    up exactly where the pattern says (coordinates depend on their own draw only)."""
    random = np.flatnonzero(tp.random[row])
    patterns = _patterns(len(random))
    expect = np.broadcast_to(tp.down[row], outputs.shape).copy()
    expect[:, random] = np.where(patterns, tp.up[row, random], tp.down[row, random])
    return bool(np.array_equal(outputs, expect))


# -- Monte Carlo with real keys -----------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 1))
def _draws_many(comps, sizes, xs, seed):
    out = []
    for i, (comp, n, x) in enumerate(zip(comps, sizes, xs, strict=True)):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), n)
        out.append(jax.vmap(lambda k, c=comp, x=x: c(k, x).astype(jnp.float32))(keys))
    return out


def draws_many(jobs, seed: int = 0) -> list[np.ndarray]:
    """Independent draws for several ``(comp, x, n)`` jobs in one compiled program.

    Job ``i`` gives ``n`` draws of ``comp(key, x)`` with threefry keys (split
    from ``fold_in(key(seed), i)``), as float64 ``(n, x.size)``.
    """
    comps = tuple(c for c, _, _ in jobs)
    sizes = tuple(int(n) for _, _, n in jobs)
    xs = tuple(jnp.asarray(x, jnp.float32) for _, x, _ in jobs)
    out = _draws_many(comps, sizes, xs, seed)
    return [np.asarray(o, np.float64).reshape(n, -1) for o, n in zip(out, sizes, strict=True)]


def draws(comp, x, n: int, seed: int = 0) -> np.ndarray:
    """``n`` independent draws of ``comp(key, x)`` with threefry keys, float64 ``(n, d)``."""
    return draws_many([(comp, x, n)], seed)[0]


def chi2_mean(samples: np.ndarray, x: np.ndarray, var: np.ndarray, p: float = 1e-6):
    """Chi-square statistic of the sample mean against ``x`` given per-entry variances.

    Returns ``(chi2, bound, dof, fixed_ok)``: the statistic over entries with
    positive variance, its ``1 - p`` quantile (a correct sampler exceeds it
    with probability ``p``), the degrees of freedom, and whether the entries
    with zero variance are always exactly ``x``.
    """
    n = samples.shape[0]
    x = np.asarray(x, np.float64).reshape(-1)
    random = var > 0
    fixed_ok = bool(np.all(samples[:, ~random] == x[~random]))
    dof = int(random.sum())
    if dof == 0:
        return 0.0, 0.0, 0, fixed_ok
    z = (samples[:, random].mean(0) - x[random]) / np.sqrt(var[random] / n)
    return float(np.sum(z**2)), float(stats.chi2.isf(p, dof)), dof, fixed_ok


def z_mean(values: np.ndarray, expected: float) -> float:
    """``(mean - expected) / standard error`` of i.i.d. ``values``."""
    se = values.std(ddof=1) / math.sqrt(len(values))
    return float((values.mean() - expected) / se) if se > 0 else 0.0


Z = 5.0  # Monte Carlo tolerance in standard errors (two-sided p ~ 6e-7)


# -- test vectors -----------------------------------------------------------------------
def test_vectors(d: int, count: int, seed: int) -> np.ndarray:
    """``count`` vectors of ``d`` entries: Gaussian, heavy-tailed, sparse, equal magnitudes,
    one dominant entry, geometric decay, mixed scales."""
    rng = np.random.default_rng(seed)
    families = [
        lambda: rng.standard_normal(d),
        lambda: rng.standard_cauchy(d),
        lambda: rng.standard_normal(d) * (rng.random(d) < max(2 / d, 0.1)),
        lambda: rng.choice([-1.0, 1.0], d),
        lambda: np.concatenate([[10.0], rng.standard_normal(d - 1) * 0.1]),
        lambda: rng.choice([-1.0, 1.0], d) * 0.7 ** np.arange(d),
        lambda: rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 3, d),
    ]
    out = []
    for i in range(count):
        v = families[i % len(families)]()
        if not np.any(v):
            v[0] = 1.0
        out.append(v)
    return np.asarray(out, np.float32)


def fmt(v: float, digits: int = 4) -> str:
    """A number with ``digits`` significant digits."""
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def sq(x) -> np.ndarray:
    """Squared Euclidean norm of each row, float64."""
    x = np.asarray(x, np.float64)
    return np.sum(x * x, axis=-1)


def sampler_agreement(cases, n: int) -> tuple[bool, float, float, list[str]]:
    """Real-key draws of each case against its exact per-coordinate moments.

    Args:
      cases: ``(label, comp, table, row, seed)`` with ``table`` a
        :class:`TwoPoint` whose ``row`` is the input.
      n: draws per case.

    Returns:
      ``(ok, worst chi2/quantile, worst |z|, one detail string per case)``: the
      mean passes a chi-square test at false-alarm probability 1e-6 and the
      mean squared error is within :data:`Z` standard errors of the exact one.
    """
    ok, worst_chi, worst_z, parts = True, 0.0, 0.0, []
    for label, comp, tp, row, seed in cases:
        x = tp.x[row].astype(np.float32)
        samples = draws(comp, x, n, seed=seed)
        chi2, bound, dof, fixed_ok = chi2_mean(samples, x, tp.var_coord[row])
        z = z_mean(sq(samples - tp.x[row]), float(tp.mse()[row]))
        ok &= chi2 < bound and fixed_ok and abs(z) < Z
        worst_chi = max(worst_chi, chi2 / bound if bound else 0.0)
        worst_z = max(worst_z, abs(z))
        parts.append(f"{label}: χ²={fmt(chi2)} vs {fmt(bound)} (dof {dof}), z={fmt(z, 3)}")
    return ok, worst_chi, worst_z, parts
