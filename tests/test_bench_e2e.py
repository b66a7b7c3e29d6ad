"""``make bench-e2e``'s parts: the text task, the sweep's choice, the time-to-target report,
the goals and the command line; and (slow) a tiny run in simulation and across processes
reaching the target at the same step.
"""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments.common import data, netns
from experiments.e2e import report as bench_e2e_report
from experiments.e2e import run as bench_e2e
from experiments.e2e import sweep as bench_e2e_sweep
from experiments.e2e import task
from experiments.e2e import worker as bench_e2e_worker


def test_the_model_is_a_few_million_parameters_over_characters():
    assert task.MODEL.vocab == len(data.CHARACTERS) + 1
    assert 5e6 <= task.MODEL.parameters <= 10e6


def test_rows_are_windows_of_the_text_with_their_next_characters():
    train, validation = task.rows()
    assert train.shape[1] == validation.shape[1] == task.MODEL.length + 1
    assert train.dtype == np.int32 and train.min() >= 0 and train.max() < task.MODEL.vocab
    codes = data.encode(data.pydoc_text())
    # Consecutive windows overlap by one character: the last target is the next first input.
    np.testing.assert_array_equal(train[0, :-1], codes[: task.MODEL.length])
    np.testing.assert_array_equal(train[1, 0], train[0, -1])
    # Validation comes after every training character (the split is in text order).
    assert len(train) * task.MODEL.length < len(codes) - len(validation) * task.MODEL.length


def test_batches_are_a_function_of_seed_step_and_worker():
    train, _ = task.rows()
    a = task.batch_rows(train, 0, 5, 2, 3)
    np.testing.assert_array_equal(a, task.batch_rows(train, 0, 5, 2, 3))
    assert a.shape == (3, task.MODEL.length + 1)
    for other in [(1, 5, 2), (0, 6, 2), (0, 5, 3)]:
        assert not np.array_equal(a, task.batch_rows(train, *other, 3))


def test_validation_rows_split_evenly_over_the_workers():
    _, validation = task.rows()
    assert len(task.validation_rows(validation, 4)) == 256
    assert len(task.validation_rows(validation, 3)) == 255


def _run(method, reached, evals, lr=1e-3, diverged=False):
    return {
        "method": method,
        "lr": lr,
        "reached_step": reached,
        "evals": evals,
        "diverged": diverged,
    }


def test_the_sweep_keeps_the_fewest_steps_to_target_else_the_lowest_loss():
    runs = [_run("a", 30, [(30, 2.0)], 1e-3), _run("a", 20, [(20, 2.1)], 2e-3)]
    assert bench_e2e_sweep.best(runs)["lr"] == 2e-3
    none = [_run("a", None, [(9, 2.5)], 1e-3), _run("a", None, [(9, 2.4)], 2e-3)]
    assert bench_e2e_sweep.best(none)["lr"] == 2e-3
    diverged = [_run("a", None, [(9, float("nan"))], 1e-3, True), _run("a", None, [(9, 3.0)], 2e-3)]
    assert bench_e2e_sweep.best(diverged)["lr"] == 2e-3


def test_a_grid_grows_past_the_end_its_kept_rate_lies_at():
    mid = [_run("a", 30, [(30, 2.0)], 1e-3), _run("a", 20, [(20, 2.0)], 2e-3)]
    mid += [_run("a", 40, [(40, 2.0)], 4e-3)]
    assert bench_e2e_sweep.next_rate(mid) is None
    low = [_run("a", 20, [(20, 2.0)], 1e-3), _run("a", 30, [(30, 2.0)], 2e-3)]
    assert bench_e2e_sweep.next_rate(low) == pytest.approx(5e-4)
    high = [_run("a", None, [(90, 2.6)], 3e-4), _run("a", None, [(90, 2.5)], 1e-3)]
    assert bench_e2e_sweep.next_rate(high) == pytest.approx(1e-3 / 0.3)
    calls = []

    def run_at(rates, found):  # each new rate is better still: the grid grows twice, no more
        calls.append(rates)
        return [_run("a", 10 - len(calls), [(9, 2.0)], rates[0])]

    assert bench_e2e_sweep.extend(low, run_at)
    assert calls == [[pytest.approx(5e-4)], [pytest.approx(2.5e-4)]]
    assert not bench_e2e_sweep.extend(mid, run_at)


