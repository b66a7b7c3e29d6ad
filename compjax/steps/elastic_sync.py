"""The synchronizer of :func:`compjax.elastic.train`: global parameters, outer state, round.

:class:`SyncCore` is the synchronizer's logic as a plain object (tested
without Ray): islands :meth:`~SyncCore.push` contributions (compressed
pseudo-gradient payloads, decoded here), a round merges by the rules of
:mod:`compjax.steps.elastic_rounds`, and every merge is saved with orbax
before anyone is told of it (:meth:`~SyncCore.save`), so a synchronizer
restarted from its checkpoint directory has lost no merged round.
:class:`Synchronizer` is the Ray actor around it (asyncio: the islands'
waits are coroutines, the merges run one at a time in its event loop).

A push the synchronizer does not merge is recorded: ``refused`` when it
holds a NaN or Inf (it never reaches the parameters, whatever the merge),
``dropped`` when it is staler than :data:`~compjax.steps.elastic_rounds.MAX_STALENESS`.
A late contribution waiting for the next round is lost if the synchronizer
dies before that merge; an on-time one is sent again by its island, which
asks after its round (:meth:`Synchronizer.next_params`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from compjax.merges import merger
from compjax.payload import wire_bits
from compjax.steps import elastic_rounds as rules


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """What the synchronizer is built from (pickled to its process as one object)."""

    params: Any  # the initial global parameters (float32 numpy)
    outer: optax.GradientTransformation
    rounds: int
    islands: int
    min_quorum: int
    grace_s: float | None
    merge: str
    trim: float
    compressor: Any  # a compjax Compressor, or None (float32 pseudo-gradients)
    checkpoint_dir: str
    started_at: float  # time.time() at the start of the run
    kill_at_round: int | None = None
    evaluate: Any = None  # params -> float, or None


@dataclasses.dataclass
class Contribution:
    island: int
    base_round: int
    delta: Any  # the decoded pseudo-gradient (float32 numpy tree)
    tokens: int
    bits: int


def decode(compressor, message: Any) -> tuple[Any, int]:
    """A pushed message as a float32 tree and its wire bits.

    ``message`` is a tree of compjax payloads (one per leaf) or, without a
    compressor, of float32 arrays (32 bits per entry).
    """
    if compressor is None:
        delta = rules.as_float32(message)
        return delta, 32 * sum(int(np.size(a)) for a in jax.tree.leaves(delta))
    payloads = jax.tree.leaves(message, is_leaf=lambda x: hasattr(x, "wire"))
    bits = sum(wire_bits(p) for p in payloads)
    decoded = [np.asarray(compressor.decompress(p), np.float32) for p in payloads]
    return jax.tree.unflatten(
        jax.tree.structure(message, is_leaf=lambda x: hasattr(x, "wire")), decoded
    ), bits


class SyncCore:
    """The synchronizer's state and rules; see the module docstring."""

    def __init__(self, config: SyncConfig):
        self.config = config
        self.merge_fn = merger(config.merge, config.trim)
        self.theta = rules.as_float32(config.params)
        self.outer_state = config.outer.init(self.theta)
        self.round = 0
        self.history: list[rules.Round] = []
        self.live = set(range(config.islands))
        self.pending: dict[int, Contribution] = {}  # on time, by island
        self.late: list[Contribution] = []
        self.dropped: list[int] = []
        self.refused: list[int] = []
        self.bits = 0
        self.opened = time.monotonic()
        self.quorum_at: float | None = None
        self.restored = self.restore()
        if not self.restored:
            self.save()

    # -- pushes -------------------------------------------------------------------------------
    def push(self, island: int, base_round: int, message: Any, tokens: int) -> str:
        """Take island ``island``'s contribution computed from round ``base_round``'s params.

        Returns:
          ``"pending"`` (waits for this round's merge), ``"late"`` (merged
          into this round with the staleness weight), ``"dropped"``,
          ``"refused"`` (non-finite) or ``"finished"`` (every round merged).
        """
        if self.round >= self.config.rounds:
            return "finished"
        delta, bits = decode(self.config.compressor, message)
        self.bits += bits
        if not rules.finite(delta):
            self.refused.append(island)
            self._count_answers()
            return "refused"
        contribution = Contribution(island, base_round, delta, int(tokens), bits)
        if base_round == self.round:
            self.pending[island] = contribution
            self._count_answers()
            return "pending"
        if rules.weight(tokens, self.round - base_round) is None:
            self.dropped.append(island)
            return "dropped"
        self.late.append(contribution)
        return "late"

    def answered(self) -> set[int]:
        """The islands that pushed for the open round, refused pushes included."""
        return set(self.pending) | set(self.refused)

    def _count_answers(self) -> None:
        if self.quorum_at is None and len(self.answered()) >= self.config.min_quorum:
            self.quorum_at = time.monotonic()

    def ready(self) -> bool:
        """Whether the open round merges now (:func:`~compjax.steps.elastic_rounds.grace_over`)."""
        if self.round >= self.config.rounds or self.quorum_at is None:
            return False
        now = time.monotonic()
        answered = self.answered()
        return rules.grace_over(
            len(answered), len(self.live | answered), self.config.min_quorum, self.config.grace_s,
            now - self.quorum_at, self.quorum_at - self.opened,
        )  # fmt: skip

    def merge(self) -> rules.Round:
        """Merge the open round, save, and open the next; returns its record."""
        on_time = [self.pending[i] for i in sorted(self.pending)]
        contributions = on_time + sorted(self.late, key=lambda c: (c.island, c.base_round))
        weights = [rules.weight(c.tokens, self.round - c.base_round) for c in contributions]
        rows = 2 * self.config.islands
        if contributions:  # else every push was refused: the parameters stay as they are
            deltas, w = rules.stacked([c.delta for c in contributions][:rows], weights[:rows], rows)
            self.theta, self.outer_state = jax.device_get(
                rules.merge_and_step(
                    self.theta, self.outer_state, deltas, w, self.merge_fn, self.config.outer
                )
            )
        evaluate = self.config.evaluate
        record = rules.Round(
            round=self.round,
            merged=tuple(c.island for c in on_time),
            late=tuple(c.island for c in contributions[len(on_time) :]),
            dropped=tuple(self.dropped),
            refused=tuple(self.refused),
            tokens=tuple(c.tokens for c in contributions),
            wall_s=time.time() - self.config.started_at,
            bits=int(self.bits),
            evaluation=None if evaluate is None else float(evaluate(self.theta)),
        )
        self.history.append(record)
        self.round += 1
        self.pending, self.late, self.dropped, self.refused, self.bits = {}, [], [], [], 0
        self.opened, self.quorum_at = time.monotonic(), None
        self.save()
        return record

    # -- checkpoints --------------------------------------------------------------------------
    def _path(self, round_: int) -> Path:
        return Path(self.config.checkpoint_dir) / f"round_{round_:06d}"

    def save(self) -> None:
        """The parameters, outer state and history as of the open round, with orbax.

        The history (JSON) is written after the arrays and names the round, so
        a checkpoint without it is incomplete and skipped by :meth:`restore`.
        Older checkpoints than the previous one are deleted.
        """
        import orbax.checkpoint as ocp

        path = self._path(self.round)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path / "state", {"theta": self.theta, "outer": self.outer_state},
                              force=True)  # fmt: skip
        records = [r._asdict() for r in self.history]
        tmp = path / "history.json.tmp"
        tmp.write_text(json.dumps({"round": self.round, "history": records}))
        os.replace(tmp, path / "history.json")
        for old in Path(self.config.checkpoint_dir).glob("round_*"):
            if old.name < self._path(self.round - 1).name:
                _remove_tree(old)

    def restore(self) -> bool:
        """Resume from the newest complete checkpoint in the directory; False if there is none."""
        import orbax.checkpoint as ocp

        root = Path(self.config.checkpoint_dir)
        complete = sorted(p for p in root.glob("round_*") if (p / "history.json").exists())
        if not complete:
            root.mkdir(parents=True, exist_ok=True)
            return False
        path = complete[-1]
        saved = json.loads((path / "history.json").read_text())
        target = {"theta": self.theta, "outer": self.outer_state}
        with ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(path / "state", jax.tree.map(np.asarray, target))
        self.theta = rules.as_float32(state["theta"])
        self.outer_state = jax.tree.map(np.asarray, state["outer"])
        self.outer_state = jax.tree.unflatten(
            jax.tree.structure(target["outer"]), jax.tree.leaves(self.outer_state)
        )
        self.round = int(saved["round"])
        self.history = [rules.Round.from_json(r) for r in saved["history"]]
        return True


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


