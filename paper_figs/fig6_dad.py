"""Figure 6: dAD and rank-dAD against PowerSGD at equal rank (accuracy per bit).

Paper: Baker, Calhoun, Pearlmutter, Plis, "Peering Beyond the Gradient Veil
with Distributed Auto Differentiation" (dAD), 2021.  Their claims: dAD (every
site all-gathers the inputs ``A_s`` and output cotangents ``Delta_s`` of each
linear layer and forms ``[Delta]^T [A]``) is exactly pooled SGD; rank-dAD
(each site sends rank-``r`` factors of ``Delta_s^T A_s`` from a few power
iterations) is more accurate per bit than PowerSGD at the same rank.

What runs: the harness's ``mnist1d_mlp`` task (MLP 40-128-128-10 on
MNIST-1D) over 8 workers with a small per-worker batch (dAD sends
``rows (in + out)`` floats per layer instead of ``in x out``, so it saves bits
only for small local batches), SGD with momentum after the exchange, one
learning rate for all methods; methods ``dense()``, ``dad()``,
``rank_dad(rank=r)`` and ``powersgd(rank=r)`` for ``r`` in (1, 2, 4).
Test accuracy against cumulative bits per worker and against steps;
dAD's minibatch-loss curve is compared with ``dense()``'s step by step.
rank-dAD has no error feedback (as in the paper), so the like-for-like
comparison at equal rank is PowerSGD *without* its error memory
(``powersgd(rank=r, error_feedback=False)``); PowerSGD with its memory (the
paper's PowerSGD) is reported beside it.

Statistics (stated before the run): for each seed, rank-dAD's final test
accuracy minus PowerSGD's accuracy at the moment PowerSGD had sent as many
bits (its final accuracy if it sent fewer in all); the mean over seeds with
a two-sided 95% Student-t interval.  rank-dAD is better per bit at rank
``r`` when the interval lies above 0, worse when below, otherwise no
difference is detected.  Seeds: 2 in quick mode, 5 with ``FULL=1``.

dAD's exactness: the criterion stated before the first full-mode run was
dAD's minibatch loss within ``EXACT_TOL`` of ``dense()``'s at every step.
That run (2000 steps) missed it in every seed: the two curves agree to
float32 rounding (gaps of 0 to 1e-7) for hundreds of steps, then the gap
grows tenfold every few dozen steps to the spread of two unrelated runs.
That is the training's sensitivity amplifying rounding, not dAD: so the
criterion was amended after that run.  A rounding control now runs with
it: ``dense()`` at the next float32 learning rate above ``LR`` (one ulp).
dAD is exact when, in every seed, its loss stays within ``EXACT_TOL`` of
``dense()``'s for as long as the control's does in the seed where the
control leaves first (a wrong gradient shows within a few steps).

Writes ``out/fig6_dad.png`` and ``out/fig6_dad.md``.
"""

from __future__ import annotations

import pathlib

import numpy as np
from matplotlib.figure import Figure

from experiments.harness import train
from paper_figs import common

NAME = "fig6_dad"
OUT_DIR = common.OUT_DIR
TASK = "mnist1d_mlp"
WORKERS = 8
BATCH = 8
LR = 0.05
MOMENTUM = 0.9
RANKS = (1, 2, 4)
# dAD is exact pooled SGD: its loss curve must follow dense()'s up to float32 rounding.
EXACT_TOL = 1e-3
#: The rounding control's learning rate: the next float32 above LR.
TWIN_LR = float(np.nextafter(np.float32(LR), np.float32(1.0)))
#: The rounding control's label (it runs ``dense()`` at ``TWIN_LR``).
TWIN = "dense(), lr + 1 ulp"


def _settings() -> tuple[int, tuple[int, ...], int]:
    """``(steps, seeds, eval_every)``."""
    if common.full():
        return 2000, (0, 1, 2, 3, 4), 50
    return 600, (0, 1), 50


def rank_dad(r: int) -> str:
    return f"rank_dad(rank={r})"


def powersgd(r: int, error_feedback: bool = True) -> str:
    return f"powersgd(rank={r})" if error_feedback else f"powersgd(rank={r}, error_feedback=False)"


def methods() -> list[str]:
    return [
        "dense()",
        "dad()",
        *[rank_dad(r) for r in RANKS],
        *[powersgd(r) for r in RANKS],
        *[powersgd(r, error_feedback=False) for r in RANKS],
    ]


