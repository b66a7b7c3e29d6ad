"""Small flax models and their losses."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLP(nn.Module):
    """Fully connected ReLU network; ``features`` are the layer widths, the last the logits."""

    features: Sequence[int] = (64, 10)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.features[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.features[-1])(x)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of ``logits`` against integer ``labels``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of rows whose largest logit is at the label."""
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)
