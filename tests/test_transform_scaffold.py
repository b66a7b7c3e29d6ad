"""The leaf-by-leaf scaffold of the transformations: state layout, keys, bit counter, guard.

One worker (``axis_name=None``), eager: the scaffold's own contracts, on a toy step whose
results are known in closed form.  The transformations built on it are checked in their
own tests (bit for bit against their references).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax.draws import init_key, step_keys
from compjax.pieces import Pieces
from compjax.transforms.padded_sparse import real_bits_sent
from compjax.transforms.scaffold import KNOWN_FIELDS, LeafStep, leafwise, scaffold

PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(5)}
SIZE = 11


class ToyState(NamedTuple):
    key: jax.Array
    memory: Any
    total: Any
    bits_sent: jax.Array
    PER_WORKER = ("memory", "bits_sent")
    COUNTS_BITS = True


def toy_step(leaf):
    """Update ``2 g``; ``memory += g``, ``total += 1``; ``5`` bits per entry; the key echoed."""
    g, (memory, total) = leaf.update, leaf.state
    out = (2 * g).astype(g.dtype)
    return LeafStep(out, (memory + g, total + 1.0), sent=((jnp.int32(g.size), 5),))


def toy(**options):
    return leafwise(scaffold(ToyState, None, seed=3, **options), toy_step)


def grads(dtype=jnp.float32, scale=1.0):
    return {"w": jnp.full((2, 3), 1.5 * scale, dtype), "b": jnp.arange(5, dtype=dtype) * scale}


def test_fields_are_every_state_field_but_the_known_ones():
    sc = scaffold(ToyState, "data")
    assert sc.fields == ("memory", "total")
    assert set(ToyState._fields) - set(sc.fields) <= set(KNOWN_FIELDS)
    assert scaffold(ToyState, "data", fields=("memory",)).fields == ("memory",)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_init_lays_out_per_worker_and_shared_fields_in_the_state_dtype(dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    state = toy().init(params)
    assert state.memory["w"].shape == (1, 2, 3) and state.total["w"].shape == (2, 3)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves((state.memory, state.total)))
    np.testing.assert_array_equal(state.key, init_key(3))
    np.testing.assert_array_equal(state.bits_sent, np.zeros((1, 2), np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_steps_write_fields_keys_and_bits(dtype):
    tx = toy()
    state = tx.init(PARAMS)
    g = grads(dtype)
    for _ in range(2):
        out, state = tx.update(g, state)
    for name in ("w", "b"):
        assert out[name].dtype == dtype
        np.testing.assert_array_equal(out[name], 2 * g[name])
        np.testing.assert_array_equal(state.memory[name][0], 2 * g[name].astype(jnp.float32))
        np.testing.assert_array_equal(state.total[name], np.full(g[name].shape, 2.0))
    assert state.memory["w"].dtype == jnp.float32  # fixed at init, whatever the step returns
    key, _ = step_keys(step_keys(init_key(3), 2)[0], 2)
    np.testing.assert_array_equal(state.key, key)
    assert real_bits_sent(state) == 2 * 5 * SIZE


def test_flatten_and_buckets_keep_one_entry_per_group():
    flat = toy(flatten=True).init(PARAMS)
    assert flat.memory.shape == (1, SIZE) and flat.total.shape == (SIZE,)
    tx = toy(bucket_size=4)
    state = tx.init(PARAMS)
    assert [a.shape for a in state.memory] == [(1, 4), (1, 4), (1, 3)]
    out, state = tx.update(grads(), state)
    np.testing.assert_array_equal(out["b"], 2 * grads()["b"])
    assert real_bits_sent(state) == 5 * SIZE


def test_pieces_hands_a_bucket_over_uncopied():
    seen = []

    def step(leaf):
        seen.append(type(leaf.update))
        return LeafStep([2 * p for p in leaf.update.arrays])

    class KeyOnly(NamedTuple):
        key: jax.Array
        PER_WORKER = ()

    tx = leafwise(scaffold(KeyOnly, None, False, 4, 0, pieces=True), step)
    out, _ = tx.update(grads(), tx.init(PARAMS))
    assert seen == [Pieces] * 3
    np.testing.assert_array_equal(out["w"], 2 * grads()["w"])


def test_non_finite_input_gives_nan_and_keeps_the_whole_state():
    tx = toy()
    state = tx.init(PARAMS)
    _, state = tx.update(grads(), state)
    bad = grads()
    bad["b"] = bad["b"].at[1].set(jnp.inf)
    out, new = tx.update(bad, state)
    assert all(bool(jnp.all(jnp.isnan(a))) for a in jax.tree.leaves(out))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cast_after_guard_judges_float32_updates_before_the_cast():
    """A float32 update beyond float16's range: refused where the step casts it (the guard
    sees inf), passed on as inf with ``cast_after_guard`` (the guard judged float32)."""

    def wide(leaf):
        g, (memory, total) = leaf.update, leaf.state
        return LeafStep(g.astype(jnp.float32) * 1e6, (memory, total))

    def narrow(leaf):
        out = wide(leaf)
        return out._replace(out=out.out.astype(leaf.update.dtype))

    params = jax.tree.map(lambda p: p.astype(jnp.float16), PARAMS)
    g = grads(jnp.float16)
    after = leafwise(scaffold(ToyState, None, seed=3, cast_after_guard=True), wide)
    out, state = after.update(g, after.init(params))
    assert out["w"].dtype == jnp.float16 and bool(jnp.all(jnp.isposinf(out["w"])))
    assert real_bits_sent(state) == 0 and not np.array_equal(state.key, init_key(3))
    before = leafwise(scaffold(ToyState, None, seed=3), narrow)
    out, state = before.update(g, before.init(params))
    assert bool(jnp.all(jnp.isnan(out["w"])))
    np.testing.assert_array_equal(state.key, init_key(3))


def test_a_state_built_for_other_params_is_refused():
    tx = toy()
    state = tx.init({"w": jnp.ones((2, 3))})
    with pytest.raises(ValueError, match="'memory' has structure"):
        tx.update(grads(), state)


@pytest.mark.parametrize(
    "options, name",
    [({"bucket_size": 0}, "bucket_size"), ({"state_dtype": jnp.int32}, "state_dtype")],
)
def test_invalid_options_are_refused_at_construction(options, name):
    with pytest.raises(ValueError, match=name):
        scaffold(ToyState, None, **options)
