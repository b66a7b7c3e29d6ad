"""Figure 13: DiLoCo with compressed pseudo-gradients against data-parallel AdamW.

The papers: Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato,
Szlam, Shen, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv 2311.08105, 2023 (each worker takes ``H`` inner AdamW steps on
its own data, then the pseudo-gradients are averaged into a Nesterov outer
step, lr 0.7, momentum 0.9: about ``H``-fold less communication at equal
quality); Jaghouar et al., "INTELLECT-1 Technical Report", arXiv 2412.01152,
2024 (int8 pseudo-gradients); Douillard et al., "Streaming DiLoCo",
arXiv 2501.18512, 2025 (4-bit outer gradients); Sarfi, Thérien, Lidin,
Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
arXiv 2508.15706, 2025 (chunked top-k in 2 bits, decaying error feedback in
place of the outer momentum).

What runs: the harness's ``char_lm`` task (its 431k-parameter causal
transformer on Python's pydoc prose, 4 sequences of 64 characters per worker
per step; ``experiments.harness.tasks`` gives the data, the model and the loss) on
4 workers simulated with ``jax.vmap``, each with its own i.i.d. shard of the
training text, driven here directly (one ``jax.lax.scan`` per run, one
compiled program per method reused across seeds and learning rates, which
are traced arguments):

* data parallel: the float32 mean gradient (``compress(identity())``) into
  AdamW every step;
* DiLoCo (:func:`compjax.diloco`) at ``H`` in {10, 50, 100}: inner AdamW,
  outer ``optax.sgd(0.7, momentum=0.9, nesterov=True)``, the
  pseudo-gradients sent exactly (float32 all-reduce), as 8-bit integer codes
  (``int_quant(8)``) or as MXFP4 (``mx("float4_e2m1fn")``: 4-bit E2M1
  floats with one power-of-two scale per 32 entries, 4.25 bits an entry,
  with the error memory a biased compressor keeps);
* SparseLoCo (:func:`compjax.sparseloco`, its defaults: 32 of every 4096
  entries, 2-bit values, error decay 0.95, outer lr 1) at the same ``H``.

Every run sees the same tokens: the same shards and the same sampled
sequences at every step.  The inner AdamW (weight decay 0.1, as DiLoCo's)
follows a linear warm-up over ``WARMUP`` steps and a cosine decay to a tenth
of its peak at the last step, for every method alike.  The peak learning
rates (``LEARNING_RATES``) were chosen on the validation split by
:func:`sweep` (seed ``SWEEP_SEED``, not one of the figure's seeds).  Bits
per step are :func:`compjax.communication`'s count of the payloads
(ring traffic leaving one worker) averaged over a round: a round's messages
divided by ``H``, plus the 8-bit non-finite flag every step all-reduces.

The scale is set by the machine: a step of the four workers costs 60-70 ms
(the transformer's forward and backward pass on about one core of the two)
and each method compiles in 15-40 s, so ``FULL=1`` (13 methods, 3 seeds,
``FULL_STEPS = 400`` steps) takes 19 minutes on an idle machine (25 to 27
with other sessions on the cores); ``H = 100`` then makes 4 rounds.  The
1000 steps that would give it 10 would take 45 to 60 minutes.
The 4-bit float is MXFP4, not a plain ``cast("float4_e2m1fn")``: the cast's
smallest nonzero value is 0.5 and entries below 0.25 round to 0, while a
round of AdamW moves most entries by far less, so with the cast DiLoCo
trains only through its error memory (measured in an earlier run of this
figure: 9.5% to 18.5% above exact DiLoCo; docs/local_steps.md).

Criterion (stated before the run): for each configuration, the relative gap
of its final validation loss to data parallel's, paired by seed,
``L_method / L_dp - 1``, with a 95% Student-t interval over the seeds.
*Reproduced* if some DiLoCo or SparseLoCo configuration sending at least
100x fewer bits per step than data parallel has that interval entirely
below +3%; *partly reproduced* if only the mean gap of some such
configuration is below +3%; otherwise *did not reproduce*.  (The per-step
flag counts: exact pseudo-gradients at ``H = 100`` are 99.99x, not 100x.)

Writes ``out/fig13_diloco.png`` and ``out/fig13_diloco.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from matplotlib.figure import Figure

import compjax
from experiments.common import data, models
from experiments.harness import tasks
from paper_figs import common

NAME = "fig13_diloco"
OUT_DIR = common.OUT_DIR
TASK = "char_lm"
WORKERS = 4
AXIS = "data"
#: Sequences per worker per step (the task's batch) and characters per sequence.
BATCH, LENGTH = 4, 64
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
WEIGHT_DECAY = 0.1
#: Linear warm-up of the inner learning rate; then cosine decay to END_FRACTION of the peak.
WARMUP, END_FRACTION = 40, 0.1
SYNC_EVERY = (10, 50, 100)
#: Validation loss of the global params every this many steps, on CURVE_EXAMPLES windows
#: (DiLoCo's ``theta`` is the last synchronised value: mid-round at H = 100).
EVAL_EVERY = 50
CURVE_EXAMPLES = 256
#: Criterion: the largest relative validation gap and the least compression.
TOLERANCE, MIN_RATIO = 0.03, 100.0
SWEEP_SEED = 10
#: Steps of a full run: about the most that keeps ``FULL=1`` near 20 minutes on the 2-core
#: machine (measured: 19 idle, 25 to 27 shared; see the module docstring).
FULL_STEPS = 400
#: The peak learning rates every method tries, and the ladder the sweep may walk on.
SWEEP_GRID = (1e-3, 3e-3, 1e-2)
LADDER = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
COMPRESSORS = ("exact", "int8", "MXFP4", "SparseLoCo")


@dataclasses.dataclass(frozen=True)
class Method:
    """A configuration: ``compressor`` one of ``COMPRESSORS``, or ``None`` for data parallel."""

    compressor: str | None = None
    sync_every: int = 1

    @property
    def label(self) -> str:
        if self.compressor is None:
            return "data parallel"
        if self.compressor == "SparseLoCo":
            return f"SparseLoCo H={self.sync_every}"
        return f"DiLoCo {self.compressor} H={self.sync_every}"


DATA_PARALLEL = Method()
ALL_METHODS = (DATA_PARALLEL, *(Method(c, h) for h in SYNC_EVERY for c in COMPRESSORS))

#: Peak inner learning rates: the least final validation loss (nats per character, whole
#: split) of :func:`sweep` (seed ``SWEEP_SEED``, 400 steps; ``--sweep``), measured:
#:
#: ===================  ======  ======  ======  ======  ======
#: method               3e-4    1e-3    3e-3    1e-2    3e-2
#: ===================  ======  ======  ======  ======  ======
#: data parallel                2.329   2.044   2.149
#: DiLoCo exact H=10    2.481   2.419   2.436   2.457
#: DiLoCo int8 H=10     2.481   2.419   2.429   2.457
#: DiLoCo MXFP4 H=10    2.483   2.421   2.431   2.451
#: SparseLoCo H=10              2.558   2.437   2.402   2.432
#: DiLoCo exact H=50            2.419   2.405   2.454
#: DiLoCo int8 H=50             2.419   2.404   2.456
#: DiLoCo MXFP4 H=50            2.420   2.397   2.449
#: SparseLoCo H=50              2.676   2.559   2.567
#: DiLoCo exact H=100           2.429   2.406   2.482
#: DiLoCo int8 H=100            2.429   2.407   2.482
#: DiLoCo MXFP4 H=100           2.431   2.410   2.479
#: SparseLoCo H=100             3.242   2.803   2.831
#: ===================  ======  ======  ======  ======  ======
LEARNING_RATES: dict[str, float] = {
    "data parallel": 3e-3,
    "DiLoCo exact H=10": 1e-3,
    "DiLoCo int8 H=10": 1e-3,
    "DiLoCo MXFP4 H=10": 1e-3,
    "SparseLoCo H=10": 1e-2,
    "DiLoCo exact H=50": 3e-3,
    "DiLoCo int8 H=50": 3e-3,
    "DiLoCo MXFP4 H=50": 3e-3,
    "SparseLoCo H=50": 3e-3,
    "DiLoCo exact H=100": 3e-3,
    "DiLoCo int8 H=100": 3e-3,
    "DiLoCo MXFP4 H=100": 3e-3,
    "SparseLoCo H=100": 3e-3,
}


@dataclasses.dataclass(frozen=True)
class Scale:
    steps: int
    seeds: tuple[int, ...]
    methods: tuple[Method, ...]


def scale() -> Scale:
    """Quick: 200 steps, one seed, data parallel and DiLoCo at H = 50 sent exactly and in
    int8; ``FULL=1``: FULL_STEPS steps, three seeds, every method."""
    if common.full():
        return Scale(FULL_STEPS, (0, 1, 2), ALL_METHODS)
    quick = (DATA_PARALLEL, Method("exact", 50), Method("int8", 50))
    return Scale(200, (0,), quick)


def schedule(lr, steps: int) -> optax.Schedule:
    """The inner learning rate: warm-up to ``lr``, cosine decay to ``END_FRACTION * lr``."""
    unit = optax.warmup_cosine_decay_schedule(0.0, 1.0, WARMUP, steps, end_value=END_FRACTION)
    return lambda count: lr * unit(count)


def optimizer(method: Method, lr, steps: int) -> optax.GradientTransformation:
    """``method`` with peak inner learning rate ``lr`` (a float or a traced scalar)."""
    inner = optax.adamw(schedule(lr, steps), weight_decay=WEIGHT_DECAY)
    if method.compressor is None:
        return optax.chain(compjax.compress(compjax.identity(), AXIS), inner)
    if method.compressor == "SparseLoCo":
        return compjax.sparseloco(inner, method.sync_every, AXIS)
    compressor = {
        "exact": None,
        "int8": compjax.int_quant(bits=8),
        "MXFP4": compjax.mx("float4_e2m1fn"),
    }[method.compressor]
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return compjax.diloco(inner, outer, method.sync_every, AXIS, compressor=compressor)


@functools.cache
def dataset() -> data.Dataset:
    return data.characters(length=LENGTH)


#: The model's width: the task's (2 blocks of width 128, 431k parameters).
WIDTH = 128


@functools.cache
def model(width: int = WIDTH):
    """The task's transformer at ``width`` (its default 128; fig13_diloco_rounds uses 64)."""
    if width == WIDTH:
        return tasks.get(TASK).model(dataset().num_classes)
    return models.CharTransformer(vocab=dataset().num_classes, width=width)


