"""One training run of ``make bench-e2e``: a method trained until it reaches the target.

Run either as one process of a ``jax.distributed`` job inside bench-net's
namespace (one CPU device per process, started by
:mod:`experiments.e2e.run`), or simulated: one process holding every
worker as a CPU device (``--simulate N``), which is how the learning-rate
sweep runs.  Both build the step of :func:`experiments.common.lm_step.build`
(``jax.jit(jax.shard_map(...))`` over the mesh axis ``"data"``), with the
method's optimizer after the exchange, and feed it the same batches
(:func:`experiments.e2e.task.batch_rows`), so their trajectories agree
up to the order of float32 sums.

Every ``eval_every`` steps the validation loss is computed (split over the
workers, ``pmean``: every process sees the same value and stops at the same
step).  A run stops at the first evaluation at or below ``target``, at a
non-finite validation loss, or after ``max_steps``.  Step times are taken as
bench-net takes them (each process blocks on each step's outputs; a step's
time is the slowest process's); evaluations are timed apart and are not part
of the time to target::

    python -m experiments.e2e.worker --simulate 4 --config run.json --out result.json
    ip netns exec NS python -m experiments.e2e.worker --process-id 0 \\
        --num-processes 4 --port 29500 --config run.json --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from experiments.common import netns
from experiments.common.jobs import barrier, gather_times, run_joined
from experiments.common.lm import init_params, loss_fn
from experiments.common.lm_step import AXIS, build, local_stepper
from experiments.e2e import task

P = jax.P


def local_workers(mesh: jax.sharding.Mesh) -> list[int]:
    """The positions on the mesh's (1-D) axis of this process's devices."""
    me = jax.process_index()
    return [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]


def global_rows(mesh, local: np.ndarray) -> jax.Array:
    """Rows split over the mesh axis, from this process's part (its workers' rows in order)."""
    return jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P(AXIS)), local)


def evaluator(mesh, cfg):
    """``evaluate(params, rows) -> loss``: the mean loss of ``rows`` split over the workers."""

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    def evaluate(params, rows):
        return jax.lax.pmean(loss_fn(params, rows, cfg.heads), AXIS)

    return evaluate


def scalar(x: jax.Array) -> float:
    """A replicated scalar's value on this process."""
    return float(np.asarray(x.addressable_data(0)))


def train_to_target(run: dict, mesh, measure_bytes: bool = False) -> dict:
    """Train ``run["method"]`` until the target; the trajectory and its times.

    ``run`` holds ``method`` (a key of :data:`experiments.e2e.task.BY_KEY`),
    ``lr``, ``seed``, ``target`` (``None``: run ``max_steps``), ``max_steps``
    and ``eval_every``, and optionally ``model``: fields of
    :data:`experiments.e2e.task.MODEL` to change (a smaller model for tests).
    """
    method = task.BY_KEY[run["method"]]
    cfg = dataclasses.replace(task.MODEL, **run.get("model", {}))
    n = mesh.size
    train, validation = task.rows(cfg.length)
    mine = local_workers(mesh)

    def batch(step):
        parts = [task.batch_rows(train, run["seed"], step, w, cfg.batch_per_worker) for w in mine]
        return global_rows(mesh, np.concatenate(parts))

    val_all = task.validation_rows(validation, n)
    per = len(val_all) // n
    val = global_rows(mesh, np.concatenate([val_all[w * per : (w + 1) * per] for w in mine]))
    evaluate = evaluator(mesh, cfg)
    host_params = init_params(cfg, seed=run["seed"])
    if method.local:
        advance, params, state, info = _local_stepper(method, run, cfg, host_params, mesh, batch)
        current = lambda params, state: compjax.global_params(state)  # noqa: E731
        h = run.get("sync_every") or method.sync_every
        evaluated = lambda step: step % h == 0  # noqa: E731  (when the global params move)
    else:
        trainer, info = build(
            method.bench, cfg, host_params, mesh, [batch(0)], optimizer=method.optax(run["lr"])
        )
        advance, params, state = trainer.compiled, trainer.params, trainer.state
        current = lambda params, state: params  # noqa: E731
        evaluated = lambda step: step % run["eval_every"] == 0  # noqa: E731
    # One warm-up step on copies (the step may donate its inputs): the first real step does
    # not pay for allocations and connections, and the trajectory is untouched.
    copies = jax.tree.map(jnp.copy, (params, state))
    jax.block_until_ready(advance(*copies, batch(0)))
    first = scalar(evaluate(current(params, state), val))
    times, losses, evals, eval_s = [], [], [(0, first)], 0.0
    reached, diverged = None, False
    rank = jax.process_index()
    if measure_bytes:
        barrier("start")
    before = netns.read_tx_bytes() if measure_bytes and rank == 0 else 0
    wall = time.perf_counter()
    for step in range(1, run["max_steps"] + 1):
        b = batch(step)
        start = time.perf_counter()
        params, state, loss = advance(params, state, b)
        jax.block_until_ready((params, state, loss))
        times.append(time.perf_counter() - start)
        losses.append(scalar(loss))
        if evaluated(step) or step == run["max_steps"]:
            start = time.perf_counter()
            value = scalar(evaluate(current(params, state), val))
            eval_s += time.perf_counter() - start
            evals.append((step, value))
            if not math.isfinite(value):
                diverged = True
                break
            if run["target"] is not None and value <= run["target"]:
                reached = step
                break
    wall = time.perf_counter() - wall
    sent = netns.read_tx_bytes() - before if measure_bytes and rank == 0 else None
    all_times = gather_times(times) if jax.process_count() > 1 else [times]
    slowest = np.max(np.asarray(all_times), axis=0).tolist()
    return {
        **run,
        "workers": n,
        "parameters": int(sum(np.size(x) for x in jax.tree.leaves(host_params))),
        "step_times": slowest,
        "train_losses": losses,
        "evals": evals,
        "reached_step": reached,
        "diverged": diverged,
        "steps_run": len(times),
        "train_s": float(sum(slowest)),
        "eval_s": eval_s,
        "wall_s": wall,
        "tx_bytes": sent,
        "library_bits": info.get("library_bits"),
        "hlo_wire_bits": info.get("hlo_wire_bits"),
        "compile_s": info["compile_s"],
    }


