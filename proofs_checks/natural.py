"""Natural compression (Horváth et al. 2019): unbiased, omega = 1/8, tight, exact on 2^a.

``|t| in [2^a, 2^(a+1))`` is rounded to ``2^(a+1)`` with probability
``(|t| - 2^a)/2^a`` and to ``2^a`` otherwise: per-coordinate variance
``(2^(a+1) - |t|)(|t| - 2^a) <= t^2/8``, with equality at ``|t| = (4/3) 2^a``, and
zero at exact powers of two (which must never be rounded up).
"""

from __future__ import annotations

import numpy as np

import compjax
from proofs_checks import check, result
from proofs_checks._common import TwoPoint, Z, chi2_mean, draws, fmt, sq, z_mean

SOURCE = "Horváth et al. 2019, Thm 1"
EXPONENTS = np.array([-120, -100, -20, -3, -1, 0, 1, 2, 7, 30, 100, 126])


def vectors(d, count, seed):
    """Signed values spread over 2^-120 .. 2^120, plus values near (4/3) 2^a."""
    rng = np.random.default_rng(seed)
    rows = [rng.choice([-1.0, 1.0], d) * 2.0 ** rng.uniform(-120, 120, d) for _ in range(count)]
    rows += [
        np.exp2(rng.integers(-60, 60, d)) * (4 / 3 + eps * rng.standard_normal(d))
        for eps in (1e-4, 1e-2, 0.1)
    ]
    rows += [rng.uniform(1.0, 2.0, d) * np.exp2(rng.integers(-10, 10, d))]
    return np.asarray(rows, np.float32)


@check
def natural_theory(fast: bool):
    comp = compjax.natural()
    d = 64
    xs = vectors(d, 8 if fast else 40, seed=700)
    # The extremal values, and exact powers of two, as extra rows of d entries.
    sgn = np.where(np.arange(d) % 2, -1.0, 1.0)
    a = np.resize(EXPONENTS, d)
    tight = (sgn * np.float32(4 / 3) * np.exp2(a)).astype(np.float32)
    powers = (sgn * np.exp2(np.resize(np.arange(-126, 128), d))).astype(np.float32)
    powers_b = (sgn * np.exp2(np.resize(np.arange(-126, 128)[::-1], d))).astype(np.float32)
    tp = TwoPoint(comp, np.concatenate([xs, tight[None], powers[None], powers_b[None]]))
    x = tp.x
    omega = comp.omega(d)

    # Unbiasedness and the exact per-coordinate variance.
    bias = float(np.max(np.abs(tp.mean - x) / np.abs(x)))
    lo = np.exp2(np.floor(np.log2(np.abs(x))))
    paper = (2 * lo - np.abs(x)) * (np.abs(x) - lo)
    var_dev = float(np.max(np.abs(tp.var_coord - paper) / x**2))

    # omega = 1/8: per coordinate and per vector; tight at (4/3) 2^a.
    per_coord = tp.var_coord / x**2
    worst = float(per_coord[:-3].max() / omega)
    at_tight = per_coord[-3] / omega
    vec_worst = float(np.max(tp.variance / sq(x)) / omega)

    # Powers of two: no randomness, output exactly the input.
    exact = tp.x[-2:]
    unchanged = bool(np.all(~tp.random[-2:]) and np.array_equal(tp.up[-2:], exact))
    unchanged &= bool(np.array_equal(tp.down[-2:], exact))
    samples = draws(comp, tp.x[0].astype(np.float32), 4000 if fast else 40000, seed=50)
    chi2, bound, dof, fixed_ok = chi2_mean(samples, tp.x[0], tp.var_coord[0])
    z = z_mean(sq(samples - tp.x[0]), float(tp.mse()[0]))
    return [
        result(
            "natural compression is unbiased (exact expectation of the library's output)",
            SOURCE,
            f"max |E C(t) − t|/|t| = {fmt(bias, 2)}",
            "≤ 1e-7",
            bias <= 1e-7 and tp.two_point,
            f"{len(x)} vectors of d = {d}, magnitudes 2⁻¹²⁶…2¹²⁷, both signs. Rounding "
            f"probabilities read off the library by bisection over scripted 23-bit draws.",
        ),
        result(
            "natural compression variance is exactly (2^(a+1) − |t|)(|t| − 2^a) per coordinate",
            SOURCE,
            f"max |Var_lib − Var_paper|/t² = {fmt(var_dev, 2)}",
            "≤ 1e-7",
            var_dev <= 1e-7,
            "The library rounds up with probability mantissa/2²³ = (|t| − 2^a)/2^a exactly.",
        ),
        result(
            "natural compression omega = 1/8, attained at |t| = (4/3)·2^a",
            SOURCE,
            f"Var/t² at (4/3)·2^a: {fmt(float(at_tight.min()), 7)}…{fmt(float(at_tight.max()), 7)}"
            f" ×ω; max elsewhere {fmt(worst, 7)}×ω (per coordinate), {fmt(vec_worst, 7)}×ω "
            f"(per vector)",
            "= ω (to 1e-6) at (4/3)·2^a, ≤ ω elsewhere; ω = natural().omega(d) = 1/8",
            bool(np.all(np.abs(at_tight - 1) <= 1e-6))
            and worst <= 1 + 1e-6
            and vec_worst <= 1 + 1e-6
            and omega == 1 / 8,
            f"(4/3)·2^a rounded to float32 for a in {EXPONENTS.tolist()}.",
        ),
        result(
            "natural compression leaves exact powers of two unchanged (never rounds 2^a up)",
            SOURCE,
            f"every scripted draw returns the input: {unchanged}",
            "C(±2^a) = ±2^a for a = −126…127",
            unchanged,
            "Both extreme draws and all bisection draws give the input exactly, so the "
            "variance is exactly 0 (the reference-implementation bug rounds 2^a up).",
        ),
        result(
            "natural compression sampler with real PRNG keys matches the exact mean and variance",
            SOURCE,
            f"χ² = {fmt(chi2)} (dof {dof}); z(MSE) = {fmt(z, 3)}",
            f"χ² < {fmt(bound)} (1−1e-6 quantile); |z| < {Z:g}",
            chi2 < bound and fixed_ok and abs(z) < Z,
            f"{len(samples)} draws of one vector of d = {d} spread over 2⁻¹²⁰…2¹²⁰.",
        ),
    ]
