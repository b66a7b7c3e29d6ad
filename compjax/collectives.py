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
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from compjax import packing
from compjax.payload import wire_bits

AxisName = str | tuple[str, ...] | None

_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("compjax_bits", default=None)
_ROUND: contextvars.ContextVar[list | None] = contextvars.ContextVar("compjax_round", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[object, list[tuple[str, int]]]]]:
    """Log the messages sent while tracing inside the context.

    The log is a list of ``(owner, messages)`` rounds, ``messages`` being
    ``(kind, bits)`` pairs; a round is one call of an update marked with
    :func:`exchange_round` (``owner`` identifies the transformation), and a
    collective called outside any round forms a round of its own
    (``owner=None``).  Each round's list also has ``routes``: ``(kind, via,
    axes)`` of every message, ``via`` the collective that carries it
    (:data:`ROUTES`) and ``axes`` the mesh axes it crosses.
    """
    log: list = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


@contextlib.contextmanager
def exchange_round(owner: object) -> Iterator[None]:
    """Group the messages sent inside into one round of ``owner``."""
    log = _LOG.get()
    if log is None:
        yield
        return
    messages = _Round()
    log.append((owner, messages))
    token = _ROUND.set(messages)
    try:
        yield
    finally:
        _ROUND.reset(token)


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("compjax_quiet", default=False)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Do not log messages sent inside (e.g. a warm-up branch that is not the steady state)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


#: The collectives a message can travel by (``record``'s ``via``).
ROUTES = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter")


class _Round(list):
    """One round's ``(kind, bits)`` messages, with their ``routes`` alongside."""

    def __init__(self):
        super().__init__()
        self.routes: list[tuple[str, str, tuple[str, ...]]] = []


def record(what: str, message, via: str, axis_name: AxisName) -> None:
    """Log that this worker sends ``message`` (an array or payload) in this round.

    Every function here records what it sends; a transformation that builds a
    message of its own (and sends it with :func:`all_gather` or :func:`psum`)
    records it with this.

    Args:
      what: the message's kind (``"payload"``, ``"flag"``, ...).
      message: what this worker puts in the collective.
      via: the collective, one of :data:`ROUTES` (a ``pmax`` is an all-reduce).
      axis_name: the axes it crosses.
    """
    log = _LOG.get()
    if log is None or _QUIET.get():
        return
    if via not in ROUTES:
        raise ValueError(f"via must be one of {ROUTES}, got {via!r}")
    current = _ROUND.get()
    if current is None:
        current = _Round()
        log.append((None, current))
    current.append((what, wire_bits(message)))
    current.routes.append((what, via, _names(axis_name)))


