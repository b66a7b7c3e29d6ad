"""Deep Gradient Compression: agreement with a plain step-by-step reference, its selection,
masking, accounting, the compressed all-reduce exchange and argument checks.

Shapes are fixed (``PARAMS`` of test_transforms, one 32768-entry vector for the
selection) so that each configuration compiles once.
"""

import math
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_transforms import PARAMS, assert_trees_close, run_shard_map, run_vmap, worker_grads

import compjax
from compjax.compressors import selection as select_lib
from compjax.compressors.selection import sample_layout, sampled_threshold_select
from compjax.transforms.dgc import DGCState, dgc

N = 8
STEPS = 5

# Each case: dgc's keyword arguments (min_size=10: "w" (15 entries) is sparse, "b" dense).
CASES = {
    "momentum, masking, warm-up 0.5 -> 0.2": dict(
        ratio=0.2, warmup_ratios=(0.5,), warmup_steps_per_phase=2
    ),
    "nesterov, clipping, no masking, two warm-up phases": dict(
        ratio=0.2,
        nesterov=True,
        clip_norm=4.0,
        momentum_masking=False,
        warmup_ratios=(0.6, 0.4),
        warmup_steps_per_phase=1,
    ),
    "no momentum correction, clipping": dict(ratio=0.3, momentum_correction=False, clip_norm=1.0),
    "flatten, clipping, masking, momentum 0.5": dict(
        ratio=0.25, flatten=True, clip_norm=3.0, momentum=0.5
    ),
    # The whole leaf is the sample: the threshold is the exact k-th largest entry.
    "sampled threshold, warm-up": dict(
        ratio=0.2,
        warmup_ratios=(0.5,),
        warmup_steps_per_phase=3,
        sampled_threshold=True,
        sample_ratio=1.0,
    ),
}


