"""The flat exchanges: how one array's compressed sum travels over one set of axes.

:mod:`compjax.exchange.choose` picks one of these for each message (and adds
the hierarchical exchange, the overflow guard, buckets in pieces and the
dtypes); each takes the compressor, a key all workers share, this worker's
array (a flat array in :class:`compjax.pieces.Pieces` for the first two),
the axes' names and their number of workers ``n``:

* :func:`gathered_sum`: one payload of the whole array, all-gathered and
  decoded ``n`` times, or for a ``linear`` compressor ``psum``-ed and
  decoded once;
* :func:`summed_codes`: a ``summable`` compressor's integer codes for one
  shared scale (``pmax``), summed by ``psum``;
* :func:`scatter_gathered`: the compressed all-reduce of ``"scatter_gather"``,
  the scatter half (:func:`compjax.exchange.scatter.scatter`) followed by a second
  compression and an all-gather.

The first two return a :data:`Sum`: the float32 sum over workers, the same
sum again with every message times a scale (what
:func:`compjax.exchange.overflow.mean_without_overflow` takes where the sum
overflowed) and the step that turns the mean into what the exchange returns.

The second compression of ``"scatter_gather"``.  Worker ``j`` holds
``S_j = sum_i C_1(x_i^j)`` and sends ``C_2(S_j + m_j)``:

* for an **unbiased** compressor ``m_j = 0`` and the mean stays unbiased.  Its
  exact variance, for independent first-stage draws, is

      E||mean - x_bar||^2 = (1/n^2) [ sum_i V_1(x_i) + E V_2(S) ],

  with ``V(y) = E||C(y) - y||^2`` the compressor's own variance on ``y``
  (summed over shards).  With ``V(y) <= omega ||y||^2`` this is at most
  ``(1/n^2) [ (1 + omega_2) omega_1 sum_i ||x_i||^2 + omega_2 ||sum_i x_i||^2 ]``,
  with equality for compressors whose variance is exactly ``omega ||y||^2``
  (random-k): :func:`two_stage_variance` and ``proofs_checks/two_stage.py``.
* for a **biased** compressor the shard's owner keeps an error memory ``m_j``
  (DoubleSqueeze, Tang et al. 2019): ``m_j <- S_j + m_j - C_2(S_j + m_j)``, so
  nothing is lost: what is applied plus the memories equals what was sent.

References:
  Tang, Yu, Lian, Zhang, Liu, "DoubleSqueeze: Parallel Stochastic Gradient
  Descent with Double-Pass Error-Compensated Compression", ICML 2019.
  Patarasuk, Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009 (reduce-scatter + all-gather).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.axes import worker_index
from compjax.compressor import Compressor
from compjax.exchange.scatter import (
    block_of,
    decoded_sum,
    placed_block,
    scatter,
    summable,
    widened,
)
from compjax.numerics import prescale, to_dtype
from compjax.payload import Payload
from compjax.pieces import Pieces
from compjax.recording import record

#: ``(total, resum, finish)``: the float32 sum over workers; ``resum(scale)``, the same
#: sum of every worker's message times ``scale``; ``finish(mean, finite)``, the mean (and
#: whether it is finite) as ``(mean, own, finite)``, ``own`` this worker's payload
#: (:func:`gathered_sum`) or decoded message (:func:`summed_codes`).
Sum = tuple[jax.Array, Callable[[float], jax.Array], Callable]


def compress_message(comp, key, x):
    """``comp``'s payload of an array, or of a flat array in pieces."""
    return comp.compress_pieces(key, x) if isinstance(x, Pieces) else comp.compress(key, x)


def single(comp: Compressor, key, x, names) -> Payload:
    """One worker's payload of ``x`` (an array, or a flat array in pieces), logged as sent."""
    payload = compress_message(comp, key, x)
    via = "all_reduce" if comp.linear or summable(comp) else "all_gather"
    record("payload", payload, via, names)
    return payload


def _times(x, scale: float):
    """``x * scale`` in ``x``'s dtype (for a flat array in pieces, piece by piece)."""
    if isinstance(x, Pieces):
        return Pieces(tuple(s * jnp.asarray(scale, s.dtype) for s in x.sources), x.ranges, x.dtype)
    return x * jnp.asarray(scale, x.dtype)


def _psummed(comp, key, x, names, scale: float = 1.0):
    """A linear compressor's payloads summed by ``psum`` and decoded once:
    ``(the decoded sum flattened, own payload)``.

    Flattened: the overflow check's loop carries it and reads it 1-D (a decode in the
    array's shape was written twice, once for the loop and once flat for the check).
    """
    payload = compress_message(comp, key, x if scale == 1.0 else _times(x, scale))
    record("payload", payload, "all_reduce", names)
    total = dataclasses.replace(payload, wire=collectives.psum(dict(payload.wire), names))
    # Decoded in float32: the sum may lie beyond x's dtype though the mean does not.
    return comp.decompress(widened(total)).astype(jnp.float32).reshape(-1), payload


