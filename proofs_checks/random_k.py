"""Random-k sparsification: ``omega = d/k - 1`` exactly, for every ``x``.

Scaled by ``d/k``, random-k is unbiased with ``E||C(x) - x||^2 = (d/k - 1)||x||^2``
for every ``x`` (not only in the worst case); unscaled, the error is exactly
``(1 - k/d)||x||^2`` (``delta = k/d``).  Both follow from each coordinate being
kept with probability ``k/d``; the checks enumerate every one of the
``C(d, k)`` subsets through the library's own output and test that the
library's sampler picks them uniformly.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

import compjax
from proofs_checks import check, result
from proofs_checks._common import Z, chi2_mean, draws_many, fmt, sq, test_vectors, z_mean

SOURCE = "Stich et al. 2018; Wangni et al. 2018"
CASES_FAST = ((6, 2), (8, 3))
CASES_FULL = ((6, 2), (8, 3), (10, 5), (7, 1), (9, 8))


def subsets_of(samples: np.ndarray):
    """Distinct kept-sets among the draws: (masks, index of each draw's set, one output each)."""
    masks = samples != 0
    keys, inverse = np.unique(masks, axis=0, return_inverse=True)
    outputs = np.stack([samples[np.flatnonzero(inverse == j)[0]] for j in range(len(keys))])
    deterministic = all(
        np.array_equal(
            samples[inverse == j], np.broadcast_to(outputs[j], samples[inverse == j].shape)
        )
        for j in range(len(keys))
    )
    return keys, inverse.reshape(-1), outputs, deterministic


LARGE = (1000, 10)


@check
def omega_exact(fast: bool):
    cases = CASES_FAST if fast else CASES_FULL
    per_cell = 200 if fast else 1000
    n_large = 40000
    # One compiled program for every draw of this module.
    jobs, inputs = [], []
    for i, (d, k) in enumerate(cases):
        x = test_vectors(d, 1, 500 + i)[0]
        x = np.where(x == 0, 1.0, x).astype(np.float32)  # kept sets identified by nonzeros
        inputs.append(x)
        for scaled in (True, False):
            jobs.append((compjax.rand_k(k=k, scaled=scaled), x, per_cell * math.comb(d, k)))
    if not fast:
        jobs.append((compjax.rand_k(k=LARGE[1]), test_vectors(LARGE[0], 1, 600)[0], n_large))
    samples_all = draws_many(jobs, seed=30)
    rows = []
    scaled_dev, unscaled_dev, bias, all_seen, det, meta = 0.0, 0.0, 0.0, True, True, True
    chi_worst, chi_ok, chi_parts = 0.0, True, []
    for i, (d, k) in enumerate(cases):
        x = inputs[i]
        x64 = x.astype(np.float64)
        n_sets = math.comb(d, k)
        for j, scaled in enumerate((True, False)):
            comp, _, _ = jobs[2 * i + j]
            samples = samples_all[2 * i + j]
            masks, inverse, outputs, deterministic = subsets_of(samples)
            det &= deterministic and bool(np.all(masks.sum(1) == k))
            all_seen &= len(masks) == n_sets
            # Exact expectation over uniformly random subsets, through the library's outputs.
            err = float(np.mean(sq(outputs - x64)))
            if scaled:
                omega = d / k - 1
                meta &= comp.omega(d) == omega and comp.unbiased
                scaled_dev = max(scaled_dev, abs(err / (omega * sq(x64)) - 1))
                bias = max(bias, float(np.sqrt(sq(outputs.mean(0) - x64) / sq(x64))))
            else:
                meta &= comp.delta(d) == k / d and not comp.unbiased
                unscaled_dev = max(unscaled_dev, abs(err / ((1 - k / d) * sq(x64)) - 1))
            # Uniformity of the sampler over the subsets.
            counts = np.bincount(inverse, minlength=n_sets)
            expect = len(samples) / n_sets
            chi2 = float(np.sum((counts - expect) ** 2 / expect))
            bound = float(stats.chi2.isf(1e-6, n_sets - 1))
            chi_ok &= chi2 < bound
            chi_worst = max(chi_worst, chi2 / bound)
            if scaled:
                chi_parts.append(
                    f"(d={d}, k={k}): χ²={fmt(chi2)} vs {fmt(bound)}, dof {n_sets - 1}"
                )
    cases_txt = ", ".join(f"(d={d}, k={k}: {math.comb(d, k)} subsets)" for d, k in cases)
    rows.append(
        result(
            "random-k scaled by d/k: E C(x) = x and E||C(x) − x||² = (d/k − 1)||x||² exactly",
            SOURCE,
            f"max |E||C−x||²/((d/k−1)||x||²) − 1| = {fmt(scaled_dev, 2)}; "
            f"max ||E C − x||/||x|| = {fmt(bias, 2)}",
            "≤ 1e-6 (float32); omega(d) = d/k − 1",
            scaled_dev <= 1e-6 and bias <= 1e-6 and all_seen and det and meta,
            f"Every subset of {cases_txt} seen among the library's draws (all seen: {all_seen}); "
            f"each subset's output is deterministic and keeps k entries ({det}); the exact "
            f"expectation is the average over the subsets of the library's outputs. "
            f"comp.omega(d) = d/k − 1, comp.delta(d) = k/d for unscaled: {meta}.",
        )
    )
    rows.append(
        result(
            "random-k unscaled: E||C(x) − x||² = (1 − k/d)||x||² exactly (delta = k/d)",
            SOURCE,
            f"max |E||C−x||²/((1−k/d)||x||²) − 1| = {fmt(unscaled_dev, 2)}",
            "≤ 1e-6 (float32); delta(d) = k/d",
            unscaled_dev <= 1e-6 and all_seen and det and meta,
            f"Same enumeration as above, rand_k(scaled=False); cases {cases_txt}.",
        )
    )
    rows.append(
        result(
            "random-k sampler picks every k-subset with probability 1/C(d, k)",
            SOURCE,
            f"max χ²/χ²₁₋₁ₑ₋₆ = {fmt(chi_worst, 3)}",
            "χ² < its 1−1e-6 quantile",
            chi_ok,
            f"{per_cell}·C(d, k) draws per case, scaled and unscaled; "
            + "; ".join(chi_parts)
            + ".",
        )
    )
    if not fast:
        rows.append(large_d(jobs[-1][1], samples_all[-1]))
    return rows


def large_d(x, samples):
    """d = 1000: inclusion frequencies and the error, by Monte Carlo (full mode)."""
    d, k = LARGE
    n = len(samples)
    x64 = x.astype(np.float64)
    kept = samples != 0
    counts = kept.sum(0)
    p = k / d
    chi_incl = float(np.sum((counts - n * p) ** 2 / (n * p * (1 - p))))
    bound_incl = float(stats.chi2.isf(1e-6, d))
    var = (d / k - 1) * x64**2  # per-coordinate variance of a coordinate kept w.p. k/d
    chi2, bound, _, _ = chi2_mean(samples, x, var)
    z = z_mean(sq(samples - x64), (d / k - 1) * float(sq(x64)))
    ok = chi_incl < bound_incl and chi2 < bound and abs(z) < Z and bool(np.all(kept.sum(1) == k))
    return result(
        f"random-k at d = {d}, k = {k}: inclusion probability k/d, unbiased, MSE (d/k − 1)||x||²",
        SOURCE,
        f"inclusion χ² = {fmt(chi_incl)}; mean χ² = {fmt(chi2)}; z(MSE) = {fmt(z, 3)}",
        f"χ² < {fmt(bound_incl)} and < {fmt(bound)} (1−1e-6 quantiles); |z| < {Z:g}",
        ok,
        f"{n} draws with real PRNG keys.",
    )
