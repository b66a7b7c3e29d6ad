"""Pure helpers of paper_figs/fig12_demo.py (no training)."""

import numpy as np

from paper_figs import fig12_demo


def test_smooth_is_a_running_mean_shorter_at_the_start():
    got = fig12_demo.smooth(np.array([1.0, 3.0, 5.0, 7.0]), 2)
    np.testing.assert_allclose(got, [1.0, 2.0, 4.0, 6.0])


def test_verdict_follows_the_stated_criterion():
    adam = 0.10
    ok = fig12_demo.verdict({"DeMo": 0.105, "dense AdamW": adam}, ratio=10.0)
    partly = fig12_demo.verdict({"DeMo": 0.14, "dense AdamW": adam}, ratio=10.0)
    worse = fig12_demo.verdict({"DeMo": 0.2, "dense AdamW": adam}, ratio=10.0)
    dense = fig12_demo.verdict({"DeMo": 0.1, "dense AdamW": adam}, ratio=2.0)
    assert ok.startswith("Reproduced") and partly.startswith("Partly reproduced")
    assert worse.startswith("Did not reproduce") and dense.startswith("Did not reproduce")


def test_every_method_builds_and_the_quick_scale_skips_top_4():
    for name, lr in fig12_demo.LEARNING_RATES.items():
        fig12_demo.optimizer(name, lr)
    assert "DeMo top-4" not in fig12_demo.scale().methods
