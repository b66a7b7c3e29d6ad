"""The fast path of the sampled-threshold selection: blocks of ``|x|``.

On a CPU, XLA runs a plain reduction of x at memory speed, but a pass that
compares every entry with a threshold and sums the result, or a prefix sum
over all entries (``jnp.nonzero``), costs several times more.  The selection
is sparse, so the fast path reduces x once to the maximum of |x| over blocks
(of ``block_size(d, capacity)`` entries); for a threshold t only the blocks
whose maximum reaches t (at most as many as the entries that pass) can hold
a selected entry, and counting and the ordered compaction run on those
blocks only.  The result is the reference path's selection, entry for entry.

:class:`Blocks` holds the block maxima and serves the counts and the ordered
compaction; :func:`kth_largest` the sample's threshold; the prefix sums and
the compaction are written for XLA's CPU backend (see their docstrings).
:mod:`compjax.compressors.selection` drives them.

References:
  Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training", ICLR 2018 (Section 3,
  the sampled threshold).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

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


def kth_largest(values: jax.Array, top: int) -> jax.Array:
    """``jax.lax.top_k(values, top)[0][-1]`` for 1-D ``values >= 0`` (no NaN), without a top-k.

    Few wanted (``2 top`` at most the number of blocks of ``_BLOCK``): the
    ``top`` largest values lie in the ``top`` blocks with the largest maxima
    (a block left out has its maximum, hence all its entries, at most the
    ``top``-th largest block maximum, which is at most the ``top``-th largest
    value), so a top-k of those blocks' entries gives it.  Many wanted (DGC's
    sample at density 0.01 wants thousands, where a top-k costs XLA on a CPU
    more than a pass over all of ``x``): a radix selection on the values'
    bits (:func:`_kth_largest_bits`).
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
    return jax.lax.bitcast_convert_type(_kth_largest_bits(bits, top), jnp.float32)


# The radix selection's digits of a non-negative int32, most significant first:
# (shift, width) covering bits 30..0.
_DIGITS = ((20, 11), (10, 10), (0, 10))


def _kth_largest_bits(bits: jax.Array, top: int) -> jax.Array:
    """The ``top``-th largest of 1-D non-negative int32 ``bits``, by their digits.

    A non-negative float32 orders as its bits read as an int32.  Digit by
    digit (:data:`_DIGITS`, 2048 or 1024 values), the entries that agree
    with the answer's digits so far are counted per value of the next digit
    (a histogram, one scatter-add over ``bits``), and the answer's digit is
    the largest one with at least ``need`` such entries at or above it;
    ``need`` then drops by those above it.  Three passes over ``bits``, where
    a bisection on the bits takes 31 counts over them (3.4 ms against 1.2 ms
    for 258,151 values on a 2-core CPU).
    """
    answer = jnp.zeros_like(bits[0])  # from the values: it varies between workers as they do
    need = jnp.int32(top)
    for shift, width in _DIGITS:
        high = shift + width
        digit = (bits >> shift) & ((1 << width) - 1)
        if high < 31:  # only the entries agreeing with the answer's higher digits
            digit = jnp.where((bits >> high) == (answer >> high), digit, 1 << width)
        counts = jnp.zeros((1 << width,), jnp.int32).at[digit].add(1, mode="drop")
        at_or_above = jnp.cumsum(counts[::-1])[::-1]
        best = jnp.sum(at_or_above >= need, dtype=jnp.int32) - 1
        need = need - (at_or_above[best] - counts[best])
        answer = answer | (best << shift)
    return answer


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
        offsets = prefix_sums(totals, cols * most)
    return within + offsets[:, None]


def prefix_sums(counts: jax.Array, most: int, row: int = _PREFIX_ROW) -> jax.Array:
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


def compact(mask: jax.Array, values: jax.Array, size: int, fill: int) -> jax.Array:
    """``values`` where ``mask`` holds, in row-major order, in ``size`` slots padded with ``fill``.

    ``values[jnp.nonzero(mask, size=size)]`` with the unused slots set to
    ``fill`` (true entries beyond the first ``size`` are dropped).  ``mask``
    and ``values`` are 1-D, or 2-D with at most ``_BLOCK`` columns.
    """
    prefix = prefix_sums(mask, 1, _SUB_BLOCK) if mask.ndim == 1 else _row_prefix(mask, 1)
    pos = jnp.where(mask, prefix, size).reshape(-1)
    out = jnp.full((size,), fill, jnp.int32)
    return out.at[pos].set(values.reshape(-1).astype(jnp.int32), mode="drop")


def _abs_max(rows: jax.Array) -> jax.Array:
    """``max |rows|`` per row as ``max(max x, -min x)``: reductions of ``x`` itself, which XLA
    runs at memory speed, where ``max |x|`` would first materialise ``|x|``."""
    return jnp.maximum(jnp.max(rows, axis=1), -jnp.min(rows, axis=1))


class Blocks(NamedTuple):
    """``x`` in blocks of ``size`` entries and the maximum of ``|x|`` over each block.

    The last block may be short (``d`` need not be a multiple of ``size``);
    ``x`` is never padded, which would copy it.
    """

    flat: jax.Array
    maxima: jax.Array
    d: int
    size: int

    @classmethod
    def of(cls, flat: jax.Array, size: int = _BLOCK) -> Blocks:
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
        ids = compact(active, jnp.arange(nb), capacity, nb)
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
            ids = compact(_abs_max(sub_values) >= t, jnp.arange(n_sub), capacity, n_sub)
            values = sub_values.at[ids].get(mode="fill", fill_value=0.0)
            index = sub_index.at[ids].get(mode="fill", fill_value=self.d)
        return compact((jnp.abs(values) >= t) & (index < self.d), index, capacity, self.d)
