"""Random draws of compjax's stochastic compressors: one 32-bit word per entry, from a key.

For threefry keys (JAX's default) the key's 64 bits, mixed by three Feistel
rounds (:func:`seed_of`), are the array's seed, and one round of a bijective
integer hash of each entry's index
(:func:`counter_bits`) expands it to one word per entry: exactly uniform at
each entry, fused into the loop that consumes it, where a threefry draw per
entry costs several times a memory copy.  Since entry ``i``'s word depends
only on ``i``, a stretch of an array (a piece of a gradient bucket,
:mod:`compjax.pieces`) draws its words alone, with ``offset``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from compjax.numerics import divide, round_to

#: Largest array size the counter-based sampler handles (a uint32 counter per entry).
_MAX_COUNTER = 2**32


#: ``triple32``'s steps ``h ^= h >> s; h *= m`` as ``(s, m)``, then ``h ^= h >> 14``.
_TRIPLE32 = ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB))


def mix32(h: jax.Array) -> jax.Array:
    """A bijection of uint32 with full avalanche (Wellons' ``triple32``).

    Each step is invertible: ``h ^ (h >> s)`` for ``s >= 1`` (the top ``s``
    bits are unchanged and determine the next ones) and multiplication by an
    odd constant modulo ``2**32``.  Three multiplies, against two for
    ``lowbias32``, whose single round over consecutive counters fails
    ``tests/test_fast_random.py``'s byte and lag tests; one round of this
    passes them.
    """
    for shift, multiplier in _TRIPLE32:
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    return h ^ (h >> 14)


#: Round keys of :func:`seed_of`'s Feistel rounds (odd constants: the golden ratio's and
#: the square roots of 2 and 3's fractional bits).
_SEED_ROUNDS = (0x9E3779B9, 0x6A09E667, 0xBB67AE85)


def seed_of(key) -> jax.Array:
    """The 64-bit seed ``(s0, s1)`` (uint32) of a threefry key's counter draws.

    The key's own 64 bits through three Feistel rounds ``(l, r) -> (r, l ^
    mix32(r ^ c))``: a bijection, so a uniform key gives a uniform seed and
    independent keys independent seeds (the keys compjax draws with come
    from ``jax.random.split`` and ``fold_in``), and with :func:`mix32`'s
    avalanche keys that differ in a bit (``key(0)``, ``key(1)``) give
    unrelated seeds.  A threefry draw per array did the same through a loop
    that XLA's CPU backend runs in several thunks: per leaf of a 161-leaf
    tree, about 5 ms of a compress.
    """
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    left, right = data[..., 0], data[..., 1]
    for c in _SEED_ROUNDS:
        left, right = right, left ^ mix32(right ^ jnp.uint32(c))
    return jnp.stack([left, right], axis=-1)


def hash_counters(seed: jax.Array, counters: jax.Array) -> jax.Array:
    """32 random bits for each uint32 counter under a 64-bit ``seed = (s0, s1)``:
    ``mix32((i + s0) ^ s1)`` for counter ``i``.

    One round of the hash.  For a fixed ``i`` and ``s1`` the map
    ``s0 -> bits`` is a bijection of uint32 (``+ s0``, ``^ s1`` and
    :func:`mix32` each are), so a uniform ``s0`` gives exactly uniform bits at
    every counter.  For a fixed counter, the inputs ``(i + s0) ^ s1`` of two
    independent seeds are independent and uniform, so two workers' bits at the
    same entry are independent, which is all the theory of the stochastic
    compressors uses (unbiasedness and the variance per entry; a squared
    norm or a mean over workers has no cross terms between entries).  Until
    2026-11-27 it was two rounds of ``lowbias32``,
    ``mix32(mix32(i + s0) ^ s1)``: 4 multiplies where this makes 3, a
    Bernoulli draw of ``2^22`` entries 2.1 against 1.5 ms on the Intel Xeon.
    """
    return mix32((counters + seed[0]) ^ seed[1])


def counter_bits(seed: jax.Array, n: int, offset: int = 0) -> jax.Array:
    """32 random bits for each of the counters ``offset .. offset+n-1`` under a 64-bit ``seed``.

    Entry ``i`` is ``mix32((i + s0) ^ s1)`` with ``seed = (s0, s1)``
    (uint32, ``n <= 2**32``; :func:`hash_counters`): a handful of integer
    operations per entry that XLA fuses into the loop that consumes the bits,
    where a threefry draw per entry costs several times a memory copy.  A
    uniform ``s0`` gives exactly uniform 32 bits at every entry, and two
    independent seeds give independent bits at the same entry.  ``offset``
    draws a stretch of the same stream: entries ``[o, o + n)`` of an array are
    drawn by ``counter_bits(seed, n, o)`` exactly as by the whole array's draw
    (:mod:`compjax.pieces`).
    """
    i = jax.lax.iota(jnp.uint32, n)
    if offset:
        i = i + jnp.uint32(offset)
    return hash_counters(seed, i)


def uses_threefry(key) -> bool:
    """Whether ``key`` is a threefry key (typed, or a raw key of the default impl)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32"
    return jax.config.jax_default_prng_impl == "threefry2x32" and key.shape[-1:] == (2,)


