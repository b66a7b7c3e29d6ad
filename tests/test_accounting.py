"""communication(): the dense baseline follows the gradient's dtype, and every message says
which collective carries it over which axes."""

import jax.numpy as jnp

import compjax

PARAMS = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
D = 64 * 32 + 32


def test_dense_bits_follow_the_gradients_dtype():
    tx = compjax.compress(compjax.top_k(ratio=0.1), "data")
    assert compjax.communication(tx, PARAMS).dense_bits == 32 * D
    half = {k: v.astype(jnp.bfloat16) for k, v in PARAMS.items()}
    report = compjax.communication(tx, half)
    assert report.dense_bits == 16 * D  # a bf16 model's baseline
    mixed = {"w": PARAMS["w"].astype(jnp.bfloat16), "b": PARAMS["b"]}
    assert compjax.communication(tx, mixed).dense_bits == 16 * 64 * 32 + 32 * 32


def test_routes_of_the_all_gather_and_the_all_reduce():
    report = compjax.communication(compjax.compress(compjax.qsgd(4), "data"), PARAMS)
    assert [r[:2] for r in report.routes] == [
        ("flag", "all_reduce"),
        ("payload", "all_gather"),
        ("payload", "all_gather"),
    ]
    assert {axes for _, _, axes in report.routes} == {("data",)}
    by_route = report.bits_by_route()
    assert by_route["all_reduce", ("data",)] == 8
    assert by_route["all_gather", ("data",)] == report.bits_per_worker - 8
    linear = compjax.communication(compjax.compress(compjax.cast("bfloat16"), "data"), PARAMS)
    assert linear.bits_by_route() == {("all_reduce", ("data",)): 8 + 16 * D}
    power = compjax.communication(compjax.powersgd(2, "data"), PARAMS)
    assert {via for _, via, _ in power.routes} == {"all_reduce"}


def test_routes_of_scatter_gather_and_hierarchical_exchanges_per_axis():
    tx = compjax.compress(compjax.qsgd(4), "data", exchange="scatter_gather", flatten=True)
    report = compjax.communication(tx, PARAMS, "data", num_workers=4)
    assert [r[:2] for r in report.routes] == [
        ("flag", "all_reduce"),
        ("scatter", "all_to_all"),
        ("gather", "all_gather"),
    ]
    axes = ("hosts", "local")
    tx = compjax.compress(
        compjax.qsgd(4), axes, exchange=compjax.hierarchical("local"), flatten=True
    )
    report = compjax.communication(tx, PARAMS, axes, num_workers=(2, 4))
    assert report.routes == (
        ("flag", "all_reduce", axes),
        ("fast_reduce_scatter", "reduce_scatter", ("local",)),
        ("scatter", "all_to_all", ("hosts",)),
        ("gather", "all_gather", ("hosts",)),
        ("fast_all_gather", "all_gather", ("local",)),
    )
    by_route = report.bits_by_route()
    assert by_route["reduce_scatter", ("local",)] + by_route["all_gather", ("local",)] == (
        report.fast_bits
    )
    assert sum(by_route.values()) == report.bits_per_worker
