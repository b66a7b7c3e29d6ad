"""Pure helpers of paper_figs/fig6_dad.py (no training)."""

import pathlib

import pytest

from experiments import train
from paper_figs.fig6_dad import accuracy_at_bits, max_loss_gap, per_bit_winner


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


def test_per_bit_winner():
    assert per_bit_winner(0.9, 10, 0.8, 20) == "a"
    assert per_bit_winner(0.8, 20, 0.9, 10) == "b"
    assert per_bit_winner(0.9, 20, 0.8, 10) == "mixed"
    assert per_bit_winner(0.9, 10, 0.9, 10) == "tie"
    assert per_bit_winner(0.9, 10, 0.9, 20) == "a"
