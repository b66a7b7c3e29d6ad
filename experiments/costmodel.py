"""The alpha-beta network model: bits on the wire to predicted communication time.

For ``n`` workers on a ring with per-message latency ``alpha`` (seconds) and
link bandwidth ``beta`` (bits per second):

* all-reduce of ``b`` bits per worker: ``2 (n - 1) alpha + 2 (n - 1) / n * b / beta``;
* all-gather of ``b`` bits per worker: ``(n - 1) alpha + (n - 1) b / beta``
  (every worker receives the other ``n - 1`` messages).

A step's messages are fused into one all-reduce and one all-gather (as
gradient bucketing does), so a step pays each latency term at most once.  An
all-gathered message beats a dense all-reduce of ``B`` bits only when
``b / B < 2 / n``.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005 (ring all-reduce and all-gather costs).
  Wen et al., "TernGrad", NeurIPS 2017, Section 5 (the performance model).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Network:
    """A homogeneous network: ``bandwidth_gbps`` Gbit/s per link and ``latency_us`` per message."""

    bandwidth_gbps: float = 10.0
    latency_us: float = 5.0

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if not self.latency_us >= 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")

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

    def step(self, reduced_bits: float, gathered_bits: float, workers: int) -> float:
        """Seconds for one step that all-reduces and all-gathers these bits per worker."""
        return self.allreduce(reduced_bits, workers) + self.allgather(gathered_bits, workers)


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
