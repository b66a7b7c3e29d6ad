"""Transformations in training: convergence, composition with optax and flax, checkpoints."""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from test_transforms import PARAMS, assert_trees_close, run_vmap, worker_grads

import compjax

# A heterogeneous least-squares problem: 4 workers, 50 rows each, d = 20.
N, M, D = 4, 50, 20
_rng = np.random.default_rng(0)
A = jnp.asarray(_rng.standard_normal((N, M, D)), jnp.float32)
B = jnp.asarray(_rng.standard_normal((N, M)) + np.arange(N)[:, None], jnp.float32)
X_STAR = jnp.linalg.lstsq(A.reshape(-1, D), B.reshape(-1))[0]
L_MAX = max(float(jnp.linalg.eigvalsh(A[i].T @ A[i] / M).max()) for i in range(N))


def local_loss(x, a, b):
    return 0.5 * jnp.mean((a @ x - b) ** 2)


def train(tx, steps, lr):
    """Full-batch training; returns ||x_t - x*||^2 per step and the final state."""
    opt = optax.chain(tx, optax.sgd(lr))

    def worker(a, b):
        def body(carry, _):
            x, state = carry
            upd, state = opt.update(jax.grad(local_loss)(x, a, b), state, x)
            return (optax.apply_updates(x, upd), state), jnp.sum((x - X_STAR) ** 2)

        x0 = jnp.zeros(D)
        (x, state), dist = jax.lax.scan(body, (x0, opt.init(x0)), None, length=steps)
        return dist, x, state

    return jax.jit(jax.vmap(worker, axis_name="data"))(A, B)


def local_gradients_at_optimum():
    return jax.vmap(jax.grad(local_loss), in_axes=(None, 0, 0))(X_STAR, A, B)


def test_diana_converges_linearly_where_compressed_gd_stalls():
    comp = compjax.rand_k(k=2)  # omega = 9
    lr = 1.0 / (L_MAX * (1 + 2 * comp.omega(D) / N))
    dist, _, state = train(compjax.diana(comp, "data"), 1000, lr)
    stalled, _, _ = train(compjax.compress(comp, "data"), 1000, lr)
    assert dist[0, -1] < 1e-9 < 1e-3 < stalled[0, -1]
    # The local shifts learn the local gradients at the optimum.
    shifts = state[0].local_shift[:, 0]
    np.testing.assert_allclose(shifts, local_gradients_at_optimum(), atol=1e-4)
    np.testing.assert_allclose(state[0].shift[0], 0.0, atol=1e-4)


def test_ef21_converges_with_top_k():
    dist, _, state = train(compjax.ef21(compjax.top_k(k=2), "data"), 1000, 0.5 / L_MAX)
    assert dist[0, -1] < 1e-9
    np.testing.assert_allclose(state[0].local[:, 0], local_gradients_at_optimum(), atol=1e-4)


@pytest.mark.parametrize(
    "opt",
    [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9), optax.adam(0.01)],
    ids=["sgd", "momentum", "adam"],
)
def test_chain_with_optax_optimizers(opt):
    """Lossless compression chained into an optimizer equals the optimizer on the mean."""
    tx = optax.chain(compjax.compress(compjax.identity(), "data"), opt)
    grads = [worker_grads(4, t) for t in range(3)]
    outs, _ = run_vmap(tx, grads, 4)
    state = opt.init(PARAMS)
    for g, out in zip(grads, outs, strict=True):
        expect, state = opt.update(jax.tree.map(lambda x: x.mean(0), g), state, PARAMS)
        assert_trees_close(out, expect, rtol=1e-5, atol=1e-7)


def test_inject_hyperparams_schedules_diana_alpha():
    comp = compjax.qsgd(2)
    injected = optax.inject_hyperparams(compjax.diana, static_args=("comp", "axis_name"))
    grads = [worker_grads(4, t) for t in range(3)]
    constant, _ = run_vmap(injected(comp=comp, axis_name="data", alpha=0.5), grads, 4)
    plain, _ = run_vmap(compjax.diana(comp, "data", alpha=0.5), grads, 4)
    assert_trees_close(constant, plain, rtol=0, atol=0)
    schedule = optax.linear_schedule(0.5, 0.1, transition_steps=2)
    _, state = run_vmap(injected(comp=comp, axis_name="data", alpha=schedule), grads, 4)
    np.testing.assert_allclose(state.hyperparams["alpha"][0], 0.1)


