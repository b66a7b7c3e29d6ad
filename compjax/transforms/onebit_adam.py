"""1-bit Adam: Adam's variance frozen after a warm-up, the momentum exchanged in one bit.

Two phases, switched by the shared step count:

* **Warm-up** (the first ``freeze_step`` steps): plain Adam on the mean
  gradient, all-reduced uncompressed: ``g = mean_i g_i``,
  ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``.
* **Compression** (every later step): ``v`` is frozen.  Each worker folds
  its own gradient into the shared momentum, ``m_i = b1 m + (1 - b1) g_i``,
  and the ``m_i`` are averaged by an error-compensated compressed
  all-reduce: worker ``i`` compresses ``m_i + e_i`` and keeps
  ``e_i <- m_i + e_i - C(m_i + e_i)``; the owner of each shard averages the
  decoded messages, adds its server error, compresses again and keeps the
  new server error; the re-compressed shards are all-gathered and become
  the new shared momentum ``m``.

Both phases update with ``m / (sqrt(v) + eps)``, with no bias correction,
as in the paper's Algorithm 1 and DeepSpeed's ``OnebitAdam`` (which also
carries the exchanged momentum, not each worker's own, into the next step).

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021 (arXiv:2102.02888).
  Tang, Yu, Lian, Zhang, Liu, "DoubleSqueeze: Parallel Stochastic Gradient
  Descent with Double-Pass Error-Compensated Compression", ICML 2019.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange
from compjax.transforms.base import check_grouping, counted
from compjax.transforms.compressed_adam import (
    Adam,
    begin,
    branches,
    check_hyperparams,
    configure,
    dense_branch,
    finish,
    init_buffers,
    momentum_branch,
)


class OnebitAdamState(NamedTuple):
    """State of :func:`scale_by_onebit_adam` (every moment and memory in float32).

    Attributes:
      count: steps taken (int32, shared): the phase is ``count < freeze_step``.
      mu: the momentum ``m``, shared (after each step every worker holds the
        same, decoded, momentum).
      nu: the variance ``v``, shared; frozen from step ``freeze_step`` on.
      error: per-worker error ``e_i`` of the worker-side compression.
      server_error: per-worker memories of the shard owners' compression
        (scatter-gather exchanges; an empty tuple on an all-gather).  Worker
        ``j`` keeps the entries of the shard it owns and zeros elsewhere; the
        memory is of the *sum* of the workers' messages, ``n`` times the
        paper's server error ``delta_bar`` (the same update, since the
        scaled sign is positively homogeneous).
      key: shared PRNG key (raw uint32), split every step.
    """

    count: jax.Array
    mu: Any
    nu: Any
    error: Any
    server_error: Any
    key: jax.Array
    PER_WORKER = ("error", "server_error")


def scale_by_onebit_adam(
    axis_name: AxisName,
    freeze_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    comp: Compressor | None = None,
    exchange: str | Exchange = "scatter_gather",
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """1-bit Adam's direction ``m / (sqrt(v) + eps)``; chain a learning rate after it.

    The first ``freeze_step`` steps are Adam on the all-reduced gradient; from
    then on ``v`` is frozen and the momentum travels compressed with error
    feedback on the workers and on the shard owners (see the module
    docstring).  Follow it with ``optax.scale_by_learning_rate(lr)``, or use
    :func:`onebit_adam`.  Weight decay, as DeepSpeed's, is
    ``optax.add_decayed_weights(wd)`` chained in between.

    What is sent, per leaf (``compjax.communication`` reports the compression
    phase; the warm-up all-reduces the gradient dense, ``dense_bits``):

    * ``exchange="scatter_gather"`` (default, the paper's compressed
      all-reduce): the ``n`` shards of ``m_i + e_i``, each as packed signs and
      one float32 scale, by ``all_to_all``; then the owner's re-compressed
      shard (packed signs and a scale) by ``all_gather``.  Each shard has its
      own worker-side scale, where DeepSpeed scales a worker's whole buffer
      by one: ``n - 1`` more floats per worker and leaf.
    * ``exchange="all_gather"``: the whole ``C(m_i + e_i)``, all-gathered;
      no server compression (``server_error`` is empty).
    * :func:`compjax.hierarchical`: the momentum is reduce-scattered
      uncompressed over the fast axis and its shard exchanged as above over
      the slow ones.

    The warm-up all-reduces the gradient in its own dtype (bf16 gradients are
    summed in bf16); the moments and memories are float32 throughout.  A leaf
    whose size is not a multiple of ``n`` has its last shard zero-padded, and
    the padding counts in that shard's scales (as in DeepSpeed's padded
    buffers).

    Non-finite gradients on any worker give NaN updates everywhere and keep
    the whole state, count included (see :mod:`compjax.transforms.base`).

    Args:
      axis_name: the data-parallel axis (a name, a tuple of names, or
        ``None`` for one worker).
      freeze_step: warm-up steps before the variance is frozen and the
        compression starts (>= 1).  DeepSpeed's default is 100000; its
        tutorial suggests 15-25% of the training steps (23000 for BERT-large
        pre-training, 400 for fine-tuning).  compjax's ``freeze_step=F`` is
        DeepSpeed's ``freeze_step=F + 1``: DeepSpeed's first ``step()`` only
        sets up its buffers and discards its gradient but counts, so its
        ``F`` runs ``F - 1`` warm-up steps, and at equal ``F`` the
        trajectories part from step ``F`` (compjax's last warm-up step,
        DeepSpeed's first compressed one).  To reproduce a DeepSpeed run
        configured with ``F``, pass ``F - 1`` (tested against a
        transcription of its counting).
      b1: momentum decay (paper 0.9).
      b2: variance decay (paper 0.999).
      eps: added to ``sqrt(v)`` (paper 1e-8).
      comp: the compressor of both stages; ``None`` is the paper's
        :func:`compjax.l2_scaled_sign` (scale ``||x||_2 / sqrt(d)``);
        :func:`compjax.scaled_sign` (scale ``||x||_1 / d``) is the
        contractive alternative.
      exchange: ``"scatter_gather"``, ``"all_gather"`` or
        :func:`compjax.hierarchical` (see :mod:`compjax.exchange`).
      flatten: treat the whole tree as one vector (one scale per shard of it).
      bucket_size: compress the flattened tree in buckets of this many
        entries; ``None``: leaf by leaf.
      seed: seed of the shared key (used by stochastic compressors only).

    Returns:
      An ``optax.GradientTransformation`` with :class:`OnebitAdamState`.

    Raises:
      ValueError: ``freeze_step`` not an integer >= 1, a beta outside
        ``[0, 1)``, ``eps <= 0``, or a bad ``exchange``/``bucket_size``.

    References:
      Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
      Communication Efficient Large-Scale Training with Adam's Convergence
      Speed", ICML 2021 (arXiv:2102.02888), Algorithm 1.
      Tang, Yu, Lian, Zhang, Liu, "DoubleSqueeze: Parallel Stochastic Gradient
      Descent with Double-Pass Error-Compensated Compression", ICML 2019.
    """
    check_hyperparams(b1, b2, eps, freeze_step=freeze_step)
    check_grouping(flatten, bucket_size)
    adam = configure(axis_name, b1, b2, eps, comp, exchange, flatten, bucket_size)
    return optax.GradientTransformation(
        functools.partial(_init, adam, seed),
        counted(functools.partial(_update, adam, freeze_step)),
    )


def _init(adam: Adam, seed: int, params) -> OnebitAdamState:
    return OnebitAdamState(count=jnp.zeros([], jnp.int32), **init_buffers(adam, seed, params))


def _update(adam: Adam, freeze_step: int, updates, state, params=None):
    step = begin(adam, updates, state)
    warmup, compressed = branches(adam, dense_branch, momentum_branch)
    operands = (step.leaves.arrays, step.keys, step.mus, step.nus, step.errors, step.memories)
    buffers = jax.lax.cond(state.count < freeze_step, warmup, compressed, *operands)
    return finish(adam, step, state, OnebitAdamState, buffers, {"count": state.count + 1})


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: AxisName,
    freeze_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    comp: Compressor | None = None,
    exchange: str | Exchange = "scatter_gather",
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """1-bit Adam with a learning rate: :func:`scale_by_onebit_adam`, then ``-learning_rate``.

    Args:
      learning_rate: a float or an optax schedule.
      axis_name, freeze_step, b1, b2, eps, comp, exchange, flatten, bucket_size, seed: see
        :func:`scale_by_onebit_adam`.

    Returns:
      ``optax.chain(scale_by_onebit_adam(...), optax.scale_by_learning_rate(lr))``.

    References:
      Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
      with Adam's Convergence Speed", ICML 2021.
    """
    return optax.chain(
        scale_by_onebit_adam(
            axis_name,
            freeze_step,
            b1,
            b2,
            eps,
            comp=comp,
            exchange=exchange,
            flatten=flatten,
            bucket_size=bucket_size,
            seed=seed,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )
