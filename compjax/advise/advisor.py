"""Will compression pay on my setup?  ``python -m compjax.advise`` or :func:`advise`.

For a model (a params tree or a parameter count), ``n`` workers and a
network (bandwidth, latency, each worker on its own link or all on one
shared medium), every method below is costed as

    step = compute + dense's update + codec + the time of its messages on the network,

with the messages and their collectives from :func:`compjax.communication`
(``routes``), their time from :mod:`compjax.costmodel` (the model that
``make bench-net`` checks against measured steps: 74 of 102 settings within
25% in its committed run, the others measured faster than predicted), and
the codec timed here, on the current device: one jitted update of a single
worker (its compression and the decoding of its own message;
the decoding of the other workers' messages, which an all-gather adds, is
not included), less dense float32's update timed in the same round.

The codecs are timed on a sample and scaled by size: the entries of the
matrices become one matrix of 1024 columns and those of the vectors one
vector, each cut to at most ``sample_entries`` entries (4M) by the same
fraction, and the sample's time is multiplied by the model's entries over
the sample's.
The methods are timed in interleaved rounds (every method once per round,
in a rotating order); a codec's time is the median over rounds of its time
less dense's in the same round, and the range of those differences is
reported with it.  A negative median (a codec timed faster than dense's
update) is kept, shown and flagged, never clipped.

Every method's step is ``a + K / bandwidth`` (``a``: compute, update,
codec and latency; ``K``: the bits on the wire), so against dense float32
it pays below one bandwidth, its crossover (or at every bandwidth, or at
none), given with its range over the codec's range.  The command ends with
a recommendation: the method with the shortest step.  Speedups are
against dense float32 and against the bf16 cast.  A parameter count
stands for a matrix of 1024 columns (and a vector of the rest), so that
PowerSGD has a matrix to factor.

A shorter step is not a shorter training: a method that needs more steps
to reach the same quality can lose with a faster step.  ``steps_factor``
(``--steps-factor METHOD=X``) gives a method's steps to a quality target
over dense float32's (from ``make bench-e2e``'s table or your own runs);
every method's time to quality is then ``X * step``, and the speedups,
crossovers and the recommendation are about that time, not the step's.

The advice itself (:class:`~compjax.advise.report.Advice`) and its text (the table and
the recommendation) are :mod:`compjax.advise.report`.  Sharded training
(``--fsdp``) is costed by :mod:`compjax.advise.fsdp`; the command line is
:mod:`compjax.advise.cli`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import costmodel
from compjax.accounting import CommunicationReport, communication
from compjax.advise.codec_timing import CLOCK_CHOICES, COLUMNS, SAMPLE_ENTRIES, time_updates
from compjax.advise.report import BF16, DENSE, Advice
from compjax.compressors.dense import cast, identity
from compjax.compressors.qsgd import qsgd
from compjax.compressors.sparse import top_k
from compjax.transforms.compress import compress
from compjax.transforms.error_feedback import error_feedback
from compjax.transforms.powersgd import powersgd
from compjax.transforms.sign_vote import sign_majority_vote
from compjax.transforms.terngrad_allreduce import terngrad_allreduce

AXIS = "data"
#: ``communication()``'s routes to the cost model's collectives.
COLLECTIVES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "all_to_all": "alltoall",
    "reduce_scatter": "reduce_scatter",
}


def methods(exchange: str) -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The methods advised on, by name.

    Args:
      exchange: how the compressed messages travel: ``"all_gather"`` or ``"scatter_gather"``
        (the sign vote then votes by scatter-gather too).

    Returns:
      ``{name: build}``, each ``build()`` an optax transformation over :data:`AXIS`, dense
      float32 first and bf16 second.
    """
    via = "scatter_gather" if exchange == "scatter_gather" else "all_gather"
    return {
        DENSE: lambda: compress(identity(), AXIS),
        BF16: lambda: compress(cast("bfloat16"), AXIS),
        "TernGrad (int8 psum)": lambda: terngrad_allreduce(AXIS),
        "QSGD 4-bit": lambda: compress(qsgd(levels=7), AXIS, exchange=exchange),
        "EF top-k 1%": lambda: error_feedback(top_k(ratio=0.01), AXIS, exchange=exchange),
        # DGC's sampled threshold: 1.3x the exact message's slots, a fraction of its codec.
        "EF top-k 1%, threshold": lambda: error_feedback(
            top_k(ratio=0.01, select="threshold"), AXIS, exchange=exchange
        ),
        "PowerSGD rank 4": lambda: powersgd(4, AXIS),
        "sign vote": lambda: sign_majority_vote(AXIS, via=via),
    }


