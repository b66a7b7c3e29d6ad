"""Top-k selection: which entries of an array a sparse message carries.

Used by :func:`compjax.top_k` (``select="threshold"``, and the fast path of
``select="exact"``: :mod:`compjax.compressors.exact_top_k`) and by
:func:`compjax.dgc` for each worker's accumulated velocity.

The exact top-``k`` (``jax.lax.top_k``) and DGC's sampled threshold: the
threshold is estimated from a strided sample of ``|x|`` (about 1% of the
entries), lowered while too few entries pass it, and the exact top-``k`` is
taken where the count falls outside an accepted band.  Every selection has a
static capacity (a fixed number of int32 slots, padded with ``d``), so the
message has a fixed size.

The fast path (:func:`threshold_candidates`) takes the sample's threshold
with one pass over ``x`` that packs the mask of the entries reaching it into
words (:mod:`compjax.compressors.masks`); where the threshold must be
lowered it reduces ``x`` to block maxima (:mod:`compjax.compressors.blocks`)
and counts and compacts on the candidate blocks only.  It gives the
reference selection (:func:`_reference_select`, full passes over ``|x|``)
entry for entry.

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

from compjax.compressors import masks
from compjax.compressors.blocks import Blocks, block_size, kth_largest


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


def ceil_exact(x: float) -> int:
    """``ceil(x)`` of ``x`` rounded to 9 decimals: the count a product of decimals means."""
    return math.ceil(round(x, 9))  # 0.2 * 15 is 3.0000000000000004, not 4


def floor_exact(x: float) -> int:
    """``floor(x)`` of ``x`` rounded to 9 decimals (see :func:`ceil_exact`)."""
    return math.floor(round(x, 9))


def num_selected(d: int, ratio: float) -> int:
    """``k = ceil(ratio d)`` entries sent of ``d`` (at least 1, at most ``d``)."""
    return min(d, max(1, ceil_exact(ratio * d)))


def band_limits(k: int, d: int, band: tuple[float, float]) -> tuple[int, int]:
    """Accepted counts ``[ceil(lo k), floor(hi k)]``; the upper one is the payload capacity."""
    return min(k, ceil_exact(band[0] * k)), min(d, max(k, floor_exact(band[1] * k)))


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
    target = min(d, max(ceil_exact(sample_ratio * d), ceil_exact(2 * d / k)))
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


def sample_values(x, k, offset, sample_ratio):
    """``|x|`` at the strided sample positions, and the rank of the threshold among them."""
    d = x.shape[0]
    stride, num = sample_layout(d, k, sample_ratio)
    samples = jnp.abs(x[offset % stride + stride * jnp.arange(num)])
    return samples, min(num, max(1, ceil_exact(num * k / d)))


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


def _reference_select(mag, samples, top, k, band, max_adaptation_iters):
    """The selection by full passes over ``mag = |x|`` (taken where ``x`` holds a NaN).

    An entry reaches ``t`` where ``not mag < t``, as on the mask words
    (:func:`compjax.compressors.masks.reaching`): a NaN reaches every
    threshold, so it is counted and sent, never dropped (and a NaN sampled as
    the threshold makes every entry reach it: the count leaves the band and
    the exact top-``k``, which ranks NaN first, is taken).
    """
    d = mag.shape[0]
    low, capacity = band_limits(k, d, band)
    threshold = jax.lax.top_k(samples, top)[0][-1]

    def reach(t):
        return ~(mag < t)

    def count(t):
        return jnp.sum(reach(t), dtype=jnp.int32)

    threshold, n = _adapt(count, threshold, low, max_adaptation_iters, band[0])
    accept = (n >= low) & (n <= capacity)

    def by_threshold():
        return jnp.nonzero(reach(threshold), size=capacity, fill_value=d)[0].astype(jnp.int32)

    def by_top_k():
        return exact_select(mag, k, capacity).indices

    return jax.lax.cond(accept, by_threshold, by_top_k), n, accept


def threshold_candidates(
    flat, samples, top, limits, factor, max_adaptation_iters, then, otherwise, with_nan
):
    """The entries reaching a sampled threshold: ``then`` of them, or ``otherwise()``.

    The threshold (the ``top``-th largest sample) is multiplied by ``factor``
    while fewer than ``limits[0]`` entries reach it (at most
    ``max_adaptation_iters`` times).  If the count is then within ``limits``,
    the result is ``then(indices, values)`` (the entries' flat indices in
    order, ``limits[1]`` slots padded with ``d``, and their values, 0 in the
    padded slots), else ``otherwise()``.  Where ``flat`` holds a NaN it is
    ``with_nan(has_nan)``, a ``(result, count, accepted)`` as returned here
    (``has_nan``, true there, is passed so that constants made from it vary
    between workers under ``jax.shard_map`` as the data does).  Returns
    ``(result, count, accepted)``.

    The usual case, the sample's threshold accepted as it is, costs one pass
    over ``flat`` and passes over its mask words (:mod:`compjax.compressors.masks`);
    a NaN, which reaches every threshold there, is then among the selected
    values.  Otherwise ``flat`` is summed for a NaN, and without one the
    threshold is adapted on block maxima (:class:`Blocks`), computed in that
    branch only.  Where more than ``limits[1]`` blocks reach the adapted
    threshold, the count used is the number of those blocks: like the true
    count it is above the capacity, so the adaptation stops and the result is
    ``otherwise()``, as in the reference.
    """
    d = flat.shape[0]
    low, capacity = limits
    threshold = kth_largest(samples, top)
    direct, n = masks.compact_words(masks.reaching(flat, threshold), capacity, d)
    values = flat.at[direct].get(mode="fill", fill_value=0.0)
    first = (n >= low) & (n <= capacity) & ~jnp.any(jnp.isnan(values))

    def adapted():
        blocks = Blocks.of(flat, block_size(d, capacity))

        def cond(carry):
            return (carry[1] < low) & (carry[2] < max_adaptation_iters)

        def body(carry):  # counts only: the loop carries scalars
            t = carry[0] * factor
            return t, blocks.candidates(t, capacity)[0], carry[2] + 1

        start = (threshold, blocks.candidates(threshold, capacity)[0], 0)
        t, n_t, _ = jax.lax.while_loop(cond, body, start)
        accept = (n_t >= low) & (n_t <= capacity)

        def selected():
            _, _, values, index = blocks.candidates(t, capacity)
            indices = blocks.select(t, values, index, capacity)
            return then(indices, flat.at[indices].get(mode="fill", fill_value=0.0))

        return jax.lax.cond(accept, selected, otherwise), n_t, accept

    # With a NaN in flat the block maxima are unreliable (XLA's CPU max reduction may drop
    # earlier entries when it meets a NaN).  The sum is NaN if flat holds a NaN (or both
    # infinities: with_nan, too).
    def checked():
        has_nan = jnp.isnan(jnp.sum(flat))
        return jax.lax.cond(has_nan, lambda: with_nan(has_nan), adapted)

    return jax.lax.cond(first, lambda: (then(direct, values), n, first), checked)


def _blocked_select(flat, samples, top, k, band, max_adaptation_iters):
    """:func:`_reference_select` by :func:`threshold_candidates`: the same selection, at a
    fraction of its cost."""
    limits = band_limits(k, flat.shape[0], band)
    return threshold_candidates(
        flat,
        samples,
        top,
        limits,
        band[0],
        max_adaptation_iters,
        then=lambda indices, _: indices,
        otherwise=lambda: exact_select(flat, k, limits[1]).indices,
        with_nan=lambda _: _reference_select(
            jnp.abs(flat), samples, top, k, band, max_adaptation_iters
        ),
    )


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
    samples, top = sample_values(flat, k, offset, sample_ratio)
    indices, n, accept = _blocked_select(flat, samples, top, k, band, max_adaptation_iters)
    return Selection(indices, jnp.where(accept, n, k).astype(jnp.int32), ~accept)
