"""0/1 Adam's local rounds (``zero_one_adam(..., local_step_clipper > 1)``) on per-worker params.

Checked against an independent float64 numpy transcription of DeepSpeed's ``ZeroOneAdam.step``
with local steps (no weight decay; each worker reverts its local steps and adds the decoded
mean of its accumulated momentum), at every step on 4 vmap workers with gradients of each
worker's own params (both schedules, leaf by leaf and flattened); the workers agree after
every synchronisation; ``local_step_clipper=1`` follows the synchronising 0/1 Adam; the
schedule of exchanges and the mean bits per step; non-finite gradients; bfloat16 params; the
shard_map builder and pmap, an orbax checkpoint taken mid-round; bad arguments.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_onebit_adam import compressed_allreduce

import compjax
from compjax.transforms.zero_one_adam_local import ZeroOneAdamLocalState, local_zero_one_adam
from compjax.transforms.zero_one_adam_schedule import mean_bits_per_step, step_kinds

P = jax.P
N = 4  # workers
B = 4  # examples per worker per step
B1, B2, EPS = 0.9, 0.999, 1e-8
# Leaf sizes 48 and 8: chunks of 12 and 2 entries per worker in the scatter-gather exchange.
P0 = {"w": np.linspace(-0.5, 0.5, 48, dtype=np.float32).reshape(6, 8), "b": np.zeros(8, np.float32)}
# Variance steps 1, 2, 4 (kappa = 1), a 1-bit gradient step 3, frozen from 5; synchronising
# on 5, 6 (interval 1), 8 (interval 2), then every 4th step (interval 4, the clipper).
FREEZE, KAPPA, SCALER, CLIPPER = 3, 1, 2, 4
STEPS = 17
KINDS = ["variance", "variance", "compressed", "variance", "compressed", "compressed"]
KINDS += ["local", "compressed"] + (["local"] * 3 + ["compressed"]) * 2 + ["local"]
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(STEPS, N, B, 6)).astype(np.float32)
Y = _RNG.normal(size=(STEPS, N, B, 8)).astype(np.float32)


def lr_schedule(count):
    """A decaying rate: the round's momentum is the learning-rate-weighted mean."""
    return 0.05 / (1.0 + 0.1 * count)


