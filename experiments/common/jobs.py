"""A job of ``n`` worker processes on one machine, as ``make bench-net`` and ``make
bench-e2e`` run them: started inside a network namespace, one CPU device and one thread
each (:func:`launch`), joined into a ``jax.distributed`` job over the loopback with gloo
collectives (:func:`run_joined`), and kept in step by barriers (:func:`barrier`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import numpy as np

from experiments.common import netns

#: The repository root: the workers' working directory and first import path.
ROOT = Path(__file__).resolve().parents[2]

#: Seconds a process waits for the others to join.
INIT_TIMEOUT_S = 120
#: A process silent this long is declared dead and the others fail, rather than block
#: for JAX's default of 100 s on a peer that died.  Heartbeats are tiny: a throttled link
#: or a loaded CPU delays them by well under a second.
HEARTBEAT_TIMEOUT_S = 20
#: One thread per process for XLA, OpenMP and OpenBLAS (up to 4 processes on 2 cores).
THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


# -- the launcher's side ----------------------------------------------------------------------
def worker_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of a worker: one CPU device, one thread, this checkout importable."""
    env = {k: v for k, v in base.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=1 {THREAD_FLAGS}"
    env |= {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    return env


def worker_command(
    ns: str, rank: int, n: int, port: int, config: Path, out: Path, module: str
) -> list[str]:
    """The command line of worker ``rank`` of ``n`` (``python -m module``), run inside ``ns``."""
    argv = [sys.executable, "-m", module, "--process-id", str(rank)]
    argv += ["--num-processes", str(n), "--port", str(port)]
    argv += ["--config", str(config), "--out", str(out)]
    return netns.in_namespace(ns, argv)


def launch(
    ns: str, n: int, config, tmp: Path, port: int, timeout: float, module: str
) -> dict | list:
    """Run one job of ``n`` processes of ``module`` in ``ns``; its result, or ``{"error": ...}``.

    ``config`` (JSON) is the workers' ``--config``; the result is what
    process 0 wrote to ``--out``.  Process 0 prints its progress here; every
    process also logs to ``tmp``.  On a failure, a timeout or Ctrl-C every
    process is killed.
    """
    cfg_path, out = tmp / f"config{n}.json", tmp / f"result{n}.json"
    cfg_path.write_text(json.dumps(config))
    out.unlink(missing_ok=True)  # never a previous job's result
    env = worker_env(dict(os.environ))
    procs, logs = [], []
    try:
        for rank in range(n):
            log = (tmp / f"worker{n}-{rank}.log").open("wb")
            logs.append(log)
            stdout = None if rank == 0 else log
            argv = worker_command(ns, rank, n, port, cfg_path, out, module)
            procs.append(subprocess.Popen(argv, stdout=stdout, stderr=log, env=env, cwd=ROOT))
        failure = wait_all(procs, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        for log in logs:
            log.close()
    result = json.loads(out.read_text()) if out.exists() else {}
    if failure is not None:
        result = result if isinstance(result, dict) else {"partial": result}
        tails = [
            f"--- worker {r} ---\n"
            + (tmp / f"worker{n}-{r}.log").read_text(errors="replace")[-2000:]
            for r in range(n)
        ]
        result["error"] = failure + "\n" + "\n".join(tails)
    return result


def wait_all(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every process; ``None`` if all exit 0, else why not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            return f"a worker failed (exit codes {codes})"
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.2)
    return f"timed out after {timeout:.0f} s"


# -- a worker's side ----------------------------------------------------------------------------
def worker_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A worker's command line: ``--process-id``, ``--num-processes`` and ``--port`` (the
    launcher's), to which the worker adds its own."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    return parser


def barrier(name: str) -> None:
    """Wait until every process of the job has reached the barrier ``name``."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def gather_times(times: list[float]) -> list[list[float]]:
    """Every process's list of step times, by process index."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(times))).tolist()


def join(address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize`` on the loopback job, with a short heartbeat timeout."""
    jax.distributed.initialize(
        address,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=address,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    )


def run_joined(port: int, num_processes: int, process_id: int, body) -> None:
    """Join the loopback job (gloo, one CPU device) and call ``body()``; on an error print
    it and exit at once, so that the other processes fail too rather than hang."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 1)
    join(f"127.0.0.1:{port}", num_processes, process_id)
    try:
        body()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()
