"""Means that transformations take themselves (not by compjax.exchange) near float32's limit.

PowerSGD's all-reduces of ``P`` and ``Q`` and of its uncompressed leaves, and
DGC's dense all-reduce and summed sparse messages, add ``n`` workers' values:
near float32's largest value the sum overflows though the mean does not.  And
a norm of entries beyond ``1.8e19`` overflows (PowerSGD's Gram-Schmidt, DGC's
clipping), which used to turn the update silently into zeros.  Each is
checked here on gradients every worker shares, whose mean is known exactly.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax
from compjax.exchange.overflow import mean_without_overflow
from compjax.transforms.powersgd import orthogonalize

WORKERS = 4
TOP = float(np.finfo(np.float32).max)
# A rank-1 matrix (PowerSGD's rank-1 approximation of it is itself) and a 1-D leaf.
PATTERN = np.outer([1.0, -1.0, 0.5], [1.0, 0.5, 0.25, 1.0, -1.0])

TRANSFORMS = {
    "powersgd": lambda: compjax.powersgd(rank=1, axis_name="data", min_compression_rate=1.0),
    # dense: the 1-D leaf is all-reduced (below min_size); ratio 1 sends every entry of w.
    "dgc": lambda: compjax.dgc("data", 1.0, momentum=0.0, min_size=2, sampled_threshold=False),
    "dgc(clip)": lambda: compjax.dgc(
        "data", 1.0, momentum=0.0, min_size=2, sampled_threshold=False, clip_norm=1.0
    ),
}


def _grads(scale, dtype=jnp.float32):
    w = jnp.asarray(np.broadcast_to(scale * PATTERN, (WORKERS, 3, 5)), dtype)
    return {"w": w, "b": jnp.full((WORKERS, 1), scale, dtype)}


@partial(jax.jit, static_argnums=(0, 2))
def _two_steps(name, grads, dtype_name):
    tx = TRANSFORMS[name]()
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], dtype_name), grads)
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(WORKERS))
    step = jax.vmap(tx.update, axis_name="data")
    first, state = step(grads, state)
    second, state = step(grads, state)
    return first, second, state


def _finite(tree) -> bool:
    return all(
        bool(np.all(np.isfinite(np.asarray(a, np.float64))))
        for a in jax.tree.leaves(tree)
        if jnp.issubdtype(a.dtype, jnp.floating)
    )


@pytest.mark.parametrize("scale", [1.0, 1e20, 3e38, TOP], ids=["1", "1e20", "3e38", "max"])
@pytest.mark.parametrize("name", ["powersgd", "dgc"])
def test_the_mean_of_equal_gradients_near_the_float32_limit_is_that_gradient(name, scale):
    """Every worker sends ``g``: each step's update is ``g`` (up to float32 rounding), and the
    state stays finite; before, 1e20 gave PowerSGD zero updates forever and 3e38 NaN steps.

    At float32's maximum PowerSGD's ``g + e`` overflows once the first step's rounding left
    ``e != 0``: it saturates, and the second step is taken (it was refused until 2026-11-27)."""
    grads = _grads(scale)
    first, second, state = _two_steps(name, grads, "float32")
    for update in (first, second):
        for k, g in grads.items():
            np.testing.assert_allclose(
                np.asarray(update[k][0], np.float64),
                np.asarray(g[0], np.float64),
                rtol=2e-6,
                err_msg=f"{name} {scale} {k}",
            )
    assert _finite(state), (name, scale)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_dgc_dense_mean_of_the_largest_low_precision_gradients(dtype):
    top = float(jnp.finfo(dtype).max)
    grads = _grads(top, dtype)
    first, second, state = _two_steps("dgc", grads, jnp.dtype(dtype).name)
    for update in (first, second):
        for k, g in grads.items():
            np.testing.assert_array_equal(np.asarray(update[k][0]), np.asarray(g[0]))
    assert _finite(state)


def test_dgc_clips_huge_gradients_to_the_limit_not_to_zero():
    """``sum(g**2)`` overflowed for entries beyond 1.8e19: the norm was Inf and the clipped
    gradient zero.  Each worker's gradient is clipped to norm ``1 / sqrt(n)``."""
    grads = _grads(1e20)
    first, _, _ = _two_steps("dgc(clip)", grads, "float32")
    norm = np.sqrt(sum(np.sum(np.asarray(first[k][0], np.float64) ** 2) for k in ("w",)))
    np.testing.assert_allclose(norm, 1 / np.sqrt(WORKERS), rtol=1e-5)


