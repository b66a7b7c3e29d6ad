"""``make bench``: speed of compjax's compressors against baselines measured in the same run.

Every figure is a ratio against a baseline timed in the same run, interleaved
with it round by round (so a machine that slows down slows both), and
reported as the median over the rounds after warm-up calls:

* **roofline**: each compressor's (:data:`experiments.common.codecs.CODECS`,
  one line each) ``compress`` plus ``decompress`` (two jitted calls; the
  payload is materialised as it would be on the wire) on a ``2**24``-entry
  float32 gradient and on a ResNet-50-like tree (161 leaves, 25.6M
  parameters), against a jitted ``x * 2`` of the same arrays (one read and
  one write of each); and on the same tree cut into ``2**22``-entry buckets
  (``bucket_size=``: each bucket encoded from its pieces of leaves, decoded
  into them); and that bucketed tree with its kernels in Flax's HWIO layout
  (no goal: the tree's torchvision layout ends its kernels in dimensions of
  1, 3 or 7, over which XLA's CPU backend runs the decoders' loops).
  Elementwise compressors are held to 2x the copy everywhere; EDEN (1 bit) to
  3x on ``2**24`` entries; the other rotation-based ones (EDEN 2 and 4 bits,
  DRIVE) and EDEN on the tree are reported without a goal;
* **Hadamard**: :func:`compjax.hadamard.fwht` and EDEN's randomized rotation
  (3 rounds, signs drawn from the key) on ``2**24`` entries against the copy;
* **PyTorch**: the same compressors written plainly in PyTorch
  (:mod:`experiments.bench.torch_baselines`) on the same arrays and CPU, and
  ``compjax.powersgd`` against PyTorch's DDP ``powerSGD_hook`` on the same
  matrices (two workers each);
* **top-k**: DGC's sampled threshold
  (:func:`compjax.compressors.selection.sampled_threshold_select`) against
  the exact ``jax.lax.top_k`` at ratio 0.001 of ``2**24`` entries;
* **training step**: a data-parallel MLP step over 8 simulated devices
  (``shard_map``) with ``compjax.compress(comp)`` against the same step with
  a plain ``pmean``;
* **memory**: XLA's compiled memory analysis of ``compress`` and
  ``decompress`` (temporaries plus outputs) over the input's bytes.

The codecs, sizes and goals are :mod:`experiments.common.codecs`; the verdicts
and tables :mod:`experiments.bench.report`.  Writes ``results/bench.json``
(every raw time, the medians, machine and library versions, thread counts,
load averages) and ``results/bench.md`` (the table with each goal, MET or
MISSED), and prints the table.

Usage::

    python -m experiments.bench.run            # everything (7.5 min + 3-5 min per EDEN codec)
    python -m experiments.bench.run --quick    # fewer repeats, smaller step (a smoke run)

The multi-device parts run in subprocesses of this module (``--part step``,
``--part powersgd``) with ``XLA_FLAGS=--xla_force_host_platform_device_count``
set before JAX starts (:mod:`experiments.bench.parts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

import compjax
from compjax import hadamard
from compjax.compressors import selection as dgc_select
from experiments.bench import parts
from experiments.bench import report as bench_report
from experiments.common.codecs import (
    BUCKET_LOG2,
    CODECS,
    DGC_RATIO,
    EF_TOPK_RATIO,
    HADAMARD_ROUNDS,
    HWIO_PART,
    MLP_BATCH_PER_WORKER,
    MLP_WIDTHS,
    NO_YNN,
    POWERSGD_RANK,
    STEP_WORKERS,
    N,
    hwio,
    resnet50_shapes,
    specs,
)
from experiments.common.machine import load_average, machine
from experiments.common.timing import (
    codec_calls,
    codec_keys,
    interleaved,
    make_compressor,
    median,
    random_tree,
    ratios,
)


# -- roofline ------------------------------------------------------------------------------------
def bench_roofline(shapes, specs, repeats: int, bucket_size: int | None = None) -> dict:
    """compress + decompress of every leaf (one jitted call each) against ``x * 2``.

    With ``bucket_size``, the tree is cut into buckets of that many entries
    (:class:`compjax.transforms.buckets.Buckets`, as ``bucket_size=`` does in
    ``compjax.compress``): compress encodes each bucket from its pieces
    (:meth:`compjax.Compressor.compress_pieces`; a compressor that is not
    elementwise concatenates them first), decompress decodes them into the
    pieces and rebuilds the tree's leaves.
    """
    xs = random_tree(shapes)
    keys, copy = codec_keys(xs, bucket_size), jax.jit(lambda xs: [x * 2.0 for x in xs])
    out = {"shapes": [list(s) for s in shapes], "entries": sum(math.prod(s) for s in shapes)}
    out["bucket_size"] = bucket_size
    out["compressors"] = {}
    for spec in specs:
        enc, dec = codec_calls(make_compressor(spec), xs, bucket_size)
        payloads = jax.block_until_ready(enc(keys, xs))
        faults: dict = {}
        times = interleaved(
            {
                "copy": partial(copy, xs),
                "compress": partial(enc, keys, xs),
                "decompress": partial(dec, payloads),
            },
            repeats,
            faults=faults,
        )
        rounds = ratios(
            [c + d for c, d in zip(times["compress"], times["decompress"], strict=True)],
            times["copy"],
        )
        out["compressors"][spec] = {
            "times": times,
            "ratio_per_round": rounds,
            "ratio": median(rounds),
            "compress_ratio": median(ratios(times["compress"], times["copy"])),
            "decompress_ratio": median(ratios(times["decompress"], times["copy"])),
            "median_s": {k: median(v) for k, v in times.items()},
            "page_faults_per_call": {k: median(v) for k, v in faults.items()},
            "wire_bits_per_entry": sum(compjax.wire_bits(p) for p in payloads) / out["entries"],
        }
        print(f"  {spec:34s} {median(rounds):5.2f}x the copy", flush=True)
    return out


def bench_hadamard(repeats: int) -> dict:
    """:func:`compjax.hadamard.fwht` and EDEN's rotation on ``2**24`` entries against ``x * 2``.

    The rotation is the one EDEN's compress makes: ``HADAMARD_ROUNDS`` rounds
    ``H D_r ... H D_1 x`` with the sign diagonals drawn from the key in the
    same call (:func:`compjax.hadamard.rotate_key`: flips drawn from the
    entries' indices).  Interleaved with the copy, round by round.
    """
    x = jax.random.normal(jax.random.key(4), (N,), jnp.float32)
    key = jax.random.key(5)
    copy = jax.jit(lambda x: x * 2.0)
    fwht = jax.jit(hadamard.fwht)
    rotate = jax.jit(lambda key, x: hadamard.rotate_key(key, x, HADAMARD_ROUNDS))
    faults: dict = {}
    times = interleaved(
        {"copy": partial(copy, x), "fwht": partial(fwht, x), "rotate": partial(rotate, key, x)},
        repeats,
        faults=faults,
    )
    out = {
        "n": N,
        "rounds": HADAMARD_ROUNDS,
        "times": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "page_faults_per_call": {k: median(v) for k, v in faults.items()},
    }
    for name in ("fwht", "rotate"):
        out[f"{name}_ratio_per_round"] = ratios(times[name], times["copy"])
        out[f"{name}_ratio"] = median(out[f"{name}_ratio_per_round"])
        print(f"  {name:34s} {out[f'{name}_ratio']:5.2f}x the copy", flush=True)
    return out


def bench_memory(specs) -> dict:
    """XLA's compiled memory analysis of compress and decompress on 2**24 entries."""
    x = jax.ShapeDtypeStruct((N,), jnp.float32)
    key = jax.random.key(0)
    in_bytes = N * 4
    out = {"input_bytes": in_bytes, "compressors": {}}

    def usage(compiled):
        m = compiled.memory_analysis()
        return {
            "temp_bytes": int(m.temp_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "argument_bytes": int(m.argument_size_in_bytes),
        }

    copy = usage(jax.jit(lambda x: x * 2.0).lower(x).compile())
    out["copy"] = copy
    for spec in specs:
        comp = make_compressor(spec)
        enc = usage(jax.jit(comp.compress).lower(key, x).compile())
        payload = jax.eval_shape(comp.compress, key, x)
        dec = usage(jax.jit(comp.decompress).lower(payload).compile())
        out["compressors"][spec] = {
            "compress": enc,
            "decompress": dec,
            "compress_ratio": (enc["temp_bytes"] + enc["output_bytes"]) / in_bytes,
            "decompress_ratio": (dec["temp_bytes"] + dec["output_bytes"]) / in_bytes,
        }
    return out


# -- PyTorch -------------------------------------------------------------------------------------
def bench_torch(shapes, specs, repeats: int) -> dict | None:
    try:
        from experiments.bench import torch_baselines as bench_torch
    except ImportError as err:  # torch absent: the rows say so
        return {"error": f"torch not importable: {err}"}
    times = bench_torch.time_compressors(specs, shapes, repeats)
    out = {
        "machine": bench_torch.machine(),
        "copy": times.pop("copy"),
        "copy_faults": times.pop("copy_faults"),
        "compressors": {},
    }
    for spec, t in times.items():
        total = [c + d for c, d in zip(t["compress"], t["decompress"], strict=True)]
        out["compressors"][spec] = {
            "times": t,
            "median_s": median(total),
            "page_faults_per_call": median(t["faults"]),
        }
    return out


# -- top-k ---------------------------------------------------------------------------------------
def bench_topk(repeats: int) -> dict:
    x = jax.random.normal(jax.random.key(2), (N,), jnp.float32)
    k = dgc_select.num_selected(N, DGC_RATIO)
    low, capacity = dgc_select.band_limits(k, N, (0.8, 1.3))
    exact = jax.jit(lambda x: dgc_select.exact_select(x, k))
    sampled = jax.jit(lambda x, offset: dgc_select.sampled_threshold_select(x, k, offset=offset))
    times = interleaved({"exact": partial(exact, x), "sampled": partial(sampled, x, 0)}, repeats)
    # The count and fallback over several sample offsets (the transformation rotates it).
    stride, _ = dgc_select.sample_layout(N, k, 0.01)
    offsets = list(range(0, stride, max(1, stride // 8)))
    selections = [sampled(x, o) for o in offsets]
    counts = [int(s.count) for s in selections]
    fallbacks = [bool(s.fallback) for s in selections]
    rounds = ratios(times["exact"], times["sampled"])
    return {
        "d": N,
        "k": k,
        "band": [low, capacity],
        "times": times,
        "speedup_per_round": rounds,
        "speedup": median(rounds),
        "median_s": {name: median(v) for name, v in times.items()},
        "offsets": offsets,
        "counts": counts,
        "fallbacks": fallbacks,
    }


def bench_topk_codec(repeats: int, d: int | None = None) -> dict:
    """Error feedback's top-k codec (compress + decompress, one jitted call) against ``x * 2``.

    ``compjax.top_k(ratio=EF_TOPK_RATIO)`` with ``select="exact"`` and with
    ``select="threshold"`` (its default sample, and a tenth of it) on one
    float32 vector of the ResNet-50 tree's 25,557,032 entries (``d`` to
    override), interleaved with the copy round by round; and SparseLoCo's
    ``chunked_top_k(32, 4096)`` (no goal).
    """
    d = d or sum(math.prod(s) for s in resnet50_shapes())
    x = jax.random.normal(jax.random.key(3), (d,), jnp.float32)
    copy = jax.jit(lambda x: x * 2.0)
    fns = {"copy": partial(copy, x)}
    top = partial(compjax.top_k, ratio=EF_TOPK_RATIO)
    comps = {
        "exact": top(),
        "threshold": top(select="threshold"),
        # A tenth of the default sample: the threshold still comes from 2,556 sampled entries.
        "threshold, sample_ratio=0.001": top(select="threshold", sample_ratio=0.001),
        # SparseLoCo's message (reported without a goal): 32 of every 4096, 2-bit codes.
        "chunked_top_k(32, 4096)": compjax.chunked_top_k(k=32, chunk=4096),
    }
    for name, comp in comps.items():
        codec = jax.jit(lambda x, comp=comp: comp.decompress(comp.compress(None, x)))
        fns[name] = partial(codec, x)
    times = interleaved(fns, repeats)
    thr = comps["threshold"]
    return {
        "d": d,
        "k": thr.k_for(d),
        "band": list(thr.count_band(d)),
        "kept": {name: int(jnp.sum(fns[name]() != 0)) for name in comps},
        "times": times,
        "median_s": {name: median(v) for name, v in times.items()},
        "ratio": {name: median(ratios(times[name], times["copy"])) for name in comps},
    }


# -- main ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--out", default="results", help="output directory")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--part", choices=["step", "powersgd"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    shapes_tree = resnet50_shapes()

    if args.part == "step":
        Path(args.json).write_text(json.dumps(parts.part_step(repeats, args.quick)))
        return 0
    if args.part == "powersgd":
        Path(args.json).write_text(json.dumps(parts.part_powersgd(repeats, shapes_tree)))
        return 0

    start = time.perf_counter()
    res: dict = {
        "machine": machine(),
        "config": {
            "repeats": repeats,
            "quick": args.quick,
            "warmup": 2,
            "n": N,
            "codecs": [dataclasses.asdict(c) for c in CODECS],
            "hadamard_rounds": HADAMARD_ROUNDS,
            "dgc_ratio": DGC_RATIO,
            "powersgd_rank": POWERSGD_RANK,
            "mlp_widths": list(MLP_WIDTHS),
            "mlp_batch_per_worker": MLP_BATCH_PER_WORKER,
            "step_workers": STEP_WORKERS,
        },
        "load_before": load_average(),
    }
    print("roofline, 2^24 entries", flush=True)
    res["roofline"] = bench_roofline([(N,)], specs("roofline"), repeats)
    print("roofline, ResNet-50 tree", flush=True)
    res["roofline_tree"] = bench_roofline(shapes_tree, specs("roofline_tree"), repeats)
    print(f"roofline, ResNet-50 tree in buckets of 2^{BUCKET_LOG2}", flush=True)
    res["roofline_buckets"] = bench_roofline(
        shapes_tree, specs("roofline_buckets"), repeats, 2**BUCKET_LOG2
    )
    print("roofline, the same in Flax's HWIO layout (no goal)", flush=True)
    res[HWIO_PART] = bench_roofline(
        [hwio(s) for s in shapes_tree], specs(HWIO_PART), repeats, 2**BUCKET_LOG2
    )
    print("Hadamard transform, 2^24 entries", flush=True)
    res["hadamard"] = bench_hadamard(repeats)
    print("memory analysis", flush=True)
    res["memory"] = bench_memory(specs("memory"))
    print("PyTorch compressors", flush=True)
    res["torch"] = bench_torch([(N,)], specs("torch"), repeats)
    res["torch_tree"] = bench_torch(shapes_tree, specs("torch"), repeats)
    print("top-k vs sampled threshold", flush=True)
    res["topk"] = bench_topk(repeats)
    print("EF top-k 1% codec: exact vs sampled threshold", flush=True)
    res["topk_codec"] = bench_topk_codec(repeats)
    print("training step, 8 devices", flush=True)
    res["step"] = parts.run_part(
        "step", STEP_WORKERS, ["--repeats", str(repeats)] + ["--quick"] * args.quick
    )
    print("training step, 8 devices, XLA's YNNPACK fusions off (diagnostic)", flush=True)
    res["step_no_ynn"] = parts.run_part(
        "step",
        STEP_WORKERS,
        ["--repeats", str(repeats)] + ["--quick"] * args.quick,
        flags=NO_YNN,
    )
    print("PowerSGD vs the PyTorch hook", flush=True)
    ps_repeats = max(repeats, 15)  # a step is short and noisier than the others
    res["powersgd"] = {
        "jax": parts.run_part("powersgd", 2, ["--repeats", str(ps_repeats)]),
        "torch": parts.torch_powersgd(ps_repeats, shapes_tree),
    }
    res["load_after"] = load_average()
    res["seconds"] = time.perf_counter() - start
    rows = bench_report.goal_rows(res)
    res["goals"] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=1, default=float))
    table = bench_report.markdown(res, rows)
    (out / "bench.md").write_text(table)
    print(table)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
