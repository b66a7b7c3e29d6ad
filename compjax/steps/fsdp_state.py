"""The values :func:`compjax.fsdp` works with: its step's state and what it returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class FSDPState(NamedTuple):
    """State of :func:`compjax.fsdp`'s step.

    Attributes:
      opt_state: the optax state, each leaf laid out like its parameter's
        shard (sharded leaves) or replicated.
      key: shared PRNG key of the gradient compressor (raw uint32).
      memory: with ``feedback``, one array per sharded leaf (a tuple in leaf
        order), each worker's own of the leaf's full stored (padded) shape
        (global shape ``(workers, *shape)``, split over the data axis): the error memory
        ``e_i`` (``"ef"``) or the gradient estimate ``g_i`` (``"ef21"``);
        else ``()``.  On a ``(slow, fast)`` pair of axes each worker's
        memory is of the ``1/L`` of the leaf it sends over the slow axis
        (the split dimension divided by ``L``), its rows in the order of the
        params' shards.
      shift: with ``feedback="ef21"``, the owner's shard of
        ``mean_i g_i``, laid out like the parameter; else ``()``.
    """

    opt_state: Any
    key: jax.Array
    memory: tuple = ()
    shift: tuple = ()


class FSDP(NamedTuple):
    """What :func:`compjax.fsdp` returns.

    Attributes:
      init: ``init(params) -> state`` (jitted).
      step: ``step(params, state, *batch) -> (params, state, loss)`` (jitted);
        the params come back sharded as ``param_specs`` say, in their stored
        shapes: a leaf whose split dimension is not a multiple of the
        number of workers comes back padded with zero rows (``unpad``
        gives its own shape).  The loss is NaN on a skipped step.
      param_specs: the parameters' ``PartitionSpec`` s (:func:`compjax.fsdp_specs`),
        of their stored (padded) shapes.
      specs: the :class:`FSDPState`'s ``PartitionSpec`` s.
      exchange: ``exchange(shards) -> grad_shards``, one step's messages in a
        worker's view (inside a mapping over the data axis): the parameter
        gather and the gradient reduce-scatter, without the loss; what
        :func:`compjax.communication` traces to count them.
      shard: ``shard(params) -> params`` (jitted): the params in their stored
        shapes (padded leaves padded with zeros), sharded as ``param_specs``
        say, what ``step`` returns (with ``init(params)``, an orbax restore
        target for this mesh).
      unpad: ``unpad(params) -> params`` (jitted): stored params in their
        own shapes, the padding cut off (a padded leaf comes back
        replicated; the others as they are).
    """

    init: Callable[[Any], FSDPState]
    step: Callable[..., tuple[Any, FSDPState, jax.Array]]
    param_specs: Any
    specs: Any
    exchange: Callable[[Any], Any]
    shard: Callable[[Any], Any]
    unpad: Callable[[Any], Any]
