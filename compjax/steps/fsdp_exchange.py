"""The messages of one :func:`compjax.fsdp` step, in a worker's view: the parameter gather and
the gradient reduce-scatter, leaf by leaf, with error feedback or EF21 on the compressed one.

The feedback rules are the transformations' own
(:func:`compjax.transforms.error_feedback.ef_message` and
:func:`~compjax.transforms.error_feedback.ef_error`,
:func:`compjax.transforms.ef21.ef21_message` and :func:`~compjax.transforms.ef21.ef21_estimates`),
applied to what the reduce-scatter sends: each sharded leaf with its split dimension first, and
on a ``(slow, fast)`` pair only the ``1/L`` of it that the worker sends over the slow axis.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.axes import worker_index
from compjax.draws import step_keys
from compjax.exchange import Exchanged, compressed_reduce_scatter
from compjax.exchange.scatter import shared_scales
from compjax.guards import Check, any_non_finite
from compjax.recording import record
from compjax.steps import hpz
from compjax.steps.fsdp_layout import owned_part, without_padding
from compjax.steps.fsdp_plan import Plan
from compjax.steps.fsdp_state import FSDPState
from compjax.steps.param_gather import gathered
from compjax.transforms.ef21 import ef21_estimates, ef21_message
from compjax.transforms.error_feedback import ef_error, ef_message


class Prepared(NamedTuple):
    """What one sharded leaf sends over the slow axis (split dimension first).

    Attributes:
      x: the message compressed, in the gradient's dtype.
      key: its key (on a pair, with the worker's fast index folded in).
      message: the message before the cast (in the memory's precision with feedback).
      memory: the worker's memory, split dimension first (``None`` without feedback).
      shard_shape: the shape of the shard each worker receives (split dimension first).
    """

    x: jax.Array
    key: jax.Array
    message: jax.Array
    memory: jax.Array | None
    shard_shape: tuple[int, ...]


class Reduced(NamedTuple):
    """The gradient reduce-scatter of one step, in a worker's view.

    Attributes:
      shards: each leaf's mean gradient (its owned shard, or the whole replicated leaf), in
        leaf order: what the optimizer sees.
      key: the state's next key.
      memory: the new memories (:attr:`compjax.steps.fsdp_state.FSDPState.memory`).
      shift: the new shifts (:attr:`compjax.steps.fsdp_state.FSDPState.shift`).
      check: the non-finite check of this worker's gradient.
    """

    shards: list[jax.Array]
    key: jax.Array
    memory: tuple
    shift: tuple
    check: Check


def gather_leaf(plan: Plan, x: jax.Array, dim: int | None) -> jax.Array:
    """The whole leaf from every worker's shard ``x``.

    Args:
      plan: the step's plan.
      x: this worker's shard (the whole leaf if replicated).
      dim: the split dimension (``None``: replicated, returned as it is).

    Returns:
      The leaf gathered over the slow axis as ``plan.gather`` says (on a pair, the secondary
      shard), then over the fast axis exactly.
    """
    whole = gathered(x, dim, plan.slow, plan.gather, plan.gather_block)
    return whole if plan.fast is None else hpz.fast_gathered(whole, dim, plan.fast)


def gather_all(plan: Plan, params: Any) -> Any:
    """The whole parameters from every worker's shards (as the forward pass sees them).

    Args:
      plan: the step's plan.
      params: this worker's shards.

    Returns:
      The gathered params (stored shapes).
    """
    gather = functools.partial(gather_leaf, plan)
    return jax.tree.map(gather, params, plan.dims, is_leaf=lambda x: x is None)


def prepared(
    plan: Plan, key: jax.Array, g: jax.Array, dim: int | None, memory: jax.Array | None
) -> Prepared | None:
    """What one leaf sends over the slow axis.

    Args:
      plan: the step's plan.
      key: the leaf's key.
      g: this worker's gradient of the leaf (stored shape).
      dim: the leaf's split dimension (``None``: replicated).
      memory: the worker's memory of the leaf (``None`` without feedback).

    Returns:
      A :class:`Prepared`: the gradient with its split dimension first (on a pair, this
      worker's ``1/L`` averaged over its host), with the memory added (EF) or subtracted
      (EF21); ``None`` for a replicated leaf.
    """
    if dim is None:
        return None
    moved = jnp.moveaxis(g, dim, 0)
    shard_shape = (moved.shape[0] // plan.n, *moved.shape[1:])
    if plan.fast is not None:  # the host's mean of this worker's 1/L, with a key of its own
        moved = hpz.locally_reduced(moved, plan.fast)
        key = jax.random.fold_in(key, worker_index(plan.fast))
    if plan.feedback is None:
        return Prepared(moved, key, moved, None, shard_shape)
    memory = jnp.moveaxis(memory, dim, 0)
    rule = ef_message if plan.feedback == "ef" else ef21_message
    message = rule(moved, memory)
    return Prepared(message.astype(g.dtype), key, message, memory, shard_shape)


def replicated_mean(plan: Plan, g: jax.Array) -> jax.Array:
    """The exact mean over every worker of a replicated leaf's gradient ``g``.

    Args:
      plan: the step's plan.
      g: this worker's gradient.

    Returns:
      The mean (summed over the fast axis first on a pair).
    """
    g = g if plan.fast is None else hpz.fast_summed(g, plan.fast)
    record("replicated_mean", g, "all_reduce", plan.slow)
    return collectives.psum(g, plan.slow) / plan.n


def sharded_mean(
    plan: Plan, prep: Prepared, dim: int, scale: jax.Array | None, rows: int | None
) -> Exchanged:
    """The compressed reduce-scatter of one sharded leaf.

    Args:
      plan: the step's plan.
      prep: :func:`prepared`'s.
      dim: the leaf's split dimension.
      scale: the agreed scale of a summable compressor (``None``: agreed in the
        reduce-scatter).
      rows: the leaf's own rows if it is padded, else ``None``.

    Returns:
      :class:`compjax.exchange.Exchanged` whose ``mean`` is this worker's owned shard of the
      mean (laid out like the parameter, its padding zero: a sign's decode is not) and whose
      ``local`` is what this worker sent, decoded (split dimension first; the leaf on a flat
      step, its host's ``1/L`` on a pair; padding rows zero).
    """
    sent = compressed_reduce_scatter(plan.comp, prep.key, prep.x, plan.slow, scale)
    mean = jnp.moveaxis(sent.mean.reshape(prep.shard_shape), 0, dim)
    shard = owned_part(mean, dim, rows, plan.shard_axes)
    first = 0 if plan.fast is None else worker_index(plan.fast) * prep.x.shape[0]
    return Exchanged(mean=shard, local=without_padding(sent.local, first, rows))


def with_feedback(
    plan: Plan, prep: Prepared, dim: int, shift: jax.Array | None, sent: Exchanged
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The gradient shard the optimizer sees, and the new memory and shift of ``feedback``.

    Args:
      plan: the step's plan.
      prep: :func:`prepared`'s.
      dim: the leaf's split dimension.
      shift: the owner's shard of ``mean_i g_i`` (EF21), else ``None``.
      sent: :func:`sharded_mean`'s.

    Returns:
      ``(shard, memory, shift)``: the mean shard (EF21: the new shift, in the gradient's
      dtype); the new memory, laid out like the parameter (``None`` without feedback); the
      new shift (``None`` but with EF21).
    """
    if plan.feedback is None:
        return sent.mean, None, None
    if plan.feedback == "ef":
        return sent.mean, jnp.moveaxis(ef_error(prep.message, sent), 0, dim), None
    memory, estimate = ef21_estimates(prep.memory, shift, sent)
    return estimate.astype(sent.mean.dtype), jnp.moveaxis(memory, 0, dim), estimate


def state_memories(plan: Plan, state: FSDPState, count: int) -> tuple[list, list]:
    """Each leaf's memory and shift as the state holds them.

    Args:
      plan: the step's plan.
      state: the step's state (in a worker's view).
      count: the number of leaves.

    Returns:
      ``(memories, shifts)``: one entry per leaf, ``None`` where none is kept.
    """
    memories, shifts = [None] * count, [None] * count
    for j, i in enumerate(plan.ef_leaves):
        memories[i] = state.memory[j][0]
        shifts[i] = state.shift[j] if plan.feedback == "ef21" else None
    return memories, shifts


def agreed_scales(plan: Plan, preps: list[Prepared | None]) -> list[jax.Array | None]:
    """A summable compressor's scales, agreed in one ``pmax`` for every sharded leaf.

    Args:
      plan: the step's plan.
      preps: :func:`prepared`'s, one per leaf.

    Returns:
      One scale per leaf (``None`` for a replicated leaf or a compressor without one).
    """
    sent = [i for i, p in enumerate(preps) if p is not None]
    keys, xs = [preps[i].key for i in sent], [preps[i].x for i in sent]
    agreed = shared_scales(plan.comp, keys, xs, plan.slow)
    scales = [None] * len(preps)
    for j, i in enumerate(sent):
        scales[i] = None if agreed is None else agreed[j]
    return scales


def reduce_all(plan: Plan, grads: Any, state: FSDPState) -> Reduced:
    """Each leaf's mean gradient shard, with the new key, memories, shifts and the check.

    Args:
      plan: the step's plan.
      grads: this worker's gradient (stored shapes).
      state: the step's state (in a worker's view).

    Returns:
      :class:`Reduced`.
    """
    leaves = jax.tree.leaves(grads)
    check = any_non_finite(leaves, plan.names)
    key, keys = step_keys(state.key, len(leaves))
    memories, shifts = state_memories(plan, state, len(leaves))
    preps = [prepared(plan, *a) for a in zip(keys, leaves, plan.dim_list, memories, strict=True)]
    scales = agreed_scales(plan, preps)
    shards, new_memories, new_shifts = [], [], []
    rows = zip(preps, leaves, plan.dim_list, memories, shifts, scales, plan.own_rows, strict=True)
    for p, g, dim, e, h, c, r in rows:
        if dim is None:
            shards.append(replicated_mean(plan, g))
            continue
        shard, new_e, new_h = with_feedback(plan, p, dim, h, sharded_mean(plan, p, dim, c, r))
        shards.append(shard)
        if e is not None:
            new_memories.append(new_e.astype(e.dtype)[None])
        if h is not None:
            new_shifts.append(new_h)
    return Reduced(shards, key, tuple(new_memories), tuple(new_shifts), check)
