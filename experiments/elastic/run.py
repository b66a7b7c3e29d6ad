"""``make bench-elastic``: elastic DiLoCo on Ray under faults, against lock-step DiLoCo.

``python -m experiments.elastic.run [--quick] [--resume] [--rate 100mbit]`` makes a network
namespace with only its loopback up, limits the loopback to ``--rate`` (0.1 Gbit/s), and runs

1. the elastic scenarios (:mod:`experiments.elastic.scenario`: clean, a killed island
   restarted two rounds later, a 3x straggler, a poisoned island with the median-norm clip, a
   killed synchronizer), all on one Ray instance inside the namespace;
2. the lock-step baseline (:mod:`experiments.elastic.baseline`): ``compjax.diloco`` under
   ``jax.distributed`` with the same kill, which aborts and restarts from its last checkpoint,
   and without it;

then writes ``results/bench_elastic.{json,md,png}`` (:mod:`experiments.elastic.report`; a
full run also ``paper_figs/out/bench_elastic.*``, committed).
Every process shares JAX's persistent compilation cache, so a restarted island or process
loads its compiled steps rather than compiling them again.  The runs' records are kept in
``results/bench_elastic_runs/``; ``--resume`` reuses those there.  Without root (no
namespaces or ``tc``) it says why and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import compjax
from experiments.common import netns
from experiments.elastic import baseline, report, scenario, task

NS = "compjax-bench-elastic"
RESULTS = Path("results")
RAW = RESULTS / "bench_elastic_runs"
CACHE = RESULTS / "bench_elastic_jax_cache"
FIGURES = Path("paper_figs/out")


def round_bits(setup: task.Setup) -> int:
    """The wire bits of one lock-step round's payloads: every worker's ``int_quant(8)``
    pseudo-gradient, leaf by leaf (what the elastic synchronizer receives in a full round)."""
    comp = compjax.int_quant(8)
    params = task.init_params()
    return setup.islands * sum(comp.bits(np.shape(a)) for a in jax.tree.leaves(params))


def lockstep_record(raw: dict, setup: task.Setup, name: str = "lockstep") -> dict:
    """The lock-step run's record in the elastic scenarios' form (every worker merged every
    round it finished: ``islands x H`` tokens each)."""
    bits = round_bits(setup)
    history = [
        {"round": r["round"], "wall_s": r["wall_s"], "evaluation": r["evaluation"],
         "tokens": [setup.sync_every] * setup.islands, "bits": bits}
        for r in raw["history"]
    ]  # fmt: skip
    return {
        "name": name,
        "setup": dataclasses.asdict(setup),
        "history": history,
        "final_validation": history[-1]["evaluation"],
        "loopback_bytes": raw.get("loopback_bytes"),
        "lockstep": {k: v for k, v in raw.items() if k != "history"},
    }


def run_scenarios(names: list[str], setup: task.Setup) -> None:
    argv = [sys.executable, "-m", "experiments.elastic.scenario", str(RAW), *names]
    argv += ["--rounds", str(setup.rounds)]
    subprocess.run(netns.in_namespace(NS, argv), check=True, timeout=3 * 3600)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.elastic.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="8 rounds; clean and the kill")
    parser.add_argument("--resume", action="store_true", help="reuse the runs results/ holds")
    parser.add_argument("--rate", default="100mbit", help="the loopback's rate (tc units)")
    args = parser.parse_args(argv)
    reason = netns.unavailable_reason(NS)
    if reason is not None:
        print(f"make bench-elastic needs a rate-limited network namespace: {reason}")
        return
    setup = dataclasses.replace(task.SETUP, rounds=8) if args.quick else task.SETUP
    names = ["clean", "kill_restart"] if args.quick else list(scenario.NAMES)
    RAW.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=str(CACHE.resolve()),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])),
    )
    with netns.namespace(NS):
        netns.run(netns.rate_command(args.rate, NS))
        todo = [n for n in names if not (args.resume and (RAW / f"{n}.json").exists())]
        if todo:
            run_scenarios(todo, setup)
        for name, kill in (("lockstep", max(1, setup.rounds // 4)), ("lockstep_clean", None)):
            if (args.quick and kill is None) or (args.resume and (RAW / f"{name}.json").exists()):
                continue
            raw = baseline.run_lockstep(NS, RAW / f"{name}_raw", kill_round=kill, setup=setup)
            record = lockstep_record(raw, setup, name)
            (RAW / f"{name}.json").write_text(json.dumps(record, indent=1))
    result = report.write(RAW, RESULTS, args.rate)
    if not args.quick:  # the committed copy
        report.write(RAW, FIGURES, args.rate)
    print((RESULTS / "bench_elastic.md").read_text())
    missed = [g for g, ok in result["goals"].items() if ok is False]
    print("goals missed: " + ", ".join(missed) if missed else "every goal met")


if __name__ == "__main__":
    main()
