"""Integer quantization with a shared scale: b-bit codes that workers sum as integers.

Every worker maps its array onto the grid ``{-s, ..., s} * scale / s`` with
``s = 2**(b-1) - 1`` levels on each side (``b >= 2`` bits per code), rounding
stochastically so the decode is unbiased.  When all workers use one scale,
the maximum ``max_i max|x_i|`` agreed on with a 32-bit ``pmax``, their integer
codes can be *summed* instead of gathered: the sum of the codes decodes to
the sum of the decodes.  The codes travel offset to ``u = q + s`` in
``[0, 2s]`` and packed into fields of a uint32 word, each field wide enough
for the sum of ``n`` codes (``w = bit_length(2 s n)`` bits, ``32 // w`` fields
per word).  A ``psum`` of the words then adds every field separately, without
carries between fields: traffic is one ring all-reduce of ``w``-bit fields,
whatever the number of workers (``w`` grows only with ``log2 n``).  With
``b = 2`` this is TernGrad with scaler sharing (Wen et al. 2017).

Alone (one worker), the compressor uses its own ``max|x|`` and ``b``-bit fields.

Variance, exactly.  With step ``D = scale / s`` an entry at ``t = |x| / D``
is decoded with variance ``D**2 f (1 - f)``, ``f`` the fractional part of
``t``.  The supremum of ``E||C(x) - x||^2 / ||x||^2`` over ``x`` with ``d``
entries is

    omega(d) = (sqrt(1 + (d - 1) / s**2) - 1) / 2,

attained at ``x = D (s, t, ..., t)`` with ``t = 1 / (2 (1 + omega))``: one
entry sets the scale; maximising ``sum_k f_k (1 - f_k) - r (s**2 + sum_k
t_k**2)`` entry by entry gives every other entry ``t = 1/(2 (1 + r))``
(an entry beyond the first level adds at most ``1/4 - r`` against the
``1/(4 (1 + r))`` of ``t``), and ``r`` solves ``(d - 1) / (4 (1 + r)) = r
s**2``.  For ``b = 2`` it is TernGrad's ``(sqrt(d) - 1)/2``.

Shared among ``n`` workers the scale is one maximum over all ``n d`` entries,
so the same argument over the concatenation of the workers' arrays bounds
the mean:

    E||mean - x_bar||^2 <= omega(n d) / n**2 * sum_i ||x_i||^2,

with equality at the extremal input above spread over the workers
(:func:`int_quant_mean_omega`; ``proofs_checks/int_quant.py`` checks both).

With a rotation (``rotate=True``, THC's randomized Hadamard rotation).  The
workers pad ``x`` to ``d'`` (the next power of two) and quantise ``y = H D x``
(:mod:`compjax.hadamard`), ``D`` random signs from a key *all workers share*;
the receiver sums the integer codes and unrotates once, ``x_hat = D H y_hat``:
the rotation is linear and shared, so it commutes with the integer sum.  The
worst case over ``x`` is still the sup above at ``d'`` entries (a rotated
vector is a vector), but conditionally on the rotation the error is
``D**2 sum_k f_k (1 - f_k) <= d' max_k y_k**2 / (4 s**2)``, and each ``y_k``
is a Rademacher sum with variance proxy ``||x||**2 / d'``: by Hoeffding and a
union bound ``E max_k y_k**2 <= 2 (ln(2 d') + 1) ||x||**2 / d'``, so

    omega_rot(d) = min(omega(d'), (ln(2 d') + 1) / (2 s**2)),

a bound that holds for every ``x`` (0.159 at ``d = 2**20`` and 4 bits against
72.6 without the rotation).  It is not attained: on Gaussian or flat inputs at
``d = 1024`` the measured error is 0.41 (2 bits) to 0.46 (4 bits) of it, and
spikes rotate to a flat vector on the grid, error 0 (``tests/test_int_quant.py``).
For ``n`` workers sharing one scale the same argument over the ``n d'``
rotated entries gives ``E||mean - x_bar||^2 <= (ln(2 n d') + 1) / (2 s**2 n)
sum_i ||x_i||^2`` (:func:`int_quant_mean_omega` with ``rotate=True``).  The
price: ``d' - d`` padded entries on the wire and two ``O(d' log d')``
transforms.  The rotation's partial sums reach ``d' max|x|`` (the decode's
``n d'**1.5 max|x|``), so inputs must stay below float32's maximum divided by
that (far above any gradient); beyond it the decode is non-finite, not silently
wrong.

References:
  Li, Shen, Vargaftik, Ben Basat, Mitzenmacher, Yu, "THC: Accelerating
  Distributed Deep Learning Using Tensor Homomorphic Compression", NSDI 2024
  (integer codes aggregated without decoding).
  Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017 (scaler sharing).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from compjax import hadamard
from compjax.compressor import dtype_max
from compjax.compressors.int_quant_theory import int_quant_omega, int_quant_rotated_omega
from compjax.compressors.summable import SummableCodes
from compjax.draws import counts_entries, raw_key, stochastic_round
from compjax.packing import WORD
from compjax.pieces import Pieces, decode_spans, wire_slice

#: ``fold_in`` data of the shared rotation's key (no worker index reaches it).
_ROTATION_STREAM = 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class IntQuant(SummableCodes):
    """``b``-bit stochastic integer codes with a scale that workers may share.

    See :func:`int_quant` and the module docstring.

    Besides the compressor contract (own scale, ``b``-bit fields), the
    exchange (:func:`compjax.exchange.compressed_mean`) uses the
    ``summable`` protocol of its base (:class:`compjax.compressors.summable.SummableCodes`):
    :meth:`scale_of` (this worker's ``max|x|``, to be ``pmax``-ed),
    :meth:`encode_words` (codes for a shared scale, packed for ``n`` summands)
    and :meth:`decode_words` (the sum back to floats).  The rotation
    (:meth:`rotate_in`, :meth:`rotate_out`) is this class's own.
    """

    rotate: bool = False

    def __post_init__(self):
        if not isinstance(self.code_bits, int) or not 2 <= self.code_bits <= 16:
            raise ValueError(f"bits must be an integer in [2, 16], got {self.code_bits!r}")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be True or False, got {self.rotate!r}")

    @staticmethod
    def _rotation_key(key):
        """The rotation's key: its own stream of the shared ``key`` (its signs, one round)."""
        return jax.random.fold_in(raw_key(key), _ROTATION_STREAM)

    def rotate_in(self, key, flat: jax.Array | Pieces) -> jax.Array | Pieces:
        """``H D x`` padded to ``d'``, signs from the shared ``key`` (``x`` if not rotating).

        ``flat`` may be a flat array in :class:`compjax.pieces.Pieces`: the
        rotation joins it; without one it stays in pieces.
        """
        if not self.rotate:
            return flat
        if isinstance(flat, Pieces):
            flat = flat.join()
        d = flat.shape[0]
        n = hadamard.next_power_of_two(d) if d else 0
        padded = jnp.pad(flat.astype(jnp.float32), (0, n - d))
        return hadamard.rotate_key(self._rotation_key(key), padded)

    def rotate_out(self, key, y: jax.Array, d: int) -> jax.Array:
        """The inverse of :meth:`rotate_in` (same ``key``), cut back to ``d`` entries."""
        if not self.rotate:
            return y
        return hadamard.unrotate_key(self._rotation_key(key), y)[:d]

    # -- the compressor contract: one worker, its own scale ------------------
    def encode(self, key, flat, dtype):
        code_key, round_key = jax.random.split(key)
        side = {"key": raw_key(round_key)}
        if self.rotate:
            # The rotation's key travels as side information, as EDEN's (not counted).
            side["rotation"] = raw_key(jax.random.fold_in(key, 2))
            flat = self.rotate_in(side["rotation"], flat)
        scale = self.scale_of(flat)
        words = self.encode_words(code_key, flat, scale, 1)
        # The receiver's randomness for rounding the decode onto a bfloat16/float16 grid.
        return {"scale": scale, "words": words}, side

    def decode(self, wire, side, n, dtype):
        size = hadamard.next_power_of_two(n) if self.rotate and n else n
        y = self.decode_words(wire["words"], wire["scale"], 1, 1, size)
        if self.rotate:
            y = self.rotate_out(side["rotation"], y, n)
        y = jnp.where(jnp.isfinite(wire["scale"]), y, jnp.nan)
        return stochastic_round(side["key"], y, dtype)

    # -- in pieces (compjax.pieces): without a rotation, its own words span by span ----------
    def encode_pieces(self, key, pieces, dtype):
        if self.rotate or not counts_entries(key, pieces.size):
            return super().encode_pieces(key, pieces, dtype)
        code_key, round_key = jax.random.split(key)
        scale = self.scale_of(pieces)
        words = self.encode_words(code_key, pieces, scale, 1)
        return {"scale": scale, "words": words}, {"key": raw_key(round_key)}

    def decode_pieces(self, wire, side, sizes, dtype):
        if self.rotate or not counts_entries(side["key"], sum(sizes)):
            return super().decode_pieces(wire, side, sizes, dtype)
        scale = wire["scale"]
        per_word = self.fields_per_word(1)

        def decode(span):  # spans start at whole groups, so at word span.start / per_word
            words = wire_slice(wire["words"], span, per_word)
            y = self.decode_words(words, scale, 1, 1, span.length)
            y = jnp.where(jnp.isfinite(scale), y, jnp.nan)
            return stochastic_round(side["key"], y, dtype, span.start)

        return decode_spans(sizes, self.unit(1), decode)

    def unbiased_range(self, d, dtype=jnp.float32):
        """Every finite input; with ``rotate``, ``max / min(d', 1 + d'/s)`` (sufficient).

        A rotated entry reaches ``sqrt(d') max|x|``, so the scale does and a
        code's error is below one step ``scale / s <= sqrt(d') max|x| / s``;
        unrotated, an entry's error is at most ``sqrt(d')`` steps, so the
        decode is at most ``(1 + d'/s) max|x|`` (and ``d' max|x|``, the sum
        of the rotated entries).  Beyond it a decode can exceed ``max`` and
        saturates (biased): float16 entries of 65504 average 0.3% low at 8
        bits, 6% at 4 bits, on 64 entries.  No decode confined to
        ``[-max, max]`` can be unbiased at ``x_i = max`` without being exact.
        At most ``float32 max / d'``, where the transform's float32 sums stay
        finite (bfloat16 and float32 inputs: ``max / d'`` as before).
        """
        if self.rotate and d:
            n = hadamard.next_power_of_two(d)
            # The transform's float32 sums (before its 1/sqrt(d') normalisation) stay finite.
            rotated = dtype_max(jnp.float32) / n
            return min(dtype_max(dtype) / min(n, 1.0 + n / self.levels), rotated)
        return dtype_max(dtype)

    def omega(self, d):
        if self.rotate:
            return int_quant_rotated_omega(d, self.code_bits)
        return int_quant_omega(d, self.code_bits)

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        if self.rotate and d:
            d = hadamard.next_power_of_two(d)
        return WORD * -(-d // self.fields_per_word(1)) + 32


def int_quant(bits: int = 4, rotate: bool = False) -> IntQuant:
    """Stochastic ``bits``-bit integer quantization whose codes sum across workers.

    ``C(x) = (scale / s) q`` with ``q_k`` one of the two integers around
    ``s x_k / scale`` (the upper with probability the fractional part), ``s =
    2**(bits-1) - 1`` and ``scale = max|x|``.  Unbiased with the exact
    variance constant ``omega(d) = (sqrt(1 + (d-1)/s**2) - 1)/2`` (for 4 bits
    and ``d = 2**20``, 73; QSGD's ``min(d/s**2, sqrt(d)/s)`` is 146 at the same
    ``s``).

    In a compjax exchange (``compress``, error feedback, EF21, DIANA, any
    ``exchange=``) the workers first agree on ``scale = max_i max|x_i|`` (a
    ``pmax`` of one float32) and their codes are ``psum``-ed as integers in
    fields of ``bit_length(2 s n)`` bits: a ring all-reduce whose traffic
    does not grow with ``n`` (see the module docstring for the mean's
    constant).  The exchange kinds ``"all_gather"`` and ``"scatter_gather"``
    both reduce this way; :func:`compjax.hierarchical` sums over the slow axes.

    Wire format alone: one float32 scale and ``bits``-bit offset codes,
    ``32 // bits`` to a uint32 word.

    Not INTELLECT-1's int8 all-reduce, though ``int_quant(8)`` sends the same
    8-bit codes: INTELLECT-1 quantises each ring chunk deterministically into
    256 bins over a 6-sigma range, decodes a bin to the mean of its values and
    re-quantises at every hop (biased, tails clipped); ``int_quant`` rounds
    stochastically (unbiased) on a grid set by one shared scale, and the
    codes are summed exactly as integers.

    ``rotate=True`` is THC's version: the codes are those of ``H D x``
    (padded to ``d'``, the next power of two), ``D`` random signs from a key
    every worker shares (in an exchange, derived from the step's common key;
    alone, sent as side information like EDEN's), and the receiver unrotates
    the summed codes once.  ``omega`` becomes the bound
    ``min(omega(d'), (ln(2 d') + 1) / (2 s**2))``: 0.159 at ``2**20`` entries
    and 4 bits instead of 72.6, for ``d' - d`` padded codes on the wire.

    Args:
      bits: bits per code, 2 to 16 (2: TernGrad's ternaries).
      rotate: quantise after a shared randomized Hadamard rotation (THC).

    Returns:
      An :class:`IntQuant` compressor whose payload holds ``"scale"`` (float32
      ``max|x|``, of ``H D x`` when rotating) and ``"words"`` (the offset codes
      packed into uint32 words), with keys as side information (the decode's
      rounding onto a bfloat16/float16 grid; the rotation's signs); it decodes
      to ``(scale / s) q``, unrotated.  In an exchange its ``summable``
      protocol sums the workers' words as integers.

    Raises:
      ValueError: ``bits`` out of range, or ``rotate`` not a bool.

    References:
      Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor
      Homomorphic Compression", NSDI 2024.
      Wen et al., "TernGrad", NeurIPS 2017.
    """
    return IntQuant(code_bits=bits, rotate=rotate)
