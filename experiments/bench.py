"""``make bench``: speed of compjax's compressors against baselines measured in the same run.

Every figure is a ratio against a baseline timed in the same run, interleaved
with it round by round (so a machine that slows down slows both), and
reported as the median over the rounds after warm-up calls:

* **roofline**: each compressor's (:data:`CODECS`, one line each) ``compress`` plus
  ``decompress`` (two jitted calls; the payload is materialised as it would be
  on the wire) on a ``2**24``-entry float32 gradient and on a ResNet-50-like
  tree (161 leaves, 25.6M parameters), against a jitted ``x * 2`` of the same
  arrays (one read and one write of each); and on the same tree cut into
  ``2**22``-entry buckets (``bucket_size=``: each bucket encoded from its
  pieces of leaves, decoded into them).
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
  (:func:`compjax.transforms.dgc_select.sampled_threshold_select`) against
  the exact ``jax.lax.top_k`` at ratio 0.001 of ``2**24`` entries;
* **training step**: a data-parallel MLP step over 8 simulated devices
  (``shard_map``) with ``compjax.compress(comp)`` against the same step with
  a plain ``pmean``;
* **memory**: XLA's compiled memory analysis of ``compress`` and
  ``decompress`` (temporaries plus outputs) over the input's bytes.

Writes ``results/bench.json`` (every raw time, the medians, machine and
library versions, thread counts, load averages) and ``results/bench.md`` (the
table with each goal, MET or MISSED), and prints the table.

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
from experiments import methods

N = 2**24
#: Bucket size of the bucketed ResNet-50 roofline (25.6M entries: 7 buckets).
BUCKET_LOG2 = 22
#: Goals of the benchmark (never loosened here; a miss is reported with its ratio).
ROOFLINE_GOAL = 2.0
EDEN_GOAL = 3.0
TORCH_GOAL = 1.0
TOPK_SPEEDUP_GOAL = 5.0
TOPK_CODEC_GOAL = 3.0
#: Density of error feedback's top-k codec row (``compjax.top_k(ratio=0.01)``).
EF_TOPK_RATIO = 0.01
STEP_GOAL = 1.25
DGC_RATIO = 0.001
POWERSGD_RANK = 4
MLP_WIDTHS = (784, 1024, 1024, 10)
MLP_BATCH_PER_WORKER = 64
STEP_WORKERS = 8
#: XLA flag that turns off its YNNPACK fusions (a diagnostic run of the step only).
NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="

#: The roofline sections (compress + decompress against the copy).
ROOFLINE_PARTS = ("roofline", "roofline_tree", "roofline_buckets")
#: Where an elementwise compressor runs: every roofline, the memory analysis, the MLP step.
ELEMENTWISE_PARTS = (*ROOFLINE_PARTS, "memory", "step")
#: Where a rotation-based one runs (its time grows with log d: no buckets, no step).
ROTATION_PARTS = ("roofline", "roofline_tree", "memory")


@dataclasses.dataclass(frozen=True)
class Codec:
    """One benchmarked compressor: its spec (the harness's parser), where it runs, its goal.

    ``goal`` is the most compress + decompress may take, in copies, on the
    sections of ``goal_on``; elsewhere (or with ``goal=None``) its ratio is
    reported without a verdict.  ``torch``: :mod:`experiments.bench_torch`
    has a plain PyTorch version to compare with.
    """

    spec: str
    parts: tuple[str, ...] = ELEMENTWISE_PARTS
    goal: float | None = ROOFLINE_GOAL
    goal_on: tuple[str, ...] = ROOFLINE_PARTS
    torch: bool = False


#: Every benchmarked compressor, one line each (a new codec joins ``make bench`` here).
CODECS = (
    Codec("sign()", torch=True),
    Codec("scaled_sign()", torch=True),
    Codec("terngrad()", torch=True),
    Codec("qsgd(levels=4)", torch=True),
    Codec("qsgd(levels=4, bucket_size=512)", torch=True),
    Codec("natural()", torch=True),
    Codec("cast('float16')", torch=True),
    Codec("cast('bfloat16')", torch=True),
    Codec("natural_dithering()"),
    Codec("l2_scaled_sign()"),
    Codec("int_quant(bits=4)"),
    Codec("eden(bits=1)", ROTATION_PARTS, goal=EDEN_GOAL, goal_on=("roofline",)),
    Codec("eden(bits=2)", ROTATION_PARTS, goal=None),
    Codec("eden(bits=4)", ROTATION_PARTS, goal=None),
    Codec("drive()", ROTATION_PARTS, goal=None),
)
CODEC = {c.spec: c for c in CODECS}


def specs(part: str) -> tuple[str, ...]:
    """The specs of the codecs that run in ``part`` (``"torch"``: those with a PyTorch twin)."""
    return tuple(c.spec for c in CODECS if (c.torch if part == "torch" else part in c.parts))


#: Rounds of the randomized Hadamard rotation the Hadamard row times (EDEN's default).
HADAMARD_ROUNDS = 3


# -- shapes ---------------------------------------------------------------------------------
def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (torchvision layout, OIHW kernels; 25,557,032 entries).

    The stem, 16 bottleneck blocks (``[3, 4, 6, 3]`` at widths 64..512,
    expansion 4, a projection on the first block of each stage), a batch-norm
    scale and shift after every convolution, and the 1000-way classifier.
    """
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = 4 * width
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, channels, 1, 1), (out,), (out,)]
            channels = out
    return [*shapes, (1000, 2048), (1000,)]


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
    same call (:func:`compjax.hadamard.rotate_key`: inside the blocked
    passes).  Interleaved with the copy, round by round.
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


