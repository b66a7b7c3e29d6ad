"""Flax NNX: nnx.Optimizer with compjax state under shard_map, state_specs through nnx.State."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import compjax

P = jax.P
N = 8
LR = 0.1


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def batches(steps=3):
    for t in range(steps):
        yield (
            jax.random.normal(jax.random.key(2 * t), (32, 6)),
            jax.random.normal(jax.random.key(2 * t + 1), (32, 3)),
        )


def mesh():
    return jax.make_mesh((N,), ("data",))


def nnx_train(tx):
    """Three steps of the docs' NNX recipe; the final params and the optimizer state."""
    model = MLP(nnx.Rngs(0))
    optimizer = compjax.nnx.optimizer(model, tx, mesh(), "data", wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    specs = compjax.state_specs(state, "data")

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh(),
        in_specs=(specs, P("data"), P("data")),
        out_specs=(specs, P()),
    )
    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = compjax.nnx.value_and_grad(loss_fn, "data")(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), jax.lax.pmean(loss, "data")

    shard = jax.NamedSharding(mesh(), P("data"))
    for x, y in batches():
        state, loss = step(state, jax.device_put(x, shard), jax.device_put(y, shard))
    assert np.isfinite(float(loss))
    model, optimizer = nnx.merge(graphdef, state)
    return nnx.as_pure(nnx.state(model, nnx.Param)), optimizer


def functional_train(tx):
    """The same steps on the params pytree with the plain shard_map recipe (no NNX optimizer)."""
    graphdef, params, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)
    params = nnx.as_pure(params)

    def pure_loss(p, x, y):
        return loss_fn(nnx.merge(graphdef, p, rest), x, y)

    dp = compjax.data_parallel(pure_loss, tx, params, mesh())
    state = dp.init(params)
    for x, y in batches():
        params, state, _ = dp.step(params, state, x, y)
    return params


def pooled_sgd():
    model = MLP(nnx.Rngs(0))
    for x, y in batches():
        grads = nnx.grad(loss_fn)(model, x, y)
        nnx.update(model, jax.tree.map(lambda p, g: p - LR * g, nnx.state(model, nnx.Param), grads))
    return nnx.as_pure(nnx.state(model, nnx.Param))


def assert_trees_close(got, want, atol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=atol)


LOSSLESS = {
    "compress": lambda: compjax.compress(compjax.identity(), "data"),
    "error_feedback": lambda: compjax.error_feedback(compjax.identity(), "data"),
    "ef21": lambda: compjax.ef21(compjax.identity(), "data"),
    "diana": lambda: compjax.diana(compjax.identity(), "data"),
}


@pytest.mark.parametrize(
    "name",
    [
        n if n in ("compress", "diana") else pytest.param(n, marks=pytest.mark.slow)
        for n in LOSSLESS
    ],
)
def test_nnx_optimizer_with_a_lossless_compressor_is_pooled_sgd(name):
    params, _ = nnx_train(optax.chain(LOSSLESS[name](), optax.sgd(LR)))
    assert_trees_close(params, pooled_sgd(), atol=1e-6)


LOSSY = {
    "ef_top_k": lambda: compjax.error_feedback(compjax.top_k(ratio=0.3), "data"),
    "diana_qsgd": lambda: compjax.diana(compjax.qsgd(levels=2), "data"),
    "dgc": lambda: compjax.dgc("data", 0.2),
    "powersgd": lambda: compjax.powersgd(rank=1, axis_name="data"),
}


@pytest.mark.parametrize(
    "name",
    [n if n == "ef_top_k" else pytest.param(n, marks=pytest.mark.slow) for n in LOSSY],
)
def test_nnx_optimizer_trains_like_the_functional_step(name):
    """Any transformation (stochastic, stateful, low rank) gives the pytree step's result."""
    tx = optax.chain(LOSSY[name](), optax.sgd(LR))
    params, optimizer = nnx_train(tx)
    assert_trees_close(params, functional_train(tx), atol=1e-6)
    assert optimizer.step[...] == 3


def test_per_worker_state_has_every_workers_slice_and_its_spec():
    tx = optax.chain(compjax.error_feedback(compjax.top_k(ratio=0.3), "data"), optax.sgd(LR))
    _, optimizer = nnx_train(tx)
    error = optimizer.opt_state[0].error
    assert error["hidden"]["kernel"].shape == (N, 6, 8)  # not (1, 6, 8): init ran per worker
    assert np.abs(np.asarray(error["hidden"]["kernel"][...])).max() > 0  # top-k kept residuals
    specs = compjax.state_specs(nnx.state(optimizer), "data")
    assert specs["opt_state"][0]["error"]["out"]["bias"] == P("data")
    assert specs["opt_state"][0]["key"] == P()
    assert specs["step"] == P()


