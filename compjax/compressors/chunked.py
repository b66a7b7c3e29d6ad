"""Chunked top-k with low-bit values: SparseLoCo's message.

The flattened array is cut into chunks of ``chunk`` entries; each chunk
sends the ``k`` entries of largest magnitude, their positions inside the
chunk as small unsigned integers, and their values either in float32 or as
``bits``-bit codes of a per-array lookup table (the mean of the values that
fell in each bin).

References:
  Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM
  Pre-training with SparseLoCo", arXiv 2508.15706, 2025.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax.compressor import Compressor, safe_norm
from compjax.compressors.sparse import subtract_entries
from compjax.numerics import ldexp, unit_scale
from compjax.packing import code_width, pack, packed_bits, unpack


def chunk_layout(d: int, chunk: int, k: int) -> tuple[int, int, int]:
    """``(size, count, kept)``: the chunk size used (``chunk``, or ``d`` when smaller), the
    number of chunks (the last one padded with zeros) and the entries kept per chunk."""
    size = min(chunk, d)
    count = -(-d // size) if size else 0
    return size, count, min(k, size)


def bin_codes(values: jax.Array, bits: int, sigmas: float) -> tuple[jax.Array, jax.Array]:
    """``(codes, table)``: ``bits``-bit codes of ``values`` (1-D float32) and the float32 value
    each code decodes to.

    The values are centred on their mean; bins of width ``sigmas * std / 2**bits`` (the
    unbiased standard deviation; width 1 where it is 0) are numbered from ``-2**(bits-1)``
    (code 0) and clipped to the ``2**bits`` codes; a code decodes to the mean of the values
    it holds (0 for an empty bin).  Computed after an exact power-of-two scaling by the
    largest magnitude, so values near float32's limit neither overflow nor lose precision.
    """
    n_bins = 1 << bits
    m = values.shape[0]
    e, _ = unit_scale(jnp.max(jnp.abs(values), initial=0.0))
    v = ldexp(values, -e)
    centred = v - jnp.mean(v) if m else v
    std = safe_norm(centred) / math.sqrt(max(m - 1, 1)) if m > 1 else jnp.float32(0.0)
    width = sigmas * std / n_bins
    width = jnp.where((width > 0) & jnp.isfinite(width), width, 1.0)
    codes = jnp.clip(jnp.round(centred / width + n_bins // 2), 0, n_bins - 1).astype(jnp.int32)
    sums = jnp.zeros(n_bins, jnp.float32).at[codes].add(v)
    counts = jnp.zeros(n_bins, jnp.float32).at[codes].add(1.0)
    table = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)
    return codes.astype(jnp.uint32), ldexp(table, e)


_BLOCK = 8  # entries per block of the blocked per-chunk top-k


def _plain_select(flat: jax.Array, size: int, count: int, kept: int):
    rows = jnp.pad(flat, (0, count * size - flat.shape[0])).reshape(count, size)
    idx = jax.lax.top_k(jnp.abs(rows), kept)[1]
    return idx, jnp.take_along_axis(rows, idx, axis=1)


def _blocked_select(flat: jax.Array, size: int, count: int, kept: int):
    """:func:`_plain_select` (the same indices in the same order) from fewer entries, with no
    padded copy of ``flat`` (``d`` and ``size`` multiples of ``_BLOCK``).

    Each chunk is cut into blocks of ``_BLOCK``; the ``kept`` blocks with the
    largest maxima of ``|x|`` (ties: the first) hold the chunk's ``kept``
    largest entries (ties: the first): a block left out has its maximum at
    most each chosen block's, and at equal maxima a chosen block comes
    first, so each chosen block's first largest entry ranks above every
    entry of the block left out.  Those blocks, in chunk order, are searched
    for the ``kept`` largest; in chunk order the ties fall as in the chunk.
    The last chunk's padding is blocks of zeros, as in the padded chunk.
    """
    per = size // _BLOCK
    blocks = flat.reshape(-1, _BLOCK)  # a reshape: no copy
    maxima = jnp.maximum(jnp.max(blocks, axis=1), -jnp.min(blocks, axis=1))
    maxima = jnp.pad(maxima, (0, count * per - blocks.shape[0])).reshape(count, per)
    chosen = jnp.sort(jax.lax.top_k(maxima, kept)[1], axis=1)
    ids = jnp.arange(count, dtype=chosen.dtype)[:, None] * per + chosen
    entries = blocks.at[ids].get(mode="fill", fill_value=0.0).reshape(count, kept * _BLOCK)
    best = jax.lax.top_k(jnp.abs(entries), kept)[1]
    idx = jnp.take_along_axis(chosen, best // _BLOCK, axis=1) * _BLOCK + best % _BLOCK
    return idx, jnp.take_along_axis(entries, best, axis=1)


@dataclasses.dataclass(frozen=True)
class ChunkedTopK(Compressor):
    """Top-``k`` per chunk, values in float32 or as ``value_bits``-bit lookup codes.  See
    :func:`chunked_top_k` (its ``bits`` argument is ``value_bits``)."""

    k: int
    chunk: int = 4096
    value_bits: int | None = 2
    sigmas: float = 6.0
    deterministic: ClassVar[bool] = True

    def select(self, flat: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(indices, values)``: per chunk (rows), the positions inside the chunk of its ``k``
        largest magnitudes (ties: the first) and their values."""
        d = flat.shape[0]
        size, count, kept = chunk_layout(d, self.chunk, self.k)
        if d % _BLOCK or size % _BLOCK or size // _BLOCK < 4 * kept:
            return _plain_select(flat, size, count, kept)
        # Block maxima are unreliable with a NaN (XLA's CPU max reduction may drop
        # earlier entries): then the plain top-k.  The sum is NaN if flat holds one.
        return jax.lax.cond(
            jnp.isnan(jnp.sum(flat)),
            lambda: _plain_select(flat, size, count, kept),
            lambda: _blocked_select(flat, size, count, kept),
        )

    def encode(self, key, flat, dtype):
        size, _, _ = chunk_layout(flat.shape[0], self.chunk, self.k)
        idx, vals = self.select(flat)
        wire = {"indices": pack(idx.reshape(-1).astype(jnp.uint32), code_width(max(size - 1, 0)))}
        if self.value_bits is None:
            wire["values"] = vals.reshape(-1)
        else:
            codes, table = bin_codes(vals.reshape(-1), self.value_bits, self.sigmas)
            wire["codes"], wire["table"] = pack(codes, self.value_bits), table
        return wire, {}

    def entries(self, wire, n: int) -> tuple[jax.Array, jax.Array]:
        """The kept entries' flat positions (those in the last chunk's padding ``>= n``) and
        decoded float32 values."""
        size, count, kept = chunk_layout(n, self.chunk, self.k)
        width = code_width(max(size - 1, 0))
        idx = unpack(wire["indices"], width, count * kept).astype(jnp.int32)
        if self.value_bits is None:
            vals = wire["values"]
        else:
            vals = wire["table"][unpack(wire["codes"], self.value_bits, count * kept)]
        starts = jnp.repeat(jnp.arange(count, dtype=jnp.int32) * size, kept)
        return starts + idx, vals

    def decode(self, wire, side, n, dtype):
        size, count, _ = chunk_layout(n, self.chunk, self.k)
        idx, vals = self.entries(wire, n)
        return jnp.zeros(count * size, jnp.float32).at[idx].set(vals)[:n]

    def subtract_decoded(self, payload, y):
        """``y - decompress(payload)`` from the kept entries (:func:`.sparse.subtract_entries`)."""
        if tuple(y.shape) != tuple(payload.meta[0]):
            return super().subtract_decoded(payload, y)
        return subtract_entries(payload, y, *self.entries(payload.wire, math.prod(y.shape)))

    def delta(self, d):
        # Float32 values: top-k of each chunk keeps at least kept/size of its energy.
        if self.value_bits is not None:
            return None
        size, _, kept = chunk_layout(d, self.chunk, self.k)
        return kept / size if size else 1.0

    def bits_of(self, d: int) -> int:
        size, count, kept = chunk_layout(d, self.chunk, self.k)
        sent = count * kept
        index_bits = packed_bits(sent, code_width(max(size - 1, 0)))
        if self.value_bits is None:
            return index_bits + 32 * sent
        return index_bits + packed_bits(sent, self.value_bits) + 32 * (1 << self.value_bits)

    def bits(self, shape, dtype=jnp.float32):  # type: ignore[override]
        return self.bits_of(math.prod(shape))


