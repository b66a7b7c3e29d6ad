"""Test configuration: 8 simulated CPU devices, a shared compilation cache, hypothesis profiles."""

import atexit
import os
import shutil
import tempfile

# Simulated devices must be requested before jax is imported.  The tests spend most of
# their time compiling small programs, so the CPU backend is told to compile cheaply: no
# LLVM backend optimisation or expensive passes, the classic fusion emitters, one codegen
# module per program (35-40% less CPU time over test_contract and test_transforms; the HLO
# optimisations are unchanged).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1",
)

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_num_cpu_devices", 8)

# One persistent compilation cache per test run, shared by the xdist workers (they inherit
# the controller's environment): a program compiled by one test file is loaded, not
# recompiled, by the others.  A directory given in JAX_COMPILATION_CACHE_DIR is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="compjax-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

# "ci" is deterministic (derandomize) and small; "dev" explores more.
settings.register_profile(
    "ci",
    max_examples=15,
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

#: The longest test files of the fast suite (about 20-50 s each on this 2-core machine), run
#: first: ``--dist loadfile`` hands each worker one file at a time in collection order, so a
#: long file collected last would keep one core busy while the other waits.
LONGEST_FIRST = (
    "test_contract.py",
    "test_transforms.py",
    "test_exchange.py",
    "test_onebit_adam.py",
    "test_readme.py",
    "test_training.py",
    "test_dgc.py",
    "test_nnx.py",
    "test_multiprocess.py",
    "test_numerics.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others in order
