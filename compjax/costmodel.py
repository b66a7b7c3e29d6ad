"""The alpha-beta network model: bits on the wire to predicted communication time.

For ``n`` workers on a ring with per-message latency ``alpha`` (seconds) and
link bandwidth ``beta`` (bits per second):

* all-reduce of ``b`` bits per worker: ``2 (n - 1) alpha + 2 (n - 1) / n * b / beta``;
* all-gather of ``b`` bits per worker: ``(n - 1) alpha + (n - 1) b / beta``
  (every worker receives the other ``n - 1`` messages).

* scatter-gather of ``b`` bits per worker (all-to-all of compressed shards,
  each owner decodes and sums its shard, re-compresses it and all-gathers):
  like an all-reduce of the compressed size, ``2 (n - 1) alpha + 2 (n - 1) / n
  * b / beta``.

A step's messages are fused into one all-reduce and one all-gather (as
gradient bucketing does), so a step pays each latency term at most once.  An
all-gathered message beats a dense all-reduce of ``B`` bits only when
``b / B < 2 / n``.

:class:`SharedMedium` is the other extreme: one link of ``beta`` bit/s that
every worker's bytes cross (a hub, a single congested uplink, or ``tc``'s
token bucket on the loopback device that ``make bench-net`` uses).  A
collective then takes the bits sent by *all* workers over ``beta``: ``2 (n -
1) b`` for a ring all-reduce or a scatter-gather, ``n (n - 1) b`` for an
all-gather.  :func:`wire_bits` gives the per-worker bits of each collective
under ring algorithms (what gloo's CPU collectives send, measured); both
models are built on it.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005 (ring all-reduce and all-gather costs).
  Wen et al., "TernGrad", NeurIPS 2017, Section 5 (the performance model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

#: Collectives by the bits one worker sends for a message of ``b`` bits per worker.
COLLECTIVES = ("allreduce", "scatter_gather", "allgather", "alltoall", "reduce_scatter", "permute")


def wire_bits(collective: str, bits: float, workers: int) -> float:
    """Bits one worker puts on the wire for a ``bits``-bit message per worker (ring algorithms).

    ``allreduce`` and ``scatter_gather``: ``2 (n - 1) / n * b``; ``allgather``:
    ``(n - 1) b``; ``alltoall`` and ``reduce_scatter``: ``(n - 1) / n * b``
    (``b`` being the input of either); ``permute``: ``b``.  Zero for one worker.

    Raises:
      ValueError: an unknown collective.
    """
    n = workers
    factors = {
        "allreduce": 2 * (n - 1) / n,
        "scatter_gather": 2 * (n - 1) / n,
        "allgather": n - 1,
        "alltoall": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "permute": 1.0,
    }
    if collective not in factors:
        raise ValueError(f"unknown collective {collective!r}; one of {COLLECTIVES}")
    if n < 2 or bits <= 0:
        return 0.0
    return factors[collective] * bits


def latency_rounds(collective: str, workers: int) -> int:
    """Message rounds of the ring algorithm: ``2 (n - 1)`` for all-reduce and
    scatter-gather, ``n - 1`` for all-gather, all-to-all and reduce-scatter, 1 for a permute."""
    n = workers
    if n < 2:
        return 0
    if collective in ("allreduce", "scatter_gather"):
        return 2 * (n - 1)
    return 1 if collective == "permute" else n - 1


@dataclasses.dataclass(frozen=True)
class Network:
    """A homogeneous network: ``bandwidth_gbps`` Gbit/s per link and ``latency_us`` per message.

    ``bandwidth_gbps=math.inf`` is an unlimited link (bits cost no time, only the latency);
    NaN, zero or negative bandwidths and a NaN, negative or infinite latency are refused.
    """

    bandwidth_gbps: float = 10.0
    latency_us: float = 5.0

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ValueError(
                f"bandwidth_gbps must be > 0 (inf: unlimited), got {self.bandwidth_gbps}"
            )
        if not 0 <= self.latency_us < math.inf:
            raise ValueError(f"latency_us must be finite and >= 0, got {self.latency_us}")

    @property
    def alpha(self) -> float:
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        return self.bandwidth_gbps * 1e9

    def allreduce(self, bits: float, workers: int) -> float:
        """Seconds to all-reduce ``bits`` per worker over ``workers`` (0 when nothing is sent)."""
        if workers < 2 or bits <= 0:
            return 0.0
        n = workers
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * bits / self.beta

    def allgather(self, bits: float, workers: int) -> float:
        """Seconds to all-gather messages of ``bits`` per worker over ``workers``."""
        if workers < 2 or bits <= 0:
            return 0.0
        return (workers - 1) * (self.alpha + bits / self.beta)

    def scatter_gather(self, bits: float, workers: int) -> float:
        """Seconds to scatter-gather ``bits`` compressed bits per worker: an all-reduce's cost."""
        return self.allreduce(bits, workers)

    def collective(self, collective: str, bits: float, workers: int) -> float:
        """Seconds of one ``collective`` of ``bits`` per worker, each worker on its own link."""
        if workers < 2 or bits <= 0:
            return 0.0
        rounds = latency_rounds(collective, workers)
        return rounds * self.alpha + wire_bits(collective, bits, workers) / self.beta

    def exchange(self, messages: Iterable[tuple[str, float]], workers: int) -> float:
        """Seconds of a step's ``(collective, bits per worker)`` messages, one after another."""
        return sum(self.collective(c, b, workers) for c, b in messages)

    def step(self, reduced_bits: float, gathered_bits: float, workers: int) -> float:
        """Seconds for one step that all-reduces and all-gathers these bits per worker."""
        return self.allreduce(reduced_bits, workers) + self.allgather(gathered_bits, workers)


@dataclasses.dataclass(frozen=True)
class SharedMedium(Network):
    """One link of ``bandwidth_gbps`` that all workers share; ``latency_us`` per message round.

    A collective takes ``rounds * alpha + (bits sent by all workers) / beta``:
    ``2 (n - 1) b / beta`` for a ring all-reduce or a scatter-gather of ``b``
    bits per worker, ``n (n - 1) b / beta`` for an all-gather.
    """

    latency_us: float = 0.0

    def collective(self, collective: str, bits: float, workers: int) -> float:
        if workers < 2 or bits <= 0:
            return 0.0
        total = workers * wire_bits(collective, bits, workers)
        return latency_rounds(collective, workers) * self.alpha + total / self.beta

    def allreduce(self, bits: float, workers: int) -> float:
        return self.collective("allreduce", bits, workers)

    def allgather(self, bits: float, workers: int) -> float:
        return self.collective("allgather", bits, workers)


def predicted_step(
    base_s: float, messages: Iterable[tuple[str, float]], workers: int, network: Network
) -> float:
    """Step seconds: ``base_s`` (compute + codec, measured without a rate limit) plus the
    time of the step's ``(collective, bits per worker)`` messages on ``network``."""
    return base_s + network.exchange(messages, workers)


def speedup(
    compute_s: float,
    dense_bits: float,
    reduced_bits: float,
    gathered_bits: float,
    compress_s: float,
    workers: int,
    network: Network,
) -> float:
    """Predicted step-time ratio dense / compressed, without overlap of compute and communication.

    ``compute_s`` is the forward-backward time per step, ``compress_s`` the
    compress + decompress time the method adds; the dense step all-reduces
    ``dense_bits``.  Above 1 compression pays.
    """
    dense = compute_s + network.allreduce(dense_bits, workers)
    compressed = compute_s + compress_s + network.step(reduced_bits, gathered_bits, workers)
    return dense / compressed
