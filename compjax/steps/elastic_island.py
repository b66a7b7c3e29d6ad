"""An island of :func:`compjax.elastic.train`: an independent JAX program taking inner steps.

An island holds its own copy of the parameters and its inner optimizer's
state.  Each round it starts from the global parameters ``theta`` of the
round, takes up to ``sync_every`` inner steps on its own batches
(``batches(island, round * sync_every + k)``), and pushes its
pseudo-gradient ``theta - theta_i``, compressed leaf by leaf by the
compressor (its real wire payload; with error feedback for a biased one, as
:func:`compjax.diloco`), with the number of steps it took.  It stops a round
early, pushing what it has, once the synchronizer says the round has its
quorum: a slow island contributes fewer tokens rather than arriving late.

Its inner step (:func:`inner_step`) is a jitted value-and-gradient step of
the inner optimizer on one device, or on ``devices > 1`` a
:func:`compjax.data_parallel` or :func:`compjax.fsdp` step over the
island's own mesh (axis ``"island"``; each batch split over its devices),
so an island may itself be a data-parallel or sharded group.

**Healing.** An island (re)joining asks the synchronizer for the open round
and its parameters, starts its inner optimizer from a fresh ``inner.init``
and its error memory from zeros, and takes part from that round on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from compjax.compressors.dense import identity
from compjax.draws import init_key
from compjax.steps import elastic_faults as faults_
from compjax.steps.data_parallel import data_parallel
from compjax.steps.elastic_rounds import STARTUP_S
from compjax.steps.fsdp import fsdp
from compjax.transforms.compress import compress


@dataclasses.dataclass(frozen=True)
class IslandConfig:
    """What an island is built from (pickled to its process as one object)."""

    loss_fn: Callable[..., jax.Array]
    batches: Callable[[int, int], tuple]
    inner: optax.GradientTransformation
    params: Any  # the user's initial params (numpy): shapes and dtypes of the island's copy
    sync_every: int
    rounds: int
    compressor: Any = None
    error_feedback: bool = False
    faults: tuple = ()
    devices: int = 1
    step: str = "data_parallel"  # the island's step over its devices: or "fsdp"
    seed: int = 0
    timeout_s: float = 300.0


class InnerStep(NamedTuple):
    """An island's inner optimizer: ``place(params)`` puts the params where ``step`` wants
    them, ``init(placed) -> state``, ``step(placed, state, *batch) -> (placed, state)``,
    ``read(placed)`` gives them back in their shapes."""

    place: Callable[[Any], Any]
    init: Callable[[Any], Any]
    step: Callable[..., tuple[Any, Any]]
    read: Callable[[Any], Any]


def _same(tree: Any) -> Any:
    return tree


def inner_step(
    loss_fn, inner: optax.GradientTransformation, params: Any, devices: int, kind: str
) -> InnerStep:
    """The island's inner optimizer step, on one device or on a mesh of ``devices``.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``.
      inner: the inner optimizer.
      params: the parameters (for the mesh step's shapes).
      devices: the island's devices; above 1, a step over a mesh of them
        (axis ``"island"``, each batch split over it).
      kind: that step: ``"data_parallel"`` (:func:`compjax.data_parallel`, the
        gradients averaged exactly) or ``"fsdp"`` (:func:`compjax.fsdp`: the
        params and the inner state split over the devices).

    Returns:
      :class:`InnerStep`.

    Raises:
      ValueError: fewer devices than ``devices``, or ``kind`` unknown.
    """
    if devices == 1:

        def step(p, s, *batch):
            grads = jax.grad(loss_fn)(p, *batch)
            updates, s = inner.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        return InnerStep(_same, jax.jit(inner.init), jax.jit(step), _same)
    if len(jax.devices()) < devices:
        raise ValueError(f"island_devices={devices} but this island sees {len(jax.devices())}")
    mesh = jax.make_mesh((devices,), ("island",), devices=jax.devices()[:devices])
    if kind == "fsdp":
        fs = fsdp(loss_fn, inner, params, mesh, axis_name="island")
        return InnerStep(fs.shard, fs.init, lambda p, s, *b: fs.step(p, s, *b)[:2], fs.unpad)
    if kind != "data_parallel":
        raise ValueError(f"island_step must be 'data_parallel' or 'fsdp', got {kind!r}")
    exact = optax.chain(compress(identity(), "island"), inner)
    dp = data_parallel(loss_fn, exact, params, mesh, axis_name="island")
    return InnerStep(_same, dp.init, lambda p, s, *b: dp.step(p, s, *b)[:2], _same)


class IslandCore:
    """One island's state and its rounds (no Ray: :class:`Island` drives it)."""

    def __init__(self, config: IslandConfig, island: int):
        self.config, self.island = config, island
        self.dtypes = jax.tree.map(lambda a: jnp.asarray(a).dtype, config.params)
        self.inner = inner_step(
            config.loss_fn, config.inner, config.params, config.devices, config.step
        )
        self.inner_state = None
        self.error = None
        self.slow = faults_.slow_factor(config.faults, island)
        self.tokens = 0

    def heal(self, theta: Any) -> None:
        """Fresh inner state and zero error memory, for a (re)joining island."""
        self.inner_state = self.inner.init(self.inner.place(self.local(theta)))
        self.error = jax.tree.map(np.zeros_like, theta) if self.config.error_feedback else None

    def local(self, theta: Any) -> Any:
        """``theta`` in the island's parameter dtypes."""
        return jax.tree.map(lambda t, d: jnp.asarray(t).astype(d), theta, self.dtypes)

    def train(self, theta: Any, round_: int, stop: Callable[[], bool]) -> tuple[Any, int]:
        """Up to ``sync_every`` inner steps from ``theta``; ``(pseudo-gradient, steps)``.

        ``stop()`` is asked after each step; True ends the round early.

        Raises:
          RuntimeError: ``batches`` raised (the island, step and error named).
        """
        params, taken = self.inner.place(self.local(theta)), 0
        for k in range(self.config.sync_every):
            t = round_ * self.config.sync_every + k
            try:
                batch = self.config.batches(self.island, t)
            except Exception as err:
                raise RuntimeError(
                    f"island {self.island}: batches({self.island}, {t}) raised "
                    f"{type(err).__name__}: {err}"
                ) from err
            start = time.perf_counter()
            params, self.inner_state = self.inner.step(params, self.inner_state, *batch)
            jax.block_until_ready(params)
            if self.slow > 1:
                time.sleep((self.slow - 1) * (time.perf_counter() - start))
            taken += 1
            if k + 1 < self.config.sync_every and stop():
                break
        self.tokens += taken
        params = self.inner.read(params)
        delta = jax.tree.map(
            lambda th, p: np.asarray(th, np.float32) - np.asarray(p.astype(jnp.float32)),
            theta, params,
        )  # fmt: skip
        scale = faults_.poison_scale(self.config.faults, self.island, round_)
        if scale is not None:
            delta = jax.tree.map(lambda d: (d * np.float32(scale)).astype(np.float32), delta)
        return delta, taken

    def message(self, delta: Any, round_: int) -> Any:
        """What is pushed: float32 arrays, or one payload per leaf (with error feedback)."""
        comp = self.config.compressor
        if comp is None:
            return delta
        if self.error is not None:
            delta = jax.tree.map(np.add, delta, self.error)
        key = jax.random.fold_in(init_key(self.config.seed), self.island)
        leaves, treedef = jax.tree.flatten(delta)
        keys = jax.random.split(jax.random.fold_in(key, round_), len(leaves))
        payloads = [
            jax.device_get(comp.compress(k, jnp.asarray(x)))
            for k, x in zip(keys, leaves, strict=True)
        ]
        if self.error is not None:
            decoded = [np.asarray(comp.decompress(p), np.float32) for p in payloads]
            self.error = treedef.unflatten([x - d for x, d in zip(leaves, decoded, strict=True)])
        return treedef.unflatten(payloads)


class Island:
    """The Ray actor of one island (``ray.remote(Island)``): :meth:`run` until the last round."""

    def __init__(self, config: IslandConfig, island: int, incarnation: int):
        self.core = IslandCore(config, island)
        self.incarnation = incarnation

    def run(self, sync) -> dict:
        """Join, then train, push and pull round after round; returns what it did.

        Every wait on the synchronizer has twice the config's ``timeout_s`` (the
        driver, which waits ``timeout_s``, reports a stuck round first).

        Raises:
          TimeoutError: the synchronizer did not answer within ``timeout_s``.
          RuntimeError: ``batches`` raised.
        """
        import ray

        core, config = self.core, self.core.config
        island = core.island
        kill = faults_.kill_round(config.faults, island) if self.incarnation == 0 else None

        def get(ref, timeout_s=2 * config.timeout_s):  # the driver's timeout fires first
            try:
                return ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError as err:
                raise TimeoutError(
                    f"island {island}: the synchronizer did not answer in {timeout_s} s"
                ) from err

        round_, theta = get(sync.join.remote(island), config.timeout_s + STARTUP_S)
        core.heal(theta)
        pushed = 0
        while round_ < config.rounds:
            if kill is not None and round_ >= kill:
                os._exit(1)  # the Kill fault
            closing = sync.closing.remote(round_)

            def stop(ref=closing) -> bool:
                return bool(ray.wait([ref], timeout=0)[0])

            delta, taken = core.train(theta, round_, stop)
            message = core.message(delta, round_)
            while True:
                status = get(sync.push.remote(island, round_, message, taken))
                pushed += 1
                reply = get(sync.next_params.remote(island, round_, status == "pending"))
                if reply is not None:
                    break
            round_, theta = reply
        devices = len(jax.devices()) if config.devices > 1 else 1
        return {"island": island, "incarnation": self.incarnation, "tokens": core.tokens,
                "pushes": pushed, "devices": devices}  # fmt: skip
