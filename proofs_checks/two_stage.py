"""The two-stage (scatter-gather) compressed mean: unbiased, exact variance, the bound.

``compjax.compressed_mean(comp, key, x_i, axis, "scatter_gather")``: worker ``i``
pads its ``d`` entries to ``n m`` (``m = ceil(d/n)``), compresses each of its
``n`` shards (first stage ``C_1``, independent keys), shard ``j`` goes to
worker ``j``, which sums ``S_j = sum_i C_1(x_i^j)``, compresses ``S_j`` again
(second stage ``C_2``, an independent key) and all-gathers it; the mean is
``concat_j C_2(S_j) / n``.  For an unbiased compressor, conditioning on the
first stage (law of total variance):

    E||mean - x_bar||^2 = (1/n^2) [ sum_i V(x_i) + E V(S) ],
    V(y) = E||C(y) - y||^2 summed over the shards of y,
    E V(S) <= omega E||S||^2 = omega (||sum_i x_i||^2 + sum_i V(x_i)),

so with ``V(y) <= omega ||y||^2`` (``omega = comp.omega(m)``, the shard's size):
``E||mean - x_bar||^2 <= (1/n^2) [(1 + omega) omega sum_i ||x_i||^2 +
omega ||sum_i x_i||^2]``, with equality for scaled random-k, whose variance is
exactly ``(m/k - 1)||y||^2`` on every shard.

Everything is measured on the library's own exchange under ``jax.vmap`` over
``n = 4`` workers (``d = 101``, so the last shard is padded), many PRNG keys
at once.  ``V`` is computed in closed form per shard (QSGD:
``(||y||/s)^2 sum_k p_k(1 - p_k)``, ``p_k = frac(s|y_k|/||y||)``; natural
compression: ``(2^(a+1) - |y_k|)(|y_k| - 2^a)``; random-k: ``(m/k - 1)||y||^2``),
checked against the library's exact variance (scripted keys, ``_common``).
``E V(S)`` is averaged over the first-stage sums ``S`` of the same draws:
the first stage is re-run with the library's compressor and the keys the
exchange derives, and the re-run is checked bit for bit against the
first-stage messages the exchange itself returns (``Exchanged.local``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from compjax.compressors.natural import Natural
from compjax.compressors.qsgd import QSGD
from compjax.compressors.rand_k import RandK
from compjax.exchange import compressed_mean, two_stage_bound, two_stage_variance
from proofs_checks import check, result
from proofs_checks._common import TwoPoint, Z, chi2_mean, fmt, sq, z_mean

SOURCE = "compjax.exchange (law of total variance)"
AXIS = "data"
N = 4  # workers
D = 101  # entries per worker: shards of m = 26, the last one padded with 3 zeros
COMPRESSORS = (
    ("QSGD s=2", compjax.qsgd(2)),
    ("QSGD s=4", compjax.qsgd(4)),
    ("natural", compjax.natural()),
    ("rand-k ratio ¼", compjax.rand_k(ratio=0.25)),
)
INPUTS_FAST = ("shared", "cancelling")
INPUTS_FULL = ("shared", "cancelling", "independent")


def inputs(kind: str, seed: int) -> np.ndarray:
    """``n`` workers' vectors of ``D`` entries.

    * ``shared``: a common vector plus worker noise of scales 0.3…2 (the
      second-stage term ``omega ||sum_i x_i||^2`` dominates);
    * ``cancelling``: the vectors sum to almost zero, so the second stage
      compresses (mostly) first-stage noise: ``E V(S)`` differs from ``V(sum x)``;
    * ``independent``: zero-mean vectors of scales 0.1…10, one of them sparse.
    """
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((N, D))
    if kind == "shared":
        x = rng.standard_normal(D) + np.array([0.3, 0.6, 1.0, 2.0])[:, None] * z
    elif kind == "cancelling":
        x = z.copy()
        x[-1] = -z[:-1].sum(0) + 0.05 * rng.standard_normal(D)
    elif kind == "independent":
        x = np.array([0.1, 1.0, 3.0, 10.0])[:, None] * z
        x[1] *= rng.random(D) < 0.2
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


def shard(x: np.ndarray) -> np.ndarray:
    """``(..., d)`` to ``(..., n, m)``: the exchange's shards, zero-padded."""
    m = -(-x.shape[-1] // N)
    pad = [(0, 0)] * (x.ndim - 1) + [(0, N * m - x.shape[-1])]
    return np.pad(x, pad).reshape(*x.shape[:-1], N, m)


# -- closed-form variances -------------------------------------------------------------
def coord_var(comp, y) -> np.ndarray:
    """Per-entry variance ``Var C(y)_k`` of one compressor call on each row of ``y``
    (the rows are the calls: shards), in float64, in closed form."""
    y = np.asarray(y, np.float64)
    length = y.shape[-1]
    if isinstance(comp, QSGD) and comp.bucket_size is None:
        s = comp.levels
        norm = np.sqrt(sq(y))[..., None]
        ratio = np.minimum(np.divide(np.abs(y), norm, out=np.zeros_like(y), where=norm > 0), 1)
        p = s * ratio - np.floor(s * ratio)
        return (norm / s) ** 2 * p * (1 - p)
    if isinstance(comp, Natural):
        a = np.abs(y)
        low = np.ldexp(0.5, np.frexp(a)[1])  # 2^floor(log2 |y|): |y| in [low, 2 low)
        return np.where(a > 0, (2 * low - a) * (a - low), 0.0)
    if isinstance(comp, RandK) and comp.scaled and not comp.shared_seed:
        k = comp.k_for(length)
        return (length / k - 1) * y**2
    raise NotImplementedError(f"no closed-form variance for {comp!r}")


def variance(comp, y) -> np.ndarray:
    """``V(y) = E||C(y) - y||^2`` summed over the last two axes (shards, entries)."""
    return coord_var(comp, y).sum(axis=(-2, -1))


# -- the library's exchange, many keys at once ---------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _scatter_gather(comp, xs, keys):
    """Per key: the exchange's mean, the re-run first-stage sums ``S`` (``(n, m)``), the
    largest disagreement of the re-run with ``Exchanged.local``, and the largest
    disagreement between workers' means."""
    n, d = xs.shape
    m = -(-d // n)
    shards = jnp.pad(xs, ((0, 0), (0, n * m - d))).reshape(n, n, m)
    valid = (jnp.arange(n * m) < d).reshape(n, m)
    diagonal = jnp.eye(n, dtype=bool)[:, :, None]

    def draw(key):
        def worker(x):
            out = compressed_mean(comp, key, x, AXIS, "scatter_gather")
            return out.mean, out.local

        mean, local = jax.vmap(worker, axis_name=AXIS)(xs)
        # The first stage again: worker i's shard keys as compjax.exchange derives them.
        first_key, _ = jax.random.split(key)

        def stage_1(i, rows):
            shard_keys = jax.random.split(jax.random.fold_in(first_key, i), n)
            return jax.vmap(comp)(shard_keys, rows).astype(jnp.float32)

        decoded = jax.vmap(stage_1)(jnp.arange(n), shards)  # (worker i, shard j, m)
        s = decoded[0]
        for i in range(1, n):  # in the order of compjax.exchange.scatter.decoded_sum
            s = s + decoded[i]
        # Exchanged.local of worker i: C_1(x_i^j) on shards j != i, and
        # C_1(x_i^i) + C_2(S_i) - S_i on its own shard, where C_2(S_i) = n mean^i.
        local = jnp.pad(local, ((0, 0), (0, n * m - d))).reshape(n, n, m)
        sent = (n * jnp.pad(mean[0], (0, n * m - d))).reshape(n, m)
        expect = jnp.where(diagonal, decoded + (sent - s)[None], decoded)
        mismatch = jnp.max(jnp.where(valid[None], jnp.abs(local - expect), 0.0))
        spread = jnp.max(jnp.abs(mean - mean[0]))
        return mean[0], s, mismatch, spread

    return jax.vmap(draw)(keys)


@functools.partial(jax.jit, static_argnums=0)
def _all_gather(comp, xs, keys):
    one = lambda key: jax.vmap(  # noqa: E731
        lambda x: compressed_mean(comp, key, x, AXIS, "all_gather").mean, axis_name=AXIS
    )(xs)[0]
    return jax.vmap(one)(keys)


def _keys(seed: int, count: int):
    return jax.random.split(jax.random.key(seed), count)


class Case:
    """One compressor on one input set: the library's draws and the closed forms."""

    def __init__(self, label, comp, kind, x, draws, seed):
        self.label, self.comp, self.kind = label, comp, kind
        self.x = x.astype(np.float64)
        self.xbar = self.x.mean(0)
        mean, s, mismatch, spread = _scatter_gather(comp, jnp.asarray(x), _keys(seed, draws))
        self.mean = np.asarray(mean, np.float64)
        self.s = np.asarray(s)  # float32, as the second stage sees it
        self.mismatch = float(np.max(mismatch))
        self.spread = float(np.max(spread))
        self.m = self.s.shape[-1]
        # Closed forms.
        self.v1 = variance(comp, shard(x))  # V_1(x_i), per worker
        v2_coord = coord_var(comp, self.s)  # (draws, n, m)
        self.v2 = v2_coord.sum(axis=(1, 2))  # V_2(S) per draw
        self.v2_at_sum = float(variance(comp, shard(x.astype(np.float32).sum(0))))
        v1_coord = coord_var(comp, shard(x)).sum(0)  # (n, m)
        self.var_coord = ((v1_coord + v2_coord.mean(0)) / N**2).reshape(-1)[:D]
        # n^2 ||mean - x_bar||^2 per draw, and the prediction via the library's formula.
        self.err = N**2 * sq(self.mean - self.xbar)
        self.predicted = two_stage_variance(list(self.v1), float(self.v2.mean()), N)
        self.measured = float(self.err.mean()) / N**2

    def z(self, first=1.0, second=1.0) -> float:
        """z of ``n^2 ||mean - x_bar||^2 - first sum_i V_1 - second V_2(S)`` (paired per draw)."""
        return z_mean(self.err - second * self.v2, first * float(self.v1.sum()))

    def se(self) -> float:
        return float(self.err.std(ddof=1) / math.sqrt(len(self.err))) / N**2

    def bound(self, omega_factor=1.0):
        w = omega_factor * self.comp.omega(self.m)
        return two_stage_bound(list(sq(self.x)), float(sq(self.x.sum(0))), w, w)


def _v1_against_library(cases) -> tuple[float, list[str]]:
    """The closed-form first-stage variance against the library's exact one (scripted
    keys, QSGD and natural compression): the largest relative difference."""
    worst, names = 0.0, []
    for c in cases:
        if isinstance(c.comp, RandK) or c.comp in names:
            continue
        names.append(c.comp)
        rows = shard(c.x.astype(np.float32)).reshape(-1, c.m)
        exact = TwoPoint(c.comp, rows).variance
        closed = coord_var(c.comp, rows).sum(-1)
        worst = max(worst, float(np.max(np.abs(closed - exact) / np.maximum(sq(rows), 1e-30))))
    return worst, [repr(n) for n in names]


@check
def scatter_gather(fast: bool):
    draws = 4000 if fast else 20000
    kinds = INPUTS_FAST if fast else INPUTS_FULL
    cases = []
    for i, kind in enumerate(kinds):
        x = inputs(kind, seed=1200 + i)
        for j, (label, comp) in enumerate(COMPRESSORS):
            cases.append(Case(label, comp, kind, x, draws, seed=1300 + 10 * i + j))
    name = lambda c: f"{c.label}, {c.kind}"  # noqa: E731
    setup = (
        f"n = {N} workers under jax.vmap, d = {D} (shards of m = {-(-D // N)}, the last "
        f"padded), inputs {', '.join(kinds)}; {draws} keys per case, one jitted program "
        f"per compressor."
    )
    rows = []

    # 1. Unbiased.
    chi_worst, chi_ok, parts = 0.0, True, []
    for c in cases:
        chi2, bound, _dof, fixed_ok = chi2_mean(c.mean, c.xbar, c.var_coord)
        chi_ok &= chi2 < bound and fixed_ok and c.spread == 0
        chi_worst = max(chi_worst, chi2 / bound)
        parts.append(f"{name(c)}: χ²={fmt(chi2)} vs {fmt(bound)}")
    rows.append(
        result(
            "scatter-gather mean of an unbiased compressor is unbiased: E mean = x̄ "
            "(QSGD s=2, 4; natural; random-k)",
            SOURCE,
            f"max χ²/χ²₁₋₁ₑ₋₆ = {fmt(chi_worst, 3)}",
            "χ² < its 1−1e-6 quantile (dof 101); every worker holds the same mean",
            chi_ok,
            f"{setup} Per-entry variances from the closed form (E V₂ averaged over the "
            f"draws). " + "; ".join(parts) + ".",
        )
    )

    # 2. Exact variance, and that the test would reject wrong formulas.
    wrong = {
        "no first-stage term": (0.0, 1.0),
        "first stage doubled": (2.0, 1.0),
        "no second-stage term": (1.0, 0.0),
        "second stage doubled": (1.0, 2.0),
    }
    worst_z, rejected, parts, at_sum = 0.0, {w: np.inf for w in wrong}, [], []
    for c in cases:
        z = c.z()
        worst_z = max(worst_z, abs(z))
        for w, (a, b) in wrong.items():
            rejected[w] = min(rejected[w], abs(c.z(a, b)))
        # V_2 at the exact sum instead of averaged over S: a subtler mistake.
        z_at_sum = z_mean(c.err - c.v1.sum(), c.v2_at_sum)
        at_sum.append((name(c), z_at_sum))
        share = c.v1.sum() / (c.v1.sum() + c.v2.mean())
        parts.append(
            f"{name(c)}: measured {fmt(c.measured)} ± {fmt(c.se(), 2)}, exact "
            f"{fmt(c.predicted)} (first stage {fmt(100 * share, 3)}%), z={fmt(z, 3)}"
        )
    v1_dev, v1_comps = _v1_against_library(cases)
    mismatch = max(c.mismatch for c in cases)
    power_ok = all(r >= Z for r in rejected.values())
    ok = worst_z < Z and power_ok and mismatch == 0 and v1_dev <= 1e-6
    rows.append(
        result(
            "scatter-gather variance is exactly (1/n²)[Σᵢ V₁(xᵢ) + E V₂(S)] "
            "(compjax.exchange.two_stage_variance)",
            SOURCE,
            f"max |z| = {fmt(worst_z, 3)}; wrong formulas rejected at |z| ≥ "
            f"{fmt(min(rejected.values()), 3)}",
            f"|z| < {Z:g}; each wrong formula |z| ≥ {Z:g} in every case",
            ok,
            f"{setup} z of the paired per-draw difference n²||mean − x̄||² − Σᵢ V₁(xᵢ) − "
            f"V₂(S), with S the draw's own first-stage sums. "
            + "; ".join(parts)
            + ". Power: smallest |z| over the cases for a wrong formula: "
            + ", ".join(f"{w} {fmt(r, 3)}" for w, r in rejected.items())
            + "; V₂ at Σᵢxᵢ instead of E V₂(S) (not required to be rejected): "
            + ", ".join(f"{n} z={fmt(z, 3)}" for n, z in at_sum)
            + f". The re-run first stage equals the exchange's own first-stage messages "
            f"(Exchanged.local) bit for bit in every draw (largest difference {fmt(mismatch)}). "
            f"Closed-form V against the library's exact variance (scripted keys) on every "
            f"first-stage shard, {', '.join(v1_comps)}: max relative difference "
            f"{fmt(v1_dev, 2)} (≤ 1e-6).",
        )
    )

    # 3. The bound: equality for random-k, an upper bound for the others.
    eq_parts, eq_z, eq_closed, eq_meta, eq_power = [], 0.0, 0.0, True, np.inf
    le_parts, le_ratio, le_ok = [], 0.0, True
    for c in cases:
        bound = c.bound()
        if isinstance(c.comp, RandK):
            k = c.comp.k_for(c.m)
            eq_meta &= c.comp.omega(c.m) == c.m / k - 1
            z = z_mean(c.err / N**2, bound)
            eq_z = max(eq_z, abs(z))
            exact_second = c.comp.omega(c.m) * (float(sq(c.x.sum(0))) + float(c.v1.sum()))
            eq_closed = max(
                eq_closed, abs(two_stage_variance(list(c.v1), exact_second, N) - bound) / bound
            )
            eq_power = min(eq_power, abs(z_mean(c.err / N**2, c.bound(2.0))))
            eq_parts.append(
                f"{c.kind}: measured {fmt(c.measured)} ± {fmt(c.se(), 2)}, bound {fmt(bound)}, "
                f"z={fmt(z, 3)}"
            )
        else:
            ratio = c.measured / bound
            le_ratio = max(le_ratio, ratio)
            le_ok &= c.measured - Z * c.se() <= bound and c.predicted <= bound
            le_parts.append(f"{name(c)}: {fmt(ratio, 3)}")
    k = COMPRESSORS[-1][1].k_for(-(-D // N))
    rows.append(
        result(
            "random-k: the variance equals two_stage_bound((1+ω)ω Σᵢ||xᵢ||² + ω||Σᵢxᵢ||²)/n², "
            "ω = comp.omega(m)",
            SOURCE,
            f"max |z| = {fmt(eq_z, 3)}; closed form vs bound {fmt(eq_closed, 2)} (relative)",
            f"|z| < {Z:g}; ω doubled rejected (|z| ≥ {Z:g})",
            eq_z < Z and eq_closed <= 1e-6 and eq_meta and eq_power >= Z,
            f"{setup} rand_k(ratio=0.25) keeps k = {k} of every m = {-(-D // N)}-entry shard "
            f"(all shards are padded to m, so every shard has the same k), variance exactly "
            f"(m/k − 1)||y||² and comp.omega(m) = m/k − 1: {eq_meta}. "
            + "; ".join(eq_parts)
            + f". With ω doubled in the bound: |z| ≥ {fmt(eq_power, 3)}.",
        )
    )
    rows.append(
        result(
            "QSGD and natural compression: scatter-gather variance ≤ two_stage_bound "
            "(ω = comp.omega(m))",
            SOURCE,
            f"max measured/bound = {fmt(le_ratio, 3)}",
            f"≤ 1 (measured − {Z:g} s.e. and the exact value)",
            le_ok,
            f"{setup} measured/bound: " + "; ".join(le_parts) + ".",
        )
    )
    rows.append(_versus_all_gather(cases, draws, setup))
    return rows


def _versus_all_gather(cases, draws, setup):
    """The all-gather mean's variance is (1/n^2) sum_i V(x_i) (whole vectors); the
    scatter-gather variance relative to it (informative)."""
    worst_z, parts, ratios = 0.0, [], []
    for i, c in enumerate(cases):
        if c.kind != cases[0].kind:
            continue
        x32 = c.x.astype(np.float32)
        mean = np.asarray(_all_gather(c.comp, jnp.asarray(x32), _keys(1400 + i, draws)))
        err = sq(mean.astype(np.float64) - c.xbar)
        exact = float(coord_var(c.comp, x32).sum()) / N**2
        z = z_mean(err, exact)
        worst_z = max(worst_z, abs(z))
        ratio = c.predicted / exact
        ratios.append(ratio)
        w2 = c.comp.omega(c.m)
        parts.append(
            f"{c.label}: all-gather {fmt(float(err.mean()))} (exact {fmt(exact)}, z={fmt(z, 3)}), "
            f"scatter-gather/all-gather = {fmt(ratio, 3)} (ω(m) = {fmt(w2, 3)})"
        )
    return result(
        "all-gather variance is (1/n²)Σᵢ V(xᵢ); scatter-gather pays the second stage "
        "on top (ratio reported)",
        SOURCE,
        f"max |z| = {fmt(worst_z, 3)}; scatter-gather/all-gather "
        f"{fmt(min(ratios), 3)}…{fmt(max(ratios), 3)}",
        f"|z| < {Z:g} (the ratio is informative)",
        worst_z < Z,
        f"{setup} Input '{cases[0].kind}', whole vectors compressed on an all-gather (the "
        f"same compressor: random-k keeps a quarter of d). For equal inputs the second stage "
        f"adds ω||x̄||², which does not shrink with n: the ratio is about 1 + ω + n. "
        + "; ".join(parts)
        + ".",
    )
