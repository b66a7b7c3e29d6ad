"""compjax.advise: the predicted step of each method from its messages, the cost model and
a codec timer (replaced here by fixed times; the CLI runs the real one on a tiny model)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compjax import advise, costmodel
from compjax.advise import advisor, codec_timing, report
from compjax.advise import cli as advise_cli
from compjax.advise import fsdp as advise_fsdp


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
    return lambda txs, params, repeats, entries, clock: {name: [seconds] * repeats for name in txs}


def rounds_timer(rounds):
    """A codec timer giving each method's per-round seconds (dense fp32's when not given)."""
    return lambda txs, params, repeats, entries, clock: {
        name: rounds.get(name, rounds["dense fp32"]) for name in txs
    }


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
    assert dense.step_s == pytest.approx(compute + 0.02 + dense.comm_s)
    assert dense.speedup_fp32 == 1
    assert by["bf16 cast"].speedup_bf16 == 1
    for a in got:  # equal timers: no codec cost over dense; dense's update is in every step
        assert a.codec_s == 0 and a.step_s == pytest.approx(compute + 0.02 + a.comm_s)
        assert a.speedup_fp32 == pytest.approx(dense.step_s / a.step_s)
    qsgd = by["QSGD 4-bit"]
    assert {via for via, _ in qsgd.routes} == {"all_reduce", "all_to_all", "all_gather"}
    assert qsgd.comm_s == pytest.approx(network.exchange(_cost_messages(qsgd), n))
    for a in got:  # the routes are payloads: the cost model's ring factors give the traffic
        traffic = sum(costmodel.wire_bits(c, b, n) for c, b in _cost_messages(a))
        assert traffic == pytest.approx(a.bits_per_worker, rel=1e-12)


def _cost_messages(a):
    return [(advisor.COLLECTIVES[via], b) for (via, _), b in a.routes.items()]


@pytest.mark.slow  # the cost model's rule is tested fast in test_bench_net
def test_a_shared_medium_charges_every_workers_bits():
    d, n = 1024 * 64, 4
    own = advise.advise(d, n, 1.0, 0.0, 0.1, timer=fixed_timer(0.0))
    shared = advise.advise(d, n, 1.0, 0.0, 0.1, shared=True, timer=fixed_timer(0.0))
    for a, b in zip(own, shared, strict=True):
        assert b.comm_s == pytest.approx(n * a.comm_s)


@pytest.mark.slow  # 3 s; the ring factors are tested fast in test_accounting
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
        ({"bandwidth_gbps": math.inf}, "bandwidth_gbps"),
        ({"compute_s": -1.0}, "compute_s"),
        ({"compute_s": math.nan}, "compute_s"),
        ({"latency_us": -1.0}, "latency_us"),
        ({"latency_us": math.inf}, "latency_us"),
        ({"exchange": "ring"}, "exchange"),
        ({"params": 0.5}, "params"),
        ({"params": 4096.5}, "params"),
        ({"params": math.inf}, "params"),
        ({"repeats": 0}, "repeats"),
        ({"clock": "gpu"}, "clock"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, name):
    args = {"params": 4096, "workers": 4, "bandwidth_gbps": 1.0, "latency_us": 5.0}
    args |= {"compute_s": 0.1} | kwargs
    with pytest.raises(ValueError, match=name):
        advise.advise(**args, timer=fixed_timer(0.0))


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--bandwidth-gbps",
            "inf",
            "argument --bandwidth-gbps: must be a finite number > 0, got 'inf'",
        ),
        ("--bandwidth-gbps", "0", "argument --bandwidth-gbps: must be a finite number > 0"),
        ("--params", "0.5", "argument --params: must be a whole number >= 1, got '0.5'"),
        ("--params", "1e400", "argument --params: must be a whole number >= 1"),
        ("--workers", "1", "argument --workers: must be a whole number >= 2, got '1'"),
        ("--latency-us", "nan", "argument --latency-us: must be a finite number >= 0"),
        ("--compute-ms", "-3", "argument --compute-ms: must be a finite number > 0"),
        ("--repeats", "0", "argument --repeats: must be a whole number >= 1"),
    ],
)
def test_cli_bad_values_name_the_flag(flag, value, message, capsys):
    args = {"--params": "8192", "--workers": "4", "--bandwidth-gbps": "1", "--compute-ms": "10"}
    args[flag] = value
    with pytest.raises(SystemExit) as exit_:
        advise_cli.main([x for pair in args.items() for x in pair])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_large_model_is_timed_on_a_sample_scaled_by_size():
    tree, factor = codec_timing.sample_tree(advise.as_params(124_000_000))
    assert all(math.prod(s.shape) <= codec_timing.SAMPLE_ENTRIES for s in tree.values())
    assert factor * sum(math.prod(s.shape) for s in tree.values()) == pytest.approx(124e6)
    assert tree["matrix_float32"].shape == (4096, 1024)  # a matrix keeps its 1024 columns
    # A tree of many leaves: one matrix and one vector per dtype, whatever the leaf count.
    params = {f"w{i}": jax.ShapeDtypeStruct((3, 700), jnp.float32) for i in range(9)}
    params |= {"b": jax.ShapeDtypeStruct((5,), jnp.float32), "s": jnp.zeros((), jnp.float32)}
    params |= {"h": jax.ShapeDtypeStruct((4, 2, 8), jnp.bfloat16)}
    tree, factor = codec_timing.sample_tree(params)
    shapes = {name: s.shape for name, s in tree.items()}
    assert shapes == {
        "matrix_float32": (18, 1024),
        "vector_float32": (6,),
        "matrix_bfloat16": (1, 64),
    }
    assert factor == pytest.approx((9 * 2100 + 6 + 64) / (18 * 1024 + 6 + 64))
    # The real timer at a billion parameters allocates and runs only the sample.
    txs = {"dense fp32": advise.methods("scatter_gather")["dense fp32"]()}
    for clock in codec_timing.CLOCKS:
        rounds = codec_timing.time_updates(txs, advise.as_params(10**9), 2, 4096, clock)
        assert rounds["dense fp32"].shape == (2,) and np.all(rounds["dense fp32"] > 0)


def test_one_worker_keeps_the_updates_conditionals_and_its_result():
    """The codec timer runs a worker's update on a one-device mesh, not under ``jax.vmap``
    (which turned every ``lax.cond`` into both branches: the threshold top-k's exact
    fallback was timed on every update); the result is the vmapped update's."""
    import compjax

    tx = compjax.error_feedback(compjax.top_k(ratio=0.01, select="threshold"), "data")
    grads = {"w": jax.random.normal(jax.random.key(0), (1, 2**16))}
    state = jax.vmap(tx.init)(grads)
    batched = jax.vmap(tx.update, axis_name="data")
    assert " cond[" not in str(jax.make_jaxpr(batched)(grads, state))
    want, want_state = batched(grads, state)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    grads, state = jax.device_put((grads, state), jax.NamedSharding(mesh, jax.P("data")))
    timed = jax.jit(codec_timing.one_worker(tx.update, mesh))
    assert " cond[" in str(jax.make_jaxpr(timed)(grads, state))
    out, new_state = timed(grads, state)
    np.testing.assert_array_equal(out["w"], want["w"])
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(b))