def test_a_stopped_sweep_resumes_at_the_rate_it_was_running(tmp_path, monkeypatch):
    """Each rate is saved as it ends; a rerun runs only the rates not yet run, capped at the
    fewest steps to target already found."""
    sweep_file = tmp_path / "sweep.json"
    target = [_run("bf16", None, [(4, 2.0)], lr) for lr in (1e-3, 2e-3, 5e-4)]
    target[0]["evals"] = [(4, 1.5)]  # 1e-3 is kept: an interior rate, no growth
    sweep_file.write_text(json.dumps({"budget_steps": 4, "model": {}, "target_runs": target}))
    calls = []

    def simulate(runs, workers, tmp, max_steps):
        (run,) = runs
        calls.append((run["lr"], run["earlier"]))
        if len(calls) == 2:
            raise KeyboardInterrupt  # stopped while its second rate runs
        steps = {5e-4: 6, 1e-3: 8, 2.5e-4: 10}[run["lr"]]
        return [
            _run("qsgd512-sg", steps, [(steps, 1.4)], run["lr"])
            | {"steps_run": steps, "train_s": 1.0}
        ]

    monkeypatch.setattr(bench_e2e_sweep, "simulate", simulate)
    args = bench_e2e.parse_args(["--sweep-file", str(sweep_file), "--budget-steps", "4"])
    method = task.select(["qsgd512-sg"])
    with pytest.raises(KeyboardInterrupt):
        bench_e2e_sweep.sweep(args, method, {})
    saved = json.loads(sweep_file.read_text())
    assert [r["lr"] for r in saved["partial"]["qsgd512-sg"]] == [5e-4]
    bench_e2e_sweep.sweep(args, method, {})
    # 5e-4 was not run again; the next rates were capped by its 6 steps (and 1e-3's 8).
    assert calls[2:] == [(1e-3, [6]), (2.5e-4, [6, 8])]
    saved = json.loads(sweep_file.read_text())
    assert saved["methods"]["qsgd512-sg"]["lr"] == 5e-4 and saved["partial"] == {}


def test_a_swept_rate_stops_at_the_fewest_steps_an_earlier_rate_of_its_method_needed():
    run = {"method": "a", "max_steps": 90}
    assert bench_e2e_worker.capped(run | {"earlier": [40, 30]})["max_steps"] == 30
    assert bench_e2e_worker.capped(run | {"earlier": []})["max_steps"] == 90
    assert bench_e2e_worker.capped(run) == run  # a timed run is never capped


def _timed(method, seed, times, reached, kind="measured", tx=None):
    evals = [(0, 4.0)] + [(s, 4.0 - s / 10) for s in range(2, len(times) + 1, 2)]
    return {
        "method": method,
        "seed": seed,
        "kind": kind,
        "step_times": times,
        "reached_step": reached,
        "steps_run": len(times),
        "evals": evals,
        "workers": 4,
        "tx_bytes": tx,
    }


def _result():
    sweep = {"target": 3.6, "budget_steps": 4, "max_steps": 12}
    sweep["methods"] = {"fp32": {"steps_to_target": 4}, "bf16": {"steps_to_target": 4}}
    sweep["methods"]["sign-sg"] = {"steps_to_target": 6}
    return {
        "sweep": sweep,
        "measured_rate": "1gbit",
        "workers": 4,
        "rates": {
            "1gbit": [
                _timed("fp32", 0, [2.0] * 4 + [9.0], 4, tx=4 * 5 * 1000),
                _timed("bf16", 0, [1.0] * 4, 4, tx=4 * 4 * 500),
                _timed("sign-sg", 0, [0.25] * 6, 6, tx=4 * 6 * 10),
            ],
            "100mbit": [
                _timed("fp32", 0, [20.0, 19.0, 21.0], None, "extrapolated"),
                _timed("bf16", 0, [10.0, 10.0, 10.0], None, "extrapolated"),
                _timed("sign-sg", 0, [1.0, 1.5, 1.0], None, "extrapolated"),
            ],
        },
    }


