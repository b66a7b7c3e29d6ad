"""Figure 11: the variance-per-bit frontier of the unbiased compressors on real gradients.

Vargaftik, Ben Basat, Portnoy, Mendelson, Ben-Itzhak, Mitzenmacher, "EDEN:
Communication-Efficient and Robust Distributed Mean Estimation for Federated
Learning", ICML 2022 (arXiv:2108.08842): a random rotation and one bit per
rotated coordinate with an unbiased scale gives a normalised variance
(vNMSE) ``E||C(x) - x||^2 / ||x||^2`` of about ``pi/2 - 1 ~ 0.571`` for large
``d``, far below the other unbiased one- and two-bit schemes (QSGD,
TernGrad, random sparsification), whose variance grows with the dimension.

What runs: the minibatch gradients (batch 128) of the digits MLP that
``paper_figs/compressors.py`` keeps (steps 0, 10 and 40 of SGD), every
unbiased compressor of the library at several settings (QSGD's levels and
buckets, TernGrad, natural compression, natural dithering's levels,
rand-k's ratios, ATOMO, EDEN with 1, 2 and 4 bits) applied layer by layer,
as the harness applies them, with :data:`NUM_KEYS` keys per
gradient: the measured vNMSE (summed over layers, averaged over keys and
gradients, a normal 95% interval over the keys) against the bits per
coordinate counted from the payloads (``compjax.wire_bits``).  The
unbiased Pareto frontier (no other unbiased compressor both cheaper and
less noisy) is drawn; the biased compressors (DRIVE, signs, top-k, casts)
are shown hollow with their NMSE, outside the frontier.

Criterion: reproduced if (1) ``eden(bits=1)`` is on the unbiased frontier,
(2) its vNMSE is within :data:`EDEN_TOLERANCE` of the padding-corrected
large-d value (below) and (3) every unbiased compressor of another family
that sends at most :data:`BITS_FACTOR` times EDEN's bits per coordinate has
at least :data:`FAR_FACTOR` times its vNMSE; partly reproduced if (1) or (3)
holds.  Criteria (2) and (3) were amended after the first run, whose
versions were mis-specified (the section says so and gives both outcomes):
(2) compared with ``pi/2 - 1`` itself, but a layer of ``d`` entries padded
to ``d'`` drops the padding's share of the rotated error, so its vNMSE is
about ``(pi/2 - 1) d / d'`` (0.357 for the 640- and 10-entry layers, measured
0.356 and 0.36; 0.571 for the 4096-entry one, measured 0.570); (3) counted
EDEN's own 2-bit version as a rival.

Writes ``out/fig11_variance_per_bit.png`` and ``out/fig11_variance_per_bit.md``.
"""

from __future__ import annotations

import math
import pathlib

import jax
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter
from tqdm.auto import tqdm

from compjax.compressors.eden import padded_size
from experiments.common import data, methods
from paper_figs import common, compressors
from paper_figs.fig8_frontier import pareto_front

NAME = "fig11_variance_per_bit"
OUT_DIR = common.OUT_DIR
SEED = 0
EDEN = "eden(bits=1)"
EDEN_LIMIT = math.pi / 2 - 1
#: Criterion (2): EDEN's vNMSE within this relative distance of pi/2 - 1.
EDEN_TOLERANCE = 0.10
#: Criterion (3): other unbiased compressors with at most BITS_FACTOR x EDEN's bits per
#: coordinate must have at least FAR_FACTOR x its vNMSE.
BITS_FACTOR = 2.0
FAR_FACTOR = 2.0

