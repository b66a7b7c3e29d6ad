"""Hostile inputs for every exported transformation, in the fast suite.

* float64 (``jax_enable_x64``) is refused by every transformation with the
  compressors' error, never silently squeezed into float32's range;
* a params tree holding an empty ``(0,)`` leaf runs (an empty update, zeros
  elsewhere for zero gradients);
* the largest finite gradients give a finite mean on every exchange, and no
  transformation's persistent state becomes non-finite from finite input;
* norms of entries near the float32 limit do not overflow (scaled sign, the
  l2-scaled sign, ATOMO's rescaled values), in float32, bfloat16 and float16.

One compiled step per transformation (shapes fixed), shared by the tests.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hostile import TRANSFORMS

import compjax

WORKERS = 4
SHAPES = {"w": (3, 5), "b": (1,), "e": (0,)}  # "e": an empty leaf


@partial(jax.jit, static_argnums=0)
def _step(name, grads):
    tx = TRANSFORMS[name]()
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(WORKERS))
    if name == "variance_based":  # per-example gradients: the gradient and its half
        grads = jax.tree.map(lambda g: jnp.stack([g, g / 2], axis=1), grads)
    updates, new_state = jax.vmap(tx.update, axis_name="data")(grads, state)
    return updates, state, new_state


def _grads(value):
    return {k: jnp.full((WORKERS, *s), value, jnp.float32) for k, s in SHAPES.items()}


def _finite(tree) -> bool:
    return all(
        bool(np.all(np.isfinite(np.asarray(a, np.float32))))
        for a in jax.tree.leaves(tree)
        if jnp.issubdtype(a.dtype, jnp.floating)
    )


# --- float64 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_float64_updates_are_refused_by_every_transformation(name):
    """2e40 would become Inf and 2e-50 zero in float32: the compressors' ValueError instead."""
    with jax.enable_x64(True):
        tx = TRANSFORMS[name]()
        grads = {"w": jnp.full((WORKERS, 3, 5), 2e40), "b": jnp.full((WORKERS, 1), 2e-50)}
        assert grads["w"].dtype == jnp.float64
        params = {"w": jnp.zeros((3, 5)), "b": jnp.zeros((1,))}
        if name == "variance_based":
            grads = jax.tree.map(lambda g: jnp.stack([g, g], axis=1), grads)
        state = jax.eval_shape(jax.vmap(lambda _: tx.init(params)), jnp.arange(WORKERS))
        with pytest.raises(ValueError, match=r"float32, bfloat16 or float16, got float64"):
            jax.eval_shape(jax.vmap(tx.update, axis_name="data"), grads, state)


# --- empty leaves and the largest finite gradients, every transformation ---------------------


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_empty_leaf(name):
    """Zero gradients, an empty leaf among them: zeros (the sign vote's +1 for zero, documented),
    an empty update for the empty leaf, and the state's empty leaves stay empty."""
    updates, state, new_state = _step(name, _grads(0.0))
    assert updates["e"].shape == (WORKERS, 0)
    expected = 1.0 if name == "sign_majority_vote" else 0.0
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(updates[k]), expected, err_msg=name)
    assert _finite(new_state)
    for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
        if 0 in old.shape:
            assert new.shape == old.shape and new.dtype == old.dtype


# --- norms near the float32 limit ------------------------------------------------------------

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_sign_scales_of_the_largest_entries_are_finite_and_exact(dtype):
    """``||x||_1 / d`` and ``||x||_2 / sqrt(d)`` of equal magnitudes are that magnitude."""
    top = float(jnp.finfo(dtype).max)
    signs = np.where(np.arange(13) % 3 == 1, -1.0, 1.0)
    for comp, value, d in (
        (compjax.scaled_sign(), top, 7),
        (compjax.l2_scaled_sign(), min(1e38, top), 13),
        (compjax.l2_scaled_sign(), top, 13),
    ):
        x = jnp.asarray(value * signs[:d], dtype)
        out = np.asarray(jax.jit(comp)(jax.random.key(0), x), np.float64)
        want = np.asarray(x, np.float64)
        np.testing.assert_allclose(out, want, rtol=2e-7, err_msg=str(comp))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_atomo_saturates_rescaled_values_of_the_largest_entries(dtype):
    """``x_i / p_i`` beyond the dtype's range saturates at its largest value, never Inf."""
    top = float(jnp.finfo(dtype).max)
    x = jnp.asarray(np.array([3e38, -3e38, 3e38, 3e38, -3e38, 3e38, 3e38]).clip(-top, top), dtype)
    outs = jax.jit(jax.vmap(lambda k: compjax.atomo(budget=4)(k, x)))(
        jax.random.split(jax.random.key(0), 16)
    )
    outs = np.asarray(outs, np.float64)
    assert np.all(np.isfinite(outs))
    kept = outs != 0
    assert kept.any()
    np.testing.assert_array_equal(np.abs(outs[kept]), top)
    np.testing.assert_array_equal(
        np.sign(outs[kept]), np.sign(np.broadcast_to(x, outs.shape))[kept]
    )
