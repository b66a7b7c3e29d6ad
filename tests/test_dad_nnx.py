"""dAD and rank-dAD on Flax NNX models: nnx.Linear captured like linen Dense."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_dad import N, assert_trees_close, local, on_pmap, on_shard_map, pooled_grad

from compjax import dad


class MLP(nnx.Module):
    """Two Linear layers, the second applied twice (one kernel, two calls), and a LayerNorm."""

    def __init__(self, rngs):
        self.first = nnx.Linear(12, 16, rngs=rngs)
        self.shared = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 5, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.first(x))
        x = jax.nn.relu(self.shared(jax.nn.relu(self.shared(x))))
        return self.head(self.norm(x))


@functools.cache
def problem(local_batch=4):
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N * local_batch, 12), np.float32)
    y = rng.integers(0, 5, N * local_batch, np.int32)

    def loss_fn(params, batch):
        x, y = batch
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn, nnx.as_pure(params), (x, y)


def test_nnx_linear_layers_are_captured_by_their_kernels():
    loss_fn, params, batch = problem()
    layers = {layer.name: layer for layer in dad.dense_layers(loss_fn, params, local(batch, 0))}
    assert sorted(layers) == ["first", "head", "shared"]  # not the LayerNorm
    assert layers["shared"].calls == (1, 2) and layers["shared"].rows == 8
    assert layers["head"].bias is None
    assert (layers["first"].in_features, layers["first"].out_features) == (12, 16)
    assert nnx.Linear.__call__.__qualname__ == "Linear.__call__"  # put back after the trace


@pytest.mark.parametrize("runner", [on_shard_map, on_pmap], ids=["shard_map", "pmap"])
def test_dad_on_nnx_equals_pooled_full_batch_gradient(runner):
    loss_fn, params, batch = problem()
    got = runner(lambda p, b: dad.dad_grads(loss_fn, p, b, "data")[1], params, batch)
    assert_trees_close(got, pooled_grad(loss_fn, params, batch))


def test_rank_dad_on_nnx_is_exact_at_full_rank():
    loss_fn, params, batch = problem()

    def grads_fn(p, b):
        return dad.rank_dad_grads(loss_fn, p, b, "data", rank=8)[1]

    got = on_shard_map(grads_fn, params, batch)
    assert_trees_close(got, pooled_grad(loss_fn, params, batch), rtol=1e-4, atol=1e-6)


def test_a_linear_layer_outside_params_is_a_clear_error():
    loss_fn, params, batch = problem()
    extra = nnx.Linear(5, 5, rngs=nnx.Rngs(1))  # closed over: its kernel is not in params

    def with_extra(p, b):
        return loss_fn(p, b) + jnp.sum(extra(jnp.ones((1, 5))))

    with pytest.raises(ValueError, match="not among the differentiated params"):
        dad.dense_layers(with_extra, params, local(batch, 0))
    assert nnx.Linear.__call__.__qualname__ == "Linear.__call__"  # put back on error too
