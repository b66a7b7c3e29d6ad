"""The elastic scenarios of ``make bench-elastic``, run on one Ray instance.

``python -m experiments.elastic.scenario OUT NAME... [--rounds R]``, started inside the
benchmark's network namespace (:mod:`experiments.elastic.run`), runs each named scenario of
:func:`scenarios` with :func:`compjax.elastic.train` on :mod:`experiments.elastic.task`'s
workload (DiLoCo, ``int_quant(8)`` pseudo-gradients, a quorum of ``islands - 1``) and writes
``OUT/NAME.json``: the rounds' records (with the validation loss the synchronizer measured
after each merge), what each island process reported, and the bytes the namespace's loopback
carried during the run.

Ray is started on 127.0.0.1 with objects of up to 256 MiB sent inside its RPCs rather than
through the node's shared-memory object store, so that every payload and every pull of the
parameters crosses the rate-limited loopback as it would cross a network between machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import compjax
import compjax.elastic as ce
from experiments.common import netns
from experiments.elastic import task

INLINE_BYTES = 256 * 2**20
NAMES = ("clean", "kill_restart", "slow", "poison", "kill_sync")


def scenarios(setup: task.Setup) -> dict[str, dict]:
    """Each scenario's extra arguments to :func:`compjax.elastic.train`."""
    kill = max(1, setup.rounds // 4)
    return {
        "clean": {},
        "kill_restart": {"faults": (ce.Kill(1, at_round=kill, restart_at_round=kill + 2),)},
        "slow": {"faults": (ce.Slow(3, 3.0),)},
        "poison": {"faults": (ce.Poison(2, 1e3),), "merge": "median_norm_clip"},
        "kill_sync": {"faults": (ce.KillSynchronizer(max(1, setup.rounds // 2)),)},
    }


def common(setup: task.Setup) -> dict:
    """The arguments every scenario shares."""
    return dict(
        inner=setup.inner(),
        outer=setup.outer(),
        sync_every=setup.sync_every,
        rounds=setup.rounds,
        islands=setup.islands,
        compressor=compjax.int_quant(8),
        min_quorum=setup.islands - 1,
        evaluate=task.validation_loss,
        timeout_s=300.0,
        progress=True,
    )


def run(name: str, setup: task.Setup, out: Path) -> dict:
    """One scenario, written to ``out/name.json``; its record."""
    kw = {**common(setup), **scenarios(setup)[name]}
    before = netns.read_tx_bytes()
    start = time.perf_counter()
    result = ce.train(task.loss_fn, task.init_params(), task.batch, **kw)
    record = {
        "name": name,
        "setup": dataclasses.asdict(setup),
        "faults": [repr(f) for f in kw.get("faults", ())],
        "merge": kw.get("merge", "mean"),
        "seconds": time.perf_counter() - start,
        "loopback_bytes": netns.read_tx_bytes() - before,
        "history": [r._asdict() for r in result.history],
        "islands": result.islands,
        "final_validation": task.validation_loss(result.params),
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.elastic.scenario", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="+", choices=NAMES)
    parser.add_argument("--rounds", type=int, default=task.SETUP.rounds)
    args = parser.parse_args(argv)
    import ray

    setup = dataclasses.replace(task.SETUP, rounds=args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=setup.islands + 1,
        log_to_driver=False,
        _system_config={
            "max_direct_call_object_size": INLINE_BYTES,
            "task_rpc_inlined_bytes_limit": INLINE_BYTES,
        },
    )
    try:
        for name in args.names:
            record = run(name, setup, args.out)
            print(f"{name}: {record['seconds']:.0f} s, validation {record['final_validation']:.4f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
