"""Error feedback's residual ``p - C(p)`` from the worker's own message.

``Compressor.subtract_decoded`` (a sparse message, top-k, random-k or
SparseLoCo's chunked top-k, subtracts its kept entries from ``y``, with no
dense decode) and ``Exchanged.residual`` must give the
very values of ``y - decompress(payload)`` and ``y - local``: bit for bit,
with NaN, infinities, ``-0`` and low-precision messages.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import compjax
from compjax.exchange import Exchanged, compressed_mean

D = 96
COMPRESSORS = {
    "top_k": compjax.top_k(ratio=0.1),
    "top_k threshold": compjax.top_k(ratio=0.1, select="threshold"),
    "rand_k unscaled": compjax.rand_k(ratio=0.1, scaled=False),
    "rand_k shared seed": compjax.rand_k(ratio=0.1, scaled=False, shared_seed=True),
    "rand_k scaled (decodes)": compjax.rand_k(ratio=0.1),
    "chunked_top_k 2-bit": compjax.chunked_top_k(k=3, chunk=40),  # the last chunk padded
    "chunked_top_k float32": compjax.chunked_top_k(k=3, chunk=40, bits=None),
    "scaled_sign (decodes)": compjax.scaled_sign(),
}
DTYPES = {  # (message, y): error feedback sends bf16 gradients and keeps a float32 memory
    "f32": (jnp.float32, jnp.float32),
    "bf16-f32": (jnp.bfloat16, jnp.float32),
    "bf16": (jnp.bfloat16, jnp.bfloat16),
}
VALUES = st.one_of(
    st.floats(-1e4, 1e4, width=32),
    st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38]),
)


def bits(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32)).view(np.uint32)


@functools.cache
def both_ways(name: str, dtypes: str):
    comp = COMPRESSORS[name]
    x_dtype, y_dtype = DTYPES[dtypes]

    def run(x, y):
        payload = comp.compress(jax.random.key(7), x.astype(x_dtype))
        y = y.astype(y_dtype)
        return comp.subtract_decoded(payload, y), y - comp.decompress(payload)

    return jax.jit(run)


@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("name", list(COMPRESSORS))
@given(values=st.lists(VALUES, min_size=D, max_size=D), shift=st.sampled_from([0.0, 1.0, -2.5]))
def test_subtract_decoded_is_the_decoded_message_subtracted(name, dtypes, values, shift):
    x = jnp.asarray(values, jnp.float32)
    got, want = both_ways(name, dtypes)(x, x + shift)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(bits(got), bits(want))


def test_a_sparse_residual_keeps_the_unsent_entries_and_zeroes_the_sent():
    comp = compjax.top_k(k=2)
    y = jnp.array([0.5, -3.0, -0.0, 4.0, 1.0])
    payload = comp.compress(None, y)
    got = comp.subtract_decoded(payload, y)
    np.testing.assert_array_equal(bits(got), bits(jnp.array([0.5, 0.0, -0.0, 0.0, 1.0])))


@pytest.mark.parametrize("exchange", ["all_gather", "scatter_gather"])
def test_the_residual_is_y_minus_local_and_only_all_gather_carries_the_message(exchange):
    comp = compjax.top_k(ratio=0.1)
    x = jax.random.normal(jax.random.key(0), (4, D)).at[1, 5].set(jnp.nan)

    def one(xi):
        memory = jnp.zeros_like(xi) if exchange == "scatter_gather" else None
        sent = compressed_mean(comp, jax.random.key(3), xi, "data", exchange, memory)
        return sent.residual(1.5 * xi), 1.5 * xi - sent.local, sent.message is not None

    got, want, carried = jax.vmap(one, axis_name="data")(x)
    np.testing.assert_array_equal(bits(got), bits(want))
    assert bool(carried.all()) == (exchange == "all_gather")


@pytest.mark.parametrize("exchange", ["all_gather", "scatter_gather"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_error_feedback_memory_equals_the_dense_residual(exchange, dtype, monkeypatch):
    """Four steps of EF top-k (4 workers, a NaN in step 2's gradient): updates and memories
    bit for bit as ``p - local`` leaves them."""
    tx = compjax.error_feedback(compjax.top_k(ratio=0.1), "data", exchange=exchange)
    grads = [jax.random.normal(jax.random.key(s), (4, D)).astype(dtype) for s in range(4)]
    grads[2] = grads[2].at[1, 9].set(jnp.nan)

    def run():
        state = jax.vmap(tx.init)(grads[0])
        update = jax.jit(jax.vmap(tx.update, axis_name="data"))
        outs = []
        for g in grads:
            out, state = update(g, state)
            outs.append(out)
        return outs, state

    got = run()
    monkeypatch.setattr(Exchanged, "residual", lambda self, y: y - self.local)
    want = run()
    assert np.isfinite(bits(got[1].error).view(np.float32)).all()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            a, b = bits(a), bits(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
