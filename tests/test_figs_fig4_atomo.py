"""Pure helpers of paper_figs/fig4_atomo.py (no training)."""

import numpy as np
import pytest

import compjax
from paper_figs.fig4_atomo import exact_variance, matched_budget, stable_rank


def test_stable_rank_extremes():
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(7, 1)), rng.normal(size=(1, 5))
    assert stable_rank(u @ v) == pytest.approx(1.0)
    assert stable_rank(np.eye(6)) == pytest.approx(6.0)
    assert stable_rank(np.diag([2.0, 1.0])) == pytest.approx(1.25)
    assert stable_rank(np.zeros((3, 3))) == 0.0


@pytest.mark.parametrize("shape", [(128, 128), (32, 80), (40, 128)])
@pytest.mark.parametrize("budget", [1, 3])
def test_matched_budget_equalises_expected_bits(shape, budget):
    entry = matched_budget(budget, shape)
    svd_bits = compjax.atomo_svd(budget).expected_bits(shape)
    assert compjax.atomo(entry).expected_bits(shape) == pytest.approx(svd_bits)


def test_exact_variance_entrywise_worked_example():
    # REFERENCES.md: lambda = (10, 5, 1, 1, 1, .5), s = 3 -> p = (1, 1, 2/7, 2/7, 2/7, 1/7).
    x = np.array([10, 5, 1, 1, 1, 0.5])
    p = np.array([1, 1, 2 / 7, 2 / 7, 2 / 7, 1 / 7])
    expected = np.sum(x**2 * (1 / p - 1)) / np.sum(x**2)
    assert exact_variance(x, 3, svd=False) == pytest.approx(expected, rel=1e-5)


def test_exact_variance_svd_uses_singular_values():
    rng = np.random.default_rng(1)
    q1, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    q2, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    m = q1 @ np.diag([10, 5, 1, 1, 1, 0.5]) @ q2.T
    assert exact_variance(m, 3, svd=True) == pytest.approx(
        exact_variance(np.array([10, 5, 1, 1, 1, 0.5]), 3, svd=False), rel=1e-4
    )
    # A budget covering the rank sends every atom: no variance.
    assert exact_variance(m, 6, svd=True) == pytest.approx(0.0, abs=1e-9)