def configs(steps: int, seeds, eval_every: int) -> list[tuple[str, train.Config]]:
    """``(label, config)`` of every run: each method's label is its expression, then
    the rounding control :data:`TWIN`."""
    runs = [(m, m, LR) for m in methods()] + [(TWIN, "dense()", TWIN_LR)]
    return [
        (
            label,
            train.Config(
                task=TASK,
                method=m,
                workers=WORKERS,
                steps=steps,
                seed=seed,
                lr=lr,
                momentum=MOMENTUM,
                batch_size=BATCH,
                eval_every=eval_every,
            ),
        )
        for seed in seeds
        for label, m, lr in runs
    ]


# --- summaries -----------------------------------------------------------------------


def loss_gaps(a: train.Run, b: train.Run) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, |loss_a - loss_b|)`` over the steps both runs logged (minibatch losses)."""
    sa, la = a.column("loss")
    sb, lb = b.column("loss")
    common_steps, ia, ib = np.intersect1d(sa, sb, return_indices=True)
    if common_steps.size == 0:
        raise ValueError("the runs share no logged step")
    return common_steps, np.abs(la[ia] - lb[ib])


def max_loss_gap(a: train.Run, b: train.Run) -> float:
    """Largest ``|loss_a - loss_b|`` over the steps both runs logged (minibatch losses)."""
    return float(np.max(loss_gaps(a, b)[1]))


def first_divergence(a: train.Run, b: train.Run, tol: float = EXACT_TOL) -> int | None:
    """The first logged step where the runs' losses differ by more than ``tol``; ``None``
    when they never do."""
    steps, gaps = loss_gaps(a, b)
    over = np.flatnonzero(gaps > tol)
    return int(steps[over[0]]) if over.size else None


def exact_window(twin_divergences: list[int | None], steps: int) -> int:
    """Steps over which dAD must follow ``dense()``: until the rounding control first
    leaves it in any seed (all ``steps`` when it never does)."""
    return min((d for d in twin_divergences if d is not None), default=steps + 1) - 1


def exact_within(divergences: list[int | None], window: int) -> bool:
    """Whether every seed's loss stayed within the tolerance for the first ``window`` steps."""
    return all(d is None or d > window for d in divergences)


def accuracy_at_bits(run: train.Run, bits: float) -> float | None:
    """Test accuracy of ``run`` when it had sent ``bits`` per worker (linear between
    evaluations); ``None`` beyond what it sent in total."""
    steps, acc = run.column("test_accuracy")
    cum_steps, cum = run.column("cum_bits")
    sent = np.interp(steps, np.concatenate([[0], cum_steps]), np.concatenate([[0.0], cum]))
    if bits > sent[-1]:
        return None
    return float(np.interp(bits, sent, acc))


def _mean_final(runs: list[train.Run], key: str) -> float:
    return float(np.mean([r.final[key] for r in runs]))


def paired_per_bit(ours: list[train.Run], theirs: list[train.Run]) -> list[float]:
    """Per seed: ``ours``' final test accuracy minus ``theirs``' when it had sent as many
    bits (its final accuracy if it sent fewer in all)."""
    diffs = []
    for a, b in zip(ours, theirs, strict=True):
        at = accuracy_at_bits(b, a.final["cum_bits"])
        diffs.append(a.final["test_accuracy"] - (b.final["test_accuracy"] if at is None else at))
    return diffs


# --- figure --------------------------------------------------------------------------

COLORS = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}


def _style(method: str) -> dict:
    if method == "dense()":
        return {"color": "black", "lw": 2.5, "label": "dense() (pooled SGD)"}
    if method == "dad()":
        return {"color": "tab:red", "ls": ":", "lw": 2.5, "label": "dAD"}
    rank = int(method.split("rank=")[1].split(",")[0].rstrip(")"))
    if method.startswith("rank_dad"):
        return {"color": COLORS[rank], "ls": "-", "label": f"rank-dAD, r={rank}"}
    if "error_feedback=False" in method:
        return {"color": COLORS[rank], "ls": ":", "label": f"PowerSGD, r={rank}, no EF"}
    return {"color": COLORS[rank], "ls": "--", "label": f"PowerSGD, r={rank} (EF)"}


