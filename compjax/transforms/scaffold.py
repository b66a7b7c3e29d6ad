"""The flow every leaf-by-leaf transformation shares, so that each transformation holds its
algorithm only.

A transformation describes itself once (:class:`Scaffold`: its state NamedTuple, which of
its fields hold one array per leaf, whether it keeps a key, a server memory or a bit
counter, how the tree is grouped) and writes one function, ``step(leaf) -> LeafStep``: what
one worker does with one leaf (or bucket, or the flattened tree), given the leaf's update,
key, server memory and state entries (:class:`Leaf`).  :func:`leafwise` does the rest, the
same way for all:

1. split the updates into leaves (:class:`compjax.transforms.base.Leaves`: leaf by leaf,
   flattened, or in buckets);
2. check them for Inf/NaN (:func:`compjax.guards.any_non_finite`, the step's one flag);
3. read the state's per-leaf fields (per-worker where the state lists them in
   ``PER_WORKER``, checked against the updates' structure) and the shard owners' memories
   (:class:`compjax.transforms.base.ServerMemory`);
4. derive one key per leaf from the state's key (:func:`compjax.draws.step_keys`);
5. run ``step`` on each leaf, in leaf order;
6. write the new fields back in the dtypes fixed at ``init``
   (:func:`compjax.transforms.base.cast_like`), the memories, the next key and the bit
   counter (``bits_sent``, on states with ``COUNTS_BITS``);
7. refuse the step on non-finite input or output (:func:`compjax.guards.guarded`: NaN
   updates, the old state kept);
8. rebuild the tree; the call counts as one communication round
   (:func:`compjax.transforms.base.counted`).

A transformation whose input is not the updates themselves (per-example gradients) calls
:func:`begin` and :func:`end` around its own loop.

State fields the scaffold knows by name (:data:`KNOWN_FIELDS`): ``key`` (the shared PRNG
key, with ``seed``), ``server_error`` (with ``server``) and ``bits_sent`` (with
``COUNTS_BITS``); every other field holds one array per leaf, zeros at ``init`` in the
state dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.draws import init_key, step_keys
from compjax.exchange import Exchange
from compjax.guards import Check, any_non_finite, guarded
from compjax.transforms.base import (
    Leaves,
    ServerMemory,
    cast_like,
    check_grouping,
    check_state_dtype,
    counted,
    state_zeros,
)
from compjax.transforms.padded_sparse import add_bits, new_counter


class Leaf(NamedTuple):
    """What a step reads of one leaf (or bucket, or the flattened tree).

    Attributes:
      update: this worker's update: an array (a bucket's
        :class:`compjax.pieces.Pieces` where the scaffold sends ``pieces``).
      key: the leaf's key for this step (``None`` for a state without a key).
      memory: the shard owner's memory for :func:`compjax.exchange.compressed_mean`
        (``None`` where none is kept).
      state: the leaf's entries of the scaffold's ``fields``, in their order.
    """

    update: Any
    key: Any = None
    memory: Any = None
    state: tuple = ()


class LeafStep(NamedTuple):
    """What a step returns for one leaf.

    Attributes:
      out: the update (in the gradient's dtype, unless the scaffold casts after the guard;
        a bucket's update may be its pieces).
      state: the new entries of the scaffold's ``fields``, in their order (cast to the
        state's dtypes by the scaffold).
      memory: the shard owner's new memory (:attr:`compjax.exchange.Exchanged.memory`).
      finite: whether ``out`` is finite where the exchange already knows it
        (:attr:`compjax.exchange.Exchanged.finite`); ``None``: checked by the guard.
      sent: ``(count, bits_each)`` pairs added, in order, to the state's ``bits_sent``.
    """

    out: Any
    state: tuple = ()
    memory: Any = None
    finite: Any = None
    sent: tuple = ()


class Scaffold(NamedTuple):
    """How a transformation lays out its state and its updates (static; build it with
    :func:`scaffold` or :func:`exchanged`, which check the arguments).

    Attributes:
      state: the state NamedTuple type.
      axis_name: the data-parallel axis.
      fields: the state fields holding one array per leaf.
      flatten: one leaf for the whole tree.
      bucket_size: buckets of this many entries of the flattened tree, or ``None``.
      seed: seed of the state's ``key`` field, or ``None`` for a state without one.
      server: the shard owners' memories (``server_error``), or ``None``.
      state_dtype: dtype of the per-leaf fields (checked; ``None``: the default).
      pieces: steps get a bucket as its pieces (:attr:`Leaves.messages`) instead of
        one array.
      cast_after_guard: updates are cast to their leaf's dtype after the guard (a
        step computing in float32: its updates are judged finite in float32).
    """

    state: type
    axis_name: AxisName
    fields: tuple[str, ...] = ()
    flatten: bool = False
    bucket_size: int | None = None
    seed: int | None = None
    server: ServerMemory | None = None
    state_dtype: np.dtype | None = None
    pieces: bool = False
    cast_after_guard: bool = False


#: State fields the scaffold fills itself (every other field holds one array per leaf).
KNOWN_FIELDS = ("key", "server_error", "bits_sent")


def scaffold(
    state: type,
    axis_name: AxisName,
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int | None = None,
    *,
    fields: Sequence[str] | None = None,
    **options: Any,
) -> Scaffold:
    """A :class:`Scaffold`, its ``bucket_size`` and ``state_dtype`` checked.

    Args:
      state: the state NamedTuple type.
      axis_name: the data-parallel axis.
      flatten: one leaf for the whole tree.
      bucket_size: buckets of this many entries of the flattened tree, or ``None``.
      seed: seed of the state's ``key``, or ``None`` for a state without one.
      fields: the per-leaf fields; ``None``: every field of ``state`` but
        :data:`KNOWN_FIELDS`.
      **options: the other fields of :class:`Scaffold`.

    Returns:
      The :class:`Scaffold`.

    Raises:
      ValueError: ``bucket_size`` or ``state_dtype`` invalid (naming it).
    """
    check_grouping(flatten, bucket_size)
    if fields is None:
        fields = [f for f in state._fields if f not in KNOWN_FIELDS]
    sc = Scaffold(state, axis_name, tuple(fields), flatten, bucket_size, seed, **options)
    return sc._replace(state_dtype=check_state_dtype(sc.state_dtype))


def exchanged(
    state: type,
    comp: Compressor,
    axis_name: AxisName,
    flatten: bool,
    bucket_size: int | None,
    seed: int,
    exchange: str | Exchange,
    state_dtype: Any,
    **options: Any,
) -> Scaffold:
    """The scaffold of a transformation whose messages travel by
    :func:`compjax.exchange.compressed_mean`: a shared key, and the shard owners' memories
    where the exchange keeps them.

    Args:
      state: the state NamedTuple type (with ``key`` and ``server_error`` fields).
      comp: the compressor.
      axis_name, flatten, bucket_size, seed, exchange, state_dtype: the transformation's
        own arguments (in the order of their signatures).
      **options: the other fields of :class:`Scaffold` (``pieces``).

    Returns:
      The :class:`Scaffold`.

    Raises:
      ValueError: ``state_dtype``, ``exchange`` or ``bucket_size`` invalid.
    """
    state_dtype = check_state_dtype(state_dtype)
    server = ServerMemory(comp, exchange, state_dtype)
    return scaffold(
        state,
        axis_name,
        flatten,
        bucket_size,
        seed,
        server=server,
        state_dtype=state_dtype,
        **options,
    )


class Round(NamedTuple):
    """One step's inputs, as :func:`begin` read them.

    Attributes:
      leaves: the updates, split.
      check: the non-finite check of the input, for the guard.
      rows: one :class:`Leaf` per leaf.
      key: the state's next key (``None`` without one).
      memories: the shard owners' memories as read (one per leaf, ``None`` where not kept).
      old: each field's arrays as read (one list per field).
    """

    leaves: Leaves
    check: Check
    rows: list[Leaf]
    key: Any
    memories: list[Any]
    old: list[list[jax.Array]]


def _leaves(sc: Scaffold, tree: Any) -> Leaves:
    return Leaves(tree, sc.flatten, sc.bucket_size)


def _per_worker(sc: Scaffold, field: str) -> bool:
    return field in sc.state.PER_WORKER


def init(sc: Scaffold, params: Any) -> Any:
    """The state at step 0: zeros in every field, a fresh key, empty memories and counter.

    Args:
      sc: the scaffold.
      params: the parameters (or any tree of their shapes).

    Returns:
      An instance of ``sc.state``.
    """
    values: dict[str, Any] = {}
    if sc.fields or sc.server is not None:  # (a state without them never splits the params)
        leaves = _leaves(sc, params)
        fill = state_zeros(sc.state_dtype)
        for f in sc.fields:
            values[f] = (
                leaves.worker_state(fill) if _per_worker(sc, f) else leaves.shared_state(fill)
            )
        if sc.server is not None:
            values["server_error"] = sc.server.init(leaves)
    if sc.seed is not None:
        values["key"] = init_key(sc.seed)
    if getattr(sc.state, "COUNTS_BITS", False):
        values["bits_sent"] = new_counter()
    return sc.state(**values)


def begin(sc: Scaffold, updates: Any, state: Any, check: Check | None = None) -> Round:
    """Split ``updates``, check them, and read what each leaf's step needs of ``state``.

    Args:
      sc: the scaffold.
      updates: this worker's updates.
      state: the transformation's state.
      check: the input's non-finite check where the caller made it (on another input
        than ``updates``); ``None``: :func:`any_non_finite` of the leaves.

    Returns:
      A :class:`Round`.

    Raises:
      ValueError: the state was built for another params structure.
    """
    leaves = _leaves(sc, updates)
    inputs = leaves.messages if sc.pieces else leaves.arrays
    if check is None:
        check = any_non_finite(inputs, sc.axis_name)
    n = len(inputs)
    old = [leaves.read(getattr(state, f), f, per_worker=_per_worker(sc, f)) for f in sc.fields]
    memories = [None] * n if sc.server is None else sc.server.read(leaves, state.server_error)
    key, keys = (None, [None] * n) if sc.seed is None else step_keys(state.key, n)
    entries = list(zip(*old, strict=True)) if old else [()] * n
    rows = [Leaf(*row) for row in zip(inputs, keys, memories, entries, strict=True)]
    return Round(leaves, check, rows, key, memories, old)


def end(sc: Scaffold, rnd: Round, state: Any, steps: Sequence[LeafStep]) -> tuple[Any, Any]:
    """The updates and the new state from each leaf's step, through the guard.

    Args:
      sc: the scaffold.
      rnd: what :func:`begin` read.
      state: the state the step started from (kept if the step is refused).
      steps: one :class:`LeafStep` per leaf, in leaf order.

    Returns:
      ``(updates, new_state)``: the updates rebuilt into the tree (NaN where the step
      is refused) and the new state (the old one where refused).
    """
    leaves = rnd.leaves
    new: dict[str, Any] = {}
    for i, f in enumerate(sc.fields):
        arrays = cast_like([s.state[i] for s in steps], rnd.old[i])
        new[f] = leaves.write(arrays, per_worker=_per_worker(sc, f))
    if sc.seed is not None:
        new["key"] = rnd.key
    if sc.server is not None:
        new["server_error"] = sc.server.write(leaves, [s.memory for s in steps], rnd.memories)
    if getattr(sc.state, "COUNTS_BITS", False):
        counter = state.bits_sent[0]
        for s in steps:
            for count, bits in s.sent:
                counter = add_bits(counter, count, bits)
        new["bits_sent"] = counter[None]
    out = [s.out for s in steps]
    out, new_state = guarded(
        rnd.check, out, state._replace(**new), state, [s.finite for s in steps]
    )
    if sc.cast_after_guard:
        out = cast_like(out, leaves.arrays)
    return leaves.rebuild(out), new_state


def leafwise(sc: Scaffold, step: Callable[[Leaf], LeafStep]) -> optax.GradientTransformation:
    """The transformation that runs ``step`` on each leaf of the updates, every step.

    Args:
      sc: the scaffold (:func:`scaffold`).
      step: one worker's step on one leaf.

    Returns:
      An ``optax.GradientTransformation`` (its update counted as one round).
    """

    def init_fn(params):
        return init(sc, params)

    def update_fn(updates, state, params=None):
        rnd = begin(sc, updates, state)
        return end(sc, rnd, state, [step(leaf) for leaf in rnd.rows])

    return optax.GradientTransformation(init_fn, counted(update_fn))
