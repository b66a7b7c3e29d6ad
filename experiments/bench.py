"""``make bench``: speed of compjax's compressors against baselines measured in the same run.

Every figure is a ratio against a baseline timed in the same run, interleaved
with it round by round (so a machine that slows down slows both), and
reported as the median over the rounds after warm-up calls:

* **roofline**: each compressor's (:data:`experiments.bench_codecs.CODECS`,
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
  (:mod:`experiments.bench_torch`) on the same arrays and CPU, and
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

The codecs, sizes and goals are :mod:`experiments.bench_codecs`; the verdicts
and tables :mod:`experiments.bench_report`.  Writes ``results/bench.json``
(every raw time, the medians, machine and library versions, thread counts,
load averages) and ``results/bench.md`` (the table with each goal, MET or
MISSED), and prints the table.

Usage::

    python -m experiments.bench            # everything (7.5 min + 3-5 min per EDEN codec)
    python -m experiments.bench --quick    # fewer repeats, smaller step (a smoke run)

The multi-device parts run in subprocesses of this module (``--part step``,
``--part powersgd``) with ``XLA_FLAGS=--xla_force_host_platform_device_count``
set before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from compjax import hadamard
from compjax.compressors import selection as dgc_select
from compjax.transforms.buckets import Buckets
from experiments import bench_report, methods
from experiments.bench_codecs import (
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


# -- timing ----------------------------------------------------------------------------------
def minor_faults() -> int:
    """Minor page faults of this process so far (fresh output buffers fault page by page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2, faults=None, batch: int = 1
):
    """Wall times (``time.perf_counter``) of each function, round by round.

    Each function is called ``warmup`` times first (compilation, caches);
    then every round calls each function once, in order, blocking on the
    result, so the functions see the same machine state.  If ``faults`` is a
    dict, it receives the minor page faults of each call too.  With
    ``batch`` > 1 a round dispatches that many calls back to back, blocks on
    them all, and records the mean (an accelerator's device then works while
    the host dispatches the next call).
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    if faults is not None:
        faults.update({name: [] for name in fns})
    for _ in range(repeats):
        for name, fn in fns.items():
            f0 = minor_faults()
            t0 = time.perf_counter()
            jax.block_until_ready([fn() for _ in range(batch)])
            times[name].append((time.perf_counter() - t0) / batch)
            if faults is not None:
                faults[name].append((minor_faults() - f0) // batch)
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


def make_compressor(spec: str) -> compjax.Compressor:
    """The compressor of a spec such as ``"qsgd(levels=4)"`` (the harness's parser)."""
    return methods.parse(spec).compressor


def random_tree(shapes, seed: int = 0) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


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


def codec_keys(xs: list[jax.Array], bucket_size: int | None = None) -> jax.Array:
    """One key per message: per leaf, or per bucket of ``bucket_size`` entries."""
    n = len(xs) if bucket_size is None else len(Buckets(xs, bucket_size).bounds)
    return jax.random.split(jax.random.key(1), n)


def codec_calls(comp: compjax.Compressor, xs: list[jax.Array], bucket_size: int | None = None):
    """The jitted ``compress(keys, xs)`` and ``decompress(payloads)`` of a list of leaves.

    Leaf by leaf, or with ``bucket_size`` bucket by bucket
    (:class:`compjax.transforms.buckets.Buckets`): each bucket encoded from its
    pieces of leaves, decoded into them, and the leaves rebuilt.
    """
    if bucket_size is None:
        enc = jax.jit(lambda keys, xs: [comp.compress(k, x) for k, x in zip(keys, xs, strict=True)])
        return enc, jax.jit(lambda ps: [comp.decompress(p) for p in ps])
    layout = Buckets(xs, bucket_size)
    enc = jax.jit(
        lambda keys, xs: [
            comp.compress_pieces(k, x) for k, x in zip(keys, layout.pieces(xs), strict=True)
        ]
    )
    dec = jax.jit(
        lambda ps: layout.rebuild(
            [comp.decompress_pieces(p, layout.sizes(b)) for b, p in enumerate(ps)]
        )
    )
    return enc, dec


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
        from experiments import bench_torch
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


# -- subprocesses with several devices ----------------------------------------------------------
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


def run_part(
    part: str, devices: int, args: list[str], timeout: float = 900, flags: str = ""
) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "experiments.bench", "--part", part, "--json", str(path)]
        proc = subprocess.run(
            [*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            return {"error": proc.stderr[-3000:]}
        return json.loads(path.read_text())


def part_step(repeats: int, quick: bool) -> dict:
    """Compressed vs plain data-parallel MLP steps on ``STEP_WORKERS`` devices (this process)."""
    import optax

    P = jax.P
    from jax.sharding import NamedSharding

    n = STEP_WORKERS
    assert jax.device_count() == n, jax.devices()
    mesh = jax.make_mesh((n,), ("data",))
    widths = MLP_WIDTHS if not quick else (784, 256, 10)
    keys = jax.random.split(jax.random.key(0), len(widths))
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        params[f"w{i}"] = jax.random.normal(keys[i], (a, b)) / math.sqrt(a)
        params[f"b{i}"] = jnp.zeros((b,))
    layers = len(widths) - 1

    def loss_fn(params, x, y):
        for i in range(layers):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < layers - 1:
                x = jax.nn.relu(x)
        return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

    batch = MLP_BATCH_PER_WORKER * n
    kx, ky = jax.random.split(jax.random.key(1))
    data = NamedSharding(mesh, P("data"))
    x = jax.device_put(jax.random.normal(kx, (batch, widths[0])), data)
    y = jax.device_put(jax.random.randint(ky, (batch,), 0, widths[-1]), data)
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def make_step(opt, exchange):
        specs = compjax.state_specs(jax.eval_shape(opt.init, params), "data")
        init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))
        state = init(params)

        @jax.jit
        @partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs, P()),
        )
        def step(params, state, x, y):
            local = compjax.worker_params(params, "data")
            loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
            grads = exchange(grads)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

        return partial(step, params, state, x, y)

    fns = {"plain pmean": make_step(optax.sgd(0.01), lambda g: jax.lax.pmean(g, "data"))}
    step_specs = specs("step")
    for spec in step_specs:
        opt = optax.chain(compjax.compress(make_compressor(spec), "data"), optax.sgd(0.01))
        fns[spec] = make_step(opt, lambda g: g)
    times = interleaved(fns, repeats)
    out = {
        "workers": n,
        "widths": list(widths),
        "batch_per_worker": MLP_BATCH_PER_WORKER,
        "parameters": sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)),
        "times": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "ratio": {spec: median(ratios(times[spec], times["plain pmean"])) for spec in step_specs},
        "devices": [str(d) for d in jax.devices()],
    }
    return out


