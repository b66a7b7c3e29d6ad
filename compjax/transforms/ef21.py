"""EF21: each worker tracks its gradient with compressed corrections.

References:
  Richtarik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically
  Better, and Practically Faster Error Feedback", NeurIPS 2021 (Algorithm 1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, Exchanged, compressed_mean
from compjax.transforms.scaffold import Leaf, LeafStep, exchanged, leafwise


def ef21_message(update: jax.Array, local: jax.Array) -> jax.Array:
    """What an EF21 worker compresses: its update minus its estimate, ``grad_i - g_i``.

    Args:
      update: the worker's update ``grad_i``.
      local: its estimate ``g_i`` (same shape).

    Returns:
      ``grad_i - g_i``, in the wider of the two dtypes (the caller sends it cast to the
      update's dtype).
    """
    return update - local


def ef21_estimates(local: jax.Array, estimate: Any, sent: Exchanged) -> tuple[jax.Array, Any]:
    """The new estimates of EF21: ``g_i <- g_i + c_i`` and ``g <- g + mean_i c_i``.

    Args:
      local: the worker's estimate ``g_i``.
      estimate: the shared estimate ``g`` (or the part of it the worker keeps).
      sent: the exchange of :func:`ef21_message`'s; its ``local`` is this worker's decoded
        message ``c_i`` (``local``'s shape), its ``mean`` the mean of those (``estimate``'s).

    Returns:
      ``(g_i + c_i, g + mean_i c_i)``, each in the wider of its operands' dtypes.
    """
    return local + sent.local, estimate + sent.mean


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

    Returns:
      An ``optax.GradientTransformation`` whose update is the new shared estimate ``g``
      (its state an :class:`EF21State`).

    Raises:
      ValueError: ``bucket_size``, ``state_dtype`` or ``exchange`` invalid.

    References:
      Richtarik et al., "EF21: A New, Simpler, Theoretically Better, and
      Practically Faster Error Feedback", NeurIPS 2021.
    """

    sc = exchanged(EF21State, comp, axis_name, flatten, bucket_size, seed, exchange, state_dtype)

    def step(leaf: Leaf) -> LeafStep:
        local, estimate = leaf.state
        x = ef21_message(leaf.update, local).astype(leaf.update.dtype)
        c = compressed_mean(comp, leaf.key, x, axis_name, exchange, leaf.memory)
        new_local, new_estimate = ef21_estimates(local, estimate, c)
        # The update is the new estimate, in the gradient's dtype.
        out = new_estimate.astype(leaf.update.dtype)
        return LeafStep(out, (new_local, new_estimate), c.memory)

    return leafwise(sc, step)
