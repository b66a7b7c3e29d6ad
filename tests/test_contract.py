"""The contract every compressor keeps, over shapes, dtypes and values.

Bits and output shapes are checked by abstract evaluation on every shape
(scalars, empty arrays, sizes not divisible by 8); execution uses a fixed set
of shapes so that each compressor compiles a bounded number of times.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXTRA_SPECS, all_compressors, apply, min_size, roundtrip, roundtrip_all
from hypothesis import given
from hypothesis import strategies as st

import compjax

COMPRESSORS = all_compressors()
SPECS = list(COMPRESSORS)


#: Catalogue entries whose code a fast one runs (another level count, bit width or flag of
#: the same compressor): executed with -m slow.
CATALOGUE_SLOW = {
    "cast('float16')",
    "qsgd(levels=4)",
    "qsgd(levels=16)",
    "terngrad()",
    "natural_dithering(levels=7)",
    "eden()",
    "eden(bits=4)",
    "rand_k(ratio=0.01)",
}


assert CATALOGUE_SLOW <= set(SPECS), CATALOGUE_SLOW - set(SPECS)


def run_specs(keep=lambda comp: True) -> list:
    """Executed specs: the catalogue's compressors in the fast suite but for CATALOGUE_SLOW,
    which runs with -m slow as do the variants that reach other code paths (EXTRA_SPECS):
    each spec costs a compile of RUN_CASES."""
    return [
        s
        if s not in EXTRA_SPECS and s not in CATALOGUE_SLOW
        else pytest.param(s, marks=pytest.mark.slow)
        for s in SPECS
        if keep(COMPRESSORS[s])
    ]


RUN_SPECS = run_specs()
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ALL_SHAPES = ((), (0,), (1,), (7,), (8,), (9,), (3, 5), (2, 3, 4), (4, 0), (63,), (1000,))
#: (shape, dtype) pairs whose bits are checked by abstract evaluation: every shape in float32
#: and one in each half precision in the fast suite, every pair with -m slow.
CORE_CASES = [(s, jnp.float32) for s in ALL_SHAPES] + [((9,), jnp.bfloat16), ((9,), jnp.float16)]
EVERY_CASE = [(s, d) for s in ALL_SHAPES for d in (jnp.float32, jnp.bfloat16, jnp.float16)]
# (shape, dtype) pairs that are executed.
RUN_CASES = (((3, 3), jnp.float32), ((9,), jnp.bfloat16), ((9,), jnp.float16), ((), jnp.float32))
KEY = jax.random.key(0)
KEYS = jax.random.split(KEY, len(RUN_CASES))


def raw(a):
    """Array contents comparable by numpy (typed PRNG keys as their key data)."""
    return jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a


def assert_same(a, b):
    np.testing.assert_array_equal(np.asarray(raw(a)), np.asarray(raw(b)))


def accepts(comp, shape) -> bool:
    return math.prod(shape) >= min_size(comp)


def values(seed: int, shape, dtype, exponent: int = 0, sparsity: float = 0.0) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0**exponent
    x = np.where(rng.random(shape) < sparsity, 0.0, x)
    return jnp.asarray(x, dtype=dtype)


@pytest.mark.parametrize(
    "cases", [CORE_CASES, pytest.param(EVERY_CASE, marks=pytest.mark.slow)], ids=["core", "every"]
)
@pytest.mark.parametrize("spec", SPECS)
def test_bits_and_shapes_match_payload(spec, cases):
    comp = COMPRESSORS[spec]
    for shape, dtype in cases:
        if not accepts(comp, shape):
            continue
        x = jax.ShapeDtypeStruct(shape, dtype)
        payload = jax.eval_shape(comp.compress, KEY, x)
        assert compjax.wire_bits(payload) == comp.bits(shape, dtype), (shape, dtype)
        out = jax.eval_shape(comp.decompress, payload)
        assert (out.shape, out.dtype) == (shape, dtype)


# One compressor per code path runs in the fast suite; the rest with -m slow.
VMAP_FAST = {
    "qsgd(levels=4, bucket_size=512)",
    "terngrad(clip=2.5)",
    "natural()",
    "scaled_sign()",
    "rand_k(ratio=0.01, shared_seed=True)",
    "top_k(ratio=0.01)",
    "chain(top_k(ratio=0.01), qsgd(levels=16))",
    "blockwise(terngrad(), 512)",
    "atomo_svd(budget=2.0)",
    "cast('float16')",
}


@pytest.mark.parametrize(
    "spec",
    [
        s if not isinstance(s, str) or s in VMAP_FAST else pytest.param(s, marks=pytest.mark.slow)
        for s in RUN_SPECS
    ],
)
@given(
    seed=st.integers(0, 2**31),
    exponent=st.integers(-30, 30),
    sparsity=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_round_trip_is_deterministic_for_a_key(spec, seed, exponent, sparsity):
    comp = COMPRESSORS[spec]
    small = max(min(exponent, 3), -3)  # stay inside float16's range
    xs = tuple(
        values(seed + i, shape, dtype, exponent if dtype == jnp.float32 else small, sparsity)
        for i, (shape, dtype) in enumerate(RUN_CASES)
    )
    keys = jax.random.split(jax.random.key(seed), len(xs))
    first = roundtrip_all(comp, keys, xs)
    jax.tree.map(assert_same, first, roundtrip_all(comp, keys, xs))
    for x, (payload, y) in zip(xs, first, strict=True):
        assert y.shape == x.shape and y.dtype == x.dtype
        assert compjax.wire_bits(payload) == comp.bits(x.shape, x.dtype)
        assert np.all(np.isfinite(np.asarray(y, np.float32)))


@pytest.mark.parametrize("spec", RUN_SPECS)
def test_zero_input_gives_zero(spec):
    comp = COMPRESSORS[spec]
    xs = tuple(jnp.zeros(shape, dtype) for shape, dtype in RUN_CASES)
    for x, (_, y) in zip(xs, roundtrip_all(comp, KEYS, xs), strict=True):
        y = np.asarray(y, np.float32)
        if isinstance(comp, compjax.compressors.sign.Sign):
            # Documented: one bit has no zero, so zeros are sent as +1.
            np.testing.assert_array_equal(y, np.ones(x.shape))
        else:
            np.testing.assert_array_equal(y, np.zeros(x.shape))


# Entries near the float32 limits and subnormals; float16's own limits.  The
# norm of each vector stays representable, so every exact result is finite.
EXTREMES = {
    jnp.float32: np.array([1e38, -1e38, 5e37, 1e-38, -1e-40, 0.0, 3.0, -2e-45, 7e30]),
    jnp.bfloat16: np.array([1e38, -1e38, 5e37, 1e-38, -1e-38, 0.0, 3.0, -2e-38, 7e30]),
    jnp.float16: np.array([65504, -65504, 6e4, 6e-8, -6e-5, 0.0, 3.0, -1e-7, 3e4]),
}


@pytest.mark.parametrize("spec", RUN_SPECS)
def test_extreme_values_stay_finite(spec):
    comp = COMPRESSORS[spec]
    xs = tuple(
        jnp.asarray(EXTREMES[dtype][: math.prod(shape)], dtype).reshape(shape)
        for shape, dtype in RUN_CASES
    )
    for x, (_, y) in zip(xs, roundtrip_all(comp, KEYS, xs), strict=True):
        assert np.all(np.isfinite(np.asarray(y, np.float32))), (x.dtype, y)


@partial(jax.jit, static_argnums=0)
def batched(comp, keys, xs):
    """``comp`` vmapped over (keys, inputs), and over inputs with one key."""
    return jax.vmap(comp)(keys, xs), jax.vmap(comp, in_axes=(None, 0))(keys[0], xs)


@pytest.mark.parametrize(
    "spec", [s if s in VMAP_FAST else pytest.param(s, marks=pytest.mark.slow) for s in SPECS]
)
def test_vmap_over_keys_and_inputs(spec):
    comp = COMPRESSORS[spec]
    shape, dtype = RUN_CASES[0]
    xs = jnp.stack([values(s, shape, dtype) for s in range(3)])
    keys = jax.random.split(KEY, 3)
    over_both, over_inputs = batched(comp, keys, xs)
    for i in range(3):
        rest = tuple(jnp.zeros(s, d) for s, d in RUN_CASES[1:])
        (_, ref_i), *_ = roundtrip_all(comp, KEYS.at[0].set(keys[i]), (xs[i], *rest))
        (_, ref_0), *_ = roundtrip_all(comp, KEYS.at[0].set(keys[0]), (xs[i], *rest))
        # Batched and unbatched programs may round differently (EDEN's rotations): a few ulp.
        np.testing.assert_allclose(over_both[i], ref_i, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(over_inputs[i], ref_0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", run_specs(lambda comp: not comp.deterministic))
def test_different_keys_give_different_noise(spec):
    comp = COMPRESSORS[spec]
    # First on the compiled round trip's small inputs; where those leave no
    # randomness (top-1 of 9 entries, an ATOMO budget above d), on a larger one.
    xs = tuple(values(i, shape, dtype) for i, (shape, dtype) in enumerate(RUN_CASES))
    first = roundtrip_all(comp, KEYS, xs)
    second = roundtrip_all(comp, jax.random.split(jax.random.key(9), len(RUN_CASES)), xs)
    pairs = zip(first, second, strict=True)
    if all(np.array_equal(np.asarray(a[1]), np.asarray(b[1])) for a, b in pairs):
        x = values(3, (40, 25), jnp.float32)
        a, b = apply(comp, jax.random.key(1), x), apply(comp, jax.random.key(2), x)
        assert not np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("spec", [s for s in SPECS if COMPRESSORS[s].linear])
def test_linear_payloads_sum_before_decoding(spec):
    comp = COMPRESSORS[spec]
    xa, xb = values(1, (1000,), jnp.float32), values(2, (1000,), jnp.float32)
    (pa, _), (pb, _) = roundtrip(comp, KEY, xa), roundtrip(comp, KEY, xb)
    summed = jax.tree.map(jnp.add, pa.wire, pb.wire)
    total = comp.decompress(compjax.Payload(wire=summed, side=pa.side, meta=pa.meta))
    expect = comp.decompress(pa) + comp.decompress(pb)
    # Exact in float32; the fp16/bf16 all-reduce rounds the sum in the wire dtype.
    rtol = 2.0 ** -(jnp.finfo(pa.wire["values"].dtype).nmant)
    np.testing.assert_allclose(total, expect, rtol=rtol, atol=1e-6)


def test_side_information_is_not_counted():
    comp = compjax.rand_k(k=10, shared_seed=True)
    payload = comp.compress(KEY, jnp.ones(100))
    assert "key" in payload.side
    assert compjax.wire_bits(payload) == 10 * 32


def test_gathered_payload_decodes_with_vmap():
    """A payload with a leading worker axis (as after all_gather) decodes under vmap."""
    for comp in (compjax.qsgd(4), compjax.blockwise(compjax.terngrad(), 4), compjax.natural()):
        xs = jnp.stack([values(s, (3, 3), jnp.float32) for s in range(4)])
        keys = jax.random.split(KEY, 4)
        gathered = jax.jit(jax.vmap(comp.compress))(keys, xs)
        assert compjax.wire_bits(gathered) == 4 * comp.bits((3, 3))
        decoded = jax.jit(jax.vmap(comp.decompress))(gathered)
        np.testing.assert_allclose(decoded[2], apply(comp, keys[2], xs[2]), rtol=1e-6)


@pytest.mark.parametrize(
    ("comp", "shape", "copies"),
    [
        (compjax.qsgd(levels=4), (256, 128, 3, 3), 0),
        (compjax.qsgd(levels=4, bucket_size=512), (256, 128, 1, 1), 0),
        (compjax.qsgd(levels=4, bucket_size=512), (128, 512), 0),
        # Rows of 512 cut across 3 x 3: one copy, 4x faster than rows indexed by the kernel.
        (compjax.qsgd(levels=4, bucket_size=512), (256, 128, 3, 3), 1),
        (compjax.terngrad(), (256, 128, 3, 3), 0),
        (compjax.scaled_sign(), (256, 128, 3, 3), 0),
        (compjax.natural_dithering(), (256, 128, 3, 3), 0),
        # One norm in one pass, the two-pass fallback under lax.cond: no copy of the leaf.
        (compjax.qsgd(levels=4), (2048, 1024, 1, 1), 0),
        (compjax.natural_dithering(), (2048, 1024, 1, 1), 0),
        # Its scale in one pass, the two-pass fallback under lax.cond: no copy of the leaf.
        (compjax.l2_scaled_sign(), (256, 128, 3, 3), 0),
        (compjax.l2_scaled_sign(), (2048, 1024, 1, 1), 0),
    ],
    ids=lambda v: repr(v) if isinstance(v, compjax.Compressor) else str(v),
)
def test_compressing_a_kernel_copies_it_at_most_where_said(comp, shape, copies):
    """XLA's compiled temporaries for compress on a conv kernel stay well below its size,
    plus the copies said (a row view of the flattened kernel behind an optimisation barrier
    is a full copy; so was natural dithering's ``|x|``, shared by the norm's reduction and
    the codes).  QSGD's rows of its buckets take that copy only where they cut across the
    kernel's last dimensions (:meth:`compjax.Compressor.flat_barrier`)."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    compiled = jax.jit(comp.compress).lower(jax.random.key(0), x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < (copies + 0.25) * x.size * 4


