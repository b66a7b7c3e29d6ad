"""Buckets in pieces: the message of a bucket built from its leaves where they lie.

Every elementwise compressor's ``compress_pieces`` must send exactly what
``compress`` sends for the concatenated bucket (today's copying path, kept
as ``compress(key, pieces.join())``): the same wire arrays, bit for bit,
and ``decompress_pieces`` the same decode, on trees whose buckets straddle
leaves of mixed shapes at offsets that are not multiples of the packing
unit, in float32, bfloat16 and a mix of both.  Inputs are multiples of
1/64 below 1 in magnitude, so every float32 sum a statistic makes is exact
in any order and the comparison can be exact; on Gaussian inputs sums may
differ in the last bit (checked to 1e-6), maxima not at all.
"""

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax
from compjax.draws import counter_bits, init_key, step_keys
from compjax.exchange import compressed_mean
from compjax.pieces import Pieces, spans, split
from compjax.transforms.base import Leaves
from compjax.transforms.buckets import Buckets

# Sizes 15, 7, 24, 1, 13, 36, 33, 2, 50, 3: 184 entries, odd offsets everywhere.
SHAPES = [(3, 5), (7,), (2, 3, 4), (1,), (13,), (4, 9), (33,), (2,), (50,), (3, 1)]
MIXED = [jnp.float32, jnp.bfloat16] * 5
TREES = {
    "float32": [jnp.float32] * len(SHAPES),
    "bfloat16": [jnp.bfloat16] * len(SHAPES),
    "mixed": MIXED,
}

#: Every elementwise compressor (exact: statistics exact on dyadic inputs).
ELEMENTWISE = {
    "sign": compjax.sign(),
    "scaled_sign": compjax.scaled_sign(),
    "l2_scaled_sign": compjax.l2_scaled_sign(),
    "terngrad": compjax.terngrad(),
    "qsgd": compjax.qsgd(levels=4),
    "qsgd_rows": compjax.qsgd(levels=4, bucket_size=8),
    "qsgd_rows_8bit": compjax.qsgd(levels=100, bucket_size=6),
    "natural": compjax.natural(),
    "natural_dithering": compjax.natural_dithering(),
    "int_quant": compjax.int_quant(bits=4),
    "int_quant_2": compjax.int_quant(bits=2),
    "bfloat16": compjax.cast("bfloat16"),
    "float16": compjax.cast("float16"),
    "float8": compjax.cast("float8_e4m3fn"),
    "float4": compjax.cast("float4_e2m1fn"),
}
#: Elementwise, with statistics that are not exact sums (a mean divided by d): to 1e-6.
INEXACT = {
    "terngrad_clip": compjax.terngrad(clip=2.5),
    "natural_dithering_p1": compjax.natural_dithering(p=1.0),
}
#: Not elementwise: concatenated first, the same by construction.
COPYING = {"top_k": compjax.top_k(k=3), "int_quant_rotated": compjax.int_quant(4, rotate=True)}


def tree_of(dtypes, seed=0, dyadic=True):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    out = []
    for k, s, d in zip(keys, SHAPES, dtypes, strict=True):
        if dyadic:
            x = jax.random.randint(k, s, -63, 64).astype(jnp.float32) / 64
        else:
            x = 3 * jax.random.normal(k, s)
        out.append(x.astype(d))
    return out


#: (tree, bucket size) of every exact comparison, traced and compiled together per compressor.
CASES = [("float32", 37), ("bfloat16", 37), ("mixed", 37), ("mixed", 64)]


def both_paths(comp, trees, sizes, key):
    """For every bucket of every tree: ``(new payload, copying payload, new decode, copying
    decode)`` (one jitted call for all of them: one compilation per compressor)."""
    layouts = [Buckets(t, size) for t, size in zip(trees, sizes, strict=True)]

    @jax.jit
    def run(trees, key):
        out = []
        for tree, layout in zip(trees, layouts, strict=True):
            for b, (pieces, joined) in enumerate(
                zip(layout.pieces(tree), layout.cut(tree), strict=True)
            ):
                k = jax.random.fold_in(key, b)
                new, old = comp.compress_pieces(k, pieces), comp.compress(k, joined)
                sizes = layout.sizes(b)
                decoded = split(comp.decompress(old), sizes)
                out.append((new, old, comp.decompress_pieces(new, sizes), decoded))
        return out

    return run(trees, key)


