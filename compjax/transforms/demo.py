"""DeMo: decoupled momentum, only its fast-moving DCT components exchanged.

Each worker ``i`` keeps its own momentum ``delta_i`` and never averages it
with the others.  Per leaf and step::

    delta_i <- decay delta_i + g_i
    c_i      = chunked DCT-II of delta_i               (compjax.dct, per h x w chunk)
    S_i      = the top-k |c_i| of every chunk           -> send (indices, values)
    delta_i <- delta_i - IDCT(c_i on S_i, zeros elsewhere)
    q        = IDCT(every worker's (S_j, c_j[S_j]) combined)   (all_gather)
    update   = sign(q)

and the optimizer step is ``p <- p (1 - lr wd) - lr sign(q)`` (signSGD with
decoupled weight decay).

Differences from the reference optimizer (``DeMo`` in the authors' code):

* It accumulates ``lr g`` into ``delta``; here ``g`` is accumulated and the
  learning rate applied after the sign.  With a constant learning rate the
  selected components, and the signs, are the same (the whole ``delta`` is
  scaled by ``lr``); under a schedule the reference weighs old gradients by
  their own step's learning rate and this does not.
* ``sign=False`` (not in the reference) returns the plain mean over all
  ``n`` workers of the decoded messages, ``IDCT(sum_j c_j[S_j]) / n``, an
  estimate of the mean fast momentum, for use with another scaling.

References:
  Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
  arXiv:2411.19870, 2024 (Algorithm 1; defaults of the reference code:
  ``compression_decay=0.999``, ``compression_topk=32``,
  ``compression_chunk=64``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax import axes, dct, recording
from compjax.axes import AxisName
from compjax.guards import saturated
from compjax.payload import Payload
from compjax.transforms.padded_sparse import gather
from compjax.transforms.scaffold import Leaf, LeafStep, leafwise, scaffold


class DeMoState(NamedTuple):
    """State of :func:`scale_by_demo`.

    Attributes:
      delta: per-worker momentum ``delta_i`` (what has not been sent), in the
        state dtype (float32 by default), each leaf's shape.
    """

    delta: Any
    PER_WORKER = ("delta",)


class _Plan(NamedTuple):
    """The static layout of one leaf: its matrix, its chunks and its message."""

    rows: int  # R
    cols: int  # C
    h: int
    w: int
    k: int  # coefficients sent per chunk

    @property
    def chunks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def index_dtype(self) -> np.dtype:
        """The narrowest unsigned integer holding an index within a chunk (``< h w``)."""
        last = self.h * self.w - 1
        for dtype in (np.uint8, np.uint16, np.uint32):
            if last <= np.iinfo(dtype).max:
                return np.dtype(dtype)
        raise ValueError(f"a chunk of {self.h} x {self.w} entries is too large to index")


def _plan(shape: tuple[int, ...], chunk: int, topk: int) -> _Plan:
    rows, cols = dct.matrix_shape(shape)
    h, w = dct.chunk_size(rows, chunk), dct.chunk_size(cols, chunk)
    return _Plan(rows, cols, h, w, min(topk, h * w))


def _exponent(blocks: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Per chunk, the least ``e >= 0`` with ``max |blocks| < 2**e``: a scale that only ever
    shrinks (chunks below 1 are left as they are, subnormals included)."""
    return jnp.maximum(jnp.frexp(jnp.max(jnp.abs(blocks), axis=axes, keepdims=True))[1], 0)


def _scaled(transform, blocks: jax.Array) -> jax.Array:
    """``transform`` (linear, per chunk) of ``blocks``, saturated instead of overflowing.

    Each chunk beyond 1 is scaled by a power of two to below 1 (exact),
    transformed and scaled back; a coefficient beyond the dtype's range
    saturates there.
    """
    e = _exponent(blocks, (-2, -1))
    return saturated(jnp.ldexp(transform(jnp.ldexp(blocks, -e)), e), blocks.dtype)


