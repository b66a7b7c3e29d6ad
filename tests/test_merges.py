"""compjax.merges: the robust merges' properties (hypothesis), in the three forms users run
(eager, jax.jit, jax.jit of jax.vmap over a batch of problems), against numpy/scipy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from compjax import merges

N = 5  # workers
SHAPES = {"w": (3, 4), "b": (4,)}


def _eager(fn):
    return fn


def _jit(fn):
    return jax.jit(fn)


def _jit_vmap(fn):
    """The merge of a batch of two problems (the same one twice) under jit(vmap): its first."""
    batched = jax.jit(jax.vmap(fn))

    def run(stacked, *args):
        two = jax.tree.map(lambda a: jnp.stack([a, a]), (stacked, *args))
        return jax.tree.map(lambda a: a[0], batched(*two))

    return run


FORMS = {"eager": _eager, "jit": _jit, "jit_vmap": _jit_vmap}


@functools.cache
def merged(form: str, name: str, trim: float = 0.2, per_leaf: bool = False):
    """One compiled function per (form, merge): ``f(stacked, weights)``."""
    fns = {
        "mean": lambda s, w: merges.mean(s, w),
        "median_norm_clip": lambda s, w: merges.median_norm_clip(s, w, per_leaf=per_leaf),
        "trimmed_mean": lambda s, w: merges.trimmed_mean(s, trim, w),
    }
    return FORMS[form](fns[name])


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
messages = st.fixed_dictionaries(
    {k: arrays(np.float32, (N, *s), elements=finite) for k, s in SHAPES.items()}
)
ONES = np.ones(N, np.float32)


def global_norms(stacked):
    squares = [np.sum(np.asarray(a, np.float64).reshape(N, -1) ** 2, 1) for a in stacked.values()]
    return np.sqrt(sum(squares))


def assert_tree_close(a, b, rtol=1e-5, atol=1e-5):
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=rtol, atol=atol)


@pytest.mark.parametrize("form", FORMS)
@given(stacked=messages)
def test_mean_is_jnp_mean_and_weighted_mean(form, stacked):
    out = merged(form, "mean")(stacked, ONES)
    assert_tree_close(out, {k: np.mean(v, axis=0) for k, v in stacked.items()}, atol=1e-4)
    w = np.arange(1, N + 1, dtype=np.float32)
    out = merged(form, "mean")(stacked, w)
    ref = {k: np.tensordot(w, v.astype(np.float64), 1) / w.sum() for k, v in stacked.items()}
    assert_tree_close(out, ref, atol=1e-3)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", merges.MERGES)
@given(stacked=messages, seed=st.integers(0, 2**16))
def test_permutation_invariance(form, name, stacked, seed):
    perm = np.random.default_rng(seed).permutation(N)
    w = np.arange(1, N + 1, dtype=np.float32)
    a = merged(form, name)(stacked, w)
    b = merged(form, name)({k: v[perm] for k, v in stacked.items()}, w[perm])
    assert_tree_close(a, b, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("per_leaf", [False, True])
@given(stacked=messages)
def test_median_norm_clip_output_within_the_median_norm(form, per_leaf, stacked):
    out = merged(form, "median_norm_clip", per_leaf=per_leaf)(stacked, ONES)
    if per_leaf:
        for k, v in stacked.items():
            norms = np.sort(np.linalg.norm(np.asarray(v, np.float64).reshape(N, -1), axis=1))
            med = norms[(N - 1) // 2]
            assert np.linalg.norm(np.asarray(out[k], np.float64)) <= med * (1 + 1e-5) + 1e-6
    else:
        med = np.sort(global_norms(stacked))[(N - 1) // 2]
        total = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in out.values()))
        assert total <= med * (1 + 1e-5) + 1e-6


def np_median_norm_clip(stacked):
    """Numpy transcription: scale each message by min(1, lower median / norm), then average."""
    norms = global_norms(stacked)
    med = np.sort(norms)[(N - 1) // 2]
    f = np.where(norms > med, med / np.where(norms > 0, norms, 1.0), 1.0)
    return {k: np.mean(v * f.reshape(-1, *[1] * (v.ndim - 1)), axis=0) for k, v in stacked.items()}


@pytest.mark.parametrize("form", FORMS)
@given(stacked=messages)
def test_median_norm_clip_matches_numpy(form, stacked):
    out = merged(form, "median_norm_clip")(stacked, ONES)
    assert_tree_close(out, np_median_norm_clip(stacked), atol=1e-3)


@pytest.mark.parametrize("form", FORMS)
@given(stacked=messages, trim=st.sampled_from([0.0, 0.2, 0.4]))
def test_trimmed_mean_is_scipy_and_within_min_max(form, stacked, trim):
    out = merged(form, "trimmed_mean", trim=trim)(stacked, ONES)
    for k, v in stacked.items():
        # trim * N is whole (0, 1, 2): scipy's trimmed mean.
        ref = scipy.stats.trim_mean(np.asarray(v, np.float64), trim, axis=0)
        np.testing.assert_allclose(np.asarray(out[k]), ref, rtol=1e-5, atol=1e-3)
        assert np.all(np.asarray(out[k]) >= v.min(0) - 1e-3)
        assert np.all(np.asarray(out[k]) <= v.max(0) + 1e-3)


@pytest.mark.parametrize("form", FORMS)
def test_trimmed_mean_fractional_cut_counts_the_boundary_value_in_part(form):
    # 5 workers, trim 0.1: half a worker's weight is cut from each end.
    stacked = {"w": jnp.asarray([[0.0], [1.0], [2.0], [3.0], [10.0]])}
    out = merged(form, "trimmed_mean", trim=0.1)(stacked, ONES)
    ref = (0.5 * 0.0 + 1.0 + 2.0 + 3.0 + 0.5 * 10.0) / 4.0
    np.testing.assert_allclose(np.asarray(out["w"]), [ref], rtol=1e-6)


@pytest.mark.parametrize("form", FORMS)
@given(stacked=messages, who=st.integers(0, N - 1))
def test_one_worker_scaled_by_1e6_is_bounded(form, stacked, who):
    """Whatever one worker sends, the robust merges stay within the honest workers' reach."""
    bad = {k: v.copy() for k, v in stacked.items()}
    for v in bad.values():
        v[who] *= 1e6
    honest = [i for i in range(N) if i != who]
    clip = merged(form, "median_norm_clip")(bad, ONES)
    total = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in clip.values()))
    assert total <= global_norms(stacked)[honest].max() * (1 + 1e-5) + 1e-6
    trimmed = merged(form, "trimmed_mean", trim=0.2)(bad, ONES)  # cuts one worker per end
    for k, v in stacked.items():
        h = np.asarray(v)[honest]
        assert np.all(np.asarray(trimmed[k]) >= h.min(0) - 1e-3)
        assert np.all(np.asarray(trimmed[k]) <= h.max(0) + 1e-3)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_worker(form, bad):
    """The robust merges leave a non-finite worker out; the plain mean is non-finite; a
    merge with every worker left out is NaN."""
    rng = np.random.default_rng(1)
    stacked = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    poisoned = {k: v.copy() for k, v in stacked.items()}
    poisoned["b"][2, 1] = bad
    rest = {k: np.delete(v, 2, axis=0) for k, v in stacked.items()}
    w4 = np.ones(N - 1, np.float32)
    assert not np.all(np.isfinite(np.asarray(merged(form, "mean")(poisoned, ONES)["b"])))
    # The others merged as if worker 2 had not sent: the same as worker 2 at weight 0.
    w0 = ONES.copy()
    w0[2] = 0.0
    for name in ("median_norm_clip", "trimmed_mean"):
        out = merged(form, name)(poisoned, ONES)
        ref = merged(form, name)(stacked, w0)
        assert_tree_close(out, ref, rtol=1e-6, atol=1e-6)
    # (4 workers: the median is the 2nd smallest of 4 norms.)
    ref = merges.median_norm_clip(rest, w4)
    assert_tree_close(merged(form, "median_norm_clip")(poisoned, ONES), ref, rtol=1e-6, atol=1e-6)
    every = {k: np.full_like(v, np.nan) for k, v in stacked.items()}
    for name in ("median_norm_clip", "trimmed_mean"):
        assert np.all(np.isnan(np.asarray(merged(form, name)(every, ONES)["w"])))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", merges.MERGES)
