"""Distributed auto-differentiation (dAD) and rank-dAD for flax linen and NNX models.

A linear layer's gradient over a batch is ``A^T Delta``: a sum of outer
products of its inputs ``A`` (``rows x in``) and the backpropagated output
cotangents ``Delta`` (``rows x out``).  Instead of all-reducing the
``in x out`` gradient, dAD sites all-gather ``A`` and ``Delta`` and each
rebuilds the exact pooled gradient; rank-dAD sends rank-``r`` factors of
each site's ``Delta_s^T A_s`` found by power iteration.

Functions (call them inside ``jax.shard_map``, ``jax.pmap`` or
``jax.vmap(axis_name=...)`` with each site's batch; the gradients they return
are identical on every site and feed any optax optimizer):

* :func:`dad_grads` — ``(loss, grads)``, the exact pooled gradient;
* :func:`rank_dad_grads` — ``(loss, grads)`` with rank-``r`` Dense gradients;
* :func:`dad_communication` — bits per step of plain, dAD, rank-dAD and
  PowerSGD for a model and batch;
* :func:`dense_layers` — the layers dAD captures; :func:`split_batch` — a
  global batch split across sites, with a clear error if it does not divide.

Capture (see :mod:`compjax.dad.capture`): ``flax.linen.intercept_methods``
wraps every ``nn.Dense`` and ``nn.DenseGeneral`` called inside ``loss_fn``
(and ``nnx.Linear.__call__`` is swapped for the trace, NNX having no method
interception), recording its input and adding a zero perturbation to its output; the
gradient with respect to the perturbations is ``Delta``.  Layers applied to
sequences (transformer projections, ``MultiHeadDotProductAttention``'s
``DenseGeneral`` q/k/v/out) flatten every non-contracted axis into rows.

Limits:

* only exactly ``nn.Dense``, ``nn.DenseGeneral`` and ``nnx.Linear`` (no
  subclasses, no ``batch_dims``, no custom ``dot_general``; an NNX model is
  built inside ``loss_fn`` by ``nnx.merge`` from ``params``, and each
  ``Linear`` is found by its kernel) are rebuilt from ``A`` and
  ``Delta``; every other leaf (norms, embeddings, convolutions) goes through
  an ordinary mean, or a compjax compressor;
* layers inside flax lifted transforms (``nn.scan``, ``nn.remat``,
  ``nn.vmap``, ``nn.jit``) or inside a ``jax.jit``-compiled ``model.apply``
  called by ``loss_fn`` cannot be captured (a ``ValueError`` says so): apply
  the model directly in ``loss_fn`` and jit the whole step;
* a Dense kernel must reach the loss only through its layer: an L2 penalty
  on it inside ``loss_fn`` would be dropped (use ``optax.add_decayed_weights``);
* ``loss_fn`` must call the same layers on every trace, and equal local
  batches are assumed for the pooled-mean reading.

References:
  Baker, Khanal, Calhoun, Pearlmutter, Plis, "Peering Beyond the Gradient
  Veil with Distributed Auto Differentiation", arXiv:2102.09631, 2021.
"""

from compjax.dad.accounting import dad_communication
from compjax.dad.capture import Layer
from compjax.dad.exchange import (
    dad_grads,
    dense_layers,
    factor_rank,
    gaussian_start,
    power_factors,
    rank_dad_grads,
    split_batch,
)

__all__ = [
    "Layer",
    "dad_communication",
    "dad_grads",
    "dense_layers",
    "factor_rank",
    "gaussian_start",
    "power_factors",
    "rank_dad_grads",
    "split_batch",
]
