"""SparseLoCo: DiLoCo whose pseudo-gradients travel as chunked top-k in 2 bits.

References:
  Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM
  Pre-training with SparseLoCo", arXiv 2508.15706, 2025.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from compjax import merges
from compjax.axes import AxisName
from compjax.compressors.chunked import ChunkedTopK, chunk_layout, chunked_top_k
from compjax.exchange import Exchange, as_exchange
from compjax.transforms.base import ServerMemory, counted
from compjax.transforms.diloco import DiLoCoState, diloco
from compjax.transforms.outer import EveryH, check_positive, gathered

MERGES = ("mean", "median_norm_clip")
AVERAGES = ("workers", "senders")


def sparseloco(
    inner: optax.GradientTransformation,
    sync_every: int,
    axis_name: AxisName,
    *,
    outer_lr: float = 1.0,
    k: int = 32,
    chunk: int = 4096,
    bits: int | None = 2,
    error_decay: float = 0.95,
    exchange: str | Exchange = "all_gather",
    seed: int = 0,
    chunk_1d: int | None = None,
    merge: str = "mean",
    average: str = "workers",
) -> optax.GradientTransformation:
    """SparseLoCo: local steps, then error feedback with a decaying memory in place of
    DiLoCo's outer momentum, and a sparse, 2-bit message.

    Every ``sync_every`` inner steps each worker forms ``e_i <- beta e_i +
    Delta_i`` (its pseudo-gradient ``Delta_i = theta - theta_i`` added to its
    decayed memory), sends ``m_i = C(e_i)`` with ``C =``
    :func:`compjax.chunked_top_k` ``(k, chunk, bits)``, keeps ``e_i <- e_i -
    m_i``, and every worker restarts from ``theta <- theta - outer_lr *
    mean_i m_i``.  This is exactly :func:`compjax.diloco` with
    ``outer=optax.sgd(outer_lr)``, ``compressor=chunked_top_k(k, chunk,
    bits)``, ``error_feedback=True`` and ``error_decay=beta``, which is what
    it returns with the default ``chunk_1d``, ``merge`` and ``average``
    (same state, specs and checkpoints).  Those three give the authors'
    code's choices instead (templar; below).  Non-finite input is handled as
    in :func:`compjax.diloco` on either path.

    The defaults follow the authors' configuration for their 500M-parameter
    runs: ``k = 32`` of every 64 x 64 tile (here ``chunk = 4096``
    consecutive entries of the flattened leaf), ``beta = 0.95``, outer
    learning rate 1, with inner AdamW (learning rate 1e-3, weight decay 0.1)
    and ``sync_every = 15``; 2-bit values as in the paper.

    Args:
      inner: the inner optimizer, e.g. ``optax.adamw(1e-3, weight_decay=0.1)``.
      sync_every: ``H``, inner steps per round.
      axis_name: the workers' axis.
      outer_lr: the outer SGD step on the mean message.
      k, chunk, bits: the compressor (:func:`compjax.chunked_top_k`).
      error_decay: ``beta`` in ``[0, 1]``.
      exchange: how messages travel (:mod:`compjax.exchange`).
      seed: as in :func:`compjax.diloco`.
      chunk_1d: chunk size for the leaves with at most one dimension above 1
        (biases, norms' scales), with ``min(k, chunk_1d)`` entries kept per
        chunk; ``None``: ``chunk``, like every leaf.  The authors' code
        (templar) cuts such leaves in chunks of 64 (the largest divisor of
        the length up to 64; the same where the length is a multiple of 64).
      merge: ``"mean"``, or ``"median_norm_clip"``: before the outer step
        each worker's message for a leaf is scaled by ``min(1, M / norm)``,
        ``M`` the (lower) median of the workers' norms for that leaf
        (:func:`compjax.merges.clip_to_median_norm` with ``per_leaf=True``),
        as the authors' code does.
      average: ``"workers"`` (each entry summed over the workers and divided
        by their number) or ``"senders"`` (divided by the number of workers
        that sent that entry; entries no worker sent stay 0), as the
        authors' code does.

    Any of ``chunk_1d``, ``merge`` or ``average`` away from its default
    gathers every worker's message (``exchange="all_gather"`` only), merges
    them as said, and steps ``theta <- theta - outer_lr * merged``; the state
    is :class:`compjax.DiLoCoState`, as with the defaults.

    Returns:
      The :func:`compjax.diloco` transformation described above, or with the
      options above the same round with that merge.

    Raises:
      ValueError: as :func:`compjax.chunked_top_k` and :func:`compjax.diloco`;
        ``chunk_1d`` not a positive integer, ``merge`` or ``average`` unknown,
        or these options with an exchange other than ``"all_gather"``.

    References:
      Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo",
      arXiv 2508.15706, 2025.
    """
    comp = chunked_top_k(k=k, chunk=chunk, bits=bits)
    if chunk_1d is None and merge == "mean" and average == "workers":
        return diloco(
            inner,
            optax.sgd(outer_lr),
            sync_every,
            axis_name,
            compressor=comp,
            exchange=exchange,
            error_feedback=True,
            error_decay=error_decay,
            seed=seed,
        )
    _check_reference_options(chunk_1d, merge, average, exchange, sync_every, error_decay)
    vector = comp if chunk_1d is None else chunked_top_k(min(k, chunk_1d), chunk_1d, bits)
    rounds = EveryH(
        DiLoCoState, "sparseloco", inner, optax.sgd(outer_lr), sync_every, axis_name,
        send=MergedSend(comp, vector, axis_name, merge, average), keep_error=True,
        error_decay=error_decay, server=ServerMemory(comp, exchange), seed=seed,
    )  # fmt: skip
    return optax.GradientTransformation(rounds.init, counted(rounds.update))


def _check_reference_options(chunk_1d, merge, average, exchange, sync_every, error_decay):
    """Refuse :func:`sparseloco`'s arguments that its reference options cannot take.

    Raises:
      ValueError: naming the argument.
    """
    if chunk_1d is not None and (
        isinstance(chunk_1d, bool) or not isinstance(chunk_1d, int) or chunk_1d < 1
    ):
        raise ValueError(f"chunk_1d must be a positive integer or None, got {chunk_1d!r}")
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    if as_exchange(exchange).kind != "all_gather" or as_exchange(exchange).fast_axis is not None:
        raise ValueError(
            f"exchange must be 'all_gather' with chunk_1d, merge or average set, got {exchange!r}"
        )
    check_positive("sync_every", sync_every)
    if not 0.0 <= error_decay <= 1.0:
        raise ValueError(f"error_decay must be in [0, 1], got {error_decay!r}")


def is_vector(shape) -> bool:
    """Whether a leaf of ``shape`` is chunked as a vector: at most one dimension above 1."""
    return sum(d > 1 for d in shape) <= 1


def _sent(comp: ChunkedTopK, wire, n: int) -> jax.Array:
    """1.0 at the ``n`` flat positions a message sent, 0.0 elsewhere."""
    size, count, _ = chunk_layout(n, comp.chunk, comp.k)
    idx, _ = comp.entries(wire, n)
    return jnp.zeros(count * size, jnp.float32).at[idx].set(1.0)[:n]


def merged_messages(messages: jax.Array, sent: jax.Array, merge: str, average: str) -> jax.Array:
    """One leaf's merge: ``messages`` and ``sent`` (1.0 where a worker sent an entry) stacked on
    a leading worker axis; see :func:`sparseloco`'s ``merge`` and ``average``."""
    if merge == "median_norm_clip":
        messages, _ = merges.clip_to_median_norm(messages, per_leaf=True)
    total = jnp.sum(messages, axis=0)
    if average == "workers":
        return total / messages.shape[0]
    senders = jnp.sum(sent, axis=0)
    return jnp.where(senders > 0, total / jnp.maximum(senders, 1.0), 0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class MergedSend:
    """:data:`compjax.transforms.outer.Send` of SparseLoCo's reference options: every
    worker's chunked top-k message gathered and merged (:func:`merged_messages`).

    ``matrix`` compresses the leaves with two or more dimensions above 1,
    ``vector`` the others (:func:`is_vector`); the residual is this worker's
    pseudo-gradient less its own message.  No shard owner's memory is kept.
    """

    matrix: ChunkedTopK
    vector: ChunkedTopK
    axis_name: AxisName
    merge: str
    average: str

    def __call__(self, key: jax.Array, p: jax.Array, memory: None) -> tuple:
        comp = self.vector if is_vector(p.shape) else self.matrix
        payload, every = gathered(comp, key, p, self.axis_name)
        decoded = jax.vmap(comp.decompress)(every).reshape(-1, p.size)
        sent = jax.vmap(functools.partial(_sent, comp, n=p.size))(every.wire)
        mean = merged_messages(decoded, sent, self.merge, self.average).reshape(p.shape)
        return mean, comp.subtract_decoded(payload, p), memory