def test_low_precision_leaves_keep_their_dtype(name, dtype):
    rng = np.random.default_rng(2)
    stacked = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    low = jax.tree.map(lambda a: jnp.asarray(a, dtype), stacked)
    out = merged("jit", name)(low, ONES)
    ref = merged("jit", name)(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), low), ONES)
    for k in out:
        assert out[k].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(out[k], np.float32), np.asarray(ref[k]), rtol=1e-2, atol=1e-2
        )


def test_zero_messages_give_zeros():
    zeros = {k: np.zeros((N, *s), np.float32) for k, s in SHAPES.items()}
    for name in merges.MERGES:
        out = merged("jit", name)(zeros, ONES)
        assert all(np.all(np.asarray(v) == 0) for v in out.values())


@pytest.mark.parametrize("trim", [-0.1, 0.5, 0.7, True, "0.2"])
def test_trim_outside_range_raises(trim):
    with pytest.raises(ValueError, match="trim"):
        merges.trimmed_mean({"w": jnp.zeros((N, 2))}, trim)


def test_bad_structure_raises():
    with pytest.raises(ValueError, match="leading worker axis"):
        merges.mean({"a": jnp.zeros((N, 2)), "b": jnp.zeros((N + 1, 2))})
    with pytest.raises(ValueError, match="weights"):
        merges.mean({"a": jnp.zeros((N, 2))}, jnp.ones(N + 1))
    with pytest.raises(ValueError, match="at least one"):
        merges.mean({})
