"""compjax's experiments: datasets, models, tasks, the training harness and benchmarks.

Every dataset here ships with its package or is generated locally (no
download at run time).  Importing the package asks XLA for 8 host (CPU)
devices unless ``XLA_FLAGS`` already sets a count, so data-parallel runs over
simulated workers work on a laptop; on a GPU/TPU host the accelerators are
used unchanged.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
