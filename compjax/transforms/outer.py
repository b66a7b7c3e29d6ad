"""The outer round of the local-step transformations: what DiLoCo, Streaming DiLoCo and
SparseLoCo share.

Each worker takes one inner step on its own params (:meth:`LocalSteps.inner_step`); at a
round's end its pseudo-gradient ``theta - theta_i`` (:func:`pseudo_gradient`,
plus its decayed error memory) travels through a compressed exchange (a
``send``, such as :class:`CompressedMean`), the outer optimizer updates the
global params ``theta`` from the mean (:func:`outer_round`), and the update
returned moves every worker to them (:func:`moved`).  :class:`EveryH` is the
whole transformation when every leaf synchronises on the same steps (every
``sync_every``-th): :func:`compjax.diloco` and :func:`compjax.sparseloco`.
:func:`compjax.streaming_diloco` runs :func:`outer_round` per fragment on
its own schedule.

The state is laid out as :class:`compjax.DiLoCoState` (see
:mod:`compjax.transforms.diloco`): ``count``, ``key``, the shared
``global_params`` (float32) and ``outer_state``, and each worker's
``inner_state``, ``error`` and ``server_error`` (:meth:`LocalSteps.init`).

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
  "DiLoCo: Distributed Low-Communication Training of Language Models",
  arXiv 2311.08105, 2023 (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import collectives, recording
from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.compressors.dense import identity
from compjax.draws import init_key, step_keys
from compjax.exchange import Exchange
from compjax.guards import any_non_finite, guarded
from compjax.transforms.base import Leaves, ServerMemory, cast_like, state_zeros
from compjax.transforms.per_worker_params import check_params_dtype

#: ``send(key, p, memory) -> (mean, residual, memory)``: one leaf's pseudo-gradient ``p``
#: exchanged; ``residual`` is ``None`` where no error memory is kept.  A send whose
#: ``whole_tree`` is true takes and returns lists, every leaf's at once
#: (:class:`GatheredMerge`): ``send(keys, ps, memories) -> (means, residuals, memories)``.
Send = Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any, Any]]


def check_positive(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is a positive integer (``bool`` is not one).

    Raises:
      ValueError: naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def error_memory(
    compressor: Compressor | None, error_feedback: bool | None
) -> tuple[Compressor, bool]:
    """The compressor (the identity for ``None``) and whether an error memory is kept.

    ``error_feedback=None`` keeps one exactly for a biased compressor.

    Raises:
      ValueError: ``error_feedback=True`` without a compressor.
    """
    if compressor is None and error_feedback:
        raise ValueError("error_feedback=True needs a compressor: the exact mean loses nothing")
    comp = identity() if compressor is None else compressor
    return comp, (not comp.unbiased) if error_feedback is None else bool(error_feedback)


class InnerStep(NamedTuple):
    """One inner step on this worker's own params, and the step's shared draws."""

    leaves: Leaves  # the gradients' leaves
    bad: Any  # the non-finite check of the gradients (compjax.guards)
    inner_state: Any  # the new inner state, without the worker axis
    local: list[jax.Array]  # the params after the inner update
    params: list[jax.Array]  # the params before it
    inner_out: list[jax.Array]  # the inner updates, in the wider of theirs and the params' dtype
    key: jax.Array  # the state's next key
    keys: list[jax.Array]  # one key per leaf for this step's messages
    count: jax.Array  # the steps taken, this one included


def pseudo_gradient(
    theta: jax.Array, local: jax.Array, error: jax.Array | None, decay: float = 1.0
) -> jax.Array:
    """``theta - local`` in ``theta``'s dtype, plus ``decay * error`` where a memory is kept."""
    p = theta - local.astype(theta.dtype)
    if error is None:
        return p
    return p + (error if decay == 1.0 else jnp.asarray(decay, error.dtype) * error)


def outer_round(
    outer: optax.GradientTransformation,
    send: Send,
    keys: Sequence[jax.Array],
    theta: Any,
    outer_state: Any,
    local: Sequence[jax.Array],
    errors: Sequence[jax.Array | None],
    memories: Sequence[jax.Array | None],
    decay: float = 1.0,
) -> tuple[Any, Any, list, list]:
    """A round's end: each leaf's pseudo-gradient sent, then the outer step on ``theta``.

    Args:
      outer: the outer optimizer, stepped with the mean pseudo-gradient as gradient.
      send: the exchange of one leaf (:data:`Send`).
      keys: one key per leaf.
      theta: the global params (a pytree whose leaves match ``local``).
      outer_state: ``outer``'s state for ``theta``.
      local: this worker's params after the inner step, one per leaf.
      errors: the error memories (``None`` entries: none kept).
      memories: the shard owners' memories (``None`` entries: none kept).
      decay: the factor on the error memory before it is added.

    Returns:
      The new ``theta`` (``theta``'s tree), outer state, error memories and
      shard owners' memories.
    """
    means, new_errors, new_memories = [], [], []
    if getattr(send, "whole_tree", False):
        triples = zip(jax.tree.leaves(theta), local, errors, strict=True)
        ps = [pseudo_gradient(t, lo, e, decay) for t, lo, e in triples]
        means, residuals, new_memories = send(keys, ps, memories)
        new_errors = [e if r is None else r for e, r in zip(errors, residuals, strict=True)]
    else:
        leaves = zip(keys, jax.tree.leaves(theta), local, errors, memories, strict=True)
        for k, t, lo, e, m in leaves:
            p = pseudo_gradient(t, lo, e, decay)
            mean, residual, memory = send(k, p, m)
            means.append(mean)
            new_errors.append(e if residual is None else residual)
            new_memories.append(memory)
    delta = jax.tree.unflatten(jax.tree.structure(theta), means)
    outer_updates, outer_state = outer.update(delta, outer_state, theta)
    return optax.apply_updates(theta, outer_updates), outer_state, new_errors, new_memories


