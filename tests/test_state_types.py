"""Transformation states: float32 by default under low-precision gradients, fixed types.

A bfloat16 error memory rounds away every increment below 2^-8 of its value,
so a small coordinate is never sent; persistent state is therefore float32
unless ``state_dtype`` says otherwise, while messages and updates keep the
gradient's dtype.  The state's types never change from ``init`` to
``update``, which is what ``optax.apply_if_finite`` (a ``lax.cond`` between
the new and the old state) needs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax

BF16 = jnp.bfloat16
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 18).reshape(6, 3), "b": jnp.zeros(3)}
WORKERS = 2

#: Every transformation with persistent per-leaf state (axis name "data").
STATEFUL = {
    "compress(top_k, scatter_gather)": lambda **kw: compjax.compress(
        compjax.top_k(ratio=0.5), "data", exchange="scatter_gather", **kw
    ),
    "error_feedback(top_k)": lambda **kw: compjax.error_feedback(
        compjax.top_k(ratio=0.3), "data", **kw
    ),
    "error_feedback(top_k, scatter_gather)": lambda **kw: compjax.error_feedback(
        compjax.top_k(ratio=0.3), "data", exchange="scatter_gather", **kw
    ),
    "ef21(top_k)": lambda **kw: compjax.ef21(compjax.top_k(ratio=0.3), "data", **kw),
    "diana(qsgd)": lambda **kw: compjax.diana(compjax.qsgd(4), "data", **kw),
    "dgc": lambda **kw: compjax.dgc("data", 0.3, min_size=4, sampled_threshold=False, **kw),
    "dgc(scatter_gather)": lambda **kw: compjax.dgc(
        "data", 0.3, min_size=4, exchange="scatter_gather", **kw
    ),
    "powersgd": lambda **kw: compjax.powersgd(1, "data", min_compression_rate=1.0, **kw),
    "signum": lambda **kw: compjax.sign_majority_vote("data", 0.9, **kw),
    "strom_threshold": lambda **kw: compjax.strom_threshold("data", 0.05, budget=0.5, **kw),
    "demo": lambda **kw: compjax.scale_by_demo("data", chunk=3, topk=2, **kw),
}


def grads_at(t: int, dtype=jnp.float32):
    """Each worker's gradient at step ``t``: a leading axis of ``WORKERS``."""
    keys = jax.random.split(jax.random.key(t), len(PARAMS))
    return {
        name: jax.random.normal(k, (WORKERS, *PARAMS[name].shape)).astype(dtype)
        for k, name in zip(keys, sorted(PARAMS), strict=True)
    }


def run(tx, params, steps: int, dtype):
    """``steps`` updates of ``WORKERS`` workers simulated by vmap: (updates, states)."""
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(WORKERS))
    update = jax.jit(jax.vmap(tx.update, axis_name="data"))
    outs, states = [], [state]
    for t in range(steps):
        out, state = update(grads_at(t, dtype), state)
        outs.append(out)
        states.append(state)
    return outs, states


def float_dtypes(tree):
    return {a.dtype for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)}


def avals(tree):
    return [(a.shape, a.dtype, a.weak_type) for a in jax.tree.leaves(jax.eval_shape(lambda: tree))]


# --- the default: float32 state for bfloat16 gradients ---------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        n
        if n in ("error_feedback(top_k)", "dgc", "powersgd", "strom_threshold")
        else pytest.param(n, marks=pytest.mark.slow)
        for n in STATEFUL
    ],
)
def test_bfloat16_gradients_keep_float32_state_and_bfloat16_updates(name):
    tx = STATEFUL[name]()
    half = jax.tree.map(lambda p: p.astype(BF16), PARAMS)
    outs, states = run(tx, half, 2, BF16)
    for state in states:
        assert float_dtypes(state) == {jnp.dtype(jnp.float32)}
    assert avals(states[0]) == avals(states[-1])  # fixed at init, weak types included
    for out in outs:
        assert float_dtypes(out) == {jnp.dtype(BF16)}


@pytest.mark.parametrize("name", ["error_feedback(top_k)", "powersgd", "strom_threshold"])
def test_an_explicit_state_dtype_is_used(name):
    tx = STATEFUL[name](state_dtype=BF16)
    _, states = run(tx, PARAMS, 1, jnp.float32)
    assert float_dtypes(states[-1]) - {jnp.dtype(jnp.float32)} == {jnp.dtype(BF16)}
    assert avals(states[0]) == avals(states[1])


