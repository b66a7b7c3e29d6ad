"""The workload of ``make bench-elastic``: a small character language model on real text.

* :data:`MODEL`: :mod:`experiments.common.lm`'s transformer, smaller than
  ``make bench-e2e``'s (2 layers of width 128 against 8 of 256: 0.43M
  parameters against 6.4M), so that four islands sharing this machine's two
  cores finish a scenario in minutes;
* :func:`rows`: train and validation windows of Python's documentation prose
  (``pydoc_data.topics``, split in text order, no download);
* :func:`make_batches`: ``batches(island, step)``, a deterministic draw of
  :data:`ROWS_PER_STEP` windows from ``(SEED, step, island)``, the same in the
  elastic and the lock-step runs;
* :data:`SETUP`: DiLoCo's optimizers and rounds, the same in every scenario.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax

from experiments.common import data, lm

MODEL = lm.LMConfig(vocab=len(data.CHARACTERS) + 1, width=128, layers=2, heads=4, length=64)
ROWS_PER_STEP = 8
VALIDATION_ROWS = 256
SEED = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """DiLoCo's configuration in every scenario."""

    islands: int = 4
    sync_every: int = 20
    rounds: int = 30
    inner_lr: float = 3e-3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def inner(self) -> optax.GradientTransformation:
        return optax.adamw(self.inner_lr)

    def outer(self) -> optax.GradientTransformation:
        return optax.sgd(self.outer_lr, momentum=self.outer_momentum, nesterov=True)


SETUP = Setup()


@functools.cache
def rows() -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` token rows ``(n, length + 1)`` (no overlap)."""
    dataset = data.characters(MODEL.length)

    def joined(split):
        return np.concatenate([split.x, split.y[:, -1:]], axis=1).astype(np.int32)

    return joined(dataset.train), joined(dataset.validation)[:VALIDATION_ROWS]


def batch(island: int, step: int) -> tuple[np.ndarray]:
    """Island ``island``'s rows at ``step``, as the one-element batch tuple ``loss_fn`` takes."""
    train, _ = rows()
    rng = np.random.default_rng([SEED, step, island])
    return (train[rng.integers(0, len(train), ROWS_PER_STEP)],)


def loss_fn(params, tokens) -> jax.Array:
    """Mean next-character cross-entropy of ``tokens`` (``(B, length + 1)``)."""
    return lm.loss_fn(params, tokens, MODEL.heads)


@functools.cache
def _validation():
    return jax.jit(lambda p: loss_fn(p, rows()[1]))


def validation_loss(params) -> float:
    """The loss on the :data:`VALIDATION_ROWS` validation windows."""
    return float(_validation()(params))


def init_params() -> dict:
    """The initial parameters (float32)."""
    return lm.init_params(MODEL, seed=SEED)
