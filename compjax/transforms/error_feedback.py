"""Error feedback (EF-SGD): compress the update plus the memory of what was not sent.

References:
  Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
  Gradient Compression Schemes", ICML 2019 (Algorithm 2).
  Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018.
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


class ErrorFeedbackState(NamedTuple):
    """State of :func:`error_feedback`.

    Attributes:
      key: shared PRNG key (raw uint32).
      error: per-worker memory ``e_i`` (leading worker axis of size 1 per worker).
      server_error: the shard owners' memories (scatter-gather with a biased
        compressor; otherwise an empty tuple).
    """

    key: jax.Array
    error: Any
    server_error: Any = ()
    PER_WORKER = ("error", "server_error")


def error_feedback(
    comp: Compressor,
    axis_name: AxisName,
    *,
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
    exchange: str | Exchange = "all_gather",
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """EF-SGD: ``p_i = g_i + e_i``, send ``C(p_i)``, keep ``e_i <- p_i - C(p_i)``.

    The update is the mean of the decoded messages.  Works with biased
    compressors (top-k, scaled sign): the memory makes sure every coordinate
    is eventually applied, and ``sum of sent + final error = sum of inputs``.
    The step size is applied afterwards (``optax.sgd``), so the memory is in
    gradient units; with a constant learning rate this is Algorithm 2 of
    Karimireddy et al. with ``gamma`` factored out.

    Args:
      comp: the compressor (any).
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
        :mod:`compjax.transforms.base`): ``None`` keeps it in float32 for
        float32, bfloat16 and float16 params (float64 for float64 params
        under ``jax_enable_x64``, whose gradients must still be at most
        float32); messages and updates keep the gradient's dtype.

    Raises:
      ValueError: ``bucket_size`` or ``state_dtype`` invalid.

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019.
    """

    state_dtype = check_state_dtype(state_dtype)
    server = ServerMemory(comp, exchange, state_dtype)

    check_grouping(flatten, bucket_size)

    def init_fn(params):
        leaves = Leaves(params, flatten, bucket_size)
        return ErrorFeedbackState(
            key=init_key(seed),
            error=leaves.worker_state(state_zeros(state_dtype)),
            server_error=server.init(leaves),
        )

    def update_fn(updates, state, params=None):
        leaves = Leaves(updates, flatten, bucket_size)
        bad = any_non_finite(leaves.arrays, axis_name)
        errors = leaves.read(state.error, "error", per_worker=True)
        memories = server.read(leaves, state.server_error)
        key, keys = step_keys(state.key, len(leaves.arrays))
        out, new_errors, new_memories, finite = [], [], [], []
        for k, g, e, m in zip(keys, leaves.arrays, errors, memories, strict=True):
            p = g + e  # in the state's precision; sent in the gradient's dtype
            sent = compressed_mean(comp, k, p.astype(g.dtype), axis_name, exchange, m)
            out.append(sent.mean)
            finite.append(sent.finite)
            new_errors.append(sent.residual(p))
            new_memories.append(sent.memory)
        new_state = ErrorFeedbackState(
            key=key,
            error=leaves.write(cast_like(new_errors, errors), per_worker=True),
            server_error=server.write(leaves, new_memories, memories),
        )
        out, new_state = guarded(bad, out, new_state, state, finite)
        return leaves.rebuild(out), new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))