# (spec, family): the unbiased compressors, then the biased ones shown for reference.
UNBIASED: tuple[tuple[str, str], ...] = (
    *(
        (f"qsgd(levels={s}{'' if b is None else f', bucket_size={b}'})", "QSGD")
        for b in (None, 512)
        for s in (1, 4, 16)
    ),
    ("terngrad()", "TernGrad"),
    ("blockwise(terngrad(), 512)", "TernGrad"),
    ("natural()", "natural"),
    *((f"natural_dithering(levels={s})", "natural dithering") for s in (3, 8)),
    *((f"rand_k(ratio={r})", "rand-k") for r in (0.01, 0.25)),
    ("atomo(budget=16)", "ATOMO"),
    *((f"eden(bits={b})", "EDEN") for b in (1, 2, 4)),
    *((f"int_quant(bits={b})", "integer") for b in (2, 4, 8)),
)
BIASED: tuple[tuple[str, str], ...] = (
    ("drive()", "biased"),
    ("scaled_sign()", "biased"),
    ("l2_scaled_sign()", "biased"),
    ("top_k(ratio=0.01)", "biased"),
    ("cast('bfloat16')", "biased"),
)
#: Keys per gradient (the compiles, one per compressor and layer shape, dominate the time).
NUM_KEYS = 200
FAMILY_COLORS = {
    "QSGD": "tab:green",
    "TernGrad": "tab:olive",
    "natural": "tab:cyan",
    "natural dithering": "tab:blue",
    "rand-k": "tab:orange",
    "ATOMO": "tab:purple",
    "EDEN": "tab:red",
    "integer": "tab:brown",
    "biased": "gray",
}


def padded_limit(gradients: list) -> float:
    """EDEN's large-d vNMSE with each layer's padding dropped: the mean over the gradients
    of ``sum_l (pi/2 - 1) (d_l / d'_l) ||g_l||^2 / sum_l ||g_l||^2``."""
    values = []
    for grads in gradients:
        leaves = jax.tree.leaves(grads)
        norms = [float(np.sum(np.square(np.asarray(g, np.float64)))) for g in leaves]
        kept = [g.size / padded_size(g.size) for g in leaves]
        values.append(EDEN_LIMIT * np.dot(kept, norms) / sum(norms))
    return float(np.mean(values))


