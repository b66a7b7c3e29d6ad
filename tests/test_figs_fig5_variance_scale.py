"""The pure helpers of paper_figs/fig5_variance_scale.py: the sweep, matched points, verdict."""

import dataclasses

from experiments.common import methods
from paper_figs import fig5_variance_scale as fig


def test_configs_sweep_both_knobs_without_momentum():
    s = fig.Scale(steps=5, seeds=(0, 1), alphas=(4.0,), taus=(0.01, 0.02))
    cfgs = fig.configs(s)
    assert len(cfgs) == 2 * 4 and {c.momentum for c in cfgs} == {0.0}
    assert {c.lr for c in cfgs} == {fig.LR}
    assert methods.parse(fig.methods(s)[1][2]).gradients == "per_example"


def test_best_matched_is_lowest_loss_side_of_the_target():
    p = fig.Point
    points = [
        p(fig.VB, 1.0, "a", (2.30, 0.01), (0.0, 0.01), 10.0),
        p(fig.VB, 2.0, "b", (2.34, 0.01), (0.04, 0.01), 50.0),
        p(fig.VB, 3.0, "c", (2.60, 0.01), (0.3, 0.01), 500.0),
        p(fig.STROM, 0.1, "d", (2.40, 0.01), (0.1, 0.01), 20.0),
    ]
    assert fig.best_matched(points, fig.VB, 2.35).knob == 2.0
    assert fig.best_matched(points, fig.STROM, 2.35) is None


def test_verdict_words():
    vb = fig.Point(fig.VB, 1.0, "a", (2.3, 0.01), (0.0, 0.01), 100.0)
    strom = fig.Point(fig.STROM, 0.1, "b", (2.3, 0.01), (0.0, 0.01), 50.0)
    assert fig.verdict(vb, strom, 2.3).startswith("Reproduced")
    assert fig.verdict(vb, dataclasses.replace(strom, ratio=200.0), 2.3).startswith("Did not")
    assert fig.verdict(None, strom, 2.3).startswith("Did not reproduce")


def test_dominated_pairs_cross_the_methods_only():
    p = fig.Point
    vb_low = p(fig.VB, 8.0, "a", (3.5, 0.1), (0.0, 0.1), 100.0)
    vb_high = p(fig.VB, 32.0, "b", (3.7, 0.1), (0.0, 0.1), 1000.0)
    strom = p(fig.STROM, 0.05, "c", (3.3, 0.1), (0.0, 0.1), 500.0)
    assert fig.dominated([vb_low, vb_high, strom]) == [(vb_low, strom)]
    assert "beaten by" in fig.frontier_note([vb_low, vb_high, strom], 0.4)
    assert "No setting" in fig.frontier_note([vb_high, strom], 0.4)