def test_codec_times_are_medians_of_paired_rounds_and_negatives_are_kept():
    dense = [1.0, 5.0, 9.0]
    timer = rounds_timer({"dense fp32": dense, "QSGD 4-bit": [1.5, 9.5, 5.2],
                          "sign vote": [0.9, 4.8, 8.95]})  # fmt: skip
    got = {a.method: a for a in advise.advise(8192, 4, 1.0, 5.0, 0.1, repeats=3, timer=timer)}
    qsgd, vote = got["QSGD 4-bit"], got["sign vote"]
    # The median of the per-round differences (0.5), not the difference of medians (0.2).
    assert qsgd.codec_s == pytest.approx(0.5) and qsgd.codec_range_s == pytest.approx((-3.8, 4.5))
    assert qsgd.step_s == pytest.approx(0.1 + np.median(dense) + 0.5 + qsgd.comm_s)
    assert vote.codec_s == pytest.approx(-0.1) and vote.codec_range_s == pytest.approx(
        (-0.2, -0.05)
    )
    assert vote.step_s == pytest.approx(0.1 + 5.0 - 0.1 + vote.comm_s)  # not clipped to 0
    assert qsgd.noisy and vote.noisy and not got["bf16 cast"].noisy
    assert "-100.0 (-200.0 to -50.0)" in report.table(list(got.values()))
    text = report.recommendation(list(got.values()), 1.0)
    assert "Within timing noise" in text and "QSGD 4-bit" in text.splitlines()[-1]


