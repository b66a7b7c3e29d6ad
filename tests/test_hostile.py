"""Hostile inputs for every compressor and transformation (``make test-slow``).

Hypothesis builds arrays out of the values that broke compressors before:
zeros of both signs, NaN, +-Inf, +-3e38, the float32 limit, subnormals,
entries near 1e38 next to ones near 1e-38, float16's largest value, in
float32, bfloat16 and float16, in the shapes ``()``, ``(0,)``, ``(0, 5)``,
``(1,)`` and odd sizes.  For every compressor of the catalogue (and the
variants of ``tests/helpers.py``) it checks that

* the payload has exactly ``bits(shape, dtype)`` bits;
* zeros in give zeros out;
* finite in gives finite out;
* an unbiased compressor stays unbiased on each hostile input, in every dtype
  its metadata claims (``unbiased_for(dtype)``), up to its variance bound;

and for every transformation, on two ``vmap``-simulated workers, that finite
gradients give finite updates and state, zero gradients zero updates, and an
Inf/NaN on one worker a NaN update with the whole state kept.

Shapes come from a fixed list and values are drawn for them, so each
(compressor, shape, dtype) compiles once however many examples run.
"""

import inspect
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import all_compressors, min_size, roundtrip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compjax

pytestmark = pytest.mark.slow

COMPRESSORS = all_compressors()
SHAPES = ((), (0,), (0, 5), (1,), (7,), (3, 5))
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
HUGE = float(np.finfo(np.float32).max)
FINITE = {
    jnp.float32: (0.0, -0.0, 1e-45, 1e-40, 1e-38, 0.1, -1.0, 65504.0, 1e38, -1e38, 3e38, HUGE),
    jnp.bfloat16: (0.0, -0.0, 1e-40, 1e-38, 0.1, -1.0, 65504.0, 1e38, -1e38, 3e38),
    jnp.float16: (0.0, -0.0, 6e-8, 6.1e-5, 0.1, -1.0, 1000.0, 65504.0, -65504.0),
}
NON_FINITE = (np.nan, np.inf, -np.inf)
DRAWS = 2000
Z = 6.0  # a false alarm per entry has probability < 2e-9 (normal tail)

HOSTILE = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def hostile(draw, spec, finite_only=True):
    """An array of hostile values that the compressor ``spec`` accepts."""
    dtype = draw(st.sampled_from(DTYPES))
    shapes = [s for s in SHAPES if math.prod(s) >= min_size(COMPRESSORS[spec])]
    shape = draw(st.sampled_from(shapes))
    pool = FINITE[dtype] + (() if finite_only else NON_FINITE)
    values = draw(
        st.lists(st.sampled_from(pool), min_size=math.prod(shape), max_size=math.prod(shape))
    )
    return jnp.asarray(np.array(values, np.float32).reshape(shape), dtype)


@partial(jax.jit, static_argnums=(0, 3))
def _draws(comp, x, seed, n):
    keys = jax.random.split(jax.random.key(seed), n)
    return jax.vmap(lambda k: comp(k, x))(keys)


@pytest.mark.parametrize("spec", sorted(COMPRESSORS))
@given(data=st.data())
@HOSTILE
def test_bits_are_the_payloads_on_hostile_input(spec, data):
    x = data.draw(hostile(spec, finite_only=False))
    comp = COMPRESSORS[spec]
    payload, _ = roundtrip(comp, jax.random.key(0), x)
    assert compjax.wire_bits(payload) == comp.bits(x.shape, x.dtype)


@pytest.mark.parametrize("spec", sorted(set(COMPRESSORS) - {"sign()"}))  # sign(): zeros as +1
def test_zeros_in_zeros_out(spec):
    comp = COMPRESSORS[spec]
    for shape in SHAPES:
        if math.prod(shape) < min_size(comp):
            continue
        for dtype in DTYPES:
            for zero in (0.0, -0.0):
                _, out = roundtrip(comp, jax.random.key(1), jnp.full(shape, zero, dtype))
                assert out.dtype == dtype and out.shape == shape
                assert not np.any(np.asarray(out, np.float32)), (shape, dtype)


@pytest.mark.parametrize("spec", sorted(COMPRESSORS))
@given(data=st.data())
@HOSTILE
def test_finite_in_finite_out(spec, data):
    x = data.draw(hostile(spec))
    _, out = roundtrip(COMPRESSORS[spec], jax.random.key(2), x)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert np.all(np.isfinite(np.asarray(out, np.float32))), (spec, x, out)


