"""The pure helpers of paper_figs/fig1_diana.py: exact quantiser variances and the plateau."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax
from paper_figs import fig1_diana as fig


@pytest.mark.parametrize(
    "comp", [compjax.qsgd(levels=1), compjax.qsgd(levels=3), compjax.terngrad(), compjax.natural()]
)
def test_entry_variance_matches_the_library(comp):
    x = np.random.default_rng(0).standard_normal(12).astype(np.float32) * 0.3
    exact = fig.entry_variance(comp, x)
    keys = jax.random.split(jax.random.key(1), 8000)
    out = np.asarray(jax.jit(jax.vmap(comp, in_axes=(0, None)))(keys, jnp.asarray(x)), np.float64)
    squared = (out - x.astype(np.float64)) ** 2  # E = the variance (unbiased compressor)
    error = np.abs(squared.mean(axis=0) - exact)
    assert np.all(error <= 5 * squared.std(axis=0) / np.sqrt(len(keys)) + 1e-12)
    assert comp.unbiased
    assert exact.sum() <= comp.omega(x.size) * np.sum(x.astype(np.float64) ** 2) * (1 + 1e-9)


def test_entry_variance_special_values():
    assert np.all(fig.entry_variance(compjax.natural(), np.array([0.0, 0.25, -4.0])) == 0)
    assert np.all(fig.entry_variance(compjax.terngrad(), np.array([1.0, -1.0])) == 0)
    with pytest.raises(ValueError):
        fig.entry_variance(compjax.top_k(k=1), np.ones(3))


def test_stationary_distance_matches_a_simulated_linear_recursion():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 4))
    hessian = a @ a.T / 4 + 0.2 * np.eye(4)
    variance = rng.uniform(0.5, 2.0, 4)
    lr = 0.3
    predicted = fig.stationary_distance(hessian, variance, lr)
    e = np.zeros((4000, 4))  # 4000 independent chains
    step = np.eye(4) - lr * hessian
    total = 0.0
    for t in range(400):
        e = e @ step.T - lr * rng.standard_normal(e.shape) * np.sqrt(variance)
        if t >= 200:
            total += np.mean(np.sum(e**2, axis=1))
    assert total / 200 == pytest.approx(predicted, rel=0.03)
    assert fig.stationary_distance(hessian, variance, 100.0) == float("inf")


def test_tail_median_and_first_below():
    steps = np.arange(0, 110, 10)
    values = 10.0 ** -np.arange(11)
    assert fig.tail_median(steps, values, tail=30) == values[-2]
    assert fig.first_below(steps, values, 1e-3) == 40
    assert fig.first_below(steps, values, 1e-20) is None