def powersgd_transform():
    """The benchmarked PowerSGD: the ResNet-50 shapes are torchvision's ``(cout, cin, kh, kw)``,
    so each kernel is the ``cout x (cin kh kw)`` matrix ``powerSGD_hook`` compresses.

    Until 2026-11-27 the benchmark left ``channels_last`` at its flax default: each kernel
    was a ``(cout cin kh) x kw`` matrix, too thin to compress, and 53 of the 54 matrices
    were all-reduced dense against the hook's 54 compressed.
    """
    return compjax.powersgd(POWERSGD_RANK, "data", channels_last=False)


def part_powersgd(repeats: int, shapes) -> dict:
    """``compjax.powersgd`` update steps on two devices (this process)."""
    from jax.sharding import NamedSharding

    P = jax.P
    assert jax.device_count() == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("data",))
    params = {f"p{i:03d}": jnp.zeros(s) for i, s in enumerate(shapes)}
    tx = powersgd_transform()
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    keys = jax.random.split(jax.random.key(3), len(shapes))
    grads = {
        f"p{i:03d}": jax.random.normal(k, (2, *s))
        for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
    }
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    def update(grads, state):
        local = jax.tree.map(lambda g: g[0], grads)
        return tx.update(local, state)

    state = jax.block_until_ready(update(grads, state)[1])  # warm start under way
    times = interleaved({"update": partial(update, grads, state)}, repeats)
    return {"rank": POWERSGD_RANK, "times": times["update"], "median_s": median(times["update"])}


def torch_powersgd(repeats: int, shapes, threads: int = 1) -> dict:
    """PyTorch's DDP ``powerSGD_hook`` on two gloo processes, timed per step inside the hook."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "shapes": [list(s) for s in shapes],
            "rank": POWERSGD_RANK,
            "warmup": 3,
            "steps": repeats,
            "threads": threads,
        }
        inputs, output = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inputs.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "experiments.bench_torch", "powersgd", str(inputs)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        procs = [
            subprocess.Popen(
                [*cmd, str(Path(tmp) / "store"), str(r), "2", str(output)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        logs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs):
            return {"error": "\n".join(log[-2000:] for log in logs)}
        out = json.loads(output.read_text())
    out["median_s"] = median(out["hook"])
    out["threads_per_process"] = threads
    return out


# -- machine --------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
        "numpy": np.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    return info


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# -- main ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--out", default="results", help="output directory")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--part", choices=["step", "powersgd"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 9)
    shapes_tree = resnet50_shapes()

    if args.part == "step":
        Path(args.json).write_text(json.dumps(part_step(repeats, args.quick)))
        return 0
    if args.part == "powersgd":
        Path(args.json).write_text(json.dumps(part_powersgd(repeats, shapes_tree)))
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
    res["step"] = run_part(
        "step", STEP_WORKERS, ["--repeats", str(repeats)] + ["--quick"] * args.quick
    )
    print("training step, 8 devices, XLA's YNNPACK fusions off (diagnostic)", flush=True)
    res["step_no_ynn"] = run_part(
        "step",
        STEP_WORKERS,
        ["--repeats", str(repeats)] + ["--quick"] * args.quick,
        flags=NO_YNN,
    )
    print("PowerSGD vs the PyTorch hook", flush=True)
    ps_repeats = max(repeats, 15)  # a step is short and noisier than the others
    res["powersgd"] = {
        "jax": run_part("powersgd", 2, ["--repeats", str(ps_repeats)]),
        "torch": torch_powersgd(ps_repeats, shapes_tree),
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
