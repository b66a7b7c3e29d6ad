"""One process of ``make bench-net``: real data-parallel training steps, timed.

:mod:`experiments.net.run` starts ``n`` of these inside its network
namespace (``ip netns exec``); they join a ``jax.distributed`` job on
127.0.0.1 (gloo CPU collectives, one CPU device per process, XLA and BLAS on
one thread each) and train the language model of
:mod:`experiments.common.lm` over the global 1-D mesh axis ``"data"``,
with the step of :func:`experiments.common.lm_step.build` (docs/distributed.md, "A
complete shard_map training step", with ``optax.sgd(lr)`` after the method).

For every method the step is compiled once (the compiled HLO's collectives
are recorded, :func:`experiments.common.hlo.hlo_collectives`) and run twice to warm up.  Then, for
each rate (the first without a limit), process 0 sets the loopback's token
bucket with ``tc`` and every method in turn runs one more warm-up step, a
barrier, the namespace's loopback ``tx_bytes``, the timed steps (each
process blocks on each step's outputs and keeps its own times), a barrier
and ``tx_bytes`` again.  The local-steps methods (DiLoCo, SparseLoCo: the
step of :func:`compjax.local_steps` over per-worker copies) are timed over
whole rounds instead (:func:`measure`): their first warm-up is a whole
round, so that its synchronisation has run once.  A forward-backward-SGD step on each process's own
device with no exchange at all is timed first (the compute alone).

Process 0 writes the results as JSON after every rate, so a run cut short
keeps what it measured::

    ip netns exec NS python -m experiments.net.worker --process-id 0 \\
        --num-processes 2 --port 29500 --config config.json --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

from experiments.common import netns
from experiments.common.jobs import barrier, gather_times, run_joined
from experiments.common.lm import METHODS, LMConfig, init_params, loss_fn
from experiments.common.lm import tokens as make_tokens
from experiments.common.lm_step import AXIS, P, Trainer, build

BATCHES = 4  # distinct batches per worker, cycled


def step_seconds(times: list[list[float]]) -> float:
    """The step time of a setting: the median over steps of the slowest process's time."""
    return float(statistics.median(np.max(np.asarray(times), axis=0)))


