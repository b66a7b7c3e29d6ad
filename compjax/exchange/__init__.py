"""How a compressed mean travels: all-gather, scatter-gather, and hierarchical exchanges.

Three ways for the workers' compressed messages to meet (every transformation
takes one as ``exchange=``; the default is ``"all_gather"``):

* ``"all_gather"``: each worker compresses its whole array, the payloads are
  all-gathered and every worker decodes and adds all ``n`` of them.  Each
  worker receives ``(n - 1) M_c`` bits: traffic grows with ``n``.
  ``linear`` compressors (identity, cast, random-k with a shared seed) ``psum``
  their payloads instead and decode once, whatever the exchange; so do
  ``summable`` ones (:func:`compjax.int_quant`), after a ``pmax`` of their
  scale, with integer codes in fields wide enough for ``n`` summands.
* ``"scatter_gather"``: a compressed all-reduce.  The flat array is split into
  ``n`` shards; each worker compresses every shard and ``all_to_all`` sends
  shard ``j`` to worker ``j`` (*scatter*), which decodes and sums it
  (*reduce*), compresses the sum again and all-gathers it (*gather*).  Each
  worker sends and receives about ``2 (n - 1) / n M_c`` bits, like a ring
  all-reduce of the compressed size.
* :func:`compressed_reduce_scatter`: the first half alone, for sharded
  training: each worker ends with the mean of the shard it owns.  Summable
  and linear compressors reduce-scatter their payloads; the others are
  all-to-all-ed and summed by the owner, as in ``"scatter_gather"``.
* :func:`hierarchical`: on a mesh with a fast axis and a slow one, the array
  is reduce-scattered over the fast axis uncompressed, the shard is exchanged
  compressed over the slow axes (by either exchange above), and the result is
  all-gathered over the fast axis.  Only the slow link carries compressed
  messages.

How each flat exchange travels, and the second compression of
``"scatter_gather"`` (its error memory for a biased compressor, its exact
variance for an unbiased one: :func:`two_stage_variance`), are
:mod:`compjax.exchange.flat`; this module chooses among them.

``Exchanged.local`` is this worker's part of the exchange, defined so that
(``S_j`` the first-stage sum of shard ``j`` and ``m_j`` its owner's memory,
as in :mod:`compjax.exchange.flat`)
``sum_i local_i + sum_j m_j(before) = n mean + sum_j m_j(after)`` holds
exactly: the decoded own message, plus (unbiased scatter-gather, no memory)
the second-stage residual ``C_2(S_j) - S_j`` of the shard it owns, and
(hierarchical) minus the residual of its fast group's shard.  Error
feedback, EF21 and DIANA use it unchanged, and their invariants (``sum of
sent + memories = inputs``; ``h = mean_i h_i``) hold on every exchange.

Server memories are per-worker arrays of the leaf's shape; worker ``j``
uses the entries of the shard it owns and keeps zeros elsewhere (so the
state's shape does not depend on ``n``).

Bits are logged per message kind: ``"payload"`` (all-gather), ``"scatter"``
(all of a worker's shard payloads, of which ``(n - 1)/n`` leave it),
``"gather"`` (its re-compressed shard), and on a hierarchical exchange
``"fast_reduce_scatter"`` and ``"fast_all_gather"`` on the fast axis.

References:
  Tang, Yu, Lian, Zhang, Liu, "DoubleSqueeze: Parallel Stochastic Gradient
  Descent with Double-Pass Error-Compensated Compression", ICML 2019.
  Patarasuk, Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009 (reduce-scatter + all-gather).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.collectives import AxisName, num_workers, record, worker_index
from compjax.compressor import Compressor
from compjax.exchange.flat import gathered_mean, scatter_gathered, summed_mean
from compjax.exchange.flat import two_stage_bound as two_stage_bound
from compjax.exchange.flat import two_stage_variance as two_stage_variance
from compjax.exchange.overflow import rescaled_if_overflow
from compjax.exchange.scatter import (
    block_of,
    linear_scatter,
    padded_to,
    placed_block,
    scatter,
    summable,
    summed_scatter,
)
from compjax.numerics import to_dtype
from compjax.payload import Payload
from compjax.pieces import Pieces, split

KINDS = ("all_gather", "scatter_gather")


@dataclasses.dataclass(frozen=True)
class Exchange:
    """How messages travel (see the module docstring).

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
    """Whether the shard owners keep an error memory (biased compressor, scatter-gather)."""
    exchange = as_exchange(exchange)
    return exchange.kind == "scatter_gather" and not comp.unbiased and not comp.linear


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """Result of a compressed exchange.

    Attributes:
      mean: the decoded mean over workers (identical on every worker).
      local: this worker's part of it (its decoded message ``C(x)`` on an
        all-gather; see the module docstring for the others).
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
    return _exchanged(comp, key, x, names, fast, exchange.kind, memory, guard=True)


def _exchanged_pieces(comp, key, pieces: Pieces, names, fast, kind, memory) -> Exchanged:
    """:func:`_exchanged` of a flat array in ``pieces``: the mean and own part in pieces."""
    sizes = pieces.sizes
    n = num_workers(names)
    if n == 1:
        payload = comp.compress_pieces(key, pieces)
        via = "all_reduce" if comp.linear or summable(comp) else "all_gather"
        record("payload", payload, via, names)
        local = comp.decompress_pieces(payload, sizes)
        return Exchanged(mean=local, local=local, memory=memory)
    if fast or not (summable(comp) or comp.linear or kind == "all_gather"):
        out = _exchanged(comp, key, pieces.join(), names, fast, kind, memory, guard=True)
        return Exchanged(
            split(out.mean, sizes), split(out.local, sizes), out.memory, finite=out.finite
        )
    if summable(comp):
        mean, local, finite = summed_mean(comp, key, pieces, names, n)
    else:
        mean, own, finite = gathered_mean(comp, key, pieces, names, n)
        local = comp.decompress(own)
    as_pieces = lambda a: split(to_dtype(a, pieces.dtype), sizes)  # noqa: E731
    return Exchanged(as_pieces(mean), as_pieces(local), memory, finite=finite)


def _exchanged(comp, key, x, names, fast, kind, memory, guard):
    """:func:`compressed_mean` after its checks.  ``guard``: a sum that overflows float32 is
    resent pre-scaled (:mod:`compjax.exchange.overflow`); off for the slow stage of a hierarchical
    exchange, whose whole run is guarded once."""
    n = num_workers(names)
    if n == 1:
        payload = comp.compress(key, x)
        via = "all_reduce" if comp.linear or summable(comp) else "all_gather"
        record("payload", payload, via, names)
        local = comp.decompress(payload)
        return Exchanged(mean=local, local=local, memory=memory, message=(comp, payload))
    guarded = rescaled_if_overflow if guard else _unguarded
    message = None
    if fast:
        slow = tuple(a for a in names if a not in fast)
        mean, local, memory, finite = guarded(
            lambda xs, ms: _hierarchical(comp, key, xs, ms, slow, fast, kind), x, memory, n
        )
    elif summable(comp):
        mean, local, finite = summed_mean(comp, key, x.reshape(-1), names, n, guard)
    elif comp.linear or kind == "all_gather":
        mean, own, finite = gathered_mean(comp, key, x, names, n, guard)
        local, message = comp.decompress(own), (comp, own)
    else:
        flat_memory = None if memory is None else memory.reshape(-1)
        mean, local, memory, finite = guarded(
            lambda xs, ms: scatter_gathered(comp, key, xs, ms, names, n),
            x.reshape(-1),
            flat_memory,
            n,
        )
    # Saturating cast: a float32 mean at float32's maximum is not bfloat16's Inf.
    as_x = lambda a: None if a is None else to_dtype(a.reshape(x.shape), x.dtype)  # noqa: E731
    # The memory keeps the precision it was computed in (float32 for a bfloat16 x):
    # rounding it to x's dtype would drop small residuals every step.
    memory = None if memory is None else memory.reshape(x.shape)
    return Exchanged(as_x(mean), as_x(local), memory, message, finite)


def _unguarded(run, x, memory, n):
    """``run(x, memory) -> (total, local, memory)`` as ``(mean, local, memory, None)``."""
    total, local, memory = run(x, memory)
    return total / n, local, memory, None


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


def _hierarchical(comp, key, x, memory, slow, fast, kind):
    """Reduce-scatter over ``fast``, compressed exchange over ``slow``, all-gather over ``fast``."""
    flat = x.reshape(-1)
    d = flat.shape[0]
    n_fast = num_workers(fast)
    m = math.ceil(d / n_fast)
    padded = padded_to(flat, n_fast * m)
    record("fast_reduce_scatter", padded, "reduce_scatter", fast)
    group = collectives.psum_scatter(padded, fast)  # this worker's shard, summed over ``fast``
    k = worker_index(fast)
    inner_key = jax.random.fold_in(key, k)  # distinct per shard; shared along ``slow``
    inner_memory = None if memory is None else block_of(memory.reshape(-1), k, n_fast)
    if slow:
        n_slow = num_workers(slow)
        # unguarded: the whole hierarchical run is resent pre-scaled if it overflows
        inner = _exchanged(comp, inner_key, group, slow, (), kind, inner_memory, guard=False)
        shard_total = inner.mean.astype(jnp.float32) * n_slow
        shard_local, inner_memory = inner.local, inner.memory
    else:
        shard_total, shard_local = group.astype(jnp.float32), group
    record("fast_all_gather", shard_total.astype(x.dtype), "all_gather", fast)
    total = collectives.all_gather_tiled(shard_total, fast)[:d]
    local = flat.astype(jnp.float32) - placed_block(
        group.astype(jnp.float32) - shard_local.astype(jnp.float32), k, n_fast, d
    )
    new_memory = None if inner_memory is None else placed_block(inner_memory, k, n_fast, d)
    return total, local, new_memory
