"""DiLoCo (compjax.diloco): local steps on per-worker params, a compressed outer step per round.

Checked against an independent float64 numpy transcription of Algorithm 1 of Douillard et
al. (inner SGD and AdamW, outer Nesterov), against pooled data-parallel SGD (one step per
round, exact mean, outer SGD(1)), across vmap, shard_map and pmap, through an orbax
checkpoint taken mid-round, with error feedback's identity over rounds, and on non-finite
gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import compjax
from compjax.transforms.diloco import DiLoCoState

P = jax.P
N = 4  # workers
B = 4  # examples per worker per step
LR = 0.1
P0 = {"w": np.linspace(-0.5, 0.5, 6, dtype=np.float32).reshape(3, 2), "b": np.zeros(2, np.float32)}
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(12, N, B, 3)).astype(np.float32)
Y = _RNG.normal(size=(12, N, B, 2)).astype(np.float32)
ADAMW = {"lr": 0.05, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "wd": 0.01}


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def nesterov():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


#: The transformations the tests run, built once per name (one compile each).
BUILDERS = {
    "fedavg_h1": lambda: compjax.diloco(optax.sgd(LR), optax.sgd(1.0), 1, "data"),
    "sgd_h3": lambda: compjax.diloco(optax.sgd(LR), nesterov(), 3, "data"),
    "fedavg_h3": lambda: compjax.diloco(optax.sgd(LR), optax.sgd(1.0), 3, "data"),
    "adamw_h3": lambda: compjax.diloco(
        optax.adamw(ADAMW["lr"], ADAMW["b1"], ADAMW["b2"], ADAMW["eps"], weight_decay=ADAMW["wd"]),
        nesterov(),
        3,
        "data",
    ),
    "top_k_h2": lambda: compjax.diloco(
        optax.sgd(LR), nesterov(), 2, "data", compressor=compjax.top_k(k=1)
    ),
    "fedavg_top_k_h2": lambda: compjax.diloco(
        optax.sgd(LR), optax.sgd(1.0), 2, "data", compressor=compjax.top_k(k=1)
    ),
    "top_k_scatter_gather_h2": lambda: compjax.diloco(
        optax.sgd(LR),
        nesterov(),
        2,
        "data",
        compressor=compjax.top_k(k=1),
        exchange="scatter_gather",
    ),
    "streaming_top_k_h2": lambda: compjax.streaming_diloco(
        optax.sgd(LR), nesterov(), 2, "data", compressor=compjax.top_k(k=1)
    ),
    # H = 4, fragment 0 (the bias) sent on steps 2, 6, 10, the kernel on 4, 8; merged a step later.
    "streaming_2f_delay1": lambda: compjax.streaming_diloco(
        optax.sgd(LR), nesterov(), 4, "data", fragments=2, delay=1, mixing=0.5
    ),
    "qsgd_h2": lambda: compjax.diloco(
        optax.sgd(LR), nesterov(), 2, "data", compressor=compjax.qsgd(levels=4)
    ),
}


def local_step(tx):
    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    return step


@functools.cache
def vmapped(name):
    """``(init, step)`` of ``BUILDERS[name]`` on ``N`` workers simulated by vmap, jitted."""
    tx = BUILDERS[name]()
    init = jax.jit(lambda: jax.vmap(lambda _: tx.init(P0))(jnp.arange(N)))
    return init, jax.jit(jax.vmap(local_step(tx), axis_name="data"))


def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))


@functools.cache
def sharded(name):
    """``(init, step, specs)`` under shard_map: local params stacked, split with P("data")."""
    tx = BUILDERS[name]()
    specs = compjax.state_specs(jax.eval_shape(tx.init, P0), "data")
    step = local_step(tx)

    def body(p, s, x, y):
        p, s, g = step(jax.tree.map(lambda a: a[0], p), s, x[0], y[0])
        p, g = jax.tree.map(lambda a: a[None], (p, g))
        return p, s, g

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh(), in_specs=P(), out_specs=specs))
    run = jax.shard_map(
        body,
        mesh=mesh(),
        in_specs=(P("data"), specs, P("data"), P("data")),
        out_specs=(P("data"), specs, P("data")),
    )
    return init, jax.jit(run), specs


@functools.cache
def pmapped(name):
    tx = BUILDERS[name]()
    devices = jax.devices()[:N]
    init = jax.pmap(lambda _: tx.init(P0), devices=devices)
    return init, jax.pmap(local_step(tx), axis_name="data", devices=devices)


def run_vmap(name, steps, xs=X, ys=Y):
    """Per step: the workers' params (stacked), the state and the gradients, as numpy."""
    init, step = vmapped(name)
    params, state = compjax.worker_copies(P0, N), init()
    out = []
    for t in range(steps):
        params, state, grads = step(params, state, xs[t], ys[t])
        out.append(jax.tree.map(np.asarray, (params, state, grads)))
    return out


