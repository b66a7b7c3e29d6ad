"""The training tasks of the experiments: a dataset, a model, a batch size and defaults.

Every task is softmax cross-entropy on a flax model; a task's L2 term
``l2 / 2 ||params||^2`` is applied by the optimizer after the exchange
(``optax.add_decayed_weights``), the regulariser every worker knows, so only
the data term's gradient is compressed (as DIANA's proximal step does).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import data, models


@dataclasses.dataclass(frozen=True)
class Task:
    """A training problem.

    Attributes:
      name: the name ``--task`` selects.
      description: one line for tables.
      dataset: ``dataset(workers, seed) -> Dataset``.
      model: ``model(num_classes) -> flax module``.
      batch_size: examples per worker per step; ``None`` is full batch (each
        worker's whole shard every step).
      l2: the L2 coefficient (see the module docstring).
      lr: default learning rate.
      steps: default number of steps.
      convex: a linear model, whose optimum :func:`optimum` computes.
      momentum: default momentum of the SGD.
      eval_examples: evaluate on at most this many examples of each split (a
        fixed, evenly spaced subset); ``None`` evaluates on all of them.
    """

    name: str
    description: str
    dataset: Callable[[int, int], data.Dataset]
    model: Callable[[int], nn.Module]
    batch_size: int | None
    l2: float = 0.0
    lr: float = 0.1
    steps: int = 300
    convex: bool = False
    momentum: float = 0.0
    eval_examples: int | None = None


# Dense learning rates and step counts of the two larger tasks, tuned on their
# validation splits (see the task table of docs/experiments.md).
LR_WIDE, STEPS_WIDE = 0.2, 600
LR_CHAR, STEPS_CHAR = 0.1, 800


def _linear(num_classes: int) -> nn.Module:
    return models.MLP(features=(num_classes,))


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "logreg",
            "logistic regression, breast cancer (569 x 30), full batch",
            lambda workers, seed: data.breast_cancer(seed),
            _linear,
            batch_size=None,
            l2=1e-2,
            lr=0.5,
            steps=300,
            convex=True,
        ),
        Task(
            "logreg_sgd",
            "logistic regression, breast cancer, 16 examples per worker",
            lambda workers, seed: data.breast_cancer(seed),
            _linear,
            batch_size=16,
            l2=1e-2,
            lr=0.2,
            steps=300,
            convex=True,
        ),
        Task(
            "logreg_hetero",
            "logistic regression, synthetic data differing per worker (64 x 20 each), full batch",
            lambda workers, seed: data.heterogeneous_logistic(workers, seed=seed),
            _linear,
            batch_size=None,
            l2=1e-1,
            lr=0.5,
            steps=300,
            convex=True,
        ),
        Task(
            "digits_mlp",
            "MLP 64-64-10, scikit-learn digits, 16 examples per worker",
            lambda workers, seed: data.digits(seed),
            lambda c: models.MLP(features=(64, c)),
            batch_size=16,
            lr=0.1,
            steps=400,
        ),
        Task(
            "mnist1d_mlp",
            "MLP 40-128-128-10, MNIST-1D, 32 examples per worker",
            lambda workers, seed: data.mnist1d(),
            lambda c: models.MLP(features=(128, 128, c)),
            batch_size=32,
            lr=0.1,
            steps=1000,
        ),
        Task(
            "mnist1d_cnn",
            "1-D CNN (16, 32 channels), MNIST-1D, 32 examples per worker",
            lambda workers, seed: data.mnist1d(),
            lambda c: models.CNN1D(num_classes=c),
            batch_size=32,
            lr=0.05,
            steps=1000,
        ),
        Task(
            "mnist1d_wide",
            "1-D CNN (32, 64 channels, kernel 5) + dense 2560-512-10 (1.33M parameters, "
            "99.9% in kernels), MNIST-1D with 400 of the train signals held out for "
            "validation, 32 examples per worker, SGD momentum 0.9",
            lambda workers, seed: data.mnist1d(validation=400),
            lambda c: models.CNN1D(channels=(32, 64), strides=(1, 1), hidden=(512,), num_classes=c),
            batch_size=32,
            lr=LR_WIDE,
            momentum=0.9,
            steps=STEPS_WIDE,
            eval_examples=1000,
        ),
        Task(
            "char_lm",
            "character-level causal transformer (2 blocks, width 128) on Python's pydoc "
            "topics (80/10/10% train/validation/test), 64 characters, 4 sequences per "
            "worker, SGD momentum 0.9",
            lambda workers, seed: data.characters(),
            lambda c: models.CharTransformer(vocab=c),
            batch_size=4,
            lr=LR_CHAR,
            momentum=0.9,
            steps=STEPS_CHAR,
            eval_examples=256,
        ),
        Task(
            "transformer",
            "one-block transformer, majority token of 16 (vocab 8), 16 sequences per worker",
            lambda workers, seed: data.majority_tokens(seed=seed),
            lambda c: models.TinyTransformer(num_classes=c),
            batch_size=16,
            lr=0.1,
            steps=600,
        ),
    )
}


def get(name: str) -> Task:
    """The task called ``name``."""
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), TASKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}{hint}")
    return TASKS[name]


def loss_fn(module: nn.Module) -> Callable:
    """``loss(params, (x, y))``: mean cross-entropy of ``module`` on its 'params' collection."""

    def loss(params, batch):
        x, y = batch
        return models.cross_entropy(module.apply({"params": params}, x), y)

    return loss


def l2_term(params, l2: float) -> jax.Array:
    """``l2 / 2 ||params||^2``."""
    return 0.5 * l2 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))


def optimum(x: np.ndarray, y: np.ndarray, num_classes: int, l2: float, iters: int = 50):
    """Minimiser of mean cross-entropy + ``l2/2 ||(W, b)||^2`` for a linear softmax model.

    Newton's method in float64 (the objective is strongly convex for
    ``l2 > 0``).  Returns ``{"Dense_0": {"kernel": W, "bias": b}}`` (float64),
    the structure of ``models.MLP(features=(num_classes,))``'s params.
    """
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0 for a unique optimum, got {l2}")
    n, d = x.shape
    xt = np.concatenate([x.astype(np.float64), np.ones((n, 1))], axis=1)
    onehot = np.eye(num_classes)[y]
    theta = np.zeros((d + 1, num_classes))
    for _ in range(iters):
        z = xt @ theta
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        grad = xt.T @ (p - onehot) / n + l2 * theta
        cov = np.einsum("nc,ce->nce", p, np.eye(num_classes)) - np.einsum("nc,ne->nce", p, p)
        hess = np.einsum("na,nb,nce->acbe", xt, xt, cov) / n
        size = (d + 1) * num_classes
        hess = hess.reshape(size, size) + l2 * np.eye(size)
        step = np.linalg.solve(hess, grad.reshape(-1)).reshape(theta.shape)
        theta -= step
        if np.max(np.abs(step)) < 1e-14:
            break
    return {"Dense_0": {"kernel": theta[:d], "bias": theta[d]}}
