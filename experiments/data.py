"""Datasets as in-memory numpy arrays: standardised float32 features, int32 labels."""

from __future__ import annotations

import dataclasses

import numpy as np
from sklearn.datasets import load_digits
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
    """A train/test pair of splits with the number of classes."""

    train: Split
    test: Split
    num_classes: int


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
