"""0/1 Adam's schedules: the variance steps ``T_v``, the synchronisations ``T_u``, and the
mean bits per step they give.

Both schedules run on a step count from 1.  compjax's default
(``schedule="compjax"``) counts one step per gradient; ``"deepspeed"`` runs
on DeepSpeed's count, one ahead (its first ``step()`` call only sets up its
buffers and discards its gradient, but counts).  Writing ``s`` for the count
the schedule runs on (``t`` or ``t + 1`` for the gradient ``t``):

* ``T_v``: while the variance adapts (``s <= var_freeze_step + 1``), ``s``
  is a variance step when it is a multiple of the variance interval, which
  starts at 1 and doubles every ``var_update_scaler`` variance steps;
* ``T_u``: once the variance is frozen, ``s`` ends a round (a
  synchronisation) when it is a multiple of the local interval, which starts
  at 1 and doubles every ``local_step_scaler`` frozen steps up to
  ``local_step_clipper``; the other frozen steps are local steps.

References:
  Lu, Li, Zhang, Tang, Awan, He, "Maximizing Communication Efficiency for
  Large-scale Training via 0/1 Adam", ICLR 2023 (arXiv:2202.06009).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from compjax.accounting import CommunicationReport

SCHEDULES = ("compjax", "deepspeed")

#: What a step sends: the gradient all-reduced uncompressed (a variance step), one 1-bit
#: compressed round (gradients while the variance adapts, then momenta at a synchronisation),
#: or nothing but the step's 8-bit non-finite flag (a local step).
STEP_KINDS = ("variance", "compressed", "local")


def offset(schedule: str) -> int:
    """How many steps DeepSpeed's count is ahead: its first ``step()`` counts, sets up
    buffers and discards its gradient, so its step ``s`` is the gradient ``s - 1``.

    Raises:
      ValueError: ``schedule`` is not one of :data:`SCHEDULES`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return 1 if schedule == "deepspeed" else 0


class VarianceSchedule(NamedTuple):
    """``T_v`` as the construction fixes it: the last adaptive step, the variance steps per
    interval, and the schedule's :func:`offset`."""

    var_freeze_step: int
    var_update_scaler: int
    shift: int


class Phase(NamedTuple):
    """Where a step stands in ``T_v`` (traced, from the state's counters).

    Attributes:
      count: the schedule's count before the step (the state's ``count`` plus the offset).
      adaptive: the variance may still be updated.
      variance_step: the step updates the variance.
      restart: the first frozen step (the error buffers start afresh).
    """

    count: jax.Array
    adaptive: jax.Array
    variance_step: jax.Array
    restart: jax.Array


def phase(schedule: VarianceSchedule, state) -> Phase:
    """The :class:`Phase` of the step that ``state`` (with ``count`` and ``var_interval``) takes."""
    count = state.count + schedule.shift  # DeepSpeed's count is one ahead (see `offset`)
    adaptive = count <= schedule.var_freeze_step
    variance_step = adaptive & ((count + 1) % state.var_interval == 0)
    return Phase(count, adaptive, variance_step, count == schedule.var_freeze_step + 1)


def restarted(restart: jax.Array, errors: list, memories: list) -> tuple[list, list]:
    """The error buffers and server memories, zero on the first frozen step: they held the
    gradients' errors, and the frozen phase compresses momenta."""
    errors = [jnp.where(restart, 0.0, e) for e in errors]
    memories = [None if s is None else jnp.where(restart, 0.0, s) for s in memories]
    return errors, memories


def variance_counters(schedule: VarianceSchedule, state, variance_step: jax.Array) -> dict:
    """The state's ``var_interval`` and ``var_counter`` after the step: the interval doubles
    after ``var_update_scaler`` variance steps."""
    counter = state.var_counter + variance_step.astype(jnp.int32)
    doubled = counter == schedule.var_update_scaler
    return {
        "var_interval": jnp.where(doubled, 2 * state.var_interval, state.var_interval),
        "var_counter": jnp.where(doubled, 0, counter),
    }


def variance_steps(
    var_update_scaler: int, var_freeze_step: int, schedule: str = "compjax"
) -> list[int]:
    """The steps (from 1, one per gradient) on which the variance is updated: ``T_v``.

    ``"compjax"``: ``var_update_scaler`` steps at interval 1, then as many at
    interval 2 (the multiples of 2), 4, ..., up to ``var_freeze_step + 1``.
    ``"deepspeed"``: DeepSpeed's ``ZeroOneAdam`` fed the same gradients: the
    step ``t`` is a variance step when ``t + 1`` is a multiple of the
    interval, up to ``var_freeze_step`` (e.g. ``1, 2, 3, 5, 7, 11`` where
    compjax has ``1, 2, 4, 6, 8, 12``, at ``(2, 12)``).
    """
    shift = offset(schedule)
    steps, interval, counter = [], 1, 0
    for t in range(1, var_freeze_step + 2 - shift):
        if (t + shift) % interval == 0:
            steps.append(t)
            counter += 1
            if counter == var_update_scaler:
                counter, interval = 0, 2 * interval
    return steps


def step_kinds(
    num_steps: int,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 1,
    schedule: str = "compjax",
) -> list[str]:
    """What each of the first ``num_steps`` steps (from 1) sends, one of :data:`STEP_KINDS`.

    The steps of :func:`variance_steps` are ``"variance"``; the other steps
    before the freeze, and the frozen steps that end a round, are
    ``"compressed"``; the frozen steps inside a round are ``"local"``.  The
    local interval starts at 1 at the first frozen step and doubles after
    every ``local_step_scaler`` frozen steps, up to ``local_step_clipper``;
    a frozen step ends a round when the schedule's count (``t``, or ``t + 1``
    under ``"deepspeed"``) is a multiple of the interval in force.
    ``local_step_clipper = 1`` synchronises every step.
    """
    shift = offset(schedule)
    variance = set(variance_steps(var_update_scaler, var_freeze_step, schedule))
    kinds, interval, counter = [], 1, 0
    for t in range(1, num_steps + 1):
        s = t + shift
        if s <= var_freeze_step + 1:
            kinds.append("variance" if t in variance else "compressed")
            continue
        kinds.append("compressed" if s % interval == 0 else "local")
        counter += 1
        if counter == local_step_scaler:
            counter, interval = 0, min(local_step_clipper, 2 * interval)
    return kinds


def mean_bits_per_step(report: CommunicationReport, kinds: list[str]) -> float:
    """Bits leaving one worker per step, averaged over the steps of ``kinds``.

    ``report`` is :func:`compjax.communication` of the 0/1 Adam
    transformation: the messages of one compressed round, the step's 8-bit
    flag among them, as :func:`compjax.diloco`'s report is the messages of
    one synchronising step.  A ``"compressed"`` step sends all of them; a
    ``"local"`` step only the flag; a ``"variance"`` step the flag and the
    gradient all-reduced uncompressed, :attr:`CommunicationReport.dense_bits`.

    Raises:
      ValueError: ``kinds`` is empty or holds a kind not in :data:`STEP_KINDS`.
    """
    unknown = sorted(set(kinds) - set(STEP_KINDS))
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty list of {STEP_KINDS}, got {unknown or kinds}")
    flag = sum(bits for kind, bits in report.messages if kind == "flag")
    cost = {
        "variance": flag + report.dense_bits,
        "compressed": report.bits_per_worker,
        "local": flag,
    }
    return sum(cost[kind] for kind in kinds) / len(kinds)
