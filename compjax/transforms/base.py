"""What every compjax transformation shares: leaves, per-worker state, keys, guards.

Per-worker state (error memory, local shifts) has a leading axis of size 1
in each worker's view, so that it concatenates into a leading worker axis:
under ``shard_map`` its global shape is ``(workers, *shape)`` with
``PartitionSpec(axis)``; under ``pmap`` or ``vmap`` it is ``(workers, 1,
*shape)``.  State NamedTuples list their per-worker fields in ``PER_WORKER``;
:func:`state_specs` turns any optimizer state (chains, wrappers) into the
matching ``PartitionSpec`` tree.

Keys: the state holds a raw uint32 PRNG key shared by all workers, split every
step; :mod:`compjax.collectives` folds in the worker index where workers need
independent noise.

State dtype: persistent per-leaf state (error memories, shifts, momenta,
accumulators) is kept in ``float32`` by default, or in the leaf's own dtype
where that is wider (float64), whatever the gradients' dtype: a bfloat16
memory rounds away every increment below 2**-8 of its value, so small
coordinates would never be sent.  Each transformation with such state takes
``state_dtype`` (in the spirit of optax's ``mu_dtype``): ``None`` for that
default, or a floating dtype used for every leaf (:func:`check_state_dtype`,
:func:`state_zeros`).  Messages are still compressed in the gradient's dtype
(the wire format is unchanged), the updates returned keep the gradient's
dtype, and the state's dtypes are fixed at ``init`` (:func:`cast_like`).

Non-finite input: if any worker's update holds an Inf or NaN (one 8-bit
flag per step is reduced with ``pmax``), the transformation returns an update
of NaNs on every worker and keeps its whole state (error memory, shifts, key)
unchanged.  Nothing is silently poisoned (top-k could otherwise drop the NaN
from the message while keeping it in the memory), and ``optax.apply_if_finite``
on the optimizer that follows (which sees the NaNs on every worker) then skips
the step cleanly; wrapped around the compjax transformation instead, it would
test each worker's own gradient and the workers could disagree.  The same
flag refuses a step whose finite input would leave a non-finite update or
state (float32 overflowing on gradients near its largest value, e.g. an
error memory ``x + e`` beyond ``3.4e38``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

from compjax.collectives import (
    any_worker,
    check_worker_local,
    exchange_round,
    record,
    unrecorded,
)
from compjax.compressor import check_float32_range, raw_key
from compjax.exchange import keeps_memory
from compjax.transforms.buckets import Buckets


def counted(update_fn: Callable) -> Callable:
    """Mark one call of ``update_fn`` as one communication round (for accounting).

    Wrappers that trace an update more than once (``optax.MultiSteps``) then
    still count the messages of one round.
    """

    @functools.wraps(update_fn)
    def update(updates, state, params=None):
        with exchange_round(update):
            return update_fn(updates, state, params)

    return update


def init_key(seed: int) -> jax.Array:
    """A raw uint32 key (plain array: serialisable, all-gatherable)."""
    return raw_key(jax.random.key(seed))


# The variable metadata in which compjax.nnx.optimizer records each optimizer-state leaf's spec.
NNX_SPEC = "compjax_spec"


def _axis_names(axis_name) -> tuple[str, ...]:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def spec_axes(spec: Any) -> tuple[str, ...]:
    """The mesh axes a ``PartitionSpec`` (or ``None``) splits over, in order."""
    return tuple(a for entry in tuple(spec or ()) for a in _axis_names(entry))


def is_marked(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "PER_WORKER")


def state_specs(state: Any, axis_name, param_specs: Any = None) -> Any:
    """``PartitionSpec``s of an optimizer state for ``jax.shard_map``.

    Per-worker fields of compjax states get ``P(axis_name)`` (their leading
    worker axis is split across workers); everything else ``P()``
    (replicated).  Works through ``optax.chain``, ``inject_hyperparams``,
    ``MultiSteps`` and any other container.

    Flax NNX: in an ``nnx.State`` (of an optimizer built by
    :func:`compjax.nnx.optimizer`, alone or split together with its model)
    each optimizer-state variable gives the spec it was laid out with, and
    every other variable (the model's params, the step count) ``P()``.

    With ``param_specs`` (the params' own specs, for parameters sharded over
    other mesh axes, e.g. ``{"w": P(None, "model")}``), every state field
    laid out like the params follows them: a per-worker field gets
    ``P(axis_name, *spec)`` (the worker axis, then the parameter's own
    sharding), a shared one the parameter's ``spec``.  Every other per-worker
    field (a bit counter) differs on each device holding a block, so its
    leading axis is split over the data axes and the params' other axes
    together, ``P((axis_name, "model"))``; fields a state lists in
    ``PER_LEAF`` (one entry per leaf, computed from its block, as PowerSGD's
    ``Q``) are split over that leaf's other axes.  ``flatten=True`` and
    ``bucket_size=`` refuse params split over other axes (in ``init``).

    Args:
      state: the state, or its shapes (``jax.eval_shape(opt.init, params)``).
      axis_name: the data-parallel axis (a name or a tuple of names).
      param_specs: ``None`` (parameters replicated over every other axis), or
        a pytree of ``PartitionSpec`` with the params' structure.

    Returns:
      A pytree of ``PartitionSpec`` with the state's structure, usable as
      ``in_specs``/``out_specs`` of ``jax.shard_map``.

    Raises:
      ValueError: an ``nnx.State`` holds the state of an ``nnx.Optimizer``
        that was not built by :func:`compjax.nnx.optimizer` (its per-worker
        fields cannot be told apart).
    """
    split = jax.P(axis_name)
    replicated = jax.P()
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    layout = None if param_specs is None else jax.tree.structure(param_specs, is_leaf=is_spec)
    leaf_specs = [] if param_specs is None else jax.tree.leaves(param_specs, is_leaf=is_spec)
    data_axes = set(_axis_names(axis_name))
    leaf_axes = [tuple(a for a in spec_axes(s) if a not in data_axes) for s in leaf_specs]
    # The other mesh axes any parameter is split over: a per-worker field that is not laid out
    # like the params (a bit counter, a flattened memory) differs on each of their blocks too.
    model_axes = tuple(dict.fromkeys(a for axes in leaf_axes for a in axes))
    per_block = jax.P((*_axis_names(axis_name), *model_axes)) if model_axes else split

    def field_specs(value, per_worker: bool):
        if layout is not None and jax.tree.structure(value) == layout:
            specs = [jax.P(axis_name, *s) if per_worker else s for s in leaf_specs]
            return jax.tree.unflatten(layout, specs)
        return jax.tree.map(lambda _: per_block if per_worker else replicated, value)

    def per_leaf_specs(value):
        """A tuple in leaf order of values computed from each leaf's block (PowerSGD's ``Q``)."""
        if not leaf_axes:
            return jax.tree.map(lambda _: replicated, value)
        if len(value) != len(leaf_axes):
            raise ValueError(
                f"state_specs: param_specs has {len(leaf_axes)} leaves where the state was "
                f"built for {len(value)}: give the specs of the params the state was built for"
            )
        return tuple(
            jax.tree.map(lambda _, axes=axes: jax.P(axes) if axes else replicated, v)
            for v, axes in zip(value, leaf_axes, strict=True)
        )

    def per_worker_grads(leaf):
        if not np.shape(leaf):
            raise ValueError(
                "state_specs: optax.MultiSteps accumulates each worker's own gradient "
                "(acc_grads), which shard_map can only split along a leading axis: a scalar "
                "parameter has none (give it shape (1,))"
            )
        return split

    def variable_spec(var: nnx.Variable):
        if not isinstance(var, nnx.OptArray | nnx.OptVariable):
            return replicated
        recorded = var.get_metadata().get(NNX_SPEC)
        if recorded is None:
            raise ValueError(
                "state_specs: this nnx.State holds the state of an nnx.Optimizer built "
                "directly, whose per-worker fields nnx.state no longer marks (and whose "
                "tx.init ran outside shard_map); build it with compjax.nnx.optimizer(model, "
                "tx, mesh, axis_name, wrt=...)"
            )
        return recorded

    def spec(node):
        if isinstance(node, nnx.Variable):
            return variable_spec(node)
        if isinstance(node, optax.MultiStepsState):
            # acc_grads holds each worker's own sum of gradients, the params' shape on every
            # worker: split along its first axis (globally n times the params' first axis).
            return node._replace(
                mini_step=replicated,
                gradient_step=replicated,
                inner_opt_state=state_specs(node.inner_opt_state, axis_name, param_specs),
                acc_grads=jax.tree.map(per_worker_grads, node.acc_grads),
                skip_state=jax.tree.map(lambda _: replicated, node.skip_state),
            )
        if is_marked(node):
            per_leaf = getattr(node, "PER_LEAF", ())
            fields = [
                per_leaf_specs(v) if f in per_leaf else field_specs(v, f in node.PER_WORKER)
                for f, v in zip(node._fields, node, strict=True)
            ]
            return type(node)(*fields)
        return replicated

    def stop(node):
        return is_marked(node) or isinstance(node, optax.MultiStepsState | nnx.Variable)

    return jax.tree.map(spec, state, is_leaf=stop)


class Leaves:
    """The arrays a transformation works on: each leaf, the whole tree, or buckets of it.

    :attr:`arrays` are the arrays themselves.  :attr:`messages` are the same
    values as :func:`compjax.exchange.compressed_mean` best takes them: in
    buckets, each bucket as its pieces (:class:`compjax.pieces.Pieces`), so an
    elementwise compressor encodes it without concatenating it; otherwise the
    arrays.  A transformation that sends the updates themselves exchanges
    :attr:`messages` and hands the results (pieces for a bucket) back to
    :meth:`rebuild`; one that computes on them (error feedback adds its
    memory) takes :attr:`arrays`, each bucket then concatenated once.

    Args:
      tree: the updates (or params) pytree.
      flatten: treat the tree as one vector (one compressor call, one scale)
        instead of compressing layer by layer.
      bucket_size: split the flattened tree into consecutive buckets of this
        many entries (the last one shorter), as PyTorch DDP buckets
        gradients: one compressor call, one scale and one collective per
        bucket, so a step sends a few large messages instead of one per leaf.
    """

    def __init__(self, tree: Any, flatten: bool, bucket_size: int | None = None):
        self.flatten = flatten
        self.bucketed = bucket_size is not None
        if flatten or self.bucketed:
            _refuse_sharded("bucket_size" if self.bucketed else "flatten", tree)
        if self.bucketed:
            self._buckets = Buckets(tree, bucket_size)
            self.messages: list[Any] = self._buckets.pieces(tree)
            return
        if flatten:
            flat, self._unravel = ravel_pytree(tree)
            self.arrays = [flat]
        else:
            self.arrays, self._treedef = jax.tree.flatten(tree)
        self.messages = self.arrays

    @functools.cached_property
    def arrays(self) -> list[jax.Array]:
        """In buckets: each bucket concatenated (built when first asked for)."""
        return [p.join() for p in self.messages]

    def _pack(self, arrays: Sequence[jax.Array]) -> Any:
        """A state field from one array per entry of :attr:`arrays`."""
        if self.bucketed:
            return tuple(arrays)
        if self.flatten:
            return arrays[0]
        return jax.tree.unflatten(self._treedef, list(arrays))

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        """Inverse: a list of arrays like :attr:`arrays` back into the tree (a bucket may also
        be a list of its pieces, as :func:`compjax.exchange.compressed_mean` returns them)."""
        if self.bucketed:
            return self._buckets.rebuild(arrays)
        if self.flatten:
            return self._unravel(arrays[0])
        return jax.tree.unflatten(self._treedef, list(arrays))

    def worker_state(self, fill: Callable[[jax.Array], jax.Array] = jnp.zeros_like) -> Any:
        """Per-worker state: ``fill(leaf)`` with a leading axis of size 1."""
        return self._pack([fill(a)[None] for a in self.arrays])

    def shared_state(self, fill: Callable[[jax.Array], jax.Array] = jnp.zeros_like) -> Any:
        return self._pack([fill(a) for a in self.arrays])

    def read(self, state_tree: Any, name: str, per_worker: bool) -> list[jax.Array]:
        """The arrays of a state field, checked against the updates' structure.

        Raises:
          ValueError: the state was built for another params structure.
        """
        if self.bucketed:
            arrays = list(state_tree) if isinstance(state_tree, tuple | list) else [state_tree]
            if len(arrays) != len(self.messages):
                raise ValueError(
                    f"state field {name!r} has {len(arrays)} buckets where the updates have "
                    f"{len(self.messages)}: was the optimizer state initialised for other params?"
                )
        elif self.flatten:
            arrays = [state_tree]
        else:
            arrays, treedef = jax.tree.flatten(state_tree)
            if treedef != self._treedef:
                raise ValueError(
                    f"state field {name!r} has structure {treedef} but the updates have "
                    f"{self._treedef}: was the optimizer state initialised for other params?"
                )
        lead = (1,) if per_worker else ()
        for got, leaf in zip(arrays, self.messages, strict=True):
            if got.shape != lead + leaf.shape:
                raise ValueError(
                    f"state field {name!r} has a leaf of shape {got.shape} where the updates "
                    f"need {lead + leaf.shape}: was the optimizer state initialised for other "
                    f"params?"
                )
        return [a[0] for a in arrays] if per_worker else arrays

    def write(self, arrays: Sequence[jax.Array], per_worker: bool) -> Any:
        return self._pack([a[None] for a in arrays] if per_worker else list(arrays))


def _refuse_sharded(option: str, tree: Any) -> None:
    """Refuse to flatten leaves that are split over mesh axes (explicit sharding).

    Flattening mixes the blocks of a parameter split over a model axis into one vector
    whose length and buckets differ between the global array and each device's block.
    """
    for leaf in jax.tree.leaves(tree):
        try:
            axes = spec_axes(jax.typeof(leaf).sharding.spec)
        except (AttributeError, TypeError):
            continue
        if axes:
            raise ValueError(
                f"{option}: a parameter of shape {np.shape(leaf)} is split over mesh axis "
                f"{axes[0]!r}, and flattening would mix its blocks; on model-sharded params "
                f"compress leaf by leaf (leave {option} unset)"
            )


def check_grouping(flatten: bool, bucket_size: int | None) -> None:
    """Construction-time check of ``flatten`` and ``bucket_size``.

    Raises:
      ValueError: ``bucket_size`` not a positive integer, or given with ``flatten``.
    """
    if bucket_size is None:
        return
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive integer or None, got {bucket_size!r}")
    if flatten:
        raise ValueError("bucket_size: give either flatten=True or bucket_size, not both")


def step_keys(key: jax.Array, num: int) -> tuple[jax.Array, list[jax.Array]]:
    """The next state key and one key per leaf for this step."""
    next_key, step = jax.random.split(key)
    return next_key, list(jax.random.split(step, num))


def saturated(x: jax.Array) -> jax.Array:
    """A non-negative accumulator (sums of squares) capped at its dtype's largest finite value.

    Squares of finite entries above the square root of that value overflow;
    capping keeps such state finite (it only ever means "very large").
    """
    return jnp.minimum(x, jnp.finfo(x.dtype).max)


def all_finite(arrays: Sequence[Any]) -> jax.Array:
    """Whether every entry of ``arrays`` (arrays, or pytrees of them such as pieces) is finite.

    Pieces are checked through their whole sources (the leaves they are cut
    from), never sliced: the flag is one for the step, and every entry of a
    source belongs to some bucket.
    """
    leaves = jax.tree.leaves(list(arrays))
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in leaves] or [jnp.bool_(True)]))


class Check(NamedTuple):
    """What :func:`any_non_finite` found, for :func:`guarded` to decide the step by.

    Attributes:
      local: whether this worker's input holds an Inf or NaN (not yet reduced).
      axis_name: the workers' axes, over which :func:`guarded` reduces.
    """

    local: jax.Array
    axis_name: Any


def any_non_finite(arrays: Sequence[jax.Array], axis_name) -> Check:
    """Whether this worker's ``arrays`` hold an Inf or NaN, for :func:`guarded`.

    Every transformation calls this first, so it also checks that ``arrays``
    are each worker's own (:func:`compjax.collectives.check_worker_local`) and
    no wider than float32 (:func:`compjax.compressor.check_float32_range`).
    The step's one 8-bit flag is logged here (the first message of a round)
    and reduced over the workers in :func:`guarded`, once the step's updates
    and state are known.

    Raises:
      ValueError: a float64 leaf (``jax_enable_x64``), or a leaf already
        reduced over the workers.
    """
    for a in arrays:
        check_float32_range(a.dtype, "the updates")
    check_worker_local(jax.tree.leaves(list(arrays)), axis_name)
    local = ~all_finite(arrays)
    record("flag", local.astype(jnp.int8), "all_reduce", axis_name)
    return Check(local, axis_name)


def guarded(check: Check, out: list[jax.Array], new_state: Any, old_state: Any):
    """NaN updates and the old state if the step is refused; else the new ones.

    A step is refused (on every worker: one 8-bit ``pmax``) if any worker's
    input holds an Inf or NaN, or if finite input would leave a non-finite
    update or a non-finite value in the new state (float32 overflowing on
    the largest finite gradients): persistent state is never poisoned, and
    ``optax.apply_if_finite`` skips the step.
    """
    floats = [
        a
        for a in jax.tree.leaves(list(out)) + jax.tree.leaves(new_state)
        if jnp.issubdtype(a.dtype, jnp.floating)
    ]
    with unrecorded():  # logged by any_non_finite
        bad = any_worker(check.local | ~all_finite(floats), check.axis_name)
    # (A bucket's update may come in pieces, a list of arrays: each piece guarded.)
    out = [jax.tree.map(lambda a: jnp.where(bad, jnp.nan, a).astype(a.dtype), o) for o in out]
    return out, jax.tree.map(lambda n, o: jnp.where(bad, o, n), new_state, old_state)


def check_state_dtype(state_dtype: Any) -> np.dtype | None:
    """Construction-time check of ``state_dtype``: ``None`` or a floating dtype.

    Returns:
      ``None``, or the dtype as a numpy dtype.

    Raises:
      ValueError: ``state_dtype`` is not a floating dtype (the message names it).
    """
    if state_dtype is None:
        return None
    try:
        dtype = jnp.dtype(state_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"state_dtype must be None (float32, or the parameter's dtype if wider) or a "
            f"floating dtype such as jnp.float32, got {state_dtype!r}"
        )
    return dtype


def state_zeros(state_dtype: np.dtype | None) -> Callable[[jax.Array], jax.Array]:
    """A ``fill`` for :meth:`Leaves.worker_state`: zeros of a leaf's shape in the state dtype.

    ``state_dtype=None``: ``float32``, or the leaf's dtype where that is wider.
    """

    def fill(a: jax.Array) -> jax.Array:
        dtype = jnp.promote_types(a.dtype, jnp.float32) if state_dtype is None else state_dtype
        return jnp.zeros(a.shape, dtype)

    return fill


def cast_like(arrays: Sequence[jax.Array], old: Sequence[jax.Array]) -> list[jax.Array]:
    """``arrays`` in the dtypes of the state they replace (fixed at ``init``)."""
    return [a.astype(o.dtype) for a, o in zip(arrays, old, strict=True)]


class ServerMemory:
    """The shard owners' error memories of a scatter-gather exchange (see :mod:`compjax.exchange`).

    Kept, per worker and with each leaf's shape, only where
    :func:`compjax.exchange.keeps_memory` says so (a biased compressor over a
    scatter-gather exchange); otherwise the state field is an empty tuple.
    Kept in the state dtype (:func:`state_zeros`).
    """

    def __init__(self, comp, exchange, state_dtype: np.dtype | None = None):
        self.kept = keeps_memory(comp, exchange)
        self.fill = state_zeros(state_dtype)

    def init(self, leaves: Leaves) -> Any:
        return leaves.worker_state(self.fill) if self.kept else ()

    def read(self, leaves: Leaves, field: Any) -> list[jax.Array | None]:
        if not self.kept:
            return [None] * len(leaves.messages)
        return leaves.read(field, "server_error", per_worker=True)

    def write(
        self, leaves: Leaves, arrays: Sequence[jax.Array | None], old: Sequence[jax.Array | None]
    ) -> Any:
        """The new memories ``arrays``, in the dtypes of the ``old`` ones (from :meth:`read`)."""
        if not self.kept:
            return ()
        return leaves.write(cast_like(arrays, old), per_worker=True)
