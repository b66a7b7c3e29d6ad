"""Figure 9: when does compression pay?  Predicted speedup vs bandwidth and worker count.

In the style of TernGrad's performance model (Wen et al., NeurIPS 2017,
Section 5): the step time of data-parallel training is compute plus
communication, communication follows the alpha-beta model of ring
collectives (:mod:`compjax.costmodel`), and a compressed method adds its
compress + decompress time.  Agarwal et al. (MLSys 2022) found that gradient
compression gave a real speedup in only 6 of 200+ setups; this figure says
where, in the model, compression stops paying.

What is computed (nothing is trained):

* the gradient is ResNet-50-sized: a pytree of ``jax.ShapeDtypeStruct`` with
  ResNet-50's 161 parameter tensors (25,557,032 parameters; conv kernels in
  PyTorch's ``(out, in, kh, kw)`` layout, so PowerSGD's ``out x rest`` matrix
  view is the paper's; fc ``1000 x 2048`` plus biases and batch-norm vectors);
* each method's bits per worker per step come from the payloads
  (``compjax.communication``), split into all-reduced and all-gathered bits the
  way the harness does (``experiments.common.methods.Method.gathered``).  Every
  compjax transformation works leaf by leaf, so the bits are counted once per
  distinct shape and multiplied by its number of tensors (plus one 8-bit
  non-finite flag per step);
* each method's codec overhead is measured on this CPU: its transformation with
  ``axis_name=None`` (compress, decode, memories) jitted on one real-size
  float32 gradient of 25.5M entries (a ``4096 x 6240`` matrix, so PowerSGD's
  matrix products have the same total size as ResNet-50's), the median of a few
  runs after a warm-up, minus the same time for ``dense()`` (the shared
  non-finite check and copy).  This is CPU time, pessimistic against a GPU
  kernel; decoding the other workers' messages of all-gather methods is not
  included.  A second row of panels assumes a free codec (the communication-only
  model);
* the compute time per step is an assumption, :data:`COMPUTE_S`.

Measurements are cached under ``results/fig9_speedup/`` (keyed by method,
machine and JAX version) like the harness's runs.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

import compjax
from compjax import costmodel
from compjax.advise.codec_timing import median_seconds
from experiments.common import methods
from experiments.harness import train
from paper_figs import common
from paper_figs.fig9_network import measured_on_network

NAME = "fig9_speedup"
OUT_DIR = common.OUT_DIR

# Assumed forward + backward time of one step: ResNet-50 at batch 32 per worker on a V100 in
# float32 (about 320 images/s).
COMPUTE_S = 0.1
LATENCY_US = 5.0  # per message, the cost model's default
WORKERS = (4, 8, 16, 64)
BANDWIDTHS_GBPS = np.geomspace(0.1, 100.0, 121)
HIGH_BANDWIDTHS_GBPS = (10.0, 25.0, 40.0, 100.0)  # the data-centre setups counted for the verdict
TIMING_SHAPE = (4096, 6240)  # 25,559,040 entries, about ResNet-50's gradient

# (label, method expression, colour).  The first is the baseline.
METHODS = (
    ("dense float32", "dense()", "black"),
    ("bf16 cast", "cast('bfloat16')", "tab:gray"),
    ("TernGrad, int8 ternaries summed", "terngrad_allreduce()", "tab:orange"),
    ("TernGrad, 2-bit codes", "terngrad()", "tab:brown"),
    ("QSGD 4 levels, bucket 512", "qsgd(levels=4, bucket_size=512)", "tab:red"),
    ("natural compression", "natural()", "tab:purple"),
    ("signSGD (majority vote)", "signsgd()", "tab:pink"),
    # The shapes are PyTorch's (cout, cin, kh, kw): each kernel is the cout x (cin kh kw)
    # matrix, as PyTorch's hook views it (the flax default sent 53 of 54 kernels dense).
    ("PowerSGD rank 4", "powersgd(rank=4, channels_last=False)", "tab:blue"),
    ("DGC 0.1%", "dgc(ratio=0.001)", "tab:green"),
)


def repeats() -> int:
    return 5 if common.full() else 3


# --- the gradient's shapes ------------------------------------------------------------------


def resnet50_shapes() -> dict:
    """ResNet-50's parameter tensors as ``jax.ShapeDtypeStruct`` (float32), PyTorch layouts.

    A 7x7 stem, bottleneck stages of 3, 4, 6, 3 blocks (widths 64-512, expansion
    4, a projection shortcut in each stage's first block), batch-norm scale and
    bias after every convolution, and the 2048 -> 1000 classifier:
    25,557,032 parameters in 161 tensors (torchvision's ``resnet50``).
    """
    tree: dict = {}

    def conv(name, k, cin, cout):
        tree[name] = {"kernel": (cout, cin, k, k)}

    def bn(name, c):
        tree[name] = {"scale": (c,), "bias": (c,)}

    conv("conv1", 7, 3, 64)
    bn("bn1", 64)
    cin = 64
    stages = ((64, 3), (128, 4), (256, 6), (512, 3))  # (width, blocks)
    for stage, (width, blocks) in enumerate(stages, start=1):
        for block in range(blocks):
            prefix = f"layer{stage}_{block}"
            conv(f"{prefix}_conv1", 1, cin, width)
            bn(f"{prefix}_bn1", width)
            conv(f"{prefix}_conv2", 3, width, width)
            bn(f"{prefix}_bn2", width)
            conv(f"{prefix}_conv3", 1, width, 4 * width)
            bn(f"{prefix}_bn3", 4 * width)
            if block == 0:
                conv(f"{prefix}_downsample", 1, cin, 4 * width)
                bn(f"{prefix}_downsample_bn", 4 * width)
            cin = 4 * width
    tree["fc"] = {"kernel": (1000, 2048), "bias": (1000,)}
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tree, is_leaf=lambda x: isinstance(x, tuple)
    )


# --- bits -----------------------------------------------------------------------------------


def message_bits(spec: str, shapes, workers: int) -> tuple[int, int]:
    """``(all-reduced, all-gathered)`` payload bits of one worker's messages per step.

    These are message sizes (``communication()``'s ``payloads``), the cost
    model's input: it applies each collective's ring factor itself.  Counted
    by ``compjax.communication`` once per distinct leaf shape (the
    transformations work leaf by leaf) and multiplied by the number of leaves of
    that shape; the per-step non-finite flag is counted once.  Equal to
    ``communication`` on the whole tree (tested), several times faster to trace.
    """
    method = methods.parse(spec)
    tx = method.build("data")
    counts = collections.Counter(
        (s.shape, jnp.dtype(s.dtype).name) for s in jax.tree.leaves(shapes)
    )
    reduced = gathered = flag = 0
    for (shape, dtype), count in counts.items():
        report = compjax.communication(tx, jax.ShapeDtypeStruct(shape, dtype), "data", workers)
        for kind, bits in report.payloads:
            if kind == "flag":
                flag = max(flag, bits)
            elif method.gathered(kind):
                gathered += count * bits
            else:
                reduced += count * bits
    return reduced + flag, gathered


# --- codec time -----------------------------------------------------------------------------


def codec_seconds(spec: str, shape=TIMING_SHAPE, runs: int = 3, seed: int = 0) -> float:
    """Median seconds of one jitted update of ``spec``'s transformation (``axis_name=None``).

    On one float32 gradient of ``shape`` (values ~ N(0, 1e-6)), after a warm-up
    call that compiles.
    """
    tx = methods.parse(spec).build(None)
    rng = np.random.default_rng(seed)
    g = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-3))
    state = tx.init(g)
    update = jax.jit(lambda g, s: tx.update(g, s, g))
    return median_seconds(lambda: update(g, state), runs)


# --- the model ------------------------------------------------------------------------------


def speedup(bandwidth_gbps, workers, dense_bits, reduced, gathered, overhead_s, compute_s):
    """``compjax.costmodel.speedup`` at one bandwidth."""
    network = costmodel.Network(float(bandwidth_gbps), LATENCY_US)
    return costmodel.speedup(compute_s, dense_bits, reduced, gathered, overhead_s, workers, network)


def crossing_bandwidth(workers, dense_bits, reduced, gathered, overhead_s, compute_s) -> float:
    """The bandwidth (Gbit/s) above which the method no longer pays (speedup < 1).

    ``math.inf`` when it pays at every bandwidth up to 1e5 Gbit/s, ``0.0`` when
    it never pays down to 1e-3 Gbit/s.  Speedup falls with bandwidth when the
    method sends less than dense; solved by bisection on log bandwidth.
    """

    def gain(log_b):
        b = 10.0**log_b
        return speedup(b, workers, dense_bits, reduced, gathered, overhead_s, compute_s) - 1

    lo, hi = -3.0, 5.0
    if gain(hi) > 0:
        return math.inf
    if gain(lo) <= 0:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return 10.0 ** ((lo + hi) / 2)


def _fmt_cross(b: float) -> str:
    if b == math.inf:
        return "always"
    if b == 0.0:
        return "never"
    if b > 1e3:
        return "> 1000"  # latency terms only: far beyond any real link
    return f"{b:.3g}"


# --- measurements, cached -------------------------------------------------------------------


def _cache_path(spec: str, runs: int) -> pathlib.Path:
    key = json.dumps(
        {
            "spec": spec,
            "shape": TIMING_SHAPE,
            "runs": runs,
            "workers": max(WORKERS),
            "jax": jax.__version__,
            "code": train.code_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return common.RESULTS / NAME / f"{methods.slug(spec)}-{digest}.json"


def measure(spec: str, shapes) -> dict:
    """Bits and codec seconds of ``spec`` (read back if this machine measured them before)."""
    runs = repeats()
    path = _cache_path(spec, runs)
    if path.exists():
        return json.loads(path.read_text())
    reduced, gathered = message_bits(spec, shapes, max(WORKERS))
    result = {
        "spec": spec,
        "reduced_bits": reduced,
        "gathered_bits": gathered,
        "codec_s": codec_seconds(spec, runs=runs),
        "runs": runs,
        "measured_on": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


# --- figure ---------------------------------------------------------------------------------


def main(out_dir: pathlib.Path = OUT_DIR) -> list[pathlib.Path]:
    """Measure bits and codec times, write ``fig9_speedup.png`` and ``fig9_speedup.md``."""
    shapes = resnet50_shapes()
    params = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
    dense_bits = 32 * params
    measured = {spec: measure(spec, shapes) for _, spec, _ in METHODS}
    floor = measured["dense()"]["codec_s"]
    overhead = {spec: max(m["codec_s"] - floor, 0.0) for spec, m in measured.items()}
    compressed = [m for m in METHODS if m[1] != "dense()"]

    def gathers(spec):
        return measured[spec]["gathered_bits"] > measured[spec]["reduced_bits"]

    def curve(spec, n, with_overhead):
        m = measured[spec]
        o = overhead[spec] if with_overhead else 0.0
        args = (n, dense_bits, m["reduced_bits"], m["gathered_bits"], o, COMPUTE_S)
        return np.array([speedup(b, *args) for b in BANDWIDTHS_GBPS]), crossing_bandwidth(*args)

    fig = Figure(figsize=(17, 8.2), layout="constrained")
    axes = fig.subplots(2, len(WORKERS), sharex=True, sharey=True)
    crossings = {}
    for row, with_overhead in enumerate((False, True)):
        for col, n in enumerate(WORKERS):
            ax = axes[row, col]
            for label, spec, color in compressed:
                values, cross = curve(spec, n, with_overhead)
                crossings[(spec, n, with_overhead)] = cross
                style = "--" if gathers(spec) else "-"
                ax.plot(BANDWIDTHS_GBPS, values, style, color=color, lw=1.6, label=label)
                if BANDWIDTHS_GBPS[0] <= cross <= BANDWIDTHS_GBPS[-1]:
                    ax.plot(cross, 1.0, "o", color=color, ms=5, mec="black", mew=0.5)
            ax.axhline(1.0, color="black", lw=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            scenario = "free codec" if not with_overhead else "measured CPU codec time"
            ax.set_title(f"{n} workers, {scenario}", fontsize=10)
            if row == 1:
                ax.set_xlabel("bandwidth per link (Gbit/s)")
            if col == 0:
                ax.set_ylabel("predicted speedup over dense (step time ratio)")
            if n == 8 and not with_overhead:
                ax.plot(1.0, 3.0, "*", color="gold", ms=14, mec="black", zorder=5)
                ax.annotate(
                    "TernGrad paper:\nAlexNet, 8 GPUs,\n1 Gbit/s ≈ 3×",
                    (1.0, 3.0),
                    xytext=(0.15, 0.08),
                    textcoords="data",
                    fontsize=8.5,
                    arrowprops={"arrowstyle": "->", "color": "0.3"},
                )
    axes[0, 0].set_ylim(0.03, 60)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    labels = [
        f"{label} ({'all-gather' if gathers(spec) else 'all-reduce'})"
        for label, spec, _ in compressed
    ]
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle(
        f"Predicted speedup of compressed data-parallel training, ResNet-50 gradient "
        f"({params / 1e6:.1f}M parameters), compute {COMPUTE_S} s/step, ring collectives, "
        f"latency {LATENCY_US:g} µs; dots: speedup = 1 (compression stops paying)",
        fontsize=11,
    )
    png = out_dir / f"{NAME}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)

    # Numbers.
    def at(spec, n, b, with_overhead):
        m = measured[spec]
        o = overhead[spec] if with_overhead else 0.0
        return speedup(b, n, dense_bits, m["reduced_bits"], m["gathered_bits"], o, COMPUTE_S)

    rows = [
        "| method | all-reduced / all-gathered Mbit per worker per step | compression | codec "
        "s (CPU, net of dense) | speedup n=8, 1 Gbit/s (free / measured) | crossing bandwidth "
        "Gbit/s, free codec: n=" + " / ".join(map(str, WORKERS)) + " | crossing, measured "
        "codec: n=" + " / ".join(map(str, WORKERS)) + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, spec, _ in METHODS:
        m = measured[spec]
        bits = m["reduced_bits"] + m["gathered_bits"]
        cells = [
            f"{label} `{spec}`",
            f"{m['reduced_bits'] / 1e6:.3g} / {m['gathered_bits'] / 1e6:.3g}",
            f"{dense_bits / bits:.3g}×",
            f"{overhead[spec]:.3f}" + (f" (raw {m['codec_s']:.3f})" if spec == "dense()" else ""),
        ]
        if spec == "dense()":
            cells += ["1 / 1", "—", "—"]
        else:
            cells.append(f"{at(spec, 8, 1.0, False):.2f} / {at(spec, 8, 1.0, True):.2f}")
            for flag in (False, True):
                cells.append(" / ".join(_fmt_cross(crossings[(spec, n, flag)]) for n in WORKERS))
        rows.append("| " + " | ".join(cells) + " |")

    setups = [
        (spec, n, b) for _, spec, _ in compressed for n in WORKERS for b in HIGH_BANDWIDTHS_GBPS
    ]
    pays = {flag: sum(at(s, n, b, flag) > 1 for s, n, b in setups) for flag in (False, True)}
    pays_all = sum(
        at(spec, n, b, True) > 1
        for _, spec, _ in compressed
        for n in WORKERS
        for b in BANDWIDTHS_GBPS
    )
    grid_all = len(compressed) * len(WORKERS) * len(BANDWIDTHS_GBPS)
    tern = at("terngrad_allreduce()", 8, 1.0, False)
    tern_measured = at("terngrad_allreduce()", 8, 1.0, True)
    ok_tern = tern >= 2.0
    ok_rare = pays[True] < 0.1 * len(setups)
    word = (
        "Reproduced"
        if ok_tern and ok_rare
        else ("Partly reproduced" if ok_tern or ok_rare else "Did not reproduce")
    )
    high = ", ".join(f"{b:g}" for b in HIGH_BANDWIDTHS_GBPS)
    measured_md = (
        f"Dense all-reduce of {dense_bits / 1e6:.1f} Mbit at n = 8: "
        + ", ".join(
            f"{costmodel.Network(b, LATENCY_US).allreduce(dense_bits, 8):.3g} s at {b:g} Gbit/s"
            for b in (1.0, 10.0, 100.0)
        )
        + f", against {COMPUTE_S} s of compute.\n\n"
        + "\n".join(rows)
        + f'\n\nCrossing bandwidth: above it the method is slower than dense ("always": pays '
        f'up to 1e5 Gbit/s; "never": not even at 1e-3 Gbit/s; "> 1000": it loses only to the '
        "latency of its extra 8-bit flag all-reduce, at bandwidths no link has). Codec "
        "seconds measured on "
        f"{measured['dense()']['measured_on']} ({measured['dense()']['runs']} runs after a "
        f"warm-up; the machine was shared, so they are noisy); dense's own time "
        f"({floor:.3f} s) is subtracted. At ≥ 10 Gbit/s ({high}) "
        f"compression pays in {pays[False]} of {len(setups)} (method, n, bandwidth) setups "
        f"with a free codec and in {pays[True]} of {len(setups)} with the measured CPU codec "
        f"time; over the whole 0.1–100 Gbit/s grid with measured codec time, in {pays_all} "
        f"of {grid_all}."
    )
    setting = (
        f"No training. ResNet-50's {len(jax.tree.leaves(shapes))} parameter tensors "
        f"({params:,} parameters, PyTorch layouts) as `jax.ShapeDtypeStruct`; bits from "
        "`compjax.communication` per distinct shape (times its count), all-reduce vs "
        "all-gather by `experiments.common.methods.parse(spec).gathered(kind)`; codec time of the "
        f"method's transformation with `axis_name=None` on one {TIMING_SHAPE[0]}×"
        f"{TIMING_SHAPE[1]} float32 gradient, jitted, median of {repeats()} runs after a "
        f"warm-up, minus dense's; `compjax.costmodel` (ring all-reduce "
        f"2(n−1)α + 2(n−1)/n·b/β, all-gather (n−1)(α + b/β), one fused message of each kind "
        f"per step, α = {LATENCY_US:g} µs), no overlap of compute and communication; "
        f"assumed compute {COMPUTE_S} s per step (ResNet-50 forward + backward at batch 32 "
        "per worker on a V100, float32). Bandwidths 0.1–100 Gbit/s, n ∈ "
        f"{{{', '.join(map(str, WORKERS))}}}. TernGrad all-reduce sends int8 ternaries "
        "(psum of integers), TernGrad 2-bit all-gathers packed codes."
    )
    verdict = (
        f"{word}. Criteria: (1) TernGrad's performance model — `terngrad_allreduce()` at "
        f"8 workers and 1 Gbit/s with a free codec predicts ≥ 2× (paper: ≈ 3× for AlexNet): "
        f"{tern:.2f}× ({'yes' if ok_tern else 'no'}; {tern_measured:.2f}× with the CPU codec "
        f"time); (2) Agarwal et al.'s finding that compression rarely pays — with the measured "
        f"codec time, fewer than 10% of the ≥ 10 Gbit/s setups pay: {pays[True]} of "
        f"{len(setups)} ({'yes' if ok_rare else 'no'}). With a free codec compression pays in "
        f"{pays[False]} of those {len(setups)} setups: in this model it is the codec time "
        f"against the few milliseconds a fast network needs that decides, and CPU codec "
        f"times are an upper bound on a GPU's."
    )
    network_md, network_verdict = measured_on_network(out_dir)
    md = common.section(
        NAME,
        "Figure 9 — when compression pays: predicted speedup vs bandwidth and workers",
        claim=(
            "TernGrad's performance model predicts large speedups on slow networks (AlexNet, "
            "8 GPUs, 1 Gbit/s: ≈ 3×); Agarwal et al. (MLSys 2022) measured a speedup from "
            "compression in only 6 of 200+ setups: on fast networks the codec's cost eats "
            "the saving."
        ),
        setting=setting,
        measured=measured_md + "\n\n" + network_md,
        verdict=verdict + " " + network_verdict,
        out_dir=out_dir,
    )
    return [png, md]


if __name__ == "__main__":
    for path in main():
        print(path)
