"""The compressor contract shared by every compressor in compjax.

A compressor is an immutable, hashable value (a frozen dataclass) with

* ``compress(key, x) -> Payload``: the message a worker sends for the array
  ``x``; ``key`` is a PRNG key (ignored, and may be ``None``, for deterministic
  compressors);
* ``decompress(payload) -> Array``: the decoded array, with ``x``'s shape and
  dtype;
* theory attached as metadata:

  - ``unbiased``: ``E[C(x)] = x``;
  - ``omega(d)``: variance constant of an unbiased compressor,
    ``E||C(x) - x||^2 <= omega(d) ||x||^2`` for every ``x`` with ``d`` entries;
  - ``delta(d)``: contraction of a biased compressor,
    ``E||C(x) - x||^2 <= (1 - delta(d)) ||x||^2``;
  - ``linear``: payloads of workers that used the same key may be summed
    before decoding (``decompress`` of the sum is the sum of the decodes);
  - ``bits(shape, dtype)``: the bits on the wire for an input of that shape
    and dtype, equal to ``wire_bits(compress(key, x))``;
  - ``unbiased_range(d, dtype)``: the range of unbiasedness, a bound ``r``
    such that ``E[C(x)] = x`` holds for every input of ``d`` entries in
    ``dtype`` with ``max|x_i| <= r`` (an unbiased estimate of a large ``x``
    may need values beyond the dtype, which saturate: ``rand_k`` rescales by
    ``d/k``, so its range is ``max * k/d``).  Called on a concrete array
    (not under ``jit``), ``compress`` warns (``UnbiasedRangeWarning``) when
    the input leaves it; traced inputs are not checked, which costs nothing.

``omega`` and ``delta`` return ``None`` where the compressor gives no such
guarantee (``sign`` is neither unbiased nor contractive).

Concrete compressors are final; new behaviour comes from wrapping
(:func:`compjax.blockwise`, :func:`compjax.chain`, :func:`compjax.scaled`).

Numerics: every compressor computes in float32 (bfloat16 and float16 inputs
are upcast exactly), scales by exact powers of two rather than dividing by a
data-dependent scale (:mod:`compjax.numerics`), so that inputs near the
float32 limits neither overflow nor flush to zero, maps a zero input to a zero
output, and casts its output back to the input dtype saturating at that
dtype's largest finite value (so a float16 input never decodes to Inf through
rounding up).  Unbiased compressors choose between values of the output
dtype's grid, so they stay unbiased in bfloat16 and float16.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from compjax.numerics import flatten, ldexp, opaque, to_dtype, unit_scale
from compjax.payload import Payload
from compjax.pieces import Pieces, split


def check_float32_range(dtype, name: str = "x") -> None:
    """Refuse a dtype wider than float32 (float64 under ``jax_enable_x64``).

    compjax computes in float32, so float64 values outside its range would
    silently become 0 or Inf; every compressor and transformation raises
    this same error instead.

    Raises:
      ValueError: ``dtype`` is wider than 4 bytes (the message names ``name``).
    """
    if jnp.dtype(dtype).itemsize > 4:
        raise ValueError(
            f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(dtype)} "
            f"(jax_enable_x64): compjax compresses in float32; cast the gradients to float32 first"
        )


def _check_dtype(dtype) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"x must be a floating point array, got dtype {np.dtype(dtype)}")
    check_float32_range(dtype)


def _check_input(x) -> jax.Array:
    x = jnp.asarray(x)
    _check_dtype(x.dtype)
    return x


class UnbiasedRangeWarning(UserWarning):
    """An input beyond a compressor's ``unbiased_range``: its decode may be biased (saturated)."""


def dtype_max(dtype) -> float:
    """The largest finite value of a floating ``dtype``, as a Python float."""
    return float(jnp.finfo(dtype).max)


#: A float32 sum of squares at least ``d`` times this is exact to its rounding:
#: the squares a CPU flushes to zero (entries below ``2**-63``) add less than
#: ``d * 2**-126``, below ``2**-24`` of it.
UNFLUSHED = 2.0**-102


