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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.collectives import AxisName
from compjax.compressor import Compressor
from compjax.compressors.dense import identity
from compjax.exchange import Exchange, as_exchange, compressed_mean
from compjax.transforms.base import (
    Leaves,
    ServerMemory,
    any_non_finite,
    cast_like,
    counted,
    guarded,
    init_key,
    state_zeros,
    step_keys,
)
from compjax.transforms.per_worker_params import check_params_dtype

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
    if compressor is None and error_feedback:
        raise ValueError("error_feedback=True needs a compressor: the exact mean loses nothing")
    comp = identity() if compressor is None else compressor
    keep_error = (not comp.unbiased) if error_feedback is None else bool(error_feedback)
    server = ServerMemory(comp, exchange)
    fill = state_zeros(None)
    offsets = sync_offsets(sync_every, fragments)

    def members(num_leaves: int) -> list[list[int]]:
        owner = fragment_of(num_leaves, fragments)
        return [[i for i in range(num_leaves) if owner[i] == p] for p in range(fragments)]

    def init_fn(params):
        check_params_dtype(params, "streaming_diloco")
        leaves = Leaves(params, flatten=False)
        theta = [a.astype(fill(a).dtype) for a in leaves.arrays]
        return StreamingDiLoCoState(
            count=jnp.zeros([], jnp.int32),
            key=init_key(seed),
            global_params=leaves.rebuild(theta),
            outer_state=tuple(outer.init([theta[i] for i in ids]) for ids in members(len(theta))),
            inner_state=jax.tree.map(lambda x: jnp.asarray(x)[None], inner.init(params)),
            error=leaves.worker_state(fill) if keep_error else (),
            server_error=server.init(leaves),
        )

    def send(ids, keys, theta, outer_state, local, errors, memories):
        """One fragment's exchange and outer step: its new theta, outer state and memories."""
        means, errors, memories = [], list(errors), list(memories)
        for j, i in enumerate(ids):
            p = theta[j] - local[j].astype(theta[j].dtype)
            if keep_error:
                p = p + errors[j]
            sent = compressed_mean(comp, keys[i], p, axis_name, exchange, memories[j])
            means.append(sent.mean)
            if keep_error:
                errors[j] = sent.residual(p)
            memories[j] = sent.memory
        outer_updates, outer_state = outer.update(means, outer_state, theta)
        return optax.apply_updates(theta, outer_updates), outer_state, errors, memories

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "streaming_diloco: update(grads, state, params) needs params, this "
                "worker's own params"
            )
        leaves = Leaves(updates, flatten=False)
        bad = any_non_finite(leaves.arrays, axis_name)
        n = len(leaves.arrays)
        inner_state = jax.tree.map(lambda x: x[0], state.inner_state)
        inner_updates, inner_state = inner.update(updates, inner_state, params)
        local = jax.tree.leaves(optax.apply_updates(params, inner_updates))
        own = jax.tree.leaves(params)
        # Updates in the wider of the inner update's and the params' dtypes (see diloco).
        inner_out = [
            u.astype(jnp.promote_types(u.dtype, p.dtype))
            for u, p in zip(jax.tree.leaves(inner_updates), own, strict=True)
        ]
        theta = list(jax.tree.leaves(state.global_params))
        none = [None] * n
        errors = leaves.read(state.error, "error", per_worker=True) if keep_error else none
        old_errors, memories = list(errors), server.read(leaves, state.server_error)
        errors, new_memories = list(errors), list(memories)
        key, keys = step_keys(state.key, n)
        count = state.count + 1
        outer_states = list(state.outer_state)
        out = list(inner_out)
        for p, ids in enumerate(members(n)):
            pick = lambda xs, ids=ids: [xs[i] for i in ids]  # noqa: E731

            # New closures at every trace: a cached branch would not log its messages again.
            def sending(th, os, lo, es, ms, ids=ids):
                return send(ids, keys, th, os, lo, es, ms)

            def waiting(th, os, lo, es, ms):
                return th, os, es, ms

            th, outer_states[p], es, ms = jax.lax.cond(
                count % sync_every == offsets[p],
                sending,
                waiting,
                pick(theta),
                outer_states[p],
                pick(local),
                pick(errors),
                pick(new_memories),
            )
            # delay steps after sending (count - delay >= 1: a first send happened)
            merging = ((count - delay) % sync_every == offsets[p]) & (count > delay)
            for j, i in enumerate(ids):
                theta[i], errors[i], new_memories[i] = th[j], es[j], ms[j]
                target = th[j] if mixing == 0 else mixing * local[i] + (1 - mixing) * th[j]
                moved = (target - own[i].astype(th[j].dtype)).astype(inner_out[i].dtype)
                out[i] = jnp.where(merging, moved, inner_out[i])
        new_state = StreamingDiLoCoState(
            count=count,
            key=key,
            global_params=leaves.rebuild(theta),
            outer_state=tuple(outer_states),
            inner_state=jax.tree.map(lambda x: x[None], inner_state),
            error=leaves.write(cast_like(errors, old_errors), per_worker=True)
            if keep_error
            else (),
            server_error=server.write(leaves, new_memories, memories),
        )
        out, new_state = guarded(bad, out, new_state, state)
        return leaves.rebuild(out), new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))
