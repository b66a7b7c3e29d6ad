"""Figure 1: DIANA converges linearly to the optimum; compressed GD stalls at a plateau.

Mishchenko, Gorbunov, Takáč, Richtárik, "Distributed Learning with Compressed
Gradient Differences" (2019): in the batch (full-gradient) mode, methods that
compress the gradients themselves -- QSGD (Alistarh et al. 2017), TernGrad
(Wen et al. 2017), DQGD (Khirirat et al. 2018) -- cannot converge to the
optimum with a constant step size when the local gradients at the optimum do
not vanish (``grad f_i(x*) != 0``); DIANA compresses gradient *differences*
``g_i - h_i`` and learns the shifts ``h_i -> grad f_i(x*)``, so it converges
linearly to the exact optimum.

What runs: the harness task ``logreg_hetero`` (L2-regularised logistic
regression, every worker its own synthetic data distribution, full batch), 8
workers, the same constant step size for every method:

* GD: ``dense()`` (float32 all-reduce), the reference;
* DIANA: ``diana(qsgd(levels=1))`` and ``diana(terngrad())`` (shift step
  ``alpha = 1/(omega + 1)`` per layer, compjax's default);
* QSGD: compressed GD ``x <- x - gamma (mean_i Q(grad f_i(x)) + l2 x)`` with
  ``qsgd(levels=1)``, the same quantiser DIANA uses;
* TernGrad: the same iteration with ``terngrad()`` (no clipping), the same
  quantiser as the second DIANA;
* DQGD: the same iteration (Khirirat et al.'s compressed GD without memory)
  with natural compression, ``natural()`` (omega = 1/8).

The plot shows ``||x_t - x*||^2`` (``x*`` by Newton's method in float64) over
iterations and over bits sent per worker.  For every compressed-GD variant the
plateau predicted by linearising around ``x*`` is drawn as a dotted line: with
``H`` the Hessian at ``x*`` (eigenpairs ``lambda_j, u_j``) and the exact
per-coordinate variance ``v`` of ``mean_i C(grad f_i(x*))`` (computed from the
task's data and the quantiser's formula), the stationary
``E||x - x*||^2 = sum_j gamma q_j / (lambda_j (2 - gamma lambda_j))``,
``q_j = u_j^T diag(v) u_j``; its size is set by the noise power
``S = sum v <= (omega/n) mean_i ||grad f_i(x*)||^2`` (REFERENCES.md).
"""

from __future__ import annotations

import pathlib

import numpy as np
from matplotlib.figure import Figure

import compjax
from experiments.common import data, methods
from experiments.harness import tasks, train
from paper_figs import common

NAME = "fig1_diana"
OUT_DIR = common.OUT_DIR
TASK = "logreg_hetero"
WORKERS = 8
LR = 0.5  # the task's default; the same constant step for every method
EVAL_EVERY = 10
TAIL_STEPS = 100  # "plateau" = median of the evaluations over the last TAIL_STEPS steps

# (label, method expression, colour, line style); compressed GD entries carry a compressor.
METHODS = (
    ("GD (dense float32)", "dense()", "black", "-"),
    ("DIANA + QSGD s=1", "diana(qsgd(levels=1))", "tab:blue", "-"),
    ("DIANA + TernGrad", "diana(terngrad())", "tab:cyan", "-"),
    ("QSGD s=1", "qsgd(levels=1)", "tab:red", "--"),
    ("TernGrad", "terngrad()", "tab:orange", "--"),
    ("DQGD (natural)", "natural()", "tab:purple", "--"),
)
DIANAS = [m for m in METHODS if m[1].startswith("diana")]
STALLING = [m for m in METHODS if not m[1].startswith(("diana", "dense"))]


def settings() -> tuple[int, tuple[int, ...]]:
    """``(steps, seeds)`` for the quick or the full run."""
    return (1000, (0, 1, 2)) if common.full() else (500, (0,))


# --- the linearised plateau ---------------------------------------------------------------


