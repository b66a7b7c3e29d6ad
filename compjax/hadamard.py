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

from compjax.compressor import random_bits


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def fwht(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform along the last axis (length a power of two).

    Equals ``x @ scipy.linalg.hadamard(n) / sqrt(n)``; ``fwht(fwht(x)) == x``
    up to rounding.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the last axis must have a power-of-two length, got {n}")
    if n == 0:
        return x
    batch = x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*batch, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*batch, n)
        h *= 2
    return x * jnp.asarray(n**-0.5, x.dtype)


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
