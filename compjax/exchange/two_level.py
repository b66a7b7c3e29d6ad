"""The hierarchical exchange's run: uncompressed over the fast axes, compressed over the slow.

:func:`hierarchical_sum` reduce-scatters the array over the fast axes
uncompressed (each worker then holds its fast group's sum of one shard),
exchanges that shard compressed over the slow axes (:func:`slow_mean`, one
of the flat exchanges of :mod:`compjax.exchange.flat`) and all-gathers the
result over the fast axes.  Its sum may overflow float32 as a whole:
:func:`compjax.exchange.compressed_mean` runs it under
:func:`compjax.exchange.overflow.rescaled_if_overflow`, so the slow stage is
not guarded on its own.

``local`` (what error feedback keeps, see :class:`compjax.exchange.Exchanged`)
is this worker's ``x`` less the residual of its fast group's shard; the
shard owners' memories (a biased compressor over ``"scatter_gather"``) are
kept in the entries of the shard each owns.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from compjax import collectives
from compjax.axes import num_workers, worker_index
from compjax.exchange.flat import gathered_sum, in_shape_of, scatter_gathered, single, summed_codes
from compjax.exchange.scatter import block_of, padded_to, placed_block, summable
from compjax.recording import record


def hierarchical_sum(comp, key, x, memory, slow, fast, kind):
    """Reduce-scatter over ``fast``, compressed exchange over ``slow``, all-gather over ``fast``.

    Returns:
      ``(total, local, memory)``: the float32 sum over every worker
      (flattened), this worker's part and the new memory (flattened, or ``None``).
    """
    flat = x.reshape(-1)
    d = flat.shape[0]
    n_fast = num_workers(fast)
    m = math.ceil(d / n_fast)
    padded = padded_to(flat, n_fast * m)
    record("fast_reduce_scatter", padded, "reduce_scatter", fast)
    group = collectives.psum_scatter(padded, fast)  # this worker's shard, summed over ``fast``
    k = worker_index(fast)
    inner_key = jax.random.fold_in(key, k)  # distinct per shard; shared along ``slow``
    inner_memory = None if memory is None else block_of(memory.reshape(-1), k, n_fast)
    if slow:
        inner = slow_mean(comp, inner_key, group, slow, kind, inner_memory)
        mean, shard_local, inner_memory = inner
        shard_total = mean.astype(jnp.float32) * num_workers(slow)
    else:
        shard_total, shard_local = group.astype(jnp.float32), group
    record("fast_all_gather", shard_total.astype(x.dtype), "all_gather", fast)
    total = collectives.all_gather_tiled(shard_total, fast)[:d]
    local = flat.astype(jnp.float32) - placed_block(
        group.astype(jnp.float32) - shard_local.astype(jnp.float32), k, n_fast, d
    )
    new_memory = None if inner_memory is None else placed_block(inner_memory, k, n_fast, d)
    return total, local, new_memory


def slow_mean(comp, key, x, names, kind, memory):
    """The flat exchange of a shard over the slow axes, unguarded: ``(mean, local, memory)``.

    The mean and local part in ``x``'s shape and dtype (as
    :func:`compjax.exchange.compressed_mean` returns them); the memory
    in the precision it was computed in.
    """
    n = num_workers(names)
    if n == 1:
        local = comp.decompress(single(comp, key, x, names))
        return local, local, memory
    if summable(comp):
        total, _, finish = summed_codes(comp, key, x.reshape(-1), names, n)
        mean, local, _ = finish(total / n, None)
    elif comp.linear or kind == "all_gather":
        total, _, finish = gathered_sum(comp, key, x, names, n)
        mean, own, _ = finish(total / n, None)
        local = comp.decompress(own)
    else:
        flat_memory = None if memory is None else memory.reshape(-1)
        total, local, memory = scatter_gathered(comp, key, x.reshape(-1), flat_memory, names, n)
        mean = total / n
    memory = None if memory is None else memory.reshape(x.shape)
    return in_shape_of(x, mean), in_shape_of(x, local), memory
