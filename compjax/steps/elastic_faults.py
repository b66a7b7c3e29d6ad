"""The faults :func:`compjax.elastic.train` can inject, for tests and benchmarks.

Chaos engineering, as Decoupled DiLoCo evaluates itself: each fault is a
frozen dataclass naming an island (``0 <= island < islands``) or the
synchronizer and a round; :func:`check_faults` refuses a fault that could
not happen (``ValueError`` naming the field), and the functions below are
the only places the islands and the synchronizer read them.

* :class:`Kill`: the island's process exits (``os._exit``) as it starts
  round ``at_round``; with ``restart_at_round`` a fresh process for that
  island is started once the global round reaches it, and heals
  (:mod:`compjax.steps.elastic_island`).
* :class:`Slow`: the island sleeps ``factor - 1`` times each inner step's
  measured time after it, so it runs ``factor`` times slower.
* :class:`Poison`: from round ``from_round`` on, the island's
  pseudo-gradient is multiplied by ``scale`` before it is compressed
  (``float("nan")`` sends NaN).
* :class:`KillSynchronizer`: the synchronizer's process exits when round
  ``at_round`` has every push it waits for, before merging it; Ray restarts
  it and it resumes from its last checkpoint.

References:
  Douillard et al., "Decoupled DiLoCo: Resilient, Asynchronous Distributed
  Training at Scale", 2026 (evaluation under injected failures).
"""

from __future__ import annotations

import dataclasses
import math


def _check_index(name: str, value, low: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Kill:
    """Island ``island``'s process exits as it starts round ``at_round``.

    Attributes:
      island: the island.
      at_round: the round it dies at (its push for that round never happens).
      restart_at_round: once the global round reaches it, a new process for
        the island starts and heals; ``None``: it stays dead.
    """

    island: int
    at_round: int
    restart_at_round: int | None = None

    def __post_init__(self):
        _check_index("Kill.island", self.island)
        _check_index("Kill.at_round", self.at_round)
        if self.restart_at_round is not None:
            _check_index("Kill.restart_at_round", self.restart_at_round, self.at_round + 1)


@dataclasses.dataclass(frozen=True)
class Slow:
    """Island ``island`` runs ``factor`` times slower (``factor >= 1``)."""

    island: int
    factor: float

    def __post_init__(self):
        _check_index("Slow.island", self.island)
        if not (isinstance(self.factor, int | float) and math.isfinite(self.factor)):
            raise ValueError(f"Slow.factor must be a finite number >= 1, got {self.factor!r}")
        if self.factor < 1:
            raise ValueError(f"Slow.factor must be >= 1, got {self.factor!r}")


@dataclasses.dataclass(frozen=True)
class Poison:
    """Island ``island`` sends ``scale`` times its pseudo-gradient from round ``from_round`` on."""

    island: int
    scale: float
    from_round: int = 0

    def __post_init__(self):
        _check_index("Poison.island", self.island)
        _check_index("Poison.from_round", self.from_round)
        if not isinstance(self.scale, int | float) or isinstance(self.scale, bool):
            raise ValueError(f"Poison.scale must be a number (NaN allowed), got {self.scale!r}")


@dataclasses.dataclass(frozen=True)
class KillSynchronizer:
    """The synchronizer's process exits before merging round ``at_round`` (once)."""

    at_round: int

    def __post_init__(self):
        _check_index("KillSynchronizer.at_round", self.at_round)


FAULTS = (Kill, Slow, Poison, KillSynchronizer)


def check_faults(faults, islands: int, rounds: int) -> tuple:
    """``faults`` as a tuple, checked against the run.

    Args:
      faults: an iterable of :data:`FAULTS` instances.
      islands: the number of islands.
      rounds: the number of rounds.

    Returns:
      The faults, as a tuple.

    Raises:
      ValueError: a fault of another type, an island outside ``range(islands)``,
        a round outside ``range(rounds)`` (a restart may be ``rounds - 1`` at
        the latest), two faults of one kind on one island, or two
        ``KillSynchronizer``.
    """
    faults = tuple(faults)
    seen = set()
    for fault in faults:
        if not isinstance(fault, FAULTS):
            names = ", ".join(f.__name__ for f in FAULTS)
            raise ValueError(f"faults must hold {names}; got {fault!r}")
        island = getattr(fault, "island", None)
        if island is not None and island >= islands:
            raise ValueError(f"{fault!r}: island must be < islands = {islands}")
        for name in ("at_round", "from_round", "restart_at_round"):
            value = getattr(fault, name, None)
            if value is not None and value >= rounds:
                raise ValueError(f"{fault!r}: {name} must be < rounds = {rounds}")
        kind = (type(fault), island)
        if kind in seen:
            raise ValueError(f"faults: two {type(fault).__name__} faults for island {island}")
        seen.add(kind)
    return faults


def _one(faults, kind, island=None):
    for fault in faults:
        if isinstance(fault, kind) and getattr(fault, "island", None) == island:
            return fault
    return None


def kill_round(faults, island: int) -> int | None:
    """The round at which island ``island``'s first process dies, or ``None``."""
    fault = _one(faults, Kill, island)
    return None if fault is None else fault.at_round


def restart_round(faults, island: int) -> int | None:
    """The global round from which a killed island is started again, or ``None``."""
    fault = _one(faults, Kill, island)
    return None if fault is None else fault.restart_at_round


def slow_factor(faults, island: int) -> float:
    """How many times slower island ``island`` runs (1.0: not slowed)."""
    fault = _one(faults, Slow, island)
    return 1.0 if fault is None else float(fault.factor)


def poison_scale(faults, island: int, round_: int) -> float | None:
    """The factor on island ``island``'s pseudo-gradient in round ``round_``, or ``None``."""
    fault = _one(faults, Poison, island)
    return None if fault is None or round_ < fault.from_round else float(fault.scale)


def synchronizer_kill_round(faults) -> int | None:
    """The round before whose merge the synchronizer dies, or ``None``."""
    fault = _one(faults, KillSynchronizer)
    return None if fault is None else fault.at_round
