"""dAD and rank-dAD: rebuild each Dense layer's pooled gradient from what sites exchange.

References:
  Baker, Khanal, Calhoun, Pearlmutter, Plis, "Peering Beyond the Gradient
  Veil with Distributed Auto Differentiation", arXiv:2102.09631, 2021.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from compjax.axes import AxisName, num_workers
from compjax.collectives import all_gather, pmax, psum
from compjax.compressor import Compressor
from compjax.dad.capture import Captured, Layer, LossFn, capture, discover, group_layers
from compjax.exchange import compressed_mean
from compjax.recording import record

_F32 = jnp.float32


def _gather(kind: str, x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Send ``x`` to every site; all sites' ``x`` stacked on a leading axis."""
    record(kind, x, "all_gather", axis_name)
    return x[None] if axis_name is None else all_gather(x, axis_name)


def _mean_others(
    got: Captured,
    axis_name: AxisName,
    n: int,
    compressor: Compressor | None,
    key: jax.Array | None,
) -> dict[int, jax.Array]:
    """The ordinary mean over sites of every gradient leaf that is not a Dense kernel or bias."""
    dense = {layer.kernel for layer in got.layers} | {layer.bias for layer in got.layers}
    others = [i for i in range(len(got.grads)) if i not in dense]
    if compressor is not None:
        keys = list(jax.random.split(key, len(others))) if key is not None else [None] * len(others)
        return {
            i: compressed_mean(compressor, k, got.grads[i], axis_name).mean
            for i, k in zip(others, keys, strict=True)
        }
    out = {}
    for i in others:
        g = got.grads[i].astype(_F32)
        record("dense", g, "all_reduce", axis_name)
        total = g if axis_name is None else psum(g, axis_name)
        out[i] = (total / n).astype(got.grads[i].dtype)
    return out


def _place(got: Captured, layer: Layer, kernel: jax.Array, bias: jax.Array | None, out: dict):
    """Put a rebuilt kernel (``in x out``) and bias (``out``) gradient in the leaves' shapes."""
    k = got.grads[layer.kernel]
    out[layer.kernel] = kernel.reshape(k.shape).astype(k.dtype)
    if layer.bias is not None:
        b = got.grads[layer.bias]
        out[layer.bias] = bias.reshape(b.shape).astype(b.dtype)


def _tree(params: Any, out: dict[int, jax.Array]) -> Any:
    treedef = jax.tree.structure(params)
    return jax.tree.unflatten(treedef, [out[i] for i in range(len(out))])


def dad_grads(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    axis_name: AxisName,
    *,
    has_aux: bool = False,
    compressor: Compressor | None = None,
    key: jax.Array | None = None,
) -> tuple[Any, Any]:
    """dAD: the exact pooled gradient, Dense layers rebuilt from all sites' ``A`` and ``Delta``.

    Call inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap(axis_name=...)``
    with this site's part of the batch.  For each Dense layer every site sends
    its inputs ``A_s`` (``rows x in``) and output cotangents ``Delta_s``
    (``rows x out``); each site forms ``(1/n) sum_s A_s^T Delta_s`` (the
    kernel) and ``(1/n) sum_s 1^T Delta_s`` (the bias).  Every other
    parameter (norms, embeddings, convolutions, Dense layers that are not
    captured) is averaged with an ordinary float32 all-reduce, or with
    ``compressor`` if given.

    The result is the mean over sites of the local gradients, identical on
    every site: with equal local batches and a ``loss_fn`` that is a mean over
    its batch, that is the gradient of the loss on all sites' data in one
    batch (the deltas of a mean loss already carry ``1/N_local``).  Use it
    with any optax optimizer: ``updates, state = opt.update(grads, state,
    params)``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (``(loss, aux)`` with
        ``has_aux``), applying a flax linen model with ``params``; a mean over
        the batch for the pooled-gradient reading above.
      params: the parameters (the variables ``{'params': ...}`` or the
        ``'params'`` collection), replicated on every site.
      batch: this site's batch (any pytree ``loss_fn`` accepts).
      axis_name: the sites' axis name (or tuple of names; ``None``: one site).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      compressor: optional compjax compressor for the non-Dense leaves.
      key: PRNG key shared by all sites, for a stochastic ``compressor``.

    Returns:
      ``(loss, grads)``: this site's local loss (``(loss, aux)`` with
      ``has_aux``; ``pmean`` it for logging) and the pooled gradient with
      ``params``' structure.

    Replicated params (``in_specs=P()`` under ``shard_map``) are fine: the
    local gradients are taken with respect to a per-site copy, whereas a bare
    ``jax.grad`` there would already sum them over the axis.

    Raises:
      ValueError: ``loss_fn`` applies no capturable Dense layer, a layer's
        kernel is not in ``params``, a layer is hidden inside a transformation
        (``nn.remat``, ``nn.scan``, a jitted ``model.apply``), or
        ``axis_name`` is not bound.

    References:
      Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
      Differentiation", arXiv:2102.09631, 2021.
    """
    n = num_workers(axis_name)
    got = capture(loss_fn, params, batch, has_aux, axis_name)
    out = _mean_others(got, axis_name, n, compressor, key)
    for layer, a, d in zip(got.layers, got.inputs, got.deltas, strict=True):
        a_all = _gather("A", a, axis_name).astype(_F32)
        d_all = _gather("Delta", d, axis_name).astype(_F32)
        kernel = jnp.einsum("sri,sro->io", a_all, d_all) / n
        _place(got, layer, kernel, jnp.sum(d_all, axis=(0, 1)) / n, out)
    return got.loss, _tree(params, out)


