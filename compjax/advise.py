"""Will compression pay on my setup?  ``python -m compjax.advise`` or :func:`advise`.

For a model (a params tree or a parameter count), ``n`` workers and a
network (bandwidth, latency, each worker on its own link or all on one
shared medium), every method below is costed as

    step = compute + codec + the time of its messages on the network,

with the messages and their collectives from :func:`compjax.communication`
(``routes``), their time from :mod:`compjax.costmodel` (the model that
``make bench-net`` checks against measured steps: 57 of 60 settings within
25%), and the codec timed here, on the current device: one jitted update
of a single worker (its compression and the decoding of its own message;
the decoding of the other workers' messages, which an all-gather adds, is
not included), less the same for the uncompressed all-reduce.  Speedups
are against dense float32 and against the bf16 cast.  A parameter count
stands for a matrix of 1024 columns (and a vector of the rest), so that
PowerSGD has a matrix to factor.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax
from compjax import costmodel

AXIS = "data"
#: ``communication()``'s routes to the cost model's collectives.
COLLECTIVES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "all_to_all": "alltoall",
    "reduce_scatter": "reduce_scatter",
}
COLUMNS = 1024


def methods(exchange: str) -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The methods advised on, by name; compressed messages travel by ``exchange``."""
    via = "scatter_gather" if exchange == "scatter_gather" else "all_gather"
    return {
        "dense fp32": lambda: compjax.compress(compjax.identity(), AXIS),
        "bf16 cast": lambda: compjax.compress(compjax.cast("bfloat16"), AXIS),
        "TernGrad (int8 psum)": lambda: compjax.terngrad_allreduce(AXIS),
        "QSGD 4-bit": lambda: compjax.compress(compjax.qsgd(levels=7), AXIS, exchange=exchange),
        "EF top-k 1%": lambda: compjax.error_feedback(
            compjax.top_k(ratio=0.01), AXIS, exchange=exchange
        ),
        "PowerSGD rank 4": lambda: compjax.powersgd(4, AXIS),
        "sign vote": lambda: compjax.sign_majority_vote(AXIS, via=via),
    }


@dataclasses.dataclass(frozen=True)
class Advice:
    """One method's predicted step.

    Attributes:
      method: its name.
      bits_per_worker: bits that leave one worker per step (``communication()``'s
        ring traffic).
      routes: ``{(collective, axes): payload bits}`` (``payload_bits_by_route()``:
        the message sizes the cost model turns into time, not the traffic).
      codec_s: the measured codec time per worker and step (over dense's).
      comm_s: the messages' time on the network.
      step_s: ``compute + codec + comm``.
      speedup_fp32, speedup_bf16: dense float32's and the bf16 cast's step
        over this one.
    """

    method: str
    bits_per_worker: int
    routes: dict
    codec_s: float
    comm_s: float
    step_s: float
    speedup_fp32: float = math.nan
    speedup_bf16: float = math.nan


def as_params(params: Any) -> Any:
    """A params tree, or a parameter count as one float32 vector of that many entries."""
    if isinstance(params, int | float) and not isinstance(params, bool):
        count = int(params)
        if count < 1:
            raise ValueError(f"params: a parameter count must be positive, got {params!r}")
        rows, rest = divmod(count, COLUMNS)
        tree = {"rest": jax.ShapeDtypeStruct((rest,), jnp.float32)} if rest else {}
        if rows:
            tree["matrix"] = jax.ShapeDtypeStruct((rows, COLUMNS), jnp.float32)
        return tree
    return params


def messages(report: compjax.CommunicationReport) -> list[tuple[str, float]]:
    """``(collective, payload bits per worker)`` of a report, in the cost model's names
    (the payloads: the cost model applies each collective's ring factor itself)."""
    return [(COLLECTIVES[via], float(b)) for (via, _), b in report.payload_bits_by_route().items()]