# --- an independent transcription of Algorithm 1, float64 numpy ----------------------


def np_grad(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"w": 2 * x.T @ r / r.size, "b": 2 * r.sum(0) / r.size}


def np_algorithm_1(inner: str, steps: int, h: int, outer: str = "nesterov") -> tuple[list, list]:
    """Workers' params after every step and the global params after every round; ``outer``
    is the paper's Nesterov step or ``"fedavg"`` (SGD with learning rate 1)."""
    f64 = lambda tree: {k: np.asarray(v, np.float64) for k, v in tree.items()}  # noqa: E731
    theta = f64(P0)
    mom = {k: np.zeros_like(v) for k, v in theta.items()}
    workers = [f64(P0) for _ in range(N)]
    adam = [({k: 0 * v for k, v in theta.items()}, {k: 0 * v for k, v in theta.items()})] * N
    history, thetas = [], []
    for t in range(steps):
        for i in range(N):
            g = np_grad(workers[i], X[t, i].astype(np.float64), Y[t, i].astype(np.float64))
            if inner == "sgd":
                workers[i] = {k: workers[i][k] - LR * g[k] for k in g}
            else:
                a = ADAMW
                m = {k: a["b1"] * adam[i][0][k] + (1 - a["b1"]) * g[k] for k in g}
                v = {k: a["b2"] * adam[i][1][k] + (1 - a["b2"]) * g[k] ** 2 for k in g}
                adam[i] = (m, v)
                c1, c2 = 1 - a["b1"] ** (t + 1), 1 - a["b2"] ** (t + 1)
                workers[i] = {
                    k: workers[i][k]
                    - a["lr"]
                    * (m[k] / c1 / (np.sqrt(v[k] / c2) + a["eps"]) + a["wd"] * workers[i][k])
                    for k in g
                }
        if (t + 1) % h == 0:  # outer step on the mean pseudo-gradient
            delta = {k: theta[k] - np.mean([w[k] for w in workers], 0) for k in theta}
            if outer == "fedavg":
                theta = {k: theta[k] - delta[k] for k in theta}
            else:
                mom = {k: delta[k] + 0.9 * mom[k] for k in theta}
                theta = {k: theta[k] - 0.7 * (delta[k] + 0.9 * mom[k]) for k in theta}
            workers = [dict(theta) for _ in range(N)]
            thetas.append(theta)
        history.append([dict(w) for w in workers])
    return history, thetas


def assert_one_rounding(params, theta):
    """Every worker's params are ``theta`` up to one float32 rounding."""
    for k in theta:
        for row in params[k]:
            np.testing.assert_allclose(row, theta[k], rtol=2**-23, atol=2**-126)


# --- tests -----------------------------------------------------------------------------


def test_one_step_rounds_with_the_exact_mean_are_pooled_data_parallel_sgd():
    theta = {k: v.astype(np.float64) for k, v in P0.items()}
    for t, (params, state, _) in enumerate(run_vmap("fedavg_h1", 3)):
        x, y = X[t].reshape(N * B, 3), Y[t].reshape(N * B, 2)
        g = np_grad(theta, x.astype(np.float64), y.astype(np.float64))
        theta = {k: theta[k] - LR * g[k] for k in theta}
        for k in theta:
            np.testing.assert_allclose(params[k], np.broadcast_to(theta[k], params[k].shape), 1e-5)
        assert_one_rounding(params, compjax.global_params(state, stacked=True))


