"""The network benchmark's processes give up on a dead peer after a short heartbeat timeout."""

import inspect

import jax
import pytest

from experiments import bench_net_worker


class _Joined(Exception):
    pass


def test_bench_workers_join_with_a_short_heartbeat_timeout(monkeypatch):
    real = jax.distributed.initialize
    calls = []

    def initialize(*args, **kwargs):
        calls.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        raise _Joined  # record the call; join nothing

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    with pytest.raises(_Joined):
        bench_net_worker.join("127.0.0.1:1234", num_processes=2, process_id=1)
    [arguments] = calls
    assert arguments["heartbeat_timeout_seconds"] == bench_net_worker.HEARTBEAT_TIMEOUT_S
    assert bench_net_worker.HEARTBEAT_TIMEOUT_S < 100  # JAX's default
