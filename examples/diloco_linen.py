"""A flax.linen MLP trained with DiLoCo on 4 workers: local AdamW steps on each worker's own
copy of the parameters, and once a round an outer Nesterov step on the mean of the workers'
pseudo-gradients, sent as 8-bit integers (``compjax.diloco`` with ``compjax.int_quant(8)``).

The task: learn the labels a fixed random "teacher" network gives to Gaussian inputs (made
here: nothing is downloaded); every worker draws its own examples.  ``compjax.local_steps``
builds the jitted step over the per-worker copies.  On a CPU this script asks XLA for 4
simulated devices.  Run it as::

    python examples/diloco_linen.py                      # 300 steps in rounds of 25
    python examples/diloco_linen.py --sync-every 50      # fewer, larger rounds
    python examples/diloco_linen.py --steps 5            # a quick check that it runs
"""

import os

# Simulated CPU devices must be requested before jax is imported (GPUs and TPUs are used as
# they are).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax

WORKERS = 4
FEATURES = 64  # input size
CLASSES = 10
PER_WORKER = 32  # examples per worker per step


class MLP(nn.Module):
    """Two hidden ReLU layers and the class logits."""

    width: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(CLASSES)(x)


def teacher_batch(rng: np.random.Generator, teacher: tuple, size: int):
    """``size`` Gaussian inputs and the class a fixed random linear-tanh teacher gives each."""
    x = rng.standard_normal((size, FEATURES)).astype(np.float32)
    return x, np.argmax(np.tanh(x @ teacher[0]) @ teacher[1], axis=1).astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument("--sync-every", type=int, default=25, help="H, steps per round (25)")
    args = parser.parse_args()

    workers = min(WORKERS, jax.device_count())
    mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]

    def loss_fn(params, x, y):  # this worker's own mean loss: no pmean inside
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    h = min(args.sync_every, args.steps)  # a run shorter than a round still synchronises
    opt = compjax.diloco(
        inner=optax.adamw(2e-3, weight_decay=1e-4),
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True),  # the paper's outer step
        sync_every=h,
        axis_name="data",
        compressor=compjax.int_quant(bits=8),  # int8 pseudo-gradients, summed as integers
    )
    train = compjax.local_steps(loss_fn, opt, params, mesh)
    local, state = train.init(params)  # each worker's copy, and the global params in the state

    # communication() traces a synchronising step: the pseudo-gradients and the one-byte
    # non-finite flag that every step all-reduces; the other H - 1 steps send the flag alone.
    report = compjax.communication(opt, params, "data", num_workers=workers)
    flag = sum(bits for kind, bits in report.messages if kind == "flag")
    per_round = report.bits_per_worker + (h - 1) * flag
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"{count:,} parameters, {workers} workers, rounds of {h} steps; each worker sends")
    print(
        f"{per_round:,.0f} bits per round ({per_round / h:,.0f} bits per step, "
        f"{h * report.dense_bits / per_round:,.0f}x fewer than a dense all-reduce every step)"
    )

    rng = np.random.default_rng(0)
    teacher = (
        rng.standard_normal((FEATURES, 32)).astype(np.float32) / np.sqrt(FEATURES),
        rng.standard_normal((32, CLASSES)).astype(np.float32),
    )
    held_out = teacher_batch(rng, teacher, 4096)
    evaluate = jax.jit(loss_fn)
    for step in range(1, args.steps + 1):
        x, y = teacher_batch(rng, teacher, workers * PER_WORKER)  # split over "data" by step
        local, state, loss = train.step(local, state, x, y)
        if step % h == 0 or step == args.steps:
            line = f"step {step}: loss {float(loss):.3f} (the workers' mean)"
            if step % h == 0:  # a round ended: every worker restarts from the new global params
                held = float(evaluate(compjax.global_params(state), *held_out))
                line += f"; round {step // h}: held-out loss {held:.3f}"
            print(line)
    theta = compjax.global_params(state)  # the last round's: evaluate or export these
    x, y = held_out
    accuracy = np.mean(np.argmax(model.apply({"params": theta}, x), axis=1) == y)
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")


if __name__ == "__main__":
    main()
