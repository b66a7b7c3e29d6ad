"""Every script of ``examples/`` runs, in its few-steps mode (``--steps``), as ``__main__`` in
this test process (``runpy``: JAX is not imported again), with the session's XLA flags (8
simulated CPU devices, compiled cheaply: see ``conftest.py``); the multi-process launcher in a
process group of its own.  ``make test`` runs one script; ``make test-slow`` the others and the
launcher.
"""

import contextlib
import io
import math
import os
import pathlib
import re
import runpy
import signal
import subprocess
import sys
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 3
TIMEOUT_S = 180


def run(cmd: list[str]) -> str:
    """Run ``cmd`` from the repository root in its own process group; its output.  On a
    timeout the whole group is killed (the multi-process launcher's workers too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} timed out after {TIMEOUT_S} s:\n{out}")
    assert proc.returncode == 0, f"{cmd} exited with {proc.returncode}:\n{out}"
    return out


def final_loss(out: str) -> float:
    """The loss the script printed for its last step."""
    match = re.search(rf"step {STEPS}: loss ([-+]?(?:[\d.]+(?:e[-+]?\d+)?|nan|inf))", out)
    assert match, f"no loss printed for step {STEPS}:\n{out}"
    return float(match.group(1))


SCRIPTS = (
    "linen_lm.py",
    "nnx_mlp.py",
    "jit_data_parallel.py",
    "fsdp_linen.py",
    "fsdp_nnx.py",
    "diloco_linen.py",
)
#: The one script ``make test`` runs (the shortest path: a jitted data-parallel step); the
#: others, and the multi-process launcher, run with ``make test-slow`` (8-11 s each here).
FAST = ("jit_data_parallel.py",)


def run_script(path: pathlib.Path) -> tuple[bool, str]:
    """Run ``path`` as ``__main__`` with ``--steps`` in this process (JAX already initialised,
    with the session's devices): ``(it ran without an exception, its output)``."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [str(path), "--steps", str(STEPS)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(path), run_name="__main__")
        return True, out.getvalue()
    except BaseException:  # argparse's SystemExit too
        return False, out.getvalue() + traceback.format_exc()
    finally:
        sys.argv = argv


@pytest.fixture(scope="module")
def outputs(request) -> dict:
    """The selected scripts' ``(ok, output)``, each run as ``__main__`` in this process."""
    selected = {
        item.callspec.params["script"]
        for item in request.session.items  # those -m selected
        if item.path == request.path and item.originalname == "test_example_runs"
    }
    return {s: run_script(EXAMPLES / s) for s in SCRIPTS if s in selected}


@pytest.mark.parametrize(
    "script",
    [s if s in FAST else pytest.param(s, marks=pytest.mark.slow) for s in SCRIPTS],
    ids=lambda s: s,
)
def test_example_runs(script, outputs):
    ok, out = outputs[script]
    assert ok, out
    assert math.isfinite(final_loss(out))
    assert re.search(r"[\d,]+ bits", out), out  # it reports what each worker sends


def test_every_example_is_tested():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(SCRIPTS)
    assert {p.name for p in (EXAMPLES / "multiprocess").iterdir()} >= {"launch.sh", "worker.py"}


@pytest.mark.slow
def test_multiprocess_example_runs():
    """Two ``jax.distributed`` processes started by the launcher end with the same params."""
    out = run(["bash", str(EXAMPLES / "multiprocess" / "launch.sh"), "--steps", str(STEPS)])
    finals = re.findall(r"process (\d): (final loss [\d.]+, sum\(w\) [-\d.]+)", out)
    assert sorted(p for p, _ in finals) == ["0", "1"], out
    assert finals[0][1] == finals[1][1], out  # replicated: the same loss and params everywhere
    assert math.isfinite(final_loss(out))
