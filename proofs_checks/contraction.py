"""Contraction of biased compressors, and the general facts linking omega and delta.

* top-k: ``||C(x) - x||^2 <= (1 - k/d)||x||^2``, equality at equal magnitudes;
* scaled sign ``(||x||_1/d) sign(x)``: error ``||x||^2 - ||x||_1^2/d`` exactly, so
  ``delta(x) = ||x||_1^2/(d||x||^2)``, worst case ``1/d`` at 1-sparse ``x``;
* rank-r truncated SVD: error ``sum_{i>r} sigma_i^2 <= (1 - r/min(m, n))||M||^2``,
  reached by PowerSGD's warm-started power iteration;
* PowerSGD's output ``P Q^T = P P^T M`` is an orthogonal projection of ``M``;
* an unbiased ``C`` scaled by ``1/(omega + 1)`` is contractive with
  ``delta = 1/(omega + 1)``;
* averaging ``n`` independent workers divides the variance (omega) by ``n``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from compjax.compressors.rand_k import RandK
from proofs_checks import check, result
from proofs_checks._common import TwoPoint, Z, fmt, sq, test_vectors

_apply = jax.jit(
    lambda comp, xs: jax.vmap(lambda x: comp(None, x).astype(jnp.float32))(xs),
    static_argnums=0,
)


def apply(comp, xs) -> np.ndarray:
    return np.asarray(_apply(comp, jnp.asarray(xs, jnp.float32)), np.float64)


@check
def top_k_and_scaled_sign(fast: bool):
    rows = []
    # top-k
    cases = (
        ((10, 3), (1000, 10)) if fast else ((10, 1), (10, 3), (100, 10), (1000, 10), (1000, 999))
    )
    worst, at_equal, meta = 0.0, [], True
    for i, (d, k) in enumerate(cases):
        comp = compjax.top_k(k=k)
        meta &= comp.delta(d) == k / d
        rng = np.random.default_rng(900 + i)
        equal = rng.choice([-1.0, 1.0], d)
        xs = np.concatenate([test_vectors(d, 21, 900 + i), equal[None]]).astype(np.float32)
        out = apply(comp, xs)
        x = xs.astype(np.float64)
        ratio = sq(out - x) / sq(x) / (1 - k / d)
        worst = max(worst, float(ratio.max()))
        at_equal.append(float(ratio[-1]))
        meta &= bool(np.all(np.count_nonzero(out, axis=1) <= k))
    rows.append(
        result(
            "top-k: ||C(x) − x||² ≤ (1 − k/d)||x||², equality at equal magnitudes (delta = k/d)",
            "Stich et al. 2018, §2",
            f"max ||C−x||²/((1−k/d)||x||²) = {fmt(worst, 7)}; at ±1 vectors "
            f"{fmt(min(at_equal), 7)}…{fmt(max(at_equal), 7)}",
            "≤ 1; = 1 (to 1e-6) at equal magnitudes; top_k(k).delta(d) = k/d",
            worst <= 1 + 1e-6 and all(abs(r - 1) <= 1e-6 for r in at_equal) and meta,
            f"(d, k) = {list(cases)}; 22 vectors each (7 families and a ±1 vector).",
        )
    )
    # scaled sign
    dims = (7, 1000) if fast else (1, 2, 7, 100, 1000, 4096)
    dev, at_sparse, worst, meta = 0.0, [], 0.0, True
    comp = compjax.scaled_sign()
    for i, d in enumerate(dims):
        meta &= comp.delta(d) == 1 / d
        sparse = np.zeros(d)
        sparse[i % d] = -3.0
        xs = np.concatenate([test_vectors(d, 21, 950 + i), sparse[None]]).astype(np.float32)
        out = apply(comp, xs)
        x = xs.astype(np.float64)
        exact = sq(x) - np.sum(np.abs(x), axis=1) ** 2 / d
        err = sq(out - x)
        dev = max(dev, float(np.max(np.abs(err - exact) / sq(x))))
        ratio = err / sq(x) / (1 - 1 / d) if d > 1 else err / sq(x) + 1
        worst = max(worst, float(ratio.max()))
        at_sparse.append(float(ratio[-1]))
    rows.append(
        result(
            "scaled sign: ||C(x) − x||² = ||x||² − ||x||₁²/d exactly, i.e. delta(x) = "
            "||x||₁²/(d||x||²); worst case 1/d at 1-sparse x",
            "Karimireddy et al. 2019 (scaled sign)",
            f"max |err − (||x||² − ||x||₁²/d)|/||x||² = {fmt(dev, 2)}; ratio to (1 − 1/d) at "
            f"1-sparse {fmt(min(at_sparse), 7)}…{fmt(max(at_sparse), 7)}, max {fmt(worst, 7)}",
            "≤ 1e-6; = 1 at 1-sparse, ≤ 1 elsewhere; delta(d) = 1/d",
            dev <= 1e-6
            and all(abs(r - 1) <= 1e-6 for r in at_sparse)
            and worst <= 1 + 1e-6
            and meta,
            f"d = {list(dims)}; 22 vectors each. (d = 1: C is the identity, error 0.)",
        )
    )
    return rows


# -- low rank ------------------------------------------------------------------------------
ROWS, COLS = 32, 24


def _matrix(rng, spectrum):
    u, _ = np.linalg.qr(rng.standard_normal((ROWS, ROWS)))
    v, _ = np.linalg.qr(rng.standard_normal((COLS, COLS)))
    k = min(ROWS, COLS)
    return (u[:, :k] * spectrum) @ v[:, :k].T


@functools.cache
def _powersgd_step(rank):
    tx = compjax.powersgd(rank, None)
    return tx, jax.jit(tx.update)


def power_iterations(m, rank, iterations):
    """PowerSGD on a fixed matrix with the error memory reset each step: warm-started
    subspace iteration; returns the output after ``iterations`` steps."""
    tx, step = _powersgd_step(rank)
    params = {"w": jnp.zeros((ROWS, COLS))}
    state = tx.init(params)
    grads = {"w": jnp.asarray(m, jnp.float32)}
    for _ in range(iterations):
        upd, state = step(grads, state)
        state = state._replace(error=jax.tree.map(jnp.zeros_like, state.error))
    return np.asarray(upd["w"], np.float64)


@check
def low_rank(fast: bool):
    rng = np.random.default_rng(960)
    k = min(ROWS, COLS)
    ranks = (2,) if fast else (1, 2, 4)
    iterations = 60 if fast else 200
    svd_dev, bound_ratio, equal_ratio = 0.0, 0.0, []
    for r in ranks:
        spectra = [np.exp(-0.25 * np.arange(k)), 1.0 / (1 + np.arange(k)), np.ones(k)]
        spectra += [np.sort(rng.uniform(0.1, 1, k))[::-1]] * (0 if fast else 1)
        for j, spectrum in enumerate(spectra):
            m = _matrix(rng, spectrum)
            tail = float(np.sum(spectrum[r:] ** 2))
            total = float(np.sum(m**2))
            err = float(np.sum((m - power_iterations(m, r, iterations)) ** 2))
            bound_ratio = max(bound_ratio, tail / ((1 - r / k) * total))
            if j == 2:  # equal singular values: the bound is attained
                equal_ratio.append(err / ((1 - r / k) * total))
            else:
                svd_dev = max(svd_dev, abs(err - tail) / tail)
    proj = projection(rng, fast)
    return [
        result(
            "rank-r truncated SVD: error Σ_{i>r}σ_i² ≤ (1 − r/min(m,n))||M||², attained at equal "
            "σ; PowerSGD's warm-started power iteration reaches it",
            "Eckart–Young; Vogels et al. 2019, Alg. 1",
            f"max tail/((1−r/min)||M||²) = {fmt(bound_ratio, 6)}; PowerSGD error vs tail: "
            f"max rel. dev. {fmt(svd_dev, 2)}; at equal σ error/bound = "
            f"{fmt(min(equal_ratio), 7)}…{fmt(max(equal_ratio), 7)}",
            "≤ 1; ≤ 1e-4; = 1 (to 1e-5)",
            bound_ratio <= 1 + 1e-12
            and svd_dev <= 1e-4
            and all(abs(e - 1) <= 1e-5 for e in equal_ratio),
            f"{ROWS}×{COLS} matrices with geometric, harmonic{'' if fast else ', random'} and "
            f"equal spectra; rank r ∈ {list(ranks)}; {iterations} PowerSGD steps on a fixed "
            f"matrix with the error memory reset each step (subspace iteration).",
        ),
        proj,
    ]


def projection(rng, fast):
    """PowerSGD with error feedback: each step's output is P P^T M_t, M_t = g_t + e_{t-1}."""
    rank = 2
    tx, step = _powersgd_step(rank)
    params = {"w": jnp.zeros((ROWS, COLS))}
    state = tx.init(params)
    e_prev = np.zeros((ROWS, COLS))
    ortho, proj_dev, mem_dev, rank_ok, energy_ok = 0.0, 0.0, 0.0, True, True
    steps = 8 if fast else 30
    for _ in range(steps):
        g = rng.standard_normal((ROWS, COLS)) * rng.uniform(0.1, 10)
        upd, state = step({"w": jnp.asarray(g, jnp.float32)}, state)
        out = np.asarray(upd["w"], np.float64)
        e = np.asarray(state.error["w"][0], np.float64)
        m = g.astype(np.float32).astype(np.float64) + e_prev
        m2 = float(np.sum(m**2))
        mem_dev = max(mem_dev, float(np.sum((m - out - e) ** 2) / m2))
        ortho = max(ortho, abs(float(np.sum(e * out))) / m2)
        u, s, _ = np.linalg.svd(out)
        r_out = int(np.sum(s > 1e-5 * s[0]))
        rank_ok &= r_out <= rank
        basis = u[:, :r_out]
        proj_dev = max(proj_dev, float(np.sum((basis @ (basis.T @ m) - out) ** 2) / m2))
        energy_ok &= 0 <= float(np.sum(e**2)) <= m2 * (1 + 1e-6)
        e_prev = e
    return result(
        "PowerSGD's output is an orthogonal projection of M = g + e: out = ΠM, ⟨M − out, out⟩ = 0, "
        "0 ≤ ||e||² ≤ ||M||² (no uniform delta)",
        "Vogels et al. 2019, Alg. 1",
        f"max ||ΠM − out||²/||M||² = {fmt(proj_dev, 2)}; max |⟨e, out⟩|/||M||² = {fmt(ortho, 2)}; "
        f"max ||M − out − e||²/||M||² = {fmt(mem_dev, 2)}",
        "≤ 1e-9; ≤ 1e-5; ≤ 1e-10; rank(out) ≤ r; ||e||² ≤ ||M||²",
        proj_dev <= 1e-9 and ortho <= 1e-5 and mem_dev <= 1e-10 and rank_ok and energy_ok,
        f"powersgd(rank={rank}, None) for {steps} steps on random {ROWS}×{COLS} gradients of "
        f"varying scale; Π projects onto the column space of the output; e is the library's "
        f"error memory.",
    )


