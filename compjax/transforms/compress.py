"""Plain compressed data parallelism: every worker sends C(g_i), all apply the mean.

With an unbiased compressor this is QSGD/TernGrad/natural-compression
training and DQGD (Khirirat et al. 2018): ``x <- x - gamma mean_i C(g_i)``.

References:
  Alistarh et al., "QSGD", NeurIPS 2017.
  Khirirat, Feyzmahdavian, Johansson, "Distributed learning with compressed
  gradients", arXiv:1806.06573 (DQGD).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from compjax.collectives import AxisName, compressed_mean
from compjax.compressor import Compressor
from compjax.transforms.base import Leaves, any_non_finite, counted, guarded, init_key, step_keys


class CompressState(NamedTuple):
    """State of :func:`compress`: the shared PRNG key (raw uint32)."""

    key: jax.Array


def compress(
    comp: Compressor, axis_name: AxisName, *, flatten: bool = False, seed: int = 0
) -> optax.GradientTransformation:
    """The compressed mean of the workers' updates.

    Args:
      comp: the compressor applied to each worker's update.
      axis_name: the data-parallel axis (name, tuple of names, or ``None``).
      flatten: compress the whole tree as one vector instead of leaf by leaf.
      seed: seed of the shared key in the state.

    Returns:
      An ``optax.GradientTransformation`` whose update is
      ``mean_i decompress(compress(key_i, g_i))`` for each leaf.

    Examples:
      >>> import optax, compjax
      >>> opt = optax.chain(compjax.compress(compjax.qsgd(4), "data"), optax.sgd(0.1))
    """

    def init_fn(params):
        return CompressState(key=init_key(seed))

    def update_fn(updates, state, params=None):
        leaves = Leaves(updates, flatten)
        bad = any_non_finite(leaves.arrays, axis_name)
        key, keys = step_keys(state.key, len(leaves.arrays))
        out = [
            compressed_mean(comp, k, g, axis_name).mean
            for k, g in zip(keys, leaves.arrays, strict=True)
        ]
        out, new_state = guarded(bad, out, CompressState(key), state)
        return leaves.rebuild(out), new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))