def chunked_top_k(
    k: int, chunk: int = 4096, bits: int | None = 2, sigmas: float = 6.0
) -> ChunkedTopK:
    """SparseLoCo's compressor: the ``k`` largest magnitudes of every chunk, in ``bits`` bits.

    The flattened array is cut into chunks of ``chunk`` consecutive entries
    (the last padded with zeros; an array smaller than ``chunk`` is one
    chunk).  Each chunk sends the positions of its ``k`` largest magnitudes
    as unsigned integers of the smallest packable width that holds
    ``chunk - 1`` (8 bits for chunks of 64 to 256 entries, 16 bits up to
    65536), and the kept values of the whole array are quantised together:
    centred on their mean, binned in ``2**bits`` bins of width
    ``sigmas * std / 2**bits`` (clipped at both ends), each code decoding to
    the mean of the values in its bin; the ``2**bits`` bin means travel as
    float32.  ``bits=None`` sends the kept values in float32.

    Bits for ``d`` entries with ``n = ceil(d / chunk)`` chunks:
    ``n k (index width + bits) + 32 * 2**bits`` (whole words per field of codes below 8 bits).
    An array smaller than ``chunk`` is one chunk of ``d`` entries, so its
    positions are narrower: the packable width holding ``d - 1`` (``d = 15``:
    4 bits, ``d = 200``: 8 bits, against 16 for ``chunk = 4096``), and at
    most ``d`` of them (``min(k, d)``); ``bits(shape)`` counts those.

    Biased; with float32 values contractive, ``delta = k / chunk``.  The
    lookup quantiser replaces each value by its bin's mean, which never adds
    energy, but gives no uniform contraction, so ``delta`` is ``None`` with
    ``bits``; use it with error feedback.

    Args:
      k: entries kept per chunk (all of a chunk smaller than ``k``).
      chunk: entries per chunk (SparseLoCo: 64 x 64 tiles of a matrix, here
        ``chunk`` consecutive entries of the flattened array).
      bits: bits per kept value, 1, 2 or 4 (SparseLoCo: 2), or ``None``.
      sigmas: the width of the quantiser's range in standard deviations of
        the kept values.

    Returns:
      A :class:`ChunkedTopK` compressor whose payload holds ``"indices"`` (each
      chunk's ``k`` positions, packed into uint32 words) and either ``"codes"``
      (the ``bits``-bit bin codes, packed) with ``"table"`` (the ``2**bits``
      float32 bin means) or, with ``bits=None``, ``"values"`` (float32); it
      decodes to the kept values at their positions and 0 elsewhere.

    Raises:
      ValueError: ``k`` or ``chunk`` not positive, ``k > chunk``, ``bits``
        not one of 1, 2, 4, None, or ``sigmas`` not positive.

    Examples:
      >>> import jax.numpy as jnp, compjax
      >>> c = compjax.chunked_top_k(k=1, chunk=4, bits=None)
      >>> c(None, jnp.array([1.0, -3.0, 2.0, 0.5, 0.0, 0.1, -0.2, 0.0]))
      Array([ 0. , -3. ,  0. ,  0. ,  0. ,  0. , -0.2,  0. ], dtype=float32)

    References:
      Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo",
      arXiv 2508.15706, 2025.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if not isinstance(chunk, int) or chunk < k:
        raise ValueError(f"chunk must be an integer >= k = {k}, got {chunk!r}")
    if bits not in (1, 2, 4, None):
        raise ValueError(f"bits must be 1, 2, 4 or None, got {bits!r}")
    if not sigmas > 0:
        raise ValueError(f"sigmas must be positive, got {sigmas!r}")
    return ChunkedTopK(k=k, chunk=chunk, value_bits=bits, sigmas=float(sigmas))
