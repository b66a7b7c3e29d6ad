"""Pure helpers of paper_figs/fig6_dad.py (no training)."""

import pathlib

import pytest

from experiments import train
from paper_figs import common
from paper_figs.fig6_dad import accuracy_at_bits, max_loss_gap, paired_per_bit


def _run(losses, bits_per_step, evals):
    records = [{"step": 0, "test_accuracy": evals[0]}]
    cum = 0.0
    for step, loss in enumerate(losses, start=1):
        cum += bits_per_step
        records.append({"step": step, "loss": loss, "bits": bits_per_step, "cum_bits": cum})
        if step in evals:
            records[-1]["test_accuracy"] = evals[step]
    return train.Run(pathlib.Path("."), train.Config(), {}, records)


def test_max_loss_gap():
    a = _run([1.0, 0.5, 0.25], 10, {0: 0.1})
    b = _run([1.0, 0.4, 0.30], 10, {0: 0.1})
    assert max_loss_gap(a, b) == pytest.approx(0.1)


def test_accuracy_at_bits_interpolates_and_stops_at_total():
    run = _run([1.0] * 4, 10, {0: 0.0, 2: 0.4, 4: 0.8})
    assert accuracy_at_bits(run, 20) == pytest.approx(0.4)
    assert accuracy_at_bits(run, 30) == pytest.approx(0.6)
    assert accuracy_at_bits(run, 10) == pytest.approx(0.2)
    assert accuracy_at_bits(run, 41) is None


def test_paired_per_bit_uses_the_accuracy_at_the_same_bits():
    ours = [_run([1.0] * 4, 5, {0: 0.0, 4: 0.7}), _run([1.0] * 4, 5, {0: 0.0, 4: 0.5})]
    theirs = [_run([1.0] * 4, 10, {0: 0.0, 2: 0.4, 4: 0.8}), _run([1.0] * 2, 5, {0: 0.0, 2: 0.6})]
    # Seed 0: PowerSGD had 0.4 after 20 bits; seed 1: it sent only 10 bits, final 0.6.
    assert paired_per_bit(ours, theirs) == pytest.approx([0.3, -0.1])


def test_mean_ci95_and_its_verdict():
    mean, half = common.mean_ci95([0.01, 0.02, 0.03])
    assert mean == pytest.approx(0.02)
    assert half == pytest.approx(4.302653 * 0.01 / 3**0.5, rel=1e-5)  # t(0.975, 2)
    assert common.ci_verdict(mean, half) == "no difference"
    assert common.ci_verdict(0.05, 0.01) == "higher"
    assert common.ci_verdict(-0.05, 0.01) == "lower"
    assert common.mean_ci95([0.3])[1] == float("inf")