def test_time_to_target_speedups_bits_and_extrapolation():
    res = _result()
    table = {(r["rate"], r["method"]): r for r in bench_e2e_report.rows(res)}
    fp32, bf16, sign = (table["1gbit", k] for k in ("fp32", "bf16", "sign-sg"))
    # Steps after the one that reached the target do not count.
    assert fp32["seconds"] == 8.0 and bf16["seconds"] == 4.0 and sign["seconds"] == 1.5
    assert sign["speedup_fp32"] == pytest.approx(8 / 1.5)
    assert sign["speedup_bf16"] == pytest.approx(4 / 1.5)
    assert fp32["bits"] == pytest.approx(8 * 1000 * 4) and sign["bits_per_step"] == 80.0
    # Predicted: simulated steps x the median step time; measured rows only get a ratio.
    assert fp32["predicted_s"] == 8.0 and fp32["measured_over_predicted"] == 1.0
    slow = table["100mbit", "sign-sg"]
    assert slow["steps"] == 6 and slow["seconds"] == 6.0 and slow["measured_over_predicted"] is None
    assert table["100mbit", "fp32"]["seconds"] == 80.0
    assert slow["speedup_bf16"] == pytest.approx(40 / 6)
    assert slow["final_validation"] == sign["final_validation"]


def test_a_local_steps_prediction_counts_its_synchronisations():
    # Rounds of 3 steps, the last of each synchronising (5 s): the median step (0.5 s) would
    # predict 3 s for 6 steps; the round's mean step (2 s) predicts the 12 s it took.
    res = _result() | {"local_methods": ["diloco"], "sync_every": {"diloco": 3}}
    res["sweep"]["methods"]["diloco"] = {"steps_to_target": 6}
    times = [0.5, 0.5, 5.0] * 2 + [0.5]  # the last, unfinished round does not count
    res["rates"]["100mbit"].append(_timed("diloco", 0, times, 6))
    diloco = next(r for r in bench_e2e_report.rows(res) if r["method"] == "diloco")
    assert diloco["seconds"] == 12.0 and diloco["step_s"] == 2.0
    assert diloco["predicted_s"] == 12.0 and diloco["measured_over_predicted"] == 1.0
    # A synchronous method keeps the median step (its first, slow step does not move it).
    assert bench_e2e_report.step_time({"step_times": [9.0, 1.0, 1.0]}) == 1.0
    # Fewer steps than a round: their mean.
    assert bench_e2e_report.step_time({"step_times": [1.0, 3.0]}, 3) == 2.0


def test_a_warm_up_is_timed_apart_and_runs_to_the_target_at_every_rate():
    # 1-bit Adam: 2 dense warm-up steps of 10 s, then 1 s steps.  The median step (1 s) would
    # predict 5 s for 5 steps; the phases predict 2 x 10 + 3 x 1 = 23 s.
    res = _result() | {"warmup": {"onebit-adam": 2}}
    res["sweep"]["methods"]["onebit-adam"] = {"steps_to_target": 5}
    res["rates"]["100mbit"].append(_timed("onebit-adam", 0, [10.0, 10.0, 1.0, 1.0, 1.0], 5))
    onebit = next(r for r in bench_e2e_report.rows(res) if r["method"] == "onebit-adam")
    assert onebit["seconds"] == 23.0 and onebit["predicted_s"] == 23.0
    assert bench_e2e_report.predict({"step_times": [10.0, 10.0, 1.0]}, 1, 1.0, warmup=2) == 10.0
    # A few steps time a steady method only: the others run to the target at every rate.
    steady = {key for key, m in task.BY_KEY.items() if m.steady}
    assert "sign-sg" in steady and "qsgd512-sg" in steady
    assert not steady & {"onebit-adam", "diloco", "diloco-int8", "sparseloco"}


