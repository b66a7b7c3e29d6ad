"""make bench-elastic's pieces that need no Ray: the workload, the scenarios it runs, the
lock-step record's conversion, and the report's arithmetic and goals on hand-made records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import compjax.elastic as ce
from experiments.elastic import baseline, report, run, scenario, task


def test_the_workload_is_deterministic_and_the_same_for_every_island_step():
    a, b = task.batch(2, 7), task.batch(2, 7)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[0].shape == (task.ROWS_PER_STEP, task.MODEL.length + 1)
    assert not np.array_equal(task.batch(1, 7)[0], a[0])
    train, validation = task.rows()
    assert validation.shape == (task.VALIDATION_ROWS, task.MODEL.length + 1)
    assert not set(map(bytes, validation[:32])) & set(map(bytes, train))  # no shared window


def test_the_scenarios_inject_what_they_say():
    setup = dataclasses.replace(task.SETUP, rounds=8)
    runs = scenario.scenarios(setup)
    assert set(runs) == set(scenario.NAMES)
    assert runs["clean"] == {}
    assert runs["kill_restart"]["faults"] == (ce.Kill(1, at_round=2, restart_at_round=4),)
    assert runs["slow"]["faults"] == (ce.Slow(3, 3.0),)
    assert runs["poison"]["merge"] == "median_norm_clip"
    assert runs["kill_sync"]["faults"] == (ce.KillSynchronizer(4),)
    kw = scenario.common(setup)
    assert kw["min_quorum"] == setup.islands - 1 and kw["rounds"] == 8


def record(name, walls, tokens, evaluations, rounds=None, bits=10):
    islands = 4
    return {
        "name": name,
        "setup": {
            **dataclasses.asdict(task.SETUP),
            "rounds": rounds or len(walls),
            "islands": islands,
        },
        "history": [
            {"round": i, "wall_s": w, "tokens": t, "evaluation": e, "bits": bits}
            for i, (w, t, e) in enumerate(zip(walls, tokens, evaluations, strict=True))
        ],
        "final_validation": evaluations[-1],
        "loopback_bytes": 1e6,
    }


FULL = [10, 10, 10, 10]
CLEAN = record("clean", [5, 6, 7, 8, 9], [FULL] * 5, [4.0, 3.5, 3.0, 2.5, 2.0])


def test_goodput_and_time_to_target_by_their_definitions():
    # 4 rounds after round 0 in 4 s, 10 steps per island and round: 10 per island and second
    assert report.step_rate(CLEAN) == pytest.approx(10.0)
    assert report.target(CLEAN) == 3.0  # after round 3 R / 4 = 3 (of 5): index 2
    assert report.time_to(CLEAN, 3.0) == 2.0
    # one island missing for two rounds, the run 1 s longer
    hurt = record("kill_restart", [5, 6, 7, 8, 10], [FULL, FULL, FULL[:3], FULL[:3], FULL],
                  [4.0, 3.6, 3.2, 2.9, 2.1])  # fmt: skip
    assert report.goodput(hurt, 10.0) == pytest.approx(140 / (4 * 5 * 10.0))
    assert report.time_to(hurt, 3.0) == 3.0
    assert report.time_to(hurt, 1.0) is None


def test_the_goals_say_met_missed_or_not_run():
    slow = record("slow", [5, 6.1, 7.2, 8.3, 9.4], [[10, 10, 10, 4]] * 5, [4.0, 3.5, 3.0, 2.5, 2.0])
    poison = record("poison", [5, 6, 7, 8, 9], [FULL] * 5, [4.0, 3.5, 3.0, 2.5, 2.03])
    lost = record("kill_sync", [5, 6, 7, 8], [FULL] * 4, [4.0, 3.5, 3.0, 2.5], rounds=5)
    result = report.summary({"clean": CLEAN, "slow": slow, "poison": poison, "kill_sync": lost})
    goals = result["goals"]
    assert goals["slow goodput >= 90%"] is False  # 34 of 40 steps a round, 10% slower
    assert goals["slow time to target within 15% of clean"] is True  # 2.2 s against 2 s
    assert goals["poison (median_norm_clip) within 2% of clean"] is True  # +1.5%
    assert goals["kill_sync loses no merged round"] is False  # 4 of 5 rounds
    assert goals["kill_restart goodput >= 90%"] is None
    assert result["rows"]["clean"]["goodput"] == pytest.approx(1.0)


def test_the_lockstep_record_takes_the_scenarios_form():
    raw = {"history": [{"round": 0, "wall_s": 3.0, "evaluation": 4.0},
                       {"round": 1, "wall_s": 5.0, "evaluation": 3.0}],
           "lost_s": 12.0, "loopback_bytes": 7}  # fmt: skip
    setup = dataclasses.replace(task.SETUP, rounds=2)
    converted = run.lockstep_record(raw, setup)
    assert converted["history"][1]["tokens"] == [setup.sync_every] * setup.islands
    assert converted["final_validation"] == 3.0 and converted["lockstep"]["lost_s"] == 12.0


def test_the_report_is_written(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "clean.json").write_text(json.dumps(CLEAN))
    result = report.write(raw, tmp_path, "100mbit")
    text = (tmp_path / "bench_elastic.md").read_text()
    assert "| clean | 100.0% |" in text and "## Goals" in text and "not run" in text
    assert (tmp_path / "bench_elastic.png").stat().st_size > 1000
    assert json.loads((tmp_path / "bench_elastic.json").read_text())["target"] == result["target"]


def test_the_lockstep_history_keeps_each_round_once(tmp_path):
    path = tmp_path / "history.jsonl"
    lines = [{"round": 0, "wall_s": 1.0, "evaluation": 4.0},
             {"round": 1, "wall_s": 2.0, "evaluation": 3.9},
             {"round": 1, "wall_s": 9.0, "evaluation": 3.8}]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert [r["wall_s"] for r in baseline.read_history(path)] == [1.0, 9.0]
    assert baseline.read_history(tmp_path / "none.jsonl") == []


def test_lost_time_is_beyond_the_median_round():
    walls = [10.0, 12.0, 14.0, 45.0, 47.0, 49.0]  # a 29 s restart after round 2
    history = [{"wall_s": w} for w in walls]
    lost, typical = baseline.lost_time(history, rounds=6)
    assert typical == 2.0 and lost == pytest.approx(39.0 - 5 * 2.0)


def test_every_worker_gets_its_own_command_inside_the_namespace():
    argv = baseline.commands("ns", 4, 1234, Path("/o"), task.SETUP, 7, 0.0)
    assert len(argv) == 4 and all(a[:4] == ["ip", "netns", "exec", "ns"] for a in argv)
    assert [a[a.index("--process-id") + 1] for a in argv] == ["0", "1", "2", "3"]
    assert argv[0][argv[0].index("--kill-round") + 1] == "7"


@pytest.mark.slow
def test_the_lockstep_job_restarts_from_its_checkpoint_and_loses_time(tmp_path):
    from experiments.common import netns

    ns = "compjax-lockstep-test"
    reason = netns.unavailable_reason(ns)
    if reason is not None:
        pytest.skip(f"needs a network namespace: {reason}")
    setup = dataclasses.replace(task.SETUP, rounds=4, sync_every=3)
    with netns.namespace(ns):
        killed = baseline.run_lockstep(ns, tmp_path / "k", kill_round=2, setup=setup)
        clean = baseline.run_lockstep(ns, tmp_path / "c", kill_round=None, setup=setup)
    assert [r["round"] for r in killed["history"]] == [0, 1, 2, 3]
    assert len(killed["attempts"]) == 2 and killed["attempts"][0]["code"] != 0
    assert killed["lost_s"] > 5 * killed["round_s"] and killed["detected_s"] < 10
    # the restart resumed exactly where the checkpoint was: the same trajectory
    assert [r["evaluation"] for r in killed["history"]] == [
        r["evaluation"] for r in clean["history"]
    ]