def part_powersgd(repeats: int, shapes) -> dict:
    """``compjax.powersgd`` update steps on two devices (this process)."""
    from jax.sharding import NamedSharding

    P = jax.P
    assert jax.device_count() == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("data",))
    params = {f"p{i:03d}": jnp.zeros(s) for i, s in enumerate(shapes)}
    tx = compjax.powersgd(POWERSGD_RANK, "data")
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


# -- goals and the table ---------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def roofline_rows(res: dict) -> list[dict]:
    """A row per compressor and roofline section; ``goal`` None where it has none there."""
    rows = []
    for label, key in (
        ("2^24 fp32", "roofline"),
        ("ResNet-50 tree", "roofline_tree"),
        (f"ResNet-50 tree in buckets of 2^{BUCKET_LOG2}", "roofline_buckets"),
    ):
        sec = res.get(key, {})
        for spec, r in sec.get("compressors", {}).items():
            codec = CODEC.get(spec, Codec(spec))
            goal = codec.goal if key in codec.goal_on else None
            med = r["median_s"]
            per_entry = 1e9 * med["copy"] / sec["entries"]
            note = (
                f"compress {r['compress_ratio']:.2f}x + decompress {r['decompress_ratio']:.2f}x; "
                f"copy {per_entry:.2f} ns/entry, "
                f"{r['page_faults_per_call']['copy']:.0f} page faults per copy"
            )
            rows.append(
                {
                    "group": "roofline",
                    "what": f"`{spec}` compress+decompress, {label}",
                    "time": f"{1e3 * (med['compress'] + med['decompress']):.1f} ms",
                    "baseline": f"copy {1e3 * r['median_s']['copy']:.1f} ms",
                    "ratio": r["ratio"],
                    "goal": None if goal is None else f"<= {goal:g}x",
                    "met": None if goal is None else r["ratio"] <= goal,
                    "note": note,
                }
            )
    return rows


def topk_codec_rows(res: dict) -> list[dict]:
    """The top-k codecs against the copy: EF top-k 1% with a goal, SparseLoCo's without."""
    rows = []
    tc = res.get("topk_codec")
    if not tc:
        return rows
    for name in tc["ratio"]:
        ratio = tc["ratio"][name]
        chunked = name.startswith("chunked")
        kept = tc["kept"][name]
        rows.append(
            {
                "group": "top-k",
                "what": f"{'SparseLoCo' if chunked else 'EF top-k 1%'} codec, {name}, "
                f"{tc['d']:,} entries",
                "time": f"{1e3 * tc['median_s'][name]:.1f} ms",
                "baseline": f"copy {1e3 * tc['median_s']['copy']:.1f} ms",
                "ratio": ratio,
                "goal": None if chunked else f"<= {TOPK_CODEC_GOAL:g}x",
                "met": None if chunked else ratio <= TOPK_CODEC_GOAL,
                "note": "compress + decompress"
                + (
                    f"; kept {kept:,} in [{tc['band'][0]:,}, {tc['band'][1]:,}]"
                    if name.startswith("threshold")
                    else ""
                ),
            }
        )
    return rows


