"""The exchange chosen for a compressed mean: the public functions and what they return.

:func:`compressed_mean` checks its arguments and picks the flat exchange
(:mod:`compjax.exchange.flat`) or the hierarchical run
(:mod:`compjax.exchange.two_level`), guarded against a sum that overflows
float32 (:mod:`compjax.exchange.overflow`); :func:`compressed_reduce_scatter`
stops after the scatter half (:mod:`compjax.exchange.scatter`).  The
exchanges themselves are described in :mod:`compjax.exchange`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.axes import AxisName, num_workers, worker_index
from compjax.compressor import Compressor
from compjax.exchange.flat import (
    Sum,
    gathered_sum,
    in_shape_of,
    scatter_gathered,
    single,
    summed_codes,
)
from compjax.exchange.overflow import mean_without_overflow, rescaled_if_overflow
from compjax.exchange.scatter import (
    linear_scatter,
    padded_to,
    scatter,
    summable,
    summed_scatter,
)
from compjax.exchange.two_level import hierarchical_sum
from compjax.numerics import to_dtype
from compjax.payload import Payload
from compjax.pieces import Pieces, split
from compjax.recording import record

KINDS = ("all_gather", "scatter_gather")


@dataclasses.dataclass(frozen=True)
class Exchange:
    """How messages travel (see :mod:`compjax.exchange`).

    Attributes:
      kind: ``"all_gather"`` or ``"scatter_gather"`` (over the slow axes when
        ``fast_axis`` is set).
      fast_axis: for a hierarchical exchange, the axis (or axes) over which
        the array is reduce-scattered and all-gathered uncompressed; ``None``
        for a flat exchange.
    """

    kind: str = "all_gather"
    fast_axis: AxisName = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"exchange kind must be one of {KINDS}, got {self.kind!r}")
        names = collectives._names(self.fast_axis)
        if self.fast_axis is not None and (not names or not all(isinstance(a, str) for a in names)):
            raise ValueError(
                f"fast_axis must be an axis name or a tuple of names, got {self.fast_axis!r}"
            )


def hierarchical(fast_axis: AxisName, exchange: str = "scatter_gather") -> Exchange:
    """A two-level exchange: uncompressed over ``fast_axis``, compressed over the other axes.

    The transformation's ``axis_name`` names every data-parallel axis (e.g.
    ``("hosts", "local")``); ``fast_axis`` is the fast one (``"local"``).

    Args:
      fast_axis: the fast axis or axes (chips in a host; ICI).
      exchange: how the shard travels over the slow axes, ``"all_gather"``
        or ``"scatter_gather"``.

    Returns:
      An :class:`Exchange` for the ``exchange=`` argument of any compjax
      transformation.
    """
    return Exchange(kind=exchange, fast_axis=fast_axis)


def as_exchange(exchange: str | Exchange) -> Exchange:
    """An :class:`Exchange` from a kind's name or an :class:`Exchange`.

    Args:
      exchange: ``"all_gather"``, ``"scatter_gather"`` or an :class:`Exchange`
        (:func:`hierarchical`).

    Returns:
      The :class:`Exchange` (``exchange`` itself if it is one).

    Raises:
      ValueError: anything else (the message names ``exchange``).
    """
    if isinstance(exchange, Exchange):
        return exchange
    if isinstance(exchange, str) and exchange in KINDS:
        return Exchange(kind=exchange)
    raise ValueError(
        f"exchange must be one of {KINDS} or compjax.hierarchical(...), got {exchange!r}"
    )


def keeps_memory(comp: Compressor, exchange: str | Exchange) -> bool:
    """Whether the shard owners keep an error memory (biased compressor, scatter-gather).

    Args:
      comp: the compressor.
      exchange: the exchange, as :func:`compressed_mean` takes it.

    Returns:
      ``True`` exactly when :func:`compressed_mean` requires (and returns) a
      ``memory``: a compressor neither unbiased nor linear over
      ``"scatter_gather"`` (hierarchical or not).
    """
    exchange = as_exchange(exchange)
    return exchange.kind == "scatter_gather" and not comp.unbiased and not comp.linear


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """Result of a compressed exchange.

    Attributes:
      mean: the decoded mean over workers (identical on every worker).
      local: this worker's part of it (its decoded message ``C(x)`` on an
        all-gather; see :mod:`compjax.exchange` for the others).
      memory: the new server memory (``None`` when none is kept), in the
        precision it was computed in (float32 for a low-precision ``x``).

    For an ``x`` given in :class:`compjax.pieces.Pieces` (a gradient
    bucket), ``mean`` and ``local`` are lists of 1-D arrays, one per piece.
    """

    mean: jax.Array | list[jax.Array]
    local: jax.Array | list[jax.Array]
    memory: jax.Array | None = None
    #: ``(compressor, payload)`` where ``local`` is the decode of this worker's own
    #: message (one worker; a whole array all-gathered, or psummed by a linear
    #: compressor); else ``None`` (scatter-gather, hierarchical, pieces, summable).
    message: tuple[Compressor, Payload] | None = None
    #: Whether ``mean`` is finite (a scalar), where the overflow check already
    #: knows (:func:`compjax.exchange.overflow.once_more_if_not_finite`): the guard then
    #: skips its own pass over the mean (:func:`compjax.guards.guarded`).
    #: ``None`` on one worker and where the mean is unrotated after the check.
    finite: jax.Array | None = None

    def residual(self, y: jax.Array) -> jax.Array:
        """``y - local`` (``y`` of ``local``'s shape): what error feedback keeps.

        Where ``local`` is this worker's decoded message it is computed from
        the message (:meth:`compjax.Compressor.subtract_decoded`: a sparse
        message subtracts its ``k`` entries, with no dense decode); the same
        values either way.
        """
        if self.message is None:
            return y - self.local
        comp, payload = self.message
        return comp.subtract_decoded(payload, y)


def compressed_mean(
    comp: Compressor,
    key,
    x: jax.Array,
    axis_name: AxisName,
    exchange: str | Exchange = "all_gather",
    memory: jax.Array | None = None,
) -> Exchanged:
    """The mean over workers of ``comp`` applied to each worker's ``x``.

    Args:
      comp: the compressor.
      key: a PRNG key shared by all workers; each worker folds in its index
        unless ``comp.linear`` (shared randomness is what lets payloads sum).
      x: this worker's array, or a flat array in :class:`compjax.pieces.Pieces`
        (a gradient bucket, :meth:`compjax.transforms.buckets.Buckets.pieces`):
        where the message is one payload of the whole array (one worker,
        ``"all_gather"``, linear and summable compressors) it is built from
        the pieces (:meth:`compjax.Compressor.compress_pieces`, no copy for
        an elementwise compressor); the scatter-gather and hierarchical
        exchanges cut the array into shards and join it first.
      axis_name: every data-parallel axis (a name or a tuple of names).
      exchange: ``"all_gather"``, ``"scatter_gather"`` or :func:`hierarchical`.
      memory: the shard owners' error memory (``x``'s shape), required
        exactly when :func:`keeps_memory`.

    Returns:
      :class:`Exchanged` with the mean, this worker's part and the new memory
      (the mean and this worker's part in pieces for ``x`` in pieces).
    """
    exchange = as_exchange(exchange)
    if (memory is not None) != keeps_memory(comp, exchange):
        raise ValueError(
            f"memory: {comp!r} over {exchange} "
            + ("keeps a server memory; pass it" if memory is None else "keeps no memory")
        )
    names = collectives._names(axis_name)
    fast = collectives._names(exchange.fast_axis)
    if not set(fast) <= set(names):
        raise ValueError(
            f"fast_axis {exchange.fast_axis!r} must be one of the axes in axis_name {axis_name!r}"
        )
    if isinstance(x, Pieces):
        return _exchanged_pieces(comp, key, x, names, fast, exchange.kind, memory)
    return _exchanged(comp, key, x, names, fast, exchange.kind, memory)


def _exchanged_pieces(comp, key, pieces: Pieces, names, fast, kind, memory) -> Exchanged:
    """:func:`_exchanged` of a flat array in ``pieces``: the mean and own part in pieces."""
    sizes = pieces.sizes
    n = num_workers(names)
    if n == 1:
        local = comp.decompress_pieces(single(comp, key, pieces, names), sizes)
        return Exchanged(mean=local, local=local, memory=memory)
    if fast or not (summable(comp) or comp.linear or kind == "all_gather"):
        out = _exchanged(comp, key, pieces.join(), names, fast, kind, memory)
        return Exchanged(
            split(out.mean, sizes), split(out.local, sizes), out.memory, finite=out.finite
        )
    if summable(comp):
        mean, local, finite = _guarded(summed_codes(comp, key, pieces, names, n), n)
    else:
        mean, own, finite = _guarded(gathered_sum(comp, key, pieces, names, n), n)
        local = comp.decompress(own)
    as_pieces = lambda a: split(to_dtype(a, pieces.dtype), sizes)  # noqa: E731
    return Exchanged(as_pieces(mean), as_pieces(local), memory, finite=finite)


def _exchanged(comp, key, x, names, fast, kind, memory) -> Exchanged:
    """:func:`compressed_mean` of an array after its checks.

    A sum that overflows float32 is taken again pre-scaled
    (:mod:`compjax.exchange.overflow`): the flat exchanges' sums
    (:func:`_guarded`), and the scatter-gather and hierarchical runs as a
    whole (their second compression sees the sum).
    """
    n = num_workers(names)
    if n == 1:
        payload = single(comp, key, x, names)
        local = comp.decompress(payload)
        return Exchanged(mean=local, local=local, memory=memory, message=(comp, payload))
    message = None
    if fast:
        slow = tuple(a for a in names if a not in fast)
        run = functools.partial(hierarchical_sum, comp, key, slow=slow, fast=fast, kind=kind)
        mean, local, memory, finite = rescaled_if_overflow(run, x, memory, n)
    elif summable(comp):
        mean, local, finite = _guarded(summed_codes(comp, key, x.reshape(-1), names, n), n)
    elif comp.linear or kind == "all_gather":
        mean, own, finite = _guarded(gathered_sum(comp, key, x, names, n), n)
        local, message = comp.decompress(own), (comp, own)
    else:
        flat_memory = None if memory is None else memory.reshape(-1)
        run = functools.partial(scatter_gathered, comp, key, names=names, n=n)
        mean, local, memory, finite = rescaled_if_overflow(run, x.reshape(-1), flat_memory, n)
    # The memory keeps the precision it was computed in (float32 for a bfloat16 x):
    # rounding it to x's dtype would drop small residuals every step.
    memory = None if memory is None else memory.reshape(x.shape)
    return Exchanged(in_shape_of(x, mean), in_shape_of(x, local), memory, message, finite)


def _guarded(summed: Sum, n: int):
    """A flat exchange's :data:`compjax.exchange.flat.Sum` finished with its mean over ``n``
    workers, taken again pre-scaled where the sum overflowed: ``(mean, own, finite)``."""
    total, resum, finish = summed
    return finish(*mean_without_overflow(total, resum, n))


def compressed_reduce_scatter(
    comp: Compressor, key, x: jax.Array, axis_name: AxisName, scale: jax.Array | None = None
) -> Exchanged:
    """The mean over workers of ``comp`` applied to each worker's ``x``, ending in shards.

    The reduce-scatter half of a compressed all-reduce, for sharded
    training (:func:`compjax.fsdp`): ``x`` is flattened and split into ``n``
    equal blocks (the last one padded with zeros), and worker ``j`` receives
    only the mean over workers of the decoded block ``j``.  How the blocks
    travel depends on the compressor:

    * ``summable`` (:func:`compjax.int_quant`): one scale for all workers
      (a ``pmax``), each block's integer codes packed for ``n`` summands and
      the words reduce-scattered (``psum_scatter``); a rotating ``int_quant``
      rotates each block with the shared signs;
    * ``linear`` (identity, casts, random-k with a shared seed): each block
      compressed with a key all workers share and its payload
      reduce-scattered, decoded once by the owner;
    * any other: each worker compresses its ``n`` blocks with keys of its own
      and ``all_to_all`` sends block ``j`` to worker ``j``, which decodes and
      sums them (the first half of ``"scatter_gather"``).

    Each worker sends and receives ``(n - 1) / n`` of its compressed message
    ``M_c`` (the ``n`` block payloads).  Sums are float32 (integers for
    ``summable``); unlike :func:`compressed_mean` a sum that overflows float32
    is not resent pre-scaled (the owners would have to agree first): the
    shard is then non-finite, which compjax's guards refuse.

    Args:
      comp: the compressor.
      key: a PRNG key shared by all workers.
      x: this worker's array.
      axis_name: every data-parallel axis (a name or a tuple of names).
      scale: for a ``summable`` compressor, the shared scale if already agreed
        (:func:`compjax.exchange.scatter.shared_scales`, one ``pmax`` for many arrays); ``None``
        agrees on it here.

    Returns:
      :class:`Exchanged` whose ``mean`` is the mean of this worker's block
      (1-D, ``ceil(x.size / n)`` entries, ``x``'s dtype) and whose ``local``
      is this worker's own decoded message (``x``'s shape): what error
      feedback subtracts.  ``memory`` is ``None``.

    References:
      Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward
      Training Trillion Parameter Models", SC 2020 (the gradient
      reduce-scatter of sharded training).
    """
    names = collectives._names(axis_name)
    n = num_workers(axis_name)
    flat = x.reshape(-1)
    if n == 1 or flat.shape[0] == 0:
        payload = comp.compress(key, x)
        record("payload", payload, "reduce_scatter", axis_name)
        local = comp.decompress(payload)
        return Exchanged(
            mean=padded_to(local.reshape(-1), math.ceil(flat.shape[0] / n)), local=local
        )
    if summable(comp):
        total, own = summed_scatter(comp, key, flat, names, n, scale)
    elif comp.linear:
        total, own = linear_scatter(comp, key, flat, names, n)
    else:
        total, own = scatter(comp, key, flat, names, n)
    m = total.shape[0]
    # The padding of the last block decodes to zeros (a rotation would spread noise over it).
    real = worker_index(names) * m + jnp.arange(m) < flat.shape[0]
    mean = to_dtype(jnp.where(real, total / n, 0.0), x.dtype)
    return Exchanged(mean=mean, local=to_dtype(own.reshape(x.shape), x.dtype))