def _names(axis_name: AxisName) -> tuple[str, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


class UnboundAxisError(ValueError):
    """An axis name that is not bound where a collective runs (``axis`` names it)."""

    def __init__(self, message: str, axis: str):
        super().__init__(message)
        self.axis = axis


def num_workers(axis_name: AxisName) -> int:
    """Number of workers along ``axis_name`` (1 for ``None``).

    Raises:
      UnboundAxisError: (a ``ValueError``) the axis name is not bound here
        (not inside ``pmap``, ``shard_map`` or ``vmap`` with that name).
    """
    size = 1
    for name in _names(axis_name):
        try:
            size *= jax.lax.axis_size(name)
        except NameError as err:
            raise UnboundAxisError(
                f"axis_name {name!r} is not bound: call the update inside jax.pmap, "
                f"jax.shard_map or jax.vmap over an axis named {name!r} "
                f"(or pass axis_name=None for a single worker)",
                name,
            ) from err
    return size


def worker_index(axis_name: AxisName) -> jax.Array:
    """This worker's index along ``axis_name`` (0 for ``None``)."""
    if axis_name is None:
        return jnp.int32(0)
    num_workers(axis_name)  # clear error for an unbound name
    return jax.lax.axis_index(_names(axis_name))


def worker_key(key: jax.Array, axis_name: AxisName) -> jax.Array:
    """A key of this worker's own: ``fold_in(key, worker_index)``."""
    if axis_name is None:
        return key
    return jax.random.fold_in(key, worker_index(axis_name))


def _gather_target(axis_name: AxisName) -> str:
    # Under shard_map (and pmap) the axes are manual: mark the gathered result
    # replicated so that callers can return it with out_specs=P().
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return "invarying" if set(_names(axis_name)) <= manual else "varying"


def _tracks_variation(name: str) -> bool:
    """Whether values here carry the manual axes they vary over (``shard_map`` with
    ``check_vma=True``); ``pmap`` and ``check_vma=False`` do not."""
    return name in jax.typeof(jax.lax.axis_index(name)).manual_axis_type.varying


def check_worker_local(arrays, axis_name: AxisName) -> None:
    """Refuse a gradient that is already reduced over the workers, or an untyped 2-D mesh.

    Under ``shard_map`` (``check_vma=True``, the default) every value knows
    the mesh axes it varies over.  A worker's own gradient varies over
    ``axis_name``; the gradient of a replicated (``P()``) input does not,
    because JAX's autodiff has already summed it over the workers, and a
    compressed exchange of it would be ``n`` times too large and save
    nothing.  Under ``check_vma=False`` nothing can be told, which is
    harmless on a mesh of the data axes alone but not with other axes (a
    model axis): refused.  Under ``vmap`` and ``pmap`` gradients are local.

    Raises:
      ValueError: a leaf does not vary over an axis of ``axis_name`` (the
        message names it and ``compjax.worker_params``), or ``check_vma=False``
        on a mesh with axes besides ``axis_name``.
    """
    names = _bound_names(axis_name)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if not names or not set(names) <= manual:
        return
    if not _tracks_variation(names[0]):
        others = sorted(manual - set(names))
        if others:
            raise ValueError(
                f"shard_map with check_vma=False over a mesh with axes {others} besides "
                f"axis_name {axis_name!r}: compjax cannot tell which values vary over them "
                f"(leaves sharded over {others[0]!r} would take wrong steps); use "
                f"check_vma=True, the default"
            )
        return
    for leaf in arrays:
        varying = _varying(leaf)
        missing = [a for a in names if a not in varying]
        if missing:
            raise ValueError(
                f"the gradient does not vary over axis {missing[0]!r}: it is already summed "
                f"over the workers (under shard_map, the gradient of a replicated input is), "
                f"so compressing it would apply it {num_workers(missing[0])} times over and "
                f"save nothing. Differentiate compjax.worker_params(params, {axis_name!r}) "
                f"instead of params, so each worker keeps its own gradient (with Flax NNX: "
                f"compjax.nnx.value_and_grad(loss_fn, {axis_name!r}) in place of "
                f"nnx.value_and_grad or nnx.grad)"
            )


def check_local_loss(loss, axis_name: AxisName) -> None:
    """Refuse a loss already reduced over the workers (a ``pmean`` inside the loss).

    Under ``shard_map`` (``check_vma=True``) each worker's loss of its own
    params (:func:`worker_params`) varies over ``axis_name``.  A loss that
    does not was reduced over the workers inside the loss function: the
    gradient of ``pmean(loss)`` is each worker's gradient divided by ``n``,
    so the step would be ``1/n`` of the intended one, silently.  Nothing is
    checked under ``pmap``, ``vmap`` or ``check_vma=False``.

    Raises:
      ValueError: a leaf of ``loss`` does not vary over an axis of ``axis_name``.
    """
    names = _bound_names(axis_name)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if not names or not set(names) <= manual or not _tracks_variation(names[0]):
        return
    for leaf in jax.tree.leaves(loss):
        missing = [a for a in names if a not in _varying(leaf)]
        if missing:
            raise ValueError(
                f"the loss does not vary over axis {missing[0]!r}: it is already reduced over "
                f"the workers (a jax.lax.pmean or psum inside the loss function), so its "
                f"gradient is each worker's divided by {num_workers(missing[0])} (pmean) and "
                f"the step would be that much too small. Return this worker's local loss, "
                f"and pmean the reported loss outside the gradient"
            )


def worker_params(tree, axis_name: AxisName):
    """This worker's own copy of replicated ``tree`` (params), to differentiate.

    Under ``shard_map`` the gradient with respect to a replicated (``P()``)
    input is summed over the workers by JAX's autodiff, so
    ``jax.grad(loss)(params, local_batch)`` is already the *sum* of every
    worker's gradient and a compressor would compress the reduced gradient.
    Differentiating ``worker_params(params, axis_name)`` instead gives each
    worker its own local gradient, which compjax then exchanges.  Under
    ``pmap`` and ``vmap`` the gradient is local anyway and this returns the
    tree as it is.
    """
    if axis_name is None:
        return tree
    names = _bound_names(axis_name)  # a misspelled axis raises, as everywhere
    if _gather_target(axis_name) == "varying":
        return tree
    return jax.tree.map(lambda x: jax.lax.pcast(x, names, to="varying"), tree)


def _bound_names(axis_name: AxisName) -> tuple[str, ...]:
    """The names of ``axis_name``, after checking each is bound (clear error if not)."""
    num_workers(axis_name)
    return _names(axis_name)


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


def _varying(x: jax.Array) -> set[str]:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``'s typing)."""
    return set(jax.typeof(x).manual_axis_type.varying)


def shared_max(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Maximum over workers (for scalers every worker must share)."""
    record("scaler", x, "all_reduce", axis_name)
    return pmax(x, axis_name) if axis_name is not None else x
