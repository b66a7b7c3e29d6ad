"""One process of :func:`compjax.auto`'s two-process check (``tests/test_multiprocess.py``).

Two ``jax.distributed`` processes on 127.0.0.1 (gloo CPU collectives, 2 CPU devices each) run
the same :func:`compjax.auto` trial over a 4-device global mesh, each with its own scripted
clock: on process 0 dense steps last 1 s and QSGD's 2 s, on process 1 dense's last 5 s.  Each
process writes its report and final params to ``--out``/process<i>.json::

    python tests/auto_worker.py --process-id 0 --num-processes 2 --port 12345 --out DIR
"""

import os

# 2 CPU devices in this process, requested before jax is imported (compiled cheaply).
os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)

import argparse
import json
import pathlib
import sys
import traceback

import jax
import optax
from multiprocess_worker import (
    AXIS,
    INIT_TIMEOUT_S,
    WORKERS,
    fsdp_batch,
    fsdp_loss,
    initial_params,
    to_global,
    to_host,
)

import compjax

P = jax.P
TRIAL = 2
#: Seconds each timed step lasts on each process's clock, per candidate.
DURATIONS = {0: {"dense": 1.0, "qsgd": 2.0}, 1: {"dense": 5.0, "qsgd": 2.0}}
CANDIDATES = {
    "dense": optax.chain(compjax.compress(compjax.identity(), AXIS), optax.sgd(0.1)),
    "qsgd": optax.chain(compjax.compress(compjax.qsgd(levels=4), AXIS), optax.sgd(0.1)),
}
STEPS = len(CANDIDATES) * (1 + TRIAL) + 2  # the trial, then two of the winner's steps


def scripted_clock(durations: list[float]):
    """A clock called twice per timed step that advances by ``durations`` in order."""
    calls, now = [0], [0.0]

    def clock() -> float:
        calls[0] += 1
        if calls[0] % 2 == 0:
            now[0] += durations.pop(0)
        return now[0]

    return clock


def run(process: int, mesh) -> dict:
    """The trial and two steps after it; this process's report and final params."""
    durations = [DURATIONS[process][name] for name in CANDIDATES for _ in range(TRIAL)]
    params = to_global(initial_params(), mesh, P())
    chooser = compjax.auto(
        fsdp_loss,
        CANDIDATES,
        params,
        mesh,
        AXIS,
        trial_steps=TRIAL,
        clock=scripted_clock(durations),
    )
    state = chooser.init(params)
    for step in range(STEPS):
        x, y = fsdp_batch(step)
        batch = to_global({"x": x, "y": y}, mesh, P(AXIS))
        params, state, _ = chooser.step(params, state, batch["x"], batch["y"])
    report = chooser.report(state)
    return {
        "chosen": report.chosen,
        "timings": list(report.timings),
        "clock_left": len(durations),
        "params": {k: v.tolist() for k, v in to_host(params).items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True, help="the folder to write process<i>.json to")
    args = parser.parse_args()
    address = f"127.0.0.1:{args.port}"
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        coordinator_bind_address=address,
        initialization_timeout=INIT_TIMEOUT_S,
    )
    try:
        result = run(args.process_id, jax.make_mesh((WORKERS,), (AXIS,)))
        path = pathlib.Path(args.out) / f"process{args.process_id}.json"
        path.write_text(json.dumps(result))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
