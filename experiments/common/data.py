"""Datasets as in-memory numpy arrays: standardised float32 features, int32 labels."""

from __future__ import annotations

import dataclasses
import functools
import string

import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split


@dataclasses.dataclass(frozen=True)
class Split:
    """Features ``x`` of shape ``(n, features)`` and labels ``y`` of shape ``(n,)``."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A train/test pair of splits, the number of classes and how to deal the train split.

    ``partition`` is ``"shuffle"`` (i.i.d. worker shards) or ``"contiguous"``
    (the train split is ordered by worker; see :func:`worker_shards`).
    ``validation``, where a dataset has one, is held out of ``train`` for
    tuning hyperparameters, so that the test split is never used for it.
    """

    train: Split
    test: Split
    num_classes: int
    partition: str = "shuffle"
    validation: Split | None = None


def _standardise(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale both to zero mean and unit variance per feature, with the train statistics.

    Constant features (the border pixels of digits) are centred but not scaled.
    """
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return ((train - mean) / std).astype(np.float32), ((test - mean) / std).astype(np.float32)


def digits(seed: int = 0, test_size: float = 0.25) -> Dataset:
    """scikit-learn's 8x8 handwritten digits: 1797 images, 64 features, 10 classes.

    Args:
      seed: seed of the stratified train/test split.
      test_size: fraction of the images held out for testing.
    """
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y
    )
    x_train, x_test = _standardise(x_train, x_test)
    return Dataset(
        train=Split(x_train, y_train.astype(np.int32)),
        test=Split(x_test, y_test.astype(np.int32)),
        num_classes=10,
    )


def breast_cancer(seed: int = 0, test_size: float = 0.25) -> Dataset:
    """scikit-learn's Wisconsin breast-cancer set: 569 examples, 30 features, 2 classes."""
    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y
    )
    x_train, x_test = _standardise(x_train, x_test)
    return Dataset(
        train=Split(x_train, y_train.astype(np.int32)),
        test=Split(x_test, y_test.astype(np.int32)),
        num_classes=2,
    )


