"""The orthonormal DCT-II, applied chunk by chunk (DeMo's transform).

``dct_matrix(c)`` is the ``c x c`` orthonormal DCT-II basis ``D``, with
``D[k, n] = s_k cos(pi (2n + 1) k / (2c))``, ``s_0 = sqrt(1/c)`` and
``s_k = sqrt(2/c)`` otherwise: ``D @ x`` is ``scipy.fft.dct(x, norm='ortho')``
and, ``D`` being orthogonal, ``D.T @ y`` is its inverse.

A matrix of shape ``(R, C)`` is cut into ``h x w`` chunks, ``h`` the largest
divisor of ``R`` and ``w`` the largest divisor of ``C`` not above a target
size (:func:`chunk_size`), and each chunk gets its own 2-D DCT: two small
matmuls (an ``einsum`` with ``D_h`` and ``D_w``), never a dense transform of
the whole leaf.  A vector is cut into chunks of the largest divisor of its
length, each with a 1-D DCT.  Every function here is pure; the bases are
built in numpy at trace time (static shapes).

References:
  Ahmed, Natarajan, Rao, "Discrete Cosine Transform", IEEE Trans. Computers,
  1974.
  Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
  arXiv:2411.19870, 2024 (the chunking rule and the chunked 2-D DCT).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


@functools.cache
def dct_matrix(c: int) -> np.ndarray:
    """The ``(c, c)`` orthonormal DCT-II basis (float64): ``dct_matrix(c) @ x`` is the DCT of ``x``.

    Raises:
      ValueError: ``c < 1``.
    """
    if c < 1:
        raise ValueError(f"the DCT size must be >= 1, got {c}")
    k = np.arange(c)[:, None]
    n = np.arange(c)[None, :]
    basis = np.cos(np.pi * (2 * n + 1) * k / (2 * c)) * np.sqrt(2.0 / c)
    basis[0] /= np.sqrt(2.0)
    basis.setflags(write=False)
    return basis


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (DeMo's chunking rule).

    Raises:
      ValueError: ``n < 1`` or ``target < 1``.
    """
    if n < 1 or target < 1:
        raise ValueError(f"chunk_size needs n >= 1 and target >= 1, got n={n}, target={target}")
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for q in (d, n // d):
                if best < q <= target:
                    best = q
    return best


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(R, C)`` matrix a leaf of ``shape`` is transformed as.

    A scalar is ``(1, 1)``, a vector of length ``d`` is ``(1, d)`` (so its
    chunks are 1-D: the row chunk has size 1), a matrix itself, and a leaf
    of more dimensions (a convolution kernel, an attention projection)
    ``(prod(shape[:-1]), shape[-1])``.
    """
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (math.prod(shape[:-1]), shape[-1])


def to_blocks(x: jax.Array, h: int, w: int) -> jax.Array:
    """``(R, C)`` into ``(R/h, C/w, h, w)``: chunk ``(i, j)`` is ``x[i h:(i+1) h, j w:(j+1) w]``."""
    r, c = x.shape
    return x.reshape(r // h, h, c // w, w).transpose(0, 2, 1, 3)


def from_blocks(blocks: jax.Array) -> jax.Array:
    """Inverse of :func:`to_blocks`."""
    rows, cols, h, w = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(rows * h, cols * w)


def _bases(h: int, w: int, dtype) -> tuple[jax.Array, jax.Array]:
    return jnp.asarray(dct_matrix(h), dtype), jnp.asarray(dct_matrix(w), dtype)


def dct2(blocks: jax.Array) -> jax.Array:
    """The orthonormal 2-D DCT-II of every ``h x w`` chunk (the last two axes)."""
    dh, dw = _bases(*blocks.shape[-2:], blocks.dtype)
    return jnp.einsum("ap,bq,...pq->...ab", dh, dw, blocks, precision=_HIGHEST)


def idct2(coeffs: jax.Array) -> jax.Array:
    """Inverse of :func:`dct2` (the orthonormal DCT-III of every chunk)."""
    dh, dw = _bases(*coeffs.shape[-2:], coeffs.dtype)
    return jnp.einsum("ap,bq,...ab->...pq", dh, dw, coeffs, precision=_HIGHEST)


def chunked_dct(x: jax.Array, target: int) -> jax.Array:
    """The DCT of each chunk of a vector or a matrix.

    Args:
      x: shape ``(d,)`` or ``(R, C)``.
      target: the chunk size aimed at (:func:`chunk_size`).

    Returns:
      ``(d/h, h)`` (one 1-D DCT per row) for a vector; ``(R/h, C/w, h, w)``
      (one 2-D DCT per chunk ``(i, j)``) for a matrix.
    """
    if x.ndim == 1:
        (d,) = x.shape
        return dct2(to_blocks(x[None], 1, chunk_size(d, target)))[0, :, 0]
    if x.ndim != 2:
        raise ValueError(f"chunked_dct takes a vector or a matrix, got shape {x.shape}")
    r, c = x.shape
    return dct2(to_blocks(x, chunk_size(r, target), chunk_size(c, target)))


def chunked_idct(coeffs: jax.Array) -> jax.Array:
    """Inverse of :func:`chunked_dct` (the chunked orthonormal DCT-III)."""
    if coeffs.ndim == 2:
        return from_blocks(idct2(coeffs[None, :, None]))[0]
    if coeffs.ndim != 4:
        raise ValueError(f"chunked_idct takes (m, h) or (R/h, C/w, h, w), got {coeffs.shape}")
    return from_blocks(idct2(coeffs))
