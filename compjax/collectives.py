"""Compressed collectives: the only module of compjax that calls ``jax.lax`` collectives.

Every function takes an ``axis_name``: a mapped axis name, a tuple of names
(reducing over all of them), or ``None`` for a single worker (no
communication).  The same code runs under ``jax.pmap``, ``jax.shard_map``
(on any mesh, reducing over some of its axes), ``jax.vmap(axis_name=...)``
and multi-process ``jax.distributed`` runs.  compjax never builds meshes.

How a compressed mean travels:

* per-worker randomness is ``jax.random.fold_in(key, worker_index)`` of a key
  all workers share;
* how a compressed mean travels (all-gather, scatter-gather, hierarchical) is
  :mod:`compjax.exchange`, built on the primitives here;
* integer reductions where a method allows: the sign majority vote and
  TernGrad with a shared scaler sum small integers with ``psum``.

Under ``shard_map`` the gathered payloads are marked replicated
(``all_gather(..., to='invarying')``), so a mean can be returned with
``out_specs=P()``.

Bits: while a :func:`recording` context is open, every message a worker sends
is logged with its :func:`compjax.wire_bits` (trace time, from the payload
arrays themselves).

What is not a collective lives below this module and is re-exported here:
the axes (names, sizes, this worker's index: :mod:`compjax.axes`), the bits
log (:func:`recording`, :func:`record`: :mod:`compjax.recording`) and the
checks that values are each worker's own (:func:`worker_params`,
:func:`check_worker_local`, :func:`check_local_loss`: :mod:`compjax.worker_local`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.axes import AxisName, num_workers, worker_index
from compjax.axes import axis_names as _names
from compjax.axes import bound_names as _bound_names
from compjax.axes import gather_target as _gather_target
from compjax.axes import varying as _varying
from compjax.recording import record


def worker_key(key: jax.Array, axis_name: AxisName) -> jax.Array:
    """A key of this worker's own: ``fold_in(key, worker_index)``."""
    if axis_name is None:
        return key
    return jax.random.fold_in(key, worker_index(axis_name))


def all_gather(tree, axis_name: AxisName):
    """Stack every worker's ``tree`` on a new leading axis (replicated result).

    Over a tuple of names the gathers run innermost name first, so the
    leading axis is ordered like ``jax.lax.axis_index(names)``.
    """
    names = _bound_names(axis_name)
    to = _gather_target(axis_name)

    def gather(x):
        for name in reversed(names):
            x = jax.lax.all_gather(x, name, to=to)
        # The leading size spelled out: -1 cannot be inferred for an empty leaf.
        return x.reshape((math.prod(x.shape[: len(names)]), *x.shape[len(names) :]))

    return jax.tree.map(gather, tree)


