"""Variance-based gradient compression, and Strom's threshold method as its baseline.

Both delay what they cannot send: each worker accumulates its gradients
locally and sends only the coordinates that pass a test, as a sparse,
quantised message; what is not sent stays in the accumulator, so nothing is
ever lost (``sent + residual = accumulated``, exactly up to float rounding).

Wire format.  A sparse message has a variable length, but ``all_gather``
needs a static shape: every message is padded to a fixed number of *slots*
(``budget``).  Each slot holds an int32 index (``d``, one past the end, in an
unused slot, dropped when decoding) and a small code; the static accounting
(:func:`compjax.communication`, :func:`compjax.collectives.record`) counts the
padded message, and each state keeps an exact runtime counter of the *real*
bits (the used slots only) that :func:`real_bits_sent` reads.

References:
  Tsuzuku, Imachi, Akiba, "Variance-based Gradient Compression for Efficient
  Distributed Deep Learning", ICLR Workshop 2018 (arXiv:1802.06058).
  Strom, "Scalable distributed DNN training using commodity GPU cloud
  computing", Interspeech 2015.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import packing
from compjax.collectives import AxisName, all_gather, num_workers, record
from compjax.payload import Payload
from compjax.transforms.base import (
    Leaves,
    any_non_finite,
    cast_like,
    check_state_dtype,
    counted,
    guarded,
    state_zeros,
)

#: Bits of one index on the wire (int32).
INDEX_BITS = 32
#: Bits of one variance-based code: a sign bit and a 3-bit exponent offset.
CODE_BITS = 4
#: Bits of the per-message float32 scale of variance-based messages.
SCALE_BITS = 32
#: Real bits per coordinate sent: index and code (variance-based), index and sign (Strom).
VARIANCE_BASED_ENTRY_BITS = INDEX_BITS + CODE_BITS
STROM_ENTRY_BITS = INDEX_BITS + 1

_EXPONENTS = 8  # codes 0..7: magnitudes scale * 2**-k
_LEVELS = np.asarray([2.0**-k for k in range(_EXPONENTS)], np.float32)


class VarianceBasedState(NamedTuple):
    """State of :func:`variance_based`.

    Attributes:
      r: per-worker accumulated gradient (float32 by default, leading worker axis).
      v: per-worker accumulated variance estimate (float32 by default, leading
        worker axis).
      bits_sent: per-worker cumulative real bits sent, as uint32 words
        ``(low, high)`` (shape ``(1, 2)`` in each worker's view); read it with
        :func:`real_bits_sent`.
    """

    r: Any
    v: Any
    bits_sent: jax.Array
    PER_WORKER = ("r", "v", "bits_sent")


class StromState(NamedTuple):
    """State of :func:`strom_threshold`.

    Attributes:
      residual: per-worker residual ``r`` (float32 by default, leading worker axis).
      bits_sent: per-worker cumulative real bits sent, uint32 ``(low, high)``.
    """

    residual: Any
    bits_sent: jax.Array
    PER_WORKER = ("residual", "bits_sent")


# --- parameters --------------------------------------------------------------


def _check_real(name: str, value, ok: Callable[[float], bool], what: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite real with ``ok``.

    A traced value (a hyperparameter under ``optax.inject_hyperparams``) cannot
    be checked and passes.
    """
    if isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, bool | str) or np.ndim(value) != 0:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not (math.isfinite(x) and ok(x)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(
            f"budget must be an integer >= 1 (slots) or a float in (0, 1] (a fraction of "
            f"the entries), got {budget!r}"
        )
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ValueError(f"budget must be an integer >= 1 (slots), got {budget!r}")
    elif not 0.0 < budget <= 1.0:
        raise ValueError(
            f"budget must be a float in (0, 1] (a fraction of the entries) or an "
            f"integer >= 1 (slots), got {budget!r}"
        )


def budget_slots(budget: int | float, d: int) -> int:
    """Slots of a message for ``d`` entries.

    An integer ``budget`` is a number of slots (capped at ``d``); a float is a
    fraction: ``min(d, max(1, round(budget * d)))`` (the rule of ``top_k``).
    """
    if d == 0:
        return 0
    if isinstance(budget, numbers.Integral):
        return min(int(budget), d)
    return min(d, max(1, round(budget * d)))


# --- shared pieces -----------------------------------------------------------


def _counter() -> jax.Array:
    return jnp.zeros((1, 2), jnp.uint32)


def _add_bits(total: jax.Array, count: jax.Array, per_entry: int) -> jax.Array:
    """``total + count * per_entry`` on a 64-bit counter of two uint32 words, exactly.

    ``total`` is ``[low, high]``; ``count < 2**31`` and ``per_entry < 2**16``.
    """
    count = count.astype(jnp.uint32)
    per = jnp.uint32(per_entry)
    low_part = (count & jnp.uint32(0xFFFF)) * per  # < 2**32
    high_part = (count >> 16) * per  # < 2**31; stands for high_part * 2**16
    lo, hi = total[0], total[1]
    for add_lo, add_hi in (
        (low_part, jnp.uint32(0)),
        (high_part << 16, high_part >> 16),
    ):
        new_lo = lo + add_lo  # wraps modulo 2**32
        hi = hi + add_hi + (new_lo < lo).astype(jnp.uint32)
        lo = new_lo
    return jnp.stack([lo, hi])


def _select(score: jax.Array, eligible: jax.Array, slots: int):
    """The ``slots`` eligible entries of largest score (ties: lower index first).

    Returns the indices (distinct) and which of them are eligible: fewer than
    ``slots`` eligible entries leave the remaining slots unused.
    """
    _, idx = jax.lax.top_k(jnp.where(eligible, score, -jnp.inf), slots)
    return idx, eligible[idx]


def _gather(payload: Payload, axis_name: AxisName) -> Payload:
    if axis_name is None:
        return jax.tree.map(lambda x: x[None], payload)
    return all_gather(payload, axis_name)


def _scatter_mean(indices: jax.Array, values: jax.Array, d: int, n: int) -> jax.Array:
    """Mean over the ``n`` workers of their decoded sparse messages (index ``d`` dropped)."""
    dense = jnp.zeros((d,), jnp.float32)
    dense = dense.at[indices.reshape(-1)].add(values.reshape(-1), mode="drop")
    return dense / n


# --- variance-based compression ----------------------------------------------


def _vb_values(neg: jax.Array, exps: jax.Array, scale: jax.Array) -> jax.Array:
    """``(-1)**neg * scale * 2**-exps`` (exact: a power-of-two multiple of ``scale``)."""
    sign = jnp.where(neg, jnp.float32(-1.0), jnp.float32(1.0))
    return sign * scale * jnp.asarray(_LEVELS)[exps]


def _vb_encode(r: jax.Array, v: jax.Array, alpha, slots: int):
    """Choose, quantise and encode what one worker sends of one leaf.

    Returns ``(payload, idx, q, send)``: the slots' coordinates (distinct),
    their decoded values (0 where nothing is sent) and which slots are used.
    """
    d = r.shape[0]
    r2 = r * r
    qualify = r2 > alpha * v
    positive = v > 0
    score = jnp.where(positive, r2 / jnp.where(positive, v, 1.0), jnp.inf)
    idx, chosen = _select(score, qualify, slots)
    picked = r[idx]
    mag = jnp.abs(picked)
    scale = jnp.max(jnp.where(chosen, mag, 0.0))
    # Round |r| to the nearest of scale * 2**-k, k = 0..7 (ties upwards); a value
    # nearer to 0 than to scale * 2**-7 is not sent this step.
    send = chosen & (mag >= scale * jnp.float32(2.0**-8))
    thresholds = (scale * jnp.float32(0.75)) * jnp.asarray(_LEVELS[:-1])
    exps = jnp.sum(mag[:, None] < thresholds[None, :], axis=1).astype(jnp.int32)
    neg = picked < 0
    q = jnp.where(send, _vb_values(neg, exps, scale), 0.0)
    codes = jnp.where(send, neg.astype(jnp.uint32) * 8 + exps.astype(jnp.uint32), 0)
    payload = Payload(
        wire={
            "indices": jnp.where(send, idx, d).astype(jnp.int32),
            "codes": packing.pack(codes.astype(jnp.uint32), CODE_BITS),
            "scale": scale.astype(jnp.float32),
        },
        side={},
        meta=((d,), np.dtype(np.float32)),
    )
    return payload, idx, q, send


def _vb_decode(wire, slots: int):
    codes = packing.unpack(wire["codes"], CODE_BITS, slots)
    exps = (codes & 7).astype(jnp.int32)
    neg = (codes >> 3) == 1
    return wire["indices"], _vb_values(neg, exps, wire["scale"])


def per_example_grads(loss_fn: Callable, params: Any, *batch: Any) -> Any:
    """Per-example gradients: ``jax.vmap(jax.grad(loss_fn))`` over the batch.

    Each example is given to ``loss_fn`` as a batch of one (a leading axis of
    size 1 is added), so a ``loss_fn`` written for batches (``.mean()`` over
    its leading axis) gives each example's own gradient.  The result has the
    structure of ``params`` with a leading batch axis on every leaf: the input
    :func:`variance_based` expects (the convention of optax.contrib's
    per-example aggregators, e.g. ``differentially_private_aggregate``).

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``.
      params: the parameters.
      *batch: arrays (or pytrees of arrays) sharing a leading batch axis.

    Returns:
      The gradients, each leaf of shape ``(batch_size, *param.shape)``.
    """
    grad = jax.grad(loss_fn)

    def one(p, *example):
        return grad(p, *jax.tree.map(lambda x: jnp.asarray(x)[None], example))

    return jax.vmap(one, in_axes=(None, *([0] * len(batch))))(params, *batch)


def _batch_size(updates: Any) -> int:
    leaves = jax.tree.leaves(updates)
    sizes = {np.shape(g)[0] if np.ndim(g) else None for g in leaves}
    if None in sizes or len(sizes) > 1:
        shapes = [np.shape(g) for g in leaves]
        raise ValueError(
            "variance_based needs per-example gradients: every leaf with a leading batch axis "
            f"of the same size (see per_example_grads); got leaves of shapes {shapes}"
        )
    (size,) = sizes or {1}
    if size == 0:
        raise ValueError("variance_based needs at least one example: the batch axis is empty")
    return size


def variance_based(
    axis_name: AxisName,
    alpha: float = 2.0,
    zeta: float = 0.999,
    *,
    budget: int | float = 0.01,
    flatten: bool = False,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Variance-based gradient compression: send a coordinate once it is unambiguous.

    The input is **per-example gradients**: every leaf has a leading batch
    axis, ``(B, *param.shape)`` (build them with :func:`per_example_grads`);
    the update has the parameters' shapes.  Each worker ``i`` keeps, per
    coordinate, an accumulated gradient ``r`` and an accumulated variance
    estimate ``v`` (the algorithm of Tsuzuku et al.) and at each step, with
    ``g_1..g_B`` its per-example gradients::

        r <- r + (1/B) sum_b g_b             # the minibatch gradient
        v <- v + (1/B^2) sum_b g_b^2         # estimate of that gradient's variance
        send where r^2 > alpha * v           # "unambiguous"
        sent:      r <- r - Q(r),  v <- 0    # Q(r): the value sent
        not sent:  v <- zeta * v

    ``(1/B^2) sum_b g_b^2 = (1/B) mean_b g_b^2`` estimates the variance of the
    mean of ``B`` per-example gradients, ``sigma^2/B`` (uncentred: squares,
    not squared deviations), so ``r`` and ``v`` measure the same accumulated
    quantity: the test
    compares its squared value with its variance, independently of the batch
    size, and is invariant to rescaling the loss (``g -> c g`` multiplies both
    sides by ``c^2``).  ``v`` of a coordinate just sent restarts from 0, and
    the decay ``zeta`` lets old variance fade.  The quantisation error
    ``r - Q(r)`` stays in ``r`` (the paper's algorithm resets ``r`` to 0):
    nothing is lost, ``sum of updates + mean_i r_i = sum of mean gradients``.
    Such a residual starts with ``v = 0`` and is judged against the variance
    of the gradients that follow.

    Wire format (per leaf, or per tree with ``flatten``; ``K`` slots, see
    ``budget``): ``indices`` int32[K], ``codes`` 4-bit codes packed two per
    byte (uint8[ceil(K/2)], first code in the low nibble), ``scale`` one
    float32 ``M``, the largest ``|r|`` sent.  A code is ``8 * s + k``: sign bit
    ``s`` (1 = negative) and exponent offset ``k`` in 0..7, decoding to
    ``(-1)^s M 2^-k``; ``|r|`` is rounded to the nearest such magnitude (ties
    upwards), and a chosen coordinate with ``|r| < M 2^-8`` (nearer to 0) is
    not sent this step (it stays accumulated, as if it had not qualified).
    Unused slots hold index ``d`` (dropped) and code 0.

    Bits: the padded message is ``32 K + 8 ceil(K/2) + 32`` bits (what
    :func:`compjax.communication` reports, with the 8-bit non-finite flag);
    the real message of ``m`` sent coordinates is ``36 m`` bits, plus 32 for
    the scale when ``m > 0`` (separate int32 indices allow any ``d < 2^31``;
    packing index and code into one 32-bit word would need ``d < 2^28``).
    The state counts
    the real bits exactly (:func:`real_bits_sent`).

    Budget: when more than ``K`` coordinates qualify, the ``K`` largest by
    ``r^2 / v`` (``v = 0`` counting as infinite; ties to the lower index) are
    sent and the others stay accumulated.

    The update is the mean over workers of the decoded messages (all-gathered,
    scattered, divided by the number of workers), in the input's dtype; the
    accumulators are float32 (``state_dtype``).  Non-finite input on any
    worker gives a NaN update and keeps the whole state: ``r``, ``v`` and the
    bit counter (the step is void, as ``optax.apply_if_finite`` would make it).

    Args:
      axis_name: the data-parallel axis (``None``: a single worker).
      alpha: threshold ``alpha > 0`` of the test ``r^2 > alpha v`` (a public
        implementation uses 2).
      zeta: decay ``0 < zeta <= 1`` of ``v`` where nothing is sent (0.999).
      budget: slots per message: an integer ``>= 1`` (capped at ``d``), or a
        fraction in ``(0, 1]`` of the entries (``max(1, round(budget d))``).
      flatten: one message for the whole tree instead of one per leaf.
      state_dtype: dtype of the accumulators (see
        :mod:`compjax.transforms.base`): ``None`` keeps them in float32 (or
        the parameters' dtype where wider); messages are the same either way.

    Raises:
      ValueError: ``alpha``, ``zeta``, ``budget`` or ``state_dtype`` invalid
        (at construction); updates without a common leading batch axis (at update).

    References:
      Tsuzuku, Imachi, Akiba, "Variance-based Gradient Compression for
      Efficient Distributed Deep Learning", ICLR Workshop 2018
      (arXiv:1802.06058).
    """
    _check_real("alpha", alpha, lambda x: x > 0, "a finite number > 0")
    _check_real("zeta", zeta, lambda x: 0 < x <= 1, "in (0, 1]")
    _check_budget(budget)
    zeros = state_zeros(check_state_dtype(state_dtype))

    def init_fn(params):
        leaves = Leaves(params, flatten)
        return VarianceBasedState(
            r=leaves.worker_state(zeros),
            v=leaves.worker_state(zeros),
            bits_sent=_counter(),
        )

    def update_fn(updates, state, params=None):
        size = _batch_size(updates)
        bad = any_non_finite(jax.tree.leaves(updates), axis_name)
        means = jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), axis=0), updates)
        squares = jax.tree.map(
            lambda g: jnp.mean(jnp.square(g.astype(jnp.float32)), axis=0) / size, updates
        )
        leaves = Leaves(means, flatten)
        sq = Leaves(squares, flatten).arrays
        rs = leaves.read(state.r, "r", per_worker=True)
        vs = leaves.read(state.v, "v", per_worker=True)
        n = num_workers(axis_name)
        counter = state.bits_sent[0]
        out, new_r, new_v = [], [], []
        for m, s, r, v in zip(leaves.arrays, sq, rs, vs, strict=True):
            shape, d = m.shape, m.size
            slots = budget_slots(budget, d)
            if slots == 0:
                out.append(jnp.zeros(shape, jnp.float32))
                new_r.append(r)
                new_v.append(v)
                continue
            r_acc = (r + m).reshape(-1)
            v_acc = (v + s).reshape(-1)
            payload, idx, q, send = _vb_encode(r_acc, v_acc, alpha, slots)
            record("payload", payload, "all_gather", axis_name)
            indices, values = jax.vmap(functools.partial(_vb_decode, slots=slots))(
                _gather(payload, axis_name).wire
            )
            out.append(_scatter_mean(indices, values, d, n).reshape(shape))
            sent = jnp.zeros((d,), bool).at[idx].set(send)
            new_r.append(r_acc.at[idx].add(-q).reshape(shape))
            new_v.append(jnp.where(sent, 0.0, zeta * v_acc).reshape(shape))
            n_sent = jnp.sum(send)
            counter = _add_bits(counter, n_sent, VARIANCE_BASED_ENTRY_BITS)
            counter = _add_bits(counter, n_sent > 0, SCALE_BITS)
        new_state = VarianceBasedState(
            r=leaves.write(cast_like(new_r, rs), per_worker=True),
            v=leaves.write(cast_like(new_v, vs), per_worker=True),
            bits_sent=counter[None],
        )
        out, new_state = guarded(bad, out, new_state, state)
        out = jax.tree.map(lambda o, g: o.astype(g.dtype), leaves.rebuild(out), updates)
        return out, new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))


# --- Strom's threshold method ------------------------------------------------


def strom_threshold(
    axis_name: AxisName,
    tau: float,
    *,
    budget: int | float = 0.01,
    flatten: bool = False,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Strom's threshold quantisation: send ``+-tau`` where the residual exceeds ``tau``.

    The input is ordinary gradients.  Each worker keeps a residual ``r``::

        r <- r + g
        send sign(r_j) * tau where |r_j| > tau,  r_j <- r_j - sign(r_j) * tau

    so ``sent + residual = accumulated`` (up to the rounding of one
    subtraction).  The update is the mean over workers of the sent values.

    Wire format (per leaf, or per tree with ``flatten``; ``K`` slots):
    ``indices`` int32[K] and ``signs`` one bit per slot packed 8 per byte
    (uint8[ceil(K/8)], 1 = negative); ``tau`` is known to every worker, so no
    scale is sent.  Unused slots hold index ``d`` (dropped) and sign 0.  Padded
    bits ``32 K + 8 ceil(K/8)``; real bits ``33`` per coordinate sent (for
    ``d < 2^31`` a 31-bit index and the sign could share one 32-bit word, as
    Strom describes; not done here).  When more than
    ``K`` coordinates exceed ``tau``, the ``K`` of largest ``|r|`` are sent
    (ties to the lower index) and the others stay in the residual.

    Non-finite input on any worker gives a NaN update and keeps the whole
    state (the residual and the bit counter).

    Args:
      axis_name: the data-parallel axis (``None``: a single worker).
      tau: threshold ``tau > 0``, also the magnitude sent.
      budget: slots per message: an integer ``>= 1`` (capped at ``d``), or a
        fraction in ``(0, 1]`` of the entries (``max(1, round(budget d))``).
      flatten: one message for the whole tree instead of one per leaf.
      state_dtype: dtype of the accumulators (see
        :mod:`compjax.transforms.base`): ``None`` keeps them in float32 (or
        the parameters' dtype where wider); messages are the same either way.

    Raises:
      ValueError: ``tau``, ``budget`` or ``state_dtype`` invalid.

    References:
      Strom, "Scalable distributed DNN training using commodity GPU cloud
      computing", Interspeech 2015.
    """
    _check_real("tau", tau, lambda x: x > 0, "a finite number > 0")
    _check_budget(budget)
    zeros = state_zeros(check_state_dtype(state_dtype))

    def init_fn(params):
        residual = Leaves(params, flatten).worker_state(zeros)
        return StromState(residual=residual, bits_sent=_counter())

    def update_fn(updates, state, params=None):
        leaves = Leaves(updates, flatten)
        bad = any_non_finite(leaves.arrays, axis_name)
        residuals = leaves.read(state.residual, "residual", per_worker=True)
        n = num_workers(axis_name)
        counter = state.bits_sent[0]
        out, new_res = [], []
        for g, r in zip(leaves.arrays, residuals, strict=True):
            shape, d = g.shape, g.size
            slots = budget_slots(budget, d)
            if slots == 0:
                out.append(jnp.zeros(shape, jnp.float32))
                new_res.append(r)
                continue
            acc = (r + g.astype(jnp.float32)).reshape(-1)
            mag = jnp.abs(acc)
            idx, send = _select(mag, mag > tau, slots)
            neg = acc[idx] < 0
            q = jnp.where(send, jnp.where(neg, -tau, tau), 0.0).astype(jnp.float32)
            payload = Payload(
                wire={
                    "indices": jnp.where(send, idx, d).astype(jnp.int32),
                    "signs": packing.pack((send & neg).astype(jnp.uint32), 1),
                },
                side={},
                meta=((d,), np.dtype(np.float32)),
            )
            record("payload", payload, "all_gather", axis_name)
            wire = _gather(payload, axis_name).wire
            signs = jax.vmap(functools.partial(packing.unpack, width=1, n=slots))(wire["signs"])
            values = jnp.where(signs == 1, jnp.float32(-tau), jnp.float32(tau))
            out.append(_scatter_mean(wire["indices"], values, d, n).reshape(shape))
            new_res.append(acc.at[idx].add(-q).reshape(shape))
            counter = _add_bits(counter, jnp.sum(send), STROM_ENTRY_BITS)
        new_state = StromState(
            residual=leaves.write(cast_like(new_res, residuals), per_worker=True),
            bits_sent=counter[None],
        )
        out, new_state = guarded(bad, out, new_state, state)
        out = [o.astype(g.dtype) for o, g in zip(out, leaves.arrays, strict=True)]
        return leaves.rebuild(out), new_state

    return optax.GradientTransformation(init_fn, counted(update_fn))


# --- accounting --------------------------------------------------------------


def _is_counted(node) -> bool:
    return isinstance(node, VarianceBasedState | StromState)


def real_bits_sent(state: Any) -> int:
    """Real (unpadded) bits sent so far, from the counters in an optimizer state.

    Sums the ``bits_sent`` counters of every :class:`VarianceBasedState` and
    :class:`StromState` in ``state`` (through chains and wrappers) over all
    workers present: a state gathered from ``shard_map`` (or stacked by
    ``vmap``/``pmap``) gives the total of all workers, one worker's state its
    own.  Call it outside ``jit`` (it reads the arrays); differences between
    steps give the bits of a step.

    Returns:
      The exact number of bits, a Python ``int``.
    """
    total = 0
    for node in jax.tree.leaves(state, is_leaf=_is_counted):
        if not _is_counted(node):
            continue
        words = np.asarray(node.bits_sent).reshape(-1, 2)
        total += sum(int(lo) + (int(hi) << 32) for lo, hi in words)
    return total
