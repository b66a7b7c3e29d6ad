"""What every compjax transformation shares: leaves, per-worker state, keys, state dtypes.

The flow that strings these together, leaf by leaf, is
:mod:`compjax.transforms.scaffold`; a transformation built on it writes one
worker's step on one leaf.

Per-worker state (error memory, local shifts) has a leading axis of size 1
in each worker's view (:meth:`Leaves.worker_state`), so that it concatenates
into a leading worker axis; :func:`state_specs` gives the matching
``PartitionSpec``s (:mod:`compjax.transforms.specs`).

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

Non-finite input: every step runs under the guard of
:mod:`compjax.guards` (:func:`any_non_finite`, :func:`guarded`).
The names of :mod:`compjax.transforms.specs` and
:mod:`compjax.guards` are re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from compjax.exchange import keeps_memory
from compjax.recording import exchange_round
from compjax.transforms.buckets import Buckets
from compjax.transforms.specs import spec_axes


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
