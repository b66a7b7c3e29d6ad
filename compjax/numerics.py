"""Exact float32 scaling and rounding onto a narrower dtype's grid.

Three facts of XLA shape these helpers:

* on a CPU it rewrites ``x / m`` as ``x * (1/m)``; for ``m > 2**126`` the
  reciprocal is subnormal and flushed to zero, so the quotient is 0;
* on a CPU subnormal floats are flushed to zero in arithmetic;
* its simplifier reassociates float products with a compile-time constant as
  if they were exact, so a compressor hides its input (:func:`opaque`).

So a compressor never divides by a data-dependent scale directly: it first
brings the scale into ``[1, 2)`` by an exact power of two (:func:`unit_scale`),
where the reciprocal is harmless.  And a
compressor that decodes to bfloat16 or float16 rounds its candidate outputs
with :func:`round_to` exactly as :meth:`compjax.Compressor.finish` will, so it
can pick between the values the receiver will actually decode to.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_MANTISSA_BITS = 23
_BIAS = 127


def flatten(x: jax.Array) -> jax.Array:
    """``x.reshape(-1)``, kept 1-D for XLA.

    XLA would otherwise move the reshape past the elementwise work and run
    every loop and reduction on ``x``'s own shape; for conv kernels such as
    ``(2048, 1024, 1, 1)`` that makes a CPU reduction several times slower.
    The optimisation barrier keeps the (free) reshape where it is.
    """
    flat = x.reshape(-1)
    return jax.lax.optimization_barrier(flat) if x.ndim > 1 else flat


def opaque(x: jax.Array) -> jax.Array:
    """``x`` behind an optimisation barrier: XLA's simplifier sees no constant in it.

    A compressor's input may be a compile-time constant: an array closed over
    by ``jax.jit`` (or ``jax.vmap`` under it), or made from constants inside.
    XLA's simplifier then reassociates float products of it as if they were
    exact, and the scaled arithmetic above breaks: the exactly scaled square
    ``(x 2**-e) (x 2**-e)`` becomes ``(x x) (2**-e 2**-e)``, ``Inf * 0`` for
    ``|x|`` beyond ``2**64`` and ``0 * Inf`` for a tiny ``x`` (QSGD's and
    natural dithering's norm was NaN there, the decode NaN); and the constant
    folder does not flush subnormals as the CPU does (``sign`` read ``-1e-45``
    as negative there, as zero in every other form).  Behind the barrier a
    constant is compiled as an argument is.  The barrier is expanded before
    fusion: for an argument the compiled program is the same, op for op.
    """
    return jax.lax.optimization_barrier(x)


def all_finite(a: jax.Array) -> jax.Array:
    """Whether every entry of ``a`` is finite, as one sum: ``sum(a - a) == 0``.

    A finite entry less itself is ``+0``; an Inf or NaN less itself is NaN,
    which the sum keeps.  (XLA keeps the difference: its simplifier folds
    ``x - x`` to 0 for integers only, which for floats would lose the NaN.
    ``a * 0`` would do as well, but XLA may share its broadcast zero with
    another, materialised one, and read it: measured, a training step 15%
    slower.)  On a CPU the difference fuses into one reduction that XLA runs
    at memory speed, where ``jnp.all(jnp.isfinite(a))`` takes 2 to 3 times
    as long (25.6M float32 entries: 6.1 against 13.4 ms, a copy 28 ms).
    The sum runs over ``a`` flattened (:func:`flatten`): inside a training
    step XLA's CPU backend otherwise cut a matrix's sum into 32 × 32 windows
    for a YNNPACK fusion, and ``make bench``'s sign MLP step took 1.44 to
    1.48 times the plain step, against 1.29 to 1.32 flat.
    Other dtypes (integers, complex) by ``jnp.isfinite``.
    """
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.all(jnp.isfinite(a))
    flat = flatten(a)
    return jnp.sum(flat - flat, dtype=jnp.float32) == 0


def exponent(m: jax.Array) -> jax.Array:
    """``floor(log2 m)`` of a positive normal float32 ``m``, as int32, from its bits.

    Zero and subnormal ``m`` give ``-127``; Inf and NaN give ``128``.
    """
    bits = jax.lax.bitcast_convert_type(m.astype(jnp.float32), jnp.uint32)
    return ((bits >> _MANTISSA_BITS) & 0xFF).astype(jnp.int32) - _BIAS


def magnitude(x: jax.Array) -> jax.Array:
    """``|x|`` of float32 ``x`` by clearing its sign bit.

    The same values as ``jnp.abs``, but not merged with another ``abs(x)``
    by XLA: an ``abs`` shared by a reduction and a later loop (a norm, then
    the quantisation) would be materialised as a full-size array.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def pow2(k: jax.Array) -> jax.Array:
    """``2.0**k`` as float32, exact, for integer ``k`` in ``[-126, 127]`` (clipped to it)."""
    k = jnp.clip(jnp.asarray(k, jnp.int32), -126, 127) + _BIAS
    return jax.lax.bitcast_convert_type(k.astype(jnp.uint32) << _MANTISSA_BITS, jnp.float32)


def ldexp(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k`` by one multiplication, exact for ``k`` in ``[-126, 127]`` while the
    result stays normal (a subnormal result is flushed to zero on a CPU)."""
    return x * pow2(k)


def unit_scale(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(e, m * 2**-e)`` for ``m >= 0``: ``m`` scaled into ``[1, 2)`` by an exact power of two.

    ``e`` is ``m``'s exponent clipped to ``[-126, 126]``, so that ``2**e`` and
    ``2**-e`` are both normal; ``m >= 2**127`` lands in ``[2, 4)`` and a zero
    ``m`` gives ``(0, 0)``.  Scaling ``x`` by the same ``2**-e``
    (:func:`ldexp`) is exact for ``|x| <= m`` down to ``2**-126`` times ``m``.
    """
    e = jnp.where(m > 0, jnp.clip(exponent(m), -126, 126), 0)
    return e, ldexp(m, -e)


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` for ``b >= 0``, with 0 where ``b == 0``, for any normal ``b``.

    Both are scaled by the power of two that brings ``b`` into ``[1, 2)``
    (:func:`unit_scale`), so the reciprocal that XLA substitutes is harmless
    (the result may differ from the correctly rounded quotient by an ulp).
    """
    e, unit = unit_scale(b)
    return jnp.where(b > 0, ldexp(a, -e) / jnp.where(b > 0, unit, 1.0), 0.0)


def fraction_between(m: jax.Array, lo: jax.Array, hi: jax.Array, e: jax.Array) -> jax.Array:
    """``(m - lo) / (hi - lo)`` for ``lo <= m <= hi``, 0 where ``hi == lo``, all three scaled
    by ``2**-e`` first (``e``: the exponent of the scale they lie below, :func:`unit_scale`).

    The chance of the upper of two neighbouring levels in a stochastic rounding.  Levels
    closer than float32's smallest normal have a gap that flushes to 0 unscaled.
    """
    gap = hi > lo
    lo = ldexp(lo, -e)
    p = (ldexp(m, -e) - lo) / jnp.where(gap, ldexp(hi, -e) - lo, 1.0)
    return jnp.where(gap, p, 0.0)


def to_dtype(y: jax.Array, dtype) -> jax.Array:
    """Cast ``y`` to ``dtype``, finite values saturating at the target's largest finite value.

    Infinities stay infinite and NaN stays NaN: only rounding is kept from
    overflowing, a non-finite value is never turned into a finite one.
    """
    dtype = np.dtype(dtype)
    if y.dtype == dtype:
        return y
    if jnp.issubdtype(dtype, jnp.floating):
        limit = float(jnp.finfo(dtype).max)
        if limit < float(jnp.finfo(y.dtype).max):
            # In float32 (at least), where the limit is exact: bfloat16 rounds 65504 to 65536.
            y = y.astype(jnp.promote_types(y.dtype, jnp.float32))
            y = jnp.where(jnp.isinf(y), y, jnp.clip(y, -limit, limit))
    return y.astype(dtype)


def widen(a: jax.Array) -> jax.Array:
    """``a`` as float32, exactly: bfloat16 by moving its 16 bits to the top of a word.

    A bfloat16 value is the top half of the float32 with the same value, so
    the bits moved left by 16 are that float32 for every one of the 65,536
    codes (NaNs and subnormals included; ``tests/test_numerics.py`` checks
    all of them against ``astype``).  XLA's CPU backend converts
    ``astype(float32)`` from bfloat16 in a slower loop: decoding the ResNet-50
    tree's bfloat16 leaves took 13 ms against 10 ms this way.  Other dtypes
    are ``astype(float32)``.
    """
    if a.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return a.astype(jnp.float32)


def round_to(y: jax.Array, dtype) -> jax.Array:
    """Float32 ``y`` rounded onto ``dtype``'s grid as decoding will (:func:`to_dtype`), as float32.

    The identity for float32 (or wider) ``dtype``.
    """
    if np.dtype(dtype).itemsize >= 4:
        return y
    return to_dtype(y, dtype).astype(jnp.float32)


def round_up_to(y: jax.Array, dtype) -> jax.Array:
    """The smallest value of ``dtype``'s grid ``>= y`` (float32 ``y >= 0``), as float32.

    Saturates at the dtype's largest finite value.
    """
    if np.dtype(dtype).itemsize >= 4:
        return y
    near = to_dtype(y, dtype)
    up = jnp.nextafter(near, jnp.asarray(jnp.finfo(dtype).max, dtype))
    return jnp.where(near.astype(jnp.float32) < y, up, near).astype(jnp.float32)


def prescale(n: int, headroom: int = 0) -> tuple[float, float]:
    """``(2**-k, 2**k / n)`` with ``2**k`` the power of two ``>= n``, times ``2**headroom``.

    A sum of ``n`` float32 values each at most float32's largest value can
    overflow though their mean cannot; the same sum of the values times
    ``2**-k`` (an exact scaling) cannot, and times ``2**k / n`` it is the mean.

    Args:
      n: the number of summands (workers), at least 1.
      headroom: extra binades of room below float32's largest value.

    Returns:
      ``(down, up)``: the exact scaling before the sum and the factor after it.
    """
    k = max(0, math.ceil(math.log2(n))) + headroom
    return 2.0**-k, 2.0**k / n
