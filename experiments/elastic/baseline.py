"""The lock-step baseline of ``make bench-elastic``: ``compjax.diloco`` under ``jax.distributed``
with the elastic runs' kill, restarted from its last checkpoint.

:func:`run_lockstep` starts one :mod:`experiments.elastic.baseline_worker` process per worker
inside the namespace (:func:`experiments.common.launch.supervise`: the first process to fail
ends the job, the survivors, which would wait in the gloo collective, are stopped at once),
and starts the whole job again from the newest complete checkpoint (saved every round) until
every round is done.  It returns the rounds' records and the time the failure cost:

* ``detected_s``: from the kill to the launcher's noticing it (the job's end);
* ``restart_s``: from the relaunch to the first round merged after it (the processes' start,
  ``jax.distributed``'s join, the compile, the restore, and that round);
* ``lost_s``: the run's time after round 0 minus ``(rounds - 1)`` times the median round
  time of the rounds not interrupted: what the kill cost in all.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import jobs, launch, netns
from experiments.elastic import task

ATTEMPTS = 3


def commands(ns: str | None, n: int, port: int, out: Path, setup: task.Setup, kill: int | None,
             started: float) -> list[list[str]]:  # fmt: skip
    """Each worker's command line, inside ``ns``."""
    argv = [sys.executable, "-m", "experiments.elastic.baseline_worker", "--num-processes",
            str(n), "--port", str(port), "--out", str(out), "--rounds", str(setup.rounds),
            "--sync-every", str(setup.sync_every), "--kill-round",
            str(-1 if kill is None else kill), "--started", repr(started)]  # fmt: skip
    return [netns.in_namespace(ns, [*argv, "--process-id", str(i)]) for i in range(n)]


def tx_bytes(ns: str | None) -> int:
    """Bytes sent on ``ns``'s loopback so far (read inside it)."""
    if ns is None:
        return netns.read_tx_bytes()
    argv = netns.in_namespace(ns, ["cat", netns.TX_BYTES])
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def read_history(path: Path) -> list[dict]:
    """The rounds' records, the last of each round kept (a round run twice counts once)."""
    records = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        records[record["round"]] = record
    return [records[r] for r in sorted(records)]


def lost_time(history: list[dict], rounds: int) -> tuple[float, float]:
    """``(lost_s, median round s)``: the time after round 0 beyond ``rounds - 1`` median rounds."""
    walls = [r["wall_s"] for r in history]
    gaps = sorted(b - a for a, b in itertools.pairwise(walls))
    typical = statistics.median(gaps[: max(1, len(gaps) - 1)])  # the longest gap is the restart's
    return walls[-1] - walls[0] - (rounds - 1) * typical, typical


def run_lockstep(ns: str | None, out: Path, kill_round: int | None,
                 setup: task.Setup = task.SETUP, timeout_s: float = 3600.0) -> dict:  # fmt: skip
    """Run the lock-step job to its last round, restarting it after a failure.

    Returns:
      ``{"history", "attempts", "killed_s", "detected_s", "restart_s", "lost_s",
      "round_s", "loopback_bytes"}`` (also written to ``out/lockstep.json``).

    Raises:
      RuntimeError: the job failed :data:`ATTEMPTS` times.
    """
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.time()
    before = tx_bytes(ns)
    env = jobs.worker_env(dict(os.environ))
    attempts = []
    for attempt in range(ATTEMPTS):
        began = time.time() - started
        argv = commands(ns, setup.islands, launch.free_port(), out, setup, kill_round, started)
        with open(out / f"launcher{attempt}.log", "w") as log:
            code = launch.supervise(argv, out / f"logs{attempt}", timeout=timeout_s, out=log,
                                    env=env)  # fmt: skip
        attempts.append({"began_s": began, "ended_s": time.time() - started, "code": code})
        if code == 0:
            break
    else:
        raise RuntimeError(f"the lock-step job failed {ATTEMPTS} times: {attempts}")
    history = read_history(out / "history.jsonl")
    lost, typical = lost_time(history, setup.rounds)
    killed = json.loads((out / "killed.json").read_text())["wall_s"] if kill_round else None
    relaunched = attempts[1]["began_s"] if len(attempts) > 1 else None
    after = [r["wall_s"] for r in history if relaunched and r["wall_s"] > relaunched]
    result = {
        "setup": dataclasses.asdict(setup),
        "kill_round": kill_round,
        "history": history,
        "attempts": attempts,
        "killed_s": killed,
        "detected_s": None if killed is None else attempts[0]["ended_s"] - killed,
        "restart_s": after[0] - relaunched if after else None,
        "lost_s": lost,
        "round_s": typical,
        "loopback_bytes": tx_bytes(ns) - before,
    }
    (out / "lockstep.json").write_text(json.dumps(result, indent=1))
    return result