@pytest.mark.parametrize(
    ("name", "inner", "outer"),
    [
        ("sgd_h3", "sgd", "nesterov"),
        ("adamw_h3", "adamw", "nesterov"),
        ("fedavg_h3", "sgd", "fedavg"),
    ],
)
def test_rounds_follow_algorithm_1_at_every_step(name, inner, outer):
    steps, h = 7, 3  # two rounds and the first step of a third
    expected, thetas = np_algorithm_1(inner, steps, h, outer)
    runs = run_vmap(name, steps)
    for t, (params, state, _) in enumerate(runs):
        for i in range(N):
            for k in P0:
                np.testing.assert_allclose(
                    params[k][i], expected[t][i][k], rtol=2e-5, atol=2e-6, err_msg=f"{t} {i} {k}"
                )
        if (t + 1) % h == 0:
            theta = state.global_params
            for k in P0:  # the same global params on every worker, bit for bit
                assert (theta[k] == theta[k][:1]).all()
                np.testing.assert_allclose(theta[k][0], thetas[t // h][k], rtol=2e-5, atol=2e-6)
            assert_one_rounding(params, compjax.global_params(state, stacked=True))
    final = runs[-1][1]
    assert (final.count == steps).all()
    if inner == "adamw":  # the inner state persisted across the rounds
        assert (jax.tree.leaves(final.inner_state)[0] == steps).all()


def test_error_feedback_identity_across_rounds():
    """``sent_i + e_i(new) = Delta_i + e_i(old)`` at every sync; top-1 of each leaf is sent."""
    runs = run_vmap("fedavg_top_k_h2", 6)
    params, theta = compjax.worker_copies(P0, N), P0
    error = {k: np.zeros((N, 1, *v.shape), np.float32) for k, v in P0.items()}
    total_delta = {k: np.zeros((N, *v.shape)) for k, v in P0.items()}
    total_sent = {k: np.zeros(v.shape) for k, v in P0.items()}
    for t, (new_params, state, grads) in enumerate(runs):
        local = {k: np.asarray(params[k]) + np.float32(-LR) * grads[k] for k in P0}
        if (t + 1) % 2 == 0:
            new_theta = compjax.global_params(state, stacked=True)
            for k in P0:
                delta = theta[k] - local[k]
                sent = delta + error[k][:, 0] - state.error[k][:, 0]
                # top_k(k=1): one entry of each worker's leaf is sent, the rest kept
                assert ((np.abs(sent) > 1e-6).reshape(N, -1).sum(1) <= 1).all()
                # FedAvg's outer step: theta moves by the mean of what was sent
                np.testing.assert_allclose(theta[k] - new_theta[k], sent.mean(0), atol=1e-6)
                total_delta[k] += delta
                total_sent[k] += sent.mean(0)
            theta, error = new_theta, state.error
        params = new_params
    for k in P0:  # over the rounds: n * sum of means + memories = sum of pseudo-gradients
        np.testing.assert_allclose(
            N * total_sent[k] + error[k][:, 0].sum(0), total_delta[k].sum(0), atol=1e-5
        )
        assert np.abs(error[k]).max() > 0  # something was held back


def test_non_finite_gradients_leave_the_state_untouched():
    init, step = vmapped("top_k_h2")
    params, state = compjax.worker_copies(P0, N), init()
    params, state, _ = step(params, state, X[0], Y[0])
    for t in (1, 2):  # the round's last step, then (after a clean one) a step inside a round
        bad = X[t].copy()
        bad[2, 0, 1] = np.nan if t == 1 else np.inf
        new_params, new_state, _ = step(params, state, bad, Y[t])
        assert np.isnan(np.asarray(new_params["w"])).all()  # every worker's update is NaN
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        params, state, _ = step(params, state, X[t], Y[t])
    assert (np.asarray(state.count) == 3).all()
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves((params, state)))


@functools.cache
def agreement_runs(name, steps=4):
    """The workers' params and states of vmap, shard_map and pmap runs, as numpy."""
    runs = {}
    for kind, (init, step) in {
        "vmap": vmapped(name),
        "shard_map": sharded(name)[:2],
        "pmap": pmapped(name),
    }.items():
        params = compjax.worker_copies(P0, N)
        state = (
            init() if kind == "vmap" else init(P0) if kind == "shard_map" else init(np.arange(N))
        )
        for t in range(steps):
            params, state, _ = step(params, state, X[t], Y[t])
        runs[kind] = jax.tree.map(np.asarray, (params, state))
    return runs


@pytest.mark.parametrize(
    "name",
    ["top_k_h2"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in ("qsgd_h2", "top_k_scatter_gather_h2")],
)
def test_vmap_shard_map_and_pmap_agree(name):
    runs = agreement_runs(name)
    params, state = runs["vmap"]
    for kind in ("shard_map", "pmap"):
        other_params, other_state = runs[kind]
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(other_params), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=kind)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(other_state), strict=True):
            # shard_map: shared fields once, per-worker ones with their N rows (N, *shape)
            b = b.reshape(a.shape) if b.size == a.size else np.broadcast_to(b, a.shape)
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=kind)


