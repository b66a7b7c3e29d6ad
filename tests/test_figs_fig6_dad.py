"""Pure helpers of paper_figs/fig6_dad.py (no training)."""

import pathlib

import numpy as np
import pytest

from experiments.harness import train
from paper_figs import common, fig6_dad
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


def test_first_divergence_is_the_first_step_over_the_tolerance():
    a = _run([1.0, 0.5, 0.25, 0.2], 10, {0: 0.1})
    b = _run([1.0, 0.5004, 0.3, 0.2], 10, {0: 0.1})
    assert fig6_dad.first_divergence(a, b, tol=1e-3) == 3
    assert fig6_dad.first_divergence(a, b, tol=0.1) is None


def test_exact_window_is_set_by_the_control_that_leaves_first():
    assert fig6_dad.exact_window([700, None, 400], steps=2000) == 399
    assert fig6_dad.exact_window([None, None], steps=600) == 600
    # dAD must not leave the tolerance inside the window, in any seed
    assert fig6_dad.exact_within([None, 400, 1200], 399)
    assert not fig6_dad.exact_within([None, 399, 1200], 399)
    assert not fig6_dad.exact_within([3], 399)  # a wrong gradient shows at once


def test_the_rounding_control_is_dense_one_ulp_above_the_learning_rate():
    labelled = fig6_dad.configs(10, (0, 1), 5)
    twins = [cfg for label, cfg in labelled if label == fig6_dad.TWIN]
    assert len(twins) == 2 and all(c.method == "dense()" for c in twins)
    lr = np.float32(fig6_dad.LR)
    assert np.float32(twins[0].lr) == np.nextafter(lr, np.float32(1)) != lr
    others = [cfg for label, cfg in labelled if label != fig6_dad.TWIN]
    assert {c.lr for c in others} == {fig6_dad.LR}
    assert [label for label, _ in labelled[: len(fig6_dad.methods())]] == fig6_dad.methods()


def test_divergence_note_names_the_early_seeds_and_the_shared_steps():
    note = fig6_dad.divergence_note([1069, 383, 418], [722, 564, 418], (0, 2, 4), 417)
    assert note == (
        " (seed 2 at step 383); in 1 of 3 seeds dAD and the control leave dense() at the same step"
    )
    assert fig6_dad.divergence_note([None, 383], [None, 383], (0, 1), 2000).endswith(
        "in 1 of 2 seeds dAD and the control leave dense() at the same step"
    )
    never = fig6_dad.divergence_note([None, None], [None, None], (0, 1), 600)
    assert never == "; neither dAD nor the control ever leaves it"