def moved(target: jax.Array, own: jax.Array, like: jax.Array) -> jax.Array:
    """The update taking ``own`` params to ``target``, in ``like``'s dtype."""
    return (target - own.astype(target.dtype)).astype(like.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class CompressedMean:
    """:data:`Send` through a compressed exchange (:func:`compjax.exchange.compressed_mean`).

    ``mean`` is that function (given, so that a caller's module decides which
    one runs); the residual is kept only with ``keep_error``.
    """

    mean: Callable
    comp: Compressor
    axis_name: AxisName
    exchange: str | Exchange
    keep_error: bool

    def __call__(self, key: jax.Array, p: jax.Array, memory: Any) -> tuple:
        sent = self.mean(self.comp, key, p, self.axis_name, self.exchange, memory)
        return sent.mean, (sent.residual(p) if self.keep_error else None), sent.memory


def gathered(comp: Compressor, key: jax.Array, p: jax.Array, axis_name: AxisName) -> tuple:
    """This worker's compressed ``p`` and every worker's, all-gathered: ``(payload, gathered)``.

    The payload is recorded as an all-gather (:func:`compjax.communication`);
    ``gathered`` carries a leading worker axis.
    """
    payload = comp.compress(collectives.worker_key(key, axis_name), p)
    recording.record("payload", payload, "all_gather", axis_name)
    return payload, collectives.all_gather(payload, axis_name)


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredMerge:
    """:data:`Send` of a robust merge over the whole tree: every worker's compressed
    pseudo-gradient all-gathered (:func:`gathered`), decoded, and the stacked messages of all
    leaves merged at once by ``merge`` (``merge(stacked) -> merged``, a function of
    :mod:`compjax.merges`: a worker's message is its whole pseudo-gradient).

    The residual (kept only with ``keep_error``) is this worker's pseudo-gradient less its own
    message.  No shard owner's memory is kept.
    """

    comp: Compressor
    axis_name: AxisName
    merge: Callable
    keep_error: bool
    whole_tree = True

    def __call__(self, keys: Sequence[jax.Array], ps: Sequence[jax.Array], memories) -> tuple:
        stacked, residuals = [], []
        for key, p in zip(keys, ps, strict=True):
            payload, every = gathered(self.comp, key, p, self.axis_name)
            decoded = jax.vmap(self.comp.decompress)(every).reshape(-1, p.size)
            stacked.append(decoded.astype(jnp.promote_types(p.dtype, jnp.float32)))
            residuals.append(self.comp.subtract_decoded(payload, p) if self.keep_error else None)
        merged = self.merge(stacked)
        means = [m.reshape(p.shape).astype(p.dtype) for m, p in zip(merged, ps, strict=True)]
        return means, residuals, list(memories)


@dataclasses.dataclass(frozen=True, eq=False)
class LocalSteps:
    """A local-step transformation's parts, its ``init`` and what its updates share.

    ``init`` is an ``optax.GradientTransformation``'s; a subclass adds its
    ``update`` (wrap it in :func:`compjax.transforms.base.counted`).

    Attributes:
      state_type: the state's NamedTuple (fields as :class:`compjax.DiLoCoState`).
      where: the public function's name, for the messages of errors.
      inner: the inner optimizer (its state per worker).
      outer: the outer optimizer (its state shared).
      sync_every: ``H``, the inner steps of a round.
      axis_name: the workers' axis.
      send: one leaf's exchange (:data:`Send`).
      keep_error: whether each worker keeps an error memory.
      server: the shard owners' memories.
      seed: seed of the shared key.
    """

    state_type: type
    where: str
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    sync_every: int
    axis_name: AxisName
    send: Send
    keep_error: bool
    server: ServerMemory
    seed: int

    def init(self, params: Any) -> Any:
        """A fresh state for the replicated ``params``.

        ``theta`` is ``params`` in float32 (the state dtype), :meth:`outer_init`
        of it the outer state; the inner state gets a leading axis of size 1
        (per worker), the error memory (zeros, float32) is kept only with
        ``keep_error``.

        Raises:
          ValueError: float64 params (:func:`check_params_dtype`).
        """
        check_params_dtype(params, self.where)
        fill = state_zeros(None)
        leaves = Leaves(params, flatten=False)
        theta = leaves.rebuild([a.astype(fill(a).dtype) for a in leaves.arrays])
        return self.state_type(
            count=jnp.zeros([], jnp.int32),
            key=init_key(self.seed),
            global_params=theta,
            outer_state=self.outer_init(theta),
            inner_state=jax.tree.map(lambda x: jnp.asarray(x)[None], self.inner.init(params)),
            error=leaves.worker_state(fill) if self.keep_error else (),
            server_error=self.server.init(leaves),
        )

    def outer_init(self, theta: Any) -> Any:
        """The outer state for the global params ``theta``."""
        return self.outer.init(theta)

    def inner_step(self, updates: Any, state: Any, params: Any) -> InnerStep:
        """``inner`` applied to this worker's ``updates`` and own ``params``.

        Raises:
          ValueError: ``params`` is ``None``.
        """
        if params is None:
            raise ValueError(
                f"{self.where}: update(grads, state, params) needs params, this worker's own params"
            )
        leaves = Leaves(updates, flatten=False)
        bad = any_non_finite(leaves.arrays, self.axis_name)
        inner_state = jax.tree.map(lambda x: x[0], state.inner_state)
        inner_updates, inner_state = self.inner.update(updates, inner_state, params)
        local = jax.tree.leaves(optax.apply_updates(params, inner_updates))
        own = jax.tree.leaves(params)
        # Updates in the wider of the inner update's and the params' dtypes: a sync's update
        # to float32 params is not rounded to a bfloat16 gradient's precision.
        inner_out = [
            u.astype(jnp.promote_types(u.dtype, p.dtype))
            for u, p in zip(jax.tree.leaves(inner_updates), own, strict=True)
        ]
        key, keys = step_keys(state.key, len(leaves.arrays))
        count = state.count + 1
        return InnerStep(leaves, bad, inner_state, local, own, inner_out, key, keys, count)

    def memories(self, step: InnerStep, state: Any) -> tuple[list, list]:
        """The error memories and the shard owners' memories (``None`` entries: none kept)."""
        if self.keep_error:
            errors = step.leaves.read(state.error, "error", per_worker=True)
        else:
            errors = [None] * len(step.leaves.arrays)
        return errors, self.server.read(step.leaves, state.server_error)

    def finish(
        self,
        step: InnerStep,
        state: Any,
        out: list[jax.Array],
        *,
        global_params: Any,
        outer_state: Any,
        errors: Sequence[Any],
        old_errors: Sequence[Any],
        memories: Sequence[Any],
        old_memories: Sequence[Any],
    ) -> tuple[Any, Any]:
        """The step's updates and new state (of ``state``'s type), under the finite guard.

        ``old_errors`` and ``old_memories``: as read by :meth:`memories` (the
        new ones are kept in their dtypes).
        """
        leaves = step.leaves
        new_state = type(state)(
            count=step.count,
            key=step.key,
            global_params=global_params,
            outer_state=outer_state,
            inner_state=jax.tree.map(lambda x: x[None], step.inner_state),
            error=leaves.write(cast_like(errors, old_errors), per_worker=True)
            if self.keep_error
            else (),
            server_error=self.server.write(leaves, memories, old_memories),
        )
        out, new_state = guarded(step.bad, out, new_state, state)
        return leaves.rebuild(out), new_state


@dataclasses.dataclass(frozen=True, eq=False)
class EveryH(LocalSteps):
    """:class:`LocalSteps` whose every leaf synchronises every ``sync_every`` steps.

    The round's end runs under ``lax.cond``: its messages travel on that step
    only.  ``error_decay``: the factor on the error memory before it is
    added to the pseudo-gradient.
    """

    error_decay: float

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        step = self.inner_step(updates, state, params)
        errors, memories = self.memories(step, state)

        # New closures at every trace: a cached branch would not log its messages again.
        def at_sync(local, params, errors, memories):
            theta, outer_state, errors, memories = outer_round(
                self.outer, self.send, step.keys, state.global_params, state.outer_state,
                local, errors, memories, self.error_decay,
            )  # fmt: skip
            targets = jax.tree.leaves(theta)
            out = [moved(*a) for a in zip(targets, params, step.inner_out, strict=True)]
            return out, theta, outer_state, errors, memories

        def in_round(local, params, errors, memories):
            return step.inner_out, state.global_params, state.outer_state, errors, memories

        synced = jax.lax.cond(
            step.count % self.sync_every == 0,
            at_sync,
            in_round,
            step.local,
            step.params,
            errors,
            memories,
        )
        out, theta, outer_state, new_errors, new_memories = synced
        return self.finish(
            step, state, out, global_params=theta, outer_state=outer_state, errors=new_errors,
            old_errors=errors, memories=new_memories, old_memories=memories,
        )  # fmt: skip