def loss(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def build(schedule="compjax", clipper=CLIPPER, lr=lr_schedule, **kwargs):
    return local_zero_one_adam(
        lr,
        "data",
        FREEZE,
        KAPPA,
        B1,
        B2,
        EPS,
        local_step_scaler=SCALER,
        local_step_clipper=clipper,
        schedule=schedule,
        **kwargs,
    )


def local_step(tx):
    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    return step


@functools.cache
def vmapped(schedule="compjax", clipper=CLIPPER, flatten=False):
    tx = build(schedule, clipper, flatten=flatten)
    init = jax.jit(lambda p: jax.vmap(lambda _: tx.init(p))(jnp.arange(N)))
    return init, jax.jit(jax.vmap(local_step(tx), axis_name="data"))


@functools.cache
def run(schedule="compjax", clipper=CLIPPER, flatten=False):
    """Per step: the workers' params (stacked) and the state, as numpy."""
    init, step = vmapped(schedule, clipper, flatten)
    params, state = compjax.worker_copies(P0, N), init(P0)
    out = [jax.tree.map(np.asarray, (params, state))]
    for t in range(STEPS):
        params, state, _ = step(params, state, X[t], Y[t])
        out.append(jax.tree.map(np.asarray, (params, state)))
    return out


# --- an independent transcription of DeepSpeed's step with local rounds, float64 numpy -------


def np_grad(p, x, y):
    r = x @ p["w"] + p["b"] - y
    return {"w": 2 * x.T @ r / r.size, "b": 2 * r.sum(0) / r.size}


def join(tree, groups):
    """The leaves of ``tree`` as one flat vector per group of leaf names (``flatten=True``:
    one group of them all, in ``ravel_pytree``'s sorted order)."""
    return {g: np.concatenate([np.reshape(tree[k], -1) for k in g]) for g in groups}


def split(vectors):
    """Inverse of :func:`join`, for one worker's vectors."""
    out = {}
    for group, vector in vectors.items():
        sizes = np.cumsum([P0[k].size for k in group])[:-1]
        for k, part in zip(group, np.split(vector, sizes), strict=True):
            out[k] = part.reshape(P0[k].shape)
    return out


def np_zero_one_adam(shift=0, clipper=CLIPPER, steps=STEPS, flatten=False):
    """Every worker's params after every step, written from DeepSpeed's ``ZeroOneAdam.step``.

    ``s = t + shift`` is the count the schedule runs on.  While ``s <= FREEZE + 1`` the
    variance adapts: on a multiple of the variance interval the mean gradient updates ``m``
    and ``v``, otherwise the 1-bit mean gradient updates ``m``; the params move by
    ``-lr m / d``.  Frozen: each worker's own momentum moves its params, and the comm buffer
    collects ``-lr m_i / d``; on a multiple of the local interval each worker reverts its
    local steps, compresses the buffer times ``d`` with its error, ``m = -mean / sum(lr)``
    and the params move by ``mean / d``.  Each leaf is compressed alone, or with
    ``flatten`` the leaves concatenated.
    """
    groups = (tuple(sorted(P0)),) if flatten else tuple((k,) for k in P0)
    workers = [join({k: np.asarray(a, np.float64) for k, a in P0.items()}, groups)] * N
    size = {g: sum(P0[k].size for k in g) for g in groups}
    m = {g: np.zeros((N, size[g])) for g in groups}
    v = {g: np.zeros(size[g]) for g in groups}
    err = {g: np.zeros((N, size[g])) for g in groups}
    server = {g: np.zeros(size[g]) for g in groups}
    comm = {g: np.zeros((N, size[g])) for g in groups}
    lrs, var_interval, var_counter, interval, counter = 0.0, 1, 0, 1, 0
    history = []
    for t in range(1, steps + 1):
        s, lr = t + shift, lr_schedule(t - 1)
        g = [
            join(np_grad(split(w), X[t - 1, i].astype(np.float64), Y[t - 1, i]), groups)
            for i, w in enumerate(workers)
        ]
        g = {k: np.stack([gi[k] for gi in g]) for k in groups}
        workers = [dict(w) for w in workers]
        if s <= FREEZE + 1:
            variance = s % var_interval == 0
            for k in groups:
                if variance:
                    mean = g[k].mean(0)
                    m[k] = B1 * m[k] + (1 - B1) * mean
                    v[k] = B2 * v[k] + (1 - B2) * mean**2
                else:
                    m[k] = B1 * m[k] + (1 - B1) * compressed_allreduce(
                        g[k], err[k], server[k], N, True
                    )
                for i in range(N):
                    workers[i][k] = workers[i][k] - lr * m[k][i] / (np.sqrt(v[k]) + EPS)
            if variance:
                var_counter += 1
                if var_counter == KAPPA:
                    var_counter, var_interval = 0, 2 * var_interval
        else:
            if s == FREEZE + 2:  # the error buffers restart at the freeze
                for k in groups:
                    err[k][:], server[k][:] = 0.0, 0.0
            lrs += lr
            for k in groups:
                d = np.sqrt(v[k]) + EPS
                m[k] = B1 * m[k] + (1 - B1) * g[k]
                comm[k] = comm[k] - lr * m[k] / d
                for i in range(N):
                    workers[i][k] = workers[i][k] - lr * m[k][i] / d
                if s % interval == 0:
                    for i in range(N):  # revert the local steps
                        workers[i][k] = workers[i][k] - comm[k][i]
                    mean = compressed_allreduce(comm[k] * d, err[k], server[k], N, True)
                    m[k] = np.broadcast_to(-mean / lrs, m[k].shape).copy()
                    for i in range(N):
                        workers[i][k] = workers[i][k] + mean / d
                    comm[k] = np.zeros_like(comm[k])
            if s % interval == 0:
                lrs = 0.0
            counter += 1
            if counter == SCALER:
                counter, interval = 0, min(clipper, 2 * interval)
        history.append([split(w) for w in workers])
    return history


def ulp(x, dtype):
    """The spacing of ``dtype`` at ``|x|`` (normal numbers; the smallest normal's below)."""
    info = jnp.finfo(dtype)
    x = np.maximum(np.abs(np.asarray(x, np.float64)), float(info.tiny))
    return 2.0 ** (np.floor(np.log2(x)) - info.nmant)


def assert_one_rounding(params, theta, before, dtype=np.float32):
    """Every worker's params are ``theta`` up to the rounding of the additive update
    ``before + (theta - before)`` in their dtype: half an ulp of ``theta - before`` plus half
    an ulp of ``theta`` (exactly ``theta`` where ``before`` is within a factor 2 of it)."""
    for k in theta:
        got, was = np.asarray(params[k], np.float64), np.asarray(before[k], np.float64)
        t = np.asarray(theta[k], np.float64)
        bound = 0.5 * ulp(t - was, dtype) + 0.5 * ulp(t, dtype)
        assert (np.abs(got - t) <= bound).all(), (k, np.abs(got - t).max())


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "shift", "flatten"),
    [
        ("compjax", 0, False),
        pytest.param("deepspeed", 1, False, marks=pytest.mark.slow),
        pytest.param("compjax", 0, True, marks=pytest.mark.slow),
    ],
)
def test_local_rounds_follow_the_numpy_transcription_at_every_step(schedule, shift, flatten):
    expected = np_zero_one_adam(shift, flatten=flatten)
    runs = run(schedule, flatten=flatten)
    kinds = step_kinds(STEPS, FREEZE, KAPPA, SCALER, CLIPPER, schedule)
    for t in range(1, STEPS + 1):
        (before, _), (params, state) = runs[t - 1], runs[t]
        for i in range(N):
            for k in P0:
                np.testing.assert_allclose(
                    params[k][i], expected[t - 1][i][k], rtol=1e-4, atol=1e-5, err_msg=f"{t} {i}"
                )
        if kinds[t - 1] != "local":  # a synchronisation: the same theta, momentum, params
            for field in (state.global_params, state.mu, state.local_mu):
                for a in jax.tree.leaves(field):
                    assert (a == a[:1]).all(), t  # bit for bit on every worker
            assert_one_rounding(params, compjax.global_params(state, stacked=True), before)
    assert (runs[-1][1].count == STEPS).all()


