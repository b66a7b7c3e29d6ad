"""The pure helpers of paper_figs/fig13_diloco.py: methods, traffic, verdict (no training)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from paper_figs import fig13_diloco as fig


def test_every_method_has_a_swept_rate_and_the_quick_scale_is_a_subset():
    labels = [m.label for m in fig.ALL_METHODS]
    assert len(set(labels)) == 13 and set(labels) == set(fig.LEARNING_RATES)
    assert all(lr in fig.LADDER for lr in fig.LEARNING_RATES.values())
    quick = fig.scale()
    assert set(quick.methods) <= set(fig.ALL_METHODS) and quick.steps % fig.EVAL_EVERY == 0
    assert fig.FULL_STEPS % fig.EVAL_EVERY == 0 and fig.FULL_STEPS // max(fig.SYNC_EVERY) >= 4


def test_traffic_averages_a_round_and_counts_the_flag_every_step():
    t = fig.Traffic(flag=12.0, round=1000.0, sync_every=10)
    assert t.per_step == 12.0 + 100.0
    np.testing.assert_array_equal(t.cumulative([5, 10, 25]), [60.0, 1120.0, 2300.0])


def test_traffic_of_the_methods():
    params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros(256)}
    size = 64 * 256 + 256
    dp = fig.traffic(fig.DATA_PARALLEL, params)
    assert dp.round == 32 * size * 2 * 3 / 4  # a float32 ring all-reduce over 4 workers
    exact = fig.traffic(fig.Method("exact", 100), params)
    assert exact.round == dp.round and exact.flag == dp.flag > 0
    # The flag, sent every step, keeps exact pseudo-gradients at H = 100 just under 100x.
    assert dp.per_step / exact.per_step == pytest.approx(
        (dp.round + dp.flag) / (dp.round / 100 + dp.flag)
    )
    assert dp.per_step / exact.per_step < 100
    int8 = fig.traffic(fig.Method("int8", 50), params)
    sparse = fig.traffic(fig.Method("SparseLoCo", 50), params)
    assert dp.per_step / int8.per_step > 100 and sparse.round < int8.round / 10


def test_verdict_follows_the_stated_criterion():
    ratios = {"a": 150.0, "b": 50.0}
    assert fig.verdict({"a": (0.01, 0.01), "b": (0.0, 0.0)}, ratios).startswith("Reproduced")
    partly = fig.verdict({"a": (0.02, 0.02), "b": (0.0, 0.0)}, ratios)
    assert partly.startswith("Partly reproduced")
    # Within 3% but at too few bits saved: does not count.
    assert fig.verdict({"a": (0.05, 0.01), "b": (0.0, 0.0)}, ratios).startswith("Did not")
    assert fig.verdict({"b": (0.0, 0.0)}, {"b": 50.0}).startswith("Did not")


def test_best_rates_skip_diverged_runs():
    swept = {"m": {1e-3: 2.3, 3e-3: 2.1, 1e-2: math.nan}, "n": {1e-3: math.inf, 3e-3: 2.5}}
    assert fig.best_rates(swept) == {"m": 3e-3, "n": 3e-3}


def test_the_sweep_walks_past_an_end_of_the_grid_only():
    assert fig.next_rates({1e-3: 2.4, 3e-3: 2.5, 1e-2: 2.6}) == (3e-4,)
    assert fig.next_rates({1e-3: 2.6, 3e-3: 2.5, 1e-2: 2.4}) == (3e-2,)
    assert fig.next_rates({1e-3: 2.6, 3e-3: 2.4, 1e-2: 2.5}) == ()
    assert fig.next_rates({1e-4: 2.4, 3e-4: 2.5}) == ()  # the ladder's end
    assert fig.next_rates({1e-3: 2.5, 3e-3: 2.4, 1e-2: math.nan}) == ()
    assert set(fig.SWEEP_GRID) <= set(fig.LADDER)


def test_interval_drops_the_half_width_of_one_seed():
    assert fig.interval(2.0, 0.25) == "2.000 ± 0.250"
    assert fig.interval(2.0, math.inf) == "2.000"
    assert fig.interval(0.031, 0.012, 100, "%", sign=True) == "+3.1 ± 1.2%"


def test_compressed_runs_are_compared_with_exact_diloco_at_the_same_h():
    def runs(*values):
        return [fig.Result(np.zeros(1), np.zeros(1), v, v, 0.0) for v in values]

    methods = (fig.DATA_PARALLEL, fig.Method("exact", 10), fig.Method("int8", 10))
    results = {
        "data parallel": runs(1.0, 1.0),
        "DiLoCo exact H=10": runs(2.0, 4.0),
        "DiLoCo int8 H=10": runs(2.2, 4.4),
    }
    text = fig.against_exact(methods, results)
    assert text.endswith("DiLoCo int8 H=10 +10.0 ± 0.0%.")
    assert fig.against_exact(methods[:2], results) == ""