def test_without_the_measured_rate_steps_to_target_come_from_the_simulation(tmp_path):
    res = _result()
    del res["rates"]["1gbit"]
    res["sweep"]["seed"], res["labels"] = 0, {}
    for key, m in res["sweep"]["methods"].items():
        steps = m["steps_to_target"]
        m |= {"lr": 1e-3, "runs": [_run(key, None, [(0, 4.0), (steps, 3.5)], 1e-3)]}
    table = {(r["rate"], r["method"]): r for r in bench_e2e_report.rows(res)}
    slow = table["100mbit", "sign-sg"]
    assert slow["steps"] == 6 and slow["seconds"] == 6.0 and slow["steps_from"] == "simulation"
    assert table["100mbit", "fp32"]["seconds"] == 80.0 and slow["final_validation"] == 3.5
    assert slow["speedup_bf16"] == pytest.approx(40 / 6)
    text = bench_e2e_report.markdown(
        res
        | {"machine": {"cpu": "cpu", "cpu_count": 2}, "seconds": 1.0, "parameters": 10}
        | {"labels": {}},
        bench_e2e_report.rows(res),
    )
    assert "| sign-sg | extrapolated (simulated steps) | 1/1 | 6 |" in text
    bench_e2e_report.figure(res, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0
    res["rates"]["100mbit"][2]["seed"] = 1  # another seed than the sweep's: no steps known
    assert bench_e2e_report.rows(res)[2]["steps"] is None


def test_goals_are_met_missed_or_not_run():
    res = _result()
    lines = bench_e2e_report.goals(bench_e2e_report.rows(res), res)
    assert "MET (best sign-sg, 2.67x)" in lines[0]
    assert "NOT RUN" in lines[1]
    assert "prediction: MET" in lines[2]
    # Over seeds the goal takes the mean (a seed not reached counts 0), not the best seed.
    rates = res["rates"]["1gbit"]
    res["rates"]["1gbit"] = rates + [r | {"seed": 1} for r in rates]
    res["rates"]["1gbit"][-1] |= {"reached_step": None}
    lines = bench_e2e_report.goals(bench_e2e_report.rows(res), res)
    assert "MISSED (best sign-sg, 1.33x, mean of 2 seeds: 0.00 to 2.67x)" in lines[0]
    res["rates"]["1gbit"][2]["step_times"] = [1.0] * 6
    lines = bench_e2e_report.goals(bench_e2e_report.rows(res), res)
    assert "MISSED (best sign-sg, 0.33x, mean of 2 seeds: 0.00 to 0.67x)" in lines[0]


def test_each_seed_is_predicted_from_its_own_simulation():
    # Seed 1 of the vote needs 8 steps where the sweep's seed 0 needed 6: without seed 1's
    # own simulation it gets no prediction (seed 0's is not borrowed); with it (the late
    # stage's run, which reaches the early target at step 8 on its way), 1.00x.
    res = _result()
    res["rates"]["1gbit"].append(_timed("sign-sg", 1, [0.25] * 8, 8))
    seed1 = next(r for r in bench_e2e_report.rows(res) if r["seed"] == 1)
    assert seed1["predicted_s"] is None and seed1["measured_over_predicted"] is None
    assert "; 3 runs)" in bench_e2e_report.goals(bench_e2e_report.rows(res), res)[2]
    res["late"] = {"target": 3.3, "runs": {"sign-sg/1": {"evals": [(0, 4.0), (8, 3.55)]}}}
    seed1 = next(r for r in bench_e2e_report.rows(res) if r["seed"] == 1)
    assert seed1["predicted_s"] == 2.0 and seed1["measured_over_predicted"] == 1.0


def test_the_prediction_goal_names_its_worst_run_and_splits_steps_from_step_time():
    # Seed 1 of the vote needs 8 steps where its simulation needed 6, at the predicted step
    # time: 1.33x the prediction, all of it steps.
    res = _result()
    res["rates"]["1gbit"].append(_timed("sign-sg", 1, [0.25] * 8, 8))
    res["late"] = {"target": 3.3, "runs": {"sign-sg/1": {"evals": [(0, 4.0), (6, 3.55)]}}}
    table = bench_e2e_report.rows(res)
    seed1 = next(r for r in table if (r["method"], r["seed"]) == ("sign-sg", 1))
    assert seed1["measured_over_predicted"] == pytest.approx(8 / 6)
    assert seed1["steps_over_simulated"] == pytest.approx(8 / 6)
    line = bench_e2e_report.goals(table, res)[2]
    assert "prediction: MISSED (worst measured/predicted 1.33: sign-sg seed 1 at 1gbit" in line
    assert "its steps 1.33x its seed's simulation's, its time per step 1.00x" in line
    # A step slower than the median (which the prediction takes) shows in the second factor:
    # 2 + 7 x 0.25 s over 6 x 0.25 s is 2.5x, the steps' 1.33x times 1.88x.
    res["rates"]["1gbit"][-1]["step_times"] = [2.0] + [0.25] * 7
    line = bench_e2e_report.goals(bench_e2e_report.rows(res), res)[2]
    assert "measured/predicted 2.50: sign-sg seed 1" in line
    assert "its steps 1.33x its seed's simulation's, its time per step 1.88x" in line


def test_the_report_and_figure_are_written(tmp_path):
    res = _result() | {"machine": {"cpu": "cpu", "cpu_count": 2}, "seconds": 1.0}
    res |= {"parameters": 10, "labels": {"sign-sg": "sign vote"}}
    text = bench_e2e_report.markdown(res, bench_e2e_report.rows(res))
    assert "| sign vote | measured | 1/1 | 6 | 1.5 (0.0) | 5.33 | 2.67 |" in text
    assert "| sign vote | extrapolated |" in text
    bench_e2e_report.figure(res, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0
    # A saved run rebuilt from its runs: the same report, its table recomputed.
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(res | {"table": []}))
    assert bench_e2e_report.rerender(saved) == text
    assert json.loads(saved.read_text())["table"] == bench_e2e_report.rows(res)
    assert saved.with_suffix(".md").read_text() == text and saved.with_suffix(".png").exists()
    # A stopped run's file (written before its end: no parameter count yet) takes the runs'.
    stopped = {k: v for k, v in res.items() if k != "parameters"}
    for run in stopped["rates"]["1gbit"] + stopped["rates"]["100mbit"]:
        run["parameters"] = 10
    saved.write_text(json.dumps(stopped))
    assert bench_e2e_report.rerender(saved) == text


def test_command_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_e2e.parse_args(["--methods", "nope"])
    assert exit_info.value.code == 2 and "unknown methods" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--workers", "1"])
    assert "--workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--seeds", "3"])
    assert "--seeds" in capsys.readouterr().err
    assert bench_e2e.parse_args(["--seeds", "1"]).seeds == (0,)
    assert bench_e2e.parse_args([]).seeds == (0, 1)
    assert bench_e2e.parse_args(["--quick"]).seeds == (0,)
    assert bench_e2e.parse_args(["--quick"]).rates == ("1gbit",)
    assert bench_e2e.parse_args([]).rates == ("1gbit", "100mbit")
    assert bench_e2e.parse_args(["--rates", "100mbit"]).rates == ("100mbit",)
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--rates", "5gbit"])
    assert "--rates" in capsys.readouterr().err
    assert bench_e2e.main(["--sweep-file", str(tmp_path / "none.json")]) == 2
    assert "--sweep` first" in capsys.readouterr().err


