"""One process of the lock-step baseline: ``compjax.diloco`` under ``jax.distributed``.

``python -m experiments.elastic.baseline_worker --process-id I --num-processes N --port P
--out DIR --rounds R [--kill-round K]`` joins the loopback job (gloo, one CPU device per
process), trains :mod:`experiments.elastic.task`'s model with DiLoCo (``int_quant(8)``
pseudo-gradients, the task's optimizers and ``H``) on the islands' own batches (process
``i`` is worker ``i``: ``task.batch(i, t)``), and after every round

* saves its shards of the per-worker params and of the state to
  ``DIR/checkpoints/round_RRRRRR/process_I.npz`` (a round is complete when every process's
  file is there);
* process 0 appends ``{"round", "wall_s", "evaluation"}`` to ``DIR/history.jsonl``
  (``wall_s`` from ``--started``, the launcher's clock; the evaluation of the global params
  on the validation windows is in the round's time, as the elastic synchronizer's is).

A process started where a complete checkpoint exists resumes from the newest.  With
``--kill-round K`` process 1 ends itself (``os._exit``) as it starts round ``K``, once (not
after a resume): lock-step SPMD cannot go on without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

import compjax
from experiments.common.jobs import barrier, run_joined, worker_parser
from experiments.common.lm_step import AXIS, local_stepper
from experiments.elastic import task


def save(directory: Path, tree, rank: int) -> None:
    """This process's shards of every leaf of ``tree``, in leaf order."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = {
        f"{i}_{j}": np.asarray(s.data)
        for i, leaf in enumerate(jax.tree.leaves(tree))
        for j, s in enumerate(leaf.addressable_shards)
    }
    tmp = directory / f"process_{rank}.tmp.npz"
    np.savez(tmp, **shards)
    os.replace(tmp, directory / f"process_{rank}.npz")


def restore(directory: Path, like, rank: int):
    """``like``'s tree with this process's shards read from ``directory``."""
    saved = np.load(directory / f"process_{rank}.npz")
    leaves, treedef = jax.tree.flatten(like)
    out = []
    for i, leaf in enumerate(leaves):
        arrays = [
            jax.device_put(saved[f"{i}_{j}"], s.device)
            for j, s in enumerate(leaf.addressable_shards)
        ]
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays))
    return treedef.unflatten(out)


def newest_complete(root: Path, processes: int) -> Path | None:
    """The newest round directory holding every process's file."""
    rounds = sorted(root.glob("round_*")) if root.exists() else []
    names = [f"process_{i}.npz" for i in range(processes)]  # not a stopped save's .tmp.npz
    complete = [d for d in rounds if all((d / name).exists() for name in names)]
    return complete[-1] if complete else None


def train(args) -> None:
    n, rank = args.num_processes, args.process_id
    # The collectives' context (gloo: every process within 30 s) is set up now, while the
    # processes stand together after the join, not at the first step, which each reaches
    # after its own compile and restore (minutes apart on a loaded machine).
    barrier("joined")
    setup = dataclasses.replace(task.SETUP, sync_every=args.sync_every)
    mesh = jax.make_mesh((n,), (AXIS,))
    opt = compjax.diloco(
        setup.inner(), setup.outer(), setup.sync_every, AXIS, compressor=compjax.int_quant(8)
    )
    sharding = jax.NamedSharding(mesh, jax.P(AXIS))

    def batch(t):
        return jax.make_array_from_process_local_data(sharding, task.batch(rank, t)[0])

    step, params, state, _ = local_stepper(opt, task.MODEL, task.init_params(), mesh, batch(0))
    root = Path(args.out) / "checkpoints"
    found = newest_complete(root, n)
    first = 0
    if found is not None:
        params, state = restore(found, (params, state), rank)
        first = int(found.name.split("_")[1])
    history = Path(args.out) / "history.jsonl"
    for r in range(first, args.rounds):
        if r == args.kill_round and rank == 1 and found is None:
            (Path(args.out) / "killed.json").write_text(json.dumps({"wall_s": _wall(args)}))
            os._exit(1)  # the fault: worker 1 dies as it starts round r
        for k in range(setup.sync_every):
            params, state, _ = step(params, state, batch(r * setup.sync_every + k))
        jax.block_until_ready(state)
        save(root / f"round_{r + 1:06d}", (params, state), rank)
        if rank == 0:
            theta = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)),
                                 compjax.global_params(state))  # fmt: skip
            record = {"round": r, "wall_s": _wall(args), "evaluation": task.validation_loss(theta)}
            with history.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"round {r}: validation {record['evaluation']:.4f}", flush=True)


def _wall(args) -> float:
    return time.time() - args.started


def parse_args(argv=None) -> argparse.Namespace:
    parser = worker_parser("python -m experiments.elastic.baseline_worker", __doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=task.SETUP.rounds)
    parser.add_argument("--sync-every", type=int, default=task.SETUP.sync_every)
    parser.add_argument("--kill-round", type=int, default=-1)
    parser.add_argument("--started", type=float, default=time.time())
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_joined(args.port, args.num_processes, args.process_id, lambda: train(args))


if __name__ == "__main__":
    main()
