"""The scatter half of a compressed all-reduce: each worker ends with the sum of its block.

The pieces :mod:`compjax.exchange` builds its exchanges from: a flat array
cut into ``n`` equal blocks (the last padded with zeros), and three ways for
worker ``j`` to receive the sum over workers of block ``j``:

* :func:`scatter`: each worker compresses its ``n`` blocks with keys of its
  own, ``all_to_all`` hands block ``j`` to worker ``j``, which decodes and
  adds the ``n`` messages (:func:`decoded_sum`);
* :func:`summed_scatter`: a ``summable`` compressor's integer codes for one
  shared scale, reduce-scattered (``psum_scatter``);
* :func:`linear_scatter`: a ``linear`` compressor's payloads for a shared
  key, reduce-scattered and decoded once.

:func:`shared_scales` agrees on the summable scales of many arrays in one
``pmax`` (sharded training reduce-scatters every leaf in one step).

``"scatter_gather"`` follows :func:`scatter` with a compressed all-gather;
:func:`compjax.exchange.compressed_reduce_scatter` (sharded training) stops
after it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from compjax import axes, collectives
from compjax.axes import worker_index
from compjax.compressor import Compressor
from compjax.payload import Payload
from compjax.recording import record

#: Workers' messages decoded per iteration of the summing loop.
UNROLL_WORKERS = 8


def decoded_sum(comp: Compressor, gathered: Payload, n: int, scale: float = 1.0) -> jax.Array:
    """``sum_i scale comp.decompress(gathered[i])`` over the ``n`` gathered payloads, in float32.

    The messages are decoded and added one worker at a time, so one decoded
    message is in memory rather than ``n``, and the sum is a chain of
    elementwise adds.  (Decoding all of them with ``vmap`` and reducing over
    the workers' axis gives XLA's CPU backend a reduction over a leading axis,
    which it hands to a YNNPACK fusion running about 20 times slower than
    the adds: see ``make bench``.)
    """

    def decoded(i):
        one = comp.decompress(jax.tree.map(lambda a: a[i], gathered)).astype(jnp.float32)
        return one if scale == 1.0 else one * scale

    def add(i, total):
        return total + decoded(i)

    return jax.lax.fori_loop(1, n, add, decoded(0), unroll=UNROLL_WORKERS)


def widened(payload: Payload) -> Payload:
    """``payload`` (and every payload nested in its wire) decoding to float32, not its input's
    dtype: for a sum of linear payloads (a ``psum``), whose decode may lie beyond the input
    dtype's range though the mean does not.

    Decoding to the input's dtype saturates: 4 float16 workers each sending 17000 by
    ``cast("bfloat16")`` sum to 68000, which float16 clips to 65504 (a mean of 16376,
    finite, so no overflow check sees it).  ``meta[1]`` is the input dtype of every
    compjax payload; a float32 payload is returned as it is.
    """
    wide = np.dtype(jnp.float32)
    if payload.meta[1] == wide:
        return payload
    wire = {k: widened(v) if isinstance(v, Payload) else v for k, v in payload.wire.items()}
    return dataclasses.replace(payload, wire=wire, meta=(payload.meta[0], wide, *payload.meta[2:]))


def summable(comp: Compressor) -> bool:
    """Whether ``comp``'s integer codes for a shared scale sum (:func:`compjax.int_quant`)."""
    return getattr(comp, "summable", False)


def padded_to(flat: jax.Array, size: int) -> jax.Array:
    """``flat`` followed by zeros up to ``size`` entries."""
    return jnp.pad(flat, (0, size - flat.shape[0]))


def placed_block(block: jax.Array, index, blocks: int, d: int) -> jax.Array:
    """A length-``d`` vector: zeros, with ``block`` as block ``index`` of ``blocks`` (unpadded)."""
    m = block.shape[0]
    full = jnp.zeros((blocks * m,), block.dtype)
    return jax.lax.dynamic_update_slice(full, block, (index * m,))[:d]


def block_of(flat: jax.Array, index, blocks: int) -> jax.Array:
    """Block ``index`` of ``flat`` padded to ``blocks`` equal blocks."""
    m = math.ceil(flat.shape[0] / blocks)
    return jax.lax.dynamic_slice(padded_to(flat, blocks * m), (index * m,), (m,))


def split_blocks(flat: jax.Array, n: int) -> jax.Array:
    """``flat`` zero-padded to ``n`` equal blocks: ``(n, ceil(d / n))``, row ``j`` block ``j``."""
    m = math.ceil(flat.shape[0] / n)
    return padded_to(flat, n * m).reshape(n, m)


def compress_blocks(comp: Compressor, keys, blocks: jax.Array):
    """``comp.compress(keys[i], blocks[i])`` for every row, stacked into one payload.

    Batched with ``jax.vmap``, except for a compressor whose ``compress``
    branches on its data (``comp.branches``: the top-k selections' accept
    tests): ``vmap`` turns a ``lax.cond`` on batched data into both
    branches, so the threshold's exact top-k fallback and its full passes ran
    on every block (``make bench-net``: EF top-k by scatter-gather took 687
    against 356 ms per step by all-gather).  Those blocks are compressed one
    at a time (``jax.lax.map``) and each takes its own branch.
    """
    if comp.branches:
        return jax.lax.map(lambda args: comp.compress(*args), (keys, blocks))
    return jax.vmap(comp.compress)(keys, blocks)


