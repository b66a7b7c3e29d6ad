"""Elastic DiLoCo on Ray: four islands train a digits classifier; one dies and comes back.

Each island is an independent JAX program (a Ray actor) taking AdamW steps on its own
shard of scikit-learn's bundled digits; every ``--sync-every`` steps it pushes its int8
pseudo-gradient to the synchronizer, which merges a quorum of three (median-norm clipped,
weighted by the steps behind each) and steps the global parameters with Nesterov momentum.
Island 2 is killed at round 2 and restarted at round 4: it heals from the synchronizer and
rejoins.  Run it as::

    python examples/elastic/islands.py                 # a local Ray instance
    python examples/elastic/islands.py --rounds 3      # a quick check that it runs
    python examples/elastic/islands.py --address ray://HEAD:10001   # a Ray cluster

(On a machine whose policy keeps Ray on loopback, start it inside a network namespace:
``ip netns exec NS python examples/elastic/islands.py``.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import compjax
import compjax.elastic as ce

ISLANDS = 4
X, Y = load_digits(return_X_y=True)
X = (X / 16.0).astype(np.float32)
Y = Y.astype(np.int32)
TRAIN, VALID = slice(0, 1500), slice(1500, None)


def init(key, sizes=(64, 64, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(island: int, step: int):
    """Island ``island``'s batch of 32 at ``step``: a deterministic draw from its own shard."""
    shard = np.arange(TRAIN.start + island, TRAIN.stop, ISLANDS)
    rows = np.random.default_rng([island, step]).choice(shard, 32, replace=False)
    return X[rows], Y[rows]


def validation_loss(params) -> float:
    return float(loss_fn(params, X[VALID], Y[VALID]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="outer rounds (12)")
    parser.add_argument("--sync-every", type=int, default=20, help="H, steps per round (20)")
    parser.add_argument("--address", default=None, help="a Ray cluster (default: local)")
    args = parser.parse_args()
    faults = (ce.Kill(2, at_round=2, restart_at_round=4),) if args.rounds > 4 else ()
    params = init(jax.random.key(0))
    result = ce.train(
        loss_fn, params, batches,
        inner=optax.adamw(3e-3), outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        sync_every=args.sync_every, rounds=args.rounds, islands=ISLANDS,
        compressor=compjax.int_quant(8), min_quorum=ISLANDS - 1, merge="median_norm_clip",
        faults=faults, evaluate=validation_loss, address=args.address,
    )  # fmt: skip
    for r in result.history:
        print(
            f"round {r.round}: merged {list(r.merged)} late {list(r.late)} "
            f"validation loss {r.evaluation:.4f}, {r.bits:,} bits in, {r.wall_s:.1f} s"
        )
    dense = 32 * sum(a.size for a in jax.tree.leaves(params)) * ISLANDS
    print(f"final validation loss {validation_loss(result.params):.4f}; a round's pushes "
          f"{result.history[-1].bits:,} bits against {dense:,} bits in float32")  # fmt: skip


if __name__ == "__main__":
    main()