def as_params(params: Any) -> Any:
    """A params tree, or a parameter count as one float32 vector of that many entries.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``, or a whole number >= 1.

    Returns:
      ``params`` itself if a tree; for a count, ``{"matrix": (count // COLUMNS, COLUMNS)}``
      plus ``{"rest": (count % COLUMNS,)}`` as float32 ``ShapeDtypeStruct`` s (either
      omitted when empty).

    Raises:
      ValueError: a count that is not a whole number >= 1.
    """
    if isinstance(params, int | float | np.integer | np.floating) and not isinstance(params, bool):
        if not (math.isfinite(params) and params >= 1 and float(params).is_integer()):
            raise ValueError(
                f"params: a parameter count must be a whole number >= 1, got {params!r}"
            )
        count = int(params)
        rows, rest = divmod(count, COLUMNS)
        tree = {"rest": jax.ShapeDtypeStruct((rest,), jnp.float32)} if rest else {}
        if rows:
            tree["matrix"] = jax.ShapeDtypeStruct((rows, COLUMNS), jnp.float32)
        return tree
    return params


def messages(report: CommunicationReport) -> list[tuple[str, float]]:
    """A report's messages in the cost model's terms.

    Args:
      report: what :func:`compjax.communication` returned for one step.

    Returns:
      ``[(collective, payload bits per worker)]``, the collective in the cost model's names
      (the payloads: the cost model applies each collective's ring factor itself).
    """
    return [(COLLECTIVES[via], float(b)) for (via, _), b in report.payload_bits_by_route().items()]


def _positive(name: str, value: Any, *, zero: bool = False) -> None:
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and (value >= 0 if zero else value > 0)):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def _affine(kind: type, latency_us: float, msgs: list, workers: int) -> tuple[float, float]:
    """``(L, K)`` with the messages' time ``L + K / bandwidth_gbps`` on ``kind`` networks."""
    at_1 = kind(bandwidth_gbps=1.0, latency_us=latency_us).exchange(msgs, workers)
    at_2 = kind(bandwidth_gbps=2.0, latency_us=latency_us).exchange(msgs, workers)
    per_gbps = 2.0 * (at_1 - at_2)
    return at_1 - per_gbps, per_gbps


def crossover(dense: tuple[float, float], method: tuple[float, float]) -> tuple[float, bool]:
    """The bandwidth where a method's step time meets dense's.

    Args:
      dense: dense's ``(a_d, K_d)``: its step time is ``a_d + K_d / B`` at ``B`` Gbit/s.
      method: the method's ``(a_m, K_m)``, likewise.

    Returns:
      ``(B, pays_below)``: the ``B`` where the two times are equal and whether the method is
      faster below it; ``(inf, True)`` when it pays at every bandwidth, ``(0.0, True)`` at none.
    """
    (a_d, k_d), (a_m, k_m) = dense, method
    saved, extra = k_d - k_m, a_m - a_d  # wire time saved at 1 Gbit/s, fixed time added
    if saved > 0 and extra <= 0:
        return math.inf, True
    if saved <= 0 and extra >= 0:
        return 0.0, True
    return saved / extra, saved > 0  # both positive (pays below) or both negative (above)


def _steps_factors(given: Mapping[str, float] | None, exchange: str) -> dict[str, float]:
    """Every method's steps factor (1 where not given); a ``ValueError`` names a bad one."""
    names = list(methods(exchange))
    given = dict(given or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"steps_factor: unknown methods {unknown}; the methods are {names}")
    for name, value in given.items():
        if not isinstance(value, int | float | np.number) or not 0 < value < math.inf:
            raise ValueError(f"steps_factor: {name!r} must be finite and > 0, got {value!r}")
    if given.get(DENSE, 1.0) != 1.0:
        raise ValueError(f"steps_factor: {DENSE!r} is the reference (1), got {given[DENSE]!r}")
    return {name: float(given.get(name, 1.0)) for name in names}