def reported_rows(res: dict) -> list[dict]:
    """Ratios against the copy with no goal: the Hadamard transform, codecs without one."""
    rows = [r for r in roofline_rows(res) if r["goal"] is None]
    rows += [r for r in topk_codec_rows(res) if r["goal"] is None]
    had = res.get("hadamard")
    if had:
        med = had["median_s"]
        for name, what in (
            ("fwht", "`hadamard.fwht` (forward transform)"),
            ("rotate", f"EDEN's rotation, {had['rounds']} rounds with signs from the key"),
        ):
            rows.append(
                {
                    "group": "hadamard",
                    "what": f"{what}, 2^24 fp32",
                    "time": f"{1e3 * med[name]:.1f} ms",
                    "baseline": f"copy {1e3 * med['copy']:.1f} ms",
                    "ratio": had[f"{name}_ratio"],
                    "note": f"{had['page_faults_per_call'][name]:.0f} page faults per call, "
                    f"{had['page_faults_per_call']['copy']:.0f} per copy",
                }
            )
    return rows


def goal_rows(res: dict) -> list[dict]:
    rows = [r for r in roofline_rows(res) if r["goal"] is not None]
    for label, key, jkey in (
        ("2^24 fp32", "torch", "roofline"),
        ("ResNet-50 tree", "torch_tree", "roofline_tree"),
    ):
        sec, jsec = res.get(key) or {}, res.get(jkey, {})
        if "error" in sec:
            rows.append(
                {
                    "group": "pytorch",
                    "what": f"compressors vs PyTorch, {label}",
                    "time": "-",
                    "baseline": "-",
                    "ratio": float("nan"),
                    "goal": f"< {TORCH_GOAL:g}x",
                    "met": False,
                    "note": sec["error"],
                }
            )
            continue
        for spec, t in sec.get("compressors", {}).items():
            j = jsec["compressors"][spec]["median_s"]
            jf = jsec["compressors"][spec]["page_faults_per_call"]
            ours = j["compress"] + j["decompress"]
            ratio = ours / t["median_s"]
            tc = t["times"]
            rows.append(
                {
                    "group": "pytorch",
                    "what": f"`{spec}` vs PyTorch, {label}",
                    "time": f"{1e3 * ours:.1f} ms",
                    "baseline": f"PyTorch {1e3 * t['median_s']:.1f} ms",
                    "ratio": ratio,
                    "goal": f"< {TORCH_GOAL:g}x",
                    "met": ratio < TORCH_GOAL,
                    "note": (
                        f"PyTorch compress {1e3 * median(tc['compress']):.1f} ms + "
                        f"decompress {1e3 * median(tc['decompress']):.1f} ms, its copy "
                        f"{1e3 * median(sec['copy']):.1f} ms; page faults per compress+"
                        f"decompress: PyTorch {t['page_faults_per_call']:.0f}, compjax "
                        f"{jf['compress'] + jf['decompress']:.0f}"
                    ),
                }
            )
    ps = res.get("powersgd", {})
    if "jax" in ps and "torch" in ps and "error" not in ps["jax"] and "error" not in ps["torch"]:
        ratio = ps["jax"]["median_s"] / ps["torch"]["median_s"]
        rows.append(
            {
                "group": "pytorch",
                "what": f"`powersgd(rank={POWERSGD_RANK})` step vs DDP `powerSGD_hook`, "
                "ResNet-50 tree, 2 workers",
                "time": f"{1e3 * ps['jax']['median_s']:.1f} ms",
                "baseline": f"hook {1e3 * ps['torch']['median_s']:.1f} ms",
                "ratio": ratio,
                "goal": f"<= {TORCH_GOAL:g}x",
                "met": ratio <= TORCH_GOAL,
                "note": (
                    f"PyTorch: 2 gloo processes x {ps['torch']['threads_per_process']} thread, "
                    f"{ps['torch']['buckets']} DDP buckets, whole backward "
                    f"{1e3 * median(ps['torch']['backward']):.1f} ms; compjax: 2 CPU devices"
                ),
            }
        )
    else:
        rows.append(
            {
                "group": "pytorch",
                "what": "`powersgd` vs DDP `powerSGD_hook`",
                "time": "-",
                "baseline": "-",
                "ratio": float("nan"),
                "goal": f"<= {TORCH_GOAL:g}x",
                "met": False,
                "note": "did not run: "
                + str(ps.get("jax", {}).get("error") or ps.get("torch", {}).get("error"))[-300:],
            }
        )
    tk = res.get("topk")
    if tk:
        k = tk["k"]
        low, high = tk["band"]
        rows.append(
            {
                "group": "top-k",
                "what": f"DGC sampled threshold vs exact `lax.top_k`, k = {k} of 2^24",
                "time": f"{1e3 * tk['median_s']['sampled']:.1f} ms",
                "baseline": f"top_k {1e3 * tk['median_s']['exact']:.1f} ms",
                "ratio": tk["speedup"],
                "goal": f">= {TOPK_SPEEDUP_GOAL:g}x faster",
                "met": tk["speedup"] >= TOPK_SPEEDUP_GOAL,
                "note": "ratio is top_k time / sampled time",
            }
        )
        in_band = [
            low <= c <= high and not f for c, f in zip(tk["counts"], tk["fallbacks"], strict=True)
        ]
        rows.append(
            {
                "group": "top-k",
                "what": f"DGC selected count in [0.8k, 1.3k] = [{low}, {high}]",
                "time": f"{min(tk['counts'])}..{max(tk['counts'])}",
                "baseline": f"k = {k}",
                "ratio": max(tk["counts"]) / k,
                "goal": "every offset in band",
                "met": all(in_band),
                "note": f"{len(tk['counts'])} sample offsets, "
                f"{sum(tk['fallbacks'])} fell back to top-k",
            }
        )
    rows += [r for r in topk_codec_rows(res) if r["goal"] is not None]
    st = res.get("step", {})
    if "error" in st:
        rows.append(
            {
                "group": "step",
                "what": "training-step overhead",
                "time": "-",
                "baseline": "-",
                "ratio": float("nan"),
                "goal": f"<= {STEP_GOAL:g}x",
                "met": False,
                "note": "did not run: " + st["error"][-300:],
            }
        )
    no_ynn = res.get("step_no_ynn", {}).get("ratio", {})
    for spec, ratio in st.get("ratio", {}).items():
        diag = f"; {no_ynn[spec]:.2f}x with XLA's YNNPACK fusions off" if spec in no_ynn else ""
        rows.append(
            {
                "group": "step",
                "what": f"`compress({spec})` MLP step, {st['workers']} workers",
                "time": f"{1e3 * st['median_s'][spec]:.1f} ms",
                "baseline": f"pmean step {1e3 * st['median_s']['plain pmean']:.1f} ms",
                "ratio": ratio,
                "goal": f"<= {STEP_GOAL:g}x",
                "met": ratio <= STEP_GOAL,
                "note": f"MLP {'-'.join(map(str, st['widths']))}, "
                f"{st['batch_per_worker']} examples/worker{diag}",
            }
        )
    return rows