def plot(rows: list[dict], title: str, path: pathlib.Path) -> None:
    fig = Figure(figsize=(13, 7), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    floor = min(r["m"].error for r in rows if r["m"].error > 0) / 4
    heights = [max(r["m"].error, floor) for r in rows]
    front = [r for r in rows if r["front"]]
    front.sort(key=lambda r: r["m"].bits_per_coordinate)
    ax.step(
        [r["m"].bits_per_coordinate for r in front],
        [r["m"].error for r in front],
        where="post",
        color="gray",
        lw=1.5,
        alpha=0.7,
        zorder=1,
    )
    ax.axhline(EDEN_LIMIT, color="tab:red", ls=":", lw=1)
    ax.text(
        0.995,
        EDEN_LIMIT,
        "π/2 − 1 ",
        transform=ax.get_yaxis_transform(),
        ha="right",
        va="bottom",
        fontsize=8,
        color="tab:red",
    )
    handles = []
    for r, y in zip(rows, heights, strict=True):
        m, color = r["m"], FAMILY_COLORS[r["family"]]
        if m.unbiased:
            style = {"marker": "o", "mfc": color, "mec": "black" if r["front"] else color}
        else:
            style = {"marker": "s", "mfc": "none", "mec": color}
        x = m.bits_per_coordinate
        if m.halfwidth > 0:
            ax.plot([x, x], [max(y - m.halfwidth, floor), y + m.halfwidth], color=color, lw=1)
        handles.append(ax.plot(x, y, ls="", ms=8, mew=1.5, zorder=3, **style)[0])
    ax.autoscale_view()
    compressors._number_points(ax, [r["m"] for r in rows], heights)
    legend = [
        Line2D([], [], marker="o" if f != "biased" else "s", ls="", mfc=c, mec="black", ms=8)
        for f, c in FAMILY_COLORS.items()
    ]
    labels = [
        f if f != "biased" else "biased (hollow: NMSE, not on the frontier)" for f in FAMILY_COLORS
    ]
    legend.append(Line2D([], [], color="gray", lw=1.5))
    labels.append("unbiased Pareto frontier (black rim)")
    ax.legend(legend, labels, loc="lower left", fontsize=8.5, framealpha=0.9)
    key = fig.legend(
        handles,
        [f"{i:>2}  {r['m'].spec}" for i, r in enumerate(rows, start=1)],
        loc="outside right upper",
        fontsize=8,
        frameon=False,
    )
    for text in key.get_texts():
        text.set_family("monospace")
    ax.set_xlabel("bits per coordinate (wire bits of all layers / number of entries)")
    ax.set_ylabel(r"vNMSE  $\sum_l E\|C(g_l) - g_l\|^2 \;/\; \sum_l \|g_l\|^2$")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    fig.savefig(path, dpi=120)


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Measure every compressor on the gradients, plot the frontier, write the section."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = data.digits(SEED)
    gradients, test_accuracy = compressors.train_gradients(dataset, SEED)
    rows = []
    for spec, family in tqdm((*UNBIASED, *BIASED), desc=NAME, leave=False):
        comp = methods.parse(spec).compressor
        rows.append(
            {"family": family, "m": compressors.measure(spec, comp, gradients, SEED, NUM_KEYS)}
        )
    unbiased = [r for r in rows if r["m"].unbiased]
    front = pareto_front(
        [r["m"].bits_per_coordinate for r in unbiased], [-r["m"].error for r in unbiased]
    )
    for r in rows:
        r["front"] = False
    for r, f in zip(unbiased, front, strict=True):
        r["front"] = bool(f)

    eden = next(r["m"] for r in rows if r["m"].spec == EDEN)
    on_front = next(r["front"] for r in rows if r["m"].spec == EDEN)
    predicted = padded_limit(gradients)
    near_limit = abs(eden.error - predicted) <= EDEN_TOLERANCE * predicted
    near_raw = abs(eden.error - EDEN_LIMIT) <= EDEN_TOLERANCE * EDEN_LIMIT  # first run's (2)
    cheap = [
        r
        for r in unbiased
        if r["m"].spec != EDEN
        and r["m"].bits_per_coordinate <= BITS_FACTOR * eden.bits_per_coordinate
    ]
    rivals = [r["m"] for r in cheap if r["family"] != "EDEN"]
    far_below = all(m.error >= FAR_FACTOR * eden.error for m in rivals)
    far_raw = all(r["m"].error >= FAR_FACTOR * eden.error for r in cheap)  # first run's (3)
    closest = min(rivals, key=lambda m: m.error) if rivals else None

    sizes = [leaf.shape for leaf in jax.tree.leaves(gradients[0])]
    figure = out_dir / f"{NAME}.png"
    plot(
        rows,
        f"Variance per bit on real gradients (digits MLP, {len(gradients)} gradients x "
        f"{NUM_KEYS} keys)",
        figure,
    )
    table = [
        "| # | compressor | unbiased | bits/coord | vNMSE (NMSE if biased) ± 95% CI "
        "| ω bound | on the unbiased frontier |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, start=1):
        m = r["m"]
        bound = "—" if not m.unbiased or m.bound is None else compressors._fmt(m.bound)
        mark = "—" if not m.unbiased else ("**yes**" if r["front"] else "no")
        table.append(
            f"| {i} | `{m.spec}` | {'yes' if m.unbiased else 'no'} | "
            f"{m.bits_per_coordinate:.3g} | {compressors._fmt(m.error)} ± "
            f"{compressors._fmt(m.halfwidth)} | {bound} | {mark} |"
        )
    frontier = sorted((r["m"] for r in unbiased if r["front"]), key=lambda m: m.bits_per_coordinate)
    measured = (
        "\n".join(table)
        + "\n\nThe unbiased frontier, cheapest first: "
        + ", ".join(f"`{m.spec}` ({m.bits_per_coordinate:.3g} b, {m.error:.3g})" for m in frontier)
        + f". `{EDEN}`: {eden.bits_per_coordinate:.3g} bits per coordinate, vNMSE "
        f"{eden.error:.4f} ± {eden.halfwidth:.4f} (π/2 − 1 = {EDEN_LIMIT:.4f}; with each "
        f"layer's padding dropped {predicted:.4f}). "
        + (
            f"The least noisy unbiased compressor of another family within {BITS_FACTOR:g}x "
            "its bits is "
            f"`{closest.spec}` ({closest.bits_per_coordinate:.3g} b, vNMSE {closest.error:.3g}, "
            f"{closest.error / eden.error:.1f}x EDEN's)."
            if closest
            else f"No other unbiased compressor sends at most {BITS_FACTOR:g}x its bits."
        )
    )
    word = (
        "Reproduced"
        if on_front and near_limit and far_below
        else ("Partly reproduced" if on_front or far_below else "Did not reproduce")
    )
    raw_word = (
        "reproduced"
        if on_front and near_raw and far_raw
        else ("partly reproduced" if on_front or far_raw else "did not reproduce")
    )
    verdict = (
        f"{word}. Criteria: (1) `{EDEN}` on the unbiased frontier "
        f"({'yes' if on_front else 'no'}); (2) its vNMSE within {EDEN_TOLERANCE:.0%} of the "
        f"padding-corrected large-d value {predicted:.4f} ({'yes' if near_limit else 'no'}: "
        f"{eden.error:.4f}); (3) every unbiased compressor of another family with at most "
        f"{BITS_FACTOR:g}x its bits per coordinate at least {FAR_FACTOR:g}x noisier "
        f"({'yes' if far_below else 'no'}: {len(rivals)} of them"
        + (
            f", the least noisy `{closest.spec}` at {closest.error / eden.error:.1f}x"
            if closest
            else ""
        )
        + "). Criteria (2) and (3) were amended after the first run: as first stated, (2) "
        f"compared with π/2 − 1 = {EDEN_LIMIT:.4f} itself ({'yes' if near_raw else 'no'} "
        "here), ignoring that a layer padded from d to d' entries drops the padding's share "
        "of the rotated error (vNMSE ≈ (π/2 − 1)·d/d': the 4096-entry layer measures 0.57, "
        "the 640- and 10-entry ones, padded to 1024 and 16, about 0.36), and (3) counted "
        f"EDEN's own 2-bit version as a rival; under them the verdict was '{raw_word}'. "
        "EDEN pays for the padding in bits (1.11 bits per coordinate, with one float32 scale "
        "per layer). The intervals are over the keys for these fixed gradients."
    )
    widths = "-".join(map(str, (dataset.train.x.shape[1], *compressors.MLP().features)))
    setting = (
        f"The minibatch gradients (batch {compressors.BATCH_SIZE}) of an MLP {widths} trained "
        f"with SGD (lr {compressors.LEARNING_RATE}, seed {SEED}, test accuracy "
        f"{test_accuracy:.1%} after {compressors.STEPS} steps) on scikit-learn's digits at "
        f"steps {', '.join(map(str, compressors.CHECKPOINTS))}, as `paper_figs/compressors.py` "
        f"takes them. Each compressor is applied per layer (shapes "
        f"{', '.join(map(str, sizes))}) with {NUM_KEYS} keys per gradient; the "
        "vNMSE sums the squared error and the squared norm over the layers and averages over "
        "keys and gradients; bits are the payloads' `compjax.wire_bits` over all layers per "
        "entry. Unbiased compressors are filled circles, biased ones hollow squares (their "
        "NMSE, for reference only)."
    )
    md = common.section(
        NAME,
        "Figure 11 — variance per bit of the unbiased compressors on real gradients",
        claim=(
            "At one bit per coordinate EDEN's normalised variance is about π/2 − 1 ≈ 0.571 for "
            "large d, far below other unbiased one- and two-bit schemes (Vargaftik et al. 2022)."
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