def advise(
    params: Any,
    workers: int,
    bandwidth_gbps: float,
    latency_us: float,
    compute_s: float,
    *,
    exchange: str = "scatter_gather",
    shared: bool = False,
    repeats: int = 5,
    sample_entries: int = SAMPLE_ENTRIES,
    clock: str = "auto",
    timer: Callable[..., Mapping[str, Sequence[float]]] = time_updates,
    steps_factor: Mapping[str, float] | None = None,
) -> list[Advice]:
    """Predicted step time, speedup and crossover bandwidth of every method of :func:`methods`.

    Args:
      params: the params tree (arrays or ``jax.ShapeDtypeStruct``), or a parameter count.
      workers: data-parallel workers, at least 2.
      bandwidth_gbps, latency_us: the network (per worker, or of the shared
        medium with ``shared=True``); finite.
      compute_s: forward and backward per step, without communication.
      exchange: ``"scatter_gather"`` or ``"all_gather"`` for the compressed messages.
      shared: one medium all workers' bits cross (``costmodel.SharedMedium``).
      repeats: timing rounds (medians and ranges over them).
      sample_entries: the most entries of each leaf of the timed sample (:func:`sample_tree`).
      clock: ``"wall"``, ``"process"`` (CPU time; see :func:`time_updates`) or ``"auto"``:
        the process clock on a CPU, the wall clock on an accelerator
        (:func:`~compjax.advise.codec_timing.resolve_clock`).
      timer: ``timer(txs, params, repeats, sample_entries, clock)``: ``{name:
        seconds per round}`` of one worker's update (:func:`time_updates`).
      steps_factor: ``{method: its steps to a quality target over dense float32's}``
        (finite, > 0; methods not named: 1): speedups, crossovers and the
        recommendation are then about the time to the target.

    Returns:
      One :class:`~compjax.advise.report.Advice` per method, dense float32 first.

    Raises:
      ValueError: a bad argument, naming it.
    """
    if not isinstance(workers, int | np.integer) or isinstance(workers, bool) or workers < 2:
        raise ValueError(f"workers must be an integer >= 2, got {workers!r}")
    _positive("bandwidth_gbps", bandwidth_gbps)
    _positive("compute_s", compute_s)
    _positive("latency_us", latency_us, zero=True)
    for name, value in (("repeats", repeats), ("sample_entries", sample_entries)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if exchange not in ("scatter_gather", "all_gather"):
        raise ValueError(f"exchange must be 'scatter_gather' or 'all_gather', got {exchange!r}")
    if clock not in CLOCK_CHOICES:
        raise ValueError(f"clock must be one of {list(CLOCK_CHOICES)}, got {clock!r}")
    params = as_params(params)
    factors = _steps_factors(steps_factor, exchange)
    kind = costmodel.SharedMedium if shared else costmodel.Network
    network = kind(bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)
    concrete = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), params)
    txs = {name: build() for name, build in methods(exchange).items()}
    rounds = {
        k: np.asarray(v, float)
        for k, v in timer(txs, concrete, repeats, sample_entries, clock).items()
    }
    base = compute_s + float(np.median(rounds[DENSE]))  # dense's update is in every step
    reports = {
        name: communication(tx, concrete, AXIS, num_workers=workers) for name, tx in txs.items()
    }
    msgs = {name: messages(report) for name, report in reports.items()}
    lines = {name: _affine(kind, latency_us, m, workers) for name, m in msgs.items()}
    diffs = {name: rounds[name] - rounds[DENSE] for name in txs}
    codecs = {name: float(np.median(d)) for name, d in diffs.items()}
    comms = {name: network.exchange(m, workers) for name, m in msgs.items()}
    steps = {name: base + codecs[name] + comms[name] for name in txs}

    def crossing(name: str, codec: float) -> tuple[float, bool]:
        (latency, per_gbps), (dense_latency, dense_per_gbps) = lines[name], lines[DENSE]
        f = factors[name]  # time to quality: f steps' worth of this method's step
        return crossover(
            (base + dense_latency, dense_per_gbps), (f * (base + codec + latency), f * per_gbps)
        )

    out = []
    for name in txs:
        advice = Advice(
            method=name,
            bits_per_worker=reports[name].bits_per_worker,
            routes=reports[name].payload_bits_by_route(),
            codec_s=codecs[name],
            codec_range_s=(float(diffs[name].min()), float(diffs[name].max())),
            comm_s=comms[name],
            step_s=steps[name],
            speedup_fp32=steps[DENSE] / steps[name],
            speedup_bf16=steps[BF16] / steps[name],
            steps_factor=factors[name],
            quality_fp32=steps[DENSE] / (factors[name] * steps[name]),
            quality_bf16=factors[BF16] * steps[BF16] / (factors[name] * steps[name]),
        )
        if name != DENSE:
            gbps, below = crossing(name, codecs[name])
            slowest, fastest = diffs[name].max(), diffs[name].min()
            advice = dataclasses.replace(
                advice,
                crossover_gbps=gbps,
                pays_below=below,
                crossover_range_gbps=(crossing(name, slowest)[0], crossing(name, fastest)[0]),
            )
        out.append(advice)
    return out
