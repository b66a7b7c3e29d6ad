"""compjax.data_parallel: the compressed step for jax.jit users, on ordinary sharded arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding

import compjax

P = jax.P
N = 8
W0 = {"w": jnp.linspace(-0.3, 0.3, 18).reshape(6, 3), "b": jnp.zeros(3)}


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def batches(steps=3):
    for t in range(steps):
        yield (
            jax.random.normal(jax.random.key(2 * t), (32, 6)),
            jax.random.normal(jax.random.key(2 * t + 1), (32, 3)),
        )


def pooled_sgd():
    w = W0
    for x, y in batches():
        w = jax.tree.map(lambda a, g: a - 0.1 * g, w, jax.grad(loss)(w, x, y))
    return w


@pytest.mark.parametrize("axis_types", [None, (AxisType.Explicit,)], ids=["auto", "explicit"])
def test_lossless_step_on_jit_sharded_arrays_is_pooled_sgd(axis_types):
    kwargs = {} if axis_types is None else {"axis_types": axis_types}
    mesh = jax.make_mesh((N,), ("data",), **kwargs)
    opt = optax.chain(compjax.compress(compjax.identity(), "data"), optax.sgd(0.1))
    dp = compjax.data_parallel(loss, opt, W0, mesh)
    params = jax.device_put(W0, NamedSharding(mesh, P()))
    state = dp.init(params)
    shard = NamedSharding(mesh, P("data"))
    for x, y in batches():
        x, y = jax.device_put(x, shard), jax.device_put(y, shard)
        params, state, value = dp.step(params, state, x, y)
    assert np.isfinite(float(value))
    want = pooled_sgd()
    for key in W0:
        np.testing.assert_allclose(params[key], want[key], atol=1e-6)


def test_a_loss_reduced_over_the_workers_is_refused():
    """``pmean`` inside the loss: each worker's gradient would be 1/n of its own (a step of
    0.125x pooled SGD at 8 workers), silently; the step refuses it and names the fix."""
    mesh = jax.make_mesh((N,), ("data",))
    opt = optax.chain(compjax.compress(compjax.identity(), "data"), optax.sgd(0.1))
    reduced = lambda p, x, y: jax.lax.pmean(loss(p, x, y), "data")  # noqa: E731
    dp = compjax.data_parallel(reduced, opt, W0, mesh)
    x, y = next(batches())
    with pytest.raises(ValueError, match=r"loss does not vary over axis 'data'.*local loss"):
        dp.step(W0, dp.init(W0), x, y)


def test_compressed_step_sends_what_communication_reports():
    mesh = jax.make_mesh((N,), ("data",))
    opt = optax.chain(compjax.error_feedback(compjax.top_k(ratio=0.3), "data"), optax.sgd(0.1))
    dp = compjax.data_parallel(loss, opt, W0, mesh)
    assert dp.specs[0].error == {"w": P("data"), "b": P("data")}
    state = dp.init(W0)
    assert state[0].error["w"].shape == (N, 6, 3)  # one memory per worker
    x, y = next(batches())
    _, state, _ = dp.step(W0, state, x, y)  # unsharded inputs are resharded by jit
    assert np.abs(np.asarray(state[0].error["w"])).max() > 0  # top-k kept a residual
    report = compjax.communication(opt, W0, mesh=mesh)  # the worker count from the mesh
    assert report.axis_sizes == (("data", N),)
    # 30% top-k all-gathered to 7 others sends more than a ring all-reduce of the gradient
    assert report.compression_ratio < 1


def test_an_axis_that_is_not_in_the_mesh_raises():
    mesh = jax.make_mesh((N,), ("batch",))
    opt = compjax.compress(compjax.identity(), "data")
    with pytest.raises(ValueError, match="axis_name 'data' is not an axis"):
        compjax.data_parallel(loss, opt, W0, mesh)
