"""The fast Walsh-Hadamard transform and randomized Hadamard rotations.

``fwht(x)`` is ``H x / sqrt(n)`` with ``H`` the Sylvester Hadamard matrix of
order ``n = 2^k`` (``scipy.linalg.hadamard(n)``): orthonormal and symmetric,
hence its own inverse.  It runs in ``k`` butterfly stages of ``n`` additions
each (``O(n log n)``), never a dense matrix: each stage a product with
``H_2`` that transforms the leading index bit and moves it last
(``H_n = H_2 (x) ... (x) H_2``), so after ``k`` stages the order is natural
again.  On a CPU a long vector is transformed in cache-sized blocks, in two
passes over memory.  On an accelerator (GPU, TPU) the stages are grouped
into a few matrix products with small Hadamard matrices
(``H_n = H_64 (x) ... (x) H_64``), each one pass over memory: the CPU's
sequential loop over blocks would launch thousands of small kernels.

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

from compjax.draws import counts_entries, mix32, random_bits


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


#: Entries of one block of the blocked transform (:func:`fwht` on long vectors): 256 KiB of
#: float32, so a block's stages run in the core's cache.
_BLOCK = 2**16

#: The Hadamard matrix of order 2.
_H2 = ((1.0, 1.0), (1.0, -1.0))

#: The sign bit of a float32, as uint32.
_SIGN_BIT = 0x80000000


#: Most index bits one matrix product of the accelerators' transform handles (``H_64``).
_FACTOR_BITS = 6


def _on_accelerator() -> bool:
    """Whether JAX's default backend is an accelerator (the transform's grouped form)."""
    return jax.default_backend() != "cpu"


def fwht(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform along the last axis (length a power of two).

    Equals ``x @ scipy.linalg.hadamard(n) / sqrt(n)``; ``fwht(fwht(x)) == x``
    up to rounding.  On a CPU a vector longer than ``2**16`` is transformed
    in two blocked passes over memory instead of one pass per stage (the same
    additions in the same order, so the same bits; :func:`_blocked`).  On an
    accelerator the stages run as products with ``H_64`` (:func:`_grouped`):
    the same transform, rounded differently.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"the last axis must have a power-of-two length, got {n}")
    if n == 0:
        return x
    scale = jnp.asarray(n**-0.5, x.dtype)
    if _on_accelerator():
        return _grouped(x)
    if x.ndim == 1 and n > _BLOCK:
        return _blocked(x)
    batch = x.shape[:-1]
    stages = functools.partial(_leading_stages, stages=n.bit_length() - 1)
    return (jax.vmap(stages)(x.reshape(-1, n)) * scale).reshape(*batch, n)


def _leading_stages(x: jax.Array, stages: int) -> jax.Array:
    """``stages`` butterfly stages of a 1-D ``x`` on its leading (most significant) index bits.

    Each stage views ``x`` as ``(2, m)``, pairs ``x[0, j]`` with ``x[1, j]`` and
    writes ``(a + b, a - b)`` as row ``j`` of an ``(m, 2)`` result: a product with
    ``H_2`` that contracts the leading index bit and appends the transformed
    bit last.  After ``s`` stages the ``s`` leading bits are transformed and
    moved behind the others; after all of them the order is the natural one
    (the Kronecker identity ``H_(2^k) = H_2 (x) ... (x) H_2``).  Each stage is
    one product with a 2x2 matrix, which XLA runs as a vectorised loop
    (several times faster on CPU than a reshape-and-stack butterfly).
    """
    h2 = jnp.asarray(_H2, x.dtype)
    for _ in range(stages):
        x = jax.lax.dot_general(
            x.reshape(2, -1), h2, (((0,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST
        )
    return x.reshape(-1)


def _factor_bits(bits: int) -> list[int]:
    """``bits`` split into as few parts of at most :data:`_FACTOR_BITS` as can be, as even."""
    parts = -(-bits // _FACTOR_BITS)
    return [bits // parts + (i < bits % parts) for i in range(parts)]


def _grouped(x: jax.Array) -> jax.Array:
    """:func:`fwht` as a few matrix products, for accelerators.

    With ``n = f_1 ... f_p`` (each ``f <= 64``, :func:`_factor_bits`) and
    ``H_n = H_(f_1) (x) ... (x) H_(f_p)``, each product contracts the leading
    index digit of every row with ``H_f`` and moves the transformed digit
    last (as :func:`_leading_stages` does one bit at a time), so after ``p``
    products the order is natural.  A product reads and writes the array
    once: ``p`` passes (4 for ``2**24`` entries) instead of ``log2 n``.
    """
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    for bits in _factor_bits(n.bit_length() - 1):
        h = jnp.asarray(_sylvester(bits), x.dtype)
        rows = jax.lax.dot_general(
            rows.reshape(rows.shape[0], 1 << bits, -1),
            h,
            (((1,), (0,)), ((), ())),
            precision=jax.lax.Precision.HIGHEST,
        ).reshape(rows.shape[0], n)
    return (rows * jnp.asarray(n**-0.5, x.dtype)).reshape(x.shape)


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


def _natural_index(shape, strides, offset) -> jax.Array:
    """uint32 ``offset + i strides[0] + j strides[1]`` at ``(i, j)`` of a 2-D ``shape``."""
    rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(strides[0])
    cols = jax.lax.broadcasted_iota(jnp.uint32, shape, 1) * jnp.uint32(strides[1])
    return rows + cols + offset


def _transposing_pass(matrix, strides, pre=None, post=None):
    """``(H_rows M)^T`` for ``M = matrix`` of shape ``(rows, cols)``, one column block at a time.

    A block of ``w`` columns (``rows * w <= 2**16`` entries, read with a stride, in
    cache) gets :func:`_leading_stages` over its ``log2(rows)`` row bits, which
    leaves it as ``(w, rows)``: rows ``j w ..`` of the ``(cols, rows)`` result,
    written contiguously.  ``strides`` give each entry's index in the vector
    (``M[r, c]`` is entry ``r strides[0] + c strides[1]``); ``pre`` and
    ``post``, functions of a block and its entries' indices, run on each
    block before and after its stages, fused into the same pass.
    """
    rows, cols = matrix.shape
    width = max(1, min(cols, _BLOCK // rows))
    stages = rows.bit_length() - 1

    def block(_, j):
        col = j * width
        offset = col.astype(jnp.uint32) * jnp.uint32(strides[1])
        values = jax.lax.dynamic_slice_in_dim(matrix, col, width, 1)
        if pre is not None:
            values = pre(values, _natural_index((rows, width), strides, offset))
        values = _leading_stages(values.reshape(-1), stages).reshape(width, rows)
        if post is not None:
            values = post(values, _natural_index((width, rows), strides[::-1], offset))
        return None, values

    _, blocks = jax.lax.scan(block, None, jnp.arange(cols // width, dtype=jnp.int32))
    return blocks.reshape(cols, rows)


def _halves(n: int) -> tuple[int, int]:
    """``(A, B)`` with ``A B = n``, both powers of two, ``A >= B``, as even as possible."""
    log2 = n.bit_length() - 1
    rows = 1 << (log2 - log2 // 2)
    return rows, n // rows


def _blocked(x: jax.Array, draws=(None,), inverse: bool = False) -> jax.Array:
    """:func:`fwht` of a long vector, or rounds of a randomized rotation, in blocked passes.

    With ``n = A B`` and ``X = x.reshape(A, B)``, ``H_n x = vec(H_A X H_B)``
    (``H_n = H_A (x) H_B``): a first :func:`_transposing_pass` gives
    ``(H_A X)^T``, a second ``(H_B (H_A X)^T)^T = H_A X H_B``, scaled by
    ``1 / sqrt(n)`` on its way out: two reads and writes of the vector per
    transform.  Per entry the stages run from the most significant index bit
    to the least, as in the one-piece transform, so the bits are the same.

    ``draws`` has one entry per round: ``None`` (a plain transform) or a
    function of the entries' indices (uint32) giving uint32 words whose top
    bit flips an entry's sign, the diagonal ``D`` of the round.  A round is
    ``H D x``, the flips made in its first pass; with ``inverse`` it is
    ``D H y``, the flips made in its second, after the scaling (the same
    operations per entry as :func:`rotate` and :func:`unrotate`).
    """
    n = x.shape[0]
    rows, cols = _halves(n)
    scale = jnp.asarray(n**-0.5, x.dtype)

    def flipping(draw):
        return lambda values, index: _flip(values, draw(index))

    def scaling(draw):
        if draw is None or not inverse:
            return lambda values, index: values * scale
        return lambda values, index: _flip(values * scale, draw(index))

    for draw in draws:
        first = flipping(draw) if draw is not None and not inverse else None
        y = _transposing_pass(x.reshape(rows, cols), (cols, 1), pre=first)
        x = _transposing_pass(y, (1, cols), post=scaling(draw)).reshape(n)
    return x


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
    seed = jax.random.bits(key, (2,), jnp.uint32)

    def draw(k):
        return lambda index: mix32(mix32(index + (seed[0] + jnp.uint32(k * n))) ^ seed[1])

    return [draw(k) for k in range(rounds)]


def _fuses_signs(key, x: jax.Array, rounds: int) -> bool:
    """Whether :func:`rotate_key` draws the signs inside the blocked passes."""
    n = x.shape[-1]
    float32 = x.dtype == jnp.float32  # the flips are sign-bit xors of 32-bit words
    return float32 and x.ndim == 1 and n > _BLOCK and counts_entries(key, rounds * n)


def rotate_key(key, x: jax.Array, rounds: int = 1) -> jax.Array:
    """``rotate(random_signs(key, n, rounds), x)``, the same bits, without the signs in memory.

    On a long vector (past ``2**16`` entries, counter-drawn key) each round's
    signs are drawn from their counters inside the first blocked pass of the
    round's transform: a round reads and writes the vector twice, where
    drawing ``D``, multiplying by it and transforming takes four passes.
    """
    if not _fuses_signs(key, x, rounds):
        return rotate(random_signs(key, x.shape[-1], rounds), x)
    draws = _sign_draws(key, x.shape[0], rounds)
    if _on_accelerator():  # the flips are elementwise, drawn from the index: no sign array
        index = jax.lax.iota(jnp.uint32, x.shape[0])
        for draw in draws:
            x = fwht(_flip(x, draw(index)))
        return x
    return _blocked(x, draws)


def unrotate_key(key, y: jax.Array, rounds: int = 1) -> jax.Array:
    """``unrotate(random_signs(key, n, rounds), y)``, the inverse of :func:`rotate_key`, the
    signs drawn inside each round's second blocked pass."""
    if not _fuses_signs(key, y, rounds):
        return unrotate(random_signs(key, y.shape[-1], rounds), y)
    draws = _sign_draws(key, y.shape[0], rounds)[::-1]
    if _on_accelerator():
        index = jax.lax.iota(jnp.uint32, y.shape[0])
        for draw in draws:
            y = _flip(fwht(y), draw(index))
        return y
    return _blocked(y, draws, inverse=True)