@functools.cache
def built_local_steps():
    explicit = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    return compjax.local_steps(loss, BUILDERS["top_k_h2"](), P0, explicit)


def test_local_steps_builder_agrees_with_vmap():
    """compjax.local_steps on an explicit-sharding mesh: global arrays in and out."""
    built = built_local_steps()
    params, state = built.init(P0)
    assert params["w"].shape == (N, 3, 2) and params["w"].sharding.spec[0] == "data"
    for t in range(4):  # each worker's rows of the batch are its own examples
        x, y = X[t].reshape(N * B, 3), Y[t].reshape(N * B, 2)
        params, state, mean_loss = built.step(params, state, x, y)
    expected, vmapped_state, _ = run_vmap("top_k_h2", 4)[-1]
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
    theta = compjax.global_params(state)
    for k in P0:
        np.testing.assert_allclose(
            compjax.global_params(vmapped_state, stacked=True)[k], theta[k], rtol=1e-6, atol=1e-7
        )
    assert np.isfinite(float(mean_loss))


def test_orbax_checkpoint_mid_round_continues_bit_identically(tmp_path):
    init, step, _ = sharded("top_k_h2")
    shard = jax.sharding.NamedSharding(mesh(), P("data"))
    data = [(jax.device_put(X[t], shard), jax.device_put(Y[t], shard)) for t in range(6)]
    params = jax.device_put(compjax.worker_copies(P0, N), shard)
    state = init(P0)
    for t in range(3):  # H = 2: the checkpoint falls in the middle of the second round
        params, state, _ = step(params, state, *data[t])
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    for t in range(3, 6):
        params, state, _ = step(params, state, *data[t])
    restored = ckptr.restore(tmp_path / "ckpt", target)
    p2, s2 = restored["params"], restored["state"]
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(target["state"]), strict=True):
        assert a.sharding == b.sharding
    for t in range(3, 6):
        p2, s2, _ = step(p2, s2, *data[t])
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_gradients_sync_float32_params_to_float32_rounding():
    tx = BUILDERS["fedavg_h1"]()

    def step(p, s, x, y):
        g = jax.tree.map(lambda a: a.astype(jnp.bfloat16), jax.grad(loss)(p, x, y))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    state = jax.vmap(lambda _: tx.init(P0))(jnp.arange(N))
    params, state, updates = jax.jit(jax.vmap(step, axis_name="data"))(
        compjax.worker_copies(P0, N), state, X[0], Y[0]
    )
    assert updates["w"].dtype == jnp.float32
    assert_one_rounding(jax.device_get(params), compjax.global_params(state, stacked=True))


