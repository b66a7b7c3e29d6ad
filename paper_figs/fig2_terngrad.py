"""TernGrad against float32 SGD over worker counts, with and without clipping.

The paper: Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to
Reduce Communication in Distributed Deep Learning", NeurIPS 2017.  Trained
with its recipe (layer-wise scalers, gradient clipping to 2.5 standard
deviations, a scaler shared by the workers), TernGrad loses no accuracy
against float32 on AlexNet and under 2% on GoogLeNet, and the clipping is
what makes the ternary gradients' variance tolerable.

What runs: the 64-64-10 MLP on scikit-learn's digits (``digits_mlp``, 16
examples per worker per step, plain SGD) with 2, 4 and 8 workers, each with
``dense()`` (the float32 all-reduce), ``terngrad_allreduce(clip=2.5)`` and
``terngrad_allreduce(clip=None)``; the same seeds, learning rate and steps for
all.  Plotted: test accuracy against steps for every worker count, and the
final accuracy (the mean of the last evaluations, averaged over seeds) with
the gaps to float32.

Criterion: TernGrad with clipping within 2 percentage points of float32 at
every worker count.  Clipping "matters" here if it closes the gap of the
unclipped TernGrad by more than 0.5 points on average over the worker counts.

Writes ``out/fig2_terngrad.png`` and ``out/fig2_terngrad.md``.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
from matplotlib.figure import Figure

from experiments.harness import train
from paper_figs import common

NAME = "fig2_terngrad"
OUT_DIR = common.OUT_DIR
TASK = "digits_mlp"
WORKERS = (2, 4, 8)
LR = 0.1
EVAL_EVERY = 10
#: Final accuracy: the mean test accuracy of this many last evaluations (less noise than one).
LAST_EVALS = 5
#: Criterion: the clipped TernGrad's largest allowed gap to float32 (accuracy, not points).
TOLERANCE = 0.02
#: Clipping matters if it narrows the unclipped gap by more than this on average.
CLIP_MATTERS = 0.005

METHODS = {
    "float32 (dense)": "dense()",
    "TernGrad, clip 2.5σ": "terngrad_allreduce(clip=2.5)",
    "TernGrad, no clipping": "terngrad_allreduce(clip=None)",
}
COLORS = {
    "float32 (dense)": "black",
    "TernGrad, clip 2.5σ": "tab:blue",
    "TernGrad, no clipping": "tab:orange",
}


@dataclasses.dataclass(frozen=True)
class Scale:
    steps: int
    seeds: tuple[int, ...]


def scale() -> Scale:
    """Quick: 300 steps, one seed; ``FULL=1``: 600 steps, three seeds."""
    return Scale(600, (0, 1, 2)) if common.full() else Scale(300, (0,))


def configs(s: Scale) -> list[train.Config]:
    return [
        train.Config(
            task=TASK,
            method=method,
            workers=n,
            steps=s.steps,
            seed=seed,
            lr=LR,
            eval_every=EVAL_EVERY,
        )
        for n in WORKERS
        for method in METHODS.values()
        for seed in s.seeds
    ]


def final_accuracy(run: train.Run, last: int = LAST_EVALS) -> float:
    """Mean test accuracy over the last ``last`` evaluations of ``run``."""
    _, acc = run.column("test_accuracy")
    return float(np.mean(acc[-last:]))


def gaps(table: dict[tuple[str, int], float], baseline: str, method: str) -> dict[int, float]:
    """``baseline - method`` final accuracy at every worker count of ``table``."""
    counts = sorted({n for _, n in table})
    return {n: table[baseline, n] - table[method, n] for n in counts}


def verdict(clip_gaps: dict[int, float], raw_gaps: dict[int, float]) -> str:
    """The verdict sentence from the gaps (in accuracy units) to float32."""
    worst = max(clip_gaps.values())
    benefit = float(np.mean([raw_gaps[n] - clip_gaps[n] for n in clip_gaps]))
    within = worst <= TOLERANCE
    matters = benefit > CLIP_MATTERS
    clip_text = (
        f"clipping narrowed the unclipped TernGrad's gap by {100 * benefit:.2f} points on "
        "average, so it matters here"
        if matters
        else f"clipping changed the gap by only {100 * benefit:+.2f} points on average "
        f"(threshold {100 * CLIP_MATTERS:.1f}): it made no difference at this scale"
    )
    if within and matters:
        head = "Reproduced"
    elif within:
        head = "Partly reproduced"
    else:
        head = "Did not reproduce"
    return (
        f"{head}: TernGrad with clipping is within {100 * worst:.2f} points of float32 at worst "
        f"over {len(clip_gaps)} worker counts (criterion: within {100 * TOLERANCE:.0f} points "
        f"at every count: {'met' if within else 'not met'}); {clip_text}."
    )


def _mean_curve(runs: list[train.Run]) -> tuple[np.ndarray, np.ndarray]:
    steps, _ = runs[0].column("test_accuracy")
    return steps, np.mean([r.column("test_accuracy")[1] for r in runs], axis=0)


def plot(grouped: dict[tuple[str, int], list[train.Run]], table, path: pathlib.Path) -> None:
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    axes = fig.subplots(1, len(WORKERS) + 1)
    for ax, n in zip(axes, WORKERS, strict=False):
        for label in METHODS:
            steps, acc = _mean_curve(grouped[label, n])
            ax.plot(steps, acc, color=COLORS[label], label=label, lw=1.4)
        ax.set_title(f"{n} workers (batch {16 * n})")
        ax.set_xlabel("step")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(loc="lower right", fontsize=8)
    bar = axes[-1]
    width = 0.27
    x = np.arange(len(WORKERS))
    for i, label in enumerate(METHODS):
        values = [100 * table[label, n] for n in WORKERS]
        bar.bar(x + (i - 1) * width, values, width, color=COLORS[label], label=label)
    bar.set_xticks(x, [f"{n} workers" for n in WORKERS])
    low, high = min(table.values()), max(table.values())
    bar.set_ylim(max(0, 100 * low - 4), min(100, 100 * high + 1.5))
    bar.set_ylabel(f"test accuracy (%), last {LAST_EVALS} evals")
    bar.set_title("final accuracy")
    bar.grid(axis="y", alpha=0.3)
    fig.suptitle(f"TernGrad vs float32 SGD, {TASK}", fontsize=11)
    fig.savefig(path, dpi=120)


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    s = scale()
    cfgs = configs(s)
    runs = common.runs(cfgs, NAME)
    labels = {spec: label for label, spec in METHODS.items()}
    grouped: dict[tuple[str, int], list[train.Run]] = {}
    for cfg, run in zip(cfgs, runs, strict=True):
        grouped.setdefault((labels[cfg.method], cfg.workers), []).append(run)
    table = {key: float(np.mean([final_accuracy(r) for r in rs])) for key, rs in grouped.items()}
    dense, clip, raw = METHODS
    clip_gaps = gaps(table, dense, clip)
    raw_gaps = gaps(table, dense, raw)

    figure = out_dir / f"{NAME}.png"
    plot(grouped, table, figure)

    any_run = {label: grouped[label, WORKERS[0]][0] for label in METHODS}
    dense_bits = any_run[dense].info["dense_bits"]
    tern = any_run[clip].info["steady_bits"]
    tern_bits = tern["allreduce"] + tern["allgather"]
    rows = [
        "| workers | float32 | TernGrad, clip 2.5σ (gap) | TernGrad, no clip (gap) |",
        "|---|---|---|---|",
    ]
    for n in WORKERS:
        rows.append(
            f"| {n} | {100 * table[dense, n]:.2f}% | {100 * table[clip, n]:.2f}% "
            f"({100 * clip_gaps[n]:+.2f}) | {100 * table[raw, n]:.2f}% ({100 * raw_gaps[n]:+.2f}) |"
        )
    measured = (
        f"Final test accuracy (mean of the last {LAST_EVALS} evaluations, every {EVAL_EVERY} "
        f"steps; mean over {len(s.seeds)} seed(s)); gap = float32 minus TernGrad, in points.\n\n"
        + "\n".join(rows)
        + f"\n\nBits per worker per step: float32 {dense_bits}, TernGrad {tern_bits} "
        f"({dense_bits / tern_bits:.1f}x less; int8 ternaries summed by all-reduce plus one "
        "shared float32 scaler per layer)."
    )
    setting = (
        f"`{TASK}` (MLP 64-64-10, scikit-learn digits, 16 examples per worker per step), "
        f"workers {', '.join(map(str, WORKERS))}, {s.steps} steps of SGD (lr {LR}, no momentum), "
        f"seeds {', '.join(map(str, s.seeds))}; methods "
        + ", ".join(f"`{m}`" for m in METHODS.values())
        + "."
    )
    section = common.section(
        NAME,
        "TernGrad: accuracy against float32 over worker counts (Wen et al. 2017)",
        claim=(
            "TernGrad (ternary gradients with layer-wise scalers, 2.5σ clipping and a shared "
            "scaler) loses no accuracy against float32 on AlexNet and under 2% on GoogLeNet; "
            "gradient clipping is needed for it."
        ),
        setting=setting,
        measured=measured,
        verdict=verdict(clip_gaps, raw_gaps),
        out_dir=out_dir,
    )
    return [figure, section]


if __name__ == "__main__":
    for output in main():
        print(output)
