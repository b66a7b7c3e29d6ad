"""Summable integer codes: stochastic ``b``-bit codes packed into uint32 fields that add.

The part of :func:`compjax.int_quant` that an exchange uses to sum the
workers' messages as integers (the ``summable`` protocol of
:func:`compjax.exchange.compressed_mean`): a worker's ``max|x|``
(:meth:`SummableCodes.scale_of`, agreed on with a ``pmax``), its unbiased
codes ``q`` in ``[-s, s]`` for that shared scale, offset to ``u = q + s`` and
packed into fields wide enough for the sum of ``n`` codes
(:meth:`SummableCodes.encode_words`, :func:`compjax.packing.pack_fields`), so
that a ``psum`` of the words adds every field without carries; and the sum
back to floats (:meth:`SummableCodes.decode_words`).

References:
  Li, Shen, Vargaftik, Ben Basat, Mitzenmacher, Yu, "THC: Accelerating
  Distributed Deep Learning Using Tensor Homomorphic Compression", NSDI 2024
  (integer codes aggregated without decoding).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from compjax.compressor import Compressor
from compjax.draws import bernoulli, counts_entries
from compjax.numerics import divide
from compjax.packing import GROUP_WORDS, WORD, pack_fields, packing_unit, planar, unpack_fields
from compjax.pieces import Pieces, encode_spans


@dataclasses.dataclass(frozen=True)
class SummableCodes(Compressor):
    """``b``-bit stochastic integer codes on a scale that workers may share, and their words.

    The base of :class:`compjax.compressors.int_quant.IntQuant`: the
    ``summable`` protocol (:meth:`scale_of`, :meth:`encode_words`,
    :meth:`decode_words`) on ``code_bits``-bit codes, ``s = 2**(b-1) - 1``
    levels on each side.
    """

    code_bits: int = 4

    unbiased: ClassVar[bool] = True
    # Payloads of workers that used one scale may be psum-ed as integers.
    summable: ClassVar[bool] = True

    @property
    def levels(self) -> int:
        """``s``: the grid is ``{-s, ..., s} * scale / s``."""
        return 2 ** (self.code_bits - 1) - 1

    def field_width(self, summands: int) -> int:
        """Bits of a field holding the sum of ``summands`` codes ``u`` in ``[0, 2s]``."""
        return (2 * self.levels * summands).bit_length()

    def fields_per_word(self, summands: int) -> int:
        width = self.field_width(summands)
        if width > WORD:
            raise ValueError(
                f"{summands} workers' sums of {self.code_bits}-bit codes do not fit a uint32 field"
            )
        return WORD // width

    def scale_of(self, flat: jax.Array | Pieces) -> jax.Array:
        """``max|x|`` in float32 (NaN or Inf propagate: the decode is then non-finite).

        ``flat`` may be a flat array in pieces (reduced piece by piece, the same maximum).
        """
        if isinstance(flat, Pieces):
            return flat.reduce(lambda a: jnp.abs(a.astype(jnp.float32)), "max")
        return jnp.max(jnp.abs(flat.astype(jnp.float32)), initial=0.0)

    def codes(
        self, key, flat: jax.Array, scale: jax.Array, offset: int | jax.Array = 0
    ) -> jax.Array:
        """Unbiased integer codes ``q`` in ``[-s, s]`` (int32) for ``scale >= max|x|``.

        ``offset``: ``flat`` is entries ``offset ..`` of a larger array, whose
        random draws it takes, or each entry's index in it (a uint32 array;
        :func:`compjax.draws.random_bits`).
        """
        s = self.levels
        y = divide(flat.astype(jnp.float32), scale) * s  # exact power-of-two scaling first
        low = jnp.floor(y)
        up = bernoulli(key, y - low, offset, unit=True)  # in [0, 1)
        q = jnp.clip(low + up.astype(jnp.float32), -s, s)
        return jnp.where(jnp.isfinite(q), q, 0.0).astype(jnp.int32)

    def encode_words(
        self, key, flat: jax.Array | Pieces, scale: jax.Array, summands: int
    ) -> jax.Array:
        """Codes packed into uint32 words with fields wide enough for ``summands`` messages.

        ``flat`` may be a flat array in :class:`compjax.pieces.Pieces`: its
        words are then packed span by span (:func:`compjax.pieces.spans`,
        aligned to :meth:`unit`), with the codes' random draws taken at
        their entries' offsets, so the words are those of the joined array, for a
        threefry key (any other key joins the pieces first).
        """
        if isinstance(flat, Pieces):
            if not counts_entries(key, flat.size):
                return self.encode_words(key, flat.join(), scale, summands)
            return encode_spans(
                flat,
                self.unit(summands),
                lambda x, o: {"words": self._encoded(key, x, scale, summands, o)},
            )["words"]
        return self._encoded(key, flat, scale, summands)

    def _encoded(self, key, flat: jax.Array, scale, summands: int, offset: int = 0) -> jax.Array:
        """The words of ``flat`` (entries ``offset ..`` of a larger array).

        In the planar layout, for a counter-drawn key, the whole groups and
        the last partial group are coded separately (the latter's draws at its
        offset), so that each packing pass reads its codes straight from ``flat``.
        """
        n = flat.shape[0]
        cut = n // self.unit(summands) * self.unit(summands)
        if not (planar(self.fields_per_word(summands)) and cut and counts_entries(key, offset + n)):
            return self._words(self.codes(key, flat, scale, offset), summands)
        head = self._planar_words(key, flat[:cut], scale, summands, offset)
        if cut == n:
            return head
        tail = self._words(self.codes(key, flat[cut:], scale, offset + cut), summands)
        return jnp.concatenate([head, tail])

    def _planar_words(self, key, flat: jax.Array, scale, summands: int, offset: int) -> jax.Array:
        """Whole planar groups: each field's codes drawn from its own stream of ``flat``.

        Field ``k`` of the group's words holds entries ``k W .. (k + 1) W``
        (:func:`compjax.packing.pack_fields`); coding each field's entries
        apart, at their own counters, makes the words one elementwise pass (a
        reduction over the fields, fused with the draws, ran 4x slower).
        """
        width, per_word = self.field_width(summands), self.fields_per_word(summands)
        groups = flat.reshape(-1, per_word, GROUP_WORDS)
        index = jnp.arange(groups.shape[0], dtype=jnp.uint32)[:, None] * jnp.uint32(
            per_word * GROUP_WORDS
        ) + jnp.arange(GROUP_WORDS, dtype=jnp.uint32)
        words = jnp.zeros(index.shape, jnp.uint32)
        for k in range(per_word):
            counters = index + jnp.uint32(offset + k * GROUP_WORDS)
            q = self.codes(key, groups[:, k, :], scale, counters)
            words = words | ((q + self.levels).astype(jnp.uint32) << jnp.uint32(width * k))
        return words.reshape(-1)

    def unit(self, summands: int) -> int:
        """Entries of one packing unit (:func:`packing_unit`) for ``summands`` messages."""
        return packing_unit(self.fields_per_word(summands))

    def _words(self, q: jax.Array, summands: int) -> jax.Array:
        """Integer codes ``q`` offset to ``[0, 2s]`` and packed ``fields_per_word`` to a word.

        The layout is :func:`pack_fields`'s.
        """
        width = self.field_width(summands)
        u = (q + self.levels).astype(jnp.uint32)
        return pack_fields(u, width, self.fields_per_word(summands))

    def decode_words(
        self, words: jax.Array, scale: jax.Array, summed: int, summands: int, n: int
    ) -> jax.Array:
        """Float32 sum of the decodes of ``summed`` messages whose words were added.

        ``summands`` is the number the fields were sized for (the number of
        workers); ``summed`` how many messages ``words`` holds (1 for a
        worker's own message).
        """
        width, per_word = self.field_width(summands), self.fields_per_word(summands)

        def decoded(w, m):
            total = unpack_fields(w, width, per_word, m).astype(jnp.int32) - summed * self.levels
            # (q / s) * scale: |q / s| <= summed, so only scale's own size matters for overflow.
            return total.astype(jnp.float32) / self.levels * scale

        # Planar: whole groups and the last partial group decoded separately (each pass fused).
        cut = n // self.unit(summands) * self.unit(summands)
        if planar(per_word) and 0 < cut < n:
            head = cut // per_word
            return jnp.concatenate([decoded(words[:head], cut), decoded(words[head:], n - cut)])
        return decoded(words, n)
