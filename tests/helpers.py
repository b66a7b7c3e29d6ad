"""Shared jitted wrappers and samplers: one compile per (compressor, shape, dtype)."""

from __future__ import annotations

import re
from functools import partial

import jax
import numpy as np
from scipy import stats

import compjax
from compjax.table import catalogue

EXTRA_SPECS = (
    "qsgd(levels=2)",
    "qsgd(levels=200, bucket_size=5)",
    "qsgd(levels=1000)",
    "rand_k(k=1)",
    "top_k(k=1)",
    "top_k(ratio=0.1, select='threshold')",
    "chain(rand_k(ratio=0.5, shared_seed=True), natural())",
    "chain(top_k(ratio=0.5), cast('bfloat16'))",
    "blockwise(top_k(ratio=0.5), 3)",
    "atomo(budget=4.0)",
    "atomo_svd(budget=2.0)",
    "eden(rounds=1)",
    "natural_dithering(levels=1)",
    "cast('float8_e4m3fn')",
    "cast('float4_e2m1fn')",
    "mx('float4_e2m1fn', block=4)",
    "mx('float8_e4m3fn')",
    "chunked_top_k(k=2, chunk=8)",
)


def all_compressors() -> dict[str, compjax.Compressor]:
    """The table catalogue (compjax.table) plus variants that reach other code paths."""
    namespace = {name: getattr(compjax, name) for name in compjax.__all__}
    comps = catalogue()
    comps.update({spec: eval(spec, namespace) for spec in EXTRA_SPECS})
    return comps


def min_size(comp) -> int:
    """Smallest input size a compressor accepts (fixed k needs d >= k)."""
    inner = getattr(comp, "sparsifier", None) or getattr(comp, "inner", None) or comp
    return getattr(inner, "k", None) or 0


@partial(jax.jit, static_argnums=0)
def roundtrip(comp, key, x):
    """``(payload, decompress(payload))`` in one compiled program."""
    payload = comp.compress(key, x)
    return payload, comp.decompress(payload)


@partial(jax.jit, static_argnums=0)
def roundtrip_all(comp, keys, xs):
    """:func:`roundtrip` of ``(keys[i], xs[i])`` for a tuple ``xs``, in one compiled program."""
    return tuple((comp.compress(keys[i], x), comp(keys[i], x)) for i, x in enumerate(xs))


def apply(comp, key, x):
    """``comp(key, x)``, compiled."""
    return roundtrip(comp, key, x)[1]


@partial(jax.jit, static_argnums=(0, 3))
def samples(comp, x, seed, n):
    """``n`` independent draws of ``comp(key, x)``, stacked on a leading axis."""
    keys = jax.random.split(jax.random.key(seed), n)
    return jax.vmap(lambda k: comp(k, x))(keys)


def draw(comp, x, n=4000, seed=0) -> np.ndarray:
    """Draws as float64 numpy, shape ``(n, d)``."""
    return np.asarray(samples(comp, x, seed, n), dtype=np.float64).reshape(n, -1)


def assert_unbiased(draws: np.ndarray, x: np.ndarray, var: np.ndarray, p: float = 1e-6):
    """Mean of the draws equals ``x`` given the exact per-entry variance ``var``.

    Entries with positive variance: the chi-square statistic of the standardised
    mean errors stays below its ``1 - p`` quantile (a false alarm has
    probability ``p``).  Entries with zero variance: every draw equals ``x``.
    """
    n = draws.shape[0]
    x = np.asarray(x, np.float64).reshape(-1)
    random = var > 0
    fixed = ~random
    np.testing.assert_allclose(
        draws[:, fixed], np.broadcast_to(x[fixed], (n, fixed.sum())), rtol=1e-5
    )
    if random.any():
        z = (draws[:, random].mean(0) - x[random]) / np.sqrt(var[random] / n)
        chi2 = float(np.sum(z**2))
        bound = float(stats.chi2.isf(p, int(random.sum())))
        assert chi2 < bound, f"mean is off: chi2={chi2:.1f} > {bound:.1f} (dof {random.sum()})"


def assert_mean_error(draws: np.ndarray, x: np.ndarray, expected: float, z: float = 5.0):
    """The mean squared error of the draws is ``expected`` within ``z`` standard errors."""
    x = np.asarray(x, np.float64).reshape(-1)
    err = np.sum((draws - x) ** 2, axis=1)
    se = err.std(ddof=1) / np.sqrt(len(err))
    tol = z * se + 1e-6 * expected
    assert abs(err.mean() - expected) <= tol, (
        f"mean error {err.mean():.6g} vs exact {expected:.6g} (tolerance {tol:.3g})"
    )
    return err.mean(), se


def run_vmap(tx, grads, n, params):
    """Updates and states (the initial one first) of ``tx`` on ``n`` workers simulated by vmap
    over the axis ``"data"``, and the jitted step; ``grads[t]`` has a leading worker axis."""
    state = jax.vmap(lambda _: tx.init(params))(jax.numpy.arange(n))
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    outs, states = [], [state]
    for g in grads:
        upd, state = step(g, state)
        outs.append(upd)
        states.append(state)
    return outs, states, step


def input_readers(fn, key, x) -> list[str]:
    """The operations of ``fn(key, x)``'s compiled program that read ``x`` (float32,
    1-D), but for a conditional's branches (which run only on overflow)."""
    entry = fn.lower(key, x).compile().as_text()
    entry = entry[entry.index("ENTRY") :].splitlines()
    shape = rf"f32\[{x.shape[0]}\]"
    param = re.search(rf"(%\S+) = {shape}\S* parameter\(\d+\)", "\n".join(entry)).group(1)
    return [
        line
        for line in entry[1:]
        if re.search(re.escape(param) + r"\b", line)
        and not re.search(r"parameter\(|\) tuple\(|conditional\(", line)
    ]