def plot(
    by_method: dict[str, list[train.Run]],
    twins: list[train.Run],
    path: pathlib.Path,
    title: str,
) -> None:
    fig = Figure(figsize=(16, 5), layout="constrained")
    ax_bits, ax_steps, ax_gap = fig.subplots(1, 3)
    for method, runs in by_method.items():
        run = runs[0]
        steps, acc = run.column("test_accuracy")
        bits = np.interp(steps, *run.column("cum_bits"))
        style = _style(method)
        ax_bits.plot(np.maximum(bits, 1.0)[1:], acc[1:], **style)
        ax_steps.plot(steps, acc, **style)
    ax_bits.set_xscale("log")
    ax_bits.set_xlabel("cumulative bits sent per worker")
    ax_bits.set_ylabel("test accuracy")
    ax_bits.set_title("accuracy vs communication")
    ax_steps.set_xlabel("step")
    ax_steps.set_title("accuracy vs steps")
    ax_bits.legend(fontsize=8, loc="upper left")
    dense = by_method["dense()"][0]
    for other, color, label in (
        (by_method["dad()"][0], "tab:red", "dAD"),
        (twins[0], "gray", "dense at lr + 1 ulp (rounding control)"),
    ):
        s, gap = loss_gaps(dense, other)
        ax_gap.semilogy(s, np.maximum(gap, 1e-9), color=color, lw=0.8, label=label)
    ax_gap.axhline(EXACT_TOL, color="black", ls="--", lw=1, label=f"tolerance {EXACT_TOL:g}")
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("|minibatch loss - dense's| (floor 1e-9)")
    ax_gap.set_title("dAD is pooled SGD: loss difference per step")
    ax_gap.legend(fontsize=8)
    for ax in (ax_bits, ax_steps, ax_gap):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def divergence_note(
    dad_div: list[int | None], twin_div: list[int | None], seeds, window: int
) -> str:
    """The seeds where dAD left ``dense()`` inside the window, and how often it left at the
    very step the rounding control did."""
    early = [
        f"seed {seed} at step {d}"
        for seed, d in zip(seeds, dad_div, strict=True)
        if d is not None and d <= window
    ]
    same = sum(d is not None and d == t for d, t in zip(dad_div, twin_div, strict=True))
    text = f" ({', '.join(early)})" if early else ""
    if all(d is None for d in (*dad_div, *twin_div)):
        return text + "; neither dAD nor the control ever leaves it"
    return text + (
        f"; in {same} of {len(seeds)} seeds dAD and the control leave dense() at the same step"
    )


