"""compjax.diloco's robust merges (merge="median_norm_clip" | "trimmed_mean"): every worker's
whole pseudo-gradient is gathered, decoded and merged by compjax.merges (median_norm_clip clips
each worker's whole message, all leaves together; trimmed_mean is coordinate-wise).

Checked under jax.vmap over 4 workers (one round, inner SGD(1/8), outer SGD(1): theta_new =
theta - merged) against a float64 numpy transcription of the merge applied to the workers'
pseudo-gradients, recomputed here from the inputs; with one worker sending 2^20 times its
gradient, a NaN gradient, an inner step that overflows float16 params, compressed messages,
eager, jit(vmap) and shard_map forms, and the round's messages as compjax.communication counts
them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax
from compjax import merges
from compjax.exchange import Exchange

N = 4
TRIM = 0.25
LR = 0.125
# Params, gradients and steps on grids that bfloat16 and float16 hold exactly (multiples of
# 2^-6 below 2, inner steps of integer multiples of LR / 8), so the references below are
# exact whatever precision XLA computes the inner step in.
P0 = {
    "w": jnp.round(64 * jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)) / 64,
    "b": jnp.round(64 * jnp.linspace(0.5, -0.5, 4)) / 64,
}
G = jax.tree.map(lambda a: jnp.round(8 * jnp.sin(3 * a + 1.0)) / 8, P0)
# Each worker's gradient scale per leaf ("w", "b"): the honest workers' ratios between the two
# leaves differ (so clipping the whole message differs from clipping each leaf), and worker 3
# sends 2^20 (about 1e6) times its gradient (a lying worker).
SCALES = jnp.array([[1.0, 4.0], [2.0, 1.0], [3.0, 2.0], [2.0**20, 2.0**20]])
HONEST = SCALES.at[3].set(SCALES[0])  # worker 3 honest, equal to worker 0
ROBUST = ("median_norm_clip", "trimmed_mean")


def grads_of(scale):
    """One worker's gradients for its two scales (float32)."""
    return {"w": scale[0] * G["w"], "b": scale[1] * G["b"]}


def cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


@functools.cache
def stepper(merge, compressor=None, dtype=jnp.float32, grad_dtype=None, form="jit"):
    """``(params, init, step)`` of a one-step-round DiLoCo over ``N`` workers, params in
    ``dtype``, gradients in ``grad_dtype`` (default ``dtype``); ``form``: "jit" (jit(vmap)),
    "eager" (vmap alone) or "shard_map" (jit(shard_map) over ``N`` devices)."""
    tx = compjax.diloco(optax.sgd(LR), optax.sgd(1.0), 1, "i", compressor=compressor,
                        merge=merge, trim=TRIM)  # fmt: skip
    params = cast(P0, dtype)

    def step(p, s, scale):
        u, s = tx.update(cast(grads_of(scale), grad_dtype or dtype), s, p)
        return optax.apply_updates(p, u), s, u

    if form == "shard_map":
        P = jax.sharding.PartitionSpec
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("i",))
        specs = compjax.state_specs(jax.eval_shape(tx.init, params), "i")
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

        def body(p, s, scale):
            p, s, u = step(jax.tree.map(lambda a: a[0], p), s, scale[0])
            return jax.tree.map(lambda a: a[None], p), s, jax.tree.map(lambda a: a[None], u)

        run = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), specs, P("i")),
                            out_specs=(P("i"), specs, P("i")))  # fmt: skip
        return params, lambda: init(params), jax.jit(run)
    init = jax.jit(jax.vmap(lambda _: tx.init(params)))
    mapped = jax.vmap(step, axis_name="i")
    return params, lambda: init(jnp.arange(N)), (jax.jit(mapped) if form == "jit" else mapped)


def one_round(merge, scales=SCALES, **kw):
    """The workers' params, global params and updates after one round."""
    params, init, step = stepper(merge, **kw)
    state = init()
    local, state, updates = step(compjax.worker_copies(params, N), state, scales)
    theta = compjax.global_params(state, stacked=kw.get("form") != "shard_map")
    return local, theta, updates


