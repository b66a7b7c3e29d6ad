"""Stage 1 of ``make bench-e2e``: the target and each method's learning rate, in simulation.

One process holds the workers as CPU devices (no network).  Dense bf16 trains for the token
budget at each of its rates; its best validation loss there is the target.  Every other
method then runs one rate at a time until the target or :data:`MAX_FACTOR` x the budget, each
rate saved as it ends (a stopped sweep resumes at the rate it was running), capped at the
fewest steps an earlier rate needed, and a grid whose kept rate lies at one of its ends grows
past it (:func:`extend`).  The result is the committed ``experiments/e2e/sweep.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from experiments.common import jobs
from experiments.common.jobs import ROOT
from experiments.e2e import task

WORKER = "experiments.e2e.worker"
#: A run that has not reached the target by this multiple of the budget reports "not reached".
MAX_FACTOR = 3


def simulate(runs: list[dict], workers: int, tmp: Path, max_steps: int) -> list[dict]:
    """Run ``runs`` for at most ``max_steps`` each in one process holding ``workers`` CPU
    devices; their results."""
    cfg, out = tmp / "sweep_runs.json", tmp / "sweep_results.json"
    cfg.write_text(json.dumps([{"max_steps": max_steps} | run for run in runs]))
    out.unlink(missing_ok=True)
    env = jobs.worker_env(dict(os.environ))
    env.pop("XLA_FLAGS")  # the worker sets its device count itself; XLA may use every core
    argv = [sys.executable, "-m", WORKER, "--simulate", str(workers)]
    subprocess.run([*argv, "--config", str(cfg), "--out", str(out)], check=True, env=env, cwd=ROOT)
    return json.loads(out.read_text())


def best(results: list[dict]) -> dict:
    """The run that reached the target in the fewest steps, else the lowest final validation."""
    reached = [r for r in results if r["reached_step"] is not None]
    if reached:
        return min(reached, key=lambda r: (r["reached_step"], r["evals"][-1][1]))
    return min(results, key=lambda r: r["evals"][-1][1] if not r["diverged"] else float("inf"))


#: How many learning rates a sweep may add beyond the end of a method's grid.
MAX_EXTENSIONS = 2


def next_rate(results: list[dict]) -> float | None:
    """The rate to try next: one grid step beyond the kept rate when it is the smallest or the
    largest tried (a better one may lie beyond), else ``None``.

    The step is the ratio of the two rates tried nearest that end.
    """
    tried = sorted({r["lr"] for r in results})
    kept = best(results)["lr"]
    if len(tried) < 2 or tried[0] < kept < tried[-1]:
        return None
    if kept == tried[0]:
        return tried[0] * tried[0] / tried[1]
    return tried[-1] * tried[-1] / tried[-2]


def extend(found: list[dict], run_at: Callable[[list[float], list[dict]], list[dict]]) -> bool:
    """Add rates beyond the grid's end while the kept rate is at an end (at most
    :data:`MAX_EXTENSIONS`); whether any was added."""
    added = False
    for _ in range(MAX_EXTENSIONS):
        rate = next_rate(found)
        if rate is None:
            break
        found += run_at([rate], found)
        added = True
    return added


def sweep(args, methods: tuple[task.E2EMethod, ...], model: dict) -> dict:
    """Stage 1: the target from dense bf16 at the budget, then every method's learning rate.

    A grid whose kept rate lies at one of its ends grows by a step in that direction
    (:func:`extend`): for the target too, so that the baseline it comes from is tuned.  A
    changed target discards every method's sweep.
    """
    path = Path(args.sweep_file)
    previous = json.loads(path.read_text()) if path.exists() and not args.fresh else {}
    same = previous.get("budget_steps") == args.budget_steps and previous.get("model") == model
    result = previous if same else {}
    result |= {
        "budget_steps": args.budget_steps,
        "eval_every": args.eval_every,
        "max_steps": MAX_FACTOR * args.budget_steps,
        "workers": args.workers,
        "model": model,
        "seed": 0,
    }
    result.setdefault("methods", {})
    common = {"seed": 0, "eval_every": args.eval_every, "model": model}
    common |= {"sync_every": args.sync_every} if args.sync_every else {}

    def save():
        result["command"] = "python -m experiments.e2e.run --sweep"
        result["date"] = datetime.date.today().isoformat()
        path.write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        lead = task.BY_KEY[task.TARGET_METHOD]

        def budget_runs(rates, found):
            runs = [{**common, "method": lead.key, "lr": lr, "target": None} for lr in rates]
            return [_kept(r) for r in simulate(runs, args.workers, Path(tmp), args.budget_steps)]

        found = result.get("target_runs") or budget_runs(lead.lrs, [])
        if extend(found, budget_runs) or "target" not in result:
            chosen = best(found)
            result["target"], result["target_lr"] = chosen["evals"][-1][1], chosen["lr"]
            result["target_runs"], result["methods"], result["partial"] = found, {}, {}
            save()
        if task.TARGET_METHOD not in result["methods"] and any(
            m.key == task.TARGET_METHOD for m in methods
        ):
            # Its budget runs already hold its steps to the target it defined.
            chosen = best([_reached(r, result["target"]) for r in found])
            result["methods"][task.TARGET_METHOD] = {
                "lr": chosen["lr"],
                "steps_to_target": chosen["reached_step"],
                "runs": found,
            }
        partial = result.setdefault("partial", {})  # a method's runs while it is swept
        for method in methods:
            if method.key == task.TARGET_METHOD:
                continue

            def to_target(rates, found, method=method):
                # One rate at a time, each saved: a stopped sweep loses at most the rate it
                # was running.  A rate stops at the fewest steps an earlier one needed.
                new = []
                for lr in rates:
                    run = {**common, "method": method.key, "lr": lr, "target": result["target"]}
                    run["earlier"] = _reached_steps(found + new)
                    got = simulate([run], args.workers, Path(tmp), result["max_steps"])
                    new += [_kept(r) for r in got]
                    partial[method.key] = found + new
                    save()
                return new

            done = result["methods"].get(method.key)
            found = done["runs"] if done else list(partial.get(method.key, []))
            tried = {r["lr"] for r in found}
            found += to_target([lr for lr in method.lrs if lr not in tried], found)
            if extend(found, to_target) or not done:
                chosen = best(found)
                result["methods"][method.key] = {
                    "lr": chosen["lr"],
                    "steps_to_target": chosen["reached_step"],
                    "runs": found,
                }
                partial.pop(method.key, None)
                save()
    return result


def _reached_steps(runs: list[dict]) -> list[int]:
    """The steps to target of the runs that reached it."""
    return [r["reached_step"] for r in runs if r["reached_step"] is not None]


def _reached(run: dict, target: float) -> dict:
    """``run`` with ``reached_step``: its first evaluation at or below ``target``."""
    steps = [step for step, value in run["evals"] if value <= target]
    return run | {"reached_step": steps[0] if steps else None}


def _kept(run: dict) -> dict:
    """What the committed sweep keeps of a run: its settings and its validation trajectory."""
    keys = ("method", "lr", "reached_step", "diverged", "steps_run", "evals", "train_s")
    return {k: run[k] for k in keys}
