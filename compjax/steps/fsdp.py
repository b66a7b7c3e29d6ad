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

References:
  Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models", SC 2020.
  Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
  Parallel", VLDB 2023.
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
  Giant Model Training", ICLR 2024 (quantized weight gather, qwZ).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import collectives
from compjax.collectives import (
    any_worker,
    check_local_loss,
    record,
    unrecorded,
    worker_index,
    worker_params,
)
from compjax.compressor import Compressor
from compjax.compressors.dense import identity
from compjax.draws import init_key, step_keys
from compjax.exchange import compressed_reduce_scatter
from compjax.exchange.scatter import shared_scales
from compjax.guards import all_finite, any_non_finite
from compjax.steps import hpz
from compjax.steps.fsdp_layout import (
    check_param_dtypes,
    fsdp_specs,
    opt_state_specs,
    own_shapes,
    owned_part,
    padded_shape,
    spec_dim,
    to_stored,
    without_padding,
)
from compjax.steps.fsdp_state import FSDP, FSDPState
from compjax.steps.param_gather import GATHERS, gathered

P = jax.P

#: Feedback on the compressed reduce-scatter (see :func:`fsdp`'s ``feedback``).
FEEDBACKS = (None, "ef", "ef21")


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
      feedback: ``None``; ``"ef"`` (error feedback, EF-SGD): each worker
        keeps a memory ``e`` of every sharded leaf, sends ``C(g + e)`` and
        keeps ``e <- g + e - C(g + e)``; or ``"ef21"``: each worker keeps an
        estimate ``g_i``, sends ``c_i = C(g - g_i)`` and sets
        ``g_i <- g_i + c_i``, and each owner keeps its shard of
        ``mean_i g_i``, updated by the reduce-scattered ``mean_i c_i``,
        which is the gradient the optimizer sees.  Each worker's memory
        has the full shape of each sharded leaf (float32), more than the
        parameter shard it serves.
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
    names = hpz.check_axis_name(axis_name, mesh)
    check_param_dtypes(params)
    if gather is not None and gather not in GATHERS:
        raise ValueError(f"gather must be None or one of {GATHERS}, got {gather!r}")
    if isinstance(gather_block, bool) or not isinstance(gather_block, int) or gather_block < 1:
        raise ValueError(f"gather_block must be a positive integer, got {gather_block!r}")
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback must be one of {FEEDBACKS}, got {feedback!r}")
    if feedback is not None and compressor is None:
        raise ValueError(f"feedback={feedback!r} needs a compressor (nothing is lost without one)")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative integer, got {min_size!r}")
    comp = identity() if compressor is None else compressor
    # The compressed stages run over ``slow`` (the only axis of a flat step); a pair adds the
    # exact ``fast`` stages, and its shards are laid out local-major (see compjax.steps.hpz).
    slow, fast = names if len(names) == 2 else (names[0], None)
    shard_axes = slow if fast is None else (fast, slow)
    batch_axes = slow if fast is None else names  # host-major: a host's rows are contiguous
    n, n_fast = math.prod(mesh.shape[a] for a in names), mesh.shape[fast] if fast else 1
    param_specs = fsdp_specs(params, n, shard_axes, min_size)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    dims = jax.tree.map(spec_dim, param_specs, is_leaf=is_spec)
    dim_list = jax.tree.leaves(dims, is_leaf=lambda x: x is None)
    leaves, treedef = jax.tree.flatten(params)
    leaf_shapes = [tuple(np.shape(p)) for p in leaves]
    # Stored shapes: a split dimension that is not a multiple of n padded up to one.
    stored_shapes = [padded_shape(s, d, n) for s, d in zip(leaf_shapes, dim_list, strict=True)]
    stored = treedef.unflatten(
        [jax.ShapeDtypeStruct(s, p.dtype) for s, p in zip(stored_shapes, leaves, strict=True)]
    )
    # The rows of a padded leaf's own (split) dimension; None where nothing is padded.
    own_rows = [
        None if s == t else s[d]
        for s, t, d in zip(leaf_shapes, stored_shapes, dim_list, strict=True)
    ]
    # Error memories in float32, or the leaf's dtype where wider.
    memory_dtypes = [jnp.promote_types(p.dtype, jnp.float32) for p in leaves]
    ef_leaves = [i for i, dim in enumerate(dim_list) if dim is not None] if feedback else []
    # A worker's memory is of what it sends over ``slow``: the leaf, or 1/L of it on a pair.
    memory_shapes = {
        i: tuple(s // n_fast if j == dim_list[i] else s for j, s in enumerate(stored_shapes[i]))
        for i in ef_leaves
    }
    specs = FSDPState(
        opt_state=opt_state_specs(opt, stored, dims, n, shard_axes),
        key=P(),
        memory=tuple(P(shard_axes) for _ in ef_leaves),
        shift=tuple(jax.tree.leaves(param_specs, is_leaf=is_spec)[i] for i in ef_leaves)
        if feedback == "ef21"
        else (),
    )

    def prepared(key, g, dim, memory):
        """What one leaf sends over ``slow``: ``(x, key, moved, memory, shard_shape)``, ``x``
        the gradient ``g`` with its split dimension first (on a pair, this worker's ``1/L``
        averaged over its host) plus or minus the memory; ``None`` for a replicated leaf."""
        if dim is None:
            return None
        moved = jnp.moveaxis(g, dim, 0)
        shard_shape = (moved.shape[0] // n, *moved.shape[1:])
        if fast is not None:  # the host's mean of this worker's 1/L, with a key of its own
            moved = hpz.locally_reduced(moved, fast)
            key = jax.random.fold_in(key, worker_index(fast))
        if feedback is None:
            return moved, key, moved, None, shard_shape
        memory = jnp.moveaxis(memory, dim, 0)
        x = moved + memory if feedback == "ef" else moved - memory
        return x.astype(g.dtype), key, moved, memory, shard_shape

    def reduced(prep, g, dim, shift, scale, rows):
        """This worker's mean shard of gradient ``g`` (split along ``dim``), with the new memory
        and shift of ``feedback``; ``prep`` is :func:`prepared`'s, ``scale`` the agreed scale
        of a summable compressor (``None``: agreed in the reduce-scatter), ``rows`` the leaf's
        own rows if it is padded (the padding's decodes are set to zero: a sign is not)."""
        if dim is None:
            g = g if fast is None else hpz.fast_summed(g, fast)
            record("replicated_mean", g, "all_reduce", slow)
            return collectives.psum(g, slow) / n, None, None
        x, key, moved, memory, shard_shape = prep
        sent = compressed_reduce_scatter(comp, key, x, slow, scale)
        mean = jnp.moveaxis(sent.mean.reshape(shard_shape), 0, dim)
        shard = owned_part(mean, dim, rows, shard_axes)
        # What this worker sent: the leaf (flat) or its host's 1/L of it (a pair).
        first = 0 if fast is None else worker_index(fast) * x.shape[0]
        local = without_padding(sent.local, first, rows)
        if feedback is None:
            return shard, None, None
        if feedback == "ef":
            target = moved + memory
            return shard, jnp.moveaxis(target - local, 0, dim), None
        new_memory = jnp.moveaxis(memory + local, 0, dim)
        new_shift = shift + shard.astype(shift.dtype)
        return new_shift.astype(g.dtype), new_memory, new_shift

    def gather_one(x, dim):
        """The whole leaf from every worker's shard ``x``: over ``slow`` as ``gather`` says (on
        a pair, the secondary shard), then over ``fast`` exactly."""
        whole = gathered(x, dim, slow, gather, gather_block)
        return whole if fast is None else hpz.fast_gathered(whole, dim, fast)

    def gather_all(p):
        """The whole parameters from every worker's shards (as the forward pass sees them)."""
        return jax.tree.map(gather_one, p, dims, is_leaf=lambda x: x is None)

    def reduce_all(grads, state):
        """Each leaf's mean shard, with the new key, memories, shifts and the non-finite check."""
        leaves = jax.tree.leaves(grads)
        check = any_non_finite(leaves, names)
        key, keys = step_keys(state.key, len(leaves))
        memories, shifts = [None] * len(leaves), [None] * len(leaves)
        for j, i in enumerate(ef_leaves):
            memories[i] = state.memory[j][0]
            shifts[i] = state.shift[j] if feedback == "ef21" else None
        preps = [prepared(*a) for a in zip(keys, leaves, dim_list, memories, strict=True)]
        sent = [i for i, p in enumerate(preps) if p is not None]
        # A summable compressor's scales, agreed in one pmax for every sharded leaf.
        agreed = shared_scales(comp, [preps[i][1] for i in sent], [preps[i][0] for i in sent], slow)
        scales = [None] * len(leaves)
        for j, i in enumerate(sent):
            scales[i] = None if agreed is None else agreed[j]
        shards, new_memories, new_shifts = [], [], []
        rows = zip(preps, leaves, dim_list, memories, shifts, scales, own_rows, strict=True)
        for p, g, dim, e, h, c, r in rows:
            shard, new_e, new_h = reduced(p, g, dim, h, c, r)
            shards.append(shard)
            if e is not None:
                new_memories.append(new_e.astype(e.dtype)[None])
            if h is not None:
                new_shifts.append(new_h)
        return shards, key, tuple(new_memories), tuple(new_shifts), check

    def local_step(p, state, *batch):
        full = gather_all(p)
        # The backward pass reuses the gathered ``full``: nothing is gathered again.  The loss
        # sees the params' own shapes; the padding's gradient is zero.
        on_own = lambda f, *b: loss_fn(own_shapes(f, treedef, leaf_shapes, dim_list), *b)  # noqa: E731
        loss, grads = jax.value_and_grad(on_own)(worker_params(full, names), *batch)
        check_local_loss(loss, names)  # a pmean inside loss_fn would make the step 1/n
        shards, key, memory, shift, check = reduce_all(grads, state)
        # One decision for every worker (an 8-bit pmax): skip the step if any worker's gradient,
        # or what it led to, is not finite.
        floats = shards + list(memory) + list(shift)
        with unrecorded():  # the flag was logged by any_non_finite
            bad = any_worker(check.local | ~all_finite(floats), names)
        grad_shards = jax.tree.unflatten(jax.tree.structure(grads), shards)
        updates, opt_state = opt.update(grad_shards, state.opt_state, p)
        # The padding's updates are zero (float16 Adam divides 0 by 0 where a gradient is 0).
        updates = zip(treedef.flatten_up_to(updates), dim_list, own_rows, strict=True)
        updates = treedef.unflatten([owned_part(*a, shard_axes) for a in updates])
        new_params = optax.apply_updates(p, updates)
        new = (new_params, FSDPState(opt_state, key, memory, shift))
        kept = jax.tree.map(lambda a, b: jnp.where(bad, b, a), new, (p, state))
        # A skipped step shows in the loss (its value may be finite: a sum that overflowed).
        return *kept, jnp.where(bad, jnp.nan, jax.lax.pmean(loss, names)).astype(loss.dtype)

    def exchange(p):
        """One step's messages, in a worker's view: its shards ``p`` gathered, and a gradient
        of the gathered shapes reduce-scattered (what :func:`compjax.communication` traces)."""
        full = gather_all(p)
        shards, *_ = reduce_all(jax.tree.map(jnp.zeros_like, full), local_init(p))
        return shards

    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    named = lambda s: jax.NamedSharding(mesh, s)  # noqa: E731

    def placed(tree, spec_tree):
        """``tree`` resharded to ``spec_tree`` on ``mesh`` (whatever sharding it came with):
        ``jax.reshard`` on an explicit-sharding mesh, a sharding constraint on any other."""
        move = jax.reshard if explicit else jax.lax.with_sharding_constraint
        return jax.tree.map(
            lambda x, s: move(x, jax.NamedSharding(mesh, s)), tree, spec_tree, is_leaf=is_spec
        )

    def stored(p):
        """``p`` (the params' own shapes or their stored ones) in the stored shapes."""
        return to_stored(p, treedef, leaf_shapes, dim_list, stored_shapes)

    def shard(p):
        return placed(stored(p), param_specs)

    def unpad(p):
        """Stored params in their own shapes (a padded leaf replicated first: a JAX array
        cannot be split unevenly)."""
        spec_list = jax.tree.leaves(param_specs, is_leaf=is_spec)
        kept = [s if r is None else P() for s, r in zip(spec_list, own_rows, strict=True)]
        return own_shapes(placed(p, treedef.unflatten(kept)), treedef, leaf_shapes, dim_list)

    def step(p, state, *batch):
        p = stored(p)
        in_specs = (param_specs, specs, *[P(batch_axes)] * len(batch))
        mapped = jax.shard_map(
            local_step, mesh=mesh, in_specs=in_specs, out_specs=(param_specs, specs, P())
        )
        batch = [jax.tree.map(lambda x: placed(x, P(batch_axes)), b) for b in batch]
        return mapped(placed(p, param_specs), placed(state, specs), *batch)

    def local_init(p):
        memory = tuple(jnp.zeros((1, *memory_shapes[i]), memory_dtypes[i]) for i in ef_leaves)
        shards = jax.tree.leaves(p)
        shift = tuple(jnp.zeros(shards[i].shape, memory_dtypes[i]) for i in ef_leaves)
        return FSDPState(
            opt_state=opt.init(p),
            key=init_key(seed),
            memory=memory,
            shift=shift if feedback == "ef21" else (),
        )

    def init(p):
        mapped = jax.shard_map(local_init, mesh=mesh, in_specs=(param_specs,), out_specs=specs)
        return mapped(shard(p))

    return FSDP(
        init=jax.jit(init),
        step=jax.jit(step),
        param_specs=param_specs,
        specs=specs,
        exchange=exchange,
        shard=jax.jit(stored, out_shardings=jax.tree.map(named, param_specs, is_leaf=is_spec)),
        unpad=jax.jit(unpad),
    )