def scatter(comp, key, flat, names, n):
    """The scatter half of a compressed all-reduce: ``(sum of the owned block, own decoded)``.

    Each worker compresses the ``n`` blocks of ``flat`` (keys split from
    ``fold_in(key, worker)``) and ``all_to_all`` sends block ``j`` to worker
    ``j``, which decodes and sums what it receives (float32, the block's
    padded length).  ``own`` is this worker's decoded message (float32,
    ``flat``'s length).
    """
    d = flat.shape[0]
    me = worker_index(names)
    shard_keys = jax.random.split(jax.random.fold_in(key, me), n)
    payloads = compress_blocks(comp, shard_keys, split_blocks(flat, n))
    # Materialised before the exchange: fused with the decoding below, XLA's CPU backend
    # turned a batched top-k into a step 8x slower (make bench-net; 1.7 s against 0.05 s
    # for 2 shards of 2^21 entries).
    payloads = jax.lax.optimization_barrier(payloads)
    record("scatter", payloads, "all_to_all", names)
    own = jax.vmap(comp.decompress)(payloads).astype(jnp.float32).reshape(-1)[:d]
    return decoded_sum(comp, collectives.all_to_all(payloads, names), n), own


def rotated_blocks(comp, key, flat, n):
    """``flat``'s ``n`` blocks, each rotated with the shared signs (as they are unless the
    summable compressor rotates): what :func:`summed_scatter` codes."""
    return jax.vmap(lambda b: comp.rotate_in(key, b))(split_blocks(flat, n))


def local_scale(comp, key, flat, n):
    """This worker's part of :func:`summed_scatter`'s shared scale (before the ``pmax``)."""
    return comp.scale_of(rotated_blocks(comp, key, flat, n).reshape(-1))


def summed_scatter(comp, key, flat, names, n, scale=None):
    """Shared scale, each block's integer codes reduce-scattered: ``(owned block's sum, own)``.

    ``scale``: the shared scale, already agreed (the ``pmax`` of every worker's
    :func:`local_scale`); ``None`` agrees on it here.
    """
    d = flat.shape[0]
    m = split_blocks(flat, n).shape[1]
    rotated = rotated_blocks(comp, key, flat, n)  # shared signs: linear
    size = rotated.shape[1]
    if scale is None:
        scale = collectives.pmax(comp.scale_of(rotated.reshape(-1)), names)
        record("scale", scale, "all_reduce", names)
    block_keys = jax.random.split(collectives.worker_key(key, names), n)
    words = jax.vmap(lambda k, b: comp.encode_words(k, b, scale, n))(block_keys, rotated)
    record("payload", words, "reduce_scatter", names)
    summed = collectives.psum_scatter(words, names)[0]
    total = comp.rotate_out(key, comp.decode_words(summed, scale, n, n, size), m)
    own = jax.vmap(lambda w: comp.rotate_out(key, comp.decode_words(w, scale, 1, n, size), m))
    return total, own(words).reshape(-1)[:d]


def linear_scatter(comp, key, flat, names, n):
    """Each block compressed with a shared key, payloads reduce-scattered: ``(sum, own)``."""
    d = flat.shape[0]
    payloads = compress_blocks(comp, jax.random.split(key, n), split_blocks(flat, n))
    record("payload", payloads, "reduce_scatter", names)
    me = worker_index(names)
    wire = jax.tree.map(lambda a: collectives.psum_scatter(a, names)[0], dict(payloads.wire))
    side = jax.tree.map(lambda a: a[me], dict(payloads.side))
    mine = dataclasses.replace(payloads, wire=wire, side=side)
    total = comp.decompress(widened(mine)).astype(jnp.float32)
    own = jax.vmap(comp.decompress)(payloads).astype(jnp.float32).reshape(-1)[:d]
    return total, own


def shared_scales(comp: Compressor, keys, xs: list[jax.Array], axis_name):
    """The shared scales of ``compressed_reduce_scatter(comp, keys[i], xs[i], axis_name)``
    (:func:`compjax.exchange.compressed_reduce_scatter`) for every ``i``, agreed in one
    ``pmax`` of a vector (one message, not one per array).

    ``None`` where the arrays need no agreed scale (a compressor that is not
    ``summable``, one worker, or no array with entries); else a list with a
    float32 scale for each array (``None`` for empty ones), to pass as
    :func:`compressed_reduce_scatter`'s ``scale``.
    """
    names = collectives._names(axis_name)
    n = axes.num_workers(axis_name)
    sized = [i for i, x in enumerate(xs) if x.size]
    if not summable(comp) or n == 1 or not sized:
        return None
    local = jnp.stack([local_scale(comp, keys[i], xs[i].reshape(-1), n) for i in sized])
    agreed = collectives.pmax(local, names)
    record("scale", agreed, "all_reduce", names)
    scales = [None] * len(xs)
    for j, i in enumerate(sized):
        scales[i] = agreed[j]
    return scales
