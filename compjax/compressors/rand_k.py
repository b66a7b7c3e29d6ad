"""Random-k sparsification: ``k`` entries chosen uniformly, rescaled by ``d/k`` to be unbiased.

Low-precision inputs (bfloat16, float16) are dithered before the rescaling
(:func:`dither`), so that the rescaled decode, rounded to the input's dtype,
stays unbiased.

References:
  Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
  (random-k, its variance and contraction constants).
  Wangni, Wang, Liu, Zhang, "Gradient Sparsification for
  Communication-Efficient Distributed Optimization", NeurIPS 2018.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from compjax.compressor import dtype_max
from compjax.compressors.sparse import Sparsifier, check_k_ratio
from compjax.draws import bernoulli, raw_key
from compjax.numerics import divide, round_to

_F32_MAX = dtype_max(jnp.float32)


def rescaled(values: jax.Array, scale: float, dtype) -> jax.Array:
    """What a kept value decodes to: ``values * scale`` in float32, saturated, on ``dtype``'s grid.

    The same operations as :meth:`Sparsifier.scatter` followed by
    :meth:`compjax.Compressor.finish` (finite values only).
    """
    return round_to(jnp.clip(values.astype(jnp.float32) * scale, -_F32_MAX, _F32_MAX), dtype)


def dither(key, values: jax.Array, scale: float) -> jax.Array:
    """Kept values (bfloat16/float16) nudged so that their rescaled decodes are unbiased.

    Rescaling by ``scale = d/k`` and rounding to the values' dtype would bias
    each kept entry by up to half an ulp.  Instead, of the values' neighbours
    ``w`` (up to two ulps either way) the two whose decodes bracket the
    float32 target ``v * scale`` are chosen between with the probability that
    makes the expected decode equal that target.  Values whose target leaves
    the dtype's range (float16 beyond 65504) saturate, and Inf/NaN are kept.
    """
    dtype = values.dtype
    limit = jnp.asarray(jnp.finfo(dtype).max, dtype)
    target = values.astype(jnp.float32) * scale
    near = [values]
    for _ in range(2):
        near = [jnp.nextafter(near[0], -limit), *near, jnp.nextafter(near[-1], limit)]
    near = [jnp.clip(w, -limit, limit) for w in near]
    decoded = [rescaled(w, scale, dtype) for w in near]
    lo, v_lo, hi, v_hi = values, target, values, target
    for w, v in zip(near, decoded, strict=True):  # ascending: keep the last below
        lo, v_lo = jnp.where(v <= target, w, lo), jnp.where(v <= target, v, v_lo)
    for w, v in zip(near[::-1], decoded[::-1], strict=True):  # and the first above
        hi, v_hi = jnp.where(v >= target, w, hi), jnp.where(v >= target, v, v_hi)
    bracket = jnp.isfinite(target) & (v_lo <= target) & (target <= v_hi)
    p = divide(jnp.where(bracket, target - v_lo, 0.0), jnp.where(bracket, v_hi - v_lo, 0.0))
    return jnp.where(bracket, jnp.where(bernoulli(key, p), hi, lo), values)


@dataclasses.dataclass(frozen=True)
class RandK(Sparsifier):
    """Keep ``k`` uniformly random entries.  See :func:`rand_k`."""

    scaled: bool = True
    shared_seed: bool = False

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.scaled

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.shared_seed

    def scale(self, d):
        k = self.k_for(d)
        return d / k if self.scaled and k else 1.0

    def indices(self, key, flat, k):
        d = flat.shape[0]
        if k == 0:
            return jnp.zeros((0,), jnp.int32)
        return jax.random.choice(key, d, (k,), replace=False).astype(jnp.int32)

    def encode(self, key, flat, dtype):
        d = flat.shape[0]
        # With a shared seed the raw key travels as side information; both ends draw from it.
        index_key = raw_key(key) if self.shared_seed else key
        idx = self.indices(index_key, flat, self.k_for(d))
        values = flat[idx]
        if self.scaled and idx.size and np.dtype(dtype).itemsize < 4:
            values = dither(jax.random.fold_in(key, 1), values, self.scale(d))
        if self.shared_seed:
            return {"values": values}, {"key": index_key}
        return {"indices": idx, "values": values}, {}

    def entries(self, wire, side, n):
        if not self.shared_seed:
            return super().entries(wire, side, n)
        # Both ends draw the indices from the shared key.
        return self.indices(side["key"], jnp.zeros((n,)), self.k_for(n)), wire["values"]

    def omega(self, d):
        if not self.scaled:
            return None
        return d / self.k_for(d) - 1.0 if d else 0.0

    def unbiased_range(self, d, dtype=jnp.float32):
        """``max * k/d`` (``max``: the dtype's largest value): ``x_i d/k`` must be representable."""
        if not self.scaled:
            return None
        k = self.k_for(d)
        return dtype_max(dtype) * (k / d if d else 1.0)

    def delta(self, d):
        if self.scaled:
            return None
        return self.k_for(d) / d if d else 1.0

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        return self.value_bits(d, dtype) + (0 if self.shared_seed else 32 * self.k_for(d))


def rand_k(
    k: int | None = None,
    ratio: float | None = None,
    scaled: bool = True,
    shared_seed: bool = False,
) -> RandK:
    """Random-k sparsification: keep ``k`` entries chosen uniformly without replacement.

    Args:
      k: entries kept of each array (give ``k`` or ``ratio``, not both).
      ratio: the fraction of the ``d`` entries kept, ``k = max(1, round(ratio d))``,
        in ``(0, 1]``.
      scaled: multiply by ``d/k`` on decoding, making the compressor unbiased
        with ``omega = d/k - 1`` exactly (for every ``x``; a rescaled value
        beyond the float32 range saturates at its limit); unscaled it is
        biased with ``E||C(x) - x||^2 = (1 - k/d) ||x||^2``, ``delta = k/d``.
        For bfloat16/float16 inputs the rescaled value is rounded to the
        input dtype on decoding, so each kept value is first moved to one of
        its neighbours (:func:`dither`) such that the expected decode is
        ``x_i d/k``: unbiased while ``|x_i| d/k`` stays below the dtype's
        largest value (float16: 65504, beyond which it saturates).  The two
        decodes chosen between are at most 3 ulps of ``x_i d/k`` apart, so a
        kept entry gains at most ``(3 ulp)^2 / 4`` of variance.  With
        ``shared_seed`` the neighbours are chosen with the shared key, so
        that choice is the same on every worker.
      shared_seed: the indices derive from the key alone, so only the values
        travel (the key is side information every worker holds) and payloads
        of workers that used the same key can be summed before decoding
        (``linear``).

    Range of unbiasedness (``unbiased_range(d, dtype)``): ``max|x_i| <=
    max * k/d`` with ``max`` the dtype's largest finite value (float32:
    3.4e38, so ``ratio=0.1`` is unbiased up to 3.4e37); beyond it a kept
    ``x_i d/k`` saturates at ``max`` and the mean falls short (3e38
    averages to ``max * k/d``: 3.4e37 at ``d = 100``, ``ratio=0.1``).  A concrete input beyond it
    warns (``UnbiasedRangeWarning``); inputs under ``jit`` are not checked.
    As :func:`compjax.top_k`, an empty input gives an empty payload whatever ``k``.

    Wire format: int32 indices and values in the input dtype; values only with
    ``shared_seed``.

    Returns:
      A :class:`RandK` compressor whose payload holds ``"indices"`` (``k``
      int32, absent with ``shared_seed``, where the side information holds the
      key they derive from) and ``"values"`` (the kept entries in the input
      dtype); it decodes to the values times ``d/k`` (``scaled``) at those
      positions and 0 elsewhere.

    Raises:
      ValueError: both or neither of ``k`` and ``ratio``; ``k < 1``; ``ratio``
        outside ``(0, 1]``.

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018.
      Wangni et al., "Gradient Sparsification for Communication-Efficient
      Distributed Optimization", NeurIPS 2018.
    """
    check_k_ratio(k, ratio)
    return RandK(
        k=None if k is None else int(k),
        ratio=None if ratio is None else float(ratio),
        scaled=bool(scaled),
        shared_seed=bool(shared_seed),
    )
