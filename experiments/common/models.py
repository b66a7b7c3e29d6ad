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
    """A 1-D convolutional network for signals ``(batch, length)``.

    ReLU convolutions of ``channels`` (``'SAME'`` padding; the first with
    stride 1, the others with stride 2 unless ``strides`` says), flattened,
    then ReLU dense layers of ``hidden`` widths and the logits.
    """

    channels: Sequence[int] = (16, 32)
    kernel_size: int = 5
    num_classes: int = 10
    hidden: Sequence[int] = ()
    strides: Sequence[int] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x[..., None]
        for i, width in enumerate(self.channels):
            stride = 1 + (i > 0) if self.strides is None else self.strides[i]
            x = nn.relu(nn.Conv(width, (self.kernel_size,), strides=(stride,))(x))
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


def _block(x: jax.Array, heads: int, hidden: int, mask: jax.Array | None = None) -> jax.Array:
    """A pre-norm transformer block (self-attention, then a GELU MLP of ``hidden``), made
    inside the calling module's ``nn.compact`` method (its layers are that module's)."""
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(y, y, mask=mask)
    y = nn.LayerNorm()(x)
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(hidden)(y)))


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
        x = _block(x, self.heads, 2 * self.width)
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x).mean(axis=1))


class CharTransformer(nn.Module):
    """A causal pre-norm transformer language model: next-token logits at every position.

    Token and learned position embeddings, ``blocks`` blocks of causal
    multi-head self-attention and a GELU MLP (``4 * width``), a final
    LayerNorm and a dense layer to ``vocab`` logits: ``(batch, length, vocab)``.
    """

    vocab: int = 101
    length: int = 64
    width: int = 128
    heads: int = 4
    blocks: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (self.length, self.width))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.blocks):
            x = _block(x, self.heads, 4 * self.width, mask)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))
