"""The fast Walsh-Hadamard transform and randomized Hadamard rotations.

``fwht(x)`` is ``H x / sqrt(n)`` with ``H`` the Sylvester Hadamard matrix of
order ``n = 2^k`` (``scipy.linalg.hadamard(n)``): orthonormal and symmetric,
hence its own inverse.  It runs in ``k`` butterfly stages of ``n`` additions
each (``O(n log n)``), each stage a reshape of the last axis to
``(n / 2h, 2, h)``, never a dense matrix.

A randomized Hadamard rotation is ``R x = fwht(D x)`` with ``D`` a diagonal of
random signs; ``rounds`` of them (``R = H D_r ... H D_1``) bring the rotated
coordinates closer to those of a uniformly random rotation for structured
(sparse) inputs.  The signs come from a PRNG key, so anyone holding the key
regenerates ``R`` without it being sent.

References:
  Ailon, Chazelle, "The Fast Johnson-Lindenstrauss Transform and Approximate
  Nearest Neighbors", SIAM J. Comput. 2009 (randomized Hadamard).
  Vargaftik et al., "DRIVE: One-bit Distributed Mean Estimation", NeurIPS
  2021 (arXiv:2105.08339).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from compjax.draws import random_bits


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


#: Entries of one block of the blocked transform (:func:`fwht` on long vectors): 256 KiB of
#: float32, so a block's butterfly stages run in the core's cache.
_BLOCK = 2**16


def fwht(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform along the last axis (length a power of two).

    Equals ``x @ scipy.linalg.hadamard(n) / sqrt(n)``; ``fwht(fwht(x)) == x``
    up to rounding.  A vector longer than ``2**16`` is transformed in two
    blocked passes over memory instead of one pass per stage (the same
    additions in the same order, so the same bits).
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the last axis must have a power-of-two length, got {n}")
    if n == 0:
        return x
    scale = jnp.asarray(n**-0.5, x.dtype)
    if x.ndim == 1 and n > _BLOCK:
        return _fwht_blocked(x, scale)
    batch = x.shape[:-1]
    return (_butterfly(x.reshape(-1, n, 1)) * scale).reshape(*batch, n)


def _butterfly(x: jax.Array) -> jax.Array:
    """Every butterfly stage along the middle axis of ``(batch, length, inner)``, unscaled.

    Stage ``h`` pairs ``i`` with ``i + h`` along that axis, ``(a, b) -> (a + b, a - b)``,
    for ``h = 1, 2, 4, ...``; the inner axis rides along (contiguous, vectorised).
    """
    batch, length, inner = x.shape
    h = 1
    while h < length:
        pairs = x.reshape(batch, length // (2 * h), 2, h * inner)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = jnp.stack([a + b, a - b], axis=2)
        h *= 2
    return x.reshape(batch, length, inner)


def _fwht_blocked(x: jax.Array, scale: jax.Array) -> jax.Array:
    """:func:`fwht` of a long vector in two passes over memory.

    With ``n = A B`` and ``X = x.reshape(A, B)``, ``H_n x = vec(H_A X H_B)``
    (``H_n = H_A (x) H_B``): the first pass transforms blocks of rows (the
    stages ``h < B``), the second blocks of columns (the stages ``h >= B``),
    each block in cache, updated in place in a loop.  Per entry these are the
    stages of the one-pass-per-stage butterfly, in the same order.
    """
    n = x.shape[0]
    log2 = n.bit_length() - 1
    cols_total = 1 << (log2 - log2 // 2)
    rows_total = n // cols_total
    rows = max(1, min(rows_total, _BLOCK // cols_total))
    cols = max(1, min(cols_total, _BLOCK // rows_total))
    matrix = x.reshape(rows_total, cols_total)

    def row_block(i, matrix):
        block = jax.lax.dynamic_slice_in_dim(matrix, i * rows, rows, 0)
        block = _butterfly(block.reshape(rows, cols_total, 1)).reshape(rows, cols_total)
        return jax.lax.dynamic_update_slice_in_dim(matrix, block, i * rows, 0)

    def col_block(j, matrix):
        block = jax.lax.dynamic_slice_in_dim(matrix, j * cols, cols, 1)
        block = _butterfly(block.reshape(1, rows_total, cols)).reshape(rows_total, cols)
        return jax.lax.dynamic_update_slice_in_dim(matrix, block * scale, j * cols, 1)

    matrix = jax.lax.fori_loop(0, rows_total // rows, row_block, matrix)
    matrix = jax.lax.fori_loop(0, cols_total // cols, col_block, matrix)
    return matrix.reshape(n)


def random_signs(key, n: int, rounds: int = 1) -> jax.Array:
    """``(rounds, n)`` independent random signs ``+-1.0`` (float32) from ``key``."""
    bits = random_bits(key, (rounds, n)) >> 31
    return 1.0 - 2.0 * bits.astype(jnp.float32)


def rotate(signs: jax.Array, x: jax.Array) -> jax.Array:
    """``H D_r ... H D_1 x`` for ``signs = (D_1, ..., D_r)``; ``x`` already padded."""
    for d in signs:
        x = fwht(d * x)
    return x


def unrotate(signs: jax.Array, y: jax.Array) -> jax.Array:
    """The inverse of :func:`rotate`: ``D_1 H ... D_r H y``."""
    for d in signs[::-1]:
        y = d * fwht(y)
    return y
