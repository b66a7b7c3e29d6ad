"""ATOMO (Wang et al. 2018): variance-optimal keep probabilities and special cases.

Atom ``i`` of ``x = sum_i lambda_i a_i`` is kept with probability ``p_i`` and
rescaled by ``1/p_i``: unbiased with variance ``sum_i lambda_i^2 (1/p_i - 1)``.
Under the budget ``sum_i p_i = s`` the minimiser is ``p_i = min(1, c|lambda_i|)``
(water-filling).  With ``s = ||x||_1/||x||_inf`` the entrywise scheme is
TernGrad, with ``s = ||x||_1/||x||_2`` it is QSGD with one level.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from compjax.compressors.atomo import water_fill
from proofs_checks import check, result
from proofs_checks._common import FULL, TwoPoint, fmt, sq, test_vectors

SOURCE = "Wang et al. 2018, §3"
EXAMPLE = np.array([10.0, 5.0, 1.0, 1.0, 1.0, 0.5])
EXAMPLE_P = np.array([1.0, 1.0, 2 / 7, 2 / 7, 2 / 7, 1 / 7])

_water_fill = jax.jit(jax.vmap(water_fill))


def variance(lam, p):
    lam2 = np.asarray(lam, np.float64) ** 2
    p = np.asarray(p, np.float64)
    safe = np.where(p > 0, p, 1.0)
    return np.sum(np.where(p > 0, lam2 * (1 / safe - 1), np.where(lam2 > 0, np.inf, 0.0)), -1)


TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32


def kkt_violation(lam, p, s):
    """Largest relative violation of the KKT conditions of
    min sum lambda^2/p  s.t.  sum p = s, 0 < p <= 1 (at the water-filling solution),
    and the number of atoms left out: those whose |lambda| or exact p is below float32's
    normal range (XLA on CPU flushes subnormals to zero, so they may get p = 0)."""
    lam = np.abs(np.asarray(lam, np.float64))
    p = np.asarray(p, np.float64)
    nz = lam > 0
    budget = abs(p.sum() - s) / s
    underflow = nz & ((p < TINY) | (lam < TINY))
    free = nz & (p < 1 - 1e-6) & ~underflow
    sat = nz & ~free & ~underflow
    zeros = float(np.max(p[~nz])) if (~nz).any() else 0.0
    if not free.any():
        return max(budget, zeros), int(underflow.sum())
    g = lam[free] ** 2 / p[free] ** 2  # -d/dp_i of the objective: equal to the multiplier
    nu = np.median(g)
    spread = float(np.max(np.abs(g - nu)) / nu)
    sat_gap = float(np.max(np.maximum(0.0, nu - lam[sat] ** 2) / nu)) if sat.any() else 0.0
    # Left-out atoms must be subnormal themselves or have an exact p that underflows.
    under = lam[underflow]
    under_ok = bool(np.all((under < TINY) | (under / np.sqrt(nu) < TINY)))
    return max(budget, spread, sat_gap, zeros, 0.0 if under_ok else np.inf), int(underflow.sum())


def random_feasible(rng, d, s, count):
    """Random p in (0, 1]^d with sum s: clip(c u, 1e-9, 1), c set by bisection."""
    u = rng.random((count, d)) ** rng.uniform(0.2, 5.0, (count, 1))
    lo, hi = np.zeros((count, 1)), s / u.min(axis=1, keepdims=True)
    for _ in range(200):
        c = (lo + hi) / 2
        low = np.clip(c * u, 1e-9, 1).sum(axis=1, keepdims=True) < s
        lo, hi = np.where(low, c, lo), np.where(low, hi, c)
    return np.clip(hi * u, 1e-9, 1)


def local_perturbations(rng, p, count, scale):
    """Feasible perturbations of p along zero-sum directions that keep 0 < p <= 1."""
    out = []
    for _ in range(count):
        v = rng.standard_normal(p.shape)
        v -= v.mean()
        step = scale
        while True:
            q = p + step * v
            if np.all(q > 0) and np.all(q <= 1):
                out.append(q)
                break
            step /= 2
    return np.asarray(out)


def instances(fast):
    """(lambda, budget) pairs for the optimality checks."""
    dims = (6, 20, 200) if fast else (6, 20, 100, 1000)
    out = [(EXAMPLE, 3.0)]
    for d in dims:
        for i, lam in enumerate(test_vectors(d, 7, 810 + d)):
            nnz = int(np.count_nonzero(lam))
            for s in (1.0, 2.5, 0.1 * d, 0.5 * d):
                if s < nnz:
                    out.append((np.abs(lam).astype(np.float64), float(s) + 0.1 * (i % 3)))
    return out


@check
def water_filling(fast: bool):
    # Worked example, through water_fill and through the compressor's own sampling.
    p_example = np.asarray(water_fill(jnp.asarray(EXAMPLE, jnp.float32), 3.0), np.float64)
    ex_dev = float(np.max(np.abs(p_example - EXAMPLE_P)))
    comp = compjax.atomo(3.0)
    rng = np.random.default_rng(820)
    batch = np.stack(
        [EXAMPLE, np.ones(6), *(rng.standard_normal((6, 6)) * rng.uniform(0.1, 10, (6, 1)))]
    ).astype(np.float32)
    tp = TwoPoint(comp, batch)
    # P(keep): the bisection probability where random, else whether the atom is always sent.
    keep = np.where(tp.random[0], tp.prob[0], (tp.up[0] != 0).astype(np.float64))
    kept_dev = float(np.max(np.abs(keep - EXAMPLE_P)))

    # KKT conditions and optimality against random feasible p.
    insts = instances(fast)
    kkt, worst_ratio, worst_local, n_rand, n_under = 0.0, math.inf, math.inf, 0, 0
    by_dim = {}
    for lam, s in insts:
        by_dim.setdefault(len(lam), []).append((lam, s))
    for d, group in by_dim.items():
        lams = jnp.asarray(np.stack([g[0] for g in group]), jnp.float32)
        ps = np.asarray(_water_fill(lams, jnp.asarray([g[1] for g in group], jnp.float32)))
        for (lam, s), p in zip(group, ps.astype(np.float64), strict=True):
            violation, under = kkt_violation(lam, p, s)
            kkt, n_under = max(kkt, violation), n_under + under
            if np.any(p >= 1 - 1e-6) or np.any(lam == 0) or d > 200:
                continue  # random comparisons: no saturated or zero atoms
            v_opt = variance(lam, p)
            rand = random_feasible(rng, d, s, 100 if fast else 400)
            worst_ratio = min(worst_ratio, float(np.min(variance(lam, rand) / v_opt)))
            local = local_perturbations(rng, p, 50 if fast else 200, 0.01 * p.min())
            worst_local = min(worst_local, float(np.min(variance(lam, local) / v_opt)))
            n_rand += 1

    # The compressor: unbiased, variance sum lambda^2 (1/p - 1), omega at equal magnitudes.
    magnitudes = jnp.asarray(np.abs(batch))
    p_lib = np.asarray(_water_fill(magnitudes, jnp.full((len(batch),), 3.0)), np.float64)
    var_dev = float(np.max(np.abs(tp.variance - variance(tp.x, p_lib)) / sq(tp.x)))
    bias = float(np.max(np.sqrt(sq(tp.mean - tp.x) / sq(tp.x))))
    omega_ratio = float(tp.variance[1] / sq(tp.x[1]) / comp.omega(6))
    others = float(np.max(tp.variance / sq(tp.x)) / comp.omega(6))

    special = special_cases(fast)
    return [
        result(
            "ATOMO worked example: |λ| = (10, 5, 1, 1, 1, .5), s = 3 → "
            "p = (1, 1, 2/7, 2/7, 2/7, 1/7)",
            "REFERENCES.md (ATOMO row)",
            f"water_fill: max |p − p_ref| = {fmt(ex_dev, 2)}; atomo(3) keeps atoms with "
            f"max |P(keep) − p_ref| = {fmt(kept_dev, 2)}",
            "≤ 1e-6 (float32), ≤ 2⁻²² (draw resolution)",
            ex_dev <= 1e-6 and kept_dev <= 2.0 / FULL + 1e-6,
            "The keep probabilities of the compressor are read off its own sampling by "
            "bisection over scripted 23-bit draws.",
        ),
        result(
            "ATOMO water-filling satisfies the KKT conditions of min Σλ²/p s.t. Σp = s, 0 < p ≤ 1",
            SOURCE,
            f"max relative violation = {fmt(kkt, 2)}",
            "≤ 1e-5",
            kkt <= 1e-5,
            f"{len(insts)} (λ, s) instances, d ∈ {sorted(by_dim)}: Σp = s; λ_i²/p_i² equal for "
            f"unsaturated atoms (the multiplier ν); λ_i² ≥ ν where p_i = 1; p_i = 0 where λ_i = 0. "
            f"{n_under} atoms with a subnormal float32 |λ_i| or exact p_i = |λ_i|/√ν (from "
            f"geometric test vectors; XLA on CPU flushes subnormals to zero, so they get "
            f"p_i = 0) are left out of the stationarity test.",
        ),
        result(
            "ATOMO water-filling is optimal: no random feasible p has lower variance",
            SOURCE,
            f"min Var(p_random)/Var(p_lib) = {fmt(worst_ratio, 6)}; over local perturbations "
            f"{fmt(worst_local, 8)}",
            "≥ 1 (to 1e-6)",
            worst_ratio >= 1 - 1e-6 and worst_local >= 1 - 1e-6 and n_rand > 0,
            f"{n_rand} instances without saturated or zero atoms; {100 if fast else 400} "
            f"random feasible p (clip(c·u, ·, 1) with Σp = s) and {50 if fast else 200} "
            f"feasible zero-sum perturbations each.",
        ),
        result(
            "ATOMO compressor is unbiased with variance Σλ²(1/p − 1); omega(d) = d/s − 1 is "
            "attained at equal magnitudes",
            SOURCE,
            f"max ||E C − x||/||x|| = {fmt(bias, 2)}; max |Var − Σλ²(1/p−1)|/||x||² = "
            f"{fmt(var_dev, 2)}; Var/(ω||x||²) at ±1: {fmt(omega_ratio, 7)}, max {fmt(others, 7)}",
            "≤ 1e-6; ≤ 1e-5; = 1 (to 1e-5), ≤ 1",
            bias <= 1e-6
            and var_dev <= 1e-5
            and abs(omega_ratio - 1) <= 1e-5
            and others <= 1 + 1e-5
            and tp.two_point,
            f"atomo(3.0) on {len(batch)} vectors of d = 6 (the example, all ones, Gaussians at "
            f"several scales); exact moments of the library's output.",
        ),
        *special,
    ]


def _ratio_family(rng, d, count, norm, target):
    """``count`` vectors of ``d`` entries with ||x||_1/||x||_norm = target: |u|^θ with θ
    found by bisection, random signs."""
    out = []
    for _ in range(count):
        u = rng.uniform(0.05, 1.0, d)

        def ratio(theta, u=u):
            v = u**theta
            return v.sum() / (v.max() if norm == "inf" else np.sqrt(np.sum(v * v)))

        lo, hi = 0.0, 400.0  # ratio decreases from its flat value towards 1
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio(mid) > target else (lo, mid)
        out.append(rng.choice([-1.0, 1.0], d) * u**hi)
    return np.asarray(out, np.float32)


def special_cases(fast):
    rng = np.random.default_rng(830)
    d, count = 12, 4 if fast else 12
    rows = []
    for name, other, norm, budget, source in (
        ("TernGrad", compjax.terngrad(), "inf", 5.0, "s = ||x||₁/||x||_∞"),
        ("QSGD with s = 1", compjax.qsgd(1), "2", 2.5, "s = ||x||₁/||x||₂"),
    ):
        xs = _ratio_family(rng, d, count, norm, budget)
        a = TwoPoint(compjax.atomo(budget), xs)
        b = TwoPoint(other, xs)
        nrm = np.sqrt(sq(a.x))[:, None]
        value_dev = max(
            float(np.max(np.abs(a.up - b.up) / nrm)), float(np.max(np.abs(a.down - b.down) / nrm))
        )
        prob_dev = float(np.max(np.abs(a.prob - b.prob)))
        var_dev = float(np.max(np.abs(a.variance - b.variance) / sq(a.x)))
        rows.append(
            result(
                f"ATOMO with {source} is {name}: the same distribution, coordinate by coordinate",
                SOURCE + " (special cases)",
                f"max |Δ value|/||x|| = {fmt(value_dev, 2)}; max |Δ P(up)| = {fmt(prob_dev, 2)}; "
                f"max |Δ Var|/||x||² = {fmt(var_dev, 2)}",
                "≤ 1e-6; ≤ 1e-6; ≤ 1e-5",
                value_dev <= 1e-6 and prob_dev <= 1e-6 and var_dev <= 1e-5,
                f"atomo({budget}) against {name} on {count} random vectors of d = {d} with "
                f"{source.split(' = ')[1]} = {budget}; both distributions read off the library.",
            )
        )
    return rows
