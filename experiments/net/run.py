"""``make bench-net``: compressed training across processes on a rate-limited network.

What is measured, all in one run:

* **step time**: real data-parallel training steps of a 10.5M-parameter
  transformer language model (:mod:`experiments.common.lm`), 2 and 4
  ``jax.distributed`` processes with one CPU device each, gloo collectives,
  the step under ``jax.jit(jax.shard_map(...))`` over the mesh axis
  ``"data"`` (:mod:`experiments.net.worker`).  The processes run in a
  network namespace made here (:mod:`experiments.common.netns`) and talk over its
  loopback only, limited by a token bucket to 0.1, 1 and 10 Gbit/s (``tc
  qdisc replace ... tbf``), and once without a limit.  Each setting is the
  median over the timed steps of the slowest process's step time, after
  warm-up steps;
* **local steps**: DiLoCo (``H = 50``, int8 pseudo-gradients) and SparseLoCo
  (``H = 15``), built with ``compjax.local_steps``, synchronise once a
  round: their step time is the mean over whole rounds (the timed window is
  ``rounds`` rounds, each ending with its synchronisation) and their bits
  per step are a synchronisation's over ``H``;
* **speedups** of each method over the two baselines timed in the same run
  at the same rate: dense float32 (``compress(identity())``, a psum) and the
  bfloat16 cast (a psum of bf16);
* **traffic**: the namespace's loopback ``tx_bytes`` around the timed steps
  (every byte any process sends crosses it once), per worker and step;
* **prediction**: :func:`compjax.costmodel.predicted_step` on a
  :class:`compjax.costmodel.SharedMedium` (the token bucket is one link
  all processes share) from the step measured without a limit (compute plus
  codec) and the collectives of the compiled step
  (:mod:`experiments.net.report`).

Writes ``results/bench_net.json`` (every raw time, the traffic, the compiled
collectives, the machine), ``results/bench_net.md`` (the tables and the
GOAL lines) and ``results/bench_net.png`` (measured speedups over the
predicted curves).  A full run (not ``--quick``, and every rate, process count
and method) copies the three to
``paper_figs/out/fig9_measured.{json,md,png}``: the committed measurements
that ``make figures`` draws into figure 9 and its section.

Usage (as root: namespaces and ``tc`` need it; elsewhere it says why and
exits 0)::

    python -m experiments.net.run                 # 2 and 4 processes, 0.1/1/10 Gbit/s
    python -m experiments.net.run --quick         # 1 Gbit/s only, fewer steps
    python -m experiments.net.run --rates 1gbit --workers 4 --methods qsgd-sg,topk-sg
    python -m experiments.net.run --quick --methods fsdp-fp32,fsdp-bf16,fsdp-zpp,fsdp-sign
    python -m experiments.net.run --quick --methods diloco-int8,sparseloco
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from experiments.common import jobs, lm, netns
from experiments.common.jobs import ROOT
from experiments.common.machine import load_average, machine
from experiments.net import report as net_report

RATES = ("100mbit", "1gbit", "10gbit")
WORKERS = (2, 4)
QUICK_RATES = ("1gbit",)
#: Timed steps per setting (the slowest rate gets fewer: a dense step takes seconds there).
STEPS = {"unlimited": 5, "default": 5, "100mbit": 3}
QUICK_STEPS = {"unlimited": 3, "default": 3, "100mbit": 2}
WARMUP = 2
#: Whole rounds timed per setting for the local-steps methods (DiLoCo's is 50 steps).
ROUNDS, QUICK_ROUNDS = 2, 1
COMPUTE_STEPS = 5
BASE_PORT = 29400
TIMEOUT_S = 3600
FIGURE_COPY = ROOT / "paper_figs" / "out" / "fig9_measured.png"  # and .json, .md


WORKER = "experiments.net.worker"


def plan(rates, methods, quick: bool) -> dict:
    """The workers' configuration: model, methods, rates (``None`` first: no limit), steps."""
    table = QUICK_STEPS if quick else STEPS
    names = ["unlimited", *rates]
    return {
        "model": {},
        "methods": [m.key for m in methods],
        "rates": [None, *rates],
        "steps": {r: table.get(r, table["default"]) for r in names},
        "rounds": QUICK_ROUNDS if quick else ROUNDS,
        "warmup": 1 if quick else WARMUP,
        "compute_steps": 3 if quick else COMPUTE_STEPS,
    }


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.net.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="1 Gbit/s only, fewer steps")
    parser.add_argument("--rates", help=f"comma-separated tc rates (default {','.join(RATES)})")
    parser.add_argument("--workers", help="comma-separated process counts (default 2,4)")
    keys = ",".join(m.key for m in lm.METHODS)
    parser.add_argument("--methods", help=f"comma-separated, of {keys} (baselines always run)")
    parser.add_argument("--out", default=str(ROOT / "results"), help="output directory")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per job")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rates = tuple(args.rates.split(",")) if args.rates else (QUICK_RATES if args.quick else RATES)
    for rate in rates:
        netns.rate_bits_per_s(rate)  # a clear error for a bad rate, before anything starts
    workers = tuple(int(w) for w in args.workers.split(",")) if args.workers else WORKERS
    methods = lm.select(args.methods.split(",") if args.methods else None)
    ns = f"compjax-bench-{os.getpid()}"
    reason = netns.unavailable_reason(ns)
    if reason is not None:
        print(f"bench-net: skipped: {reason}")
        return 0
    config = plan(rates, methods, args.quick)
    res: dict = {
        "machine": machine(),
        "config": {**config, "workers": list(workers), "quick": args.quick},
        "network": {"namespace": ns, "burst": netns.BURST, "latency": netns.LATENCY},
        "methods": {
            m.key: {
                "label": m.label,
                "spec": m.spec,
                "collective": m.collective,
                "sync_every": m.sync_every,
            }
            for m in methods
        },
        "load_before": load_average(),
        "runs": {},
    }
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with netns.namespace(ns), tempfile.TemporaryDirectory() as tmp:
            for n in workers:
                print(f"bench-net: {n} processes in namespace {ns}, rates {rates}", flush=True)
                port = BASE_PORT + n
                netns.clear_rate(ns)  # the previous count's workers left their last rate
                res["runs"][str(n)] = jobs.launch(
                    ns, n, config, Path(tmp), port, args.timeout, WORKER
                )
                if "error" in res["runs"][str(n)]:
                    print(f"bench-net: {n} processes FAILED:\n{res['runs'][str(n)]['error']}")
    except KeyboardInterrupt:
        print("bench-net: interrupted; namespace deleted, workers killed", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    res["load_after"] = load_average()
    res["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = net_report.analyse(res)
    res["analysis"] = report
    (out / "bench_net.json").write_text(json.dumps(res, indent=1, default=float))
    table = net_report.markdown(res, report)
    (out / "bench_net.md").write_text(table)
    png = out / "bench_net.png"
    net_report.figure(res, report, png)
    copies = ""
    # The committed measurements (figure 9's) are a full run's: every rate, count and method.
    if not args.quick and not (args.rates or args.workers or args.methods):
        FIGURE_COPY.parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".md", ".png"):
            shutil.copyfile(
                (out / "bench_net").with_suffix(suffix), FIGURE_COPY.with_suffix(suffix)
            )
        copies = f" and copied them to {FIGURE_COPY.with_suffix('.*')}"
    print(table)
    print(
        f"wrote {out / 'bench_net.json'}, {out / 'bench_net.md'} and {png}{copies} "
        f"in {res['seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
