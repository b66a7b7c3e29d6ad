"""``make bench-e2e``: time to a validation-loss target across processes on a slow network.

Step times (``make bench-net``) do not say whether compression pays: a
method that needs 3x the steps loses even with a 2.7x faster step.  This
benchmark trains a character language model on real text
(:mod:`experiments.e2e.task`, 6.4M parameters) until a fixed
validation loss, in real ``jax.distributed`` processes on bench-net's
rate-limited loopback (its namespace, ``tc`` and process launcher), and
reports wall-clock seconds, steps and bits to the target.

Three stages:

1. ``--sweep`` (:mod:`experiments.e2e.sweep`, in simulation): the **target** (dense
   bf16's best validation loss at the token budget) and each method's learning rate, the
   rate that reaches it in the fewest steps.  Committed as
   ``experiments/e2e/sweep.json``: the target is fixed before any timed run.
1b. ``--late`` (:mod:`experiments.e2e.late`, in simulation): the **late target** (dense
   bf16's validation loss at 3x the budget, near its plateau), and every seed's simulated
   steps to both targets of the methods that matter most at each rate.  Committed as
   ``experiments/e2e/late.json``.
2. The timed runs (as root): at 1 Gbit/s every method runs to the target for
   real, per seed.  At 0.1 Gbit/s a steady method's (synchronous, every step
   alike) steps to target are those of its 1 Gbit/s run (its trajectory does
   not depend on the link) and only its step time is measured, over a few
   steps: those rows are labelled *extrapolated*.  Local-step methods
   (DiLoCo, SparseLoCo) and 1-bit Adam (dense warm-up steps, then 1-bit
   ones) run to the target at every rate.  Then the local-steps methods of the late stage run
   to the late target at ``--late-rates`` (the others' times to it are their seeds'
   simulated steps x the step time measured at each rate: :mod:`experiments.e2e.late_report`).

The timed runs go one job per rate and method, the results file rewritten after each;
``--resume`` reuses the runs of earlier results files whose settings match, so a full run
can be made in parts.  Writes ``results/bench_e2e.{json,md,png}``
(:mod:`experiments.e2e.report`) and, for a full run, copies them to
``paper_figs/out/``.  ``--quick``: one seed, 1 Gbit/s, dense bf16 and two methods.

Usage::

    python -m experiments.e2e.run --sweep          # simulation; writes the committed sweep
    python -m experiments.e2e.run --late           # simulation; the late target, every seed
    python -m experiments.e2e.run --quick          # as root: 1 Gbit/s, 3 methods, 1 seed
    python -m experiments.e2e.run                  # as root: every method, 2 seeds, 2 rates
    python -m experiments.e2e.run --resume         # the same, reusing the runs already timed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from experiments.common import jobs, netns
from experiments.common.jobs import ROOT
from experiments.common.machine import load_average, machine
from experiments.e2e import late, report, task
from experiments.e2e.sweep import WORKER, sweep

WORKERS = 4
#: The token budget of the target: dense bf16's steps (of 4 x 2 x 64 characters).
BUDGET_STEPS = 300
EVAL_EVERY = 10
MEASURED_RATE = "1gbit"
EXTRAPOLATED_RATES = ("100mbit",)
#: Where the local-steps methods run to the late target across processes: the goal's rate
#: (elsewhere their seeds' simulated steps x their measured round time, as a synchronous
#: method's).
LATE_RATES = ("100mbit",)
#: Steps timed at an extrapolated rate (a dense step takes seconds there).
EXTRAPOLATION_STEPS = 6
SEEDS = (0, 1)
QUICK_METHODS = ("bf16", "sign-sg", "qsgd512-sg")
BASE_PORT = 29600
TIMEOUT_S = 3 * 3600
FIGURE_COPY = ROOT / "paper_figs" / "out" / "bench_e2e.png"  # and .json, .md


# -- stage 2: the timed runs ---------------------------------------------------------------------
#: The settings a timed run's workers were given: with its rate and process count, what makes
#: an earlier run reusable by ``--resume``.
RUN_SETTINGS = ("method", "seed", "lr", "target", "max_steps", "eval_every", "model", "sync_every")


def run_key(run: dict, rate: str, workers: int) -> str:
    """The identity of a timed run: its rate, process count and :data:`RUN_SETTINGS`."""
    return json.dumps([rate, workers, *(run.get(f) for f in RUN_SETTINGS)])


def saved_runs(paths: list[Path]) -> dict[str, dict]:
    """The timed runs of earlier results files, by :func:`run_key`, each with its ``rate`` and
    the file it was first written to (``timed_in``).

    Both a file's report (``rates``) and the runs it carried without reporting them
    (``other_runs``) are read; a later file's run replaces an earlier file's.
    """
    saved = {}
    for path in paths:
        res = json.loads(Path(path).read_text())
        listed = [
            r | {"rate": rate}
            for field in ("rates", "late_rates")
            for rate, runs in res.get(field, {}).items()
            for r in runs
        ]
        for run in listed + res.get("other_runs", []):
            run = run | {"timed_in": run.get("timed_in") or Path(path).name}
            saved[run_key(run, run["rate"], run["workers"])] = run
    return saved


def timed_runs(
    args,
    methods,
    sweep_result: dict,
    model: dict,
    saved: dict[str, dict] | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Stage 2: every method to the target at the measured rate, step times at the others.

    One job per rate and method (its seeds): a run found in ``saved`` (:func:`saved_runs`) is
    not run again, and ``progress`` gets the runs so far after every job, so a stopped run
    loses at most the job it was running.
    """
    saved = {} if saved is None else saved
    ns = f"compjax-e2e-{os.getpid()}"
    rates: dict[str, list[dict]] = {}
    common = {"eval_every": sweep_result["eval_every"], "model": model}
    common |= {"sync_every": args.sync_every} if args.sync_every else {}
    installed, started = None, 0
    with netns.namespace(ns), tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            # Steady methods (every step alike) run to the target at the measured rate only
            # (elsewhere their step time is measured and extrapolated); the others everywhere.
            measured = {m.key: rate == MEASURED_RATE or not m.steady for m in methods}
            to_target = {"target": sweep_result["target"], "max_steps": sweep_result["max_steps"]}
            timed = {"target": None, "max_steps": EXTRAPOLATION_STEPS}
            kind = {True: "measured", False: "extrapolated"}
            rates[rate] = []
            for m in methods:
                wanted = [
                    {**common, "method": m.key, "seed": seed}
                    | {"lr": sweep_result["methods"][m.key]["lr"]}
                    | (to_target if measured[m.key] else timed)
                    for seed in args.seeds
                ]
                keys = [run_key(w, rate, args.workers) for w in wanted]
                todo = [w for w, k in zip(wanted, keys, strict=True) if k not in saved]
                if todo:
                    if installed != rate:
                        netns.run(netns.rate_command(rate, ns, installed=installed is not None))
                        installed = rate
                    seeds = [w["seed"] for w in todo]
                    print(f"bench-e2e: {m.key} at {rate}, seeds {seeds}, in {ns}", flush=True)
                    got = jobs.launch(
                        ns,
                        args.workers,
                        todo,
                        Path(tmp),
                        BASE_PORT + started % 64,
                        args.timeout,
                        module=WORKER,
                    )
                    started += 1
                    if isinstance(got, dict):  # a failure: what it wrote, and why
                        print(
                            f"bench-e2e: FAILED ({m.key} at {rate}):\n{got.get('error')}",
                            flush=True,
                        )
                        got = got.get("partial", [])
                    stamp = {"kind": kind[measured[m.key]], "timed_at": _now(), "rate": rate}
                    for run in got:
                        saved[run_key(run, rate, args.workers)] = run | stamp
                rates[rate] += [saved[k] for k in keys if k in saved]
                if progress is not None:
                    progress(rates)
    return rates