@pytest.mark.parametrize("name", ["sign()", "terngrad()", "int_quant(bits=4)", "top_k(ratio=0.01)"])
def test_a_conv_kernels_codec_runs_on_the_flat_array(name):
    """Compress and decompress of an ``(O, I, 1, 1)`` kernel keep their work 1-D: the reshapes
    sit behind optimisation barriers (``flatten``, ``unflatten``), which XLA cannot move the
    elementwise work past.  (Indexed by the 4-D shape, a CPU reduction or decode runs several
    times slower: ``make bench``'s ResNet-50 tree.)"""
    comp = COMPRESSORS[name]
    x = jax.ShapeDtypeStruct((64, 32, 1, 1), jnp.float32)
    key = jax.random.key(0)
    encode = jax.jit(comp.compress).lower(key, x).as_text()
    payload = jax.eval_shape(comp.compress, key, x)
    decode = jax.jit(comp.decompress).lower(payload).as_text()
    assert "optimization_barrier" in encode
    assert "optimization_barrier" in decode
    flat = jax.ShapeDtypeStruct((2048,), jnp.float32)  # nothing to keep 1-D
    assert (
        "optimization_barrier"
        not in jax.jit(comp.decompress).lower(jax.eval_shape(comp.compress, key, flat)).as_text()
    )
