"""Sparsification: keep ``k`` entries, send their indices and values.

References:
  Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
  (top-k and random-k, their contraction constants).
  Wangni, Wang, Liu, Zhang, "Gradient Sparsification for
  Communication-Efficient Distributed Optimization", NeurIPS 2018.
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

from compjax.compressor import Compressor, dtype_max, raw_key
from compjax.compressors import selection
from compjax.draws import bernoulli
from compjax.numerics import divide, round_to, to_dtype

_F32_MAX = float(jnp.finfo(jnp.float32).max)


def rescaled(values: jax.Array, scale: float, dtype) -> jax.Array:
    """What a kept value decodes to: ``values * scale`` in float32, saturated, on ``dtype``'s grid.

    The same operations as :meth:`Sparsifier.scatter` followed by
    :meth:`compjax.Compressor.finish` (finite values only).
    """
    return round_to(jnp.clip(values.astype(jnp.float32) * scale, -_F32_MAX, _F32_MAX), dtype)


def dither(key, values: jax.Array, scale: float) -> jax.Array:
    """Kept values (bfloat16/float16) nudged so that their rescaled decodes are unbiased.

    Rescaling by ``scale = d/k`` and rounding to the values' dtype would bias
    each kept entry by up to half an ulp.  Instead, of the values' neighbours
    ``w`` (up to two ulps either way) the two whose decodes bracket the
    float32 target ``v * scale`` are chosen between with the probability that
    makes the expected decode equal that target.  Values whose target leaves
    the dtype's range (float16 beyond 65504) saturate, and Inf/NaN are kept.
    """
    dtype = values.dtype
    limit = jnp.asarray(jnp.finfo(dtype).max, dtype)
    target = values.astype(jnp.float32) * scale
    near = [values]
    for _ in range(2):
        near = [jnp.nextafter(near[0], -limit), *near, jnp.nextafter(near[-1], limit)]
    near = [jnp.clip(w, -limit, limit) for w in near]
    decoded = [rescaled(w, scale, dtype) for w in near]
    lo, v_lo, hi, v_hi = values, target, values, target
    for w, v in zip(near, decoded, strict=True):  # ascending: keep the last below
        lo, v_lo = jnp.where(v <= target, w, lo), jnp.where(v <= target, v, v_lo)
    for w, v in zip(near[::-1], decoded[::-1], strict=True):  # and the first above
        hi, v_hi = jnp.where(v >= target, w, hi), jnp.where(v >= target, v, v_hi)
    bracket = jnp.isfinite(target) & (v_lo <= target) & (target <= v_hi)
    p = divide(jnp.where(bracket, target - v_lo, 0.0), jnp.where(bracket, v_hi - v_lo, 0.0))
    return jnp.where(bracket, jnp.where(bernoulli(key, p), hi, lo), values)


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


def _check_k_ratio(k, ratio) -> None:
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
        # one's on inputs where selection.fast_exact_pays).
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
            return selection.top_k_indices(flat, k, sample_ratio=self.sample_ratio)
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


@dataclasses.dataclass(frozen=True)
class RandK(Sparsifier):
    """Keep ``k`` uniformly random entries.  See :func:`rand_k`."""

    scaled: bool = True
    shared_seed: bool = False

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.scaled

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.shared_seed

    def scale(self, d):
        k = self.k_for(d)
        return d / k if self.scaled and k else 1.0

    def indices(self, key, flat, k):
        d = flat.shape[0]
        if k == 0:
            return jnp.zeros((0,), jnp.int32)
        return jax.random.choice(key, d, (k,), replace=False).astype(jnp.int32)

    def encode(self, key, flat, dtype):
        d = flat.shape[0]
        # With a shared seed the raw key travels as side information; both ends draw from it.
        index_key = raw_key(key) if self.shared_seed else key
        idx = self.indices(index_key, flat, self.k_for(d))
        values = flat[idx]
        if self.scaled and idx.size and np.dtype(dtype).itemsize < 4:
            values = dither(jax.random.fold_in(key, 1), values, self.scale(d))
        if self.shared_seed:
            return {"values": values}, {"key": index_key}
        return {"indices": idx, "values": values}, {}

    def entries(self, wire, side, n):
        if not self.shared_seed:
            return super().entries(wire, side, n)
        # Both ends draw the indices from the shared key.
        return self.indices(side["key"], jnp.zeros((n,)), self.k_for(n)), wire["values"]

    def omega(self, d):
        if not self.scaled:
            return None
        return d / self.k_for(d) - 1.0 if d else 0.0

    def unbiased_range(self, d, dtype=jnp.float32):
        """``max * k/d`` (``max``: the dtype's largest value): ``x_i d/k`` must be representable."""
        if not self.scaled:
            return None
        k = self.k_for(d)
        return dtype_max(dtype) * (k / d if d else 1.0)

    def delta(self, d):
        if self.scaled:
            return None
        return self.k_for(d) / d if d else 1.0

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        return self.value_bits(d, dtype) + (0 if self.shared_seed else 32 * self.k_for(d))


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
      sampled threshold (:func:`compjax.compressors.selection.fast_exact_select`;
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
    _check_k_ratio(k, ratio)
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


def rand_k(
    k: int | None = None,
    ratio: float | None = None,
    scaled: bool = True,
    shared_seed: bool = False,
) -> RandK:
    """Random-k sparsification: keep ``k`` entries chosen uniformly without replacement.

    Args:
      k, ratio: as in :func:`top_k`.
      scaled: multiply by ``d/k`` on decoding, making the compressor unbiased
        with ``omega = d/k - 1`` exactly (for every ``x``; a rescaled value
        beyond the float32 range saturates at its limit); unscaled it is
        biased with ``E||C(x) - x||^2 = (1 - k/d) ||x||^2``, ``delta = k/d``.
        For bfloat16/float16 inputs the rescaled value is rounded to the
        input dtype on decoding, so each kept value is first moved to one of
        its neighbours (:func:`dither`) such that the expected decode is
        ``x_i d/k``: unbiased while ``|x_i| d/k`` stays below the dtype's
        largest value (float16: 65504, beyond which it saturates).  The two
        decodes chosen between are at most 3 ulps of ``x_i d/k`` apart, so a
        kept entry gains at most ``(3 ulp)^2 / 4`` of variance.  With
        ``shared_seed`` the neighbours are chosen with the shared key, so
        that choice is the same on every worker.
      shared_seed: the indices derive from the key alone, so only the values
        travel (the key is side information every worker holds) and payloads
        of workers that used the same key can be summed before decoding
        (``linear``).

    Range of unbiasedness (``unbiased_range(d, dtype)``): ``max|x_i| <=
    max * k/d`` with ``max`` the dtype's largest finite value (float32:
    3.4e38, so ``ratio=0.1`` is unbiased up to 3.4e37); beyond it a kept
    ``x_i d/k`` saturates at ``max`` and the mean falls short (3e38
    averages to ``max * k/d``: 3.4e37 at ``d = 100``, ``ratio=0.1``).  A concrete input beyond it
    warns (``UnbiasedRangeWarning``); inputs under ``jit`` are not checked.
    As :func:`top_k`, an empty input gives an empty payload whatever ``k``.

    Wire format: int32 indices and values in the input dtype; values only with
    ``shared_seed``.

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
      Wangni et al., "Gradient Sparsification for Communication-Efficient
      Distributed Optimization", NeurIPS 2018.
    """
    _check_k_ratio(k, ratio)
    return RandK(
        k=None if k is None else int(k),
        ratio=None if ratio is None else float(ratio),
        scaled=bool(scaled),
        shared_seed=bool(shared_seed),
    )