@pytest.mark.parametrize("name", [*STATEFUL, "variance_based"])
@pytest.mark.parametrize("bad", [jnp.int32, "nope", bool])
def test_state_dtype_is_validated_at_construction(name, bad):
    make = STATEFUL.get(name, lambda **kw: compjax.variance_based("data", **kw))
    with pytest.raises(ValueError, match="state_dtype"):
        make(state_dtype=bad)


def test_variance_based_accumulators_take_the_state_dtype():
    tx = compjax.variance_based(None, budget=0.5, state_dtype=BF16)
    state = tx.init(PARAMS)
    _, new = jax.jit(tx.update)(grads_at(0), state)  # a batch of 2 examples
    assert float_dtypes(new) == {jnp.dtype(BF16)}
    assert avals(state) == avals(new)


# --- nothing is lost in bfloat16 -------------------------------------------------------------


@functools.cache
def scanned(tx, steps: int):
    """``steps`` updates of one worker on a constant gradient: (sum of updates, final state)."""

    def body(carry, _):
        total, state, g = carry
        out, state = tx.update(g, state)
        return (total + out.astype(jnp.float32), state, g), None

    @jax.jit
    def go(g):
        init = (jnp.zeros(g.shape, jnp.float32), tx.init(g), g)
        (total, state, _), _ = jax.lax.scan(body, init, None, length=steps)
        return total, state

    return go


SMALL = jnp.array([1.0, 0.003], BF16)  # the audit's example: top-1 of [1, 0.003]


def test_error_feedback_sends_the_small_coordinate_of_bfloat16_gradients():
    tx = compjax.error_feedback(compjax.top_k(k=1), None)
    sent, state = scanned(tx, 600)(SMALL)
    memory = state.error[0]
    assert memory.dtype == jnp.float32
    # A bfloat16 memory sticks at 1.0 (1 + 0.003 rounds to 1): nothing sent.
    assert sent[1] >= 1.0
    # Nothing lost: what was sent plus the memory is the accumulated input.
    total = 600 * np.float64(SMALL[1].astype(jnp.float32))  # 1.8036
    np.testing.assert_allclose(sent[1] + memory[1], total, rtol=1e-6)
    np.testing.assert_allclose(sent[0] + memory[0], 600.0, rtol=1e-6)


def test_error_feedback_identity_holds_to_float32_accuracy_on_bfloat16():
    """``sum of sent + memory = sum of inputs``, step after step (one worker: the update is
    its decoded message, exactly)."""
    tx = compjax.error_feedback(compjax.top_k(ratio=0.3), None)
    update = jax.jit(tx.update)
    state = tx.init(jax.tree.map(lambda p: p.astype(BF16), PARAMS))
    sent, inputs = dict.fromkeys(PARAMS, 0.0), dict.fromkeys(PARAMS, 0.0)
    for t in range(8):
        g = jax.tree.map(lambda a: a[0], grads_at(t, BF16))
        out, state = update(g, state)
        for k in PARAMS:
            sent[k] = sent[k] + np.asarray(out[k], np.float64)
            inputs[k] = inputs[k] + np.asarray(g[k], np.float64)
            memory = np.asarray(state.error[k][0], np.float64)
            np.testing.assert_allclose(sent[k] + memory, inputs[k], rtol=1e-6, atol=1e-6)


def test_gradient_dropping_sends_the_small_coordinate_of_bfloat16_gradients():
    tx = compjax.dgc(None, 0.5, momentum_correction=False, min_size=1, sampled_threshold=False)
    sent, state = scanned(tx, 600)(SMALL)
    velocity = state.velocity[0]
    assert velocity.dtype == jnp.float32 and sent[1] >= 1.0
    total = 600 * np.float64(SMALL[1].astype(jnp.float32))
    np.testing.assert_allclose(sent[1] + velocity[1], total, rtol=1e-6)


def test_powersgd_memory_keeps_what_bfloat16_updates_round_away():
    """``sum of updates + e = sum of gradients`` with one worker, each update as delivered."""
    tx = compjax.powersgd(1, None, min_compression_rate=1.0)
    g = (jnp.arange(18.0).reshape(6, 3) / 7 + 0.001).astype(BF16)
    sent, state = scanned(tx, 50)(g)
    assert state.error.dtype == jnp.float32
    np.testing.assert_allclose(
        sent + state.error[0], 50 * g.astype(jnp.float32), rtol=1e-5, atol=1e-5
    )


