"""Bit packing of small unsigned integer codes into uint32 words.

Codes of ``width`` bits (1, 2 or 4) are packed ``32 // width`` to a uint32
word, the first code in the least significant bits.  Widths 8, 16 and 32 use
the unsigned integer type of that width directly.  This is the wire format of
signs (1 bit), ternaries (2 bits) and QSGD's sign-magnitude codes.

Fields of any width up to 32 bits packed into uint32 words
(:func:`pack_fields`) are the wire format of :func:`compjax.int_quant`'s
summable codes, whose fields are sized for a sum over workers, and of
:func:`compjax.natural`'s exponents and signs (:func:`pack_fields_pair`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WIDTHS = (1, 2, 4, 8, 16, 32)
_WORD = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}

#: Bits of the word that carries packed codes and fields (:func:`pack`, :func:`pack_fields`).
WORD = 32


def code_width(max_code: int) -> int:
    """The smallest packing width in :data:`WIDTHS` holding codes ``0..max_code``."""
    needed = max(int(max_code).bit_length(), 1)
    for width in WIDTHS:
        if width >= needed:
            return width
    raise ValueError(f"max_code={max_code} does not fit in 32 bits")


def packed_bits(n: int, width: int) -> int:
    """Bits of ``n`` codes of ``width`` bits once packed (whole words below 8 bits)."""
    if width >= 8:
        return n * width
    return -(-n // codes_per_element(width)) * WORD


def codes_per_element(width: int) -> int:
    """Codes of ``width`` bits in one element of the packed array (a uint32 word below 8
    bits, else one code per element)."""
    return WORD // width if width < 8 else 1


def pack(codes: jax.Array, width: int) -> jax.Array:
    """Pack a 1-D array of unsigned codes, each below ``2**width``.

    Returns a uint32 array of ``ceil(n * width / 32)`` words for widths below
    8 (code ``i`` in bits ``[(i % k) width, (i % k + 1) width)`` of word
    ``i // k``, ``k = 32 // width``; the last word zero-padded), else the
    codes as uint8/uint16/uint32: :func:`pack_fields` with ``32 // width``
    fields to a word.  Words, not bytes: splitting each word into its four bytes was a pass of
    its own on every compress, and joining them again a small loop per
    message in every decode of gathered messages (``make bench``'s sign MLP
    step 1.27 to 1.32 against 1.16 times the plain step with words, Intel
    Xeon, 2026-11-27); the padding is at most 31 bits per array instead of 7.
    """
    if width not in WIDTHS:
        raise ValueError(f"width must be one of {WIDTHS}, got {width}")
    if width >= 8:
        return codes.astype(_WORD[width])
    return pack_fields(codes.astype(jnp.uint32), width, WORD // width)


def pack_summing(codes: jax.Array, width: int, terms: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`pack` of ``codes`` (``width`` below 8) and the float32 sum of ``terms``, one pass.

    ``terms`` has one value per code (a magnitude, a square).  One variadic
    reduction over each word's codes gives the word and the sum of its
    terms; the words' sums (one per ``32 // width`` entries) are added
    after.  Two reductions, the packing and a sum, read the array twice:
    ``2^24`` entries, signs and ``sum |x|``, 6.5 ms apart and 4.0 ms together
    (Intel Xeon, 2026-11-27).  The sum is in that blocked order, so it may
    differ from ``jnp.sum(terms)`` in the last bits.
    """
    if width >= 8:
        raise ValueError(f"width must be below 8 for pack_summing, got {width}")
    per_word = WORD // width
    values = jnp.pad(terms.astype(jnp.float32), (0, -terms.shape[0] % per_word))
    words, sums = jax.lax.reduce(
        (_shifted_rows(codes.astype(jnp.uint32), width, per_word), _rows(values, per_word)),
        (jnp.uint32(0), jnp.float32(0.0)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        _word_axes(per_word),
    )
    return words, jnp.sum(sums)


#: How a word's 32 one-bit codes are laid out for the reduction that packs them:
#: ``(8, 4)``, reduced over both axes (the same words; see :func:`_rows`).
_BIT_ROW = (8, 4)


def _rows(a: jax.Array, per_word: int) -> jax.Array:
    """``a`` (a multiple of ``per_word`` entries) in rows of one word's entries.

    A row of 32 one-bit codes is viewed as ``(8, 4)`` and reduced over both
    axes: the same row-major entries, so the same words, in a loop that
    XLA's CPU backend runs about 3 times as fast as the reduction over one
    minor axis of 32.  Packing the signs of ``2^24`` float32 entries: 4.2 ms
    over 32, 1.2 ms over ``(8, 4)``, 1.4 ms over ``(4, 8)``; of ``2^21``
    (cached): 0.39, 0.22 and 0.34 ms (AMD EPYC, 2026-11-28).  With 2- and
    4-bit codes (16 and 8 to a word) such views were slower than one axis.
    XLA's GPU pipeline groups adjacent reduced axes back into one (not
    measured on a GPU).
    """
    return a.reshape(-1, *_row_shape(per_word))


def _row_shape(per_word: int) -> tuple[int, ...]:
    """The shape of one word's entries in :func:`_rows`'s view."""
    return _BIT_ROW if per_word == WORD else (per_word,)


def _word_axes(per_word: int) -> tuple[int, ...]:
    """The axes of :func:`_rows`'s view that one word's entries span."""
    return tuple(range(1, 1 + len(_row_shape(per_word))))


def _shifted_rows(u: jax.Array, width: int, per_word: int) -> jax.Array:
    """uint32 values in zero-padded rows of one word's ``per_word`` (:func:`_rows`), each
    shifted to its bit range (consecutive entries share a word)."""
    padded = jnp.pad(u, (0, -u.shape[0] % per_word))
    return _rows(padded, per_word) << _shifts(width, per_word).reshape(_row_shape(per_word))


def unpack(packed: jax.Array, width: int, n: int) -> jax.Array:
    """Inverse of :func:`pack`: the first ``n`` codes, as uint32."""
    if width >= 8:
        return packed.astype(jnp.uint32)
    return unpack_fields(packed, width, WORD // width, n)


def unpack_rows(packed: jax.Array, width: int, rows: int) -> jax.Array:
    """:func:`unpack` of all the codes, cut into ``rows`` equal rows of whole words.

    Returns ``(rows, words per row, 32 // width)`` uint32 codes (width below
    8), row ``r``'s codes in order in ``[r].reshape(-1)``.  Kept 3-D so that a
    per-row value (QSGD's norms) broadcasts over the codes' own shape: XLA's
    CPU loop over the sum of 8 decodes mixing a ``(words, codes per word)``
    view with a ``(rows, codes per row)`` one ran 6 times slower.
    """
    return _split_words(packed.reshape(rows, -1), width)


def _split_words(words: jax.Array, width: int) -> jax.Array:
    """Each word's ``32 // width`` codes along a new last axis, first code first."""
    return (words[..., None] >> _shifts(width, WORD // width)) & jnp.uint32((1 << width) - 1)


class SignMagnitude:
    """Sign-magnitude codes of level indices ``0..levels``, for compressors with ``levels``.

    ``magnitude_bits`` hold the level, the sign sits in the top bit of a code
    ``width`` bits wide (:func:`code_width`: a packable 1, 2, 4, 8, ... bits).
    """

    levels: int

    @property
    def magnitude_bits(self) -> int:
        return int(self.levels).bit_length()

    @property
    def width(self) -> int:
        """Packed width of one sign-magnitude code (sign in the top bit)."""
        return code_width((1 << (self.magnitude_bits + 1)) - 1)


#: Words of a packing group in the planar layout (:func:`pack_fields`).
GROUP_WORDS = 256


def planar(per_word: int) -> bool:
    """Whether :func:`pack_fields` lays ``per_word`` fields out planar in groups: when
    ``per_word`` is not a power of two (5 or 6 fields of 6 or 5 bits, 4-bit codes summed by
    4 or 2 workers)."""
    return per_word & (per_word - 1) != 0


def packing_unit(per_word: int) -> int:
    """Entries of one packing unit: a word (interleaved layout) or a group (planar).

    A span of a flat array that starts at a multiple of the unit (and,
    unless it is the array's end, ends at one) packs into exactly its own
    stretch of the array's words (:mod:`compjax.pieces`).
    """
    return per_word * GROUP_WORDS if planar(per_word) else per_word


def _shifts(width: int, per_word: int) -> jax.Array:
    return jnp.uint32(width) * jnp.arange(per_word, dtype=jnp.uint32)


def pack_fields(u: jax.Array, width: int, per_word: int) -> jax.Array:
    """Unsigned ``width``-bit values ``u`` (1-D uint32) packed ``per_word`` to a uint32 word.

    ``ceil(n / per_word)`` words, entry ``i`` in bits ``[k width, (k + 1)
    width)`` of one of them, ``k < per_word``.  Which entries share a word
    depends on ``per_word``, so that packing and unpacking vectorize on
    XLA's CPU backend:

    * a power of two: consecutive entries, word ``i // per_word``, field
      ``i % per_word`` (a reduction along a minor axis of ``per_word``);
    * otherwise planar in groups of ``per_word * GROUP_WORDS`` entries (the
      last one shorter): in a group of ``W`` words, word ``j`` holds
      entries ``j, j + W, ..., j + (per_word - 1) W`` of the group, so every
      field is read from or written to a contiguous stream (a minor-axis
      reduction of 5 or 6 runs scalar, about 5x slower).

    Disjoint bit ranges: the sum of the shifted fields is their bitwise or.
    """
    n = u.shape[0]
    if not planar(per_word):
        # Disjoint bit ranges: the sum is the bitwise or.
        return jnp.sum(
            _shifted_rows(u, width, per_word), axis=_word_axes(per_word), dtype=jnp.uint32
        )
    if n == 0:
        return jnp.zeros((0,), jnp.uint32)
    unit = packing_unit(per_word)
    cut = n // unit * unit
    if 0 < cut < n:  # whole groups, then the last partial one (its own W)
        return jnp.concatenate(
            [pack_fields(u[:cut], width, per_word), pack_fields(u[cut:], width, per_word)]
        )
    words = GROUP_WORDS if cut else -(-n // per_word)
    grouped = jnp.pad(u, (0, -n % (per_word * words))).reshape(-1, per_word, words)
    packed = jnp.sum(grouped << _shifts(width, per_word)[:, None], axis=1, dtype=jnp.uint32)
    return packed.reshape(-1)


def pack_fields_pair(
    wide: jax.Array, wide_width: int, narrow: jax.Array, narrow_width: int
) -> tuple[jax.Array, jax.Array]:
    """:func:`pack_fields` of two arrays of codes of one length, in one pass over them.

    ``wide`` (``wide_width`` bits, ``32 // wide_width`` to a word) and
    ``narrow`` (``narrow_width <= wide_width`` bits) give exactly
    ``pack_fields(wide, wide_width, 32 // wide_width)`` and
    ``pack_fields(narrow, narrow_width, 32 // narrow_width)`` (both
    interleaved).  One variadic reduction over a ``(narrow words, wide words
    per narrow word, wide codes per word)`` view gives the wide words and, per
    wide word, the narrow codes it covers (``wide codes per word x
    narrow_width`` bits, in the smallest unsigned type holding them); a sum
    over the second axis then joins those into the narrow words.  Packing
    the two apart reads the codes' input twice: natural compression's
    exponents and signs of ``2^24`` entries, 19.4 ms as two loops and 9.6 ms
    as this one (Intel Xeon, 2026-11-27).
    """
    n = wide.shape[0]
    group, per_word = WORD // wide_width, WORD // narrow_width
    if wide_width not in WIDTHS[:-1] or narrow_width not in WIDTHS or narrow_width > wide_width:
        raise ValueError(
            f"widths ({wide_width}, {narrow_width}): need 1 <= narrow <= wide < 32, powers of two"
        )
    rows = -(-n // per_word)

    def view(codes):
        padded = jnp.pad(codes.astype(jnp.uint32), (0, rows * per_word - n))
        return padded.reshape(rows, per_word // group, group)

    partial = _WORD[max(8, group * narrow_width)]
    wide_words, parts = jax.lax.reduce(
        (
            view(wide) << _shifts(wide_width, group),
            (view(narrow) << _shifts(narrow_width, group)).astype(partial),
        ),
        (jnp.uint32(0), partial(0)),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        (2,),
    )
    narrow_words = jnp.sum(
        parts.astype(jnp.uint32) << _shifts(group * narrow_width, per_word // group),
        axis=1,
        dtype=jnp.uint32,
    )
    return wide_words.reshape(-1)[: -(-n // group)], narrow_words


def unpack_fields(words: jax.Array, width: int, per_word: int, n: int) -> jax.Array:
    """The ``n`` uint32 fields of ``words`` packed by :func:`pack_fields`."""
    mask = jnp.uint32((1 << width) - 1) if width < WORD else jnp.uint32(0xFFFFFFFF)
    if not planar(per_word):
        fields = (words[:, None] >> _shifts(width, per_word)) & mask
        return fields.reshape(-1)[:n]
    if n == 0:
        return jnp.zeros((0,), jnp.uint32)
    unit = packing_unit(per_word)
    cut = n // unit * unit
    if 0 < cut < n:
        head = cut // per_word
        return jnp.concatenate(
            [
                unpack_fields(words[:head], width, per_word, cut),
                unpack_fields(words[head:], width, per_word, n - cut),
            ]
        )
    grouped = words.reshape(-1, GROUP_WORDS if cut else words.shape[0])
    # One contiguous stream per field (a stack along a middle axis, not a broadcast shift).
    fields = [(grouped >> jnp.uint32(width * k)) & mask for k in range(per_word)]
    return jnp.stack(fields, axis=1).reshape(-1)[:n]