def late_timed_runs(args, methods, sweep_result: dict, res: dict, saved: dict, write) -> dict:
    """The local-steps methods of the late stage to the late target (and its cap) across
    processes at ``args.late_rates``, for the seeds whose simulation reached it (the others
    take the simulation's steps: they would not reach it either); ``write(runs, field)`` after
    every job."""
    to_late = sweep_result | {"target": res["late"]["target"], "max_steps": res["late"]["cap"]}
    out: dict[str, list[dict]] = {}
    for m in methods:
        if not m.local or m.key not in late.LATE_METHODS:
            continue
        seeds = [s for s in args.seeds if late.simulated_steps(res, m.key, s, "late")]
        if not seeds:
            print(f"bench-e2e: {m.key} reached the late target in no seed's simulation")
            continue
        late_args = argparse.Namespace(**vars(args) | {"rates": args.late_rates, "seeds": seeds})
        done = out
        got = timed_runs(
            late_args, (m,), to_late, {}, saved, lambda r, d=done: write(_merge(d, r), "late_rates")
        )
        out = _merge(done, got)
    return out


def _merge(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    """Runs per rate of ``a`` then ``b``."""
    return {rate: a.get(rate, []) + b.get(rate, []) for rate in dict.fromkeys([*a, *b])}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.e2e.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sweep", action="store_true", help="stage 1 in simulation")
    parser.add_argument("--late", action="store_true", help="stage 1b in simulation")
    parser.add_argument(
        "--fresh", action="store_true", help="with --sweep or --late: ignore a saved one"
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, 1 Gbit/s, 3 methods")
    keys = ",".join(task.BY_KEY)
    parser.add_argument("--methods", help=f"comma-separated, of {keys}")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument(
        "--rates",
        help=f"comma-separated, of {MEASURED_RATE},{','.join(EXTRAPOLATED_RATES)} (without "
        f"{MEASURED_RATE}, a synchronous method's steps to target are its simulated ones)",
    )
    parser.add_argument(
        "--seeds", type=int, help=f"seeds per method (default {len(SEEDS)}, --quick: 1)"
    )
    parser.add_argument("--budget-steps", type=int, default=BUDGET_STEPS)
    parser.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    parser.add_argument("--model", default="", help="model overrides, e.g. width=32,layers=1")
    parser.add_argument("--sync-every", type=int, help="DiLoCo's H (default 50)")
    parser.add_argument(
        "--resume",
        nargs="*",
        metavar="FILE",
        help="reuse the timed runs of earlier results files (default: the output directory's "
        "bench_e2e.json) whose settings match; only the others run",
    )
    parser.add_argument("--sweep-file", default=str(task.SWEEP_FILE))
    parser.add_argument("--late-file", default=str(late.LATE_FILE))
    parser.add_argument(
        "--late-rates",
        default=",".join(LATE_RATES),
        help="comma-separated rates where the local-steps methods run to the late target "
        "('' for none)",
    )
    parser.add_argument("--out", default=str(ROOT / "results"), help="output directory")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per job")
    args = parser.parse_args(argv)
    try:
        methods = task.select(args.methods.split(",") if args.methods else None)
        model = {k: int(v) for k, v in (kv.split("=") for kv in args.model.split(",") if kv)}
    except ValueError as err:
        parser.error(str(err))
    if args.workers < 2:
        parser.error(f"argument --workers: must be >= 2, got {args.workers}")
    if args.quick and not args.methods:
        methods = task.select(list(QUICK_METHODS))
    args.method_list, args.model_overrides = methods, model
    if args.seeds is not None and not 1 <= args.seeds <= len(SEEDS):
        parser.error(f"argument --seeds: must be in [1, {len(SEEDS)}], got {args.seeds}")
    args.seeds = SEEDS[: args.seeds or (1 if args.quick else len(SEEDS))]
    rates = (MEASURED_RATE,) if args.quick else (MEASURED_RATE, *EXTRAPOLATED_RATES)
    args.rates = tuple(args.rates.split(",")) if args.rates else rates
    known = (MEASURED_RATE, *EXTRAPOLATED_RATES)
    args.late_rates = tuple(r for r in args.late_rates.split(",") if r)
    unknown = [r for r in (*args.rates, *args.late_rates) if r not in known]
    if unknown:
        parser.error(f"argument --rates: unknown {unknown}; choose from {list(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    methods, model = args.method_list, args.model_overrides
    start = time.perf_counter()
    if args.sweep:
        result = sweep(args, methods, model)
        print(f"bench-e2e: target {result['target']:.4f} (bf16 lr {result['target_lr']:g})")
        for key, m in result["methods"].items():
            print(f"  {key:>12s}: lr {m['lr']:g}, steps to target {m['steps_to_target']}")
        print(f"wrote {args.sweep_file} in {time.perf_counter() - start:.0f} s")
        return 0
    try:
        sweep_result = task.read_sweep(Path(args.sweep_file))
    except FileNotFoundError as err:
        print(f"bench-e2e: {err}", file=sys.stderr)
        return 2
    missing = [m.key for m in methods if m.key not in sweep_result["methods"]]
    if missing:
        print(f"bench-e2e: no swept learning rate for {missing}: run --sweep first")
        return 2
    if args.late:
        result = late.late(args, sweep_result, args.seeds)
        print(f"bench-e2e: late target {result['target']:.4f}, cap {result['cap']} steps")
        for name, run in result["runs"].items():
            steps = late.steps_to(run["evals"], result["target"])
            print(f"  {name:>14s}: steps to late target {steps}, {run['steps_run']} run")
        print(f"wrote {args.late_file} in {time.perf_counter() - start:.0f} s")
        return 0
    reason = netns.unavailable_reason(f"compjax-e2e-check-{os.getpid()}")
    if reason is not None:
        print(f"bench-e2e: skipped: {reason}")
        return 0
    # The baselines are in every report: every speedup is against them (timed in this run, or
    # with --resume possibly in an earlier one, which the report says).
    keys = {m.key for m in methods} | set(task.BASELINES if not args.quick else ("bf16",))
    methods = tuple(m for m in task.METHODS if m.key in keys)
    res = {
        "machine": machine(),
        "load_before": load_average(),
        "workers": args.workers,
        "quick": args.quick,
        "seeds": list(args.seeds),
        "sweep": {k: v for k, v in sweep_result.items() if k not in ("target_runs", "partial")},
        "labels": {m.key: m.label for m in task.METHODS},
        "local_methods": [m.key for m in task.METHODS if m.local],
        "sync_every": {m.key: args.sync_every or m.sync_every for m in task.METHODS if m.local},
        "warmup": {m.key: m.warmup for m in task.METHODS if m.warmup},
        "measured_rate": MEASURED_RATE,
    }
    late_stage = {} if args.quick or model else late.read_late(Path(args.late_file))
    if late_stage.get("target") is not None:
        res["late"] = late_stage
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = {}
    if args.resume is not None:
        # Files named must exist; the default one may not (nothing run yet).
        paths = [Path(p) for p in args.resume] or [out / "bench_e2e.json"]
        try:
            saved = saved_runs([p for p in paths if args.resume or p.exists()])
        except FileNotFoundError as err:
            print(f"bench-e2e: --resume: {err}", file=sys.stderr)
            return 2
        print(f"bench-e2e: {len(saved)} timed runs saved in {[str(p) for p in paths]}")

    def write(rates: dict, field: str = "rates") -> None:
        # After every job: this run's report so far, and every saved run it does not report
        # (another method, seed or setting), so that a later --resume of this file loses none.
        res[field] = rates
        reported = {
            run_key(r, rate, args.workers)
            for f in ("rates", "late_rates")
            for rate, runs in res.get(f, {}).items()
            for r in runs
        }
        other = [r for k, r in saved.items() if k not in reported]
        res.update(other_runs=other, seconds=time.perf_counter() - start)
        (out / "bench_e2e.json").write_text(json.dumps(res, indent=1, default=float))

    res["rates"] = timed_runs(args, methods, sweep_result, model, saved, write)
    if "late" in res and args.late_rates:
        res["late_rates"] = late_timed_runs(args, methods, sweep_result, res, saved, write)
    res["parameters"] = next(
        (r["parameters"] for runs in res["rates"].values() for r in runs), task.MODEL.parameters
    )
    res["load_after"] = load_average()
    table = report.rows(res)
    res["table"] = table
    text = report.full_markdown(res)
    write(res["rates"])
    (out / "bench_e2e.md").write_text(text)
    report.figure(res, out / "bench_e2e.png")
    full = not args.quick and not model and args.workers == WORKERS and args.seeds == SEEDS
    full = full and len(args.rates) == 1 + len(EXTRAPOLATED_RATES)
    if full and len(methods) == len(task.METHODS):  # the committed full run
        for suffix in (".json", ".md", ".png"):
            source = (out / "bench_e2e").with_suffix(suffix)
            shutil.copyfile(source, FIGURE_COPY.with_suffix(suffix))
    print(text)
    print(f"wrote {out / 'bench_e2e'}.{{json,md,png}} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