def problem_at_optimum(seed: int, workers: int = WORKERS):
    """The task's data at the optimum: ``(grads, hessian, l2)``.

    ``grads``: ``(workers, d + 1, C)`` local data-term gradients ``grad f_i(x*)``
    (rows ``0..d-1`` the kernel, row ``d`` the bias, as the harness's
    ``Dense_0`` params); ``hessian``: ``((d+1) C, (d+1) C)`` Hessian of the full
    objective (mean cross-entropy + ``l2/2 ||x||^2``) at ``x*``, flattened the same way.
    """
    task = tasks.get(TASK)
    dataset = task.dataset(workers, seed)
    x, y = data.worker_shards(dataset.train, workers, dataset.partition, seed)
    n, m, d = x.shape
    c = dataset.num_classes
    star = tasks.optimum(x.reshape(-1, d), y.reshape(-1), c, task.l2)["Dense_0"]
    theta = np.concatenate([star["kernel"], star["bias"][None]], axis=0)
    xt = np.concatenate([x.astype(np.float64), np.ones((n, m, 1))], axis=2)
    z = xt @ theta
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    grads = np.einsum("nma,nmc->nac", xt, p - np.eye(c)[y]) / m
    flat_x, flat_p = xt.reshape(n * m, d + 1), p.reshape(n * m, c)
    cov = np.einsum("kc,ce->kce", flat_p, np.eye(c)) - np.einsum("kc,ke->kce", flat_p, flat_p)
    hess = np.einsum("ka,kb,kce->acbe", flat_x, flat_x, cov) / (n * m)
    size = (d + 1) * c
    return grads, hess.reshape(size, size) + task.l2 * np.eye(size), task.l2


def entry_variance(comp: compjax.Compressor, x: np.ndarray) -> np.ndarray:
    """Exact per-entry variance of ``comp(x)`` for one leaf ``x`` (float64).

    QSGD with ``s`` levels, one norm: ``(||x||/s)^2 p (1 - p)``, ``p`` the
    fractional part of ``s|x_i|/||x||``; TernGrad without clipping:
    ``|x_i| (max|x| - |x_i|)``; natural compression, ``|t|`` in ``[2^a, 2^(a+1))``:
    ``(2^(a+1) - |t|)(|t| - 2^a)``.
    """
    a = np.abs(np.asarray(x, np.float64)).ravel()
    name = type(comp).__name__
    if name == "QSGD" and comp.bucket_size is None:
        norm = np.linalg.norm(a)
        if norm == 0:
            return np.zeros_like(a)
        scaled = comp.levels * a / norm
        frac = scaled - np.floor(scaled)
        return (norm / comp.levels) ** 2 * frac * (1 - frac)
    if name == "TernGrad" and comp.clip is None:
        return a * (a.max() - a)
    if name == "Natural":
        with np.errstate(divide="ignore"):
            low = np.where(a > 0, 2.0 ** np.floor(np.log2(np.where(a > 0, a, 1.0))), 0.0)
        return (2 * low - a) * (a - low)
    raise ValueError(f"no variance formula for {comp!r}")


def noise_variance(comp: compjax.Compressor, grads: np.ndarray) -> np.ndarray:
    """Per-coordinate variance of ``mean_i C(grads[i])``, layer by layer as the harness sends.

    The leaves are the kernel ``grads[i, :d]`` and the bias ``grads[i, d]``;
    workers draw independently, so the variances add and divide by ``n^2``.
    Returns the ``(d + 1, C)`` array.
    """
    n, rows, _ = grads.shape
    total = np.zeros(grads.shape[1:])
    for g in grads:
        total[: rows - 1] += entry_variance(comp, g[: rows - 1]).reshape(g[: rows - 1].shape)
        total[rows - 1] += entry_variance(comp, g[rows - 1])
    return total / n**2


def omega_bound(comp: compjax.Compressor, grads: np.ndarray) -> float:
    """``sum_layers (omega(d_l)/n) mean_i ||grad_l f_i(x*)||^2``: the worst-case noise power."""
    n, rows, _ = grads.shape
    kernel, bias = grads[:, : rows - 1], grads[:, rows - 1]
    return sum(
        comp.omega(leaf[0].size) / n * float(np.mean(np.sum(leaf.reshape(n, -1) ** 2, axis=1)))
        for leaf in (kernel, bias)
    )


def stationary_distance(hessian: np.ndarray, variance: np.ndarray, lr: float) -> float:
    """Stationary ``E||e||^2`` of ``e <- (I - lr H) e - lr xi`` with ``Cov xi = diag(variance)``."""
    lam, u = np.linalg.eigh(hessian)
    if np.any(lam * lr >= 2) or np.any(lam <= 0):
        return float("inf")
    q = (u**2).T @ variance.ravel()
    return float(np.sum(lr * q / (lam * (2 - lr * lam))))


# --- runs and numbers ----------------------------------------------------------------------


def tail_median(steps: np.ndarray, values: np.ndarray, tail: int = TAIL_STEPS) -> float:
    """Median of ``values`` at the evaluated steps within the last ``tail`` steps."""
    return float(np.median(values[steps > steps[-1] - tail]))


def first_below(steps: np.ndarray, values: np.ndarray, level: float) -> int | None:
    """The first evaluated step where ``values < level`` (``None`` if never)."""
    hit = np.flatnonzero(values < level)
    return int(steps[hit[0]]) if hit.size else None


