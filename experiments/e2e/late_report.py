"""The late target's table and goals in ``make bench-e2e``'s report.

One row per (rate, method of :data:`experiments.e2e.late.LATE_METHODS`, seed):

* **measured**: the method ran to the late target across processes at that rate (the
  local-steps methods): its steps and the sum of its step times up to the evaluation that
  reached it; *not reached* when it had not by the cap;
* **extrapolated (simulated steps)**: that seed's steps to the late target in simulation
  (:mod:`experiments.e2e.late`; the run across processes takes the same steps, up to the
  order of its float sums) x the step time measured at that rate in the same method's and
  seed's early-target run (:func:`experiments.e2e.report.step_time`; 1-bit Adam's warm-up
  steps at their own median): the issue's allowance for synchronous methods, whose
  trajectory does not depend on the link.

Every row is predicted the same way, so a measured row's measured/predicted tests the
prediction out of sample: the seed's simulated steps x the step time of a different run.
"""

from __future__ import annotations

from experiments.e2e import late, report

#: The late target's goals (the issue's, not loosened).
GOAL_ANY = 1.5  # some method vs bf16 at 1 Gbit/s
GOAL_LOCAL_STEPS = 5.0  # DiLoCo or SparseLoCo vs bf16 at 0.1 Gbit/s


def rows(res: dict) -> list[dict]:
    """One row per (rate, late method, seed) that has a timing run and a simulation or a
    measured late run (see the module docstring); with speedups over fp32 and bf16."""
    rounds = report._local_rounds(res)
    warmups = res.get("warmup", {})
    out = []
    for rate, runs in res["rates"].items():
        for base in runs:  # the early-target runs: each rate's step times
            key, seed = base["method"], base["seed"]
            if key not in late.LATE_METHODS:
                continue
            step_s = report.step_time(base, rounds.get(key))
            sim_steps = late.simulated_steps(res, key, seed, "late")
            sim = late.simulated_run(res, key, seed)
            warmup = warmups.get(key, 0)
            predicted = None
            if sim_steps is not None:
                predicted = report.predict(base, sim_steps, step_s, warmup)
            real = _late_run(res, rate, key, seed)
            row = {"rate": rate, "method": key, "seed": seed, "step_s": step_s}
            if real is not None:
                steps, seconds = real["reached_step"], report.time_to_target(real)
                row |= {"kind": "measured", "final_validation": real["evals"][-1][1]}
                bits = report.bits_per_worker(real)
            elif sim is not None:
                steps, seconds = sim_steps, predicted
                row |= {"kind": "extrapolated", "steps_from": "simulation"}
                row["final_validation"] = sim["evals"][-1][1]
                bits = report.bits_per_worker(base) if base["kind"] == "measured" else None
            else:
                continue
            known = row["kind"] == "measured" and seconds is not None and predicted is not None
            row |= {
                "steps": steps,
                "seconds": seconds,
                "bits": None if bits is None or steps is None else bits * steps,
                "predicted_s": predicted,
                "measured_over_predicted": seconds / predicted if known else None,
                "steps_over_simulated": steps / sim_steps if known else None,
            }
            out.append(row)
    for row in out:
        for ref_key in ("fp32", "bf16"):
            want = (row["rate"], ref_key, row["seed"])
            ref = next((r for r in out if (r["rate"], r["method"], r["seed"]) == want), None)
            ok = ref and ref["seconds"] and row["seconds"]
            row[f"speedup_{ref_key}"] = ref["seconds"] / row["seconds"] if ok else None
    return out


def _late_run(res: dict, rate: str, key: str, seed: int) -> dict | None:
    """The run to the late target across processes of ``key`` and ``seed`` at ``rate``."""
    runs = res.get("late_rates", {}).get(rate, [])
    return next((r for r in runs if (r["method"], r["seed"]) == (key, seed)), None)


def goals(table: list[dict], res: dict) -> list[str]:
    """The late target's GOAL lines: met, missed, or not run."""
    lines = []
    local = res.get("local_methods", [])
    fast = [r for r in table if r["rate"] == "1gbit" and r["method"] not in ("fp32", "bf16")]
    slow = [r for r in table if r["rate"] == "100mbit" and r["method"] in local]
    for name, group, goal in (
        ("some method", fast, GOAL_ANY),
        ("DiLoCo/SparseLoCo", slow, GOAL_LOCAL_STEPS),
    ):
        rate = "1 Gbit/s" if group is fast else "0.1 Gbit/s"
        head = f"GOAL late target: {name} >= {goal}x bf16 at {rate}"
        if not group:
            lines.append(f"{head}: NOT RUN")
            continue
        method, got, spread = report._best_mean(group)
        lines.append(f"{head}: {'MET' if got >= goal else 'MISSED'} ({method}, {got:.2f}x{spread})")
    judged = [r for r in table if r["measured_over_predicted"] is not None]
    head = f"GOAL late target: measured within {report.GOAL_PREDICTION:.0%} of the prediction"
    if not judged:
        lines.append(f"{head}: NOT RUN (no run reached the late target across processes)")
    else:
        worst = max(judged, key=lambda r: abs(r["measured_over_predicted"] - 1))
        ratio = worst["measured_over_predicted"]
        verdict = "MET" if abs(ratio - 1) <= report.GOAL_PREDICTION else "MISSED"
        lines.append(
            f"{head}: {verdict} ({len(judged)} runs; worst {ratio:.2f}: {worst['method']} seed "
            f"{worst['seed']} at {worst['rate']}, its steps {worst['steps_over_simulated']:.2f}x "
            f"its seed's simulation, its time per step "
            f"{ratio / worst['steps_over_simulated']:.2f}x the prediction's)"
        )
    return lines


def markdown(res: dict, table: list[dict]) -> str:
    """The late target's section: its definition, a table per rate, the goals."""
    info = res["late"]
    unreached = sorted(
        {res["labels"].get(r["method"], r["method"]) for r in table if r["steps"] is None}
    )
    missing = [
        res["labels"].get(key, key)
        for key in late.LATE_METHODS
        if not any(r["method"] == key for r in table)
    ]
    head = [
        "# The late target",
        "",
        f"Validation loss {info['target']:.4f}: dense bf16's after {info['late_steps']} steps "
        f"(3x the early target's budget), seed {res['sweep'].get('seed', 0)}, at its swept "
        f"learning rate, in simulation (committed in `experiments/e2e/late.json` before any "
        f"timed run to it). A run stops there or at {info['cap']} steps (the cap); "
        + (
            f"not reached within it: {', '.join(unreached)}. "
            if unreached
            else "every run reached it. "
        )
        + (f"Not run yet (no simulation): {', '.join(missing)}. " if missing else "")
        + "*measured*: ran to the late target across processes at that rate; *extrapolated "
        "(simulated steps)*: that seed's steps to it in simulation x the step time measured at "
        "that rate in the same method's and seed's early-target run. Predicted (every row): "
        "the same product, so a measured row's measured/predicted is out of sample.",
        "",
    ]
    body = []
    for rate in res["rates"]:
        body += [
            f"## {rate}, late target",
            "",
            "| method | kind | seeds reached | steps to target | seconds to target (spread) "
            "| x fp32 | x bf16 | Mbit/worker to target | predicted s | measured/predicted "
            "(steps/simulated) | final validation |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        body += [
            report.table_row(res, r) for r in report.summary(table) if r["rate"] == rate
        ]  # fmt: skip
        body.append("")
    return "\n".join(head + body + goals(table, res)) + "\n"
