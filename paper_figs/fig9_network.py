"""Figure 9's measured points: ``make bench-net``'s committed run over the cost model's curves.

``make bench-net`` (:mod:`experiments.net.run`) times real training steps of
``jax.distributed`` processes on a rate-limited loopback and, on a full run,
commits its raw measurements as ``out/fig9_measured.json``.  This module reads
them back for figure 9: the measured speedups drawn over the curves the same
cost model predicts for that setup, and the agreement in numbers.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from experiments.net import goals as bench_net_goals
from experiments.net import report as bench_net_report

#: ``make bench-net``'s committed full run (its JSON, table and figure sit side by side).
MEASURED = "fig9_measured"


def measured_on_network(out_dir: pathlib.Path) -> tuple[str, str]:
    """The measured points of ``make bench-net`` over the cost model's curves for its setup.

    Reads the committed full run (``out/fig9_measured.json``), analyses it again,
    redraws ``out/fig9_measured.png`` and returns ``(markdown, verdict sentence)``.
    """
    path = out_dir / f"{MEASURED}.json"
    if not path.exists():
        note = (
            f"No measured run is committed (`make bench-net` writes `out/{MEASURED}.json` on a "
            "full run), so the model's curves above are not checked against a real network."
        )
        return note, note
    res = json.loads(path.read_text())
    report = bench_net_report.analyse(res)
    bench_net_report.figure(res, report, out_dir / f"{MEASURED}.png")
    labels = {key: m["label"] for key, m in res["methods"].items()}
    limited = [r for r in report["settings"] if r["rate"] != "unlimited" and r["method"] != "fp32"]
    ratios = np.array([r["ratio"] for r in limited])
    within = int(np.sum(np.abs(ratios - 1) <= bench_net_goals.PREDICTION_TOLERANCE))
    rows = [
        "| processes | rate | fastest method | × dense fp32 (predicted) | × bf16 all-reduce |",
        "|---|---|---|---|---|",
    ]
    for n in sorted({r["workers"] for r in limited}):
        for rate in dict.fromkeys(r["rate"] for r in limited if r["workers"] == n):
            at = [r for r in limited if r["workers"] == n and r["rate"] == rate]
            best = max(at, key=lambda r: r["speedup_fp32"])
            rows.append(
                f"| {n} | {rate} | {labels[best['method']]} | {best['speedup_fp32']:.2f} "
                f"({best['predicted_speedup_fp32']:.2f}) | "
                f"{best.get('speedup_bf16', math.nan):.2f} |"
            )
    first = next((r for r in res["runs"].values() if "parameters" in r), {})
    machine = res["machine"]
    markdown = (
        f"**Measured on a rate-limited network** (`make bench-net`, committed as "
        f"`{MEASURED}.json`; the full table is [{MEASURED}.md]({MEASURED}.md)): "
        f"{', '.join(res['runs'])} `jax.distributed` processes training a "
        f"{first.get('parameters', 0):,}-parameter transformer LM on {machine['cpu']} "
        f"({machine['cpu_count']} cores), one process per worker, the loopback limited by "
        "`tc tbf`. The dots are measured step-time speedups, the lines the same cost model "
        "fitted to that setup (each method's unlimited step plus its compiled collectives' bits "
        "on one shared link):\n\n"
        f"![measured vs predicted speedups]({MEASURED}.png)\n\n"
        + "\n".join(rows)
        + f"\n\nMeasured over predicted speedup: median {np.median(ratios):.2f}, range "
        f"{ratios.min():.2f}–{ratios.max():.2f}; {within} of {len(limited)} rate-limited "
        f"settings within {bench_net_goals.PREDICTION_TOLERANCE:.0%}."
    )
    sentence = (
        f"On a real rate-limited network the model's speedups held: {within} of {len(limited)} "
        f"measured settings within {bench_net_goals.PREDICTION_TOLERANCE:.0%} of the "
        f"prediction (median ratio {np.median(ratios):.2f})."
    )
    return markdown, sentence
