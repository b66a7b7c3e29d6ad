"""Compressors built from compressors: blocks, sparsify-then-quantise, scaling.

Variation by wrapping: each combinator is a compressor holding others, with
its theory derived from theirs.

References:
  Alistarh et al., "QSGD", NeurIPS 2017 (bucketing).
  Horvath et al., "Natural Compression for Distributed Deep Learning",
  arXiv:1905.10988 (composition of compressors, Theorem 2).
  Stich et al., "Sparsified SGD with Memory", NeurIPS 2018 (an unbiased C with
  constant omega, scaled by 1/(omega + 1), is contractive).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from compjax.compressor import Compressor, split_key
from compjax.compressors.sparse import Sparsifier


def _worst(values, pick):
    values = list(values)
    return None if any(v is None for v in values) else pick(values)


@dataclasses.dataclass(frozen=True)
class Wrapper(Compressor):
    """A compressor around one ``inner`` compressor, with its flags by default."""

    inner: Compressor = None

    @property
    def unbiased(self):  # type: ignore[override]
        return self.inner.unbiased

    @property
    def linear(self):  # type: ignore[override]
        return self.inner.linear

    @property
    def deterministic(self):  # type: ignore[override]
        return self.inner.deterministic

    @property
    def branches(self):  # type: ignore[override]
        return self.inner.branches


@dataclasses.dataclass(frozen=True)
class Blockwise(Wrapper):
    """``inner`` applied independently to consecutive blocks.  See :func:`blockwise`."""

    block_size: int = 1

    def _sizes(self, d: int) -> tuple[int, int]:
        full = d // self.block_size
        return full, d - full * self.block_size

    def compress(self, key, x):
        x = self.check(key, x)
        flat = x.reshape(-1)
        full, tail = self._sizes(flat.shape[0])
        key_blocks, key_tail = split_key(key)
        wire = {}
        if full:
            blocks = flat[: full * self.block_size].reshape(full, self.block_size)
            if key_blocks is None:
                wire["blocks"] = jax.vmap(lambda b: self.inner.compress(None, b))(blocks)
            else:
                keys = jax.random.split(key_blocks, full)
                wire["blocks"] = jax.vmap(self.inner.compress)(keys, blocks)
        if tail:
            wire["tail"] = self.inner.compress(key_tail, flat[full * self.block_size :])
        return self.payload(wire, {}, x)

    def decompress(self, payload):
        shape, dtype = payload.meta[0], payload.meta[1]
        parts = [jnp.zeros((0,), dtype)]
        if "blocks" in payload.wire:
            parts.append(jax.vmap(self.inner.decompress)(payload.wire["blocks"]).reshape(-1))
        if "tail" in payload.wire:
            parts.append(self.inner.decompress(payload.wire["tail"]))
        return jnp.concatenate(parts).reshape(shape)

    def _block_dims(self, d):
        full, tail = self._sizes(d)
        return ([self.block_size] if full else []) + ([tail] if tail else []) or [0]

    def omega(self, d):
        return _worst((self.inner.omega(s) for s in self._block_dims(d)), max)

    def unbiased_range(self, d, dtype=jnp.float32):
        return _worst((self.inner.unbiased_range(s, dtype) for s in self._block_dims(d)), min)

    def delta(self, d):
        return _worst((self.inner.delta(s) for s in self._block_dims(d)), min)

    def bits(self, shape, dtype=jnp.float32):
        full, tail = self._sizes(math.prod(shape))
        total = full * self.inner.bits((self.block_size,), dtype) if full else 0
        return total + (self.inner.bits((tail,), dtype) if tail else 0)


@dataclasses.dataclass(frozen=True)
class Chain(Compressor):
    """Sparsify, then quantise the kept values.  See :func:`chain`."""

    sparsifier: Sparsifier = None
    quantizer: Compressor = None

    @property
    def unbiased(self):  # type: ignore[override]
        return self.sparsifier.unbiased and self.quantizer.unbiased

    @property
    def linear(self):  # type: ignore[override]
        return self.sparsifier.linear and self.quantizer.linear

    @property
    def deterministic(self):  # type: ignore[override]
        return self.sparsifier.deterministic and self.quantizer.deterministic

    @property
    def branches(self):  # type: ignore[override]
        return self.sparsifier.branches or self.quantizer.branches

    def compress(self, key, x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):  # the sparsifier raises for the others
            self.warn_out_of_range(x)
        key_sparse, key_quant = split_key(key)
        sparse = self.sparsifier.compress(key_sparse, x)
        values = self.quantizer.compress(key_quant, sparse.wire["values"])
        return dataclasses.replace(sparse, wire={**sparse.wire, "values": values})

    def decompress(self, payload):
        values = self.quantizer.decompress(payload.wire["values"])
        return self.sparsifier.decompress(
            dataclasses.replace(payload, wire={**payload.wire, "values": values})
        )

    def omega(self, d):
        if not self.unbiased:
            return None
        k = self.sparsifier.slots(d)
        return (1.0 + self.quantizer.omega(k)) * (1.0 + self.sparsifier.omega(d)) - 1.0

    def unbiased_range(self, d, dtype=jnp.float32):
        """``min(r_q, r_s / g)``: the quantiser's range on the ``k`` kept values ``r_q``,
        and the sparsifier's ``r_s`` (random-k: ``max k/d``) over the quantiser's
        ``decode_growth`` ``g`` (``max|decode| / max|x|``; natural compression's is 2), as
        the sparsifier rescales the quantised values.

        ``None`` where either range is not established or the quantiser states no
        growth.  ``chain(rand_k(ratio=0.5), natural())`` in float16 on 64 entries: 16376
        (3e4 is rounded to 32768 or 65536 by natural and doubled: 65536 saturates).
        """
        if not self.unbiased:
            return None
        k = self.sparsifier.slots(d)
        r_s = self.sparsifier.unbiased_range(d, dtype)
        r_q = self.quantizer.unbiased_range(k, dtype)
        growth = getattr(self.quantizer, "decode_growth", None)
        if r_s is None or r_q is None or growth is None:
            return None
        return min(r_q, r_s / growth)

    def delta(self, d):
        if self.sparsifier.unbiased or d == 0:
            return None if d else 1.0
        k = self.sparsifier.slots(d)
        if self.quantizer.unbiased:
            omega = self.quantizer.omega(k)
            kept = None if omega is None or omega >= 1 else 1.0 - omega
        else:
            kept = self.quantizer.delta(k)
        return None if kept is None else kept * self.sparsifier.delta(d)

    def bits(self, shape, dtype=jnp.float32):
        d = math.prod(shape)
        k = self.sparsifier.slots(d)
        return (
            self.sparsifier.bits(shape, dtype)
            - self.sparsifier.value_bits(d, dtype)
            + self.quantizer.bits((k,), dtype)
        )


@dataclasses.dataclass(frozen=True)
class Scaled(Wrapper):
    """``gamma * inner(x)``.  See :func:`scaled`."""

    gamma: float = 1.0

    @property
    def unbiased(self):  # type: ignore[override]
        return self.inner.unbiased and self.gamma == 1.0

    def compress(self, key, x):
        return self.inner.compress(key, x)

    def decompress(self, payload):
        y = self.inner.decompress(payload)
        return (self.gamma * y.astype(jnp.float32)).astype(y.dtype)

    def omega(self, d):
        return self.inner.omega(d) if self.unbiased else None

    def unbiased_range(self, d, dtype=jnp.float32):
        return self.inner.unbiased_range(d, dtype) if self.unbiased else None

    def delta(self, d):
        if self.gamma == 1.0:
            return self.inner.delta(d)
        if not self.inner.unbiased:
            return None
        # E||g C(x) - x||^2 = (g^2 (1 + omega) - 2 g + 1) ||x||^2 for unbiased C.
        delta = 2.0 * self.gamma - self.gamma**2 * (1.0 + self.inner.omega(d))
        return delta if delta > 0 else None

    def bits(self, shape, dtype=jnp.float32):
        return self.inner.bits(shape, dtype)


def _check_compressor(value, name):
    if not isinstance(value, Compressor):
        raise ValueError(f"{name} must be a compjax compressor, got {value!r}")


def blockwise(comp: Compressor, block_size: int) -> Blockwise:
    """Apply ``comp`` independently to consecutive blocks of ``block_size`` entries.

    The flattened array is cut into ``d // block_size`` full blocks (compressed
    under ``jax.vmap`` with independent keys) and a shorter tail block if
    ``block_size`` does not divide ``d``; nothing is padded, so the wire holds
    exactly the blocks' payloads.  ``blockwise(terngrad(), b)`` sends one
    scaler per block; ``blockwise(qsgd(s), b)`` equals ``qsgd(s, bucket_size=b)``
    in distribution.

    Theory: unbiased iff ``comp`` is; ``omega`` is the largest of the blocks'
    and ``delta`` the smallest (errors add over disjoint blocks).

    Args:
      comp: the compressor applied to each block.
      block_size: entries per block, ``>= 1``.

    Returns:
      A :class:`Blockwise` compressor whose payload holds ``"blocks"`` (``comp``'s
      payload of one block, each array with a leading axis over the full
      blocks; absent when ``d < block_size``) and ``"tail"`` (``comp``'s payload
      of the last ``d % block_size`` entries; absent when there are none); it
      decodes each block with ``comp`` and lays them end to end.

    Raises:
      ValueError: ``comp`` is not a compressor or ``block_size < 1``.
    """
    _check_compressor(comp, "comp")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return Blockwise(inner=comp, block_size=block_size)


def chain(sparsifier: Sparsifier, quantizer: Compressor) -> Chain:
    """Sparsify with ``sparsifier``, then compress the kept values with ``quantizer``.

    E.g. ``chain(top_k(ratio=0.01), qsgd(levels=16))``: int32 indices plus the
    quantised values' payload.

    Theory (``k`` kept of ``d``): with unbiased parts,
    ``omega = (1 + omega_q(k)) (1 + omega_s(d)) - 1``.  With a contractive
    sparsifier (top-k, unscaled random-k) the error is at most
    ``||x||^2 - c ||v||^2 <= (1 - c delta_s) ||x||^2`` where ``v`` are the kept
    values and ``c = delta_q(k)`` (biased quantiser) or ``1 - omega_q(k)``
    (unbiased quantiser with ``omega_q < 1``), so ``delta = c delta_s``.

    Range of unbiasedness: ``min(r_q(k), r_s(d) / g)`` (:meth:`Chain.unbiased_range`),
    ``g`` the quantiser's ``decode_growth``; a concrete input beyond it warns
    (``UnbiasedRangeWarning``): the rescaled quantised values saturate.

    Args:
      sparsifier: ``top_k(...)`` or ``rand_k(...)``: which entries are sent.
      quantizer: the compressor of the ``k`` kept values (as a 1-D array).

    Returns:
      A :class:`Chain` compressor whose payload is ``sparsifier``'s with its
      ``"values"`` replaced by ``quantizer``'s payload of them; it decodes the
      values with ``quantizer``, then places them as ``sparsifier`` does.

    Raises:
      ValueError: ``sparsifier`` is not ``top_k``/``rand_k`` or ``quantizer``
        is not a compressor.
    """
    if not isinstance(sparsifier, Sparsifier):
        raise ValueError(f"sparsifier must be top_k(...) or rand_k(...), got {sparsifier!r}")
    _check_compressor(quantizer, "quantizer")
    return Chain(sparsifier=sparsifier, quantizer=quantizer)


def scaled(comp: Compressor, gamma: float) -> Scaled:
    """``gamma * comp(x)``.

    For an unbiased ``comp`` with constant ``omega``,
    ``E||gamma C(x) - x||^2 = (gamma^2 (1 + omega) - 2 gamma + 1) ||x||^2``, so
    ``delta = 2 gamma - gamma^2 (1 + omega)``; ``gamma = 1/(omega + 1)`` gives the
    largest, ``delta = 1/(omega + 1)``.

    Args:
      comp: the compressor whose decode is scaled.
      gamma: the factor, a positive finite number.

    Returns:
      A :class:`Scaled` compressor whose payload is ``comp``'s (the same bits);
      it decodes to ``gamma`` times ``comp``'s decode, computed in float32 and
      cast back to the input's dtype.

    Raises:
      ValueError: ``comp`` is not a compressor or ``gamma`` is not positive.
    """
    _check_compressor(comp, "comp")
    if not (isinstance(gamma, int | float) and gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"gamma must be a positive finite number, got {gamma!r}")
    return Scaled(inner=comp, gamma=float(gamma))
