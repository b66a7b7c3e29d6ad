"""DGC's step on each leaf: accumulate, select, exchange, mask.

Momentum correction and local clipping (:func:`accumulate`, :func:`clip`),
the dense all-reduce of small leaves (:func:`dense_leaf`), and the sparse
leaves' messages: DGC's own all-gather of indices and values
(:func:`sparse_leaf`) or :func:`compjax.exchange.compressed_mean` with a
top-k per shard (:func:`exchanged_leaf`), in the warm-up phase of the step
(:func:`exchange_sparse`).  The transformation, its state and its arguments
are :mod:`compjax.transforms.dgc`.

References:
  Lin et al., "Deep Gradient Compression", ICLR 2018, and the authors' public
  ``DGCSGDMemory`` (see :mod:`compjax.transforms.dgc`).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from compjax import axes, collectives, recording
from compjax.axes import AxisName
from compjax.compressor import safe_norm
from compjax.compressors.selection import (
    Selection,
    exact_select,
    num_selected,
    sample_layout,
    sampled_threshold_select,
)
from compjax.compressors.sparse import TopK, top_k
from compjax.exchange import Exchange, compressed_mean
from compjax.exchange.overflow import mean_without_overflow
from compjax.payload import Payload
from compjax.transforms.padded_sparse import gather


class Options(NamedTuple):
    """The validated, static arguments of :func:`dgc`."""

    axis_name: AxisName
    momentum: float
    nesterov: bool
    momentum_correction: bool
    clip_norm: float | None
    momentum_masking: bool
    ratios: tuple[float, ...]  # one per phase: the warm-up phases, then the final ratio
    steps_per_phase: int
    sampled_threshold: bool
    sample_ratio: float
    band: tuple[float, float]
    max_adaptation_iters: int
    min_size: int
    exchange: Exchange | None  # None: DGC's own all-gather of indices and values


def clip(g: jax.Array, opts: Options, n: int) -> jax.Array:
    """Local clipping: rescale ``g`` to norm at most ``clip_norm / sqrt(n)``."""
    if opts.clip_norm is None:
        return g
    limit = opts.clip_norm / math.sqrt(n)
    # Scaled by a power of two first: sum(g**2) overflows for entries beyond 1.8e19 (the
    # norm would be Inf and the gradient clipped to zero).
    norm = safe_norm(g.astype(jnp.float32))
    scale = jnp.where(norm > limit, limit / jnp.where(norm > 0, norm, 1.0), 1.0)
    return (g * scale).astype(g.dtype)


def accumulate(g, u, v, opts: Options):
    """``u <- m u + g, v <- v + u``; Nesterov ``u <- m (u + g), v <- v + u + g``; else ``v + g``."""
    if not opts.momentum_correction:
        return u, v + g
    m = opts.momentum
    if opts.nesterov:
        u = m * (u + g)
        return u, v + u + g
    u = m * u + g
    return u, v + u


def dense_leaf(g, u, opts: Options, n: int):
    """A small leaf: all of ``v = u`` (or ``u + g``, or ``g``) is all-reduced; ``u`` is kept.

    Momentum is linear, so the mean of the workers' momenta is the momentum of
    the mean gradient: this is exactly dense momentum SGD.  Nothing is
    dropped, so nothing is stale and ``u`` is not masked.
    """
    u, v = accumulate(g, u, jnp.zeros_like(g), opts)
    v = v.astype(g.dtype)  # sent in the gradient's dtype
    recording.record("dense", v, "all_reduce", opts.axis_name)
    if opts.axis_name is None:
        return v, u

    # Near the dtype's largest value the sum overflows though the mean does not: resent
    # pre-scaled by a power of two on such steps (mean_without_overflow).
    def resum(scale):
        return collectives.psum(
            v if scale == 1.0 else v * jnp.asarray(scale, v.dtype), opts.axis_name
        )

    return mean_without_overflow(resum(1.0), resum, n)[0].astype(g.dtype), u


def select(v, k, step, opts: Options) -> Selection:
    if not opts.sampled_threshold:
        return exact_select(v, k)
    stride, _ = sample_layout(v.size, k, opts.sample_ratio)
    return sampled_threshold_select(
        v,
        k,
        offset=step % stride,
        sample_ratio=opts.sample_ratio,
        band=opts.band,
        max_adaptation_iters=opts.max_adaptation_iters,
    )


def sparse_leaf(v, u, ratio, step, opts: Options, n: int, wire_dtype):
    """Send the selected entries of ``v``; the mean of every worker's message; masked ``u, v``.

    The values travel in ``wire_dtype`` (the gradient's); where ``v`` is kept
    in a wider dtype, the rounding of a sent entry stays in ``v`` (zero when
    the dtypes agree).
    """
    d = v.size
    flat = v.reshape(-1)
    sel = select(flat, num_selected(d, ratio), step, opts)
    picked = flat.at[sel.indices].get(mode="fill", fill_value=0)
    values = picked.astype(wire_dtype)
    payload = Payload(
        wire={"indices": sel.indices, "values": values}, side={}, meta=(v.shape, wire_dtype)
    )
    recording.record("payload", payload, "all_gather", opts.axis_name)
    wire = gather(payload, opts.axis_name).wire
    indices, sent = wire["indices"].reshape(-1), wire["values"].reshape(-1).astype(jnp.float32)

    def resum(scale):  # the sum of every worker's values, times scale (exact: a power of two)
        scaled = sent if scale == 1.0 else sent * scale
        return jnp.zeros((d,), jnp.float32).at[indices].add(scaled, mode="drop")

    mean = mean_without_overflow(resum(1.0), resum, n)[0].astype(wire_dtype).reshape(v.shape)
    residual = picked - values.astype(flat.dtype)
    v = flat.at[sel.indices].set(residual, mode="drop").reshape(v.shape)
    if u is not None and opts.momentum_masking:
        u = u.reshape(-1).at[sel.indices].set(0, mode="drop").reshape(u.shape)
    return mean, u, v


def shard_top_k(ratio: float, opts: Options) -> TopK:
    """The top-k of each shard on the other exchanges: the sampled threshold with DGC's
    band and sample where ``opts.sampled_threshold``, else the exact top-k."""
    if not opts.sampled_threshold:
        return top_k(ratio=ratio)
    return top_k(
        ratio=ratio,
        select="threshold",
        band=opts.band,
        sample_ratio=opts.sample_ratio,
        max_adaptation_iters=opts.max_adaptation_iters,
    )


def exchanged_leaf(v, u, memory, ratio, opts: Options, wire_dtype):
    """``v`` through :func:`compjax.exchange.compressed_mean` with a top-k per shard.

    ``local`` is this worker's part of the exchange (on a scatter-gather, its
    own first-stage message): ``v <- v - local`` clears exactly the entries it
    sent, and ``u`` is masked where ``local`` is non-zero.  ``v`` is sent in
    ``wire_dtype`` (the gradient's).
    """
    sent = compressed_mean(
        shard_top_k(ratio, opts),
        jax.random.key(0),
        v.astype(wire_dtype),
        opts.axis_name,
        opts.exchange,
        memory,
    )
    if u is not None and opts.momentum_masking:
        u = jnp.where(sent.local != 0, jnp.zeros_like(u), u)
    return sent.mean, u, v - sent.local, sent.memory


def exchange_sparse(vs, us, memories, step, opts: Options, n: int, wire_dtypes):
    """The sparse leaves' exchange, in the warm-up phase ``step`` is in.

    Every phase has its own static ``k`` (its own top-k ratio on the other
    exchanges), so each is a branch of ``lax.switch`` (all workers share
    ``step`` and take the same branch); the server memories pass through
    every branch.  Only the last (steady-state) branch records its messages:
    the communication report gives the steady-state message.

    Returns:
      ``(means, us, vs, memories)``, one list each.
    """

    def one(ratio, v, u, memory, wire_dtype):
        if opts.exchange is None:
            return (*sparse_leaf(v, u, ratio, step, opts, n, wire_dtype), memory)
        return exchanged_leaf(v, u, memory, ratio, opts, wire_dtype)

    def branch(ratio, record):
        def run(vs, us, memories):
            with contextlib.nullcontext() if record else recording.unrecorded():
                rows = zip(vs, us, memories, wire_dtypes, strict=True)
                outs = [one(ratio, *a) for a in rows]
            return tuple(list(t) for t in zip(*outs, strict=True)) if outs else ([],) * 4

        return run

    last = len(opts.ratios) - 1
    branches = [branch(r, i == last) for i, r in enumerate(opts.ratios)]
    if len(branches) == 1:
        return branches[0](vs, us, memories)
    phase = jnp.minimum(step // opts.steps_per_phase, last)
    return jax.lax.switch(phase, branches, vs, us, memories)


def step_leaves(arrays, us, vs, memories, step, opts: Options):
    """Every leaf's step: clip, then the small leaves' dense all-reduce and the sparse leaves'
    accumulation and :func:`exchange_sparse`.

    Args:
      arrays: this worker's gradients, one per leaf.
      us: the momenta ``u`` (``None`` entries without momentum correction).
      vs: the velocities ``v``.
      memories: the shard owners' memories (``None`` entries where none is kept).
      step: the shared step count.
      opts: the arguments of :func:`compjax.transforms.dgc.dgc`.

    Returns:
      ``(updates, us, vs, memories)``, one list each, in leaf order.
    """
    n = axes.num_workers(opts.axis_name)
    out, new_us, new_vs, new_ms = [None] * len(vs), list(us), list(vs), list(memories)
    sparse = []
    for i, g in enumerate(arrays):
        g = clip(g, opts, n)
        if g.size < opts.min_size:
            out[i], new_us[i] = dense_leaf(g, us[i], opts, n)
        else:
            sparse.append(i)
            new_us[i], new_vs[i] = accumulate(g, us[i], vs[i], opts)
    pick = lambda xs: [xs[i] for i in sparse]  # noqa: E731
    wire = [arrays[i].dtype for i in sparse]
    sent = exchange_sparse(pick(new_vs), pick(new_us), pick(memories), step, opts, n, wire)
    for j, i in enumerate(sparse):
        out[i], new_us[i], new_vs[i], new_ms[i] = (s[j] for s in sent)
    return out, new_us, new_vs, new_ms
