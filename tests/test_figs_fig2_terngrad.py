"""The pure helpers of paper_figs/fig2_terngrad.py: the configs, the gaps and the verdict."""

from paper_figs import fig2_terngrad as fig


def test_configs_cover_every_worker_count_and_method():
    s = fig.Scale(steps=7, seeds=(0, 1))
    cfgs = fig.configs(s)
    assert len(cfgs) == len(fig.WORKERS) * len(fig.METHODS) * 2
    assert {(c.workers, c.method) for c in cfgs} == {
        (n, m) for n in fig.WORKERS for m in fig.METHODS.values()
    }
    assert all(c.steps == 7 and c.task == fig.TASK for c in cfgs)


def test_gaps_are_baseline_minus_method():
    table = {("a", 2): 0.9, ("b", 2): 0.85, ("a", 4): 0.8, ("b", 4): 0.82}
    assert fig.gaps(table, "a", "b") == {2: 0.9 - 0.85, 4: 0.8 - 0.82}


def test_verdict_words():
    assert fig.verdict({2: 0.01, 4: 0.0}, {2: 0.05, 4: 0.03}).startswith("Reproduced")
    assert fig.verdict({2: 0.01, 4: 0.0}, {2: 0.01, 4: 0.0}).startswith("Partly reproduced")
    assert fig.verdict({2: 0.03, 4: 0.0}, {2: 0.08, 4: 0.0}).startswith("Did not reproduce")
