"""optax.MultiSteps around compjax under shard_map and pmap: each worker accumulates its own
gradients, one compressed exchange every k steps, equal to pooled SGD with accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import compjax

P = jax.P
N, K, LR = 8, 2, 0.1
PARAMS = {"w": jnp.ones((6, 3)) * 0.1, "b": jnp.zeros(3)}


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def batches():
    keys = jax.random.split(jax.random.key(0), 2 * K)
    return [
        (jax.random.normal(keys[2 * t], (16, 6)), jax.random.normal(keys[2 * t + 1], (16, 3)))
        for t in range(K)
    ]


def pooled():
    """SGD on the mean over the K batches of the pooled gradient."""
    grads = [jax.grad(loss)(PARAMS, x, y) for x, y in batches()]
    mean = jax.tree.map(lambda *g: sum(g) / K, *grads)
    return jax.tree.map(lambda p, g: p - LR * g, PARAMS, mean)


def opt():
    inner = optax.chain(compjax.compress(compjax.identity(), "data"), optax.sgd(LR))
    return optax.MultiSteps(inner, K)


def test_state_specs_split_the_accumulated_gradients():
    specs = compjax.state_specs(jax.eval_shape(opt().init, PARAMS), "data")
    assert specs.acc_grads == {"w": P("data"), "b": P("data")}
    assert specs.mini_step == P() and specs.inner_opt_state[0].key == P()
    with pytest.raises(ValueError, match="acc_grads"):
        compjax.state_specs(jax.eval_shape(opt().init, {"s": jnp.zeros(())}), "data")


def test_multisteps_under_shard_map_is_pooled_sgd_with_accumulation():
    mesh = jax.make_mesh((N,), ("data",))
    tx = opt()
    specs = compjax.state_specs(jax.eval_shape(tx.init, PARAMS), "data")

    def step(p, s, x, y):
        g = jax.grad(loss)(compjax.worker_params(p, "data"), x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)
        )
    )
    p, s = PARAMS, init(PARAMS)
    shard = NamedSharding(mesh, P("data"))
    for x, y in batches():
        p, s = run(p, s, jax.device_put(x, shard), jax.device_put(y, shard))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(pooled()), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_multisteps_under_pmap_is_pooled_sgd_with_accumulation():
    tx = opt()
    n = jax.device_count()

    def step(p, s, x, y):
        u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    run = jax.pmap(step, axis_name="data")
    p = jax.tree.map(lambda a: jnp.stack([a] * n), PARAMS)
    s = jax.pmap(tx.init)(p)
    for x, y in batches():
        p, s = run(p, s, x.reshape(n, -1, 6), y.reshape(n, -1, 3))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(pooled()), strict=True):
        np.testing.assert_allclose(a[0], b, atol=1e-6)
