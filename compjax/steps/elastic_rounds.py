"""One round of :func:`compjax.elastic.train`: its rules, its merge and its record.

Pure functions the synchronizer (:mod:`compjax.steps.elastic_sync`) applies,
tested without Ray:

* **Quorum and grace** (:func:`grace_over`): a round merges once
  ``min_quorum`` islands have pushed for it and then either every live
  island has pushed or ``grace_s`` seconds have passed since the quorum
  (``grace_s=None``: adaptive, a quarter of the time the quorum took to
  arrive, at least :data:`MIN_GRACE_S`).
* **Token weights** (:func:`weight`): an island's contribution is weighted by
  the inner steps (tokens) it took since the parameters it started from.
* **Staleness** (:func:`weight`): a contribution computed from round ``b``'s
  parameters that arrives once round ``r > b`` is open is *late*, with
  staleness ``s = r - b``.  With ``s <= MAX_STALENESS`` it is merged into
  round ``r`` at weight ``tokens / (1 + s)``; staler ones are dropped.
* **The merge** (:func:`merge_and_step`): the contributions, stacked in
  island order and padded with zero-weight rows to a fixed count, merged by
  :mod:`compjax.merges` (``"mean"``, ``"median_norm_clip"``,
  ``"trimmed_mean"``), then one step of the outer optimizer from the merge
  as from a gradient: DiLoCo's outer step.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of
  Language Models", 2023 (the outer step).  Douillard et al., "Decoupled
  DiLoCo", 2026 (quorum, grace window, token weighting).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

#: A late contribution older than this many rounds is dropped.
MAX_STALENESS = 1
#: The least adaptive grace, in seconds.
MIN_GRACE_S = 0.5
#: Seconds allowed on top of ``timeout_s`` for an actor's first answer (its process starts,
#: imports JAX and compiles).
STARTUP_S = 120.0


class Round(NamedTuple):
    """What happened in one merged round.

    Attributes:
      round: the round (0-based); its merge made the parameters of round ``round + 1``.
      merged: the islands whose contributions for this round were merged, in order.
      late: the islands whose late contributions (from an earlier round's
        parameters) were merged into this round.
      dropped: the islands whose contributions arrived too stale and were dropped.
      refused: the islands whose contributions held a NaN or Inf and were refused.
      tokens: the inner steps behind each merged contribution (``merged`` then ``late``).
      wall_s: seconds from the start of the run to this merge.
      bits: the wire bits of every payload the synchronizer received for this round.
      evaluation: ``evaluate(params)`` after the merge, or ``None``.
    """

    round: int
    merged: tuple[int, ...]
    late: tuple[int, ...]
    dropped: tuple[int, ...]
    refused: tuple[int, ...]
    tokens: tuple[int, ...]
    wall_s: float
    bits: int
    evaluation: float | None = None

    @classmethod
    def from_json(cls, record: dict) -> Round:
        """The record from its ``_asdict()`` as JSON gives it back (lists for tuples)."""
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        return cls(**fields)


def grace_over(
    pushed: int, live: int, min_quorum: int, grace_s: float | None, waited_s: float, quorum_s: float
) -> bool:
    """Whether a round with ``pushed`` on-time contributions merges now.

    Args:
      pushed: islands that pushed for the round.
      live: islands the synchronizer counts as alive.
      min_quorum: the least number of contributions merged.
      grace_s: seconds to wait after the quorum for the rest; ``None``: adaptive.
      waited_s: seconds since the quorum was reached.
      quorum_s: seconds the quorum took to arrive after the round opened.

    Returns:
      True once the quorum is there and every live island pushed or the grace is over.
    """
    if pushed < min_quorum:
        return False
    if pushed >= live:
        return True
    grace = max(MIN_GRACE_S, quorum_s / 4) if grace_s is None else grace_s
    return waited_s >= grace


def weight(tokens: int, staleness: int) -> float | None:
    """A contribution's merge weight, or ``None`` when it is dropped as too stale.

    Args:
      tokens: the inner steps behind it.
      staleness: rounds between the parameters it started from and the open round.

    Returns:
      ``tokens / (1 + staleness)`` for ``staleness <= MAX_STALENESS``, else ``None``.
    """
    if staleness > MAX_STALENESS:
        return None
    return tokens / (1.0 + staleness)


def stacked(contributions: list[Any], weights: list[float], rows: int) -> tuple[Any, np.ndarray]:
    """The contributions stacked on a leading axis of ``rows``, zero-padded, and their weights.

    Padding rows carry weight 0, so every merge leaves them out and one
    compiled merge serves every count of contributions up to ``rows``.
    """
    if not contributions or len(contributions) > rows:
        raise ValueError(f"between 1 and {rows} contributions, got {len(contributions)}")
    pad = rows - len(contributions)

    def stack(*leaves):
        own = np.stack([np.asarray(a, np.float32) for a in leaves])
        return np.concatenate([own, np.zeros((pad, *own.shape[1:]), np.float32)])

    w = np.zeros(rows, np.float32)
    w[: len(weights)] = weights
    return jax.tree.map(stack, *contributions), w


@functools.partial(jax.jit, static_argnames=("merge_fn", "outer"))
def merge_and_step(
    theta: Any,
    outer_state: Any,
    stacked_deltas: Any,
    weights: jax.Array,
    merge_fn,
    outer: optax.GradientTransformation,
) -> tuple[Any, Any]:
    """One outer round: merge the stacked pseudo-gradients, step ``theta`` from the merge.

    Args:
      theta: the global parameters (float32).
      outer_state: the outer optimizer's state.
      stacked_deltas: the pseudo-gradients ``theta - theta_i``, stacked.
      weights: one weight per row (0 for padding).
      merge_fn: from :func:`compjax.merges.merger`.
      outer: the outer optimizer.

    Returns:
      ``(theta, outer_state)`` after the step.
    """
    merged = merge_fn(stacked_deltas, weights)
    merged = jax.tree.map(lambda m, t: m.astype(t.dtype), merged, theta)
    updates, outer_state = outer.update(merged, outer_state, theta)
    return optax.apply_updates(theta, updates), outer_state


def finite(tree: Any) -> bool:
    """Whether every entry of every leaf of ``tree`` is finite."""
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree.leaves(tree))


def as_float32(tree: Any) -> Any:
    """``tree`` with every leaf a float32 numpy array (the global parameters' dtype)."""
    return jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.float32)), tree)
