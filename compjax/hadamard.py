"""The fast Walsh-Hadamard transform and randomized Hadamard rotations.

``fwht(x)`` is ``H x / sqrt(n)`` with ``H`` the Sylvester Hadamard matrix of
order ``n = 2^k`` (``scipy.linalg.hadamard(n)``): orthonormal and symmetric,
hence its own inverse.  It runs as a few matrix products with small Hadamard
matrices (``H_n = H_(f_1) (x) ... (x) H_(f_p)``), never a dense ``n x n``
matrix: each product contracts the leading index digit and moves it last,
one pass over memory and ``f`` multiply-adds per entry.  On a CPU the
factors are at most ``H_32`` (``2^24`` entries: 5 passes, four of 32
multiply-adds per entry and one of 16), on an accelerator ``H_64`` (4
passes of 64).  Either way these are XLA's matrix-multiply kernels,
several times faster on a CPU than ``log2 n`` butterfly stages of one
addition each (measured in ``make bench``'s Hadamard row).

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

import functools

import jax
import jax.numpy as jnp

from compjax.draws import counts_entries, hash_counters, random_bits, seed_of


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


#: The sign bit of a float32, as uint32.
_SIGN_BIT = 0x80000000

#: Most index bits one matrix product of the transform handles on a CPU (``H_32``).  EDEN's
#: 1-bit compress plus decompress on the 2-core AMD EPYC (2026-11-28; one process,
#: interleaved, 7 rounds) took, for ``2^24`` entries, 400 ms with ``H_32`` factors, 354 with
#: ``H_16``, 374 with ``H_8`` and 560 with ``H_64``; for the ResNet-50 tree 600, 565, 628 and
#: 746 ms.  On the 2-core Intel Xeon (2026-11-27) EDEN's 3-round rotation of ``2^24``
#: entries took 213 ms with ``H_32``, 254 with ``H_16`` and 209 with ``H_64``: ``H_32`` is
#: within 2% of the best on one machine and 13% on the other.
_CPU_FACTOR_BITS = 5
#: The same on an accelerator (GPU, TPU): ``H_64``, fewer passes over memory.
_FACTOR_BITS = 6


def fwht(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform along the last axis (length a power of two).

    Equals ``x @ scipy.linalg.hadamard(n) / sqrt(n)`` up to float32 rounding;
    ``fwht(fwht(x)) == x`` up to rounding.  As :func:`_products` of small
    Hadamard matrices, at most ``H_32`` on a CPU and ``H_64`` on an
    accelerator (``jax.lax.platform_dependent``: the same transform, rounded
    differently by each backend's factors).
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the last axis must have a power-of-two length, got {n}")
    if n == 0:
        return x
    return jax.lax.platform_dependent(
        x,
        cpu=functools.partial(_products, most=_CPU_FACTOR_BITS),
        default=functools.partial(_products, most=_FACTOR_BITS),
    )


def _products(x: jax.Array, most: int) -> jax.Array:
    """:func:`fwht` as products with Hadamard matrices of at most ``2**most`` rows.

    With ``n = f_1 ... f_p`` (each ``f <= 2**most``, :func:`_factor_bits`)
    and ``H_n = H_(f_1) (x) ... (x) H_(f_p)``, each product contracts the
    leading index digit of every row with ``H_f`` and moves the transformed
    digit last, so after ``p`` products the order is natural again: ``p``
    reads and writes of the array instead of ``log2 n``.
    """
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    for bits in _factor_bits(n.bit_length() - 1, most):
        h = jnp.asarray(_sylvester(bits), x.dtype)
        rows = jax.lax.dot_general(
            rows.reshape(rows.shape[0], 1 << bits, -1),
            h,
            (((1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
        ).reshape(rows.shape[0], n)
    return (rows * jnp.asarray(n**-0.5, x.dtype)).reshape(x.shape)


def _factor_bits(bits: int, most: int) -> list[int]:
    """``bits`` split into as few parts of at most ``most`` as can be, as even."""
    parts = -(-bits // most)
    return [bits // parts + (i < bits % parts) for i in range(parts)]


@functools.cache
def _sylvester(bits: int):
    """The Sylvester Hadamard matrix of order ``2**bits`` (entries +-1), as nested tuples."""
    h = [[1.0]]
    for _ in range(bits):
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return tuple(tuple(row) for row in h)


def _flip(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` with its sign flipped where the top bit of ``bits`` (uint32) is set:
    ``x * (1 - 2 (bits >> 31))``, exactly, as a sign-bit xor."""
    word = jax.lax.bitcast_convert_type(x, jnp.uint32) ^ (bits & jnp.uint32(_SIGN_BIT))
    return jax.lax.bitcast_convert_type(word, x.dtype)


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


def _sign_draws(key, n: int, rounds: int):
    """Per round, the words of :func:`random_signs`' stream as a function of the index:
    round ``k``, entry ``i`` is counter ``k n + i`` of :func:`compjax.draws.counter_bits`."""
    seed = seed_of(key)

    def draw(k):
        return lambda index: hash_counters(seed, index + jnp.uint32(k * n))

    return [draw(k) for k in range(rounds)]


def _fuses_signs(key, x: jax.Array, rounds: int) -> bool:
    """Whether :func:`rotate_key` draws the signs from the entries' indices (no sign array)."""
    float32 = x.dtype == jnp.float32  # the flips are sign-bit xors of 32-bit words
    return float32 and x.ndim == 1 and counts_entries(key, rounds * x.shape[-1])


def rotate_key(key, x: jax.Array, rounds: int = 1) -> jax.Array:
    """``rotate(random_signs(key, n, rounds), x)``, the same bits, without the signs in memory.

    For a float32 vector and a counter-drawn key each round's signs are
    sign-bit flips drawn from the entries' indices
    (:func:`compjax.draws.counter_bits`), computed elementwise as the vector
    is read: no ``(rounds, n)`` sign array is drawn, stored and read again.
    """
    if not _fuses_signs(key, x, rounds):
        return rotate(random_signs(key, x.shape[-1], rounds), x)
    index = jax.lax.iota(jnp.uint32, x.shape[0])
    for draw in _sign_draws(key, x.shape[0], rounds):
        x = fwht(_flip(x, draw(index)))
    return x


def unrotate_key(key, y: jax.Array, rounds: int = 1) -> jax.Array:
    """``unrotate(random_signs(key, n, rounds), y)``, the inverse of :func:`rotate_key`, the
    signs drawn from the indices in the same way."""
    if not _fuses_signs(key, y, rounds):
        return unrotate(random_signs(key, y.shape[-1], rounds), y)
    index = jax.lax.iota(jnp.uint32, y.shape[0])
    for draw in _sign_draws(key, y.shape[0], rounds)[::-1]:
        y = _flip(fwht(y), draw(index))
    return y
