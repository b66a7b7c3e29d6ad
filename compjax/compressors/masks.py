"""The entries reaching a threshold, as a bit mask in words, and their ordered compaction.

The selection's common case (:mod:`compjax.compressors.selection`): the
sample's threshold ``t`` is accepted as it is, and the message is every
entry with ``|x| >= t``, in index order.  On a CPU this costs XLA one read
of ``x`` and passes over ``d / 32`` words:

1. :func:`reaching`: the mask ``|x| >= t`` packed 32 entries to a uint32
   word, in one fused pass over ``x`` (no mask of ``d`` entries is written).
2. :func:`compact_words`: the set bits' positions, in order, in a fixed
   number of slots.  Each word's first slot is the exclusive prefix sum of
   the words' population counts; a histogram of those first slots, summed
   over the slots, names the word behind every slot; the slot's bit is
   found in its word by halving (five population counts).

Where a prefix sum over ``d`` entries or a compaction by scatter of ``d``
positions (``jnp.nonzero``) costs XLA's CPU backend several passes over
``x``, these are one pass over ``x`` and passes over ``d / 32`` words and
over the slots.

An entry that is NaN reaches every threshold here (the mask is ``not |x| <
t``), so a NaN in ``x`` is always among the selected entries when they fit
their slots: the selection checks their values for NaN instead of summing
all of ``x``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from compjax.compressors.blocks import prefix_sums

WORD = 32  # entries per mask word


def _pack(mask: jax.Array) -> jax.Array:
    """Rows of up to 32 booleans as uint32 words, the first entry in the lowest bit."""
    bits = jnp.uint32(1) << jnp.arange(mask.shape[1], dtype=jnp.uint32)
    return jnp.sum(jnp.where(mask, bits, jnp.uint32(0)), axis=1, dtype=jnp.uint32)


def reaching(x: jax.Array, t: jax.Array) -> jax.Array:
    """The mask ``not |x| < t`` of 1-D ``x``, 32 entries to a uint32 word (``ceil(d / 32)`` words).

    Entry ``32 w + b`` is bit ``b`` of word ``w``; the last word's bits past
    ``d`` are 0.  The words of an even number of whole rows are reduced from
    ``x`` read in place (XLA's CPU loop vectorises a reduction only where its
    output has an even length; a pad of ``x`` would copy it); the last
    ``d mod 64`` entries, if any, make one or two words more.
    """
    d = x.shape[0]
    rows = d // (2 * WORD) * 2
    main = rows * WORD
    words = _pack(~(jnp.abs(x[:main].reshape(rows, WORD)) < t))
    if main == d:
        return words
    tail = ~(jnp.abs(x[main:]) < t)
    count = -(-(d - main) // WORD)
    tail = jnp.pad(tail, (0, count * WORD - (d - main))).reshape(count, WORD)
    return jnp.concatenate([words, _pack(tail)])


def select_bit(words: jax.Array, rank: jax.Array) -> jax.Array:
    """The position of the set bit of rank ``rank`` (0 for the lowest) in each uint32 word.

    Five halvings: where the lower half holds more than ``rank`` set bits
    the bit is there, else in the upper half with ``rank`` reduced by them.
    (A ``rank`` at or above the word's population count gives some position
    in ``[0, 32)``.)
    """
    pos = jnp.zeros(rank.shape, jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = jax.lax.population_count(words & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
        upper = rank >= low
        rank = jnp.where(upper, rank - low, rank)
        pos = jnp.where(upper, pos + width, pos)
        words = jnp.where(upper, words >> width, words)
    return pos


def compact_words(words: jax.Array, size: int, fill: int) -> tuple[jax.Array, jax.Array]:
    """The positions of the set bits of ``words`` in increasing order, in ``size`` slots.

    Returns ``(indices, count)``: int32 positions ``32 w + b``, the slots
    past the ``count`` set bits holding ``fill`` (set bits beyond the first
    ``size`` are dropped), and the number of set bits.
    """
    counts = jax.lax.population_count(words).astype(jnp.int32)
    first = prefix_sums(counts, WORD)  # each word's first slot
    total = first[-1] + counts[-1]
    # Slot j's word: the last word whose first slot is at most j, which holds a set bit
    # (a word without one shares its first slot with the next word).
    starts = jnp.zeros((size,), jnp.int32).at[first].add(1, mode="drop")
    word = prefix_sums(starts, words.shape[0]) + starts - 1
    slot = jnp.arange(size, dtype=jnp.int32)
    bit = select_bit(words[word], slot - first[word])
    return jnp.where(slot < total, word * WORD + bit, fill), total
