"""Elementwise compressors: a few statistics of the whole array, then one code per entry.

Sign, scaled sign, L2-scaled sign, TernGrad, QSGD, natural compression,
natural dithering, the casts and ``int_quant`` send statistics of the whole
array (a scale, a norm, ``max|x|``; QSGD's norms per row of its own buckets)
and, for each entry, a code that depends only on the entry, those statistics
and the entry's random draw, which :func:`compjax.draws.counter_bits`
makes from the entry's index.  So the message of a gradient bucket can be
built from its pieces where they lie (:class:`compjax.pieces.Pieces`), with
no copy of the bucket: the statistics are reduced piece by piece, and the
codes are computed and packed over aligned spans
(:func:`compjax.pieces.spans`) whose packed words or rows
concatenate into the bucket's message.  The message is the same as that of
the concatenated bucket: every wire array has the same shape, the codes are
drawn with the same random bits, and the statistics are equal (maxima
exactly; sums up to the order of their float32 additions).

Every other compressor (top-k, rand-k, PowerSGD, EDEN, DRIVE, ATOMO, chunked
top-k, the rotating ``int_quant``, the combinators) concatenates the bucket
first (:meth:`compjax.Compressor.encode_pieces`): their message depends on
the whole array at once (a selection, a rotation, a factorisation).
"""

from __future__ import annotations

import jax

from compjax.compressor import Compressor
from compjax.draws import counts_entries
from compjax.pieces import Pieces, Span, decode_spans, encode_spans, lcm, wire_slice


class Elementwise:
    """Mixin of a :class:`compjax.Compressor` whose codes are per entry (see the module docstring).

    The compressor defines

    * ``units(d, dtype)``: its per-entry wire fields, each with the number of
      entries one element holds (32 for signs packed 32 to a word, 1 for a
      value per entry, a row's length for QSGD's norms per row);
    * ``statistics(key, pieces, dtype)``: the wire fields of the whole array
      (a scale), reduced over the pieces, and under names that start with
      ``_`` what ``encode_span`` needs besides (not sent); none by default;
    * ``encode_span(key, x, offset, d, stats, dtype)``: the per-entry fields
      of entries ``[offset, offset + len(x))`` of an array of ``d`` entries;
    * ``decode_span(wire, side, offset, n, d, dtype)``: those ``n`` entries
      decoded (1-D), with the per-entry fields of ``wire`` cut to them;

    and its ``encode`` of a whole array is ``encode_span`` at offset 0 (with
    its own statistics), so the two paths compute the same codes.
    """

    def units(self, d: int, dtype) -> dict[str, int]:
        raise NotImplementedError

    def statistics(self, key, pieces: Pieces, dtype) -> dict:
        return {}

    def encode_span(self, key, x: jax.Array, offset: int, d: int, stats: dict, dtype) -> dict:
        raise NotImplementedError

    def decode_span(self, wire: dict, side: dict, offset: int, n: int, d: int, dtype):
        raise NotImplementedError

    def decode(self, wire, side, n, dtype):
        return self.decode_span(wire, side, 0, n, n, dtype)

    def encode_pieces(self, key, pieces: Pieces, dtype):
        d = pieces.size
        if not self.deterministic and not counts_entries(key, d):
            return Compressor.encode_pieces(self, key, pieces, dtype)  # per-entry draws only
        stats = self.statistics(key, pieces, dtype)
        unit = lcm(*self.units(d, dtype).values())
        fields = encode_spans(
            pieces, unit, lambda x, offset: self.encode_span(key, x, offset, d, stats, dtype)
        )
        return {**{k: v for k, v in stats.items() if not k.startswith("_")}, **fields}, {}

    def decode_pieces(self, wire, side, sizes, dtype):
        d = sum(sizes)
        units = self.units(d, dtype)

        def decode(span: Span) -> jax.Array:
            cut = {k: wire_slice(v, span, units[k]) if k in units else v for k, v in wire.items()}
            return self.decode_span(cut, side, span.start, span.length, d, dtype)

        return decode_spans(sizes, lcm(*units.values()), decode)
