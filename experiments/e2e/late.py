"""The late target of ``make bench-e2e``, in simulation: a loss near dense bf16's plateau, and
every seed's simulated steps to both targets.

The early target (:mod:`experiments.e2e.sweep`) is dense bf16's validation loss after the
token budget (300 steps), early in training: a method that arrives there first can still
plateau higher, which is Agarwal et al.'s critique ("On the Utility of Gradient Compression in
Distributed Training Systems", MLSys 2022).  The late target is the validation loss dense
bf16 reaches at :data:`LATE_FACTOR` x the budget (900 steps), at its swept learning rate and
the sweep's seed; the methods that matter most at each rate (:data:`LATE_METHODS`) run to it
in simulation for every seed, stopped at :data:`CAP_FACTOR` x 900 steps, where a method that
has not reached it is reported as not reaching it.

Each seed's runs also give that seed's simulated steps to the early target (they pass it on
the way; the other methods run to the early target alone, :data:`EARLY_ONLY`), so every
seed's prediction uses its own trajectory.  The learning rate is constant (no schedule), so a
run's trajectory does not depend on where it stops.

The result is committed as ``experiments/e2e/late.json``; every run is saved as it ends, so a
stopped stage resumes at the run it was in (``python -m experiments.e2e.run --late``).
"""

from __future__ import annotations

import datetime
import json
import tempfile
from pathlib import Path

from experiments.e2e import task
from experiments.e2e.sweep import _kept, simulate

LATE_FILE = task.HERE / "late.json"
#: The late target: dense bf16's validation loss at this multiple of the budget's steps.
LATE_FACTOR = 3
#: Runs to the late target stop at this multiple of its steps (the cap).
CAP_FACTOR = 2
#: Raced to the late target: the baselines and the methods that matter most at each rate, in
#: the order they are simulated (the goals' first: a stopped stage has those).
LATE_METHODS = ("bf16", "diloco-int8", "sparseloco", "sign-sg", "qsgd512-sg", "onebit-adam", "fp32")
#: Raced to the early target only (for their per-seed predictions).
EARLY_ONLY = tuple(m.key for m in task.METHODS if m.key not in LATE_METHODS)


def steps_to(evals: list, target: float) -> int | None:
    """The step of the first evaluation at or below ``target`` (``None``: never)."""
    return next((step for step, value in evals if value <= target), None)


def run_name(key: str, seed: int) -> str:
    return f"{key}/{seed}"


def plan(sweep_result: dict, seeds: tuple[int, ...]) -> list[dict]:
    """The simulated runs after the late target is known, in the order they run: the late
    methods to it for every seed (the goals' methods first), then the other methods to the
    early target for the seeds the sweep did not run."""
    late = sweep_result["late"]
    common = {"eval_every": sweep_result["eval_every"], "model": sweep_result.get("model", {})}
    runs = []
    for key in LATE_METHODS:
        for seed in seeds:
            if (key, seed) == (task.TARGET_METHOD, sweep_result.get("seed", 0)):
                continue  # the target's own run
            lr = sweep_result["methods"][key]["lr"]
            runs.append(
                {**common, "method": key, "seed": seed, "lr": lr}
                | {"target": late["target"], "max_steps": late["cap"]}
            )
    for key in EARLY_ONLY:
        for seed in seeds:
            if seed == sweep_result.get("seed", 0) or key not in sweep_result["methods"]:
                continue
            lr = sweep_result["methods"][key]["lr"]
            runs.append(
                {**common, "method": key, "seed": seed, "lr": lr}
                | {"target": sweep_result["target"], "max_steps": sweep_result["max_steps"]}
            )
    return runs


def late(args, sweep_result: dict, seeds: tuple[int, ...]) -> dict:
    """Stage 1b: the late target from dense bf16 at ``LATE_FACTOR`` x the budget, then every
    planned run (:func:`plan`), each saved to ``LATE_FILE`` (``args.late_file``) as it ends."""
    path = Path(args.late_file)
    previous = json.loads(path.read_text()) if path.exists() and not args.fresh else {}
    result = previous if previous.get("early_target") == sweep_result["target"] else {}
    budget = sweep_result["budget_steps"]
    result |= {"early_target": sweep_result["target"], "late_steps": LATE_FACTOR * budget}
    result |= {"cap": CAP_FACTOR * LATE_FACTOR * budget, "seeds": list(seeds)}
    result.setdefault("runs", {})

    def save():
        result["command"] = "python -m experiments.e2e.run --late"
        result["date"] = datetime.date.today().isoformat()
        path.write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        lead = run_name(task.TARGET_METHOD, sweep_result.get("seed", 0))
        if lead not in result["runs"]:
            run = {
                "method": task.TARGET_METHOD,
                "seed": sweep_result.get("seed", 0),
                "lr": sweep_result["target_lr"],
                "eval_every": sweep_result["eval_every"],
                "model": sweep_result.get("model", {}),
                "target": None,
                "max_steps": result["late_steps"],
            }
            result["runs"][lead] = _kept(simulate([run], args.workers, Path(tmp), 0)[0]) | {
                "seed": run["seed"]
            }
            save()
        result["target"] = result["runs"][lead]["evals"][-1][1]
        for run in plan(sweep_result | {"late": result}, seeds):
            name = run_name(run["method"], run["seed"])
            if name in result["runs"]:
                continue
            got = simulate([run], args.workers, Path(tmp), run["max_steps"])[0]
            result["runs"][name] = _kept(got) | {"seed": run["seed"], "target": run["target"]}
            save()
    save()
    return result


def simulated_steps(res: dict, key: str, seed: int, which: str) -> int | None:
    """``key``'s steps to the ``which`` (``"early"`` or ``"late"``) target in simulation for
    ``seed``: the sweep's kept run for its seed and the early target, else the late stage's run
    of that seed (``None`` where none ran, or it did not reach the target)."""
    sweep = res["sweep"]
    if which == "early" and seed == sweep.get("seed", 0) and key in sweep.get("methods", {}):
        return sweep["methods"][key]["steps_to_target"]
    run = res.get("late", {}).get("runs", {}).get(run_name(key, seed))
    target = sweep["target"] if which == "early" else res["late"]["target"]
    # A run to the early target stopped there: it says nothing of the late one.
    if run is None or run.get("target") not in (None, res["late"]["target"], target):
        return None
    return steps_to(run["evals"], target)


def simulated_run(res: dict, key: str, seed: int) -> dict | None:
    """The late stage's simulated run of ``key`` for ``seed`` (``None`` where none ran)."""
    return res.get("late", {}).get("runs", {}).get(run_name(key, seed))


def read_late(path: Path = LATE_FILE) -> dict:
    """The committed late stage (``{}`` before it ran)."""
    return json.loads(path.read_text()) if path.exists() else {}