def _scatter(plan: _Plan, indices: jax.Array, values: jax.Array):
    """Sums and counts of ``values`` (``(..., chunks, k)``) at their chunk ``indices``.

    Returns:
      ``(sums, counts)``, each ``(R/h, C/w, h, w)`` in ``values``' dtype.
    """
    rows = jnp.broadcast_to(jnp.arange(plan.chunks)[:, None], indices.shape)
    at = (rows.reshape(-1), indices.reshape(-1).astype(jnp.int32))
    flat = jnp.zeros((plan.chunks, plan.h * plan.w), values.dtype)
    sums = flat.at[at].add(values.reshape(-1))
    counts = flat.at[at].add(1)
    shape = (plan.rows // plan.h, plan.cols // plan.w, plan.h, plan.w)
    return sums.reshape(shape), counts.reshape(shape)


def _leaf(g, delta, plan: _Plan, decay: float, sign: bool, axis_name: AxisName, n: int):
    """One leaf's step: ``(update, new delta)``."""
    delta = saturated(decay * delta + g.astype(delta.dtype), delta.dtype)
    blocks = dct.to_blocks(delta.reshape(plan.rows, plan.cols), plan.h, plan.w)
    coeffs = _scaled(dct.dct2, blocks).reshape(plan.chunks, plan.h * plan.w)
    _, idx = jax.lax.top_k(jnp.abs(coeffs), plan.k)
    values = saturated(jnp.take_along_axis(coeffs, idx, axis=-1), g.dtype).astype(g.dtype)
    payload = Payload(
        wire={"indices": idx.astype(plan.index_dtype), "values": values},
        side={},
        meta=(g.shape, g.dtype),
    )
    recording.record("payload", payload, "all_gather", axis_name)
    # What was sent leaves the momentum (as sent: a rounding stays in delta).
    mine, _ = _scatter(plan, idx, values.astype(delta.dtype))
    sent = dct.from_blocks(_scaled(dct.idct2, mine)).reshape(g.shape)
    delta = saturated(delta - sent, delta.dtype)

    wire = gather(payload, axis_name).wire
    vals = wire["values"].astype(jnp.float32)
    # One power of two per chunk (over every worker's values) keeps the sums finite.
    e = _exponent(vals, (0, 2))[0]  # (chunks, 1)
    sums, counts = _scatter(plan, wire["indices"], jnp.ldexp(vals, -e[None]))
    e = e.reshape(plan.rows // plan.h, plan.cols // plan.w, 1, 1)
    if sign:
        # The reference's scatter "mean": each coefficient averaged over its contributors.
        mean = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0)
        out = jnp.sign(dct.from_blocks(dct.idct2(mean)))
    else:
        out = saturated(dct.from_blocks(jnp.ldexp(dct.idct2(sums / n), e)), g.dtype)
    return out.reshape(g.shape).astype(g.dtype), delta


def _step(leaf: Leaf, chunk: int, topk: int, decay: float, sign: bool, axis_name: AxisName):
    """One worker's step on one leaf (a zero-size leaf sends nothing)."""
    g, (delta,) = leaf.update, leaf.state
    if g.size == 0:
        return LeafStep(g, (delta,))
    plan = _plan(g.shape, chunk, topk)
    out, delta = _leaf(g, delta, plan, decay, sign, axis_name, axes.num_workers(axis_name))
    return LeafStep(out, (delta,))


def _check(chunk, topk, decay) -> None:
    """Construction-time checks; ``decay`` may be an array (``optax.inject_hyperparams``)."""
    for name, value in (("chunk", chunk), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(
                f"{name} must be an integer >= 1 (static: under optax.inject_hyperparams list "
                f"it in static_args), got {value!r}"
            )
    number = isinstance(decay, int | float | np.floating) and not isinstance(decay, bool)
    if (number and not 0.0 <= decay < 1.0) or isinstance(decay, bool | str | None):
        raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")


def scale_by_demo(
    axis_name: AxisName,
    *,
    chunk: int = 64,
    topk: int = 32,
    decay: float = 0.999,
    sign: bool = True,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """DeMo's direction: the sign of the gathered fast DCT components of each worker's momentum.

    Per leaf, each worker folds its gradient into its own momentum
    ``delta_i <- decay delta_i + g_i``, takes the orthonormal DCT-II of every
    ``h x w`` chunk of it (:mod:`compjax.dct`: ``h``, ``w`` the largest
    divisors of the leaf's rows and columns not above ``chunk``), sends the
    ``k = min(topk, h w)`` coefficients of largest magnitude of every chunk,
    and removes what it sent from ``delta_i``.  Every worker's message is
    all-gathered and decoded; the update is the sign of the inverse DCT of
    the combination (follow it with ``optax.scale_by_learning_rate(lr)``, or
    use :func:`demo`).

    Layout: a leaf of shape ``(R, C)`` is a matrix; a vector of length ``d``
    is chunked 1-D (``(1, d)``: chunks of the largest divisor of ``d``); a
    scalar is one chunk of one entry; a leaf of more dimensions is the
    matrix ``(prod(shape[:-1]), shape[-1])`` (a conv kernel ``(kh, kw, in,
    out)`` as ``(kh kw in, out)``).  The reference code handles vectors and
    matrices only: it raises on a leaf of more than two dimensions and on a
    scalar (checked against it on identical inputs), so compjax's layouts of
    those two are its own extension, not the reference's behaviour.

    Message, per leaf and worker (``Payload(wire={"indices", "values"})``,
    all-gathered): ``chunks x k`` indices within their chunk, in the
    narrowest unsigned integer holding ``h w - 1`` (uint8 up to 16 x 16
    chunks, uint16 up to 256 x 256), and ``chunks x k`` values in the
    gradient's dtype (bf16 gradients send bf16 values; the rounding stays in
    ``delta``).  The default 64 x 64 chunks with ``topk=32`` send 32 x (16 +
    32) bits per 4096 float32 entries: 85 times fewer bits than the dense
    all-reduce of the same leaf.

    Decoding: with ``sign=True`` each coefficient is averaged over the
    workers that sent it (the reference's ``scatter_reduce(..., "mean",
    include_self=False)``), the chunks are inverse-transformed and the sign
    taken: exactly the reference's step.  (The sign of the contributors'
    mean is that of the sum coefficient by coefficient, but not after the
    inverse DCT mixes coefficients, so the mean is kept.)  With
    ``sign=False`` the update is the plain mean over all ``n`` workers of the
    decoded messages, ``IDCT(sum_i c_i) / n`` (not in the reference).

    Zero gradients give zero updates (``sign(0) = 0``) and leave ``delta``
    at zero.  Very large values saturate at their dtype's largest finite
    value instead of overflowing (each chunk is transformed scaled by a
    power of two).  Non-finite gradients on any worker give NaN updates
    everywhere and keep the whole state (see :mod:`compjax.transforms.base`).

    Args:
      axis_name: the data-parallel axis (a name, a tuple of names, or
        ``None`` for one worker).
      chunk: the chunk size aimed at along each dimension (reference: 64).
      topk: coefficients sent per chunk (reference: 32).
      decay: the momentum decay, in ``[0, 1)`` (reference: 0.999).
      sign: return the sign of the decoded components (the reference), or
        their plain mean over the workers.
      state_dtype: dtype of ``delta`` (see :mod:`compjax.transforms.base`):
        ``None`` keeps it in float32 for float32, bfloat16 and float16 params
        (float64 for float64 params under ``jax_enable_x64``, whose gradients
        must still be at most float32).

    Returns:
      An ``optax.GradientTransformation`` with :class:`DeMoState`.

    Raises:
      ValueError: ``chunk`` or ``topk`` not an integer >= 1, ``decay``
        outside ``[0, 1)``, or an invalid ``state_dtype`` (the message names
        it).

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
      arXiv:2411.19870, 2024.
    """
    _check(chunk, topk, decay)
    sc = scaffold(DeMoState, axis_name, state_dtype=state_dtype)
    return leafwise(
        sc,
        functools.partial(
            _step, chunk=chunk, topk=topk, decay=decay, sign=bool(sign), axis_name=axis_name
        ),
    )


def demo(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: AxisName,
    *,
    weight_decay: float = 0.0,
    chunk: int = 64,
    topk: int = 32,
    decay: float = 0.999,
    sign: bool = True,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    """DeMo with a learning rate: ``p <- p (1 - lr wd) - lr sign(decoded)``.

    Args:
      learning_rate: a float or an optax schedule.
      axis_name: the data-parallel axis.
      weight_decay: decoupled weight decay ``wd`` >= 0 (reference: 0).
      chunk, topk, decay, sign, state_dtype: see :func:`scale_by_demo`.

    Returns:
      ``optax.chain(scale_by_demo(...), optax.add_decayed_weights(wd)`` (when
      ``wd != 0``) ``, optax.scale_by_learning_rate(lr))``.

    Raises:
      ValueError: ``weight_decay < 0``, or as :func:`scale_by_demo`.

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
      arXiv:2411.19870, 2024.
    """
    if isinstance(weight_decay, int | float) and not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    parts = [
        scale_by_demo(
            axis_name, chunk=chunk, topk=topk, decay=decay, sign=sign, state_dtype=state_dtype
        )
    ]
    if not (isinstance(weight_decay, int | float) and weight_decay == 0.0):
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
