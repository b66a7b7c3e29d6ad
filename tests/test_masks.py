"""The mask of ``|x| >= t`` in words and its ordered compaction (compressors.masks): the
bits are the mask's, entry for entry, and the compaction is ``jnp.nonzero``'s."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from compjax.compressors import masks


def _words(mask: np.ndarray) -> np.ndarray:
    padded = np.zeros(-(-mask.size // 32) * 32, np.uint64)
    padded[: mask.size] = mask
    return (padded.reshape(-1, 32) << np.arange(32, dtype=np.uint64)).sum(1).astype(np.uint32)


# Sizes around the words and the even rows (64 entries) read in place: no tail, a tail of
# one word or two, and fewer entries than one row.
@pytest.mark.parametrize("d", [1, 31, 32, 33, 63, 64, 65, 96, 127, 128, 5003])
def test_words_are_the_mask_of_entries_reaching_the_threshold(d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal(d).astype(np.float32)
    x[rng.integers(0, d, 3)] = [np.nan, np.inf, -np.inf]
    x[rng.integers(0, d)] = 1.0  # exactly at the threshold: reaches it
    got = jax.jit(masks.reaching)(jnp.asarray(x), jnp.float32(1.0))
    with np.errstate(invalid="ignore"):
        want = ~(np.abs(x) < 1.0)  # NaN reaches every threshold
    np.testing.assert_array_equal(got, _words(want))


def test_select_bit_finds_every_rank_of_every_word():
    words = np.array([1, 0x80000000, 0xFFFFFFFF, 0x0F0F0000, 0xAAAAAAAA, 6], np.uint32)
    for w in words:
        positions = [b for b in range(32) if (int(w) >> b) & 1]
        ranks = jnp.arange(len(positions), dtype=jnp.int32)
        got = masks.select_bit(jnp.full(ranks.shape, w, jnp.uint32), ranks)
        assert got.tolist() == positions


@partial(jax.jit, static_argnames="size")
def _compact(words, size):
    return masks.compact_words(words, size, fill=-1)


@given(
    seed=st.integers(0, 2**31 - 1),
    density=st.sampled_from([0.0, 0.001, 0.03, 0.5, 1.0]),
    size=st.sampled_from([1, 40, 700]),
)
def test_compaction_is_nonzero_in_order(seed, density, size):
    """1,000 entries (32 words) at densities from empty words to full ones; slots fewer
    than the set bits (the first ``size`` kept) or more (padded)."""
    rng = np.random.default_rng(seed)
    mask = rng.random(1000) < density
    indices, count = _compact(jnp.asarray(_words(mask)), size)
    want = np.flatnonzero(mask)[:size]
    assert int(count) == mask.sum()
    np.testing.assert_array_equal(indices[: want.size], want)
    assert np.all(np.asarray(indices[want.size :]) == -1)
