"""``make bench-e2e``'s late target: the simulated stage that fixes it and every seed's steps,
the rows (measured or simulated steps x measured step time), the goals, and ``--resume``."""

import json

import pytest

from experiments.e2e import late, late_report, task
from experiments.e2e import report as bench_e2e_report
from experiments.e2e import run as bench_e2e


def _sim(method, seed, evals, lr=1e-3):
    return {
        "method": method,
        "seed": seed,
        "lr": lr,
        "reached_step": None,
        "diverged": False,
        "steps_run": evals[-1][0],
        "evals": evals,
        "train_s": 1.0,
    }


def _sweep():
    methods = {key: {"lr": 1e-3, "steps_to_target": 4} for key in task.BY_KEY}
    sweep = {"target": 3.0, "target_lr": 5e-4, "budget_steps": 4, "max_steps": 12}
    return sweep | {"eval_every": 2, "model": {}, "seed": 0, "methods": methods}


def test_the_late_stage_fixes_the_target_then_runs_every_seed_resumably(tmp_path, monkeypatch):
    calls = []

    def simulate(runs, workers, tmp, max_steps):
        (run,) = runs
        calls.append((run["method"], run["seed"], run["target"], run["max_steps"]))
        if len(calls) == 3:
            raise KeyboardInterrupt  # stopped in its third run
        if run["target"] is None:  # the lead: bf16 for 3 x 4 steps, ending at 2.5
            return [_sim("bf16", 0, [(0, 4.0), (4, 3.0), (8, 2.6), (12, 2.5)])]
        return [_sim(run["method"], run["seed"], [(0, 4.0), (6, 2.9), (10, 2.4)])]

    monkeypatch.setattr(late, "simulate", simulate)
    args = bench_e2e.parse_args(["--late", "--late-file", str(tmp_path / "late.json")])
    with pytest.raises(KeyboardInterrupt):
        late.late(args, _sweep(), (0, 1))
    saved = json.loads((tmp_path / "late.json").read_text())
    assert saved["runs"]["bf16/0"]["steps_run"] == 12 and len(saved["runs"]) == 2
    assert calls[:2] == [("bf16", 0, None, 12), ("bf16", 1, 2.5, 24)]  # cap 2 x 12
    result = late.late(args, _sweep(), (0, 1))
    # Nothing finished is run twice (only the interrupted one is): the lead, the late methods
    # for both seeds (bf16/0 is the lead; the goals' methods first), then the others to the
    # early target for seed 1 only (the sweep ran seed 0).
    assert calls[2] == calls[3] == ("diloco-int8", 0, 2.5, 24)
    assert [c[0] for c in calls[4:7]] == ["diloco-int8", "sparseloco", "sparseloco"]
    assert len(calls) == 1 + (2 * len(late.LATE_METHODS) - 1) + len(late.EARLY_ONLY) + 1
    assert result["target"] == 2.5 and result["cap"] == 24 and result["late_steps"] == 12
    early_only = [c for c in calls if c[0] in late.EARLY_ONLY]
    assert {c[1] for c in early_only} == {1} and {c[2:] for c in early_only} == {(3.0, 12)}
    res = {"sweep": _sweep(), "late": result}
    assert late.simulated_steps(res, "sign-sg", 0, "early") == 4  # the sweep's
    assert late.simulated_steps(res, "sign-sg", 1, "early") == 6  # its own run's
    assert late.simulated_steps(res, "sign-sg", 1, "late") == 10
    assert late.simulated_steps(res, "bf16", 0, "late") == 12
    assert late.simulated_steps(res, "terngrad", 1, "late") is None  # never ran to it
    assert late.simulated_steps(res, "sign-sg", 2, "early") is None


def _timed(method, seed, times, reached, kind="measured"):
    evals = [(0, 4.0)] + [(s, 4.0 - s / 10) for s in range(2, len(times) + 1, 2)]
    run = {"method": method, "seed": seed, "kind": kind, "step_times": times}
    run |= {"reached_step": reached, "steps_run": len(times), "evals": evals, "workers": 4}
    return run | {"tx_bytes": 4 * len(times) * 100}


