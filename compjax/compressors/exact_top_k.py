"""The exact top-``k``, fast where it pays: the candidates above a sampled threshold.

:func:`top_k_indices` is :func:`compjax.top_k`'s exact selection: the
indices of ``jax.lax.top_k`` of ``|x|``, in increasing order.  Where a pass
over ``x`` dominates (:func:`fast_exact_pays`) they come from
:func:`fast_exact_select`: the entries reaching a sampled threshold
(:func:`compjax.compressors.selection.threshold_candidates`, DGC's
machinery aimed at a little more than ``k`` entries) are a superset of the
top-``k``, whose own top-``k`` is found by counts and compactions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from compjax.compressors.blocks import compact, kth_largest, prefix_sums
from compjax.compressors.selection import (
    Selection,
    ceil_exact,
    floor_exact,
    sample_values,
    threshold_candidates,
)

# The exact top-k by candidates: the sample aims at EXACT_TARGET k entries, a count in
# [k, EXACT_CAPACITY k] is accepted, and the threshold is lowered by EXACT_FACTOR while
# fewer than k pass.  The sample's rank estimate has a relative spread of about
# 1/sqrt(num_samples k / d) (4% at density 0.01 with a 1% sample), so the band is
# several spreads wide on either side of the target; the sample is made large enough for
# its rank to be EXACT_MIN_RANK at least (a relative spread of 9% at most).
EXACT_TARGET = 1.15
EXACT_CAPACITY = 1.5
EXACT_FACTOR = 0.9
EXACT_MIN_RANK = 128


def fast_exact_pays(d: int, k: int) -> bool:
    """Whether :func:`fast_exact_select` beats a plain ``jax.lax.top_k`` of ``d`` entries.

    The candidates' top-k runs over ``EXACT_CAPACITY k`` slots, so the fast
    path pays where those are a small part of ``d`` (at most 1/16) and ``d``
    is large enough for a pass over it to dominate (``2**16`` entries).
    """
    return d >= 2**16 and 16 * floor_exact(EXACT_CAPACITY * k) <= d


def top_k_indices(x: jax.Array, k: int, *, sample_ratio: float = 0.01) -> jax.Array:
    """The flat indices of the ``k`` largest ``|x|``, in increasing order (int32).

    The set of ``jax.lax.top_k(|x|, k)`` (equal magnitudes taken by
    increasing index, as it does), sorted.  Where :func:`fast_exact_pays`,
    from :func:`fast_exact_select`; else a ``jax.lax.top_k`` of all of
    ``|x|``.
    """
    flat = x.reshape(-1).astype(jnp.float32)
    if fast_exact_pays(flat.shape[0], k):
        return fast_exact_select(flat, k, sample_ratio=sample_ratio).indices
    return _sorted_top_k(flat, k)


def _sorted_top_k(flat: jax.Array, k: int) -> jax.Array:
    return jnp.sort(jax.lax.top_k(jnp.abs(flat), k)[1].astype(jnp.int32))


def _top_of_candidates(candidates: jax.Array, values: jax.Array, k: int, d: int) -> jax.Array:
    """The ``k`` largest ``|values|`` among ``candidates`` (flat indices in increasing order,
    padded with ``d``, at least ``k`` real ones; ``values`` the entries there, 0 in the
    padded slots), as flat indices in increasing order.

    The ``k``-th largest candidate magnitude ``t`` (:func:`kth_largest`, a
    radix selection on the bits), every candidate above it, and the first of those
    equal to it (by index, as ``jax.lax.top_k`` breaks ties) up to ``k``:
    compactions and counts over the candidates, where a top-k of them would
    sort them.  The padded slots read 0 and come last, so they are never
    taken before a real candidate.
    """
    mag = jnp.abs(values)
    t = kth_largest(mag, k)
    above, tied = mag > t, mag == t
    room = k - jnp.sum(above, dtype=jnp.int32)
    keep = above | (tied & (prefix_sums(tied, 1) < room))
    return compact(keep, candidates, k, d)


def fast_exact_select(x: jax.Array, k: int, *, sample_ratio: float = 0.01) -> Selection:
    """The indices of the exact top-``k``
    (:func:`compjax.compressors.selection.exact_select`), in increasing order, from a
    sampled threshold.

    The entries reaching a threshold are a superset of the top-``k`` when at
    least ``k`` of them do: if ``count(|x| >= t) >= k`` then ``t`` is at most
    the ``k``-th largest magnitude, so every entry at or above it passes.  So
    the threshold of :func:`compjax.compressors.selection.sampled_threshold_select` (aimed at
    ``EXACT_TARGET k`` entries, from a sample of ``sample_ratio d`` entries
    or enough for that rank to be ``EXACT_MIN_RANK`` in the sample, lowered
    while fewer than ``k`` pass) selects between ``k`` and ``EXACT_CAPACITY
    k`` candidates in index order, and the top-``k`` of the candidates
    (:func:`_top_of_candidates`) is the top-``k`` of all of ``x``, equal
    magnitudes taken by increasing index as ``jax.lax.top_k`` takes them.
    Otherwise (a count outside the band, or a NaN in ``x``) it is
    ``jax.lax.top_k`` of all of ``|x|``, sorted.  ``fallback`` says which
    was taken; ``count`` is always ``k``.

    On a CPU the candidates cost one pass over ``x`` (the mask words) and
    passes over ``1.5 k`` candidates, where ``jax.lax.top_k`` of all ``d``
    sorts them: 25.6M entries at density 0.01, 34 ms against 625 ms (one
    process, 2-core CPU).  ``|x|`` is computed where it is read (in the
    fallback, and on the gathered candidates), never as a full-size array.
    """
    flat = x.reshape(-1).astype(jnp.float32)
    d = flat.shape[0]
    if not 0 < k < d:
        return Selection(_sorted_top_k(flat, k), jnp.int32(k), jnp.bool_(True))
    target = min(d, ceil_exact(EXACT_TARGET * k))
    limits = (k, min(d, floor_exact(EXACT_CAPACITY * k)))
    ratio = min(1.0, max(sample_ratio, EXACT_MIN_RANK / target))
    samples, top = sample_values(flat, target, 0, ratio)
    indices, _, accept = threshold_candidates(
        flat,
        samples,
        top,
        limits,
        EXACT_FACTOR,
        10,
        then=lambda candidates, values: _top_of_candidates(candidates, values, k, d),
        otherwise=lambda: _sorted_top_k(flat, k),
        with_nan=lambda has_nan: (_sorted_top_k(flat, k), jnp.where(has_nan, k, 0), ~has_nan),
    )
    fallback = ~accept
    return Selection(indices, jnp.int32(k), fallback)
