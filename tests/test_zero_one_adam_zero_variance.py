"""0/1 Adam where the frozen variance is 0 on some coordinates, in float16, bfloat16 and float32.

A coordinate whose gradient is 0 on every variance step freezes with ``v = 0``; the 1-bit
rounds still give it momentum (the scaled sign sends a zero entry as ``+-scale``), so the
update there is ``lr m / eps``, the reference's ``m / (sqrt(v) + eps)``.  In float32 and
bfloat16 that step is finite and is taken; in float16 it overflows, and the step must then be
refused as every non-finite one is: NaN updates on every worker and the whole state kept.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_zero_one_adam_local import EPS, FREEZE, KINDS, P0, N, X, Y, build, loss

import compjax

LR = 1e-3
STEPS = 7  # variance steps 1, 2, 4, a 1-bit gradient step 3, frozen from 5; step 7 is local
# Feature 0 is silent while the variance adapts: row 0 of w has a zero gradient on every
# variance step, so its variance freezes at 0.
XS = X[:STEPS].copy()
XS[: FREEZE + 1, ..., 0] = 0.0
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
# The float16 case in the fast suite; each local-rounds case compiles its own step (~13 s).
SLOW_WIDE = [jnp.float16] + [pytest.param(d, marks=pytest.mark.slow) for d in DTYPES[1:]]


@functools.cache
def local_rounds(dtype):
    tx = build(lr=LR)
    p0 = jax.tree.map(lambda a: jnp.asarray(a, dtype), P0)

    def step(p, s, x, y):
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s, u

    state = jax.vmap(lambda _: tx.init(p0))(jnp.arange(N))
    return compjax.worker_copies(p0, N), state, jax.jit(jax.vmap(step, axis_name="data"))


def run(dtype):
    """Per step: whether it was refused, the updates, and the state before and after it."""
    params, state, step = local_rounds(dtype)
    out = []
    for t in range(STEPS):
        new_params, new_state, updates = step(params, state, XS[t], Y[t])
        leaves = [np.asarray(u, np.float32) for u in jax.tree.leaves(updates)]
        refused = not all(np.isfinite(u).all() for u in leaves)
        out.append((refused, updates, state, new_state))
        # Keep the params where a step is refused (as compjax.local_steps does).
        params = params if refused else new_params
        state = new_state
    return out


def assert_refused(updates, before, after):
    """NaN in every entry on every worker, the whole state kept bit for bit."""
    for u in jax.tree.leaves(updates):
        assert np.isnan(np.asarray(u, np.float32)).all()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", SLOW_WIDE, ids=lambda d: jnp.dtype(d).name)
def test_local_rounds_with_a_zero_frozen_variance(dtype):
    steps = run(dtype)
    nu = np.asarray(steps[-1][3].nu["w"][0])
    assert (nu[0] == 0).all() and (nu[1:] > 0).all()
    refused = [r for r, *_ in steps]
    for r, updates, before, after in steps:
        if r:
            assert_refused(updates, before, after)
    if dtype == jnp.float16:
        # theta near 1e3 after the 1-bit rounds 3 and 5; from the first frozen step (5) on,
        # the worker's own momentum makes lr m / eps (or theta - params) overflow float16.
        assert refused == [False] * (FREEZE + 1) + [True] * (STEPS - FREEZE - 1)
        return
    assert not any(refused)
    # Step 7, a local step: row 0 moves by -lr m_i / (sqrt(0) + eps), finite, as the reference.
    assert KINDS[STEPS - 1] == "local"
    _, updates, _, after = steps[-1]
    m = np.asarray(after.local_mu["w"][:, 0, 0], np.float32)  # (workers, 8)
    want = (np.float32(-LR) * (m / np.float32(EPS))).astype(dtype)
    got = np.asarray(updates["w"][:, 0])
    assert np.isfinite(np.asarray(got, np.float32)).all() and np.abs(want).min() > 1.0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_synchronising_path_with_a_zero_frozen_variance(dtype):
    """The synchronising 0/1 Adam's direction m / (sqrt(v) + eps) on the same gradients: in
    float16 beyond range, so refused with the state kept; finite in bfloat16 and float32."""
    tx = compjax.scale_by_zero_one_adam("data", FREEZE, 1, exchange="all_gather")
    p0 = jax.tree.map(lambda a: jnp.asarray(a, dtype), P0)

    def step(p, s, x, y):
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, jax.tree.map(lambda a: -LR * a, u)), s, u

    run_step = jax.jit(jax.vmap(step, axis_name="data"))
    params = compjax.worker_copies(p0, N)
    state = jax.vmap(lambda _: tx.init(p0))(jnp.arange(N))
    refused = []
    for t in range(STEPS):
        new_params, new_state, updates = run_step(params, state, XS[t], Y[t])
        leaves = [np.asarray(u, np.float32) for u in jax.tree.leaves(updates)]
        bad = not all(np.isfinite(u).all() for u in leaves)
        if bad:
            assert_refused(updates, state, new_state)
        refused.append(bad)
        params, state = (params if bad else new_params), new_state
    assert any(refused) == (dtype == jnp.float16)
