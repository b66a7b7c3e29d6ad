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


class CNN1D(nn.Module):
    """A small 1-D convolutional network for signals ``(batch, length)``."""

    channels: Sequence[int] = (16, 32)
    kernel_size: int = 5
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x[..., None]
        for i, width in enumerate(self.channels):
            x = nn.relu(nn.Conv(width, (self.kernel_size,), strides=(1 + (i > 0),))(x))
        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


class TinyTransformer(nn.Module):
    """One pre-norm transformer block over token sequences, mean-pooled into logits."""

    vocab: int = 8
    length: int = 16
    width: int = 32
    heads: int = 2
    num_classes: int = 8

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.length, self.width))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
        y = nn.LayerNorm()(x)
        x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(y)))
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x).mean(axis=1))