def test_the_exchanges_follow_the_schedule():
    """Variance steps move ``v``; the other adaptive steps and the round ends move the error
    buffers and leave every worker on ``theta``; local steps move the params apart."""
    assert step_kinds(STEPS, FREEZE, KAPPA, SCALER, CLIPPER) == KINDS
    runs = run()
    for t, kind in enumerate(KINDS, start=1):
        (_, before), (params, after) = runs[t - 1], runs[t]
        moved_v = not np.array_equal(after.nu["w"], before.nu["w"])
        moved_error = not np.array_equal(after.error["w"], before.error["w"])
        spread = max(np.abs(a - a[:1]).max() for a in jax.tree.leaves(params))
        assert moved_v == (kind == "variance"), t
        assert moved_error == (kind == "compressed"), t
        assert spread > 1e-2 if kind == "local" else spread < 1e-6, (t, spread)
        assert int(after.local_interval[0]) == (1 if t < 6 else 2 if t < 8 else CLIPPER)


def test_mean_bits_per_step_averages_the_schedule():
    """``communication()`` reports one synchronising step (the 1-bit round and the flag), the
    same messages as the synchronising 0/1 Adam; the mean over the schedule counts the flag
    every step, the round on the compressed steps and the dense gradient on variance steps."""
    report = compjax.communication(build(), P0, "data", num_workers=N)
    sync = compjax.communication(
        compjax.zero_one_adam(0.05, "data", FREEZE, KAPPA), P0, "data", num_workers=N
    )
    assert report.messages == sync.messages and report.bits_per_worker > 0
    flag = 2 * (N - 1) / N * 8  # the 8-bit flag, all-reduced on a ring
    assert dict(report.messages)["flag"] == flag
    dense = 2 * (N - 1) / N * 32 * (48 + 8)
    assert report.dense_bits == dense
    rounds = report.bits_per_worker
    want = (3 * (flag + dense) + 6 * rounds + 8 * flag) / STEPS  # KINDS: 3, 6 and 8 steps
    assert mean_bits_per_step(report, KINDS) == pytest.approx(want, rel=1e-12)
    # At the clipper, a round of H = 4 steps: the round's bits over H, plus the flag per step.
    window = mean_bits_per_step(report, ["local"] * 3 + ["compressed"])
    assert window == pytest.approx(flag + (rounds - flag) / CLIPPER, rel=1e-12)
    with pytest.raises(ValueError, match="kinds"):
        mean_bits_per_step(report, ["skipped"])