def _configs(steps: int, seeds) -> list[train.Config]:
    return [
        train.Config(
            task=TASK,
            method=spec,
            workers=WORKERS,
            steps=steps,
            seed=seed,
            lr=LR,
            eval_every=EVAL_EVERY,
        )
        for _, spec, _, _ in METHODS
        for seed in seeds
    ]


def _fmt(v: float) -> str:
    return f"{v:.2e}"


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Run (or read) the runs, write ``fig1_diana.png`` and ``fig1_diana.md``."""
    steps, seeds = settings()
    runs = common.runs(_configs(steps, seeds), NAME)
    by = {(r.config.method, r.config.seed): r for r in runs}

    curves, bits, tails, mean_tails, reach = {}, {}, {}, {}, {}
    for _, spec, _, _ in METHODS:
        dists = []
        for seed in seeds:
            run = by[(spec, seed)]
            s, d = run.column("dist_to_opt")
            dists.append(d)
            tails.setdefault(spec, []).append(tail_median(s, d))
            mean_tails.setdefault(spec, []).append(float(np.mean(d[s > steps // 2])))
        bstep, cum = run.column("cum_bits")
        curves[spec] = (s, np.median(dists, axis=0))
        bits[spec] = np.interp(s, np.concatenate([[0], bstep]), np.concatenate([[0], cum]))
        reach[spec] = first_below(s, curves[spec][1], 1e-8)
    start = float(curves["dense()"][1][0])

    # Predicted plateaus, per seed (each seed draws its own data), averaged.
    predicted, noise, bound = {}, {}, {}
    for _, spec, _, _ in STALLING:
        comp = methods.parse(spec).compressor
        p_s, n_s, b_s = [], [], []
        for seed in seeds:
            grads, hess, _ = problem_at_optimum(seed)
            var = noise_variance(comp, grads)
            p_s.append(stationary_distance(hess, var, LR))
            n_s.append(float(var.sum()))
            b_s.append(omega_bound(comp, grads))
        predicted[spec], noise[spec], bound[spec] = map(np.mean, (p_s, n_s, b_s))
    grads0, _, _ = problem_at_optimum(seeds[0])
    local_norm = float(np.mean(np.sum(grads0**2, axis=(1, 2))))

    # Criterion.
    diana_final = {spec: max(tails[spec]) for _, spec, _, _ in DIANAS}
    worst_diana = max(diana_final.values())
    diana_ok = all(v < 1e-8 or v < 1e-6 * start for v in diana_final.values())
    stall_ratio = {spec: min(tails[spec]) / worst_diana for _, spec, _, _ in STALLING}
    stall_ok = all(r > 100 for r in stall_ratio.values())

    # Figure.
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_it, ax_bits = fig.subplots(1, 2)
    for label, spec, color, style in METHODS:
        s, d = curves[spec]
        ax_it.plot(s, d, style, color=color, label=label, lw=1.6)
        ax_bits.plot(bits[spec], d, style, color=color, label=label, lw=1.6)
        if spec in predicted:
            ax_it.axhline(predicted[spec], color=color, ls=":", lw=1.2)
    ax_it.plot([], [], ":", color="gray", label="predicted plateau (linearised)")
    for ax in (ax_it, ax_bits):
        ax.set_yscale("log")
        ax.set_ylabel(r"$\|x_t - x^\star\|^2$")
        ax.grid(True, which="major", alpha=0.3)
    ax_bits.set_xscale("log")
    ax_it.set_xlabel("iteration")
    ax_bits.set_xlabel("bits sent per worker (cumulative)")
    ax_it.legend(fontsize=8.5, loc="center right")
    seed_note = f"median of {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
    ax_it.set_title(
        f"(a) distance to optimum, {WORKERS} workers, step {LR} ({seed_note})", fontsize=10
    )
    ax_bits.set_title("(b) the same against communication", fontsize=10)
    fig.suptitle(
        "DIANA vs compressed GD on heterogeneous logistic regression (logreg_hetero, full batch)",
        fontsize=11,
    )
    png = out_dir / f"{NAME}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)

    # Section.
    rows = [
        "| method | bits/worker/step | steps to ‖x−x*‖² < 1e-8 | tail median (last "
        f"{TAIL_STEPS} steps) | tail / DIANA's worst | predicted plateau | measured mean "
        "(2nd half) / predicted | S = Σv | (ω/n)·mean‖∇f_i(x*)‖² |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, spec, _, _ in METHODS:
        run = by[(spec, seeds[0])]
        per_step = run.info["steady_bits"]["allreduce"] + run.info["steady_bits"]["allgather"]
        tail = float(np.median(tails[spec]))
        cells = [
            f"{label} `{spec}`",
            f"{per_step:,}",
            str(reach[spec]) if reach[spec] is not None else "never",
            _fmt(tail),
            f"{tail / worst_diana:.3g}" if spec in stall_ratio else "—",
        ]
        if spec in predicted:
            measured_mean = float(np.mean(mean_tails[spec]))
            cells += [
                _fmt(predicted[spec]),
                f"{measured_mean / predicted[spec]:.2f}",
                _fmt(noise[spec]),
                _fmt(bound[spec]),
            ]
        else:
            cells += ["—"] * 4
        rows.append("| " + " | ".join(cells) + " |")
    over_seeds = f" (every number: median over {len(seeds)} seeds)" if len(seeds) > 1 else ""
    measured = (
        f"Start ‖x₀−x*‖² = {start:.3g}{over_seeds}; mean_i ‖∇f_i(x*)‖² = {local_norm:.3g} (seed "
        f"{seeds[0]}): the local gradients at the optimum do not vanish.\n\n"
        + "\n".join(rows)
        + "\n\nThe predicted plateau uses the exact per-coordinate variance of the quantiser "
        "at ∇f_i(x*) and the Hessian at x* (linearised stationary variance; the noise of the "
        "real iteration is evaluated at x_t, not x*). S is the noise power of the averaged "
        "message; the last column is REFERENCES.md's worst-case (ω/n)·mean‖∇f_i(x*)‖², "
        "summed over the two layers."
    )
    setting = (
        f"Task `{TASK}` ({tasks.get(TASK).description}; L2 {tasks.get(TASK).l2} applied "
        f"after the exchange), {WORKERS} workers, {steps} full-batch steps, plain SGD with "
        f"the same constant step {LR} for every method (no momentum), seeds {list(seeds)} "
        f"(each seed draws its own data; curves are the median over seeds), ‖x−x*‖² "
        f"evaluated every {EVAL_EVERY} steps against x* from Newton's method in float64. "
        "QSGD, TernGrad and DQGD are the same compressed GD iteration "
        "x ← x − γ(mean_i C(∇f_i(x)) + l2·x) without memory (`compjax.compress`), with "
        "C = `qsgd(levels=1)` (ℓ2 ternary), `terngrad()` (ℓ∞ ternary, no clipping) and "
        "`natural()` (natural compression, ω = 1/8; our stand-in for DQGD's quantiser). DIANA "
        "uses α = 1/(ω+1) per layer. Compressors act per layer (kernel 20×2, bias 2)."
    )
    worst_stall = min(stall_ratio, key=stall_ratio.get)
    by_noise = sorted(noise, key=noise.get)
    same_order = by_noise == sorted(noise, key=lambda spec: float(np.median(tails[spec])))
    verdict = (
        f"{'Reproduced' if diana_ok and stall_ok else 'Did not reproduce'}. Criterion: every "
        f"DIANA run ends (median over the last {TAIL_STEPS} steps) below 1e-8 or 1e-6 of the "
        f"start, and every compressed-GD run's tail median stays above 100× DIANA's worst. "
        f"DIANA ends at "
        + ", ".join(f"{_fmt(v)} (`{k}`)" for k, v in diana_final.items())
        + f" (dense GD's float32 floor: {_fmt(float(np.median(tails['dense()'])))}; DIANA "
        "reaches 1e-8 at step "
        + ", ".join(str(reach[spec]) for _, spec, _, _ in DIANAS)
        + f", dense GD at step {reach['dense()']}); compressed GD stalls "
        f"{stall_ratio[worst_stall]:.3g}× or more above it (least: `{worst_stall}`, noise "
        f"power S = {_fmt(noise[worst_stall])}). Measured / predicted plateau: "
        + ", ".join(
            f"{float(np.mean(mean_tails[spec])) / predicted[spec]:.2f} (`{spec}`)"
            for _, spec, _, _ in STALLING
        )
        + f"; the plateaus are {'' if same_order else 'not '}in the order of the noise "
        "powers S."
    )
    md = common.section(
        NAME,
        "Figure 1 — DIANA: linear convergence where compressed GD stalls",
        claim=(
            "With full gradients and a constant step size, DIANA (compressing gradient "
            "differences with learned shifts) converges linearly to the exact optimum, while "
            "QSGD, TernGrad and DQGD (compressing the gradients) stall in a neighbourhood of "
            "size ~ (ω/n)·mean‖∇f_i(x*)‖² (Mishchenko et al. 2019)."
        ),
        setting=setting,
        measured=measured,
        verdict=verdict,
        out_dir=out_dir,
    )
    return [png, md]


if __name__ == "__main__":
    for path in main():
        print(path)