def test_orthogonalize_columns_beyond_the_norms_overflow():
    """Huge or tiny columns give the same orthonormal columns as moderate ones (the norm of
    1e20 entries overflowed, zeroing the column); a zero column stays zero."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((6, 3)).astype(np.float32)
    m[:, 2] = 0.0
    want = np.asarray(orthogonalize(jnp.asarray(m)))
    np.testing.assert_allclose(want[:, :2].T @ want[:, :2], np.eye(2), atol=1e-6)
    for scale in (2.0**70, 2.0**126, 2.0**-80):
        got = np.asarray(jax.jit(orthogonalize)(jnp.asarray(m * np.float32(scale))))
        np.testing.assert_array_equal(got, want, err_msg=str(scale))


def test_a_transformations_mean_is_total_over_n_unless_it_overflowed():
    """The means DGC and PowerSGD take themselves (``mean_without_overflow``, as each
    exchange's): the rescaled sum where the sum overflowed, ``total / n`` bit for bit where
    it did not, and a poisoned term keeps its entry non-finite."""
    values = jnp.asarray([[1.0, 3e38, -TOP], [2.0, 3e38, -TOP], [4.0, 3e38, -TOP]], jnp.float32)

    def resum(s):
        return jnp.sum(values * s, axis=0)

    got = np.asarray(jax.jit(lambda: mean_without_overflow(resum(1.0), resum, 3)[0])())
    np.testing.assert_allclose(got, [7 / 3, 3e38, -TOP], rtol=1e-7)
    assert np.all(np.isfinite(got))
    small = values[:, :1]
    plain = jax.jit(
        lambda: mean_without_overflow(jnp.sum(small, 0), lambda s: jnp.sum(small * s, 0), 3)[0]
    )
    np.testing.assert_array_equal(plain(), jax.jit(lambda: jnp.sum(small, 0) / 3)())
    poisoned = values.at[0, 1].set(jnp.inf)
    out, finite = mean_without_overflow(
        jnp.sum(poisoned, axis=0), lambda s: jnp.sum(poisoned * s, axis=0), 3
    )
    assert not np.isfinite(np.asarray(out)[1]) and not bool(finite)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("workers", [3, 4])
def test_a_low_precision_sum_keeps_its_dtype_and_saturates_at_its_largest(dtype, workers):
    """A sum in bfloat16 or float16 (DGC's dense all-reduce sends the gradient's dtype): the
    mean comes back in that dtype, ``total / n`` bit for bit where the sum is finite, and
    where it overflowed the rescaled sum, saturating at the dtype's largest value (float32's
    largest would round to Inf there), not Inf."""
    top = float(jnp.finfo(dtype).max)
    rows = [[1.0, top, -top, 0.75 * top]] + [[2.0, top, -top, 0.5 * top]] * (workers - 1)
    values = jnp.asarray(rows, dtype)

    @jax.jit
    def mean(values):
        return mean_without_overflow(jnp.sum(values, 0), lambda s: jnp.sum(values * s, 0), workers)

    got, finite = mean(values)
    assert got.dtype == dtype and bool(finite)
    plain = jax.jit(lambda v: jnp.sum(v, 0) / workers)(values)
    np.testing.assert_array_equal(np.asarray(got)[:1], np.asarray(plain)[:1])
    want = np.mean(np.asarray(values, np.float64), axis=0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2)
    assert np.all(np.isfinite(np.asarray(got, np.float64)))
    if workers == 4:  # 4 x top/4 is top exactly
        assert np.asarray(got, np.float64)[1] == top and np.asarray(got, np.float64)[2] == -top


@pytest.mark.parametrize("workers", [1, 3])
def test_mean_without_overflow_is_total_over_n_unless_it_overflowed_and_keeps_no_copy(workers):
    """``overflow.mean_without_overflow`` (every exchange's mean) equals ``total / n`` bit for
    bit where the sum is finite, the rescaled sum where it overflowed, and a poisoned term
    stays non-finite, also under ``vmap`` with one worker overflowing; its flag says whether
    the mean is finite (what the guard then skips reading).  Its ``while_loop`` carries the
    sum in place and the division fuses with the caller: compiled, the function below keeps
    no temporary array (a carried ``total / n`` was one more, with its pass)."""
    values = jnp.asarray([[1.0, 3e38, -TOP], [2.0, 3e38, -TOP], [4.0, 3e38, -TOP]], jnp.float32)
    values = values[:, :1] if workers == 1 else values

    @jax.jit
    def mean(values):
        return mean_without_overflow(jnp.sum(values, 0), lambda s: jnp.sum(values * s, 0), 3)

    got, finite = mean(values)
    assert bool(finite)
    np.testing.assert_array_equal(
        np.asarray(got)[:1], np.asarray(jax.jit(lambda v: jnp.sum(v, 0) / 3)(values))[:1]
    )
    if workers > 1:
        np.testing.assert_allclose(got, [7 / 3, 3e38, -TOP], rtol=1e-7)
        for bad in (jnp.nan, jnp.inf):
            poisoned, finite = mean(values.at[0, 1].set(bad))
            assert not np.isfinite(np.asarray(poisoned)[1]) and not bool(finite)
        stacked = jnp.stack([values[:, :1] * np.float32(0.5), values[:, 1:2]])
        each, finite = jax.jit(jax.vmap(mean))(stacked)
        np.testing.assert_allclose(np.asarray(each)[:, 0], [7 / 6, 3e38], rtol=1e-7)
        assert np.asarray(finite).tolist() == [True, True]
    x = jax.ShapeDtypeStruct((1 << 16,), jnp.float32)

    def step(a, b):
        return mean_without_overflow(a + b, lambda s: a * s + b * s, 8)[0] * 0.5 + a

    memory = jax.jit(step).lower(x, x).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 0.01 * x.size * 4


def test_under_shard_map_near_the_limit():
    """The rescaled sums run inside the overflow check's loop on every worker alike (shard_map,
    4 devices)."""
    mesh = jax.make_mesh((WORKERS,), ("data",))
    P = jax.P
    grads = _grads(3e38)
    flat = jax.tree.map(
        lambda g: jax.device_put(g.reshape((-1, *g.shape[2:])), jax.NamedSharding(mesh, P("data"))),
        grads,
    )
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:]), grads)
    for name in ("powersgd", "dgc"):
        tx = TRANSFORMS[name]()
        specs = compjax.state_specs(jax.eval_shape(tx.init, params), "data")
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        step = jax.jit(
            jax.shard_map(tx.update, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
        )
        updates, _ = step(flat, init(params))
        for k, g in grads.items():
            np.testing.assert_allclose(
                np.asarray(updates[k], np.float64), np.asarray(g[0], np.float64), rtol=2e-6
            )


# --- float16 sums beyond float16 whose means are not ------------------------------------------

F16_AXES = ("hosts", "local")
F16_EXCHANGES = {
    "all_gather": ("data", "all_gather"),
    "scatter_gather": ("data", "scatter_gather"),
    "hierarchical(all_gather)": (F16_AXES, compjax.hierarchical("local", "all_gather")),
    "hierarchical(scatter_gather)": (F16_AXES, compjax.hierarchical("local", "scatter_gather")),
}
F16_COMPRESSORS = {
    "cast(bfloat16)": compjax.cast("bfloat16"),
    "cast(float32)": compjax.cast("float32"),
    "natural": compjax.natural(),
    "eden": compjax.eden(),
}


@partial(jax.jit, static_argnums=(0, 1))
def _exchange_mean(comp_name, exchange_name, x):
    axes, exchange = F16_EXCHANGES[exchange_name]
    tx = compjax.compress(F16_COMPRESSORS[comp_name], axes, exchange=exchange)
    names = (axes,) if isinstance(axes, str) else axes
    init, update = tx.init, tx.update
    for _ in names:
        init = jax.vmap(init)
    for axis in reversed(names):
        update = jax.vmap(update, axis_name=axis)
    return update(x, init(x))[0]


def _shared(exchange_name, row, dtype):
    lead = (WORKERS,) if isinstance(F16_EXCHANGES[exchange_name][0], str) else (2, 2)
    return jnp.asarray(np.broadcast_to(np.asarray(row), (*lead, len(row))), dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("exchange_name", list(F16_EXCHANGES))
@pytest.mark.parametrize("comp_name", ["cast(bfloat16)", "cast(float32)"])
def test_a_cast_mean_whose_sum_leaves_the_dtype_is_not_clipped(comp_name, exchange_name, dtype):
    """4 workers each sending [20000, 1] through a cast: the mean is the cast of [20000, 1].

    The psummed payload (80000) used to be decoded in the input dtype, which clipped it to
    float16's 65504: a finite mean of 16376, flagged as nothing."""
    x = _shared(exchange_name, [20000.0, 1.0], dtype)
    out = np.asarray(_exchange_mean(comp_name, exchange_name, x), np.float64)
    one = F16_COMPRESSORS[comp_name](None, x.reshape(-1, 2)[0])
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(one, np.float64), out.shape))