def _cell(text) -> str:
    """``text`` as one Markdown table cell: on one line, its pipes escaped (an error message
    in a note would otherwise end the table)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(res: dict, rows: list[dict]) -> str:
    m = res["machine"]
    lines = [
        "# compjax benchmark",
        "",
        f"{m['cpu']}, {m['cpu_count']} cores; jax {m['jax']}, torch "
        f"{(res.get('torch') or {}).get('machine', {}).get('torch', 'absent')}; "
        f"medians of {res['config']['repeats']} interleaved rounds after 2 warm-up calls; "
        f"load average {res.get('load_before')} before, {res.get('load_after')} after.",
        "",
        "| measurement | median time | baseline (same run) | ratio | goal | verdict | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "n/a" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}x"
        mark = "MET" if r["met"] else f"MISSED ({ratio})"
        lines.append(
            f"| {_cell(r['what'])} | {r['time']} | {_cell(r['baseline'])} | {ratio} | {r['goal']} "
            f"| {mark} | {_cell(r['note'])} |"
        )
    reported = reported_rows(res)
    if reported:
        lines += [
            "",
            "Measured against the copy in the same run, no goal:",
            "",
            "| measurement | median time | baseline (same run) | ratio | note |",
            "|---|---|---|---|---|",
        ]
        for r in reported:
            lines.append(
                f"| {_cell(r['what'])} | {r['time']} | {_cell(r['baseline'])} | {r['ratio']:.2f}x "
                f"| {_cell(r['note'])} |"
            )
    mem = res.get("memory")
    if mem:
        lines += [
            "",
            "Memory (XLA compiled memory analysis on 2^24 float32 entries: temporaries plus "
            "outputs of the jitted call, over the input's bytes; the copy `x * 2` is 1.00):",
            "",
            "| compressor | compress | decompress |",
            "|---|---|---|",
        ]
        for spec, r in mem["compressors"].items():
            lines.append(f"| `{spec}` | {r['compress_ratio']:.3f} | {r['decompress_ratio']:.3f} |")
    met = sum(r["met"] for r in rows)
    lines += ["", f"{met} of {len(rows)} goals met."]
    return "\n".join(lines) + "\n"


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
    rows = goal_rows(res)
    res["goals"] = rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=1, default=float))
    table = markdown(res, rows)
    (out / "bench.md").write_text(table)
    print(table)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
