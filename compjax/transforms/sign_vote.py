"""signSGD and Signum with majority vote.

References:
  Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed
  Optimisation for Non-Convex Problems", ICML 2018 (Algorithms 1 and 3).
  Bernstein, Zhao, Azizzadenesheli, Anandkumar, "signSGD with Majority Vote
  is Communication Efficient and Fault Tolerant", ICLR 2019.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

from compjax.axes import AxisName
from compjax.collectives import sign_vote
from compjax.transforms.scaffold import Leaf, LeafStep, leafwise, scaffold

_VIA = ("all_gather", "psum", "scatter_gather")


class SignVoteState(NamedTuple):
    """State of :func:`sign_majority_vote`.

    Attributes:
      momentum: per-worker momentum (Signum), or ``None`` for signSGD.
    """

    momentum: Any = None
    PER_WORKER = ("momentum",)


def sign_majority_vote(
    axis_name: AxisName,
    momentum: float | None = None,
    *,
    via: str = "all_gather",
    flatten: bool = False,
    bucket_size: int | None = None,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """Each worker sends ``sign(g_i)`` (or the sign of its momentum); the update is the vote.

    The update is ``sign(sum_i sign(v_i))``: ``-1``, ``0`` (tie) or ``+1`` per
    entry; follow it with ``optax.sgd(lr)`` for signSGD.  With ``momentum =
    beta`` each worker keeps ``v_i <- beta v_i + (1 - beta) g_i`` (Signum).

    Non-finite input: if any worker's gradient has an Inf/NaN, the update is
    NaN on every worker (a vote would hide it) and the momenta are kept.

    Args:
      axis_name: the data-parallel axis.
      momentum: Signum's ``beta`` in ``[0, 1)``, or ``None`` (signSGD).
      via: ``"all_gather"``: signs bit-packed, 1 bit per entry, a zero votes
        +1; ``"psum"``: int8 signs summed, 8 bits per entry, zeros abstain;
        ``"scatter_gather"``: the all-gather's vote, tallied shard by shard
        (worker ``j`` counts shard ``j`` of every worker's packed signs and
        all-gathers the outcome, 1 bit per entry for odd ``n``, 2 bits for
        even ``n``); traffic ``(n - 1) / n (1 + w) d`` bits per worker
        instead of ``(n - 1) d``.
      flatten: treat the tree as one vector (changes nothing but the layout).
      bucket_size: compress the flattened tree in buckets of this many
        entries (one message and one scale per bucket) instead of leaf by
        leaf; ``None``: per leaf.
      state_dtype: dtype of Signum's momenta (see
        :mod:`compjax.transforms.base`): ``None`` keeps them in float32 for
        float32, bfloat16 and float16 params (float64 for float64 params
        under ``jax_enable_x64``, whose gradients must still be at most
        float32); the vote is returned in the gradient's dtype.

    Returns:
      An ``optax.GradientTransformation`` whose update is the vote, ``-1``, ``0``
      or ``+1`` per entry, in the gradient's dtype.

    Raises:
      ValueError: ``momentum`` outside ``[0, 1)``, an unknown ``via``, or an
        invalid ``bucket_size`` or ``state_dtype``.

    References:
      Bernstein et al., "signSGD with Majority Vote is Communication Efficient
      and Fault Tolerant", ICLR 2019.
    """
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1) or None, got {momentum!r}")
    if via not in _VIA:
        raise ValueError(f"via must be one of {_VIA}, got {via!r}")

    fields = () if momentum is None else ("momentum",)
    sc = scaffold(
        SignVoteState, axis_name, flatten, bucket_size, fields=fields, state_dtype=state_dtype
    )

    def step(leaf: Leaf) -> LeafStep:
        g = leaf.update
        if momentum is None:
            voted, new = g, ()
        else:
            (old,) = leaf.state
            voted = (momentum * old + (1.0 - momentum) * g).astype(old.dtype)
            new = (voted,)
        return LeafStep(sign_vote(voted, axis_name, via).astype(g.dtype), new)  # in g's dtype

    return leafwise(sc, step)
