"""The exchanges of compjax.exchange: scatter-gather and hierarchical.

Lossless compressors give the exact mean; biased ones lose nothing (what is
applied plus every memory equals what was sent); unbiased ones stay
unbiased; nested vmap and shard_map on a (hosts, local) mesh agree; bits are
counted per axis.  The exact two-stage variance is checked against the
library's code in ``proofs_checks/two_stage.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from scipy import stats

import compjax
from compjax.exchange import compressed_mean, keeps_memory

P = jax.P
N = 4
D = 37  # not a multiple of the number of shards
AXES = ("hosts", "local")
MESH_SHAPE = (2, 4)
TOP_K = compjax.top_k(ratio=0.3)
QSGD = compjax.qsgd(levels=2)

EXCHANGES = {
    "scatter_gather": (("data",), "scatter_gather"),
    "hierarchical(scatter_gather)": (AXES, compjax.hierarchical("local", "scatter_gather")),
    "hierarchical(all_gather)": (AXES, compjax.hierarchical("local", "all_gather")),
}


def axis_arg(axes):
    return axes[0] if len(axes) == 1 else axes


def shape_for(axes, *tail):
    return ((N,) if len(axes) == 1 else MESH_SHAPE) + tail


def normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def nested_vmap(fn, axes):
    for name in reversed(axes):
        fn = jax.vmap(fn, axis_name=name)
    return fn


def vmapped(tx, axes):
    """``(init, update)`` with one leading worker axis per name (nested vmap)."""
    init = tx.init
    for _ in axes:
        init = jax.vmap(init)
    return jax.jit(init), jax.jit(nested_vmap(tx.update, axes))


def worker_total(x, axes):
    """Sum over the leading worker axes."""
    return jnp.sum(x, axis=tuple(range(len(axes))))


def field_total(field, axes):
    """Sum over workers of a per-worker state field (empty tuple: none kept)."""
    if isinstance(field, tuple):
        return 0.0
    return worker_total(field, axes)[0]


@pytest.mark.parametrize("comp", [compjax.identity(), compjax.rand_k(ratio=0.5, shared_seed=True)])
@pytest.mark.parametrize("name", list(EXCHANGES))
def test_lossless_or_linear_compressor_gives_the_pooled_mean(comp, name):
    """identity: exactly the mean; a linear compressor: the same as over all_gather."""
    axes, exchange = EXCHANGES[name]
    x = normal(0, shape_for(axes, D))
    init, update = vmapped(compjax.compress(comp, axis_arg(axes), exchange=exchange), axes)
    out, _ = update(x, init(x))
    flat = out.reshape(-1, D)
    assert jnp.all(flat == flat[0])
    if isinstance(comp, type(compjax.identity())):
        np.testing.assert_allclose(flat[0], x.reshape(-1, D).mean(0), atol=1e-6)
    else:
        assert jnp.all(jnp.isfinite(flat))


HIERARCHICAL_SG = "hierarchical(scatter_gather)"


def exchange_cases(comps, slow=()):
    """``(comp, name)`` for every exchange; the pairs in ``slow`` (costly compiles whose code
    paths a faster pair covers) run with -m slow."""
    return [
        pytest.param(c, n, id=f"{n}-{c}", marks=[pytest.mark.slow] if (c, n) in slow else [])
        for n in EXCHANGES
        for c in comps
    ]


@pytest.mark.parametrize(
    ("comp", "name"),
    exchange_cases(
        [TOP_K, compjax.scaled_sign(), QSGD],
        slow=[
            (QSGD, HIERARCHICAL_SG),
            (compjax.scaled_sign(), HIERARCHICAL_SG),
            (QSGD, "hierarchical(all_gather)"),
        ],
    ),
)
def test_exchange_accounts_for_every_entry(comp, name):
    """``sum_i local_i + sum m(before) = n mean + sum m(after)``, exactly (float32)."""
    axes, exchange = EXCHANGES[name]
    x = normal(1, shape_for(axes, D))
    n = x.size // D

    def one(xi, mi):
        got = compressed_mean(comp, jax.random.key(3), xi, axis_arg(axes), exchange, mi)
        return got.mean, got.local, got.memory

    exchanged = jax.jit(nested_vmap(one, axes))
    # A memory as the exchange leaves it (each owner's entries), from a first round.
    memory = (
        exchanged(normal(2, x.shape), jnp.zeros_like(x))[2]
        if keeps_memory(comp, exchange)
        else None
    )
    mean, local, new_memory = exchanged(x, memory)
    left = worker_total(local, axes) + (0 if memory is None else worker_total(memory, axes))
    right = n * mean.reshape(-1, D)[0] + (
        0 if new_memory is None else worker_total(new_memory, axes)
    )
    np.testing.assert_allclose(left, right, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "dtype"),  # (bfloat16 through the hierarchical exchanges: with -m slow)
    [
        pytest.param(
            n,
            d,
            id=f"{n}-{jnp.dtype(d).name}",
            marks=[pytest.mark.slow] if d == jnp.bfloat16 and n.startswith("hier") else [],
        )
        for n in EXCHANGES
        for d in (jnp.float32, jnp.bfloat16)
    ],
)
def test_error_feedback_loses_nothing(name, dtype):
    """Over steps: n * (sum of updates) + worker memories + server memories = sum of inputs."""
    axes, exchange = EXCHANGES[name]
    tx = compjax.error_feedback(TOP_K, axis_arg(axes), exchange=exchange)
    init, update = vmapped(tx, axes)
    x0 = normal(10, shape_for(axes, D), dtype)
    state = init(x0)
    n = x0.size // D
    applied = inputs = jnp.zeros(D, jnp.float32)
    for step in range(4):
        x = normal(10 + step, x0.shape, dtype)
        out, state = update(x, state)
        applied += n * out.reshape(-1, D)[0].astype(jnp.float32)
        inputs += worker_total(x.astype(jnp.float32), axes)
    kept = field_total(state.error, axes) + field_total(state.server_error, axes)
    assert not isinstance(state.server_error, tuple) or "all_gather" in name
    tol = 1e-4 if dtype == jnp.float32 else 0.1  # bf16 error memories round (kept in bf16)
    np.testing.assert_allclose(applied + kept, inputs, atol=tol)


@pytest.mark.parametrize(
    "name", ["scatter_gather", pytest.param("hierarchical(scatter_gather)", marks=pytest.mark.slow)]
)
def test_two_stage_mean_of_unbiased_compressor_is_unbiased(name):
    """QSGD over both stages: the mean of 4000 draws is the pooled mean (chi-square, p = 1e-6)."""
    axes, exchange = EXCHANGES[name]
    x = normal(20, shape_for(axes, D))

    def draw(key):
        def one(xi):
            return compressed_mean(QSGD, key, xi, axis_arg(axes), exchange).mean

        return nested_vmap(one, axes)(x).reshape(-1, D)[0]

    keys = jax.random.split(jax.random.key(21), 4000)
    draws = np.asarray(jax.jit(jax.vmap(draw))(keys), np.float64)
    target = np.asarray(x, np.float64).reshape(-1, D).mean(0)
    var = draws.var(0, ddof=1)
    z = (draws.mean(0) - target) / np.sqrt(var / len(draws))
    assert float(np.sum(z**2)) < stats.chi2.isf(1e-6, D)


def test_diana_shift_stays_the_mean_of_the_local_shifts():
    """The second-stage residual is attributed to the shard owner: h = mean_i h_i exactly."""
    tx = compjax.diana(QSGD, "data", exchange="scatter_gather")
    init, update = vmapped(tx, ("data",))
    state = init(normal(30, (N, D)))
    for step in range(3):
        _, state = update(normal(30 + step, (N, D)), state)
    np.testing.assert_allclose(state.shift[0], state.local_shift.mean(0)[0], atol=1e-5)


def test_ef21_estimate_and_server_memories_are_the_local_estimates():
    """EF21 over scatter-gather with top-k: n g + sum_j m_j = sum_i g_i after every step."""
    tx = compjax.ef21(TOP_K, "data", exchange="scatter_gather")
    init, update = vmapped(tx, ("data",))
    state = init(normal(70, (N, D)))
    for step in range(3):
        _, state = update(normal(70 + step, (N, D)), state)
        left = N * state.estimate[0] + state.server_error.sum(0)[0]
        np.testing.assert_allclose(left, state.local.sum(0)[0], atol=1e-4)
    assert np.abs(np.asarray(state.server_error)).max() > 0


THRESHOLD_TOP_K = compjax.top_k(ratio=0.5, select="threshold")  # 4 to 6 of a 9-10 entry shard


@pytest.mark.parametrize("exchange", ["all_gather", "scatter_gather"])
def test_threshold_top_k_in_error_feedback_and_ef21_loses_nothing(exchange):
    """The sampled-threshold top-k through error feedback and EF21, on the whole vector or
    per shard: what was sent plus every memory is what came in; EF21's server memories
    with its estimate add up to the local estimates."""
    ef_init, ef_update = vmapped(
        compjax.error_feedback(THRESHOLD_TOP_K, "data", exchange=exchange), ("data",)
    )
    ef21_init, ef21_update = vmapped(
        compjax.ef21(THRESHOLD_TOP_K, "data", exchange=exchange), ("data",)
    )
    ef, ef21 = ef_init(normal(80, (N, D))), ef21_init(normal(80, (N, D)))
    applied = inputs = jnp.zeros(D, jnp.float32)
    for step in range(3):
        x = normal(80 + step, (N, D))
        out, ef = ef_update(x, ef)
        applied += N * out[0]
        inputs += x.sum(0)
        _, ef21 = ef21_update(x, ef21)
        server = 0.0 if isinstance(ef21.server_error, tuple) else ef21.server_error.sum(0)[0]
        np.testing.assert_allclose(N * ef21.estimate[0] + server, ef21.local.sum(0)[0], atol=1e-4)
    kept = field_total(ef.error, ("data",)) + field_total(ef.server_error, ("data",))
    np.testing.assert_allclose(applied + kept, inputs, atol=1e-4)
    assert np.count_nonzero(np.asarray(ef.error)) > 0  # something was held back


def test_psum_together_sums_each_array_in_one_message_per_dtype_and_variation():
    """Under shard_map: float32 arrays replicated over the model axis in one message, the
    one that varies over it in another, the int32 one in a third; each its own sum, in
    its own dtype and shape."""
    from compjax import collectives

    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def f(x):
        w = jax.lax.axis_index("data").astype(jnp.float32)
        arrays = [w * jnp.ones((2, 3)), w + jnp.arange(5.0), x[0], jnp.int32(2) * (w > 0)]
        sums = collectives.psum_together(arrays, "data")
        return tuple(s[None] for s in sums)

    specs = (P("model"),) * 4
    run = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=specs))
    x = jax.device_put(jnp.arange(2.0 * 7).reshape(2, 7), NamedSharding(mesh, P("model")))
    ones, ramp, mine, ints = (np.asarray(a) for a in run(x))
    np.testing.assert_array_equal(ones[0], np.full((2, 3), 6.0))  # 0 + 1 + 2 + 3
    np.testing.assert_array_equal(ramp[0], 6.0 + 4 * np.arange(5.0))
    np.testing.assert_array_equal(mine, 4 * np.arange(14.0).reshape(2, 7))
    assert ints.dtype == jnp.int32 and np.asarray(ints).tolist() == [6, 6]


def test_a_branching_compressors_blocks_keep_their_branches():
    """Scatter-gather compresses a worker's blocks one at a time when the compressor branches
    on its data (``branches``): the program keeps the threshold's conditionals (batched with
    ``vmap``, each became both branches, the exact top-k fallback run on every block), with
    the same payloads as compressing each block alone."""
    from compjax.exchange import scatter

    assert THRESHOLD_TOP_K.branches and TOP_K.branches and not compjax.qsgd(levels=4).branches
    assert compjax.chain(THRESHOLD_TOP_K, compjax.qsgd(levels=4)).branches
    keys, blocks = jax.random.split(jax.random.key(3), N), normal(95, (N, 10))
    run = jax.jit(lambda k, b: scatter.compress_blocks(THRESHOLD_TOP_K, k, b))
    got = run(keys, blocks)
    for i in range(N):
        alone = THRESHOLD_TOP_K.compress(keys[i], blocks[i])
        for name, wire in alone.wire.items():
            np.testing.assert_array_equal(got.wire[name][i], wire)
    jaxpr = str(jax.make_jaxpr(run)(keys, blocks))
    batched = str(jax.make_jaxpr(jax.vmap(THRESHOLD_TOP_K.compress))(keys, blocks))
    assert " cond[" in jaxpr and " cond[" not in batched


def test_threshold_top_k_scatter_gather_under_shard_map_is_the_simulation():
    tx = compjax.error_feedback(THRESHOLD_TOP_K, "data", exchange="scatter_gather")
    xs = [normal(90 + t, (N, D)) for t in range(2)]
    outs, _ = _shard_map_run(tx, xs, jax.make_mesh((N,), ("data",)), "data")
    init, update = vmapped(tx, ("data",))
    simulated = init(xs[0])
    for x, got in zip(xs, outs, strict=True):
        out, simulated = update(x, simulated)
        np.testing.assert_allclose(got, out[0], rtol=1e-6, atol=1e-7)


def _shard_map_run(tx, xs, mesh, axes):
    params = jnp.zeros(D)
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), axes)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    update = jax.jit(
        jax.shard_map(tx.update, mesh=mesh, in_specs=(P(axes), specs), out_specs=(P(), specs))
    )
    state, outs = init(params), []
    for x in xs:
        out, state = update(jax.device_put(x.reshape(-1), NamedSharding(mesh, P(axes))), state)
        outs.append(out)
    return outs, state


@pytest.mark.parametrize(
    "build",
    [
        lambda ex: compjax.error_feedback(TOP_K, AXES, exchange=ex),
        pytest.param(lambda ex: compjax.diana(QSGD, AXES, exchange=ex), marks=pytest.mark.slow),
    ],
    ids=["error_feedback(top_k)", "diana(qsgd)"],
)
def test_shard_map_on_a_hosts_local_mesh_agrees_with_nested_vmap(build):
    tx = build(compjax.hierarchical("local", "scatter_gather"))
    xs = [normal(40 + t, (*MESH_SHAPE, D)) for t in range(3)]
    init, update = vmapped(tx, AXES)
    state = init(xs[0])
    simulated = []
    for x in xs:
        out, state = update(x, state)
        simulated.append(out[0, 0])
    mesh = jax.make_mesh(MESH_SHAPE, AXES)
    outs, mesh_state = _shard_map_run(tx, [x.reshape(-1, D) for x in xs], mesh, AXES)
    for a, b in zip(outs, simulated, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for a, b in zip(jax.tree.leaves(mesh_state), jax.tree.leaves(state), strict=True):
        a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(8, -1)
        # per-worker fields hold every worker's part; replicated ones one copy
        np.testing.assert_allclose(a, b.reshape(-1) if a.size == b.size else b[0], atol=1e-6)


def test_hierarchical_lossless_step_equals_pooled_sgd():
    """A shard_map training step on a (hosts, local) mesh: SGD on the pooled mean gradient."""
    mesh = jax.make_mesh(MESH_SHAPE, AXES)
    w0 = {"w": normal(50, (6, 3)), "b": jnp.zeros(3)}
    xb, yb = normal(51, (32, 6)), normal(52, (32, 3))
    opt = optax.chain(
        compjax.compress(compjax.identity(), AXES, exchange=compjax.hierarchical("local")),
        optax.sgd(0.1),
    )

    def loss(w, x, y):
        return jnp.mean((x @ w["w"] + w["b"] - y) ** 2)

    specs = compjax.state_specs(jax.eval_shape(opt.init, w0), AXES)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P(AXES), P(AXES)), out_specs=(P(), specs))
    def step(w, s, x, y):
        g = jax.grad(loss)(compjax.worker_params(w, AXES), x, y)
        u, s = opt.update(g, s, w)
        return optax.apply_updates(w, u), s

    state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(w0)
    shard = NamedSharding(mesh, P(AXES))
    w, ref = w0, w0
    for _ in range(3):
        w, state = step(w, state, jax.device_put(xb, shard), jax.device_put(yb, shard))
        g = jax.grad(loss)(ref, xb, yb)
        ref = jax.tree.map(lambda p, gi: p - 0.1 * gi, ref, g)
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_bits_are_counted_per_axis():
    """Fast axis: the padded array reduce-scattered, the shard all-gathered (float32);
    slow axis: the shard's compressed scatter and gather."""
    tx = compjax.compress(QSGD, AXES, exchange=compjax.hierarchical("local", "scatter_gather"))
    report = compjax.communication(tx, jnp.zeros(D), AXES, MESH_SHAPE)
    fast_shard = -(-D // 4)  # 10 entries per local worker, 40 padded
    slow_shard = -(-fast_shard // 2)  # 5 entries per host
    kinds = dict(report.payloads)
    assert kinds["fast_reduce_scatter"] == 32 * 4 * fast_shard
    assert kinds["fast_all_gather"] == 32 * fast_shard
    assert kinds["scatter"] == 2 * QSGD.bits((slow_shard,))
    assert kinds["gather"] == QSGD.bits((slow_shard,))
    # ring traffic: 3/4 of the reduce-scatter's input and 3 gathered shards on the fast
    # axis (4 workers); half the scatter and one gathered shard on the slow one (2 hosts)
    assert report.fast_bits == 3 / 4 * 32 * 4 * fast_shard + 3 * 32 * fast_shard
    flag = 2 * 7 / 8 * 8  # an all-reduce over all 8 workers
    assert report.slow_bits == kinds["scatter"] / 2 + kinds["gather"] + flag


@pytest.mark.parametrize("n", [2, 4, 8])
def test_scatter_gather_sends_one_message_in_shards_and_one_shard(n):
    d = 1000
    report = compjax.communication(
        compjax.compress(QSGD, "data", exchange="scatter_gather"), jnp.zeros(d), "data", n
    )
    kinds = dict(report.payloads)
    assert kinds["scatter"] == n * QSGD.bits((d // n,))
    assert kinds["gather"] == QSGD.bits((d // n,))
    # what leaves a worker: all but its own shard, then its shard to n - 1 others
    sent = dict(report.messages)
    assert sent["scatter"] == (n - 1) * QSGD.bits((d // n,))
    assert sent["gather"] == (n - 1) * QSGD.bits((d // n,))


@pytest.mark.parametrize(
    ("comp", "name"),
    exchange_cases(
        [TOP_K, QSGD], slow=[(QSGD, HIERARCHICAL_SG), (QSGD, "hierarchical(all_gather)")]
    ),
)
def test_zero_gradients_give_zeros(comp, name):
    axes, exchange = EXCHANGES[name]
    init, update = vmapped(compjax.error_feedback(comp, axis_arg(axes), exchange=exchange), axes)
    x = jnp.zeros(shape_for(axes, D))
    out, state = update(x, init(x))
    assert jnp.all(out == 0)
    assert all(jnp.all(leaf == 0) for leaf in jax.tree.leaves((state.error, state.server_error)))


def test_non_finite_gradient_keeps_the_server_memory():
    init, update = vmapped(compjax.compress(TOP_K, "data", exchange="scatter_gather"), ("data",))
    state = init(jnp.zeros((N, D)))
    _, state = update(normal(60, (N, D)), state)
    bad = normal(61, (N, D)).at[2, 5].set(jnp.nan)
    out, after = update(bad, state)
    assert jnp.all(jnp.isnan(out))
    np.testing.assert_array_equal(after.server_error, state.server_error)


def test_server_memory_is_per_worker_state():
    tx = compjax.error_feedback(TOP_K, "data", exchange="scatter_gather")
    specs = compjax.state_specs(jax.eval_shape(tx.init, jnp.zeros(D)), "data")
    assert specs.server_error == P("data")
    plain = compjax.error_feedback(TOP_K, "data").init(jnp.zeros(D))
    assert plain.server_error == ()


def test_bad_exchange_is_rejected_naming_the_argument():
    with pytest.raises(ValueError, match="exchange"):
        compjax.compress(QSGD, "data", exchange="ring")
    with pytest.raises(ValueError, match="fast_axis"):
        compjax.hierarchical(3)
    tx = compjax.compress(QSGD, "data", exchange=compjax.hierarchical("model"))
    with pytest.raises(ValueError, match="fast_axis"):
        jax.vmap(tx.update, axis_name="data")(
            jnp.zeros((N, D)), jax.vmap(tx.init)(jnp.zeros((N, D)))
        )


def test_all_to_all_of_a_value_shared_by_every_worker():
    """A closed-over constant under vmap is transposed like the per-worker copies of it.

    (jax.vmap's own rule for ``all_to_all`` returns extra axes for such an operand.)
    """
    from compjax import collectives

    c = jnp.arange(12.0).reshape(2, 2, 3)
    shared = jax.vmap(lambda _: collectives.all_to_all(c, "data"), axis_name="data")(jnp.arange(2))
    copies = jax.vmap(lambda a: collectives.all_to_all(a, "data"), axis_name="data")(
        jnp.stack([c, c])
    )
    assert shared.shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(shared, copies)


@pytest.mark.parametrize(
    "comp",
    [compjax.scaled_sign(), compjax.cast("bfloat16"), compjax.int_quant(bits=4), TOP_K],
    ids=repr,
)
@pytest.mark.parametrize("name", ["all_gather", "scatter_gather", "hierarchical(all_gather)"])
def test_the_exchanges_finite_flag_says_whether_the_mean_is_finite(comp, name):
    """``Exchanged.finite`` (the overflow check's verdict, which the guard trusts instead of
    reading the mean again) is set on every exchange of several workers and agrees with the
    mean: true for finite gradients, false where one worker's Inf reaches the mean."""
    axes, exchange = EXCHANGES.get(name, (("data",), name))

    def one(x):
        memory = jnp.zeros_like(x) if keeps_memory(comp, exchange) else None
        out = compressed_mean(comp, jax.random.key(3), x, axis_arg(axes), exchange, memory)
        return out.mean, out.finite

    run = jax.jit(nested_vmap(one, axes))
    x = normal(62, shape_for(axes, D))
    for gradient, finite in ((x, True), (x.at[(0,) * len(axes) + (4,)].set(jnp.inf), False)):
        mean, flag = run(gradient)
        assert np.all(np.isfinite(mean)) == finite
        np.testing.assert_array_equal(flag, np.full(flag.shape, finite))


def test_guarded_trusts_a_known_flag_and_checks_the_rest():
    """``guarded(..., finite=...)``: an update with a flag is not read again (a false flag
    refuses the step, keeping the old state); an update without one is checked."""
    from compjax.guards import Check, guarded

    ok, state, old = jnp.ones(3), {"m": jnp.full(2, 2.0)}, {"m": jnp.zeros(2)}
    check = Check(jnp.bool_(False), None)
    out, new = guarded(check, [ok, ok], state, old, [jnp.bool_(True), None])
    assert np.all(np.asarray(out[0]) == 1) and np.all(np.asarray(new["m"]) == 2)
    out, new = guarded(check, [ok, ok], state, old, [jnp.bool_(False), None])
    assert np.all(np.isnan(out[0])) and np.all(np.asarray(new["m"]) == 0)
    out, new = guarded(check, [ok, ok.at[1].set(jnp.nan)], state, old, [jnp.bool_(True), None])
    assert np.all(np.isnan(out[0])) and np.all(np.asarray(new["m"]) == 0)
    unread = ok.at[0].set(jnp.inf)  # flagged finite: trusted, not read
    out, new = guarded(check, [unread], state, old, [jnp.bool_(True)])
    assert np.asarray(out[0])[0] == np.inf and np.all(np.asarray(new["m"]) == 2)
