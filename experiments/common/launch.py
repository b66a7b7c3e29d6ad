"""Starting the processes of a ``jax.distributed`` job on one machine, and what a dead peer does.

When one process of a job dies (killed, out of memory, a crashed host), the
survivors cannot go on: the next collective fails in every one of them.
Two things happen in a survivor, and only the first can be caught:

* the collective raises ``jax.errors.JaxRuntimeError`` (gloo: ``Connection
  closed by peer``) as soon as it reaches the dead peer's socket;
  :func:`exit_on_peer_failure` catches it, says so in one line and ends the
  process at once (``os._exit``), skipping the shutdown barrier that
  ``jax.distributed`` registers at exit, which would otherwise wait for the
  peer's heartbeat timeout and then abort the process (SIGABRT, a C++ stack
  trace);
* a survivor that is not in a collective (or whose collective does not
  fail) is aborted by JAX's coordination service once the peer has missed
  its heartbeats for ``heartbeat_timeout_seconds`` (100 s by default): a
  ``LOG(FATAL)`` in C++ that Python never sees.

:func:`supervise`, the launcher, covers both: it starts the processes,
notices the first one to fail, stops the others at once (instead of letting
them wait for the heartbeat timeout) and says in one line which process
died, how, and how to resume.  Every process's output goes to a log file,
so the C++ traces stay there::

    python -m experiments.common.launch -n 2 --logs /tmp/job -- \\
        python worker.py --process-id {process_id} --num-processes {num_processes} --port {port}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

#: The exit status of a process that :func:`exit_on_peer_failure` ended (``EX_TEMPFAIL``:
#: run the job again).
PEER_FAILED = 75
#: Seconds :func:`supervise` gives a stopped process to end after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: The resume advice in every message.
RESUME = "run the same command again to resume from the last checkpoint"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def how_it_ended(code: int) -> str:
    """A process's exit status in words: ``killed by SIGKILL``, ``exit status 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == PEER_FAILED:
        return f"exit status {code}: a collective failed"
    return f"exit status {code}"


@contextlib.contextmanager
def exit_on_peer_failure(process_id: int, out=sys.stderr) -> Iterator[None]:
    """Around a worker's training loop: a collective that fails (a peer died) ends this
    process with one line and :data:`PEER_FAILED`, before JAX's shutdown barrier can wait
    for the heartbeat timeout and abort it.

    Only a ``jax.errors.JaxRuntimeError`` is caught; the line quotes the runtime's first
    line (gloo names the peer's address, not its process id: the launcher's message,
    :func:`supervise`, names the process).
    """
    import jax  # the launcher itself never imports jax

    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"process {process_id}: a collective failed, a peer process has probably died "
            f"({first}); {RESUME} on every process",
            file=out,
            flush=True,
        )
        os._exit(PEER_FAILED)  # no atexit: jax.distributed's shutdown barrier would abort


def supervise(
    commands: Sequence[Sequence[str]],
    logs: Path,
    *,
    timeout: float | None = None,
    poll_s: float = 0.1,
    out=sys.stderr,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run one process per command until all end; 0 if every one exits 0.

    The first process to fail (a non-zero exit or a signal) ends the job: the
    others get SIGTERM (SIGKILL after :data:`GRACE_S`), and one line on
    ``out`` says which process died, how, when, and how to resume.  Process
    ``i``'s output is in ``logs/process{i}.log``; ``env`` is the processes' environment
    (this process's if ``None``).

    Returns:
      0, or the failed process's exit status (``128 + signal`` for a signal), or 124 on
      ``timeout``.
    """
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    began = time.monotonic()
    try:
        for i, command in enumerate(commands):
            with (logs / f"process{i}.log").open("wb") as log:
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
                procs.append(proc)
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A peer that ended on the collective's error is a survivor, not the cause.
                dead = [i for i in failed if codes[i] != PEER_FAILED] or failed
                first = dead[0]
                code = codes[first]
                running = [i for i, c in enumerate(codes) if c is None]
                _stop(procs, running)
                others = f"; stopped process {', '.join(map(str, running))}" if running else ""
                print(
                    f"process {first} of {len(procs)} died ({how_it_ended(code)}) after "
                    f"{time.monotonic() - began:.1f} s{others}; {RESUME} "
                    f"(logs: {logs})",
                    file=out,
                    flush=True,
                )
                return 128 - code if code < 0 else code
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - began > timeout:
                _stop(procs, [i for i, c in enumerate(codes) if c is None])
                print(f"timed out after {timeout:g} s; stopped every process (logs: {logs})",
                      file=out, flush=True)  # fmt: skip
                return 124
            time.sleep(poll_s)
    finally:
        _stop(procs, [i for i, p in enumerate(procs) if p.poll() is None])


def _stop(procs: list[subprocess.Popen], which: Sequence[int]) -> None:
    for i in which:
        procs[i].terminate()
    deadline = time.monotonic() + GRACE_S
    for i in which:
        try:
            procs[i].wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[i].kill()
            procs[i].wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.common.launch",
        description=__doc__.splitlines()[0],
        epilog="In the command, {process_id}, {num_processes} and {port} (a free port on "
        "127.0.0.1 for the coordinator) are replaced per process.",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--logs", type=Path, required=True, help="a directory for the logs")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (none)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command is required after --")
    if args.num_processes < 1:
        parser.error(f"argument -n/--num-processes: must be >= 1, got {args.num_processes}")
    port = free_port()
    commands = [
        [part.format(process_id=i, num_processes=args.num_processes, port=port) for part in command]
        for i in range(args.num_processes)
    ]
    return supervise(commands, args.logs, timeout=args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
