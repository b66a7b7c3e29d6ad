"""Will compression pay for sharded training?  ``python -m compjax.advise --fsdp`` or
:func:`advise_fsdp`.

The sharded-training mode of :mod:`compjax.advise`: each :func:`compjax.fsdp` step in
:data:`FSDP_METHODS` is costed from its messages (the parameter all-gather, the gradient
reduce-scatter, the replicated leaves' mean and the non-finite flag), counted by
:func:`compjax.communication` on an abstract mesh and timed by :mod:`compjax.costmodel`.
The codecs are not timed here: a step is its compute plus its messages' time.  The
command ends, as :mod:`compjax.advise`'s does, with a recommendation
(:func:`fsdp_recommendation`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from compjax import costmodel
from compjax.accounting import communication
from compjax.advise.advisor import AXIS, _positive, as_params, messages
from compjax.compressors.dense import cast
from compjax.compressors.int_quant import int_quant
from compjax.compressors.sign import scaled_sign
from compjax.steps.fsdp import fsdp

#: The sharded-training (FSDP) steps :func:`advise_fsdp` costs: :func:`compjax.fsdp`'s
#: keyword arguments (dense float32 first).
FSDP_METHODS: dict[str, Callable[[], dict]] = {
    "fsdp fp32": lambda: {},
    "fsdp bf16": lambda: {"compressor": cast("bfloat16"), "gather": "bfloat16"},
    "fsdp int8 gather + int4 grads": lambda: {
        "compressor": int_quant(4),
        "gather": "int8",
    },
    "fsdp scaled sign + EF, int8 gather": lambda: {
        "compressor": scaled_sign(),
        "feedback": "ef",
        "gather": "int8",
    },
}


@dataclasses.dataclass(frozen=True)
class FSDPAdvice:
    """The predicted communication of one sharded-training step (:func:`advise_fsdp`).

    Attributes:
      method: a name of :data:`FSDP_METHODS`.
      gather_bits: bits one worker sends per step gathering the parameters.
      gradient_bits: the same for the gradient (reduce-scatter, the replicated
        leaves' mean, the non-finite flag).
      comm_s: the time of the step's messages on the network.
      step_s: compute plus ``comm_s`` (codecs not timed).
      speedup_fp32: dense float32 FSDP's ``step_s`` over this one's.
    """

    method: str
    gather_bits: float
    gradient_bits: float
    comm_s: float
    step_s: float
    speedup_fp32: float


def advise_fsdp(
    params: Any,
    workers: int,
    bandwidth_gbps: float,
    latency_us: float,
    compute_s: float,
    *,
    shared: bool = False,
    min_size: int = 4096,
) -> list[FSDPAdvice]:
    """Predicted communication of a :func:`compjax.fsdp` step for each of :data:`FSDP_METHODS`.

    Each step's messages (the parameter all-gather, the gradient
    reduce-scatter, the replicated leaves' mean and the flag) are counted by
    :func:`compjax.communication` on an abstract mesh of ``workers`` (no
    devices needed) and timed by :mod:`compjax.costmodel`: per worker the
    gather sends ``(n - 1)/n M_param,c`` and the reduce-scatter
    ``(n - 1)/n M_grad,c``.  Unlike :func:`advise`, the codecs are not timed:
    ``step_s`` is ``compute_s`` plus the messages' time.

    Args:
      params: the params tree (arrays or ``jax.ShapeDtypeStruct``), or a parameter count.
      workers: data-parallel workers, at least 2.
      bandwidth_gbps, latency_us: the network (per worker, or of the shared
        medium with ``shared=True``).
      compute_s: forward and backward per step, without communication.
      shared: one medium all workers' bits cross (``costmodel.SharedMedium``).
      min_size: :func:`compjax.fsdp`'s ``min_size`` (smaller leaves stay replicated).

    Returns:
      One :class:`FSDPAdvice` per method, dense float32 FSDP first.

    Raises:
      ValueError: a bad argument, naming it.

    References:
      Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
      Giant Model Training", ICLR 2024.
    """
    if not isinstance(workers, int | np.integer) or isinstance(workers, bool) or workers < 2:
        raise ValueError(f"workers must be an integer >= 2, got {workers!r}")
    _positive("bandwidth_gbps", bandwidth_gbps)
    _positive("compute_s", compute_s)
    _positive("latency_us", latency_us, zero=True)
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype), as_params(params))
    kind = costmodel.SharedMedium if shared else costmodel.Network
    network = kind(bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)
    mesh = jax.sharding.AbstractMesh((int(workers),), (AXIS,))
    out = []
    for name, kwargs in FSDP_METHODS.items():
        fs = fsdp(lambda p: 0.0, optax.sgd(0.0), params, mesh, AXIS, min_size=min_size, **kwargs())
        report = communication(fs, params, AXIS, num_workers=int(workers))
        comm = network.exchange(messages(report), int(workers))
        step = compute_s + comm
        fp32 = out[0].step_s if out else step
        out.append(
            FSDPAdvice(name, report.gather_bits, report.gradient_bits, comm, step, fp32 / step)
        )
    return out


def fsdp_table(advice: Sequence[FSDPAdvice]) -> str:
    """The FSDP methods as a text table: MiB per worker per step, times, speedup."""
    lines = [
        f"{'FSDP step':36s} {'gather MiB':>10s} {'grads MiB':>10s} {'comm ms':>9s} "
        f"{'step ms':>9s} {'x fsdp fp32':>11s}"
    ]
    for a in advice:
        lines.append(
            f"{a.method:36s} {a.gather_bits / 8 / 2**20:10.2f} {a.gradient_bits / 8 / 2**20:10.2f}"
            f" {1e3 * a.comm_s:9.1f} {1e3 * a.step_s:9.1f} {a.speedup_fp32:11.2f}"
        )
    return "\n".join(lines)


#: A compressed step must be shorter than dense float32 FSDP's by more than this fraction to be
#: recommended: the codecs are not timed, and a gain this small is within what they cost.
MIN_GAIN = 0.01


def fsdp_recommendation(advice: Sequence[FSDPAdvice], bandwidth_gbps: float) -> str:
    """The answer: the step with the shortest predicted time, how much shorter than dense
    float32 FSDP's it is, and that the codecs were not timed.

    Dense float32 FSDP is recommended when no compressed step is shorter than it by more
    than :data:`MIN_GAIN` (its messages are then a negligible part of the step).
    """
    dense = advice[0]
    best = min(advice, key=lambda a: a.step_s)
    at = f"at {bandwidth_gbps:g} Gbit/s"
    if best is dense or best.step_s > (1 - MIN_GAIN) * dense.step_s:
        share = dense.comm_s / dense.step_s
        return (f"Recommendation: {dense.method}; no compressed step is more than "
                f"{100 * MIN_GAIN:g}% shorter {at} (its messages are {100 * share:.1f}% of its "
                f"{1e3 * dense.step_s:.1f} ms step).")  # fmt: skip
    return (f"Recommendation: {best.method}, {best.speedup_fp32:.2f}x {dense.method}'s step {at} "
            f"({1e3 * best.step_s:.1f} ms against {1e3 * dense.step_s:.1f} ms); messages only, "
            "the codecs not timed: measure the steps with compjax.auto before committing to "
            "one.")  # fmt: skip
