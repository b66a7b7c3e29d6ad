"""The pure helpers of paper_figs/fig9_speedup.py: the shapes, the bits, the crossing, and the
measured points fig9_network reads from make bench-net's committed run."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import pytest

import compjax
from compjax import costmodel
from experiments.common import methods
from paper_figs import common
from paper_figs import fig9_network as network
from paper_figs import fig9_speedup as fig


def test_resnet50_has_torchvisions_parameter_count():
    leaves = jax.tree.leaves(fig.resnet50_shapes())
    assert len(leaves) == 161
    assert sum(math.prod(s.shape) for s in leaves) == 25_557_032


@pytest.mark.parametrize(
    "spec",
    [
        "qsgd(levels=4, bucket_size=512)",
        "powersgd(rank=2, channels_last=False)",  # the shapes are PyTorch's, as in figure 9
        "signsgd()",
        "dgc(ratio=0.01)",
    ],
)
def test_bits_per_shape_equal_the_whole_tree(spec):
    s = jax.ShapeDtypeStruct
    tree = {
        "a": s((64, 32, 3, 3), jnp.float32),
        "b": s((64, 32, 3, 3), jnp.float32),
        "c": s((64,), jnp.float32),
        "d": s((2000,), jnp.float32),
        "e": s((64,), jnp.float32),
    }
    method = methods.parse(spec)
    report = compjax.communication(method.build("data"), tree, "data", 8)
    gathered = sum(b for k, b in report.payloads if method.gathered(k))
    assert fig.message_bits(spec, tree, 8) == (report.payload_bits - gathered, gathered)


def test_crossing_bandwidth_is_where_speedup_is_one():
    args = (8, 1e9, 0.0, 2e7, 0.05, 0.1)  # n, dense bits, reduced, gathered, overhead, compute
    b = fig.crossing_bandwidth(*args)
    assert 0 < b < math.inf
    assert fig.speedup(b, *args) == pytest.approx(1.0, abs=1e-9)
    assert fig.speedup(b / 2, *args) > 1 > fig.speedup(b * 2, *args)
    assert fig.crossing_bandwidth(8, 1e9, 0.0, 2e7, 0.0, 0.1) == math.inf  # a free codec
    assert fig.crossing_bandwidth(8, 1e9, 0.0, 2e7, 1e4, 0.1) == 0.0  # a very slow codec
    net = costmodel.Network(b, fig.LATENCY_US)
    dense = 0.1 + net.allreduce(1e9, 8)
    assert dense == pytest.approx(0.1 + 0.05 + net.allgather(2e7, 8))


def test_measured_points_are_read_from_the_committed_bench_net_run(tmp_path):
    committed = network.MEASURED + ".json"
    shutil.copyfile(common.OUT_DIR / committed, tmp_path / committed)
    res = json.loads((tmp_path / committed).read_text())
    limited = [
        (n, rate, key)
        for n, run in res["runs"].items()
        for key, m in run["methods"].items()
        for rate in m["rates"]
        if rate != "unlimited" and key != "fp32"
    ]
    markdown, sentence = network.measured_on_network(tmp_path)
    assert (tmp_path / (network.MEASURED + ".png")).stat().st_size > 0
    assert f"of {len(limited)} measured settings" in sentence
    assert markdown.count("\n| ") == 2 + len({(n, rate) for n, rate, _ in limited}) - 1


def test_no_committed_run_is_said_not_drawn(tmp_path):
    markdown, sentence = network.measured_on_network(tmp_path)
    assert "No measured run is committed" in markdown and markdown == sentence
    assert not list(tmp_path.iterdir())
