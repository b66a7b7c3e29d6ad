"""The pure helpers of paper_figs/fig3_dgc_lm.py: its methods and the verdict."""

from experiments.common import methods
from paper_figs import fig3_dgc_lm as fig


def test_methods_are_dense_and_dgc_with_every_trick():
    (dense, m_dense), (dgc, m_dgc) = fig.methods().values()
    assert methods.parse(dense).name == "dense" and m_dense == fig.MOMENTUM
    options = methods.parse(dgc).options
    assert options["ratio"] == fig.DENSITY == 0.001 and m_dgc == 0.0
    assert options["warmup_steps_per_phase"] == fig.WARMUP
    assert 4 * fig.WARMUP < fig.scale().steps  # some steps at the final density
    assert options["clip_norm"] > 0 and options["sampled_threshold"] is False


def test_verdict_needs_the_loss_interval_and_the_ratio():
    assert fig.verdict((0.005, 0.01), 300.0, 95.0).startswith("Reproduced")
    assert fig.verdict((0.005, 0.04), 300.0, 95.0).startswith("Partly reproduced")
    assert fig.verdict((0.005, 0.01), 200.0, 95.0).startswith("Partly reproduced")
    assert fig.verdict((0.1, 0.01), 200.0, 95.0).startswith("Did not reproduce")
