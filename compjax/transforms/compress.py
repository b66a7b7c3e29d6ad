"""Plain compressed data parallelism: every worker sends C(g_i), all apply the mean.

With an unbiased compressor this is QSGD/TernGrad/natural-compression
training and DQGD (Khirirat et al. 2018): ``x <- x - gamma mean_i C(g_i)``.

References:
  Alistarh et al., "QSGD", NeurIPS 2017.
  Khirirat, Feyzmahdavian, Johansson, "Distributed learning with compressed
  gradients", arXiv:1806.06573 (DQGD).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, compressed_mean
from compjax.transforms.scaffold import Leaf, LeafStep, exchanged, leafwise


class CompressState(NamedTuple):
    """State of :func:`compress`.

    Attributes:
      key: the shared PRNG key (raw uint32).
      server_error: the shard owners' error memories (scatter-gather with a
        biased compressor; otherwise an empty tuple).
    """

    key: jax.Array
    server_error: Any = ()
    PER_WORKER = ("server_error",)


def compress(
    comp: Compressor,
    axis_name: AxisName,
    *,
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
    exchange: str | Exchange = "all_gather",
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """The compressed mean of the workers' updates.

    Args:
      comp: the compressor applied to each worker's update.
      axis_name: the data-parallel axis (name, tuple of names, or ``None``).
      flatten: compress the whole tree as one vector instead of leaf by leaf.
      bucket_size: compress the flattened tree in buckets of this many
        entries (one message and one scale per bucket) instead of leaf by
        leaf; ``None``: per leaf.
      seed: seed of the shared key in the state.
      exchange: how messages travel: ``"all_gather"`` (default),
        ``"scatter_gather"`` (a compressed all-reduce; a biased compressor
        then keeps the shard owners' error memory in ``server_error``) or
        :func:`compjax.hierarchical` (see :mod:`compjax.exchange`).
      state_dtype: dtype of the shard owners' memories (see
        :mod:`compjax.transforms.base`): ``None`` keeps them in float32 (or
        the parameters' dtype where wider) even for bfloat16/float16
        gradients.

    Returns:
      An ``optax.GradientTransformation`` whose update is
      ``mean_i decompress(compress(key_i, g_i))`` for each leaf.

    Examples:
      >>> import optax, compjax
      >>> opt = optax.chain(compjax.compress(compjax.qsgd(4), "data"), optax.sgd(0.1))
    """

    sc = exchanged(
        CompressState, comp, axis_name, flatten, bucket_size, seed, exchange, state_dtype
    )

    def step(leaf: Leaf) -> LeafStep:
        sent = compressed_mean(comp, leaf.key, leaf.update, axis_name, exchange, leaf.memory)
        return LeafStep(sent.mean, memory=sent.memory, finite=sent.finite)

    # Buckets sent in pieces: no copy for an elementwise compressor.
    return leafwise(sc._replace(pieces=True), step)
