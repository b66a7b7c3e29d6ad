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
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@partial(jax.jit, static_argnums=0)
def _init(name):
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    return jax.vmap(lambda _: TRANSFORMS[name]().init(params))(jnp.arange(WORKERS))


@partial(jax.jit, static_argnums=0)
def _update(name, grads, state):
    if name == "variance_based":  # per-example gradients: the gradient and its half
        grads = jax.tree.map(lambda g: jnp.stack([g, g / 2], axis=1), grads)
    # Every worker's params (the local-step methods train their own copies; the others
    # ignore them).
    copies = {k: jnp.zeros((WORKERS, *s)) for k, s in SHAPES.items()}
    return jax.vmap(TRANSFORMS[name]().update, axis_name="data")(grads, state, copies)


def _step(name, grads, state=None):
    state = _init(name) if state is None else state
    updates, new_state = _update(name, grads, state)
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
        # float32 params (the local-step methods refuse float64 ones at init): the updates
        # alone are float64 here.
        params = {"w": jnp.zeros((3, 5), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
        if name == "variance_based":
            grads = jax.tree.map(lambda g: jnp.stack([g, g], axis=1), grads)
        state = jax.eval_shape(jax.vmap(lambda _: tx.init(params)), jnp.arange(WORKERS))
        # Every worker's params (the local-step methods train their own copies).
        copies = jax.tree.map(lambda p: jnp.broadcast_to(p, (WORKERS, *p.shape)), params)
        with pytest.raises(ValueError, match=r"float32, bfloat16 or float16, got float64"):
            jax.eval_shape(jax.vmap(tx.update, axis_name="data"), grads, state, copies)


# --- empty leaves and the largest finite gradients, every transformation ---------------------


#: The fast suite runs these (the transformations a hostile-input sweep saw crash or poison
#: their state); the others repeat their code paths and run with make test-slow.
FAST = {
    "compress(qsgd)",
    "error_feedback(top_k)",
    "diana(terngrad)",
    "powersgd",
    "sign_majority_vote",
}
TOP = float(np.finfo(np.float32).max)
#: Their first step at the largest values overflows float32 (see the test's docstring).
OVERFLOWING_FIRST_STEP = {"powersgd", "onebit_adam", "scale_by_onebit_adam"}


def _refused(updates, state, new_state) -> bool:
    """Whether the step was refused: NaN updates everywhere and the whole state kept."""
    if not all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(updates)):
        return False
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return True


@pytest.mark.parametrize(
    "name",
    [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(TRANSFORMS)],
)
def test_empty_leaf_and_largest_finite_gradients(name):
    """An empty leaf runs; finite gradients up to float32's maximum never poison the state.

    Zero gradients, an empty leaf among them, give zeros (the sign vote's +1 for zero,
    documented) and an empty update for the empty leaf.  Every worker sending +-3e38 or
    the float32 maximum (so is the mean) for two steps: each step gives a finite update
    or is refused whole (NaN update, state kept; e.g. an error memory ``x + e`` beyond
    float32), and the state stays finite.  The first such step from a zero state gives the
    finite mean, except in PowerSGD (whose ``P = M Q`` overflows) and 1-bit Adam (its
    variance, frozen after the zero-gradient warm-up step, is 0: ``m / (sqrt(v) + eps)``
    is 3e37 / 1e-8, beyond float32, so the step is refused).
    """
    updates, state, new_state = _step(name, _grads(0.0))
    assert updates["e"].shape == (WORKERS, 0)
    expected = 1.0 if name == "sign_majority_vote" else 0.0
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(updates[k]), expected, err_msg=name)
    assert _finite(new_state)
    for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
        if 0 in old.shape:
            assert new.shape == old.shape and new.dtype == old.dtype
    zero_state = new_state
    for value in (3e38, -TOP):
        state = zero_state
        for step in range(2):
            updates, state, new_state = _step(name, _grads(value), state)
            assert _finite(new_state), (name, value)
            refused = _refused(updates, state, new_state)
            assert refused or _finite(updates), (name, value, updates)
            if step == 0 and name not in OVERFLOWING_FIRST_STEP:
                assert not refused, (name, value)
            if name in ("onebit_adam", "scale_by_onebit_adam"):
                assert refused, (name, value)
            state = new_state


# --- the mean over workers of the largest finite values, on every exchange -------------------

AXES = ("hosts", "local")
EXCHANGES = {
    "all_gather": ("data", "all_gather"),
    "scatter_gather": ("data", "scatter_gather"),
    "hierarchical(scatter_gather)": (AXES, compjax.hierarchical("local", "scatter_gather")),
    "hierarchical(all_gather)": (AXES, compjax.hierarchical("local", "all_gather")),
}
#: Lossless on these inputs: the mean is exactly the (common) value.
EXACT = {
    "identity": compjax.identity(),
    "int_quant": compjax.int_quant(4),  # every entry at the shared scale: codes +-s
    "rand_k(shared)": compjax.rand_k(ratio=1.0, shared_seed=True),  # a linear psum
    "top_k": compjax.top_k(ratio=1.0),  # decoded and summed after an all-gather
}


