"""The machine a benchmark ran on: CPU, library versions, JAX's backend, thread settings,
and the load average."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import jax
import numpy as np


def machine() -> dict:
    """This machine: CPU model and count, platform, Python, JAX, jaxlib and numpy versions,
    JAX's backend and device count, ``XLA_FLAGS`` and ``OMP_NUM_THREADS``."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
        "numpy": np.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the platform has none."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None