def all_gather_tiled(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Every worker's ``x`` concatenated along axis 0 (replicated result), in worker order."""
    gathered = all_gather(x, axis_name)
    return gathered.reshape((gathered.shape[0] * x.shape[0], *x.shape[1:]))


def all_to_all(tree, axis_name: AxisName):
    """Transpose the leading worker axis: row ``j`` of every worker goes to worker ``j``.

    Each leaf has a leading axis of size ``num_workers(axis_name)``; on return
    row ``i`` of worker ``j``'s leaf is row ``j`` of worker ``i``'s.
    """
    names = _bound_names(axis_name)
    # jax.vmap's rule for all_to_all returns extra axes for an operand that is the same on
    # every worker (unmapped: a closed-over constant; jax 0.10).  A select on the worker's
    # index makes it per-worker there, and folds away in XLA (both branches are ``x``).
    mine = jax.lax.axis_index(names) >= 0
    return jax.tree.map(
        lambda x: jax.lax.all_to_all(jnp.where(mine, x, x), names, 0, 0, tiled=True), tree
    )


def psum_scatter(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Sum over workers of ``x``, split along axis 0: worker ``j`` gets block ``j`` of the sum."""
    names = _bound_names(axis_name)
    return jax.lax.psum_scatter(x, names, scatter_dimension=0, tiled=True)


def psum(tree, axis_name: AxisName):
    names = _bound_names(axis_name)
    return jax.tree.map(lambda x: jax.lax.psum(x, names), tree)


def psum_together(arrays: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    """:func:`psum` of every array, as one all-reduce where they can share one.

    Arrays of one dtype that vary over the same mesh axes are raveled,
    concatenated, summed in one collective and split back to their shapes
    (one message instead of one per array: each collective pays a round trip,
    which for many small arrays costs more than their bytes).  Arrays of
    different dtypes or variation go in separate messages (joining them would
    change a value's type under ``shard_map``).  Each entry's sum is that of
    its own array; only the order of the additions inside the collective may
    differ.
    """
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault((jnp.dtype(a.dtype), frozenset(_varying(a))), []).append(i)
    out: list[jax.Array | None] = [None] * len(arrays)
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = psum(arrays[members[0]], axis_name)
            continue
        parts = [arrays[i] for i in members]
        total = psum(jnp.concatenate([a.reshape(-1) for a in parts]), axis_name)
        at = 0
        for i, a in zip(members, parts, strict=True):
            out[i] = total[at : at + a.size].reshape(a.shape)
            at += a.size
    return out


def pmax(tree, axis_name: AxisName):
    names = _bound_names(axis_name)
    return jax.tree.map(lambda x: jax.lax.pmax(x, names), tree)


def _vote_dtype(n: int):
    return jnp.int8 if n <= 127 else jnp.int32


def sign_vote(x: jax.Array, axis_name: AxisName, via: str = "all_gather") -> jax.Array:
    """signSGD's majority vote: ``sign(sum_i sign(x_i))`` over workers.

    Args:
      x: this worker's array (gradient or momentum).
      axis_name: the workers' axis.
      via: ``"all_gather"`` sends each worker's signs bit-packed (1 bit per
        entry, zeros voting +1) and sums the unpacked votes;
        ``"psum"`` sums ``sign(x)`` as int8 (int32 beyond 127 workers),
        8 bits per entry on the wire but zeros abstain;
        ``"scatter_gather"`` votes shard by shard (:func:`_sign_vote_shards`):
        the same vote as ``"all_gather"`` for ``(n - 1) / n`` of the bits
        plus the gathered result (1 bit per entry for odd ``n``, 2 for even
        ``n``, which can tie).

    Returns:
      The vote, ``-1``, ``0`` (a tie) or ``+1`` per entry, in ``x``'s dtype.
    """
    n = num_workers(axis_name)
    flat = x.reshape(-1)
    if via == "psum":
        votes = jnp.sign(flat).astype(_vote_dtype(n))
        record("votes", votes, "all_reduce", axis_name)
        total = psum(votes, axis_name) if axis_name is not None else votes
        return jnp.sign(total).astype(x.dtype).reshape(x.shape)
    if via == "scatter_gather" and axis_name is not None:
        return _sign_vote_shards(flat, axis_name, n).astype(x.dtype).reshape(x.shape)
    bits = packing.pack((flat < 0).astype(jnp.uint32), 1)
    record("signs", bits, "all_gather", axis_name)
    gathered = all_gather(bits, axis_name) if axis_name is not None else bits[None]
    unpacked = jax.vmap(lambda b: packing.unpack(b, 1, flat.shape[0]))(gathered)
    total = jnp.sum(1 - 2 * unpacked.astype(jnp.int32), axis=0)
    return jnp.sign(total).astype(x.dtype).reshape(x.shape)


def _sign_vote_shards(flat: jax.Array, axis_name: AxisName, n: int) -> jax.Array:
    """The majority vote as a scatter-gather: worker ``j`` tallies shard ``j`` of every vote.

    Each worker pads its ``d`` entries to ``n m`` and bit-packs the signs of
    each ``m``-entry shard (zeros vote +1, as on the all-gather); an
    ``all_to_all`` hands shard ``j`` of every worker to worker ``j``, which
    sums the votes and all-gathers the outcome: one bit per entry when ``n``
    is odd (no ties), else the codes ``vote + 1`` in 2 bits (a tie is 0).
    Per-worker traffic ``(n - 1) / n (1 + w) d`` bits with ``w`` the width of
    the outcome, against ``(n - 1) d`` for the all-gather.

    References:
      Bernstein et al., "signSGD with Majority Vote is Communication Efficient
      and Fault Tolerant", ICLR 2019 (a parameter server tallies the votes:
      here worker ``j`` is the server of shard ``j``).
    """
    d = flat.shape[0]
    m = -(-d // n)
    shards = jnp.pad(flat < 0, (0, n * m - d)).reshape(n, m).astype(jnp.uint32)
    packed = jax.vmap(lambda s: packing.pack(s, 1))(shards)
    record("scatter", packed, "all_to_all", axis_name)
    received = all_to_all(packed, axis_name)
    negative = jax.vmap(lambda b: packing.unpack(b, 1, m))(received).astype(jnp.int32)
    vote = jnp.sign(jnp.sum(1 - 2 * negative, axis=0))
    width = 1 if n % 2 else 2
    codes = (vote < 0) if width == 1 else vote + 1
    outcome = packing.pack(codes.astype(jnp.uint32), width)
    record("gather", outcome, "all_gather", axis_name)
    everyone = jax.vmap(lambda b: packing.unpack(b, width, m))(all_gather(outcome, axis_name))
    votes = 1 - 2 * everyone.astype(jnp.int32) if width == 1 else everyone.astype(jnp.int32) - 1
    return votes.reshape(-1)[:d]


def ternary_mean(codes: jax.Array, scale: jax.Array, axis_name: AxisName) -> jax.Array:
    """Mean over workers of ``scale * codes`` for ternary ``codes`` and a shared ``scale``.

    The ternaries ``-1, 0, +1`` are summed as int8 (int32 beyond 127 workers)
    with ``psum``: with a scaler every worker shares, the sum of integers is the
    whole message.
    """
    n = num_workers(axis_name)
    ints = codes.astype(_vote_dtype(n))
    record("ternaries", ints, "all_reduce", axis_name)
    total = psum(ints, axis_name) if axis_name is not None else ints
    # total / n first: |total / n| <= 1, so a scale near float32's maximum does not overflow.
    return scale * (total.astype(jnp.float32) / n)


def any_worker(flag: jax.Array, axis_name: AxisName) -> jax.Array:
    """Whether ``flag`` is true on any worker (an 8-bit ``pmax``).

    On a mesh with other axes (a ``"model"`` axis sharding the parameters)
    the flag is also reduced over the axes it varies over, so every shard of
    every worker takes the same decision (one step for the whole model).
    """
    flag = flag.astype(jnp.int8)
    record("flag", flag, "all_reduce", axis_name)
    if axis_name is None:
        return flag > 0
    names = _names(axis_name)
    extra = tuple(sorted(_varying(flag) - set(names)))
    return pmax(flag, names + extra) > 0


def shared_max(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Maximum over workers (for scalers every worker must share)."""
    record("scaler", x, "all_reduce", axis_name)
    return pmax(x, axis_name) if axis_name is not None else x
