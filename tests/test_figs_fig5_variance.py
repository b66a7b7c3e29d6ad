"""The pure helpers of paper_figs/fig5_variance.py: the sweep, the matched point, the verdict."""

import dataclasses

from experiments.common import methods
from paper_figs import fig5_variance as fig


def test_methods_parse_and_sweep_both_knobs():
    s = fig.Scale(steps=5, seeds=(0,), alphas=(1.0, 2.0), taus=(0.1,))
    runs = fig.methods(s)
    assert [family for family, _, _ in runs] == ["dense", fig.VB, fig.VB, fig.STROM]
    for _, _, spec in runs:
        methods.parse(spec)
    assert methods.parse(runs[1][2]).gradients == "per_example"


def test_best_matched_takes_the_highest_ratio_at_the_target():
    p = fig.Point
    points = [
        p(fig.VB, 1.0, "a", 0.95, 10.0),
        p(fig.VB, 2.0, "b", 0.94, 50.0),
        p(fig.VB, 3.0, "c", 0.80, 500.0),
        p(fig.STROM, 0.1, "d", 0.96, 20.0),
    ]
    assert fig.best_matched(points, fig.VB, 0.94).knob == 2.0
    assert fig.best_matched(points, fig.STROM, 0.97) is None


def test_verdict_words():
    vb = fig.Point(fig.VB, 1.0, "a", 0.95, 100.0)
    strom = fig.Point(fig.STROM, 0.1, "b", 0.95, 50.0)
    assert fig.verdict(vb, strom, 0.955).startswith("Reproduced")
    assert fig.verdict(vb, None, 0.955).startswith("Reproduced")
    better_strom = dataclasses.replace(strom, ratio=200.0)
    assert fig.verdict(vb, better_strom, 0.955).startswith("Did not reproduce")
    assert fig.verdict(None, strom, 0.955).startswith("Did not reproduce")
