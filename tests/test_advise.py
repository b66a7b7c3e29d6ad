"""compjax.advise: the predicted step of each method from its messages, the cost model and
a codec timer (replaced here by fixed times; the CLI runs the real one on a tiny model)."""

import math

import jax
import jax.numpy as jnp
import pytest

from compjax import advise, costmodel


def test_a_parameter_count_is_a_matrix_of_1024_columns_and_the_rest():
    tree = advise.as_params(2500)
    assert tree["matrix"].shape == (2, 1024) and tree["rest"].shape == (452,)
    assert set(advise.as_params(2048)) == {"matrix"}
    params = {"w": jnp.zeros((3, 4))}
    assert advise.as_params(params) is params
    with pytest.raises(ValueError, match="params"):
        advise.as_params(0)


def fixed_timer(seconds):
    """A codec timer that says every update takes ``seconds`` (so no codec costs over dense)."""
    return lambda tx, params, workers, repeats: seconds


def test_steps_are_compute_plus_codec_plus_the_cost_models_time():
    d, n, compute = 1024 * 64, 8, 0.1
    got = advise.advise(d, n, 1.0, 5.0, compute, timer=fixed_timer(0.02))
    by = {a.method: a for a in got}
    assert list(by)[:2] == ["dense fp32", "bf16 cast"]
    network = costmodel.Network(bandwidth_gbps=1.0, latency_us=5.0)
    dense = by["dense fp32"]
    # the gradient and the non-finite flag, ring all-reduced: 2 (n - 1) / n of each leaves
    assert dense.bits_per_worker == 2 * (n - 1) / n * (32 * d + 8)
    assert dense.comm_s == pytest.approx(network.allreduce(32 * d + 8, n))
    assert dense.step_s == pytest.approx(compute + dense.comm_s) and dense.speedup_fp32 == 1
    assert by["bf16 cast"].speedup_bf16 == 1
    for a in got:  # equal timers: no codec cost over dense
        assert a.codec_s == 0 and a.step_s == pytest.approx(compute + a.comm_s)
        assert a.speedup_fp32 == pytest.approx(dense.step_s / a.step_s)
    qsgd = by["QSGD 4-bit"]
    assert {via for via, _ in qsgd.routes} == {"all_reduce", "all_to_all", "all_gather"}
    assert qsgd.comm_s == pytest.approx(network.exchange(_cost_messages(qsgd), n))
    for a in got:  # the routes are payloads: the cost model's ring factors give the traffic
        traffic = sum(costmodel.wire_bits(c, b, n) for c, b in _cost_messages(a))
        assert traffic == pytest.approx(a.bits_per_worker, rel=1e-12)


def _cost_messages(a):
    return [(advise.COLLECTIVES[via], b) for (via, _), b in a.routes.items()]


def test_a_shared_medium_charges_every_workers_bits():
    d, n = 1024 * 64, 4
    own = advise.advise(d, n, 1.0, 0.0, 0.1, timer=fixed_timer(0.0))
    shared = advise.advise(d, n, 1.0, 0.0, 0.1, shared=True, timer=fixed_timer(0.0))
    for a, b in zip(own, shared, strict=True):
        assert b.comm_s == pytest.approx(n * a.comm_s)


def test_all_gather_exchange_moves_more_at_many_workers():
    d = 1024 * 64
    sg = advise.advise(d, 16, 1.0, 0.0, 0.1, timer=fixed_timer(0.0))
    ag = advise.advise(d, 16, 1.0, 0.0, 0.1, exchange="all_gather", timer=fixed_timer(0.0))
    q = lambda res: next(a for a in res if a.method == "QSGD 4-bit")  # noqa: E731
    assert q(ag).comm_s > 4 * q(sg).comm_s  # (n - 1) M_c against 2 (n - 1)/n M_c


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"workers": 1}, "workers"),
        ({"bandwidth_gbps": 0.0}, "bandwidth_gbps"),
        ({"compute_s": -1.0}, "compute_s"),
        ({"latency_us": -1.0}, "latency_us"),
        ({"exchange": "ring"}, "exchange"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, name):
    args = {"workers": 4, "bandwidth_gbps": 1.0, "latency_us": 5.0, "compute_s": 0.1} | kwargs
    with pytest.raises(ValueError, match=name):
        advise.advise(4096, **args, timer=fixed_timer(0.0))


def test_cli_times_the_codecs_and_prints_every_method(capsys):
    code = advise.main(
        ["--params", "8192", "--workers", "4", "--bandwidth-gbps", "1", "--compute-ms", "10",
         "--repeats", "1"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    for name in advise.methods("scatter_gather"):
        assert name in out
    assert "8,192 parameters, 4 workers" in out and jax.devices()[0].platform in out
    assert not math.isnan(float(out.splitlines()[2].split()[-1]))
