"""Sharded training (FSDP / ZeRO-3): parameters and optimizer state split over the data axis.

:func:`fsdp` builds a jitted step, shaped like :func:`compjax.data_parallel`,
in which each worker keeps only its shard of every large parameter and of
its optimizer state.  Each step, every worker

1. all-gathers the parameters (optionally compressed: :mod:`compjax.steps.param_gather`,
   ZeRO++'s quantized weights), computes the loss and gradient of its own
   batch at the gathered parameters,
2. receives only the mean gradient of the shard it owns
   (:func:`compjax.exchange.compressed_reduce_scatter`, with any compjax
   compressor and optional error feedback), and the ordinary mean of the
   small replicated leaves,
3. updates its shard with the optax optimizer.

Which dimension of a leaf is split is decided by :func:`fsdp_specs` (the
largest dimension divisible by the number of workers, else the largest
dimension, padded with zeros to a multiple of it; leaves smaller than
``min_size`` entries stay replicated).  On a
``(slow, fast)`` pair of axes the gather and the reduce-scatter each take
two stages, and only the slow stages are compressed (:mod:`compjax.steps.hpz`,
ZeRO++'s hpZ).

The step is built from a plan fixed once (:mod:`compjax.steps.fsdp_plan`: the axes, each leaf's
split dimension, padding and memory); its messages are :mod:`compjax.steps.fsdp_exchange`'s,
and this module maps one worker's step and init over the mesh
(:mod:`compjax.steps.scaffold`).

References:
  Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models", SC 2020.
  Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
  Parallel", VLDB 2023.
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
  Giant Model Training", ICLR 2024 (quantized weight gather, qwZ).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from compjax.collectives import any_worker
from compjax.compressor import Compressor
from compjax.draws import init_key
from compjax.guards import all_finite
from compjax.recording import unrecorded
from compjax.steps.fsdp_exchange import Reduced, gather_all, reduce_all
from compjax.steps.fsdp_layout import (
    fsdp_specs,  # noqa: F401  (compjax.fsdp_specs)
    own_shapes,
    owned_part,
    to_stored,
)
from compjax.steps.fsdp_plan import (
    FEEDBACKS,  # noqa: F401  (kept importable here)
    Plan,
    build_plan,
)
from compjax.steps.fsdp_state import FSDP, FSDPState
from compjax.steps.scaffold import is_spec, mapped_init, mapped_step, placed
from compjax.worker_local import check_local_loss, worker_params

P = jax.P


def fsdp(
    loss_fn: Callable[..., jax.Array],
    opt: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str | tuple[str, str] = "data",
    *,
    compressor: Compressor | None = None,
    feedback: str | None = None,
    gather: str | None = None,
    gather_block: int = 256,
    min_size: int = 4096,
    seed: int = 0,
) -> FSDP:
    """Build a jitted sharded-training (FSDP / ZeRO-3) step over ``mesh``'s ``axis_name``.

    Parameters and optimizer state are split over ``axis_name``
    (:func:`fsdp_specs`); every other mesh axis (a ``"model"`` axis)
    holds them replicated.  Each step all-gathers the parameters, takes
    each worker's gradient on its part of the batch, reduce-scatters the
    gradient so that each worker receives the mean of the shard it owns
    (compressed with ``compressor``), averages the replicated leaves'
    gradients, and applies ``opt`` to the shard.  With the default
    ``compressor`` (none) and ``gather``, the step is data-parallel
    training on the pooled batch, up to float32 summation order.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``, the mean loss of the
        batch it is given (each worker is given its own part); not reduced
        over the workers.
      opt: a plain optax optimizer acting elementwise (``sgd``, ``adam``,
        ``adamw``, ``lion``, ...): it sees only this worker's shard, so
        per-tensor statistics (LAMB's trust ratio, factored Adafactor) would
        be computed per shard, and a global reduction kept in the state
        (``optax.apply_if_finite``'s counters, which the step's own skipping
        replaces) varies over the workers, which ``shard_map`` refuses.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), in float32,
        bfloat16 or float16.
      mesh: the device mesh; every batch array is split along its first
        axis over ``axis_name``.
      axis_name: the data-parallel mesh axis, over which the shards are split;
        or a pair ``(slow, fast)`` of axes (``("hosts", "local")``: hosts
        over a network, chips in a host), over both of which the shards are
        split (:mod:`compjax.steps.hpz`): the parameters are gathered over
        ``slow`` (compressed as ``gather`` says) and then over ``fast``
        (exact), and the gradient reduce-scattered over ``fast`` (exact)
        and then, only the ``1/L`` each worker's host reduced, over ``slow``
        (compressed with ``compressor``).
      compressor: the gradient compressor of the reduce-scatter (any compjax
        compressor; see :func:`compjax.exchange.compressed_reduce_scatter`);
        ``None`` sends the gradient as it is.
      feedback: ``None``; ``"ef"`` (error feedback, EF-SGD, the rule of
        :func:`compjax.error_feedback`): each worker keeps a memory ``e`` of every sharded
        leaf, sends ``C(g + e)`` and keeps ``e <- g + e - C(g + e)``; or ``"ef21"`` (that of
        :func:`compjax.ef21`): each worker keeps an estimate ``g_i``, sends
        ``c_i = C(g - g_i)`` and sets ``g_i <- g_i + c_i``, and each owner keeps its shard
        of ``mean_i g_i``, updated by the reduce-scattered ``mean_i c_i``, which is the
        gradient the optimizer sees.  Each worker's memory has the full shape of each
        sharded leaf (float32), more than the parameter shard it serves.
      gather: how the parameters are all-gathered: ``None`` (exact), ``"int8"``
        (blockwise int8 with one float32 step per ``gather_block`` entries, or
        per shard if smaller: :func:`compjax.steps.param_gather.quantize_blocks`),
        or a cast to ``"bfloat16"``, ``"float16"`` or ``"float8_e4m3fn"``
        (saturating).  The shards themselves stay
        exact; only the forward and backward passes see the decoded weights.
      gather_block: entries per int8 block.
      min_size: leaves with fewer entries stay replicated (their gradient
        is averaged exactly, uncompressed); every other leaf is split, padded
        if no dimension is a multiple of the number of workers (its padding
        rows hold zeros, get zero gradients and zero optimizer state, and
        are counted by :func:`compjax.communication`).
      seed: seed of the compressor's shared key.

    Returns:
      :class:`FSDP`.  ``step`` returns the new params (sharded), the new
      state and the loss averaged over workers.  A step whose gradient
      holds an Inf or NaN on any worker (or whose reduced shards or error
      memory would: a float32 or float16 sum that overflows) is skipped on
      every worker: the params and the whole state come back unchanged, and
      the returned loss is NaN.

    Raises:
      ValueError: ``axis_name`` is not one axis of ``mesh`` or a pair of
        distinct ones; a float64 parameter (here, at ``init`` or at
        ``step``); ``gather`` or
        ``gather_block`` or ``feedback`` is invalid; ``feedback`` without a
        ``compressor``; an optimizer state leaf not laid out like a parameter;
        or, at the first ``step``, ``loss_fn``'s value is already reduced
        over the workers.

    References:
      Rajbhandari et al., "ZeRO", SC 2020; Wang et al., "ZeRO++", ICLR 2024;
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019; Richtarik, Sokolov, Fatkhullin,
      "EF21: A New, Simpler, Theoretically Better, and Practically Faster
      Error Feedback", NeurIPS 2021.
    """
    plan = build_plan(
        loss_fn,
        opt,
        params,
        mesh,
        axis_name,
        compressor=compressor,
        feedback=feedback,
        gather=gather,
        gather_block=gather_block,
        min_size=min_size,
        seed=seed,
    )
    return step_of(plan)


def step_of(plan: Plan) -> FSDP:
    """The :class:`FSDP` step of ``plan``: its functions mapped over the mesh and jitted.

    Args:
      plan: :func:`compjax.steps.fsdp_plan.build_plan`'s.

    Returns:
      :class:`FSDP`.
    """
    mapped = mapped_step(
        functools.partial(local_step, plan),
        plan.mesh,
        plan.param_specs,
        plan.specs,
        P(plan.batch_axes),
    )
    mapped_local_init = mapped_init(
        functools.partial(local_init, plan), plan.mesh, plan.param_specs, plan.specs
    )
    shardings = jax.tree.map(
        lambda s: jax.NamedSharding(plan.mesh, s), plan.param_specs, is_leaf=is_spec
    )
    return FSDP(
        init=jax.jit(functools.partial(init, plan, mapped_local_init)),
        step=jax.jit(functools.partial(step, plan, mapped)),
        param_specs=plan.param_specs,
        specs=plan.specs,
        exchange=functools.partial(exchange, plan),
        shard=jax.jit(functools.partial(stored, plan), out_shardings=shardings),
        unpad=jax.jit(functools.partial(unpad, plan)),
    )


def loss_on_own_shapes(plan: Plan, full: Any, *batch: Any) -> jax.Array:
    """``loss_fn`` of the gathered params ``full`` cut to their own shapes (the padding's
    gradient is zero).

    Args:
      plan: the step's plan.
      full: the gathered params (stored shapes).
      *batch: this worker's batch.

    Returns:
      The loss.
    """
    return plan.loss_fn(own_shapes(full, plan.treedef, plan.leaf_shapes, plan.dim_list), *batch)


def updated(plan: Plan, p: Any, state: FSDPState, red: Reduced) -> tuple[Any, FSDPState]:
    """The new shards and state after the optimizer's step on the reduced gradient.

    Args:
      plan: the step's plan.
      p: this worker's shards.
      state: the step's state.
      red: :func:`compjax.steps.fsdp_exchange.reduce_all`'s.

    Returns:
      ``(params, state)``, not yet guarded.
    """
    grad_shards = plan.treedef.unflatten(red.shards)
    updates, opt_state = plan.opt.update(grad_shards, state.opt_state, p)
    # The padding's updates are zero (float16 Adam divides 0 by 0 where a gradient is 0).
    updates = zip(plan.treedef.flatten_up_to(updates), plan.dim_list, plan.own_rows, strict=True)
    updates = plan.treedef.unflatten([owned_part(*a, plan.shard_axes) for a in updates])
    new_params = optax.apply_updates(p, updates)
    return new_params, FSDPState(opt_state, red.key, red.memory, red.shift)


def local_step(plan: Plan, p: Any, state: FSDPState, *batch: Any):
    """One worker's step: gather, its gradient, the reduce-scatter, the optimizer, the guard.

    Args:
      plan: the step's plan.
      p: this worker's shards.
      state: the step's state (in a worker's view).
      *batch: this worker's part of the batch.

    Returns:
      ``(params, state, loss)``: the old ones and a NaN loss if the step is skipped.
    """
    full = gather_all(plan, p)
    # The backward pass reuses the gathered ``full``: nothing is gathered again.
    on_own = functools.partial(loss_on_own_shapes, plan)
    loss, grads = jax.value_and_grad(on_own)(worker_params(full, plan.names), *batch)
    check_local_loss(loss, plan.names)  # a pmean inside loss_fn would make the step 1/n
    red = reduce_all(plan, grads, state)
    # One decision for every worker (an 8-bit pmax): skip the step if any worker's gradient,
    # or what it led to, is not finite.
    floats = red.shards + list(red.memory) + list(red.shift)
    with unrecorded():  # the flag was logged by any_non_finite
        bad = any_worker(red.check.local | ~all_finite(floats), plan.names)
    new = updated(plan, p, state, red)
    kept = jax.tree.map(lambda a, b: jnp.where(bad, b, a), new, (p, state))
    # A skipped step shows in the loss (its value may be finite: a sum that overflowed).
    return *kept, jnp.where(bad, jnp.nan, jax.lax.pmean(loss, plan.names)).astype(loss.dtype)


def exchange(plan: Plan, p: Any) -> list[jax.Array]:
    """One step's messages, in a worker's view: its shards ``p`` gathered, and a gradient of
    the gathered shapes reduce-scattered (what :func:`compjax.communication` traces).

    Args:
      plan: the step's plan.
      p: this worker's shards.

    Returns:
      The gradient shards (of a zero gradient).
    """
    full = gather_all(plan, p)
    return reduce_all(plan, jax.tree.map(jnp.zeros_like, full), local_init(plan, p)).shards


def local_init(plan: Plan, p: Any) -> FSDPState:
    """One worker's state at step 0: the optimizer's, a fresh key, zero memories and shifts.

    Args:
      plan: the step's plan.
      p: this worker's shards.

    Returns:
      :class:`FSDPState`.
    """
    memory = tuple(
        jnp.zeros((1, *plan.memory_shapes[i]), plan.memory_dtypes[i]) for i in plan.ef_leaves
    )
    shards = jax.tree.leaves(p)
    shift = tuple(jnp.zeros(shards[i].shape, plan.memory_dtypes[i]) for i in plan.ef_leaves)
    return FSDPState(
        opt_state=plan.opt.init(p),
        key=init_key(plan.seed),
        memory=memory,
        shift=shift if plan.feedback == "ef21" else (),
    )


def stored(plan: Plan, p: Any) -> Any:
    """``p`` (the params' own shapes or their stored ones) in the stored shapes.

    Args:
      plan: the step's plan.
      p: the params.

    Returns:
      The params, padded where their split dimension is (zeros).
    """
    return to_stored(p, plan.treedef, plan.leaf_shapes, plan.dim_list, plan.stored_shapes)


def unpad(plan: Plan, p: Any) -> Any:
    """Stored params in their own shapes (a padded leaf replicated first: a JAX array cannot
    be split unevenly).

    Args:
      plan: the step's plan.
      p: the stored params.

    Returns:
      The params in their own shapes.
    """
    spec_list = jax.tree.leaves(plan.param_specs, is_leaf=is_spec)
    kept = [s if r is None else P() for s, r in zip(spec_list, plan.own_rows, strict=True)]
    whole = placed(plan.mesh, p, plan.treedef.unflatten(kept))
    return own_shapes(whole, plan.treedef, plan.leaf_shapes, plan.dim_list)


def step(plan: Plan, mapped: Callable, p: Any, state: FSDPState, *batch: Any):
    """The step on the whole arrays: ``p`` in its stored shapes, then ``mapped``.

    Args:
      plan: the step's plan.
      mapped: :func:`local_step` mapped over the mesh (:func:`compjax.steps.scaffold.mapped_step`).
      p: the params; ``state`` and ``batch`` the step's other inputs.

    Returns:
      ``(params, state, loss)``.
    """
    return mapped(stored(plan, p), state, *batch)


def init(plan: Plan, mapped: Callable, p: Any) -> FSDPState:
    """The state at step 0 of the params ``p`` (own or stored shapes).

    Args:
      plan: the step's plan.
      mapped: :func:`local_init` mapped over the mesh (:func:`compjax.steps.scaffold.mapped_init`).
      p: the params.

    Returns:
      :class:`FSDPState`.
    """
    return mapped(stored(plan, p))