def _unbiased_for(comp, dtype) -> bool:
    claims = getattr(comp, "unbiased_for", None)
    return claims(dtype) if claims is not None else comp.unbiased


UNBIASED = sorted(s for s, c in COMPRESSORS.items() if c.unbiased)


def in_documented_range(spec: str, x) -> bool:
    """Whether every value ``spec`` may decode ``x`` to is finite in ``x``'s dtype.

    Beyond it docs/compressors.md documents saturation (biased): natural compression at
    ``2^127``, random-k's ``x_i d/k``, QSGD's and natural dithering's norm,
    ATOMO's ``x_i / p_i``, EDEN's rotated scale.
    """
    xs = np.abs(np.asarray(x, np.float64)).reshape(-1)
    d, top = max(xs.size, 1), float(jnp.finfo(x.dtype).max)
    bounds = [xs.max(initial=0.0)]
    if "natural()" in spec and x.dtype != jnp.float16:  # 2^127 = half of float32's top binade
        bounds.append(2 * xs.max(initial=0.0))
    if "rand_k" in spec:
        bounds.append(xs.max(initial=0.0) * d)
    if any(f in spec for f in ("qsgd", "dithering", "eden", "drive")):
        bounds.append(float(np.sqrt(np.sum(xs**2))) * np.sqrt(2 * d) + xs.sum())
    if "atomo" in spec:
        bounds.append(xs.sum() * d)
    return max(bounds) < top


@pytest.mark.parametrize("spec", UNBIASED)
@given(data=st.data())
@HOSTILE
def test_unbiased_compressors_stay_unbiased_on_hostile_input(spec, data):
    x = data.draw(hostile(spec))
    comp = COMPRESSORS[spec]
    if not _unbiased_for(comp, x.dtype) or x.size == 0 or not in_documented_range(spec, x):
        return
    xs = np.asarray(x, np.float64).reshape(-1)
    draws = np.asarray(_draws(comp, x, 3, DRAWS), np.float64).reshape(DRAWS, -1)
    # Each entry's variance is at most the total, omega ||x||^2 (computed in float64).
    se = math.sqrt(comp.omega(xs.size) * float(np.sum(xs**2)) / DRAWS)
    # Decoded values are in x's dtype: allow one rounding of each (half an ulp of the mean),
    # and float32 subnormals, which XLA on a CPU flushes to zero in arithmetic.
    ulp = np.abs(xs) * float(jnp.finfo(x.dtype).eps) + float(jnp.finfo(jnp.float32).tiny)
    err = np.abs(draws.mean(0) - xs)
    assert np.all(err <= Z * se + ulp), (spec, x.dtype, xs, draws.mean(0))


# --- transformations -----------------------------------------------------------------

WORKERS = 2
TRANSFORMS = {
    "compress(qsgd)": lambda: compjax.compress(compjax.qsgd(levels=4), "data"),
    "error_feedback(top_k)": lambda: compjax.error_feedback(compjax.top_k(ratio=0.5), "data"),
    "error_feedback(top_k, scatter_gather)": lambda: compjax.error_feedback(
        compjax.top_k(ratio=0.5), "data", exchange="scatter_gather"
    ),
    "ef21(scaled_sign)": lambda: compjax.ef21(compjax.scaled_sign(), "data"),
    "diana(terngrad)": lambda: compjax.diana(compjax.terngrad(), "data"),
    "dgc": lambda: compjax.dgc("data", 0.5),
    "powersgd": lambda: compjax.powersgd(rank=1, axis_name="data", min_compression_rate=1.0),
    "sign_majority_vote": lambda: compjax.sign_majority_vote("data", momentum=0.9),
    "sign_majority_vote(psum)": lambda: compjax.sign_majority_vote("data", via="psum"),
    "terngrad_allreduce": lambda: compjax.terngrad_allreduce("data"),
    "strom_threshold": lambda: compjax.strom_threshold("data", tau=0.5, budget=0.5),
    "variance_based": lambda: compjax.variance_based("data", budget=0.5),
    # freeze_step=1: the one step taken is already the compressed phase.
    "scale_by_onebit_adam": lambda: compjax.scale_by_onebit_adam("data", freeze_step=1),
    "onebit_adam": lambda: compjax.onebit_adam(0.1, "data", freeze_step=1),
    "scale_by_zero_one_adam": lambda: compjax.scale_by_zero_one_adam("data", 2, 1),
    "zero_one_adam": lambda: compjax.zero_one_adam(0.1, "data", 2, 1),
    # Local rounds over per-worker params (a first step adapts the variance: every worker moves
    # to the new global params; the local and synchronising steps are in test_zero_one_adam_local).
    "zero_one_adam(local)": lambda: compjax.zero_one_adam(0.1, "data", 2, 1, local_step_clipper=2),
    # The 3 x 5 kernel is one 3 x 5 chunk, 4 of its 15 coefficients sent; the default sends all.
    "scale_by_demo": lambda: compjax.scale_by_demo("data", chunk=5, topk=4),
    "demo": lambda: compjax.demo(0.1, "data"),  # (update is called without params here)
    # Rounds of one step: every call synchronises (the exchange and the outer step run).
    "diloco(top_k)": lambda: compjax.diloco(
        optax.sgd(0.1),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        1,
        "data",
        compressor=compjax.top_k(ratio=0.5),
    ),
    # Two fragments of one leaf each: the bias is sent and merged at the step taken.
    "streaming_diloco(top_k)": lambda: compjax.streaming_diloco(
        optax.sgd(0.1),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        2,
        "data",
        fragments=2,
        compressor=compjax.top_k(ratio=0.5),
    ),
    # Chunks of 4 entries, 2 kept in 2 bits; the decaying memory is read at every call.
    "sparseloco": lambda: compjax.sparseloco(optax.sgd(0.1), 1, "data", k=2, chunk=4),
}
#: Transformations of per-worker params: update(grads, state, params).
WITH_PARAMS = {"diloco(top_k)", "streaming_diloco(top_k)", "sparseloco", "zero_one_adam(local)"}
GRAD_SHAPES = {"w": (3, 5), "b": (1,)}


