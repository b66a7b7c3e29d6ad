"""``make bench-gpu``'s arithmetic: traffic, bandwidth fractions, the goal's verdicts, the table.

A tiny section runs for real on the CPU (its times are not judged: no chip
peak is known there); the fractions are checked on a section with times
fixed by hand.
"""

import json

import pytest

import compjax
from experiments.gpu import run as bench_gpu


def test_peak_bandwidth_by_device_kind():
    assert bench_gpu.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench_gpu.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert bench_gpu.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert bench_gpu.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert bench_gpu.peak_bandwidth("cpu") is None


def test_traffic_is_input_output_and_the_payload_twice():
    assert bench_gpu.traffic(1000, 0) == 8000
    assert bench_gpu.traffic(1000, 125) == 8250  # a sign's payload: 1 bit per entry


def test_a_section_on_the_cpu_counts_its_payload_and_has_no_fraction_without_a_peak():
    section = {
        "shapes": [(4096,)],
        "bucket_size": None,
        "codecs": {"sign()": compjax.sign, "cast('bfloat16')": lambda: compjax.cast("bfloat16")},
    }
    out = bench_gpu.bench_section(section, rounds=1, batch=1, peak=None)
    sign = out["codecs"]["sign()"]
    assert sign["payload_bytes"] == 4096 / 8
    assert sign["traffic_bytes"] == 8 * 4096 + 2 * 512
    assert sign["bytes_per_s"] == sign["traffic_bytes"] / sign["median_s"]["codec"]
    assert sign["of_peak"] is None
    assert out["codecs"]["cast('bfloat16')"]["payload_bytes"] == 2 * 4096
    assert all(r["met"] is None for r in bench_gpu.rows({"sections": {"2^24": out}}))


def fixed(codec_s: float, copy_s: float = 1.0, entries: int = 1000, payload: float = 0.0):
    traffic = bench_gpu.traffic(entries, payload)
    return {
        "median_s": {"copy": copy_s, "codec": codec_s},
        "ratio": codec_s / copy_s,
        "bytes_per_s": traffic / codec_s,
        "of_peak": traffic / codec_s / 10_000,
        "copy_of_peak": 8 * entries / copy_s / 10_000,
    }


@pytest.fixture
def result():
    fast, slow = fixed(1.0), fixed(1.7)  # 80% and 47% of a 10 kB/s peak
    return {
        "machine": {"jax": "0"},
        "device": {"kind": "test chip", "backend": "gpu"},
        "peak_bytes_per_s": 10_000.0,
        "rounds": 1,
        "batch": 1,
        "seconds": 1.0,
        "transform_check": None,
        "sections": {
            "2^24": {"entries": 1000, "codecs": {"fast": fast, "slow": slow}},
            "2^26": {"entries": 1000, "codecs": {"slow": slow}},
        },
    }


def test_the_goal_is_half_the_peak_on_2_24_alone(result):
    rows = {(r["section"], r["codec"]): r for r in bench_gpu.rows(result)}
    assert rows["2^24", "fast"]["met"] is True
    assert rows["2^24", "slow"]["met"] is False  # 47% < 50%
    assert rows["2^26", "slow"]["met"] is None and rows["2^26", "slow"]["goal"] is None
    table = bench_gpu.markdown(result)
    assert "| `fast` | 1,000,000 | 1.00 | 0 | 80.0% | MET |" in table
    assert "| `slow` | 1,700,000 | 1.70 | 0 | 47.1% | MISSED |" in table
    assert "1 of 2 met" in table


def test_render_rewrites_the_table_of_a_saved_run(result, tmp_path):
    saved = tmp_path / "bench_gpu.json"
    saved.write_text(json.dumps(result))
    assert bench_gpu.main(["--render", str(saved)]) == 0
    assert saved.with_suffix(".md").read_text() == bench_gpu.markdown(result)
