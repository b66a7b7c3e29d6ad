"""``make bench``'s parts that need several devices, each run in a subprocess of
:mod:`experiments.bench.run` (``--part step``, ``--part powersgd``) with
``XLA_FLAGS=--xla_force_host_platform_device_count`` set before JAX starts; and PyTorch's
DDP ``powerSGD_hook`` on two gloo processes (:mod:`experiments.bench.torch_baselines`)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import compjax
from experiments.common.codecs import (
    MLP_BATCH_PER_WORKER,
    MLP_WIDTHS,
    POWERSGD_RANK,
    STEP_WORKERS,
    specs,
)
from experiments.common.timing import interleaved, make_compressor, median, ratios


def run_part(
    part: str, devices: int, args: list[str], timeout: float = 900, flags: str = ""
) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "experiments.bench.run", "--part", part, "--json", str(path)]
        proc = subprocess.run(
            [*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            return {"error": proc.stderr[-3000:]}
        return json.loads(path.read_text())


def part_step(repeats: int, quick: bool) -> dict:
    """Compressed vs plain data-parallel MLP steps on ``STEP_WORKERS`` devices (this process)."""
    import optax

    P = jax.P
    from jax.sharding import NamedSharding

    n = STEP_WORKERS
    assert jax.device_count() == n, jax.devices()
    mesh = jax.make_mesh((n,), ("data",))
    widths = MLP_WIDTHS if not quick else (784, 256, 10)
    keys = jax.random.split(jax.random.key(0), len(widths))
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        params[f"w{i}"] = jax.random.normal(keys[i], (a, b)) / math.sqrt(a)
        params[f"b{i}"] = jnp.zeros((b,))
    layers = len(widths) - 1

    def loss_fn(params, x, y):
        for i in range(layers):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < layers - 1:
                x = jax.nn.relu(x)
        return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

    batch = MLP_BATCH_PER_WORKER * n
    kx, ky = jax.random.split(jax.random.key(1))
    data = NamedSharding(mesh, P("data"))
    x = jax.device_put(jax.random.normal(kx, (batch, widths[0])), data)
    y = jax.device_put(jax.random.randint(ky, (batch,), 0, widths[-1]), data)
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def make_step(opt, exchange):
        specs = compjax.state_specs(jax.eval_shape(opt.init, params), "data")
        init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))
        state = init(params)

        @jax.jit
        @partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs, P()),
        )
        def step(params, state, x, y):
            local = compjax.worker_params(params, "data")
            loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
            grads = exchange(grads)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

        return partial(step, params, state, x, y)

    fns = {"plain pmean": make_step(optax.sgd(0.01), lambda g: jax.lax.pmean(g, "data"))}
    step_specs = specs("step")
    for spec in step_specs:
        opt = optax.chain(compjax.compress(make_compressor(spec), "data"), optax.sgd(0.01))
        fns[spec] = make_step(opt, lambda g: g)
    times = interleaved(fns, repeats)
    out = {
        "workers": n,
        "widths": list(widths),
        "batch_per_worker": MLP_BATCH_PER_WORKER,
        "parameters": sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)),
        "times": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "ratio": {spec: median(ratios(times[spec], times["plain pmean"])) for spec in step_specs},
        "devices": [str(d) for d in jax.devices()],
    }
    return out


def powersgd_transform():
    """The benchmarked PowerSGD: the ResNet-50 shapes are torchvision's ``(cout, cin, kh, kw)``,
    so each kernel is the ``cout x (cin kh kw)`` matrix ``powerSGD_hook`` compresses.

    Until 2026-11-27 the benchmark left ``channels_last`` at its flax default: each kernel
    was a ``(cout cin kh) x kw`` matrix, too thin to compress, and 53 of the 54 matrices
    were all-reduced dense against the hook's 54 compressed.
    """
    return compjax.powersgd(POWERSGD_RANK, "data", channels_last=False)


def part_powersgd(repeats: int, shapes) -> dict:
    """``compjax.powersgd`` update steps on two devices (this process)."""
    from jax.sharding import NamedSharding

    P = jax.P
    assert jax.device_count() == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("data",))
    params = {f"p{i:03d}": jnp.zeros(s) for i, s in enumerate(shapes)}
    tx = powersgd_transform()
    specs = compjax.state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    keys = jax.random.split(jax.random.key(3), len(shapes))
    grads = {
        f"p{i:03d}": jax.random.normal(k, (2, *s))
        for i, (k, s) in enumerate(zip(keys, shapes, strict=True))
    }
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    def update(grads, state):
        local = jax.tree.map(lambda g: g[0], grads)
        return tx.update(local, state)

    state = jax.block_until_ready(update(grads, state)[1])  # warm start under way
    times = interleaved({"update": partial(update, grads, state)}, repeats)
    return {"rank": POWERSGD_RANK, "times": times["update"], "median_s": median(times["update"])}


def torch_powersgd(repeats: int, shapes, threads: int = 1) -> dict:
    """PyTorch's DDP ``powerSGD_hook`` on two gloo processes, timed per step inside the hook."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "shapes": [list(s) for s in shapes],
            "rank": POWERSGD_RANK,
            "warmup": 3,
            "steps": repeats,
            "threads": threads,
        }
        inputs, output = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inputs.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "experiments.bench.torch_baselines", "powersgd", str(inputs)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        procs = [
            subprocess.Popen(
                [*cmd, str(Path(tmp) / "store"), str(r), "2", str(output)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(2)
        ]
        logs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs):
            return {"error": "\n".join(log[-2000:] for log in logs)}
        out = json.loads(output.read_text())
    out["median_s"] = median(out["hook"])
    out["threads_per_process"] = threads
    return out