def test_clipper_one_follows_the_synchronous_path():
    """Synchronising every step, the local rounds' code is the synchronising 0/1 Adam (in
    learning-rate units: equal to float32 rounding at a constant rate); and
    ``zero_one_adam(local_step_clipper=1)`` is that synchronising transformation."""
    sync = compjax.zero_one_adam(0.05, "data", FREEZE, KAPPA)
    assert isinstance(sync.init(P0)[0], compjax.ZeroOneAdamState)
    local = build(clipper=1, lr=0.05)
    step_sync = jax.jit(jax.vmap(local_step(sync), axis_name="data"))
    step_local = jax.jit(jax.vmap(local_step(local), axis_name="data"))
    ps, ss = compjax.worker_copies(P0, N), jax.vmap(lambda _: sync.init(P0))(jnp.arange(N))
    pl, sl = compjax.worker_copies(P0, N), jax.vmap(lambda _: local.init(P0))(jnp.arange(N))
    for t in range(10):  # the adaptive phase and five frozen steps
        ps, ss, _ = step_sync(ps, ss, X[t], Y[t])
        pl, sl, _ = step_local(pl, sl, X[t], Y[t])
        for k in P0:
            np.testing.assert_allclose(pl[k], ps[k], rtol=2e-6, atol=1e-6, err_msg=str(t))
    assert (np.asarray(sl.local_interval) == 1).all()
    # The defaults: DeepSpeed's local_step_scaler, and no local rounds.
    default = compjax.zero_one_adam(0.05, "data", FREEZE, local_step_scaler=4)
    assert isinstance(default.init(P0)[0], compjax.ZeroOneAdamState)


def test_non_finite_gradients_leave_the_state_untouched():
    init, step = vmapped()
    params, state = compjax.worker_copies(P0, N), init(P0)
    for t in range(STEPS - 1):
        kind = KINDS[t]
        if t >= 7 and kind in ("local", "compressed"):  # a local step, then a round's end
            bad = X[t].copy()
            bad[1, 0, 2] = np.nan if kind == "local" else np.inf
            _, new_state, updates = step(params, state, bad, Y[t])
            assert all(np.isnan(np.asarray(u)).all() for u in jax.tree.leaves(updates))
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            if kind == "compressed":
                break
        params, state, _ = step(params, state, X[t], Y[t])
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves((params, state)))


def run_bfloat16_gradients(params_dtype, steps):
    """``steps`` steps from ``P0`` in ``params_dtype`` on bf16 gradients: the workers' params
    before and after the last step, the last updates and the state."""
    tx = build()
    p0 = jax.tree.map(lambda a: jnp.asarray(a, params_dtype), P0)

    def step(p, s, x, y):
        g = jax.tree.map(lambda a: a.astype(jnp.bfloat16), jax.grad(loss)(p, x, y))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    run_step = jax.jit(jax.vmap(step, axis_name="data"))
    params, state = compjax.worker_copies(p0, N), jax.vmap(lambda _: tx.init(p0))(jnp.arange(N))
    for t in range(steps):
        before = params
        params, state, updates = run_step(params, state, X[t], Y[t])
        assert all(np.isfinite(np.asarray(u, np.float32)).all() for u in jax.tree.leaves(updates))
    return before, params, updates, state


@pytest.mark.parametrize(("dtype", "steps"), [(jnp.bfloat16, 12), (jnp.float32, 5)])
def test_bfloat16_gradients(dtype, steps):
    """bf16 gradients, bf16 or float32 params: updates in the params' dtype, finite, and after
    a synchronisation (step 12, or 5) every worker on the float32 ``theta`` to one rounding
    in the params' dtype."""
    before, params, updates, state = run_bfloat16_gradients(dtype, steps)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
    assert state.global_params["w"].dtype == jnp.float32
    theta = compjax.global_params(state, stacked=True)
    assert_one_rounding(params, theta, jax.tree.map(np.float32, before), dtype)


