"""``make bench-gpu``: the codecs on an accelerator, as a fraction of its memory bandwidth.

A codec streams its input once and its payload twice (written by
``compress``, read by ``decompress``), then writes the output: its least
traffic is ``8 n + 2 p`` bytes for ``n`` float32 entries and a payload of
``p`` bytes.  This benchmark times ``compress`` and ``decompress`` (two
jitted calls, :func:`experiments.common.timing.codec_calls`) and the
copy ``x * 2`` (``8 n`` bytes), and reports each as bytes per second and as
a fraction of the chip's nominal memory bandwidth (:data:`PEAK_BYTES_PER_S`,
from the vendor's data sheet; ``--peak-tbs`` for another chip).  The goal is
50% of it (:data:`HBM_GOAL`) for every codec on ``2**24`` entries; the other
sections are reported without a verdict, with their ratio to the copy (the
CPU goals of ``make bench``, measured here on the accelerator).

Timing: a round dispatches ``--batch`` calls back to back and waits for the
last, so the host's dispatch overlaps the device's work
(:func:`experiments.common.timing.interleaved` with ``batch``);
the figure is the median over ``--rounds`` rounds of the mean call,
interleaved round by round with the copy.  A call's dispatch is still in it
where the device's work is shorter: on an H100 the copy of ``2**24``
entries reached 65% of the nominal bandwidth, of ``2**26`` 81%.  The JSON is
rewritten after every section, so a run stopped early keeps what it measured.

The transform EDEN and DRIVE rotate with takes a different form on an
accelerator (:func:`compjax.hadamard.fwht`); :func:`check_transform` records
its error there against the Hadamard matrix, beside the times.

Usage::

    python -m experiments.gpu.run                 # every section (an H100: over 5 minutes)
    python -m experiments.gpu.run --quick         # 2**16 entries, any backend (a smoke run)
    python -m experiments.gpu.run --render results/bench_gpu.json   # the table again
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from compjax import hadamard
from experiments.common import codecs, timing
from experiments.common.machine import machine

#: Nominal memory bandwidth (bytes/s) by a substring of ``device_kind``, first match wins.
#: NVIDIA's data sheets: H200 4.8 TB/s, H100 NVL 3.9, H100 SXM 3.35, H100 PCIe 2.0,
#: A100 80GB 2.039, A100 40GB 1.555 (TB = 10^12 bytes).
PEAK_BYTES_PER_S = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB", 2.039e12),
    ("A100", 1.555e12),
)
#: The least fraction of the nominal bandwidth a codec should reach on ``2**24`` entries.
HBM_GOAL = 0.5
#: The section the goal is judged on.
GOAL_SECTION = "2^24"
#: Error feedback's and SparseLoCo's selections, beside :data:`experiments.common.codecs.CODECS`.
TOPK = {
    "top_k(ratio=0.01)": partial(compjax.top_k, ratio=codecs.EF_TOPK_RATIO),
    "top_k(ratio=0.01, select='threshold')": partial(
        compjax.top_k, ratio=codecs.EF_TOPK_RATIO, select="threshold"
    ),
    "chunked_top_k(k=32, chunk=4096)": partial(compjax.chunked_top_k, k=32, chunk=4096),
}


def peak_bandwidth(device_kind: str) -> float | None:
    """The nominal bandwidth of a chip, or None where :data:`PEAK_BYTES_PER_S` lacks it."""
    for name, peak in PEAK_BYTES_PER_S:
        if name.lower() in device_kind.lower():
            return peak
    return None


def sections(quick: bool) -> dict[str, dict]:
    """Each section's shapes, bucket size and codecs (spec -> factory), the goal's first.

    ``quick`` shrinks them: ``2**16`` and ``2**18`` entries, the tree's
    output channels divided by 8, and ``2**16``-entry buckets.
    """
    log2 = 16 if quick else 24
    every = {c.spec: partial(timing.make_compressor, c.spec) for c in codecs.CODECS}
    elementwise = {s: every[s] for s in codecs.specs("roofline_buckets")}
    tree = codecs.resnet50_shapes()
    if quick:
        tree = [(max(1, s[0] // 8), *s[1:]) for s in tree]
    bucket_log2 = 16 if quick else codecs.BUCKET_LOG2
    return {
        f"2^{log2}": {"shapes": [(2**log2,)], "bucket_size": None, "codecs": every | TOPK},
        f"2^{log2 + 2}": {"shapes": [(4 * 2**log2,)], "bucket_size": None, "codecs": every | TOPK},
        f"ResNet-50 tree in buckets of 2^{bucket_log2}": {
            "shapes": tree,
            "bucket_size": 2**bucket_log2,
            "codecs": elementwise,
        },
        "ResNet-50 tree": {"shapes": tree, "bucket_size": None, "codecs": every},
    }


def traffic(entries: int, payload_bytes: float) -> float:
    """The least bytes a codec moves: input and output once, its payload twice."""
    return 8.0 * entries + 2.0 * payload_bytes


def bench_section(section: dict, rounds: int, batch: int, peak: float | None) -> dict:
    """Every codec of a section against the copy of the same arrays."""
    xs = timing.random_tree(section["shapes"])
    entries = sum(math.prod(s) for s in section["shapes"])
    keys = timing.codec_keys(xs, section["bucket_size"])
    copy = jax.jit(lambda xs: [x * 2.0 for x in xs])
    out = {"entries": entries, "bucket_size": section["bucket_size"], "codecs": {}}
    for spec, factory in section["codecs"].items():
        enc, dec = timing.codec_calls(factory(), xs, section["bucket_size"])
        payloads = jax.block_until_ready(enc(keys, xs))
        times = timing.interleaved(
            {
                "copy": partial(copy, xs),
                "compress": partial(enc, keys, xs),
                "decompress": partial(dec, payloads),
            },
            rounds,
            batch=batch,
        )
        codec = [c + d for c, d in zip(times["compress"], times["decompress"], strict=True)]
        payload_bytes = sum(compjax.wire_bits(p) for p in payloads) / 8
        row = {
            "times": times,
            "median_s": {k: timing.median(v) for k, v in times.items()}
            | {"codec": timing.median(codec)},
            "ratio": timing.median(timing.ratios(codec, times["copy"])),
            "payload_bytes": payload_bytes,
            "traffic_bytes": traffic(entries, payload_bytes),
        }
        row["bytes_per_s"] = row["traffic_bytes"] / row["median_s"]["codec"]
        row["copy_bytes_per_s"] = 8.0 * entries / row["median_s"]["copy"]
        row["of_peak"] = None if peak is None else row["bytes_per_s"] / peak
        row["copy_of_peak"] = None if peak is None else row["copy_bytes_per_s"] / peak
        out["codecs"][spec] = row
        share = "" if peak is None else f", {100 * row['of_peak']:5.1f}% of the peak"
        print(f"  {spec:40s} {row['ratio']:6.2f}x the copy{share}", flush=True)
    return out


def check_transform(log2: int = 12, rotated_log2: int = 24) -> dict:
    """The device's Walsh-Hadamard transform against ``scipy.linalg.hadamard`` (float64), and
    EDEN's 3-round rotation there undone, on ``2**rotated_log2`` entries: max abs errors."""
    from scipy import linalg

    n = 2**log2
    x = np.random.default_rng(0).standard_normal((4, n))
    y = np.asarray(jax.jit(hadamard.fwht)(jnp.asarray(x, jnp.float32)), np.float64)
    z = jax.random.normal(jax.random.key(7), (2**rotated_log2,), jnp.float32)
    key = jax.random.key_data(jax.random.key(8))
    rot = jax.jit(lambda z: hadamard.unrotate_key(key, hadamard.rotate_key(key, z, 3), 3))
    return {
        "n": n,
        "fwht_max_abs_error": float(np.max(np.abs(y - x @ linalg.hadamard(n) / np.sqrt(n)))),
        "rotated_n": 2**rotated_log2,
        "rotation_roundtrip_max_abs_error": float(jnp.max(jnp.abs(rot(z) - z))),
    }


