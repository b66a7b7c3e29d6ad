"""A character-level language model (flax.linen) trained data-parallel under ``jax.shard_map``,
each worker's gradient sent top-1% sparsified with error feedback.

The text is the prose of Python's own documentation (``pydoc_data``, shipped with the
interpreter: nothing is downloaded).  Every device is a worker: on a CPU this script asks XLA
for 8 simulated devices.  Run it as::

    python examples/linen_lm.py              # 300 steps
    python examples/linen_lm.py --steps 5    # a quick check that it runs
"""

import os

# Simulated CPU devices must be requested before jax is imported (GPUs and TPUs are used as
# they are).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
from functools import partial
from pydoc_data.topics import topics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import compjax

P = jax.P
VOCAB = 128  # ASCII; other characters become "?"
LENGTH = 64  # characters per training sequence
PER_WORKER = 4  # sequences per worker per step


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class CharLM(nn.Module):
    """Token and position embeddings, ``depth`` blocks, and the next character's logits."""

    width: int = 64
    heads: int = 4
    depth: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.width)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (LENGTH, self.width))
        for _ in range(self.depth):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def text_codes() -> np.ndarray:
    """The pydoc topics as ASCII codes (about 465,000 characters)."""
    text = "".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("ascii", errors="replace"), np.uint8).astype(np.int32)


def batch(codes: np.ndarray, rng: np.random.Generator, size: int) -> tuple[np.ndarray, ...]:
    """``size`` random windows: the characters, and the next character at every position."""
    starts = rng.integers(0, len(codes) - LENGTH - 1, size)
    windows = np.stack([codes[s : s + LENGTH + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (300)")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k fraction sent (0.01)")
    args = parser.parse_args()

    workers = jax.device_count()
    mesh = jax.make_mesh((workers,), ("data",))
    model = CharLM()
    params = model.init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32))["params"]
    params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated on every worker

    # Error feedback around top-k: each worker sends the largest 1% of the entries of its whole
    # gradient (flatten=True: the tree as one vector; int32 index + float32 value each) and keeps
    # the rest in its own error memory for the next steps; Adam then acts on the mean of the
    # decoded messages.
    opt = optax.chain(
        compjax.error_feedback(compjax.top_k(ratio=args.ratio), "data", flatten=True),
        optax.adam(3e-3),
    )
    # Per-worker state (the error memories) is split over "data"; the rest is replicated.
    specs = compjax.state_specs(jax.eval_shape(opt.init, params), "data")
    opt_state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def loss_fn(params, x, y):  # this worker's own loss: no pmean inside
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P(), specs, P()),
    )
    def train_step(params, opt_state, x, y):
        # The gradient of this worker's copy of the params: its own, not the sum over workers.
        local = compjax.worker_params(params, "data")
        loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)  # the compressed exchange
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    report = compjax.communication(opt, params, "data", mesh=mesh)
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"{count:,} parameters, {workers} workers; per step each worker sends")
    print(f"{report.bits_per_worker:,.0f} bits ({report.compression_ratio:.0f}x fewer than dense)")

    codes, rng = text_codes(), np.random.default_rng(0)
    data = NamedSharding(mesh, P("data"))
    for step in range(1, args.steps + 1):
        x, y = (jax.device_put(a, data) for a in batch(codes, rng, workers * PER_WORKER))
        params, opt_state, loss = train_step(params, opt_state, x, y)
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: loss {float(loss):.3f} ({float(loss) / np.log(2):.2f} bits/char)")


if __name__ == "__main__":
    main()
