"""0/1 Adam (synchronising every step) against a numpy transcription of DeepSpeed's
``ZeroOneAdam.step``: the variance schedule, 1-bit gradients, the freeze, the buffers' restart."""

import functools

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
from compjax.transforms.zero_one_adam import variance_steps

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


DS_FREEZE, DS_SCALER, DS_STEPS = 12, 2, 15
# DeepSpeed's first step() only sets up its buffers: DS_GRADS[0] is discarded there.
DS_GRADS = [worker_grads(t) for t in range(DS_STEPS + 1)]


def deepspeed_reference(grads, n, freeze, scaler, server_stage, lrs):
    """DeepSpeed's ``ZeroOneAdam.step`` (``local_step_clipper = 1``, no weight decay) on one
    flat leaf, written from its counting: ``step`` counts every call, the first of which only
    sets up (and later clears) the buffers; a variance step when ``step`` is a multiple of the
    interval, while ``step <= freeze + 1``; frozen from then on with the buffers zeroed and
    ``-lr (b1 m + (1 - b1) g_i)`` compressed (learning-rate units), ``m = -mean / lr``.

    Returns:
      (parameter changes of every call after the first, variance steps counted from the
      first gradient used).
    """
    d = grads[0].shape[1]
    m, v = np.zeros(d), np.zeros(d)
    err, server = np.zeros((n, d)), np.zeros(d)
    interval, counter, frozen = 1, 0, False
    deltas, var_steps = [], []
    for step, g in enumerate(grads, start=1):
        if step == 1:
            continue  # buffers set up; its gradient is discarded
        g, lr = np.asarray(g, np.float64), lrs[step - 2]
        if not frozen:
            if step % interval == 0:
                gbar = g.mean(axis=0)
                m = B1 * m + (1 - B1) * gbar
                v = B2 * v + (1 - B2) * gbar**2
                var_steps.append(step - 1)
                counter += 1
                if counter == scaler:
                    counter, interval = 0, 2 * interval
            else:
                m = B1 * m + (1 - B1) * compressed_allreduce(g, err, server, n, server_stage)
            deltas.append(-lr * m / (np.sqrt(v) + EPS))
        else:
            sent = compressed_allreduce(-lr * (B1 * m + (1 - B1) * g), err, server, n, server_stage)
            m = -sent / lr
            deltas.append(sent / (np.sqrt(v) + EPS))
        if step > freeze and not frozen:
            frozen, err[:], server[:] = True, 0.0, 0.0
    return deltas, var_steps


@functools.cache
def _deepspeed_run(schedule):
    """compjax's directions on ``DS_GRADS[1:]`` (``zero_one_adam`` scales them by
    ``-lr``), and the steps on which its variance moved."""
    tx = compjax.scale_by_zero_one_adam(
        "data", DS_FREEZE, DS_SCALER, B1, B2, EPS, schedule=schedule
    )
    outs, states, _ = run_vmap(tx, DS_GRADS[1:])
    changed = [
        t
        for t in range(1, DS_STEPS + 1)
        if not np.array_equal(states[t].nu["w"], states[t - 1].nu["w"])
    ]
    return outs, changed


@pytest.mark.slow  # 7 s; the numpy reference tests run the schedule fast
def test_deepspeed_schedule_matches_a_transcription_of_its_counting():
    """Fed the same gradients (kappa=2, freeze 12), DeepSpeed updates the variance on steps
    1, 2, 3, 5, 7, 11 and compjax's default on 1, 2, 4, 6, 8, 12; ``schedule="deepspeed"``
    gives DeepSpeed's steps and updates, the default does not."""
    lrs = np.ones(DS_STEPS)
    assert variance_steps(DS_SCALER, DS_FREEZE, "deepspeed") == [1, 2, 3, 5, 7, 11]
    assert variance_steps(DS_SCALER, DS_FREEZE) == [1, 2, 4, 6, 8, 12]
    runs = {schedule: _deepspeed_run(schedule) for schedule in ("deepspeed", "compjax")}
    for schedule, want in (("deepspeed", [1, 2, 3, 5, 7, 11]), ("compjax", [1, 2, 4, 6, 8, 12])):
        _, changed = runs[schedule]
        assert changed == want == variance_steps(DS_SCALER, DS_FREEZE, schedule)
    outs, _ = runs["deepspeed"]
    default, _ = runs["compjax"]
    for name in PARAMS:
        flat = [np.asarray(g[name]).reshape(N, -1) for g in DS_GRADS]
        deltas, var_steps = deepspeed_reference(flat, N, DS_FREEZE, DS_SCALER, True, lrs)
        assert var_steps == [1, 2, 3, 5, 7, 11]
        for t in range(DS_STEPS):
            got = -np.asarray(outs[t][name]).reshape(N, -1)
            np.testing.assert_allclose(got, np.broadcast_to(deltas[t], got.shape), rtol=2e-4)
        # The default departs at the first step where the schedules differ (step 3).
        got = -np.asarray(default[2][name]).reshape(N, -1)[0]
        assert not np.allclose(got, deltas[2], rtol=1e-2)
    with pytest.raises(ValueError, match="schedule"):
        compjax.scale_by_zero_one_adam("data", 10, schedule="paper")


def test_frozen_phase_compresses_the_momentum_in_gradient_units():
    """compjax compresses ``b1 m + (1 - b1) g_i + e_i`` whatever the learning rate, and
    scales the update by the step's rate afterwards; DeepSpeed compresses ``-lr`` times it
    with its error in learning-rate units.  Equal at a constant rate (the scaled sign is
    positively homogeneous), apart once the rate changes in the frozen phase."""
    lrs = np.where(np.arange(DS_STEPS) < DS_FREEZE + 1, 1e-2, 1e-3)  # drops at the freeze
    outs, _ = _deepspeed_run("deepspeed")
    flat = [np.asarray(g["w"]).reshape(N, -1) for g in DS_GRADS]
    deltas, _ = deepspeed_reference(flat, N, DS_FREEZE, DS_SCALER, True, lrs)
    const, _ = deepspeed_reference(flat, N, DS_FREEZE, DS_SCALER, True, np.full(DS_STEPS, 1e-2))
    got = [-lr * np.asarray(o["w"]).reshape(N, -1)[0] for lr, o in zip(lrs, outs, strict=True)]
    for t in range(DS_FREEZE + 1):  # up to the first frozen step, same rate so far
        np.testing.assert_allclose(got[t], deltas[t], rtol=2e-4)
    # compjax after the drop: the constant-rate trajectory scaled by the new rate.
    for t in range(DS_FREEZE + 1, DS_STEPS):
        np.testing.assert_allclose(got[t], const[t] / 10, rtol=2e-4)
    differs = [not np.allclose(got[t], deltas[t], rtol=1e-2) for t in range(DS_STEPS)]
    assert any(differs[DS_FREEZE + 1 :])