def _result():
    """Early-target runs at both rates; the late stage's simulations of seed 0: bf16 needs 12
    steps to the late target, the vote 10, DiLoCo 20 (rounds of 2 steps)."""
    res = {"sweep": _sweep(), "measured_rate": "1gbit", "workers": 4}
    res |= {"local_methods": ["diloco-int8"], "sync_every": {"diloco-int8": 2}, "labels": {}}
    res["rates"] = {
        "1gbit": [
            _timed("fp32", 0, [2.0] * 4, 4),
            _timed("bf16", 0, [1.0] * 4, 4),
            _timed("sign-sg", 0, [0.25] * 4, 4),
            _timed("diloco-int8", 0, [0.1, 0.3] * 3, 6),
        ],
        "100mbit": [
            _timed("fp32", 0, [20.0] * 3, None, "extrapolated"),
            _timed("bf16", 0, [10.0] * 3, None, "extrapolated"),
            _timed("sign-sg", 0, [1.0] * 3, None, "extrapolated"),
            _timed("diloco-int8", 0, [0.1, 0.5] * 3, 6),
        ],
    }
    runs = {
        f"{key}/0": _sim(key, 0, [(0, 4.0), (steps, 2.5)])
        for key, steps in (("fp32", 12), ("bf16", 12), ("sign-sg", 10), ("diloco-int8", 20))
    }
    res["late"] = {"target": 2.5, "late_steps": 12, "cap": 24, "runs": runs}
    return res


def test_late_rows_multiply_each_seeds_simulated_steps_by_the_measured_step_time():
    table = {(r["rate"], r["method"]): r for r in late_report.rows(_result())}
    assert table["1gbit", "bf16"]["seconds"] == 12.0 and table["1gbit", "fp32"]["seconds"] == 24
    vote = table["1gbit", "sign-sg"]
    assert vote["kind"] == "extrapolated" and vote["steps_from"] == "simulation"
    assert vote["seconds"] == 2.5 and vote["speedup_bf16"] == pytest.approx(12 / 2.5)
    assert vote["bits"] == pytest.approx(800 * 10) and vote["final_validation"] == 2.5
    # A local-steps method's step time is a round's mean, its synchronisation included.
    assert table["100mbit", "diloco-int8"]["seconds"] == pytest.approx(20 * 0.3)
    assert table["100mbit", "sign-sg"]["seconds"] == 10.0
    assert table["100mbit", "sign-sg"]["bits"] is None  # its early run was extrapolated
    assert ("1gbit", "terngrad") not in table  # not a late method


def test_a_measured_late_run_is_judged_against_its_out_of_sample_prediction():
    res = _result()
    # Across processes at 0.1 Gbit/s DiLoCo needs 22 steps (its simulation 20) and its round
    # takes 0.8 s where its early-target run's took 0.6 s.
    res["late_rates"] = {"100mbit": [_timed("diloco-int8", 0, [0.2, 0.6] * 11, 22)]}
    row = next(
        r for r in late_report.rows(res) if (r["rate"], r["method"]) == ("100mbit", "diloco-int8")
    )
    assert row["kind"] == "measured" and row["seconds"] == pytest.approx(8.8)
    assert row["predicted_s"] == pytest.approx(6.0)
    assert row["measured_over_predicted"] == pytest.approx(8.8 / 6.0)
    assert row["steps_over_simulated"] == pytest.approx(22 / 20)
    assert row["speedup_bf16"] == pytest.approx(120 / 8.8)
    lines = late_report.goals(late_report.rows(res), res)
    assert lines[0].startswith("GOAL late target: some method >= 1.5x bf16 at 1 Gbit/s: MET")
    assert "(sign-sg, 4.80x)" in lines[0]
    assert "0.1 Gbit/s: MET (diloco-int8, 13.64x)" in lines[1]
    assert "prediction: MISSED (1 runs; worst 1.47: diloco-int8 seed 0 at 100mbit" in lines[2]
    assert lines[2].endswith("its time per step 1.33x the prediction's)")
    # Not reached within the cap: no seconds, no speedup (counted 0 by the goal).
    res["late_rates"]["100mbit"][0]["reached_step"] = None
    table = late_report.rows(res)
    lines = late_report.goals(table, res)
    assert "0.1 Gbit/s: MISSED (diloco-int8, 0.00x)" in lines[1] and "NOT RUN" in lines[2]
    res |= {"machine": {"cpu": "cpu", "cpu_count": 2}, "seconds": 1.0, "parameters": 10}
    text = late_report.markdown(res, table)
    assert "not reached within it: diloco-int8" in text
    assert "Not run yet (no simulation): sparseloco, qsgd512-sg, onebit-adam." in text
    assert "| diloco-int8 | measured | 0/1 | not reached | not reached (—) |" in text
    assert "| sign-sg | extrapolated (simulated steps) | 1/1 | 10 | 2.5 (0.0) |" in text


