"""Bad input: a ValueError naming the parameter, at construction or at call time."""

import jax
import jax.numpy as jnp
import pytest

import compjax

KEY = jax.random.key(0)


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: compjax.qsgd(0), "levels"),
        (lambda: compjax.qsgd(-3), "levels"),
        (lambda: compjax.qsgd(2.5), "levels"),
        (lambda: compjax.qsgd(4, bucket_size=0), "bucket_size"),
        (lambda: compjax.terngrad(clip=0), "clip"),
        (lambda: compjax.terngrad(clip=float("inf")), "clip"),
        (lambda: compjax.cast("int8"), "dtype"),
        (lambda: compjax.cast("float64"), "dtype"),
        (lambda: compjax.cast("not-a-dtype"), "dtype"),
        (lambda: compjax.top_k(), "k and ratio"),
        (lambda: compjax.top_k(k=3, ratio=0.1), "k and ratio"),
        (lambda: compjax.rand_k(), "k and ratio"),
        (lambda: compjax.top_k(k=0), "k"),
        (lambda: compjax.rand_k(ratio=0.0), "ratio"),
        (lambda: compjax.rand_k(ratio=1.5), "ratio"),
        (lambda: compjax.top_k(ratio=-0.1), "ratio"),
        (lambda: compjax.blockwise(compjax.qsgd(2), 0), "block_size"),
        (lambda: compjax.blockwise("qsgd", 4), "comp"),
        (lambda: compjax.chain(compjax.qsgd(2), compjax.qsgd(2)), "sparsifier"),
        (lambda: compjax.chain(compjax.top_k(k=2), None), "quantizer"),
        (lambda: compjax.scaled(compjax.qsgd(2), 0.0), "gamma"),
    ],
)
def test_bad_parameters_raise(build, name):
    with pytest.raises(ValueError, match=name):
        build()


@pytest.mark.parametrize("comp", [compjax.top_k(k=10), compjax.rand_k(k=10)])
def test_k_larger_than_input_raises_at_call_time(comp):
    with pytest.raises(ValueError, match="k=10 exceeds"):
        comp.compress(KEY, jnp.ones(5))


def test_integer_input_raises():
    with pytest.raises(ValueError, match="x must be a floating point array"):
        compjax.qsgd(2).compress(KEY, jnp.arange(4))


def test_stochastic_compressor_needs_a_key():
    with pytest.raises(ValueError, match="key"):
        compjax.natural().compress(None, jnp.ones(4))
    # Deterministic ones accept None.
    compjax.top_k(k=2).compress(None, jnp.ones(4))


def test_compressors_are_hashable_values():
    assert compjax.qsgd(4) == compjax.qsgd(4)
    assert hash(compjax.qsgd(4)) == hash(compjax.qsgd(4))
    assert compjax.qsgd(4) != compjax.qsgd(4, bucket_size=8)
    assert len({compjax.chain(compjax.top_k(k=2), compjax.natural()) for _ in range(3)}) == 1
    with pytest.raises(AttributeError):
        compjax.qsgd(4).levels = 8