@pytest.mark.parametrize("shared", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_crossover_is_where_the_step_equals_dense_fp32s(shared):
    timer = rounds_timer({"dense fp32": [0.010] * 3, "QSGD 4-bit": [0.030] * 3,
                          "bf16 cast": [0.009] * 3, "EF top-k 1%": [5.0] * 3})  # fmt: skip
    kwargs = {"shared": shared, "timer": timer, "repeats": 3}
    got = {a.method: a for a in advise.advise(2**20, 8, 1.0, 5.0, 0.05, **kwargs)}
    qsgd = got["QSGD 4-bit"]
    assert qsgd.pays_below and 0 < qsgd.crossover_gbps < math.inf
    at = {a.method: a for a in advise.advise(2**20, 8, qsgd.crossover_gbps, 5.0, 0.05, **kwargs)}
    assert at["QSGD 4-bit"].speedup_fp32 == pytest.approx(1.0)
    for scale, pays in ((0.5, True), (2.0, False)):
        res = advise.advise(2**20, 8, scale * qsgd.crossover_gbps, 5.0, 0.05, **kwargs)
        assert (next(a for a in res if a.method == "QSGD 4-bit").speedup_fp32 > 1) == pays
    assert got["bf16 cast"].crossover_gbps == math.inf  # fewer bits and a cheaper update
    assert report.crossover_text(got["bf16 cast"]) == "any"
    assert report.crossover_text(qsgd).startswith("below ")


def test_the_recommendation_names_the_shortest_step():
    timer = rounds_timer({"dense fp32": [0.0] * 3})
    res = advise.advise(2**20, 8, 1.0, 5.0, 0.05, repeats=3, timer=timer)
    best = min(res, key=lambda a: a.step_s)
    text = report.recommendation(res, 1.0)
    assert text.startswith(f"Recommendation: {best.method}, {best.speedup_fp32:.2f}x dense fp32")
    # A fast network and costly codecs: dense float32, and which method pays first below.
    costly = rounds_timer(
        {"dense fp32": [0.0] * 3}
        | {m: [1.0] * 3 for m in advise.methods("all_gather") if m != "dense fp32"}
    )
    res = advise.advise(2**20, 8, 100.0, 5.0, 0.05, repeats=3, timer=costly)
    text = report.recommendation(res, 100.0)
    first = max(res[1:], key=lambda a: a.crossover_gbps)
    assert text.startswith("Recommendation: dense fp32; no method's step is shorter at 100 Gbit/s")
    assert f"the first to pay is {first.method}" in text


def test_cli_times_the_codecs_and_prints_every_method_and_a_recommendation(capsys):
    code = advise_cli.main(
        ["--params", "8192", "--workers", "4", "--bandwidth-gbps", "1", "--compute-ms", "10",
         "--repeats", "2"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    for name in advise.methods("scatter_gather"):
        assert name in out
    assert "8,192 parameters, 4 workers" in out and jax.devices()[0].platform in out
    assert not math.isnan(float(out.splitlines()[2].split()[-3]))
    assert "pays at Gbit/s" in out.splitlines()[1]
    assert out.splitlines()[-1].startswith(("Recommendation: ", "Within timing noise"))


def test_fsdp_steps_cost_a_gather_and_a_reduce_scatter(capsys, monkeypatch):
    """A 64 x 1024 float32 matrix sharded 4 ways: dense FSDP sends (n-1)/n of the parameters in
    the gather and (n-1)/n of the gradient in the reduce-scatter (plus the 8-bit flag's
    all-reduce); the compressed steps send less and are faster at the same compute."""
    n, entries = 4, 64 * codec_timing.COLUMNS
    rows = advise_fsdp.advise_fsdp(entries, n, 1.0, 0.0, 0.01)
    assert [r.method for r in rows] == list(advise_fsdp.FSDP_METHODS)
    fp32, bf16, zpp, sign = rows
    assert fp32.gather_bits == 0.75 * 32 * entries
    assert fp32.gradient_bits == 0.75 * 32 * entries + 2 * 0.75 * 8  # + the flag
    assert bf16.gather_bits == fp32.gather_bits / 2
    assert zpp.gather_bits == pytest.approx(0.75 * (8 + 32 / 256) * entries)
    net = costmodel.Network(bandwidth_gbps=1.0, latency_us=0.0)
    assert fp32.comm_s == pytest.approx(net.exchange([("allgather", 8 * entries),
        ("reduce_scatter", 32 * entries), ("allreduce", 8)], n))  # fmt: skip
    assert fp32.step_s == pytest.approx(0.01 + fp32.comm_s)
    assert 1 < bf16.speedup_fp32 < zpp.speedup_fp32 < sign.speedup_fp32
    with pytest.raises(ValueError, match="workers"):
        advise_fsdp.advise_fsdp(entries, 1, 1.0, 0.0, 0.01)
    # the command line, on one shared medium (n times the bits on one link), dense FSDP only
    dense_only = {"fsdp fp32": advise_fsdp.FSDP_METHODS["fsdp fp32"]}
    monkeypatch.setattr(advise_fsdp, "FSDP_METHODS", dense_only)
    args = ["--fsdp", "--params", str(entries), "--workers", "4", "--bandwidth-gbps", "1"]
    assert advise_cli.main([*args, "--compute-ms", "10", "--latency-us", "0", "--shared"]) == 0
    out = capsys.readouterr().out
    shared_ms = 1e3 * (0.01 + n * fp32.comm_s)
    assert "one shared medium" in out and f"{shared_ms:9.1f}" in out.splitlines()[-2]
    assert out.splitlines()[-1].startswith("Recommendation: fsdp fp32; no compressed step")


def test_fsdp_ends_with_a_recommendation_of_the_shortest_step(capsys):
    """The shortest compressed step at a slow link; dense float32 FSDP when no compressed step
    saves more than MIN_GAIN of the step (its messages negligible against the compute)."""
    entries = 64 * codec_timing.COLUMNS
    rows = advise_fsdp.advise_fsdp(entries, 4, 1.0, 0.0, 0.01)
    best = min(rows, key=lambda r: r.step_s)
    text = advise_fsdp.fsdp_recommendation(rows, 1.0)
    assert best.method != "fsdp fp32"
    assert text.startswith(f"Recommendation: {best.method}, {best.speedup_fp32:.2f}x fsdp fp32")
    assert "codecs not timed" in text and "\n" not in text
    # 1,000 s of compute: the messages are under 1% of any step
    slow = advise_fsdp.advise_fsdp(entries, 4, 1.0, 0.0, 1000.0)
    assert 1 < max(r.speedup_fp32 for r in slow) < 1 / (1 - advise_fsdp.MIN_GAIN)
    text = advise_fsdp.fsdp_recommendation(slow, 1.0)
    assert text.startswith("Recommendation: fsdp fp32; no compressed step is more than 1% shorter")
    args = ["--fsdp", "--params", str(entries), "--workers", "4", "--bandwidth-gbps", "1"]
    assert advise_cli.main([*args, "--compute-ms", "10"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"Recommendation: {best.method}, ")


def test_the_default_clock_is_the_process_clock_on_a_cpu(monkeypatch, capsys):
    """``clock="auto"`` (the default of ``advise``, ``time_updates`` and the command line)
    times by the process's CPU time on a CPU backend, by the wall clock on an accelerator."""
    assert codec_timing.resolve_clock("auto", "cpu") == "process"
    assert codec_timing.resolve_clock("auto", "gpu") == "wall"
    assert codec_timing.resolve_clock("auto", "tpu") == "wall"
    assert codec_timing.resolve_clock("wall", "cpu") == "wall"
    assert jax.devices()[0].platform == "cpu"
    calls = {"wall": 0, "process": 0}

    def counting(name, real):
        def now():
            calls[name] += 1
            return real()

        return now

    clocks = {name: counting(name, real) for name, real in codec_timing.CLOCKS.items()}
    monkeypatch.setattr(codec_timing, "CLOCKS", clocks)
    txs = {"dense fp32": advise.methods("scatter_gather")["dense fp32"]()}
    codec_timing.time_updates(txs, advise.as_params(4096), 3, 4096)
    assert calls == {"wall": 0, "process": 6}  # two readings per timed call
    seen = []

    def timer(txs, params, repeats, entries, clock):
        seen.append(clock)
        return fixed_timer(0.01)(txs, params, repeats, entries, clock)

    advise.advise(4096, 4, 1.0, 5.0, 0.1, repeats=2, timer=timer)
    assert seen == ["auto"]
    assert advise_cli.main(["--params", "4096", "--workers", "4", "--bandwidth-gbps", "1",
                            "--compute-ms", "10", "--repeats", "1"]) == 0  # fmt: skip
    assert "(process clock)" in capsys.readouterr().out.splitlines()[0]


def test_a_steps_factor_makes_the_answer_about_time_to_quality(capsys):
    """A method whose step is shortest but needs 3x the steps loses to dense float32 on time
    to quality; the crossover is where its time to quality equals dense's."""
    timer = rounds_timer({"dense fp32": [0.0] * 3})
    kwargs = {"repeats": 3, "timer": timer}
    plain = {a.method: a for a in advise.advise(2**20, 8, 1.0, 5.0, 0.05, **kwargs)}
    best = min(plain.values(), key=lambda a: a.step_s).method
    assert best != "dense fp32"
    factors = {best: 3.0, "bf16 cast": 1.25}
    got = {
        a.method: a for a in advise.advise(2**20, 8, 1.0, 5.0, 0.05, steps_factor=factors, **kwargs)
    }
    for name, a in got.items():
        assert a.step_s == pytest.approx(plain[name].step_s)  # the steps themselves unchanged
        assert a.quality_s == pytest.approx(factors.get(name, 1.0) * a.step_s)
        assert a.quality_fp32 == pytest.approx(got["dense fp32"].step_s / a.quality_s)
        assert a.quality_bf16 == pytest.approx(got["bf16 cast"].quality_s / a.quality_s)
    slow = got[best]
    assert slow.speedup_fp32 > 1 and slow.quality_fp32 == pytest.approx(slow.speedup_fp32 / 3)
    # its crossover: the bandwidth where 3 of its steps take one dense step's time
    gbps = slow.crossover_gbps
    assert 0 < gbps < plain[best].crossover_gbps
    at = {
        a.method: a
        for a in advise.advise(2**20, 8, gbps, 5.0, 0.05, steps_factor=factors, **kwargs)
    }
    assert at[best].quality_fp32 == pytest.approx(1.0)
    text = report.recommendation(list(got.values()), 1.0)
    winner = min(got.values(), key=lambda a: a.quality_s)
    assert winner.method != best
    assert f"Recommendation: {winner.method}" in text and "time to quality" in text
    table = report.table(list(got.values()))
    assert "to target x fp32" in table.splitlines()[0]
    assert "steps x" not in report.table(list(plain.values()))


@pytest.mark.parametrize(
    "factors, message",
    [
        ({"QSGD 4 bit": 1.5}, r"steps_factor: unknown methods \['QSGD 4 bit'\]"),
        ({"QSGD 4-bit": 0.0}, r"'QSGD 4-bit' must be finite and > 0"),
        ({"QSGD 4-bit": math.nan}, r"'QSGD 4-bit' must be finite and > 0"),
        ({"dense fp32": 2.0}, r"'dense fp32' is the reference"),
    ],
)
def test_bad_steps_factors_are_named(factors, message):
    with pytest.raises(ValueError, match=message):
        advise.advise(2**12, 4, 1.0, 5.0, 0.05, steps_factor=factors, timer=fixed_timer(0.0))


def test_cli_steps_factor_flag(capsys):
    args = ["--params", "8192", "--workers", "4", "--bandwidth-gbps", "1", "--compute-ms", "10"]
    with pytest.raises(SystemExit) as exit_info:
        advise_cli.main([*args, "--steps-factor", "QSGD 4-bit:2"])
    assert exit_info.value.code == 2
    assert "--steps-factor: expected METHOD=X, got 'QSGD 4-bit:2'" in capsys.readouterr().err
    assert advise_cli._parse_steps_factors(["QSGD 4-bit=2", "bf16 cast=1.1"]) == {
        "QSGD 4-bit": 2.0,
        "bf16 cast": 1.1,
    }


@pytest.mark.parametrize("kind", [costmodel.Network, costmodel.SharedMedium])
def test_the_cost_model_refuses_non_finite_networks(kind):
    for bandwidth in (math.nan, 0.0, -math.inf):
        with pytest.raises(ValueError, match=r"^bandwidth_gbps must be > 0 \(inf: unlimited\)"):
            kind(bandwidth_gbps=bandwidth)
    # An unlimited link is the bench-net report's naive model: only the latency costs time.
    unlimited = kind(bandwidth_gbps=math.inf, latency_us=2.0)
    assert unlimited.collective("allreduce", 8.0, 2) == pytest.approx(2 * unlimited.alpha)
    for latency in (math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match=r"^latency_us must be finite and >= 0"):
            kind(bandwidth_gbps=1.0, latency_us=latency)
    assert kind(bandwidth_gbps=1e6, latency_us=0.0).collective("allreduce", 8.0, 2) > 0
