"""``experiments/bench/native_fwht.cc``, the native transform behind the EDEN bound in
docs/benchmarks.md: it builds, and its transform is the float64 butterfly's."""

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "experiments" / "bench" / "native_fwht.cc"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_native_transform_builds_and_is_the_butterfly(tmp_path):
    """Built as the docs say (without ``-march=native``, so the vectors may lower to narrower
    registers); at ``2^16``, ``2^20`` and ``2^18`` entries its transform is within 2e-5 of
    a float64 butterfly (the program's exit status), and a bad size is refused."""
    exe = tmp_path / "native_fwht"
    build = ["g++", "-O2", "-fopenmp", "-std=c++17", "-Wno-psabi", str(SOURCE), "-o", str(exe)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    run = subprocess.run([exe, "18", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("max abs error") == 3
    assert "(2 passes" in run.stdout  # rows of 2^12 entries, then one group of 6 bits
    refused = subprocess.run([exe, "3"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "usage" in refused.stderr
