"""Choose a compressed method by timing it: candidates take the first steps in turn, on the
real mesh, and every later step runs the fastest.

:func:`compjax.advise` predicts whether compression pays from a cost model and a codec timed
on one device; :func:`auto` measures instead.  Timing cannot happen inside ``jax.jit``, so,
like :func:`compjax.data_parallel` (whose step each candidate runs), :func:`auto` builds a
host-level ``init`` and ``step``:

* **Trial.**  The candidates take real training steps in turn, in the order given: each its
  ``warmup_steps`` (untimed: they compile), then ``trial_steps`` timed ones (wall time from
  dispatch to ``jax.block_until_ready`` of the step's outputs, its inputs ready first).  The
  params keep training through the trial; no step is thrown away.
* **Agreement.**  Every process times its own steps, and each timed step's time is agreed at
  once as the maximum over all devices of the mesh (a jitted ``pmax`` under ``shard_map``, on
  a global array built from every process's own value, so it works across ``jax.distributed``
  processes): a step is as slow as its slowest worker, and every process holds the same table
  of times.  A candidate's timing is the median of its agreed step times.
* **Choice.**  After the last trial step the candidate with the smallest timing is chosen (ties
  go to the earlier candidate); every process computes the same ``argmin`` of the same
  numbers, so all take the same choice.  Every later step runs the winner alone.

Each candidate has its own optimizer state, initialised by ``init`` and updated only by its
own steps: the winner continues from the state its trial steps left, which never saw the other
candidates' steps (an Adam moment or a step count restarts when its candidate's turn begins).
The losers' states are frozen at their last trial step and never read again; whatever an
error memory of a loser held (the part of its gradients it had not yet sent) is never applied.
That is a one-off loss of at most the few trial steps' residual, the same as restarting error
feedback with a fresh memory, which its convergence bounds tolerate.  The state keeps every
candidate's memory for the whole run (its structure never changes, so a checkpoint restores
onto ``init``'s state at any step); to free the losers', continue with
``compjax.data_parallel(loss_fn, candidates[name], ...)`` from ``state.states[index]`` (the
winner's own step, equal to :func:`auto`'s).

The state (:class:`AutoState`) holds the trial's position, the agreed times and the choice as
arrays, so it checkpoints with orbax like any other state, and a restored run continues the
trial where it stopped or, once chosen, never times again.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import collectives
from compjax.steps.data_parallel import data_parallel

P = jax.P


class AutoState(NamedTuple):
    """The state of :func:`auto`'s step.

    Attributes:
      choice: ``int32`` scalar, the chosen candidate's index; ``-1`` during the trial.
      trial_step: ``int32`` scalar, the trial steps taken (stops at the trial's length).
      times: ``float32`` ``(candidates, trial_steps)``, each timed step's wall time in
        seconds, agreed over the mesh (the maximum over workers); NaN until measured.
      states: one optimizer state per candidate, in the candidates' order.
    """

    choice: jax.Array
    trial_step: jax.Array
    times: jax.Array
    states: tuple


class AutoReport(NamedTuple):
    """What :func:`auto` measured: ``names`` in order, ``timings`` (seconds per step, the median
    of each candidate's agreed step times; NaN while not yet measured), ``chosen`` (the
    winner's name, ``None`` during the trial) and ``trial_steps_left``."""

    names: tuple[str, ...]
    timings: tuple[float, ...]
    chosen: str | None
    trial_steps_left: int


class Auto(NamedTuple):
    """``init(params) -> AutoState``; ``step(params, state, *batch) -> (params, state, loss)``;
    ``report(state) -> AutoReport``; ``names`` of the candidates, in order; ``specs``, the
    state's partition specs (``P()`` for the trial's fields, each candidate's own specs)."""

    init: Callable[[Any], AutoState]
    step: Callable[..., tuple[Any, AutoState, jax.Array]]
    report: Callable[[AutoState], AutoReport]
    names: tuple[str, ...]
    specs: AutoState


def _host(x: jax.Array) -> np.ndarray:
    """A replicated array's value, read from this process's own copy (multi-process safe)."""
    return np.asarray(x.addressable_shards[0].data)


def _replicated(value: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
    """``value`` (the same on every process) as a global array replicated over ``mesh``."""
    value = np.asarray(value)
    sharding = jax.NamedSharding(mesh, P())
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def local_values(value: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
    """A global array of shape ``(mesh.size, *value.shape)`` split over every device of
    ``mesh``, each device's row holding its own process's ``value``."""
    value = np.asarray(value, np.float32)
    sharding = jax.NamedSharding(mesh, P(mesh.axis_names))
    return jax.make_array_from_callback(
        (mesh.size, *value.shape), sharding, lambda index: value[None]
    )


def agreed_max(mesh: jax.sharding.Mesh) -> Callable[[jax.Array], jax.Array]:
    """A jitted function from a ``(mesh.size, ...)`` array split over every device of ``mesh``
    (one row per device, e.g. :func:`local_values`) to the maximum of the rows, replicated: a
    ``pmax`` over all of ``mesh``'s axes, so every device and every process gets the same
    numbers."""
    names = tuple(mesh.axis_names)

    def rows_max(rows):
        return collectives.pmax(rows[0], names)

    return jax.jit(jax.shard_map(rows_max, mesh=mesh, in_specs=P(names), out_specs=P()))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check(candidates, trial_steps, warmup_steps, clock) -> None:
    if not isinstance(candidates, Mapping) or not candidates:
        raise ValueError(
            "candidates must be a non-empty dict of name -> optax.GradientTransformation, "
            f"got {candidates!r}"
        )
    for name, opt in candidates.items():
        if not isinstance(name, str):
            raise ValueError(f"candidates: names must be strings, got {name!r}")
        if not isinstance(opt, optax.GradientTransformation):
            raise ValueError(
                f"candidates[{name!r}] must be an optax.GradientTransformation, got {opt!r}"
            )
    if not _is_int(trial_steps) or trial_steps < 1:
        raise ValueError(f"trial_steps must be an integer >= 1, got {trial_steps!r}")
    if not _is_int(warmup_steps) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if not callable(clock):
        raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")


def choose(times: np.ndarray) -> int:
    """The index of the smallest median over each row of ``times`` (the first on ties)."""
    return int(np.argmin(np.median(times, axis=1)))


def auto(
    loss_fn: Callable[..., jax.Array],
    candidates: Mapping[str, optax.GradientTransformation],
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str = "data",
    *,
    trial_steps: int = 3,
    warmup_steps: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> Auto:
    """Time candidate optimizers on the first training steps and keep the fastest.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``, as for :func:`compjax.data_parallel`.
      candidates: name -> optax transformation, each with its compressed exchange over
        ``axis_name`` and its optimizer, as ``data_parallel``'s ``opt`` (e.g.
        ``{"dense": optax.sgd(lr), "qsgd": optax.chain(compjax.compress(...), optax.sgd(lr))}``).
        Their order is the trial's, and breaks ties.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), replicated.
      mesh: the device mesh (every device of every process).
      axis_name: the data-parallel mesh axis.
      trial_steps: timed steps per candidate (the median is kept).
      warmup_steps: untimed steps per candidate before its timed ones (they compile it).
      clock: the timer, ``clock() -> seconds``; called twice around each timed step (right
        before it is dispatched and once its outputs are ready) and never otherwise, so a test
        can script the times.

    Returns:
      :class:`Auto`.  The trial takes ``len(candidates) * (warmup_steps + trial_steps)`` steps,
      each a real training step; ``report(state)`` gives the timings and the choice.

    Raises:
      ValueError: empty or non-dict ``candidates``, a value that is not an
        ``optax.GradientTransformation``, ``trial_steps < 1``, ``warmup_steps < 0``, a
        ``clock`` that is not callable, or ``axis_name`` not an axis of ``mesh``.

    See also:
      :func:`compjax.advise`, which predicts from a cost model what :func:`auto` measures
      (docs/benchmarks.md).
    """
    _check(candidates, trial_steps, warmup_steps, clock)
    names = tuple(candidates)
    steps = [data_parallel(loss_fn, candidates[n], params, mesh, axis_name) for n in names]
    trial_steps, warmup_steps = int(trial_steps), int(warmup_steps)
    per = warmup_steps + trial_steps
    length = len(names) * per
    agree = agreed_max(mesh)
    replicated = jax.NamedSharding(mesh, P())

    def init(p) -> AutoState:
        return AutoState(
            choice=_replicated(np.int32(-1), mesh),
            trial_step=_replicated(np.int32(0), mesh),
            times=_replicated(np.full((len(names), trial_steps), np.nan, np.float32), mesh),
            states=tuple(dp.init(p) for dp in steps),
        )

    def with_state(state: AutoState, i: int, s) -> tuple:
        return tuple(s if j == i else old for j, old in enumerate(state.states))

    seen = []  # the last choice array read and its value: after the trial it never changes

    def chosen_index(choice: jax.Array) -> int:
        if not seen or seen[0] is not choice:
            seen[:] = [choice, int(_host(choice))]
        return seen[1]

    def step(p, state: AutoState, *batch):
        chosen = chosen_index(state.choice)
        if chosen >= 0:
            p, s, loss = steps[chosen].step(p, state.states[chosen], *batch)
            return p, state._replace(states=with_state(state, chosen, s)), loss
        t = int(_host(state.trial_step))
        # typed and placed as every step returns them (strong types, replicated on the mesh):
        # the first step's params (weakly typed or uncommitted arrays, often) would otherwise
        # compile the first candidate a second time, in a timed step
        p = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, x.dtype), p), replicated)
        i, k = divmod(t, per)
        if k < warmup_steps:
            p, s, loss = steps[i].step(p, state.states[i], *batch)
            times = state.times
        else:
            jax.block_until_ready((p, state.states[i], batch))
            start = clock()
            p, s, loss = steps[i].step(p, state.states[i], *batch)
            jax.block_until_ready((p, s, loss))
            elapsed = clock() - start
            table = _host(state.times).copy()
            table[i, k - warmup_steps] = _host(agree(local_values(elapsed, mesh)))
            times = _replicated(table, mesh)
        choice = state.choice
        if t + 1 == length:
            choice = _replicated(np.int32(choose(_host(times))), mesh)
        new = AutoState(choice, _replicated(np.int32(t + 1), mesh), times, with_state(state, i, s))
        return p, new, loss

    def report(state: AutoState) -> AutoReport:
        table = _host(state.times)
        timings = tuple(
            float(np.median(row)) if not np.isnan(row).any() else math.nan for row in table
        )
        chosen = int(_host(state.choice))
        return AutoReport(
            names=names,
            timings=timings,
            chosen=names[chosen] if chosen >= 0 else None,
            trial_steps_left=length - int(_host(state.trial_step)),
        )

    specs = AutoState(P(), P(), P(), tuple(dp.specs for dp in steps))
    return Auto(init=init, step=step, report=report, names=names, specs=specs)