def assert_same(comp, trees, sizes, rtol=0.0):
    for new, old, dec_new, dec_old in both_paths(comp, trees, sizes, jax.random.key(1)):
        assert compjax.wire_bits(new) == compjax.wire_bits(old) == comp.bits(old.shape, old.dtype)
        assert new.meta == old.meta
        assert jax.tree.structure(new) == jax.tree.structure(old)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            if rtol == 0.0 or not jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                np.testing.assert_allclose(a, b, rtol=rtol)
        assert [p.shape for p in dec_new] == [p.shape for p in dec_old]
        for a, b in zip(dec_new, dec_old, strict=True):
            assert a.dtype == b.dtype
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if rtol == 0.0:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(
                    a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b)) + 1)
                )


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_pieces_send_what_the_concatenated_bucket_sends(name):
    trees = [tree_of(TREES[t]) for t, _ in CASES]
    assert_same(ELEMENTWISE[name], trees, [size for _, size in CASES])


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_gaussian_buckets_agree_to_the_last_bit_of_a_sum(name):
    """Maxima and codes exact; a sum's order may move a scale by an ulp (1e-6 relative)."""
    assert_same(ELEMENTWISE[name], [tree_of(MIXED, seed=3, dyadic=False)], [37], rtol=1e-6)


@pytest.mark.parametrize("name", sorted(INEXACT) + sorted(COPYING))
def test_other_compressors_agree(name):
    comp = {**INEXACT, **COPYING}[name]
    rtol = 1e-5 if name in INEXACT else 0.0
    assert_same(comp, [tree_of(MIXED, seed=4, dyadic=False)], [37], rtol=rtol)


#: Sizes 64, 64, 128, 128, 16 in buckets of 256: the payloads join as rows (a cast's of 64
#: entries and of 16, sign's of 2 words).
ALIGNED_SHAPES = [(8, 8), (64,), (4, 32), (128,), (2, 8)]


@pytest.mark.parametrize(
    "comp",
    [
        compjax.cast("bfloat16"),
        compjax.cast("float16"),
        compjax.natural(),
        compjax.int_quant(4),
        compjax.sign(),
    ],
    ids=str,
)
def test_payloads_joined_in_rows_are_the_concatenated_bucket(comp):
    """Spans whose lengths share a row of at least 2 elements join as ``(n / row, row)``
    matrices (:func:`compjax.pieces.encode_spans`): the same message, in float32 and bfloat16."""
    keys = jax.random.split(jax.random.key(7), len(ALIGNED_SHAPES))
    trees = [
        [(3 * jax.random.normal(k, s)).astype(d) for k, s in zip(keys, ALIGNED_SHAPES, strict=True)]
        for d in (jnp.float32, jnp.bfloat16)
    ]
    layout = Buckets(trees[0], 256)
    assert [layout.sizes(b) for b in range(len(layout.bounds))] == [(64, 64, 128), (128, 16)]
    pieces = layout.pieces(trees[0])[0]
    jaxpr = str(jax.make_jaxpr(lambda p: comp.compress_pieces(jax.random.key(0), p))(pieces))
    assert re.search(r"\[\d+,\d+\] = concatenate\[dimension=0\]", jaxpr)
    assert_same(comp, trees, [256, 256])


#: One bucket of 20 spans (grouped: 3 joins of at most 8, then one of the 3) and one of 70
#: (more than 64: one plain join); their lengths share a row of 16.
GROUPED_SHAPES = [(16,), (4, 8), (64,), (2, 16)] * 5
PLAIN_SHAPES = [(16,)] * 70


def grouped_joins(comp, trees, sizes) -> list[bool]:
    """Per tree (one bucket each): whether ``compress_pieces`` joins a field in groups (a 3-D
    concatenation in its jaxpr, :func:`compjax.pieces._grouped_join`)."""
    out = []
    for tree, size in zip(trees, sizes, strict=True):
        (pieces,) = Buckets(tree, size).pieces(tree)
        jaxpr = str(jax.make_jaxpr(lambda p: comp.compress_pieces(jax.random.key(0), p))(pieces))
        out.append(bool(re.search(r"\[\d+,2,\d+\] = concatenate\[dimension=0\]", jaxpr)))
    return out