def test_the_report_carries_the_late_section_and_resume_keeps_late_runs(tmp_path):
    res = _result() | {"machine": {"cpu": "cpu", "cpu_count": 2}, "seconds": 1.0}
    res |= {"parameters": 10}
    res["late_rates"] = {"100mbit": [_timed("diloco-int8", 0, [0.2, 0.6] * 11, 22)]}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(res))
    text = bench_e2e_report.rerender(saved)
    assert "# The late target" in text and "## 100mbit, late target" in text
    assert text.index("## 1gbit\n") < text.index("# The late target")
    key = bench_e2e.run_key(res["late_rates"]["100mbit"][0], "100mbit", 4)
    assert key in bench_e2e.saved_runs([saved])
    # --late-file: the late stage's file as it is now, not the one the results file saved.
    later = dict(res["late"]) | {"target": 2.5}
    (tmp_path / "late.json").write_text(json.dumps(later))
    assert bench_e2e_report.main([str(saved), "--late-file", str(tmp_path / "late.json")]) == 0
    assert json.loads(saved.read_text())["late"]["target"] == 2.5
    # Without the late stage the report is the early one alone.
    del res["late"]
    saved.write_text(json.dumps(res))
    assert "late target" not in bench_e2e_report.rerender(saved)


def test_only_seeds_whose_simulation_reached_the_late_target_run_to_it(monkeypatch):
    res = _result()
    res["late"]["runs"]["diloco-int8/1"] = _sim("diloco-int8", 1, [(0, 4.0), (24, 2.7)])
    asked, written = [], []

    def timed_runs(args, methods, sweep_result, model, saved, progress):
        (m,) = methods
        asked.append((m.key, tuple(args.seeds), args.rates, sweep_result["target"]))
        got = {"100mbit": [{"method": m.key, "seed": s} for s in args.seeds]}
        progress(got)
        return got

    monkeypatch.setattr(bench_e2e, "timed_runs", timed_runs)
    args = bench_e2e.parse_args(["--late-rates", "100mbit"])
    methods = task.select(["bf16", "diloco-int8", "sparseloco"])
    out = bench_e2e.late_timed_runs(
        args, methods, res["sweep"], res, {}, lambda r, f: written.append((f, r))
    )
    # Seed 1 of DiLoCo never reached it in simulation (cap 24); SparseLoCo has no simulation.
    assert asked == [("diloco-int8", (0,), ("100mbit",), 2.5)]
    assert out == {"100mbit": [{"method": "diloco-int8", "seed": 0}]}
    assert written == [("late_rates", out)]


def test_late_command_line():
    args = bench_e2e.parse_args([])
    assert args.late_rates == ("100mbit",)
    assert bench_e2e.parse_args(["--late-rates", ""]).late_rates == ()
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--late-rates", "10gbit"])
