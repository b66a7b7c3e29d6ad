"""A Flax NNX MLP trained with sharded parameters and optimizer state (``compjax.fsdp``),
gradients reduce-scattered as scaled signs with error feedback, weights gathered as int8.

``compjax.fsdp`` takes a pure ``loss_fn(params, *batch)`` over a pytree of parameters: here
the ``nnx.Param`` state of ``nnx.split``, merged back into a model inside the loss.  After
training, ``nnx.update`` writes the trained parameters into the model, which is then evaluated
as an ordinary NNX module.  The task: learn the labels a fixed random "teacher" network gives to
Gaussian inputs (made here: nothing is downloaded).  Every device is a worker and keeps ``1/n``
of every large kernel and of its Adam moments; on a CPU this script asks XLA for 8 simulated
devices.  Run it as::

    python examples/fsdp_nnx.py              # 200 steps
    python examples/fsdp_nnx.py --steps 5    # a quick check that it runs
"""

import os

# Simulated CPU devices must be requested before jax is imported (GPUs and TPUs are used as
# they are).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import compjax

FEATURES = 64  # input size
CLASSES = 10
PER_WORKER = 32  # examples per worker per step


class MLP(nnx.Module):
    """Two hidden ReLU layers and the class logits."""

    def __init__(self, rngs: nnx.Rngs, width: int = 256):
        self.hidden1 = nnx.Linear(FEATURES, width, rngs=rngs)
        self.hidden2 = nnx.Linear(width, width, rngs=rngs)
        self.out = nnx.Linear(width, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.out(x)


def teacher_batch(rng: np.random.Generator, teacher: np.ndarray, size: int):
    """``size`` Gaussian inputs and the class a fixed random linear-tanh teacher gives each."""
    x = rng.standard_normal((size, FEATURES)).astype(np.float32)
    return x, np.argmax(np.tanh(x @ teacher[0]) @ teacher[1], axis=1).astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (200)")
    args = parser.parse_args()

    workers = jax.device_count()
    mesh = jax.make_mesh((workers,), ("data",))
    model = MLP(nnx.Rngs(0))
    # The trainable parameters, a pytree (nnx.State) that compjax.fsdp shards.  `rest` is any
    # other state (none in this MLP): the loss reads it as a constant, and fsdp's step returns
    # no updates of it (batch statistics, RNG counts would stay as they are here).
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, x, y):  # this worker's own mean loss: no pmean inside
        logits = nnx.merge(graphdef, params, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # The kernels (64x256, 256x256, 256x10 entries: at least 2,560 each) are split over "data";
    # the biases (fewer than min_size entries) stay replicated and are averaged exactly.
    # Gradients: EF-signSGD's scaled sign, ||x||_1 / d * sign(x), 1 bit per entry and a float32
    # scale per block, each worker keeping what the sign lost in its error memory; every owner
    # receives the mean of the workers' scaled signs of its shard.  Weights: blockwise int8.
    fs = compjax.fsdp(
        loss_fn,
        optax.adam(3e-3),
        params,
        mesh,
        compressor=compjax.scaled_sign(),
        feedback="ef",
        gather="int8",
        min_size=1024,
    )
    state = fs.init(params)
    # fs.param_specs is an nnx.State of Params holding PartitionSpecs; printed as a plain dict.
    for path, spec in jax.tree.leaves_with_path(nnx.to_pure_dict(fs.param_specs)):
        print(f"{jax.tree_util.keystr(path)}: {spec}")

    report = compjax.communication(fs, params, mesh=mesh)
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"{count:,} parameters, {workers} workers; per step each worker sends")
    print(
        f"{report.gather_bits:,.0f} bits gathering weights + {report.gradient_bits:,.0f} bits "
        f"of gradients ({report.dense_bits / report.bits_per_worker:.1f}x fewer than dense FSDP)"
    )

    rng = np.random.default_rng(0)
    teacher = (
        rng.standard_normal((FEATURES, 32)).astype(np.float32) / np.sqrt(FEATURES),
        rng.standard_normal((32, CLASSES)).astype(np.float32),
    )
    for step in range(1, args.steps + 1):
        x, y = teacher_batch(rng, teacher, workers * PER_WORKER)  # split over "data" by step
        params, state, loss = fs.step(params, state, x, y)
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: loss {float(loss):.3f}")

    # The trained parameters, gathered and replicated, back in the model's Variables.
    nnx.update(model, jax.device_put(fs.unpad(params), jax.NamedSharding(mesh, jax.P())))
    x, y = teacher_batch(rng, teacher, 4096)
    accuracy = np.mean(np.argmax(model(x), axis=1) == y)
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")


if __name__ == "__main__":
    main()