def _fake_network(monkeypatch, launched, stop_at=None):
    """No namespace or tc (their commands recorded in ``launched``); each job's workers "run"
    its configs: 1 s steps, the target reached at step 4 (or 6 for the sign vote)."""
    monkeypatch.setattr(netns, "unavailable_reason", lambda ns: None)
    monkeypatch.setattr(netns, "namespace", contextlib.nullcontext)
    monkeypatch.setattr(
        netns, "run", lambda argv: launched.append(("tc", argv[argv.index("rate") + 1]))
    )

    def launch(ns, n, config, tmp, port, timeout, module):
        launched.append([(c["method"], c["seed"]) for c in config])
        if len(launched) == stop_at:
            raise KeyboardInterrupt
        steps = {"sign-sg": 6}.get(config[0]["method"], 4)
        steps = steps if config[0]["target"] is not None else config[0]["max_steps"]
        reached = steps if config[0]["target"] is not None else None
        return [
            c
            | _timed(c["method"], c["seed"], [1.0] * steps, reached)
            | {"wall_s": 1.0, "parameters": 10}
            for c in config
        ]

    monkeypatch.setattr(bench_e2e.jobs, "launch", launch)


def test_resume_runs_only_the_timed_runs_no_file_holds(tmp_path, monkeypatch, capsys):
    """``--resume``: a timed run whose rate, processes and settings match a saved one is not
    run again; every job's runs are written as it ends, so a stopped run loses at most the job
    it was running, and saved runs this report does not use are carried in its file."""
    sweep = {"target": 3.6, "budget_steps": 4, "max_steps": 12, "eval_every": 2, "seed": 0}
    sweep["methods"] = {k: {"lr": 1e-3, "steps_to_target": 4} for k in ("fp32", "bf16")}
    sweep["methods"]["sign-sg"] = {"lr": 1e-4, "steps_to_target": 6}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    base = {
        "eval_every": 2,
        "model": {},
        "lr": 1e-3,
        "target": 3.6,
        "max_steps": 12,
        "parameters": 10,
    }
    earlier = {
        "rates": {"1gbit": [base | _timed("fp32", 0, [2.0] * 4, 4) | {"wall_s": 9.0}]},
        "other_runs": [
            base | _timed("bf16", 0, [1.0] * 4, 4) | {"rate": "1gbit", "wall_s": 5.0},
            # Another learning rate than the sweep's: not this run's, so run again.
            base | _timed("bf16", 1, [1.0] * 4, 4) | {"rate": "1gbit", "lr": 5e-4},
        ],
    }
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    out = tmp_path / "out"
    argv = ["--methods", "sign-sg", "--sweep-file", str(tmp_path / "sweep.json")]
    argv += ["--out", str(out)]
    launched = []
    _fake_network(monkeypatch, launched, stop_at=4)
    with pytest.raises(KeyboardInterrupt):  # stopped while sign-sg runs at 1 Gbit/s
        bench_e2e.main([*argv, "--resume", str(tmp_path / "earlier.json")])
    assert launched == [
        ("tc", "1gbit"),
        [("fp32", 1)],
        [("bf16", 1)],  # seed 0 is in the earlier file; its seed 1 there has another lr
        [("sign-sg", 0), ("sign-sg", 1)],
    ]
    written = json.loads((out / "bench_e2e.json").read_text())
    assert [(r["method"], r["seed"]) for r in written["rates"]["1gbit"]] == [
        ("fp32", 0),
        ("fp32", 1),
        ("bf16", 0),
        ("bf16", 1),
    ]
    assert [r.get("timed_in") for r in written["rates"]["1gbit"]] == [
        "earlier.json",
        None,
        "earlier.json",
        None,
    ]
    assert [r["lr"] for r in written["other_runs"]] == [5e-4]  # carried, not lost

    launched.clear()
    _fake_network(monkeypatch, launched)
    assert bench_e2e.main([*argv, "--resume"]) == 0  # the output directory's own file
    assert launched == [
        ("tc", "1gbit"),
        [("sign-sg", 0), ("sign-sg", 1)],
        ("tc", "100mbit"),
        *([(key, 0), (key, 1)] for key in ("fp32", "bf16", "sign-sg")),
    ]
    res = json.loads((out / "bench_e2e.json").read_text())
    assert len(res["rates"]["1gbit"]) == 6 and len(res["rates"]["100mbit"]) == 6
    assert res["rates"]["100mbit"][0]["kind"] == "extrapolated"
    text = (out / "bench_e2e.md").read_text()
    assert "4 of its 12 runs were timed in earlier runs (bench_e2e.json, earlier.json" in text

    launched.clear()
    assert bench_e2e.main([*argv, "--resume"]) == 0
    assert launched == []  # everything saved: nothing runs, not even tc
    assert bench_e2e.main([*argv, "--resume", str(tmp_path / "none.json")]) == 2
    assert launched == [] and "none.json" in capsys.readouterr().err


