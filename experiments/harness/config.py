"""A training run's configuration: its fields, their checks and its results directory.

:meth:`Config.resolved` checks every field before anything runs or is
written: first its type, against the dataclass's own annotations
(:func:`field_types`; an ``int`` passes for a ``float``, a ``bool`` for
neither), then its range; the error is one line naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from pathlib import Path

import jax

from compjax import costmodel
from experiments.common import methods
from experiments.harness import tasks

RESULTS = Path("results")


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run.  ``None`` fields take the task's defaults.

    Attributes:
      task: a name in :data:`experiments.harness.tasks.TASKS`.
      method: a method expression (:mod:`experiments.common.methods`).
      workers: data-parallel workers (devices of the mesh).
      steps: optimizer steps.
      seed: seeds the initialisation, the data split, the batches and the method.
      lr: learning rate of the SGD that follows the exchange (in (0, 1000]).
      momentum: its momentum (0: none; None: the task's).
      batch_size: examples per worker per step (0: the whole shard).
      eval_every: steps between evaluations (and the length of one jitted scan).
      checkpoint_every: steps between checkpoints (rounded up to ``eval_every``).
      bandwidth_gbps: link bandwidth of the cost model (in (0, 1e6]).
      latency_us: per-message latency of the cost model (in [0, 1e6]).
    """

    task: str = "digits_mlp"
    method: str = "dense()"
    workers: int = 8
    steps: int | None = None
    seed: int = 0
    lr: float | None = None
    momentum: float | None = None
    batch_size: int | None = None
    eval_every: int = 10
    checkpoint_every: int = 200
    bandwidth_gbps: float = 10.0
    latency_us: float = 5.0

    def resolved(self) -> Config:
        """Task defaults filled in, every field checked.

        Raises:
          TypeError: a field of the wrong type, naming it and the type it takes.
          ValueError: a field out of range, naming it.
        """
        cfg = checked_types(self)
        task = tasks.get(cfg.task)
        methods.parse(cfg.method)
        cfg = dataclasses.replace(
            cfg,
            steps=task.steps if cfg.steps is None else cfg.steps,
            lr=task.lr if cfg.lr is None else cfg.lr,
            momentum=task.momentum if cfg.momentum is None else cfg.momentum,
            batch_size=(task.batch_size or 0) if cfg.batch_size is None else cfg.batch_size,
        )
        check_ranges(cfg)
        return cfg

    def run_dir(self, root: Path = RESULTS) -> Path:
        """``root/<task>/<method>-w<workers>-s<seed>-<hash>``.

        The hash covers the resolved config and :func:`code_version`, so a
        change to the library or the harness never reads back stale results.
        """
        cfg = self.resolved()
        text = json.dumps(dataclasses.asdict(cfg), sort_keys=True) + code_version()
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        name = f"{methods.slug(cfg.method)}-w{cfg.workers}-s{cfg.seed}-{digest}"
        return Path(root) / cfg.task / name


@functools.cache
def field_types() -> dict[str, tuple[type, ...]]:
    """Each field's accepted types from :class:`Config`'s annotations (``int | None``:
    ``(int, NoneType)``)."""
    hints = typing.get_type_hints(Config)
    return {
        f.name: typing.get_args(hints[f.name]) or (hints[f.name],)
        for f in dataclasses.fields(Config)
    }


def _accepts(kinds: tuple[type, ...], value) -> bool:
    if isinstance(value, bool):  # a JSON/TOML true is not the number 1
        return bool in kinds
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


def checked_types(cfg: Config) -> Config:
    """``cfg`` with ints in float fields made floats; ``TypeError`` on a field of another type."""
    floats = {}
    for name, kinds in field_types().items():
        value = getattr(cfg, name)
        if not _accepts(kinds, value):
            expected = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
        if float in kinds and isinstance(value, int):
            floats[name] = float(value)
    return dataclasses.replace(cfg, **floats)


#: Inclusive bounds of the integer fields (``None``: unbounded).
RANGES = {
    "workers": (1, None),
    "steps": (1, None),
    "seed": (0, 2**32 - 1),  # numpy's and scikit-learn's seeds
    "batch_size": (0, None),
    "eval_every": (1, None),
    "checkpoint_every": (1, None),
}


#: Bounds ``(low, high]`` of the float fields: beyond them a value is a typo, not a setting (a
#: learning rate of 1e308 or Inf trains to NaN; a link of Inf Gbit/s makes every message free).
FLOAT_RANGES = {
    "lr": (0.0, 1e3),
    "bandwidth_gbps": (0.0, 1e6),  # 1 Pbit/s
}
#: The largest ``latency_us`` (one second per message).
LATENCY_US_MAX = 1e6


def check_ranges(cfg: Config) -> None:
    """``ValueError`` naming the first field of a resolved config out of its range."""
    for name, (least, most) in RANGES.items():
        value = getattr(cfg, name)
        if value < least or (most is not None and value > most):
            bound = f">= {least}" if most is None else f"in [{least}, {most}]"
            raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    for name, (low, high) in FLOAT_RANGES.items():
        value = getattr(cfg, name)
        if not low < value <= high:  # NaN and Inf fail too
            raise ValueError(f"{name} must be a finite number in ({low:g}, {high:g}], got {value}")
    if not 0 <= cfg.momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {cfg.momentum}")
    if not 0 <= cfg.latency_us <= LATENCY_US_MAX:
        raise ValueError(
            f"latency_us must be a finite number in [0, {LATENCY_US_MAX:g}], got {cfg.latency_us}"
        )
    if cfg.workers > len(jax.devices()):
        raise ValueError(
            f"workers={cfg.workers} exceeds the {len(jax.devices())} devices; on a CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count before importing jax"
        )
    costmodel.Network(cfg.bandwidth_gbps, cfg.latency_us)


@functools.cache
def code_version() -> str:
    """A hash of the sources a run depends on: ``compjax/`` and the harness modules."""
    here = Path(__file__).parent
    files = sorted(here.parents[1].joinpath("compjax").rglob("*.py"))
    files += [here / f"{m}.py" for m in ("train", "config", "problem", "runlog", "tasks")]
    files += [here.parent / "common" / f"{m}.py" for m in ("data", "models", "methods")]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:12]
