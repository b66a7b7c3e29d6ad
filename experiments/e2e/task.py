"""The workload of ``make bench-e2e``: a character language model on real text, and its methods.

* :data:`MODEL`: :mod:`experiments.common.lm`'s transformer at a
  vocabulary of 101 characters (:func:`experiments.common.data.characters`):
  6,363,904 parameters, so that at 1 Gbit/s with 4 processes a dense
  float32 step spends most of its time on the wire;
* :func:`rows`: the train and validation windows of Python's own
  documentation prose (``pydoc_data.topics``, 80/10/10 split in text order,
  no download), as ``(n, length + 1)`` int32 token rows;
* :func:`batch_rows`: the rows worker ``w`` trains on at step ``t``: a
  deterministic draw from ``(seed, step, worker)``, so that a simulated run
  and a run across processes see the same batches (and take the same steps, up to the
  order in which their collectives sum floats);
* :data:`METHODS`: the methods raced to the target, each an exchange
  (:mod:`experiments.common.methods` expression, or the bf16 baseline of
  bench-net) followed by its optimizer, and DiLoCo (inner AdamW, outer
  Nesterov every ``H = 50`` steps, exact or int8 pseudo-gradients) and
  SparseLoCo (inner AdamW, ``H = 15``, chunked top-k 2-bit pseudo-gradients); the
  learning rate comes from the committed sweep (:data:`SWEEP_FILE`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import optax

import compjax
from experiments.common import data, lm
from experiments.common.lm import B, BenchMethod, LMConfig

#: The model: bench-net's transformer over characters, 2 sequences of 64 per worker and step.
MODEL = LMConfig(vocab=len(data.CHARACTERS) + 1, width=256, layers=8, heads=4, length=64)
#: Validation windows evaluated every ``eval_every`` steps (split over the workers).
VALIDATION_ROWS = 256
HERE = Path(__file__).resolve().parent
#: The committed learning-rate sweep and target (``python -m experiments.e2e.run --sweep``).
SWEEP_FILE = HERE / "sweep.json"


@dataclasses.dataclass(frozen=True)
class E2EMethod:
    """A method raced to the target.

    Attributes:
      bench: the exchange, as bench-net times it (its ``key``, ``label``, ``spec``).
      optimizer: ``"adam"`` (``optax.adam(lr)`` after the exchange), ``"sgd"``
        (``optax.sgd(lr)``: the exchange's output is already the direction) or
        ``"diloco"`` (local steps: :func:`local_optimizer`).
      lrs: the learning rates the sweep tries (DiLoCo's: the inner AdamW's).
      sync_every: DiLoCo's ``H`` (local-step methods only).
      outer_compressor: the compressor of DiLoCo's pseudo-gradients (``None``: exact).
      outer: the local-steps method: ``"diloco"`` (outer Nesterov) or ``"sparseloco"``
        (:func:`compjax.sparseloco`'s chunked top-k pseudo-gradients with error feedback).
      warmup: steps before the method's messages change (1-bit Adam's dense warm-up before
        its freeze step); ``0``: every step sends the same.
    """

    bench: BenchMethod
    optimizer: str
    lrs: tuple[float, ...]
    sync_every: int | None = None
    outer_compressor: Callable[[], compjax.Compressor] | None = None
    outer: str = "diloco"
    warmup: int = 0

    @property
    def local(self) -> bool:
        """Whether each worker trains its own copy between synchronisations."""
        return self.optimizer == "diloco"

    @property
    def steady(self) -> bool:
        """Whether a few steps time every step: a synchronous method without a warm-up.  The
        others (local steps, a warm-up) run to the target at every rate, since their steps
        differ in cost (the median of a few would be a local or a warm-up step's)."""
        return not self.local and self.warmup == 0

    def local_optimizer(
        self, lr: float, axis_name: str, sync_every: int | None = None
    ) -> optax.GradientTransformation:
        """The local-steps optimizer, a round of ``sync_every`` steps (default
        :attr:`sync_every`), inner AdamW at ``lr``: DiLoCo's Algorithm 1 (outer Nesterov,
        0.7, momentum 0.9) or SparseLoCo as bench-net runs it."""
        h = sync_every or self.sync_every
        if self.outer == "sparseloco":
            return lm.sparseloco_optimizer(axis_name, h, lr)
        comp = None if self.outer_compressor is None else self.outer_compressor()
        return lm.diloco_optimizer(lr, axis_name, h, comp)

    @property
    def key(self) -> str:
        return self.bench.key

    @property
    def label(self) -> str:
        return self.bench.label

    def optax(self, lr: float) -> optax.GradientTransformation:
        """The optimizer that follows the exchange (per-step methods)."""
        return optax.adam(lr) if self.optimizer == "adam" else optax.sgd(lr)


#: Adam's rates (DiLoCo's and SparseLoCo's inner AdamW too), in the order they run: the first
#: runs until the target, the others stop at its steps (see the sweep).  The target's own
#: sweep of dense bf16 kept 5e-4 (after growing its first grid, 1e-3 to 4e-3, downwards).
ADAM_LRS = (5e-4, 1e-3, 2.5e-4)
#: 1-bit Adam's warm-up: dense Adam steps before its variance freezes and 1-bit messages start.
ONEBIT_FREEZE = 50
#: DiLoCo's round, as bench-net times it.
DILOCO_H = lm.DILOCO_H

_BENCH = {m.key: m for m in lm.METHODS}

METHODS: tuple[E2EMethod, ...] = (
    E2EMethod(_BENCH["fp32"], "adam", ADAM_LRS),
    E2EMethod(_BENCH["bf16"], "adam", ADAM_LRS),
    E2EMethod(
        BenchMethod(
            "sign-sg",
            "Signum vote, scatter-gather",
            f"signum(via='scatter_gather', {B})",
            "scatter_gather",
        ),
        "sgd",
        (3e-4, 1e-4, 1e-3),
    ),
    # QSGD with the paper's 512-entry buckets (omega 3.2 at 7 levels, 1/16 bit more per entry).
    # bench-net's qsgd-sg takes one norm per message bucket of 2^22 entries (omega up to
    # sqrt(d)/7 - 1 = 291): its sweep stayed at 2.67-2.75, far from the target, at every rate.
    E2EMethod(
        BenchMethod(
            "qsgd512-sg",
            "QSGD 4-bit, 512-entry buckets, scatter-gather",
            f"compress(qsgd(levels=7, bucket_size=512), exchange='scatter_gather', {B})",
            "scatter_gather",
        ),
        "adam",
        ADAM_LRS,
    ),
    E2EMethod(_BENCH["terngrad"], "adam", ADAM_LRS),
    E2EMethod(_BENCH["topk-sg"], "adam", ADAM_LRS),
    E2EMethod(_BENCH["powersgd"], "adam", ADAM_LRS),
    E2EMethod(
        BenchMethod(
            "onebit-adam",
            "1-bit Adam",
            f"onebit_adam(freeze_step={ONEBIT_FREEZE}, {B})",
            "scatter_gather",
        ),
        "sgd",
        ADAM_LRS,
        warmup=ONEBIT_FREEZE,
    ),
    E2EMethod(
        BenchMethod("diloco", "DiLoCo", "diloco", "allreduce"),
        "diloco",
        ADAM_LRS,
        sync_every=DILOCO_H,
    ),
    E2EMethod(
        BenchMethod("diloco-int8", "DiLoCo, int8 outer gradients", "diloco", "allreduce"),
        "diloco",
        ADAM_LRS,
        sync_every=DILOCO_H,
        outer_compressor=lambda: compjax.int_quant(8),
    ),
    E2EMethod(
        BenchMethod("sparseloco", "SparseLoCo H=15, top-32/4096 2-bit", "sparseloco", "allreduce"),
        "diloco",
        ADAM_LRS,
        sync_every=lm.SPARSELOCO_H,
        outer="sparseloco",
    ),
)
BY_KEY = {m.key: m for m in METHODS}
#: The baselines every speedup is reported against.
BASELINES = ("fp32", "bf16")
#: The method whose validation loss at the token budget is the target.
TARGET_METHOD = "bf16"


def select(keys: list[str] | None) -> tuple[E2EMethod, ...]:
    """The methods named by ``keys`` (all when ``None``), in :data:`METHODS`' order.

    Raises:
      ValueError: an unknown key (the message lists the known ones).
    """
    unknown = [k for k in keys or () if k not in BY_KEY]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(BY_KEY)}")
    wanted = set(keys or BY_KEY)
    return tuple(m for m in METHODS if m.key in wanted)


@functools.lru_cache(maxsize=1)
def rows(length: int = MODEL.length) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` token rows ``(n, length + 1)`` of the pydoc text (no overlap)."""
    dataset = data.characters(length)

    def joined(split):
        return np.concatenate([split.x, split.y[:, -1:]], axis=1).astype(np.int32)

    return joined(dataset.train), joined(dataset.validation)


def batch_rows(train: np.ndarray, seed: int, step: int, worker: int, per_worker: int) -> np.ndarray:
    """The ``per_worker`` rows worker ``worker`` trains on at ``step`` (a draw from the three)."""
    rng = np.random.default_rng([seed, step, worker])
    return train[rng.integers(0, len(train), per_worker)]


def validation_rows(validation: np.ndarray, workers: int) -> np.ndarray:
    """The first :data:`VALIDATION_ROWS` validation windows, cut to a multiple of ``workers``."""
    count = VALIDATION_ROWS - VALIDATION_ROWS % workers
    return validation[:count]


def read_sweep(path: Path = SWEEP_FILE) -> dict:
    """The committed sweep: ``{"target": ..., "budget_steps": ..., "methods": {key: {...}}}``.

    Raises:
      FileNotFoundError: no sweep was committed (run ``--sweep`` first).
    """
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: run `python -m experiments.e2e.run --sweep` first"
        )
    return json.loads(path.read_text())