@pytest.mark.parametrize("exchange_name", ["scatter_gather", "hierarchical(scatter_gather)"])
@pytest.mark.parametrize("comp_name", ["natural", "eden"])
def test_a_representable_float16_mean_goes_through_scatter_gather(comp_name, exchange_name):
    """4 workers each sending 60000 in float16: the owner's shard sums to 240000, beyond
    float16, and its second compression used to overflow (the step refused).  It is sent
    times 2**-2 and scaled back: the mean is finite on every worker, within the
    compressor's range (natural: each entry 32768 or 65504, so the mean within them; 1-bit
    EDEN is noisy on 8 entries: its decode saturates at 65504)."""
    x = _shared(exchange_name, [60000.0] * 8, jnp.float16)
    out = np.asarray(_exchange_mean(comp_name, exchange_name, x), np.float64)
    assert np.all(np.isfinite(out)), out
    low = 32768 if comp_name == "natural" else -65504
    assert np.all((out >= low) & (out <= 65504)), out
    # The same mean on every worker.
    flat = out.reshape(-1, 8)
    np.testing.assert_array_equal(flat, np.broadcast_to(flat[0], flat.shape))


def test_a_non_finite_float16_gradient_is_still_refused_on_scatter_gather():
    """An Inf on one worker (a mean no dtype holds): NaN updates on every worker."""
    x = np.full((WORKERS, 8), 60000.0, np.float32)
    x[1, 3] = np.inf
    out = np.asarray(_exchange_mean("natural", "scatter_gather", jnp.asarray(x, jnp.float16)))
    assert np.all(np.isnan(out.astype(np.float32))), out


@pytest.mark.parametrize("comp_name", ["cast(bfloat16)", "cast(float32)"])
def test_a_cast_reduce_scatter_of_float16_is_not_clipped(comp_name):
    """The FSDP gradient reduce-scatter: 4 float16 workers at 17000 give each owner the cast
    of 17000 (was 16376: the summed payload decoded to float16, clipped at 65504)."""
    comp = F16_COMPRESSORS[comp_name]
    x = jnp.full((WORKERS, 16), 17000.0, jnp.float16)
    scatter = jax.vmap(
        lambda xi: compjax.compressed_reduce_scatter(comp, jax.random.key(0), xi, "data").mean,
        axis_name="data",
    )
    out = np.asarray(jax.jit(scatter)(x), np.float64)
    np.testing.assert_array_equal(out, float(comp(None, x[0])[0]))
