"""The ``make bench-elastic`` report: goodput, time to target, loss and bits per scenario.

Every figure is computed here from the runs' records (:mod:`experiments.elastic.scenario`'s
and :mod:`experiments.elastic.baseline`'s JSON), by the definitions below, stated again in the
report:

* **time** runs from the end of each run's round 0 (its processes' start and first compile
  excluded, a restart's included);
* **clean step rate** ``r``: the inner steps the clean run merged after round 0 over
  ``islands x`` its time;
* **goodput**: the inner steps a run merged into the global parameters after round 0 over
  ``islands x time x r`` (the clean run: 100% by definition);
* **target**: the validation loss the clean run reached after round ``3 R / 4`` (``R``
  rounds); **time to target**: the time of the first merge at or below it;
* **bits**: the wire bits of every payload the synchronizer received (the islands' pulls of
  the float32 parameters are in the loopback bytes, not in the bits).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

GOODPUT_GOAL = 0.9
TIME_GOAL = 1.15
POISON_GOAL = 0.02


def merged_tokens(record: dict) -> int:
    """Inner steps merged after round 0."""
    return sum(sum(r["tokens"]) for r in record["history"][1:])


def elapsed(record: dict) -> float:
    """Seconds from the end of round 0 to the last merge."""
    return record["history"][-1]["wall_s"] - record["history"][0]["wall_s"]


def step_rate(record: dict) -> float:
    """Inner steps merged per island and second after round 0."""
    return merged_tokens(record) / (record["setup"]["islands"] * elapsed(record))


def goodput(record: dict, clean_rate: float) -> float:
    """Steps merged over ``islands x time x clean_rate``."""
    return step_rate(record) / clean_rate


def target(clean: dict) -> float:
    """The clean run's validation loss after round ``3 R / 4``."""
    rounds = len(clean["history"])
    return clean["history"][(3 * rounds) // 4 - 1]["evaluation"]


def time_to(record: dict, goal: float) -> float | None:
    """Seconds after round 0 to the first merge at or below ``goal`` (``None``: never)."""
    start = record["history"][0]["wall_s"]
    for r in record["history"]:
        if r["evaluation"] is not None and r["evaluation"] <= goal:
            return r["wall_s"] - start
    return None


def no_round_lost(record: dict) -> bool:
    """Every round merged exactly once, in order."""
    return [r["round"] for r in record["history"]] == list(range(record["setup"]["rounds"]))


def summary(records: dict[str, dict]) -> dict:
    """Per run: goodput, time to target, final loss, bits; and the goals' verdicts."""
    clean = records["clean"]
    rate, goal = step_rate(clean), target(clean)
    clean_time = time_to(clean, goal)
    rows = {}
    for name, record in records.items():
        t = time_to(record, goal)
        rows[name] = {
            "goodput": goodput(record, rate),
            "time_to_target_s": t,
            "time_ratio": None if t is None else t / clean_time,
            "final_validation": record["final_validation"],
            "loss_change": record["final_validation"] / clean["final_validation"] - 1,
            "bits": sum(r.get("bits", 0) for r in record["history"]),
            "rounds_merged": len(record["history"]),
            "no_round_lost": no_round_lost(record),
            "elapsed_s": elapsed(record),
            "step_rate": step_rate(record),
            "loopback_bytes": record.get("loopback_bytes"),
        }
    return {"target": goal, "clean_rate": rate, "rows": rows, "goals": goals(rows)}


def goals(rows: dict) -> dict[str, bool | None]:
    """The benchmark's goals, each ``None`` where its run is missing."""

    def check(name, test):
        return None if name not in rows else bool(test(rows[name]))

    def on_time(row):
        return row["time_ratio"] is not None and row["time_ratio"] <= TIME_GOAL

    def busy(row):
        return row["goodput"] >= GOODPUT_GOAL

    return {
        "kill_restart goodput >= 90%": check("kill_restart", busy),
        "slow goodput >= 90%": check("slow", busy),
        "kill_restart time to target within 15% of clean": check("kill_restart", on_time),
        "slow time to target within 15% of clean": check("slow", on_time),
        "poison (median_norm_clip) within 2% of clean": check(
            "poison", lambda r: abs(r["loss_change"]) <= POISON_GOAL
        ),
        "kill_sync loses no merged round": check("kill_sync", lambda r: r["no_round_lost"]),
    }


LABELS = {
    "clean": "clean",
    "kill_restart": "Kill(1) + restart",
    "slow": "Slow(3, 3x)",
    "poison": "Poison(2, 1e3), median_norm_clip",
    "kill_sync": "KillSynchronizer",
    "lockstep": "lock-step diloco, same kill",
    "lockstep_clean": "lock-step diloco, clean",
}


def absent_rounds(record: dict, island: int) -> list[int]:
    """The rounds merged without ``island``."""
    return [r["round"] for r in record["history"] if island not in r["merged"]]


def notes(records: dict[str, dict]) -> list[str]:
    """What the table does not show: how each kill played out, and the machine's caveat."""
    lines = []
    if "kill_restart" in records:
        gone = absent_rounds(records["kill_restart"], 1)
        lines.append(
            f"Elastic kill: island 1 was absent from {len(gone)} rounds ({gone[0]} to "
            f"{gone[-1]}: its restart's process start, import and compile) while the other "
            "three went on."
        )
    info = records.get("lockstep", {}).get("lockstep")
    if info and info.get("killed_s") is not None:
        lines.append(
            f"Lock-step kill: the launcher saw the death {info['detected_s']:.1f} s after it "
            "(left alone, the survivors wait in the gloo collective), stopped the job and "
            f"relaunched it; its first round after the restart came {info['restart_s']:.1f} s "
            f"after the relaunch; {info['lost_s']:.1f} s lost in all, "
            f"{info['lost_s'] / info['round_s']:.0f} rounds' time."
        )
    lines.append(
        "Caveat: the four islands share two cores, so an island that is dead or asleep "
        "leaves its share to the others (see steps/island/s): this flatters the kill's and "
        "the straggler's goodput and time; the poisoned run's 'goodput' above 100% shows the "
        "run-to-run spread."
    )
    return lines


def _fmt(value, spec: str, none: str = "never") -> str:
    if value is None:
        return none
    return format(value, spec) if math.isfinite(value) else str(value)


def markdown(result: dict, records: dict[str, dict], rate: str) -> str:
    """The report's text."""
    setup = records["clean"]["setup"]
    lines = [
        "# make bench-elastic",
        "",
        f"{setup['islands']} islands, DiLoCo (inner AdamW {setup['inner_lr']}, outer Nesterov "
        f"{setup['outer_lr']}/{setup['outer_momentum']}, H = {setup['sync_every']}, "
        f"{setup['rounds']} rounds), int_quant(8) pseudo-gradients, quorum "
        f"{setup['islands'] - 1}, on a loopback limited to {rate}; "
        "the character model of `experiments/elastic/task.py`.",
        "",
        f"Target: validation loss {result['target']:.4f} (the clean run's after round "
        f"{(3 * setup['rounds']) // 4}); clean step rate {result['clean_rate']:.2f} inner steps "
        "per island and second.",
        "",
        "| run | goodput | steps/island/s | time to target (s) | vs clean | final val. loss | "
        "vs clean | Mbit pushed | rounds | loopback MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"| {LABELS.get(name, name)} | {row['goodput']:.1%} | {row['step_rate']:.2f} | "
            f"{_fmt(row['time_to_target_s'], '.1f')} | {_fmt(row['time_ratio'], '.2f', '-')}x | "
            f"{row['final_validation']:.4f} | {row['loss_change']:+.1%} | "
            f"{row['bits'] / 1e6:.1f} | {row['rounds_merged']} | "
            f"{_fmt(row['loopback_bytes'] and row['loopback_bytes'] / 1e6, '.0f', '-')} |"
        )
    for note in notes(records):
        lines += ["", note]
    lines += ["", "## Goals", ""]
    for goal, verdict in result["goals"].items():
        mark = {True: "met", False: "**missed**", None: "not run"}[verdict]
        lines.append(f"- {goal}: {mark}")
    lines += ["", "## Definitions", "", *__doc__.split("\n\n", 1)[1].strip().splitlines()]
    return "\n".join(lines) + "\n"


def figure(records: dict[str, dict], path: Path) -> None:
    """Validation loss against time after round 0, every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, record in records.items():
        start = record["history"][0]["wall_s"]
        xs = [r["wall_s"] - start for r in record["history"] if r["evaluation"] is not None]
        ys = [r["evaluation"] for r in record["history"] if r["evaluation"] is not None]
        ax.plot(xs, ys, label=LABELS.get(name, name), lw=1.4)
    ax.axhline(summary(records)["target"], color="gray", ls=":", lw=1, label="target")
    ax.set_xlabel("seconds after round 0")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(raw: Path, out: Path, rate: str) -> dict:
    """Read ``raw/*.json``, write ``out/bench_elastic.{json,md,png}``; the summary."""
    records = {p.stem: json.loads(p.read_text()) for p in sorted(raw.glob("*.json"))}
    order = [n for n in LABELS if n in records]
    records = {n: records[n] for n in order}
    result = summary(records)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_elastic.json").write_text(json.dumps({**result, "rate": rate}, indent=1))
    (out / "bench_elastic.md").write_text(markdown(result, records, rate))
    figure(records, out / "bench_elastic.png")
    return result