def squares_safe(total: jax.Array, d: int) -> jax.Array:
    """Whether ``total``, a plain float32 sum of ``d`` squares, is the sum itself: finite and
    at least ``d * 2**-102`` (:data:`UNFLUSHED`).

    Where it is, its square root equals :func:`safe_norm`'s exactly scaled
    value bit for bit when no square is subnormal (scaling by ``2**-e``
    commutes with every rounding), and otherwise to within ``2**-25``; one
    pass over the array instead of two dependent ones (``max|x|``, then the
    scaled squares).
    """
    return jnp.isfinite(total) & (total >= d * UNFLUSHED)


def safe_norm(x: jax.Array, axis=None) -> jax.Array:
    """Euclidean norm computed as ``2**e ||x 2**-e||`` with ``2**e <= max|x| < 2**(e+1)``
    (:func:`compjax.numerics.unit_scale`).

    Scaling by an exact power of two (never dividing by ``max|x|``, see
    :mod:`compjax.numerics`): no overflow for entries near the float32 limit,
    exactly ``|x_i|`` for a single nonzero entry, and exactly 0 for a zero
    input (never NaN).
    """
    e, _ = unit_scale(jnp.max(jnp.abs(x), axis=axis, keepdims=True, initial=0.0))
    # One consumer per full-size intermediate, so XLA fuses the scaling into the sum.
    n = jnp.sqrt(jnp.sum(jnp.square(ldexp(x, -e)), axis=axis, keepdims=True))
    out = ldexp(n, e)
    return out.squeeze(axis) if axis is not None else out.reshape(())


def unflatten(flat: jax.Array, shape) -> jax.Array:
    """``flat.reshape(shape)``, with ``flat`` computed 1-D (the inverse of :func:`flatten`).

    XLA would otherwise move the reshape before the elementwise work that
    makes ``flat`` and index that work by ``shape``: a decode into conv
    kernels such as ``(2048, 1024, 1, 1)`` then runs slower on a CPU (the
    ResNet-50 tree's sign decode 15.1 against 9.3 ms, TernGrad's 17.3
    against 12.8).  The optimisation barrier keeps the (free) reshape last.
    """
    return (
        jax.lax.optimization_barrier(flat).reshape(shape) if len(shape) > 1 else flat.reshape(shape)
    )


def require_key(key, name: str):
    if key is None:
        raise ValueError(f"{name} is stochastic: compress needs a PRNG key, got key=None")
    return key


def split_key(key, num: int = 2):
    """``jax.random.split`` that passes ``None`` through (deterministic compressors)."""
    if key is None:
        return [None] * num
    return list(jax.random.split(key, num))


