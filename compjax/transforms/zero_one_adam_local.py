"""0/1 Adam's local rounds: per-worker params between synchronisations (the paper's ``T_u``).

Once the variance is frozen, 0/1 Adam skips synchronisations: each worker
steps its own params with its own momentum, and the workers meet only at the
end of a round.  The rounds grow: the local interval starts at 1 at the
first frozen step and doubles every ``local_step_scaler`` frozen steps, up
to ``local_step_clipper`` (DeepSpeed's names; the clipper is the paper's
``H``).  A frozen step ends a round when the schedule's step count is a
multiple of the interval (:func:`compjax.transforms.zero_one_adam_schedule.step_kinds`).
While the variance adapts, every step synchronises, as in
:func:`compjax.scale_by_zero_one_adam`.

With ``d = sqrt(v) + eps`` (``v`` frozen) and the step's learning rate
``lr_t``, a frozen step on worker ``i``:

* ``m_i <- b1 m_i + (1 - b1) g_i`` (its own gradient);
* ``u_i <- u_i + lr_t m_i`` and ``L <- L + lr_t`` (the paper's ``u``: the
  momentum accumulated in learning-rate units, that is the displacement of
  the params times ``d``; ``L`` the rates of the round);
* inside a round, the params move by ``-lr_t m_i / d``;
* at a round's end, ``u_i`` plus the worker's error travels through the
  error-compensated 1-bit compressed all-reduce (worker and server error
  feedback, the buffers restarted at the freeze) and gives the mean ``S``;
  the global params become ``theta <- theta - S / d``, every worker's
  momentum ``m <- S / L`` (zero if ``L <= 0``: a round without learning
  rate carries no momentum, and moves the params by the memory it flushes),
  ``u <- 0``, ``L <- 0``; the update returned moves the worker to the new
  ``theta``.

This is DeepSpeed's ``ZeroOneAdam`` with ``weight_decay = 0`` (which
compresses ``-u``, reverts each worker's local steps and adds ``-S / d``),
tested against a transcription of that step.  Weight decay is not inside:
``optax.add_decayed_weights`` chained before adds an L2 term to the
gradients (it then enters the momentum, as any gradient).  Unlike compjax's
synchronising 0/1 Adam, which compresses in gradient units with the
learning rate chained after it, the error buffers here are in the units of
``u``: the learning rate is inside the transformation, so the memory of a
round is what the params missed, whatever the next round's length or rate.
At a constant rate and before the interval grows the two agree to float32
rounding (the scaled sign is positively homogeneous).

The per-worker layout of :func:`compjax.diloco`: the params of ``update``
are each worker's own (stacked on a leading worker axis outside the map,
:func:`compjax.worker_copies`); the state holds the global params ``theta``
(the params at the last synchronisation, in float32; read them with
:func:`compjax.global_params`), the momentum ``m`` the workers agree on,
the variance and the counters (all shared), and each worker's own momentum,
accumulator and error buffers (per worker).  After a synchronisation
``theta`` and the momenta are the same on every worker bit for bit, and the
params equal ``theta`` up to the rounding of the additive update
``params + (theta - params)`` (exactly where ``params`` is within a factor 2
of ``theta``; otherwise within half an ulp of ``theta - params`` plus half
an ulp of ``theta``, in the params' dtype); the state keeps ``theta``, so
the rounding never accumulates.  The updates must reach the params
unchanged: chain nothing after it.

Memory per worker for ``P`` parameters: the local params, ``theta``, the
shared and the worker's momentum, ``v``, ``u`` and the error (``7P``,
float32 apart from the params), and the shard owners' error over the
scatter-gather exchange (``8P``), against ``5P`` for the synchronising 0/1
Adam (DeepSpeed keeps the params, both moments, ``u``, the worker error and
a server error of ``P/n``).

References:
  Lu, Li, Zhang, Tang, Awan, He, "Maximizing Communication Efficiency for
  Large-scale Training via 0/1 Adam", ICLR 2023 (arXiv:2202.06009).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.draws import step_keys
from compjax.exchange import Exchange
from compjax.guards import all_finite, any_non_finite, guarded
from compjax.transforms.base import Leaves, cast_like, check_grouping, counted, state_zeros
from compjax.transforms.compressed_adam import (
    Adam,
    branches,
    check_hyperparams,
    configure,
    float32_zeros,
    init_buffers,
    read_buffers,
    write_buffers,
)
from compjax.transforms.per_worker_params import check_params_dtype
from compjax.transforms.zero_one_adam_rounds import (
    Round,
    dense_round,
    gradient_round,
    local_round,
    sync_round,
)
from compjax.transforms.zero_one_adam_schedule import (
    VarianceSchedule,
    offset,
    phase,
    restarted,
    variance_counters,
)


class ZeroOneAdamLocalState(NamedTuple):
    """State of 0/1 Adam with local rounds (:func:`compjax.zero_one_adam` with
    ``local_step_clipper > 1``); moments, buffers and ``theta`` in float32.

    Attributes:
      count: steps taken (int32, shared).
      var_interval: the current interval between variance steps (int32).
      var_counter: variance steps taken at this interval (int32).
      local_interval: the current interval between synchronisations (int32).
      local_counter: frozen steps taken at this interval (int32).
      lr_sum: ``L``, the learning rates of the round so far (float32, shared).
      global_params: ``theta``, the params of the last synchronisation, shared.
      mu: the momentum the workers agree on (every step's while the variance adapts,
        then the last synchronisation's), shared.
      local_mu: each worker's own momentum inside a round (``mu`` at its start).
      nu: the variance, shared.
      accumulator: each worker's ``u``, its momentum accumulated over the round in
        learning-rate units.
      error: per-worker error of the worker-side compression.
      server_error: per-worker memories of the shard owners (``()`` on an all-gather).
      key: shared PRNG key (raw uint32).
    """

    count: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_interval: jax.Array
    local_counter: jax.Array
    lr_sum: jax.Array
    global_params: Any
    mu: Any
    local_mu: Any
    nu: Any
    accumulator: Any
    error: Any
    server_error: Any
    key: jax.Array
    PER_WORKER = ("local_mu", "accumulator", "error", "server_error")


def check_local_steps(local_step_scaler: int, local_step_clipper: int) -> None:
    """Construction-time checks: both integers >= 1 (they shape the schedule, so no arrays).

    Raises:
      ValueError: either is not an integer >= 1 (the message names it).
    """
    for name, value in (
        ("local_step_scaler", local_step_scaler),
        ("local_step_clipper", local_step_clipper),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_learning_rate(learning_rate) -> None:
    if callable(learning_rate):
        return
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, int | float):
        if jnp.ndim(learning_rate) != 0:
            raise ValueError(f"learning_rate must be a scalar or a schedule, got {learning_rate!r}")
        return  # an array (from optax.inject_hyperparams): its value is not known here
    if not 0.0 <= learning_rate < float("inf"):
        raise ValueError(f"learning_rate must be finite and >= 0, got {learning_rate!r}")


def local_zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: AxisName,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    comp: Compressor | None = None,
    exchange: str | Exchange = "scatter_gather",
    flatten: bool = False,
    bucket_size: int | None = None,
    seed: int = 0,
    schedule: str = "compjax",
) -> optax.GradientTransformation:
    """0/1 Adam with local rounds over per-worker params (see the module docstring).

    :func:`compjax.zero_one_adam` returns this for ``local_step_clipper > 1``;
    with ``local_step_clipper = 1`` it synchronises every step and follows
    the synchronising 0/1 Adam (to float32 rounding at a constant rate).

    Communication: the 1-bit round travels on the steps that synchronise
    (``lax.switch``); every step reduces the 8-bit non-finite flag.
    :func:`compjax.communication` reports one synchronising step, as for
    :func:`compjax.diloco`; :func:`compjax.transforms.zero_one_adam_schedule.mean_bits_per_step`
    averages it over the schedule.

    Non-finite input: if any worker's gradient holds an Inf or NaN, or the
    step would leave a non-finite value in the state or in the updates as
    returned (in the wider of each gradient's and param's dtypes: ``lr m /
    eps`` where the variance froze at 0 overflows float16), every worker gets
    NaN updates and the whole state is kept, ``theta``, the momenta, the
    accumulators and the memories included; :func:`compjax.local_steps`
    then keeps the params.

    Args:
      learning_rate: a float (>= 0) or an optax schedule of the step count.
      axis_name, var_freeze_step, var_update_scaler, b1, b2, eps: as
        :func:`compjax.scale_by_zero_one_adam`.
      comp, exchange, flatten, bucket_size, seed, schedule: as
        :func:`compjax.scale_by_zero_one_adam`.
      local_step_scaler: frozen steps between doublings of the local
        interval (DeepSpeed's default 32678).
      local_step_clipper: the largest local interval, the paper's ``H``.

    Returns:
      An ``optax.GradientTransformation`` with :class:`ZeroOneAdamLocalState`
      whose ``update(grads, state, params)`` needs ``params``, this worker's
      own.  The updates are in the wider of each gradient's and param's
      dtypes.

    Raises:
      ValueError: as :func:`compjax.scale_by_zero_one_adam`; ``learning_rate``
        a negative or non-finite number; ``local_step_scaler`` or
        ``local_step_clipper`` not an integer >= 1; at ``init``, float64
        params (``jax_enable_x64``: cast them to float32 first); at
        ``update``, ``params`` missing.

    References:
      Lu et al., "Maximizing Communication Efficiency for Large-scale
      Training via 0/1 Adam", ICLR 2023 (the local steps ``T_u``).
    """
    check_hyperparams(
        b1, b2, eps, var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler
    )
    check_local_steps(local_step_scaler, local_step_clipper)
    _check_learning_rate(learning_rate)
    check_grouping(flatten, bucket_size)
    variance = VarianceSchedule(var_freeze_step, var_update_scaler, offset(schedule))
    adam = configure(axis_name, b1, b2, eps, comp, exchange, flatten, bucket_size)
    rounds = _Rounds(learning_rate, local_step_scaler, local_step_clipper)
    return optax.GradientTransformation(
        functools.partial(_init, adam, seed),
        counted(functools.partial(_update, adam, variance, rounds)),
    )


class _Rounds(NamedTuple):
    """``T_u`` and the learning rate, as the construction fixes them."""

    learning_rate: optax.ScalarOrSchedule
    local_step_scaler: int
    local_step_clipper: int


def _init(adam: Adam, seed: int, params) -> ZeroOneAdamLocalState:
    check_params_dtype(params, "zero_one_adam with local_step_clipper > 1")
    leaves = Leaves(params, adam.flatten, adam.bucket_size)
    one, zero = jnp.ones([], jnp.int32), jnp.zeros([], jnp.int32)
    fill = state_zeros(None)
    return ZeroOneAdamLocalState(
        count=zero,
        var_interval=one,
        var_counter=zero,
        local_interval=one,
        local_counter=zero,
        lr_sum=jnp.zeros([], jnp.float32),
        global_params=jax.tree.map(lambda p: jnp.asarray(p).astype(fill(p).dtype), params),
        local_mu=leaves.worker_state(float32_zeros),
        accumulator=leaves.worker_state(float32_zeros),
        **init_buffers(adam, seed, params),
    )


def _rate(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    return jnp.asarray(lr, jnp.float32)


def _check_shapes(thetas, grads) -> None:
    for t, g in zip(thetas, grads, strict=True):
        if t.shape != g.shape:
            raise ValueError(
                f"state field 'global_params' has a leaf of shape {t.shape} where the "
                f"updates need {g.shape}: was the state initialised for other params?"
            )


def _returned(out, own: Leaves, updates, params):
    """The updates in the wider of each gradient's and param's dtypes: a synchronisation's
    update to float32 params is not rounded to a bfloat16 gradient's precision."""
    return jax.tree.map(
        lambda o, g, p: o.astype(jnp.promote_types(g.dtype, p.dtype)),
        own.rebuild(out),
        updates,
        params,
    )


def _local_counters(rounds: _Rounds, state, adaptive: jax.Array) -> dict:
    """The state's ``local_interval`` and ``local_counter`` after the step: the interval
    doubles after ``local_step_scaler`` frozen steps, up to ``local_step_clipper``."""
    frozen_steps = state.local_counter + (~adaptive).astype(jnp.int32)
    widened = frozen_steps == rounds.local_step_scaler
    longer = jnp.minimum(rounds.local_step_clipper, 2 * state.local_interval)
    return {
        "local_interval": jnp.where(widened, longer, state.local_interval),
        "local_counter": jnp.where(widened, 0, frozen_steps),
    }


def _update(adam: Adam, variance: VarianceSchedule, rounds: _Rounds, updates, state, params=None):
    if params is None:
        raise ValueError(
            "zero_one_adam with local_step_clipper > 1: update(grads, state, params) "
            "needs params, this worker's own params"
        )
    leaves = Leaves(updates, adam.flatten, adam.bucket_size)
    own = Leaves(params, adam.flatten, adam.bucket_size)
    shared = Leaves(state.global_params, adam.flatten, adam.bucket_size)
    bad = any_non_finite(leaves.arrays, adam.axis_name)
    _check_shapes(shared.arrays, leaves.arrays)
    mus, nus, errors, old_memories = read_buffers(leaves, adam.server, state)
    local_mus = leaves.read(state.local_mu, "local_mu", per_worker=True)
    accs = leaves.read(state.accumulator, "accumulator", per_worker=True)
    key, keys = step_keys(state.key, len(leaves.arrays))
    lr = _rate(rounds.learning_rate, state.count)
    now = phase(variance, state)
    sync = ~now.adaptive & ((now.count + 1) % state.local_interval == 0)
    errors, memories = restarted(now.restart, errors, old_memories)
    lr_sum = state.lr_sum + jnp.where(now.adaptive, 0.0, lr)
    thetas = shared.arrays
    ds = [jnp.sqrt(v) + adam.eps for v in nus]
    shared_by_all = Round(adam, lr, lr_sum, ds, own.arrays)
    kinds = branches(shared_by_all, dense_round, gradient_round, local_round, sync_round)
    branch = jnp.where(now.variance_step, 0, jnp.where(now.adaptive, 1, jnp.where(sync, 3, 2)))
    operands = (leaves.arrays, keys, mus, local_mus, nus, accs, errors, memories, thetas)
    mus, local_mus, nus, accs, errors, memories, new_thetas, out = jax.lax.switch(
        branch, kinds, *operands
    )
    new_state = ZeroOneAdamLocalState(
        count=state.count + 1,
        **variance_counters(variance, state, now.variance_step),
        **_local_counters(rounds, state, now.adaptive),
        lr_sum=jnp.where(sync, 0.0, lr_sum),
        global_params=shared.rebuild(cast_like(new_thetas, thetas)),
        local_mu=leaves.write(local_mus, per_worker=True),
        accumulator=leaves.write(accs, per_worker=True),
        key=key,
        **write_buffers(leaves, adam.server, mus, nus, errors, memories, old_memories),
    )
    # Finite as returned: a float32 step beyond a float16 param's range (lr m / eps where
    # the variance froze at 0) refuses the step, as a non-finite float32 one does.
    finite = all_finite(jax.tree.leaves(_returned(out, own, updates, params)))
    out, new_state = guarded(bad, out, new_state, state, finite=[finite] * len(out))
    return _returned(out, own, updates, params), new_state
