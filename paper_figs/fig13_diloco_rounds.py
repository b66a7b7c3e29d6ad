"""Figure 13 with enough rounds: DiLoCo and SparseLoCo against data parallel over 64 to 320
outer rounds, and the final loss against ``H`` at a fixed token budget.

The papers: as :mod:`paper_figs.fig13_diloco` (Douillard et al., "DiLoCo",
arXiv 2311.08105, 2023; Jaghouar et al., "INTELLECT-1", arXiv 2412.01152;
Douillard et al., "Streaming DiLoCo", arXiv 2501.18512; Sarfi et al.,
"SparseLoCo", arXiv 2508.15706).  DiLoCo's paper runs hundreds of outer rounds
(88k steps at H = 500) and shows DiLoCo starting behind data parallel and
catching up; its figure of the final perplexity against ``H`` at a fixed budget
rises slowly with ``H``.  :mod:`paper_figs.fig13_diloco` ran 4 to 40 rounds,
which tests only the start.

What runs: the same driver as :mod:`paper_figs.fig13_diloco` (4 workers under
``jax.vmap``, i.i.d. shards of Python's pydoc prose, 4 sequences of 64
characters per worker per step, every method on the same tokens, inner AdamW
with weight decay 0.1, 40 warm-up steps and a cosine decay to a tenth), on a
narrower transformer (2 blocks of width ``WIDTH = 64``, 117k parameters, 20 to
25 ms a step of the 4 workers here instead of 46 to 55) for ``STEPS = 1600``
steps (1.64M characters, 4.4 passes over the training text):

* data parallel (the float32 mean gradient into AdamW every step);
* DiLoCo (outer Nesterov SGD, lr 0.7, momentum 0.9) with exact, int8 and MXFP4
  pseudo-gradients, and SparseLoCo at its defaults, at ``H`` in
  ``SYNC_EVERY = (5, 10, 25)``: 320, 160 and 64 outer rounds; the final loss
  against ``H`` at this fixed token budget is the paper's shape.  (Exact DiLoCo
  at ``H = 50`` and ``100``, 32 and 16 rounds, was planned for that panel as
  well and dropped to keep the compute within the issue's budget.)

Every configuration's peak learning rate is swept on the validation split
(seed ``SWEEP_SEED``) as in :mod:`paper_figs.fig13_diloco`: ``(1e-3, 3e-3,
1e-2)``, then one more rung of the ladder while the best is at an end.  Then 3
seeds at the chosen rate.

Criterion (fixed before the runs, written here on 2026-11-29 before any of
them): for each configuration with at least ``MIN_ROUNDS = 64`` outer rounds,
the relative gap of its final validation loss to data parallel's, paired by
seed, ``L / L_dp - 1``, with a 95% Student-t interval over the 3 seeds.
*Reproduced* if some DiLoCo or SparseLoCo configuration sending at least 100x
fewer bits per step than data parallel (ring traffic leaving one worker, the
per-step non-finite flag included) has that interval entirely below +3%;
*partly reproduced* if only its mean is below +3%; otherwise *did not
reproduce*.

Each run is kept in ``results/fig13_diloco_rounds.json`` as it finishes and
reused by later calls (the runs are deterministic; ``--fresh`` ignores them), so
the 2-core machine's hour can be spread over sittings.  ``FULL=1 python -m
paper_figs fig13_diloco_rounds``; without ``FULL`` a quick check (200 steps,
H = 5, one seed, the rate unswept).  Writes ``out/fig13_diloco_rounds.png`` and
``.md``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from paper_figs import common
from paper_figs import fig13_diloco as base
from paper_figs.fig13_diloco import Method, Result, bits_per_char, interval

NAME = "fig13_diloco_rounds"
OUT_DIR = common.OUT_DIR
WIDTH = 64
STEPS = 1600
SYNC_EVERY = (5, 10, 25)
MIN_ROUNDS = 64
SEEDS = (0, 1, 2)
#: The quick mode's one peak learning rate (no sweep).
QUICK_LR = 3e-3
CACHE = common.RESULTS / f"{NAME}.json"

METHODS = (
    base.DATA_PARALLEL,
    *(Method(c, h) for h in SYNC_EVERY for c in base.COMPRESSORS),
)


@dataclasses.dataclass(frozen=True)
class Scale:
    steps: int
    seeds: tuple[int, ...]
    methods: tuple[Method, ...]
    swept: bool


def scale() -> Scale:
    """``FULL=1``: every method, swept, 3 seeds of ``STEPS`` steps; else a quick check."""
    if common.full():
        return Scale(STEPS, SEEDS, METHODS, True)
    quick = (base.DATA_PARALLEL, Method("exact", 5), Method("SparseLoCo", 5))
    return Scale(200, (0,), quick, False)


def rounds(method: Method, steps: int) -> int:
    """Outer rounds in ``steps`` (data parallel: one per step)."""
    return steps // method.sync_every


class Runs:
    """Finished runs, keyed by (method, learning rate, seed, steps, width), kept in ``path``
    as JSON after each one; ``resume=False`` starts from none."""

    def __init__(self, path: pathlib.Path, resume: bool):
        self.path = path
        self.done = json.loads(path.read_text()) if resume and path.exists() else {}

    @staticmethod
    def key(method: Method, lr: float, seed: int, steps: int) -> str:
        return f"{method.label}|{lr:g}|{seed}|{steps}|w{WIDTH}"

    def get(self, method: Method, lr: float, seed: int, steps: int) -> Result:
        key = self.key(method, lr, seed, steps)
        if key not in self.done:
            self.done[key] = self._train(method, lr, seed, steps)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.done))
            tmp.replace(self.path)
        r = self.done[key]
        return Result(np.zeros(0), np.asarray(r["curve"]), r["validation"], r["test"], r["seconds"])

    @staticmethod
    def _train(method: Method, lr: float, seed: int, steps: int) -> dict:
        start = time.perf_counter()
        params, x, y, keys = base.problem(seed, WIDTH)
        _, curve, final = base.trainer(method, steps, WIDTH)(params, x, y, keys, jnp.float32(lr))
        ds = base.dataset()
        return {
            "curve": np.asarray(curve).tolist(),
            "validation": base.split_loss(final, ds.validation, WIDTH),
            "test": base.split_loss(final, ds.test, WIDTH),
            "seconds": time.perf_counter() - start,
        }


def sweep(runs: Runs, method: Method, steps: int) -> dict[float, float]:
    """Final validation loss per peak learning rate on ``SWEEP_SEED``: the grid, then one
    rung of the ladder beyond the best while the best is at an end."""
    losses: dict[float, float] = {}
    todo = base.SWEEP_GRID
    while todo:
        for lr in todo:
            losses[lr] = runs.get(method, lr, base.SWEEP_SEED, steps).validation
        todo = tuple(lr for lr in base.next_rates(losses) if lr not in losses)
    return dict(sorted(losses.items()))


def measure(s: Scale, runs: Runs):
    """``(swept losses, chosen rates, results per label)`` for every method of ``s``."""
    swept, rates, results = {}, {}, {}
    bar = tqdm(s.methods, desc=NAME, unit="method", file=sys.stderr)
    for m in bar:
        bar.set_postfix_str(m.label)
        if s.swept:
            swept[m.label] = sweep(runs, m, s.steps)
            rates[m.label] = base.best_rates({m.label: swept[m.label]})[m.label]
        else:
            rates[m.label] = QUICK_LR
        results[m.label] = [runs.get(m, rates[m.label], seed, s.steps) for seed in s.seeds]
    return swept, rates, results


def draw(s: Scale, results, traffics, path: pathlib.Path) -> None:
    """Validation over tokens (data parallel and every method at the largest H with enough
    rounds), the final loss against H (the paper's shape), and against bits per step."""
    fig = Figure(figsize=(15, 5.2), layout="constrained")
    ax_tokens, ax_h, ax_bits = fig.subplots(1, 3)
    evals = np.arange(base.EVAL_EVERY, s.steps + 1, base.EVAL_EVERY)
    tokens = evals * base.WORKERS * base.BATCH * base.LENGTH / 1e6
    dp = bits_per_char(np.mean([r.validation for r in results[base.DATA_PARALLEL.label]]))
    largest = max(m.sync_every for m in s.methods if m.compressor and m.sync_every in SYNC_EVERY)
    by_compressor: dict[str | None, list] = {}
    for m in s.methods:
        runs = results[m.label]
        color = base.COLORS[m.compressor]
        final = common.mean_ci95(bits_per_char(np.array([r.validation for r in runs])))
        half = final[1] if math.isfinite(final[1]) else 0.0
        enough = rounds(m, s.steps) >= MIN_ROUNDS
        if m.compressor is None or m.sync_every == largest:
            mean, band = base.band(bits_per_char(np.array([r.curve for r in runs])))
            ax_tokens.plot(tokens, mean, color=color, label=m.label, lw=2 if m.compressor else 1.3)
            ax_tokens.fill_between(tokens, mean - band, mean + band, color=color, alpha=0.1)
        if m.compressor is not None:
            by_compressor.setdefault(m.compressor, []).append((m.sync_every, *final, enough))
        ax_bits.errorbar(
            traffics[m.label].per_step, final[0], yerr=half, fmt="o", color=color, capsize=3,
            mfc=color if enough else "white",
        )  # fmt: skip
        ax_bits.annotate(
            m.label.replace("DiLoCo ", ""), (traffics[m.label].per_step, final[0]), fontsize=6,
            xytext=(3, 3), textcoords="offset points",
        )  # fmt: skip
    for compressor, points in by_compressor.items():
        hs, means, halves, enough = (np.array(v) for v in zip(*sorted(points), strict=True))
        halves = np.where(np.isfinite(halves), halves, 0.0)
        color = base.COLORS[compressor]
        ax_h.errorbar(hs, means, yerr=halves, color=color, capsize=3, marker="o", label=compressor)
        ax_h.scatter(hs[~enough], means[~enough], color="white", edgecolor=color, zorder=3)
    for ax in (ax_h, ax_bits):
        ax.axhline(dp, color="black", lw=1.2, label="data parallel" if ax is ax_h else None)
        ax.axhline(dp * (1 + base.TOLERANCE), color="gray", ls="--", lw=0.8)
    dp_bits = traffics[base.DATA_PARALLEL.label].per_step
    ax_bits.axvline(dp_bits / base.MIN_RATIO, color="gray", ls="--", lw=0.8)
    for ax in (ax_tokens, ax_h, ax_bits):
        ax.grid(alpha=0.3)
    ax_tokens.set(xlabel="training characters (millions, all workers)")
    ax_tokens.set(ylabel="validation bits per character", ylim=(dp - 0.1, dp + 1.0))
    ax_tokens.set_title(f"width {WIDTH}, {base.WORKERS} workers, H = {largest}")
    ax_tokens.legend(fontsize=7)
    ax_h.set(xscale="log", xlabel="H (inner steps per round)")
    hs = sorted({m.sync_every for m in s.methods if m.compressor})
    ax_h.set_xticks(hs, [str(h) for h in hs], minor=False)
    ax_h.minorticks_off()
    ax_h.set_title(f"final loss against H at {s.steps} steps; hollow: < {MIN_ROUNDS} rounds")
    ax_h.legend(fontsize=7)
    ax_bits.set(xscale="log", xlabel="bits per step per worker (averaged over a round)")
    ax_bits.set_title(f"dashed: +{100 * base.TOLERANCE:g}% and {base.MIN_RATIO:g}x fewer bits")
    fig.savefig(path, dpi=120)


def sweep_table(swept: dict[str, dict[float, float]]) -> str:
    """Final validation loss (bits per character) per peak learning rate, on the sweep seed."""
    rates = sorted({lr for losses in swept.values() for lr in losses})
    head = "| method | " + " | ".join(f"{lr:g}" for lr in rates) + " |\n"
    head += "|---|" + "---|" * len(rates) + "\n"
    rows = [
        f"| {label} | "
        + " | ".join(f"{bits_per_char(losses[lr]):.3f}" if lr in losses else "" for lr in rates)
        + " |"
        for label, losses in swept.items()
    ]
    return head + "\n".join(rows)


def report(s: Scale, swept, rates, results, traffics) -> tuple[str, str]:
    """``(measured, verdict)`` for the section."""
    dp_label = base.DATA_PARALLEL.label
    dp_bits = traffics[dp_label].per_step
    ratios = {k: dp_bits / t.per_step for k, t in traffics.items()}
    gaps = {
        m.label: base.paired_gap(results[m.label], results[dp_label])
        for m in s.methods
        if m.compressor is not None
    }
    rows = []
    for m in s.methods:
        runs = results[m.label]
        val = [bits_per_char(r.validation) for r in runs]
        gap = "" if m.compressor is None else interval(*gaps[m.label], 100, "%", True)
        rows.append(
            f"| {m.label} | {rounds(m, s.steps)} | {rates[m.label]:g} | "
            f"{traffics[m.label].per_step:,.0f} | {ratios[m.label]:,.4g}x | "
            f"{', '.join(f'{v:.3f}' for v in val)} | {interval(*common.mean_ci95(val))} | {gap} | "
            f"{interval(*common.mean_ci95([bits_per_char(r.test) for r in runs]))} | "
            f"{sum(r.seconds for r in runs):.0f} |"
        )
    measured = (
        "Final losses of the global params on the whole validation and test splits, in bits "
        f"per character; 95% Student-t intervals over seeds {list(s.seeds)}; the gap is "
        "`L / L_dp - 1` on validation, paired by seed. Bits: ring traffic leaving one worker, a "
        "round's messages averaged over its steps plus the per-step flag. Seconds: training "
        "and evaluation of the seeds' runs (compiles included in the first).\n\n"
        "| method | rounds | peak lr | bits/step/worker | fewer bits than DP | validation (per "
        "seed) | validation | gap to DP | test | seconds |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    against = base.against_exact(s.methods, results)
    if against:
        measured += "\n\n" + against
    if swept:
        measured += (
            f"\n\nThe sweep (seed {base.SWEEP_SEED}, final validation bits per character per "
            "peak learning rate; the least chosen):\n\n" + sweep_table(swept)
        )
    eligible = {k: g for k, g in gaps.items() if rounds(_method(s, k), s.steps) >= MIN_ROUNDS}
    if not eligible:
        return measured, f"Not judged: no configuration ran {MIN_ROUNDS} outer rounds."
    return measured, base.verdict(eligible, ratios)


def _method(s: Scale, label: str) -> Method:
    return next(m for m in s.methods if m.label == label)


def main(out_dir: pathlib.Path = OUT_DIR, fresh: bool = False) -> list[pathlib.Path]:
    """Sweep and train every method (reusing finished runs unless ``fresh``); write the figure
    and its section."""
    s = scale()
    runs = Runs(CACHE, resume=not fresh)
    swept, rates, results = measure(s, runs)
    params = base.problem(0, WIDTH)[0]
    traffics = {m.label: base.traffic(m, params) for m in s.methods}
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{NAME}.png"
    draw(s, results, traffics, png)
    measured, verdict = report(s, swept, rates, results, traffics)
    n_params = sum(a.size for a in jax.tree.leaves(params))
    done = [r for k, r in runs.done.items() if k.split("|")[3:] == [str(s.steps), f"w{WIDTH}"]]
    tokens = s.steps * base.WORKERS * base.BATCH * base.LENGTH
    passes = tokens / base.dataset().train.y.size
    rate_text = (
        f"swept on seed {base.SWEEP_SEED} over {list(base.SWEEP_GRID)}, extended along "
        f"{list(base.LADDER)} while the best was at an end (the table below)"
        if s.swept
        else f"{QUICK_LR:g} for all (quick mode: not swept)"
    )
    setting = (
        f"`char_lm`'s transformer narrowed to width {WIDTH} (2 blocks, {n_params:,} "
        f"parameters) on Python's pydoc prose, {base.WORKERS} workers (vmap) with i.i.d. "
        f"shards, {base.BATCH} sequences of {base.LENGTH} characters per worker per step, "
        f"{s.steps} steps ({tokens:,} characters, {passes:.1f} passes over the "
        f"training text), seeds {list(s.seeds)}; every method sees the same tokens. Inner "
        f"AdamW (weight decay {base.WEIGHT_DECAY}, {base.WARMUP} warm-up steps, cosine to "
        f"{base.END_FRACTION:g} of the peak); DiLoCo's outer Nesterov SGD (lr {base.OUTER_LR}, "
        f"momentum {base.OUTER_MOMENTUM}) on exact, int8 or MXFP4 pseudo-gradients; SparseLoCo "
        f"at its defaults. H in {list(SYNC_EVERY)} (at least {MIN_ROUNDS} outer rounds each). "
        f"Peak learning rates: {rate_text}. Criterion (fixed before the runs): some "
        f"configuration with >= {MIN_ROUNDS} rounds at >= {base.MIN_RATIO:g}x fewer bits whose "
        f"95% interval of the validation gap to data parallel lies below "
        f"+{100 * base.TOLERANCE:g}%: reproduced; only its mean: partly. Compute: {len(done)} "
        f"runs of {s.steps} steps (the sweep's included), "
        f"{sum(r['seconds'] for r in done) / 60:.0f} minutes."
    )
    md = common.section(
        NAME,
        "Figure 13, with enough rounds: DiLoCo and SparseLoCo over 64 to 320 outer rounds",
        claim=(
            "DiLoCo starts behind data parallel and catches up over hundreds of outer rounds; "
            "at a fixed token budget its final loss rises only slowly with H; compressed "
            "pseudo-gradients cost little. Stated here as some configuration within "
            f"{100 * base.TOLERANCE:g}% of data parallel's validation loss at >= "
            f"{base.MIN_RATIO:g}x fewer bits."
        ),
        setting=setting,
        measured=measured,
        verdict=verdict,
        out_dir=out_dir,
    )
    return [png, md]


if __name__ == "__main__":
    for p in main(fresh="--fresh" in sys.argv[1:]):
        print(p)
