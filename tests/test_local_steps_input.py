"""compjax.local_steps and the local-step transformations on bad input: params not stacked per
worker at ``step``, stacked params at ``init``, and float64 params (``jax_enable_x64``), each a
ValueError that says what to pass instead, before anything is traced deep."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax

N = 4
# A small MLP; w1's leading axis is the number of workers, so that its unstacked leaf splits
# over the mesh without a sharding error (the case that failed deep inside the loss).
PARAMS = {
    "w1": jnp.linspace(-0.2, 0.2, 4 * 8).reshape(4, 8),
    "b1": jnp.zeros(8),
    "w2": jnp.linspace(-0.1, 0.1, 8 * 2).reshape(8, 2),
}
X, Y = np.ones((16, 4), np.float32), np.ones((16, 2), np.float32)
ADVICE = "cast the params to float32 (jax.tree.map(lambda p: p.astype(jnp.float32), params))"


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def mesh():
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def optimizers():
    return {
        "diloco": compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, "data"),
        "streaming_diloco": compjax.streaming_diloco(
            optax.sgd(0.1), optax.sgd(1.0), 2, "data", fragments=2
        ),
        "zero_one_adam": compjax.zero_one_adam(
            0.01, "data", 4, local_step_clipper=4, exchange="all_gather"
        ),
    }


@pytest.mark.parametrize("name", ["diloco", "zero_one_adam"])
def test_unstacked_params_at_step_are_refused_naming_the_fix(name):
    train = compjax.local_steps(mlp_loss, optimizers()[name], PARAMS, mesh())
    local, state = train.init(PARAMS)
    with pytest.raises(ValueError) as err:
        train.step(PARAMS, state, X, Y)  # the replicated params, not the workers' copies
    message = str(err.value)
    for words in ("'data'", "size 4", "init(params)", "compjax.worker_copies(params, 4)"):
        assert words in message, words
    own = r"local\['b1'\] of shape \(8,\) \(the replicated params' own shape\) where \(4, 8\)"
    assert re.search(own, message), message
    if name != "diloco":
        return
    # The copies init returns (or worker_copies gives) are taken.
    local, state, loss = train.step(compjax.worker_copies(PARAMS, N), state, X, Y)
    assert np.isfinite(float(loss)) and local["w1"].shape == (N, 4, 8)


def test_other_copies_and_trees_at_step_and_init_are_refused():
    train = compjax.local_steps(mlp_loss, optimizers()["diloco"], PARAMS, mesh())
    local, state = train.init(PARAMS)
    with pytest.raises(ValueError, match=r"of shape \(8, 8\) where \(4, 8\) is needed"):
        train.step(compjax.worker_copies(PARAMS, 8), state, X, Y)
    with pytest.raises(ValueError, match="structure"):
        train.step({"w1": local["w1"]}, state, X, Y)
    with pytest.raises(ValueError, match="init takes the replicated params"):
        train.init(local)  # already stacked


@pytest.mark.parametrize("name", ["diloco", "streaming_diloco", "zero_one_adam"])
def test_float64_params_are_refused_at_construction_and_init(name):
    opt = optimizers()[name]
    f64 = {**PARAMS, "w2": jax.ShapeDtypeStruct((8, 2), jnp.float64)}
    with pytest.raises(ValueError, match=re.escape("got float64 at params['w2']")) as err:
        compjax.local_steps(mlp_loss, opt, f64, mesh())
    message = str(err.value)
    assert ADVICE in message and "jax_enable_x64" in message
    assert "cast the gradients" not in message  # local_steps takes params, not gradients
    train = compjax.local_steps(mlp_loss, opt, PARAMS, mesh())
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), PARAMS)
        assert wide["w1"].dtype == jnp.float64
        with pytest.raises(ValueError, match=re.escape(ADVICE)):
            train.init(wide)
        # The transformation itself refuses them when its state is built, under any map.
        with pytest.raises(ValueError, match=re.escape("before init, or disable jax_enable_x64")):
            jax.vmap(lambda _: opt.init(wide))(jnp.arange(N))
