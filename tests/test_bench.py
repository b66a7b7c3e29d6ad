"""The benchmark's pure parts: shapes, the interleaved timer, goals and the table.

Nothing here times anything against a goal; ``make bench`` does that.
"""

import math

import pytest

from experiments.bench import parts
from experiments.bench import report as bench_report
from experiments.common import codecs as bench_codecs
from experiments.common import timing


def test_resnet50_tree_has_torchvision_parameter_count():
    shapes = bench_codecs.resnet50_shapes()
    assert sum(math.prod(s) for s in shapes) == 25_557_032  # torchvision resnet50
    assert len(shapes) == 161
    assert shapes[0] == (64, 3, 7, 7) and shapes[-2:] == [(1000, 2048), (1000,)]


def test_every_benchmarked_spec_builds_its_compressor():
    names = [type(timing.make_compressor(c.spec)).__name__ for c in bench_codecs.CODECS]
    assert names == [
        "Sign",
        "ScaledSign",
        "TernGrad",
        "QSGD",
        "QSGD",
        "Natural",
        "Cast",
        "Cast",
        "NaturalDithering",
        "L2ScaledSign",
        "IntQuant",
        "Drive",
        "Drive",
        "Drive",
        "Drive",
    ]
    assert len(bench_codecs.CODEC) == len(bench_codecs.CODECS)  # one line each


def test_codec_table_decides_sections_and_goals():
    """A codec runs where its line says; EDEN's goal is 3x on 2^24 only."""
    assert "eden(bits=1)" in bench_codecs.specs("roofline")
    assert "eden(bits=1)" not in bench_codecs.specs("step") + bench_codecs.specs("roofline_buckets")
    assert set(bench_codecs.specs("torch")) < set(bench_codecs.specs("step"))
    assert "natural_dithering()" in bench_codecs.specs("step")
    res = {
        "roofline_tree": {
            "entries": 10,
            "compressors": {
                "eden(bits=1)": _roofline(1.0, 2.0, 2.0),
                "sign()": _roofline(1.0, 0.5, 0.5),
            },
        },
        "roofline": {"entries": 10, "compressors": {"eden(bits=1)": _roofline(1.0, 1.5, 1.5)}},
        "hadamard": {
            "rounds": 3,
            "median_s": {"copy": 1.0, "fwht": 2.0, "rotate": 6.0},
            "fwht_ratio": 2.0,
            "rotate_ratio": 6.0,
            "page_faults_per_call": {"copy": 0.0, "fwht": 0.0, "rotate": 0.0},
        },
    }
    goals = [r for r in bench_report.goal_rows(res) if r["group"] == "roofline"]
    assert [(r["what"].split()[0], r["goal"], r["met"]) for r in goals] == [
        ("`eden(bits=1)`", "<= 3x", True),
        ("`sign()`", "<= 2x", True),
    ]
    reported = bench_report.reported_rows(res)
    assert [r["group"] for r in reported] == ["roofline", "hadamard", "hadamard"]
    assert reported[0]["ratio"] == 4.0  # EDEN on the tree: no goal there


def test_interleaved_calls_every_function_in_rounds():
    calls = []
    times = timing.interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then round by round
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    # In batches: each round calls a function that many times, one time (the mean) recorded.
    calls.clear()
    times = timing.interleaved({"a": lambda: calls.append("a")}, repeats=2, warmup=0, batch=4)
    assert calls == ["a"] * 8 and len(times["a"]) == 2
    assert timing.ratios([2.0, 6.0], [1.0, 2.0]) == [2.0, 3.0]
    assert timing.median([3.0, 1.0, 2.0]) == 2.0


def _roofline(copy, compress, decompress):
    return {
        "median_s": {"copy": copy, "compress": compress, "decompress": decompress},
        "ratio": (compress + decompress) / copy,
        "compress_ratio": compress / copy,
        "decompress_ratio": decompress / copy,
        "page_faults_per_call": {"copy": 0.0, "compress": 0.0, "decompress": 0.0},
    }


