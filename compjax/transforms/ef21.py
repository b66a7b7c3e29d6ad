"""EF21: each worker tracks its gradient with compressed corrections.

References:
  Richtarik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically
  Better, and Practically Faster Error Feedback", NeurIPS 2021 (Algorithm 1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from compjax.collectives import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, compressed_mean
from compjax.transforms.base import (
    Leaves,
    ServerMemory,
    any_non_finite,
    cast_like,
    check_grouping,
    check_state_dtype,
    counted,
    guarded,
    init_key,
    state_zeros,
    step_keys,
)


class EF21State(NamedTuple):
    """State of :func:`ef21`.

    Attributes:
      key: shared PRNG key (raw uint32).
      local: per-worker estimates ``g_i`` of the local gradients.
      estimate: the shared estimate ``g = mean_i g_i`` (the update).
      server_error: the shard owners' memories (scatter-gather with a biased
        compressor; otherwise an empty tuple).
    """

    key: jax.Array
    local: Any
    estimate: Any
    server_error: Any = ()
    PER_WORKER = ("local", "server_error")


def ef21(
    comp: Compressor,
    axis_name: AxisName,
    *,
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
    exchange: str | Exchange = "all_gather",
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """EF21: ``c_i = C(grad_i - g_i)``, ``g_i <- g_i + c_i``, ``g <- g + mean_i c_i``.

    The update is the new ``g``.  Designed for contractive compressors
    (top-k); the estimates start at zero, so the first step sends
    ``C(grad_i)``.  On a fixed full-batch problem ``g_i`` converges to the local
    gradients.

    Args:
      comp: the compressor (contractive ones are what the theory covers).
      axis_name: the data-parallel axis.
      flatten: compress the whole tree as one vector.
      bucket_size: compress the flattened tree in buckets of this many
        entries (one message and one scale per bucket) instead of leaf by
        leaf; ``None``: per leaf.
      seed: seed of the shared key.
      exchange: how messages travel: ``"all_gather"`` (default),
        ``"scatter_gather"`` (a compressed all-reduce; a biased compressor
        then keeps the shard owners' error memory in ``server_error``) or
        :func:`compjax.hierarchical` (see :mod:`compjax.exchange`).
      state_dtype: dtype of the persistent state (see
        :mod:`compjax.transforms.base`): ``None`` keeps it in float32 (or the
        parameters' dtype where wider) even for bfloat16/float16 gradients;
        messages and updates keep the gradient's dtype.

    Raises:
      ValueError: ``bucket_size`` or ``state_dtype`` invalid.

    References:
      Richtarik et al., "EF21: A New, Simpler, Theoretically Better, and
      Practically Faster Error Feedback", NeurIPS 2021.
    """

    state_dtype = check_state_dtype(state_dtype)
    server = ServerMemory(comp, exchange, state_dtype)

    check_grouping(flatten, bucket_size)

    def init_fn(params):
        leaves = Leaves(params, flatten, bucket_size)
        return EF21State(
            key=init_key(seed),
            local=leaves.worker_state(state_zeros(state_dtype)),
            estimate=leaves.shared_state(state_zeros(state_dtype)),
            server_error=server.init(leaves),
        )

    def update_fn(updates, state, params=None):
        leaves = Leaves(updates, flatten, bucket_size)
        bad = any_non_finite(leaves.arrays, axis_name)
        local = leaves.read(state.local, "local", per_worker=True)
        estimate = leaves.read(state.estimate, "estimate", per_worker=False)
        memories = server.read(leaves, state.server_error)
        key, keys = step_keys(state.key, len(leaves.arrays))
        new_local, new_estimate, new_memories = [], [], []
        rows = zip(keys, leaves.arrays, local, estimate, memories, strict=True)
        for k, g, gi, gs, m in rows:
            c = compressed_mean(comp, k, (g - gi).astype(g.dtype), axis_name, exchange, m)
            new_local.append(gi + c.local)
            new_estimate.append(gs + c.mean)
            new_memories.append(c.memory)
        new_state = EF21State(
            key=key,
            local=leaves.write(cast_like(new_local, local), per_worker=True),
            estimate=leaves.write(cast_like(new_estimate, estimate), per_worker=False),
            server_error=server.write(leaves, new_memories, memories),
        )
        out = cast_like(new_estimate, leaves.arrays)  # the update, in the gradient's dtype
        out, new_state = guarded(bad, out, new_state, state)
        return leaves.rebuild(out), new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))
