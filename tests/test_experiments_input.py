"""Bad input to the harness is one line naming the field, before anything runs or is written;
workers that do not divide the training set say which examples they leave out."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from experiments.common import data, methods
from experiments.harness import config, train

# --- every field's type, from Config's annotations ------------------------------------

WRONG = {str: 3, int: "3", float: "0.5"}  # a value of another type for each kind of field


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(train.Config)])
def test_every_field_of_the_wrong_type_is_a_type_error_naming_it(name):
    kind = config.field_types()[name][0]
    cfg = dataclasses.replace(train.Config(task="logreg"), **{name: WRONG[kind]})
    with pytest.raises(TypeError, match=rf"^{name} must be {kind.__name__}\b.*\(\w+\)$"):
        cfg.resolved()


@pytest.mark.parametrize("name", ["workers", "steps", "seed", "eval_every", "lr", "momentum"])
def test_a_bool_is_not_a_number(name):
    with pytest.raises(TypeError, match=rf"^{name} must be .*, got True \(bool\)"):
        dataclasses.replace(train.Config(task="logreg"), **{name: True}).resolved()


def test_an_int_serves_for_a_float_and_is_stored_as_one():
    cfg = train.Config(task="logreg", lr=1, momentum=0, latency_us=5)
    resolved = cfg.resolved()
    assert (resolved.lr, resolved.momentum, resolved.latency_us) == (1.0, 0.0, 5.0)
    assert all(type(v) is float for v in (resolved.lr, resolved.momentum, resolved.latency_us))
    assert cfg.run_dir() == dataclasses.replace(cfg, lr=1.0).run_dir()


@pytest.mark.parametrize(
    ("field", "value"), [("seed", -1), ("seed", 2**32), ("checkpoint_every", 0)]
)
def test_integers_out_of_range_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be an integer"):
        dataclasses.replace(train.Config(task="logreg"), **{field: value}).resolved()


# --- the command line: one line on stderr, exit 2, nothing written ----------------------


def _cli_error(args, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        train.main([*args, "--out", str(out), "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()  # nothing written
    return err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seed": "abc"}, "seed must be int, got 'abc' (str)"),
        ({"checkpoint_every": "20"}, "checkpoint_every must be int, got '20' (str)"),
        ({"lr": "0.1"}, "lr must be float or None, got '0.1' (str)"),
        ({"momentum": "0.9"}, "momentum must be float or None, got '0.9' (str)"),
        ({"steps": True}, "steps must be int or None, got True (bool)"),
    ],
)
def test_a_config_file_field_of_the_wrong_type_is_one_line(fields, message, tmp_path, capsys):
    file = tmp_path / "run.json"
    file.write_text(json.dumps({"task": "logreg", **fields}))
    assert message in _cli_error(["--config", str(file)], tmp_path, capsys)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps = true\n", "steps must be int or None, got True (bool)"),
        ("steps = \n", "run.toml: Invalid value (at line 1, column 9)"),
        ('task = "logreg"\nstep = 3\n', "unknown config fields ['step']"),
        ("[steps]\n", "steps must be int or None, got {} (dict)"),
    ],
)
def test_a_bad_toml_file_is_one_line(text, message, tmp_path, capsys):
    file = tmp_path / "run.toml"
    file.write_text(text)
    assert message in _cli_error(["--config", str(file)], tmp_path, capsys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "missing.json"], "No such file or directory"),
        (["--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_a_bad_file_or_flag_is_one_line(args, message, tmp_path, capsys):
    assert message in _cli_error(args, tmp_path, capsys)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("compress(qsgd(levels=4), exchange='scatter-gather')", "got 'scatter-gather'"),
        ("ef(top_k(ratio=0.01), exchange='ring')", "exchange must be one of"),
        ("diana(qsgd(levels=4), alpah=0.5)", "did you mean 'alpha'?"),
        ("dianna(qsgd(levels=4))", "unknown method 'dianna' (did you mean 'diana'?)"),
    ],
)
def test_a_bad_method_argument_is_one_line(method, message, tmp_path, capsys):
    err = _cli_error(["--task", "logreg", "--method", method], tmp_path, capsys)
    assert message in err and method in err


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", math.inf), ("lr", 1e308), ("lr", math.nan), ("bandwidth_gbps", math.inf),
     ("bandwidth_gbps", 1e308), ("latency_us", math.inf), ("latency_us", 1e308)],
)  # fmt: skip
def test_non_finite_and_absurd_floats_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number in "):
        dataclasses.replace(train.Config(task="logreg"), **{field: value}).resolved()


def test_the_float_bounds_admit_the_tasks_and_reasonable_settings():
    for name in ("logreg", "digits_mlp"):
        assert train.Config(task=name, lr=1000.0, bandwidth_gbps=1e6, latency_us=1e6).resolved()
    with pytest.raises(ValueError, match=r"^lr must be a finite number in \(0, 1000\]"):
        train.Config(task="logreg", lr=1000.5).resolved()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "inf"], "error: lr must be a finite number in (0, 1000], got inf"),
        (["--lr", "1e308"], "error: lr must be a finite number in (0, 1000], got 1e+308"),
        (["--bandwidth-gbps", "Infinity"], "error: bandwidth_gbps must be a finite number"),
    ],
)
def test_cli_non_finite_and_absurd_floats_are_one_line(args, message, tmp_path, capsys):
    assert message in _cli_error(["--task", "logreg", *args], tmp_path, capsys)


def test_a_config_file_infinity_is_one_line(tmp_path, capsys):
    file = tmp_path / "run.json"
    file.write_text('{"task": "logreg", "lr": Infinity}')  # json.loads reads it as inf
    assert "lr must be a finite number" in _cli_error(["--config", str(file)], tmp_path, capsys)


DEPTH = 100_000


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("lists.json", "[" * DEPTH + "]" * DEPTH),
        ("dicts.json", '{"a":' * DEPTH + "1" + "}" * DEPTH),
        ("lists.toml", "a = " + "[" * DEPTH + "]" * DEPTH),
        ("dicts.toml", "a = " + "{b = " * DEPTH + "1" + "}" * DEPTH),
    ],
)
def test_a_config_nested_too_deeply_is_one_line(name, text, tmp_path, capsys):
    file = tmp_path / name
    file.write_text(text)
    assert "nested too deeply" in _cli_error(["--config", str(file)], tmp_path, capsys)


def _out_error(out: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        train.main(["--task", "logreg", "--steps", "1", "--workers", "2", "--out", out,
                    "--no-progress"])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("make_out", "message"),
    [
        (lambda tmp: str(tmp / ("a" * 256)), "File name too long"),  # one component > 255
        (lambda tmp: str(tmp / "/".join(["b" * 200] * 25)), "File name too long"),  # > 4096
        (lambda tmp: str(tmp / "file" / "sub"), "Not a directory"),  # under a regular file
        (lambda tmp: "/proc/compjax-results", "cannot write the results there"),  # root too
    ],
    ids=["component-over-255", "path-over-4096", "under-a-file", "unwritable"],
)
def test_an_out_directory_that_cannot_be_written_is_one_line(make_out, message, tmp_path, capsys):
    if not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc")
    (tmp_path / "file").write_text("not a directory")
    out = make_out(tmp_path)
    err = _out_error(out, capsys)
    assert message in err and "--out " in err
    assert len(err) < 400  # a long path is shortened, not printed whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


def test_an_error_found_when_the_run_is_built_writes_nothing(tmp_path, capsys):
    err = _cli_error(["--task", "logreg", "--batch-size", "100000"], tmp_path, capsys)
    assert "batch_size=100000 exceeds" in err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dianna(qsgd(levels=4))", "unknown method 'dianna' (did you mean 'diana'?)"),
        ("powersgd_(2)", "unknown method 'powersgd_' (did you mean 'powersgd'?)"),
        ("diana(qsdg(levels=4))", "'qsdg' is not a compressor (did you mean 'qsgd'?)"),
        ("qsgd(level=4)", "unexpected keyword argument 'level' (did you mean 'levels'?)"),
        ("dgc(ratoi=0.1)", "dgc got an unexpected keyword argument 'ratoi' (did you mean 'ratio"),
        ("powersgd(rnak=2)", "did you mean 'rank'?"),
    ],
)
def test_misspelled_names_get_a_did_you_mean(spec, message):
    with pytest.raises(ValueError) as err:
        methods.parse(spec)
    assert message in str(err.value) and "keyword arguments only" not in str(err.value)


def test_a_known_name_given_a_positional_argument_still_says_keywords_only():
    with pytest.raises(ValueError, match="powersgd takes keyword arguments only"):
        methods.parse("powersgd(2)")


# --- workers that do not divide the data -------------------------------------------------


def test_dropped_examples_are_those_no_worker_is_dealt():
    split = data.Split(np.zeros((10, 1), np.float32), np.arange(10, dtype=np.int32))
    for partition in ("shuffle", "contiguous"):
        _, y = data.worker_shards(split, 3, partition, seed=1)
        dropped = data.dropped_examples(split, 3, partition, seed=1)
        assert sorted([*y.ravel(), *dropped]) == list(range(10)) and len(dropped) == 1
    assert data.dropped_examples(split, 3, "contiguous").tolist() == [9]
    assert data.dropped_examples(split, 5, "shuffle").size == 0


def test_a_run_over_workers_that_do_not_divide_the_data_says_what_it_drops(tmp_path, caplog):
    cfg = train.Config(task="logreg", workers=7, steps=1, eval_every=1)
    with caplog.at_level(logging.WARNING, logger="experiments.harness.train"):
        result = train.run(cfg, tmp_path, progress=False)
    problem = train.Problem(result.config)
    train_size = len(problem.dataset.train)
    dropped = result.info["dropped_examples"]
    assert len(dropped) == train_size % 7 == train_size - 7 * result.info["shard_size"] > 0
    assert json.loads((result.path / "config.json").read_text())["dropped_examples"] == dropped
    [warning] = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert f"the {len(dropped)} left over are dropped" in warning and str(dropped) in warning
