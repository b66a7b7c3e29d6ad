"""Robust merges: one message per worker, stacked on a leading axis, merged into one.

Every function takes ``stacked``, a pytree whose leaves all carry the same
leading worker axis of size ``n`` (worker ``i``'s message is
``jax.tree.map(lambda a: a[i], stacked)``), and optional ``weights`` of
shape ``(n,)`` (non-negative; ``None``: all ones), and returns one pytree of
the message's structure, each leaf in its own dtype (computed in float32, or
the leaf's dtype where wider).  They are pure JAX: they run eager, under
``jax.jit``, and batched under ``jax.vmap``.

* :func:`mean`: the weighted mean, ``sum_i w_i m_i / sum_i w_i``.
* :func:`median_norm_clip`: each message scaled down so that its norm is at
  most the median of the messages' norms, then the weighted mean.  The
  result's norm is at most that median, and whatever one worker sends the
  median lies within the range of the other workers' norms (``n >= 2``):
  one worker scaled by ``1e6`` cannot make the result larger than the
  largest honest message.
* :func:`merger`: one of the three by name (``compjax.diloco(..., merge=)``,
  ``compjax.elastic.train(..., merge=)``).
* :func:`trimmed_mean`: coordinate-wise, the weighted mean of what is left
  after ``trim`` of the total weight is cut from each end of the sorted
  values.  Each coordinate of the result lies between that coordinate's
  minimum and maximum over the workers; fewer than ``trim * n`` corrupted
  workers (equal weights) cannot move it outside the range of the honest
  workers' values.

Non-finite messages.  :func:`mean` is the plain mean: a worker whose message
holds an Inf or NaN makes the result non-finite.  The robust merges leave
such a worker out (its weight becomes 0, and it takes no part in the
median): the others are merged as if it had not sent.  With every worker
left out (or every weight 0) the result is NaN, which a finite guard
downstream (:mod:`compjax.guards`) catches.

References:
  Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates", ICML 2018 (coordinate-wise trimmed mean).
  Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM
  Pre-training with SparseLoCo", arXiv 2508.15706, 2025 (messages clipped to
  the median norm before the outer step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

MERGES = ("mean", "median_norm_clip", "trimmed_mean")


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _leaves(stacked) -> tuple[list[jax.Array], Any, int]:
    leaves, treedef = jax.tree.flatten(stacked)
    if not leaves:
        raise ValueError("stacked must hold at least one array")
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every leaf of stacked needs the same leading worker axis, got sizes {sizes}"
        )
    return [jnp.asarray(a) for a in leaves], treedef, sizes.pop()


def _weights(weights, n: int) -> jax.Array:
    if weights is None:
        return jnp.ones((n,), jnp.float32)
    w = jnp.asarray(weights)
    if w.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), one per worker, got {w.shape}")
    return w.astype(_compute_dtype(w.dtype))


def _per_worker(a: jax.Array, v: jax.Array) -> jax.Array:
    """``v`` of shape ``(n,)`` broadcast against ``a`` of shape ``(n, ...)``."""
    return v.reshape((-1,) + (1,) * (a.ndim - 1))


def _finite_workers(leaves: list[jax.Array]) -> jax.Array:
    ok = [jnp.all(jnp.isfinite(a.reshape(a.shape[0], -1)), axis=1) for a in leaves]
    return jnp.all(jnp.stack(ok), axis=0)


def _weighted_mean(leaves, w, treedef):
    total = jnp.sum(w)
    out = []
    for a in leaves:
        c = a.astype(_compute_dtype(a.dtype))
        wc = _per_worker(c, w.astype(c.dtype))
        s = jnp.sum(jnp.where(wc > 0, wc * c, 0.0), axis=0)
        out.append((s / total.astype(c.dtype)).astype(a.dtype))
    return jax.tree.unflatten(treedef, out)


def _norms(leaves: list[jax.Array]) -> jax.Array:
    """Per worker and leaf, the Euclidean norm (float32, scaled so it does not overflow):
    shape ``(leaves, n)``."""
    out = []
    for a in leaves:
        c = a.astype(_compute_dtype(a.dtype)).reshape(a.shape[0], -1)
        top = jnp.max(jnp.abs(c), axis=1, initial=0.0)
        safe = jnp.where((top > 0) & jnp.isfinite(top), top, 1.0)
        out.append(safe * jnp.sqrt(jnp.sum(jnp.square(c / safe[:, None]), axis=1)))
    return jnp.stack(out)


def _lower_median(values: jax.Array, keep: jax.Array) -> jax.Array:
    """The lower median of ``values[keep]`` along the last axis (``torch.median``'s): the
    ``(m - 1) // 2``-th smallest of the ``m`` kept values; NaN where none is kept."""
    big = jnp.where(keep, values, jnp.inf)
    ordered = jnp.sort(big, axis=-1)
    m = jnp.sum(keep, axis=-1)
    pick = jnp.take_along_axis(ordered, jnp.maximum(m - 1, 0)[..., None] // 2, axis=-1)[..., 0]
    return jnp.where(m > 0, pick, jnp.nan)


def mean(stacked: Any, weights: jax.typing.ArrayLike | None = None) -> Any:
    """The weighted mean over the leading worker axis: ``sum_i w_i m_i / sum_i w_i``.

    Args:
      stacked: a pytree of arrays with a leading worker axis of size ``n``.
      weights: ``(n,)`` non-negative weights, or ``None`` for the plain mean
        (equal to ``jnp.mean(leaf, axis=0)``).

    Returns:
      The merged pytree, each leaf in its dtype.  Not robust: a non-finite
      message makes the result non-finite (a worker of weight 0 is left out).

    Raises:
      ValueError: leaves without a common leading axis, or ``weights`` of
        another shape.
    """
    leaves, treedef, n = _leaves(stacked)
    return _weighted_mean(leaves, _weights(weights, n), treedef)


def clip_to_median_norm(
    stacked: Any, weights: jax.typing.ArrayLike | None = None, *, per_leaf: bool = False
) -> tuple[Any, jax.Array]:
    """Each worker's message scaled by ``min(1, median / norm_i)``: ``(clipped, kept)``.

    ``norm_i`` is the Euclidean norm of worker ``i``'s whole message (all
    leaves together), or with ``per_leaf=True`` of each leaf separately, each
    leaf clipped to its own median (SparseLoCo's reference clips each
    parameter tensor).  The median is the lower median (``torch.median``'s:
    of ``m`` norms the ``(m - 1) // 2``-th smallest) over the workers with a
    positive weight and a finite message; a message of norm 0 is kept as it is.

    Returns:
      ``clipped`` (the stacked messages, non-finite ones and those of weight 0
      set to zeros) and ``kept``, ``(n,)`` booleans: the workers that take part.
    """
    leaves, treedef, n = _leaves(stacked)
    w = _weights(weights, n)
    kept = (w > 0) & _finite_workers(leaves)
    norms = _norms(leaves)
    if not per_leaf:
        top = jnp.max(norms, axis=0, initial=0.0)
        safe = jnp.where((top > 0) & jnp.isfinite(top), top, 1.0)
        norms = (safe * jnp.sqrt(jnp.sum(jnp.square(norms / safe), axis=0)))[None]
    median = _lower_median(norms, kept[None])[:, None]
    factors = jnp.where(norms > median, median / jnp.where(norms > 0, norms, 1.0), 1.0)
    factors = jnp.broadcast_to(factors, (len(leaves), n))
    out = []
    for a, f in zip(leaves, factors, strict=True):
        c = a.astype(_compute_dtype(a.dtype))
        scaled = c * _per_worker(c, f.astype(c.dtype))
        out.append(jnp.where(_per_worker(c, kept), scaled, 0.0).astype(a.dtype))
    return jax.tree.unflatten(treedef, out), kept


def median_norm_clip(
    stacked: Any, weights: jax.typing.ArrayLike | None = None, *, per_leaf: bool = False
) -> Any:
    """The weighted mean of the messages after :func:`clip_to_median_norm`.

    Every clipped message has norm at most the median ``M`` of the norms, so
    the result's norm is at most ``M`` (a mean of vectors in a ball).

    Args:
      stacked: a pytree of arrays with a leading worker axis of size ``n``.
      weights: ``(n,)`` non-negative weights, or ``None``.
      per_leaf: clip each leaf to the median of that leaf's norms instead of
        each whole message to the median of the messages' norms.

    Returns:
      The merged pytree, each leaf in its dtype; workers with a non-finite
      message are left out; NaN where no worker is left.

    Raises:
      ValueError: as :func:`mean`.
    """
    _, treedef, n = _leaves(stacked)
    clipped, kept = clip_to_median_norm(stacked, weights, per_leaf=per_leaf)
    w = jnp.where(kept, _weights(weights, n), 0.0)
    return _weighted_mean(jax.tree.leaves(clipped), w, treedef)


def trimmed_mean(stacked: Any, trim: float, weights: jax.typing.ArrayLike | None = None) -> Any:
    """Coordinate-wise trimmed mean: cut ``trim`` of the total weight from each end.

    For each coordinate the workers' values are sorted; with cumulative
    weights ``C_j`` and total ``W``, value ``j`` keeps the weight
    ``|[C_{j-1}, C_j] ∩ [trim W, (1 - trim) W]|``, and the result is the
    weighted mean of the kept weights.  With equal weights and ``trim * n`` a
    whole number ``t`` this drops the ``t`` smallest and ``t`` largest
    values (``scipy.stats.trim_mean``); otherwise the values at the cut count
    in part.  ``trim = 0`` is the weighted mean.

    Args:
      stacked: a pytree of arrays with a leading worker axis of size ``n``.
      trim: the fraction of the weight cut from each end, in ``[0, 0.5)``.
      weights: ``(n,)`` non-negative weights, or ``None``.

    Returns:
      The merged pytree, each leaf in its dtype; workers with a non-finite
      message are left out (their whole message); NaN where no worker is left.

    Raises:
      ValueError: ``trim`` outside ``[0, 0.5)``, or as :func:`mean`.
    """
    if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be a fraction in [0, 0.5), got {trim!r}")
    leaves, treedef, n = _leaves(stacked)
    w = _weights(weights, n)
    w = jnp.where((w > 0) & _finite_workers(leaves), w, 0.0)
    total = jnp.sum(w)
    lo, hi = trim * total, (1.0 - trim) * total
    out = []
    for a in leaves:
        c = a.astype(_compute_dtype(a.dtype)).reshape(n, -1)
        c = jnp.where(_per_worker(c, w > 0), c, jnp.inf)  # left-out workers sort last
        order = jnp.argsort(c, axis=0)
        values = jnp.take_along_axis(c, order, axis=0)
        ws = w[order].astype(c.dtype)
        upper = jnp.cumsum(ws, axis=0)
        keep = jnp.clip(jnp.minimum(upper, hi) - jnp.maximum(upper - ws, lo), 0.0, None)
        keep = jnp.where(ws > 0, keep, 0.0)
        merged = jnp.sum(jnp.where(keep > 0, keep * values, 0.0), axis=0) / jnp.sum(keep, axis=0)
        out.append(merged.reshape(a.shape[1:]).astype(a.dtype))
    return jax.tree.unflatten(treedef, out)


def merger(merge: str, trim: float = 0.1) -> Callable[..., Any]:
    """The merge named ``merge`` as ``merge_fn(stacked, weights=None) -> merged``.

    ``"median_norm_clip"`` clips each leaf to the median of that leaf's norms
    (``per_leaf=True``: templar clips each parameter tensor); ``"trimmed_mean"``
    cuts ``trim`` of the weight from each end.

    Args:
      merge: one of :data:`MERGES`.
      trim: the trimmed mean's fraction, in ``[0, 0.5)`` (read only for it).

    Returns:
      The merge function.

    Raises:
      ValueError: ``merge`` unknown, or ``trim`` outside ``[0, 0.5)``.
    """
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if isinstance(trim, bool) or not isinstance(trim, (int, float)) or not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be a fraction in [0, 0.5), got {trim!r}")
    if merge == "mean":
        return mean
    if merge == "median_norm_clip":
        return functools.partial(median_norm_clip, per_leaf=True)
    return functools.partial(_trimmed_by_weights, trim=trim)


def _trimmed_by_weights(stacked: Any, weights: jax.typing.ArrayLike | None = None, *, trim: float):
    return trimmed_mean(stacked, trim, weights)