def pseudo_gradients(scales=SCALES, dtype=jnp.float32, grad_dtype=None):
    """Each worker's ``theta - theta_i`` after one inner SGD(LR) step, recomputed here from
    the inputs (float32 ``theta``, the local params in ``dtype``): ``{leaf: (N, ...)}``."""
    params = cast(P0, dtype)
    theta = cast(params, jnp.float32)
    out = {k: [] for k in P0}
    for s in scales:
        g = cast(grads_of(s), grad_dtype or dtype)
        local = optax.apply_updates(params, jax.tree.map(lambda x: -LR * x, g))
        for k in P0:
            out[k].append(np.asarray(theta[k] - local[k].astype(jnp.float32), np.float64))
    return {k: np.stack(v) for k, v in out.items()}


def numpy_merge(merge, deltas):
    """float64 transcription: the whole-message lower-median norm clip, or the coordinate-wise
    trimmed mean (TRIM * N workers cut from each end), over the finite workers."""
    keep = [all(np.isfinite(deltas[k][i]).all() for k in deltas) for i in range(N)]
    rows = {k: v[np.array(keep)] for k, v in deltas.items()}
    m = len(next(iter(rows.values())))
    if merge == "median_norm_clip":
        norms = np.sqrt(sum((v.reshape(m, -1) ** 2).sum(axis=1) for v in rows.values()))
        median = np.sort(norms)[(m - 1) // 2]
        f = np.where(norms > median, median / np.where(norms > 0, norms, 1.0), 1.0)
        return {k: np.mean(f.reshape((m,) + (1,) * (v.ndim - 1)) * v, axis=0)
                for k, v in rows.items()}  # fmt: skip
    t = TRIM * m
    assert t == int(t), "a whole number of workers cut"
    return {k: np.sort(v, axis=0)[int(t) : m - int(t)].mean(axis=0) for k, v in rows.items()}


def assert_tree_close(x, y, rtol=1e-6, atol=1e-7):
    for k in P0:
        np.testing.assert_allclose(np.asarray(x[k], np.float64), y[k], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("merge", ROBUST)
def test_a_round_steps_theta_by_the_merge_of_the_workers_pseudo_gradients(merge, dtype):
    local, theta, _ = one_round(merge, dtype=dtype)
    deltas = pseudo_gradients(dtype=dtype)
    start = cast(cast(P0, dtype), jnp.float32)
    expected = {k: np.asarray(start[k], np.float64) - v
                for k, v in numpy_merge(merge, deltas).items()}  # fmt: skip
    assert_tree_close(theta, expected)
    # the same as compjax.merges on the stacked tree (the whole message, all leaves at once)
    fn = {"median_norm_clip": functools.partial(merges.median_norm_clip, per_leaf=False),
          "trimmed_mean": functools.partial(merges.trimmed_mean, trim=TRIM)}[merge]  # fmt: skip
    merged = fn(cast(deltas, jnp.float32))
    assert_tree_close(theta, {k: start[k] - merged[k] for k in P0}, atol=1e-6)
    for k in P0:  # every worker moved to theta, in its params' dtype (exact in float32)
        assert local[k].dtype == dtype
        eps = 0.0 if dtype == jnp.float32 else float(jnp.finfo(dtype).eps)  # theta - p rounded
        want = np.broadcast_to(np.asarray(theta[k].astype(dtype), np.float64), local[k].shape)
        np.testing.assert_allclose(np.asarray(local[k], np.float64), want, rtol=0, atol=eps)


def test_median_norm_clip_clips_each_whole_message_not_each_leaf():
    """The per-leaf clip (SparseLoCo's reference) gives another theta here: the test above
    tells the two apart."""
    deltas = cast(pseudo_gradients(), jnp.float32)
    whole = merges.median_norm_clip(deltas, per_leaf=False)
    each = merges.median_norm_clip(deltas, per_leaf=True)
    assert float(jnp.max(jnp.abs(whole["b"] - each["b"]))) > 1e-2


def test_a_lying_worker_drags_the_mean_but_not_the_robust_merges():
    deltas = pseudo_gradients()
    whole_norm = np.sqrt(sum((v.reshape(N, -1) ** 2).sum(axis=1) for v in deltas.values()))[:3]
    moves, thetas = {}, {}
    for merge in ("mean", *ROBUST):
        _, thetas[merge], _ = one_round(merge)
        steps = [np.asarray(thetas[merge][k] - P0[k], np.float64) for k in P0]
        moves[merge] = np.sqrt(sum((s**2).sum() for s in steps))
    assert moves["mean"] > 1e4 * whole_norm.max()
    # whole-message clip: the merge's norm is at most the median (the 2nd smallest) of the norms
    assert moves["median_norm_clip"] <= np.sort(whole_norm)[1] * (1 + 1e-6)
    # trimmed mean: each coordinate within the honest workers' range
    for k in P0:
        step = -np.asarray(thetas["trimmed_mean"][k] - P0[k], np.float64)
        assert np.all(step >= deltas[k][:3].min(axis=0) - 1e-6)
        assert np.all(step <= deltas[k][:3].max(axis=0) + 1e-6)


@pytest.mark.parametrize("merge", ("mean", *ROBUST))
def test_a_nan_gradient_refuses_the_step_for_every_worker_and_keeps_theta(merge):
    """The finite guard acts before the merge: NaN updates everywhere, the state kept."""
    scales = HONEST.at[1, 1].set(jnp.nan)
    _, theta, updates = one_round(merge, scales=scales)
    assert all(bool(jnp.isnan(u).all()) for u in jax.tree.leaves(updates))
    for k in P0:
        np.testing.assert_array_equal(theta[k], P0[k])


@pytest.mark.parametrize("merge", ("mean", *ROBUST))
def test_a_worker_whose_inner_step_overflows_is_left_out_by_the_robust_merges(merge):
    """float16 params, float32 gradients (all finite): worker 3's inner step lands beyond
    float16's range, so its pseudo-gradient is infinite.  The robust merges merge the other
    three; the mean would make theta infinite, so the guard refuses the step."""
    kw = {"dtype": jnp.float16, "grad_dtype": jnp.float32}
    local, theta, updates = one_round(merge, **kw)
    deltas = pseudo_gradients(dtype=jnp.float16, grad_dtype=jnp.float32)
    assert np.isinf(deltas["w"][3]).any() and np.isfinite(deltas["w"][:3]).all()
    start = cast(cast(P0, jnp.float16), jnp.float32)
    if merge == "mean":
        assert all(bool(jnp.isnan(u).all()) for u in jax.tree.leaves(updates))
        assert_tree_close(theta, {k: np.asarray(v, np.float64) for k, v in start.items()})
        return
    three = {k: v[:3] for k, v in deltas.items()}  # merged as if worker 3 had not sent
    fn = {"median_norm_clip": functools.partial(merges.median_norm_clip, per_leaf=False),
          "trimmed_mean": functools.partial(merges.trimmed_mean, trim=TRIM)}[merge]  # fmt: skip
    merged = fn(cast(three, jnp.float32))
    assert_tree_close(theta, {k: np.asarray(start[k] - merged[k], np.float64) for k in P0})
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves((local, theta)))


@pytest.mark.parametrize("merge", ROBUST)
def test_eager_jit_and_shard_map_forms_agree(merge):
    _, reference, ref_updates = one_round(merge)
    for form in ("eager", "shard_map"):
        _, theta, updates = one_round(merge, form=form)
        assert_tree_close(theta, {k: np.asarray(v, np.float64) for k, v in reference.items()})
        for k in P0:
            np.testing.assert_allclose(updates[k], ref_updates[k], rtol=1e-6, atol=1e-6)


def test_merge_mean_is_the_default_path_bit_for_bit():
    tx, default = (compjax.diloco(optax.adam(1e-2), optax.sgd(0.7), 2, "i", **kw)
                   for kw in ({"merge": "mean", "trim": 0.3}, {}))  # fmt: skip
    args = (
        jax.tree.map(lambda a: a[None], P0),
        jax.vmap(lambda _: default.init(P0))(jnp.arange(1)),
    )

    def run(t):
        def step(p, s):
            u, s = t.update(grads_of(SCALES[0]), s, p)
            return optax.apply_updates(p, u), s

        return jax.make_jaxpr(jax.vmap(step, axis_name="i"))(*args)

    assert str(run(tx)) == str(run(default))


def test_top_k_messages_are_decoded_per_worker_then_merged_with_error_feedback():
    """A deterministic compressor: theta moves by the merge of each worker's top-k message,
    and each worker keeps its own pseudo-gradient less its own message."""
    comp = compjax.top_k(ratio=0.5)
    _, init, step = stepper("median_norm_clip", comp)
    _, state, _ = step(compjax.worker_copies(P0, N), init(), SCALES)
    deltas = pseudo_gradients()
    key = jax.random.key(0)  # top-k uses no randomness

    def message(row):
        return np.asarray(comp.decompress(comp.compress(key, jnp.asarray(row, jnp.float32))))

    sent = {k: np.stack([message(r) for r in v]) for k, v in deltas.items()}
    expected = {k: np.asarray(P0[k], np.float64) - v
                for k, v in numpy_merge("median_norm_clip", sent).items()}  # fmt: skip
    assert_tree_close(compjax.global_params(state, stacked=True), expected)
    memory = jax.tree.leaves(state.error)
    for m, k in zip(memory, sorted(P0), strict=True):  # leaves in key order: "b", "w"
        np.testing.assert_allclose(m[:, 0], deltas[k] - sent[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int8_messages_are_decoded_before_the_merge(dtype):
    """int_quant(8) (stochastic, its own scale per message): theta within the 8-bit grid's
    rounding of the unquantised merge, the liar still clipped."""
    local, theta, _ = one_round("median_norm_clip", compressor=compjax.int_quant(8), dtype=dtype)
    deltas = pseudo_gradients(dtype=dtype)
    start = cast(cast(P0, dtype), jnp.float32)
    exact = numpy_merge("median_norm_clip", deltas)
    grid = max(np.abs(deltas[k][:3]).max() for k in P0) / 127  # one step of an honest grid
    for k in P0:
        step = np.asarray(start[k] - theta[k], np.float64)
        np.testing.assert_allclose(step, exact[k], atol=2 * grid)
        assert local[k].dtype == dtype


@pytest.mark.parametrize("merge", ROBUST)
def test_the_merged_round_is_counted_as_an_all_gather(merge):
    tx = compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "i", compressor=compjax.int_quant(8),
                        merge=merge)  # fmt: skip
    report = compjax.communication(tx, P0, "i", num_workers=N)
    kinds = [kind for kind, _, _ in report.routes]
    assert kinds.count("flag") == 1
    payloads = [(via, bits) for (kind, via, _), (_, bits) in
                zip(report.routes, report.payloads, strict=True) if kind == "payload"]  # fmt: skip
    # one int8 payload per leaf (4 and 12 entries, plus its float32 scale), all-gathered
    assert payloads == [("all_gather", 8 * 4 + 32), ("all_gather", 8 * 12 + 32)]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"merge": "median"}, "merge must be one of"),
        ({"merge": "trimmed_mean", "trim": 0.5}, "trim must be a fraction"),
        ({"merge": "trimmed_mean", "trim": -0.1}, "trim must be a fraction"),
        ({"merge": "median_norm_clip", "trim": True}, "trim must be a fraction"),
        ({"merge": "median_norm_clip", "exchange": "scatter_gather"},
         "exchange must be 'all_gather'"),
        ({"merge": "trimmed_mean", "exchange": Exchange("scatter_gather")},
         "exchange must be 'all_gather'"),
        ({"merge": "trimmed_mean", "exchange": Exchange("all_gather", fast_axis="j")},
         "exchange must be 'all_gather'"),
    ],
)  # fmt: skip
def test_bad_merges_are_refused_naming_the_parameter(kw, match):
    with pytest.raises(ValueError, match=match):
        compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "i", **kw)