def heterogeneous_logistic(
    workers: int, per_worker: int = 64, features: int = 20, seed: int = 0
) -> Dataset:
    """A synthetic binary problem where every worker holds differently distributed data.

    Worker ``i`` draws its features from ``N(mu_i, I)`` with its own mean
    ``mu_i`` (norm 2) and labels from its own logistic model ``w + w_i``
    (``w_i`` of norm 1.5 around a shared ``w``): the local optima differ, so
    the local gradients at the global optimum do not vanish (the setting
    where compressed gradient descent stalls and DIANA does not).  The train
    split is ordered by worker (``partition="contiguous"``); the test split
    draws from all workers equally.
    """
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=features)
    shared *= 2.0 / np.linalg.norm(shared)

    def unit(v):
        return v / np.linalg.norm(v)

    def draw(count, mean, weights):
        x = rng.normal(size=(count, features)) + mean
        p = 1.0 / (1.0 + np.exp(-x @ weights))
        return x.astype(np.float32), (rng.uniform(size=count) < p).astype(np.int32)

    parts = [
        (2.0 * unit(rng.normal(size=features)), shared + 1.5 * unit(rng.normal(size=features)))
        for _ in range(workers)
    ]
    train = [draw(per_worker, mean, w) for mean, w in parts]
    test = [draw(max(per_worker // 4, 1), mean, w) for mean, w in parts]
    return Dataset(
        train=Split(np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])),
        test=Split(np.concatenate([x for x, _ in test]), np.concatenate([y for _, y in test])),
        num_classes=2,
        partition="contiguous",
    )


@functools.lru_cache(maxsize=4)
def mnist1d(seed: int = 42, validation: int = 0) -> Dataset:
    """MNIST-1D (Greydanus 2020) generated locally: 4000/1000 signals of length 40, 10 classes.

    ``mnist1d.data.make_dataset`` builds it from templates (no download);
    the signals are standardised with the train statistics.

    Args:
      seed: the generator's seed.
      validation: how many of the 4000 training signals to hold out (the
        last ones of a permutation seeded by ``seed``) as the validation
        split; the test split is the same whatever this is.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    data = make_dataset(args)
    x, y = np.asarray(data["x"]), np.asarray(data["y"], np.int32)
    if not 0 <= validation < len(y):
        raise ValueError(f"validation must be in [0, {len(y)}), got {validation}")
    order = np.random.default_rng(seed).permutation(len(y)) if validation else np.arange(len(y))
    keep, held = order[: len(y) - validation], order[len(y) - validation :]
    x_train, x_rest = _standardise(x[keep], np.concatenate([x[held], np.asarray(data["x_test"])]))
    return Dataset(
        train=Split(x_train, y[keep]),
        test=Split(x_rest[validation:], np.asarray(data["y_test"], np.int32)),
        num_classes=10,
        validation=Split(x_rest[:validation], y[held]) if validation else None,
    )


#: The characters of :func:`characters`' vocabulary; any other is the unknown token.
CHARACTERS = string.printable


def pydoc_text() -> str:
    """The prose of Python's own documentation, shipped with the interpreter (no download).

    ``pydoc_data.topics.topics`` maps the names of ``help()``'s topics to
    their text (about 465,000 characters in Python 3.12); they are joined in
    sorted-key order.
    """
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def encode(text: str) -> np.ndarray:
    """int32 codes of ``text``: the index in :data:`CHARACTERS`, or ``len(CHARACTERS)``."""
    table = np.full(0x110000, len(CHARACTERS), np.int32)
    table[[ord(c) for c in CHARACTERS]] = np.arange(len(CHARACTERS))
    return table[np.frombuffer(text.encode("utf-32-le"), np.uint32)]


@functools.lru_cache(maxsize=2)
def characters(length: int = 64, held_out: float = 0.1) -> Dataset:
    """Next-character prediction on :func:`pydoc_text`: a character-level language model.

    The text is cut in order into train, validation (the ``held_out``
    fraction before the last) and test (the last ``held_out`` fraction), so
    no character of one part is in another; each part is cut into
    non-overlapping windows of ``length + 1`` characters whose first
    ``length`` are ``x`` and last ``length`` are ``y`` (the next character at
    every position), both ``(n, length)`` int32 codes of :func:`encode`:
    the printable ASCII characters and an unknown token (101 classes).
    Deterministic: the same text gives the same splits.
    """
    codes = encode(pydoc_text())
    cut = round(len(codes) * held_out)
    parts = codes[: len(codes) - 2 * cut], codes[len(codes) - 2 * cut : len(codes) - cut]
    parts += (codes[len(codes) - cut :],)

    def windows(part: np.ndarray) -> Split:
        n = (len(part) - 1) // length
        x = part[: n * length].reshape(n, length)
        y = part[1 : n * length + 1].reshape(n, length)
        return Split(x, y)

    train, validation, test = (windows(p) for p in parts)
    return Dataset(train=train, test=test, num_classes=len(CHARACTERS) + 1, validation=validation)


def majority_tokens(
    train: int = 4096, test: int = 1024, length: int = 16, vocab: int = 8, seed: int = 0
) -> Dataset:
    """A sequence task: name the token that occurs most often (ties to the smallest token).

    Each sequence is ``length`` tokens from ``vocab`` symbols with one symbol
    favoured (drawn with three times the weight of each other), so every
    answer needs the whole sequence: a task for attention.  ``x`` holds int32
    tokens ``(n, length)``.
    """
    rng = np.random.default_rng(seed)

    def draw(count):
        favourite = rng.integers(vocab, size=count)
        weights = np.ones((count, vocab))
        weights[np.arange(count), favourite] = 3.0
        weights /= weights.sum(axis=1, keepdims=True)
        cum = np.cumsum(weights, axis=1)
        u = rng.uniform(size=(count, length, 1))
        tokens = np.minimum((u > cum[:, None, :]).sum(axis=-1), vocab - 1).astype(np.int32)
        counts = np.stack([(tokens == v).sum(axis=1) for v in range(vocab)], axis=1)
        return Split(tokens, counts.argmax(axis=1).astype(np.int32))

    return Dataset(train=draw(train), test=draw(test), num_classes=vocab)


def _dealt(count: int, workers: int, partition: str, seed: int) -> np.ndarray:
    """The indices :func:`worker_shards` deals, worker by worker: the first ``workers * m``."""
    if partition not in ("shuffle", "contiguous"):
        raise ValueError(f"partition must be 'shuffle' or 'contiguous', got {partition!r}")
    m = count // workers
    if m == 0:
        raise ValueError(f"workers={workers} exceeds the {count} training examples")
    order = np.arange(count)
    if partition == "shuffle":
        order = np.random.default_rng(seed).permutation(count)
    return order[: m * workers]


def worker_shards(split: Split, workers: int, partition: str, seed: int = 0):
    """Split the examples among ``workers`` equally: ``(workers, m, ...)`` features and labels.

    ``partition="shuffle"`` deals a seeded permutation (i.i.d. shards);
    ``"contiguous"`` gives worker ``i`` the ``i``-th block (data generated
    per worker).  ``m = len(split) // workers``; the remainder (the
    :func:`dropped_examples`) is left out, so that every worker's shard has
    the same size.
    """
    order = _dealt(len(split), workers, partition, seed)
    x = split.x[order].reshape(workers, -1, *split.x.shape[1:])
    y = split.y[order].reshape(workers, -1, *split.y.shape[1:])
    return x, y


def dropped_examples(split: Split, workers: int, partition: str, seed: int = 0) -> np.ndarray:
    """The sorted indices of ``split`` that :func:`worker_shards` leaves out (``len % workers``)."""
    kept = _dealt(len(split), workers, partition, seed)
    return np.setdiff1d(np.arange(len(split)), kept)