def test_multisteps_accumulates_before_compressing():
    inner = compjax.error_feedback(compjax.top_k(k=3), "data")
    grads = [worker_grads(4, t) for t in range(4)]
    outs, state = run_vmap(optax.MultiSteps(inner, every_k_schedule=2), grads, 4)
    mean_pairs = [
        jax.tree.map(lambda a, b: (a + b) / 2, grads[0], grads[1]),
        jax.tree.map(lambda a, b: (a + b) / 2, grads[2], grads[3]),
    ]
    direct, direct_state = run_vmap(inner, mean_pairs, 4)
    assert_trees_close(outs[1], direct[0])
    assert_trees_close(outs[3], direct[1])
    assert_trees_close(state.inner_opt_state.error, direct_state.error)


def _with_nan(grads):
    return jax.tree.map(lambda g: g.at[1, 0].set(jnp.nan), grads)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: compjax.error_feedback(compjax.top_k(k=3), "data"), marks=pytest.mark.slow
        ),
        lambda: compjax.diana(compjax.qsgd(2), "data"),
        pytest.param(lambda: compjax.ef21(compjax.top_k(k=3), "data"), marks=pytest.mark.slow),
        pytest.param(
            lambda: compjax.sign_majority_vote("data", momentum=0.9), marks=pytest.mark.slow
        ),
    ],
)
def test_non_finite_gradient_leaves_state_untouched(make):
    tx = make()
    before = [worker_grads(4, t) for t in range(2)]
    _, state = run_vmap(tx, before, 4)
    out, after = run_vmap(tx, [*before, _with_nan(worker_grads(4, 2))], 4)
    # The step shows the problem (non-finite update) but keeps every worker's state.
    assert not all(np.all(np.isfinite(u)) for u in jax.tree.leaves(out[-1]))
    assert_trees_close(after, state, rtol=0, atol=0)
    # With apply_if_finite on the optimizer that follows, every worker skips the step.
    chained = optax.chain(tx, optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3))
    _, clean = run_vmap(chained, before, 4)
    out, after = run_vmap(chained, [*before, _with_nan(worker_grads(4, 2))], 4)
    assert all(np.all(u == 0) for u in jax.tree.leaves(out[-1]))
    assert_trees_close(after[0], clean[0], rtol=0, atol=0)
    # Wrapping the compjax transformation itself works when every worker sees the
    # Inf/NaN (apply_if_finite checks each worker's own input, before any exchange).
    wrapped = optax.apply_if_finite(tx, max_consecutive_errors=3)
    _, clean = run_vmap(wrapped, before, 4)
    everywhere = jax.tree.map(lambda g: g.at[:, 0].set(jnp.inf), worker_grads(4, 2))
    out, after = run_vmap(wrapped, [*before, everywhere], 4)
    assert all(np.all(u == 0) for u in jax.tree.leaves(out[-1]))
    assert_trees_close(after.inner_state, clean.inner_state, rtol=0, atol=0)


def test_flax_train_state():
    tx = optax.chain(compjax.error_feedback(compjax.top_k(k=3), "data"), optax.sgd(0.1))

    def step(grads):
        state = TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
        state = state.apply_gradients(grads=grads)
        return state.apply_gradients(grads=grads).params

    params = jax.jit(jax.vmap(step, axis_name="data"))(worker_grads(4))
    outs, _ = run_vmap(tx, [worker_grads(4)] * 2, 4)
    expect = jax.tree.map(lambda p, a, b: p + a + b, PARAMS, *outs)
    assert_trees_close(jax.tree.map(lambda p: p[0], params), expect)


@pytest.mark.parametrize(
    "make",
    [
        lambda: compjax.error_feedback(compjax.top_k(k=3), "data"),
        lambda: compjax.diana(compjax.natural(), "data"),
        lambda: compjax.ef21(compjax.top_k(k=3), "data"),
    ],
)
def test_checkpoint_restore_continues_bit_identically(make):
    tx = optax.chain(make(), optax.adam(0.01))
    grads = [worker_grads(4, t) for t in range(6)]
    uninterrupted, _ = run_vmap(tx, grads, 4)
    _, mid = run_vmap(tx, grads[:3], 4)
    blob = flax.serialization.to_bytes(mid)
    template = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(4))
    restored = flax.serialization.from_bytes(template, blob)
    assert_trees_close(restored, mid, rtol=0, atol=0)
    state = restored
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    for t in range(3, 6):
        upd, state = step(grads[t], state)
        assert_trees_close(jax.tree.map(lambda u: u[0], upd), uninterrupted[t], rtol=0, atol=0)
