"""One process of a two-process ``jax.distributed`` job in which process 1 dies.

Both processes run one compressed exchange; then process 1 kills itself
(SIGKILL, as a crashed host would vanish) and process 0 enters the next
exchange, whose gloo collective fails at once (``JaxRuntimeError``, the
peer's socket closed).  Process 0 runs its steps inside
:func:`experiments.common.launch.exit_on_peer_failure`, which says so in one line
and ends it; with ``--no-catch`` the error ends the interpreter, whose
``jax.distributed`` shutdown barrier then waits for the heartbeat timeout
and aborts (SIGABRT, a C++ stack trace).  Process 0 prints the time of its
last completed step; ``tests/test_multiprocess.py`` measures how long after
the peer's death it ends::

    python tests/dead_peer_worker.py --process-id 0 --port 12345 --heartbeat 10
"""

import os

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import compjax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the experiments package
from experiments.common.launch import exit_on_peer_failure

P = jax.P


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--heartbeat", type=int, required=True, help="heartbeat_timeout_seconds")
    parser.add_argument("--no-catch", action="store_true", help="leave the collective's error")
    args = parser.parse_args()
    guard = contextlib.nullcontext() if args.no_catch else exit_on_peer_failure(args.process_id)
    address = f"127.0.0.1:{args.port}"
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address,
        num_processes=2,
        process_id=args.process_id,
        coordinator_bind_address=address,
        initialization_timeout=60,
        heartbeat_timeout_seconds=args.heartbeat,
    )
    mesh = jax.make_mesh((2,), ("data",))
    tx = compjax.compress(compjax.qsgd(levels=4), "data")
    params = jnp.zeros(64)
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(
        jax.shard_map(tx.update, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    )
    grads = jax.make_array_from_callback(
        (128,), jax.NamedSharding(mesh, P("data")), lambda index: jnp.ones(128)[index]
    )
    updates, state = step(grads, state)
    updates.block_until_ready()
    print(f"step done at {time.time():.3f}", flush=True)
    if args.process_id == 1:
        time.sleep(1.0)
        print(f"dying at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)  # the peer is gone by now
    with guard:
        updates, state = step(grads, state)
        updates.block_until_ready()
    print("second step completed (unexpected)", flush=True)


if __name__ == "__main__":
    main()
