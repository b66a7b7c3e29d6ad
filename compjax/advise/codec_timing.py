"""Timing one worker's update of a large model on a small sample: :mod:`compjax.advise`'s
codec times.

A model's leaves are timed as one matrix of :data:`COLUMNS` columns and one
vector (per dtype), cut to at most ``sample_entries`` entries by the same
fraction, and the time scaled back by size (:func:`sample_tree`); the
methods are timed in interleaved rounds on copies of the gradient that are
not cache-resident (:func:`time_updates`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

#: The columns of the matrix a model's matrices (and a parameter count) are timed as.
COLUMNS = 1024
#: Entries of each leaf of the sample the codecs are timed on (:func:`sample_tree`), at most.
SAMPLE_ENTRIES = 2**22
#: The timed gradients and states cycle through copies of at least this many bytes together
#: (twice a 32 MiB last-level cache), at most ``MAX_COPIES``.
COLD_BYTES, MAX_COPIES = 2**26, 8
#: The timer's clocks: wall time, or the process's CPU time (a CPU backend on a shared machine).
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
#: The clocks a caller may name: :data:`CLOCKS` and ``"auto"`` (:func:`resolve_clock`).
CLOCK_CHOICES = ("auto", *CLOCKS)


def resolve_clock(clock: str, platform: str | None = None) -> str:
    """``"auto"`` as the clock to time by on ``platform`` (the default device's if ``None``):
    the process's CPU time on a CPU, where other jobs' load moves the wall time of every
    call (two wall-clock runs at 124M parameters under load disagreed on the fastest
    method, two process-clock runs agreed), the wall clock on an accelerator, whose work
    the process's CPU time does not see.  Any other clock is returned as given.
    """
    if clock != "auto":
        return clock
    platform = jax.devices()[0].platform if platform is None else platform
    return "process" if platform == "cpu" else "wall"


def sample_tree(params: Any, entries: int = SAMPLE_ENTRIES) -> tuple[dict, float]:
    """A small tree whose update time, times ``factor``, is ``params``' update time.

    Per dtype, the entries of the leaves of two or more dimensions become one
    matrix of (at most) :data:`COLUMNS` columns, and those of the vectors and
    scalars one vector, as a parameter count is laid out (a tree of many
    leaves would cost a compilation of many); where one of these exceeds
    ``entries`` entries, every one is cut by the same fraction (the matrix
    by rows).  ``factor`` is the entries of ``params`` over the sample's.

    Returns:
      ``({name: jax.ShapeDtypeStruct}, factor)``.
    """
    sizes: dict[tuple[bool, Any], int] = {}
    for leaf in jax.tree.leaves(params):
        key = (np.ndim(leaf) >= 2, jnp.dtype(leaf.dtype))
        sizes[key] = sizes.get(key, 0) + int(np.size(leaf))
    sizes = {key: size for key, size in sizes.items() if size}
    if not sizes:
        return {}, 1.0
    cut = max(1.0, max(sizes.values()) / entries)
    tree = {}
    for (matrix, dtype), size in sizes.items():
        columns = min(COLUMNS, size) if matrix else 1
        rows = max(1, min(round(size / columns / cut), entries // columns))
        shape = (rows, columns) if matrix else (rows,)
        tree[f"{'matrix' if matrix else 'vector'}_{dtype.name}"] = jax.ShapeDtypeStruct(
            shape, dtype
        )
    return tree, sum(sizes.values()) / sum(math.prod(s.shape) for s in tree.values())


def time_updates(
    txs: Mapping[str, optax.GradientTransformation],
    params: Any,
    repeats: int,
    sample_entries: int = SAMPLE_ENTRIES,
    clock: str = "auto",
    axis_name: str = "data",
) -> dict[str, np.ndarray]:
    """Seconds of one worker's jitted update of ``params``-shaped gradients, per round.

    The update is timed on :func:`sample_tree` and scaled by size.  Each of
    ``repeats`` rounds runs every transformation once, in an order rotated
    by one each round, after one untimed call of each (the compilations run
    in parallel threads first), so that the methods' times in one round are
    taken under the same load.  Calls
    cycle through copies of the gradients and states that together exceed
    ``COLD_BYTES``, so that, as a model's gradient would be, they are not
    in the cache (a 4M-entry sample timed on one copy ran at a third of
    the time per entry of the whole 25.6M-entry gradient on a 32 MiB-L3 CPU).

    ``clock="process"`` times by the process's CPU time (all its threads)
    instead of the wall clock: steadier on a machine other jobs share, but
    only for a CPU backend, and above the wall time where XLA runs an
    operation on several cores.  ``"auto"`` (the default) is the process
    clock on a CPU and the wall clock on an accelerator (:func:`resolve_clock`).

    ``axis_name`` is the data axis the transformations were built with (the
    update runs on one device, :func:`one_worker`).

    Returns:
      ``{name: seconds of each round}``, the rounds in order.
    """
    now = CLOCKS[resolve_clock(clock)]
    tree, factor = sample_tree(params, sample_entries)
    size = sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in tree.values())
    copies = min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / max(size, 1))))
    keys = jax.random.split(jax.random.key(0), copies * max(len(tree), 1)).reshape(copies, -1)
    grads = [
        {
            name: jax.random.normal(key, (1, *s.shape)).astype(s.dtype)
            for key, (name, s) in zip(row, tree.items(), strict=False)
        }
        for row in keys
    ]

    mesh = jax.make_mesh((1,), (axis_name,), devices=jax.devices()[:1])
    placed = jax.NamedSharding(mesh, jax.P(axis_name))
    grads = jax.device_put(grads, placed)

    def prepare(tx: optax.GradientTransformation) -> list[Callable[[], Any]]:
        states = [jax.device_put(jax.jit(jax.vmap(tx.init))(g), placed) for g in grads]
        step = jax.jit(one_worker(tx.update, mesh)).lower(grads[0], states[0]).compile()
        return [functools.partial(step, g, state) for g, state in zip(grads, states, strict=True)]

    names = list(txs)
    with concurrent.futures.ThreadPoolExecutor(min(len(names), os.cpu_count() or 1)) as pool:
        calls = dict(zip(names, pool.map(prepare, txs.values()), strict=True))  # compiled
    for name in names:
        jax.block_until_ready(calls[name][0]())  # an untimed first run
    totals = {name: np.zeros(repeats) for name in names}
    count = 0
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call = calls[name][count % copies]
            count += 1
            start = now()
            jax.block_until_ready(call())
            totals[name][r] = factor * (now() - start)
    return totals


def one_worker(update: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """``update`` as one worker runs it: ``jax.shard_map`` over ``mesh``, of one device.

    Its arguments and results carry a leading worker axis of size 1 (as from
    ``jax.vmap(tx.init)``), placed on ``mesh`` along its one axis.  Not
    ``jax.vmap``: a batched ``lax.cond`` runs both branches, so the top-k
    selections' fallbacks (a full ``top_k``) and every overflow guard's
    second pass were timed on every update (``python -m compjax.advise``,
    25.6M parameters, 16 workers: EF top-k 1% 621 ms by ``vmap``, 339 ms
    here; with the sampled threshold 1,144 and 334 ms).
    """
    spec = jax.P(mesh.axis_names[0])

    def worker(*args):
        out = update(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: a[None], out)

    return jax.shard_map(worker, mesh=mesh, in_specs=spec, out_specs=spec)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` until its outputs are ready, after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))
