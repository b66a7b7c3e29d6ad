"""The training harness: method expressions, the cost model, runs that must agree with theory."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import compjax
from compjax import costmodel
from experiments.common import data, methods
from experiments.harness import tasks, train

# --- method expressions --------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "name", "gradients"),
    [
        ("dense()", "dense", "local"),
        ("qsgd(levels=4)", "qsgd", "local"),
        ("diana(qsgd(levels=2, bucket_size=64))", "diana", "local"),
        ("ef(chain(top_k(ratio=0.1), qsgd(levels=16)))", "ef", "local"),
        ("dgc(ratio=0.01, accept_band=(0.8, 1.3))", "dgc", "local"),
        ("powersgd(rank=2, start_iter=3)", "powersgd", "local"),
        ("variance_based(alpha=1.5)", "variance_based", "per_example"),
        ("rank_dad(rank=2)", "rank_dad", "rank_dad"),
        ("signum()", "signum", "local"),
        ("demo(topk=8)", "demo", "local"),
        ("adam(b1=0.8)", "adam", "local"),
        ("onebit_adam(freeze_step=5, flatten=True)", "onebit_adam", "local"),
        ("ef(drive())", "ef", "local"),
        ("eden(bits=2)", "eden", "local"),
        ("natural_dithering(levels=4)", "natural_dithering", "local"),
        ("ef(l2_scaled_sign())", "ef", "local"),
    ],
)
def test_parse_builds_each_kind_of_method(spec, name, gradients):
    method = methods.parse(spec)
    assert (method.name, method.gradients) == (name, gradients)
    assert isinstance(method.build("data"), optax.GradientTransformation)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("qsgd(levels=0)", "levels"),
        ("dgc(ratio=2.0)", "ratio"),
        ("nonsense()", "unknown method 'nonsense'"),
        ("diana(dgc())", "'dgc' is not a compressor"),
        ("diana()", "takes one compressor"),
        ("dgc(0.1)", "keyword arguments only"),
        ("rank_dad()", "rank >= 1"),
        ("qsgd(levels=__import__('os'))", "'__import__' is not a compressor"),
        ("os.system('true')", "registered name"),
        ("qsgd(", "not an expression"),
        ("qsgd(wrong=1)", "wrong"),
        ("onebit_adam(freeze_step=0)", "freeze_step"),
        ("adam(wrong=1)", "wrong"),
    ],
)
def test_parse_rejects_bad_expressions_naming_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        methods.parse(spec)


def test_messages_travel_by_the_collective_the_method_uses():
    assert not methods.parse("dense()").gathered("payload")  # identity is linear: psum
    assert not methods.parse("adam()").gathered("payload")
    assert methods.parse("qsgd(levels=4)").gathered("payload")
    assert not methods.parse("int_quant(bits=4)").gathered("payload")  # integer psum
    assert not methods.parse("int_quant(bits=4)").gathered("scale")  # pmax
    assert not methods.parse("powersgd(rank=1)").gathered("P")
    assert methods.parse("rank_dad(rank=1)").gathered("P")
    assert not methods.parse("terngrad_allreduce()").gathered("ternaries")
    assert methods.parse("signsgd()").gathered("signs")


def test_onebit_adam_warm_up_is_counted_dense_then_compressed():
    from experiments.harness.problem import Problem

    cfg = train.Config(task="logreg", method="onebit_adam(freeze_step=3)", workers=2, steps=5)
    problem = Problem(cfg.resolved())
    plan = problem.bits_plan()
    dense = sum(32 * a.size for a in jax.tree.leaves(problem.params))
    warm = sum(b for kind, b in problem.step_messages(plan, 2) if kind != "flag")
    steady = sum(b for _, b in problem.step_messages(plan, 3))
    assert plan["dense_until"] == 3 and warm == dense
    assert 0 < steady < dense / 4
    adam = Problem(dataclasses.replace(cfg, method="adam()").resolved())
    assert sum(b for kind, b in adam.bits_plan()["steady"] if kind != "flag") == dense


# --- the cost model -------------------------------------------------------------


def test_alpha_beta_costs_and_the_two_over_n_rule():
    net = costmodel.Network(bandwidth_gbps=1.0, latency_us=10.0)
    n, bits = 8, 1e9
    assert net.allreduce(bits, n) == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 1.0)
    assert net.allgather(bits, n) == pytest.approx(7 * 1e-5 + 7 * 1.0)
    assert net.allreduce(bits, 1) == 0.0 and net.allgather(0, n) == 0.0
    zero_latency = costmodel.Network(1.0, 0.0)
    # an all-gathered message is cheaper than the dense all-reduce exactly below 2/n of its size
    assert zero_latency.allgather(bits * 2 / n, n) == pytest.approx(zero_latency.allreduce(bits, n))
    assert costmodel.speedup(0.1, bits, 0, bits / 32, 0.0, n, net) > 1
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        costmodel.Network(bandwidth_gbps=0)


# --- data and tasks ---------------------------------------------------------------


def test_worker_shards_deal_every_kept_example_once():
    split = data.Split(np.arange(10, dtype=np.float32)[:, None], np.arange(10, dtype=np.int32))
    x, y = data.worker_shards(split, 3, "shuffle", seed=1)
    assert x.shape == (3, 3, 1) and len(set(y.ravel())) == 9
    _, y = data.worker_shards(split, 3, "contiguous")
    np.testing.assert_array_equal(y, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    with pytest.raises(ValueError, match="partition"):
        data.worker_shards(split, 2, "random")


def test_majority_tokens_labels_are_the_most_frequent_token():
    ds = data.majority_tokens(train=64, test=8, seed=3)
    counts = np.stack([(ds.train.x == v).sum(axis=1) for v in range(8)], axis=1)
    np.testing.assert_array_equal(ds.train.y, counts.argmax(axis=1))


def test_the_optimum_zeroes_the_regularised_gradient():
    ds = data.heterogeneous_logistic(workers=4, per_worker=32, features=5)
    l2 = 0.1
    opt = tasks.optimum(ds.train.x, ds.train.y, 2, l2)
    loss = tasks.loss_fn(tasks.TASKS["logreg_hetero"].model(2))

    def objective(p):
        return loss(p, (jnp.asarray(ds.train.x, jnp.float64), ds.train.y)) + tasks.l2_term(p, l2)

    with jax.enable_x64():
        grad = jax.grad(objective)(jax.tree.map(jnp.asarray, opt))
    assert max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grad)) < 1e-12


# --- runs ---------------------------------------------------------------------------

SMALL = train.Config(task="logreg", workers=4, steps=10, eval_every=5, lr=0.5)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="workers=16 exceeds"):
        dataclasses.replace(SMALL, workers=16).resolved()
    with pytest.raises(ValueError, match="task must be one of"):
        dataclasses.replace(SMALL, task="imagenet").resolved()
    with pytest.raises(ValueError, match="lr must be"):
        dataclasses.replace(SMALL, lr=0.0).resolved()
    with pytest.raises(ValueError, match="levels"):
        dataclasses.replace(SMALL, method="qsgd(levels=-1)").resolved()


def test_dense_run_is_gradient_descent_on_the_pooled_data(tmp_path):
    """Equal shards: the mean of the workers' gradients is the pooled gradient."""
    result = train.run(SMALL, tmp_path, progress=False)
    problem = train.Problem(SMALL.resolved())
    x = jnp.asarray(problem.x.reshape(-1, problem.x.shape[-1]))
    y = jnp.asarray(problem.y.reshape(-1))
    l2 = problem.task.l2
    params = problem.params
    objective = []
    for _ in range(SMALL.steps):
        grad = jax.grad(problem.loss)(params, (x, y))
        params = jax.tree.map(lambda p, g: p - SMALL.lr * (g + l2 * p), params, grad)
        objective.append(float(problem.loss(params, (x, y)) + tasks.l2_term(params, l2)))
    steps, logged = result.column("objective")
    np.testing.assert_allclose(logged[1:], np.array(objective)[steps[1:] - 1], rtol=2e-6)
    assert [r["bits"] for r in result.records[1:]] == [result.info["dense_bits"] + 8] * 10


