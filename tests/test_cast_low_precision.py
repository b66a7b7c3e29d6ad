"""cast to float8_e4m3fn and float4_e2m1fn: rounding, saturation, non-finite entries, the
wire (one byte, or two 4-bit codes per byte) and DiLoCo outer gradients sent in 4 bits."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import roundtrip

import compjax

LOW = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float4_e2m1fn": ml_dtypes.float4_e2m1fn}
KEY = jax.random.key(0)
SHAPE = (61,)  # odd: the last byte of float4 codes holds one code


def values(seed, scale):
    rng = np.random.default_rng(seed)
    signs = np.where(rng.random(SHAPE) < 0.5, -1.0, 1.0)
    return (signs * scale * 2.0 ** rng.uniform(0, 1, SHAPE)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(LOW))
def test_rounding_matches_the_format_and_saturates(name):
    comp = compjax.cast(name)
    info = ml_dtypes.finfo(LOW[name])
    u = 2.0 ** -(info.nmant + 1)
    tiny, big = float(info.smallest_normal), float(info.max)
    # Normal values, from the smallest normal to the largest finite value, then beyond.
    normal = np.concatenate([values(0, tiny)[:30], values(1, big / 2)[:31]])
    over = np.array([1.01 * big, -1.5 * big, 1e30, -3e38] * 15 + [big], np.float32)
    payload, y = roundtrip(comp, KEY, jnp.asarray(normal))
    wire = 61 * 8 if name.startswith("float8") else 8 * 32  # 61 4-bit codes in 8 words
    assert compjax.wire_bits(payload) == comp.bits(SHAPE) == wire
    y = np.asarray(y)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, normal.astype(LOW[name]).astype(np.float32))
    assert np.all(np.abs(y - normal) <= u * np.abs(normal))
    assert np.max(np.abs(y - normal) / np.abs(normal)) > u / 4  # the bound is not vacuous
    _, y = roundtrip(comp, KEY, jnp.asarray(over))
    np.testing.assert_array_equal(np.asarray(y), np.sign(over) * big)


@pytest.mark.parametrize("name", sorted(LOW))
def test_non_finite_entries_decode_as_nan_and_zeros_as_zero(name):
    comp = compjax.cast(name)
    x = np.zeros(SHAPE, np.float32)
    x[:5] = [np.nan, np.inf, -np.inf, -0.0, 1.0]
    _, y = roundtrip(comp, KEY, jnp.asarray(x))
    y = np.asarray(y)
    assert np.isnan(y[:3]).all()
    np.testing.assert_array_equal(y[3:], x[3:])


def test_wire_bits_count_4_bits_per_float4_entry():
    comp = compjax.cast("float4_e2m1fn")
    for shape in [(), (0,), (1,), (7,), (8,), (3, 5)]:
        payload = jax.eval_shape(comp.compress, KEY, jax.ShapeDtypeStruct(shape, jnp.float32))
        n = int(np.prod(shape))
        assert compjax.wire_bits(payload) == comp.bits(shape) == 32 * -(-n // 8), shape
        assert payload.wire["codes"].dtype == jnp.uint32  # 8 codes to a word
    payload = jax.eval_shape(
        compjax.cast("float8_e4m3fn").compress, KEY, jax.ShapeDtypeStruct((7,), jnp.bfloat16)
    )
    assert compjax.wire_bits(payload) == 56
    assert not comp.linear and not comp.unbiased and compjax.cast("bfloat16").linear
    assert comp.delta(10) == 1 - 2.0**-4


N, LR = 4, 1.0  # a large inner step: outer gradients of order 1, float4's range
P0 = {"w": np.linspace(-0.5, 0.5, 6, dtype=np.float32).reshape(3, 2)}
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(2, N, 4, 3)).astype(np.float32)
Y = _RNG.normal(size=(2, N, 4, 2)).astype(np.float32)


def loss(p, x, y):
    return jnp.mean((x @ p["w"] - y) ** 2)


@functools.cache
def diloco_float4():
    """One DiLoCo round (H = 2, FedAvg outer step) with outer gradients sent as float4."""
    tx = compjax.diloco(
        optax.sgd(LR), optax.sgd(1.0), 2, "data", compressor=compjax.cast("float4_e2m1fn")
    )

    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    init = jax.jit(jax.vmap(lambda _: tx.init(P0)))
    return init, jax.jit(jax.vmap(step, axis_name="data"))


def test_diloco_sends_float4_outer_gradients_with_error_feedback():
    init, step = diloco_float4()
    params, state = compjax.worker_copies(P0, N), init(jnp.arange(N))
    local = {"w": np.asarray(params["w"])}
    for t in range(2):
        params, state, grads = step(params, state, X[t], Y[t])
        local = {"w": local["w"] + np.float32(-LR) * np.asarray(grads["w"])}
    delta = P0["w"] - local["w"]
    sent = delta - np.asarray(state.error["w"][:, 0])  # error feedback: e_new = delta - sent
    np.testing.assert_allclose(sent, delta.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert len(np.unique(np.abs(sent))) <= 8 and np.abs(sent).max() > 0  # float4 grid values
    theta = compjax.global_params(state, stacked=True)["w"]
    np.testing.assert_allclose(theta, np.broadcast_to(P0["w"] - sent.mean(0), theta.shape), 1e-6)