def rows(res: dict) -> list[dict]:
    """A row per section and codec; ``goal`` None off the goal's section or without a peak."""
    out = []
    for name, section in res["sections"].items():
        for spec, r in section["codecs"].items():
            judged = name == GOAL_SECTION and r["of_peak"] is not None
            out.append(
                {
                    "section": name,
                    "codec": spec,
                    "ratio": r["ratio"],
                    "codec_us": 1e6 * r["median_s"]["codec"],
                    "copy_us": 1e6 * r["median_s"]["copy"],
                    "gbs": r["bytes_per_s"] / 1e9,
                    "of_peak": r["of_peak"],
                    "copy_of_peak": r["copy_of_peak"],
                    "goal": f">= {HBM_GOAL:.0%} of the peak" if judged else None,
                    "met": (r["of_peak"] >= HBM_GOAL) if judged else None,
                }
            )
    return out


def markdown(res: dict) -> str:
    """The results table (one per section), with the goal's verdicts and the machine."""
    peak, device = res["peak_bytes_per_s"], res["device"]
    lines = [
        f"# make bench-gpu: {device['kind']} ({device['backend']}), jax {res['machine']['jax']}",
        "",
        "Nominal memory bandwidth: "
        + (f"{peak / 1e12:.2f} TB/s." if peak else "unknown (fractions of the copy only)."),
        f"Traffic counted: 8 n + 2 payload bytes a codec, 8 n a copy. Rounds {res['rounds']}, "
        f"{res['batch']} calls each; {res['seconds']:.0f} s.",
    ]
    check = res.get("transform_check")
    if check:
        lines.append(
            "Walsh-Hadamard transform (products with H_64): max abs error "
            f"{check['fwht_max_abs_error']:.1e} against the matrix on {check['n']:,} entries; "
            f"EDEN's 3-round rotation undone on {check['rotated_n']:,}: "
            f"{check['rotation_roundtrip_max_abs_error']:.1e}."
        )
    table = rows(res)
    for name in res["sections"]:
        section = [r for r in table if r["section"] == name]
        entries = res["sections"][name]["entries"]
        copy = statistics.median(r["copy_us"] for r in section) if section else float("nan")
        copy_share = [r["copy_of_peak"] for r in section if r["copy_of_peak"] is not None]
        lines += [
            "",
            f"## {name}: {entries:,} float32 entries; the copy {copy:,.0f} us"
            + (f", {100 * statistics.median(copy_share):.0f}% of the peak" if copy_share else ""),
            "",
            "| codec | compress + decompress, us | × the copy | GB/s | of the peak | goal |",
            "|---|---|---|---|---|---|",
        ]
        for r in section:
            share = "" if r["of_peak"] is None else f"{100 * r['of_peak']:.1f}%"
            verdict = "" if r["goal"] is None else ("MET" if r["met"] else "MISSED")
            lines.append(
                f"| `{r['codec']}` | {r['codec_us']:,.0f} | {r['ratio']:.2f} | "
                f"{r['gbs']:,.0f} | {share} | {verdict} |"
            )
    judged = [r for r in table if r["met"] is not None]
    if judged:
        met = sum(r["met"] for r in judged)
        lines += ["", f"Goal (>= {HBM_GOAL:.0%} of the peak on 2^24): {met} of {len(judged)} met."]
    return "\n".join(lines) + "\n"


