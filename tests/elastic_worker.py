"""Runs :func:`compjax.elastic.train` scenarios on one Ray instance, for ``test_elastic.py``.

``python tests/elastic_worker.py OUT NAME...`` (inside a network namespace: Ray is started on
127.0.0.1) runs each named scenario of :data:`SCENARIOS` and writes ``OUT/NAME.json``: the
history, the final parameters (as lists) and their validation loss, or the error raised.  The
problem (:func:`loss_fn`, :func:`batches`, :data:`PARAMS`, :data:`KW`) is imported by the test
for its in-process reference.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax
import compjax.elastic as ce

#: A linear-in-features regression through one tanh layer: 8 -> 16 -> 1.
TEACHER = np.random.default_rng(0).normal(size=(8, 1)).astype(np.float32)
PARAMS = {
    "w1": (np.random.default_rng(1).normal(size=(8, 16)) / np.sqrt(8)).astype(np.float32),
    "b1": np.zeros((16,), np.float32),
    "w2": (np.random.default_rng(2).normal(size=(16, 1)) / 4).astype(np.float32),
}
ISLANDS, H, ROUNDS = 3, 4, 24
KW = dict(
    inner=optax.adam(1e-2),
    outer=optax.sgd(0.7, momentum=0.5, nesterov=True),
    sync_every=H,
    rounds=ROUNDS,
    islands=ISLANDS,
    progress=False,
    timeout_s=60.0,
)


def loss_fn(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def sample(seed, rows):
    x = np.random.default_rng(seed).normal(size=(rows, 8)).astype(np.float32)
    return x, np.tanh(x @ TEACHER / 2)


def batches(island, step):
    return sample([island, step], 16)


VALIDATION = sample([99], 512)


def validation_loss(params) -> float:
    return float(loss_fn(params, *VALIDATION))


def raising_batches(island, step):
    if island == 1 and step == 5:
        raise KeyError("no such shard")
    return batches(island, step)


def slow_batches(island, step):
    time.sleep(0.3)  # rounds of 1.2 s: 21 after the restart, for its process start and compile
    return batches(island, step)


SCENARIOS = {
    "clean": dict(),
    "clean_2dev": dict(island_devices=2),
    "fsdp_2dev": dict(island_devices=2, island_step="fsdp"),
    "kill_sync": dict(faults=(ce.KillSynchronizer(2),)),
    "kill_restart": dict(
        batches=slow_batches,
        rounds=24,
        min_quorum=ISLANDS - 1,
        grace_s=2.0,
        faults=(ce.Kill(1, at_round=2, restart_at_round=3),),
    ),
    "poison_mean": dict(faults=(ce.Poison(0, scale=1e3),)),
    "poison_clip": dict(merge="median_norm_clip", faults=(ce.Poison(0, scale=1e3),)),
    "nan_push": dict(faults=(ce.Poison(2, scale=float("nan"), from_round=1),)),
    "int8": dict(compressor=compjax.int_quant(8), merge="trimmed_mean", trim=0.34),
    "raises": dict(batches=raising_batches),
    "stuck": dict(timeout_s=6.0, faults=(ce.Kill(1, at_round=1),)),
}


def run(name: str, out: Path) -> None:
    kw = {**KW, "batches": batches, **SCENARIOS[name]}
    fn = kw.pop("batches")
    start = time.perf_counter()
    try:
        result = ce.train(loss_fn, PARAMS, fn, **kw)
    except Exception as err:  # the scenario's expected failure, checked by the test
        record = {"error": type(err).__name__, "message": str(err),
                  "trace": traceback.format_exc()}  # fmt: skip
    else:
        record = {
            "history": [r._asdict() for r in result.history],
            "params": jax.tree.map(lambda a: np.asarray(a).tolist(), result.params),
            "validation": validation_loss(result.params),
            "islands": result.islands,
        }
    record["seconds"] = time.perf_counter() - start
    (out / f"{name}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> None:
    import ray

    out = Path(argv[0])
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=8,
             log_to_driver=False)  # fmt: skip
    try:
        for name in argv[1:]:
            run(name, out)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
