"""PowerSGD against PyTorch's own DDP ``powerSGD_hook`` on identical matrices and Q.

Runs where torch is installed (``make test-peers`` installs the CPU build);
skipped otherwise.  Two torch processes (gloo, world size 2; DDP skips its
hooks for a single process) run DDP on a one-parameter model, so the hook's
bucket holds exactly that matrix and its Q memory can be seeded with
compjax's initial Q; compjax runs the same two workers under ``jax.vmap``.
Rank 4 exercises the hook's QR orthogonalisation (compjax uses Gram-Schmidt;
the two bases differ at most in column signs, which leave ``P Q^T``
unchanged).
"""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compjax

pytest.importorskip("torch")
pytestmark = pytest.mark.peers

WORKER = Path(__file__).with_name("torch_powersgd_worker.py")
STEPS, WORLD, START = 5, 2, 2


def torch_updates(tmp_path, grads, q0, rank):
    inputs, output = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(inputs, grads=grads, q0=np.asarray(q0), rank=rank, start_iter=START)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                *map(str, (inputs, tmp_path / "store", r, WORLD, output)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return np.load(output)["updates"]


@pytest.mark.parametrize(("shape", "rank"), [((16, 12), 1), ((16, 12), 2), ((32, 2, 3, 3), 4)])
def test_agrees_with_pytorch_hook(tmp_path, shape, rank):
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((STEPS, WORLD, *shape)).astype(np.float32)
    tx = compjax.powersgd(rank, "data", start_iter=START, channels_last=False)  # torch layout
    params = {"w": jnp.zeros(shape)}
    expected = torch_updates(tmp_path, grads, tx.init(params).q[0], rank)
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(WORLD))
    step = jax.jit(jax.vmap(tx.update, axis_name="data"))
    for t in range(STEPS):
        upd, state = step({"w": jnp.asarray(grads[t])}, state)
        np.testing.assert_allclose(upd["w"][0], expected[t], rtol=1e-4, atol=1e-5, err_msg=f"{t}")