def many_span_trees():
    """:data:`GROUPED_SHAPES` and :data:`PLAIN_SHAPES` in float32 and bfloat16, each with the
    bucket size that makes it one bucket."""
    trees, sizes = [], []
    for shapes in (GROUPED_SHAPES, PLAIN_SHAPES):
        keys = jax.random.split(jax.random.key(8), len(shapes))
        for d in (jnp.float32, jnp.bfloat16):
            xs = [3 * jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]
            trees.append([x.astype(d) for x in xs])
            sizes.append(sum(math.prod(s) for s in shapes))
    return trees, sizes


@pytest.mark.parametrize(
    ("comp", "groups"),
    [
        (compjax.cast("bfloat16"), True),
        (compjax.cast("float16"), True),
        (compjax.cast("float8_e4m3fn"), False),
    ],
    ids=str,
)
def test_payloads_of_many_spans_joined_in_groups_are_the_concatenated_bucket(comp, groups):
    """A field of one 16- or 32-bit float per entry, of 9 to 64 spans, joins in groups of
    at most 8 (:func:`compjax.pieces._grouped_join`, a 3-D outer join); an 8-bit one, or
    one of more spans, in one join: the same message, in float32 and bfloat16."""
    trees, sizes = many_span_trees()
    assert grouped_joins(comp, trees[::2], sizes[::2]) == [groups, False]
    assert_same(comp, trees, sizes)


def test_per_row_norms_join_in_one_concatenation():
    """QSGD's float32 norms (one per row of 8 entries, 20 spans) are not joined in groups."""
    trees, sizes = many_span_trees()
    assert grouped_joins(compjax.qsgd(levels=4, bucket_size=8), trees[::2], sizes[::2]) == [
        False,
        False,
    ]


