"""PowerSGD: rank-r power iteration on each gradient matrix, with error feedback.

References:
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization", NeurIPS 2019 (Algorithms 1-2).
  PyTorch's DDP communication hook ``powerSGD_hook``, whose conventions
  (error memory ``M_i - P Q^T``, warm start, Gram-Schmidt, minimum
  compression rate, start iteration) this follows.

Which leaves are compressed, and as which matrices, is decided here
(:func:`matrix_view`, :func:`compressible`); the step's messages, the low-rank
update and the error memory are :mod:`compjax.transforms.powersgd_step`.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from compjax.axes import AxisName, num_workers
from compjax.draws import init_key
from compjax.guards import all_finite, any_non_finite, guarded
from compjax.transforms.base import Leaves, check_state_dtype, counted, state_zeros
from compjax.transforms.powersgd_step import (
    Options,
    compressed_step,
    orthogonalize,
    warmup_step,
)


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    Attributes:
      count: steps taken (int32), for ``start_iter``.
      error: per-worker error memory ``e_i`` (zero for leaves sent uncompressed).
      q: shared right factors ``Q`` of the compressed leaves, warm-started
        (leaf order; ``None`` for leaves sent uncompressed: an empty pytree
        node, which ``state_specs`` and orbax-checkpoint pass through, where a
        zero-size array cannot be saved).
    """

    count: jax.Array
    error: Any
    q: tuple
    PER_WORKER = ("error",)
    # Each Q is computed from its leaf's block: on params split over a model axis it differs
    # between the blocks (``state_specs`` splits it over the leaf's other axes).
    PER_LEAF = ("q",)


def matrix_view(shape, channels_last: bool = True) -> tuple[int, int]:
    """The ``(rows, cols)`` matrix a tensor of ``shape`` is compressed as.

    A matrix is itself; a tensor of 3 or more dimensions is a kernel whose
    output channels form one side: the last axis with ``channels_last``
    (flax/JAX layout, conv kernels ``(kh, kw, cin, cout)`` become
    ``(kh kw cin) x cout``), else the first (PyTorch layout ``(cout, cin, kh,
    kw)`` becomes ``cout x (cin kh kw)``, as PyTorch's hook views it).
    """
    if len(shape) < 2:
        return (1, math.prod(shape))
    if len(shape) > 2 and channels_last:
        return (math.prod(shape[:-1]), shape[-1])
    return (shape[0], math.prod(shape[1:]))


def compressible(shape, rank: int, min_compression_rate: float, channels_last: bool = True) -> bool:
    """Compress a tensor of ``shape`` at ``rank``?

    As PyTorch's hook: only tensors of 2 or more dimensions, and only if
    ``(rows + cols) * rank * min_compression_rate < rows * cols`` for the
    :func:`matrix_view` ``rows x cols``.
    """
    if len(shape) < 2:
        return False
    rows, cols = matrix_view(shape, channels_last)
    r = min(rank, rows, cols)
    return (rows + cols) * r * min_compression_rate < rows * cols


class LayoutWarning(UserWarning):
    """A kernel that :func:`powersgd` sends dense in the layout it was given, but would
    compress in the other (``channels_last`` probably does not match the parameters)."""


def warn_if_layout_swapped(
    shape, rank: int, min_compression_rate: float, channels_last: bool
) -> None:
    """Warn (:class:`LayoutWarning`) if a kernel of ``shape`` (3+ dimensions) is not
    :func:`compressible` in the layout ``channels_last`` names but is in the other.

    PyTorch's ``(cout, cin, kh, kw)`` read as flax's ``(kh, kw, cin, cout)``
    becomes a ``(cout cin kh) x kw`` matrix, too thin to compress, and the
    whole kernel is all-reduced in float32: on ResNet-50's shapes 53 of its 54
    matrices, with nothing else to show for it than the bits.
    """
    if len(shape) < 3 or compressible(shape, rank, min_compression_rate, channels_last):
        return
    if compressible(shape, rank, min_compression_rate, not channels_last):
        given, other = matrix_view(shape, channels_last), matrix_view(shape, not channels_last)
        warnings.warn(
            f"powersgd: a kernel of shape {tuple(shape)} is sent uncompressed: with "
            f"channels_last={channels_last} it is a {given[0]} x {given[1]} matrix, with "
            f"channels_last={not channels_last} a compressible {other[0]} x {other[1]} one "
            "(PyTorch's (cout, cin, kh, kw) kernels need channels_last=False)",
            LayoutWarning,
            stacklevel=3,
        )


class _Layout(NamedTuple):
    """Which leaves :func:`powersgd` compresses, and at which rank."""

    rank: int
    min_compression_rate: float
    channels_last: bool

    def rank_of(self, shape) -> int:
        """The rank used for a leaf of ``shape``, 0 if it is sent uncompressed."""
        if not compressible(shape, self.rank, self.min_compression_rate, self.channels_last):
            return 0
        return min(self.rank, *matrix_view(shape, self.channels_last))


def _initial_q(key, shape, layout: _Layout, epsilon: float):
    """The shared, orthonormalised Gaussian ``Q`` of a leaf (``None``: sent uncompressed)."""
    r = layout.rank_of(shape)
    if not r:
        return None
    cols = matrix_view(shape, layout.channels_last)[1]
    return orthogonalize(jax.random.normal(key, (cols, r)), epsilon)