def _local_stepper(method, run, cfg, host_params, mesh, batch):
    """DiLoCo's compiled step over per-worker copies: ``(step, copies, state, info)``."""
    opt = method.local_optimizer(run["lr"], AXIS, run.get("sync_every"))
    compiled, copies, state, seconds = local_stepper(opt, cfg, host_params, mesh, batch(0))
    return compiled, copies, state, {"compile_s": seconds}


def capped(run: dict) -> dict:
    """``run`` stopped at the fewest of its ``earlier`` steps to target (the sweep passes those
    of the rates of its method already run): a rate that has not reached the target by then
    cannot be the one the sweep keeps.  A run without ``earlier`` (a timed run) is unchanged.
    """
    return run | {"max_steps": min([run["max_steps"], *run.get("earlier", ())])}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.e2e.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--simulate", type=int, help="one process holding this many workers")
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--config", required=True, help="JSON: a list of runs")
    parser.add_argument("--out", required=True, help="JSON results (written by process 0)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Run every run of the config in turn; process 0 writes the results after each."""
    args = parse_args(argv)
    runs = json.loads(Path(args.config).read_text())
    if args.simulate:
        jax.config.update("jax_num_cpu_devices", args.simulate)
        mesh = jax.make_mesh((args.simulate,), (AXIS,))
        results = []
        for run in runs:
            results.append(train_to_target(capped(run), mesh))
            Path(args.out).write_text(json.dumps(results))
            print(_line(results[-1]), flush=True)
        return

    def body():
        mesh = jax.make_mesh((args.num_processes,), (AXIS,))
        results = []
        for run in runs:
            results.append(train_to_target(run, mesh, measure_bytes=True))
            if args.process_id == 0:
                Path(args.out).write_text(json.dumps(results))
                print(_line(results[-1]), flush=True)

    run_joined(args.port, args.num_processes, args.process_id, body)


def _line(r: dict) -> str:
    end = f"target at step {r['reached_step']}" if r["reached_step"] else "target not reached"
    end = "diverged" if r["diverged"] else end
    return (
        f"{r['method']:>12s} lr {r['lr']:.3g} seed {r['seed']}: {r['steps_run']} steps, "
        f"{r['train_s']:.1f} s training, validation {r['evals'][-1][1]:.4f}, {end}"
    )


if __name__ == "__main__":
    main()
