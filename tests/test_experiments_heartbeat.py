"""A dead peer: the network benchmark's processes give up after a short heartbeat timeout; the
launcher (:mod:`experiments.common.launch`) names the dead process and stops the others; a
survivor's failed collective is one line."""

import inspect
import io
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from experiments.common import jobs, launch

ROOT = Path(__file__).resolve().parent.parent


class _Joined(Exception):
    pass


def test_bench_workers_join_with_a_short_heartbeat_timeout(monkeypatch):
    real = jax.distributed.initialize
    calls = []

    def initialize(*args, **kwargs):
        calls.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        raise _Joined  # record the call; join nothing

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    with pytest.raises(_Joined):
        jobs.join("127.0.0.1:1234", num_processes=2, process_id=1)
    [arguments] = calls
    assert arguments["heartbeat_timeout_seconds"] == jobs.HEARTBEAT_TIMEOUT_S
    assert jobs.HEARTBEAT_TIMEOUT_S < 100  # JAX's default


# --- the launcher and the survivor's one line (experiments.common.launch) ---------------------


def test_the_launcher_names_the_dead_process_and_stops_the_others(tmp_path):
    """Process 1 is killed; the launcher says so in one line and stops process 0 (which would
    run 60 s) at once, without waiting for any heartbeat."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    out = io.StringIO()
    began = time.monotonic()
    code = launch.supervise([sleeper, killed], tmp_path / "logs", out=out)
    assert time.monotonic() - began < 30
    assert code == 128 + 9
    [line] = out.getvalue().splitlines()
    assert line.startswith("process 1 of 2 died (killed by SIGKILL) after ")
    assert "stopped process 0" in line and launch.RESUME in line and str(tmp_path) in line
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["process0.log", "process1.log"]
    # A process that ended on the collective's error is a survivor; the other is named.
    peer_failed = [sys.executable, "-c", f"raise SystemExit({launch.PEER_FAILED})"]
    crashed = [sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(3)"]
    out = io.StringIO()
    assert launch.supervise([peer_failed, crashed], tmp_path / "b", out=out, poll_s=2.0) == 3
    assert out.getvalue().startswith("process 1 of 2 died (exit status 3)")
    assert launch.supervise([[sys.executable, "-c", "pass"]] * 2, tmp_path / "c") == 0
    # the command line fills in the process ids and one port
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.common.launch", "-n", "2",
         "--logs", str(tmp_path / "d"),
         "--", sys.executable, "-c", "import sys; sys.exit(int('{process_id}') * 5)"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 5 and "process 1 of 2 died (exit status 5)" in proc.stderr


def test_a_failed_collective_is_one_line_and_a_prompt_exit(tmp_path):
    """Inside ``exit_on_peer_failure`` a ``JaxRuntimeError`` ends the process with one line and
    ``PEER_FAILED``, skipping the atexit handlers (JAX's shutdown barrier among them)."""
    script = (
        "import atexit, jax\n"
        "from experiments.common.launch import exit_on_peer_failure\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "with exit_on_peer_failure(3):\n"
        "    raise jax.errors.JaxRuntimeError('UNKNOWN: Gloo AllGather failed: closed\\nmore')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == launch.PEER_FAILED, proc.stderr
    assert "atexit ran" not in proc.stdout and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("process 3: a collective failed, a peer process has probably died")
    assert "(UNKNOWN: Gloo AllGather failed: closed)" in line and launch.RESUME in line