def factor_rank(layer: Layer, rank: int) -> int:
    """Columns of the factors rank-dAD sends for ``layer``: ``rank`` capped by the shapes.

    ``Delta^T [A, 1]`` (``out x (in + 1)``, the ones column for the bias) has
    rank at most ``min(out, in + 1, rows)``.
    """
    return min(rank, layer.out_features, layer.in_features + (layer.bias is not None), layer.rows)


def _augmented(layer: Layer, a: jax.Array) -> jax.Array:
    """``[A, 1]``: the bias gradient ``1^T Delta`` becomes the last column of ``Delta^T [A, 1]``."""
    a = a.astype(_F32)
    if layer.bias is None:
        return a
    return jnp.concatenate([a, jnp.ones((a.shape[0], 1), _F32)], axis=1)


def power_factors(
    a: jax.Array, d: jax.Array, start: jax.typing.ArrayLike, iterations: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rank-``k`` factors ``P Q^T`` of ``G = d^T a`` by subspace (power) iteration.

    ``G`` (``out x in``) is never formed: each iteration is
    ``P = orth(d^T (a Q))``, ``Q = a^T (d P)``, with ``orth`` the left singular
    vectors of the thin SVD (orthonormal also when ``k`` exceeds the rank of
    ``G``).  A final SVD of the small ``Q`` rotates the factors so that their
    columns are ordered by singular value.

    Args:
      a: ``(rows, in)``.
      d: ``(rows, out)``.
      start: the starting ``Q``, ``(in, k)`` with ``1 <= k <= min(in, out)``
        (Gaussian: :func:`gaussian_start`).
      iterations: power iterations, at least 1 (exact after one if ``k`` is
        at least the rank of ``G``, for a generic start).

    Returns:
      ``(P, Q, s)``: ``P`` (``out x k``) and ``Q`` (``in x k``) with
      ``G ~= P Q^T``, and the singular values ``s`` of ``P Q^T`` (descending).

    Raises:
      ValueError: ``start`` has the wrong shape.
    """
    k = np.shape(start)[1] if np.ndim(start) == 2 else 0
    if np.shape(start)[:1] != (a.shape[1],) or not 1 <= k <= min(a.shape[1], d.shape[1]):
        raise ValueError(
            f"start must have shape (in, k) = ({a.shape[1]}, k) with 1 <= k <= "
            f"min(in, out) = {min(a.shape[1], d.shape[1])}, got {np.shape(start)}"
        )
    q = jnp.asarray(start, _F32)
    p = None
    for _ in range(iterations):
        p = jnp.linalg.svd(d.T @ (a @ q), full_matrices=False)[0]
        q = a.T @ (d @ p)
    u, s, vt = jnp.linalg.svd(q, full_matrices=False)
    return p @ vt.T, u * s, s


def gaussian_start(shape: tuple[int, int], seed: int, index: int = 0) -> np.ndarray:
    """A float32 Gaussian ``(in, k)`` start for :func:`power_factors`.

    Drawn with numpy at trace time (a constant of the compiled step, the same
    on every site and every step): no PRNG in the compiled program.
    """
    return np.random.default_rng([seed, index]).standard_normal(shape).astype(np.float32)


def _effective_rank(s: jax.Array, rtol: float) -> jax.Array:
    return jnp.sum(s > rtol * s[0]).astype(jnp.int32)


def _check_rank_args(rank: int, iterations: int, rtol: float) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
    if not 0 <= rtol < 1:
        raise ValueError(f"rtol must be in [0, 1), got {rtol!r}")


def rank_dad_grads(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    axis_name: AxisName,
    *,
    rank: int,
    iterations: int = 2,
    rtol: float = 1e-5,
    seed: int = 0,
    has_aux: bool = False,
    compressor: Compressor | None = None,
    key: jax.Array | None = None,
    return_ranks: bool = False,
):
    """rank-dAD: each site sends rank-``r`` factors of its Dense layers' ``Delta_s^T [A_s, 1]``.

    Per Dense layer each site

    1. factorises ``G_s = Delta_s^T [A_s, 1]`` (``out x (in + 1)``: kernel
       and bias together) as ``P_s Q_s^T`` with ``k = factor_rank(layer,
       rank)`` columns by ``iterations`` power iterations (never forming
       ``G_s``), columns ordered by singular value;
    2. counts its effective rank ``r_s``, the singular values above
       ``rtol`` times the largest, and the sites agree on ``r = max_s r_s``
       (one ``pmax`` of an int32 per layer);
    3. zeroes the columns ``j >= r`` and all-gathers ``P_s`` and ``Q_s``;
    4. every site forms ``(1/n) sum_s P_s Q_s^T``: the kernel and bias
       gradients, identical on every site.

    What "agree on r" means with static shapes: the factors always have
    ``k`` columns (XLA needs static shapes), so a site sends
    ``32 k (out + in + 1)`` bits per layer (that is what is recorded and
    what :func:`compjax.dad.dad_communication` reports); the agreed ``r``
    zeroes the columns beyond it, which below ``rtol`` on every site carry
    only round-off, so the result is that of sending ``r`` columns, and a
    variable-length transport would send ``32 r (out + in + 1)`` bits
    (``return_ranks=True`` gives each layer's ``r``).

    With ``rank`` at least the rank of every ``G_s`` the result is dAD's
    exact pooled gradient; below, it is biased (no error feedback, as in the
    paper).  Non-Dense leaves are averaged as in :func:`dad_grads`.

    Args:
      loss_fn: as in :func:`dad_grads`.
      params: as in :func:`dad_grads`.
      batch: this site's batch.
      axis_name: the sites' axis name (or tuple; ``None``: one site).
      rank: the most columns sent per layer (capped per layer by
        :func:`factor_rank`).
      iterations: power iterations per step (at least 1).
      rtol: relative singular-value threshold of the effective rank.
      seed: seed of the Gaussian start of the power iteration (the same
        every step and on every site).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      compressor: optional compressor for the non-Dense leaves.
      key: PRNG key for a stochastic ``compressor``.
      return_ranks: also return ``{layer name: agreed r}`` (int32 arrays).

    Returns:
      ``(loss, grads)``, or ``(loss, grads, ranks)`` with ``return_ranks``.

    Raises:
      ValueError: as :func:`dad_grads`, and for ``rank < 1``,
        ``iterations < 1`` or ``rtol`` outside ``[0, 1)``.

    References:
      Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
      Differentiation", arXiv:2102.09631, 2021 (rank-dAD).
    """
    _check_rank_args(rank, iterations, rtol)
    n = num_workers(axis_name)
    got = capture(loss_fn, params, batch, has_aux, axis_name)
    out = _mean_others(got, axis_name, n, compressor, key)
    factors, own_ranks = [], []
    for i, (layer, a, d) in enumerate(zip(got.layers, got.inputs, got.deltas, strict=True)):
        a = _augmented(layer, a)
        start = gaussian_start((a.shape[1], factor_rank(layer, rank)), seed, i)
        p, q, s = power_factors(a, d.astype(_F32), start, iterations)
        factors.append((p, q))
        own_ranks.append(_effective_rank(s, rtol))
    own = jnp.stack(own_ranks)
    record("ranks", own, "all_reduce", axis_name)
    agreed = own if axis_name is None else pmax(own, axis_name)
    for i, (layer, (p, q)) in enumerate(zip(got.layers, factors, strict=True)):
        keep = (jnp.arange(p.shape[1]) < agreed[i]).astype(_F32)
        p_all = _gather("P", p * keep, axis_name)
        q_all = _gather("Q", q * keep, axis_name)
        g_t = jnp.einsum("sik,sok->io", q_all, p_all) / n  # (in [+ 1]) x out
        _place(got, layer, g_t[: layer.in_features], g_t[layer.in_features :], out)
    grads = _tree(params, out)
    if return_ranks:
        names = {layer.name: agreed[i] for i, layer in enumerate(got.layers)}
        return got.loss, grads, names
    return got.loss, grads


def dense_layers(loss_fn: LossFn, params: Any, batch: Any) -> list[Layer]:
    """The Dense layers dAD captures in ``loss_fn(params, batch)`` (abstract trace).

    Returns:
      One :class:`~compjax.dad.capture.Layer` per layer (name, leaf indices,
      ``in``, ``out``, ``rows`` per site).

    Raises:
      ValueError: no Dense layer, or one whose kernel is not in ``params``.
    """
    return group_layers(discover(loss_fn, params, batch), params)


def split_batch(batch: Any, workers: int) -> Any:
    """Reshape a global batch's leading axis into ``(workers, batch / workers, ...)``.

    For ``jax.pmap`` and ``jax.vmap``-simulated sites (``shard_map`` splits a
    global batch itself with ``in_specs=P(axis)``).

    Args:
      batch: a pytree whose leaves share their leading (example) axis.
      workers: the number of sites.

    Returns:
      The batch with a leading sites axis.

    Raises:
      ValueError: the leaves have no common leading axis, or its size does not
        divide across ``workers`` (dAD's pooled mean needs equal local batches).
    """
    leaves = jax.tree.leaves(batch)
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if not leaves or None in sizes or len(sizes) != 1:
        raise ValueError(
            f"every leaf of the batch needs the same leading (example) axis; got sizes {sizes}"
        )
    size = sizes.pop()
    if workers < 1 or size % workers:
        raise ValueError(
            f"a global batch of {size} examples does not divide across {workers} workers: "
            f"dAD's pooled mean gradient needs equal local batches; use a batch size that "
            f"is a multiple of {workers}"
        )
    return jax.tree.map(lambda x: jnp.reshape(x, (workers, size // workers, *x.shape[1:])), batch)
