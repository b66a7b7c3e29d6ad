"""DiLoCo: local steps on each worker's own params, a compressed outer step every ``H`` steps.

The per-worker layout of the parameters.  Between synchronisations each
worker trains its own copy of the params, so the params being optimised
(the ``params`` of ``update``) are *per worker*: outside the map they are
stacked on a leading worker axis of size ``n`` (:func:`compjax.worker_copies`), the
axis ``jax.vmap`` and ``jax.pmap`` map over and ``jax.shard_map`` splits
with ``P(axis_name)``.  Inside, a worker holds its own copy: the params'
shape under ``vmap`` and ``pmap``, and a leading axis of size 1 under
``shard_map`` (index it away before the loss, put it back on the result).
The optimizer state holds the rest:

* the global params ``theta`` (:attr:`DiLoCoState.global_params`) and the
  outer optimizer's state, the same on every worker (replicated, ``P()``;
  read them back with :func:`compjax.global_params` to evaluate or export);
* the inner optimizer's state, each worker's own (every leaf with a leading
  axis of size 1, like every per-worker field of compjax, ``P(axis_name)``),
  and the error memories of a biased compressor.

:func:`compjax.state_specs` gives the state's specs.  ``init`` takes the
replicated params (``in_specs=P()`` under ``shard_map``, the same params in
every lane under ``vmap``/``pmap``).

Memory per worker, for ``P`` parameters: the local params (``P``, their
dtype), the inner state (``2P`` for Adam), the global params (``P``,
float32), the outer state (``P`` for momentum),
and with error feedback the error memory (``P``, float32; another ``P`` for
a biased compressor over ``"scatter_gather"``): ``5P`` floats for inner
AdamW and outer Nesterov (``6P`` with a biased compressor), against ``3P``
for data-parallel AdamW.

References:
  Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
  "DiLoCo: Distributed Low-Communication Training of Language Models",
  arXiv 2311.08105, 2023 (Algorithm 1).
  Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019.
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017 (FedAvg).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax import merges
from compjax.axes import AxisName
from compjax.compressor import Compressor
from compjax.exchange import Exchange, as_exchange, compressed_mean
from compjax.transforms.base import ServerMemory, counted
from compjax.transforms.outer import (
    CompressedMean,
    EveryH,
    GatheredMerge,
    check_positive,
    error_memory,
)
from compjax.transforms.streaming_diloco import StreamingDiLoCoState
from compjax.transforms.zero_one_adam_local import ZeroOneAdamLocalState


class DiLoCoState(NamedTuple):
    """State of :func:`compjax.diloco`.

    Attributes:
      count: inner steps taken (int32), shared; a round ends after every
        ``sync_every``-th.
      key: shared PRNG key (raw uint32) of the compressor.
      global_params: the global params ``theta``, shared, in float32 (the
        params are float32, bfloat16 or float16; float64 is refused at
        ``init``).
      outer_state: the outer optimizer's state, shared.
      inner_state: each worker's inner optimizer state, every leaf with a
        leading axis of size 1.
      error: per-worker error memory of the pseudo-gradient (leading axis of
        size 1 per worker), or an empty tuple without error feedback.
      server_error: the shard owners' memories (a biased compressor over
        ``"scatter_gather"``, see :mod:`compjax.exchange`), else an empty tuple.
    """

    count: jax.Array
    key: jax.Array
    global_params: Any
    outer_state: Any
    inner_state: Any
    error: Any = ()
    server_error: Any = ()
    PER_WORKER = ("inner_state", "error", "server_error")


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    axis_name: AxisName,
    compressor: Compressor | None = None,
    exchange: str | Exchange = "all_gather",
    error_feedback: bool | None = None,
    *,
    error_decay: float = 1.0,
    seed: int = 0,
    merge: str = "mean",
    trim: float = 0.1,
) -> optax.GradientTransformation:
    """DiLoCo (Algorithm 1 of Douillard et al.) over per-worker params.

    Every step is one ``inner`` step on each worker's own params.  The step
    that ends a round (every ``sync_every``-th) then synchronises: each
    worker's pseudo-gradient ``Delta_i = theta - theta_i`` (``theta_i`` its
    params after this step's inner update) is compressed, exchanged and
    averaged, ``outer`` updates ``theta`` from the mean as from a gradient,
    and the update returned moves every worker to the new ``theta``:
    ``optax.apply_updates(params, updates)`` equals it up to the float32
    rounding of the additive update ``params + (theta - params)``: exactly
    where ``params`` is within a factor 2 of ``theta`` (Sterbenz), otherwise
    within half an ulp of ``theta - params`` plus half an ulp of ``theta``
    (for float32 params; in the params' dtype for narrower ones).  The state
    keeps ``theta`` itself, and the next pseudo-gradient is taken from it, so
    the rounding never accumulates.  The inner state persists across rounds.

    ``outer=optax.sgd(1.0)`` with the exact mean is local SGD / FedAvg
    (``theta`` becomes the mean of the workers' params); the paper's outer
    step is ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` with inner
    AdamW.  A biased compressor keeps an error memory per worker (error
    feedback, Karimireddy et al. 2019): ``p_i = Delta_i + e_i`` is sent as
    ``C(p_i)`` and ``e_i <- p_i - C(p_i)``, so what was sent plus the new
    memory equals the pseudo-gradient plus the old memory.  With
    ``error_decay = beta < 1`` the memory decays first, ``p_i = Delta_i +
    beta e_i`` (SparseLoCo's accumulator, :func:`compjax.sparseloco`).  Pseudo-gradients
    travel in the state's dtype (float32); the updates returned are in the
    wider of the inner update's and the params' dtypes.

    Communication: the payloads travel only on the round's last step
    (``lax.cond``); every step, as every compjax transformation, reduces one
    8-bit non-finite flag.  :func:`compjax.communication` counts a round's
    messages, which happen once every ``sync_every`` steps.

    Non-finite input: if any worker's gradient holds an Inf or NaN, or the
    step would leave a non-finite value in the updates or the state, every
    worker gets NaN updates and the whole state is kept (the round does not
    advance), so the global params, the outer state and the memories are
    never poisoned.  To skip such a step, keep the params where the updates
    are not finite (every worker decides alike; :func:`compjax.local_steps`
    does).  ``optax.apply_if_finite`` around it does not: it tests each
    worker's own gradient, so the workers whose gradients are finite would
    apply the NaN updates.

    Args:
      inner: the inner optimizer (any optax transformation; its state is
        per worker), e.g. ``optax.adamw(4e-4, weight_decay=0.1)``.
      outer: the outer optimizer, applied to the global params with the
        averaged pseudo-gradient as gradient.
      sync_every: ``H``, the inner steps of a round (``1`` synchronises every
        step).
      axis_name: the workers' axis (a name or a tuple of names).
      compressor: any compjax compressor for the pseudo-gradients; ``None``
        sends them exactly (the identity, a ``psum``).
      exchange: how messages travel (:mod:`compjax.exchange`).
      error_feedback: keep an error memory per worker; ``None``: exactly for
        a biased compressor.
      error_decay: ``beta`` in ``[0, 1]``, the factor on the error memory
        before it is added to the next pseudo-gradient (1: plain error
        feedback).
      seed: seed of the shared key (random compressors).
      merge: ``"mean"``; or, robust to a few wrong or malicious workers,
        ``"median_norm_clip"`` (each worker's whole message, all leaves
        together, scaled down to the median of the messages' norms, then the
        mean: :func:`compjax.merges.median_norm_clip`, ``per_leaf=False``)
        or ``"trimmed_mean"`` (:func:`compjax.merges.trimmed_mean`,
        coordinate-wise).  These gather every worker's message
        (``exchange="all_gather"`` only) and merge what each decodes; a
        worker whose pseudo-gradient is not finite (an inner step that
        overflowed on finite gradients) is left out of them, while a
        non-finite gradient still refuses the step for every worker.
      trim: the trimmed mean's fraction, in ``[0, 0.5)``.

    Returns:
      An ``optax.GradientTransformation`` whose ``update(grads, state,
      params)`` needs ``params``, this worker's own params.

    Raises:
      ValueError: ``sync_every`` is not a positive integer, ``exchange`` is
        unknown, ``error_feedback=True`` without a compressor, or
        ``error_decay`` outside ``[0, 1]`` or below 1 without an error
        memory, ``merge`` unknown, ``trim`` outside ``[0, 0.5)``, or a robust
        ``merge`` with another ``exchange`` than ``"all_gather"``; at
        ``init``, float64 params (``jax_enable_x64``: cast them to float32
        first); at ``update``, ``params`` missing.

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", arXiv 2311.08105, 2023.
    """
    check_positive("sync_every", sync_every)
    as_exchange(exchange)
    comp, keep_error = error_memory(compressor, error_feedback)
    if not 0.0 <= error_decay <= 1.0 or (error_decay < 1.0 and not keep_error):
        raise ValueError(
            f"error_decay must be in [0, 1] and below 1 only with an error memory, "
            f"got {error_decay!r} (error memory: {keep_error})"
        )
    send = _send(comp, axis_name, exchange, keep_error, merge, trim)
    rounds = EveryH(
        DiLoCoState, "diloco", inner, outer, sync_every, axis_name,
        send=send,
        keep_error=keep_error, error_decay=error_decay, server=ServerMemory(comp, exchange),
        seed=seed,
    )  # fmt: skip
    return optax.GradientTransformation(rounds.init, counted(rounds.update))


def _send(comp, axis_name, exchange, keep_error: bool, merge: str, trim: float):
    """The round's exchange: each leaf's compressed mean, or a robust merge of every worker's
    whole gathered pseudo-gradient (:class:`~compjax.transforms.outer.GatheredMerge`).

    Raises:
      ValueError: ``merge`` unknown, ``trim`` outside ``[0, 0.5)``, or a robust ``merge``
        with an ``exchange`` other than ``"all_gather"``.
    """
    merges.merger(merge, trim)  # the names and the fraction checked
    if merge == "mean":
        return CompressedMean(compressed_mean, comp, axis_name, exchange, keep_error)
    if as_exchange(exchange).kind != "all_gather" or as_exchange(exchange).fast_axis is not None:
        raise ValueError(
            f"exchange must be 'all_gather' with merge={merge!r} (every worker's message "
            f"is merged), got {exchange!r}"
        )
    if merge == "median_norm_clip":
        merge_fn = functools.partial(merges.median_norm_clip, per_leaf=False)
    else:
        merge_fn = functools.partial(merges.trimmed_mean, trim=trim)
    return GatheredMerge(comp, axis_name, merge_fn, keep_error)


def worker_copies(params: Any, num_workers: int) -> Any:
    """``num_workers`` copies of replicated ``params``, stacked on a leading worker axis.

    The per-worker params of :func:`compjax.diloco`: map over the leading axis with
    ``jax.vmap``/``jax.pmap``, or split it with ``P(axis_name)`` under
    ``jax.shard_map`` (each worker then sees a leading axis of size 1).

    Args:
      params: the replicated params (a pytree of arrays).
      num_workers: ``n``, the number of workers.

    Returns:
      ``params`` with every leaf broadcast to shape ``(n, *leaf.shape)``.

    Raises:
      ValueError: ``num_workers`` is not a positive integer.
    """
    check_positive("num_workers", num_workers)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_workers, *jnp.shape(x))), params)


def global_params(opt_state: Any, stacked: bool = False) -> Any:
    """The global params ``theta`` of the :func:`compjax.diloco` (or
    :func:`compjax.streaming_diloco`, or 0/1 Adam's local rounds) state inside ``opt_state``.

    After a round's last step they are the synchronised params every worker
    restarts from: evaluate or export these.  They are kept in float32,
    whatever the params' dtype (float32, bfloat16 or float16).

    Args:
      opt_state: an optimizer state holding one :class:`compjax.DiLoCoState`,
        :class:`compjax.StreamingDiLoCoState` or
        :class:`compjax.ZeroOneAdamLocalState` (alone, in ``optax.chain``,
        ``optax.apply_if_finite``, ...).
      stacked: the state comes from ``jax.vmap`` or ``jax.pmap``, which stack
        even the shared fields on the worker axis: return worker 0's (every
        worker's are the same).

    Returns:
      The global params, a pytree of the params' structure in float32
      (without the worker axis when ``stacked``).

    Raises:
      ValueError: ``opt_state`` holds no such state, or several.
    """
    kinds = (DiLoCoState, StreamingDiLoCoState, ZeroOneAdamLocalState)
    found = [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, kinds))
        if isinstance(node, kinds)
    ]
    if len(found) != 1:
        raise ValueError(
            f"opt_state holds {len(found)} DiLoCoState, StreamingDiLoCoState or "
            f"ZeroOneAdamLocalState where one is needed"
        )
    theta = found[0].global_params
    return jax.tree.map(lambda x: x[0], theta) if stacked else theta