# --- optax.apply_if_finite --------------------------------------------------------------------


#: One worker (axis_name=None): apply_if_finite then sees every worker's input.
ALL_SINGLE = {
    "compress(qsgd)": lambda: compjax.compress(compjax.qsgd(4), None),
    "error_feedback(top_k)": lambda: compjax.error_feedback(compjax.top_k(ratio=0.3), None),
    "ef21(top_k)": lambda: compjax.ef21(compjax.top_k(ratio=0.3), None),
    "diana(qsgd)": lambda: compjax.diana(compjax.qsgd(4), None),
    "dgc": lambda: compjax.dgc(None, 0.3, min_size=4, sampled_threshold=False),
    "powersgd": lambda: compjax.powersgd(1, None, min_compression_rate=1.0),
    "signum": lambda: compjax.sign_majority_vote(None, 0.9),
    "terngrad_allreduce": lambda: compjax.terngrad_allreduce(None),
    "strom_threshold": lambda: compjax.strom_threshold(None, 0.05, budget=0.5),
}


@pytest.mark.parametrize(
    "name",
    [
        n
        if n in ("error_feedback(top_k)", "dgc", "strom_threshold")
        else pytest.param(n, marks=pytest.mark.slow)
        for n in ALL_SINGLE
    ],
)
def test_apply_if_finite_skips_a_nan_step_and_continues(name, dtype=BF16):
    opt = optax.apply_if_finite(optax.chain(ALL_SINGLE[name](), optax.sgd(0.1)), 3)
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    grads = [jax.tree.map(lambda a: a[0], grads_at(t, dtype)) for t in range(3)]
    nan = jax.tree.map(lambda a: a.at[0].set(jnp.nan), grads[1])

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def train(gs):
        p, s = params, opt.init(params)
        for g in gs:
            p, s = step(p, s, g)
        return p, s

    p1, s1 = train([grads[0], nan, grads[2]])
    p2, s2 = train([grads[0], grads[2]])
    assert int(s1.total_notfinite) == 1
    got, want = jax.tree.leaves((p1, s1.inner_state)), jax.tree.leaves((p2, s2.inner_state))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_variance_based_with_apply_if_finite_on_the_optimizer_that_follows():
    """The per-example input has another shape than the update, so optax's
    ``apply_if_finite`` cannot wrap ``variance_based`` itself (its skip branch
    returns zeros of the input's shape); wrapping the optimizer that follows
    skips the step, and ``variance_based`` keeps its whole state."""
    vb = compjax.variance_based(None, budget=0.5)
    opt = optax.chain(vb, optax.apply_if_finite(optax.sgd(0.1), 3))
    examples = [grads_at(t) for t in range(3)]  # per-example gradients, a batch of 2
    nan = jax.tree.map(lambda a: a.at[0, 0].set(jnp.nan), examples[1])

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def train(gs):
        p, s = PARAMS, opt.init(PARAMS)
        for g in gs:
            p, s = step(p, s, g)
        return p, s

    p1, s1 = train([examples[0], nan, examples[2]])
    p2, s2 = train([examples[0], examples[2]])
    assert int(s1[1].total_notfinite) == 1
    for a, b in zip(jax.tree.leaves((p1, s1[0])), jax.tree.leaves((p2, s2[0])), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scatter_gather_server_memory_keeps_float32_precision():
    """The shard owner's memory is returned as computed (float32), not rounded to bfloat16."""
    x = jnp.array([1.0, 0.003, 1.0, 0.003], BF16)  # two workers: shards of 2 entries
    memory = jnp.array([0.0, 1e-4, 0.0, 1e-4], jnp.float32)  # not a bfloat16 number

    def one(_):
        sent = compjax.compressed_mean(
            compjax.top_k(k=1), jax.random.key(0), x, "data", "scatter_gather", memory
        )
        return sent.mean, sent.memory

    mean, new = jax.jit(jax.vmap(one, axis_name="data"))(jnp.arange(2))
    assert mean.dtype == BF16 and new.dtype == jnp.float32
    # Each owner sends the sum 2 of its shard's first entry and keeps the rest.
    np.testing.assert_array_equal(new[0], np.float32([0, 1e-4, 0, 0]))
    np.testing.assert_array_equal(new[1], np.float32([0, 0, 0, 1e-4]))
