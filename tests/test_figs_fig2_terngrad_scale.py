"""The pure helpers of paper_figs/fig2_terngrad_scale.py: the ternary error, configs, verdict."""

import itertools

import numpy as np

from experiments.common import methods
from paper_figs import fig2_terngrad_scale as fig


def _enumerated_mse(g: np.ndarray, y: np.ndarray) -> float:
    """E||T(y) - g||^2 over every outcome of TernGrad's ternary of ``y`` (scaler max |y|)."""
    s = np.abs(y).max()
    p = np.abs(y) / s
    total = 0.0
    for kept in itertools.product((0, 1), repeat=y.size):
        kept = np.array(kept)
        prob = np.prod(np.where(kept == 1, p, 1 - p))
        total += prob * np.sum((s * np.sign(y) * kept - g) ** 2)
    return total


def test_ternary_mse_is_variance_plus_squared_bias_by_enumeration():
    g = np.array([1.0, -0.5, 0.25, 3.0, -0.125])
    assert np.isclose(fig.ternary_mse(g, g), _enumerated_mse(g, g))
    assert np.isclose(fig.ternary_mse(g, g), 3.0 * 4.875 - np.sum(g**2))
    y = np.clip(g, -2.0, 2.0)  # clipped: a smaller scaler, a bias of 1 on the fourth entry
    assert np.isclose(fig.ternary_mse(g, y), _enumerated_mse(g, y))
    assert fig.ternary_mse(g, y) < fig.ternary_mse(g, g)


def test_configs_share_figure_3b_settings_and_parse():
    cfgs = fig.configs(10, (0, 1))
    assert len(cfgs) == 2 * len(fig.methods())
    assert {c.task for c in cfgs} == {fig.TASK} and {c.momentum for c in cfgs} == {fig.MOMENTUM}
    for c in cfgs:
        methods.parse(c.method)
    clips = {methods.parse(m).options.get("clip", "default") for m, _ in fig.METHODS.values()}
    assert clips == {"default", fig.CLIP, None}


def test_verdict_needs_both_intervals():
    assert fig.verdict((0.005, 0.01), (0.3, 0.1)).startswith("Reproduced")
    assert fig.verdict((0.005, 0.03), (0.3, 0.1)).startswith("Partly reproduced")
    assert fig.verdict((0.005, 0.01), (0.05, 0.1)).startswith("Partly reproduced")
    assert fig.verdict((0.03, 0.01), (-0.01, 0.005)).startswith("Did not reproduce")
