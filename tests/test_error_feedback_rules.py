"""The error-feedback and EF21 rules (compjax.transforms.error_feedback.ef_message / ef_error,
compjax.transforms.ef21.ef21_message / ef21_estimates), which error_feedback, ef21 and fsdp's
``feedback`` all apply: on real exchanges over 8 workers, in float32 and with low-precision
updates against float32 memories."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import compjax
from compjax.transforms.ef21 import ef21_estimates, ef21_message
from compjax.transforms.error_feedback import ef_error, ef_message

P = jax.P
N = 8
D = 40


def exchange_rules(comp, exchange, dtype):
    """Per worker (one row each): the EF message ``p``, its decode ``C(p)``, the new memory, and
    EF21's message, new estimate ``g_i`` and new shared estimate ``g`` (one step from the
    memories ``e`` and ``g_i`` and the shared ``g``)."""
    mesh = jax.make_mesh((N,), ("data",))

    def local(g, e, gi, h):
        g, e, gi = g[0], e[0], gi[0]
        key = jax.random.key(11)
        p = ef_message(g, e)
        sent = compjax.compressed_mean(comp, key, p.astype(g.dtype), "data", exchange)
        c = compjax.compressed_mean(
            comp, key, ef21_message(g, gi).astype(g.dtype), "data", exchange
        )
        new_gi, new_h = ef21_estimates(gi, h, c)
        rows = (p, sent.local, ef_error(p, sent), ef21_message(g, gi), c.local, new_gi)
        return (*(r[None] for r in rows), new_h, c.mean)

    spec = P("data")
    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, spec, P()),
        out_specs=(spec,) * 6 + (P(), P()),
    )
    keys = jax.random.split(jax.random.key(5), 4)
    g = jax.random.normal(keys[0], (N, D)).astype(dtype)
    e = 0.1 * jax.random.normal(keys[1], (N, D))
    gi = 0.5 * jax.random.normal(keys[2], (N, D))
    h = jax.random.normal(keys[3], (D,))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    out = jax.jit(f)(put(g, spec), put(e, spec), put(gi, spec), put(h, P()))
    return (g, e, gi, h), out


CASES = {
    "top_k all_gather f32": (lambda: compjax.top_k(ratio=0.25), "all_gather", jnp.float32),
    "qsgd scatter_gather bf16": (lambda: compjax.qsgd(4), "scatter_gather", jnp.bfloat16),
    "scaled_sign all_gather f16": (compjax.scaled_sign, "all_gather", jnp.float16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rules_on_exchanges_of_8_workers(name):
    make, exchange, dtype = CASES[name]
    (g, e, gi, h), out = exchange_rules(make(), exchange, dtype)
    p, decoded, memory, m21, c, new_gi, new_h, mean_c = (np.asarray(x) for x in out)
    g32 = np.asarray(g, np.float32)
    # EF: the message is g + e in the memory's float32 (a bf16/f16 update is widened exactly),
    # and the new memory is exactly what the decoded message left of it: p - C(p).
    assert p.dtype == np.float32 and memory.dtype == np.float32
    np.testing.assert_array_equal(p, g32 + np.asarray(e))
    np.testing.assert_array_equal(memory, p - decoded.astype(np.float32))
    if name.startswith("top_k"):  # a contraction: the kept entries leave nothing behind
        kept = decoded != 0
        assert 0 < kept.sum() < kept.size
        np.testing.assert_array_equal(memory[kept], 0.0)
        np.testing.assert_array_equal(memory[~kept], p[~kept])
    # EF21: the message is grad_i - g_i; g_i moves by the decoded c_i and g by their mean.
    np.testing.assert_array_equal(m21, g32 - np.asarray(gi))
    assert new_gi.dtype == np.float32 and new_h.dtype == np.float32
    np.testing.assert_array_equal(new_gi, np.asarray(gi) + c.astype(np.float32))
    np.testing.assert_array_equal(new_h, np.asarray(h) + mean_c.astype(np.float32))
    # The shared estimate moved by the mean of what the workers' estimates moved by (up to the
    # rounding of the mean to the update's dtype).
    moved = (new_gi - np.asarray(gi)).mean(0)
    tol = 2 * float(jnp.finfo(dtype).eps) * np.abs(moved).max()
    np.testing.assert_allclose(new_h - np.asarray(h), moved, rtol=0, atol=tol)


def test_ef_error_subtracts_a_sparse_message_without_a_dense_decode():
    """Where the exchange keeps this worker's payload, ``ef_error`` subtracts it from the message
    (the same values as ``p - C(p)``); the exchange's own ``residual`` is what it uses."""
    comp = compjax.top_k(k=3)
    p = jnp.array([0.5, -4.0, 1.0, 3.0, -0.25, 2.0, 0.0, -1.5])
    sent = compjax.compressed_mean(comp, jax.random.key(0), p, None)
    assert sent.message is not None  # one worker: its own payload
    np.testing.assert_array_equal(ef_error(p, sent), [0.5, 0.0, 1.0, 0.0, -0.25, 0.0, 0.0, -1.5])
    np.testing.assert_array_equal(ef_error(p, sent), p - sent.local)
