"""Test configuration: 8 simulated CPU devices and the hypothesis profiles."""

import os

# Simulated devices must be requested before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)

# "ci" is deterministic (derandomize) and small; "dev" explores more.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