def counts_entries(key, n: int) -> bool:
    """Whether :func:`random_bits` draws ``n`` entries of ``key`` from counters (so that a
    stretch of them can be drawn alone, with ``offset``)."""
    return uses_threefry(key) and n <= _MAX_COUNTER


def random_bits(key, shape, offset: int | jax.Array = 0) -> jax.Array:
    """Uniform uint32 draws of ``shape``, one per entry, from a PRNG ``key``.

    For threefry keys (JAX's default) the key's own bits give a 64-bit seed
    (:func:`seed_of`) and :func:`counter_bits` expands it to one 32-bit word per entry: exactly
    uniform at each entry and independent across independent keys (workers'
    ``fold_in`` keys), at a fraction of a per-entry threefry draw.  Any other
    key implementation (``rbg``, or a custom one such as the scripted keys of
    ``proofs_checks``) draws with ``jax.random.bits``, so an implementation
    that chooses the bits controls every entry's draw.

    ``offset``: the entries are entries ``offset ..`` of a larger array drawn
    with the same key (counter-drawn keys only, :func:`counts_entries`); or
    a uint32 array of each entry's counter (of ``shape``, or broadcasting to
    it): the draws of those entries of the larger array, wherever they lie
    (threefry keys only).
    """
    shape = tuple(shape)
    n = math.prod(shape)
    if not isinstance(offset, int):  # each entry's own counter
        if not uses_threefry(key):
            raise ValueError("counters: only counter-drawn (threefry) keys draw given entries")
        seed = seed_of(key)
        return hash_counters(seed, jnp.broadcast_to(jnp.asarray(offset, jnp.uint32), shape))
    if counts_entries(key, offset + n):
        seed = seed_of(key)
        return counter_bits(seed, n, offset).reshape(shape)
    if offset:
        raise ValueError(f"offset={offset}: only counter-drawn (threefry) keys draw a stretch")
    return jax.random.bits(key, shape, jnp.uint32)


def bernoulli(key, p: jax.Array, offset: int | jax.Array = 0, unit: bool = False) -> jax.Array:
    """Independent draws, true with probability ``p`` (float32, clipped to ``[0, 1]``).

    Compares 32 random bits (:func:`random_bits`) with ``p * 2**32``: the
    probability is exact for ``p >= 2**-8`` (where ``p * 2**32`` is an
    integer) and otherwise off by less than ``2**-32``.
    ``jax.random.uniform`` would carry only 23 random bits and round every
    probability up to a multiple of ``2**-23``.  ``p = 1`` is always true and
    ``p = 0`` always false.  ``offset`` as in :func:`random_bits`.

    ``unit``: the caller guarantees ``0 <= p <= 1`` (a stochastic rounding's
    fraction; NaN, from a non-finite input, draws arbitrarily), so the clip
    is left out: below 1, ``p * 2**32`` is below ``2**32`` and converts
    exactly, and ``p = 1`` is true by the last comparison.  Five fewer vector
    instructions per 8 entries in the rounding's loop on a CPU.
    """
    bits = random_bits(key, p.shape, offset)
    p = p.astype(jnp.float32)
    if unit:
        threshold = (p * 2.0**32).astype(jnp.uint32)  # out of range only at p = 1
    else:
        scaled = jnp.clip(p, 0.0, 1.0) * 2.0**32
        threshold = jnp.minimum(scaled, 2.0**32 - 256).astype(jnp.uint32)  # float32 < 2^32
    return (bits < threshold) | (p >= 1.0)


def stochastic_round(key, y: jax.Array, dtype, offset: int = 0) -> jax.Array:
    """Float32 ``y`` rounded onto ``dtype``'s grid at random, unbiased, as float32.

    Each entry becomes one of its two neighbours in ``dtype`` with the
    probabilities that keep ``E = y``, so the cast in :meth:`Compressor.finish`
    is exact.  The identity for float32; values beyond the dtype's largest
    finite value saturate there (biased).  ``offset`` as in :func:`random_bits`.
    """
    if np.dtype(dtype).itemsize >= 4:
        return y
    near = round_to(y, dtype)
    limit = jnp.asarray(jnp.finfo(dtype).max, dtype)
    toward = jnp.nextafter(near.astype(dtype), jnp.where(y > near, limit, -limit))
    other = toward.astype(jnp.float32)
    p = divide(jnp.abs(y - near), jnp.abs(other - near))
    return jnp.where(bernoulli(key, p, offset, unit=True), other, near)  # |y - near| <= gap


def raw_key(key) -> jax.Array:
    """The uint32 data of a PRNG key (typed keys are unwrapped; raw keys pass through).

    Raw keys are plain arrays: collectives and serialisation handle them like
    any other.  ``jax.random`` functions accept them as legacy threefry keys.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def init_key(seed: int) -> jax.Array:
    """A raw uint32 key (plain array: serialisable, all-gatherable)."""
    return raw_key(jax.random.key(seed))


def step_keys(key: jax.Array, num: int) -> tuple[jax.Array, list[jax.Array]]:
    """The next state key and one key per leaf for this step."""
    next_key, step = jax.random.split(key)
    return next_key, list(jax.random.split(step, num))
