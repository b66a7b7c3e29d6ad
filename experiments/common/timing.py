"""Timing a codec against a copy: interleaved rounds, medians, ratios, and the jitted
``compress``/``decompress`` of a list of leaves (leaf by leaf or in buckets), as ``make
bench`` and ``make bench-gpu`` both time them."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import compjax
from compjax.transforms.buckets import Buckets
from experiments.common import methods


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