def evenly(split: data.Split, count: int) -> tuple[jax.Array, jax.Array]:
    """``count`` evenly spaced windows of ``split`` (all of them if fewer)."""
    idx = np.linspace(0, len(split.x) - 1, min(count, len(split.x))).round().astype(int)
    return jnp.asarray(split.x[idx]), jnp.asarray(split.y[idx])


def problem(seed: int, width: int = WIDTH):
    """``(params, worker x, worker y, worker keys)`` for ``seed``: i.i.d. shards of the text."""
    ds = dataset()
    x, y = data.worker_shards(ds.train, WORKERS, "shuffle", seed)
    params = model(width).init(jax.random.key(seed), jnp.asarray(x[0, :1]))["params"]
    keys = jax.random.split(jax.random.key(1000 + seed), WORKERS)
    return params, jnp.asarray(x), jnp.asarray(y), keys


class Traffic(NamedTuple):
    """Bits leaving one worker (ring traffic, :func:`compjax.communication`): ``flag`` every
    step (the non-finite flag), ``round`` more on a round's last step."""

    flag: float
    round: float
    sync_every: int

    @property
    def per_step(self) -> float:
        """Averaged over a round."""
        return self.flag + self.round / self.sync_every

    def cumulative(self, steps: np.ndarray) -> np.ndarray:
        """Bits sent by the end of each of ``steps`` (counted from 1)."""
        steps = np.asarray(steps)
        return self.flag * steps + (steps // self.sync_every) * self.round


def traffic(method: Method, params) -> Traffic:
    """``method``'s :class:`Traffic` for ``params``-shaped models on ``WORKERS`` workers."""
    report = compjax.communication(optimizer(method, 1e-3, 2 * WARMUP), params, AXIS, WORKERS)
    flag = sum(b for kind, b in report.messages if kind == "flag")
    return Traffic(flag, report.bits_per_worker - flag, method.sync_every)


def global_params(method: Method, params, state):
    """Inside the map, what to evaluate: ``theta`` for DiLoCo, the params for data parallel
    (every worker holds the same)."""
    if method.compressor is None:
        return params
    return compjax.global_params(state)


@functools.cache
def trainer(method: Method, steps: int, width: int = WIDTH) -> Callable:
    """``run(params, x, y, keys, lr) -> (train losses per step, curve validation losses,
    final params)``, jitted once for ``method`` (and cached: a sweep and the runs after it
    share the compile); ``steps`` a multiple of ``EVAL_EVERY``.

    The whole run is one ``jax.vmap`` over the workers, the state made inside it: the
    shared fields (the step count) stay unmapped, so DiLoCo's ``lax.cond`` synchronises only
    on a round's last step (with a state mapped from outside, ``vmap`` would turn it into a
    select that runs the synchronisation every step).  Each worker evaluates a quarter of
    the ``CURVE_EXAMPLES`` validation windows, and the mean is ``pmean``-ed.
    """
    loss = tasks.loss_fn(model(width))
    val_x, val_y = evenly(dataset().validation, CURVE_EXAMPLES)
    val_x = val_x.reshape(WORKERS, -1, *val_x.shape[1:])
    val_y = val_y.reshape(WORKERS, -1, *val_y.shape[1:])

    def run(params, x, y, keys, lr):
        tx = optimizer(method, lr, steps)

        def worker(x, y, key, vx, vy):
            def body(carry, t):
                p, s = carry
                idx = jax.random.randint(jax.random.fold_in(key, t), (BATCH,), 0, x.shape[0])
                value, g = jax.value_and_grad(loss)(p, (x[idx], y[idx]))
                u, s = tx.update(g, s, p)
                return (optax.apply_updates(p, u), s), value

            def chunk(carry, c):
                carry, values = jax.lax.scan(body, carry, c * EVAL_EVERY + jnp.arange(EVAL_EVERY))
                val = jax.lax.pmean(loss(global_params(method, *carry), (vx, vy)), AXIS)
                return carry, (jax.lax.pmean(values, AXIS), val)

            carry = (params, tx.init(params))
            carry, (train, val) = jax.lax.scan(chunk, carry, jnp.arange(steps // EVAL_EVERY))
            return train.reshape(-1), val, global_params(method, *carry)

        train, val, final = jax.vmap(worker, axis_name=AXIS)(x, y, keys, val_x, val_y)
        return train[0], val[0], jax.tree.map(lambda a: a[0], final)

    return jax.jit(run)


@functools.partial(jax.jit, static_argnums=0)
def _split_loss(width, params, x, y):
    return tasks.loss_fn(model(width))(params, (x, y))


def split_loss(params, split: data.Split, width: int = WIDTH) -> float:
    """The mean cross-entropy (nats per character) on every window of ``split``."""
    return float(_split_loss(width, params, jnp.asarray(split.x), jnp.asarray(split.y)))


@dataclasses.dataclass
class Result:
    """One run: training losses per step, validation losses every ``EVAL_EVERY`` steps, and
    the final params' loss on the whole validation and test splits."""

    train: np.ndarray
    curve: np.ndarray
    validation: float
    test: float
    seconds: float


def train(method: Method, lr: float, seeds: tuple[int, ...], steps: int) -> list[Result]:
    """Run ``method`` at peak learning rate ``lr`` on every seed (one compile)."""
    run, out = trainer(method, steps), []
    for seed in seeds:
        start = time.perf_counter()
        params, x, y, keys = problem(seed)
        losses, curve, final = run(params, x, y, keys, jnp.float32(lr))
        ds = dataset()
        out.append(
            Result(
                np.asarray(losses),
                np.asarray(curve),
                split_loss(final, ds.validation),
                split_loss(final, ds.test),
                time.perf_counter() - start,
            )
        )
    return out


def next_rates(losses: dict[float, float]) -> tuple[float, ...]:
    """The rung of ``LADDER`` to try next: one beyond the best finite loss of ``losses`` when
    that best is at an end of what was tried (and the ladder goes on), else none."""
    tried = sorted(losses)
    finite = {lr: v for lr, v in losses.items() if math.isfinite(v)}
    if not finite:
        return ()
    best = min(finite, key=finite.get)
    i = LADDER.index(best)
    if best == tried[0] and i > 0:
        return (LADDER[i - 1],)
    if best == tried[-1] and i + 1 < len(LADDER):
        return (LADDER[i + 1],)
    return ()


def sweep(
    steps: int | None = None,
    methods: tuple[Method, ...] = ALL_METHODS,
    known: dict[str, dict[float, float]] | None = None,
) -> dict[str, dict[float, float]]:
    """The sweep behind ``LEARNING_RATES``: the final validation loss (whole split) per peak
    learning rate, on seed ``SWEEP_SEED`` with the full run's steps (not run by :func:`main`;
    ``python -m paper_figs.fig13_diloco --sweep`` prints it).

    Each method tries ``SWEEP_GRID``, then one more rung of ``LADDER`` beyond the best
    while the best is at an end of what it tried.  ``known`` holds losses already measured
    (skipped; the runs are deterministic).
    """
    steps = steps or FULL_STEPS
    out = {}
    for method in methods:
        run = trainer(method, steps)
        params, x, y, keys = problem(SWEEP_SEED)
        losses = dict((known or {}).get(method.label, {}))
        todo = tuple(lr for lr in SWEEP_GRID if lr not in losses) or next_rates(losses)
        while todo:
            for lr in todo:
                final = run(params, x, y, keys, jnp.float32(lr))[2]
                losses[lr] = split_loss(final, dataset().validation)
            todo = tuple(lr for lr in next_rates(losses) if lr not in losses)
        out[method.label] = dict(sorted(losses.items()))
        print(method.label, out[method.label], flush=True, file=sys.stderr)
    return out


def bits_per_char(nats: float) -> float:
    return nats / math.log(2)


def interval(
    mean: float, half: float, scale: float = 1.0, unit: str = "", sign: bool = False
) -> str:
    """``mean ± half`` (times ``scale``), or the mean alone for one seed (no interval)."""
    text = f"{scale * mean:{'+' if sign else ''}.{1 if unit == '%' else 3}f}"
    if math.isfinite(half):
        text += f" ± {scale * half:.{1 if unit == '%' else 3}f}"
    return text + unit


def against_exact(methods: tuple[Method, ...], results: dict[str, list[Result]]) -> str:
    """What compressing the pseudo-gradients costs: each compressed configuration's final
    validation loss against exact DiLoCo's at the same ``H``, paired by seed."""
    parts = []
    for m in methods:
        exact = Method("exact", m.sync_every).label
        if m.compressor in (None, "exact") or exact not in results:
            continue
        gap = paired_gap(results[m.label], results[exact])
        parts.append(f"{m.label} {interval(*gap, 100, '%', True)}")
    if not parts:
        return ""
    return (
        "Against exact DiLoCo at the same H (validation, paired by seed): " + "; ".join(parts) + "."
    )


def paired_gap(runs: list[Result], base: list[Result]) -> tuple[float, float]:
    """Mean and 95% half-width of ``L / L_dp - 1`` over the seeds (final validation loss)."""
    return common.mean_ci95(
        [r.validation / b.validation - 1 for r, b in zip(runs, base, strict=True)]
    )


def verdict(gaps: dict[str, tuple[float, float]], ratios: dict[str, float]) -> str:
    """The criterion of the module docstring over ``gaps`` (label -> (mean, half-width) of
    the relative gap) and ``ratios`` (label -> compression against data parallel)."""
    eligible = {k: g for k, g in gaps.items() if ratios[k] >= MIN_RATIO}
    if not eligible:
        return f"Did not reproduce: no configuration sends {MIN_RATIO:g}x fewer bits."
    closest = min(gaps, key=lambda n: gaps[n][0])
    anywhere = (
        f" At any compression the closest is {closest} ({ratios[closest]:.4g}x fewer bits): "
        f"{interval(*gaps[closest], 100, '%', True)}."
        if closest not in eligible
        else ""
    )
    sure = {k: g for k, g in eligible.items() if g[0] + g[1] < TOLERANCE}
    likely = {k: g for k, g in eligible.items() if g[0] < TOLERANCE}

    def best(group):
        k = min(group, key=lambda n: group[n][0] + group[n][1])
        m, h = group[k]
        return f"{k} ({ratios[k]:.4g}x fewer bits): {interval(m, h, 100, '%', True)}"

    if sure:
        return (
            f"Reproduced at this scale: {len(sure)} of {len(eligible)} configurations at >= "
            f"{MIN_RATIO:g}x fewer bits have the whole 95% interval of their validation gap "
            f"below +{100 * TOLERANCE:g}%; best {best(sure)}."
        )
    if likely:
        return (
            f"Partly reproduced: {len(likely)} of {len(eligible)} configurations at >= "
            f"{MIN_RATIO:g}x fewer bits are within {100 * TOLERANCE:g}% on the mean but no "
            f"interval lies below it; best {best(likely)}."
        )
    return (
        f"Did not reproduce at this scale: every configuration at >= {MIN_RATIO:g}x fewer "
        f"bits ends more than {100 * TOLERANCE:g}% above data parallel on the mean; closest "
        f"{best(eligible)}." + anywhere
    )


def best_rates(swept: dict[str, dict[float, float]]) -> dict[str, float]:
    """The learning rate of the least finite validation loss of each method of a :func:`sweep`."""
    return {
        label: min((v, lr) for lr, v in losses.items() if math.isfinite(v))[1]
        for label, losses in swept.items()
    }


COLORS = {None: "black", "exact": "tab:blue", "int8": "tab:green", "MXFP4": "tab:red"}
COLORS["SparseLoCo"] = "tab:purple"
STYLES = {1: "-", 10: "-", 50: "--", 100: ":"}


def band(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and 95% half-width over the first axis (the seeds), per column (0 for one seed)."""
    pairs = [common.mean_ci95(col) for col in np.asarray(values).T]
    mean, half = (np.array(v) for v in zip(*pairs, strict=True))
    return mean, np.where(np.isfinite(half), half, 0.0)


def draw(
    methods: tuple[Method, ...],
    results: dict[str, list[Result]],
    traffics: dict[str, Traffic],
    steps: int,
    path: pathlib.Path,
) -> list[str]:
    """The three panels; returns the labels of the curves left off the loss scale."""
    fig = Figure(figsize=(15, 5.2), layout="constrained")
    ax_tokens, ax_bits, ax_final = fig.subplots(1, 3)
    evals = np.arange(EVAL_EVERY, steps + 1, EVAL_EVERY)
    tokens = evals * WORKERS * BATCH * LENGTH / 1e6
    dp = results[DATA_PARALLEL.label]
    dp_final = np.mean([r.validation for r in dp])
    finals = [np.mean([r.validation for r in rs]) for rs in results.values()]
    top = bits_per_char(max(*finals, 1.3 * dp_final)) + 0.15
    off = []
    for m in methods:
        runs, tr = results[m.label], traffics[m.label]
        mean, half = band(bits_per_char(np.array([r.curve for r in runs])))
        style = dict(color=COLORS[m.compressor], ls=STYLES[m.sync_every])
        style["lw"] = 2.0 if m.compressor is None else 1.3
        label = m.label
        if mean.min() > top:
            off.append(m.label)
            label += " (off scale)"
        ax_tokens.plot(tokens, mean, label=label, **style)
        ax_tokens.fill_between(tokens, mean - half, mean + half, color=style["color"], alpha=0.1)
        ax_bits.plot(np.maximum(tr.cumulative(evals), 1.0), mean, **style)
        final = bits_per_char(np.array([r.validation for r in runs]))
        f_mean, f_half = common.mean_ci95(final)
        f_half = f_half if math.isfinite(f_half) else 0.0
        ax_final.errorbar(
            tr.per_step,
            f_mean,
            yerr=f_half,
            fmt="o",
            color=style["color"],
            capsize=3,
            mfc="white" if style["ls"] == ":" else style["color"],
        )
        ax_final.annotate(
            m.label.replace("DiLoCo ", ""),
            (tr.per_step, f_mean),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    dp_bits = traffics[DATA_PARALLEL.label].per_step
    ax_final.axhline(bits_per_char(dp_final) * (1 + TOLERANCE), color="gray", ls="--", lw=0.8)
    ax_final.axvline(dp_bits / MIN_RATIO, color="gray", ls="--", lw=0.8)
    low = bits_per_char(min(np.mean([r.validation for r in rs]) for rs in results.values()))
    for ax in (ax_tokens, ax_bits, ax_final):
        ax.set_ylim(low - 0.05, top)
        ax.grid(alpha=0.3)
    ax_tokens.set(
        xlabel="training characters (millions, all workers)", ylabel="validation bits per character"
    )
    ax_tokens.set_title(f"{TASK}, {WORKERS} workers: the global params")
    fig.legend(loc="outside lower center", ncol=7, fontsize=7)
    ax_bits.set(xscale="log", xlabel="cumulative bits sent per worker")
    ax_bits.set_title("against communication")
    ax_final.set(xscale="log", xlabel="bits per step per worker (averaged over a round)")
    ax_final.set_title(
        f"final (95% intervals); dashed: +{100 * TOLERANCE:g}% and {MIN_RATIO:g}x fewer bits"
    )
    fig.savefig(path, dpi=120)
    return off


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Train every method on every seed; write ``fig13_diloco.png`` and ``fig13_diloco.md``."""
    s = scale()
    params = problem(0)[0]
    results, traffics, seconds = {}, {}, {}
    for m in s.methods:
        start = time.perf_counter()
        results[m.label] = train(m, LEARNING_RATES[m.label], s.seeds, s.steps)
        seconds[m.label] = time.perf_counter() - start
        traffics[m.label] = traffic(m, params)
    dp_label = DATA_PARALLEL.label
    base, dp_bits = results[dp_label], traffics[dp_label].per_step
    ratios = {k: dp_bits / t.per_step for k, t in traffics.items()}
    gaps = {k: paired_gap(r, base) for k, r in results.items() if k != dp_label}
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{NAME}.png"
    off = draw(s.methods, results, traffics, s.steps, png)
    rows = []
    for m in s.methods:
        runs = results[m.label]
        val = [bits_per_char(r.validation) for r in runs]
        gap = "" if m is DATA_PARALLEL else interval(*gaps[m.label], scale=100, unit="%", sign=True)
        rows.append(
            f"| {m.label} | {LEARNING_RATES[m.label]:g} | {traffics[m.label].per_step:,.0f} | "
            f"{ratios[m.label]:,.4g}x | {', '.join(f'{v:.3f}' for v in val)} | "
            f"{interval(*common.mean_ci95(val))} | {gap} | "
            f"{interval(*common.mean_ci95([bits_per_char(r.test) for r in runs]))} | "
            f"{seconds[m.label]:.0f} |"
        )
    measured = (
        "Final losses of the global params on the whole validation and test splits (726 "
        "windows of 64 characters each), in bits per character; intervals are 95% Student-t "
        f"over seeds {list(s.seeds)}; the gap is `L / L_dp - 1` on validation, paired by seed. "
        "Bits: ring traffic leaving one worker, a round's messages averaged over its steps "
        "plus the per-step flag.\n\n"
        "| method | peak lr | bits/step/worker | fewer bits than DP | validation (per seed) | "
        "validation | gap to DP | test | seconds |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    against = against_exact(s.methods, results)
    if against:
        measured += "\n\n" + against
    if off:
        measured += f"\n\nOff the figure's loss scale: {', '.join(off)}."
    setting = (
        f"`{TASK}` (the harness's 431k-parameter causal transformer, 2 blocks of width 128, "
        f"on Python's pydoc prose, 80/10/10% train/validation/test), {WORKERS} workers "
        f"(vmap) with i.i.d. shards of the training text, {BATCH} sequences of {LENGTH} "
        f"characters per worker per step, {s.steps} steps ({s.steps * WORKERS * BATCH * LENGTH:,} "
        f"tokens), seeds {list(s.seeds)}; every method sees the same tokens. Inner AdamW "
        f"(weight decay {WEIGHT_DECAY}, {WARMUP} warm-up steps, cosine to {END_FRACTION:g} of "
        f"the peak) for all; DiLoCo's outer step Nesterov SGD (lr {OUTER_LR}, momentum "
        f'{OUTER_MOMENTUM}) on exact, int8 (`int_quant(8)`) or MXFP4 (`mx("float4_e2m1fn")`, '
        "E2M1 with a power-of-two scale per 32 entries, with error feedback) pseudo-gradients; "
        "SparseLoCo at its defaults (32 of 4096, 2-bit "
        "values, error decay 0.95, outer lr 1). Peak learning rates: the best final validation "
        f"loss over {list(SWEEP_GRID)}, extended along {list(LADDER)} while the best was at an "
        f"end, on seed {SWEEP_SEED} (`--sweep`; the table is in the module). Validation curves on "
        f"{CURVE_EXAMPLES} windows every {EVAL_EVERY} steps. "
        f"Criterion (fixed before the run): some configuration at >= {MIN_RATIO:g}x fewer bits "
        f"whose 95% interval of the validation gap lies below +{100 * TOLERANCE:g}%: "
        f"reproduced; only its mean: partly. H = 100 makes {s.steps // 100} rounds in "
        f"{s.steps} steps; the 1000 steps that would give it 10 would take 45 to 60 minutes here."
    )
    md = common.section(
        NAME,
        "Figure 13: DiLoCo with compressed pseudo-gradients, and SparseLoCo, against data parallel",
        claim=(
            "DiLoCo (H inner AdamW steps per round, a Nesterov outer step) reaches the "
            "validation loss of data-parallel training with about H-fold less communication, "
            "and compressing its pseudo-gradients (int8, 4-bit floats, SparseLoCo's 2-bit "
            "chunked top-k) cuts it further: stated here as some DiLoCo configuration within "
            f"{100 * TOLERANCE:g}% of data parallel's validation loss at >= {MIN_RATIO:g}x "
            "fewer bits."
        ),
        setting=setting,
        measured=measured,
        verdict=verdict(gaps, ratios),
        out_dir=out_dir,
    )
    return [png, md]


if __name__ == "__main__":
    if "--sweep" in sys.argv[1:]:
        swept = sweep()
        for label, losses in swept.items():
            print(label, {lr: round(v, 4) for lr, v in losses.items()})
        print("LEARNING_RATES =", best_rates(swept))
    else:
        for p in main():
            print(p)
