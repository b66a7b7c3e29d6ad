"""Measured error of every catalogued compressor on real gradients, against its theory.

A small MLP is trained for a few SGD steps on scikit-learn's digits and its
minibatch gradient is kept at a few checkpoints.  Every compressor of
:func:`compjax.table.catalogue` is applied layer-wise (to each leaf of the
gradient pytree) with many PRNG keys, and the relative error
``sum_l E||C(g_l) - g_l||^2 / sum_l ||g_l||^2`` is plotted against the bits
sent per coordinate, with the theoretical bound (``omega`` for unbiased
compressors, ``1 - delta`` for biased ones, worst case over the layers)
marked at the same abscissa.

Writes ``out/compressors.png`` and ``out/compressors.md``.  Run with
``python -m paper_figs`` (all figures) or ``python -m paper_figs.compressors``.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter
from tqdm import tqdm

import compjax
from compjax.table import catalogue
from experiments.common.data import Dataset, digits
from experiments.common.models import MLP, accuracy, cross_entropy

SEED = 0
STEPS = 40
CHECKPOINTS = (0, 10, 40)
BATCH_SIZE = 128
LEARNING_RATE = 0.1
NUM_KEYS = 400
OUT_DIR = pathlib.Path(__file__).parent / "out"

# Colours of the compressors in turn, so that a point and its bound pair up: tab10, then
# Dark2 without its grey (tab10 has one), then two more.
COLORS = [
    *matplotlib.colormaps["tab10"].colors,
    *matplotlib.colormaps["Dark2"].colors[:7],
    "black",
    "navy",
]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One compressor's measured error on the gradients and its theoretical bound.

    Attributes:
      spec: the catalogue's spec string.
      unbiased: whether the compressor claims ``E[C(x)] = x``.
      bits_per_coordinate: wire bits over all layers per gradient entry.
      samples: relative error per key, averaged over the checkpoints.
      bias: relative squared bias ``||mean_k C_k(g) - g||^2 / ||g||^2``,
        averaged over the checkpoints (``None`` for biased compressors).
      bound: ``max_l omega(d_l)`` (unbiased) or ``1 - min_l delta(d_l)``
        (biased), ``None`` where the compressor gives no guarantee.
    """

    spec: str
    unbiased: bool
    bits_per_coordinate: float
    samples: np.ndarray
    bias: float | None
    bound: float | None

    @property
    def error(self) -> float:
        return float(np.mean(self.samples))

    @property
    def halfwidth(self) -> float:
        """Half-width of the normal 95% confidence interval of :attr:`error`.

        0 when every key gives the same error up to rounding (deterministic compressors).
        """
        halfwidth = 1.96 * np.std(self.samples, ddof=1) / np.sqrt(len(self.samples))
        return float(halfwidth) if halfwidth > 1e-9 * self.error else 0.0

    @property
    def noise_floor(self) -> float:
        """Expected :attr:`bias` of an unbiased compressor: the error over the number of keys."""
        return self.error / len(self.samples)

    @property
    def within_bound(self) -> bool | None:
        """Whether the error is at most the bound within its confidence interval."""
        if self.bound is None:
            return None
        return self.error - self.halfwidth <= self.bound * (1 + 1e-6)


def train_gradients(data: Dataset, seed: int) -> tuple[list, float]:
    """Train the MLP with minibatch SGD; return its gradients at the checkpoints.

    The gradient at checkpoint ``t`` is the minibatch gradient at the
    parameters after ``t`` updates.  Also returns the test accuracy after
    :data:`STEPS` updates.
    """
    model = MLP()
    params = model.init(jax.random.key(seed), data.train.x[:1])

    @jax.jit
    def grad_fn(params, x, y):
        return jax.grad(lambda p: cross_entropy(model.apply(p, x), y))(params)

    rng = np.random.default_rng(seed)
    gradients = []
    for step in range(STEPS + 1):
        batch = rng.choice(len(data.train), BATCH_SIZE, replace=False)
        grads = grad_fn(params, data.train.x[batch], data.train.y[batch])
        if step in CHECKPOINTS:
            gradients.append(grads)
        if step < STEPS:
            params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    test_accuracy = accuracy(model.apply(params, data.test.x), data.test.y)
    return gradients, float(test_accuracy)


@functools.partial(jax.jit, static_argnums=0)
def _leaf_samples(comp: compjax.Compressor, keys: jax.Array, leaf: jax.Array):
    """``||C_k(leaf) - leaf||^2`` for every key, the mean of ``C_k(leaf)``, one payload."""
    outputs = jax.vmap(comp, in_axes=(0, None))(keys, leaf)
    errors = jnp.sum(jnp.square(outputs - leaf).reshape(keys.shape[0], -1), axis=1)
    return errors, jnp.mean(outputs, axis=0), comp.compress(keys[0], leaf)


