"""DIANA: compress gradient differences against learned shifts.

References:
  Mishchenko, Gorbunov, Takac, Richtarik, "Distributed Learning with
  Compressed Gradient Differences", arXiv:1901.09269 (Algorithm 1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, compressed_mean
from compjax.transforms.scaffold import Leaf, LeafStep, exchanged, leafwise


class DianaState(NamedTuple):
    """State of :func:`diana`.

    Attributes:
      key: the shared PRNG key (raw uint32), split every step.
      local_shift: this worker's shifts ``h_i`` (leading worker axis of size 1),
        one per leaf (per bucket, or one for the flattened tree), in the state dtype.
      shift: the shared shift ``h = mean_i h_i``, moved by ``alpha mean_i m_i``.
      server_error: the shard owners' memories (scatter-gather with a biased
        compressor; otherwise an empty tuple).
    """

    key: jax.Array
    local_shift: Any
    shift: Any
    server_error: Any = ()
    PER_WORKER = ("local_shift", "server_error")


def diana(
    comp: Compressor,
    axis_name: AxisName,
    alpha: float | jax.Array | None = None,
    *,
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
    exchange: str | Exchange = "all_gather",
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """DIANA: ``m_i = C(g_i - h_i)``, update ``h + mean_i m_i``, ``h_i <- h_i + alpha m_i``.

    The shared ``h`` moves by ``alpha mean_i m_i`` so that it stays the mean of
    the ``h_i``.  With a full gradient and a strongly convex objective the
    shifts learn the local gradients at the optimum and the method converges
    linearly to the exact optimum, where plain compressed GD stalls at a
    neighbourhood of size ``~ (omega/n) mean_i ||grad f_i(x*)||^2``.

    Args:
      comp: an unbiased compressor.
      axis_name: the data-parallel axis.
      alpha: shift step size; default ``1/(omega(d) + 1)`` for each leaf of
        ``d`` entries (the theory's largest).  May be a schedule value under
        ``optax.inject_hyperparams``.
      flatten: one shift and one message for the whole tree (as one vector).
      bucket_size: one shift and one message per bucket of this many entries
        of the flattened tree; ``None``: per leaf (see :func:`compjax.compress`).
      seed: seed of the shared key.
      exchange: how the messages ``m_i`` travel, as in :func:`compjax.compress`
        (with a biased compressor over ``"scatter_gather"`` the shard owners
        keep an error memory in ``server_error``).
      state_dtype: dtype of the shifts ``h_i`` and ``h`` (see
        :mod:`compjax.transforms.base`): ``None`` keeps them in float32 for
        float32, bfloat16 and float16 params (float64 for float64 params under
        ``jax_enable_x64``, whose gradients must still be at most float32);
        messages and updates keep the gradient's dtype.

    Returns:
      An ``optax.GradientTransformation`` whose update is ``h + mean_i m_i``, in
      the gradient's dtype.

    Raises:
      ValueError: ``alpha`` not in ``(0, 1]``, ``alpha=None`` with a
        compressor that has no ``omega``, or an invalid ``bucket_size`` or
        ``state_dtype``.

    References:
      Mishchenko et al., "Distributed Learning with Compressed Gradient
      Differences", arXiv:1901.09269.
    """
    if alpha is None and not comp.unbiased:
        raise ValueError(
            f"alpha: {comp!r} is biased and has no omega to derive alpha = 1/(omega + 1) "
            f"from; pass alpha explicitly"
        )
    if isinstance(alpha, int | float) and not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")

    sc = exchanged(DianaState, comp, axis_name, flatten, bucket_size, seed, exchange, state_dtype)

    def step(leaf: Leaf) -> LeafStep:
        g, (hi, h) = leaf.update, leaf.state
        a = 1.0 / (comp.omega(g.size) + 1.0) if alpha is None else alpha
        m = compressed_mean(
            comp, leaf.key, (g - hi).astype(g.dtype), axis_name, exchange, leaf.memory
        )
        return LeafStep((h + m.mean).astype(g.dtype), (hi + a * m.local, h + a * m.mean), m.memory)

    return leafwise(sc, step)