def test_state_layout_and_specs():
    state = jax.eval_shape(BUILDERS["top_k_h2"]().init, P0)
    assert isinstance(state, DiLoCoState)
    assert (
        state.global_params["w"].shape == (3, 2) and state.global_params["w"].dtype == jnp.float32
    )
    assert state.error["w"].shape == (1, 3, 2)
    assert all(leaf.shape[0] == 1 for leaf in jax.tree.leaves(state.inner_state))
    specs = compjax.state_specs(state, "data")
    assert specs.global_params == {"w": P(), "b": P()}
    assert specs.error == {"w": P("data"), "b": P("data")}
    assert all(
        s == P("data")
        for s in jax.tree.leaves(
            specs.inner_state, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
        )
    )
    assert all(
        s == P()
        for s in jax.tree.leaves(
            specs.outer_state, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
        )
    )
    # error feedback by default exactly for biased compressors
    assert jax.eval_shape(BUILDERS["qsgd_h2"]().init, P0).error == ()
    assert jax.eval_shape(BUILDERS["sgd_h3"]().init, P0).error == ()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="sync_every"):
        compjax.diloco(optax.sgd(1.0), optax.sgd(1.0), 0, "data")
    with pytest.raises(ValueError, match="error_feedback"):
        compjax.diloco(optax.sgd(1.0), optax.sgd(1.0), 2, "data", error_feedback=True)
    with pytest.raises(ValueError, match="exchange"):
        compjax.diloco(optax.sgd(1.0), optax.sgd(1.0), 2, "data", exchange="ring")
    tx = BUILDERS["sgd_h3"]()
    with pytest.raises(ValueError, match="needs params"):
        jax.vmap(tx.update, axis_name="data")(compjax.worker_copies(P0, N), vmapped("sgd_h3")[0]())
    with pytest.raises(ValueError, match="num_workers"):
        compjax.worker_copies(P0, 0)
    with pytest.raises(ValueError, match="DiLoCoState"):
        compjax.global_params(optax.sgd(1.0).init(P0))


# --- Streaming DiLoCo ------------------------------------------------------------------


def np_streaming(steps: int, h: int, send: dict, delay: int, alpha: float) -> list:
    """Streaming DiLoCo (inner SGD, outer Nesterov per fragment), float64; ``send[k]``: leaf
    ``k``'s fragment is sent on the steps ``t`` (from 1) with ``t % h == send[k]``."""
    theta = {k: np.asarray(v, np.float64) for k, v in P0.items()}
    mom = {k: np.zeros_like(v) for k, v in theta.items()}
    workers = [dict(theta) for _ in range(N)]
    history = []
    for t in range(1, steps + 1):
        for i in range(N):
            g = np_grad(workers[i], X[t - 1, i].astype(np.float64), Y[t - 1, i].astype(np.float64))
            workers[i] = {k: workers[i][k] - LR * g[k] for k in g}
        for k, offset in send.items():
            if t % h == offset:  # this fragment's outer step, from the workers' params now
                delta = theta[k] - np.mean([w[k] for w in workers], 0)
                mom[k] = delta + 0.9 * mom[k]
                theta[k] = theta[k] - 0.7 * (delta + 0.9 * mom[k])
            if t - delay >= 1 and (t - delay) % h == offset:  # merged delay steps later
                for w in workers:
                    w[k] = alpha * w[k] + (1 - alpha) * theta[k]
        history.append([dict(w) for w in workers])
    return history


def test_streaming_with_one_fragment_and_no_delay_is_diloco_bit_for_bit():
    for (p1, s1, _), (p2, s2, _) in zip(
        run_vmap("top_k_h2", 5), run_vmap("streaming_top_k_h2", 5), strict=True
    ):
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            np.testing.assert_array_equal(a, b)
        for field in ("count", "global_params", "inner_state", "error"):
            for a, b in zip(
                jax.tree.leaves(getattr(s1, field)),
                jax.tree.leaves(getattr(s2, field)),
                strict=True,
            ):
                np.testing.assert_array_equal(a, b, err_msg=field)
        for a, b in zip(
            jax.tree.leaves(s1.outer_state), jax.tree.leaves(s2.outer_state), strict=True
        ):
            np.testing.assert_array_equal(a, b)


def test_streaming_fragments_follow_their_staggered_delayed_mixed_schedule():
    steps = 10
    expected = np_streaming(steps, 4, {"b": 2, "w": 0}, delay=1, alpha=0.5)
    runs = run_vmap("streaming_2f_delay1", steps)
    for t, (params, _, _) in enumerate(runs):
        for i in range(N):
            for k in P0:
                np.testing.assert_allclose(
                    params[k][i], expected[t][i][k], rtol=2e-5, atol=2e-6, err_msg=f"{t} {i} {k}"
                )
    state = runs[-1][1]
    assert len(state.outer_state) == 2  # one outer state per fragment