def outcome_text(outcome: str) -> str:
    return {
        "higher": "rank-dAD better",
        "lower": "PowerSGD better",
        "no difference": "no difference detected",
    }[outcome]


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Run (or read) the runs, plot, write the section; returns the PNG and MD paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps, seeds, eval_every = _settings()
    labelled = configs(steps, seeds, eval_every)
    results = common.runs([cfg for _, cfg in labelled], NAME)
    by_method: dict[str, list[train.Run]] = {m: [] for m in methods()}
    twins: list[train.Run] = []
    for (label, _), run in zip(labelled, results, strict=True):
        (twins if label == TWIN else by_method[label]).append(run)

    dense_runs, dad_runs = by_method["dense()"], by_method["dad()"]
    gap = max(max_loss_gap(d, p) for d, p in zip(dense_runs, dad_runs, strict=True))
    dad_div = [first_divergence(d, p) for d, p in zip(dense_runs, dad_runs, strict=True)]
    twin_div = [first_divergence(d, t) for d, t in zip(dense_runs, twins, strict=True)]
    window = exact_window(twin_div, steps)
    exact = exact_within(dad_div, window)
    acc_gap = common.mean_ci95(
        [
            p.final["test_accuracy"] - d.final["test_accuracy"]
            for d, p in zip(dense_runs, dad_runs, strict=True)
        ]
    )
    rows = []
    for m in methods():
        runs = by_method[m]
        acc = _mean_final(runs, "test_accuracy")
        bits = _mean_final(runs, "cum_bits")
        per_step = runs[0].info["steady_bits"]
        rows.append((m, acc, bits, per_step))
    dense_bits = rows[0][2]
    table = [
        "| method | bits/step/worker (all-reduce + all-gather) | total bits/worker "
        "| vs dense | final test acc. | final train objective |",
        "|---|---|---|---|---|---|",
    ]
    for (m, acc, bits, per_step), runs in zip(rows, by_method.values(), strict=True):
        obj = _mean_final(runs, "objective")
        ratio = "baseline" if m == "dense()" else f"{dense_bits / bits:.1f}x fewer"
        table.append(
            f"| `{m}` | {per_step['allreduce']:,.0f} + {per_step['allgather']:,.0f} "
            f"| {bits:.3g} | {ratio} | {acc:.1%} | {obj:.3f} |"
        )
    acc_of = {m: (a, b) for m, a, b, _ in rows}
    comparisons, wins, losses = [], 0, 0
    for r in RANKS:
        parts = []
        for ef in (False, True):
            diffs = paired_per_bit(by_method[rank_dad(r)], by_method[powersgd(r, ef)])
            mean, half = common.mean_ci95(diffs)
            outcome = common.ci_verdict(mean, half)
            if not ef:
                wins += outcome == "higher"
                losses += outcome == "lower"
            parts.append(
                f"vs PowerSGD {'with' if ef else 'without'} EF {100 * mean:+.1f} ± "
                f"{100 * half:.1f} points ({outcome_text(outcome)})"
            )
        comparisons.append(f"r={r}: rank-dAD " + ", ".join(parts))
    dad_acc, dense_acc = acc_of["dad()"][0], acc_of["dense()"][0]

    def steps_text(divergences: list[int | None]) -> str:
        return ", ".join("never" if d is None else str(d) for d in divergences)

    measured = (
        "Final values (mean over seeds):\n\n"
        + "\n".join(table)
        + f"\n\ndAD vs dense(): largest |minibatch loss difference| over {steps} steps "
        f"{gap:.2e}. First step with a difference over {EXACT_TOL:g}, by seed: dAD "
        f"{steps_text(dad_div)}; the rounding control (dense() at lr {TWIN_LR!r}, the next "
        f"float32 above {LR}) {steps_text(twin_div)}. Final test accuracy {dad_acc:.1%} vs "
        f"{dense_acc:.1%} (dAD minus dense {100 * acc_gap[0]:+.1f} ± {100 * acc_gap[1]:.1f} "
        f"points), dAD sending {acc_of['dad()'][1] / dense_bits:.2f} of dense's bits. "
        + "Per bit at equal rank (rank-dAD's final accuracy minus PowerSGD's at the same bits, "
        f"mean ± 95% interval over {len(seeds)} seeds): " + "; ".join(comparisons) + "."
    )
    if exact and wins == len(RANKS):
        verdict = "Reproduced"
    elif exact or wins:
        verdict = "Partly reproduced"
    else:
        verdict = "Did not reproduce"
    verdict += (
        f" (criteria: dAD's loss curve within {EXACT_TOL:g} of dense()'s for as long as the "
        "rounding control's, in every seed, and at every rank the 95% interval of rank-dAD's "
        "per-bit advantage over PowerSGD without error feedback above 0; the first criterion "
        f"was amended after the first full-mode run, which asked for {EXACT_TOL:g} at every "
        "one of 2000 steps and missed it in every seed, as the control does). dAD "
        + ("matches" if exact else "does not match")
        + f" pooled SGD over the first {window} steps"
        + (
            ", where the control leaves it first"
            if any(t is not None for t in twin_div)
            else " (all of them)"
        )
        + divergence_note(dad_div, twin_div, seeds, window)
        + f"; rank-dAD is better per bit at {wins} of "
        f"{len(RANKS)} ranks and worse at {losses} (no difference detected at the rest), "
        f"over {len(seeds)} seeds; the test set has 1000 examples."
    )
    setting = (
        f"Task `{TASK}` (MLP 40-128-128-10, MNIST-1D, 4000 train / 1000 test), {WORKERS} "
        f"workers, {BATCH} examples per worker per step ({BATCH * WORKERS} pooled), {steps} "
        f"steps, SGD lr {LR} with momentum {MOMENTUM} after the exchange for every method, "
        f"seeds {', '.join(map(str, seeds))}, evaluation every {eval_every} steps. Bits are "
        "the harness's per-worker message sizes (dAD and rank-dAD all-gather, PowerSGD and "
        "dense all-reduce); rank-dAD uses 2 power iterations; PowerSGD with and without its "
        f"error memory. Rounding control: dense() at lr {TWIN_LR!r}, one float32 ulp above "
        f"{LR}."
    )
    figure = out_dir / f"{NAME}.png"
    plot(
        by_method,
        twins,
        figure,
        f"dAD / rank-dAD vs PowerSGD on {TASK}, {WORKERS} workers x {BATCH} examples, "
        f"seed {seeds[0]}",
    )
    md = common.section(
        NAME,
        "dAD and rank-dAD vs PowerSGD",
        claim=(
            "dAD reproduces pooled (centralised) SGD exactly; rank-dAD is more accurate per "
            "bit than PowerSGD at the same rank (Baker et al. 2021)."
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