def _checkpoint_samples(comp: compjax.Compressor, keys: jax.Array, grads):
    """Relative error per key, relative squared bias and wire bits on one gradient pytree."""
    errors, bias, norm, bits = 0.0, 0.0, 0.0, 0
    for leaf in jax.tree.leaves(grads):
        leaf_errors, mean, payload = _leaf_samples(comp, keys, leaf)
        errors = errors + np.asarray(leaf_errors, np.float64)
        bias += float(jnp.sum(jnp.square(mean - leaf)))
        norm += float(jnp.sum(jnp.square(leaf)))
        bits += compjax.wire_bits(payload)
    return errors / norm, bias / norm, bits


def theoretical_bound(comp: compjax.Compressor, sizes: list[int]) -> float | None:
    """Worst case over layers of ``omega`` (unbiased) or ``1 - delta`` (biased)."""
    if comp.unbiased:
        omegas = [comp.omega(d) for d in sizes]
        return None if None in omegas else max(omegas)
    deltas = [comp.delta(d) for d in sizes]
    return None if None in deltas else 1.0 - min(deltas)


def measure(
    spec: str, comp: compjax.Compressor, gradients: list, seed: int, num_keys: int = NUM_KEYS
) -> Measurement:
    """Apply ``comp`` layer-wise to every gradient with ``num_keys`` keys."""
    sizes = [leaf.size for leaf in jax.tree.leaves(gradients[0])]
    samples, biases = [], []
    for i, grads in enumerate(gradients):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), num_keys)
        relative, bias, bits = _checkpoint_samples(comp, keys, grads)
        samples.append(relative)
        biases.append(bias)
    return Measurement(
        spec=spec,
        unbiased=comp.unbiased,
        bits_per_coordinate=bits / sum(sizes),
        samples=np.mean(samples, axis=0),
        bias=float(np.mean(biases)) if comp.unbiased else None,
        bound=theoretical_bound(comp, sizes),
    )


def _fmt(value: float) -> str:
    if 0 < 1 - value < 1e-3:
        return f"1 − {1 - value:.3g}"
    return f"{value:.3g}" if value == 0 or 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


def markdown(results: list[Measurement], setting: str) -> str:
    """The results as a markdown table under a sentence on the setting."""
    header = (
        "| # | compressor | unbiased | bits/coord | measured rel. error ± 95% CI "
        "| bound | within bound | rel. bias (noise floor) |"
    )
    lines = [setting, "", header, "|" + "---|" * 8]
    for number, r in enumerate(results, start=1):
        bound = "—" if r.bound is None else ("ω = " if r.unbiased else "1 − δ = ") + _fmt(r.bound)
        within = {None: "—", True: "yes", False: "**no**"}[r.within_bound]
        bias = "—" if r.bias is None else f"{_fmt(r.bias)} ({_fmt(r.noise_floor)})"
        error = f"{_fmt(r.error)} ± {_fmt(r.halfwidth)}"
        row = [str(number), f"`{r.spec}`", "yes" if r.unbiased else "no"]
        row += [f"{r.bits_per_coordinate:.3g}", error, bound, within, bias]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _box(centre: np.ndarray, width: float, height: float) -> tuple[float, ...]:
    return (
        centre[0] - width / 2,
        centre[1] - height / 2,
        centre[0] + width / 2,
        centre[1] + height / 2,
    )


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _label_offsets(axes, points: list, ticks: list, labels: list[str]) -> list[np.ndarray]:
    """Offsets in points for each label, beside its point, avoiding markers and other labels.

    Tries the eight directions around the point, then the same farther out, and takes
    the first with the fewest overlaps.
    """
    to_points = 72 / axes.figure.dpi

    def where(xy):
        return np.asarray(axes.transData.transform(xy)) * to_points

    obstacles = [_box(where(p), 8, 8) for p in points] + [_box(where(t), 16, 4) for t in ticks]
    directions = [(1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1)]
    offsets = []
    for point, label in zip(points, labels, strict=True):
        width, height = 5.5 * len(label) + 1, 9
        candidates = [
            np.array([dx * (width / 2 + 4.5 * reach), dy * (height / 2 + 4.5 * reach)])
            for reach in (1, 2.5)
            for dx, dy in directions
        ]
        boxes = [_box(where(point) + offset, width, height) for offset in candidates]
        clashes = [sum(_overlap(box, other) for other in obstacles) for box in boxes]
        best = int(np.argmin(clashes))
        obstacles.append(boxes[best])
        offsets.append(candidates[best])
    return offsets