def test_state_layout_specs_and_global_params():
    state = jax.eval_shape(build().init, P0)
    assert isinstance(state, ZeroOneAdamLocalState)
    assert isinstance(state, compjax.ZeroOneAdamLocalState)
    assert state.local_mu["w"].shape == (1, 6, 8) and state.mu["w"].shape == (6, 8)
    specs = compjax.state_specs(state, "data")
    for field in ("global_params", "mu", "nu"):
        assert getattr(specs, field) == {"w": P(), "b": P()}, field
    for field in ("local_mu", "accumulator", "error", "server_error"):
        assert getattr(specs, field) == {"w": P("data"), "b": P("data")}, field
    theta = compjax.global_params(optax.chain(build()).init(P0))
    np.testing.assert_array_equal(theta["w"], P0["w"])


@functools.cache
def sharded_local_steps():
    mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    return compjax.local_steps(loss, build(), P0, mesh)


def test_local_steps_builder_agrees_with_vmap():
    """compjax.local_steps (shard_map, explicit mesh) gives the vmap run's params and theta."""
    built = sharded_local_steps()
    params, state = built.init(P0)
    for t in range(STEPS):
        params, state, _ = built.step(params, state, X[t].reshape(N * B, 6), Y[t].reshape(N * B, 8))
    expected, vmapped_state = run()[-1]
    for k in P0:
        # The gradients' float32 sums are ordered differently per device than under vmap.
        np.testing.assert_allclose(np.asarray(params[k]), expected[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            compjax.global_params(state)[k],
            compjax.global_params(vmapped_state, stacked=True)[k],
            rtol=1e-5,
            atol=1e-6,
        )


def test_pmap_agrees_with_vmap():
    """jax.pmap over 4 devices gives the vmap run's per-worker params and state at every step."""
    tx = build()
    devices = jax.devices()[:N]
    init = jax.pmap(lambda _: tx.init(P0), devices=devices)
    step = jax.pmap(local_step(tx), axis_name="data", devices=devices)
    params, state = compjax.worker_copies(P0, N), init(jnp.arange(N))
    expected = run()
    for t in range(STEPS):
        params, state, _ = step(params, state, X[t], Y[t])
        want_params, want_state = expected[t + 1]
        for k in P0:
            # One device per worker against a vmap: float32 sums ordered differently.
            np.testing.assert_allclose(
                np.asarray(params[k]), want_params[k], rtol=1e-5, atol=1e-6, err_msg=f"{t} {k}"
            )
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_orbax_checkpoint_mid_round_continues_bit_identically(tmp_path):
    built = sharded_local_steps()
    data = [(X[t].reshape(N * B, 6), Y[t].reshape(N * B, 8)) for t in range(STEPS)]
    params, state = built.init(P0)
    for t in range(10):  # inside the round of steps 9-12, local interval 4
        params, state, _ = built.step(params, state, *data[t])
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    for t in range(10, 13):  # through the round's end
        params, state, _ = built.step(params, state, *data[t])
    restored = ckptr.restore(tmp_path / "ckpt", target)
    p2, s2 = restored["params"], restored["state"]
    for t in range(10, 13):
        p2, s2, _ = built.step(p2, s2, *data[t])
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p2, s2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_arguments_are_refused():
    for name, bad in (
        ("local_step_clipper", 0),
        ("local_step_clipper", 2.0),
        ("local_step_clipper", True),
        ("local_step_scaler", 0),
        ("local_step_scaler", None),
    ):
        with pytest.raises(ValueError, match=name):
            compjax.zero_one_adam(0.1, "data", 10, **{name: bad})
    with pytest.raises(ValueError, match="learning_rate"):
        compjax.zero_one_adam(-0.1, "data", 10, local_step_clipper=4)
    with pytest.raises(ValueError, match="schedule"):
        compjax.zero_one_adam(0.1, "data", 10, local_step_clipper=4, schedule="paper")
    with pytest.raises(ValueError, match="var_freeze_step"):
        compjax.zero_one_adam(0.1, "data", 0, local_step_clipper=4)
    tx = compjax.zero_one_adam(0.1, "data", 10, local_step_clipper=4)
    with pytest.raises(ValueError, match="params"):
        jax.vmap(tx.update, axis_name="data")(
            compjax.worker_copies(P0, N), jax.vmap(lambda _: tx.init(P0))(jnp.arange(N))
        )
