"""compjax's experiments: datasets, models, tasks, the training harness and benchmarks.

Every dataset here ships with its package or is generated locally (no
download at run time).  Importing the package asks XLA for 8 host (CPU)
devices unless ``XLA_FLAGS`` already sets a count, so data-parallel runs over
simulated workers work on a laptop; on a GPU/TPU host the accelerators are
used unchanged.

It also limits OpenBLAS (numpy's, and scipy's, whose LAPACK XLA's CPU
backend calls for SVD and QR) to one thread: next to XLA's own threads its
spinning workers made a 128 x 128 SVD take 0.8 s instead of 2.5 ms on a
loaded 2-core machine.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import scipy.linalg  # noqa: E402, F401  (loads the OpenBLAS that XLA's LAPACK calls use)
from threadpoolctl import threadpool_limits  # noqa: E402

threadpool_limits(limits=1, user_api="blas")