@partial(jax.jit, static_argnums=(0, 1))
def _mean_step(comp_name, exchange_name, x):
    axes, exchange = EXCHANGES[exchange_name]
    comp = EXACT.get(comp_name) or compjax.qsgd(levels=4)
    tx = compjax.compress(comp, axes, exchange=exchange)
    names = (axes,) if isinstance(axes, str) else axes
    init, update = tx.init, tx.update
    for _ in names:
        init = jax.vmap(init)
    for axis in reversed(names):
        update = jax.vmap(update, axis_name=axis)
    return update(x, init(x))[0]


def _workers_x(exchange_name, value, dtype):
    lead = (4,) if isinstance(EXCHANGES[exchange_name][0], str) else (2, 2)
    signs = np.where(np.arange(5) % 2, -1.0, 1.0)  # 5 entries: shards padded
    return jnp.asarray(np.broadcast_to(value * signs, (*lead, 5)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("exchange_name", list(EXCHANGES))
def test_mean_of_the_largest_finite_values_on_every_exchange(exchange_name, dtype):
    """4 workers each sending the dtype's maximum: the mean is that value, not Inf."""
    x = _workers_x(exchange_name, float(jnp.finfo(dtype).max), dtype)
    out = np.asarray(_mean_step("identity", exchange_name, x), np.float64)
    np.testing.assert_array_equal(out, np.asarray(x, np.float64))


@pytest.mark.parametrize(
    ("comp_name", "exchange_name"),
    [
        (c, e) if e == "all_gather" else pytest.param(c, e, marks=pytest.mark.slow)
        for c in sorted(set(EXACT) - {"identity"})
        for e in EXCHANGES
    ],
)
def test_summed_psummed_and_gathered_means_of_the_largest_finite_values(comp_name, exchange_name):
    """The integer sum, a linear psum and a decoded all-gather sum: the exact mean, not Inf."""
    x = _workers_x(exchange_name, TOP, jnp.float32)
    out = np.asarray(_mean_step(comp_name, exchange_name, x), np.float64)
    np.testing.assert_array_equal(out, np.asarray(x, np.float64))


def test_float16_cast_psum_that_overflows_keeps_its_other_entries():
    """``compress(cast("float16"))`` over 4 workers: the float16 ``psum`` of 3e4 overflows
    and is sent again pre-scaled (mean 3e4); the step's small entries are the same bits
    as in a step where nothing overflows (their pre-scaled terms would be subnormal)."""
    tx = compjax.compress(compjax.cast("float16"), "data")
    small = jnp.asarray([1.1e-5, 1.21e-5, 1.32e-5, 1.43e-5])

    @jax.jit
    def mean(x):
        return jax.vmap(tx.update, axis_name="data")(x, jax.vmap(tx.init)(x))[0]

    big = np.asarray(mean(jnp.stack([jnp.full(4, 3e4), small], axis=1)))
    quiet = np.asarray(mean(jnp.stack([jnp.ones(4), small], axis=1)))
    np.testing.assert_array_equal(big[:, 0], np.float32(3e4))
    np.testing.assert_array_equal(big[:, 1], quiet[:, 1])


@pytest.mark.parametrize(
    "exchange_name",
    [e if e == "scatter_gather" else pytest.param(e, marks=pytest.mark.slow) for e in EXCHANGES],
)
def test_qsgd_mean_of_the_largest_finite_values_saturates_on_every_exchange(exchange_name):
    """QSGD's decode of entries at the maximum reaches beyond it (its levels are ``||x|| l/s``):
    finite, saturated at the maximum with the entries' signs, never Inf or a refused step."""
    x = _workers_x(exchange_name, TOP, jnp.float32)
    out = np.asarray(_mean_step("qsgd", exchange_name, x), np.float64)
    assert np.all(np.isfinite(out)) and np.all(np.abs(out) <= TOP)
    assert np.all(np.sign(out) == np.sign(np.asarray(x)))


# --- norms near the float32 limit ------------------------------------------------------------


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


@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1.0, 1e12, 1e19, 3e37])
def test_one_pass_rms_is_the_scaled_two_pass_one_or_falls_back_to_it(scale):
    """``l2_scaled_sign``'s ``||x||_2 / sqrt(d)`` takes one pass (the plain sum of squares)
    where no square overflows or flushes: then it equals the scaled two-pass computation bit
    for bit; beyond (entries of ``1e19`` overflow the sum, ``1e-30`` flush) it is that
    computation.  Over a bucket's pieces (a cut leaf, a whole one) the same, to rounding."""
    from compjax.compressors.l2_sign import rms, rms_of_pieces, scaled_rms
    from compjax.numerics import ldexp
    from compjax.pieces import Pieces

    x = jax.random.normal(jax.random.key(4), (3000,)) * np.float32(scale)

    def two_pass(a):
        top = jnp.max(jnp.abs(a))
        return scaled_rms(top, lambda e: jnp.sum(jnp.square(ldexp(a, -e))), a.shape[0])

    got, want = jax.jit(rms)(x), jax.jit(two_pass)(x)
    np.testing.assert_array_equal(got, want)
    exact = np.sqrt(np.mean(np.square(np.asarray(x, np.float64))))
    np.testing.assert_allclose(float(got), exact, rtol=1e-6)
    pieces = Pieces((x[:1000], x), ((200, 1000), (0, 3000)), jnp.float32)
    joined = jnp.concatenate([x[200:1000], x])
    np.testing.assert_allclose(jax.jit(rms_of_pieces)(pieces), rms(joined), rtol=1e-6)


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