def gathered_sum(comp, key, x, names, n) -> Sum:
    """All-gather (or, for a linear compressor, psum): the :data:`Sum` of the workers' messages.

    Its ``finish`` gives ``(mean, own payload, finite)``.
    """
    if comp.linear:
        total, payload = _psummed(comp, key, x, names)

        def finish(mean, finite):
            return mean.reshape(payload.meta[0]), payload, finite

        # A psum of values near the dtype's largest overflows: resent pre-scaled (exact).
        return total, lambda s: _psummed(comp, key, x, names, s)[0], finish
    payload = compress_message(comp, collectives.worker_key(key, names), x)
    record("payload", payload, "all_gather", names)
    gathered = collectives.all_gather(payload, names)
    total = decoded_sum(comp, gathered, n)
    return (
        total,
        lambda s: decoded_sum(comp, gathered, n, s),
        lambda mean, finite: (mean, payload, finite),
    )


def summed_codes(comp, key, flat, names, n) -> Sum:
    """Shared scale (``pmax``), integer codes summed by ``psum``: the :data:`Sum` of the codes.

    Its ``finish`` gives ``(mean, own decoded, finite)``.  A rotating
    compressor (``int_quant(rotate=True)``) codes ``H D x`` with signs from
    ``key``, which all workers share: the rotation is linear, so the summed
    codes are unrotated once, in ``finish``.  ``flat`` may be in
    :class:`compjax.pieces.Pieces`, which the summable protocol's
    ``rotate_in``, ``scale_of`` and ``encode_words`` take.  ``finite`` is then
    ``None`` for a rotating compressor (the unrotation of a finite mean can
    overflow).
    """
    d = flat.shape[0]
    flat = comp.rotate_in(key, flat)
    scale = collectives.pmax(comp.scale_of(flat), names)
    record("scale", scale, "all_reduce", names)
    words = comp.encode_words(collectives.worker_key(key, names), flat, scale, n)
    record("payload", words, "all_reduce", names)
    m = flat.shape[0]
    summed = collectives.psum(words, names)

    def finish(mean, finite):
        own = comp.decode_words(words, scale, 1, n, m)
        finite = None if getattr(comp, "rotate", False) else finite
        return comp.rotate_out(key, mean, d), comp.rotate_out(key, own, d), finite

    return (
        comp.decode_words(summed, scale, n, n, m),
        lambda s: comp.decode_words(summed, scale * s, n, n, m),
        finish,
    )


def scatter_gathered(comp, key, flat, memory, names, n):
    """Compressed all-reduce of a flat array: ``(sum over workers, local, new memory)``.

    See the module docstring: shards compressed and all-to-all-ed, decoded
    and summed by their owner (:func:`compjax.exchange.scatter.scatter`), compressed again (with the
    owner's memory for a biased compressor) and all-gathered.
    """
    d = flat.shape[0]
    if d == 0:
        return jnp.zeros((0,), jnp.float32), flat, memory
    me = worker_index(names)
    first_key, second_key = jax.random.split(key)
    mine, own = scatter(comp, first_key, flat, names, n)
    target = mine if memory is None else mine + block_of(memory, me, n).astype(jnp.float32)
    # A sum of n float16 values need not be one (4 x 60000): in a dtype of float16's
    # range the shard is sent times 2**-k (2**k >= n, exact) and scaled back on decoding.
    down = prescale(n)[0] if narrow_range(flat.dtype) else 1.0
    shard = target if down == 1.0 else target * down
    second = comp.compress(jax.random.fold_in(second_key, me), shard.astype(flat.dtype))
    record("gather", second, "all_gather", names)
    sent = _scaled_up(comp.decompress(second), down)
    gathered = collectives.all_gather(second, names)
    total = _scaled_up(jax.vmap(comp.decompress)(gathered).reshape(-1)[:d], down)
    if memory is not None:
        return total, own, placed_block(target - sent, me, n, d)
    return total, own + placed_block(sent - mine, me, n, d), None


def in_shape_of(x: jax.Array, a: jax.Array | None) -> jax.Array | None:
    """A mean or local part ``a`` in ``x``'s shape and dtype (``None`` stays ``None``).

    A saturating cast (:func:`compjax.numerics.to_dtype`): a float32 mean at
    float32's maximum is not bfloat16's Inf.
    """
    return None if a is None else to_dtype(a.reshape(x.shape), x.dtype)


def narrow_range(dtype) -> bool:
    """Whether ``dtype``'s exponent range is narrower than float32's (float16)."""
    return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def _scaled_up(decoded: jax.Array, down: float) -> jax.Array:
    """``decoded / down`` in float32 (``down`` a power of two: exact)."""
    decoded = decoded.astype(jnp.float32)
    return decoded if down == 1.0 else decoded * (1.0 / down)


def two_stage_variance(first: list[float], second: float, n: int) -> float:
    """Exact variance of the scatter-gather mean, from the stages' own variances.

    Args:
      first: ``V_1(x_i) = E||C_1(x_i) - x_i||^2`` for each worker ``i``
        (summed over its shards).
      second: ``E V_2(S)``, the expected second-stage variance on the summed
        shards ``S`` (summed over shards).
      n: number of workers.

    Returns:
      ``E||mean - x_bar||^2 = (sum_i V_1(x_i) + E V_2(S)) / n^2``.
    """
    return (sum(first) + second) / n**2


def two_stage_bound(sq_norms: list[float], sq_norm_sum: float, omega1: float, omega2: float):
    """The bound ``((1 + omega_2) omega_1 sum_i ||x_i||^2 + omega_2 ||sum_i x_i||^2) / n^2``.

    Exact when each stage's variance is exactly ``omega ||y||^2`` (random-k).
    """
    n = len(sq_norms)
    return ((1 + omega2) * omega1 * sum(sq_norms) + omega2 * sq_norm_sum) / n**2
