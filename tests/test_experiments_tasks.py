"""The two larger tasks: a 1.3M-parameter CNN on MNIST-1D and a character-level LM on pydoc."""

from __future__ import annotations

import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import data
from experiments.harness import tasks, train


def _params(name: str, num_classes: int, example: jax.ShapeDtypeStruct):
    model = tasks.get(name).model(num_classes)
    return jax.eval_shape(model.init, jax.random.key(0), example)["params"]


def test_mnist1d_wide_has_over_a_million_parameters_almost_all_in_kernels():
    params = _params("mnist1d_wide", 10, jax.ShapeDtypeStruct((1, 40), jnp.float32))
    sizes = {jax.tree_util.keystr(k): a.size for k, a in jax.tree.leaves_with_path(params)}
    total = sum(sizes.values())
    assert total == 1_326_858  # 160+32, 10240+64 (convs), 1310720+512, 5120+10 (dense)
    small = sum(s for s in sizes.values() if s < 1024)
    biases = sum(s for k, s in sizes.items() if "bias" in k)
    assert (small, biases) == (778, 618)  # 0.06% and 0.05% of the parameters
    assert small / total < 1e-3


def test_char_lm_is_a_few_hundred_thousand_parameters_mostly_kernels():
    params = _params("char_lm", 101, jax.ShapeDtypeStruct((1, 64), jnp.int32))
    sizes = [a.size for a in jax.tree.leaves(params)]
    assert sum(sizes) == 430_949
    assert sum(s for s in sizes if s < 1024) / sum(sizes) < 0.01


@pytest.mark.slow  # generating MNIST-1D twice takes tens of seconds
def test_mnist1d_validation_is_held_out_of_train_and_leaves_test_alone():
    plain, split = data.mnist1d(), data.mnist1d(validation=400)
    assert (len(split.train), len(split.validation), len(split.test)) == (3600, 400, 1000)
    np.testing.assert_array_equal(split.test.y, plain.test.y)
    labels = np.sort(np.concatenate([split.train.y, split.validation.y]))
    np.testing.assert_array_equal(labels, np.sort(plain.train.y))
    assert plain.validation is None


def test_the_corpus_split_is_disjoint_deterministic_and_needs_no_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the corpus must not touch the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    ds = data.characters.__wrapped__()
    again = data.characters.__wrapped__()
    for part in ("train", "validation", "test"):
        a, b = getattr(ds, part), getattr(again, part)
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.y, b.y)
    codes = data.encode(data.pydoc_text())
    cut = round(len(codes) * 0.1)
    starts = {"train": 0, "validation": len(codes) - 2 * cut, "test": len(codes) - cut}
    ends = {"train": starts["validation"], "validation": starts["test"], "test": len(codes)}
    for part, start in starts.items():
        split = getattr(ds, part)
        n, length = split.x.shape
        assert length == 64 and start + n * length < ends[part]  # y's last code is inside too
        np.testing.assert_array_equal(split.x.ravel(), codes[start : start + n * length])
        np.testing.assert_array_equal(split.y.ravel(), codes[start + 1 : start + 1 + n * length])
    assert ds.num_classes == 101 and codes.max() <= 100 and np.mean(codes == 100) < 0.002
    assert len(ds.test) == len(ds.validation) and len(ds.train) > 7 * len(ds.test)


def test_encode_maps_printable_ascii_and_the_rest_to_unknown():
    codes = data.encode("a\n~é→")
    assert codes.tolist() == [data.CHARACTERS.index(c) for c in "a\n~"] + [100, 100]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mnist1d_wide", "char_lm"])
def test_a_few_dense_steps_decrease_the_loss(name, tmp_path):
    cfg = train.Config(task=name, steps=20, eval_every=20)
    result = train.run(cfg, tmp_path, progress=False)
    assert result.config.momentum == 0.9 and result.info["params"] > 400_000
    first, last = result.records[0], result.records[-1]
    assert last["objective"] < first["objective"]
    assert last["validation_loss"] < first["validation_loss"]
