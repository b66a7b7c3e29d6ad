"""TernGrad's gradient clipping on a model whose gradients are heavy-tailed.

The paper: Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to
Reduce Communication in Distributed Deep Learning", NeurIPS 2017.  The
ternary gradient's variance grows with the layer's largest entry
(``s ||g||_1 - ||g||^2`` with ``s = max |g|``), and the paper's gradients are
heavy-tailed (a few entries far out in the tails), so it clips every layer to
2.5 standard deviations before ternarising: that keeps the variance small at
the cost of a small bias, and it is needed for TernGrad to match float32.
Figure 2 runs the recipe on a 64-64-10 MLP, where clipping made no
difference; this figure gives it the tails it is for.

What runs:

1. **The tails**, measured: one worker's minibatch gradient at the
   initialisation of ``digits_mlp``, ``mnist1d_wide`` and ``char_lm``.  Per
   leaf of at least 1024 entries: the excess kurtosis (0 for a Gaussian), the
   largest entry in standard deviations, and the ternary compressor's mean
   squared error against the gradient without clipping (its variance) over
   the same with clipping at 2.5 sigma (variance plus the clipping's squared
   bias).  That ratio is how much noise clipping removes.
2. **Training**: ``mnist1d_wide`` (1.33M parameters, the heaviest tails), the
   settings of figure 3b (8 workers x 32 examples, the task's learning rate
   tuned for dense SGD on the validation split, momentum 0.9 in the SGD that
   follows the exchange, the same seeds and steps, so the dense runs are
   shared), with ``dense()``, ``terngrad_allreduce(clip=2.5)`` and
   ``terngrad_allreduce(clip=None)`` (both with the shared scaler); with
   ``FULL=1`` also the unclipped TernGrad at a quarter of the learning rate,
   to ask whether a smaller step does the clipping's job.

Criteria (stated before the run), on the test accuracy (the mean of the last
evaluations), paired by seed, 95% Student-t intervals: TernGrad with
clipping is within 2 points of float32 (the interval of ``dense - clipped``
lies below 2 points), and clipping helps (the interval of ``clipped -
unclipped`` lies above 0).  Reproduced when both hold, partly when one does.

Writes ``out/fig2_terngrad_scale.png`` and ``out/fig2_terngrad_scale.md``.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure
from scipy import stats

from compjax.compressors.terngrad import clip_to_std
from experiments.harness import tasks, train
from experiments.harness.config import Config
from experiments.harness.problem import Problem
from paper_figs import common
from paper_figs.fig3_dgc import LAST_EVALS, tail_mean
from paper_figs.fig3_dgc_scale import BATCH, EVAL_EVERY, MOMENTUM, WORKERS, scale

NAME = "fig2_terngrad_scale"
OUT_DIR = common.OUT_DIR
TASK = "mnist1d_wide"
CLIP = 2.5
#: The tasks whose gradient tails are measured, with their examples per worker.
TAIL_TASKS = {"digits_mlp": 16, "mnist1d_wide": 32, "char_lm": 4}
#: Leaves smaller than this are left out of the tail statistics (biases, norms).
MIN_LEAF = 1024
#: Criteria: the clipped TernGrad's largest allowed gap to float32 (accuracy).
TOLERANCE = 0.02

#: label -> (method, learning rate over the task's).
METHODS = {
    "float32 (dense)": ("dense()", 1.0),
    "TernGrad, clip 2.5σ": (f"terngrad_allreduce(clip={CLIP})", 1.0),
    "TernGrad, no clipping": ("terngrad_allreduce(clip=None)", 1.0),
}
#: ``FULL=1`` also asks whether a smaller step does clipping's job.
SMALLER_STEP = {"TernGrad, no clipping, lr / 4": ("terngrad_allreduce(clip=None)", 0.25)}
COLORS = ("black", "tab:blue", "tab:orange", "tab:red")


def methods() -> dict[str, tuple[str, float]]:
    return METHODS | SMALLER_STEP if common.full() else METHODS


@dataclasses.dataclass(frozen=True)
class Tails:
    """The gradient tail statistics of one task (see the module docstring)."""

    task: str
    leaves: int
    entries: int
    kurtosis: float  # entry-weighted mean of the leaves' excess kurtosis
    max_sigmas: float  # the largest |g| / sigma over the leaves
    beyond: float  # fraction of entries beyond CLIP sigma
    noise_ratio: float  # ternary MSE without clipping / with clipping (summed over leaves)
    normalised: np.ndarray  # g / sigma of the largest leaf, for the histogram


def ternary_mse(g: np.ndarray, y: np.ndarray) -> float:
    """Mean squared error of TernGrad's unbiased ternary of ``y`` (scaler ``max |y|``)
    against ``g``: its variance ``s ||y||_1 - ||y||^2`` plus the bias ``||g - y||^2``."""
    g, y = g.astype(np.float64), y.astype(np.float64)
    s = np.abs(y).max()
    return float(s * np.abs(y).sum() - (y**2).sum() + ((g - y) ** 2).sum())


def gradient_tails(task: str, batch: int, seed: int = 0) -> Tails:
    """Tail statistics of one worker's minibatch gradient at ``task``'s initialisation."""
    problem = Problem(
        Config(task=task, method="dense()", workers=WORKERS, steps=1, seed=seed, batch_size=batch)
    )
    x, y = problem.x[0, :batch], problem.y[0, :batch]
    grads = jax.grad(lambda p: problem.loss(p, (x, y)))(problem.params)
    leaves = [np.asarray(g).ravel() for g in jax.tree.leaves(grads) if g.size >= MIN_LEAF]
    sizes = np.array([g.size for g in leaves])
    sigmas = [g.std() for g in leaves]
    raw = sum(ternary_mse(g, g) for g in leaves)
    clipped = sum(ternary_mse(g, np.asarray(clip_to_std(jnp.asarray(g), CLIP))) for g in leaves)
    largest = int(np.argmax(sizes))
    return Tails(
        task=task,
        leaves=len(leaves),
        entries=int(sizes.sum()),
        kurtosis=float(np.average([stats.kurtosis(g) for g in leaves], weights=sizes)),
        max_sigmas=float(max(np.abs(g).max() / s for g, s in zip(leaves, sigmas, strict=True))),
        beyond=float(sum(np.sum(np.abs(g) > CLIP * s) for g, s in zip(leaves, sigmas, strict=True)))
        / sizes.sum(),
        noise_ratio=raw / clipped,
        normalised=leaves[largest] / sigmas[largest],
    )


def configs(steps: int, seeds: tuple[int, ...]) -> list[train.Config]:
    lr = tasks.get(TASK).lr
    return [
        train.Config(
            task=TASK,
            method=method,
            workers=WORKERS,
            steps=steps,
            seed=seed,
            lr=lr * factor,
            momentum=MOMENTUM,
            batch_size=BATCH,
            eval_every=EVAL_EVERY,
        )
        for method, factor in methods().values()
        for seed in seeds
    ]


def diverged_at(run: train.Run) -> int | None:
    """The first evaluated step whose training objective is not finite, if any."""
    steps, objective = run.column("objective")
    bad = steps[~np.isfinite(objective)]
    return int(bad[0]) if bad.size else None


def verdict(gap: tuple[float, float], helps: tuple[float, float]) -> str:
    """The verdict from the paired intervals of ``dense - clipped`` and ``clipped - raw``."""
    within = gap[0] + gap[1] < TOLERANCE
    matters = helps[0] - helps[1] > 0
    head = (
        "Reproduced"
        if within and matters
        else ("Partly reproduced" if within or matters else "Did not reproduce")
    )
    return (
        f"{head} (criteria: the 95% interval of dense minus clipped TernGrad below "
        f"{100 * TOLERANCE:.0f} points; the interval of clipped minus unclipped above 0). "
        f"Gap to float32 {100 * gap[0]:+.2f} ± {100 * gap[1]:.2f} points "
        f"({'met' if within else 'not met'}); clipping's gain {100 * helps[0]:+.2f} ± "
        f"{100 * helps[1]:.2f} points ({'met' if matters else 'not met'})."
    )


def plot(tails: list[Tails], grouped: dict[str, list[train.Run]], path: pathlib.Path) -> None:
    fig = Figure(figsize=(13, 3.9), layout="constrained")
    ax_hist, ax_acc, ax_bar = fig.subplots(1, 3)
    bins = np.linspace(-20, 20, 161)
    for t in tails:
        density, edges = np.histogram(np.clip(t.normalised, -20, 20), bins=bins, density=True)
        ax_hist.stairs(density, edges, label=f"{t.task} (kurtosis {t.kurtosis:.1f})")
    grid = np.linspace(-20, 20, 400)
    ax_hist.plot(grid, stats.norm.pdf(grid), "k:", lw=1, label="Gaussian")
    for side in (-CLIP, CLIP):
        ax_hist.axvline(side, color="grey", lw=0.8, ls="--")
    ax_hist.set_yscale("log")
    ax_hist.set_ylim(1e-6, 2)
    ax_hist.set_xlabel("gradient entry / its layer's σ (largest layer, at init)")
    ax_hist.set_ylabel("density")
    ax_hist.legend(fontsize=7)
    finals = {}
    for (label, runs), color in zip(grouped.items(), COLORS, strict=False):
        steps, _ = runs[0].column("test_accuracy")
        curve = np.mean([r.column("test_accuracy")[1] for r in runs], axis=0)
        ax_acc.plot(steps, curve, color=color, label=label, lw=1.4)
        finals[label] = common.mean_ci95([tail_mean(r, "test_accuracy") for r in runs])
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("test accuracy (mean over seeds)")
    ax_acc.set_ylim(0.3, 1.0)
    ax_acc.legend(fontsize=8, loc="lower right")
    x = np.arange(len(finals))
    means = [100 * m for m, _ in finals.values()]
    halves = [100 * h if np.isfinite(h) else 0.0 for _, h in finals.values()]
    ax_bar.bar(x, means, yerr=halves, color=COLORS[: len(x)], capsize=4)
    ax_bar.set_xticks(x, [label.replace(", ", "\n") for label in finals], fontsize=8)
    ax_bar.set_ylim(max(0, min(means) - 8), min(100, max(means) + 3))
    ax_bar.set_ylabel("final test accuracy (%), 95% interval")
    for ax in (ax_hist, ax_acc, ax_bar):
        ax.grid(alpha=0.3)
    fig.suptitle(f"TernGrad's clipping on heavy-tailed gradients: {TASK}, {WORKERS} workers")
    fig.savefig(path, dpi=120)


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    s = scale()
    tails = [gradient_tails(task, batch) for task, batch in TAIL_TASKS.items()]
    cfgs = configs(s.steps, s.seeds)
    runs = common.runs(cfgs, NAME)
    grouped: dict[str, list[train.Run]] = {}
    per_method = len(s.seeds)
    for i, label in enumerate(methods()):
        grouped[label] = runs[i * per_method : (i + 1) * per_method]
    finals = {
        label: [tail_mean(r, "test_accuracy") for r in group] for label, group in grouped.items()
    }
    dense, clipped, raw = (finals[label] for label in METHODS)
    gap = common.mean_ci95(np.subtract(dense, clipped))
    helps = common.mean_ci95(np.subtract(clipped, raw))
    figure = out_dir / f"{NAME}.png"
    plot(tails, grouped, figure)

    tail_rows = [
        "| task | leaves (entries) | excess kurtosis | largest entry | beyond 2.5σ | "
        "ternary MSE, no clip / clip |",
        "|---|---|---|---|---|---|",
    ] + [
        f"| `{t.task}` | {t.leaves} ({t.entries:,}) | {t.kurtosis:.1f} | {t.max_sigmas:.1f}σ | "
        f"{100 * t.beyond:.1f}% | {t.noise_ratio:.1f}x |"
        for t in tails
    ]
    run_rows = [
        "| method | lr | test accuracy (per seed) | mean ± 95% | diverged (loss not finite) |",
        "|---|---|---|---|---|",
    ]
    for (label, values), (_, factor) in zip(finals.items(), methods().values(), strict=True):
        mean, half = common.mean_ci95(values)
        per_seed = ", ".join(f"{100 * v:.2f}%" for v in values)
        blown = [diverged_at(r) for r in grouped[label]]
        blown_text = (
            ", ".join("—" if b is None else f"by step {b}" for b in blown)
            if any(b is not None for b in blown)
            else "no"
        )
        run_rows.append(
            f"| {label} | {factor * tasks.get(TASK).lr:g} | {per_seed} | "
            f"{100 * mean:.2f} ± {100 * half:.2f} | {blown_text} |"
        )
    steady = grouped["TernGrad, clip 2.5σ"][0].info["steady_bits"]
    dense_bits = grouped["float32 (dense)"][0].info["dense_bits"]
    measured = (
        "Gradient tails at initialisation (one worker's minibatch; leaves of at least "
        f"{MIN_LEAF} entries; kurtosis weighted by entries):\n\n"
        + "\n".join(tail_rows)
        + f"\n\nTraining on `{TASK}` (accuracy: the mean of the last {LAST_EVALS} evaluations, "
        f"every {EVAL_EVERY} steps):\n\n"
        + "\n".join(run_rows)
        + f"\n\nPaired by seed: dense minus clipped TernGrad {100 * gap[0]:+.2f} ± "
        f"{100 * gap[1]:.2f} points; clipped minus unclipped {100 * helps[0]:+.2f} ± "
        f"{100 * helps[1]:.2f} points (95% intervals, {len(s.seeds)} seeds). Bits per worker "
        f"per step: float32 {dense_bits:,}, TernGrad {sum(steady.values()):,} "
        f"({dense_bits / sum(steady.values()):.1f}x less)."
    )
    for label in SMALLER_STEP.keys() & finals.keys():
        mean, half = common.mean_ci95(np.subtract(clipped, finals[label]))
        measured += (
            f" Clipped TernGrad minus unclipped at lr / 4: {100 * mean:+.2f} ± {100 * half:.2f} "
            "points (whether a smaller step does clipping's job)."
        )
    setting = (
        f"Tails: `{'`, `'.join(TAIL_TASKS)}` at seed 0. Training: `{TASK}` "
        f"({tasks.get(TASK).description}), {WORKERS} workers x {BATCH} examples, {s.steps} "
        f"steps, lr {tasks.get(TASK).lr} (the task's, tuned for dense on the validation split), "
        f"momentum {MOMENTUM} after the exchange, seeds {', '.join(map(str, s.seeds))}; "
        "methods " + ", ".join(f"`{m}` (lr x{f:g})" for m, f in methods().values()) + "."
    )
    section = common.section(
        NAME,
        "TernGrad's clipping on heavy-tailed gradients (Wen et al. 2017)",
        claim=(
            "Gradients are heavy-tailed, so a ternary gradient scaled by the layer's largest "
            "entry is noisy; clipping each layer to 2.5σ before ternarising removes most of that "
            "noise at the cost of a small bias, and TernGrad with it matches float32."
        ),
        setting=setting,
        measured=measured,
        verdict=verdict(gap, helps),
        out_dir=out_dir,
    )
    return [figure, section]


if __name__ == "__main__":
    for output in main():
        print(output)
