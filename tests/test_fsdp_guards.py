"""compjax.fsdp's guards: float64 params refused up front, skipped steps shown by the loss."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax

N = 8
MIN_SIZE = 64
W0 = {"w": jnp.linspace(-0.3, 0.3, 96).reshape(16, 6), "b": jnp.linspace(0.0, 0.1, 6)}
ADVICE = "cast the params to float32 (jax.tree.map(lambda p: p.astype(jnp.float32), params))"


def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def test_float64_params_are_refused_at_construction():
    mesh = jax.make_mesh((N,), ("data",))
    f64 = {"w": jax.ShapeDtypeStruct((16, 6), jnp.float64), "b": W0["b"]}
    with pytest.raises(ValueError, match=r"float64 parameter of shape \(16, 6\)") as err:
        compjax.fsdp(loss, optax.sgd(0.1), f64, mesh, min_size=MIN_SIZE)
    assert ADVICE in str(err.value) and "jax_enable_x64" in str(err.value)
    assert "gradients" not in str(err.value)


def test_float64_params_are_refused_at_init_and_step():
    mesh = jax.make_mesh((N,), ("data",))
    fs = compjax.fsdp(loss, optax.sgd(0.1), W0, mesh, min_size=MIN_SIZE)
    with jax.enable_x64(True):
        f64 = jax.tree.map(lambda a: a.astype(jnp.float64), W0)
        assert f64["w"].dtype == jnp.float64
        with pytest.raises(ValueError, match=re.escape(ADVICE)):
            fs.init(f64)
        state = fs.init(W0)
        x, y = jnp.ones((16, 16)), jnp.ones((16, 6))
        with pytest.raises(ValueError, match=r"float64 parameter of shape \(6,\)"):
            fs.step({"w": W0["w"], "b": f64["b"]}, state, x, y)


def pushed(p, x):
    """``mean(w^2)`` (its value) plus a term whose value is 0 and whose gradient is the mean
    of the rows of ``x`` (each worker's own gradient, as large as ``x``)."""
    w = p["w"].astype(jnp.float32)
    push = jnp.sum(jnp.mean(x, 0) * (p["w"] - jax.lax.stop_gradient(p["w"])))
    return jnp.mean(w**2) + push.astype(jnp.float32)


@pytest.mark.parametrize(
    "dtype, big",
    # float32: 8 workers' 1e38 sum past float32's 3.4e38; float16: 8 x 2e4 past 65504
    [(jnp.float32, 1e38), (jnp.float16, 2e4)],
    ids=["float32", "float16"],
)
def test_an_overflowing_reduce_scatter_is_skipped_and_the_loss_says_so(dtype, big):
    mesh = jax.make_mesh((N,), ("data",))
    w0 = {"w": W0["w"].astype(dtype)}
    fs = compjax.fsdp(pushed, optax.sgd(0.1), w0, mesh, min_size=MIN_SIZE)
    state = fs.init(w0)
    params, state, value = fs.step(w0, state, jnp.ones((16, 16, 6), dtype))
    assert np.isfinite(float(value))  # a step taken: the loss is mean(w^2)
    np.testing.assert_allclose(float(value), float(jnp.mean(W0["w"] ** 2)), rtol=1e-3)

    x = jnp.full((16, 16, 6), big, dtype)  # every worker's gradient finite, their sum not
    one = jax.grad(pushed)({"w": np.asarray(params["w"])}, np.asarray(x[:2]))["w"]
    assert np.isfinite(np.asarray(one, np.float32)).all()
    new_params, new_state, value = fs.step(params, state, x)
    unchanged = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            jax.tree.leaves((params, state)), jax.tree.leaves((new_params, new_state)), strict=True
        )
    )
    if dtype == jnp.float32:  # float32 sums are not resent pre-scaled: always skipped
        assert unchanged
    # a skipped step (params and state unchanged) shows as a NaN loss, and only a skipped one
    assert np.isnan(float(value)) == unchanged
    if not unchanged:  # an exchange that averaged without overflowing took the step
        np.testing.assert_allclose(
            np.asarray(new_params["w"], np.float32),
            np.asarray(params["w"], np.float32) - 0.1 * big,
            rtol=1e-2,
        )
    # the next ordinary step is taken
    after, _, value = fs.step(new_params, new_state, jnp.ones((16, 16, 6), dtype))
    assert np.isfinite(float(value)) and not np.array_equal(after["w"], new_params["w"])