def test_streaming_under_shard_map_agrees_with_vmap():
    init, step, _ = sharded("streaming_2f_delay1")
    params, state = compjax.worker_copies(P0, N), init(P0)
    for t in range(6):
        params, state, _ = step(params, state, X[t], Y[t])
    vmapped_params, vmapped_state, _ = run_vmap("streaming_2f_delay1", 6)[-1]
    for a, b in zip(jax.tree.leaves(vmapped_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
    theta = compjax.global_params(state)
    for k in P0:
        np.testing.assert_allclose(
            compjax.global_params(vmapped_state, stacked=True)[k], theta[k], rtol=1e-6, atol=1e-7
        )


def test_streaming_bad_arguments_are_refused():
    sgd = optax.sgd(1.0)
    with pytest.raises(ValueError, match="delay"):
        compjax.streaming_diloco(sgd, sgd, 2, "data", delay=2)
    with pytest.raises(ValueError, match="mixing"):
        compjax.streaming_diloco(sgd, sgd, 2, "data", mixing=1.5)
    with pytest.raises(ValueError, match="fragments"):
        compjax.streaming_diloco(sgd, sgd, 2, "data", fragments=0)
    with pytest.raises(ValueError, match="3 fragments"):
        compjax.streaming_diloco(sgd, sgd, 2, "data", fragments=3).init(P0)


@pytest.mark.parametrize("compressor", [None, compjax.int_quant(bits=8)], ids=["exact", "int8"])
def test_streaming_bits_per_step_split_the_report_over_the_round(compressor):
    """communication() of Streaming DiLoCo is DiLoCo's (every fragment once, one flag); the
    per-fragment reports add up to it, and bits_per_step puts each fragment on its step."""
    from compjax.transforms.streaming_diloco import bits_per_step, fragment_leaves

    sgd = optax.sgd(1.0)
    streaming = compjax.streaming_diloco(sgd, sgd, 4, "data", fragments=2, compressor=compressor)
    diloco = compjax.diloco(sgd, sgd, 4, "data", compressor=compressor)
    report = compjax.communication(streaming, P0, "data", num_workers=N)
    assert report == compjax.communication(diloco, P0, "data", num_workers=N)
    b, w = fragment_leaves(P0, 2)  # tree order: the bias, then the kernel
    assert [a.shape for a in b] == [(2,)] and [a.shape for a in w] == [(3, 2)]
    reports = [compjax.communication(diloco, f, "data", num_workers=N) for f in (b, w)]
    flag = 2 * (N - 1) / N * 8  # the 8-bit flag on a ring all-reduce
    assert [m for m in report.messages if m[0] == "flag"] == [("flag", flag)]
    assert report.messages == reports[0].messages + reports[1].messages[1:]
    sent = [r.bits_per_worker - flag for r in reports]
    if compressor is None:  # float32 on a ring all-reduce: 2 (n - 1) / n of 32 bits an entry
        assert sent == [2 * 3 / 4 * 32 * 2, 2 * 3 / 4 * 32 * 6]
    steps = bits_per_step(reports, 4)
    # H = 4, F = 2: the bias on steps 2, 6, ..., the kernel on steps 4, 8, ...
    assert steps == [flag, flag + sent[0], flag, flag + sent[1]]
    assert np.mean(steps) == (report.bits_per_worker - flag) / 4 + flag
    # One fragment is DiLoCo: its round's last step sends the whole report.
    assert bits_per_step(reports[:1], 1) == [reports[0].bits_per_worker]
    with pytest.raises(ValueError, match="sync_every"):
        bits_per_step(reports, 0)
    with pytest.raises(ValueError, match="one report per fragment"):
        bits_per_step([], 4)
    with pytest.raises(ValueError, match="3 fragments"):
        fragment_leaves(P0, 3)


def test_local_steps_builder_skips_a_refused_step():
    built = built_local_steps()
    params, state = built.init(P0)
    params, state, _ = built.step(params, state, X[0].reshape(N * B, 3), Y[0].reshape(N * B, 2))
    bad = X[1].copy()
    bad[1, 2, 0] = np.nan  # worker 1's example: the step is refused on every worker
    new_params, new_state, _ = built.step(
        params, state, bad.reshape(N * B, 3), Y[1].reshape(N * B, 2)
    )
    for a, b in zip(
        jax.tree.leaves((params, state)), jax.tree.leaves((new_params, new_state)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
