"""Streaming DiLoCo: DiLoCo with the params in fragments synchronised on staggered schedules.

The params' leaves are split, in tree order, into ``fragments`` consecutive
groups of nearly equal counts.  Fragment ``p`` synchronises on the steps
``t`` (counted from 1) with ``t mod H = t_p``, ``t_p = ((p + 1) H // F) mod H``
for ``F`` fragments, so the fragments' messages are spread over the round
(peak bandwidth ``1/F`` of DiLoCo's) and the last fragment keeps DiLoCo's
schedule.  Each fragment's outer step is DiLoCo's on its own leaves (its own
outer optimizer state); its result reaches the workers ``delay`` (``tau``)
inner steps after it was sent (the time the exchange may take, overlapped
with those steps), and is mixed with the workers' params as they are then:
``theta_i <- mixing theta_i + (1 - mixing) theta`` (``alpha``; ``0`` replaces
them, as DiLoCo).  One fragment, ``delay=0`` and ``mixing=0`` is
:func:`compjax.diloco`, bit for bit.

The layout of the params and the state is :func:`compjax.diloco`'s (see
:mod:`compjax.transforms.diloco`): per-worker params stacked on a leading
worker axis outside the map, shared global params and outer states, per
worker inner states and error memories; :func:`compjax.state_specs` gives
the specs.  The overlap is in the schedule: every exchange runs inside the
step that sends it, and its result is applied ``delay`` steps later.

References:
  Douillard, Donchev, Rush, Kale, Charles, Garrett, Ranzato, Szlam, et al.,
  "Streaming DiLoCo with overlapping communication: Towards a Distributed
  Free Lunch", arXiv 2501.18512, 2025.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, as_exchange, compressed_mean
from compjax.transforms.base import ServerMemory, counted
from compjax.transforms.outer import (
    CompressedMean,
    LocalSteps,
    error_memory,
    moved,
    outer_round,
)

if TYPE_CHECKING:
    from compjax.accounting import CommunicationReport


class StreamingDiLoCoState(NamedTuple):
    """State of :func:`compjax.streaming_diloco`.

    Attributes:
      count: inner steps taken (int32), shared.
      key: shared PRNG key (raw uint32) of the compressor.
      global_params: the global params ``theta``, shared, in float32 (the
        params are float32, bfloat16 or float16); a fragment's leaves hold the result of
        its latest outer step.
      outer_state: one outer optimizer state per fragment (a tuple), shared.
      inner_state: each worker's inner optimizer state, every leaf with a
        leading axis of size 1.
      error: per-worker error memory (leading axis of size 1 per worker), or
        an empty tuple without error feedback.
      server_error: the shard owners' memories (a biased compressor over
        ``"scatter_gather"``), else an empty tuple.
    """

    count: jax.Array
    key: jax.Array
    global_params: Any
    outer_state: Any
    inner_state: Any
    error: Any = ()
    server_error: Any = ()
    PER_WORKER = ("inner_state", "error", "server_error")


def fragment_of(num_leaves: int, fragments: int) -> list[int]:
    """The fragment of each leaf (in tree order): ``fragments`` consecutive groups.

    Raises:
      ValueError: fewer leaves than fragments.
    """
    if num_leaves < fragments:
        raise ValueError(
            f"streaming_diloco: {fragments} fragments need at least as many parameter "
            f"leaves, got {num_leaves}"
        )
    return [i * fragments // num_leaves for i in range(num_leaves)]


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """``t_p``: fragment ``p`` synchronises on the steps ``t`` with ``t mod H = t_p``."""
    return [((p + 1) * sync_every // fragments) % sync_every for p in range(fragments)]


def fragment_leaves(params: Any, fragments: int) -> list[list[Any]]:
    """Each fragment's leaves of ``params``, in tree order (fragment ``p`` at index ``p``).

    ``compjax.communication(compjax.diloco(inner, outer, sync_every,
    axis_name, compressor, exchange), fragment_leaves(params, F)[p], ...)``
    is what a step that sends fragment ``p`` sends: its messages and the
    8-bit flag (the outer step sends nothing; tested against the report of
    :func:`streaming_diloco`).

    Raises:
      ValueError: fewer leaves than fragments, or ``fragments`` < 1.
    """
    _check_int("fragments", fragments, 1)
    leaves = jax.tree.leaves(params)
    owner = fragment_of(len(leaves), fragments)
    return [[a for a, o in zip(leaves, owner, strict=True) if o == p] for p in range(fragments)]


def bits_per_step(reports: Sequence[CommunicationReport], sync_every: int) -> list[float]:
    """Bits leaving one worker on each step ``t = 1, ..., H`` of a round of Streaming DiLoCo.

    :func:`compjax.communication` of :func:`streaming_diloco` lists every
    fragment's messages once, with one flag: the messages of a whole round
    (``H`` steps), which no single step sends when ``F > 1``.  This splits
    them over the round: every step sends the 8-bit flag, and the steps with
    ``t mod H = t_p`` also send fragment ``p``'s messages (several
    fragments share a step only when ``F > H``).  ``max`` of the result is
    the peak a link must carry, its mean the bits per step averaged over a
    round (equal to ``(bits - flag) / H + flag`` of the whole report).

    Args:
      reports: one per fragment, in order: :func:`compjax.communication` of
        :func:`compjax.diloco` (the same compressor and exchange) on that
        fragment's leaves (:func:`fragment_leaves`); each includes the flag.
      sync_every: ``H``.

    Returns:
      ``H`` floats, the bits of the steps ``t = 1, ..., H`` (step ``H``
      ends a round of the last fragment).

    Raises:
      ValueError: ``reports`` empty, or ``sync_every`` not an integer >= 1.
    """
    _check_int("sync_every", sync_every, 1)
    if not reports:
        raise ValueError("reports must hold one report per fragment, got none")

    def flag(report):
        return sum(b for kind, b in report.messages if kind == "flag")

    steps = [float(flag(reports[0]))] * sync_every
    for report, t_p in zip(reports, sync_offsets(sync_every, len(reports)), strict=True):
        steps[(t_p - 1) % sync_every] += report.bits_per_worker - flag(report)
    return steps


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def streaming_diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    axis_name: AxisName,
    fragments: int = 1,
    delay: int = 0,
    mixing: float = 0.0,
    compressor: Compressor | None = None,
    exchange: str | Exchange = "all_gather",
    error_feedback: bool | None = None,
    *,
    seed: int = 0,
) -> optax.GradientTransformation:
    """Streaming DiLoCo (Douillard et al. 2025) over per-worker params.

    Every step is one ``inner`` step on each worker's own params.  On the
    steps of fragment ``p``'s schedule (see the module docstring) its
    pseudo-gradient ``theta_p - theta_{i,p}`` (after this step's inner
    update) is compressed, exchanged and averaged (with error feedback for a
    biased compressor, as :func:`compjax.diloco`), and the fragment's outer
    optimizer updates ``theta_p``.  ``delay`` steps later the update
    returned moves every worker's fragment to ``mixing theta_{i,p} + (1 -
    mixing) theta_p`` (their params after that step's inner update), up to
    the float32 rounding of the additive update.  Other steps return the
    inner update.

    Non-finite input (NaN updates on every worker and the whole state kept)
    and the memory per worker are :func:`compjax.diloco`'s.  Communication:
    each fragment's exchange runs only on its own steps (``lax.cond``), and
    every step reduces the 8-bit non-finite flag.
    :func:`compjax.communication` reports the flag and every fragment's
    messages once: the messages of a whole round of ``sync_every`` steps,
    the same as :func:`compjax.diloco`'s report, which with ``fragments >
    1`` no single step sends.  :func:`bits_per_step` splits it into the
    bits of each step of a round (its maximum the peak, its mean the
    average per step).

    Args:
      inner: the inner optimizer (per-worker state).
      outer: the outer optimizer; each fragment has its own state of it.
      sync_every: ``H``, the inner steps between two synchronisations of a
        fragment.
      axis_name: the workers' axis (a name or a tuple of names).
      fragments: ``F``, the number of fragments (at most the number of
        leaves).
      delay: ``tau``, inner steps between sending a fragment and merging its
        outer step (``0 <= delay < sync_every``).
      mixing: ``alpha`` in ``[0, 1]``, the weight of the workers' own params
        at the merge (``0``: replaced by the global params).
      compressor: any compjax compressor; ``None`` sends the exact mean.
      exchange: how messages travel (:mod:`compjax.exchange`).
      error_feedback: keep an error memory per worker; ``None``: exactly for
        a biased compressor.
      seed: seed of the shared key (random compressors).

    Returns:
      An ``optax.GradientTransformation`` whose ``update(grads, state,
      params)`` needs ``params``, this worker's own.

    Raises:
      ValueError: an argument out of range, ``error_feedback=True`` without
        a compressor; at ``init``, fewer leaves than fragments or float64
        params (``jax_enable_x64``: cast them to float32 first); at
        ``update``, ``params`` missing.

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication:
      Towards a Distributed Free Lunch", arXiv 2501.18512, 2025.
    """
    _check_int("sync_every", sync_every, 1)
    _check_int("fragments", fragments, 1)
    _check_int("delay", delay, 0)
    if delay >= sync_every:
        raise ValueError(
            f"delay must be below sync_every ({sync_every}): a fragment's outer step is "
            f"merged before its next synchronisation, got {delay}"
        )
    if not 0.0 <= float(mixing) <= 1.0:
        raise ValueError(f"mixing must be in [0, 1], got {mixing!r}")
    as_exchange(exchange)
    comp, keep_error = error_memory(compressor, error_feedback)
    streaming = _Streaming(
        StreamingDiLoCoState, "streaming_diloco", inner, outer, sync_every, axis_name,
        send=CompressedMean(compressed_mean, comp, axis_name, exchange, keep_error),
        keep_error=keep_error, server=ServerMemory(comp, exchange), seed=seed,
        fragments=fragments, delay=delay, mixing=mixing,
    )  # fmt: skip
    return optax.GradientTransformation(streaming.init, counted(streaming.update))


def _members(num_leaves: int, fragments: int) -> list[list[int]]:
    """The leaves' indices of each fragment."""
    owner = fragment_of(num_leaves, fragments)
    return [[i for i in range(num_leaves) if owner[i] == p] for p in range(fragments)]


@dataclasses.dataclass(frozen=True, eq=False)
class _Streaming(LocalSteps):
    """:func:`streaming_diloco`'s ``init`` and ``update``: :class:`LocalSteps` whose
    fragments synchronise on their own steps."""

    fragments: int
    delay: int
    mixing: float

    def outer_init(self, theta: Any) -> tuple:
        """One outer state per fragment, of its leaves of ``theta``."""
        leaves = jax.tree.leaves(theta)
        ids_of = _members(len(leaves), self.fragments)
        return tuple(self.outer.init([leaves[i] for i in ids]) for ids in ids_of)

    def update(self, updates: Any, state: StreamingDiLoCoState, params: Any = None) -> tuple:
        step = self.inner_step(updates, state, params)
        theta = list(jax.tree.leaves(state.global_params))
        old_errors, old_memories = self.memories(step, state)
        errors, memories = list(old_errors), list(old_memories)
        outer_states = list(state.outer_state)
        out = list(step.inner_out)
        offsets = sync_offsets(self.sync_every, self.fragments)
        count = step.count
        for p, ids in enumerate(_members(len(step.leaves.arrays), self.fragments)):
            th, outer_states[p], es, ms = self._fragment(
                step, ids, offsets[p], theta, outer_states[p], errors, memories
            )
            # delay steps after sending (count - delay >= 1: a first send happened)
            merging = ((count - self.delay) % self.sync_every == offsets[p]) & (count > self.delay)
            for j, i in enumerate(ids):
                theta[i], errors[i], memories[i] = th[j], es[j], ms[j]
                target = self._mixed(step.local[i], th[j])
                out[i] = jnp.where(merging, moved(target, step.params[i], out[i]), out[i])
        return self.finish(
            step, state, out, global_params=step.leaves.rebuild(theta),
            outer_state=tuple(outer_states), errors=errors, old_errors=old_errors,
            memories=memories, old_memories=old_memories,
        )  # fmt: skip

    def _mixed(self, local: jax.Array, theta: jax.Array) -> jax.Array:
        """``mixing local + (1 - mixing) theta`` (``theta`` when ``mixing`` is 0)."""
        return theta if self.mixing == 0 else self.mixing * local + (1 - self.mixing) * theta

    def _fragment(self, step, ids, offset, theta, outer_state, errors, memories) -> tuple:
        """Fragment ``ids``'s exchange and outer step on its steps (``lax.cond``), else its
        state as it was: its theta, outer state, error memories and shard owners' memories."""

        def pick(xs):
            return [xs[i] for i in ids]

        keys = pick(step.keys)

        # New closures at every trace: a cached branch would not log its messages again.
        def sending(th, os, lo, es, ms):
            return outer_round(self.outer, self.send, keys, th, os, lo, es, ms)

        def waiting(th, os, lo, es, ms):
            return th, os, es, ms

        return jax.lax.cond(
            step.count % self.sync_every == offset,
            sending,
            waiting,
            pick(theta),
            outer_state,
            pick(step.local),
            pick(errors),
            pick(memories),
        )
