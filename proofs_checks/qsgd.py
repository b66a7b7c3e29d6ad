"""QSGD (Alistarh et al. 2017), Lemma 3.1, and the exact supremum compjax reports.

Lemma 3.1: ``Q_s`` is unbiased, ``E||Q_s(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2``
and ``E nnz(Q_s(x)) <= s(s + sqrt(d))``.  compjax's ``omega(d)`` is the exact
supremum of the variance ratio: ``d/(4 s^2)`` for ``d < 4 s^2`` (every
``p_i = 1/2``) and ``sqrt(d)/s - 1`` for ``d >= 4 s^2`` (equal magnitudes).
"""

from __future__ import annotations

import math

import numpy as np

import compjax
from proofs_checks import check, result
from proofs_checks._common import (
    FULL,
    TwoPoint,
    Z,
    enumerate_outcomes,
    fmt,
    outcomes_consistent,
    sampler_agreement,
    sq,
    test_vectors,
)

SOURCE = "Alistarh et al. 2017, Lemma 3.1"
# (d, s) cases.  "half": d < 4s^2 and the all-ones vector has every p_i = 1/2
# (s / sqrt(d) = l + 1/2); "equal": d >= 4s^2, extremal at equal magnitudes;
# None: no extremal vector is built (the lemma's bounds are still checked).
CASES_FULL = (
    (8, 1, "equal"),
    (8, 3, None),
    (12, 2, None),
    (4, 1, "half"),
    (16, 2, "half"),
    (64, 4, "half"),
    (36, 9, "half"),
    (100, 15, "half"),
    (16, 1, "equal"),
    (64, 1, "equal"),
    (1000, 1, "equal"),
    (1000, 4, "equal"),
    (4096, 32, "equal"),
    (1000, 64, None),
)
CASES_FAST = ((8, 3, None), (16, 2, "half"), (64, 4, "half"), (64, 1, "equal"), (1000, 1, "equal"))
MC_FULL = ((64, 4), (1000, 1), (1000, 64), (12, 2))
MC_FAST = ((64, 4),)


def lemma_bound(d, s):
    return min(d / s**2, math.sqrt(d) / s)


def bias_tolerance(tp: TwoPoint) -> np.ndarray:
    """Per-row bound on ``||E C(x) - x|| / ||x||`` from the 2^-23 resolution of the
    uniform draws and float32 rounding of the outputs."""
    spread = np.sqrt(sq(tp.up - tp.down))
    return (2.0 / FULL) * spread / np.sqrt(sq(tp.x)) + 1e-6


def extremal(d, kind):
    if kind == "half":
        return np.ones(d, np.float32)
    return np.where(np.arange(d) % 3 == 0, -1.0, 1.0).astype(np.float32)


def vectors(d, count, seed):
    """Test vectors plus perturbations of the all-ones vector (extremal in both regimes)."""
    rng = np.random.default_rng(seed)
    base = test_vectors(d, count, seed)
    near = [np.ones(d) + eps * rng.standard_normal(d) for eps in (1e-3, 1e-2, 0.1, 0.3)]
    return np.concatenate([base, np.asarray(near, np.float32)])


