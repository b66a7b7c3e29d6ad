"""The four kinds of step of 0/1 Adam with local rounds, as the branches of one ``lax.switch``.

Each takes the step's :class:`Round` (what the branches share: the
construction's :class:`~compjax.transforms.compressed_adam.Adam`, the step's
learning rate, the round's rates ``L``, ``d = sqrt(v) + eps`` and this
worker's params) and the operands ``(grads, keys, mus, local_mus, nus, accs,
errors, memories, thetas)``, and returns ``(mus, local_mus, nus, accs,
errors, memories, thetas, out)``: the new buffers, the new global params and
the update of this worker's params (see
:mod:`compjax.transforms.zero_one_adam_local` for the method).

References:
  Lu, Li, Zhang, Tang, Awan, He, "Maximizing Communication Efficiency for
  Large-scale Training via 0/1 Adam", ICLR 2023 (arXiv:2202.06009).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from compjax.transforms.compressed_adam import (
    Adam,
    compensated_means,
    dense_branch,
    gradient_branch,
    momenta,
)
from compjax.worker_local import worker_params


class Round(NamedTuple):
    """What the branches of one step share.

    Attributes:
      adam: the construction's exchange and Adam's constants.
      lr: the step's learning rate (float32).
      lr_sum: ``L``, the round's learning rates including this step's.
      ds: ``sqrt(v) + eps`` of the state's variance, leaf by leaf.
      here: this worker's params, leaf by leaf.
    """

    adam: Adam
    lr: jax.Array
    lr_sum: jax.Array
    ds: list
    here: list


def _moved(r: Round, thetas, mus, ds):
    """Every worker at ``theta - lr m / d`` (while the variance adapts): the new ``theta`` and
    this worker's update to it."""
    steps = [(-r.lr) * (m / d) for m, d in zip(mus, ds, strict=True)]
    new = [t + s.astype(t.dtype) for t, s in zip(thetas, steps, strict=True)]
    return new, [n - p.astype(n.dtype) for n, p in zip(new, r.here, strict=True)]


def _own_copies(r: Round, mus):
    """Each worker's momentum starts the round from the shared one (typed per worker under
    shard_map, as the branches' outputs must agree)."""
    return worker_params(mus, r.adam.axis_name)


def _accumulated(r: Round, local_mus, grads, accs):
    """The worker's own momentum ``m_i <- b1 m_i + (1 - b1) g_i`` and ``u_i <- u_i + lr m_i``."""
    local_mus = momenta(local_mus, grads, r.adam.b1)
    return local_mus, [a + r.lr * m for a, m in zip(accs, local_mus, strict=True)]


def dense_round(r: Round, grads, keys, mus, local_mus, nus, accs, errors, memories, thetas):
    """A variance step: Adam's moments of the mean gradient, every worker at the new params."""
    mus, nus, errors, memories = dense_branch(r.adam, grads, keys, mus, nus, errors, memories)
    new, out = _moved(r, thetas, mus, [jnp.sqrt(v) + r.adam.eps for v in nus])
    return mus, _own_copies(r, mus), nus, accs, errors, memories, new, out


def gradient_round(r: Round, grads, keys, mus, local_mus, nus, accs, errors, memories, thetas):
    """An adaptive step off ``T_v``: the momentum of the 1-bit mean gradient."""
    mus, nus, errors, memories = gradient_branch(r.adam, grads, keys, mus, nus, errors, memories)
    new, out = _moved(r, thetas, mus, r.ds)
    return mus, _own_copies(r, mus), nus, accs, errors, memories, new, out


def local_round(r: Round, grads, keys, mus, local_mus, nus, accs, errors, memories, thetas):
    """A frozen step inside a round: the worker moves its own params by ``-lr m_i / d``."""
    local_mus, accs = _accumulated(r, local_mus, grads, accs)
    out = [(-r.lr) * (m / d) for m, d in zip(local_mus, r.ds, strict=True)]
    return mus, local_mus, nus, accs, errors, memories, thetas, out


def sync_round(r: Round, grads, keys, mus, local_mus, nus, accs, errors, memories, thetas):
    """A round's end: the mean ``S`` of the ``u_i`` by the compensated 1-bit all-reduce,
    ``theta <- theta - S / d``, ``m <- S / L`` (zero if ``L <= 0``), ``u <- 0``."""
    adam = r.adam
    local_mus, accs = _accumulated(r, local_mus, grads, accs)
    sums, errors, memories = compensated_means(
        adam.comp, keys, accs, errors, memories, adam.axis_name, adam.exchange
    )
    positive = r.lr_sum > 0
    mus = [jnp.where(positive, s / jnp.where(positive, r.lr_sum, 1.0), 0.0) for s in sums]
    new = [t - (s / d).astype(t.dtype) for t, s, d in zip(thetas, sums, r.ds, strict=True)]
    out = [n - p.astype(n.dtype) for n, p in zip(new, r.here, strict=True)]
    accs = [jnp.zeros_like(a) for a in accs]
    return mus, _own_copies(r, mus), nus, accs, errors, memories, new, out