def test_the_mean_takes_any_exchange_and_keeps_its_own_route():
    """merge="mean" (any trim) is the compressed mean: int8 codes summed by an all-reduce,
    over "scatter_gather" too, never gathered."""
    tx = compjax.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, "i", compressor=compjax.int_quant(8),
                        exchange="scatter_gather", merge="mean", trim=0.3)  # fmt: skip
    routes = compjax.communication(tx, P0, "i", num_workers=N).routes
    assert [via for kind, via, _ in routes if kind == "payload"] == ["all_reduce"] * 2


def test_merger_names_each_merge_with_weights():
    rng = np.random.default_rng(0)
    stacked = {"a": rng.normal(size=(5, 3)), "b": rng.normal(size=(5, 2, 2))}
    stacked["b"][1] *= 9.0  # worker 1's second leaf far larger: per-leaf clipping differs
    w = jnp.array([1.0, 2.0, 0.0, 1.0, 3.0])

    def same(x, y):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), x, y)

    same(merges.merger("mean")(stacked, w), merges.mean(stacked, w))
    same(merges.merger("median_norm_clip")(stacked, w),
         merges.median_norm_clip(stacked, w, per_leaf=True))  # fmt: skip
    same(merges.merger("trimmed_mean", 0.2)(stacked, w), merges.trimmed_mean(stacked, 0.2, w))