def largest_float32_buffer(fn, *args) -> int:
    """Entries of the largest float32 array the compiled ``fn`` writes at its top level."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    sizes = [0]
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]+)\]\S* (\S+)\(", line)
        if m and m.group(2) not in ("parameter", "bitcast", "get-tuple-element"):
            sizes.append(math.prod(int(v) for v in m.group(1).split(",")))
    return max(sizes)


@pytest.mark.parametrize(
    "comp",
    [compjax.scaled_sign(), compjax.qsgd(levels=4), compjax.natural(), compjax.int_quant(4)],
    ids=str,
)
def test_the_pieces_are_not_copied(comp):
    """The copying path writes each bucket into a float32 buffer; the pieces path does not."""
    tree = [jnp.ones((40,))] + [jnp.ones((16, 64))] * 6 + [jnp.ones((50, 100)), jnp.ones((30,))]
    layout = Buckets(tree, 8192)  # a bucket of 9 pieces, one of 2
    keys = jax.random.split(jax.random.key(0), len(layout.bounds))

    def new(ks, t):
        return [comp.compress_pieces(k, p) for k, p in zip(ks, layout.pieces(t), strict=True)]

    def old(ks, t):
        return [comp.compress(k, b) for k, b in zip(ks, layout.cut(t), strict=True)]

    assert largest_float32_buffer(old, keys, tree) == 8192
    assert largest_float32_buffer(new, keys, tree) <= 5000  # at most one leaf's


def test_summed_exchange_of_pieces_is_the_exchange_of_the_bucket():
    """int_quant's integer sums (pmax of the scale, psum of the words) over 4 workers."""
    comp = compjax.int_quant(bits=4)
    layout = Buckets(tree_of(MIXED), 37)
    trees = [tree_of(MIXED, seed=s) for s in range(4)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

    def run(tree, key):
        out = []
        for b, (pieces, joined) in enumerate(
            zip(layout.pieces(tree), layout.cut(tree), strict=True)
        ):
            k = jax.random.fold_in(key, b)
            new = compressed_mean(comp, k, pieces, "data")
            old = compressed_mean(comp, k, joined, "data")
            sizes = layout.sizes(b)
            out.append((new.mean, split(old.mean, sizes), new.local, split(old.local, sizes)))
        return out

    res = jax.jit(jax.vmap(run, in_axes=(0, None), axis_name="data"))(stacked, jax.random.key(2))
    for mean_new, mean_old, local_new, local_old in res:
        for a, b in zip(mean_new + local_new, mean_old + local_old, strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize(
    "comp", [compjax.sign(), compjax.qsgd(levels=4), compjax.int_quant(bits=4), compjax.top_k(k=2)]
)
def test_compress_with_buckets_equals_the_copying_exchange(comp):
    """``compjax.compress(bucket_size=)`` sends the pieces; the same as exchanging each bucket."""
    n, size = 4, 37
    tx = compjax.compress(comp, "data", bucket_size=size, seed=5)
    grads = jax.tree.map(lambda *xs: jnp.stack(xs), *[tree_of(MIXED, seed=s) for s in range(n)])
    state = jax.vmap(tx.init)(grads)
    out, _ = jax.jit(jax.vmap(tx.update, axis_name="data"))(grads, state)

    def reference(g):
        leaves = Leaves(g, flatten=False, bucket_size=size)
        _, keys = step_keys(init_key(5), len(leaves.arrays))
        means = [
            compressed_mean(comp, k, a, "data").mean
            for k, a in zip(keys, leaves.arrays, strict=True)
        ]
        return leaves.rebuild(means)

    expected = jax.jit(jax.vmap(reference, axis_name="data"))(grads)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_one_worker_gets_its_decode_in_pieces():
    comp = compjax.scaled_sign()
    tree = tree_of(MIXED)
    tx = compjax.compress(comp, None, bucket_size=37)
    out, _ = jax.jit(tx.update)(tree, tx.init(tree))
    layout = Buckets(tree, 37)
    expected = layout.rebuild([comp(None, b) for b in layout.cut(tree)])
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_non_finite_pieces_refuse_the_step():
    tree = tree_of(MIXED)
    tree[4] = tree[4].at[3].set(jnp.inf)
    tx = compjax.compress(compjax.sign(), None, bucket_size=37)
    out, _ = jax.jit(tx.update)(tree, tx.init(tree))
    assert all(bool(jnp.all(jnp.isnan(o))) for o in jax.tree.leaves(out))


@pytest.mark.parametrize(
    ("sizes", "unit"),
    [((15, 7, 24, 1, 13), 8), ((64, 64), 8), ((3, 2, 1, 40, 5), 4), ((100,), 512), ((9, 9, 9), 1)],
)
def test_spans_are_aligned_and_cover_the_pieces(sizes, unit):
    out = spans(sizes, unit)
    starts = np.cumsum((0, *sizes))
    pos = 0
    for j, span in enumerate(out):
        assert span.start == pos and span.start % unit == 0
        if j < len(out) - 1:
            assert (span.start + span.length) % unit == 0
        for i, lo, hi in span.parts:  # consecutive entries of the flat array
            assert starts[i] + lo == pos and 0 <= lo < hi <= sizes[i]
            pos += hi - lo
    assert pos == sum(sizes)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_pieces_reduce_like_the_flat_array(op):
    """Whole sources, partial ones through rows (bounds multiples of 8) and plain slices."""
    a = jnp.arange(64.0) - 20.0
    b = jnp.arange(30.0) * 0.5
    pieces = Pieces((a, a, b, b), ((0, 24), (24, 64), (0, 30), (3, 17)), np.dtype(np.float32))
    flat = pieces.join()
    np.testing.assert_array_equal(flat, jnp.concatenate([a, b, b[3:17]]))
    expected = {"sum": jnp.sum, "max": jnp.max}[op](jnp.abs(flat))
    assert float(pieces.reduce(jnp.abs, op)) == float(expected)


def test_counter_offsets_draw_a_stretch_of_the_stream():
    seed = jnp.array([12345, 678], jnp.uint32)
    whole = counter_bits(seed, 100)
    for offset, n in itertools.product((0, 1, 37), (5, 63)):
        np.testing.assert_array_equal(counter_bits(seed, n, offset), whole[offset : offset + n])


def test_decompress_pieces_refuses_wrong_sizes():
    comp = compjax.sign()
    payload = comp.compress_pieces(None, Pieces.of([jnp.ones(5), jnp.ones(3)]))
    with pytest.raises(ValueError, match="sizes"):
        comp.decompress_pieces(payload, (5, 4))
