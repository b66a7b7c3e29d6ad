"""Model-sharded parameters: a ("data", "model") mesh, kernels split over "model",
compression over "data" only.  With a lossless compressor the step is pooled SGD."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import compjax

P = jax.P
MESH = (4, 2)
PARAM_SPECS = {"w": P(None, "model"), "b": P("model")}
W0 = {"w": jnp.linspace(-0.3, 0.3, 24).reshape(6, 4), "b": jnp.zeros(4)}

LOSSLESS = {
    "compress": lambda: compjax.compress(compjax.identity(), "data"),
    "error_feedback": lambda: compjax.error_feedback(compjax.identity(), "data"),
    "ef21": lambda: compjax.ef21(compjax.identity(), "data"),
    "diana": lambda: compjax.diana(compjax.identity(), "data"),
    "compress(scatter_gather)": lambda: compjax.compress(
        compjax.identity(), "data", exchange="scatter_gather"
    ),
}
LOSSY = {
    "compress(qsgd)": lambda: compjax.compress(compjax.qsgd(levels=4), "data"),
    "error_feedback(top_k)": lambda: compjax.error_feedback(compjax.top_k(ratio=0.5), "data"),
    "diana(qsgd, scatter_gather)": lambda: compjax.diana(
        compjax.qsgd(levels=4), "data", exchange="scatter_gather"
    ),
}


def loss(p, x, y):
    """Mean squared error of a column-parallel linear layer (columns split over "model")."""
    local = jnp.sum((x @ p["w"] + p["b"] - y) ** 2)
    return jax.lax.psum(local, "model") / (x.shape[0] * 4)


def train(tx, steps=3):
    mesh = jax.make_mesh(MESH, ("data", "model"))
    opt = optax.chain(tx, optax.sgd(0.1))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    params = jax.tree.map(put, W0, PARAM_SPECS)
    specs = compjax.state_specs(jax.eval_shape(opt.init, params), "data", PARAM_SPECS)

    def step(p, s, x, y):
        g = jax.grad(loss)(compjax.worker_params(p, "data"), x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=(PARAM_SPECS,), out_specs=specs))
    run = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(PARAM_SPECS, specs, P("data"), P("data", "model")),
            out_specs=(PARAM_SPECS, specs),
        )
    )
    state = init(params)
    for t in range(steps):
        x = jax.random.normal(jax.random.key(2 * t), (16, 6))
        y = jax.random.normal(jax.random.key(2 * t + 1), (16, 4))
        params, state = run(params, state, put(x, P("data")), put(y, P("data", "model")))
        yield x, y, params, state


def pooled_loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def pooled_sgd(batches):
    w = W0
    for x, y in batches:
        w = jax.tree.map(lambda a, b: a - 0.1 * b, w, jax.grad(pooled_loss)(w, x, y))
    return w


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_lossless_step_on_a_model_sharded_mesh_is_pooled_sgd(name):
    runs = list(train(LOSSLESS[name]()))
    params = runs[-1][2]
    want = pooled_sgd([(x, y) for x, y, _, _ in runs])
    for key in W0:
        np.testing.assert_allclose(params[key], want[key], atol=1e-6)


@pytest.mark.parametrize(
    "name",  # (the scatter-gather case: with -m slow; test_model_sharded_all runs every exchange)
    [n if "scatter_gather" not in n else pytest.param(n, marks=pytest.mark.slow) for n in LOSSY],
)
def test_lossy_steps_run_and_state_follows_the_params_sharding(name):
    runs = list(train(LOSSY[name]()))
    for _, _, params, _ in runs:
        assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(params))
    state = runs[-1][3]
    memories = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda n: hasattr(n, "PER_WORKER"))
        if hasattr(s, "PER_WORKER")
    ]
    assert memories
    for node in memories:
        for field in node.PER_WORKER:
            value = getattr(node, field)
            if isinstance(value, dict):  # laid out like the params: worker axis, then "model"
                assert value["w"].shape == (4, 6, 4)
                assert value["w"].sharding.spec == P("data", None, "model")


def test_state_specs_follow_the_params_specs():
    tx = compjax.diana(compjax.qsgd(levels=4), "data")
    specs = compjax.state_specs(jax.eval_shape(tx.init, W0), "data", PARAM_SPECS)
    assert specs.local_shift == {"w": P("data", None, "model"), "b": P("data", "model")}
    assert specs.shift == PARAM_SPECS  # shared across workers, sharded like the params
    assert specs.key == P()
    plain = compjax.state_specs(jax.eval_shape(tx.init, W0), "data")
    assert plain.local_shift == {"w": P("data"), "b": P("data")}