@dataclasses.dataclass(frozen=True)
class Compressor:
    """Base class: a compressor acting on the flattened input.

    Subclasses implement ``encode(key, flat, dtype) -> (wire, side)`` on the 1-D
    input (float32 unless ``keeps_dtype``; ``dtype`` is the input's, which the
    output will have) and ``decode(wire, side, n, dtype)`` back to
    a 1-D array, plus the metadata methods.  ``compress``/``decompress`` handle
    shapes, dtypes and the payload's static metadata.
    """

    unbiased: ClassVar[bool] = False
    linear: ClassVar[bool] = False
    deterministic: ClassVar[bool] = False
    # Send values in the input dtype (identity, sparsifiers) instead of float32.
    keeps_dtype: ClassVar[bool] = False
    # ``compress`` branches on the data (``lax.cond``), which ``jax.vmap`` would turn into
    # running every branch: the exchanges compress several blocks of it one at a time
    # (:func:`compjax.exchange.scatter.compress_blocks`).
    branches: ClassVar[bool] = False

    def flat_barrier(self, shape: tuple[int, ...]) -> bool:
        """Whether ``compress`` keeps the flattened input of ``shape`` 1-D for XLA
        (:func:`flatten`).

        Compressors that reshape the flat input into rows themselves (QSGD's
        buckets) keep it only where their rows would cut across ``shape``'s
        last dimensions: behind the barrier a row view of a kernel is a copy
        of it, and without it XLA indexes the rows by the kernel's shape.
        """
        return True

    # -- the wire -----------------------------------------------------------
    def compress(self, key, x) -> Payload:
        x = opaque(self.check(key, x))
        flat = flatten(x) if self.flat_barrier(x.shape) else x.reshape(-1)
        if not self.keeps_dtype:
            flat = flat.astype(jnp.float32)
        wire, side = self.encode(key, flat, x.dtype)
        return self.payload(wire, side, x)

    def decompress(self, payload: Payload) -> jax.Array:
        shape, dtype = payload.meta[0], payload.meta[1]
        flat = self.decode(payload.wire, payload.side, math.prod(shape), dtype)
        return self.finish(flat, payload)

    def subtract_decoded(self, payload: Payload, y: jax.Array) -> jax.Array:
        """``y - decompress(payload)``, ``y`` of the payload's shape: what error feedback keeps.

        The same values (in ``y``'s dtype promoted with the payload's).  The
        default decodes and subtracts; a sparse message
        (:class:`compjax.compressors.sparse.Sparsifier`) subtracts its kept
        entries from ``y`` instead, with no dense decode of zeros.
        """
        return y - self.decompress(payload)

    # -- a flat array in pieces (gradient buckets, compjax.pieces) --------------
    def compress_pieces(self, key, pieces: Pieces) -> Payload:
        """``compress(key, pieces.join())``, built from the pieces where the compressor can.

        The payload is the flat array's (the same wire arrays, metadata
        ``((pieces.size,), dtype)``), so :meth:`decompress` decodes it.
        Compressors that override :meth:`encode_pieces` (the elementwise
        ones, :mod:`compjax.compressors.elementwise`) encode the pieces where
        they lie; the others concatenate them first, a copy of the array.
        """
        if type(self).encode_pieces is Compressor.encode_pieces or not pieces.size:
            return self.compress(key, pieces.join())
        dtype = pieces.dtype
        _check_dtype(dtype)
        if not self.deterministic:
            require_key(key, type(self).__name__)
        if all(not isinstance(a, jax.core.Tracer) for a in pieces.sources):
            self.warn_out_of_range(np.concatenate([np.asarray(a) for a in pieces.arrays]))
        if not self.keeps_dtype:
            pieces = pieces.astype(jnp.float32)
        wire, side = self.encode_pieces(key, pieces, dtype)
        return Payload(wire=wire, side=side, meta=((pieces.size,), np.dtype(dtype)))

    def decompress_pieces(self, payload: Payload, sizes) -> list[jax.Array]:
        """The decoded flat array cut into consecutive 1-D pieces of ``sizes`` entries.

        ``split(decompress(payload), sizes)``, decoded straight into the
        pieces where the compressor can (:meth:`decode_pieces`), without the
        flat array in between.

        Raises:
          ValueError: ``sizes`` do not add up to the payload's entries.
        """
        sizes = tuple(int(s) for s in sizes)
        if sum(sizes) != math.prod(payload.meta[0]):
            raise ValueError(
                f"sizes {sizes} add up to {sum(sizes)} entries; the payload has "
                f"{math.prod(payload.meta[0])}"
            )
        if type(self).decode_pieces is Compressor.decode_pieces or not sum(sizes):
            return split(self.decompress(payload).reshape(-1), sizes)
        dtype = payload.meta[1]
        flats = self.decode_pieces(payload.wire, payload.side, sizes, dtype)
        return [to_dtype(f, dtype) for f in flats]

    def encode_pieces(self, key, pieces: Pieces, dtype) -> tuple[dict, dict]:
        """:meth:`encode` of the flat array that ``pieces`` lay end to end (float32 pieces
        unless ``keeps_dtype``).

        The default concatenates the pieces (a copy) and encodes the result;
        compressors that can encode each piece where it lies override it and
        return the same ``(wire, side)``.
        """
        return self.encode(key, pieces.join(), dtype)

    def decode_pieces(self, wire: dict, side: dict, sizes: tuple[int, ...], dtype):
        """:meth:`decode` cut into pieces of ``sizes`` entries (1-D, float32 or the wire's).

        The default decodes the flat array and cuts it.
        """
        return split(self.decode(wire, side, sum(sizes), dtype), sizes)

    # -- helpers for compressors that override compress/decompress -------------
    def check(self, key, x) -> jax.Array:
        """``x`` as a floating array; raises ``ValueError`` for bad input or a missing key."""
        x = _check_input(x)
        if not self.deterministic:
            require_key(key, type(self).__name__)
        self.warn_out_of_range(x)
        return x

    def warn_out_of_range(self, x: jax.Array) -> None:
        """Warn (``UnbiasedRangeWarning``) if a concrete ``x`` leaves :meth:`unbiased_range`.

        Traced inputs (under ``jit``, ``vmap``, ...) are not checked: the
        check is a host-side comparison, free where it runs and absent from
        compiled steps.  Non-finite entries are not "out of range" (they
        propagate, see docs/compressors.md).
        """
        if isinstance(x, jax.core.Tracer) or x.size == 0:
            return
        bound = self.unbiased_range(x.size, x.dtype)
        if bound is None:
            return
        magnitudes = np.abs(np.asarray(x, np.float32))
        largest = float(np.max(np.where(np.isfinite(magnitudes), magnitudes, 0.0)))
        if largest > bound:
            warnings.warn(
                f"{type(self).__name__}: max|x| = {largest:.4g} exceeds the range of "
                f"unbiasedness {bound:.4g} for {x.size} entries of {np.dtype(x.dtype).name}: "
                f"the decode saturates there and is biased",
                UnbiasedRangeWarning,
                stacklevel=4,
            )

    def payload(self, wire: dict, side: dict, x: jax.Array) -> Payload:
        """A payload for input ``x`` (its shape and dtype go into the static metadata)."""
        return Payload(wire=wire, side=side, meta=(tuple(x.shape), np.dtype(x.dtype)))

    def finish(self, flat: jax.Array, payload: Payload) -> jax.Array:
        """The decoded 1-D ``flat`` back to the payload's shape and (saturated) dtype."""
        return unflatten(to_dtype(flat, payload.meta[1]), payload.meta[0])

    def __call__(self, key, x) -> jax.Array:
        """``decompress(compress(key, x))``: the compressed estimate of ``x``."""
        return self.decompress(self.compress(key, x))

    # -- to implement -------------------------------------------------------
    def encode(self, key, flat: jax.Array, dtype) -> tuple[dict, dict]:
        raise NotImplementedError

    def decode(self, wire: dict, side: dict, n: int, dtype) -> jax.Array:
        raise NotImplementedError

    def omega(self, d: int) -> float | None:
        """Variance constant for inputs of ``d`` entries (``None``: no guarantee)."""
        return None

    def delta(self, d: int) -> float | None:
        """Contraction constant for inputs of ``d`` entries (``None``: no guarantee)."""
        return None

    def bits(self, shape, dtype=jnp.float32) -> int:
        """Bits on the wire for an input of ``shape`` and ``dtype``."""
        raise NotImplementedError

    def unbiased_range(self, d: int, dtype=jnp.float32) -> float | None:
        """``r`` such that ``E[C(x)] = x`` for every ``x`` of ``d`` entries with ``max|x_i| <= r``.

        ``None`` where no range is guaranteed: a biased compressor, or one
        whose range is not established (the default).  An unbiased compressor
        whose decodes never exceed what the dtype holds returns the dtype's
        largest finite value (unbiased on every finite input).
        """
        return None

    def bits_per_coordinate(self, d: int, dtype=jnp.float32) -> float:
        return self.bits((d,), dtype) / d