def test_state_specs_refuses_an_nnx_optimizer_built_directly():
    """Its markers are lost inside nnx.State: a clear error, not P() everywhere."""
    tx = compjax.error_feedback(compjax.top_k(ratio=0.3), "data")
    optimizer = nnx.Optimizer(MLP(nnx.Rngs(0)), tx, wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"compjax\.nnx\.optimizer"):
        compjax.state_specs(nnx.state(optimizer), "data")


def test_nnx_grad_without_worker_copy_is_refused():
    """nnx.grad of the replicated model is the reduced gradient: compjax names the fix."""
    model = MLP(nnx.Rngs(0))
    tx = compjax.compress(compjax.identity(), "data")
    optimizer = compjax.nnx.optimizer(model, tx, mesh(), "data", wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    specs = compjax.state_specs(state, "data")

    @jax.jit  # one program, not op by op
    @partial(jax.shard_map, mesh=mesh(), in_specs=(specs, P("data"), P("data")), out_specs=specs)
    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, nnx.grad(loss_fn)(model, x, y))
        return nnx.state((model, optimizer))

    shard = jax.NamedSharding(mesh(), P("data"))
    # The message names both fixes: worker_params, and for NNX compjax.nnx.value_and_grad.
    with pytest.raises(ValueError, match=r"worker_params.*compjax\.nnx\.value_and_grad"):
        step(state, *(jax.device_put(a, shard) for a in next(batches())))


@pytest.mark.parametrize("has_aux", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_loss_reduced_over_the_workers_is_refused(has_aux):
    """A pmean inside the loss would make each worker's gradient 1/n of its own, silently."""
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def pmean_loss(m, x, y):
        loss = jax.lax.pmean(loss_fn(m, x, y), "data")
        return (loss, jnp.sum(x)) if has_aux else loss

    @jax.jit  # one program, not op by op
    @partial(jax.shard_map, mesh=mesh(), in_specs=(P(), P("data"), P("data")), out_specs=P())
    def run(state, x, y):
        model = nnx.merge(graphdef, state)
        compjax.nnx.value_and_grad(pmean_loss, "data", has_aux=has_aux)(model, x, y)
        return nnx.state(model)

    shard = jax.NamedSharding(mesh(), P("data"))
    with pytest.raises(ValueError, match=r"loss does not vary over axis 'data'.*local loss"):
        run(state, *(jax.device_put(a, shard) for a in next(batches())))


def test_value_and_grad_restores_the_shared_params_and_reports_aux():
    model = MLP(nnx.Rngs(0))
    graphdef, before = nnx.split(model)

    def with_aux(m, x, y):
        return loss_fn(m, x, y), jnp.sum(x)

    @jax.jit  # one program, not op by op
    @partial(jax.shard_map, mesh=mesh(), in_specs=(P(), P("data"), P("data")), out_specs=P())
    def run(state, x, y):
        model = nnx.merge(graphdef, state)
        (loss, aux), grads = compjax.nnx.value_and_grad(with_aux, "data", has_aux=True)(model, x, y)
        # This worker's own gradient; the model holds the shared (unvarying) params again,
        # which out_specs=P() of the returned state also requires.
        assert "data" in jax.typeof(grads["out"]["kernel"][...]).manual_axis_type.varying
        return nnx.state(model), jax.lax.pmean(loss, "data"), jax.lax.psum(aux, "data")

    x, y = next(batches())
    shard = jax.NamedSharding(mesh(), P("data"))
    after, loss, aux = run(before, jax.device_put(x, shard), jax.device_put(y, shard))
    np.testing.assert_allclose(loss, loss_fn(model, x, y), rtol=1e-6)
    np.testing.assert_allclose(aux, jnp.sum(x), rtol=1e-5)
    assert_trees_close(after, before, atol=0)


def test_optimizer_rejects_an_axis_not_in_the_mesh():
    with pytest.raises(ValueError, match="axis_name 'batch'"):
        compjax.nnx.optimizer(
            MLP(nnx.Rngs(0)), compjax.compress(compjax.identity(), "batch"), mesh(), "batch"
        )