@pytest.mark.slow  # 25 s; tests/test_experiments_crash.py resumes killed runs in make test
def test_an_interrupted_run_resumes_to_the_same_numbers(tmp_path):
    cfg = train.Config(
        task="logreg_sgd",
        method="diana(qsgd(levels=2))",
        workers=4,
        steps=20,
        eval_every=5,
        checkpoint_every=10,
    )
    whole = train.run(cfg, tmp_path / "a", progress=False)
    part = train.run(cfg, tmp_path / "b", progress=False, until=10)
    assert part.records[-1]["step"] == 10 and not (part.path / "summary.json").exists()
    resumed = train.run(cfg, tmp_path / "b", progress=False)
    assert resumed.records == whole.records
    assert train.load(resumed.path).records == whole.records  # the finished run reads back
    bits = compjax.communication(
        methods.parse(cfg.method).build("data"), train.Problem(cfg.resolved()).params, "data", 4
    )
    assert whole.records[-1]["cum_bits"] == 20 * bits.payload_bits  # the harness logs payloads


def test_cli_with_a_config_file_writes_every_output(tmp_path, capsys):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"task": "logreg", "method": "rank_dad(rank=1)", "workers": 2}))
    result = train.main(["--config", str(config), "--steps", "4", "--eval-every", "2",
                         "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    for name in ("config.json", "metrics.jsonl", "metrics.csv", "summary.json"):
        assert (result.path / name).exists()
    assert str(result.path) in capsys.readouterr().out
    assert result.config.steps == 4 and result.config.method == "rank_dad(rank=1)"
    header = (result.path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"step", "loss", "bits", "cum_comm_s", "test_accuracy", "dist_to_opt"} <= set(header)
    # rank-dAD's bits are what compjax's own dAD accounting reports for this batch
    problem = train.Problem(result.config)
    batch = (problem.x[0], problem.y[0])
    expected = compjax.dad_communication(problem.loss, problem.params, batch, rank=1)
    assert result.records[1]["bits"] == expected["rank_dad"]


def test_cli_reads_a_finished_run_back_and_says_so(tmp_path, capsys):
    args = ["--task", "logreg", "--steps", "2", "--eval-every", "2", "--out", str(tmp_path)]
    args.append("--no-progress")
    first = train.main(args)
    assert "read back" not in capsys.readouterr().out
    again = train.main(args)
    assert again.path == first.path
    assert "read back the finished run" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["--method", "top_kk(ratio=0.1)"], "did you mean 'top_k'?"),
        (["--task", "digit_mlp"], "did you mean 'digits_mlp'?"),
        (["--workers", "0"], "workers"),
    ],
)
def test_cli_bad_input_is_one_line(args, hint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main([*args, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and hint in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_cli_help_lists_tasks_methods_and_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in tasks.TASKS)
    assert all(name in text for name in ("ef21", "top_k", "powersgd", "rank_dad", "dense()"))
    assert "(default: 200)" in text  # checkpoint_every


def test_cli_interrupt_says_how_to_resume(monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    with pytest.raises(SystemExit) as exit_:
        train.main(["--task", "logreg", "--out", str(tmp_path)])
    assert exit_.value.code == 130
    assert "run the same command again to resume" in capsys.readouterr().err


def test_variance_based_logs_the_real_bits_not_the_padding(tmp_path):
    cfg = train.Config(
        task="logreg_sgd", method="variance_based(alpha=1.0, budget=1.0)", workers=2, steps=6,
        eval_every=3,
    )  # fmt: skip
    result = train.run(cfg, tmp_path, progress=False)
    bits = np.array([r["bits"] for r in result.records[1:]])
    padded = result.info["steady_bits"]["allgather"] + result.info["steady_bits"]["allreduce"]
    assert np.all(bits < padded) and bits.sum() > 0
    assert math.isclose(result.records[-1]["cum_bits"], bits.sum())


def test_dad_run_follows_the_dense_run(tmp_path):
    """dAD rebuilds the pooled gradient exactly, so its run is the dense run."""
    cfg = dataclasses.replace(SMALL, task="logreg_sgd", workers=2, steps=4, eval_every=2)
    dense = train.run(cfg, tmp_path, progress=False)
    dad = train.run(dataclasses.replace(cfg, method="dad()"), tmp_path, progress=False)
    np.testing.assert_allclose(dad.column("loss")[1], dense.column("loss")[1], rtol=1e-5)
    assert dad.records[1]["bits"] == 32 * 16 * (30 + 2)  # A (16 x 30) and Delta (16 x 2)
