"""``make bench-net``'s pure parts: the namespace commands, the compiled-collective parser,
the shared-medium cost model, the bf16 baseline, the analysis and the clean exit.

Nothing here starts a namespace or times anything; ``make bench-net`` does that.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax
from compjax import costmodel
from experiments import bench_net, bench_net_model, bench_net_report, bench_net_worker, netns


def test_namespace_commands():
    assert netns.in_namespace(None, ["tc"]) == ["tc"]
    assert netns.in_namespace("ns", ["tc", "x"]) == ["ip", "netns", "exec", "ns", "tc", "x"]
    assert netns.rate_command("1gbit", "ns") == [
        *("ip", "netns", "exec", "ns", "tc", "qdisc", "replace", "dev", "lo", "root"),
        *("tbf", "rate", "1gbit", "burst", "256kb", "latency", "400ms"),
    ]
    assert netns.rate_command(None, installed=True) == ["tc", "qdisc", "del", "dev", "lo", "root"]
    assert netns.rate_command(None, installed=False) == []


@pytest.mark.parametrize(
    ("rate", "bps"), [("100mbit", 1e8), ("1gbit", 1e9), ("10Gbit", 1e10), ("2.5kbit", 2500.0)]
)
def test_tc_rates(rate, bps):
    assert netns.rate_bits_per_s(rate) == bps


@pytest.mark.parametrize("rate", ["1gb", "fast", "gbit", ""])
def test_bad_tc_rates_raise(rate):
    with pytest.raises(ValueError, match="tc rate"):
        netns.rate_bits_per_s(rate)


def test_without_ip_the_benchmark_says_why_and_exits_cleanly(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(netns, "IP", "compjax-no-such-command")
    assert "not installed" in netns.unavailable_reason("x")
    assert bench_net.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "skipped" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_bad_rate_is_rejected_before_anything_starts():
    with pytest.raises(ValueError, match="tc rate"):
        bench_net.main(["--rates", "1gb"])
    with pytest.raises(ValueError, match="unknown methods"):
        bench_net_model.select(["qsgd-sg", "nope"])
    assert [m.key for m in bench_net_model.select(["qsgd-sg"])] == ["fp32", "bf16", "qsgd-sg"]


HLO = """
HloModule step
ENTRY %main {
  %a = f32[10,4]{1,0} all-reduce(f32[10,4]{1,0} %p), replica_groups={}
  %b = u8[4,16]{1,0} all-to-all(u8[4,16]{1,0} %q), dimensions={0}
  %c = (u8[16]{0}, u8[64]{0}) all-gather-start(u8[16]{0} %r), dimensions={0}
  %d = u8[64]{0} all-gather-done((u8[16]{0}, u8[64]{0}) %c)
  ROOT %e = s8[] all-reduce(s8[] %f), replica_groups={}
}
"""


def test_compiled_collectives_are_parsed_with_one_workers_message():
    found = bench_net_worker.hlo_collectives(HLO, workers=4)
    assert [(c["op"], c["dtypes"], c["bits"]) for c in found] == [
        ("all-reduce", ["f32"], 1280),
        ("all-to-all", ["u8"], 512),
        ("all-gather", ["u8"], 128),  # the gathered 64 bytes over 4 workers
        ("all-reduce", ["s8"], 8),
    ]
    # ring algorithms: 2(n-1)/n of an all-reduce, (n-1)/n of an all-to-all, (n-1) gathers
    want = 1.5 * 1280 + 0.75 * 512 + 3 * 128 + 1.5 * 8
    assert bench_net_worker.hlo_wire_bits(found, 4) == want
    assert bench_net_worker.shape_bits("(bf16[3]{0}, pred[2])") == 64
    with pytest.raises(ValueError, match="element type"):
        bench_net_worker.shape_bits("c64[2]")


def test_step_time_is_the_median_of_the_slowest_process():
    assert bench_net_worker.step_seconds([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == 3.0


def test_shared_medium_charges_every_workers_bits():
    bits, n = 8e9, 4
    own = costmodel.Network(bandwidth_gbps=1.0, latency_us=0.0)
    shared = costmodel.SharedMedium(bandwidth_gbps=1.0, latency_us=0.0)
    assert own.collective("allreduce", bits, n) == pytest.approx(2 * 3 / 4 * 8)
    assert shared.collective("allreduce", bits, n) == pytest.approx(2 * 3 * 8)
    assert shared.collective("allgather", bits, n) == pytest.approx(4 * 3 * 8)
    assert shared.collective("scatter_gather", bits, n) == shared.collective("allreduce", bits, n)
    assert own.scatter_gather(bits, n) == own.allreduce(bits, n)
    assert costmodel.wire_bits("allgather", bits, 1) == 0.0
    assert costmodel.predicted_step(0.5, [("alltoall", bits)], n, shared) == pytest.approx(
        0.5 + 3 * 8
    )
    with pytest.raises(ValueError, match="unknown collective"):
        costmodel.wire_bits("ring", bits, n)


@pytest.mark.parametrize("n", [2, 3])
def test_bf16_baseline_is_the_mean_with_bf16_on_the_wire(n):
    tree = {"a": jax.random.normal(jax.random.key(0), (n, 5, 3)), "b": jnp.ones((n, 4))}
    tx = bench_net_model.bf16_allreduce("data")
    out, _ = jax.vmap(tx.update, axis_name="data")(tree, jax.vmap(tx.init)(tree))
    for got, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        want = np.broadcast_to(np.mean(np.asarray(x), 0), got.shape)
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7)
        assert got.dtype == jnp.float32
    params = jax.tree.map(lambda x: x[0], tree)
    report = compjax.communication(tx, params, "data", num_workers=n)
    m = -(-19 // n)
    assert report.payloads == (("scatter", 16 * n * m), ("gather", 16 * m))


def test_language_model_counts_and_data():
    cfg = bench_net_model.LMConfig(vocab=64, width=16, layers=2, heads=2, length=8)
    params = bench_net_model.init_params(cfg)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.parameters
    assert bench_net_model.LMConfig().parameters == 10_506_496
    batch = bench_net_model.tokens(cfg, worker=1, index=2)
    assert batch.shape == (2, 9) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, bench_net_model.tokens(cfg, 1, 2))
    assert not np.array_equal(batch, bench_net_model.tokens(cfg, 0, 2))
    loss = bench_net_model.loss_fn(params, batch, cfg.heads)
    assert abs(float(loss) - math.log(64)) < 0.5  # near uniform at initialisation


def _fake_run() -> dict:
    """Two methods on 4 processes, unlimited and 1gbit, with hand-made numbers.

    Dense fp32 all-reduces 8e8 bits per worker (4 x 1.5 x 8e8 = 4.8e9 on the shared
    link); its unlimited step is 1.0 s against 0.52 s of compute alone, so the loopback's
    own rate is 4.8e9 / 0.48 = 1e10 bit/s.  QSGD sends 1e8 bits in shards and gathers
    2.5e7: 4 x (0.75e8 + 3 x 2.5e7) = 6e8 bits on the link.  The 1gbit steps are what the
    corrected model predicts: 1.0 - 0.48 + 4.8 and 1.2 - 0.06 + 0.6 seconds.
    """
    msgs = {"fp32": [["payload", 8e8, False]], "qsgd-sg": [["scatter", 1e8, True]]}
    msgs["qsgd-sg"].append(["gather", 2.5e7, True])
    hlo = {
        "fp32": [{"collective": "allreduce", "bits": 8e8}],
        "qsgd-sg": [
            {"collective": "alltoall", "bits": 1e8},
            {"collective": "allgather", "bits": 2.5e7},
        ],
    }
    methods, times = {}, {"fp32": (1.0, 5.32), "qsgd-sg": (1.2, 1.74)}
    for key in ("fp32", "qsgd-sg"):
        wire = bench_net_report.library_wire_bits(msgs[key], 4)
        rates = {
            rate: {"steps": 2, "step_s": t, "tx_bytes": int(2 * 4 * wire / 8)}
            for rate, t in zip(("unlimited", "1gbit"), times[key], strict=True)
        }
        methods[key] = {
            "library_messages": msgs[key],
            "library_bits": 8e8,
            "payload_bits": None if key == "fp32" else 1e8,
            "hlo_collectives": hlo[key],
            "hlo_wire_bits": bench_net_worker.hlo_wire_bits(hlo[key], 4),
            "rates": rates,
        }
    labels = {"fp32": "dense", "qsgd-sg": "QSGD"}
    return {
        "machine": {"cpu": "cpu", "cpu_count": 2, "jax": "0"},
        "config": {"steps": {}, "warmup": 1},
        "network": {"burst": "256kb", "latency": "400ms"},
        "methods": {
            k: {"label": v, "collective": "scatter_gather" if k != "fp32" else "allreduce"}
            for k, v in labels.items()
        },
        "runs": {"4": {"methods": methods, "compute": {"step_s": 0.52}, "parameters": 25}},
    }


def test_analysis_predictions_traffic_and_goals():
    res = _fake_run()
    assert bench_net_report.loopback_bps(res["runs"]["4"], 4) == pytest.approx(1e10)
    report = bench_net_report.analyse(res)
    limited = {r["method"]: r for r in report["settings"] if r["rate"] == "1gbit"}
    assert limited["fp32"]["predicted_s"] == pytest.approx(5.32)
    assert limited["qsgd-sg"]["predicted_s"] == pytest.approx(1.74)
    assert limited["qsgd-sg"]["ratio"] == pytest.approx(1.0)
    # the naive model charges the bits on top of the whole unlimited step
    assert limited["fp32"]["predicted_naive_s"] == pytest.approx(5.8)
    assert limited["qsgd-sg"]["ratio_naive"] == pytest.approx((5.32 / 1.74) / (5.8 / 1.8))
    flows = {f["method"]: f for f in report["traffic"]}
    assert flows["qsgd-sg"]["theory_bits"] == pytest.approx(1.5 * 1e8)  # 2(n-1)/n M_c
    assert flows["qsgd-sg"]["ratio"] == pytest.approx(1.0)
    assert [g["met"] for g in report["goals"]] == [True, True, True]
    text = bench_net_report.markdown(res, report)
    assert "| 4 | 1gbit | QSGD |" in text and "n=4: 10.00 Gbit/s" in text


def test_a_slower_step_misses_the_goals():
    res = _fake_run()
    res["runs"]["4"]["methods"]["qsgd-sg"]["rates"]["1gbit"]["step_s"] = 3.0  # 1.77x
    goals = bench_net_report.analyse(res)["goals"]
    assert [g["met"] for g in goals] == [False, False, True]