def time_compute(cfg: LMConfig, host_params, rank: int, steps: int) -> list[list[float]]:
    """Each process's forward-backward-SGD step on its own device, no exchange (all at once)."""
    import optax

    device = jax.local_devices()[0]
    params = jax.device_put(host_params, device)
    batch = jax.device_put(make_tokens(cfg, rank, 0), device)

    @partial(jax.jit, donate_argnums=0)
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg.heads)
        return optax.apply_updates(params, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    for _ in range(2):
        params, _ = jax.block_until_ready(step(params, batch))
    barrier("compute")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, _ = jax.block_until_ready(step(params, batch))
        times.append(time.perf_counter() - start)
    return gather_times(times)


# -- the run ------------------------------------------------------------------------------------
def round_warmup(trainer: Trainer) -> int:
    """Warm-up steps before a local-steps method's timed window: enough to end the current
    round (at least one whole round on a fresh trainer, so its synchronisation has run)."""
    h = trainer.method.sync_every
    return h if trainer.count == 0 else -trainer.count % h


def measure(
    trainer: Trainer, steps: int, rank: int, idle_bytes: int, rounds: int | None = None
) -> dict:
    """Time ``steps`` steps of a warmed-up trainer; loopback bytes from process 0's counter.

    A local-steps method (``trainer.method.sync_every = H``) is timed over
    ``rounds`` whole rounds instead: it first ends the round under way, then
    the ``rounds * H`` timed steps each end with a synchronisation, so the
    step time (``step_s``) is the **mean** over them of the slowest process's
    step, each synchronisation counted once in ``H`` steps (``sync_s`` and
    ``inner_s`` split it), and the traffic is whole rounds'.
    """
    h = trainer.method.sync_every
    if h is None:
        trainer.step()  # warm-up at this rate
    else:
        steps = rounds * h
        for _ in range(round_warmup(trainer)):
            trainer.step()
    barrier("before")
    before = netns.read_tx_bytes() if rank == 0 else 0
    times, losses = [], []
    for _ in range(steps):
        seconds, loss = trainer.step()
        times.append(seconds)
        losses.append(loss)
    barrier("after")
    sent = netns.read_tx_bytes() - before - idle_bytes if rank == 0 else 0
    all_times = gather_times(times)
    out = {
        "steps": steps,
        "times": all_times,
        "step_s": step_seconds(all_times),
        "tx_bytes": int(sent),
        "losses": losses,
    }
    if h is not None:
        out |= round_seconds(all_times, h)
    return out


def round_seconds(times: list[list[float]], sync_every: int) -> dict:
    """A local-steps method's step times over whole rounds (each process's list starting at
    a round's first step): the mean of the slowest process's step (``step_s``), and of its
    synchronising steps (every ``sync_every``-th, ``sync_s``) and the others (``inner_s``)."""
    slowest = np.max(np.asarray(times), axis=0)
    if slowest.size == 0 or slowest.size % sync_every:
        raise ValueError(f"{slowest.size} steps are not whole rounds of {sync_every}")
    rounds = slowest.reshape(-1, sync_every)
    return {
        "rounds": int(rounds.shape[0]),
        "step_s": float(slowest.mean()),
        "sync_s": float(rounds[:, -1].mean()),
        "inner_s": float(rounds[:, :-1].mean()) if sync_every > 1 else math.nan,
    }


def run(config: dict, rank: int, n: int, out: Path | None) -> dict:
    """Every measurement of this job (process 0 writes them to ``out`` after each rate)."""
    cfg = LMConfig(**config["model"])
    mesh = jax.make_mesh((n,), (AXIS,))
    say = print if rank == 0 else (lambda *a, **k: None)
    host_params = init_params(cfg)
    result: dict = {"workers": n, "model": dataclasses.asdict(cfg), "methods": {}}
    result["parameters"] = int(sum(x.size for x in jax.tree.leaves(host_params)))
    result["leaves"] = len(jax.tree.leaves(host_params))
    sharding = jax.NamedSharding(mesh, P(AXIS))
    batches = [
        jax.make_array_from_process_local_data(sharding, make_tokens(cfg, rank, i))
        for i in range(BATCHES)
    ]
    result["compute"] = {"times": time_compute(cfg, host_params, rank, config["compute_steps"])}
    result["compute"]["step_s"] = step_seconds(result["compute"]["times"])
    say(f"[n={n}] compute alone: {1e3 * result['compute']['step_s']:.0f} ms/step", flush=True)

    trainers = {}
    by_key = {m.key: m for m in METHODS}
    for key in config["methods"]:
        method = by_key[key]
        try:
            trainer, info = build(method, cfg, host_params, mesh, batches)
        except TypeError as err:  # a keyword the library does not take yet
            result["methods"][key] = {"skipped": f"TypeError: {err}"}
            say(f"[n={n}] {method.label}: SKIPPED (TypeError: {err})", flush=True)
            continue
        for _ in range(config["warmup"] if method.sync_every is None else 0):
            trainer.step()
        trainers[key] = trainer
        result["methods"][key] = {**info, "rates": {}}
        say(f"[n={n}] compiled {method.label} in {info['compile_s']:.1f} s", flush=True)

    barrier("idle0")
    before = netns.read_tx_bytes() if rank == 0 else 0
    barrier("idle1")
    idle = netns.read_tx_bytes() - before if rank == 0 else 0
    result["idle_bytes"] = int(idle)
    installed = False
    for rate in config["rates"]:
        name = rate or "unlimited"
        if rank == 0:
            netns.run(netns.rate_command(rate, installed=installed))
            installed = rate is not None
        barrier(f"rate {name}")
        for key, trainer in trainers.items():
            r = measure(trainer, config["steps"][name], rank, idle, config["rounds"])
            result["methods"][key]["rates"][name] = r
            mb = r["tx_bytes"] / n / r["steps"] / 2**20
            say(
                f"[n={n}] {name:>9s}  {trainer.method.label:30s} {1e3 * r['step_s']:8.0f} ms/step"
                f"  {mb:8.2f} MiB/worker/step  loss {r['losses'][-1]:.3f}",
                flush=True,
            )
        if rank == 0 and out is not None:
            out.write_text(json.dumps(result))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.net.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="JSON: model, methods, rates, steps")
    parser.add_argument("--out", required=True, help="JSON result (written by process 0)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Join the loopback job and run every measurement."""
    args = parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    run_joined(
        args.port,
        args.num_processes,
        args.process_id,
        lambda: run(config, args.process_id, args.num_processes, Path(args.out)),
    )


if __name__ == "__main__":
    main()