# -- unbiased => contractive; averaging ----------------------------------------------------------
def _extremal(name, d):
    if name == "qsgd":
        return np.ones(d)  # d = 16, s = 2: every p_i = 1/2
    if name == "terngrad":
        b = 1.0 / (np.sqrt(d) + 1.0)
        return np.concatenate([[1.0], np.full(d - 1, b)])
    return np.float32(4 / 3) * np.exp2(np.arange(d) % 7 - 3.0)  # natural


@check
def scaling_and_averaging(fast: bool):
    d = 16
    comps = {"qsgd": compjax.qsgd(2), "terngrad": compjax.terngrad(), "natural": compjax.natural()}
    if fast:
        comps.pop("natural")
    worst, at_ext, meta = 0.0, [], True
    for i, (name, comp) in enumerate(comps.items()):
        omega = comp.omega(d)
        gamma = 1.0 / (omega + 1.0)
        sc = compjax.scaled(comp, gamma)
        meta &= abs(sc.delta(d) - gamma) <= 1e-12
        xs = np.concatenate([test_vectors(d, 14, 970 + i), _extremal(name, d)[None]])
        tp = TwoPoint(sc, xs.astype(np.float32))
        ratio = tp.mse() / sq(tp.x) / (1 - sc.delta(d))
        worst = max(worst, float(ratio.max()))
        at_ext.append(float(ratio[-1]))
    rows = [
        result(
            "unbiased C scaled by 1/(ω+1) is contractive with delta = 1/(ω+1): "
            "E||C(x)/(ω+1) − x||² ≤ (1 − 1/(ω+1))||x||²",
            "Stich et al. 2018; REFERENCES.md (general facts)",
            f"max E||γC − x||²/((1−δ)||x||²) = {fmt(worst, 7)}; at the extremal vectors "
            f"{fmt(min(at_ext), 7)}…{fmt(max(at_ext), 7)}",
            "≤ 1; = 1 (to 1e-5) where the variance attains ω; scaled(C, γ).delta(d) = γ",
            worst <= 1 + 1e-5 and all(abs(r - 1) <= 1e-5 for r in at_ext) and meta,
            f"compjax.scaled({', '.join(comps)}, 1/(ω(d)+1)) at d = {d}; exact expectation of "
            f"the library's output (scripted draws) on 15 vectors each.",
        )
    ]
    rows.append(averaging(fast))
    return rows