@check
def lemma_3_1(fast: bool):
    cases = CASES_FAST if fast else CASES_FULL
    count = 14 if fast else 56
    bias, bias_ok, var_ratio, nnz_ratio, structure = 0.0, True, 0.0, 0.0, True
    sup = {"half": [], "equal": []}  # (d, s, ratio at extremal / omega, max other / omega)
    meta_ok, tables, enumerated = True, {}, []
    for i, (d, s, kind) in enumerate(cases):
        comp = compjax.qsgd(s)
        xs = vectors(d, count, seed=100 + i)
        ext = extremal(d, kind or "equal")
        tp = TwoPoint(comp, np.concatenate([xs, ext[None]]))
        rel = np.sqrt(sq(tp.mean - tp.x) / sq(tp.x))
        bias = max(bias, float(rel.max()))
        bias_ok &= bool(np.all(rel <= bias_tolerance(tp)))
        structure &= tp.two_point
        tables[(d, s)] = tp
        if d <= 12:
            enumerated.append((d, s, *_enumerate(comp, tp)))
        ratio = tp.variance / sq(tp.x)
        var_ratio = max(var_ratio, float(ratio.max() / lemma_bound(d, s)))
        nnz_ratio = max(nnz_ratio, float(np.max(tp.nnz / (s * (s + math.sqrt(d))))))
        omega = comp.omega(d)
        meta_ok &= omega == compjax.qsgd_omega(d, s) and omega <= lemma_bound(d, s)
        if kind is not None:
            sup[kind].append((d, s, float(ratio[-1] / omega), float(ratio[:-1].max() / omega)))
    enum_ok = all(ok for *_, ok in enumerated)
    cases_txt = ", ".join(f"(d={d}, s={s})" for d, s, _ in cases)
    vec_txt = (
        f"{count + 5} vectors per case (Gaussian, Cauchy, sparse, ±1, spiky, geometric, "
        f"mixed scales, perturbed all-ones, the extremal vector)"
    )
    enum_txt = "; ".join(f"d={d}, s={s}: {n} outcomes" for d, s, n, _ in enumerated)
    return [
        result(
            "QSGD is unbiased: E Q_s(x) = x (exact expectation of the library's output)",
            SOURCE,
            f"max ||E Q(x) − x||/||x|| = {fmt(bias, 2)}",
            "≤ 2⁻²²·||up − down||/||x|| + 1e-6 (draw resolution, float32)",
            bias_ok and structure and enum_ok,
            f"Cases {cases_txt}; {vec_txt}. Rounding probabilities read off the library by "
            f"bisection over scripted 23-bit draws; exhaustive joint enumeration ({enum_txt}) "
            f"agrees with the per-coordinate form: {enum_ok}; every scripted output two-point: "
            f"{structure}.",
        ),
        result(
            "QSGD variance: E||Q_s(x) − x||² ≤ min(d/s², √d/s)·||x||²",
            SOURCE,
            f"max E||Q(x) − x||²/(min(d/s², √d/s)||x||²) = {fmt(var_ratio)}",
            "≤ 1",
            var_ratio <= 1 + 1e-5,
            f"Exact variance of the library's output; cases {cases_txt}; {vec_txt}.",
        ),
        result(
            "QSGD sparsity: E nnz(Q_s(x)) ≤ s(s + √d)",
            SOURCE,
            f"max E nnz/(s(s + √d)) = {fmt(nnz_ratio)}",
            "≤ 1",
            nnz_ratio <= 1 + 1e-9,
            f"Exact expected number of nonzeros of the library's output; cases {cases_txt}.",
        ),
        _supremum(
            sup["half"],
            "QSGD sup_x E||Q−x||²/||x||² = d/(4s²) for d < 4s², attained when every p_i = 1/2",
            "the all-ones vector",
            meta_ok,
        ),
        _supremum(
            sup["equal"],
            "QSGD sup = √d/s − 1 for d ≥ 4s² (s = 1: √d − 1), attained at equal magnitudes",
            "a ±1 vector",
            meta_ok,
        ),
        monte_carlo(fast, tables),
    ]


def _enumerate(comp, tp, row=0):
    """All joint outcomes for row ``row``: (number of outcomes, consistent with the
    per-coordinate exact distribution)."""
    outputs, weights = enumerate_outcomes(comp, tp, row)
    x = tp.x[row]
    mean = weights @ outputs
    mse = weights @ sq(outputs - x)
    ok = outcomes_consistent(outputs, tp, row) and abs(weights.sum() - 1) < 1e-12
    ok &= bool(np.allclose(mean, tp.mean[row], rtol=1e-9, atol=1e-12))
    ok &= abs(mse - tp.mse()[row]) <= 1e-9 * max(mse, 1e-30)
    return len(outputs), ok


def _supremum(rows, claim, where, meta_ok):
    """The variance ratio at the extremal vector equals the library's omega(d) and no
    other test vector exceeds it."""
    at_ext = [r for _, _, r, _ in rows]
    worst_other = max(o for *_, o in rows)
    ok = all(abs(r - 1) <= 1e-5 for r in at_ext) and worst_other <= 1 + 1e-5 and meta_ok
    cases_txt = ", ".join(
        f"(d={d}, s={s}): ω={fmt(compjax.qsgd(s).omega(d))}, ratio/ω={fmt(r, 7)}"
        for d, s, r, _ in rows
    )
    return result(
        claim,
        SOURCE + " (tightened; compjax.qsgd_omega)",
        f"E||Q−x||²/(ω||x||²) at the extremal vector: {fmt(min(at_ext), 7)}…"
        f"{fmt(max(at_ext), 7)}; max over the others {fmt(worst_other, 7)}",
        "= 1 (to 1e-5) at the extremal vector, ≤ 1 elsewhere; ω = qsgd(s).omega(d)",
        ok,
        f"Extremal vector: {where}. Cases {cases_txt}. Exact variance of the library's output. "
        f"omega(d) equals compjax.qsgd_omega(d, s) and is ≤ Lemma 3.1's min(d/s², √d/s) in "
        f"every case: {meta_ok}.",
    )


def monte_carlo(fast, tables):
    """The library's sampler with real (threefry) keys against the exact moments."""
    n = 4000 if fast else 40000
    cases = MC_FAST if fast else MC_FULL
    # Row i % 3 of each table: Gaussian, Cauchy or sparse.
    ok, worst_chi, worst_z, parts = sampler_agreement(
        [
            (f"(d={d}, s={s})", compjax.qsgd(s), tables[(d, s)], i % 3, 10 + i)
            for i, (d, s) in enumerate(cases)
        ],
        n,
    )
    return result(
        "QSGD sampler with real PRNG keys matches the exact mean and variance",
        SOURCE,
        f"max χ²/χ²₁₋₁ₑ₋₆ = {fmt(worst_chi, 3)}; max |z| of the MSE = {fmt(worst_z, 3)}",
        f"χ² < its 1−1e-6 quantile; |z| < {Z:g}",
        ok,
        f"{n} draws per case; " + "; ".join(parts) + ".",
    )