def _draw(axes, r: Measurement, y: float, color) -> Line2D:
    """One compressor: its bound and its measured point at height ``y`` (returned)."""
    x = r.bits_per_coordinate
    if r.bound is not None and r.bound > 0:
        axes.plot([x, x], [y, r.bound], ":", color=color, lw=1.2)
        axes.plot(x, r.bound, "_", color=color, ms=16, mew=2.5)
    if r.unbiased:
        style = {"marker": "o" if r.error > 0 else "v", "color": color, "mec": "black", "mew": 0.5}
    else:
        # Hollow, so that an unbiased point at the same place shows through.
        style = {"marker": "s" if r.error > 0 else "v", "mfc": "none", "mec": color, "mew": 2}
    return axes.plot(x, y, ls="", ms=8, zorder=3, **style)[0]


def _number_points(axes, results: list[Measurement], heights: list[float]) -> None:
    """Write each compressor's number next to its point."""
    points = [(r.bits_per_coordinate, y) for r, y in zip(results, heights, strict=True)]
    ticks = [(r.bits_per_coordinate, r.bound) for r in results if r.bound]
    labels = [str(number) for number in range(1, len(results) + 1)]
    for point, label, offset in zip(
        points, labels, _label_offsets(axes, points, ticks, labels), strict=True
    ):
        axes.annotate(
            label,
            point,
            xytext=offset,
            textcoords="offset points",
            ha="center",
            va="center",
            fontsize=9,
        )


def _marker_legend(axes) -> None:
    """What the marker shapes mean, inside the axes."""
    hollow = {"mfc": "none", "mec": "black", "ms": 8, "ls": ""}
    handles = [
        Line2D([], [], marker="o", color="gray", mec="black", mew=0.5, ms=8, ls=""),
        Line2D([], [], marker="s", mew=2, **hollow),
        Line2D([], [], marker="_", color="black", ms=16, mew=2.5, ls=""),
        Line2D([], [], marker="v", **hollow),
    ]
    labels = [
        "unbiased (filled): relative variance",
        "biased (hollow): relative error",
        r"bound: $\omega$ (unbiased), $1-\delta$ (biased)",
        "error exactly 0 (drawn at the bottom)",
    ]
    axes.legend(handles, labels, loc="lower left", fontsize=9, framealpha=0.9)


def plot(results: list[Measurement], title: str, path: pathlib.Path) -> None:
    """Log-log scatter of measured error vs bits/coordinate with the bounds, numbered."""
    fig = Figure(figsize=(11.5, 6.5), layout="constrained")
    axes = fig.add_subplot()
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    floor = min(r.error for r in results if r.error > 0) / 4
    heights = [r.error if r.error > 0 else floor for r in results]
    handles = [
        _draw(axes, r, y, COLORS[i % len(COLORS)])
        for i, (r, y) in enumerate(zip(results, heights, strict=True))
    ]
    axes.autoscale_view()
    _number_points(axes, results, heights)
    _marker_legend(axes)
    labels = [f"{number:>2}  {r.spec}" for number, r in enumerate(results, start=1)]
    key = fig.legend(handles, labels, loc="outside right upper", fontsize=8.5, frameon=False)
    for text in key.get_texts():
        text.set_family("monospace")
    axes.set_xlabel("bits per coordinate (wire bits of all layers / number of entries)")
    axes.set_ylabel(r"relative error  $\sum E\|C(g_l) - g_l\|^2 \;/\; \sum \|g_l\|^2$")
    axes.set_title(title, fontsize=11)
    axes.grid(True, which="major", alpha=0.3)
    fig.savefig(path, dpi=130)


def main(out_dir: pathlib.Path = OUT_DIR, seed: int = SEED) -> list[pathlib.Path]:
    """Measure every catalogued compressor, write the figure and the table, return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = digits(seed)
    gradients, test_accuracy = train_gradients(data, seed)
    results = [
        measure(spec, comp, gradients, seed)
        for spec, comp in tqdm(catalogue().items(), desc="compressors")
    ]
    sizes = [leaf.shape for leaf in jax.tree.leaves(gradients[0])]
    widths = "-".join(map(str, (data.train.x.shape[1], *MLP().features)))
    steps = ", ".join(map(str, CHECKPOINTS))
    setting = (
        f"Minibatch gradients (batch {BATCH_SIZE}) of an MLP {widths} trained with SGD "
        f"(learning rate {LEARNING_RATE}, {STEPS} steps, seed {seed}, test accuracy "
        f"{test_accuracy:.1%}) on scikit-learn's digits, at steps {steps}. "
        f"Each compressor is applied per layer (shapes {', '.join(map(str, sizes))}) with "
        f"{NUM_KEYS} keys per checkpoint; the relative error is summed over layers, "
        "averaged over keys and checkpoints. The bound is the worst case over the layers; "
        "the relative bias of an unbiased compressor should match its noise floor "
        f"(error / {NUM_KEYS})."
    )
    figure, table = out_dir / "compressors.png", out_dir / "compressors.md"
    plot(results, f"Compressors on MLP gradients (digits, {NUM_KEYS} keys, seed {seed})", figure)
    table.write_text(markdown(results, setting))
    return [figure, table]


if __name__ == "__main__":
    for output in main():
        print(output)
