"""TernGrad: ternary gradients with a per-tensor scaler.

References:
  Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.compressor import Compressor, dtype_max
from compjax.compressors.elementwise import Elementwise
from compjax.draws import bernoulli
from compjax.numerics import divide, ldexp, magnitude, round_up_to, unit_scale
from compjax.pieces import Pieces

# Ternary codes, 2 bits each, 16 to a uint32 word.
ZERO, PLUS, MINUS = 0, 1, 2


def clip_to_std(x: jax.Array, c: float) -> jax.Array:
    """Clip ``x`` to ``[-c sigma, c sigma]`` with ``sigma`` the std of its entries.

    The std is computed on ``x 2**-e`` with ``2**e <= max|x| < 2**(e+1)`` (an
    exact scaling, :func:`compjax.numerics.unit_scale`) so that it can neither
    overflow nor flush to zero.  A leaf whose entries are all equal (a scalar,
    a single entry, a constant gradient) has ``sigma = 0`` and is not clipped:
    clipping it to 0 would freeze it for ever, and its float std is a rounding
    error whose size differs between ``jit`` and eager execution.
    """
    if not x.size:
        return x
    e, _ = unit_scale(jnp.max(jnp.abs(x)))
    sigma = ldexp(jnp.std(ldexp(x, -e)), e)
    spread = jnp.max(x) > jnp.min(x)
    return jnp.where(spread, jnp.clip(x, -c * sigma, c * sigma), x)


def clip_bound_of_pieces(pieces: Pieces, c: float) -> tuple[jax.Array, jax.Array]:
    """``(spread, c sigma)`` of :func:`clip_to_std` for the flat array in ``pieces`` (non-empty).

    The same scaled two-pass standard deviation, reduced piece by piece.
    """
    e, _ = unit_scale(pieces.reduce(jnp.abs, "max"))
    d = pieces.size
    mean = pieces.reduce(lambda a: ldexp(a, -e), "sum") / d
    var = pieces.reduce(lambda a: jnp.square(ldexp(a, -e) - mean), "sum") / d
    sigma = ldexp(jnp.sqrt(var), e)
    spread = pieces.reduce(lambda a: a, "max") > -pieces.reduce(lambda a: -a, "max")
    return spread, c * sigma


def ternarize(key, x: jax.Array, scale: jax.Array, offset: int = 0) -> jax.Array:
    """Ternary codes of ``x`` for the scaler ``scale >= max|x|``.

    Entry ``i`` is ``sign(x_i)`` with probability ``|x_i| / scale`` (exactly 1
    at ``|x_i| = scale``) and 0 otherwise, so that ``scale * value`` is an
    unbiased estimate of ``x``.  ``offset``: ``x`` is entries ``offset ..`` of
    a larger array, whose random draws it takes (:func:`compjax.draws.random_bits`).
    """
    mag = magnitude(x)
    keep = bernoulli(key, divide(mag, scale), offset, unit=True) | ((mag >= scale) & (scale > 0))
    return jnp.where(keep, jnp.where(x < 0, MINUS, PLUS), ZERO).astype(jnp.uint32)


def ternary_values(codes: jax.Array) -> jax.Array:
    """Codes to ``-1, 0, +1`` as float32."""
    return jnp.where(codes == PLUS, 1.0, jnp.where(codes == MINUS, -1.0, 0.0))


def terngrad_omega(d: int) -> float:
    """Supremum of TernGrad's relative variance over ``x`` with ``d`` entries.

    The variance is ``sum_k |x_k| (s - |x_k|)`` with ``s = ||x||_inf``, i.e.
    ``omega(x) = ||x||_inf ||x||_1 / ||x||_2^2 - 1``, maximal at
    ``x = (1, b, ..., b)`` with ``b = 1/(sqrt(d) + 1)``: ``(sqrt(d) - 1) / 2``.

    Args:
      d: the number of entries of the input.

    Returns:
      ``omega(d) = (sqrt(d) - 1) / 2`` (a float; 0 for ``d <= 0``).
    """
    return (math.sqrt(d) - 1.0) / 2.0 if d > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class TernGrad(Elementwise, Compressor):
    """TernGrad with an optional ``clip * std`` clipping.  See :func:`terngrad`."""

    clip: float | None = None

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.clip is None

    def encode(self, key, flat, dtype):
        if self.clip is not None:
            flat = clip_to_std(flat, self.clip)
        # On the output dtype's grid (rounded up), so that the decoded +-scale is exact.
        stats = {"scale": round_up_to(jnp.max(jnp.abs(flat), initial=0.0), dtype)}
        # (clipped already: no clip bound for encode_span)
        return {**stats, **self.encode_span(key, flat, 0, flat.shape[0], stats, dtype)}, {}

    def units(self, d, dtype):
        return {"codes": packing.codes_per_element(2)}

    def statistics(self, key, pieces, dtype):
        top = pieces.reduce(jnp.abs, "max")
        if self.clip is None:
            return {"scale": round_up_to(top, dtype)}
        # max|clip(x, -b, b)| = min(max|x|, b) exactly.
        spread, bound = clip_bound_of_pieces(pieces, self.clip)
        clipped_top = jnp.where(spread, jnp.minimum(top, bound), top)
        return {"scale": round_up_to(clipped_top, dtype), "_clip": (spread, bound)}

    def encode_span(self, key, x, offset, d, stats, dtype):
        if "_clip" in stats:
            spread, bound = stats["_clip"]
            x = jnp.where(spread, jnp.clip(x, -bound, bound), x)
        return {"codes": packing.pack(ternarize(key, x, stats["scale"], offset), 2)}

    def decode_span(self, wire, side, offset, n, d, dtype):
        return wire["scale"] * ternary_values(packing.unpack(wire["codes"], 2, n))

    def omega(self, d):
        return terngrad_omega(d) if self.unbiased else None

    def unbiased_range(self, d, dtype=jnp.float32):
        # Decodes are 0 or +-max|x| on the dtype's grid: every finite input.
        return dtype_max(dtype) if self.unbiased else None

    def bits(self, shape, dtype=jnp.float32):
        return packing.packed_bits(math.prod(shape), 2) + 32


def terngrad(clip: float | None = None) -> TernGrad:
    """TernGrad: ``C(x) = s sign(x) * b`` with ``s = max|x|``, ``b_k ~ Bernoulli(|x_k|/s)``.

    Wire format: one float32 scaler and 2-bit ternary codes packed 16 to a uint32 word.
    The scaler is on the input dtype's grid (rounded up where clipping made
    it inexact), so ``+-s`` decode exactly in bfloat16 and float16 too.

    Theory: without clipping, unbiased with ``omega(d) = (sqrt(d) - 1)/2``, the
    supremum of ``||x||_inf ||x||_1 / ||x||_2^2 - 1``.  With ``clip = c`` the
    array is first clipped to ``c`` standard deviations of its entries (the
    paper uses ``c = 2.5``); the result is unbiased only for the clipped
    array, so the compressor reports ``unbiased = False`` and no constants.

    Args:
      clip: clipping factor ``c > 0``, or ``None`` for no clipping.

    Returns:
      A :class:`TernGrad` compressor whose payload holds ``"scale"`` (float32
      ``s``) and ``"codes"`` (the ternaries, 2 bits each, 16 to a uint32 word);
      it decodes to ``s sign(x_k) b_k``.

    Raises:
      ValueError: ``clip`` is not positive.

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
      Distributed Deep Learning", NeurIPS 2017.
    """
    valid = isinstance(clip, int | float) and clip > 0 and math.isfinite(clip)
    if clip is not None and not valid:
        raise ValueError(f"clip must be a positive finite number or None, got {clip!r}")
    return TernGrad(clip=None if clip is None else float(clip))