def time_update(tx: optax.GradientTransformation, params: Any, workers: int, repeats: int):
    """Seconds per worker of one jitted update of ``workers`` workers simulated by vmap
    (median of ``repeats``)."""
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)
    keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes)))
    grads = jax.tree.unflatten(
        jax.tree.structure(shapes),
        [
            jax.random.normal(k, (workers, *s.shape), s.dtype)
            for k, s in zip(keys, jax.tree.leaves(shapes), strict=True)
        ],
    )
    state = jax.vmap(lambda _: tx.init(shapes_like(shapes)))(jnp.arange(workers))
    step = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
    return median_seconds(lambda: step(grads, state), repeats) / workers


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` until its outputs are ready, after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def shapes_like(shapes: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def advise(
    params: Any,
    workers: int,
    bandwidth_gbps: float,
    latency_us: float,
    compute_s: float,
    *,
    exchange: str = "scatter_gather",
    shared: bool = False,
    repeats: int = 3,
    timer: Callable[[optax.GradientTransformation, Any, int, int], float] = time_update,
) -> list[Advice]:
    """Predicted step time and speedup of every method of :func:`methods` on this setup.

    Args:
      params: the params tree (arrays or ``jax.ShapeDtypeStruct``), or a parameter count.
      workers: data-parallel workers, at least 2.
      bandwidth_gbps, latency_us: the network (per worker, or of the shared
        medium with ``shared=True``).
      compute_s: forward and backward per step, without communication.
      exchange: ``"scatter_gather"`` or ``"all_gather"`` for the compressed messages.
      shared: one medium all workers' bits cross (``costmodel.SharedMedium``).
      repeats: timed runs per codec (median).
      timer: ``timer(tx, params, workers, repeats)``, seconds of one update per worker
        (called with one worker).

    Returns:
      One :class:`Advice` per method, dense float32 first.

    Raises:
      ValueError: a bad argument, naming it.
    """
    if not isinstance(workers, int) or workers < 2:
        raise ValueError(f"workers must be an integer >= 2, got {workers!r}")
    for name, value in (("bandwidth_gbps", bandwidth_gbps), ("compute_s", compute_s)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if not latency_us >= 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us!r}")
    if exchange not in ("scatter_gather", "all_gather"):
        raise ValueError(f"exchange must be 'scatter_gather' or 'all_gather', got {exchange!r}")
    params = as_params(params)
    kind = costmodel.SharedMedium if shared else costmodel.Network
    network = kind(bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)
    table = methods(exchange)
    concrete = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)
    base = timer(table["dense fp32"](), concrete, 1, repeats)
    out = []
    for name, build in table.items():
        tx = build()
        report = compjax.communication(tx, concrete, AXIS, num_workers=workers)
        codec = 0.0 if name == "dense fp32" else max(timer(tx, concrete, 1, repeats) - base, 0.0)
        comm = network.exchange(messages(report), workers)
        out.append(
            Advice(
                method=name,
                bits_per_worker=report.bits_per_worker,
                routes=report.payload_bits_by_route(),
                codec_s=codec,
                comm_s=comm,
                step_s=compute_s + codec + comm,
            )
        )
    fp32, bf16 = out[0].step_s, out[1].step_s
    return [dataclasses.replace(a, speedup_fp32=fp32 / a.step_s, speedup_bf16=bf16 / a.step_s)
            for a in out]  # fmt: skip


def table(advice: Sequence[Advice]) -> str:
    """The advice as an aligned text table."""
    rows = [("method", "Mbit/worker", "travels by", "codec ms", "comm ms", "step ms",
             "x fp32", "x bf16")]  # fmt: skip
    for a in advice:
        routes = ", ".join(sorted({via for via, _ in a.routes}))
        rows.append((a.method, f"{a.bits_per_worker / 1e6:.2f}", routes, f"{1e3 * a.codec_s:.1f}",
                     f"{1e3 * a.comm_s:.1f}", f"{1e3 * a.step_s:.1f}", f"{a.speedup_fp32:.2f}",
                     f"{a.speedup_bf16:.2f}"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compjax.advise", description=__doc__)
    parser.add_argument("--params", type=float, required=True, help="parameter count (25.6e6)")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--bandwidth-gbps", type=float, required=True)
    parser.add_argument("--latency-us", type=float, default=5.0)
    parser.add_argument("--compute-ms", type=float, required=True, help="per step, per worker")
    parser.add_argument("--exchange", default="scatter_gather",
                        choices=("scatter_gather", "all_gather"))  # fmt: skip
    parser.add_argument("--shared", action="store_true", help="one medium shared by all workers")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        advice = advise(int(args.params), args.workers, args.bandwidth_gbps, args.latency_us,
                        args.compute_ms / 1e3, exchange=args.exchange, shared=args.shared,
                        repeats=args.repeats)  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    link = "one shared medium" if args.shared else "each worker on its own link"
    print(f"{int(args.params):,} parameters, {args.workers} workers, {args.bandwidth_gbps:g} "
          f"Gbit/s ({link}), {args.latency_us:g} us latency, {args.compute_ms:g} ms compute; "
          f"codecs timed on {jax.devices()[0].platform}")  # fmt: skip
    print(table(advice))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
