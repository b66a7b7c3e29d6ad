"""The pure parts of paper_figs/fig13_diloco_rounds.py: its methods and rounds, the cache of
finished runs, the sweep's walk and the criterion's eligibility (no training)."""

import math

import numpy as np

from paper_figs import fig13_diloco as base
from paper_figs import fig13_diloco_rounds as fig
from paper_figs.fig13_diloco import Method


def test_every_judged_configuration_has_at_least_64_rounds():
    judged = [m for m in fig.METHODS if m.compressor and m.sync_every in fig.SYNC_EVERY]
    assert len(judged) == 4 * len(fig.SYNC_EVERY) and len(fig.METHODS) == 1 + 12
    assert all(fig.rounds(m, fig.STEPS) >= fig.MIN_ROUNDS for m in judged)
    assert fig.rounds(fig.Method("exact", 5), 200) < fig.MIN_ROUNDS  # the quick mode's
    assert fig.STEPS % base.EVAL_EVERY == 0 and set(fig.scale().methods) <= set(fig.METHODS)


def test_runs_are_cached_as_they_finish_and_reused_only_with_resume(tmp_path, monkeypatch):
    trained = []

    def train(method, lr, seed, steps):
        trained.append((method.label, lr, seed))
        return {"curve": [3.0, 2.0], "validation": 2.0 + lr, "test": 2.1, "seconds": 1.0}

    monkeypatch.setattr(fig.Runs, "_train", staticmethod(train))
    path = tmp_path / "runs.json"
    runs = fig.Runs(path, resume=True)
    first = runs.get(Method("int8", 5), 1e-3, 0, 100)
    assert first.validation == 2.001 and list(first.curve) == [3.0, 2.0]
    runs.get(Method("int8", 5), 1e-3, 0, 100)
    assert len(trained) == 1 and path.exists()
    fig.Runs(path, resume=True).get(Method("int8", 5), 1e-3, 0, 100)
    assert len(trained) == 1  # read back
    fig.Runs(path, resume=False).get(Method("int8", 5), 1e-3, 0, 100)
    assert len(trained) == 2  # without --resume, run again
    fig.Runs(path, resume=True).get(Method("int8", 5), 1e-3, 1, 100)
    assert len(trained) == 3  # another seed is another run


def test_the_sweep_walks_the_ladder_past_an_end():
    losses = {1e-4: 2.6, 3e-4: 2.4, 1e-3: 2.5, 3e-3: 2.7, 1e-2: 2.9}

    asked = []

    class Fake:
        def get(self, method, lr, seed, steps):
            asked.append(lr)
            assert seed == base.SWEEP_SEED
            return base.Result(np.zeros(0), np.zeros(1), losses[lr], 0.0, 0.0)

    got = fig.sweep(Fake(), Method("exact", 5), 100)
    assert asked == [1e-3, 3e-3, 1e-2, 3e-4, 1e-4]
    assert base.best_rates({"m": got}) == {"m": 3e-4}


def _results(gaps: dict[str, float], seeds=(0, 1, 2)):
    """Data parallel at 2.0 on every seed; each label's validation ``2 (1 + gap)`` with a
    small spread."""
    out = {"data parallel": [base.Result(np.zeros(0), np.zeros(1), 2.0, 2.0, 1.0)] * len(seeds)}
    for label, gap in gaps.items():
        out[label] = [
            base.Result(np.zeros(0), np.zeros(1), 2.0 * (1 + gap + 1e-4 * s), 2.0, 1.0)
            for s in seeds
        ]
    return out


def test_only_configurations_with_enough_rounds_are_judged():
    methods = (base.DATA_PARALLEL, Method("SparseLoCo", 25), Method("exact", 100))
    s = fig.Scale(1600, (0, 1, 2), methods, False)
    traffics = {
        "data parallel": base.Traffic(8.0, 1e6, 1),
        "SparseLoCo H=25": base.Traffic(8.0, 1e5, 25),
        "DiLoCo exact H=100": base.Traffic(8.0, 1e6, 100),
    }
    rates = {m.label: 1e-3 for m in methods}
    # Exact DiLoCo at H = 100 (16 rounds) within 1% does not count; SparseLoCo at +10% fails.
    results = _results({"SparseLoCo H=25": 0.10, "DiLoCo exact H=100": 0.01})
    measured, verdict = fig.report(s, {}, rates, results, traffics)
    assert verdict.startswith("Did not reproduce") and "SparseLoCo H=25" in verdict
    assert "| DiLoCo exact H=100 | 16 |" in measured and "| SparseLoCo H=25 | 64 |" in measured
    results = _results({"SparseLoCo H=25": 0.02, "DiLoCo exact H=100": 0.01})
    assert fig.report(s, {}, rates, results, traffics)[1].startswith("Reproduced")
    quick = fig.Scale(200, (0,), methods, False)
    assert fig.report(quick, {}, rates, _results({}, (0,)) | {
        k: _results({k: 0.0}, (0,))[k] for k in ("SparseLoCo H=25", "DiLoCo exact H=100")
    }, traffics)[1].startswith("Not judged")  # fmt: skip


def test_the_sweep_table_prints_bits_per_character():
    table = fig.sweep_table({"m": {1e-3: math.log(2) * 2, 3e-3: math.log(2) * 3}})
    assert "| m | 2.000 | 3.000 |" in table
    assert table.splitlines()[0] == "| method | 0.001 | 0.003 |"
