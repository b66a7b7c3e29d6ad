"""TernGrad (Wen et al. 2017): unbiasedness, exact variance, supremum, Assumption 3.

``C(g) = s sign(g) * b`` with ``s = ||g||_inf`` and ``b_k ~ Bernoulli(|g_k|/s)``:
unbiased, per-coordinate variance ``|g_k|(s - |g_k|)``, so
``E||C(g)||^2 = ||g||_inf ||g||_1`` -- the quantity TernGrad's Assumption 3
bounds in place of ``||g||^2`` (a stronger assumption because
``||g||_inf ||g||_1 >= ||g||^2``).  The supremum of the variance ratio is
``(sqrt(d) - 1)/2``, attained at ``(1, b, ..., b)``, ``b = 1/(sqrt(d) + 1)``.
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

SOURCE = "Wen et al. 2017, §3"
DIMS_FAST = (8, 64, 1000)
DIMS_FULL = (2, 8, 12, 64, 100, 1000, 4096)


def extremal(d):
    b = 1.0 / (math.sqrt(d) + 1.0)
    x = np.full(d, b)
    x[0] = 1.0
    return x


def vectors(d, count, seed):
    """Test vectors, perturbations of the extremal one, and the extremal one (last)."""
    rng = np.random.default_rng(seed)
    ext = extremal(d)
    near = []
    for f in (0.7, 0.95, 1.05, 1.3):
        v = ext.copy()
        v[1:] *= f
        near.append(v)
    near += [ext + eps * rng.standard_normal(d) * ext for eps in (1e-3, 1e-2)]
    return np.concatenate([test_vectors(d, count, seed), np.asarray(near), ext[None]]).astype(
        np.float32
    )


@check
def terngrad_theory(fast: bool):
    dims = DIMS_FAST if fast else DIMS_FULL
    count = 14 if fast else 56
    comp = compjax.terngrad()
    bias, bias_ok, var_dev, var_ok, structure, enum_ok = 0.0, True, 0.0, True, True, True
    sup_ext, sup_other, meta_ok = [], 0.0, True
    a3_min, a3_dev, a3_ok = math.inf, 0.0, True
    tables = {}
    for i, d in enumerate(dims):
        tp = TwoPoint(comp, vectors(d, count, seed=400 + i))
        tables[d] = tp
        x = tp.x
        nrm2 = sq(x)
        structure &= tp.two_point
        spread2 = sq(tp.up - tp.down)
        rel = np.sqrt(sq(tp.mean - x) / nrm2)
        bias = max(bias, float(rel.max()))
        bias_ok &= bool(np.all(rel <= 2.0 / FULL * np.sqrt(spread2 / nrm2) + 1e-6))
        # The paper's variance, in float64 from x.
        s = np.max(np.abs(x), axis=1, keepdims=True)
        paper = np.sum(np.abs(x) * (s - np.abs(x)), axis=1)
        dev = np.abs(tp.variance - paper)
        var_dev = max(var_dev, float(np.max(dev / nrm2)))
        var_ok &= bool(np.all(dev <= 2.0 / FULL * spread2 + 1e-5 * paper + 1e-7 * nrm2))
        omega = comp.omega(d)
        meta_ok &= omega == compjax.terngrad_omega(d) == (math.sqrt(d) - 1) / 2
        ratio = tp.variance / nrm2
        sup_ext.append((d, float(ratio[-1] / omega)))
        sup_other = max(sup_other, float(ratio[:-1].max() / omega))
        # Assumption 3: E||C(g)||^2 = ||g||_inf ||g||_1 >= ||g||^2.
        linf_l1 = s[:, 0] * np.sum(np.abs(x), axis=1)
        a3_min = min(a3_min, float(np.min(linf_l1 / nrm2)))
        a3_err = np.abs(tp.second_moment - linf_l1)
        a3_dev = max(a3_dev, float(np.max(a3_err / linf_l1)))
        a3_ok &= bool(np.all(a3_err <= 2.0 / FULL * spread2 + 1e-5 * linf_l1))
        if d <= 12:
            outputs, weights = enumerate_outcomes(comp, tp, 0)
            enum_ok &= outcomes_consistent(outputs, tp, 0)
            enum_ok &= bool(np.allclose(weights @ outputs, tp.mean[0], rtol=1e-9, atol=1e-12))
    dims_txt = ", ".join(map(str, dims))
    vec_txt = (
        f"{count + 7} vectors per d (Gaussian, Cauchy, sparse, ±1, spiky, geometric, mixed "
        f"scales, six perturbations of the extremal vector, the extremal vector)"
    )
    return [
        result(
            "TernGrad is unbiased: E C(g) = g (exact expectation of the library's output)",
            SOURCE,
            f"max ||E C(g) − g||/||g|| = {fmt(bias, 2)}",
            "≤ 2⁻²²·||up − down||/||g|| + 1e-6 (draw resolution, float32)",
            bias_ok and structure and enum_ok,
            f"d = {dims_txt}; {vec_txt}. Exhaustive joint enumeration for d ≤ 12 agrees: "
            f"{enum_ok}; every scripted output two-point: {structure}.",
        ),
        result(
            "TernGrad variance is exactly Σ_k |g_k|(||g||_∞ − |g_k|)",
            SOURCE,
            f"max |Var_lib − Var_paper|/||g||² = {fmt(var_dev, 2)}",
            "≤ 2⁻²²·||up − down||² + 1e-5·Var (draw resolution, float32)",
            var_ok,
            f"Exact variance of the library's output against the formula in float64; d = "
            f"{dims_txt}.",
        ),
        result(
            "TernGrad sup_g E||C(g)−g||²/||g||² = (√d − 1)/2, attained at (1, b, …, b), "
            "b = 1/(√d + 1)",
            SOURCE + " (sup: compjax.terngrad_omega)",
            f"ratio/ω at the extremal vector: {fmt(min(r for _, r in sup_ext), 7)}…"
            f"{fmt(max(r for _, r in sup_ext), 7)}; max over the others {fmt(sup_other, 7)}",
            "= 1 (to 1e-5) at the extremal vector, ≤ 1 elsewhere; ω = terngrad().omega(d)",
            all(abs(r - 1) <= 1e-5 for _, r in sup_ext) and sup_other <= 1 + 1e-5 and meta_ok,
            f"d = {dims_txt}; omega(d) = terngrad_omega(d) = (√d − 1)/2 in every case: "
            f"{meta_ok}. Perturbing b by ±5% or ±30% lowers the ratio.",
        ),
        result(
            "TernGrad Assumption 3: E||C(g)||² = ||g||_∞||g||_1 ≥ ||g||²",
            "Wen et al. 2017, Assumption 3",
            f"min ||g||_∞||g||_1/||g||² = {fmt(a3_min)}; max |E||C(g)||² − ||g||_∞||g||_1| "
            f"/ (||g||_∞||g||_1) = {fmt(a3_dev, 2)}",
            "≥ 1; second moment equal up to 2⁻²²·||up − down||² + 1e-5 (draw resolution)",
            a3_min >= 1 - 1e-12 and a3_ok,
            f"The exact second moment of the library's output is the quantity Assumption 3 "
            f"bounds; d = {dims_txt}.",
        ),
        monte_carlo(fast, tables),
    ]


def monte_carlo(fast, tables):
    n = 4000 if fast else 40000
    dims = (64,) if fast else (64, 1000, 12)
    comp = compjax.terngrad()
    ok, worst_chi, worst_z, parts = sampler_agreement(
        [(f"d={d}", comp, tables[d], i % 3, 20 + i) for i, d in enumerate(dims)], n
    )
    return result(
        "TernGrad sampler with real PRNG keys matches the exact mean and variance",
        SOURCE,
        f"max χ²/χ²₁₋₁ₑ₋₆ = {fmt(worst_chi, 3)}; max |z| of the MSE = {fmt(worst_z, 3)}",
        f"χ² < its 1−1e-6 quantile; |z| < {Z:g}",
        ok,
        f"{n} draws per case; " + "; ".join(parts) + ".",
    )
