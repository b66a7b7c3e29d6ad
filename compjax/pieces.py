"""A flat array given as consecutive pieces of other arrays, and its aligned spans.

A gradient bucket (:class:`compjax.transforms.buckets.Buckets`) covers parts
of several leaves.  Concatenating them first writes a fresh buffer the size
of the bucket (a fresh allocation, with its page faults, on every step),
which the compressor then reads again.  :class:`Pieces` describes the bucket
as its pieces instead (slices of the flattened leaves, nothing copied):

* statistics of the whole bucket (a norm, a mean magnitude, ``max|x|``) are
  reduced piece by piece and combined (:meth:`Pieces.reduce`);
* per-entry codes are computed over :func:`spans`: runs of entries that
  start at a multiple of the packing ``unit`` (32 one-bit codes to a word, a
  row of QSGD's own buckets), so each span packs into whole words (or
  rows) of the bucket's message and the spans' payloads concatenate into
  exactly the message of the concatenated bucket.  A span lies inside one
  piece except where a piece's boundary is not aligned: there the few
  entries around it (fewer than ``unit`` on each side, plus any pieces
  shorter than that) form a span of their own, the only entries ever
  concatenated.

The compressors that encode pieces this way (:mod:`compjax.compressors.elementwise`)
produce the same message as for the concatenated bucket; every other one
concatenates (:meth:`compjax.Compressor.encode_pieces`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: Largest row length :meth:`Pieces.reduce` folds a partly covered source into (and
#: :func:`encode_spans` joins the spans' payloads in).
_MAX_ROW = 4096
#: Smallest such row worth folding (below it the piece is reduced as a slice).
_MIN_ROW = 8
#: Smallest row the spans' payloads are joined in (below it, element by element).
_MIN_JOIN_ROW = 2
#: Most arrays XLA's CPU backend fuses a concatenation with (``kMaxConcatenateArguments``
#: of its instruction fusion): a join of more is a copy of its operands.
_MAX_FUSED_JOIN = 8


@dataclasses.dataclass(frozen=True)
class Pieces:
    """Entries ``[lo, hi)`` of each 1-D ``source``, laid end to end: one flat array, not built.

    A pytree whose leaves are the sources (the shared arrays the pieces are
    cut from) and whose static data are the ranges and the dtype, so it
    passes through ``jax.jit`` untouched.

    Attributes:
      sources: 1-D arrays, all of ``dtype``.
      ranges: ``(lo, hi)`` for each source, ``0 <= lo < hi <= len(source)``.
      dtype: the dtype of the flat array (also of an empty one).
    """

    sources: tuple[jax.Array, ...]
    ranges: tuple[tuple[int, int], ...]
    dtype: np.dtype

    @classmethod
    def of(cls, arrays: Sequence[jax.Array], dtype=None) -> Pieces:
        """The pieces that are ``arrays`` whole (1-D, one dtype; empty arrays are left out)."""
        arrays = [a for a in arrays if a.shape[0]]
        dtype = np.dtype(dtype if dtype is not None else arrays[0].dtype)
        return cls(tuple(arrays), tuple((0, a.shape[0]) for a in arrays), dtype)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.ranges)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    @property
    def ndim(self) -> int:
        return 1

    @property
    def arrays(self) -> list[jax.Array]:
        """Each piece as a 1-D array (a slice of its source, fused into whatever reads it)."""
        return [_cut(s, lo, hi) for s, (lo, hi) in zip(self.sources, self.ranges, strict=True)]

    def astype(self, dtype) -> Pieces:
        """The pieces converted to ``dtype`` (each source converted as it is read)."""
        if np.dtype(dtype) == self.dtype:
            return self
        return Pieces(tuple(s.astype(dtype) for s in self.sources), self.ranges, np.dtype(dtype))

    def join(self) -> jax.Array:
        """The flat array itself: a fresh buffer, materialised behind an optimisation barrier.

        (Fused into a consumer, XLA's CPU backend would evaluate the
        concatenation per entry.)  For the code that needs the bucket as one
        array: the compressors that are not elementwise, the scatter-gather
        exchange.
        """
        arrays = self.arrays
        if not arrays:
            return jnp.zeros((0,), self.dtype)
        if len(arrays) == 1:
            return arrays[0]
        return jax.lax.optimization_barrier(jnp.concatenate(arrays))

    def reduce(self, f: Callable[[jax.Array], jax.Array], op: str) -> jax.Array:
        """``op`` (``"sum"`` or ``"max"``) of the elementwise ``f`` over every entry, in float32.

        Each piece is reduced on its own and the results combined in order
        (a maximum equals the one over the concatenated array; a sum may
        differ from it in the last bits, as any other order would).  A piece
        that covers only part of its source is reduced through a row view of
        the whole source, ``(len / r, r)`` with ``r`` a power of two dividing
        its bounds: XLA's CPU backend hands reductions to a library that
        would first copy a slice; its rows' results are then sliced instead
        (``len / r`` values).  0 for no entries.
        """
        reduce = {"sum": jnp.sum, "max": jnp.max}[op]
        combine = {"sum": jnp.add, "max": jnp.maximum}[op]
        total = None
        for source, (lo, hi) in zip(self.sources, self.ranges, strict=True):
            n = source.shape[0]
            r = _row(lo, hi, n)
            if (lo, hi) == (0, n):
                part = reduce(f(source))
            elif r >= _MIN_ROW:
                rows = reduce(f(source).reshape(n // r, r), axis=1)
                part = reduce(rows[lo // r : hi // r])
            else:
                part = reduce(f(source[lo:hi]))
            part = part.astype(jnp.float32)
            total = part if total is None else combine(total, part)
        return jnp.float32(0.0) if total is None else total


jax.tree_util.register_dataclass(Pieces, data_fields=["sources"], meta_fields=["ranges", "dtype"])


def _cut(source: jax.Array, lo: int, hi: int) -> jax.Array:
    return source if (lo, hi) == (0, source.shape[0]) else source[lo:hi]


def _row(lo: int, hi: int, n: int) -> int:
    """The largest power of two up to ``_MAX_ROW`` dividing ``lo``, ``hi`` and ``n``."""
    r = 1
    while 2 * r <= _MAX_ROW and lo % (2 * r) == 0 and hi % (2 * r) == 0 and n % (2 * r) == 0:
        r *= 2
    return r


class Span(NamedTuple):
    """Entries ``[start, start + length)`` of a flat array in pieces.

    Attributes:
      start: offset in the flat array, a multiple of the spans' unit.
      parts: ``(piece, lo, hi)``: the span is entries ``[lo, hi)`` of these
        pieces, in order.
    """

    start: int
    parts: tuple[tuple[int, int, int], ...]

    @property
    def length(self) -> int:
        return sum(hi - lo for _, lo, hi in self.parts)


@functools.lru_cache(maxsize=256)
def spans(sizes: tuple[int, ...], unit: int) -> tuple[Span, ...]:
    """The flat array of pieces of ``sizes`` cut into spans that start at multiples of ``unit``.

    Every span but the last ends at a multiple of ``unit`` too.  Each piece's
    aligned interior (its entries from the first multiple of ``unit`` at or
    after its start to the last one at or before its end) is one span; the
    entries in between (around an unaligned boundary, and pieces shorter than
    ``unit``) form spans of their own.
    """
    starts = np.cumsum((0, *sizes))
    total = int(starts[-1])
    out: list[Span] = []

    def covering(a: int, b: int) -> tuple[tuple[int, int, int], ...]:
        parts = []
        for i, (s0, s1) in enumerate(itertools.pairwise(starts)):
            lo, hi = max(a, int(s0)), min(b, int(s1))
            if lo < hi:
                parts.append((i, lo - int(s0), hi - int(s0)))
        return tuple(parts)

    pos = 0
    for i, size in enumerate(sizes):
        s = int(starts[i])
        body_lo, body_hi = -(-s // unit) * unit, (s + size) // unit * unit
        if body_lo >= body_hi:
            continue
        if pos < body_lo:
            out.append(Span(pos, covering(pos, body_lo)))
        out.append(Span(body_lo, ((i, body_lo - s, body_hi - s),)))
        pos = body_hi
    if pos < total:
        out.append(Span(pos, covering(pos, total)))
    return tuple(out)


def span_array(pieces: Pieces, span: Span) -> jax.Array:
    """The entries of ``span`` as one 1-D array (a slice; a small concatenation at a seam)."""
    arrays = pieces.arrays
    parts = [_cut(arrays[i], lo, hi) for i, lo, hi in span.parts]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def wire_slice(field: jax.Array, span: Span, unit: int) -> jax.Array:
    """The elements of a per-entry wire ``field`` (``unit`` entries per element) that hold
    ``span``'s entries: ``[start / unit, ceil((start + length) / unit))``."""
    return field[span.start // unit : -(-(span.start + span.length) // unit)]


def encode_spans(
    pieces: Pieces, unit: int, encode: Callable[[jax.Array, int], dict]
) -> dict[str, jax.Array]:
    """``encode(x, offset)`` of every span (aligned to ``unit``), fields concatenated in order.

    ``encode`` returns per-entry wire fields, each packing a whole number of
    its elements per ``unit`` entries; their concatenation is the field of
    the whole flat array.
    """
    outs = [encode(span_array(pieces, s), s.start) for s in spans(pieces.sizes, unit)]
    if len(outs) == 1:
        return outs[0]
    return {k: _concatenate_bits([o[k] for o in outs], pieces.size) for k in outs[0]}


def _concatenate_bits(arrays: list[jax.Array], entries: int) -> jax.Array:
    """The concatenation of ``arrays``, the fields of a bucket of ``entries`` entries, floats
    done on their bits (unsigned integers), in rows.

    On floats, XLA moves a final conversion (a cast's float32 -> bfloat16)
    past the concatenation and concatenates float32 copies of the pieces.
    Where every array's length is a multiple of a row of at least 2
    elements (a power of two), the arrays are joined as
    ``(length / row, row)`` matrices: XLA's CPU loop then chooses the array
    once per row instead of once per element.  The same elements in the same
    order.  Compress of the ResNet-50 tree in buckets of ``2^22``, one
    process, interleaved: ``cast('float16')`` (rows of 64 entries) 14.5 to
    19 against 12.4 to 16.4 ms, ``cast('bfloat16')`` 20 to 24 against 15 to
    16, ``sign()`` (rows of 2 words: a bias of 64 entries is 2) 12 to 14
    against 9 to 10.

    A field of one 16- or 32-bit float per entry (the values of a cast to
    float16, bfloat16 or float32) of more than :data:`_MAX_FUSED_JOIN` spans
    is joined in groups (:func:`_grouped_join`), so that every span's
    conversion runs inside the join's loop instead of being written and
    copied there: such a field is half the bucket or more.  Compress of the
    ResNet-50 tree in buckets of ``2^22``, plain against grouped (one
    process, interleaved, three rounds): ``cast('float16')`` 14.4 to 15.9
    against 10.2 to 10.5 ms, ``cast('bfloat16')`` 14.7 to 15.6 against 11.5
    to 12.1 ms (the tree's copy 12.3 to 14.2 ms).  Other fields are not:
    QSGD's 8-bit codes, a packing reduction per span, took 58 against 108
    ms grouped, and ``cast('float8_e4m3fn')`` (a software conversion) 35.7
    to 37.2 against 37.2 to 37.9 ms; per-row statistics (QSGD's norms) are
    too short for their copy to matter.
    """
    dtype = arrays[0].dtype
    if jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
        grouped = dtype.itemsize >= 2 and sum(a.shape[0] for a in arrays) == entries
        joined = _concatenate_rows([jax.lax.bitcast_convert_type(a, bits) for a in arrays], grouped)
        return jax.lax.bitcast_convert_type(joined, dtype)
    return _concatenate_rows(arrays)


def _concatenate_rows(arrays: list[jax.Array], grouped: bool = False) -> jax.Array:
    """``arrays`` (1-D) concatenated, as rows where their lengths share one; ``grouped``: in
    groups of at most :data:`_MAX_FUSED_JOIN` (:func:`_grouped_join`)."""
    row = _MAX_ROW
    while row >= _MIN_JOIN_ROW and any(a.shape[0] % row for a in arrays):
        row //= 2
    if row < _MIN_JOIN_ROW:
        return jnp.concatenate(arrays)
    return _grouped_join(arrays, row) if grouped else _join_view(arrays, (-1, row))


def _grouped_join(arrays: list[jax.Array], row: int) -> jax.Array:
    """The concatenation of ``arrays`` (lengths multiples of ``row``) as a join of at most
    :data:`_MAX_FUSED_JOIN` joins of at most :data:`_MAX_FUSED_JOIN` arrays, fused with what
    produces the arrays; one plain join beyond that many arrays.

    XLA merges a concatenation of concatenations into one, so the outer join
    views its arrays as ``(-1, 2, row / 2)``, the inner ones as ``(-1,
    row)``.  The same elements in the same order.  Per bucket of the
    ResNet-50 tree in buckets of ``2^22``, ``cast('float16')``'s compress
    (one process, interleaved): buckets of 34, 13 and 10 spans 2.24, 2.17
    and 2.08 against 0.94, 0.88 and 0.74 ms.  A third level for its bucket
    of 94 spans (most of them small leaves) took 6.3 against 2.4 ms, so
    there is none.
    """
    if not _MAX_FUSED_JOIN < len(arrays) <= _MAX_FUSED_JOIN**2:
        return _join_view(arrays, (-1, row))
    groups = -(-len(arrays) // _MAX_FUSED_JOIN)
    size = -(-len(arrays) // groups)
    joined = [_join_view(arrays[i : i + size], (-1, row)) for i in range(0, len(arrays), size)]
    return _join_view(joined, (-1, 2, row // 2))


def _join_view(arrays: list[jax.Array], shape: tuple[int, ...]) -> jax.Array:
    """``arrays`` concatenated through the view ``shape`` (``-1`` first), 1-D."""
    if len(arrays) == 1:
        return arrays[0]
    return jnp.concatenate([a.reshape(shape) for a in arrays]).reshape(-1)


def decode_spans(
    sizes: tuple[int, ...], unit: int, decode: Callable[[Span], jax.Array]
) -> list[jax.Array]:
    """The pieces of ``sizes`` from ``decode(span)`` (the span's decoded entries, 1-D)."""
    parts: list[list[jax.Array]] = [[] for _ in sizes]
    for span in spans(tuple(sizes), unit):
        decoded = decode(span)
        at = 0
        for i, lo, hi in span.parts:
            parts[i].append(_cut(decoded, at, at + hi - lo))
            at += hi - lo
    return [_concatenate(p) if p else jnp.zeros((0,), jnp.float32) for p in parts]


def _concatenate(arrays: list[jax.Array]) -> jax.Array:
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays)


def split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """``flat`` cut into consecutive arrays of ``sizes`` entries."""
    bounds = np.cumsum((0, *sizes))
    return [_cut(flat, int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def lcm(*units: int) -> int:
    """The least common multiple of the packing units (1 for none)."""
    return math.lcm(1, *units)
