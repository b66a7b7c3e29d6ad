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

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, Exchanged, compressed_mean
from compjax.transforms.scaffold import Leaf, LeafStep, exchanged, leafwise


def ef_message(update: jax.Array, error: jax.Array) -> jax.Array:
    """What an error-feedback worker compresses: its update plus its memory, ``p = g + e``.

    Args:
      update: the worker's update ``g``.
      error: its memory ``e`` (same shape).

    Returns:
      ``p``, in the wider of the two dtypes (the memory's precision; the caller sends it
      cast to the update's dtype).
    """
    return update + error


def ef_error(message: jax.Array, sent: Exchanged) -> jax.Array:
    """An error-feedback worker's new memory: what its message lost, ``e <- p - C(p)``.

    Args:
      message: ``p``, :func:`ef_message`'s (before any cast to the sent dtype).
      sent: the exchange of ``p``; its ``local`` is this worker's decoded message ``C(p)``.

    Returns:
      ``p - C(p)`` (:meth:`compjax.exchange.Exchanged.residual`: a sparse message
      subtracts its entries, with no dense decode).
    """
    return sent.residual(message)


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

    Returns:
      An ``optax.GradientTransformation`` whose update is the mean over workers of the
      decoded messages ``C(g_i + e_i)`` (its state an :class:`ErrorFeedbackState`).

    Raises:
      ValueError: ``bucket_size``, ``state_dtype`` or ``exchange`` invalid.

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019.
    """

    sc = exchanged(
        ErrorFeedbackState, comp, axis_name, flatten, bucket_size, seed, exchange, state_dtype
    )

    def step(leaf: Leaf) -> LeafStep:
        (error,) = leaf.state
        p = ef_message(leaf.update, error)  # in the state's precision; sent in the update's
        x = p.astype(leaf.update.dtype)
        sent = compressed_mean(comp, leaf.key, x, axis_name, exchange, leaf.memory)
        return LeafStep(sent.mean, (ef_error(p, sent),), sent.memory, sent.finite)

    return leafwise(sc, step)
