"""0/1 Adam (synchronising every step) against a numpy transcription of DeepSpeed's
``ZeroOneAdam.step``: the variance schedule, 1-bit gradients, the freeze, the buffers' restart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_onebit_adam import (
    B1,
    B2,
    EPS,
    PARAMS,
    N,
    compressed_allreduce,
    run_vmap,
    worker_grads,
)

import compjax

FREEZE = 7  # variance steps: 1, 2 (scaler 2), then 4, 6 (interval 2), then 8 (interval 4)
SCALER = 2
STEPS = 11
GRADS = [worker_grads(t) for t in range(STEPS)]


def reference(grads, n, freeze, scaler, server_stage):
    """0/1 Adam on one flat leaf, ``grads[t]`` of shape ``(n, d)``; the step ``t`` from 1."""
    d = grads[0].shape[1]
    m, v = np.zeros(d), np.zeros(d)
    err, server = np.zeros((n, d)), np.zeros(d)
    interval, counter = 1, 0
    updates, var_steps = [], []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        if t <= freeze + 1:
            if t % interval == 0:
                gbar = g.mean(axis=0)
                m = B1 * m + (1 - B1) * gbar
                v = B2 * v + (1 - B2) * gbar**2
                var_steps.append(t)
                counter += 1
                if counter == scaler:
                    counter, interval = 0, 2 * interval
            else:
                m = B1 * m + (1 - B1) * compressed_allreduce(g, err, server, n, server_stage)
        else:
            if t == freeze + 2:
                err[:], server[:] = 0.0, 0.0
            m = compressed_allreduce(B1 * m + (1 - B1) * g, err, server, n, server_stage)
        updates.append(m / (np.sqrt(v) + EPS))
    return updates, m, v, var_steps


@pytest.mark.parametrize(
    "exchange", ["scatter_gather", pytest.param("all_gather", marks=pytest.mark.slow)]
)
def test_matches_the_numpy_reference(exchange):
    tx = compjax.scale_by_zero_one_adam("data", FREEZE, SCALER, B1, B2, EPS, exchange=exchange)
    outs, states, _ = run_vmap(tx, GRADS)
    for name in PARAMS:
        flat = [np.asarray(g[name]).reshape(N, -1) for g in GRADS]
        updates, m, v, var_steps = reference(flat, N, FREEZE, SCALER, exchange == "scatter_gather")
        for t in range(STEPS):
            got = np.asarray(outs[t][name]).reshape(N, -1)
            np.testing.assert_allclose(got, np.broadcast_to(updates[t], got.shape), rtol=2e-4)
        np.testing.assert_allclose(np.asarray(states[-1].mu[name])[0].reshape(-1), m, rtol=2e-4)
        np.testing.assert_allclose(np.asarray(states[-1].nu[name])[0].reshape(-1), v, rtol=1e-5)
    assert var_steps == compjax.transforms.zero_one_adam.variance_steps(SCALER, FREEZE)
    assert var_steps == [1, 2, 4, 6, 8]


def test_schedule_and_validation():
    steps = compjax.transforms.zero_one_adam.variance_steps(16, 100000)
    assert steps[:17] == [*range(1, 17), 18]  # then every other step
    assert steps[32] == 52 and len(steps) < 16 * 14  # doubling: O(16 log T) dense rounds
    for bad in ({"var_freeze_step": 0}, {"var_update_scaler": 0}, {"var_update_scaler": 1.5}):
        args = {"var_freeze_step": 10, "var_update_scaler": 16} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            compjax.scale_by_zero_one_adam("data", **args)


def test_non_finite_keeps_the_state_and_bf16_trains():
    tx = compjax.zero_one_adam(1e-2, "data", 3, 1)
    grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), GRADS[0])
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(N))
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    for _ in range(5):  # through the variance steps, the 1-bit gradients and the freeze
        out, state = step(grads, state)
        assert all(
            jnp.all(jnp.isfinite(u)) and u.dtype == jnp.bfloat16 for u in jax.tree.leaves(out)
        )
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
    _, kept = step(bad, state)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