@functools.partial(jax.jit, static_argnums=(0, 1, 3))
def _averaged_errors(comp, n, x, steps):
    """||mean of n workers' C(x) - x||^2 for ``steps`` steps of compjax.compress."""
    tx = compjax.compress(comp, "data")

    def worker(x):
        def body(state, _):
            upd, state = tx.update(x, state)
            return state, jnp.sum((upd - x) ** 2)

        _, errs = jax.lax.scan(body, tx.init(x), None, length=steps)
        return errs

    return jax.vmap(worker, axis_name="data")(jnp.broadcast_to(x, (n, *x.shape)))[0]


def averaging(fast):
    d = 16
    steps = 3000 if fast else 20000
    ns = (1, 8) if fast else (1, 4, 16)
    comps = [compjax.qsgd(2)] + ([] if fast else [compjax.terngrad(), compjax.rand_k(k=2)])
    x = test_vectors(d, 1, 990)[0]
    ratios, worst_z, parts = [], 0.0, []
    for comp in comps:
        if isinstance(comp, RandK):
            v1 = (d / comp.k - 1) * float(sq(x.astype(np.float64)))
        else:
            v1 = float(TwoPoint(comp, x[None]).variance[0])
        for n in ns:
            errs = np.asarray(_averaged_errors(comp, n, jnp.asarray(x), steps), np.float64)
            se = errs.std(ddof=1) / np.sqrt(steps)
            z = (errs.mean() - v1 / n) / se
            ratios.append(n * errs.mean() / v1)
            worst_z = max(worst_z, abs(z))
            parts.append(
                f"{type(comp).__name__} n={n}: n·MSE/V₁ = {fmt(ratios[-1], 4)} (z={fmt(z, 3)})"
            )
    return result(
        "averaging n independent workers divides the variance by n: E||mean_i C_i(x) − x||² = "
        "Var(C(x))/n",
        "REFERENCES.md (general facts); compjax.compress",
        f"n·MSE/V₁ = {fmt(min(ratios), 4)}…{fmt(max(ratios), 4)}; max |z| = {fmt(worst_z, 3)}",
        f"|z| < {Z:g} (Monte Carlo, {steps} steps each)",
        worst_z < Z,
        f"compjax.compress(C, 'data') under jax.vmap with n workers holding the same x "
        f"(d = {d}); V₁ is the exact single-worker variance. " + "; ".join(parts) + ".",
    )
