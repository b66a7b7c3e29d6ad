"""Tables, goals and the figure of ``make bench-e2e`` (time to a validation-loss target).

:func:`rows` turns the raw runs into one row per method and rate:

* **measured** rows ran to the target across processes at that rate: the
  time to target is the sum of the step times up to the evaluation that
  reached it (evaluations excluded), the bits are the loopback bytes of the
  whole run per worker, scaled to the steps to target;
* **extrapolated** rows (a synchronous method at a slower rate): the steps
  to target of the same method and seed at the measured rate (where that
  rate did not run, its steps to target in the sweep's simulation, which the
  run across processes follows up to the order of its float sums), times the
  median step time measured over a few steps at this rate.  A synchronous
  method's trajectory does not depend on the link, so only its step time is
  measured there.

Each row carries its speedups over dense float32 and over the bf16
all-reduce of the same rate and seed, and the prediction
``steps_to_target(simulation of its seed) x step time`` (:func:`step_time`: the
median step, or a local-steps method's mean step over a round, its
synchronisation included; :func:`predict`: a warm-up's steps at their own
time), with the ratio of measured to predicted (measured rows only).

``python -m experiments.e2e.report FILE.json ...`` rebuilds a saved run's
table, report and figure from its runs (:func:`rerender`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from experiments.e2e import late

#: Goals, as the benchmark states them (not loosened).
GOAL_PER_STEP = 1.5  # some per-step method vs bf16 at 1 Gbit/s, 4 processes
GOAL_LOCAL_STEPS = 5.0  # DiLoCo or SparseLoCo vs bf16 at 0.1 Gbit/s
GOAL_PREDICTION = 0.25  # |measured / predicted - 1|


def time_to_target(run: dict) -> float | None:
    """Seconds of training steps until the evaluation that reached the target."""
    if run["reached_step"] is None:
        return None
    return float(sum(run["step_times"][: run["reached_step"]]))


def median_step(run: dict) -> float:
    """The median step time of a run (its first step, the slowest, included)."""
    return float(statistics.median(run["step_times"]))


def step_time(run: dict, sync_every: int | None = None) -> float:
    """The step time a prediction multiplies: the median step of a synchronous method; for a
    local-steps method (a round of ``sync_every`` steps, one of them synchronising), the median
    over its complete rounds of a round's mean step, so that the synchronisation is counted
    (the median step is a local one, which would leave it out)."""
    times = run["step_times"]
    if not sync_every or len(times) < sync_every:
        return median_step(run) if not sync_every else float(np.mean(times))
    whole = len(times) // sync_every * sync_every
    rounds = np.asarray(times[:whole], dtype=float).reshape(-1, sync_every)
    return float(np.median(rounds.mean(axis=1)))


def bits_per_worker(run: dict) -> float | None:
    """Loopback bits per worker per step of a measured run, ``None`` in simulation."""
    if run.get("tx_bytes") is None:
        return None
    return 8.0 * run["tx_bytes"] / run["workers"] / run["steps_run"]


def rows(res: dict) -> list[dict]:
    """One row per (rate, method, seed), measured or extrapolated (see the module docstring)."""
    rounds = _local_rounds(res)
    out = []
    for rate, runs in res["rates"].items():
        for run in runs:
            key, seed = run["method"], run["seed"]
            row = {"rate": rate, "method": key, "seed": seed, "kind": run["kind"]}
            step_s = step_time(run, rounds.get(key))
            if run["kind"] == "measured":
                steps, seconds = run["reached_step"], time_to_target(run)
                final = run["evals"][-1][1]
            else:
                base = _find(res, res["measured_rate"], key, seed) or _simulated(res, key, seed)
                steps = base["reached_step"] if base else None
                seconds = None if steps is None else steps * step_s
                final = base["evals"][-1][1] if base else None
                row["steps_from"] = None if base is None else base.get("source", "measured")
            bits = bits_per_worker(run)
            sim_steps = late.simulated_steps(res, key, seed, "early")
            warmup = res.get("warmup", {}).get(key, 0)
            predicted = None if sim_steps is None else predict(run, sim_steps, step_s, warmup)
            row |= {
                "steps": steps,
                "seconds": seconds,
                "step_s": step_s,
                "bits_per_step": bits,
                "bits": None if bits is None or steps is None else bits * steps,
                "predicted_s": predicted,
                "final_validation": final,
            }
            # An extrapolated row's seconds are themselves a product of steps and step time.
            known = run["kind"] == "measured" and seconds is not None and predicted is not None
            row["measured_over_predicted"] = seconds / predicted if known else None
            # Its two factors: the steps over its seed's simulation's, the rest the step time's.
            row["steps_over_simulated"] = steps / sim_steps if known else None
            out.append(row)
    for row in out:
        for base in ("fp32", "bf16"):
            ref = next(
                (
                    r
                    for r in out
                    if (r["rate"], r["method"], r["seed"]) == (row["rate"], base, row["seed"])
                ),
                None,
            )
            ok = ref and ref["seconds"] and row["seconds"]
            row[f"speedup_{base}"] = ref["seconds"] / row["seconds"] if ok else None
    return out


def predict(run: dict, steps: int, step_s: float, warmup: int = 0) -> float:
    """Seconds for ``steps`` steps at ``step_s`` each; with a ``warmup`` (1-bit Adam's dense
    steps before its freeze), the warm-up steps at their own median time and the others at the
    median of the steps after it."""
    times = run["step_times"]
    if not warmup or len(times) <= warmup:
        return steps * step_s
    early = float(statistics.median(times[:warmup]))
    late = float(statistics.median(times[warmup:]))
    return min(steps, warmup) * early + max(steps - warmup, 0) * late


def _local_rounds(res: dict) -> dict[str, int]:
    """Each local-steps method's round ``H`` (an older result's single ``sync_every``
    applies to all of its local methods)."""
    rounds = res.get("sync_every") or {}
    if not isinstance(rounds, dict):
        rounds = {key: rounds for key in res.get("local_methods", [])}
    return {key: h for key, h in rounds.items() if key in res.get("local_methods", [])}


def _simulated(res: dict, key: str, seed: int) -> dict | None:
    """The sweep's kept run of ``key`` (its steps to target and trajectory in simulation), for
    the sweep's seed, when the measured rate did not run.  The run across processes sees the
    same batches and takes the same steps up to the order of its float sums (gloo's against
    XLA's in one process): a tiny model reaches the target at the same step
    (``tests/test_bench_e2e.py``), the full one did for most methods, not for PowerSGD."""
    swept = res["sweep"].get("methods", {}).get(key)
    if swept is None or seed != res["sweep"].get("seed", 0):
        return None
    run = next((r for r in swept.get("runs", []) if r["lr"] == swept["lr"]), None)
    if run is None:
        return None
    return run | {"reached_step": swept["steps_to_target"], "source": "simulation"}


def _find(res: dict, rate: str, key: str, seed: int) -> dict | None:
    return next(
        (r for r in res["rates"].get(rate, []) if (r["method"], r["seed"]) == (key, seed)), None
    )


def _mean(values):
    values = [v for v in values if v is not None]
    return (float(np.mean(values)), float(np.ptp(values))) if values else (None, None)


def summary(table: list[dict]) -> list[dict]:
    """Rows averaged over seeds: means, and the spread (max - min) of the seconds."""
    keys = []
    for r in table:
        if (r["rate"], r["method"]) not in keys:
            keys.append((r["rate"], r["method"]))
    out = []
    for rate, method in keys:
        group = [r for r in table if (r["rate"], r["method"]) == (rate, method)]
        mean = {f: _mean(r[f] for r in group)[0] for f in _FIELDS}
        reached = sum(r["steps"] is not None for r in group)
        spread = _mean(r["seconds"] for r in group)[1]
        out.append(
            {"rate": rate, "method": method, "kind": _kind(group[0]), "seeds": len(group)}
            | mean
            | {"reached": reached, "seconds_spread": spread}
        )
    return out


def _kind(row: dict) -> str:
    """``measured``, ``extrapolated``, or ``extrapolated (simulated steps)``."""
    simulated = row.get("steps_from") == "simulation"
    return f"{row['kind']} (simulated steps)" if simulated else row["kind"]


_FIELDS = (
    "steps",
    "seconds",
    "step_s",
    "bits",
    "speedup_fp32",
    "speedup_bf16",
    "predicted_s",
    "measured_over_predicted",
    "steps_over_simulated",
    "final_validation",
)


def _best_mean(rows_: list[dict]) -> tuple[str, float, str]:
    """The method of ``rows_`` with the best speedup over bf16 as a mean over its seeds (a
    seed that did not reach the target counts 0, never the best seed alone); that mean, and
    the per-seed range when there are several."""
    by_method: dict[str, list[float]] = {}
    for r in rows_:
        by_method.setdefault(r["method"], []).append(r["speedup_bf16"] or 0.0)
    method = max(by_method, key=lambda m: float(np.mean(by_method[m])))
    values = by_method[method]
    spread = f", mean of {len(values)} seeds: {min(values):.2f} to {max(values):.2f}x"
    return method, float(np.mean(values)), spread if len(values) > 1 else ""


def goals(table: list[dict], res: dict) -> list[str]:
    """The GOAL lines: met, missed, or not run (and why)."""
    lines = []
    local_methods = res.get("local_methods", [])
    per_step = [
        r
        for r in table
        if r["rate"] == "1gbit" and r["method"] not in ("fp32", "bf16", *local_methods)
    ]
    if res["workers"] != 4 or not per_step:
        lines.append("GOAL per-step method >= 1.5x bf16 at 1 Gbit/s, 4 processes: NOT RUN")
    else:
        method, got, spread = _best_mean(per_step)
        verdict = "MET" if got >= GOAL_PER_STEP else "MISSED"
        lines.append(
            f"GOAL per-step method >= {GOAL_PER_STEP}x bf16 at 1 Gbit/s, 4 processes: {verdict} "
            f"(best {method}, {got:.2f}x{spread})"
        )
    local = [r for r in table if r["method"] in local_methods and r["rate"] == "100mbit"]
    if not local:
        lines.append(
            f"GOAL DiLoCo/SparseLoCo >= {GOAL_LOCAL_STEPS}x bf16 at 0.1 Gbit/s: NOT RUN "
            "(no local-step method in this run)"
        )
    else:
        method, got, spread = _best_mean(local)
        verdict = "MET" if got >= GOAL_LOCAL_STEPS else "MISSED"
        lines.append(
            f"GOAL DiLoCo/SparseLoCo >= {GOAL_LOCAL_STEPS}x bf16 at 0.1 Gbit/s: {verdict} "
            f"({method}, {got:.2f}x{spread})"
        )
    judged = [r for r in table if r["measured_over_predicted"] is not None]
    if judged:
        worst = max(judged, key=lambda r: abs(r["measured_over_predicted"] - 1))
        ratio, steps = worst["measured_over_predicted"], worst["steps_over_simulated"]
        verdict = "MET" if abs(ratio - 1) <= GOAL_PREDICTION else "MISSED"
        lines.append(
            f"GOAL measured time to target within {GOAL_PREDICTION:.0%} of the prediction: "
            f"{verdict} (worst measured/predicted {ratio:.2f}: {worst['method']} seed "
            f"{worst['seed']} at {worst['rate']}, its steps {steps:.2f}x its seed's simulation's, "
            f"its time per step {ratio / steps:.2f}x the prediction's; {len(judged)} runs)"
        )
    else:
        lines.append("GOAL measured time to target within 25% of the prediction: NOT RUN")
    return lines


def _fmt(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


def _rounds(res: dict) -> str:
    """Each local-steps method's round, e.g. ``diloco 50, sparseloco 15``."""
    rounds = res.get("sync_every", {})
    if not isinstance(rounds, dict):  # a result written before rounds were per method
        return str(rounds)
    return ", ".join(f"{key} {h}" for key, h in rounds.items()) or "none"


def _reused(res: dict) -> str:
    """Which runs ``--resume`` took from earlier runs' files, and what they took."""
    runs = [r for rate_runs in res["rates"].values() for r in rate_runs]
    reused = [r for r in runs if r.get("timed_in")]
    if not reused:
        return ""
    files = sorted({r["timed_in"] for r in reused})
    wall = sum(r["wall_s"] for r in reused)
    return (
        f"; {len(reused)} of its {len(runs)} runs were timed in earlier runs "
        f"({', '.join(files)}; {wall:.0f} s of training and evaluation there)"
    )


def table_row(res: dict, r: dict) -> str:
    """A :func:`summary` row as a line of the report's tables."""
    mbit = None if r["bits"] is None else r["bits"] / 1e6
    seconds = _fmt(r["seconds"], ".1f", "not reached")
    return (
        f"| {res['labels'].get(r['method'], r['method'])} | {r['kind']} "
        f"| {r['reached']}/{r['seeds']} | {_fmt(r['steps'], '.0f', 'not reached')} "
        f"| {seconds} ({_fmt(r['seconds_spread'], '.1f')}) "
        f"| {_fmt(r['speedup_fp32'], '.2f')} | {_fmt(r['speedup_bf16'], '.2f')} "
        f"| {_fmt(mbit, ',.0f')} | {_fmt(r['predicted_s'], '.1f')} "
        f"| {_fmt(r['measured_over_predicted'], '.2f')} "
        f"({_fmt(r['steps_over_simulated'], '.2f')}) "
        f"| {_fmt(r['final_validation'], '.4f')} |"
    )


def markdown(res: dict, table: list[dict]) -> str:
    """The report: setup, the summary table per rate, the goals."""
    sweep = res["sweep"]
    head = [
        "# make bench-e2e: time to a validation-loss target",
        "",
        f"{res['parameters']:,}-parameter character transformer on Python's pydoc text, "
        f"{res['workers']} jax.distributed processes on a loopback limited by tc. Target: "
        f"validation loss {sweep['target']:.4f} (dense bf16 after {sweep['budget_steps']} steps, "
        f"measured once in simulation and committed); a run stops there or at "
        f"{sweep['max_steps']} steps (3x). Local steps (inner AdamW): DiLoCo's outer Nesterov "
        f"(0.7, momentum 0.9), SparseLoCo's chunked top-k with error feedback; H: {_rounds(res)}. "
        f"Machine: {res['machine']['cpu']}, "
        f"{res['machine']['cpu_count']} cores; the run took {res['seconds']:.0f} s"
        f"{_reused(res)}.",
        "",
        "Seconds are training steps only (evaluations excluded). *measured*: ran to the target "
        "at that rate; *extrapolated*: steps to target from the measured rate (*simulated "
        "steps*: from the sweep's simulation, where the measured rate did not run) x the median "
        "step time measured at this rate (a synchronous method's trajectory does not depend on the "
        "link). Predicted: steps to target in simulation x the median step time (a local-steps "
        "method's: the median over its rounds of a round's mean step, the synchronisation "
        "included; 1-bit Adam's warm-up steps at their own median), each seed from its own "
        "simulation (no prediction where that seed was not simulated); in brackets, the steps "
        "to target over the simulation's, the part of measured/predicted that is not the step "
        "time.",
        "",
    ]
    body = []
    for rate in res["rates"]:
        body += [
            f"## {rate}",
            "",
            "| method | kind | seeds reached | steps to target | seconds to target (spread) "
            "| x fp32 | x bf16 | Mbit/worker to target | predicted s | measured/predicted "
            "(steps/simulated) | final validation |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        body += [table_row(res, r) for r in summary(table) if r["rate"] == rate]
        body.append("")
    return "\n".join(head + body + goals(table, res)) + "\n"


def full_markdown(res: dict) -> str:
    """The report of ``res`` (its ``table`` computed): :func:`markdown`, and the late target's
    section (:mod:`experiments.e2e.late_report`, its table kept as ``res["late_table"]``)
    where ``res`` carries the late stage."""
    text = markdown(res, res["table"])
    if not res.get("late"):
        return text
    from experiments.e2e import late_report  # it builds on this module

    res["late_table"] = late_report.rows(res)
    return text + "\n" + late_report.markdown(res, res["late_table"])


def figure(res: dict, path) -> None:
    """Validation loss against training seconds, one panel per rate, the target dotted; a
    method has one colour in every panel, its later seeds fainter, extrapolated runs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(res["rates"])
    methods = list(dict.fromkeys(r["method"] for runs in res["rates"].values() for r in runs))
    palette = [*plt.get_cmap("tab10").colors, "black", "olive"]
    colour = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(rates), figsize=(7 * len(rates), 5), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        labelled = set()
        for run in res["rates"][rate]:
            if run["kind"] == "measured":
                source = run
                clock = np.concatenate([[0.0], np.cumsum(run["step_times"])])
            else:
                source = _find(res, res["measured_rate"], run["method"], run["seed"])
                source = source or _simulated(res, run["method"], run["seed"])
                if source is None:
                    continue
                clock = median_step(run) * np.arange(source["evals"][-1][0] + 1)
            steps, values = zip(*source["evals"], strict=True)
            first = run["method"] not in labelled
            labelled.add(run["method"])
            ax.plot(
                clock[list(steps)],
                values,
                linestyle="-" if run["kind"] == "measured" else "--",
                color=colour[run["method"]],
                alpha=1.0 if first else 0.45,
                label=res["labels"].get(run["method"], run["method"]) if first else None,
            )
        ax.axhline(res["sweep"]["target"], color="k", linestyle=":", label="target")
        if res.get("late"):
            ax.axhline(res["late"]["target"], color="gray", linestyle=":", label="late target")
        title = f"{rate} (fainter: later seeds; dashed: extrapolated)"
        ax.set(title=title, xlabel="training seconds", ylabel="validation loss")
        # symlog: linear below one second, so the step-0 evaluation (clock 0) stays on the axis
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(left=0.0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rerender(path: Path, late_file: Path | None = None) -> str:
    """Rebuild a results file's table, report and figure from its runs (after a change to
    this module, or from a stopped run's file): ``path`` (``.json``) and its ``.md`` and
    ``.png`` are rewritten; the report.  ``late_file``: the late stage to report instead of
    the one the file holds (its simulation went on after the timed runs)."""
    res = json.loads(path.read_text())
    if late_file is not None:
        res["late"] = late.read_late(late_file)
    runs = [r for rate_runs in res["rates"].values() for r in rate_runs]
    if "parameters" not in res and runs:  # a stopped run's file: written before its end
        res["parameters"] = runs[0]["parameters"]
    res["table"] = rows(res)
    text = full_markdown(res)
    path.write_text(json.dumps(res, indent=1, default=float))
    path.with_suffix(".md").write_text(text)
    figure(res, path.with_suffix(".png"))
    return text


def main(argv=None) -> int:
    """``python -m experiments.e2e.report FILE.json ...``: rebuild each saved run's table,
    report and figure (:func:`rerender`) and print its report."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.e2e.report", description=main.__doc__.split(":", 1)[1]
    )
    parser.add_argument("files", nargs="+", type=Path, help="saved runs (results/bench_e2e.json)")
    parser.add_argument(
        "--late-file",
        type=Path,
        help="report this late stage (experiments/e2e/late.json) instead of the saved one",
    )
    args = parser.parse_args(argv)
    for path in args.files:
        print(rerender(path, args.late_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
