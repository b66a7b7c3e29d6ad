"""The non-finite guard every compjax transformation runs its step under.

Non-finite input: if any worker's update holds an Inf or NaN (one 8-bit
flag per step is reduced with ``pmax``), the transformation returns an update
of NaNs on every worker and keeps its whole state (error memory, shifts, key)
unchanged.  Nothing is silently poisoned (top-k could otherwise drop the NaN
from the message while keeping it in the memory), and ``optax.apply_if_finite``
on the optimizer that follows (which sees the NaNs on every worker) then skips
the step cleanly; wrapped around the compjax transformation instead, it would
test each worker's own gradient and the workers could disagree.  The same
flag refuses a step whose finite input would leave a non-finite update or
state (float32 overflowing on gradients near its largest value, e.g. an
error memory ``x + e`` beyond ``3.4e38``).

Every transformation calls :func:`any_non_finite` on its input first and
returns through :func:`guarded`; :func:`saturated` caps accumulators of
squares so that finite input keeps them finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from compjax import numerics
from compjax.collectives import any_worker
from compjax.compressor import check_float32_range
from compjax.recording import record, unrecorded
from compjax.worker_local import check_worker_local


def saturated(x: jax.Array, dtype=None) -> jax.Array:
    """``x`` clipped to ``[-top, top]``, ``top`` the largest finite value of ``dtype``
    (``x``'s own by default); NaN stays NaN.

    Accumulators of squares (squares of finite entries above the square root of
    ``top`` overflow) and memories of sums stay finite this way: a saturated
    value only ever means "very large".
    """
    top = float(jnp.finfo(x.dtype if dtype is None else dtype).max)
    return jnp.clip(x, -top, top)


def all_finite(arrays: Sequence[Any]) -> jax.Array:
    """Whether every entry of ``arrays`` (arrays, or pytrees of them such as pieces) is finite.

    Pieces are checked through their whole sources (the leaves they are cut
    from), never sliced: the flag is one for the step, and every entry of a
    source belongs to some bucket.
    """
    leaves = jax.tree.leaves(list(arrays))
    return jnp.all(jnp.stack([numerics.all_finite(a) for a in leaves] or [jnp.bool_(True)]))


class Check(NamedTuple):
    """What :func:`any_non_finite` found, for :func:`guarded` to decide the step by.

    Attributes:
      local: whether this worker's input holds an Inf or NaN (not yet reduced).
      axis_name: the workers' axes, over which :func:`guarded` reduces.
    """

    local: jax.Array
    axis_name: Any


def any_non_finite(arrays: Sequence[jax.Array], axis_name) -> Check:
    """Whether this worker's ``arrays`` hold an Inf or NaN, for :func:`guarded`.

    Every transformation calls this first, so it also checks that ``arrays``
    are each worker's own (:func:`compjax.worker_local.check_worker_local`) and
    no wider than float32 (:func:`compjax.compressor.check_float32_range`).
    The step's one 8-bit flag is logged here (the first message of a round)
    and reduced over the workers in :func:`guarded`, once the step's updates
    and state are known.

    Raises:
      ValueError: a float64 leaf (``jax_enable_x64``), or a leaf already
        reduced over the workers.
    """
    for a in arrays:
        check_float32_range(a.dtype, "the updates")
    check_worker_local(jax.tree.leaves(list(arrays)), axis_name)
    local = ~all_finite(arrays)
    record("flag", local.astype(jnp.int8), "all_reduce", axis_name)
    return Check(local, axis_name)


def guarded(
    check: Check,
    out: list[jax.Array],
    new_state: Any,
    old_state: Any,
    finite: Sequence[jax.Array | None] | None = None,
    state_finite: jax.Array | None = None,
):
    """NaN updates and the old state if the step is refused; else the new ones.

    A step is refused (on every worker: one 8-bit ``pmax``) if any worker's
    input holds an Inf or NaN, or if finite input would leave a non-finite
    update or a non-finite value in the new state (float32 overflowing on
    the largest finite gradients): persistent state is never poisoned, and
    ``optax.apply_if_finite`` skips the step.

    ``finite``, one per ``out``: whether that update is finite where the
    exchange already knows it (:attr:`compjax.exchange.Exchanged.finite`), so
    it is not read again; ``None`` (or an entry ``None``): checked here.
    ``state_finite``: whether ``new_state`` is finite, where the transformation
    knows it without reading the whole state (a memory saturated by
    construction, its small leaves checked by the caller); ``None``: every
    floating leaf is checked here.  Nothing left to read, the flag depends on
    the input and small arrays only, and XLA fuses the selects into the loops
    that compute the update and the state.
    """
    known = [None] * len(out) if finite is None else list(finite)
    unknown = [o for o, f in zip(out, known, strict=True) if f is None]
    state = [] if state_finite is not None else jax.tree.leaves(new_state)
    floats = [a for a in jax.tree.leaves(unknown) + state if jnp.issubdtype(a.dtype, jnp.floating)]
    ok = all_finite(floats)
    if state_finite is not None:
        ok = ok & state_finite
    for f in known:
        ok = ok if f is None else ok & f
    with unrecorded():  # logged by any_non_finite
        bad = any_worker(check.local | ~ok, check.axis_name)
    # (A bucket's update may come in pieces, a list of arrays: each piece guarded.)
    out = [jax.tree.map(lambda a: jnp.where(bad, jnp.nan, a).astype(a.dtype), o) for o in out]
    return out, jax.tree.map(lambda n, o: jnp.where(bad, o, n), new_state, old_state)