@st.composite
def hostile_grads(draw, dtype, finite_only=True):
    """Gradients of both workers: a dict of ``(WORKERS, *shape)`` arrays."""
    pool = FINITE[dtype] + (() if finite_only else NON_FINITE)
    out = {}
    for name, shape in GRAD_SHAPES.items():
        size = WORKERS * math.prod(shape)
        values = draw(st.lists(st.sampled_from(pool), min_size=size, max_size=size))
        out[name] = jnp.asarray(np.array(values, np.float32).reshape(WORKERS, *shape), dtype)
    return out


@partial(jax.jit, static_argnums=(0, 1))
def _init_and_step(name, dtype_name, grads):
    tx = TRANSFORMS[name]()
    params = {k: jnp.zeros(s, dtype_name) for k, s in GRAD_SHAPES.items()}
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(WORKERS))
    if name == "variance_based":  # per-example gradients: a batch of the gradient and its half
        grads = jax.tree.map(lambda g: jnp.stack([g, g / 2], axis=1), grads)
    if name in WITH_PARAMS:
        local = compjax.worker_copies(params, WORKERS)
        updates, new_state = jax.vmap(tx.update, axis_name="data")(grads, state, local)
    else:
        updates, new_state = jax.vmap(tx.update, axis_name="data")(grads, state)
    return updates, state, new_state


def _finite(tree) -> bool:
    return all(
        bool(np.all(np.isfinite(np.asarray(a, np.float64))))
        for a in jax.tree.leaves(tree)
        if jnp.issubdtype(a.dtype, jnp.floating)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transformation_on_hostile_gradients(name, dtype):
    dtype_name = jnp.dtype(dtype).name

    @given(hostile_grads(dtype, finite_only=False))
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def check(grads):
        updates, state, new_state = _init_and_step(name, dtype_name, grads)
        if _finite(grads):
            assert _finite(updates) and _finite(new_state), (name, grads, updates)
        else:  # one worker's Inf/NaN: NaN updates everywhere, the whole state kept
            assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(updates))
            for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True):
                np.testing.assert_array_equal(np.asarray(old), np.asarray(new))

    check()
    zeros = {k: jnp.zeros((WORKERS, *s), dtype) for k, s in GRAD_SHAPES.items()}
    updates, _, new_state = _init_and_step(name, dtype_name, zeros)
    # Zero gradients give zero updates; the sign vote's one-bit signs have no zero, and every
    # worker votes +1 for a zero entry (documented).
    expected = 1.0 if name == "sign_majority_vote" else 0.0
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.asarray(u, np.float32), expected, err_msg=name)
    assert _finite(new_state)


def test_hostile_suite_covers_every_transformation_factory():
    """A transformation added to compjax must join TRANSFORMS."""
    factories = {
        name
        for name in compjax.__all__
        if inspect.isfunction(obj := getattr(compjax, name))
        and "GradientTransformation" in str(inspect.signature(obj).return_annotation)
    }
    covered = {name.split("(")[0] for name in TRANSFORMS}
    assert factories and factories <= covered, factories - covered