def _init(params, *, layout: _Layout, epsilon: float, seed: int, state_dtype) -> PowerSGDState:
    """:func:`powersgd`'s state at step 0 (warning about kernels sent dense in this layout)."""
    leaves = Leaves(params, flatten=False)
    for a in leaves.arrays:
        warn_if_layout_swapped(a.shape, *layout)
    keys = jax.random.split(init_key(seed), max(len(leaves.arrays), 1))
    q = tuple(
        _initial_q(k, a.shape, layout, epsilon) for k, a in zip(keys, leaves.arrays, strict=False)
    )
    error = leaves.worker_state(state_zeros(state_dtype))
    return PowerSGDState(count=jnp.zeros([], jnp.int32), error=error, q=q)


def _update(updates, state: PowerSGDState, params=None, *, opts: Options, start_iter: int):
    """:func:`powersgd`'s step: dense means before ``start_iter``, low-rank ones after."""
    leaves = Leaves(updates, flatten=False)
    bad = any_non_finite(leaves.arrays, opts.axis_name)
    errors = leaves.read(state.error, "error", per_worker=True)
    n = num_workers(opts.axis_name)
    args = (leaves.arrays, errors, state.q, n, opts)
    known = None
    if start_iter:
        out, new_errors, new_q = jax.lax.cond(
            state.count < start_iter,
            lambda a: warmup_step(*a, n, opts),
            lambda a: compressed_step(*a, n, opts),
            args[:3],
        )
    else:
        out, new_errors, new_q = compressed_step(*args)
        # Finite input gives finite low-rank updates (saturated, from factors kept finite)
        known = [None if q is None else jnp.bool_(True) for q in state.q]
    new_state = PowerSGDState(
        count=optax.safe_increment(state.count),
        error=leaves.write(new_errors, per_worker=True),
        q=new_q,
    )
    # The memories saturate (finite for finite input): only the factors Q are read here.
    state_finite = all_finite([q for q in new_q if q is not None])
    out, new_state = guarded(bad, out, new_state, state, known, state_finite)
    return leaves.rebuild(out), new_state


def powersgd(
    rank: int,
    axis_name: AxisName,
    *,
    start_iter: int = 0,
    min_compression_rate: float = 2.0,
    orthogonalization_epsilon: float = 0.0,
    seed: int = 0,
    channels_last: bool = True,
    state_dtype: Any = None,
    error_feedback: bool = True,
) -> optax.GradientTransformation:
    """PowerSGD with error feedback and warm start; the update is the rank-``r`` mean.

    For each leaf viewed as a matrix ``(rows, cols)`` (see :func:`matrix_view`:
    kernels of 3+ dimensions put their output channels on one side) and
    compressed (see :func:`compressible`), each worker forms ``M_i = g_i + e_i`` and:

    1. ``P = sum_i M_i Q`` (all-reduce of ``rows x r``), orthonormalised by
       Gram-Schmidt;
    2. ``Q <- mean_i M_i^T P`` (all-reduce of ``cols x r``), kept for the next
       step (warm start);
    3. the update is ``P Q^T``; ``e_i <- M_i - P Q^T``.

    ``Q`` starts as the same orthonormalised Gaussian matrix on every worker
    (from ``seed``).  Leaves that are 1-D or too small to compress at least
    ``min_compression_rate`` times are all-reduced in float32.  Before
    ``start_iter`` steps every leaf is all-reduced and the memory is unused.

    Each worker sends ``32 r (rows + cols)`` bits per compressed leaf; the
    :func:`compjax.communication` report is that steady state.

    Args:
      rank: ``r >= 1`` (capped at ``min(rows, cols)`` per leaf).
      axis_name: the data-parallel axis.
      start_iter: plain all-reduce steps before compression starts.
      min_compression_rate: compress only where it saves this factor.
      orthogonalization_epsilon: added to column norms in Gram-Schmidt.
      seed: seed of the shared initial ``Q``.
      channels_last: kernels of 3+ dimensions have their output channels last
        (flax/JAX, ``(kh, kw, cin, cout)``); ``False`` for PyTorch's
        ``(cout, cin, kh, kw)``.  ``init`` warns (:class:`LayoutWarning`)
        about a kernel sent dense in this layout that the other would compress.
      state_dtype: dtype of the error memory (see
        :mod:`compjax.transforms.base`): ``None`` keeps it in float32 (or the
        parameters' dtype where wider) even for bfloat16/float16 gradients.
        ``P`` and ``Q`` are float32 either way; updates keep the gradient's
        dtype.
      error_feedback: keep the memory ``e_i`` (the paper's algorithm);
        ``False`` compresses ``M_i = g_i`` and drops the residual (the
        paper's ablation, and the like-for-like comparison with low-rank
        methods that keep no memory, such as rank-dAD).

    Returns:
      An ``optax.GradientTransformation`` with :class:`PowerSGDState`.

    Raises:
      ValueError: ``rank < 1``, ``start_iter < 0``, ``min_compression_rate < 1``,
        a negative epsilon or an invalid ``state_dtype``.

    References:
      Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
      Distributed Optimization", NeurIPS 2019.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if not isinstance(start_iter, int) or start_iter < 0:
        raise ValueError(f"start_iter must be a nonnegative integer, got {start_iter!r}")
    if not min_compression_rate >= 1:
        raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate!r}")
    if not orthogonalization_epsilon >= 0:
        raise ValueError(
            f"orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}"
        )
    state_dtype = check_state_dtype(state_dtype)
    layout = _Layout(rank, min_compression_rate, channels_last)
    opts = Options(axis_name, orthogonalization_epsilon, error_feedback)
    init_fn = functools.partial(
        _init, layout=layout, epsilon=orthogonalization_epsilon, seed=seed, state_dtype=state_dtype
    )
    update_fn = functools.partial(_update, opts=opts, start_iter=start_iter)
    return optax.GradientTransformation(init_fn, counted(update_fn))