TINY = ["--workers", "2", "--model", "width=32,layers=1,heads=2", "--sync-every", "2"]
TINY += ["--methods", "bf16,sign-sg,diloco,sparseloco"]


@pytest.mark.slow
def test_a_tiny_sweep_and_timed_run_reach_the_target_at_the_same_steps(tmp_path):
    """The trajectory of a run across processes is the simulated one: same steps to target."""
    sweep = tmp_path / "sweep.json"
    args = [*TINY, "--budget-steps", "4", "--eval-every", "2", "--sweep-file", str(sweep)]
    assert bench_e2e.main(["--sweep", *args]) == 0
    found = json.loads(sweep.read_text())
    assert (
        set(found["methods"]) == {"bf16", "sign-sg", "diloco", "sparseloco"}
        and found["max_steps"] == 12
    )
    if netns.unavailable_reason(f"compjax-e2e-test-{os.getpid()}") is not None:
        pytest.skip("needs root for a network namespace")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.e2e.run", "--quick", *args, "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=bench_e2e.ROOT)
    res = json.loads((out / "bench_e2e.json").read_text())
    for run in res["rates"]["1gbit"]:
        assert run["reached_step"] == found["methods"][run["method"]]["steps_to_target"]
    assert (out / "bench_e2e.md").exists() and (out / "bench_e2e.png").exists()
