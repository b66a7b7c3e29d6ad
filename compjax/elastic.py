"""``import compjax.elastic as ce``: local steps on Ray that survive dead, slow and lying workers.

The public face of :mod:`compjax.steps.elastic`: :func:`train`, its result
and records, and the faults it can inject.  Needs the ``elastic`` extra
(``pip install 'compjax[elastic]'``: Ray, orbax, tqdm); Ray itself is
imported when :func:`train` runs.

Example::

    import compjax, optax
    import compjax.elastic as ce

    result = ce.train(
        loss_fn, params, batches,  # batches(island, step) -> (x, y)
        inner=optax.adamw(1e-3), outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        sync_every=50, rounds=40, islands=4, compressor=compjax.int_quant(8),
        min_quorum=3, merge="median_norm_clip", faults=(ce.Kill(1, at_round=2),),
    )
    result.params, result.history[-1].merged
"""

from compjax.merges import MERGES
from compjax.steps.elastic import ElasticResult, train
from compjax.steps.elastic_faults import Kill, KillSynchronizer, Poison, Slow
from compjax.steps.elastic_rounds import MAX_STALENESS, MIN_GRACE_S, Round

__all__ = [
    "MAX_STALENESS",
    "MERGES",
    "MIN_GRACE_S",
    "ElasticResult",
    "Kill",
    "KillSynchronizer",
    "Poison",
    "Round",
    "Slow",
    "train",
]
