"""Will compression pay on my setup?  ``python -m compjax.advise`` or :func:`advise`.

The package, top to bottom:

* :mod:`compjax.advise.cli`: the command line (replicated data parallelism, and sharded
  training with ``--fsdp``);
* :mod:`compjax.advise.fsdp`: the same question for :func:`compjax.fsdp` steps;
* :mod:`compjax.advise.advisor`: :func:`advise`, each method's predicted step time;
* :mod:`compjax.advise.report`: the answer (:class:`Advice`), its table and recommendation;
* :mod:`compjax.advise.codec_timing`: one worker's update timed on a sample, scaled by size.
"""

from compjax.advise.advisor import (
    advise,
    as_params,
    crossover,
    messages,
    methods,
)

#: The advisor's own functions; its constants (``AXIS``, ``COLLECTIVES``), the report's, the
#: FSDP mode's and the command line's names are under their modules.
__all__ = [
    "advise",
    "as_params",
    "crossover",
    "messages",
    "methods",
]