def _result(copy, compress, decompress, sampled, exact, step, plain, counts):
    """A minimal result of one spec, with the given median times (seconds)."""
    comp = _roofline(copy, compress, decompress)
    return {
        "machine": {"cpu": "cpu", "cpu_count": 2, "jax": "x"},
        "config": {"repeats": 3},
        "roofline": {"entries": bench_codecs.N, "compressors": {"sign()": comp}},
        "torch": {"error": "torch not importable"},
        "powersgd": {"jax": {"error": "no"}, "torch": {"error": "no"}},
        "topk": {
            "k": 16777,
            "band": [13422, 21810],
            "median_s": {"sampled": sampled, "exact": exact},
            "speedup": exact / sampled,
            "counts": counts,
            "fallbacks": [False] * len(counts),
        },
        "topk_codec": {
            "d": 25557032,
            "k": 255570,
            "band": [204456, 332241],
            "kept": {"exact": 255570, "threshold": 260000, "chunked_top_k(32, 4096)": 199680},
            "median_s": {
                "copy": copy,
                "exact": exact,
                "threshold": 3 * sampled,
                "chunked_top_k(32, 4096)": 4 * copy,
            },
            "ratio": {
                "exact": exact / copy,
                "threshold": 3 * sampled / copy,
                "chunked_top_k(32, 4096)": 4.0,
            },
        },
        "step": {
            "workers": 8,
            "widths": [4, 2],
            "batch_per_worker": 1,
            "median_s": {"plain pmean": plain, "sign()": step},
            "ratio": {"sign()": step / plain},
        },
    }


@pytest.mark.parametrize("scale", [1.0, 1.1])
def test_goals_are_met_exactly_up_to_their_bounds(scale):
    """Each goal at its bound is MET; 10% past it MISSED with the ratio in the table."""
    res = _result(
        copy=1.0,
        compress=1.0 * scale,
        decompress=1.0 * scale,
        sampled=1.0 * scale,
        exact=5.0,
        step=1.25 * scale,
        plain=1.0,
        counts=[13422, 21810] if scale == 1.0 else [13421, 16777],
    )
    rows = bench_report.goal_rows(res)
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r["met"])
    assert by_group["roofline"] == [scale == 1.0]
    # DGC's speedup and count; the EF top-k codec exact (5x the copy) and by threshold.
    assert by_group["top-k"] == [scale == 1.0, scale == 1.0, False, scale == 1.0]
    assert by_group["step"] == [scale == 1.0]
    assert by_group["pytorch"] == [False, False]  # did not run: never counted as met
    table = bench_report.markdown(res, rows)
    if scale != 1.0:
        assert "MISSED (2.20x)" in table  # the roofline ratio
    # The header and one line per goal; then the header and SparseLoCo's codec, no goal.
    assert table.count("\n| ") == 1 + len(rows) + 2
    assert "SparseLoCo codec, chunked_top_k(32, 4096)" in table.split("no goal:", 1)[1]


def test_a_multi_line_error_note_stays_in_its_table_row():
    """A section that did not run (PyTorch absent) has a traceback for a note: one row still."""
    res = _result(1.0, 1.0, 1.0, 1.0, 5.0, 1.25, 1.0, [13422, 21810])
    res["torch"] = {"error": "Traceback (most recent call last):\n\n  x | y\nImportError: torch"}
    rows = bench_report.goal_rows(res)
    goals_table = bench_report.markdown(res, rows).split("| measurement", 1)[1].split("\n\n", 1)[0]
    assert goals_table.count("\n| ") == len(rows)
    assert "x \\| y" in goals_table


