"""TernGrad's full recipe: layer-wise scalers, clipping, a shared scaler, summed ternaries.

References:
  Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to Reduce
  Communication in Distributed Deep Learning", NeurIPS 2017 (Section 3 and
  its "scaler sharing").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.axes import AxisName
from compjax.collectives import shared_max, ternary_mean, worker_key
from compjax.compressors.terngrad import clip_to_std, ternarize, ternary_values, terngrad
from compjax.exchange import compressed_mean
from compjax.transforms.scaffold import Leaf, LeafStep, leafwise, scaffold


class TernGradState(NamedTuple):
    """State of :func:`terngrad_allreduce`: the shared PRNG key (raw uint32)."""

    key: jax.Array


def terngrad_allreduce(
    axis_name: AxisName,
    clip: float | None = 2.5,
    *,
    share_scaler: bool = True,
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """TernGrad as trained in the paper, for each layer (leaf):

    1. clip each worker's gradient to ``clip`` standard deviations;
    2. scaler sharing: ``s = max_i max|g_i|`` over workers (a 32-bit ``pmax``);
    3. each worker ternarises with the shared ``s``: ``sign(g) * b``,
       ``b ~ Bernoulli(|g|/s)``;
    4. the ternaries are summed as int8 with ``psum`` (int32 beyond 127
       workers) and the update is ``s * sum / n``.

    Unbiased for the clipped gradients.  With ``share_scaler=False`` each
    worker uses its own scaler and the messages (scaler + 2-bit packed
    ternaries) are all-gathered instead of summed.

    Args:
      axis_name: the data-parallel axis.
      clip: clipping factor ``c`` (2.5 in the paper) or ``None``.
      share_scaler: share the maximum scaler across workers.
      flatten: one scaler for the whole tree instead of one per layer.
      bucket_size: compress the flattened tree in buckets of this many
        entries (one message and one scale per bucket) instead of leaf by
        leaf; ``None``: per leaf.
      seed: seed of the shared key.

    Returns:
      An ``optax.GradientTransformation`` whose update is the mean of the
      workers' ternarised (clipped) gradients, in the gradient's dtype.

    Raises:
      ValueError: an invalid ``clip`` or ``bucket_size``.

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
      Distributed Deep Learning", NeurIPS 2017.
    """
    own_scaler = terngrad(clip=clip)
    sc = scaffold(TernGradState, axis_name, flatten, bucket_size, seed)

    def step(leaf: Leaf) -> LeafStep:
        k, g = leaf.key, leaf.update
        if not share_scaler:
            return LeafStep(compressed_mean(own_scaler, k, g, axis_name).mean)
        y = g.reshape(-1).astype(jnp.float32)
        if clip is not None:
            y = clip_to_std(y, clip)
        scale = shared_max(jnp.max(jnp.abs(y), initial=0.0), axis_name)
        codes = ternarize(worker_key(k, axis_name), y, scale)
        mean = ternary_mean(ternary_values(codes), scale, axis_name)
        return LeafStep(mean.astype(g.dtype).reshape(g.shape))

    return leafwise(sc, step)
