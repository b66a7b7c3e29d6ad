"""How a compressed mean travels: all-gather, scatter-gather, and hierarchical exchanges.

Three ways for the workers' compressed messages to meet (every transformation
takes one as ``exchange=``; the default is ``"all_gather"``):

* ``"all_gather"``: each worker compresses its whole array, the payloads are
  all-gathered and every worker decodes and adds all ``n`` of them.  Each
  worker receives ``(n - 1) M_c`` bits: traffic grows with ``n``.
  ``linear`` compressors (identity, cast, random-k with a shared seed) ``psum``
  their payloads instead and decode once, whatever the exchange; so do
  ``summable`` ones (:func:`compjax.int_quant`), after a ``pmax`` of their
  scale, with integer codes in fields wide enough for ``n`` summands.
* ``"scatter_gather"``: a compressed all-reduce.  The flat array is split into
  ``n`` shards; each worker compresses every shard and ``all_to_all`` sends
  shard ``j`` to worker ``j`` (*scatter*), which decodes and sums it
  (*reduce*), compresses the sum again and all-gathers it (*gather*).  Each
  worker sends and receives about ``2 (n - 1) / n M_c`` bits, like a ring
  all-reduce of the compressed size.
* :func:`compressed_reduce_scatter`: the first half alone, for sharded
  training: each worker ends with the mean of the shard it owns.  Summable
  and linear compressors reduce-scatter their payloads; the others are
  all-to-all-ed and summed by the owner, as in ``"scatter_gather"``.
* :func:`hierarchical`: on a mesh with a fast axis and a slow one, the array
  is reduce-scattered over the fast axis uncompressed, the shard is exchanged
  compressed over the slow axes (by either exchange above), and the result is
  all-gathered over the fast axis.  Only the slow link carries compressed
  messages.

The package reads top to bottom; a module imports only those below it
(and calls only down: the guards are handed the sums to take again):

* :mod:`compjax.exchange.choose`: the public functions, their checks and
  the choice of exchange, and what they return (:class:`Exchanged`);
* :mod:`compjax.exchange.overflow`: a sum that overflows float32 taken
  again pre-scaled (the one overflow-safe mean, and a whole run again);
* :mod:`compjax.exchange.two_level`: the hierarchical exchange's run;
* :mod:`compjax.exchange.flat`: each flat exchange over one set of axes,
  and the second compression of ``"scatter_gather"`` (its error memory for
  a biased compressor, its exact variance for an unbiased one:
  :func:`two_stage_variance`);
* :mod:`compjax.exchange.scatter`: the scatter half, blocks and decoded sums.

This module only re-exports the public names.

``Exchanged.local`` is this worker's part of the exchange, defined so that
(``S_j`` the first-stage sum of shard ``j`` and ``m_j`` its owner's memory,
as in :mod:`compjax.exchange.flat`)
``sum_i local_i + sum_j m_j(before) = n mean + sum_j m_j(after)`` holds
exactly: the decoded own message, plus (unbiased scatter-gather, no memory)
the second-stage residual ``C_2(S_j) - S_j`` of the shard it owns, and
(hierarchical) minus the residual of its fast group's shard.  Error
feedback, EF21 and DIANA use it unchanged, and their invariants (``sum of
sent + memories = inputs``; ``h = mean_i h_i``) hold on every exchange.

Server memories are per-worker arrays of the leaf's shape; worker ``j``
uses the entries of the shard it owns and keeps zeros elsewhere (so the
state's shape does not depend on ``n``).

Bits are logged per message kind: ``"payload"`` (all-gather), ``"scatter"``
(all of a worker's shard payloads, of which ``(n - 1)/n`` leave it),
``"gather"`` (its re-compressed shard), and on a hierarchical exchange
``"fast_reduce_scatter"`` and ``"fast_all_gather"`` on the fast axis.

References:
  Tang, Yu, Lian, Zhang, Liu, "DoubleSqueeze: Parallel Stochastic Gradient
  Descent with Double-Pass Error-Compensated Compression", ICML 2019.
  Patarasuk, Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009 (reduce-scatter + all-gather).
"""

from compjax.exchange.choose import KINDS as KINDS
from compjax.exchange.choose import Exchange as Exchange
from compjax.exchange.choose import Exchanged as Exchanged
from compjax.exchange.choose import as_exchange as as_exchange
from compjax.exchange.choose import compressed_mean as compressed_mean
from compjax.exchange.choose import compressed_reduce_scatter as compressed_reduce_scatter
from compjax.exchange.choose import hierarchical as hierarchical
from compjax.exchange.choose import keeps_memory as keeps_memory
from compjax.exchange.flat import two_stage_bound as two_stage_bound
from compjax.exchange.flat import two_stage_variance as two_stage_variance

__all__ = [
    "KINDS",
    "Exchange",
    "Exchanged",
    "as_exchange",
    "compressed_mean",
    "compressed_reduce_scatter",
    "hierarchical",
    "keeps_memory",
    "two_stage_bound",
    "two_stage_variance",
]
