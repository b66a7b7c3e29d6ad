"""Pure helpers of paper_figs/fig10_onebit_adam.py and fig11_variance_per_bit.py (no training)."""

import math

import numpy as np
import pytest

from experiments.common import methods
from paper_figs import fig10_onebit_adam as fig10
from paper_figs import fig11_variance_per_bit as fig11


def test_band_is_the_range_for_two_seeds_and_a_t_interval_from_three():
    two = np.array([[1.0, 2.0], [3.0, 2.0]])
    mean, lo, hi = fig10.band(two)
    np.testing.assert_allclose([mean, lo, hi], [[2, 2], [1, 2], [3, 2]])
    three = np.array([[1.0], [2.0], [3.0]])
    mean, lo, hi = fig10.band(three)
    half = 4.302652729911275 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    np.testing.assert_allclose([mean[0], lo[0], hi[0]], [2, 2 - half, 2 + half])


def test_first_below_and_the_warm_up_share():
    assert fig10.first_below(np.arange(4), np.array([3.0, 2.0, 1.0, 0.5]), 1.0) == 2
    assert fig10.first_below(np.arange(2), np.array([3.0, 2.0]), 1.0) is None
    for s in (fig10.Scale(300, (0,), 25), fig10.Scale(600, (0,), 25)):
        assert 0.15 <= s.freeze_step / s.steps <= 0.2
        for spec in fig10.methods(s).values():
            methods.parse(spec)


def test_fig11_specs_parse_with_the_claimed_bias():
    for spec, _ in fig11.UNBIASED:
        assert methods.parse(spec).compressor.unbiased, spec
    for spec, _ in fig11.BIASED:
        assert not methods.parse(spec).compressor.unbiased, spec


def test_padded_limit_weights_each_layer_by_its_kept_share():
    grads = [{"a": np.ones(4096, np.float32), "b": np.ones(640, np.float32)}]
    expected = fig11.EDEN_LIMIT * (4096 + 640 * 640 / 1024) / (4096 + 640)
    assert fig11.padded_limit(grads) == pytest.approx(expected)
