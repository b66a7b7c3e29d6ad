"""0/1 Adam: adaptive variance freezing and 1-bit synchronisation, every step or in rounds.

0/1 Adam (Lu et al. 2022) removes 1-bit Adam's uncompressed warm-up.  With
the step ``t`` counted from 1, while ``t <= var_freeze_step + 1``:

* on a **variance step** (``t`` a multiple of ``var_interval``) the gradient
  is all-reduced uncompressed and both moments are updated,
  ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``.  Every
  ``var_update_scaler`` variance steps the interval doubles (1, 2, 4, ...:
  the set ``T_v`` of the paper grows ever sparser);
* on every other step the *gradient* travels through the 1-bit compressed
  all-reduce with worker and server error feedback, ``g_hat``, and only the
  momentum moves: ``m <- b1 m + (1 - b1) g_hat``.

From then on ``v`` is frozen, the error buffers start again from zero (the
compressed quantity changes from gradients to momenta), and each step is
1-bit Adam's compression stage: ``m_i = b1 m + (1 - b1) g_i`` averaged
through the error-compensated compressed all-reduce.  Every step updates
with ``m / (sqrt(v) + eps)`` (no bias correction), as DeepSpeed's
``ZeroOneAdam`` does.

That is :func:`scale_by_zero_one_adam`, and :func:`zero_one_adam` with
``local_step_clipper = 1`` (the default): a synchronisation at every step,
on replicated params.  :func:`zero_one_adam` with ``local_step_clipper > 1``
adds the paper's local rounds ``T_u`` (DeepSpeed's ``local_step_scaler``
and ``local_step_clipper``): once the variance is frozen each worker steps
its own params between synchronisations that grow further apart, on the
per-worker params of :func:`compjax.diloco`
(:mod:`compjax.transforms.zero_one_adam_local`).

**Where the synchronising path departs from DeepSpeed's ``ZeroOneAdam``** (tested against a
transcription of its ``step`` in ``tests/test_zero_one_adam.py``):

* *The variance steps, shifted by one.*  DeepSpeed's first ``step()`` call
  only allocates its buffers and discards its gradient, but counts as step 1,
  and its schedule runs on that count: fed the same gradients (``kappa = 2``,
  ``var_freeze_step = 12``) it updates the variance on the gradients 1, 2, 3,
  5, 7, 11 and freezes from 13, where compjax's default does on 1, 2, 4, 6,
  8, 12 and freezes from 14.  ``schedule="deepspeed"`` gives DeepSpeed's
  steps; no other setting does.
* *What the frozen phase compresses.*  compjax compresses each worker's
  momentum ``b1 m + (1 - b1) g_i`` plus its error, in gradient units; the
  learning rate and weight decay (``optax.add_decayed_weights``) are applied
  to the direction afterwards and never enter ``m`` or the error buffers.
  DeepSpeed compresses ``-lr (m_i / (sqrt(v) + eps) + wd p) (sqrt(v) + eps)``
  (its buffer for the paper's ``u``: learning-rate units, weight decay
  inside) plus an error kept in those units, and sets ``m`` to minus the
  decoded mean over ``lr``, weight-decay term included.  The two agree while
  the learning rate is constant and ``wd = 0`` (the scaled sign is positively
  homogeneous); after a change of learning rate DeepSpeed's error buffer
  carries the earlier rates into the next messages, and with weight decay
  its momentum carries ``wd p (sqrt(v) + eps)``.  compjax's synchronising
  frozen phase is 1-bit Adam's compression stage, with the learning rate
  chained after it as for every optax transformation.  The local rounds,
  whose learning rate is inside the transformation, keep DeepSpeed's
  learning-rate units (without its weight decay), and its schedule's shift
  is theirs to choose too (``schedule``).

References:
  Lu, Li, Zhang, Tang, Awan, He, "Maximizing Communication Efficiency for
  Large-scale Training via 0/1 Adam", ICLR 2023 (arXiv:2202.06009).
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
  Adam's Convergence Speed", ICML 2021.
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
    gradient_branch,
    init_buffers,
    momentum_branch,
)
from compjax.transforms.zero_one_adam_local import check_local_steps, local_zero_one_adam
from compjax.transforms.zero_one_adam_schedule import (  # noqa: F401 (SCHEDULES re-exported)
    SCHEDULES,
    VarianceSchedule,
    offset,
    phase,
    restarted,
    variance_counters,
    variance_steps,
)


class ZeroOneAdamState(NamedTuple):
    """State of :func:`scale_by_zero_one_adam` (moments and memories in float32).

    Attributes:
      count: steps taken (int32, shared).
      var_interval: the current interval between variance steps (int32).
      var_counter: variance steps taken at this interval (int32).
      mu: the momentum, shared.
      nu: the variance, shared.
      error: per-worker error of the worker-side compression.
      server_error: per-worker memories of the shard owners (``()`` on an
        all-gather).
      key: shared PRNG key (raw uint32).
    """

    count: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    mu: Any
    nu: Any
    error: Any
    server_error: Any
    key: jax.Array
    PER_WORKER = ("error", "server_error")


def scale_by_zero_one_adam(
    axis_name: AxisName,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    comp: Compressor | None = None,
    exchange: str | Exchange = "scatter_gather",
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
    schedule: str = "compjax",
) -> optax.GradientTransformation:
    """0/1 Adam's direction ``m / (sqrt(v) + eps)``, synchronising every step (module docstring).

    ``compjax.communication`` reports one compressed round (a 1-bit gradient
    round and a 1-bit momentum round send the same messages); variance steps
    all-reduce the gradient uncompressed.

    Args:
      axis_name: the data-parallel axis (or axes; ``None`` for one worker).
      var_freeze_step: the last step (from 1) on which the variance may be
        updated (DeepSpeed's default 100000; its tutorial uses the end of the
        learning-rate warm-up).
      var_update_scaler: variance steps per interval before it doubles (the
        paper's kappa; DeepSpeed's default 16).
      b1, b2, eps: Adam's constants.
      comp, exchange, flatten, bucket_size, seed: as
        :func:`compjax.scale_by_onebit_adam` (default: the l2-scaled 1-bit
        sign over the scatter-gather compressed all-reduce).
      schedule: which steps are variance steps and when the variance
        freezes (:func:`variance_steps`).  ``"compjax"`` (default): the step
        ``t`` (from 1) when ``t`` is a multiple of the interval, while ``t <=
        var_freeze_step + 1``; frozen from ``var_freeze_step + 2``.
        ``"deepspeed"``: DeepSpeed's ``ZeroOneAdam`` on the same gradients,
        whose first ``step()`` call only sets up buffers but counts: ``t + 1``
        a multiple of the interval, while ``t <= var_freeze_step``; frozen
        (error buffers restarted) from ``var_freeze_step + 1``.  DeepSpeed
        fed a first, discarded gradient and then compjax's gradients gives
        compjax's ``"deepspeed"`` updates (tested against a transcription of
        its ``step``).  No ``var_freeze_step`` or ``var_update_scaler`` makes
        one schedule the other's.

    Returns:
      An ``optax.GradientTransformation`` with :class:`ZeroOneAdamState`.

    Raises:
      ValueError: ``var_freeze_step`` or ``var_update_scaler`` not an integer
        >= 1, a beta outside ``[0, 1)``, ``eps <= 0``, a bad
        ``exchange``/``bucket_size``, or ``schedule`` not one of
        :data:`SCHEDULES`.

    References:
      Lu et al., "Maximizing Communication Efficiency for Large-scale
      Training via 0/1 Adam", ICLR 2023, Algorithm 1 (with ``T_u`` every step).
    """
    check_hyperparams(
        b1, b2, eps, var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler
    )
    check_grouping(flatten, bucket_size)
    variance = VarianceSchedule(var_freeze_step, var_update_scaler, offset(schedule))
    adam = configure(axis_name, b1, b2, eps, comp, exchange, flatten, bucket_size)
    return optax.GradientTransformation(
        functools.partial(_init, adam, seed),
        counted(functools.partial(_update, adam, variance)),
    )


def _init(adam: Adam, seed: int, params) -> ZeroOneAdamState:
    return ZeroOneAdamState(
        count=jnp.zeros([], jnp.int32),
        var_interval=jnp.ones([], jnp.int32),
        var_counter=jnp.zeros([], jnp.int32),
        **init_buffers(adam, seed, params),
    )


def _update(adam: Adam, variance: VarianceSchedule, updates, state, params=None):
    step = begin(adam, updates, state)
    count = state.count + 1
    now = phase(variance, state)
    errors, memories = restarted(now.restart, step.errors, step.memories)
    steps = branches(adam, dense_branch, gradient_branch, momentum_branch)
    branch = jnp.where(now.variance_step, 0, jnp.where(now.adaptive, 1, 2))
    operands = (step.leaves.arrays, step.keys, step.mus, step.nus, errors, memories)
    buffers = jax.lax.switch(branch, steps, *operands)
    counters = {"count": count, **variance_counters(variance, state, now.variance_step)}
    return finish(adam, step, state, ZeroOneAdamState, buffers, counters)


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: AxisName,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 1,
    **kwargs,
) -> optax.GradientTransformation:
    """0/1 Adam with a learning rate, synchronising every step or with local rounds.

    ``local_step_clipper = 1`` (default): :func:`scale_by_zero_one_adam`,
    then ``-learning_rate``; the params are replicated and every step
    synchronises.  ``local_step_clipper > 1``: 0/1 Adam's local rounds
    (:func:`compjax.transforms.zero_one_adam_local.local_zero_one_adam`) over
    per-worker params, as :func:`compjax.diloco`: once the variance is
    frozen the workers step their own params between synchronisations whose
    interval doubles every ``local_step_scaler`` frozen steps up to
    ``local_step_clipper``; ``update(grads, state, params)`` then needs this
    worker's own ``params`` and must be the last transformation of a chain.

    Args:
      learning_rate: a float or an optax schedule.
      axis_name, var_freeze_step, var_update_scaler, b1, b2, eps: see
        :func:`scale_by_zero_one_adam`; ``kwargs``: its keyword options.
      local_step_scaler: frozen steps between doublings of the local
        interval (DeepSpeed's default 32678; no effect at
        ``local_step_clipper = 1``).
      local_step_clipper: the largest interval between synchronisations, the
        paper's ``H`` (DeepSpeed's default is 16; compjax's 1 synchronises
        every step).

    Returns:
      An ``optax.GradientTransformation``: at ``local_step_clipper = 1``
      ``optax.chain(scale_by_zero_one_adam(...), optax.scale_by_learning_rate(lr))``
      with replicated params; above it the local rounds' transformation, with
      :class:`compjax.transforms.zero_one_adam_local.ZeroOneAdamLocalState`,
      whose ``update`` needs this worker's ``params``.

    Raises:
      ValueError: as :func:`scale_by_zero_one_adam`, or ``local_step_scaler``
        or ``local_step_clipper`` not an integer >= 1.

    References:
      Lu et al., "Maximizing Communication Efficiency for Large-scale
      Training via 0/1 Adam", ICLR 2023.
    """
    check_local_steps(local_step_scaler, local_step_clipper)
    args = (axis_name, var_freeze_step, var_update_scaler, b1, b2, eps)
    if local_step_clipper > 1:
        return local_zero_one_adam(
            learning_rate,
            *args,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
            **kwargs,
        )
    return optax.chain(
        scale_by_zero_one_adam(*args, **kwargs), optax.scale_by_learning_rate(learning_rate)
    )
