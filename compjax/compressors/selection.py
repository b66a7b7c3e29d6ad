"""Top-k selection: which entries of an array a sparse message carries.

Used by :func:`compjax.top_k` (``select="exact"`` or ``"threshold"``) and by
:func:`compjax.dgc` for each worker's accumulated velocity.

The exact top-``k`` (``jax.lax.top_k``) and DGC's sampled threshold: the
threshold is estimated from a strided sample of ``|x|`` (about 1% of the
entries), lowered while too few entries pass it, and the exact top-``k`` is
taken where the count falls outside an accepted band.  Every selection has a
static capacity (a fixed number of int32 slots, padded with ``d``), so the
message has a fixed size.

The fast path (:class:`_Blocks`, :func:`_blocked_select`) reduces ``x`` once
to block maxima and counts and compacts on the candidate blocks only; it
gives the reference selection (:func:`_reference_select`, full passes over
``|x|``) entry for entry.

References:
  Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training", ICLR 2018 (Section 3,
  the sampled threshold).
  The authors' public implementation (``DGCCompressor``): the sample size
  and the threshold adaptation follow it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Selection(NamedTuple):
    """The coordinates a worker sends, in a fixed number of slots.

    Attributes:
      indices: int32 flat indices, ``capacity`` slots; unused slots hold
        ``d`` (one past the last entry), which every scatter drops.
      count: how many slots are used.
      fallback: whether the exact top-k was used instead of the threshold.
    """

    indices: jax.Array
    count: jax.Array
    fallback: jax.Array


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))  # 0.2 * 15 is 3.0000000000000004, not 4


def _floor(x: float) -> int:
    return math.floor(round(x, 9))


def num_selected(d: int, ratio: float) -> int:
    """``k = ceil(ratio d)`` entries sent of ``d`` (at least 1, at most ``d``)."""
    return min(d, max(1, _ceil(ratio * d)))


def band_limits(k: int, d: int, band: tuple[float, float]) -> tuple[int, int]:
    """Accepted counts ``[ceil(lo k), floor(hi k)]``; the upper one is the payload capacity."""
    return min(k, _ceil(band[0] * k)), min(d, max(k, _floor(band[1] * k)))


def check_band(band, name: str = "band") -> tuple[float, float]:
    """``band`` as a float pair ``0 < low <= 1 <= high``; else ``ValueError`` naming ``name``."""
    try:
        low, high = (float(b) for b in band)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (low, high), got {band!r}") from None
    if not 0.0 < low <= 1.0 <= high:
        raise ValueError(f"{name} must satisfy 0 < low <= 1 <= high, got {band!r}")
    return low, high


def check_sample_ratio(value, name: str = "sample_ratio") -> float:
    """``value`` as a float in ``(0, 1]``; else ``ValueError`` naming ``name``."""
    if isinstance(value, int | float | np.floating) and not isinstance(value, bool):
        if 0.0 < value <= 1.0:
            return float(value)
    raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def check_iters(value, name: str = "max_adaptation_iters") -> int:
    """``value`` as an integer ``>= 0``; else ``ValueError`` naming ``name``."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def sample_layout(d: int, k: int, sample_ratio: float) -> tuple[int, int]:
    """``(stride, num_samples)`` of the strided sample of ``d`` entries.

    At least ``sample_ratio d`` samples and at least ``2 d / k`` (so the
    sample's own top part holds two entries), as in the public implementation;
    the stride is made odd so that it does not alias with power-of-two row
    lengths (the public code uses ``32 j + 1`` strides for the same reason).
    """
    target = min(d, max(_ceil(sample_ratio * d), _ceil(2 * d / k)))
    stride = max(1, d // target)
    if stride > 1 and stride % 2 == 0:
        stride -= 1
    return stride, d // stride


def _padded(indices: jax.Array, capacity: int, d: int) -> jax.Array:
    pad = jnp.full((capacity - indices.shape[0],), d, jnp.int32)
    return jnp.concatenate([indices.astype(jnp.int32), pad])


def exact_select(x: jax.Array, k: int, capacity: int | None = None) -> Selection:
    """The exact top-``k`` of ``|x|`` (``jax.lax.top_k``), padded to ``capacity`` slots."""
    mag = jnp.abs(x.reshape(-1)).astype(jnp.float32)
    idx = jax.lax.top_k(mag, k)[1]
    return Selection(_padded(idx, capacity or k, mag.shape[0]), jnp.int32(k), jnp.bool_(True))


def _samples(x, k, offset, sample_ratio):
    """``|x|`` at the strided sample positions, and the rank of the threshold among them."""
    d = x.shape[0]
    stride, num = sample_layout(d, k, sample_ratio)
    samples = jnp.abs(x[offset % stride + stride * jnp.arange(num)])
    return samples, min(num, max(1, _ceil(num * k / d)))


def _adapt(count, threshold, low, max_adaptation_iters, factor):
    """Lower the threshold by ``factor`` while fewer than ``low`` entries pass it."""

    def cond(carry):
        _, n, i = carry
        return (n < low) & (i < max_adaptation_iters)

    def body(carry):
        t, _, i = carry
        return t * factor, count(t * factor), i + 1

    threshold, n, _ = jax.lax.while_loop(cond, body, (threshold, count(threshold), 0))
    return threshold, n


# -- the fast path: blocks of |x| ---------------------------------------------------
# On a CPU, XLA runs a plain reduction of x at memory speed, but a pass that
# compares every entry with a threshold and sums the result, or a prefix sum
# over all entries (``jnp.nonzero``), costs several times more.  The selection
# is sparse, so the fast path reduces x once to the maximum of |x| over blocks
# (of ``block_size(d, capacity)`` entries); for a threshold t only the blocks
# whose maximum reaches t (at most as many as the entries that pass) can hold
# a selected entry, and counting and the ordered compaction run on those
# blocks only.  The result is the reference path's selection, entry for entry.
_BLOCK = 64  # the largest block (and the blocks of the sample's k-th largest)
_SUB_BLOCK = 8  # the smallest block; the final selection narrows larger ones to it
_PREFIX_ROW = 64  # prefix sums as products with a triangular matrix, 64 per row
_EXACT_F32 = 2**24  # integers up to here are exact in float32


def block_size(d: int, capacity: int) -> int:
    """Entries per block of the fast path: a power of two in ``[8, 64]``.

    The candidate blocks are gathered in ``capacity`` slots, ``capacity *
    size`` entries; the largest size that keeps this within an eighth of
    ``d`` is taken (64 at DGC's density 0.001, 8 at 0.01), so that the
    gathers stay a small fraction of a pass over ``x``.
    """
    size = _BLOCK
    while size > _SUB_BLOCK and 8 * capacity * size > d:
        size //= 2
    return size


def _kth_largest(values: jax.Array, top: int) -> jax.Array:
    """``jax.lax.top_k(values, top)[0][-1]`` for 1-D ``values >= 0`` (no NaN), without a top-k.

    Few wanted (``2 top`` at most the number of blocks of ``_BLOCK``): the
    ``top`` largest values lie in the ``top`` blocks with the largest maxima
    (a block left out has its maximum, hence all its entries, at most the
    ``top``-th largest block maximum, which is at most the ``top``-th largest
    value), so a top-k of those blocks' entries gives it.  Many wanted (DGC's
    sample at density 0.01 wants thousands, where a top-k costs XLA on a CPU
    more than a pass over all of ``x``): a bisection on the values' bits.  A
    non-negative float32 orders as its bits read as an int32, so the answer
    is the largest bit pattern ``b`` with ``count(bits >= b) >= top``: 31
    halvings of ``[0, bits(inf)]``, each a count over ``values``.
    """
    m = values.shape[0]
    rows = -(-m // _BLOCK)
    if rows <= 2 * top and top <= _BLOCK:
        return jax.lax.top_k(values, top)[0][-1]
    if rows > 2 * top:
        blocks = jnp.pad(values, (0, rows * _BLOCK - m), constant_values=-1.0)
        blocks = blocks.reshape(rows, _BLOCK)
        best = jax.lax.top_k(jnp.max(blocks, axis=1), top)[1]
        return jax.lax.top_k(blocks[best].reshape(-1), top)[0][-1]
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)

    def halve(_, bounds):  # count(bits >= lo) >= top > count(bits >= hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(bits >= mid, dtype=jnp.int32) >= top
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    inf = int(np.array(np.inf, np.float32).view(np.int32))
    lo, _ = jax.lax.fori_loop(0, 31, halve, (jnp.int32(0), jnp.int32(inf + 1)))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def _row_prefix(counts: jax.Array, most: int) -> jax.Array:
    """Exclusive prefix sums of a 2-D array of counts in ``[0, most]``, row-major, as int32.

    Within rows: up to ``_SUB_BLOCK`` columns, running sums column by column
    (one fused pass); wider rows, a product with a triangular matrix of ones
    (exact in float32: every partial sum stays below ``2**24``).  Across
    rows, the same on the row totals, down to ``_PREFIX_ROW`` of them.
    ``jnp.cumsum`` over many entries costs XLA on a CPU tens of times a pass
    over them.
    """
    rows, cols = counts.shape
    if cols <= _SUB_BLOCK:
        ints = counts.astype(jnp.int32)
        running = [jnp.zeros((rows,), jnp.int32)]
        for j in range(1, cols + 1):
            running.append(running[-1] + ints[:, j - 1])
        within, totals = jnp.stack(running[:-1], axis=1), running[-1]
    else:
        upper = jnp.triu(jnp.ones((cols, cols), jnp.float32))
        inclusive = jnp.matmul(
            counts.astype(jnp.float32), upper, precision=jax.lax.Precision.HIGHEST
        ).astype(jnp.int32)
        within, totals = inclusive - counts.astype(jnp.int32), inclusive[:, -1]
    if rows <= _PREFIX_ROW:
        offsets = jnp.cumsum(totals) - totals
    else:
        offsets = _prefix(totals, cols * most)
    return within + offsets[:, None]


def _prefix(counts: jax.Array, most: int, row: int = _PREFIX_ROW) -> jax.Array:
    """Exclusive prefix sums of a 1-D array of counts in ``[0, most]``, as int32.

    The first level in rows of ``row`` entries, the row totals in rows of
    ``_PREFIX_ROW``.
    """
    m = counts.shape[0]
    if m <= _PREFIX_ROW or m * most > _EXACT_F32 or _PREFIX_ROW * most > _EXACT_F32:
        return (jnp.cumsum(counts, dtype=jnp.int32) - counts).astype(jnp.int32)
    rows = -(-m // row)
    padded = jnp.pad(counts, (0, rows * row - m)).reshape(rows, row)
    return _row_prefix(padded, most).reshape(-1)[:m]


def _compact(mask: jax.Array, values: jax.Array, size: int, fill: int) -> jax.Array:
    """``values`` where ``mask`` holds, in row-major order, in ``size`` slots padded with ``fill``.

    ``values[jnp.nonzero(mask, size=size)]`` with the unused slots set to
    ``fill`` (true entries beyond the first ``size`` are dropped).  ``mask``
    and ``values`` are 1-D, or 2-D with at most ``_BLOCK`` columns.
    """
    prefix = _prefix(mask, 1, _SUB_BLOCK) if mask.ndim == 1 else _row_prefix(mask, 1)
    pos = jnp.where(mask, prefix, size).reshape(-1)
    out = jnp.full((size,), fill, jnp.int32)
    return out.at[pos].set(values.reshape(-1).astype(jnp.int32), mode="drop")


def _abs_max(rows: jax.Array) -> jax.Array:
    """``max |rows|`` per row as ``max(max x, -min x)``: reductions of ``x`` itself, which XLA
    runs at memory speed, where ``max |x|`` would first materialise ``|x|``."""
    return jnp.maximum(jnp.max(rows, axis=1), -jnp.min(rows, axis=1))


class _Blocks(NamedTuple):
    """``x`` in blocks of ``size`` entries and the maximum of ``|x|`` over each block.

    The last block may be short (``d`` need not be a multiple of ``size``);
    ``x`` is never padded, which would copy it.
    """

    flat: jax.Array
    maxima: jax.Array
    d: int
    size: int

    @classmethod
    def of(cls, flat: jax.Array, size: int = _BLOCK) -> _Blocks:
        d = flat.shape[0]
        if d % size == 0:  # a reshape: the reductions read x in place, at memory speed
            return cls(flat, _abs_max(flat.reshape(d // size, size)), d, size)
        # A short last block: windowed reductions (a slice or a pad of x would copy it
        # first; measured, these cost less, though several times the reshape's).
        pad = [(0, -d % size)]
        high = jax.lax.reduce_window(flat, -jnp.inf, jax.lax.max, (size,), (size,), pad)
        low = jax.lax.reduce_window(flat, jnp.inf, jax.lax.min, (size,), (size,), pad)
        return cls(flat, jnp.maximum(high, -low), d, size)

    def candidates(self, t, capacity: int):
        """The first ``capacity`` blocks whose maximum reaches ``t``, the count, their entries.

        Returns ``(count, ids, values, index)``: ``count(|x| >= t)`` if at
        most ``capacity`` blocks reach ``t``, else the number of those blocks
        (above ``capacity``, and at most the count); those blocks in order,
        ``capacity`` slots (unused ones hold the number of blocks); and
        :meth:`entries` of them.
        """
        nb = self.maxima.shape[0]
        active = self.maxima >= t
        ids = _compact(active, jnp.arange(nb), capacity, nb)
        values, index = self.entries(ids)
        passes = jnp.sum((jnp.abs(values) >= t) & (index < self.d), dtype=jnp.int32)
        blocks = jnp.sum(active, dtype=jnp.int32)
        return jnp.where(blocks > capacity, blocks, passes), ids, values, index

    def entries(self, ids):
        """The entries of blocks ``ids`` and their flat indices, ``(len(ids), size)`` each
        (value 0 and an index ``>= d`` past the last entry)."""
        index = ids[:, None] * self.size + jnp.arange(self.size, dtype=jnp.int32)
        if self.d % self.size == 0:  # whole rows of a reshape (no copy), not single entries
            rows = self.flat.reshape(-1, self.size)
            return rows.at[ids].get(mode="fill", fill_value=0.0), index
        index = jnp.where(index < self.d, index, self.d)
        return self.flat.at[index].get(mode="fill", fill_value=0.0), index

    def select(self, t, values, index, capacity: int):
        """The flat indices of ``|x| >= t`` in order, ``capacity`` slots padded with ``d``.

        ``values, index`` are the entries of the candidate blocks of
        :meth:`candidates` for ``t``, which (at most ``capacity`` entries
        reaching ``t``) hold every entry that does.  Blocks larger than
        ``_SUB_BLOCK`` are first narrowed to the sub-blocks of ``_SUB_BLOCK``
        entries whose maximum reaches ``t`` (at most ``capacity`` of them)
        before the entries are compacted.
        """
        if self.size > _SUB_BLOCK:
            sub_values = values.reshape(-1, _SUB_BLOCK)
            sub_index = index.reshape(-1, _SUB_BLOCK)
            n_sub = sub_values.shape[0]
            ids = _compact(_abs_max(sub_values) >= t, jnp.arange(n_sub), capacity, n_sub)
            values = sub_values.at[ids].get(mode="fill", fill_value=0.0)
            index = sub_index.at[ids].get(mode="fill", fill_value=self.d)
        return _compact((jnp.abs(values) >= t) & (index < self.d), index, capacity, self.d)


def _reference_select(mag, samples, top, k, band, max_adaptation_iters):
    """The selection by full passes over ``mag = |x|`` (taken where ``x`` holds a NaN)."""
    d = mag.shape[0]
    low, capacity = band_limits(k, d, band)
    threshold = jax.lax.top_k(samples, top)[0][-1]

    def count(t):
        return jnp.sum(mag >= t, dtype=jnp.int32)

    threshold, n = _adapt(count, threshold, low, max_adaptation_iters, band[0])
    accept = (n >= low) & (n <= capacity)

    def by_threshold():
        return jnp.nonzero(mag >= threshold, size=capacity, fill_value=d)[0].astype(jnp.int32)

    def by_top_k():
        return exact_select(mag, k, capacity).indices

    return jax.lax.cond(accept, by_threshold, by_top_k), n, accept


def _blocked_select(flat, samples, top, k, band, max_adaptation_iters, blocks):
    """:func:`_reference_select` on blocks: the same selection, at a fraction of its cost.

    Where more than ``capacity`` blocks reach the threshold, the count used is
    the number of those blocks: like the true count it is above ``capacity``,
    so the adaptation stops and the selection falls back to the exact top-k,
    as in the reference.
    """
    d = flat.shape[0]
    low, capacity = band_limits(k, d, band)

    def cond(carry):
        return (carry[1] < low) & (carry[2] < max_adaptation_iters)

    def body(carry):
        t = carry[0] * band[0]
        n, _, values, index = blocks.candidates(t, capacity)
        return t, n, carry[2] + 1, values, index

    threshold = _kth_largest(samples, top)
    n, _, values, index = blocks.candidates(threshold, capacity)
    threshold, n, _, values, index = jax.lax.while_loop(
        cond, body, (threshold, n, 0, values, index)
    )
    accept = (n >= low) & (n <= capacity)

    def by_threshold():
        return blocks.select(threshold, values, index, capacity)

    def by_top_k():
        return exact_select(flat, k, capacity).indices

    return jax.lax.cond(accept, by_threshold, by_top_k), n, accept


def sampled_threshold_select(
    x: jax.Array,
    k: int,
    *,
    offset: int | jax.Array = 0,
    sample_ratio: float = 0.01,
    band: tuple[float, float] = (0.8, 1.3),
    max_adaptation_iters: int = 10,
) -> Selection:
    """DGC's selection: a threshold estimated from a strided sample of ``|x|``.

    1. Sample ``|x|`` at ``offset % stride + stride * j`` (see
       :func:`sample_layout`; about 1% of the entries).
    2. The threshold is the ``ceil(num_samples k / d)``-th largest sample.
    3. While fewer than ``ceil(band[0] k)`` entries reach it, multiply it by
       ``band[0]`` (at most ``max_adaptation_iters`` times).
    4. If the count of ``|x| >= threshold`` lies in ``[ceil(band[0] k),
       floor(band[1] k)]`` send all those entries, else (a misleading sample:
       too many, or still too few) fall back to the exact top-``k``.

    Shapes are static: the selection always has ``floor(band[1] k)`` slots
    (the payload capacity), unused slots padded with ``d``.

    Args:
      x: the array (any shape; flattened).
      k: the target count.
      offset: start of the strided sample (the transformation rotates it with
        the step so no entry is systematically left out).
      sample_ratio: fraction of entries sampled.
      band: the accept band ``(low, high)`` relative to ``k``.
      max_adaptation_iters: threshold reductions before falling back.

    Returns:
      A :class:`Selection`.
    """
    flat = x.reshape(-1).astype(jnp.float32)
    samples, top = _samples(flat, k, offset, sample_ratio)
    args = (samples, top, k, band, max_adaptation_iters)
    blocks = _Blocks.of(flat, block_size(flat.shape[0], band_limits(k, flat.shape[0], band)[1]))
    # With a NaN in x the block maxima are unreliable (XLA's CPU max reduction
    # may drop earlier entries when it meets a NaN): take the full passes.  The
    # sum is NaN if x holds a NaN (or both infinities: the full passes, too).
    has_nan = jnp.isnan(jnp.sum(flat))
    indices, n, accept = jax.lax.cond(
        has_nan,
        lambda: _reference_select(jnp.abs(flat), *args),
        lambda: _blocked_select(flat, *args, blocks),
    )
    return Selection(indices, jnp.where(accept, n, k).astype(jnp.int32), ~accept)
