"""Pure helpers of paper_figs/fig8_frontier.py (no training)."""

import numpy as np

from experiments.common import methods
from paper_figs.fig8_frontier import METHODS, pareto_front


def test_pareto_front():
    bits = [10, 1, 5, 5, 20, 1]
    acc = [0.9, 0.5, 0.8, 0.7, 0.95, 0.5]
    # 3 is dominated by 2 (same bits, less accurate); the equal points 1 and 5 both stay.
    assert pareto_front(bits, acc).tolist() == [True, True, True, False, True, True]


def test_pareto_front_single_and_dominated():
    assert pareto_front([3.0], [0.1]).tolist() == [True]
    assert pareto_front([1, 2], [0.9, 0.8]).tolist() == [True, False]
    rng = np.random.default_rng(0)
    bits, acc = rng.uniform(1, 100, 50), rng.uniform(0, 1, 50)
    keep = pareto_front(bits, acc)
    order = np.argsort(bits[keep])
    # Along the frontier accuracy rises with bits.
    assert np.all(np.diff(acc[keep][order]) > 0)


def test_methods_parse():
    for spec, lr, _ in METHODS:
        methods.parse(spec)
        assert lr > 0
