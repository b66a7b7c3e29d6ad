"""The optax transformations: identical under vmap, pmap and shard_map, and correct.

Worker counts and shapes are fixed so that each transformation compiles a
bounded number of times.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import compjax

P = jax.P
N = 8
PARAMS = {"w": jnp.ones((5, 3)), "b": jnp.zeros(3)}

TRANSFORMS = {
    "compress(qsgd)": lambda ax: compjax.compress(compjax.qsgd(4), ax),
    "compress(rand_k shared)": lambda ax: compjax.compress(
        compjax.rand_k(ratio=0.5, shared_seed=True), ax
    ),
    "compress(cast)": lambda ax: compjax.compress(compjax.cast("bfloat16"), ax),
    "error_feedback(top_k)": lambda ax: compjax.error_feedback(compjax.top_k(ratio=0.3), ax),
    "error_feedback(scaled_sign, flatten)": lambda ax: compjax.error_feedback(
        compjax.scaled_sign(), ax, flatten=True
    ),
    "ef21(top_k)": lambda ax: compjax.ef21(compjax.top_k(ratio=0.3), ax),
    "diana(qsgd)": lambda ax: compjax.diana(compjax.qsgd(2), ax),
    "sign_majority_vote(momentum)": lambda ax: compjax.sign_majority_vote(ax, momentum=0.9),
    "sign_majority_vote(psum)": lambda ax: compjax.sign_majority_vote(ax, via="psum"),
    "sign_majority_vote(scatter_gather)": lambda ax: compjax.sign_majority_vote(
        ax, momentum=0.9, via="scatter_gather"
    ),
    "terngrad_allreduce": lambda ax: compjax.terngrad_allreduce(ax),
    "terngrad_allreduce(own scalers)": lambda ax: compjax.terngrad_allreduce(
        ax, share_scaler=False
    ),
    # The compressed all-reduce (compjax.exchange): shards, all_to_all, all_gather.
    "compress(qsgd, scatter_gather)": lambda ax: compjax.compress(
        compjax.qsgd(4), ax, exchange="scatter_gather"
    ),
    "error_feedback(top_k, scatter_gather)": lambda ax: compjax.error_feedback(
        compjax.top_k(ratio=0.3), ax, exchange="scatter_gather"
    ),
    "ef21(top_k, scatter_gather)": lambda ax: compjax.ef21(
        compjax.top_k(ratio=0.3), ax, exchange="scatter_gather"
    ),
    "diana(qsgd, scatter_gather)": lambda ax: compjax.diana(
        compjax.qsgd(2), ax, exchange="scatter_gather"
    ),
    # The integer all-reduce: a pmax-ed scale, then a psum of packed integer fields.
    "compress(int_quant)": lambda ax: compjax.compress(compjax.int_quant(4), ax),
    "zero_one_adam": lambda ax: compjax.scale_by_zero_one_adam(ax, 1, 1),
}


def worker_grads(n, step=0, params=PARAMS):
    """Deterministic gradients with a leading worker axis."""
    key = jax.random.fold_in(jax.random.key(42), step)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, (n, *p.shape)) for k, p in zip(keys, leaves, strict=True)]
    )


def run_vmap(tx, grads_per_step, n, axis="data"):
    """Run ``tx`` for several steps with workers simulated by ``vmap``."""
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(n))
    step = jax.jit(jax.vmap(tx.update, axis_name=axis))
    outs = []
    for grads in grads_per_step:
        upd, state = step(grads, state)
        outs.append(jax.tree.map(lambda u: u[0], upd))
    return outs, state


def run_pmap(tx, grads_per_step, n):
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(n))
    step = jax.pmap(tx.update, axis_name="data")
    outs = []
    for grads in grads_per_step:
        upd, state = step(grads, state)
        outs.append(jax.tree.map(lambda u: u[0], upd))
    return outs


def run_shard_map(tx, grads_per_step, mesh, axis="data"):
    specs = compjax.state_specs(jax.eval_shape(tx.init, PARAMS), axis)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    state = init(PARAMS)
    step = jax.jit(
        jax.shard_map(tx.update, mesh=mesh, in_specs=(P(axis), specs), out_specs=(P(), specs))
    )
    outs = []
    for grads in grads_per_step:
        flat = jax.tree.map(
            lambda g: jax.device_put(g.reshape((-1, *g.shape[2:])), NamedSharding(mesh, P(axis))),
            grads,
        )
        upd, state = step(flat, state)
        outs.append(upd)
    return outs


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# pmap runs the same collectives as shard_map: a few transformations in the
# fast suite, all of them with -m slow.
PMAP_FAST = {"sign_majority_vote(psum)"}
# shard_map: one transformation per code path in the fast suite (a compressor through each
# exchange, error feedback, the votes, the integer sums), all of them with -m slow.
SHARD_MAP_FAST = {
    "compress(qsgd)",
    "error_feedback(top_k)",
    "sign_majority_vote(momentum)",
    "sign_majority_vote(psum)",
    "sign_majority_vote(scatter_gather)",
    "terngrad_allreduce",
    "error_feedback(top_k, scatter_gather)",
    "compress(int_quant)",
}


def _tolerance(name):
    # bfloat16 all-reduce: the summation order may differ; each partial sum of
    # 8 unit-scale values rounds in bfloat16 (2^-8 relative).
    return 8 * 2.0**-8 if "cast" in name else 1e-6


@pytest.mark.parametrize(
    "name",
    [n if n in SHARD_MAP_FAST else pytest.param(n, marks=pytest.mark.slow) for n in TRANSFORMS],
)
def test_shard_map_agrees_with_vmap(name):
    tx = TRANSFORMS[name]("data")
    grads = [worker_grads(N, t) for t in range(3)]
    simulated, _ = run_vmap(tx, grads, N)
    mesh = jax.make_mesh((N,), ("data",))
    assert_trees_close(run_shard_map(tx, grads, mesh), simulated, atol=_tolerance(name))


@pytest.mark.parametrize(
    "name",
    [n if n in PMAP_FAST else pytest.param(n, marks=pytest.mark.slow) for n in TRANSFORMS],
)
def test_pmap_agrees_with_vmap(name):
    tx = TRANSFORMS[name]("data")
    grads = [worker_grads(N, t) for t in range(3)]
    simulated, _ = run_vmap(tx, grads, N)
    assert_trees_close(run_pmap(tx, grads, N), simulated, atol=_tolerance(name))


@pytest.mark.parametrize(
    "name", [pytest.param("diana(qsgd)", marks=pytest.mark.slow), "error_feedback(top_k)"]
)
def test_two_dimensional_mesh_reducing_over_one_axis(name):
    """A (4, 2) mesh: data-parallel over 'data', replicated over 'model'."""
    tx = TRANSFORMS[name]("data")
    grads = [worker_grads(4, t) for t in range(3)]
    simulated, _ = run_vmap(tx, grads, 4)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert_trees_close(run_shard_map(tx, grads, mesh), simulated)


def test_tuple_axis_name_reduces_over_both_axes():
    tx = compjax.compress(compjax.qsgd(4), ("data", "model"))
    grads = worker_grads(N)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    specs = compjax.state_specs(jax.eval_shape(tx.init, PARAMS), ("data", "model"))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)
    flat = jax.tree.map(
        lambda g: jax.device_put(
            g.reshape((-1, *g.shape[2:])), NamedSharding(mesh, P(("data", "model")))
        ),
        grads,
    )
    upd, _ = jax.jit(
        jax.shard_map(
            tx.update,
            mesh=mesh,
            in_specs=(P(("data", "model")), specs),
            out_specs=(P(), specs),
        )
    )(flat, state)
    nested = jax.vmap(jax.vmap(tx.update, axis_name="model"), axis_name="data")
    state_v = jax.vmap(jax.vmap(lambda _: tx.init(PARAMS)))(jnp.zeros((4, 2)))
    grid = jax.tree.map(lambda g: g.reshape(4, 2, *g.shape[1:]), grads)
    upd_v, _ = jax.jit(nested)(grid, state_v)
    assert_trees_close(upd, jax.tree.map(lambda u: u[0, 0], upd_v))


@partial(jax.jit, static_argnums=(0, 2))
def _compressed_means(comp, x, n, seed):
    """Compressed means over ``n`` vmap-simulated workers for 2000 keys."""

    def one(key):
        return jax.vmap(lambda xi: compjax.compressed_mean(comp, key, xi, "w").mean, axis_name="w")(
            jnp.broadcast_to(x, (n, *x.shape))
        )[0]

    return jax.vmap(one)(jax.random.split(jax.random.key(seed), 2000))


def test_workers_draw_independent_noise():
    """Averaging n workers divides the variance by n (it would not with one key)."""
    comp = compjax.rand_k(k=4)  # omega = d/k - 1 exactly, for every x
    x = jnp.linspace(-1.0, 2.0, 32)
    norm2 = float(jnp.sum(x**2))
    for n in (1, 8):
        draws = np.asarray(_compressed_means(comp, x, n, 0), np.float64)
        err = np.sum((draws - np.asarray(x)) ** 2, axis=1)
        expected = comp.omega(32) * norm2 / n
        se = err.std(ddof=1) / np.sqrt(len(err))
        assert abs(err.mean() - expected) < 5 * se, (n, err.mean(), expected)


def test_error_feedback_loses_nothing():
    """sum_t sent_t + mean_i e_i(T) = sum_t mean_i g_i(t), exactly up to rounding."""
    tx = compjax.error_feedback(compjax.top_k(k=2), "data")
    grads = [worker_grads(4, t) for t in range(6)]
    outs, state = run_vmap(tx, grads, 4)
    sent = jax.tree.map(lambda *u: sum(u), *outs)
    residual = jax.tree.map(lambda e: e.mean(axis=(0, 1)), state.error)
    total = jax.tree.map(lambda *g: sum(x.mean(0) for x in g), *grads)
    assert_trees_close(jax.tree.map(jnp.add, sent, residual), total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_unbound_axis_name_is_named_in_the_error(name):
    tx = TRANSFORMS[name]("batch")
    grads = worker_grads(2)
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(2))
    with pytest.raises(ValueError, match="axis_name 'batch' is not bound"):
        jax.vmap(tx.update, axis_name="data")(grads, state)
    with pytest.raises(ValueError, match="axis_name 'batch' is not bound"):
        tx.update(PARAMS, tx.init(PARAMS))  # no mapped axis at all


def test_state_for_other_params_is_rejected():
    tx = compjax.error_feedback(compjax.top_k(k=1), None)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="structure"):
        tx.update({"w": jnp.ones((5, 3))}, state)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": jnp.ones((5, 4)), "b": jnp.ones(3)}, state)


def test_single_worker_axis_none():
    tx = compjax.error_feedback(compjax.top_k(k=2), None)
    grads = jax.tree.map(lambda g: g[0], worker_grads(1))
    upd, state = tx.update(grads, tx.init(PARAMS))
    assert sum(int(jnp.count_nonzero(u)) for u in jax.tree.leaves(upd)) == 4
    assert_trees_close(jax.tree.map(lambda u, e: u + e[0], upd, state.error), grads)


def test_sign_majority_vote_semantics():
    g = {"x": jnp.array([[1.0, -1.0, 0.0, 2.0], [3.0, -2.0, 0.0, -1.0], [-1.0, -5.0, 0.0, 0.0]])}
    cases = [("all_gather", [1, -1, 1, 1]), ("psum", [1, -1, 0, 0])]
    cases += [("scatter_gather", [1, -1, 1, 1])]  # the all-gather's vote, tallied per shard
    for via, expect in cases:
        tx = compjax.sign_majority_vote("data", via=via)
        state = jax.vmap(lambda _, tx=tx: tx.init({"x": jnp.zeros(4)}))(jnp.arange(3))
        upd, _ = jax.vmap(tx.update, axis_name="data")(g, state)
        np.testing.assert_array_equal(upd["x"], np.broadcast_to(expect, (3, 4)))


@pytest.mark.parametrize(
    "n", [pytest.param(n, marks=pytest.mark.slow) if n != 3 else n for n in (2, 3, 4)]
)
def test_sign_vote_scatter_gather_is_the_all_gather_vote(n):
    """Every worker gets the all-gather's vote, ties (even n) included; d = 37 pads the
    last shard.  The messages: the packed signs of n shards, then one shard's outcome in
    1 bit per entry (odd n) or 2 (even n, a tie is a third value)."""
    signs = jax.random.choice(jax.random.key(n), jnp.array([-1.0, 0.0, 2.0]), (n, 37))
    votes = {}
    for via in ("all_gather", "scatter_gather"):
        tx = compjax.sign_majority_vote("data", via=via)
        state = jax.vmap(lambda _, tx=tx: tx.init({"x": jnp.zeros(37)}))(jnp.arange(n))
        votes[via] = np.asarray(jax.vmap(tx.update, axis_name="data")({"x": signs}, state)[0]["x"])
    np.testing.assert_array_equal(votes["scatter_gather"], votes["all_gather"])
    assert (votes["all_gather"] == 0).any() == (n % 2 == 0)  # the ties are exercised
    m, width = -(-37 // n), 1 if n % 2 else 2
    report = compjax.communication(
        compjax.sign_majority_vote("data", via="scatter_gather"),
        {"x": jnp.zeros(37)},
        "data",
        num_workers=n,
    )
    scatter, gather = n * -(-m // 32) * 32, -(-m * width // 32) * 32  # whole uint32 words
    assert report.payloads == (("flag", 8), ("scatter", scatter), ("gather", gather))


@partial(jax.jit, static_argnums=0)
def _terngrad_means(clip, grads, seed):
    tx = compjax.terngrad_allreduce("data", clip=clip, seed=seed)

    def one(s):
        state = jax.vmap(lambda _: tx.init({"x": grads[0]}))(jnp.arange(4))
        state = state._replace(key=jax.vmap(lambda _: compjax.draws.raw_key(s))(state.key))
        return jax.vmap(tx.update, axis_name="data")({"x": grads}, state)[0]["x"][0]

    return jax.vmap(one)(jax.random.split(jax.random.key(seed), 4000))


def test_terngrad_allreduce_is_unbiased_for_clipped_gradients():
    grads = jax.random.normal(jax.random.key(3), (4, 16)) * jnp.arange(1, 17)
    for clip in (None, 1.0):
        means = np.asarray(_terngrad_means(clip, grads, 0), np.float64)
        clipped = [compjax.compressors.terngrad.clip_to_std(g, clip) if clip else g for g in grads]
        target = np.mean(np.asarray(clipped, np.float64), axis=0)
        se = means.std(axis=0, ddof=1) / np.sqrt(len(means))
        z = (means.mean(0) - target) / np.where(se > 0, se, 1.0)
        assert np.sum(z**2) < 60.0, (clip, np.sum(z**2))  # chi2(16) 1e-6 quantile: 59.7
    # Clipping changes the target: the clipped run is not unbiased for the raw mean.
    raw = np.asarray(grads, np.float64).mean(0)
    assert np.abs(means.mean(0) - raw).max() > 10 * se.max()


def test_communication_is_counted_from_payloads():
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}
    sizes = [32, 64 * 32]  # leaf order: b, w
    qsgd = compjax.qsgd(4)
    report = compjax.communication(compjax.diana(qsgd, "data"), params, "data", 2)
    assert report.dense_bits == 32 * sum(sizes)
    flag = 8  # the non-finite flag
    assert report.bits_per_worker == sum(qsgd.bits((d,)) for d in sizes) + flag
    # The same through a chain, a wrapper and MultiSteps.
    wrapped = optax.MultiSteps(
        optax.chain(compjax.compress(qsgd, "data"), optax.adam(0.1)), every_k_schedule=2
    )
    wrapped_report = compjax.communication(wrapped, params, "data", 2)
    assert wrapped_report.bits_per_worker == report.bits_per_worker
    vote = compjax.communication(compjax.sign_majority_vote("data"), params, "data", 2)
    assert vote.bits_per_worker == sum(sizes) + flag
    tern = compjax.communication(compjax.terngrad_allreduce("data"), params, "data", 2)
    assert tern.bits_per_worker == sum(8 * d + 32 for d in sizes) + flag
    assert compjax.communication(optax.adam(0.1), params, "data", 2).bits_per_worker == 0


def _shard_map_sgd_step(tx, local):
    """A shard_map training step on a linear least-squares loss, as the docs write it."""
    mesh = jax.make_mesh((N,), ("data",))
    params = {"w": jnp.zeros(4)}
    opt = optax.chain(tx, optax.sgd(0.1))
    specs = compjax.state_specs(jax.eval_shape(opt.init, params), "data")
    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def loss(p, x, y):
        return 0.5 * jnp.mean((x @ p["w"] - y) ** 2)

    def step(p, s, x, y):
        grads = jax.grad(loss)(compjax.worker_params(p, "data") if local else p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates)

    x = jax.random.normal(jax.random.key(0), (8 * N, 4))
    y = x @ jnp.arange(4.0)
    sharded = NamedSharding(mesh, P("data"))
    specs_in = (P(), specs, P("data"), P("data"))
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs_in, out_specs=P()))
    new = fn(params, state, jax.device_put(x, sharded), jax.device_put(y, sharded))
    return new["w"], params["w"] - 0.1 * jax.grad(loss)(params, x, y)["w"]


def test_worker_params_gives_each_worker_its_own_gradient():
    got, pooled_sgd = _shard_map_sgd_step(compjax.compress(compjax.identity(), "data"), True)
    np.testing.assert_allclose(got, pooled_sgd, rtol=1e-5)
    # Without it JAX hands every worker the sum over workers (N times too large): refused.
    with pytest.raises(ValueError, match="worker_params"):
        _shard_map_sgd_step(compjax.compress(compjax.identity(), "data"), False)
    # Under vmap it changes nothing.
    tree = {"a": jnp.ones(3)}
    out = jax.vmap(lambda t: compjax.worker_params(t, "data"), axis_name="data")(tree)
    np.testing.assert_array_equal(out["a"], tree["a"])