def write(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(res, indent=1))
    (out / "bench_gpu.md").write_text(markdown(res))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gpu.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="2^16 entries, a smaller tree")
    parser.add_argument("--out", default="results", help="output directory")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="calls dispatched per round")
    parser.add_argument("--sections", help="comma-separated section names (default: all)")
    parser.add_argument("--peak-tbs", type=float, help="the chip's memory bandwidth, TB/s")
    parser.add_argument("--render", help="rewrite the table of a saved JSON and exit")
    args = parser.parse_args(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(res))
        print(markdown(res))
        return 0
    dev = jax.devices()[0]
    peak = 1e12 * args.peak_tbs if args.peak_tbs else peak_bandwidth(dev.device_kind)
    chosen = sections(args.quick)
    if args.sections:
        names = args.sections.split(",")
        unknown = set(names) - set(chosen)
        if unknown:
            raise SystemExit(f"--sections: unknown {sorted(unknown)}; known {list(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in names}
    res = {
        "machine": machine(),
        "device": {"kind": dev.device_kind, "backend": jax.default_backend()},
        "peak_bytes_per_s": peak,
        "rounds": args.rounds or (2 if args.quick else 7),
        "batch": args.batch or (2 if args.quick else 10),
        "sections": {},
        "transform_check": None,
        "seconds": 0.0,
    }
    start, out = time.perf_counter(), Path(args.out)
    res["transform_check"] = check_transform(rotated_log2=16 if args.quick else 24)
    print(f"transform check: {res['transform_check']}", flush=True)
    for name, section in chosen.items():
        print(f"{name}", flush=True)
        res["sections"][name] = bench_section(section, res["rounds"], res["batch"], peak)
        res["seconds"] = time.perf_counter() - start
        write(res, out)
    print(markdown(res))
    print(f"wrote {out / 'bench_gpu.json'} and {out / 'bench_gpu.md'} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