def reference(grads_per_step, n, *, ratio, momentum=0.9, nesterov=False,
              momentum_correction=True, clip_norm=None, momentum_masking=True,
              warmup_ratios=(), warmup_steps_per_phase=0, flatten=False, min_size=10):  # fmt: skip
    """DGC written plainly in float64 numpy: per worker, per step, exact top-k."""
    names = sorted(PARAMS)  # jax's leaf order for a dict

    def vectors(grads):  # name -> (n, d) per-worker gradients
        flat = {k: np.asarray(grads[k], np.float64).reshape(n, -1) for k in names}
        return {"all": np.concatenate([flat[k] for k in names], axis=1)} if flatten else flat

    first = vectors(grads_per_step[0])
    u = {k: np.zeros_like(g) for k, g in first.items()}
    v = {k: np.zeros_like(g) for k, g in first.items()}
    m = momentum
    outs = []
    for t, grads in enumerate(grads_per_step):
        phase = (
            min(t // warmup_steps_per_phase, len(warmup_ratios)) if warmup_steps_per_phase else 0
        )
        r = (*warmup_ratios, ratio)[phase] if warmup_steps_per_phase else ratio
        out = {}
        for key, g in vectors(grads).items():
            d = g.shape[1]
            if clip_norm is not None:
                limit = clip_norm / math.sqrt(n)
                norms = np.linalg.norm(g, axis=1, keepdims=True)
                g = g * np.minimum(1.0, limit / norms)
            if not momentum_correction:
                acc = g
            elif nesterov:
                u[key] = m * (u[key] + g)
                acc = u[key] + g
            else:
                u[key] = m * u[key] + g
                acc = u[key]
            if d < min_size:
                out[key] = acc.mean(axis=0)
                continue
            v[key] = v[key] + acc
            k = math.ceil(r * d - 1e-9)
            message = np.zeros(d)
            for i in range(n):
                sent = np.argsort(-np.abs(v[key][i]))[:k]
                message[sent] += v[key][i, sent]
                v[key][i, sent] = 0.0
                if momentum_correction and momentum_masking:
                    u[key][i, sent] = 0.0
            out[key] = message / n
        outs.append(out)
    return outs, u, v


def as_vectors(tree, n, flatten):
    """A tree with a leading worker axis (and the per-worker axis of 1) as name -> (n, d)."""
    if flatten:
        return {"all": np.asarray(tree).reshape(n, -1)}
    return {k: np.asarray(a).reshape(n, -1) for k, a in tree.items()}


def updates_as_vectors(update, flatten):
    if flatten:
        return {"all": np.concatenate([np.asarray(update[k]).reshape(-1) for k in sorted(update)])}
    return {k: np.asarray(a).reshape(-1) for k, a in update.items()}


GRADS = [worker_grads(N, t) for t in range(STEPS)]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n == "sampled threshold, warm-up" else n
        for n in CASES
    ],
)
def test_matches_reference_under_vmap_and_shard_map(name):
    kwargs = dict(CASES[name])
    selection = {k: kwargs.pop(k) for k in ("sampled_threshold", "sample_ratio") if k in kwargs}
    tx = dgc("data", min_size=10, **{"sampled_threshold": False, **selection, **kwargs})
    expected, u, v = reference(GRADS, N, **kwargs)
    outs, state = run_vmap(tx, GRADS, N)
    flatten = kwargs.get("flatten", False)
    for got, want in zip(outs, expected, strict=True):
        assert_trees_close(updates_as_vectors(got, flatten), want, rtol=1e-5, atol=1e-5)
    assert_trees_close(as_vectors(state.velocity, N, flatten), v, rtol=1e-5, atol=1e-5)
    if kwargs.get("momentum_correction", True):
        assert_trees_close(as_vectors(state.momentum, N, flatten), u, rtol=1e-5, atol=1e-5)
    else:
        assert state.momentum is None
    np.testing.assert_array_equal(state.step, STEPS)
    mesh = jax.make_mesh((N,), ("data",))
    assert_trees_close(run_shard_map(tx, GRADS, mesh), outs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_nothing_dropped_is_momentum_sgd(nesterov):
    """ratio=1 without masking: chain(dgc, sgd) is sgd with (Nesterov) momentum on the mean."""
    tx = optax.chain(
        dgc(
            "data",
            1.0,
            nesterov=nesterov,
            momentum_masking=False,
            sampled_threshold=False,
            min_size=10,
        ),
        optax.sgd(0.1),
    )
    outs, _ = run_vmap(tx, GRADS, N)
    sgd = optax.sgd(0.1, momentum=0.9, nesterov=nesterov)
    state = sgd.init(PARAMS)
    for got, grads in zip(outs, GRADS, strict=True):
        want, state = sgd.update(jax.tree.map(lambda g: g.mean(0), grads), state)
        assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


BIG = {"w": jnp.zeros((64, 64))}  # 4096 entries: k = 41 at ratio 0.01


@partial(jax.jit, static_argnums=(0, 1, 2))
def _one_worker_steps(masking, sampled, exchange, grads):
    """Single-worker steps (a scan): the state before each step, the update, the state after."""
    tx = dgc(
        None,
        0.01,
        momentum_masking=masking,
        sampled_threshold=sampled,
        min_size=1,
        exchange=exchange,
    )

    def step(state, g):
        upd, new = tx.update({"w": g}, state)
        return new, (state, upd, new)

    return jax.lax.scan(step, tx.init(BIG), grads)[1]


MASKING_CASES = [
    (masking, sampled, "all_gather") for sampled in (False, True) for masking in (True, False)
] + [(True, False, "scatter_gather")]  # one worker: v - local, masking where local != 0


@pytest.mark.parametrize(("masking", "sampled", "exchange"), MASKING_CASES)
def test_momentum_masking_zeroes_exactly_the_sent_coordinates(masking, sampled, exchange):
    grads = jax.random.normal(jax.random.key(7), (3, 64, 64)) * jnp.linspace(0.1, 3.0, 64)
    old, upd, new = jax.tree.map(np.asarray, _one_worker_steps(masking, sampled, exchange, grads))
    for t, g in enumerate(np.asarray(grads).reshape(3, -1)):
        u_old, v_old = (x["w"][t].reshape(-1) for x in (old.momentum, old.velocity))
        u_new, v_new = (x["w"][t].reshape(-1) for x in (new.momentum, new.velocity))
        upd_t = upd["w"][t].reshape(-1)
        sent = upd_t != 0
        # Exact top-k sends k entries; the sampled threshold within the band or k.
        assert 33 <= sent.sum() <= (53 if sampled else 41)
        u = 0.9 * u_old + g
        np.testing.assert_array_equal(v_new == 0, sent)  # the velocity is always cleared
        np.testing.assert_allclose(v_new + upd_t, v_old + u, rtol=1e-6, atol=1e-6)  # nothing lost
        if masking:
            np.testing.assert_array_equal(u_new == 0, sent)
            np.testing.assert_allclose(u_new[~sent], u[~sent], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_allclose(u_new, u, rtol=1e-6, atol=1e-6)
            assert np.all(u_new[sent] != 0)


D, K = 2**15, 33  # ratio 0.001 of 32768
LOW, CAP = 27, 42  # ceil(0.8 k), floor(1.3 k)
STRIDE, NUM_SAMPLES = sample_layout(D, K, 0.01)


@jax.jit
def _select(x, offset):
    return sampled_threshold_select(x, K, offset=offset)


def check_selection(x, sel):
    """Band or fallback, a top set of |x|, padding marked with d."""
    idx, count = np.asarray(sel.indices), int(sel.count)
    assert idx.shape == (CAP,)
    assert np.all(idx[count:] == D) and np.all(idx[:count] < D)
    chosen = np.zeros(D, bool)
    chosen[idx[:count]] = True
    assert chosen.sum() == count  # distinct
    if bool(sel.fallback):
        assert count == K  # the exact top-k
    else:
        assert LOW <= count <= CAP
    mag = np.abs(x)
    assert mag[chosen].min() >= mag[~chosen].max()  # the largest entries


def test_sample_layout():
    assert (STRIDE, NUM_SAMPLES) == (15, 2184)  # >= 2 d / k = 1986 samples, odd stride
    assert sample_layout(100, 1, 0.01) == (1, 100)  # sample everything


@given(seed=st.integers(0, 2**31 - 1), offset=st.integers(0, 10**6))
def test_threshold_on_gaussian_is_in_band_or_falls_back(seed, offset):
    x = np.random.default_rng(seed).standard_normal(D).astype(np.float32)
    check_selection(x, _select(x, offset))


def test_threshold_accepts_or_falls_back_on_gaussians():
    """At d = 32768, k = 33 the sample's rank-3 threshold is noisy: both outcomes occur."""
    rng = np.random.default_rng(0)
    fallbacks = []
    for offset in range(16):
        x = rng.standard_normal(D).astype(np.float32)
        sel = _select(x, offset)
        check_selection(x, sel)
        fallbacks.append(bool(sel.fallback))
    assert any(fallbacks) and not all(fallbacks)


@given(
    seed=st.integers(0, 2**31 - 1),
    outliers=st.integers(0, 200),
    sampled_scale=st.sampled_from([0.0, 0.1, 0.5, 2.0, 3.0, 10.0]),
)
def test_misleading_samples_fall_back_or_stay_in_band(seed, outliers, sampled_scale):
    """Outliers the sample misses, or a sample much larger or smaller than the rest."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(D).astype(np.float32)
    offset = int(rng.integers(0, STRIDE))
    sampled = offset + STRIDE * np.arange(NUM_SAMPLES)
    x[sampled] *= sampled_scale
    unsampled = np.setdiff1d(np.arange(D), sampled)
    x[rng.choice(unsampled, outliers, replace=False)] = 1e3 + np.arange(outliers)
    sel = _select(x, offset)
    check_selection(x, sel)
    if outliers > CAP or sampled_scale == 0.0:  # threshold far too low: too many pass it
        assert bool(sel.fallback)


def pareto_with_inflated_sample(scale):
    """|x| at exact Pareto(1) quantiles (count(|x| >= t) ~ d / t); the sample at offset 0
    multiplied by ``scale``."""
    rng = np.random.default_rng(3)
    sampled = STRIDE * np.arange(NUM_SAMPLES)
    rest = np.setdiff1d(np.arange(D), sampled)
    x = np.zeros(D, np.float32)
    x[rng.permutation(rest)] = len(rest) / (np.arange(len(rest)) + 0.5)
    x[sampled] = scale * NUM_SAMPLES / (np.arange(NUM_SAMPLES) + 0.5)
    return x * rng.choice([-1.0, 1.0], D).astype(np.float32)


@pytest.mark.parametrize(("iters", "accepted"), [(10, True), (2, True), (1, False), (0, False)])
def test_threshold_is_lowered_into_the_band(iters, accepted):
    """A sample twice too large: about 24 then 25 entries pass, after two 0.8 reductions 31."""
    x = pareto_with_inflated_sample(2.0)
    sel = jax.jit(partial(sampled_threshold_select, k=K, max_adaptation_iters=iters))(x)
    check_selection(x, sel)
    assert bool(sel.fallback) != accepted
    if accepted:
        assert 27 <= int(sel.count) <= 35


# The fast selection (the sample's threshold on mask words; adapted on block maxima,
# compaction on candidate blocks) must give the reference selection (full passes over
# |x|) entry for entry, NaNs and infinities included.  Two sizes: 2**15, and one that is
# not a multiple of the words or the blocks; two densities: 0.001 (blocks of 64) and 0.01
# (blocks of 8, no sub-blocks).
@partial(jax.jit, static_argnames=("k", "iters"))
def _both_selections(x, offset, k, iters):
    samples, top = select_lib.sample_values(x, k, offset, 0.01)
    args = (samples, top, k, (0.8, 1.3), iters)
    reference = select_lib._reference_select(jnp.abs(x), *args)
    blocked = select_lib._blocked_select(x, *args)
    return reference, blocked


def _inputs(draw_kind, rng, d):
    if draw_kind == "gaussian":
        return rng.standard_normal(d)
    if draw_kind == "ties":  # few distinct magnitudes: many entries equal the threshold
        return rng.integers(-3, 4, d) * 0.5
    if draw_kind == "sparse":  # mostly zeros, a few large entries in clumps
        x = np.zeros(d)
        start = int(rng.integers(0, d - 200))
        x[start : start + 200] = rng.standard_normal(200) * 10
        x[rng.integers(0, d, 40)] = rng.standard_normal(40)
        return x
    if draw_kind == "nan":  # a NaN reaches every threshold on the words' path
        x = rng.standard_normal(d)
        x[rng.integers(0, d, 2)] = np.nan
        return x
    if draw_kind == "infs":  # both infinities: x sums to NaN
        x = rng.standard_cauchy(d)
        x[rng.integers(0, d, 2)] = [np.inf, -np.inf]
        return x
    if draw_kind == "zeros":  # three non-zero entries: the sample's threshold is 0
        x = np.zeros(d)
        x[rng.integers(0, d, 3)] = 1.0
        return x
    return rng.standard_cauchy(d)  # heavy tails


@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["gaussian", "ties", "sparse", "zeros", "cauchy", "nan", "infs"]),
    d=st.sampled_from([D, 5003]),
    density=st.sampled_from([0.001, 0.01]),
    offset=st.integers(0, 100),
    iters=st.sampled_from([0, 3]),
)
def test_blocked_selection_is_the_reference_selection(seed, kind, d, density, offset, iters):
    x = jnp.asarray(_inputs(kind, np.random.default_rng(seed), d), jnp.float32)
    k = max(1, round(d * density))
    (ref_idx, ref_n, ref_ok), (idx, n, ok) = _both_selections(x, offset, k=k, iters=iters)
    assert bool(ok) == bool(ref_ok)
    np.testing.assert_array_equal(idx, ref_idx)
    _, capacity = select_lib.band_limits(k, d, (0.8, 1.3))
    if int(ref_n) > capacity:  # too many pass: the count may be that of the blocks instead
        assert int(n) > capacity
    else:
        assert int(n) == int(ref_n)


# The sample's k-th largest by each of its three ways: a top-k (few values), a top-k of
# the blocks with the largest maxima (few wanted of many), a bisection on the bits.
KTH_CASES = [(100, 10), (6400, 3), (10000, 100)]


@pytest.mark.parametrize(("m", "top"), KTH_CASES)
def test_kth_largest_is_top_ks_on_one_device_and_under_shard_map(m, top):
    """Equal to ``jax.lax.top_k(values, top)[0][-1]``, also under ``jax.shard_map`` with
    values that differ between workers (the bisection's loop once kept its bounds as
    constants, the same on every worker, and failed to trace there)."""
    values = jnp.abs(jax.random.normal(jax.random.key(m), (2, m)))
    want = [float(jax.lax.top_k(v, top)[0][-1]) for v in values]
    assert [float(select_lib.kth_largest(v, top)) for v in values] == want
    mesh = jax.make_mesh((2,), ("data",))
    run = jax.shard_map(
        lambda v: select_lib.kth_largest(v[0], top)[None],
        mesh=mesh,
        in_specs=jax.P("data"),
        out_specs=jax.P("data"),
    )
    got = jax.jit(run)(jax.device_put(values, jax.NamedSharding(mesh, jax.P("data"))))
    assert np.asarray(got).tolist() == want


@pytest.mark.parametrize("top", [1, 64, 65, 2999, 3000, 9000, 10000])
def test_kth_largest_by_digits_with_ties_zeros_and_infinities(top):
    """The radix selection (10,000 values, more wanted than the blocks serve) where the
    answer is shared by many values, is 0, is an infinity, or is the smallest value."""
    rng = np.random.default_rng(top)
    values = np.abs(rng.integers(-3, 4, 10_000) * 0.5).astype(np.float32)
    values[:3000] = np.inf if top <= 3000 else values[:3000]
    values[5000:5005] = np.float32(1e-45)  # subnormal
    v = jnp.asarray(rng.permutation(values))
    assert float(select_lib.kth_largest(v, top)) == float(jax.lax.top_k(v, top)[0][-1])


def test_blocked_selection_at_a_zero_threshold_keeps_every_entry_once():
    """k = 4000 of 5003: the capacity is d, so a threshold of 0 (mostly zeros) is accepted
    and every entry is selected, once, in order; the blocks' slots past the last entry
    (value 0, also reaching the threshold) are not."""
    x = jnp.zeros(5003).at[jnp.array([7, 4000])].set(1.0)
    (ref_idx, ref_n, ref_ok), (idx, n, ok) = _both_selections(x, 0, k=4000, iters=0)
    assert bool(ok) and bool(ref_ok) and int(n) == int(ref_n) == 5003
    np.testing.assert_array_equal(idx, np.arange(5003))
    np.testing.assert_array_equal(idx, ref_idx)


def test_communication_reports_the_steady_state_payload():
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}  # 4096 sparse, 64 dense
    flag, dense = 8, 64 * 32
    k, cap = 41, 53  # ceil(0.01 * 4096), floor(1.3 * 41)
    exact = compjax.communication(dgc("data", 0.01, sampled_threshold=False), params, "data", 2)
    assert exact.bits_per_worker == flag + dense + k * 64
    assert exact.messages == (("flag", 8), ("dense", dense), ("payload", k * 64))
    for kwargs in ({}, {"warmup_steps_per_phase": 100}):
        report = compjax.communication(dgc("data", 0.01, **kwargs), params, "data", 2)
        assert report.bits_per_worker == flag + dense + cap * 64
    half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    report = compjax.communication(dgc("data", 0.01, sampled_threshold=False), half, "data", 2)
    assert report.bits_per_worker == flag + 64 * 16 + k * (32 + 16)


def test_non_finite_gradient_gives_nan_and_keeps_the_state():
    tx = dgc("data", 0.2, min_size=10, sampled_threshold=False)
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    _, state = step(GRADS[0], jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(N)))
    bad = jax.tree.map(lambda g: g.at[3, 0].set(jnp.nan), GRADS[1])
    upd, new = step(bad, state)
    assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(upd))
    assert_trees_close(new, state, rtol=0, atol=0)


def test_state_and_errors():
    tx = dgc("batch", min_size=10)
    state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(2))
    assert isinstance(state, DGCState)
    specs = compjax.state_specs(jax.eval_shape(tx.init, PARAMS), "data")
    assert specs.step == jax.P() and specs.velocity["w"] == jax.P("data")
    with pytest.raises(ValueError, match="axis_name 'batch' is not bound"):
        jax.vmap(tx.update, axis_name="data")(jax.tree.map(lambda g: g[:2], GRADS[0]), state)
    with pytest.raises(ValueError, match="velocity"):
        dgc(None, min_size=10).update(PARAMS, tx.init({"w": jnp.ones((5, 3))}))


BAD = [
    ("ratio", {"ratio": 0.0}),
    ("ratio", {"ratio": 1.5}),
    ("ratio", {"ratio": "0.1"}),
    ("momentum", {"momentum": 1.0}),
    ("momentum", {"momentum": -0.1}),
    ("nesterov", {"nesterov": True, "momentum_correction": False}),
    ("clip_norm", {"clip_norm": 0.0}),
    ("clip_norm", {"clip_norm": -1.0}),
    ("warmup_ratios", {"warmup_ratios": (0.5, 0.0)}),
    ("warmup_ratios", {"warmup_ratios": (2.0,)}),
    ("warmup_ratios", {"warmup_ratios": "0.5"}),
    ("warmup_steps_per_phase", {"warmup_steps_per_phase": -1}),
    ("warmup_steps_per_phase", {"warmup_steps_per_phase": 1.5}),
    ("sample_ratio", {"sample_ratio": 0.0}),
    ("accept_band", {"accept_band": (1.1, 1.3)}),
    ("accept_band", {"accept_band": (0.8, 0.9)}),
    ("accept_band", {"accept_band": (0.8,)}),
    ("max_adaptation_iters", {"max_adaptation_iters": -1}),
    ("min_size", {"min_size": 0}),
    ("exchange", {"exchange": "ring"}),
    ("exchange", {"exchange": None}),
]


@pytest.mark.parametrize(("name", "kwargs"), BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_bad_parameters_raise_naming_them(name, kwargs):
    with pytest.raises(ValueError, match=name):
        dgc("data", **kwargs)


# -- other exchanges: the sparse leaves through compjax.exchange.compressed_mean ------------
SCATTER = dict(
    ratio=0.2,
    min_size=10,
    nesterov=True,
    clip_norm=4.0,
    warmup_ratios=(0.6,),
    warmup_steps_per_phase=2,
    exchange="scatter_gather",
)


@cache
def _scatter_gather_run():
    """The float32 run of ``dgc(**SCATTER)`` under vmap (shared by the tests below)."""
    return run_vmap(dgc("data", **SCATTER), GRADS, N)


@pytest.mark.parametrize("sampled", [None, True])
def test_scatter_gather_loses_nothing(sampled):
    """Without momentum correction, ``n sum_t update + sum_i v_i + sum_j m_j = sum_t,i g_i``,
    through warm-up phases of different top-k ratios sharing the server memory (flatten: 18
    entries, 3 per shard, 2 then 1 sent per shard), with the exact top-k per shard or the
    sampled threshold."""
    tx = dgc(
        "data",
        0.2,
        momentum_correction=False,
        warmup_ratios=(0.6,),
        warmup_steps_per_phase=2,
        min_size=10,
        flatten=True,
        exchange="scatter_gather",
        sampled_threshold=sampled,
    )
    outs, state = run_vmap(tx, GRADS, N)
    applied = N * sum(updates_as_vectors(o, True)["all"] for o in outs)
    residual = as_vectors(state.velocity, N, True)["all"].sum(0)
    server = as_vectors(state.server_error, N, True)["all"].sum(0)
    assert np.abs(server).max() > 0  # the shard owners did drop entries
    inputs = sum(
        updates_as_vectors(jax.tree.map(lambda a: a.sum(0), g), True)["all"] for g in GRADS
    )
    np.testing.assert_allclose(applied + residual + server, inputs, rtol=0, atol=1e-4)


def test_scatter_gather_shard_map_agrees_with_vmap():
    tx = dgc("data", **SCATTER)
    outs, state = _scatter_gather_run()
    assert state.server_error["w"].shape == (N, 1, 5, 3)
    specs = compjax.state_specs(jax.eval_shape(tx.init, PARAMS), "data")
    assert specs.server_error["w"] == jax.P("data")
    mesh = jax.make_mesh((N,), ("data",))
    assert_trees_close(run_shard_map(tx, GRADS, mesh), outs, rtol=1e-5, atol=1e-6)


def test_scatter_gather_bfloat16_is_finite_and_close():
    tx = dgc("data", **SCATTER)
    half = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)  # noqa: E731
    state = jax.vmap(lambda _: tx.init(half(PARAMS)))(jnp.arange(N))
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    want, _ = _scatter_gather_run()
    for grads, expected in zip(GRADS, want, strict=True):
        upd, state = step(half(grads), state)
        got = jax.tree.map(lambda u: np.asarray(u[0], np.float32), upd)
        assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(upd))
        assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(got))
        assert_trees_close(got, expected, rtol=0.02, atol=0.02)  # seen: 0.005


def test_communication_of_the_compressed_all_reduce():
    """Two workers: each sends the top 20 of each 2048-entry shard, then of its own shard."""
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}  # 4096 sparse, 64 dense
    flag, dense, shard = 8, 64 * 32, 20 * 64  # round(0.01 * 2048) entries of 32 + 32 bits
    for kwargs in ({}, {"warmup_steps_per_phase": 100}):
        report = compjax.communication(
            dgc("data", 0.01, exchange="scatter_gather", **kwargs), params, "data", 2
        )
        assert report.payloads == (
            ("flag", 8),
            ("dense", dense),
            ("scatter", 2 * shard),
            ("gather", shard),
        )
        assert report.payload_bits == flag + dense + 3 * shard
        assert report.bits_per_worker == flag + dense + shard + shard  # half the scatter leaves
    tx = dgc(("hosts", "local"), 0.01, exchange=compjax.hierarchical("local"))
    report = compjax.communication(tx, params, ("hosts", "local"), num_workers=2)
    kinds = [kind for kind, _ in report.messages]
    assert kinds == ["flag", "dense", "fast_reduce_scatter", "scatter", "gather", "fast_all_gather"]
    assert report.payload_bits - sum(b for k, b in report.payloads if k.startswith("fast_")) == (
        flag + dense + 2 * shard // 2 + shard // 2
    )
    # ring traffic: the flag and the dense leaf all-reduced over all 4 workers (2 * 3/4),
    # half the scatter leaves over the 2 hosts, the gathered shard goes to the other host
    assert report.slow_bits == 1.5 * (flag + dense) + shard // 2 + shard // 2
