"""A flax.linen MLP trained with sharded parameters and optimizer state (``compjax.fsdp``),
gradients reduce-scattered as 4-bit integers with error feedback, weights gathered as int8.

The task: learn the labels a fixed random "teacher" network gives to Gaussian inputs (made
here: nothing is downloaded).  Every device is a worker and keeps ``1/n`` of every large
kernel and of its Adam moments; on a CPU this script asks XLA for 8 simulated devices.  Run
it as::

    python examples/fsdp_linen.py              # 200 steps
    python examples/fsdp_linen.py --steps 5    # a quick check that it runs
"""

import os

# Simulated CPU devices must be requested before jax is imported (GPUs and TPUs are used as
# they are).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import compjax

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
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]

    def loss_fn(params, x, y):  # this worker's own mean loss: no pmean inside
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # The kernels (64x256, 256x256, 256x10 entries: at least 2,560 each) are split over "data";
    # the biases (fewer than min_size entries) stay replicated and are averaged exactly.
    # Gradients: int_quant(4), one shared scale, 4-bit codes summed as integers in the
    # reduce-scatter, with an error memory per worker; weights: blockwise int8 in the gather.
    fs = compjax.fsdp(
        loss_fn,
        optax.adam(3e-3),
        params,
        mesh,
        compressor=compjax.int_quant(4),
        feedback="ef",
        gather="int8",
        min_size=1024,
    )
    state = fs.init(params)
    for path, spec in jax.tree.leaves_with_path(fs.param_specs, is_leaf=lambda s: s == jax.P()):
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
    x, y = teacher_batch(rng, teacher, 4096)
    whole = jax.device_put(fs.unpad(params), jax.NamedSharding(mesh, jax.P()))  # replicated
    accuracy = np.mean(np.argmax(model.apply({"params": whole}, x), axis=1) == y)
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")


if __name__ == "__main__":
    main()
