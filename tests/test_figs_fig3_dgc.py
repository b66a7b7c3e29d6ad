"""The pure helpers of paper_figs/fig3_dgc.py: the ablation's methods and the verdict."""

import dataclasses

from experiments.common import methods
from paper_figs import fig3_dgc as fig


def test_ablation_methods_parse_and_add_one_trick_at_a_time():
    runs = fig.ablation()
    assert len(runs) == 7
    parsed = [methods.parse(spec) for _, spec, _ in runs]
    assert [m.name for m in parsed] == ["dense"] + ["dgc"] * 6
    options = [m.options for m in parsed[1:6]]
    assert options[0]["momentum_correction"] is False
    assert "momentum_correction" not in options[1] and options[1]["momentum_masking"] is False
    assert "momentum_masking" not in options[2]
    assert "clip_norm" not in options[2] and options[3]["clip_norm"] == fig.CLIP_NORM
    assert options[4]["warmup_steps_per_phase"] == fig.steps_per_epoch() > 0
    # momentum lives in the SGD exactly when DGC does not correct for it
    assert [m for _, _, m in runs] == [fig.MOMENTUM, fig.MOMENTUM] + [0.0] * 5
    assert parsed[6].options["ratio"] == fig.PAPER_RATIO
    sampled = fig.ablation(sampled=True)
    assert sampled[:7] == runs and len(sampled) == 8
    assert "sampled_threshold" not in methods.parse(sampled[7][1]).options
    assert methods.parse(runs[6][1]).options["sampled_threshold"] is False


def test_verdict_words():
    row = fig.Row("x", "m", test=0.6, train=0.9, cum_bits=1.0, ratio=1.0, steady=1.0)
    rows = [row] * 5 + [dataclasses.replace(row, ratio=30.0)] * 2
    assert fig.verdict(rows).startswith("Reproduced")
    worse = dataclasses.replace(row, test=0.55, ratio=70.0)
    assert fig.verdict([*rows[:6], worse]).startswith("Partly reproduced")
    assert fig.verdict([*rows[:5], worse, worse]).startswith("Did not reproduce")


def test_verdict_states_whether_the_interval_rules_out_a_one_point_loss():
    row = fig.Row("x", "m", test=0.6, train=0.9, cum_bits=1.0, ratio=1.0, steady=1.0)
    tight = dataclasses.replace(row, gap=(0.002, 0.005))
    loose = dataclasses.replace(row, gap=(0.002, 0.02))
    text = fig.verdict([row] * 5 + [tight, loose])
    assert text.startswith("Reproduced")
    assert "+0.20 ± 0.50 points" in text and "rules out a loss" in text
    assert "+0.20 ± 2.00 points" in text and "does not rule out" in text
    one_seed = dataclasses.replace(row, gap=(0.002, float("inf")))
    assert "one seed, no interval" in fig.verdict([row] * 6 + [one_seed])
