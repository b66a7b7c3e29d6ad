"""The exact top-k from a sampled threshold (exact_top_k.fast_exact_select): the indices of
``jax.lax.top_k`` of all of ``|x|`` (ties by increasing index), in increasing order,
whichever path it takes.

Two sizes (2**15, and 5003, not a multiple of the blocks) and three densities, so that
the hypothesis examples reuse six compiled programs.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import compjax
from compjax.compressors import exact_top_k, selection


@partial(jax.jit, static_argnames="k")
def _both(x, k):
    fast = exact_top_k.fast_exact_select(x, k)
    return fast.indices, fast.fallback, jnp.sort(selection.exact_select(x, k).indices)


def _inputs(kind, rng, d):
    if kind == "gaussian":
        return rng.standard_normal(d)
    if kind == "ties":  # seven magnitudes: the k-th largest is shared by many entries
        return rng.integers(-3, 4, d) * 0.5
    if kind == "sparse":  # mostly zeros, a clump of large entries
        x = np.zeros(d)
        start = int(rng.integers(0, d - 300))
        x[start : start + 300] = rng.standard_normal(300) * 10
        return x
    if kind == "inf":  # infinities of one sign among Cauchy draws
        x = rng.standard_cauchy(d)
        x[rng.integers(0, d, 5)] = np.inf
        return x
    return rng.standard_cauchy(d)


@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["gaussian", "ties", "sparse", "inf", "cauchy"]),
    d=st.sampled_from([2**15, 5003]),
    density=st.sampled_from([0.001, 0.01, 0.05]),
)
def test_fast_exact_is_lax_top_k_sorted(seed, kind, d, density):
    x = jnp.asarray(_inputs(kind, np.random.default_rng(seed), d), jnp.float32)
    k = max(1, round(d * density))
    fast, _, exact = _both(x, k=k)
    np.testing.assert_array_equal(fast, exact)


def test_gaussians_take_the_candidates_and_misleading_inputs_the_full_top_k():
    """The fast path must be the one taken on ordinary inputs (else the test above proves
    nothing about it).  A NaN, and magnitudes in seven levels (a level holds a seventh of
    the entries: the count jumps from below k to above 1.5 k), fall back; all of them
    still equal lax.top_k."""
    rng = np.random.default_rng(0)
    d, k = 2**15, 328
    nan = rng.standard_normal(d)
    nan[17] = np.nan
    cases = [(rng.standard_normal(d), False) for _ in range(3)]
    cases += [(rng.standard_cauchy(d), False) for _ in range(3)]
    cases += [(nan, True), (rng.integers(-3, 4, d) * 0.5, True)]
    for x, fallback in cases:
        fast, fell_back, exact = _both(jnp.asarray(x, jnp.float32), k=k)
        assert bool(fell_back) == fallback
        np.testing.assert_array_equal(fast, exact)


def test_top_k_takes_the_fast_path_only_where_it_pays():
    assert exact_top_k.fast_exact_pays(2**16, 655)  # density 0.01
    assert not exact_top_k.fast_exact_pays(2**16, 5000)  # 1.5 k > d / 16
    assert not exact_top_k.fast_exact_pays(2**15, 33)  # too small to matter


def test_top_k_exact_on_a_large_input_under_shard_map_and_in_bfloat16():
    """compjax.top_k(ratio=0.01) on 2**17 entries (the fast path) gives lax.top_k's payload,
    also under shard_map with inputs that differ between workers, and in bfloat16."""
    d, comp = 2**17, compjax.top_k(ratio=0.01)
    k = comp.k_for(d)
    assert exact_top_k.fast_exact_pays(d, k)
    xs = jax.random.normal(jax.random.key(1), (2, d))

    def indices(x):
        return comp.compress(None, x).wire["indices"]

    want = [np.sort(jax.lax.top_k(jnp.abs(x), k)[1]) for x in xs]
    mesh = jax.make_mesh((2,), ("data",))
    spec = jax.P("data")
    run = jax.jit(
        jax.shard_map(lambda x: indices(x[0])[None], mesh=mesh, in_specs=spec, out_specs=spec)
    )
    got = run(jax.device_put(xs, jax.NamedSharding(mesh, jax.P("data"))))
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))
    x16 = xs[0].astype(jnp.bfloat16)
    payload = jax.jit(lambda x: comp.compress(None, x))(x16)
    want16 = np.sort(jax.lax.top_k(jnp.abs(x16.astype(jnp.float32)), k)[1])
    np.testing.assert_array_equal(payload.wire["indices"], want16)
    assert payload.wire["values"].dtype == jnp.bfloat16


def test_ties_at_the_kth_magnitude_are_taken_by_index_on_the_fast_path():
    """Entries sharing the k-th largest magnitude (both signs) straddle the cut: the fast
    path keeps the lowest-indexed of them, as lax.top_k does, and is the path taken."""
    rng = np.random.default_rng(3)
    d, k = 2**15, 328
    for _ in range(3):
        x = rng.standard_normal(d)
        kth = np.sort(np.abs(x))[-k]
        tied = rng.choice(d, 40, replace=False)
        x[tied] = kth * rng.choice([-1.0, 1.0], 40)
        fast, fell_back, exact = _both(jnp.asarray(x, jnp.float32), k=k)
        assert not bool(fell_back)
        assert np.sum(np.abs(np.float32(x)) == np.float32(kth)) > 1  # a real tie at the cut
        np.testing.assert_array_equal(fast, exact)


def test_top_k_sends_increasing_indices_below_the_fast_path_too():
    """Where the fast path does not pay, top_k's payload is lax.top_k's indices, sorted,
    with their values: one wire order whatever the size."""
    d, comp = 1000, compjax.top_k(k=37)
    assert not exact_top_k.fast_exact_pays(d, 37)
    x = jax.random.normal(jax.random.key(2), (d,))
    payload = comp.compress(None, x)
    want = np.sort(jax.lax.top_k(jnp.abs(x), 37)[1])
    np.testing.assert_array_equal(payload.wire["indices"], want)
    np.testing.assert_array_equal(payload.wire["values"], np.asarray(x)[want])