def test_summary_puts_each_goal_on_one_line_with_what_met_and_missed_it():
    """The docs' table: roofline rows of one section share a line (named by their specs),
    the EF top-k codecs share theirs (named by their selection), a row of its own keeps
    its text; a row that did not run counts as missed, with no ratio."""
    res = _result(1.0, 1.0, 1.0, 1.0, 5.0, 1.25, 1.0, [13422, 21810])
    rows = bench_report.goal_rows(res)
    assert bench_report.family(rows[0]) == ("compress+decompress, 2^24 fp32", "sign()")
    text = bench_report.summary(rows)
    lines = text.splitlines()
    assert lines[:2] == ["| goal | met (ratio) | missed (ratio) |", "|---|---|---|"]
    assert "| compress+decompress, 2^24 fp32: <= 2x | sign() 2.00 |  |" in lines
    topk = next(line for line in lines if line.startswith("| EF top-k 1% codec"))
    assert topk.endswith("| threshold 3.00 | exact 5.00 |")
    assert "| compressors vs PyTorch, 2^24 fp32: < 1x |  | n/a |" in lines  # did not run
    assert lines[-1] == f"{sum(r['met'] for r in rows)} of {len(rows)} goals met."
    # one line per family, every goal row in exactly one of them
    assert len(lines) == 2 + len({bench_report.family(r)[0] + str(r["goal"]) for r in rows}) + 2


def test_the_docs_performance_table_is_one_committed_runs():
    """docs/benchmarks.md's goal table is :func:`summary` of the committed full run
    (``paper_figs/out/bench_cpu.json``, a copy of one ``make bench``'s results/bench.json),
    and that run judged the same goals as the code does now."""
    import dataclasses
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    res = json.loads((root / "paper_figs" / "out" / "bench_cpu.json").read_text())
    rows = bench_report.goal_rows(res)
    assert [r["met"] for r in rows] == [r["met"] for r in res["goals"]]
    assert bench_report.summary(rows) in (root / "docs" / "benchmarks.md").read_text()
    assert res["config"]["quick"] is False and res["config"]["repeats"] == 9
    codecs = [dataclasses.asdict(c) for c in bench_codecs.CODECS]
    assert res["config"]["codecs"] == json.loads(json.dumps(codecs))  # today's codecs


@pytest.mark.slow
def test_quick_run_writes_every_section(tmp_path):
    """``python -m experiments.bench.run --quick``: every section ran (PyTorch only where it
    is installed), and the table has a line per goal."""
    import json
    import os
    import subprocess
    import sys

    # Timed with XLA's usual optimisations, not the cheap compilation the tests ask for.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.run", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    sections = ("roofline", "roofline_tree", "roofline_buckets", "hadamard", "memory", "topk")
    sections += ("topk_codec",)
    for section in (*sections, "step"):
        assert "error" not in res[section], res[section]
    for section in (*bench_codecs.ROOFLINE_PARTS, bench_codecs.HWIO_PART, "memory"):
        assert set(res[section]["compressors"]) == set(bench_codecs.specs(section))
    assert set(res["step"]["ratio"]) == set(bench_codecs.specs("step"))
    assert all(r["ratio"] > 0 for r in res["goals"] if r["group"] != "pytorch")
    table = (tmp_path / "bench.md").read_text()
    assert table == bench_report.markdown(res, res["goals"])  # the table is the JSON's
    goals_table = table.split("| measurement", 1)[1].split("\n\n", 1)[0]
    assert goals_table.count("\n| ") == len(res["goals"])


def test_powersgd_compresses_the_matrices_the_hook_does():
    """Every kernel and the classifier (54 matrices) go as rank-4 factors, as in
    ``powerSGD_hook``; only the 107 vectors are all-reduced dense."""
    import jax
    import jax.numpy as jnp

    import compjax

    shapes = bench_codecs.resnet50_shapes()
    params = {f"p{i:03d}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}
    report = compjax.communication(parts.powersgd_transform(), params, num_workers=2)
    r = bench_codecs.POWERSGD_RANK
    matrices = [s for s in shapes if len(s) > 1]
    factors = sum(32 * r * (s[0] + math.prod(s[1:])) for s in matrices)
    dense = 32 * sum(s[0] for s in shapes if len(s) == 1)
    assert len(matrices) == 54
    assert report.payload_bits == factors + dense + 8  # and the step's flag
