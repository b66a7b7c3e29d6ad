"""Sparsification: keep ``k`` entries, send their indices and values; and top-k.

:class:`Sparsifier` is what every sparse message shares (``k`` from ``k`` or
``ratio``, the wire of indices and values, the residual without a dense
decode); :func:`top_k` keeps the largest entries here, and
:func:`compjax.compressors.rand_k.rand_k` random ones.

References:
  Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
  (top-k, its contraction constant).
  Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression", ICLR 2018
  (the sampled threshold of ``top_k(select="threshold")``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from compjax.compressor import Compressor, dtype_max
from compjax.compressors import exact_top_k, selection
from compjax.numerics import to_dtype

_F32_MAX = dtype_max(jnp.float32)


def subtract_entries(payload, y: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """``y - decompress(payload)`` for a message that decodes to ``values`` at the flat
    positions ``idx`` (distinct; any ``>= y.size`` is an unused slot) and to 0 elsewhere.

    A gather and a scatter of the ``k`` slots, where decoding writes a dense
    array of zeros that the subtraction reads again (two passes over ``d``
    entries saved): error feedback's residual.  The same values as decoding
    and subtracting: elsewhere ``y - 0 = y`` (``-0``, Inf and NaN included),
    and a kept entry's decode is its value on the payload's dtype, as
    :meth:`compjax.Compressor.finish` rounds it.  ``y`` has the payload's shape.
    """
    shape, dtype = tuple(payload.meta[0]), payload.meta[1]
    out = jnp.result_type(y.dtype, dtype)
    decoded = to_dtype(values.astype(jnp.float32), dtype).astype(out)
    flat = y.reshape(-1).astype(out)
    kept = flat.at[idx].get(mode="fill", fill_value=0)
    return flat.at[idx].set(kept - decoded, mode="drop").reshape(shape)


def check_k_ratio(k, ratio) -> None:
    if (k is None) == (ratio is None):
        raise ValueError(f"give exactly one of k and ratio, got k={k!r}, ratio={ratio!r}")
    if k is not None and (not isinstance(k, int | np.integer) or k < 1):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if ratio is not None and not (isinstance(ratio, int | float) and 0.0 < ratio <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")


@dataclasses.dataclass(frozen=True)
class Sparsifier(Compressor):
    """Common parts of top-k and random-k: ``k`` from ``k`` or ``ratio``."""

    k: int | None = None
    ratio: float | None = None
    keeps_dtype: ClassVar[bool] = True

    def k_for(self, d: int) -> int:
        """Entries kept of an input with ``d`` entries.

        Raises:
          ValueError: a fixed ``k`` larger than ``d``.
        """
        if d == 0:
            return 0
        if self.k is not None:
            if self.k > d:
                raise ValueError(f"k={self.k} exceeds the number of entries d={d}")
            return self.k
        return min(d, max(1, round(self.ratio * d)))

    def slots(self, d: int) -> int:
        """Index and value slots on the wire for ``d`` entries (``k``; padded selections more)."""
        return self.k_for(d)

    def scale(self, d: int) -> float:
        return 1.0

    def indices(self, key, flat, k) -> jax.Array:
        raise NotImplementedError

    def encode(self, key, flat, dtype):
        k = self.k_for(flat.shape[0])
        idx = self.indices(key, flat, k)
        return {"indices": idx, "values": flat[idx]}, {}

    def scatter(self, idx, values, n):
        # Unused slots hold index n (padded selections) and are dropped.
        dense = jnp.zeros((n,), jnp.float32).at[idx].set(values.astype(jnp.float32), mode="drop")
        scale = self.scale(n)
        if scale == 1.0:
            return dense
        # Finite values whose rescaling leaves float32 saturate; Inf/NaN pass through.
        scaled = dense * scale
        return jnp.where(jnp.isfinite(dense), jnp.clip(scaled, -_F32_MAX, _F32_MAX), scaled)

    def entries(self, wire, side, n):
        """The kept entries as sent: their indices (``n`` in an unused slot) and values."""
        return wire["indices"], wire["values"]

    def decode(self, wire, side, n, dtype):
        return self.scatter(*self.entries(wire, side, n), n)

    def subtract_decoded(self, payload, y):
        """``y - decompress(payload)``: :func:`subtract_entries` of the kept entries.

        Rescaled messages (unbiased random-k) decode and subtract.
        """
        n = math.prod(payload.meta[0])
        if self.scale(n) != 1.0 or tuple(y.shape) != tuple(payload.meta[0]):
            return super().subtract_decoded(payload, y)
        return subtract_entries(payload, y, *self.entries(payload.wire, payload.side, n))

    def value_bits(self, d: int, dtype) -> int:
        return self.slots(d) * np.dtype(dtype).itemsize * 8

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        return self.value_bits(d, dtype) + 32 * self.slots(d)


SELECTS = ("exact", "threshold")


@dataclasses.dataclass(frozen=True)
class TopK(Sparsifier):
    """Keep the ``k`` entries of largest magnitude (or, with ``select="threshold"``, every
    entry above a sampled threshold, between ``k_lo`` and ``k_hi`` of them).  See :func:`top_k`."""

    select: str = "exact"
    band: tuple[float, float] = (0.8, 1.3)
    sample_ratio: float = 0.01
    max_adaptation_iters: int = 10
    deterministic: ClassVar[bool] = True

    @property
    def branches(self):  # type: ignore[override]
        # Both selections' accept tests and NaN guards are conditionals (the exact
        # one's on inputs where exact_top_k.fast_exact_pays).
        return True

    def _threshold(self, d: int) -> bool:
        # An empty input has nothing to select; with k = d every entry is kept.
        return self.select == "threshold" and 0 < self.k_for(d) < d

    def count_band(self, d: int) -> tuple[int, int]:
        """``(k_lo, k_hi)``: the fewest and most entries kept of ``d`` (both ``k`` when exact).

        ``k_hi`` is the payload's number of slots.
        """
        k = self.k_for(d)
        if not self._threshold(d):
            return k, k
        return selection.band_limits(k, d, self.band)

    def slots(self, d: int) -> int:
        return self.count_band(d)[1]

    def indices(self, key, flat, k):
        d = flat.shape[0]
        if not self._threshold(d):
            return exact_top_k.top_k_indices(flat, k, sample_ratio=self.sample_ratio)
        return selection.sampled_threshold_select(
            flat,
            k,
            sample_ratio=self.sample_ratio,
            band=self.band,
            max_adaptation_iters=self.max_adaptation_iters,
        ).indices

    def encode(self, key, flat, dtype):
        idx = self.indices(key, flat, self.k_for(flat.shape[0]))
        # Unused slots (index d) carry the value 0.
        return {"indices": idx, "values": flat.at[idx].get(mode="fill", fill_value=0)}, {}

    def delta(self, d):
        # A threshold keeps every entry at or above it, so the n >= k_lo largest.
        return self.count_band(d)[0] / d if d > 0 else 1.0


def top_k(
    k: int | None = None,
    ratio: float | None = None,
    *,
    select: str = "exact",
    band: tuple[float, float] = (0.8, 1.3),
    sample_ratio: float = 0.01,
    max_adaptation_iters: int = 10,
) -> TopK:
    """Top-k sparsification: keep the ``k`` largest-magnitude entries.

    Give ``k`` (entries per array; an array with fewer entries raises
    ``ValueError`` when compressed) or ``ratio`` (``k = max(1, round(ratio d))``).
    An empty array has nothing to keep: whatever ``k``, it gives an empty
    payload (0 bits) and an empty output (the one exception to ``k > d``
    raising, so that trees with size-0 leaves compress).

    ``select`` chooses how the entries are found:

    * ``"exact"`` (default): the ``k`` entries of ``jax.lax.top_k`` of
      ``|x|`` (equal magnitudes by increasing index), sent in increasing
      index order.  On inputs where it pays (``2**16`` entries or more, ``k``
      at most ``d / 24``) the same indices come from the entries above a
      sampled threshold (:func:`compjax.compressors.exact_top_k.fast_exact_select`;
      25.6M entries at density 0.01 on a CPU: about 100 ms against 620 ms).
      Wire format: ``k`` int32 indices, increasing, and ``k`` values in the
      input dtype.  Theory: biased,
      ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``, ``delta = k/d``, equality at
      equal magnitudes.
    * ``"threshold"``: DGC's sampled threshold
      (:func:`compjax.compressors.selection.sampled_threshold_select`), a
      fraction of the cost of a full top-k on a CPU.  The ``ceil(num k/d)``-th
      largest of a strided sample of about ``sample_ratio d`` magnitudes sets
      a threshold, lowered by ``band[0]`` (up to ``max_adaptation_iters``
      times) while fewer than ``k_lo = ceil(band[0] k)`` entries reach it;
      every entry that reaches it is kept if they are between ``k_lo`` and
      ``k_hi = floor(band[1] k)`` (at most ``d``), else the exact top-``k``
      is.  The count is always in ``[k_lo, k_hi]`` (``count_band(d)``), and
      the payload has ``k_hi`` slots whatever the count (a static shape):
      ``k_hi`` int32 indices and ``k_hi`` values, unused slots carrying index
      ``d`` and value 0; the bits are those of the slots.  Theory: the kept
      entries are all those at or above a threshold, hence the ``n`` largest
      for some ``n >= k_lo``, so ``||C(x) - x||^2 <= (1 - n/d) ||x||^2 <= (1
      - k_lo/d) ||x||^2``: ``delta = k_lo/d``.  Deterministic: the sample
      starts at entry 0.  With ``k = d`` (or an empty input) it is the exact
      selection.  On a TPU, ``jax.lax.approx_max_k`` is the hardware's own
      approximate top-k (a recall target instead of a count band).  A NaN
      reaches every threshold (an entry reaches ``t`` where ``not |x| <
      t``) and ``jax.lax.top_k`` ranks it first, so with either selection a
      NaN or an infinity in ``x`` is sent, never dropped.

    Args:
      k: entries kept of each array (give ``k`` or ``ratio``, not both).
      ratio: the fraction of the ``d`` entries kept, ``k = max(1, round(ratio d))``,
        in ``(0, 1]``.
      select: ``"exact"`` or ``"threshold"``, as above.
      band: ``(low, high)``, the threshold's accepted counts relative to ``k``
        (``select="threshold"`` only).
      sample_ratio: the fraction of the entries sampled for the threshold
        (both selections' samples; the exact one enlarges it where needed).
      max_adaptation_iters: how many times the threshold may be lowered before
        the exact top-``k`` is taken instead.

    Returns:
      A :class:`TopK` compressor whose payload holds ``"indices"`` (int32, ``k``
      slots, or ``k_hi`` with the threshold) and ``"values"`` (the kept entries
      in the input dtype); it decodes to those values at those positions and 0
      elsewhere.

    Raises:
      ValueError: both or neither of ``k`` and ``ratio``; ``k < 1``; ``ratio``
        outside ``(0, 1]``; ``select`` not ``"exact"`` or ``"threshold"``;
        ``band`` not a pair with ``0 < band[0] <= 1 <= band[1]``;
        ``sample_ratio`` outside ``(0, 1]``; ``max_adaptation_iters < 0``
        (each message names the parameter).

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
      Lin et al., "Deep Gradient Compression", ICLR 2018 (the sampled
      threshold and its accept band).
    """
    check_k_ratio(k, ratio)
    if select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
    return TopK(
        k=None if k is None else int(k),
        ratio=None if ratio is None else float(ratio),
        select=select,
        band=selection.check_band(band, "band"),
        sample_ratio=selection.check_sample_ratio(sample_ratio),
        max_adaptation_iters=selection.check_iters(max_adaptation_iters),
    )