class Synchronizer:
    """The Ray actor around :class:`SyncCore` (``ray.remote(Synchronizer)``; asyncio)."""

    def __init__(self, config: SyncConfig):
        self.core = SyncCore(config)
        self.changed = asyncio.Condition()
        self.restarted = self.core.restored  # a KillSynchronizer fault fires once
        self.timer: asyncio.TimerHandle | None = None

    async def _settle(self) -> None:
        core = self.core
        if core.ready():
            kill = core.config.kill_at_round
            if kill is not None and core.round == kill and not self.restarted:
                os._exit(1)  # the KillSynchronizer fault: die holding the round's pushes
            core.merge()
        elif core.quorum_at is not None and self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(
                0.05, lambda: asyncio.ensure_future(self.poke())
            )
        async with self.changed:
            self.changed.notify_all()

    async def poke(self) -> None:
        """Re-check the open round (the grace timer)."""
        self.timer = None
        await self._settle()

    async def join(self, island: int) -> tuple[int, Any]:
        """Island ``island`` (re)joins: the open round and its parameters."""
        self.core.live.add(island)
        return self.core.round, self.core.theta

    async def leave(self, island: int) -> None:
        """Island ``island`` is gone: the open round stops waiting for it."""
        self.core.live.discard(island)
        await self._settle()

    async def push(self, island: int, base_round: int, message: Any, tokens: int) -> str:
        """:meth:`SyncCore.push`, then merge if the round is ready."""
        status = self.core.push(island, base_round, message, tokens)
        await self._settle()
        return status

    async def closing(self, round_: int) -> bool:
        """Returns once round ``round_`` has its quorum or has merged."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: self.core.round > round_ or self.core.quorum_at is not None
            )
        return True

    async def next_params(self, island: int, round_: int, pending: bool) -> tuple[int, Any] | None:
        """After island ``island`` pushed for round ``round_``: the next round and its params.

        Returns ``None`` when the push was ``pending`` but the open round is
        ``round_`` and holds no push of the island (the synchronizer restarted
        since): the island pushes again.
        """
        core = self.core
        if pending and core.round == round_ and island not in core.pending:
            return None
        async with self.changed:
            await self.changed.wait_for(lambda: core.round > round_)
        return core.round, core.theta

    async def status(self) -> dict:
        """The open round, who pushed for it, who is live, and the records so far."""
        core = self.core
        return {"round": core.round, "pending": sorted(core.pending), "live": sorted(core.live),
                "history": list(core.history)}  # fmt: skip

    async def result(self) -> tuple[Any, list]:
        """The global parameters and the history."""
        return self.core.theta, list(self.core.history)
