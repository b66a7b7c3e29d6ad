"""A run killed by SIGKILL in the middle of its writes resumes to the records of an unkilled one.

Each test starts ``python -m experiments.harness.train`` with ``$EXPERIMENTS_CRASH_AT``
naming a point of its writes (:func:`experiments.harness.runlog.crash_point`), lets it
die there, resumes the same config in this process and compares the records
and both metrics files, byte for byte, with an uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.harness import runlog, train

ROOT = Path(__file__).resolve().parent.parent
FIELDS = {"task": "logreg", "workers": 2, "steps": 6, "eval_every": 2, "checkpoint_every": 2}
CFG = train.Config(**FIELDS)


def _cli_args(out: Path) -> list[str]:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in FIELDS.items()]
    return [*args, f"--out={out}", "--no-progress"]


def _run_killed_at(point: str, out: Path) -> None:
    """Run the config in a subprocess that SIGKILLs itself at ``point``."""
    env = {**os.environ, runlog.CRASH_AT: point}
    command = [sys.executable, "-m", "experiments.harness.train", *_cli_args(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> train.Run:
    return train.run(CFG, tmp_path_factory.mktemp("whole"), progress=False)


@pytest.mark.parametrize(
    "point",
    [
        "metrics-mid-write@4",  # half of metrics.jsonl written: a torn last line
        # the logs of step 4 written, its checkpoint not (passed before the fix too: slow)
        pytest.param("metrics-saved@4", marks=pytest.mark.slow),
        # the checkpoint of step 4 renamed into place
        pytest.param("checkpoint-saved@4", marks=pytest.mark.slow),
    ],
)
def test_a_killed_run_resumes_to_the_uninterrupted_records(point, uninterrupted, tmp_path):
    _run_killed_at(point, tmp_path)
    resumed = train.run(CFG, tmp_path, progress=False)
    assert [r["step"] for r in resumed.records] == list(range(CFG.steps + 1))
    assert resumed.records == uninterrupted.records
    for name in ("metrics.jsonl", "metrics.csv"):
        assert (resumed.path / name).read_text() == (uninterrupted.path / name).read_text()


def test_logs_that_stop_short_of_the_checkpoint_are_an_error_not_a_gap(tmp_path):
    part = train.run(CFG, tmp_path, progress=False, until=4)
    metrics = part.path / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:3]))
    with pytest.raises(RuntimeError, match=r"ends at step 2 but .* is at step 4"):
        train.run(CFG, tmp_path, progress=False)
