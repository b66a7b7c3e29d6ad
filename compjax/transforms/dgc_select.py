"""DGC's selection, under its earlier name: see :mod:`compjax.compressors.selection`.

The selection serves :func:`compjax.top_k` as well as :func:`compjax.dgc`, so
it lives with the compressors; this module keeps ``compjax.transforms.dgc_select``
imports working.
"""

from compjax.compressors.selection import (
    Selection,
    band_limits,
    exact_select,
    num_selected,
    sample_layout,
    sampled_threshold_select,
)

__all__ = [
    "Selection",
    "band_limits",
    "exact_select",
    "num_selected",
    "sample_layout",
    "sampled_threshold_select",
]
