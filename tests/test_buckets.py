"""Buckets: the flattened tree in fixed-size buckets, one message and one scale per bucket."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax
from compjax.transforms.base import Leaves

N = 4
TREE = {"w": jnp.zeros((7, 5)), "b": jnp.zeros(5), "s": jnp.zeros(())}  # 41 entries
SIZE = 16


def per_worker(seed, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return jax.tree.map(
        lambda k, p: jax.random.normal(k, (N, *p.shape)).astype(dtype),
        dict(zip(TREE, keys, strict=True)),
        TREE,
    )


def test_buckets_split_the_flat_tree_and_rebuild_it():
    tree = jax.tree.map(lambda x: x[0], per_worker(0))
    leaves = Leaves(tree, flatten=False, bucket_size=SIZE)
    assert [a.shape for a in leaves.arrays] == [(16,), (16,), (9,)]
    rebuilt = leaves.rebuild(leaves.arrays)
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("exchange", ["all_gather", "scatter_gather"])
def test_one_message_per_bucket(exchange):
    tx = compjax.compress(compjax.qsgd(4), "data", bucket_size=SIZE, exchange=exchange)
    report = compjax.communication(tx, TREE, "data", N)
    kinds = [k for k, _ in report.messages if k != "flag"]
    per_bucket = 1 if exchange == "all_gather" else 2  # scatter + gather
    assert len(kinds) == 3 * per_bucket
    if exchange == "all_gather":
        expected = sum(compjax.qsgd(4).bits((b,)) for b in (16, 16, 9))
        assert report.payload_bits - 8 == expected


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_bucketed_error_feedback_loses_nothing(dtype):
    tx = compjax.error_feedback(compjax.top_k(ratio=0.25), "data", bucket_size=SIZE)
    state = jax.vmap(tx.init)(per_worker(1, dtype))
    update = jax.jit(jax.vmap(tx.update, axis_name="data"))
    applied = inputs = 0.0
    for step in range(3):
        g = per_worker(2 + step, dtype)
        out, state = update(g, state)
        flat = lambda t: jnp.concatenate([x.reshape(N, -1) for x in jax.tree.leaves(t)], 1)  # noqa: E731
        applied += N * flat(out)[0].astype(jnp.float32)
        inputs += flat(g).astype(jnp.float32).sum(0)
    memory = jnp.concatenate([e.astype(jnp.float32).sum(0)[0] for e in state.error])
    tol = 1e-5 if dtype == jnp.float32 else 0.1
    np.testing.assert_allclose(applied + memory, inputs, atol=tol)


def test_lossless_buckets_give_the_mean():
    tx = compjax.compress(compjax.identity(), "data", bucket_size=SIZE, exchange="scatter_gather")
    g = per_worker(5)
    out, _ = jax.vmap(tx.update, axis_name="data")(g, jax.vmap(tx.init)(g))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(g), strict=True):
        np.testing.assert_allclose(a[0], b.mean(0), atol=1e-6)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_bucket_size_is_rejected(bad):
    with pytest.raises(ValueError, match="bucket_size"):
        compjax.compress(compjax.qsgd(4), "data", bucket_size=bad)
    with pytest.raises(ValueError, match="bucket_size"):
        compjax.error_feedback(compjax.top_k(k=1), "data", flatten=True, bucket_size=4)
