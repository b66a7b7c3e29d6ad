"""Edge cases from the hostile-input audit: degenerate leaves, non-finite values, float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_compressors

import compjax

# --- TernGrad's clipping on leaves whose entries are all equal (sigma = 0) -------------------


@pytest.mark.parametrize("shape", [(), (1,), (5,)])
def test_clipped_terngrad_keeps_a_constant_leaf(shape):
    """Clipping to 2.5 sigma with sigma = 0 would send 0 for ever; a constant leaf is not clipped.

    Every entry equals the scaler, so each is kept with probability 1: exact.
    """
    x = jnp.full(shape, 0.7, jnp.float32)
    out = jax.jit(compjax.terngrad(clip=2.5))(jax.random.key(0), x)
    np.testing.assert_array_equal(out, x)


def test_clipped_terngrad_agrees_in_jit_and_eager_on_a_constant_float16_leaf():
    x = jnp.full((7,), 0.3, jnp.float16)
    comp, key = compjax.terngrad(clip=2.5), jax.random.key(1)
    eager = comp(key, x)
    np.testing.assert_array_equal(jax.jit(comp)(key, x), eager)
    np.testing.assert_array_equal(eager, x)


def test_clipping_still_applies_to_a_leaf_with_spread():
    x = jnp.array([0.0] * 9 + [10.0])  # sigma = 3: the outlier is clipped to 7.5
    out = jax.vmap(lambda k: compjax.terngrad(clip=2.5)(k, x))(
        jax.random.split(jax.random.key(2), 4000)
    )
    assert abs(float(out[:, -1].mean()) - 7.5) < 0.05


def test_terngrad_allreduce_moves_a_scalar_parameter():
    """A scalar parameter whose gradient is 0.7 on every worker gets the update 0.7, not 0."""
    tx = compjax.terngrad_allreduce("data")  # clip=2.5 by default
    params = {"s": jnp.zeros(()), "b": jnp.zeros((1,))}
    grads = {"s": jnp.full((4,), 0.7), "b": jnp.full((4, 1), -0.2)}
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(4))
    updates, _ = jax.jit(jax.vmap(tx.update, axis_name="data"))(grads, state)
    np.testing.assert_allclose(updates["s"], 0.7, rtol=1e-6)
    np.testing.assert_allclose(updates["b"], -0.2, rtol=1e-6)


# --- non-finite values through a compressor called directly ----------------------------------

COMPRESSORS = all_compressors()
#: One-bit signs cannot carry NaN (sign() sends it as +1, +-Inf as +-1); random-k sends only
#: the entries it draws, whatever the others hold (so does a chain that starts with it).
DROPS_NON_FINITE = {s for s in COMPRESSORS if s == "sign()" or "rand_k" in s}


BAD_INPUTS = jnp.array(
    [
        jnp.array([1.0, -2.0, 0.5, 3.0, -1.0, 0.25, 2.0, -0.75]).at[at].set(bad)
        for bad in (np.nan, np.inf, -np.inf)
        for at in (0, 5)
    ]
)


#: One compressor of each family in the fast suite; the rest run with make test-slow.
FAST_FAMILIES = {
    "cast('float16')",
    "atomo(budget=16)",
    "atomo_svd(budget=2)",
    "qsgd(levels=4)",
    "terngrad(clip=2.5)",
    "eden()",
    "top_k(ratio=0.01)",
    "natural()",
}


@pytest.mark.parametrize(
    "spec",
    [
        s if s in FAST_FAMILIES else pytest.param(s, marks=pytest.mark.slow)
        for s in sorted(set(COMPRESSORS) - DROPS_NON_FINITE)
    ],
)
def test_non_finite_input_gives_non_finite_output(spec):
    comp = COMPRESSORS[spec]
    keys = jax.random.split(jax.random.key(0), len(BAD_INPUTS))
    outs = jax.jit(jax.vmap(comp))(keys, BAD_INPUTS)
    for x, out in zip(BAD_INPUTS, np.asarray(outs, np.float32), strict=True):
        assert not np.all(np.isfinite(out)), (x, out)


def test_sign_sends_nan_as_plus_one_and_infinities_as_their_sign():
    x = jnp.array([np.nan, np.inf, -np.inf, -2.0])
    np.testing.assert_array_equal(compjax.sign()(None, x), [1.0, 1.0, -1.0, -1.0])


def test_random_k_drops_the_entries_it_does_not_draw_and_keeps_those_it_does():
    x = jnp.array([np.inf, 1.0, -2.0, 3.0])
    np.testing.assert_array_equal(compjax.rand_k(ratio=1.0)(jax.random.key(0), x), x)
    outs = jax.vmap(lambda k: compjax.rand_k(k=1)(k, x))(jax.random.split(jax.random.key(1), 64))
    drew_inf = np.isinf(np.asarray(outs[:, 0]))
    assert 0 < drew_inf.sum() < 64  # sometimes drawn (then Inf), otherwise dropped
    assert np.all(np.isfinite(np.asarray(outs[~drew_inf])))


# --- float64 with jax_enable_x64 -------------------------------------------------------------


def test_float64_input_is_refused_with_a_clear_error():
    """Computation is in float32: 1e300 would become Inf and 1e-300 zero, silently."""
    with jax.enable_x64(True):
        x = jnp.array([1e300, 1e-300, 1.0], jnp.float64)
        assert x.dtype == jnp.float64
        for comp in (compjax.qsgd(levels=4), compjax.top_k(k=1), compjax.identity()):
            with pytest.raises(ValueError, match="float64"):
                comp(jax.random.key(0), x)
