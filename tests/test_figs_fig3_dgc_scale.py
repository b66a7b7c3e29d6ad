"""The pure helpers of paper_figs/fig3_dgc_scale.py: its methods and the verdict."""

from experiments.common import methods
from paper_figs import fig3_dgc_scale as fig


def test_methods_are_dense_and_dgc_with_every_trick():
    (dense, m_dense), (dgc, m_dgc) = fig.methods().values()
    assert methods.parse(dense).name == "dense" and m_dense == fig.MOMENTUM
    options = methods.parse(dgc).options
    assert options["ratio"] == fig.DENSITY == 0.001 and m_dgc == 0.0
    assert options["warmup_steps_per_phase"] == fig.steps_per_epoch() == 15
    assert options["clip_norm"] > 0 and options["sampled_threshold"] is False
    assert "momentum_correction" not in options and "momentum_masking" not in options


def test_verdict_needs_both_the_ratio_and_the_interval():
    assert fig.verdict(0.002, 0.005, 300.0).startswith("Reproduced")
    assert fig.verdict(0.002, 0.05, 300.0).startswith("Partly reproduced")
    assert fig.verdict(0.002, 0.005, 200.0).startswith("Partly reproduced")
    assert fig.verdict(0.03, 0.005, 200.0).startswith("Did not reproduce")
